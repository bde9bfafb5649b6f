//! The RocketMQ broadcast transport (Rust client 1.0): the type, what it
//! guarantees, and its [`Transport`] impl; the parts it is built from live
//! in the files below.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use rocketmq_model::common::topic::{TOPIC_MAX_LENGTH, TopicValidator};

use super::{
    HeartbeatSubscription, Position, StartFrom, SubscribeOptions, Subscription, Transport,
};
use crate::error::{Error, Result};
use crate::transport::names::{self, NameKind};

mod admin;
mod builder;
mod client;
mod error;
mod heartbeat;
mod naming;
mod plan;
mod producer;
mod subscription;
mod tail;
mod watchdog;

use admin::*;
pub use builder::RocketMqBuilder;
use builder::*;
use client::*;
use error::*;
use heartbeat::*;
use naming::*;
use plan::*;
use producer::*;
use subscription::*;
use tail::*;
use watchdog::*;

const KIND: &str = "rocketmq";
/// The client id is `<client_ip>@<instance>` and names the offsets
/// directory; for a broadcasting consumer it is only a label, so it is pinned
/// to keep that path computable.
const CLIENT_IP: &str = "127.0.0.1";
/// Admin calls (topic creation, offsets) that take longer than this fail.
const ADMIN_TIMEOUT_MS: u64 = 3000;
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The RocketMQ transport: one topic with N message queues on the brokers of
/// a name server; every node reads it with its own `BROADCASTING` push
/// consumer (its own group and client instance), so every node gets every
/// message.
///
/// - **Delivery:** every message still on the brokers, per queue in order,
///   to every node. A cache's events all go to one queue (the tag is
///   hashed to pick it), so they arrive in publish order; events of
///   different caches are not ordered with each other. The message tag is
///   the cache name and the brokers filter by it ([`Transport::filters_by_tag`]).
/// - **Back-pressure:** the client's orderly listener hands each batch to a
///   bounded buffer. When the buffer is full the queue is suspended for a
///   moment and the same batch is offered again, so a full buffer slows the
///   node down but loses nothing, and is not signalled as a loss.
/// - **Loss detection:** queue offsets as one node sees them are not
///   contiguous (the broker skips other caches' messages), so gaps in them
///   mean nothing. Instead, a subscription from a stored position compares
///   each queue's offset with the oldest offset the broker still holds and
///   yields [`LossReason::Trimmed`](super::LossReason::Trimmed) first if history is gone (or
///   [`LossReason::HistoryReset`](super::LossReason::HistoryReset) if the position is past the queue's end).
///   Anything else is caught by the node's per-publisher sequence check.
/// - **Start positions:** latest, earliest, a stored position, a timestamp
///   (millisecond precision, resolved per queue by the broker). Every start
///   is turned into an explicit offset per queue, written to the consumer's
///   `offsets.json` before it starts, so the subscription's
///   [`position`](Subscription::position) is known from the beginning.
/// - **Broker restart:** pull requests in flight when a broker dies hang for
///   the client's hard-coded 30 s, and the client's circuit breaker rejects
///   connections for another 30 s. Each subscription therefore watches the
///   brokers over a plain TCP connection; when one went away and accepts
///   connections again, `next` fails so the node re-subscribes from its
///   position with a fresh client instance. The producer is recreated under a
///   new instance name when sends keep failing while the broker is up.
/// - **Freshness:** the tail ([`Transport::tail`]) is every queue's end on
///   every master broker, read once the broker reports its commit-log
///   reader caught up (which leaves a short hand-off inside the broker
///   uncovered: see `docs/design.md`, The freshness bound).
///   A subscription also notes how far its consumer has read past other
///   caches' messages, which the broker filters out, so that a queue whose
///   last message is another cache's is still reached (see
///   `docs/design.md`, The freshness bound).
/// - **Heartbeats** ([`Transport::publish_heartbeat`]) go to a topic of
///   their own, `<escaped topic>%hb`, which no topic escapes to, created
///   like a change topic on first use; never into the change topic, so they
///   take none of its queue offsets and no change subscription gets them,
///   whatever its tags. RocketMQ has no retention per topic: the brokers
///   keep them for their commit-log retention (72 h by default), and a
///   heartbeat subscription, a consumer of its own from the end, reads none
///   of that. A topic within 3 characters of the 127-character limit has no
///   heartbeat topic ([`Error::Unsupported`](crate::Error::Unsupported)).
///
/// # Offsets directory
/// The client keeps each consumer's `offsets.json` under a directory it reads
/// once per process from the environment variable
/// `rocketmq.client.localOffsetStoreDir` (default `$HOME/.rocketmq_offsets`);
/// it has no API to set it, and setting the variable from inside the process
/// needs `unsafe`. The node's own offset store stays the source of truth:
/// every subscription gets a new client instance, seeds its file there, and
/// removes it when it ends.
///
/// # Shutdown
/// The transport owns the client's runtime. [`RocketMqTransport::shutdown`] stops the
/// producer, the client runtime and its tasks, in that order; dropping the
/// last clone does the same on a helper thread.
#[cfg_attr(docsrs, doc(cfg(feature = "rocketmq")))]
#[derive(Clone)]
pub struct RocketMqTransport {
    inner: Arc<dyn Shared>,
}

