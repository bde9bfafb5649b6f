//! Gaps in a publisher's numbers, resumes and a history the node fell
//! behind: every event a node may have missed is answered by resyncing the
//! caches it may have changed, and only those.

use super::*;

/// Sequence numbers run per (publisher, cache), so a gap resyncs only the
/// cache whose sequence jumped, not every cache on the topic: only that
/// cache can have missed anything.
#[tokio::test]
async fn a_gap_in_a_publishers_sequence_invalidates_that_cache_only() {
    let transport = EmbeddedTransport::new();
    let (a, b) = (cache("a"), cache("b"));
    let node = Node::builder("n1", transport.clone())
        .register(&a)
        .register(&b)
        .start()
        .await
        .unwrap();
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 1, &refresh_change("x", "1")),
        )
        .await
        .unwrap();
    eventually("seq 1", async || holds(&a, "x", Some("1")).await).await;
    b.insert("y".into(), "untouched by a's gap".into()).await;
    // Sequence 2 and 3 never arrive.
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 4, &refresh_change("z", "4")),
        )
        .await
        .unwrap();
    eventually("seq 4", async || holds(&a, "z", Some("4")).await).await;
    assert_eq!(
        a.get("x").await,
        None,
        "stale entries before the gap are gone"
    );
    assert_eq!(
        b.get("y").await.as_deref(),
        Some("untouched by a's gap"),
        "another cache's sequence did not jump"
    );
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (1, 1));
    assert_eq!(s.last_loss_reason.as_deref(), Some("publisher_gap"));
    let resyncs: Vec<_> = s
        .caches
        .iter()
        .map(|c| (c.name.as_str(), c.loss_resyncs))
        .collect();
    assert_eq!(resyncs, [("a", 1), ("b", 0)]);
    // A redelivery of an old sequence number is not a gap.
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 2, &refresh_change("w", "2")),
        )
        .await
        .unwrap();
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 5, &refresh_change("v", "5")),
        )
        .await
        .unwrap();
    eventually("seq 5", async || holds(&a, "v", Some("5")).await).await;
    assert_eq!(node.status().publisher_gaps, 1);
}

/// After a resume (a re-subscription from the node's position, with no loss
/// signalled), the first event of a publisher the node has not heard from
/// cannot vouch for the ones before it: had the history been replaced
/// without the transport noticing, they would be gone. It is answered as a
/// gap in that cache. At a fresh start (empty caches) it is trusted.
#[tokio::test]
async fn after_a_resume_an_unknown_publishers_first_event_is_not_trusted() {
    let flaky = flaky();
    let (a, b) = (cache("a"), cache("b"));
    let node = Node::builder("n1", flaky.clone())
        .reconnect_backoff(Duration::from_millis(1), Duration::from_millis(10))
        .register(&a)
        .register(&b)
        .start()
        .await
        .unwrap();
    let publish = |cache: &'static str, publisher, seq, k: &'static str| {
        let transport = flaky.inner();
        async move {
            transport
                .publish(
                    DEFAULT_TOPIC,
                    cache,
                    raw_event(cache, publisher, seq, &refresh_change(k, "v")),
                )
                .await
                .unwrap();
        }
    };
    // Before any resume: a publisher first seen at seq 41 is trusted.
    publish("a", 1, 41, "a1").await;
    eventually("applied", async || holds(&a, "a1", Some("v")).await).await;
    // The first subscription fails after that batch; the node resumes.
    eventually("resumed", async || flaky.subscriptions() == 2).await;
    b.insert("warm".into(), "kept".into()).await;
    publish("a", 1, 42, "a2").await; // known publisher, next number: fine
    publish("a", 2, 1, "a3").await; // a new publisher's first event: fine
    publish("b", 3, 17, "b1").await; // unknown, after a resume: a gap in b
    eventually("b1 applied", async || holds(&b, "b1", Some("v")).await).await;
    assert!(holds(&a, "a1", Some("v")).await, "a was not resynced");
    assert_eq!(b.peek("warm").await, None, "b was resynced");
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (1, 1), "{s:?}");
    publish("b", 3, 18, "b2").await; // now known
    eventually("b2 applied", async || holds(&b, "b2", Some("v")).await).await;
    assert_eq!(node.status().publisher_gaps, 1);
}

#[tokio::test]
async fn falling_behind_the_history_is_answered_by_invalidating() {
    // History of 4 records, and the consumer cannot run while we publish 50
    // (the current-thread runtime only switches tasks at an await that blocks).
    let transport = EmbeddedTransport::builder()
        .max_records(4)
        .build()
        .expect("valid settings");
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .max_batch(1)
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("stale".into(), "old".into()).await;
    let p = node.publisher();
    for i in 0..50 {
        p.insert("t", [(format!("k{i}"), "v")]).await.unwrap();
    }
    eventually("last event applied", async || {
        holds(&c, "k49", Some("v")).await
    })
    .await;
    let s = node.status();
    assert!(s.losses >= 1, "{s:?}");
    assert_eq!(s.last_loss_reason.as_deref(), Some("trimmed"));
    assert!(s.caches[0].loss_resyncs >= 1);
    assert_eq!(c.get("stale").await, None);
}

