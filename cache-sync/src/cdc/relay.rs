//! The relay: streams the slot, maps rows into cache events, publishes
//! them, and only then confirms the slot's position.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwire_replication::{ReplicationConfig, SslMode, TlsConfig};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::publication::{self, Mode};
use super::slot::{self, SlotState, db};
use super::stream::{self, SQL_TIMEOUT};
use super::{CdcTable, Mapping};
use crate::error::{Error, Result};
use crate::publish::Publisher;
use crate::util::{check_duration, lock};

/// Row changes one transaction may make to one cache before the rest of
/// it reaches nodes as one clear.
const DEFAULT_MAX_ROWS_PER_TRANSACTION: usize = 10_000;
const DEFAULT_LAG_WARNING_BYTES: u64 = 1 << 30;
const DEFAULT_LAG_INTERVAL: Duration = Duration::from_secs(5);
/// How often a standby relay asks whether the slot is free.
const DEFAULT_STANDBY_RETRY: Duration = Duration::from_secs(1);
const DEFAULT_MAX_ROW_BYTES: usize = 8 << 20;
// The settings' ranges, as `CdcRelayBuilder`'s docs and design.md's limits
// table state them (tests/doc_limits.rs checks both).
const MIN_LAG_INTERVAL: Duration = Duration::from_millis(100);
const MAX_LAG_INTERVAL: Duration = Duration::from_secs(3600);
const MIN_STANDBY_RETRY: Duration = Duration::from_millis(10);
const MAX_STANDBY_RETRY: Duration = Duration::from_secs(60);
const MIN_ROW_BYTES: usize = 1 << 10;
const MAX_ROW_BYTES: usize = 1 << 30;
/// Messages the replication client reads ahead of the relay. With
/// `max_row_bytes` this bounds what it holds: 128 × 8 MiB by default.
const READ_AHEAD: usize = 128;

