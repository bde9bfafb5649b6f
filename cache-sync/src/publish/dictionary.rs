//! The dictionary-table helper: typed rows, automatic row versions.

use std::borrow::Borrow;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::Publisher;
use crate::error::{Error, Result};
use crate::table::{Table, check_topic};
use crate::util::now_us;
use crate::wire::Outgoing;

/// Hands out row versions: microseconds since the Unix epoch, bumped so each
/// is strictly greater than the last this clock gave or saw. Across restarts
/// of the admin service versions keep increasing as long as the clock does
/// not step back by more than the time between two writes.
#[derive(Debug, Default)]
struct VersionClock {
    last: AtomicU64,
}

impl VersionClock {
    /// The next version, or [`Error::VersionExhausted`] once a version of
    /// `u64::MAX` was given or seen: nothing is newer, and wrapping would
    /// make every node ignore the change as older than what it holds.
    fn next(&self) -> Result<u64> {
        let now = now_us();
        let next = |last: u64| last.checked_add(1).map(|n| n.max(now));
        match self
            .last
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, next)
        {
            Ok(prev) => next(prev).ok_or(Error::VersionExhausted(prev)),
            Err(last) => Err(Error::VersionExhausted(last)),
        }
    }

    fn observe(&self, version: u64) {
        self.last.fetch_max(version, Ordering::AcqRel);
    }
}

/// Publishes changes to one dictionary table (country codes, categories,
/// feature flags …) whose rows are cached under one name on every node.
///
/// Every change carries a row version. By default the helper assigns
/// monotonically increasing versions (see below); pass your own, such as the
/// row's version column, with the `_with_version` methods when several
/// services write the same table, so that the database orders them.
///
/// Automatic versions are microseconds since the Unix epoch, forced to be
/// strictly increasing within this helper and above any version passed in.
pub struct DictionaryPublisher<K, V> {
    publisher: Publisher,
    cache: String,
    /// The topic the table is pinned to, if any.
    topic: Option<&'static str>,
    clock: Arc<VersionClock>,
    _types: PhantomData<fn(&K, &V)>,
}

impl<K, V> Clone for DictionaryPublisher<K, V> {
    fn clone(&self) -> Self {
        Self {
            publisher: self.publisher.clone(),
            cache: self.cache.clone(),
            topic: self.topic,
            clock: self.clock.clone(),
            _types: PhantomData,
        }
    }
}

