//! Off the consumer's path: saving positions and moka's housekeeping, the
//! latter on a thread the node owns.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::sync::watch;

use super::Shared;
use crate::cache::CacheHandle;
use crate::util::deadline_after;

/// A thread of the node's own, with a single-threaded tokio runtime, that
/// runs moka's housekeeping. That work cannot be split: after a clear of a
/// 1M-entry cache (a published `invalidate_all`, a resync after a loss)
/// moka evicts every entry in one call, 5 to 8 s without a yield
/// (`docs/benchmarks/cdc.md`); on the application's runtime it would hold a
/// worker, and every task queued behind it, for as long. Here it holds only
/// this thread; the maintenance task waits for it without holding a
/// worker.
pub(super) struct Housekeeper {
    /// `None` when the thread could not be started: housekeeping then runs
    /// on the maintenance task, as it would without this.
    handle: Option<tokio::runtime::Handle>,
    /// Dropped with the node's shared state: the thread's runtime then
    /// stops (a run under way is cancelled at its next await).
    _stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Housekeeper {
    pub(super) fn start(node: &str) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let started = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .and_then(|runtime| {
                let handle = runtime.handle().clone();
                std::thread::Builder::new()
                    .name("cache-sync-housekeeping".to_owned())
                    .spawn(move || {
                        runtime.block_on(async {
                            let _ = stopped.await;
                        });
                    })
                    .map(|_| handle)
            });
        match started {
            Ok(handle) => Housekeeper {
                handle: Some(handle),
                _stop: Some(stop),
            },
            Err(e) => {
                tracing::warn!(node, error = %e, "could not start the housekeeping thread; moka's housekeeping runs on the application's runtime");
                Housekeeper {
                    handle: None,
                    _stop: None,
                }
            }
        }
    }

    /// Runs `cache`'s pending housekeeping to its end on the node's thread;
    /// the caller waits without holding a worker of its runtime.
    pub(super) async fn settle(&self, cache: Arc<dyn CacheHandle>) {
        self.run(async move { cache.settle().await }).await;
    }

    /// Runs `work` on the node's thread (or, without one, here), and waits
    /// for it.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        if let Some(handle) = &self.handle {
            match handle.spawn(work).await {
                Ok(out) => return out,
                // A panic there is a panic here; cancelled only when the
                // thread stops, with the node's state, which outlives every
                // caller.
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        work.await
    }
}

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
