//! An outbox relay's reports of its lag in the nodes' staleness bound: a
//! cache that awaits them is unknown until the first, fresh while the
//! relay drains the outbox, past its bound once the relay is gone while
//! rows wait, and fresh again under a new relay; two relays taking turns
//! keep it fresh, and either alone does.

use super::*;

const BOUND: Duration = Duration::from_secs(1);
const CACHE: &str = "c";

/// A relay reporting for `c` every 50 ms.
async fn reporting_relay(db: &TestDb, transport: &EmbeddedTransport) -> OutboxRelay {
    OutboxRelay::builder(db.pool.clone(), Publisher::new(transport.clone()))
        .outbox(db.outbox())
        .poll_interval(Duration::from_millis(200))
        .freshness_interval(Duration::from_millis(50))
        .reports_for([CACHE])
        .start()
        .await
        .expect("relay starts")
}

/// A node proving every 100 ms, holding `c` bounded at `BOUND` and
/// awaiting a relay's reports from the start.
async fn bounded_node(transport: &EmbeddedTransport) -> (SyncedCache<u32, String>, Node) {
    let cache = SyncedCache::builder(CACHE, moka::future::Cache::new(100))
        .max_staleness(BOUND)
        .relayed()
        .build()
        .unwrap();
    let node = Node::builder("n", transport.clone())
        .freshness_interval(Duration::from_millis(100))
        .register(&cache)
        .start()
        .await
        .unwrap();
    (cache, node)
}

fn age(node: &Node) -> Option<u64> {
    node.status()
        .caches
        .first()
        .and_then(|c| c.freshness_age_ms)
}

async fn set(db: &TestDb, key: u32, value: &str) {
    let mut tx = db.pool.begin().await.unwrap();
    db.outbox()
        .insert(&mut tx, CACHE, [(key, value.to_owned())])
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relays_reports_hold_a_bounded_cache_to_the_outbox() {
    let db = TestDb::new("fresh").await;
    let transport = EmbeddedTransport::new();
    let (cache, node) = bounded_node(&transport).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(age(&node), None, "awaited from the start: no report yet");
    assert_eq!(cache.get(&1).await, None);

    let relay = reporting_relay(&db, &transport).await;
    set(&db, 1, "a").await;
    eventually("the row held and the cache fresh", async || {
        cache.get(&1).await.as_deref() == Some("a") && age(&node).is_some_and(|a| a < 500)
    })
    .await;

    // The relay gone while a row waits in the outbox: past the bound
    // within it, though the node's own proof of the topic stays young.
    relay.shutdown().await;
    set(&db, 1, "b").await;
    let replaced = Instant::now();
    while replaced.elapsed() < Duration::from_secs(2) {
        let late = replaced.elapsed();
        if cache.get(&1).await.as_deref() == Some("a") {
            assert!(
                late <= BOUND + Duration::from_millis(250),
                "a read begun {late:?} after the row was replaced in the outbox returned the old value"
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(cache.get(&1).await, None, "past the bound with no relay");
    assert!(age(&node).is_some_and(|a| a > 1500), "{:?}", age(&node));
    assert!(
        node.status().freshness_age_ms.is_some_and(|a| a < 1000),
        "the node's own proof is young: the topic is fine, the relay is not"
    );
    assert!(cache.status().stale_bypasses > 0);

    // A new relay: its passes draw later terms, so its reports are taken.
    let relay = reporting_relay(&db, &transport).await;
    eventually(
        "the waiting row held and the cache fresh again",
        async || cache.get(&1).await.as_deref() == Some("b") && age(&node).is_some_and(|a| a < 500),
    )
    .await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_taking_turns_keep_a_cache_fresh_and_either_alone_does() {
    let db = TestDb::new("fresh_turns").await;
    let transport = EmbeddedTransport::new();
    let (_cache, node) = bounded_node(&transport).await;
    let first = reporting_relay(&db, &transport).await;
    let second = reporting_relay(&db, &transport).await;
    // Rows keep both relays passing, each taking the leader lock in turn.
    let writes = async {
        for i in 0..40 {
            set(&db, i % 4, &marker(i)).await;
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    };
    let mut ages = Vec::new();
    let watch = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        for _ in 0..20 {
            ages.push(age(&node));
            tokio::time::sleep(Duration::from_millis(35)).await;
        }
    };
    tokio::join!(writes, watch);
    assert!(
        ages.iter().all(|a| a.is_some_and(|a| a < 800)),
        "fresh while two relays take turns: {ages:?}"
    );
    assert!(first.stats().published + second.stats().published >= 40);
    for gone in [first, second] {
        gone.shutdown().await;
        // The other one, or a new one, alone.
        let alone = reporting_relay(&db, &transport).await;
        set(&db, 9, "x").await;
        let since = Instant::now();
        eventually("fresh with one relay", async || {
            age(&node).is_some_and(|a| u128::from(a) < since.elapsed().as_millis())
        })
        .await;
        alone.shutdown().await;
    }
    node.shutdown().await.unwrap();
    db.drop_schema().await;
}

#[tokio::test]
async fn report_settings_are_checked_at_start() {
    let db = TestDb::new("fresh_config").await;
    let publisher = || Publisher::new(EmbeddedTransport::new());
    let build = |every: Duration, caches: &[&str]| {
        OutboxRelay::builder(db.pool.clone(), publisher())
            .outbox(db.outbox())
            .freshness_interval(every)
            .reports_for(caches.iter().copied())
    };
    for (every, caches) in [
        (Duration::ZERO, &[CACHE][..]),
        (Duration::from_millis(9), &[CACHE][..]),
        (Duration::from_secs(3601), &[CACHE][..]),
        (Duration::from_millis(50), &[][..]),
        (Duration::from_millis(50), &[""][..]),
    ] {
        let err = build(every, caches).start().await.unwrap_err();
        assert!(err.is_config(), "{every:?} {caches:?}: {err}");
    }
    // Off (the default, and `Duration::MAX`) needs no caches; the range's
    // ends are taken.
    for every in [
        Duration::MAX,
        Duration::from_millis(10),
        Duration::from_secs(3600),
    ] {
        let caches: &[&str] = if every == Duration::MAX {
            &[]
        } else {
            &[CACHE]
        };
        build(every, caches).start().await.unwrap().shutdown().await;
    }
    db.drop_schema().await;
}
