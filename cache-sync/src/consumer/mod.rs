//! The broadcasting consumer: one per node, applying every event on its topic
//! to the caches the node registered.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::bus::{
    ChangeBus, Delivery, Loss, LossReason, Position, Record, StartFrom, SubscribeOptions,
    Subscription,
};
use crate::cache::{CacheHandle, SyncedCache, now_us};
use crate::error::{DecodeError, DecodeErrorKind, Error, Result};
use crate::event::{
    DEFAULT_MAX_EVENT_BYTES, MAX_EVENT_BYTES_CEILING, decode_change, decode_header,
};
use crate::lock;
use crate::publish::Publisher;
use crate::sign::{Keyring, strip_unverified};
use crate::status::{NodeStatus, StatusServer};
use crate::util::deadline_after;

mod offsets;

pub use offsets::{FileOffsetStore, MemoryOffsetStore, OffsetStore};

/// The topic used when none is set.
pub const DEFAULT_TOPIC: &str = "cache-sync";

/// See [`NodeBuilder::reorder_window`].
pub const DEFAULT_REORDER_WINDOW: Duration = Duration::from_secs(10);

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
            .field("transport", &self.handle.shared.bus.kind())
            .finish_non_exhaustive()
    }
}

/// Owned by the `Node` clones only; the tasks hold `Shared`, so dropping the
/// last `Node` can stop them.
struct Handle {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: tokio::sync::Mutex<Option<(JoinHandle<()>, JoinHandle<()>)>>,
}

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
    bus: Arc<dyn ChangeBus>,
    offsets: Arc<dyn OffsetStore>,
    config: Config,
    keyring: Option<Keyring>,
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
}

#[derive(Default)]
struct NodeStats {
    received: AtomicU64,
    skipped: AtomicU64,
    rejected: AtomicU64,
    losses: AtomicU64,
    publisher_gaps: AtomicU64,
    transport_errors: AtomicU64,
    last_loss: Mutex<Option<(String, u64)>>,
}

/// Configures and starts a [`Node`].
pub struct NodeBuilder {
    id: String,
    topic: String,
    bus: Arc<dyn ChangeBus>,
    offsets: Arc<dyn OffsetStore>,
    config: Config,
    keyring: Option<Keyring>,
    caches: Vec<Arc<dyn CacheHandle>>,
}

