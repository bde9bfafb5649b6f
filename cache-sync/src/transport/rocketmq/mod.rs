//! The RocketMQ broadcast transport (Rust client 1.0).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use rocketmq_client_rust::{
    ClientConfig, ClientError, ClientResult, ClientRuntime, ClientRuntimeConfig,
    ConsumeOrderlyContext, ConsumeOrderlyStatus, DefaultMQAdminExt, DefaultMQProducer,
    DefaultMQPushConsumer, MQPushConsumer, RouteAdmin, TelemetryHandle, TopicAdmin,
};
use rocketmq_model::common::config::TopicConfig;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::topic::{TOPIC_MAX_LENGTH, TopicValidator};
use rocketmq_protocol::protocol::heartbeat::message_model::MessageModel;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
use tokio::sync::{RwLock, mpsc, watch};

use super::{
    Delivery, HeartbeatSubscription, Offset, Position, StartFrom, SubscribeOptions, Subscription,
    Tags, Transport,
};
use crate::error::{Error, Result};
use crate::transport::names::{self, NameKind};
use crate::util::{check_at_least, lock};

mod admin;
mod plan;
mod subscription;
mod watchdog;

use admin::*;
use plan::*;
use subscription::*;
use watchdog::*;

const KIND: &str = "rocketmq";
/// The client id is `<client_ip>@<instance>` and names the offsets
/// directory; for a broadcasting consumer it is only a label, so it is pinned
/// to keep that path computable.
const CLIENT_IP: &str = "127.0.0.1";
/// Admin calls (topic creation, offsets) that take longer than this fail.
const ADMIN_TIMEOUT_MS: u64 = 3000;
const SEND_TIMEOUT_MS: u64 = 3000;
/// Batches the listener may park in a subscription before it pushes back.
const BUFFER_BATCHES: usize = 64;
/// How long the client holds a queue back after the buffer was full.
const SUSPEND_MS: i64 = 50;
/// Consecutive send failures before the producer is suspected stuck behind
/// the client's circuit breaker.
const SEND_FAILURES_BEFORE_RECREATE: u32 = 3;
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;
/// "Disconnected" only when the client says the broker or name server could
/// not be reached or did not answer in time; a refusal (no such topic, no
/// permission, a bad argument, a broker-side failure) is another transport
/// error, which retrying the same call will not mend.
fn err(e: ClientError) -> Error {
    use rocketmq_error::CanonicalCondition as C;
    match e.descriptor().condition() {
        C::Unavailable | C::DeadlineExceeded | C::Aborted | C::Cancelled => {
            Error::disconnected(KIND, e.to_string())
        }
        _ => Error::Transport {
            transport: KIND,
            source: e.to_string().into(),
        },
    }
}

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
/// - **Heartbeats** ([`Transport::publish_heartbeat`]) go to a topic of
///   their own, `<escaped topic>%hb`, which no topic escapes to, created
///   like a change topic on first use; never into the change topic, so they
///   take none of its queue offsets and no change subscription gets them,
///   whatever its tags. RocketMQ has no retention per topic: the brokers
///   keep them for their commit-log retention (72 h by default), and a
///   heartbeat subscription, a consumer of its own from the end, reads none
///   of that. A topic within 3 characters of the 127-character limit has no
///   heartbeat topic ([`Error::Unsupported`]).
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

#[derive(Debug, Clone)]
struct RmqConfig {
    namesrv: String,
    queues: u32,
    offset_dir: Option<PathBuf>,
    name_prefix: String,
}

/// Configures a [`RocketMqTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "rocketmq")))]
#[derive(Debug, Clone)]
pub struct RocketMqBuilder {
    config: RmqConfig,
}

impl RocketMqBuilder {
    /// Message queues of a topic the transport creates. Default 4; at least
    /// 1, or [`connect`](Self::connect) refuses it. More queues spread
    /// caches over more brokers' queues; order holds per cache either way.
    pub fn queues_per_topic(mut self, n: u32) -> Self {
        self.config.queues = n;
        self
    }

