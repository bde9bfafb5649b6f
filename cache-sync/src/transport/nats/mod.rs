//! The NATS JetStream transport: the type, what it guarantees, and its
//! [`Transport`] impl; the parts it is built from live in the files below.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use async_nats::jetstream::{self, consumer};
use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;

use super::{
    HeartbeatSubscription, Loss, LossReason, Offset, PendingPublish, Position, StartFrom,
    SubscribeOptions, Subscription, Tags, Transport,
};
use crate::error::{Error, Result};
use crate::transport::names::{self, NameKind};
use crate::util::{deadline_after, lock};

mod builder;
mod error;
mod heartbeat;
mod link;
mod naming;
mod publish;
mod subscription;

use builder::NatsConfig;
pub use builder::NatsJetStreamBuilder;
use link::Link;
use naming::{CREATED, MAX_STREAM_NAME, SEQ, created, seq_position};
use subscription::{NatsSubscription, after};

const KIND: &str = "nats-jetstream";

/// The NATS JetStream transport: one stream per topic with limits-based
/// retention; every node reads it with its own ordered consumer.
///
/// - **Delivery:** every message still in the stream, in order, to every node.
/// - **Retention:** `max_messages` per stream (default 100 000), oldest
///   discarded first.
/// - **Loss detection:** the stream carries only this topic's events, so its
///   sequence numbers are contiguous. The ordered consumer recreates itself
///   across gaps without a word; the subscription checks every sequence
///   instead, and signals a jump as [`LossReason::Trimmed`], a sequence that
///   goes backwards (stream deleted and recreated) as
///   [`LossReason::HistoryReset`], and a stored position below the stream's
///   first sequence as a trim before the first delivery.
/// - **Stalls:** the ordered consumer recreates itself when its server
///   goes, and retries that without end and without a word (seen with a
///   stream's leader killed and kept down: a node heard nothing more while
///   it reported itself consuming). So after a silence of one
///   [`pull_expiry`](NatsJetStreamBuilder::pull_expiry) the subscription
///   asks the stream how far it reaches (one request, besides the pull
///   requests an idle consumer makes anyway); behind it twice in a row, the
///   subscription ends, and the node resumes from its position through a
///   new consumer, or reports itself not consuming while it cannot.
/// - **Start positions:** latest, earliest, a stored sequence, a timestamp.
/// - **Heartbeats** ([`Transport::publish_heartbeat`]) are core NATS
///   messages on `<subject>.hb`, kept nowhere (no JetStream): the topic's
///   stream takes exactly its one subject, and the escaped topic is one
///   token without `.`, so no topic's stream captures another's heartbeats
///   or its own. A heartbeat subscription is a plain core subscription,
///   which the client renews by itself after a reconnect; what was sent
///   while it was away is gone.
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[derive(Clone)]
pub struct NatsJetStreamTransport {
    js: jetstream::Context,
    client: async_nats::Client,
    config: NatsConfig,
    link: Arc<watch::Sender<Link>>,
    /// Topics whose stream this transport has made sure of. Asking the server on
    /// every publish cost a second round trip and doubled the publish time.
    known_streams: Arc<Mutex<HashMap<String, u64>>>,
    /// Held while a message is handed to the client, and the number of the
    /// last one handed over (shared by clones, which share the client):
    /// a retry may go out only if nothing was handed over after the
    /// message it repeats (see `start`).
    handing: Arc<tokio::sync::Mutex<u64>>,
}

impl fmt::Debug for NatsJetStreamTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsJetStreamTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Transport for NatsJetStreamTransport {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn check_topic(&self, topic: &str) -> Result<()> {
        names::check(NameKind::Topic, topic)?;
        let stream = self.stream_name(topic);
        if stream.len() > MAX_STREAM_NAME {
            return Err(names::invalid(
                NameKind::Topic,
                topic,
                format_args!(
                    "on NATS the stream name, {} characters once the topic is escaped, \
                     may be at most {MAX_STREAM_NAME}",
                    stream.len()
                ),
            ));
        }
        Ok(())
    }

