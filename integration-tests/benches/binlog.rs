//! The binlog relay (feature `mysql-cdc`) against a MariaDB of its own
//! (`MariaDbServer`: a ROW binlog with full metadata, on a free loopback
//! port): how fast it reads a backlog, next to a raw reader of the same
//! binlog in the same run.
//!
//! ```text
//! cargo bench -p integration-tests --bench binlog
//! cargo bench -p integration-tests --bench binlog -- --quick   # small sizes
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny
//! smoke pass. Everything talks to 127.0.0.1 only.
//!
//! Method: a relay is started and stopped, so its position is saved at
//! the binlog's end. Then the backlog is written while no relay runs:
//! (a) single-row autocommit updates from 8 connections on random ids of a
//! 100,000-row table; (b) 10,000-row transactions (each an `UPDATE` of a
//! range of ids). For each backlog, in the same run:
//! - raw: `mysql_async`'s binlog stream from the saved position, decoding
//!   every rows event of the table into rows (the work any reader must do)
//!   and dropping them, until it reaches the binlog's end;
//! - relay: a `BinlogRelay` started from the saved position, publishing to
//!   an embedded transport with one node caching the table, timed until
//!   its stats count every row (10,000-row transactions are past the
//!   default cap of 10,000 changes per cache only by the cap's rule, so
//!   the cap is raised to 20,000 to publish their rows, not clears).
//!
//! The relay's position is reset to the backlog's start before each run.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use cache_sync::cdc::{BinlogRelay, CdcTable};
use cache_sync::transport::EmbeddedTransport;
use cache_sync::{Node, Publisher, SyncedCache, Table};
use futures_util::StreamExt as _;
use integration_tests::mariadb_server::MariaDbServer;
use mysql_async::binlog::events::EventData;
use mysql_async::prelude::Queryable as _;

const ITEMS: Table<i64, String> = Table::new("items");

