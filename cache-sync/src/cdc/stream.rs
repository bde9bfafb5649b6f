//! The relay's task: replication sessions, one after another, each
//! streaming the slot, mapping its changes and publishing them.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::FutureExt as _;
use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use tokio::sync::watch;

use super::Row;
use super::batch::Batch;
use super::pgoutput::{self, Message, Relation};
use super::publication::{self, Mode};
use super::relay::Inner;
use super::slot::{self, RESYNC_PREFIX, SlotState, db};
use super::state::{self, Scope};
use crate::error::Result;
use crate::publish::Publisher;
use crate::util::Backoff;
use crate::wire::{Change, KeyVersion};

/// Row changes, bytes of keys and values, and transactions gathered into
/// one publish at most (more wait for the next).
const MAX_BATCH_ROWS: u64 = 5_000;
const MAX_BATCH_BYTES: usize = 16 << 20;
const MAX_BATCH_TRANSACTIONS: u64 = 1_000;
/// How long committed work may wait while the relay reads the next
/// transaction (a large one takes a while to arrive) before it is
/// published on its own.
const FLUSH_WAIT: Duration = Duration::from_millis(20);
/// The longest the database may take to answer the visibility check
/// before the session is given up and started again.
pub(super) const SQL_TIMEOUT: Duration = Duration::from_secs(10);
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// How a session ended without an error.
enum Ended {
    /// Another relay streams the slot (or, `foreign`, another client).
    Standby { pid: i32, foreign: Option<String> },
    /// The server ended the stream.
    Closed,
    /// The relay was told to stop, and closed the stream.
    Stopped,
    /// The publication was dropped under the stream (see `run`).
    PublicationGone(String),
}

/// How long a stopping session waits for the client to report its last
/// confirmed position to the server (it does so every 200 ms), so the
/// next relay does not publish it again.
const FEEDBACK_GRACE: Duration = Duration::from_secs(1);

/// How long a stopping relay waits for its session to close the stream
/// (a publish under way finishes first) before dropping it.
const STOP_GRACE: Duration = Duration::from_secs(5);

pub(super) async fn run(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut standby_of: Option<i32> = None;
    // A client that is not a relay held the slot: what it confirmed never
    // reached nodes, so a resync is owed once the slot is free again.
    let after_foreign = AtomicBool::new(false);
    loop {
        if *stop.borrow() {
            break;
        }
        let mut session = std::pin::pin!(session(
            &inner,
            standby_of.is_some(),
            &after_foreign,
            stop.clone()
        ));
        let ended = tokio::select! {
            ended = &mut session => ended,
            _ = stop.changed() => {
                // The session sees the stop too, at its next read, and
                // closes the stream, so the slot is free for the next relay
                // when `shutdown` returns.
                let _ = tokio::time::timeout(STOP_GRACE, &mut session).await;
                break;
            }
        };
        inner.shared.active.store(false, Ordering::Relaxed);
        let wait = match ended {
            Ok(Ended::Standby { pid, foreign }) => {
                if let Some(client) = foreign {
                    if !after_foreign.load(Ordering::Relaxed) || standby_of != Some(pid) {
                        tracing::error!(slot = %inner.shared.slot, pid, client, "cdc relay: the slot is read by a client that is not a cache-sync relay: the changes it confirms never reach nodes; every mapped cache is resynced once the relay has the slot back");
                    }
                    after_foreign.store(true, Ordering::Relaxed);
                } else if standby_of.is_none() {
                    tracing::info!(slot = %inner.shared.slot, pid, "cdc relay: standby, another session streams the slot");
                }
                standby_of = Some(pid);
                backoff.reset();
                inner.standby_retry
            }
            Ok(Ended::Closed) => {
                standby_of = None;
                backoff.fail()
            }
            Ok(Ended::Stopped) => break,
            Ok(Ended::PublicationGone(why)) => {
                // pgoutput reads the publication as the catalog was at each
                // change: past the drop, this slot's stream fails for ever,
                // whatever is created since. Only a new slot goes on, and
                // what the old one could not stream is resynced.
                standby_of = None;
                inner.shared.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(slot = %inner.shared.slot, error = %why, "cdc relay: the publication was dropped under the stream, which cannot go past the drop; creating the publication again, and the slot anew with a resync");
                check_publication(&inner).await;
                drop_slot(&inner).await;
                backoff.fail()
            }
            Err(e) => {
                standby_of = None;
                inner.shared.failures.fetch_add(1, Ordering::Relaxed);
                let wait = backoff.fail();
                tracing::warn!(slot = %inner.shared.slot, error = %e, retry_in = ?wait, "cdc relay: session failed; starting again from the confirmed position");
                wait
            }
        };
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            _ = stop.changed() => break,
        }
    }
}

