//! Off the consumer's path: saving positions and moka's housekeeping, the
//! latter on the runtime's blocking pool (`cache::Housekeeper`).

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::watch;

use super::Shared;
use crate::util::deadline_after;

/// moka does its housekeeping (applying logged reads and writes, expiry,
/// eviction) inline, in whichever cache call finds 64 writes logged or
/// 300 ms passed since the last run. Left alone, that call is now and then
/// the consumer applying an event, which then pays for everything logged
/// since; and since every node gets the same events, all nodes pay on the
/// same event. So the maintenance task runs it instead: `SETTLE_DELAY` after
/// the consumer has applied something (coalescing a burst, and out of the
/// way of the batch just applied), and every `HOUSEKEEPING_INTERVAL` for the
/// application's reads. An idle node does not wake up for it more often.
pub(super) const HOUSEKEEPING_INTERVAL: Duration = Duration::from_millis(200);
pub(super) const SETTLE_DELAY: Duration = Duration::from_millis(10);

/// Off the consumer's path: saves the applied position periodically, so a
/// slow offset store never delays applying, and runs the caches'
/// housekeeping.
pub(super) async fn maintenance_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    // Deadlines rather than `tokio::time::interval`, whose next tick is
    // `now + period` and panics for a period as long as `Duration::MAX`.
    let every = shared.config.persist_interval;
    let mut persist = std::pin::pin!(tokio::time::sleep_until(deadline_after(every)));
    let mut housekeeping = std::pin::pin!(tokio::time::sleep_until(deadline_after(
        HOUSEKEEPING_INTERVAL
    )));
    enum Due {
        Stop,
        Persist,
        Housekeeping,
        Applied,
    }
    loop {
        let due = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => Due::Stop,
            () = &mut persist => Due::Persist,
            () = &mut housekeeping => Due::Housekeeping,
            () = shared.applied.notified() => Due::Applied,
        };
        match due {
            Due::Stop => break,
            Due::Persist => {
                if shared.dirty.swap(false, Relaxed)
                    && let Err(e) = shared.persist().await
                {
                    shared.dirty.store(true, Relaxed);
                    tracing::warn!(node = %shared.id, error = %e, "could not save position");
                }
                persist.as_mut().reset(deadline_after(every));
            }
            Due::Housekeeping | Due::Applied => {
                if matches!(due, Due::Applied) {
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => break,
                        () = tokio::time::sleep(SETTLE_DELAY) => {}
                    }
                }
                let caches: Vec<_> = shared.caches().values().cloned().collect();
                for cache in caches {
                    shared.housekeeper.settle(cache).await;
                }
                // It just ran: the periodic run can wait a whole interval.
                housekeeping
                    .as_mut()
                    .reset(deadline_after(HOUSEKEEPING_INTERVAL));
            }
        }
    }
}
