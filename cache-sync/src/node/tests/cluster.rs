//! Heartbeats, the cluster view, acknowledged publishes and readiness, on
//! the embedded transport.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::*;
use crate::cluster::Cluster;
use crate::cluster::Heartbeat;
use crate::cluster::{Incomplete, Message, Request};

pub(super) const EVERY: Duration = Duration::from_millis(100);

pub(super) async fn start(id: &str, transport: impl Transport, caches: &[&Cache]) -> Node {
    let mut b = Node::builder(id, transport)
        .heartbeat_interval(EVERY)
        .reorder_window(Duration::ZERO);
    for c in caches {
        b = b.register(*c);
    }
    b.start().await.unwrap()
}

fn ids(nodes: &[Heartbeat]) -> Vec<&str> {
    nodes.iter().map(|h| h.node_id.as_str()).collect()
}

#[tokio::test]
async fn every_node_sees_every_node_within_two_intervals() {
    let transport = EmbeddedTransport::new();
    let (a, b, c) = (cache("countries"), cache("countries"), cache("countries"));
    let started = Instant::now();
    let nodes = [
        start("n1", transport.clone(), &[&a]).await,
        start("n2", transport.clone(), &[&b]).await,
        start("n3", transport.clone(), &[&c]).await,
    ];
    for node in &nodes {
        eventually("all three in the view", async || {
            node.cluster().nodes().len() == 3
        })
        .await;
    }
    assert!(started.elapsed() <= EVERY * 2, "{:?}", started.elapsed());
    let view = nodes[0].cluster().view();
    assert_eq!(view.observer, "n1");
    assert_eq!(
        view.nodes
            .iter()
            .map(|n| n.node_id.as_str())
            .collect::<Vec<_>>(),
        ["n1", "n2", "n3"]
    );
    assert_eq!(view.caches.len(), 1);
    assert_eq!(view.caches[0].nodes, 3);
    // Heartbeats are no events: nothing was received, skipped or applied.
    for node in &nodes {
        let s = node.status();
        assert_eq!(s.events_received, 0);
        assert!(s.heartbeats_sent >= 1);
        assert!(s.heartbeats_received >= 2);
        assert_eq!(s.heartbeats_rejected, 0);
    }
    for node in &nodes {
        node.shutdown().await.unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_node_that_stops_is_gone_after_three_intervals() {
    let transport = EmbeddedTransport::new();
    let (a, b) = (cache("countries"), cache("countries"));
    let n1 = start("n1", transport.clone(), &[&a]).await;
    let n2 = start("n2", transport.clone(), &[&b]).await;
    eventually("both seen", async || n1.cluster().nodes().len() == 2).await;
    // Its last heartbeat arrives on its way out (or just before).
    n2.shutdown().await.unwrap();
    let stopped = Instant::now();
    while n1.cluster().nodes().len() == 2 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let gone_after = stopped.elapsed();
    assert!(gone_after > EVERY * 2, "gone too early: {gone_after:?}");
    assert!(
        gone_after <= EVERY * 3 + Duration::from_millis(5),
        "{gone_after:?}"
    );
    assert_eq!(ids(&n1.cluster().nodes()), ["n1"]);
    let view = n1.cluster().view();
    assert_eq!(view.gone.len(), 1);
    assert_eq!(view.gone[0].node_id, "n2");
    n1.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_acknowledged_publish_names_every_node_and_its_latency() {
    let transport = EmbeddedTransport::new();
    let (a, b, c, other) = (
        cache("countries"),
        cache("countries"),
        cache("countries"),
        cache("flags"),
    );
    let nodes = [
        start("n1", transport.clone(), &[&a]).await,
        start("n2", transport.clone(), &[&b]).await,
        start("n3", transport.clone(), &[&c]).await,
        // Holds another cache only: not waited for.
        start("n4", transport.clone(), &[&other]).await,
    ];
    let watcher = Cluster::builder(transport.clone())
        .heartbeat_interval(EVERY)
        .start()
        .await
        .unwrap();
    let publisher = Publisher::new(transport.clone());
    let published = publisher
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    let acks = published
        .applied_by(&watcher, Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    assert_eq!(
        acks.nodes
            .iter()
            .map(|n| n.node_id.as_str())
            .collect::<Vec<_>>(),
        ["n1", "n2", "n3"]
    );
    assert!(acks.nodes.iter().all(|n| n.latency.is_some()));
    assert_eq!(
        acks.to_string().split(" in ").next(),
        Some("applied on 3/3 nodes")
    );
    for c in [&a, &b, &c] {
        assert!(holds(c, "de", Some("Germany")).await);
    }
    // A second publish, on a watcher that has settled by now.
    let published = publisher
        .insert("countries", [("fr", "France")])
        .await
        .unwrap();
    let acks = published
        .applied_by(&watcher, Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    assert_eq!(acks.applied(), 3);
    // The nodes' own view works the same.
    let published = nodes[0]
        .publisher()
        .invalidate("countries", ["fr"])
        .await
        .unwrap();
    let acks = published
        .applied_by(&nodes[1].cluster(), Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    assert_eq!(acks.applied(), 3);
    watcher.shutdown().await;
    for node in &nodes {
        node.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn a_lagging_node_is_flagged_and_left_pending() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let slow_transport = FaultyTransport::new(transport.inner());
    let (a, b, c) = (cache("countries"), cache("countries"), cache("countries"));
    let nodes = [
        start("n1", transport.clone(), &[&a]).await,
        start("n2", transport.clone(), &[&b]).await,
        start("n3", slow_transport.clone(), &[&c]).await,
    ];
    let publisher = Publisher::new(transport.inner());
    let first = publisher
        .insert_versioned("countries", [("de", "Germany", Some(5))])
        .await
        .unwrap();
    let acks = first
        .applied_by(&nodes[0].cluster(), Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");

    slow_transport.stall(true);
    let second = publisher
        .insert_versioned("countries", [("de", "Deutschland", Some(9))])
        .await
        .unwrap();
    let acks = second
        .applied_by(&nodes[0].cluster(), Duration::from_millis(500))
        .await;
    assert!(!acks.is_complete());
    assert_eq!(acks.applied(), 2);
    assert_eq!(acks.pending().collect::<Vec<_>>(), ["n3"]);
    assert!(acks.elapsed >= Duration::from_millis(500));
    eventually("n3 flagged as lagging", async || {
        let view = nodes[0].cluster().view();
        view.node("n3")
            .is_some_and(|n| n.lagging && n.caches[0].lag == Some(4))
            && !view.node("n1").unwrap().lagging
            && !view.node("n2").unwrap().lagging
    })
    .await;
    let view = nodes[0].cluster().view();
    assert!(!view.is_converged());
    assert_eq!(view.caches[0].newest_version, Some(9));
    assert_eq!(view.caches[0].behind, 1);
    let diverged = view.diverged(Duration::ZERO);
    assert_eq!(diverged.len(), 1);
    assert_eq!(diverged[0].0.node_id, "n3");
    assert!(view.diverged(Duration::from_secs(3600)).is_empty());

    // Versions, as an outbox's relay publishes them.
    let acks = nodes[1]
        .cluster()
        .applied_version("countries", 9, Duration::from_millis(300))
        .await;
    assert_eq!(acks.pending().collect::<Vec<_>>(), ["n3"]);
    slow_transport.stall(false);
    let acks = nodes[1]
        .cluster()
        .applied_version("countries", 9, Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    let acks = second
        .applied_by(&nodes[2].cluster(), Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    eventually("converged", async || {
        nodes[0].cluster().view().is_converged()
    })
    .await;
    for node in &nodes {
        node.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn a_verifying_node_takes_only_signed_heartbeats() {
    let transport = EmbeddedTransport::new();
    let ring = Keyring::new("k1", b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    let (a, b) = (cache("countries"), cache("countries"));
    let signed = |id: &str, c: &Cache| {
        Node::builder(id, transport.clone())
            .heartbeat_interval(EVERY)
            .verify_signatures(ring.clone())
            .register(c)
    };
    let n1 = signed("n1", &a).start().await.unwrap();
    let n2 = signed("n2", &b).start().await.unwrap();
    // Each must have heard the other: the forged heartbeat below is a
    // copy of n1's entry as n2 holds it.
    eventually("both seen", async || {
        n1.cluster().nodes().len() == 2 && n2.cluster().nodes().len() == 2
    })
    .await;
    // An unsigned node, and a forged heartbeat, are refused.
    let c = cache("countries");
    let unsigned = start("intruder", transport.clone(), &[&c]).await;
    let mut forged = n2.cluster().nodes()[1].clone();
    forged.node_id = "forged".into();
    let plain = Codec::new(1 << 20, None);
    let payload = crate::cluster::seal_message(&plain, &Message::Heartbeat(forged)).unwrap();
    transport
        .publish_heartbeat("cache-sync", Bytes::from(payload))
        .await
        .unwrap();
    eventually("refusals counted", async || {
        n1.status().heartbeats_rejected >= 2
    })
    .await;
    assert_eq!(ids(&n1.cluster().nodes()), ["n1", "n2"]);
    // The unverifying node reads the signed ones.
    eventually("the intruder sees all", async || {
        unsigned.cluster().nodes().len() == 3
    })
    .await;
    for n in [n1, n2, unsigned] {
        n.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn requests_and_garbage_on_the_channel_change_nothing() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let n1 = start("n1", transport.clone(), &[&a]).await;
    // Subscribed once its own first heartbeat comes back.
    eventually("subscribed", async || n1.status().heartbeats_received >= 1).await;
    let plain = Codec::new(1 << 20, None);
    // Garbage of every kind, and a flood of requests for a cache it
    // does not hold and for targets never reached.
    for payload in [
        Bytes::new(),
        Bytes::from_static(b"H"),
        Bytes::from_static(b"H{\"type\":\"heartbeat\"}"),
        Bytes::from_static(b"\x01\x02\x03"),
        Bytes::from(vec![b'H'; 2 << 20]),
        Bytes::from(format!("H{}{}", "[".repeat(10_000), "]".repeat(10_000))),
    ] {
        transport
            .publish_heartbeat("cache-sync", payload)
            .await
            .unwrap();
    }
    eventually("garbage read", async || {
        n1.status().heartbeats_rejected >= 6
    })
    .await;
    let base = n1.status().heartbeats_received;
    for i in 0..900u64 {
        // A third are roll calls, which every node answers: the
        // early-heartbeat gap must bound the answers.
        let request = if i % 3 == 0 {
            Request::roll_call("cache-sync")
        } else {
            Request {
                topic: "cache-sync".into(),
                cache: Some(if i % 2 == 0 { "countries" } else { "nope" }.into()),
                target: Some(crate::cluster::Target::Seq {
                    publisher: i,
                    seq: u64::MAX,
                }),
                within_ms: u64::MAX,
                asker: i,
                id: i,
                reply: i % 2 == 0,
            }
        };
        let payload = crate::cluster::seal_message(&plain, &Message::Request(request)).unwrap();
        transport
            .publish_heartbeat("cache-sync", Bytes::from(payload))
            .await
            .unwrap();
        // In steps the channel's buffer holds, with the node's answers.
        if i % 100 == 99 {
            eventually("read so far", async || {
                n1.status().heartbeats_received > base + i
            })
            .await;
        }
    }
    let s = n1.status();
    assert_eq!(s.heartbeats_rejected, 6);
    assert_eq!(s.events_received, 0);
    assert_eq!(s.losses, 0);
    assert!(n1.is_alive());
    // Early heartbeats are rate-limited: far fewer than the 300 roll calls.
    assert!(s.heartbeats_sent < 150, "{}", s.heartbeats_sent);
    n1.shutdown().await.unwrap();
}

#[tokio::test]
async fn heartbeats_off_leaves_a_view_of_one() {
    let transport = EmbeddedTransport::new();
    let (a, b) = (cache("countries"), cache("countries"));
    let n1 = Node::builder("n1", transport.clone())
        .heartbeat_interval(Duration::MAX)
        .register(&a)
        .start()
        .await
        .unwrap();
    let n2 = start("n2", transport.clone(), &[&b]).await;
    eventually("n2 sees nobody else", async || {
        n2.status().heartbeats_sent >= 3
    })
    .await;
    assert_eq!(ids(&n1.cluster().nodes()), ["n1"]);
    assert_eq!(ids(&n2.cluster().nodes()), ["n2"]);
    assert_eq!(n1.status().heartbeats_sent, 0);
    for n in [n1, n2] {
        n.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn heartbeat_interval_is_checked() {
    for bad in [
        Duration::ZERO,
        Duration::from_millis(9),
        Duration::from_secs(3601),
    ] {
        let err = Node::builder("n", EmbeddedTransport::new())
            .heartbeat_interval(bad)
            .start()
            .await
            .unwrap_err();
        assert!(err.is_config(), "{bad:?}: {err}");
    }
    for good in [
        Duration::from_millis(10),
        Duration::from_secs(3600),
        Duration::MAX,
    ] {
        let node = Node::builder("n", EmbeddedTransport::new())
            .heartbeat_interval(good)
            .start()
            .await
            .unwrap();
        node.shutdown().await.unwrap();
    }
    let err = Cluster::builder(EmbeddedTransport::new())
        .heartbeat_interval(Duration::ZERO)
        .start()
        .await
        .unwrap_err();
    assert!(err.is_config());
}

#[tokio::test]
async fn readiness_follows_the_quarantine() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = Node::builder("n1", transport.clone())
        .reorder_window(Duration::from_millis(300))
        .register(&a)
        .start()
        .await
        .unwrap();
    eventually("ready", async || node.is_ready()).await;
    assert!(node.is_alive());
    let b = cache("late");
    // A late registration quarantines that cache: not ready until its
    // window ends.
    node.register(&b).await.unwrap();
    assert!(!node.is_ready());
    assert_eq!(node.not_ready().len(), 1, "{:?}", node.not_ready());
    eventually("ready again", async || node.is_ready()).await;
    node.shutdown().await.unwrap();
    assert!(!node.is_ready());
    assert!(!node.is_alive());
}

/// Records the `cache_sync.apply` spans' fields, as a tracing exporter
/// would see them.
#[derive(Default, Clone)]
struct Spans(Arc<Mutex<Vec<SpanFields>>>);

type SpanFields = Vec<(String, String)>;

struct Fields<'a>(&'a mut Vec<(String, String)>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().to_owned(), format!("{value:?}")));
    }
}

impl tracing::Subscriber for Spans {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        let mut spans = self.0.lock().unwrap();
        let mut fields = vec![("name".to_owned(), span.metadata().name().to_owned())];
        span.record(&mut Fields(&mut fields));
        spans.push(fields);
        tracing::span::Id::from_u64(spans.len() as u64)
    }
    fn record(&self, span: &tracing::span::Id, values: &tracing::span::Record<'_>) {
        let mut spans = self.0.lock().unwrap();
        let fields = &mut spans[span.into_u64() as usize - 1];
        values.record(&mut Fields(fields));
    }
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test]
async fn each_applied_batch_is_one_span_with_cache_count_versions_and_latency() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(spans.clone());
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = Node::builder("n1", transport.clone())
        .heartbeat_interval(Duration::MAX)
        .register(&a)
        .start()
        .await
        .unwrap();
    Publisher::new(transport)
        .insert_versioned(
            "countries",
            [("de", "Germany", Some(7)), ("fr", "France", Some(3))],
        )
        .await
        .unwrap();
    eventually("applied", async || holds(&a, "de", Some("Germany")).await).await;
    let applied: Vec<_> = spans
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|f| f[0].1 == "cache_sync.apply")
        .cloned()
        .collect();
    assert_eq!(applied.len(), 1, "{applied:?}");
    let get = |k: &str| {
        applied[0]
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(get("cache").as_deref(), Some("\"countries\""));
    assert_eq!(get("events").as_deref(), Some("1"));
    assert_eq!(get("version.min").as_deref(), Some("3"));
    assert_eq!(get("version.max").as_deref(), Some("7"));
    assert!(get("latency_us").is_some());
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_does_not_wait_for_a_heartbeat_channel_that_hangs() {
    // Its heartbeat channel never answers, as a broker that is down until
    // a timeout: subscribing hangs, or (`hang_publish`) publishing does.
    for hang_publish in [false, true] {
        let transport = FaultyTransport::new(EmbeddedTransport::new());
        transport.hang_heartbeats(hang_publish);
        transport.hang_heartbeat_subscriptions(!hang_publish);
        let a = cache("countries");
        let node = start("n1", transport, &[&a]).await;
        tokio::time::sleep(EVERY * 2).await;
        tokio::time::timeout(Duration::from_secs(2), node.shutdown())
            .await
            .unwrap_or_else(|_| panic!("shutdown hung (hang_publish: {hang_publish})"))
            .unwrap();
    }
}

#[tokio::test]
async fn two_publishers_in_one_batch_are_both_acknowledged() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let a = cache("countries");
    let node = start("n1", transport.clone(), &[&a]).await;
    eventually("settled", async || {
        node.cluster()
            .settled_at()
            .is_some_and(|at| Instant::now() >= at)
    })
    .await;
    transport.stall(true);
    let first = Publisher::new(transport.inner());
    let second = Publisher::new(transport.inner());
    let from_first = first
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    let from_second = second
        .insert("countries", [("fr", "France")])
        .await
        .unwrap();
    // Released together: one batch, one run, two publishers.
    transport.stall(false);
    for published in [from_first, from_second] {
        let acks = published
            .applied_by(&node.cluster(), Duration::from_secs(5))
            .await;
        assert!(acks.is_complete(), "{acks:?}");
    }
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_view_that_cannot_hear_the_channel_never_calls_a_publish_complete() {
    // Subscribing to the heartbeat channel hangs: the node hears nobody,
    // so it cannot know who else holds the cache.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.hang_heartbeat_subscriptions(true);
    let a = cache("countries");
    let node = start("n1", transport.clone(), &[&a]).await;
    let published = node
        .publisher()
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    eventually("applied here", async || {
        holds(&a, "de", Some("Germany")).await
    })
    .await;
    // Longer than any settling: only not hearing the channel keeps it
    // from calling itself complete.
    let acks = published
        .applied_by(&node.cluster(), Duration::from_millis(1500))
        .await;
    assert!(!acks.is_complete(), "{acks:?}");
    assert_eq!(acks.applied(), 1, "it did apply it itself");
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn heartbeats_from_another_topic_are_refused() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = start("n1", transport.clone(), &[&a]).await;
    eventually("subscribed", async || {
        node.status().heartbeats_received >= 1
    })
    .await;
    let mut foreign = node.cluster().nodes()[0].clone();
    foreign.node_id = "elsewhere".into();
    foreign.topic = "other-topic".into();
    let plain = Codec::new(1 << 20, None);
    let payload = crate::cluster::seal_message(&plain, &Message::Heartbeat(foreign)).unwrap();
    transport
        .publish_heartbeat("cache-sync", Bytes::from(payload))
        .await
        .unwrap();
    eventually("refused", async || node.status().heartbeats_rejected >= 1).await;
    assert_eq!(ids(&node.cluster().nodes()), ["n1"]);
    node.shutdown().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_forged_endless_interval_still_expires() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    // A long interval of its own: hours pass on the paused clock.
    let node = Node::builder("n1", transport.clone())
        .heartbeat_interval(Duration::from_secs(600))
        .register(&a)
        .start()
        .await
        .unwrap();
    eventually("subscribed", async || {
        node.status().heartbeats_received >= 1
    })
    .await;
    let mut forged = node.cluster().nodes()[0].clone();
    forged.node_id = "forever".into();
    forged.interval_ms = u64::MAX;
    forged.started_at_us = u64::MAX;
    let plain = Codec::new(1 << 20, None);
    let payload = crate::cluster::seal_message(&plain, &Message::Heartbeat(forged)).unwrap();
    transport
        .publish_heartbeat("cache-sync", Bytes::from(payload))
        .await
        .unwrap();
    eventually("seen", async || node.cluster().nodes().len() == 2).await;
    // The longest interval a node can have is an hour: three of them.
    tokio::time::sleep(Duration::from_secs(3 * 3600 + 1)).await;
    assert_eq!(ids(&node.cluster().nodes()), ["n1"]);
    node.shutdown().await.unwrap();
}

// Real time (a node's uptime, which bounds how long it can have been behind,
// is read off the wall clock, which paused time does not move), and no
// slack: the bounds below follow from the order of observed events alone,
// however slow the machine.
#[tokio::test]
async fn a_node_stuck_while_versions_keep_coming_is_behind_for_as_long_as_it_is_stuck() {
    let fast = FaultyTransport::new(EmbeddedTransport::new());
    let slow = FaultyTransport::new(fast.inner());
    let (a, b) = (cache("countries"), cache("countries"));
    let n1 = start("n1", fast.clone(), &[&a]).await;
    let n2 = start("n2", slow.clone(), &[&b]).await;
    let publisher = Publisher::new(fast.inner());
    publisher
        .insert_versioned("countries", [("de", "v1", Some(1))])
        .await
        .unwrap();
    eventually("both at 1", async || n1.cluster().view().is_converged()).await;
    slow.stall(true);
    let stuck = Instant::now();
    publisher
        .insert_versioned("countries", [("de", "v", Some(2))])
        .await
        .unwrap();
    // From here the view knows n2 is behind: it has been since no later
    // than this.
    let lag = |n: &Node| n.cluster().view().node("n2").and_then(|n| n.caches[0].lag);
    eventually("n2 seen behind", async || lag(&n1).is_some_and(|l| l > 0)).await;
    let seen = Instant::now();
    for v in 3..=12u64 {
        publisher
            .insert_versioned("countries", [("de", "v", Some(v))])
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let before = Instant::now();
    let view = n1.cluster().view();
    let after = Instant::now();
    let behind = Duration::from_millis(view.node("n2").unwrap().caches[0].behind_ms.unwrap());
    // Behind since a moment between the stall and the view first showing
    // it, to the millisecond the view rounds down to.
    let (least, most) = (before - seen, after - stuck);
    assert!(
        behind + Duration::from_millis(1) >= least && behind <= most,
        "behind {behind:?}: at least {least:?} (since it was seen), at most {most:?} (since the stall)"
    );
    assert!(!view.diverged(Duration::from_millis(400)).is_empty());
    slow.stall(false);
    for n in [n1, n2] {
        n.shutdown().await.unwrap();
    }
}

// The view's lag timing: never one machine's clock against another's.

const HOUR_US: u64 = 3_600_000_000;

/// A heartbeat as a node whose clock reads `skew_us` ahead of the true
/// time (behind, if negative) would send it: it started two hours ago, and
/// its one cache reached `version` `age_ms` ago. Every stamp on its clock;
/// the age a duration.
fn skewed(id: &str, skew_us: i64, version: u64, age_ms: u64) -> Heartbeat {
    let clock = now_us().saturating_add_signed(skew_us);
    Heartbeat {
        node_id: id.into(),
        topic: "cache-sync".into(),
        started_at_us: clock - 2 * HOUR_US,
        sent_at_us: clock,
        interval_ms: 10_000,
        transport: "embedded".into(),
        consuming: true,
        ready: true,
        position: Position::default(),
        losses: 0,
        live_nodes: None,
        freshness_age_ms: None,
        caches: vec![crate::cluster::CacheHeartbeat {
            name: "countries".into(),
            version: Some(version),
            version_at_us: Some(clock.saturating_sub(age_ms.saturating_mul(1000))),
            version_age_ms: Some(age_ms),
            entries: 1,
            loss_resyncs: 0,
            quarantined: false,
            last_latency_us: None,
            freshness_age_ms: None,
            audit: None,
        }],
    }
}

async fn forge(transport: &EmbeddedTransport, h: Heartbeat) {
    let plain = Codec::new(1 << 20, None);
    let payload = crate::cluster::seal_message(&plain, &Message::Heartbeat(h)).unwrap();
    transport
        .publish_heartbeat("cache-sync", Bytes::from(payload))
        .await
        .unwrap();
}

async fn fresh_watcher(transport: &EmbeddedTransport) -> Cluster {
    Cluster::builder(transport.clone())
        .heartbeat_interval(EVERY)
        .start()
        .await
        .unwrap()
}

/// How long the watcher says `node`'s cache has been behind, once it sees
/// `count` nodes.
async fn behind_ms(watcher: &Cluster, node: &str, count: usize) -> u64 {
    eventually("every node seen", async || {
        watcher.view().nodes.len() == count
    })
    .await;
    let view = watcher.view();
    let c = &view.node(node).unwrap().caches[0];
    assert!(c.lag.unwrap() > 0, "{view:?}");
    c.behind_ms.unwrap()
}

#[tokio::test]
async fn a_skewed_clock_neither_inflates_nor_deflates_how_long_a_node_is_behind() {
    for skew in [-(HOUR_US as i64), HOUR_US as i64] {
        for age_ms in [400, 30_000] {
            let transport = EmbeddedTransport::new();
            let watcher = fresh_watcher(&transport).await;
            let started = Instant::now();
            // "ahead" took version 10 `age_ms` ago and its clock is off by
            // an hour; "behind" holds 9, its clock off the other way.
            forge(&transport, skewed("ahead", skew, 10, age_ms)).await;
            forge(&transport, skewed("behind", -skew, 9, 5)).await;
            let behind = behind_ms(&watcher, "behind", 2).await;
            let slack = u64::try_from(started.elapsed().as_millis()).unwrap() + 50;
            assert!(
                behind >= age_ms && behind <= age_ms + slack,
                "skew {skew} µs, age {age_ms} ms: behind for {behind} ms"
            );
            let view = watcher.view();
            let lag = Duration::from_millis(age_ms);
            assert!(view.diverged(lag + Duration::from_secs(5)).is_empty());
            assert_eq!(view.diverged(lag / 2).len(), 1);
            // Its next heartbeat, its clock 300 ms on, the age too: the
            // same instant, so the same answer as time goes by.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut next = skewed("ahead", skew + 300_000, 10, age_ms + 300);
            next.started_at_us -= 300_000;
            let sent = next.sent_at_us;
            forge(&transport, next).await;
            eventually("the next heartbeat", async || {
                watcher
                    .nodes()
                    .iter()
                    .any(|h| h.node_id == "ahead" && h.sent_at_us == sent)
            })
            .await;
            let behind = watcher.view().node("behind").unwrap().caches[0]
                .behind_ms
                .unwrap();
            let elapsed = u64::try_from(started.elapsed().as_millis()).unwrap();
            assert!(
                behind >= age_ms + 300 && behind <= age_ms + elapsed + 50,
                "skew {skew}: {behind} ms after {elapsed} ms"
            );
            watcher.shutdown().await;
        }
    }
}

#[tokio::test]
async fn the_newest_heartbeat_of_a_skewed_node_still_wins() {
    for skew in [-(HOUR_US as i64), HOUR_US as i64] {
        let transport = EmbeddedTransport::new();
        let watcher = fresh_watcher(&transport).await;
        let first = skewed("n", skew, 4, 10);
        let mut second = first.clone();
        second.sent_at_us += 100_000;
        second.caches[0].version = Some(5);
        forge(&transport, first.clone()).await;
        forge(&transport, second).await;
        // A redelivery of the first, after the second.
        forge(&transport, first).await;
        let version = async || {
            watcher
                .nodes()
                .into_iter()
                .find(|h| h.node_id == "n")
                .and_then(|h| h.caches.first().cloned())
                .and_then(|c| c.version)
        };
        eventually("the second heartbeat", async || version().await == Some(5)).await;
        // The channel is ordered: once a later message is in, so is the
        // redelivery; it changed nothing.
        forge(&transport, skewed("marker", 0, 1, 1)).await;
        eventually("read past it", async || watcher.nodes().len() == 2).await;
        assert_eq!(version().await, Some(5), "skew {skew}");
        watcher.shutdown().await;
    }
}

#[tokio::test]
async fn a_watcher_that_just_started_sees_a_node_stuck_for_an_hour() {
    let transport = EmbeddedTransport::new();
    let watcher = fresh_watcher(&transport).await;
    forge(&transport, skewed("ahead", 0, 10, 3_600_000)).await;
    forge(&transport, skewed("stuck", 0, 9, 3_700_000)).await;
    let behind = behind_ms(&watcher, "stuck", 2).await;
    assert!((3_600_000..3_610_000).contains(&behind), "{behind}");
    assert_eq!(
        watcher.view().diverged(Duration::from_secs(59 * 60)).len(),
        1
    );
    watcher.shutdown().await;
}

#[tokio::test]
async fn a_forged_age_is_believed_only_up_to_the_uptime_and_a_day() {
    // An age beyond the sender's uptime (two hours): two hours.
    let transport = EmbeddedTransport::new();
    let watcher = fresh_watcher(&transport).await;
    forge(&transport, skewed("liar", 0, 10, u64::MAX)).await;
    let mut stuck = skewed("stuck", 0, 9, 1);
    stuck.started_at_us = 0;
    forge(&transport, stuck.clone()).await;
    let behind = behind_ms(&watcher, "stuck", 2).await;
    assert!((7_200_000..7_210_000).contains(&behind), "{behind}");
    watcher.shutdown().await;
    // And one whose stamps claim decades of uptime: a day.
    let transport = EmbeddedTransport::new();
    let watcher = fresh_watcher(&transport).await;
    let mut liar = skewed("liar", 0, 10, u64::MAX);
    liar.started_at_us = 0;
    forge(&transport, liar).await;
    forge(&transport, stuck).await;
    let behind = behind_ms(&watcher, "stuck", 2).await;
    assert!((86_400_000..86_410_000).contains(&behind), "{behind}");
    // A node is never behind for longer than it has been up: two hours.
    forge(&transport, {
        let mut h = skewed("young", 0, 9, 1);
        h.sent_at_us += 1;
        h
    })
    .await;
    let behind = behind_ms(&watcher, "young", 3).await;
    assert!((7_200_000..7_210_000).contains(&behind), "{behind}");
    watcher.shutdown().await;
}

#[tokio::test]
async fn a_heartbeat_gives_how_long_ago_each_version_rose() {
    let transport = EmbeddedTransport::new();
    let a = cache("countries");
    let node = start("n1", transport.clone(), &[&a]).await;
    Publisher::new(transport.clone())
        .insert_versioned("countries", [("de", "Germany", Some(3))])
        .await
        .unwrap();
    eventually("applied", async || holds(&a, "de", Some("Germany")).await).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let own = node.cluster().nodes().remove(0);
    let age = own.caches[0].version_age_ms.unwrap();
    assert!((200..10_000).contains(&age), "{age}");
    node.shutdown().await.unwrap();
}

/// A watcher that has waited out its roll call's grace, but holds fewer
/// nodes than a node it heard says are live, has not heard every node: an
/// acknowledgement through it stays incomplete (the one-shot CLI once said
/// "applied on 1/1 nodes" of three, on a loaded machine).
#[tokio::test(start_paused = true)]
async fn a_view_holding_fewer_nodes_than_a_node_counts_is_still_settling() {
    const SLOW: Duration = Duration::from_secs(2);
    let transport = EmbeddedTransport::new();
    let quiet = [
        FaultyTransport::new(transport.clone()),
        FaultyTransport::new(transport.clone()),
    ];
    let (a, b, c) = (cache("countries"), cache("countries"), cache("countries"));
    let start = async |id: &str, t: Arc<dyn Transport>, cache: &Cache| {
        Node::builder(id, t)
            .heartbeat_interval(SLOW)
            .reorder_window(Duration::ZERO)
            .register(cache)
            .start()
            .await
            .unwrap()
    };
    let n1 = start("n1", Arc::new(transport.clone()), &a).await;
    let n2 = start("n2", Arc::new(quiet[0].clone()), &b).await;
    let n3 = start("n3", Arc::new(quiet[1].clone()), &c).await;
    eventually("n1 knows all three", async || {
        n1.cluster().live_nodes() == 3
    })
    .await;
    // n2 and n3 go on applying events, but nothing they send on the
    // heartbeat channel arrives: to a watcher starting now they are as
    // nodes slow to answer its roll call. n1 still counts them live.
    for q in &quiet {
        q.drop_heartbeats(true);
    }
    let watcher = Cluster::builder(transport.clone())
        .heartbeat_interval(SLOW)
        .start()
        .await
        .unwrap();
    let published = Publisher::new(transport.clone())
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    // Past the roll call's 500 ms, short of 1.5 intervals.
    let acks = published
        .applied_by(&watcher, Duration::from_millis(1200))
        .await;
    assert_eq!(acks.incomplete, Some(Incomplete::Settling), "{acks}");
    assert_eq!(acks.nodes.len(), 1, "{acks}");
    assert_eq!(watcher.unsettled(), Some(Incomplete::Settling));
    for q in &quiet {
        q.drop_heartbeats(false);
    }
    let acks = published.applied_by(&watcher, Duration::from_secs(5)).await;
    assert!(acks.is_complete(), "{acks}");
    assert_eq!(acks.applied(), 3, "{acks}");
    watcher.shutdown().await;
    for n in [n1, n2, n3] {
        n.shutdown().await.unwrap();
    }
}
