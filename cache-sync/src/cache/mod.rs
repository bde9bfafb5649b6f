//! The cache: a moka cache that events keep in step.

use std::borrow::Borrow;
use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;

use crate::status::{CacheStatus, TraceEvent, TraceRecord};
use crate::table::Table;
use crate::util::{HashMap, Hasher, lock};

mod apply;
mod audit;
mod builder;
mod coalesce;
mod housekeeping;
mod load;
mod park;
mod pin;
mod stats;
mod trace;
mod versions;
mod write;

pub(crate) use apply::{CacheHandle, Event};
pub use audit::Audit;
use audit::Auditor;
pub(crate) use audit::{AUDIT_MARGIN, RoundTrip, first_wait};
pub use builder::SyncedCacheBuilder;
pub(crate) use housekeeping::Housekeeper;
use load::{Flight, FlightGuard, SharedError};
use park::Pins;
use stats::Stats;
use trace::Trace;
use write::{Stripe, Write};

use versions::VersionTable;

/// Default bound on per-key version records; see [`SyncedCacheBuilder::max_tracked_keys`].
pub(crate) const DEFAULT_MAX_TRACKED_KEYS: usize = 100_000;

/// Default bound on a write's wait for a pinned load; see
/// [`SyncedCacheBuilder::max_pin_wait`].
pub(crate) const DEFAULT_MAX_PIN_WAIT: Duration = Duration::from_secs(1);

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
/// pinned: other tasks' writes to the key wait for that load, for at most
/// [`max_pin_wait`](SyncedCacheBuilder::max_pin_wait). A write that waited
/// that long goes ahead, and so does a clear, which never waits; the pinned
/// load they overtook then returns the value now cached, or, with none,
/// loads again. Either way `get_with` never returns a value older than a
/// change applied while it ran, and never caches one.
///
/// A load that returns its row's version
/// ([`get_with_versioned`](Self::get_with_versioned)) is held to versions
/// too: it is cached at that version, so an older refresh that arrives
/// later cannot replace it, and it is not cached if the node already knows
/// a newer version of the key.
///
/// While the key is pinned, the node's consumer does not wait: it parks
/// its writes to that key and goes on with every other key and cache; the
/// parked writes are applied, in the order they arrived and before any
/// later event for the key, once the load has installed its value (or at
/// `max_pin_wait`). Local writes to the key from other tasks (`insert`,
/// `invalidate`, a load's install) wait, up to `max_pin_wait`; so a loader
/// that waits for another task's write to its own key waits that long.
/// Writes to other keys never wait for it, and writes the loader makes
/// itself, on its own task (a nested `get_with`, an `insert`, an
/// `invalidate_all`), go ahead.
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

pub(crate) struct Inner<K, V> {
    /// Itself, for the drainers of parked writes (`park.rs`), which outlive
    /// the consumer's call.
    me: Weak<Inner<K, V>>,
    name: String,
    /// The topic its [`Table`] is pinned to, if any.
    topic: Option<&'static str>,
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
    write_locks: Box<[Stripe]>,
    /// The version table's hasher, which also picks the stripe.
    hasher: Hasher,
    /// Keys under a locked last load (see `load_locked`): writes to them
    /// from other tasks wait until the load has installed its value, or
    /// `max_pin_wait`; the consumer parks its writes to them instead (see
    /// `park.rs`), in the queues kept here too. Pins and queues are added
    /// under the key's stripe, so a write that holds the stripe sees every
    /// pin and queue of its key; queues are removed under it, pins under
    /// it after an install, and without it when the load fails or is
    /// cancelled (a write that then finds the pin gone just goes ahead).
    pins: Mutex<Pins<K, V>>,
    /// `pins.count()`, pins and queues, stored under the `pins` lock and
    /// read under a stripe, so a write skips the map's lock while nothing
    /// is pinned or parked (nearly always): a write that holds its key's
    /// stripe sees at least the count stored when its key's pin or queue
    /// was added.
    pinned: AtomicUsize,
    /// Event writes parked and not yet applied (or dropped by a clear).
    parked_items: AtomicUsize,
    max_pin_wait: Duration,
    flights: Mutex<HashMap<K, Arc<Flight<V>>>>,
    max_load_retries: u32,
    /// The node that holds the cache, by its token; 0 when none does.
    owner: AtomicU64,
    /// Until then, versioned refreshes are applied as invalidations; see
    /// `CacheHandle::resync`.
    quarantine_until: Mutex<Option<tokio::time::Instant>>,
    /// How long each resync quarantines, set by the node at registration.
    quarantine: Mutex<Duration>,
    /// The housekeeping of the node the cache is registered on
    /// (`None` until then): a clear hands moka's eviction to it.
    housekeeper: Mutex<Option<Arc<Housekeeper>>>,
    /// When the cache was last emptied (built, registered, resynced or
    /// cleared), read before the clear's stamp: every change sent by then
    /// is reflected in it, so a node judging whether an event it never
    /// received was its to miss looks no further back (see `node/seqs.rs`,
    /// `Prior`).
    emptied_at: Mutex<tokio::time::Instant>,
    /// When the cache was last built or reset for a registration: before
    /// then the node did not keep its events, and for a while after it (a
    /// re-subscription with its tag) may not have received them yet.
    registered_at: Mutex<tokio::time::Instant>,
    stats: Stats,
    /// What happened to keys, if the builder turned it on (`trace.rs`).
    trace: Option<Trace<K>>,
    /// The consistency auditor, if the builder set one (`audit.rs`).
    audit: Option<Auditor<K, V>>,
}

