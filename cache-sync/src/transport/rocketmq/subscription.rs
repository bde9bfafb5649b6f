//! The push consumer behind a subscription: opening it at its planned
//! offsets, and the records it hands over.

use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use rocketmq_client_rust::ConsumerAdmin;
use rocketmq_client_rust::{
    ClientResult, ConsumeOrderlyContext, ConsumeOrderlyStatus, DefaultMQPushConsumer,
    MQPushConsumer, MessageQueueListener, OffsetStore, ReadOffsetType,
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

/// What the listener (or the skip watch) hands over: a record and where it
/// leaves its queue, or only how far the consumer has read past.
pub(super) struct Received {
    /// `None` for a skip: the consumer moved past messages the broker
    /// filtered out (other caches' tags).
    record: Option<Record>,
    /// `<broker>:<queue>` for a record, shared by the messages of one
    /// queue; its [`read_past`] partition for a skip.
    queue: Arc<str>,
    /// The queue's offset after this message (or skip).
    next: Offset,
    /// The message itself, naming the queue's history; `None` for a skip.
    anchor: Option<Anchor>,
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
            record: Some(record(m, tags)),
            queue,
            next: next_offset(m.queue_offset()),
            anchor: Some(Anchor::of(m)),
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
    /// Ends the task that hands over the consumer's moves past filtered
    /// messages (which then shuts its admin client down).
    pub(super) skips: Option<watch::Sender<bool>>,
    /// Its connections to the brokers it reads, which vouch for the tails
    /// its node proves against.
    pub(super) watch: Arc<Watch>,
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
        self.watch.unsettle();
        self.watchdog.abort();
        if let Some(skips) = &self.skips {
            skips.send_replace(true);
        }
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
        // A batch of skips that move nothing (the consumer's offset where
        // its records already took the position) is not handed out.
        loop {
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
            // The newest place and anchor per queue, written into the position
            // once per batch rather than once per record.
            let mut last: Vec<(Arc<str>, Offset, Option<Anchor>)> = Vec::new();
            for r in self.buffered.drain(..n) {
                match last
                    .iter_mut()
                    .find(|(q, ..)| Arc::ptr_eq(q, &r.queue) || *q == r.queue)
                {
                    Some((_, next, anchor)) => {
                        if !matches!((&*next, &r.next), (Offset::Seq(a), Offset::Seq(b)) if a > b) {
                            *next = r.next;
                        }
                        if r.anchor.is_some() {
                            *anchor = r.anchor;
                        }
                    }
                    None => last.push((r.queue, r.next, r.anchor)),
                }
                if let Some(record) = r.record {
                    records.push(record);
                }
            }
            let mut moved = false;
            for (queue, next, anchor) in last {
                // A skip never moves back: one read before a record was
                // handed over names an offset that record already passed.
                if anchor.is_none()
                    && let (Some(Offset::Seq(at)), Offset::Seq(to)) =
                        (self.position.get(&queue), &next)
                    && at >= to
                {
                    continue;
                }
                moved = true;
                self.position.set(&*queue, next);
                if let Some(anchor) = anchor {
                    self.position
                        .set(anchor_partition(&queue), anchor.to_offset());
                }
            }
            if records.is_empty() && !moved {
                continue;
            }
            return Ok(Delivery::Batch {
                records,
                position: self.position.clone(),
            });
        }
    }

    fn position(&self) -> Option<Position> {
        Some(self.position.clone())
    }
}

/// The tag codes a tag expression (`a||b`, or `*` for all) takes.
fn tag_codes(expression: &str) -> Option<HashSet<i64>> {
    if expression.trim() == "*" {
        return None;
    }
    Some(
        expression
            .split("||")
            .map(|t| i64::from(java_hash(t.trim())))
            .collect(),
    )
}

/// How often the consumer's own offsets are read for moves past filtered
/// messages.
const SKIP_CHECK: Duration = Duration::from_millis(50);

/// Entries of a queue one look past the consumer reads at most; a longer
/// run of other caches' messages takes several tails.
const PROBE_ENTRIES: u64 = 256;

/// What the skip watch needs: the consumer's offset store, the queues it
/// reads and where the subscription began on each.
struct Skips {
    store: Arc<OffsetStore>,
    queues: Vec<QueueRef>,
    /// Each queue's read-past mark as last handed over.
    at: Position,
    /// Weak: the channel still closes when the consumer's listener goes.
    tx: mpsc::WeakSender<Vec<Received>>,
    /// The topic's newest tail, as the node's freshness checks read it.
    tails: watch::Receiver<Option<Position>>,
    /// The tag codes this subscription takes (Java's `hashCode` of each
    /// tag, as the broker stores and filters them); `None` for all tags.
    ours: Option<HashSet<i64>>,
    topic: String,
    shared: Arc<dyn Shared>,
    admin: Option<Admin>,
    stop: watch::Receiver<bool>,
}

