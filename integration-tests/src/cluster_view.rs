//! Cluster-view scenarios, run on every transport through the conformance
//! [`Fixture`]s: heartbeats make every node visible to every party within
//! two intervals, an acknowledged publish completes, a key probe finds
//! every node at the last version, a node that stops is
//! gone after three intervals, and readiness follows a paused broker.

use std::time::Duration;

use cache_sync::{Node, Publisher, SyncedCache, cluster::Cluster};
use tokio::time::Instant;

use crate::conformance::Fixture;

/// Short, so the scenarios take seconds; long enough for a broker's latency.
pub const EVERY: Duration = Duration::from_millis(250);

type Cache = SyncedCache<String, String>;

async fn node(fixture: &dyn Fixture, id: &str, topic: &str) -> (Node, Cache) {
    let cache: Cache = SyncedCache::new("countries", moka::future::Cache::new(100));
    let node = fixture
        .configure(Node::builder(id, fixture.transport().await))
        .topic(topic)
        .heartbeat_interval(EVERY)
        // No quarantine after start (Pub/Sub has no history to replay):
        // the scenarios check values land in the caches.
        .reorder_window(Duration::ZERO)
        .register(&cache)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{}: node {id}: {e}", fixture.name()));
    (node, cache)
}

/// A topic of the scenario's own, so the broker's other tests' nodes are
/// not in its view.
fn topic(fixture: &dyn Fixture, scenario: &str) -> String {
    format!(
        "cluster-{scenario}-{}-{}",
        fixture.name(),
        std::process::id()
    )
}

async fn watcher(fixture: &dyn Fixture, topic: &str) -> Cluster {
    Cluster::builder(fixture.transport().await)
        .topic(topic)
        .heartbeat_interval(EVERY)
        .observer("test-watcher")
        .start()
        .await
        .unwrap_or_else(|e| panic!("{}: watcher: {e}", fixture.name()))
}

