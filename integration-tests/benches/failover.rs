//! Recovery after a failover (issue 23): how long from killing the server
//! that leads the topic (the master of its slot on a Redis Cluster, the
//! stream's leader on a NATS JetStream cluster, the broker of the cache's
//! queue on RocketMQ with two brokers) to the first event published after
//! the kill being applied on every node; p50 and max over the runs, per
//! cluster mode.
//!
//! ```text
//! cargo bench -p integration-tests --bench failover
//! cargo bench -p integration-tests --bench failover -- NATS   # one mode
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it makes one run
//! per mode: a smoke pass over the same code.
//!
//! Method:
//! - A cluster of the test harness (`integration_tests::redis_cluster`,
//!   six servers, `cluster-node-timeout` 1 s; `integration_tests::nats_cluster`,
//!   three servers, the stream on all three; `RocketMqServer::start_with_brokers(2)`,
//!   a queue per broker), four nodes each on a client of
//!   its own, and a publisher that inserts a rising number into one key
//!   every 5 ms, whatever happens (a failed publish is skipped).
//! - Each run: 1 s of steady traffic; kill the leader (`kill -9`); note the
//!   highest number whose publish had begun once the process was gone;
//!   poll every node's cache every millisecond until each holds a larger
//!   number. That time is
//!   the run's recovery. Then the killed server is started again and the
//!   cluster is let settle (it rejoins as a replica; a RocketMQ broker is
//!   given the 11 s its publishers leave it out, so the cache's events are
//!   on it again), and the next run kills whichever server leads then.
//! - The figure includes the cluster's own failover (the replica's
//!   promotion after the node timeout, JetStream's election; RocketMQ has
//!   none, its publishers move to the other broker) and the client's part
//!   (finding the new leader, resubscribing, a resync after a loss). Losses
//!   the nodes signalled are counted alongside.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

// Uses the node start-up and report helpers only.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cache_sync::transport::Transport;
use cache_sync::{
    Publisher,
    transport::{
        NatsJetStreamTransport, RedisPubSubTransport, RedisStreamsTransport, RocketMqTransport,
    },
};
use common::{BenchNode, CACHE, now_us, run_footer, run_header, start_nodes};
use integration_tests::nats_cluster::NatsCluster;
use integration_tests::redis_cluster::RedisCluster;
use integration_tests::rocketmq_server::RocketMqServer;

const NODES: usize = 4;
/// Runs per mode under `cargo bench`.
const RUNS: usize = 10;
/// The longest a recovery may take before the bench gives up.
const GIVE_UP: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy)]
enum Mode {
    RedisStreams,
    RedisShardedPubSub,
    NatsJetStream,
    RocketMqBrokers,
}

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::RedisStreams => "Redis Streams, Redis Cluster (3+3)",
            Mode::RedisShardedPubSub => "sharded Pub/Sub, Redis Cluster (3+3)",
            Mode::NatsJetStream => "NATS JetStream, 3 servers, R3",
            Mode::RocketMqBrokers => "RocketMQ, 2 brokers, a queue on each",
        }
    }
}

/// The cluster a mode runs on.
enum Servers {
    Redis(RedisCluster),
    Nats(NatsCluster),
    /// With the broker the bench cache's queue is on, once known.
    RocketMq(RocketMqServer, Option<usize>),
}

impl Servers {
    fn start(mode: Mode) -> Self {
        match mode {
            Mode::RedisStreams | Mode::RedisShardedPubSub => Servers::Redis(RedisCluster::start()),
            Mode::NatsJetStream => Servers::Nats(NatsCluster::start()),
            Mode::RocketMqBrokers => Servers::RocketMq(RocketMqServer::start_with_brokers(2), None),
        }
    }

    async fn transport(&self, mode: Mode) -> Arc<dyn Transport> {
        match (self, mode) {
            (Servers::Redis(c), Mode::RedisStreams) => Arc::new(
                RedisStreamsTransport::cluster(c.urls())
                    .response_timeout(Duration::from_millis(500))
                    .block(Duration::from_millis(500))
                    .connect()
                    .await
                    .expect("connect"),
            ),
            (Servers::Redis(c), _) => Arc::new(
                RedisPubSubTransport::cluster(c.urls())
                    .response_timeout(Duration::from_millis(500))
                    .ping_timeout(Duration::from_millis(500))
                    .connect()
                    .await
                    .expect("connect"),
            ),
            (Servers::Nats(c), _) => Arc::new(
                NatsJetStreamTransport::builder(c.urls())
                    .replicas(3)
                    .connect()
                    .await
                    .expect("connect"),
            ),
            (Servers::RocketMq(s, _), _) => Arc::new(
                RocketMqTransport::builder(s.namesrv_addr())
                    .queues_per_topic(1)
                    .connect()
                    .await
                    .expect("connect"),
            ),
        }
    }

    /// On RocketMQ, learns which broker the bench cache's events go to: a
    /// cache's queue is its name's hash among the topic's queues, the same
    /// on every topic the transport made, so a publish to another topic
    /// under its name tells.
    async fn find_the_caches_broker(&mut self, mode: Mode) {
        if !matches!(self, Servers::RocketMq(..)) {
            return;
        }
        let transport = self.transport(mode).await;
        let position = transport
            .publish("placement", CACHE, bytes::Bytes::from_static(b"?"))
            .await
            .expect("publish")
            .expect("a RocketMQ publish says where it went");
        let (partition, _) = position.iter().next().expect("one queue");
        let name = partition.split(':').next().unwrap_or_default().to_owned();
        if let Servers::RocketMq(s, broker) = self {
            *broker = (0..s.brokers()).find(|&i| s.broker_name_of(i) == name);
        }
    }