impl fmt::Debug for NodeBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeBuilder")
            .field("id", &self.id)
            .field("topic", &self.topic)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl NodeBuilder {
    /// The topic to consume (and, for [`Node::publisher`], to publish to).
    /// Use one topic per application or domain, not one for the whole company:
    /// every node reads every event on its topic. Default `"cache-sync"`.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// Where to start when the offset store holds no position. Default
    /// [`StartFrom::Latest`], right for caches that start empty.
    pub fn start_from(mut self, from: StartFrom) -> Self {
        self.config.start_from = from;
        self
    }

    /// Where the position is kept. Default: a [`MemoryOffsetStore`].
    pub fn offset_store(mut self, store: impl OffsetStore) -> Self {
        self.offsets = Arc::new(store);
        self
    }

    /// Most records fetched and applied as one batch. Default 256.
    pub fn max_batch(mut self, n: usize) -> Self {
        self.config.max_batch = n;
        self
    }

    /// Events larger than this are rejected unread. Default 1 MiB; at most
    /// [`MAX_EVENT_BYTES_CEILING`](crate::MAX_EVENT_BYTES_CEILING).
    pub fn max_event_bytes(mut self, n: usize) -> Self {
        self.config.max_event_bytes = n;
        self
    }

    /// How often the position is saved. Default 5 s (RocketMQ's default).
    pub fn persist_interval(mut self, every: Duration) -> Self {
        self.config.persist_interval = every;
        self
    }

    /// Wait between re-subscription attempts after a transport error:
    /// starts at `min`, doubles up to `max`. Default 100 ms to 5 s.
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.config.min_backoff = min;
        self.config.max_backoff = max;
        self
    }

    /// The longest time between a version being assigned (the database
    /// commit) and its event being published, retries included. Default 10 s.
    ///
    /// Why it matters: when two writers publish in another order than they
    /// committed, a node can receive an older refresh after a newer event for
    /// the same key. Versions sort that out, as long as the node saw both.
    /// It may not have:
    /// - **At start**, the newer event may have been published just before
    ///   the node subscribed. So a node starting from the latest position
    ///   first replays this much history, where the transport can start from
    ///   a timestamp (embedded bus, Redis Streams).
    /// - **After a loss**, or at start on a transport without history (Redis
    ///   Pub/Sub), or for a cache registered after start, that is not
    ///   possible: for this long, versioned refreshes are applied as
    ///   invalidations (counted as `refreshes_quarantined`), so the next read
    ///   goes to the source of truth.
    ///
    /// A single publisher per table using automatic versions never publishes
    /// out of version order; zero is then safe.
    pub fn reorder_window(mut self, window: Duration) -> Self {
        self.config.reorder_window = window;
        self
    }

    /// Accepts only events signed with a key in `keyring`. Unsigned, forged
    /// or tampered events, and events signed with an unknown key, are
    /// rejected, counted and logged, and change nothing: unlike unreadable
    /// events they do not invalidate a cache, since anyone could send them.
    ///
    /// Without this, signed events are accepted without being checked, so
    /// publishers can start signing before nodes start verifying.
    pub fn verify_signatures(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// Registers a cache before the consumer starts. See [`Node::register`].
    pub fn register<K, V>(mut self, cache: &SyncedCache<K, V>) -> Self
    where
        K: Hash + Eq + Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
        V: Clone + Send + Sync + DeserializeOwned + 'static,
    {
        self.caches.push(cache.handle());
        self
    }

    /// Validates the configuration, subscribes, and starts consuming. When it
    /// returns, every event published afterwards reaches this node.
    pub async fn start(self) -> Result<Node> {
        let c = &self.config;
        if self.id.is_empty() {
            return Err(Error::Config("node id must not be empty".into()));
        }
        if c.max_batch == 0 {
            return Err(Error::Config("max_batch must be at least 1".into()));
        }
        if c.max_event_bytes == 0 || c.max_event_bytes > MAX_EVENT_BYTES_CEILING {
            return Err(Error::Config(format!(
                "max_event_bytes must be between 1 and {MAX_EVENT_BYTES_CEILING}"
            )));
        }
        if c.persist_interval.is_zero() {
            return Err(Error::Config("persist_interval must be non-zero".into()));
        }
        if c.min_backoff < MIN_BACKOFF || c.min_backoff > c.max_backoff {
            return Err(Error::Config(format!(
                "reconnect_backoff needs {MIN_BACKOFF:?} <= min <= max, not {:?} and {:?}: \
                 a smaller minimum would retry a down broker in a tight loop",
                c.min_backoff, c.max_backoff
            )));
        }
        self.bus.check_topic(&self.topic)?;
        for cache in &self.caches {
            self.bus.check_tag(cache.name())?;
        }
        // Everything that can be refused without side effects is refused
        // above; from here a failure drops `shared`, whose `Drop` releases
        // every cache claimed so far, so they can be registered again.
        let (shared, caches) = self.into_shared();
        for cache in caches {
            shared.register(cache).await?;
        }

        let stored = shared.offsets.load(&shared.topic).await?;
        let window = shared.config.reorder_window;
        // Whether the caches see every event that could still be reordered
        // against what comes next; if not, they are quarantined.
        let mut covered = false;
        let from = match stored {
            // The caches are new: what the previous run applied is unknown to them.
            Some(p) => StartFrom::Position(p),
            None => match &shared.config.start_from {
                StartFrom::Latest if !window.is_zero() => {
                    covered = true;
                    // A window reaching back before the epoch (`Duration::MAX`)
                    // asks for all the history there is.
                    match std::time::SystemTime::now().checked_sub(window) {
                        Some(t) if t > std::time::UNIX_EPOCH => StartFrom::Timestamp(t),
                        _ => StartFrom::Earliest,
                    }
                }
                StartFrom::Latest | StartFrom::Earliest => {
                    covered = true;
                    shared.config.start_from.clone()
                }
                other => other.clone(),
            },
        };
        // Taken before subscribing: a registration from here on must trigger a
        // re-subscription, even if it lands before the consumer first runs.
        let registrations = shared.registrations.subscribe();
        let names: HashSet<String> = shared.caches().keys().cloned().collect();
        let subscription = match shared.subscribe(from).await {
            Err(e)
                if e.is_unsupported() && matches!(shared.config.start_from, StartFrom::Latest) =>
            {
                // No history to look back into (Pub/Sub): quarantine instead.
                covered = false;
                shared.subscribe(StartFrom::Latest).await?
            }
            other => other?,
        };
        if !covered {
            for cache in shared.caches().values() {
                cache.quarantine();
            }
        }
        if let Some(p) = subscription.position() {
            *lock(&shared.position) = p;
        }
        shared.consuming.store(true, Relaxed);
        tracing::info!(node = %shared.id, topic = %shared.topic, transport = shared.bus.kind(), "consumer started");

        let (stop, stop_rx) = watch::channel(false);
        let consumer = tokio::spawn(consume_loop(
            shared.clone(),
            Subscribed {
                subscription,
                registrations,
                names,
            },
            stop_rx.clone(),
        ));
        let maintenance = tokio::spawn(maintenance_loop(shared.clone(), stop_rx));
        Ok(Node {
            handle: Arc::new(Handle {
                shared,
                stop,
                tasks: tokio::sync::Mutex::new(Some((consumer, maintenance))),
            }),
        })
    }
}

