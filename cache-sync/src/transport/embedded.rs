//! The in-process transport: the default, and the one the demo and most tests use.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{broadcast, watch};

use super::{
    Delivery, HeartbeatSubscription, Loss, LossReason, Offset, Position, Record, StartFrom,
    SubscribeOptions, Subscription, Transport,
};
use crate::error::{Error, Result};
use crate::util::{check_at_least, lock};

const KIND: &str = "embedded";

/// An in-memory broadcast transport for nodes that share one process.
///
/// Each topic is a log with bounded history (by record count and by bytes).
/// Publishing never blocks on subscribers: a subscriber that falls further
/// behind than the history reaches gets [`Delivery::Lost`] with
/// [`LossReason::Trimmed`], and then continues from the oldest record kept.
///
/// Positions carry this transport instance's id, so a position stored by an earlier
/// process (or another transport) is recognised as [`LossReason::HistoryReset`]
/// instead of being misread as an offset into this history.
///
/// Clones share the same topics.
#[derive(Clone, Debug)]
pub struct EmbeddedTransport {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    partition: String,
    max_records: usize,
    max_bytes: usize,
    topics: Mutex<HashMap<String, Arc<Topic>>>,
}

#[derive(Debug)]
struct Topic {
    log: Mutex<Log>,
    /// The end offset, so subscribers can wait for new records.
    end_tx: watch::Sender<u64>,
    /// The heartbeat channel: kept apart from the log, so heartbeats never
    /// trim change history, and keeping nothing (a subscriber that lags
    /// behind its buffer skips ahead; heartbeats may be lost).
    heartbeats: broadcast::Sender<Bytes>,
    /// Reply channels, by the party they are for: made by a subscription,
    /// gone once nobody listens (at the next publish or subscription).
    replies: Mutex<HashMap<u64, broadcast::Sender<Bytes>>>,
}

/// Heartbeat messages buffered per subscriber: some seconds of a large
/// cluster's heartbeats.
const HEARTBEAT_BUFFER: usize = 1024;

#[derive(Debug, Default)]
struct Log {
    /// Offset of `records[0]`.
    first: u64,
    records: VecDeque<Stored>,
    bytes: usize,
    last_ts: Option<SystemTime>,
    /// Timestamp of the newest record trimmed, to tell whether a timestamp
    /// start reaches into history that is gone.
    trimmed_ts: Option<SystemTime>,
}

#[derive(Debug)]
struct Stored {
    ts: SystemTime,
    tag: Arc<str>,
    payload: Bytes,
}

impl Log {
    fn end(&self) -> u64 {
        self.first.saturating_add(self.records.len() as u64)
    }
}

/// Builds an [`EmbeddedTransport`].
#[derive(Debug, Clone)]
pub struct EmbeddedBuilder {
    max_records: usize,
    max_bytes: usize,
}

impl Default for EmbeddedBuilder {
    fn default() -> Self {
        Self {
            max_records: 10_000,
            max_bytes: 64 << 20,
        }
    }
}

impl EmbeddedBuilder {
    /// Records kept per topic for replay and slow subscribers. Default
    /// 10 000; at least 1, or [`build`](Self::build) refuses it.
    pub fn max_records(mut self, n: usize) -> Self {
        self.max_records = n;
        self
    }

    /// Payload bytes kept per topic. Default 64 MiB; at least 1, or
    /// [`build`](Self::build) refuses it. The newest record is kept
    /// whatever its size.
    pub fn max_bytes(mut self, n: usize) -> Self {
        self.max_bytes = n;
        self
    }

    /// The transport, or [`Error::Config`] naming a setting out of its range.
    pub fn build(self) -> Result<EmbeddedTransport> {
        check_at_least("embedded max_records", self.max_records, 1)?;
        check_at_least("embedded max_bytes", self.max_bytes, 1)?;
        Ok(self.build_checked())
    }