/// Streams committed row changes of the mapped tables out of PostgreSQL's
/// logical replication and publishes them as versioned cache events.
///
/// What it promises:
///
/// - **Every committed change, never an uncommitted one.** `pgoutput`
///   sends a transaction only once it committed; a rolled-back one is
///   never sent. Each change is published at the version of its commit
///   LSN, which only grows, so on a node an older change never lands over
///   a newer one, whatever order events arrive in.
/// - **At least once.** The slot's confirmed position moves past a
///   transaction only after the transport's publish call returned for
///   every event of it (and of all before it). A relay killed at any
///   point, a dropped connection, a restarted server: the next session
///   starts again from the confirmed position and publishes the rest
///   again; applying a change twice equals once.
/// - **Visible before published.** A transaction is published only once a
///   new snapshot sees it: a node that applied a change and then loads the
///   row reads the change (see [`CdcRelay`]'s section on loads).
/// - **One active relay per slot.** PostgreSQL lets one session stream a
///   slot. Run a second relay with the same settings as a standby: it
///   checks every second (see
///   [`standby_retry`](CdcRelayBuilder::standby_retry)) and takes over
///   once the active one's session ends, logging it at `info` and
///   counting it in [`CdcRelayStats::takeovers`]. A replaced relay needs
///   no fence: its late events carry older versions than its successor's.
/// - **A lost slot is a resync.** A slot an operator dropped, or one the
///   server invalidated because it fell more than
///   `max_slot_wal_keep_size` behind, has lost changes. The relay creates
///   the slot again, and right after it writes a logical message into the
///   log; when the stream reaches it (and every commit not yet visible
///   then is), every mapped cache is cleared at its LSN (counted in
///   [`CdcRelayStats::resyncs`], logged). A new slot starts the same way.
///   The resync is recorded as owed (in the relays' record, the comment
///   on the publication, which the relays own) before the slot is made,
///   and cleared with the message: a relay that dies in between leaves it
///   to the next relay that looks. Two relays creating the slot at once
///   resync it once; a server crash that makes the stream deliver the
///   message again does not apply it twice.
/// - **Large transactions, large rows.** Past
///   [`max_rows_per_transaction`](CdcRelayBuilder::max_rows_per_transaction)
///   row changes (10,000 by default) or 64 MiB of keys and values to one
///   cache, the rest of the transaction reaches nodes as one clear of that
///   cache at its version. A row change over
///   [`max_row_bytes`](CdcRelayBuilder::max_row_bytes) cannot be read: its
///   transaction is skipped and every mapped cache cleared in its place.
/// - **Schema changes.** Columns are read by name from the table's latest
///   shape, which the server sends after every schema change: a column
///   added is there, a dropped one reads as absent and makes a change an
///   invalidation. A mapped table renamed is no longer the mapped table:
///   its cache is cleared, with a warning, and its changes are ignored. A
///   table created under a mapped name (after a rename or a drop) is added
///   to the publication within [`lag_interval`](CdcRelayBuilder::lag_interval),
///   with a resync. A partitioned table is mapped by its own name: its
///   partitions' changes (a partition-level `TRUNCATE` included) reach its
///   cache. A message that does not decode clears every mapped cache.
/// - **What an operator does, answered.** Every
///   [`lag_interval`](CdcRelayBuilder::lag_interval) the relay checks the
///   publication and the mapped tables. A partition detached, attached or
///   dropped, or a mapped table dropped, changes the table's rows with no
///   row change in the log: its cache is resynced. The publication
///   dropped (its slot's stream then cannot go on): created again, with a
///   new slot and a resync. Altered (an operation left out, a row filter
///   or column list, `publish_via_partition_root`, a mapped table taken
///   out): set back, with a resync. Until the check, nodes may serve rows
///   such an action removed. Losing `REPLICATION` stops the relay's
///   sessions (counted in [`CdcRelayStats::failures`], retried); given
///   back, the stream goes on where it was.
///
/// **Lag.** A slot holds back the server's WAL until the relay confirms
/// it: a relay that is down or slow pins WAL and can fill the server's
/// disk. The relay reports the lag in bytes (from `pg_replication_slots`,
/// every 5 s) and seconds (the oldest unconfirmed commit, on the server's
/// clock) in [`stats`](CdcRelay::stats) and [`metrics`](CdcRelay::metrics),
/// and warns past [`lag_warning_bytes`](CdcRelayBuilder::lag_warning_bytes)
/// (1 GiB). Set `max_slot_wal_keep_size` on the server: past it, the
/// server invalidates the slot instead of filling its disk, and the relay
/// resyncs as above.
///
/// **Where to run it.** Beside the database, in a process (or on a tokio
/// runtime) of its own, not on a node's: a node applying a large clear
/// can keep a shared runtime busy for seconds (measured in
/// `docs/benchmarks/cdc.md`), and a session that sends no status for
/// `wal_sender_timeout` is ended by the server and its unconfirmed
/// transactions streamed again.
///
/// **Loads.** With [`SyncedCache::get_with`](crate::SyncedCache::get_with)
/// nothing more is needed: a load that an event overtakes is not
/// installed. With
/// [`get_with_versioned`](crate::SyncedCache::get_with_versioned), the
/// loader must return a version below every change missing from what it
/// read: [`SyncedCache::version`](crate::SyncedCache::version), read
/// *before* the reading transaction starts (0 when it is `None`). Every
/// change at or below it reached this node, so it was published, so its
/// transaction was visible before the read began. The version may be
/// older than the row (a later event for the key then applies again,
/// which is harmless); it is never newer. Feed such a cache from the
/// relay only: versions from another source mean nothing next to LSNs.
/// (`pg_current_wal_lsn()` read in the reading transaction is *not* such
/// a version: a transaction whose commit record is written but which is
/// not yet visible has a lower LSN, is missing from the read, and its
/// event would then be ignored as old.)
///
/// ```no_run
/// # use cache_sync::{SyncedCache, Table};
/// # async fn load(cache: &SyncedCache<i64, String>, pool: &sqlx::PgPool) {
/// let name = cache
///     .get_with_versioned(7, || async {
///         let version = cache.version().unwrap_or(0);
///         let name: String = sqlx::query_scalar("SELECT name FROM items WHERE id = 7")
///             .fetch_one(pool)
///             .await
///             .unwrap_or_default();
///         (name, version)
///     })
///     .await;
/// # }
/// ```
pub struct CdcRelay {
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for CdcRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CdcRelay")
            .field("slot", &self.shared.slot)
            .finish_non_exhaustive()
    }
}

