//! A classic change subscription: the client's queue drained into a backlog
//! bounded in bytes (an overflow is a loss), and a quiet link PINGed.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use redis::Value;

use super::{RECORD_OVERHEAD, Tails};
use crate::error::{Error, Result};
use crate::transport::redis::{PUBSUB, map_err};
use crate::transport::{Delivery, Loss, LossReason, Position, Record, Subscription};
use crate::util::deadline_after;

/// Messages a drain moves at most per call.
const DRAIN_AT_ONCE: usize = 4096;

pub(super) struct PubSubSubscription {
    pub(super) sink: redis::aio::PubSubSink,
    pub(super) stream: redis::aio::PubSubStream,
    /// Messages taken off the client's queue, not yet delivered.
    pub(super) backlog: VecDeque<Record>,
    pub(super) backlog_bytes: usize,
    pub(super) max_backlog_bytes: usize,
    pub(super) pending: Option<Loss>,
    /// Fires at the earliest when the link has been quiet for `ping_interval`.
    /// Only moved when it fires (to `heard_at + ping_interval`), not on every
    /// message: re-arming a tokio timer per event takes the timer driver's lock.
    pub(super) ping: Pin<Box<tokio::time::Sleep>>,
    /// When a message last arrived.
    pub(super) heard_at: tokio::time::Instant,
    pub(super) ping_interval: Duration,
    pub(super) ping_timeout: Duration,
    /// This client's freshness requests (see `Tails`).
    pub(super) tails: Arc<Tails>,
    pub(super) asked: tokio::sync::watch::Receiver<u64>,
    /// False once the transport is gone: no more requests come.
    pub(super) asking: bool,
    /// A request answered by a PONG: its number, and how many messages,
    /// queued before the PONG, are still to be delivered before it is
    /// reached.
    pub(super) proving: Option<(u64, usize)>,
}

impl fmt::Debug for PubSubSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PubSubSubscription").finish_non_exhaustive()
    }
}

impl PubSubSubscription {
    /// Moves everything the client has queued into the backlog; false if
    /// the connection closed.
    fn drain(&mut self) -> bool {
        // At most this many per call: a burst of small messages moved in
        // one poll would hold the application's worker for milliseconds.
        let mut left = DRAIN_AT_ONCE;
        while self.backlog_bytes <= self.max_backlog_bytes && left > 0 {
            left = left.saturating_sub(1);
            // Unconstrained: tokio's cooperative budget would answer
            // `Pending` with messages still queued once the task had polled
            // 128 things, and a request answered then would count too few
            // messages before its PONG.
            let next = tokio::task::unconstrained(self.stream.next());
            match futures_util::FutureExt::now_or_never(next) {
                Some(Some(msg)) => self.push(&msg),
                Some(None) => return false,
                None => break,
            }
        }
        true
    }

    fn push(&mut self, msg: &redis::Msg) {
        let record = record(msg);
        self.backlog_bytes = self
            .backlog_bytes
            .saturating_add(record.payload.len().saturating_add(RECORD_OVERHEAD));
        self.backlog.push_back(record);
    }

    fn take(&mut self, max: usize) -> Result<Delivery> {
        if self.backlog_bytes > self.max_backlog_bytes {
            let missed = self.backlog.len() as u64;
            tracing::warn!(
                messages = missed,
                bytes = self.backlog_bytes,
                limit = self.max_backlog_bytes,
                "Pub/Sub backlog over its limit; dropping it"
            );
            self.backlog.clear();
            self.backlog_bytes = 0;
            // What the request waited for is answered by this loss: the
            // next delivery reaches it.
            if let Some((_, left)) = &mut self.proving {
                *left = 0;
            }
            return Ok(Delivery::Lost(Loss::new(
                LossReason::Overflow,
                Some(missed),
                None,
            )));
        }
        let n = max.max(1).min(self.backlog.len());
        let records: Vec<Record> = self.backlog.drain(..n).collect();
        let taken = records.iter().fold(0usize, |sum, r| {
            sum.saturating_add(r.payload.len().saturating_add(RECORD_OVERHEAD))
        });
        self.backlog_bytes = self.backlog_bytes.saturating_sub(taken);
        Ok(Delivery::Batch {
            records,
            position: self.reached(n),
        })
    }

    /// The position of a delivery of `n` messages: a request's, once every
    /// message queued before its PONG is delivered; else none.
    fn reached(&mut self, n: usize) -> Position {
        match &mut self.proving {
            Some((asked, left)) => {
                *left = left.saturating_sub(n);
                if *left > 0 {
                    return Position::default();
                }
                let p = self.tails.position(*asked);
                self.proving = None;
                p
            }
            None => Position::default(),
        }
    }

    /// Answers the latest freshness request: a PING on this connection,
    /// then everything queued before its PONG.
    async fn answer(&mut self) -> Result<()> {
        let asked = *self.asked.borrow_and_update();
        match tokio::time::timeout(self.ping_timeout, self.sink.ping::<Value>()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(map_err(PUBSUB, e)),
            Err(_) => return Err(Error::disconnected(PUBSUB, "PING went unanswered")),
        }
        self.heard_at = tokio::time::Instant::now();
        // The client queued every message read before the PONG before it
        // answered the PING: all of them are counted, a batch at a time
        // with a yield between (a full backlog stops it: the overflow
        // loss answers the request).
        loop {
            let before = self.backlog.len();
            if !self.drain() {
                break;
            }
            if self.backlog.len().saturating_sub(before) < DRAIN_AT_ONCE {
                break;
            }
            tokio::task::yield_now().await;
        }
        self.proving = Some((asked, self.backlog.len()));
        Ok(())
    }
}

#[async_trait]
impl Subscription for PubSubSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if let Some(loss) = self.pending.take() {
            return Ok(Delivery::Lost(loss));
        }
        loop {
            // Everything queued, not just one batch: the size of the client's
            // queue is only known by emptying it.
            let open = self.drain();
            if !self.backlog.is_empty() {
                self.heard_at = tokio::time::Instant::now();
                return self.take(max);
            }
            if self.proving.is_some() {
                // Nothing queued before the PONG: reached at once.
                return Ok(Delivery::Batch {
                    records: Vec::new(),
                    position: self.reached(0),
                });
            }
            if !open {
                return Err(Error::disconnected(
                    PUBSUB,
                    "the subscription connection closed",
                ));
            }
            tokio::select! {
                msg = self.stream.next() => {
                    let Some(msg) = msg else {
                        return Err(Error::disconnected(PUBSUB, "the subscription connection closed"));
                    };
                    self.push(&msg);
                }
                changed = self.asked.changed(), if self.asking => {
                    match changed {
                        Ok(()) => self.answer().await?,
                        Err(_) => self.asking = false,
                    }
                }
                () = self.ping.as_mut() => {
                    let due = self.heard_at.checked_add(self.ping_interval);
                    let now = tokio::time::Instant::now();
                    if let Some(due) = due.filter(|&due| now < due) {
                        self.ping.as_mut().reset(due);
                        continue;
                    }
                    self.ping.as_mut().reset(deadline_after(self.ping_interval));
                    match tokio::time::timeout(self.ping_timeout, self.sink.ping::<Value>()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(map_err(PUBSUB, e)),
                        Err(_) => return Err(Error::disconnected(PUBSUB, "PING went unanswered")),
                    }
                }
            }
        }
    }
}

fn record(msg: &redis::Msg) -> Record {
    Record::new(None, Bytes::copy_from_slice(msg.get_payload_bytes()))
}
