//! Events that arrive after later ones of their publisher for the same
//! cache: on a transport with several queues (RocketMQ with two brokers), a
//! publisher's events for one cache move to another queue when a broker
//! fails, and the node reads the old queue's rest after the new queue's.

use std::time::Duration;

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

/// Versioned rows: a late event older than the key's record is ignored
/// (where the record cannot tell, it lands as an invalidation, whose
/// tombstone is at its own, older version), so a newer row still lands.
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

/// Issue 35, item 7: a replayed signed versioned refresh (anyone who can
/// write to the broker can replay one, byte for byte) is stale, and is
/// ignored as such: the newer value stays. It used to land, being late, as
/// an invalidation, so replays evicted keys at will; so did a duplicate of
/// an event numbered `u64::MAX`.
#[tokio::test]
async fn a_replayed_signed_versioned_refresh_is_ignored_not_an_eviction() {
    let ring = Keyring::new("k1", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.record_publishes(true);
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    let publisher = Publisher::builder(transport.clone())
        .signing(ring.clone())
        .announce_interval(Duration::MAX)
        .build()
        .unwrap();
    publisher
        .insert_versioned("t", [("k", "v1", Some(1))])
        .await
        .unwrap();
    publisher
        .insert_versioned("t", [("k", "v2", Some(2))])
        .await
        .unwrap();
    eventually("v2", async || c.peek("k").await.as_deref() == Some("v2")).await;
    // The broker's copies, sent again: the older event, then the newer.
    let replays = transport.published();
    assert_eq!(replays.len(), 2);
    for (tag, payload) in replays {
        transport
            .inner()
            .publish(DEFAULT_TOPIC, &tag, payload)
            .await
            .unwrap();
    }
    eventually("both replays read", async || node.status().events_late == 2).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("v2"), "{:?}", c.status());
    assert_eq!(c.status().stale_ignored, 2);
    // A publisher at the end of its numbers: each of its events is at or
    // below its last, and a duplicate is as stale as any replay.
    let send = |payload: Vec<u8>| {
        let t = transport.inner();
        async move {
            t.publish(DEFAULT_TOPIC, "t", Bytes::from(payload))
                .await
                .unwrap()
        }
    };
    let last = ring.sign(&raw_event(
        "t",
        9,
        u64::MAX,
        &versioned_change("j", "v5", Some(5)),
    ));
    send(last.clone()).await;
    eventually("j at 5", async || {
        c.peek("j").await.as_deref() == Some("v5")
    })
    .await;
    send(last).await;
    eventually("the duplicate read", async || {
        node.status().events_late == 3
    })
    .await;
    assert_eq!(c.peek("j").await.as_deref(), Some("v5"));
    assert_eq!(c.status().stale_ignored, 3);
    node.shutdown().await.unwrap();
}

/// Issue 35, item 7, the other side: a late versioned refresh newer than
/// the key's record is never installed, since what the node holds may be
/// newer than it without the record saying so. Here a gap resynced the
/// cache, and a read loaded the source's row (version 25) without a
/// version; the late event at version 20 must not put back its older row.
/// It lands as an invalidation, as before, and one older than the record
/// is ignored.
#[tokio::test]
async fn a_late_versioned_refresh_never_installs_over_a_resync() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    // No quarantine after the resync: the refreshes apply as they are.
    let node = Node::builder("n1", transport.clone())
        .reorder_window(Duration::ZERO)
        .register(&c)
        .start()
        .await
        .unwrap();
    let send = |seq, k: &str, v: &str, version| {
        let t = transport.clone();
        let payload = raw_event("t", 7, seq, &versioned_change(k, v, Some(version)));
        async move { t.publish(DEFAULT_TOPIC, "t", payload).await.unwrap() }
    };
    send(1, "k", "v10", 10).await;
    eventually("row 10", async || {
        c.peek("k").await.as_deref() == Some("v10")
    })
    .await;
    send(3, "j", "v30", 30).await;
    eventually("the gap's resync", async || {
        c.peek("j").await.as_deref() == Some("v30")
    })
    .await;
    assert_eq!(c.status().loss_resyncs, 1);
    let loaded = c.get_with("k".into(), || async { "v25".to_owned() }).await;
    assert_eq!(loaded, "v25");
    send(2, "k", "v20", 20).await;
    eventually("event 2, late", async || node.status().events_late == 1).await;
    assert_eq!(c.peek("k").await, None, "never v20, nor kept over it");
    send(2, "j", "v29", 29).await;
    eventually("event 2 again", async || node.status().events_late == 2).await;
    assert_eq!(c.peek("j").await.as_deref(), Some("v30"), "older: ignored");
    node.shutdown().await.unwrap();
}
