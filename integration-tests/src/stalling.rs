//! A transport wrapper for tests: a node that lags while it keeps
//! reporting.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use cache_sync::transport::{
    Delivery, HeartbeatSubscription, Position, SubscribeOptions, Subscription, Transport,
};

/// Holds back every change event from its subscribers while `stalled` is
/// set, and passes heartbeats through: a node that keeps reporting while
/// it falls behind.
#[derive(Debug, Clone)]
pub struct Stalling<T> {
    /// The transport wrapped.
    pub inner: T,
    /// While set, change events are held back.
    pub stalled: Arc<AtomicBool>,
}

#[derive(Debug)]
struct StallingSubscription {
    inner: Box<dyn Subscription>,
    stalled: Arc<AtomicBool>,
    /// A delivery fetched while stalled, held until it is not: kept here
    /// so that a dropped `next` loses nothing.
    held: Option<cache_sync::Result<Delivery>>,
}

#[async_trait]
impl Subscription for StallingSubscription {
    async fn next(&mut self, max: usize) -> cache_sync::Result<Delivery> {
        if self.held.is_none() {
            self.held = Some(self.inner.next(max).await);
        }
        while self.stalled.load(Relaxed) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.held.take().expect("filled above")
    }

    fn position(&self) -> Option<Position> {
        self.inner.position()
    }
}

#[async_trait]
impl<T: Transport> Transport for Stalling<T> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn filters_by_tag(&self) -> bool {
        self.inner.filters_by_tag()
    }

    fn check_topic(&self, topic: &str) -> cache_sync::Result<()> {
        self.inner.check_topic(topic)
    }

    fn check_tag(&self, tag: &str) -> cache_sync::Result<()> {
        self.inner.check_tag(tag)
    }

    async fn publish(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> cache_sync::Result<Option<Position>> {
        self.inner.publish(topic, tag, payload).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> cache_sync::Result<Box<dyn Subscription>> {
        Ok(Box::new(StallingSubscription {
            inner: self.inner.subscribe(topic, options).await?,
            stalled: self.stalled.clone(),
            held: None,
        }))
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> cache_sync::Result<()> {
        self.inner.publish_heartbeat(topic, payload).await
    }

    async fn subscribe_heartbeats(
        &self,
        topic: &str,
    ) -> cache_sync::Result<Box<dyn HeartbeatSubscription>> {
        self.inner.subscribe_heartbeats(topic).await
    }
}
