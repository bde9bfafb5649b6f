//! The broadcasting consumer: one per node, applying every event on its topic
//! to the caches the node registered.
//!
//! This file holds the [`Node`] handle and its API. The state the node's
//! tasks share lives in `shared` (the hub), `registry` (the caches it
//! holds) and `stats` (its counters and status); the rest by task:
//! `builder`, `consume` and `route` (with `seqs` and `fences`),
//! `maintenance` and `offsets`, `heartbeat` and `acks`, and the status
//! routes and server (`http`, `server`, `metrics`, `page`).

use std::fmt;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cache::SyncedCache;
use crate::cluster::{Cluster, DEFAULT_HEARTBEAT_INTERVAL};
use crate::error::{Error, Result};
use crate::publish::{DEFAULT_ANNOUNCE_INTERVAL, DEFAULT_WINDOW, Publisher};
use crate::status::NodeStatus;
use crate::transport::{DEFAULT_TOPIC, MemoryOffsetStore, StartFrom, Transport};
use crate::wire::DEFAULT_MAX_EVENT_BYTES;
use shared::{Config, Shared};

mod acks;
mod announcements;
mod audit;
mod builder;
mod cluster_metrics;
mod consume;
mod fences;
mod freshness;
mod heartbeat;
mod http;
mod lateness;
mod maintenance;
mod metrics;
mod registry;
mod route;
mod seqs;
mod server;
mod shared;
mod stats;

pub use builder::NodeBuilder;
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) use route::RawNode;
pub use server::StatusServer;

/// See [`NodeBuilder::reorder_window`].
pub(crate) const DEFAULT_REORDER_WINDOW: Duration = Duration::from_secs(10);
/// How often a node proves its freshness bound by default.
pub(crate) const DEFAULT_FRESHNESS_INTERVAL: Duration = Duration::from_secs(1);

/// One application node: a broadcasting consumer plus the caches it keeps in
/// step, and the source of its status.
///
/// Cheap to clone; clones share the consumer. The consumer stops when
/// [`shutdown`](Self::shutdown) is called, or when the last clone is dropped
/// (without persisting its position).
#[derive(Clone)]
pub struct Node {
    handle: Arc<Handle>,
}

impl fmt::Debug for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.handle.shared.id)
            .field("topic", &self.handle.shared.topic)
            .field("transport", &self.handle.shared.transport.kind())
            .finish_non_exhaustive()
    }
}

/// Owned by the `Node` clones only; the tasks hold `Shared`, so dropping the
/// last `Node` can stop them.
struct Handle {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: tokio::sync::Mutex<Option<Tasks>>,
}

/// The node's tasks: the consumer, the maintenance task, the heartbeat
/// task, the auditors' (`audit.rs`), the runtime's lateness monitor
/// (`lateness.rs`) and the freshness bound's (`freshness.rs`).
type Tasks = [JoinHandle<()>; 6];

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

impl Node {
    /// Configures a node with this id on this transport.
    pub fn builder(id: impl Into<String>, transport: impl Transport) -> NodeBuilder {
        NodeBuilder {
            id: id.into(),
            topic: DEFAULT_TOPIC.into(),
            transport: Arc::new(transport),
            offsets: Arc::new(MemoryOffsetStore::new()),
            keyring: None,
            config: Config {
                start_from: StartFrom::Latest,
                max_batch: 256,
                max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
                persist_interval: Duration::from_secs(5),
                min_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(5),
                reorder_window: DEFAULT_REORDER_WINDOW,
                heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
                freshness_interval: DEFAULT_FRESHNESS_INTERVAL,
            },
            caches: Vec::new(),
        }
    }

    /// Starts a node with default settings.
    pub async fn start(id: impl Into<String>, transport: impl Transport) -> Result<Node> {
        Self::builder(id, transport).start().await
    }

    /// The node's id.
    pub fn id(&self) -> &str {
        &self.handle.shared.id
    }

    /// The topic it consumes.
    pub fn topic(&self) -> &str {
        &self.handle.shared.topic
    }

