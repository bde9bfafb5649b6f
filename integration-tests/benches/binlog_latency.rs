//! Commit → applied on 4 nodes through the binlog relay (feature
//! `mysql-cdc`, issue 39), against a plain publish after the commit, in one
//! run against a MariaDB of its own (`MariaDbServer`: a ROW binlog with full
//! metadata, on a free loopback port).
//!
//! ```text
//! cargo bench -p integration-tests --bench binlog_latency -- --bench
//! cargo bench -p integration-tests --bench binlog_latency -- --bench --quick   # 300 samples a path
//! cargo bench -p integration-tests --bench binlog_latency -- --bench --no-fsync  # innodb_flush_log_at_trx_commit = 2
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny
//! smoke pass. Everything talks to 127.0.0.1 only.
//!
//! Method:
//! - One `EmbeddedTransport`, 4 nodes on it, each a `Node` with two
//!   `SyncedCache`s, one per path, on one tokio runtime with a worker per
//!   core; the server, the relay, the writer and the nodes share the
//!   machine's cores. Both paths publish through the same transport to the
//!   same nodes: only the path differs. Each path has a cache of its own (the
//!   relay's versions are binlog positions, the plain path's a counter: one
//!   cache never mixes two clocks).
//! - Relay: an autocommit single-row `UPDATE lat_relay SET name = ? WHERE
//!   id = ?` on one `mysql_async` connection; a `BinlogRelay` maps
//!   `lat_relay` to its cache and publishes the row.
//! - Plain: the same autocommit `UPDATE` of a twin table, `lat_plain`, that
//!   the relay does not map (its row events still pass through the relay's
//!   stream, and are skipped there), then, once the commit returned,
//!   `Publisher::insert_versioned` of the new value on a publisher of its own.
//! - A sample runs from just before the `UPDATE` is sent (autocommit: the
//!   statement is the commit) until an observer thread sees every node's
//!   cache of the path count one more applied event, and every node then
//!   holds the new value (checked with `peek`; a sample whose value was not
//!   there yet is counted as "value late" and ends when it is). The
//!   observer starts before the statement is sent, so an event applied
//!   before the commit returns to the writer is timed as such. It polls
//!   `status().events_applied` of the 4 caches with a 100 µs sleep between
//!   polls (cache-sync offers no change listener); its measured mean poll
//!   period is printed: that is the resolution. Also recorded: the same
//!   sample from the commit's return, and the `UPDATE`'s own round trip.
//! - The paths take turns, one update at a time, alternating which goes
//!   first, so they share the same moments of a noisy machine. The rows
//!   updated cycle through 100 ids of each table. The first updates of each
//!   path are warm-up, not recorded.
//! - `--no-fsync` sets the server's `innodb_flush_log_at_trx_commit` to 2
//!   (the redo log written at each commit, flushed to disk once a second):
//!   the same run without a disk flush in each commit, the writer's or the
//!   relay's own position write.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

// Shared with the propagation benches; this one uses the runtime and
// report helpers only.
#[allow(dead_code)]
mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cache_sync::cdc::{BinlogRelay, CdcTable};
use cache_sync::transport::EmbeddedTransport;
use cache_sync::{Node, Publisher, SyncedCache, Table};
use common::{STALL, loadavg, p, ratio};
use hdrhistogram::Histogram;
use integration_tests::mariadb_server::MariaDbServer;
use mysql_async::prelude::Queryable as _;

const NODES: usize = 4;
const LAT_RELAY: Table<i64, String> = Table::new("lat_relay");
const LAT_PLAIN: Table<i64, String> = Table::new("lat_plain");
/// Rows of each table, updated in turn.
const KEYS: i64 = 100;
/// The observer's sleep between two polls of the nodes.
const POLL: Duration = Duration::from_micros(100);

type Cache = SyncedCache<i64, String>;

struct Sizes {
    warmup: u64,
    samples: u64,
}

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

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds")
}

/// Polls every `POLL` until every cache has applied more events than
/// `before`; returns when it saw that, and how many polls it took.
fn wait_applied(caches: &[Cache], before: &[u64]) -> (Instant, u64) {
    let deadline = Instant::now() + STALL;
    let mut polls = 0u64;
    loop {
        polls += 1;
        if caches
            .iter()
            .zip(before)
            .all(|(c, b)| c.status().events_applied > *b)
        {
            return (Instant::now(), polls);
        }
        assert!(Instant::now() < deadline, "nodes stalled");
        std::thread::sleep(POLL);
    }
}

struct Path {
    name: &'static str,
    /// From just before the `UPDATE` is sent.
    from_send: Histogram<u64>,
    /// From the `UPDATE`'s return (the commit acknowledged).
    from_commit: Histogram<u64>,
    /// The `UPDATE`'s round trip.
    update: Histogram<u64>,
    late: u64,
}

/// The one connection that writes, the plain path's publisher, both
/// paths' caches and the observer's counters.
struct Writer {
    conn: mysql_async::Conn,
    plain: Publisher,
    /// The relay path's caches, then the plain path's, one per node.
    caches: [Arc<Vec<Cache>>; 2],
    /// The observer's polls, and the time it spent polling.
    polls: u64,
    polling: Duration,
}

