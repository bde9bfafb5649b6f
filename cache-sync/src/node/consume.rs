//! The consume loop: fetch, apply, re-subscribe after errors, answer losses.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::watch;

use super::Shared;
use super::route::{apply_records, expire_checks};
use super::seqs::PublisherSeqs;
use crate::transport::{Delivery, Loss, LossReason, Position, StartFrom, Subscription};
use crate::util::{Backoff, lock};

/// The initial subscription and what it was made with.
pub(super) struct Subscribed {
    pub(super) subscription: Box<dyn Subscription>,
    pub(super) registrations: watch::Receiver<u64>,
    /// The caches registered when it was made.
    pub(super) names: HashSet<String>,
}

/// When the consume task ends, by shutdown or by a panic in user code (a
/// key's `Deserialize` or `Hash`), the node stops reporting itself healthy.
pub(super) struct MarkDownOnExit<'a>(&'a Shared);

impl Drop for MarkDownOnExit<'_> {
    fn drop(&mut self) {
        self.0.consuming.store(false, Relaxed);
        self.0.alive.store(false, Relaxed);
    }
}

/// How long the first fetches may find nothing to hand over before the
/// start replay counts as done: the transport has no backlog for the node.
const CAUGHT_UP_AFTER_IDLE: Duration = Duration::from_millis(200);

