//! The read-through methods: `get_with` and its fallible, versioned and
//! fresh forms, and the path they share: a hit, or a coalesced load.

use std::future::Future;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tokio::sync::watch;

use super::SyncedCache;
use super::load::{Flight, FlightGuard, SharedError};
use crate::util::lock;

impl<K, V> SyncedCache<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
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
    /// [`loads_stale`](crate::status::CacheStatus::loads_stale). So is one
    /// below the floor that evicted version records leave (see
    /// [`max_tracked_keys`](crate::SyncedCacheBuilder::max_tracked_keys)),
    /// since it may be older than what was forgotten. Such a call returns the cached
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
    /// [`fresh_reads`](crate::status::CacheStatus::fresh_reads), and in
    /// `loads`.
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
    ///   ([`loads_stale`](crate::status::CacheStatus::loads_stale)): the
    ///   cached value is returned if the node holds it at the row's version
    ///   or newer; otherwise the row read is, and a cached value the node
    ///   cannot vouch for is dropped (an invalidation is always safe).
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
        if self.inner.past_bound() {
            // The source, not memory, and nothing cached: a value installed
            // while the node cannot prove it hears every event could be
            // overwritten later by an older one it missed.
            self.inner.stats.loads.fetch_add(1, Relaxed);
            return match loader().await {
                Ok((v, _)) => Ok(v),
                Err(e) => {
                    self.inner.stats.load_failures.fetch_add(1, Relaxed);
                    Err(Arc::new(e))
                }
            };
        }
        if let Some(v) = self.lookup(&key).await {
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
