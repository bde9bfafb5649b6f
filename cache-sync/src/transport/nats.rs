//! The NATS JetStream transport.

use std::collections::HashMap;
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
    Delivery, HeartbeatSubscription, Loss, LossReason, Offset, Position, Record, StartFrom,
    SubscribeOptions, Subscription, Tags, Transport,
};
use crate::error::{Error, Result};
use crate::transport::names::{self, NameKind};
use crate::util::{MAX_TIMEOUT, check_at_least, check_duration, lock};

const KIND: &str = "nats-jetstream";
/// The partitions of a NATS position: the last stream sequence read, and
/// the stream's creation time, which names the history the sequence
/// belongs to (a stream deleted and made again, or a server that lost its
/// store, starts another history whose sequences can reach the same numbers).
const SEQ: &str = "seq";
const CREATED: &str = "created";
/// Carries the cache name, so nodes skip other caches' events unread.
const TAG_HEADER: &str = "Cache-Sync-Tag";
/// JetStream's longest stream name.
const MAX_STREAM_NAME: usize = 255;
/// How long a heartbeat publish waits for the client to write it out. Core
/// NATS has no acknowledgement; while the client is disconnected a flush
/// waits for the reconnect, so it is bounded like a JetStream request (the
/// client's default request timeout).
const HEARTBEAT_FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the client is connected, and how many times it connected. Moved
/// by the client's events; subscriptions end on any change, so a node shows
/// a dropped connection at once and resumes afresh after a reconnect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Link {
    connects: u64,
    up: bool,
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
}

impl fmt::Debug for NatsJetStreamTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsJetStreamTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct NatsConfig {
    max_messages: i64,
    pull_expiry: Duration,
    ping_interval: Duration,
    subject_prefix: String,
    storage: stream::StorageType,
}

/// Configures a [`NatsJetStreamTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
#[derive(Debug, Clone)]
pub struct NatsJetStreamBuilder {
    url: String,
    config: NatsConfig,
}

/// The shortest [`pull_expiry`](NatsJetStreamBuilder::pull_expiry) and
/// [`ping_interval`](NatsJetStreamBuilder::ping_interval): far below it the
/// client polls or pings continuously.
const MIN_INTERVAL: Duration = Duration::from_millis(100);

impl NatsJetStreamBuilder {
    /// Messages kept per topic. Default 100 000; at least 1, or
    /// [`connect`](Self::connect) refuses it.
    pub fn max_messages(mut self, n: i64) -> Self {
        self.config.max_messages = n;
        self
    }

    /// How long one pull request may wait on the server (long poll). The
    /// client's idle heartbeat follows it, and a dead consumer is recreated
    /// after two missed heartbeats, so this bounds how long a node stalls
    /// after a broker restart. Default 2 s; between 100 ms and an hour (the
    /// server refuses longer pull requests), or [`connect`](Self::connect)
    /// refuses it.
    pub fn pull_expiry(mut self, expiry: Duration) -> Self {
        self.config.pull_expiry = expiry;
        self
    }

    /// How often the client PINGs an idle server. Two unanswered PINGs
    /// count as a lost connection, so a server that stops answering (but
    /// keeps its socket open) shows as a disconnect, and `consuming: false`,
    /// within about twice this. A killed server shows at once. Default 5 s;
    /// between 100 ms and an hour, or [`connect`](Self::connect) refuses it.
    pub fn ping_interval(mut self, every: Duration) -> Self {
        self.config.ping_interval = every;
        self
    }

