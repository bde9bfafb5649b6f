//! The transport: a topic that every node reads in full (broadcast).

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;

use crate::error::Result;

/// The topic nodes and publishers use when none is set: a name every
/// transport accepts.
pub(crate) const DEFAULT_TOPIC: &str = "cache-sync";

mod delivery;
pub(crate) mod embedded;
#[cfg(any(test, feature = "test-util"))]
mod faulty;
pub(crate) mod names;
#[cfg(feature = "nats")]
pub(crate) mod nats;
mod offsets;
mod pending;
mod position;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "rocketmq")]
pub(crate) mod rocketmq;

#[cfg(any(feature = "redis", feature = "nats", feature = "rocketmq"))]
pub(crate) use delivery::Tags;
pub use delivery::{Delivery, Loss, LossReason, Record, StartFrom, SubscribeOptions};
pub use embedded::{EmbeddedBuilder, EmbeddedTransport};
#[cfg(any(test, feature = "test-util"))]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use faulty::FaultyTransport;
#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub use nats::{NatsJetStreamBuilder, NatsJetStreamTransport};
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) use offsets::fuzz as fuzz_offsets;
pub use offsets::{FileOffsetStore, MemoryOffsetStore, OffsetStore};
pub use pending::PendingPublish;
pub use position::{Offset, Position};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::{
    RedisPubSubBuilder, RedisPubSubTransport, RedisStreamsBuilder, RedisStreamsTransport,
};
#[cfg(feature = "rocketmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocketmq")))]
pub use rocketmq::{RocketMqBuilder, RocketMqTransport};

/// A transport that carries change events from publishers to every node.
///
/// Every subscriber reads the whole topic (broadcast): there are no consumer
/// groups sharing work.
///
/// # Contract
/// - Within a partition, records arrive in publish order.
/// - A subscription never skips silently. Whenever it cannot guarantee that
///   it delivered everything after the previous batch (history trimmed, a
///   reconnect on a lossy transport, a full local buffer), it yields
///   [`Delivery::Lost`] before the next batch.
/// - A [`Position`] names the history it belongs to (an instance id, an
///   epoch, a creation time), not only an offset into it: subscribing from a
///   position of a history the broker no longer holds yields
///   [`LossReason::HistoryReset`] first, even when the new history's offsets
///   have grown past the stored one.
/// - While the transport cannot reach its broker, `next` fails promptly
///   rather than waiting for it, so the node can report itself unhealthy.
/// - [`Subscription::next`] is cancel-safe: dropping its future loses nothing.
/// - An `Err` from `next` means the subscription is broken. The consumer drops
///   it and subscribes again from the last position it received.
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// A short name for status and logs: `"embedded"`, `"redis-streams"`, ….
    fn kind(&self) -> &'static str;

    /// Whether the transport honours [`SubscribeOptions::tags`]. If it does,
    /// the consumer re-subscribes when caches are registered later.
    fn filters_by_tag(&self) -> bool {
        false
    }

    /// Refuses a topic name this transport cannot map one-to-one onto a
    /// resource of its own, with [`Error::Config`](crate::Error::Config)
    /// naming the rule. Nodes call it when they start and publishers when
    /// they are built, so a bad name fails there, not on the wire.
    ///
    /// The default accepts what every transport must: 1 to 255 bytes of
    /// UTF-8 without control characters. Override it to add limits of the
    /// transport's own, never to accept less than a name that default
    /// allows and the transport can carry.
    fn check_topic(&self, topic: &str) -> Result<()> {
        crate::transport::names::check(crate::transport::names::NameKind::Topic, topic)
    }

    /// Like [`check_topic`](Self::check_topic), for a cache name, which the
    /// transport carries as a record's tag.
    fn check_tag(&self, tag: &str) -> Result<()> {
        crate::transport::names::check(crate::transport::names::NameKind::Cache, tag)
    }

    /// Publishes one encoded event under a tag (the cache name). Returns the
    /// position of the record where the transport knows it.
    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>>;

    /// Whether [`start_publish`](Self::start_publish) can have several
    /// publishes in flight (the transport overrides it). A publisher that
    /// finds it false calls `publish` instead, and saves the boxed future
    /// the default `start_publish` costs on top of it. Default false: a
    /// transport that overrides `start_publish` and not this one is still
    /// correct, one call at a time.
    fn pipelines(&self) -> bool {
        false
    }

    /// Publishes like [`publish`](Self::publish), in two stages, so that a
    /// caller can have several publishes in flight (pipelined) while their
    /// order on the wire stays the order they were handed over.
    ///
    /// - **Hand-over** (this call): once it returns `Ok`, the record's
    ///   place on the topic is fixed before every record handed over later
    ///   on the same topic (by this method or by `publish`, from this
    ///   transport and its clones): they reach the broker after it, or not
    ///   at all. It may wait for room in the transport's queue.
    /// - **Acknowledgement** (the returned future): the broker's answer,
    ///   as `publish` returns it. It completes whether or not it is polled
    ///   meanwhile (the transport drives the call), and dropping it only
    ///   gives up the answer: the record still goes out, or not.
    ///
    /// An `Err` at either stage means what a failed `publish` means: the
    /// record may or may not have reached the broker, so the caller treats
    /// its sequence number as used. After an `Err` from the hand-over the
    /// record is no longer pending anywhere: it never reaches the broker
    /// after a record handed over later. The same holds for a hand-over
    /// future dropped before it completed.
    ///
    /// The default does the whole `publish` in the hand-over and returns an
    /// acknowledgement that is already complete: correct for every
    /// transport, and one call in flight at a time. A transport overrides
    /// it only where its client keeps the order of calls in flight (Redis
    /// pipelining, NATS JetStream's asynchronous acknowledgements), and
    /// then says so in [`pipelines`](Self::pipelines).
    async fn start_publish(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<PendingPublish> {
        let published = self.publish(topic, tag, payload).await?;
        Ok(PendingPublish::ready(Ok(published)))
    }

    /// Starts a subscription. When this returns, every event published
    /// afterwards will be delivered (or a loss signalled).
    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>>;

    /// The topic's tail, asked of the broker now: a position such that a
    /// subscription whose position [covers](Self::covers) it has delivered
    /// every record whose publish was acknowledged before this call began.
    /// What a node's freshness bound is proved with (see
    /// `NodeBuilder::freshness_interval`): one request per node per check,
    /// never a message every node must receive.
    ///
    /// `Ok(None)`, the default: this transport cannot tell, and a node on
    /// it proves no freshness (its `freshness_age_ms` stays unknown).
    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        let _ = topic;
        Ok(None)
    }

    /// Whether a subscription at `position` has delivered everything up to
    /// `tail` (an answer of [`tail`](Self::tail)). The default: every
    /// partition `tail` names is in `position`, at a sequence number at or
    /// past the tail's (an [`Offset::Id`] must be equal: it names a
    /// history, not a place in it).
    fn covers(&self, position: &Position, tail: &Position) -> bool {
        tail.iter()
            .all(|(partition, end)| match (position.get(partition), end) {
                (Some(Offset::Seq(at)), Offset::Seq(end)) => at >= end,
                (Some(Offset::Id(at)), Offset::Id(end)) => at == end,
                _ => false,
            })
    }

    /// Publishes one encoded heartbeat message (a node's heartbeat, or a
    /// request for early heartbeats) on the topic's heartbeat channel.
    ///
    /// The heartbeat channel is a separate resource beside the topic's
    /// change history, never the history itself: heartbeats must not evict
    /// change events from a bounded history, take up sequence or offset
    /// space a node resumes from, or reach a change subscription. It keeps
    /// little or nothing (a short retention at most), and it may drop
    /// messages: a heartbeat's loss only delays the cluster view.
    ///
    /// The default refuses with [`Error::Unsupported`](crate::Error): a
    /// node on such a transport sends no heartbeats and its cluster view
    /// holds only itself.
    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        let _ = (topic, payload);
        Err(crate::Error::Unsupported {
            transport: self.kind(),
            what: "heartbeats",
        })
    }

    /// Subscribes to the topic's heartbeat channel: what is published on it
    /// from now on, and, where the channel keeps a short history, what was
    /// published on it recently.
    ///
    /// The default refuses with [`Error::Unsupported`](crate::Error).
    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        let _ = topic;
        Err(crate::Error::Unsupported {
            transport: self.kind(),
            what: "heartbeats",
        })
    }

    /// Publishes one encoded message on the reply channel of the party `to`
    /// (a random id per party), beside the topic's heartbeat channel: what
    /// nodes answer to an acknowledgement request reaches only the party
    /// that asked, so an acknowledged publish costs the transport one
    /// delivery per node, not one per node and party. Like the heartbeat
    /// channel, it may drop messages (the asker asks again) and keeps little
    /// or nothing; nobody subscribed is no error.
    ///
    /// The default refuses with [`Error::Unsupported`](crate::Error): the
    /// answers then go on the heartbeat channel, where every other party
    /// skips them unread.
    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        let _ = (topic, to, payload);
        Err(crate::Error::Unsupported {
            transport: self.kind(),
            what: "reply channels",
        })
    }

    /// Subscribes to the reply channel of the party `to`: what is published
    /// on it from now on.
    ///
    /// The default refuses with [`Error::Unsupported`](crate::Error).
    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        let _ = (topic, to);
        Err(crate::Error::Unsupported {
            transport: self.kind(),
            what: "reply channels",
        })
    }
}

