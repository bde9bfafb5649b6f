//! The NATS JetStream transport.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::watch;

use super::{
    ChangeBus, Delivery, Loss, LossReason, Offset, Position, Record, StartFrom, SubscribeOptions,
    Subscription,
};
use crate::error::{Error, Result};
use crate::lock;

const KIND: &str = "nats-jetstream";
/// The one partition of a NATS position: the last stream sequence read.
const SEQ: &str = "seq";
/// Carries the cache name, so nodes skip other caches' events unread.
const TAG_HEADER: &str = "Cache-Sync-Tag";

fn err(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::disconnected(KIND, e)
}

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
/// - **Start positions:** latest, earliest, a stored sequence, a timestamp.
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[derive(Clone)]
pub struct NatsJetStreamBus {
    js: jetstream::Context,
    config: NatsConfig,
    /// Counts reconnections, so subscriptions can start afresh at once.
    reconnects: Arc<watch::Sender<u64>>,
    /// Topics whose stream this bus has made sure of. Asking the server on
    /// every publish cost a second round trip and doubled the publish time.
    known_streams: Arc<Mutex<HashSet<String>>>,
}

impl fmt::Debug for NatsJetStreamBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsJetStreamBus")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct NatsConfig {
    max_messages: i64,
    pull_expiry: Duration,
    subject_prefix: String,
    storage: stream::StorageType,
}

/// Configures a [`NatsJetStreamBus`].
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[derive(Debug, Clone)]
pub struct NatsJetStreamBuilder {
    url: String,
    config: NatsConfig,
}

impl NatsJetStreamBuilder {
    /// Messages kept per topic. Default 100 000.
    pub fn max_messages(mut self, n: i64) -> Self {
        self.config.max_messages = n.max(1);
        self
    }

    /// How long one pull request may wait on the server (long poll). The
    /// client's idle heartbeat follows it, and a dead consumer is recreated
    /// after two missed heartbeats, so this bounds how long a node stalls
    /// after a broker restart. Default 2 s; far below a second the client
    /// polls continuously.
    pub fn pull_expiry(mut self, expiry: Duration) -> Self {
        self.config.pull_expiry = expiry.max(Duration::from_millis(100));
        self
    }

    /// Subject prefix; the subject is `<prefix>.<topic>` and the stream is
    /// named after it. Default `"cache-sync"`.
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.subject_prefix = prefix.into();
        self
    }

    /// Keep the stream in memory instead of on disk (lost on a server restart,
    /// which nodes then see as a history reset). Default: file storage.
    pub fn memory_storage(mut self) -> Self {
        self.config.storage = stream::StorageType::Memory;
        self
    }

    /// Connects. The client reconnects by itself after a disconnect.
    pub async fn connect(self) -> Result<NatsJetStreamBus> {
        let reconnects = Arc::new(watch::Sender::new(0u64));
        let on_event = Arc::downgrade(&reconnects);
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .retry_on_initial_connect()
            .max_reconnects(None)
            .event_callback(move |event| {
                let on_event = on_event.clone();
                async move {
                    if let (async_nats::Event::Connected, Some(tx)) = (event, on_event.upgrade()) {
                        tx.send_modify(|n| *n += 1);
                    }
                }
            })
            .connect(self.url.as_str())
            .await
            .map_err(err)?;
        Ok(NatsJetStreamBus {
            js: jetstream::new(client),
            config: self.config,
            reconnects,
            known_streams: Arc::default(),
        })
    }
}

