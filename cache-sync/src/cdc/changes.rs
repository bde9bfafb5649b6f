//! How a session puts each change into its batch: pgoutput messages
//! decoded, rows mapped to their caches' keys and values, and truncates,
//! renamed tables and what does not decode made clears.

use std::sync::Arc;

use super::Row;
use super::batch::Batch;
use super::pgoutput::{self, Message, Relation};
use super::slot::{self, db};
use super::state::Scope;
use super::stream::{SQL_TIMEOUT, Stream};
use crate::error::Result;

impl Stream<'_> {
    /// Where a change goes: the open transaction's batch, or, outside one
    /// (a resync message), the committed batch.
    fn gather(&mut self) -> &mut Batch {
        if self.open.is_some() {
            &mut self.open_batch
        } else {
            &mut self.batch
        }
    }

    fn version(&self) -> u64 {
        self.open.as_ref().map_or(self.last_commit, |o| o.version)
    }

    pub(super) fn clear_all(&mut self, version: u64) {
        self.clear_scope(&Scope::All, version);
    }

    /// Clears the caches of the mapped tables `scope` covers.
    pub(super) fn clear_scope(&mut self, scope: &Scope, version: u64) {
        let inner = self.inner;
        for t in &inner.tables {
            let covered = match scope {
                Scope::All => true,
                Scope::Tables(tables) => tables.iter().any(|(s, n)| *s == t.schema && *n == t.name),
            };
            if covered {
                self.gather().clear(&t.cache, version);
            }
        }
    }

    pub(super) async fn message(&mut self, data: &[u8]) -> Result<()> {
        let version = self.version();
        let message = match pgoutput::decode(data) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!(slot = %self.inner.shared.slot, error = %e, "cdc relay: a change did not decode; clearing every mapped cache");
                self.clear_all(version);
                return Ok(());
            }
        };
        let cap = self.inner.max_rows_per_transaction;
        match message {
            Message::Relation(relation) => self.relation(relation, version).await?,
            Message::Insert { relation, new } => {
                let Some((rel, maps)) = self.lookup(relation) else {
                    return Ok(());
                };
                for &i in maps.iter() {
                    let m = &self.inner.tables[i];
                    let key = m.mapper.key(&Row::new(&rel, &new, false));
                    let value = m.mapper.value(&Row::new(&rel, &new, false));
                    self.key_change(i, key, value, version, cap);
                }
            }
            Message::Update { relation, old, new } => {
                let Some((rel, maps)) = self.lookup(relation) else {
                    return Ok(());
                };
                for &i in maps.iter() {
                    let m = &self.inner.tables[i];
                    // Without an old row the identity did not change: the
                    // key, read from the identity columns only, is the old
                    // one too.
                    let new_key = m.mapper.key(&Row::new(
                        &rel,
                        &new,
                        old.is_none() && rel.replica_identity != b'f',
                    ));
                    if let Some(old) = &old {
                        let old_key = m.mapper.key(&Row::new(&rel, old, false));
                        match (&old_key, &new_key) {
                            (Some(o), Some(n)) if o != n => {
                                self.key_change(i, old_key.clone(), None, version, cap);
                            }
                            (None, _) => {
                                self.key_change(i, None, None, version, cap);
                                continue;
                            }
                            _ => {}
                        }
                    }
                    let value = m
                        .mapper
                        .value(&Row::new(&rel, &new, false).with_before(old.as_ref()));
                    self.key_change(i, new_key, value, version, cap);
                }
            }
            Message::Delete { relation, old } => {
                let Some((rel, maps)) = self.lookup(relation) else {
                    return Ok(());
                };
                for &i in maps.iter() {
                    let key = self.inner.tables[i]
                        .mapper
                        .key(&Row::new(&rel, &old, false));
                    self.key_change(i, key, None, version, cap);
                }
            }
            Message::Truncate { relations } => {
                for id in relations {
                    for &i in self.mapped.get(&id).cloned().as_deref().unwrap_or_default() {
                        let cache = self.inner.tables[i].cache.clone();
                        self.gather().clear(&cache, version);
                    }
                }
            }
            Message::Other(_) => {}
        }
        Ok(())
    }

    /// The relation's shape and mappings: shared, not copied, per change.
    fn lookup(&self, relation: u32) -> Option<(Arc<Relation>, Arc<[usize]>)> {
        let maps = self.mapped.get(&relation)?;
        if maps.is_empty() {
            return None;
        }
        Some((Arc::clone(self.relations.get(&relation)?), Arc::clone(maps)))
    }

    fn key_change(
        &mut self,
        mapping: usize,
        key: Option<bytes::Bytes>,
        value: Option<bytes::Bytes>,
        version: u64,
        cap: usize,
    ) {
        let inner = self.inner;
        let m = &inner.tables[mapping];
        self.gather()
            .change(&inner.shared.slot, m, key, value, version, cap);
    }

    /// A table's (new) shape. It feeds the mappings of its own name, and
    /// those of the partitioned tables it is a partition of: with
    /// `publish_via_partition_root` off, a partition's changes come under
    /// its own name. Its ancestors are read from the catalog as it is now
    /// (the stream does not carry them): a change of a partition since
    /// detached is then not mapped, and the detach's resync, later in the
    /// stream, covers it.
    async fn relation(&mut self, relation: Relation, version: u64) -> Result<()> {
        let ancestors =
            tokio::time::timeout(SQL_TIMEOUT, slot::ancestors(&self.inner.pool, relation.id))
                .await
                .map_err(|_| db("reading a table's partition ancestors timed out"))??;
        let maps: Vec<usize> = self
            .inner
            .tables
            .iter()
            .enumerate()
            .filter(|(_, t)| {
                (t.schema == relation.schema && t.name == relation.name)
                    || ancestors
                        .iter()
                        .any(|(s, n)| *s == t.schema && *n == t.name)
            })
            .map(|(i, _)| i)
            .collect();
        if let Some(before) = self.mapped.get(&relation.id) {
            for &i in before.iter() {
                if !maps.contains(&i) {
                    let t = &self.inner.tables[i];
                    tracing::warn!(cache = %t.cache, table = %t.relation(), now = %format_args!("{}.{}", relation.schema, relation.name), "cdc relay: a mapped table (or a partition of one) was renamed or detached; clearing its cache and no longer following it");
                    let cache = t.cache.clone();
                    self.batch.clear(&cache, version);
                }
            }
        }
        if maps.is_empty() && !self.mapped.contains_key(&relation.id) {
            // In the publication (another relay of the group maps it, or it
            // was renamed), not mapped here.
            tracing::info!(table = %format_args!("{}.{}", relation.schema, relation.name), "cdc relay: changes of a table this relay does not map are ignored");
        }
        self.mapped.insert(relation.id, maps.into());
        self.relations.insert(relation.id, Arc::new(relation));
        Ok(())
    }
}