    /// The directory the client keeps consumer offsets in. The client reads
    /// it only from the process environment (see the type's docs), so this
    /// must name the same directory: [`connect`](Self::connect) fails with
    /// [`Error::Config`] otherwise. Default: whatever the client uses.
    pub fn offset_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.config.offset_dir = Some(dir.into());
        self
    }

    /// Prefix of the consumer groups and client instance names the transport
    /// creates. Default `"cache-sync"`.
    pub fn name_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.name_prefix = prefix.into();
        self
    }

    /// Starts the client runtime and the producer.
    ///
    /// A setting out of its range is refused with [`Error::Config`] before
    /// the runtime starts or anything is sent.
    pub async fn connect(self) -> Result<RocketMqTransport> {
        check_at_least("rocketmq queues_per_topic", self.config.queues, 1)?;
        // Boxed as `dyn Send`: the client's futures nest so deeply that
        // every crate awaiting them would need a higher recursion limit.
        let connecting: BoxFuture<'static, Result<RocketMqTransport>> = Box::pin(self.start());
        connecting.await
    }

    async fn start(self) -> Result<RocketMqTransport> {
        let client_dir = client_offset_dir();
        let offset_dir = match self.config.offset_dir.clone() {
            Some(dir) if !same_dir(&dir, &client_dir) => {
                return Err(Error::Config(format!(
                    "rocketmq offset dir {} differs from the client's {}; the client reads it \
                     only from the environment variable rocketmq.client.localOffsetStoreDir \
                     at process start",
                    dir.display(),
                    client_dir.display()
                )));
            }
            _ => client_dir,
        };
        let owner = RuntimeOwner::plan(RuntimeConfig::for_parallelism("cache-sync-rmq", 2))
            .map_err(|e| Error::Config(format!("rocketmq runtime: {e}")))?
            .build()
            .map_err(|e| Error::Config(format!("rocketmq runtime: {e}")))?;
        let rt = match ClientRuntime::try_new(
            owner.root_context().component("client"),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        ) {
            Ok(rt) => rt,
            Err(e) => {
                // Dropping a runtime inside the caller's runtime panics.
                let _ = owner.shutdown_background();
                return Err(err(e));
            }
        };
        let inner = Arc::new(Inner {
            id: unique_id(&self.config.name_prefix),
            config: self.config,
            offset_dir,
            rt,
            owner: Mutex::new(Some(owner)),
            producer: RwLock::new(None),
            producers_made: AtomicU64::new(0),
            send_failures: Mutex::new(SendFailures::default()),
            topics: tokio::sync::Mutex::new(HashMap::new()),
            creating: Mutex::new(HashMap::new()),
            names: AtomicU64::new(0),
            closed: AtomicBool::new(false),
        });
        let producer = inner.new_producer().await?;
        *inner.producer.write().await = Some(producer);
        Ok(RocketMqTransport {
            inner: inner as Arc<dyn Shared>,
        })
    }
}

