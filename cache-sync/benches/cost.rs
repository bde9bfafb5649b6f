//! What cache-sync's operations cost in instructions and allocations, next
//! to raw moka measured the same way, plus bytes per cached entry. Unlike
//! wall-clock time (which swings 2× on a shared VM), these counts repeat
//! from run to run.
//!
//! ```text
//! scripts/bench-cost                    # the whole table (needs valgrind), then memory
//! cargo bench -p cache-sync --bench cost -- memory           # bytes per entry only
//! cargo bench -p cache-sync --bench cost -- apply-1 cache-sync 2048   # one measured run
//! ```
//!
//! # Instructions and allocations per operation
//! `cost <op> <side> <n>` sets everything up, performs exactly `n`
//! operations of kind `op` on `side` (`raw` or `cache-sync`), checks them,
//! and prints the allocator's counters over those operations. Operations:
//!
//! | op | cache-sync | raw |
//! |---|---|---|
//! | `get-hit` | `SyncedCache::get`, 10k prefilled keys | moka `get` |
//! | `get-with-miss` | `SyncedCache::get_with`, distinct missing keys, loader ready at once | moka `get_with` |
//! | `insert` | `SyncedCache::insert`, distinct keys | moka `insert` |
//! | `apply-1` | a node applies `n` single-entry versioned refreshes from a backlog | moka `insert` of `n` entries |
//! | `apply-1-traced` | `apply-1` on a cache built with `trace_bytes(64 KiB)`, full and evicting | moka `insert` of `n` entries |
//! | `apply-100` | the same, `n / 100` events of 100 entries; cost per entry | moka `insert` of `n` entries |
//! | `publish` | `Publisher::insert_versioned` of 1 entry on the embedded transport | `Transport::publish` of the same event, already encoded |
//!
//! `scripts/bench-cost` runs each under `valgrind --tool=callgrind
//! --collect-atstart=no --toggle-collect='*cost_measured_region*'`, for `n`
//! and `2n`, and reports `(count(2n) - count(n)) / n` for instructions (the
//! out file's `summary:`) and for allocations (printed here). Two tools,
//! because each removes a different part that is not the operation:
//! - The toggle counts only what runs inside [`cost_measured_region`]. Setup
//!   that grows with `n` (prefilling, publishing the backlog that `apply`
//!   then reads) happens before it, so it is not counted, however much it
//!   costs. A helper is exact here, where a subtraction of publishing cost
//!   from a separate run would carry that run's own noise.
//! - The subtraction of the `n` run from the `2n` run cancels what the
//!   region does once whatever `n` is: first-touch allocations, the node's
//!   first fetch, the waiting loop's last check.
//!
//! What stays in is the marginal cost of one operation, including its
//! share of amortised work: moka's inline housekeeping (every 64 reads or
//! writes), hash-table growth, the consumer's batch fetch (256 records).
//! Growth makes the figure depend a little on `n`: for moka `insert`, the
//! step from 4k to 8k keys cost about 400 instructions per key more than
//! the step from 2k to 4k, on both sides alike. Compare figures taken at the
//! same `n` (the script fixes one per operation).
//!
//! Everything runs on a current-thread tokio runtime, so one thread does all
//! the work inside the region, in the same order every run. Its clock is
//! paused: the node's maintenance task, which would run moka's housekeeping
//! 10 ms after a batch, never gets to, since paused time only advances when
//! nothing is runnable and the waiting loop below always is. Otherwise the
//! share of housekeeping done by that task instead of inline would depend on
//! how fast valgrind runs. Housekeeping then happens inline, as on the raw
//! side. What remains unrepeatable is small: moka's and the version table's
//! hash seeds are random per process (probe lengths vary slightly).
//!
//! The node is started before the region (its consumer task has not run
//! yet: asserted); the region drives the runtime until the cache holds the
//! last key and `events_applied` reaches the count. The waiting loop yields
//! (never sleeps) and checks `contains_key` (no allocation) about once per
//! 128 events, when tokio's task budget makes the consumer yield.
//!
//! Allocations are counted with `stats_alloc` as the global allocator: a
//! well-known wrapper around the system allocator whose `unsafe impl
//! GlobalAlloc` lives in that crate, so this workspace keeps
//! `forbid(unsafe_code)`. The same counters give live heap bytes for the
//! memory section, which callgrind cannot. "Allocations" counts calls that
//! hand out memory: `alloc`, `alloc_zeroed` and `realloc`. The wrapper adds
//! a few atomic adds per call to both sides' instruction counts alike.
//!
//! # Memory
//! `cost memory [entries…]` (default 100k and 1M; no valgrind) fills a
//! cache of capacity `entries`, lets moka settle (`run_pending_tasks`), and
//! reports live heap bytes (bytes requested and not yet freed) divided by the
//! entries held, minus the same cache empty. Rows: filled by `insert`
//! (`max_tracked_keys = entries`, so every key is tracked); under churn
//! (then 3 × `entries` more inserts of new keys, a window moving over the
//! key space, so moka and the version table evict on every write); and,
//! for cache-sync, applied by a node from events of 100 entries (transport,
//! publisher and node dropped before measuring).
//!
//! Without `--bench` and without arguments (as under `cargo test
//! --all-targets`) it runs a tiny smoke pass over every operation, side and
//! memory row, with the same checks.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

