//! The CDC relay against what an operator, a DBA or an object made
//! beforehand does to what it depends on: the publication (dropped,
//! altered, replaced, pre-created with other settings), the mapped tables
//! (a partition truncated, detached, attached or dropped; the table
//! dropped; no replica identity), the slot (read by another client), the
//! relay's role (`REPLICATION`, `SELECT`, `EXECUTE` on its marks' function
//! revoked) and the server
//! (`wal_level` lowered). Each ends in a correct stream, a resync, or a
//! clear refusal: never a stall nor a stale node. Also the relay's own
//! seams (issue 35): an oversized value, two relays starting at once, a
//! graceful handover, a server crash after a resync.
#![cfg(feature = "postgres-cdc")]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table,
    cdc::{CdcRelay, CdcRelayBuilder, CdcTable},
    transport::EmbeddedTransport,
};
use integration_tests::cdc::*;
use integration_tests::eventually;
use integration_tests::postgres_server::PostgresServer;
use sqlx::PgPool;

/// The partitioned table's cache: `None` caches a missing row, so that a
/// row that appears without a row change (a partition attached) would
/// show as stale.
const PARTS: Table<i64, Option<String>> = Table::new("parts");

async fn create_parts(pool: &PgPool) {
    exec(
        pool,
        "CREATE TABLE parts (id bigint PRIMARY KEY, name text NOT NULL) PARTITION BY RANGE (id);
         CREATE TABLE parts_a PARTITION OF parts FOR VALUES FROM (0) TO (100);
         CREATE TABLE parts_b PARTITION OF parts FOR VALUES FROM (100) TO (200);
         INSERT INTO parts SELECT g, 'a' || g FROM generate_series(0, 9) g;
         INSERT INTO parts SELECT g, 'b' || g FROM generate_series(100, 109) g;",
    )
    .await;
}

fn parts_relay(pg: &PostgresServer, transport: &EmbeddedTransport) -> CdcRelayBuilder {
    CdcRelay::builder(pg.url(), Publisher::new(transport.clone()))
        .slot("parts")
        .standby_retry(Duration::from_millis(50))
        .lag_interval(Duration::from_millis(200))
        .table(
            CdcTable::new(PARTS, "parts", |row| row.parse("id"))
                .value(|row| Some(row.parse::<String>("name"))),
        )
}

/// A node caching `parts` through reads of the database (absent rows as
/// `None`).
struct PartsNode {
    node: Node,
    cache: SyncedCache<i64, Option<String>>,
    pool: PgPool,
}

impl PartsNode {
    async fn start(transport: &EmbeddedTransport, pool: &PgPool) -> Self {
        let cache = SyncedCache::new(PARTS, moka::future::Cache::new(10_000));
        let node = Node::builder("p", transport.clone())
            .register(&cache)
            .start()
            .await
            .unwrap();
        PartsNode {
            node,
            cache,
            pool: pool.clone(),
        }
    }

    /// Reads `id` through the cache, loading it on a miss.
    async fn read(&self, id: i64) -> Option<String> {
        self.cache
            .get_with(id, || {
                let pool = self.pool.clone();
                async move {
                    sqlx::query_scalar("SELECT name FROM parts WHERE id = $1")
                        .bind(id)
                        .fetch_optional(&pool)
                        .await
                        .unwrap()
                }
            })
            .await
    }

