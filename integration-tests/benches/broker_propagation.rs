//! NATS JetStream and RocketMQ propagation (issue 4): how long a change takes
//! from `Publisher` to being applied on N nodes over `NatsJetStreamTransport` and
//! `RocketMqTransport`, next to each broker's raw floor measured the same way in the
//! same run with the broker's own client.
//!
//! ```text
//! cargo bench -p integration-tests --bench broker_propagation              # both brokers
//! cargo bench -p integration-tests --bench broker_propagation -- nats      # NATS only
//! cargo bench -p integration-tests --bench broker_propagation -- rocketmq  # RocketMQ only
//! cargo bench -p integration-tests --bench broker_propagation -- nats-cluster rocketmq-brokers
//! ```
//!
//! The last line runs the same rows on clusters (issue 23): three NATS
//! servers with every stream, the transport's and the raw floor's, on all
//! three (`replicas(3)`); and RocketMQ with two brokers, every topic's
//! queues on both (one each).
//!
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a tiny smoke pass over the same code and checks.
//! It starts its own servers on free loopback ports, through
//! `integration_tests::nats_server` (`nats-server -js` with file storage) and
//! `integration_tests::rocketmq_server` (the Rust name server and broker),
//! never the ones on the standard ports.
//!
//! The method is `redis_propagation`'s, from the shared `common` module:
//! stamps taken just before the transport call, each node's own `now -
//! stamp`, one event at a time, an observer that sleeps on the tokio timer,
//! cache-sync and its raw floors taking turns event by event, and a check
//! afterwards that no node counted anything wrong and every node holds the
//! last value. Every node, raw or not, has a client of its own, as separate
//! processes would.
//!
//! Raw floors:
//! - NATS: a JetStream publish awaiting its ack (as the transport publishes)
//!   → one ordered pull consumer per node on a stream configured as the
//!   transport configures its own (file storage, limits retention, the same
//!   pull expiry). A core NATS `publish` → `subscribe` pair runs alongside
//!   as a further reference (no ack, no storage).
//! - RocketMQ: a producer `send` → one BROADCASTING push consumer per node
//!   with the orderly listener, in a group and client instance of its own,
//!   filtering on the same tag, each node on a client runtime of its own, as
//!   the transport runs each transport. Both topics have one queue, as in the
//!   conformance suite, so each consumer long-polls exactly one queue.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]
// Proving the RocketMQ client's futures `Send` (the raw floor awaits them in
// `async_trait` methods) nests deeper than the default limit of 128.
#![recursion_limit = "256"]

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::RequestErrorKind;
use async_nats::jetstream::{self, consumer, stream};
use async_trait::async_trait;
use bytes::Bytes;
use cache_sync::transport::Transport;
use cache_sync::transport::{NatsJetStreamTransport, RocketMqTransport};
use common::{
    CACHE, RawFloor, STALL, Sizes, Slot, System, cache_sync_system, latency_header, latency_intro,
    latency_row, new_slots, now_us, run_footer, run_header, stamp_of,
};
use futures_util::StreamExt;
use integration_tests::nats_cluster::NatsCluster;
use integration_tests::nats_server::NatsServer;
use integration_tests::rocketmq_server::RocketMqServer;
use rocketmq_client_rust::{
    ClientConfig, ClientResult, ClientRuntime, ClientRuntimeConfig, ConsumeOrderlyContext,
    ConsumeOrderlyStatus, DefaultMQAdminExt, DefaultMQProducer, DefaultMQPushConsumer,
    MQPushConsumer, MessageQueueListener, TelemetryHandle, TopicAdmin,
};
use rocketmq_model::common::config::TopicConfig;
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_protocol::protocol::heartbeat::message_model::MessageModel;
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};

const FULL: Sizes = Sizes {
    warmup: 100,
    events: 1500,
    nodes: &[1, 4, 16],
};

const SMOKE: Sizes = Sizes {
    warmup: 3,
    events: 20,
    nodes: &[1, 2],
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    Nats,
    RocketMq,
    NatsCluster,
    RocketMqBrokers,
}