    fn build_checked(self) -> EmbeddedTransport {
        // A random instance id: positions from another instance must not alias.
        let id = crate::util::random_u64();
        EmbeddedTransport {
            shared: Arc::new(Shared {
                partition: format!("embedded-{id:016x}"),
                max_records: self.max_records,
                max_bytes: self.max_bytes,
                topics: Mutex::default(),
            }),
        }
    }
}

impl Default for EmbeddedTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl EmbeddedTransport {
    /// A transport with the default history (10 000 records or 64 MiB per topic).
    pub fn new() -> Self {
        // The defaults are in range.
        Self::builder().build_checked()
    }

    /// Configures history bounds.
    pub fn builder() -> EmbeddedBuilder {
        EmbeddedBuilder::default()
    }

    fn topic(&self, name: &str) -> Arc<Topic> {
        let mut topics = lock(&self.shared.topics);
        topics
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(Topic {
                    log: Mutex::default(),
                    end_tx: watch::Sender::new(0),
                    heartbeats: broadcast::Sender::new(HEARTBEAT_BUFFER),
                    replies: Mutex::default(),
                })
            })
            .clone()
    }

    fn position(&self, offset: u64) -> Position {
        Position::single(self.shared.partition.clone(), Offset::Seq(offset))
    }
}

#[async_trait]
impl Transport for EmbeddedTransport {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn filters_by_tag(&self) -> bool {
        true
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        // Every subscriber clones the records it reads. A `Bytes` made from
        // a full `Vec` (a publisher's event is sealed into one of exactly
        // its size) allocates its shared count at its first clone: taken
        // here, that is paid by the publish, once, not by the first reader
        // on its apply path. A payload already shared only gains a reference.
        let shared = payload.clone();
        drop(payload);
        let payload = shared;
        let topic = self.topic(topic);
        let end = {
            let mut log = lock(&topic.log);
            // Timestamps never go backwards, so a timestamp start can bisect.
            let now = SystemTime::now();
            let ts = log.last_ts.map_or(now, |last| last.max(now));
            log.last_ts = Some(ts);
            log.bytes = log.bytes.saturating_add(payload.len());
            // Publishes come in runs to one cache: the newest record's tag,
            // when it is the same name, is shared rather than copied again.
            let tag = match log.records.back() {
                Some(newest) if *newest.tag == *tag => newest.tag.clone(),
                _ => tag.into(),
            };
            log.records.push_back(Stored { ts, tag, payload });
            while log.records.len() > self.shared.max_records
                || (log.bytes > self.shared.max_bytes && log.records.len() > 1)
            {
                if let Some(old) = log.records.pop_front() {
                    log.bytes = log.bytes.saturating_sub(old.payload.len());
                    log.trimmed_ts = Some(old.ts);
                    log.first = log.first.saturating_add(1);
                }
            }
            log.end()
        };
        topic.end_tx.send_replace(end);
        Ok(Some(self.position(end)))
    }