/// Hands the subscription the consumer's moves past messages the broker
/// filtered out (other caches' tags), which no record shows: without them
/// the position would stay at this node's last message in each queue and
/// never [cover](RocketMqTransport::covers) the queue's end (the freshness
/// bound) once another cache's message is last there.
///
/// Two sources. The consumer's own offset, which the client moves past
/// filtered messages when a pull finds nothing else. And, because a pull
/// that found nothing is held by the broker until a message *for it*
/// arrives or 15 s pass (the client's fixed long-poll time), a look at the
/// queue's index from the consumer's offset up to the newest tail's end
/// when a tail names more than the consumer has read: a run of entries
/// whose tag codes are none of this subscription's is passed at once. A
/// tag whose code collides with one of ours stops the run (its message
/// comes through the consumer, which filters by the tag itself).
///
/// The moves go under each queue's [`read_past`] partition, never into the
/// queue's own offset, which stays the place a later subscription resumes
/// from, anchored to the message just before it: the messages passed are
/// pulled (and filtered) again then, and a history replaced among them
/// (lost with a broker's unflushed pages, say) is still checked.
///
/// The consumer moves its offset past a message only after the listener
/// handed the message over (or the broker filtered it out); a move is read
/// after that and sent through the same channel, so it arrives behind every
/// record before it.
async fn watch_skips(mut s: Skips) {
    skip_loop(&mut s).await;
    if let Some(mut admin) = s.admin.take() {
        admin.shutdown().await;
    }
}

async fn skip_loop(s: &mut Skips) {
    let names: Vec<Arc<str>> = s
        .queues
        .iter()
        .map(|q| Arc::from(read_past(&q.name)))
        .collect();
    let mut tick = tokio::time::interval(SKIP_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let probe = tokio::select! {
            _ = s.stop.wait_for(|stop| *stop) => return,
            _ = tick.tick() => None,
            changed = s.tails.changed() => match changed {
                Ok(()) => s.tails.borrow_and_update().clone(),
                Err(_) => return,
            },
        };
        let mut batch = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let stored = s
                .store
                .read_offset(&s.queues[i].mq, ReadOffsetType::ReadFromMemory)
                .await;
            // -1 until the client has loaded the queue's offset.
            let Ok(stored) = u64::try_from(stored) else {
                continue;
            };
            let marked = match s.at.get(name) {
                Some(Offset::Seq(at)) => *at,
                _ => 0,
            };
            let mut past = stored.max(marked);
            if let Some(Offset::Seq(end)) = probe.as_ref().and_then(|t| t.get(&s.queues[i].name))
                && *end > past
                && s.ours.is_some()
            {
                let end = *end;
                past = past.saturating_add(others_from(s, i, past, end).await);
            }
            if past > marked {
                batch.push(Received {
                    record: None,
                    queue: name.clone(),
                    next: Offset::Seq(past),
                    anchor: None,
                });
            }
        }
        if batch.is_empty() {
            continue;
        }
        let sent: Vec<(Arc<str>, Offset)> = batch
            .iter()
            .map(|r| (r.queue.clone(), r.next.clone()))
            .collect();
        let Some(tx) = s.tx.upgrade() else {
            return;
        };
        match tx.try_send(batch) {
            Ok(()) => {
                for (name, next) in sent {
                    s.at.set(&*name, next);
                }
            }
            // Full: records are waiting, and the next check comes after them.
            Err(mpsc::error::TrySendError::Full(_)) => {}
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    }
}

/// How many entries of queue `i` from offset `from` (below `end`) in a row
/// carry other caches' tags: 0 where the first is ours, or the broker does
/// not answer (then the next tail asks again, on a fresh admin client).
async fn others_from(s: &mut Skips, i: usize, from: u64, end: u64) -> u64 {
    let Some(ours) = &s.ours else {
        return 0;
    };
    if s.admin.is_none() {
        s.admin = s.shared.get().admin().await.ok();
    }
    let Some(admin) = &s.admin else {
        return 0;
    };
    let q = &s.queues[i];
    let count = i32::try_from(end.saturating_sub(from).min(PROBE_ENTRIES)).unwrap_or(1);
    let answer = tokio::time::timeout(
        Duration::from_millis(ADMIN_TIMEOUT_MS),
        ConsumerAdmin::query_consume_queue(
            admin.get(),
            q.addr.as_str().into(),
            s.topic.as_str().into(),
            q.mq.queue_id(),
            from,
            count,
            // Any group: the broker only uses it to evaluate a filter.
            "cache-sync-probe".into(),
        ),
    )
    .await;
    let Ok(Ok(body)) = answer else {
        if let Some(mut a) = s.admin.take() {
            a.shutdown().await;
        }
        return 0;
    };
    let entries = body.queue_data.as_deref().unwrap_or_default();
    // With the broker's extended consume queue on, an entry's code may be
    // an address into it rather than the tag's hash: such an entry (one
    // with extended data, or a code no `i32` hash gives) is not known to
    // be another cache's, and ends the run.
    let codes = entries.iter().map(|e| {
        (e.extend_data_json.is_none() && i32::try_from(e.tags_code).is_ok()).then_some(e.tags_code)
    });
    others_leading(codes, ours)
}

