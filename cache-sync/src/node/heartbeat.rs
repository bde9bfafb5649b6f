//! The heartbeat task: sends this node's heartbeat every interval, takes the
//! other nodes' in, and answers requests for an early one (a watcher that
//! starts, an acknowledged publish waiting for this node).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};

use super::Shared;
use crate::cluster::{Message, Request, Target, next_backoff};
use crate::transport::HeartbeatSubscription;
use crate::util::deadline_after;

/// The longest a node keeps a request it cannot answer yet.
const MAX_REQUEST_WAIT: Duration = Duration::from_secs(60);
/// Requests kept at once; past that the oldest goes (its asker times out).
const MAX_PENDING: usize = 1024;
/// The least time between two heartbeats sent early: a flood of requests
/// (forged ones, on a bus that does not sign) cannot make a node flood the
/// channel in turn.
const MIN_EARLY_GAP: Duration = Duration::from_millis(2);

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
    let mut sub: Option<Box<dyn HeartbeatSubscription>> = None;
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
        if sub.is_none() && Instant::now() >= retry_at {
            match shared.transport.subscribe_heartbeats(&shared.topic).await {
                Ok(s) => {
                    sub = Some(s);
                    backoff = Duration::ZERO;
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
        let first_due = pending.iter().map(|p| p.until).min();
        tokio::select! {
            () = &mut stopped => break,
            () = &mut tick => {
                send(&shared, &mut last_sent).await;
                tick.as_mut().reset(deadline_after(every));
                continue;
            }
            () = sleep_until(retry_at), if sub.is_none() => continue,
            () = shared.acks.notified(), if !pending.is_empty() => {}
            () = sleep_until(first_due.unwrap_or(retry_at)), if first_due.is_some() => {}
            next = next_message(&mut sub) => match next {
                Ok(payload) => {
                    if let Some(request) = cluster.receive(&payload) {
                        early |= take(&shared, request, &mut pending);
                    }
                }
                Err(e) => {
                    sub = None;
                    backoff = next_backoff(backoff);
                    retry_at = deadline_after(backoff);
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff,
                        "heartbeat channel: subscription failed; subscribing again");
                }
            },
        }
        let now = Instant::now();
        pending.retain(|p| {
            if met(&shared, &p.cache, p.target) {
                early = true;
                return false;
            }
            p.until > now
        });
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
                _ => send(&shared, &mut last_sent).await,
            }
        }
    }
}

async fn next_message(
    sub: &mut Option<Box<dyn HeartbeatSubscription>>,
) -> crate::error::Result<bytes::Bytes> {
    match sub {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn send(shared: &Shared, last_sent: &mut Option<Instant>) {
    *last_sent = Some(Instant::now());
    let heartbeat = shared.heartbeat();
    // Own heartbeat, as the others will see it (the channel may not echo
    // it back; the view builds the node's own entry fresh anyway).
    shared.cluster.send(&Message::Heartbeat(heartbeat)).await;
}

/// Takes a request in: whether to answer with a heartbeat now (every
/// request for a cache this node holds, so the asker learns of it, and
/// every roll call), keeping it if its target is not yet met.
fn take(shared: &Shared, request: Request, pending: &mut Vec<Pending>) -> bool {
    let Some(cache) = request.cache else {
        return true;
    };
    if shared.cache(&cache).is_none() {
        return false;
    }
    if let Some(target) = request.target
        && !met(shared, &cache, target)
    {
        if pending.len() >= MAX_PENDING {
            pending.remove(0);
        }
        let wait = Duration::from_millis(request.within_ms).min(MAX_REQUEST_WAIT);
        pending.push(Pending {
            cache,
            target,
            until: deadline_after(wait),
        });
        shared.acks_wanted.store(true, Relaxed);
    }
    true
}

/// Whether this node has applied `target` to `cache`.
fn met(shared: &Shared, cache: &str, target: Target) -> bool {
    let Some(cache) = shared.cache(cache) else {
        return false;
    };
    let status = cache.status();
    match target {
        Target::Seq { publisher, seq } => status
            .recent
            .iter()
            .any(|e| e.publisher == publisher && e.seq >= seq),
        Target::Version(v) => status.version.is_some_and(|have| have >= v),
    }
}
