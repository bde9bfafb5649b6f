//! The outbox's SQL on MySQL and MariaDB. Three things differ from
//! PostgreSQL, and each is answered here:
//!
//! - *No transaction-level advisory lock.* A writer's enqueue lock is an
//!   InnoDB row lock on its cache's row in `versions` (an upsert takes it,
//!   the transaction's end releases it), and reads of that row lock it too,
//!   so they see the latest committed version rather than the snapshot's.
//! - *No sequence.* Row ids are `AUTO_INCREMENT`, taken under the lock; the
//!   relay's terms come from one row, raised with `LAST_INSERT_ID(term + 1)`
//!   in a statement committed at once, so a term is never handed out twice.
//! - *No `NOTIFY`.* The relay polls.
//!
//! The relay's leader lock is `GET_LOCK`, which belongs to a connection
//! rather than a transaction: the relay holds it on a connection of its
//! own, taken out of the pool, for as long as that connection lives, and
//! draws one term each time it takes the lock.

use std::time::Duration;

use sqlx::{Executor as _, MySqlConnection, MySqlPool};

use super::db;
use crate::error::{Error, Result};

/// The migration, with `{schema}` for the schema's name;
/// `migrations/mysql/0001_outbox.sql` is this with `cache_sync` (a test
/// keeps them the same).
pub(super) const MIGRATIONS: [&str; 1] = [include_str!("migration_mysql_0001.sql.in")];

/// The database's clock, in microseconds since the Unix epoch. `SYSDATE`,
/// not `NOW`: the time of the call, not of the statement's start.
/// `UNIX_TIMESTAMP` undoes the session's time zone, so writers and relays
/// with different zones agree.
const CLOCK_US: &str = "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)";

/// Rows per `INSERT` statement, and bytes: well under the server's
/// placeholder limit (65,535) and its default `max_allowed_packet` (16 MiB
/// on MariaDB, 64 MiB on MySQL). A single row larger than the packet limit
/// is the server's error.
const INSERT_ROWS: usize = 1000;
const INSERT_BYTES: usize = 4 << 20;

/// Ids per `DELETE` statement.
const DELETE_IDS: usize = 10_000;

/// `GET_LOCK` names are at most 64 characters, and server-wide: the schema
/// (a database name) is hashed into one.
fn lock_name(what: &str, schema: &str) -> String {
    format!(
        "cache-sync {what} {:016x}",
        crate::util::source_hash(&["mysql outbox", what, schema])
    )
}

/// Takes the cache's enqueue lock: the upsert locks its row in `versions`
/// (creating it at version 0) until the transaction ends.
pub(super) async fn lock(conn: &mut MySqlConnection, schema: &str, cache: &str) -> Result<()> {
    sqlx::query(&format!(
        "INSERT INTO {schema}.versions (cache, version) VALUES (?, 0) \
         ON DUPLICATE KEY UPDATE version = version"
    ))
    .bind(cache.as_bytes())
    .execute(&mut *conn)
    .await
    .map_err(db)?;
    Ok(())
}

/// The cache's last version (0 for a cache locked for the first time), and
/// the database's clock. A locking read: under REPEATABLE READ a plain read
/// would see the transaction's snapshot, which may predate the version the
/// previous lock holder committed.
pub(super) async fn last_version_and_clock(
    conn: &mut MySqlConnection,
    schema: &str,
    cache: &str,
) -> Result<(Option<i64>, i64)> {
    let (last, now): (i64, i64) = sqlx::query_as(&format!(
        "SELECT version, {CLOCK_US} FROM {schema}.versions WHERE cache = ? FOR UPDATE"
    ))
    .bind(cache.as_bytes())
    .fetch_one(&mut *conn)
    .await
    .map_err(db)?;
    Ok((Some(last), now))
}

/// The row exists: the lock made it.
pub(super) async fn store_version(
    conn: &mut MySqlConnection,
    schema: &str,
    cache: &str,
    version: i64,
    raise: bool,
) -> Result<()> {
    let set = if raise { "GREATEST(version, ?)" } else { "?" };
    sqlx::query(&format!(
        "UPDATE {schema}.versions SET version = {set} WHERE cache = ?"
    ))
    .bind(version)
    .bind(cache.as_bytes())
    .execute(&mut *conn)
    .await
    .map_err(db)?;
    Ok(())
}

