//! The transport: a topic that every node reads in full (broadcast).

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::error::Result;

/// The topic nodes and publishers use when none is set: a name every
/// transport accepts.
pub(crate) const DEFAULT_TOPIC: &str = "cache-sync";

pub(crate) mod embedded;
#[cfg(any(test, feature = "test-util"))]
mod faulty;
pub(crate) mod names;
#[cfg(feature = "nats")]
pub(crate) mod nats;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(feature = "rocketmq")]
pub(crate) mod rocketmq;

mod offsets;

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
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::{
    RedisPubSubBuilder, RedisPubSubTransport, RedisStreamsBuilder, RedisStreamsTransport,
};
#[cfg(feature = "rocketmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rocketmq")))]
pub use rocketmq::{RocketMqBuilder, RocketMqTransport};

/// Where a subscriber stands in a topic: one offset per partition.
///
/// Opaque to applications; meaningful only to the transport that produced it.
/// It serializes to JSON as a map from key to offset, like RocketMQ's
/// `offsets.json`:
///
/// ```json
/// {"broker-a:0": 1042, "broker-a:1": 977}
/// ```
///
/// The keys are the transport's own, and each names the history it belongs
/// to as well as a place in it, so a position from a lost history is caught
/// rather than resumed into: the embedded transport keeps one entry, named
/// after the transport instance (`embedded-<id>`); a Redis
/// stream the last entry id read, its ordinal and the stream's epoch (`id`,
/// `n`, `e`); a NATS stream the last sequence read and the stream's creation
/// time (`seq`, `created`); RocketMQ, per message queue, the *next* offset
/// to read (as in its consumer offsets) and an anchor naming the message
/// before it (`<broker>:<queue>@`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Position(BTreeMap<String, Offset>);

/// One partition's offset: a sequence number, or a transport-specific id such
/// as a Redis stream entry id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(untagged)]
#[non_exhaustive]
pub enum Offset {
    /// A numeric offset or sequence (embedded transport, NATS, RocketMQ).
    Seq(u64),
    /// An opaque id (a Redis stream entry id).
    Id(String),
}

impl Position {
    /// A position in a transport with a single partition.
    pub fn single(partition: impl Into<String>, offset: Offset) -> Self {
        let mut p = Self::default();
        p.set(partition, offset);
        p
    }

    /// Sets one partition's offset.
    pub fn set(&mut self, partition: impl Into<String>, offset: Offset) {
        self.0.insert(partition.into(), offset);
    }

    /// One partition's offset.
    pub fn get(&self, partition: &str) -> Option<&Offset> {
        self.0.get(partition)
    }

    /// Partitions and their offsets, in partition order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Offset)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Has no partition at all (nothing consumed yet).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Takes every partition that `later` names from `later`.
    pub fn advance(&mut self, later: &Position) {
        // In place where the partition exists: this runs for every batch.
        for (k, v) in &later.0 {
            match self.0.get_mut(k) {
                Some(offset) => offset.clone_from(v),
                None => {
                    self.0.insert(k.clone(), v.clone());
                }
            }
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match v {
                Offset::Seq(n) => write!(f, "{k}: {n}")?,
                Offset::Id(s) => write!(f, "{k}: {s}")?,
            }
        }
        f.write_str("}")
    }
}

/// Where a new subscription begins, like RocketMQ's consume-from-where.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartFrom {
    /// Only events published after the subscription is established. The right
    /// choice for a cache that starts empty.
    Latest,
    /// The oldest event the transport still holds.
    Earliest,
    /// Right after a stored position. If the transport no longer holds it, the
    /// subscription first yields [`Delivery::Lost`].
    Position(Position),
    /// The first event published at or after this time, where the transport
    /// keeps timestamps; otherwise [`Error::Unsupported`](crate::Error).
    Timestamp(SystemTime),
}

/// What a subscription is asked for.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct SubscribeOptions {
    /// Where to begin.
    pub from: StartFrom,
    /// Only events with one of these tags (cache names). `None` means all.
    /// A transport may deliver more than asked; the consumer filters again.
    pub tags: Option<Vec<String>>,
}

impl SubscribeOptions {
    /// All tags, from `from`.
    pub fn new(from: StartFrom) -> Self {
        Self { from, tags: None }
    }

    /// Only these tags.
    pub fn with_tags(mut self, tags: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.tags = Some(tags.into_iter().map(Into::into).collect());
        self
    }
}

/// One event as the transport carries it.
///
/// Built once per event per node, so nothing in it should cost an
/// allocation that the transport did not make anyway: the tag is shared,
/// and the offset is a number or an id the transport already holds.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Record {
    /// The tag it was published with: the cache name.
    pub tag: Option<Arc<str>>,
    /// The encoded event. Untrusted.
    pub payload: Bytes,
    /// The record's own offset in its partition, for logs, where the
    /// transport has it at hand. Progress is tracked by the batch's
    /// [`Position`], never by this.
    pub offset: Option<Offset>,
}

impl Record {
    /// A record.
    pub fn new(tag: Option<Arc<str>>, payload: Bytes) -> Self {
        Self {
            tag,
            payload,
            offset: None,
        }
    }

