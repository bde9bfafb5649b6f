//! Redis Pub/Sub: the lowest latency, and lossy, so every reconnect is a
//! loss. Classic (`PUBLISH`) on one server, sharded (`SPUBLISH`) on a
//! cluster by default.

use std::collections::VecDeque;
use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use redis::{ProtocolVersion, Value};

use super::super::{
    Delivery, HeartbeatSubscription, Loss, LossReason, Position, Record, StartFrom,
    SubscribeOptions, Subscription, Transport,
};
use super::servers::{Commands, Servers, Target};
use super::{MIN_BACKLOG_BYTES, PUBSUB, check_timeout, key_part, map_err};
use crate::error::{Error, Result};
use crate::util::{check_at_least, deadline_after};

mod sharded;

use sharded::{Settings, ShardHeartbeats, ShardSubscription};

/// `SPUBLISH` on the slot's master only (see `publish_to`). Sent whole with
/// `EVAL`, not by hash: `EVALSHA` meets `NOSCRIPT` on a master that never
/// saw it (a promoted replica), and the `redis` crate then loads the
/// script on every node of the cluster, which fails while one is down,
/// just when a failover happens. It is 49 bytes.
const SPUBLISH: &str = "return redis.call('SPUBLISH', KEYS[1], ARGV[1])";

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
/// always reports a loss first.
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
}

impl fmt::Debug for RedisPubSubTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPubSubTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct PubSubConfig {
    max_backlog_bytes: usize,
    ping_interval: Duration,
    ping_timeout: Duration,
    response_timeout: Duration,
    channel_prefix: String,
    /// `None`: sharded on a cluster, classic on one server.
    sharded: Option<bool>,
}

/// Configures a [`RedisPubSubTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[derive(Debug, Clone)]
pub struct RedisPubSubBuilder {
    target: Target,
    config: PubSubConfig,
}

impl RedisPubSubBuilder {
    /// Most bytes of messages a subscription holds that its node has not
    /// taken yet. Default 32 MiB, Redis's own hard `pubsub` output-buffer
    /// limit.
    ///
    /// The `redis` crate reads Pub/Sub messages off the socket into an
    /// unbounded queue, so a node that applies slower than events arrive
    /// would never trip the server's limit and would grow without bound.
    /// Past this limit the queued messages are dropped and the loss is
    /// signalled as [`LossReason::Overflow`]. At least 64 KiB, or
    /// [`connect`](Self::connect) refuses it: a smaller limit would drop
    /// ordinary events one by one, each as a loss.
    pub fn max_backlog_bytes(mut self, bytes: usize) -> Self {
        self.config.max_backlog_bytes = bytes;
        self
    }

    /// How often an idle subscription PINGs the server. Default 1 s; between
    /// 1 ms and an hour, or [`connect`](Self::connect) refuses it.
    pub fn ping_interval(mut self, every: Duration) -> Self {
        self.config.ping_interval = every;
        self
    }

    /// How long a PING may go unanswered before the link counts as dead.
    /// Default 1 s; between 1 ms and an hour, or [`connect`](Self::connect)
    /// refuses it.
    pub fn ping_timeout(mut self, timeout: Duration) -> Self {
        self.config.ping_timeout = timeout;
        self
    }

