//! Invalidation from PostgreSQL's own log (feature `postgres-cdc`).
//!
//! The [`Outbox`](crate::outbox::Outbox) covers writers that use it. A migration, a
//! `psql` session or a job in another language writes the table directly
//! and leaves every node stale. The [`CdcRelay`] reads the database's
//! logical replication stream instead (the built-in `pgoutput` plugin), so
//! every committed row change of the tables it maps reaches every node,
//! whoever wrote it.
//!
//! A [`CdcTable`] maps a table's rows to a cache's keys and values:
//! INSERT and UPDATE become refreshes (or invalidations, for a table
//! mapped with only a key), DELETE an invalidation, TRUNCATE a clear, each
//! versioned with the transaction's commit LSN, so an older change never
//! lands over a newer one.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use serde::Serialize;

use crate::table::Table;
use crate::wire::encode_part;

#[cfg(feature = "postgres-cdc")]
mod address;
mod batch;
#[cfg(feature = "mysql-cdc")]
pub(crate) mod binlog;
#[cfg(feature = "postgres-cdc")]
mod builder;
#[cfg(feature = "postgres-cdc")]
mod changes;
#[cfg(feature = "postgres-cdc")]
mod handoff;
mod metrics;
pub(crate) mod pgoutput;
#[cfg(feature = "postgres-cdc")]
mod publication;
#[cfg(feature = "postgres-cdc")]
mod publishing;
#[cfg(feature = "postgres-cdc")]
mod relay;
#[cfg(feature = "postgres-cdc")]
mod session;
#[cfg(feature = "postgres-cdc")]
mod slot;
#[cfg(feature = "postgres-cdc")]
mod state;
mod stats;
#[cfg(feature = "postgres-cdc")]
mod stream;
#[cfg(feature = "postgres-cdc")]
mod upkeep;
#[cfg(feature = "postgres-cdc")]
mod watermark;

#[cfg(feature = "mysql-cdc")]
pub use binlog::{BinlogRelay, BinlogRelayBuilder};
#[cfg(feature = "postgres-cdc")]
pub use builder::CdcRelayBuilder;
#[cfg(feature = "postgres-cdc")]
pub use relay::CdcRelay;
pub use stats::CdcRelayStats;

use pgoutput::{Datum, Relation, Tuple};

/// How a table's rows become a cache's entries. Give it to
/// [`CdcRelayBuilder::table`].
///
/// ```
/// use cache_sync::Table;
/// use cache_sync::cdc::CdcTable;
///
/// const COUNTRIES: Table<String, String> = Table::new("countries");
/// const FLAGS: Table<i64, bool> = Table::new("flags");
///
/// // Refresh: every node installs the committed row.
/// let countries = CdcTable::new(COUNTRIES, "public.countries", |row| row.parse("code"))
///     .value(|row| row.parse("name"));
/// // Invalidate only: nodes drop the key and load it again when asked.
/// let flags = CdcTable::new(FLAGS, "flags", |row| row.parse("id"));
/// ```
///
/// **Keys.** `key` reads the old row for a DELETE, and for an UPDATE that
/// changed the key (both the old key is dropped and the new one
/// installed). PostgreSQL sends the old row's *replica identity* columns
/// only (the primary key, by default): key by those columns, or set
/// `REPLICA IDENTITY FULL` on the table. A key that reads another column
/// (or returns `None`) cannot be told for that change, and the relay
/// clears the whole cache instead, with a warning: never a stale key.
///
/// **Values.** `value` reads the new row. PostgreSQL leaves out of an
/// UPDATE's new row the large (TOASTed) values it did not change; with
/// `REPLICA IDENTITY FULL` they are read from the old row it then sends.
/// Otherwise a column the change did not send, a column the table no
/// longer has, or `None` from `value` make that change an invalidation of
/// the key: never a value built from part of a row.
pub struct CdcTable<K, V> {
    schema: String,
    /// The relation named its schema (a binlog relay files a bare name
    /// under its address's database, not `public`).
    qualified: bool,
    name: String,
    cache: String,
    topic: Option<&'static str>,
    key: RowFn<K>,
    value: Option<RowFn<V>>,
}

