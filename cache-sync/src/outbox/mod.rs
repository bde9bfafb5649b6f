//! The transactional outbox, on PostgreSQL (feature `postgres-outbox`)
//! and on MySQL or MariaDB (feature `mysql-outbox`): one [`Outbox`] and one
//! [`OutboxRelay`], on a `sqlx` connection and pool of either database.
//!
//! Publishing after a commit is two writes: a crash or a broker outage
//! between them leaves the change unpublished, and nodes serve the old row
//! until it is evicted. With the outbox, the change event is a row written
//! in the caller's own transaction ([`Outbox`]), so it commits or rolls
//! back with the data, and an [`OutboxRelay`] publishes committed rows
//! through a [`Publisher`](crate::Publisher), deleting each only once the
//! transport has taken it.
//!
//! Ordering: every enqueue first takes a lock on its (schema, cache) that
//! lasts until its transaction ends (on PostgreSQL a transaction-level
//! advisory lock; on MySQL an InnoDB row lock on the cache's row in the
//! outbox's `versions` table), then takes its row id (and an automatic
//! version) after the lock. Writers of one cache therefore serialize from their
//! first enqueue to their commit, and per cache, ids and versions follow
//! commit order. The relay publishes in id order, so per cache it publishes
//! in commit order. The cost: a transaction that enqueued holds up every
//! other writer of that cache until it ends, so enqueue last, just before
//! the commit.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::publish::{invalidations, refreshes};
use crate::table::Table;
use crate::transport::names::{self, NameKind};
pub(crate) use crate::wire::decode_row;
use crate::wire::{Change, DEFAULT_MAX_EVENT_BYTES, encode_row};

mod builder;
mod database;
mod dictionary;
mod migrate;
#[cfg(feature = "mysql-outbox")]
mod mysql;
#[cfg(feature = "postgres-outbox")]
mod pg;
mod relay;
mod relay_pass;

pub use builder::OutboxBuilder;
use database::Conn;
pub use database::{OutboxConnection, OutboxPool};
pub use dictionary::OutboxDictionary;
pub use relay::{OutboxRelay, OutboxRelayBuilder, OutboxRelayStats};

/// The schema [`Outbox::new`] uses.
const DEFAULT_SCHEMA: &str = "cache_sync";

/// PostgreSQL's longest identifier (NAMEDATALEN - 1); MySQL's is 64.
const MAX_SCHEMA_BYTES: usize = 63;

/// Writes change events into an outbox table inside the caller's own
/// transaction; an [`OutboxRelay`] publishes them once committed.
///
/// Every method that enqueues takes an open transaction: `&mut tx` for a
/// `sqlx::Transaction` of PostgreSQL or MySQL (any [`OutboxConnection`]).
/// The row is written when the call returns; the relay sees it only once
/// the caller commits, and a rolled-back transaction publishes nothing.
///
/// **Enqueue last.** Each enqueue first takes a lock on its cache (held
/// until commit or rollback), so that per cache,
/// row ids and automatic versions follow commit order and the relay
/// publishes in commit order. Every other writer of that cache waits for
/// it: enqueue just before committing, not at the start of a long
/// transaction. A transaction that enqueues for several caches holds
/// several locks: take them in one order everywhere (say, by cache name),
/// or the database may find a deadlock and abort one of two transactions
/// (an [`Error::Database`]; retry it). On MySQL a writer waits for the lock
/// at most `innodb_lock_wait_timeout` (50 s by default), then fails the
/// same way. Outside a transaction (autocommit) each statement commits on
/// its own and that ordering is not promised.
///
/// Cheap to clone.
///
/// ```no_run
/// use cache_sync::outbox::{Outbox, OutboxRelay};
/// use cache_sync::{Publisher, Table};
/// # use cache_sync::transport::EmbeddedTransport;
///
/// const COUNTRIES: Table<String, String> = Table::new("countries");
///
/// # async fn run(pool: sqlx::PgPool, publisher: Publisher) -> cache_sync::Result<()> {
/// let outbox = Outbox::new();
/// outbox.migrate(&pool).await?; // or run migrations/*.sql yourself, in order
///
/// // In the admin service, in the transaction that writes the row:
/// let countries = outbox.dictionary(COUNTRIES);
/// let mut tx = pool.begin().await.map_err(|e| cache_sync::Error::Database(e.into()))?;
/// // ... UPDATE countries SET name = 'Deutschland' WHERE code = 'de' ...
/// let version = countries.insert(&mut tx, "de", "Deutschland").await?;
/// tx.commit().await.map_err(|e| cache_sync::Error::Database(e.into()))?;
///
/// // Once per service (several may run; one publishes at a time):
/// let relay = OutboxRelay::builder(pool.clone(), publisher).outbox(outbox).start().await?;
/// # let _ = version;
/// relay.shutdown().await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<OutboxInner>,
}

