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
    let housekeeper = super::super::maintenance::Housekeeper::start("n");
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

/// The housekeeping thread is the node's: named so a profile shows it.
#[tokio::test]
async fn housekeeping_runs_on_the_nodes_own_thread() {
    let housekeeper = super::super::maintenance::Housekeeper::start("n");
    let name = housekeeper
        .run(async { std::thread::current().name().map(str::to_owned) })
        .await;
    assert_eq!(name.as_deref(), Some("cache-sync-housekeeping"));
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
