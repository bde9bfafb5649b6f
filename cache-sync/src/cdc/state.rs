//! What a relay group keeps on the database, between its relays and across
//! their restarts: a small JSON record, per slot, in the comment on the
//! publication (the one object the relays own whose lifetime is the
//! stream's: dropping the publication breaks the slot's stream anyway, and
//! starts a new slot with a resync of everything).
//!
//! Per slot it holds:
//! - the resyncs **owed**: written (durably) before whatever makes them
//!   owed, and cleared in the transaction that writes the resync message,
//!   whose commit also makes the message durable. Whoever finds one owed
//!   writes the message: a relay that dies in between leaves it to the
//!   next, never lost. A relay about to create the slot owes only while
//!   the slot is missing, under the lock every settle takes: one that
//!   loses the race to create it owes nothing, or owes before the winner
//!   settles both debts in one message (and takes back its debt, by its
//!   token, if that is still owed), so the slot is resynced once;
//! - the LSN of the last resync **done** (its clears published): a server
//!   that crashed forgets the slot's confirmed position back to its last
//!   checkpoint and streams the message again, which must not clear every
//!   node a second time;
//! - each mapped table's **shape** when last checked: its oid and its
//!   partitions'. Detaching, attaching or dropping a partition, or dropping
//!   or replacing the table, changes which rows the table has without a
//!   row change in the log; the relay finds it by comparing shapes, and
//!   owes a resync of the table.
//!
//! Every change is made under the publication's advisory lock, read and
//! written in one transaction, so relays of several slots sharing a
//! publication, or a relay and its standbys, never lose each other's
//! writes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use super::slot::{RESYNC_PREFIX, db, ident, literal};
use crate::error::Result;

/// A relation by schema and name, as PostgreSQL stores them.
pub(crate) type Relation = (String, String);

/// The whole comment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct Document {
    /// Marks the comment as this record (and its format).
    #[serde(rename = "cache-sync cdc")]
    format: u32,
    #[serde(default)]
    slots: BTreeMap<String, SlotRecord>,
}

const FORMAT: u32 = 1;

/// One slot's record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct SlotRecord {
    #[serde(default)]
    pub(crate) owed: Vec<Debt>,
    #[serde(default)]
    pub(crate) done: u64,
    /// `None`: never checked (a new slot, or a record an operator wiped).
    #[serde(default)]
    pub(crate) shapes: Option<Vec<Shape>>,
}

/// A resync owed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Debt {
    pub(crate) token: u64,
    /// The mapped tables whose caches it clears; `None`: every one.
    pub(crate) tables: Option<Vec<Relation>>,
}

/// A mapped table's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Shape {
    pub(crate) schema: String,
    pub(crate) name: String,
    /// The table's oid; `None` when no table has the name.
    pub(crate) oid: Option<u32>,
    /// Its partitions at every level, sorted.
    pub(crate) partitions: Vec<u32>,
}

/// What a resync message clears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Scope {
    All,
    Tables(Vec<Relation>),
}

/// A scoped message's content.
#[derive(Serialize, Deserialize)]
struct Message {
    slot: String,
    tables: Vec<Relation>,
}

impl Scope {
    fn union(debts: &[Debt]) -> Option<Scope> {
        let mut tables = Vec::new();
        for d in debts {
            match &d.tables {
                None => return Some(Scope::All),
                Some(t) => tables.extend(t.iter().cloned()),
            }
        }
        if debts.is_empty() {
            return None;
        }
        tables.sort();
        tables.dedup();
        Some(Scope::Tables(tables))
    }

    /// The message's content: the slot's name alone for everything (what
    /// earlier relays wrote too), else the slot and the tables, in JSON.
    fn content(&self, slot: &str) -> String {
        match self {
            Scope::All => slot.to_owned(),
            Scope::Tables(tables) => serde_json::to_string(&Message {
                slot: slot.to_owned(),
                tables: tables.clone(),
            })
            .unwrap_or_else(|_| slot.to_owned()),
        }
    }

    /// A message's content, if it is addressed to `slot`. Anything else
    /// (another slot's, or a message any role may write that does not
    /// parse) is not this slot's.
    pub(crate) fn parse(content: &[u8], slot: &str) -> Option<Scope> {
        if content == slot.as_bytes() {
            return Some(Scope::All);
        }
        let m: Message = serde_json::from_slice(content).ok()?;
        (m.slot == slot).then_some(Scope::Tables(m.tables))
    }
}

