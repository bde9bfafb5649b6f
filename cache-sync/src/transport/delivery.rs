//! What a subscription is asked for (where to start, which tags) and what
//! it yields: batches of records, or a loss.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;

use super::{Offset, Position};

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
