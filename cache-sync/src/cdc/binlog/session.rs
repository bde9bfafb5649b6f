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
use crate::wire::Change;
use mysql_common::io::ParseBuf;

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
/// Events handled in a row while they are ready, between two looks at a
/// stop, the upkeep and a landed flight.
const READY_EVENTS: u32 = 256;

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
/// MySQL's compressed transaction (`binlog_transaction_compression`): its
/// rows are inside, compressed; the relay refuses a server with it on, and
/// clears if it is turned on under a streaming relay.
const TRANSACTION_PAYLOAD: u8 = 40;
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
    inner: &Arc<Inner>,
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
    // The binlog's connection is opened and set up meanwhile: it needs
    // nothing the checks below find until the binlog is asked for, and the
    // round trips of both connections no longer add up before streaming
    // starts. Aborted (and the connection closed) if the session ends
    // before.
    let dump = Setup(tokio::spawn(dump_connection(inner.opts.clone())));
    let server_id = timed("checking the server", state::check_server(&mut conn)).await?;
    timed("creating the relays' table", state::create_table(&mut conn)).await?;
    let logs = timed("listing binlogs", state::binlogs(&mut conn)).await?;
    let Some((last, size)) = logs.last().cloned() else {
        return Err(db("the server lists no binlog"));
    };
    let end = Position {
        file: last,
        pos: size,
        created: 0,
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
        owner: Arc::clone(inner),
        conn: Some(conn),
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
        flight: None,
        images: Default::default(),
        // Checked against the first format description the stream sends.
        expect_created: (resync.is_none() && saved.at.created != 0).then_some(saved.at.created),
        wrong_file: None,
    };
    if let Some(version) = resync {
        for t in &inner.tables {
            stream.batch.clear(&t.cache, version);
        }
        saved.high = version;
        let lock = stream.lock.clone();
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
                state::save(stream.conn()?, name, &lock, &first),
            )
            .await?;
        }
        publish(inner, stream.batch.take()).await?;
        timed(
            "saving the position",
            state::save(stream.conn()?, name, &lock, &saved),
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
    let dump = dump.finish().await?;
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

/// A mapped table's shape, the mappings (indices into `inner.tables`) it
/// feeds, and the table map event's bytes it was read from.
#[derive(Clone)]
struct Mapped {
    shape: Arc<Shape>,
    maps: Arc<[usize]>,
    raw: Arc<[u8]>,
}

/// The binlog's connection, set up for the dump.
async fn dump_connection(opts: mysql_async::Opts) -> Result<Conn> {
    let mut dump = timed("connecting", async { Conn::new(opts).await.map_err(db) }).await?;
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
    Ok(dump)
}

/// The binlog connection's setup under way, aborted when dropped.
struct Setup(tokio::task::JoinHandle<Result<Conn>>);

impl Setup {
    async fn finish(mut self) -> Result<Conn> {
        (&mut self.0)
            .await
            .map_err(|e| db(format!("setting up the binlog connection ended: {e}")))?
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The open transaction.
struct Txn {
    version: u64,
    /// Its first event's time on the server's clock, in µs.
    time: i64,
}

/// A batch handed over: its visibility write and its publish, a task of
/// its own (on another worker, beside the stream's reading and decoding)
/// while the stream reads on. It holds the lock's connection (the
/// visibility write must be made on it) until it lands; dropped with the
/// session (a failure), it is aborted, and the next session publishes its
/// batch again from the saved position.
struct Flight {
    task: tokio::task::JoinHandle<Landed>,
    /// The end of its last transaction, confirmed once it lands (`None`
    /// when handed over inside a transaction, at a stop: the position
    /// stays where it was).
    end: Option<Position>,
    /// Its oldest transaction's time (µs, server clock), for the lag.
    oldest: i64,
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A flight that ended: the connection back, and what its visibility
/// write saved once everything in it was published.
struct Landed {
    conn: Conn,
    result: Result<Saved>,
}

struct Stream<'a> {
    inner: &'a Inner,
    /// The same, for the flights' tasks.
    owner: Arc<Inner>,
    /// The connection that holds the lock and saves the position (`None`
    /// while a flight has it).
    conn: Option<Conn>,
    lock: String,
    /// What the relays' table holds.
    saved: Saved,
    /// The end of the last transaction published (or with nothing to
    /// publish) before which nothing is left to do.
    confirmed: Position,
    /// The end of the last event read.
    at: Position,
    /// Table id → its shape and the mappings it feeds.
    shapes: HashMap<u64, Mapped>,
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
    /// The batch before this one, being made visible and published: at
    /// most one at a time, so publishes keep the binlog's order, and the
    /// relay holds at most it and the batch it gathers.
    flight: Option<Flight>,
    /// The before and after images' buffers, kept from row to row.
    images: [Image; 2],
    /// The saved position's file's creation time, until the stream's first
    /// format description is checked against it.
    expect_created: Option<u32>,
    /// Set when that check failed: the session ends as `Unreadable`.
    wrong_file: Option<crate::error::Error>,
}

impl<'a> Stream<'a> {
    /// The lock's connection, once no flight holds it.
    fn conn(&mut self) -> Result<&mut Conn> {
        self.conn
            .as_mut()
            .ok_or_else(|| db("the relay's connection is held by a publish under way"))
    }

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
                landed = Self::landing(&mut self.flight), if self.flight.is_some() => {
                    self.landed(landed)?;
                    self.hand_over_if_ready(&mut binlog);
                    continue;
                }
                event = tokio::time::timeout(SILENCE, binlog.next()) => event,
                _ = save.tick() => {
                    self.upkeep().await?;
                    self.hand_over_if_ready(&mut binlog);
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
            let mut ready = match event {
                Err(_) => return Err(db(format!("no binlog event or heartbeat for {SILENCE:?}"))),
                Ok(next) => next,
            };
            // Events already here are handled without going back to the
            // select (its timers and wakers cost more than a small event):
            // at most `READY_EVENTS` before a stop, the upkeep or a landed
            // flight is looked at again.
            let mut budget = READY_EVENTS;
            loop {
                let event = match ready {
                    None => return Err(db("the server ended the binlog stream")),
                    Some(Err(mysql_async::Error::Server(e)))
                        if e.code == ER_FATAL_READING_BINLOG =>
                    {
                        return Ok(Ended::Unreadable(db(format!(
                            "the binlog stream failed: {e}"
                        ))));
                    }
                    Some(Err(e)) => return Err(db(format!("the binlog stream failed: {e}"))),
                    Some(Ok(event)) => event,
                };
                let committed = self.event(binlog.get_ref(), &event)?;
                if let Some(e) = self.wrong_file.take() {
                    return Ok(Ended::Unreadable(e));
                }
                if committed && !self.batch.is_empty() {
                    self.batch_since
                        .get_or_insert_with(tokio::time::Instant::now);
                    if self.full() {
                        // No more is read until the flight lands: the
                        // relay holds at most two batches.
                        self.land().await?;
                        self.hand_over();
                    } else {
                        self.hand_over_if_ready(&mut binlog);
                    }
                }
                // A flight that landed meanwhile frees the publisher for the
                // batch gathered since: handed over now, not after the
                // budget.
                if self.flight.as_ref().is_some_and(|f| f.task.is_finished()) {
                    self.land().await?;
                    self.hand_over_if_ready(&mut binlog);
                }
                budget = budget.saturating_sub(1);
                if budget == 0 {
                    break;
                }
                match binlog.next().now_or_never() {
                    Some(next) => ready = next,
                    None => break,
                }
            }
        }
    }

    /// The batch reached its bounds.
    fn full(&self) -> bool {
        self.batch.rows >= BINLOG_BATCH_ROWS || self.batch.bytes >= BINLOG_BATCH_BYTES
    }

    /// Hands the batch over when no flight is under way, between
    /// transactions, and it is full, old, or the stream has nothing more
    /// ready (more already here is gathered into the same publish, within
    /// the batch's bounds).
    fn hand_over_if_ready(&mut self, binlog: &mut Peekable<BinlogStream>) {
        if self.flight.is_some() || self.txn.is_some() || self.batch.is_empty() {
            return;
        }
        let old = self
            .batch_since
            .is_some_and(|since| since.elapsed() >= BINLOG_BATCH_AGE);
        if self.full() || old {
            self.hand_over();
            return;
        }
        let more = std::pin::Pin::new(binlog)
            .peek()
            .now_or_never()
            .is_some_and(|next| next.is_some());
        if !more {
            self.hand_over();
        }
    }

    /// The flight's end, or never when there is none.
    async fn landing(flight: &mut Option<Flight>) -> Result<Landed> {
        match flight {
            Some(f) => (&mut f.task)
                .await
                .map_err(|e| db(format!("the relay's publish ended: {e}"))),
            None => std::future::pending().await,
        }
    }

    /// Waits for the flight, if one is under way, to land.
    async fn land(&mut self) -> Result<()> {
        if self.flight.is_none() {
            return Ok(());
        }
        let landed = Self::landing(&mut self.flight).await;
        self.landed(landed)
    }

    /// A flight landed: everything in it is published, and its end is
    /// confirmed (saved by the next write).
    fn landed(&mut self, landed: Result<Landed>) -> Result<()> {
        let flight = self.flight.take();
        let landed = landed?;
        self.conn = Some(landed.conn);
        self.saved = landed.result?;
        if let Some(end) = flight.and_then(|mut f| f.end.take()) {
            self.confirmed = end;
        }
        self.show_oldest();
        Ok(())
    }

    /// The lag's oldest unpublished transaction: the flight's, else the
    /// batch's.
    fn show_oldest(&self) {
        let oldest = match &self.flight {
            Some(f) if f.oldest != 0 => f.oldest,
            _ => self.oldest,
        };
        self.inner
            .shared
            .oldest_pending_commit
            .store(oldest, Ordering::Relaxed);
    }

    /// One event. `true` when it ended a transaction.
    fn event(&mut self, binlog: &BinlogStream, event: &Event) -> Result<bool> {
        let header = event.header();
        let ty = header.event_type_raw();
        let begin = self.at.pos;
        let log_pos = u64::from(header.log_pos());
        if ty == FORMAT_DESCRIPTION {
            self.described = true;
            let created = header.timestamp();
            // The first one names the file the stream began in: the saved
            // position's file, or another by the same name.
            if let Some(expected) = self.expect_created.take()
                && created != 0
                && created != expected
            {
                self.wrong_file = Some(db(format!(
                    "the binlog {} was created at {created}, and the saved position is in one created at {expected} (RESET MASTER?)",
                    self.at.file
                )));
            }
            self.at.created = created;
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
                created: 0,
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
                created: 0,
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
            t if MARIADB_COMPRESSED.contains(&t) || t == TRANSACTION_PAYLOAD => {
                if self.txn.is_none() {
                    start(self)?;
                }
                self.clear_all(
                    "a compressed event (log_bin_compress, binlog_transaction_compression), which this relay does not decode",
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
            self.show_oldest();
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
        // The same table map as before (every transaction repeats its
        // tables'): the shape read from it stands.
        if self
            .shapes
            .get(&tme.table_id())
            .is_some_and(|m| *m.raw == *event.data())
        {
            return;
        }
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
                self.shapes.insert(
                    tme.table_id(),
                    Mapped {
                        shape: Arc::new(shape),
                        maps: maps.into(),
                        raw: event.data().into(),
                    },
                );
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
        let Some(Mapped { shape, maps, .. }) = self.shapes.get(&data.table_id()).cloned() else {
            // Not a mapped table (its table map said so).
            return;
        };
        if binlog.get_tme(data.table_id()).is_none() {
            self.clear_all("a rows event without its table map");
            return;
        }
        if matches!(data, RowsEventData::PartialUpdateRowsEvent(_)) {
            self.clear_mapped(
                &maps,
                "a partial JSON update, which names a path and not the row",
            );
            return;
        }
        let version = self.version();
        let cap = self.inner.max_rows_per_transaction;
        let relation = &shape.relation;
        let before = data
            .columns_before_image()
            .map(|b| b.iter().map(|b| *b).collect::<Vec<bool>>());
        let after = data
            .columns_after_image()
            .map(|b| b.iter().map(|b| *b).collect::<Vec<bool>>());
        if usize::try_from(data.num_columns()).ok() != Some(shape.len()) {
            self.clear_mapped(&maps, "a rows event whose columns are not its table map's");
            return;
        }
        // The images' buffers, reused from row to row and event to event.
        let [mut old, mut new] = std::mem::take(&mut self.images);
        let mut rows = ParseBuf(data.rows_data());
        loop {
            // mysql_common's value decoder indexes metadata it trusts; a
            // server's garbage must not take the relay down. Each row is
            // decoded and mapped in turn: a row that fails clears the
            // caches after the rows before it, and the clear covers them.
            let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
                next_row(&shape, &before, &after, &mut rows, &mut old, &mut new)
            }));
            let (has_old, has_new) = match decoded {
                Ok(Ok(Some(images))) => images,
                Ok(Ok(None)) => break,
                Ok(Err(why)) => {
                    self.clear_mapped(&maps, &format!("a row did not decode: {why}"));
                    break;
                }
                Err(_) => {
                    self.clear_mapped(&maps, "a row's decoder panicked");
                    break;
                }
            };
            let old_tuple = has_old.then(|| old.tuple(None, b'O'));
            // An after image lacks what it did not change (MINIMAL): that
            // is the before image's value.
            let new_tuple = has_new.then(|| new.tuple(has_old.then_some(&old), b'N'));
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
        self.images = [old, new];
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

    /// Hands the committed batch over as a flight: the write that makes
    /// it visible (which also saves the confirmed position), then its
    /// publish. The caller has landed the flight before.
    fn hand_over(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            // Never: every caller lands the flight first.
            return;
        };
        let mut saved = self.saved.clone();
        saved.at = self.confirmed.clone();
        // Above every version in the batch: a transaction's is its
        // start's, plus one, and it starts before where the stream is.
        saved.high = saved.high.max(self.version_of(&self.at).unwrap_or(0));
        let transactions = self.batch.transactions;
        let rows = self.batch.rows;
        let publishes = self.batch.take();
        let inner = Arc::clone(&self.owner);
        let lock = self.lock.clone();
        let landing = async move {
            let inner = &*inner;
            let result = async {
                timed(
                    "the visibility write",
                    state::save(&mut conn, &inner.shared.slot, &lock, &saved),
                )
                .await?;
                publish(inner, publishes).await?;
                let s = &inner.shared;
                s.transactions.fetch_add(transactions, Ordering::Relaxed);
                s.rows.fetch_add(rows, Ordering::Relaxed);
                Ok(saved)
            }
            .await;
            Landed { conn, result }
        };
        self.flight = Some(Flight {
            task: tokio::spawn(landing),
            end: self.txn.is_none().then(|| self.at.clone()),
            oldest: self.oldest,
        });
        self.oldest = 0;
        self.batch_since = None;
    }

    /// Publishes everything committed and waits for it.
    async fn flush(&mut self) -> Result<()> {
        self.land().await?;
        if !self.batch.is_empty() {
            self.hand_over();
            self.land().await?;
        }
        if self.txn.is_none() {
            self.confirmed = self.at.clone();
        }
        Ok(())
    }

    /// Saves the confirmed position when other transactions moved it,
    /// and reads the lag.
    async fn upkeep(&mut self) -> Result<()> {
        // The lock's connection is the flight's until it lands.
        self.land().await?;
        if self.txn.is_none() && self.batch.is_empty() {
            self.confirmed = self.at.clone();
        }
        let name = self.inner.shared.slot.as_str();
        if self.moved && self.confirmed != self.saved.at {
            let mut saved = self.saved.clone();
            saved.at = self.confirmed.clone();
            let lock = self.lock.clone();
            timed(
                "saving the position",
                state::save(self.conn()?, name, &lock, &saved),
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
        let logs = timed("listing binlogs", state::binlogs(self.conn()?)).await?;
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

/// Publishes a batch, every cache at once. Every cache's publish is
/// awaited, failed or not, before the error ends the session: none is cut
/// off half sent.
async fn publish(inner: &Inner, publishes: Vec<(String, Vec<Change>)>) -> Result<()> {
    let publisher = &inner.publisher;
    let results =
        futures_util::future::join_all(publishes.into_iter().map(|(cache, changes)| async move {
            batch::publish(publisher, &cache, changes).await
        }))
        .await;
    for result in results {
        result?;
    }
    Ok(())
}

/// The next row of a rows event: a before image (UPDATE, DELETE), then an
/// after image (INSERT, UPDATE), as the event's column bitmaps say; which
/// of the two it had, or `None` at the event's end. Run under
/// `catch_unwind` by its callers (the relay, and the fuzz target that
/// checks it): mysql_common's value decoder indexes metadata it trusts.
pub(crate) fn next_row(
    shape: &Shape,
    before: &Option<Vec<bool>>,
    after: &Option<Vec<bool>>,
    rows: &mut ParseBuf<'_>,
    old: &mut Image,
    new: &mut Image,
) -> std::io::Result<Option<(bool, bool)>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let left = rows.0.len();
    if let Some(present) = before {
        shape.decode(Some(present), rows, &mut old.text, &mut old.cells)?;
    }
    if let Some(present) = after {
        shape.decode(Some(present), rows, &mut new.text, &mut new.cells)?;
    }
    if rows.0.len() >= left {
        // Images of no column: reading on would never end.
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a row of no bytes",
        ));
    }
    Ok(Some((before.is_some(), after.is_some())))
}

/// A row image rendered: its cells, in the table's column order, and their
/// text in one buffer, kept from row to row (no allocation per cell).
#[derive(Debug, Default)]
pub(crate) struct Image {
    pub(crate) text: Vec<u8>,
    pub(crate) cells: Vec<Cell>,
}

impl Image {
    fn datum(&self, cell: Cell) -> Datum<'_> {
        match cell {
            Cell::Absent => Datum::Unchanged,
            Cell::Null => Datum::Null,
            Cell::Text(from, to) => self
                .text
                .get(from..to)
                .map_or(Datum::Unchanged, Datum::Text),
        }
    }

    /// The image as a tuple; a cell it lacks is read from `fallback` (the
    /// before image, for an after image).
    pub(crate) fn tuple<'i>(&'i self, fallback: Option<&'i Image>, kind: u8) -> Tuple<'i> {
        let mut whole = true;
        let columns = self
            .cells
            .iter()
            .enumerate()
            .map(|(i, &cell)| match (cell, fallback) {
                (Cell::Absent, Some(f)) => {
                    let cell = f.cells.get(i).copied().unwrap_or(Cell::Absent);
                    whole &= cell != Cell::Absent;
                    f.datum(cell)
                }
                (cell, _) => {
                    whole &= cell != Cell::Absent;
                    self.datum(cell)
                }
            })
            .collect();
        Tuple {
            columns,
            // A before image without every column holds the primary key:
            // only it can be read from it.
            kind: if kind == b'O' && !whole { b'K' } else { kind },
        }
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
