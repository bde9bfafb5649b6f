//! The CDC relay against a PostgreSQL of the test's own (`wal_level =
//! logical`, see `postgres_server`): what commits reaches every node, what
//! rolls back never does, and after any fault (the relay killed, its
//! connection terminated, the server killed or stopped, the slot dropped)
//! every node agrees with the database.
//!
//! "Agrees": for every key, a node holds either nothing or the database's
//! current value; and once the writes stop, every key a refresh installed
//! holds the last committed value.
#![cfg(feature = "postgres-cdc")]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table,
    cdc::{CdcRelay, CdcTable},
    transport::EmbeddedTransport,
};
use integration_tests::cdc::*;
use integration_tests::eventually;
use integration_tests::postgres_server::PostgresServer;
use sqlx::PgPool;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_changes_reach_every_node_and_rolled_back_ones_never() {
    let (pg, pool, transport, nodes) = items_fixture(3).await;
    let relay = relay(&pg, &transport).start().await.unwrap();

    insert(&pool, 0..50, "a").await;
    eventually("every node holds the inserted rows", async || {
        nodes.hold(&named(0..50, "a")).await
    })
    .await;
    exec(&pool, "UPDATE items SET name = 'b' || id WHERE id < 10").await;
    exec(&pool, "DELETE FROM items WHERE id >= 40").await;
    // Rolled back: never published.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("UPDATE items SET name = 'rolled back' WHERE id = 20")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    // Insert then delete in one transaction: nodes see the delete.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO items VALUES (1000, 'gone', NULL)")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("DELETE FROM items WHERE id = 1000")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // A marker after everything: once it arrived, so had the rest.
    exec(&pool, "INSERT INTO items VALUES (2000, 'last', NULL)").await;
    let mut want = named(0..10, "b");
    want.insert(2000, "last".into());
    want.extend(named(10..40, "a"));
    eventually("every node holds the committed rows", async || {
        nodes.hold(&want).await
    })
    .await;
    for cache in &nodes.caches {
        for id in 40..50 {
            assert_eq!(cache.peek(&id).await, None, "deleted {id}");
        }
        assert_eq!(cache.peek(&1000).await, None);
        assert!(cache.iter().all(|(_, v)| v != "rolled back"));
    }
    nodes.agree(&pool).await;
    let stats = relay.stats();
    assert!(stats.active, "{stats:?}");
    assert!(stats.transactions >= 5, "{stats:?}");
    assert_eq!(stats.resyncs, 1, "the new slot's clear: {stats:?}");
    let metrics = relay.metrics();
    assert!(
        metrics.contains("cache_sync_cdc_active{slot=\"cache_sync\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("cache_sync_cdc_slot_lag_bytes"),
        "{metrics}"
    );
    relay.shutdown().await;
    nodes.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncate_clears_and_rows_inserted_after_it_stay() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    exec(
        &pool,
        "BEGIN; TRUNCATE items; INSERT INTO items VALUES (5, 'after', NULL); COMMIT",
    )
    .await;
    let want: BTreeMap<i64, String> = [(5, "after".to_owned())].into();
    eventually("the row after the truncate arrives", async || {
        nodes.hold(&want).await
    })
    .await;
    for cache in &nodes.caches {
        assert_eq!(cache.iter().count(), 1);
    }
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// 100,000 rows in one transaction: past the cap, one clear at its commit
/// instead of 100,000 events to every node; nothing stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_thousand_row_transaction_reaches_nodes_as_a_clear() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..100, "a").await;
    eventually("rows arrive", async || {
        nodes.hold(&named(0..100, "a")).await
    })
    .await;
    insert(&pool, 100..100_000, "a").await;
    exec(&pool, "UPDATE items SET name = 'big' || id").await;
    exec(&pool, "INSERT INTO items VALUES (-1, 'last', NULL)").await;
    let want: BTreeMap<i64, String> = [(-1, "last".to_owned())].into();
    eventually("the transaction after it arrives", async || {
        nodes.hold(&want).await
    })
    .await;
    nodes.agree(&pool).await;
    for cache in &nodes.caches {
        assert_eq!(cache.peek(&7).await, None, "cleared, not refreshed");
    }
    let stats = relay.stats();
    assert!(stats.rows >= 199_900, "{stats:?}");
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// A broker that takes no publish: the slot's confirmed position stays,
/// its lag in bytes and seconds grows and is reported, and once the broker
/// takes publishes again every change arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_broker_shows_as_slot_lag_and_loses_nothing() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let faulty = cache_sync::transport::FaultyTransport::new(transport.clone());
    let relay = CdcRelay::builder(pg.url(), Publisher::new(faulty.clone()))
        .lag_interval(Duration::from_millis(100))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    faulty.hang_publishes(true);
    insert(&pool, 0..100, "a").await;
    let mut last = relay.stats();
    eventually("the slot lags in bytes and seconds", async || {
        last = relay.stats();
        last.lag_bytes.is_some_and(|b| b > 0) && last.lag_seconds >= 1.0
    })
    .await;
    eprintln!("{last:?}");
    let metrics = relay.metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("cache_sync_cdc_slot_lag_bytes{") && !l.ends_with(" 0")),
        "{metrics}"
    );
    faulty.hang_publishes(false);
    eventually("every row arrives", async || {
        nodes.hold(&named(0..100, "a")).await
    })
    .await;
    eventually("the lag is gone", async || {
        let s = relay.stats();
        s.lag_bytes == Some(0) && s.lag_seconds == 0.0
    })
    .await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// The relay publishes while it goes on reading: with a publish stuck, it
