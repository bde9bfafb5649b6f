//! The push consumer behind a subscription: opening it at its planned
//! offsets, and the records it hands over.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rocketmq_client_rust::{
    ClientResult, ConsumeOrderlyContext, ConsumeOrderlyStatus, DefaultMQPushConsumer,
    MQPushConsumer, MessageQueueListener,
};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_protocol::protocol::heartbeat::message_model::MessageModel;
use tokio::sync::{mpsc, watch};

use super::super::{Delivery, Loss, Offset, Position, Record, StartFrom, Subscription, Tags};
use super::*;
use crate::error::{Error, Result};
use crate::transport::names::{self};
use crate::util::lock;

/// Reports the queues the rebalance assigned (it runs about 1 s after start).
pub(super) struct AssignWatch {
    pub(super) topic: String,
    pub(super) tx: watch::Sender<HashSet<MessageQueue>>,
}

impl MessageQueueListener for AssignWatch {
    fn message_queue_changed(
        &self,
        topic: &str,
        _all: &HashSet<MessageQueue>,
        assigned: &HashSet<MessageQueue>,
    ) {
        if topic == self.topic {
            self.tx.send_replace(assigned.clone());
        }
    }
}

/// A message as the listener hands it over: the record, and where it
/// leaves its queue.
pub(super) struct Received {
    record: Record,
    /// `<broker>:<queue>`, shared by the messages of one queue.
    queue: Arc<str>,
    /// The queue's offset after this message.
    next: Offset,
    anchor: Anchor,
}

/// What the listener passes on from one call: a call's messages come from
/// one queue, so its name is made once.
pub(super) fn received(msgs: &[&MessageExt], tags: &mut Tags) -> Vec<Received> {
    let mut queue: Option<Arc<str>> = None;
    let mut out = Vec::with_capacity(msgs.len());
    for m in msgs {
        let name = partition(m.broker_name(), m.queue_id());
        let queue = match &queue {
            Some(q) if **q == *name => q.clone(),
            _ => queue.insert(Arc::from(name)).clone(),
        };
        out.push(Received {
            record: record(m, tags),
            queue,
            next: next_offset(m.queue_offset()),
            anchor: Anchor::of(m),
        });
    }
    out
}

fn record(m: &MessageExt, tags: &mut Tags) -> Record {
    // A tag that no escape produced came from another producer: left out,
    // the consumer routes the event by its header instead.
    let tag = m
        .get_tags()
        .and_then(|t| names::unescape(t.as_str()).map(|c| tags.get(&c)));
    // Its offset in its queue; the batch's position names the queue.
    let offset = Offset::Seq(u64::try_from(m.queue_offset()).unwrap_or(0));
    Record::new(tag, m.body().unwrap_or_default()).at(offset)
}

/// A started consumer, shut down and its scratch offsets removed when the
/// subscription ends.
pub(super) struct Consumer {
    pub(super) consumer: Option<DefaultMQPushConsumer>,
    pub(super) dir: PathBuf,
    /// Keeps the client runtime alive until this consumer is shut down.
    pub(super) _runtime: Arc<dyn Shared>,
}

