//! The binlog relay's task: sessions one after another, each taking the
//! lock, checking the server, finding where to start, and streaming the
//! binlog into batches it publishes.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::stream::Peekable;
use futures_util::{FutureExt as _, StreamExt as _};
use mysql_async::binlog::events::{Event, EventData, RotateEvent, RowsEventData};
use mysql_async::prelude::Queryable as _;
use mysql_async::{BinlogStream, BinlogStreamRequest, Conn};
use tokio::sync::watch;

use super::super::Row;
use super::super::batch::{self, Batch};
use super::super::pgoutput::{Datum, Tuple};
use super::Inner;
use super::shape::{Cell, Shape};
use super::state::{self, Position, Saved, db};
use crate::error::Result;
use crate::util::Backoff;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The server sends a heartbeat after this long without an event.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// No event or heartbeat for this long: the connection is dead.
const SILENCE: Duration = Duration::from_secs(10);
/// The longest a statement of the relay's own may take.
const BINLOG_SQL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the position is saved when only other tables' transactions
/// moved it (so a restart does not read them all again), and the lag read.
const SAVE_EVERY: Duration = Duration::from_secs(1);
/// A batch is published once it holds this many row changes, or the
/// stream has nothing more ready.
const BINLOG_BATCH_ROWS: u64 = 50_000;
const BINLOG_BATCH_BYTES: usize = 32 << 20;
/// Nor is a batch held longer than this while other tables' changes keep
/// the stream busy.
const BINLOG_BATCH_AGE: Duration = Duration::from_millis(50);

// Event types (MySQL's and MariaDB's `Log_event_type`).
const QUERY: u8 = 2;
const ROTATE: u8 = 4;
const FORMAT_DESCRIPTION: u8 = 15;
const XID: u8 = 16;
const TABLE_MAP: u8 = 19;
const ROWS: [u8; 6] = [23, 24, 25, 30, 31, 32];
/// MySQL's partial JSON update: names a path, not the row.
const PARTIAL_UPDATE_ROWS: u8 = 39;
const MARIADB_GTID: u8 = 162;
/// Ends the group of an `XA PREPARE`d transaction (MySQL and MariaDB):
/// its rows are in the binlog, and it may still roll back.
const XA_PREPARE: u8 = 38;
/// MariaDB's compressed query and row events: not decoded here.
const MARIADB_COMPRESSED: std::ops::RangeInclusive<u8> = 165..=171;
/// The GTID event's flag: a statement committed on its own (DDL), no XID
/// follows.
const FL_STANDALONE: u8 = 1;

enum Ended {
    Standby,
    Stopped,
    /// The server cannot read the binlog at the position asked for (ERROR
    /// 1236): it is not an event's start in the file of that name (the
    /// binlogs were reset, and the new file reached past the old offset),
    /// or the file is damaged there. Asking again gets the same answer for
    /// ever, so the position is treated as lost: the next session resyncs
    /// at the binlog's end.
    Unreadable(crate::error::Error),
}

/// The server's error for a binlog it cannot read at the position a
/// replica asked for (`ER_MASTER_FATAL_ERROR_READING_BINLOG`).
const ER_FATAL_READING_BINLOG: u16 = 1236;

