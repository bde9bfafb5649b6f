//! The dictionary-table helper: typed rows, automatic row versions.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::Publisher;
use crate::error::{Error, Result};
use crate::table::{Table, check_topic};
use crate::util::now_us;
use crate::wire::Change;

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
    pub async fn upsert(&self, key: &K, row: &V) -> Result<u64> {
        self.upsert_many([(key, row)]).await
    }

    /// [`upsert`](Self::upsert) with the caller's version.
    pub async fn upsert_with_version(&self, key: &K, row: &V, version: u64) -> Result<u64> {
        self.publish(Some(version), |p, v| {
            super::refreshes([(key, row, Some(v))], p.budget())
        })
        .await
    }

    /// Several rows at one version, split into events as the size limit needs.
    pub async fn upsert_many<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(None, |p, v| {
            super::refreshes(rows.into_iter().map(|(k, r)| (k, r, Some(v))), p.budget())
        })
        .await
    }

    /// A row was deleted: every node drops it and keeps a tombstone, so an
    /// older upsert that arrives late cannot bring it back.
    pub async fn delete(&self, key: &K) -> Result<u64> {
        self.publish(None, |p, v| {
            super::invalidations([(key, Some(v))], p.budget())
        })
        .await
    }

    /// [`delete`](Self::delete) with the caller's version.
    pub async fn delete_with_version(&self, key: &K, version: u64) -> Result<u64> {
        self.publish(Some(version), |p, v| {
            super::invalidations([(key, Some(v))], p.budget())
        })
        .await
    }

    /// The table was replaced wholesale: every node drops all rows, then
    /// installs these. A clear at the same version goes first, so rows the
    /// new table lacks disappear and no older refresh can return afterwards.
    pub async fn replace_all<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(None, |p, v| super::replacement(rows, v, p.budget()))
            .await
    }

    /// [`replace_all`](Self::replace_all) with the caller's version.
    pub async fn replace_all_with_version<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
        version: u64,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(Some(version), |p, v| {
            super::replacement(rows, v, p.budget())
        })
        .await
    }

    /// Publishes under the table's publish lock. An automatic version is taken
    /// inside the lock, so this helper's versions reach the transport in
    /// increasing order even when it is called from many tasks at once.
    async fn publish(
        &self,
        version: Option<u64>,
        build: impl FnOnce(&Publisher, u64) -> Result<Vec<Change>>,
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
    use crate::EmbeddedTransport;
    use crate::publish::tests::drain;

    #[tokio::test]
    async fn dictionary_versions_increase_and_respect_caller_versions() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("countries");
        let a = dict.upsert(&"de".into(), &"Germany".into()).await.unwrap();
        let b = dict.delete(&"de".into()).await.unwrap();
        assert!(b > a);
        let c = dict
            .upsert_with_version(&"fr".into(), &"France".into(), u64::MAX / 2)
            .await
            .unwrap();
        let d = dict.upsert(&"it".into(), &"Italy".into()).await.unwrap();
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

    /// Regression: after a caller passed `u64::MAX`, the next automatic
    /// version wrapped (`last + 1`) and silently went backwards, so every
    /// node ignored the change as stale.
    #[tokio::test]
    async fn automatic_versions_past_the_largest_one_fail_instead_of_wrapping() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("t");
        dict.upsert_with_version(&"a".into(), &"x".into(), u64::MAX)
            .await
            .unwrap();
        for attempt in 0..2 {
            let err = dict.upsert(&"b".into(), &"y".into()).await.unwrap_err();
            assert!(
                matches!(err, Error::VersionExhausted(u64::MAX)),
                "attempt {attempt}: {err}"
            );
            assert!(dict.delete(&"b".into()).await.is_err());
        }
        // Nothing was sent for the refused calls, and no sequence number
        // was used up: nodes see no gap.
        let events = drain(&transport).await;
        assert_eq!(events.len(), 1);
        dict.upsert_with_version(&"c".into(), &"z".into(), 5)
            .await
            .unwrap();
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
