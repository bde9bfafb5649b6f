//! A session's stream: what it holds, and the loop that reads the
//! replication events, gathers committed transactions and hands them on
//! (or skips one too large to read).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::FutureExt as _;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio::sync::{mpsc, watch};

use super::batch::Batch;
use super::pgoutput::Relation;
use super::publishing::{Job, Progress};
use super::relay::Inner;
use super::session::Ended;
use super::slot::{self, RESYNC_PREFIX, db};
use super::state::{self, Scope};
use super::upkeep::drop_slot;
use super::watermark::WATERMARK_PREFIX;
use crate::error::Result;

/// The longest the database may take to answer the visibility check
/// before the session is given up and started again.
pub(super) const SQL_TIMEOUT: Duration = Duration::from_secs(10);

/// The open transaction.
pub(super) struct Open {
    pub(super) version: u64,
    pub(super) xid: u32,
    /// Its commit time on the server's clock, in µs.
    pub(super) commit_time: i64,
}

pub(super) struct Stream<'a> {
    pub(super) inner: &'a Inner,
    pub(super) relations: HashMap<u32, Arc<Relation>>,
    /// Relation id → the mappings (indices into `inner.tables`) it feeds.
    pub(super) mapped: HashMap<u32, Arc<[usize]>>,
    pub(super) batch: Batch,
    pub(super) open: Option<Open>,
    /// The version of the last commit seen, for a change outside any.
    pub(super) last_commit: u64,
    /// The end of the last commit in the batch: confirmed once it is published.
    pub(super) pending_end: Option<Lsn>,
    /// The batch holds committed work.
    pub(super) committed: bool,
    /// The open transaction's changes, joining `batch` at its commit.
    pub(super) open_batch: Batch,
    /// The LSN of the newest resync message in the batch: see
    /// `slot::wait_committed_visible`, and `done`.
    pub(super) resync_at: Option<u64>,
    /// Resync messages at or below this LSN were applied already.
    pub(super) done: u64,
    /// The last position this session confirmed.
    pub(super) last_confirmed: Option<Lsn>,
    /// The publishing task's channel (`None` once the session ends).
    pub(super) jobs: Option<mpsc::Sender<Job>>,
    pub(super) progress: watch::Receiver<Progress>,
    /// Jobs handed over.
    pub(super) handed: u64,
    /// The oldest commit time of each job handed over and not yet
    /// published, in order (for the lag in seconds).
    pub(super) in_flight: VecDeque<i64>,
    /// The oldest commit time of the batch and the open transaction.
    pub(super) batch_oldest: i64,
    /// The newest freshness mark seen on the stream (`watermark.rs`):
    /// reported once the batch it joined is published.
    pub(super) watermark: Option<tokio::time::Instant>,
}

/// What the stream waits for.
enum Next {
    Event(std::result::Result<Option<ReplicationEvent>, pgwire_replication::PgWireError>),
    Progress,
    Room,
    Stop,
    TaskEnded,
}

