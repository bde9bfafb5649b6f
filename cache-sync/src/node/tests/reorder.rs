//! The reorder window at a fresh start: the history it replays, and the
//! quarantine where there is none to replay.

use super::*;

/// Regression: a node that started just after a delete at version 12 was
/// published, then received an upsert at version 10 (committed earlier,
/// published later by another writer), installed the older row.
#[tokio::test]
async fn a_fresh_node_replays_the_reorder_window_so_older_refreshes_are_refused() {
    let transport = EmbeddedTransport::new();
    let p = Publisher::new(transport.clone());
    p.invalidate_versioned("t", [("k", Some(12))])
        .await
        .unwrap();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    p.insert_versioned("t", [("k", "older row", Some(10))])
        .await
        .unwrap();
    p.insert_versioned("t", [("j", "newer row", Some(13))])
        .await
        .unwrap();
    eventually("j applied", async || {
        holds(&c, "j", Some("newer row")).await
    })
    .await;
    assert_eq!(
        c.peek("k").await,
        None,
        "the replayed tombstone keeps version 10 out"
    );
    let s = &node.status().caches[0];
    assert_eq!(
        (s.refreshes, s.refreshes_quarantined, s.stale_ignored),
        (1, 0, 1)
    );
}

/// Without history to replay, the same situation is answered by quarantine.
#[tokio::test]
async fn without_history_a_fresh_node_quarantines_instead() {
    // Without history: a subscription from anywhere but the latest is refused.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.refuse_history(true);
    let p = Publisher::new(transport.clone());
    p.invalidate_versioned("t", [("k", Some(12))])
        .await
        .unwrap();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    p.insert_versioned("t", [("k", "older row", Some(10))])
        .await
        .unwrap();
    p.insert("t", [("fence", "x")]).await.unwrap();
    eventually("fence applied", async || {
        holds(&c, "fence", Some("x")).await
    })
    .await;
    assert_eq!(c.peek("k").await, None);
    assert_eq!(node.status().caches[0].refreshes_quarantined, 1);
}

/// Regression: `reorder_window(Duration::MAX)` panicked in `start()`
/// (`now - window` and `now + window` overflowed). A window that does not
/// fit the clock means "as far as the clock reaches": replay all the
/// history there is, and quarantine for as long as the process lives.
#[tokio::test]
async fn an_unbounded_reorder_window_replays_everything_and_quarantines_for_good() {
    let transport = EmbeddedTransport::new();
    Publisher::new(transport.clone())
        .insert_versioned("t", [("old", "history", Some(1))])
        .await
        .unwrap();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .reorder_window(Duration::MAX)
        .register(&c)
        .start()
        .await
        .unwrap();
    eventually("the whole history is replayed", async || {
        node.status().caches[0].events_applied == 1
    })
    .await;
    let late = cache("late");
    node.register(&late).await.unwrap();
    node.publisher()
        .insert_versioned("late", [("k", "v", Some(2))])
        .await
        .unwrap();
    eventually("applied as an invalidation", async || {
        late.status().refreshes_quarantined == 1
    })
    .await;
    assert!(node.is_consuming());
}
