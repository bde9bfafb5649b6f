//! Configuring and connecting a [`RedisStreamsTransport`]: the settings,
//! the checks `connect` makes before any I/O, and the server version check.
//! Apart from the transport itself, which only reads the settings.

use std::sync::Arc;
use std::time::Duration;

use super::RedisStreamsTransport;
use super::pipeline::Pipeline;
use super::state::XADD_SCRIPT;
use crate::error::{Error, Result};
use crate::transport::redis::servers::{Commands, Servers, Target};
use crate::transport::redis::{STREAMS, check_timeout};
use crate::util::check_at_least;

#[derive(Debug, Clone)]
pub(super) struct StreamsConfig {
    pub(super) max_len: usize,
    pub(super) block: Duration,
    pub(super) response_timeout: Duration,
    pub(super) key_prefix: String,
}

/// Configures a [`RedisStreamsTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[derive(Debug, Clone)]
pub struct RedisStreamsBuilder {
    /// One server's URL, or a cluster's seeds.
    target: Target,
    config: StreamsConfig,
}

impl RedisStreamsBuilder {
    /// Approximate number of entries kept per topic (`MAXLEN ~`). Default
    /// 100 000; at least 1, or [`connect`](Self::connect) refuses it.
    pub fn max_len(mut self, n: usize) -> Self {
        self.config.max_len = n;
        self
    }

    /// How long one `XREAD BLOCK` waits before asking again. Default 5 s;
    /// between 1 ms and an hour, or [`connect`](Self::connect) refuses it.
    /// The reader's response timeout is this plus
    /// [`response_timeout`](Self::response_timeout); the `redis` crate's
    /// default of 500 ms would fail every blocking read.
    pub fn block(mut self, block: Duration) -> Self {
        self.config.block = block;
        self
    }

    /// How long to wait for a connection or an answer before treating the
    /// server as unreachable. Default 5 s; between 1 ms and an hour, or
    /// [`connect`](Self::connect) refuses it.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.config.response_timeout = timeout;
        self
    }

    /// Prefix of the stream key; the topic follows, in braces (a hash tag:
    /// every key of a topic is in one slot of a Redis Cluster). Default
    /// `"cache-sync:"`; no `{` or `}`, or [`connect`](Self::connect)
    /// refuses it (the prefix would take the hash tag's place).
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.key_prefix = prefix.into();
        self
    }

    /// Connects and checks the server version.
    ///
    /// A setting out of its range is refused with [`Error::Config`] before
    /// anything is sent.
    pub async fn connect(self) -> Result<RedisStreamsTransport> {
        self.check()?;
        let servers = Servers::open(&self.target)?;
        let timeout = self.config.response_timeout;
        let publisher = servers.commands(STREAMS, timeout).await?;
        servers
            .require_redis_7(STREAMS, timeout, "Redis before 7.0")
            .await?;
        let script = redis::Script::new(XADD_SCRIPT);
        let pipeline = match &publisher {
            Commands::Single(conn) => Some(Arc::new(Pipeline::new(conn.clone(), script.clone()))),
            Commands::Cluster(_) => None,
        };
        Ok(RedisStreamsTransport {
            servers: Arc::new(servers),
            publisher,
            script,
            config: self.config,
            pipeline,
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    pub(in crate::transport::redis) fn check(&self) -> Result<()> {
        let c = &self.config;
        check_at_least("redis-streams max_len", c.max_len, 1)?;
        if c.key_prefix.contains(['{', '}']) {
            return Err(Error::Config(format!(
                "redis-streams key_prefix {:?}: no `{{` or `}}` (the topic is the keys' hash tag)",
                c.key_prefix
            )));
        }
        check_timeout("redis-streams block", c.block)?;
        check_timeout("redis-streams response_timeout", c.response_timeout)
    }
}

impl RedisStreamsTransport {
    /// Configures a transport for the server at `url` (`redis://127.0.0.1:6379/`),
    /// or for a Redis Cluster when `url` names its seeds as
    /// `redis+cluster://host:port,host:port/` (the same as
    /// [`cluster`](Self::cluster) with each seed as a `redis://` URL; the
    /// form the command-line tool's `--url` takes).
    pub fn builder(url: impl Into<String>) -> RedisStreamsBuilder {
        Self::builder_for(Target::Server(url.into()))
    }

    /// Configures a transport for the Redis Cluster that `seeds` belong to
    /// (`redis://host:port/` each; any of its servers, one is enough, more
    /// are tried in turn while some are down). Publishes follow the
    /// cluster's redirects and failovers; each reader reads from the master
    /// that serves its topic's slot, and on a redirect, a failover or a
    /// lost connection ends its subscription, so the node resumes from its
    /// position, checked against the history it finds (see
    /// [`RedisStreamsTransport`]).
    pub fn cluster<S: Into<String>>(seeds: impl IntoIterator<Item = S>) -> RedisStreamsBuilder {
        Self::builder_for(Target::Cluster(seeds.into_iter().map(Into::into).collect()))
    }

    fn builder_for(target: Target) -> RedisStreamsBuilder {
        RedisStreamsBuilder {
            target,
            config: StreamsConfig {
                max_len: 100_000,
                block: Duration::from_secs(5),
                response_timeout: Duration::from_secs(5),
                key_prefix: "cache-sync:".into(),
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self> {
        Self::builder(url).connect().await
    }
}
