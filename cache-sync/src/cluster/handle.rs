//! The [`Cluster`] handle and what it shares between clones and tasks
//! (`Inner`), the heartbeat channel's counters, and its construction: a
//! node's view through [`Cluster::new`], a watcher's through
//! [`ClusterBuilder`]. What the view does is in the sibling files:
//! `membership` (taking heartbeats in, reading the nodes), `channel` (the
//! heartbeat channel's sends and reads) and `watcher` (a watcher's task).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::heartbeat::{DEFAULT_HEARTBEAT_INTERVAL, MIN_HEARTBEAT_INTERVAL};
use super::watcher::watch_loop;
use super::{Heartbeat, Message, Request, ack, members, probe};
use crate::error::Result;
use crate::transport::{DEFAULT_TOPIC, Transport};
use crate::util::{check_duration, lock};
use crate::wire::{Codec, DEFAULT_MAX_EVENT_BYTES, Keyring};

/// The cluster as one party on the topic sees it: every node's last
/// heartbeat. A node has one ([`Node::cluster`](crate::Node::cluster));
/// anyone else can watch with [`Cluster::watch`].
///
/// Cheap to clone; clones share the view. A watcher stops when
/// [`shutdown`](Self::shutdown) is called or its last clone is dropped.
///
/// # Bounds
/// A view keeps a summary of each live node's last heartbeat (what
/// [`nodes`](Self::nodes) and [`view`](Self::view) return: a heartbeat
/// that lists a cache twice keeps the first), and holds at most 10,000
/// nodes, 256 KiB per node and 128 MiB in all, as it accounts bytes (an
/// estimate of its heap, over rather than under). A heartbeat that does
/// not fit is dropped: counted in `heartbeats_dropped`
/// ([`NodeStatus`](crate::status::NodeStatus), `/metrics`), logged at warn at most
/// once per interval, and an acknowledged publish does not call itself
/// complete while the view may be missing a node for it. Taking a
/// heartbeat in costs `O(c log n)` for c caches and n nodes.
#[derive(Clone)]
pub struct Cluster {
    pub(super) inner: Arc<Inner>,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster")
            .field("observer", &self.inner.observer)
            .field("topic", &self.inner.topic)
            .finish_non_exhaustive()
    }
}

/// Builds the heartbeat of the node that owns a view, fresh at each call.
pub(crate) type LocalHeartbeat = Box<dyn Fn() -> Option<Heartbeat> + Send + Sync>;

/// Hands an acknowledgement request this view sends to the node that owns
/// it, which answers its own requests directly: the channel need not echo
/// what a party sends.
pub(crate) type LocalRequest = Box<dyn Fn(Request) + Send + Sync>;

/// A watcher's stop signal, and its tasks: reading the heartbeat channel,
/// and its reply channel.
type WatcherTasks = (watch::Sender<bool>, Vec<JoinHandle<()>>);

pub(crate) struct Inner {
    pub(crate) observer: String,
    pub(crate) topic: String,
    pub(crate) transport: Arc<dyn Transport>,
    /// Signs what this party sends, and verifies what it receives, when
    /// it has a keyring.
    pub(crate) codec: Codec,
    /// The heartbeat interval this party expects of nodes (its own, for a
    /// node): a view younger than 1.5 intervals may not know every node.
    pub(crate) interval: Duration,
    /// Since when the heartbeat channel has been read without a break,
    /// and whether a roll call went out then; `None` while it is not read.
    pub(super) listening: Mutex<Option<(Instant, bool)>>,
    /// The members, their indexes, the nodes gone lately: one lock.
    pub(super) members: Mutex<members::Members>,
    /// Bumped at every heartbeat taken in, so waiters can re-check.
    pub(super) updates: watch::Sender<u64>,
    /// The owning node's own heartbeat, built when asked.
    pub(super) local: Option<LocalHeartbeat>,
    /// The owning node's intake of this view's own acknowledgement requests.
    pub(super) local_request: Option<LocalRequest>,
    /// Names this party in its acknowledgement requests; answers for any
    /// other party are skipped unread (random per view).
    pub(super) asker: u64,
    /// This party's acknowledgement requests waiting for answers.
    pub(super) waiters: ack::Waiters,
    /// This party's key probes waiting for answers.
    pub(super) probes: probe::Probes,
    /// A watcher's task, stopped with the view.
    task: Mutex<Option<WatcherTasks>>,
    /// Whether this party reads its reply channel now (`channel::reply_loop`).
    pub(crate) replies: AtomicBool,
    pub(crate) stats: ClusterStats,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some((stop, _)) = lock(&self.task).take() {
            stop.send_replace(true);
        }
    }
}

/// Counters of the heartbeat channel, for status and metrics.
#[derive(Debug, Default)]
pub(crate) struct ClusterStats {
    pub(crate) received: AtomicU64,
    pub(crate) rejected: AtomicU64,
    /// Heartbeats the view had no room for.
    pub(crate) dropped: AtomicU64,
    pub(crate) sent: AtomicU64,
    pub(crate) send_failures: AtomicU64,
}

