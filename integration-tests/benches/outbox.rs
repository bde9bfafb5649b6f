//! The PostgreSQL outbox (issue 12), on Redis Streams, in one run:
//! - commit-to-applied latency through the outbox and its relay, next to a
//!   plain publish right after the commit;
//! - how many events per second the relay moves from the outbox to every
//!   node, next to how many of the same rows the database takes per second
//!   (with their outbox rows, and without).
//!
//! ```text
//! cargo bench -p integration-tests --bench outbox
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny
//! smoke pass. It starts its own `redis-server` (persistence off: the usual
//! set-up for cache invalidation) on a free loopback port, and uses the
//! PostgreSQL server at `CACHE_SYNC_TEST_DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/cache_sync_test`), in a schema of its
//! own that it drops at the end.
//!
//! Method:
//! - 4 nodes, each with its own Redis client, on one tokio runtime with a
//!   worker per core; the relay and the plain publisher have clients of
//!   their own.
//! - A sample starts when `commit` returns to the writer and ends when an
//!   observer thread, polling every node's `events_applied` every 100 µs,
//!   sees every node past it. Outbox and plain samples alternate, one event
//!   at a time, so they share the same moments of a noisy machine. A
//!   transaction is `UPDATE` of one row (plus the outbox's enqueue, or not).
//! - Throughput: with the relay stopped, one writer commits `M` such
//!   transactions (the database's rate with the outbox); then the relay is
//!   started and timed until the outbox is empty and every node has applied
//!   all `M` (the relay's rate, end to end). The same `M` updates without
//!   the outbox give the database's own rate.

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
    Publisher, SyncedCache, Table,
    outbox::{Outbox, OutboxRelay},
    transport::RedisStreamsTransport,
};
use common::{BenchNode, CACHE, p, ratio, run_footer, run_header, start_nodes, stop_nodes};
use hdrhistogram::Histogram;
use integration_tests::redis_server::RedisServer;
use sqlx::PgPool;

const NODES: usize = 4;
const TABLE: Table<u64, u64> = Table::new(CACHE);
const KEYS: u64 = 100;

fn database_url() -> String {
    std::env::var("CACHE_SYNC_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/cache_sync_test".into())
}

