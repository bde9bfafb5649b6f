//! Configuring and starting a node.

use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, watch};

use super::acks::AckQueue;
use super::consume::{Subscribed, consume_loop};
use super::heartbeat::{heartbeat_loop, take};
use super::maintenance::maintenance_loop;
use super::stats::NodeStats;
use super::{Config, Handle, Node, Shared};
use crate::cache::{CacheHandle, SyncedCache};
use crate::cluster::{Cluster, check_interval};
use crate::error::{Error, Result};
use crate::table::check_topic;
use crate::transport::OffsetStore;
use crate::transport::{StartFrom, Transport};
use crate::util::{lock, now_us};
use crate::wire::{Codec, Keyring, check_max_event_bytes};

/// The shortest wait between re-subscription attempts.
const MIN_BACKOFF: Duration = Duration::from_millis(1);

/// Hands each node a token of its own, so a cache knows which node holds it.
static NEXT_NODE_TOKEN: AtomicU64 = AtomicU64::new(1);

/// Configures and starts a [`Node`].
pub struct NodeBuilder {
    pub(super) id: String,
    pub(super) topic: String,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) offsets: Arc<dyn OffsetStore>,
    pub(super) config: Config,
    pub(super) keyring: Option<Keyring>,
    pub(super) caches: Vec<Arc<dyn CacheHandle>>,
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

    /// Where the position is kept. Default: a [`MemoryOffsetStore`](crate::transport::MemoryOffsetStore).
    pub fn offset_store(mut self, store: impl OffsetStore) -> Self {
        self.offsets = Arc::new(store);
        self
    }

    /// Most records fetched and applied as one batch. Default 256.
    pub fn max_batch(mut self, n: usize) -> Self {
        self.config.max_batch = n;
        self
    }

    /// Events larger than this are rejected unread. Default 1 MiB; 1 byte to
    /// 64 MiB, or [`start`](Self::start) refuses it.
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
    ///   a timestamp (every transport but Redis Pub/Sub).
    /// - **After a loss**, or at start on a transport without history (Redis
    ///   Pub/Sub), or for a cache registered after start, that is not
    ///   possible: for this long, versioned refreshes are applied as
    ///   invalidations (counted as `refreshes_quarantined`), so the next read
    ///   goes to the source of truth.
    ///
    /// Loads are not quarantined. A load reads the source of truth, which
    /// already holds every change committed before it ran, the missed ones
    /// included, so installing what it read is as safe after a loss as at
    /// any time. A versioned load
    /// ([`get_with_versioned`](crate::SyncedCache::get_with_versioned))
    /// also records the row's version, exactly the knowledge the loss took:
    /// a refresh older than it is stale from then on. Within the window such
    /// a refresh is still applied as an invalidation, which drops the loaded
    /// value: a reload, never an older value.
    ///
    /// A single publisher per table using automatic versions never publishes
    /// out of version order; zero is then safe.
    ///
    /// It is also how long the node waits for events a publisher's
    /// announcement says it sent (see
    /// [`PublisherBuilder::announce_interval`](crate::PublisherBuilder::announce_interval))
    /// before it takes them as lost and resyncs the cache: a node that
    /// missed the last events before a quiet period resyncs within the
    /// publisher's announce interval plus this window, plus the transport's
    /// latency. Zero resyncs as soon as the announcement arrives;
    /// `Duration::MAX` never does (as long as the process runs).
    pub fn reorder_window(mut self, window: Duration) -> Self {
        self.config.reorder_window = window;
        self
    }

    /// How often the node publishes its heartbeat on the transport's
    /// heartbeat channel (see [`Node::cluster`]). Default 2 s; 10 ms to
    /// 1 h, or `Duration::MAX` for none (the node then neither sends
    /// heartbeats nor answers requests for them, and its cluster view holds
    /// only itself).
    ///
    /// Heartbeats go on a channel of their own, never into the change
    /// history, and are never counted as events. They are signed when the
    /// node [verifies signatures](Self::verify_signatures), and the node
    /// then takes only signed ones in. Other parties count a node as gone
    /// after three of its intervals without a heartbeat.
    pub fn heartbeat_interval(mut self, every: Duration) -> Self {
        self.config.heartbeat_interval = every;
        self
    }

    /// How often the node proves its freshness bound: it asks the broker
    /// for the topic's tail (one request, the transport's
    /// [`tail`](crate::transport::Transport::tail); on RocketMQ one to the
    /// name server and two per broker) and notes, on its own
    /// monotonic clock, when it asked; once it has applied everything up
    /// to that tail, every publish acknowledged before that moment is
    /// applied. `freshness_age_ms` in [`NodeStatus`](crate::status::NodeStatus)
    /// and `cache_sync_node_freshness_age_seconds` in `/metrics` are that
    /// moment's age: how stale the node may be, within one interval. A
    /// node cut off from its broker, or falling behind, shows an age that
    /// grows. Default 1 s; 10 ms to 1 h, or `Duration::MAX` for none.
    ///
    /// A transport that cannot tell its tail proves nothing: the age stays
    /// unknown (`None`), and the node asks once. The embedded transport,
    /// Redis Streams, NATS JetStream, classic Redis Pub/Sub on one server
    /// and RocketMQ tell; sharded Pub/Sub and Pub/Sub on a Redis Cluster do
    /// not.
    pub fn freshness_interval(mut self, every: Duration) -> Self {
        self.config.freshness_interval = every;
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
        check_max_event_bytes(c.max_event_bytes)?;
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
        check_interval("heartbeat_interval", c.heartbeat_interval)?;
        check_interval("freshness_interval", c.freshness_interval)?;
        self.transport.check_topic(&self.topic)?;
        for cache in &self.caches {
            self.transport.check_tag(cache.name())?;
            check_topic(cache.name(), cache.topic(), &self.topic)?;
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
        shared.alive.store(true, Relaxed);
        tracing::info!(node = %shared.id, topic = %shared.topic, transport = shared.transport.kind(), "consumer started");

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
        let maintenance = tokio::spawn(maintenance_loop(shared.clone(), stop_rx.clone()));
        let heartbeats = tokio::spawn(heartbeat_loop(shared.clone(), stop_rx.clone()));
        let auditors = tokio::spawn(super::audit::audit_loop(shared.clone(), stop_rx.clone()));
        let freshness = tokio::spawn(super::freshness::freshness_loop(
            shared.clone(),
            shared.config.freshness_interval,
            stop_rx.clone(),
        ));
        let lateness = tokio::spawn(super::lateness::lateness_loop(shared.clone(), stop_rx));
        Ok(Node {
            handle: Arc::new(Handle {
                shared,
                stop,
                tasks: tokio::sync::Mutex::new(Some([
                    consumer,
                    maintenance,
                    heartbeats,
                    auditors,
                    lateness,
                    freshness,
                ])),
            }),
        })
    }
}

