//! The relay's handle: what it promises, its stats and its shutdown, and
//! the state its tasks share.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pgwire_replication::ReplicationConfig;
use sqlx::PgPool;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::Mapping;
use super::stats::Shared;
use crate::publish::Publisher;
use crate::util::lock;

#[cfg(doc)]
use super::builder::CdcRelayBuilder;
use super::stats::CdcRelayStats;

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
    pub(super) shared: Arc<Shared>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) task: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for CdcRelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CdcRelay")
            .field("slot", &self.shared.slot)
            .finish_non_exhaustive()
    }
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
    /// How often the active relay reports its lag (`watermark.rs`).
    pub(super) freshness_interval: Duration,
    /// The relay group's source, in its reports.
    pub(super) source: u64,
    /// The marks written and not yet seen on the stream.
    pub(super) marks: super::watermark::Marks,
}

impl CdcRelay {
    // `CdcRelay::builder` is in builder.rs, beside the defaults it sets.

    /// The counters and gauges.
    pub fn stats(&self) -> CdcRelayStats {
        self.shared.snapshot()
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
