//! Redis propagation (issue 3): how long a change takes from `Publisher` to
//! being applied on N nodes over `RedisStreamsTransport` and `RedisPubSubTransport`, next
//! to the raw Redis floor measured the same way in the same run; and how many
//! events per second one node applies through Streams, next to
//! `redis-benchmark` XADD against the same server.
//!
//! ```text
//! cargo bench -p integration-tests --bench redis_propagation
//! # only one transport's latency rows, on the server without persistence
//! # (for profiling one row, or a quick check of a change):
//! cargo bench -p integration-tests --bench redis_propagation -- pubsub
//! # only the Streams throughput rows, on the server without persistence:
//! cargo bench -p integration-tests --bench redis_propagation -- throughput
//! ```
//!
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a tiny smoke pass over the same code and checks.
//! It starts its own `redis-server` on a free loopback port (never the
//! system one on 6379), through `integration_tests::redis_server`.
//!
//! Method, briefly (docs/benchmarks/redis.md has the discussion):
//! - Every node has its own transport client (its own connections), as separate
//!   processes would; all of them, the publisher and the observer share one
//!   tokio runtime with one worker per core.
//! - Latency: events go out one at a time. The next one is published only
//!   once every node has applied the previous one, as the observer sees on
//!   waking from a tokio timer tick (≈ 1 ms; it sleeps rather than spins, so
//!   it takes no CPU from the nodes). So a sample never includes queueing
//!   behind an earlier event, and each starts from about the same idle state.
//! - The publisher stamps the send time (wall clock, µs) into the event
//!   header just before the transport call; each node's cache records
//!   `now - stamp` when it has applied the event (`last_latency_us`) and only
//!   then bumps `events_applied` (Release). The latency is the node's own
//!   figure, so the observer's wake-up delay is not in it. Every node's
//!   sample goes into one histogram, and the slowest node per event into
//!   another.
//! - cache-sync and its raw baselines run side by side, taking turns event
//!   by event, so they share the same moments of a noisy machine.
//! - The raw floor uses the same protocol: the publisher sends its clock in
//!   the payload (`PUBLISH`, or a plain `XADD`), and one task per "node" with
//!   its own connection (an async pub/sub subscriber, or an
//!   `XREAD BLOCK` loop) stores `now - stamp`, then bumps its counter. A
//!   third Streams variant hands each batch through a bounded tokio channel
//!   to a second task first, as the consumer's fetcher did to its applier
//!   until the two became one task: it shows what that hand-over cost.
//! - Each configuration has its own topic, so a Streams node's start-up
//!   replay window (the default reorder window) finds nothing to replay; the
//!   events are unversioned refreshes, which are never quarantined. So the
//!   nodes run with default settings.
//! - The whole suite runs twice: on the test harness's server
//!   (`RedisServer::start()`: AOF with `appendfsync always`, so every `XADD`
//!   waits for an fsync) and on one with persistence off, the usual setup for
//!   a cache-invalidation transport. Pub/Sub writes nothing to the AOF.
//! - Node counts 1, 4, 16 and 64. The p99 goal (≤ 1.5× raw) is judged at 16;
//!   a last table shows how the p99 ratio grows from 16 to 64 nodes (goal:
//!   the 64-node ratio within 1.3× of the 16-node one). All 64 nodes are
//!   tasks on the same workers (one per core; two on the reference machine),
//!   so the 64-node rows measure how 64 nodes' per-event CPU work queues on
//!   the cores, on both sides, far more than the network or Redis.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use cache_sync::transport::Transport;
use cache_sync::{
    Publisher,
    transport::{RedisPubSubTransport, RedisStreamsTransport},
};
use common::{
    CACHE, Latency, RawFloor, STALL, System, cache_sync_system, latency_header, latency_intro,
    latency_row, measure, new_slots, now_us, p, ratio, run_footer, run_header, stamp_of,
    start_nodes, stop_nodes,
};
use futures_util::StreamExt;
use integration_tests::redis_server::RedisServer;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, Value};
use tokio::sync::mpsc;

