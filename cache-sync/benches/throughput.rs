//! What keeping a moka cache in step costs, measured against raw moka and a
//! raw `tokio::sync::broadcast` channel in the same run.
//!
//! ```text
//! cargo bench -p cache-sync --bench throughput              # everything
//! cargo bench -p cache-sync --bench throughput -- latency   # sections whose name contains "latency"
//! ```
//!
//! Sections: `read`, `get_with`, `insert`, `apply`, `latency`. Prints two
//! markdown tables (throughput, then propagation latency), row by row.
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a tiny smoke pass over the same code and checks.
//!
//! Method, briefly (docs/benchmarks/throughput.md has the discussion):
//! - Everything runs as tasks on a hand-built multi-thread runtime with one
//!   worker per core. The driver is itself a task, so it shares the cores with
//!   what it measures instead of getting a thread of its own.
//! - Each micro-benchmark runs several rounds, alternating which side goes
//!   first, on fresh caches; the median round is reported.
//!   Ratio = cache-sync time / baseline time: 1.50× means 50 % slower.
//! - Propagation latency: one event at a time. The publisher stamps each
//!   event with its send time (wall clock, µs); each node's cache records
//!   `now - stamp` as `last_latency_us` when it has applied the event. The
//!   observer sleeps (tokio timer, ≤ ~1 ms), then reads `events_applied` on
//!   every node; once all have the event, the sample is the largest
//!   `last_latency_us`: publish → applied on every node. The baseline's
//!   receiver tasks stamp the same way. Because the observer sleeps rather
//!   than spins, it takes no CPU from the consumers, and the workers park
//!   between events, as they would between real admin changes.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

use std::future::{Future, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cache_sync::transport::StartFrom;
use cache_sync::{Node, NodeBuilder, Publisher, SyncedCache, transport::EmbeddedTransport};
use moka::future::Cache;
use moka::ops::compute::Op;
use tokio::sync::broadcast;

/// Workload sizes: `FULL` under `cargo bench`, `SMOKE` otherwise.
#[derive(Debug, Clone, Copy)]
struct Sizes {
    /// Distinct keys for hits and hot writes.
    keys: u64,
    /// Reads, in total: one task does all, or two tasks half each.
    reads: usize,
    /// Read-through misses, each a distinct key.
    misses: u64,
    /// Local inserts.
    writes: usize,
    /// Single-entry refresh events.
    events: u64,
    /// Multi-entry refresh events, and the entries in each.
    batch_events: u64,
    batch: u64,
    /// Paced events per latency configuration, measured after `warmup`.
    latency_events: usize,
    warmup: usize,
    /// Rounds per micro-benchmark; the median is reported.
    rounds: usize,
}

const FULL: Sizes = Sizes {
    keys: 10_000,
    reads: 1_000_000,
    misses: 100_000,
    writes: 200_000,
    events: 100_000,
    batch_events: 1_000,
    batch: 100,
    latency_events: 2_000,
    warmup: 100,
    rounds: 3,
};

const SMOKE: Sizes = Sizes {
    keys: 100,
    reads: 2_000,
    misses: 500,
    writes: 1_000,
    events: 300,
    batch_events: 10,
    batch: 10,
    latency_events: 10,
    warmup: 2,
    rounds: 1,
};

/// Large enough that nothing is evicted by moka in any benchmark.
const CAPACITY: u64 = 1_000_000;
const NAME: &str = "bench";
const LATENCY_NODES: [usize; 3] = [1, 3, 16];

fn moka() -> Cache<u64, u64> {
    Cache::builder().max_capacity(CAPACITY).build()
}

fn synced() -> SyncedCache<u64, u64> {
    SyncedCache::new(NAME, moka())
}

/// A node for the benchmarks, with default settings. Each run asserts that
/// no refresh was quarantined (the default reorder window is replayed from the
/// transport at start, not quarantined), so every refresh really is installed.
fn node(id: impl Into<String>, transport: &EmbeddedTransport) -> NodeBuilder {
    Node::builder(id, transport.clone())
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A fixed pseudo-random sequence of keys in `0..keys` (xorshift), so both
/// sides touch the same keys in the same order. Its length is a power of two.
fn key_sequence(keys: u64) -> Arc<Vec<u64>> {
    let mut x = 0x9E37_79B9_7F4A_7C15_u64;
    let seq = (0..1 << 16)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % keys
        })
        .collect();
    Arc::new(seq)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `moka::future::Cache`.
    Raw,
    /// `SyncedCache` around the same kind of moka cache.
    Synced,
    /// Raw moka whose writes go through `entry().and_compute_with`, the
    /// primitive every `SyncedCache` write uses.
    RawCompute,
}