/// confirms nothing past it, however long the server keeps sending
/// keepalives (each names the end of its WAL, past the stuck rows), so a
/// relay that dies then loses nothing: the next one streams the rows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_publish_confirms_nothing_past_it_while_the_stream_goes_on() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let faulty = cache_sync::transport::FaultyTransport::new(transport.clone());
    let relay = CdcRelay::builder(pg.url(), Publisher::new(faulty.clone()))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    first_resync(&relay).await;
    faulty.hang_publishes(true);
    insert(&pool, 0..1, "a").await;
    eventually("a publish hangs", async || faulty.hanging() > 0).await;
    // More commits behind it, read and handed over while it hangs.
    for i in 1..200 {
        insert(&pool, i..i + 1, "a").await;
    }
    let (written,): (String,) = sqlx::query_as("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    // The walsender sent it all, and keepalives followed (every
    // wal_sender_timeout / 2 = 2.5 s while the stream is quiet).
    eventually("the walsender sent everything", async || {
        let (sent,): (bool,) = sqlx::query_as(
            "SELECT coalesce(bool_and(sent_lsn >= $1::pg_lsn), false) FROM pg_stat_replication",
        )
        .bind(&written)
        .fetch_one(&pool)
        .await
        .unwrap();
        sent
    })
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (confirmed,): (String,) = sqlx::query_as(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'cache_sync'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let (behind,): (bool,) = sqlx::query_as("SELECT $1::pg_lsn < $2::pg_lsn")
        .bind(&confirmed)
        .bind(&written)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        behind,
        "the slot was confirmed to {confirmed}, past the rows still unpublished (written to {written})"
    );
    assert_eq!(relay.stats().rows, 0, "nothing was published yet");
    // The relay dies with its publish stuck (its stop's grace runs out).
    relay.shutdown().await;
    faulty.hang_publishes(false);
    let relay = integration_tests::cdc::relay(&pg, &transport)
        .start()
        .await
        .unwrap();
    eventually("every row arrives", async || {
        nodes.hold(&named(0..200, "a")).await
    })
    .await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Within one batch, each cache is published on its own: a publish stuck
/// for one cache holds up neither the other's publish in the same
/// transaction nor, therefore, its nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_publish_of_one_cache_does_not_hold_up_another() {
    let (pg, pool, transport, nodes) = items_fixture(1).await;
    exec(
        &pool,
        "CREATE TABLE others (id bigint PRIMARY KEY, name text NOT NULL)",
    )
    .await;
    const OTHERS: Table<i64, String> = Table::new("others");
    let others = SyncedCache::new(OTHERS, moka::future::Cache::new(1_000));
    let node = Node::builder("o", transport.clone())
        .register(&others)
        .start()
        .await
        .unwrap();
    let faulty = cache_sync::transport::FaultyTransport::new(transport.clone());
    // The items cache's publishes hang; the others' go through. Four
    // rounds, each a relay of its own (a session orders a batch's caches
    // in a way of its own): publishing the caches one after another would
    // hang the others' behind the items' in about 15 runs of 16.
    for round in 0..4i64 {
        let relay = CdcRelay::builder(pg.url(), Publisher::new(faulty.clone()))
            .table(
                CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")),
            )
            .table(
                CdcTable::new(OTHERS, "others", |row| row.parse("id"))
                    .value(|row| row.parse("name")),
            )
            .start()
            .await
            .unwrap();
        if round == 0 {
            // The new slot's resync, a clear of both caches, goes first.
            first_resync(&relay).await;
        }
        eventually("the relay streams", async || relay.stats().active).await;
        faulty.hang_publishes_where(|cache, _| cache == "items");
        exec(
            &pool,
            &format!(
                "BEGIN; INSERT INTO items VALUES ({round}, 'i{round}'); \
                 INSERT INTO others VALUES ({round}, 'o{round}'); COMMIT"
            ),
        )
        .await;
        eventually("the other cache's row arrives", async || {
            others.peek(&round).await.as_deref() == Some(&*format!("o{round}"))
        })
        .await;
        assert!(faulty.hanging() > 0, "the items publish hangs meanwhile");
        assert_eq!(nodes.caches[0].peek(&round).await, None);
        faulty.hang_publishes(false);
        eventually("the items row arrives", async || {
            nodes.caches[0].peek(&round).await.as_deref() == Some(&*format!("i{round}"))
        })
        .await;
        relay.shutdown().await;
    }
    node.shutdown().await.unwrap();
    nodes.shutdown().await;
}

