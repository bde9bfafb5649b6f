//! The relay's SQL side: the publication, the slot, its lag, and whether a
//! decoded transaction is visible yet.

use std::time::Duration;

use sqlx::{PgConnection, PgPool, Row as _};

use crate::error::{Error, Result};
use crate::util::Backoff;

/// The prefix of the logical message a relay writes into the log right
/// after it created its slot: when the stream reaches it, every mapped
/// cache is cleared at its LSN. Written to the log rather than published
/// at once, so a relay that dies between creating the slot and clearing
/// leaves the clear in the slot's stream for whichever relay comes next.
pub(crate) const RESYNC_PREFIX: &str = "cache-sync.cdc.resync";

pub(crate) fn db(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::Database(e.into())
}

/// `name` as a quoted SQL identifier.
pub(crate) fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Creates the publication for `relations` (`(schema, table)`), or adds
/// those an existing one lacks; returns the relations it added. Never
/// removes a table: another relay of the group, of another version, may
/// map it. Partitions are published as their root, so a partitioned table
/// is mapped by its own name. Serialized between relays by an advisory
/// lock, so two relays starting at once do not both try to create it.
///
/// `existing_only`: add only the tables that exist now (the periodic
/// check, after a table was dropped or renamed); otherwise a mapped table
/// that does not exist is an error (the relay's start).
pub(crate) async fn ensure_publication(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    relations: &[(String, String)],
    existing_only: bool,
) -> Result<Vec<(String, String)>> {
    let quoted = |(schema, name): &(String, String)| format!("{}.{}", ident(schema), ident(name));
    let mut tx = pool.begin().await.map_err(db)?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("cache-sync cdc publication\n{publication}"))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    // Read first, and written only where it differs: the periodic check
    // runs this every few seconds, and a write would add WAL, make the
    // server send every table's shape again, and, under a synchronous
    // standby, wait for it.
    let via_root: Option<bool> =
        sqlx::query_scalar("SELECT pubviaroot FROM pg_publication WHERE pubname = $1")
            .bind(publication)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
    let added = if let Some(via_root) = via_root {
        if !via_root {
            sqlx::query(&format!(
                "ALTER PUBLICATION {} SET (publish_via_partition_root = true)",
                ident(publication)
            ))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        let members: Vec<(String, String)> = sqlx::query_as(
            "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = $1",
        )
        .bind(publication)
        .fetch_all(&mut *tx)
        .await
        .map_err(db)?;
        let mut missing = Vec::new();
        for r in relations.iter().filter(|r| !members.contains(r)) {
            if existing_only {
                let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                    .bind(quoted(r))
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db)?;
                if !exists {
                    continue;
                }
            }
            missing.push(r.clone());
        }
        if existing_only && !missing.is_empty() {
            // Their changes before now were never streamed.
            owe(&mut tx, publication, slot).await?;
        }
        for r in &missing {
            sqlx::query(&format!(
                "ALTER PUBLICATION {} ADD TABLE {}",
                ident(publication),
                quoted(r)
            ))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        missing
    } else {
        let tables = relations.iter().map(quoted).collect::<Vec<_>>().join(", ");
        sqlx::query(&format!(
            "CREATE PUBLICATION {} FOR TABLE {tables} WITH (publish_via_partition_root = true)",
            ident(publication)
        ))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
        relations.to_vec()
    };
    tx.commit().await.map_err(db)?;
    Ok(added)
}

/// What the server says of the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SlotState {
    Missing,
    /// The server invalidated it (`wal_status = 'lost'`: it fell behind
    /// `max_slot_wal_keep_size`); it can never stream again.
    Lost,
    /// Held by the walsender of this backend pid.
    Active(i32),
    Idle,
}

pub(crate) async fn slot_state(pool: &PgPool, slot: &str) -> Result<SlotState> {
    let row = sqlx::query(
        "SELECT active_pid, wal_status, plugin, database = current_database() AS here \
         FROM pg_replication_slots WHERE slot_name = $1",
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
    Ok(pid.map_or(SlotState::Idle, SlotState::Active))
}

/// The comment on the publication that says a resync is owed: written
/// (durably, in a transaction) before whatever makes it owed, and cleared
/// in the transaction that wrote the resync message, whose commit also
/// makes the message durable. Whoever finds it set writes the message: a
/// relay that dies in between leaves the debt to the next, never lost.
fn owed_comment(slot: &str) -> String {
    format!("cache-sync cdc: a resync is owed to slot {slot}")
}

/// Records that a resync is owed to `slot`, in `conn`'s transaction.
pub(crate) async fn owe(conn: &mut PgConnection, publication: &str, slot: &str) -> Result<()> {
    sqlx::query(&format!(
        "COMMENT ON PUBLICATION {} IS {}",
        ident(publication),
        literal(&owed_comment(slot))
    ))
    .execute(conn)
    .await
    .map_err(db)
    .map(drop)
}

/// Writes the resync message if one is owed to `slot`, and clears the
/// debt in the same transaction. Returns whether it wrote one.
pub(crate) async fn settle(pool: &PgPool, publication: &str, slot: &str) -> Result<bool> {
    let comment: Option<String> = sqlx::query_scalar(
        "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
    )
    .bind(publication)
    .fetch_optional(pool)
    .await
    .map_err(db)?
    .flatten();
    if comment.as_deref() != Some(owed_comment(slot).as_str()) {
        return Ok(false);
    }
    let mut tx = pool.begin().await.map_err(db)?;
    sqlx::query("SELECT pg_logical_emit_message(false, $1, $2)")
        .bind(RESYNC_PREFIX)
        .bind(slot)
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    sqlx::query(&format!(
        "COMMENT ON PUBLICATION {} IS NULL",
        ident(publication)
    ))
    .execute(&mut *tx)
    .await
    .map_err(db)?;
    tx.commit().await.map_err(db)?;
    Ok(true)
}

/// `text` as a SQL string literal.
fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Creates the slot (dropping a lost one first), with a resync owed from
/// before it, settled right after: the message lands after the slot's
/// starting point, and covers whatever was lost before it. `false`:
/// another relay created it first (its debt, recorded the same way, is
/// settled by whoever gets to it).
pub(crate) async fn create_slot(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    lost: bool,
) -> Result<bool> {
    let mut conn = pool.acquire().await.map_err(db)?;
    owe(&mut conn, publication, slot).await?;
    drop(conn);
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
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42710") => return Ok(false),
        Err(e) => return Err(db(e)),
    }
    settle(pool, publication, slot).await?;
    Ok(true)
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