impl Consumer {
    pub(super) async fn shutdown(&mut self) {
        if let Some(mut c) = self.consumer.take() {
            c.shutdown().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(super) struct RocketMqSubscription {
    pub(super) rx: mpsc::Receiver<Vec<Received>>,
    /// Records received but not yet handed out; kept so a cancelled or short
    /// `next` loses nothing.
    pub(super) buffered: VecDeque<Received>,
    pub(super) position: Position,
    pub(super) pending: Option<Loss>,
    pub(super) brokers: watch::Receiver<Brokers>,
    /// Set when the consumer offered messages of a queue the plan did not
    /// check (its broker was down then, or joined the topic's route since).
    pub(super) stray: watch::Receiver<bool>,
    pub(super) watchdog: tokio::task::JoinHandle<()>,
    pub(super) consumer: Option<Consumer>,
}

impl fmt::Debug for RocketMqSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RocketMqSubscription")
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

impl Drop for RocketMqSubscription {
    fn drop(&mut self) {
        self.watchdog.abort();
        let Some(mut consumer) = self.consumer.take() else {
            return;
        };
        // Shutting a consumer down is async; without a runtime it is left to
        // the transport's own shutdown.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move { consumer.shutdown().await });
        }
    }
}

#[async_trait]
impl Subscription for RocketMqSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if let Some(loss) = self.pending.take() {
            return Ok(Delivery::Lost(loss));
        }
        if self.buffered.is_empty() {
            tokio::select! {
                batch = self.rx.recv() => match batch {
                    Some(b) => self.buffered.extend(b),
                    None => return Err(Error::disconnected(KIND, "the consumer stopped")),
                },
                Ok(_) = self.stray.wait_for(|s| *s) => {
                    return Err(Error::Transport {
                        transport: KIND,
                        source: "the consumer offered messages of a queue whose history was \
                                 not checked; the consumer starts afresh to check it"
                            .into(),
                    });
                }
                Ok(state) = self.brokers.wait_for(|b| *b != Brokers::Up) => {
                    // Ending here shows the outage at once (the node stops
                    // reporting itself healthy), and a fresh consumer does
                    // not wait out the client's 30 s pull timeout.
                    return Err(match *state {
                        Brokers::Down => Error::disconnected(KIND, "a broker went down"),
                        Brokers::Returned => Error::Transport {
                            transport: KIND,
                            source: "a broker that was down is back; the consumer starts \
                                     afresh to read its queues from where it stopped"
                                .into(),
                        },
                        _ => Error::disconnected(
                            KIND,
                            "a broker closed its connection; the consumer starts afresh",
                        ),
                    });
                }
            }
        }
        while self.buffered.len() < max {
            match self.rx.try_recv() {
                Ok(b) => self.buffered.extend(b),
                Err(_) => break,
            }
        }
        let n = self.buffered.len().min(max.max(1));
        let mut records = Vec::with_capacity(n);
        // The newest anchor per queue, written into the position once per
        // batch rather than once per record.
        let mut last: Vec<(Arc<str>, Offset, Anchor)> = Vec::new();
        for r in self.buffered.drain(..n) {
            match last
                .iter_mut()
                .find(|(q, ..)| Arc::ptr_eq(q, &r.queue) || *q == r.queue)
            {
                Some((_, next, anchor)) => (*next, *anchor) = (r.next, r.anchor),
                None => last.push((r.queue, r.next, r.anchor)),
            }
            records.push(r.record);
        }
        for (queue, next, anchor) in last {
            self.position.set(&*queue, next);
            self.position
                .set(anchor_partition(&queue), anchor.to_offset());
        }
        Ok(Delivery::Batch {
            records,
            position: self.position.clone(),
        })
    }

    fn position(&self) -> Option<Position> {
        Some(self.position.clone())
    }
}

/// Batches the listener may park in a subscription before it pushes back.
const BUFFER_BATCHES: usize = 64;
/// How long the client holds a queue back after the buffer was full.
const SUSPEND_MS: i64 = 50;
/// How long it holds back a queue the plan did not check, until the
/// subscription ends.
const STRAY_SUSPEND_MS: i64 = 1000;

impl RocketMqTransport {
    /// A subscription to the RocketMQ topic `topic` (already escaped) from
    /// `from`, with the tag expression `expression`.
    pub(super) async fn open(
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
        let planned: HashSet<String> = plan.queues.iter().map(|q| q.name.clone()).collect();
        let (stray_tx, stray) = watch::channel(false);
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
                    // A call's messages come from one queue. One the plan
                    // did not check may hold another history than the
                    // position says: nothing of it passes before a new
                    // subscription checked it.
                    if let Some(m) = msgs.first()
                        && !planned.contains(&partition(m.broker_name(), m.queue_id()))
                    {
                        stray_tx.send_replace(true);
                        ctx.set_suspend_current_queue_time_millis(STRAY_SUSPEND_MS);
                        return Ok(ConsumeOrderlyStatus::SuspendCurrentQueueAMoment);
                    }
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
        // A broker that was down is back once it accepts connections and
        // the name server lists it again (so that its queues, made again if
        // it lost its store, are in the topic's route for the next plan).
        let shared = self.inner.clone();
        let missing = plan.missing;
        let returned = async move {
            if missing.is_empty() {
                return std::future::pending().await;
            }
            // A broker known by name only is asked of the name server, a
            // heavier call: every 2 s for five minutes, as a restart takes,
            // then every 30 s (it may have been taken out for good, while
            // positions still name it).
            // One request to the name server per poll, however many
            // brokers a position names.
            for poll in 0u64.. {
                tokio::time::sleep(RETURN_POLL).await;
                let mut asked = Vec::new();
                for (name, addr) in &missing {
                    let up = match addr {
                        Some(addr) => reachable(addr).await,
                        None if poll < 600 => poll % 4 == 3,
                        None => poll % 60 == 59,
                    };
                    if up {
                        asked.push(name.as_str());
                    }
                }
                if shared.get().registered(&asked).await {
                    return;
                }
            }
        };
        let watchdog = tokio::spawn(watchdog(addrs, returned, report));
        Ok(RocketMqSubscription {
            rx,
            buffered: VecDeque::new(),
            position: plan.seed,
            pending: plan.loss,
            brokers,
            stray,
            watchdog,
            consumer: Some(consumer),
        })
    }
}