struct OutboxInner {
    schema: String,
    topic: Option<String>,
    max_event_bytes: usize,
    again_after: Option<Duration>,
}

impl fmt::Debug for Outbox {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outbox")
            .field("schema", &self.inner.schema)
            .field("topic", &self.inner.topic)
            .field("max_event_bytes", &self.inner.max_event_bytes)
            .field("again_after", &self.inner.again_after)
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        Self::new()
    }
}

pub(crate) fn db(e: sqlx::Error) -> Error {
    Error::Database(Box::new(e))
}

impl Outbox {
    /// An outbox in the schema `cache_sync`, rows up to 1 MiB, no second
    /// invalidation.
    pub fn new() -> Self {
        Self::builder()
            .build()
            .expect("the default settings are valid")
    }

    /// Configures an outbox.
    pub fn builder() -> OutboxBuilder {
        OutboxBuilder {
            schema: DEFAULT_SCHEMA.into(),
            topic: None,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            again_after: None,
        }
    }

    /// The schema holding the outbox's tables.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    /// The topic its rows are for, when [set](OutboxBuilder::topic).
    pub fn topic(&self) -> Option<&str> {
        self.inner.topic.as_deref()
    }

    pub(crate) fn max_event_bytes(&self) -> usize {
        self.inner.max_event_bytes
    }

