//! Shared machinery for cache-sync's cross-module tests: a versioned
//! in-memory "database" as the source of truth, nodes that read through to
//! it, and a fence that tells when every node has caught up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cache_sync::transport::Transport;
use cache_sync::{Audit, Node, NodeBuilder, Publisher, SyncedCache};

pub mod built;
#[cfg(feature = "postgres-cdc")]
pub mod cdc;
pub mod cluster_view;
pub mod conformance;
pub mod mariadb_server;
pub mod nats_cluster;
pub mod nats_server;
pub mod postgres_server;
mod process;
pub mod proxy;
pub mod redis_cluster;
pub mod redis_server;
pub mod rocketmq_server;

/// Cache values: `None` caches a missing row (negative caching).
pub type Row = Option<String>;

/// The source of truth. Every write bumps one table-wide version, as a
/// database sequence or an `updated_at` column would.
#[derive(Debug, Default)]
pub struct Db {
    state: Mutex<DbState>,
}

#[derive(Debug, Default)]
struct DbState {
    rows: BTreeMap<String, String>,
    /// The version of each key's last write, a delete's included.
    versions: BTreeMap<String, u64>,
    version: u64,
}

impl Db {
    /// Writes a row; returns its new version.
    pub fn upsert(&self, key: &str, value: &str) -> u64 {
        let mut s = self.state.lock().expect("db lock");
        s.version += 1;
        s.rows.insert(key.to_owned(), value.to_owned());
        let v = s.version;
        s.versions.insert(key.to_owned(), v);
        v
    }

    /// Deletes a row; returns the version of the deletion.
    pub fn delete(&self, key: &str) -> u64 {
        let mut s = self.state.lock().expect("db lock");
        s.version += 1;
        s.rows.remove(key);
        let v = s.version;
        s.versions.insert(key.to_owned(), v);
        v
    }

    /// Reads a row.
    pub fn get(&self, key: &str) -> Row {
        self.state.lock().expect("db lock").rows.get(key).cloned()
    }

    /// Reads rows with the version of their last write (0 for a key never
    /// written), as an auditor asks: a missing row is `None`, kept as the
    /// caches keep it.
    pub fn read_versioned(&self, keys: Vec<String>) -> Vec<(String, Option<(Row, u64)>)> {
        let s = self.state.lock().expect("db lock");
        keys.into_iter()
            .map(|k| {
                let version = s.versions.get(&k).copied().unwrap_or(0);
                let row = s.rows.get(&k).cloned();
                (k, Some((row, version)))
            })
            .collect()
    }

    /// A consistency auditor of the table against this database, by
    /// version (entries loaded without one are not judged, events'
    /// refreshes are), quick enough to sweep a test's few keys many times
    /// a second, with the
    /// default grace window (the node's reorder window + 3 s): what a user
    /// gets, under which no fault may make it count an inconsistency. (At
    /// a grace of 1 s, shorter than a NATS publish's 4 s timeout, a writer
    /// whose publish waits out a paused leader after its commit does make
    /// one: see the issue 24 note.)
    pub fn audit(self: &Arc<Self>) -> Audit<String, Row> {
        let db = self.clone();
        Audit::versioned(move |keys| {
            let rows = db.read_versioned(keys);
            async move { Ok::<_, std::convert::Infallible>(rows) }
        })
        .rate(2000)
        .batch(50)
        .window(Duration::from_secs(60))
    }
}

/// A node holding the table under test and a fence cache.
#[derive(Debug)]
pub struct TestNode {
    /// The node.
    pub node: Node,
    /// The table under test.
    pub table: SyncedCache<String, Row>,
    /// Holds the last fence value published.
    pub fence: SyncedCache<String, u64>,
}

/// The builder of the table under test.
pub type TableBuilder = cache_sync::SyncedCacheBuilder<String, Row>;

