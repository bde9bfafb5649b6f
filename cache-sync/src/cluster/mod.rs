//! The cluster view: every node's last heartbeat, as any party on the bus
//! sees it (a node, or a [`Cluster`] watcher that is not a node), and what
//! follows from them: who is live, who lags, who applied a publish.
//!
//! Nodes publish heartbeats on their transport's heartbeat channel (see
//! [`Transport::publish_heartbeat`]), a resource apart from the change
//! history. Nothing has to be configured: whoever shares the bus sees the
//! nodes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::status::AppliedEvent;
use crate::transport::{DEFAULT_TOPIC, Position, Transport};
use crate::util::{HashMap, check_duration, lock, now_us};
use crate::wire::{Codec, DEFAULT_MAX_EVENT_BYTES, Keyring};

mod ack;
mod message;
mod view;

pub use ack::{Acks, NodeAck};
pub(crate) use ack::{Goal, wait};
pub(crate) use message::{Message, Request, Target};
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) use message::{open as open_message, seal as seal_message};
pub use view::{CacheSummary, ClusterView, GoneNode, NodeCacheView, NodeView};

/// How often a node sends its heartbeat unless told otherwise.
pub(crate) const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// The shortest heartbeat interval: more often would cost the bus more
/// than it tells anyone.
pub(crate) const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(10);
/// A node that sent nothing for this many of its own intervals is gone.
pub(crate) const MISSED_INTERVALS: u32 = 3;
/// How long a watcher gives the nodes to answer the roll call it sends as
/// it starts before it trusts its view to hold every live node (unless 1.5
/// heartbeat intervals are sooner): a node answers at once, so this covers
/// the transport's round trip with room to spare.
const ROLL_CALL_GRACE: Duration = Duration::from_millis(500);
/// How long a gone node is still listed as gone (not as live).
const GONE_KEPT: Duration = Duration::from_secs(300);
/// Bounds the members a view keeps, against a flood of made-up node ids
/// on a bus whose heartbeats are not signed.
const MAX_MEMBERS: usize = 10_000;

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
    /// node's clock.
    #[serde(default)]
    pub version_at_us: Option<u64>,
    /// Entries held (approximate).
    pub entries: u64,
    /// Times the cache was invalidated because a change may have been missed.
    pub loss_resyncs: u64,
    /// Whether versioned refreshes are applied as invalidations for now.
    pub quarantined: bool,
    /// Publish-to-applied time of the last event, in microseconds.
    #[serde(default)]
    pub last_latency_us: Option<u64>,
    /// The last event applied from each recent publisher, newest first.
    #[serde(default)]
    pub recent: Vec<AppliedEvent>,
}

/// The cluster as one party on the bus sees it: every node's last
/// heartbeat. A node has one ([`Node::cluster`](crate::Node::cluster));
/// anyone else can watch with [`Cluster::watch`].
///
/// Cheap to clone; clones share the view. A watcher stops when
/// [`shutdown`](Self::shutdown) is called or its last clone is dropped.
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
    members: Mutex<HashMap<String, Member>>,
    /// Per (node, cache): when this view first saw it behind, for
    /// `NodeCacheView::behind_ms`.
    behind: Mutex<HashMap<(String, String), u64>>,
    gone: Mutex<HashMap<String, u64>>,
    /// Bumped at every heartbeat taken in, so waiters can re-check.
    updates: watch::Sender<u64>,
    /// The owning node's own heartbeat, built when asked.
    local: Option<LocalHeartbeat>,
    /// A watcher's task, stopped with the view.
    task: Mutex<Option<(watch::Sender<bool>, JoinHandle<()>)>>,
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
    pub(crate) sent: AtomicU64,
    pub(crate) send_failures: AtomicU64,
}

struct Member {
    heartbeat: Heartbeat,
    seen: Instant,
    seen_at_us: u64,
}

