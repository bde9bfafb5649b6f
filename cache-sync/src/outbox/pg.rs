//! The outbox's SQL on PostgreSQL: transaction-level advisory locks, a
//! sequence for row ids and one for relay terms, and `LISTEN`/`NOTIFY`.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Postgres, Transaction};

use super::db;
use crate::error::Result;

/// The channel the insert trigger notifies, with the schema as payload. One
/// channel for every schema: a channel name is limited like an identifier,
/// and the payload tells relays of other schemas to ignore it.
const CHANNEL: &str = "cache_sync_outbox";

/// The 64-bit key of a transaction-level advisory lock, computed by the
/// database from a string naming what it guards.
const LOCK_SQL: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";

/// The migrations, in order, with `{schema}` for the schema's name;
/// `migrations/0001_outbox.sql` and `migrations/0002_relay_fence.sql` are
/// these with `cache_sync` (a test keeps them the same).
pub(super) const MIGRATIONS: [&str; 2] = [
    include_str!("migration_0001.sql.in"),
    include_str!("migration_0002.sql.in"),
];

/// Takes the transaction-level advisory lock named `key`.
pub(super) async fn lock(conn: &mut PgConnection, key: &str) -> Result<()> {
    sqlx::query(LOCK_SQL)
        .bind(key)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
    Ok(())
}

/// The cache's last version, and the database's clock in microseconds.
pub(super) async fn last_version_and_clock(
    conn: &mut PgConnection,
    schema: &str,
    cache: &str,
) -> Result<(Option<i64>, i64)> {
    sqlx::query_as(&format!(
        "SELECT (SELECT version FROM {schema}.versions WHERE cache = $1), \
         (extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
    ))
    .bind(cache)
    .fetch_one(&mut *conn)
    .await
    .map_err(db)
}

pub(super) async fn store_version(
    conn: &mut PgConnection,
    schema: &str,
    cache: &str,
    version: i64,
    raise: bool,
) -> Result<()> {
    let update = if raise {
        "greatest(v.version, EXCLUDED.version)"
    } else {
        "EXCLUDED.version"
    };
    sqlx::query(&format!(
        "INSERT INTO {schema}.versions AS v (cache, version) VALUES ($1, $2) \
         ON CONFLICT (cache) DO UPDATE SET version = {update}"
    ))
    .bind(cache)
    .bind(version)
    .execute(&mut *conn)
    .await
    .map_err(db)?;
    Ok(())
}

/// One statement: ids from the sequence, in the rows' order.
pub(super) async fn insert_rows(
    conn: &mut PgConnection,
    schema: &str,
    cache: &str,
    rows: &[Vec<u8>],
    delay_us: Option<i64>,
) -> Result<()> {
    let sql = format!(
        "INSERT INTO {schema}.outbox (id, cache, change, not_before) \
         SELECT nextval('{schema}.outbox_id_seq'), $1, c, \
         CASE WHEN $3::bigint IS NULL THEN NULL ELSE clock_timestamp() + $3 * interval '1 microsecond' END \
         FROM unnest($2::bytea[]) WITH ORDINALITY AS r(c, n) ORDER BY n"
    );
    sqlx::query(&sql)
        .bind(cache)
        .bind(rows)
        .bind(delay_us)
        .execute(&mut *conn)
        .await
        .map_err(db)?;
    Ok(())
}

/// Runs the migrations in one transaction, one migration at a time.
pub(super) async fn migrate(pool: &PgPool, schema: &str, sql: &[String]) -> Result<()> {
    let mut tx = pool.begin().await.map_err(db)?;
    lock(&mut tx, &format!("cache-sync migrate\n{schema}")).await?;
    // A plain string runs as one simple query, several statements in
    // it. (Not `raw_sql`: its future is not `Send` for every lifetime,
    // so a migrate could not be spawned.)
    for sql in sql {
        let conn: &mut PgConnection = &mut tx;
        sqlx::Executor::execute(conn, sql.as_str())
            .await
            .map_err(db)?;
    }
    tx.commit().await.map_err(db)
}

