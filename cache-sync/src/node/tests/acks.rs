//! Acknowledged publishes (issue 21, items 3, 4 and 11): answers that do
//! not depend on a short list of recent publishers, a full view that never
//! calls a publish complete, and answers only their asker reads.

use std::time::Duration;

use super::*;
use crate::cluster::Cluster;
use crate::cluster::{Ack, Incomplete, Message, Request, Target};

const EVERY: Duration = Duration::from_millis(100);

async fn start(id: &str, transport: &EmbeddedTransport, c: &Cache) -> Node {
    Node::builder(id, transport.clone())
        .heartbeat_interval(EVERY)
        .reorder_window(Duration::ZERO)
        .register(c)
        .start()
        .await
        .unwrap()
}

async fn watcher(transport: &EmbeddedTransport) -> Cluster {
    Cluster::builder(transport.clone())
        .heartbeat_interval(EVERY)
        .start()
        .await
        .unwrap()
}

/// Issue 21, item 3: after more than 16 other publishers published once
/// each (one per request, the CLI), `applied_by` for an earlier, fully
/// applied event is still complete on every node. Nodes answer from the
/// publishers' sequence numbers they track; a ring of the 16 most recent
/// publishers per cache would have forgotten it, on both sides ("applied on
/// 0/1 nodes").
#[tokio::test]
async fn an_acknowledgement_does_not_forget_a_publisher_among_many() {
    let transport = EmbeddedTransport::new();
    let (a, b) = (cache("countries"), cache("countries"));
    let nodes = [
        start("n1", &transport, &a).await,
        start("n2", &transport, &b).await,
    ];
    let watcher = watcher(&transport).await;
    let first = Publisher::new(transport.clone())
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    for i in 0..40 {
        Publisher::new(transport.clone())
            .insert("countries", [(format!("k{i}"), "v")])
            .await
            .unwrap();
    }
    for c in [&a, &b] {
        eventually("every publish applied", async || {
            holds(c, "k39", Some("v")).await
        })
        .await;
    }
    let acks = first.applied_by(&watcher, Duration::from_secs(10)).await;
    assert!(acks.is_complete(), "{acks}: {acks:?}");
    assert_eq!(acks.applied(), 2);
    // The same from a node's own view.
    let acks = first
        .applied_by(&nodes[0].cluster(), Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks}: {acks:?}");
    watcher.shutdown().await;
    for node in nodes {
        node.shutdown().await.unwrap();
    }
}

/// Issue 21, item 4: past the member cap a new node's heartbeats are
/// dropped, so a real node, holding the cache and serving the old value,
/// may be missing from the view. A full view cannot know every live node:
/// it never calls a publish complete, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_view_never_calls_a_publish_complete() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = start("n1", &transport, &a).await;
    let watcher = watcher(&transport).await;
    // Made-up members fill the watcher's view (unsigned heartbeats): each
    // holds another cache, so none is waited for.
    let template = node.cluster().nodes()[0].clone();
    let plain = crate::wire::Codec::new(1 << 20, None);
    let mut sent = 0;
    while !watcher.overflowing() {
        let mut h = template.clone();
        h.node_id = format!("made-up-{sent}");
        h.caches.clear();
        // Alive for the whole test.
        h.interval_ms = 60_000;
        let payload = crate::cluster::seal_message(&plain, &Message::Heartbeat(h)).unwrap();
        transport
            .publish_heartbeat("cache-sync", Bytes::from(payload))
            .await
            .unwrap();
        sent += 1;
        if sent % 512 == 0 {
            // Lets the watcher's reader keep up with the broadcast buffer.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(sent < 100_000, "the view never filled");
    }
    let published = Publisher::new(transport.clone())
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    eventually("applied on n1", async || {
        holds(&a, "de", Some("Germany")).await
    })
    .await;
    let acks = published
        .applied_by(&watcher, Duration::from_millis(500))
        .await;
    assert_eq!(acks.incomplete, Some(Incomplete::ViewFull), "{acks:?}");
    assert!(!acks.is_complete());
    assert!(
        acks.to_string()
            .contains("incomplete: the cluster view is full"),
        "{acks}"
    );
    watcher.shutdown().await;
    node.shutdown().await.unwrap();
}

