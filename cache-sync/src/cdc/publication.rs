//! The publication the relay streams through, and the mapped tables as the
//! stream depends on them. Checked when the relay starts: anything that
//! would make the stream miss changes, or make PostgreSQL refuse the
//! application's own writes, is refused with [`Error::Config`] before
//! anything is touched. And checked again every `lag_interval` while it
//! runs: whatever an operator changed since is put back where it can be,
//! with a resync of what the change may have hidden from the stream.
//!
//! What `pgoutput` needs of the publication, and why each is checked:
//! - it publishes inserts, updates, deletes and truncates: a publication
//!   without deletes (say) never tells nodes a row went;
//! - `publish_via_partition_root = false`: with it on, a `TRUNCATE` of one
//!   partition is sent as nothing at all. Partitions' changes come under
//!   the partition's own name, and the relay maps them to the partitioned
//!   table through `pg_partition_ancestors`;
//! - no row filter and no column list on a mapped table (or a partition
//!   or ancestor of one): a filtered change never reaches nodes;
//! - every mapped table is in it.
//!
//! Of the tables: each must exist and be a table, and have a replica
//! identity (each partition of a partitioned one too). Without one,
//! PostgreSQL refuses every `UPDATE` and `DELETE` on a table once it is in
//! a publication that publishes them: the relay must never be the one to
//! put it there.
//!
//! What no row change in the log tells, a table's *shape* does: its oid
//! (dropped, or dropped and created again) and its partitions' (detached,
//! attached, dropped). Each check compares them with the shapes recorded
//! on the database (see `state`), and owes a resync of the tables whose
//! shape changed.

use std::collections::HashSet;

use sqlx::{PgConnection, PgPool, Row as _};

use super::slot::{db, ident};
use super::state::{self, Debt, Relation, Shape};
use crate::error::{Error, Result};

/// Where the check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The relay's start: refuse what is wrong, touch nothing.
    Start,
    /// The periodic check: put back what an operator changed.
    Running,
}

/// What PostgreSQL says of one mapped table.
#[derive(Debug)]
struct Table {
    relation: Relation,
    oid: Option<u32>,
    kind: Option<String>,
    namespace: Option<u32>,
    /// Its partitions at every level, sorted.
    partitions: Vec<u32>,
    /// Itself and the tables it is a partition of.
    lineage: Vec<u32>,
}

/// The publication's settings.
#[derive(Debug)]
struct Publication {
    oid: u32,
    all_tables: bool,
    /// What it does not publish, of insert, update, delete, truncate.
    unpublished: Vec<&'static str>,
    via_root: bool,
}

fn oid(v: i64) -> u32 {
    u32::try_from(v).unwrap_or(0)
}

fn quoted((schema, name): &Relation) -> String {
    format!("{}.{}", ident(schema), ident(name))
}

async fn tables(conn: &mut PgConnection, relations: &[Relation]) -> Result<Vec<Table>> {
    let names: Vec<String> = relations.iter().map(quoted).collect();
    let rows = sqlx::query(
        "SELECT c.oid::int8 AS oid, c.relkind::text AS kind, c.relnamespace::int8 AS ns, \
           coalesce((SELECT array_agg(p.relid::oid::int8 ORDER BY p.relid::oid::int8) \
                     FROM pg_partition_tree(c.oid) p WHERE p.relid <> c.oid), '{}') AS partitions, \
           coalesce((SELECT array_agg(a.relid::oid::int8) FROM pg_partition_ancestors(c.oid) a), \
                    ARRAY[c.oid::int8]) AS lineage \
         FROM unnest($1::text[]) WITH ORDINALITY AS t(n, i) \
         LEFT JOIN pg_class c ON c.oid = to_regclass(t.n) \
         ORDER BY t.i",
    )
    .bind(&names)
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?;
    let mut out = Vec::with_capacity(relations.len());
    for (relation, row) in relations.iter().zip(rows) {
        let found: Option<i64> = row.try_get("oid").map_err(db)?;
        let list = |col: &str| -> Result<Vec<u32>> {
            let v: Option<Vec<i64>> = row.try_get(col).map_err(db)?;
            Ok(v.unwrap_or_default().into_iter().map(oid).collect())
        };
        out.push(Table {
            relation: relation.clone(),
            oid: found.map(oid),
            kind: row.try_get("kind").map_err(db)?,
            namespace: row.try_get::<Option<i64>, _>("ns").map_err(db)?.map(oid),
            partitions: if found.is_some() {
                list("partitions")?
            } else {
                Vec::new()
            },
            lineage: if found.is_some() {
                list("lineage")?
            } else {
                Vec::new()
            },
        });
    }
    Ok(out)
}