/// The thing under test. Every side pays the same enum dispatch.
#[derive(Clone)]
enum Subject {
    Raw(Cache<u64, u64>),
    /// The wrapper, and a handle on the moka cache inside it (moka caches
    /// are shared handles), used only to run moka's housekeeping.
    Synced(SyncedCache<u64, u64>, Cache<u64, u64>),
    RawCompute(Cache<u64, u64>),
}

impl Subject {
    fn fresh(kind: Kind) -> Self {
        match kind {
            Kind::Raw => Self::Raw(moka()),
            Kind::Synced => {
                let inner = moka();
                Self::Synced(SyncedCache::new(NAME, inner.clone()), inner)
            }
            Kind::RawCompute => Self::RawCompute(moka()),
        }
    }

    async fn get(&self, k: u64) -> Option<u64> {
        match self {
            Self::Raw(c) | Self::RawCompute(c) => c.get(&k).await,
            Self::Synced(c, _) => c.get(&k).await,
        }
    }

    async fn get_with(&self, k: u64) -> u64 {
        match self {
            Self::Raw(c) | Self::RawCompute(c) => c.get_with(k, async move { k }).await,
            Self::Synced(c, _) => c.get_with(k, || async move { k }).await,
        }
    }

    async fn insert(&self, k: u64, v: u64) {
        match self {
            Self::Raw(c) => c.insert(k, v).await,
            Self::Synced(c, _) => c.insert(k, v).await,
            Self::RawCompute(c) => {
                c.entry(k).and_compute_with(|_| ready(Op::Put(v))).await;
            }
        }
    }

    /// Lets moka finish the housekeeping the prefill queued, on every side
    /// alike, so none of it lands in the timed part.
    async fn settle(&self) {
        match self {
            Self::Raw(c) | Self::RawCompute(c) | Self::Synced(_, c) => c.run_pending_tasks().await,
        }
    }

    async fn prefill(&self, keys: u64) {
        for k in 0..keys {
            self.insert(k, k).await;
        }
        self.settle().await;
    }
}

/// Spawns `tasks` tasks running `body(subject, task_index)`; returns the wall
/// time until all are done.
async fn timed<F, Fut>(subject: &Subject, tasks: usize, body: F) -> Duration
where
    F: Fn(Subject, usize) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|t| tokio::spawn(body(subject.clone(), t)))
        .collect();
    for h in handles {
        h.await.expect("benchmark task panicked");
    }
    start.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn ns_per(d: Duration, ops: u64) -> f64 {
    d.as_nanos() as f64 / ops as f64
}

/// A subject and its baseline over the same `ops` operations (median rounds).
struct Pair {
    subject: Duration,
    baseline: Duration,
    ops: u64,
}

/// Runs `round(kind)` for `subject` and `baseline`, `rounds` times,
/// alternating which goes first.
async fn pair<F, Fut>(rounds: usize, ops: u64, subject: Kind, baseline: Kind, mut round: F) -> Pair
where
    F: FnMut(Kind) -> Fut,
    Fut: Future<Output = Duration>,
{
    let (mut s, mut b) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        let order = if r % 2 == 0 {
            [subject, baseline]
        } else {
            [baseline, subject]
        };
        for kind in order {
            let d = round(kind).await;
            if kind == subject { &mut s } else { &mut b }.push(d);
        }
    }
    Pair {
        subject: median(s),
        baseline: median(b),
        ops,
    }
}

async fn read_hits(s: Sizes, tasks: usize) -> Pair {
    let keys = key_sequence(s.keys);
    let per_task = s.reads / tasks;
    let ops = (per_task * tasks) as u64;
    pair(s.rounds, ops, Kind::Synced, Kind::Raw, |kind| {
        let keys = keys.clone();
        async move {
            let subject = Subject::fresh(kind);
            subject.prefill(s.keys).await;
            timed(&subject, tasks, |c, t| {
                let keys = keys.clone();
                async move {
                    let mask = keys.len() - 1;
                    let mut hits = 0;
                    for i in 0..per_task {
                        // Tasks start at different points of the sequence.
                        let k = keys[(i + t * 7919) & mask];
                        hits += usize::from(c.get(k).await.is_some());
                    }
                    assert_eq!(hits, per_task, "every read must hit");
                }
            })
            .await
        }
    })
    .await
}

