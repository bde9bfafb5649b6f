//! Soak: 16 nodes on Redis Streams under a steady stream of changes for 10
//! minutes. Does resident memory stay flat, does every node keep up (its lag
//! behind the newest event does not grow), and is nothing lost?
//!
//! ```text
//! cargo bench -p integration-tests --features redis --bench soak
//! # shorter, slower, other sizes (every setting also reads SOAK_<NAME>,
//! # e.g. SOAK_RATE=5000; a command-line flag wins):
//! cargo bench -p integration-tests --features redis --bench soak -- --secs 120 --rate 5000
//! ```
//!
//! Flags: `--secs` (run length, default 600), `--rate` (events/s, 10 000),
//! `--nodes` (16), `--keys` (key space, 50 000), `--publishers` (16),
//! `--reads` (reads per node per second, 1000), `--sample-secs` (10).
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it ignores them and runs a 3 s smoke pass: 2 nodes, 500
//! events/s, 1000 keys, a sample each second, and it asserts that nothing was lost and that
//! every node ends up consistent with the source of truth.
//!
//! How:
//! - Its own `redis-server` on a free loopback port, through
//!   `integration_tests::redis_server`, with persistence off
//!   (`--appendonly no`, and the harness's `--save ""`): the usual setup for
//!   Redis carrying cache changes, as the propagation bench's second pass.
//!   Streams keep the transport's default `MAXLEN ~ 100000`, so a node more
//!   than about 10 s behind at 10 000 events/s loses events (a `trimmed`
//!   loss) and resyncs.
//! - Nodes: each with its own `RedisStreamsTransport` (its own connections),
//!   as separate processes would have, default settings, one
//!   `SyncedCache<u64, Row>` over the whole key space. All nodes, the
//!   publishers and the readers are tasks in this one process, on a tokio
//!   runtime with one worker per core; so the resident memory reported is
//!   that of all of them together.
//! - Source of truth: one version per key (an atomic). A change bumps the
//!   key's version and then publishes it, so every key's versions only go
//!   up; loaders read it, so a node's cache can be checked against it at the
//!   end.
//! - Publishing: `--publishers` `Publisher`s, each with its own transport
//!   connection, each owning the keys `k % publishers == i`: an admin
//!   service with several workers. Each paces itself with a 10 ms tokio
//!   interval and sends its share of the rate as a burst per tick (100
//!   events per tick in all at 10 000/s), the burst's calls in flight
//!   together (the publisher pipelines them within its window, issue 36;
//!   before that a publisher did one Redis round trip at a time and 16 of
//!   them reached about 7 500 events/s here). A late tick is caught up at
//!   once (tokio's default), so the achieved rate shows what the publishers
//!   managed. The mix: 88 % single versioned
//!   refreshes, 10 % versioned invalidations, 2 % versioned refreshes of
//!   2–16 keys in one event.
//! - Readers: one task per node, `--reads` per second in 10 ms bursts of
//!   uniformly random keys, half `get`, half `get_with` (which loads from
//!   the source of truth on a miss).
//! - A monitor task probes every 100 ms: the events published so far (counted
//!   when the publish call returns) and each node's `events_applied`; their
//!   difference is the node's lag, in events (0 when a node has applied an
//!   event before its publish call returned). It also records each node's
//!   `last_latency_us` whenever the node applied something since the last
//!   probe: so latency percentiles are over those probes (up to 100 per
//!   node per 10 s), not over every event, since a cache reports only its
//!   last event's latency.
//! - Every `--sample-secs` it prints a table row and appends it to a CSV file
//!   under the target directory (`<target>/soak/soak-<unix time>.csv`, or
//!   `soak-smoke.csv` for a smoke pass; the path is printed at the start):
//!   the process's `VmRSS` and redis-server's (from `/proc/<pid>/status`,
//!   its pid from `INFO server`), the largest lag now and within the window,
//!   latency p99 and max within the window, the version-table size
//!   (`tracked_keys`) and moka's `entries`, lowest and highest over the
//!   nodes, losses, and the CPU time this process, redis-server and
//!   everything else on the machine used in the window (from
//!   `/proc/<pid>/stat` and `/proc/stat`; 100 % = one core), also per event
//!   published.
//! - No PNG: plotters writes PNG only through its `bitmap_encoder` feature
//!   (the `image` crate) and draws axis labels only with a font feature
//!   (`ttf`, which needs font-kit and fontconfig, or `ab_glyph` plus a font
//!   file); that is a lot to build into every `cargo test` for a plot any
//!   spreadsheet draws from the CSV.
//! - At the end the publishers stop, the nodes are given up to 60 s to apply
//!   everything, every cached entry on every node is compared with the
//!   source of truth, and the nodes are shut down and their counters read.
//!
//! Verdicts (the whole definitions are printed with them; in a run shorter
//! than 3 minutes, "a minute" below is a third of the run):
//! - the publishers reached the target rate (at least 99 % of it over the
//!   run): if not, the other verdicts hold only for the rate reached;
//! - resident memory flat within ±10 % after the first minute: every sample
//!   from 60 s on is within 10 % of the first one at or after 60 s. Below
//!   it, not a verdict: when the RSS last grew by more than 1 % between two
//!   samples, and its range from then on, since a slower run fills its
//!   caches and version tables later;
//! - lag not growing: the mean of the 100 ms lag probes (the largest over
//!   the nodes at each probe) over the last minute is at most 1.5× its mean
//!   over the second minute plus 100 ms worth of events. The slope of a
//!   least-squares line through the probes after the first minute is shown
//!   too;
//! - every node applied every event within 60 s of the end;
//! - 0 losses: no node counted a loss, a publisher gap, a resync, a
//!   rejected event, a quarantined refresh or a transport error, and no
//!   publish call failed;
//! - every cached entry on every node equals the source of truth.
//!
//! On the reference machine (2 shared cores) the nodes, the publishers, the
//! readers and redis-server all share those cores. A publisher waits for
//! its tick's calls before its next tick, so when the cores run out the publishing rate drops first and
//! the nodes' lag may stay flat: read the achieved rate and the CPU columns
//! before the lag.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cache_sync::status::NodeStatus;
use cache_sync::{Node, Publisher, SyncedCache, transport::RedisStreamsTransport};
use hdrhistogram::Histogram;
use integration_tests::redis_server::RedisServer;
use redis::Client;
use serde::{Deserialize, Serialize};

