//! The transactional outbox on MariaDB (feature `mysql-outbox`), against a
//! server of the test's own (`mariadb_server`): what commits is published,
//! in commit order per cache, at least once when a relay, the broker or the
//! database fails; one relay publishes at a time, and a relay whose session
//! died is fenced.
//!
//! Events are recognised by a marker, `~NNNNNNN~`, in the value each
//! enqueue carries.
#![cfg(feature = "mysql-outbox")]
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cache_sync::outbox::{Outbox, OutboxRelay};
use cache_sync::transport::{EmbeddedTransport, FaultyTransport};
use cache_sync::{Node, Publisher, SyncedCache};
use integration_tests::eventually;
use integration_tests::mariadb_server::MariaDbServer;
use sqlx::MySqlPool;
use sqlx::mysql::MySqlPoolOptions;

struct Db {
    server: MariaDbServer,
    pool: MySqlPool,
    schema: &'static str,
}

async fn db() -> Db {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let server = tokio::task::spawn_blocking(MariaDbServer::start)
        .await
        .unwrap();
    let pool = pool(&server, "root").await;
    let db = Db {
        server,
        pool,
        schema: "cache_sync",
    };
    db.outbox().migrate(&db.pool).await.expect("migrate");
    db
}

async fn pool(server: &MariaDbServer, user: &str) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&format!("mysql://{user}@127.0.0.1:{}/", server.port()))
        .await
        .unwrap()
}

impl Db {
    fn outbox(&self) -> Outbox {
        Outbox::builder().schema(self.schema).build().unwrap()
    }

    async fn rows(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {}.outbox", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn relay_on(&self, pool: MySqlPool, publisher: Publisher) -> OutboxRelay {
        OutboxRelay::builder(pool, publisher)
            .outbox(self.outbox())
            .poll_interval(Duration::from_millis(20))
            .batch_size(16)
            .start()
            .await
            .expect("relay starts")
    }

    async fn relay(&self, publisher: Publisher) -> OutboxRelay {
        self.relay_on(self.pool.clone(), publisher).await
    }

    /// Enqueues one unversioned refresh of `key` in `cache` carrying
    /// marker `n`, in a transaction of its own.
    async fn enqueue(&self, cache: &str, key: &str, n: u32) {
        let mut tx = self.pool.begin().await.unwrap();
        self.outbox()
            .insert(&mut tx, cache, [(key, marker(n))])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }

    async fn term(&self) -> i64 {
        sqlx::query_scalar(&format!("SELECT term FROM {}.relay", self.schema))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }
}

fn marker(n: u32) -> String {
    format!("~{n:07}~")
}

fn markers(payload: &[u8]) -> Vec<u32> {
    payload
        .windows(9)
        .filter(|w| w[0] == b'~' && w[8] == b'~' && w[1..8].iter().all(u8::is_ascii_digit))
        .map(|w| std::str::from_utf8(&w[1..8]).unwrap().parse().unwrap())
        .collect()
}

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

/// First arrivals per cache, in publish order.
fn first_arrivals(events: &[(String, u32)]) -> BTreeMap<String, Vec<u32>> {
    let mut seen = HashSet::new();
    let mut got: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (cache, m) in events {
        if seen.insert(*m) {
            got.entry(cache.clone()).or_default().push(*m);
        }
    }
    got
}

/// What commits is published, once, and what rolls back never is; a
/// cache named in Cyrillic with an emoji round-trips through the
/// VARBINARY columns; `migrate` runs again, and from several tasks at
/// once, without harm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commits_are_published_and_rollbacks_never() {
    let db = db().await;
    let mut migrations = Vec::new();
    for _ in 0..4 {
        let (outbox, pool) = (db.outbox(), db.pool.clone());
        migrations.push(tokio::spawn(async move { outbox.migrate(&pool).await }));
    }
    for m in migrations {
        m.await.unwrap().unwrap();
    }
    let cache = "кэш ✓ 🚀";
    db.enqueue(cache, "a", 1).await;
    let mut tx = db.pool.begin().await.unwrap();
    db.outbox()
        .insert(&mut tx, cache, [("b", marker(2))])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    db.enqueue(cache, "c", 3).await;
    let transport = recorder();
    let relay = db.relay(Publisher::new(transport.clone())).await;
    eventually("both commits are published", async || {
        relay.stats().published >= 2
    })
    .await;
    // A poll or two more: the rolled-back row never appears.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        first_arrivals(&events(&transport)),
        BTreeMap::from([(cache.to_owned(), vec![1, 3])])
    );
    assert_eq!(events(&transport).len(), 2, "nothing published twice");
    assert_eq!(db.rows().await, 0);
    assert_eq!(relay.stats().waiting, 0);
    relay.shutdown().await;
}

