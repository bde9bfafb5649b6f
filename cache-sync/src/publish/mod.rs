//! The publisher: how admin services tell every node what changed.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use crate::cluster::{Acks, Cluster, Goal, Target};
use crate::error::Result;
use crate::table::Table;
use crate::transport::{DEFAULT_TOPIC, Position, Transport};
use crate::util::{MAX_TIMEOUT, check_duration, deadline_after, lock, now_us};
use crate::wire::{
    Change, Codec, DEFAULT_MAX_EVENT_BYTES, Fence, Header, HeaderExt, Keyring, Origin,
    check_max_event_bytes,
};

/// Publishes change events for named caches.
///
/// Each call is one batch; a batch larger than the event size limit is split
/// into several events, in order. Events to one cache from one publisher are
/// numbered 1, 2, 3, … so nodes can detect a missing one. Publishing to one
/// cache is serialised, so the numbers reach the transport in order.
///
/// A failed publish returns an error and still uses up its sequence number:
/// if the event did reach some nodes, the next one must not reuse the number,
/// and if it did not, nodes see a gap and invalidate, which is safe.
///
/// Every [`announce_interval`](PublisherBuilder::announce_interval) (1 s
/// by default) it also announces, per cache it has published to lately, the
/// last number it used, so that a node that missed the last events before a
/// quiet period notices (see the crate docs, "What happens on loss"). After
/// a publish, a cache is announced at each interval until it has been
/// announced three times at an unchanged number, then no more until it is
/// published to again: one announcement after the last event is what a node
/// needs, the repeats cover lost announcements, and an idle publisher sends
/// nothing. Announcements run in a task spawned on the tokio runtime of a
/// publish (again by a later publish, should that runtime shut down). The
/// task holds the publisher's state, so a publisher dropped right after a
/// publish (one per request, or a command-line tool that publishes once)
/// still announces: the first announcement goes out within one interval
/// of the last publish, and the task ends, letting the state go, once
/// every cache has been announced three times unchanged (some four
/// intervals after the last publish). A later publish starts it again.
/// The promise therefore holds as long as the process and that tokio
/// runtime keep running for one announce interval after the last publish
/// (three, for the repeats that cover a lost announcement).
///
/// Cheap to clone; clones share the sequence numbers.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<PublisherInner>,
}

struct PublisherInner {
    transport: Arc<dyn Transport>,
    topic: String,
    origin: String,
    id: u64,
    codec: Codec,
    seqs: Mutex<HashMap<String, Arc<tokio::sync::Mutex<SeqState>>>>,
    /// `Duration::MAX`: no announcements.
    announce_interval: Duration,
    /// Whether an announcing task is running (or spawned, not yet run).
    announcing: AtomicBool,
    /// Per cache: the number last announced and how often it was sent.
    /// Kept here, not in the task, so that a task started again by a later
    /// publish does not announce long-quiet caches once more.
    announced: Mutex<HashMap<String, (u64, u8)>>,
    /// The second sends of `again_after` not yet due, in due order (the
    /// delay is the same for all), and whether a task is sending them.
    again: Mutex<AgainQueue>,
    /// Each change is sent a second time, as an invalidation, this much later.
    again_after: Option<Duration>,
}

/// A cache's numbering at this publisher, behind the cache's publish lock.
#[derive(Debug, Default)]
struct SeqState {
    /// The last number used; 0 before the first event.
    seq: u64,
    /// When the event numbered `seq` was handed to the transport, on this
    /// process's monotonic clock: every later message for the cache says
    /// how long ago that was (`HeaderExt::since_prev_us`), so a node that
    /// never heard of this publisher can tell a lost event from one sent
    /// before it listened, without comparing clocks.
    sent_at: Option<tokio::time::Instant>,
}

impl SeqState {
    /// Microseconds since the event numbered `seq` was sent, if one was.
    fn since_prev_us(&self) -> Option<u64> {
        self.sent_at
            .map(|at| u64::try_from(at.elapsed().as_micros()).unwrap_or(u64::MAX))
    }
}

/// How often a publisher announces its last sequence numbers by default.
pub(crate) const DEFAULT_ANNOUNCE_INTERVAL: Duration = Duration::from_secs(1);

/// The shortest announce interval: shorter would make announcements
/// traffic of their own, and gain nothing against a reorder window that is
/// seconds long.
const MIN_ANNOUNCE_INTERVAL: Duration = Duration::from_millis(10);