/// Takes the publication's advisory lock for the rest of `conn`'s
/// transaction: every write of the record, and of the publication itself,
/// is made under it.
pub(crate) async fn lock(conn: &mut PgConnection, publication: &str) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("cache-sync cdc publication\n{publication}"))
        .execute(conn)
        .await
        .map_err(db)
        .map(drop)
}

/// The record, read under the lock: `None` when the publication does not
/// exist. A comment that is not a record (an operator's, or one written by
/// hand) reads as an empty record, which the next write replaces: the
/// slot's record is then missing, and the relay resyncs.
pub(crate) struct Record {
    doc: Document,
    read: Document,
}

impl Record {
    pub(crate) async fn read(conn: &mut PgConnection, publication: &str) -> Result<Option<Record>> {
        let row: Option<Option<String>> = sqlx::query_scalar(
            "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
        )
        .bind(publication)
        .fetch_optional(conn)
        .await
        .map_err(db)?;
        let Some(comment) = row else {
            return Ok(None);
        };
        let doc = match comment.as_deref().map(serde_json::from_str::<Document>) {
            Some(Ok(doc)) if doc.format == FORMAT => doc,
            None => Document::default(),
            Some(_) => {
                tracing::warn!(
                    publication,
                    "cdc relay: the publication's comment is not the relays' record (an operator wrote it?); replacing it"
                );
                Document::default()
            }
        };
        Ok(Some(Record {
            read: doc.clone(),
            doc,
        }))
    }

    pub(crate) fn slot(&mut self, slot: &str) -> &mut SlotRecord {
        self.doc.slots.entry(slot.to_owned()).or_default()
    }

    pub(crate) fn get(&self, slot: &str) -> Option<&SlotRecord> {
        self.doc.slots.get(slot)
    }

    /// Writes the record back, if it changed (a write adds WAL, and under
    /// a synchronous standby waits for it: the periodic check must not
    /// write when nothing differs).
    pub(crate) async fn write(mut self, conn: &mut PgConnection, publication: &str) -> Result<()> {
        self.doc.format = FORMAT;
        if self.doc == self.read {
            return Ok(());
        }
        let json = serde_json::to_string(&self.doc).map_err(db)?;
        sqlx::query(&format!(
            "COMMENT ON PUBLICATION {} IS {}",
            ident(publication),
            literal(&json)
        ))
        .execute(conn)
        .await
        .map_err(db)
        .map(drop)
    }
}

/// A fresh token for a debt.
pub(crate) fn token() -> u64 {
    crate::util::random_u64()
}

/// Records, in its own transaction, a resync of `tables` (`None`: all)
/// owed to `slot`; returns the debt's token (`None`: there is no
/// publication to record it on, and whoever creates it owes a resync of
/// everything).
pub(crate) async fn owe(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    tables: Option<Vec<Relation>>,
) -> Result<Option<u64>> {
    let mut tx = pool.begin().await.map_err(db)?;
    lock(&mut tx, publication).await?;
    let Some(mut record) = Record::read(&mut tx, publication).await? else {
        return Ok(None);
    };
    let token = token();
    tracing::debug!(slot, token, ?tables, "cdc relay: a resync owed");
    record.slot(slot).owed.push(Debt { token, tables });
    record.write(&mut tx, publication).await?;
    tx.commit().await.map_err(db)?;
    Ok(Some(token))
}

/// Records, in its own transaction, the resync a slot about to be created
/// owes, if the slot is still missing (or lost) when it is recorded:
/// `Ok(None)` when another relay's slot exists, or is being created
/// (then that relay's debt covers it). Checked under the publication's
/// lock, like every settle, so a relay that loses the race to create the
/// slot either owes nothing, or owes before the winner settles, which
/// then writes one message for both. `Err` when there is no publication.
pub(crate) async fn owe_new_slot(
    pool: &PgPool,
    publication: &str,
    slot: &str,
) -> Result<Option<u64>> {
    let mut tx = pool.begin().await.map_err(db)?;
    lock(&mut tx, publication).await?;
    let Some(mut record) = Record::read(&mut tx, publication).await? else {
        return Err(db(format!(
            "publication {publication:?} does not exist; a slot without it cannot stream"
        )));
    };
    let status: Option<Option<String>> =
        sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
            .bind(slot)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db)?;
    if status.is_some_and(|s| s.as_deref() != Some("lost")) {
        return Ok(None);
    }
    let token = token();
    tracing::debug!(
        slot,
        token,
        "cdc relay: a resync owed to a slot about to be created"
    );
    record.slot(slot).owed.push(Debt {
        token,
        tables: None,
    });
    record.write(&mut tx, publication).await?;
    tx.commit().await.map_err(db)?;
    Ok(Some(token))
}