/// The cache every node registers.
const CACHE: &str = "soak";

/// Each publisher's and reader's pacing tick.
const TICK: Duration = Duration::from_millis(10);

/// How often the monitor probes lag and latency.
const PROBE: Duration = Duration::from_millis(100);

/// How long the nodes get to apply everything once publishing stops.
const DRAIN: Duration = Duration::from_secs(60);

/// The first minute is start-up: caches and version tables filling.
const WARM_UP: Duration = Duration::from_secs(60);

/// Run settings; see the module docs for the flags.
#[derive(Debug, Clone, Copy)]
struct Config {
    full: bool,
    secs: u64,
    rate: u64,
    nodes: usize,
    keys: u64,
    publishers: usize,
    reads: u64,
    sample_secs: u64,
}

impl Config {
    fn from_args() -> Self {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let full = args.iter().any(|a| a == "--bench");
        let mut c = if full {
            Config {
                full,
                secs: 600,
                rate: 10_000,
                nodes: 16,
                keys: 50_000,
                publishers: 16,
                reads: 1000,
                sample_secs: 10,
            }
        } else {
            Config {
                full,
                secs: 3,
                rate: 500,
                nodes: 2,
                keys: 1000,
                publishers: 1,
                reads: 200,
                sample_secs: 1,
            }
        };
        // Only a full run takes settings, so no flag or stray SOAK_*
        // variable can slow down the smoke pass `cargo test` runs.
        let setting = |name: &str| -> Option<u64> {
            if !full {
                return None;
            }
            let flag = format!("--{name}");
            let from_args = args
                .iter()
                .position(|a| *a == flag)
                .and_then(|i| args.get(i + 1))
                .cloned();
            let env = format!("SOAK_{}", name.to_uppercase().replace('-', "_"));
            from_args.or_else(|| std::env::var(env).ok()).map(|v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{flag}: not a number: {v:?}"))
            })
        };
        c.secs = setting("secs").unwrap_or(c.secs);
        c.rate = setting("rate").unwrap_or(c.rate);
        c.keys = setting("keys").unwrap_or(c.keys);
        c.reads = setting("reads").unwrap_or(c.reads);
        c.sample_secs = setting("sample-secs").unwrap_or(c.sample_secs).max(1);
        c.nodes = setting("nodes").map_or(c.nodes, |n| n as usize);
        c.publishers = setting("publishers").map_or(c.publishers, |n| n as usize);
        assert!(
            c.nodes >= 1 && c.publishers >= 1,
            "need a node and a publisher"
        );
        assert!(
            c.keys >= c.publishers as u64,
            "need at least one key per publisher"
        );
        c
    }

    /// The start-up phase the verdicts leave out: a minute, or a third of a
    /// shorter run.
    fn warm_up(&self) -> Duration {
        WARM_UP.min(Duration::from_secs(self.secs) / 3)
    }
}

// ------------------------------------------------------------ helpers

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// splitmix64: enough randomness for picking keys, without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ now_us())
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds")
}

/// `VmRSS` of a process, in KiB.
fn rss_kib(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// User + system CPU time of a process, in clock ticks.
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces; count from after it.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The machine's (busy, total) clock ticks over all cores, and the number
/// of cores, from `/proc/stat`: to tell how much CPU other processes took.
fn machine_ticks() -> Option<(u64, u64, usize)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cores = stat
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
        .count();
    let all: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is
    // already counted in user).
    let total: u64 = all.iter().take(8).sum();
    let idle = all.get(3)? + all.get(4)?;
    Some((total - idle, total, cores))
}

