//! Acknowledgement requests a node has taken in and not yet answered, what
//! askers follow, and the answers ready to go out.
//!
//! Requests arrive on the heartbeat task; whether one is met is a question
//! for the consume task, which alone holds the publishers' sequence numbers
//! (`seqs.rs`) and applies events: a request is checked there when it
//! arrives (the consume task is woken) and after every applied batch, never
//! half-way through one. A sender task of its own, one at a time, sends the
//! answers, so the consume task never waits for the transport and an
//! answer costs no other task's turn.
//!
//! **Follows.** A request also makes the node follow, for `FOLLOW_FOR`
//! after it, what the request waits on (the publisher's numbers for the
//! cache, or the cache's version) for its asker: every batch that moves it
//! on is told to the asker at once, unasked (`Progress`). An admin service
//! that acknowledges one publish after another then learns that a node
//! applied the next one when the node applies it, not a request's round
//! trip later: the request of the next publish only renews the follow.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::{AcqRel, Relaxed, Release};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::Shared;
use super::seqs::PublisherSeqs;
use crate::cluster::{Ack, Progress, Request, Target};
use crate::util::{deadline_after, lock};

/// The longest a node keeps a request it cannot answer yet.
const MAX_REQUEST_WAIT: Duration = Duration::from_secs(60);
/// Requests kept at once; past that the oldest goes (its asker times out).
/// Each holds a cache name (at most 255 bytes) and a few numbers.
const MAX_PENDING: usize = 1024;
/// How long a node follows something for an asker after its last request.
const FOLLOW_FOR: Duration = Duration::from_secs(10);
/// Follows kept at once; past that the oldest goes (its asker then waits a
/// request's round trip, as without follows). Each costs the node one small
/// message per batch that moves it on: the bound keeps forged requests on a
/// topic whose messages are not signed from making every event cost many messages.
const MAX_FOLLOWS: usize = 64;

struct Pending {
    asker: u64,
    id: u64,
    /// Whether the asker reads its reply channel.
    reply: bool,
    cache: String,
    target: Target,
    until: Instant,
}

struct Follow {
    asker: u64,
    reply: bool,
    cache: String,
    /// The publisher; `None` for the cache's version.
    publisher: Option<u64>,
    until: Instant,
    /// What the asker was last told.
    told: u64,
}

#[derive(Default)]
struct State {
    pending: Vec<Pending>,
    follows: Vec<Follow>,
}

/// One message's worth for one asker.
#[derive(Default)]
struct Answer {
    ids: Vec<u64>,
    progress: Vec<Progress>,
}

/// The queue between the heartbeat task and the consume task.
#[derive(Default)]
pub(super) struct AckQueue {
    state: Mutex<State>,
    /// Whether anything is pending or followed: the consume task looks
    /// after a batch only then (one relaxed load otherwise).
    active: AtomicBool,
    /// Answers for the sender task, by (asker, whether it reads its reply
    /// channel).
    ready: Mutex<Vec<((u64, bool), Answer)>>,
    /// Whether a sender task runs (it takes what is ready until none is).
    sending: AtomicBool,
    /// Wakes the consume task: a request arrived.
    pub(super) requested: Notify,
}

impl AckQueue {
    /// Takes an acknowledgement request for a cache this node holds
    /// (`request.cache` is `Some`, `request.target` too), and starts or
    /// renews the follow it asks for. A request already pending (the same
    /// one delivered twice: by the channel and, for the node's own view,
    /// directly) is not kept twice.
    pub(super) fn take(&self, request: Request, cache: String, target: Target) {
        let wait = Duration::from_millis(request.within_ms).min(MAX_REQUEST_WAIT);
        let (publisher, _) = target.followed();
        {
            let mut state = lock(&self.state);
            let follow_until = deadline_after(FOLLOW_FOR);
            match state
                .follows
                .iter_mut()
                .find(|f| f.asker == request.asker && f.publisher == publisher && f.cache == cache)
            {
                Some(f) => {
                    f.until = follow_until;
                    f.reply = request.reply;
                }
                None => {
                    if state.follows.len() >= MAX_FOLLOWS {
                        state.follows.remove(0);
                    }
                    state.follows.push(Follow {
                        asker: request.asker,
                        reply: request.reply,
                        cache: cache.clone(),
                        publisher,
                        until: follow_until,
                        told: 0,
                    });
                }
            }
            if !state
                .pending
                .iter()
                .any(|p| p.asker == request.asker && p.id == request.id)
            {
                if state.pending.len() >= MAX_PENDING {
                    state.pending.remove(0);
                }
                state.pending.push(Pending {
                    asker: request.asker,
                    id: request.id,
                    reply: request.reply,
                    cache,
                    target,
                    until: deadline_after(wait),
                });
            }
            self.active.store(true, Relaxed);
        }
        self.requested.notify_one();
    }

