//! Sharded against classic Pub/Sub on a Redis Cluster (issue 23): the
//! propagation latency to 16 nodes, and the CPU each master spends, for the
//! same events published with `SPUBLISH` (the default on a cluster) and with
//! `PUBLISH` (`.sharded(false)`).
//!
//! ```text
//! cargo bench -p integration-tests --bench cluster_pubsub
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny
//! smoke pass over the same code.
//!
//! Method:
//! - One cluster of the test harness (`integration_tests::redis_cluster`:
//!   three masters with a replica each, on loopback). Sixteen nodes, each
//!   on a client of its own, and a publisher, per mode, on a topic of its
//!   own; its slot's master is the "owning master" of that mode's row.
//! - Latency as in the other propagation benches (`common::measure`):
//!   events one at a time, the next once every node applied the previous;
//!   the modes run one after the other, not interleaved, so that each
//!   master's CPU time (from `/proc`, in 10 ms ticks) over a mode's run is
//!   that mode's alone.
//! - A sharded subscriber holds a connection to the slot's master only; a
//!   classic one to whichever seed answers first, and a classic `PUBLISH`
//!   is forwarded by the cluster bus to every node of the cluster. The
//!   "other masters" column is what the masters that do not serve the
//!   topic's slot spent: the cost classic Pub/Sub puts on the rest of the
//!   cluster.
//! - Then sharded Pub/Sub against its raw floor on the same cluster, taking
//!   turns event by event: `SPUBLISH` of the publisher's clock on the
//!   slot's master, and per node a RESP3 connection to it with
//!   `SSUBSCRIBE`, from the `redis` crate alone.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

// Uses the cache-sync systems, one raw floor and the report helpers.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use cache_sync::transport::RedisPubSubTransport;
use cache_sync::transport::Transport;
use common::{
    RawFloor, Sizes, System, cache_sync_system, measure, new_slots, now_us, p, ratio, run_footer,
    run_header, stamp_of,
};
use integration_tests::redis_cluster::RedisCluster;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, PushInfo, PushKind, Value};

const FULL: Sizes = Sizes {
    warmup: 100,
    events: 2000,
    nodes: &[16],
};

const SMOKE: Sizes = Sizes {
    warmup: 3,
    events: 20,
    nodes: &[2],
};

async fn transport(seeds: Vec<String>, sharded: bool) -> Arc<dyn Transport> {
    Arc::new(
        RedisPubSubTransport::cluster(seeds)
            .sharded(sharded)
            .connect()
            .await
            .expect("connect"),
    )
}

/// Every server's CPU time so far, in server order.
fn cpu(cluster: &RedisCluster) -> Vec<Duration> {
    (0..cluster.len())
        .map(|i| cluster.server(i).cpu_time().unwrap_or_default())
        .collect()
}

/// The raw floor: `SPUBLISH` on the slot's master, the publisher's clock
/// as the payload.
struct RawSharded {
    publisher: MultiplexedConnection,
    channel: String,
    /// The subscribers' connections, open while the floor is.
    _subscribers: Vec<MultiplexedConnection>,
}

#[async_trait]
impl RawFloor for RawSharded {
    async fn publish(&self) {
        let mut conn = self.publisher.clone();
        let _: i64 = redis::cmd("SPUBLISH")
            .arg(&self.channel)
            .arg(now_us().to_string())
            .query_async(&mut conn)
            .await
            .expect("SPUBLISH");
    }
}

/// `n` subscribers of `channel` on the master at `url`, each on a RESP3
/// connection of its own, and a publisher.
async fn raw_sharded(url: &str, channel: String, n: usize) -> System {
    let slots = new_slots(n);
    let mut subscribers = Vec::with_capacity(n);
    let mut tasks = Vec::with_capacity(n);
    for slot in &slots {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PushInfo>();
        let config = AsyncConnectionConfig::new().set_push_sender(tx);
        let client = redis::Client::open(format!("{url}?protocol=resp3")).expect("client");
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .expect("connect");
        // Answered by a push message, not a reply.
        let mut subscribe = redis::cmd("SSUBSCRIBE");
        subscribe.arg(&channel).set_no_response(true);
        conn.send_packed_command(&subscribe)
            .await
            .expect("SSUBSCRIBE");
        while rx.recv().await.expect("a push message").kind != PushKind::SSubscribe {}
        let slot = Arc::clone(slot);
        tasks.push(tokio::spawn(async move {
            while let Some(info) = rx.recv().await {
                if info.kind == PushKind::SMessage
                    && let Some(Value::BulkString(payload)) = info.data.get(1)
                {
                    slot.observe(stamp_of(payload));
                }
            }
        }));
        subscribers.push(conn);
    }
    let publisher = redis::Client::open(url)
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    System::raw(
        RawSharded {
            publisher,
            channel,
            _subscribers: subscribers,
        },
        slots,
        tasks,
    )
}