async fn read_through_misses(s: Sizes) -> Pair {
    pair(
        s.rounds,
        s.misses,
        Kind::Synced,
        Kind::Raw,
        |kind| async move {
            let subject = Subject::fresh(kind);
            let d = timed(&subject, 1, |c, _| async move {
                for k in 0..s.misses {
                    std::hint::black_box(c.get_with(k).await);
                }
            })
            .await;
            if let Subject::Synced(c, _) = &subject {
                let st = c.status();
                assert_eq!(st.loads, s.misses, "every get_with must load once");
                assert_eq!(st.loads_superseded, 0);
            }
            d
        },
    )
    .await
}

async fn local_writes(s: Sizes, subject: Kind, distinct: bool) -> Pair {
    let keys = key_sequence(s.keys);
    pair(s.rounds, s.writes as u64, subject, Kind::Raw, |kind| {
        let keys = keys.clone();
        async move {
            let subject = Subject::fresh(kind);
            if !distinct {
                subject.prefill(s.keys).await;
            }
            timed(&subject, 1, |c, _| {
                let keys = keys.clone();
                async move {
                    let mask = keys.len() - 1;
                    for i in 0..s.writes {
                        let k = if distinct { i as u64 } else { keys[i & mask] };
                        c.insert(k, i as u64).await;
                    }
                }
            })
            .await
        }
    })
    .await
}

/// Event apply throughput on one node.
struct Apply {
    /// From the first publish (or, for a backlog, from the node's start) to
    /// `events_applied == events` (median of rounds).
    elapsed: Duration,
    /// Time the publisher took to send everything (median of rounds).
    publishing: Duration,
    backlog: bool,
    events: u64,
    entries: u64,
    /// Raw moka, inserting the same entries (median of rounds).
    raw: Duration,
}

/// Entry `j` of event `e`: keys cycle over `keys`; versions grow with every
/// entry, so every refresh is applied and none is stale.
fn entry(e: u64, j: u64, per_event: u64, keys: u64) -> (u64, u64, Option<u64>) {
    let i = e * per_event + j;
    (i % keys, i, Some(i + 1))
}

/// Polls `done` after each short sleep (never spins) until it holds.
async fn wait_until(mut done: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        // tokio's timer has 1 ms granularity: this wakes at the next tick.
        tokio::time::sleep(Duration::from_micros(100)).await;
        if done() {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
    }
}

/// One round: `events` refresh events of `per_event` entries each, on a
/// fresh transport, node and cache. With `backlog`, all are published before the
/// node starts (reading from the earliest record), so only fetch, decode and
/// apply are timed; otherwise the publisher runs concurrently with the node
/// and both are inside the timing. Returns (elapsed, publishing time).
async fn apply_round(s: Sizes, events: u64, per_event: u64, backlog: bool) -> (Duration, Duration) {
    let entries = events * per_event;
    // History must hold every event, or this would measure loss recovery.
    let transport = EmbeddedTransport::builder()
        .max_records(events as usize + 1_024)
        .max_bytes(1 << 30)
        .build()
        .expect("valid settings");
    let cache = synced();
    let publisher = Publisher::new(transport.clone());
    let publish_all = || async {
        let start = Instant::now();
        for e in 0..events {
            publisher
                .insert_versioned(NAME, (0..per_event).map(|j| entry(e, j, per_event, s.keys)))
                .await
                .expect("publish");
        }
        start.elapsed()
    };
    let node = node("apply", &transport).start_from(StartFrom::Earliest);

    let (node, elapsed, publishing) = if backlog {
        let publishing = publish_all().await;
        let start = Instant::now();
        let node = node.register(&cache).start().await.expect("start node");
        wait_until(|| cache.status().events_applied >= events, "events").await;
        (node, start.elapsed(), publishing)
    } else {
        let node = node.register(&cache).start().await.expect("start node");
        let start = Instant::now();
        let publishing = publish_all().await;
        wait_until(|| cache.status().events_applied >= events, "events").await;
        (node, start.elapsed(), publishing)
    };

    let st = node.status();
    let c = cache.status();
    assert_eq!(st.losses, 0, "the transport history must hold every event");
    assert_eq!(st.publisher_gaps + st.events_rejected, 0);
    assert_eq!(c.events_applied, events);
    assert_eq!(c.refreshes, entries, "every entry must be applied");
    assert_eq!(
        c.stale_ignored + c.invalidations + c.loss_resyncs + c.refreshes_quarantined,
        0
    );
    node.shutdown().await.expect("shutdown");
    (elapsed, publishing)
}