    /// The log's end: the offset the next record will take. In-process,
    /// so every publish that returned is before it.
    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        let topic = self.topic(topic);
        let end = lock(&topic.log).end();
        Ok(Some(self.position(end)))
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        let partition = self.shared.partition.clone();
        let topic = self.topic(topic);
        let mut pending_loss = None;
        let cursor = {
            let log = lock(&topic.log);
            match options.from {
                StartFrom::Latest => log.end(),
                StartFrom::Earliest => log.first,
                StartFrom::Position(p) => match p.get(&partition) {
                    Some(Offset::Seq(n)) if *n <= log.end() => *n,
                    _ => {
                        pending_loss = Some(Loss::new(
                            LossReason::HistoryReset,
                            None,
                            Some(self.position(log.end())),
                        ));
                        log.end()
                    }
                },
                StartFrom::Timestamp(t) => {
                    if log.trimmed_ts.is_some_and(|trimmed| trimmed >= t) {
                        pending_loss = Some(Loss::new(
                            LossReason::Trimmed,
                            None,
                            Some(self.position(log.first)),
                        ));
                    }
                    log.first
                        .saturating_add(log.records.partition_point(|r| r.ts < t) as u64)
                }
            }
        };
        let end_rx = topic.end_tx.subscribe();
        Ok(Box::new(EmbeddedSubscription {
            topic,
            partition,
            cursor,
            pending_loss,
            end_rx,
            tags: options.tags.map(TagFilter::new),
        }))
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        // No subscriber is no error: nobody is watching yet.
        let _ = self.topic(topic).heartbeats.send(payload);
        Ok(())
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        Ok(Box::new(EmbeddedHeartbeats(
            self.topic(topic).heartbeats.subscribe(),
        )))
    }

    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        let topic = self.topic(topic);
        let mut replies = lock(&topic.replies);
        if let Some(channel) = replies.get(&to)
            && channel.send(payload).is_err()
        {
            // Its party stopped listening.
            replies.remove(&to);
        }
        Ok(())
    }

    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        let topic = self.topic(topic);
        let mut replies = lock(&topic.replies);
        // Parties gone without a last reply leave no channel behind.
        replies.retain(|_, channel| channel.receiver_count() > 0);
        let channel = replies
            .entry(to)
            .or_insert_with(|| broadcast::Sender::new(HEARTBEAT_BUFFER));
        Ok(Box::new(EmbeddedHeartbeats(channel.subscribe())))
    }
}

#[derive(Debug)]
struct EmbeddedHeartbeats(broadcast::Receiver<Bytes>);

#[async_trait]
impl HeartbeatSubscription for EmbeddedHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            match self.0.recv().await {
                Ok(payload) => return Ok(payload),
                // Heartbeats may be skipped: the next one says it all again.
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                // The topic holds its sender for as long as the transport lives.
                Err(broadcast::error::RecvError::Closed) => {
                    return Err(Error::Unsupported {
                        transport: KIND,
                        what: "heartbeats after the transport is gone",
                    });
                }
            }
        }
    }
}

/// The tags a subscription asked for, checked once per record: a node
/// usually holds a few caches, and comparing a few names costs less than
/// hashing one.
#[derive(Debug)]
enum TagFilter {
    Few(Vec<String>),
    Many(crate::util::HashSet<String>),
}

impl TagFilter {
    const FEW: usize = 4;

    fn new(tags: Vec<String>) -> Self {
        if tags.len() <= Self::FEW {
            TagFilter::Few(tags)
        } else {
            TagFilter::Many(tags.into_iter().collect())
        }
    }

    fn admits(&self, tag: &str) -> bool {
        match self {
            TagFilter::Few(tags) => tags.iter().any(|t| t == tag),
            TagFilter::Many(tags) => tags.contains(tag),
        }
    }
}

#[derive(Debug)]
struct EmbeddedSubscription {
    topic: Arc<Topic>,
    partition: String,
    cursor: u64,
    pending_loss: Option<Loss>,
    end_rx: watch::Receiver<u64>,
    tags: Option<TagFilter>,
}

impl EmbeddedSubscription {
    fn position_at(&self, offset: u64) -> Position {
        Position::single(self.partition.clone(), Offset::Seq(offset))
    }