    /// Registers a cache, so events naming it are applied to it.
    ///
    /// The cache is emptied first: nothing it held was kept in step before
    /// now, so register caches before warming them. Prefer
    /// [`NodeBuilder::register`]: a cache registered after start is
    /// quarantined for the [reorder window](NodeBuilder::reorder_window).
    ///
    /// Fails with [`Error::DuplicateCache`] if the name is taken on this
    /// node, [`Error::Config`] if another node holds the cache or the
    /// transport cannot carry its name or its [`Table`](crate::Table) is pinned
    /// to another topic, and [`Error::Shutdown`] once the node
    /// has shut down. A node gives its caches up when it shuts down, or when
    /// its start fails, so they can be registered on another.
    ///
    /// Emptying the cache waits for writes in progress, and for a
    /// [`get_with`](SyncedCache::get_with) loader that holds a key. A call
    /// dropped before it returns (a timeout) leaves the cache unregistered.
    pub async fn register<K, V>(&self, cache: &SyncedCache<K, V>) -> Result<()>
    where
        K: Hash + Eq + Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
        V: Clone + Send + Sync + DeserializeOwned + 'static,
    {
        let handle = cache.handle();
        let shared = &self.handle.shared;
        if self.is_stopped() {
            return Err(Error::Shutdown);
        }
        shared.transport.check_tag(handle.name())?;
        shared.register(handle.clone()).await?;
        // A shutdown that ran meanwhile may have released its caches before
        // this one was in the map: undo, rather than hold a claim nobody
        // will release.
        if self.is_stopped() {
            shared.unregister(&handle);
            return Err(Error::Shutdown);
        }
        // It joins mid-stream: recent events for it were not kept for it.
        handle.quarantine();
        Ok(())
    }

    fn is_stopped(&self) -> bool {
        *self.handle.stop.borrow()
    }

    /// A publisher on this node's transport and topic, with the node id as
    /// its origin; it signs if the node verifies signatures, and announces
    /// at the default interval (1 s).
    pub fn publisher(&self) -> Publisher {
        let s = &self.handle.shared;
        Publisher::with_codec(
            s.transport.clone(),
            s.topic.clone(),
            s.id.clone(),
            s.codec.clone(),
            DEFAULT_ANNOUNCE_INTERVAL,
            None,
            DEFAULT_WINDOW,
        )
    }

    /// Whether the consumer is running and its transport healthy.
    pub fn is_consuming(&self) -> bool {
        self.handle.shared.consuming.load(Relaxed) && !*self.handle.stop.borrow()
    }

    /// Whether the node's consume task is running (the liveness probe,
    /// `GET /livez`). It stays true while the transport is down and the
    /// consumer re-subscribes: restarting the process would not bring the
    /// broker back. False after shutdown, or if the task ended on a panic
    /// in application code (a key's `Hash` or `Deserialize`).
    pub fn is_alive(&self) -> bool {
        self.handle.shared.alive.load(Relaxed) && !*self.handle.stop.borrow()
    }

    /// Whether the node is ready to serve (the readiness probe,
    /// `GET /readyz`): it is consuming, it is caught up with the start
    /// replay (the transport had nothing more to hand over at once: a
    /// batch shorter than `max_batch`, or 200 ms without one), no cache
    /// is quarantined after a loss or a late registration, and no cache
    /// with a [staleness bound](crate::SyncedCacheBuilder::max_staleness)
    /// is past it (its reads would go to the source: a node cut off from
    /// its broker leaves the load balancer rather than load the database;
    /// a [serving](crate::SyncedCacheBuilder::max_staleness_serving) bound
    /// leaves the node ready).
    ///
    /// A quarantine lasts one [reorder window](NodeBuilder::reorder_window)
    /// (10 s by default), so after a loss the node is not ready for that
    /// long; a loss that hits every node at once (a Pub/Sub broker's
    /// restart) takes them all out of a load balancer together for it.
    /// With a window of `Duration::MAX` a quarantine never ends, and a
    /// node with a quarantined cache is never ready again: pick a finite
    /// window where readiness gates traffic. "Caught up" is judged from
    /// what the transport hands over, not from the broker's end offset:
    /// where a transport hands over replayed history in short batches
    /// (NATS, RocketMQ), it may be judged early.
    pub fn is_ready(&self) -> bool {
        !self.is_stopped() && self.handle.shared.ready()
    }

    /// Why the node is not ready, in words; empty when it is.
    pub(crate) fn not_ready(&self) -> Vec<String> {
        let s = &self.handle.shared;
        let mut reasons = Vec::new();
        if !self.is_consuming() {
            reasons.push("not consuming: the transport is failing or the node stopped".into());
        } else if !s.caught_up.load(Relaxed) {
            reasons.push("catching up with the start replay".into());
        }
        let mut quarantined: Vec<String> = s
            .caches()
            .values()
            .filter(|c| c.is_quarantined())
            .map(|c| {
                format!(
                    "cache {:?} quarantined after a loss or a late registration",
                    c.name()
                )
            })
            .collect();
        quarantined.sort();
        reasons.extend(quarantined);
        let mut past: Vec<String> = s
            .caches()
            .values()
            .filter(|c| c.is_past_bound())
            .map(|c| {
                format!(
                    "cache {:?} not proved fresh within its max_staleness: its reads go to the source",
                    c.name()
                )
            })
            .collect();
        past.sort();
        reasons.extend(past);
        reasons
    }