/// Configures a [`CdcRelay`].
pub struct CdcRelayBuilder {
    url: String,
    publisher: Publisher,
    tables: Vec<Mapping>,
    slot: String,
    /// `None`: the slot's name.
    publication: Option<String>,
    max_rows_per_transaction: usize,
    lag_warning_bytes: u64,
    lag_interval: Duration,
    standby_retry: Duration,
    max_row_bytes: usize,
}

impl fmt::Debug for CdcRelayBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CdcRelayBuilder")
            .field("slot", &self.slot)
            .field(
                "publication",
                &self.publication.as_deref().unwrap_or(&self.slot),
            )
            .field("tables", &self.tables.len())
            .finish_non_exhaustive()
    }
}

/// The relay's counters and gauges, since it started.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct CdcRelayStats {
    /// This relay streams the slot now (not a standby, not reconnecting).
    pub active: bool,
    /// Transactions published.
    pub transactions: u64,
    /// Row changes taken from them.
    pub rows: u64,
    /// Resyncs published: clears of the mapped caches for a new or lost
    /// slot, or of a table's caches after an operator changed it (see
    /// [`CdcRelay`]).
    pub resyncs: u64,
    /// Times this relay started streaming after another relay held the slot.
    pub takeovers: u64,
    /// Sessions that ended in an error (the database or a publish failed).
    pub failures: u64,
    /// Transactions skipped, with a clear of every mapped cache in their
    /// place, because a row change was over
    /// [`max_row_bytes`](CdcRelayBuilder::max_row_bytes).
    pub skipped: u64,
    /// The slot's confirmed position (an LSN), as this relay last set it.
    pub confirmed_lsn: u64,
    /// How far the slot's confirmed position is behind the end of the
    /// log, in bytes, when last asked (`None` before the first answer).
    pub lag_bytes: Option<u64>,
    /// While this relay streams: how long ago, on the database server's
    /// clock, the oldest change it received but has not yet confirmed was
    /// committed (a resync: received); zero when it has none. It grows
    /// while a publish is stuck. What the relay has not received (it is
    /// down, or a standby, or the server is slow to send) shows in
    /// `lag_bytes` only.
    pub lag_seconds: f64,
}

pub(super) struct Shared {
    pub(super) slot: String,
    pub(super) active: AtomicBool,
    pub(super) transactions: AtomicU64,
    pub(super) rows: AtomicU64,
    pub(super) resyncs: AtomicU64,
    pub(super) takeovers: AtomicU64,
    pub(super) failures: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) confirmed: AtomicU64,
    /// `u64::MAX`: not known yet.
    pub(super) lag_bytes: AtomicU64,
    /// Microseconds since 2000-01-01 on the server's clock; 0: none.
    pub(super) oldest_pending_commit: AtomicI64,
    pub(super) server_time: AtomicI64,
}

pub(super) struct Inner {
    pub(super) shared: Arc<Shared>,
    pub(super) publication: String,
    /// The mapped tables, `(schema, table)`, sorted, each once.
    pub(super) relations: Vec<(String, String)>,
    pub(super) pool: PgPool,
    pub(super) config: ReplicationConfig,
    pub(super) publisher: Publisher,
    pub(super) tables: Vec<Mapping>,
    pub(super) max_rows_per_transaction: usize,
    pub(super) standby_retry: Duration,
}