    /// Whether anything waits or is followed: the consume task checks
    /// after each batch only then.
    pub(super) fn active(&self) -> bool {
        self.active.load(Relaxed)
    }

    /// On the consume task, between batches: answers the requests now met,
    /// tells the askers what moved on, and drops what expired. This node's
    /// own view gets its answers here and now: that needs no channel (which
    /// may be down, or slow to subscribe).
    pub(super) fn check(&self, seqs: &PublisherSeqs, shared: &Arc<Shared>) {
        let caches = shared.caches();
        let now = Instant::now();
        // Where the node stands with a publisher (or the version) of a
        // cache; nothing while writes wait for a pinned load, which are
        // taken in but not applied.
        let at = |cache: &str, publisher: Option<u64>| {
            let cache = caches.get(cache)?;
            if cache.parked() {
                return None;
            }
            match publisher {
                Some(p) => seqs.applied(p, cache.name()),
                None => cache.status().version,
            }
        };
        let mut answers: Vec<((u64, bool), Answer)> = Vec::new();
        {
            let mut state = lock(&self.state);
            state.pending.retain(|p| {
                if !caches.contains_key(&p.cache) {
                    // Unregistered meanwhile: nothing to answer for.
                    return false;
                }
                let (publisher, wanted) = p.target.followed();
                if at(&p.cache, publisher).is_some_and(|have| have >= wanted) {
                    answer(&mut answers, (p.asker, p.reply)).ids.push(p.id);
                    return false;
                }
                p.until > now
            });
            state.follows.retain_mut(|f| {
                if f.until <= now || !caches.contains_key(&f.cache) {
                    return false;
                }
                if let Some(have) = at(&f.cache, f.publisher)
                    && have > f.told
                {
                    f.told = have;
                    answer(&mut answers, (f.asker, f.reply))
                        .progress
                        .push(Progress {
                            cache: f.cache.clone(),
                            publisher: f.publisher,
                            at: have,
                        });
                }
                true
            });
            self.active.store(
                !state.pending.is_empty() || !state.follows.is_empty(),
                Relaxed,
            );
        }
        if answers.is_empty() {
            return;
        }
        let own = shared.cluster.asker();
        let (mine, theirs): (Vec<_>, Vec<_>) = answers
            .into_iter()
            .partition(|((asker, _), _)| *asker == own);
        for (_, a) in mine {
            shared.cluster.answered(&ack(shared, a));
        }
        if !theirs.is_empty() {
            lock(&self.ready).extend(theirs);
            if !self.sending.swap(true, AcqRel) {
                tokio::spawn(send_answers(shared.clone()));
            }
        }
    }
}

/// The answer to `to` among `answers`, added if new.
fn answer(answers: &mut Vec<((u64, bool), Answer)>, to: (u64, bool)) -> &mut Answer {
    let i = match answers.iter().position(|(k, _)| *k == to) {
        Some(i) => i,
        None => {
            answers.push((to, Answer::default()));
            answers.len().saturating_sub(1)
        }
    };
    &mut answers[i].1
}

fn ack(shared: &Shared, a: Answer) -> Ack {
    Ack {
        topic: shared.topic.clone(),
        node_id: shared.id.clone(),
        ids: a.ids,
        progress: a.progress,
        probed: Vec::new(),
    }
}

/// Sends what is ready, a message per asker (on its reply channel if it
/// reads one), until nothing is; then ends. One runs at a time per node, so
/// a flood of requests costs one answer each, sent back to back, and no
/// pile of tasks.
async fn send_answers(shared: Arc<Shared>) {
    let queue = &shared.ack_queue;
    loop {
        let ready = std::mem::take(&mut *lock(&queue.ready));
        if ready.is_empty() {
            queue.sending.store(false, Release);
            // Ready since the take, with the flag still up: ours to send.
            if lock(&queue.ready).is_empty() || queue.sending.swap(true, AcqRel) {
                return;
            }
            continue;
        }
        for ((asker, reply), a) in ready {
            shared
                .cluster
                .send_ack(asker, reply, &ack(&shared, a))
                .await;
        }
    }
}