/// Takes back the debt `token` if it is still owed: its owner's reason
/// for it went away (another relay created the slot, with its own).
pub(crate) async fn forgive(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    token: u64,
) -> Result<()> {
    let mut tx = pool.begin().await.map_err(db)?;
    lock(&mut tx, publication).await?;
    let Some(mut record) = Record::read(&mut tx, publication).await? else {
        return Ok(());
    };
    tracing::debug!(slot, token, "cdc relay: a resync owed is taken back");
    record.slot(slot).owed.retain(|d| d.token != token);
    record.write(&mut tx, publication).await?;
    tx.commit().await.map_err(db)
}

/// Writes the resync message if one is owed to `slot` (one message for
/// every debt), and clears the debts in the same transaction. Returns
/// whether it wrote one.
///
/// Only into a slot that streams from before the message: a slot that is
/// missing, still being created (its starting point not yet found), or
/// lost would never carry it, and the debt would be cleared for nothing.
/// The debt then waits for whoever settles after the slot is made.
pub(crate) async fn settle(pool: &PgPool, publication: &str, slot: &str) -> Result<bool> {
    let mut tx = pool.begin().await.map_err(db)?;
    lock(&mut tx, publication).await?;
    let Some(mut record) = Record::read(&mut tx, publication).await? else {
        return Ok(false);
    };
    let Some(scope) = record.get(slot).and_then(|s| Scope::union(&s.owed)) else {
        return Ok(false);
    };
    let ready: Option<bool> = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn IS NOT NULL AND wal_status IS DISTINCT FROM 'lost' \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db)?;
    if ready != Some(true) {
        return Ok(false);
    }
    tracing::debug!(slot, debts = ?record.get(slot).map(|s| &s.owed), "cdc relay: writing a resync message");
    sqlx::query("SELECT pg_logical_emit_message(false, $1, $2)")
        .bind(RESYNC_PREFIX)
        .bind(scope.content(slot))
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    record.slot(slot).owed.clear();
    record.write(&mut tx, publication).await?;
    tx.commit().await.map_err(db)?;
    Ok(true)
}

/// The LSN of the last resync done for `slot` (0: none recorded).
pub(crate) async fn done(pool: &PgPool, publication: &str, slot: &str) -> Result<u64> {
    let mut conn = pool.acquire().await.map_err(db)?;
    let record = Record::read(&mut conn, publication).await?;
    Ok(record
        .as_ref()
        .and_then(|r| r.get(slot))
        .map_or(0, |s| s.done))
}

/// Records that the resync message at `lsn` was applied (its clears
/// published).
pub(crate) async fn mark_done(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    lsn: u64,
) -> Result<()> {
    let mut tx = pool.begin().await.map_err(db)?;
    lock(&mut tx, publication).await?;
    let Some(mut record) = Record::read(&mut tx, publication).await? else {
        return Ok(());
    };
    let s = record.slot(slot);
    s.done = s.done.max(lsn);
    record.write(&mut tx, publication).await?;
    tx.commit().await.map_err(db)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_read_only_by_its_own_slot() {
        let all = Scope::All.content("s");
        assert_eq!(Scope::parse(all.as_bytes(), "s"), Some(Scope::All));
        assert_eq!(Scope::parse(all.as_bytes(), "t"), None);
        let tables = Scope::Tables(vec![("odd \"s".into(), "t.\u{e9}\n".into())]);
        let content = tables.content("s");
        assert_eq!(Scope::parse(content.as_bytes(), "s"), Some(tables));
        assert_eq!(Scope::parse(content.as_bytes(), "t"), None);
        for garbage in [&b""[..], b"{", b"\xff", b"{\"slot\":1}", b"null"] {
            assert_eq!(Scope::parse(garbage, "s"), None);
        }
    }

    #[test]
    fn debts_add_up_to_one_scope() {
        let t = |n: &str| ("public".to_owned(), n.to_owned());
        let debt = |tables| Debt { token: 1, tables };
        assert_eq!(Scope::union(&[]), None);
        assert_eq!(
            Scope::union(&[debt(Some(vec![t("b")])), debt(Some(vec![t("a"), t("b")]))]),
            Some(Scope::Tables(vec![t("a"), t("b")]))
        );
        assert_eq!(
            Scope::union(&[debt(Some(vec![t("a")])), debt(None)]),
            Some(Scope::All)
        );
    }
}