impl<K, V> fmt::Debug for CdcTable<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CdcTable")
            .field("relation", &format_args!("{}.{}", self.schema, self.name))
            .field("cache", &self.cache)
            .field("refresh", &self.value.is_some())
            .finish_non_exhaustive()
    }
}

impl<K, V> CdcTable<K, V>
where
    K: Serialize + 'static,
    V: Serialize + 'static,
{
    /// Maps the rows of `relation` (`"schema.table"`, or `"table"` for
    /// schema `public`; names as PostgreSQL stores them, so unquoted and
    /// case-sensitive) to keys of `table`'s cache: every change becomes an
    /// invalidation of the key `key` returns. Add [`value`](Self::value)
    /// to refresh instead.
    pub fn new<F>(table: Table<K, V>, relation: &str, key: F) -> Self
    where
        F: Fn(&Row<'_>) -> Option<K> + Send + Sync + 'static,
    {
        let (schema, name, qualified) = match relation.split_once('.') {
            Some((schema, name)) => (schema.to_owned(), name.to_owned(), true),
            None => ("public".to_owned(), relation.to_owned(), false),
        };
        CdcTable {
            schema,
            qualified,
            name,
            cache: table.name().to_owned(),
            topic: table.topic(),
            key: Box::new(key),
            value: None,
        }
    }

    /// Builds each inserted or updated row's value with `value`, so nodes
    /// install it (at the commit's version) instead of dropping the key.
    pub fn value<F>(mut self, value: F) -> Self
    where
        F: Fn(&Row<'_>) -> Option<V> + Send + Sync + 'static,
    {
        self.value = Some(Box::new(value));
        self
    }

    pub(crate) fn erase(self) -> Mapping {
        Mapping {
            schema: self.schema,
            qualified: self.qualified,
            name: self.name,
            cache: self.cache,
            topic: self.topic,
            mapper: Arc::new(Typed {
                key: self.key,
                value: self.value,
            }),
        }
    }
}

/// A [`CdcTable`] with its types erased, as the relay holds it.
#[derive(Clone)]
pub(crate) struct Mapping {
    pub(crate) schema: String,
    #[cfg_attr(not(feature = "mysql-cdc"), allow(dead_code))]
    pub(crate) qualified: bool,
    pub(crate) name: String,
    pub(crate) cache: String,
    pub(crate) topic: Option<&'static str>,
    pub(crate) mapper: Arc<dyn Mapper>,
}

impl Mapping {
    pub(crate) fn relation(&self) -> String {
        format!("{}.{}", self.schema, self.name)
    }
}

/// Refuses a mapping whose cache is pinned to a topic other than the
/// relay's publisher's, or whose cache name a transport cannot carry.
pub(crate) fn check_tables(publisher: &crate::Publisher, tables: &[Mapping]) -> crate::Result<()> {
    let topic = publisher.topic().to_owned();
    for t in tables {
        if let Some(pinned) = t.topic
            && pinned != topic
        {
            return Err(crate::Error::Config(format!(
                "cache {:?} is pinned to topic {pinned:?}, but the relay's publisher publishes to {topic:?}",
                t.cache
            )));
        }
        crate::transport::names::check(crate::transport::names::NameKind::Cache, &t.cache)?;
    }
    Ok(())
}

/// One row of a change, as [`CdcTable`]'s functions see it: column values
/// in PostgreSQL's text format.
pub struct Row<'a> {
    relation: &'a Relation,
    tuple: &'a Tuple<'a>,
    /// An UPDATE's whole old row (replica identity FULL): where a column the
    /// update left unchanged, and so did not send, is read from.
    before: Option<&'a Tuple<'a>>,
    /// Only the replica identity's columns are readable.
    identity_only: bool,
    /// A column was asked for that this change did not carry.
    incomplete: Cell<bool>,
}

impl fmt::Debug for Row<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Row")
            .field("table", &self.relation.name)
            .finish_non_exhaustive()
    }
}