impl NodeBuilder {
    /// The node's shared state, and the caches still to register.
    pub(super) fn into_shared(self) -> (Arc<Shared>, Vec<Arc<dyn CacheHandle>>) {
        let codec = Codec::new(self.config.max_event_bytes, self.keyring);
        let housekeeper = Arc::new(crate::cache::Housekeeper::start());
        let shared = Arc::new_cyclic(|weak: &std::sync::Weak<Shared>| Shared {
            token: NEXT_NODE_TOKEN.fetch_add(1, Relaxed),
            cluster: Cluster::new(
                self.id.clone(),
                self.topic.clone(),
                self.transport.clone(),
                codec.clone(),
                self.config.heartbeat_interval,
                Some({
                    let weak = weak.clone();
                    Box::new(move || weak.upgrade().map(|s| s.heartbeat()))
                }),
                Some({
                    let weak = weak.clone();
                    Box::new(move |request| {
                        if let Some(shared) = weak.upgrade() {
                            let _ = take(&shared, request);
                        }
                    })
                }),
            ),
            started_at_us: now_us(),
            alive: AtomicBool::new(false),
            caught_up: AtomicBool::new(false),
            ack_queue: AckQueue::default(),
            markers: super::audit::Markers::new(),
            probes_in_flight: std::sync::atomic::AtomicUsize::new(0),
            id: self.id,
            topic: self.topic,
            transport: self.transport,
            offsets: self.offsets,
            codec,
            config: self.config,
            caches: RwLock::default(),
            registrations: watch::Sender::new(0),
            position: Mutex::default(),
            dirty: AtomicBool::new(false),
            applied: Notify::new(),
            consuming: AtomicBool::new(false),
            stats: NodeStats::default(),
            housekeeper,
            lateness: super::lateness::Lateness::default(),
            freshness: super::freshness::Freshness::default(),
        });
        (shared, self.caches)
    }
}
