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
async fn automatic_versions_increase_pass_caller_versions_and_never_wrap() {
    let db = TestDb::new("versions").await;
    let outbox = db.outbox();
    let table = outbox.dictionary::<String, String>("c");
    let mut tx = db.pool.begin().await.unwrap();
    let a = outbox.next_version(&mut tx, "c").await.unwrap();
    let b = table.insert(&mut tx, "k", "v").await.unwrap();
    assert!(b > a);
    let caller = b + 1_000_000_000;
    table
        .invalidate_versioned(&mut tx, "k", caller)
        .await
        .unwrap();
    let c = outbox.next_version(&mut tx, "c").await.unwrap();
    assert!(c > caller, "automatic versions pass caller versions");
    let other = outbox.next_version(&mut tx, "other").await.unwrap();
    assert!(other < caller, "versions are per cache");
    tx.commit().await.unwrap();

    // A rolled-back transaction gives its version back (the counter is
    // ahead of the clock here, so the next version is the counter's + 1).
    let mut tx = db.pool.begin().await.unwrap();
    let d = outbox.next_version(&mut tx, "c").await.unwrap();
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let e = outbox.next_version(&mut tx, "c").await.unwrap();
    assert_eq!(
        (d, e),
        (c + 1, c + 1),
        "the rolled-back version was given back"
    );

    // Versions are bigint in the database: past i64::MAX nothing follows.
    table
        .insert_versioned(&mut tx, "k", "v", u64::MAX)
        .await
        .unwrap();
    let err = table.insert(&mut tx, "k", "v").await.unwrap_err();
    assert!(
        matches!(err, Error::VersionExhausted(v) if v == i64::MAX as u64),
        "{err}"
    );
    tx.rollback().await.unwrap();
    db.drop_schema().await;
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

/// One enqueue in a transaction; returns the version it used (0 for none).
type Enqueue = Box<dyn for<'c> Fn(&'c mut sqlx::PgConnection) -> BoxFuture<'c, u64> + Send + Sync>;

/// Two transactions on one cache: A enqueues first, then B enqueues and
/// tries to commit at once, and only then A commits. Returns the commit
/// order (1 for A, 2 for B), the order the relay published them in, and
/// their versions.
async fn race(db: &TestDb, a: Enqueue, b: Enqueue) -> (Vec<u32>, Vec<u32>, u64, u64) {
    let mut tx_a = db.pool.begin().await.unwrap();
    let va = a(&mut tx_a).await;
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let task_b = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut tx_b = pool.begin().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx_b)
                .await
                .unwrap();
            pid_tx.send(pid).unwrap();
            let vb = b(&mut tx_b).await;
            tx_b.commit().await.unwrap();
            vb
        })
    };
    // A commits once B has either committed or waits for a lock A holds.
    // The commit order is read off which of the two it was: the clients'
    // own timing after A's commit is not (B's commit can return first).
    let pid = pid_rx.await.unwrap();
    let mut b_first = false;
    eventually("B committed or waits for a lock", async || {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)",
        )
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        b_first = task_b.is_finished();
        waiting || b_first
    })
    .await;
    tx_a.commit().await.unwrap();
    let vb = task_b.await.unwrap();
    let commit_order = if b_first { vec![2, 1] } else { vec![1, 2] };

    let rec = recorder();
    let relay = db.relay(Publisher::new(rec.clone())).await;
    wait_published(&relay, 2).await;
    relay.shutdown().await;
    let published = events(&rec).into_iter().map(|(_, m)| m).collect();
    (commit_order, published, va, vb)
}

/// The enqueue lock makes B wait for A, so A commits first and B is
/// published after it. Without the lock B commits first with the higher
/// id, and the relay, in id order, publishes A (the later commit) last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_follow_commit_order_per_cache() {
    let db = TestDb::new("commit_order").await;
    let enqueue = |m: u32| -> Enqueue {
        let outbox = db.outbox();
        Box::new(move |conn| {
            let outbox = outbox.clone();
            Box::pin(async move {
                outbox
                    .insert_versioned(conn, "c", [("k", marker(m), None)])
                    .await
                    .unwrap();
                0
            })
        })
    };
    let (commits, published, _, _) = race(&db, enqueue(1), enqueue(2)).await;
    assert_eq!(published, commits, "published in commit order");
    db.drop_schema().await;
}

