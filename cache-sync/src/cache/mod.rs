//! The cache: a moka cache that events keep in step.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash, RandomState};
use std::sync::atomic::{
    AtomicU64, AtomicUsize, Ordering::AcqRel, Ordering::Acquire, Ordering::Relaxed,
    Ordering::Release,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Mutex as AsyncMutex, watch};

use crate::event::{Change, Header, decode_part};
use crate::lock;
use crate::status::CacheStatus;

mod versions;

use versions::{RefreshDecision, VersionTable};

/// Default bound on per-key version records; see [`SyncedCacheBuilder::max_tracked_keys`].
pub const DEFAULT_MAX_TRACKED_KEYS: usize = 100_000;

/// A `moka::future::Cache` kept in step with the rest of the cluster.
///
/// Reads work as in moka. Reads never publish anything: to tell other nodes
/// about a change, use a [`Publisher`](crate::Publisher).
///
/// Register it with a [`Node`](crate::Node) so the node's consumer applies
/// change events to it. Clones share the same cache.
///
/// # Loads never resurrect stale data
/// Every write to a key (an event, a local insert or invalidation) and every
/// load result holds that key's write lock from its decision until moka has
/// the result, so they are serialised per key. A load takes a token when it
/// starts; if any write to its key, or any clear, lands before the load's
/// result is installed, the result is discarded and the load is retried, up
/// to [`max_load_retries`](SyncedCacheBuilder::max_load_retries) times. A key
/// that changes during every one of those is loaded once more with the key
/// pinned, so that load cannot be overtaken: `get_with` never returns a value
/// older than a change applied while it ran.
///
/// During that last load the key is pinned: other tasks' writes to that one
/// key (the node's consumer included) and clears of the cache wait for the
/// loader, so a loader must not wait for another task that writes that key
/// or clears the cache. Writes to other keys never wait for it, and writes
/// the loader makes itself, on its own task (a nested `get_with`, an
/// `insert`), go ahead.
///
/// Do not write to the wrapped moka cache directly: such writes bypass the
/// per-key bookkeeping.
///
/// # Missing rows
/// To remember that a row does not exist, cache `Option<V>` and let the
/// loader return `None`; a loader error is never cached and counts as a
/// failed load.
pub struct SyncedCache<K, V> {
    inner: Arc<Inner<K, V>>,
}

impl<K, V> Clone for SyncedCache<K, V> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<K, V> fmt::Debug for SyncedCache<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncedCache")
            .field("name", &self.inner.name)
            .finish_non_exhaustive()
    }
}

/// Builds a [`SyncedCache`] with non-default settings.
pub struct SyncedCacheBuilder<K, V> {
    name: String,
    cache: moka::future::Cache<K, V>,
    max_tracked_keys: usize,
    max_load_retries: u32,
}

impl<K, V> fmt::Debug for SyncedCacheBuilder<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncedCacheBuilder")
            .field("name", &self.name)
            .field("max_tracked_keys", &self.max_tracked_keys)
            .field("max_load_retries", &self.max_load_retries)
            .finish_non_exhaustive()
    }
}

