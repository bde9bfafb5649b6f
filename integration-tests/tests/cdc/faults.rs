//! Faults of the relay's world: a terminated connection, the server killed or
//! stopped, the slot dropped, a standby taking over, relays started and
//! stopped in turn, and relay processes killed.

use super::*;

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
/// the slot again and every node clears the cache. The relay reports its
/// lag throughout: the new session's reports (a new epoch) are taken, and
/// the cache's freshness is young again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_detected_recreated_and_resynced() {
    let (pg, pool, transport, nodes) = items_fixture(2).await;
    let relay = relay(&pg, &transport)
        .freshness_interval(std::time::Duration::from_millis(100))
        .start()
        .await
        .unwrap();
    let age = || {
        nodes.nodes[0].status().caches[0]
            .freshness_age_ms
            .unwrap_or(u64::MAX)
    };
    insert(&pool, 0..20, "a").await;
    eventually("rows arrive", async || nodes.hold(&named(0..20, "a")).await).await;
    eventually("reports keep the cache young", async || age() < 1000).await;
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
    // Young on the new session's reports: 1.5 s on, what the old one
    // reported is past 1 s, so a young age is the new epoch's.
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    eventually("the new session's reports taken", async || age() < 1000).await;
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
