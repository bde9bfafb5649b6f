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
    let b = if relayed { b.relayed() } else { b };
    b.build().unwrap()
}

fn cache_age(node: &Node, name: &str) -> Option<u64> {
    node.status()
        .caches
        .iter()
        .find(|c| c.name == name)
        .and_then(|c| c.freshness_age_ms)
}

static EPOCHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One relay's reports for a cache: numbered in an epoch of their own,
/// each carrying how long after its mark the previous one was
/// acknowledged (`acked_after`), as a relay sends them.
#[derive(Clone)]
struct Reporter {
    publisher: Publisher,
    source: u64,
    epoch: u64,
    number: Arc<std::sync::atomic::AtomicU64>,
}

impl Reporter {
    fn new(publisher: &Publisher, source: u64) -> Self {
        Reporter {
            publisher: publisher.clone(),
            source,
            // Growing, as a relay group's are (WAL positions).
            epoch: EPOCHS.fetch_add(1, std::sync::atomic::Ordering::SeqCst),
            number: Arc::default(),
        }
    }

    async fn send(&self, cache: &str, acked_after: Option<Duration>) {
        let number = self
            .number
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        let mark = Watermark {
            source: self.source,
            epoch: self.epoch,
            number,
            acked_after_us: acked_after.map(|d| u64::try_from(d.as_micros()).unwrap()),
        };
        self.publisher.watermark(cache, mark).await.unwrap();
    }
}

