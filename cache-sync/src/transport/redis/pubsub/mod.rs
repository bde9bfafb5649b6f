//! Redis Pub/Sub: the lowest latency, and lossy, so every reconnect is a
//! loss. Classic (`PUBLISH`) on one server, sharded (`SPUBLISH`) on a
//! cluster by default.
//! This file holds the transport type, its channel names and subscriber
//! connections, and its [`Transport`] impl; the parts it is built from live
//! in the files below.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use super::super::{
    HeartbeatSubscription, Loss, LossReason, Offset, Position, StartFrom, SubscribeOptions,
    Subscription, Transport,
};
use super::servers::{Commands, Servers};
use super::{PUBSUB, key_part, map_err};
use crate::error::{Error, Result};

mod builder;
mod heartbeat;
mod publish;
mod sharded;
mod subscription;

use builder::PubSubConfig;
pub use builder::RedisPubSubBuilder;
use sharded::{Settings, ShardSubscription};
use subscription::PubSubSubscription;

/// The Redis Pub/Sub transport: one channel per topic, `<prefix>{<topic>}`.
///
/// On one server it uses classic Pub/Sub (`PUBLISH`, `SUBSCRIBE`). On a
/// Redis Cluster ([`cluster`](Self::cluster)) it uses sharded Pub/Sub
/// (`SPUBLISH`, `SSUBSCRIBE`, Redis 7) unless told otherwise
/// ([`RedisPubSubBuilder::sharded`]): the topic is the channel's hash tag,
/// so a topic's channels live on the master that serves its slot, and each
/// event crosses the cluster bus to no other master. Classic `PUBLISH` on a
/// cluster is forwarded to every node of the cluster, whatever listens
/// there. A sharded subscription holds a connection to that master and ends
/// when the master goes (killed, paused past the PING timeout), steps down,
/// or gives the slot away (Redis unsubscribes it); the node then subscribes
/// again on the slot's new master, with the loss signalled.
///
/// The lowest latency, and lossy: Redis keeps nothing for a subscriber that
/// is not connected, and disconnects a subscriber whose output buffer passes
/// `client-output-buffer-limit pubsub` (default 32 MiB hard, or 8 MiB for
/// 60 s), dropping what was queued. So every subscription starts with no
/// history, and any disconnect, re-subscription or unanswered PING is
/// signalled as [`LossReason::Reconnected`]: the node clears its caches, as
/// Redis client-side caching does when its invalidation link drops.
///
/// Start positions: only [`StartFrom::Latest`]; resuming from a position
/// reports a loss first, unless another client saved it (a process before a
/// restart, whose caches are gone): that starts as with no position.
///
/// Heartbeats ([`Transport::publish_heartbeat`]) go to a channel of their
/// own, `<channel>:hb`, which no change subscription listens on; like every
/// Pub/Sub channel it keeps nothing. Each heartbeat subscription has its own
/// connection, PINGed like a change subscription's.
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[derive(Clone)]
pub struct RedisPubSubTransport {
    servers: Arc<Servers>,
    /// The same servers in RESP3, for sharded subscriptions (push messages);
    /// `None` for classic Pub/Sub.
    sharded: Option<Arc<Servers>>,
    publisher: Commands,
    config: PubSubConfig,
    /// Freshness requests, numbered per client (see `tail`).
    tails: Arc<Tails>,
}

/// Freshness requests of classic Pub/Sub on one server. Redis handles one
/// command at a time and writes a message into each subscriber's
/// connection when it takes the `PUBLISH`: a PING sent on the subscription's
/// own connection after a publish was acknowledged is answered after that
/// message. So a tail is a request number, and a subscription answers it by
/// a PING: once the PONG is back and the messages queued before it are
/// delivered, the request is reached. Nothing is kept on the server.
#[derive(Debug)]
pub(super) struct Tails {
    /// This client, so that a position saved by another (a process before a
    /// restart) reaches none of its requests.
    client: u64,
    /// The last request's number; subscriptions watch it.
    asked: tokio::sync::watch::Sender<u64>,
}

impl Tails {
    pub(super) fn new() -> Self {
        use std::hash::{BuildHasher, RandomState};
        Self {
            // Random per client: a process's requests start at 1 again.
            client: RandomState::new().hash_one(std::time::SystemTime::now()),
            asked: tokio::sync::watch::channel(0).0,
        }
    }

    /// Whether `position` holds another client's answer.
    fn is_foreign(&self, position: &Position) -> bool {
        matches!(position.get(CLIENT), Some(c) if *c != Offset::Seq(self.client))
    }

    /// The position that says request `n` of this client is reached.
    pub(super) fn position(&self, n: u64) -> Position {
        let mut p = Position::single(ASKED, Offset::Seq(n));
        p.set(CLIENT, Offset::Seq(self.client));
        p
    }
}

/// The partitions of a Pub/Sub freshness position (see [`Tails`]).
const ASKED: &str = "asked";
const CLIENT: &str = "client";

impl fmt::Debug for RedisPubSubTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPubSubTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A watch on `tails` that counts the request already asked as new: a
/// subscription made after it (a re-subscription) answers it too.
fn asked_from_now(tails: &Tails) -> tokio::sync::watch::Receiver<u64> {
    let mut asked = tails.asked.subscribe();
    asked.mark_changed();
    asked
}

