//! The heartbeat task: sends this node's heartbeat every interval, takes the
//! other nodes' in, answers roll calls with an early heartbeat, and takes
//! acknowledgement requests in (the consume task decides when they are met,
//! see `acks.rs`).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};

use super::Shared;
use crate::cluster::{
    Ack, CacheHeartbeat, Heartbeat, Incoming, MAX_PROBE_KEY_BYTES, Message, Probe, Probed, Request,
};
use crate::transport::HeartbeatSubscription;
use crate::util::{Backoff, deadline_after, now_us};

/// The least time between two heartbeats sent early: a flood of roll calls
/// (forged ones, on a topic whose messages are not signed) cannot make a node flood the
/// channel in turn.
const MIN_EARLY_GAP: Duration = Duration::from_millis(5);

pub(super) async fn heartbeat_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let every = shared.config.heartbeat_interval;
    if every == Duration::MAX {
        return;
    }
    let cluster = shared.cluster.clone();
    // The answers other nodes send to this node's own view's requests.
    let replies = cluster.read_replies(stop.clone());
    let mut sub: Option<Reader> = None;
    let mut backoff = Backoff::new(
        crate::cluster::CHANNEL_BACKOFF_MIN,
        crate::cluster::CHANNEL_BACKOFF_MAX,
    );
    let mut retry_at = Instant::now();
    // The first heartbeat goes out at once: other parties learn of the
    // node without waiting an interval.
    let mut tick = std::pin::pin!(sleep_until(Instant::now()));
    let mut last_sent: Option<Instant> = None;
    let mut stopped = std::pin::pin!(async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    loop {
        // Every await that can take a transport's timeout (a broker that
        // is down) also waits for the stop, so shutdown never waits on it.
        if sub.is_none() && Instant::now() >= retry_at {
            let subscribed = tokio::select! {
                () = &mut stopped => break,
                subscribed = shared.transport.subscribe_heartbeats(&shared.topic) => subscribed,
            };
            match subscribed {
                Ok(s) => {
                    sub = Some(Reader::spawn(s));
                    backoff.reset();
                    // Every node answers a roll call at once: the view
                    // knows the cluster again within a round trip.
                    let roll_call = Message::Request(Request::roll_call(&shared.topic));
                    tokio::select! {
                        () = &mut stopped => break,
                        sent = cluster.send(&roll_call) => cluster.listening(sent),
                    }
                }
                Err(e) if e.is_unsupported() => {
                    tracing::info!(node = %shared.id, transport = shared.transport.kind(),
                        "the transport has no heartbeat channel; the cluster view holds only this node");
                    return;
                }
                Err(e) => {
                    backoff.fail();
                    retry_at = deadline_after(backoff.wait());
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff.wait(),
                        "heartbeat channel: subscribe failed");
                }
            }
        }
        let mut early = false;
        tokio::select! {
            () = &mut stopped => break,
            () = &mut tick => {
                tokio::select! {
                    () = &mut stopped => break,
                    () = send(&shared, &mut last_sent) => {}
                }
                tick.as_mut().reset(deadline_after(every));
                continue;
            }
            () = sleep_until(retry_at), if sub.is_none() => continue,
            next = next_message(&mut sub) => match next {
                Ok(payload) => {
                    match cluster.receive(&payload) {
                        Some(Incoming::Request(request)) => early |= take(&shared, request),
                        Some(Incoming::Probe(probe)) => answer_probe(&shared, probe),
                        None => {}
                    }
                }
                Err(e) => {
                    sub = None;
                    cluster.deaf();
                    backoff.fail();
                    retry_at = deadline_after(backoff.wait());
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff.wait(),
                        "heartbeat channel: subscription failed; subscribing again");
                }
            },
        }
        if early {
            let now = Instant::now();
            match last_sent.and_then(|at| at.checked_add(MIN_EARLY_GAP)) {
                Some(allowed) if allowed > now => {
                    // Sent a moment ago: the next tick comes at once after
                    // the gap, and carries everything since.
                    if tick.deadline() > allowed {
                        tick.as_mut().reset(allowed);
                    }
                }
                _ => tokio::select! {
                    () = &mut stopped => break,
                    () = send(&shared, &mut last_sent) => {}
                },
            }
        }
    }
    let _ = replies.await;
}

async fn next_message(sub: &mut Option<Reader>) -> crate::error::Result<Bytes> {
    match sub {
        Some(r) => r.rx.recv().await.unwrap_or_else(|| {
            Err(crate::Error::Unsupported {
                transport: "heartbeat reader",
                what: "reading on after its task ended",
            })
        }),
        None => std::future::pending().await,
    }
}

/// Messages a reader holds for the loop; past that, heartbeats are dropped
/// (the loop is busy; the next one says it all again).
const READ_BUFFER: usize = 1024;