impl<K, V> SyncedCacheBuilder<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// How many per-key version records (tombstones included) are kept.
    /// Default 100 000. Each costs one key clone and about 40 bytes, plus up
    /// to two more key clones in the eviction queue. Once full, the least
    /// recently written record is dropped and its version folded into a floor
    /// for untracked keys: a refresh at or below the floor becomes an
    /// invalidation, so eviction never lets an older value in.
    pub fn max_tracked_keys(mut self, n: usize) -> Self {
        self.max_tracked_keys = n.max(1);
        self
    }

    /// How many times a load whose key was written meanwhile is retried
    /// without holding anything. After that, one more load runs with the key
    /// pinned, so it cannot be overtaken (see the type's docs). Default 3;
    /// 0 pins the key at the first retry.
    pub fn max_load_retries(mut self, n: u32) -> Self {
        self.max_load_retries = n;
        self
    }

    /// The cache.
    pub fn build(self) -> SyncedCache<K, V> {
        SyncedCache {
            inner: Arc::new(Inner {
                name: self.name,
                cache: self.cache,
                table: Mutex::new(VersionTable::new(self.max_tracked_keys)),
                write_locks: (0..WRITE_STRIPES).map(|_| AsyncMutex::new(())).collect(),
                stripe_hasher: RandomState::new(),
                pins: Mutex::default(),
                pinned: AtomicUsize::new(0),
                flights: Mutex::default(),
                max_load_retries: self.max_load_retries,
                owner: AtomicU64::new(0),
                quarantine_until: Mutex::new(None),
                quarantine: Mutex::new(Duration::ZERO),
                stats: Stats::default(),
            }),
        }
    }
}

pub(crate) struct Inner<K, V> {
    name: String,
    cache: moka::future::Cache<K, V>,
    table: Mutex<VersionTable<K>>,
    /// Per-key write serialisation, striped by key hash: a write holds its
    /// key's stripe from the version-table decision until moka has the
    /// result, so no other write to the key can land in between. A clear
    /// passes through every stripe, one at a time: moka's `invalidate_all`
    /// only drops entries inserted before it runs, so a load that passed its
    /// check just before a clear could otherwise insert just after it.
    ///
    /// moka's own `and_compute_with` would serialise per key too, but costs
    /// several lookups and a waiter-map insertion per call; applying an
    /// event spent about three quarters of its time there.
    write_locks: Box<[AsyncMutex<()>]>,
    stripe_hasher: RandomState,
    /// Keys under a locked last load (see `load_locked`): writes to them
    /// from other tasks wait until the load has installed its value.
    /// Entries are added under the key's stripe, so a write that holds the
    /// stripe sees every pin of its key; they are removed under it after an
    /// install, and without it when the load fails or is cancelled (a write
    /// that then finds the pin gone just goes ahead).
    pins: Mutex<HashMap<K, Arc<AsyncMutex<()>>>>,
    /// `pins.len()`, read under a stripe so a write skips the map's lock
    /// while nothing is pinned (nearly always).
    pinned: AtomicUsize,
    flights: Mutex<HashMap<K, Arc<Flight<V>>>>,
    max_load_retries: u32,
    /// The node that holds the cache, by its token; 0 when none does.
    owner: AtomicU64,
    /// Until then, versioned refreshes are applied as invalidations; see
    /// `CacheHandle::resync`.
    quarantine_until: Mutex<Option<tokio::time::Instant>>,
    /// How long each resync quarantines, set by the node at registration.
    quarantine: Mutex<Duration>,
    stats: Stats,
}

type SharedError = Arc<dyn Any + Send + Sync>;
type FlightResult<V> = Option<Result<V, SharedError>>;

/// One in-flight load that concurrent callers for the same key wait on.
struct Flight<V> {
    result: watch::Sender<FlightResult<V>>,
}

#[derive(Default)]
struct Stats {
    hits: StripedCounter,
    misses: StripedCounter,
    loads: AtomicU64,
    load_failures: AtomicU64,
    loads_superseded: AtomicU64,
    invalidations: AtomicU64,
    refreshes: AtomicU64,
    stale_ignored: AtomicU64,
    refresh_fallbacks: AtomicU64,
    refreshes_quarantined: AtomicU64,
    clears: AtomicU64,
    loss_resyncs: AtomicU64,
    rejected_events: AtomicU64,
    events_applied: AtomicU64,
    /// Highest version applied; 0 while none.
    version: AtomicU64,
    last_applied_us: AtomicU64,
    last_latency_us: AtomicU64,
}

/// A counter for the read path: one shared atomic would bounce its cache
/// line between every core that reads the cache.
#[derive(Default)]
struct StripedCounter {
    stripes: [Stripe; STRIPES],
}

