//! Sharded Pub/Sub (`SSUBSCRIBE`, Redis 7): a channel lives on the master
//! that serves its slot, and only there.
//!
//! A subscription holds a RESP3 connection of its own to that master, found
//! by following `MOVED` from the seeds. Messages arrive as push messages,
//! which the connection hands to [`Inbox`] as it reads them; the inbox counts
//! their bytes, so a node that applies slower than events arrive drops its
//! queue and reports an overflow instead of growing without bound.
//!
//! The subscription ends, so that the node subscribes again and clears what
//! may be stale, when any of these happen: the connection closes (the master
//! was killed), a PING goes unanswered (the master is paused or cut off), or
//! the server itself unsubscribes the connection. Redis does that when the
//! channel's slot leaves the master: a slot moved to another master, or a
//! failover that turned the master into a replica. The `redis` crate's own
//! cluster connection would resubscribe on its own instead, and the
//! messages published in between would be lost without a word.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, PushInfo, PushKind, Value};
use tokio::sync::Notify;

use super::super::super::{
    Delivery, HeartbeatSubscription, Loss, LossReason, Position, Record, Subscription,
};
use super::super::servers::Servers;
use super::super::{PUBSUB, map_err};
use super::RECORD_OVERHEAD;
use crate::error::{Error, Result};
use crate::util::{deadline_after, lock};

/// What the connection has handed over and the subscriber not yet taken.
#[derive(Default)]
struct Queue {
    records: VecDeque<Record>,
    bytes: usize,
    /// Messages dropped since the subscriber last heard of a drop.
    dropped: u64,
    /// The server confirmed the subscription.
    subscribed: bool,
    /// Why the subscription can no longer be trusted to hear everything.
    ended: Option<&'static str>,
}

/// Push messages of one subscription, bounded in bytes.
pub(super) struct Inbox {
    queue: Mutex<Queue>,
    notify: Notify,
    max_bytes: usize,
}

impl Inbox {
    fn new(max_bytes: usize) -> Arc<Self> {
        Arc::new(Self {
            queue: Mutex::new(Queue::default()),
            notify: Notify::new(),
            max_bytes,
        })
    }

    /// Called by the connection's reader for every push message.
    fn push(&self, info: PushInfo) {
        let mut q = lock(&self.queue);
        match info.kind {
            PushKind::SMessage => {
                let Some(Value::BulkString(payload)) = info.data.into_iter().nth(1) else {
                    return;
                };
                let cost = payload.len().saturating_add(RECORD_OVERHEAD);
                if q.bytes.saturating_add(cost) > self.max_bytes {
                    // Past the bound the whole queue goes, as Redis drops a
                    // subscriber's output buffer: a loss reported once,
                    // then the queue starts again.
                    let n = (q.records.len() as u64).saturating_add(1);
                    q.dropped = q.dropped.saturating_add(n);
                    q.records.clear();
                    q.bytes = 0;
                } else {
                    q.bytes = q.bytes.saturating_add(cost);
                    q.records.push_back(Record::new(None, Bytes::from(payload)));
                }
            }
            PushKind::SSubscribe => q.subscribed = true,
            PushKind::SUnsubscribe => {
                q.ended.get_or_insert(
                    "the server ended the subscription: the channel's slot moved, or its master \
                     stepped down",
                );
            }
            PushKind::Disconnection => {
                q.ended.get_or_insert("the subscription connection closed");
            }
            _ => return,
        }
        drop(q);
        self.notify.notify_one();
    }
}

/// A sharded subscription's connection and inbox.
struct Listener {
    conn: MultiplexedConnection,
    inbox: Arc<Inbox>,
    ping: Pin<Box<tokio::time::Sleep>>,
    ping_interval: Duration,
    ping_timeout: Duration,
}

/// Timeouts and bounds of a sharded subscription.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) max_bytes: usize,
    pub(super) ping_interval: Duration,
    pub(super) ping_timeout: Duration,
    pub(super) response_timeout: Duration,
}

