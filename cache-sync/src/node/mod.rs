//! The broadcasting consumer: one per node, applying every event on its topic
//! to the caches the node registered.

use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::cache::{CacheHandle, SyncedCache};
use crate::cluster::{CacheHeartbeat, Cluster, DEFAULT_HEARTBEAT_INTERVAL, Heartbeat};
use crate::error::{Error, Result};
use crate::publish::{DEFAULT_ANNOUNCE_INTERVAL, Publisher};
use crate::status::NodeStatus;
use crate::table::check_topic;
use crate::transport::{
    DEFAULT_TOPIC, LossReason, Position, StartFrom, SubscribeOptions, Subscription, Transport,
};
use crate::util::{HashMap, lock, now_us};
use crate::wire::{Codec, DEFAULT_MAX_EVENT_BYTES};

mod acks;
mod builder;
mod consume;
mod fences;
mod heartbeat;
mod http;
mod maintenance;
mod metrics;
mod offsets;
mod route;
mod seqs;

pub use builder::NodeBuilder;
pub use http::StatusServer;
pub use offsets::{FileOffsetStore, MemoryOffsetStore, OffsetStore};
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) use route::RawNode;

/// The `offsets` fuzz target: `offsets.json` parsing.
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) fn fuzz_offsets(data: &[u8]) {
    offsets::fuzz(data);
}

/// See [`NodeBuilder::reorder_window`].
pub(crate) const DEFAULT_REORDER_WINDOW: Duration = Duration::from_secs(10);

/// The shortest wait between re-subscription attempts.
const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// Hands each node a token of its own, so a cache knows which node holds it.
static NEXT_NODE_TOKEN: AtomicU64 = AtomicU64::new(1);

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