const STRIPES: usize = 16;

#[derive(Default)]
#[repr(align(128))]
struct Stripe(AtomicU64);

impl StripedCounter {
    fn add_one(&self) {
        thread_local! {
            static STRIPE: usize = {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Relaxed) as usize % STRIPES
            };
        }
        let i = STRIPE.with(|s| *s);
        self.stripes[i].0.fetch_add(1, Relaxed);
    }

    fn sum(&self) -> u64 {
        self.stripes.iter().map(|s| s.0.load(Relaxed)).sum()
    }
}

/// Enough that writes to different keys from a few cores rarely meet.
const WRITE_STRIPES: usize = 64;

tokio::task_local! {
    /// Set while a locked load's loader runs: the addresses of the pins its
    /// task holds (more than one when locked loads nest).
    static HELD_PINS: Vec<usize>;
}

/// What a write does to the moka entry, decided under the key's write lock.
enum Write<V> {
    Put(V),
    Remove,
    Keep,
}

pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl<K, V> SyncedCache<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Wraps `cache` under `name`, the name publishers use for it.
    pub fn new(name: impl Into<String>, cache: moka::future::Cache<K, V>) -> Self {
        Self::builder(name, cache).build()
    }

    /// Wraps `cache` with non-default settings.
    pub fn builder(
        name: impl Into<String>,
        cache: moka::future::Cache<K, V>,
    ) -> SyncedCacheBuilder<K, V> {
        SyncedCacheBuilder {
            name: name.into(),
            cache,
            max_tracked_keys: DEFAULT_MAX_TRACKED_KEYS,
            max_load_retries: 3,
        }
    }

    /// The name events address it by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The cached value, if any. Counts a hit or a miss.
    pub async fn get(&self, key: &K) -> Option<V> {
        let v = self.inner.cache.get(key).await;
        let counter = if v.is_some() {
            &self.inner.stats.hits
        } else {
            &self.inner.stats.misses
        };
        counter.add_one();
        v
    }

    /// The cached value, without counting a hit or miss (for diagnostics
    /// and tests that poll).
    pub async fn peek(&self, key: &K) -> Option<V> {
        self.inner.cache.get(key).await
    }

    /// Inserts locally. Not published; other nodes are unaffected.
    /// A load of `key` already in flight will not overwrite it.
    pub async fn insert(&self, key: K, value: V) {
        self.inner
            .write(key, |table, k| {
                table.touch(k);
                Write::Put(value)
            })
            .await;
    }

    /// Removes locally. Not published. A load of `key` already in flight will
    /// not install its result.
    pub async fn invalidate(&self, key: &K) {
        self.inner.invalidate(key.clone(), None).await;
    }

    /// Removes everything locally. Not published. No load already in flight
    /// will install its result.
    pub async fn invalidate_all(&self) {
        self.inner.clear(None).await;
    }

    /// Approximate number of entries, as moka reports it.
    pub fn entry_count(&self) -> u64 {
        self.inner.cache.entry_count()
    }

    /// A snapshot of the counters shown by the status endpoint.
    pub fn status(&self) -> CacheStatus {
        self.inner.snapshot()
    }

    /// Returns the cached value, or runs `loader` and caches its result.
    ///
    /// Concurrent calls for one key share a single load. If the key is
    /// written (by an event or locally) or the cache cleared while the load
    /// runs, its result is not cached and `loader` runs again, so the value
    /// returned is never older than a change applied while the call ran;
    /// see the type-level docs.
    pub async fn get_with<F, Fut>(&self, key: K, mut loader: F) -> V
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = V>,
    {
        match self
            .try_get_with(key, || {
                let f = loader();
                async move { Ok::<V, std::convert::Infallible>(f.await) }
            })
            .await
        {
            Ok(v) => v,
            Err(never) => match *never {},
        }
    }

    /// Like [`get_with`](Self::get_with) for a fallible loader. An error is
    /// not cached, and is shared (as in moka) with the callers that waited on
    /// the same load.
    pub async fn try_get_with<F, Fut, E>(&self, key: K, mut loader: F) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<V, E>>,
        E: Send + Sync + 'static,
    {
        if let Some(v) = self.get(&key).await {
            return Ok(v);
        }
        loop {
            let flight = {
                let mut flights = lock(&self.inner.flights);
                match flights.get(&key) {
                    Some(f) => Err(f.result.subscribe()),
                    None => {
                        let f = Arc::new(Flight {
                            result: watch::Sender::new(None),
                        });
                        flights.insert(key.clone(), f.clone());
                        Ok(f)
                    }
                }
            };
            match flight {
                Ok(flight) => {
                    let _landing = FlightGuard {
                        inner: &self.inner,
                        key: &key,
                        flight: &flight,
                    };
                    // A load that finished between our miss and taking the lead.
                    if let Some(v) = self.inner.cache.get(&key).await {
                        flight.result.send_replace(Some(Ok(v.clone())));
                        return Ok(v);
                    }
                    let result = self.inner.load(&key, &mut loader).await;
                    let shared = result.clone().map_err(|e| e as SharedError);
                    flight.result.send_replace(Some(shared));
                    return result;
                }
                Err(mut rx) => {
                    // Err: the leader was cancelled before it finished; lead a new load.
                    let Ok(done) = rx.wait_for(Option::is_some).await else {
                        continue;
                    };
                    match done.clone() {
                        Some(Ok(v)) => return Ok(v),
                        Some(Err(e)) => match e.downcast::<E>() {
                            Ok(e) => return Err(e),
                            // The leader's loader had another error type; load ourselves.
                            Err(_) => continue,
                        },
                        None => continue,
                    }
                }
            }
        }
    }
}

