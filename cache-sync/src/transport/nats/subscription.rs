//! A change subscription: the ordered consumer it reads, with every
//! sequence checked (the consumer skips gaps without a word) and the
//! connection watched (a reconnect may lead to another history).

use std::fmt;

use async_nats::jetstream::{self, consumer};
use async_trait::async_trait;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;

use super::super::{Delivery, Loss, LossReason, Offset, Position, Record, Subscription, Tags};
use super::KIND;
use super::link::{Link, link_lost};
use super::naming::{MARKER, TAG_HEADER, seq_position};
use crate::error::{Error, Result};
use crate::transport::names;

pub(super) fn after(seq: u64) -> consumer::DeliverPolicy {
    consumer::DeliverPolicy::ByStartSequence {
        start_sequence: seq.saturating_add(1),
    }
}

pub(super) struct NatsSubscription {
    pub(super) messages: consumer::pull::Ordered,
    /// Sequence of the last message read.
    pub(super) last: u64,
    /// The stream's creation time: which history `last` belongs to.
    pub(super) created: u64,
    pub(super) pending: Option<Loss>,
    /// A message read after a gap, delivered once the gap is reported.
    pub(super) stashed: Option<jetstream::Message>,
    /// The client's connection. After a reconnect, the ordered consumer
    /// notices its pull request died only after two missed idle heartbeats
    /// (up to 30 s), and would then carry on in whatever stream now has the
    /// name, so the subscription ends at once instead, and the node
    /// re-subscribes from its position, which checks the history. After a
    /// disconnect it ends too, so the node shows it is not consuming.
    pub(super) link: watch::Receiver<Link>,
    /// Connections made when the subscription began (at least the first).
    pub(super) connects: u64,
    pub(super) tags: Tags,
}

impl fmt::Debug for NatsSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSubscription")
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl NatsSubscription {
    /// The loss to report before message `seq`, if it does not follow `last`.
    fn gap(&self, seq: u64) -> Option<Loss> {
        if self.last.checked_add(1) == Some(seq) {
            return None;
        }
        let resume = Some(seq_position(seq.saturating_sub(1), self.created));
        Some(
            match seq.checked_sub(self.last).and_then(|d| d.checked_sub(1)) {
                Some(missed) => Loss::new(LossReason::Trimmed, Some(missed), resume),
                None => Loss::new(LossReason::HistoryReset, None, resume),
            },
        )
    }

    fn position_at(&self, seq: u64) -> Position {
        seq_position(seq, self.created)
    }
}

#[async_trait]
impl Subscription for NatsSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if let Some(loss) = self.pending.take() {
            return Ok(Delivery::Lost(loss));
        }
        let mut records = Vec::new();
        while records.len() < max.max(1) {
            let message = match self.stashed.take() {
                Some(m) => m,
                None if records.is_empty() => match tokio::select! {
                    // First: a message that came after a reconnect may be
                    // from another history.
                    biased;
                    what = link_lost(&mut self.link, self.connects) => {
                        return Err(Error::disconnected(KIND, what));
                    }
                    m = self.messages.next() => m,
                } {
                    Some(Ok(m)) => m,
                    // A missed heartbeat, a deleted consumer: "disconnected"
                    // only while the client is.
                    Some(Err(e)) if self.link.borrow().up => {
                        return Err(Error::Transport {
                            transport: KIND,
                            source: Box::new(e),
                        });
                    }
                    Some(Err(e)) => {
                        return Err(Error::disconnected(KIND, e));
                    }
                    None => {
                        return Err(Error::disconnected(
                            KIND,
                            "the consumer's message stream ended",
                        ));
                    }
                },
                // Only what is already buffered; an error here surfaces on the
                // next call, and a skipped message would show as a gap.
                None => match self.messages.next().now_or_never() {
                    Some(Some(Ok(m))) => m,
                    _ => break,
                },
            };
            let seq = message
                .info()
                .map_err(|e| Error::Transport {
                    transport: KIND,
                    source: e,
                })?
                .stream_sequence;
            if let Some(loss) = self.gap(seq) {
                self.stashed = Some(message);
                if records.is_empty() {
                    self.last = seq.saturating_sub(1);
                    return Ok(Delivery::Lost(loss));
                }
                // Deliver what came before the gap; the gap is reported next.
                break;
            }
            self.last = seq;
            records.push(record(&message, &mut self.tags).at(Offset::Seq(seq)));
        }
        Ok(Delivery::Batch {
            records,
            position: self.position_at(self.last),
        })
    }

    fn position(&self) -> Option<Position> {
        Some(self.position_at(self.last))
    }
}

fn record(message: &jetstream::Message, tags: &mut Tags) -> Record {
    // A tag no escape produced came from another producer: left out, the
    // consumer routes the event by its header instead.
    let tag = message
        .headers
        .as_ref()
        .and_then(|h| h.get(TAG_HEADER))
        .and_then(|v| names::unescape_with(v.as_str(), MARKER).map(|t| tags.get(&t)));
    Record::new(tag, message.payload.clone())
}
