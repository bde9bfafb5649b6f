//! The dictionary helper's outbox mode: typed rows of one table.

use std::borrow::Borrow;
use std::fmt;
use std::marker::PhantomData;

use serde::Serialize;

use super::{Outbox, OutboxConnection};
use crate::error::{Error, Result};
use crate::publish::{invalidations, refreshes, replacement};
use crate::table::check_topic;
use crate::wire::Change;

/// The dictionary helper's outbox mode: typed rows of one table, enqueued
/// in the caller's transaction with a row version each.
///
/// Like [`DictionaryPublisher`](crate::DictionaryPublisher), by default it
/// assigns versions ([`Outbox::next_version`]: database microseconds, made
/// strictly increasing per cache, in commit order), or takes the caller's
/// own (a row version column) with the `_versioned` methods; automatic
/// versions always exceed versions passed in. Every method returns the
/// version used, once the row is written.
pub struct OutboxDictionary<K, V> {
    pub(super) outbox: Outbox,
    pub(super) cache: String,
    pub(super) topic: Option<&'static str>,
    pub(super) _types: PhantomData<fn(&K, &V)>,
}

impl<K, V> Clone for OutboxDictionary<K, V> {
    fn clone(&self) -> Self {
        Self {
            outbox: self.outbox.clone(),
            cache: self.cache.clone(),
            topic: self.topic,
            _types: PhantomData,
        }
    }
}

impl<K, V> fmt::Debug for OutboxDictionary<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OutboxDictionary")
            .field("cache", &self.cache)
            .field("schema", &self.outbox.inner.schema)
            .finish_non_exhaustive()
    }
}

impl<K: Serialize, V: Serialize> OutboxDictionary<K, V> {
    /// The cache name it enqueues for.
    pub fn cache(&self) -> &str {
        &self.cache
    }

    /// A row was inserted or updated. Returns the version assigned. Key
    /// and row are borrowed as in
    /// [`DictionaryPublisher::insert`](crate::DictionaryPublisher::insert).
    pub async fn insert<Q, R>(
        &self,
        conn: &mut impl OutboxConnection,
        key: &Q,
        row: &R,
    ) -> Result<u64>
    where
        K: Borrow<Q>,
        V: Borrow<R>,
        Q: Serialize + ?Sized,
        R: Serialize + ?Sized,
    {
        self.enqueue(conn, None, |o, v| {
            refreshes([(key, row, Some(v))], o.budget())
        })
        .await
    }

    /// [`insert`](Self::insert) at the caller's version.
    pub async fn insert_versioned<Q, R>(
        &self,
        conn: &mut impl OutboxConnection,
        key: &Q,
        row: &R,
        version: u64,
    ) -> Result<u64>
    where
        K: Borrow<Q>,
        V: Borrow<R>,
        Q: Serialize + ?Sized,
        R: Serialize + ?Sized,
    {
        self.enqueue(conn, Some(version), |o, v| {
            refreshes([(key, row, Some(v))], o.budget())
        })
        .await
    }

    /// Several rows at one version.
    pub async fn insert_many<'a>(
        &self,
        conn: &mut impl OutboxConnection,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.enqueue(conn, None, |o, v| {
            refreshes(rows.into_iter().map(|(k, r)| (k, r, Some(v))), o.budget())
        })
        .await
    }

    /// A row was deleted: nodes drop it and keep a tombstone at the
    /// version.
    pub async fn invalidate<Q>(&self, conn: &mut impl OutboxConnection, key: &Q) -> Result<u64>
    where
        K: Borrow<Q>,
        Q: Serialize + ?Sized,
    {
        self.enqueue(conn, None, |o, v| {
            invalidations([(key, Some(v))], o.budget())
        })
        .await
    }

    /// [`invalidate`](Self::invalidate) at the caller's version.
    pub async fn invalidate_versioned<Q>(
        &self,
        conn: &mut impl OutboxConnection,
        key: &Q,
        version: u64,
    ) -> Result<u64>
    where
        K: Borrow<Q>,
        Q: Serialize + ?Sized,
    {
        self.enqueue(conn, Some(version), |o, v| {
            invalidations([(key, Some(v))], o.budget())
        })
        .await
    }

    /// Every row goes: nodes drop the whole cache, the version a floor
    /// below which later-arriving inserts are ignored.
    pub async fn invalidate_all(&self, conn: &mut impl OutboxConnection) -> Result<u64> {
        self.enqueue(conn, None, |_, v| {
            Ok(vec![Change::Clear { version: Some(v) }])
        })
        .await
    }

    /// [`invalidate_all`](Self::invalidate_all) at the caller's version.
    pub async fn invalidate_all_versioned(
        &self,
        conn: &mut impl OutboxConnection,
        version: u64,
    ) -> Result<u64> {
        self.enqueue(conn, Some(version), |_, v| {
            Ok(vec![Change::Clear { version: Some(v) }])
        })
        .await
    }

    /// The table was replaced wholesale: a clear at the version, then the
    /// rows at the same version (see
    /// [`DictionaryPublisher::replace_all`](crate::DictionaryPublisher::replace_all)).
    pub async fn replace_all<'a>(
        &self,
        conn: &mut impl OutboxConnection,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.enqueue(conn, None, |o, v| replacement(rows, v, o.budget()))
            .await
    }

    /// [`replace_all`](Self::replace_all) at the caller's version.
    pub async fn replace_all_versioned<'a>(
        &self,
        conn: &mut impl OutboxConnection,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
        version: u64,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.enqueue(conn, Some(version), |o, v| replacement(rows, v, o.budget()))
            .await
    }

    /// Takes the lock, then the version, then the ids. On an error the
    /// caller rolls back, which also returns the version.
    async fn enqueue(
        &self,
        conn: &mut impl OutboxConnection,
        version: Option<u64>,
        build: impl FnOnce(&Outbox, u64) -> Result<Vec<Change>>,
    ) -> Result<u64> {
        let o = &self.outbox;
        match (self.topic, o.topic()) {
            (Some(pinned), None) => {
                return Err(Error::Config(format!(
                    "table {:?} lives on topic {pinned:?}, and this outbox has no topic to check \
                     it against: set OutboxBuilder::topic to its relay's topic",
                    self.cache
                )));
            }
            (pinned, Some(topic)) => check_topic(&self.cache, pinned, topic)?,
            (None, None) => {}
        }
        let conn = &mut conn.conn();
        o.lock(conn, &self.cache).await?;
        let v = match version {
            Some(v) => {
                let stored = i64::try_from(v).unwrap_or(i64::MAX);
                o.store_version(conn, &self.cache, stored, true).await?;
                v
            }
            None => o.auto_version(conn, &self.cache).await?,
        };
        let changes = build(o, v)?;
        o.write_rows(conn, &self.cache, &changes).await?;
        Ok(v)
    }
}