    /// Kills the topic's leader; returns a way to bring it back.
    fn kill_leader(&mut self, topic: &str) -> usize {
        match self {
            Servers::Redis(c) => {
                let master = c.master_of(c.slot(&format!("{{{topic}}}")));
                c.kill(master);
                master
            }
            Servers::Nats(c) => {
                let stream = format!("cache-sync_{topic}");
                let leader = c.stream_leader(&stream).expect("a stream leader");
                c.kill(leader);
                leader
            }
            Servers::RocketMq(s, broker) => {
                let broker = broker.expect("the cache's broker is known");
                s.kill_broker(broker);
                broker
            }
        }
    }

    fn heal(&mut self, killed: usize, topic: &str) {
        match self {
            Servers::Redis(c) => {
                c.restart(killed);
                c.wait_whole();
            }
            Servers::Nats(c) => {
                c.restart(killed);
                c.wait_in_sync(&format!("cache-sync_{topic}"));
            }
            Servers::RocketMq(s, _) => {
                s.restart_broker(killed);
                // Publishers leave a broker they found down out for 10 s:
                // the next run's kill must find the cache's events on it.
                std::thread::sleep(Duration::from_secs(11));
            }
        }
    }
}

/// One mode's runs: (kill → every node applied a later event, kill → the
/// first publish after it acknowledged), and the losses the nodes signalled.
async fn measure(mode: Mode, runs: usize) -> (Vec<(Duration, Duration)>, u64) {
    let mut servers = tokio::task::block_in_place(|| Servers::start(mode));
    servers.find_the_caches_broker(mode).await;
    let topic = format!("failover-{}", now_us());
    let servers_ref = &servers;
    let nodes: Vec<BenchNode> = start_nodes(&topic, NODES, || servers_ref.transport(mode)).await;
    let publisher = Publisher::builder(servers.transport(mode).await)
        .topic(topic.clone())
        .origin("failover-bench")
        .build()
        .expect("publisher");
    // The number whose publish began last.
    let begun = Arc::new(AtomicU64::new(0));
    // The number whose publish was last acknowledged.
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn({
        let (begun, acked, stop) = (Arc::clone(&begun), Arc::clone(&acked), Arc::clone(&stop));
        async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i = i.saturating_add(1);
                begun.store(i, Ordering::Relaxed);
                // Failed publishes (the leader gone) are skipped: the next
                // number carries the key on.
                let sent = tokio::time::timeout(
                    Duration::from_secs(2),
                    publisher.insert(CACHE, [(0u64, i)]),
                )
                .await;
                if matches!(sent, Ok(Ok(_))) {
                    acked.store(i, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let killed = tokio::task::block_in_place(|| servers.kill_leader(&topic));
        // Marked once the process is gone: a number begun later was
        // published after the kill (one begun while the kill was under way
        // could still reach the old master).
        let t0 = Instant::now();
        let mark = begun.load(Ordering::Relaxed);
        let mut published = None;
        loop {
            if published.is_none() && acked.load(Ordering::Relaxed) > mark {
                published = Some(t0.elapsed());
            }
            let mut all = true;
            for n in &nodes {
                if n.cache.get(&0).await.is_none_or(|v| v <= mark) {
                    all = false;
                    break;
                }
            }
            if all {
                break;
            }
            if t0.elapsed() >= GIVE_UP {
                let mut held = Vec::new();
                for n in &nodes {
                    let s = n.node.status();
                    held.push(format!(
                        "{}: {:?}, consuming {}, losses {}",
                        s.node_id,
                        n.cache.get(&0).await,
                        n.node.is_consuming(),
                        s.losses
                    ));
                }
                panic!(
                    "{}: no event after the kill reached every node in {GIVE_UP:?}: marked {mark}, \
                     acknowledged since {}; nodes {held:?}",
                    mode.label(),
                    acked.load(Ordering::Relaxed)
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let applied = t0.elapsed();
        times.push((applied, published.unwrap_or(applied)));
        tokio::task::block_in_place(|| servers.heal(killed, &topic));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = traffic.await;
    let mut losses = 0;
    for n in nodes {
        losses = n.node.status().losses.saturating_add(losses);
        n.node.shutdown().await.expect("shutdown");
    }
    drop(servers);
    (times, losses)
}

fn main() {
    common::main(|full, workers| async move {
        let started = Instant::now();
        run_header(full, workers);
        let runs = if full { RUNS } else { 1 };
        println!(
            "\nrecovery after the topic's leader is killed: kill -> the first event published \
             after it applied on all {NODES} nodes, {runs} run(s) per mode\n"
        );
        println!(
            "| mode | runs | p50 | max | runs, ms (first publish acknowledged after the kill, ms) | losses signalled |\n|---|---:|---:|---:|---|---:|"
        );
        // Words on the command line pick the modes whose label holds one
        // (`-- NATS`).
        let picked: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        for mode in [
            Mode::RedisStreams,
            Mode::RedisShardedPubSub,
            Mode::NatsJetStream,
            Mode::RocketMqBrokers,
        ] {
            if !picked.is_empty() && !picked.iter().any(|w| mode.label().contains(w.as_str())) {
                continue;
            }
            let (runs, losses) = measure(mode, runs).await;
            let listed: Vec<String> = runs
                .iter()
                .map(|(t, p)| format!("{} ({})", t.as_millis(), p.as_millis()))
                .collect();
            let mut times: Vec<Duration> = runs.iter().map(|(t, _)| *t).collect();
            times.sort_unstable();
            let p50 = times[times.len() / 2];
            let max = times[times.len() - 1];
            println!(
                "| {} | {} | {} ms | {} ms | {} | {losses} |",
                mode.label(),
                times.len(),
                p50.as_millis(),
                max.as_millis(),
                listed.join(", ")
            );
        }
        run_footer(started);
    });
}
