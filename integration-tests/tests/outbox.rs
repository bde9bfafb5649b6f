//! The transactional outbox against a real PostgreSQL: what commits is
//! published, in commit order per cache, exactly once while nothing fails
//! and at least once when a relay, the broker or the database does.
//!
//! Every test works in a schema of its own in the database
//! `cache_sync_test` (`CACHE_SYNC_TEST_DATABASE_URL`, default
//! `postgres://postgres@127.0.0.1:5432/cache_sync_test`; `scripts/test`
//! creates it), so tests run in parallel, and drops it at the end. A
//! database that cannot be reached fails the test.
//!
//! Events are recognised by a marker, `~NNNNNNN~`, in the key or value each
//! enqueue carries: one marker per event, read straight out of the payload.
#![cfg(feature = "postgres-outbox")]
// Test code throughout, helpers included: a failed step fails the test
// with its error.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use cache_sync::transport::FaultyTransport;
use cache_sync::{
    Error, Node, Publisher, SyncedCache, Table,
    outbox::{Outbox, OutboxRelay, OutboxRelayStats},
    transport::EmbeddedTransport,
};
use futures_util::future::BoxFuture;
use integration_tests::eventually;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/cache_sync_test";

fn database_url() -> String {
    std::env::var("CACHE_SYNC_TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned())
}

async fn pool() -> PgPool {
    let url = database_url();
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach PostgreSQL at {url}: {e}. The outbox tests need it: run \
                 ./scripts/test (it creates the database cache_sync_test), or point \
                 CACHE_SYNC_TEST_DATABASE_URL at a database of your own"
            )
        })
}

/// A schema of the test's own, migrated, and an outbox on it.
struct TestDb {
    pool: PgPool,
    schema: String,
}

impl TestDb {
    async fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let schema = format!(
            "t_{name}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let db = Self {
            pool: pool().await,
            schema,
        };
        db.outbox().migrate(&db.pool).await.expect("migrate");
        db
    }

    fn outbox(&self) -> Outbox {
        self.builder().build().expect("outbox")
    }

    fn builder(&self) -> cache_sync::outbox::OutboxBuilder {
        Outbox::builder().schema(self.schema.clone())
    }

    async fn rows(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {}.outbox", self.schema))
            .fetch_one(&self.pool)
            .await
            .expect("count rows")
    }

    async fn relay(&self, publisher: Publisher) -> OutboxRelay {
        OutboxRelay::builder(self.pool.clone(), publisher)
            .outbox(self.outbox())
            .poll_interval(Duration::from_millis(50))
            .batch_size(16)
            .start()
            .await
            .expect("relay starts")
    }

    async fn drop_schema(self) {
        sqlx::query(&format!("DROP SCHEMA {} CASCADE", self.schema))
            .execute(&self.pool)
            .await
            .expect("drop schema");
    }
}

/// A marker: in a key or value, it names the event.
fn marker(n: u32) -> String {
    format!("~{n:07}~")
}

/// The markers in a payload, in order.
fn markers(payload: &[u8]) -> Vec<u32> {
    payload
        .windows(9)
        .filter(|w| w[0] == b'~' && w[8] == b'~' && w[1..8].iter().all(u8::is_ascii_digit))
        .map(|w| std::str::from_utf8(&w[1..8]).unwrap().parse().unwrap())
        .collect()
}

/// A transport that keeps what reached it, in order, for [`events`] and
/// [`payloads_for`]; its faults make it fail.
fn recorder() -> FaultyTransport {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.record_publishes(true);
    transport
}

/// `(cache, marker)` per event with a marker, in publish order.
fn events(transport: &FaultyTransport) -> Vec<(String, u32)> {
    transport
        .published()
        .into_iter()
        .flat_map(|(tag, p)| markers(&p).into_iter().map(move |m| (tag.clone(), m)))
        .collect()
}

