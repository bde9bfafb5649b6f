//! Transactions past the relay's caps: a huge one reaches nodes as a clear, a
//! row over `max_row_bytes` clears its cache, and a small commit is not held
//! up behind a large one.

use super::*;

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