/// Issue 21, item 11: if every node answered with a full heartbeat on the
/// one channel and every party decoded every answer, the cost of an
/// acknowledged publish would grow with the square of the node count. An
/// answer is a few dozen bytes for its asker, and every other party skips
/// it on its first bytes: an unreadable answer for another party is not
/// even refused (it is never read), while one for this party is.
#[tokio::test]
async fn answers_are_small_and_only_their_asker_reads_them() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = start("n1", &transport, &a).await;
    let watcher = watcher(&transport).await;
    let plain = crate::wire::Codec::new(1 << 20, None);
    let ack = Ack {
        topic: "cache-sync".into(),
        node_id: "n1".into(),
        ids: vec![u64::MAX],
        progress: Vec::new(),
        probed: Vec::new(),
    };
    let sealed = crate::cluster::seal_ack_message(&plain, 42, &ack).unwrap();
    assert!(sealed.len() < 80, "{} bytes", sealed.len());
    eventually("the node reads the channel", async || {
        node.status().heartbeats_received > 0
    })
    .await;
    let rejected = node.status().heartbeats_rejected;
    let mut garbage = plain.seal_ack(42, b"{not json").unwrap();
    transport
        .publish_heartbeat("cache-sync", Bytes::from(garbage.clone()))
        .await
        .unwrap();
    // The same garbage, addressed to the node's own view.
    garbage[1..9].copy_from_slice(&node.cluster().asker().to_le_bytes());
    transport
        .publish_heartbeat("cache-sync", Bytes::from(garbage))
        .await
        .unwrap();
    eventually("the node's own answer is read and refused", async || {
        node.status().heartbeats_rejected == rejected + 1
    })
    .await;
    // A real acknowledged publish, watched by the watcher: the node's
    // answer goes to the watcher only.
    let published = Publisher::new(transport.clone())
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    let acks = published
        .applied_by(&watcher, Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    assert!(acks.nodes[0].latency.is_some());
    assert_eq!(node.status().heartbeats_rejected, rejected + 1);
    watcher.shutdown().await;
    node.shutdown().await.unwrap();
}

/// A request a node met is answered however often it comes (the asker
/// sends again when answers are lost); a request a node cannot meet yet is
/// answered once it can, and one for a cache it does not hold never.
#[tokio::test]
async fn requests_are_answered_when_met_and_again_when_repeated() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = start("n1", &transport, &a).await;
    let watcher = watcher(&transport).await;
    let publisher = Publisher::new(transport.clone());
    let published = publisher
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    let acks = published
        .applied_by(&watcher, Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    // Asked twice more for the same event, directly: two more answers.
    let request = |cache: &str, seq| {
        Message::Request(Request {
            topic: "cache-sync".into(),
            cache: Some(cache.into()),
            target: Some(Target::Seq { publisher: 1, seq }),
            within_ms: 60_000,
            asker: 77,
            id: seq,
            reply: false,
        })
    };
    let mut answers = transport.subscribe_heartbeats("cache-sync").await.unwrap();
    let plain = crate::wire::Codec::new(1 << 20, None);
    let send = |m: Message| {
        let t = transport.clone();
        let payload = crate::cluster::seal_message(&plain, &m).unwrap();
        async move {
            t.publish_heartbeat("cache-sync", Bytes::from(payload))
                .await
                .unwrap()
        }
    };
    let next_answer = async |answers: &mut Box<dyn crate::transport::HeartbeatSubscription>| {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let payload = tokio::time::timeout_at(deadline, answers.next())
                .await
                .expect("an answer")
                .unwrap();
            if crate::wire::Codec::ack_for(&payload) == Some(77) {
                match crate::cluster::open_message(&plain, &payload).unwrap() {
                    crate::cluster::OpenedMessage::Ack { ack, .. } => return ack.ids,
                    other => panic!("{other:?}"),
                }
            }
        }
    };
    // Publisher 1 does not exist yet: pending. Then its events arrive.
    send(request("countries", 2)).await;
    send(request("flags", 1)).await;
    for seq in [1, 2] {
        let event = raw_event("countries", 1, seq, &refresh_change("x", "v"));
        transport
            .publish(DEFAULT_TOPIC, "countries", event)
            .await
            .unwrap();
    }
    assert_eq!(next_answer(&mut answers).await, [2], "answered once met");
    send(request("countries", 2)).await;
    assert_eq!(
        next_answer(&mut answers).await,
        [2],
        "and again when asked again"
    );
    // Nothing for the cache the node does not hold.
    send(request("countries", 1)).await;
    assert_eq!(next_answer(&mut answers).await, [1]);
    watcher.shutdown().await;
    node.shutdown().await.unwrap();
}

