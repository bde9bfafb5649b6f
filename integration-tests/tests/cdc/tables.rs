//! What tables look like: partitioned ones, TOASTed columns, schema changes,
//! keys outside the replica identity, hostile names.

use super::*;

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