/// What a queued record is taken to cost, beyond its payload: in the
/// backlog of either kind of change subscription.
const RECORD_OVERHEAD: usize = 64;

impl RedisPubSubTransport {
    /// `<prefix>{<topic>}`, `:`, `{`, `}` and `%` in the topic escaped.
    fn channel(&self, topic: &str) -> String {
        format!("{}{{{}}}", self.config.channel_prefix, key_part(topic))
    }

    /// `<channel>:hb`: the escaped topic holds no `:` or `}`, so no topic's
    /// change channel is another's heartbeat channel.
    fn heartbeat_channel(&self, topic: &str) -> String {
        format!("{}:hb", self.channel(topic))
    }

    /// `<channel>:hb:r:<to, 16 hex digits>`: a party's reply channel.
    fn reply_channel(&self, topic: &str, to: u64) -> String {
        format!("{}:r:{to:016x}", self.heartbeat_channel(topic))
    }

    fn shard_settings(&self) -> Settings {
        Settings {
            max_bytes: self.config.max_backlog_bytes,
            ping_interval: self.config.ping_interval,
            ping_timeout: self.config.ping_timeout,
            response_timeout: self.config.response_timeout,
        }
    }

    /// A classic pub/sub connection subscribed to `channel`, each step
    /// bounded by the response timeout.
    async fn listen(
        &self,
        channel: &str,
    ) -> Result<(redis::aio::PubSubSink, redis::aio::PubSubStream)> {
        let connect = self.servers.pubsub(PUBSUB);
        let pubsub = tokio::time::timeout(self.config.response_timeout, connect)
            .await
            .map_err(|_| Error::disconnected(PUBSUB, "connect timed out"))??;
        let (mut sink, stream) = pubsub.split();
        tokio::time::timeout(self.config.response_timeout, sink.subscribe(channel))
            .await
            .map_err(|_| Error::disconnected(PUBSUB, "SUBSCRIBE timed out"))?
            .map_err(|e| map_err(PUBSUB, e))?;
        Ok((sink, stream))
    }
}

#[async_trait]
impl Transport for RedisPubSubTransport {
    fn kind(&self) -> &'static str {
        PUBSUB
    }

    async fn publish(&self, topic: &str, _tag: &str, payload: Bytes) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        self.publish_to(self.channel(topic), &payload).await?;
        Ok(None)
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        let pending = match options.from {
            StartFrom::Latest => None,
            // Saved by another client (a process before a restart): its
            // caches were that process's, and this one's start empty, as
            // after a start with no position.
            StartFrom::Position(p) if self.tails.is_foreign(&p) => None,
            StartFrom::Position(_) => Some(Loss::new(LossReason::Reconnected, None, None)),
            StartFrom::Earliest => {
                return Err(Error::Unsupported {
                    transport: PUBSUB,
                    what: "starting from the earliest event",
                });
            }
            StartFrom::Timestamp(_) => {
                return Err(Error::Unsupported {
                    transport: PUBSUB,
                    what: "starting from a timestamp",
                });
            }
        };
        self.check_topic(topic)?;
        if let Some(servers) = &self.sharded {
            let channel = self.channel(topic);
            let settings = self.shard_settings();
            let sub = ShardSubscription::start(servers, &channel, settings, pending).await?;
            return Ok(Box::new(sub));
        }
        let (sink, stream) = self.listen(&self.channel(topic)).await?;
        Ok(Box::new(PubSubSubscription {
            sink,
            stream,
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            max_backlog_bytes: self.config.max_backlog_bytes,
            pending,
            ping: Box::pin(tokio::time::sleep(self.config.ping_interval)),
            heard_at: tokio::time::Instant::now(),
            ping_interval: self.config.ping_interval,
            ping_timeout: self.config.ping_timeout,
            tails: self.tails.clone(),
            asked: asked_from_now(&self.tails),
            asking: true,
            proving: None,
        }))
    }

    /// On classic Pub/Sub on one server, a request number that the topic's
    /// subscriptions of this client answer by a PING (see `Tails`). `None`
    /// on a cluster: a classic `PUBLISH` reaches other servers' subscribers
    /// over the cluster bus, after its answer, and a sharded subscriber may
    /// be held by a replica that passes messages on late.
    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        if self.sharded.is_some() || self.servers.is_cluster() {
            return Ok(None);
        }
        let mut n = 0;
        self.tails.asked.send_modify(|asked| {
            *asked = asked.saturating_add(1);
            n = *asked;
        });
        Ok(Some(self.tails.position(n)))
    }

    /// A request of this client answered at or past the tail's.
    fn covers(&self, position: &Position, tail: &Position) -> bool {
        crate::transport::position::reached_in_history(position, tail, ASKED, CLIENT)
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_to(self.heartbeat_channel(topic), &payload)
            .await
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        self.check_topic(topic)?;
        self.listen_beats(&self.heartbeat_channel(topic)).await
    }

    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_to(self.reply_channel(topic, to), &payload)
            .await
    }

    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        self.check_topic(topic)?;
        self.listen_beats(&self.reply_channel(topic, to)).await
    }
}
