//! Nodes that load from a read replica lagging the primary: an
//! invalidation that arrives before the replica has caught up lets a node
//! reload the old row. `PublisherBuilder::again_after` sends a second
//! invalidation once the lag has passed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cache_sync::{Node, Publisher, SyncedCache, transport::EmbeddedTransport};
use tokio::time::Instant;

const LAG: Duration = Duration::from_millis(300);
const AGAIN: Duration = Duration::from_millis(800);

/// One row's history on the primary; the replica serves the newest value
/// written at least `LAG` ago.
#[derive(Clone, Default)]
struct Db {
    history: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Db {
    fn write(&self, value: &str) {
        let mut h = self.history.lock().expect("no test panicked holding it");
        h.push((Instant::now(), value.to_owned()));
    }

    fn read_replica(&self) -> String {
        let h = self.history.lock().expect("no test panicked holding it");
        let seen = Instant::now()
            .checked_sub(LAG)
            .expect("the test runs past LAG");
        h.iter()
            .rev()
            .find(|(at, _)| *at <= seen)
            .map(|(_, v)| v.clone())
            .expect("the first row is older than LAG")
    }
}

/// A node's read: through the cache, loading from the replica.
async fn read(cache: &SyncedCache<String, String>, db: &Db) -> String {
    cache
        .get_with("de".to_owned(), || {
            let db = db.clone();
            async move { db.read_replica() }
        })
        .await
}

async fn applied(node: &Node, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while node.status().caches[0].events_applied < n {
        assert!(
            Instant::now() < deadline,
            "the node never applied event {n}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// The scenario, with or without the second invalidation; returns what the
/// node serves well after the replica caught up.
async fn scenario(again: bool) -> (String, String) {
    let db = Db::default();
    db.write("Germany");
    tokio::time::sleep(LAG * 2).await;

    let transport = EmbeddedTransport::new();
    let cache = SyncedCache::new("countries", moka::future::Cache::new(100));
    let node = Node::builder("node", transport.clone())
        .register(&cache)
        .start()
        .await
        .expect("the node starts");
    assert_eq!(read(&cache, &db).await, "Germany");

    let mut builder = Publisher::builder(transport);
    if again {
        builder = builder.again_after(AGAIN);
    }
    let publisher = builder.build().expect("valid settings");
    // The admin writes the primary, then invalidates.
    db.write("Deutschland");
    publisher
        .invalidate("countries", ["de"])
        .await
        .expect("the embedded transport takes it");
    applied(&node, 1).await;
    // The replica has not caught up: the node reloads the old row.
    assert_eq!(read(&cache, &db).await, "Germany");
    // Past the lag, before the second invalidation: still the old row.
    tokio::time::sleep(AGAIN / 2).await;
    let before = read(&cache, &db).await;
    tokio::time::sleep(AGAIN).await;
    if again {
        applied(&node, 2).await;
    }
    let after = read(&cache, &db).await;
    node.shutdown().await.expect("a clean shutdown");
    (before, after)
}

#[tokio::test(start_paused = true)]
async fn a_second_invalidation_after_the_replica_lag_removes_the_reloaded_old_row() {
    let (before, after) = scenario(true).await;
    assert_eq!(before, "Germany", "the second invalidation came early");
    assert_eq!(after, "Deutschland");
}

/// The control: without the second invalidation the old row stays, so the
/// test above can fail.
#[tokio::test(start_paused = true)]
async fn without_it_the_reloaded_old_row_stays() {
    let (before, after) = scenario(false).await;
    assert_eq!((before.as_str(), after.as_str()), ("Germany", "Germany"));
}

#[test]
fn again_after_is_refused_out_of_range() {
    for bad in [Duration::ZERO, Duration::from_secs(3601), Duration::MAX] {
        let err = Publisher::builder(EmbeddedTransport::new())
            .again_after(bad)
            .build()
            .unwrap_err();
        assert!(err.is_config(), "{bad:?}: {err}");
    }
    for ok in [Duration::from_millis(1), Duration::from_secs(3600)] {
        Publisher::builder(EmbeddedTransport::new())
            .again_after(ok)
            .build()
            .unwrap();
    }
}
