//! Outbox relay fences, as a node sees them: what a replaced relay sends
//! late never lands over what its successor already published.

use super::*;
use crate::wire::{Fence, HeaderExt, KeyVersion};

/// An event of `publisher` numbered `seq`, under a relay's term.
fn fenced(publisher: u64, seq: u64, term: u64, change: &Change) -> Bytes {
    let ext = HeaderExt {
        since_prev_us: None,
        fence: Some(Fence { scope: 42, term }),
        watermark: None,
    };
    raw_event_ext("t", publisher, seq, ext, change)
}

fn versioned(k: &str, v: &str, version: u64) -> Change {
    versioned_change(k, v, Some(version))
}

/// Issue 21, item 1, as seen on the wire: relay A (term 7) publishes rows
/// 1 and 2, its session dies while row 2's publish is slow, relay B (term
/// 8) publishes rows 1 to 4, then A's row 2 lands and A goes on with row 3
/// before it learns it lost the lock: `[1, 1, 2, 3, 4, 2, 3]`. Without the
/// fence the node would keep value 3 for good while the database says 4.
#[tokio::test]
async fn a_replaced_relays_late_rows_never_land_over_its_successors() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    let (a, b) = (7, 8);
    let send = |publisher, seq, term, v: &str| {
        let t = transport.clone();
        let payload = fenced(publisher, seq, term, &refresh_change("k", v));
        async move { t.publish(DEFAULT_TOPIC, "t", payload).await.unwrap() }
    };
    send(a, 1, 7, "1").await;
    for (seq, v) in [(1, "1"), (2, "2"), (3, "3"), (4, "4")] {
        send(b, seq, 8, v).await;
    }
    eventually("relay B's rows", async || holds(&c, "k", Some("4")).await).await;
    send(a, 2, 7, "2").await;
    send(a, 3, 7, "3").await;
    // Applied, not only read: a record is counted as received before it
    // is checked against its fence and applied.
    eventually("relay A's late rows are applied", async || {
        node.status().caches[0].events_applied == 7
    })
    .await;
    let s = node.status();
    assert_eq!(s.events_fenced, 2, "{s:?}");
    assert_eq!(s.caches[0].events_applied, 7, "applied, as invalidations");
    // Never 2 or 3: absent, so the next read loads the database's 4.
    assert_eq!(c.peek("k").await, None);
    let loaded = c.get_with("k".into(), || async { "4".to_string() }).await;
    assert_eq!(loaded, "4");
    // B's later passes draw higher terms still; they apply as refreshes.
    send(b, 5, 9, "5").await;
    eventually("relay B's next pass", async || {
        holds(&c, "k", Some("5")).await
    })
    .await;
    assert_eq!(node.status().events_fenced, 2);
    node.shutdown().await.unwrap();
}

/// Versioned rows were never exposed (versions decide), and stay right:
/// a fenced refresh leaves a tombstone at its version, which is older than
/// the newer row's; an invalidation or a clear from a replaced relay
/// removes, which is never stale. Another outbox's terms are its own.
#[tokio::test]
async fn fenced_versioned_rows_invalidations_and_other_outboxes() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    let publish = |payload: Bytes| {
        let t = transport.clone();
        async move { t.publish(DEFAULT_TOPIC, "t", payload).await.unwrap() }
    };
    publish(fenced(1, 1, 5, &versioned("k", "v10", 10))).await;
    publish(fenced(2, 1, 6, &versioned("k", "v20", 20))).await;
    publish(fenced(1, 2, 5, &versioned("k", "v15", 15))).await;
    publish(fenced(1, 3, 5, &versioned("j", "j1", 1))).await;
    eventually("four events applied", async || {
        node.status().caches[0].events_applied == 4
    })
    .await;
    assert_eq!(node.status().events_fenced, 2);
    assert_eq!(c.peek("k").await, None, "v15 arrived fenced: k dropped");
    assert_eq!(c.peek("j").await, None);
    // The tombstone it left is at 15, below the row B published at 20:
    // a redelivery of 20 is stale, a newer row applies.
    publish(fenced(2, 2, 6, &versioned("k", "v20", 20))).await;
    publish(fenced(2, 3, 6, &versioned("k", "v21", 21))).await;
    eventually("v21", async || holds(&c, "k", Some("v21")).await).await;
    // A fenced invalidation removes, as it would anyway.
    let drop_k = Change::Invalidate {
        keys: vec![KeyVersion {
            key: encode_part("k", "key").unwrap(),
            version: None,
        }],
    };
    publish(fenced(1, 4, 5, &drop_k)).await;
    eventually("k dropped", async || holds(&c, "k", None).await).await;
    // Another outbox (scope) is never fenced by this one's terms.
    c.insert("k".into(), "x".into()).await;
    let ext = HeaderExt {
        since_prev_us: None,
        fence: Some(Fence { scope: 43, term: 1 }),
        watermark: None,
    };
    publish(raw_event_ext("t", 3, 1, ext, &refresh_change("k", "other"))).await;
    eventually("the other outbox's row", async || {
        holds(&c, "k", Some("other")).await
    })
    .await;
    assert_eq!(node.status().events_fenced, 3);
    node.shutdown().await.unwrap();
}
