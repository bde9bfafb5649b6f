//! What a binlog relay keeps in the database: its position and version
//! base (the relays' table), and the lock that makes one relay of a name
//! the active one. Every write checks, in the same statement, that this
//! connection still holds the lock: a relay whose connection ended (and
//! whose lock a standby may hold now) cannot move the position.

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};

use crate::error::{Error, Result};

pub(super) const TABLE: &str = "cache_sync_binlog_relays";

pub(super) fn db(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    Error::Database(e.into())
}

/// A position in the binlog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Position {
    pub(super) file: String,
    pub(super) pos: u64,
    /// When the file was created: its format description's timestamp
    /// (seconds, the server's clock); 0 while not known. A file's name
    /// alone does not name it: after `RESET MASTER` the server writes a
    /// new `binlog.000001`, and an offset saved in the old one may be an
    /// event's start in the new one too.
    pub(super) created: u32,
}

impl Position {
    /// Where this position is along every binlog the server has written
    /// since it last started over: the file's number times 2^32 plus the
    /// offset. `None` for a name without a number or a number or offset
    /// past what fits.
    pub(super) fn raw(&self) -> Option<u64> {
        let (_, number) = self.file.rsplit_once('.')?;
        let number: u64 = number.parse().ok()?;
        if number >= 1 << 31 || self.pos >= 1 << 32 {
            return None;
        }
        Some((number << 32) | self.pos)
    }
}

/// A relay's saved state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Saved {
    pub(super) server_id: u64,
    pub(super) at: Position,
    /// Added to every raw position: raised when the binlog starts over.
    pub(super) base: u64,
    /// The highest version a relay of this name was about to publish.
    pub(super) high: u64,
}

/// The name of the lock of relays named `name`.
pub(super) fn lock_name(name: &str) -> String {
    format!(
        "cache_sync_binlog_{:016x}",
        crate::util::source_hash(&["binlog-lock", name])
    )
}

/// Takes the lock if it is free: `false` when another connection holds it.
pub(super) async fn take_lock(conn: &mut Conn, lock: &str) -> Result<bool> {
    let got: Option<Option<i64>> = conn
        .exec_first("SELECT GET_LOCK(?, 0)", (lock,))
        .await
        .map_err(db)?;
    Ok(got.flatten() == Some(1))
}

/// What the server must log for the relay to read it, checked before
/// streaming: each missing setting is named.
pub(super) async fn check_server(conn: &mut Conn) -> Result<u64> {
    let row: Option<Row> = conn
        .query_first(
            "SELECT @@log_bin, @@binlog_format, @@binlog_row_image, @@binlog_row_metadata, @@server_id",
        )
        .await
        .map_err(|e| db(format!("reading the server's binlog settings (MySQL 8 or MariaDB 10.5 and later have them all): {e}")))?;
    let Some(mut row) = row else {
        return Err(db("the server did not answer for its binlog settings"));
    };
    let log_bin: Option<i64> = row.take(0);
    let format: Option<String> = row.take(1);
    let image: Option<String> = row.take(2);
    let metadata: Option<String> = row.take(3);
    let server_id: Option<u64> = row.take(4);
    let mut missing = Vec::new();
    if log_bin != Some(1) {
        missing.push("log_bin is off".to_owned());
    }
    if !format
        .as_deref()
        .is_some_and(|f| f.eq_ignore_ascii_case("ROW"))
    {
        missing.push(format!(
            "binlog_format is {}, not ROW",
            format.as_deref().unwrap_or("unknown")
        ));
    }
    if !image
        .as_deref()
        .is_some_and(|f| f.eq_ignore_ascii_case("FULL") || f.eq_ignore_ascii_case("MINIMAL"))
    {
        missing.push(format!(
            "binlog_row_image is {}, not FULL or MINIMAL",
            image.as_deref().unwrap_or("unknown")
        ));
    }
    if !metadata
        .as_deref()
        .is_some_and(|f| f.eq_ignore_ascii_case("FULL"))
    {
        missing.push(format!(
            "binlog_row_metadata is {}, not FULL (the relay reads columns by the names it logs)",
            metadata.as_deref().unwrap_or("unknown")
        ));
    }
    // Compressed binlogs (MariaDB's log_bin_compress, MySQL's
    // binlog_transaction_compression) hide rows in events the relay does
    // not decode: each would be a clear of every mapped cache. Each server
    // has one of the two settings; the other is not listed.
    let compressed: Vec<(String, String)> = conn
        .query(
            "SHOW GLOBAL VARIABLES WHERE Variable_name IN \
             ('log_bin_compress', 'binlog_transaction_compression')",
        )
        .await
        .map_err(db)?;
    for (name, value) in compressed {
        if value.eq_ignore_ascii_case("ON") || value == "1" {
            missing.push(format!(
                "{name} is ON (the relay does not decode compressed binlog events; turn it off)"
            ));
        }
    }
    if !missing.is_empty() {
        return Err(Error::Config(format!(
            "the server's binlog cannot be read by a binlog relay: {}",
            missing.join("; ")
        )));
    }
    Ok(server_id.unwrap_or(0))
}