/// Removes a flight from the map when its leader finishes or is cancelled.
struct FlightGuard<'a, K: Hash + Eq, V> {
    inner: &'a Inner<K, V>,
    key: &'a K,
    flight: &'a Arc<Flight<V>>,
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
struct KeyPin<'a, K: Hash + Eq, V> {
    inner: &'a Inner<K, V>,
    key: &'a K,
    pin: Arc<AsyncMutex<()>>,
    /// Held for the pin's life; waiters wait for it.
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl<K: Hash + Eq, V> Drop for KeyPin<'_, K, V> {
    fn drop(&mut self) {
        let mut pins = lock(&self.inner.pins);
        if pins
            .get(self.key)
            .is_some_and(|p| Arc::ptr_eq(p, &self.pin))
        {
            pins.remove(self.key);
        }
        self.inner.pinned.store(pins.len(), Relaxed);
        drop(pins);
        // Wakes the writes that waited for the pin; they find it gone.
        self.held.take();
    }
}

fn pin_id(pin: &Arc<AsyncMutex<()>>) -> usize {
    Arc::as_ptr(pin) as usize
}

/// Whether the current task is the locked load that holds `pin`.
fn held_by_this_task(pin: &Arc<AsyncMutex<()>>) -> bool {
    HELD_PINS
        .try_with(|held| held.contains(&pin_id(pin)))
        .unwrap_or(false)
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Applies one decision to one key, atomically with respect to every
    /// other write to that key. Returns whether the decision changed anything.
    async fn write<F>(&self, key: K, decide: F) -> bool
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

    async fn invalidate(&self, key: K, version: Option<u64>) {
        self.write(key, |table, k| {
            table.invalidate(k, version);
            Write::Remove
        })
        .await;
    }

    async fn refresh(&self, key: K, value: V, version: Option<u64>) -> RefreshDecision {
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

    fn stripe(&self, key: &K) -> usize {
        self.stripe_hasher.hash_one(key) as usize % WRITE_STRIPES
    }

    /// Takes `key`'s stripe, once no other task's locked load pins the key.
    async fn lock_key(&self, key: &K) -> tokio::sync::MutexGuard<'_, ()> {
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
    fn pin_of_another_task(&self, key: &K) -> Option<Arc<AsyncMutex<()>>> {
        if self.pinned.load(Relaxed) == 0 {
            return None;
        }
        let pin = lock(&self.pins).get(key).cloned()?;
        (!held_by_this_task(&pin)).then_some(pin)
    }

    async fn clear(&self, version: Option<u64>) {
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

    /// Runs the loader until its result can be installed without having
    /// crossed a write to the key.
    async fn load<F, Fut, E>(&self, key: &K, loader: &mut F) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        let mut attempt = 0;
        loop {
            if attempt > self.max_load_retries {
                return self.load_locked(key, loader).await;
            }
            let token = lock(&self.table).load_token();
            self.stats.loads.fetch_add(1, Relaxed);
            let value = match loader().await {
                Ok(v) => v,
                Err(e) => {
                    self.stats.load_failures.fetch_add(1, Relaxed);
                    return Err(Arc::new(e));
                }
            };
            let installed = self
                .write(key.clone(), |table, k| {
                    if table.superseded(k, token) {
                        Write::Keep
                    } else {
                        Write::Put(value.clone())
                    }
                })
                .await;
            if installed {
                return Ok(value);
            }
            self.stats.loads_superseded.fetch_add(1, Relaxed);
            // A refresh that superseded us may have installed a newer value.
            if let Some(v) = self.cache.get(key).await {
                return Ok(v);
            }
            attempt = attempt.saturating_add(1);
        }
    }

    /// The last resort for a key that kept changing during every load: one
    /// more load with the key pinned, so no write to the key from another
    /// task (and no clear) can land between the read and the install. Those
    /// writes wait for the loader meanwhile, the consumer's included; that
    /// is the price of never returning a value older than a change applied
    /// during the call. Writes to other keys do not wait.
    async fn load_locked<F, Fut, E>(&self, key: &K, loader: &mut F) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        tracing::debug!(cache = %self.name, "key kept changing during loads; loading it pinned");
        let pin = Arc::new(AsyncMutex::new(()));
        let pinned = KeyPin {
            inner: self,
            key,
            held: pin.clone().try_lock_owned().ok(),
            pin: pin.clone(),
        };
        let token = {
            // Pin under the stripe: a write that holds it has either landed
            // already (before the token) or will see the pin.
            let _stripe = self.lock_key(key).await;
            let mut pins = lock(&self.pins);
            // A nested load of the same key on this task keeps the outer pin.
            pins.entry(key.clone()).or_insert_with(|| pin.clone());
            self.pinned.store(pins.len(), Relaxed);
            lock(&self.table).load_token()
        };
        self.stats.loads.fetch_add(1, Relaxed);
        let mut held = HELD_PINS.try_with(Clone::clone).unwrap_or_default();
        held.push(pin_id(&pin));
        let loaded = HELD_PINS.scope(held, loader()).await;
        let value = match loaded {
            Ok(v) => v,
            Err(e) => {
                self.stats.load_failures.fetch_add(1, Relaxed);
                return Err(Arc::new(e));
            }
        };
        {
            let _stripe = self.write_locks[self.stripe(key)].lock().await;
            // Nothing but the loader itself can have written the key
            // meanwhile; if it did, its write stands and the value is
            // returned uncached.
            if lock(&self.table).superseded(key, token) {
                self.stats.loads_superseded.fetch_add(1, Relaxed);
            } else {
                self.cache.insert(key.clone(), value.clone()).await;
            }
            // Unpin before the stripe goes, so the next write sees no pin.
            drop(pinned);
        }
        Ok(value)
    }

    fn snapshot(&self) -> CacheStatus {
        let s = &self.stats;
        // First: see the apply path's Release store.
        let events_applied = s.events_applied.load(Acquire);
        let version = s.version.load(Relaxed);
        let last = s.last_applied_us.load(Relaxed);
        CacheStatus {
            name: self.name.clone(),
            version: (version > 0).then_some(version),
            entries: self.cache.entry_count(),
            tracked_keys: lock(&self.table).len() as u64,
            hits: s.hits.sum(),
            misses: s.misses.sum(),
            loads: s.loads.load(Relaxed),
            load_failures: s.load_failures.load(Relaxed),
            loads_superseded: s.loads_superseded.load(Relaxed),
            events_applied,
            invalidations: s.invalidations.load(Relaxed),
            refreshes: s.refreshes.load(Relaxed),
            stale_ignored: s.stale_ignored.load(Relaxed),
            refresh_fallbacks: s.refresh_fallbacks.load(Relaxed),
            refreshes_quarantined: s.refreshes_quarantined.load(Relaxed),
            clears: s.clears.load(Relaxed),
            loss_resyncs: s.loss_resyncs.load(Relaxed),
            rejected_events: s.rejected_events.load(Relaxed),
            last_applied_at_us: (last > 0).then_some(last),
            last_latency_us: (last > 0).then(|| s.last_latency_us.load(Relaxed)),
        }
    }
}

