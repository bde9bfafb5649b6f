//! The outbox's schema: its migrations, and running them.

use sqlx::{PgConnection, PgPool};

use super::{LOCK_SQL, Outbox, db};
use crate::error::Result;

/// The migrations, in order, with `{schema}` for the schema's name;
/// `migrations/0001_outbox.sql` and `migrations/0002_relay_fence.sql` are
/// these with `cache_sync` (a test keeps them the same).
const MIGRATIONS: [&str; 2] = [
    include_str!("migration_0001.sql.in"),
    include_str!("migration_0002.sql.in"),
];

impl Outbox {
    /// The SQL [`migrate`](Self::migrate) runs, one string per migration.
    pub(super) fn migration_sql(&self) -> [String; 2] {
        MIGRATIONS.map(|m| m.replace("{schema}", &self.inner.schema))
    }

    /// Creates the schema, tables, sequences and trigger where missing
    /// (`migrations/0001_outbox.sql` and `0002_relay_fence.sql`, in this
    /// outbox's schema), in one transaction. Safe to run at every start and
    /// from several processes at once: an advisory lock on the schema's
    /// name lets one run at a time, and every statement is idempotent, so
    /// it also brings an outbox made by an earlier release up to date (a
    /// relay refuses to start on a schema without the second migration).
    /// Needs PostgreSQL 14 or later.
    pub async fn migrate(&self, pool: &PgPool) -> Result<()> {
        let mut tx = pool.begin().await.map_err(db)?;
        sqlx::query(LOCK_SQL)
            .bind(format!("cache-sync migrate\n{}", self.inner.schema))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        // A plain string runs as one simple query, several statements in
        // it. (Not `raw_sql`: its future is not `Send` for every lifetime,
        // so a migrate could not be spawned.)
        for sql in self.migration_sql() {
            let conn: &mut PgConnection = &mut tx;
            sqlx::Executor::execute(conn, sql.as_str())
                .await
                .map_err(db)?;
        }
        tx.commit().await.map_err(db)
    }
}
