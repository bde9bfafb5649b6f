//! Read-through loads: coalescing concurrent loads of one key, retrying a
//! load a write overtook, and pinning the key for the last attempt.

use std::any::Any;
use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::watch;

use super::Inner;
use super::pin::{Pin, held_by_this_task, holding};
use super::versions::LoadDecision;
use super::write::Write;
use crate::status::TraceEvent;
use crate::util::lock;

pub(super) type SharedError = Arc<dyn Any + Send + Sync>;
pub(super) type FlightResult<V> = Option<Result<V, SharedError>>;

/// One in-flight load that concurrent callers for the same key wait on.
pub(super) struct Flight<V> {
    pub(super) result: watch::Sender<FlightResult<V>>,
}

/// Removes a flight from the map when its leader finishes or is cancelled.
pub(super) struct FlightGuard<'a, K: Hash + Eq, V> {
    pub(super) inner: &'a Inner<K, V>,
    pub(super) key: &'a K,
    pub(super) flight: &'a Arc<Flight<V>>,
}

impl<K: Hash + Eq, V> Drop for FlightGuard<'_, K, V> {
    fn drop(&mut self) {
        let mut flights = lock(&self.inner.flights);
        if flights
            .get(self.key)
            .is_some_and(|f| Arc::ptr_eq(f, self.flight))
        {
            flights.remove(self.key);
        }
    }
}

/// A locked load's pin on its key: removed, and its waiters woken, when the
/// load installs, fails or is cancelled.
pub(super) struct KeyPin<'a, K: Hash + Eq, V> {
    pub(super) inner: &'a Inner<K, V>,
    pub(super) key: &'a K,
    pub(super) pin: Arc<Pin>,
}