impl NodeBuilder {
    /// The node's shared state, and the caches still to register.
    fn into_shared(self) -> (Arc<Shared>, Vec<Arc<dyn CacheHandle>>) {
        let shared = Arc::new(Shared {
            token: NEXT_NODE_TOKEN.fetch_add(1, Relaxed),
            id: self.id,
            topic: self.topic,
            bus: self.bus,
            offsets: self.offsets,
            config: self.config,
            keyring: self.keyring,
            caches: RwLock::default(),
            registrations: watch::Sender::new(0),
            position: Mutex::default(),
            dirty: AtomicBool::new(false),
            applied: Notify::new(),
            consuming: AtomicBool::new(false),
            stats: NodeStats::default(),
        });
        (shared, self.caches)
    }
}

impl Node {
    /// Configures a node with this id on this transport.
    pub fn builder(id: impl Into<String>, bus: impl ChangeBus) -> NodeBuilder {
        NodeBuilder {
            id: id.into(),
            topic: DEFAULT_TOPIC.into(),
            bus: Arc::new(bus),
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
            },
            caches: Vec::new(),
        }
    }

    /// Starts a node with default settings.
    pub async fn start(id: impl Into<String>, bus: impl ChangeBus) -> Result<Node> {
        Self::builder(id, bus).start().await
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
    /// transport cannot carry its name, and [`Error::Shutdown`] once the node
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
        shared.bus.check_tag(handle.name())?;
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
    /// its origin; it signs if the node verifies signatures.
    pub fn publisher(&self) -> Publisher {
        let s = &self.handle.shared;
        let builder = Publisher::builder(s.bus.clone())
            .topic(s.topic.clone())
            .origin(s.id.clone())
            .max_event_bytes(s.config.max_event_bytes);
        match &s.keyring {
            Some(ring) => builder.signing(ring.clone()).build_checked(),
            None => builder.build_checked(),
        }
    }

    /// Whether the consumer is running and its transport healthy.
    pub fn is_consuming(&self) -> bool {
        self.handle.shared.consuming.load(Relaxed) && !*self.handle.stop.borrow()
    }

    /// What the status endpoint reports.
    pub fn status(&self) -> NodeStatus {
        let s = &self.handle.shared;
        let mut caches: Vec<_> = s.caches().values().map(|c| c.status()).collect();
        caches.sort_by(|a, b| a.name.cmp(&b.name));
        let last_loss = lock(&s.stats.last_loss).clone();
        NodeStatus {
            node_id: s.id.clone(),
            transport: s.bus.kind().to_owned(),
            topic: s.topic.clone(),
            consuming: self.is_consuming(),
            position: lock(&s.position).clone(),
            events_received: s.stats.received.load(Relaxed),
            events_skipped: s.stats.skipped.load(Relaxed),
            events_rejected: s.stats.rejected.load(Relaxed),
            losses: s.stats.losses.load(Relaxed),
            publisher_gaps: s.stats.publisher_gaps.load(Relaxed),
            transport_errors: s.stats.transport_errors.load(Relaxed),
            last_loss_reason: last_loss.as_ref().map(|(r, _)| r.clone()),
            last_loss_at_us: last_loss.map(|(_, at)| at),
            caches,
        }
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

    /// An axum router serving `GET /cache-sync/status`,
    /// `GET /cache-sync/caches/{name}` and `GET /healthz`, to mount in the
    /// application's own server. No keys or values are shown.
    pub fn status_router(&self) -> axum::Router {
        crate::status::router(self.clone())
    }

    /// Serves [`status_router`](Self::status_router) on its own listener.
    /// Pass a loopback address (see
    /// [`DEFAULT_STATUS_ADDR`](crate::DEFAULT_STATUS_ADDR)) unless the
    /// endpoint is meant to be reachable from other hosts.
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
        if let Some((consumer, maintenance)) = tasks {
            let _ = consumer.await;
            let _ = maintenance.await;
        }
        let shared = &self.handle.shared;
        shared.consuming.store(false, Relaxed);
        let saved = shared.persist().await;
        shared.release_caches();
        saved
    }
}