pub(super) async fn run(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut standby = false;
    // Set when the server could not read the saved position; cleared once
    // a session has resynced and saved a new one.
    let mut lost = false;
    loop {
        if *stop.borrow() {
            break;
        }
        let ended = tokio::select! {
            ended = session(&inner, standby, &mut lost, stop.clone()) => ended,
            _ = stop.changed() => break,
        };
        inner.shared.active.store(false, Ordering::Relaxed);
        let wait = match ended {
            Ok(Ended::Standby) => {
                if !standby {
                    tracing::info!(relay = %inner.shared.slot, "binlog relay: standby, another relay of this name is active");
                }
                standby = true;
                backoff.reset();
                inner.standby_retry
            }
            Ok(Ended::Stopped) => break,
            Ok(Ended::Unreadable(e)) => {
                standby = false;
                lost = true;
                inner.shared.failures.fetch_add(1, Ordering::Relaxed);
                let wait = backoff.fail();
                tracing::error!(relay = %inner.shared.slot, error = %e, retry_in = ?wait, "binlog relay: the server cannot read the binlog at the saved position (binlogs reset, or damaged there); changes may be lost: resyncing at the binlog's end");
                wait
            }
            Err(e) => {
                standby = false;
                inner.shared.failures.fetch_add(1, Ordering::Relaxed);
                let wait = backoff.fail();
                tracing::warn!(relay = %inner.shared.slot, error = %e, retry_in = ?wait, "binlog relay: session failed; starting again from the saved position");
                wait
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.changed() => break,
        }
    }
}

async fn timed<T>(what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(BINLOG_SQL_TIMEOUT, f)
        .await
        .map_err(|_| db(format!("{what} timed out")))?
}

async fn session(
    inner: &Inner,
    was_standby: bool,
    lost: &mut bool,
    stop: watch::Receiver<bool>,
) -> Result<Ended> {
    let name = inner.shared.slot.as_str();
    let lock = state::lock_name(name);
    let mut conn = timed("connecting", async {
        Conn::new(inner.opts.clone()).await.map_err(db)
    })
    .await?;
    if !timed("taking the lock", state::take_lock(&mut conn, &lock)).await? {
        return Ok(Ended::Standby);
    }
    let server_id = timed("checking the server", state::check_server(&mut conn)).await?;
    timed("creating the relays' table", state::create_table(&mut conn)).await?;
    let logs = timed("listing binlogs", state::binlogs(&mut conn)).await?;
    let Some((last, size)) = logs.last().cloned() else {
        return Err(db("the server lists no binlog"));
    };
    let end = Position {
        file: last,
        pos: size,
    };
    let saved = timed("reading the saved position", state::load(&mut conn, name)).await?;
    let previous = saved.clone();
    let kept = saved.as_ref().filter(|s| {
        !*lost
            && s.server_id == server_id
            && s.at.raw().is_some()
            && logs
                .iter()
                .any(|(file, size)| *file == s.at.file && s.at.pos <= *size)
    });
    let (mut saved, resync) = if let Some(s) = kept {
        (s.clone(), None)
    } else {
        let raw = end
            .raw()
            .ok_or_else(|| db(format!("a binlog name without a number: {}", end.file)))?;
        // Versions go on above every one a relay of this name may have
        // published, whatever the binlog's numbering does now.
        let high = saved.as_ref().map_or(0, |s| s.high.max(s.base));
        let base = saved.as_ref().map_or(0, |s| s.base).max(
            high.checked_add(2)
                .ok_or_else(|| db("binlog versions are exhausted"))?
                .saturating_sub(raw),
        );
        match &saved {
            None => {
                tracing::info!(relay = %name, at = ?end, "binlog relay: no saved position; starting at the binlog's end with a resync of every mapped cache");
            }
            Some(s) => {
                tracing::warn!(relay = %name, saved = ?s.at, saved_server = s.server_id, server = server_id, at = ?end, "binlog relay: the saved position is gone (binlogs purged or reset, or another server); changes were lost: starting at the binlog's end and clearing every mapped cache");
            }
        }
        let version = base
            .checked_add(raw)
            .ok_or_else(|| db("binlog versions are exhausted"))?;
        (
            Saved {
                server_id,
                at: end.clone(),
                base,
                high: version,
            },
            Some(version),
        )
    };
    inner.shared.active.store(true, Ordering::Relaxed);
    if was_standby {
        inner.shared.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(relay = %name, "binlog relay: took over");
    }
    let mut stream = Stream {
        inner,
        conn,
        lock,
        saved: saved.clone(),
        confirmed: saved.at.clone(),
        at: saved.at.clone(),
        shapes: HashMap::new(),
        batch: Batch::default(),
        open: Batch::default(),
        txn: None,
        in_transaction: false,
        standalone_next: false,
        moved: false,
        own_only: true,
        described: false,
        oldest: 0,
        batch_since: None,
    };
    if let Some(version) = resync {
        for t in &inner.tables {
            stream.batch.clear(&t.cache, version);
        }
        saved.high = version;
        // The version base and `high` the resync stands on are saved
        // before its clear is published, and the new position only after:
        // a relay that dies in between finds the old, lost position again
        // (with the raised base) and resyncs again, rather than starting
        // at the new one with the clear never sent.
        if let Some(old) = &previous {
            let first = Saved {
                server_id: old.server_id,
                at: old.at.clone(),
                base: saved.base,
                high: version,
            };
            timed(
                "saving the resync's versions",
                state::save(&mut stream.conn, name, &stream.lock, &first),
            )
            .await?;
        }
        stream.publish().await?;
        timed(
            "saving the position",
            state::save(&mut stream.conn, name, &stream.lock, &saved),
        )
        .await?;
        stream.saved = saved;
        *lost = false;
        inner.shared.resyncs.fetch_add(1, Ordering::Relaxed);
    }
    inner.shared.confirmed.store(
        stream.version_of(&stream.confirmed).unwrap_or(0),
        Ordering::Relaxed,
    );
    tracing::info!(relay = %name, at = ?stream.at, "binlog relay: streaming");
    let mut dump = timed("connecting", async {
        Conn::new(inner.opts.clone()).await.map_err(db)
    })
    .await?;
    // GTID events, not the BEGIN queries MariaDB makes up for old replicas.
    timed("setting up the dump", async {
        dump.query_drop("SET @mariadb_slave_capability = 4")
            .await
            .map_err(db)?;
        dump.query_drop(format!(
            "SET @master_heartbeat_period = {}",
            HEARTBEAT.as_nanos()
        ))
        .await
        .map_err(db)
    })
    .await?;
    let file = stream.at.file.clone();
    let request = BinlogStreamRequest::new(inner.server_id)
        .with_filename(file.as_bytes())
        .with_pos(stream.at.pos);
    let binlog = timed("requesting the binlog", async {
        dump.get_binlog_stream(request).await.map_err(db)
    })
    .await?;
    stream.pump(binlog.peekable(), stop).await
}

/// The open transaction.
struct Txn {
    version: u64,
    /// Its first event's time on the server's clock, in µs.
    time: i64,
}

struct Stream<'a> {
    inner: &'a Inner,
    /// The connection that holds the lock and saves the position.
    conn: Conn,
    lock: String,
    /// What the relays' table holds.
    saved: Saved,
    /// The end of the last transaction published (or with nothing to
    /// publish) before which nothing is left to do.
    confirmed: Position,
    /// The end of the last event read.
    at: Position,
    /// Table id → its shape and the mappings it feeds.
    shapes: HashMap<u64, (Arc<Shape>, Arc<[usize]>)>,
    /// Committed transactions not yet published.
    batch: Batch,
    /// The open transaction's changes.
    open: Batch,
    txn: Option<Txn>,
    in_transaction: bool,
    /// The GTID event said the next statement commits on its own.
    standalone_next: bool,
    /// A transaction other than the relay's own writes ended since the
    /// position was last saved.
    moved: bool,
    /// The open transaction touched only the relays' table.
    own_only: bool,
    /// A format description came: rotates after it decode whole.
    described: bool,
    /// The oldest unpublished transaction's time (µs, server clock).
    oldest: i64,
    /// When the batch got its first committed change.
    batch_since: Option<tokio::time::Instant>,
}