async fn publication(conn: &mut PgConnection, name: &str) -> Result<Option<Publication>> {
    let row = sqlx::query(
        "SELECT oid::int8 AS oid, puballtables, pubinsert, pubupdate, pubdelete, pubtruncate, pubviaroot \
         FROM pg_publication WHERE pubname = $1",
    )
    .bind(name)
    .fetch_optional(conn)
    .await
    .map_err(db)?;
    let Some(row) = row else { return Ok(None) };
    let mut unpublished = Vec::new();
    for (col, what) in [
        ("pubinsert", "insert"),
        ("pubupdate", "update"),
        ("pubdelete", "delete"),
        ("pubtruncate", "truncate"),
    ] {
        if !row.try_get::<bool, _>(col).map_err(db)? {
            unpublished.push(what);
        }
    }
    Ok(Some(Publication {
        oid: oid(row.try_get("oid").map_err(db)?),
        all_tables: row.try_get("puballtables").map_err(db)?,
        unpublished,
        via_root: row.try_get("pubviaroot").map_err(db)?,
    }))
}

/// The tables without a usable replica identity among `oids` (leaf tables
/// only: a partitioned table holds no rows), as `schema.table (why)`.
async fn without_identity(conn: &mut PgConnection, oids: &[u32]) -> Result<Vec<String>> {
    let oids: Vec<i64> = oids.iter().map(|&o| i64::from(o)).collect();
    let rows = sqlx::query(
        "SELECT format('%I.%I', n.nspname, c.relname) AS name, c.relreplident::text AS ident \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE c.oid = ANY($1::int8[]::oid[]) AND c.relkind = 'r' \
           AND c.relreplident <> 'f' \
           AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisvalid \
                 AND CASE c.relreplident WHEN 'd' THEN i.indisprimary \
                                         WHEN 'i' THEN i.indisreplident ELSE false END) \
         ORDER BY 1",
    )
    .bind(&oids)
    .fetch_all(conn)
    .await
    .map_err(db)?;
    let mut out = Vec::new();
    for row in rows {
        let name: String = row.try_get("name").map_err(db)?;
        let why = match row.try_get::<String, _>("ident").map_err(db)?.as_str() {
            "n" => "REPLICA IDENTITY NOTHING",
            "i" => "REPLICA IDENTITY USING INDEX, but the index is gone or invalid",
            _ => "REPLICA IDENTITY DEFAULT, but no primary key",
        };
        out.push(format!("{name} ({why})"));
    }
    Ok(out)
}

/// The publication's own members (`pg_publication_rel`: filtered or not)
/// and schemas.
struct Members {
    rels: Vec<(u32, bool)>,
    schemas: HashSet<u32>,
}

async fn members(conn: &mut PgConnection, publication: u32) -> Result<Members> {
    let pubid = i64::from(publication);
    // Row filters, column lists and schemas arrived in PostgreSQL 15.
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int4")
        .fetch_one(&mut *conn)
        .await
        .map_err(db)?;
    let filtered = if version >= 150_000 {
        "prqual IS NOT NULL OR prattrs IS NOT NULL"
    } else {
        "false"
    };
    let rels: Vec<(i64, bool)> = sqlx::query_as(&format!(
        "SELECT prrelid::int8, {filtered} FROM pg_publication_rel WHERE prpubid = $1::int8::oid"
    ))
    .bind(pubid)
    .fetch_all(&mut *conn)
    .await
    .map_err(db)?;
    let schemas: Vec<i64> = if version >= 150_000 {
        sqlx::query_scalar(
            "SELECT pnnspid::int8 FROM pg_publication_namespace WHERE pnpubid = $1::int8::oid",
        )
        .bind(pubid)
        .fetch_all(&mut *conn)
        .await
        .map_err(db)?
    } else {
        Vec::new()
    };
    Ok(Members {
        rels: rels.into_iter().map(|(o, f)| (oid(o), f)).collect(),
        schemas: schemas.into_iter().map(oid).collect(),
    })
}