    /// Subject prefix; the subject is `<prefix>.<topic>` and the stream is
    /// named after both. Default `"cache-sync"`. It must be a literal NATS
    /// subject (dot-separated tokens, no wildcards or whitespace), or
    /// [`connect`](Self::connect) fails.
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
    ///
    /// A setting out of its range, or a subject prefix that is not a literal
    /// subject, is refused with [`Error::Config`] before anything is sent.
    pub async fn connect(self) -> Result<NatsJetStreamTransport> {
        self.check()?;
        let link = Arc::new(watch::Sender::new(Link::default()));
        let on_event = Arc::downgrade(&link);
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .ping_interval(self.config.ping_interval)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .event_callback(move |event| {
                let on_event = on_event.clone();
                async move {
                    let Some(tx) = on_event.upgrade() else { return };
                    match event {
                        async_nats::Event::Connected => tx.send_modify(|l| {
                            l.connects = l.connects.saturating_add(1);
                            l.up = true;
                        }),
                        async_nats::Event::Disconnected | async_nats::Event::Closed => {
                            tx.send_modify(|l| l.up = false);
                        }
                        _ => {}
                    }
                }
            })
            .connect(self.url.as_str())
            .await
            .map_err(|e| Error::disconnected(KIND, e))?;
        Ok(NatsJetStreamTransport {
            js: jetstream::new(client.clone()),
            client,
            config: self.config,
            link,
            known_streams: Arc::default(),
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    fn check(&self) -> Result<()> {
        let c = &self.config;
        check_at_least("nats-jetstream max_messages", c.max_messages, 1)?;
        check_duration(
            "nats-jetstream pull_expiry",
            c.pull_expiry,
            MIN_INTERVAL,
            MAX_TIMEOUT,
        )?;
        check_duration(
            "nats-jetstream ping_interval",
            c.ping_interval,
            MIN_INTERVAL,
            MAX_TIMEOUT,
        )?;
        check_prefix(&c.subject_prefix)
    }
}

impl NatsJetStreamTransport {
    /// Configures a transport for the server at `url` (`nats://127.0.0.1:4222`).
    pub fn builder(url: impl Into<String>) -> NatsJetStreamBuilder {
        NatsJetStreamBuilder {
            url: url.into(),
            config: NatsConfig {
                max_messages: 100_000,
                pull_expiry: Duration::from_secs(2),
                ping_interval: Duration::from_secs(5),
                subject_prefix: "cache-sync".into(),
                storage: stream::StorageType::File,
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self> {
        Self::builder(url).connect().await
    }

    /// `<prefix>.<topic>`, the topic escaped into one literal token: a `.`
    /// would split it into two, and `*` or `>` would make it a wildcard
    /// that catches other topics' events.
    fn subject(&self, topic: &str) -> String {
        format!(
            "{}.{}",
            self.config.subject_prefix,
            names::escape_with(topic, MARKER, subject_char)
        )
    }

    /// `<subject>.hb`, the topic's heartbeat subject: one token longer than
    /// any topic's subject, so no stream (each takes exactly its topic's
    /// subject) stores it.
    fn heartbeat_subject(&self, topic: &str) -> String {
        format!("{}.hb", self.subject(topic))
    }

    /// `<subject>.hb.r.<to, 16 hex digits>`, a party's reply subject:
    /// longer still, so no stream stores it, and no subscription to the
    /// heartbeat subject (which has no wildcard) takes it.
    fn reply_subject(&self, topic: &str, to: u64) -> String {
        format!("{}.r.{to:016x}", self.heartbeat_subject(topic))
    }

    /// `<prefix>_<topic>`, each escaped to letters, digits and `-` (others
    /// as `=XX`), so the one `_` between them keeps the name injective:
    /// `tenant.a` and `tenant_a` get streams of their own. Names made of
    /// those characters alone are unchanged (`cache-sync_catalog`).
    fn stream_name(&self, topic: &str) -> String {
        format!(
            "{}_{}",
            names::escape_with(&self.config.subject_prefix, MARKER, stream_char),
            names::escape_with(topic, MARKER, stream_char)
        )
    }

    /// An error, classified by whether the client is connected at all: a
    /// server that answers with an error is not a disconnect.
    fn err(&self, e: impl std::error::Error + Send + Sync + 'static) -> Error {
        match self.client.connection_state() {
            async_nats::connection::State::Connected => Error::Transport {
                transport: KIND,
                source: Box::new(e),
            },
            _ => Error::disconnected(KIND, e),
        }
    }

    /// Makes sure the topic's stream exists, asking the server only the
    /// first time (or after `forget_stream`).
    async fn ensure_stream(&self, topic: &str) -> Result<u64> {
        if let Some(created) = lock(&self.known_streams).get(topic) {
            return Ok(*created);
        }
        let created = created(self.stream(topic).await?.cached_info());
        lock(&self.known_streams).insert(topic.to_owned(), created);
        Ok(created)
    }

    fn forget_stream(&self, topic: &str) {
        lock(&self.known_streams).remove(topic);
    }

    async fn publish_once(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
        created: u64,
    ) -> std::result::Result<Option<Position>, jetstream::context::PublishError> {
        let mut headers = HeaderMap::new();
        // Escaped: header values lose leading and trailing spaces, and
        // cannot hold line breaks.
        headers.insert(
            TAG_HEADER,
            names::escape_with(tag, MARKER, header_char).as_ref(),
        );
        let ack = self
            .js
            .publish_with_headers(self.subject(topic), headers, payload)
            .await?
            .await?;
        Ok(Some(seq_position(ack.sequence, created)))
    }

    /// The topic's stream, made if missing. A stream of that name that
    /// carries other subjects (another application's, or an older
    /// cache-sync's) is refused rather than read or written.
    async fn stream(&self, topic: &str) -> Result<stream::Stream> {
        self.check_topic(topic)?;
        let subject = self.subject(topic);
        let stream = self
            .js
            .get_or_create_stream(stream::Config {
                name: self.stream_name(topic),
                subjects: vec![subject.clone()],
                max_messages: self.config.max_messages,
                retention: stream::RetentionPolicy::Limits,
                discard: stream::DiscardPolicy::Old,
                storage: self.config.storage,
                ..Default::default()
            })
            .await
            .map_err(|e| self.err(e))?;
        let subjects = &stream.cached_info().config.subjects;
        if subjects != std::slice::from_ref(&subject) {
            return Err(Error::Config(format!(
                "NATS stream {:?} exists with subjects {subjects:?}, not [{subject:?}]; \
                 it belongs to something else, so topic {topic:?} cannot use it",
                self.stream_name(topic)
            )));
        }
        Ok(stream)
    }
}

/// The subject prefix is used as it is: it must be a literal subject.
fn check_prefix(prefix: &str) -> Result<()> {
    let literal = !prefix.is_empty()
        && prefix
            .split('.')
            .all(|token| !token.is_empty() && token.chars().all(subject_char));
    if literal && prefix.len() <= MAX_STREAM_NAME {
        return Ok(());
    }
    Err(Error::Config(format!(
        "NATS subject prefix {prefix:?} is not allowed: it must be a literal subject, dot-separated \
         tokens of printable ASCII without whitespace, '*', '>', '%' or '='"
    )))
}

/// Escapes in NATS names start with `=` (quoted-printable's marker), not `%`:
/// the server formats a stream's name into each message's acknowledgement
/// subject as a format string, and a `%` there garbles the subject and
/// makes the client drop the connection.
const MARKER: u8 = b'=';

/// Characters a subject token takes as they are.
fn subject_char(c: char) -> bool {
    c.is_ascii_graphic() && !matches!(c, '.' | '*' | '>' | '%' | '=')
}

/// Characters a tag header value takes as they are.
fn header_char(c: char) -> bool {
    c.is_ascii_graphic() && c != '='
}

/// Characters a stream name takes as they are; `_` separates the prefix
/// from the topic, so it is escaped inside them.
fn stream_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

fn seq_position(seq: u64, created: u64) -> Position {
    let mut p = Position::single(SEQ, Offset::Seq(seq));
    p.set(CREATED, Offset::Seq(created));
    p
}

/// The stream's creation time in nanoseconds: the identity of its history.
fn created(info: &stream::Info) -> u64 {
    u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(0)
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

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        self.check_tag(tag)?;
        // Creating the stream on first use keeps publishers and nodes free of
        // set-up order.
        let created = self.ensure_stream(topic).await?;
        match self
            .publish_once(topic, tag, payload.clone(), created)
            .await
        {
            Err(e) if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound => {
                // Deleted since, or lost by a broker without persistence: the
                // message went nowhere, so make the stream again and retry once.
                self.forget_stream(topic);
                let created = self.ensure_stream(topic).await?;
                self.publish_once(topic, tag, payload, created)
                    .await
                    .map_err(|e| self.err(e))
            }
            other => other.map_err(|e| self.err(e)),
        }
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
        Ok(Box::new(NatsSubscription {
            messages,
            last,
            created,
            pending,
            stashed: None,
            link,
            connects,
            tags: Tags::default(),
        }))
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_beat(self.heartbeat_subject(topic), payload)
            .await
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

impl NatsJetStreamTransport {
    /// Publishes on a core subject (a heartbeat or reply subject).
    async fn publish_beat(&self, subject: String, payload: Bytes) -> Result<()> {
        let sent = async {
            self.client
                .publish(subject, payload)
                .await
                .map_err(|e| self.err(e))?;
            // `publish` only queues the message; the flush shows a failure
            // to write it (or, bounded, a client that is not connected).
            self.client.flush().await.map_err(|e| self.err(e))
        };
        tokio::time::timeout(HEARTBEAT_FLUSH_TIMEOUT, sent)
            .await
            .map_err(|e| self.err(e))?
    }

    /// Subscribes to a core subject (a heartbeat or reply subject).
    async fn subscribe_beats(&self, subject: String) -> Result<Box<dyn HeartbeatSubscription>> {
        let subscriber = self
            .client
            .subscribe(subject)
            .await
            .map_err(|e| self.err(e))?;
        // One round trip on the same connection: the server handles a
        // connection's messages in order, so once it answers, the SUB is
        // in place and a message published from now on reaches it. A
        // request to a fresh inbox nobody listens on is answered at once
        // by the server itself, with "no responders".
        match self
            .client
            .request(self.client.new_inbox(), Bytes::new())
            .await
        {
            Ok(_) => {}
            Err(e) if e.kind() == async_nats::client::RequestErrorKind::NoResponders => {}
            Err(e) => return Err(self.err(e)),
        }
        Ok(Box::new(NatsHeartbeats(subscriber)))
    }
}

/// A core NATS subscription to a heartbeat subject.
#[derive(Debug)]
struct NatsHeartbeats(async_nats::Subscriber);

#[async_trait]
impl HeartbeatSubscription for NatsHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        match self.0.next().await {
            Some(message) => Ok(message.payload),
            None => Err(Error::disconnected(
                KIND,
                "the heartbeat subscription ended (the client closed)",
            )),
        }
    }
}

fn after(seq: u64) -> consumer::DeliverPolicy {
    consumer::DeliverPolicy::ByStartSequence {
        start_sequence: seq.saturating_add(1),
    }
}

struct NatsSubscription {
    messages: consumer::pull::Ordered,
    /// Sequence of the last message read.
    last: u64,
    /// The stream's creation time: which history `last` belongs to.
    created: u64,
    pending: Option<Loss>,
    /// A message read after a gap, delivered once the gap is reported.
    stashed: Option<jetstream::Message>,
    /// The client's connection. After a reconnect, the ordered consumer
    /// notices its pull request died only after two missed idle heartbeats
    /// (up to 30 s), and would then carry on in whatever stream now has the
    /// name, so the subscription ends at once instead, and the node
    /// re-subscribes from its position, which checks the history. After a
    /// disconnect it ends too, so the node shows it is not consuming.
    link: watch::Receiver<Link>,
    /// Connections made when the subscription began (at least the first).
    connects: u64,
    tags: Tags,
}

/// Resolves once the connection drops, or a new one replaces the one the
/// subscription began on. The client reports its first connection with
/// an event that may arrive after the subscription began; that one counts
/// as the same connection.
async fn link_lost(link: &mut watch::Receiver<Link>, connects: u64) -> &'static str {
    loop {
        if link.changed().await.is_err() {
            return "the client was dropped";
        }
        let now = *link.borrow_and_update();
        if !now.up {
            return "disconnected from the server";
        }
        if now.connects > connects {
            return "reconnected; the consumer starts afresh";
        }
    }
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
        if self.last.checked_add(1) == Some(seq) {
            return None;
        }
        let resume = Some(seq_position(seq.saturating_sub(1), self.created));
        Some(
            match seq.checked_sub(self.last).and_then(|d| d.checked_sub(1)) {
                Some(missed) => Loss::new(LossReason::Trimmed, Some(missed), resume),
                None => Loss::new(LossReason::HistoryReset, None, resume),
            },
        )
    }

    fn position_at(&self, seq: u64) -> Position {
        seq_position(seq, self.created)
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
                    // First: a message that came after a reconnect may be
                    // from another history.
                    biased;
                    what = link_lost(&mut self.link, self.connects) => {
                        return Err(Error::disconnected(KIND, what));
                    }
                    m = self.messages.next() => m,
                } {
                    Some(Ok(m)) => m,
                    // A missed heartbeat, a deleted consumer: "disconnected"
                    // only while the client is.
                    Some(Err(e)) if self.link.borrow().up => {
                        return Err(Error::Transport {
                            transport: KIND,
                            source: Box::new(e),
                        });
                    }
                    Some(Err(e)) => {
                        return Err(Error::disconnected(KIND, e));
                    }
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
                    self.last = seq.saturating_sub(1);
                    return Ok(Delivery::Lost(loss));
                }
                // Deliver what came before the gap; the gap is reported next.
                break;
            }
            self.last = seq;
            records.push(record(&message, &mut self.tags).at(Offset::Seq(seq)));
        }
        Ok(Delivery::Batch {
            records,
            position: self.position_at(self.last),
        })
    }

