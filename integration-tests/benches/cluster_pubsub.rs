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

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

// Uses the cache-sync systems and report helpers, not the raw floors.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cache_sync::RedisPubSubTransport;
use cache_sync::transport::Transport;
use common::{Sizes, cache_sync_system, measure, now_us, p, run_footer, run_header};
use integration_tests::redis_cluster::RedisCluster;

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
        drop(cluster);
        run_footer(started);
    });
}