impl Stream<'_> {
    fn version_of(&self, at: &Position) -> Option<u64> {
        self.saved.base.checked_add(at.raw()?)
    }

    async fn pump(
        &mut self,
        mut binlog: Peekable<BinlogStream>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<Ended> {
        let mut save = tokio::time::interval(SAVE_EVERY);
        save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let event = tokio::select! {
                event = tokio::time::timeout(SILENCE, binlog.next()) => event,
                _ = save.tick() => {
                    self.upkeep().await?;
                    continue;
                }
                _ = stop.changed() => {
                    self.flush().await?;
                    self.upkeep().await?;
                    // Closed, not dropped: the server's dump thread ends
                    // now rather than at its next write, and holds no
                    // binlog back from a purge.
                    let _ = tokio::time::timeout(BINLOG_SQL_TIMEOUT, binlog.into_inner().close()).await;
                    return Ok(Ended::Stopped);
                }
            };
            let event = match event {
                Err(_) => return Err(db(format!("no binlog event or heartbeat for {SILENCE:?}"))),
                Ok(None) => return Err(db("the server ended the binlog stream")),
                Ok(Some(Err(mysql_async::Error::Server(e))))
                    if e.code == ER_FATAL_READING_BINLOG =>
                {
                    return Ok(Ended::Unreadable(db(format!(
                        "the binlog stream failed: {e}"
                    ))));
                }
                Ok(Some(Err(e))) => return Err(db(format!("the binlog stream failed: {e}"))),
                Ok(Some(Ok(event))) => event,
            };
            let committed = self.event(binlog.get_ref(), &event)?;
            if committed && !self.batch.is_empty() {
                let since = *self
                    .batch_since
                    .get_or_insert_with(tokio::time::Instant::now);
                let full = self.batch.rows >= BINLOG_BATCH_ROWS
                    || self.batch.bytes >= BINLOG_BATCH_BYTES
                    || since.elapsed() >= BINLOG_BATCH_AGE;
                // More already here: gathered into the same publish,
                // within the batch's bounds.
                let more = std::pin::Pin::new(&mut binlog)
                    .peek()
                    .now_or_never()
                    .is_some_and(|next| next.is_some());
                if full || !more {
                    self.flush().await?;
                }
            }
        }
    }

    /// One event. `true` when it ended a transaction.
    fn event(&mut self, binlog: &BinlogStream, event: &Event) -> Result<bool> {
        let header = event.header();
        let ty = header.event_type_raw();
        let begin = self.at.pos;
        let log_pos = u64::from(header.log_pos());
        if ty == FORMAT_DESCRIPTION {
            self.described = true;
        }
        if ty == ROTATE {
            if !self.described {
                // The server's made-up rotate at the stream's start names
                // the file asked for, and before a format description the
                // client leaves the checksum's bytes on its name
                // (mysql_async#189): nothing to learn.
                return Ok(false);
            }
            let rotate = event
                .read_event::<RotateEvent<'_>>()
                .map_err(|e| db(format!("a rotate event did not decode: {e}")))?;
            let next = Position {
                file: String::from_utf8_lossy(rotate.name_raw()).into_owned(),
                pos: rotate.position(),
            };
            if next.file == self.at.file {
                return Ok(false);
            }
            if next.raw() <= self.at.raw() {
                return Err(db(format!(
                    "the binlog went back from {:?} to {next:?} (RESET MASTER?)",
                    self.at
                )));
            }
            // Into the next file: the one that ended holds no more.
            self.at = next;
            self.described = false;
            return Ok(false);
        }
        if log_pos != 0 {
            self.at.pos = log_pos;
        }
        #[allow(clippy::cast_lossless)]
        let time = i64::from(header.timestamp()).saturating_mul(1_000_000);
        if time > 0 {
            self.inner.shared.server_time.store(time, Ordering::Relaxed);
        }
        let start = |s: &mut Self| -> Result<()> {
            let raw = Position {
                file: s.at.file.clone(),
                pos: begin,
            }
            .raw()
            .ok_or_else(|| {
                db(format!(
                    "a binlog position past what versions hold: {:?}",
                    s.at
                ))
            })?;
            let version = s
                .saved
                .base
                .checked_add(raw)
                .and_then(|v| v.checked_add(1))
                .ok_or_else(|| db("binlog versions are exhausted"))?;
            s.txn = Some(Txn { version, time });
            Ok(())
        };
        match ty {
            MARIADB_GTID => {
                let flags = event.data().get(12).copied().unwrap_or(0);
                start(self)?;
                self.in_transaction = flags & FL_STANDALONE == 0;
                self.standalone_next = !self.in_transaction;
                Ok(false)
            }
            QUERY => {
                let query = match event.read_data() {
                    Ok(Some(EventData::QueryEvent(q))) => q,
                    _ => {
                        if self.txn.is_none() {
                            start(self)?;
                        }
                        self.clear_all("a statement that did not decode");
                        return Ok(self.end_if_standalone());
                    }
                };
                let sql = query.query();
                let head = sql.trim_start();
                if head.eq_ignore_ascii_case("BEGIN") {
                    if self.txn.is_none() {
                        start(self)?;
                    }
                    self.in_transaction = true;
                    return Ok(false);
                }
                if head.eq_ignore_ascii_case("COMMIT") {
                    self.commit();
                    return Ok(true);
                }
                // The end of a prepared XA transaction, in a group of its
                // own. Its rows were dropped at prepare (see XA_PREPARE):
                // a commit clears every mapped cache, as the relay no
                // longer knows the keys; a rollback leaves nothing to do.
                let xa = |verb: &str| {
                    head.get(..verb.len())
                        .is_some_and(|h| h.eq_ignore_ascii_case(verb))
                };
                if xa("XA COMMIT") || xa("XA ROLLBACK") {
                    if self.txn.is_none() {
                        start(self)?;
                    }
                    if xa("XA COMMIT") {
                        self.own_only = false;
                        let version = self.version();
                        tracing::info!(relay = %self.inner.shared.slot, version, "binlog relay: a prepared XA transaction committed; clearing every mapped cache");
                        for t in &self.inner.tables {
                            self.open.clear(&t.cache, version);
                        }
                    }
                    self.commit();
                    return Ok(true);
                }
                if head.eq_ignore_ascii_case("ROLLBACK") {
                    // A non-transactional table's changes stay: they were
                    // logged as rows before it, and are published.
                    self.commit();
                    return Ok(true);
                }
                if self.txn.is_none() {
                    start(self)?;
                }
                let schema = query.schema();
                self.statement(&schema, &sql);
                Ok(self.end_if_standalone())
            }
            XID => {
                self.commit();
                Ok(true)
            }
            XA_PREPARE => {
                // Prepared, not committed: a node must never see its rows
                // (an XA ROLLBACK may follow), and readers of the database
                // do not see them either until XA COMMIT, whose clear
                // covers them. The group ends here.
                self.open = Batch::default();
                self.own_only = false;
                self.commit();
                Ok(true)
            }
            TABLE_MAP => {
                self.table_map(event);
                Ok(false)
            }
            t if ROWS.contains(&t) || t == PARTIAL_UPDATE_ROWS => {
                if self.txn.is_none() {
                    start(self)?;
                }
                self.rows(binlog, event);
                Ok(false)
            }
            t if MARIADB_COMPRESSED.contains(&t) => {
                if self.txn.is_none() {
                    start(self)?;
                }
                self.clear_all(
                    "a compressed event (log_bin_compress), which this relay does not decode",
                );
                Ok(self.end_if_standalone())
            }
            _ => Ok(false),
        }
    }

    /// A statement outside a transaction commits on its own.
    fn end_if_standalone(&mut self) -> bool {
        if self.in_transaction && !self.standalone_next {
            return false;
        }
        self.standalone_next = false;
        self.commit();
        true
    }

    fn commit(&mut self) {
        let time = self.txn.as_ref().map_or(0, |t| t.time);
        let touched = !self.open.is_empty();
        self.batch.absorb(&mut self.open, None);
        if touched && self.oldest == 0 {
            self.oldest = time;
            self.inner
                .shared
                .oldest_pending_commit
                .store(time, Ordering::Relaxed);
        }
        // Only the relay's own writes leave `moved` alone: saving the
        // position after them would write again, for ever (see `upkeep`).
        if !self.own_only {
            self.moved = true;
        }
        self.own_only = true;
        self.txn = None;
        self.in_transaction = false;
    }

    fn version(&self) -> u64 {
        self.txn.as_ref().map_or(0, |t| t.version)
    }

    fn clear_all(&mut self, why: &str) {
        let version = self.version();
        tracing::error!(relay = %self.inner.shared.slot, version, why, "binlog relay: clearing every mapped cache");
        for t in &self.inner.tables {
            self.open.clear(&t.cache, version);
        }
        self.own_only = false;
    }

    /// A statement (DDL, TRUNCATE, a statement-logged change): every
    /// mapped table it names is cleared. Names are matched as words,
    /// case-insensitively, quoted or not: a false match costs a clear,
    /// a missed one a stale cache.
    fn statement(&mut self, schema: &str, sql: &str) {
        self.own_only = false;
        let version = self.version();
        let words = words(sql);
        for t in &self.inner.tables {
            let named = words.iter().any(|w| w.eq_ignore_ascii_case(&t.name));
            if named {
                tracing::info!(relay = %self.inner.shared.slot, cache = %t.cache, table = %t.relation(), schema, version, "binlog relay: a statement names a mapped table; clearing its cache");
                self.open.clear(&t.cache, version);
            }
        }
    }

    fn table_map(&mut self, event: &Event) {
        let Ok(Some(EventData::TableMapEvent(tme))) = event.read_data() else {
            return;
        };
        let schema = tme.database_name();
        let table = tme.table_name();
        if schema == self.inner.database && table == super::state::TABLE {
            return;
        }
        self.own_only = false;
        let maps: Vec<usize> = self
            .inner
            .tables
            .iter()
            .enumerate()
            .filter(|(_, t)| t.schema == schema && t.name == table)
            .map(|(i, _)| i)
            .collect();
        if maps.is_empty() {
            self.shapes.remove(&tme.table_id());
            return;
        }
        match Shape::new(&tme) {
            Ok(shape) => {
                self.shapes
                    .insert(tme.table_id(), (Arc::new(shape), maps.into()));
            }
            Err(why) => {
                self.shapes.remove(&tme.table_id());
                let version = self.version();
                for &i in &maps {
                    let t = &self.inner.tables[i];
                    tracing::error!(relay = %self.inner.shared.slot, cache = %t.cache, why, "binlog relay: a mapped table's shape cannot be read; clearing its cache");
                    self.open.clear(&t.cache, version);
                }
            }
        }
    }

    /// A rows event of a mapped table: its row changes into the open
    /// transaction's batch.
    fn rows(&mut self, binlog: &BinlogStream, event: &Event) {
        let data = match event.read_data() {
            Ok(Some(EventData::RowsEvent(rows))) => rows,
            _ => {
                self.clear_all("a rows event that did not decode");
                return;
            }
        };
        let Some((shape, maps)) = self.shapes.get(&data.table_id()).cloned() else {
            // Not a mapped table (its table map said so).
            return;
        };
        let Some(tme) = binlog.get_tme(data.table_id()) else {
            self.clear_all("a rows event without its table map");
            return;
        };
        if matches!(data, RowsEventData::PartialUpdateRowsEvent(_)) {
            self.clear_mapped(
                &maps,
                "a partial JSON update, which names a path and not the row",
            );
            return;
        }
        // mysql_common indexes metadata it trusts; a server's garbage must
        // not take the relay down.
        let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let before = data
                .columns_before_image()
                .map(|b| b.iter().map(|b| *b).collect::<Vec<bool>>());
            let after = data
                .columns_after_image()
                .map(|b| b.iter().map(|b| *b).collect::<Vec<bool>>());
            let mut out = Vec::new();
            for row in data.rows(tme) {
                let (old, new) = row.map_err(|e| e.to_string())?;
                let old = old.map(|r| cells(&shape, before.as_deref(), &r));
                let new = new.map(|r| cells(&shape, after.as_deref(), &r));
                out.push((old, new));
            }
            Ok::<_, String>(out)
        }));
        let rows = match decoded {
            Ok(Ok(rows)) => rows,
            Ok(Err(why)) => {
                self.clear_mapped(&maps, &format!("a row did not decode: {why}"));
                return;
            }
            Err(_) => {
                self.clear_mapped(&maps, "a row's decoder panicked");
                return;
            }
        };
        let version = self.version();
        let cap = self.inner.max_rows_per_transaction;
        let relation = &shape.relation;
        for (old, new) in rows {
            let old_tuple = old.as_ref().map(|c| tuple(c, b'O'));
            // An after image lacks what it did not change (MINIMAL):
            // that is the before image's value.
            let merged = match (&old, &new) {
                (Some(old), Some(new)) => Some(
                    new.iter()
                        .zip(old)
                        .map(|(n, o)| {
                            if *n == Cell::Absent {
                                o.clone()
                            } else {
                                n.clone()
                            }
                        })
                        .collect::<Vec<Cell>>(),
                ),
                (None, Some(new)) => Some(new.clone()),
                _ => None,
            };
            let new_tuple = merged.as_ref().map(|c| tuple(c, b'N'));
            for &i in maps.iter() {
                let m = &self.inner.tables[i];
                let old_key = old_tuple
                    .as_ref()
                    .map(|t| m.mapper.key(&Row::new(relation, t, false)));
                let new_key = new_tuple
                    .as_ref()
                    .map(|t| m.mapper.key(&Row::new(relation, t, false)));
                let value = new_tuple
                    .as_ref()
                    .and_then(|t| m.mapper.value(&Row::new(relation, t, false)));
                match (old_key, new_key) {
                    // An insert.
                    (None, Some(key)) => self.key_change(i, key, value, version, cap),
                    // A delete.
                    (Some(key), None) => self.key_change(i, key, None, version, cap),
                    (Some(old), Some(new)) => {
                        if old.is_none() {
                            self.key_change(i, None, None, version, cap);
                            continue;
                        }
                        if old != new {
                            self.key_change(i, old, None, version, cap);
                        }
                        self.key_change(i, new, value, version, cap);
                    }
                    (None, None) => {}
                }
            }
        }
    }

    fn clear_mapped(&mut self, maps: &[usize], why: &str) {
        let version = self.version();
        for &i in maps {
            let t = &self.inner.tables[i];
            tracing::error!(relay = %self.inner.shared.slot, cache = %t.cache, version, why, "binlog relay: clearing the cache");
            self.open.clear(&t.cache, version);
        }
    }

    fn key_change(
        &mut self,
        mapping: usize,
        key: Option<bytes::Bytes>,
        value: Option<bytes::Bytes>,
        version: u64,
        cap: usize,
    ) {
        let inner = self.inner;
        self.open.change(
            &inner.shared.slot,
            &inner.tables[mapping],
            key,
            value,
            version,
            cap,
        );
    }

    /// Publishes the committed batch, after the write that makes it
    /// visible. Its end is then confirmed (saved by the next write).
    async fn flush(&mut self) -> Result<()> {
        if !self.batch.is_empty() {
            let mut saved = self.saved.clone();
            saved.at = self.confirmed.clone();
            // Above every version in the batch: a transaction's is its
            // start's, plus one, and it starts before where the stream is.
            saved.high = saved.high.max(self.version_of(&self.at).unwrap_or(0));
            let name = self.inner.shared.slot.as_str();
            timed(
                "the visibility write",
                state::save(&mut self.conn, name, &self.lock, &saved),
            )
            .await?;
            self.saved = saved;
            self.publish().await?;
        }
        if self.txn.is_none() {
            self.confirmed = self.at.clone();
        }
        Ok(())
    }

    /// Publishes the batch, every cache at once.
    async fn publish(&mut self) -> Result<()> {
        let transactions = self.batch.transactions;
        let rows = self.batch.rows;
        let publishes = self.batch.take();
        let publisher = &self.inner.publisher;
        let results = futures_util::future::join_all(publishes.into_iter().map(
            |(cache, changes): (String, _)| async move {
                batch::publish(publisher, &cache, changes).await
            },
        ))
        .await;
        for result in results {
            result?;
        }
        let s = &self.inner.shared;
        s.transactions.fetch_add(transactions, Ordering::Relaxed);
        s.rows.fetch_add(rows, Ordering::Relaxed);
        self.oldest = 0;
        s.oldest_pending_commit.store(0, Ordering::Relaxed);
        self.batch_since = None;
        Ok(())
    }

    /// Saves the confirmed position when other transactions moved it,
    /// and reads the lag.
    async fn upkeep(&mut self) -> Result<()> {
        if self.txn.is_none() && self.batch.is_empty() {
            self.confirmed = self.at.clone();
        }
        let name = self.inner.shared.slot.as_str();
        if self.moved && self.confirmed != self.saved.at {
            let mut saved = self.saved.clone();
            saved.at = self.confirmed.clone();
            timed(
                "saving the position",
                state::save(&mut self.conn, name, &self.lock, &saved),
            )
            .await?;
            self.saved = saved;
            self.moved = false;
        }
        self.inner.shared.confirmed.store(
            self.version_of(&self.saved.at).unwrap_or(0),
            Ordering::Relaxed,
        );
        // On the lock's connection: a relay whose connection ended (and a
        // standby may hold its lock now) stops streaming here, within a
        // second, not at its next write.
        let logs = timed("listing binlogs", state::binlogs(&mut self.conn)).await?;
        let mut behind = 0u64;
        let mut past = false;
        for (file, size) in &logs {
            if *file == self.confirmed.file {
                behind = size.saturating_sub(self.confirmed.pos);
                past = true;
            } else if past {
                behind = behind.saturating_add(*size);
            }
        }
        self.inner.shared.lag_bytes.store(behind, Ordering::Relaxed);
        Ok(())
    }
}