impl Shared {
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
        if self.bus.filters_by_tag() {
            options = options.with_tags(self.caches().keys().cloned());
        }
        self.bus.subscribe(&self.topic, options).await
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

/// The initial subscription and what it was made with.
struct Subscribed {
    subscription: Box<dyn Subscription>,
    registrations: watch::Receiver<u64>,
    /// The caches registered when it was made.
    names: HashSet<String>,
}

/// Whichever task ends first, by shutdown or by a panic in user code (a
/// key's `Deserialize` or `Hash`), the node stops reporting itself healthy.
struct MarkDownOnExit<'a>(&'a Shared);

impl Drop for MarkDownOnExit<'_> {
    fn drop(&mut self) {
        self.0.consuming.store(false, Relaxed);
    }
}

/// Fetches and applies, in one task. Owns the subscription and re-subscribes
/// after errors, from the last position applied.
///
/// Applying inline, rather than handing batches to a second task, saves a
/// task wake-up per event (tens of µs on a small VM, once per node). Every
/// transport buffers on its own side (a Redis stream or NATS stream is read
/// on demand; Pub/Sub and RocketMQ buffer in the client, and overflow there is
/// a detected loss), so a slow cache slows fetching and memory stays bounded.
async fn consume_loop(shared: Arc<Shared>, initial: Subscribed, mut stop: watch::Receiver<bool>) {
    let _down = MarkDownOnExit(&shared);
    let cfg = &shared.config;
    let Subscribed {
        subscription,
        mut registrations,
        names: mut subscribed_names,
    } = initial;
    let mut seqs = PublisherSeqs::default();
    let mut fetched = subscription.position();
    let mut sub = Some(subscription);
    let mut backoff = Duration::ZERO;
    // Whether the next subscription resumes after a broken one (time passed,
    // connections dropped), rather than re-subscribing at once for new tags.
    let mut after_error = false;
    // One future for the whole loop: a fresh `wait_for` per select would
    // register with (and leave) the channel's waiter list once per event.
    let mut stopped = std::pin::pin!(async move {
        let _ = stop.wait_for(|s| *s).await;
    });

    loop {
        let Some(s) = sub.as_mut() else {
            if !backoff.is_zero() {
                tokio::select! {
                    () = &mut stopped => break,
                    () = tokio::time::sleep(backoff) => {}
                }
            }
            let from = match &fetched {
                Some(p) => StartFrom::Position(p.clone()),
                None => {
                    // Nowhere to resume from: whatever came between is lost.
                    let loss = Loss::new(LossReason::Reconnected, None, None);
                    apply_loss(&shared, &mut seqs, loss).await;
                    shared.config.start_from.clone()
                }
            };
            let resumed = after_error && fetched.is_some();
            let names: HashSet<String> = shared.caches().keys().cloned().collect();
            match shared.subscribe(from).await {
                Ok(new) => {
                    fetched = new.position().or(fetched);
                    sub = Some(new);
                    backoff = Duration::ZERO;
                    after_error = false;
                    if resumed {
                        seqs.resumed(names.iter().cloned());
                    }
                    shared.consuming.store(true, Relaxed);
                    for name in names.difference(&subscribed_names) {
                        if let Some(cache) = shared.cache(name) {
                            // Events for it may have been filtered out before now.
                            cache.reset().await;
                            cache.quarantine();
                        }
                    }
                    subscribed_names = names;
                }
                Err(e) => {
                    shared.stats.transport_errors.fetch_add(1, Relaxed);
                    shared.consuming.store(false, Relaxed);
                    after_error = true;
                    backoff = next_backoff(backoff, cfg);
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff, "re-subscribe failed");
                }
            }
            continue;
        };

        let next = tokio::select! {
            biased;
            () = &mut stopped => break,
            Ok(()) = registrations.changed(), if shared.bus.filters_by_tag() => {
                // New tags: re-subscribe where we are, at once.
                fetched = s.position().or(fetched);
                sub = None;
                continue;
            }
            next = s.next(cfg.max_batch) => next,
        };
        match next {
            Ok(Delivery::Batch { records, position }) => {
                apply_records(&shared, &mut seqs, records).await;
                shared.applied.notify_one();
                fetched
                    .get_or_insert_with(Position::default)
                    .advance(&position);
                lock(&shared.position).advance(&position);
                shared.dirty.store(true, Relaxed);
            }
            Ok(Delivery::Lost(loss)) => {
                if let Some(p) = &loss.resume_at {
                    fetched.get_or_insert_with(Position::default).advance(p);
                }
                apply_loss(&shared, &mut seqs, loss).await;
            }
            Err(e) => {
                shared.stats.transport_errors.fetch_add(1, Relaxed);
                shared.consuming.store(false, Relaxed);
                after_error = true;
                backoff = next_backoff(backoff, cfg);
                tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff, "subscription failed; re-subscribing");
                sub = None;
            }
        }
    }
}

