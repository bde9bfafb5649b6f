//! The transport the `node` and `admin` examples talk through, chosen on the
//! command line. One file for both, so that a node and the admin accept the
//! same flags and the same URLs.

use std::sync::Arc;

use cache_sync::transport::Transport;
use cache_sync::{
    NatsJetStreamTransport, RedisPubSubTransport, RedisStreamsTransport, RocketMqTransport,
};

/// Where the transport flags show in `--help`.
const HEADING: &str = "Transport (exactly one; give the admin and every node the same)";

/// The transport flags, flattened into both examples' arguments. `--pubsub`
/// is left out of the group: it refines `--redis` rather than being a choice.
#[derive(Debug, clap::Args)]
#[group(skip)]
#[command(group(
    clap::ArgGroup::new("transport")
        .args(["redis", "nats", "rocketmq"])
        .required(true)
        .multiple(false)
))]
pub(crate) struct TransportArgs {
    /// Redis Streams on a Redis server (7.0 or later), e.g.
    /// redis://127.0.0.1:6379/
    #[arg(long, value_name = "URL", value_parser = redis_url)]
    #[arg(help_heading = HEADING, verbatim_doc_comment)]
    redis: Option<String>,
    /// With --redis: Redis Pub/Sub instead of Streams. Lowest
    /// latency, but Pub/Sub keeps nothing: a node not connected
    /// when a change is published never sees it
    // `requires` alone lets `--nats URL --pubsub` through: clap waives a
    // requirement whose flag would conflict with one given.
    #[arg(long, requires = "redis", conflicts_with_all = ["nats", "rocketmq"])]
    #[arg(help_heading = HEADING, verbatim_doc_comment)]
    pub(crate) pubsub: bool,
    /// NATS JetStream on a NATS server started with JetStream
    /// (nats-server -js), e.g. nats://127.0.0.1:4222
    #[arg(long, value_name = "URL", value_parser = nats_url)]
    #[arg(help_heading = HEADING, verbatim_doc_comment)]
    nats: Option<String>,
    /// RocketMQ broadcast consumption; ADDR is the name server,
    /// e.g. 127.0.0.1:9876
    #[arg(long, value_name = "ADDR", value_parser = rocketmq_addr)]
    #[arg(help_heading = HEADING, verbatim_doc_comment)]
    rocketmq: Option<String>,
}

/// Catches a forgotten or misplaced value here, as a usage error; the
/// client library checks the rest when connecting.
fn url(url: &str, example: &str) -> Result<String, String> {
    if url.contains("://") {
        Ok(url.to_owned())
    } else {
        Err(format!("not a URL such as {example}"))
    }
}

fn redis_url(arg: &str) -> Result<String, String> {
    url(arg, "redis://127.0.0.1:6379/")
}

fn nats_url(arg: &str) -> Result<String, String> {
    url(arg, "nats://127.0.0.1:4222")
}

/// A name server address is host:port, with no scheme.
fn rocketmq_addr(arg: &str) -> Result<String, String> {
    if arg.contains("://") || !arg.contains(':') {
        return Err("not an address such as 127.0.0.1:9876".into());
    }
    Ok(arg.to_owned())
}

impl TransportArgs {
    pub(crate) async fn connect(&self) -> cache_sync::Result<Arc<dyn Transport>> {
        Ok(match (&self.redis, &self.nats, &self.rocketmq) {
            (Some(url), ..) if self.pubsub => {
                Arc::new(RedisPubSubTransport::connect(url.as_str()).await?)
            }
            (Some(url), ..) => Arc::new(RedisStreamsTransport::connect(url.as_str()).await?),
            (_, Some(url), _) => Arc::new(NatsJetStreamTransport::connect(url.as_str()).await?),
            (_, _, Some(namesrv)) => Arc::new(RocketMqTransport::connect(namesrv.as_str()).await?),
            (None, None, None) => unreachable!("clap requires one transport"),
        })
    }
}