    fn poll_log(&mut self, max: usize) -> Option<Delivery> {
        if let Some(loss) = self.pending_loss.take() {
            return Some(Delivery::Lost(loss));
        }
        let log = lock(&self.topic.log);
        if let Some(missed) = log.first.checked_sub(self.cursor).filter(|&m| m > 0) {
            self.cursor = log.first;
            return Some(Delivery::Lost(Loss::new(
                LossReason::Trimmed,
                Some(missed),
                Some(self.position_at(self.cursor)),
            )));
        }
        // Here `first <= cursor`; nothing new unless `cursor < end`.
        let ahead = log.end().checked_sub(self.cursor).filter(|&n| n > 0)?;
        // Scan at most `max` records, matching or not, so a burst for other
        // caches cannot make one call walk the whole history.
        let start = usize::try_from(self.cursor.saturating_sub(log.first)).unwrap_or(usize::MAX);
        let scan = usize::try_from(ahead).unwrap_or(usize::MAX).min(max.max(1));
        let mut records = Vec::with_capacity(scan);
        let mut offset = self.cursor;
        for r in log.records.range(start..).take(max.max(1)) {
            if self.tags.as_ref().is_none_or(|t| t.admits(&r.tag)) {
                records.push(
                    Record::new(Some(r.tag.clone()), r.payload.clone()).at(Offset::Seq(offset)),
                );
            }
            offset = offset.saturating_add(1);
        }
        let scanned = ahead.min(max.max(1) as u64);
        self.cursor = self.cursor.saturating_add(scanned);
        Some(Delivery::Batch {
            records,
            position: self.position_at(self.cursor),
        })
    }
}