/// Three nodes and a watcher: everyone sees the three within two heartbeat
/// intervals of the last start, and an acknowledged publish completes on
/// all three, with a latency for each.
pub async fn converges_and_acknowledges(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let topic = topic(fixture, "acks");
    let watcher = watcher(fixture, &topic).await;
    let mut nodes = Vec::new();
    for i in 0..3 {
        nodes.push(node(fixture, &format!("node-{i}"), &topic).await);
    }
    let started = Instant::now();
    // RocketMQ's push consumer reads a new subscription from the end only
    // once its first rebalance has run (seconds): heartbeats sent before
    // that are not delivered to it, so it is given until then.
    let bound = if name == "rocketmq" {
        Duration::from_secs(20)
    } else {
        EVERY * 2
    };
    for view in nodes
        .iter()
        .map(|(n, _)| n.cluster())
        .chain([watcher.clone()])
    {
        while view.nodes().len() < 3 {
            assert!(
                started.elapsed() <= bound,
                "{name}: the view of {:?} holds {:?} after {bound:?}",
                view.view().observer,
                view.nodes().iter().map(|h| &h.node_id).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    eprintln!(
        "{name}: every view holds 3 nodes after {:?}",
        started.elapsed()
    );
    let publisher = Publisher::builder(fixture.transport().await)
        .topic(&topic)
        .build()
        .expect("publisher");
    for round in 0..3 {
        let published = crate::conformance::retry(|| {
            publisher.insert_versioned(
                "countries",
                [("de".to_owned(), format!("v{round}"), Some(round + 1))],
            )
        })
        .await;
        let acks = published
            .applied_by(&watcher, Duration::from_secs(10))
            .await;
        assert!(
            acks.is_complete() && acks.applied() == 3,
            "{name}: {acks:?}"
        );
        assert!(
            acks.nodes.iter().all(|n| n.latency.is_some()),
            "{name}: {acks:?}"
        );
        eprintln!("{name}: {acks}");
        for (_, cache) in &nodes {
            assert_eq!(
                cache.get(&"de".to_owned()).await.as_deref(),
                Some(format!("v{round}").as_str()),
                "{name}: applied_by returned before the value was in a cache"
            );
        }
        // Versions, as a relay would wait for an outbox's.
        let acks = watcher
            .applied_version("countries", round + 1, Duration::from_secs(10))
            .await;
        assert!(
            acks.is_complete() && acks.applied() == 3,
            "{name}: {acks:?}"
        );
    }
    // The key probe (issue 24), over the same channel: every node holds
    // the key at the last version.
    let probe = watcher
        .probe("countries", "de", Duration::from_secs(10))
        .await
        .unwrap_or_else(|e| panic!("{name}: probe: {e}"));
    assert!(probe.is_complete() && probe.agrees(), "{name}: {probe}");
    let states: Vec<_> = probe
        .nodes
        .iter()
        .map(|n| n.state.as_ref().map(|s| (s.held, s.version)))
        .collect();
    assert_eq!(states, vec![Some((true, Some(3))); 3], "{name}: {probe}");
    eprintln!("{name}: {probe}");
    for (node, _) in &nodes {
        let s = node.status();
        assert_eq!(s.heartbeats_rejected, 0, "{name}");
        assert!(s.heartbeats_sent > 0, "{name}");
    }
    watcher.shutdown().await;
    for (node, _) in nodes {
        node.shutdown().await.expect("shutdown");
    }
}

/// A node that stops (dropped without a word, as a killed process) leaves
/// every view after three intervals, not before two.
pub async fn a_stopped_node_is_gone_after_three_intervals(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let topic = topic(fixture, "gone");
    let (a, _ca) = node(fixture, "stays", &topic).await;
    let (b, cb) = node(fixture, "stops", &topic).await;
    // RocketMQ delivers to a new heartbeat subscription only after its
    // first rebalance (seconds): `eventually`'s bound is too short there.
    let seen_by = Instant::now() + Duration::from_secs(60);
    while a.cluster().nodes().len() < 2 {
        assert!(Instant::now() < seen_by, "{name}: both never seen");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its last heartbeat may be in flight: time from the one it last sent.
    let last_sent = b.status().heartbeats_sent;
    crate::eventually(&format!("{name}: a fresh heartbeat"), async || {
        b.status().heartbeats_sent > last_sent
    })
    .await;
    drop(b);
    drop(cb);
    let stopped = Instant::now();
    while a.cluster().nodes().len() == 2 {
        assert!(
            stopped.elapsed() < EVERY * 5,
            "{name}: a stopped node still in the view after {:?}",
            stopped.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let after = stopped.elapsed();
    eprintln!("{name}: stopped node gone from the view after {after:?}");
    assert!(
        after >= EVERY * 2,
        "{name}: gone too early, after {after:?}"
    );
    let view = a.cluster().view();
    assert_eq!(view.gone.len(), 1, "{name}: {view:?}");
    assert_eq!(view.gone[0].node_id, "stops");
    a.shutdown().await.expect("shutdown");
}

/// While the broker is paused (SIGSTOP), every node reports itself not
/// ready within the bound its transport documents for an unhealthy broker;
/// once it is resumed, every node is ready again and every view holds
/// every node, each saying it is ready.
pub async fn readiness_follows_a_paused_broker(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let topic = topic(fixture, "ready");
    let (a, _ca) = node(fixture, "ready-a", &topic).await;
    let (b, _cb) = node(fixture, "ready-b", &topic).await;
    for n in [&a, &b] {
        crate::eventually(&format!("{name}: {} ready", n.id()), async || n.is_ready()).await;
    }
    if !fixture.pause() {
        crate::conformance::cannot_run(name, "a paused broker");
    }
    let paused = Instant::now();
    // A paused broker answers nothing; clients notice when a request or a
    // keep-alive times out, which takes longer than a killed one's reset.
    let bound = Duration::from_secs(30);
    for n in [&a, &b] {
        while n.is_ready() {
            if paused.elapsed() > bound {
                fixture.resume();
                panic!(
                    "{name}: {} still ready {bound:?} into a broker pause",
                    n.id()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    eprintln!(
        "{name}: both nodes not ready {:?} into the pause",
        paused.elapsed()
    );
    fixture.resume();
    for n in [&a, &b] {
        crate::eventually(&format!("{name}: {} ready again", n.id()), async || {
            n.is_ready()
        })
        .await;
        crate::eventually(&format!("{name}: {} sees both again", n.id()), async || {
            let view = n.cluster().view();
            view.nodes.len() == 2 && view.nodes.iter().all(|v| v.ready)
        })
        .await;
    }
    a.shutdown().await.expect("shutdown");
    b.shutdown().await.expect("shutdown");
}
