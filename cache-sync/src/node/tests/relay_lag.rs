//! A CDC relay's reports (`wire::Watermark`) in a cache's freshness: the
//! node adds the relay's lag to its own proof, waits for a relay that
//! stopped reporting, keeps one moment per source, and never places a
//! report it cannot (no proof yet).

use super::freshness::node_on;
use super::*;
use crate::publish::Publisher;
use crate::wire::Watermark;

const MAX: Duration = Duration::from_millis(300);

fn bounded(name: &str, relayed: bool) -> Cache {
    let b = SyncedCache::builder(name, moka::future::Cache::new(100)).max_staleness(MAX);
    let b = if relayed { b.cdc_relayed() } else { b };
    b.build().unwrap()
}

fn cache_age(node: &Node, name: &str) -> Option<u64> {
    node.status()
        .caches
        .iter()
        .find(|c| c.name == name)
        .and_then(|c| c.freshness_age_ms)
}

/// Reports every 20 ms with `lag` until `stop` is set, as a relay does.
fn reporting(
    publisher: Publisher,
    cache: &'static str,
    source: u64,
    lag: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let mark = Watermark {
                source,
                lag_us: u64::try_from(lag.as_micros()).unwrap(),
            };
            publisher.watermark(cache, mark).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// Within the bound while the relay reports a small lag; past it as soon
/// as the relay reports a lag over it, or stops reporting; within again
/// once it reports a small lag again.
#[tokio::test]
async fn a_relay_lag_counts_against_the_bound_and_a_silent_relay_is_past_it() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    c.insert("k".into(), "v".into()).await;
    eventually("within the bound before any report", async || {
        c.get("k").await.is_some()
    })
    .await;
    let publisher = Publisher::new(transport.clone());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = reporting(
        publisher.clone(),
        "t",
        7,
        Duration::from_millis(10),
        stop.clone(),
    );
    eventually("within the bound with a small lag", async || {
        cache_age(&node, "t").is_some_and(|a| (10..150).contains(&a)) && c.get("k").await.is_some()
    })
    .await;

    // The relay stops: the cache's freshness ages though the node's own
    // proof stays young.
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.unwrap();
    eventually("past the bound once the relay is silent", async || {
        c.get("k").await.is_none()
    })
    .await;
    assert!(node.status().freshness_age_ms.is_some_and(|a| a < 150));
    assert!(cache_age(&node, "t").is_some_and(|a| a >= 300));
    // In the heartbeat, and so in the cluster view, per cache.
    eventually("the cache's age in the cluster view", async || {
        node.cluster().view().nodes.iter().any(|n| {
            n.caches
                .iter()
                .any(|c| c.name == "t" && c.freshness_age_ms.is_some_and(|a| a >= 300))
        })
    })
    .await;
    assert!(!node.is_ready(), "past a bound, not ready");

    // A large lag: past the bound while it lasts.
    stop.store(false, std::sync::atomic::Ordering::SeqCst);
    let task = reporting(
        publisher.clone(),
        "t",
        7,
        Duration::from_secs(2),
        stop.clone(),
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        c.get("k").await.is_none(),
        "a 2 s lag is past a 300 ms bound"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.unwrap();

    // A small lag again: within the bound.
    stop.store(false, std::sync::atomic::Ordering::SeqCst);
    let task = reporting(publisher, "t", 7, Duration::ZERO, stop.clone());
    eventually("within the bound again", async || {
        c.get("k").await.is_some()
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.unwrap();
}

/// One moment per source: a second relay that stops holds the cache back
/// though the first reports on; a cache built `cdc_relayed` waits for its
/// first report; another cache on the topic is not held by this one's.
#[tokio::test]
async fn every_source_counts_and_a_relayed_cache_waits_for_its_first_report() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", true);
    let other = bounded("o", false);
    let node = Node::builder("n", transport.clone())
        .freshness_interval(Duration::from_millis(20))
        .register(&c)
        .register(&other)
        .start()
        .await
        .unwrap();
    c.insert("k".into(), "v".into()).await;
    other.insert("k".into(), "v".into()).await;
    eventually("the other cache within its bound", async || {
        other.get("k").await.is_some()
    })
    .await;
    assert_eq!(c.get("k").await, None, "no report yet: unknown");
    assert_eq!(cache_age(&node, "t"), None);

    let publisher = Publisher::new(transport.clone());
    let stop_a = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_b = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let a = reporting(publisher.clone(), "t", 1, Duration::ZERO, stop_a.clone());
    let b = reporting(publisher.clone(), "t", 2, Duration::ZERO, stop_b.clone());
    eventually("within the bound with both reporting", async || {
        c.get("k").await.is_some()
    })
    .await;
    stop_b.store(true, std::sync::atomic::Ordering::SeqCst);
    b.await.unwrap();
    eventually("past the bound with source 2 silent", async || {
        c.get("k").await.is_none()
    })
    .await;
    assert!(
        other.get("k").await.is_some(),
        "a cache no relay reports for"
    );
    stop_a.store(true, std::sync::atomic::Ordering::SeqCst);
    a.await.unwrap();

    // Let go of and claimed again (a node restart in one process): the
    // sources are forgotten, the wait is not, and the reports the new node
    // replays from before it reached the topic's tail (source 2's last
    // among them) are not taken: source 2 no longer holds the cache.
    node.shutdown().await.unwrap();
    let node = node_on(&transport, &c).await;
    c.insert("k".into(), "v".into()).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(c.get("k").await, None, "still awaiting a report");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = reporting(publisher, "t", 1, Duration::ZERO, stop.clone());
    eventually("within once a report comes", async || {
        c.get("k").await.is_some()
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.unwrap();
    drop(node);
}

/// Past `MAX_SOURCES` sources the cache's freshness is unknown for good
/// (dropping one could hide a stalled relay); a report the node cannot
/// place (no proof of its own yet) proves nothing.
#[tokio::test]
async fn too_many_sources_or_no_proof_leave_the_freshness_unknown() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    let publisher = Publisher::new(transport.clone());
    eventually("a proof", async || node.status().freshness_age_ms.is_some()).await;
    for source in 0..16u64 {
        let mark = Watermark { source, lag_us: 0 };
        publisher.watermark("t", mark).await.unwrap();
    }
    c.insert("k".into(), "v".into()).await;
    eventually("within the bound with 16 sources", async || {
        c.get("k").await.is_some()
    })
    .await;
    let mark = Watermark {
        source: 16,
        lag_us: 0,
    };
    publisher.watermark("t", mark).await.unwrap();
    eventually("unknown past 16 sources", async || {
        cache_age(&node, "t").is_none()
    })
    .await;
    for source in 0..=16u64 {
        let mark = Watermark { source, lag_us: 0 };
        publisher.watermark("t", mark).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(cache_age(&node, "t"), None, "for good");
    assert_eq!(c.get("k").await, None);

    // No proof: the tail unanswered from the start. The node cannot place
    // a report then (it could be one replayed from long ago): not taken.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.hang_tails(true);
    let d = bounded("d", false);
    let node = node_on(&transport, &d).await;
    let publisher = Publisher::new(transport.clone());
    let mark = Watermark {
        source: 1,
        lag_us: u64::MAX,
    };
    publisher.watermark("d", mark).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    transport.hang_tails(false);
    eventually(
        "a proof, and the cache's freshness the node's",
        async || node.status().freshness_age_ms.is_some() && cache_age(&node, "d").is_some(),
    )
    .await;
    // With a proof, a lag longer than the process has run: further back
    // than the clock reaches, so unknown (not the clock's start).
    publisher.watermark("d", mark).await.unwrap();
    eventually("unknown", async || cache_age(&node, "d").is_none()).await;
}

/// A report vouches for what came before it: the events before it in the
/// same batch are applied before the cache takes it. Otherwise a read
/// between the report and the end of the batch would be within the bound
/// and find a value the batch's earlier invalidation had replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_is_taken_after_the_events_before_it_in_its_batch() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    // Long enough for the proof taken before the stall below to be
    // within it when the batch is applied.
    let bound = Duration::from_secs(10);
    let c: Cache = SyncedCache::builder("t", moka::future::Cache::new(100_000))
        .max_staleness(bound)
        .build()
        .unwrap();
    // One batch holds all that is published below.
    let node = Node::builder("n", transport.clone())
        .freshness_interval(Duration::from_millis(20))
        .max_batch(4096)
        .register(&c)
        .start()
        .await
        .unwrap();
    let publisher = Publisher::new(transport.clone());
    eventually("a proof", async || node.status().freshness_age_ms.is_some()).await;
    // The window is a few milliseconds: ten rounds, each with a source of
    // its own, so that a missing flush is all but sure to be seen.
    for round in 0..10u64 {
        let key = format!("k{round}");
        c.insert(key.clone(), "old".into()).await;
        let report = |lag_us| Watermark {
            source: round,
            lag_us,
        };
        // A relay an hour behind: past the bound.
        publisher
            .watermark("t", report(3_600_000_000))
            .await
            .unwrap();
        eventually("past the bound", async || c.get(&key).await.is_none()).await;

        // One batch: the invalidation, the report, then many more events
        // for the same cache (the run the invalidation is in is not
        // flushed by a switch of cache).
        transport.stall(true);
        publisher.invalidate("t", [&key]).await.unwrap();
        publisher.watermark("t", report(0)).await.unwrap();
        for i in 0..2000 {
            publisher
                .insert("t", [(format!("o{round}_{i}"), "v".to_owned())])
                .await
                .unwrap();
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let (c, stop, key) = (c.clone(), stop.clone(), key.clone());
            tokio::spawn(async move {
                let mut stale = 0usize;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    stale += usize::from(c.get(&key).await.as_deref() == Some("old"));
                    tokio::task::yield_now().await;
                }
                stale
            })
        };
        transport.stall(false);
        let last = format!("o{round}_1999");
        eventually("the batch applied", async || c.peek(&last).await.is_some()).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            reader.await.unwrap(),
            0,
            "round {round}: read the invalidated value within the bound"
        );
        assert_eq!(c.peek(&key).await, None);
    }
}
