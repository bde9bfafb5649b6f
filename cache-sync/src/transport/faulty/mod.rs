//! A transport for tests that injects faults on command, in the spirit of
//! `tower-test`'s mock: wrap any transport, keep a handle, and make the
//! next publishes fail, lose them, cut them after the broker took them or
//! hang them, hold deliveries back, drop, duplicate or reorder records,
//! break a subscription after some batches, refuse subscriptions, strip
//! tags, refuse history, or drop or hang the heartbeat channel's messages.
//! It also counts and (on request) records what reached the broker.
//!
//! Behind the `test-util` feature (and in this crate's own tests). Every
//! fault is off until asked for; a count-down fault (`fail_publishes(3)`)
//! applies to that many calls and then ends by itself.

use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;

use super::Transport;

mod inject;

use inject::Holding;

/// Wraps a transport; clones share the faults, so a test keeps one clone
/// and hands the other to a node or publisher.
///
/// ```
/// # async fn demo() -> cache_sync::Result<()> {
/// use cache_sync::transport::EmbeddedTransport;
/// use cache_sync::transport::FaultyTransport;
///
/// let faulty = FaultyTransport::new(EmbeddedTransport::new());
/// let publisher = cache_sync::Publisher::new(faulty.clone());
/// faulty.fail_publishes(1);
/// let err = publisher.insert("countries", [("de", "Germany")]).await.unwrap_err();
/// assert!(err.is_disconnected());
/// publisher.insert("countries", [("de", "Germany")]).await?; // the fault is spent
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct FaultyTransport {
    inner: Arc<dyn Transport>,
    faults: Arc<Faults>,
}

impl std::fmt::Debug for FaultyTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyTransport")
            .field("inner", &self.inner.kind())
            .field("faults", &self.faults)
            .finish()
    }
}

/// Picks change-event publishes by tag and payload.
type PublishFilter = dyn Fn(&str, &[u8]) -> bool + Send + Sync;
/// Picks heartbeat-channel messages by payload.
type HeartbeatFilter = dyn Fn(&[u8]) -> bool + Send + Sync;

/// A fault that is off, or on for what its filter picks.
struct Switch<F: ?Sized>(Mutex<Option<Arc<F>>>);

impl<F: ?Sized> Default for Switch<F> {
    fn default() -> Self {
        Self(Mutex::new(None))
    }
}

impl<F: ?Sized> std::fmt::Debug for Switch<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.get().is_some() { "on" } else { "off" })
    }
}

impl<F: ?Sized> Switch<F> {
    fn set(&self, filter: Option<Arc<F>>) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = filter;
    }

    /// The filter, if on; cloned out, so it runs without the lock.
    fn get(&self) -> Option<Arc<F>> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn is_on(&self) -> bool {
        self.get().is_some()
    }
}

#[derive(Debug, Default)]
struct Faults {
    /// Publishes that go through before `fail_publishes` applies.
    pass_publishes: AtomicUsize,
    fail_publishes: AtomicUsize,
    lose_publishes: AtomicUsize,
    cut_publishes: AtomicUsize,
    fail_acks: AtomicUsize,
    /// Publishes that wait before the broker.
    hang_publishes: Switch<PublishFilter>,
    /// Publishes that wait after the broker took them.
    hang_after_broker: Switch<PublishFilter>,
    /// Publishes waiting in either hang right now.
    hanging: AtomicUsize,
    publishes: AtomicUsize,
    /// What reached the broker, while `recording`: (tag, payload).
    recording: AtomicBool,
    published: Mutex<Vec<(String, Bytes)>>,
    stalled: AtomicBool,
    drop_records: AtomicUsize,
    duplicate_records: AtomicUsize,
    reorder: AtomicBool,
    /// Batches the next subscription delivers before it breaks; 0: none.
    break_next_subscription_after: AtomicUsize,
    strip_tags: AtomicBool,
    refuse_history: AtomicBool,
    fail_subscriptions: AtomicBool,
    subscriptions: AtomicUsize,
    refused_subscriptions: AtomicUsize,
    /// Subscriptions holding a delivery back in a stall right now.
    holding: AtomicUsize,
    drop_heartbeats: Switch<HeartbeatFilter>,
    hang_heartbeats: AtomicBool,
    hang_tails: AtomicBool,
    hide_tails: AtomicBool,
    /// Tails asked so far.
    tails: AtomicUsize,
    hang_heartbeat_subscriptions: AtomicBool,
}

