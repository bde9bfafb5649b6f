//! What a cache reports of itself: a key's trace, its entry count, the
//! version it has applied, and its status.

use std::borrow::Borrow;
use std::hash::Hash;
use std::sync::atomic::Ordering::Relaxed;

use super::SyncedCache;
use crate::status::{CacheStatus, TraceRecord};

impl<K, V> SyncedCache<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// What happened to `key` lately on this node, oldest first: events
    /// applied or ignored (with their version, origin, publisher and
    /// sequence numbers), loads cached or refused, local writes, and the
    /// clears and resyncs of the whole cache. Empty unless the cache was
    /// built with [`trace_bytes`](crate::SyncedCacheBuilder::trace_bytes);
    /// the oldest records go first once the cache's trace passes that many
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
}