/// Hides `Inner` behind a trait object: proving the client's types `Send`
/// takes a recursion limit above the default, and a `dyn Shared + Send +
/// Sync` keeps that proof inside this crate.
trait Shared: Send + Sync + 'static {
    fn get(&self) -> &Inner;
}

impl Shared for Inner {
    fn get(&self) -> &Inner {
        self
    }
}

impl fmt::Debug for RocketMqTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RocketMqTransport")
            .field("config", &self.inner.get().config)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for RocketMqTransport {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn filters_by_tag(&self) -> bool {
        true
    }

    fn check_topic(&self, topic: &str) -> Result<()> {
        names::check(NameKind::Topic, topic)?;
        let name = rmq_topic(topic);
        if name.len() > TOPIC_MAX_LENGTH {
            return Err(names::invalid(
                NameKind::Topic,
                topic,
                format_args!(
                    "on RocketMQ a topic, {} characters once escaped, may be at most {TOPIC_MAX_LENGTH}",
                    name.len()
                ),
            ));
        }
        if TopicValidator::is_system_topic(&name) {
            return Err(names::invalid(
                NameKind::Topic,
                topic,
                "it is one of RocketMQ's system topics",
            ));
        }
        Ok(())
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        self.check_tag(tag)?;
        self.send_to(&rmq_topic(topic), &rmq_tag(tag), payload)
            .await
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        self.check_topic(topic)?;
        let topic = &*rmq_topic(topic);
        let expression = match &options.tags {
            // Without spaces: the client hashes untrimmed tags for the broker.
            Some(tags) if !tags.is_empty() => tags
                .iter()
                .map(|t| rmq_tag(t))
                .collect::<Vec<_>>()
                .join("||"),
            _ => "*".to_owned(),
        };
        Ok(Box::new(
            self.open(topic, &options.from, &expression).await?,
        ))
    }

    /// Every queue's end on every master broker of the topic, read once
    /// each broker's commit-log reader has caught up: one request to the
    /// name server and two to each broker.
    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        let topic = rmq_topic(topic).into_owned();
        // On a task of its own: a check that gives up on it drops only the
        // wait, and the request ends on its own (within its timeout) rather
        // than leaving the client mid-request.
        let inner = self.inner.clone();
        let tail = tokio::spawn(async move { inner.get().tail(&topic).await })
            .await
            .map_err(|e| Error::Transport {
                transport: KIND,
                source: format!("the tail request ended abnormally: {e}").into(),
            })??;
        Ok(Some(tail))
    }

    /// Every queue of the tail read up to its end: by the records handed
    /// over, or past them by the consumer where the broker filtered out the
    /// rest (other caches' messages, see `watch_skips`).
    fn covers(&self, position: &Position, tail: &Position) -> bool {
        covered(position, tail) && self.inner.get().vouched(tail)
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        let topic = self.heartbeat_topic(topic)?;
        self.send_to(&topic, HEARTBEAT_TAG, payload).await?;
        Ok(())
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        let topic = self.heartbeat_topic(topic)?;
        // A consumer of its own from the end, as a change subscription from
        // the latest is (which also makes the topic if missing).
        let subscription = self.open(&topic, &StartFrom::Latest, "*").await?;
        Ok(Box::new(RocketMqHeartbeats {
            subscription,
            read: VecDeque::new(),
        }))
    }
}