    /// Enqueues an unversioned insert of these entries in `cache` (see
    /// [`Publisher::insert`](crate::Publisher::insert)).
    pub async fn insert<K: Serialize, V: Serialize>(
        &self,
        conn: &mut impl OutboxConnection,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V)>,
    ) -> Result<()> {
        self.insert_versioned(conn, cache, entries.into_iter().map(|(k, v)| (k, v, None)))
            .await
    }

    /// Enqueues an insert of these entries, each with an optional version
    /// (see [`Publisher::insert_versioned`](crate::Publisher::insert_versioned)).
    pub async fn insert_versioned<K: Serialize, V: Serialize>(
        &self,
        conn: &mut impl OutboxConnection,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
    ) -> Result<()> {
        let changes = refreshes(entries, self.budget())?;
        let conn = &mut conn.conn();
        self.lock(conn, cache).await?;
        self.write_rows(conn, cache, &changes).await
    }

    /// Enqueues an unversioned invalidation of `keys` in `cache` (see
    /// [`Publisher::invalidate`](crate::Publisher::invalidate)).
    pub async fn invalidate<K: Serialize>(
        &self,
        conn: &mut impl OutboxConnection,
        cache: &str,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<()> {
        self.invalidate_versioned(conn, cache, keys.into_iter().map(|k| (k, None)))
            .await
    }

    /// Enqueues an invalidation leaving a tombstone at each key's version
    /// (see [`Publisher::invalidate_versioned`](crate::Publisher::invalidate_versioned)).
    pub async fn invalidate_versioned<K: Serialize>(
        &self,
        conn: &mut impl OutboxConnection,
        cache: &str,
        keys: impl IntoIterator<Item = (K, Option<u64>)>,
    ) -> Result<()> {
        let changes = invalidations(keys, self.budget())?;
        let conn = &mut conn.conn();
        self.lock(conn, cache).await?;
        self.write_rows(conn, cache, &changes).await
    }

    /// Enqueues an invalidation of everything in `cache` (see
    /// [`Publisher::invalidate_all`](crate::Publisher::invalidate_all)).
    pub async fn invalidate_all(
        &self,
        conn: &mut impl OutboxConnection,
        cache: &str,
    ) -> Result<()> {
        let conn = &mut conn.conn();
        self.lock(conn, cache).await?;
        self.write_rows(conn, cache, &[Change::Clear { version: None }])
            .await
    }

    /// Enqueues an invalidation of everything in `cache` whose version is
    /// a floor (see
    /// [`Publisher::invalidate_all_versioned`](crate::Publisher::invalidate_all_versioned)).
    pub async fn invalidate_all_versioned(
        &self,
        conn: &mut impl OutboxConnection,
        cache: &str,
        version: u64,
    ) -> Result<()> {
        let conn = &mut conn.conn();
        self.lock(conn, cache).await?;
        self.write_rows(
            conn,
            cache,
            &[Change::Clear {
                version: Some(version),
            }],
        )
        .await
    }

    /// A version for a row of `cache`, from the caller's transaction: the
    /// database clock in microseconds since the Unix epoch, made strictly
    /// greater than every version this outbox handed out or was given for
    /// `cache` (by the dictionary helper's `_versioned` methods). It is
    /// taken under the cache's enqueue lock, so per cache, versions follow
    /// commit order; the lock is held until the transaction ends, as for
    /// an enqueue. A rolled-back transaction gives its version back.
    ///
    /// Versions are stored as a signed 64-bit `bigint`: after a version of
    /// `i64::MAX` (or a caller version above it), this is
    /// [`Error::VersionExhausted`].
    pub async fn next_version(&self, conn: &mut impl OutboxConnection, cache: &str) -> Result<u64> {
        let conn = &mut conn.conn();
        self.lock(conn, cache).await?;
        self.auto_version(conn, cache).await
    }

    /// The outbox mode of the dictionary helper: a typed, versioned
    /// enqueuer for one table, mirroring
    /// [`DictionaryPublisher`](crate::DictionaryPublisher). A [`Table`]
    /// pinned to a topic other than this outbox's
    /// [`topic`](OutboxBuilder::topic) refuses every write with
    /// [`Error::Config`].
    pub fn dictionary<K: Serialize, V: Serialize>(
        &self,
        table: impl Into<Table<K, V>>,
    ) -> OutboxDictionary<K, V> {
        let (cache, topic) = table.into().into_parts();
        OutboxDictionary {
            outbox: self.clone(),
            cache,
            topic,
            _types: PhantomData,
        }
    }

    /// Takes the cache's enqueue lock, held until the transaction ends.
    /// Everything that decides order (the row id, an automatic version) is
    /// taken after it.
    async fn lock(&self, conn: &mut Conn<'_>, cache: &str) -> Result<()> {
        names::check(NameKind::Cache, cache)?;
        let schema = &self.inner.schema;
        match conn {
            #[cfg(feature = "postgres-outbox")]
            Conn::Pg(c) => pg::lock(c, &format!("cache-sync outbox\n{schema}\n{cache}")).await,
            #[cfg(feature = "mysql-outbox")]
            Conn::MySql(c) => mysql::lock(c, schema, cache).await,
        }
    }

    /// The next automatic version; the caller holds the cache's lock, which
    /// also serializes every reader and writer of its counter row.
    async fn auto_version(&self, conn: &mut Conn<'_>, cache: &str) -> Result<u64> {
        let schema = &self.inner.schema;
        let (last, now) = match conn {
            #[cfg(feature = "postgres-outbox")]
            Conn::Pg(c) => pg::last_version_and_clock(c, schema, cache).await?,
            #[cfg(feature = "mysql-outbox")]
            Conn::MySql(c) => mysql::last_version_and_clock(c, schema, cache).await?,
        };
        let next = match last {
            Some(last) => last
                .checked_add(1)
                .ok_or(Error::VersionExhausted(u64::try_from(last).unwrap_or(0)))?
                .max(now),
            None => now.max(1),
        };
        self.store_version(conn, cache, next, false).await?;
        Ok(u64::try_from(next).unwrap_or(0))
    }

    /// Records `version` as the cache's latest: `raise` keeps the larger of
    /// the stored and the given (a caller's version).
    async fn store_version(
        &self,
        conn: &mut Conn<'_>,
        cache: &str,
        version: i64,
        raise: bool,
    ) -> Result<()> {
        let schema = &self.inner.schema;
        match conn {
            #[cfg(feature = "postgres-outbox")]
            Conn::Pg(c) => pg::store_version(c, schema, cache, version, raise).await,
            #[cfg(feature = "mysql-outbox")]
            Conn::MySql(c) => mysql::store_version(c, schema, cache, version, raise).await,
        }
    }

    /// Writes the rows (and, with [`again_after`](OutboxBuilder::again_after),
    /// a delayed invalidation for each), ids taken now, under the lock the
    /// caller took.
    async fn write_rows(&self, conn: &mut Conn<'_>, cache: &str, changes: &[Change]) -> Result<()> {
        let mut rows = Vec::with_capacity(changes.len());
        for change in changes {
            rows.push(encode_row(change, self.inner.max_event_bytes)?);
        }
        self.insert_rows(conn, cache, &rows, None).await?;
        if let Some(delay) = self.inner.again_after {
            let mut rows = Vec::with_capacity(changes.len());
            for change in changes {
                // No larger than the change it repeats, so it fits too.
                rows.push(encode_row(
                    &change.clone().into_invalidation(),
                    self.inner.max_event_bytes,
                )?);
            }
            let micros = i64::try_from(delay.as_micros()).unwrap_or(i64::MAX);
            self.insert_rows(conn, cache, &rows, Some(micros)).await?;
        }
        Ok(())
    }

    /// Inserts encoded rows in order, due at once or `delay_us` from now by
    /// the database's clock.
    async fn insert_rows(
        &self,
        conn: &mut Conn<'_>,
        cache: &str,
        rows: &[Vec<u8>],
        delay_us: Option<i64>,
    ) -> Result<()> {
        let schema = &self.inner.schema;
        match conn {
            #[cfg(feature = "postgres-outbox")]
            Conn::Pg(c) => pg::insert_rows(c, schema, cache, rows, delay_us).await,
            #[cfg(feature = "mysql-outbox")]
            Conn::MySql(c) => mysql::insert_rows(c, schema, cache, rows, delay_us).await,
        }
    }

    /// How many bytes of keys and values one row may hold: the format
    /// byte, the variant and the length prefix fit in the rest, rounded up.
    fn budget(&self) -> usize {
        self.inner.max_event_bytes.saturating_sub(16)
    }
}