#[async_trait]
impl Subscription for EmbeddedSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        loop {
            // Mark the current end as seen *before* looking at the log, so a
            // publish between the look and the wait still wakes us.
            self.end_rx.borrow_and_update();
            if let Some(d) = self.poll_log(max) {
                return Ok(d);
            }
            if self.end_rx.changed().await.is_err() {
                return Err(Error::disconnected(
                    KIND,
                    "the embedded transport was dropped",
                ));
            }
        }
    }

    fn position(&self) -> Option<Position> {
        Some(self.position_at(self.cursor))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn publish_n(transport: &EmbeddedTransport, topic: &str, tag: &str, n: usize) {
        for i in 0..n {
            transport
                .publish(topic, tag, Bytes::from(format!("{tag}-{i}")))
                .await
                .unwrap();
        }
    }

    fn payloads(d: Delivery) -> Vec<String> {
        match d {
            Delivery::Batch { records, .. } => records
                .into_iter()
                .map(|r| String::from_utf8(r.payload.to_vec()).unwrap())
                .collect(),
            Delivery::Lost(l) => panic!("unexpected loss {l:?}"),
        }
    }

    #[tokio::test]
    async fn every_subscriber_gets_every_record_in_order() {
        let transport = EmbeddedTransport::new();
        let mut a = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap();
        let mut b = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap();
        publish_n(&transport, "t", "x", 3).await;
        assert_eq!(payloads(a.next(10).await.unwrap()), ["x-0", "x-1", "x-2"]);
        assert_eq!(payloads(b.next(2).await.unwrap()), ["x-0", "x-1"]);
        assert_eq!(payloads(b.next(2).await.unwrap()), ["x-2"]);
    }

    #[tokio::test]
    async fn next_waits_for_a_publish_and_is_cancel_safe() {
        let transport = EmbeddedTransport::new();
        let mut s = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(20), s.next(10))
                .await
                .is_err()
        );
        let transport2 = transport.clone();
        tokio::spawn(async move { publish_n(&transport2, "t", "x", 1).await });
        assert_eq!(payloads(s.next(10).await.unwrap()), ["x-0"]);
    }

    #[tokio::test]
    async fn falling_behind_history_is_a_loss_never_a_skip() {
        let transport = EmbeddedTransport::builder().max_records(4).build().unwrap();
        let mut s = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap();
        publish_n(&transport, "t", "x", 10).await;
        match s.next(100).await.unwrap() {
            Delivery::Lost(l) => {
                assert_eq!(l.reason, LossReason::Trimmed);
                assert_eq!(l.missed, Some(6));
            }
            d => panic!("expected a loss, got {d:?}"),
        }
        assert_eq!(
            payloads(s.next(100).await.unwrap()),
            ["x-6", "x-7", "x-8", "x-9"]
        );
    }

    #[tokio::test]
    async fn byte_bound_trims_too() {
        let transport = EmbeddedTransport::builder().max_bytes(8).build().unwrap();
        let mut s = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        publish_n(&transport, "t", "x", 3).await; // 3 bytes each
        assert!(matches!(s.next(10).await.unwrap(), Delivery::Lost(_)));
        assert_eq!(payloads(s.next(10).await.unwrap()), ["x-1", "x-2"]);
    }

    #[test]
    fn build_refuses_zero_capacities() {
        for (builder, setting) in [
            (EmbeddedTransport::builder().max_records(0), "max_records"),
            (EmbeddedTransport::builder().max_bytes(0), "max_bytes"),
        ] {
            let e = builder.build().unwrap_err();
            assert!(e.is_config(), "{e:?}");
            assert!(e.to_string().contains(setting), "{e}");
        }
    }

    #[tokio::test]
    async fn the_smallest_capacities_keep_the_newest_record() {
        let transport = EmbeddedTransport::builder()
            .max_records(1)
            .max_bytes(1)
            .build()
            .unwrap();
        let mut s = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        publish_n(&transport, "t", "x", 2).await;
        assert!(matches!(s.next(10).await.unwrap(), Delivery::Lost(_)));
        assert_eq!(payloads(s.next(10).await.unwrap()), ["x-1"]);
    }

    #[tokio::test]
    async fn resumes_from_a_position_and_rejects_foreign_ones() {
        let transport = EmbeddedTransport::new();
        publish_n(&transport, "t", "x", 3).await;
        let mut s = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        let Delivery::Batch { position, .. } = s.next(2).await.unwrap() else {
            panic!()
        };
        let mut resumed = transport
            .subscribe(
                "t",
                SubscribeOptions::new(StartFrom::Position(position.clone())),
            )
            .await
            .unwrap();
        assert_eq!(payloads(resumed.next(10).await.unwrap()), ["x-2"]);

        // The same position read by a different transport (a restarted process).
        let other = EmbeddedTransport::new();
        publish_n(&other, "t", "y", 5).await;
        let mut s = other
            .subscribe("t", SubscribeOptions::new(StartFrom::Position(position)))
            .await
            .unwrap();
        match s.next(10).await.unwrap() {
            Delivery::Lost(l) => assert_eq!(l.reason, LossReason::HistoryReset),
            d => panic!("expected a history reset, got {d:?}"),
        }
    }

    #[tokio::test]
    async fn starts_from_a_timestamp() {
        let transport = EmbeddedTransport::new();
        publish_n(&transport, "t", "x", 2).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let t = SystemTime::now();
        publish_n(&transport, "t", "y", 2).await;
        let mut s = transport
            .subscribe("t", SubscribeOptions::new(StartFrom::Timestamp(t)))
            .await
            .unwrap();
        assert_eq!(payloads(s.next(10).await.unwrap()), ["y-0", "y-1"]);
    }

    #[tokio::test]
    async fn tag_filter_skips_other_caches_but_advances() {
        // A few tags are compared, more are hashed: both ways.
        for extra in [0, TagFilter::FEW] {
            let transport = EmbeddedTransport::new();
            let tags = (0..extra)
                .map(|i| format!("also-{i}"))
                .chain(["keep".into()]);
            let mut s = transport
                .subscribe(
                    "t",
                    SubscribeOptions::new(StartFrom::Latest).with_tags(tags),
                )
                .await
                .unwrap();
            publish_n(&transport, "t", "other", 2).await;
            publish_n(&transport, "t", "keep", 1).await;
            assert_eq!(payloads(s.next(10).await.unwrap()), ["keep-0"]);
        }
    }

    #[tokio::test]
    async fn topics_are_separate() {
        let transport = EmbeddedTransport::new();
        let mut s = transport
            .subscribe("a", SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap();
        publish_n(&transport, "b", "x", 1).await;
        publish_n(&transport, "a", "y", 1).await;
        assert_eq!(payloads(s.next(10).await.unwrap()), ["y-0"]);
    }
}