impl<'a> Row<'a> {
    pub(crate) fn new(relation: &'a Relation, tuple: &'a Tuple<'a>, identity_only: bool) -> Self {
        Row {
            relation,
            tuple,
            before: None,
            identity_only: identity_only || tuple.kind == b'K',
            incomplete: Cell::new(false),
        }
    }

    /// Reads the columns this row lacks (left unchanged) from `old`, when
    /// it is a whole old row (`'O'`: replica identity FULL).
    #[cfg_attr(not(feature = "postgres-cdc"), allow(dead_code))]
    pub(crate) fn with_before(mut self, old: Option<&'a Tuple<'a>>) -> Self {
        self.before = old.filter(|t| t.kind == b'O');
        self
    }

    /// The name (without its schema) of the table the row is in: for a
    /// partitioned table, the partition's.
    pub fn table(&self) -> &str {
        &self.relation.name
    }

    /// The column's value in text format; `None` when it is NULL. A
    /// column this change did not carry (an unchanged TOASTed value, unless
    /// the table's replica identity is FULL, when it is read from the old
    /// row; a column outside the replica identity in an old row; one the
    /// table does not have) is also `None`, and makes the change an
    /// invalidation whatever the function returns.
    pub fn get(&self, column: &str) -> Option<&'a str> {
        let Some(i) = self.relation.columns.iter().position(|c| c.name == column) else {
            self.incomplete.set(true);
            return None;
        };
        if self.identity_only && !self.relation.columns[i].identity {
            self.incomplete.set(true);
            return None;
        }
        let mut datum = self.tuple.columns.get(i);
        if let (Some(Datum::Unchanged), Some(before)) = (datum, self.before) {
            datum = before.columns.get(i);
        }
        match datum {
            Some(Datum::Null) => None,
            Some(Datum::Text(bytes)) => match std::str::from_utf8(bytes) {
                Ok(s) => Some(s),
                Err(_) => {
                    self.incomplete.set(true);
                    None
                }
            },
            Some(Datum::Unchanged | Datum::Binary(_)) | None => {
                self.incomplete.set(true);
                None
            }
        }
    }

    /// The column parsed with [`FromStr`]; `None` when it is NULL or does
    /// not parse (which makes the change an invalidation too).
    pub fn parse<T: FromStr>(&self, column: &str) -> Option<T> {
        let text = self.get(column)?;
        match text.parse() {
            Ok(v) => Some(v),
            Err(_) => {
                self.incomplete.set(true);
                None
            }
        }
    }

    pub(crate) fn is_complete(&self) -> bool {
        !self.incomplete.get()
    }
}

/// The typed functions behind a [`CdcTable`], erased.
pub(crate) trait Mapper: Send + Sync {
    /// The encoded key; `None` when the row does not tell it.
    fn key(&self, row: &Row<'_>) -> Option<Bytes>;
    /// The encoded value; `None` when the row does not give one (or the
    /// table is mapped for invalidation only).
    fn value(&self, row: &Row<'_>) -> Option<Bytes>;
}

type RowFn<T> = Box<dyn Fn(&Row<'_>) -> Option<T> + Send + Sync>;

pub(crate) struct Typed<K, V> {
    pub(crate) key: RowFn<K>,
    pub(crate) value: Option<RowFn<V>>,
}

impl<K: Serialize, V: Serialize> Mapper for Typed<K, V> {
    fn key(&self, row: &Row<'_>) -> Option<Bytes> {
        let key = (self.key)(row)?;
        if !row.is_complete() {
            return None;
        }
        encode_part(&key, "key").ok()
    }

    fn value(&self, row: &Row<'_>) -> Option<Bytes> {
        let value = (self.value.as_ref()?)(row)?;
        if !row.is_complete() {
            return None;
        }
        encode_part(&value, "value").ok()
    }
}

#[cfg(all(test, feature = "postgres-cdc"))]
mod tests;