/// Configures a [`Cluster`] watcher.
#[must_use = "a builder does nothing until `start` is called"]
pub struct ClusterBuilder {
    transport: Arc<dyn Transport>,
    topic: String,
    observer: String,
    keyring: Option<Keyring>,
    max_bytes: usize,
    interval: Duration,
}

impl fmt::Debug for ClusterBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterBuilder")
            .field("transport", &self.transport.kind())
            .field("topic", &self.topic)
            .field("observer", &self.observer)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl ClusterBuilder {
    /// The topic whose nodes to watch. Default `cache-sync`.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// A name for logs and for the view's `observer`. Default `watcher`.
    pub fn observer(mut self, name: impl Into<String>) -> Self {
        self.observer = name.into();
        self
    }

    /// Takes only heartbeats signed with a key in `keyring`, and signs what
    /// this watcher sends (its requests for heartbeats). Use it when the
    /// nodes verify signatures.
    pub fn verify_signatures(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// The nodes' heartbeat interval (default 2 s). A watcher asks every
    /// node for a heartbeat as it starts; until it has given them 500 ms
    /// to answer (or 1.5 intervals, if sooner), and while it holds fewer
    /// nodes than one of them counts, it may not know every node (see
    /// [`Cluster::unsettled`]), and an acknowledged publish waits for that
    /// before it calls itself complete.
    pub fn heartbeat_interval(mut self, every: Duration) -> Self {
        self.interval = every;
        self
    }

    /// Subscribes to the heartbeat channel and starts taking heartbeats in.
    /// Fails with [`Error::Unsupported`](crate::Error::Unsupported) on a transport without heartbeats.
    pub async fn start(self) -> Result<Cluster> {
        check_duration(
            "heartbeat_interval",
            self.interval,
            MIN_HEARTBEAT_INTERVAL,
            crate::util::MAX_TIMEOUT,
        )?;
        self.transport.check_topic(&self.topic)?;
        let subscription = self.transport.subscribe_heartbeats(&self.topic).await?;
        let topic = self.topic.clone();
        let cluster = Cluster::new(
            self.observer,
            self.topic,
            self.transport,
            Codec::new(self.max_bytes, self.keyring),
            self.interval,
            None,
            None,
        );
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(watch_loop(
            Arc::downgrade(&cluster.inner),
            subscription,
            stopped.clone(),
        ));
        let replies = cluster.read_replies(stopped);
        *lock(&cluster.inner.task) = Some((stop, vec![task, replies]));
        // Ask every node for a heartbeat now, rather than wait an interval.
        let sent = cluster
            .send(&Message::Request(Request::roll_call(&topic)))
            .await;
        cluster.listening(sent);
        Ok(cluster)
    }
}

impl Cluster {
    /// Configures a watcher on `transport`: a party that reads the nodes'
    /// heartbeats without being a node (a CLI, an admin service).
    pub fn builder(transport: impl Transport) -> ClusterBuilder {
        ClusterBuilder {
            transport: Arc::new(transport),
            topic: DEFAULT_TOPIC.into(),
            observer: "watcher".into(),
            keyring: None,
            max_bytes: DEFAULT_MAX_EVENT_BYTES,
            interval: DEFAULT_HEARTBEAT_INTERVAL,
        }
    }

    /// Watches the default topic's nodes with default settings.
    pub async fn watch(transport: impl Transport) -> Result<Cluster> {
        Self::builder(transport).start().await
    }

    pub(crate) fn new(
        observer: String,
        topic: String,
        transport: Arc<dyn Transport>,
        codec: Codec,
        interval: Duration,
        local: Option<LocalHeartbeat>,
        local_request: Option<LocalRequest>,
    ) -> Self {
        // Never 0, which requests from older parties carry.
        let asker = crate::util::random_u64() | 1;
        Cluster {
            inner: Arc::new(Inner {
                observer,
                topic,
                transport,
                codec,
                interval,
                listening: Mutex::new(None),
                members: Mutex::default(),
                updates: watch::Sender::new(0),
                local,
                local_request,
                asker,
                waiters: ack::Waiters::default(),
                probes: probe::Probes::default(),
                task: Mutex::new(None),
                replies: AtomicBool::new(false),
                stats: ClusterStats::default(),
            }),
        }
    }

    /// The heartbeat channel's counters.
    pub(crate) fn stats(&self) -> &ClusterStats {
        &self.inner.stats
    }

    /// The topic whose nodes this view shows.
    pub fn topic(&self) -> &str {
        &self.inner.topic
    }

    /// Stops a watcher's task (a node's view stops with the node).
    pub async fn shutdown(&self) {
        let task = lock(&self.inner.task).take();
        if let Some((stop, tasks)) = task {
            stop.send_replace(true);
            for task in tasks {
                let _ = task.await;
            }
        }
    }
}