/// Workload sizes: `FULL` under `cargo bench`, `SMOKE` otherwise.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// The paced latency rows. Rows above `goal_nodes` nodes measure
    /// `wide_events` events instead of `latency.events`.
    latency: common::Sizes,
    /// The node count the p99 goal is judged at.
    goal_nodes: usize,
    /// The wider node count whose p99 ratio is compared with the one at
    /// `goal_nodes` (the fan-out table at the end).
    wide_nodes: usize,
    /// Paced events per row above `goal_nodes` nodes.
    wide_events: u64,
    /// Throughput: events from one publisher, each awaited before the next.
    seq_events: u64,
    /// Throughput: events from `publishers` concurrent publishers, in total.
    conc_events: u64,
    publishers: usize,
    /// Throughput: tasks sharing one pipelined publisher.
    pipelined_tasks: usize,
    /// `redis-benchmark -n` at its default 50 clients, and at 1 client.
    rb_requests: u64,
    rb_requests_one_client: u64,
    /// Whether to repeat everything on a server without persistence.
    both_servers: bool,
}

const FULL: Sizes = Sizes {
    latency: common::Sizes {
        warmup: 100,
        // 2000 per row took the run past 3 minutes once the disk of the
        // `appendfsync always` server was busy.
        events: 1500,
        nodes: &[1, 4, 16, 64],
    },
    goal_nodes: 16,
    wide_nodes: 64,
    // At 1500 the 64-node rows added about a minute (3.5 min in all), so
    // they keep the full count; lower this if they grow much slower.
    wide_events: 1500,
    seq_events: 20_000,
    conc_events: 100_000,
    publishers: 50,
    pipelined_tasks: 64,
    rb_requests: 100_000,
    rb_requests_one_client: 5_000,
    both_servers: true,
};

const SMOKE: Sizes = Sizes {
    latency: common::Sizes {
        warmup: 3,
        events: 20,
        nodes: &[1, 2],
    },
    goal_nodes: 1,
    wide_nodes: 2,
    wide_events: 10,
    seq_events: 200,
    conc_events: 400,
    publishers: 4,
    pipelined_tasks: 4,
    rb_requests: 2000,
    rb_requests_one_client: 500,
    both_servers: false,
};

/// The script `RedisStreamsTransport` publishes with, from the same file cache-sync
/// includes, to run `redis-benchmark` on it. The bench still checks with
/// `SCRIPT EXISTS` that cache-sync loaded this very text (same SHA-1).
const PUBLISH_SCRIPT: &str = concat!(
    include_str!("../../cache-sync/src/transport/redis/redis_epoch.lua"),
    include_str!("../../cache-sync/src/transport/redis/redis_publish.lua")
);

/// Throughput publishers stop early after this, so a slow disk (the
/// `appendfsync always` server) cannot stretch the run.
const THROUGHPUT_CAP: Duration = Duration::from_secs(5);

// ------------------------------------------------------------ cache-sync

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Streams,
    PubSub,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Streams => "Streams",
            Kind::PubSub => "Pub/Sub",
        }
    }

    async fn transport(self, url: &str) -> Arc<dyn Transport> {
        match self {
            Kind::Streams => Arc::new(
                RedisStreamsTransport::connect(url)
                    .await
                    .expect("connect streams transport"),
            ),
            Kind::PubSub => Arc::new(
                RedisPubSubTransport::connect(url)
                    .await
                    .expect("connect pubsub transport"),
            ),
        }
    }
}

/// N nodes on a fresh topic, each with its own transport client, and a publisher
/// with its own.
async fn redis_system(url: &str, transport: Kind, n: usize) -> System {
    let topic = format!("lat-{}-{n}-{}", transport.label(), now_us());
    cache_sync_system(topic, n, || transport.transport(url)).await
}

// ------------------------------------------------------------ raw Redis

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RawKind {
    /// `PUBLISH` → one plain async subscriber per node.
    PubSub,
    /// `XADD` → one `XREAD BLOCK` loop per node.
    Streams,
    /// As `Streams`, but each reader hands its batch through a bounded tokio
    /// channel to a second task, as the consumer's fetcher did to its
    /// applier before they became one task; that task takes the time.
    StreamsHop,
}

/// Publishes with a plain Redis command.
struct RedisRaw {
    kind: RawKind,
    conn: MultiplexedConnection,
    /// The channel or stream key.
    target: String,
}