use std::alloc::System;
use std::future::Future;
use std::hint::black_box;
use std::time::Instant;

use bytes::Bytes;
use cache_sync::transport::{Delivery, StartFrom, SubscribeOptions, Transport};
use cache_sync::{Node, Publisher, SyncedCache, transport::EmbeddedTransport};
use moka::future::Cache;
use stats_alloc::{INSTRUMENTED_SYSTEM, Stats, StatsAlloc};
use tokio::runtime::Runtime;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const NAME: &str = "bench";
const TOPIC: &str = "cost";
/// moka capacity and version-table bound for the per-operation runs: far
/// above any key count used, so nothing is evicted and no record dropped.
const CAPACITY: u64 = 1 << 21;
/// Keys prefilled for `get-hit`.
const HIT_KEYS: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    GetHit,
    GetWithMiss,
    Insert,
    Apply1,
    Apply1Traced,
    Apply100,
    Publish,
}

impl Op {
    const ALL: [Op; 7] = [
        Op::GetHit,
        Op::GetWithMiss,
        Op::Insert,
        Op::Apply1,
        Op::Apply1Traced,
        Op::Apply100,
        Op::Publish,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::GetHit => "get-hit",
            Op::GetWithMiss => "get-with-miss",
            Op::Insert => "insert",
            Op::Apply1 => "apply-1",
            Op::Apply1Traced => "apply-1-traced",
            Op::Apply100 => "apply-100",
            Op::Publish => "publish",
        }
    }

    fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.name() == s)
    }

    /// `n` must be a multiple of this: entries per event for `apply`.
    fn unit(self) -> u64 {
        match self {
            Op::Apply100 => 100,
            _ => 1,
        }
    }

    /// Operations per smoke run: enough to cross moka's 64-write
    /// housekeeping point and a consumer batch, small enough for a debug build.
    fn smoke_n(self) -> u64 {
        match self {
            Op::Apply100 => 500,
            _ => 300,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Raw,
    Synced,
}

impl Side {
    const ALL: [Side; 2] = [Side::Raw, Side::Synced];

    fn name(self) -> &'static str {
        match self {
            Side::Raw => "raw",
            Side::Synced => "cache-sync",
        }
    }

    fn parse(s: &str) -> Option<Side> {
        Side::ALL.into_iter().find(|side| side.name() == s)
    }
}

/// Current-thread, paused clock: see the module docs.
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("tokio runtime")
}

/// The only code callgrind counts: the scripts name this function in
/// `--toggle-collect`, so it must stay a frame of its own (never inlined),
/// and everything measured must run inside it. The work must borrow what
/// setup built rather than own it: whatever the future owns is dropped in
/// here, and dropping a filled cache would be counted.
#[inline(never)]
fn cost_measured_region<T>(rt: &Runtime, work: impl Future<Output = T>) -> (T, Stats) {
    let before = GLOBAL.stats();
    let out = rt.block_on(work);
    (out, GLOBAL.stats() - before)
}