/// A commit that waits for a synchronous standby is flushed, so the
/// server sends it, but no other session sees it yet: the relay must not
/// publish it (a node would load the old row and then ignore the event as
/// old news) until it is visible. The server's xids are in epoch 1, so the
/// 32-bit xid off the stream must be widened right for the check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_not_yet_visible_is_not_published() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    let epoch: i64 = sqlx::query_scalar("SELECT (pg_current_xact_id()::text::int8 >> 32)")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(epoch, 1);
    let transport = EmbeddedTransport::new();
    let nodes = nodes(&transport, 1).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..3, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..3, "a")).await).await;
    // Every commit from now on waits for a standby that does not exist.
    exec(
        &pool,
        "ALTER SYSTEM SET synchronous_standby_names = 'nobody'",
    )
    .await;
    exec(&pool, "SELECT pg_reload_conf()").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // An older transaction with an xid, still open: snapshots' xmax stays
    // at or below it, so the waiting commit's xid is above xmax.
    let mut older = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *older)
        .await
        .unwrap();
    let writer = {
        let pool = pool.clone();
        tokio::spawn(async move {
            exec(&pool, "UPDATE items SET name = 'hidden' WHERE id = 1").await;
        })
    };
    // Flushed and decoded, not visible: not published.
    eventually("the commit waits for the standby", async || {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        waiting >= 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        nodes.caches[0].peek(&1).await.as_deref(),
        Some("a1"),
        "published before it was visible"
    );
    older.rollback().await.unwrap();
    exec(&pool, "ALTER SYSTEM RESET synchronous_standby_names").await;
    exec(&pool, "SELECT pg_reload_conf()").await;
    writer.await.unwrap();
    let want: BTreeMap<i64, String> = [(1, "hidden".to_owned())].into();
    eventually("visible, then published", async || nodes.hold(&want).await).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

const PARTS: Table<i64, String> = Table::new("parts");

/// A partitioned table is mapped by its own name: its partitions' changes
/// are published as the root's. And two relay groups on separate slots
/// (each with its own publication, by default) follow their own tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_tables_and_two_relay_groups() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    exec(
        &pool,
        "CREATE TABLE parts (id bigint PRIMARY KEY, name text NOT NULL) PARTITION BY RANGE (id);
         CREATE TABLE parts_a PARTITION OF parts FOR VALUES FROM (0) TO (100);
         CREATE TABLE parts_b PARTITION OF parts FOR VALUES FROM (100) TO (200);",
    )
    .await;
    let transport = EmbeddedTransport::new();
    let nodes = nodes(&transport, 1).await;
    let parts = SyncedCache::new(PARTS, moka::future::Cache::new(100));
    let node = Node::builder("p", transport.clone())
        .register(&parts)
        .start()
        .await
        .unwrap();
    let items_relay = relay(&pg, &transport).start().await.unwrap();
    let parts_relay = CdcRelay::builder(pg.url(), Publisher::new(transport.clone()))
        .slot("parts")
        .table(CdcTable::new(PARTS, "parts", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    exec(
        &pool,
        "INSERT INTO parts VALUES (1, 'one'), (150, 'one fifty')",
    )
    .await;
    insert(&pool, 0..3, "a").await;
    eventually("both groups' rows arrive", async || {
        parts.peek(&1).await.as_deref() == Some("one")
            && parts.peek(&150).await.as_deref() == Some("one fifty")
            && nodes.hold(&named(0..3, "a")).await
    })
    .await;
    exec(&pool, "TRUNCATE parts").await;
    eventually("the truncate of the root clears", async || {
        parts.peek(&1).await.is_none() && parts.peek(&150).await.is_none()
    })
    .await;
    items_relay.shutdown().await;
    parts_relay.shutdown().await;
    node.shutdown().await.unwrap();
    nodes.shutdown().await;
}

/// A row change over `max_row_bytes` cannot be read and the stream cannot
/// go past it: its transaction is skipped, with a clear of the cache in its
/// place, and what follows flows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_max_row_bytes_is_skipped_and_the_cache_cleared() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport)
        .max_row_bytes(64 << 10)
        .start()
        .await
        .unwrap();
    insert(&pool, 0..10, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..10, "a")).await).await;
    // 200 kB of text: compressed on disk, sent whole.
    exec(
        &pool,
        "BEGIN; UPDATE items SET name = 'x' WHERE id = 2; \
         INSERT INTO items VALUES (100, 'big', repeat('x', 200000)); COMMIT",
    )
    .await;
    exec(&pool, "UPDATE items SET name = 'after' WHERE id = 1").await;
    let want: BTreeMap<i64, String> = [(1, "after".to_owned())].into();
    eventually("changes after it flow", async || nodes.hold(&want).await).await;
    for cache in &nodes.caches {
        assert_eq!(
            cache.peek(&0).await,
            None,
            "cleared in the skipped one's place"
        );
    }
    nodes.agree(&pool).await;
    assert_eq!(relay.stats().skipped, 1, "{:?}", relay.stats());

    // A huge logical message outside any transaction, which any role can
    // write: the slot is made again, every cache resynced.
    insert(&pool, 10..12, "b").await;
    eventually("rows arrive", async || {
        nodes.hold(&named(10..12, "b")).await
    })
    .await;
    first_resync(&relay).await;
    let resyncs = relay.stats().resyncs;
    exec(
        &pool,
        "SELECT pg_logical_emit_message(false, 'someone', repeat('x', 200000))",
    )
    .await;
    let want: BTreeMap<i64, String> = [(3, "later".to_owned())].into();
    eventually("changes flow again", async || {
        exec(&pool, "UPDATE items SET name = 'later' WHERE id = 3").await;
        nodes.hold(&want).await
    })
    .await;
    assert_eq!(relay.stats().skipped, 2, "{:?}", relay.stats());
    // The resync message follows the table's addition to the
    // publication: changes after the addition may arrive first.
    eventually("the caches were resynced", async || {
        relay.stats().resyncs > resyncs
    })
    .await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Committed work does not wait for the next transaction to arrive whole:
/// a small change committed just before a large one is published while
/// the large one still streams in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_commit_is_not_held_up_by_a_large_one_after_it() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    insert(&pool, 0..200_000, "a").await;
    let transport = EmbeddedTransport::new();
    let nodes = nodes(&transport, 1).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    relay.shutdown().await;
    // The large one writes first and commits right after the small one,
    // both while no relay runs: the server then sends the small one, and
    // at once the large one, decoded already, back to back.
    let mut large = pool.begin().await.unwrap();
    sqlx::query("UPDATE items SET name = 'large' || id WHERE id > 0")
        .execute(&mut *large)
        .await
        .unwrap();
    exec(&pool, "UPDATE items SET name = 'small' WHERE id = 0").await;
    large.commit().await.unwrap();
    let relay = self::relay(&pg, &transport).start().await.unwrap();
    let base = 0;
    let mut seen = Vec::new();
    eventually("the small one is published on its own", async || {
        let t = relay.stats().transactions;
        seen.push(t);
        t == base + 1 && nodes.caches[0].peek(&0).await.as_deref() == Some("small")
    })
    .await;
    eventually("then the large one", async || {
        relay.stats().transactions == base + 2
    })
    .await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

const DOCS: Table<i64, String> = Table::new("docs");

/// The value reads a TOASTed column: an UPDATE that leaves it unchanged
/// does not send it, and the change becomes an invalidation, never a value
/// built from part of the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_toasted_column_makes_an_invalidation() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    exec(
        &pool,
        "CREATE TABLE docs (id bigint PRIMARY KEY, title text NOT NULL, body text NOT NULL);
         ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL",
    )
    .await;
    let transport = EmbeddedTransport::new();
    let cache = SyncedCache::new(DOCS, moka::future::Cache::new(100));
    let node = Node::builder("n", transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    let relay = CdcRelay::builder(pg.url(), Publisher::new(transport.clone()))
        .table(
            CdcTable::new(DOCS, "docs", |row| row.parse("id"))
                .value(|row| Some(format!("{}:{}", row.get("title")?, row.get("body")?.len()))),
        )
        .start()
        .await
        .unwrap();
    // 100 kB, stored out of line (EXTERNAL: not compressed).
    exec(
        &pool,
        "INSERT INTO docs VALUES (1, 't1', repeat('x', 100000))",
    )
    .await;
    eventually("the row arrives", async || {
        cache.peek(&1).await.as_deref() == Some("t1:100000")
    })
    .await;
    exec(&pool, "UPDATE docs SET title = 't2' WHERE id = 1").await;
    eventually("the key is dropped", async || {
        cache.peek(&1).await.is_none()
    })
    .await;
    // Loaded again, the value is whole.
    exec(
        &pool,
        "UPDATE docs SET title = 't3', body = repeat('y', 5) WHERE id = 1",
    )
    .await;
    eventually("a full row refreshes again", async || {
        cache.peek(&1).await.as_deref() == Some("t3:5")
    })
    .await;
    // With REPLICA IDENTITY FULL the old row carries the unchanged value.
    exec(&pool, "ALTER TABLE docs REPLICA IDENTITY FULL").await;
    exec(
        &pool,
        "UPDATE docs SET title = 't4', body = repeat('z', 100000) WHERE id = 1",
    )
    .await;
    eventually("the big row arrives", async || {
        cache.peek(&1).await.as_deref() == Some("t4:100000")
    })
    .await;
    exec(&pool, "UPDATE docs SET title = 't5' WHERE id = 1").await;
    eventually("the unchanged value is read from the old row", async || {
        cache.peek(&1).await.as_deref() == Some("t5:100000")
    })
    .await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
}

const EXTRA: Table<i64, String> = Table::new("extra");