#[async_trait]
impl RawFloor for RedisRaw {
    async fn publish(&self) {
        let mut conn = self.conn.clone();
        let mut cmd = match self.kind {
            RawKind::PubSub => redis::cmd("PUBLISH"),
            RawKind::Streams | RawKind::StreamsHop => redis::cmd("XADD"),
        };
        cmd.arg(&self.target);
        if self.kind != RawKind::PubSub {
            cmd.arg("*").arg("p");
        }
        cmd.arg(now_us())
            .query_async::<Value>(&mut conn)
            .await
            .expect("raw publish");
    }
}

/// `(id, payload field "p")` of each entry in an `XREAD` reply (RESP2).
fn xread_entries(reply: Value) -> Vec<(String, Vec<u8>)> {
    fn text(v: &Value) -> Option<String> {
        match v {
            Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    }
    let mut out = Vec::new();
    let Value::Array(streams) = reply else {
        return out; // Nil: the block timed out.
    };
    for stream in streams {
        let Value::Array(mut key_entries) = stream else {
            continue;
        };
        let Some(Value::Array(entries)) = key_entries.pop() else {
            continue;
        };
        for entry in entries {
            let Value::Array(parts) = entry else { continue };
            let (Some(id), Some(Value::Array(fields))) =
                (parts.first().and_then(text), parts.get(1))
            else {
                continue;
            };
            let payload = fields
                .chunks(2)
                .find(|kv| kv.first().and_then(text).as_deref() == Some("p"))
                .and_then(|kv| match kv.get(1) {
                    Some(Value::BulkString(b)) => Some(b.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            out.push((id, payload));
        }
    }
    out
}

async fn connection(url: &str, response_timeout: Duration) -> MultiplexedConnection {
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(response_timeout));
    Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connection")
}

/// N raw receivers, each on its own connection, and a publisher connection.
async fn raw_system(url: &str, kind: RawKind, n: usize) -> System {
    let target = format!("raw-{kind:?}-{n}-{}", now_us());
    let mut conn = connection(url, Duration::from_secs(5)).await;
    let slots = new_slots(n);
    let mut tasks = Vec::new();
    if kind == RawKind::PubSub {
        for slot in &slots {
            let mut pubsub = Client::open(url)
                .expect("client")
                .get_async_pubsub()
                .await
                .expect("pubsub connection");
            pubsub.subscribe(&target).await.expect("SUBSCRIBE");
            let slot = slot.clone();
            tasks.push(tokio::spawn(async move {
                let mut messages = pubsub.into_on_message();
                while let Some(msg) = messages.next().await {
                    slot.observe(stamp_of(msg.get_payload_bytes()));
                }
            }));
        }
    } else {
        // Create the stream; readers start after this entry.
        let first: String = redis::cmd("XADD")
            .arg(&target)
            .arg("*")
            .arg("p")
            .arg(0)
            .query_async(&mut conn)
            .await
            .expect("XADD");
        for slot in &slots {
            // The default 500 ms response timeout would fail every blocking read.
            let mut reader = connection(url, Duration::from_secs(30)).await;
            let hop = if kind == RawKind::StreamsHop {
                // The consumer's channel holds 4 batches by default.
                let (tx, mut rx) = mpsc::channel::<Vec<u64>>(4);
                let slot = slot.clone();
                tasks.push(tokio::spawn(async move {
                    while let Some(batch) = rx.recv().await {
                        for stamp in batch {
                            slot.observe(stamp);
                        }
                    }
                }));
                Some(tx)
            } else {
                None
            };
            let (key, slot, mut last) = (target.clone(), slot.clone(), first.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let reply: Value = redis::cmd("XREAD")
                        .arg("COUNT")
                        .arg(256)
                        .arg("BLOCK")
                        .arg(5000)
                        .arg("STREAMS")
                        .arg(&key)
                        .arg(&last)
                        .query_async(&mut reader)
                        .await
                        .expect("XREAD");
                    let mut batch = Vec::new();
                    for (id, payload) in xread_entries(reply) {
                        batch.push(stamp_of(&payload));
                        last = id;
                    }
                    match &hop {
                        Some(tx) => {
                            if !batch.is_empty() && tx.send(batch).await.is_err() {
                                return;
                            }
                        }
                        None => batch.into_iter().for_each(|stamp| slot.observe(stamp)),
                    }
                }
            }));
        }
    }
    System::raw(RedisRaw { kind, conn, target }, slots, tasks)
}