/// One replication session: from taking the slot to losing it.
async fn session(
    inner: &Inner,
    was_standby: bool,
    after_foreign: &AtomicBool,
    mut stop: watch::Receiver<bool>,
) -> Result<Ended> {
    let slot = &inner.shared.slot;
    match slot::slot_state(&inner.pool, slot).await? {
        SlotState::Active { pid, foreign } => return Ok(Ended::Standby { pid, foreign }),
        SlotState::Missing => {
            tracing::warn!(slot = %slot, "cdc relay: the slot is gone (dropped?); creating it again and clearing every mapped cache");
            // A slot streams through the publication: put it back first
            // if it went too.
            check_publication(inner).await;
            slot::create_slot(&inner.pool, &inner.publication, slot, false).await?;
        }
        SlotState::Lost => {
            tracing::warn!(slot = %slot, "cdc relay: the server invalidated the slot (max_slot_wal_keep_size); creating it again and clearing every mapped cache");
            check_publication(inner).await;
            slot::create_slot(&inner.pool, &inner.publication, slot, true).await?;
        }
        SlotState::Idle => {
            if after_foreign.load(Ordering::Relaxed) {
                // Owed now the other client let go: the message lands after
                // whatever it confirmed.
                state::owe(&inner.pool, &inner.publication, slot, None).await?;
                after_foreign.store(false, Ordering::Relaxed);
            }
        }
    }
    // A debt a relay left when it died (after creating the slot, say).
    state::settle(&inner.pool, &inner.publication, slot).await?;
    // Resyncs this slot already applied: streamed again after a server
    // crash forgot the slot's confirmed position, they are not applied
    // twice.
    let done = state::done(&inner.pool, &inner.publication, slot).await?;
    let mut client = ReplicationClient::connect(inner.config.clone())
        .await
        .map_err(db)?;
    if let Err(e) = client.wait_started().await {
        // Most often another relay took the slot between the check and
        // the start: that is standing by, not a failure.
        if let Ok(SlotState::Active { pid, foreign }) = slot::slot_state(&inner.pool, slot).await {
            return Ok(Ended::Standby { pid, foreign });
        }
        return Err(db(e));
    }
    inner.shared.active.store(true, Ordering::Relaxed);
    if was_standby {
        inner.shared.takeovers.fetch_add(1, Ordering::Relaxed);
        tracing::info!(slot = %slot, "cdc relay: took over the slot");
    } else {
        tracing::info!(slot = %slot, "cdc relay: streaming the slot");
    }
    let mut stream = Stream {
        inner,
        relations: HashMap::new(),
        mapped: HashMap::new(),
        batch: Batch::default(),
        open: None,
        last_commit: 0,
        pending_end: None,
        committed: false,
        committed_since: None,
        open_batch: Batch::default(),
        resync_at: None,
        done,
        last_confirmed: None,
    };
    let result = stream.pump(&mut client, &mut stop).await;
    let last_confirmed = stream.last_confirmed;
    // What it held is given up: the next session receives it again.
    inner
        .shared
        .oldest_pending_commit
        .store(0, Ordering::Relaxed);
    if matches!(result, Ok(Ended::Stopped)) {
        // The client reports the confirmed position every 200 ms, and not
        // on its way out: wait for the last one to be sent, or the next
        // relay would publish it all again (and apply a resync twice).
        if let Some(lsn) = last_confirmed {
            let metrics = client.metrics();
            let _ = tokio::time::timeout(FEEDBACK_GRACE, async {
                while metrics.last_applied_lsn() < lsn {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
            .await;
        }
        // CopyDone, and the worker's end: the connection is closed when
        // this returns.
        let _ = tokio::time::timeout(STOP_GRACE, client.shutdown()).await;
    } else {
        client.stop();
    }
    result
}

/// The open transaction.
struct Open {
    version: u64,
    xid: u32,
}

struct Stream<'a> {
    inner: &'a Inner,
    relations: HashMap<u32, Arc<Relation>>,
    /// Relation id → the mappings (indices into `inner.tables`) it feeds.
    mapped: HashMap<u32, Arc<[usize]>>,
    batch: Batch,
    open: Option<Open>,
    /// The version of the last commit seen, for a change outside any.
    last_commit: u64,
    /// The end of the last commit in the batch: confirmed once it is published.
    pending_end: Option<Lsn>,
    /// The batch holds committed work.
    committed: bool,
    /// Since when.
    committed_since: Option<tokio::time::Instant>,
    /// The open transaction's changes, joining `batch` at its commit.
    open_batch: Batch,
    /// The LSN of the newest resync message in the batch: see
    /// `slot::wait_committed_visible`, and `done`.
    resync_at: Option<u64>,
    /// Resync messages at or below this LSN were applied already.
    done: u64,
    /// The last position this session confirmed.
    last_confirmed: Option<Lsn>,
}

impl Stream<'_> {
    async fn pump(
        &mut self,
        client: &mut ReplicationClient,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Ended> {
        loop {
            // Committed work waits while more is ready (so that a burst
            // goes out in few publishes), and is flushed before waiting.
            let event = if self.open.is_none() && self.committed {
                match client.recv().now_or_never() {
                    Some(event) => event,
                    None => {
                        self.flush(client).await?;
                        continue;
                    }
                }
            } else if self.committed {
                // Inside a transaction, with committed work waiting.
                let now = tokio::time::Instant::now();
                let since = *self.committed_since.get_or_insert(now);
                let due = since.checked_add(FLUSH_WAIT).unwrap_or(now);
                tokio::select! {
                    event = client.recv() => event,
                    () = tokio::time::sleep_until(due) => {
                        self.flush(client).await?;
                        continue;
                    }
                    _ = stop.changed() => return Ok(Ended::Stopped),
                }
            } else {
                tokio::select! {
                    event = client.recv() => event,
                    _ = stop.changed() => return Ok(Ended::Stopped),
                }
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
                    self.open = Some(Open {
                        version: final_lsn.as_u64(),
                        xid,
                    });
                    let _ = shared.oldest_pending_commit.compare_exchange(
                        0,
                        commit_time_micros.max(1),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
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
                    ..
                } => {
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
                        let now = shared.server_time.load(Ordering::Relaxed).max(1);
                        let _ = shared.oldest_pending_commit.compare_exchange(
                            0,
                            now,
                            Ordering::Relaxed,
                            Ordering::Relaxed,
                        );
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
                    if self.batch.rows >= MAX_BATCH_ROWS
                        || self.batch.bytes >= MAX_BATCH_BYTES
                        || self.batch.transactions >= MAX_BATCH_TRANSACTIONS
                    {
                        self.flush(client).await?;
                    }
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
                    if self.open.is_none() && !self.committed && self.batch.is_empty() {
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
        self.flush(client).await?;
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

    fn mark_committed(&mut self) {
        self.committed = true;
        self.committed_since
            .get_or_insert_with(tokio::time::Instant::now);
    }

    /// Where a change goes: the open transaction's batch, or, outside one
    /// (a resync message), the committed batch.
    fn gather(&mut self) -> &mut Batch {
        if self.open.is_some() {
            &mut self.open_batch
        } else {
            &mut self.batch
        }
    }

    fn version(&self) -> u64 {
        self.open.as_ref().map_or(self.last_commit, |o| o.version)
    }

    fn clear_all(&mut self, version: u64) {
        self.clear_scope(&Scope::All, version);
    }

    /// Clears the caches of the mapped tables `scope` covers.
    fn clear_scope(&mut self, scope: &Scope, version: u64) {
        let inner = self.inner;
        for t in &inner.tables {
            let covered = match scope {
                Scope::All => true,
                Scope::Tables(tables) => tables.iter().any(|(s, n)| *s == t.schema && *n == t.name),
            };
            if covered {
                self.gather().clear(&t.cache, version);
            }
        }
    }

    async fn message(&mut self, data: &[u8]) -> Result<()> {
        let version = self.version();
        let message = match pgoutput::decode(data) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(slot = %self.inner.shared.slot, error = %e, "cdc relay: a change did not decode; clearing every mapped cache");
                self.clear_all(version);
                return Ok(());
            }
        };
        let cap = self.inner.max_rows_per_transaction;
        match message {
            Message::Relation(relation) => self.relation(relation, version).await?,
            Message::Insert { relation, new } => {
                let Some((rel, maps)) = self.lookup(relation) else {
                    return Ok(());
                };
                for &i in maps.iter() {
                    let m = &self.inner.tables[i];
                    let key = m.mapper.key(&Row::new(&rel, &new, false));
                    let value = m.mapper.value(&Row::new(&rel, &new, false));
                    self.key_change(i, key, value, version, cap);
                }
            }
            Message::Update { relation, old, new } => {
                let Some((rel, maps)) = self.lookup(relation) else {
                    return Ok(());
                };
                for &i in maps.iter() {
                    let m = &self.inner.tables[i];
                    // Without an old row the identity did not change: the
                    // key, read from the identity columns only, is the old
                    // one too.
                    let new_key = m.mapper.key(&Row::new(
                        &rel,
                        &new,
                        old.is_none() && rel.replica_identity != b'f',
                    ));
                    if let Some(old) = &old {
                        let old_key = m.mapper.key(&Row::new(&rel, old, false));
                        match (&old_key, &new_key) {
                            (Some(o), Some(n)) if o != n => {
                                self.key_change(i, old_key.clone(), None, version, cap);
                            }
                            (None, _) => {
                                self.key_change(i, None, None, version, cap);
                                continue;
                            }
                            _ => {}
                        }
                    }
                    let value = m
                        .mapper
                        .value(&Row::new(&rel, &new, false).with_before(old.as_ref()));
                    self.key_change(i, new_key, value, version, cap);
                }
            }
            Message::Delete { relation, old } => {
                let Some((rel, maps)) = self.lookup(relation) else {
                    return Ok(());
                };
                for &i in maps.iter() {
                    let key = self.inner.tables[i]
                        .mapper
                        .key(&Row::new(&rel, &old, false));
                    self.key_change(i, key, None, version, cap);
                }
            }
            Message::Truncate { relations } => {
                for id in relations {
                    for &i in self.mapped.get(&id).cloned().as_deref().unwrap_or_default() {
                        let cache = self.inner.tables[i].cache.clone();
                        self.gather().clear(&cache, version);
                    }
                }
            }
            Message::Other(_) => {}
        }
        Ok(())
    }

    /// The relation's shape and mappings: shared, not copied, per change.
    fn lookup(&self, relation: u32) -> Option<(Arc<Relation>, Arc<[usize]>)> {
        let maps = self.mapped.get(&relation)?;
        if maps.is_empty() {
            return None;
        }
        Some((Arc::clone(self.relations.get(&relation)?), Arc::clone(maps)))
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
        let m = &inner.tables[mapping];
        match key {
            Some(key) => {
                if self.gather().key(&m.cache, key, value, version, cap) {
                    tracing::info!(cache = %m.cache, version, cap, "cdc relay: a transaction changed more rows of the table than the cap; clearing the cache instead");
                }
            }
            None => {
                tracing::warn!(cache = %m.cache, table = %m.relation(), version, "cdc relay: a change's key could not be read from its row (a key outside the replica identity?); clearing the cache");
                self.gather().clear(&m.cache, version);
            }
        }
    }

    /// A table's (new) shape. It feeds the mappings of its own name, and
    /// those of the partitioned tables it is a partition of: with
    /// `publish_via_partition_root` off, a partition's changes come under
    /// its own name. Its ancestors are read from the catalog as it is now
    /// (the stream does not carry them): a change of a partition since
    /// detached is then not mapped, and the detach's resync, later in the
    /// stream, covers it.
    async fn relation(&mut self, relation: Relation, version: u64) -> Result<()> {
        let ancestors =
            tokio::time::timeout(SQL_TIMEOUT, slot::ancestors(&self.inner.pool, relation.id))
                .await
                .map_err(|_| db("reading a table's partition ancestors timed out"))??;
        let maps: Vec<usize> = self
            .inner
            .tables
            .iter()
            .enumerate()
            .filter(|(_, t)| {
                (t.schema == relation.schema && t.name == relation.name)
                    || ancestors
                        .iter()
                        .any(|(s, n)| *s == t.schema && *n == t.name)
            })
            .map(|(i, _)| i)
            .collect();
        if let Some(before) = self.mapped.get(&relation.id) {
            for &i in before.iter() {
                if !maps.contains(&i) {
                    let t = &self.inner.tables[i];
                    tracing::warn!(cache = %t.cache, table = %t.relation(), now = %format_args!("{}.{}", relation.schema, relation.name), "cdc relay: a mapped table (or a partition of one) was renamed or detached; clearing its cache and no longer following it");
                    let cache = t.cache.clone();
                    self.batch.clear(&cache, version);
                }
            }
        }
        if maps.is_empty() && !self.mapped.contains_key(&relation.id) {
            // In the publication (another relay of the group maps it, or it
            // was renamed), not mapped here.
            tracing::info!(table = %format_args!("{}.{}", relation.schema, relation.name), "cdc relay: changes of a table this relay does not map are ignored");
        }
        self.mapped.insert(relation.id, maps.into());
        self.relations.insert(relation.id, Arc::new(relation));
        Ok(())
    }

    fn confirm(&mut self, client: &ReplicationClient, lsn: Lsn) {
        client.update_applied_lsn(lsn);
        self.last_confirmed = Some(self.last_confirmed.map_or(lsn, |l| l.max(lsn)));
        self.inner
            .shared
            .confirmed
            .fetch_max(lsn.as_u64(), Ordering::Relaxed);
    }

    /// Publishes the batch, then confirms the slot up to its last commit.
    async fn flush(&mut self, client: &ReplicationClient) -> Result<()> {
        let inner = self.inner;
        let transactions = self.batch.transactions;
        let rows = self.batch.rows;
        let xids = std::mem::take(&mut self.batch.xids);
        let publishes = self.batch.take();
        if !publishes.is_empty() {
            tokio::time::timeout(SQL_TIMEOUT, slot::wait_visible(&inner.pool, &xids))
                .await
                .map_err(|_| db("the visibility check timed out"))??;
        }
        let resync = self.resync_at.take();
        if resync.is_some() {
            tokio::time::timeout(SQL_TIMEOUT, slot::wait_committed_visible(&inner.pool))
                .await
                .map_err(|_| db("the visibility check timed out"))??;
        }
        for (cache, changes) in publishes {
            publish(&inner.publisher, &cache, changes).await?;
        }
        if let Some(at) = resync {
            // Recorded before the position is confirmed: a server crash
            // that forgets the confirmation streams the message again, and
            // this says it was applied. Failing to record it costs a second
            // clear at worst.
            let marked = tokio::time::timeout(
                SQL_TIMEOUT,
                state::mark_done(&inner.pool, &inner.publication, &inner.shared.slot, at),
            )
            .await;
            if !matches!(marked, Ok(Ok(()))) {
                tracing::warn!(slot = %inner.shared.slot, "cdc relay: recording a resync as applied failed; a server crash may apply it again");
            }
            self.done = self.done.max(at);
            // Counted once published: a session that fails before leaves
            // it to the next, which publishes (and counts) it.
            inner.shared.resyncs.fetch_add(1, Ordering::Relaxed);
        }
        inner
            .shared
            .transactions
            .fetch_add(transactions, Ordering::Relaxed);
        inner.shared.rows.fetch_add(rows, Ordering::Relaxed);
        if let Some(end) = self.pending_end.take() {
            self.confirm(client, end);
        }
        self.committed = false;
        self.committed_since = None;
        inner
            .shared
            .oldest_pending_commit
            .store(0, Ordering::Relaxed);
        Ok(())
    }
}

/// Publishes one cache's changes. An entry that can never fit the
/// publisher's size limit is sent as an invalidation of its own key, and a
/// key that cannot fit either as a clear: never dropped, and never more
/// than that entry made an invalidation (the others of its change go as
/// they are).
async fn publish(publisher: &Publisher, cache: &str, changes: Vec<Change>) -> Result<()> {
    let mut split = Vec::new();
    // A clear in place of keys that fit in no form, at their newest version.
    let mut fallback: Option<Option<u64>> = None;
    let mut clear_at = |version: Option<u64>| {
        tracing::warn!(
            cache,
            "cdc relay: a key is over the event size limit; clearing the cache instead"
        );
        fallback = Some(fallback.flatten().max(version));
    };
    for change in changes {
        match publisher.resplit(change.clone()) {
            Ok(parts) => split.extend(parts),
            Err(e) if e.is_too_large() => match change {
                Change::Refresh { entries } => {
                    let mut fit = Vec::new();
                    let mut keys = Vec::new();
                    for entry in entries {
                        let key = KeyVersion {
                            key: entry.key.clone(),
                            version: entry.version,
                        };
                        let version = entry.version;
                        let one = Change::Refresh {
                            entries: vec![entry],
                        };
                        if publisher.resplit(one.clone()).is_ok() {
                            let Change::Refresh { entries } = one else {
                                unreachable!("built above")
                            };
                            fit.extend(entries);
                        } else if fits_invalidation(publisher, &key) {
                            tracing::warn!(
                                cache,
                                "cdc relay: an entry is over the event size limit; invalidating its key instead"
                            );
                            keys.push(key);
                        } else {
                            clear_at(version);
                        }
                    }
                    split.extend(publisher.resplit(Change::Invalidate { keys })?);
                    split.extend(publisher.resplit(Change::Refresh { entries: fit })?);
                }
                Change::Invalidate { keys } => {
                    let mut fit = Vec::new();
                    for key in keys {
                        if fits_invalidation(publisher, &key) {
                            fit.push(key);
                        } else {
                            clear_at(key.version);
                        }
                    }
                    split.extend(publisher.resplit(Change::Invalidate { keys: fit })?);
                }
                // A clear carries no key: it always fits.
                Change::Clear { version } => clear_at(version),
            },
            Err(e) => return Err(e),
        }
    }
    if let Some(version) = fallback {
        split.insert(0, Change::Clear { version });
    }
    publisher
        .send(cache, crate::wire::Outgoing::from_changes(split))
        .await
        .map(|_| ())
}

fn fits_invalidation(publisher: &Publisher, key: &KeyVersion) -> bool {
    publisher
        .resplit(Change::Invalidate {
            keys: vec![key.clone()],
        })
        .is_ok()
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

/// Drops the slot (if it is still there), for the next session to create
/// it anew with a resync; retried while a failed session's walsender still
/// holds it. `false`: it could not be dropped within the SQL timeout.
async fn drop_slot(inner: &Inner) -> bool {
    let params = [inner.shared.slot.as_str()];
    let dropped = slot::until_done(
        &inner.pool,
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
        &params,
    );
    tokio::time::timeout(SQL_TIMEOUT, dropped).await.is_ok()
}

pub(super) async fn lag_loop(
    inner: Arc<Inner>,
    mut stop: watch::Receiver<bool>,
    every: Duration,
    warn_over: u64,
) {
    let mut warned = false;
    loop {
        match tokio::time::timeout(SQL_TIMEOUT, slot::lag(&inner.pool, &inner.shared.slot)).await {
            Ok(Ok(Some(lag))) => {
                let bytes = lag.bytes;
                inner.shared.lag_bytes.store(bytes, Ordering::Relaxed);
                // The server's clock, like the commit times it is
                // compared with: the lag in seconds grows while the relay
                // is stuck, whatever the stream says.
                inner
                    .shared
                    .server_time
                    .fetch_max(lag.server_now_us, Ordering::Relaxed);
                if bytes > warn_over {
                    if !warned {
                        tracing::warn!(slot = %inner.shared.slot, lag_bytes = bytes, safe_wal_size = ?lag.safe_wal_size, "cdc relay: the slot is far behind and pins the server's WAL");
                    }
                    warned = true;
                } else {
                    warned = false;
                }
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "cdc relay: reading the slot's lag failed"),
            Err(_) => tracing::debug!("cdc relay: reading the slot's lag timed out"),
        }
        check_publication(&inner).await;
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The periodic check of the publication and the mapped tables (see
/// `publication`): what an operator changed is put back, with the resync
/// it calls for owed; then any resync owed is settled.
async fn check_publication(inner: &Inner) {
    let slot = &inner.shared.slot;
    let checked = tokio::time::timeout(SQL_TIMEOUT, async {
        let changed = publication::check(
            &inner.pool,
            &inner.publication,
            slot,
            &inner.relations,
            Mode::Running,
        )
        .await?;
        if !changed.is_empty() {
            tracing::warn!(slot = %slot, publication = %inner.publication, ?changed, "cdc relay: the publication or a mapped table changed under the relay; resyncing what it may have hidden");
        }
        state::settle(&inner.pool, &inner.publication, slot).await
    })
    .await;
    match checked {
        Ok(Ok(_)) => {}
        // An operator action goes unanswered until the check passes: say so.
        Ok(Err(e)) => {
            tracing::warn!(slot = %slot, error = %e, "cdc relay: checking the publication and the mapped tables failed")
        }
        Err(_) => {
            tracing::warn!(slot = %slot, "cdc relay: checking the publication and the mapped tables timed out")
        }
    }
}