impl<K, V> fmt::Debug for DictionaryPublisher<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DictionaryPublisher")
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl<K: Serialize, V: Serialize> DictionaryPublisher<K, V> {
    pub(super) fn new(publisher: Publisher, table: Table<K, V>) -> Self {
        let (cache, topic) = table.into_parts();
        Self {
            publisher,
            cache,
            topic,
            clock: Arc::new(VersionClock::default()),
            _types: PhantomData,
        }
    }

    /// The cache name it publishes to.
    pub fn cache(&self) -> &str {
        &self.cache
    }

    /// A row was inserted or updated: every node installs `row` (unless it
    /// already reflects a newer version). Returns the version used.
    ///
    /// Key and row are borrowed in any form their types borrow as (`"de"`
    /// for a `String` key), as moka's `get` and `invalidate` take keys; the
    /// borrowed form must encode as the owned one does, as `str` and
    /// `String`, `[T]` and `Vec<T>`, or `T` and `Box<T>` do.
    pub async fn insert<Q, R>(&self, key: &Q, row: &R) -> Result<u64>
    where
        K: Borrow<Q>,
        V: Borrow<R>,
        Q: Serialize + ?Sized,
        R: Serialize + ?Sized,
    {
        self.publish(None, |p, v| {
            Outgoing::refreshes([(key, row, Some(v))], p.budget())
        })
        .await
    }

    /// [`insert`](Self::insert) at the caller's version.
    pub async fn insert_versioned<Q, R>(&self, key: &Q, row: &R, version: u64) -> Result<u64>
    where
        K: Borrow<Q>,
        V: Borrow<R>,
        Q: Serialize + ?Sized,
        R: Serialize + ?Sized,
    {
        self.publish(Some(version), |p, v| {
            Outgoing::refreshes([(key, row, Some(v))], p.budget())
        })
        .await
    }

    /// Several rows at one version, split into events as the size limit needs.
    pub async fn insert_many<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(None, |p, v| {
            Outgoing::refreshes(rows.into_iter().map(|(k, r)| (k, r, Some(v))), p.budget())
        })
        .await
    }

    /// A row was deleted: every node drops it and keeps a tombstone, so an
    /// older insert that arrives late cannot bring it back.
    pub async fn invalidate<Q>(&self, key: &Q) -> Result<u64>
    where
        K: Borrow<Q>,
        Q: Serialize + ?Sized,
    {
        self.publish(None, |p, v| {
            Outgoing::invalidations([(key, Some(v))], p.budget())
        })
        .await
    }

    /// [`invalidate`](Self::invalidate) at the caller's version.
    pub async fn invalidate_versioned<Q>(&self, key: &Q, version: u64) -> Result<u64>
    where
        K: Borrow<Q>,
        Q: Serialize + ?Sized,
    {
        self.publish(Some(version), |p, v| {
            Outgoing::invalidations([(key, Some(v))], p.budget())
        })
        .await
    }

    /// Every row goes: every node drops the whole cache, and the version
    /// becomes a floor, so no older insert that arrives late comes back.
    pub async fn invalidate_all(&self) -> Result<u64> {
        self.publish(None, |_, v| Ok(Outgoing::clear(Some(v))))
            .await
    }

    /// [`invalidate_all`](Self::invalidate_all) at the caller's version.
    pub async fn invalidate_all_versioned(&self, version: u64) -> Result<u64> {
        self.publish(Some(version), |_, v| Ok(Outgoing::clear(Some(v))))
            .await
    }

    /// The table was replaced wholesale: every node drops all rows, then
    /// installs these. A clear at the same version goes first, so rows the
    /// new table lacks disappear and no older insert can return afterwards.
    pub async fn replace_all<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(None, |p, v| Outgoing::replacement(rows, v, p.budget()))
            .await
    }

    /// [`replace_all`](Self::replace_all) at the caller's version.
    pub async fn replace_all_versioned<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
        version: u64,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(Some(version), |p, v| {
            Outgoing::replacement(rows, v, p.budget())
        })
        .await
    }

    /// Publishes under the table's publish lock. An automatic version is taken
    /// inside the lock, so this helper's versions reach the transport in
    /// increasing order even when it is called from many tasks at once.
    async fn publish(
        &self,
        version: Option<u64>,
        build: impl FnOnce(&Publisher, u64) -> Result<Outgoing>,
    ) -> Result<u64> {
        check_topic(&self.cache, self.topic, &self.publisher.inner.topic)?;
        let (_, v) = self
            .publisher
            .send_with(&self.cache, None, || {
                let v = match version {
                    Some(v) => {
                        self.clock.observe(v);
                        v
                    }
                    None => self.clock.next()?,
                };
                Ok((build(&self.publisher, v)?, v))
            })
            .await?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::publish::tests::drain;
    use crate::transport::EmbeddedTransport;
    use crate::wire::Change;

    #[tokio::test]
    async fn dictionary_versions_increase_and_respect_caller_versions() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("countries");
        let a = dict.insert("de", "Germany").await.unwrap();
        let b = dict.invalidate("de").await.unwrap();
        assert!(b > a);
        let c = dict
            .insert_versioned("fr", "France", u64::MAX / 2)
            .await
            .unwrap();
        let d = dict.insert("it", "Italy").await.unwrap();
        assert!(d > c, "auto versions must pass caller versions");
        let v = dict
            .replace_all([(&"se".to_string(), &"Sweden".to_string())])
            .await
            .unwrap();
        let events = drain(&transport).await;
        let kinds: Vec<_> = events.iter().map(|(_, c)| c.max_version()).collect();
        assert_eq!(
            kinds,
            [Some(a), Some(b), Some(c), Some(d), Some(v), Some(v)]
        );
        assert!(matches!(events[4].1, Change::Clear { .. }));
    }

    /// `invalidate_all` is a clear whose version is a floor, automatic or
    /// the caller's, and a node holds none of the rows below it afterwards,
    /// even one that arrives late.
    #[tokio::test]
    async fn invalidate_all_is_a_versioned_floor() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("t");
        let a = dict.insert("a", "x").await.unwrap();
        let b = dict.invalidate_all().await.unwrap();
        assert!(b > a);
        let c = dict.invalidate_all_versioned(b + 10).await.unwrap();
        assert_eq!(c, b + 10);
        let events = drain(&transport).await;
        assert!(matches!(events[1].1, Change::Clear { version: Some(v) } if v == b));
        assert!(matches!(events[2].1, Change::Clear { version: Some(v) } if v == c));

        // A node of a transport of its own, which keeps no earlier floor.
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("t");
        let cache = crate::SyncedCache::new("t", moka::future::Cache::<String, String>::new(8));
        let node = crate::Node::builder("n", transport.clone())
            .register(&cache)
            .start()
            .await
            .unwrap();
        dict.invalidate_all_versioned(100).await.unwrap();
        dict.insert_versioned("late", "older", 99).await.unwrap();
        dict.insert_versioned("new", "newer", 101).await.unwrap();
        crate::node::tests::eventually("the newer row arrives", async || {
            cache.get("new").await.is_some()
        })
        .await;
        // Applied in order: "late" came before "new".
        assert_eq!(cache.get("late").await, None, "below the floor");
        assert_eq!(cache.get("new").await.as_deref(), Some("newer"));
        node.shutdown().await.unwrap();
    }

    /// Regression: after a caller passed `u64::MAX`, the next automatic
    /// version wrapped (`last + 1`) and silently went backwards, so every
    /// node ignored the change as stale.
    #[tokio::test]
    async fn automatic_versions_past_the_largest_one_fail_instead_of_wrapping() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("t");
        dict.insert_versioned("a", "x", u64::MAX).await.unwrap();
        for attempt in 0..2 {
            let err = dict.insert("b", "y").await.unwrap_err();
            assert!(
                matches!(err, Error::VersionExhausted(u64::MAX)),
                "attempt {attempt}: {err}"
            );
            assert!(dict.invalidate("b").await.is_err());
        }
        // Nothing was sent for the refused calls, and no sequence number
        // was used up: nodes see no gap.
        let events = drain(&transport).await;
        assert_eq!(events.len(), 1);
        dict.insert_versioned("c", "z", 5).await.unwrap();
        let seqs: Vec<_> = drain(&transport).await.iter().map(|(h, _)| h.seq).collect();
        assert_eq!(seqs, [1, 2]);
    }

    #[test]
    fn clock_is_strictly_increasing_even_when_called_in_the_same_microsecond() {
        let clock = VersionClock::default();
        let mut last = 0;
        for _ in 0..10_000 {
            let v = clock.next().unwrap();
            assert!(v > last);
            last = v;
        }
    }
}