/// What the consumer needs from a registered cache, without its types.
#[async_trait]
pub(crate) trait CacheHandle: Send + Sync {
    fn name(&self) -> &str;
    /// Claims the cache for the node with token `owner` (never 0), whose
    /// reorder window sets how long each quarantine lasts. False if another
    /// node holds it.
    fn claim(&self, owner: u64, reorder_window: Duration) -> bool;
    /// Gives the cache up, if `owner` holds it, so another node may claim it.
    fn release(&self, owner: u64);
    /// Applies one decoded event. Undecodable keys or values are answered
    /// here (invalidation or a resync), counted, and logged.
    async fn apply(&self, header: &Header, change: Change);
    /// Drops everything, because events may have been lost, and quarantines.
    async fn resync(&self);
    /// Drops everything (on registration; not counted as a loss).
    async fn reset(&self);
    /// For one reorder window from now, applies versioned refreshes as
    /// invalidations: a refresh delivered now may be older than an event for
    /// its key that this cache never saw (lost, or published before the node
    /// subscribed), when two writers publish in another order than they
    /// committed. Only the source of truth can tell, so the entry is dropped
    /// and the next read loads it.
    fn quarantine(&self);
    async fn reject(&self, reason: &str);
    /// Lets moka finish pending bookkeeping, so `entries` is current.
    async fn settle(&self);
    fn status(&self) -> CacheStatus;
}

