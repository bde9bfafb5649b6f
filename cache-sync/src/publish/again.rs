//! `again_after`: each change sent a second time, as an invalidation,
//! a fixed delay later.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use super::{Publisher, PublisherInner};
use crate::util::{deadline_after, lock};
use crate::wire::Outgoing;

impl Publisher {
    /// The second send of [`PublisherBuilder::again_after`](crate::PublisherBuilder::again_after): queues, for
    /// `delay` from now, an invalidation of what `changes` changed. One
    /// task per publisher sends them in order (every entry waits the same
    /// delay, so the queue is in due order); it holds the publisher's
    /// state until the queue is empty, so a dropped publisher's second
    /// sends still go out while the process and its runtime live.
    pub(super) fn send_again(&self, cache: Arc<str>, delay: Duration, changes: Outgoing) {
        let again = changes.into_invalidation();
        let mut queue = lock(&self.inner.again);
        queue
            .pending
            .push_back((deadline_after(delay), cache.clone(), again));
        if queue.sending {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                queue.sending = true;
                runtime.spawn(again_loop(AgainGuard {
                    inner: self.inner.clone(),
                    armed: true,
                }));
            }
            // The caller's runtime is shutting down: nothing can send it
            // later. Left queued, it goes with the next publish's task.
            Err(e) => tracing::warn!(%cache, error = %e,
                "no tokio runtime to send the delayed second invalidation from; it waits for the next publish"),
        }
    }
}

/// The second sends of `again_after` waiting for their time.
#[derive(Default)]
pub(super) struct AgainQueue {
    pending: VecDeque<(tokio::time::Instant, Arc<str>, Outgoing)>,
    sending: bool,
}

/// Sends the queued second sends as they fall due; ends when none is left.
async fn again_loop(mut guard: AgainGuard) {
    let inner = guard.inner.clone();
    loop {
        let due = {
            let mut queue = lock(&inner.again);
            match queue.pending.front() {
                Some((due, ..)) if *due > tokio::time::Instant::now() => Some(*due),
                Some(_) => None,
                None => {
                    // Under the queue's lock: a send queued after this
                    // sees `sending` false and spawns a new task.
                    queue.sending = false;
                    guard.armed = false;
                    return;
                }
            }
        };
        if let Some(due) = due {
            tokio::time::sleep_until(due).await;
            continue;
        }
        let Some((_, cache, again)) = lock(&inner.again).pending.pop_front() else {
            continue;
        };
        let publisher = Publisher {
            inner: inner.clone(),
        };
        // Interned when the first send went out, so this finds it.
        let (cache, seq) = match publisher.seq(&cache) {
            Ok(seq) => seq,
            Err(e) => {
                tracing::warn!(cache = %cache, error = %e, "the delayed second invalidation failed");
                continue;
            }
        };
        let mut seq = seq.lock().await;
        // A failure used up its number: nodes see the gap and resync
        // this cache, which is what the second invalidation was for.
        if let Err(e) = publisher
            .publish_locked(&cache, &mut seq, None, &again)
            .await
        {
            tracing::warn!(cache = %cache, error = %e, "the delayed second invalidation failed");
        }
        drop(seq);
        publisher.announce_later();
    }
}

/// Lets the next publish start the second sends' task again if this one
/// is dropped before it ends (its runtime shut down).
struct AgainGuard {
    inner: Arc<PublisherInner>,
    /// False once the task ended by itself: a newer one may be sending.
    armed: bool,
}

impl Drop for AgainGuard {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.inner.again).sending = false;
        }
    }
}