fn payloads_for(transport: &FaultyTransport, cache: &str) -> Vec<Bytes> {
    transport
        .published()
        .into_iter()
        .filter(|(t, _)| t == cache)
        .map(|(_, p)| p)
        .collect()
}

/// Each cache's events must be exactly `want` (the enqueue order), first
/// arrivals counted only, and every event must have arrived.
fn assert_order(events: &[(String, u32)], want: &BTreeMap<String, Vec<u32>>) {
    let mut seen = HashSet::new();
    let mut got: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (cache, m) in events {
        if seen.insert(*m) {
            got.entry(cache.clone()).or_default().push(*m);
        }
    }
    for (cache, want) in want {
        let got = got.get(cache).cloned().unwrap_or_default();
        assert_eq!(got.len(), want.len(), "{cache}: events missing");
        assert_eq!(&got, want, "{cache}: first arrivals out of enqueue order");
    }
}

fn duplicates(events: &[(String, u32)]) -> usize {
    let mut seen = HashSet::new();
    events.iter().filter(|(_, m)| !seen.insert(*m)).count()
}

async fn wait_published(relay: &OutboxRelay, n: u64) -> OutboxRelayStats {
    eventually(&format!("the relay published {n} rows"), async || {
        relay.stats().published >= n
    })
    .await;
    relay.stats()
}

/// Enqueues `n` refreshes round-robin over `caches`, one transaction each,
/// markers from `first`. Returns the enqueue order per cache.
async fn enqueue_many(
    db: &TestDb,
    caches: &[&str],
    first: u32,
    n: u32,
) -> BTreeMap<String, Vec<u32>> {
    let outbox = db.outbox();
    let mut order: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for i in first..first + n {
        let cache = caches[i as usize % caches.len()];
        let mut tx = db.pool.begin().await.unwrap();
        outbox
            .insert_versioned(&mut tx, cache, [(i, marker(i), None)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        order.entry(cache.to_owned()).or_default().push(i);
    }
    order
}

#[path = "outbox/audit.rs"]
mod audit;
#[path = "outbox/failures.rs"]
mod failures;
#[path = "outbox/fencing.rs"]
mod fencing;
#[path = "outbox/freshness.rs"]
mod freshness;
#[path = "outbox/order.rs"]
mod order;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_and_safe_to_run_concurrently() {
    let db = TestDb::new("migrate").await;
    let outbox = db.outbox();
    outbox.migrate(&db.pool).await.expect("second migrate");
    // A fresh schema, migrated by eight tasks at once.
    let fresh = Outbox::builder()
        .schema(format!("{}_b", db.schema))
        .build()
        .unwrap();
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let (o, p) = (fresh.clone(), db.pool.clone());
            tokio::spawn(async move { o.migrate(&p).await })
        })
        .collect();
    for r in runs {
        r.await.unwrap().expect("concurrent migrate");
    }
    let mut tx = db.pool.begin().await.unwrap();
    fresh.invalidate_all(&mut tx, "c").await.unwrap();
    tx.commit().await.unwrap();
    sqlx::query(&format!("DROP SCHEMA {}_b CASCADE", db.schema))
        .execute(&db.pool)
        .await
        .unwrap();
    db.drop_schema().await;
}

