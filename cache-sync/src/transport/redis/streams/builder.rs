//! Configuring and connecting a [`RedisStreamsTransport`]: the settings,
//! the checks `connect` makes before any I/O, and the server version check.
//! Apart from the transport itself, which only reads the settings.

use std::time::Duration;

use redis::Client;

use super::RedisStreamsTransport;
use super::state::XADD_SCRIPT;
use crate::error::{Error, Result};
use crate::transport::redis::{STREAMS, check_timeout, map_err, publisher_connection};
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
    url: String,
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

    /// Prefix of the stream key; the topic follows. Default `"cache-sync:"`.
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
        let client = Client::open(self.url.as_str()).map_err(|e| Error::Config(e.to_string()))?;
        let mut publisher =
            publisher_connection(&client, STREAMS, self.config.response_timeout).await?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut publisher)
            .await
            .map_err(|e| map_err(STREAMS, e))?;
        let version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
        if version.is_none_or(|major| major < 7) {
            return Err(Error::Unsupported {
                transport: STREAMS,
                what: "Redis before 7.0",
            });
        }
        Ok(RedisStreamsTransport {
            client,
            publisher,
            script: redis::Script::new(XADD_SCRIPT),
            config: self.config,
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    pub(in crate::transport::redis) fn check(&self) -> Result<()> {
        let c = &self.config;
        check_at_least("redis-streams max_len", c.max_len, 1)?;
        check_timeout("redis-streams block", c.block)?;
        check_timeout("redis-streams response_timeout", c.response_timeout)
    }
}

impl RedisStreamsTransport {
    /// Configures a transport for the server at `url` (`redis://127.0.0.1:6379/`).
    pub fn builder(url: impl Into<String>) -> RedisStreamsBuilder {
        RedisStreamsBuilder {
            url: url.into(),
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
