//! What the propagation benches share, whatever the transport: the paced
//! latency protocol, the histograms, cache-sync nodes, the raw receivers'
//! bookkeeping and the table. Each bench adds its transports, their raw
//! floors and anything it reports beyond latency.
//!
//! Every bench includes this with `mod common;` and compiles its own copy, so
//! the module is `pub(crate)` throughout and every item in it is used by every
//! bench.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use cache_sync::transport::Transport;
use cache_sync::{Node, Publisher, SyncedCache};
use hdrhistogram::Histogram;
use tokio::task::JoinHandle;

/// Paced latency sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    /// Paced events before measuring, per configuration.
    pub(crate) warmup: u64,
    /// Paced events measured, per configuration.
    pub(crate) events: u64,
    /// Node counts.
    pub(crate) nodes: &'static [usize],
}

/// The cache every node registers, and the key every event refreshes.
pub(crate) const CACHE: &str = "bench";

/// A paced event (or a throughput run's last event) must be applied within this.
pub(crate) const STALL: Duration = Duration::from_secs(20);

pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

/// One latency configuration's results.
pub(crate) struct Latency {
    /// One sample per node per event.
    pub(crate) per_node: Histogram<u64>,
    /// One sample per event: the slowest node.
    pub(crate) slowest: Histogram<u64>,
    /// How long the publish call itself took (publisher side).
    pub(crate) publish_call: Histogram<u64>,
    /// Anything wrong the nodes reported (losses, gaps, errors); empty if clean.
    pub(crate) problems: String,
}

impl Latency {
    fn new() -> Self {
        Self {
            per_node: histogram(),
            slowest: histogram(),
            publish_call: histogram(),
            problems: String::new(),
        }
    }
}

// ------------------------------------------------------------ raw receivers

/// The publishing side of a raw floor: the same protocol on a broker's own
/// client, with nothing of cache-sync in it. Its receivers record into
/// [`Slot`]s (see [`System::raw`]).
#[async_trait]
pub(crate) trait RawFloor: Send + Sync {
    /// Sends one message carrying [`now_us`], taken just before the call.
    async fn publish(&self);

    /// Closes whatever the receiver tasks do not own, once they are stopped.
    async fn close(self: Box<Self>) {}
}

/// What one raw receiver has seen: latency first, then the count (Release).
#[derive(Debug, Default)]
pub(crate) struct Slot {
    count: AtomicU64,
    latency: AtomicU64,
}

impl Slot {
    pub(crate) fn observe(&self, stamp: u64) {
        self.latency
            .store(now_us().saturating_sub(stamp), Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Release);
    }

    fn probe(&self, i: u64) -> Option<u64> {
        (self.count.load(Ordering::Acquire) >= i).then(|| self.latency.load(Ordering::Relaxed))
    }
}

/// The publisher's clock in a raw message's payload.
pub(crate) fn stamp_of(bytes: &[u8]) -> u64 {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .expect("a stamp payload")
}

pub(crate) fn new_slots(n: usize) -> Vec<Arc<Slot>> {
    (0..n).map(|_| Arc::default()).collect()
}

// ------------------------------------------------------------ systems

/// Some receivers ("nodes") and the way to publish to them.
pub(crate) enum System {
    CacheSync {
        publisher: Publisher,
        nodes: Vec<BenchNode>,
    },
    Raw {
        floor: Box<dyn RawFloor>,
        /// One per receiver ("node").
        slots: Vec<Arc<Slot>>,
        /// The receivers, if they run as tasks here; aborted when done.
        tasks: Vec<JoinHandle<()>>,
    },
}

impl System {
    pub(crate) fn raw(
        floor: impl RawFloor + 'static,
        slots: Vec<Arc<Slot>>,
        tasks: Vec<JoinHandle<()>>,
    ) -> Self {
        System::Raw {
            floor: Box::new(floor),
            slots,
            tasks,
        }
    }

    fn nodes(&self) -> usize {
        match self {
            System::CacheSync { nodes, .. } => nodes.len(),
            System::Raw { slots, .. } => slots.len(),
        }
    }

    async fn publish(&self, i: u64) {
        match self {
            System::CacheSync { publisher, .. } => {
                publisher
                    .insert(CACHE, [(0_u64, i)])
                    .await
                    .expect("publish");
            }
            System::Raw { floor, .. } => floor.publish().await,
        }
    }

    /// Node `k`'s latency for event `i`, once it has applied it; `t0` is the
    /// observer's clock from just before the publish.
    fn probe(&self, k: usize, i: u64, t0: u64) -> Option<u64> {
        match self {
            System::CacheSync { nodes, .. } => {
                let st = nodes[k].cache.status();
                (st.events_applied >= i && st.last_applied_at_us.is_some_and(|a| a >= t0))
                    .then(|| st.last_latency_us.unwrap_or(0))
            }
            System::Raw { slots, .. } => slots[k].probe(i),
        }
    }

