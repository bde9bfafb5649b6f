//! Acknowledgement requests a node has taken in and not yet answered, and
//! the answers ready to go out.
//!
//! Requests arrive on the heartbeat task; whether one is met is a question
//! for the consume task, which alone holds the publishers' sequence numbers
//! (`seqs.rs`) and applies events: a request is checked there when it
//! arrives (the consume task is woken) and after every applied batch, never
//! half-way through one. Answers go back to the heartbeat task to send.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::Shared;
use super::seqs::PublisherSeqs;
use crate::cluster::{Ack, Request, Target};
use crate::util::{deadline_after, lock};

/// The longest a node keeps a request it cannot answer yet.
const MAX_REQUEST_WAIT: Duration = Duration::from_secs(60);
/// Requests kept at once; past that the oldest goes (its asker times out).
/// With the answers waiting to go out, this bounds the queue in bytes too:
/// each holds a cache name (at most 255 bytes) and a few numbers.
const MAX_PENDING: usize = 1024;

struct Pending {
    asker: u64,
    id: u64,
    cache: String,
    target: Target,
    until: Instant,
}

/// The queue between the heartbeat task and the consume task.
#[derive(Default)]
pub(super) struct AckQueue {
    pending: Mutex<Vec<Pending>>,
    /// Met requests, as (asker, request id), for the heartbeat task to send.
    ready: Mutex<Vec<(u64, u64)>>,
    /// Wakes the consume task: a request arrived.
    pub(super) requested: Notify,
    /// Wakes the heartbeat task: answers are ready.
    pub(super) answered: Notify,
}

impl AckQueue {
    /// Takes an acknowledgement request for a cache this node holds
    /// (`request.cache` is `Some`, `request.target` too). A request already
    /// pending (the same one delivered twice: by the channel and, for the
    /// node's own view, directly) is not kept twice.
    pub(super) fn take(&self, request: Request, cache: String, target: Target) {
        let wait = Duration::from_millis(request.within_ms).min(MAX_REQUEST_WAIT);
        {
            let mut pending = lock(&self.pending);
            if pending
                .iter()
                .any(|p| p.asker == request.asker && p.id == request.id)
            {
                return;
            }
            if pending.len() >= MAX_PENDING {
                pending.remove(0);
            }
            pending.push(Pending {
                asker: request.asker,
                id: request.id,
                cache,
                target,
                until: deadline_after(wait),
            });
        }
        self.requested.notify_one();
    }

    /// Whether any request waits: the consume task checks after each batch
    /// only then.
    pub(super) fn any_pending(&self) -> bool {
        !lock(&self.pending).is_empty()
    }

    /// On the consume task, between batches: moves the requests now met to
    /// the answers, and drops the expired ones. This node's own view's
    /// requests are answered here and now: that needs no channel (which may
    /// be down, or slow to subscribe).
    pub(super) fn check(&self, seqs: &PublisherSeqs, shared: &Shared) {
        let caches = shared.caches();
        let now = Instant::now();
        let mut met = Vec::new();
        lock(&self.pending).retain(|p| {
            let Some(cache) = caches.get(&p.cache) else {
                // Unregistered meanwhile: nothing to answer for.
                return false;
            };
            // Writes waiting for a pinned load are taken in but not applied.
            let applied = !cache.parked()
                && match p.target {
                    Target::Seq { publisher, seq } => seqs
                        .applied(publisher, &p.cache)
                        .is_some_and(|have| have >= seq),
                    Target::Version(v) => cache.status().version.is_some_and(|have| have >= v),
                };
            if applied {
                met.push((p.asker, p.id));
                return false;
            }
            p.until > now
        });
        let own = shared.cluster.asker();
        let (mine, theirs): (Vec<_>, Vec<_>) =
            met.into_iter().partition(|(asker, _)| *asker == own);
        if !mine.is_empty() {
            shared.cluster.answered(&Ack {
                topic: shared.topic.clone(),
                node_id: shared.id.clone(),
                ids: mine.into_iter().map(|(_, id)| id).collect(),
            });
        }
        if !theirs.is_empty() {
            lock(&self.ready).extend(theirs);
            self.answered.notify_one();
        }
    }

    /// The answers to send, taken.
    pub(super) fn take_ready(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *lock(&self.ready))
    }
}