/// One sample.
struct Sample {
    sent: Instant,
    committed: Instant,
    applied: Instant,
    /// The event count moved before every node held the value.
    late: bool,
}

impl Writer {
    /// One update of `key` to `value` through `path` (0: the relay, 1: the
    /// plain publish, at `version`).
    async fn sample(&mut self, path: usize, key: i64, value: &str, version: u64) -> Sample {
        let caches = self.caches[path].clone();
        let before: Vec<u64> = caches.iter().map(|c| c.status().events_applied).collect();
        let c = caches.clone();
        let watch_from = Instant::now();
        let watching = tokio::task::spawn_blocking(move || wait_applied(&c, &before));
        let table = ["lat_relay", "lat_plain"][path];
        let sent = Instant::now();
        self.conn
            .exec_drop(
                format!("UPDATE {table} SET name = ? WHERE id = ?"),
                (value, key),
            )
            .await
            .unwrap();
        let committed = Instant::now();
        if path == 1 {
            self.plain
                .insert_versioned(LAT_PLAIN.name(), [(key, value, Some(version))])
                .await
                .unwrap();
        }
        let (mut applied, polls) = watching.await.unwrap();
        self.polls += polls;
        self.polling += applied.duration_since(watch_from);
        let deadline = Instant::now() + STALL;
        let mut late = false;
        'check: loop {
            for c in caches.iter() {
                if c.peek(&key).await.as_deref() != Some(value) {
                    late = true;
                    assert!(Instant::now() < deadline, "{key} = {value} never arrived");
                    tokio::time::sleep(POLL).await;
                    applied = Instant::now();
                    continue 'check;
                }
            }
            return Sample {
                sent,
                committed,
                applied,
                late,
            };
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let no_fsync = args.iter().any(|a| a == "--no-fsync");
    common::main(move |full, workers| async move {
        let started = Instant::now();
        let s = match (full, quick) {
            (true, false) => Sizes {
                warmup: 100,
                samples: 2_000,
            },
            (true, true) => Sizes {
                warmup: 20,
                samples: 300,
            },
            (false, _) => Sizes {
                warmup: 2,
                samples: 10,
            },
        };
        if !full {
            println!(
                "(smoke run with tiny sizes: checks the code paths; the numbers mean nothing)"
            );
        }
        let commit = commit();
        let db = tokio::task::spawn_blocking(MariaDbServer::start)
            .await
            .unwrap();
        db.sql(&format!(
            "CREATE DATABASE app;
             CREATE TABLE app.lat_relay (id BIGINT PRIMARY KEY, name VARCHAR(100) NOT NULL) ENGINE=InnoDB;
             CREATE TABLE app.lat_plain (id BIGINT PRIMARY KEY, name VARCHAR(100) NOT NULL) ENGINE=InnoDB;
             INSERT INTO app.lat_relay WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < {m}) SELECT i, CONCAT('r', i) FROM s;
             INSERT INTO app.lat_plain SELECT * FROM app.lat_relay",
            m = KEYS - 1
        ))
        .unwrap();
        if no_fsync {
            db.sql("SET GLOBAL innodb_flush_log_at_trx_commit = 2")
                .unwrap();
        }
        let version = db.sql("SELECT VERSION()").unwrap();
        let settings = db
            .sql(
                "SELECT GROUP_CONCAT(CONCAT(LOWER(VARIABLE_NAME), '=', VARIABLE_VALUE) ORDER BY VARIABLE_NAME SEPARATOR ' ') \
                 FROM information_schema.GLOBAL_VARIABLES WHERE VARIABLE_NAME IN \
                 ('INNODB_FLUSH_LOG_AT_TRX_COMMIT', 'SYNC_BINLOG', 'BINLOG_COMMIT_WAIT_COUNT', 'BINLOG_FORMAT')",
            )
            .unwrap();
        let url = format!("{}app", db.url());
        println!(
            "\n# Binlog relay latency bench\n\ncommit {commit}; {}; {workers} tokio worker threads, {} cores; load average at start {}\n\
             MariaDB {} of the bench's own on 127.0.0.1:{} ({}); {NODES} nodes on one `EmbeddedTransport`; \
             the relay on the same tokio runtime as the nodes",
            sh("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]).unwrap_or_default(),
            std::thread::available_parallelism().map_or(0, |n| n.get()),
            loadavg(),
            version.trim(),
            db.port(),
            settings.trim(),
        );

        let transport = EmbeddedTransport::new();
        let mut nodes = Vec::new();
        let mut relay_caches = Vec::new();
        let mut plain_caches = Vec::new();
        for k in 0..NODES {
            let r = SyncedCache::new(LAT_RELAY, moka::future::Cache::new(10_000));
            let p = SyncedCache::new(LAT_PLAIN, moka::future::Cache::new(10_000));
            nodes.push(
                Node::builder(format!("node-{k}"), transport.clone())
                    .register(&r)
                    .register(&p)
                    .start()
                    .await
                    .unwrap(),
            );
            relay_caches.push(r);
            plain_caches.push(p);
        }
        let publisher = |origin: &str| {
            Publisher::builder(transport.clone())
                .origin(origin)
                .build()
                .unwrap()
        };
        let relay = BinlogRelay::builder(url.as_str(), publisher("binlog-relay"))
            .table(
                CdcTable::new(LAT_RELAY, "lat_relay", |row| row.parse("id"))
                    .value(|row| row.parse("name")),
            )
            .start()
            .await
            .unwrap();
        let deadline = Instant::now() + STALL;
        while !relay.stats().active {
            assert!(Instant::now() < deadline, "the relay did not start");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let stats0 = relay.stats();

        let mut paths = ["binlog relay", "publish after commit"].map(|name| Path {
            name,
            from_send: histogram(),
            from_commit: histogram(),
            update: histogram(),
            late: 0,
        });
        let conn = mysql_async::Conn::new(mysql_async::Opts::from_url(&url).unwrap())
            .await
            .unwrap();
        let mut w = Writer {
            conn,
            plain: publisher("plain"),
            caches: [Arc::new(relay_caches), Arc::new(plain_caches)],
            polls: 0,
            polling: Duration::ZERO,
        };
        let events = s.warmup + s.samples;
        for i in 0..events {
            for j in 0..2 {
                let path = (i as usize + j) % 2;
                #[allow(clippy::cast_possible_wrap)]
                let key = (i % KEYS as u64) as i64;
                let value = format!("v{i}");
                let smp = w.sample(path, key, &value, i + 1).await;
                let p = &mut paths[path];
                if i >= s.warmup {
                    let us = |d: Duration| d.as_micros() as u64;
                    p.from_send
                        .saturating_record(us(smp.applied.duration_since(smp.sent)));
                    p.from_commit.saturating_record(us(smp
                        .applied
                        .saturating_duration_since(smp.committed)));
                    p.update
                        .saturating_record(us(smp.committed.duration_since(smp.sent)));
                    p.late += u64::from(smp.late);
                }
            }
        }
        let (polls, polling) = (w.polls, w.polling);
        drop(w);
        let stats = relay.stats();
        let (rows, transactions) = (
            stats.rows - stats0.rows,
            stats.transactions - stats0.transactions,
        );
        // Its transactions count every transaction it read to the end
        // (the plain path's and its own position writes too), its rows only
        // the mapped table's.
        assert_eq!(
            rows, events,
            "the relay published other than one row per update: {stats:?}"
        );
        relay.shutdown().await;

        println!(
            "\nCommit → applied on all {NODES} nodes, µs; {} sequential single-row autocommit updates per path \
             after {} of warm-up, the two paths taking turns; both publish on the same in-process \
             transport to the same nodes. Observer: polls every {} µs asked, {:.0} µs measured on average \
             ({} polls in {:.2} s).\n",
            s.samples,
            s.warmup,
            POLL.as_micros(),
            polling.as_secs_f64() * 1e6 / polls.max(1) as f64,
            polls,
            polling.as_secs_f64(),
        );
        println!("| path, from | p50 | p90 | p99 | max | mean | samples | value late |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        for path in &paths {
            for (from, h) in [
                ("before the `UPDATE` is sent", &path.from_send),
                ("the commit's return", &path.from_commit),
            ] {
                println!(
                    "| {}, {from} | {} | {} | {} | {} | {:.0} | {} | {} |",
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
        }
        for path in &paths {
            let h = &path.update;
            println!(
                "| ({}: the `UPDATE`'s round trip) | {} | {} | {} | {} | {:.0} | {} | |",
                path.name,
                p(h, 0.5),
                p(h, 0.9),
                p(h, 0.99),
                h.max(),
                h.mean(),
                h.len(),
            );
        }
        println!();
        let (relay_h, plain_h) = (&paths[0], &paths[1]);
        for (from, a, b) in [
            ("before the send", &relay_h.from_send, &plain_h.from_send),
            (
                "the commit's return",
                &relay_h.from_commit,
                &plain_h.from_commit,
            ),
        ] {
            println!(
                "relay / plain publish, from {from}: p50 {:.2}×, p99 {:.2}×",
                ratio(p(a, 0.5), p(b, 0.5)),
                ratio(p(a, 0.99), p(b, 0.99))
            );
        }
        println!(
            "\nrelay: {rows} rows published, {transactions} transactions read; {} failed sessions",
            stats.failures - stats0.failures
        );

        let mut problems = Vec::new();
        for n in nodes {
            n.shutdown().await.unwrap();
            let st = n.status();
            for (what, count) in [
                ("losses", st.losses),
                ("gaps", st.publisher_gaps),
                ("rejected", st.events_rejected),
                ("transport errors", st.transport_errors),
            ] {
                if count > 0 {
                    problems.push(format!("{}: {count} {what}", st.node_id));
                }
            }
        }
        let problems = problems.join("; ");
        println!(
            "node problems (losses, gaps, rejected events, transport errors): {}",
            if problems.is_empty() {
                "none"
            } else {
                &problems
            }
        );
        drop(db);
        common::run_footer(started);
        assert!(problems.is_empty(), "nodes counted problems: {problems}");
    });
}