impl NatsJetStreamBus {
    /// Configures a bus for the server at `url` (`nats://127.0.0.1:4222`).
    pub fn builder(url: impl Into<String>) -> NatsJetStreamBuilder {
        NatsJetStreamBuilder {
            url: url.into(),
            config: NatsConfig {
                max_messages: 100_000,
                pull_expiry: Duration::from_secs(2),
                subject_prefix: "cache-sync".into(),
                storage: stream::StorageType::File,
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self> {
        Self::builder(url).connect().await
    }

    fn subject(&self, topic: &str) -> String {
        format!("{}.{topic}", self.config.subject_prefix)
    }

    fn stream_name(&self, topic: &str) -> String {
        // Stream names may not contain '.', ' ', '*' or '>'.
        self.subject(topic).replace(['.', ' ', '*', '>'], "_")
    }

    /// Makes sure the topic's stream exists, asking the server only the
    /// first time (or after `forget_stream`).
    async fn ensure_stream(&self, topic: &str) -> Result<()> {
        if lock(&self.known_streams).contains(topic) {
            return Ok(());
        }
        self.stream(topic).await?;
        lock(&self.known_streams).insert(topic.to_owned());
        Ok(())
    }

    fn forget_stream(&self, topic: &str) {
        lock(&self.known_streams).remove(topic);
    }

    async fn publish_once(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> std::result::Result<Option<Position>, jetstream::context::PublishError> {
        let mut headers = HeaderMap::new();
        headers.insert(TAG_HEADER, tag);
        let ack = self
            .js
            .publish_with_headers(self.subject(topic), headers, payload)
            .await?
            .await?;
        Ok(Some(seq_position(ack.sequence)))
    }

    async fn stream(&self, topic: &str) -> Result<stream::Stream> {
        self.js
            .get_or_create_stream(stream::Config {
                name: self.stream_name(topic),
                subjects: vec![self.subject(topic)],
                max_messages: self.config.max_messages,
                retention: stream::RetentionPolicy::Limits,
                discard: stream::DiscardPolicy::Old,
                storage: self.config.storage,
                ..Default::default()
            })
            .await
            .map_err(err)
    }
}

fn seq_position(seq: u64) -> Position {
    Position::single(SEQ, Offset::Seq(seq))
}

#[async_trait]
impl ChangeBus for NatsJetStreamBus {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        // Creating the stream on first use keeps publishers and nodes free of
        // set-up order.
        self.ensure_stream(topic).await?;
        match self.publish_once(topic, tag, payload.clone()).await {
            Err(e) if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
                // Deleted since, or lost by a broker without persistence: the
                // message went nowhere, so make the stream again and retry once.
                self.forget_stream(topic);
                self.ensure_stream(topic).await?;
                self.publish_once(topic, tag, payload).await.map_err(err)
            }
            other => other.map_err(err),
        }
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        let mut stream = self.stream(topic).await?;
        let state = stream.info().await.map_err(err)?.state.clone();
        let mut pending = None;
        // `last`: the sequence before the first one we expect.
        let (policy, last) = match options.from {
            StartFrom::Latest => (
                consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: state.last_sequence + 1,
                },
                state.last_sequence,
            ),
            StartFrom::Earliest => (
                consumer::DeliverPolicy::All,
                state.first_sequence.saturating_sub(1),
            ),
            StartFrom::Position(p) => match p.get(SEQ) {
                Some(Offset::Seq(n)) if *n <= state.last_sequence => {
                    if state.messages > 0 && n + 1 < state.first_sequence {
                        pending = Some(Loss::new(
                            LossReason::Trimmed,
                            Some(state.first_sequence - n - 1),
                            Some(seq_position(state.first_sequence - 1)),
                        ));
                        (
                            consumer::DeliverPolicy::ByStartSequence {
                                start_sequence: state.first_sequence,
                            },
                            state.first_sequence - 1,
                        )
                    } else {
                        (
                            consumer::DeliverPolicy::ByStartSequence {
                                start_sequence: n + 1,
                            },
                            *n,
                        )
                    }
                }
                _ => {
                    pending = Some(Loss::new(
                        LossReason::HistoryReset,
                        None,
                        Some(seq_position(state.last_sequence)),
                    ));
                    (
                        consumer::DeliverPolicy::ByStartSequence {
                            start_sequence: state.last_sequence + 1,
                        },
                        state.last_sequence,
                    )
                }
            },
            StartFrom::Timestamp(t) => {
                let nanos = t
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as i128);
                let start_time = async_nats::datetime::from_nanos(nanos)
                    .map_err(|e| Error::Config(format!("start time: {e}")))?;
                if state.messages > 0
                    && state.first_sequence > 1
                    && state.first_timestamp > start_time
                {
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
            .map_err(err)?;
        // For a timestamp start the server works out the sequence; its
        // consumer info says where delivery begins.
        let last = if last == u64::MAX {
            consumer.cached_info().delivered.stream_sequence
        } else {
            last
        };
        let messages = consumer.messages().await.map_err(err)?;
        Ok(Box::new(NatsSubscription {
            messages,
            last,
            pending,
            stashed: None,
            reconnects: self.reconnects.subscribe(),
        }))
    }
}

struct NatsSubscription {
    messages: consumer::pull::Ordered,
    /// Sequence of the last message read.
    last: u64,
    pending: Option<Loss>,
    /// A message read after a gap, delivered once the gap is reported.
    stashed: Option<jetstream::Message>,
    /// After a reconnect, the ordered consumer notices its pull request died
    /// only after two missed idle heartbeats (up to 30 s); the subscription
    /// ends at once instead, and the node re-subscribes from its position.
    reconnects: watch::Receiver<u64>,
}

impl fmt::Debug for NatsSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSubscription")
            .field("last", &self.last)
            .finish_non_exhaustive()
    }
}

impl NatsSubscription {
    /// The loss to report before message `seq`, if it does not follow `last`.
    fn gap(&self, seq: u64) -> Option<Loss> {
        if seq == self.last + 1 {
            return None;
        }
        let resume = Some(seq_position(seq - 1));
        Some(if seq > self.last + 1 {
            Loss::new(LossReason::Trimmed, Some(seq - self.last - 1), resume)
        } else {
            Loss::new(LossReason::HistoryReset, None, resume)
        })
    }
}

#[async_trait]
impl Subscription for NatsSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if let Some(loss) = self.pending.take() {
            return Ok(Delivery::Lost(loss));
        }
        let mut records = Vec::new();
        while records.len() < max.max(1) {
            let message = match self.stashed.take() {
                Some(m) => m,
                None if records.is_empty() => match tokio::select! {
                    m = self.messages.next() => m,
                    _ = self.reconnects.changed() => {
                        return Err(Error::disconnected(KIND, "reconnected; the consumer starts afresh"));
                    }
                } {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => return Err(err(e)),
                    None => {
                        return Err(Error::disconnected(
                            KIND,
                            "the consumer's message stream ended",
                        ));
                    }
                },
                // Only what is already buffered; an error here surfaces on the
                // next call, and a skipped message would show as a gap.
                None => match self.messages.next().now_or_never() {
                    Some(Some(Ok(m))) => m,
                    _ => break,
                },
            };
            let seq = message
                .info()
                .map_err(|e| Error::Transport {
                    transport: KIND,
                    source: e,
                })?
                .stream_sequence;
            if let Some(loss) = self.gap(seq) {
                self.stashed = Some(message);
                if records.is_empty() {
                    self.last = seq - 1;
                    return Ok(Delivery::Lost(loss));
                }
                // Deliver what came before the gap; the gap is reported next.
                break;
            }
            self.last = seq;
            records.push(record(&message, seq));
        }
        Ok(Delivery::Batch {
            records,
            position: seq_position(self.last),
        })
    }

    fn position(&self) -> Option<Position> {
        Some(seq_position(self.last))
    }
}

fn record(message: &jetstream::Message, seq: u64) -> Record {
    let tag = message
        .headers
        .as_ref()
        .and_then(|h| h.get(TAG_HEADER))
        .map(|v| v.as_str().to_owned());
    Record::new(seq_position(seq), tag, message.payload.clone())
}
