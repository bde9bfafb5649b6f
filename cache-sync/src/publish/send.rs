//! The publish path: each change sealed under the cache's next number and
//! handed to the transport in order, under the cache's publish lock.

use std::sync::Arc;

use bytes::Bytes;

use super::in_flight::{HandedOver, InFlight};
use super::{Published, Publisher, Sent, SeqState};
use crate::error::Result;
use crate::util::now_us;
#[cfg(feature = "_outbox")]
use crate::wire::Change;
use crate::wire::{Fence, Header, HeaderExt, Origin, Outgoing};

impl Publisher {
    pub(crate) async fn send(&self, cache: &str, changes: Outgoing) -> Result<Published> {
        self.send_with(cache, None, || Ok((changes, ())))
            .await
            .map(|(p, ())| p)
    }

    /// [`send`](Self::send) under an outbox relay's fencing token.
    #[cfg(feature = "_outbox")]
    pub(crate) async fn send_fenced(
        &self,
        cache: &str,
        changes: Vec<Change>,
        fence: Fence,
    ) -> Result<Published> {
        let changes = Outgoing::from_changes(changes);
        self.send_with(cache, Some(fence), || Ok((changes, ())))
            .await
            .map(|(p, ())| p)
    }

    /// Builds the changes while holding the cache's publish lock, so that
    /// versions assigned in `build` reach the transport in version order.
    pub(super) async fn send_with<T>(
        &self,
        cache: &str,
        fence: Option<Fence>,
        build: impl FnOnce() -> Result<(Outgoing, T)>,
    ) -> Result<(Published, T)> {
        let (cache, seq) = self.seq(cache)?;
        // Held across the hand-over so numbers reach the transport in
        // order, and released before the acknowledgements are awaited, so
        // the next publish to the cache is handed over meanwhile. Free, the
        // usual case, it is taken at once without building the waiting
        // future; a lock with waiters queued is never free (tokio hands a
        // released lock to the first waiter), so this jumps no queue.
        let mut seq = match seq.try_lock() {
            Ok(seq) => seq,
            Err(_) => seq.lock().await,
        };
        let (changes, out) = build()?;
        let mut handed = HandedOver::new();
        self.hand_over_locked(&cache, &mut seq, fence, &changes, &mut handed)
            .await;
        drop(seq);
        // After the number was used, failed publish or not: an announcing
        // task that ends from now on finds it due (see `announce_loop`).
        self.announce_later();
        let published = handed.settle().await?;
        // Scheduled only once the first send went through: a failed one
        // returns its error, and the caller retries the whole change.
        match self.inner.again_after {
            Some(delay) => self.send_again(cache, delay, changes),
            None => changes.recycle(),
        }
        Ok((published, out))
    }

    /// Seals and publishes `changes` in order, each under the next number,
    /// and awaits their acknowledgements, all under the caller's lock.
    pub(super) async fn publish_locked(
        &self,
        cache: &Arc<str>,
        state: &mut SeqState,
        fence: Option<Fence>,
        changes: &Outgoing,
    ) -> Result<Published> {
        let mut handed = HandedOver::new();
        self.hand_over_locked(cache, state, fence, changes, &mut handed)
            .await;
        handed.settle().await
    }

    /// Seals `changes` and hands them to the transport in order, each under
    /// the next number and with a place in the window, into `handed`; the
    /// caller awaits their acknowledgements ([`HandedOver::settle`]), once
    /// it has let the cache's lock go. Stops at the first failure.
    async fn hand_over_locked<'a>(
        &'a self,
        cache: &Arc<str>,
        state: &mut SeqState,
        fence: Option<Fence>,
        changes: &Outgoing,
        handed: &mut HandedOver<'a>,
    ) {
        for change in changes.events() {
            // Waits for a place in the window only while holding none: this
            // publish's own events in flight are awaited first, else two
            // publishes of many events each could wait for the other's. A
            // transport that does not pipeline has its call done by the
            // end of the hand-over, so nothing is ever in flight after it:
            // no place to take (and no semaphore to touch).
            let permit = loop {
                if !self.inner.pipelines {
                    break None;
                }
                if let Ok(permit) = self.inner.window.try_acquire() {
                    break Some(permit);
                }
                if handed.is_empty() {
                    match self.inner.window.acquire().await {
                        Ok(permit) => break Some(permit),
                        Err(_) => unreachable!("the publish window is never closed"),
                    }
                }
                handed.settle_one().await;
                if handed.error.is_some() {
                    return;
                }
            };
            // 2^64 publishes to one cache from one publisher will not happen;
            // saturating keeps the numbers from ever going back regardless.
            state.seq = state.seq.saturating_add(1);
            let header = Header {
                cache,
                origin: Origin(self.inner.origin.as_bytes()),
                publisher: self.inner.id,
                seq: state.seq,
                published_at_us: now_us(),
            };
            // One read of the clock for both: the time since the previous
            // event, and this one's send time (the next event's "previous").
            // Both are taken at the same point of a publish, before sealing,
            // so what the next event says it measures alike.
            let now = tokio::time::Instant::now();
            let ext = HeaderExt {
                since_prev_us: state.since_prev_us_at(now),
                fence,
                watermark: None,
            };
            let payload = match self.inner.codec.seal_body(&header, &ext, change) {
                Ok(payload) => payload,
                Err(e) => {
                    handed.error = Some(e);
                    return;
                }
            };
            // Before the call: whether or not it fails, the number is used
            // and the event may have reached some nodes.
            state.sent_at = Some(now);
            // Through the trait object itself: `Arc<dyn Transport>` is a
            // `Transport` too, and calling that one would box a second future.
            // The payload's buffer is exactly full, so the `Bytes` takes it
            // over without allocating.
            let payload = Bytes::from(payload);
            let transport = &*self.inner.transport;
            let sent = Sent {
                cache: cache.clone(),
                publisher: header.publisher,
                seq: header.seq,
                at: now,
            };
            if !self.inner.pipelines {
                // The whole call, answered now: nothing to hold in flight,
                // and one boxed future, not the two the default
                // `start_publish` would make.
                let published = transport.publish(&self.inner.topic, cache, payload).await;
                let failed = published.is_err();
                handed.record(published, sent);
                if failed {
                    return;
                }
                continue;
            }
            match transport
                .start_publish(&self.inner.topic, cache, payload)
                .await
            {
                Ok(ack) => handed.push(InFlight {
                    ack,
                    sent,
                    _permit: permit,
                }),
                Err(e) => {
                    handed.error = Some(e);
                    return;
                }
            }
        }
    }
}