/// Fetches and applies, in one task. Owns the subscription and re-subscribes
/// after errors, from the last position applied.
///
/// Applying inline, rather than handing batches to a second task, saves a
/// task wake-up per event (tens of µs on a small VM, once per node). Every
/// transport buffers on its own side (a Redis stream or NATS stream is read
/// on demand; Pub/Sub and RocketMQ buffer in the client, and overflow there is
/// a detected loss), so a slow cache slows fetching and memory stays bounded.
pub(super) async fn consume_loop(
    shared: Arc<Shared>,
    initial: Subscribed,
    mut stop: watch::Receiver<bool>,
) {
    let _down = MarkDownOnExit(&shared);
    let cfg = &shared.config;
    let Subscribed {
        subscription,
        mut registrations,
        names: mut subscribed_names,
    } = initial;
    let mut seqs = PublisherSeqs::default();
    seqs.margin = cfg.reorder_window;
    let mut caught_up = shared.caught_up.load(Relaxed);
    if caught_up {
        seqs.live_since = Some(tokio::time::Instant::now());
    }
    let mut fetched = subscription.position();
    let mut sub = Some(subscription);
    let mut backoff = Backoff::new(cfg.min_backoff, cfg.max_backoff);
    // Whether the next subscription resumes after a broken one (time passed,
    // connections dropped), rather than re-subscribing at once for new tags.
    let mut after_error = false;
    // One future for the whole loop: a fresh `wait_for` per select would
    // register with (and leave) the channel's waiter list once per event.
    let mut stopped = std::pin::pin!(async move {
        let _ = stop.wait_for(|s| *s).await;
    });

    'consume: loop {
        let Some(s) = sub.as_mut() else {
            // Checks fall due while the node re-subscribes too: a cache
            // already known to be behind must not stay stale for a whole
            // outage of the transport.
            if !backoff.wait().is_zero() {
                let wait = tokio::time::sleep(backoff.wait());
                let mut wait = std::pin::pin!(wait);
                loop {
                    tokio::select! {
                        () = &mut stopped => break 'consume,
                        () = &mut wait => break,
                        () = check_due(seqs.next_deadline()) => {
                            expire_checks(&shared, &mut seqs).await;
                        }
                        // What the node applied before the outage is still
                        // applied: a request it meets is answered now.
                        () = shared.ack_queue.requested.notified() => {
                            shared.ack_queue.check(&seqs, &shared);
                        }
                    }
                }
            }
            expire_checks(&shared, &mut seqs).await;
            let from = match &fetched {
                Some(p) => StartFrom::Position(p.clone()),
                None => {
                    // Nowhere to resume from: whatever came between is lost.
                    let loss = Loss::new(LossReason::Reconnected, None, None);
                    apply_loss(&shared, &mut seqs, loss).await;
                    shared.config.start_from.clone()
                }
            };
            let resumed = after_error && fetched.is_some();
            let names: HashSet<String> = shared.caches().keys().cloned().collect();
            let subscribing = shared.subscribe(from);
            let mut subscribing = std::pin::pin!(subscribing);
            // An attempt can take up to the transport's timeout.
            let subscribed = loop {
                tokio::select! {
                    subscribed = &mut subscribing => break subscribed,
                    () = check_due(seqs.next_deadline()) => {
                        expire_checks(&shared, &mut seqs).await;
                    }
                    () = shared.ack_queue.requested.notified() => {
                        shared.ack_queue.check(&seqs, &shared);
                    }
                }
            };
            match subscribed {
                Ok(new) => {
                    fetched = new.position().or(fetched);
                    sub = Some(new);
                    backoff.reset();
                    after_error = false;
                    if resumed {
                        seqs.resumed(names.iter().cloned());
                    }
                    shared.consuming.store(true, Relaxed);
                    for name in names.difference(&subscribed_names) {
                        if let Some(cache) = shared.cache(name) {
                            // Events for it may have been filtered out before now.
                            cache.reset().await;
                            cache.quarantine();
                        }
                    }
                    subscribed_names = names;
                }
                Err(e) => {
                    shared.stats.transport_errors.fetch_add(1, Relaxed);
                    shared.consuming.store(false, Relaxed);
                    after_error = true;
                    backoff.fail();
                    tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff.wait(), "re-subscribe failed");
                }
            }
            continue;
        };

        let next = tokio::select! {
            biased;
            () = &mut stopped => break,
            Ok(()) = registrations.changed(), if shared.transport.filters_by_tag() => {
                // New tags: re-subscribe where we are, at once.
                fetched = s.position().or(fetched);
                sub = None;
                continue;
            }
            // The checks must fall due in a quiet period too: waiting for
            // the silence to end is what they are there to avoid.
            () = check_due(seqs.next_deadline()) => {
                expire_checks(&shared, &mut seqs).await;
                continue;
            }
            // An acknowledgement request: answered now if met, else after
            // the batch that meets it.
            () = shared.ack_queue.requested.notified() => {
                shared.ack_queue.check(&seqs, &shared);
                continue;
            }
            // Until the start replay is done: a fetch that waits this long
            // found the end of what the transport holds.
            // In an async block: a disabled branch's expression is still
            // evaluated, and a bare `sleep` would read the clock every batch.
            () = async { tokio::time::sleep(CAUGHT_UP_AFTER_IDLE).await }, if !caught_up => {
                caught_up = true;
                shared.caught_up.store(true, Relaxed);
                seqs.live_since = Some(tokio::time::Instant::now());
                continue;
            }
            next = s.next(cfg.max_batch) => next,
        };
        // A batch fetched after a registration may have been filtered with
        // the tags of before it: the new cache's events published since
        // (after `register` returned) are missing from it, and a
        // re-subscription from its end would start after them. So nothing
        // of it is applied: it is read again, with the new tags, from where
        // it began. (The registration was made before those publishes, so a
        // fetch that saw them sees it too.)
        if matches!(next, Ok(Delivery::Batch { .. }))
            && shared.transport.filters_by_tag()
            && registrations.has_changed().unwrap_or(false)
        {
            registrations.borrow_and_update();
            sub = None;
            continue;
        }
        match next {
            Ok(Delivery::Batch { records, position }) => {
                // A short batch: the transport handed over all it had.
                if !caught_up && records.len() < cfg.max_batch {
                    caught_up = true;
                    shared.caught_up.store(true, Relaxed);
                    // From the next batch on: this one is the replay's end.
                    seqs.live_since = Some(tokio::time::Instant::now());
                }
                apply_records(&shared, &mut seqs, records).await;
                shared.applied.notify_one();
                if shared.ack_queue.active() {
                    shared.ack_queue.check(&seqs, &shared);
                }
                fetched
                    .get_or_insert_with(Position::default)
                    .advance(&position);
                lock(&shared.position).advance(&position);
                shared.freshness.applied.notify_one();
                shared.dirty.store(true, Relaxed);
            }
            Ok(Delivery::Lost(loss)) => {
                if let Some(p) = &loss.resume_at {
                    fetched.get_or_insert_with(Position::default).advance(p);
                }
                apply_loss(&shared, &mut seqs, loss).await;
            }
            Err(e) => {
                shared.stats.transport_errors.fetch_add(1, Relaxed);
                shared.consuming.store(false, Relaxed);
                after_error = true;
                backoff.fail();
                tracing::warn!(node = %shared.id, error = %e, retry_in = ?backoff.wait(), "subscription failed; re-subscribing");
                sub = None;
            }
        }
    }
}

/// Sleeps until `deadline`; with none, forever.
async fn check_due(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

pub(super) async fn apply_loss(shared: &Shared, seqs: &mut PublisherSeqs, loss: Loss) {
    // Every publisher may have lost events; their next sequence numbers will
    // jump, and that is already answered here.
    seqs.clear();
    shared.resync_all(loss.reason, loss.missed).await;
    if let Some(p) = loss.resume_at {
        lock(&shared.position).advance(&p);
    }
    shared.freshness.applied.notify_one();
    shared.dirty.store(true, Relaxed);
}
