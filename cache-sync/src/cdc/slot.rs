//! The relay's SQL side but the publication (`publication.rs`): the slot,
//! its lag, a partition's ancestors, and whether a decoded transaction is
//! visible yet.

use std::time::Duration;

use sqlx::{PgPool, Row as _};

use super::state;

use crate::error::{Error, Result};
use crate::util::Backoff;

/// The prefix of the logical message a relay writes into the log right
/// after it created its slot: when the stream reaches it, every mapped
/// cache is cleared at its LSN. Written to the log rather than published
/// at once, so a relay that dies between creating the slot and clearing
/// leaves the clear in the slot's stream for whichever relay comes next.
pub(crate) const RESYNC_PREFIX: &str = "cache-sync.cdc.resync";

/// The `application_name` of the relays' sessions: a slot held by a
/// session without it is read by another client.
pub(crate) const APPLICATION_NAME: &str = "cache-sync cdc";

pub(crate) fn db(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::Database(e.into())
}

/// `name` as a quoted SQL identifier.
pub(crate) fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// What the server says of the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SlotState {
    Missing,
    /// The server invalidated it (`wal_status = 'lost'`: it fell behind
    /// `max_slot_wal_keep_size`); it can never stream again.
    Lost,
    /// Held by the walsender of this backend pid; `foreign`: its client
    /// says it is not a cache-sync relay (its `application_name`).
    Active {
        pid: i32,
        foreign: Option<String>,
    },
    Idle,
}

pub(crate) async fn slot_state(pool: &PgPool, slot: &str) -> Result<SlotState> {
    let row = sqlx::query(
        "SELECT s.active_pid, s.wal_status, s.plugin, s.database = current_database() AS here, \
                a.application_name \
         FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid \
         WHERE s.slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(db)?;
    let Some(row) = row else {
        return Ok(SlotState::Missing);
    };
    let plugin: Option<String> = row.try_get("plugin").map_err(db)?;
    let here: Option<bool> = row.try_get("here").map_err(db)?;
    if plugin.as_deref() != Some("pgoutput") || here != Some(true) {
        return Err(Error::Config(format!(
            "replication slot {slot:?} exists but is not a pgoutput slot of this database"
        )));
    }
    let status: Option<String> = row.try_get("wal_status").map_err(db)?;
    if status.as_deref() == Some("lost") {
        return Ok(SlotState::Lost);
    }
    let pid: Option<i32> = row.try_get("active_pid").map_err(db)?;
    let name: Option<String> = row.try_get("application_name").map_err(db)?;
    Ok(match pid {
        None => SlotState::Idle,
        Some(pid) => SlotState::Active {
            pid,
            // Unknown (not visible to this role): taken for a relay.
            foreign: name.filter(|n| n != APPLICATION_NAME),
        },
    })
}

/// `text` as a SQL string literal.
pub(crate) fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Creates the slot (dropping a lost one first), with a resync owed from
/// before it, settled right after: the message lands after the slot's
/// starting point, and covers whatever was lost before it. `false`:
/// another relay created it first; its own debt covers the slot, and this
/// one owes nothing (see `state::owe_new_slot`), so the slot is resynced
/// once.
pub(crate) async fn create_slot(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    lost: bool,
) -> Result<bool> {
    let Some(token) = state::owe_new_slot(pool, publication, slot).await? else {
        // Another relay's slot: made, or being made, with its own debt.
        return Ok(false);
    };
    if lost {
        // Fails if another relay already dropped it: the create says who won.
        let _ = sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(slot)
            .execute(pool)
            .await;
    }
    let created =
        sqlx::query("SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')")
            .bind(slot)
            .fetch_one(pool)
            .await;
    match created {
        Ok(_) => {}
        // duplicate_object: another relay was quicker.
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => {
            state::forgive(pool, publication, slot, token).await?;
            return Ok(false);
        }
        Err(e) => return Err(db(e)),
    }
    state::settle(pool, publication, slot).await?;
    Ok(true)
}

/// The partitioned tables `relation` (an oid) is a partition of, at every
/// level, as `(schema, table)`; none for a table that is no partition, or
/// no longer exists.
pub(crate) async fn ancestors(pool: &PgPool, relation: u32) -> Result<Vec<(String, String)>> {
    sqlx::query_as(
        "SELECT n.nspname::text, c.relname::text \
         FROM pg_partition_ancestors($1::int8::oid) AS a \
         JOIN pg_class c ON c.oid = a.relid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE a.relid <> $1::int8::oid",
    )
    .bind(i64::from(relation))
    .fetch_all(pool)
    .await
    .map_err(db)
}

/// What the server says of the slot's lag.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lag {
    /// How far the confirmed position is behind the end of the log.
    pub(crate) bytes: u64,
    /// The WAL the server may still keep for the slot before invalidating
    /// it (`safe_wal_size`; `None` with `max_slot_wal_keep_size = -1`).
    pub(crate) safe_wal_size: Option<i64>,
    /// The server's clock, in microseconds since 2000-01-01 (the unit of
    /// the stream's timestamps): the lag in seconds is measured on it.
    pub(crate) server_now_us: i64,
}