/// Clock ticks per second, for `cpu_ticks`; 100 on Linux nearly always.
fn clock_ticks_per_sec() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

/// `<target>/soak`: the directory three levels above this binary
/// (`<target>/release/deps/soak-…`), so it follows `CARGO_TARGET_DIR`.
fn out_dir() -> PathBuf {
    let exe = std::env::current_exe().ok();
    let target = exe
        .as_deref()
        .and_then(|e| e.ancestors().find(|a| a.ends_with("deps")))
        .and_then(|deps| deps.parent()?.parent())
        .map_or_else(|| PathBuf::from("target"), PathBuf::from);
    target.join("soak")
}

// ------------------------------------------------------------ source of truth

/// A cached row. Small, as dictionary rows are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Row {
    version: u64,
    price: u64,
}

impl Row {
    fn of(key: u64, version: u64) -> Self {
        Row {
            version,
            price: key.wrapping_mul(31).wrapping_add(version),
        }
    }
}

/// One version per key; 0 = never changed.
struct Db {
    versions: Vec<AtomicU64>,
}

impl Db {
    fn new(keys: u64) -> Self {
        Db {
            versions: (0..keys).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Bumps the key's version (only its one publisher does).
    fn change(&self, key: u64) -> u64 {
        self.versions[key as usize].fetch_add(1, Relaxed) + 1
    }

    fn row(&self, key: u64) -> Row {
        Row::of(key, self.versions[key as usize].load(Relaxed))
    }
}

// ------------------------------------------------------------ the run

struct SoakNode {
    node: Node,
    cache: SyncedCache<u64, Row>,
}

/// What the tasks count, read by the monitor.
#[derive(Default)]
struct Counters {
    /// Events whose publish call returned.
    published: AtomicU64,
    publish_errors: AtomicU64,
    reads: AtomicU64,
    /// Publish call durations, µs, since the monitor last took them.
    publish_calls: Mutex<Option<Histogram<u64>>>,
}

impl Counters {
    fn record_call(&self, d: Duration) {
        let mut h = self.publish_calls.lock().expect("publish histogram");
        h.get_or_insert_with(histogram)
            .saturating_record(d.as_micros() as u64);
    }

    fn take_calls(&self) -> Histogram<u64> {
        self.publish_calls
            .lock()
            .expect("publish histogram")
            .take()
            .unwrap_or_else(histogram)
    }
}

/// One publisher: its share of the rate, on the keys it owns.
async fn publish_loop(
    c: Config,
    index: usize,
    publisher: Publisher,
    db: Arc<Db>,
    counters: Arc<Counters>,
    until: tokio::time::Instant,
) {
    let mut rng = Rng::new(index as u64);
    let share = c.rate as f64 / c.publishers as f64 * TICK.as_secs_f64();
    let step = c.publishers as u64;
    let owned = (c.keys - index as u64).div_ceil(step);
    let key = move |rng: &mut Rng| rng.below(owned) * step + index as u64;
    // Fractional events carry over, so any rate comes out right on average.
    let mut credit = 0.0;
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        // The clock, not the tick's scheduled instant: a publisher that fell
        // behind gets its missed ticks at once, all scheduled before `until`.
        if tokio::time::Instant::now() >= until {
            break;
        }
        credit += share;
        // The tick's events go out together, each awaiting its own
        // acknowledgement: the publisher pipelines them (its window), as an
        // admin service's concurrent requests would share it.
        let mut calls = Vec::new();
        while credit >= 1.0 {
            credit -= 1.0;
            let roll = rng.below(100);
            let publisher = &publisher;
            let call = if roll < 2 {
                let n = 2 + rng.below(15);
                let entries: Vec<_> = (0..n)
                    .map(|_| {
                        let k = key(&mut rng);
                        let v = db.change(k);
                        (k, Row::of(k, v), Some(v))
                    })
                    .collect();
                Change::Many(entries)
            } else if roll < 12 {
                let k = key(&mut rng);
                Change::Gone(k, db.change(k))
            } else {
                let k = key(&mut rng);
                let v = db.change(k);
                Change::Many(vec![(k, Row::of(k, v), Some(v))])
            };
            let counters = &counters;
            calls.push(async move {
                let started = Instant::now();
                let result = match call {
                    Change::Many(entries) => publisher.insert_versioned(CACHE, entries).await,
                    Change::Gone(k, v) => {
                        publisher.invalidate_versioned(CACHE, [(k, Some(v))]).await
                    }
                };
                counters.record_call(started.elapsed());
                match result {
                    Ok(p) => {
                        counters.published.fetch_add(p.events as u64, Relaxed);
                    }
                    Err(e) => {
                        // A failed publish still used up its sequence number, so
                        // the nodes will see a gap: that shows as a loss.
                        counters.publish_errors.fetch_add(1, Relaxed);
                        eprintln!("publisher {index}: {e}");
                    }
                }
            });
        }
        futures_util::future::join_all(calls).await;
    }
}

/// One publish of the soak's mix.
enum Change {
    /// Versioned refreshes, one or several keys in one event.
    Many(Vec<(u64, Row, Option<u64>)>),
    /// A versioned invalidation of one key.
    Gone(u64, u64),
}

/// One node's readers: `reads` per second, half `get`, half `get_with`.
async fn read_loop(
    c: Config,
    index: usize,
    cache: SyncedCache<u64, Row>,
    db: Arc<Db>,
    counters: Arc<Counters>,
    until: tokio::time::Instant,
) {
    let mut rng = Rng::new(1000 + index as u64);
    let share = c.reads as f64 * TICK.as_secs_f64();
    let mut credit = 0.0;
    let mut tick = tokio::time::interval(TICK);
    loop {
        tick.tick().await;
        if tokio::time::Instant::now() >= until {
            break;
        }
        credit += share;
        let mut n = 0;
        while credit >= 1.0 {
            credit -= 1.0;
            n += 1;
            let k = rng.below(c.keys);
            if rng.below(2) == 0 {
                let _ = cache.get(&k).await;
            } else {
                let db = db.clone();
                let _ = cache.get_with(k, || std::future::ready(db.row(k))).await;
            }
        }
        counters.reads.fetch_add(n, Relaxed);
    }
}

/// One row of the table and the CSV.
#[derive(Debug, Clone, Default)]
struct Sample {
    t_s: f64,
    published_per_s: f64,
    rss_mib: f64,
    redis_rss_mib: f64,
    lag_now_max: u64,
    lag_window_max: u64,
    latency_p99_ms: f64,
    latency_max_ms: f64,
    tracked_min: u64,
    tracked_max: u64,
    entries_min: u64,
    entries_max: u64,
    losses: u64,
    /// Gaps, resyncs, transport errors, rejections, quarantined refreshes,
    /// publish errors: anything else that went wrong, summed.
    other_problems: u64,
    reads_per_s: f64,
    publish_p99_ms: f64,
    /// CPU time in the window, % of one core: this process, redis-server,
    /// and everything else on the machine.
    bench_cpu_pct: f64,
    redis_cpu_pct: f64,
    others_cpu_pct: f64,
    /// CPU time per event published in the window, µs.
    bench_cpu_us_per_event: f64,
    redis_cpu_us_per_event: f64,
}

const CSV_HEADER: &str = "t_s,published_per_s,rss_mib,redis_rss_mib,lag_now_max,lag_window_max,\
latency_p99_ms,latency_max_ms,tracked_min,tracked_max,entries_min,entries_max,losses,\
other_problems,reads_per_s,publish_p99_ms,bench_cpu_pct,redis_cpu_pct,others_cpu_pct,\
bench_cpu_us_per_event,redis_cpu_us_per_event";

impl Sample {
    fn csv(&self) -> String {
        format!(
            "{:.1},{:.0},{:.1},{:.1},{},{},{:.2},{:.2},{},{},{},{},{},{},{:.0},{:.2},{:.0},{:.0},{:.0},{:.0},{:.0}",
            self.t_s,
            self.published_per_s,
            self.rss_mib,
            self.redis_rss_mib,
            self.lag_now_max,
            self.lag_window_max,
            self.latency_p99_ms,
            self.latency_max_ms,
            self.tracked_min,
            self.tracked_max,
            self.entries_min,
            self.entries_max,
            self.losses,
            self.other_problems,
            self.reads_per_s,
            self.publish_p99_ms,
            self.bench_cpu_pct,
            self.redis_cpu_pct,
            self.others_cpu_pct,
            self.bench_cpu_us_per_event,
            self.redis_cpu_us_per_event,
        )
    }

