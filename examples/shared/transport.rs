//! The transport the multi-process examples talk through, chosen on the
//! command line the way the `cache-sync` command-line tool chooses it:
//! `--transport NAME --url URL`, with the tool's names and default URLs.
//! One file for all of them, so a node and the admin accept the same flags.
//!
//! Each transport is built only with its feature of this package (`redis`,
//! `nats`, `rocketmq`), so one feature is enough; a name whose feature was
//! not built is refused as a usage error that names the feature.

use std::sync::Arc;

use cache_sync::transport::Transport;

// Cargo's `required-features` cannot say "at least one of": the examples
// require `clap`, which every transport feature turns on, and this says
// the rest when `clap` is turned on by itself.
#[cfg(not(any(feature = "redis", feature = "nats", feature = "rocketmq")))]
compile_error!(
    "this example needs a transport: build it with `--features redis`, `nats` or `rocketmq`"
);

/// Every transport: its name (the command-line tool's, which is also the
/// `transport` a node reports in its status) and the feature that builds it.
const ALL: [(&str, &str); 4] = [
    ("redis-streams", "redis"),
    ("redis-pubsub", "redis"),
    ("nats-jetstream", "nats"),
    ("rocketmq", "rocketmq"),
];

/// A transport this build can connect to: only those of the features built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    #[cfg(feature = "redis")]
    RedisStreams,
    #[cfg(feature = "redis")]
    RedisPubSub,
    #[cfg(feature = "nats")]
    NatsJetStream,
    #[cfg(feature = "rocketmq")]
    RocketMq,
}

/// The transport flags, flattened into each example's arguments.
#[derive(Debug, clap::Args)]
#[group(skip)]
pub(crate) struct TransportArgs {
    #[arg(long, value_name = "NAME", value_parser = parse, help = help())]
    #[arg(help_heading = HEADING)]
    pub(crate) transport: Kind,
    /// The broker: a URL such as redis://127.0.0.1:6379/ or
    /// nats://127.0.0.1:4222, or a RocketMQ name server such as
    /// 127.0.0.1:9876. Default: the transport's usual port on 127.0.0.1
    #[arg(long, value_name = "URL", verbatim_doc_comment)]
    #[arg(help_heading = HEADING)]
    url: Option<String>,
}

/// Where the transport flags show in `--help`.
const HEADING: &str = "Transport (give the admin and every node the same)";

fn built() -> Vec<&'static str> {
    ALL.iter()
        .map(|(name, _)| *name)
        .filter(|name| kind(name).is_some())
        .collect()
}

fn help() -> String {
    format!(
        "The transport: redis-streams or redis-pubsub (feature redis),\n\
         nats-jetstream (feature nats) or rocketmq (feature rocketmq).\n\
         Built into this example: {}",
        built().join(", ")
    )
}

fn kind(name: &str) -> Option<Kind> {
    match name {
        #[cfg(feature = "redis")]
        "redis-streams" => Some(Kind::RedisStreams),
        #[cfg(feature = "redis")]
        "redis-pubsub" => Some(Kind::RedisPubSub),
        #[cfg(feature = "nats")]
        "nats-jetstream" => Some(Kind::NatsJetStream),
        #[cfg(feature = "rocketmq")]
        "rocketmq" => Some(Kind::RocketMq),
        _ => None,
    }
}

/// The `value_parser` of `--transport`.
fn parse(arg: &str) -> Result<Kind, String> {
    if arg == "embedded" {
        return Err(
            "the embedded transport lives inside one process: nodes on it \
                    cannot be reached from another one. Use a broker's transport"
                .into(),
        );
    }
    if let Some(kind) = kind(arg) {
        return Ok(kind);
    }
    let built = built().join(", ");
    match ALL.iter().find(|(name, _)| *name == arg) {
        Some((name, feature)) => Err(format!(
            "{name} is not built into this example (built: {built}); \
             run it with `--features {feature}`"
        )),
        None => Err(format!("unknown transport (built: {built})")),
    }
}

impl TransportArgs {
    /// Whether it is Redis Pub/Sub, which keeps no history.
    #[allow(dead_code)] // Only the node asks.
    pub(crate) fn is_pubsub(&self) -> bool {
        match self.transport {
            #[cfg(feature = "redis")]
            Kind::RedisPubSub => true,
            _ => false,
        }
    }

    pub(crate) async fn connect(&self) -> cache_sync::Result<Arc<dyn Transport>> {
        let url = self.url.as_deref().unwrap_or(match self.transport {
            #[cfg(feature = "redis")]
            Kind::RedisStreams | Kind::RedisPubSub => "redis://127.0.0.1:6379/",
            #[cfg(feature = "nats")]
            Kind::NatsJetStream => "nats://127.0.0.1:4222",
            #[cfg(feature = "rocketmq")]
            Kind::RocketMq => "127.0.0.1:9876",
        });
        Ok(match self.transport {
            #[cfg(feature = "redis")]
            Kind::RedisStreams => {
                Arc::new(cache_sync::transport::RedisStreamsTransport::connect(url).await?)
            }
            #[cfg(feature = "redis")]
            Kind::RedisPubSub => {
                Arc::new(cache_sync::transport::RedisPubSubTransport::connect(url).await?)
            }
            #[cfg(feature = "nats")]
            Kind::NatsJetStream => {
                Arc::new(cache_sync::transport::NatsJetStreamTransport::connect(url).await?)
            }
            #[cfg(feature = "rocketmq")]
            Kind::RocketMq => {
                Arc::new(cache_sync::transport::RocketMqTransport::connect(url).await?)
            }
        })
    }
}