fn moka(capacity: u64) -> Cache<u64, u64> {
    Cache::builder().max_capacity(capacity).build()
}

/// A `SyncedCache` and a handle on the moka cache inside it (moka caches are
/// shared handles), used only to run moka's housekeeping and count entries.
fn synced(capacity: u64, tracked: usize) -> (SyncedCache<u64, u64>, Cache<u64, u64>) {
    let inner = moka(capacity);
    let cache = SyncedCache::builder(NAME, inner.clone())
        .max_tracked_keys(tracked)
        .build()
        .expect("valid settings");
    (cache, inner)
}

/// An embedded transport that keeps `records` events: a trimmed history
/// would make the node measure loss recovery instead of applying.
fn transport(records: u64) -> EmbeddedTransport {
    EmbeddedTransport::builder()
        .max_records(usize::try_from(records).expect("fits") + 1_024)
        .max_bytes(1 << 30)
        .build()
        .expect("valid settings")
}

fn publisher(transport: &EmbeddedTransport) -> Publisher {
    Publisher::builder(transport.clone())
        .topic(TOPIC)
        .build()
        .expect("valid settings")
}

/// Entry `i` of every workload: a distinct key, and a version that rises
/// with it, so every refresh is applied and none is stale.
fn entry(i: u64) -> (u64, u64, Option<u64>) {
    (i, i, Some(i + 1))
}

/// A fixed pseudo-random sequence of keys in `0..keys` (xorshift, as in the
/// throughput bench), so both sides read the same keys in the same order.
/// Its length is a power of two.
fn key_sequence(keys: u64) -> Vec<u64> {
    let mut x = 0x9E37_79B9_7F4A_7C15_u64;
    (0..1 << 16)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % keys
        })
        .collect()
}

/// Sets up, performs `n` operations inside the region, checks them; returns
/// the allocator's counters over the region.
fn measure(op: Op, side: Side, n: u64) -> Stats {
    let rt = runtime();
    match op {
        Op::GetHit => get_hit(&rt, side, n),
        Op::GetWithMiss => get_with_miss(&rt, side, n),
        // The raw baseline of `apply` is inserting the same entries.
        Op::Insert | Op::Apply1 | Op::Apply1Traced | Op::Apply100 if side == Side::Raw => {
            raw_insert(&rt, n)
        }
        Op::Insert => synced_insert(&rt, n),
        Op::Apply1 | Op::Apply100 => apply(&rt, n, op.unit(), None),
        Op::Apply1Traced => apply(&rt, n, 1, Some(TRACE_BYTES)),
        Op::Publish => publish(&rt, side, n),
    }
}

fn get_hit(rt: &Runtime, side: Side, n: u64) -> Stats {
    let keys = key_sequence(HIT_KEYS);
    let mask = keys.len() - 1;
    let key = |i: u64| keys[i as usize & mask];
    let (hits, stats) = match side {
        Side::Raw => {
            let cache = moka(CAPACITY);
            rt.block_on(async {
                for k in 0..HIT_KEYS {
                    cache.insert(k, k).await;
                }
                cache.run_pending_tasks().await;
            });
            cost_measured_region(rt, async {
                let mut hits = 0;
                for i in 0..n {
                    hits += u64::from(cache.get(&key(i)).await.is_some());
                }
                hits
            })
        }
        Side::Synced => {
            let (cache, inner) = synced(CAPACITY, CAPACITY as usize);
            rt.block_on(async {
                for k in 0..HIT_KEYS {
                    cache.insert(k, k).await;
                }
                inner.run_pending_tasks().await;
            });
            cost_measured_region(rt, async {
                let mut hits = 0;
                for i in 0..n {
                    hits += u64::from(cache.get(&key(i)).await.is_some());
                }
                hits
            })
        }
    };
    assert_eq!(hits, n, "every read must hit");
    stats
}