    fn pipelines(&self) -> bool {
        true
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        self.start(topic, tag, payload).await?.await
    }

    async fn start_publish(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<PendingPublish> {
        self.start(topic, tag, payload).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        // Before anything is read: a change after this ends the subscription,
        // a reconnect while the consumer is being made included.
        let link = self.link.subscribe();
        let connects = link.borrow().connects.max(1);
        let mut stream = self.stream(topic).await?;
        let info = stream.info().await.map_err(|e| self.err(e))?;
        let (state, created) = (info.state.clone(), created(info));
        lock(&self.known_streams).insert(topic.to_owned(), created);
        let first = state.first_sequence;
        let last_seq = state.last_sequence;
        let mut pending = None;
        // `last`: the sequence before the first one we expect.
        let (policy, last) = match options.from {
            StartFrom::Latest => (after(last_seq), last_seq),
            StartFrom::Earliest => (consumer::DeliverPolicy::All, first.saturating_sub(1)),
            StartFrom::Position(p) => match (p.get(SEQ), p.get(CREATED)) {
                (Some(Offset::Seq(n)), Some(Offset::Seq(c))) if *c == created && *n <= last_seq => {
                    // What follows the stored sequence is gone when the
                    // oldest message kept comes after it.
                    match first.checked_sub(*n).and_then(|d| d.checked_sub(1)) {
                        Some(missed) if missed > 0 && state.messages > 0 => {
                            // `first > n + 1 >= 1` here.
                            let before = first.saturating_sub(1);
                            pending = Some(Loss::new(
                                LossReason::Trimmed,
                                Some(missed),
                                Some(seq_position(before, created)),
                            ));
                            (after(before), before)
                        }
                        _ => (after(*n), *n),
                    }
                }
                // Another history (a stream made again, a server that lost
                // its store, a position from before this format), or a
                // sequence past this history's end.
                _ => {
                    pending = Some(Loss::new(
                        LossReason::HistoryReset,
                        None,
                        Some(seq_position(last_seq, created)),
                    ));
                    (after(last_seq), last_seq)
                }
            },
            StartFrom::Timestamp(t) => {
                let nanos = t
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
                let start_time = async_nats::datetime::from_nanos(nanos)
                    .map_err(|e| Error::Config(format!("start time: {e}")))?;
                if state.messages > 0 && first > 1 && state.first_timestamp > start_time {
                    // Messages after `t` may already have been discarded.
                    pending = Some(Loss::new(LossReason::Trimmed, None, None));
                }
                // Resolved from the consumer's info below.
                (
                    consumer::DeliverPolicy::ByStartTime { start_time },
                    u64::MAX,
                )
            }
        };
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                deliver_policy: policy,
                // The client derives its idle heartbeat from the pull expiry
                // (15 s by default), and recreates the consumer only after two
                // missed heartbeats: a broker restart then stalls a node for
                // 15 s. A short expiry brings that down to a few seconds.
                max_expires: self.config.pull_expiry,
                ..Default::default()
            })
            .await
            .map_err(|e| self.err(e))?;
        // For a timestamp start the server works out the sequence; its
        // consumer info says where delivery begins.
        let last = if last == u64::MAX {
            consumer.cached_info().delivered.stream_sequence
        } else {
            last
        };
        let messages = consumer.messages().await.map_err(|e| self.err(e))?;
        let silence = self.config.pull_expiry;
        Ok(Box::new(NatsSubscription {
            messages,
            last,
            created,
            pending,
            stashed: None,
            link,
            connects,
            tags: Tags::default(),
            stream,
            silence,
            quiet: Box::pin(tokio::time::sleep_until(deadline_after(silence))),
            behind: false,
        }))
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_beat(self.heartbeat_subject(topic), payload)
            .await
    }

    /// The stream's last sequence and creation time, from one stream-info
    /// request (answered by the stream's leader on a cluster, which
    /// acknowledges a publish only once it is stored).
    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        let stream = self
            .js
            .get_stream(self.stream_name(topic))
            .await
            .map_err(|e| self.err(e))?;
        let info = stream.cached_info();
        if let Some(cluster) = &info.cluster
            && !authoritative(cluster)
        {
            return Err(Error::Transport {
                transport: KIND,
                source: "the stream's state was not answered by a leader in touch with a quorum of its replicas".into(),
            });
        }
        Ok(Some(seq_position(info.state.last_sequence, created(info))))
    }

    /// The sequence read at or past the tail's, in the same stream: a
    /// stream made again is another history.
    fn covers(&self, position: &Position, tail: &Position) -> bool {
        crate::transport::position::reached_in_history(position, tail, SEQ, CREATED)
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        self.check_topic(topic)?;
        self.subscribe_beats(self.heartbeat_subject(topic)).await
    }

    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_beat(self.reply_subject(topic, to), payload)
            .await
    }

    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        self.check_topic(topic)?;
        self.subscribe_beats(self.reply_subject(topic, to)).await
    }
}