/// The baseline: the same entries inserted into raw moka.
async fn apply_baseline(s: Sizes, events: u64, per_event: u64) -> Duration {
    let raw = moka();
    let start = Instant::now();
    for e in 0..events {
        for j in 0..per_event {
            let (k, v, _) = entry(e, j, per_event, s.keys);
            raw.insert(k, v).await;
        }
    }
    start.elapsed()
}

async fn apply_throughput(s: Sizes, events: u64, per_event: u64, backlog: bool) -> Apply {
    let (mut elapsed, mut publishing, mut raw) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..s.rounds {
        if r % 2 == 1 {
            raw.push(apply_baseline(s, events, per_event).await);
        }
        let (e, p) = apply_round(s, events, per_event, backlog).await;
        elapsed.push(e);
        publishing.push(p);
        if r % 2 == 0 {
            raw.push(apply_baseline(s, events, per_event).await);
        }
    }
    Apply {
        elapsed: median(elapsed),
        publishing: median(publishing),
        backlog,
        events,
        entries: events * per_event,
        raw: median(raw),
    }
}

/// Latency samples (µs, sorted) for cache-sync and the broadcast baseline.
struct Latency {
    synced: Vec<u64>,
    raw: Vec<u64>,
    /// Loss signals and publisher gaps summed over the nodes.
    losses: u64,
}

/// One event at a time to `nodes` nodes; see the module docs for the method.
async fn propagation(s: Sizes, nodes: usize) -> (Vec<u64>, u64) {
    let transport = EmbeddedTransport::builder()
        .max_records(s.warmup + s.latency_events + 1_024)
        .build()
        .expect("valid settings");
    let mut caches = Vec::new();
    let mut handles = Vec::new();
    for n in 0..nodes {
        let cache = synced();
        let node = node(format!("node-{n}"), &transport)
            .register(&cache)
            .start()
            .await
            .expect("start node");
        caches.push(cache);
        handles.push(node);
    }
    let publisher = Publisher::new(transport);
    let mut samples = Vec::with_capacity(s.latency_events);
    for i in 0..(s.warmup + s.latency_events) as u64 {
        let before = now_us();
        publisher
            .insert_versioned(NAME, [(i % s.keys, i, Some(i + 1))])
            .await
            .expect("publish");
        // `events_applied` is bumped just before the latency is stored; also
        // wanting the apply time to be after `before` keeps a sweep that
        // lands in between from reading the previous event's latency.
        wait_until(
            || {
                caches.iter().all(|c| {
                    let st = c.status();
                    st.events_applied > i && st.last_applied_at_us.is_some_and(|t| t >= before)
                })
            },
            "propagation",
        )
        .await;
        let worst = caches
            .iter()
            .filter_map(|c| c.status().last_latency_us)
            .max()
            .expect("every node applied the event");
        if i >= s.warmup as u64 {
            samples.push(worst);
        }
    }
    let mut losses = 0;
    for node in handles {
        let st = node.status();
        losses += st.losses + st.publisher_gaps;
        node.shutdown().await.expect("shutdown");
    }
    samples.sort_unstable();
    (samples, losses)
}

/// The same protocol over a raw broadcast channel: the message is its send
/// time; each receiver task stores `now - sent`, then bumps its count.
async fn broadcast_propagation(s: Sizes, receivers: usize) -> Vec<u64> {
    let (tx, _) = broadcast::channel::<u64>(64);
    let slots: Arc<Vec<(AtomicU64, AtomicU64)>> = Arc::new(
        (0..receivers)
            .map(|_| (AtomicU64::new(0), AtomicU64::new(0)))
            .collect(),
    );
    let mut tasks = Vec::new();
    for r in 0..receivers {
        let mut rx = tx.subscribe();
        let slots = slots.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match rx.recv().await {
                    Ok(sent) => {
                        let (count, latency) = &slots[r];
                        latency.store(now_us().saturating_sub(sent), Ordering::Relaxed);
                        count.fetch_add(1, Ordering::Release);
                    }
                    Err(broadcast::error::RecvError::Closed) => break,
                    Err(broadcast::error::RecvError::Lagged(n)) => panic!("lagged by {n}"),
                }
            }
        }));
    }
    let mut samples = Vec::with_capacity(s.latency_events);
    for i in 0..(s.warmup + s.latency_events) as u64 {
        tx.send(now_us()).expect("receivers alive");
        wait_until(
            || slots.iter().all(|(c, _)| c.load(Ordering::Acquire) > i),
            "broadcast",
        )
        .await;
        let worst = slots
            .iter()
            .map(|(_, l)| l.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0);
        if i >= s.warmup as u64 {
            samples.push(worst);
        }
    }
    drop(tx);
    for t in tasks {
        t.await.expect("receiver task");
    }
    samples.sort_unstable();
    samples
}

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