    /// Every key the node holds has the database's value (`None`: no row).
    async fn agrees(&self) -> Result<(), String> {
        let db: BTreeMap<i64, String> = sqlx::query_as("SELECT id, name FROM parts")
            .fetch_all(&self.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
        for (k, v) in self.cache.iter() {
            if db.get(&*k) != v.as_ref() {
                return Err(format!(
                    "holds {k} = {v:?}; the database has {:?}",
                    db.get(&*k)
                ));
            }
        }
        Ok(())
    }

    async fn converges(&self) {
        let mut last = String::new();
        let done = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match self.agrees().await {
                    Ok(()) => return,
                    Err(e) => last = e,
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            done.is_ok(),
            "the node does not agree with the database: {last}"
        );
    }
}

/// Issue 35, item 1: with `publish_via_partition_root` on, PostgreSQL
/// sends nothing for a `TRUNCATE` of one partition, and its rows stayed
/// cached for good. Partitions' changes now come under their own names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncating_one_partition_reaches_every_node() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_parts(&pool).await;
    let transport = EmbeddedTransport::new();
    let node = PartsNode::start(&transport, &pool).await;
    let relay = parts_relay(&pg, &transport).start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    for id in (0..10).chain(100..110) {
        node.read(id).await;
    }
    exec(
        &pool,
        "UPDATE parts SET name = name || '!' WHERE id IN (1, 101)",
    )
    .await;
    eventually("the updates arrive", async || {
        node.cache.peek(&1).await == Some(Some("a1!".into()))
            && node.cache.peek(&101).await == Some(Some("b101!".into()))
    })
    .await;
    exec(&pool, "TRUNCATE parts_a").await;
    eventually("the partition's rows leave the node", async || {
        node.cache.peek(&1).await.is_none() && node.cache.peek(&5).await.is_none()
    })
    .await;
    node.converges().await;
    // And rows written after it flow as before.
    exec(&pool, "INSERT INTO parts VALUES (1, 'again')").await;
    eventually("a row after the truncate arrives", async || {
        node.cache.peek(&1).await == Some(Some("again".into()))
    })
    .await;
    node.converges().await;
    relay.shutdown().await;
    node.node.shutdown().await.unwrap();
}

/// Issue 35, item 2: `DETACH PARTITION` and `DROP TABLE` of a partition
/// take rows out of the mapped table, and `ATTACH PARTITION` puts rows
/// in, with no row change in the log. The relay's check sees the table's
/// partitions change, and resyncs its cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detaching_attaching_or_dropping_a_partition_resyncs_its_table() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_parts(&pool).await;
    exec(
        &pool,
        "CREATE TABLE parts_c (id bigint PRIMARY KEY, name text NOT NULL);
         INSERT INTO parts_c VALUES (250, 'c250');",
    )
    .await;
    let transport = EmbeddedTransport::new();
    let node = PartsNode::start(&transport, &pool).await;
    let relay = parts_relay(&pg, &transport).start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    let fill = async || {
        for id in (0..10).chain(100..110).chain([250]) {
            node.read(id).await;
        }
    };
    fill().await;
    assert_eq!(node.cache.peek(&250).await, Some(None), "no row 250 yet");
    first_resync(&relay).await;
    let resyncs = relay.stats().resyncs;

    exec(
        &pool,
        "ALTER TABLE parts ATTACH PARTITION parts_c FOR VALUES FROM (200) TO (300)",
    )
    .await;
    eventually(
        "the attached row is no longer cached as missing",
        async || node.cache.peek(&250).await.is_none(),
    )
    .await;
    node.converges().await;
    fill().await;
    assert_eq!(node.read(250).await.as_deref(), Some("c250"));

    exec(&pool, "ALTER TABLE parts DETACH PARTITION parts_a").await;
    eventually("the detached rows leave the node", async || {
        node.cache.peek(&1).await.is_none()
    })
    .await;
    node.converges().await;
    fill().await;

    exec(&pool, "DROP TABLE parts_b").await;
    eventually("the dropped partition's rows leave the node", async || {
        node.cache.peek(&101).await.is_none()
    })
    .await;
    node.converges().await;
    // Counted once published and recorded as applied: a node can have
    // applied the last one a moment before.
    eventually("three resyncs counted", async || {
        relay.stats().resyncs >= resyncs + 3
    })
    .await;

    // Changes of the partition attached meanwhile flow as the table's.
    fill().await;
    exec(&pool, "UPDATE parts SET name = 'c!' WHERE id = 250").await;
    eventually("a change in the attached partition arrives", async || {
        node.cache.peek(&250).await == Some(Some("c!".into()))
    })
    .await;
    node.converges().await;
    relay.shutdown().await;
    node.node.shutdown().await.unwrap();
}

/// Issue 35, item 3: `DROP PUBLICATION` under a streaming relay. pgoutput
/// reads the publication as the catalog was at each change, so the slot's
/// stream fails for good past the drop; the relay creates the
/// publication again and a new slot, with a resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_publication_ends_in_a_new_slot_and_a_resync() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..50, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..50, "a")).await).await;
    first_resync(&relay).await;
    let resyncs = relay.stats().resyncs;
    let (stop, task) = writer(pool.clone(), 50);
    tokio::time::sleep(Duration::from_millis(300)).await;
    exec(&pool, "DROP PUBLICATION cache_sync").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.send(true).unwrap();
    task.await.unwrap();
    exec(&pool, "DELETE FROM items WHERE id < 5").await;
    eventually("the relay resynced", async || {
        relay.stats().resyncs > resyncs
    })
    .await;
    nodes.agree(&pool).await;
    flows_again(&pool, &nodes).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// The publication replaced under the relay by one with other settings