/// Doubles the wait, within the configured bounds, without overflowing.
fn next_backoff(backoff: Duration, cfg: &Config) -> Duration {
    backoff
        .saturating_mul(2)
        .clamp(cfg.min_backoff, cfg.max_backoff)
}

async fn apply_loss(shared: &Shared, seqs: &mut PublisherSeqs, loss: Loss) {
    // Every publisher may have lost events; their next sequence numbers will
    // jump, and that is already answered here.
    seqs.clear();
    shared.resync_all(loss.reason, loss.missed).await;
    if let Some(p) = loss.resume_at {
        lock(&shared.position).advance(&p);
    }
    shared.dirty.store(true, Relaxed);
}

/// moka does its housekeeping (applying logged reads and writes, expiry,
/// eviction) inline, in whichever cache call finds 64 writes logged or
/// 300 ms passed since the last run. Left alone, that call is now and then
/// the consumer applying an event, which then pays for everything logged
/// since; and since every node gets the same events, all nodes pay on the
/// same event. So the maintenance task runs it instead: `SETTLE_DELAY` after
/// the consumer has applied something (coalescing a burst, and out of the
/// way of the batch just applied), and every `HOUSEKEEPING_INTERVAL` for the
/// application's reads. An idle node does not wake up for it more often.
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_millis(200);
const SETTLE_DELAY: Duration = Duration::from_millis(10);