fn rate(per_sec: f64) -> String {
    if per_sec >= 1e6 {
        format!("{:.2} M/s", per_sec / 1e6)
    } else if per_sec >= 1e4 {
        format!("{:.0} k/s", per_sec / 1e3)
    } else {
        format!("{:.1} k/s", per_sec / 1e3)
    }
}

fn pair_row(id: &str, what: &str, baseline: &str, p: &Pair) {
    println!(
        "| {id} | {what} | {:.0} ns/op | {baseline} | {:.0} ns/op | {:.2}× |",
        ns_per(p.subject, p.ops),
        ns_per(p.baseline, p.ops),
        p.subject.as_secs_f64() / p.baseline.as_secs_f64()
    );
}

fn apply_row(id: &str, what: &str, a: &Apply) {
    let secs = a.elapsed.as_secs_f64();
    let publisher = if a.backlog {
        format!(
            "published beforehand in {:.0} ms, not timed",
            a.publishing.as_secs_f64() * 1e3
        )
    } else {
        format!(
            "publisher done at {:.0} ms",
            a.publishing.as_secs_f64() * 1e3
        )
    };
    println!(
        "| {id} | {what} | {} events = {} entries; {:.0} ns/entry; {:.0} ms ({publisher}) | moka `insert` × {} | {} entries; {:.0} ns/entry | {:.1}× |",
        rate(a.events as f64 / secs),
        rate(a.entries as f64 / secs),
        ns_per(a.elapsed, a.entries),
        secs * 1e3,
        count(a.entries),
        rate(a.entries as f64 / a.raw.as_secs_f64()),
        ns_per(a.raw, a.entries),
        secs / a.raw.as_secs_f64()
    );
}

fn latency_row(id: &str, nodes: usize, l: &Latency) {
    let p = percentile;
    let (s, r) = (&l.synced, &l.raw);
    println!(
        "| {id} | {nodes} | {} | {} | {} | {} | {} | {} | {:.1}× | {} |",
        p(s, 0.50),
        p(s, 0.99),
        p(s, 0.999),
        p(r, 0.50),
        p(r, 0.99),
        p(r, 0.999),
        p(s, 0.50) as f64 / p(r, 0.50).max(1) as f64,
        l.losses,
    );
}

/// How much faster two tasks of pure arithmetic finish than one doing the
/// same work twice: 2.0 on two free cores. Context for the 2-task row, on
/// shared or virtual machines.
async fn parallel_speedup(full: bool) -> f64 {
    fn spin(n: u64) -> u64 {
        let mut x = 1_u64;
        for i in 0..n {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i);
        }
        x
    }
    let n = if full { 200_000_000 } else { 1_000_000 };
    let start = Instant::now();
    std::hint::black_box(spin(2 * n));
    let one = start.elapsed();
    let start = Instant::now();
    let tasks: Vec<_> = (0..2)
        .map(|_| tokio::spawn(async move { std::hint::black_box(spin(n)) }))
        .collect();
    for t in tasks {
        t.await.expect("spin task");
    }
    one.as_secs_f64() / start.elapsed().as_secs_f64()
}