impl CdcRelay {
    /// Configures a relay that streams the database at `url` (a
    /// `postgres://user:password@host:port/database` address; `sslmode`
    /// `disable`, `prefer`, `require`, `verify-ca` or `verify-full` and
    /// `sslrootcert` are read from its query) and publishes through
    /// `publisher`. The user needs the `REPLICATION` attribute, and to
    /// own the mapped tables (to create the publication); the server needs
    /// `wal_level = logical`.
    pub fn builder(url: impl Into<String>, publisher: Publisher) -> CdcRelayBuilder {
        CdcRelayBuilder {
            url: url.into(),
            publisher,
            tables: Vec::new(),
            slot: "cache_sync".to_owned(),
            publication: None,
            max_rows_per_transaction: DEFAULT_MAX_ROWS_PER_TRANSACTION,
            lag_warning_bytes: DEFAULT_LAG_WARNING_BYTES,
            lag_interval: DEFAULT_LAG_INTERVAL,
            standby_retry: DEFAULT_STANDBY_RETRY,
            max_row_bytes: DEFAULT_MAX_ROW_BYTES,
        }
    }

    /// The counters and gauges.
    pub fn stats(&self) -> CdcRelayStats {
        let s = &self.shared;
        let lag_bytes = s.lag_bytes.load(Ordering::Relaxed);
        let oldest = s.oldest_pending_commit.load(Ordering::Relaxed);
        let now = s.server_time.load(Ordering::Relaxed);
        let lag_micros = if oldest == 0 {
            0
        } else {
            now.saturating_sub(oldest).max(0)
        };
        CdcRelayStats {
            active: s.active.load(Ordering::Relaxed),
            transactions: s.transactions.load(Ordering::Relaxed),
            rows: s.rows.load(Ordering::Relaxed),
            resyncs: s.resyncs.load(Ordering::Relaxed),
            takeovers: s.takeovers.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            skipped: s.skipped.load(Ordering::Relaxed),
            confirmed_lsn: s.confirmed.load(Ordering::Relaxed),
            lag_bytes: (lag_bytes != u64::MAX).then_some(lag_bytes),
            #[allow(clippy::cast_precision_loss)] // microseconds: exact below 2^53
            lag_seconds: lag_micros as f64 / 1e6,
        }
    }

    /// The stats in Prometheus' text format (families
    /// `cache_sync_cdc_*`), for the service that runs the relay to serve
    /// on its own `/metrics`.
    pub fn metrics(&self) -> String {
        super::metrics::encode(&self.shared.slot, &self.stats())
    }

    /// Stops streaming and waits for the task. Events of transactions not
    /// yet confirmed are published again by the next relay on the slot.
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let task = lock(&self.task).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        self.shared.active.store(false, Ordering::Relaxed);
    }
}

impl Drop for CdcRelay {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl CdcRelayBuilder {
    /// Maps a table to a cache. Several tables may map to one cache, and
    /// one table to several caches.
    pub fn table<K, V>(mut self, table: CdcTable<K, V>) -> Self
    where
        K: serde::Serialize + 'static,
        V: serde::Serialize + 'static,
    {
        self.tables.push(table.erase());
        self
    }

    /// The replication slot's name (`cache_sync` by default; 1 to 63 bytes
    /// of a-z, 0-9 and _, as PostgreSQL requires). Relays with
    /// the same slot are one active relay and its standbys; give separate
    /// relay groups separate slots.
    pub fn slot(mut self, name: impl Into<String>) -> Self {
        self.slot = name.into();
        self
    }

    /// The publication's name (the slot's by default, so that relay groups
    /// on separate slots never share one; 1 to 63 bytes of a-z, 0-9 and _).
    /// The relay creates it, or adds the mapped tables an existing one
    /// lacks; it never removes one (a relay of another version may map
    /// it), and changes of tables it does not map are ignored. An existing
    /// one that would hide changes (one that does not publish inserts,
    /// updates, deletes and truncates, publishes via the partition root,
    /// or has a row filter or column list on a mapped table) is refused at
    /// [`start`](Self::start). The relays keep their record in its comment.
    pub fn publication(mut self, name: impl Into<String>) -> Self {
        self.publication = Some(name.into());
        self
    }

    /// Row changes one transaction may make to one cache before the rest
    /// become one clear of it (10,000; at least 1).
    pub fn max_rows_per_transaction(mut self, n: usize) -> Self {
        self.max_rows_per_transaction = n;
        self
    }

    /// Warns while the slot is more than this many bytes behind (1 GiB).
    pub fn lag_warning_bytes(mut self, bytes: u64) -> Self {
        self.lag_warning_bytes = bytes;
        self
    }