    /// Stops the receivers; returns what the nodes counted as wrong.
    async fn finish(self, last: u64) -> String {
        match self {
            System::CacheSync { nodes, .. } => {
                for node in &nodes {
                    let v = node.cache.peek(&0).await;
                    assert_eq!(v, Some(last), "{} holds the last value", node.node.id());
                }
                stop_nodes(nodes).await
            }
            System::Raw { floor, tasks, .. } => {
                for t in tasks {
                    t.abort();
                }
                floor.close().await;
                String::new()
            }
        }
    }
}

/// Publishes events 1, 2, 3, … to each system in turn (rotating which goes
/// first), one at a time: an event goes out only once every node of the
/// previous one has applied its event, seen on waking from a timer tick
/// (≈ 1 ms). Interleaving puts the systems through
/// the same moments of a noisy machine, so their ratios are fairer than
/// those of back-to-back runs.
async fn paced(s: Sizes, systems: &[System]) -> Vec<Latency> {
    let mut out: Vec<Latency> = systems.iter().map(|_| Latency::new()).collect();
    for i in 1..=s.warmup + s.events {
        for j in 0..systems.len() {
            let idx = (j + i as usize) % systems.len();
            let sys = &systems[idx];
            let t0 = now_us();
            let started = Instant::now();
            sys.publish(i).await;
            let call = started.elapsed();
            let mut seen = vec![false; sys.nodes()];
            loop {
                // Sleep before looking, even when the nodes were done before
                // the publish call returned: every event then starts from the
                // same state (just woken by the timer, workers idle for about
                // a tick), whichever system went before. And the probes never
                // take CPU from nodes still applying: a cache-sync probe reads
                // a whole status snapshot, a raw one two atomics.
                tokio::time::sleep(Duration::from_millis(1)).await;
                for (k, done) in seen.iter_mut().enumerate() {
                    *done = *done || sys.probe(k, i, t0).is_some();
                }
                if seen.iter().all(|d| *d) {
                    break;
                }
                assert!(
                    started.elapsed() < STALL,
                    "event {i} not applied on every node within {STALL:?}: system {idx} \
                     (0 is cache-sync), applied per node {seen:?}"
                );
            }
            if i <= s.warmup {
                continue;
            }
            let l = &mut out[idx];
            l.publish_call.saturating_record(call.as_micros() as u64);
            let mut slowest = 0;
            for k in 0..sys.nodes() {
                // Nothing more is published to it until this returns, so
                // these figures are final.
                let lat = sys.probe(k, i, t0).expect("applied above");
                l.per_node.saturating_record(lat);
                slowest = slowest.max(lat);
            }
            l.slowest.saturating_record(slowest);
        }
    }
    out
}

/// Runs the systems side by side (see [`paced`]), then stops them. Whatever
/// any node counted as wrong ends up in the first system's `problems`.
pub(crate) async fn measure(s: Sizes, systems: Vec<System>) -> Vec<Latency> {
    let mut lat = paced(s, &systems).await;
    for sys in systems {
        let problems = sys.finish(s.warmup + s.events).await;
        lat[0].problems.push_str(&problems);
    }
    lat
}

// ------------------------------------------------------------ cache-sync

/// A started node with its one cache.
pub(crate) struct BenchNode {
    // Visible to the benches that start nodes with settings of their own
    // (the cluster bench's heartbeat intervals).
    pub(crate) node: Node,
    pub(crate) cache: SyncedCache<u64, u64>,
}

/// `n` nodes on `topic`, each on a transport client of its own from `transport`, as
/// separate processes would have.
pub(crate) async fn start_nodes<F, Fut>(topic: &str, n: usize, transport: F) -> Vec<BenchNode>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Transport>>,
{
    let mut nodes = Vec::with_capacity(n);
    for k in 0..n {
        let cache = SyncedCache::new(CACHE, moka::future::Cache::new(10_000));
        let node = Node::builder(format!("node-{k}"), transport().await)
            .topic(topic)
            .register(&cache)
            .start()
            .await
            .expect("start node");
        nodes.push(BenchNode { node, cache });
    }
    nodes
}

/// Shuts the nodes down and reports whatever they counted as wrong.
pub(crate) async fn stop_nodes(nodes: Vec<BenchNode>) -> String {
    let mut problems = Vec::new();
    for n in nodes {
        n.node.shutdown().await.expect("shutdown");
        let s = n.node.status();
        let c = &s.caches[0];
        let bad = [
            ("losses", s.losses),
            ("gaps", s.publisher_gaps),
            ("rejected", s.events_rejected),
            ("transport errors", s.transport_errors),
            ("quarantined", c.refreshes_quarantined),
            ("resyncs", c.loss_resyncs),
        ];
        for (what, count) in bad {
            if count > 0 {
                problems.push(format!("{}: {count} {what}", s.node_id));
            }
        }
    }
    problems.join("; ")
}