/// Off the consumer's path: saves the applied position periodically, so a
/// slow offset store never delays applying, and runs the caches'
/// housekeeping.
async fn maintenance_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    // Deadlines rather than `tokio::time::interval`, whose next tick is
    // `now + period` and panics for a period as long as `Duration::MAX`.
    let every = shared.config.persist_interval;
    let mut persist = std::pin::pin!(tokio::time::sleep_until(deadline_after(every)));
    let mut housekeeping = std::pin::pin!(tokio::time::sleep_until(deadline_after(
        HOUSEKEEPING_INTERVAL
    )));
    enum Due {
        Stop,
        Persist,
        Housekeeping,
        Applied,
    }
    loop {
        let due = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => Due::Stop,
            () = &mut persist => Due::Persist,
            () = &mut housekeeping => Due::Housekeeping,
            () = shared.applied.notified() => Due::Applied,
        };
        match due {
            Due::Stop => break,
            Due::Persist => {
                if shared.dirty.swap(false, Relaxed)
                    && let Err(e) = shared.persist().await
                {
                    shared.dirty.store(true, Relaxed);
                    tracing::warn!(node = %shared.id, error = %e, "could not save position");
                }
                persist.as_mut().reset(deadline_after(every));
            }
            Due::Housekeeping | Due::Applied => {
                if matches!(due, Due::Applied) {
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => break,
                        () = tokio::time::sleep(SETTLE_DELAY) => {}
                    }
                }
                for cache in shared.caches().values() {
                    cache.settle().await;
                }
                // It just ran: the periodic run can wait a whole interval.
                housekeeping
                    .as_mut()
                    .reset(deadline_after(HOUSEKEEPING_INTERVAL));
            }
        }
    }
}

type CacheMap = HashMap<String, Arc<dyn CacheHandle>>;

/// Last sequence number seen per (publisher, cache), to detect gaps.
/// Keyed by publisher first, so a lookup by `&str` allocates nothing.
#[derive(Default)]
struct PublisherSeqs {
    last: HashMap<u64, HashMap<String, u64>>,
    tracked: usize,
    /// Caches whose unknown publishers are not taken on trust: every cache
    /// held when the subscription last resumed, until it is resynced.
    distrusted: HashSet<String>,
}

/// Bounds memory when publishers come and go: forgetting baselines only
/// delays gap detection for the next event of each, it never raises a false one.
const MAX_TRACKED_PUBLISHERS: usize = 100_000;

impl PublisherSeqs {
    /// After a loss every cache was resynced: nothing before now matters.
    fn clear(&mut self) {
        self.last.clear();
        self.tracked = 0;
        self.distrusted.clear();
    }

    /// The subscription resumed from a position. Had the transport's history
    /// been replaced unnoticed in between, a publisher's earlier events
    /// would be gone, and only a known baseline could tell; so for these
    /// caches, a publisher's first event after a start counts as a gap.
    fn resumed(&mut self, caches: impl IntoIterator<Item = String>) {
        self.distrusted.extend(caches);
    }

    /// `cache` was resynced: what any publisher sent it before is moot.
    fn resynced(&mut self, cache: &str) {
        self.distrusted.remove(cache);
    }

    /// Records `seq`; returns how many events may have been missed before
    /// it, if any. Checked arithmetic throughout: `seq` comes off the wire.
    fn observe(&mut self, publisher: u64, cache: &str, seq: u64) -> Option<u64> {
        if let Some(last) = self.last.get_mut(&publisher).and_then(|m| m.get_mut(cache)) {
            // A redelivery (seq <= last) is applied again but does not move back.
            let missed = seq.checked_sub(*last).and_then(|d| d.checked_sub(1));
            *last = (*last).max(seq);
            return missed.filter(|&m| m > 0);
        }
        if self.tracked >= MAX_TRACKED_PUBLISHERS {
            // Forgetting baselines is safe here, not after a resume: the
            // caches stay distrusted.
            self.last.clear();
            self.tracked = 0;
        }
        self.last
            .entry(publisher)
            .or_default()
            .insert(cache.to_owned(), seq);
        self.tracked = self.tracked.saturating_add(1);
        // A publisher's first event (seq 1) vouches for everything before it.
        (seq > 1 && self.distrusted.contains(cache)).then(|| seq.saturating_sub(1))
    }
}