/// Takes one from a count-down fault, if any is left.
fn take(count: &AtomicUsize) -> bool {
    count
        .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

impl FaultyTransport {
    /// `inner`, with no fault on.
    pub fn new(inner: impl Transport) -> Self {
        Self {
            inner: Arc::new(inner),
            faults: Arc::default(),
        }
    }

    /// `inner`, under this transport's faults: what a restarted process's
    /// new client gets when the test's switches should still apply to it.
    pub fn sharing(&self, inner: impl Transport) -> Self {
        Self {
            inner: Arc::new(inner),
            faults: self.faults.clone(),
        }
    }

    /// The transport wrapped, without faults: a publisher or node on it
    /// goes around them.
    pub fn inner(&self) -> Arc<dyn Transport> {
        self.inner.clone()
    }

    /// The next `n` publishes fail before they reach the broker, as on a
    /// dropped connection (`is_disconnected()`). `fail_publishes(0)` ends
    /// this fault, and one set by
    /// [`fail_publishes_after`](Self::fail_publishes_after).
    pub fn fail_publishes(&self, n: usize) {
        self.fail_publishes_after(0, n);
    }

    /// The next `ok` publishes go through, and the `n` after them fail as
    /// in [`fail_publishes`](Self::fail_publishes): a broker that goes
    /// down in the middle of a run. With `n` as `usize::MAX` it stays down
    /// until `fail_publishes(0)`.
    pub fn fail_publishes_after(&self, ok: usize, n: usize) {
        self.faults.pass_publishes.store(ok, SeqCst);
        self.faults.fail_publishes.store(n, SeqCst);
    }

    /// The next `n` publishes report success (with no position) and never
    /// reach the broker: lost between publisher and broker, and nobody is
    /// told. Not counted in [`publishes`](Self::publishes).
    pub fn lose_publishes(&self, n: usize) {
        self.faults.lose_publishes.store(n, SeqCst);
    }

    /// The next `n` publishes reach the broker, and then report a dropped
    /// connection: the caller cannot tell them from failed ones.
    pub fn cut_publishes(&self, n: usize) {
        self.faults.cut_publishes.store(n, SeqCst);
    }

    /// The next `n` publishes are handed over (see
    /// [`Transport::start_publish`]), never reach the broker, and their
    /// acknowledgement fails as on a dropped connection: a pipelined call
    /// lost in flight while later ones go through. Not counted in
    /// [`publishes`](Self::publishes).
    pub fn fail_acks(&self, n: usize) {
        self.faults.fail_acks.store(n, SeqCst);
    }

    /// While on, publishes wait (before the broker) until it is turned off.
    /// Turning it off also releases the hangs of
    /// [`hang_publishes_where`](Self::hang_publishes_where) and
    /// [`hang_after_broker_where`](Self::hang_after_broker_where).
    pub fn hang_publishes(&self, on: bool) {
        if on {
            self.faults.hang_publishes.set(Some(Arc::new(|_, _| true)));
        } else {
            self.faults.hang_publishes.set(None);
            self.faults.hang_after_broker.set(None);
        }
    }

    /// The publishes that `pick(tag, payload)` picks (asked once, as each
    /// publish starts) wait before the broker until
    /// `hang_publishes(false)`; the others go on: one cache's publishes
    /// stuck, or the `n`th publish, with a counter in `pick`.
    pub fn hang_publishes_where(&self, pick: impl Fn(&str, &[u8]) -> bool + Send + Sync + 'static) {
        self.faults.hang_publishes.set(Some(Arc::new(pick)));
    }

    /// The publishes that `pick(tag, payload)` picks reach the broker, and
    /// then wait before they return until `hang_publishes(false)`: the
    /// record is out, and the caller does not know it yet. What waits is
    /// the acknowledgement (see [`Transport::start_publish`]): publishes
    /// handed over later go on meanwhile.
    pub fn hang_after_broker_where(
        &self,
        pick: impl Fn(&str, &[u8]) -> bool + Send + Sync + 'static,
    ) {
        self.faults.hang_after_broker.set(Some(Arc::new(pick)));
    }

    /// Publishes waiting in a hang right now, before or after the broker:
    /// once this is above 0, the publisher is parked there.
    pub fn hanging(&self) -> usize {
        self.faults.hanging.load(SeqCst)
    }

    /// Change-event publishes that reached the broker so far (heartbeats
    /// and replies not counted).
    pub fn publishes(&self) -> usize {
        self.faults.publishes.load(SeqCst)
    }

    /// While on, each change-event publish that reaches the broker is kept
    /// for [`published`](Self::published). Off by default: a long test
    /// would keep every payload.
    pub fn record_publishes(&self, on: bool) {
        self.faults.recording.store(on, SeqCst);
    }

    /// The `(tag, payload)` of each change-event publish that reached the
    /// broker while [`record_publishes`](Self::record_publishes) was on,
    /// in the order the broker took them (as they were handed over).
    pub fn published(&self) -> Vec<(String, Bytes)> {
        self.faults
            .published
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// While on, every subscription holds its next delivery back (fetched,
    /// not lost): a node that falls behind. Heartbeats pass.
    pub fn stall(&self, on: bool) {
        self.faults.stalled.store(on, SeqCst);
    }

    /// The next `n` records delivered to any subscription are dropped
    /// without a word: a loss the transport does not know of.
    pub fn drop_records(&self, n: usize) {
        self.faults.drop_records.store(n, SeqCst);
    }

    /// The next `n` records delivered are delivered twice in a row.
    pub fn duplicate_records(&self, n: usize) {
        self.faults.duplicate_records.store(n, SeqCst);
    }

    /// While on, each batch is delivered in reverse order.
    pub fn reorder(&self, on: bool) {
        self.faults.reorder.store(on, SeqCst);
    }

    /// The next subscription made breaks, as on a dropped connection, after
    /// delivering `batches` batches (0 turns this off); later ones do not.
    pub fn break_next_subscription_after(&self, batches: usize) {
        self.faults
            .break_next_subscription_after
            .store(batches, SeqCst);
    }

    /// While on, records are delivered without their tags, as Redis
    /// Pub/Sub delivers them.
    pub fn strip_tags(&self, on: bool) {
        self.faults.strip_tags.store(on, SeqCst);
    }

    /// While on, a subscription from anywhere but the latest record is
    /// `Unsupported`, as on a transport without history.
    pub fn refuse_history(&self, on: bool) {
        self.faults.refuse_history.store(on, SeqCst);
    }

    /// While on, change subscribes fail as on a dropped connection
    /// (`is_disconnected()`): a broker that cannot be reached. Heartbeat
    /// and reply subscriptions are not affected.
    pub fn fail_subscriptions(&self, on: bool) {
        self.faults.fail_subscriptions.store(on, SeqCst);
    }

    /// Change subscriptions made so far.
    pub fn subscriptions(&self) -> usize {
        self.faults.subscriptions.load(SeqCst)
    }

    /// Change subscribes refused so far by
    /// [`fail_subscriptions`](Self::fail_subscriptions) or
    /// [`refuse_history`](Self::refuse_history): how often a node tried.
    pub fn refused_subscriptions(&self) -> usize {
        self.faults.refused_subscriptions.load(SeqCst)
    }

    /// Subscriptions that have fetched a delivery and hold it back in a
    /// stall right now: once this is above 0 after [`stall`](Self::stall),
    /// their reader is parked, and everything published later is behind it.
    pub fn holding(&self) -> usize {
        self.faults.holding.load(SeqCst)
    }

    /// While on, every message published on the heartbeat channel
    /// (heartbeats, acknowledgement requests and what is answered there)
    /// is reported sent and never delivered, as the channel may drop them.
    /// Turning it off also ends
    /// [`drop_heartbeats_where`](Self::drop_heartbeats_where).
    pub fn drop_heartbeats(&self, on: bool) {
        self.faults
            .drop_heartbeats
            .set(on.then(|| Arc::new(|_: &[u8]| true) as Arc<HeartbeatFilter>));
    }

    /// Drops, as [`drop_heartbeats`](Self::drop_heartbeats) does, only the
    /// heartbeat-channel messages that `pick(payload)` picks: one kind of
    /// message lost, the others delivered.
    pub fn drop_heartbeats_where(&self, pick: impl Fn(&[u8]) -> bool + Send + Sync + 'static) {
        self.faults.drop_heartbeats.set(Some(Arc::new(pick)));
    }

    /// While on, publishing on the heartbeat channel waits until it is
    /// turned off, as on a broker that is down until a timeout.
    pub fn hang_heartbeats(&self, on: bool) {
        self.faults.hang_heartbeats.store(on, SeqCst);
    }

    /// While on, subscribing to the heartbeat channel waits until it is
    /// turned off: a party that never hears the channel.
    pub fn hang_heartbeat_subscriptions(&self, on: bool) {
        self.faults.hang_heartbeat_subscriptions.store(on, SeqCst);
    }

    /// While on, asking for the topic's tail waits until it is turned off:
    /// a broker the node cannot reach, its requests unanswered.
    pub fn hang_tails(&self, on: bool) {
        self.faults.hang_tails.store(on, SeqCst);
    }

    /// While on, the topic's tail is unknown (`Ok(None)`), as on a
    /// transport that cannot tell it.
    pub fn hide_tails(&self, on: bool) {
        self.faults.hide_tails.store(on, SeqCst);
    }

    /// How many times the topic's tail was asked (what a node's freshness
    /// proof costs its broker).
    pub fn tails_asked(&self) -> usize {
        self.faults.tails.load(SeqCst)
    }
}

/// Waits, counted in `hanging`, while `on` holds.
async fn hang(hanging: &AtomicUsize, on: impl Fn() -> bool) {
    // Uncounted however the wait ends (a cancelled publish included).
    let _hanging = Holding::new(hanging);
    while on() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::embedded::EmbeddedTransport;
    use crate::transport::{Delivery, StartFrom, SubscribeOptions, Subscription};

    async fn batch(sub: &mut Box<dyn Subscription>) -> Vec<Bytes> {
        match sub.next(100).await.expect("a delivery") {
            Delivery::Batch { records, .. } => records.into_iter().map(|r| r.payload).collect(),
            Delivery::Lost(loss) => panic!("a loss: {loss:?}"),
        }
    }

    async fn publish(t: &FaultyTransport, payloads: &[&'static str]) {
        for p in payloads {
            t.inner()
                .publish("t", "c", Bytes::from_static(p.as_bytes()))
                .await
                .expect("publish");
        }
    }

    fn bytes(v: &[&'static str]) -> Vec<Bytes> {
        v.iter().map(|p| Bytes::from_static(p.as_bytes())).collect()
    }

    #[tokio::test]
    async fn publishes_fail_or_are_cut_as_many_times_as_asked() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        let mut sub = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        t.fail_publishes(2);
        t.cut_publishes(1);
        for _ in 0..2 {
            let e = t.publish("t", "c", Bytes::from_static(b"x")).await;
            assert!(e.is_err_and(|e| e.is_disconnected()));
        }
        // Cut: reported failed, but the broker has it.
        let e = t.publish("t", "c", Bytes::from_static(b"cut")).await;
        assert!(e.is_err_and(|e| e.is_disconnected()));
        t.publish("t", "c", Bytes::from_static(b"ok"))
            .await
            .expect("spent");
        assert_eq!(t.publishes(), 2);
        assert_eq!(batch(&mut sub).await, bytes(&["cut", "ok"]));
    }

    #[tokio::test]
    async fn records_are_dropped_duplicated_reordered_and_untagged() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        let mut sub = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        t.drop_records(1);
        t.duplicate_records(1);
        publish(&t, &["a", "b", "c"]).await;
        assert_eq!(batch(&mut sub).await, bytes(&["b", "b", "c"]));
        t.reorder(true);
        t.strip_tags(true);
        assert!(!t.filters_by_tag());
        publish(&t, &["d", "e"]).await;
        match sub.next(100).await.expect("a delivery") {
            Delivery::Batch { records, .. } => {
                assert!(records.iter().all(|r| r.tag.is_none()));
                let got: Vec<_> = records.into_iter().map(|r| r.payload).collect();
                assert_eq!(got, bytes(&["e", "d"]));
            }
            Delivery::Lost(loss) => panic!("a loss: {loss:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_stall_holds_deliveries_back_without_losing_them() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        let mut sub = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        t.stall(true);
        publish(&t, &["a"]).await;
        assert_eq!(t.holding(), 0);
        let before = sub.position();
        let held = tokio::time::timeout(Duration::from_secs(60), batch(&mut sub)).await;
        assert!(held.is_err(), "delivered while stalled");
        // The cancelled read kept what it fetched, and is no longer held;
        // the position is still before it, so a subscription from there
        // would read it again.
        assert_eq!(t.holding(), 0);
        assert_eq!(sub.position(), before, "past a delivery never handed out");
        let reading = tokio::spawn(async move { (batch(&mut sub).await, sub) });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(t.holding(), 1, "the reader is parked in the stall");
        t.stall(false);
        let (got, sub) = reading.await.expect("joins");
        assert_eq!(got, bytes(&["a"]));
        assert_ne!(sub.position(), before, "past the delivery once handed out");
        assert_eq!(t.holding(), 0);
        // A restarted process's client under the same switches.
        let again = t.sharing(t.inner());
        again.fail_publishes(1);
        assert!(t.publish("t", "c", Bytes::from_static(b"x")).await.is_err());
    }

    #[tokio::test]
    async fn the_next_subscription_breaks_after_its_batches_and_history_can_be_refused() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        t.break_next_subscription_after(1);
        let mut first = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        let mut second = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        publish(&t, &["a"]).await;
        assert_eq!(batch(&mut first).await, bytes(&["a"]));
        assert!(first.next(100).await.is_err_and(|e| e.is_disconnected()));
        assert_eq!(
            batch(&mut second).await,
            bytes(&["a"]),
            "only the next one breaks"
        );
        assert_eq!(t.subscriptions(), 2);
        t.refuse_history(true);
        let refused = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
            .await;
        assert!(refused.is_err_and(|e| e.is_unsupported()));
        assert!(
            t.subscribe("t", SubscribeOptions::new(StartFrom::Latest))
                .await
                .is_ok()
        );
    }

    // Paused time: the clock moves only once every task waits, so by the
    // end of the sleep the publish has run into the hang and waited a
    // minute in it.
    #[tokio::test(start_paused = true)]
    async fn hung_publishes_wait_until_released() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        t.hang_publishes(true);
        let publishing = {
            let t = t.clone();
            tokio::spawn(async move { t.publish("t", "c", Bytes::from_static(b"x")).await })
        };
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(t.publishes(), 0);
        assert!(!publishing.is_finished());
        t.hang_publishes(false);
        publishing.await.expect("joins").expect("published");
        assert_eq!(t.publishes(), 1);
    }

    #[tokio::test]
    async fn a_broker_goes_down_after_some_publishes_and_publishes_can_be_lost() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        let mut sub = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        t.record_publishes(true);
        t.fail_publishes_after(2, usize::MAX);
        for p in ["a", "b"] {
            t.publish("t", "c", Bytes::from_static(p.as_bytes()))
                .await
                .expect("before it goes down");
        }
        for _ in 0..5 {
            let e = t.publish("t", "c", Bytes::from_static(b"x")).await;
            assert!(e.is_err_and(|e| e.is_disconnected()), "down");
        }
        t.fail_publishes(0);
        t.lose_publishes(1);
        let lost = t.publish("t", "c", Bytes::from_static(b"lost")).await;
        assert_eq!(lost.expect("reported done"), None);
        t.publish("t", "d", Bytes::from_static(b"up"))
            .await
            .expect("up again");
        assert_eq!(t.publishes(), 3, "neither failed nor lost ones counted");
        assert_eq!(batch(&mut sub).await, bytes(&["a", "b", "up"]));
        assert_eq!(
            t.published(),
            [("c", "a"), ("c", "b"), ("d", "up")]
                .map(|(tag, p)| (tag.to_owned(), Bytes::from_static(p.as_bytes())))
        );
        t.record_publishes(false);
        t.publish("t", "c", Bytes::from_static(b"unrecorded"))
            .await
            .expect("publish");
        assert_eq!(t.published().len(), 3, "recorded only while on");
    }

    // Paused time, as in `hung_publishes_wait_until_released`: a publish
    // that has not moved after a minute waits in its hang.
    #[tokio::test(start_paused = true)]
    async fn only_picked_publishes_hang_before_or_after_the_broker() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        let mut sub = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        let spawn = |tag: &'static str, p: &'static str| {
            let t = t.clone();
            tokio::spawn(async move { t.publish("t", tag, Bytes::from_static(p.as_bytes())).await })
        };
        t.hang_publishes_where(|tag, _| tag == "slow");
        let slow = spawn("slow", "s");
        t.publish("t", "fast", Bytes::from_static(b"f"))
            .await
            .expect("not picked: goes on");
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!slow.is_finished());
        assert_eq!((t.hanging(), t.publishes()), (1, 1), "before the broker");
        // After the broker: the record is delivered, the publish waits.
        t.hang_after_broker_where(|_, payload| payload == b"late");
        let late = spawn("fast", "late");
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!late.is_finished());
        assert_eq!((t.hanging(), t.publishes()), (2, 2));
        assert_eq!(batch(&mut sub).await, bytes(&["f", "late"]));
        t.hang_publishes(false);
        slow.await.expect("joins").expect("published");
        late.await.expect("joins").expect("published");
        assert_eq!((t.hanging(), t.publishes()), (0, 3));
        assert_eq!(batch(&mut sub).await, bytes(&["s"]));
        // A cancelled publish is no longer counted as hanging.
        t.hang_publishes(true);
        let cancelled = tokio::time::timeout(
            Duration::from_secs(1),
            t.publish("t", "c", Bytes::from_static(b"x")),
        )
        .await;
        assert!(cancelled.is_err());
        assert_eq!(t.hanging(), 0);
    }

    #[tokio::test]
    async fn subscriptions_fail_while_asked_and_are_counted() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        t.fail_subscriptions(true);
        for _ in 0..2 {
            let e = t
                .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
                .await;
            assert!(e.is_err_and(|e| e.is_disconnected()));
        }
        assert!(
            t.subscribe_heartbeats("t").await.is_ok(),
            "the heartbeat channel is not affected"
        );
        assert_eq!((t.subscriptions(), t.refused_subscriptions()), (0, 2));
        t.fail_subscriptions(false);
        t.refuse_history(true);
        assert!(
            t.subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
                .await
                .is_err_and(|e| e.is_unsupported())
        );
        let mut sub = t
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("up again");
        assert_eq!((t.subscriptions(), t.refused_subscriptions()), (1, 3));
        publish(&t, &["a"]).await;
        assert_eq!(batch(&mut sub).await, bytes(&["a"]));
    }

    #[tokio::test(start_paused = true)]
    async fn heartbeats_are_dropped_or_hung_on_command() {
        let t = FaultyTransport::new(EmbeddedTransport::new());
        let mut heard = t.subscribe_heartbeats("t").await.expect("subscribe");
        let send = |p: &'static str| {
            let t = t.clone();
            async move {
                t.publish_heartbeat("t", Bytes::from_static(p.as_bytes()))
                    .await
                    .expect("reported sent");
            }
        };
        t.drop_heartbeats_where(|payload| payload.starts_with(b"request"));
        send("request 1").await;
        send("beat 1").await;
        assert_eq!(heard.next().await.expect("a message"), "beat 1");
        t.drop_heartbeats(true);
        send("beat 2").await;
        t.drop_heartbeats(false);
        send("request 2").await;
        assert_eq!(heard.next().await.expect("a message"), "request 2");

        t.hang_heartbeats(true);
        let hung = tokio::spawn(send("beat 3"));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!hung.is_finished());
        t.hang_heartbeats(false);
        hung.await.expect("joins");
        assert_eq!(heard.next().await.expect("a message"), "beat 3");

        t.hang_heartbeat_subscriptions(true);
        let subscribing = {
            let t = t.clone();
            tokio::spawn(async move { t.subscribe_heartbeats("t").await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!subscribing.is_finished());
        t.hang_heartbeat_subscriptions(false);
        subscribing.await.expect("joins").expect("subscribed");
    }
}