/// The node's tasks: the consumer, the maintenance task, and the
/// heartbeat task.
type Tasks = (JoinHandle<()>, JoinHandle<()>, JoinHandle<()>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// A node that failed to start, or whose last task and handle are gone,
/// lets its caches be registered on another node.
impl Drop for Shared {
    fn drop(&mut self) {
        self.release_caches();
    }
}

struct Shared {
    /// This node's claim on its caches; see `CacheHandle::claim`.
    token: u64,
    id: String,
    topic: String,
    transport: Arc<dyn Transport>,
    offsets: Arc<dyn OffsetStore>,
    config: Config,
    /// Opens what the transport delivers: the size limit and, when the node
    /// verifies signatures, the keyring.
    codec: Codec,
    /// Copied on write (registrations are rare), so the consumer takes one
    /// snapshot per batch instead of a lock and an `Arc` clone per event.
    caches: RwLock<Arc<CacheMap>>,
    /// Bumped on every registration, so the consumer can re-subscribe with
    /// the new tag set.
    registrations: watch::Sender<u64>,
    position: Mutex<Position>,
    /// The position moved since it was last saved.
    dirty: AtomicBool,
    /// Signalled after each applied batch; see `maintenance_loop`.
    applied: Notify,
    consuming: AtomicBool,
    /// The consume task runs (see [`Node::is_alive`]).
    alive: AtomicBool,
    /// The start replay is done: the transport had no more to give at once
    /// (see `consume_loop`).
    caught_up: AtomicBool,
    /// Acknowledgement requests between the heartbeat task, which takes
    /// them in and sends the answers, and the consume task, which decides
    /// when each is met.
    ack_queue: acks::AckQueue,
    started_at_us: u64,
    /// What this node sees of the cluster, its own heartbeat included.
    cluster: Cluster,
    stats: NodeStats,
}

#[derive(Debug, Clone)]
struct Config {
    start_from: StartFrom,
    max_batch: usize,
    max_event_bytes: usize,
    persist_interval: Duration,
    min_backoff: Duration,
    max_backoff: Duration,
    reorder_window: Duration,
    /// `Duration::MAX`: no heartbeats.
    heartbeat_interval: Duration,
}

type CacheMap = HashMap<String, Arc<dyn CacheHandle>>;

#[derive(Default)]
struct NodeStats {
    received: AtomicU64,
    skipped: AtomicU64,
    rejected: AtomicU64,
    losses: AtomicU64,
    /// `losses` split by reason, indexed by `loss_index`; they sum to it.
    losses_by_reason: [AtomicU64; LOSS_REASONS.len()],
    publisher_gaps: AtomicU64,
    /// Events from a replaced outbox relay, applied as invalidations.
    fenced: AtomicU64,
    transport_errors: AtomicU64,
    last_loss: Mutex<Option<(String, u64)>>,
}

/// Every `LossReason`, in the order of `NodeStats::losses_by_reason`.
const LOSS_REASONS: [LossReason; 6] = [
    LossReason::Trimmed,
    LossReason::Reconnected,
    LossReason::HistoryReset,
    LossReason::PublisherGap,
    LossReason::Overflow,
    LossReason::Unreadable,
];

/// Where `reason` is in `LOSS_REASONS`. A match with no wildcard, so a new
/// reason does not compile until it has a counter.
fn loss_index(reason: LossReason) -> usize {
    match reason {
        LossReason::Trimmed => 0,
        LossReason::Reconnected => 1,
        LossReason::HistoryReset => 2,
        LossReason::PublisherGap => 3,
        LossReason::Overflow => 4,
        LossReason::Unreadable => 5,
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
    /// batch shorter than `max_batch`, or 200 ms without one), and no
    /// cache is quarantined after a loss or a late registration.
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
        self.not_ready().is_empty()
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
            .filter(|c| c.status().quarantined)
            .map(|c| {
                format!(
                    "cache {:?} quarantined after a loss or a late registration",
                    c.name()
                )
            })
            .collect();
        quarantined.sort();
        reasons.extend(quarantined);
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
            cache.settle().await;
        }
        self.status()
    }

    /// An axum router to mount in the application's own server. No keys or
    /// values are shown. It serves:
    /// - `GET /cache-sync/status`: [`NodeStatus`] as JSON;
    /// - `GET /cache-sync/caches/{name}`: one [`CacheStatus`](crate::CacheStatus), or 404;
    /// - `GET /cache-sync/cluster`: [`cluster`](Self::cluster)'s
    ///   [`ClusterView`](crate::ClusterView) as JSON;
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
    ///   `_refresh_fallbacks_total`, `_refreshes_quarantined_total`,
    ///   `_loss_resyncs_total`, `_hits_total`, `_misses_total`,
    ///   `_loads_total`, `_load_failures_total`, `_loads_superseded_total`,
    ///   `_loads_stale_total`: the [`CacheStatus`](crate::CacheStatus)
    ///   fields of those names (`events_rejected` is `rejected_events`);
    /// - gauges `cache_sync_cache_entries`, `cache_sync_cache_tracked_keys`
    ///   and `cache_sync_cache_version` (only caches with a version have a
    ///   sample);
    /// - histogram `cache_sync_cache_publish_to_apply_latency_seconds`
    ///   (buckets 100 µs to 10 s): one observation per run of events applied
    ///   to the cache together, the latency of the run's last event, the
    ///   value `last_latency_us` takes. Across machines it includes clock
    ///   skew.
    ///
    /// Per node: counters `cache_sync_node_events_received_total`,
    /// `_events_skipped_total`, `_events_rejected_total`,
    /// `_publisher_gaps_total`, `_transport_errors_total`, and
    /// `cache_sync_node_losses_total` labelled `reason` (every
    /// [`LossReason`] label, zeros included: [`NodeStatus::losses`] split by
    /// reason), `_heartbeats_sent_total`, `_heartbeats_received_total`,
    /// `_heartbeats_rejected_total`, `_heartbeats_dropped_total` (taken in
    /// but past the cluster view's bounds); gauges
    /// `cache_sync_node_consuming`, 1 while
    /// [`is_consuming`](Self::is_consuming), else 0, and
    /// `cache_sync_node_ready`, 1 while [`is_ready`](Self::is_ready). Per
    /// cache also the gauge `cache_sync_cache_quarantined` (0 or 1).
    ///
    /// From the cluster view: gauge `cache_sync_cluster_nodes` (live nodes,
    /// this one included), and per live node (label `node`)
    /// `cache_sync_cluster_heartbeat_age_seconds`, `cache_sync_cluster_node_ready`,
    /// and per node and cache `cache_sync_cluster_cache_lag_versions`
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

    /// Serves [`status_router`](Self::status_router) on its own listener.
    /// Pass a loopback address (such as `127.0.0.1:9464`, the port the
    /// examples use) unless the endpoint is meant to be reachable from
    /// other hosts.
    pub async fn serve_status(&self, addr: impl tokio::net::ToSocketAddrs) -> Result<StatusServer> {
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
        if let Some((consumer, maintenance, heartbeats)) = tasks {
            let _ = consumer.await;
            let _ = maintenance.await;
            let _ = heartbeats.await;
        }
        let shared = &self.handle.shared;
        shared.consuming.store(false, Relaxed);
        let saved = shared.persist().await;
        shared.release_caches();
        saved
    }
}