impl Member {
    /// Gone after three of its own intervals without a heartbeat.
    fn live(&self, now: Instant) -> bool {
        // The sender's own interval, within the range a node can be given:
        // a forged `u64::MAX` must not make an entry immortal.
        let interval =
            Duration::from_millis(self.heartbeat.interval_ms.max(1)).min(crate::util::MAX_TIMEOUT);
        now.saturating_duration_since(self.seen) <= interval.saturating_mul(MISSED_INTERVALS)
    }
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
        );
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(watch_loop(
            Arc::downgrade(&cluster.inner),
            subscription,
            stopped,
        ));
        *lock(&cluster.inner.task) = Some((stop, task));
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
    ) -> Self {
        Cluster {
            inner: Arc::new(Inner {
                observer,
                topic,
                transport,
                codec,
                interval,
                listening: Mutex::new(None),
                members: Mutex::default(),
                behind: Mutex::default(),
                gone: Mutex::default(),
                updates: watch::Sender::new(0),
                local,
                task: Mutex::new(None),
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
    pub fn nodes(&self) -> Vec<Heartbeat> {
        let mut nodes: Vec<Heartbeat> = self
            .members_now()
            .into_iter()
            .map(|(heartbeat, _, _)| heartbeat)
            .collect();
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        nodes
    }

    /// The view: every live node with its caches' lag behind the newest
    /// version any node reports, the nodes gone lately, and per cache the
    /// newest version and who is behind it.
    pub fn view(&self) -> ClusterView {
        // Members first: it moves those that just expired to `gone`.
        let members = self.members_now();
        let gone = lock(&self.inner.gone)
            .iter()
            .map(|(id, at)| (id.clone(), *at))
            .collect();
        let mut behind = lock(&self.inner.behind);
        view::build(
            &self.inner.observer,
            &self.inner.topic,
            members,
            gone,
            &mut behind,
        )
    }

    /// Live members, each with when it was seen (µs since the epoch, and
    /// how long ago); moves those gone for three intervals to `gone`.
    fn members_now(&self) -> Vec<(Heartbeat, u64, Duration)> {
        let now = Instant::now();
        let now_us = now_us();
        let own = self.inner.local.as_ref().and_then(|f| f());
        let mut out = Vec::new();
        {
            let mut members = lock(&self.inner.members);
            let mut gone = lock(&self.inner.gone);
            members.retain(|id, m| {
                if m.live(now) {
                    return true;
                }
                tracing::info!(observer = %self.inner.observer, node = %id,
                    "node gone: no heartbeat for three of its intervals");
                gone.insert(id.clone(), m.seen_at_us);
                false
            });
            let keep_us = u64::try_from(GONE_KEPT.as_micros()).unwrap_or(u64::MAX);
            gone.retain(|id, at| {
                now_us.saturating_sub(*at) <= keep_us && !members.contains_key(id)
            });
            for m in members.values() {
                if own
                    .as_ref()
                    .is_some_and(|o| o.node_id == m.heartbeat.node_id)
                {
                    continue;
                }
                out.push((
                    m.heartbeat.clone(),
                    m.seen_at_us,
                    now.saturating_duration_since(m.seen),
                ));
            }
        }
        if let Some(own) = own {
            out.push((own, now_us, Duration::ZERO));
        }
        out
    }

    /// Takes a heartbeat in. The newest per node wins: one that was sent
    /// before the node's last (a redelivery, a reordering) is dropped.
    pub(crate) fn observe(&self, heartbeat: Heartbeat) {
        {
            let mut members = lock(&self.inner.members);
            // The newest per node wins, by its own clock; but an entry that
            // has expired here is replaced whatever its stamps say, so a
            // heartbeat stamped far in the future cannot shadow the node.
            if let Some(m) = members.get(&heartbeat.node_id)
                && m.live(Instant::now())
                && (m.heartbeat.started_at_us, m.heartbeat.sent_at_us)
                    > (heartbeat.started_at_us, heartbeat.sent_at_us)
            {
                return;
            }
            if members.len() >= MAX_MEMBERS && !members.contains_key(&heartbeat.node_id) {
                tracing::warn!(observer = %self.inner.observer, node = %heartbeat.node_id,
                    "cluster view full; heartbeat of a new node dropped");
                return;
            }
            members.insert(
                heartbeat.node_id.clone(),
                Member {
                    heartbeat,
                    seen: Instant::now(),
                    seen_at_us: now_us(),
                },
            );
            let own = self.inner.local.as_ref().and_then(|f| f());
            let all = members
                .values()
                .map(|m| &m.heartbeat)
                .filter(|h| own.as_ref().is_none_or(|o| o.node_id != h.node_id))
                .chain(own.as_ref());
            view::track_behind(all, &mut lock(&self.inner.behind), now_us());
        }
        self.inner.updates.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Reads one message off the heartbeat channel: a heartbeat is taken
    /// in, a request is handed back. Refused ones (unsigned or forged on a
    /// verifying party, oversized, unreadable) are counted and dropped.
    pub(crate) fn receive(&self, payload: &Bytes) -> Option<Request> {
        let stats = &self.inner.stats;
        stats.received.fetch_add(1, Relaxed);
        match message::open(&self.inner.codec, payload) {
            // Another topic's, replayed here (one keyring may sign several
            // topics): not this cluster's.
            Ok(Message::Heartbeat(h)) if h.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Message::Request(r)) if r.topic != self.inner.topic => {
                stats.rejected.fetch_add(1, Relaxed);
                None
            }
            Ok(Message::Heartbeat(h)) => {
                self.observe(h);
                None
            }
            Ok(Message::Request(r)) => Some(r),
            Err(e) => {
                stats.rejected.fetch_add(1, Relaxed);
                tracing::debug!(observer = %self.inner.observer, error = %e,
                    "heartbeat channel: message refused");
                None
            }
        }
    }

    /// Publishes a message on the heartbeat channel; a failure is counted
    /// and logged, never returned: heartbeats are best effort.
    pub(crate) async fn send(&self, message: &Message) -> bool {
        let stats = &self.inner.stats;
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
        if let Some((stop, task)) = task {
            stop.send_replace(true);
            let _ = task.await;
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
    let mut backoff = Duration::ZERO;
    loop {
        let Some(inner) = cluster.upgrade() else {
            return;
        };
        let view = Cluster { inner };
        let Some(s) = sub.as_mut() else {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(backoff) => {}
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
                    backoff = Duration::ZERO;
                    let roll_call = Message::Request(Request::roll_call(&view.inner.topic));
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => return,
                        sent = view.send(&roll_call) => view.listening(sent),
                    }
                }
                Err(e) => {
                    backoff = next_backoff(backoff);
                    tracing::warn!(observer = %view.inner.observer, error = %e, retry_in = ?backoff,
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
                backoff = next_backoff(backoff);
                tracing::warn!(observer = %view.inner.observer, error = %e, retry_in = ?backoff,
                    "heartbeat channel: subscription failed; subscribing again");
                sub = None;
            }
        }
    }
}

/// 100 ms, doubling up to 5 s.
pub(crate) fn next_backoff(backoff: Duration) -> Duration {
    backoff
        .saturating_mul(2)
        .clamp(Duration::from_millis(100), Duration::from_secs(5))
}

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