// ------------------------------------------------------------ publish calls

/// How long publish calls take with nobody subscribed: cache-sync and the
/// raw command taking turns, paced as in the latency rows. What the
/// publisher side alone costs.
async fn publish_only(s: Sizes, url: &str) -> Vec<(&'static str, Latency, Latency)> {
    let s = common::Sizes {
        events: s.latency.events / 2,
        ..s.latency
    };
    let mut out = Vec::new();
    for (transport, kind) in [
        (Kind::Streams, RawKind::Streams),
        (Kind::PubSub, RawKind::PubSub),
    ] {
        let systems = vec![
            redis_system(url, transport, 0).await,
            raw_system(url, kind, 0).await,
        ];
        let mut lat = measure(s, systems).await;
        let raw = lat.pop().expect("raw");
        let cs = lat.pop().expect("cache-sync");
        out.push((transport.label(), cs, raw));
    }
    out
}

/// `usec_per_call` of some commands from `INFO commandstats`.
async fn server_costs(url: &str) -> String {
    let mut conn = Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO commandstats");
    let wanted = ["evalsha", "xadd", "xinfo|stream", "xread", "publish"];
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            if !wanted.contains(&name) {
                return None;
            }
            let calls = rest.split(',').find_map(|f| f.strip_prefix("calls="))?;
            let per = rest
                .split(',')
                .find_map(|f| f.strip_prefix("usec_per_call="))?;
            Some(format!("`{name}` {per} µs × {calls}"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

async fn reset_server_stats(url: &str) {
    let mut conn = Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async::<()>(&mut conn)
        .await
        .expect("CONFIG RESETSTAT");
}

// ------------------------------------------------------------ throughput

struct Throughput {
    events: u64,
    /// Until the node's `events_applied` reached `events`.
    applied: Duration,
    /// Until the last publish call returned.
    published: Duration,
    problems: String,
}

impl Throughput {
    fn rate(&self) -> f64 {
        self.events as f64 / self.applied.as_secs_f64()
    }
}

/// One Streams node; `publishers` `Publisher`s, each with its own transport
/// connection and `tasks` tasks sharing it, send `events` single-entry
/// refreshes in total as fast as they can (each task awaits its previous
/// publish; tasks sharing a publisher have their calls in flight together,
/// up to its window), or as many as they manage in `THROUGHPUT_CAP`. Timed
/// until the node has applied them all.
async fn streams_throughput(url: &str, events: u64, publishers: usize, tasks: usize) -> Throughput {
    let topic = format!("tput-{publishers}x{tasks}-{}", now_us());
    let nodes = start_nodes(&topic, 1, || Kind::Streams.transport(url)).await;
    let cache = nodes[0].cache.clone();
    let mut pubs = Vec::with_capacity(publishers * tasks);
    for k in 0..publishers {
        let p = Publisher::builder(Kind::Streams.transport(url).await)
            .topic(topic.clone())
            .origin(format!("publisher-{k}"))
            .build()
            .expect("publisher");
        pubs.extend(std::iter::repeat_n(p, tasks));
    }
    let publishers = publishers * tasks;
    let per = events / publishers as u64;
    let start = Instant::now();
    let deadline = start + THROUGHPUT_CAP;
    let tasks: Vec<_> = pubs
        .into_iter()
        .map(|p| {
            tokio::spawn(async move {
                let mut sent = 0;
                while sent < per && Instant::now() < deadline {
                    p.insert(CACHE, [(sent % 1024, sent)])
                        .await
                        .expect("publish");
                    sent += 1;
                }
                (sent, start.elapsed())
            })
        })
        .collect();
    let (mut events, mut published) = (0, Duration::ZERO);
    for t in tasks {
        let (sent, done) = t.await.expect("publisher task");
        events += sent;
        published = published.max(done);
    }
    while cache.status().events_applied < events {
        assert!(
            start.elapsed() < THROUGHPUT_CAP + STALL,
            "throughput run stalled: {:?}",
            cache.status()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let applied = start.elapsed();
    Throughput {
        events,
        applied,
        published,
        problems: stop_nodes(nodes).await,
    }
}

/// `redis-benchmark -p PORT -n N -c C -P 1 <command>`; `None` if it is not
/// installed or its output has no rate.
async fn redis_benchmark(port: u16, requests: u64, clients: u32, command: &[&str]) -> Option<f64> {
    let mut args: Vec<String> = vec![
        "-p".into(),
        port.to_string(),
        "-n".into(),
        requests.to_string(),
        "-c".into(),
        clients.to_string(),
        "-P".into(),
        "1".into(),
    ];
    args.extend(command.iter().map(|s| (*s).to_owned()));
    let output =
        tokio::task::spawn_blocking(move || Command::new("redis-benchmark").args(&args).output())
            .await
            .expect("redis-benchmark task")
            .ok()?;
    integration_tests::redis_server::requests_per_second(&output.stdout)
}

const XADD_COMMAND: &[&str] = &["XADD", "bench-stream", "*", "f", "v"];

/// The SHA-1 of the publish script, if the server holds it (cache-sync
/// loaded it) and the copy here is current.
async fn loaded_script_sha(url: &str) -> Option<String> {
    let sha = redis::Script::new(PUBLISH_SCRIPT).get_hash().to_owned();
    let mut conn = connection(url, Duration::from_secs(5)).await;
    let exists: Vec<i64> = redis::cmd("SCRIPT")
        .arg("EXISTS")
        .arg(&sha)
        .query_async(&mut conn)
        .await
        .ok()?;
    (exists.first() == Some(&1)).then_some(sha)
}

fn port_of(url: &str) -> u16 {
    url.trim_end_matches('/')
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port in url")
}

// ------------------------------------------------------------ report

/// What one server's pass found, for the verdicts.
struct Pass {
    server: &'static str,
    /// The p99s at `goal_nodes` and at `wide_nodes`.
    p99s: Vec<P99>,
    /// `None` when the throughput section did not run.
    throughput: Option<ThroughputPass>,
}

/// One latency row's tail, cache-sync against its raw floor.
struct P99 {
    transport: &'static str,
    nodes: usize,
    cache_sync: u64,
    raw: u64,
    raw_p50: u64,
}

impl P99 {
    fn ratio(&self) -> f64 {
        ratio(self.cache_sync, self.raw)
    }
}

/// Events applied/s, and `redis-benchmark` XADD/s at the same concurrency.
struct ThroughputPass {
    one: f64,
    many: f64,
    /// One publisher shared by `pipelined_tasks` tasks.
    pipelined: f64,
    /// `-c 1`: one connection, one request at a time, like one publisher.
    rb_one: Option<f64>,
    /// `-c 50`, its default: the goal's yardstick.
    rb_many: Option<f64>,
}

/// What a run covers: everything, or one part (`cargo bench -- NAME`).
#[derive(Clone, Copy, PartialEq)]
enum Only {
    /// One transport's latency rows.
    Latency(Kind),
    /// The Streams throughput rows.
    Throughput,
}

async fn run_pass(s: Sizes, server: &'static str, redis: RedisServer, only: Option<Only>) -> Pass {
    let url = redis.url();
    println!("\n#### Server: {server}\n");
    if only == Some(Only::Throughput) {
        return Pass {
            server,
            p99s: Vec::new(),
            throughput: Some(throughput(s, &url).await),
        };
    }
    latency_intro(s.latency, "plain Redis commands");
    if s.wide_events != s.latency.events {
        println!(
            "Rows above {} nodes: {} paced events each (fewer, to keep the run time down).\n",
            s.goal_nodes, s.wide_events
        );
    }
    latency_header(&["raw + task hop p50 / p99"]);
    let mut p99s = Vec::new();
    reset_server_stats(&url).await;
    for &n in s.latency.nodes {
        for (transport, label, raw_kinds) in [
            (
                Kind::Streams,
                "Streams (raw: XADD → XREAD BLOCK)",
                &[RawKind::Streams, RawKind::StreamsHop][..],
            ),
            (
                Kind::PubSub,
                "Pub/Sub (raw: PUBLISH → message)",
                &[RawKind::PubSub][..],
            ),
        ] {
            if only.is_some_and(|o| o != Only::Latency(transport)) {
                continue;
            }
            let mut systems = vec![redis_system(&url, transport, n).await];
            for &kind in raw_kinds {
                systems.push(raw_system(&url, kind, n).await);
            }
            let sizes = if n > s.goal_nodes {
                common::Sizes {
                    events: s.wide_events,
                    ..s.latency
                }
            } else {
                s.latency
            };
            let lat = latency_row(sizes, label, n, 1, systems).await;
            if n == s.goal_nodes || n == s.wide_nodes {
                p99s.push(P99 {
                    transport: transport.label(),
                    nodes: n,
                    cache_sync: p(&lat[0].per_node, 0.99),
                    raw: p(&lat[1].per_node, 0.99),
                    raw_p50: p(&lat[1].per_node, 0.50),
                });
            }
        }
    }

    if only.is_some() {
        return Pass {
            server,
            p99s,
            throughput: None,
        };
    }
    println!(
        "\nServer-side cost over the latency rows (`INFO commandstats`; commands a script calls count too): {}",
        server_costs(&url).await
    );

    println!(
        "\nPublish call alone, no subscribers, {} calls each, taking turns, µs:\n",
        s.latency.events / 2
    );
    println!(
        "| transport | cache-sync `Publisher::insert` p50 | p99 | raw command p50 | p99 | p50 ratio |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (t, cs, raw) in publish_only(s, &url).await {
        let raw_cmd = if t == "Streams" { "XADD" } else { "PUBLISH" };
        let (cs, raw) = (&cs.publish_call, &raw.publish_call);
        println!(
            "| {t} (raw: {raw_cmd}) | {} | {} | {} | {} | {:.2}× |",
            p(cs, 0.50),
            p(cs, 0.99),
            p(raw, 0.50),
            p(raw, 0.99),
            ratio(p(cs, 0.50), p(raw, 0.50)),
        );
    }

    let throughput = throughput(s, &url).await;
    drop(redis);
    Pass {
        server,
        p99s,
        throughput: Some(throughput),
    }
}

/// The Streams throughput rows, next to `redis-benchmark` on the same server.
async fn throughput(s: Sizes, url: &str) -> ThroughputPass {
    let url = url.to_owned();
    println!("\nStreams throughput, one node:\n");
    println!("| what | events | rate | notes |");
    println!("|---|---:|---:|---|");
    let seq = streams_throughput(&url, s.seq_events, 1, 1).await;
    println!(
        "| cache-sync, 1 publisher (each publish awaited), events applied/s | {} | {:.0}/s | last publish returned at {:.0} ms, all applied at {:.0} ms; problems: {} |",
        seq.events,
        seq.rate(),
        seq.published.as_secs_f64() * 1e3,
        seq.applied.as_secs_f64() * 1e3,
        if seq.problems.is_empty() {
            "0"
        } else {
            &seq.problems
        },
    );
    let conc = streams_throughput(&url, s.conc_events, s.publishers, 1).await;
    println!(
        "| cache-sync, {} publishers with a connection each, events applied/s | {} | {:.0}/s | last publish returned at {:.0} ms, all applied at {:.0} ms; problems: {} |",
        s.publishers,
        conc.events,
        conc.rate(),
        conc.published.as_secs_f64() * 1e3,
        conc.applied.as_secs_f64() * 1e3,
        if conc.problems.is_empty() {
            "0"
        } else {
            &conc.problems
        },
    );
    // Issue 36: one publisher whose calls are pipelined (its default
    // window), shared by as many tasks as the window holds.
    let piped = streams_throughput(&url, s.conc_events, 1, s.pipelined_tasks).await;
    println!(
        "| cache-sync, 1 publisher shared by {} tasks (pipelined, default window), events applied/s | {} | {:.0}/s | last publish returned at {:.0} ms, all applied at {:.0} ms; problems: {} |",
        s.pipelined_tasks,
        piped.events,
        piped.rate(),
        piped.published.as_secs_f64() * 1e3,
        piped.applied.as_secs_f64() * 1e3,
        if piped.problems.is_empty() {
            "0"
        } else {
            &piped.problems
        },
    );
    let port = port_of(&url);
    let rb = redis_benchmark(port, s.rb_requests, 50, XADD_COMMAND).await;
    let rb1 = redis_benchmark(port, s.rb_requests_one_client, 1, XADD_COMMAND).await;
    let show = |r: Option<f64>| {
        r.map_or("n/a (redis-benchmark missing?)".to_owned(), |r| {
            format!("{r:.0}/s")
        })
    };
    println!(
        "| `redis-benchmark -p {port} -n {} -P 1 XADD bench-stream '*' f v` (50 clients, its default) | {} | {} | plain XADD, no reader |",
        s.rb_requests,
        s.rb_requests,
        show(rb)
    );
    println!(
        "| same with `-c 1` (one connection, one request at a time) | {} | {} | plain XADD, no reader |",
        s.rb_requests_one_client,
        show(rb1)
    );
    // The script's own ceiling: what Redis manages when every XADD is
    // cache-sync's publish script, with nothing else on the client side.
    match loaded_script_sha(&url).await {
        Some(sha) => {
            let payload = "x".repeat(64);
            let script = [
                "EVALSHA",
                sha.as_str(),
                "3",
                "bench-script-stream",
                "bench-script-stream:n",
                "bench-script-stream:e",
                "100000",
                CACHE,
                payload.as_str(),
            ];
            let n = s.rb_requests / 2;
            let rate = redis_benchmark(port, n, 50, &script).await;
            println!(
                "| `redis-benchmark … -n {n} EVALSHA <publish script> 3 key key:n key:e 100000 bench <64 B>` (50 clients) | {n} | {} | cache-sync's publish script, no reader |",
                show(rate)
            );
        }
        None => println!(
            "| redis-benchmark on the publish script | – | skipped | cache-sync's loaded script does not match `redis_publish.lua` |"
        ),
    }
    ThroughputPass {
        one: seq.rate(),
        many: conc.rate(),
        pipelined: piped.rate(),
        rb_one: rb1,
        rb_many: rb,
    }
}

fn verdicts(s: Sizes, full: bool, passes: &[Pass]) {
    let smoke = if full {
        ""
    } else {
        " (smoke sizes: meaningless)"
    };
    println!("\n#### Goals{smoke}\n");
    for pass in passes {
        println!("{}:", pass.server);
        for row in pass.p99s.iter().filter(|r| r.nodes == s.goal_nodes) {
            let (t, cs, raw, r) = (row.transport, row.cache_sync, row.raw, row.ratio());
            // On a quiet machine the raw p99 is 2-3× its p50; far above that,
            // stalls from outside (other processes, the disk) make up both
            // tails and push the ratio toward 1.
            let tail = ratio(raw, row.raw_p50);
            let noisy = if tail > 4.0 {
                format!(
                    " (raw p99 is {tail:.1}× its p50: the tails are machine noise, so this says little)"
                )
            } else {
                String::new()
            };
            println!(
                "- p99 ≤ 1.5× raw at {} nodes, {t}: {cs} µs vs {raw} µs = {r:.2}× → {}{noisy}",
                s.goal_nodes,
                if r <= 1.5 { "PASS" } else { "FAIL" }
            );
        }
        match &pass.throughput {
            None => println!("- throughput goal: not run"),
            Some(t) => {
                let line = |what: &str,
                            rate: f64,
                            rb: Option<f64>,
                            rb_what: &str,
                            goal: Option<f64>| {
                    let Some(rb) = rb else {
                        println!("- Streams applied/s, {what}: redis-benchmark did not run");
                        return;
                    };
                    let r = rate / rb;
                    if let Some(goal) = goal {
                        let verdict = if r >= goal { "PASS" } else { "FAIL" };
                        println!(
                            "- Streams applied/s ≥ {goal}× redis-benchmark XADD/s ({rb_what}), {what}: {rate:.0} vs {rb:.0} = {r:.2}× → {verdict}"
                        );
                    } else {
                        println!(
                            "- for reference, Streams applied/s ÷ redis-benchmark XADD/s ({rb_what}), {what}: {rate:.0} vs {rb:.0} = {r:.2}×"
                        );
                    }
                };
                let many = format!("{} publishers", s.publishers);
                // Issue 3's goal, with a connection per publisher.
                line(
                    &many,
                    t.many,
                    t.rb_many,
                    "50 clients, its default",
                    Some(0.5),
                );
                // Issue 36's goal: one node behind one pipelined publisher.
                let piped = format!("1 publisher, {} tasks, pipelined", s.pipelined_tasks);
                line(
                    &piped,
                    t.pipelined,
                    t.rb_many,
                    "50 clients, its default",
                    Some(0.8),
                );
                // Like for like: one publisher awaits each call, as -c 1 does.
                line("1 publisher", t.one, t.rb_one, "-c 1", None);
            }
        }
    }
}

/// How the p99 ratio grows from `goal_nodes` to `wide_nodes` nodes, per
/// server and transport. Goal: the wide ratio within 1.3× of the other.
fn fan_out(s: Sizes, full: bool, workers: usize, passes: &[Pass]) {
    let (a, b) = (s.goal_nodes, s.wide_nodes);
    let smoke = if full {
        ""
    } else {
        " (smoke sizes: meaningless)"
    };
    println!("\n#### Fan-out: p99 ratio (cache-sync ÷ raw) from {a} to {b} nodes{smoke}\n");
    // Every node is a task on the same few workers, so at 64 nodes the last
    // node of an event waits for the other 63 to take their turn on the CPU,
    // on both sides; the network and Redis add little per extra node.
    println!(
        "All nodes are tasks on the same {} tokio workers, so this mostly measures how the per-event \
         CPU work of {b} nodes queues on the cores (on both sides), not the network.\n",
        workers
    );
    println!(
        "| server | transport | p99 at {a}, cache-sync / raw µs | ratio at {a} | p99 at {b}, cache-sync / raw µs | ratio at {b} | {b}-node ÷ {a}-node ratio | ≤ 1.3× | raw p99 ÷ p50 at {a} / {b} |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---|---:|");
    for pass in passes {
        for at_a in pass.p99s.iter().filter(|r| r.nodes == a) {
            let Some(at_b) = pass
                .p99s
                .iter()
                .find(|r| r.nodes == b && r.transport == at_a.transport)
            else {
                continue;
            };
            let growth = at_b.ratio() / at_a.ratio();
            // As in the goals: far above 3×, outside stalls make the tails.
            let (tail_a, tail_b) = (ratio(at_a.raw, at_a.raw_p50), ratio(at_b.raw, at_b.raw_p50));
            let noisy = if tail_a.max(tail_b) > 4.0 {
                " (noisy)"
            } else {
                ""
            };
            println!(
                "| {} | {} | {} / {} | {:.2}× | {} / {} | {:.2}× | {growth:.2}× | {} | {tail_a:.1} / {tail_b:.1}{noisy} |",
                pass.server,
                at_a.transport,
                at_a.cache_sync,
                at_a.raw,
                at_a.ratio(),
                at_b.cache_sync,
                at_b.raw,
                at_b.ratio(),
                if growth <= 1.3 { "PASS" } else { "FAIL" },
            );
        }
    }
    println!(
        "\nA raw p99 more than 4× its p50 (noisy) means stalls from outside (other processes, the \
         disk) make up both tails, which pushes the ratios toward 1."
    );
}

async fn run(s: Sizes, full: bool, workers: usize, only: Option<Only>) {
    let started = Instant::now();
    run_header(full, workers);
    let mut passes = Vec::new();
    if only.is_none() {
        passes.push(
            run_pass(
                s,
                "RedisServer::start() (AOF, appendfsync always)",
                RedisServer::start(),
                None,
            )
            .await,
        );
    }
    if s.both_servers || only.is_some() {
        passes.push(
            run_pass(
                s,
                "persistence off (--appendonly no)",
                RedisServer::start_with(&["--appendonly", "no"]),
                only,
            )
            .await,
        );
    }
    verdicts(s, full, &passes);
    // The fan-out table compares latency rows of both transports.
    if only.is_none() {
        fan_out(s, full, workers, &passes);
    }
    run_footer(started);
}

fn main() {
    // `cargo bench -- pubsub` hands the binary `pubsub --bench`.
    let mut only = None;
    for arg in std::env::args().skip(1).filter(|a| !a.starts_with('-')) {
        only = Some(match arg.as_str() {
            "streams" => Only::Latency(Kind::Streams),
            "pubsub" => Only::Latency(Kind::PubSub),
            "throughput" => Only::Throughput,
            other => panic!("unknown section {other:?}: expected streams, pubsub or throughput"),
        });
    }
    common::main(move |full, workers| run(if full { FULL } else { SMOKE }, full, workers, only));
}
