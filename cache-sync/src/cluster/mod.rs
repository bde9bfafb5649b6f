//! The cluster view: every node's last heartbeat, as any party on the topic
//! sees it (a node, or a [`Cluster`] watcher that is not a node), and what
//! follows from them: who is live, who lags, who applied a publish.
//!
//! Nodes publish heartbeats on their transport's heartbeat channel (see
//! [`Transport::publish_heartbeat`]), a resource apart from the change
//! history. Nothing has to be configured: whoever shares the topic sees the
//! nodes.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::transport::{DEFAULT_TOPIC, Position, Transport};
use crate::util::{Backoff, check_duration, lock, now_us};
use crate::wire::{Codec, DEFAULT_MAX_EVENT_BYTES, Keyring};
use message::Opened;

mod ack;
mod members;
mod message;
#[cfg(test)]
mod tests;
mod view;

pub use ack::{Acks, Incomplete, NodeAck};
pub(crate) use ack::{Goal, wait};
pub(crate) use message::{Ack, Message, Progress, Request, Target};
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) use message::{
    Opened as OpenedMessage, open as open_message, seal as seal_message,
    seal_ack as seal_ack_message,
};
pub use view::{CacheSummary, ClusterView, GoneNode, NodeCacheView, NodeView};

/// How often a node sends its heartbeat unless told otherwise.
pub(crate) const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// The shortest heartbeat interval: more often would cost the transport more
/// than it tells anyone.
pub(crate) const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(10);
/// A node that sent nothing for this many of its own intervals is gone.
pub(crate) const MISSED_INTERVALS: u32 = 3;
/// How long a watcher gives the nodes to answer the roll call it sends as
/// it starts before it trusts its view to hold every live node (unless 1.5
/// heartbeat intervals are sooner): a node answers at once, so this covers
/// the transport's round trip with room to spare.
const ROLL_CALL_GRACE: Duration = Duration::from_millis(500);
/// Nodes gone at once that get a log line each; the rest one line in all.
const GONE_LOGGED: usize = 10;
/// How long a gone node is still listed as gone (not as live).
const GONE_KEPT: Duration = Duration::from_secs(300);
/// Bounds the members a view keeps, against a flood of made-up node ids
/// on a topic whose heartbeats are not signed (and the nodes gone lately
/// listed, likewise).
const MAX_MEMBERS: usize = 10_000;
/// Bounds what one member's summary may take, in bytes as the view
/// accounts them (its cache names counted in full): room for a node of
/// about 1,300 caches. A heartbeat
/// may be 1 MiB of JSON; kept whole, it would take about 2 MB.
const MAX_MEMBER_BYTES: usize = 256 << 10;
/// Bounds what the whole view takes, in bytes as accounted: members,
/// cache names with their indexes, nodes gone lately (given up first).
/// Room for the 10,000 members of the cap at 13 KiB each: a node of one
/// cache is accounted about 0.7 KiB, of 10 caches 2.2 KiB, of 100 caches
/// 18 KiB (`benches/cluster_view.rs` measured 0.6, 1.8 and 14 KiB).
const MAX_TOTAL_BYTES: usize = 128 << 20;
/// The longest a heartbeat's `version_age_ms` is believed: it comes off
/// the wire. Besides, never longer than the sender's own uptime.
const MAX_VERSION_AGE: Duration = Duration::from_secs(24 * 3600);

/// One node's heartbeat: who it is, how far it got, and what its caches
/// hold. No key or value appears in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Heartbeat {
    /// The node's id.
    pub node_id: String,
    /// The topic it consumes: signed with the rest, so a heartbeat replayed
    /// into another topic's channel is refused there.
    #[serde(default)]
    pub topic: String,
    /// Microseconds since the Unix epoch when the node started.
    pub started_at_us: u64,
    /// Microseconds since the Unix epoch when this heartbeat was sent, on
    /// the node's clock.
    pub sent_at_us: u64,
    /// The node's heartbeat interval, in milliseconds: it counts as gone
    /// after three of them without a heartbeat.
    pub interval_ms: u64,
    /// The transport's kind.
    pub transport: String,
    /// Whether the consumer is running and its transport healthy.
    pub consuming: bool,
    /// Whether the node is ready to serve: see [`Node::is_ready`](crate::Node::is_ready).
    pub ready: bool,
    /// The node's position: every event before it has been applied.
    pub position: Position,
    /// Losses the node answered by a resync.
    pub losses: u64,
    /// Each cache the node holds, by name.
    #[serde(default)]
    pub caches: Vec<CacheHeartbeat>,
}