/// Columns are read by name from the table's latest shape: a column added
/// is read from the next change on; a dropped one makes changes
/// invalidations; a renamed table's cache is cleared and no longer
/// followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_changes_never_cache_a_wrong_value() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    let transport = EmbeddedTransport::new();
    let extra = SyncedCache::new(EXTRA, moka::future::Cache::new(100));
    let nodes = nodes(&transport, 1).await;
    let node = Node::builder("x", transport.clone())
        .register(&extra)
        .start()
        .await
        .unwrap();
    let relay = relay(&pg, &transport)
        .table(CdcTable::new(EXTRA, "items", |row| row.parse("id")).value(|row| row.parse("note")))
        .start()
        .await
        .unwrap();
    insert(&pool, 0..3, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..3, "a")).await).await;
    assert_eq!(extra.peek(&0).await, None, "no column note yet");

    exec(&pool, "ALTER TABLE items ADD COLUMN note text").await;
    exec(
        &pool,
        "UPDATE items SET note = 'n' || id, name = 'b' || id WHERE id = 0",
    )
    .await;
    eventually("the added column is read", async || {
        extra.peek(&0).await.as_deref() == Some("n0")
    })
    .await;
    eventually("and the old one still", async || {
        nodes.hold(&named(0..1, "b")).await
    })
    .await;

    exec(&pool, "ALTER TABLE items DROP COLUMN note").await;
    exec(&pool, "UPDATE items SET name = 'c' || id WHERE id = 0").await;
    eventually("a dropped column's cache is invalidated", async || {
        extra.peek(&0).await.is_none() && nodes.hold(&named(0..1, "c")).await
    })
    .await;

    exec(&pool, "ALTER TABLE items RENAME TO things").await;
    exec(&pool, "UPDATE things SET name = 'd' || id WHERE id = 1").await;
    eventually("a renamed table's cache is cleared", async || {
        nodes.caches[0].iter().count() == 0
    })
    .await;
    exec(&pool, "UPDATE things SET name = 'e' || id WHERE id = 2").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(nodes.caches[0].peek(&2).await, None, "no longer followed");
    // The check found the mapped name without its table: a resync of it
    // (after the new slot's).
    eventually("the renamed table's resync", async || {
        relay.stats().resyncs >= 2
    })
    .await;
    // A new table under the mapped name: added to the publication, every
    // cache resynced, and its changes followed.
    let resyncs = relay.stats().resyncs;
    create_items(&pool).await;
    insert(&pool, 7..8, "new").await;
    eventually("the new table is followed", async || {
        exec(&pool, "UPDATE items SET name = 'new' || id").await;
        nodes.hold(&named(7..8, "new")).await
    })
    .await;
    // The resync message follows the table's addition to the
    // publication: changes after the addition may arrive first.
    eventually("the caches were resynced", async || {
        relay.stats().resyncs > resyncs
    })
    .await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    nodes.shutdown().await;
}

const BY_CODE: Table<String, i64> = Table::new("by_code");

/// A key outside the replica identity cannot be read from a DELETE's old
/// row: the cache is cleared instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_outside_the_replica_identity_clears_on_delete() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    exec(
        &pool,
        "CREATE TABLE codes (id bigint PRIMARY KEY, code text UNIQUE NOT NULL)",
    )
    .await;
    let transport = EmbeddedTransport::new();
    let cache = SyncedCache::new(BY_CODE, moka::future::Cache::new(100));
    let node = Node::builder("n", transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    let relay = CdcRelay::builder(pg.url(), Publisher::new(transport.clone()))
        .table(
            CdcTable::new(BY_CODE, "codes", |row| row.get("code").map(str::to_owned))
                .value(|row| row.parse("id")),
        )
        .start()
        .await
        .unwrap();
    exec(&pool, "INSERT INTO codes VALUES (1, 'de'), (2, 'at')").await;
    eventually("rows arrive", async || {
        cache.peek("de").await == Some(1) && cache.peek("at").await == Some(2)
    })
    .await;
    // The key changed without the identity changing: PostgreSQL sends no
    // old row, so the old key is unknown.
    exec(&pool, "UPDATE codes SET code = 'ch' WHERE id = 1").await;
    eventually("the cache is cleared", async || {
        cache.peek("de").await.is_none() && cache.peek("at").await.is_none()
    })
    .await;
    exec(&pool, "INSERT INTO codes VALUES (3, 'fr')").await;
    eventually("later rows arrive", async || {
        cache.peek("fr").await == Some(3)
    })
    .await;
    exec(&pool, "DELETE FROM codes WHERE id = 3").await;
    eventually("a delete clears", async || cache.peek("fr").await.is_none()).await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
}