/// `n` nodes on `topic` (see [`start_nodes`]) and a publisher with a transport
/// client of its own.
pub(crate) async fn cache_sync_system<F, Fut>(topic: String, n: usize, transport: F) -> System
where
    F: Fn() -> Fut,
    Fut: Future<Output = Arc<dyn Transport>>,
{
    let nodes = start_nodes(&topic, n, &transport).await;
    let publisher = Publisher::builder(transport().await)
        .topic(topic)
        .origin("bench")
        .build()
        .expect("publisher");
    System::CacheSync { publisher, nodes }
}

// ------------------------------------------------------------ report

pub(crate) fn p(h: &Histogram<u64>, q: f64) -> u64 {
    h.value_at_quantile(q)
}

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b.max(1) as f64
}

/// The paragraph above a latency table; `raw` says what the raw floor runs on.
pub(crate) fn latency_intro(s: Sizes, raw: &str) {
    println!(
        "Propagation latency, publish → applied, µs; {} paced events per row after {} warm-up; \
         percentiles over every node's samples; raw = the same protocol on {raw}.\n",
        s.events, s.warmup
    );
}

/// The head of a latency table. Each of `variants` is a column for a further
/// raw variant, after the ratios.
pub(crate) fn latency_header(variants: &[&str]) {
    let cols: String = variants.iter().map(|v| format!(" {v} |")).collect();
    println!(
        "| transport | nodes | cache-sync p50 | p99 | p999 | raw p50 | p99 | p999 | p50 ratio | p99 ratio |{cols} slowest node p99, cache-sync / raw | publish call p50, cache-sync / raw | problems |"
    );
    println!("|---|{}---:|---:|---|", "---:|".repeat(9 + variants.len()));
}

/// Measures one row of a table with `variants` columns (see
/// [`latency_header`]) and prints it: `systems[0]` is cache-sync,
/// `systems[1]` its raw floor, and any further system is a raw variant shown
/// as "p50 / p99" in the next variant column ("–" where a row has none).
pub(crate) async fn latency_row(
    s: Sizes,
    transport: &str,
    nodes: usize,
    variants: usize,
    systems: Vec<System>,
) -> Vec<Latency> {
    let lat = measure(s, systems).await;
    let (cs, raw) = (&lat[0], &lat[1]);
    let (c, r) = (&cs.per_node, &raw.per_node);
    let problems = if cs.problems.is_empty() {
        "0"
    } else {
        cs.problems.as_str()
    };
    let cols: String = (0..variants)
        .map(|v| {
            lat.get(2 + v).map_or(" – |".to_owned(), |h| {
                format!(" {} / {} |", p(&h.per_node, 0.50), p(&h.per_node, 0.99))
            })
        })
        .collect();
    println!(
        "| {transport} | {nodes} | {} | {} | {} | {} | {} | {} | {:.2}× | {:.2}× |{cols} {} / {} | {} / {} | {problems} |",
        p(c, 0.50),
        p(c, 0.99),
        p(c, 0.999),
        p(r, 0.50),
        p(r, 0.99),
        p(r, 0.999),
        ratio(p(c, 0.50), p(r, 0.50)),
        ratio(p(c, 0.99), p(r, 0.99)),
        p(&cs.slowest, 0.99),
        p(&raw.slowest, 0.99),
        p(&cs.publish_call, 0.50),
        p(&raw.publish_call, 0.50),
    );
    lat
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

/// The lines every run starts with.
pub(crate) fn run_header(full: bool, workers: usize) {
    if !full {
        println!("(smoke run with tiny sizes: checks the code paths; the numbers mean nothing)");
    }
    println!(
        "\n{workers} tokio worker threads; load average at start {}",
        loadavg()
    );
}

/// The line every run ends with.
pub(crate) fn run_footer(started: Instant) {
    println!(
        "\nrun time {:.1} s; load average at end {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
}

/// `--bench` on the command line (as `cargo bench` passes it) selects the
/// full sizes; anything else, as under `cargo test --all-targets`, a smoke
/// pass. `run(full, workers)` runs on a multi-thread runtime with one worker
/// per core.
pub(crate) fn main<F, Fut>(run: F)
where
    F: FnOnce(bool, usize) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let full = std::env::args().skip(1).any(|a| a == "--bench");
    // What the library logs, to stderr, when RUST_LOG asks for it.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let driver = run(full, workers);
    // The driver runs as a task on the workers, not on the main thread, so it
    // shares the cores with what it measures instead of adding a thread.
    rt.block_on(async move {
        tokio::spawn(driver).await.expect("benchmark panicked");
    });
}