/// Runs the selected sections, printing rows as they complete.
async fn run(s: Sizes, full: bool, workers: usize, wanted: impl Fn(&str) -> bool) {
    let mut phases = Vec::new();
    let total = Instant::now();
    if !full {
        println!("(smoke run with tiny sizes: checks the code paths; the numbers mean nothing)");
    }
    let speedup = parallel_speedup(full).await;
    let (k, reads, writes) = (count(s.keys), count(s.reads as u64), count(s.writes as u64));

    println!(
        "\n### Throughput ({workers} worker threads; median of {} rounds; ratio = cache-sync time / baseline time)\n",
        s.rounds
    );
    println!("| # | operation | cache-sync | baseline | baseline | ratio |");
    println!("|---|---|---:|---|---:|---:|");
    if wanted("read") {
        let t = Instant::now();
        let what = format!("`get` hit, 1 task, {reads} reads over {k} keys");
        pair_row("1a", &what, "moka `get`", &read_hits(s, 1).await);
        let half = count(s.reads as u64 / 2);
        let what = format!("`get` hit, 2 tasks × {half} reads at once (wall time / all reads)");
        pair_row("1b", &what, "moka `get`", &read_hits(s, 2).await);
        phases.push(("read", t.elapsed()));
    }
    if wanted("get_with") {
        let t = Instant::now();
        let what = format!(
            "`get_with` miss + load (loader ready at once), {} distinct keys",
            count(s.misses)
        );
        let p = read_through_misses(s).await;
        pair_row("2", &what, "moka `get_with`", &p);
        phases.push(("get_with", t.elapsed()));
    }
    if wanted("insert") {
        let t = Instant::now();
        let p = local_writes(s, Kind::Synced, false).await;
        let what = format!("`insert`, {writes} writes over {k} hot keys");
        pair_row("3a", &what, "moka `insert`", &p);
        let p = local_writes(s, Kind::Synced, true).await;
        let what = format!("`insert`, {writes} distinct keys (version table holds 100k)");
        pair_row("3b", &what, "moka `insert`", &p);
        let p = local_writes(s, Kind::RawCompute, false).await;
        let what = format!(
            "*reference:* raw moka `entry().and_compute_with(Put)`, {writes} writes over {k} hot keys"
        );
        pair_row("3c", &what, "moka `insert`", &p);
        phases.push(("insert", t.elapsed()));
    }
    if wanted("apply") {
        let t = Instant::now();
        let a = apply_throughput(s, s.events, 1, false).await;
        let what = format!(
            "apply {} single-entry refreshes, publisher concurrent",
            count(a.events)
        );
        apply_row("4a", &what, &a);
        let a = apply_throughput(s, s.batch_events, s.batch, false).await;
        let what = format!(
            "apply {} refreshes × {} entries, publisher concurrent",
            count(a.events),
            s.batch
        );
        apply_row("4b", &what, &a);
        let a = apply_throughput(s, s.events, 1, true).await;
        let what = format!(
            "apply {} single-entry refreshes from a backlog (apply only)",
            count(a.events)
        );
        apply_row("4c", &what, &a);
        phases.push(("apply", t.elapsed()));
    }

    if wanted("latency") {
        let t = Instant::now();
        println!(
            "\n### Propagation latency, publish → applied on every node (µs; {} events one at a time, ≥ 1 ms apart, after {} warm-up)\n",
            s.latency_events, s.warmup
        );
        println!(
            "| # | nodes | cache-sync p50 | p99 | p999 | broadcast p50 | p99 | p999 | p50 ratio | losses |"
        );
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (i, nodes) in LATENCY_NODES.into_iter().enumerate() {
            let (synced, losses) = propagation(s, nodes).await;
            let raw = broadcast_propagation(s, nodes).await;
            let id = format!("5{}", char::from(b'a' + i as u8));
            latency_row(
                &id,
                nodes,
                &Latency {
                    synced,
                    raw,
                    losses,
                },
            );
        }
        phases.push(("latency", t.elapsed()));
    }

    let phases: Vec<_> = phases
        .iter()
        .map(|(name, d)| format!("{name} {:.1} s", d.as_secs_f64()))
        .collect();
    println!(
        "\nrun time {:.1} s ({}); 2 tasks of pure arithmetic ran {speedup:.2}× as fast as 1 (2.00 = two free cores)",
        total.elapsed().as_secs_f64(),
        phases.join(", ")
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let full = args.iter().any(|a| a == "--bench");
    let filters: Vec<String> = args.into_iter().filter(|a| !a.starts_with('-')).collect();
    let wanted = move |section: &str| {
        filters.is_empty() || filters.iter().any(|f| section.contains(f.as_str()))
    };
    let sizes = if full { FULL } else { SMOKE };
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime");
    // The driver runs as a task on the workers, not on the main thread, so it
    // shares the cores with what it measures instead of adding a thread.
    rt.block_on(async move {
        tokio::spawn(run(sizes, full, workers, wanted))
            .await
            .expect("benchmark panicked");
    });
}
