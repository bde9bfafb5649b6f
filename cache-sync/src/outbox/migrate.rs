//! The outbox's schema: its migrations, and running them.

use super::Outbox;
use super::database::{OutboxPool, Pool};
use crate::error::Result;

impl Outbox {
    /// The SQL [`migrate`](Self::migrate) runs on PostgreSQL, one string
    /// per migration.
    #[cfg(feature = "postgres-outbox")]
    pub(super) fn migration_sql(&self) -> Vec<String> {
        self.fill(&super::pg::MIGRATIONS)
    }

    fn fill(&self, migrations: &[&str]) -> Vec<String> {
        migrations
            .iter()
            .map(|m| m.replace("{schema}", &self.inner.schema))
            .collect()
    }

    /// Creates the outbox's tables where missing, and brings an outbox made
    /// by an earlier release up to date (a relay refuses to start on a
    /// schema without its fence). Safe to run at every start and from
    /// several processes at once: a lock on the schema's name lets one run
    /// at a time, and every statement is idempotent.
    ///
    /// - On PostgreSQL 14 or later (`sqlx::PgPool`): the schema,
    ///   sequences, tables and trigger of `migrations/0001_outbox.sql` and
    ///   `0002_relay_fence.sql`, in this outbox's schema, in one
    ///   transaction under an advisory lock.
    /// - On MariaDB (tested on 10.11) or MySQL 8 (`sqlx::MySqlPool`): the
    ///   database named by the schema, and the tables of
    ///   `migrations/mysql/0001_outbox.sql`, statement by statement (MySQL
    ///   commits each DDL statement on its own) under `GET_LOCK`. It needs
    ///   the `CREATE` privilege, or a database created beforehand.
    pub async fn migrate(&self, pool: &impl OutboxPool) -> Result<()> {
        match pool.pool() {
            #[cfg(feature = "postgres-outbox")]
            Pool::Pg(pool) => {
                super::pg::migrate(&pool, &self.inner.schema, &self.migration_sql()).await
            }
            #[cfg(feature = "mysql-outbox")]
            Pool::MySql(pool) => {
                super::mysql::migrate(
                    &pool,
                    &self.inner.schema,
                    &self.fill(&super::mysql::MIGRATIONS),
                )
                .await
            }
        }
    }
}
