//! Building a [`SyncedCache`] with non-default settings.

use std::fmt;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use super::audit::{Audit, Auditor};
use super::stats::Stats;
use super::trace::Trace;
use super::versions::VersionTable;
use super::write::{Stripe, WRITE_STRIPES};
use super::{Inner, SyncedCache};
use crate::util::{Hasher, check_at_least, check_duration};

/// Builds a [`SyncedCache`] with non-default settings.
pub struct SyncedCacheBuilder<K, V> {
    pub(super) name: String,
    pub(super) topic: Option<&'static str>,
    pub(super) cache: moka::future::Cache<K, V>,
    pub(super) max_tracked_keys: usize,
    pub(super) max_load_retries: u32,
    pub(super) max_pin_wait: Duration,
    /// Set by `trace_bytes`, where `K: Serialize` says how to count a
    /// key's bytes.
    pub(super) trace: Option<Trace<K>>,
    pub(super) audit: Option<Audit<K, V>>,
    /// The staleness bound on reads, and whether to serve past it.
    pub(super) max_staleness: Option<(Duration, bool)>,
    /// Await a CDC relay's reports from the start.
    pub(super) relayed: bool,
}

impl<K, V> fmt::Debug for SyncedCacheBuilder<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncedCacheBuilder")
            .field("name", &self.name)
            .field("max_tracked_keys", &self.max_tracked_keys)
            .field("max_load_retries", &self.max_load_retries)
            .field("max_pin_wait", &self.max_pin_wait)
            .finish_non_exhaustive()
    }
}