/// (no deletes), and altered in place: `SET (publish = …)`, a row filter,
/// `SET TABLE` to another table, `DROP TABLE`, `publish_via_partition_root`.
/// Each is put back by the relay's check, with a resync of what it hid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_altered_or_replaced_is_put_back_and_resynced() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    exec(&pool, "CREATE TABLE other (id bigint PRIMARY KEY)").await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..40, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..40, "a")).await).await;
    let actions = [
        "DROP PUBLICATION cache_sync; \
         CREATE PUBLICATION cache_sync FOR TABLE items WITH (publish = 'insert, update')",
        "ALTER PUBLICATION cache_sync SET (publish = 'insert')",
        "ALTER PUBLICATION cache_sync SET TABLE items WHERE (id >= 20)",
        "ALTER PUBLICATION cache_sync SET TABLE other",
        "ALTER PUBLICATION cache_sync DROP TABLE items",
        "ALTER PUBLICATION cache_sync SET (publish_via_partition_root = true)",
    ];
    first_resync(&relay).await;
    for (round, action) in actions.iter().enumerate() {
        let resyncs = relay.stats().resyncs;
        exec(&pool, action).await;
        // Hidden from a stream on the altered publication.
        exec(&pool, &format!("DELETE FROM items WHERE id = {round}")).await;
        exec(
            &pool,
            &format!("UPDATE items SET name = 'r{round}' WHERE id BETWEEN 10 AND 15"),
        )
        .await;
        eventually(&format!("the relay answered {action:?}"), async || {
            relay.stats().resyncs > resyncs
        })
        .await;
        nodes.agree(&pool).await;
        // The publication is as the relay needs it again.
        let (publish, via_root): (String, bool) = sqlx::query_as(
            "SELECT concat_ws(',', CASE WHEN pubinsert THEN 'i' END, CASE WHEN pubupdate THEN 'u' END, \
                    CASE WHEN pubdelete THEN 'd' END, CASE WHEN pubtruncate THEN 't' END), pubviaroot \
             FROM pg_publication WHERE pubname = 'cache_sync'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (publish.as_str(), via_root),
            ("i,u,d,t", false),
            "after {action:?}"
        );
        flows_again(&pool, &nodes).await;
    }
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Issue 35, item 4: a publication that exists before the relay starts,
/// with settings that would hide changes from the stream, is refused with
/// a configuration error that names it and the setting, and is left as it
/// was; so is the slot (never created).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_created_publication_with_other_settings_is_refused_untouched() {
    let (pg, pool, transport, nodes) = items_fixture(1).await;
    exec(
        &pool,
        "CREATE TABLE parts (id bigint PRIMARY KEY, name text NOT NULL) PARTITION BY RANGE (id);",
    )
    .await;
    let cases = [
        (
            "FOR TABLE items WITH (publish = 'insert, update')",
            "delete",
        ),
        (
            "FOR TABLE items WITH (publish = 'insert, update, delete')",
            "truncate",
        ),
        ("FOR TABLE items WHERE (id > 5)", "row filter"),
        ("FOR TABLE items (id, name)", "column list"),
        (
            "FOR TABLE items WITH (publish_via_partition_root = true)",
            "publish_via_partition_root",
        ),
    ];
    for (definition, setting) in cases {
        exec(
            &pool,
            &format!("CREATE PUBLICATION cache_sync {definition}"),
        )
        .await;
        let before: String = sqlx::query_scalar(
            "SELECT row(p.*, (SELECT array_agg(row(r.*)::text) FROM pg_publication_rel r WHERE r.prpubid = p.oid))::text \
             FROM pg_publication p WHERE pubname = 'cache_sync'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let err = relay(&pg, &transport).start().await.unwrap_err();
        assert!(err.is_config(), "{definition}: {err}");
        let message = err.to_string();
        assert!(
            message.contains("cache_sync") && message.contains(setting),
            "{definition}: the error names neither the publication nor {setting:?}: {message}"
        );
        let after: String = sqlx::query_scalar(
            "SELECT row(p.*, (SELECT array_agg(row(r.*)::text) FROM pg_publication_rel r WHERE r.prpubid = p.oid))::text \
             FROM pg_publication p WHERE pubname = 'cache_sync'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(before, after, "{definition}: the publication was touched");
        let slots: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_replication_slots")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(slots, 0, "{definition}: a slot was created");
        exec(&pool, "DROP PUBLICATION cache_sync").await;
    }
    // One that is right is used as it is.
    exec(&pool, "CREATE PUBLICATION cache_sync FOR TABLE items").await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..5, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..5, "a")).await).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Issue 35, item 5: a table without a replica identity, once in a
