//! Committed transactions gathered into one publish per cache.
//!
//! Within a batch, a key keeps only its last change: every change of one
//! transaction carries the same version (the commit LSN), and a node
//! applies a second change at an equal version as no news, so an insert
//! then a delete of one key in one transaction must reach nodes as the
//! delete alone. Across transactions the later one (a higher LSN) wins
//! anyway, so keeping the last is what nodes would end up with.

use std::collections::HashMap;

use bytes::Bytes;

use crate::error::Result;
use crate::publish::Publisher;
use crate::wire::{Change, EntryVersion, KeyVersion};

/// Bytes of keys and values one transaction may gather for one cache
/// before the rest becomes a clear, like the row cap: what the relay holds
/// for a transaction is bounded in bytes, not only in rows.
pub(crate) const MAX_TRANSACTION_BYTES: usize = 64 << 20;

#[derive(Debug, Default)]
pub(crate) struct Batch {
    caches: HashMap<String, Pending>,
    /// Row changes taken into the batch (before merging).
    pub(crate) rows: u64,
    /// Bytes of keys and values taken in (before merging).
    pub(crate) bytes: usize,
    /// The transactions in it, by xid, for the visibility check.
    pub(crate) xids: Vec<u32>,
    pub(crate) transactions: u64,
}

#[derive(Debug, Default)]
struct Pending {
    /// A clear at this version, sent before the keys.
    clear: Option<u64>,
    /// Key → the value to install (`None`: drop it) and its version.
    keys: HashMap<Bytes, (Option<Bytes>, u64)>,
    /// Row changes of the open transaction, against its cap.
    in_transaction: usize,
    /// And their bytes, against `MAX_TRANSACTION_BYTES`.
    bytes_in_transaction: usize,
    /// The open transaction went past its cap: its clear covers the rest.
    saturated: bool,
}

impl Batch {
    pub(crate) fn is_empty(&self) -> bool {
        self.caches.is_empty() && self.xids.is_empty()
    }

    /// The open transaction (gathered in this batch) changed `key` of
    /// `cache`. `cap`: how many row
    /// changes one transaction may make to one cache before the rest
    /// become a clear at its version (a 100,000-row migration reaches
    /// nodes as one clear, not 100,000 events to every node).
    pub(crate) fn key(
        &mut self,
        cache: &str,
        key: Bytes,
        value: Option<Bytes>,
        version: u64,
        cap: usize,
    ) -> bool {
        self.rows = self.rows.saturating_add(1);
        let pending = self.pending(cache);
        if pending.saturated {
            return false;
        }
        let size = key
            .len()
            .saturating_add(value.as_ref().map_or(0, Bytes::len));
        pending.in_transaction = pending.in_transaction.saturating_add(1);
        pending.bytes_in_transaction = pending.bytes_in_transaction.saturating_add(size);
        if pending.in_transaction > cap || pending.bytes_in_transaction > MAX_TRANSACTION_BYTES {
            pending.clear_at(version);
            pending.saturated = true;
            return true;
        }
        pending.keys.insert(key, (value, version));
        self.bytes = self.bytes.saturating_add(size);
        false
    }

    /// The open transaction changed a row of `mapping`'s table: its key
    /// (with the value to install), or, when the row did not tell the key,
    /// a clear of the cache. `relay` names the relay in the logs.
    pub(crate) fn change(
        &mut self,
        relay: &str,
        mapping: &super::Mapping,
        key: Option<Bytes>,
        value: Option<Bytes>,
        version: u64,
        cap: usize,
    ) {
        let m = mapping;
        match key {
            Some(key) => {
                if self.key(&m.cache, key, value, version, cap) {
                    tracing::info!(relay, cache = %m.cache, version, cap, "cdc relay: a transaction changed more rows of the table than the cap; clearing the cache instead");
                }
            }
            None => {
                tracing::warn!(relay, cache = %m.cache, table = %m.relation(), version, "cdc relay: a change's key could not be read from its row (a key outside the replica identity or the binlog's row image?); clearing the cache");
                self.clear(&m.cache, version);
            }
        }
    }

    /// A clear of `cache` at `version` (a TRUNCATE, a key the row could
    /// not tell, a resync). Later changes of the same transaction still
    /// count: a TRUNCATE followed by INSERTs leaves those rows.
    pub(crate) fn clear(&mut self, cache: &str, version: u64) {
        self.pending(cache).clear_at(version);
    }

    /// The open transaction, gathered in `open`, committed: its changes
    /// join this batch, after everything in it, and `open` is empty again.
    /// Its xid is kept for the visibility check only if it changed
    /// anything here.
    pub(crate) fn absorb(&mut self, open: &mut Batch, xid: Option<u32>) {
        let touched = !open.caches.is_empty();
        for (cache, p) in open.caches.drain() {
            let target = self.pending(&cache);
            if let Some(version) = p.clear {
                target.clear_at(version);
            }
            target.keys.extend(p.keys);
        }
        self.rows = self.rows.saturating_add(std::mem::take(&mut open.rows));
        self.bytes = self.bytes.saturating_add(std::mem::take(&mut open.bytes));
        if touched && let Some(xid) = xid {
            self.xids.push(xid);
        }
        self.transactions = self.transactions.saturating_add(1);
    }