async fn apply_records(shared: &Shared, seqs: &mut PublisherSeqs, records: Vec<Record>) {
    let limit = shared.config.max_event_bytes;
    // Every record here was published before this snapshot, so a cache
    // registered after it has nothing in this batch that its own reset and
    // first loads would not already reflect.
    let caches = shared.caches();
    for record in records {
        shared.stats.received.fetch_add(1, Relaxed);
        // Tag filter: skip other caches' events without reading them. The
        // tag is not authenticated, but skipping changes nothing.
        let tagged = match record.tag.as_deref() {
            Some(tag) => match caches.get(tag) {
                Some(c) => Some(c),
                None => {
                    shared.stats.skipped.fetch_add(1, Relaxed);
                    continue;
                }
            },
            None => None,
        };
        // Authentication comes before anything that could change state,
        // the size check and the tag's cache included: what fails it may
        // only bump a counter, or forgeries could flush caches at will.
        let payload = match &shared.keyring {
            Some(ring) => match ring.open(&record.payload) {
                Ok(inner) => inner,
                Err(e) => {
                    reject(shared, &record, &e.to_string(), e.kind().label());
                    continue;
                }
            },
            None => strip_unverified(&record.payload),
        };
        // From here the bytes are authentic, or the node does not ask: an
        // unreadable event may have carried a change.
        if record.payload.len() > limit {
            let e = DecodeError::new(DecodeErrorKind::TooLarge {
                size: record.payload.len(),
                limit,
            });
            reject(shared, &record, &e.to_string(), e.kind().label());
            unreadable(shared, seqs, &caches, tagged, payload, &e.to_string()).await;
            continue;
        }
        let (header, offset) = match decode_header(payload, limit) {
            Ok(h) => h,
            Err(e) => {
                reject(shared, &record, &e.to_string(), e.kind().label());
                unreadable(shared, seqs, &caches, tagged, payload, &e.to_string()).await;
                continue;
            }
        };
        let Some(cache) = caches.get(&header.cache) else {
            shared.stats.skipped.fetch_add(1, Relaxed);
            continue;
        };
        if let Some(missed) = seqs.observe(header.publisher, &header.cache, header.seq) {
            shared.stats.publisher_gaps.fetch_add(1, Relaxed);
            shared.record_loss(LossReason::PublisherGap);
            tracing::warn!(node = %shared.id, cache = %header.cache, origin = %header.origin,
                publisher = header.publisher, seq = header.seq, missed,
                "gap in a publisher's sequence; invalidating that cache");
            // Sequence numbers run per (publisher, cache): only this cache
            // can have missed anything.
            cache.resync().await;
            seqs.resynced(&header.cache);
        }
        match decode_change(payload, offset) {
            Ok(change) => cache.apply(&header, change).await,
            Err(e) => {
                reject(shared, &record, &e.to_string(), e.kind().label());
                cache.reject(&e.to_string()).await;
                seqs.resynced(&header.cache);
            }
        }
    }
}

/// An event that is authentic (or the node does not verify) but cannot be
/// applied: the cache it was meant for may have missed a change. The
/// event's header names that cache (read from the front of an oversized
/// payload; on a verifying node it is signed, unlike the tag), or else the
/// transport's tag; an event that names no cache at all may have been for
/// any of them (a Pub/Sub message carries no tag, and a publisher of a
/// newer format writes a header this node cannot read).
async fn unreadable(
    shared: &Shared,
    seqs: &mut PublisherSeqs,
    caches: &CacheMap,
    tagged: Option<&Arc<dyn CacheHandle>>,
    payload: &[u8],
    reason: &str,
) {
    let limit = shared.config.max_event_bytes;
    let header = decode_header(payload.get(..limit).unwrap_or(payload), limit)
        .ok()
        .map(|(h, _)| h);
    if let Some(h) = &header
        && let Some(cache) = caches.get(&h.cache)
    {
        // Its number is used up: the next one is no gap.
        let _ = seqs.observe(h.publisher, &h.cache, h.seq);
        cache.reject(reason).await;
        seqs.resynced(&h.cache);
    } else if let Some(cache) = tagged {
        cache.reject(reason).await;
        seqs.resynced(cache.name());
    } else if header.is_none() {
        shared.resync_all(LossReason::Unreadable, None).await;
        for cache in caches.keys() {
            seqs.resynced(cache);
        }
    }
}

fn reject(shared: &Shared, record: &Record, reason: &str, label: &str) {
    shared.stats.rejected.fetch_add(1, Relaxed);
    tracing::warn!(node = %shared.id, tag = ?record.tag, position = %record.position, bytes = record.payload.len(),
        kind = label, %reason, "rejected an unreadable event");
}

