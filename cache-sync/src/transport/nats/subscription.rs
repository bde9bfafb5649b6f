//! A change subscription: the ordered consumer it reads, with every
//! sequence checked (the consumer skips gaps without a word), the
//! connection watched (a reconnect may lead to another history), and the
//! stream asked after a silence whether the consumer fell behind it.

use std::fmt;
use std::pin::Pin;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use async_trait::async_trait;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;
use tokio::time::Sleep;

use super::super::{Delivery, Loss, LossReason, Offset, Position, Record, Subscription, Tags};
use super::KIND;
use super::link::{Link, link_lost};
use super::naming::{MARKER, TAG_HEADER, created, seq_position};
use crate::error::{Error, Result};
use crate::transport::names;
use crate::util::deadline_after;

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
    /// The topic's stream, asked how far it reaches after a silence.
    pub(super) stream: stream::Stream,
    /// The silence after which the stream is asked: the pull expiry.
    pub(super) silence: Duration,
    /// Fires once nothing was read for `silence`.
    pub(super) quiet: Pin<Box<Sleep>>,
    /// Whether the last silence found the consumer behind the stream; a
    /// second one in a row ends the subscription.
    pub(super) behind: bool,
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

    /// The next message, waiting as long as the stream has none for us.
    async fn wait(&mut self) -> Result<jetstream::Message> {
        if self.quiet.deadline() <= tokio::time::Instant::now() {
            // The silence ran out while nobody waited: the caller was away
            // (a node cancels a wait only to come straight back), and the
            // consumer, not polled meanwhile, says nothing of a stall yet.
            self.rearm();
            self.behind = false;
        }
        loop {
            let message = tokio::select! {
                // First: a message that came after a reconnect may be from
                // another history.
                biased;
                what = link_lost(&mut self.link, self.connects) => {
                    return Err(Error::disconnected(KIND, what));
                }
                m = self.messages.next() => m,
                () = &mut self.quiet => {
                    self.check_not_behind().await?;
                    continue;
                }
            };
            self.rearm();
            self.behind = false;
            return match message {
                Some(Ok(m)) => Ok(m),
                // A missed heartbeat, a deleted consumer: "disconnected"
                // only while the client is.
                Some(Err(e)) if self.link.borrow().up => Err(Error::Transport {
                    transport: KIND,
                    source: Box::new(e),
                }),
                Some(Err(e)) => Err(Error::disconnected(KIND, e)),
                None => Err(Error::disconnected(
                    KIND,
                    "the consumer's message stream ended",
                )),
            };
        }
    }

    fn rearm(&mut self) {
        self.quiet.as_mut().reset(deadline_after(self.silence));
    }

    /// After a silence: whether the stream holds messages the consumer has
    /// not delivered. The ordered consumer recreates itself when its server
    /// goes away, and retries that without end and without a word: with a
    /// stream's leader killed and kept down, a node was seen to wait on it
    /// for good while its stream grew. Behind the stream at two silences in
    /// a row (one could be a message on its way), the subscription ends, so
    /// the node shows it is not consuming and resumes from its position
    /// through a consumer of its own making, or keeps saying why it cannot.
    async fn check_not_behind(&mut self) -> Result<()> {
        let info = self.stream.get_info().await.map_err(|e| Error::Transport {
            transport: KIND,
            source: Box::new(e),
        })?;
        let (last, born) = (info.state.last_sequence, created(&info));
        if born == self.created && last == self.last {
            // A quiet stream.
            self.behind = false;
        } else if self.behind {
            return Err(Error::Transport {
                transport: KIND,
                source: format!(
                    "the consumer delivered nothing for {:?} while the stream went on \
                     (to sequence {last}, read to {}); reading on through a new consumer",
                    self.silence.saturating_mul(2),
                    self.last
                )
                .into(),
            });
        } else {
            self.behind = true;
        }
        self.rearm();
        Ok(())
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
                None if records.is_empty() => self.wait().await?,
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
