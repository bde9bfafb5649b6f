//! Input the node cannot trust: unsigned or forged events on a verifying
//! node, oversized ones, ones it cannot read. None may change a cache, and
//! none that may be genuine may be dropped without an answer.

use super::*;

#[tokio::test]
async fn with_signatures_on_only_authentic_events_change_anything() {
    let ring = Keyring::new("k2", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("k".into(), "cached".into()).await;

    // Unsigned, signed with an unknown key, forged (right id, wrong secret), tampered.
    Publisher::new(transport.clone())
        .insert("t", [("k", "unsigned")])
        .await
        .unwrap();
    let stranger = Keyring::new("k9", b"some-other-secret-000".to_vec()).unwrap();
    Publisher::builder(transport.clone())
        .signing(stranger)
        .build()
        .unwrap()
        .insert("t", [("k", "stranger")])
        .await
        .unwrap();
    let forger = Keyring::new("k2", b"a-guessed-secret-0000".to_vec()).unwrap();
    Publisher::builder(transport.clone())
        .signing(forger)
        .build()
        .unwrap()
        .insert("t", [("k", "forged")])
        .await
        .unwrap();
    let mut tampered = ring.sign(&raw_event("t", 5, 1, &refresh_change("k", "original")));
    let last = tampered.len() - 1;
    tampered[last] ^= 0xFF;
    transport
        .publish(DEFAULT_TOPIC, "t", Bytes::from(tampered))
        .await
        .unwrap();

    Publisher::builder(transport.clone())
        .signing(ring)
        .build()
        .unwrap()
        .insert("t", [("ok", "signed")])
        .await
        .unwrap();
    eventually("the signed event applies", async || {
        holds(&c, "ok", Some("signed")).await
    })
    .await;
    assert_eq!(
        c.peek("k").await.as_deref(),
        Some("cached"),
        "no rejected event touched the cache"
    );
    let s = node.status();
    assert_eq!((s.events_rejected, s.losses), (4, 0));
    assert_eq!(
        s.caches[0].loss_resyncs, 0,
        "forgeries must not be able to flush caches"
    );
    assert!(node.is_consuming());
    // The node's own publisher signs.
    node.publisher()
        .insert("t", [("own", "signed too")])
        .await
        .unwrap();
    eventually("own event applies", async || {
        holds(&c, "own", Some("signed too")).await
    })
    .await;
}

#[tokio::test]
async fn a_node_without_keys_accepts_signed_events_for_rollout() {
    let ring = Keyring::new("k1", b"rollout-secret-0000000".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let _node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    Publisher::builder(transport)
        .signing(ring)
        .build()
        .unwrap()
        .insert("t", [("k", "v")])
        .await
        .unwrap();
    eventually("signed event applies unverified", async || {
        holds(&c, "k", Some("v")).await
    })
    .await;
}

/// Regression: on a verifying node, an unsigned payload over the size
/// limit, tagged for a held cache, invalidated and quarantined that cache:
/// the size check and the tag routing ran before the signature check.
/// Nothing unauthenticated may change cache state; it only bumps a counter.
#[tokio::test]
async fn unauthenticated_input_changes_nothing_whatever_its_size_or_tag() {
    let ring = Keyring::new("k1", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .max_event_bytes(1024)
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("k".into(), "cached".into()).await;

    let oversized_unsigned = raw_event("t", 5, 1, &refresh_change("k", &"x".repeat(4096)));
    let oversized_garbage = Bytes::from(vec![0xAB; 4096]);
    let mut oversized_forged = vec![crate::wire::FORMAT_SIGNED, 2, b'k', b'1'];
    oversized_forged.extend([0u8; 32 + 4096]);
    let small_garbage = Bytes::from_static(b"\x01\xff\xff\xff");
    for payload in [
        oversized_unsigned,
        oversized_garbage,
        Bytes::from(oversized_forged),
        small_garbage,
        Bytes::new(),
    ] {
        transport
            .publish(DEFAULT_TOPIC, "t", payload)
            .await
            .unwrap();
    }
    // A signed, versioned refresh afterwards: applied normally, so the cache
    // was neither resynced nor quarantined by what came before.
    let admin = Publisher::builder(transport.clone())
        .signing(ring)
        .build()
        .unwrap();
    admin
        .insert_versioned("t", [("fence", "signed", Some(7))])
        .await
        .unwrap();
    eventually("the signed event applies", async || {
        holds(&c, "fence", Some("signed")).await
    })
    .await;
    assert_eq!(c.peek("k").await.as_deref(), Some("cached"));
    let s = node.status();
    assert_eq!(s.events_rejected, 5, "{s:?}");
    assert_eq!((s.losses, s.caches[0].loss_resyncs), (0, 0), "{s:?}");
    assert_eq!(s.caches[0].rejected_events, 0, "{s:?}");
    assert_eq!(s.caches[0].refreshes_quarantined, 0, "{s:?}");
}

/// Guards against dropping an event with no tag to name its cache (Redis
/// Pub/Sub): a genuine event over the node's size limit, or one in a format
/// the node cannot read, if only counted and dropped, would leave the cache
/// it changed stale. The header, read from the front of an oversized event,
/// names the cache; an event that names none may have changed any.
#[tokio::test]
async fn an_unreadable_event_without_a_tag_invalidates_what_it_may_have_changed() {
    // Records without their tags, as Redis Pub/Sub delivers them.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.strip_tags(true);
    let (t, u) = (cache("t"), cache("u"));
    let node = Node::builder("n1", transport.clone())
        .max_event_bytes(1024)
        .register(&t)
        .register(&u)
        .start()
        .await
        .unwrap();
    t.insert("k".into(), "cached".into()).await;
    u.insert("k".into(), "cached".into()).await;

    // Too large for this node (its publisher allowed more): only "t".
    let big = raw_event("t", 5, 1, &refresh_change("k", &"x".repeat(4096)));
    transport.publish(DEFAULT_TOPIC, "t", big).await.unwrap();
    // The publisher's next number is no gap: the oversized one used up 1.
    let next = raw_event("t", 5, 2, &refresh_change("after", "big"));
    transport.publish(DEFAULT_TOPIC, "t", next).await.unwrap();
    eventually("the next event applies", async || {
        holds(&t, "after", Some("big")).await
    })
    .await;
    assert_eq!(t.get("k").await, None, "t may have missed a change");
    assert_eq!(u.peek("k").await.as_deref(), Some("cached"));
    let s = node.status();
    assert_eq!(
        (s.events_rejected, s.publisher_gaps, s.losses),
        (1, 0, 0),
        "{s:?}"
    );
    assert_eq!(
        (s.caches[0].rejected_events, s.caches[1].rejected_events),
        (1, 0)
    );

    // A format this node cannot read, naming no cache: any may be stale.
    u.insert("k".into(), "cached".into()).await;
    transport
        .publish(
            DEFAULT_TOPIC,
            "u",
            Bytes::from_static(b"\x09a newer format"),
        )
        .await
        .unwrap();
    // The loss is counted before the caches are invalidated: wait for
    // what the test is about, the invalidation.
    eventually("every cache is invalidated", async || {
        holds(&u, "k", None).await
    })
    .await;
    let s = node.status();
    assert_eq!(s.losses, 1, "{s:?}");
    assert_eq!(s.last_loss_reason.as_deref(), Some("unreadable"));
    assert_eq!(s.events_rejected, 2);
    node.shutdown().await.unwrap();
}

/// The tag is not signed, the header is (on a verifying node): an oversized
/// event re-tagged for another cache resyncs the cache its header names.
#[tokio::test]
async fn an_oversized_event_resyncs_the_cache_its_header_names_not_its_tag() {
    let ring = Keyring::new("k1", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let (t, u) = (cache("t"), cache("u"));
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .max_event_bytes(1024)
        .register(&t)
        .register(&u)
        .start()
        .await
        .unwrap();
    t.insert("k".into(), "cached".into()).await;
    u.insert("k".into(), "cached".into()).await;
    let signed = Bytes::from(ring.sign(&raw_event(
        "t",
        5,
        1,
        &refresh_change("k", &"x".repeat(4096)),
    )));
    transport.publish(DEFAULT_TOPIC, "u", signed).await.unwrap();
    eventually("the event is rejected", async || {
        node.status().events_rejected == 1
    })
    .await;
    let s = node.status();
    assert_eq!(
        (s.caches[0].rejected_events, s.caches[1].rejected_events),
        (1, 0),
        "{s:?}"
    );
    assert_eq!(t.get("k").await, None);
    assert_eq!(u.peek("k").await.as_deref(), Some("cached"));
    node.shutdown().await.unwrap();
}