/// What a node applied before a loss stays applied: a loss makes every
/// publisher's next number no gap (every cache was resynced), but it does
/// not make the node forget, for acknowledgements, what it applied.
#[test]
fn a_loss_keeps_what_was_applied_for_acknowledgements() {
    let mut seqs = PublisherSeqs::default();
    assert_eq!(seqs.observe(1, "a", 5), None);
    seqs.clear();
    assert_eq!(seqs.applied(1, "a"), Some(5), "still applied");
    assert_eq!(seqs.observe(1, "a", 9), None, "no gap right after a loss");
    assert_eq!(seqs.applied(1, "a"), Some(9));
    assert_eq!(seqs.observe(1, "a", 11), Some(1), "gaps count again");
    assert_eq!(seqs.applied(2, "a"), None);
}

/// Issue 21, item 11: an acknowledged publish need not cost a request's
/// round trip after the publish. A node follows, for a while after a
/// request, what it asked about, and tells the asker as each batch moves it
/// on: the next publish's acknowledgement completes from that, with no
/// request reaching the node at all; once the follow lapses, only a request
/// can.
#[tokio::test(start_paused = true)]
async fn a_followed_publisher_is_acknowledged_as_it_is_applied() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let a = cache("countries");
    let node = Node::builder("n1", transport.clone())
        .heartbeat_interval(EVERY)
        .reorder_window(Duration::ZERO)
        .register(&a)
        .start()
        .await
        .unwrap();
    let watcher = Cluster::builder(transport.clone())
        .heartbeat_interval(EVERY)
        .start()
        .await
        .unwrap();
    let publisher = Publisher::new(transport.inner());
    let first = publisher.insert("countries", [("de", "1")]).await.unwrap();
    let acks = first.applied_by(&watcher, Duration::from_secs(10)).await;
    assert!(acks.is_complete(), "{acks:?}");
    // From now on no request reaches any node: the heartbeat channel drops
    // every acknowledgement request.
    transport
        .drop_heartbeats_where(|payload| payload.windows(16).any(|w| w == b"\"type\":\"request\""));
    let second = publisher.insert("countries", [("de", "2")]).await.unwrap();
    let acks = second.applied_by(&watcher, Duration::from_secs(5)).await;
    assert!(acks.is_complete(), "told as it applied: {acks:?}");
    assert!(acks.nodes[0].latency.is_some());
    // The follow lapses 10 s after the last request the node got.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let third = publisher.insert("countries", [("de", "3")]).await.unwrap();
    eventually("applied", async || holds(&a, "de", Some("3")).await).await;
    let acks = third.applied_by(&watcher, Duration::from_secs(2)).await;
    assert_eq!(acks.incomplete, Some(Incomplete::Pending), "{acks:?}");
    watcher.shutdown().await;
    node.shutdown().await.unwrap();
}
