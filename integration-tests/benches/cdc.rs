//! The CDC relay (feature `postgres-cdc`), in one run against a PostgreSQL 15
//! of its own (`PostgresServer`: `wal_level = logical`, `fsync = off`, on a
//! free loopback port):
//!
//! 1. commit → applied latency on 4 nodes through the CDC relay, next to the
//!    transactional outbox and a plain publish after the commit;
//! 2. the rows per second the relay publishes while concurrent writers
//!    update single rows as fast as the database takes them, next to the
//!    database's own update rate without a relay;
//! 3. the slot's lag while a burst of 1,000,000 row changes drains, in
//!    10,000-row transactions (row events) and in one transaction (a clear).
//!
//! ```text
//! cargo bench -p integration-tests --features postgres-cdc --bench cdc
//! cargo bench -p integration-tests --features postgres-cdc --bench cdc -- --quick           # small sizes, about a minute
//! cargo bench -p integration-tests --features postgres-cdc --bench cdc -- --latency-only    # or --throughput-only, --lag-only
//! cargo bench -p integration-tests --features postgres-cdc --bench cdc -- --clients 16      # writers of part 2 (8)
//! cargo bench -p integration-tests --features postgres-cdc --bench cdc -- --relay-runtime   # relays on a runtime of their own
//! cargo bench -p integration-tests --features postgres-cdc --bench cdc -- --in-process-writers  # part 2's writers as tasks, not pgbench
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny
//! smoke pass. Everything runs on this machine and talks to 127.0.0.1 only.
//!
//! Method:
//! - One `EmbeddedTransport`, 4 nodes on it, each a `Node` with one
//!   `SyncedCache` per measured table, on one tokio runtime with a worker per
//!   core; the database server, its walsender, the relays, the writers and
//!   the nodes share the machine's cores. The three latency paths publish
//!   through the same transport to the same nodes: only the path differs.
//! - Latency: one `UPDATE` of one row at a time. CDC: an autocommit
//!   `UPDATE` of a table the relay maps. Outbox: `BEGIN`, the same `UPDATE`
//!   of a twin table that no publication includes, the outbox's enqueue,
//!   `COMMIT`; an `OutboxRelay` (woken by `NOTIFY`) publishes. Plain: the
//!   autocommit `UPDATE` of the twin table, then `Publisher::insert`. Each
//!   path has a cache of its own (a CDC version is a commit LSN, the
//!   outbox's a counter: one cache never mixes two clocks). A sample runs
//!   from the writer's commit returning to an observer thread (polling the
//!   path's cache on every node every 100 µs) seeing every node past the
//!   event, and every node then holds the new value (checked). The three
//!   paths take turns, one event at a time, rotating which goes first, so
//!   they share the same moments of a noisy machine.
//! - Throughput: `pgbench -n -M prepared -c 8 -j 2 -T 20` (`--clients`
//!   sets `-c`), a process of its own, each transaction one autocommit
//!   `UPDATE items SET name = … WHERE id = …` on random ids of 100,000 rows
//!   (`--in-process-writers`: tokio tasks of this process instead).
//!   Four phases: no slot at all; a slot streamed by `pg_recvlogical` to
//!   /dev/null (the cost of logical decoding itself, with a consumer that
//!   does nothing; skipped if the binary is missing); the relay streaming
//!   (its rows and transactions from `CdcRelay::stats`, its slot's lag
//!   sampled every 500 ms, the lag when the writers stop, and how long it
//!   takes to publish the rest; then every node's cache is checked against
//!   the table); no slot again (the drift of the database's own rate).
//!   `VACUUM` and `CHECKPOINT` before each phase. The CPU each phase kept
//!   busy comes from `/proc`: the server's processes (the walsender among
//!   them), this process (the relay, the nodes) and pgbench; a 10 ms timer
//!   task on the bench's runtime records the longest it overslept.
//! - The relays (CDC and outbox) run on the bench's runtime, with the
//!   nodes, or with `--relay-runtime` on a runtime of one worker thread of
//!   their own, as a relay service would.
//! - With `CDC_STALL_TRACE` set, each burst also prints an anatomy of its
//!   longest stall: the runtime's own counters (busy time and parks per
//!   worker, queued tasks) and every thread's state and system call, read
//!   from `/proc` every 2 ms by a thread of its own. With
//!   `perf record -k 1 -g -e cpu-clock -e sched:sched_switch` around the
//!   run (frame pointers on), the window's samples name what ran.
//! - Lag: with the relay streaming (`lag_interval` 500 ms), one connection
//!   inserts 1,000,000 rows in 100 back-to-back transactions of 10,000 (the
//!   relay's default `max_rows_per_transaction`: row events, not clears),
//!   then 1,000,000 more in one transaction (past the cap: a clear). The
//!   relay's `lag_bytes` and `lag_seconds` are sampled every 500 ms from
//!   the first statement until the server's own slot lag is back under
//!   64 KiB after every row was published; the relay's failed sessions and
//!   the walsenders the server timed out (from its log) are counted.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

// Shared with the propagation benches; this one uses the runtime and
// report helpers only.
#[allow(dead_code)]
mod common;

use std::fmt::Write as _;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cache_sync::{
    Node, Publisher, SyncedCache, Table,
    cdc::{CdcRelay, CdcTable},
    outbox::{Outbox, OutboxRelay},
    transport::EmbeddedTransport,
};
use common::{STALL, loadavg, p, ratio};
use hdrhistogram::Histogram;
use integration_tests::postgres_server::PostgresServer;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection as _, PgConnection, PgPool};

const NODES: usize = 4;
const TOPIC: &str = "bench-cdc";
const LAT_CDC: Table<u64, String> = Table::new("lat_cdc");
const LAT_OUTBOX: Table<u64, String> = Table::new("lat_outbox");
const LAT_PLAIN: Table<u64, String> = Table::new("lat_plain");
const ITEMS: Table<u64, String> = Table::new("items");
const BURST: Table<u64, String> = Table::new("burst");
/// Rows per transaction of the batched burst: the relay's default cap.
const BURST_TX_ROWS: u64 = 10_000;
/// "Drained": the slot's lag back under this.
const DRAINED_BYTES: u64 = 64 << 10;
const LAG_EVERY: Duration = Duration::from_millis(500);
/// How often the relay reports its lag in the reporting phase.
const REPORT_EVERY: Duration = Duration::from_millis(100);
const TP_SLOT: &str = "bench_throughput";
const LAG_SLOT: &str = "bench_lag";
const FLOOR_SLOT: &str = "bench_floor";

type Cache = SyncedCache<u64, String>;

// ------------------------------------------------------------ settings

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Size {
    Smoke,
    Quick,
    Full,
}

#[derive(Debug, Clone, Copy)]
struct Sizes {
    size: Size,
    latency_warmup: u64,
    latency_samples: u64,
    /// Rows of each latency table, updated in turn.
    latency_keys: u64,
    tp_rows: u64,
    tp_clients: usize,
    /// How long the writers of each throughput phase run.
    tp_window: Duration,
    /// Rows of each burst (batched, then one transaction).
    burst_rows: u64,
}

impl Sizes {
    fn new(size: Size, clients: Option<usize>) -> Self {
        let (latency_warmup, latency_samples, tp_rows, tp_window, burst_rows) = match size {
            Size::Smoke => (2, 5, 1_000, 2, 2 * BURST_TX_ROWS),
            Size::Quick => (20, 300, 100_000, 5, 10 * BURST_TX_ROWS),
            Size::Full => (50, 3_000, 100_000, 20, 100 * BURST_TX_ROWS),
        };
        Sizes {
            size,
            latency_warmup,
            latency_samples,
            latency_keys: 100,
            tp_rows,
            tp_clients: clients.unwrap_or(8),
            tp_window: Duration::from_secs(tp_window),
            burst_rows,
        }
    }
}

struct Args {
    size: Size,
    latency: bool,
    throughput: bool,
    lag: bool,
    clients: Option<usize>,
    /// Part 2's writers as tasks of this process instead of pgbench.
    in_process: bool,
    /// The relays on a runtime of their own (one worker thread).
    relay_runtime: bool,
    /// What was given after `--`, for the header.
    given: Vec<String>,
}

fn args() -> Args {
    let all: Vec<String> = std::env::args().skip(1).collect();
    let has = |f: &str| all.iter().any(|a| a == f);
    let size = if !has("--bench") {
        Size::Smoke
    } else if has("--quick") {
        Size::Quick
    } else {
        Size::Full
    };
    let clients = all
        .iter()
        .position(|a| a == "--clients")
        .and_then(|i| all.get(i + 1))
        .map(|n| n.parse().expect("--clients N: a number"));
    let only = ["--latency-only", "--throughput-only", "--lag-only"];
    let any_only = only.iter().any(|f| has(f));
    Args {
        size,
        latency: !any_only || has("--latency-only"),
        throughput: !any_only || has("--throughput-only"),
        lag: !any_only || has("--lag-only"),
        clients,
        in_process: has("--in-process-writers"),
        relay_runtime: has("--relay-runtime"),
        given: all.into_iter().filter(|a| a != "--bench").collect(),
    }
}

// ------------------------------------------------------------ report helpers