    fn table_header() {
        println!(
            "| t (s) | published/s | RSS MiB | redis RSS MiB | max lag now / in window (events) | latency p99 / max (ms) | tracked keys (min–max) | entries (min–max) | losses | other problems | reads/s | publish call p99 (ms) | CPU bench / redis / others | CPU µs per event, bench / redis |"
        );
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    }

    fn table_row(&self) {
        println!(
            "| {:.0} | {:.0} | {:.1} | {:.1} | {} / {} | {:.2} / {:.2} | {}–{} | {}–{} | {} | {} | {:.0} | {:.2} | {:.0} / {:.0} / {:.0} % | {:.0} / {:.0} |",
            self.t_s,
            self.published_per_s,
            self.rss_mib,
            self.redis_rss_mib,
            self.lag_now_max,
            self.lag_window_max,
            self.latency_p99_ms,
            self.latency_max_ms,
            self.tracked_min,
            self.tracked_max,
            self.entries_min,
            self.entries_max,
            self.losses,
            self.other_problems,
            self.reads_per_s,
            self.publish_p99_ms,
            self.bench_cpu_pct,
            self.redis_cpu_pct,
            self.others_cpu_pct,
            self.bench_cpu_us_per_event,
            self.redis_cpu_us_per_event,
        );
    }
}

/// Losses, and everything else a node counts as wrong, from its status.
fn troubles(s: &NodeStatus) -> (u64, u64) {
    let c = &s.caches[0];
    let other = s.publisher_gaps
        + s.transport_errors
        + s.events_rejected
        + c.loss_resyncs
        + c.refreshes_quarantined
        + c.rejected_events;
    (s.losses, other)
}

/// The lag probes and the samples, for the verdicts.
struct Record {
    /// (seconds since publishing started, largest lag over the nodes).
    lag: Vec<(f64, u64)>,
    samples: Vec<Sample>,
}

/// Probes every `PROBE`, prints and writes a sample every `sample_secs`,
/// until `until`.
async fn monitor(
    c: Config,
    nodes: Arc<Vec<SoakNode>>,
    counters: Arc<Counters>,
    redis_pid: Option<String>,
    mut csv: std::fs::File,
    start: Instant,
    until: tokio::time::Instant,
) -> Record {
    let hz = clock_ticks_per_sec();
    let window = Duration::from_secs(c.sample_secs);
    let mut record = Record {
        lag: Vec::new(),
        samples: Vec::new(),
    };
    let mut applied_seen = vec![0_u64; nodes.len()];
    let mut latency = histogram();
    let mut lag_window_max = 0;
    let mut last_sample = Instant::now();
    let mut published_before = 0;
    let mut reads_before = 0;
    let mut cpu_before = cpu_ticks("self");
    let mut redis_cpu_before = redis_pid.as_deref().and_then(cpu_ticks);
    let mut machine_before = machine_ticks();
    let mut probe = tokio::time::interval(PROBE);
    probe.tick().await;
    loop {
        let now = probe.tick().await;
        let published = counters.published.load(Relaxed);
        let mut lag_now = 0;
        let mut statuses = Vec::with_capacity(nodes.len());
        for (k, n) in nodes.iter().enumerate() {
            let st = n.node.status();
            let cache = &st.caches[0];
            lag_now = lag_now.max(published.saturating_sub(cache.events_applied));
            if cache.events_applied > applied_seen[k] {
                applied_seen[k] = cache.events_applied;
                if let Some(l) = cache.last_latency_us {
                    latency.saturating_record(l);
                }
            }
            statuses.push(st);
        }
        let t = start.elapsed().as_secs_f64();
        record.lag.push((t, lag_now));
        lag_window_max = lag_window_max.max(lag_now);
        let done = now >= until;
        if last_sample.elapsed() + PROBE / 2 < window && !done {
            continue;
        }
        let secs = last_sample.elapsed().as_secs_f64();
        last_sample = Instant::now();
        let reads = counters.reads.load(Relaxed);
        let cpu = cpu_ticks("self");
        let redis_cpu = redis_pid.as_deref().and_then(cpu_ticks);
        let machine = machine_ticks();
        let pct = |after: Option<u64>, before: Option<u64>| match (after, before) {
            (Some(a), Some(b)) => a.saturating_sub(b) as f64 / hz / secs * 100.0,
            _ => f64::NAN,
        };
        let (bench_pct, redis_pct) = (pct(cpu, cpu_before), pct(redis_cpu, redis_cpu_before));
        // The machine's busy share of all its cores, in % of one core,
        // less ours and redis-server's.
        let others_pct = match (machine, machine_before) {
            (Some((busy, total, cores)), Some((busy0, total0, _))) if total > total0 => {
                let busy = (busy - busy0) as f64 / (total - total0) as f64 * cores as f64 * 100.0;
                (busy - bench_pct - redis_pct).max(0.0)
            }
            _ => f64::NAN,
        };
        let events = published.saturating_sub(published_before).max(1) as f64;
        let per_event = |p: f64| p / 100.0 * secs * 1e6 / events;
        let caches = || statuses.iter().map(|s| &s.caches[0]);
        let (mut losses, mut other) = (0, counters.publish_errors.load(Relaxed));
        for s in &statuses {
            let (l, o) = troubles(s);
            losses += l;
            other += o;
        }
        let calls = counters.take_calls();
        let sample = Sample {
            t_s: t,
            published_per_s: published.saturating_sub(published_before) as f64 / secs,
            rss_mib: rss_kib("self").unwrap_or(0) as f64 / 1024.0,
            redis_rss_mib: redis_pid.as_deref().and_then(rss_kib).unwrap_or(0) as f64 / 1024.0,
            lag_now_max: lag_now,
            lag_window_max,
            latency_p99_ms: latency.value_at_quantile(0.99) as f64 / 1e3,
            latency_max_ms: latency.max() as f64 / 1e3,
            tracked_min: caches().map(|c| c.tracked_keys).min().unwrap_or(0),
            tracked_max: caches().map(|c| c.tracked_keys).max().unwrap_or(0),
            entries_min: caches().map(|c| c.entries).min().unwrap_or(0),
            entries_max: caches().map(|c| c.entries).max().unwrap_or(0),
            losses,
            other_problems: other,
            reads_per_s: reads.saturating_sub(reads_before) as f64 / secs,
            publish_p99_ms: calls.value_at_quantile(0.99) as f64 / 1e3,
            bench_cpu_pct: bench_pct,
            redis_cpu_pct: redis_pct,
            others_cpu_pct: others_pct,
            bench_cpu_us_per_event: per_event(bench_pct),
            redis_cpu_us_per_event: per_event(redis_pct),
        };
        sample.table_row();
        writeln!(csv, "{}", sample.csv()).expect("write the CSV");
        record.samples.push(sample);
        published_before = published;
        reads_before = reads;
        cpu_before = cpu;
        redis_cpu_before = redis_cpu;
        machine_before = machine;
        latency.reset();
        lag_window_max = 0;
        if done {
            return record;
        }
    }
}

/// redis-server's pid, from `INFO server`.
async fn redis_pid(url: &str) -> Option<String> {
    let mut conn = Client::open(url)
        .ok()?
        .get_multiplexed_async_connection()
        .await
        .ok()?;
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(&mut conn)
        .await
        .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("process_id:"))
        .map(|p| p.trim().to_owned())
}

