//! A broker that stops taking publishes: the slot's lag shows it, nothing is
//! confirmed past a stuck publish, and one cache's stuck publish does not
//! hold up another's.

use super::*;

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
