//! The cluster view (issue 13): what heartbeats cost the propagation of
//! changes, and how long an acknowledged publish takes next to a plain one,
//! at 16 nodes on `RedisStreamsTransport`.
//!
//! ```text
//! cargo bench -p integration-tests --no-default-features --features redis --bench cluster
//! # only the acknowledged publishes, at 4, 8, 16 and 64 nodes:
//! cargo bench -p integration-tests --no-default-features --features redis --bench cluster -- --acks-only
//! # only the key probes, at 16 nodes:
//! cargo bench -p integration-tests --no-default-features --features redis --bench cluster -- --probes-only
//! ```
//!
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a tiny smoke pass over the same code and checks.
//! It starts its own `redis-server` with persistence off (the usual setup
//! for a cache-invalidation transport) on a free loopback port, through
//! `integration_tests::redis_server`.
//!
//! Method, briefly (docs/benchmarks/heartbeats.md and acks.md have the discussion):
//! - Every node has its own transport client, as separate processes would;
//!   all nodes, publishers, the watcher and the observer share one tokio
//!   runtime with one worker per core. Every configuration has its own 16
//!   nodes, its own publisher and its own topic (so its own heartbeat
//!   channel), and all of them are started up front.
//! - Heartbeat cost: three configurations, heartbeats off
//!   (`Duration::MAX`), on at the default 2 s, and on at 100 ms (a stress
//!   interval). Events go out one at a time, round-robin between the
//!   configurations (rotating which goes first), so they share the same
//!   noisy moments of the machine. The next event is published only once
//!   every node of the previous one has applied it, as the observer sees on
//!   waking from a 1 ms timer tick. Each node's own figure is the sample:
//!   the cache records `now - stamp` (`last_latency_us`, the publisher's
//!   wall-clock stamp taken just before the transport call) and then bumps
//!   `events_applied`, as in `redis_propagation`. Every node's sample goes
//!   into one histogram, the slowest node per event into another.
//! - Acknowledged publish, at 4, 8, 16 and 64 nodes (issue 21: the extra
//!   time after the last apply must grow at most linearly with the node
//!   count): two more configurations per count, heartbeats on at 2 s.
//!   One has a `Cluster` watcher, started once up front and given 1.5 s to
//!   hear every node; its events are timed from just before the publish
//!   call until `applied_by(&watcher, 5 s)` returns. The other's events are
//!   plain publishes, timed from just before the publish call until the
//!   last node applied the event (the largest `last_applied_at_us`, the
//!   node's own clock, so the observer's wake-up delay is not in it).
//!   The two take turns event by event. Every acked publish must come back
//!   complete and list all 16 nodes, and every node must really have
//!   applied the event when it does; the bench counts the ones that do not.
//! - Key probe (issue 24), at 16 nodes: `Cluster::probe` of one key from a
//!   watcher, from the call to its return, taking turns with a plain
//!   publish to the same nodes, timed as above (call → the last node's
//!   apply): one hop to every node, where a probe makes two (the request
//!   out, an answer back from each). (`applied_version` of a version the
//!   nodes applied is no floor: the nodes' follows answer it at once.)
//!   Every probe must come back complete, listing every node, all agreeing.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

// Shared with the propagation benches; this one uses the node, runtime and
// report helpers only.
#[allow(dead_code)]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use cache_sync::transport::Transport;
use cache_sync::{
    Node, Publisher, SyncedCache, cluster::Cluster, transport::RedisStreamsTransport,
};
use common::{BenchNode, CACHE, STALL, now_us, p, ratio, run_footer, run_header, stop_nodes};
use hdrhistogram::Histogram;
use integration_tests::redis_server::RedisServer;

/// Workload sizes: `FULL` under `cargo bench`, `SMOKE` otherwise.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    nodes: usize,
    /// Paced events before measuring, per configuration.
    warmup: u64,
    /// Paced events measured, per configuration.
    events: u64,
}

const FULL: Sizes = Sizes {
    nodes: 16,
    warmup: 50,
    events: 1000,
};

const SMOKE: Sizes = Sizes {
    nodes: 4,
    warmup: 2,
    events: 5,
};