impl Listener {
    /// Subscribes to `channel` on the master that serves its slot.
    async fn start(servers: &Servers, channel: &str, settings: Settings) -> Result<Self> {
        let inbox = Inbox::new(settings.max_bytes);
        let to = Arc::clone(&inbox);
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(settings.response_timeout))
            .set_response_timeout(Some(settings.response_timeout))
            .set_push_sender(move |info: PushInfo| {
                to.push(info);
                Ok::<(), std::convert::Infallible>(())
            });
        let mut conn = servers.connection_for(channel, &config, PUBSUB).await?;
        // Answered by a push message, not a reply: sent without waiting
        // for one, then confirmed through the inbox.
        let mut cmd = redis::cmd("SSUBSCRIBE");
        cmd.arg(channel).set_no_response(true);
        conn.send_packed_command(&cmd)
            .await
            .map_err(|e| map_err(PUBSUB, e))?;
        let confirmed = tokio::time::timeout(settings.response_timeout, async {
            loop {
                let notified = inbox.notify.notified();
                {
                    let q = lock(&inbox.queue);
                    if let Some(why) = q.ended {
                        return Err(Error::disconnected(PUBSUB, why));
                    }
                    if q.subscribed {
                        return Ok(());
                    }
                }
                notified.await;
            }
        })
        .await;
        match confirmed {
            Ok(result) => result?,
            Err(_) => return Err(Error::disconnected(PUBSUB, "SSUBSCRIBE timed out")),
        }
        Ok(Self {
            conn,
            inbox,
            ping: Box::pin(tokio::time::sleep(settings.ping_interval)),
            ping_interval: settings.ping_interval,
            ping_timeout: settings.ping_timeout,
        })
    }

    /// Up to `max` records, a count of dropped ones, or the reason the
    /// subscription ended; waits while there is nothing.
    async fn next(&mut self, max: usize) -> Result<Taken> {
        loop {
            let notified = self.inbox.notify.notified();
            {
                let mut q = lock(&self.inbox.queue);
                if q.dropped > 0 {
                    return Ok(Taken::Dropped(std::mem::take(&mut q.dropped)));
                }
                if !q.records.is_empty() {
                    let n = max.max(1).min(q.records.len());
                    let records: Vec<Record> = q.records.drain(..n).collect();
                    let taken = records.iter().fold(0usize, |sum, r| {
                        sum.saturating_add(r.payload.len().saturating_add(RECORD_OVERHEAD))
                    });
                    q.bytes = q.bytes.saturating_sub(taken);
                    drop(q);
                    // Heard from the server: no PING needed for a while.
                    self.ping.as_mut().reset(deadline_after(self.ping_interval));
                    return Ok(Taken::Records(records));
                }
                if let Some(why) = q.ended {
                    return Err(Error::disconnected(PUBSUB, why));
                }
            }
            tokio::select! {
                () = notified => {}
                () = self.ping.as_mut() => {
                    self.ping.as_mut().reset(deadline_after(self.ping_interval));
                    let cmd = redis::cmd("PING");
                    let ping = cmd.query_async::<Value>(&mut self.conn);
                    match tokio::time::timeout(self.ping_timeout, ping).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(map_err(PUBSUB, e)),
                        Err(_) => return Err(Error::disconnected(PUBSUB, "PING went unanswered")),
                    }
                }
            }
        }
    }
}

enum Taken {
    Records(Vec<Record>),
    Dropped(u64),
}

/// A change subscription on sharded Pub/Sub.
pub(super) struct ShardSubscription {
    listener: Listener,
    pending: Option<Loss>,
}

impl ShardSubscription {
    pub(super) async fn start(
        servers: &Servers,
        channel: &str,
        settings: Settings,
        pending: Option<Loss>,
    ) -> Result<Self> {
        Ok(Self {
            listener: Listener::start(servers, channel, settings).await?,
            pending,
        })
    }
}

impl fmt::Debug for ShardSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardSubscription").finish_non_exhaustive()
    }
}