/// The total of every node's applied events: a sample ends when it passes
/// `target` on every node.
fn wait_applied(caches: &[SyncedCache<u64, u64>], each: u64) -> Instant {
    let deadline = Instant::now() + common::STALL;
    loop {
        if caches.iter().all(|c| c.status().events_applied >= each) {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "nodes stalled before {each} events"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

async fn applied_after(caches: &Arc<Vec<SyncedCache<u64, u64>>>, each: u64) -> Instant {
    let caches = caches.clone();
    tokio::task::spawn_blocking(move || wait_applied(&caches, each))
        .await
        .expect("observer")
}

async fn update(conn: &mut sqlx::PgConnection, schema: &str, k: u64, v: u64) {
    sqlx::query(&format!("UPDATE {schema}.rows SET v = $2 WHERE k = $1"))
        .bind(i64::try_from(k).expect("small"))
        .bind(i64::try_from(v).expect("small"))
        .execute(conn)
        .await
        .expect("update");
}

fn main() {
    common::main(|full, workers| async move {
        let started = Instant::now();
        run_header(full, workers);
        let (samples, m) = if full { (400, 5_000) } else { (5, 50) };

        let redis = RedisServer::start_with(&["--appendonly", "no", "--save", ""]);
        let url = redis.url();
        let connect = || {
            let url = url.clone();
            async move {
                let t: Arc<dyn Transport> = Arc::new(
                    RedisStreamsTransport::connect(&url)
                        .await
                        .expect("redis streams"),
                );
                t
            }
        };
        let pool = PgPool::connect(&database_url())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is needed: {e}", database_url()));
        let schema = format!("bench_outbox_{}", std::process::id());
        let outbox = Outbox::builder().schema(&schema).build().expect("schema");
        outbox.migrate(&pool).await.expect("migrate");
        sqlx::raw_sql(&format!(
            "CREATE TABLE {schema}.rows (k bigint PRIMARY KEY, v bigint NOT NULL);
             INSERT INTO {schema}.rows SELECT k, 0 FROM generate_series(0, 2 * {KEYS}) k;"
        ))
        .execute(&pool)
        .await
        .expect("rows table");

        let topic = "bench-outbox";
        let nodes: Vec<BenchNode> = start_nodes(topic, NODES, &connect).await;
        let caches = Arc::new(nodes.iter().map(|n| n.cache.clone()).collect::<Vec<_>>());
        let relay_publisher = || async {
            Publisher::builder(connect().await)
                .topic(topic)
                .origin("relay")
                .build()
                .expect("publisher")
        };
        let relay = OutboxRelay::builder(pool.clone(), relay_publisher().await)
            .outbox(outbox.clone())
            .start()
            .await
            .expect("relay");
        let plain = Publisher::builder(connect().await)
            .topic(topic)
            .origin("plain")
            .build()
            .expect("publisher")
            .dictionary(TABLE);
        let dict = outbox.dictionary(TABLE);

        // ---------------------------------------------------- latency
        let mut via_outbox = Histogram::<u64>::new(3).expect("histogram");
        let mut via_plain = Histogram::<u64>::new(3).expect("histogram");
        let mut sent = 0u64;
        let warmup = 10;
        for i in 0..(warmup + samples) {
            let k = i % KEYS;
            // Through the outbox: row and event in one transaction.
            let mut tx = pool.begin().await.expect("begin");
            update(&mut tx, &schema, k, i).await;
            dict.insert(&mut tx, &k, &i).await.expect("enqueue");
            tx.commit().await.expect("commit");
            let committed = Instant::now();
            sent += 1;
            let done = applied_after(&caches, sent).await;
            if i >= warmup {
                via_outbox
                    .record(done.duration_since(committed).as_micros() as u64)
                    .expect("in range");
            }
            // Plain: the row, then a publish after the commit. Keys of its
            // own: each key's versions come from one clock.
            let k = k + KEYS;
            let mut tx = pool.begin().await.expect("begin");
            update(&mut tx, &schema, k, i).await;
            tx.commit().await.expect("commit");
            let committed = Instant::now();
            plain.insert(&k, &i).await.expect("publish");
            sent += 1;
            let done = applied_after(&caches, sent).await;
            if i >= warmup {
                via_plain
                    .record(done.duration_since(committed).as_micros() as u64)
                    .expect("in range");
            }
        }
        println!(
            "\n### Commit to applied on {NODES} nodes, Redis Streams (µs; {samples} events each, interleaved)\n"
        );
        println!("| path | p50 | p99 | max |");
        println!("|---|---:|---:|---:|");
        for (name, h) in [
            ("outbox + relay", &via_outbox),
            ("publish after commit", &via_plain),
        ] {
            println!("| {name} | {} | {} | {} |", p(h, 0.5), p(h, 0.99), h.max());
        }
        println!(
            "\noutbox / plain: p50 {:.2}×, p99 {:.2}×",
            ratio(p(&via_outbox, 0.5), p(&via_plain, 0.5)),
            ratio(p(&via_outbox, 0.99), p(&via_plain, 0.99))
        );

        // ---------------------------------------------------- throughput
        relay.shutdown().await;
        let mut conn = pool.acquire().await.expect("connection");
        // The plain updates run before and after the outbox's, so a drift
        // in the database's speed over the run shows.
        let mut bare = Vec::new();
        let mut with_outbox = 0.0;
        for round in 0..3 {
            let t = Instant::now();
            for i in 0..m {
                let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
                update(&mut tx, &schema, i % KEYS, i).await;
                if round == 1 {
                    dict.insert(&mut tx, &(i % KEYS), &i)
                        .await
                        .expect("enqueue");
                }
                tx.commit().await.expect("commit");
            }
            let rate = m as f64 / t.elapsed().as_secs_f64();
            match round {
                1 => with_outbox = rate,
                _ => bare.push(rate),
            }
        }
        drop(conn);
        let t = Instant::now();
        let relay = OutboxRelay::builder(pool.clone(), relay_publisher().await)
            .outbox(outbox.clone())
            .start()
            .await
            .expect("relay");
        applied_after(&caches, sent + m).await;
        let relayed = m as f64 / t.elapsed().as_secs_f64();
        // The relay deletes a batch's rows after publishing all of them, so
        // the nodes can be done first.
        let deadline = Instant::now() + common::STALL;
        loop {
            let left: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.outbox"))
                .fetch_one(&pool)
                .await
                .expect("count");
            if left == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the relay left {left} rows behind"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        relay.shutdown().await;
        println!("\n### Throughput, {m} single-row transactions, one writer (events/s)\n");
        println!("| | events/s |");
        println!("|---|---:|");
        println!(
            "| database: `UPDATE` alone (before, after) | {:.0}, {:.0} |",
            bare[0], bare[1]
        );
        println!("| database: `UPDATE` + outbox enqueue | {with_outbox:.0} |");
        println!("| relay: outbox → applied on {NODES} nodes | {relayed:.0} |");
        println!(
            "\nrelay / database with outbox: {:.2}×",
            relayed / with_outbox
        );

        let problems = stop_nodes(nodes).await;
        assert!(problems.is_empty(), "nodes counted problems: {problems}");
        sqlx::raw_sql(&format!("DROP SCHEMA {schema} CASCADE"))
            .execute(&pool)
            .await
            .expect("drop schema");
        run_footer(started);
    });
}