/// Writers on overlapping caches, concurrently: per cache, automatic
/// versions follow commit order (each strictly above the last), and the
/// relay publishes every row in that order, while publishes fail now and
/// then (each failure ends the pass; the rows are published again, in
/// order).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_are_published_in_commit_order_per_cache() {
    let db = Arc::new(db().await);
    let transport = recorder();
    let relay = db.relay(Publisher::new(transport.clone())).await;
    let next = Arc::new(AtomicUsize::new(1));
    let mut writers = Vec::new();
    for w in 0..6 {
        let (db, next) = (db.clone(), next.clone());
        writers.push(tokio::spawn(async move {
            let mut versions: Vec<(String, u32, u64)> = Vec::new();
            for i in 0..25 {
                let cache = ["a", "b", "c"][(w + i) % 3];
                let n = u32::try_from(next.fetch_add(1, Ordering::SeqCst)).unwrap();
                let dictionary = db.outbox().dictionary::<String, String>(cache);
                let mut tx = db.pool.begin().await.unwrap();
                // A read first, as an application's transaction makes: it
                // fixes the transaction's snapshot before the enqueue's lock.
                let _: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM cache_sync.versions")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                tokio::task::yield_now().await;
                let v = dictionary
                    .insert(&mut tx, &format!("k{}", i % 4), &marker(n))
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                versions.push((cache.to_owned(), n, v));
            }
            versions
        }));
    }
    for round in 0..5 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        transport.fail_publishes(1 + round % 2);
    }
    let mut version_of = BTreeMap::new();
    for w in writers {
        for (cache, n, v) in w.await.unwrap() {
            version_of.insert(n, (cache, v));
        }
    }
    assert_eq!(version_of.len(), 150);
    eventually("every row is published", async || db.rows().await == 0).await;
    let got = first_arrivals(&events(&transport));
    for (cache, ns) in &got {
        let versions: Vec<u64> = ns.iter().map(|n| version_of[n].1).collect();
        assert!(
            versions.windows(2).all(|w| w[0] < w[1]),
            "{cache}: published out of version (commit) order: {versions:?}"
        );
        assert!(ns.iter().all(|n| version_of[n].0 == *cache));
    }
    assert_eq!(
        got.values().map(Vec::len).sum::<usize>(),
        150,
        "every row arrived"
    );
    assert!(relay.stats().publish_failures >= 1, "{:?}", relay.stats());
    relay.shutdown().await;
}

/// Two relays: one publishes, the other stands by; the leader's connection
/// killed, the standby (or the leader, reconnected) takes over with a
/// higher term and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_publishes_and_a_standby_takes_over() {
    let db = db().await;
    db.server
        .sql("CREATE USER relay_a@'%'; GRANT ALL ON *.* TO relay_a@'%'")
        .unwrap();
    let pool_a = pool(&db.server, "relay_a").await;
    let a = recorder();
    let b = recorder();
    let relay_a = db.relay_on(pool_a.clone(), Publisher::new(a.clone())).await;
    for n in 1..=5 {
        db.enqueue("t", "k", n).await;
    }
    eventually("relay A publishes", async || events(&a).len() == 5).await;
    let term_a = db.term().await;
    let relay_b = db.relay(Publisher::new(b.clone())).await;
    // One at a time, a poll apart: a standby that led too would take some.
    for n in 6..=20 {
        db.enqueue("t", "k", n).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    eventually("relay A publishes again", async || events(&a).len() == 20).await;
    assert!(
        events(&b).is_empty(),
        "the standby published: {:?}",
        events(&b)
    );
    // Every session of relay A: its pool, and its leader's connection.
    let ids = db
        .server
        .sql("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = 'relay_a'")
        .unwrap();
    // A's pool would hand it new sessions; the user goes first.
    db.server.sql("DROP USER relay_a@'%'").unwrap();
    for id in ids.lines() {
        let _ = db.server.sql(&format!("KILL {id}"));
    }
    for n in 21..=25 {
        db.enqueue("t", "k", n).await;
    }
    eventually("relay B takes over", async || events(&b).len() == 5).await;
    assert!(
        db.term().await > term_a,
        "the new leader drew a higher term"
    );
    let all: Vec<u32> = first_arrivals(&[events(&a), events(&b)].concat())
        .remove("t")
        .unwrap();
    assert_eq!(all, (1..=25).collect::<Vec<_>>());
    relay_a.shutdown().await;
    relay_b.shutdown().await;
}