#[async_trait]
impl Subscription for ShardSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if let Some(loss) = self.pending.take() {
            return Ok(Delivery::Lost(loss));
        }
        match self.listener.next(max).await? {
            Taken::Records(records) => Ok(Delivery::Batch {
                records,
                position: Position::default(),
            }),
            Taken::Dropped(missed) => {
                tracing::warn!(
                    messages = missed,
                    limit = self.listener.inbox.max_bytes,
                    "sharded Pub/Sub backlog over its limit; dropped it"
                );
                Ok(Delivery::Lost(Loss::new(
                    LossReason::Overflow,
                    Some(missed),
                    None,
                )))
            }
        }
    }
}

/// A heartbeat or reply subscription on sharded Pub/Sub.
pub(super) struct ShardHeartbeats {
    listener: Listener,
    ready: VecDeque<Bytes>,
}

impl ShardHeartbeats {
    pub(super) async fn start(
        servers: &Servers,
        channel: &str,
        settings: Settings,
    ) -> Result<Self> {
        Ok(Self {
            listener: Listener::start(servers, channel, settings).await?,
            ready: VecDeque::new(),
        })
    }
}

impl fmt::Debug for ShardHeartbeats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardHeartbeats").finish_non_exhaustive()
    }
}

#[async_trait]
impl HeartbeatSubscription for ShardHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            if let Some(beat) = self.ready.pop_front() {
                return Ok(beat);
            }
            match self.listener.next(64).await? {
                Taken::Records(records) => {
                    self.ready.extend(records.into_iter().map(|r| r.payload))
                }
                // Heartbeats repeat: the next one from each node says the
                // same, and the view expires nodes it stops hearing from.
                Taken::Dropped(missed) => {
                    tracing::warn!(
                        messages = missed,
                        "heartbeat backlog over its limit; dropped it"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8]) -> PushInfo {
        PushInfo {
            kind: PushKind::SMessage,
            data: vec![
                Value::BulkString(b"cache-sync:{t}".to_vec()),
                Value::BulkString(payload.to_vec()),
            ],
        }
    }

    fn push(kind: PushKind) -> PushInfo {
        PushInfo { kind, data: vec![] }
    }

    #[test]
    fn the_inbox_drops_its_queue_past_its_bytes_and_says_how_many() {
        let per = 100 + RECORD_OVERHEAD;
        let inbox = Inbox::new(per * 3);
        for _ in 0..3 {
            inbox.push(message(&[0; 100]));
        }
        assert_eq!(lock(&inbox.queue).records.len(), 3);
        inbox.push(message(&[0; 100]));
        let q = lock(&inbox.queue);
        assert_eq!((q.records.len(), q.bytes, q.dropped), (0, 0, 4));
        drop(q);
        // It starts again after the drop.
        inbox.push(message(b"next"));
        assert_eq!(lock(&inbox.queue).records.len(), 1);
    }

    #[test]
    fn a_server_side_unsubscribe_or_a_closed_connection_ends_the_subscription() {
        for kind in [PushKind::SUnsubscribe, PushKind::Disconnection] {
            let inbox = Inbox::new(1 << 20);
            inbox.push(push(PushKind::SSubscribe));
            assert!(lock(&inbox.queue).subscribed);
            assert!(lock(&inbox.queue).ended.is_none());
            inbox.push(push(kind.clone()));
            assert!(lock(&inbox.queue).ended.is_some(), "{kind:?}");
        }
    }

    #[test]
    fn a_message_without_a_payload_or_of_another_kind_is_ignored() {
        let inbox = Inbox::new(1 << 20);
        inbox.push(PushInfo {
            kind: PushKind::SMessage,
            data: vec![Value::BulkString(b"c".to_vec())],
        });
        inbox.push(push(PushKind::Message));
        let q = lock(&inbox.queue);
        assert!(q.records.is_empty() && q.ended.is_none() && !q.subscribed);
    }
}