/// Multi-row inserts: `AUTO_INCREMENT` hands out a statement's ids in the
/// order of its rows, and statements run in order.
pub(super) async fn insert_rows(
    conn: &mut MySqlConnection,
    schema: &str,
    cache: &str,
    rows: &[Vec<u8>],
    delay_us: Option<i64>,
) -> Result<()> {
    let not_before = match delay_us {
        Some(_) => format!("{CLOCK_US} + ?"),
        None => "NULL".to_owned(),
    };
    let mut rest = rows;
    while !rest.is_empty() {
        // At least one row per statement, however large.
        let mut n = 1;
        let mut bytes = rest[0].len();
        while n < rest.len() && n < INSERT_ROWS {
            bytes = bytes.saturating_add(rest[n].len());
            if bytes > INSERT_BYTES {
                break;
            }
            n = n.saturating_add(1);
        }
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let values = vec![format!("(?, ?, {not_before})"); chunk.len()].join(", ");
        let sql =
            format!("INSERT INTO {schema}.outbox (cache, `change`, not_before) VALUES {values}");
        let mut query = sqlx::query(&sql);
        for row in chunk {
            query = query.bind(cache.as_bytes()).bind(row.as_slice());
            if let Some(delay) = delay_us {
                query = query.bind(delay);
            }
        }
        query.execute(&mut *conn).await.map_err(db)?;
    }
    Ok(())
}

/// Runs the migration's statements one at a time (MySQL commits each DDL
/// statement on its own) under a server-wide lock, on a connection of its
/// own that is closed after, so the lock never goes back to the pool.
pub(super) async fn migrate(pool: &MySqlPool, schema: &str, sql: &[String]) -> Result<()> {
    let mut conn = pool.acquire().await.map_err(db)?.detach();
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 60)")
        .bind(lock_name("migrate", schema))
        .fetch_one(&mut conn)
        .await
        .map_err(db)?;
    if got != Some(1) {
        return Err(Error::Database(
            format!("another process held the outbox migration lock of {schema} for 60 s").into(),
        ));
    }
    for migration in sql {
        for statement in statements(migration) {
            // Unprepared: DDL goes as text.
            conn.execute(statement.as_str()).await.map_err(db)?;
        }
    }
    // Closing ends the session and its lock.
    sqlx::Connection::close(conn).await.map_err(db)
}

/// A migration's statements: its text without comment lines, split where a
/// line ends in `;` (the shipped migration is written so).
fn statements(migration: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in migration.lines() {
        if line.trim_start().starts_with("--") {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if line.trim_end().ends_with(';') {
            out.push(
                std::mem::take(&mut current)
                    .trim()
                    .trim_end_matches(';')
                    .to_owned(),
            );
        }
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_owned());
    }
    out
}

pub(super) async fn scope(pool: &MySqlPool, schema: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!("SELECT scope FROM {schema}.relay WHERE one = 1"))
        .fetch_one(pool)
        .await
}

/// A relay's hold on MySQL: a connection of its own, out of the pool, and
/// the term it drew when that connection took the leader lock (`None`
/// while it stands by).
pub(super) struct Store {
    pool: MySqlPool,
    conn: Option<MySqlConnection>,
    term: Option<i64>,
}

/// A pass on the leader's connection.
pub(super) struct Lease<'a> {
    conn: &'a mut MySqlConnection,
}

impl Store {
    pub(super) fn new(pool: MySqlPool) -> Self {
        Self {
            pool,
            conn: None,
            term: None,
        }
    }

    /// The leader's connection and its term: the lock taken now, with a
    /// new term, or still held from an earlier pass (with the term it drew
    /// then: no other relay can have published since). `None` when another
    /// relay holds the lock.
    pub(super) async fn lead(&mut self, schema: &str) -> Result<Option<(Lease<'_>, i64)>> {
        let conn = match self.conn.take() {
            Some(conn) => conn,
            // Out of the pool: the lock must never go back into it.
            None => self.pool.acquire().await.map_err(db)?.detach(),
        };
        let conn = self.conn.insert(conn);
        if self.term.is_none() {
            // A standby asks on the same connection at every poll.
            let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
                .bind(lock_name("relay", schema))
                .fetch_one(&mut *conn)
                .await
                .map_err(db)?;
            if got != Some(1) {
                return Ok(None);
            }
            let drawn = sqlx::query(&format!(
                "UPDATE {schema}.relay SET term = LAST_INSERT_ID(term + 1) WHERE one = 1"
            ))
            .execute(&mut *conn)
            .await
            .map_err(db)?;
            if drawn.rows_affected() != 1 {
                return Err(Error::Database(
                    format!(
                        "{schema}.relay holds no row to draw a fencing term from: run \
                         Outbox::migrate, or migrations/mysql/0001_outbox.sql, on this database"
                    )
                    .into(),
                ));
            }
            let term = i64::try_from(drawn.last_insert_id()).map_err(|_| {
                Error::Database(format!("{schema}.relay's term is past i64::MAX").into())
            })?;
            self.term = Some(term);
        }
        Ok(self.term.map(|term| (Lease { conn }, term)))
    }