#[tokio::test]
async fn a_broken_subscription_resumes_where_it_was_without_loss() {
    let flaky = flaky();
    let c = cache("t");
    let node = Node::builder("n1", flaky.clone())
        .max_batch(1)
        .reconnect_backoff(Duration::from_millis(1), Duration::from_millis(10))
        .register(&c)
        .start()
        .await
        .unwrap();
    let p = node.publisher();
    for i in 0..5 {
        p.insert("t", [(format!("k{i}"), "v")]).await.unwrap();
    }
    eventually("all applied", async || holds(&c, "k4", Some("v")).await).await;
    for i in 0..5 {
        assert!(holds(&c, &format!("k{i}"), Some("v")).await, "k{i} lost");
    }
    let s = node.status();
    assert_eq!(s.transport_errors, 1);
    assert_eq!(s.losses, 0, "resuming from a known position loses nothing");
    assert_eq!(flaky.subscriptions(), 2);
    assert!(node.is_consuming());
}

#[test]
fn publisher_seqs_count_gaps_per_publisher_and_cache() {
    let mut seqs = PublisherSeqs::default();
    assert_eq!(
        seqs.observe(1, "a", 5),
        None,
        "the first event sets the baseline"
    );
    assert_eq!(seqs.observe(1, "a", 6), None);
    assert_eq!(seqs.observe(1, "a", 9), Some(2));
    // A redelivery is no gap and does not move the baseline back.
    assert_eq!(seqs.observe(1, "a", 7), None);
    assert_eq!(seqs.observe(1, "a", 10), None);
    // Other caches and other publishers keep their own baselines.
    assert_eq!(seqs.observe(1, "b", 1), None);
    assert_eq!(seqs.observe(2, "a", 1), None);
    assert_eq!(seqs.observe(1, "b", 3), Some(1));
    assert_eq!(seqs.tracked, 3);
    // The ends of the range are numbers like any other.
    assert_eq!(seqs.observe(3, "a", u64::MAX), None);
    assert_eq!(seqs.observe(3, "a", u64::MAX), None);
    assert_eq!(seqs.observe(3, "a", 0), None);
    assert_eq!(seqs.observe(4, "a", 0), None);
    assert_eq!(seqs.observe(4, "a", u64::MAX), Some(u64::MAX - 1));
    // After a resume, unknown publishers do not vouch for what came before.
    seqs.resumed(["a".to_owned()]);
    assert_eq!(
        seqs.observe(5, "a", 1),
        None,
        "a first event vouches for itself"
    );
    assert_eq!(seqs.observe(6, "a", 7), Some(6));
    assert_eq!(
        seqs.observe(6, "b", 7),
        None,
        "b was not held at the resume"
    );
    seqs.resynced("a");
    assert_eq!(seqs.observe(7, "a", 3), None, "a was resynced since");
    seqs.clear();
    assert_eq!(
        seqs.observe(1, "a", 20),
        None,
        "after a loss, a new baseline"
    );
}

/// Regression: a duplicate of an event whose sequence number is `u64::MAX`
/// counted as a gap in release builds (`last + 1` wrapped to 0) and
/// overflowed, killing the consumer task, in debug builds.
#[tokio::test]
async fn the_largest_sequence_number_is_just_a_number() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    for (seq, v) in [(u64::MAX - 1, "a"), (u64::MAX, "b"), (u64::MAX, "c")] {
        transport
            .publish(
                DEFAULT_TOPIC,
                "t",
                raw_event("t", 9, seq, &refresh_change("k", v)),
            )
            .await
            .unwrap();
    }
    eventually("all three applied", async || {
        node.status().caches[0].events_applied == 3
    })
    .await;
    assert!(node.is_consuming(), "the consumer task died");
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (0, 0), "{s:?}");
    // The duplicate is late: it lands as an invalidation.
    assert_eq!(s.events_late, 1, "{s:?}");
    assert_eq!(c.peek("k").await, None);
}

/// A batch applies in runs per cache. A gap's resync must come after the
/// events before it in the same batch: applied after it, an event that the
/// missing one superseded would outlive the resync meant to drop it.
#[tokio::test]
async fn a_gap_resyncs_after_the_events_before_it_in_the_same_batch() {
    use crate::node::route::apply_records;
    use crate::transport::Record;

    let (a, b) = (cache("a"), cache("b"));
    let (shared, caches) = Node::builder("n", EmbeddedTransport::new())
        .register(&a)
        .register(&b)
        .into_shared();
    for c in caches {
        shared.register(c).await.unwrap();
    }
    let record = |cache: &str, seq: u64, k: &str, v: &str| {
        Record::new(
            Some(cache.into()),
            raw_event(cache, 7, seq, &refresh_change(k, v)),
        )
    };
    let records = vec![
        record("a", 1, "x", "1"),
        // Another cache in between: the runs are a, b, a.
        record("b", 1, "y", "1"),
        record("a", 2, "w", "2"),
        // Sequence 3 is missing.
        record("a", 4, "z", "4"),
    ];
    apply_records(&shared, &mut PublisherSeqs::default(), records).await;
    assert_eq!(a.peek("x").await, None, "applied after the resync");
    assert_eq!(a.peek("w").await, None, "applied after the resync");
    assert_eq!(a.peek("z").await.as_deref(), Some("4"));
    assert_eq!(b.peek("y").await.as_deref(), Some("1"));
    assert_eq!(a.status().loss_resyncs, 1);
}
