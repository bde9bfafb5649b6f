//! Invalidation from MySQL's or MariaDB's binary log (feature
//! `mysql-cdc`): the relay's handle, builder and shared state. The
//! session (`session.rs`) reads the binlog; `state.rs` keeps the relay's
//! position and lock in the database; `shape.rs` renders row values.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mysql_async::Opts;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::stats::{CdcRelayStats, Shared};
use super::{CdcTable, Mapping};
use crate::error::{Error, Result};
use crate::publish::Publisher;
use crate::util::{check_duration, lock};

// `pub(crate)` for the `binlog_rows` fuzz target (its `Image`, and `Shape`).
pub(crate) mod session;
pub(crate) mod shape;
mod state;

const BINLOG_DEFAULT_MAX_ROWS: usize = 10_000;
const BINLOG_DEFAULT_STANDBY_RETRY: Duration = Duration::from_secs(1);
const BINLOG_MIN_STANDBY_RETRY: Duration = Duration::from_millis(10);
const BINLOG_MAX_STANDBY_RETRY: Duration = Duration::from_secs(60);
/// The longest name the relays' table and MariaDB's `GET_LOCK` take.
const MAX_NAME_BYTES: usize = 64;

/// Streams committed row changes of the mapped tables out of a MySQL or
/// MariaDB server's binary log and publishes them as versioned cache
/// events, as [`CdcRelay`](crate::cdc::CdcRelay) does for PostgreSQL.
///
/// The server needs `log_bin`, `binlog_format = ROW`,
/// `binlog_row_metadata = FULL` (column names are read from it) and a
/// `server_id`; `binlog_row_image = FULL` lets every column be read
/// (MINIMAL: a change whose mapping reads a column the image left out is
/// an invalidation). The user needs `REPLICATION SLAVE` and
/// `REPLICATION CLIENT` (MariaDB: `BINLOG MONITOR`), and to create and
/// write the relays' table (`cache_sync_binlog_relays`) in the address's
/// database. A relay refuses to stream from a server without these, and
/// says which is missing (counted in [`CdcRelayStats::failures`], tried
/// again).
///
/// What it promises:
///
/// - **Every committed change, never an uncommitted one.** The binlog
///   holds a transaction only once it commits, in commit order; a rolled
///   back one is never written. Each change is published at a version
///   made of its transaction's binlog position: the file's number times
///   2^32 plus the offset where the transaction begins, plus one, plus a
///   base the relay raises if the server's binlog ever starts over
///   (`RESET MASTER`). It only grows along the binlog, across rotations
///   and restarts, so on a node an older change never lands over a newer
///   one.
/// - **Visible before published.** A server hands a transaction to
///   binlog readers once it is written to the binlog, which can be before
///   other sessions see it. Before publishing, the relay commits a write
///   of its own (its position, in its table); the server commits
///   transactions in binlog order, so once that write returns every
///   transaction before it is visible, and a node that applied a change
///   and loads the row reads the change.
/// - **At least once.** The position is saved only after the publish of
///   everything before it returned. A relay killed at any point, a
///   dropped connection, a restarted server: the next session starts at
///   the saved position and publishes the rest again; applying a change
///   twice equals once.
/// - **A lost position is a resync.** A saved position the server no
///   longer has (its binlogs purged, `binlog_expire_logs_seconds`, `RESET
///   MASTER`, another server at the address) has lost changes: the relay
///   starts at the binlog's end, and every mapped cache is cleared at a
///   version above every one published before (counted in
///   [`CdcRelayStats::resyncs`], logged). A relay that starts with no
///   saved position starts the same way.
/// - **One active relay per name.** The active relay holds a named lock
///   (`GET_LOCK`) on its own connection; standbys with the same name
///   check every [`standby_retry`](BinlogRelayBuilder::standby_retry) and
///   take over once that connection ends. Every write of the position
///   checks it still holds the lock, so a relay that lost it stops.
/// - **Large transactions.** Past
///   [`max_rows_per_transaction`](BinlogRelayBuilder::max_rows_per_transaction)
///   row changes (10,000 by default) or 64 MiB of keys and values to one
///   cache, the rest of the transaction reaches nodes as one clear of that
///   cache at its version.
/// - **Statements, not rows.** `TRUNCATE`, and any other statement in
///   the binlog (DDL: `ALTER`, `RENAME`, `DROP`, `CREATE`; a statement
///   logged as a statement) that names a mapped table, clears its cache
///   at the statement's version: a statement changes rows without row
///   events. A change that does not decode (a compressed event, a value
///   the relay cannot read) clears every mapped cache.
///
/// **Where to run it.** As [`CdcRelay`](crate::cdc::CdcRelay): beside the
/// database, on a runtime of its own.
pub struct BinlogRelay {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for BinlogRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BinlogRelay")
            .field("name", &self.shared.slot)
            .finish_non_exhaustive()
    }
}

/// Configures a [`BinlogRelay`].
pub struct BinlogRelayBuilder {
    url: String,
    publisher: Publisher,
    tables: Vec<Mapping>,
    name: String,
    server_id: Option<u32>,
    max_rows_per_transaction: usize,
    standby_retry: Duration,
}

impl fmt::Debug for BinlogRelayBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BinlogRelayBuilder")
            .field("name", &self.name)
            .field("tables", &self.tables.len())
            .finish_non_exhaustive()
    }
}

/// What the session needs, shared by the relay's task.
pub(super) struct Inner {
    pub(super) shared: Arc<Shared>,
    pub(super) opts: Opts,
    /// The address's database: where the relays' table is, and the
    /// database of a mapping given without one.
    pub(super) database: String,
    pub(super) publisher: Publisher,
    pub(super) tables: Vec<Mapping>,
    pub(super) server_id: u32,
    pub(super) max_rows_per_transaction: usize,
    pub(super) standby_retry: Duration,
}