const PUBLISH: &str =
    "publish = 'insert, update, delete, truncate', publish_via_partition_root = false";

/// Checks the publication and the mapped tables (see the module's docs),
/// records their shapes, and owes the resyncs what it found calls for (in
/// one transaction, under the publication's lock). At the start, refuses
/// what is wrong; while running, puts it back. Returns what it changed,
/// for the log.
pub(crate) async fn check(
    pool: &PgPool,
    publication_name: &str,
    slot: &str,
    relations: &[Relation],
    mode: Mode,
) -> Result<Vec<String>> {
    let refuse = |why: String| Err(Error::Config(why));
    let mut tx = pool.begin().await.map_err(db)?;
    state::lock(&mut tx, publication_name).await?;
    let tables = tables(&mut tx, relations).await?;
    let existing: Vec<&Table> = tables.iter().filter(|t| t.oid.is_some()).collect();

    // What is wrong with the tables.
    let mut leaves: Vec<u32> = Vec::new();
    for t in &existing {
        match t.kind.as_deref() {
            Some("r" | "p") => {}
            kind => {
                if mode == Mode::Start {
                    return refuse(format!(
                        "mapped table {} is not a table (relkind {kind:?})",
                        quoted(&t.relation)
                    ));
                }
                continue;
            }
        }
        leaves.extend(t.oid);
        leaves.extend(&t.partitions);
    }
    if mode == Mode::Start
        && let Some(t) = tables.iter().find(|t| t.oid.is_none())
    {
        return refuse(format!(
            "mapped table {} does not exist",
            quoted(&t.relation)
        ));
    }
    let no_identity = without_identity(&mut tx, &leaves).await?;
    if !no_identity.is_empty() {
        let why = format!(
            "{} without a replica identity: in a publication that publishes updates and deletes, \
             PostgreSQL refuses every UPDATE and DELETE on such a table. Add a primary key, or \
             set REPLICA IDENTITY FULL or USING INDEX",
            no_identity.join(", ")
        );
        if mode == Mode::Start {
            return refuse(format!("mapped table {why}"));
        }
        // Put there by an operator since (a partition attached, a key
        // dropped): the application's writes already fail; the relay can
        // only say so.
        tracing::error!(
            publication = publication_name,
            "cdc relay: mapped table {why}"
        );
    }

    // What is wrong with the publication.
    let mut changed = Vec::new();
    let mut owe_all = false;
    let mut owe: Vec<Relation> = Vec::new();
    let found = publication(&mut tx, publication_name).await?;
    let pub_id = match found {
        None => {
            let list = existing
                .iter()
                .map(|t| quoted(&t.relation))
                .collect::<Vec<_>>()
                .join(", ");
            let sql = if list.is_empty() {
                format!(
                    "CREATE PUBLICATION {} WITH ({PUBLISH})",
                    ident(publication_name)
                )
            } else {
                format!(
                    "CREATE PUBLICATION {} FOR TABLE {list} WITH ({PUBLISH})",
                    ident(publication_name)
                )
            };
            sqlx::query(&sql).execute(&mut *tx).await.map_err(db)?;
            // Whatever the slot streamed while there was none is lost to it
            // (PostgreSQL 15 fails the stream on it, and the slot is made
            // again; later versions skip it): a resync of everything.
            if mode == Mode::Running {
                changed.push("created the publication again (it had been dropped)".to_owned());
            }
            owe_all = true;
            None
        }
        Some(p) => {
            let mut wrong = Vec::new();
            if !p.unpublished.is_empty() {
                wrong.push(format!("publish lacks {}", p.unpublished.join(", ")));
            }
            if p.via_root {
                wrong.push("publish_via_partition_root = true (a TRUNCATE of one partition would reach no node)".to_owned());
            }
            if !wrong.is_empty() {
                if mode == Mode::Start {
                    return refuse(format!(
                        "publication {publication_name:?} exists with other settings: {}; the relay needs {PUBLISH}. \
                         Alter it, drop it, or name another with CdcRelayBuilder::publication",
                        wrong.join("; ")
                    ));
                }
                sqlx::query(&format!(
                    "ALTER PUBLICATION {} SET ({PUBLISH})",
                    ident(publication_name)
                ))
                .execute(&mut *tx)
                .await
                .map_err(db)?;
                changed.push(format!("set the publication back ({})", wrong.join("; ")));
                owe_all = true;
            }
            Some(p)
        }
    };
    if let Some(p) = &pub_id {
        let members = members(&mut tx, p.oid).await?;
        // Filters on a mapped table, a partition or an ancestor of one.
        let tree: HashSet<u32> = existing
            .iter()
            .flat_map(|t| t.lineage.iter().chain(&t.partitions))
            .copied()
            .collect();
        let filtered: Vec<u32> = members
            .rels
            .iter()
            .filter(|(o, f)| *f && tree.contains(o))
            .map(|(o, _)| *o)
            .collect();
        if !filtered.is_empty() {
            let names: Vec<String> = sqlx::query_scalar(
                "SELECT c.oid::regclass::text FROM pg_class c WHERE c.oid = ANY($1::int8[]::oid[]) ORDER BY 1",
            )
            .bind(filtered.iter().map(|&o| i64::from(o)).collect::<Vec<_>>())
            .fetch_all(&mut *tx)
            .await
            .map_err(db)?;
            if mode == Mode::Start {
                return refuse(format!(
                    "publication {publication_name:?} has a row filter or column list on {}: \
                     changes it leaves out would never reach nodes",
                    names.join(", ")
                ));
            }
            // Out, then in again whole below (a mapped table) or through
            // its mapped ancestor (a partition).
            for name in &names {
                sqlx::query(&format!(
                    "ALTER PUBLICATION {} DROP TABLE {name}",
                    ident(publication_name)
                ))
                .execute(&mut *tx)
                .await
                .map_err(db)?;
            }
            changed.push(format!(
                "removed the row filter or column list on {}",
                names.join(", ")
            ));
            owe_all = true;
        }
        let listed: HashSet<u32> = members
            .rels
            .iter()
            .filter(|(o, f)| !(*f && tree.contains(o)))
            .map(|(o, _)| *o)
            .collect();
        for t in &existing {
            let member = p.all_tables
                || t.namespace.is_some_and(|n| members.schemas.contains(&n))
                || t.lineage.iter().any(|o| listed.contains(o));
            if member || !matches!(t.kind.as_deref(), Some("r" | "p")) {
                continue;
            }
            sqlx::query(&format!(
                "ALTER PUBLICATION {} ADD TABLE {}",
                ident(publication_name),
                quoted(&t.relation)
            ))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
            // Its changes until now were never streamed.
            changed.push(format!("added {} to the publication", quoted(&t.relation)));
            owe.push(t.relation.clone());
        }
    }

    // Shapes.
    let Some(mut record) = state::Record::read(&mut tx, publication_name).await? else {
        return Err(db(
            "the publication vanished inside the check's transaction",
        ));
    };
    let now: Vec<Shape> = tables
        .iter()
        .map(|t| Shape {
            schema: t.relation.0.clone(),
            name: t.relation.1.clone(),
            oid: t.oid,
            partitions: t.partitions.clone(),
        })
        .collect();
    let slot_record = record.slot(slot);
    match &slot_record.shapes {
        // Never checked, or wiped: what happened before now is unknown.
        None => owe_all = true,
        Some(before) => {
            for shape in &now {
                let was = before
                    .iter()
                    .find(|b| b.schema == shape.schema && b.name == shape.name);
                // A table newly mapped has no shape yet: the addition to
                // the publication above owes its resync.
                if let Some(was) = was
                    && was != shape
                {
                    changed.push(format!(
                        "{} changed shape (dropped, replaced, or partitions detached or attached)",
                        quoted(&(shape.schema.clone(), shape.name.clone()))
                    ));
                    owe.push((shape.schema.clone(), shape.name.clone()));
                }
            }
        }
    }
    slot_record.shapes = Some(now);
    if owe_all || !owe.is_empty() {
        tracing::debug!(
            slot,
            ?mode,
            owe_all,
            ?owe,
            ?changed,
            "cdc relay: the check owes a resync"
        );
    }
    if owe_all {
        slot_record.owed.push(Debt {
            token: state::token(),
            tables: None,
        });
    } else if !owe.is_empty() {
        owe.sort();
        owe.dedup();
        slot_record.owed.push(Debt {
            token: state::token(),
            tables: Some(owe),
        });
    }
    record.write(&mut tx, publication_name).await?;
    tx.commit().await.map_err(db)?;
    Ok(changed)
}
