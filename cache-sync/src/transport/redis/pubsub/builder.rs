//! Configuring and connecting a [`RedisPubSubTransport`]: the settings,
//! the checks `connect` makes before any I/O, and, for sharded Pub/Sub,
//! the server version check.

use std::sync::Arc;
use std::time::Duration;

use redis::ProtocolVersion;

use super::RedisPubSubTransport;
use crate::error::{Error, Result};
use crate::transport::redis::servers::{Servers, Target};
use crate::transport::redis::{MIN_BACKLOG_BYTES, PUBSUB, check_timeout};
use crate::util::check_at_least;

#[derive(Debug, Clone)]
pub(super) struct PubSubConfig {
    pub(super) max_backlog_bytes: usize,
    pub(super) ping_interval: Duration,
    pub(super) ping_timeout: Duration,
    pub(super) response_timeout: Duration,
    pub(super) channel_prefix: String,
    /// `None`: sharded on a cluster, classic on one server.
    pub(super) sharded: Option<bool>,
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
    /// signalled as
    /// [`LossReason::Overflow`](crate::transport::LossReason::Overflow). At
    /// least 64 KiB, or [`connect`](Self::connect) refuses it: a smaller
    /// limit would drop ordinary events one by one, each as a loss.
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
            tails: Arc::new(super::Tails::new()),
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    pub(in crate::transport::redis) fn check(&self) -> Result<()> {
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
}