fn get_with_miss(rt: &Runtime, side: Side, n: u64) -> Stats {
    match side {
        Side::Raw => {
            let cache = moka(CAPACITY);
            let ((), stats) = cost_measured_region(rt, async {
                for k in 0..n {
                    black_box(cache.get_with(k, async move { k }).await);
                }
            });
            rt.block_on(cache.run_pending_tasks());
            assert_eq!(cache.entry_count(), n, "every get_with must load");
            stats
        }
        Side::Synced => {
            let (cache, _) = synced(CAPACITY, CAPACITY as usize);
            let ((), stats) = cost_measured_region(rt, async {
                for k in 0..n {
                    black_box(cache.get_with(k, || async move { k }).await);
                }
            });
            let st = cache.status();
            assert_eq!(st.loads, n, "every get_with must load once");
            assert_eq!(st.loads_superseded, 0);
            stats
        }
    }
}

fn raw_insert(rt: &Runtime, n: u64) -> Stats {
    let cache = moka(CAPACITY);
    let ((), stats) = cost_measured_region(rt, async {
        for i in 0..n {
            let (k, v, _) = entry(i);
            cache.insert(k, v).await;
        }
    });
    rt.block_on(cache.run_pending_tasks());
    assert_eq!(cache.entry_count(), n);
    stats
}

fn synced_insert(rt: &Runtime, n: u64) -> Stats {
    let (cache, inner) = synced(CAPACITY, CAPACITY as usize);
    let ((), stats) = cost_measured_region(rt, async {
        for i in 0..n {
            let (k, v, _) = entry(i);
            cache.insert(k, v).await;
        }
    });
    rt.block_on(inner.run_pending_tasks());
    assert_eq!(inner.entry_count(), n);
    assert_eq!(cache.status().tracked_keys, n, "every key tracked");
    stats
}

/// Publishes `n` entries as `n / per_event` versioned refresh events.
async fn publish_backlog(publisher: &Publisher, n: u64, per_event: u64) {
    for e in 0..n / per_event {
        let entries = (e * per_event..(e + 1) * per_event).map(entry);
        publisher
            .insert_versioned(NAME, entries)
            .await
            .expect("publish");
    }
}

/// Drives the runtime until the node has applied all `events` to `cache`.
/// Yields rather than sleeps: a sleep would let the paused clock advance and
/// the maintenance task run (see the module docs). The cheap check comes
/// first: `contains_key` allocates nothing, `status` clones the name.
async fn wait_applied(cache: &SyncedCache<u64, u64>, last_key: u64, events: u64) {
    while !cache.contains_key(&last_key) || cache.status().events_applied < events {
        tokio::task::yield_now().await;
    }
}

/// Starts a node from the earliest record, registered for `cache`.
async fn start_node(transport: &EmbeddedTransport, cache: &SyncedCache<u64, u64>) -> Node {
    Node::builder("cost", transport.clone())
        .topic(TOPIC)
        .start_from(StartFrom::Earliest)
        .register(cache)
        .start()
        .await
        .expect("start node")
}

/// Checks that the node applied exactly the backlog, every entry installed.
fn check_applied(node: &Node, cache: &SyncedCache<u64, u64>, entries: u64, events: u64) {
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
}

/// The trace's cap for `apply-1-traced`: small enough that the measured
/// runs fill it and then evict a record for each one made, as a cache
/// traced for long does.
const TRACE_BYTES: usize = 64 << 10;

fn apply(rt: &Runtime, n: u64, per_event: u64, trace: Option<usize>) -> Stats {
    let events = n / per_event;
    let transport = transport(events);
    rt.block_on(publish_backlog(&publisher(&transport), n, per_event));
    let cache = match trace {
        None => synced(CAPACITY, CAPACITY as usize).0,
        Some(bytes) => SyncedCache::builder(NAME, moka(CAPACITY))
            .max_tracked_keys(CAPACITY as usize)
            .trace_bytes(bytes)
            .build()
            .expect("valid settings"),
    };
    // `start` completes without yielding, so the consumer it spawned has not
    // run: all of the applying happens in the region.
    let node = rt.block_on(start_node(&transport, &cache));
    assert_eq!(cache.status().events_applied, 0, "nothing applied yet");
    let ((), stats) = cost_measured_region(rt, wait_applied(&cache, n - 1, events));
    check_applied(&node, &cache, n, events);
    rt.block_on(node.shutdown()).expect("shutdown");
    stats
}