/// The default heartbeat interval (`NodeBuilder::heartbeat_interval`).
const DEFAULT_INTERVAL: Duration = Duration::from_secs(2);
/// The stress interval: 20 times the default's heartbeat traffic.
const STRESS_INTERVAL: Duration = Duration::from_millis(100);
/// What an acked publish waits at most.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);
/// Given to the watcher after it starts: its roll call's answers must be
/// in before an ack can call itself complete (500 ms grace in the library).
const WATCHER_SETTLE: Duration = Duration::from_millis(1500);
/// The issue's target: heartbeats cost at most this much of the p99.
const TARGET_RATIO: f64 = 1.05;

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

async fn transport(url: &str) -> Arc<dyn Transport> {
    Arc::new(
        RedisStreamsTransport::connect(url)
            .await
            .expect("connect streams transport"),
    )
}

/// One configuration: its nodes, on a topic of their own, and a publisher.
struct Group {
    label: String,
    topic: String,
    publisher: Publisher,
    nodes: Vec<BenchNode>,
}

async fn start_group(url: &str, label: &str, n: usize, interval: Duration) -> Group {
    let topic = format!("cluster-{}-{}", label.replace(' ', "-"), now_us());
    let mut nodes = Vec::with_capacity(n);
    for k in 0..n {
        let cache = SyncedCache::new(CACHE, moka::future::Cache::new(10_000));
        let node = Node::builder(format!("node-{k}"), transport(url).await)
            .topic(&topic)
            .heartbeat_interval(interval)
            .register(&cache)
            .start()
            .await
            .expect("start node");
        nodes.push(BenchNode { node, cache });
    }
    let publisher = Publisher::builder(transport(url).await)
        .topic(&topic)
        .origin("bench")
        .build()
        .expect("publisher");
    Group {
        label: label.to_owned(),
        topic,
        publisher,
        nodes,
    }
}

/// Node `k`'s `(last_latency_us, last_applied_at_us)` once it applied event
/// `i`, published at `t0` (observer's wall clock, just before the call).
fn probe(node: &BenchNode, i: u64, t0: u64) -> Option<(u64, u64)> {
    let st = node.cache.status();
    let at = st.last_applied_at_us?;
    (st.events_applied >= i && at >= t0).then(|| (st.last_latency_us.unwrap_or(0), at))
}

/// Waits until every node applied event `i`, looking after each 1 ms timer
/// tick as `redis_propagation` does (sleeping, so the observer takes no CPU
/// from nodes still applying); then each node's `(latency, applied at)`.
async fn wait_applied(group: &Group, i: u64, t0: u64, started: Instant) -> Vec<(u64, u64)> {
    let mut seen = vec![None; group.nodes.len()];
    loop {
        tokio::time::sleep(Duration::from_millis(1)).await;
        for (node, s) in group.nodes.iter().zip(seen.iter_mut()) {
            if s.is_none() {
                *s = probe(node, i, t0);
            }
        }
        if seen.iter().all(Option::is_some) {
            break;
        }
        assert!(
            started.elapsed() < STALL,
            "event {i} not applied on every node of {} within {STALL:?}",
            group.label
        );
    }
    // Nothing more goes to this group until this returns: the figures are final.
    group
        .nodes
        .iter()
        .map(|n| probe(n, i, t0).expect("applied above"))
        .collect()
}

/// Checks the last value and stops the nodes: what they counted as wrong,
/// and the heartbeats they sent and received in all.
async fn finish(group: Group, last: u64) -> (String, u64, u64) {
    let (mut sent, mut received) = (0, 0);
    for n in &group.nodes {
        let v = n.cache.peek(&0).await;
        assert_eq!(v, Some(last), "{} holds the last value", n.node.id());
        let st = n.node.status();
        sent += st.heartbeats_sent;
        received += st.heartbeats_received;
    }
    (stop_nodes(group.nodes).await, sent, received)
}

fn or_zero(problems: &str) -> &str {
    if problems.is_empty() { "0" } else { problems }
}

// ------------------------------------------------------------ key probes

struct ProbeResult {
    nodes: usize,
    probe_p50: u64,
    probe_p99: u64,
    publish_p50: u64,
    publish_p99: u64,
    /// Probes that came back incomplete, short, or with nodes that
    /// disagree.
    bad: u64,
}

