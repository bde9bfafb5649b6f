//! The cache: a moka cache that events keep in step.

use std::borrow::Borrow;
use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::status::TraceEvent;
use crate::table::Table;
use crate::util::{HashMap, Hasher};

mod apply;
mod audit;
mod bound;
mod builder;
mod coalesce;
mod housekeeping;
mod load;
mod park;
mod pin;
mod read_through;
mod report;
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
use load::Flight;
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
    /// The staleness bound on reads, if the builder set one (`bound.rs`).
    bound: Option<bound::Bound>,
    /// What CDC relays report of the cache (`bound.rs`).
    sources: bound::Sources,
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
    /// The consistency auditor, if the builder set one (`audit/`).
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
            max_staleness: None,
            relayed: false,
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
        if self.inner.past_bound() {
            // Nothing the cache holds is proved fresh enough: a miss, and
            // the caller reads the source.
            self.inner.stats.misses.add_one();
            return None;
        }
        self.lookup(key).await
    }

    /// [`get`](Self::get), but past a [staleness
    /// bound](crate::SyncedCacheBuilder::max_staleness) an error rather than a
    /// miss: `Ok(None)` is then always a key the cache does not hold,
    /// never a read it refused. For a caller that must not send its reads
    /// to the source when the node cannot prove its cache fresh (the
    /// source is the thing under strain), and says so to its own caller.
    ///
    /// Past a bound, [`Error::Stale`](crate::Error::Stale), counted in
    /// `stale_bypasses`; past a
    /// [serving](crate::SyncedCacheBuilder::max_staleness_serving) one, the value
    /// (counted in `stale_served`), as `get` answers. Without a bound,
    /// never an error.
    pub async fn try_get<Q>(&self, key: &Q) -> Result<Option<V>, crate::Error>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.inner.past_bound() {
            return Err(self.inner.stale_error());
        }
        Ok(self.lookup(key).await)
    }

    /// [`get`](Self::get) short of the staleness bound.
    async fn lookup<Q>(&self, key: &Q) -> Option<V>
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