fn sh(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn commit() -> String {
    let head = sh("git", &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    match sh("git", &["status", "--porcelain"]) {
        Some(s) if !s.is_empty() => format!("{head} (work tree has uncommitted changes)"),
        _ => head,
    }
}

/// `1234567` as `1 234 567`.
fn th(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

fn thf(x: f64) -> String {
    th(x.max(0.0).round() as u64)
}

fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / f64::from(1 << 20))
}

fn part_header(title: &str, a: &Args, commit: &str) {
    println!("\n## {title}\n");
    println!(
        "command: `cargo bench -p integration-tests --features postgres-cdc --bench cdc{}{}`; commit {commit}; load average {}",
        if a.given.is_empty() { "" } else { " --" },
        a.given.iter().fold(String::new(), |mut s, g| {
            let _ = write!(s, " {g}");
            s
        }),
        loadavg()
    );
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds")
}

// ------------------------------------------------------------ database

async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn scalar_i64(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The end of the server's log, as an LSN in bytes.
async fn wal_now(pool: &PgPool) -> u64 {
    scalar_i64(
        pool,
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8",
    )
    .await as u64
}

/// The slot's lag as the server sees it (its `confirmed_flush_lsn`).
async fn slot_lag(pool: &PgPool, slot: &str) -> u64 {
    let lag: Option<i64> = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .expect("slot lag")
    .flatten();
    lag.map_or(0, |l| l.max(0) as u64)
}

/// Walsenders the server ended because their client sent no reply within
/// `wal_sender_timeout` (5 s on this server), in its log from byte `from`.
fn walsender_timeouts(pg: &PostgresServer, from: usize) -> usize {
    pg.log()
        .get(from..)
        .unwrap_or_default()
        .matches("terminating walsender process due to replication timeout")
        .count()
}

/// A table `(id bigint PRIMARY KEY, name text NOT NULL)` with `rows` rows.
async fn create_table(pool: &PgPool, name: &str, rows: u64) {
    exec(
        pool,
        &format!(
            "DROP TABLE IF EXISTS {name};
             CREATE TABLE {name} (id bigint PRIMARY KEY, name text NOT NULL);
             INSERT INTO {name} SELECT g, 'r' || g FROM generate_series(0, {rows} - 1) g;"
        ),
    )
    .await;
    // A statement of its own: VACUUM refuses a transaction block.
    exec(pool, &format!("VACUUM ANALYZE {name}")).await;
}

/// Drops the slot once its walsender has let it go.
async fn drop_slot(pool: &PgPool, slot: &str) {
    let deadline = Instant::now() + STALL;
    loop {
        let r = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(slot)
            .execute(pool)
            .await;
        match r {
            Ok(_) => return,
            Err(e) => assert!(
                Instant::now() < deadline,
                "slot {slot} could not be dropped: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ------------------------------------------------------------ nodes

/// One node's caches, one per measured table.
#[derive(Clone)]
struct Caches {
    lat_cdc: Cache,
    lat_outbox: Cache,
    lat_plain: Cache,
    items: Cache,
    burst: Cache,
}

struct Nodes {
    nodes: Vec<Node>,
    caches: Vec<Caches>,
}

impl Nodes {
    async fn start(transport: &EmbeddedTransport, s: &Sizes) -> Self {
        let mut nodes = Vec::new();
        let mut caches = Vec::new();
        for k in 0..NODES {
            let c = Caches {
                lat_cdc: SyncedCache::new(LAT_CDC, moka::future::Cache::new(10_000)),
                lat_outbox: SyncedCache::new(LAT_OUTBOX, moka::future::Cache::new(10_000)),
                lat_plain: SyncedCache::new(LAT_PLAIN, moka::future::Cache::new(10_000)),
                items: SyncedCache::new(ITEMS, moka::future::Cache::new(s.tp_rows * 2)),
                burst: SyncedCache::new(BURST, moka::future::Cache::new(s.burst_rows * 2 + 10)),
            };
            let node = Node::builder(format!("node-{k}"), transport.clone())
                .topic(TOPIC)
                .register(&c.lat_cdc)
                .register(&c.lat_outbox)
                .register(&c.lat_plain)
                .register(&c.items)
                .register(&c.burst)
                .start()
                .await
                .expect("start node");
            nodes.push(node);
            caches.push(c);
        }
        Nodes { nodes, caches }
    }

    fn each(&self, pick: fn(&Caches) -> &Cache) -> Vec<Cache> {
        self.caches.iter().map(|c| pick(c).clone()).collect()
    }

    /// Whatever the nodes counted as wrong; empty if nothing.
    async fn shutdown(self) -> String {
        let mut problems = Vec::new();
        for n in self.nodes {
            n.shutdown().await.expect("shutdown");
            let s = n.status();
            for (what, count) in [
                ("losses", s.losses),
                ("gaps", s.publisher_gaps),
                ("rejected", s.events_rejected),
                ("transport errors", s.transport_errors),
            ] {
                if count > 0 {
                    problems.push(format!("{}: {count} {what}", s.node_id));
                }
            }
            for c in &s.caches {
                for (what, count) in [
                    ("quarantined", c.refreshes_quarantined),
                    ("resyncs", c.loss_resyncs),
                    ("rejected", c.rejected_events),
                ] {
                    if count > 0 {
                        problems.push(format!("{} {}: {count} {what}", s.node_id, c.name));
                    }
                }
            }
        }
        problems.join("; ")
    }
}

fn publisher(transport: &EmbeddedTransport, origin: &str) -> Publisher {
    Publisher::builder(transport.clone())
        .topic(TOPIC)
        .origin(origin)
        .build()
        .expect("publisher")
}

/// Runs `f` on a current-thread runtime of its own, on a thread of its
/// own, and waits for it (`block_in_place`: the bench's runtime hands
/// this worker's tasks to another thread meanwhile). For what measures:
/// a task on the bench's runtime would itself wait out that runtime's
/// stalls (nodes applying, moka's housekeeping), and read late.
fn off_runtime<T: Send>(f: impl std::future::Future<Output = T> + Send) -> T {
    tokio::task::block_in_place(|| {
        std::thread::scope(|sc| {
            sc.spawn(|| {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("monitor runtime")
                    .block_on(f)
            })
            .join()
            .expect("monitor thread")
        })
    })
}

/// Connections for a monitor (see `off_runtime`): made on its runtime, so
/// they do not depend on the bench's.
async fn monitor_pool(url: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .expect("monitor connection")
}

/// With `--relay-runtime`: a runtime of one worker thread for the relays
/// (CDC and outbox), as a relay running as a service of its own would have.
static RELAY_RUNTIME: std::sync::OnceLock<Option<tokio::runtime::Runtime>> =
    std::sync::OnceLock::new();

/// Runs a relay's start on the relays' runtime, where there is one (its
/// tasks then run there), else on this one.
async fn on_relay_runtime<F, T>(start: F) -> T
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    match RELAY_RUNTIME.get().and_then(Option::as_ref) {
        Some(rt) => rt.spawn(start).await.expect("relay start"),
        None => start.await,
    }
}

/// A CDC relay on its own slot and publication, mapping `relation`
/// (`id`, `name`) to `table`'s cache, with its `lag_interval` and its
/// `freshness_interval` if given; returned once it streams and every node
/// applied the new slot's clear.
async fn cdc_relay(
    url: &str,
    transport: &EmbeddedTransport,
    slot: &str,
    table: Table<u64, String>,
    relation: &str,
    (lag_interval, freshness): (Option<Duration>, Option<Duration>),
    caches: &[Cache],
) -> CdcRelay {
    let clears: Vec<u64> = caches.iter().map(|c| c.status().clears).collect();
    let mut b = CdcRelay::builder(url, publisher(transport, slot))
        .slot(slot)
        .publication(slot)
        .table(
            CdcTable::new(table, relation, |row| row.parse("id"))
                .value(|row| row.get("name").map(str::to_owned)),
        );
    if let Some(every) = lag_interval {
        b = b.lag_interval(every);
    }
    if let Some(every) = freshness {
        b = b.freshness_interval(every);
    }
    let relay = on_relay_runtime(async move { b.start().await })
        .await
        .expect("cdc relay");
    let deadline = Instant::now() + STALL;
    while !(relay.stats().active
        && caches
            .iter()
            .zip(&clears)
            .all(|(c, before)| c.status().clears > *before))
    {
        assert!(
            Instant::now() < deadline,
            "the relay did not start streaming: {:?}",
            relay.stats()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay
}

// ------------------------------------------------------------ 1. latency

/// Polls (every 100 µs, on a thread of its own) until every cache has
/// applied more events than `before`.
fn wait_applied(caches: &[Cache], before: &[u64]) -> Instant {
    let deadline = Instant::now() + STALL;
    loop {
        if caches
            .iter()
            .zip(before)
            .all(|(c, b)| c.status().events_applied > *b)
        {
            return Instant::now();
        }
        assert!(Instant::now() < deadline, "nodes stalled");
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// When every node has applied the path's next event and holds `value`
/// for `key`; counts in `late` a sample whose value was not there yet.
async fn applied(
    caches: &Arc<Vec<Cache>>,
    before: Vec<u64>,
    key: u64,
    value: &str,
    late: &mut u64,
) -> Instant {
    let c = caches.clone();
    let mut done = tokio::task::spawn_blocking(move || wait_applied(&c, &before))
        .await
        .expect("observer");
    let deadline = Instant::now() + STALL;
    let mut counted = false;
    'check: loop {
        for c in caches.iter() {
            if c.peek(&key).await.as_deref() != Some(value) {
                if !counted {
                    *late += 1;
                    counted = true;
                }
                assert!(Instant::now() < deadline, "{key} = {value} never arrived");
                tokio::time::sleep(Duration::from_micros(100)).await;
                done = Instant::now();
                continue 'check;
            }
        }
        return done;
    }
}

struct Path {
    name: &'static str,
    hist: Histogram<u64>,
    late: u64,
}

async fn latency(
    url: &str,
    pool: &PgPool,
    transport: &EmbeddedTransport,
    nodes: &Nodes,
    s: &Sizes,
) -> Vec<Path> {
    let keys = s.latency_keys;
    create_table(pool, "lat_cdc", keys).await;
    // The outbox's and the plain path's rows: a twin of lat_cdc that no
    // publication includes (the outbox's keys 0..keys, the plain's above).
    create_table(pool, "lat_app", 2 * keys).await;
    let cdc_caches = Arc::new(nodes.each(|c| &c.lat_cdc));
    let outbox_caches = Arc::new(nodes.each(|c| &c.lat_outbox));
    let plain_caches = Arc::new(nodes.each(|c| &c.lat_plain));
    let relay = cdc_relay(
        url,
        transport,
        "bench_latency",
        LAT_CDC,
        "lat_cdc",
        (None, None),
        &cdc_caches,
    )
    .await;

    let outbox = Outbox::builder()
        .schema("bench_outbox")
        .build()
        .expect("outbox");
    outbox.migrate(pool).await.expect("migrate");
    let outbox_builder =
        OutboxRelay::builder(pool.clone(), publisher(transport, "outbox")).outbox(outbox.clone());
    let outbox_relay = on_relay_runtime(async move { outbox_builder.start().await })
        .await
        .expect("outbox relay");
    let dict = outbox.dictionary(LAT_OUTBOX);
    let plain = publisher(transport, "plain");

    let mut paths = ["CDC relay", "outbox + relay", "publish after commit"].map(|name| Path {
        name,
        hist: histogram(),
        late: 0,
    });
    let mut conn = pool.acquire().await.expect("connection");
    for i in 0..(s.latency_warmup + s.latency_samples) {
        for j in 0..3 {
            let path = (i as usize + j) % 3;
            let k = i % keys;
            let v = format!("v{i}");
            let id = k as i64;
            let caches = [&cdc_caches, &outbox_caches, &plain_caches][path];
            let before: Vec<u64> = caches.iter().map(|c| c.status().events_applied).collect();
            let committed = match path {
                0 => {
                    sqlx::query("UPDATE lat_cdc SET name = $2 WHERE id = $1")
                        .bind(id)
                        .bind(&v)
                        .execute(&mut *conn)
                        .await
                        .expect("update");
                    Instant::now()
                }
                1 => {
                    let mut tx = conn.begin().await.expect("begin");
                    sqlx::query("UPDATE lat_app SET name = $2 WHERE id = $1")
                        .bind(id)
                        .bind(&v)
                        .execute(&mut *tx)
                        .await
                        .expect("update");
                    dict.insert(&mut tx, &k, &v).await.expect("enqueue");
                    tx.commit().await.expect("commit");
                    Instant::now()
                }
                _ => {
                    sqlx::query("UPDATE lat_app SET name = $2 WHERE id = $1")
                        .bind(id + keys as i64)
                        .bind(&v)
                        .execute(&mut *conn)
                        .await
                        .expect("update");
                    let committed = Instant::now();
                    plain
                        .insert(LAT_PLAIN.name(), [(k, &v)])
                        .await
                        .expect("publish");
                    committed
                }
            };
            let p = &mut paths[path];
            let done = applied(caches, before, k, &v, &mut p.late).await;
            if i >= s.latency_warmup {
                p.hist
                    .saturating_record(done.duration_since(committed).as_micros() as u64);
            }
        }
    }
    drop(conn);
    let stats = relay.stats();
    let events = s.latency_warmup + s.latency_samples;
    assert!(
        stats.rows == events && (events..=events + 1).contains(&stats.transactions),
        "the relay published other than one row per update: {stats:?}"
    );
    relay.shutdown().await;
    outbox_relay.shutdown().await;
    drop_slot(pool, "bench_latency").await;
    Vec::from(paths)
}

fn print_latency(paths: &[Path], s: &Sizes) {
    println!(
        "Commit → applied on all {NODES} nodes, µs; {} sequential single-row updates per path after {} of warm-up, \
         the three paths taking turns; every path publishes on the same in-process transport \
         (`EmbeddedTransport`) to the same nodes: only the path differs.\n",
        s.latency_samples, s.latency_warmup
    );
    println!("| path | p50 | p90 | p99 | max | mean | samples | value late |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for path in paths {
        let h = &path.hist;
        println!(
            "| {} | {} | {} | {} | {} | {:.0} | {} | {} |",
            path.name,
            p(h, 0.5),
            p(h, 0.9),
            p(h, 0.99),
            h.max(),
            h.mean(),
            h.len(),
            path.late
        );
    }
    let (cdc, outbox, plain) = (&paths[0].hist, &paths[1].hist, &paths[2].hist);
    println!();
    for (name, a, b) in [
        ("CDC / outbox", cdc, outbox),
        ("CDC / plain publish", cdc, plain),
        ("outbox / plain publish", outbox, plain),
    ] {
        println!(
            "{name}: p50 {:.2}×, p99 {:.2}×",
            ratio(p(a, 0.5), p(b, 0.5)),
            ratio(p(a, 0.99), p(b, 0.99))
        );
    }
    println!(
        "\n(\"value late\": samples where the event count moved before the new value was there; \
         the sample then ends when it is.)"
    );
}

// ------------------------------------------------------------ 2. throughput

/// What writes during a phase.
#[derive(Debug, Clone)]
enum Load {
    /// `pgbench` (a process of its own), with this script.
    Pgbench { bin: String, script: String },
    /// Tokio tasks in this process, on the relay's and the nodes' runtime.
    InProcess,
}

struct Phase {
    /// Updates committed per second.
    rate: f64,
    updates: u64,
    /// Mean update latency, µs (pgbench's "latency average").
    latency_us: f64,
    /// p50 and p99, µs, where known (the in-process writers).
    percentiles: Option<(u64, u64)>,
    failed: u64,
    relay: Option<RelayPhase>,
    cores: Cores,
    /// The longest a 10 ms timer task on the bench's runtime overslept.
    stall: Duration,
    /// The relay's counters over the burst, until drained: row changes,
    /// transactions, failed sessions.
    counted: (u64, u64, u64),
    /// Walsenders the server ended for want of a reply meanwhile.
    timeouts: usize,
    /// The floor phase: bytes of log its walsender had not sent yet when
    /// the writers stopped (`None` if it was gone).
    floor_behind: Option<i64>,
}

struct RelayPhase {
    /// Row changes and transactions the relay published while the writers
    /// ran, per second.
    rows_rate: f64,
    tx_rate: f64,
    /// Events the nodes applied meanwhile, per second (one per publish).
    events_rate: f64,
    peak_lag_bytes: u64,
    peak_lag_seconds: f64,
    /// When the writers stopped: the server's slot lag, the relay's own
    /// (end of log − its confirmed LSN), and its `lag_seconds`.
    end_slot_lag: u64,
    end_relay_lag: u64,
    end_lag_seconds: f64,
    /// Updates committed but not yet published when the writers stopped.
    end_backlog: u64,
    /// From the writers' stop until every update was published.
    drain: Duration,
}

/// One in-process writer: autocommit single-row updates on random ids
/// from `start` until `end`, each counted in `done`. Returns its
/// connection open, so that its backend's CPU time can still be read.
async fn writer(
    url: String,
    seed: u64,
    rows: u64,
    start: Instant,
    end: Instant,
    done: Arc<AtomicU64>,
) -> (Histogram<u64>, PgConnection) {
    let mut conn = PgConnection::connect(&url).await.expect("connect");
    let mut h = histogram();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut n = 0u64;
    tokio::time::sleep_until(start.into()).await;
    loop {
        let now = Instant::now();
        if now >= end {
            break;
        }
        // xorshift64
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        n += 1;
        sqlx::query("UPDATE items SET name = $2 WHERE id = $1")
            .bind((x % rows) as i64)
            .bind(format!("w{seed}-{n}"))
            .execute(&mut conn)
            .await
            .expect("update");
        h.saturating_record(now.elapsed().as_micros() as u64);
        done.fetch_add(1, Ordering::Relaxed);
    }
    (h, conn)
}

/// The ticker's worst oversleep: when it went to sleep and when it woke.
static WORST_TICK: std::sync::Mutex<Option<(Instant, Instant)>> = std::sync::Mutex::new(None);

/// One reading of the bench runtime's own counters.
struct RuntimeReading {
    at: Instant,
    /// Per worker: its total busy time and how often it parked (both
    /// move only when it parks or does its maintenance).
    busy: Vec<Duration>,
    parks: Vec<u64>,
    queued: usize,
    alive: usize,
}

/// One thread of this process at a reading, from `/proc/self/task`.
struct ThreadReading {
    tid: String,
    name: String,
    /// `R` running or runnable, `S` asleep, ...
    state: char,
    /// The system call it is in (`/proc/.../syscall`'s first field).
    syscall: String,
}

impl ThreadReading {
    fn all() -> Vec<ThreadReading> {
        let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
            return Vec::new();
        };
        dir.flatten()
            .map(|t| {
                let path = t.path();
                let stat = std::fs::read_to_string(path.join("stat")).unwrap_or_default();
                let syscall = std::fs::read_to_string(path.join("syscall")).unwrap_or_default();
                ThreadReading {
                    tid: t.file_name().to_string_lossy().into_owned(),
                    // `pid (name) state ...`: the name may hold spaces.
                    name: stat
                        .split_once('(')
                        .and_then(|(_, r)| r.rsplit_once(')'))
                        .map_or("", |(n, _)| n)
                        .to_owned(),
                    state: stat
                        .rsplit_once(") ")
                        .and_then(|(_, r)| r.chars().next())
                        .unwrap_or('?'),
                    syscall: syscall.split_whitespace().next().unwrap_or("").to_owned(),
                }
            })
            .collect()
    }
}

/// With `CDC_STALL_TRACE` set: the bench runtime's own counters and every
/// thread's state, read every 2 ms from a thread of its own, printed for
/// the ticker's worst oversleep: were the workers busy or parked, and what
/// were the other threads doing?
fn stall_trace() -> Option<(
    Arc<std::sync::atomic::AtomicBool>,
    std::thread::JoinHandle<()>,
)> {
    std::env::var_os("CDC_STALL_TRACE")?;
    *WORST_TICK.lock().expect("worst tick") = None;
    let m = tokio::runtime::Handle::current().metrics();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::spawn(move || {
        let mut readings = Vec::new();
        let mut threads: Vec<(Instant, Vec<ThreadReading>)> = Vec::new();
        while !flag.load(Ordering::Relaxed) {
            let workers = 0..m.num_workers();
            readings.push(RuntimeReading {
                at: Instant::now(),
                busy: workers
                    .clone()
                    .map(|w| m.worker_total_busy_duration(w))
                    .collect(),
                parks: workers.map(|w| m.worker_park_count(w)).collect(),
                queued: m.global_queue_depth(),
                alive: m.num_alive_tasks(),
            });
            threads.push((Instant::now(), ThreadReading::all()));
            std::thread::sleep(Duration::from_millis(2));
        }
        let Some((from, to)) = *WORST_TICK.lock().expect("worst tick") else {
            return;
        };
        print_stall(from, to, &readings, &threads);
    });
    Some((stop, thread))
}

fn print_stall(
    from: Instant,
    to: Instant,
    readings: &[RuntimeReading],
    threads: &[(Instant, Vec<ThreadReading>)],
) {
    let unix = |at: Instant| {
        let t = std::time::SystemTime::now() - Instant::now().saturating_duration_since(at);
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    };
    println!(
        "stall trace: worst oversleep {:?}, from unix {:.3} to {:.3}",
        to - from,
        unix(from),
        unix(to)
    );
    // Per thread over the window, how many readings in each state (R =
    // running or runnable; S:202 asleep in futex, S:232 in epoll_wait,
    // S:230 in clock_nanosleep).
    let mut per: std::collections::BTreeMap<(&str, &str), std::collections::BTreeMap<String, u32>> =
        std::collections::BTreeMap::new();
    for (_, all) in threads.iter().filter(|t| (from..=to).contains(&t.0)) {
        for t in all {
            let state = if t.state == 'R' {
                "R".to_owned()
            } else {
                format!("{}:{}", t.state, t.syscall)
            };
            *per.entry((&t.tid, &t.name))
                .or_default()
                .entry(state)
                .or_default() += 1;
        }
    }
    for ((tid, name), states) in &per {
        let states: Vec<String> = states.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("thread {tid} {name}: {}", states.join(" "));
    }
    println!(
        "t ms (from 20 ms before it went to sleep) | busy ms per worker (delta) | parks per worker (delta) | global queue | alive tasks"
    );
    let window = readings.iter().filter(|r| {
        r.at + Duration::from_millis(20) >= from && r.at <= to + Duration::from_millis(10)
    });
    let mut prev: Option<&RuntimeReading> = None;
    for r in window {
        if let Some(p) = prev {
            let busy: Vec<String> = r
                .busy
                .iter()
                .zip(&p.busy)
                .map(|(a, b)| format!("{:.1}", a.saturating_sub(*b).as_secs_f64() * 1e3))
                .collect();
            let parks: Vec<String> = r
                .parks
                .iter()
                .zip(&p.parks)
                .map(|(a, b)| a.saturating_sub(*b).to_string())
                .collect();
            println!(
                "{:.1} | {} | {} | {} | {}",
                r.at.saturating_duration_since(from).as_secs_f64() * 1e3,
                busy.join(" "),
                parks.join(" "),
                r.queued,
                r.alive
            );
        }
        prev = Some(r);
    }
}

/// A task that sleeps 10 ms at a time and keeps the longest it overslept:
/// how long the bench's runtime left a ready task waiting.
fn ticker() -> (
    tokio::task::JoinHandle<Duration>,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let task = tokio::spawn(async move {
        let mut worst = Duration::ZERO;
        while !flag.load(Ordering::Relaxed) {
            let t = Instant::now();
            tokio::time::sleep(Duration::from_millis(10)).await;
            let late = t.elapsed().saturating_sub(Duration::from_millis(10));
            if late > worst {
                worst = late;
                *WORST_TICK.lock().expect("worst tick") = Some((t, Instant::now()));
            }
        }
        worst
    });
    (task, stop)
}

/// pgbench's summary: (transactions, tps without connection time, mean
/// latency in ms, failed transactions).
fn parse_pgbench(out: &str) -> (u64, f64, f64, u64) {
    let after = |prefix: &str| {
        out.lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_owned)
    };
    let number = |prefix: &str| {
        after(prefix)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("pgbench printed no {prefix:?}:\n{out}"))
    };
    (
        number("number of transactions actually processed:") as u64,
        number("tps ="),
        number("latency average ="),
        after("number of failed transactions:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    )
}

#[allow(clippy::too_many_arguments)]
async fn phase(
    pg: &PostgresServer,
    url: &str,
    pool: &PgPool,
    s: &Sizes,
    load: &Load,
    postmaster: Option<u32>,
    reader: Reader<'_>,
) -> Phase {
    exec(pool, "VACUUM items").await;
    exec(pool, "CHECKPOINT").await;
    let relay = match reader {
        Reader::Relay(r, caches) => Some((r, caches)),
        _ => None,
    };
    let walsender = match reader {
        Reader::None => None,
        Reader::Floor(_) => walsender_pid(pool, FLOOR_SLOT).await,
        Reader::Relay(..) => walsender_pid(pool, TP_SLOT).await,
    };
    let consumer = match reader {
        Reader::Floor(pid) => Some(pid),
        _ => None,
    };
    let port = pg.port();
    let log0 = pg.log().len();
    let secs = s.tp_window.as_secs().max(1);
    let (tick, tick_stop) = ticker();
    let r0 = relay.map(|(r, caches)| (r.stats(), caches[0].status().events_applied));
    // The writers run from `start` to `end`; the CPU is read inside that,
    // half a second in from either edge, while every writer's backend is
    // connected.
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now() + Duration::from_millis(300);
    let end = start + Duration::from_secs(secs);
    let (cpu_from, cpu_to) = (
        start + Duration::from_millis(500),
        end - Duration::from_millis(500),
    );
    enum Running {
        Pgbench(std::process::Child),
        Tasks(Vec<tokio::task::JoinHandle<(Histogram<u64>, PgConnection)>>),
    }
    // In-process writers run on the bench's runtime, with the nodes.
    let running = match load {
        Load::Pgbench { .. } => None,
        Load::InProcess => Some(Running::Tasks(
            (0..s.tp_clients)
                .map(|c| {
                    tokio::spawn(writer(
                        url.to_owned(),
                        c as u64 + 1,
                        s.tp_rows,
                        start,
                        end,
                        done.clone(),
                    ))
                })
                .collect(),
        )),
    };
    // pgbench's pid, for its CPU time, once started.
    let (pid_tx, pid_rx) = std::sync::mpsc::channel::<Option<u32>>();
    if running.is_some() {
        let _ = pid_tx.send(None);
    }
    // The CPU is read on a thread of its own, on time even while the
    // bench's runtime is stalled.
    let cpu_reader = std::thread::spawn(move || {
        let load_pid = pid_rx.recv().ok().flatten();
        let read = |at: Instant| {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            let load = load_pid
                .and_then(|p| proc_stat(&p.to_string()))
                .map_or(0, |x| x.1);
            (
                Instant::now(),
                Cpu::read(postmaster, walsender, consumer),
                load,
            )
        };
        (load_pid, read(cpu_from), read(cpu_to))
    });
    // Starting the load, sampling the relay and reading the end state run
    // off the bench's runtime (see `off_runtime`).
    let done_ref = &done;
    let r0_in = r0.clone();
    let measured = off_runtime(async move {
        let mpool = monitor_pool(url).await;
        let running = match (running, load) {
            (Some(r), _) => r,
            (None, Load::Pgbench { bin, script }) => {
                tokio::time::sleep_until(start.into()).await;
                let child = Command::new(bin)
                    .args(["-n", "-h", "127.0.0.1", "-p", &port.to_string()])
                    .args(["-U", "postgres", "-M", "prepared"])
                    .args(["-c", &s.tp_clients.to_string(), "-j", "2"])
                    .args(["-T", &secs.to_string(), "-f", script, "postgres"])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("start pgbench");
                let _ = pid_tx.send(Some(child.id()));
                Running::Pgbench(child)
            }
            (None, Load::InProcess) => unreachable!("in-process writers start above"),
        };
        let (mut peak_bytes, mut peak_seconds) = (0u64, 0f64);
        while Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if let Some((r, _)) = relay {
                let st = r.stats();
                peak_bytes = peak_bytes.max(st.lag_bytes.unwrap_or(0));
                peak_seconds = peak_seconds.max(st.lag_seconds);
            }
        }
        let (updates, rate, latency_us, percentiles, failed) = match running {
            Running::Pgbench(child) => {
                let out = tokio::task::spawn_blocking(move || child.wait_with_output())
                    .await
                    .expect("pgbench")
                    .expect("pgbench output");
                let text = String::from_utf8_lossy(&out.stdout);
                assert!(
                    out.status.success(),
                    "pgbench failed: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                );
                let (n, tps, lat_ms, failed) = parse_pgbench(&text);
                (n, tps, lat_ms * 1000.0, None, failed)
            }
            Running::Tasks(tasks) => {
                let mut lat = histogram();
                let mut conns = Vec::new();
                for t in tasks {
                    let (h, conn) = t.await.expect("writer");
                    lat.add(h).expect("histogram");
                    conns.push(conn);
                }
                drop(conns);
                let n = done_ref.load(Ordering::Relaxed);
                (
                    n,
                    n as f64 / secs as f64,
                    lat.mean(),
                    Some((p(&lat, 0.5), p(&lat, 0.99))),
                    0,
                )
            }
        };
        let stopped = Instant::now();
        // How far behind the end of the log the floor's walsender had
        // sent when the writers stopped.
        let floor_behind = match (reader, walsender) {
            (Reader::Floor(_), Some(pid)) => sqlx::query_scalar::<_, Option<i64>>(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), sent_lsn)::int8 \
                 FROM pg_stat_replication WHERE pid = $1",
            )
            .bind(i32::try_from(pid).expect("pid"))
            .fetch_optional(&mpool)
            .await
            .expect("pg_stat_replication")
            .flatten(),
            _ => None,
        };
        let relay_phase = match (relay, &r0_in) {
            (Some((r, caches)), Some((s0, e0))) => {
                let s1 = r.stats();
                let e1 = caches[0].status().events_applied;
                let wal = wal_now(&mpool).await;
                let slot = slot_lag(&mpool, TP_SLOT).await;
                // Every update is one row change: drained once the relay
                // has published as many rows as were committed.
                let deadline = Instant::now() + STALL * 3;
                while r.stats().rows - s0.rows < updates {
                    assert!(
                        Instant::now() < deadline,
                        "the relay did not publish every update: {:?}, {updates} committed",
                        r.stats()
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let drain = stopped.elapsed();
                let ran = secs as f64;
                Some(RelayPhase {
                    rows_rate: (s1.rows - s0.rows) as f64 / ran,
                    tx_rate: (s1.transactions - s0.transactions) as f64 / ran,
                    events_rate: (e1 - e0) as f64 / ran,
                    peak_lag_bytes: peak_bytes.max(s1.lag_bytes.unwrap_or(0)),
                    peak_lag_seconds: peak_seconds.max(s1.lag_seconds),
                    end_slot_lag: slot,
                    end_relay_lag: wal.saturating_sub(s1.confirmed_lsn),
                    end_lag_seconds: s1.lag_seconds,
                    end_backlog: updates.saturating_sub(s1.rows - s0.rows),
                    drain,
                })
            }
            _ => None,
        };
        mpool.close().await;
        (
            updates,
            rate,
            latency_us,
            percentiles,
            failed,
            floor_behind,
            relay_phase,
        )
    });
    let (updates, rate, latency_us, percentiles, failed, floor_behind, relay_phase) = measured;
    let counted = match (relay, &r0) {
        (Some((r, _)), Some((s0, _))) => {
            let s1 = r.stats();
            (
                s1.rows - s0.rows,
                s1.transactions - s0.transactions,
                s1.failures - s0.failures,
            )
        }
        _ => (0, 0, 0),
    };
    let relay = relay_phase;
    tick_stop.store(true, Ordering::Relaxed);
    let stall = tick.await.expect("ticker");
    let (load_pid, (t0, c0, l0), (t1, c1, l1)) =
        tokio::task::spawn_blocking(move || cpu_reader.join())
            .await
            .expect("cpu reader")
            .expect("cpu reader");
    let window = t1.duration_since(t0).as_secs_f64();
    let mut cores = c1.since(&c0, window);
    if load_pid.is_some() {
        cores.load = (l1.saturating_sub(l0)) as f64 / clock_ticks() / window;
    }
    Phase {
        rate,
        updates,
        latency_us,
        percentiles,
        failed,
        relay,
        cores,
        stall,
        counted,
        timeouts: walsender_timeouts(pg, log0),
        floor_behind,
    }
}

/// CPU time so far, in clock ticks: the server's processes (the
/// postmaster and its children, by pid), the walsender among them, this
/// process (the relay, the nodes, and the in-process writers' client side)
/// and `pg_recvlogical`.
#[derive(Debug, Clone, Default)]
struct Cpu {
    server: std::collections::HashMap<u32, u64>,
    walsender: u64,
    bench: u64,
    consumer: u64,
}

/// `/proc/PID/stat`: (parent pid, utime + stime in ticks).
fn proc_stat(pid: &str) -> Option<(u32, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces: state is the
    // 3rd field overall, ppid the 4th, utime the 14th, stime the 15th.
    let f: Vec<&str> = s.get(s.rfind(')')? + 2..)?.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((f.get(1)?.parse().ok()?, ticks))
}

impl Cpu {
    fn read(postmaster: Option<u32>, walsender: Option<u32>, consumer: Option<u32>) -> Self {
        let ticks = |pid: Option<u32>| {
            pid.and_then(|p| proc_stat(&p.to_string()))
                .map_or(0, |(_, t)| t)
        };
        let mut cpu = Cpu {
            server: std::collections::HashMap::new(),
            walsender: ticks(walsender),
            bench: proc_stat("self").map_or(0, |(_, t)| t),
            consumer: ticks(consumer),
        };
        let Some(pm) = postmaster else { return cpu };
        let pids = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok());
        for pid in pids {
            if let Some((ppid, t)) = proc_stat(&pid.to_string())
                && (ppid == pm || pid == pm)
            {
                cpu.server.insert(pid, t);
            }
        }
        cpu
    }

    /// CPU seconds per second of `window` since `before`. A server process
    /// that exited in between is left out (its ticks are gone with it); one
    /// that started counts from zero.
    fn since(&self, before: &Cpu, window: f64) -> Cores {
        let per_s = |t: u64| t as f64 / clock_ticks() / window;
        let server: u64 = self
            .server
            .iter()
            .map(|(pid, t)| t.saturating_sub(before.server.get(pid).copied().unwrap_or(0)))
            .sum();
        Cores {
            server: per_s(server),
            walsender: per_s(self.walsender.saturating_sub(before.walsender)),
            bench: per_s(self.bench.saturating_sub(before.bench)),
            consumer: per_s(self.consumer.saturating_sub(before.consumer)),
            load: 0.0,
        }
    }
}

/// The postmaster of the server on `port`: the `postgres` process whose
/// command line names the port.
fn postmaster_pid(port: u16) -> Option<u32> {
    let port = port.to_string();
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                args.first().is_some_and(|a| a.ends_with(b"postgres"))
                    && args
                        .windows(2)
                        .any(|w| w[0] == b"-p" && w[1] == port.as_bytes())
            })
        })
}

async fn walsender_pid(pool: &PgPool, slot: &str) -> Option<u32> {
    let pid: Option<i32> =
        sqlx::query_scalar("SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_optional(pool)
            .await
            .expect("slot")
            .flatten();
    pid.and_then(|p| u32::try_from(p).ok())
}

/// What reads the slot during a phase.
#[derive(Clone, Copy)]
enum Reader<'a> {
    /// No slot at all.
    None,
    /// `pg_recvlogical` streams pgoutput to /dev/null (this process id).
    Floor(u32),
    Relay(&'a CdcRelay, &'a [Cache]),
}

/// The cores a phase kept busy (CPU seconds per second).
#[derive(Debug, Clone, Copy, Default)]
struct Cores {
    server: f64,
    walsender: f64,
    bench: f64,
    consumer: f64,
    /// pgbench's own process.
    load: f64,
}

/// Clock ticks per second of `/proc`'s CPU times.
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        sh("getconf", &["CLK_TCK"])
            .and_then(|t| t.parse().ok())
            .unwrap_or(100.0)
    })
}

