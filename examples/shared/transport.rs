//! The transport the `node` and `admin` examples talk through, chosen on the
//! command line. One file for both, so that a node and the admin accept the
//! same flags and the same URLs.

use std::sync::Arc;

use cache_sync::transport::Transport;
use cache_sync::{
    NatsJetStreamTransport, RedisPubSubTransport, RedisStreamsTransport, RocketMqTransport,
};

/// The transport part of both examples' `--help`.
pub(crate) const USAGE: &str = "\
transport (exactly one; give the admin and every node the same):
  --redis URL     Redis Streams on a Redis server (7.0 or later), e.g.
                  redis://127.0.0.1:6379/
  --pubsub        with --redis: Redis Pub/Sub instead of Streams. Lowest
                  latency, but Pub/Sub keeps nothing: a node not connected
                  when a change is published never sees it
  --nats URL      NATS JetStream on a NATS server started with JetStream
                  (nats-server -js), e.g. nats://127.0.0.1:4222
  --rocketmq ADDR RocketMQ broadcast consumption; ADDR is the name server,
                  e.g. 127.0.0.1:9876
";

#[derive(Debug)]
pub(crate) enum Choice {
    Redis { url: String, pubsub: bool },
    Nats { url: String },
    RocketMq { namesrv: String },
}

/// Collects the transport flags while the caller parses its own.
#[derive(Debug, Default)]
pub(crate) struct TransportFlags {
    chosen: Option<(String, Choice)>,
    // `--pubsub` may come before `--redis`, so it is checked at the end.
    pubsub: bool,
}

impl TransportFlags {
    /// Takes `flag` if it is a transport flag (`Ok(false)` if not); `value`
    /// yields its value.
    pub(crate) fn take(
        &mut self,
        flag: &str,
        has_inline_value: bool,
        value: impl FnOnce() -> Result<String, String>,
    ) -> Result<bool, String> {
        let transport = match flag {
            "--redis" => Choice::Redis {
                url: url(flag, value()?, "redis://127.0.0.1:6379/")?,
                pubsub: false,
            },
            "--nats" => Choice::Nats {
                url: url(flag, value()?, "nats://127.0.0.1:4222")?,
            },
            "--rocketmq" => {
                let namesrv = value()?;
                // A name server address is host:port, with no scheme.
                if namesrv.contains("://") || !namesrv.contains(':') {
                    return Err(format!(
                        "--rocketmq {namesrv:?} is not an address such as 127.0.0.1:9876"
                    ));
                }
                Choice::RocketMq { namesrv }
            }
            "--pubsub" if !has_inline_value => {
                self.pubsub = true;
                return Ok(true);
            }
            _ => return Ok(false),
        };
        if let Some((earlier, _)) = &self.chosen {
            return Err(format!(
                "{flag} after {earlier}: give exactly one transport"
            ));
        }
        self.chosen = Some((flag.to_owned(), transport));
        Ok(true)
    }

    pub(crate) fn finish(self) -> Result<Choice, String> {
        match self.chosen {
            None => {
                Err("a transport is required: --redis URL, --nats URL or --rocketmq ADDR".into())
            }
            Some((_, Choice::Redis { url, .. })) => Ok(Choice::Redis {
                url,
                pubsub: self.pubsub,
            }),
            Some((flag, _)) if self.pubsub => Err(format!("--pubsub needs --redis, not {flag}")),
            Some((_, transport)) => Ok(transport),
        }
    }
}

/// Catches a forgotten or misplaced value here, as a usage error; the
/// client library checks the rest when connecting.
fn url(flag: &str, url: String, example: &str) -> Result<String, String> {
    if url.contains("://") {
        Ok(url)
    } else {
        Err(format!("{flag} {url:?} is not a URL such as {example}"))
    }
}

impl Choice {
    pub(crate) async fn connect(&self) -> cache_sync::Result<Arc<dyn Transport>> {
        Ok(match self {
            Self::Redis { url, pubsub: false } => {
                Arc::new(RedisStreamsTransport::connect(url.as_str()).await?)
            }
            Self::Redis { url, pubsub: true } => {
                Arc::new(RedisPubSubTransport::connect(url.as_str()).await?)
            }
            Self::Nats { url } => Arc::new(NatsJetStreamTransport::connect(url.as_str()).await?),
            Self::RocketMq { namesrv } => {
                Arc::new(RocketMqTransport::connect(namesrv.as_str()).await?)
            }
        })
    }
}