/// A writes the row with its own version (a row version column ahead of
/// the clock), B with an automatic one: B commits later, so its version
/// must be the higher. Without the lock B reads the counter before A's
/// version is committed and takes the clock's, below A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_versions_follow_commit_order_per_cache() {
    let db = TestDb::new("version_order").await;
    let table = db.outbox().dictionary::<String, String>("c");
    let ahead = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
        + 60_000_000;
    let a: Enqueue = {
        let table = table.clone();
        Box::new(move |conn| {
            let table = table.clone();
            Box::pin(async move {
                table
                    .insert_versioned(conn, "k", &marker(1), ahead)
                    .await
                    .unwrap()
            })
        })
    };
    let b: Enqueue = Box::new(move |conn| {
        let table = table.clone();
        Box::pin(async move { table.insert(conn, "k", &marker(2)).await.unwrap() })
    });
    let (commits, published, va, vb) = race(&db, a, b).await;
    assert_eq!(published, commits, "published in commit order");
    let version = |m: u32| if m == 1 { va } else { vb };
    assert!(
        version(commits[1]) > version(commits[0]),
        "the later commit carries the higher version: commits {commits:?}, versions A {va} B {vb}"
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delayed_second_invalidation_comes_after_its_delay_and_holds_nothing_up() {
    let db = TestDb::new("again").await;
    let delay = Duration::from_millis(1500);
    let outbox = db.builder().again_after(delay).build().unwrap();
    let rec = recorder();
    let relay = db.relay(Publisher::new(rec.clone())).await;

    let mut tx = db.pool.begin().await.unwrap();
    outbox.invalidate(&mut tx, "c", [marker(9)]).await.unwrap();
    tx.rollback().await.unwrap();

    let start = Instant::now();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.invalidate(&mut tx, "c", [marker(1)]).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .insert_versioned(&mut tx, "c", [(marker(2), "x", None)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    wait_published(&relay, 2).await;
    assert!(start.elapsed() < delay, "the first copies took the delay");
    assert_eq!(
        events(&rec),
        [("c".to_owned(), 1), ("c".to_owned(), 2)],
        "the delayed copies hold back neither their first copies nor a later row"
    );
    assert_eq!(db.rows().await, 2, "the second copies wait in the outbox");
    wait_published(&relay, 4).await;
    assert!(start.elapsed() >= delay, "the second copies came early");
    // The refresh's second copy is an invalidation of its key; the
    // rolled-back call's copy would have had a lower id and been due
    // earlier, so it would have come with or before these.
    assert_eq!(
        events(&rec),
        [1, 2, 1, 2].map(|m| ("c".to_owned(), m)),
        "{:?}",
        events(&rec)
    );
    let twos: Vec<_> = payloads_for(&rec, "c")
        .into_iter()
        .filter(|p| markers(p) == [2])
        .collect();
    assert_eq!(twos.len(), 2);
    assert!(
        twos[1].len() < twos[0].len(),
        "the refresh's second copy carries no value"
    );
    assert_eq!(db.rows().await, 0);
    relay.shutdown().await;
    db.drop_schema().await;
}

/// A row that does not decode, and one whose entry is over the relay's
/// publisher's limit, each become a clear of their cache; the relay goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_cannot_be_published_becomes_a_clear_of_its_cache() {
    let db = TestDb::new("poison").await;
    let outbox = db.outbox();
    let rec = recorder();
    let poisoned = SyncedCache::<String, String>::new("p", moka::future::Cache::new(10));
    let big = SyncedCache::<String, String>::new("big", moka::future::Cache::new(10));
    let node = Node::builder("n", rec.clone())
        .register(&poisoned)
        .register(&big)
        .start()
        .await
        .unwrap();
    poisoned.insert("held".into(), "old".into()).await;
    big.insert("held".into(), "old".into()).await;

    sqlx::query(&format!(
        "INSERT INTO {s}.outbox (id, cache, change) VALUES (nextval('{s}.outbox_id_seq'), 'p', '\\xdeadbeef')",
        s = db.schema
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .insert_versioned(&mut tx, "big", [("k", "v".repeat(4000), Some(1))])
        .await
        .unwrap();
    outbox
        .insert_versioned(&mut tx, "ok", [("k", marker(1), None)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    let publisher = Publisher::builder(rec.clone())
        .max_event_bytes(1024)
        .build()
        .unwrap();
    let relay = db.relay(publisher).await;
    let stats = wait_published(&relay, 1).await;
    assert_eq!(stats.replaced_by_clear, 2, "{stats:?}");
    assert_eq!(events(&rec), [("ok".to_owned(), 1)]);
    assert_eq!(payloads_for(&rec, "p").len(), 1);
    assert_eq!(payloads_for(&rec, "big").len(), 1);
    eventually("both caches are cleared", async || {
        poisoned.get("held").await.is_none() && big.get("held").await.is_none()
    })
    .await;
    assert_eq!(db.rows().await, 0);
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    db.drop_schema().await;
}

/// The broker fails mid-batch: the relay backs off and retries the same
/// rows, so nothing is lost and order per cache holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_broker_loses_nothing_and_keeps_order() {
    let db = TestDb::new("fail").await;
    let want = enqueue_many(&db, &["a", "b", "c"], 0, 120).await;
    let rec = recorder();
    // The broker goes down after 40 publishes, until the test brings it up.
    rec.fail_publishes_after(40, usize::MAX);
    let relay = db.relay(Publisher::new(rec.clone())).await;
    eventually("the relay fails", async || {
        relay.stats().publish_failures >= 2
    })
    .await;
    assert_eq!(relay.stats().published, 40);
    assert_eq!(db.rows().await, 80);
    rec.fail_publishes(0);
    wait_published(&relay, 120).await;
    let events = events(&rec);
    assert_order(&events, &want);
    assert_eq!(duplicates(&events), 0);
    relay.shutdown().await;
    db.drop_schema().await;
}

/// Two relays on one database, with writers enqueueing while both run:
/// every event is published once (no failure, so no duplicate), in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_never_publish_a_row_twice_and_keep_order() {
    let db = TestDb::new("two_relays").await;
    let rec = recorder();
    let r1 = db.relay(Publisher::new(rec.clone())).await;
    let r2 = db.relay(Publisher::new(rec.clone())).await;
    let mut writers = Vec::new();
    for w in 0..4u32 {
        let db = TestDb {
            pool: db.pool.clone(),
            schema: db.schema.clone(),
        };
        writers.push(tokio::spawn(async move {
            enqueue_many(&db, &["a", "b", "c", "d", "e"], w * 1000, 250).await
        }));
    }
    let mut want: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    let mut per_writer = Vec::new();
    for w in writers {
        per_writer.push(w.await.unwrap());
    }
    eventually("both relays drained the outbox", async || {
        r1.stats().published + r2.stats().published >= 1000
    })
    .await;
    let events = events(&rec);
    assert_eq!(duplicates(&events), 0, "a row was published twice");
    // Writers ran concurrently: per cache, each writer's own events keep
    // their order, and the whole is each cache's commit order.
    for order in &per_writer {
        let mine: HashSet<u32> = order.values().flatten().copied().collect();
        let filtered: Vec<_> = events
            .iter()
            .filter(|(_, m)| mine.contains(m))
            .cloned()
            .collect();
        assert_order(&filtered, order);
    }
    for order in per_writer {
        for (cache, ms) in order {
            want.entry(cache).or_default().extend(ms);
        }
    }
    assert_eq!(events.len(), want.values().map(Vec::len).sum::<usize>());
    let (s1, s2) = (r1.stats(), r2.stats());
    println!(
        "relay 1 published {}, relay 2 {}",
        s1.published, s2.published
    );
    r1.shutdown().await;
    r2.shutdown().await;
    db.drop_schema().await;
}

/// When, in a pass of relay A, its database session dies (issue 21,
/// item 1: a relay that does not know it was replaced).
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// While A waits for its `SELECT` of the rows (the test holds the
    /// table): after the lock and the term, before any publish.
    InSelect,
    /// While A's publish of its `n`th event is slow: that publish lands
    /// after relay B has taken over and published every row.
    DuringPublish(usize),
    /// After A's `n`th publish returned, before its next row.
    AfterPublish(usize),
}

/// Kills every session of `application_name` (a relay's whole pool).
async fn kill_sessions(pool: &PgPool, application_name: &str) {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(application_name)
    .execute(pool)
    .await
    .unwrap();
}

/// Relay A's session dies at `at`, relay B takes over. Eight unversioned
/// refreshes of two keys (values 1 to 8, the last of each key 7 and 8).
/// Whatever the step: A publishes nothing once it could know it lost the
/// lock (at most the one publish in flight), B publishes every row, and
/// the node ends with each key's last value or with nothing (a fenced
/// late row is applied as an invalidation, and the next read loads the
/// database's row): never an older value.
async fn a_relay_whose_session_dies(at: Kill) {
    let db = TestDb::new("fence").await;
    let outbox = db.outbox();
    for i in 1..=8u32 {
        let mut tx = db.pool.begin().await.unwrap();
        let key = if i % 2 == 1 { "odd" } else { "even" };
        outbox
            .insert_versioned(&mut tx, "t", [(key, marker(i), None)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let embedded = EmbeddedTransport::new();
    let cache = SyncedCache::<String, String>::new("t", moka::future::Cache::new(10));
    let node = Node::builder("n", embedded.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();

    let name_a = format!("relay-a-{}", db.schema);
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
    let pool_a = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&name_a))
        .await
        .unwrap();
    // Relay A's transport parks the publish the test kills A's session at.
    let a_transport = FaultyTransport::new(embedded.clone());
    // Kept, so its change events can be counted apart from its publisher's
    // announcements (sent from a second after its first publish, and
    // counted as publishes too).
    a_transport.record_publishes(true);
    let nth = |k: usize| {
        let calls = AtomicUsize::new(0);
        move |_: &str, _: &[u8]| calls.fetch_add(1, Ordering::SeqCst) + 1 == k
    };
    match at {
        Kill::InSelect => {}
        Kill::DuringPublish(k) => a_transport.hang_publishes_where(nth(k)),
        Kill::AfterPublish(k) => a_transport.hang_after_broker_where(nth(k)),
    }
    // A's publishes that reached the broker when its session was killed.
    let mut killed_at = None;
    // Held by the test while A selects, for `InSelect`.
    let mut table_lock = None;
    if let Kill::InSelect = at {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "LOCK TABLE {}.outbox IN ACCESS EXCLUSIVE MODE",
            db.schema
        ))
        .execute(&mut *tx)
        .await
        .unwrap();
        table_lock = Some(tx);
    }
    let relay_a = OutboxRelay::builder(pool_a.clone(), Publisher::new(a_transport.clone()))
        .outbox(db.outbox())
        .poll_interval(Duration::from_millis(50))
        .start()
        .await
        .unwrap();
    if let Some(tx) = table_lock.take() {
        eventually("relay A waits for the table", async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND wait_event_type = 'Lock'",
            )
            .bind(&name_a)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            waiting == 1
        })
        .await;
        kill_sessions(&db.pool, &name_a).await;
        killed_at = Some(events(&a_transport).len());
        tx.rollback().await.unwrap();
    }
    // B starts once A holds its pass (or has died in it).
    eventually("relay A started its pass", async || {
        a_transport.publishes() + a_transport.hanging() > 0 || killed_at.is_some()
    })
    .await;
    // Relay B's transport keeps what B sends, on the node's broker.
    let b_transport = FaultyTransport::new(embedded.clone());
    b_transport.record_publishes(true);
    let relay_b = db.relay(Publisher::new(b_transport.clone())).await;
    if let Kill::DuringPublish(_) | Kill::AfterPublish(_) = at {
        eventually("relay A's publish is parked", async || {
            a_transport.hanging() == 1
        })
        .await;
        kill_sessions(&db.pool, &name_a).await;
        killed_at = Some(events(&a_transport).len());
        if let Kill::DuringPublish(_) = at {
            // The publish in flight when the session died lands after B
            // took over and published every row, as a slow broker call would.
            eventually("relay B drained the outbox", async || db.rows().await == 0).await;
        }
        a_transport.hang_publishes(false);
    }
    eventually("the outbox is drained", async || db.rows().await == 0).await;
    // Everything either relay will ever send has been sent once both
    // stopped; every event is then applied, in order.
    relay_b.shutdown().await;
    relay_a.shutdown().await;
    // Change events only (the markers): each publisher also announces its
    // last sequence numbers, every second from its first publish, and the
    // transports count and record those too.
    let sent = (events(&a_transport).len() + events(&b_transport).len()) as u64;
    // Applied, not read: `events_received` counts each record as the node
    // reads it, before the batch's run of events is applied, and counts
    // announcements besides; on a loaded machine it passed `sent` while
    // row 7 was read but not applied, or not read yet, and the check
    // below saw row 5.
    eventually("the node applied every event", async || {
        node.status().caches[0].events_applied >= sent
    })
    .await;
    // The publish in flight, if any, counts: it landed after the kill.
    let after_kill = events(&a_transport).len() - killed_at.expect("relay A was killed");
    assert!(
        after_kill <= usize::from(matches!(at, Kill::DuringPublish(_))),
        "{at:?}: relay A published {after_kill} events after its session died"
    );
    assert_eq!(
        events(&b_transport).len(),
        8,
        "{at:?}: relay B publishes every row A did not delete"
    );
    for (key, last) in [("odd", 7), ("even", 8)] {
        let held = cache.peek(key).await;
        assert!(
            held.is_none() || held == Some(marker(last)),
            "{at:?}: the node holds {held:?} for {key}, the database {}",
            marker(last)
        );
    }
    if let Kill::DuringPublish(_) = at {
        assert_eq!(
            node.status().events_fenced,
            1,
            "{at:?}: {:?}",
            node.status()
        );
    }
    node.shutdown().await.unwrap();
    pool_a.close().await;
    db.drop_schema().await;
}

/// An outbox made by the release before the fence has only the first
/// migration: a relay refuses to start on it, naming the fix, and
/// `migrate` brings it up to date (idempotently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_needs_the_second_migration_and_migrate_adds_it() {
    let db = TestDb::new("upgrade").await;
    for object in ["TABLE {s}.relay", "SEQUENCE {s}.relay_term_seq"] {
        let object = object.replace("{s}", &db.schema);
        sqlx::query(&format!("DROP {object}"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let err = OutboxRelay::builder(db.pool.clone(), Publisher::new(EmbeddedTransport::new()))
        .outbox(db.outbox())
        .start()
        .await
        .unwrap_err();
    assert!(err.is_database(), "{err}");
    assert!(err.to_string().contains("Outbox::migrate"), "{err}");
    db.outbox().migrate(&db.pool).await.unwrap();
    db.outbox().migrate(&db.pool).await.unwrap();
    let relay = db.relay(Publisher::new(EmbeddedTransport::new())).await;
    relay.shutdown().await;
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_in_its_select_publishes_nothing() {
    a_relay_whose_session_dies(Kill::InSelect).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_during_its_first_publish_is_fenced() {
    a_relay_whose_session_dies(Kill::DuringPublish(1)).await;
}

/// The case seen on the wire: `[1, 1, 2, 3, 4, 2, 3]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_during_a_slow_publish_is_fenced() {
    a_relay_whose_session_dies(Kill::DuringPublish(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_between_publishes_publishes_no_more() {
    a_relay_whose_session_dies(Kill::AfterPublish(3)).await;
}

/// After its last publish, before its DELETE and COMMIT: B publishes the
/// rows again; duplicates, in order, are harmless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_before_its_commit_loses_nothing() {
    a_relay_whose_session_dies(Kill::AfterPublish(8)).await;
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
