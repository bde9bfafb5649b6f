//! The heartbeat task: sends this node's heartbeat every interval, takes the
//! other nodes' in, and answers requests for an early one (a watcher that
//! starts, an acknowledged publish waiting for this node).

use std::sync::Arc;
use std::sync::atomic::Ordering::{Relaxed, SeqCst};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};

use super::Shared;
use crate::cluster::{Message, Request, Target, next_backoff};
use crate::status::CacheStatus;
use crate::transport::HeartbeatSubscription;
use crate::util::deadline_after;

/// The longest a node keeps a request it cannot answer yet.
const MAX_REQUEST_WAIT: Duration = Duration::from_secs(60);
/// Requests kept at once; past that the oldest goes (its asker times out).
const MAX_PENDING: usize = 1024;
/// The least time between two heartbeats sent early: a flood of requests
/// (forged ones, on a bus that does not sign) cannot make a node flood the
/// channel in turn.
const MIN_EARLY_GAP: Duration = Duration::from_millis(5);

struct Pending {
    cache: String,
    target: Target,
    until: Instant,
}

pub(super) async fn heartbeat_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let every = shared.config.heartbeat_interval;
    if every == Duration::MAX {
        return;
    }
    let cluster = shared.cluster.clone();
    let mut sub: Option<Reader> = None;
    let mut backoff = Duration::ZERO;
    let mut retry_at = Instant::now();
    // The first heartbeat goes out at once: other parties learn of the
    // node without waiting an interval.
    let mut tick = std::pin::pin!(sleep_until(Instant::now()));
    let mut last_sent: Option<Instant> = None;
    let mut pending: Vec<Pending> = Vec::new();
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
                    backoff = Duration::ZERO;
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
                    backoff = next_backoff(backoff);
                    retry_at = deadline_after(backoff);
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff,
                        "heartbeat channel: subscribe failed");
                }
            }
        }
        let mut early = false;
        // Pending requests are checked again only after a batch was applied
        // (or when one expires): a flood of messages costs no re-checks.
        let mut recheck = false;
        let first_due = pending.iter().map(|p| p.until).min();
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
            () = shared.acks.notified(), if !pending.is_empty() => recheck = true,
            () = sleep_until(first_due.unwrap_or(retry_at)), if first_due.is_some() => recheck = true,
            next = next_message(&mut sub) => match next {
                Ok(payload) => {
                    if let Some(request) = cluster.receive(&payload) {
                        early |= take(&shared, request, &mut pending);
                    }
                }
                Err(e) => {
                    sub = None;
                    cluster.deaf();
                    backoff = next_backoff(backoff);
                    retry_at = deadline_after(backoff);
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff,
                        "heartbeat channel: subscription failed; subscribing again");
                }
            },
        }
        let now = Instant::now();
        if recheck {
            // One status per cache, however many requests wait on it.
            let mut statuses: Vec<(String, Option<CacheStatus>)> = Vec::new();
            pending.retain(|p| {
                if !statuses.iter().any(|(name, _)| *name == p.cache) {
                    let status = shared.cache(&p.cache).map(|c| c.status());
                    statuses.push((p.cache.clone(), status));
                }
                let status = statuses
                    .iter()
                    .find(|(name, _)| *name == p.cache)
                    .and_then(|(_, s)| s.as_ref());
                if status.is_some_and(|s| met(s, p.target)) {
                    early = true;
                    return false;
                }
                p.until > now
            });
        }
        shared.acks_wanted.store(!pending.is_empty(), Relaxed);
        if early {
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

async fn send(shared: &Shared, last_sent: &mut Option<Instant>) {
    *last_sent = Some(Instant::now());
    let heartbeat = shared.heartbeat();
    // Own heartbeat, as the others will see it (the channel may not echo
    // it back; the view builds the node's own entry fresh anyway).
    shared.cluster.send(&Message::Heartbeat(heartbeat)).await;
}

/// Takes a request in: whether to answer with a heartbeat now (a roll
/// call, or a target this node already met), keeping it if this node holds
/// the cache and has not met its target yet. Not answering at once
/// otherwise keeps the early-heartbeat gap free for the answer that
/// matters: the asker knows of this node already (from its periodic
/// heartbeats, or its answer to the roll call).
fn take(shared: &Shared, request: Request, pending: &mut Vec<Pending>) -> bool {
    let Some(cache_name) = request.cache else {
        return true;
    };
    let Some(cache) = shared.cache(&cache_name) else {
        return false;
    };
    let Some(target) = request.target else {
        return true;
    };
    // Raised before the check: a batch applied between the check and the
    // flag would otherwise not signal, and the answer wait an interval.
    shared.acks_wanted.store(true, SeqCst);
    if met(&cache.status(), target) {
        return true;
    }
    {
        if pending.len() >= MAX_PENDING {
            pending.remove(0);
        }
        let wait = Duration::from_millis(request.within_ms).min(MAX_REQUEST_WAIT);
        pending.push(Pending {
            cache: cache_name,
            target,
            until: deadline_after(wait),
        });
        shared.acks_wanted.store(true, Relaxed);
    }
    false
}

/// Whether a cache with this status has applied `target`.
fn met(status: &CacheStatus, target: Target) -> bool {
    match target {
        Target::Seq { publisher, seq } => status
            .recent
            .iter()
            .any(|e| e.publisher == publisher && e.seq >= seq),
        Target::Version(v) => status.version.is_some_and(|have| have >= v),
    }
}