fn main() {
    common::main(|full, workers| async move {
        let started = Instant::now();
        run_header(full, workers);
        let sizes = if full { FULL } else { SMOKE };
        let cluster = tokio::task::block_in_place(RedisCluster::start);
        let seeds = cluster.urls();
        let stamp = now_us();
        let masters = cluster.masters();
        let n = sizes.nodes[0];
        println!(
            "\n{n} nodes; {} events per mode after {} warm-up; masters {masters:?}\n",
            sizes.events, sizes.warmup
        );
        println!(
            "| mode | p50 µs | p99 µs | slowest node p99 µs | owning master CPU ms | other masters CPU ms | replicas CPU ms |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for (label, sharded) in [("sharded (SPUBLISH)", true), ("classic (PUBLISH)", false)] {
            let topic = format!("t-{}-{stamp}", u8::from(sharded));
            // The topic is its channels' hash tag.
            let owner = cluster.master_of(cluster.slot(&format!("{{{topic}}}")));
            let system = cache_sync_system(topic, n, || transport(seeds.clone(), sharded)).await;
            let before = cpu(&cluster);
            let lat = measure(sizes, vec![system]).await;
            let after = cpu(&cluster);
            let spent = |i: usize| after[i].saturating_sub(before[i]).as_millis();
            let others: u128 = masters
                .iter()
                .filter(|&&m| m != owner)
                .map(|&m| spent(m))
                .sum();
            let replicas: u128 = (0..cluster.len())
                .filter(|i| !masters.contains(i))
                .map(spent)
                .sum();
            let l = &lat[0];
            println!(
                "| {label} | {} | {} | {} | {} | {others} | {replicas} |",
                p(&l.per_node, 0.50),
                p(&l.per_node, 0.99),
                p(&l.slowest, 0.99),
                spent(owner),
            );
            if !l.problems.is_empty() {
                println!("  problems: {}", l.problems);
            }
        }
        // Against the floor, taking turns event by event. The transport's
        // channel for a topic is `cache-sync{<topic>}`: the floor's channel
        // hashes to the same slot.
        let topic = format!("floor-{stamp}");
        let owner = cluster.master_of(cluster.slot(&format!("{{{topic}}}")));
        let systems = vec![
            cache_sync_system(topic.clone(), n, || transport(seeds.clone(), true)).await,
            raw_sharded(&cluster.server(owner).url(), format!("raw{{{topic}}}"), n).await,
        ];
        let lat = measure(sizes, systems).await;
        let (c, r) = (&lat[0], &lat[1]);
        println!(
            "\nsharded Pub/Sub against its raw floor (`SPUBLISH` → `SSUBSCRIBE` on the slot's \
             master, the redis crate alone), {n} nodes, taking turns event by event:\n"
        );
        println!(
            "| | cache-sync p50 / p99 µs | raw p50 / p99 µs | p50 ratio | p99 ratio |\n|---|---:|---:|---:|---:|"
        );
        println!(
            "| sharded Pub/Sub | {} / {} | {} / {} | {:.2}× | {:.2}× |",
            p(&c.per_node, 0.50),
            p(&c.per_node, 0.99),
            p(&r.per_node, 0.50),
            p(&r.per_node, 0.99),
            ratio(p(&c.per_node, 0.50), p(&r.per_node, 0.50)),
            ratio(p(&c.per_node, 0.99), p(&r.per_node, 0.99)),
        );
        if !c.problems.is_empty() {
            println!("  problems: {}", c.problems);
        }
        drop(cluster);
        run_footer(started);
    });
}
