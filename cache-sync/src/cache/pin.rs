//! Pins: a locked last load's hold on its key, which later writes of that
//! key from other tasks wait for (or, from the consumer, park behind), and
//! which the loader's own task passes. Shared by loads (`load.rs`), which
//! take pins, and writes (`write.rs`, `park.rs`), which respect them.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::Semaphore;

tokio::task_local! {
    /// Set while a locked load's loader runs: the addresses of the pins its
    /// task holds (more than one when locked loads nest).
    static HELD_PINS: Vec<usize>;
}

/// A locked load's pin on its key (see `load_locked`).
#[derive(Debug)]
pub(super) struct Pin {
    /// Never given a permit: closed when the pin goes, which wakes every
    /// write waiting for it.
    gone: Semaphore,
    /// Writes from other tasks that went past the pin while it stood: a
    /// local write or parked event writes that waited `max_pin_wait` in
    /// vain, an event write when that bound is 0, a clear. Each counts
    /// before its change to the version table, holding the key's stripe
    /// (a clear: holding the pin map's lock, around its stamp), so the
    /// load, which reads it under the stripe after its own decision,
    /// counts every write that superseded it.
    pub(super) overtaken: AtomicUsize,
}

impl Pin {
    pub(super) fn new() -> Self {
        Self {
            gone: Semaphore::new(0),
            overtaken: AtomicUsize::new(0),
        }
    }

    /// Returns once the pin is gone.
    pub(super) async fn released(&self) {
        // No permit is ever added: this returns (with an error) once closed.
        let _ = self.gone.acquire().await;
    }

    /// Closes the pin: wakes every write waiting for it.
    pub(super) fn release(&self) {
        self.gone.close();
    }

    /// Records that another task's write went past the pin.
    pub(super) fn overtake(&self) {
        self.overtaken.fetch_add(1, Relaxed);
    }
}

pub(super) fn pin_id(pin: &Arc<Pin>) -> usize {
    Arc::as_ptr(pin) as usize
}

/// Whether the current task is the locked load that holds `pin`.
pub(super) fn held_by_this_task(pin: &Arc<Pin>) -> bool {
    HELD_PINS
        .try_with(|held| held.contains(&pin_id(pin)))
        .unwrap_or(false)
}

/// Runs `loader` as the holder of `pin` (and of any pins its task already
/// holds), so that its own writes pass them. Not an `async fn`: that would
/// hold `loader` twice in its state, and nested loads multiply it.
pub(super) fn holding<F: Future>(pin: &Arc<Pin>, loader: F) -> impl Future<Output = F::Output> {
    let mut held = HELD_PINS.try_with(Clone::clone).unwrap_or_default();
    held.push(pin_id(pin));
    HELD_PINS.scope(held, loader)
}