/// The binlogs the server has, oldest first, with their sizes.
pub(super) async fn binlogs(conn: &mut Conn) -> Result<Vec<(String, u64)>> {
    let rows: Vec<Row> = conn.query("SHOW BINARY LOGS").await.map_err(db)?;
    let mut logs = Vec::with_capacity(rows.len());
    for mut row in rows {
        let name: Option<String> = row.take(0);
        let size: Option<u64> = row.take(1);
        if let (Some(name), Some(size)) = (name, size) {
            logs.push((name, size));
        }
    }
    Ok(logs)
}

/// Names are bytes: a relay's name, or a binlog's, in any script, whatever
/// the database's default character set (latin1 on MariaDB 10.11).
pub(super) async fn create_table(conn: &mut Conn) -> Result<()> {
    conn.query_drop(format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (
            name VARBINARY(64) NOT NULL PRIMARY KEY,
            server_id BIGINT UNSIGNED NOT NULL,
            file VARBINARY(512) NOT NULL,
            pos BIGINT UNSIGNED NOT NULL,
            base BIGINT UNSIGNED NOT NULL,
            high BIGINT UNSIGNED NOT NULL,
            writes BIGINT UNSIGNED NOT NULL DEFAULT 0,
            created INT UNSIGNED NOT NULL DEFAULT 0
        ) ENGINE=InnoDB"
    ))
    .await
    .map_err(db)?;
    // A table made before `created` existed gets it (MySQL has no ADD
    // COLUMN IF NOT EXISTS). Its rows read 0, not known: not checked.
    let has: Option<u64> = conn
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND COLUMN_NAME = 'created'",
            (TABLE,),
        )
        .await
        .map_err(db)?;
    if has == Some(0) {
        conn.query_drop(format!(
            "ALTER TABLE {TABLE} ADD COLUMN created INT UNSIGNED NOT NULL DEFAULT 0"
        ))
        .await
        .map_err(db)?;
    }
    Ok(())
}

pub(super) async fn load(conn: &mut Conn, name: &str) -> Result<Option<Saved>> {
    let row: Option<(u64, String, u64, u64, u64, u32)> = conn
        .exec_first(
            format!("SELECT server_id, file, pos, base, high, created FROM {TABLE} WHERE name = ?"),
            (name,),
        )
        .await
        .map_err(db)?;
    Ok(
        row.map(|(server_id, file, pos, base, high, created)| Saved {
            server_id,
            at: Position { file, pos, created },
            base,
            high,
        }),
    )
}

/// Saves `saved`, only while this connection holds `lock`. The write is
/// also the visibility barrier: it commits after every transaction the
/// relay has read (see `BinlogRelay`), so it must change the row, and it
/// always does (`writes`).
pub(super) async fn save(conn: &mut Conn, name: &str, lock: &str, saved: &Saved) -> Result<()> {
    conn.exec_drop(
        format!(
            "INSERT INTO {TABLE} (name, server_id, file, pos, base, high, writes, created)
             SELECT ?, ?, ?, ?, ?, ?, 1, ? FROM DUAL WHERE IS_USED_LOCK(?) = CONNECTION_ID()
             ON DUPLICATE KEY UPDATE server_id = VALUES(server_id), file = VALUES(file),
                 pos = VALUES(pos), base = VALUES(base), high = GREATEST(high, VALUES(high)),
                 writes = writes + 1, created = VALUES(created)"
        ),
        (
            name,
            saved.server_id,
            saved.at.file.as_str(),
            saved.at.pos,
            saved.base,
            saved.high,
            saved.at.created,
            lock,
        ),
    )
    .await
    .map_err(db)?;
    if conn.affected_rows() == 0 {
        return Err(db(
            "the relay no longer holds its lock (its connection was replaced?): another relay of its name may be active",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_order_along_files_and_refuse_what_does_not_fit() {
        let at = |file: &str, pos| Position {
            file: file.to_owned(),
            pos,
            created: 0,
        };
        assert!(at("b.000002", 4).raw() > at("b.000001", 1 << 30).raw());
        assert!(at("b.000001", 5).raw() > at("b.000001", 4).raw());
        assert_eq!(at("binlog", 4).raw(), None);
        assert_eq!(at("b.x", 4).raw(), None);
        assert_eq!(at("b.000001", 1 << 32).raw(), None);
        assert_eq!(at("b.99999999999", 4).raw(), None);
        assert_eq!(
            at("b.2147483647", u64::from(u32::MAX)).raw(),
            Some(u64::MAX >> 1)
        );
    }

    #[test]
    fn lock_names_fit_mariadbs_limit_whatever_the_relays_name() {
        for name in ["", "a", &"é".repeat(64), "x\0y"] {
            assert!(lock_name(name).len() <= 64);
        }
        assert_ne!(lock_name("a"), lock_name("b"));
    }
}