impl RocketMqTransport {
    /// Configures a transport for the name server at `namesrv_addr`
    /// (`127.0.0.1:9876`; several separated by `;`).
    pub fn builder(namesrv_addr: impl Into<String>) -> RocketMqBuilder {
        RocketMqBuilder {
            config: RmqConfig {
                namesrv: namesrv_addr.into(),
                queues: 4,
                offset_dir: None,
                name_prefix: "cache-sync".into(),
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(namesrv_addr: impl Into<String>) -> Result<Self> {
        Self::builder(namesrv_addr).connect().await
    }

    /// Stops the producer and the client runtime for every clone of this
    /// transport. Subscriptions still alive then fail with a disconnect.
    // A plain fn returning a boxed future, not an `async fn`: callers in
    // other crates would otherwise have to lay out the client's deeply nested
    // futures themselves, and need a raised recursion limit to do it.
    pub fn shutdown(&self) -> BoxFuture<'static, ()> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.get().shutdown().await })
    }
}

#[derive(Debug, Default)]
struct SendFailures {
    consecutive: u32,
    last_recreate: Option<Instant>,
}

struct Inner {
    config: RmqConfig,
    offset_dir: PathBuf,
    /// Unique per transport: instance names and groups derive from it.
    id: String,
    rt: Arc<ClientRuntime>,
    owner: Mutex<Option<RuntimeOwner>>,
    producer: RwLock<Option<DefaultMQProducer>>,
    producers_made: AtomicU64,
    send_failures: Mutex<SendFailures>,
    /// Topics created (or found) by this transport, with their route's master
    /// brokers then (name to address).
    topics: tokio::sync::Mutex<HashMap<String, TopicBrokers>>,
    /// One gate per topic being looked up or created, so two calls for one
    /// topic create it once, while calls for other topics (a heartbeat
    /// beside a change topic) do not wait behind a slow creation.
    creating: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    names: AtomicU64,
    closed: AtomicBool,
}

fn unique_id(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // Group names allow only letters, digits, '-', '_', '%' and '|'.
    let prefix: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

/// Where the client puts offsets: the same rule as its `LocalFileOffsetStore`.
fn client_offset_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("rocketmq.client.localOffsetStoreDir") {
        return PathBuf::from(dir);
    }
    std::env::var("HOME").map_or_else(
        |_| PathBuf::from("/tmp/.rocketmq_offsets"),
        |home| PathBuf::from(home).join(".rocketmq_offsets"),
    )
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn client_config(namesrv: &str, instance: &str) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set_namesrv_addr(namesrv.into());
    cc.set_instance_name(instance.into());
    cc.set_client_ip(CLIENT_IP.into());
    cc
}

/// A topic as RocketMQ names it: letters, digits, `-` and `_` as they are,
/// everything else escaped (`%XX`, which RocketMQ's topic alphabet allows).
/// Escaping `%` also keeps user topics clear of `%RETRY%` and `%DLQ%`.
fn rmq_topic(topic: &str) -> std::borrow::Cow<'_, str> {
    names::escape(topic, names::plain)
}

/// A cache name as a message tag, escaped the same way: a raw `||` would
/// split one tag into two in a subscription expression, and spaces around
/// a tag are trimmed by the client.
fn rmq_tag(cache: &str) -> std::borrow::Cow<'_, str> {
    names::escape(cache, names::plain)
}

/// Heartbeats go to a RocketMQ topic of their own beside the change topic,
/// `<escaped topic>%hb`, rather than into the change topic under a reserved
/// tag. A tag would keep them from change subscriptions that filter by tag
/// at the broker, but not from one that asks for every tag (`*`), and they
/// would take queue offsets in the change topic, which positions name. The
/// name is one no topic escapes to: [`rmq_topic`] writes `%` only before two
/// upper-case hex digits, and `h` is none. The topic is created the way a
/// change topic is, on first use. RocketMQ has no retention per topic, so
/// the brokers keep heartbeats as long as their commit log (by time and
/// disk, 72 h by default); a heartbeat subscription starts at the end and
/// reads none of them.
fn rmq_heartbeat_topic(topic: &str) -> String {
    format!("{}{HEARTBEAT_SUFFIX}", rmq_topic(topic))
}

/// Appended to the escaped topic for its heartbeat topic (see
/// [`rmq_heartbeat_topic`]).
const HEARTBEAT_SUFFIX: &str = "%hb";

/// The tag of every heartbeat message: the heartbeat topic carries nothing
/// else, so it only labels them for someone reading the topic by hand.
const HEARTBEAT_TAG: &str = "heartbeat";