    /// Drops the connection, and with it the lock: after an error its
    /// state is unknown, and a standby may as well take over.
    pub(super) fn reset(&mut self) {
        self.conn = None;
        self.term = None;
    }

    /// Closes the connection, so a standby takes over at its next poll.
    pub(super) async fn close(&mut self) {
        self.term = None;
        if let Some(conn) = self.conn.take() {
            let _ = sqlx::Connection::close(conn).await;
        }
    }

    pub(super) async fn waiting(&mut self, schema: &str) -> Result<i64> {
        sqlx::query_scalar(&format!("SELECT COUNT(*) FROM {schema}.outbox"))
            .fetch_one(&self.pool)
            .await
            .map_err(db)
    }

    /// No notifications on MySQL: the poll interval.
    pub(super) async fn wait(&mut self, every: Duration) {
        tokio::time::sleep(every).await;
    }
}

impl Lease<'_> {
    /// Due rows in id order. Each statement on the autocommit connection
    /// reads a fresh snapshot, taken after the pass began.
    pub(super) async fn rows(
        &mut self,
        schema: &str,
        limit: i64,
    ) -> Result<Vec<(i64, String, Vec<u8>)>> {
        let rows: Vec<(i64, Vec<u8>, Vec<u8>)> = sqlx::query_as(&format!(
            "SELECT id, cache, `change` FROM {schema}.outbox \
             WHERE not_before IS NULL OR not_before <= {CLOCK_US} \
             ORDER BY id LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(&mut *self.conn)
        .await
        .map_err(db)?;
        // A cache name that is not UTF-8 was not written by an outbox; it
        // becomes a name no transport takes, and its row a clear.
        Ok(rows
            .into_iter()
            .map(|(id, cache, change)| (id, String::from_utf8_lossy(&cache).into_owned(), change))
            .collect())
    }

    /// Whether this connection still holds the leader lock.
    pub(super) async fn alive(&mut self, schema: &str) -> sqlx::Result<bool> {
        let mine: Option<i64> = sqlx::query_scalar("SELECT IS_USED_LOCK(?) = CONNECTION_ID()")
            .bind(lock_name("relay", schema))
            .fetch_one(&mut *self.conn)
            .await?;
        Ok(mine == Some(1))
    }

    /// Deletes the published rows; the lock stays with the connection.
    pub(super) async fn finish(self, schema: &str, done: &[i64]) -> Result<()> {
        for chunk in done.chunks(DELETE_IDS) {
            let marks = vec!["?"; chunk.len()].join(", ");
            let sql = format!("DELETE FROM {schema}.outbox WHERE id IN ({marks})");
            let mut query = sqlx::query(&sql);
            for id in chunk {
                query = query.bind(*id);
            }
            query.execute(&mut *self.conn).await.map_err(db)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_migration_is_what_migrate_runs_for_cache_sync() {
        assert_eq!(
            MIGRATIONS[0].replace("{schema}", "cache_sync"),
            include_str!("../../migrations/mysql/0001_outbox.sql")
        );
    }

    #[test]
    fn the_migration_splits_into_its_statements() {
        let s = statements(&MIGRATIONS[0].replace("{schema}", "s"));
        assert_eq!(s.len(), 5, "{s:#?}");
        assert!(s[0].starts_with("CREATE DATABASE IF NOT EXISTS s"));
        assert!(s[4].starts_with("INSERT IGNORE INTO s.relay"));
        assert!(s.iter().all(|s| !s.contains(';') && !s.contains("--")));
    }

    #[test]
    fn lock_names_fit_mysql() {
        let long = "a".repeat(63);
        for what in ["relay", "migrate"] {
            assert!(lock_name(what, &long).len() <= 64);
        }
        assert_ne!(lock_name("relay", "a"), lock_name("relay", "b"));
        assert_ne!(lock_name("relay", "a"), lock_name("migrate", "a"));
    }
}
