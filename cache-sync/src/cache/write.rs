//! Writes: every change to a key, serialised per key by striped locks.

use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::sync::atomic::AtomicU8;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

use tokio::sync::Notify;

use super::Inner;
use super::pin::{Pin, held_by_this_task};
use super::versions::VersionTable;
use crate::util::{deadline_after, lock};

/// Enough that writes to different keys from a few cores rarely meet.
pub(super) const WRITE_STRIPES: usize = 64;

/// The lock of one stripe, held from a write's decision until moka has the
/// result (across moka's `insert`, an await).
///
/// Not tokio's `Mutex`: its release takes the semaphore's internal lock
/// even when nobody waits, and a stripe is nearly always free, so that was
/// about 300 instructions an event. Here the free case is one
/// compare-exchange to take and one swap to give back. A task that finds
/// the stripe held marks it contended and waits on a `Notify`; the release
/// that sees the mark wakes every waiter, and they race again. Not fair,
/// which is harmless at the contention stripes see; a waiter's future can
/// be dropped at any point, since it holds nothing until it returns.
#[derive(Debug, Default)]
pub(super) struct Stripe {
    state: AtomicU8,
    waiters: Notify,
}

const FREE: u8 = 0;
const HELD: u8 = 1;
const CONTENDED: u8 = 2;

impl Stripe {
    pub(super) async fn lock(&self) -> StripeGuard<'_> {
        loop {
            if self
                .state
                .compare_exchange(FREE, HELD, Acquire, Relaxed)
                .is_ok()
            {
                return StripeGuard(self);
            }
            // Made before the mark: a `Notified` receives `notify_waiters`
            // from the moment it is created, so a release between the mark
            // and the await still wakes this task.
            let woken = self.waiters.notified();
            match self
                .state
                .compare_exchange(HELD, CONTENDED, Relaxed, Relaxed)
            {
                Ok(_) | Err(CONTENDED) => woken.await,
                // Released meanwhile: try again.
                Err(_) => {}
            }
        }
    }
}

/// Releases the stripe when dropped.
#[derive(Debug)]
pub(super) struct StripeGuard<'a>(&'a Stripe);

impl Drop for StripeGuard<'_> {
    fn drop(&mut self) {
        if self.0.state.swap(FREE, Release) == CONTENDED {
            self.0.waiters.notify_waiters();
        }
    }
}

/// What a write does to the moka entry, decided under the key's write lock.
pub(super) enum Write<V> {
    Put(V),
    Remove,
    Keep,
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Applies one decision to one key, atomically with respect to every
    /// other write to that key. Returns whether the decision changed anything.
    pub(super) async fn write<F>(&self, key: K, decide: F) -> bool
    where
        F: FnOnce(&mut VersionTable<K>, &K) -> Write<V>,
    {
        let _key_lock = self.lock_key(&key).await;
        // The decision and moka's change normally happen in one poll. moka
        // can wait in between only when an eviction listener holds the key;
        // a caller cancelled there leaves the decision recorded without the
        // change, as with moka's own `and_compute_with`. The consumer never
        // cancels an apply (it stops between batches).
        let write = decide(&mut lock(&self.table), &key);
        match write {
            Write::Put(value) => self.cache.insert(key, value).await,
            Write::Remove => self.cache.invalidate(&key).await,
            Write::Keep => return false,
        }
        true
    }

    pub(super) async fn invalidate(&self, key: K, version: Option<u64>) {
        self.write(key, |table, k| {
            table.invalidate(k, version);
            Write::Remove
        })
        .await;
    }

    pub(super) fn stripe(&self, key: &K) -> usize {
        self.hasher.hash_one(key) as usize % WRITE_STRIPES
    }