/// One cache in a [`Heartbeat`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CacheHeartbeat {
    /// The cache name.
    pub name: String,
    /// The highest entry version the node took in for it (see
    /// [`CacheStatus::version`](crate::CacheStatus::version)).
    pub version: Option<u64>,
    /// Microseconds since the Unix epoch when `version` last rose, on the
    /// node's clock. For display: another machine's clock may be off, so
    /// no party compares it with its own.
    #[serde(default)]
    pub version_at_us: Option<u64>,
    /// How long ago `version` last rose, in milliseconds, on the node's own
    /// clock: a duration, so it means the same to a party whose clock is
    /// off. Whoever receives it learns that the version has been known for
    /// at least that long (believed up to the node's own uptime, and a
    /// day), which times another node's lag even for a party that just
    /// started. Absent from older nodes.
    #[serde(default)]
    pub version_age_ms: Option<u64>,
    /// Entries held (approximate).
    pub entries: u64,
    /// Times the cache was invalidated because a change may have been missed.
    pub loss_resyncs: u64,
    /// Whether versioned refreshes are applied as invalidations for now.
    pub quarantined: bool,
    /// Publish-to-applied time of the last event, in microseconds.
    #[serde(default)]
    pub last_latency_us: Option<u64>,
}

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
/// ([`NodeStatus`](crate::NodeStatus), `/metrics`), logged at warn at most
/// once per interval, and an acknowledged publish does not call itself
/// complete while the view may be missing a node for it. Taking a
/// heartbeat in costs `O(c log n)` for c caches and n nodes.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
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
    listening: Mutex<Option<(Instant, bool)>>,
    /// The members, their indexes, the nodes gone lately: one lock.
    members: Mutex<members::Members>,
    /// Bumped at every heartbeat taken in, so waiters can re-check.
    updates: watch::Sender<u64>,
    /// The owning node's own heartbeat, built when asked.
    local: Option<LocalHeartbeat>,
    /// The owning node's intake of this view's own acknowledgement requests.
    local_request: Option<LocalRequest>,
    /// Names this party in its acknowledgement requests; answers for any
    /// other party are skipped unread (random per view).
    asker: u64,
    /// This party's acknowledgement requests waiting for answers.
    waiters: ack::Waiters,
    /// A watcher's task, stopped with the view.
    task: Mutex<Option<WatcherTasks>>,
    /// Whether this party reads its reply channel now (`ack::reply_loop`).
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
    /// to answer (or 1.5 intervals, if sooner) it may not know every node,
    /// and an acknowledged publish waits for that before it calls itself
    /// complete.
    pub fn heartbeat_interval(mut self, every: Duration) -> Self {
        self.interval = every;
        self
    }

    /// Subscribes to the heartbeat channel and starts taking heartbeats in.
    /// Fails with [`Error::Unsupported`] on a transport without heartbeats.
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
        let replies = tokio::spawn(ack::reply_loop(Arc::downgrade(&cluster.inner), stopped));
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
        use std::hash::{BuildHasher, RandomState};
        // Never 0, which requests from older parties carry.
        let asker = RandomState::new().hash_one(&observer) | 1;
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

    /// Every live node's last heartbeat, by node id. The node that owns
    /// this view (if any) is always in it, with its heartbeat as of now.
    /// Others' are as the view keeps them: a cache listed twice appears
    /// once (the first), and `version_age_ms` is not kept.
    pub fn nodes(&self) -> Vec<Heartbeat> {
        let own = self.own();
        let mut nodes: Vec<Heartbeat> = {
            let members = self.members(Instant::now());
            let own_id = own.as_ref().map(|o| o.node_id.as_str());
            members
                .iter()
                .filter(|m| Some(m.id.as_ref()) != own_id)
                .map(|m| m.to_heartbeat(&self.inner.topic))
                .collect()
        };
        nodes.extend(own);
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        nodes
    }

    /// The view: every live node with its caches' lag behind the newest
    /// version any node reports, the nodes gone lately, and per cache the
    /// newest version and who is behind it.
    pub fn view(&self) -> ClusterView {
        let own = self.own();
        let now = Instant::now();
        let at_us = now_us();
        let mut members = self.members(now);
        let own = own.map(|h| {
            members.learn(&h, now);
            members::Member::detached(h, now, at_us)
        });
        view::build(
            &self.inner.observer,
            &self.inner.topic,
            &members,
            own.as_ref(),
            now,
            at_us,
        )
    }

    /// The owning node's heartbeat, fresh (built before the members are
    /// locked: it reads the node's caches).
    fn own(&self) -> Option<Heartbeat> {
        self.inner.local.as_ref().and_then(|f| f())
    }

    /// The members, those expired moved to the nodes gone.
    fn members(&self, now: Instant) -> std::sync::MutexGuard<'_, members::Members> {
        let mut members = lock(&self.inner.members);
        let went = members.expire(now);
        // A line per node, but not 10,000 of them when a flood of made-up
        // ids (unsigned heartbeats) expires at once.
        for id in went.iter().take(GONE_LOGGED) {
            tracing::info!(observer = %self.inner.observer, node = %id,
                "node gone: no heartbeat for three of its intervals");
        }
        if let Some(more) = went.len().checked_sub(GONE_LOGGED).filter(|&n| n > 0) {
            tracing::info!(observer = %self.inner.observer, more,
                "more nodes gone at once: no heartbeat for three of their intervals");
        }
        members
    }

    /// Takes a heartbeat in. The newest per node wins: one that was sent
    /// before the node's last (a redelivery, a reordering) is dropped, and
    /// so is one the view has no room for (counted, and logged at most
    /// once per interval). The owning node's echo is kept like any
    /// other, for how long its versions have been known (its entry is
    /// built fresh when asked), but takes no room under the member cap.
    pub(crate) fn observe(&self, heartbeat: Heartbeat) {
        let now = Instant::now();
        let interval_ms = heartbeat.interval_ms;
        let stored = {
            let mut members = self.members(now);
            match members.observe(heartbeat, now, now_us(), self.owner()) {
                members::Intake::Stored => true,
                members::Intake::Stale => false,
                members::Intake::Dropped(why, node) => {
                    self.inner.stats.dropped.fetch_add(1, Relaxed);
                    // At most one line per interval (and per second), for
                    // however many are dropped meanwhile.
                    let every = self.inner.interval.max(Duration::from_secs(1));
                    if let Some(dropped) = members.note_drop(now, interval_ms, every) {
                        tracing::warn!(observer = %self.inner.observer, node = %node,
                            reason = why.reason(), dropped, members = members.len(),
                            bytes = members.bytes(),
                            "cluster view: heartbeats dropped for lack of room (an acknowledged publish may miss their nodes)");
                    }
                    false
                }
            }
        };
        if stored {
            self.inner.updates.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Whether the view may be missing a live node for lack of room: it is
    /// at its member cap, has less room left than one node may take, or
    /// dropped a heartbeat for lack of room within the last three
    /// intervals of that heartbeat's sender (clamped as liveness is). An
    /// acknowledged publish is not complete while this holds.
    pub(crate) fn overflowing(&self) -> bool {
        let now = Instant::now();
        self.members(now).overflowing(now, self.owner())
    }

    /// The owning node's id, if a node owns this view: its observer.
    fn owner(&self) -> Option<&str> {
        self.inner
            .local
            .as_ref()
            .map(|_| self.inner.observer.as_str())
    }

    /// The live nodes whose last heartbeat lists `cache`, by id, this
    /// party's own node included if it holds it; from the cache's index,
    /// `O(h log h)` for h holders.
    pub(crate) fn holders(&self, cache: &str) -> Vec<String> {
        let own = self.own();
        let own_id = own.as_ref().map(|o| o.node_id.as_str());
        let mut ids: Vec<String> = self
            .members(Instant::now())
            .index(cache)
            .map(|i| {
                i.holders()
                    .filter(|id| Some(id.as_ref()) != own_id)
                    .map(|id| id.to_string())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(o) = own
            && o.caches.iter().any(|c| c.name == cache)
        {
            ids.push(o.node_id);
        }
        ids.sort();
        ids
    }

    /// Reads one message off the heartbeat channel: a heartbeat is taken
    /// in, an answer to one of this party's acknowledgement requests too, a
    /// request is handed back. Answers for other parties are skipped on
    /// their first bytes, unread. Refused ones (unsigned or forged on a
    /// verifying party, oversized, unreadable) are counted and dropped.
    pub(crate) fn receive(&self, payload: &Bytes) -> Option<Request> {
        let stats = &self.inner.stats;
        stats.received.fetch_add(1, Relaxed);
        if Codec::ack_for(payload).is_some_and(|asker| asker != self.inner.asker) {
            // Not ours: nothing to verify or parse, and nothing changes.
            return None;
        }
        match message::open(&self.inner.codec, payload) {
            // Another topic's, replayed here (one keyring may sign several
            // topics): not this cluster's.
            Ok(Opened::Message(Message::Heartbeat(h))) if h.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Message(Message::Request(r))) if r.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Ack { ack, .. }) if ack.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Opened::Message(Message::Heartbeat(h))) => {
                self.observe(h);
                None
            }
            Ok(Opened::Message(Message::Request(r))) => Some(r),
            Ok(Opened::Ack { ack, .. }) => {
                self.answered(&ack);
                None
            }
            Err(e) => {
                stats.rejected.fetch_add(1, Relaxed);
                tracing::debug!(observer = %self.inner.observer, error = %e,
                    "heartbeat channel: message refused");
                None
            }
        }
    }

    /// Names this party in its acknowledgement requests.
    pub(crate) fn asker(&self) -> u64 {
        self.inner.asker
    }

    /// Whether this party reads its reply channel now.
    pub(crate) fn reads_replies(&self) -> bool {
        self.inner.replies.load(Relaxed)
    }

    /// Starts reading this party's reply channel, until `stop` (a node's
    /// view; a watcher starts its own).
    pub(crate) fn read_replies(&self, stop: watch::Receiver<bool>) -> JoinHandle<()> {
        tokio::spawn(ack::reply_loop(Arc::downgrade(&self.inner), stop))
    }

    pub(crate) fn waiters(&self) -> &ack::Waiters {
        &self.inner.waiters
    }

    /// Takes in a node's answer to this party's acknowledgement requests,
    /// waking the waits.
    pub(crate) fn answered(&self, ack: &Ack) {
        if self.inner.waiters.answered(ack) {
            self.inner.updates.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Publishes an answer for the party `asker`, on its reply channel if
    /// it reads one (`reply`), else on the heartbeat channel; best effort,
    /// as `send`.
    pub(crate) async fn send_ack(&self, asker: u64, reply: bool, ack: &Ack) {
        let stats = &self.inner.stats;
        let transport = &self.inner.transport;
        let topic = &self.inner.topic;
        let sent = match message::seal_ack(&self.inner.codec, asker, ack) {
            Ok(payload) => {
                let payload = Bytes::from(payload);
                if reply {
                    match transport.publish_reply(topic, asker, payload.clone()).await {
                        // A transport of another kind than the asker's
                        // says it has none: the shared channel, then.
                        Err(e) if e.is_unsupported() => {
                            transport.publish_heartbeat(topic, payload).await
                        }
                        other => other,
                    }
                } else {
                    transport.publish_heartbeat(topic, payload).await
                }
            }
            Err(e) => Err(e),
        };
        match sent {
            Ok(()) => {
                stats.sent.fetch_add(1, Relaxed);
            }
            Err(e) => {
                stats.send_failures.fetch_add(1, Relaxed);
                tracing::debug!(observer = %self.inner.observer, error = %e,
                    "heartbeat channel: could not send an acknowledgement");
            }
        }
    }

    /// Publishes a message on the heartbeat channel; a failure is counted
    /// and logged, never returned: heartbeats are best effort.
    pub(crate) async fn send(&self, message: &Message) -> bool {
        let stats = &self.inner.stats;
        // The owning node answers its own view's requests directly.
        if let (Message::Request(r), Some(local)) = (message, &self.inner.local_request)
            && r.target.is_some()
        {
            local(r.clone());
        }
        let sent = match message::seal(&self.inner.codec, message) {
            Ok(payload) => self
                .inner
                .transport
                .publish_heartbeat(&self.inner.topic, Bytes::from(payload))
                .await
                .map_err(|e| (e, "publish")),
            Err(e) => Err((e, "encode")),
        };
        match sent {
            Ok(()) => {
                stats.sent.fetch_add(1, Relaxed);
                true
            }
            Err((e, what)) => {
                stats.send_failures.fetch_add(1, Relaxed);
                // A message too large to send will never go out: that is
                // a setting to fix, not a passing failure.
                if e.is_too_large() {
                    tracing::warn!(observer = %self.inner.observer, error = %e,
                        "heartbeat channel: message too large to send");
                } else {
                    tracing::debug!(observer = %self.inner.observer, error = %e, what,
                        "heartbeat channel: could not send");
                }
                false
            }
        }
    }

    /// A receiver that changes at every heartbeat taken in.
    pub(crate) fn updates(&self) -> watch::Receiver<u64> {
        self.inner.updates.subscribe()
    }

    /// The heartbeat interval this party expects of nodes.
    pub(crate) fn interval(&self) -> Duration {
        self.inner.interval
    }

    /// The heartbeat channel is read from now on; `roll_call` says whether
    /// a roll call went out with it.
    pub(crate) fn listening(&self, roll_call: bool) {
        *lock(&self.inner.listening) = Some((Instant::now(), roll_call));
    }

    /// The heartbeat channel is not read (its subscription broke).
    pub(crate) fn deaf(&self) {
        *lock(&self.inner.listening) = None;
    }

    /// When the view can be trusted to hold every live node: it has read
    /// the channel without a break for 1.5 heartbeat intervals, or, after a
    /// roll call went out (every node answers one at once), for
    /// `ROLL_CALL_GRACE` if that is sooner. `None` while the channel is
    /// not read: the view may miss anyone then.
    pub(crate) fn settled_at(&self) -> Option<Instant> {
        let (since, roll_call) = (*lock(&self.inner.listening))?;
        let half = self.inner.interval.checked_div(2).unwrap_or(Duration::ZERO);
        let mut wait = self.inner.interval.saturating_add(half);
        if roll_call {
            wait = wait.min(ROLL_CALL_GRACE);
        }
        Some(since.checked_add(wait).unwrap_or(since))
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

/// A watcher's task: takes heartbeats in, and subscribes again after errors.
async fn watch_loop(
    cluster: std::sync::Weak<Inner>,
    subscription: Box<dyn crate::transport::HeartbeatSubscription>,
    mut stop: watch::Receiver<bool>,
) {
    let mut sub = Some(subscription);
    let mut backoff = Backoff::new(CHANNEL_BACKOFF_MIN, CHANNEL_BACKOFF_MAX);
    loop {
        let Some(inner) = cluster.upgrade() else {
            return;
        };
        let view = Cluster { inner };
        let Some(s) = sub.as_mut() else {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(backoff.wait()) => {}
            }
            // A broker that is down can take its timeout to answer: the
            // stop must not wait for that.
            let subscribed = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                subscribed = view.inner.transport.subscribe_heartbeats(&view.inner.topic) => subscribed,
            };
            match subscribed {
                Ok(s) => {
                    sub = Some(s);
                    backoff.reset();
                    let roll_call = Message::Request(Request::roll_call(&view.inner.topic));
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => return,
                        sent = view.send(&roll_call) => view.listening(sent),
                    }
                }
                Err(e) => {
                    backoff.fail();
                    tracing::warn!(observer = %view.inner.observer, error = %e, retry_in = ?backoff.wait(),
                        "heartbeat channel: subscribe failed");
                }
            }
            continue;
        };
        // The view is not held while waiting, so dropping the last clone
        // stops the task.
        drop(view);
        let next = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            next = s.next() => next,
        };
        let Some(inner) = cluster.upgrade() else {
            return;
        };
        let view = Cluster { inner };
        match next {
            Ok(payload) => {
                let _ = view.receive(&payload);
            }
            Err(e) => {
                view.deaf();
                backoff.fail();
                tracing::warn!(observer = %view.inner.observer, error = %e, retry_in = ?backoff.wait(),
                    "heartbeat channel: subscription failed; subscribing again");
                sub = None;
            }
        }
    }
}

/// Retries of the heartbeat and reply channels' subscriptions and sends:
/// 100 ms, doubling up to 5 s.
pub(crate) const CHANNEL_BACKOFF_MIN: Duration = Duration::from_millis(100);
pub(crate) const CHANNEL_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Checks a heartbeat interval setting: 10 ms to 1 h, or `Duration::MAX`
/// for none.
pub(crate) fn check_interval(setting: &str, every: Duration) -> Result<()> {
    if every == Duration::MAX {
        return Ok(());
    }
    check_duration(
        setting,
        every,
        MIN_HEARTBEAT_INTERVAL,
        crate::util::MAX_TIMEOUT,
    )
    .map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("{m} (or Duration::MAX for none)")),
        other => other,
    })
}
