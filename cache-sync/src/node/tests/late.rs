//! Events that arrive after later ones of their publisher for the same
//! cache: on a transport with several queues (RocketMQ with two brokers), a
//! publisher's events for one cache move to another queue when a broker
//! fails, and the node reads the old queue's rest after the new queue's.

use super::*;

/// Publisher 7 sets `k` to 1, 2 and 3; event 2 goes to a queue whose
/// broker then dies, so 3 arrives first (a gap: the cache is resynced),
/// the row changes to 4 through another publisher, and event 2 arrives
/// when its broker returns. Applied as the refresh it is, it would leave
/// `k` at 2 for good while the source says 4.
#[tokio::test]
async fn an_event_behind_its_publishers_last_lands_as_an_invalidation() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = node_with(&transport, &c).await;
    let send = |publisher, seq, v: &str| {
        let t = transport.clone();
        let payload = raw_event("t", publisher, seq, &refresh_change("k", v));
        async move { t.publish(DEFAULT_TOPIC, "t", payload).await.unwrap() }
    };
    send(7, 1, "1").await;
    eventually("event 1", async || holds(&c, "k", Some("1")).await).await;
    send(7, 3, "3").await;
    eventually("event 3, after a gap", async || {
        node.status().publisher_gaps == 1
    })
    .await;
    send(8, 1, "4").await;
    eventually("another publisher's 4", async || {
        holds(&c, "k", Some("4")).await
    })
    .await;
    send(7, 2, "2").await;
    eventually("event 2, late", async || node.status().events_received == 4).await;
    let s = node.status();
    assert_eq!(s.events_late, 1, "{s:?}");
    assert_eq!(s.publisher_gaps, 1, "a late event is no gap: {s:?}");
    // Never 2: absent, so the next read loads the source's 4.
    assert_eq!(c.peek("k").await, None);
    // A redelivery of the publisher's last number is late too.
    send(7, 3, "3").await;
    eventually("event 3 again", async || node.status().events_late == 2).await;
    assert_eq!(c.peek("k").await, None);
    // What follows the publisher's last number applies as it is.
    send(7, 4, "5").await;
    eventually("event 4", async || holds(&c, "k", Some("5")).await).await;
    assert_eq!(node.status().events_late, 2);
    node.shutdown().await.unwrap();
}

/// Versioned rows: a late event, applied as an invalidation, leaves its
/// tombstone at its own, older version, so a newer row still lands.
#[tokio::test]
async fn a_late_versioned_row_never_hides_a_newer_one() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = node_with(&transport, &c).await;
    let send = |seq, v: &str, version| {
        let t = transport.clone();
        let payload = raw_event("t", 7, seq, &versioned_change("k", v, Some(version)));
        async move { t.publish(DEFAULT_TOPIC, "t", payload).await.unwrap() }
    };
    send(2, "v20", 20).await;
    eventually("row 20", async || holds(&c, "k", Some("v20")).await).await;
    send(1, "v10", 10).await;
    eventually("row 10, late", async || node.status().events_late == 1).await;
    // Removed or kept at 20, never 10.
    assert_ne!(c.peek("k").await.as_deref(), Some("v10"));
    send(3, "v30", 30).await;
    eventually("row 30", async || holds(&c, "k", Some("v30")).await).await;
    node.shutdown().await.unwrap();
}
