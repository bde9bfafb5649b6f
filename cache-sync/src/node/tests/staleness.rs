//! A cache's staleness bound on reads, held to its node's freshness
//! bound: within it reads come from memory; past it they go to the source
//! and nothing is cached (or, serving, are served and counted); with no
//! node to prove anything, every read is past it.

use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

use super::freshness::node_on;
use super::*;

const MAX: Duration = Duration::from_millis(200);

fn bounded(name: &str, serving: bool) -> Cache {
    let b = SyncedCache::builder(name, moka::future::Cache::new(100));
    let b = if serving {
        b.max_staleness_serving(MAX)
    } else {
        b.max_staleness(MAX)
    };
    b.build().unwrap()
}

/// Within the bound, memory; past it (the tail unanswered, as across a
/// partition), the source on every read and nothing cached; within it
/// again, memory.
#[tokio::test]
async fn past_the_bound_reads_go_to_the_source_and_cache_nothing() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    eventually("a fresh bound", async || {
        node.status().freshness_age_ms.is_some_and(|a| a < 100)
    })
    .await;
    let loads = AtomicU32::new(0);
    let load = || async {
        loads.fetch_add(1, SeqCst);
        "db".to_owned()
    };
    assert_eq!(c.get_with("k".into(), load).await, "db");
    assert_eq!(c.get_with("k".into(), load).await, "db");
    assert_eq!(loads.load(SeqCst), 1, "the second read was memory's");
    assert_eq!(c.get("k").await.as_deref(), Some("db"));

    transport.hang_tails(true);
    eventually("past the bound", async || c.get("k").await.is_none()).await;
    let before = loads.load(SeqCst);
    for _ in 0..3 {
        assert_eq!(c.get_with("k2".into(), load).await, "db");
    }
    assert_eq!(
        loads.load(SeqCst),
        before + 3,
        "every read went to the source"
    );
    assert_eq!(c.peek("k2").await, None, "nothing cached past the bound");
    assert_eq!(
        c.peek("k").await.as_deref(),
        Some("db"),
        "what it held stays"
    );
    assert!(c.status().stale_bypasses >= 4);
    assert_eq!(c.status().stale_served, 0);

    transport.hang_tails(false);
    eventually("within the bound again", async || {
        c.get("k").await.as_deref() == Some("db")
    })
    .await;
    let before = loads.load(SeqCst);
    c.get_with("k".into(), load).await;
    assert_eq!(loads.load(SeqCst), before, "memory again");
}

/// `try_get` past the bound: an error that says so, never a miss (a miss
/// is a key the cache does not hold); within it, memory; past a serving
/// bound, the value; with no bound, never an error.
#[tokio::test]
async fn try_get_past_the_bound_is_a_stale_error() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    c.insert("k".into(), "v".into()).await;
    eventually("within the bound", async || {
        c.try_get("k")
            .await
            .is_ok_and(|v| v.as_deref() == Some("v"))
    })
    .await;
    assert_eq!(c.try_get("absent").await.unwrap(), None, "a plain miss");
    let before = c.status().stale_bypasses;

    transport.hang_tails(true);
    let err = loop {
        match c.try_get("k").await {
            Ok(v) => assert_eq!(v.as_deref(), Some("v")),
            Err(e) => break e,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(err.is_stale() && !err.is_disconnected(), "{err:?}");
    let crate::Error::Stale {
        cache: name,
        max,
        age,
    } = &err
    else {
        unreachable!()
    };
    assert_eq!((name.as_str(), *max), ("t", MAX));
    assert!(age.is_some_and(|a| a > MAX), "{age:?}");
    assert!(err.to_string().contains("\"t\""), "{err}");
    assert!(c.try_get("absent").await.unwrap_err().is_stale());
    assert!(c.status().stale_bypasses >= before + 2);

    transport.hang_tails(false);
    eventually("within the bound again", async || {
        c.try_get("k").await.is_ok_and(|v| v.is_some())
    })
    .await;
    node.shutdown().await.unwrap();
    let gone = c.try_get("k").await.unwrap_err();
    assert!(
        matches!(gone, crate::Error::Stale { age: None, .. }),
        "no node, no proof: {gone:?}"
    );

    let serving = bounded("s", true);
    serving.insert("k".into(), "v".into()).await;
    assert_eq!(serving.try_get("k").await.unwrap().as_deref(), Some("v"));
    assert_eq!(serving.status().stale_served, 1);
    let plain = cache("p");
    plain.insert("k".into(), "v".into()).await;
    assert_eq!(plain.try_get("k").await.unwrap().as_deref(), Some("v"));
}

/// A fallible loader's error past the bound is the caller's, counted.
#[tokio::test]
async fn past_the_bound_a_failed_load_is_returned() {
    let c = bounded("t", false);
    // No node holds it: nothing proves it fresh.
    let got = c
        .try_get_with("k".into(), || async { Err::<String, _>("down") })
        .await;
    assert_eq!(got.unwrap_err().as_ref(), &"down");
    let s = c.status();
    assert_eq!((s.stale_bypasses, s.load_failures), (1, 1));
}

/// Serving past the bound: memory all the same, each read counted.
#[tokio::test]
async fn a_serving_bound_serves_and_counts() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", true);
    let node = node_on(&transport, &c).await;
    eventually("a fresh bound", async || {
        node.status().freshness_age_ms.is_some_and(|a| a < 100)
    })
    .await;
    c.insert("k".into(), "v".into()).await;
    transport.hang_tails(true);
    eventually("reads served past the bound", async || {
        c.get("k").await.as_deref() == Some("v") && c.status().stale_served > 0
    })
    .await;
    assert_eq!(c.status().stale_bypasses, 0);
    // Caught up, and ready though past the bound.
    eventually("ready past a serving bound", async || node.is_ready()).await;
    assert!(c.get("k").await.is_some() && c.status().stale_served > 0);
}

/// No node, or a node that let the cache go: nothing proves it fresh,
/// so every read is past the bound. A cache without one never is.
#[tokio::test]
async fn without_a_node_every_read_is_past_the_bound() {
    let c = bounded("t", false);
    c.insert("k".into(), "v".into()).await;
    assert_eq!(c.get("k").await, None);
    assert_eq!(c.peek("k").await.as_deref(), Some("v"));
    assert_eq!(c.status().stale_bypasses, 1);

    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let node = node_on(&transport, &c).await;
    // Registering emptied it.
    c.insert("k".into(), "v".into()).await;
    eventually("within the bound once held", async || {
        c.get("k").await.is_some()
    })
    .await;
    node.shutdown().await.unwrap();
    eventually("past it once let go", async || c.get("k").await.is_none()).await;

    let plain = cache("p");
    plain.insert("k".into(), "v".into()).await;
    assert_eq!(plain.get("k").await.as_deref(), Some("v"));
    assert_eq!(plain.status().stale_bypasses, 0);
}

/// Past a cache's bound the node is not ready, and says why; within it
/// again, ready.
#[tokio::test]
async fn past_the_bound_the_node_is_not_ready_and_says_why() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    eventually("ready", async || node.is_ready()).await;
    transport.hang_tails(true);
    eventually("not ready past the bound", async || !node.is_ready()).await;
    let reasons = node.not_ready();
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("\"t\"") && r.contains("max_staleness")),
        "{reasons:?}"
    );
    transport.hang_tails(false);
    eventually("ready again", async || node.is_ready()).await;
    assert!(node.not_ready().is_empty());
}
