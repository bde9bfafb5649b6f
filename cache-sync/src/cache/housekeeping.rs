//! Where a node's caches' clears and its maintenance task hand moka's
//! housekeeping: off the runtime's workers.

use std::sync::Arc;

use super::CacheHandle;

/// Runs moka's housekeeping for a node's caches on a thread of the
/// runtime's blocking pool (`spawn_blocking`), never on a worker. That work
/// cannot be split: after a clear of a 1M-entry cache (a published
/// `invalidate_all`, a resync after a loss) moka evicts every entry in one
/// call, 5 to 8 s without a yield (`docs/benchmarks/cdc.md`); on a worker it
/// would hold it, and every task queued behind it, for as long. On a
/// blocking thread it holds only that thread, and whoever needs it done
/// (the node's maintenance task, a clear) waits without holding a worker.
/// (The blocking pool rather than a thread of the node's own: under tokio's
/// paused clock, in tests, the clock does not jump ahead while a blocking
/// task runs, and it would while a task waits on another runtime.)
pub(crate) struct Housekeeper {
    /// The runtime the node started on; `None` outside one (housekeeping
    /// then runs where it is asked for, as it would without this).
    handle: Option<tokio::runtime::Handle>,
}

impl Housekeeper {
    pub(crate) fn start() -> Self {
        Housekeeper {
            handle: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// Runs `cache`'s pending housekeeping to its end off the workers; the
    /// caller waits without holding one.
    pub(crate) async fn settle(&self, cache: Arc<dyn CacheHandle>) {
        self.run(async move { cache.settle().await }).await;
    }

    /// Runs `work` on a blocking thread (without a runtime, here), and
    /// waits for it.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> T {
        if let Some(handle) = self.handle.clone() {
            match tokio::task::spawn_blocking(move || handle.block_on(work)).await {
                Ok(out) => return out,
                // A panic there is a panic here. (A blocking task is not
                // cancelled: the runtime waits for it as it shuts down.)
                Err(e) => std::panic::resume_unwind(e.into_panic()),
            }
        }
        work.await
    }
}