async fn run(s: Sizes, full: bool, workers: usize, brokers: Vec<Broker>) {
    let started = Instant::now();
    println!(
        "date: {}",
        command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
    );
    run_header(full, workers);
    for broker in brokers {
        match broker {
            Broker::Nats => nats_pass(s, false).await,
            Broker::RocketMq => rocketmq_pass(s, 1).await,
            Broker::NatsCluster => nats_pass(s, true).await,
            Broker::RocketMqBrokers => rocketmq_pass(s, 2).await,
        }
    }
    run_footer(started);
}

fn main() {
    // The clients' own logs on stderr (errors only unless RUST_LOG says
    // more): where the RocketMQ client's rough edges show first.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    // `cargo bench -- nats` hands the binary `nats --bench`.
    let mut brokers = Vec::new();
    for arg in std::env::args().skip(1).filter(|a| !a.starts_with('-')) {
        brokers.push(match arg.as_str() {
            "nats" => Broker::Nats,
            "rocketmq" => Broker::RocketMq,
            "nats-cluster" => Broker::NatsCluster,
            "rocketmq-brokers" => Broker::RocketMqBrokers,
            other => panic!(
                "unknown broker {other:?}: expected nats, rocketmq, nats-cluster or rocketmq-brokers"
            ),
        });
    }
    if brokers.is_empty() {
        brokers = vec![Broker::Nats, Broker::RocketMq];
    }
    common::main(move |full, workers| run(if full { FULL } else { SMOKE }, full, workers, brokers));
}

/// The first line a command prints, or "n/a".
fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "n/a".into())
}

// ------------------------------------------------------------ NATS

/// The transport's default, so the raw consumers poll as its nodes do.
const NATS_PULL_EXPIRY: Duration = Duration::from_secs(2);

/// The servers a NATS pass runs on, kept alive for it.
enum NatsServers {
    One(NatsServer),
    Cluster(NatsCluster),
}