    /// Takes `key`'s stripe, once no other task's locked load pins the key,
    /// or once it has waited `max_pin_wait` for such a pin: it then goes
    /// past the pin, counting that on it, so the load will not return its
    /// value (see `load_locked`). For local writes and load installs; the
    /// consumer never waits for a pin (`apply_item`).
    pub(super) async fn lock_key(&self, key: &K) -> StripeGuard<'_> {
        let stripe = &self.write_locks[self.stripe(key)];
        let mut deadline = None;
        loop {
            let guard = stripe.lock().await;
            let Some(pin) = self.pin_of_another_task(key) else {
                return guard;
            };
            let deadline = *deadline.get_or_insert_with(|| deadline_after(self.max_pin_wait));
            if tokio::time::Instant::now() >= deadline {
                pin.overtake();
                return guard;
            }
            // Wait without the stripe: writes to the stripe's other keys go
            // on meanwhile.
            drop(guard);
            let _ = tokio::time::timeout_at(deadline, pin.released()).await;
        }
    }

    /// The pin on `key` of a locked load on another task, if any. Call with
    /// the key's stripe held.
    pub(super) fn pin_of_another_task(&self, key: &K) -> Option<Arc<Pin>> {
        if self.pinned.load(Relaxed) == 0 {
            return None;
        }
        let pin = lock(&self.pins).pins.get(key).cloned()?;
        (!held_by_this_task(&pin)).then_some(pin)
    }

    /// Empties the cache. Never waits for a pin: the consumer clears on its
    /// own task (a clear event, a resync) and must not stall behind a
    /// loader; local clears do the same.
    pub(super) async fn clear(&self, version: Option<u64>) {
        // First, in one step under the pin map's lock (then the table's):
        // - every other task's pin counts the clear as going past it. A
        //   locked load that took its token before the stamp is superseded
        //   by it, and its value may predate the clear, so it must not
        //   return that value (it returns what is cached, or loads again);
        //   one that took its token after is not superseded, and needs no
        //   count. Both happen under this lock, so no pin slips between.
        // - the stamp: from here on no load that started earlier passes
        //   its check.
        // - every parked event write is taken out of its queue
        //   (`drop_parked`). Each was delivered before this clear (the
        //   consumer applies in order, and a clear from elsewhere is
        //   concurrent with them), so applied after it, it would bring back
        //   what the clear removed; its version is kept as a tombstone.
        {
            let mut pins = lock(&self.pins);
            for pin in pins.pins.values().filter(|p| !held_by_this_task(p)) {
                pin.overtake();
            }
            let mut table = lock(&self.table);
            // Read before the stamp: a change sent by then was committed
            // before it, so a load that the stamp does not supersede reads
            // it, and one that it does never installs. (Read after, a change
            // committed between the two could count as covered while a load
            // that began before it installed the row it replaced.)
            *lock(&self.emptied_at) = tokio::time::Instant::now();
            table.clear(version);
            self.drop_parked(&mut pins, &mut table);
        }
        // Then a barrier through every stripe, one at a time: a write that
        // passed its check before the stamp (a parked write a drainer took
        // out before the step above among them) holds its stripe until moka
        // has its value, so once the barrier is through, every such value
        // is in moka, and `invalidate_all` (which drops what was inserted
        // before it runs) removes it. Holding one stripe at a time means a
        // clear never holds one stripe while waiting for another, and no
        // stripe is held while waiting for a pin, so the barrier waits only
        // for writes in progress.
        for stripe in &self.write_locks {
            drop(stripe.lock().await);
        }
        self.cache.invalidate_all();
        // moka evicts the entries at its next housekeeping, all in one
        // call (5 to 8 s for 1M entries). On a node, that call is made now,
        // on the runtime's blocking pool, and waited for here without
        // holding a worker: otherwise the next cache write (the consumer's
        // next event) would find 64 writes logged and make it inline, on
        // the application's runtime.
        let housekeeper = lock(&self.housekeeper).clone();
        if let Some(housekeeper) = housekeeper {
            let cache = self.cache.clone();
            housekeeper
                .run(async move { cache.run_pending_tasks().await })
                .await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;

    /// Many tasks on two threads, some of them giving up while they wait:
    /// never two holders at once, and every task that keeps waiting gets in.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stripe_admits_one_holder_at_a_time_and_wakes_its_waiters() {
        let stripe = Arc::new(Stripe::default());
        let holders = Arc::new(AtomicUsize::new(0));
        let entered = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let (stripe, holders, entered) = (stripe.clone(), holders.clone(), entered.clone());
                tokio::spawn(async move {
                    for i in 0..2000 {
                        // Every third attempt of odd tasks is cancelled if it
                        // has to wait at all.
                        let guard = if t % 2 == 1 && i % 3 == 0 {
                            match tokio::time::timeout(Duration::ZERO, stripe.lock()).await {
                                Ok(g) => g,
                                Err(_) => continue,
                            }
                        } else {
                            stripe.lock().await
                        };
                        assert_eq!(holders.fetch_add(1, Relaxed), 0, "two holders at once");
                        if i % 7 == 0 {
                            tokio::task::yield_now().await;
                        }
                        holders.fetch_sub(1, Relaxed);
                        entered.fetch_add(1, Relaxed);
                        drop(guard);
                    }
                })
            })
            .collect();
        let all = async {
            for t in tasks {
                t.await.unwrap();
            }
        };
        tokio::time::timeout(Duration::from_secs(60), all)
            .await
            .expect("a waiter was never woken");
        assert!(entered.load(Relaxed) >= 4 * 2000);
        assert_eq!(stripe.state.load(Relaxed), FREE);
    }
}