/// publication that publishes updates and deletes, makes PostgreSQL refuse
/// every `UPDATE` and `DELETE` on it. The relay refuses to start on one
/// (or on a partitioned table with such a partition), naming the table
/// and the setting, before it touches anything; the application's writes
/// go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_a_replica_identity_is_refused_untouched() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    exec(
        &pool,
        "CREATE TABLE nokey (id bigint NOT NULL, name text);
         CREATE TABLE nothing (id bigint PRIMARY KEY, name text);
         ALTER TABLE nothing REPLICA IDENTITY NOTHING;
         CREATE TABLE tree (id bigint NOT NULL, name text) PARTITION BY RANGE (id);
         CREATE TABLE tree_a PARTITION OF tree FOR VALUES FROM (0) TO (10);
         INSERT INTO nokey VALUES (1, 'x'); INSERT INTO nothing VALUES (1, 'x');
         INSERT INTO tree VALUES (1, 'x');",
    )
    .await;
    let transport = EmbeddedTransport::new();
    for (table, says) in [
        ("nokey", "no primary key"),
        ("nothing", "REPLICA IDENTITY NOTHING"),
        ("tree", "tree_a"),
    ] {
        let err = CdcRelay::builder(pg.url(), Publisher::new(transport.clone()))
            .table(CdcTable::new(
                Table::<i64, String>::new("t"),
                table,
                |row| row.parse("id"),
            ))
            .start()
            .await
            .unwrap_err();
        assert!(err.is_config(), "{table}: {err}");
        let message = err.to_string();
        assert!(
            message.contains(table)
                && message.contains(says)
                && message.contains("replica identity"),
            "{table}: {message}"
        );
        let (publications, slots): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM pg_publication), (SELECT count(*) FROM pg_replication_slots)",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            (publications, slots),
            (0, 0),
            "{table}: something was created"
        );
        exec(
            &pool,
            &format!("UPDATE {table} SET name = 'y'; DELETE FROM {table} WHERE id = 1"),
        )
        .await;
    }
}

/// A mapped table dropped under the relay: its rows are gone, so its cache
/// is cleared (no row change says so); created again, it is followed
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_table_clears_its_cache_and_its_successor_is_followed() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    first_resync(&relay).await;
    let resyncs = relay.stats().resyncs;
    exec(&pool, "DROP TABLE items").await;
    eventually(
        "every node let go of the dropped table's rows",
        async || {
            relay.stats().resyncs > resyncs
                && nodes.caches.iter().all(|c| c.iter().next().is_none())
        },
    )
    .await;
    let resyncs = relay.stats().resyncs;
    create_items(&pool).await;
    eventually("the new table is in the publication", async || {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'cache_sync' AND tablename = 'items'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 1
    })
    .await;
    // Its resync (what it held before it was added was never streamed)
    // comes a moment after the addition: rows written in between are
    // cleared by it.
    eventually("the new table's resync", async || {
        relay.stats().resyncs > resyncs
    })
    .await;
    insert(&pool, 0..5, "b").await;
    eventually("the new table's rows arrive", async || {
        nodes.hold(&named(0..5, "b")).await
    })
    .await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// A relay connecting as a role of its own, `relay`: the owner of `items`
/// with `REPLICATION`, as an operator would set one up (standbys retry
/// every 50 ms).
async fn relay_of_its_own_role(
    pg: &PostgresServer,
    pool: &PgPool,
    transport: &EmbeddedTransport,
) -> CdcRelayBuilder {
    exec(
        pool,
        "CREATE ROLE relay LOGIN REPLICATION; ALTER TABLE items OWNER TO relay; \
         GRANT CREATE ON DATABASE postgres TO relay;",
    )
    .await;
    let url = pg.url().replace("postgres@", "relay@");
    CdcRelay::builder(url, Publisher::new(transport.clone()))
        .standby_retry(Duration::from_millis(50))
}

