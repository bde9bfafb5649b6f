//! Event writes to a pinned key: parked, so that the node's consumer never
//! waits for a loader, and applied in delivery order by a drainer task once
//! the pin goes, or at `max_pin_wait`.
//!
//! Why no write is reordered:
//! - A key's queue is made by the consumer when its write finds another
//!   task's pin on the key, and removed by the key's drainer together with
//!   applying its last item; both hold the key's stripe. While the queue
//!   exists, every later event write to the key joins it (the consumer
//!   decides under the stripe too), so none overtakes an earlier one, and
//!   the consumer cannot find the queue gone while an item in it is still
//!   unapplied.
//! - The drainer applies the queue holding the stripe throughout, front to
//!   back, so no other write to the key lands between two of its items.
//! - A clear takes every parked item out (`drop_parked`): they were all
//!   delivered before it. Their queues stay, empty, for their drainers.
//! - Writes to other keys, and other caches, never look at the queue.

use std::collections::VecDeque;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering::{Relaxed, Release};

use super::Inner;
use super::pin::{Pin, held_by_this_task};
use super::versions::{RefreshDecision, VersionTable};
use super::write::Write;
use crate::status::TraceEvent;
use crate::util::{HashMap, deadline_after, lock, now_us};

/// What an event does to one key, decoded and owned, so that it can wait.
pub(super) enum Op<V> {
    /// An invalidation (counted in `invalidations`).
    Invalidate,
    /// A versioned refresh during the quarantine, applied as an
    /// invalidation (counted in `refreshes_quarantined`).
    Quarantined,
    /// A refresh (counted by its decision).
    Refresh(V),
    /// A versioned refresh in a late event (at or below its publisher's
    /// last number: a redelivery, a replay, an event that changed queue).
    /// Never installed: a gap may have resynced the cache since, and a
    /// value loaded without a version then leaves the record older than
    /// what the cache holds. Ignored as stale where the record says the
    /// node already had its version (a replay changes nothing), otherwise
    /// applied as an invalidation at its version. An unversioned refresh
    /// in a late event is an `Invalidate`: nothing tells its age.
    Late,
}

/// One event item for one key.
pub(super) struct Item<V> {
    pub(super) op: Op<V>,
    pub(super) version: Option<u64>,
}

/// The pins of locked loads, and the event writes parked behind them: one
/// lock for both, so a write sees its key's pin and queue in one state.
/// Lock order: this, then the version table.
pub(super) struct Pins<K, V> {
    pub(super) pins: HashMap<K, Arc<Pin>>,
    /// Per key, event writes not applied yet, in delivery order.
    pub(super) parked: HashMap<K, VecDeque<Item<V>>>,
}

impl<K, V> Default for Pins<K, V> {
    fn default() -> Self {
        Self {
            pins: HashMap::default(),
            parked: HashMap::default(),
        }
    }
}

impl<K, V> Pins<K, V> {
    /// What `Inner::pinned` holds: pins and queues.
    pub(super) fn count(&self) -> usize {
        self.pins.len().saturating_add(self.parked.len())
    }
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// The consumer's write of one event item to `key`: applied at once,
    /// or, when another task's locked load pins the key or earlier writes
    /// to it are parked, parked behind them. Never waits for a pin. Returns
    /// whether it was applied now.
    pub(super) async fn apply_item(&self, key: K, item: Item<V>) -> Option<TraceEvent> {
        let _stripe = self.write_locks[self.stripe(&key)].lock().await;
        // Nearly always 0, and then this is all the pins cost. Read under
        // the key's stripe, under which its pin or queue was counted.
        let (key, item) = if self.pinned.load(Relaxed) == 0 {
            (key, item)
        } else {
            match self.park(key, item) {
                Some(back) => back,
                None => return None,
            }
        };
        Some(self.apply_held(key, item).await)
    }

    /// With the key's stripe held: parks `item` behind the key's queue or
    /// another task's pin on it (then `None`), or hands it back to be
    /// applied now.
    fn park(&self, key: K, item: Item<V>) -> Option<(K, Item<V>)> {
        let mut guard = lock(&self.pins);
        let pins = &mut *guard;
        if let Some(queue) = pins.parked.get_mut(&key) {
            queue.push_back(item);
        } else {
            let Some(pin) = pins.pins.get(&key).filter(|p| !held_by_this_task(p)) else {
                return Some((key, item));
            };
            // A bound of 0 waits for nothing: the write goes past the pin at
            // once, as it would at the bound. (`me` is always there: `self`
            // lives in that `Arc`.)
            let me = match self.me.upgrade() {
                Some(me) if !self.max_pin_wait.is_zero() => me,
                _ => {
                    pin.overtake();
                    return Some((key, item));
                }
            };
            let deadline = deadline_after(self.max_pin_wait);
            pins.parked.insert(key.clone(), VecDeque::from([item]));
            self.pinned.store(pins.count(), Relaxed);
            tokio::spawn(me.drain(key, deadline));
        }
        self.parked_items.fetch_add(1, Relaxed);
        self.stats.writes_parked.fetch_add(1, Relaxed);
        None
    }

