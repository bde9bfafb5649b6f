//! Where the faults are injected: the `Transport` impl that consults the
//! switches on each call, and the subscription it wraps deliveries with.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::{Faults, FaultyTransport, PublishFilter, Switch, hang, take};
use crate::error::{Error, Result};
use crate::transport::{
    Delivery, HeartbeatSubscription, PendingPublish, Position, StartFrom, SubscribeOptions,
    Subscription, Transport,
};

/// Whether `switch` is on and picks this publish.
fn picks(switch: &Switch<PublishFilter>, tag: &str, payload: &[u8]) -> bool {
    switch.get().is_some_and(|pick| pick(tag, payload))
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

    /// Always: its faults are split between the two stages, whatever the
    /// transport it wraps does.
    fn pipelines(&self) -> bool {
        true
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        self.start_publish(topic, tag, payload).await?.await
    }

    /// The faults before the broker apply to the hand-over; a hang after
    /// the broker, a cut and a failed acknowledgement to the
    /// acknowledgement, so a test can hold acknowledgements back while
    /// later publishes are handed over.
    async fn start_publish(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<PendingPublish> {
        let faults = &self.faults;
        if picks(&faults.hang_publishes, tag, &payload) {
            hang(&faults.hanging, || faults.hang_publishes.is_on()).await;
        }
        if !take(&faults.pass_publishes) && take(&faults.fail_publishes) {
            return Err(dropped());
        }
        if take(&faults.lose_publishes) {
            return Ok(PendingPublish::ready(Ok(None)));
        }
        if take(&faults.fail_acks) {
            return Ok(PendingPublish::ready(Err(dropped())));
        }
        let hang_after = picks(&faults.hang_after_broker, tag, &payload);
        let recorded = faults.recording.load(SeqCst).then(|| payload.clone());
        let pending = self.inner.start_publish(topic, tag, payload).await?;
        faults.publishes.fetch_add(1, SeqCst);
        if let Some(payload) = recorded {
            faults
                .published
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push((tag.to_owned(), payload));
        }
        let faults = self.faults.clone();
        Ok(PendingPublish::new(async move {
            let published = pending.await?;
            if hang_after {
                hang(&faults.hanging, || faults.hang_after_broker.is_on()).await;
            }
            if take(&faults.cut_publishes) {
                return Err(dropped());
            }
            Ok(published)
        }))
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        if self.faults.fail_subscriptions.load(SeqCst) {
            self.faults.refused_subscriptions.fetch_add(1, SeqCst);
            return Err(dropped());
        }
        if self.faults.refuse_history.load(SeqCst) && !matches!(options.from, StartFrom::Latest) {
            self.faults.refused_subscriptions.fetch_add(1, SeqCst);
            return Err(Error::Unsupported {
                transport: "faulty",
                what: "history",
            });
        }
        let inner = self.inner.subscribe(topic, options).await?;
        self.faults.subscriptions.fetch_add(1, SeqCst);
        let breaks_after = self.faults.break_next_subscription_after.swap(0, SeqCst);
        let handed = inner.position();
        Ok(Box::new(FaultySubscription {
            inner,
            faults: self.faults.clone(),
            held: None,
            handed,
            breaks_after: (breaks_after > 0).then_some(breaks_after),
        }))
    }

    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        self.faults.tails.fetch_add(1, SeqCst);
        while self.faults.hang_tails.load(SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if self.faults.hide_tails.load(SeqCst) {
            return Ok(None);
        }
        self.inner.tail(topic).await
    }

    fn covers(&self, position: &Position, tail: &Position) -> bool {
        self.inner.covers(position, tail)
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        while self.faults.hang_heartbeats.load(SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if let Some(pick) = self.faults.drop_heartbeats.get()
            && pick(&payload)
        {
            return Ok(());
        }
        self.inner.publish_heartbeat(topic, payload).await
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        while self.faults.hang_heartbeat_subscriptions.load(SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
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
pub(super) struct Holding<'a>(&'a AtomicUsize);

impl<'a> Holding<'a> {
    pub(super) fn new(count: &'a AtomicUsize) -> Self {
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
    /// The position after the last delivery handed out: while one is held,
    /// the inner subscription's is past it, and a re-subscription from
    /// there would skip what was never handed out.
    handed: Option<Position>,
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
        self.handed = self.inner.position();
        Ok(delivery)
    }

    fn position(&self) -> Option<Position> {
        if self.held.is_some() {
            return self.handed.clone();
        }
        self.inner.position()
    }
}