impl<K, V> SyncedCache<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Wraps `cache` as the table `table`: a [`Table`] shared with the
    /// publishers, or a plain name (`"countries"`), which publishers must
    /// then spell the same way.
    pub fn new(table: impl Into<Table<K, V>>, cache: moka::future::Cache<K, V>) -> Self {
        // The defaults are in range.
        Self::builder(table, cache).build_checked()
    }

    /// Wraps `cache` with non-default settings.
    pub fn builder(
        table: impl Into<Table<K, V>>,
        cache: moka::future::Cache<K, V>,
    ) -> SyncedCacheBuilder<K, V> {
        let (name, topic) = table.into().into_parts();
        SyncedCacheBuilder {
            name,
            topic,
            cache,
            max_tracked_keys: DEFAULT_MAX_TRACKED_KEYS,
            max_load_retries: 3,
            max_pin_wait: DEFAULT_MAX_PIN_WAIT,
            trace: None,
            audit: None,
        }
    }

    /// The name events address it by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The cached value, if any. Counts a hit or a miss. Takes any borrowed
    /// form of the key, as moka does (`&str` for a `String` key).
    pub async fn get<Q>(&self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
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
    pub async fn peek<Q>(&self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.cache.get(key).await
    }

    /// Whether the cache holds `key`, without counting a hit or miss.
    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.cache.contains_key(key)
    }

    /// The entries, as moka's `iter` gives them: a snapshot-free walk that
    /// may or may not see writes made while it runs. Counts no hits.
    pub fn iter(&self) -> impl Iterator<Item = (Arc<K>, V)> + '_ {
        self.inner.cache.iter()
    }

    /// Inserts locally. Not published; other nodes are unaffected.
    /// A load of `key` already in flight will not overwrite it.
    pub async fn insert(&self, key: K, value: V) {
        let traced = self.inner.trace.as_ref().map(|_| key.clone());
        self.inner
            .write(key, |table, k| {
                table.touch(k);
                Write::Put(value)
            })
            .await;
        self.inner.traced(traced, TraceEvent::Inserted, None);
    }

    /// Removes locally. Not published. A load of `key` already in flight will
    /// not install its result.
    pub async fn invalidate<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        let key = key.to_owned();
        let traced = self.inner.trace.as_ref().map(|_| key.clone());
        self.inner.invalidate(key, None).await;
        self.inner.traced(traced, TraceEvent::Removed, None);
    }

    /// Removes everything locally. Not published. No load already in flight
    /// will install its result. On a cache registered on a node, returns
    /// once moka has evicted the entries, on a thread of the runtime's
    /// blocking pool (for 1M entries, seconds: the task waits, its runtime
    /// worker does not).
    pub async fn invalidate_all(&self) {
        self.inner.clear(None).await;
        if let Some(trace) = &self.inner.trace {
            trace.record(None, TraceEvent::Cleared, None, None, crate::util::now_us());
        }
    }

    /// What happened to `key` lately on this node, oldest first: events
    /// applied or ignored (with their version, origin, publisher and
    /// sequence numbers), loads cached or refused, local writes, and the
    /// clears and resyncs of the whole cache. Empty unless the cache was
    /// built with [`trace_bytes`](SyncedCacheBuilder::trace_bytes); the
    /// oldest records go first once the cache's trace passes that many
    /// bytes, so a key's history reaches back only as far as every key's
    /// records since leave room for.
    pub fn trace<Q>(&self, key: &Q) -> Vec<TraceRecord>
    where
        K: Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        self.inner
            .trace
            .as_ref()
            .map_or_else(Vec::new, |trace| trace.of(key))
    }

    /// Approximate number of entries, as moka reports it.
    pub fn entry_count(&self) -> u64 {
        self.inner.cache.entry_count()
    }

    /// The highest version of a change applied to this cache on this node,
    /// raised only once the change is in the cache (the status's
    /// `version`, without the rest of the snapshot); `None` before the first
    /// versioned change.
    ///
    /// A loader for [`get_with_versioned`](Self::get_with_versioned) on a
    /// cache a [`CdcRelay`](crate::cdc::CdcRelay) feeds returns it, read
    /// *before* it reads the row: see the relay's section on loads.
    pub fn version(&self) -> Option<u64> {
        let v = self.inner.stats.version.load(Relaxed);
        (v > 0).then_some(v)
    }

    /// A snapshot of the counters shown by the status endpoint.
    pub fn status(&self) -> CacheStatus {
        self.inner.snapshot()
    }

    /// Returns the cached value, or runs `loader` and caches its result.
    ///
    /// Unlike moka's `get_with`, which takes a future, this takes a closure
    /// that makes one: a load overtaken by a write is thrown away and run
    /// again, so it must be possible to start it more than once.
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
        self.load_through(key, || {
            let f = loader();
            async move { f.await.map(|v| (v, None)) }
        })
        .await
    }

    /// Like [`get_with`](Self::get_with), for a loader that also returns the
    /// version of the row it read, in the versions the table's events carry
    /// (a row version column, say). The value is cached with that version,
    /// as a refresh at it would be: afterwards a refresh at that version or
    /// older is ignored (counted in `stale_ignored`) and a newer one
    /// replaces the value, so an older event delayed in transit past the
    /// load cannot overwrite the row the loader read. Returns the value; a
    /// cache hit knows no version, so none is returned.
    ///
    /// If the node already knows a newer version of the key than the loader
    /// returned (a tombstone, a newer refresh or load, a versioned clear;
    /// the loader read a lagging replica, say), the loaded value is not
    /// cached, and is counted in
    /// [`loads_stale`](CacheStatus::loads_stale). So is one below the floor
    /// that evicted version records leave (see
    /// [`max_tracked_keys`](SyncedCacheBuilder::max_tracked_keys)), since it
    /// may be older than what was forgotten. Such a call returns the cached
    /// value if the cache holds one (a refresh at the newer version may have
    /// installed it while the loader ran), and otherwise the loaded value,
    /// the best the source gave. A version equal to the known
    /// one is cached: the source holds that row at that version. Give a
    /// delete a version of its own, newer than the row it removed (as the
    /// dictionary helper's automatic versions are), or a replica still
    /// holding the deleted row at that version could bring it back.
    ///
    /// Never return a version newer than the row read: a value at
    /// `u64::MAX` is replaced by no refresh, only removed by invalidations
    /// and clears. For a missing row (a cache of `Option<V>`), return the
    /// version of its deletion if the source keeps one, or else 0: the
    /// absence is then cached only while no version above 0 applies to the
    /// key (its record, the evicted floor, a versioned clear), and any
    /// refresh above 0 replaces it.
    ///
    /// Everything else is as in `get_with`: concurrent calls for one key
    /// share a single load (whichever of these methods started it; a caller
    /// that joins an unversioned load gets its value); a load whose key is
    /// written, or whose cache is cleared, while it runs is retried, and
    /// the last attempt pinned. Loads are not quarantined after a loss, as
    /// versioned refreshes are: see [`NodeBuilder::reorder_window`](crate::NodeBuilder::reorder_window).
    pub async fn get_with_versioned<F, Fut>(&self, key: K, mut loader: F) -> V
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = (V, u64)>,
    {
        match self
            .try_get_with_versioned(key, || {
                let f = loader();
                async move { Ok::<_, std::convert::Infallible>(f.await) }
            })
            .await
        {
            Ok(v) => v,
            Err(never) => match *never {},
        }
    }

    /// [`get_with_versioned`](Self::get_with_versioned) for a fallible
    /// loader, as [`try_get_with`](Self::try_get_with) is to `get_with`.
    pub async fn try_get_with_versioned<F, Fut, E>(
        &self,
        key: K,
        mut loader: F,
    ) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(V, u64), E>>,
        E: Send + Sync + 'static,
    {
        self.load_through(key, || {
            let f = loader();
            async move { f.await.map(|(v, version)| (v, Some(version))) }
        })
        .await
    }

    /// Reads `key` from the source of truth whatever the cache holds, for a
    /// path that must not act on a cached value (a price before payment, a
    /// permission before a grant). `loader` reads the row and its version,
    /// as for [`get_with_versioned`](Self::get_with_versioned), and runs on
    /// every call: neither a cached value nor a load already in flight for
    /// the key (which may have read the source before this call began)
    /// stands in for it. Counted in
    /// [`fresh_reads`](CacheStatus::fresh_reads), and in `loads`.
    ///
    /// The row is installed as a versioned load is: cached with its version
    /// unless the node knows a newer one for the key, so a delayed older
    /// event cannot replace it afterwards, and a load of the key still in
    /// flight no longer installs. Returns the row the loader read, or a
    /// newer value the node applied while it ran:
    /// - if a write to the key landed during the load, the cached value is
    ///   returned only if the node holds it at the loaded version or newer;
    ///   otherwise the loader runs again, the last attempts pinned as in
    ///   `get_with`, so a key written without pause by older events keeps
    ///   it loading;
    /// - if the row's version is below one the node knows for the key (the
    ///   source lags: a replica, say) or below the floor evicted version
    ///   records leave, the row is not cached
    ///   ([`loads_stale`](CacheStatus::loads_stale)): the cached value is
    ///   returned if the node holds it at the row's version or newer;
    ///   otherwise the row read is, and a cached value the node cannot
    ///   vouch for is dropped (an invalidation is always safe).
    pub async fn get_fresh<F, Fut>(&self, key: K, mut loader: F) -> V
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = (V, u64)>,
    {
        match self
            .try_get_fresh(key, || {
                let f = loader();
                async move { Ok::<_, std::convert::Infallible>(f.await) }
            })
            .await
        {
            Ok(v) => v,
            Err(never) => match *never {},
        }
    }

    /// [`get_fresh`](Self::get_fresh) for a fallible loader: an error is
    /// returned, counted in `load_failures`, and leaves the cache as it was.
    pub async fn try_get_fresh<F, Fut, E>(&self, key: K, mut loader: F) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(V, u64), E>>,
        E: Send + Sync + 'static,
    {
        self.inner.stats.fresh_reads.fetch_add(1, Relaxed);
        let mut loader = || {
            let f = loader();
            async move { f.await.map(|(v, version)| (v, Some(version))) }
        };
        self.inner.load(&key, &mut loader, true).await
    }

    /// The read-through path of every `get_with` method: a hit, or a
    /// coalesced load whose loader gives the value and its version, if any.
    async fn load_through<F, Fut, E>(&self, key: K, mut loader: F) -> Result<V, Arc<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(V, Option<u64>), E>>,
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
                    let result = self.inner.load(&key, &mut loader, false).await;
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

impl<K: 'static, V: 'static> SyncedCache<K, V> {
    pub(crate) fn handle(&self) -> Arc<dyn CacheHandle>
    where
        Inner<K, V>: CacheHandle,
    {
        self.inner.clone()
    }

    /// The token of the node that holds the cache, 0 for none (tests of
    /// when a node lets go).
    #[cfg(test)]
    pub(crate) fn owner(&self) -> u64 {
        self.inner.owner.load(std::sync::atomic::Ordering::Acquire)
    }
}

#[cfg(test)]
pub(crate) mod tests;