    /// What this node sees of the cluster: every live node's last
    /// heartbeat (its own, as of now, included), from which
    /// [`Published::applied_by`](crate::Published::applied_by) and the
    /// cluster endpoints read. Holds only this node when heartbeats are off
    /// or the transport has none.
    pub fn cluster(&self) -> Cluster {
        self.handle.shared.cluster.clone()
    }

    /// What the status endpoint reports.
    pub fn status(&self) -> NodeStatus {
        let mut status = self.handle.shared.status();
        status.consuming = self.is_consuming();
        status
    }

    /// Like [`status`](Self::status), after letting each cache finish
    /// moka's pending bookkeeping, so entry counts are current.
    pub async fn status_settled(&self) -> NodeStatus {
        let caches: Vec<_> = self.handle.shared.caches().values().cloned().collect();
        for cache in caches {
            self.handle.shared.housekeeper.settle(cache).await;
        }
        self.status()
    }

    /// An axum router to mount in the application's own server. No keys or
    /// values are shown. It serves:
    /// - `GET /cache-sync/status`: [`NodeStatus`] as JSON;
    /// - `GET /cache-sync/caches/{name}`: one [`CacheStatus`](crate::status::CacheStatus), or 404;
    /// - `GET /cache-sync/cluster`: [`cluster`](Self::cluster)'s
    ///   [`ClusterView`](crate::cluster::ClusterView) as JSON;
    /// - `GET /cache-sync/` (and `/cache-sync`): the cluster page, an HTML
    ///   view of the same for a browser, paged past a size (`?page=N`);
    /// - `GET /livez`: 200 while [`is_alive`](Self::is_alive), else 503;
    /// - `GET /readyz`: 200 while [`is_ready`](Self::is_ready), else 503
    ///   with the reasons;
    /// - `GET /healthz`: 200 while [`is_consuming`](Self::is_consuming),
    ///   else 503 (kept for compatibility; prefer the two above);
    /// - `GET /metrics`: Prometheus metrics, as below.
    ///
    /// `GET /metrics` answers in the Prometheus text format, version 0.0.4
    /// (`Content-Type: text/plain; version=0.0.4; charset=utf-8`), encoded
    /// by `prometheus-client` from a [`status_settled`](Self::status_settled)
    /// snapshot taken per scrape, so nothing is counted twice. Names start
    /// with `cache_sync_`; counters end in `_total`.
    ///
    /// Per cache, labelled `cache` (its name):
    /// - counters `cache_sync_cache_events_applied_total`,
    ///   `_events_rejected_total`, `_stale_ignored_total`,
    ///   `_refreshes_total`, `_invalidations_total`, `_clears_total`,
    ///   `_refresh_fallbacks_total`, `_coalesced_total`, `_refreshes_quarantined_total`,
    ///   `_writes_parked_total`,
    ///   `_loss_resyncs_total`, `_hits_total`, `_misses_total`,
    ///   `_loads_total`, `_load_failures_total`, `_loads_superseded_total`,
    ///   `_loads_stale_total`, `_fresh_reads_total`, `_stale_bypasses_total`,
    ///   `_stale_served_total`: the [`CacheStatus`](crate::status::CacheStatus)
    ///   fields of those names (`events_rejected` is `rejected_events`);
    /// - gauges `cache_sync_cache_entries`, `cache_sync_cache_tracked_keys`,
    ///   `cache_sync_cache_version` (only caches with a version have a
    ///   sample), `cache_sync_cache_quarantined` (0 or 1) and
    ///   `cache_sync_cache_freshness_age_seconds` (its
    ///   [`freshness_age_ms`](crate::status::CacheStatus::freshness_age_ms)
    ///   in seconds, while known: the node's age, or a CDC relay's lag
    ///   added to it);
    /// - histogram `cache_sync_cache_publish_to_apply_latency_seconds`
    ///   (buckets 100 µs to 10 s): one observation per run of events applied
    ///   to the cache together, the latency of the run's last event, the
    ///   value `last_latency_us` takes. Across machines it includes clock
    ///   skew;
    /// - for an audited cache only
    ///   ([`SyncedCacheBuilder::audit`](crate::SyncedCacheBuilder::audit)),
    ///   counters `cache_sync_cache_audit_checks_total`,
    ///   `_suspects_total`, `_suspects_cleared_total`,
    ///   `_inconsistencies_total`, `_repairs_total`, `_unverified_total`,
    ///   `_source_reads_total`, `_source_failures_total` and `_sweeps_total`,
    ///   and gauges `cache_sync_cache_audit_window_seconds`,
    ///   `_suspects_pending`, `_window_checks`, `_window_inconsistencies`,
    ///   `_max_stale_age_seconds` (once an entry was repaired) and
    ///   `_consistency_nines` (once an entry was checked): the
    ///   [`AuditStatus`](crate::status::AuditStatus) fields of those names
    ///   (`max_stale_age_ms` in seconds, and
    ///   [`nines`](crate::status::AuditStatus::nines)).
    ///
    /// Per node: counters `cache_sync_node_events_received_total`,
    /// `_events_skipped_total`, `_events_rejected_total`,
    /// `_publisher_gaps_total`, `_events_fenced_total`, `_events_late_total`,
    /// `_transport_errors_total`, and
    /// `cache_sync_node_losses_total` labelled `reason` (every
    /// [`LossReason`](crate::transport::LossReason) label, zeros included: [`NodeStatus::losses`] split by
    /// reason), `_heartbeats_sent_total`, `_heartbeats_received_total`,
    /// `_heartbeats_rejected_total`, `_heartbeats_dropped_total` (taken in
    /// but past the cluster view's bounds); gauges
    /// `cache_sync_node_consuming`, 1 while
    /// [`is_consuming`](Self::is_consuming), else 0, and
    /// `cache_sync_node_ready`, 1 while [`is_ready`](Self::is_ready), and
    /// `cache_sync_node_freshness_age_seconds` while known
    /// ([`NodeStatus::freshness_age_ms`] in seconds); and
    /// the histogram `cache_sync_runtime_lateness_seconds` (buckets 100 µs
    /// to 10 s): how late the runtime the node runs on ran the node's 10 ms
    /// timer, that is how long a task (the node's or the application's)
    /// held a worker without yielding (the most in the last minute is
    /// [`NodeStatus::runtime_lateness_us`]).
    ///
    /// From the cluster view: gauge `cache_sync_cluster_nodes` (live nodes,
    /// this one included), and per live node (label `node`)
    /// `cache_sync_cluster_heartbeat_age_seconds`, `cache_sync_cluster_node_ready`,
    /// `cache_sync_cluster_node_freshness_age_seconds` (for nodes that prove
    /// a bound: [`NodeView::freshness_age_ms`](crate::cluster::NodeView::freshness_age_ms)
    /// in seconds), and per node and cache `cache_sync_cluster_cache_lag_versions`
    /// (versions behind the newest any live node reports; caches with a
    /// version only).
    ///
    /// Mounted in the application's server, it is served with that server's
    /// limits: [`serve_status`](Self::serve_status) also bounds the time to
    /// read a request head, idle connections and the number of connections,
    /// which `axum::serve` does not. `Router::merge` panics on a route the
    /// application already has (say its own `/healthz` or `/metrics`);
    /// `nest` it under a prefix then.
    pub fn status_router(&self) -> axum::Router {
        http::router(self.clone())
    }