/// One 1-entry refresh for key `i` as the publisher encodes it, read back
/// from a scratch transport.
fn encoded_event(rt: &Runtime, i: u64) -> Bytes {
    rt.block_on(async {
        let scratch = transport(1);
        publisher(&scratch)
            .insert_versioned(NAME, [entry(i)])
            .await
            .expect("publish");
        let mut sub = scratch
            .subscribe(TOPIC, SubscribeOptions::new(StartFrom::Earliest))
            .await
            .expect("subscribe");
        match sub.next(1).await.expect("read back") {
            Delivery::Batch { mut records, .. } if records.len() == 1 => {
                records.pop().expect("one record").payload
            }
            other => panic!("expected the one event, got {other:?}"),
        }
    })
}

fn publish(rt: &Runtime, side: Side, n: u64) -> Stats {
    let transport = transport(n);
    let ((), stats) = match side {
        Side::Raw => {
            // Key `n` encodes to as many bytes as the cache-sync side's
            // largest keys (bincode varints).
            let payload = encoded_event(rt, n);
            cost_measured_region(rt, async {
                for _ in 0..n {
                    transport
                        .publish(TOPIC, NAME, payload.clone())
                        .await
                        .expect("publish");
                }
            })
        }
        Side::Synced => {
            let publisher = publisher(&transport);
            cost_measured_region(rt, async {
                for i in 0..n {
                    publisher
                        .insert_versioned(NAME, [entry(i)])
                        .await
                        .expect("publish");
                }
            })
        }
    };
    // Everything reached the transport: a subscriber from the start sees `n`.
    let seen = rt.block_on(async {
        let mut sub = transport
            .subscribe(TOPIC, SubscribeOptions::new(StartFrom::Earliest))
            .await
            .expect("subscribe");
        let mut seen = 0;
        while seen < n {
            match sub.next(1_024).await.expect("read back") {
                Delivery::Batch { records, .. } => seen += records.len() as u64,
                other => panic!("expected records, got {other:?}"),
            }
        }
        seen
    });
    assert_eq!(seen, n);
    stats
}

/// Allocator calls that hand out memory (see the module docs).
fn allocations(s: &Stats) -> usize {
    s.allocations + s.reallocations
}

/// One measured run, as the script reads it.
fn report(op: Op, side: Side, n: u64, s: &Stats) {
    println!(
        "measured op={} side={} n={n} allocs={} bytes={}",
        op.name(),
        side.name(),
        allocations(s),
        s.bytes_allocated
    );
}

// ---------------------------------------------------------------- memory

/// Bytes requested from the allocator and not yet freed.
fn live_bytes() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fill {
    /// `entries` inserts of distinct keys.
    Insert,
    /// Then `3 × entries` inserts of new keys: a window moving over the key space.
    Churn,
    /// A node applies `entries` refreshes, 100 per event.
    Applied,
}

impl Fill {
    fn label(self) -> &'static str {
        match self {
            Fill::Insert => "filled by `insert`",
            Fill::Churn => "`insert`, then 3× as many new keys (churn)",
            Fill::Applied => "applied by a node, 100 entries per event (raw: `insert`)",
        }
    }
}

