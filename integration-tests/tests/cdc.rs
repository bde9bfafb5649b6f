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

#[path = "cdc/backpressure.rs"]
mod backpressure;
#[path = "cdc/faults.rs"]
mod faults;
#[path = "cdc/freshness.rs"]
mod freshness;
#[path = "cdc/settings.rs"]
mod settings;
#[path = "cdc/tables.rs"]
mod tables;
#[path = "cdc/transactions.rs"]
mod transactions;

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