#[test]
fn schema_names_are_validated() {
    for bad in ["a;drop", "", &"a".repeat(64), "Upper", "pg_x"] {
        let err = Outbox::builder().schema(bad).build().unwrap_err();
        assert!(err.is_config(), "{bad:?}: {err}");
    }
    assert_eq!(
        Outbox::builder()
            .schema("cache_sync")
            .build()
            .unwrap()
            .schema(),
        "cache_sync"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_a_database_error_not_a_disconnect() {
    let pool = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&format!(
            "postgres://postgres@127.0.0.1:{}/x",
            integration_tests::redis_server::free_port()
        ))
        .unwrap();
    let err = Outbox::new().migrate(&pool).await.unwrap_err();
    assert!(err.is_database() && !err.is_disconnected(), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_publishes_nothing() {
    let db = TestDb::new("rollback").await;
    let outbox = db.outbox();
    let rec = recorder();
    let relay = db.relay(Publisher::new(rec.clone())).await;
    let mut tx = db.pool.begin().await.unwrap();
    outbox.invalidate(&mut tx, "c", [marker(1)]).await.unwrap();
    outbox
        .dictionary::<String, String>("c")
        .insert(&mut tx, "k", &marker(2))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.invalidate(&mut tx, "c", [marker(3)]).await.unwrap();
    tx.commit().await.unwrap();
    wait_published(&relay, 1).await;
    // The relay drains in id order, so a rolled-back row (lower ids) would
    // have come before the committed one.
    assert_eq!(events(&rec), [("c".to_owned(), 3)]);
    assert_eq!(db.rows().await, 0);
    relay.shutdown().await;
    db.drop_schema().await;
}

/// A table pinned to a topic is honoured or refused, never ignored: the
/// outbox's dictionary refuses a write for a table of another topic (and
/// writes nothing), and a relay refuses to start with a publisher on
/// another topic than its outbox's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_topic_is_honoured_or_refused() {
    const ELSEWHERE: Table<String, String> = Table::with_topic("c", "elsewhere");
    const HERE: Table<String, String> = Table::with_topic("c", "catalog");
    let db = TestDb::new("pinned").await;
    let outbox = db.builder().topic("catalog").build().expect("outbox");
    assert_eq!(outbox.topic(), Some("catalog"));
    let mut tx = db.pool.begin().await.expect("begin");
    let err = db
        .outbox()
        .dictionary(HERE)
        .insert(&mut tx, "k", "v")
        .await
        .expect_err("a pinned table on an outbox with no topic is refused");
    assert!(err.is_config(), "{err}");
    tx.rollback().await.expect("rollback");
    let mut tx = db.pool.begin().await.expect("begin");
    let err = outbox
        .dictionary(ELSEWHERE)
        .insert(&mut tx, "k", "v")
        .await
        .expect_err("a table of another topic is refused");
    assert!(err.is_config(), "{err}");
    let err = outbox
        .dictionary(ELSEWHERE)
        .invalidate_all(&mut tx)
        .await
        .expect_err("every write is refused");
    assert!(err.is_config(), "{err}");
    outbox
        .dictionary(HERE)
        .insert(&mut tx, "k", "v")
        .await
        .expect("a table of the outbox's topic is written");
    tx.commit().await.expect("commit");
    assert_eq!(db.rows().await, 1, "only the write for its own topic");

    // The default publisher's topic is "cache-sync", not the outbox's.
    let err = OutboxRelay::builder(db.pool.clone(), Publisher::new(EmbeddedTransport::new()))
        .outbox(outbox.clone())
        .start()
        .await
        .expect_err("a publisher on another topic");
    assert!(err.is_config(), "{err}");
    let rec = recorder();
    let publisher = Publisher::builder(rec.clone())
        .topic("catalog")
        .build()
        .expect("publisher");
    let relay = OutboxRelay::builder(db.pool.clone(), publisher)
        .outbox(outbox)
        .poll_interval(Duration::from_millis(50))
        .start()
        .await
        .expect("a publisher on the outbox's topic");
    wait_published(&relay, 1).await;
    relay.shutdown().await;
    db.drop_schema().await;
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use cache_sync::transport::RedisStreamsTransport;
    use cache_sync::transport::{Delivery, StartFrom, SubscribeOptions, Transport};
    use integration_tests::redis_server::RedisServer;
    use std::process::{Child, Command};

    /// Every event on the stream, from the start, until `n` distinct markers
    /// arrived (or 30 s passed).
    async fn read_stream(url: &str, topic: &str, n: usize) -> Vec<(String, u32)> {
        let t = RedisStreamsTransport::connect(url).await.unwrap();
        let mut sub = t
            .subscribe(topic, SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        let mut events = Vec::new();
        let mut distinct = HashSet::new();
        // The subscription long-polls until records come: a lost event
        // would otherwise keep it waiting for ever.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while distinct.len() < n {
            let Ok(delivery) = tokio::time::timeout_at(deadline, sub.next(1000)).await else {
                break;
            };
            match delivery.unwrap() {
                Delivery::Batch { records, .. } => {
                    for r in records {
                        let tag = r.tag.as_deref().unwrap_or_default().to_owned();
                        for m in markers(&r.payload) {
                            distinct.insert(m);
                            events.push((tag.clone(), m));
                        }
                    }
                }
                Delivery::Lost(l) => panic!("the stream lost events: {l:?}"),
                other => panic!("unexpected delivery {other:?}"),
            }
        }
        events
    }

    /// A relay process, `kill -9`ed on drop so a failing test leaves none.
    struct RelayProcess(Child);

    impl RelayProcess {
        fn kill(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Drop for RelayProcess {
        fn drop(&mut self) {
            self.kill();
        }
    }

    fn relay_process(db: &TestDb, redis: &str) -> RelayProcess {
        RelayProcess(
            Command::new(env!("CARGO_BIN_EXE_outbox_relay"))
                .args([&database_url(), &db.schema, redis, &db.schema])
                .spawn()
                .expect("start the relay binary"),
        )
    }

    /// `kill -9` of a relay process mid-batch: a second relay process
    /// publishes the rest, and nothing is lost (duplicates allowed).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_killed_mid_batch_loses_nothing() {
        let db = TestDb::new("kill").await;
        let server = RedisServer::start();
        let want = enqueue_many(&db, &["a", "b", "c", "d"], 0, 2000).await;
        let mut first = relay_process(&db, &server.url());
        let mut left = 2000;
        let deadline = Instant::now() + Duration::from_secs(60);
        while left > 1500 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
            left = db.rows().await;
        }
        first.kill();
        let at_kill = db.rows().await;
        assert!(
            at_kill > 0 && at_kill < 2000,
            "killed with {at_kill} rows left: not mid-way"
        );
        let mut second = relay_process(&db, &server.url());
        eventually("the second relay drained the outbox", async || {
            db.rows().await == 0
        })
        .await;
        second.kill();
        let events = read_stream(&server.url(), &db.schema, 2000).await;
        assert_order(&events, &want);
        println!(
            "killed with {at_kill} rows left; {} duplicates",
            duplicates(&events)
        );
        db.drop_schema().await;
    }

    /// Redis down for 10 s while writers keep enqueueing: the relay retries
    /// and, once Redis is back (same data: append-only file, fsync always),
    /// every event arrives, in order per cache.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broker_down_for_ten_seconds_loses_nothing() {
        let db = TestDb::new("broker_down").await;
        let mut server = RedisServer::start();
        let transport = RedisStreamsTransport::builder(server.url())
            .response_timeout(Duration::from_secs(1))
            .connect()
            .await
            .unwrap();
        let publisher = Publisher::builder(transport)
            .topic(db.schema.clone())
            .build()
            .unwrap();
        let relay = db.relay(publisher).await;
        let mut want = enqueue_many(&db, &["a", "b", "c"], 0, 100).await;
        wait_published(&relay, 100).await;
        server.kill();
        let down = Instant::now();
        let mut n = 100;
        while down.elapsed() < Duration::from_secs(10) {
            for (cache, ms) in enqueue_many(&db, &["a", "b", "c"], n, 10).await {
                want.entry(cache).or_default().extend(ms);
            }
            n += 10;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(relay.stats().publish_failures > 0, "{:?}", relay.stats());
        assert!(db.rows().await > 0, "rows wait while the broker is down");
        server.restart();
        eventually("the relay drained the outbox", async || {
            db.rows().await == 0
        })
        .await;
        let events = read_stream(&server.url(), &db.schema, n as usize).await;
        assert_order(&events, &want);
        relay.shutdown().await;
        db.drop_schema().await;
    }
}