/// How many times a cache is announced at an unchanged sequence number
/// before its announcements stop (until it is published to again).
///
/// A node that missed the last events needs one announcement sent after
/// them; the repeats cover lost announcements (a lossy transport loses them
/// as it loses events); and stopping means an idle publisher sends nothing
/// rather than one message per cache it ever published to, forever. A node
/// that misses every one of them (it was down meanwhile) finds the gap at
/// the next event, as before.
pub(crate) const QUIET_ANNOUNCEMENTS: u8 = 3;

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("topic", &self.inner.topic)
            .field("origin", &self.inner.origin)
            .field("id", &format_args!("{:016x}", self.inner.id))
            .finish_non_exhaustive()
    }
}

/// Configures a [`Publisher`].
pub struct PublisherBuilder {
    transport: Arc<dyn Transport>,
    topic: String,
    origin: String,
    max_event_bytes: usize,
    keyring: Option<Keyring>,
    announce_interval: Duration,
    again_after: Option<Duration>,
}

impl fmt::Debug for PublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PublisherBuilder")
            .field("topic", &self.topic)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl PublisherBuilder {
    /// The topic to publish to. Default `"cache-sync"`.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// A name for this publisher in nodes' logs (a service or node name).
    pub fn origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = origin.into();
        self
    }

    /// Largest event sent, signature included; larger batches are split.
    /// Keep it at or below the nodes' limit. Default 1 MiB; 1 byte to
    /// 64 MiB, and [`build`](Self::build) refuses anything else.
    pub fn max_event_bytes(mut self, n: usize) -> Self {
        self.max_event_bytes = n;
        self
    }

    /// Signs every event with the ring's primary key (HMAC-SHA256).
    pub fn signing(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// How often the publisher announces, per cache it published to lately,
    /// the last sequence number it used (see [`Publisher`]). A node that
    /// missed the last events before a quiet period resyncs that cache
    /// within this interval plus its
    /// [reorder window](crate::NodeBuilder::reorder_window), plus the
    /// transport's latency, provided this process and the tokio runtime it
    /// published on keep running for one interval after the last publish
    /// (three, for the repeats), whether or not the `Publisher` is dropped
    /// meanwhile. Announcements are signed like events.
    ///
    /// Default 1 s; 10 ms to 1 h, or `Duration::MAX` for no announcements
    /// (and then no such bound: a lost last event is found at the next
    /// event, or by a transport's own loss detection).
    /// [`build`](Self::build) refuses anything else.
    pub fn announce_interval(mut self, every: Duration) -> Self {
        self.announce_interval = every;
        self
    }

    /// Sends every change a second time, `delay` after the first, as an
    /// invalidation of the keys it changed at the same versions (a clear as
    /// the same clear): the "delayed double delete" for nodes that load from
    /// a read replica.
    ///
    /// Why: a node that receives an invalidation before the replica it loads
    /// from has caught up reloads the old row and keeps it. The second
    /// invalidation, sent once the replica's lag has passed, removes that
    /// copy; the next read loads the new row. Set `delay` above the
    /// replica's worst lag. Loads that return the row's version
    /// ([`SyncedCache::get_with_versioned`](crate::SyncedCache::get_with_versioned))
    /// need no second invalidation for a versioned change: the old row's
    /// version is older than the tombstone, so it is not cached.
    ///
    /// The second send is an ordinary event with its own sequence number, so
    /// nodes detect its loss like any other. Its timer lives in this process,
    /// in one task per publisher that holds the publisher's state (a dropped
    /// publisher's second sends still go out) until none is pending: if the
    /// process or its tokio runtime stops first, the second send is lost.
    /// Until it is sent, each pending second send holds the keys (and
    /// versions) its change named, so memory grows with the rate of changes
    /// times `delay`. The database
    /// outbox's relay keeps its copy as a row instead, which survives a
    /// crash. A transport's own delayed delivery (RocketMQ's delay levels)
    /// is not used: the broker would hand the event over after later ones,
    /// and nodes would see its sequence number out of order, as a gap.
    ///
    /// Off by default; 1 ms to 1 h, and [`build`](Self::build) refuses
    /// anything else.
    pub fn again_after(mut self, delay: Duration) -> Self {
        self.again_after = Some(delay);
        self
    }

    /// The publisher, once the transport has accepted the topic's name
    /// ([`check_topic`](crate::transport::Transport::check_topic)) and the
    /// settings are in range; otherwise [`Error::Config`](crate::Error::Config) naming the rule
    /// broken.
    pub fn build(self) -> Result<Publisher> {
        self.transport.check_topic(&self.topic)?;
        check_max_event_bytes(self.max_event_bytes)?;
        if let Some(delay) = self.again_after {
            check_duration("again_after", delay, Duration::from_millis(1), MAX_TIMEOUT)?;
        }
        if self.announce_interval != Duration::MAX {
            check_duration(
                "announce_interval (or Duration::MAX for none)",
                self.announce_interval,
                MIN_ANNOUNCE_INTERVAL,
                MAX_TIMEOUT,
            )?;
        }
        let codec = Codec::new(self.max_event_bytes, self.keyring);
        Ok(Publisher::with_codec(
            self.transport,
            self.topic,
            self.origin,
            codec,
            self.announce_interval,
            self.again_after,
        ))
    }
}