/// Reads a heartbeat subscription in a task of its own, so the loop's
/// ticks never cancel a read half-way: a transport's read timeout or
/// keep-alive (which a dropped `next` would restart) keeps running, and a
/// dead connection is noticed.
struct Reader {
    rx: mpsc::Receiver<crate::error::Result<Bytes>>,
    task: JoinHandle<()>,
}

impl Reader {
    fn spawn(mut sub: Box<dyn HeartbeatSubscription>) -> Self {
        let (tx, rx) = mpsc::channel(READ_BUFFER);
        let task = tokio::spawn(async move {
            loop {
                let next = sub.next().await;
                if next.is_err() {
                    // The loop must hear of a broken subscription.
                    let _ = tx.send(next).await;
                    return;
                }
                match tx.try_send(next) {
                    Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
        });
        Reader { rx, task }
    }
}

/// The read task goes with the reader: it may be waiting on a broker that
/// never answers.
impl Drop for Reader {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Shared {
    /// This node's heartbeat, as of now.
    pub(super) fn heartbeat(&self) -> Heartbeat {
        let status = self.status();
        // As `Node::is_ready` says, short of the stop its handle knows of
        // (a stopped node sends no heartbeat).
        let ready = self.ready();
        let interval = self.config.heartbeat_interval;
        let now = now_us();
        Heartbeat {
            node_id: status.node_id,
            topic: status.topic,
            started_at_us: self.started_at_us,
            sent_at_us: now,
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            transport: status.transport,
            consuming: status.consuming,
            ready,
            position: status.position,
            losses: status.losses,
            live_nodes: Some(self.cluster.live_nodes()),
            freshness_age_ms: status.freshness_age_ms,
            caches: status
                .caches
                .into_iter()
                .map(|c| CacheHeartbeat {
                    name: c.name,
                    version: c.version,
                    version_at_us: c.version_at_us,
                    // A duration on this node's clock alone: what others
                    // time lags by (they never read `version_at_us`
                    // against their own clock).
                    version_age_ms: c.version_at_us.map(|at| now.saturating_sub(at) / 1000),
                    entries: c.entries,
                    loss_resyncs: c.loss_resyncs,
                    quarantined: c.quarantined,
                    last_latency_us: c.last_latency_us,
                    freshness_age_ms: c.freshness_age_ms,
                    audit: c.audit,
                })
                .collect(),
        }
    }
}

async fn send(shared: &Shared, last_sent: &mut Option<Instant>) {
    *last_sent = Some(Instant::now());
    let heartbeat = shared.heartbeat();
    // Own heartbeat, as the others will see it (the channel may not echo
    // it back; the view builds the node's own entry fresh anyway).
    shared.cluster.send(&Message::Heartbeat(heartbeat)).await;
}

/// Takes a request in: whether to answer with a heartbeat now (a roll
/// call, or a request for a heartbeat from the nodes holding a cache this
/// node holds). An acknowledgement request for a cache this node holds is
/// handed to the consume task, which answers it once met.
pub(super) fn take(shared: &Shared, request: Request) -> bool {
    let Some(cache) = request.cache.clone() else {
        return true;
    };
    if shared.cache(&cache).is_none() {
        return false;
    }
    let Some(target) = request.target else {
        return true;
    };
    shared.ack_queue.take(request, cache, target);
    false
}

/// Probes answered at once by one node; past that a probe goes unanswered
/// (its asker shows the node without an answer). A probe costs a look-up
/// and one small message, but on a topic whose messages are not signed
/// anyone can send them.
const MAX_PROBES_IN_FLIGHT: usize = 16;

/// Answers a key probe for a cache this node holds, at once, from a task
/// of its own: the heartbeat task never waits for the transport.
fn answer_probe(shared: &Arc<Shared>, probe: Probe) {
    let Some(cache) = shared.cache(&probe.cache) else {
        return;
    };
    if probe.key.len() > MAX_PROBE_KEY_BYTES {
        return;
    }
    if shared.probes_in_flight.fetch_add(1, Relaxed) >= MAX_PROBES_IN_FLIGHT {
        shared.probes_in_flight.fetch_sub(1, Relaxed);
        return;
    }
    // Given back however the task ends, a panic in the cache's key type
    // included: a slot lost for good would silence the node's answers.
    struct Slot(Arc<Shared>);
    impl Drop for Slot {
        fn drop(&mut self) {
            self.0.probes_in_flight.fetch_sub(1, Relaxed);
        }
    }
    let slot = Slot(Arc::clone(shared));
    tokio::spawn(async move {
        let shared = &slot.0;
        let state = cache.probe(&probe.key).await;
        let ack = Ack {
            topic: shared.topic.clone(),
            node_id: shared.id.clone(),
            ids: Vec::new(),
            progress: Vec::new(),
            probed: vec![Probed {
                id: probe.id,
                state,
            }],
        };
        shared
            .cluster
            .send_ack(probe.asker, probe.reply, &ack)
            .await;
    });
}