    /// The trace route, off unless the application mounts it (keys are
    /// data, and the status routes never show one):
    /// `GET /cache-sync/caches/{name}/trace?key=…` answers with what
    /// [`SyncedCache::trace`](crate::SyncedCache::trace) gives for the key,
    /// `{"cache", "key", "tracing", "records"}`, where `tracing` is false
    /// for a cache built without [`trace_bytes`](crate::SyncedCacheBuilder::trace_bytes).
    /// The key is read as JSON (`?key=42`, `?key=%22k1%22`), or else as the
    /// text itself for a key that deserializes from a string (`?key=k1`).
    /// 400 for a missing key or one that is not the cache's, 404 for a
    /// cache not registered here.
    ///
    /// Mount it behind the application's own access control, or on a
    /// listener of its own bound to loopback.
    pub fn trace_router(&self) -> axum::Router {
        http::trace_router(self.clone())
    }

    /// Serves [`status_router`](Self::status_router) on its own listener.
    /// Pass a loopback address (such as `127.0.0.1:9464`, the port the
    /// examples use) unless the endpoint is meant to be reachable from
    /// other hosts. Fails with [`Error::Bind`] (see
    /// [`is_bind`](Error::is_bind)) when the address cannot be listened on.
    pub async fn serve_status(
        &self,
        addr: impl tokio::net::ToSocketAddrs + fmt::Debug,
    ) -> Result<StatusServer> {
        StatusServer::bind(self.clone(), addr).await
    }

    /// Stops fetching, applies what was already fetched, saves the position,
    /// and waits for the consumer to finish.
    ///
    /// Afterwards the node takes no more work ([`register`](Self::register)
    /// fails with [`Error::Shutdown`]) and its caches can be registered on
    /// another node. Calling it again does nothing more.
    pub async fn shutdown(&self) -> Result<()> {
        self.handle.stop.send_replace(true);
        let tasks = self.handle.tasks.lock().await.take();
        for task in tasks.into_iter().flatten() {
            let _ = task.await;
        }
        let shared = &self.handle.shared;
        shared.consuming.store(false, Relaxed);
        let saved = shared.persist().await;
        shared.release_caches();
        saved
    }
}

#[cfg(test)]
pub(crate) mod tests;