/// Versioned loads racing the writes: each node drops keys at random and
/// loads them again with `get_with_versioned`, at the version the cache
/// had applied before the read (as `CdcRelay`'s docs say). Once the writes
/// stop, no node holds a stale row: no load's version hid a change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versioned_loads_at_the_applied_version_never_cache_a_stale_row() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    let (stop, task) = writer(pool.clone(), 20);
    let (stop_loads, loads_stopped) = tokio::sync::watch::channel(false);
    let mut loaders = Vec::new();
    for (n, cache) in nodes.caches.iter().enumerate() {
        for t in 0..2u64 {
            let (cache, pool, stopped) = (cache.clone(), pool.clone(), loads_stopped.clone());
            loaders.push(tokio::spawn(async move {
                let mut i = (n as u64) * 7 + t * 13;
                let mut loads = 0u64;
                while !*stopped.borrow() {
                    i = i
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let id = i64::try_from((i >> 33) % 20).unwrap();
                    cache.invalidate(&id).await;
                    let (c, p) = (cache.clone(), pool.clone());
                    cache
                        .get_with_versioned(id, move || {
                            let (c, p) = (c.clone(), p.clone());
                            async move {
                                let version = c.version().unwrap_or(0);
                                let name: String =
                                    sqlx::query_scalar("SELECT name FROM items WHERE id = $1")
                                        .bind(id)
                                        .fetch_one(&p)
                                        .await
                                        .unwrap();
                                (name, version)
                            }
                        })
                        .await;
                    loads += 1;
                }
                loads
            }));
        }
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_loads.send(true).unwrap();
    let mut loads = 0;
    for l in loaders {
        loads += l.await.unwrap();
    }
    stop.send(true).unwrap();
    let writes = task.await.unwrap();
    assert!(
        loads > 100 && writes > 100,
        "{loads} loads, {writes} writes"
    );
    exec(&pool, "INSERT INTO items VALUES (-1, 'last', NULL)").await;
    let want: BTreeMap<i64, String> = [(-1, "last".to_owned())].into();
    eventually("the last row arrives", async || nodes.hold(&want).await).await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// After the faults: one more update of every row reaches every node.
/// (Not before: a replayed resync may have cleared rows the writer did
/// not touch again, which is no harm.)
/// The relay's walsender terminated (`pg_terminate_backend`) again and
/// again mid-stream: it reconnects from the confirmed position each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_connection_loses_nothing() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..50, "a").await;
    let (stop, task) = writer(pool.clone(), 50);
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        exec(
            &pool,
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active_pid IS NOT NULL",
        )
        .await;
    }
    stop.send(true).unwrap();
    assert!(task.await.unwrap() > 50);
    exec(&pool, "INSERT INTO items VALUES (-1, 'last', NULL)").await;
    let want: BTreeMap<i64, String> = [(-1, "last".to_owned())].into();
    eventually("the last row arrives", async || nodes.hold(&want).await).await;
    nodes.agree(&pool).await;
    flows_again(&pool, &nodes).await;
    assert!(relay.stats().failures >= 1, "{:?}", relay.stats());
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// The server killed mid-stream and restarted; then stopped for longer
/// than the relay's timeouts and started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_killed_or_stopped_loses_nothing() {
    let (mut pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..50, "a").await;
    let (stop, task) = writer(pool.clone(), 50);
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| pg.restart());
    tokio::time::sleep(Duration::from_millis(500)).await;
    tokio::task::block_in_place(|| pg.stop());
    // Past the relay's 10 s statement timeout and its backoff's ceiling.
    tokio::time::sleep(Duration::from_secs(12)).await;
    tokio::task::block_in_place(|| pg.restart());
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(true).unwrap();
    task.await.unwrap();
    exec(&pool, "INSERT INTO items VALUES (-1, 'last', NULL)").await;
    let want: BTreeMap<i64, String> = [(-1, "last".to_owned())].into();
    eventually("the last row arrives", async || nodes.hold(&want).await).await;
    nodes.agree(&pool).await;
    flows_again(&pool, &nodes).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// An operator drops the slot (terminating its session first): changes
/// made while there was none are lost to the stream, so the relay creates
/// the slot again and every node clears the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_detected_recreated_and_resynced() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    // The relay takes the slot again within 100 ms: drop it in one
    // statement with the termination, until the drop wins.
    let mut dropped = false;
    for _ in 0..200 {
        let r = sqlx::raw_sql(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active_pid IS NOT NULL;
             SELECT pg_sleep(0.05);
             SELECT pg_drop_replication_slot('cache_sync');",
        )
        .execute(&pool)
        .await;
        if r.is_ok() {
            dropped = true;
            break;
        }
    }
    assert!(dropped, "the slot could not be dropped");
    // While the slot is gone (or new): this change is not in any stream.
    exec(&pool, "UPDATE items SET name = 'lost' || id WHERE id < 10").await;
    eventually("the relay resynced", async || relay.stats().resyncs >= 2).await;
    nodes.agree(&pool).await;
    exec(&pool, "UPDATE items SET name = 'after' || id WHERE id = 15").await;
    let want: BTreeMap<i64, String> = [(15, "after15".to_owned())].into();
    eventually("changes flow again", async || nodes.hold(&want).await).await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// A resync is recorded as owed (in the relays' record, the comment on