/// Name of the cache under test.
pub const TABLE: &str = "table";
const FENCE: &str = "fence";

impl TestNode {
    /// Starts a node on `transport` with a table cache and a fence cache.
    pub async fn start(
        id: &str,
        transport: impl Transport,
        configure: impl FnOnce(NodeBuilder) -> NodeBuilder,
    ) -> cache_sync::Result<Self> {
        Self::start_with(id, transport, configure, None, |b| b).await
    }

    /// [`TestNode::start`], with the table's builder shaped by `table`
    /// (a staleness bound, for one).
    pub async fn start_shaped(
        id: &str,
        transport: impl Transport,
        configure: impl FnOnce(NodeBuilder) -> NodeBuilder,
        table: impl FnOnce(TableBuilder) -> TableBuilder,
    ) -> cache_sync::Result<Self> {
        Self::start_with(id, transport, configure, None, table).await
    }

    /// [`TestNode::start`], with the table audited against `db` (see
    /// [`Db::audit`]).
    pub async fn start_audited(
        id: &str,
        transport: impl Transport,
        configure: impl FnOnce(NodeBuilder) -> NodeBuilder,
        db: &Arc<Db>,
    ) -> cache_sync::Result<Self> {
        Self::start_with(id, transport, configure, Some(db), |b| b).await
    }

    async fn start_with(
        id: &str,
        transport: impl Transport,
        configure: impl FnOnce(NodeBuilder) -> NodeBuilder,
        db: Option<&Arc<Db>>,
        shape: impl FnOnce(TableBuilder) -> TableBuilder,
    ) -> cache_sync::Result<Self> {
        let mut table = SyncedCache::builder(TABLE, moka::future::Cache::new(10_000));
        if let Some(db) = db {
            table = table.audit(db.audit());
        }
        let table = shape(table).build()?;
        let fence = SyncedCache::new(FENCE, moka::future::Cache::new(10));
        let builder = configure(Node::builder(id, transport))
            .register(&table)
            .register(&fence);
        Ok(Self {
            node: builder.start().await?,
            table,
            fence,
        })
    }

    /// Reads through to `db`, yielding `yields` times in the middle of the
    /// load so that events can land while it runs.
    pub async fn read(&self, db: &Db, key: &str, yields: u32) -> Row {
        self.table
            .get_with(key.to_owned(), || async move {
                let row = db.get(key);
                for _ in 0..yields {
                    tokio::task::yield_now().await;
                }
                row
            })
            .await
    }
}

/// Publishes a fence and waits until every node has applied it. The
/// transport is ordered, so every node has then applied everything
/// published before the fence.
pub async fn fence(publisher: &Publisher, nodes: &[TestNode], n: u64) {
    publisher
        .insert(FENCE, [("fence", n)])
        .await
        .expect("publish fence");
    for node in nodes {
        let key = "fence".to_owned();
        eventually(
            &format!("{} applies fence {n}", node.node.id()),
            async || node.fence.get(&key).await == Some(n),
        )
        .await;
    }
}

/// Polls `f` until it holds, failing after 20 s with `what`.
pub async fn eventually(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Whether every entry every node holds for `keys` equals the database's row.
pub async fn holds_no_stale_entries(db: &Db, nodes: &[TestNode], keys: &[String]) -> bool {
    for node in nodes {
        for key in keys {
            if let Some(cached) = node.table.get(key).await
                && cached != db.get(key)
            {
                return false;
            }
        }
    }
    true
}

/// Fails, naming the node and key, if any node holds a value for `keys`
/// that the source of truth does not.
pub async fn assert_no_stale_entries(db: &Db, nodes: &[TestNode], keys: &[String]) {
    for node in nodes {
        for key in keys {
            if let Some(cached) = node.table.get(key).await {
                assert_eq!(
                    cached,
                    db.get(key),
                    "{} holds a stale value for {key}",
                    node.node.id()
                );
            }
        }
    }
}
