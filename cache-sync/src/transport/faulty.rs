//! A transport for tests that injects faults on command, in the spirit of
//! `tower-test`'s mock: wrap any transport, keep a handle, and make the
//! next publishes fail, cut them after the broker took them, hold
//! deliveries back, drop, duplicate or reorder records, break a
//! subscription after some batches, strip tags, or refuse history.
//!
//! Behind the `test-util` feature (and in this crate's own tests). Every
//! fault is off until asked for; a count-down fault (`fail_publishes(3)`)
//! applies to that many calls and then ends by itself.

use std::sync::Arc;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    Delivery, HeartbeatSubscription, Position, StartFrom, SubscribeOptions, Subscription, Transport,
};
use crate::error::{Error, Result};

/// Wraps a transport; clones share the faults, so a test keeps one clone
/// and hands the other to a node or publisher.
///
/// ```
/// # async fn demo() -> cache_sync::Result<()> {
/// use cache_sync::EmbeddedTransport;
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

#[derive(Debug, Default)]
struct Faults {
    fail_publishes: AtomicUsize,
    cut_publishes: AtomicUsize,
    hang_publishes: AtomicBool,
    publishes: AtomicUsize,
    stalled: AtomicBool,
    drop_records: AtomicUsize,
    duplicate_records: AtomicUsize,
    reorder: AtomicBool,
    /// Batches the next subscription delivers before it breaks; 0: none.
    break_next_subscription_after: AtomicUsize,
    strip_tags: AtomicBool,
    refuse_history: AtomicBool,
    subscriptions: AtomicUsize,
    /// Subscriptions holding a delivery back in a stall right now.
    holding: AtomicUsize,
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
    /// dropped connection (`is_disconnected()`).
    pub fn fail_publishes(&self, n: usize) {
        self.faults.fail_publishes.store(n, SeqCst);
    }

    /// The next `n` publishes reach the broker, and then report a dropped
    /// connection: the caller cannot tell them from failed ones.
    pub fn cut_publishes(&self, n: usize) {
        self.faults.cut_publishes.store(n, SeqCst);
    }

    /// While on, publishes wait (before the broker) until it is turned off.
    pub fn hang_publishes(&self, on: bool) {
        self.faults.hang_publishes.store(on, SeqCst);
    }

    /// Change-event publishes that reached the broker so far (heartbeats
    /// and replies not counted).
    pub fn publishes(&self) -> usize {
        self.faults.publishes.load(SeqCst)
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

    /// Change subscriptions made so far.
    pub fn subscriptions(&self) -> usize {
        self.faults.subscriptions.load(SeqCst)
    }

    /// Subscriptions that have fetched a delivery and hold it back in a
    /// stall right now: once this is above 0 after [`stall`](Self::stall),
    /// their reader is parked, and everything published later is behind it.
    pub fn holding(&self) -> usize {
        self.faults.holding.load(SeqCst)
    }
}

fn dropped() -> Error {
    Error::disconnected("faulty", "a fault injected by the test")
}

#[async_trait]
impl Transport for FaultyTransport {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn filters_by_tag(&self) -> bool {
        // Records without tags cannot be filtered by them.
        self.inner.filters_by_tag() && !self.faults.strip_tags.load(SeqCst)
    }

    fn check_topic(&self, topic: &str) -> Result<()> {
        self.inner.check_topic(topic)
    }

    fn check_tag(&self, tag: &str) -> Result<()> {
        self.inner.check_tag(tag)
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        while self.faults.hang_publishes.load(SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if take(&self.faults.fail_publishes) {
            return Err(dropped());
        }
        let published = self.inner.publish(topic, tag, payload).await?;
        self.faults.publishes.fetch_add(1, SeqCst);
        if take(&self.faults.cut_publishes) {
            return Err(dropped());
        }
        Ok(published)
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        if self.faults.refuse_history.load(SeqCst) && !matches!(options.from, StartFrom::Latest) {
            return Err(Error::Unsupported {
                transport: "faulty",
                what: "history",
            });
        }
        let inner = self.inner.subscribe(topic, options).await?;
        self.faults.subscriptions.fetch_add(1, SeqCst);
        let breaks_after = self.faults.break_next_subscription_after.swap(0, SeqCst);
        Ok(Box::new(FaultySubscription {
            inner,
            faults: self.faults.clone(),
            held: None,
            breaks_after: (breaks_after > 0).then_some(breaks_after),
        }))
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        self.inner.publish_heartbeat(topic, payload).await
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        self.inner.subscribe_heartbeats(topic).await
    }

    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        self.inner.publish_reply(topic, to, payload).await
    }

    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        self.inner.subscribe_replies(topic, to).await
    }
}

/// One subscription in [`Faults::holding`], for as long as it lives.
struct Holding<'a>(&'a AtomicUsize);

impl<'a> Holding<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, SeqCst);
        Self(count)
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[derive(Debug)]
struct FaultySubscription {
    inner: Box<dyn Subscription>,
    faults: Arc<Faults>,
    /// A delivery fetched while stalled, held until the stall ends: kept
    /// here so that a dropped `next` loses nothing.
    held: Option<Result<Delivery>>,
    /// Batches left before this subscription breaks, if it is to.
    breaks_after: Option<usize>,
}

#[async_trait]
impl Subscription for FaultySubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if self.breaks_after == Some(0) {
            return Err(dropped());
        }
        if self.held.is_none() {
            self.held = Some(self.inner.next(max).await);
        }
        if self.faults.stalled.load(SeqCst) {
            // Counted while held, uncounted however the wait ends (a
            // cancelled `next` included).
            let _holding = Holding::new(&self.faults.holding);
            while self.faults.stalled.load(SeqCst) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let mut delivery = self.held.take().expect("fetched above")?;
        if let Delivery::Batch { records, .. } = &mut delivery {
            let faults = &self.faults;
            let mut out = Vec::with_capacity(records.len());
            for mut record in records.drain(..) {
                if take(&faults.drop_records) {
                    continue;
                }
                if faults.strip_tags.load(SeqCst) {
                    record.tag = None;
                }
                if take(&faults.duplicate_records) {
                    out.push(record.clone());
                }
                out.push(record);
            }
            if faults.reorder.load(SeqCst) {
                out.reverse();
            }
            *records = out;
            if let Some(left) = &mut self.breaks_after {
                *left = left.saturating_sub(1);
            }
        }
        Ok(delivery)
    }

    fn position(&self) -> Option<Position> {
        self.inner.position()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::embedded::EmbeddedTransport;

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
        let held = tokio::time::timeout(Duration::from_secs(60), batch(&mut sub)).await;
        assert!(held.is_err(), "delivered while stalled");
        // The cancelled read kept what it fetched, and is no longer held.
        assert_eq!(t.holding(), 0);
        let reading = tokio::spawn(async move { batch(&mut sub).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(t.holding(), 1, "the reader is parked in the stall");
        t.stall(false);
        assert_eq!(reading.await.expect("joins"), bytes(&["a"]));
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
}
