//! Publishing: the producer, the topic it sends to (created on first use,
//! then waited for until the name server routes it), and what a failed send
//! means (a broker down, or the client's circuit breaker, which a new
//! producer escapes). Subscriptions use only `ensure_topic` from here.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rocketmq_client_rust::{DefaultMQProducer, RouteAdmin, TopicAdmin};
use rocketmq_model::common::config::TopicConfig;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_protocol::protocol::route::topic_route_data::TopicRouteData;

use super::super::Position;
use super::*;
use crate::error::{Error, Result};
use crate::util::lock;

const SEND_TIMEOUT_MS: u64 = 3000;
/// Consecutive send failures before the producer is suspected stuck behind
/// the client's circuit breaker.
const SEND_FAILURES_BEFORE_RECREATE: u32 = 3;

/// How long a created topic's route may take to reach the name server:
/// longer than the broker's default registration period (30 s), which
/// repairs a registration that failed.
const ROUTE_WAIT: Duration = Duration::from_secs(45);

/// A route slower than this to appear is logged: the broker's registration
/// with the name server failed or was slow.
const ROUTE_WAIT_WARN: Duration = Duration::from_secs(1);

/// How long a broker found down is left out of the queue choice: its
/// route stays with the name server and the client for a while after it
/// died. Past this it is tried again; a send that finds it still down
/// leaves it out again and goes elsewhere.
const AVOID_FOR: Duration = Duration::from_secs(10);

#[derive(Debug, Default)]
pub(super) struct SendFailures {
    consecutive: u32,
    last_recreate: Option<Instant>,
    /// Brokers found down, by name, with when they may be tried again.
    avoid: HashMap<String, Instant>,
}

impl SendFailures {
    /// The brokers to leave out now; those whose time is up are forgotten.
    fn avoided(&mut self) -> HashSet<String> {
        let now = Instant::now();
        self.avoid.retain(|_, until| *until > now);
        self.avoid.keys().cloned().collect()
    }
}