impl Shared {
    /// The status, with `consuming` as the flag says (the node's handle
    /// also knows whether it was told to stop).
    fn status(&self) -> NodeStatus {
        let s = self;
        let mut caches: Vec<_> = s.caches().values().map(|c| c.status()).collect();
        caches.sort_by(|a, b| a.name.cmp(&b.name));
        let last_loss = lock(&s.stats.last_loss).clone();
        NodeStatus {
            node_id: s.id.clone(),
            transport: s.transport.kind().to_owned(),
            topic: s.topic.clone(),
            consuming: s.consuming.load(Relaxed),
            position: lock(&s.position).clone(),
            events_received: s.stats.received.load(Relaxed),
            events_skipped: s.stats.skipped.load(Relaxed),
            events_rejected: s.stats.rejected.load(Relaxed),
            losses: s.stats.losses.load(Relaxed),
            losses_by_reason: LOSS_REASONS
                .iter()
                .zip(&s.stats.losses_by_reason)
                .map(|(reason, n)| (reason.label().to_owned(), n.load(Relaxed)))
                .collect(),
            publisher_gaps: s.stats.publisher_gaps.load(Relaxed),
            events_fenced: s.stats.fenced.load(Relaxed),
            transport_errors: s.stats.transport_errors.load(Relaxed),
            last_loss_reason: last_loss.as_ref().map(|(r, _)| r.clone()),
            last_loss_at_us: last_loss.map(|(_, at)| at),
            heartbeats_sent: s.cluster.stats().sent.load(Relaxed),
            heartbeats_received: s.cluster.stats().received.load(Relaxed),
            heartbeats_rejected: s.cluster.stats().rejected.load(Relaxed),
            heartbeats_dropped: s.cluster.stats().dropped.load(Relaxed),
            caches,
        }
    }

    /// This node's heartbeat, as of now.
    fn heartbeat(&self) -> Heartbeat {
        let status = self.status();
        let ready = status.consuming
            && self.caught_up.load(Relaxed)
            && status.caches.iter().all(|c| !c.quarantined);
        let interval = self.config.heartbeat_interval;
        let now = now_us();
        Heartbeat {
            node_id: status.node_id,
            topic: status.topic,
            started_at_us: self.started_at_us,
            sent_at_us: now,
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            transport: status.transport,
            consuming: status.consuming,
            ready,
            position: status.position,
            losses: status.losses,
            caches: status
                .caches
                .into_iter()
                .map(|c| CacheHeartbeat {
                    name: c.name,
                    version: c.version,
                    version_at_us: c.version_at_us,
                    // A duration on this node's clock alone: what others
                    // time lags by (they never read `version_at_us`
                    // against their own clock).
                    version_age_ms: c.version_at_us.map(|at| now.saturating_sub(at) / 1000),
                    entries: c.entries,
                    loss_resyncs: c.loss_resyncs,
                    quarantined: c.quarantined,
                    last_latency_us: c.last_latency_us,
                })
                .collect(),
        }
    }