async fn start_nodes(c: Config, url: &str, topic: &str) -> Vec<SoakNode> {
    let mut nodes = Vec::with_capacity(c.nodes);
    for k in 0..c.nodes {
        let cache = SyncedCache::new(CACHE, moka::future::Cache::new(c.keys));
        let transport = RedisStreamsTransport::connect(url)
            .await
            .expect("connect a node's transport");
        let node = Node::builder(format!("node-{k}"), transport)
            .topic(topic)
            .register(&cache)
            .start()
            .await
            .expect("start a node");
        nodes.push(SoakNode { node, cache });
    }
    nodes
}

async fn run(c: Config, workers: usize) {
    let started = Instant::now();
    if !c.full {
        println!("(smoke run with tiny sizes: checks the code paths; the numbers mean nothing)");
    }
    println!(
        "\nSoak on Redis Streams: {} nodes, {} events/s from {} publishers for {} s, {} keys, \
         {} reads per node per second; {workers} tokio worker threads; load average at start {}",
        c.nodes,
        c.rate,
        c.publishers,
        c.secs,
        c.keys,
        c.reads,
        loadavg()
    );
    println!(
        "redis-server: persistence off (`--appendonly no`, `--save \"\"`); stream MAXLEN ~ 100000 \
         (the transport's default). RSS is this whole process: all nodes, publishers and readers."
    );
    let dir = out_dir();
    std::fs::create_dir_all(&dir).expect("create the CSV directory");
    // Smoke runs (every `cargo test`) overwrite one file instead of piling up.
    let name = if c.full {
        format!("soak-{}.csv", now_us() / 1_000_000)
    } else {
        "soak-smoke.csv".to_owned()
    };
    let csv_path = dir.join(name);
    let mut csv = std::fs::File::create(&csv_path).expect("create the CSV");
    writeln!(csv, "{CSV_HEADER}").expect("write the CSV");
    println!("samples also go to {}\n", csv_path.display());

    let redis = RedisServer::start_with(&["--appendonly", "no"]);
    let url = redis.url();
    let pid = redis_pid(&url).await;
    let topic = format!("soak-{}", now_us());
    let db = Arc::new(Db::new(c.keys));
    let counters = Arc::new(Counters::default());
    let nodes = Arc::new(start_nodes(c, &url, &topic).await);
    let mut publishers = Vec::with_capacity(c.publishers);
    for k in 0..c.publishers {
        let transport = RedisStreamsTransport::connect(url.as_str())
            .await
            .expect("connect a publisher's transport");
        publishers.push(
            Publisher::builder(transport)
                .topic(topic.clone())
                .origin(format!("soak-publisher-{k}"))
                .build()
                .expect("publisher"),
        );
    }

    Sample::table_header();
    let start = Instant::now();
    let until = tokio::time::Instant::now() + Duration::from_secs(c.secs);
    let mut tasks = Vec::new();
    for (k, p) in publishers.into_iter().enumerate() {
        tasks.push(tokio::spawn(publish_loop(
            c,
            k,
            p,
            db.clone(),
            counters.clone(),
            until,
        )));
    }
    for (k, n) in nodes.iter().enumerate() {
        tasks.push(tokio::spawn(read_loop(
            c,
            k,
            n.cache.clone(),
            db.clone(),
            counters.clone(),
            until,
        )));
    }
    let record = monitor(c, nodes.clone(), counters.clone(), pid, csv, start, until).await;
    for t in tasks {
        t.await.expect("publisher or reader task");
    }
    let elapsed = start.elapsed();
    let published = counters.published.load(Relaxed);

    // Let every node apply everything, then compare with the source of truth.
    let drain_start = Instant::now();
    let behind = loop {
        let behind: Vec<String> = nodes
            .iter()
            .filter_map(|n| {
                let applied = n.cache.status().events_applied;
                (applied < published).then(|| format!("{}: {applied}", n.node.id()))
            })
            .collect();
        if behind.is_empty() || drain_start.elapsed() > DRAIN {
            break behind;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let drained = drain_start.elapsed();
    let mut stale = 0_u64;
    let mut checked = 0_u64;
    for n in nodes.iter() {
        for (k, row) in n.cache.iter() {
            checked += 1;
            if row != db.row(*k) {
                stale += 1;
            }
        }
    }
    let nodes = Arc::into_inner(nodes).expect("the monitor let go of the nodes");
    let mut problems = Vec::new();
    let (mut losses, mut stale_ignored) = (0, 0);
    for n in nodes {
        n.node.shutdown().await.expect("shutdown");
        let s = n.node.status();
        let c = &s.caches[0];
        losses += s.losses;
        stale_ignored += c.stale_ignored;
        let bad = [
            ("losses", s.losses),
            ("gaps", s.publisher_gaps),
            ("rejected", s.events_rejected),
            ("transport errors", s.transport_errors),
            ("quarantined", c.refreshes_quarantined),
            ("resyncs", c.loss_resyncs),
            ("rejected in the cache", c.rejected_events),
        ];
        for (what, count) in bad {
            if count > 0 {
                problems.push(format!("{}: {count} {what}", s.node_id));
            }
        }
        if let Some(reason) = &s.last_loss_reason {
            problems.push(format!("{}: last loss {reason}", s.node_id));
        }
    }
    let publish_errors = counters.publish_errors.load(Relaxed);
    if publish_errors > 0 {
        problems.push(format!("{publish_errors} publish errors"));
    }
    drop(redis);

    let end = Ending {
        published,
        elapsed,
        behind,
        drained,
        checked,
        stale,
        losses,
        stale_ignored,
        problems,
    };
    verdicts(c, &record, &end);
    println!("\nCSV: {}", csv_path.display());
    println!(
        "run time {:.1} s; load average at end {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    if !c.full {
        // The smoke pass checks correctness, which does not depend on the
        // machine: nothing lost, everything applied, nothing stale.
        assert!(end.behind.is_empty(), "nodes behind: {:?}", end.behind);
        assert!(end.problems.is_empty(), "problems: {:?}", end.problems);
        assert_eq!(end.stale, 0, "entries differing from the source of truth");
    }
}

/// What the end of the run found.
struct Ending {
    published: u64,
    elapsed: Duration,
    /// Nodes that had not applied everything after `DRAIN`.
    behind: Vec<String>,
    drained: Duration,
    checked: u64,
    stale: u64,
    losses: u64,
    stale_ignored: u64,
    problems: Vec<String>,
}

/// Mean of the lag probes with `from <= t < to`.
fn mean_lag(lag: &[(f64, u64)], from: f64, to: f64) -> Option<f64> {
    let xs: Vec<u64> = lag
        .iter()
        .filter(|(t, _)| *t >= from && *t < to)
        .map(|(_, l)| *l)
        .collect();
    (!xs.is_empty()).then(|| xs.iter().sum::<u64>() as f64 / xs.len() as f64)
}

/// Least-squares slope of lag against time, events per minute, from `from`.
fn lag_slope(lag: &[(f64, u64)], from: f64) -> Option<f64> {
    let pts: Vec<(f64, f64)> = lag
        .iter()
        .filter(|(t, _)| *t >= from)
        .map(|(t, l)| (*t, *l as f64))
        .collect();
    let n = pts.len() as f64;
    if n < 2.0 {
        return None;
    }
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    (sxx > 0.0).then(|| sxy / sxx * 60.0)
}

fn verdicts(c: Config, r: &Record, end: &Ending) {
    let pass = |ok: bool| if ok { "PASS" } else { "FAIL" };
    let smoke = if c.full {
        ""
    } else {
        " (smoke sizes: meaningless)"
    };
    let warm = c.warm_up().as_secs_f64();
    let total = end.elapsed.as_secs_f64();
    println!("\n#### Verdicts{smoke}\n");

    let achieved = end.published as f64 / total;
    let share = achieved / c.rate as f64;
    println!(
        "- target rate reached (at least 99 % over the run): {} events in {total:.1} s = \
         {achieved:.0}/s against {} targeted ({:.1} %) → {}",
        end.published,
        c.rate,
        share * 100.0,
        pass(share >= 0.99)
    );

    // Memory: every sample after the warm-up within 10 % of the first one.
    let after: Vec<&Sample> = r.samples.iter().filter(|s| s.t_s >= warm).collect();
    match after.first() {
        Some(first) => {
            let reference = first.rss_mib;
            let (lo, hi) = after.iter().fold((f64::MAX, 0.0_f64), |(lo, hi), s| {
                (lo.min(s.rss_mib), hi.max(s.rss_mib))
            });
            let dev = |x: f64| (x / reference - 1.0) * 100.0;
            let ok = dev(lo) >= -10.0 && dev(hi) <= 10.0;
            println!(
                "- resident memory flat within ±10 % after {warm:.0} s (every sample from then on \
                 against the first, {reference:.1} MiB at {:.0} s): {lo:.1}–{hi:.1} MiB = \
                 {:+.1} % / {:+.1} % → {}",
                first.t_s,
                dev(lo),
                dev(hi),
                pass(ok)
            );
            // Not a verdict, a hint for reading one: when the RSS last grew
            // by more than 1 % from one sample to the next, and its range
            // from then on. Slower runs fill their caches and version
            // tables later, so their growth can outlast the first minute.
            let last_rise = r
                .samples
                .windows(2)
                .rposition(|w| w[1].rss_mib > w[0].rss_mib * 1.01)
                .map(|i| i + 1);
            if let Some(i) = last_rise {
                let tail = &r.samples[i..];
                let (lo, hi) = tail.iter().fold((f64::MAX, 0.0_f64), |(lo, hi), s| {
                    (lo.min(s.rss_mib), hi.max(s.rss_mib))
                });
                println!(
                    "  (the RSS last grew by more than 1 % between two samples at {:.0} s; from \
                     then on {lo:.1}–{hi:.1} MiB, {:+.1} %; every node's version table tracks the \
                     whole key space (or its default bound, 100 000) from {})",
                    tail[0].t_s,
                    (hi / lo - 1.0) * 100.0,
                    r.samples
                        .iter()
                        .find(|s| s.tracked_min >= c.keys.min(100_000))
                        .map_or("never".to_owned(), |s| format!("{:.0} s", s.t_s)),
                );
            }
            let redis: Vec<f64> = after.iter().map(|s| s.redis_rss_mib).collect();
            println!(
                "  (redis-server's RSS over the same samples: {:.1}–{:.1} MiB)",
                redis.iter().copied().fold(f64::MAX, f64::min),
                redis.iter().copied().fold(0.0, f64::max)
            );
        }
        None => println!("- resident memory: no sample after the warm-up"),
    }

    // Lag: the second minute against the last one (for shorter runs, the
    // second third against the last), with slack for one burst's noise.
    let early = (warm, 2.0 * warm);
    let late = ((total - warm).max(early.1), total + 1.0);
    let slack = c.rate as f64 * 0.1;
    match (
        mean_lag(&r.lag, early.0, early.1),
        mean_lag(&r.lag, late.0, late.1),
    ) {
        (Some(e), Some(l)) => {
            let max_late = r
                .lag
                .iter()
                .filter(|(t, _)| *t >= late.0)
                .map(|(_, l)| *l)
                .max()
                .unwrap_or(0);
            println!(
                "- lag not growing (mean of the 100 ms probes of the largest lag over the nodes; \
                 {:.0}–{:.0} s against {:.0}–{total:.0} s; growing = the later mean above 1.5× the \
                 earlier plus 100 ms of events, {slack:.0}): {e:.0} → {l:.0} events (max in the \
                 later window {max_late}) → {}",
                early.0,
                early.1,
                late.0,
                pass(l <= 1.5 * e + slack)
            );
        }
        _ => println!("- lag: too few probes to compare"),
    }
    if let Some(slope) = lag_slope(&r.lag, warm) {
        println!(
            "  (least-squares slope of the lag after {warm:.0} s: {slope:+.1} events per minute)"
        );
    }
    println!(
        "- every node applied everything after publishing stopped: {} ({})",
        if end.behind.is_empty() {
            format!("within {:.0} ms", end.drained.as_secs_f64() * 1e3)
        } else {
            format!("not within {DRAIN:?}: {}", end.behind.join(", "))
        },
        pass(end.behind.is_empty())
    );
    println!(
        "- 0 losses: {} losses; other problems: {} → {}",
        end.losses,
        if end.problems.is_empty() {
            "none".to_owned()
        } else {
            end.problems.join("; ")
        },
        pass(end.losses == 0 && end.problems.is_empty())
    );
    println!(
        "- every cached entry on every node matches the source of truth at the end: {} of {} \
         differ → {}; refreshes ignored as stale: {} (0 expected: each key has one publisher)",
        end.stale,
        end.checked,
        pass(end.stale == 0),
        end.stale_ignored
    );
}

fn main() {
    let c = Config::from_args();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("tokio runtime");
    // The driver runs as a task on the workers, as in the propagation
    // benches, so it shares the cores with what it measures.
    rt.block_on(async move {
        tokio::spawn(run(c, workers)).await.expect("soak panicked");
    });
}
