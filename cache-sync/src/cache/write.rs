//! Writes: every change to a key, serialised per key by striped locks.

use std::hash::{BuildHasher, Hash};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::Mutex as AsyncMutex;

use super::Inner;
use super::load::held_by_this_task;
use super::versions::{RefreshDecision, VersionTable};
use crate::util::lock;

/// Enough that writes to different keys from a few cores rarely meet.
pub(super) const WRITE_STRIPES: usize = 64;

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

    pub(super) async fn refresh(&self, key: K, value: V, version: Option<u64>) -> RefreshDecision {
        let mut decision = RefreshDecision::Stale;
        self.write(key, |table, k| {
            decision = table.refresh(k, version);
            match decision {
                RefreshDecision::Apply => Write::Put(value),
                RefreshDecision::Invalidate => Write::Remove,
                RefreshDecision::Stale => Write::Keep,
            }
        })
        .await;
        decision
    }

    pub(super) fn stripe(&self, key: &K) -> usize {
        self.hasher.hash_one(key) as usize % WRITE_STRIPES
    }

    /// Takes `key`'s stripe, once no other task's locked load pins the key.
    pub(super) async fn lock_key(&self, key: &K) -> tokio::sync::MutexGuard<'_, ()> {
        let stripe = &self.write_locks[self.stripe(key)];
        loop {
            let guard = stripe.lock().await;
            match self.pin_of_another_task(key) {
                None => return guard,
                Some(pin) => {
                    // Wait without the stripe: writes to the stripe's other
                    // keys go on meanwhile.
                    drop(guard);
                    drop(pin.lock().await);
                }
            }
        }
    }

    /// The pin on `key` of a locked load on another task, if any. Call with
    /// the key's stripe held.
    pub(super) fn pin_of_another_task(&self, key: &K) -> Option<Arc<AsyncMutex<()>>> {
        if self.pinned.load(Relaxed) == 0 {
            return None;
        }
        let pin = lock(&self.pins).get(key).cloned()?;
        (!held_by_this_task(&pin)).then_some(pin)
    }

    pub(super) async fn clear(&self, version: Option<u64>) {
        // First the stamp: from here on no load that started earlier passes
        // its check. Then a barrier through every stripe, one at a time: a
        // write that passed its check before the stamp holds its stripe
        // until moka has its value, so once the barrier is through, every
        // such value is in moka, and `invalidate_all` (which drops what was
        // inserted before it runs) removes it. Holding one stripe at a time
        // means a clear never holds one stripe while waiting for another, so
        // it cannot deadlock with a write waiting for a pin.
        lock(&self.table).clear(version);
        for stripe in &self.write_locks {
            drop(stripe.lock().await);
        }
        // A locked load that took its token before the stamp installs only
        // once its pin is gone; wait for those too (not for this task's own:
        // that would be waiting on itself).
        let pins: Vec<_> = lock(&self.pins).values().cloned().collect();
        for pin in pins.iter().filter(|p| !held_by_this_task(p)) {
            drop(pin.lock().await);
        }
        self.cache.invalidate_all();
    }
}