    /// Forgets everything (an open transaction given up).
    #[cfg_attr(not(feature = "postgres-cdc"), allow(dead_code))]
    pub(crate) fn reset(&mut self) {
        *self = Batch::default();
    }

    /// Everything gathered, per cache, as the changes to publish: a clear
    /// first, then the keys. Empties the batch.
    pub(crate) fn take(&mut self) -> Vec<(String, Vec<Change>)> {
        self.rows = 0;
        self.bytes = 0;
        self.xids.clear();
        self.transactions = 0;
        let mut out = Vec::with_capacity(self.caches.len());
        for (cache, pending) in self.caches.drain() {
            let mut changes = Vec::new();
            if let Some(version) = pending.clear {
                changes.push(Change::Clear {
                    version: Some(version),
                });
            }
            let mut keys = Vec::new();
            let mut entries = Vec::new();
            for (key, (value, version)) in pending.keys {
                match value {
                    Some(value) => entries.push(EntryVersion {
                        key,
                        value,
                        version: Some(version),
                    }),
                    None => keys.push(KeyVersion {
                        key,
                        version: Some(version),
                    }),
                }
            }
            if !keys.is_empty() {
                changes.push(Change::Invalidate { keys });
            }
            if !entries.is_empty() {
                changes.push(Change::Refresh { entries });
            }
            out.push((cache, changes));
        }
        out
    }

    fn pending(&mut self, cache: &str) -> &mut Pending {
        if !self.caches.contains_key(cache) {
            self.caches.insert(cache.to_owned(), Pending::default());
        }
        self.caches.get_mut(cache).expect("inserted above")
    }
}

impl Pending {
    fn clear_at(&mut self, version: u64) {
        self.clear = Some(self.clear.map_or(version, |v| v.max(version)));
        // Every key gathered so far is older or as old: the clear covers it.
        self.keys.clear();
    }
}

/// Publishes one cache's changes. An entry that can never fit the
/// publisher's size limit is sent as an invalidation of its own key, and a
/// key that cannot fit either as a clear: never dropped, and never more
/// than that entry made an invalidation (the others of its change go as
/// they are).
pub(crate) async fn publish(
    publisher: &Publisher,
    cache: &str,
    changes: Vec<Change>,
) -> Result<()> {
    let mut split = Vec::new();
    // A clear in place of keys that fit in no form, at their newest version.
    let mut fallback: Option<Option<u64>> = None;
    let mut clear_at = |version: Option<u64>| {
        tracing::warn!(
            cache,
            "cdc relay: a key is over the event size limit; clearing the cache instead"
        );
        fallback = Some(fallback.flatten().max(version));
    };
    for change in changes {
        match publisher.resplit(change.clone()) {
            Ok(parts) => split.extend(parts),
            Err(e) if e.is_too_large() => match change {
                Change::Refresh { entries } => {
                    let mut fit = Vec::new();
                    let mut keys = Vec::new();
                    for entry in entries {
                        let key = KeyVersion {
                            key: entry.key.clone(),
                            version: entry.version,
                        };
                        let version = entry.version;
                        let one = Change::Refresh {
                            entries: vec![entry],
                        };
                        if publisher.resplit(one.clone()).is_ok() {
                            let Change::Refresh { entries } = one else {
                                unreachable!("built above")
                            };
                            fit.extend(entries);
                        } else if fits_invalidation(publisher, &key) {
                            tracing::warn!(
                                cache,
                                "cdc relay: an entry is over the event size limit; invalidating its key instead"
                            );
                            keys.push(key);
                        } else {
                            clear_at(version);
                        }
                    }
                    split.extend(publisher.resplit(Change::Invalidate { keys })?);
                    split.extend(publisher.resplit(Change::Refresh { entries: fit })?);
                }
                Change::Invalidate { keys } => {
                    let mut fit = Vec::new();
                    for key in keys {
                        if fits_invalidation(publisher, &key) {
                            fit.push(key);
                        } else {
                            clear_at(key.version);
                        }
                    }
                    split.extend(publisher.resplit(Change::Invalidate { keys: fit })?);
                }
                // A clear carries no key: it always fits.
                Change::Clear { version } => clear_at(version),
            },
            Err(e) => return Err(e),
        }
    }
    if let Some(version) = fallback {
        split.insert(0, Change::Clear { version });
    }
    publisher
        .send(cache, crate::wire::Outgoing::from_changes(split))
        .await
        .map(|_| ())
}

fn fits_invalidation(publisher: &Publisher, key: &KeyVersion) -> bool {
    publisher
        .resplit(Change::Invalidate {
            keys: vec![key.clone()],
        })
        .is_ok()
}
