//! The freshness bound (issue 38): what proving it costs the broker, how
//! soon after a partition a bounded node's reads go to the source, and
//! whether it slows applies.
//!
//! ```text
//! cargo bench -p integration-tests --features redis,nats --bench freshness
//! ```
//!
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a short smoke pass of the same code.
//!
//! Method:
//! - **Cost.** 16 nodes on Redis Streams, each with its own client, idle
//!   for a while with the proof every second (the default) and with none
//!   (`freshness_interval(Duration::MAX)`), heartbeats off, taking turns: the extra
//!   commands Redis processed (`INFO stats`), per node per second, and the
//!   records added to the topic (none: the proof puts nothing there).
//!   Then 1,000 nodes in one process on the embedded transport, each
//!   behind a counting wrapper: tails asked per node per second.
//! - **Partition to bypass.** One node per transport reads through the
//!   harness's fault proxy, its table bounded by `max_staleness(1 s)` and
//!   proved every 100 ms; a reader reads every millisecond. The proxy cuts
//!   the link both ways without a reset; the figure is the time from the
//!   cut to the first read that bypassed the cache. Target: at most the
//!   bound plus one interval (1.1 s).
//! - **Applies.** One publisher on Redis Streams, four nodes proving every
//!   100 ms with a bounded table and four with no proof and no bound, all
//!   on one topic; events go out one at a time, each once every node
//!   applied the last, and each node's publish → applied latency is its own
//!   figure (`last_latency_us`). Target: p99 with the bound ≤ 1.05× without.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cache_sync::transport::{
    EmbeddedTransport, FaultyTransport, NatsJetStreamTransport, RedisPubSubTransport,
    RedisStreamsTransport, Transport,
};
use cache_sync::{Node, Publisher, SyncedCache};
use hdrhistogram::Histogram;
use integration_tests::nats_server::NatsServer;
use integration_tests::proxy::Proxy;
use integration_tests::redis_server::RedisServer;

#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Nodes on Redis for the cost rows.
    nodes: usize,
    /// Simulated nodes on the embedded transport.
    simulated: usize,
    /// How long each cost row idles.
    idle: Duration,
    /// Partitions per transport.
    cuts: usize,
    /// Paced events per group.
    events: u64,
}

const BOUND: Duration = Duration::from_secs(1);
const EVERY: Duration = Duration::from_millis(100);

fn bounded_cache(name: &str) -> SyncedCache<String, String> {
    SyncedCache::builder(name, moka::future::Cache::new(1000))
        .max_staleness(BOUND)
        .build()
        .expect("a bounded cache")
}