impl Inner {
    pub(super) async fn new_producer(&self) -> Result<DefaultMQProducer> {
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

    /// Creates the topic with the configured number of queues on every
    /// master broker, once per topic and transport.
    pub(super) async fn ensure_topic(&self, topic: &str) -> Result<TopicBrokers> {
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
            let cluster = RouteAdmin::examine_broker_cluster_info(a)
                .await
                .map_err(err)?;
            let masters: TopicBrokers = cluster
                .broker_addr_table
                .iter()
                .flatten()
                .filter_map(|(_, b)| {
                    let addr = b.broker_addrs().get(&0)?;
                    Some((b.broker_name().to_string(), addr.to_string()))
                })
                .collect();
            // Masters without the topic: all of them for a new topic, and a
            // broker that came back without its store (wiped, or replaced)
            // for one that exists. Its queues are made again, so that its
            // readers find its offsets behind their positions and report
            // what it lost.
            let lacking: Vec<(&String, &String)> = masters
                .iter()
                .filter(|(name, _)| {
                    !found
                        .iter()
                        .flat_map(|r| &r.broker_datas)
                        .any(|b| b.broker_name().as_str() == name.as_str())
                })
                .collect();
            if found.is_none() && masters.is_empty() {
                return Err(Error::disconnected(KIND, "no master broker registered"));
            }
            let mut made = Vec::with_capacity(lacking.len());
            for (name, addr) in lacking {
                let config =
                    TopicConfig::with_queues(topic, self.config.queues, self.config.queues);
                match TopicAdmin::create_and_update_topic_config(a, addr.as_str().into(), config)
                    .await
                {
                    Ok(()) => made.push(name),
                    // The others serve the topic meanwhile.
                    Err(e) if found.is_some() => {
                        tracing::warn!(topic, broker = %name, error = %e,
                            "could not make the topic's queues on a broker that lacks them");
                    }
                    Err(e) => return Err(err(e)),
                }
            }
            if !made.is_empty() {
                // The name server learns the route when the broker registers
                // the topic with it: at once on a quiet machine. That
                // registration has a 3 s timeout, and one that fails (a
                // debug broker beside a full test run on 2 cores) is only
                // repaired by the broker's periodic registration, every 30 s
                // by default, so the wait outlasts one period.
                let routed = |found: &Option<TopicRouteData>| {
                    made.iter().all(|name| {
                        found
                            .iter()
                            .flat_map(|r| &r.broker_datas)
                            .any(|b| b.broker_name().as_str() == name.as_str())
                    })
                };
                let started = Instant::now();
                loop {
                    found = route(a, topic).await?;
                    if routed(&found) {
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
                        if found.is_some() {
                            // Used as it is; the next look-up tries again.
                            tracing::warn!(
                                topic,
                                "a broker's queues of the topic, made again, \
                                were not routed {} s later",
                                ROUTE_WAIT.as_secs()
                            );
                            break;
                        }
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

    /// Sends to the queue the tag hashes to, so that a cache's events keep
    /// one queue and their order; if that queue's broker was found down, to
    /// a queue of another broker the tag hashes to among those. `picked`
    /// learns the queue's broker, so a failure can be told apart (see
    /// `classify_send_failure`).
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
        let avoid = lock(&self.send_failures).avoided();
        let sent = producer
            .send_with_selector(
                message,
                move |mqs: &[MessageQueue], _: &Message, tag: &String| {
                    // The tag's place among `n` queues.
                    let at = |n: usize| {
                        let n = i64::try_from(n).ok().filter(|n| *n > 0)?;
                        usize::try_from(i64::from(java_hash(tag)).rem_euclid(n)).ok()
                    };
                    let mut mq = mqs.get(at(mqs.len())?)?;
                    if avoid.contains(mq.broker_name().as_str()) {
                        let up: Vec<&MessageQueue> = mqs
                            .iter()
                            .filter(|q| !avoid.contains(q.broker_name().as_str()))
                            .collect();
                        if let Some(q) = at(up.len()).and_then(|i| up.get(i)) {
                            mq = q;
                        }
                    }
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

    /// After a failed send: whether the broker it went to is down while the
    /// topic has another, which is then left out for a while.
    async fn went_down(&self, brokers: &TopicBrokers, picked: &Mutex<Option<String>>) -> bool {
        let Some(name) = lock(picked).clone() else {
            return false;
        };
        if !brokers.keys().any(|b| *b != name) {
            return false;
        }
        // Out of the route the send was made with: the name server dropped
        // it (it does at once when a broker's connection closes), while the
        // client's own copy of the route, refreshed every 30 s, still had it.
        if let Some(addr) = brokers.get(&name)
            && reachable(addr).await
        {
            return false;
        }
        tracing::warn!(transport = KIND, broker = %name,
            "a broker is down; its caches' events go to the others for now");
        lock(&self.send_failures).avoid.insert(
            name,
            Instant::now()
                .checked_add(AVOID_FOR)
                .unwrap_or_else(Instant::now),
        );
        true
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
}

impl RocketMqTransport {
    /// Sends to the RocketMQ topic `topic` (already escaped) under `tag`.
    pub(super) async fn send_to(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<Option<Position>> {
        let inner = self.inner.get();
        inner.ensure_open()?;
        let brokers = inner.ensure_topic(topic).await?;
        let picked = Arc::new(Mutex::new(None));
        let mut sent = inner.send(topic, tag, payload.clone(), &picked).await;
        if sent.is_err() && inner.went_down(&brokers, &picked).await {
            // Once, on another broker: the cache's events change queue, and
            // a node that reads the old queue's rest late applies it as
            // invalidations (a later number of the publisher came first).
            sent = inner.send(topic, tag, payload, &picked).await;
        }
        match sent {
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
}