/// Relay A's publish of its second event hangs; its sessions are killed
/// meanwhile; relay B takes over and publishes every row; A's late publish
/// then lands, and the node, having seen B's higher term, applies it as an
/// invalidation: the node never ends on an older value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_during_a_slow_publish_is_fenced() {
    let db = db().await;
    for i in 1..=8u32 {
        let key = if i % 2 == 1 { "odd" } else { "even" };
        db.enqueue("t", key, i).await;
    }
    let embedded = EmbeddedTransport::new();
    let cache = SyncedCache::<String, String>::new("t", moka::future::Cache::new(10));
    let node = Node::builder("n", embedded.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    db.server
        .sql("CREATE USER relay_a@'%'; GRANT ALL ON *.* TO relay_a@'%'")
        .unwrap();
    let pool_a = pool(&db.server, "relay_a").await;
    let a = FaultyTransport::new(embedded.clone());
    a.record_publishes(true);
    let calls = AtomicUsize::new(0);
    a.hang_publishes_where(move |_, _| calls.fetch_add(1, Ordering::SeqCst) + 1 == 2);
    let relay_a = db.relay_on(pool_a.clone(), Publisher::new(a.clone())).await;
    eventually("relay A's publish is parked", async || a.hanging() == 1).await;
    let ids = db
        .server
        .sql("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = 'relay_a'")
        .unwrap();
    db.server.sql("DROP USER relay_a@'%'").unwrap();
    for id in ids.lines() {
        let _ = db.server.sql(&format!("KILL {id}"));
    }
    let killed_at = events(&a).len();
    let b = FaultyTransport::new(embedded.clone());
    b.record_publishes(true);
    let relay_b = db.relay(Publisher::new(b.clone())).await;
    eventually("relay B drained the outbox", async || db.rows().await == 0).await;
    a.hang_publishes(false);
    relay_b.shutdown().await;
    relay_a.shutdown().await;
    let sent = (events(&a).len() + events(&b).len()) as u64;
    eventually("the node applied every event", async || {
        node.status().caches[0].events_applied >= sent
    })
    .await;
    let after_kill = events(&a).len() - killed_at;
    assert!(
        after_kill <= 1,
        "relay A published {after_kill} events after its session died"
    );
    // A deletes its rows at the end of its pass, which never came.
    assert_eq!(
        events(&b).len(),
        8,
        "relay B publishes every row A did not delete"
    );
    for (key, last) in [("odd", 7), ("even", 8)] {
        let held = cache.peek(key).await;
        assert!(
            held.is_none() || held == Some(marker(last)),
            "the node holds {held:?} for {key}, the database {}",
            marker(last)
        );
    }
    assert_eq!(node.status().events_fenced, 1, "{:?}", node.status());
    node.shutdown().await.unwrap();
}

/// The server killed (`kill -9`) and restarted under a stream of writes:
/// every committed row is published (at least once), in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_and_restarted_loses_nothing() {
    let mut db = db().await;
    let transport = recorder();
    let relay = db.relay(Publisher::new(transport.clone())).await;
    for n in 1..=20 {
        db.enqueue("t", "k", n).await;
    }
    db.server.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    db.server.restart();
    for n in 21..=40 {
        // The pool's first tries may meet dead connections.
        let mut tries = 0;
        loop {
            tries += 1;
            assert!(tries < 200, "the restarted server takes no writes");
            let mut tx = match db.pool.begin().await {
                Ok(tx) => tx,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let sent = db.outbox().insert(&mut tx, "t", [("k", marker(n))]).await;
            if sent.is_ok() && tx.commit().await.is_ok() {
                break;
            }
        }
    }
    eventually("every row is published", async || db.rows().await == 0).await;
    let got = first_arrivals(&events(&transport)).remove("t").unwrap();
    assert_eq!(got, (1..=40).collect::<Vec<_>>());
    relay.shutdown().await;
}