    /// How often the slot's lag is read (5 s; 100 ms to 1 h).
    pub fn lag_interval(mut self, every: Duration) -> Self {
        self.lag_interval = every;
        self
    }

    /// How often a standby asks whether the slot is free (1 s; 10 ms to
    /// 1 min).
    pub fn standby_retry(mut self, every: Duration) -> Self {
        self.standby_retry = every;
        self
    }

    /// The largest row change the relay reads, in bytes as the server
    /// sends it (8 MiB; 1 KiB to 1 GiB): what one message may make the
    /// relay allocate; the replication client reads up to 128 messages
    /// ahead, so at most 128 times this is held. A larger one cannot be read, nor the stream go on
    /// past it: its transaction is skipped, every mapped cache is cleared
    /// at its commit in its place, logged at `error` and counted in
    /// [`CdcRelayStats::skipped`].
    pub fn max_row_bytes(mut self, bytes: usize) -> Self {
        self.max_row_bytes = bytes;
        self
    }

    /// Checks the settings, creates or updates the publication, creates
    /// the slot if there is none (PostgreSQL waits for the transactions
    /// open at that moment to end), and starts the relay's task on the
    /// current tokio runtime. Fails when the
    /// database cannot be reached or refuses the publication (a user that
    /// does not own a mapped table), or a setting is out of range. Refuses
    /// ([`Error::Config`], naming the table or publication and the
    /// setting) before it touches anything: a mapped table that does not
    /// exist or is not a table; one without a replica identity, or with a
    /// partition without one (in a publication that publishes updates and
    /// deletes, PostgreSQL would refuse every `UPDATE` and `DELETE` on it);
    /// an existing publication that would hide changes (see
    /// [`publication`](Self::publication)). A slot held by another relay is
    /// not an error: this one starts as its standby.
    pub async fn start(self) -> Result<CdcRelay> {
        if self.tables.is_empty() {
            return Err(Error::Config("a CDC relay needs at least one table".into()));
        }
        check_name("slot", &self.slot)?;
        let publication = self
            .publication
            .clone()
            .unwrap_or_else(|| self.slot.clone());
        check_name("publication", &publication)?;
        if self.max_rows_per_transaction == 0 {
            return Err(Error::Config(
                "max_rows_per_transaction must be at least 1".into(),
            ));
        }
        check_duration(
            "lag_interval",
            self.lag_interval,
            MIN_LAG_INTERVAL,
            MAX_LAG_INTERVAL,
        )?;
        check_duration(
            "standby_retry",
            self.standby_retry,
            MIN_STANDBY_RETRY,
            MAX_STANDBY_RETRY,
        )?;
        if !(MIN_ROW_BYTES..=MAX_ROW_BYTES).contains(&self.max_row_bytes) {
            return Err(Error::Config(format!(
                "max_row_bytes must be {} KiB to {} GiB, not {}",
                MIN_ROW_BYTES >> 10,
                MAX_ROW_BYTES >> 30,
                self.max_row_bytes
            )));
        }
        let topic = self.publisher.topic().to_owned();
        for t in &self.tables {
            if let Some(pinned) = t.topic
                && pinned != topic
            {
                return Err(Error::Config(format!(
                    "cache {:?} is pinned to topic {pinned:?}, but the relay's publisher publishes to {topic:?}",
                    t.cache
                )));
            }
            crate::transport::names::check(crate::transport::names::NameKind::Cache, &t.cache)?;
        }
        let options: sqlx::postgres::PgConnectOptions = self
            .url
            .parse()
            .map_err(|e| Error::Config(format!("the relay's database address: {e}")))?;
        let config = replication_config(&self.url, &options, &self.slot, &publication)?
            .with_max_message_size(self.max_row_bytes);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(SQL_TIMEOUT)
            .connect_with(options.application_name(slot::APPLICATION_NAME))
            .await
            .map_err(db)?;
        let mut relations: Vec<(String, String)> = self
            .tables
            .iter()
            .map(|t| (t.schema.clone(), t.name.clone()))
            .collect();
        relations.sort();
        relations.dedup();
        // Refuses what would make the stream wrong, or the application's
        // writes fail, before anything is touched.
        publication::check(&pool, &publication, &self.slot, &relations, Mode::Start).await?;
        // Created here, so that a server without wal_level = logical or a
        // user without REPLICATION fails the start, not a task's log.
        if slot::slot_state(&pool, &self.slot).await? == SlotState::Missing {
            slot::create_slot(&pool, &publication, &self.slot, false).await?;
        }

        let shared = Arc::new(Shared {
            slot: self.slot.clone(),
            active: AtomicBool::new(false),
            transactions: AtomicU64::new(0),
            rows: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            takeovers: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            lag_bytes: AtomicU64::new(u64::MAX),
            oldest_pending_commit: AtomicI64::new(0),
            server_time: AtomicI64::new(0),
        });
        let inner = Arc::new(Inner {
            shared: Arc::clone(&shared),
            publication,
            relations,
            pool,
            config,
            publisher: self.publisher,
            tables: self.tables,
            max_rows_per_transaction: self.max_rows_per_transaction,
            standby_retry: self.standby_retry,
        });
        let (stop, stopped) = watch::channel(false);
        let lag = tokio::spawn(stream::lag_loop(
            Arc::clone(&inner),
            stopped.clone(),
            self.lag_interval,
            self.lag_warning_bytes,
        ));
        let task = tokio::spawn(async move {
            stream::run(inner, stopped).await;
            let _ = lag.await;
        });
        Ok(CdcRelay {
            shared,
            stop,
            task: Mutex::new(Some(task)),
        })
    }
}

/// Slot and publication names: what PostgreSQL reads the same quoted or
/// not. The replication command takes the publication's name inside a
/// string literal, as a list of identifiers, where anything else would
/// need quoting the client does not do.
fn check_name(what: &str, name: &str) -> Result<()> {
    let plain = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
    if name.is_empty() || name.len() > 63 || !name.chars().all(plain) {
        return Err(Error::Config(format!(
            "{what} name {name:?}: 1 to 63 bytes of a-z, 0-9 and _"
        )));
    }
    Ok(())
}

/// The replication session's settings, from the same address the SQL pool
/// uses.
fn replication_config(
    url: &str,
    options: &sqlx::postgres::PgConnectOptions,
    slot: &str,
    publication: &str,
) -> Result<ReplicationConfig> {
    use sqlx::postgres::PgSslMode;
    let bad = |why: String| Error::Config(format!("the relay's database address: {why}"));
    // Host, port, user, database and TLS mode as sqlx read them (the
    // address, then PGHOST, PGPORT, PGUSER, PGDATABASE, PGSSLMODE), so
    // both connections go to the same place the same way. sqlx does not
    // give the password back: it is read here, from the address, its
    // `password` parameter or PGPASSWORD (not ~/.pgpass).
    let parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
    if !matches!(parsed.scheme(), "postgres" | "postgresql") {
        return Err(bad(format!(
            "scheme {:?}, not postgres://",
            parsed.scheme()
        )));
    }
    // sqlx takes a mode it does not know for its default; a typo must not
    // turn verification off.
    if let Some((_, mode)) = parsed.query_pairs().find(|(k, _)| k == "sslmode")
        && !matches!(
            &*mode,
            "disable" | "allow" | "prefer" | "require" | "verify-ca" | "verify-full"
        )
    {
        return Err(bad(format!("unknown sslmode {mode:?}")));
    }
    // Read as sqlx reads it for the pool, so both connections log in with
    // the same password: the address's, %-decoded (an escape that is not
    // one stays as written), unless a `password` parameter follows (the
    // last one), then PGPASSWORD.
    let in_address = match parsed.password() {
        Some(p) => Some(
            percent_encoding::percent_decode_str(p)
                .decode_utf8()
                .map_err(|_| bad("the password is not UTF-8 once %-decoded".into()))?
                .into_owned(),
        ),
        None => None,
    };
    let in_query = parsed
        .query_pairs()
        .filter(|(k, _)| k == "password")
        .last()
        .map(|(_, v)| v.into_owned());
    let password = in_query
        .or(in_address)
        .unwrap_or_else(|| std::env::var("PGPASSWORD").unwrap_or_default());
    let host = match options.get_socket() {
        Some(dir) => dir.to_string_lossy().into_owned(),
        None => options.get_host().to_owned(),
    };
    let mut tls = TlsConfig::disabled();
    tls.mode = match options.get_ssl_mode() {
        PgSslMode::Disable => SslMode::Disable,
        PgSslMode::Allow | PgSslMode::Prefer => SslMode::Prefer,
        PgSslMode::Require => SslMode::Require,
        PgSslMode::VerifyCa => SslMode::VerifyCa,
        PgSslMode::VerifyFull => SslMode::VerifyFull,
    };
    let root = parsed
        .query_pairs()
        .find(|(k, _)| k == "sslrootcert")
        .map(|(_, v)| v.into_owned())
        .or_else(|| std::env::var("PGSSLROOTCERT").ok());
    tls.ca_pem_path = root.map(Into::into);
    let user = options.get_username().to_owned();
    let database = options.get_database().unwrap_or(&user).to_owned();
    Ok(
        ReplicationConfig::new(host, user, password, database, slot, publication)
            .with_port(options.get_port())
            .with_tls(tls)
            // The confirmed position reaches the server within 200 ms of
            // a publish: a takeover publishes again at most that much.
            .with_status_interval(Duration::from_millis(200))
            .with_wakeup_interval(Duration::from_secs(1))
            .with_buffer_size(READ_AHEAD)
            .with_application_name(slot::APPLICATION_NAME),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(url: &str) -> ReplicationConfig {
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        replication_config(url, &options, "s", "p").unwrap()
    }

    #[test]
    fn the_replication_session_goes_where_the_pool_goes() {
        let c = config("postgres://app:pa+ss%2Fw%40rd@db.example:6543/shop");
        assert_eq!(
            (&*c.host, c.port, &*c.user, &*c.password, &*c.database),
            ("db.example", 6543, "app", "pa+ss/w@rd", "shop")
        );
        // sqlx's default, not plaintext.
        assert_eq!(c.tls.mode, SslMode::Prefer);
        let c = config("postgres://u@h/d?sslmode=verify-full&sslrootcert=/ca.pem");
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(
            c.tls.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/ca.pem"))
        );
        let c = config("postgres://u@h");
        assert_eq!(c.database, "u", "no database: the user's");
        let c = config("postgres://u@h/d?sslmode=disable");
        assert_eq!(c.tls.mode, SslMode::Disable);
    }

    /// The password as sqlx's pool reads it from the same address: `%XX`
    /// decoded, a `+` kept, an escape that is not one kept as written, and
    /// one that decodes to no UTF-8 refused.
    #[test]
    fn the_password_decodes_as_the_pools_does() {
        let password = |p: &str| {
            let url = format!("postgres://u:{p}@h/d");
            let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
            replication_config(&url, &options, "s", "p").map(|c| c.password)
        };
        assert_eq!(password("a%20b+c").unwrap(), "a b+c");
        // A `password` parameter wins over the address's, the last of them.
        let url = "postgres://u:inaddress@h/d?password=first&password=la%73t";
        let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
        let c = replication_config(url, &options, "s", "p").unwrap();
        assert_eq!(c.password, "last");
        assert_eq!(password("%C3%A9").unwrap(), "\u{e9}");
        for kept in ["%", "%2", "%zz", "%+1", "a%-1"] {
            assert_eq!(password(kept).unwrap(), kept);
        }
        // sqlx refuses this address itself, before the relay reads it; the
        // relay refuses it too rather than log in with other bytes.
        assert!(
            "postgres://u:%ff@h/d"
                .parse::<sqlx::postgres::PgConnectOptions>()
                .is_err()
        );
        let options: sqlx::postgres::PgConnectOptions = "postgres://u@h/d".parse().unwrap();
        let e = replication_config("postgres://u:%ff@h/d", &options, "s", "p").unwrap_err();
        assert!(e.is_config(), "{e}");
    }
}
