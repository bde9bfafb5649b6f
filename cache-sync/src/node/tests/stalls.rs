//! Issue 36: the node never holds the application's runtime. Each test
//! counts what ran, or takes a lower bound a stall guarantees: none times
//! anything against a limit.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::*;

/// Counts its own polls, yielding after each, until aborted: on a runtime
/// with one thread it runs only while every other task is waiting.
fn probe() -> (Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let polls = Arc::new(AtomicUsize::new(0));
    let task = tokio::spawn({
        let polls = polls.clone();
        async move {
            loop {
                polls.fetch_add(1, Relaxed);
                tokio::task::yield_now().await;
            }
        }
    });
    (polls, task)
}

/// moka evicts every entry of a cleared cache in one housekeeping call,
/// without a yield (5 to 8 s for 1M entries). The node runs it on a thread
/// of its own: on a one-thread runtime, other tasks run while the node
/// waits for it. Run on the runtime, the probe could not run at all until
/// it was done. (Without a node, so that no periodic housekeeping of the
/// node's does the eviction first.)
#[tokio::test(flavor = "current_thread")]
async fn moka_housekeeping_after_a_clear_runs_off_the_runtime() {
    let c = SyncedCache::new("big", moka::future::Cache::new(1_000_000));
    for i in 0..200_000 {
        c.insert(format!("k{i}"), "v".to_owned()).await;
    }
    let housekeeper = crate::cache::Housekeeper::start();
    housekeeper.settle(c.handle()).await;
    c.invalidate_all().await;
    let (polls, task) = probe();
    tokio::task::yield_now().await;
    let before = polls.load(Relaxed);
    housekeeper.settle(c.handle()).await;
    let during = polls.load(Relaxed).saturating_sub(before);
    task.abort();
    assert_eq!(c.handle().status().entries, 0, "the clear was settled");
    assert!(
        during >= 1,
        "nothing else ran while moka evicted 200,000 entries"
    );
}

/// Housekeeping runs on a thread of the runtime's blocking pool, never on
/// the worker that asked for it.
#[tokio::test(flavor = "current_thread")]
async fn housekeeping_runs_off_the_workers() {
    let housekeeper = crate::cache::Housekeeper::start();
    let here = std::thread::current().id();
    let there = housekeeper.run(async { std::thread::current().id() }).await;
    assert_ne!(here, there);
}

/// A worker held for 300 ms (here by a blocking sleep, as a CPU-bound
/// task would) makes the node's timer at least some 280 ms late: the
/// status and `GET /metrics` say so.
#[tokio::test(flavor = "current_thread")]
async fn a_stalled_runtime_shows_as_lateness() {
    let node = Node::builder("n", EmbeddedTransport::new())
        .start()
        .await
        .unwrap();
    // The monitor's timer is armed once it has run.
    tokio::time::sleep(Duration::from_millis(30)).await;
    #[allow(clippy::disallowed_methods)] // the stall under test
    std::thread::sleep(Duration::from_millis(300));
    eventually("the monitor saw the stall", async || {
        node.status().runtime_lateness_us >= 280_000
    })
    .await;
    let text = super::super::metrics::render(&node).await.unwrap();
    let count = text
        .lines()
        .find(|l| l.starts_with("cache_sync_runtime_lateness_seconds_count"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(count >= 1.0, "{text}");
    let over_a_quarter_second = text
        .lines()
        .find(|l| l.starts_with("cache_sync_runtime_lateness_seconds_bucket{le=\"0.25\"}"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(f64::MAX);
    assert!(
        over_a_quarter_second < count,
        "one tick fell past the 0.25 s bucket: {text}"
    );
    node.shutdown().await.unwrap();
}

/// A clear of a registered cache hands moka's eviction to the node's
/// thread and waits for it there: when it returns the entries are gone,
/// and other tasks ran meanwhile. Left to moka, the eviction would run at
/// the next cache write that finds 64 writes logged (the consumer's next
/// event), on the runtime, in one go.
#[tokio::test(flavor = "current_thread")]
async fn a_clear_of_a_registered_cache_is_evicted_off_the_workers() {
    let c = SyncedCache::new("big", moka::future::Cache::new(1_000_000));
    let node = Node::builder("n", EmbeddedTransport::new())
        .register(&c)
        .start()
        .await
        .unwrap();
    // Filled once registered: a registration empties the cache.
    for i in 0..200_000 {
        c.insert(format!("k{i}"), "v".to_owned()).await;
    }
    node.status_settled().await;
    let (polls, task) = probe();
    tokio::task::yield_now().await;
    let before = polls.load(Relaxed);
    c.invalidate_all().await;
    let during = polls.load(Relaxed).saturating_sub(before);
    task.abort();
    assert_eq!(
        c.handle().status().entries,
        0,
        "evicted by the time the clear returned"
    );
    assert!(
        during >= 1,
        "nothing else ran while moka evicted 200,000 entries"
    );
    node.shutdown().await.unwrap();
}