async fn probes(s: Sizes, url: &str) -> ProbeResult {
    let group = start_group(url, "probed", s.nodes, DEFAULT_INTERVAL).await;
    let (t0, started) = (now_us(), Instant::now());
    group
        .publisher
        .insert_versioned(CACHE, [(0_u64, 1_u64, Some(1))])
        .await
        .expect("publish");
    wait_applied(&group, 1, t0, started).await;
    let watcher = Cluster::builder(
        RedisStreamsTransport::connect(url)
            .await
            .expect("connect watcher transport"),
    )
    .topic(group.topic.clone())
    .observer("bench-prober")
    .start()
    .await
    .expect("start watcher");
    tokio::time::sleep(WATCHER_SETTLE).await;
    let (mut probe_h, mut publish_h) = (histogram(), histogram());
    let mut bad = 0;
    // Events applied so far (the versioned one above): `wait_applied`
    // counts them.
    let mut published = 1;
    for i in 0..s.warmup + s.events {
        for j in 0..2 {
            let started = Instant::now();
            let (ok, took) = if (i + j) % 2 == 0 {
                let probe = watcher
                    .probe(CACHE, &0_u64, ACK_TIMEOUT)
                    .await
                    .expect("probe");
                let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                let ok = probe.is_complete() && probe.agrees() && probe.nodes.len() == s.nodes;
                (ok, took)
            } else {
                published += 1;
                let t0 = now_us();
                group
                    .publisher
                    .insert(CACHE, [(0_u64, published)])
                    .await
                    .expect("publish");
                let applied = wait_applied(&group, published, t0, started).await;
                let last = applied.iter().map(|&(_, at)| at).max().unwrap_or(t0);
                (true, last.saturating_sub(t0))
            };
            if i >= s.warmup {
                let h = if (i + j) % 2 == 0 {
                    &mut probe_h
                } else {
                    &mut publish_h
                };
                h.record(took.max(1)).expect("record");
                bad += u64::from(!ok);
            }
        }
    }
    watcher.shutdown().await;
    finish(group, published).await;
    ProbeResult {
        nodes: s.nodes,
        probe_p50: p(&probe_h, 0.5),
        probe_p99: p(&probe_h, 0.99),
        publish_p50: p(&publish_h, 0.5),
        publish_p99: p(&publish_h, 0.99),
        bad,
    }
}

// ------------------------------------------------------------ heartbeat cost

struct Propagation {
    per_node: Histogram<u64>,
    slowest: Histogram<u64>,
    publish_call: Histogram<u64>,
}

/// p99 of heartbeats off, on at the default, on at the stress interval.
struct CostResult {
    off: u64,
    default: u64,
    stress: u64,
    slowest_off: u64,
    slowest_default: u64,
    slowest_stress: u64,
}