struct Sizes {
    rows: i64,
    single: usize,
    big: usize,
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench");
    let quick = args.iter().any(|a| a == "--quick");
    let sizes = match (bench, quick) {
        (true, false) => Sizes {
            rows: 100_000,
            single: 40_000,
            big: 30,
        },
        (true, true) => Sizes {
            rows: 20_000,
            single: 4_000,
            big: 4,
        },
        (false, _) => Sizes {
            rows: 2_000,
            single: 200,
            big: 1,
        },
    };
    let db = tokio::task::spawn_blocking(MariaDbServer::start)
        .await
        .unwrap();
    db.sql(&format!(
        "CREATE DATABASE app;
         CREATE TABLE app.items (id BIGINT PRIMARY KEY, name VARCHAR(100) NOT NULL) ENGINE=InnoDB;
         SET SESSION max_recursive_iterations = 100000000;
         INSERT INTO app.items WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < {m}) SELECT i, CONCAT('a', i) FROM s",
        m = sizes.rows - 1
    ))
    .unwrap();
    let url = format!("{}app", db.url());
    let pool = mysql_async::Pool::new(url.as_str());

    // Saved at the binlog's end: the backlogs start there.
    let transport = EmbeddedTransport::new();
    let relay = start(&url, &transport).await;
    wait(|| relay.stats().active).await;
    relay.shutdown().await;
    let saved: (String, u64) = pool
        .get_conn()
        .await
        .unwrap()
        .query_first("SELECT file, pos FROM cache_sync_binlog_relays")
        .await
        .unwrap()
        .unwrap();

    println!(
        "binlog relay bench: MariaDB {}, {} rows",
        db.sql("SELECT VERSION()").unwrap().trim(),
        sizes.rows
    );
    // (a) single-row transactions from 8 connections.
    let started = Instant::now();
    let mut writers = Vec::new();
    for w in 0..8usize {
        let pool = pool.clone();
        let (n, rows) = (sizes.single / 8, sizes.rows);
        writers.push(tokio::spawn(async move {
            let mut conn = pool.get_conn().await.unwrap();
            let mut x = (w as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for i in 0..n {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                #[allow(clippy::cast_possible_wrap)]
                let id = (x % rows as u64) as i64;
                conn.exec_drop(
                    "UPDATE items SET name = ? WHERE id = ?",
                    (format!("w{w}i{i}"), id),
                )
                .await
                .unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let wrote = started.elapsed();
    println!(
        "(a) {} single-row transactions written by 8 connections in {:.2} s ({:.0}/s)",
        sizes.single,
        wrote.as_secs_f64(),
        sizes.single as f64 / wrote.as_secs_f64()
    );
    let end_a = end(&pool).await;
    compare(&url, &pool, &saved, &end_a, "(a) single-row").await;

    // (b) 10,000-row transactions.
    let mut conn = pool.get_conn().await.unwrap();
    for t in 0..sizes.big {
        let from = (t as i64 * 10_000) % sizes.rows;
        conn.query_drop(format!(
            "UPDATE items SET name = CONCAT('big{t}-', id) WHERE id >= {from} AND id < {}",
            from + 10_000
        ))
        .await
        .unwrap();
    }
    drop(conn);
    let end_b = end(&pool).await;
    compare(&url, &pool, &end_a, &end_b, "(b) 10,000-row").await;
    pool.disconnect().await.unwrap();
}

async fn start(url: &str, transport: &EmbeddedTransport) -> BinlogRelay {
    BinlogRelay::builder(url, Publisher::new(transport.clone()))
        .max_rows_per_transaction(20_000)
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap()
}

async fn wait(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !f() {
        assert!(Instant::now() < deadline, "timed out");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn end(pool: &mysql_async::Pool) -> (String, u64) {
    let logs: Vec<(String, u64)> = pool
        .get_conn()
        .await
        .unwrap()
        .query("SHOW BINARY LOGS")
        .await
        .unwrap();
    logs.last().cloned().unwrap()
}

/// Times a raw reader and the relay over the binlog from `from` to `to`.
async fn compare(
    url: &str,
    pool: &mysql_async::Pool,
    from: &(String, u64),
    to: &(String, u64),
    what: &str,
) {
    // Raw: every rows event of the table decoded into rows, dropped.
    let started = Instant::now();
    let conn = mysql_async::Conn::new(mysql_async::Opts::from_url(url).unwrap())
        .await
        .unwrap();
    let mut stream = conn
        .get_binlog_stream(
            mysql_async::BinlogStreamRequest::new(4_000_000_000)
                .with_filename(from.0.as_bytes())
                .with_pos(from.1),
        )
        .await
        .unwrap();
    let mut rows = 0u64;
    let mut file = from.0.clone();
    loop {
        let event = stream.next().await.unwrap().unwrap();
        let pos = u64::from(event.header().log_pos());
        if let Ok(Some(EventData::RowsEvent(data))) = event.read_data() {
            let tme = stream.get_tme(data.table_id()).unwrap();
            if tme.table_name() != "items" {
                continue;
            }
            for row in data.rows(tme) {
                let _ = std::hint::black_box(row.unwrap());
                rows += 1;
            }
        }
        if let Ok(Some(EventData::RotateEvent(r))) = event.read_data()
            && pos != 0
        {
            file = r.name().into_owned();
        }
        if file == to.0 && pos >= to.1 {
            break;
        }
    }
    let raw = started.elapsed();
    drop(stream);

    // The relay, from the same position.
    pool.get_conn()
        .await
        .unwrap()
        .exec_drop(
            "UPDATE cache_sync_binlog_relays SET file = ?, pos = ?",
            (from.0.as_str(), from.1),
        )
        .await
        .unwrap();
    let transport = EmbeddedTransport::new();
    let cache = SyncedCache::new(ITEMS, moka::future::Cache::new(1_000_000));
    let node = Node::builder("n", transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    let started = Instant::now();
    let relay = start(url, &transport).await;
    // Not a separate measure, only what part of the relay's time its start
    // (connections, lock, settings check) is: `active` is set once it holds
    // the lock and has found its position, before it opens its binlog
    // connection.
    wait(|| relay.stats().active).await;
    let streaming = started.elapsed();
    wait(|| relay.stats().rows >= rows).await;
    let took = started.elapsed();
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    let rate = |d: Duration| rows as f64 / d.as_secs_f64();
    println!(
        "{what}: {rows} rows; raw reader {:.2} s ({:.0} rows/s), relay {:.2} s ({:.0} rows/s; active after {:.3} s): relay/raw {:.2}x",
        raw.as_secs_f64(),
        rate(raw),
        took.as_secs_f64(),
        rate(took),
        streaming.as_secs_f64(),
        rate(took) / rate(raw)
    );
}