    /// With its offset in its partition.
    #[must_use]
    pub fn at(mut self, offset: Offset) -> Self {
        self.offset = Some(offset);
        self
    }
}

/// The last tag a subscription handed out, reused while the next ones are
/// the same (a topic is usually one or a few caches' events in runs), so
/// a record's tag costs no allocation in the common case.
#[cfg(any(feature = "redis", feature = "nats", feature = "rocketmq"))]
#[derive(Debug, Default)]
pub(crate) struct Tags(Option<Arc<str>>);

#[cfg(any(feature = "redis", feature = "nats", feature = "rocketmq"))]
impl Tags {
    pub(crate) fn get(&mut self, tag: &str) -> Arc<str> {
        match &self.0 {
            Some(last) if **last == *tag => last.clone(),
            _ => self.0.insert(Arc::from(tag)).clone(),
        }
    }
}

/// What a subscription yields.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Delivery {
    /// Consecutive records, oldest first.
    Batch {
        /// The records, possibly none when everything read was filtered out.
        records: Vec<Record>,
        /// The position after the whole batch, filtered records included.
        position: Position,
    },
    /// The transport knows that events may have been lost between the last
    /// batch and the next one. The consumer invalidates everything.
    Lost(Loss),
}

/// What a transport knows about a loss.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Loss {
    /// Why.
    pub reason: LossReason,
    /// How many events were lost, when the transport can tell.
    pub missed: Option<u64>,
    /// Where the subscription continues.
    pub resume_at: Option<Position>,
}

impl Loss {
    /// A loss.
    pub fn new(reason: LossReason, missed: Option<u64>, resume_at: Option<Position>) -> Self {
        Self {
            reason,
            missed,
            resume_at,
        }
    }
}

/// Why events may have been lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LossReason {
    /// History was trimmed past the subscriber's position (it fell behind, or
    /// the stored position is too old).
    Trimmed,
    /// A reconnect on a transport that does not replay (Pub/Sub).
    Reconnected,
    /// The stored position belongs to a history that no longer exists (the
    /// stream was deleted or the broker lost its data).
    HistoryReset,
    /// The consumer saw a gap in a publisher's sequence numbers.
    PublisherGap,
    /// A local buffer between the transport and the consumer overflowed.
    Overflow,
    /// An event arrived that could not be read (too large, an unknown format,
    /// garbled) and named no cache: neither its transport tag nor its header
    /// said which cache it was for.
    Unreadable,
}

impl LossReason {
    /// A short, stable label for logs and status.
    pub fn label(self) -> &'static str {
        match self {
            LossReason::Trimmed => "trimmed",
            LossReason::Reconnected => "reconnected",
            LossReason::HistoryReset => "history_reset",
            LossReason::PublisherGap => "publisher_gap",
            LossReason::Overflow => "overflow",
            LossReason::Unreadable => "unreadable",
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A publish already handed over to the transport (see
/// [`Transport::start_publish`]): a future that completes with the
/// broker's answer, the record's position where the transport knows it.
pub struct PendingPublish(Pending);

enum Pending {
    /// Answered already: no future to box (`None` once taken).
    Ready(Option<Result<Option<Position>>>),
    Waiting(Pin<Box<dyn Future<Output = Result<Option<Position>>> + Send + 'static>>),
}

impl PendingPublish {
    /// An acknowledgement still to come, from `ack`.
    pub fn new(ack: impl Future<Output = Result<Option<Position>>> + Send + 'static) -> Self {
        Self(Pending::Waiting(Box::pin(ack)))
    }

    /// An acknowledgement already in: what a transport that cannot
    /// pipeline returns once its whole publish is done.
    pub fn ready(published: Result<Option<Position>>) -> Self {
        Self(Pending::Ready(Some(published)))
    }
}

impl Future for PendingPublish {
    type Output = Result<Option<Position>>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match &mut self.get_mut().0 {
            Pending::Ready(published) => std::task::Poll::Ready(
                published
                    .take()
                    .expect("a PendingPublish polled after it completed"),
            ),
            Pending::Waiting(ack) => ack.as_mut().poll(cx),
        }
    }
}

impl fmt::Debug for PendingPublish {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            Pending::Ready(_) => "PendingPublish(ready)",
            Pending::Waiting(_) => "PendingPublish(waiting)",
        })
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_json_is_a_partition_map() {
        let mut p = Position::single("broker-a:0", Offset::Seq(1042));
        p.set("stream", Offset::Id("1700-0".into()));
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"broker-a:0":1042,"stream":"1700-0"}"#);
        assert_eq!(serde_json::from_str::<Position>(&json).unwrap(), p);
        assert_eq!(p.to_string(), "{broker-a:0: 1042, stream: 1700-0}");
    }

    #[test]
    fn advance_takes_only_named_partitions() {
        let mut p = Position::single("q0", Offset::Seq(5));
        p.set("q1", Offset::Seq(9));
        p.advance(&Position::single("q1", Offset::Seq(10)));
        assert_eq!(p.get("q0"), Some(&Offset::Seq(5)));
        assert_eq!(p.get("q1"), Some(&Offset::Seq(10)));
    }
}