/// How recently a replica must have been heard from by the stream's
/// leader to count toward its quorum in a tail: below NATS's shortest
/// election timeout (4 s), so that no other leader can have been elected,
/// and taken acknowledgements, since the quorum last heard from this one.
const QUORUM_HEARD_WITHIN: Duration = Duration::from_secs(2);

/// Whether a replicated stream's state, as answered, is a tail: a
/// server cut off from the stream's group answers with its own replica's
/// state when the group has no leader it can reach (and a leader cut off
/// with a minority answers until it steps down), which can be behind what
/// the group acknowledged since. So only the answer of a named leader that
/// has heard from a quorum of the group within `QUORUM_HEARD_WITHIN`.
fn authoritative(cluster: &async_nats::jetstream::stream::ClusterInfo) -> bool {
    if cluster.leader.as_deref().is_none_or(str::is_empty) {
        return false;
    }
    let group = cluster.replicas.len().saturating_add(1);
    let heard = cluster
        .replicas
        .iter()
        .filter(|r| !r.offline && r.active <= QUORUM_HEARD_WITHIN)
        .count()
        .saturating_add(1);
    // A majority of the group, the leader counted.
    heard.saturating_mul(2) > group
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(
        leader: &str,
        replicas: &[(bool, u64)],
    ) -> async_nats::jetstream::stream::ClusterInfo {
        let replicas: Vec<serde_json::Value> = replicas
            .iter()
            .enumerate()
            .map(|(i, (offline, active_ms))| {
                serde_json::json!({
                    "name": format!("s{i}"),
                    "current": true,
                    "active": active_ms * 1_000_000,
                    "offline": offline,
                })
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "name": "c",
            "leader": leader,
            "replicas": replicas,
        }))
        .unwrap()
    }

    /// A tail of a replicated stream is a named leader's, in touch with a
    /// majority of its group: not a replica's answer while it can reach no
    /// leader, nor a leader's that heard from too few peers lately.
    #[test]
    fn only_a_leader_in_touch_with_a_quorum_tells_the_tail() {
        assert!(authoritative(&cluster("s", &[(false, 100), (false, 100)])));
        assert!(authoritative(&cluster("s", &[(false, 100), (true, 100)])));
        assert!(authoritative(&cluster(
            "s",
            &[(false, 100), (false, 60_000)]
        )));
        assert!(!authoritative(&cluster("", &[(false, 100), (false, 100)])));
        assert!(!authoritative(&cluster(
            "s",
            &[(true, 100), (false, 3_000)]
        )));
        assert!(!authoritative(&cluster(
            "s",
            &[(false, 2_001), (false, 2_001)]
        )));
        // R5: two of four peers heard, the leader the third of five.
        let five = [(false, 100), (false, 100), (true, 100), (false, 9_000)];
        assert!(authoritative(&cluster("s", &five)));
        let five = [(false, 100), (true, 100), (true, 100), (false, 9_000)];
        assert!(!authoritative(&cluster("s", &five)));
        // A one-replica stream on a cluster: its leader alone.
        assert!(authoritative(&cluster("s", &[])));
    }
}