impl<K: Hash + Eq, V> Drop for KeyPin<'_, K, V> {
    fn drop(&mut self) {
        let mut pins = lock(&self.inner.pins);
        if pins
            .pins
            .get(self.key)
            .is_some_and(|p| Arc::ptr_eq(p, &self.pin))
        {
            pins.pins.remove(self.key);
        }
        self.inner.pinned.store(pins.count(), Relaxed);
        drop(pins);
        // Wakes the writes that waited for the pin; they find it gone.
        self.pin.release();
    }
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Runs the loader until its result can be installed without having
    /// crossed a write to the key. The loader gives the value and, for a
    /// versioned load, the row version it read (see `VersionTable::loaded`).
    ///
    /// A read-through load that a write overtook returns what that write
    /// left in the cache, which is no older than a change applied while it
    /// ran. A forced-fresh one (`fresh`) returns it only if the node holds
    /// it at the version the loader read or a newer one: an older refresh
    /// delivered during the load must not stand in for the row the source
    /// gave. Otherwise it loads again.
    pub(super) async fn load<F, Fut, E>(
        &self,
        key: &K,
        loader: &mut F,
        fresh: bool,
    ) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(V, Option<u64>), E>>,
    {
        let mut attempt = 0;
        loop {
            if attempt > self.max_load_retries {
                return self.load_locked(key, loader, fresh).await;
            }
            let token = lock(&self.table).load_token();
            self.stats.loads.fetch_add(1, Relaxed);
            let (value, version) = match loader().await {
                Ok(loaded) => loaded,
                Err(e) => {
                    self.stats.load_failures.fetch_add(1, Relaxed);
                    return Err(Arc::new(e));
                }
            };
            let mut decision = LoadDecision::Superseded;
            self.write(key.clone(), |table, k| {
                decision = table.loaded(k, token, version);
                match decision {
                    LoadDecision::Install => Write::Put(value.clone()),
                    LoadDecision::Superseded | LoadDecision::Stale => Write::Keep,
                }
            })
            .await;
            if self.trace.is_some() {
                self.traced(Some(key.clone()), traced(decision), version);
            }
            match (decision, fresh, version) {
                (LoadDecision::Install, _, _) => return Ok(value),
                (LoadDecision::Stale, true, Some(v)) => {
                    return Ok(self.fresh_stale(key, value, v).await);
                }
                (LoadDecision::Stale, _, _) => return Ok(self.stale_load(key, value).await),
                (LoadDecision::Superseded, _, _) => {}
            }
            self.stats.loads_superseded.fetch_add(1, Relaxed);
            // A refresh that superseded us may have installed a newer value.
            let cached = match (fresh, version) {
                (true, Some(version)) => self.cached_at_least(key, version).await,
                _ => self.cache.get(key).await,
            };
            if let Some(v) = cached {
                return Ok(v);
            }
            attempt = attempt.saturating_add(1);
        }
    }

    /// A forced-fresh load the node cannot cache: its version is below one
    /// the node knows for the key, or below the floor evicted records
    /// leave. The cached value if the node holds it at the loaded version
    /// or newer; otherwise whatever is cached may be older than the row
    /// read, and the node cannot tell, so it is dropped (an invalidation is
    /// always safe) and the row read is returned, uncached.
    async fn fresh_stale(&self, key: &K, value: V, version: u64) -> V {
        self.stats.loads_stale.fetch_add(1, Relaxed);
        if let Some(cached) = self.cached_at_least(key, version).await {
            return cached;
        }
        self.invalidate(key.clone(), None).await;
        value
    }

    /// The cached value, if the node holds `key` at exactly `version` or a
    /// newer one: the version its value was installed at (`held_at`), not
    /// one a tombstone or an older write left under a value installed
    /// without a version. Under the key's stripe, so the version and the
    /// value are those of one write.
    async fn cached_at_least(&self, key: &K, version: u64) -> Option<V> {
        let _stripe = self.write_locks[self.stripe(key)].lock().await;
        let known = lock(&self.table).held_at(key)?;
        if known < version {
            return None;
        }
        self.cache.get(key).await
    }

    /// A versioned load older than what the node knows for its key (the
    /// loader read a lagging replica, say): caching it could hide the newer
    /// change. The caller gets the cached value if there is one: a refresh
    /// at the newer version may have installed it while the loader ran, and
    /// returning the older row would break the promise that a load never
    /// returns a value older than a change applied while it ran. With none
    /// cached (the newer change was an invalidation), the source gave
    /// nothing newer, so the caller gets the loaded value, uncached.
    async fn stale_load(&self, key: &K, value: V) -> V {
        self.stats.loads_stale.fetch_add(1, Relaxed);
        if let Some(cached) = self.cache.get(key).await {
            tracing::debug!(cache = %self.name, "loaded version older than one known for the key; returned the cached value");
            return cached;
        }
        tracing::debug!(cache = %self.name, "loaded version older than one known for the key; returned uncached");
        value
    }

    /// The last resort for a key that kept changing during every load: one
    /// more load with the key pinned, so no write to the key from another
    /// task (and no clear) can land between the read and the install
    /// unless it waited `max_pin_wait` for the pin. Writes to other keys
    /// do not wait, and the node's consumer never does: it parks its
    /// writes to the key (see `park.rs`).
    ///
    /// A write that went past the pin (at the bound, or a clear) supersedes
    /// the load, whose value may then be older than that write: the call
    /// returns what the cache now holds, or, with nothing cached, loads
    /// again, pinned. A load superseded only by its own task (the loader
    /// wrote its key itself: a nested `insert`, `get_with` or clear; or,
    /// the key untracked, another key's eviction raised the floor) returns
    /// its value uncached, as it did when nothing else could pass the pin:
    /// a loader that writes its own key must not load for ever.
    pub(super) async fn load_locked<F, Fut, E>(
        &self,
        key: &K,
        loader: &mut F,
        fresh: bool,
    ) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(V, Option<u64>), E>>,
    {
        tracing::debug!(cache = %self.name, "key kept changing during loads; loading it pinned");
        loop {
            let pin = Arc::new(Pin::new());
            let pinned = KeyPin {
                inner: self,
                key,
                pin: pin.clone(),
            };
            let (token, watched, overtaken_before) = {
                // Pin under the stripe: a write that holds it has either
                // landed already (before the token) or will see the pin.
                let _stripe = self.lock_key(key).await;
                let mut pins = lock(&self.pins);
                let watched = match pins.pins.get(key) {
                    // A nested load of the same key on this task keeps the
                    // outer pin, which other tasks' writes find and count.
                    Some(outer) if held_by_this_task(outer) => outer.clone(),
                    // Another task's pin still here means `lock_key` waited
                    // `max_pin_wait` for it in vain (and counted that on
                    // it): this load takes the key over.
                    _ => {
                        pins.pins.insert(key.clone(), pin.clone());
                        pin.clone()
                    }
                };
                self.pinned.store(pins.count(), Relaxed);
                let before = watched.overtaken.load(Relaxed);
                (lock(&self.table).load_token(), watched, before)
            };
            self.stats.loads.fetch_add(1, Relaxed);
            let loaded = holding(&pin, loader()).await;
            let (value, version) = match loaded {
                Ok(loaded) => loaded,
                Err(e) => {
                    self.stats.load_failures.fetch_add(1, Relaxed);
                    return Err(Arc::new(e));
                }
            };
            let (decision, overtaken) = {
                let _stripe = self.write_locks[self.stripe(key)].lock().await;
                let decision = lock(&self.table).loaded(key, token, version);
                match decision {
                    LoadDecision::Install => self.cache.insert(key.clone(), value.clone()).await,
                    LoadDecision::Superseded => {
                        self.stats.loads_superseded.fetch_add(1, Relaxed);
                    }
                    LoadDecision::Stale => {}
                }
                if self.trace.is_some() {
                    self.traced(Some(key.clone()), traced(decision), version);
                }
                // After the decision: every write of another task that
                // superseded it counted itself first (see `Pin`).
                let overtaken = watched.overtaken.load(Relaxed) != overtaken_before;
                // Unpin before the stripe goes, so the next write sees no pin.
                drop(pinned);
                (decision, overtaken)
            };
            match (decision, fresh, version) {
                (LoadDecision::Install, _, _) => return Ok(value),
                (LoadDecision::Stale, true, Some(v)) => {
                    return Ok(self.fresh_stale(key, value, v).await);
                }
                (LoadDecision::Stale, _, _) => return Ok(self.stale_load(key, value).await),
                // Only this task wrote the key: its write stands, and the
                // value is returned uncached.
                (LoadDecision::Superseded, _, _) if !overtaken => return Ok(value),
                (LoadDecision::Superseded, _, _) => {}
            }
            // The value may be older than the write that went past the pin:
            // what that write (or a later one) left is the answer, for a
            // forced-fresh load only if it is at the loaded version or
            // newer; none left (an invalidation, a clear), load again.
            let cached = match (fresh, version) {
                (true, Some(version)) => self.cached_at_least(key, version).await,
                _ => self.cache.get(key).await,
            };
            if let Some(v) = cached {
                return Ok(v);
            }
        }
    }
}

/// How a load's decision shows in a key's trace.
fn traced(decision: LoadDecision) -> TraceEvent {
    match decision {
        LoadDecision::Install => TraceEvent::Loaded,
        LoadDecision::Stale => TraceEvent::LoadStale,
        LoadDecision::Superseded => TraceEvent::LoadSuperseded,
    }
}