/// A row that can never be published (garbage in the `change` column) is
/// replaced by a clear of its cache, counted, and deleted; a delayed
/// second invalidation (`again_after`) is published when due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_becomes_a_clear_and_second_invalidations_come_when_due() {
    let db = db().await;
    sqlx::query(&format!(
        "INSERT INTO {}.outbox (cache, `change`) VALUES ('t', x'02ff00')",
        db.schema
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let transport = recorder();
    let relay = db.relay(Publisher::new(transport.clone())).await;
    eventually("the garbage row is replaced", async || {
        relay.stats().replaced_by_clear == 1 && db.rows().await == 0
    })
    .await;
    let again = Outbox::builder()
        .schema(db.schema)
        .again_after(Duration::from_millis(300))
        .build()
        .unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    again
        .insert(&mut tx, "t", [("k", marker(1))])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    eventually("the change is published", async || {
        events(&transport).len() == 1
    })
    .await;
    assert_eq!(db.rows().await, 1, "the second invalidation waits");
    eventually("the second invalidation is published", async || {
        db.rows().await == 0
    })
    .await;
    assert_eq!(relay.stats().published, 3);
    relay.shutdown().await;
}

/// A relay on a database without the outbox refuses to start, naming the
/// fix; caller versions raise the automatic ones; versions past i64::MAX
/// are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_and_versions() {
    let db = db().await;
    let other = Outbox::builder().schema("not_migrated").build().unwrap();
    let err = OutboxRelay::builder(db.pool.clone(), Publisher::new(EmbeddedTransport::new()))
        .outbox(other)
        .start()
        .await
        .unwrap_err();
    assert!(err.is_database(), "{err}");
    assert!(err.to_string().contains("Outbox::migrate"), "{err}");
    let dictionary = db.outbox().dictionary::<String, String>("v");
    let mut tx = db.pool.begin().await.unwrap();
    let v1 = dictionary.insert(&mut tx, "k", "x").await.unwrap();
    let v2 = dictionary.insert(&mut tx, "k", "y").await.unwrap();
    assert!(v2 > v1);
    let high = v2 + 1_000_000_000_000;
    dictionary
        .insert_versioned(&mut tx, "k", "z", high)
        .await
        .unwrap();
    let v3 = dictionary.insert(&mut tx, "k", "w").await.unwrap();
    assert_eq!(v3, high + 1, "automatic versions exceed caller versions");
    tx.commit().await.unwrap();
    // A rolled-back version is given back.
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        db.outbox().next_version(&mut tx, "v").await.unwrap(),
        high + 2
    );
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    assert_eq!(
        db.outbox().next_version(&mut tx, "v").await.unwrap(),
        high + 2
    );
    dictionary
        .insert_versioned(&mut tx, "k", "m", i64::MAX as u64)
        .await
        .unwrap();
    let err = db.outbox().next_version(&mut tx, "v").await.unwrap_err();
    assert!(
        matches!(err, cache_sync::Error::VersionExhausted(_)),
        "{err}"
    );
    tx.rollback().await.unwrap();
}

/// Operator actions on the outbox's tables under a running relay: the
/// outbox table dropped (every pass fails, counted, until `migrate` makes
/// it again; nothing committed after is lost), and the relay's row deleted
/// (the leader keeps the term it drew; a relay that must draw a new one
/// refuses, naming the fix, until `migrate` writes the row again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_dropped_or_emptied_under_a_relay_fail_loudly_and_recover() {
    let db = db().await;
    let transport = recorder();
    let relay = db.relay(Publisher::new(transport.clone())).await;
    db.enqueue("t", "k", 1).await;
    eventually("published", async || events(&transport).len() == 1).await;

    db.server.sql("DROP TABLE cache_sync.outbox").unwrap();
    let failures = relay.stats().publish_failures;
    eventually("the relay's passes fail", async || {
        relay.stats().publish_failures > failures
    })
    .await;
    db.outbox().migrate(&db.pool).await.unwrap();
    db.enqueue("t", "k", 2).await;
    eventually("published after migrate", async || {
        events(&transport).len() == 2
    })
    .await;

    // The leader holds its lock and its term: it goes on.
    db.server.sql("DELETE FROM cache_sync.relay").unwrap();
    db.enqueue("t", "k", 3).await;
    eventually("the leader goes on", async || events(&transport).len() == 3).await;
    // A relay that must take the lock again draws a term from the row.
    relay.shutdown().await;
    let err = OutboxRelay::builder(db.pool.clone(), Publisher::new(transport.clone()))
        .outbox(db.outbox())
        .start()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("Outbox::migrate"), "{err}");
    db.outbox().migrate(&db.pool).await.unwrap();
    let relay = db.relay(Publisher::new(transport.clone())).await;
    db.enqueue("t", "k", 4).await;
    eventually("published after the row is back", async || {
        events(&transport).len() == 4
    })
    .await;
    assert_eq!(
        first_arrivals(&events(&transport)).remove("t").unwrap(),
        vec![1, 2, 3, 4]
    );
    relay.shutdown().await;
}
