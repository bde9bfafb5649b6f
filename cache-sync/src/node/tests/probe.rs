//! Key probes: which node holds which version of a key.

use std::time::Duration;

use super::*;
use crate::cluster::Cluster;
use crate::status::TraceEvent;

use super::cluster::{EVERY, start};

fn traced(name: &str) -> Cache {
    SyncedCache::builder(name, moka::future::Cache::new(100))
        .trace_bytes(1 << 16)
        .build()
        .unwrap()
}

/// The case: three nodes, one held back by its transport, shows
/// at its old version while the others show the new one; with its cache
/// traced, its answer carries the key's history there.
#[tokio::test]
async fn a_held_back_node_shows_its_old_version() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let slow = FaultyTransport::new(transport.inner());
    let (a, b, c) = (cache("countries"), cache("countries"), traced("countries"));
    let nodes = [
        start("n1", transport.clone(), &[&a]).await,
        start("n2", transport.clone(), &[&b]).await,
        start("n3", slow.clone(), &[&c]).await,
    ];
    let publisher = Publisher::new(transport.inner());
    let acks = publisher
        // Another key at a higher version: the probe is of the key's
        // version, not the cache's.
        .insert_versioned(
            "countries",
            [("de", "Germany", Some(5)), ("fr", "France", Some(12))],
        )
        .await
        .unwrap()
        .applied_by(&nodes[0].cluster(), Duration::from_secs(10))
        .await;
    assert!(acks.is_complete(), "{acks:?}");
    slow.stall(true);
    publisher
        .insert_versioned("countries", [("de", "Deutschland", Some(9))])
        .await
        .unwrap();
    eventually("n1 and n2 at 9", async || {
        a.get("de").await.as_deref() == Some("Deutschland")
            && b.get("de").await.as_deref() == Some("Deutschland")
    })
    .await;

    let watcher = Cluster::builder(transport.inner())
        .heartbeat_interval(EVERY)
        .start()
        .await
        .unwrap();
    let probe = watcher
        .probe("countries", "de", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(probe.incomplete, None, "{probe:?}");
    let versions: Vec<_> = probe
        .nodes
        .iter()
        .map(|n| {
            let s = n.state.as_ref().unwrap();
            (n.node_id.as_str(), s.held, s.version)
        })
        .collect();
    assert_eq!(
        versions,
        [
            ("n1", true, Some(9)),
            ("n2", true, Some(9)),
            ("n3", true, Some(5))
        ]
    );
    assert!(!probe.agrees());
    assert_eq!(probe.newest(), Some(9));
    assert_eq!(probe.behind().collect::<Vec<_>>(), ["n3"]);
    let text = probe.to_string();
    assert!(text.contains("n3: holds, version 5  <- differs"), "{text}");
    assert!(text.ends_with("the nodes disagree"), "{text}");
    let n3 = probe.nodes[2].state.as_ref().unwrap();
    assert_eq!(
        n3.trace.last().map(|r| (r.event, r.version)),
        Some((TraceEvent::Refreshed, Some(5)))
    );
    assert!(
        probe.nodes[0].state.as_ref().unwrap().trace.is_empty(),
        "untraced"
    );

    // Released, every node agrees.
    slow.stall(false);
    eventually("n3 at 9", async || {
        c.get("de").await.as_deref() == Some("Deutschland")
    })
    .await;
    let probe = nodes[0]
        .cluster()
        .probe("countries", "de", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(probe.agrees() && probe.is_complete(), "{probe:?}");
    for n in nodes {
        n.shutdown().await.unwrap();
    }
}

/// A key no node has seen, one of the wrong type, one too large; a cache
/// no node holds.
#[tokio::test]
async fn absent_and_foreign_keys_and_an_unheld_cache() {
    let transport = EmbeddedTransport::new();
    let ids: SyncedCache<u64, String> = SyncedCache::new("ids", moka::future::Cache::new(10));
    let n1 = Node::builder("n1", transport.clone())
        .heartbeat_interval(EVERY)
        .register(&ids)
        .start()
        .await
        .unwrap();
    let cluster = n1.cluster();
    let probe = cluster
        .probe("ids", &7u64, Duration::from_secs(10))
        .await
        .unwrap();
    let s = probe.nodes[0].state.as_ref().unwrap();
    assert_eq!((s.held, s.version, &s.error), (false, None, &None));
    assert!(probe.agrees());
    ids.insert(7, "seven".into()).await;
    let probe = cluster
        .probe("ids", &7u64, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(probe.nodes[0].state.as_ref().unwrap().held);
    let probe = cluster
        .probe("ids", "abc", Duration::from_secs(10))
        .await
        .unwrap();
    let s = probe.nodes[0].state.as_ref().unwrap();
    assert!(
        s.error
            .as_deref()
            .unwrap()
            .contains("not one of this cache's"),
        "{s:?}"
    );
    let huge = "k".repeat(5000);
    assert!(
        cluster
            .probe("ids", &huge, Duration::from_secs(1))
            .await
            .unwrap_err()
            .is_config()
    );
    let probe = cluster
        .probe("nobody", &1u64, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(probe.incomplete, Some(crate::cluster::Incomplete::NoNode));
    n1.shutdown().await.unwrap();
}

/// Issue 35, item 9: a key of another type than the cache's, which every
/// node refuses, is no agreement (it used to say "all 2 nodes agree").
#[tokio::test]
async fn a_probe_every_node_refused_does_not_agree() {
    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    let mut caches = Vec::new();
    for id in ["n1", "n2"] {
        let ids: SyncedCache<u64, String> = SyncedCache::new("ids", moka::future::Cache::new(10));
        nodes.push(
            Node::builder(id, transport.clone())
                .heartbeat_interval(EVERY)
                .register(&ids)
                .start()
                .await
                .unwrap(),
        );
        caches.push(ids);
    }
    let cluster = nodes[0].cluster();
    eventually("both nodes in the view", async || {
        cluster.nodes().len() == 2
    })
    .await;
    let probe = cluster
        .probe("ids", "abc", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(probe.is_complete(), "{probe:?}");
    assert!(!probe.agrees(), "{probe}");
    assert_eq!(probe.refused().collect::<Vec<_>>(), ["n1", "n2"]);
    let text = probe.to_string();
    assert!(
        text.ends_with("2 of 2 nodes could not read the key"),
        "{text}"
    );
    // The key's own type: they agree.
    let probe = cluster
        .probe("ids", &7u64, Duration::from_secs(10))
        .await
        .unwrap();
    assert!(probe.agrees() && probe.is_complete(), "{probe}");
    for n in nodes {
        n.shutdown().await.unwrap();
    }
}

/// Probes travel signed: verifying nodes answer a signing party, and
/// ignore an unsigned one (which sees them without an answer).
#[tokio::test]
async fn verifying_nodes_answer_only_signed_probes() {
    let transport = EmbeddedTransport::new();
    let ring = Keyring::new("k1", b"0123456789abcdef0123456789abcdef".to_vec()).unwrap();
    let a = cache("countries");
    let n1 = Node::builder("n1", transport.clone())
        .heartbeat_interval(EVERY)
        .verify_signatures(ring.clone())
        .register(&a)
        .start()
        .await
        .unwrap();
    let signed = Cluster::builder(transport.clone())
        .heartbeat_interval(EVERY)
        .verify_signatures(ring)
        .start()
        .await
        .unwrap();
    let probe = signed
        .probe("countries", "de", Duration::from_secs(10))
        .await
        .unwrap();
    assert!(probe.nodes[0].state.is_some(), "{probe:?}");
    let rejected = n1.status().heartbeats_rejected;
    let unsigned = Cluster::builder(transport.clone())
        .heartbeat_interval(EVERY)
        .start()
        .await
        .unwrap();
    eventually("the unsigned party sees n1", async || {
        unsigned.nodes().len() == 1
    })
    .await;
    let probe = unsigned
        .probe("countries", "de", Duration::from_millis(500))
        .await
        .unwrap();
    assert_eq!(probe.nodes[0].state, None, "{probe:?}");
    assert_eq!(probe.incomplete, Some(crate::cluster::Incomplete::Pending));
    assert!(
        probe
            .to_string()
            .ends_with("incomplete: some nodes did not answer"),
        "{probe}"
    );
    assert!(n1.status().heartbeats_rejected > rejected);
    n1.shutdown().await.unwrap();
}