/// The relay's role, an owner of the table with `REPLICATION`: losing
/// `REPLICATION` stops its sessions (counted as failures, retried); given
/// back, the stream goes on from the confirmed position, nothing lost.
/// Losing `SELECT` on the table changes nothing: logical decoding does not
/// read the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_role_losing_replication_or_select() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay_of_its_own_role(&pg, &pool, &transport)
        .await
        .lag_interval(Duration::from_millis(200))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    first_resync(&relay).await;
    let resyncs = relay.stats().resyncs;

    exec(&pool, "REVOKE SELECT ON items FROM relay").await;
    exec(&pool, "UPDATE items SET name = 's' || id").await;
    eventually("changes arrive without SELECT", async || {
        nodes.hold(&named(0..20, "s")).await
    })
    .await;

    let failures = relay.stats().failures;
    exec(
        &pool,
        "ALTER ROLE relay NOREPLICATION; \
         SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active_pid IS NOT NULL;",
    )
    .await;
    exec(&pool, "UPDATE items SET name = 'n' || id WHERE id < 10").await;
    eventually(
        "the relay fails to stream without REPLICATION",
        async || relay.stats().failures >= failures + 2 && !relay.stats().active,
    )
    .await;
    exec(&pool, "ALTER ROLE relay REPLICATION").await;
    eventually("the changes made meanwhile arrive", async || {
        let mut want = named(0..10, "n");
        want.extend(named(10..20, "s"));
        nodes.hold(&want).await
    })
    .await;
    nodes.agree(&pool).await;
    assert_eq!(
        relay.stats().resyncs,
        resyncs,
        "nothing was lost: no resync"
    );
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// The relay's role losing `EXECUTE` on `pg_logical_emit_message` while
/// it reports its lag: the stream goes on (row changes still arrive), its
/// marks fail, counted, and the nodes' freshness of the mapped cache ages
/// with no report (their own proof stays young: the topic is fine). Given
/// back, reports resume and the age is young again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_role_losing_the_right_to_write_its_marks() {
    let (pg, pool, transport, nodes) = items_fixture(1).await;
    let relay = relay_of_its_own_role(&pg, &pool, &transport)
        .await
        .freshness_interval(Duration::from_millis(100))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    first_resync(&relay).await;
    // The cache's freshness: the node's own proof, or the relay's lag
    // added to it once it reports.
    let age = || {
        nodes.nodes[0].status().caches[0]
            .freshness_age_ms
            .unwrap_or(u64::MAX)
    };
    let own = || nodes.nodes[0].status().freshness_age_ms.unwrap_or(u64::MAX);
    eventually("reports keep the cache young", async || age() < 1000).await;

    exec(
        &pool,
        "REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC",
    )
    .await;
    let failures = relay.stats().mark_failures;
    exec(&pool, "UPDATE items SET name = 'r' || id").await;
    eventually("changes arrive without the marks", async || {
        nodes.hold(&named(0..20, "r")).await
    })
    .await;
    eventually("the marks fail, counted", async || {
        relay.stats().mark_failures >= failures + 3
    })
    .await;
    // The cache ages with no report, while the node's own proof goes on
    // (renewed every second, later under load: compared, not bounded).
    eventually("the cache's age 1.5 s past the node's own", async || {
        age() > own().saturating_add(1500)
    })
    .await;

    exec(
        &pool,
        "GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO PUBLIC",
    )
    .await;
    eventually("reports resume", async || age() < 1000).await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// `wal_level` lowered and the server restarted: PostgreSQL refuses to