impl Publisher {
    /// A publisher with settings already checked (a node's own: its topic
    /// and its codec, so that what this one seals the node can open).
    pub(crate) fn with_codec(
        transport: Arc<dyn Transport>,
        topic: String,
        origin: String,
        codec: Codec,
        announce_interval: Duration,
        again_after: Option<Duration>,
    ) -> Self {
        Publisher {
            inner: Arc::new(PublisherInner {
                transport,
                topic,
                origin,
                // Random: a restarted publisher must not continue an old numbering.
                id: RandomState::new().hash_one((std::process::id(), now_us())),
                codec,
                seqs: Mutex::default(),
                announce_interval,
                announcing: AtomicBool::new(false),
                announced: Mutex::default(),
                again: Mutex::default(),
                again_after,
            }),
        }
    }
}

/// What a publish call sent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// Events sent (0 for an empty batch; more than 1 when it was split).
    pub events: usize,
    /// The transport position of the last one, where the transport reports it.
    pub position: Option<Position>,
    /// The last event sent, for [`applied_by`](Self::applied_by).
    last: Option<Sent>,
}

/// Which event a publish sent last: what nodes report once they apply it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sent {
    cache: String,
    publisher: u64,
    seq: u64,
    /// When it was handed to the transport, on this process's clock:
    /// acknowledgement latencies count from here.
    at: tokio::time::Instant,
}

impl Published {
    /// Asks every node that holds the cache to answer `cluster` once it
    /// has applied this publish, and waits until every live one did, or
    /// until `timeout`; then says which nodes did, with the time from the
    /// publish to each one's answer, and why not all if not
    /// ([`Acks::incomplete`]).
    ///
    /// A node answers once it has applied this publish's last event, or
    /// covered it (a node applies a publisher's numbers in order, or
    /// resyncs the cache when one is missing), judged from the publisher's
    /// sequence numbers the node tracks (up to 100 000 publishers per node),
    /// not from a short list of recent ones; events it has taken in but
    /// whose writes still wait for a pinned load do not count until they
    /// land. The live nodes are those `cluster` has heard from in their
    /// last three heartbeat intervals. A view that may not know every node
    /// (a node's own younger than 1.5 heartbeat intervals; a watcher that
    /// has given the nodes less than 500 ms to answer the roll call it sent
    /// as it started; a view that is not reading the heartbeat channel; a
    /// view full to its member or byte bound, or that dropped a node's
    /// heartbeat for lack of room lately) never calls it complete, and says
    /// so. An empty publish (no event) resolves at once, with no node.
    ///
    /// ```no_run
    /// # async fn run(publisher: cache_sync::Publisher, cluster: cache_sync::Cluster) -> cache_sync::Result<()> {
    /// use std::time::Duration;
    /// let published = publisher.invalidate("countries", ["de"]).await?;
    /// let acks = published.applied_by(&cluster, Duration::from_secs(5)).await;
    /// println!("{acks}"); // applied on 3/3 nodes in 2 ms
    /// # Ok(()) }
    /// ```
    pub async fn applied_by(&self, cluster: &Cluster, timeout: Duration) -> Acks {
        let Some(last) = &self.last else {
            return Acks::none();
        };
        let goal = Goal {
            target: Target::Seq {
                publisher: last.publisher,
                seq: last.seq,
            },
            since: Some(last.at),
        };
        crate::cluster::wait(cluster, &last.cache, goal, timeout).await
    }
}