    fn caches(&self) -> Arc<CacheMap> {
        self.caches
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn cache(&self, name: &str) -> Option<Arc<dyn CacheHandle>> {
        self.caches().get(name).cloned()
    }

    async fn register(&self, cache: Arc<dyn CacheHandle>) -> Result<()> {
        let name = cache.name().to_owned();
        check_topic(&name, cache.topic(), &self.topic)?;
        {
            let mut guard = self.caches.write().unwrap_or_else(|p| p.into_inner());
            let caches = Arc::make_mut(&mut guard);
            if caches.contains_key(&name) {
                return Err(Error::DuplicateCache(name));
            }
            if !cache.claim(self.token, self.config.reorder_window) {
                return Err(Error::Config(format!(
                    "cache {name:?} is already registered on a node"
                )));
            }
            caches.insert(name.clone(), cache.clone());
        }
        // The reset below can wait (for a write, or a loader holding a key):
        // a caller that gives up meanwhile (a timeout) must not leave the
        // cache in the map without the re-subscription that brings its
        // events, so the registration is undone unless it completes.
        let mut undo = UndoRegister {
            shared: self,
            cache: Some(cache.clone()),
        };
        // After the insert: events applied meanwhile are wiped too, which is
        // safe; the other order could drop one that arrived in between.
        cache.reset().await;
        self.registrations.send_modify(|n| *n = n.wrapping_add(1));
        undo.cache = None;
        tracing::debug!(node = %self.id, cache = %name, "cache registered");
        Ok(())
    }

    /// Takes a cache out of the map again, and releases it.
    fn unregister(&self, cache: &Arc<dyn CacheHandle>) {
        {
            let mut guard = self.caches.write().unwrap_or_else(|p| p.into_inner());
            Arc::make_mut(&mut guard).remove(cache.name());
        }
        cache.release(self.token);
    }

    fn release_caches(&self) {
        for cache in self.caches().values() {
            cache.release(self.token);
        }
    }

    async fn subscribe(&self, from: StartFrom) -> Result<Box<dyn Subscription>> {
        let mut options = SubscribeOptions::new(from);
        if self.transport.filters_by_tag() {
            options = options.with_tags(self.caches().keys().cloned());
        }
        self.transport.subscribe(&self.topic, options).await
    }

    async fn persist(&self) -> Result<()> {
        let position = lock(&self.position).clone();
        if position.is_empty() {
            return Ok(());
        }
        self.offsets.save(&self.topic, &position).await
    }

    /// Counts a loss and remembers its reason for the status.
    fn record_loss(&self, reason: LossReason) {
        self.stats.losses.fetch_add(1, Relaxed);
        // `loss_index` is always in bounds; `get` rather than indexing
        // keeps a panic out of the consumer all the same.
        if let Some(n) = self.stats.losses_by_reason.get(loss_index(reason)) {
            n.fetch_add(1, Relaxed);
        }
        *lock(&self.stats.last_loss) = Some((reason.label().to_owned(), now_us()));
    }

    async fn resync_all(&self, reason: LossReason, missed: Option<u64>) {
        self.record_loss(reason);
        let caches: Vec<_> = self.caches().values().cloned().collect();
        tracing::warn!(
            node = %self.id, topic = %self.topic, reason = reason.label(), ?missed, caches = caches.len(),
            "events may have been lost; invalidating every cache on the topic"
        );
        for cache in caches {
            cache.resync().await;
        }
    }
}

/// Takes a cache out again if its registration is dropped half-way.
struct UndoRegister<'a> {
    shared: &'a Shared,
    cache: Option<Arc<dyn CacheHandle>>,
}

impl Drop for UndoRegister<'_> {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            self.shared.unregister(&cache);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