/// Bytes of a key as the outbox stores it, for tests.
#[cfg(test)]
fn key_bytes<K: Serialize>(k: &K) -> bytes::Bytes {
    crate::wire::encode_part(k, "key").expect("key encodes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::MAX_TIMEOUT;
    use crate::wire::MAX_EVENT_BYTES_CEILING;

    proptest::proptest! {
        /// A topic is checked by the rule every transport's names follow:
        /// `build` takes exactly the names it takes, keeps them byte for
        /// byte, and refuses the rest as configuration, without echoing a
        /// huge name whole.
        #[test]
        fn a_topic_is_kept_or_refused_by_the_name_rule(topic in proptest::prop_oneof![
            proptest::strategy::Just(String::new()),
            proptest::strategy::Just("x".repeat(255)),
            proptest::strategy::Just("x".repeat(256)),
            proptest::strategy::Just("é".repeat(200)),
            proptest::strategy::Just("tenant.a > *: b".to_owned()),
            "[.*>: \\x00\\n\\u{7f}a-zé日]{0,12}",
            "\\PC{0,300}",
        ]) {
            let built = Outbox::builder().topic(topic.clone()).build();
            match names::check(NameKind::Topic, &topic) {
                Ok(()) => {
                    let outbox = built.unwrap();
                    proptest::prop_assert_eq!(outbox.topic(), Some(topic.as_str()));
                }
                Err(_) => {
                    let err = built.unwrap_err();
                    proptest::prop_assert!(err.is_config(), "{}", err);
                    proptest::prop_assert!(err.to_string().len() < 400, "{}", err);
                }
            }
        }
    }

    #[cfg(feature = "postgres-outbox")]
    #[test]
    fn the_shipped_migrations_are_what_migrate_runs_for_cache_sync() {
        assert_eq!(
            Outbox::new().migration_sql(),
            [
                include_str!("../../migrations/0001_outbox.sql"),
                include_str!("../../migrations/0002_relay_fence.sql"),
            ]
        );
        let other = Outbox::builder().schema("tenant_7").build().unwrap();
        let sql = other.migration_sql().join("\n");
        assert!(!sql.contains("{schema}") && !sql.contains("cache_sync."));
        assert!(sql.contains("CREATE TABLE IF NOT EXISTS tenant_7.outbox"));
        assert!(sql.contains("CREATE SEQUENCE IF NOT EXISTS tenant_7.relay_term_seq"));
    }

    #[test]
    fn schema_names_are_plain_identifiers() {
        for bad in [
            "",
            "a;drop",
            "A",
            "1abc",
            "pg_catalog",
            "a b",
            "a\"b",
            "é",
            &"a".repeat(64),
        ] {
            let err = Outbox::builder().schema(bad).build().unwrap_err();
            assert!(err.is_config(), "{bad:?}: {err}");
        }
        for good in ["cache_sync", "_x", "a1", &"a".repeat(63)] {
            Outbox::builder().schema(good).build().unwrap();
        }
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        for n in [0, MAX_EVENT_BYTES_CEILING + 1] {
            assert!(
                Outbox::builder()
                    .max_event_bytes(n)
                    .build()
                    .unwrap_err()
                    .is_config()
            );
        }
        for d in [
            Duration::ZERO,
            Duration::from_micros(999),
            MAX_TIMEOUT + Duration::from_nanos(1),
            Duration::MAX,
        ] {
            assert!(
                Outbox::builder()
                    .again_after(d)
                    .build()
                    .unwrap_err()
                    .is_config()
            );
        }
    }

    #[test]
    fn again_after_accepts_its_range() {
        for d in [Duration::from_millis(1), MAX_TIMEOUT] {
            Outbox::builder().again_after(d).build().unwrap();
        }
    }

    #[test]
    fn rows_round_trip_and_bad_rows_are_refused() {
        let change = Change::Invalidate {
            keys: vec![crate::wire::KeyVersion {
                key: key_bytes(&"de"),
                version: Some(7),
            }],
        };
        let row = encode_row(&change, 1024).unwrap();
        assert_eq!(decode_row(&row, 1024).unwrap(), change);
        assert!(decode_row(&row, row.len() - 1).is_err(), "over the limit");
        assert!(decode_row(&[], 1024).is_err());
        assert!(decode_row(&[2, 0], 1024).is_err(), "unknown format");
        let mut trailing = row.clone();
        trailing.push(0);
        assert!(decode_row(&trailing, 1024).is_err());
        // A length prefix claiming far more than the row holds.
        assert!(decode_row(&[1, 0, 0xfc, 0xff, 0xff, 0xff, 0x7f], 1024).is_err());
        assert!(
            encode_row(&change, row.len() - 1)
                .unwrap_err()
                .is_too_large()
        );
    }

    #[test]
    fn large_calls_split_over_rows_that_each_fit() {
        let o = Outbox::builder().max_event_bytes(4096).build().unwrap();
        let entries: Vec<_> = (0u32..100).map(|i| (i, "v".repeat(200), Some(1))).collect();
        let changes = refreshes(entries, o.budget()).unwrap();
        assert!(changes.len() > 1);
        for c in &changes {
            assert!(encode_row(c, 4096).is_ok());
        }
        assert_eq!(changes.iter().map(Change::len).sum::<usize>(), 100);
        let err = refreshes([(1u32, "v".repeat(5000), None)], o.budget()).unwrap_err();
        assert!(err.is_too_large());
    }
}