impl Publisher {
    /// A publisher on `transport` with the default topic, `cache-sync`, a
    /// name every transport accepts.
    pub fn new(transport: impl Transport) -> Self {
        Self::with_codec(
            Arc::new(transport),
            DEFAULT_TOPIC.into(),
            "publisher".into(),
            Codec::new(DEFAULT_MAX_EVENT_BYTES, None),
            DEFAULT_ANNOUNCE_INTERVAL,
            None,
        )
    }

    /// Configures a publisher on `transport`.
    pub fn builder(transport: impl Transport) -> PublisherBuilder {
        PublisherBuilder {
            transport: Arc::new(transport),
            topic: DEFAULT_TOPIC.into(),
            origin: "publisher".into(),
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            keyring: None,
            announce_interval: DEFAULT_ANNOUNCE_INTERVAL,
            again_after: None,
        }
    }

    /// Tells every node to install these entries in `cache` (unversioned:
    /// applied in delivery order). The untyped form, by cache name, for
    /// tools that do not know the key and value types; code that does uses
    /// [`dictionary`](Self::dictionary), whose [`Table`] checks them.
    pub async fn insert<K: Serialize, V: Serialize>(
        &self,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Published> {
        self.insert_versioned(cache, entries.into_iter().map(|(k, v)| (k, v, None)))
            .await
    }

    /// Like [`insert`](Self::insert), with a version per entry: a node
    /// ignores an insert older than what it already reflects for that key.
    pub async fn insert_versioned<K: Serialize, V: Serialize>(
        &self,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
    ) -> Result<Published> {
        let changes = changes::refreshes(entries, self.budget())?;
        self.send(cache, changes).await
    }

    /// Tells every node to drop `keys` from `cache`. Unversioned: applied in
    /// delivery order.
    pub async fn invalidate<K: Serialize>(
        &self,
        cache: &str,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<Published> {
        self.invalidate_versioned(cache, keys.into_iter().map(|k| (k, None)))
            .await
    }

    /// Tells every node to drop `keys`, each leaving a tombstone at its version
    /// so an older insert arriving later is ignored.
    pub async fn invalidate_versioned<K: Serialize>(
        &self,
        cache: &str,
        keys: impl IntoIterator<Item = (K, Option<u64>)>,
    ) -> Result<Published> {
        let changes = changes::invalidations(keys, self.budget())?;
        self.send(cache, changes).await
    }

    /// Tells every node to drop everything in `cache`.
    pub async fn invalidate_all(&self, cache: &str) -> Result<Published> {
        self.send(cache, vec![Change::Clear { version: None }])
            .await
    }

    /// Drops everything and makes `version` a floor: inserts older than it
    /// that arrive later are ignored.
    pub async fn invalidate_all_versioned(&self, cache: &str, version: u64) -> Result<Published> {
        self.send(
            cache,
            vec![Change::Clear {
                version: Some(version),
            }],
        )
        .await
    }

    /// A typed publisher for one dictionary table: a [`Table`] shared with
    /// the nodes, or a plain cache name with the types spelt out
    /// (`dictionary::<String, String>("countries")`).
    pub fn dictionary<K: Serialize, V: Serialize>(
        &self,
        table: impl Into<Table<K, V>>,
    ) -> DictionaryPublisher<K, V> {
        DictionaryPublisher::new(self.clone(), table.into())
    }

    /// The topic it publishes to.
    pub fn topic(&self) -> &str {
        &self.inner.topic
    }

    /// How many bytes of keys and values one event may carry.
    fn budget(&self) -> usize {
        self.inner.codec.entry_budget(&self.inner.origin)
    }

    /// Splits an already built change (the outbox relay's) as this
    /// publisher's limit needs.
    #[cfg(feature = "postgres")]
    pub(crate) fn resplit(&self, change: Change) -> Result<Vec<Change>> {
        changes::resplit(change, self.budget())
    }

    pub(crate) async fn send(&self, cache: &str, changes: Vec<Change>) -> Result<Published> {
        self.send_with(cache, None, || Ok((changes, ())))
            .await
            .map(|(p, ())| p)
    }

    /// [`send`](Self::send) under an outbox relay's fencing token.
    #[cfg(feature = "postgres")]
    pub(crate) async fn send_fenced(
        &self,
        cache: &str,
        changes: Vec<Change>,
        fence: Fence,
    ) -> Result<Published> {
        self.send_with(cache, Some(fence), || Ok((changes, ())))
            .await
            .map(|(p, ())| p)
    }

    /// Builds the changes while holding the cache's publish lock, so that
    /// versions assigned in `build` reach the transport in version order.
    async fn send_with<T>(
        &self,
        cache: &str,
        fence: Option<Fence>,
        build: impl FnOnce() -> Result<(Vec<Change>, T)>,
    ) -> Result<(Published, T)> {
        self.inner.transport.check_tag(cache)?;
        let seq = self.seq(cache);
        // Held across the publish so numbers reach the transport in order.
        let mut seq = seq.lock().await;
        let (changes, out) = build()?;
        let published = self.publish_locked(cache, &mut seq, fence, &changes).await;
        drop(seq);
        // After the number was used, failed publish or not: an announcing
        // task that ends from now on finds it due (see `announce_loop`).
        self.announce_later();
        let published = published?;
        // Scheduled only once the first send went through: a failed one
        // returns its error, and the caller retries the whole change.
        if let Some(delay) = self.inner.again_after {
            self.send_again(cache, delay, changes);
        }
        Ok((published, out))
    }

    /// Makes sure an announcing task will announce the numbers used so far.
    /// One relaxed load on the publish path: the flag only needs to be
    /// seen true by publishes whose numbers a running task will see, and
    /// the cache's publish lock orders those (see `announce_loop`).
    fn announce_later(&self) {
        if !self.inner.announcing.load(Relaxed) {
            self.start_announcing();
        }
    }

    /// The cache's sequence number, behind its publish lock.
    fn seq(&self, cache: &str) -> Arc<tokio::sync::Mutex<SeqState>> {
        let mut seqs = lock(&self.inner.seqs);
        seqs.entry(cache.to_owned()).or_default().clone()
    }

    /// Seals and publishes `changes` in order, each under the next number.
    async fn publish_locked(
        &self,
        cache: &str,
        state: &mut SeqState,
        fence: Option<Fence>,
        changes: &[Change],
    ) -> Result<Published> {
        let mut published = Published {
            events: 0,
            position: None,
            last: None,
        };
        for change in changes {
            // 2^64 publishes to one cache from one publisher will not happen;
            // saturating keeps the numbers from ever going back regardless.
            state.seq = state.seq.saturating_add(1);
            let header = Header {
                cache,
                origin: Origin(self.inner.origin.as_bytes()),
                publisher: self.inner.id,
                seq: state.seq,
                published_at_us: now_us(),
            };
            let ext = HeaderExt {
                since_prev_us: state.since_prev_us(),
                fence,
            };
            let payload = self.inner.codec.seal_ext(&header, &ext, change)?;
            // Before the call: whether or not it fails, the number is used
            // and the event may have reached some nodes.
            let sent_at = tokio::time::Instant::now();
            state.sent_at = Some(sent_at);
            let position = self
                .inner
                .transport
                .publish(&self.inner.topic, cache, Bytes::from(payload))
                .await?;
            published.events = published.events.saturating_add(1);
            published.position = position.or(published.position);
            published.last = Some(Sent {
                cache: cache.to_owned(),
                publisher: header.publisher,
                seq: header.seq,
                at: sent_at,
            });
        }
        Ok(published)
    }

    /// The second send of [`PublisherBuilder::again_after`]: queues, for
    /// `delay` from now, an invalidation of what `changes` changed. One
    /// task per publisher sends them in order (every entry waits the same
    /// delay, so the queue is in due order); it holds the publisher's
    /// state until the queue is empty, so a dropped publisher's second
    /// sends still go out while the process and its runtime live.
    fn send_again(&self, cache: &str, delay: Duration, changes: Vec<Change>) {
        let again: Vec<Change> = changes.into_iter().map(Change::into_invalidation).collect();
        let mut queue = lock(&self.inner.again);
        queue
            .pending
            .push_back((deadline_after(delay), cache.to_owned(), again));
        if queue.sending {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                queue.sending = true;
                runtime.spawn(again_loop(AgainGuard {
                    inner: self.inner.clone(),
                    armed: true,
                }));
            }
            // The caller's runtime is shutting down: nothing can send it
            // later. Left queued, it goes with the next publish's task.
            Err(e) => tracing::warn!(%cache, error = %e,
                "no tokio runtime to send the delayed second invalidation from; it waits for the next publish"),
        }
    }

    /// Spawns the announcing task, once, on the runtime of the publish
    /// that calls this: `new` and `build` may run outside any runtime.
    #[cold]
    fn start_announcing(&self) {
        let every = self.inner.announce_interval;
        if every == Duration::MAX || self.inner.announcing.swap(true, Relaxed) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let respawn = Respawn {
                    inner: self.inner.clone(),
                    armed: true,
                };
                runtime.spawn(announce_loop(respawn, every));
            }
            Err(e) => {
                // Tried again at the next publish.
                self.inner.announcing.store(false, Relaxed);
                tracing::debug!(topic = %self.inner.topic, error = %e,
                    "no tokio runtime to announce sequence numbers from");
            }
        }
    }
}