/// How many entries in a row, from the first, carry a tag code that is
/// none of `ours`; `None` (a code that is no tag's hash) ends the run.
fn others_leading(codes: impl Iterator<Item = Option<i64>>, ours: &HashSet<i64>) -> u64 {
    let others = codes
        .take_while(|c| c.is_some_and(|c| !ours.contains(&c)))
        .count();
    u64::try_from(others).unwrap_or(0)
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
        let route = inner.ensure_topic(topic).await?;
        // Before the plan checks what the brokers hold: a connection still
        // open afterwards shows the broker is the one it checked.
        let watch = Arc::new(Watch::open(&route).await);
        let mut admin = inner.admin().await?;
        let plan = plan_start(admin.get(), topic, from).await;
        admin.shutdown().await;
        let plan = plan?;
        let read: TopicBrokers = plan
            .queues
            .iter()
            .map(|q| (q.mq.broker_name().to_string(), q.addr.clone()))
            .collect();
        watch.planned(&read, !plan.missing.is_empty()).await;

        let instance = inner.next_name("node");
        let group = inner.next_name("group");
        let instance_dir = inner.offset_dir.join(format!("{CLIENT_IP}@{instance}"));
        seed_offsets(&instance_dir.join(&group), topic, &plan.queues, &plan.seed)?;

        let (tx, rx) = mpsc::channel::<Vec<Received>>(BUFFER_BATCHES);
        let skips_tx = tx.downgrade();
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
        let skips = consumer
            .consumer
            .as_ref()
            .and_then(DefaultMQPushConsumer::offset_store)
            .map(|store| {
                let (stop_tx, stop) = watch::channel(false);
                tokio::spawn(watch_skips(Skips {
                    store,
                    queues: plan.queues.clone(),
                    at: plan.seed.clone(),
                    tx: skips_tx,
                    tails: inner.tails_of(topic),
                    ours: tag_codes(expression),
                    topic: topic.to_owned(),
                    shared: self.inner.clone(),
                    admin: None,
                    stop,
                }));
                stop_tx
            });

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
        inner.watching(topic, &watch);
        let watchdog = tokio::spawn(watchdog(watch.clone(), returned, report));
        Ok(RocketMqSubscription {
            rx,
            buffered: VecDeque::new(),
            position: plan.seed,
            pending: plan.loss,
            brokers,
            stray,
            watchdog,
            skips,
            watch,
            consumer: Some(consumer),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_expression_names_its_tags_by_their_java_hash_codes() {
        assert_eq!(tag_codes("*"), None);
        assert_eq!(tag_codes(" * "), None);
        let codes = tag_codes("users||fresh").unwrap();
        // As the broker logs them for a subscription to `fresh`.
        assert!(codes.contains(&97_696_046));
        assert!(codes.contains(&111_578_632));
        assert_eq!(codes.len(), 2);
    }

    #[test]
    fn a_look_ahead_stops_at_the_first_message_of_ours() {
        let ours: HashSet<i64> = [7].into();
        let codes = |c: &[i64]| c.iter().map(|&c| Some(c)).collect::<Vec<_>>().into_iter();
        assert_eq!(others_leading(codes(&[1, 2, 7, 3]), &ours), 2);
        assert_eq!(others_leading(codes(&[7, 1]), &ours), 0);
        assert_eq!(others_leading(codes(&[1, 2, 3]), &ours), 3);
        assert_eq!(others_leading(std::iter::empty(), &ours), 0);
        // A message with no tag (code 0) from another producer is not ours.
        assert_eq!(others_leading(codes(&[0, 7]), &ours), 1);
        // An entry whose code is no tag's hash ends the run.
        assert_eq!(
            others_leading([Some(1), None, Some(2)].into_iter(), &ours),
            1
        );
    }
}