/// The `records` fuzz target (see `crate::fuzz`). The first byte picks
/// whether the node verifies signatures (bit 0), the size of its version
/// table (bits 1-3) and its event size limit (bits 4-5: 64 to 512 bytes,
/// small, so that oversized records are common); the rest is records, each a tag
/// (one length byte, 255 for none, then its bytes) and a payload (two length
/// bytes, little-endian, then its bytes).
///
/// Checked, whatever the bytes: nothing panics; every record is counted;
/// and on a verifying node, where no input can carry a valid signature,
/// nothing changes a cache: warm entries stay, and nothing is resynced.
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) fn fuzz_records(data: &[u8]) {
    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime for the fuzz target");
        // Made once: a new moka cache per input cost a millisecond or two,
        // most of the target's time. Registration empties them each time.
        static MOKA: (moka::future::Cache<String, String>, moka::future::Cache<u64, Vec<u8>>) =
            (moka::future::Cache::new(64), moka::future::Cache::new(64));
    }
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let mut records = Vec::new();
    while let Some((&tag_len, tail)) = rest.split_first() {
        let (tag, tail) = match tag_len {
            255 => (None, tail),
            n => {
                let n = usize::from(n).min(tail.len());
                let (tag, tail) = tail.split_at(n);
                (Some(String::from_utf8_lossy(tag).into_owned()), tail)
            }
        };
        let (len, tail) = match tail {
            [a, b, tail @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), tail),
            _ => (0, &[][..]),
        };
        let (payload, tail) = tail.split_at(len.min(tail.len()));
        records.push(Record::new(
            Position::default(),
            tag,
            bytes::Bytes::copy_from_slice(payload),
        ));
        rest = tail;
    }
    let verify = mode & 1 == 1;
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let (moka_a, moka_b) = MOKA.with(Clone::clone);
            let a: SyncedCache<String, String> = SyncedCache::builder("a", moka_a)
                .max_tracked_keys(usize::from((mode >> 1) & 7))
                .build();
            let b: SyncedCache<u64, Vec<u8>> = SyncedCache::new("b", moka_b);
            let mut builder = Node::builder("fuzz", crate::EmbeddedBus::new())
                .max_event_bytes(64 << ((mode >> 4) & 3))
                .register(&a)
                .register(&b);
            if verify {
                builder = builder.verify_signatures(crate::fuzz::ring());
            }
            let (shared, caches) = builder.into_shared();
            for cache in caches {
                shared
                    .register(cache)
                    .await
                    .expect("two fresh caches register");
            }
            a.insert("warm".into(), "kept".into()).await;
            b.insert(7, vec![7]).await;
            let n = records.len() as u64;
            // The seeds hold records signed with the target's key, so that
            // the fuzzer reaches what comes after the check too; the promise
            // is checked on inputs where no record is authentic.
            let ring = crate::fuzz::ring();
            let forged_only = records.iter().all(|r| ring.open(&r.payload).is_err());
            apply_records(&shared, &mut PublisherSeqs::default(), records).await;
            let s = &shared.stats;
            assert_eq!(s.received.load(Relaxed), n, "every record is counted");
            let refused = s
                .skipped
                .load(Relaxed)
                .saturating_add(s.rejected.load(Relaxed));
            assert!(refused <= n);
            if verify && forged_only {
                assert_eq!(refused, n, "an unsigned record got through");
                assert_eq!(a.peek(&"warm".into()).await.as_deref(), Some("kept"));
                assert_eq!(b.peek(&7).await, Some(vec![7]));
                for c in [a.status(), b.status()] {
                    assert_eq!(
                        (c.loss_resyncs, c.rejected_events, c.events_applied),
                        (0, 0, 0),
                        "an unauthenticated record changed cache {}",
                        c.name
                    );
                }
            }
        });
    });
}

/// The `offsets` fuzz target: `offsets.json` parsing.
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) fn fuzz_offsets(data: &[u8]) {
    offsets::fuzz(data);
}

#[cfg(test)]
mod tests;