/// Announces each cache's last sequence number every `every`, until every
/// cache has been announced `QUIET_ANNOUNCEMENTS` times unchanged; then it
/// ends, and the next publish spawns it again. It holds the publisher's
/// state meanwhile: a publisher dropped after a publish still announces.
async fn announce_loop(mut respawn: Respawn, every: Duration) {
    // `respawn` is an argument, so that it is dropped with the task even if
    // the task never ran.
    let inner = respawn.inner.clone();
    let mut ticks = tokio::time::interval_at(deadline_after(every), every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let due = inner.due();
        if due.is_empty() {
            // No await from here to the end: the exit is all or nothing.
            // A publish uses its number, then loads the flag. Either it
            // loads false (the store below came first) and spawns a task,
            // or it took its publish lock before the check below released
            // it, and the check sees the new number (or the lock held) and
            // takes the flag back.
            respawn.armed = false;
            inner.announcing.store(false, Relaxed);
            if inner.due().is_empty() || inner.announcing.swap(true, Relaxed) {
                return;
            }
            respawn.armed = true;
            continue;
        }
        for (cache, seq) in due {
            // Not waited for: a publish stuck in the transport (for up to
            // its timeout) must not hold up the other caches' announcements.
            // The cache stays due for the next tick.
            let Ok(seq) = seq.try_lock() else {
                continue;
            };
            // Under the publish lock: the announcement reaches the
            // transport after every event it vouches for, and takes no number.
            let n = seq.seq;
            let times = match lock(&inner.announced).get(cache.as_str()) {
                Some(&(m, times)) if m == n => times,
                _ => 0,
            };
            if n == 0 || times >= QUIET_ANNOUNCEMENTS {
                continue;
            }
            match inner.announce(&cache, n, seq.since_prev_us()).await {
                Ok(()) => {
                    lock(&inner.announced).insert(cache, (n, times.saturating_add(1)));
                }
                // Nothing is used up: the next tick tries again.
                Err(e) => tracing::debug!(topic = %inner.topic, %cache, seq = n, error = %e,
                    "announcing a sequence number failed; retrying at the next interval"),
            }
        }
    }
}

