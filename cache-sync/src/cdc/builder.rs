//! The relay's builder: its settings, their defaults and ranges, and the
//! start that checks them and spawns the relay's task.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;

use super::address::replication_config;
use super::publication::{self, Mode};
use super::relay::{CdcRelay, Inner};
use super::slot::{self, SlotState, db};
use super::stats::Shared;
use super::stream::SQL_TIMEOUT;
use super::{CdcTable, Mapping, session, upkeep};
use crate::error::{Error, Result};
use crate::publish::Publisher;
use crate::util::check_duration;

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
const MIN_REPORT_INTERVAL: Duration = Duration::from_millis(10);
const MAX_REPORT_INTERVAL: Duration = Duration::from_secs(3600);
const MIN_ROW_BYTES: usize = 1 << 10;
const MAX_ROW_BYTES: usize = 1 << 30;

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
    freshness_interval: Duration,
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
            // Off: a node older than the reports' wire format resyncs the
            // cache on each one, so they wait until every node is upgraded.
            freshness_interval: Duration::MAX,
        }
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

    /// How often the active relay tells nodes how far behind the database
    /// it is (never by default; 10 ms to 1 h, 250 ms a good start), so
    /// that a cache's freshness, and its
    /// [`max_staleness`](crate::SyncedCacheBuilder::max_staleness), hold
    /// against the database rather than the topic: a relay that stalls,
    /// falls behind a write storm or is cut off from its database shows
    /// on every node as a freshness that ages (see
    /// [`SyncedCacheBuilder::relayed`](crate::SyncedCacheBuilder::relayed)).
    ///
    /// Each report costs a small non-transactional logical message in the
    /// database's WAL (`pg_logical_emit_message`), and an announcement per
    /// mapped cache on the topic, which every node receives. A report's
    /// lag is known once it is acknowledged, and the next one carries it:
    /// a bound of `d` on the nodes needs reports well within `d` (their
    /// freshness is at least one interval old). Reports are in a wire
    /// format nodes older than this version do not read (they resync the
    /// cache on each): upgrade every node before turning them on.
    pub fn freshness_interval(mut self, every: Duration) -> Self {
        self.freshness_interval = every;
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
    /// [`CdcRelayStats::skipped`](crate::cdc::CdcRelayStats::skipped).
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
        if self.freshness_interval != Duration::MAX {
            check_duration(
                "freshness_interval",
                self.freshness_interval,
                MIN_REPORT_INTERVAL,
                MAX_REPORT_INTERVAL,
            )?;
        }
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
        super::check_tables(&self.publisher, &self.tables)?;
        let options: sqlx::postgres::PgConnectOptions = self
            .url
            .parse()
            .map_err(|e| Error::Config(format!("the relay's database address: {e}")))?;
        let config = replication_config(&self.url, &options, &self.slot, &publication)?
            .with_max_message_size(self.max_row_bytes);
        // The database as named in the address: every relay of a group
        // connects to the same one (PostgreSQL's default, the user's
        // name, when the address names none).
        let database = options
            .get_database()
            .map_or_else(|| options.get_username().to_owned(), str::to_owned);
        let source = super::watermark::source(&self.slot, &database);
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
            mark_failures: AtomicU64::new(0),
            confirmed: AtomicU64::new(0),
            lag_bytes: AtomicU64::new(u64::MAX),
            oldest_pending_commit: AtomicI64::new(0),
            server_time: super::stats::ServerClock::default(),
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
            freshness_interval: self.freshness_interval,
            source,
            marks: super::watermark::Marks::new(),
        });
        let (stop, stopped) = watch::channel(false);
        let lag = tokio::spawn(upkeep::lag_loop(
            Arc::clone(&inner),
            stopped.clone(),
            self.lag_interval,
            self.lag_warning_bytes,
        ));
        let task = tokio::spawn(async move {
            session::run(inner, stopped).await;
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
