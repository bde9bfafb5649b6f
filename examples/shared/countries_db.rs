//! The `countries` table in PostgreSQL that the `postgres_admin` and
//! `postgres_node` examples share: the admin writes it, nodes load from it.

use sqlx::{PgConnection, PgPool, Row as _};

/// A database every PostgreSQL server has.
pub(crate) const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Creates and seeds the table where missing. A deleted row keeps its code
/// and version with no name: a node loading it gets the deletion's version,
/// the same as the tombstone the delete event left, so it caches "no row".
pub(crate) async fn create(pool: &PgPool) -> sqlx::Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS countries (
             code text PRIMARY KEY,
             name text,
             version bigint NOT NULL
         );
         INSERT INTO countries (code, name, version) VALUES
             ('de', 'Germany', 1), ('es', 'Spain', 1), ('fr', 'France', 1),
             ('it', 'Italy', 1), ('nl', 'Netherlands', 1), ('se', 'Sweden', 1)
         ON CONFLICT (code) DO NOTHING;",
    )
    .execute(pool)
    .await
    .map(drop)
}

/// Writes a row (`None`: deleted) at `version`, in the caller's transaction.
#[allow(dead_code)] // Nodes only read.
pub(crate) async fn write(
    conn: &mut PgConnection,
    code: &str,
    name: Option<&str>,
    version: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    sqlx::query(
        "INSERT INTO countries (code, name, version) VALUES ($1, $2, $3)
         ON CONFLICT (code) DO UPDATE SET name = $2, version = $3",
    )
    .bind(code)
    .bind(name)
    .bind(i64::try_from(version)?)
    .execute(conn)
    .await?;
    Ok(())
}

/// A row and its version; a code never written reads as no row at version 0.
#[allow(dead_code)] // The admin only writes.
pub(crate) async fn read(pool: &PgPool, code: &str) -> sqlx::Result<(Option<String>, u64)> {
    let row = sqlx::query("SELECT name, version FROM countries WHERE code = $1")
        .bind(code)
        .fetch_optional(pool)
        .await?;
    Ok(match row {
        Some(row) => {
            let version: i64 = row.try_get("version")?;
            // Written by the admin from a u64; a negative one is not ours.
            (row.try_get("name")?, u64::try_from(version).unwrap_or(0))
        }
        None => (None, 0),
    })
}