/// start while a logical slot exists (a clear refusal, in its log). Set
/// back, the relay goes on from where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_lowered_the_server_refuses_to_start_and_set_back_the_stream_goes_on() {
    let (mut pg, pool, transport, nodes) = items_fixture(1).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..10, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..10, "a")).await).await;
    let refused = tokio::task::block_in_place(|| pg.restart_with(&["wal_level=replica"]));
    let log = refused.expect_err("the server started with wal_level = replica and a logical slot");
    assert!(log.contains("wal_level"), "{log}");
    tokio::task::block_in_place(|| pg.restart());
    exec(&pool, "UPDATE items SET name = 'b' || id").await;
    eventually("changes flow again", async || {
        nodes.hold(&named(0..10, "b")).await
    })
    .await;
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Issue 35, item 11: one value over the event size limit made every
/// refresh of its cache in the batch an invalidation (up to 5,000 rows of
/// other transactions). Only its own key is invalidated now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_value_invalidates_only_its_own_key() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let publisher = Publisher::builder(transport.clone())
        .max_event_bytes(8 << 10)
        .build()
        .unwrap();
    let relay = CdcRelay::builder(pg.url(), publisher)
        .lag_interval(Duration::from_millis(200))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    insert(&pool, 0..100, "a").await;
    eventually("rows arrive", async || {
        nodes.hold(&named(0..100, "a")).await
    })
    .await;
    // One transaction: 99 small values and one of 64 KiB.
    exec(
        &pool,
        "UPDATE items SET name = CASE WHEN id = 50 THEN repeat('x', 65536) ELSE 'b' || id END",
    )
    .await;
    let mut small = named(0..100, "b");
    small.remove(&50);
    eventually("the small values are installed", async || {
        nodes.hold(&small).await
    })
    .await;
    for cache in &nodes.caches {
        assert_eq!(
            cache.peek(&50).await,
            None,
            "the oversized value was dropped, not installed"
        );
    }
    nodes.agree(&pool).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Issue 35, item 12: two relays started at once on a new slot, each
/// owing the new slot a resync: the one whose slot creation lost takes its
/// debt back, so the slot is resynced once. Three slots, two relays each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_started_at_once_on_a_new_slot_resync_it_once() {
    // No node: the relays' own counts are what is checked (three groups
    // feeding one cache would each clear what the others installed).
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    let transport = EmbeddedTransport::new();
    let mut relays = Vec::new();
    let slots: Vec<String> = (0..12).map(|i| format!("s{i}")).collect();
    for (i, slot) in slots.iter().enumerate() {
        let start = || relay(&pg, &transport).slot(slot).start();
        // The second a little later each time: the race is lost when it
        // finds the slot missing just before the first creates it.
        let later = async {
            tokio::time::sleep(Duration::from_millis(3 * i as u64)).await;
            start().await
        };
        let (a, b) = tokio::join!(start(), later);
        relays.push((slot.as_str(), a.unwrap(), b.unwrap()));
    }
    for (slot, a, b) in &relays {
        eventually("the slot's resync is settled", async || {
            owed(&pool, slot).await == 0
        })
        .await;
        eventually("the slot's resync is applied", async || {
            a.stats().resyncs + b.stats().resyncs >= 1
        })
        .await;
    }
    // Past several checks of the publication, where a debt left behind
    // would be settled.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (slot, a, b) in &relays {
        assert_eq!(owed(&pool, slot).await, 0, "{slot}");
        assert_eq!(
            a.stats().resyncs + b.stats().resyncs,
            1,
            "{slot}: {:?} {:?}",
            a.stats(),
            b.stats()
        );
    }
    for (_, a, b) in relays {
        a.shutdown().await;
        b.shutdown().await;
    }
}

/// Issue 35, item 12: a graceful `shutdown` right after a publish handed
/// over a position up to 200 ms old: the next relay published it again
/// (and the new slot's resync with it). It reports its last position
/// before it closes the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_shutdown_hands_over_its_last_position() {
    let (pg, pool, transport, nodes) = items_fixture(1).await;
    let a = relay(&pg, &transport).start().await.unwrap();
    eventually("the new slot's resync is applied", async || {
        a.stats().resyncs == 1
    })
    .await;
    a.shutdown().await;
    let a = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..5, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..5, "a")).await).await;
    a.shutdown().await;
    let b = relay(&pg, &transport).start().await.unwrap();
    exec(&pool, "INSERT INTO items VALUES (-1, 'marker', NULL)").await;
    let want: BTreeMap<i64, String> = [(-1, "marker".to_owned())].into();
    eventually("the marker arrives", async || nodes.hold(&want).await).await;
    let stats = b.stats();
    assert_eq!(
        (stats.transactions, stats.resyncs),
        (1, 0),
        "the successor published only the marker: {stats:?}"
    );
    b.shutdown().await;
    nodes.shutdown().await;
}