impl<K, V> SyncedCacheBuilder<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// How many per-key version records (tombstones included) are kept.
    /// Default 100 000. Each costs one key clone and 24 bytes, plus 6 to 12
    /// bytes of hash index: for a `u64` key, 38 to 42 bytes over raw moka,
    /// as measured at 100k and 1M keys, churned or not
    /// (`docs/benchmarks.md`). The memory grows with the keys written, up
    /// to this limit, and stays there. Values above 2³² − 2 count as that.
    ///
    /// Once full, the least recently written record is dropped and its
    /// version folded into a floor for untracked keys: a refresh at or below
    /// the floor becomes an invalidation, so eviction never lets an older
    /// value in. At least 1: [`build`](Self::build) refuses 0.
    pub fn max_tracked_keys(mut self, n: usize) -> Self {
        self.max_tracked_keys = n;
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

    /// How long a write to a key waits for a pinned last load of that key
    /// (see [`max_load_retries`](Self::max_load_retries) and the type's
    /// docs) before it is applied anyway. Default 1 s. The node's consumer
    /// never waits itself: it parks such writes and goes on with other keys
    /// and caches, and the parked writes are applied, in order, when the
    /// load installs or at this bound, whichever comes first. Local writes
    /// from other tasks wait up to this long. A load overtaken at the bound
    /// returns the newer cached value, or loads again; it never returns or
    /// caches its own.
    ///
    /// `Duration::ZERO` waits for nothing (a pinned load is then overtaken
    /// by any write to its key); `Duration::MAX` waits as long as the load
    /// runs, so its key's events wait for the database.
    pub fn max_pin_wait(mut self, wait: Duration) -> Self {
        self.max_pin_wait = wait;
        self
    }

    /// Serves from memory only what the node proves fresh within `max`:
    /// while the node's freshness bound (see
    /// [`NodeBuilder::freshness_interval`](crate::NodeBuilder::freshness_interval))
    /// is older than `max`, or unknown (no node holds the cache, or its
    /// transport cannot tell its tail), [`get`](SyncedCache::get) answers
    /// a miss and the `get_with` methods run their loader and return what
    /// it read without caching it: a value installed while the node hears
    /// nothing could be overwritten later by an older event it missed;
    /// [`try_get`](SyncedCache::try_get) returns
    /// [`Error::Stale`](crate::Error::Stale), for a caller that must not
    /// send its reads to the source then. Each is counted in
    /// `stale_bypasses`; each episode is logged once as it
    /// starts and once as it ends. A read thus returns nothing older than
    /// `max` plus one freshness interval. `peek` and `iter` show what the
    /// cache holds, bound or not. Off by default.
    pub fn max_staleness(mut self, max: Duration) -> Self {
        self.max_staleness = Some((max, false));
        self
    }

    /// The cache is fed by a relay that reports its lag: a CDC relay
    /// (`cdc::CdcRelay`, feature `postgres-cdc`) with
    /// `CdcRelayBuilder::freshness_interval`, or an outbox relay
    /// (`outbox::OutboxRelay`, feature `postgres-outbox`) with
    /// `OutboxRelayBuilder::freshness_interval` and `reports_for` naming
    /// this cache. Its freshness (and so its
    /// [staleness bound](Self::max_staleness)) is unknown until the relay's
    /// first report reaches its node, rather than from the first report on.
    ///
    /// A relay reports, every interval, how long ago the database had made
    /// visible everything it has published. A node adds that to its own
    /// proof, so the cache's freshness is its age against the database,
    /// and a relay that stalls, falls behind or is cut off from its
    /// database shows as an age that grows. A node learns of a relay from
    /// its first report; a node started while its relay is down would not
    /// know to wait for one: this says so from the start.
    pub fn relayed(mut self) -> Self {
        self.relayed = true;
        self
    }

    /// [`max_staleness`](Self::max_staleness), but past the bound reads
    /// are served from memory all the same and counted in `stale_served`:
    /// for a cache that must answer whatever happens, and an alert on the
    /// count.
    pub fn max_staleness_serving(mut self, max: Duration) -> Self {
        self.max_staleness = Some((max, true));
        self
    }

    /// Keeps a trace of what happens to keys, up to `max_bytes` for the
    /// whole cache, read with [`SyncedCache::trace`]. Off by default (0);
    /// otherwise at least 1 KiB, or [`build`](Self::build) refuses it.
    ///
    /// A record counts its fixed size (about 100 bytes, with the key's
    /// inline size), the key's encoded length and the publisher's origin;
    /// past the cap the oldest records go. Keys are data: the status
    /// routes never show a trace; [`Node::trace_router`](crate::Node::trace_router)
    /// does, where the application mounts it.
    ///
    /// Each event item, load and local write then costs a clone of its
    /// key, an allocation for an event's origin, and a lock taken once
    /// (docs/benchmarks.md has the apply path's cost with it on and off).
    pub fn trace_bytes(mut self, max_bytes: usize) -> Self
    where
        K: Serialize,
    {
        self.trace = (max_bytes > 0).then(|| Trace::new(max_bytes, encoded_len::<K>));
        self
    }

    /// Audits the cache against the source of truth on the node that holds
    /// it: see [`Audit`]. Off by default. The node runs it only while
    /// ready; the findings are in the cache's status
    /// ([`CacheStatus::audit`](crate::status::CacheStatus::audit)), its
    /// metrics and the cluster view.
    pub fn audit(mut self, audit: Audit<K, V>) -> Self {
        self.audit = Some(audit);
        self
    }

    /// The cache, or [`Error::Config`](crate::Error::Config) for a setting
    /// out of range.
    pub fn build(self) -> crate::Result<SyncedCache<K, V>> {
        check_at_least("max_tracked_keys", self.max_tracked_keys, 1)?;
        if let Some(trace) = &self.trace {
            // Below this a trace would cost every write its key's clone and
            // keep nearly nothing.
            check_at_least("trace_bytes", trace.max_bytes(), MIN_TRACE_BYTES)?;
        }
        if let Some(audit) = &self.audit {
            audit.check()?;
        }
        // Every duration is in range: 0 waits for nothing, and a wait too
        // long for the clock lasts as long as the load (`deadline_after`).
        check_duration(
            "max_pin_wait",
            self.max_pin_wait,
            Duration::ZERO,
            Duration::MAX,
        )?;
        Ok(self.build_checked())
    }

    pub(super) fn build_checked(self) -> SyncedCache<K, V> {
        let hasher = Hasher::default();
        SyncedCache {
            inner: Arc::new_cyclic(|me| Inner {
                me: me.clone(),
                name: self.name,
                topic: self.topic,
                cache: self.cache,
                table: Mutex::new(VersionTable::new(self.max_tracked_keys, hasher.clone())),
                write_locks: (0..WRITE_STRIPES).map(|_| Stripe::default()).collect(),
                hasher,
                pins: Mutex::default(),
                pinned: AtomicUsize::new(0),
                parked_items: AtomicUsize::new(0),
                max_pin_wait: self.max_pin_wait,
                flights: Mutex::default(),
                max_load_retries: self.max_load_retries,
                owner: AtomicU64::new(0),
                quarantine_until: Mutex::new(None),
                quarantine: Mutex::new(Duration::ZERO),
                housekeeper: Mutex::new(None),
                emptied_at: Mutex::new(tokio::time::Instant::now()),
                registered_at: Mutex::new(tokio::time::Instant::now()),
                stats: Stats::default(),
                trace: self.trace,
                audit: self.audit.map(Auditor::new),
                bound: self
                    .max_staleness
                    .map(|(max, serve)| super::bound::Bound::new(max, serve)),
                sources: super::bound::Sources::new(self.relayed),
            }),
        }
    }
}

/// `key`'s length in the wire encoding; 0 for a key that does not encode
/// (a `Serialize` impl that fails), which the wire would refuse anyway.
fn encoded_len<K: Serialize>(key: &K) -> usize {
    let mut size = bincode::enc::write::SizeWriter::default();
    match bincode::serde::encode_into_writer(key, &mut size, bincode::config::standard()) {
        Ok(()) => size.bytes_written,
        Err(_) => 0,
    }
}

/// The smallest trace cap `build` takes.
const MIN_TRACE_BYTES: usize = 1024;