    /// How long to wait for a connection or a `PUBLISH` answer. Default 5 s;
    /// between 1 ms and an hour, or [`connect`](Self::connect) refuses it.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.config.response_timeout = timeout;
        self
    }

    /// Prefix of the channel name; the topic follows, in braces (a hash
    /// tag: on a cluster, a topic's channels share one slot). Default
    /// `"cache-sync:"`; no `{` or `}`, or [`connect`](Self::connect)
    /// refuses it.
    pub fn channel_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.channel_prefix = prefix.into();
        self
    }

    /// Sharded Pub/Sub (`SPUBLISH`, `SSUBSCRIBE`; Redis 7) or classic
    /// (`PUBLISH`, `SUBSCRIBE`). Default: sharded on a cluster, classic on
    /// one server. Nodes and publishers of one topic must agree: a sharded
    /// subscriber hears no classic publish, and the other way round.
    pub fn sharded(mut self, sharded: bool) -> Self {
        self.config.sharded = Some(sharded);
        self
    }

    /// Connects; for sharded Pub/Sub, checks that the server is Redis 7 or
    /// later.
    ///
    /// A setting out of its range is refused with [`Error::Config`] before
    /// anything is sent.
    pub async fn connect(self) -> Result<RedisPubSubTransport> {
        self.check()?;
        let servers = Servers::open(&self.target)?;
        let timeout = self.config.response_timeout;
        let publisher = servers.commands(PUBSUB, timeout).await?;
        let sharded = if self.config.sharded.unwrap_or(servers.is_cluster()) {
            servers
                .require_redis_7(PUBSUB, timeout, "sharded Pub/Sub before Redis 7.0")
                .await?;
            Some(Arc::new(servers.with_protocol(ProtocolVersion::RESP3)?))
        } else {
            None
        };
        Ok(RedisPubSubTransport {
            servers: Arc::new(servers),
            sharded,
            publisher,
            config: self.config,
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    pub(super) fn check(&self) -> Result<()> {
        let c = &self.config;
        if c.channel_prefix.contains(['{', '}']) {
            return Err(Error::Config(format!(
                "redis-pubsub channel_prefix {:?}: no `{{` or `}}` (the topic is the channels' hash tag)",
                c.channel_prefix
            )));
        }
        check_at_least(
            "redis-pubsub max_backlog_bytes",
            c.max_backlog_bytes,
            MIN_BACKLOG_BYTES,
        )?;
        check_timeout("redis-pubsub ping_interval", c.ping_interval)?;
        check_timeout("redis-pubsub ping_timeout", c.ping_timeout)?;
        check_timeout("redis-pubsub response_timeout", c.response_timeout)
    }
}

impl RedisPubSubTransport {
    /// Configures a transport for the server at `url` (`redis://127.0.0.1:6379/`),
    /// or for a Redis Cluster when `url` names its seeds as
    /// `redis+cluster://host:port,host:port/` (the same as
    /// [`cluster`](Self::cluster) with each seed as a `redis://` URL; the
    /// form the command-line tool's `--url` takes).
    pub fn builder(url: impl Into<String>) -> RedisPubSubBuilder {
        Self::builder_for(Target::Server(url.into()))
    }

    /// Configures a transport for the Redis Cluster that `seeds` belong to
    /// (`redis://host:port/` each; any of its servers, one is enough, more
    /// are tried in turn while some are down). Sharded Pub/Sub by default.
    pub fn cluster<S: Into<String>>(seeds: impl IntoIterator<Item = S>) -> RedisPubSubBuilder {
        Self::builder_for(Target::Cluster(seeds.into_iter().map(Into::into).collect()))
    }

    fn builder_for(target: Target) -> RedisPubSubBuilder {
        RedisPubSubBuilder {
            target,
            config: PubSubConfig {
                max_backlog_bytes: 32 << 20,
                ping_interval: Duration::from_secs(1),
                ping_timeout: Duration::from_secs(1),
                response_timeout: Duration::from_secs(5),
                channel_prefix: "cache-sync:".into(),
                sharded: None,
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self> {
        Self::builder(url).connect().await
    }

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

    async fn publish_to(&self, channel: String, payload: &[u8]) -> Result<()> {
        let mut conn = self.publisher.clone();
        if self.sharded.is_some() {
            // Through a script, not a bare `SPUBLISH`: a replica of the
            // slot's master takes `SPUBLISH` itself and passes it on over the
            // cluster bus, late, after what others published on the master
            // since (a publisher whose slot map still names the old master,
            // now a replica, would go on publishing there, and its events
            // would arrive out of step with everyone else's). A
            // replica answers a script with `MOVED`, so the publish lands on
            // the master and the client learns the new map.
            redis::cmd("EVAL")
                .arg(SPUBLISH)
                .arg(1)
                .arg(channel)
                .arg(payload)
                .query_async::<i64>(&mut conn)
                .await
        } else {
            redis::cmd("PUBLISH")
                .arg(channel)
                .arg(payload)
                .query_async::<i64>(&mut conn)
                .await
        }
        .map_err(|e| map_err(PUBSUB, e))?;
        Ok(())
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
        }))
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

impl RedisPubSubTransport {
    /// A heartbeat or reply channel's subscription, on a connection of its
    /// own.
    async fn listen_beats(&self, channel: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        if let Some(servers) = &self.sharded {
            let beats = ShardHeartbeats::start(servers, channel, self.shard_settings()).await?;
            return Ok(Box::new(beats));
        }
        let (sink, stream) = self.listen(channel).await?;
        Ok(Box::new(PubSubHeartbeats {
            sink,
            stream,
            ping_interval: self.config.ping_interval,
            ping_timeout: self.config.ping_timeout,
        }))
    }
}

/// A heartbeat subscription on its own pub/sub connection.
struct PubSubHeartbeats {
    sink: redis::aio::PubSubSink,
    stream: redis::aio::PubSubStream,
    ping_interval: Duration,
    ping_timeout: Duration,
}

impl fmt::Debug for PubSubHeartbeats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PubSubHeartbeats").finish_non_exhaustive()
    }
}

#[async_trait]
impl HeartbeatSubscription for PubSubHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            // A quiet link is PINGed: a connection that died without a
            // reset would otherwise wait here for ever, and the caller,
            // never told, would never subscribe again. Heartbeats are few,
            // so a timer per wait costs nothing worth saving.
            match tokio::time::timeout(self.ping_interval, self.stream.next()).await {
                Ok(Some(msg)) => return Ok(Bytes::copy_from_slice(msg.get_payload_bytes())),
                Ok(None) => {
                    return Err(Error::disconnected(
                        PUBSUB,
                        "the heartbeat connection closed",
                    ));
                }
                Err(_) => {
                    match tokio::time::timeout(self.ping_timeout, self.sink.ping::<Value>()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(map_err(PUBSUB, e)),
                        Err(_) => {
                            return Err(Error::disconnected(PUBSUB, "PING went unanswered"));
                        }
                    }
                }
            }
        }
    }
}

struct PubSubSubscription {
    sink: redis::aio::PubSubSink,
    stream: redis::aio::PubSubStream,
    /// Messages taken off the client's queue, not yet delivered.
    backlog: VecDeque<Record>,
    backlog_bytes: usize,
    max_backlog_bytes: usize,
    pending: Option<Loss>,
    /// Fires at the earliest when the link has been quiet for `ping_interval`.
    /// Only moved when it fires (to `heard_at + ping_interval`), not on every
    /// message: re-arming a tokio timer per event takes the timer driver's lock.
    ping: Pin<Box<tokio::time::Sleep>>,
    /// When a message last arrived.
    heard_at: tokio::time::Instant,
    ping_interval: Duration,
    ping_timeout: Duration,
}

impl fmt::Debug for PubSubSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PubSubSubscription").finish_non_exhaustive()
    }
}

/// What a queued record is taken to cost, beyond its payload.
const RECORD_OVERHEAD: usize = 64;

impl PubSubSubscription {
    /// Moves everything the client has queued into the backlog; false if
    /// the connection closed.
    fn drain(&mut self) -> bool {
        while self.backlog_bytes <= self.max_backlog_bytes {
            match futures_util::FutureExt::now_or_never(self.stream.next()) {
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
            position: Position::default(),
        })
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