/// A row image's cells, in the table's column order.
fn cells(
    shape: &Shape,
    present: Option<&[bool]>,
    row: &mysql_async::binlog::row::BinlogRow,
) -> Vec<Cell> {
    let mut out = vec![Cell::Absent; shape.len()];
    let mut j = 0usize;
    for (i, cell) in out.iter_mut().enumerate() {
        let here = present.is_none_or(|p| p.get(i).copied().unwrap_or(false));
        if !here {
            continue;
        }
        if let Some(value) = row.as_ref(j) {
            *cell = shape.render(i, value);
        }
        j = j.saturating_add(1);
    }
    out
}

fn tuple(cells: &[Cell], kind: u8) -> Tuple<'_> {
    let whole = cells.iter().all(|c| *c != Cell::Absent);
    Tuple {
        columns: cells
            .iter()
            .map(|c| match c {
                Cell::Absent => Datum::Unchanged,
                Cell::Null => Datum::Null,
                Cell::Text(t) => Datum::Text(t),
            })
            .collect(),
        // A before image without every column holds the primary key:
        // only it can be read from it.
        kind: if kind == b'O' && !whole { b'K' } else { kind },
    }
}

/// The identifiers of a statement, unquoted: what a mapped table's name
/// is looked for among.
fn words(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in sql.chars() {
        if c.is_alphanumeric() || c == '_' || c == '$' || !c.is_ascii() {
            word.push(c);
        } else if !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}