/// How long a created topic's route may take to reach the name server:
/// longer than the broker's default registration period (30 s), which
/// repairs a registration that failed.
const ROUTE_WAIT: Duration = Duration::from_secs(45);

/// A route slower than this to appear is logged: the broker's registration
/// with the name server failed or was slow.
const ROUTE_WAIT_WARN: Duration = Duration::from_secs(1);

/// Heartbeats a heartbeat subscription takes from its consumer at a time.
const HEARTBEAT_BATCH: usize = 32;

/// Java's `String.hashCode`, as the client's `SelectMessageQueueByHash` uses.
fn java_hash(s: &str) -> i32 {
    s.encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)))
}

fn partition(broker: &str, queue_id: i32) -> String {
    format!("{broker}:{queue_id}")
}

fn next_offset(offset: i64) -> Offset {
    Offset::Seq(u64::try_from(offset.saturating_add(1)).unwrap_or(0))
}

/// One queue of a topic and the master broker serving it.
#[derive(Debug, Clone)]
struct QueueRef {
    mq: MessageQueue,
    addr: String,
    name: String,
}

impl Inner {
    fn next_name(&self, what: &str) -> String {
        let n = self.names.fetch_add(1, Ordering::Relaxed);
        format!("{}-{what}-{n}", self.id)
    }