/// A live subscription to a topic's heartbeat channel. Unlike a
/// [`Subscription`], it may skip messages without saying so.
#[async_trait]
pub trait HeartbeatSubscription: Send + fmt::Debug {
    /// Waits for the next message. Cancel-safe. An `Err` means the
    /// subscription is broken; the caller subscribes again.
    async fn next(&mut self) -> Result<Bytes>;
}

/// A live subscription to a topic.
#[async_trait]
pub trait Subscription: Send + fmt::Debug {
    /// Waits until at least one record or a loss is available (long poll),
    /// then returns at most `max` records. Cancel-safe.
    async fn next(&mut self, max: usize) -> Result<Delivery>;

    /// Where the subscription stands now, if the transport can tell before
    /// the first batch. Lets the consumer re-subscribe without a gap.
    fn position(&self) -> Option<Position> {
        None
    }
}

#[async_trait]
impl<T: Transport + ?Sized> Transport for std::sync::Arc<T> {
    fn kind(&self) -> &'static str {
        (**self).kind()
    }

    fn filters_by_tag(&self) -> bool {
        (**self).filters_by_tag()
    }

    fn check_topic(&self, topic: &str) -> Result<()> {
        (**self).check_topic(topic)
    }

    fn check_tag(&self, tag: &str) -> Result<()> {
        (**self).check_tag(tag)
    }

    fn pipelines(&self) -> bool {
        (**self).pipelines()
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        (**self).publish(topic, tag, payload).await
    }

    async fn start_publish(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<PendingPublish> {
        (**self).start_publish(topic, tag, payload).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        (**self).subscribe(topic, options).await
    }

    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        (**self).tail(topic).await
    }

    fn covers(&self, position: &Position, tail: &Position) -> bool {
        (**self).covers(position, tail)
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        (**self).publish_heartbeat(topic, payload).await
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        (**self).subscribe_heartbeats(topic).await
    }

    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        (**self).publish_reply(topic, to, payload).await
    }

    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        (**self).subscribe_replies(topic, to).await
    }
}