/// Lets the next publish spawn the announcing task again if this one is
/// dropped without ending by itself: its runtime shut down (a publisher
/// can outlive the runtime it first published on).
struct Respawn {
    inner: Arc<PublisherInner>,
    /// False while the task ends by itself: it clears the flag then, and a
    /// newer task may have set it since.
    armed: bool,
}

impl Drop for Respawn {
    fn drop(&mut self) {
        if self.armed {
            self.inner.announcing.store(false, Relaxed);
        }
    }
}

/// The second sends of `again_after` waiting for their time.
#[derive(Default)]
struct AgainQueue {
    pending: VecDeque<(tokio::time::Instant, String, Vec<Change>)>,
    sending: bool,
}

/// Sends the queued second sends as they fall due; ends when none is left.
async fn again_loop(mut guard: AgainGuard) {
    let inner = guard.inner.clone();
    loop {
        let due = {
            let mut queue = lock(&inner.again);
            match queue.pending.front() {
                Some((due, ..)) if *due > tokio::time::Instant::now() => Some(*due),
                Some(_) => None,
                None => {
                    // Under the queue's lock: a send queued after this
                    // sees `sending` false and spawns a new task.
                    queue.sending = false;
                    guard.armed = false;
                    return;
                }
            }
        };
        if let Some(due) = due {
            tokio::time::sleep_until(due).await;
            continue;
        }
        let Some((_, cache, again)) = lock(&inner.again).pending.pop_front() else {
            continue;
        };
        let publisher = Publisher {
            inner: inner.clone(),
        };
        let seq = publisher.seq(&cache);
        let mut seq = seq.lock().await;
        // A failure used up its number: nodes see the gap and resync
        // this cache, which is what the second invalidation was for.
        if let Err(e) = publisher
            .publish_locked(&cache, &mut seq, None, &again)
            .await
        {
            tracing::warn!(cache = %cache, error = %e, "the delayed second invalidation failed");
        }
        drop(seq);
        publisher.announce_later();
    }
}