pub(super) async fn scope(pool: &PgPool, schema: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!("SELECT scope FROM {schema}.relay"))
        .fetch_one(pool)
        .await
}

/// What names the database in a freshness report's source.
pub(super) async fn database_name(pool: &PgPool) -> Result<String> {
    sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await
        .map_err(db)
}

/// A relay's hold on PostgreSQL: its listener, between passes.
pub(super) struct Store {
    pool: PgPool,
    listener: PgListener,
}

/// A pass that took the leader lock: its transaction holds it.
pub(super) struct Lease {
    tx: Transaction<'static, Postgres>,
}

impl Store {
    pub(super) async fn connect(pool: PgPool) -> Result<Self> {
        let mut listener = PgListener::connect_with(&pool).await.map_err(db)?;
        listener.listen(CHANNEL).await.map_err(db)?;
        Ok(Self { pool, listener })
    }

    /// A transaction with the leader lock and a term from the sequence, or
    /// `None` when another relay holds the lock.
    pub(super) async fn lead(&mut self, schema: &str) -> Result<Option<(Lease, i64)>> {
        let mut tx = self.pool.begin().await.map_err(db)?;
        // The term only when the lock was taken (CASE evaluates in order):
        // a relay that is not the leader draws none.
        let term: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT CASE WHEN pg_try_advisory_xact_lock(hashtextextended($1, 0)) \
             THEN nextval('{schema}.relay_term_seq') END"
        ))
        .bind(format!("cache-sync relay\n{schema}"))
        .fetch_one(&mut *tx)
        .await
        .map_err(db)?;
        match term {
            Some(term) => Ok(Some((Lease { tx }, term))),
            None => {
                tx.rollback().await.map_err(db)?;
                Ok(None)
            }
        }
    }

    pub(super) async fn waiting(&mut self, schema: &str) -> Result<i64> {
        sqlx::query_scalar(&format!("SELECT count(*) FROM {schema}.outbox"))
            .fetch_one(&self.pool)
            .await
            .map_err(db)
    }

    /// Until a notification for this schema, or `every` passes.
    pub(super) async fn wait(&mut self, schema: &str, every: Duration) {
        let deadline = tokio::time::Instant::now()
            .checked_add(every)
            .unwrap_or_else(tokio::time::Instant::now);
        loop {
            // `recv` reconnects a dropped listener by itself (notifications
            // sent meanwhile are lost: the poll finds their rows).
            match tokio::time::timeout_at(deadline, self.listener.recv()).await {
                Err(_) => return,
                Ok(Ok(n)) if n.payload() == schema => return,
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "outbox relay: listener error");
                    tokio::time::sleep_until(deadline).await;
                    return;
                }
            }
        }
    }
}

impl Lease {
    /// Due rows in id order. Every statement's snapshot in the pass's
    /// transaction is taken after the pass began, so a row committed
    /// before it is seen.
    pub(super) async fn rows(
        &mut self,
        schema: &str,
        limit: i64,
    ) -> Result<Vec<(i64, String, Vec<u8>)>> {
        sqlx::query_as(&format!(
            "SELECT id, cache, change FROM {schema}.outbox \
             WHERE not_before IS NULL OR not_before <= clock_timestamp() \
             ORDER BY id LIMIT $1"
        ))
        .bind(limit)
        .fetch_all(&mut *self.tx)
        .await
        .map_err(db)
    }

    /// The pass is the lock: a session that answers still holds it.
    pub(super) async fn alive(&mut self, _schema: &str) -> sqlx::Result<bool> {
        sqlx::query("SELECT 1").execute(&mut *self.tx).await?;
        Ok(true)
    }

    /// Deletes the published rows and commits, which releases the lock.
    pub(super) async fn finish(mut self, schema: &str, done: &[i64]) -> Result<()> {
        if !done.is_empty() {
            sqlx::query(&format!("DELETE FROM {schema}.outbox WHERE id = ANY($1)"))
                .bind(done)
                .execute(&mut *self.tx)
                .await
                .map_err(db)?;
        }
        self.tx.commit().await.map_err(db)
    }
}