async fn nats_pass(s: Sizes, cluster: bool) {
    let (servers, replicas) = if cluster {
        (
            NatsServers::Cluster(tokio::task::block_in_place(NatsCluster::start)),
            3,
        )
    } else {
        (NatsServers::One(NatsServer::start()), 1)
    };
    let url = match &servers {
        NatsServers::One(server) => server.url(),
        NatsServers::Cluster(cluster) => cluster.urls(),
    };
    println!(
        "\n#### NATS JetStream ({}, file storage{})\n",
        command_line("nats-server", &["--version"]),
        if cluster {
            "; 3 servers, every stream on all 3"
        } else {
            ""
        }
    );
    latency_intro(
        s,
        "async-nats: a JetStream publish awaiting its ack → an ordered pull consumer per node",
    );
    latency_header(&["core NATS publish → subscribe p50 / p99"]);
    let url = url.as_str();
    for &n in s.nodes {
        let transport = move || async move {
            let transport = NatsJetStreamTransport::builder(url)
                .replicas(replicas)
                .connect()
                .await
                .expect("connect nats transport");
            Arc::new(transport) as Arc<dyn Transport>
        };
        let systems = vec![
            cache_sync_system(format!("lat-{n}-{}", now_us()), n, transport).await,
            NatsRaw::start(url, NatsKind::JetStream, n, replicas).await,
            NatsRaw::start(url, NatsKind::Core, n, replicas).await,
        ];
        latency_row(
            s,
            "NATS JetStream (raw: publish + ack → ordered consumer)",
            n,
            1,
            systems,
        )
        .await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NatsKind {
    /// JetStream publish, awaiting the ack → an ordered pull consumer per node.
    JetStream,
    /// Core NATS `publish` → a `subscribe` per node: nothing stored, no ack.
    Core,
}

struct NatsRaw {
    kind: NatsKind,
    js: jetstream::Context,
    subject: String,
}

/// A client of `url`: one server, or several comma-separated.
async fn nats_client(url: &str) -> async_nats::Client {
    let servers: Vec<&str> = url.split(',').collect();
    async_nats::connect(servers.as_slice())
        .await
        .expect("connect to nats")
}

/// The stream for `subject`, configured as the transport configures its own.
async fn raw_stream(js: &jetstream::Context, subject: &str, replicas: usize) -> stream::Stream {
    js.get_or_create_stream(stream::Config {
        num_replicas: replicas,
        name: subject.replace('.', "_"),
        subjects: vec![subject.to_owned()],
        max_messages: 100_000,
        retention: stream::RetentionPolicy::Limits,
        discard: stream::DiscardPolicy::Old,
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("raw stream")
}

impl NatsRaw {
    async fn start(url: &str, kind: NatsKind, n: usize, replicas: usize) -> System {
        let subject = format!("raw.{kind:?}-{n}-{}", now_us());
        let js = jetstream::new(nats_client(url).await);
        let slots = new_slots(n);
        let mut tasks = Vec::with_capacity(n);
        for slot in &slots {
            let client = nats_client(url).await;
            let slot = slot.clone();
            let task = match kind {
                NatsKind::JetStream => {
                    let stream = raw_stream(&jetstream::new(client), &subject, replicas).await;
                    let next = stream.cached_info().state.last_sequence + 1;
                    let consumer = stream
                        .create_consumer(consumer::pull::OrderedConfig {
                            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                                start_sequence: next,
                            },
                            max_expires: NATS_PULL_EXPIRY,
                            ..Default::default()
                        })
                        .await
                        .expect("ordered consumer");
                    let mut messages = consumer.messages().await.expect("consumer messages");
                    tokio::spawn(async move {
                        while let Some(Ok(m)) = messages.next().await {
                            slot.observe(stamp_of(&m.payload));
                        }
                    })
                }
                NatsKind::Core => {
                    let mut sub = client.subscribe(subject.clone()).await.expect("SUB");
                    // A request on the same connection is answered (here: no
                    // responders) only after the server has handled the SUB
                    // before it, so the first publish cannot overtake the
                    // subscription.
                    let reply = client.request("bench.sync", Bytes::new()).await;
                    let no_responders =
                        matches!(&reply, Err(e) if e.kind() == RequestErrorKind::NoResponders);
                    assert!(no_responders, "round trip after SUB: {reply:?}");
                    tokio::spawn(async move {
                        while let Some(m) = sub.next().await {
                            slot.observe(stamp_of(&m.payload));
                        }
                    })
                }
            };
            tasks.push(task);
        }
        System::raw(Self { kind, js, subject }, slots, tasks)
    }
}

#[async_trait]
impl RawFloor for NatsRaw {
    async fn publish(&self) {
        let payload = Bytes::from(now_us().to_string());
        match self.kind {
            NatsKind::JetStream => {
                self.js
                    .publish(self.subject.clone(), payload)
                    .await
                    .expect("publish")
                    .await
                    .expect("publish ack");
            }
            NatsKind::Core => {
                self.js
                    .client()
                    .publish(self.subject.clone(), payload)
                    .await
                    .expect("publish");
            }
        }
    }
}

// ------------------------------------------------------------ RocketMQ

const SEND_TIMEOUT_MS: u32 = 3000;

async fn rocketmq_pass(s: Sizes, brokers: usize) {
    let server = RocketMqServer::start_with_brokers(brokers);
    let namesrv = server.namesrv_addr();
    let namesrv = namesrv.as_str();
    if brokers == 1 {
        println!(
            "\n#### RocketMQ (Rust name server and broker, client 1.0.0; one queue per topic)\n"
        );
    } else {
        println!(
            "\n#### RocketMQ (Rust name server and {brokers} brokers, client 1.0.0; one queue per \
             topic on each broker)\n"
        );
    }
    latency_intro(
        s,
        "rocketmq-client-rust: a producer send → a broadcasting push consumer per node",
    );
    latency_header(&[]);
    for &n in s.nodes {
        // Every transport the nodes and the publisher use, to shut down after the row.
        let transports = Mutex::new(Vec::new());
        let made = &transports;
        let transport = move || async move {
            let transport = RocketMqTransport::builder(namesrv)
                .queues_per_topic(1)
                .connect()
                .await
                .expect("connect rocketmq transport");
            made.lock().expect("transports").push(transport.clone());
            Arc::new(transport) as Arc<dyn Transport>
        };
        let systems = vec![
            cache_sync_system(format!("lat-{n}-{}", now_us()), n, transport).await,
            RmqRaw::start(&server, n).await,
        ];
        latency_row(
            s,
            "RocketMQ (raw: send → broadcasting push consumer)",
            n,
            0,
            systems,
        )
        .await;
        for transport in transports.into_inner().expect("transports") {
            transport.shutdown().await;
        }
    }
}

/// A client runtime of its own, as each `RocketMqTransport` has.
struct RmqRuntime {
    owner: RuntimeOwner,
    rt: Arc<ClientRuntime>,
}

impl RmqRuntime {
    fn new() -> Self {
        // The transport's sizing.
        let owner = RuntimeOwner::plan(RuntimeConfig::for_parallelism("bench-rmq", 2))
            .expect("runtime plan")
            .build()
            .expect("runtime");
        let rt = ClientRuntime::try_new(
            owner.root_context().component("client"),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        )
        .expect("client runtime");
        Self { owner, rt }
    }

    /// The order the client needs: its runtime, then the owner's tasks, then
    /// the owner itself (without blocking, as this runs inside tokio).
    async fn shutdown(self) {
        let _ = self.rt.shutdown().await;
        let _ = self.owner.shutdown_tasks().await;
        let _ = self.owner.shutdown_background();
    }
}

fn rmq_config(namesrv: &str, instance: &str) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set_namesrv_addr(namesrv.into());
    cc.set_instance_name(instance.into());
    // Part of the client id, which names the offsets directory.
    cc.set_client_ip("127.0.0.1".into());
    cc
}

/// Where the client keeps a broadcasting consumer's offsets: the rule of its
/// `LocalFileOffsetStore`.
fn rmq_offset_dir(instance: &str) -> PathBuf {
    let root = std::env::var_os("rocketmq.client.localOffsetStoreDir").map_or_else(
        || PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".rocketmq_offsets"),
        PathBuf::from,
    );
    root.join(format!("127.0.0.1@{instance}"))
}

/// Tells when the rebalance has given the consumer its queue, so the run
/// starts with every consumer about to pull, as every node's subscription
/// does.
struct Assigned {
    topic: String,
    ready: Arc<AtomicBool>,
}

impl MessageQueueListener for Assigned {
    fn message_queue_changed(
        &self,
        topic: &str,
        _all: &std::collections::HashSet<MessageQueue>,
        assigned: &std::collections::HashSet<MessageQueue>,
    ) {
        if topic == self.topic && !assigned.is_empty() {
            self.ready.store(true, Ordering::Release);
        }
    }
}

/// One raw node: a push consumer on a runtime of its own.
struct RmqNode {
    consumer: DefaultMQPushConsumer,
    runtime: RmqRuntime,
    offsets: PathBuf,
}

struct RmqRaw {
    producer: DefaultMQProducer,
    producer_runtime: RmqRuntime,
    topic: String,
    nodes: Mutex<Vec<RmqNode>>,
}

impl RmqRaw {
    async fn start(server: &RocketMqServer, n: usize) -> System {
        let namesrv = server.namesrv_addr();
        let id = format!("bench-raw-{}-{}", std::process::id(), now_us());
        let topic = format!("raw-{n}-{}", now_us());
        let producer_runtime = RmqRuntime::new();
        create_topic(&producer_runtime, server, &topic, &id).await;
        let mut producer = DefaultMQProducer::builder(producer_runtime.rt.clone())
            .client_config(rmq_config(&namesrv, &format!("{id}-producer")))
            .producer_group(format!("{id}-producer"))
            .send_msg_timeout(SEND_TIMEOUT_MS)
            .build();
        producer.start().await.expect("start producer");
        let slots = new_slots(n);
        let mut nodes = Vec::with_capacity(n);
        for (k, slot) in slots.iter().enumerate() {
            nodes.push(rmq_node(&namesrv, &topic, &format!("{id}-node-{k}"), slot.clone()).await);
        }
        let floor = Self {
            producer,
            producer_runtime,
            topic,
            nodes: Mutex::new(nodes),
        };
        // The client's own runtimes run the receivers.
        System::raw(floor, slots, Vec::new())
    }
}

/// The topic with one queue on each broker, through an admin client, once
/// the name server routes every one.
async fn create_topic(runtime: &RmqRuntime, server: &RocketMqServer, topic: &str, id: &str) {
    let mut admin = DefaultMQAdminExt::new(runtime.rt.clone());
    admin.set_namesrv_addr(server.namesrv_addr().as_str());
    admin
        .client_config_mut()
        .set_instance_name(format!("{id}-admin").into());
    admin.client_config_mut().set_client_ip("127.0.0.1".into());
    admin.start().await.expect("start admin");
    for i in 0..server.brokers() {
        TopicAdmin::create_and_update_topic_config(
            &admin,
            server.broker_addr_of(i).into(),
            TopicConfig::with_queues(topic, 1, 1),
        )
        .await
        .expect("create topic");
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // The name server answers a topic it does not know yet with an error.
        if let Ok(Some(route)) = TopicAdmin::examine_topic_route_info(&admin, topic.into()).await
            && route.queue_datas.len() >= server.brokers()
        {
            break;
        }
        assert!(Instant::now() < deadline, "topic {topic} has no route");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    admin.shutdown().await;
}

/// A broadcasting push consumer set up as the transport sets up each node's,
/// recording each message's stamp in `slot`; returns once its queue is
/// assigned.
async fn rmq_node(namesrv: &str, topic: &str, instance: &str, slot: Arc<Slot>) -> RmqNode {
    let runtime = RmqRuntime::new();
    let group = format!("{instance}-group");
    let offsets = rmq_offset_dir(instance);
    // The client never creates this directory itself.
    std::fs::create_dir_all(offsets.join(&group)).expect("offsets dir");
    let ready = Arc::new(AtomicBool::new(false));
    let mut consumer = DefaultMQPushConsumer::builder(runtime.rt.clone())
        .client_config(rmq_config(namesrv, instance))
        .consumer_group(group.as_str())
        .message_model(MessageModel::Broadcasting)
        // The topic is new and empty, so its first offset is where the run
        // starts, as the transport's seeded offsets are. From the last offset
        // is resolved again at the first pull, about 0.5 s after the orderly
        // service locks the assigned queue, and would skip what was sent in
        // between.
        .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
        .consume_message_batch_max_size(32)
        .post_subscription_when_pull(true)
        .message_queue_listener(Some(Arc::new(Assigned {
            topic: topic.to_owned(),
            ready: ready.clone(),
        })))
        .build();
    consumer.subscribe(topic, CACHE).await.expect("subscribe");
    consumer.register_message_listener_orderly(
        move |msgs: &[&MessageExt],
              _: &mut ConsumeOrderlyContext|
              -> ClientResult<ConsumeOrderlyStatus> {
            for m in msgs {
                slot.observe(stamp_of(&m.body().unwrap_or_default()));
            }
            Ok(ConsumeOrderlyStatus::Success)
        },
    );
    consumer.start().await.expect("start consumer");
    let started = Instant::now();
    while !ready.load(Ordering::Acquire) {
        assert!(started.elapsed() < STALL, "queue not assigned in {STALL:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    RmqNode {
        consumer,
        runtime,
        offsets,
    }
}

#[async_trait]
impl RawFloor for RmqRaw {
    async fn publish(&self) {
        let message = Message::builder()
            .topic(self.topic.as_str())
            .tags(CACHE)
            .body(Bytes::from(now_us().to_string()))
            .build()
            .expect("message");
        self.producer.send(message).await.expect("send");
    }

    async fn close(self: Box<Self>) {
        let Self {
            mut producer,
            producer_runtime,
            nodes,
            ..
        } = *self;
        for mut node in nodes.into_inner().expect("nodes") {
            node.consumer.shutdown().await;
            node.runtime.shutdown().await;
            let _ = std::fs::remove_dir_all(&node.offsets);
        }
        producer.shutdown().await;
        producer_runtime.shutdown().await;
    }
}
