//! Announcements: a publisher's last sequence number per cache, sent again
//! after its events, so that a node that missed the last ones notices.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;

use super::{Publisher, PublisherInner, SeqState};
use crate::error::Result;
use crate::util::{deadline_after, lock, now_us};
use crate::wire::{Body, Header, HeaderExt, Origin, Watermark};

/// How often a publisher announces its last sequence numbers by default.
pub(crate) const DEFAULT_ANNOUNCE_INTERVAL: Duration = Duration::from_secs(1);

/// The shortest announce interval: shorter would make announcements
/// traffic of their own, and gain nothing against a reorder window that is
/// seconds long.
pub(super) const MIN_ANNOUNCE_INTERVAL: Duration = Duration::from_millis(10);

/// How many times a cache is announced at an unchanged sequence number
/// before its announcements stop (until it is published to again).
///
/// A node that missed the last events needs one announcement sent after
/// them; the repeats cover lost announcements (a lossy transport loses them
/// as it loses events); and stopping means an idle publisher sends nothing
/// rather than one message per cache it ever published to, forever. A node
/// that misses every one of them (it was down meanwhile) finds the gap at
/// the next event, as before.
pub(crate) const QUIET_ANNOUNCEMENTS: u8 = 3;

impl Publisher {
    /// Makes sure an announcing task will announce the numbers used so far.
    /// One relaxed load on the publish path: the flag only needs to be
    /// seen true by publishes whose numbers a running task will see, and
    /// the cache's publish lock orders those (see `announce_loop`).
    pub(super) fn announce_later(&self) {
        if !self.inner.announcing.load(Relaxed) {
            self.start_announcing();
        }
    }

    /// Spawns the announcing task, once, on the runtime of the publish
    /// that calls this: `new` and `build` may run outside any runtime.
    #[cold]
    fn start_announcing(&self) {
        let every = self.inner.announce_interval;
        if every == Duration::MAX || self.inner.announcing.swap(true, Relaxed) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let respawn = Respawn {
                    inner: self.inner.clone(),
                    armed: true,
                };
                runtime.spawn(announce_loop(respawn, every));
            }
            Err(e) => {
                // Tried again at the next publish.
                self.inner.announcing.store(false, Relaxed);
                tracing::debug!(topic = %self.inner.topic, error = %e,
                    "no tokio runtime to announce sequence numbers from");
            }
        }
    }
}

/// Announces each cache's last sequence number every `every`, until every
/// cache has been announced `QUIET_ANNOUNCEMENTS` times unchanged; then it
/// ends, and the next publish spawns it again. It holds the publisher's
/// state meanwhile: a publisher dropped after a publish still announces.
async fn announce_loop(mut respawn: Respawn, every: Duration) {
    // `respawn` is an argument, so that it is dropped with the task even if
    // the task never ran.
    let inner = respawn.inner.clone();
    let mut ticks = tokio::time::interval_at(deadline_after(every), every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let due = inner.due();
        if due.is_empty() {
            // No await from here to the end: the exit is all or nothing.
            // A publish uses its number, then loads the flag. Either it
            // loads false (the store below came first) and spawns a task,
            // or it took its publish lock before the check below released
            // it, and the check sees the new number (or the lock held) and
            // takes the flag back.
            respawn.armed = false;
            inner.announcing.store(false, Relaxed);
            if inner.due().is_empty() || inner.announcing.swap(true, Relaxed) {
                return;
            }
            respawn.armed = true;
            continue;
        }
        for (cache, seq) in due {
            // Not waited for: a publish stuck in the transport (for up to
            // its timeout) must not hold up the other caches' announcements.
            // The cache stays due for the next tick.
            let Ok(seq) = seq.try_lock() else {
                continue;
            };
            // Under the publish lock: the announcement reaches the
            // transport after every event it vouches for, and takes no number.
            let n = seq.seq;
            let times = match lock(&inner.announced).get(&*cache) {
                Some(&(m, times)) if m == n => times,
                _ => 0,
            };
            if n == 0 || times >= QUIET_ANNOUNCEMENTS {
                continue;
            }
            match inner.announce(&cache, n, seq.since_prev_us(), None).await {
                Ok(()) => {
                    lock(&inner.announced).insert(cache, (n, times.saturating_add(1)));
                }
                // Nothing is used up: the next tick tries again.
                Err(e) => tracing::debug!(topic = %inner.topic, %cache, seq = n, error = %e,
                    "announcing a sequence number failed; retrying at the next interval"),
            }
        }
    }
}

/// Lets the next publish spawn the announcing task again if this one is
/// dropped without ending by itself: its runtime shut down (a publisher
/// can outlive the runtime it first published on).
struct Respawn {
    inner: Arc<PublisherInner>,
    /// False while the task ends by itself: it clears the flag then, and a
    /// newer task may have set it since.
    armed: bool,
}

impl Drop for Respawn {
    fn drop(&mut self) {
        if self.armed {
            self.inner.announcing.store(false, Relaxed);
        }
    }
}
impl PublisherInner {
    /// The caches with numbers not yet announced `QUIET_ANNOUNCEMENTS`
    /// times; a cache being published to now counts, it will need it.
    fn due(&self) -> Vec<(Arc<str>, Arc<tokio::sync::Mutex<SeqState>>)> {
        let sent = lock(&self.announced);
        lock(&self.seqs)
            .iter()
            .filter(|(cache, seq)| {
                let Ok(seq) = seq.try_lock() else {
                    return true;
                };
                seq.seq > 0
                    && sent
                        .get(&**cache)
                        .is_none_or(|&(n, times)| n != seq.seq || times < QUIET_ANNOUNCEMENTS)
            })
            .map(|(cache, seq)| (cache.clone(), seq.clone()))
            .collect()
    }

    /// Sends `seq` again for `cache`, as an announcement (see `wire`),
    /// sealed like an event, saying how long ago its event was sent, and
    /// carrying a CDC relay's `watermark` if there is one.
    async fn announce(
        &self,
        cache: &str,
        seq: u64,
        since_prev_us: Option<u64>,
        watermark: Option<Watermark>,
    ) -> Result<()> {
        let header = Header {
            cache,
            origin: Origin(self.origin.as_bytes()),
            publisher: self.id,
            seq,
            published_at_us: now_us(),
        };
        let ext = HeaderExt {
            since_prev_us,
            fence: None,
            watermark,
        };
        let payload = self.codec.seal_body(&header, &ext, Body::ANNOUNCE)?;
        (*self.transport)
            .publish(&self.topic, cache, Bytes::from(payload))
            .await?;
        Ok(())
    }
}

#[cfg(any(test, feature = "postgres-cdc", feature = "_outbox"))]
impl Publisher {
    /// A CDC relay's report for `cache` (see [`Watermark`]): an
    /// announcement of its last number, sent under the cache's publish
    /// lock, so it reaches the transport after every event it vouches
    /// for (and after those of any publish under way).
    pub(crate) async fn watermark(&self, cache: &str, watermark: Watermark) -> Result<()> {
        let (_, seq) = self.seq(cache)?;
        let seq = seq.lock().await;
        self.inner
            .announce(cache, seq.seq, seq.since_prev_us(), Some(watermark))
            .await
    }
}