/// A PostgreSQL 15 client program: Debian's directory, or `PATH`.
fn pg_bin(name: &str) -> Option<String> {
    let debian = format!("/usr/lib/postgresql/15/bin/{name}");
    if std::path::Path::new(&debian).exists() {
        return Some(debian);
    }
    sh("sh", &["-c", &format!("command -v {name}")]).filter(|p| !p.is_empty())
}

/// `pg_recvlogical` streaming a pgoutput slot on `items` to /dev/null: the
/// database's cost of logical decoding with a consumer that does nothing.
async fn floor_reader(pool: &PgPool, port: u16) -> Option<std::process::Child> {
    let bin = pg_bin("pg_recvlogical")?;
    exec(
        pool,
        &format!("CREATE PUBLICATION {FLOOR_SLOT} FOR TABLE items"),
    )
    .await;
    exec(
        pool,
        &format!("SELECT pg_create_logical_replication_slot('{FLOOR_SLOT}', 'pgoutput')"),
    )
    .await;
    let child = Command::new(bin)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args([
            "-d",
            "postgres",
            "--slot",
            FLOOR_SLOT,
            "--start",
            "-f",
            "/dev/null",
        ])
        .args(["-o", "proto_version=1", "-o"])
        .arg(format!("publication_names={FLOOR_SLOT}"))
        .stdin(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = Instant::now() + STALL;
    while walsender_pid(pool, FLOOR_SLOT).await.is_none() {
        assert!(Instant::now() < deadline, "pg_recvlogical did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Some(child)
}

struct Throughput {
    load: Load,
    before: Phase,
    /// `None` where `pg_recvlogical` is missing.
    floor: Option<Phase>,
    with: Phase,
    /// With the relay reporting its lag every `REPORT_EVERY`.
    reported: Phase,
    /// Node 0's freshness age of `items` while `reported` ran, every
    /// 100 ms (`None`: not known then).
    ages: Vec<Option<u64>>,
    after: Phase,
}

async fn throughput(
    pg: &PostgresServer,
    url: &str,
    pool: &PgPool,
    transport: &EmbeddedTransport,
    nodes: &Nodes,
    s: &Sizes,
    in_process: bool,
) -> Throughput {
    let port = pg.port();
    create_table(pool, "items", s.tp_rows).await;
    let script = tempfile::NamedTempFile::new().expect("script file");
    std::fs::write(
        script.path(),
        format!(
            "\\set id random(0, {})\n\\set v random(1, 1000000000)\n\
             UPDATE items SET name = 'p' || :v WHERE id = :id;\n",
            s.tp_rows - 1
        ),
    )
    .expect("script");
    let load = match pg_bin("pgbench") {
        Some(bin) if !in_process => Load::Pgbench {
            bin,
            script: script.path().to_string_lossy().into_owned(),
        },
        _ => Load::InProcess,
    };
    let postmaster = postmaster_pid(port);
    let caches = nodes.each(|c| &c.items);
    let run = |reader| phase(pg, url, pool, s, &load, postmaster, reader);
    let before = run(Reader::None).await;
    let floor = match floor_reader(pool, port).await {
        Some(mut child) => {
            let ph = run(Reader::Floor(child.id())).await;
            // Ends only the process this bench started.
            let _ = child.kill();
            let _ = child.wait();
            drop_slot(pool, FLOOR_SLOT).await;
            exec(pool, &format!("DROP PUBLICATION {FLOOR_SLOT}")).await;
            Some(ph)
        }
        None => None,
    };
    let relay = cdc_relay(
        url,
        transport,
        TP_SLOT,
        ITEMS,
        "items",
        (Some(LAG_EVERY), None),
        &caches,
    )
    .await;
    let with = run(Reader::Relay(&relay, &caches)).await;
    agree(pool, &caches).await;
    relay.shutdown().await;
    drop_slot(pool, TP_SLOT).await;
    // The same, the relay reporting its lag to the nodes every 100 ms:
    // what the reports cost it, and the lag they put in each node's
    // freshness (node 0's `items`, sampled every 100 ms off the bench's
    // runtime while the writers run).
    let relay = cdc_relay(
        url,
        transport,
        TP_SLOT,
        ITEMS,
        "items",
        (Some(LAG_EVERY), Some(REPORT_EVERY)),
        &caches,
    )
    .await;
    let sampling = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (node, sampling) = (nodes.nodes[0].clone(), sampling.clone());
        std::thread::spawn(move || {
            let mut ages = Vec::new();
            while sampling.load(Ordering::Relaxed) {
                let age = node
                    .status()
                    .caches
                    .iter()
                    .find(|c| c.name == ITEMS.name())
                    .and_then(|c| c.freshness_age_ms);
                ages.push(age);
                std::thread::sleep(Duration::from_millis(100));
            }
            ages
        })
    };
    let reported = run(Reader::Relay(&relay, &caches)).await;
    sampling.store(false, Ordering::Relaxed);
    let ages = sampler.join().expect("sampler");
    agree(pool, &caches).await;
    relay.shutdown().await;
    drop_slot(pool, TP_SLOT).await;
    let after = run(Reader::None).await;
    Throughput {
        load,
        before,
        floor,
        with,
        reported,
        ages,
        after,
    }
}

/// Every node holds, for every key it holds, the database's value (once
/// the nodes have applied what the relay published).
async fn agree(pool: &PgPool, caches: &[Cache]) {
    let db: std::collections::HashMap<i64, String> =
        sqlx::query_as::<_, (i64, String)>("SELECT id, name FROM items")
            .fetch_all(pool)
            .await
            .expect("rows")
            .into_iter()
            .collect();
    let deadline = Instant::now() + STALL;
    loop {
        let stale = caches.iter().enumerate().find_map(|(n, c)| {
            let mut held = 0;
            for (k, v) in c.iter() {
                held += 1;
                if db.get(&(*k as i64)) != Some(&v) {
                    return Some(format!("node-{n} holds {k} = {v}"));
                }
            }
            (held == 0).then(|| format!("node-{n} holds nothing"))
        });
        match stale {
            None => return,
            Some(s) => assert!(Instant::now() < deadline, "{s}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn print_throughput(t: &Throughput, s: &Sizes) {
    let r = t.with.relay.as_ref().expect("the relay's phase");
    let load = match &t.load {
        Load::Pgbench { .. } => format!(
            "`pgbench -n -M prepared -c {} -j 2 -T {}` (a process of its own), its script \
             `UPDATE items SET name = 'p' || :v WHERE id = :id` on random ids",
            s.tp_clients,
            s.tp_window.as_secs()
        ),
        Load::InProcess => format!(
            "{} tokio tasks in the bench's process (on the relay's and the nodes' runtime), \
             each a connection doing autocommit `UPDATE items SET name = $2 WHERE id = $1` \
             on random ids for {} s",
            s.tp_clients,
            s.tp_window.as_secs()
        ),
    };
    println!(
        "Writers: {load}, of {} rows; `VACUUM` and `CHECKPOINT` before each phase; the relay \
         publishes to the {NODES} nodes on the embedded transport; all on this machine. CPU: cores \
         kept busy (CPU s per s, read in /proc over the run less half a second at either end) by \
         the server's processes (walsender included), the walsender alone, this process (the \
         relay and the nodes{}) and the load generator. Stall: the longest a 10 ms timer task on \
         the bench's tokio runtime overslept.\n",
        th(s.tp_rows),
        if matches!(t.load, Load::InProcess) {
            ", and the writers' client side"
        } else {
            ""
        }
    );
    println!(
        "| phase | updates/s | update latency µs, mean{} | relay rows/s | relay transactions/s | publishes/s | CPU: server | walsender | bench process | load generator | stall ms |",
        if matches!(t.load, Load::InProcess) {
            " / p50 / p99"
        } else {
            ""
        }
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut rows = vec![("database alone, before (no slot)", &t.before)];
    if let Some(f) = &t.floor {
        rows.push(("slot streamed by `pg_recvlogical` to /dev/null", f));
    }
    rows.push(("with the CDC relay streaming", &t.with));
    rows.push(("the relay reporting its lag every 100 ms", &t.reported));
    rows.push(("database alone, after (no slot)", &t.after));
    for (name, ph) in rows {
        let (rows, tx, ev) = ph
            .relay
            .as_ref()
            .map_or(("–".into(), "–".into(), "–".into()), |r| {
                (thf(r.rows_rate), thf(r.tx_rate), thf(r.events_rate))
            });
        let c = ph.cores;
        let lat = match ph.percentiles {
            Some((p50, p99)) => format!("{:.0} / {p50} / {p99}", ph.latency_us),
            None => format!("{:.0}", ph.latency_us),
        };
        let load_cpu = match t.load {
            Load::Pgbench { .. } => c.load + c.consumer,
            Load::InProcess => c.consumer,
        };
        println!(
            "| {name} | {} | {lat} | {rows} | {tx} | {ev} | {:.2} | {} | {:.2} | {} | {} |",
            thf(ph.rate),
            c.server,
            if c.walsender > 0.0 {
                format!("{:.2}", c.walsender)
            } else {
                "–".into()
            },
            c.bench,
            if load_cpu > 0.0 {
                format!("{load_cpu:.2}")
            } else {
                "–".into()
            },
            ph.stall.as_millis(),
        );
        assert_eq!(ph.failed, 0, "{name}: pgbench counted failed transactions");
    }
    if let Some(f) = &t.floor {
        println!(
            "\n(the `pg_recvlogical` row's load-generator column adds pg_recvlogical's own {:.2} cores; \
             its walsender was {} behind the end of the log when pgbench stopped)",
            f.cores.consumer,
            f.floor_behind
                .map_or("gone, not".into(), |b| format!("{} B", th(b.max(0) as u64)))
        );
    }
    let raw = (t.before.rate + t.after.rate) / 2.0;
    println!();
    if let Some(f) = &t.floor {
        println!(
            "updates with pg_recvlogical streaming / without a slot: {:.2}×",
            f.rate / raw
        );
    }
    println!(
        "updates with the relay streaming / without a slot (mean of before and after): {:.2}×",
        t.with.rate / raw
    );
    println!(
        "relay rows/s / updates/s in the same run: {:.2}×; / the database alone: {:.2}×",
        r.rows_rate / t.with.rate,
        r.rows_rate / raw
    );
    println!(
        "\n| relay, when the writers stopped | |\n|---|---:|\n\
         | updates committed | {} |\n\
         | committed but not yet published | {} |\n\
         | slot lag, server's view (`confirmed_flush_lsn`) | {} B |\n\
         | slot lag, relay's confirmed LSN | {} B |\n\
         | `lag_seconds` | {:.3} |\n\
         | peak `lag_bytes` / `lag_seconds` while the writers ran | {} B / {:.3} s |\n\
         | writers' stop → every update published | {} ms |\n\
         | relay sessions failed while the writers ran, walsenders the server timed out | {}, {} |",
        th(t.with.updates),
        th(r.end_backlog),
        th(r.end_slot_lag),
        th(r.end_relay_lag),
        r.end_lag_seconds,
        th(r.peak_lag_bytes),
        r.peak_lag_seconds,
        r.drain.as_millis(),
        t.with.counted.2,
        t.with.timeouts,
    );
    print_reports(t);
}

/// What the relay's lag reports cost it, and the lag a node showed for
/// them while the writers ran.
fn print_reports(t: &Throughput) {
    let (off, on) = (
        t.with.relay.as_ref().expect("the relay's phase"),
        t.reported
            .relay
            .as_ref()
            .expect("the reporting relay's phase"),
    );
    println!(
        "\nReports every {} ms against none, same writers: updates/s {:.2}×, relay rows/s {:.2}× \
         ({} against {}); peak `lag_seconds` {:.3} against {:.3}.",
        REPORT_EVERY.as_millis(),
        t.reported.rate / t.with.rate,
        on.rows_rate / off.rows_rate,
        thf(on.rows_rate),
        thf(off.rows_rate),
        on.peak_lag_seconds,
        off.peak_lag_seconds,
    );
    let mut known: Vec<u64> = t.ages.iter().flatten().copied().collect();
    known.sort_unstable();
    let at = |q: f64| {
        known
            .get(((known.len() as f64 * q) as usize).min(known.len().saturating_sub(1)))
            .copied()
    };
    let ms = |v: Option<u64>| v.map_or("–".into(), th);
    println!(
        "Node 0's freshness age of `items` (its own proof, every 1 s, and the relay's lag as \
         reported), sampled every 100 ms while the writers ran: {} samples, {} known; ms p50 {}, \
         p99 {}, max {}; the last sample {}.",
        t.ages.len(),
        known.len(),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(known.last().copied()),
        ms(t.ages.last().copied().flatten()),
    );
}

// ------------------------------------------------------------ 3. lag

struct Sample {
    at: Duration,
    lag_bytes: Option<u64>,
    lag_seconds: f64,
    rows: u64,
}

struct Burst {
    name: String,
    rows: u64,
    write: Duration,
    peak_bytes: u64,
    peak_seconds: f64,
    /// From the last commit.
    published: Duration,
    applied: Duration,
    drained: Option<Duration>,
    /// From the first commit's start to every row published.
    relay_rate: f64,
    timeline: Vec<Sample>,
    /// The longest a 10 ms timer task on the bench's runtime overslept.
    stall: Duration,
    /// The relay's counters over the burst, until drained: row changes,
    /// transactions, failed sessions.
    counted: (u64, u64, u64),
    /// Walsenders the server ended for want of a reply meanwhile.
    timeouts: usize,
}

async fn burst(
    pg: &PostgresServer,
    relay: &CdcRelay,
    caches: &[Cache],
    first_id: u64,
    rows: u64,
    per_tx: u64,
) -> Burst {
    // One transaction past the relay's cap: nodes see one clear.
    let single = per_tx >= rows;
    let log0 = pg.log().len();
    let stats0 = relay.stats();
    let rows0 = stats0.rows;
    let clears0: Vec<u64> = caches.iter().map(|c| c.status().clears).collect();
    let last_id = first_id + rows - 1;
    let last_value = format!("b{last_id}");
    let transactions = rows.div_ceil(per_tx);
    let (tick, tick_stop) = ticker();
    let trace = stall_trace();
    let url = pg.url();
    // Writing and watching run off the bench's runtime (see
    // `off_runtime`), so neither waits out its stalls.
    let (start, wrote, published, applied, drained, timeline, peak_bytes, peak_seconds) =
        off_runtime(async {
            let mpool = monitor_pool(&url).await;
            let writer_pool = mpool.clone();
            let start = Instant::now();
            let writes = tokio::spawn(async move {
                let mut conn = writer_pool.acquire().await.expect("connection");
                let mut id = first_id;
                while id <= last_id {
                    let to = (id + per_tx - 1).min(last_id);
                    sqlx::query(
                    "INSERT INTO burst SELECT g, 'b' || g FROM generate_series($1::int8, $2::int8) g",
                )
                .bind(id as i64)
                .bind(to as i64)
                .execute(&mut *conn)
                .await
                .expect("insert");
                    id = to + 1;
                }
                Instant::now()
            });
            let mut writes = Some(writes);
            let mut timeline = Vec::new();
            let (mut peak_bytes, mut peak_seconds) = (0u64, 0f64);
            let mut wrote: Option<Instant> = None;
            let mut published: Option<Instant> = None;
            let mut applied: Option<Instant> = None;
            let mut drained: Option<Instant> = None;
            let mut next_sample = start;
            let deadline = start + Duration::from_secs(600);
            loop {
                let now = Instant::now();
                let st = relay.stats();
                let done_rows = st.rows - rows0;
                peak_bytes = peak_bytes.max(st.lag_bytes.unwrap_or(0));
                peak_seconds = peak_seconds.max(st.lag_seconds);
                if now >= next_sample {
                    timeline.push(Sample {
                        at: now - start,
                        lag_bytes: st.lag_bytes,
                        lag_seconds: st.lag_seconds,
                        rows: done_rows,
                    });
                    // After a stall, the next sample is a period from now.
                    next_sample = (next_sample + LAG_EVERY).max(now + LAG_EVERY / 2);
                }
                if writes.as_ref().is_some_and(|w| w.is_finished()) {
                    let w = writes.take().expect("the writer");
                    wrote = Some(w.await.expect("burst writer"));
                }
                if wrote.is_some() && published.is_none() && done_rows >= rows {
                    published = Some(now);
                }
                if published.is_some() && applied.is_none() {
                    let mut all = true;
                    for (c, before) in caches.iter().zip(&clears0) {
                        all &= if single {
                            c.status().clears > *before
                        } else {
                            c.peek(&last_id).await.as_deref() == Some(last_value.as_str())
                        };
                    }
                    if all {
                        applied = Some(now);
                    }
                }
                // Drained: the server's own view of the slot (its
                // `confirmed_flush_lsn`, which the relay's status updates move
                // every 200 ms), asked at each poll once every row is published.
                if published.is_some()
                    && drained.is_none()
                    && slot_lag(&mpool, LAG_SLOT).await <= DRAINED_BYTES
                {
                    drained = Some(Instant::now());
                }
                if let (Some(_), Some(_)) = (applied, drained) {
                    break;
                }
                if let (Some(_), Some(p)) = (applied, published)
                    && now > p + Duration::from_secs(30)
                {
                    break; // the lag never came back under the mark: reported as such
                }
                assert!(now < deadline, "the burst did not drain in 600 s: {st:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Two more readings of the relay's own, for the timeline's tail.
            for _ in 0..2 {
                tokio::time::sleep_until(next_sample.into()).await;
                let st = relay.stats();
                timeline.push(Sample {
                    at: next_sample - start,
                    lag_bytes: st.lag_bytes,
                    lag_seconds: st.lag_seconds,
                    rows: st.rows - rows0,
                });
                peak_bytes = peak_bytes.max(st.lag_bytes.unwrap_or(0));
                next_sample += LAG_EVERY;
            }
            mpool.close().await;
            (
                start,
                wrote,
                published,
                applied,
                drained,
                timeline,
                peak_bytes,
                peak_seconds,
            )
        });
    tick_stop.store(true, Ordering::Relaxed);
    let stall = tick.await.expect("ticker");
    if let Some((stop, thread)) = trace {
        stop.store(true, Ordering::Relaxed);
        thread.join().expect("stall trace");
    }
    let stats1 = relay.stats();
    let timeouts = walsender_timeouts(pg, log0);
    let wrote = wrote.expect("written");
    let published = published.expect("published");
    let applied = applied.expect("applied");
    Burst {
        name: if single {
            format!("{} rows in one transaction (a clear)", th(rows))
        } else {
            format!(
                "{} rows in {transactions} transactions of {} (row events)",
                th(rows),
                th(per_tx)
            )
        },
        rows,
        write: wrote - start,
        peak_bytes,
        peak_seconds,
        published: published.saturating_duration_since(wrote),
        applied: applied.saturating_duration_since(wrote),
        drained: drained.map(|d| d.saturating_duration_since(wrote)),
        relay_rate: rows as f64 / (published - start).as_secs_f64(),
        timeline,
        stall,
        counted: (
            stats1.rows - stats0.rows,
            stats1.transactions - stats0.transactions,
            stats1.failures - stats0.failures,
        ),
        timeouts,
    }
}

async fn lag(
    pg: &PostgresServer,
    url: &str,
    pool: &PgPool,
    transport: &EmbeddedTransport,
    nodes: &Nodes,
    s: &Sizes,
) -> Vec<Burst> {
    exec(
        pool,
        "DROP TABLE IF EXISTS burst;
         CREATE TABLE burst (id bigint PRIMARY KEY, name text NOT NULL)
             WITH (autovacuum_enabled = off);",
    )
    .await;
    let caches = nodes.each(|c| &c.burst);
    let relay = cdc_relay(
        url,
        transport,
        LAG_SLOT,
        BURST,
        "burst",
        (Some(LAG_EVERY), None),
        &caches,
    )
    .await;
    exec(pool, "CHECKPOINT").await;
    let batched = burst(pg, &relay, &caches, 0, s.burst_rows, BURST_TX_ROWS).await;
    // Every node holds every row of the batched burst (counted on a thread
    // of its own: a million-entry scan must not hold a runtime worker).
    let all = caches.to_vec();
    let counts = tokio::task::spawn_blocking(move || {
        all.iter()
            .map(|c| c.iter().count() as u64)
            .collect::<Vec<_>>()
    })
    .await
    .expect("count");
    for (n, (c, held)) in caches.iter().zip(counts).enumerate() {
        assert_eq!(
            held, s.burst_rows,
            "node-{n} holds {held} rows of the burst"
        );
        for id in [0, s.burst_rows / 2, s.burst_rows - 1] {
            assert_eq!(
                c.peek(&id).await,
                Some(format!("b{id}")),
                "node-{n}, row {id}"
            );
        }
    }
    // Settle: the lag back near zero before the next burst.
    tokio::time::sleep(Duration::from_secs(1)).await;
    exec(pool, "CHECKPOINT").await;
    let single = burst(
        pg,
        &relay,
        &caches,
        s.burst_rows,
        s.burst_rows,
        s.burst_rows + 1,
    )
    .await;
    // The clear left nothing of the first burst on any node (all older).
    for (n, c) in caches.iter().enumerate() {
        assert_eq!(c.peek(&0).await, None, "node-{n}: the clear left row 0");
    }
    relay.shutdown().await;
    drop_slot(pool, LAG_SLOT).await;
    vec![batched, single]
}

fn print_lag(bursts: &[Burst]) {
    println!(
        "One connection writes the burst as fast as it can (`INSERT … SELECT generate_series`) \
         while the relay streams. Peaks: the relay's `lag_bytes` (the slot's \
         `confirmed_flush_lsn` behind the end of the log, which the relay reads every 500 ms) and \
         `lag_seconds` (server clock minus the commit time of the oldest transaction it received \
         and has not confirmed), polled every 20 ms. Times from the burst's last commit: every \
         row counted in `CdcRelay::stats().rows`, every node holding the last row (or having \
         applied the clear), and \"drained\": the server's own slot lag ≤ {} KiB, asked every \
         20 ms once every row was published. Stall: the longest a 10 ms timer task on the \
         bench's tokio runtime (the relay's and the nodes') overslept.\n",
        DRAINED_BYTES >> 10
    );
    println!(
        "| burst | write time s | written rows/s | peak lag MiB | peak lag s | all published after, s | applied on {NODES} nodes after, s | drained after, s | relay rows/s, first commit → all published | stall ms | relay counted rows / transactions / failed sessions | walsender timeouts |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for b in bursts {
        println!(
            "| {} | {:.2} | {} | {} | {:.2} | {:.2} | {:.2} | {} | {} | {} | {} / {} / {} | {} |",
            b.name,
            b.write.as_secs_f64(),
            thf(b.rows as f64 / b.write.as_secs_f64()),
            mib(b.peak_bytes),
            b.peak_seconds,
            b.published.as_secs_f64(),
            b.applied.as_secs_f64(),
            b.drained.map_or("not within 30 s".into(), |d| format!(
                "{:.2}",
                d.as_secs_f64()
            )),
            thf(b.relay_rate),
            b.stall.as_millis(),
            th(b.counted.0),
            th(b.counted.1),
            b.counted.2,
            b.timeouts,
        );
    }
    for b in bursts {
        println!("\nTimeline: {}\n", b.name);
        println!(
            "| t s (from the first statement) | lag_bytes MiB | lag_seconds | rows published |"
        );
        println!("|---:|---:|---:|---:|");
        for smp in &b.timeline {
            println!(
                "| {:.1} | {} | {:.2} | {} |",
                smp.at.as_secs_f64(),
                smp.lag_bytes.map_or("–".into(), mib),
                smp.lag_seconds,
                th(smp.rows)
            );
        }
    }
}

// ------------------------------------------------------------ main

fn main() {
    let a = args();
    let relays = a.relay_runtime.then(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("relay-rt")
            .enable_all()
            .build()
            .expect("the relays' runtime")
    });
    let _ = RELAY_RUNTIME.set(relays);
    common::main(move |_full, workers| async move {
        let started = Instant::now();
        let s = Sizes::new(a.size, a.clients);
        let commit = commit();
        if s.size == Size::Smoke {
            println!(
                "(smoke run with tiny sizes: checks the code paths; the numbers mean nothing)"
            );
        }
        let pg = tokio::task::spawn_blocking(PostgresServer::start)
            .await
            .expect("postgres");
        let url = pg.url();
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&url)
            .await
            .expect("connect");
        let version: String = sqlx::query_scalar("SHOW server_version")
            .fetch_one(&pool)
            .await
            .expect("version");
        let mut settings = String::new();
        for name in [
            "wal_level",
            "fsync",
            "synchronous_commit",
            "shared_buffers",
            "max_wal_size",
            "logical_decoding_work_mem",
        ] {
            let v: String = sqlx::query_scalar(&format!("SHOW {name}"))
                .fetch_one(&pool)
                .await
                .expect("setting");
            let _ = write!(settings, " {name}={v}");
        }
        println!(
            "\n# CDC relay bench\n\ncommit {commit}; {}; {workers} tokio worker threads, {} cores; load average at start {}\n\
             PostgreSQL {version} of the bench's own on 127.0.0.1:{} ({}); {NODES} nodes on one `EmbeddedTransport`; \
             the relays (CDC, outbox) run {}",
            sh("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]).unwrap_or_default(),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            loadavg(),
            pg.port(),
            settings.trim(),
            if a.relay_runtime {
                "on a tokio runtime of their own (one worker thread, `--relay-runtime`)"
            } else {
                "on the same tokio runtime as the nodes"
            }
        );
        let transport = EmbeddedTransport::new();
        let nodes = Nodes::start(&transport, &s).await;

        if a.latency {
            part_header("1. Commit → applied latency", &a, &commit);
            let paths = latency(&url, &pool, &transport, &nodes, &s).await;
            print_latency(&paths, &s);
        }
        if a.throughput {
            part_header(
                "2. Relay throughput against the database's update rate",
                &a,
                &commit,
            );
            let t = throughput(&pg, &url, &pool, &transport, &nodes, &s, a.in_process).await;
            print_throughput(&t, &s);
        }
        if a.lag {
            part_header("3. Slot lag while a burst drains", &a, &commit);
            let bursts = lag(&pg, &url, &pool, &transport, &nodes, &s).await;
            print_lag(&bursts);
        }

        let problems = nodes.shutdown().await;
        println!(
            "\nnode problems (losses, gaps, rejected events, quarantines, resyncs): {}",
            if problems.is_empty() {
                "none"
            } else {
                &problems
            }
        );
        pool.close().await;
        drop(pg);
        common::run_footer(started);
        assert!(problems.is_empty(), "nodes counted problems: {problems}");
    });
}