impl<K: 'static, V: 'static> SyncedCache<K, V> {
    pub(crate) fn handle(&self) -> Arc<dyn CacheHandle>
    where
        Inner<K, V>: CacheHandle,
    {
        self.inner.clone()
    }
}

#[async_trait]
impl<K, V> CacheHandle for Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    V: Clone + Send + Sync + DeserializeOwned + 'static,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn claim(&self, owner: u64, reorder_window: Duration) -> bool {
        if self
            .owner
            .compare_exchange(0, owner, AcqRel, Acquire)
            .is_err()
        {
            return false;
        }
        *lock(&self.quarantine) = reorder_window;
        true
    }

    fn release(&self, owner: u64) {
        // Only the claimant's release counts: a node that shut down, and
        // whose cache another node claimed since, must not free it again.
        let _ = self.owner.compare_exchange(owner, 0, AcqRel, Acquire);
    }

    async fn apply(&self, header: &Header, change: Change) {
        let s = &self.stats;
        // Raised only once the change is in the cache, so a node never reports
        // a version next to an older value.
        let version = change.max_version();
        match change {
            Change::Clear { version } => {
                self.clear(version).await;
                s.clears.fetch_add(1, Relaxed);
            }
            Change::Invalidate { keys } => {
                let mut decoded = Vec::with_capacity(keys.len());
                for kv in keys {
                    match decode_part::<K>(&kv.key, "key") {
                        Ok(k) => decoded.push((k, kv.version)),
                        Err(e) => return self.reject_and_resync(header, &e.to_string()).await,
                    }
                }
                for (k, version) in decoded {
                    self.invalidate(k, version).await;
                    s.invalidations.fetch_add(1, Relaxed);
                }
            }
            Change::Refresh { entries } => {
                let quarantined = self.quarantined();
                let mut decoded = Vec::with_capacity(entries.len());
                for e in &entries {
                    match decode_part::<K>(&e.key, "key") {
                        Ok(k) => decoded.push(k),
                        Err(err) => return self.reject_and_resync(header, &err.to_string()).await,
                    }
                }
                for (k, e) in decoded.into_iter().zip(entries) {
                    match decode_part::<V>(&e.value, "value") {
                        Ok(_) if quarantined && e.version.is_some() => {
                            self.invalidate(k, e.version).await;
                            s.refreshes_quarantined.fetch_add(1, Relaxed)
                        }
                        Ok(v) => match self.refresh(k, v, e.version).await {
                            RefreshDecision::Apply => s.refreshes.fetch_add(1, Relaxed),
                            RefreshDecision::Stale => s.stale_ignored.fetch_add(1, Relaxed),
                            RefreshDecision::Invalidate => s.invalidations.fetch_add(1, Relaxed),
                        },
                        Err(err) => {
                            // Never drop a failed refresh: the old value would stay.
                            tracing::warn!(
                                cache = %self.name, origin = %header.origin, seq = header.seq,
                                reason = %err, "refresh value did not decode; invalidating the key instead"
                            );
                            s.rejected_events.fetch_add(1, Relaxed);
                            s.refresh_fallbacks.fetch_add(1, Relaxed);
                            self.invalidate(k, e.version).await;
                            s.invalidations.fetch_add(1, Relaxed)
                        }
                    };
                }
            }
        }
        if let Some(v) = version {
            s.version.fetch_max(v, Relaxed);
        }
        let now = now_us();
        s.last_applied_us.store(now, Relaxed);
        s.last_latency_us
            .store(now.saturating_sub(header.published_at_us), Relaxed);
        // Last, and with Release (read with Acquire): a poller that sees the
        // new count also sees this event's time and latency.
        s.events_applied.fetch_add(1, Release);
    }

    async fn resync(&self) {
        self.quarantine();
        self.reset().await;
        self.stats.loss_resyncs.fetch_add(1, Relaxed);
    }

    async fn reset(&self) {
        self.clear(None).await;
    }

    fn quarantine(&self) {
        // A window too long for the clock (`Duration::MAX`) lasts for good.
        let until = crate::util::deadline_after(*lock(&self.quarantine));
        let mut q = lock(&self.quarantine_until);
        *q = Some(q.map_or(until, |old| old.max(until)));
    }

    async fn reject(&self, reason: &str) {
        self.stats.rejected_events.fetch_add(1, Relaxed);
        tracing::warn!(cache = %self.name, %reason, "unreadable event for this cache; invalidating it all, since it may have carried a change");
        self.resync().await;
    }

    async fn settle(&self) {
        self.cache.run_pending_tasks().await;
    }

    fn status(&self) -> CacheStatus {
        self.snapshot()
    }
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    V: Clone + Send + Sync + DeserializeOwned + 'static,
{
    async fn reject_and_resync(&self, header: &Header, reason: &str) {
        tracing::warn!(cache = %self.name, origin = %header.origin, seq = header.seq, %reason,
            "event key did not decode; cannot tell which entries it meant");
        self.stats.rejected_events.fetch_add(1, Relaxed);
        self.resync().await;
    }

    fn quarantined(&self) -> bool {
        lock(&self.quarantine_until).is_some_and(|until| tokio::time::Instant::now() < until)
    }
}

#[cfg(test)]
pub(crate) mod tests;