async fn heartbeat_cost(s: Sizes, url: &str) -> CostResult {
    let configs = [
        ("off", Duration::MAX),
        ("on, 2 s", DEFAULT_INTERVAL),
        ("on, 100 ms", STRESS_INTERVAL),
    ];
    let mut groups = Vec::new();
    for (label, interval) in configs {
        groups.push(start_group(url, label, s.nodes, interval).await);
    }
    // The nodes' first heartbeats and subscriptions settle before warm-up.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut out: Vec<Propagation> = groups
        .iter()
        .map(|_| Propagation {
            per_node: histogram(),
            slowest: histogram(),
            publish_call: histogram(),
        })
        .collect();
    for i in 1..=s.warmup + s.events {
        for j in 0..groups.len() {
            let idx = (j + i as usize) % groups.len();
            let g = &groups[idx];
            let t0 = now_us();
            let started = Instant::now();
            g.publisher
                .insert(CACHE, [(0_u64, i)])
                .await
                .expect("publish");
            let call = started.elapsed();
            let samples = wait_applied(g, i, t0, started).await;
            if i <= s.warmup {
                continue;
            }
            let o = &mut out[idx];
            o.publish_call.saturating_record(call.as_micros() as u64);
            let mut slowest = 0;
            for (lat, _) in samples {
                o.per_node.saturating_record(lat);
                slowest = slowest.max(lat);
            }
            o.slowest.saturating_record(slowest);
        }
    }

    println!(
        "Propagation latency, publish → applied, µs, {} nodes per configuration; {} paced events \
         each after {} warm-up, round-robin between the configurations; per node = every node's \
         sample, slowest = the slowest node per event.\n",
        s.nodes, s.events, s.warmup
    );
    println!(
        "| heartbeats | per node p50 | p99 | p999 | max | slowest node p50 | p99 | max | publish call p50 | heartbeats sent / received | problems |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let last = s.warmup + s.events;
    for (g, o) in groups.into_iter().zip(&out) {
        let label = g.label.clone();
        let (problems, sent, received) = finish(g, last).await;
        println!(
            "| {label} | {} | {} | {} | {} | {} | {} | {} | {} | {sent} / {received} | {} |",
            p(&o.per_node, 0.50),
            p(&o.per_node, 0.99),
            p(&o.per_node, 0.999),
            o.per_node.max(),
            p(&o.slowest, 0.50),
            p(&o.slowest, 0.99),
            o.slowest.max(),
            p(&o.publish_call, 0.50),
            or_zero(&problems),
        );
    }
    CostResult {
        off: p(&out[0].per_node, 0.99),
        default: p(&out[1].per_node, 0.99),
        stress: p(&out[2].per_node, 0.99),
        slowest_off: p(&out[0].slowest, 0.99),
        slowest_default: p(&out[1].slowest, 0.99),
        slowest_stress: p(&out[2].slowest, 0.99),
    }
}

// ------------------------------------------------------------ acknowledged

struct AckResult {
    nodes: usize,
    acked_p50: u64,
    acked_p99: u64,
    plain_p50: u64,
    plain_p99: u64,
    /// Acked publishes that came back incomplete.
    incomplete: u64,
    /// Acked publishes whose acks did not list every node.
    short: u64,
    /// Acked publishes that came back complete while some node had not
    /// applied the event (by its own status).
    early: u64,
    /// p50 of the time from the last node's apply to `applied_by`'s return.
    trail_p50: u64,
}

async fn acknowledged(s: Sizes, url: &str) -> AckResult {
    let acked = start_group(url, "acked", s.nodes, DEFAULT_INTERVAL).await;
    let plain = start_group(url, "plain", s.nodes, DEFAULT_INTERVAL).await;
    let topic = acked.topic.clone();
    let watcher = Cluster::builder(
        RedisStreamsTransport::connect(url)
            .await
            .expect("connect watcher transport"),
    )
    .topic(topic)
    .observer("bench-watcher")
    .start()
    .await
    .expect("start watcher");
    tokio::time::sleep(WATCHER_SETTLE).await;
    let known = watcher.nodes().len();
    println!(
        "\nWatcher on the acked configuration's topic knows {known} of {} nodes after {:?}.\n",
        s.nodes, WATCHER_SETTLE
    );

    // Acked: publish start → applied_by complete; the wait alone
    // (Acks::elapsed); and, for the same events, when the last node really
    // applied it (publish start → largest applied-at, the plain measure).
    let mut acked_total = histogram();
    let mut acked_wait = histogram();
    let mut acked_applied = histogram();
    // What the ack returns after the last node applied: the heartbeat's
    // trip back through Redis to the watcher, and its wake-up.
    let mut acked_trail = histogram();
    let mut plain_total = histogram();
    let (mut incomplete, mut short, mut early) = (0, 0, 0);
    let mut worst: Option<String> = None;
    for i in 1..=s.warmup + s.events {
        for j in 0..2 {
            let is_acked = (j + i as usize).is_multiple_of(2);
            let g = if is_acked { &acked } else { &plain };
            let t0 = now_us();
            let started = Instant::now();
            let published = g
                .publisher
                .insert(CACHE, [(0_u64, i)])
                .await
                .expect("publish");
            if is_acked {
                let acks = published.applied_by(&watcher, ACK_TIMEOUT).await;
                let total = now_us().saturating_sub(t0);
                // Read at once, before waiting: did the nodes really apply it?
                let applied_now = g.nodes.iter().filter(|n| probe(n, i, t0).is_some()).count();
                let complete = acks.is_complete();
                let samples = wait_applied(g, i, t0, started).await;
                let last_applied = samples.iter().map(|(_, at)| *at).max().unwrap_or(t0) - t0;
                if i <= s.warmup {
                    continue;
                }
                if !complete {
                    incomplete += 1;
                }
                if acks.nodes.len() != s.nodes {
                    short += 1;
                }
                if complete && applied_now < s.nodes {
                    early += 1;
                }
                if !complete || acks.nodes.len() != s.nodes {
                    worst.get_or_insert_with(|| format!("event {i}: {acks}"));
                }
                acked_total.saturating_record(total);
                acked_wait.saturating_record(acks.elapsed.as_micros() as u64);
                acked_applied.saturating_record(last_applied);
                acked_trail.saturating_record(total.saturating_sub(last_applied));
            } else {
                let samples = wait_applied(g, i, t0, started).await;
                if i <= s.warmup {
                    continue;
                }
                let last_applied = samples.iter().map(|(_, at)| *at).max().unwrap_or(t0) - t0;
                plain_total.saturating_record(last_applied);
            }
        }
    }
    watcher.shutdown().await;
    let last = s.warmup + s.events;
    let (acked_problems, _, _) = finish(acked, last).await;
    let (plain_problems, _, _) = finish(plain, last).await;

    println!(
        "Acknowledged publish against plain, µs, {} nodes each, heartbeats every 2 s; {} events \
         each after {} warm-up, taking turns.\n",
        s.nodes, s.events, s.warmup
    );
    println!("| what | p50 | p90 | p99 | max | problems |");
    println!("|---|---:|---:|---:|---:|---|");
    let row = |what: &str, h: &Histogram<u64>, problems: &str| {
        println!(
            "| {what} | {} | {} | {} | {} | {} |",
            p(h, 0.50),
            p(h, 0.90),
            p(h, 0.99),
            h.max(),
            or_zero(problems)
        );
    };
    row(
        "acked: publish start → `applied_by` returns",
        &acked_total,
        &acked_problems,
    );
    row(
        "acked: the `applied_by` wait alone (`Acks::elapsed`)",
        &acked_wait,
        "",
    );
    row(
        "acked: publish start → last node applied (same events)",
        &acked_applied,
        "",
    );
    row(
        "acked: last node applied → `applied_by` returns",
        &acked_trail,
        "",
    );
    row(
        "plain: publish start → last node applied",
        &plain_total,
        &plain_problems,
    );
    println!(
        "\nAcked publishes: {incomplete} incomplete, {short} not listing all {} nodes, {early} \
         complete before every node had applied the event{}.",
        s.nodes,
        worst.map_or(String::new(), |w| format!("; first bad one: {w}"))
    );
    AckResult {
        nodes: s.nodes,
        trail_p50: p(&acked_trail, 0.50),
        acked_p50: p(&acked_total, 0.50),
        acked_p99: p(&acked_total, 0.99),
        plain_p50: p(&plain_total, 0.50),
        plain_p99: p(&plain_total, 0.99),
        incomplete,
        short,
        early,
    }
}

// ------------------------------------------------------------ report

/// Node counts for the acknowledged publishes, with the events measured at
/// each (fewer at 64: every event costs 128 nodes' applies).
const ACK_SIZES: [(usize, u64); 4] = [(4, 1000), (8, 1000), (16, 1000), (64, 300)];

async fn run(s: Sizes, full: bool, workers: usize) {
    let started = Instant::now();
    run_header(full, workers);
    let acks_only = std::env::args().any(|a| a == "--acks-only");
    let probes_only = std::env::args().any(|a| a == "--probes-only");
    let redis = RedisServer::start_with(&["--appendonly", "no"]);
    let url = redis.url();
    println!(
        "Server: redis-server with persistence off (--appendonly no; RDB saves are off too).\n"
    );
    let probed = if acks_only {
        None
    } else {
        Some(
            probes(
                Sizes {
                    events: s.events.min(300),
                    ..s
                },
                &url,
            )
            .await,
        )
    };
    let cost = if acks_only || probes_only {
        None
    } else {
        Some(heartbeat_cost(s, &url).await)
    };
    let mut acks = Vec::new();
    if full && !probes_only {
        for (nodes, events) in ACK_SIZES {
            acks.push(acknowledged(Sizes { nodes, events, ..s }, &url).await);
        }
    } else if !probes_only {
        acks.push(acknowledged(s, &url).await);
    }
    drop(redis);

    let smoke = if full {
        ""
    } else {
        " (smoke sizes: meaningless)"
    };
    println!("\n#### Goals{smoke}\n");
    if let Some(cost) = cost {
        let r = ratio(cost.default, cost.off);
        println!(
            "- heartbeats cost ≤ 5 % of the {}-node p99 (on at 2 s ÷ off): {} µs vs {} µs = {r:.3}× → {}",
            s.nodes,
            cost.default,
            cost.off,
            if r <= TARGET_RATIO { "PASS" } else { "FAIL" }
        );
        println!(
            "- for reference, on at 100 ms ÷ off: {} µs vs {} µs = {:.3}×; slowest-node p99, 2 s / 100 ms ÷ off: {:.3}× / {:.3}×",
            cost.stress,
            cost.off,
            ratio(cost.stress, cost.off),
            ratio(cost.slowest_default, cost.slowest_off),
            ratio(cost.slowest_stress, cost.slowest_off),
        );
    }
    if let Some(r) = &probed {
        println!(
            "\nKey probes from a watcher (µs, call → return), taking turns with a plain publish to the same nodes (call → last node applied: one hop, where a probe makes two):\n"
        );
        println!(
            "| nodes | probe p50 | probe p99 | publish p50 | publish p99 | p50 ratio | p99 ratio | bad |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
        println!(
            "| {} | {} | {} | {} | {} | {:.2}× | {:.2}× | {} |",
            r.nodes,
            r.probe_p50,
            r.probe_p99,
            r.publish_p50,
            r.publish_p99,
            ratio(r.probe_p50, r.publish_p50),
            ratio(r.probe_p99, r.publish_p99),
            r.bad
        );
    }
    let ok = acks
        .iter()
        .all(|a| a.incomplete == 0 && a.short == 0 && a.early == 0);
    if !acks.is_empty() {
        println!(
            "\n| nodes | acked p50 | plain p50 | acked ÷ plain p50 | acked p99 | plain p99 | acked ÷ plain p99 | last apply → ack p50 |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
        for a in &acks {
            println!(
                "| {} | {} | {} | {:.2}× | {} | {} | {:.2}× | {} |",
                a.nodes,
                a.acked_p50,
                a.plain_p50,
                ratio(a.acked_p50, a.plain_p50),
                a.acked_p99,
                a.plain_p99,
                ratio(a.acked_p99, a.plain_p99),
                a.trail_p50,
            );
        }
        println!();
        if let Some(a) = acks.iter().find(|a| a.nodes == 16) {
            let r = ratio(a.acked_p50, a.plain_p50);
            println!(
                "- acked ÷ plain p50 at 16 nodes ≤ 1.5×: {r:.2}× → {}",
                if r <= 1.5 { "PASS" } else { "FAIL" }
            );
        }
        if let (Some(first), Some(last)) = (acks.first(), acks.last())
            && last.nodes > first.nodes
        {
            // Linear growth allows the trail to grow by the node count's ratio.
            let grew = ratio(last.trail_p50, first.trail_p50.max(1));
            let allowed = last.nodes as f64 / first.nodes as f64;
            println!(
                "- after the last apply, {} → {} nodes: {} → {} µs = {grew:.2}× (linear allows {allowed:.0}×) → {}",
                first.nodes,
                last.nodes,
                first.trail_p50,
                last.trail_p50,
                if grew <= allowed { "PASS" } else { "FAIL" }
            );
        }
        for a in &acks {
            println!(
                "- {} nodes: every acked publish complete, listing every node, none before the nodes applied it: {} incomplete, {} short, {} early",
                a.nodes, a.incomplete, a.short, a.early
            );
        }
        println!("- all of them → {}", if ok { "PASS" } else { "FAIL" });
    }
    let probes_ok = probed.as_ref().is_none_or(|r| r.bad == 0);
    if let Some(r) = &probed {
        println!(
            "- {} nodes: every key probe complete, listing every node, all agreeing: {} bad → {}",
            r.nodes,
            r.bad,
            if probes_ok { "PASS" } else { "FAIL" }
        );
    }
    run_footer(started);
    assert!(ok, "acknowledged publishes went wrong (see above)");
    assert!(probes_ok, "key probes went wrong (see above)");
}

fn main() {
    common::main(move |full, workers| run(if full { FULL } else { SMOKE }, full, workers));
}