/// Reports every 20 ms, each acknowledged `lag` after its mark, until
/// `stop` is set.
fn reporting(
    reporter: Reporter,
    cache: &'static str,
    lag: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            reporter.send(cache, Some(lag)).await;
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
    let relay = Reporter::new(&publisher, 7);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let task = reporting(relay.clone(), "t", Duration::from_millis(10), stop.clone());
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
    let task = reporting(relay.clone(), "t", Duration::from_secs(2), stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        c.get("k").await.is_none(),
        "a 2 s lag is past a 300 ms bound"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.unwrap();

    // A small lag again: within the bound.
    stop.store(false, std::sync::atomic::Ordering::SeqCst);
    let task = reporting(relay, "t", Duration::ZERO, stop.clone());
    eventually("within the bound again", async || {
        c.get("k").await.is_some()
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    task.await.unwrap();
}

/// One moment per source: a second relay that stops holds the cache back
/// though the first reports on; a cache built `relayed` waits for its
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
    let one = Reporter::new(&publisher, 1);
    let a = reporting(one.clone(), "t", Duration::ZERO, stop_a.clone());
    let b = reporting(
        Reporter::new(&publisher, 2),
        "t",
        Duration::ZERO,
        stop_b.clone(),
    );
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
    let task = reporting(one, "t", Duration::ZERO, stop.clone());
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
    let relays: Vec<Reporter> = (0..=16u64).map(|s| Reporter::new(&publisher, s)).collect();
    // Two reports each: the second places the first.
    for relay in &relays[..16] {
        relay.send("t", None).await;
        relay.send("t", Some(Duration::ZERO)).await;
    }
    c.insert("k".into(), "v".into()).await;
    eventually("within the bound with 16 sources", async || {
        c.get("k").await.is_some()
    })
    .await;
    relays[16].send("t", None).await;
    eventually("unknown past 16 sources", async || {
        cache_age(&node, "t").is_none()
    })
    .await;
    for relay in &relays {
        relay.send("t", Some(Duration::ZERO)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(cache_age(&node, "t"), None, "for good");
    assert_eq!(c.get("k").await, None);

    // No proof: the tail unanswered from the start. The node cannot take
    // a report then (it could be one replayed from long ago).
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.hang_tails(true);
    let d = bounded("d", false);
    let node = node_on(&transport, &d).await;
    let publisher = Publisher::new(transport.clone());
    let relay = Reporter::new(&publisher, 1);
    relay.send("d", None).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    transport.hang_tails(false);
    eventually(
        "a proof, and the cache's freshness the node's",
        async || node.status().freshness_age_ms.is_some() && cache_age(&node, "d").is_some(),
    )
    .await;
    // With a proof: a first report makes the source known, its moment
    // unknown until the next places it; one acknowledged longer after its
    // mark than the process has run places nothing (further back than the
    // clock reaches), so unknown still.
    relay.send("d", Some(Duration::ZERO)).await;
    eventually("unknown", async || cache_age(&node, "d").is_none()).await;
    relay.send("d", Some(Duration::from_micros(u64::MAX))).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(cache_age(&node, "d"), None);
    relay.send("d", Some(Duration::ZERO)).await;
    eventually("placed", async || cache_age(&node, "d").is_some()).await;
}

/// A report is taken once: a copy (a redelivery, a replay) or an older
/// number of the same epoch places nothing, so a replayed pair cannot make
/// a silent relay look alive; a number skipped places nothing; a new
/// epoch (the relay restarted) starts over, its first report placing
/// nothing.
#[tokio::test]
async fn copies_and_older_reports_place_nothing() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    let publisher = Publisher::new(transport.clone());
    eventually("a proof", async || node.status().freshness_age_ms.is_some()).await;
    let mark = |epoch, number, acked: Option<u64>| Watermark {
        source: 1,
        epoch,
        number,
        acked_after_us: acked,
    };
    publisher.watermark("t", mark(5, 1, None)).await.unwrap();
    publisher.watermark("t", mark(5, 2, Some(0))).await.unwrap();
    eventually("placed", async || {
        cache_age(&node, "t").is_some_and(|a| a < 200)
    })
    .await;
    eventually("past the bound", async || {
        cache_age(&node, "t").is_some_and(|a| a > 400)
    })
    .await;
    for (number, acked) in [(1, None), (2, Some(0)), (2, Some(0)), (1, Some(0))] {
        publisher
            .watermark("t", mark(5, number, acked))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        cache_age(&node, "t").is_some_and(|a| a > 400),
        "{:?}",
        cache_age(&node, "t")
    );
    publisher.watermark("t", mark(5, 4, Some(0))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(cache_age(&node, "t").is_some_and(|a| a > 400));
    publisher.watermark("t", mark(6, 1, Some(0))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(cache_age(&node, "t").is_some_and(|a| a > 400));
    publisher.watermark("t", mark(6, 2, Some(0))).await.unwrap();
    eventually("placed again", async || {
        cache_age(&node, "t").is_some_and(|a| a < 200)
    })
    .await;
    // An older epoch's pair, replayed: nothing, however new its numbers.
    eventually("past the bound", async || {
        cache_age(&node, "t").is_some_and(|a| a > 400)
    })
    .await;
    publisher.watermark("t", mark(5, 7, None)).await.unwrap();
    publisher.watermark("t", mark(5, 8, Some(0))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(cache_age(&node, "t").is_some_and(|a| a > 400));
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
        let relay = Reporter::new(&publisher, round);
        // A new source's first report places nothing: past the bound.
        relay.send("t", None).await;
        eventually("past the bound", async || c.get(&key).await.is_none()).await;

        // One batch: the invalidation, the report, then many more events
        // for the same cache (the run the invalidation is in is not
        // flushed by a switch of cache).
        transport.stall(true);
        publisher.invalidate("t", [&key]).await.unwrap();
        relay.send("t", Some(Duration::ZERO)).await;
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

/// Report `n`'s lag, carried by report `n + 1`, is taken against the
/// node's proof as of report `n`: the proof when `n + 1` arrives may be
/// younger than `n`'s acknowledgement (a report whose publish hung
/// while the node proved on), and would claim too much.
#[tokio::test]
async fn a_lag_is_taken_against_the_proof_of_its_own_report() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = bounded("t", false);
    let node = node_on(&transport, &c).await;
    let publisher = Publisher::new(transport.clone());
    eventually("a proof", async || node.status().freshness_age_ms.is_some()).await;
    let relay = Reporter::new(&publisher, 1);
    // A moment before the process's clock base is unknown: let the clock
    // run past the lag first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.send("t", None).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The node proved on meanwhile: its proof now is young.
    assert!(node.status().freshness_age_ms.is_some_and(|a| a < 100));
    relay.send("t", Some(Duration::from_millis(100))).await;
    // Placed 100 ms before the proof as of report 1, about 500 ms ago.
    eventually("placed", async || cache_age(&node, "t").is_some()).await;
    let age = cache_age(&node, "t").unwrap();
    assert!(
        age >= 450,
        "placed against the proof as of report 2: {age} ms"
    );
    c.insert("k".into(), "v".into()).await;
    assert_eq!(c.get("k").await, None, "past a 300 ms bound");
}