/// Lets the next publish start the second sends' task again if this one
/// is dropped before it ends (its runtime shut down).
struct AgainGuard {
    inner: Arc<PublisherInner>,
    /// False once the task ended by itself: a newer one may be sending.
    armed: bool,
}

impl Drop for AgainGuard {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.inner.again).sending = false;
        }
    }
}

impl PublisherInner {
    /// The caches with numbers not yet announced `QUIET_ANNOUNCEMENTS`
    /// times; a cache being published to now counts, it will need it.
    fn due(&self) -> Vec<(String, Arc<tokio::sync::Mutex<SeqState>>)> {
        let sent = lock(&self.announced);
        lock(&self.seqs)
            .iter()
            .filter(|(cache, seq)| {
                let Ok(seq) = seq.try_lock() else {
                    return true;
                };
                seq.seq > 0
                    && sent
                        .get(cache.as_str())
                        .is_none_or(|&(n, times)| n != seq.seq || times < QUIET_ANNOUNCEMENTS)
            })
            .map(|(cache, seq)| (cache.clone(), seq.clone()))
            .collect()
    }

    /// Sends `seq` again for `cache`, as an announcement (see `wire`),
    /// sealed like an event, saying how long ago its event was sent.
    async fn announce(&self, cache: &str, seq: u64, since_prev_us: Option<u64>) -> Result<()> {
        let header = Header {
            cache,
            origin: Origin(self.origin.as_bytes()),
            publisher: self.id,
            seq,
            published_at_us: now_us(),
        };
        let ext = HeaderExt {
            since_prev_us,
            fence: None,
        };
        let payload = self.codec.seal_ext(&header, &ext, &Change::ANNOUNCE)?;
        self.transport
            .publish(&self.topic, cache, Bytes::from(payload))
            .await?;
        Ok(())
    }
}

mod changes;
mod dictionary;

pub(crate) use changes::{invalidations, refreshes, replacement};