/// Heap bytes per entry held, for one side, fill and size; and the entries held.
fn footprint(rt: &Runtime, side: Side, fill: Fill, entries: u64) -> (f64, u64) {
    let tracked = usize::try_from(entries).expect("fits");
    let writes = match fill {
        Fill::Churn => 4 * entries,
        Fill::Insert | Fill::Applied => entries,
    };
    let (empty, full, held) = match side {
        Side::Raw => {
            let cache = moka(entries);
            rt.block_on(cache.run_pending_tasks());
            let empty = live_bytes();
            rt.block_on(async {
                for i in 0..writes {
                    cache.insert(i, i).await;
                }
                cache.run_pending_tasks().await;
            });
            (empty, live_bytes(), cache.entry_count())
        }
        Side::Synced => {
            let (cache, inner) = synced(entries, tracked);
            rt.block_on(inner.run_pending_tasks());
            let empty = live_bytes();
            if fill == Fill::Applied {
                // Transport, publisher and node live only in here, so
                // their memory is freed again before the measurement.
                let events = entries / 100;
                let transport = transport(events);
                rt.block_on(async {
                    publish_backlog(&publisher(&transport), entries, 100).await;
                    let node = start_node(&transport, &cache).await;
                    wait_applied(&cache, entries - 1, events).await;
                    check_applied(&node, &cache, entries, events);
                    node.shutdown().await.expect("shutdown");
                });
            } else {
                rt.block_on(async {
                    for i in 0..writes {
                        cache.insert(i, i).await;
                    }
                });
            }
            rt.block_on(inner.run_pending_tasks());
            let tracked_now = cache.status().tracked_keys;
            assert_eq!(tracked_now, entries, "the version table is full");
            (empty, live_bytes(), inner.entry_count())
        }
    };
    assert!(held > 0, "the cache holds entries");
    ((full - empty) as f64 / held as f64, held)
}

fn memory(sizes: &[u64]) {
    let rt = runtime();
    println!(
        "\n### Memory: live heap bytes per entry held (u64 keys and values; moka capacity = entries; max_tracked_keys = entries)\n"
    );
    println!(
        "| fill | entries | raw moka B/entry | cache-sync B/entry | difference B/key | held raw / cache-sync |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for &entries in sizes {
        assert!(
            entries >= 100 && entries % 100 == 0,
            "sizes are multiples of 100 (events of 100 entries)"
        );
        for fill in [Fill::Insert, Fill::Churn, Fill::Applied] {
            // The raw side of `Applied` is the same as `Insert`.
            let raw_fill = if fill == Fill::Applied {
                Fill::Insert
            } else {
                fill
            };
            let (raw, raw_held) = footprint(&rt, Side::Raw, raw_fill, entries);
            let (syn, syn_held) = footprint(&rt, Side::Synced, fill, entries);
            println!(
                "| {} | {} | {raw:.0} | {syn:.0} | {:.0} | {raw_held} / {syn_held} |",
                fill.label(),
                count(entries),
                syn - raw
            );
        }
    }
}

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

// ---------------------------------------------------------------- main

/// Every operation and side with a few hundred operations, then the memory
/// rows at a small size: the code paths and checks, not the numbers.
fn smoke() {
    let start = Instant::now();
    println!("(smoke run with tiny sizes: checks the code paths; the numbers mean nothing)");
    for op in Op::ALL {
        for side in Side::ALL {
            let n = op.smoke_n();
            report(op, side, n, &measure(op, side, n));
        }
    }
    memory(&[2_000]);
    println!("smoke run took {:.1} s", start.elapsed().as_secs_f64());
}

const USAGE: &str =
    "usage: cost <op> <raw|cache-sync> <n>   (one measured run; see scripts/bench-cost)
       cost memory [entries...]          (bytes per entry; default 100000 1000000)
ops: get-hit get-with-miss insert apply-1 apply-1-traced apply-100 publish";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let bench = args.iter().any(|a| a == "--bench");
    let words: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| !a.starts_with('-'))
        .collect();
    match words.as_slice() {
        [] if bench => println!("{USAGE}"),
        [] => smoke(),
        ["memory", sizes @ ..] => {
            let sizes: Vec<u64> = if sizes.is_empty() {
                vec![100_000, 1_000_000]
            } else {
                sizes
                    .iter()
                    .map(|s| s.parse().expect("entries is a number"))
                    .collect()
            };
            memory(&sizes);
        }
        [op, side, n] => {
            let (Some(op), Some(side), Ok(n)) =
                (Op::parse(op), Side::parse(side), n.parse::<u64>())
            else {
                panic!("{USAGE}");
            };
            assert!(
                n > 0 && n % op.unit() == 0,
                "n must be a positive multiple of {}",
                op.unit()
            );
            report(op, side, n, &measure(op, side, n));
        }
        _ => panic!("{USAGE}"),
    }
}