    /// The drainer of `key`'s queue: once no other task's locked load pins
    /// the key, or at `deadline` (`max_pin_wait` after the queue's first
    /// write was parked) past the pin, counting that on it, applies the
    /// queue in order.
    async fn drain(self: Arc<Self>, key: K, deadline: tokio::time::Instant) {
        let stripe = &self.write_locks[self.stripe(&key)];
        let _stripe = loop {
            let guard = stripe.lock().await;
            // A new locked load may have pinned the key after the first one
            // went: wait for it too, within the same bound.
            let Some(pin) = self.pin_of_another_task(&key) else {
                break guard;
            };
            if tokio::time::Instant::now() >= deadline {
                pin.overtake();
                break guard;
            }
            drop(guard);
            let _ = tokio::time::timeout_at(deadline, pin.released()).await;
        };
        // The stripe stays held to the end (see the module's docs).
        loop {
            let item = {
                let mut pins = lock(&self.pins);
                let item = pins.parked.get_mut(&key).and_then(VecDeque::pop_front);
                if item.is_none() {
                    pins.parked.remove(&key);
                    self.pinned.store(pins.count(), Relaxed);
                }
                item
            };
            let Some(item) = item else { return };
            let version = item.version;
            let done = self.apply_held(key.clone(), item).await;
            if let Some(trace) = &self.trace {
                trace.record(Some(key.clone()), done, version, None, now_us());
            }
            // Only now is the event's change to this key done.
            if let Some(v) = version {
                self.raise_version(v);
            }
            // After the change: `parked()` false means it is in the cache.
            self.parked_items.fetch_sub(1, Release);
        }
    }

    /// Applies one event item to `key`, with the key's stripe held.
    pub(super) async fn apply_held(&self, key: K, item: Item<V>) -> TraceEvent {
        let s = &self.stats;
        // The decision and moka's change normally happen in one poll (see
        // `write`); the consumer and the drainers never cancel an apply.
        let (write, counter, done) = {
            let mut table = lock(&self.table);
            match item.op {
                Op::Invalidate => {
                    table.invalidate(&key, item.version);
                    (Write::Remove, &s.invalidations, TraceEvent::Invalidated)
                }
                Op::Quarantined => {
                    table.invalidate(&key, item.version);
                    (
                        Write::Remove,
                        &s.refreshes_quarantined,
                        TraceEvent::Quarantined,
                    )
                }
                Op::Late => match table.refresh_late(&key, item.version) {
                    RefreshDecision::Stale => {
                        (Write::Keep, &s.stale_ignored, TraceEvent::StaleIgnored)
                    }
                    RefreshDecision::Invalidate | RefreshDecision::Apply => {
                        (Write::Remove, &s.invalidations, TraceEvent::Invalidated)
                    }
                },
                Op::Refresh(value) => match table.refresh(&key, item.version) {
                    RefreshDecision::Apply => {
                        (Write::Put(value), &s.refreshes, TraceEvent::Refreshed)
                    }
                    RefreshDecision::Invalidate => {
                        (Write::Remove, &s.invalidations, TraceEvent::Invalidated)
                    }
                    RefreshDecision::Stale => {
                        (Write::Keep, &s.stale_ignored, TraceEvent::StaleIgnored)
                    }
                },
            }
        };
        match write {
            Write::Put(value) => self.cache.insert(key, value).await,
            Write::Remove => self.cache.invalidate(&key).await,
            Write::Keep => {}
        }
        counter.fetch_add(1, Relaxed);
        done
    }

    /// For a clear, right after its stamp, under the pin map's and the
    /// table's locks: takes every parked write out of its queue. They were
    /// delivered before the clear, so what each would leave in moka the
    /// clear removes anyway, and applied after it, they would bring it
    /// back. What each would leave in the version table is kept: a
    /// versioned one's version, recorded as a tombstone is (in order, an
    /// invalidation records it; a refresh records it and the clear then
    /// drops its value; one that was stale or met an inexact record leaves
    /// the record where a tombstone does too), so an older refresh
    /// delivered later still cannot land. An unversioned one leaves only a
    /// stamp, which the clear's own covers. The queues stay, empty, for
    /// their drainers, so later writes to those keys still wait behind the
    /// pins. Not counted in `refreshes` or `invalidations`: the clear did
    /// their work.
    pub(super) fn drop_parked(&self, pins: &mut Pins<K, V>, table: &mut VersionTable<K>) {
        let mut dropped = 0usize;
        let mut newest = None;
        for (key, queue) in &mut pins.parked {
            for item in queue.drain(..) {
                dropped = dropped.saturating_add(1);
                if let Some(v) = item.version {
                    table.invalidate(key, Some(v));
                    newest = newest.max(Some(v));
                }
            }
        }
        if dropped > 0 {
            self.parked_items.fetch_sub(dropped, Release);
        }
        if let Some(v) = newest {
            self.raise_version(v);
        }
    }

    /// Raises the cache's version for an event item done apart from its
    /// event (parked, then applied or dropped by a clear).
    fn raise_version(&self, v: u64) {
        if self.stats.version.fetch_max(v, Relaxed) < v {
            self.stats.version_at_us.store(now_us(), Relaxed);
        }
    }
}
