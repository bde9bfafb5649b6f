//! A row that cannot be published, a failing broker, two relays at once:
//! nothing is lost, nothing is published twice, and order holds.

use super::*;

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