    fn position(&self) -> Option<Position> {
        Some(self.position_at(self.last))
    }
}

fn record(message: &jetstream::Message, tags: &mut Tags) -> Record {
    // A tag no escape produced came from another producer: left out, the
    // consumer routes the event by its header instead.
    let tag = message
        .headers
        .as_ref()
        .and_then(|h| h.get(TAG_HEADER))
        .and_then(|v| names::unescape_with(v.as_str(), MARKER).map(|t| tags.get(&t)));
    Record::new(tag, message.payload.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nothing listens there: an attempt to connect would fail or hang.
    const NOWHERE: &str = "nats://127.0.0.1:1";

    /// `connect` fails at once with a config error naming the setting. The
    /// client retries its first connection in the background, so a
    /// connection attempt would instead give `Ok` (or hang).
    async fn assert_refused(builder: NatsJetStreamBuilder, setting: &str) {
        let connected = tokio::time::timeout(Duration::from_secs(5), builder.connect())
            .await
            .expect("refused at once, without connecting");
        let e = connected.expect_err(setting);
        assert!(e.is_config(), "{setting}: {e:?}");
        assert!(e.to_string().contains(setting), "{e}");
    }

    #[tokio::test]
    async fn connect_refuses_out_of_range_settings_before_any_io() {
        let builder = || NatsJetStreamTransport::builder(NOWHERE);
        for n in [0, -1, i64::MIN] {
            assert_refused(builder().max_messages(n), "max_messages").await;
        }
        let below = MIN_INTERVAL - Duration::from_nanos(1);
        let above = MAX_TIMEOUT + Duration::from_nanos(1);
        type Set = fn(NatsJetStreamBuilder, Duration) -> NatsJetStreamBuilder;
        let durations: [(&str, Set); 2] = [
            ("pull_expiry", NatsJetStreamBuilder::pull_expiry),
            ("ping_interval", NatsJetStreamBuilder::ping_interval),
        ];
        for (setting, set) in durations {
            for d in [Duration::ZERO, below, above, Duration::MAX] {
                assert_refused(set(builder(), d), setting).await;
            }
        }
    }

    #[test]
    fn the_ends_of_each_range_are_accepted() {
        for builder in [
            NatsJetStreamTransport::builder(NOWHERE),
            NatsJetStreamTransport::builder(NOWHERE)
                .max_messages(1)
                .pull_expiry(MIN_INTERVAL)
                .ping_interval(MIN_INTERVAL),
            NatsJetStreamTransport::builder(NOWHERE)
                .max_messages(i64::MAX)
                .pull_expiry(MAX_TIMEOUT)
                .ping_interval(MAX_TIMEOUT),
        ] {
            builder.check().unwrap();
        }
    }
}