fn total_commands(server: &RedisServer) -> u64 {
    let info = server
        .query(&["INFO", "stats"])
        .expect("INFO")
        .text()
        .expect("INFO's text");
    info.lines()
        .find_map(|l| l.strip_prefix("total_commands_processed:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("total_commands_processed")
}

fn stream_length(server: &RedisServer, topic: &str) -> u64 {
    let reply = server
        .command(&["XLEN", &format!("cache-sync:{{{topic}}}")])
        .expect("XLEN");
    reply
        .trim()
        .strip_prefix(':')
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Extra Redis commands per node per second, and records added to the
/// topic, for `nodes` idle nodes proving every `every`.
async fn redis_cost(
    server: &RedisServer,
    nodes: usize,
    every: Duration,
    idle: Duration,
) -> (f64, u64) {
    let topic = format!("cost-{}", every.as_millis().min(1_000_000));
    let mut running = Vec::new();
    for i in 0..nodes {
        let transport = RedisStreamsTransport::connect(server.url())
            .await
            .expect("connect");
        let cache = bounded_cache("c");
        let node = Node::builder(format!("n{i}"), transport)
            .topic(&topic)
            .heartbeat_interval(Duration::MAX)
            .freshness_interval(every)
            .register(&cache)
            .start()
            .await
            .expect("node");
        running.push((node, cache));
    }
    // Past the start-up requests.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (commands, length) = (total_commands(server), stream_length(server, &topic));
    let start = Instant::now();
    tokio::time::sleep(idle).await;
    let per_node_second =
        (total_commands(server) - commands) as f64 / nodes as f64 / start.elapsed().as_secs_f64();
    let added = stream_length(server, &topic) - length;
    for (node, _) in running {
        node.shutdown().await.expect("shutdown");
    }
    (per_node_second, added)
}

/// Tails asked per node per second by `nodes` nodes on one embedded
/// transport, and the records they added to the topic.
async fn simulated_cost(nodes: usize, idle: Duration) -> (f64, u64) {
    let embedded = EmbeddedTransport::new();
    let counting = FaultyTransport::new(embedded.clone());
    let mut running = Vec::new();
    for i in 0..nodes {
        let cache = bounded_cache("c");
        // No heartbeats: every node hears every other's, a cost that
        // grows with the square of the nodes and is not the proof's.
        let node = Node::builder(format!("n{i}"), counting.clone())
            .heartbeat_interval(Duration::MAX)
            .register(&cache)
            .start()
            .await
            .expect("node");
        running.push((node, cache));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let end = |t: Option<cache_sync::transport::Position>| t.map(|p| p.to_string());
    let before = (
        counting.tails_asked(),
        end(embedded.tail("cache-sync").await.expect("tail")),
    );
    let start = Instant::now();
    tokio::time::sleep(idle).await;
    let asked = counting.tails_asked() - before.0;
    let after = end(embedded.tail("cache-sync").await.expect("tail"));
    let rate = asked as f64 / nodes as f64 / start.elapsed().as_secs_f64();
    for (node, _) in running {
        node.shutdown().await.expect("shutdown");
    }
    (rate, u64::from(after != before.1))
}

/// Times from a cut to the first bypassed read, for `cuts` cuts.
async fn partition_to_bypass(
    name: &str,
    proxy: &Proxy,
    transport: Arc<dyn Transport>,
    cuts: usize,
) -> Histogram<u64> {
    let mut took = Histogram::<u64>::new_with_bounds(1, 600_000, 3).expect("histogram");
    let cache = bounded_cache("c");
    let node = Node::builder(format!("bypass-{name}"), transport)
        .topic(format!("bypass-{name}"))
        .freshness_interval(EVERY)
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(250))
        .register(&cache)
        .start()
        .await
        .expect("node");
    let reading = Arc::new(AtomicBool::new(true));
    let reader = {
        let (cache, reading) = (cache.clone(), reading.clone());
        tokio::spawn(async move {
            while reading.load(Ordering::Relaxed) {
                let _ = cache.get("k").await;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    for _ in 0..cuts {
        // Young again after the last cut.
        let deadline = Instant::now() + Duration::from_secs(30);
        while node.status().freshness_age_ms.is_none_or(|a| a >= 300) {
            assert!(Instant::now() < deadline, "{name}: never proved young");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let bypassed = cache.status().stale_bypasses;
        proxy.blackhole();
        let cut = Instant::now();
        while cache.status().stale_bypasses == bypassed {
            assert!(
                cut.elapsed() < Duration::from_secs(30),
                "{name}: never bypassed"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        took.record(cut.elapsed().as_millis() as u64)
            .expect("record");
        proxy.heal();
    }
    reading.store(false, Ordering::Relaxed);
    reader.await.expect("reader");
    node.shutdown().await.expect("shutdown");
    took
}

/// Publish → applied latency, µs, for nodes with the bound and without.
async fn applies(server: &RedisServer, events: u64) -> (Histogram<u64>, Histogram<u64>) {
    let topic = "applies";
    let mut groups: [Vec<(Node, SyncedCache<String, String>)>; 2] = [Vec::new(), Vec::new()];
    for bounded in [true, false] {
        for i in 0..4 {
            let transport = RedisStreamsTransport::connect(server.url())
                .await
                .expect("connect");
            let (cache, every) = if bounded {
                (bounded_cache("bench"), EVERY)
            } else {
                (
                    SyncedCache::new("bench", moka::future::Cache::new(1000)),
                    Duration::MAX,
                )
            };
            let node = Node::builder(format!("{bounded}-{i}"), transport)
                .topic(topic)
                .freshness_interval(every)
                .register(&cache)
                .start()
                .await
                .expect("node");
            groups[usize::from(!bounded)].push((node, cache));
        }
    }
    let publisher = Publisher::builder(
        RedisStreamsTransport::connect(server.url())
            .await
            .expect("connect"),
    )
    .topic(topic)
    .build()
    .expect("publisher");
    let mut latency = [
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
        Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram"),
    ];
    let warmup = events / 10;
    for i in 0..events + warmup {
        publisher
            .insert("bench", [("k", i.to_string())])
            .await
            .expect("publish");
        let want = i + 1;
        for (g, group) in groups.iter().enumerate() {
            for (_, cache) in group {
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    let s = cache.status();
                    if s.events_applied >= want {
                        if i >= warmup {
                            latency[g]
                                .record(s.last_latency_us.unwrap_or(0).max(1))
                                .expect("record");
                        }
                        break;
                    }
                    assert!(Instant::now() < deadline, "event {i} never applied");
                    tokio::task::yield_now().await;
                }
            }
        }
    }
    for group in groups {
        for (node, _) in group {
            node.shutdown().await.expect("shutdown");
        }
    }
    let [on, off] = latency;
    (on, off)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sizes = if args.iter().any(|a| a == "--bench") {
        Sizes {
            nodes: 16,
            simulated: 1000,
            idle: Duration::from_secs(10),
            cuts: 10,
            events: 2000,
        }
    } else {
        Sizes {
            nodes: 2,
            simulated: 20,
            idle: Duration::from_secs(1),
            cuts: 1,
            events: 50,
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(sizes));
}

async fn run(sizes: Sizes) {
    let redis = RedisServer::start();
    let nats = NatsServer::start();

    println!("## Cost of the proof, idle nodes\n");
    println!(
        "| nodes | transport | proof | broker requests per node per second | records added to the topic |"
    );
    println!("|---:|---|---|---:|---:|");
    let mut rows = Vec::new();
    for round in 0..2 {
        let off = redis_cost(&redis, sizes.nodes, Duration::MAX, sizes.idle).await;
        let on = redis_cost(&redis, sizes.nodes, Duration::from_secs(1), sizes.idle).await;
        rows.push((round, on, off));
    }
    for (round, (on, on_added), (off, off_added)) in rows {
        println!(
            "| {} | Redis Streams (round {round}) | none | {off:.2} | {off_added} |",
            sizes.nodes
        );
        println!(
            "| {} | Redis Streams (round {round}) | every 1 s | {on:.2} (+{:.2}) | {on_added} |",
            sizes.nodes,
            on - off
        );
    }
    let (tails, added) = simulated_cost(sizes.simulated, sizes.idle).await;
    println!(
        "| {} | embedded, counted | every 1 s | {tails:.2} tails asked | {added} |",
        sizes.simulated
    );

    println!(
        "\n## From a cut to the first read that bypassed the cache (bound 1 s, proof every 100 ms), ms\n"
    );
    println!("| transport | cuts | p50 | max | target |");
    println!("|---|---:|---:|---:|---:|");
    let mut links: Vec<(&str, Proxy, Arc<dyn Transport>)> = Vec::new();
    let proxy = Proxy::start(redis.addr()).await;
    let url = format!("redis://{}", proxy.addr());
    let streams = RedisStreamsTransport::builder(&url)
        .block(Duration::from_millis(100))
        .response_timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    links.push(("Redis Streams", proxy, Arc::new(streams)));
    let proxy = Proxy::start(redis.addr()).await;
    let url = format!("redis://{}", proxy.addr());
    let pubsub = RedisPubSubTransport::builder(&url)
        .ping_interval(Duration::from_millis(100))
        .ping_timeout(Duration::from_millis(300))
        .response_timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    links.push(("Redis Pub/Sub", proxy, Arc::new(pubsub)));
    let proxy = Proxy::start(nats.addr()).await;
    let nats_transport = NatsJetStreamTransport::connect(format!("nats://{}", proxy.addr()))
        .await
        .expect("connect");
    links.push(("NATS JetStream", proxy, Arc::new(nats_transport)));
    for (name, proxy, transport) in links {
        let took = partition_to_bypass(name, &proxy, transport, sizes.cuts).await;
        println!(
            "| {name} | {} | {} | {} | ≤ {} |",
            took.len(),
            took.value_at_quantile(0.5),
            took.max(),
            (BOUND + EVERY).as_millis()
        );
    }

    println!("\n## Publish → applied with the bound and without, 4 nodes each, one topic, µs\n");
    let (on, off) = applies(&redis, sizes.events).await;
    println!("| nodes | events | p50 | p99 | max |");
    println!("|---|---:|---:|---:|---:|");
    for (label, h) in [
        ("proving every 100 ms, bounded", &on),
        ("no proof, no bound", &off),
    ] {
        println!(
            "| {label} | {} | {} | {} | {} |",
            h.len(),
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.max()
        );
    }
    let ratio = on.value_at_quantile(0.99) as f64 / off.value_at_quantile(0.99).max(1) as f64;
    println!("\np99 with ÷ without: {ratio:.2}× (target ≤ 1.05×)");
}