pub(crate) async fn lag(pool: &PgPool, slot: &str) -> Result<Option<Lag>> {
    let row = sqlx::query(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8 AS lag, \
         safe_wal_size, \
         (extract(epoch FROM clock_timestamp() - '2000-01-01 00:00:00+00'::timestamptz) * 1000000)::int8 AS now_us \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(db)?;
    let Some(row) = row else { return Ok(None) };
    let bytes: Option<i64> = row.try_get("lag").map_err(db)?;
    Ok(Some(Lag {
        bytes: bytes.map_or(0, |l| u64::try_from(l).unwrap_or(0)),
        safe_wal_size: row.try_get("safe_wal_size").map_err(db)?,
        server_now_us: row.try_get("now_us").map_err(db)?,
    }))
}

/// Waits until every transaction of `xids` is visible to a new snapshot.
///
/// The server sends a transaction once its commit record is flushed, which
/// can come before the transaction is visible to other sessions (with a
/// synchronous standby, for as long as the standby takes to answer). A
/// node that applied a change and then loads the row must read the change:
/// so nothing is published before its transaction is visible.
pub(crate) async fn wait_visible(pool: &PgPool, xids: &[u32]) -> Result<()> {
    if xids.is_empty() {
        return Ok(());
    }
    let xids: Vec<i64> = xids.iter().map(|&x| i64::from(x)).collect();
    // A decoded xid is 32 bits, and recent: the full one is the snapshot's
    // xmax moved by the signed 32-bit distance between the two. (It may be
    // above xmax: committed, and not yet visible, is what this waits out.)
    let query = "SELECT coalesce(bool_and(pg_visible_in_snapshot( \
            greatest(m.xmax + (((x - m.low) + 6442450944) % 4294967296 - 2147483648), 0)::text::xid8, \
            m.snap)), true) \
        FROM unnest($1::int8[]) AS x, \
            (SELECT s AS snap, pg_snapshot_xmax(s)::text::int8 AS xmax, \
                    pg_snapshot_xmax(s)::text::int8 & 4294967295 AS low \
             FROM pg_current_snapshot() AS s) AS m";
    until(|| async {
        sqlx::query_scalar(query)
            .bind(&xids)
            .fetch_one(pool)
            .await
            .map_err(db)
    })
    .await
}

/// Waits until every transaction committed but not visible *now* is
/// visible. For a resync: the transactions that committed before its
/// message and are not in the slot's stream (they came before its starting
/// point) must be visible before nodes clear and load again, as for any
/// publish (see `wait_visible`). Committed is read from the commit log,
/// which a commit marks right after its record is flushed.
pub(crate) async fn wait_committed_visible(pool: &PgPool) -> Result<()> {
    let xids: Vec<String> = sqlx::query_scalar(
        "SELECT x::text FROM pg_snapshot_xip(pg_current_snapshot()) AS x \
         WHERE pg_xact_status(x) = 'committed'",
    )
    .fetch_all(pool)
    .await
    .map_err(db)?;
    if xids.is_empty() {
        return Ok(());
    }
    until(|| async {
        sqlx::query_scalar(
            "SELECT bool_and(pg_visible_in_snapshot(x::xid8, pg_current_snapshot())) \
             FROM unnest($1::text[]) AS x",
        )
        .bind(&xids)
        .fetch_one(pool)
        .await
        .map_err(db)
    })
    .await
}

/// Asks `check` until it says yes, 1 ms doubling to 100 ms between asks:
/// a commit becomes visible a moment after its record is flushed, or once
/// a synchronous standby answers. The caller bounds the wait.
async fn until<F, Fut>(mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(1), Duration::from_millis(100));
    while !check().await? {
        tokio::time::sleep(backoff.fail()).await;
    }
    Ok(())
}

/// Runs `sql`, with text parameters, until it succeeds, 10 ms doubling to
/// 500 ms between tries: for what fails while a failed session's walsender
/// still holds the slot (it lets go once it sees its connection closed).
/// The caller bounds it.
pub(crate) async fn until_done(pool: &PgPool, sql: &str, params: &[&str]) {
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(500));
    loop {
        let mut query = sqlx::query(sql);
        for p in params {
            query = query.bind(*p);
        }
        match query.execute(pool).await {
            Ok(_) => return,
            Err(e) => {
                tracing::debug!(error = %e, sql, "cdc relay: retrying");
                tokio::time::sleep(backoff.fail()).await;
            }
        }
    }
}