pub use dictionary::DictionaryPublisher;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedTransport;
    use crate::transport::{Delivery, StartFrom, SubscribeOptions};
    use crate::wire::{KeyVersion, MAX_EVENT_BYTES_CEILING, decode, encode_part};

    /// What a test needs of a published event's header.
    #[derive(Debug)]
    pub(super) struct Sent {
        pub(super) cache: String,
        pub(super) seq: u64,
    }

    pub(super) async fn drain(transport: &EmbeddedTransport) -> Vec<(Sent, Change)> {
        let mut sub = transport
            .subscribe(DEFAULT_TOPIC, SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        match sub.next(10_000).await.unwrap() {
            Delivery::Batch { records, .. } => records
                .iter()
                .map(|r| {
                    let (h, change) = decode(&r.payload, MAX_EVENT_BYTES_CEILING).unwrap();
                    let sent = Sent {
                        cache: h.cache.to_owned(),
                        seq: h.seq,
                    };
                    (sent, change)
                })
                .collect(),
            Delivery::Lost(l) => panic!("{l:?}"),
        }
    }

    #[tokio::test]
    async fn sequences_count_per_cache_from_one() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .origin("admin")
            .build()
            .unwrap();
        p.invalidate("a", ["x"]).await.unwrap();
        p.invalidate("b", ["y"]).await.unwrap();
        p.invalidate_all("a").await.unwrap();
        let seqs: Vec<_> = drain(&transport)
            .await
            .iter()
            .map(|(h, _)| (h.cache.clone(), h.seq))
            .collect();
        assert_eq!(seqs, [("a".into(), 1), ("b".into(), 1), ("a".into(), 2)]);
    }

    /// The second send says "drop" for every key the first changed, at the
    /// same versions, with the next sequence number, and only after the delay.
    #[tokio::test(start_paused = true)]
    async fn again_after_sends_an_invalidation_of_the_same_keys_later() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .again_after(Duration::from_secs(2))
            .announce_interval(Duration::MAX)
            .build()
            .unwrap();
        p.insert_versioned("t", [("a", "x", Some(7)), ("b", "y", None)])
            .await
            .unwrap();
        p.invalidate_all_versioned("t", 9).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1999)).await;
        assert_eq!(drain(&transport).await.len(), 2, "sent again too early");
        tokio::time::sleep(Duration::from_millis(2)).await;
        let events = drain(&transport).await;
        let seqs: Vec<_> = events.iter().map(|(h, _)| h.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        let Change::Invalidate { keys } = &events[2].1 else {
            panic!("{:?}", events[2].1)
        };
        let expect = [("a", Some(7)), ("b", None)].map(|(k, version)| KeyVersion {
            key: encode_part(&k, "key").unwrap(),
            version,
        });
        assert_eq!(keys, &expect);
        assert_eq!(events[3].1, Change::Clear { version: Some(9) });
    }

    /// The announcing task and the second sends' task hold a dropped
    /// publisher's state until their work is done, then end and let it go.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_publishers_tasks_finish_their_work_then_let_it_go() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .announce_interval(Duration::from_secs(1))
            .again_after(Duration::from_secs(2))
            .build()
            .unwrap();
        p.insert("t", [("a", "x")]).await.unwrap();
        let inner = Arc::downgrade(&p.inner);
        drop(p);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(inner.upgrade().is_none(), "the publisher's state leaked");
        let events = drain(&transport).await;
        let sent: Vec<_> = events
            .iter()
            .filter(|(_, c)| c.len() > 0)
            .map(|(h, _)| h.seq)
            .collect();
        assert_eq!(sent, [1, 2], "the change and its second send");
        let last: Vec<_> = events
            .iter()
            .filter(|(_, c)| c.len() == 0)
            .map(|(h, _)| h.seq)
            .filter(|&seq| seq == 2)
            .collect();
        assert_eq!(last, [2, 2, 2], "the last number, announced three times");
    }

    /// A second send queued where there is no runtime to time it (the
    /// caller's is shutting down) does not panic: it waits, and goes out
    /// with the next publish's.
    #[test]
    fn a_second_send_queued_outside_a_runtime_goes_with_the_next() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .again_after(Duration::from_secs(1))
            .announce_interval(Duration::MAX)
            .build()
            .unwrap();
        p.send_again(
            "t",
            Duration::from_secs(1),
            vec![Change::Clear { version: None }],
        );
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(async {
                p.invalidate_all("t").await.unwrap();
                tokio::time::sleep(Duration::from_secs(2)).await;
                let seqs: Vec<_> = drain(&transport).await.iter().map(|(h, _)| h.seq).collect();
                assert_eq!(seqs, [1, 2, 3]);
            });
    }

    /// A publish stuck in the transport for one cache does not hold up
    /// the announcements of the others.
    #[tokio::test(start_paused = true)]
    async fn a_stuck_publish_holds_up_no_other_caches_announcements() {
        let embedded = EmbeddedTransport::new();
        let transport = crate::transport::FaultyTransport::new(embedded.clone());
        let p = Publisher::builder(transport.clone())
            .announce_interval(Duration::from_secs(1))
            .build()
            .unwrap();
        p.insert("slow", [("a", "x")]).await.unwrap();
        let fast: Vec<String> = (0..8).map(|i| format!("fast{i}")).collect();
        for cache in &fast {
            p.insert(cache, [("a", "x")]).await.unwrap();
        }
        // From now on, publishes to cache "slow" hang.
        transport.hang_publishes_where(|cache, _| cache == "slow");
        let stuck = p.clone();
        let stuck = tokio::spawn(async move { stuck.insert("slow", [("b", "y")]).await });
        tokio::time::sleep(Duration::from_secs(10)).await;
        let events = drain(&embedded).await;
        for cache in &fast {
            let announced = events
                .iter()
                .filter(|(h, c)| &h.cache == cache && c.len() == 0)
                .count();
            assert_eq!(announced, 3, "{cache}");
        }
        assert!(!stuck.is_finished());
        assert!(transport.hanging() >= 1, "stuck in the transport");
        stuck.abort();
    }

    #[tokio::test]
    async fn large_batches_split_under_the_limit_and_oversized_entries_fail() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .max_event_bytes(4096)
            .build()
            .unwrap();
        let rows: Vec<(u32, String)> = (0..100).map(|i| (i, "v".repeat(200))).collect();
        let sent = p.insert("t", rows).await.unwrap();
        assert!(sent.events > 1, "{sent:?}");
        let events = drain(&transport).await;
        assert_eq!(events.len(), sent.events);
        assert_eq!(events.iter().map(|(_, c)| c.len()).sum::<usize>(), 100);
        let err = p.insert("t", [(1u32, "v".repeat(5000))]).await.unwrap_err();
        assert!(err.is_too_large(), "{err}");
        assert_eq!(p.insert::<u32, u32>("t", []).await.unwrap().events, 0);
    }
}