/// the publication) before what makes it owed, and cleared with the
/// message that settles it: a relay that died in between (here: the debt
/// written by hand) leaves it to whichever relay looks next, which settles
/// it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owed_resync_is_settled_by_the_next_relay_that_looks() {
    let (pg, pool, transport, nodes) = items_fixture(1).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..5, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..5, "a")).await).await;
    assert_eq!(
        owed(&pool, "cache_sync").await,
        0,
        "the first slot's debt was settled"
    );
    first_resync(&relay).await;
    let resyncs = relay.stats().resyncs;
    let mut record = record(&pool, "cache_sync").await;
    record["slots"]["cache_sync"]["owed"] = serde_json::json!([{"token": 7, "tables": null}]);
    set_record(&pool, "cache_sync", &record).await;
    eventually("the debt is settled", async || {
        relay.stats().resyncs == resyncs + 1 && owed(&pool, "cache_sync").await == 0
    })
    .await;
    eventually("every node was cleared", async || {
        nodes.caches[0].peek(&0).await.is_none()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(relay.stats().resyncs, resyncs + 1, "settled once");
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Two relays on one slot: one streams, the other stands by, and takes
/// over when the first stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_takes_over() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let a = relay(&pg, &transport).start().await.unwrap();
    eventually("A streams", async || a.stats().active).await;
    let b = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(a.stats().active && !b.stats().active);
    a.shutdown().await;
    eventually("B takes over", async || b.stats().active).await;
    assert_eq!(b.stats().takeovers, 1);
    exec(&pool, "UPDATE items SET name = 'b' || id").await;
    eventually("B publishes", async || nodes.hold(&named(0..20, "b")).await).await;
    b.shutdown().await;
    nodes.shutdown().await;
}

const ODD: Table<String, String> = Table::new("odd \u{e9}.*>: names");

/// Names as PostgreSQL allows them: a table with dots, spaces, quotes,
/// `*`, `>`, `:` and unicode in its name, quoted where the relay writes
/// SQL, matched as stored; and a cache name like it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_are_quoted_and_matched() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    let table = "t.a b\"c*>:\u{fc}";
    exec(
        &pool,
        &format!(
            "CREATE TABLE public.\"{}\" (k text PRIMARY KEY, v text)",
            table.replace('"', "\"\"")
        ),
    )
    .await;
    let transport = EmbeddedTransport::new();
    let cache = SyncedCache::new(ODD, moka::future::Cache::new(10));
    let node = Node::builder("n", transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    let relay = CdcRelay::builder(pg.url(), Publisher::new(transport.clone()))
        .publication("pub_x_9")
        .slot("s_1")
        .table(
            CdcTable::new(ODD, &format!("public.{table}"), |row| {
                row.get("k").map(str::to_owned)
            })
            .value(|row| row.get("v").map(str::to_owned)),
        )
        .start()
        .await
        .unwrap();
    sqlx::query(&format!(
        "INSERT INTO public.\"{}\" VALUES ($1, $2)",
        table.replace('"', "\"\"")
    ))
    .bind("k \u{1f600}")
    .bind("v\"'\\")
    .execute(&pool)
    .await
    .unwrap();
    eventually("the row arrives", async || {
        cache.peek("k \u{1f600}").await.as_deref() == Some("v\"'\\")
    })
    .await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
}

/// Start, shut down, shut down again, drop without shutting down, start
/// again on the same slot, in turn: each relay after the first finds the
/// slot free (none stays a standby of one that is gone), and nothing is
/// lost in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_started_stopped_and_dropped_in_turn_lose_nothing() {
    let (pg, pool, transport, nodes) = items_fixture(1).await;
    insert(&pool, 0..5, "a").await;
    for round in 0..4 {
        let relay = relay(&pg, &transport).start().await.unwrap();
        // The last one's walsender may hold the slot for a moment after
        // its connection closed: this one stands by until it is free.
        eventually("the relay streams", async || relay.stats().active).await;
        let name = format!("r{round}-");
        exec(&pool, &format!("UPDATE items SET name = '{name}' || id")).await;
        eventually("the round's rows arrive", async || {
            nodes.hold(&named(0..5, &name)).await
        })
        .await;
        // Written while no relay runs: the next one publishes it.
        match round % 2 {
            0 => {
                relay.shutdown().await;
                relay.shutdown().await;
            }
            _ => drop(relay),
        }
        exec(
            &pool,
            "UPDATE items SET name = 'between' || id WHERE id = 0",
        )
        .await;
    }
    let relay = relay(&pg, &transport).start().await.unwrap();
    let want: BTreeMap<i64, String> = [(0, "between0".to_owned())].into();
    eventually("the last change made between relays arrives", async || {
        nodes.hold(&want).await
    })
    .await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

#[tokio::test]
async fn settings_out_of_range_are_refused() {
    let t = EmbeddedTransport::new();
    let url = "postgres://postgres@127.0.0.1:1/none";
    let table = || CdcTable::new(ITEMS, "items", |row| row.parse("id"));
    for builder in [
        CdcRelay::builder(url, Publisher::new(t.clone())),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot(""),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot("Upper"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot("x".repeat(64)),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .slot("a.b"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication(""),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("a b"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("a\"b"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("\u{e9}"),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .publication("x".repeat(64)),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .max_rows_per_transaction(0),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .lag_interval(Duration::ZERO),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .lag_interval(Duration::MAX),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .standby_retry(Duration::ZERO),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .standby_retry(Duration::MAX),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .max_row_bytes(1023),
        CdcRelay::builder(url, Publisher::new(t.clone()))
            .table(table())
            .max_row_bytes(usize::MAX),
        CdcRelay::builder("mysql://x", Publisher::new(t.clone())).table(table()),
        CdcRelay::builder("postgres://h/db?sslmode=bogus", Publisher::new(t.clone()))
            .table(table()),
        CdcRelay::builder(url, Publisher::new(t.clone())).table(CdcTable::new(
            Table::<i64, String>::new("a\u{0}b"),
            "items",
            |r| r.parse("id"),
        )),
        CdcRelay::builder(url, Publisher::new(t.clone())).table(CdcTable::new(
            Table::<i64, String>::with_topic("items", "elsewhere"),
            "items",
            |r| r.parse("id"),
        )),
    ] {
        let err = builder.start().await.unwrap_err();
        assert!(err.is_config(), "{err}");
    }
    // A database that cannot be reached is a database error.
    let err = CdcRelay::builder(url, Publisher::new(t.clone()))
        .table(table())
        .start()
        .await
        .unwrap_err();
    assert!(err.is_database(), "{err}");
}

#[cfg(feature = "redis")]
mod processes {
    use super::*;
    use cache_sync::transport::RedisStreamsTransport;
    use integration_tests::redis_server::RedisServer;
    use std::process::{Child, Command, Stdio};

    struct RelayProcess(Child);

    impl Drop for RelayProcess {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn relay_process(pg: &PostgresServer, redis: &str) -> RelayProcess {
        RelayProcess(
            Command::new(env!("CARGO_BIN_EXE_cdc_relay"))
                .args([&pg.url(), redis, "cache-sync", "cache_sync"])
                .stdout(Stdio::null())
                .spawn()
                .expect("start the relay binary"),
        )
    }

    async fn slot_pid(pool: &PgPool) -> Option<i32> {
        sqlx::query_scalar(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'cache_sync'",
        )
        .fetch_optional(pool)
        .await
        .unwrap()
        .flatten()
    }

    /// `kill -9` of the active relay process, mid-stream and right after a
    /// 5,000-row transaction committed (mid-transaction for the stream),
    /// with a standby process running: it takes over, and every node
    /// agrees with the database.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_relay_killed_mid_stream_and_mid_transaction_loses_nothing() {
        let pg = PostgresServer::start();
        let pool = pool(&pg).await;
        create_items(&pool).await;
        let redis = RedisServer::start();
        let mut caches = Vec::new();
        let mut nodes = Vec::new();
        for i in 0..2 {
            let cache = SyncedCache::new(ITEMS, moka::future::Cache::new(100_000));
            let t = RedisStreamsTransport::connect(redis.url().as_str())
                .await
                .unwrap();
            nodes.push(
                Node::builder(format!("n{i}"), t)
                    .register(&cache)
                    .start()
                    .await
                    .unwrap(),
            );
            caches.push(cache);
        }
        let nodes = Nodes { nodes, caches };
        insert(&pool, 0..5000, "a").await;
        let mut active = relay_process(&pg, &redis.url());
        eventually("a relay streams", async || slot_pid(&pool).await.is_some()).await;
        let mut standby = relay_process(&pg, &redis.url());
        let (stop, task) = writer(pool.clone(), 5000);
        for round in 0..4 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            if round % 2 == 1 {
                exec(
                    &pool,
                    "UPDATE items SET name = 'bulk' || id || 'r' || random()",
                )
                .await;
            }
            let before = slot_pid(&pool).await;
            let _ = active.0.kill();
            let _ = active.0.wait();
            // The standby takes the slot once the server saw the session end.
            eventually("the standby takes over", async || {
                let now = slot_pid(&pool).await;
                now.is_some() && now != before
            })
            .await;
            std::mem::swap(&mut active, &mut standby);
            standby = relay_process(&pg, &redis.url());
        }
        stop.send(true).unwrap();
        task.await.unwrap();
        exec(&pool, "INSERT INTO items VALUES (-1, 'last', NULL)").await;
        let want: BTreeMap<i64, String> = [(-1, "last".to_owned())].into();
        eventually("the last row arrives", async || nodes.hold(&want).await).await;
        nodes.agree(&pool).await;
        flows_again(&pool, &nodes).await;
        drop(standby);
        drop(active);
        nodes.shutdown().await;
    }

    /// The relay process paused (SIGSTOP) while the server writes far more
    /// WAL than `max_slot_wal_keep_size`: a checkpoint invalidates the slot
    /// (terminating its walsender). Resumed, the relay finds the slot lost,
    /// creates it again and resyncs every node; changes flow again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slot_the_server_invalidated_is_recreated_and_resynced() {
        let pg = PostgresServer::start_with(
            &["--wal-segsize=1"],
            &[
                "max_slot_wal_keep_size=2MB",
                "min_wal_size=2MB",
                "max_wal_size=4MB",
            ],
        );
        let pool = pool(&pg).await;
        create_items(&pool).await;
        exec(&pool, "CREATE TABLE filler (x text)").await;
        let redis = RedisServer::start();
        let cache = SyncedCache::new(ITEMS, moka::future::Cache::new(1000));
        let t = RedisStreamsTransport::connect(redis.url().as_str())
            .await
            .unwrap();
        let node = Node::builder("n", t)
            .register(&cache)
            .start()
            .await
            .unwrap();
        let nodes = Nodes {
            nodes: vec![node],
            caches: vec![cache],
        };
        let relay = relay_process(&pg, &redis.url());
        // Written again until they arrive: the slot is active while it is
        // being created, and rows written before its resync message are
        // cleared by it.
        insert(&pool, 0..10, "a").await;
        eventually("rows arrive", async || {
            exec(&pool, "UPDATE items SET name = 'a' || id").await;
            nodes.hold(&named(0..10, "a")).await
        })
        .await;
        integration_tests::redis_server::signal("-STOP", relay.0.id());
        // Changed while the relay sleeps; lost with the slot.
        exec(&pool, "UPDATE items SET name = 'lost' || id WHERE id < 5").await;
        for _ in 0..10 {
            exec(
                &pool,
                "INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 1000); \
                 SELECT pg_switch_wal(); CHECKPOINT;",
            )
            .await;
        }
        let status: String = sqlx::query_scalar(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'cache_sync'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(status, "lost", "the slot was not invalidated");
        integration_tests::redis_server::signal("-CONT", relay.0.id());
        eventually("the slot is streamed again", async || {
            let s: Option<(Option<String>, Option<i32>)> = sqlx::query_as(
                "SELECT wal_status, active_pid FROM pg_replication_slots WHERE slot_name = 'cache_sync'",
            )
            .fetch_optional(&pool)
            .await
            .unwrap();
            matches!(s, Some((Some(w), Some(_))) if w != "lost")
        })
        .await;
        nodes.agree(&pool).await;
        flows_again(&pool, &nodes).await;
        drop(relay);
        nodes.shutdown().await;
    }
}