impl Stream<'_> {
    pub(super) async fn pump(
        &mut self,
        client: &mut ReplicationClient,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Ended> {
        loop {
            // Committed work is handed over to the publishing task as soon
            // as it has room, once nothing more is ready to read (a burst
            // goes out in few publishes), and inside a transaction at once
            // (a large one takes a while to arrive).
            let mut ready = None;
            if self.committed {
                if self.open.is_none() && !self.full() {
                    ready = client.recv().now_or_never();
                }
                if ready.is_none() {
                    match self.hand_off() {
                        Some(true) => continue,
                        Some(false) => {}
                        None => return Ok(Ended::Publishing),
                    }
                }
            }
            let next = match ready {
                Some(event) => Next::Event(event),
                None => {
                    // A full batch reads no more until it is handed over:
                    // what the relay holds is bounded in bytes.
                    let reading = !(self.committed && self.full());
                    let Some(jobs) = &self.jobs else {
                        return Ok(Ended::Publishing);
                    };
                    tokio::select! {
                        biased;
                        _ = stop.changed() => Next::Stop,
                        changed = self.progress.changed() => {
                            if changed.is_ok() { Next::Progress } else { Next::TaskEnded }
                        }
                        // The permit is let go: the loop's top hands over.
                        room = jobs.reserve(), if self.committed => {
                            if room.is_ok() { Next::Room } else { Next::TaskEnded }
                        }
                        event = client.recv(), if reading => Next::Event(event),
                    }
                }
            };
            let event = match next {
                Next::Event(event) => event,
                Next::Progress => {
                    self.progressed(client);
                    continue;
                }
                Next::Room => continue,
                Next::Stop => return Ok(Ended::Stopped),
                Next::TaskEnded => return Ok(Ended::Publishing),
            };
            let event = match event {
                Ok(Some(event)) => event,
                Ok(None) => return Ok(Ended::Closed),
                Err(e) if e.is_message_too_large() => return self.skip_oversized(client, e).await,
                Err(e) if publication_gone(&e) => return Ok(Ended::PublicationGone(e.to_string())),
                Err(e) => return Err(db(e)),
            };
            let shared = &self.inner.shared;
            tracing::trace!(?event, "cdc relay: event");
            match event {
                ReplicationEvent::Begin {
                    final_lsn,
                    xid,
                    commit_time_micros,
                } => {
                    let commit_time = commit_time_micros.max(1);
                    self.open = Some(Open {
                        version: final_lsn.as_u64(),
                        xid,
                        commit_time,
                    });
                    if self.batch_oldest == 0 {
                        self.batch_oldest = commit_time;
                        self.show_oldest();
                    }
                }
                ReplicationEvent::XLogData {
                    data,
                    server_time_micros,
                    ..
                } => {
                    shared
                        .server_time
                        .fetch_max(server_time_micros, Ordering::Relaxed);
                    self.message(&data).await?;
                }
                ReplicationEvent::Message {
                    lsn,
                    prefix,
                    content,
                    transactional,
                } => {
                    // Only the relay's own, which are not transactional.
                    if prefix == WATERMARK_PREFIX && !transactional {
                        if let Some(at) = self.inner.marks.seen(&shared.slot, &content) {
                            // Everything visible before `at` came before
                            // the mark: it is in this batch or an earlier
                            // one, and is reported once published.
                            self.watermark = Some(self.watermark.map_or(at, |w| w.max(at)));
                            if self.open.is_none() {
                                self.mark_committed();
                            }
                        }
                        continue;
                    }
                    let scope = (prefix == RESYNC_PREFIX)
                        .then(|| Scope::parse(&content, &shared.slot))
                        .flatten();
                    if let Some(scope) = scope {
                        let at = lsn.as_u64();
                        if at > self.done {
                            // Read again: the relay this session took over
                            // from may have applied it since this one
                            // started.
                            let done = tokio::time::timeout(
                                SQL_TIMEOUT,
                                state::done(
                                    &self.inner.pool,
                                    &self.inner.publication,
                                    &shared.slot,
                                ),
                            )
                            .await;
                            if let Ok(Ok(done)) = done {
                                self.done = self.done.max(done);
                            }
                        }
                        if at <= self.done {
                            tracing::info!(slot = %shared.slot, lsn = %lsn, "cdc relay: a resync streamed again (the server forgot the slot's confirmed position: a crash?); it was applied before, and is not again");
                            continue;
                        }
                        tracing::info!(slot = %shared.slot, lsn = %lsn, ?scope, "cdc relay: a resync: clearing the mapped caches it covers");
                        // Pending from now (the message has no commit time).
                        if self.batch_oldest == 0 {
                            self.batch_oldest = shared.server_time.load(Ordering::Relaxed).max(1);
                            self.show_oldest();
                        }
                        self.clear_scope(&scope, at);
                        self.resync_at = Some(self.resync_at.map_or(at, |r| r.max(at)));
                        if self.open.is_none() {
                            self.mark_committed();
                        }
                    }
                }
                ReplicationEvent::Commit { end_lsn, lsn, .. } => {
                    let open = self.open.take();
                    let xid = open.as_ref().map(|o| o.xid);
                    self.last_commit = open.map_or(lsn.as_u64(), |o| o.version);
                    self.batch.absorb(&mut self.open_batch, xid);
                    self.pending_end = Some(end_lsn);
                    self.mark_committed();
                }
                ReplicationEvent::KeepAlive {
                    wal_end,
                    server_time_micros,
                    ..
                } => {
                    shared
                        .server_time
                        .fetch_max(server_time_micros, Ordering::Relaxed);
                    // Everything the server sent before this was handled:
                    // with nothing open or unpublished, its position is
                    // done, so a slot whose tables are quiet does not pin
                    // the WAL other tables write.
                    if self.open.is_none()
                        && !self.committed
                        && self.batch.is_empty()
                        && self.in_flight.is_empty()
                    {
                        self.confirm(client, wal_end);
                    }
                }
                ReplicationEvent::StoppedAt { .. } => return Ok(Ended::Closed),
            }
        }
    }

    /// A row change over `max_row_bytes` cannot be read, and the stream
    /// cannot go on past it: the session would fail on it for ever. So its
    /// transaction is skipped, and every mapped cache cleared at its commit
    /// LSN in its place (after the transaction is visible, as for any
    /// publish): the slot is advanced to just past that commit.
    async fn skip_oversized(
        &mut self,
        client: &ReplicationClient,
        e: pgwire_replication::PgWireError,
    ) -> Result<Ended> {
        let slot = &self.inner.shared.slot;
        // Outside a transaction: a huge logical message (any role may write
        // one). There is no commit to clear at and no position known to
        // skip to: the slot is dropped, and the next session creates it
        // again and resyncs, as for a lost slot.
        let Some(open) = self.open.take() else {
            tracing::error!(slot = %slot, error = %e, "cdc relay: a message outside any transaction is over max_row_bytes; dropping the slot to create it again and resync");
            if !drop_slot(self.inner).await {
                return Err(db("dropping the slot past an unreadable message timed out"));
            }
            self.inner.shared.skipped.fetch_add(1, Ordering::Relaxed);
            return Ok(Ended::Closed);
        };
        tracing::error!(slot = %slot, version = open.version, error = %e, "cdc relay: a row change is over max_row_bytes; skipping its transaction and clearing every mapped cache");
        self.open_batch.reset();
        self.clear_all(open.version);
        self.batch.xids.push(open.xid);
        self.mark_committed();
        if !self.drain(client).await {
            return Ok(Ended::Publishing);
        }
        self.inner.shared.skipped.fetch_add(1, Ordering::Relaxed);
        let to = open.version.saturating_add(1);
        let lsn = format!("{:X}/{:X}", to >> 32, to & 0xFFFF_FFFF);
        let params = [slot.as_str(), lsn.as_str()];
        let advance = slot::until_done(
            &self.inner.pool,
            "SELECT pg_replication_slot_advance($1, $2::pg_lsn)",
            &params,
        );
        tokio::time::timeout(SQL_TIMEOUT, advance)
            .await
            .map_err(|_| db("advancing the slot past a skipped transaction timed out"))?;
        Ok(Ended::Closed)
    }
}

/// Whether a session's error is PostgreSQL failing the stream because the
/// publication is missing from the catalog as of a change it decodes
/// (SQLSTATE 42704, undefined_object).
fn publication_gone(e: &pgwire_replication::PgWireError) -> bool {
    match e {
        pgwire_replication::PgWireError::Server(msg) => {
            msg.contains("SQLSTATE 42704") && msg.contains("publication")
        }
        _ => false,
    }
}