    fn ensure_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::disconnected(KIND, "the transport was shut down"));
        }
        Ok(())
    }

    async fn new_producer(&self) -> Result<DefaultMQProducer> {
        let n = self.producers_made.fetch_add(1, Ordering::Relaxed);
        let mut producer = DefaultMQProducer::builder(self.rt.clone())
            .client_config(client_config(
                &self.config.namesrv,
                &format!("{}-producer-{n}", self.id),
            ))
            .producer_group(format!("{}-producer", self.id))
            .send_msg_timeout(SEND_TIMEOUT_MS as u32)
            .build();
        producer.start().await.map_err(err)?;
        Ok(producer)
    }

    /// A short-lived admin client. Each gets its own client instance, so a
    /// circuit breaker one opened during an outage never blocks the next.
    async fn admin(&self) -> Result<Admin> {
        let mut admin = DefaultMQAdminExt::new(self.rt.clone());
        admin.set_namesrv_addr(self.config.namesrv.as_str());
        admin
            .client_config_mut()
            .set_instance_name(self.next_name("admin").into());
        admin.client_config_mut().set_client_ip(CLIENT_IP.into());
        admin.start().await.map_err(err)?;
        Ok(Admin(Some(admin)))
    }

    /// Creates the topic with the configured number of queues on every
    /// master broker, once per topic and transport.
    async fn ensure_topic(&self, topic: &str) -> Result<TopicBrokers> {
        if let Some(brokers) = self.topics.lock().await.get(topic) {
            return Ok(brokers.clone());
        }
        let gate = lock(&self.creating)
            .entry(topic.to_owned())
            .or_default()
            .clone();
        let _creating = gate.lock().await;
        // Another call may have finished while this one waited at the gate.
        if let Some(brokers) = self.topics.lock().await.get(topic) {
            return Ok(brokers.clone());
        }
        let brokers = self.find_or_create_topic(topic).await;
        lock(&self.creating).remove(topic);
        let brokers = brokers?;
        self.topics
            .lock()
            .await
            .insert(topic.to_owned(), brokers.clone());
        Ok(brokers)
    }

    async fn find_or_create_topic(&self, topic: &str) -> Result<TopicBrokers> {
        let mut admin = self.admin().await?;
        let result = async {
            let a = admin.get();
            let mut found = route(a, topic).await?;
            if found.is_none() {
                let cluster = RouteAdmin::examine_broker_cluster_info(a)
                    .await
                    .map_err(err)?;
                let masters: Vec<String> = cluster
                    .broker_addr_table
                    .iter()
                    .flatten()
                    .filter_map(|(_, b)| b.broker_addrs().get(&0).map(ToString::to_string))
                    .collect();
                if masters.is_empty() {
                    return Err(Error::disconnected(KIND, "no master broker registered"));
                }
                for addr in masters {
                    let config =
                        TopicConfig::with_queues(topic, self.config.queues, self.config.queues);
                    TopicAdmin::create_and_update_topic_config(a, addr.into(), config)
                        .await
                        .map_err(err)?;
                }
                // The name server learns the route when the broker registers
                // the topic with it: at once on a quiet machine. That
                // registration has a 3 s timeout, and one that fails (a
                // debug broker beside a full test run on 2 cores) is only
                // repaired by the broker's periodic registration, every 30 s
                // by default, so the wait outlasts one period.
                let started = Instant::now();
                loop {
                    found = route(a, topic).await?;
                    if found.is_some() {
                        let waited = started.elapsed();
                        if waited > ROUTE_WAIT_WARN {
                            tracing::warn!(
                                topic,
                                ?waited,
                                "a created topic's route was slow to reach the name server"
                            );
                        }
                        break;
                    }
                    if started.elapsed() > ROUTE_WAIT {
                        // The name server answers, so this is no disconnect.
                        return Err(Error::Transport {
                            transport: KIND,
                            source: format!(
                                "topic {topic} was created on the brokers, but the name server \
                                 had no route for it {} s later",
                                ROUTE_WAIT.as_secs()
                            )
                            .into(),
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            Ok(found
                .iter()
                .flat_map(|r| &r.broker_datas)
                .filter_map(|b| {
                    let addr = b.broker_addrs().get(&0)?;
                    Some((b.broker_name().to_string(), addr.to_string()))
                })
                .collect::<TopicBrokers>())
        }
        .await;
        admin.shutdown().await;
        result
    }

    /// A failed send, classified by what can be reached: the client
    /// reports a send to a broker that went down as an invalid argument (it
    /// finds no queue to send to), so its own classification is not enough.
    /// "Disconnected" when every name server refuses connections, or the
    /// broker the send went to does (all of the topic's brokers when the
    /// client picked none); otherwise the error stands. `brokers` is what
    /// the send was made with, not the map, which other sends may clear.
    async fn classify_send_failure(
        &self,
        e: Error,
        brokers: &TopicBrokers,
        picked: Option<String>,
    ) -> Error {
        if e.is_disconnected() {
            return e;
        }
        let mut name_server_up = false;
        for addr in self.config.namesrv.split(';').filter(|a| !a.is_empty()) {
            if reachable(addr).await {
                name_server_up = true;
                break;
            }
        }
        if !name_server_up {
            return Error::disconnected(KIND, format!("no name server answers: {e}"));
        }
        let probed: Vec<&String> = match picked.as_ref().and_then(|b| brokers.get(b)) {
            Some(addr) => vec![addr],
            None => brokers.values().collect(),
        };
        for addr in probed {
            if !reachable(addr).await {
                return Error::disconnected(KIND, format!("broker {addr} is down: {e}"));
            }
        }
        e
    }

    /// Sends to the queue the tag hashes to; `picked` learns that queue's
    /// broker, so a failure can be told apart (see `classify_send_failure`).
    async fn send(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
        picked: &Arc<Mutex<Option<String>>>,
    ) -> Result<Option<Position>> {
        let message = Message::builder()
            .topic(topic)
            .tags(tag)
            .body(payload)
            .build()
            .map_err(|e| Error::Config(format!("rocketmq message: {e}")))?;
        let guard = self.producer.read().await;
        let Some(producer) = guard.as_ref() else {
            return Err(Error::disconnected(KIND, "the transport was shut down"));
        };
        let picked = picked.clone();
        let sent = producer
            .send_with_selector(
                message,
                move |mqs: &[MessageQueue], _: &Message, tag: &String| {
                    let n = i64::try_from(mqs.len()).ok().filter(|n| *n > 0)?;
                    let i = usize::try_from(i64::from(java_hash(tag)).rem_euclid(n)).ok()?;
                    let mq = mqs.get(i)?;
                    *lock(&picked) = Some(mq.broker_name().to_string());
                    Some(mq.clone())
                },
                tag.to_owned(),
            )
            .await
            .map_err(err)?;
        Ok(sent.and_then(|r| {
            let mq = r.message_queue?;
            let offset = i64::try_from(r.queue_offset).unwrap_or(i64::MAX - 1);
            Some(Position::single(
                partition(mq.broker_name(), mq.queue_id()),
                next_offset(offset),
            ))
        }))
    }

    /// After repeated send failures while the broker accepts connections,
    /// the client's circuit breaker (30 s, no reset) is the likely cause: a
    /// producer under a new instance name gets fresh breakers.
    async fn after_send_failure(&self, topic: &str) {
        {
            let mut f = lock(&self.send_failures);
            f.consecutive = f.consecutive.saturating_add(1);
            let recently = f
                .last_recreate
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
            if f.consecutive < SEND_FAILURES_BEFORE_RECREATE || recently {
                return;
            }
            f.last_recreate = Some(Instant::now());
        }
        let Ok(queues) = self.queues(topic).await else {
            return;
        };
        let mut addrs: Vec<String> = queues.into_iter().map(|q| q.addr).collect();
        addrs.dedup();
        for addr in &addrs {
            if !reachable(addr).await {
                return;
            }
        }
        let Ok(fresh) = self.new_producer().await else {
            return;
        };
        let old = self.producer.write().await.replace(fresh);
        lock(&self.send_failures).consecutive = 0;
        tracing::info!(
            transport = KIND,
            "sends kept failing while the broker is up; recreated the producer"
        );
        if let Some(mut old) = old {
            old.shutdown().await;
        }
    }

    /// The topic's queues, through a short-lived admin.
    async fn queues(&self, topic: &str) -> Result<Vec<QueueRef>> {
        let mut admin = self.admin().await?;
        let result = queues_of(admin.get(), topic).await;
        admin.shutdown().await;
        result
    }

    async fn shutdown(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(mut producer) = self.producer.write().await.take() {
            producer.shutdown().await;
        }
        let _ = self.rt.shutdown().await;
        let owner = lock(&self.owner).take();
        if let Some(owner) = owner {
            let _ = owner.shutdown_tasks().await;
            // Consumes the runtime without blocking, so it is allowed here.
            let _ = owner.shutdown_background();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let Some(owner) = lock(&self.owner).take() else {
            return;
        };
        let producer = self.producer.get_mut().take();
        let rt = self.rt.clone();
        // The shutdown is async and Drop may run inside the application's
        // runtime, where blocking on another runtime panics: a helper thread
        // drives it on the client's own runtime.
        let handle = std::thread::Builder::new()
            .name("cache-sync-rmq-shutdown".into())
            .spawn(move || {
                owner.block_on(async {
                    let steps = async {
                        if let Some(mut p) = producer {
                            p.shutdown().await;
                        }
                        let _ = rt.shutdown().await;
                        let _ = owner.shutdown_tasks().await;
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(5), steps).await;
                });
                let _ = owner.shutdown_background();
            });
        if let Ok(handle) = handle {
            let _ = handle.join();
        }
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

impl RocketMqTransport {
    /// The heartbeat topic of a topic this transport accepts, or
    /// `Unsupported` where the suffix would take it past RocketMQ's topic
    /// length limit: refusing such a topic in `check_topic` would refuse a
    /// name that carries change events fine.
    fn heartbeat_topic(&self, topic: &str) -> Result<String> {
        self.check_topic(topic)?;
        let name = rmq_heartbeat_topic(topic);
        if name.len() > TOPIC_MAX_LENGTH {
            return Err(Error::Unsupported {
                transport: KIND,
                what: "heartbeats on a topic within 3 characters of RocketMQ's topic length limit",
            });
        }
        Ok(name)
    }

    /// Sends to the RocketMQ topic `topic` (already escaped) under `tag`.
    async fn send_to(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        let inner = self.inner.get();
        inner.ensure_open()?;
        let brokers = inner.ensure_topic(topic).await?;
        let picked = Arc::new(Mutex::new(None));
        match inner.send(topic, tag, payload, &picked).await {
            Ok(p) => {
                lock(&inner.send_failures).consecutive = 0;
                Ok(p)
            }
            Err(e) => {
                let picked = lock(&picked).take();
                let e = inner.classify_send_failure(e, &brokers, picked).await;
                // The topic may be gone (a broker that lost its store): look
                // its route up again on the next publish.
                inner.topics.lock().await.remove(topic);
                inner.after_send_failure(topic).await;
                Err(e)
            }
        }
    }

    /// A subscription to the RocketMQ topic `topic` (already escaped) from
    /// `from`, with the tag expression `expression`.
    async fn open(
        &self,
        topic: &str,
        from: &StartFrom,
        expression: &str,
    ) -> Result<RocketMqSubscription> {
        let inner = self.inner.get();
        inner.ensure_open()?;
        // Looked up afresh: subscriptions are rare, and a broker that lost
        // its store has lost the topic with it.
        inner.topics.lock().await.remove(topic);
        inner.ensure_topic(topic).await?;
        let mut admin = inner.admin().await?;
        let plan = plan_start(admin.get(), topic, from).await;
        admin.shutdown().await;
        let plan = plan?;

        let instance = inner.next_name("node");
        let group = inner.next_name("group");
        let instance_dir = inner.offset_dir.join(format!("{CLIENT_IP}@{instance}"));
        seed_offsets(&instance_dir.join(&group), topic, &plan.queues, &plan.seed)?;

        let (tx, rx) = mpsc::channel::<Vec<Received>>(BUFFER_BATCHES);
        let tags = std::sync::Mutex::new(Tags::default());
        let (assigned_tx, mut assigned) = watch::channel(HashSet::new());
        let mut consumer = DefaultMQPushConsumer::builder(inner.rt.clone())
            .client_config(client_config(&inner.config.namesrv, &instance))
            .consumer_group(group.as_str())
            .message_model(MessageModel::Broadcasting)
            .consume_from_where(plan.from_where)
            .consume_message_batch_max_size(32)
            // Filter with this consumer's own expression, not the group's
            // last heartbeat.
            .post_subscription_when_pull(true)
            .message_queue_listener(Some(Arc::new(AssignWatch {
                topic: topic.to_owned(),
                tx: assigned_tx,
            })))
            .build();
        let started = async {
            consumer.subscribe(topic, expression).await.map_err(err)?;
            consumer.register_message_listener_orderly(
                move |msgs: &[&MessageExt],
                      ctx: &mut ConsumeOrderlyContext|
                      -> ClientResult<ConsumeOrderlyStatus> {
                    let batch = received(msgs, &mut lock(&tags));
                    match tx.try_send(batch) {
                        Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {
                            Ok(ConsumeOrderlyStatus::Success)
                        }
                        Err(mpsc::error::TrySendError::Full(_)) => {
                            // The same batch comes again: back-pressure, not loss.
                            ctx.set_suspend_current_queue_time_millis(SUSPEND_MS);
                            Ok(ConsumeOrderlyStatus::SuspendCurrentQueueAMoment)
                        }
                    }
                },
            );
            consumer.start().await.map_err(err)?;
            // start() returns before the rebalance assigns the queues.
            let all: HashSet<MessageQueue> = plan.queues.iter().map(|q| q.mq.clone()).collect();
            tokio::time::timeout(
                Duration::from_secs(10),
                assigned.wait_for(|a| !a.is_empty() && a.is_superset(&all)),
            )
            .await
            .map_err(|_| Error::disconnected(KIND, "queues were not assigned within 10 s"))?
            .map_err(|_| Error::Transport {
                transport: KIND,
                source: "the consumer dropped its queue listener".into(),
            })?;
            Ok::<_, Error>(())
        }
        .await;
        let mut consumer = Consumer {
            consumer: Some(consumer),
            dir: instance_dir,
            _runtime: self.inner.clone(),
        };
        if let Err(e) = started {
            consumer.shutdown().await;
            return Err(e);
        }

        let mut addrs: Vec<String> = plan.queues.iter().map(|q| q.addr.clone()).collect();
        addrs.sort();
        addrs.dedup();
        let (report, brokers) = watch::channel(Brokers::Up);
        let watchdog = tokio::spawn(watchdog(addrs, report));
        Ok(RocketMqSubscription {
            rx,
            buffered: VecDeque::new(),
            position: plan.seed,
            pending: plan.loss,
            brokers,
            watchdog,
            consumer: Some(consumer),
        })
    }
}

/// A heartbeat subscription: a change subscription to the heartbeat topic
/// from its end, handing out payloads one at a time.
#[derive(Debug)]
struct RocketMqHeartbeats {
    subscription: RocketMqSubscription,
    /// Payloads taken from the subscription but not handed out yet; kept so
    /// a cancelled `next` loses nothing.
    read: VecDeque<Bytes>,
}

#[async_trait]
impl HeartbeatSubscription for RocketMqHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            if let Some(payload) = self.read.pop_front() {
                return Ok(payload);
            }
            match self.subscription.next(HEARTBEAT_BATCH).await? {
                Delivery::Batch { records, .. } => {
                    self.read.extend(records.into_iter().map(|r| r.payload));
                }
                // A heartbeat channel may skip: the next beat says it all again.
                Delivery::Lost(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_topics_are_no_topics_escape() {
        for topic in ["x", "x%hb", "x hb", "%68b", "ü"] {
            let hb = rmq_heartbeat_topic(topic);
            assert!(hb.ends_with("%hb"), "{hb}");
            // No topic escapes to a name holding `%h`: the suffix is unique.
            assert!(!rmq_topic(topic).contains("%h"), "{topic}");
        }
        assert_ne!(rmq_heartbeat_topic("x"), rmq_topic("x%hb"));
    }

    #[test]
    fn java_hash_matches_string_hash_code() {
        assert_eq!(java_hash(""), 0);
        assert_eq!(java_hash("a"), 97);
        assert_eq!(java_hash("users"), 111_578_632);
    }

    #[tokio::test]
    async fn connect_refuses_zero_queues_before_any_io() {
        // Nothing listens there; a connection attempt would fail otherwise.
        let e = RocketMqTransport::builder("127.0.0.1:1")
            .queues_per_topic(0)
            .connect()
            .await
            .unwrap_err();
        assert!(e.is_config(), "{e:?}");
        assert!(e.to_string().contains("queues_per_topic"), "{e}");
    }

    #[test]
    fn seeded_offsets_use_the_clients_format() {
        let dir = tempfile::tempdir().unwrap();
        let q = QueueRef {
            mq: MessageQueue::from_parts("t", "broker-a", 2),
            addr: "127.0.0.1:10911".into(),
            name: partition("broker-a", 2),
        };
        let seed = Position::single("broker-a:2", Offset::Seq(25));
        seed_offsets(dir.path(), "t", &[q], &seed).unwrap();
        let text = std::fs::read_to_string(dir.path().join("offsets.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let table = v["offsetTable"].as_object().unwrap();
        let (key, value) = table.iter().next().unwrap();
        let key: serde_json::Value = serde_json::from_str(key).unwrap();
        assert_eq!(key["brokerName"], "broker-a");
        assert_eq!(key["queueId"], 2);
        assert_eq!(value, 25);
    }
}