impl BinlogRelay {
    /// Configures a relay that streams the binlog of the server at `url`
    /// (`mysql://user:password@host:port/database`) and publishes through
    /// `publisher`. Tables given as `"table"` are in the address's
    /// database; `"database.table"` names another.
    pub fn builder(url: impl Into<String>, publisher: Publisher) -> BinlogRelayBuilder {
        BinlogRelayBuilder {
            url: url.into(),
            publisher,
            tables: Vec::new(),
            name: "cache_sync".to_owned(),
            server_id: None,
            max_rows_per_transaction: BINLOG_DEFAULT_MAX_ROWS,
            standby_retry: BINLOG_DEFAULT_STANDBY_RETRY,
        }
    }

    /// The counters and gauges. `confirmed_lsn` is the version of the
    /// saved position.
    pub fn stats(&self) -> CdcRelayStats {
        self.shared.snapshot()
    }

    /// The stats in Prometheus' text format (families `cache_sync_cdc_*`,
    /// labelled with the relay's name as `slot`).
    pub fn metrics(&self) -> String {
        super::metrics::encode(&self.shared.slot, &self.stats())
    }

    /// Stops streaming and waits for the task. What was not yet saved is
    /// published again by the next relay of the name.
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        self.shared.active.store(false, Ordering::Relaxed);
    }
}

impl Drop for BinlogRelay {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl BinlogRelayBuilder {
    /// Maps a table's rows to a cache's keys (and values): see
    /// [`CdcTable`]. A relation without a database (`"table"`, which
    /// `CdcTable` files under `public`) is in the address's database.
    pub fn table<K, V>(mut self, table: CdcTable<K, V>) -> Self
    where
        K: serde::Serialize + 'static,
        V: serde::Serialize + 'static,
    {
        self.tables.push(table.erase());
        self
    }

    /// The relay's name (`cache_sync` by default): relays of one name
    /// share a position, one streams and the others stand by. Up to 64
    /// bytes.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The server id the relay registers as a replica with. Every
    /// replica of a server, and every relay of another name, needs its
    /// own: a second reader with the same id disconnects the first. By
    /// default one derived from the name, in `2^31..2^32`, away from the
    /// small ids servers are usually given. Not 0.
    pub fn server_id(mut self, id: u32) -> Self {
        self.server_id = Some(id);
        self
    }

    /// Row changes one transaction may make to one cache before the rest
    /// reaches nodes as one clear of it (10,000; at least 1).
    pub fn max_rows_per_transaction(mut self, n: usize) -> Self {
        self.max_rows_per_transaction = n;
        self
    }

    /// How often a standby checks whether the active relay is gone (1 s;
    /// 10 ms to 60 s).
    pub fn standby_retry(mut self, every: Duration) -> Self {
        self.standby_retry = every;
        self
    }

    /// Checks the settings and starts the relay's task. The server is
    /// not reached here: a server that is down or refuses is retried in
    /// the background (see [`CdcRelayStats::failures`]).
    pub async fn start(self) -> Result<BinlogRelay> {
        if self.tables.is_empty() {
            return Err(Error::Config(
                "a binlog relay needs at least one table".into(),
            ));
        }
        if self.name.is_empty() || self.name.len() > MAX_NAME_BYTES {
            return Err(Error::Config(format!(
                "a binlog relay's name must be 1 to {MAX_NAME_BYTES} bytes, not {}",
                self.name.len()
            )));
        }
        if self.max_rows_per_transaction == 0 {
            return Err(Error::Config(
                "max_rows_per_transaction must be at least 1".into(),
            ));
        }
        check_duration(
            "standby_retry",
            self.standby_retry,
            BINLOG_MIN_STANDBY_RETRY,
            BINLOG_MAX_STANDBY_RETRY,
        )?;
        if self.server_id == Some(0) {
            return Err(Error::Config("a replica's server_id cannot be 0".into()));
        }
        super::check_tables(&self.publisher, &self.tables)?;
        let opts = Opts::from_url(&self.url)
            .map_err(|e| Error::Config(format!("the binlog relay's address: {e}")))?;
        let Some(database) = opts.db_name().map(str::to_owned) else {
            return Err(Error::Config(
                "the binlog relay's address must name a database (mysql://…/database)".into(),
            ));
        };
        let server_id = self.server_id.unwrap_or_else(|| {
            let h = crate::util::source_hash(&["binlog", &self.name]);
            // The high half of u32: 2^31..2^32.
            #[allow(clippy::cast_possible_truncation)]
            let low = h as u32;
            low | 0x8000_0000
        });
        let mut tables = self.tables;
        for t in &mut tables {
            if !t.qualified {
                t.schema.clone_from(&database);
            }
        }
        let shared = Arc::new(Shared {
            slot: self.name,
            active: AtomicBool::new(false),
            transactions: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            takeovers: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            mark_failures: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            lag_bytes: AtomicU64::new(u64::MAX),
            oldest_pending_commit: AtomicI64::new(0),
            server_time: crate::cdc::stats::ServerClock::default(),
        });
        let inner = Arc::new(Inner {
            shared: Arc::clone(&shared),
            opts,
            database,
            publisher: self.publisher,
            tables,
            server_id,
            max_rows_per_transaction: self.max_rows_per_transaction,
            standby_retry: self.standby_retry,
        });
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(session::run(inner, stop_rx));
        Ok(BinlogRelay {
            shared,
            stop,
            task: Mutex::new(Some(task)),
        })
    }
}