/// Issue 35, item 12: a server crash forgets the slot's confirmed
/// position back to its last checkpoint, and the stream brings the new
/// slot's resync message again: it was applied, and is not again. Two
/// crashes, one resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_crashes_do_not_apply_a_resync_twice() {
    let (mut pg, pool, transport, nodes) = items_fixture(1).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    eventually("the new slot's resync is applied", async || {
        relay.stats().resyncs == 1
    })
    .await;
    for round in 0..2 {
        insert(&pool, round * 10..round * 10 + 5, "a").await;
        eventually("rows arrive", async || {
            nodes.hold(&named(round * 10..round * 10 + 5, "a")).await
        })
        .await;
        // Past the next status update: the position is confirmed, in
        // the server's memory only.
        tokio::time::sleep(Duration::from_millis(500)).await;
        tokio::task::block_in_place(|| pg.kill());
        tokio::task::block_in_place(|| pg.restart());
        exec(
            &pool,
            &format!("INSERT INTO items VALUES ({}, 'm', NULL)", -1 - round),
        )
        .await;
        let want: BTreeMap<i64, String> = [(-1 - round, "m".to_owned())].into();
        eventually("the stream goes on", async || nodes.hold(&want).await).await;
    }
    nodes.agree(&pool).await;
    assert_eq!(relay.stats().resyncs, 1, "{:?}", relay.stats());
    relay.shutdown().await;
    nodes.shutdown().await;
}

/// Issue 35, item 12, the same race where it is likelier: a slot dropped
/// under a relay and its standby, which both find it missing and create
/// it. Each drop is one new slot, resynced once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_under_a_relay_and_its_standby_is_resynced_once() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    let transport = EmbeddedTransport::new();
    let a = relay(&pg, &transport).start().await.unwrap();
    let b = relay(&pg, &transport).start().await.unwrap();
    let resyncs = || a.stats().resyncs + b.stats().resyncs;
    eventually("the first slot's resync", async || resyncs() == 1).await;
    for round in 1..=4 {
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
        eventually("the new slot's resync", async || resyncs() > round).await;
        eventually("the debts are settled", async || {
            owed(&pool, "cache_sync").await == 0
        })
        .await;
    }
    // Past several checks, where a debt left behind would be settled.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(owed(&pool, "cache_sync").await, 0);
    assert_eq!(resyncs(), 5, "{:?} {:?}", a.stats(), b.stats());
    a.shutdown().await;
    b.shutdown().await;
}

/// The slot read by another client while the relay stands by
/// (`pg_recvlogical`, say): what that client confirms is gone from the
/// slot, and never reaches nodes. The relay sees the slot held by a
/// session that is not a relay, says so, and resyncs every mapped cache
/// once it has the slot back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_read_by_another_client_is_resynced_when_the_relay_has_it_back() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport).start().await.unwrap();
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    let recvlogical = || {
        let bin = std::path::Path::new("/usr/lib/postgresql/15/bin/pg_recvlogical");
        let bin = if bin.exists() {
            bin.as_os_str()
        } else {
            "pg_recvlogical".as_ref()
        };
        std::process::Command::new(bin)
            .args([
                "-d",
                &pg.url(),
                "--slot",
                "cache_sync",
                "--start",
                "-f",
                "/dev/null",
            ])
            .args([
                "-o",
                "proto_version=1",
                "-o",
                "publication_names=cache_sync",
            ])
            // Confirm what it read every 100 ms.
            .args(["-s", "1", "-F", "0"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("pg_recvlogical (Debian: postgresql-client-15)")
    };
    let holder = async || -> Option<String> {
        sqlx::query_scalar(
            "SELECT a.application_name FROM pg_replication_slots s \
             JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = 'cache_sync'",
        )
        .fetch_optional(&pool)
        .await
        .unwrap()
    };
    // Take the slot from the relay: its session ends, and the other client
    // starts before the relay's next try (100 ms later).
    let mut client = None;
    for _ in 0..50 {
        exec(
            &pool,
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE active_pid IS NOT NULL",
        )
        .await;
        let mut c = recvlogical();
        tokio::time::sleep(Duration::from_millis(500)).await;
        if holder().await.as_deref() == Some("pg_recvlogical") {
            client = Some(c);
            break;
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    let mut client = client.expect("pg_recvlogical never got the slot");
    exec(&pool, "UPDATE items SET name = 'b' || id WHERE id < 10").await;
    let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    eventually("the other client confirmed the update", async || {
        sqlx::query_scalar::<_, bool>(
            "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = 'cache_sync'",
        )
        .bind(&lsn)
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    let _ = client.kill();
    let _ = client.wait();
    eventually("the relay has the slot back", async || relay.stats().active).await;
    nodes.agree(&pool).await;
    flows_again(&pool, &nodes).await;
    relay.shutdown().await;
    nodes.shutdown().await;
}
