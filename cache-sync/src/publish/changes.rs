//! Changes built from typed keys and rows, packed into as few as fit a
//! size budget, as the outbox stores them (what one row may hold). A
//! publisher builds its own in their wire form (`wire::Outgoing`), packed
//! by the same rule.

#[cfg(feature = "_outbox")]
use serde::Serialize;

use crate::error::{Error, Result};
#[cfg(feature = "_outbox")]
use crate::wire::encode_part;
use crate::wire::{Change, EntryVersion, KeyVersion, framed_len};

/// Drops `keys`, each at its version if any.
#[cfg(feature = "_outbox")]
pub(crate) fn invalidations<K: Serialize>(
    keys: impl IntoIterator<Item = (K, Option<u64>)>,
    budget: usize,
) -> Result<Vec<Change>> {
    let mut items = Vec::new();
    for (k, version) in keys {
        items.push(KeyVersion {
            key: encode_part(&k, "key")?,
            version,
        });
    }
    split_invalidations(items, budget)
}

/// Installs these entries, each at its version if any.
#[cfg(feature = "_outbox")]
pub(crate) fn refreshes<K: Serialize, V: Serialize>(
    entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
    budget: usize,
) -> Result<Vec<Change>> {
    let mut items = Vec::new();
    for (k, v, version) in entries {
        items.push(EntryVersion {
            key: encode_part(&k, "key")?,
            value: encode_part(&v, "value")?,
            version,
        });
    }
    split_refreshes(items, budget)
}

/// A table replaced wholesale: a clear at `version` first, so rows the new
/// table lacks disappear and no older refresh can return, then the rows at
/// the same version.
#[cfg(feature = "_outbox")]
pub(crate) fn replacement<'a, K: Serialize + 'a, V: Serialize + 'a>(
    rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    version: u64,
    budget: usize,
) -> Result<Vec<Change>> {
    let mut changes = vec![Change::Clear {
        version: Some(version),
    }];
    changes.extend(refreshes(
        rows.into_iter().map(|(k, r)| (k, r, Some(version))),
        budget,
    )?);
    Ok(changes)
}

/// Splits an already built change (the outbox relay's, stored before the
/// publisher's limit was known) as `budget` needs. An entry that can never
/// fit is [`Error::TooLarge`].
#[cfg(any(feature = "_sql", feature = "mysql-cdc"))]
pub(crate) fn resplit(change: Change, budget: usize) -> Result<Vec<Change>> {
    match change {
        Change::Invalidate { keys } => split_invalidations(keys, budget),
        Change::Refresh { entries } => split_refreshes(entries, budget),
        clear @ Change::Clear { .. } => Ok(vec![clear]),
    }
}

fn split_invalidations(keys: Vec<KeyVersion>, budget: usize) -> Result<Vec<Change>> {
    split(
        keys,
        budget,
        |k| framed_len(&[&k.key]),
        |keys| Change::Invalidate { keys },
    )
}

fn split_refreshes(entries: Vec<EntryVersion>, budget: usize) -> Result<Vec<Change>> {
    split(
        entries,
        budget,
        |e| framed_len(&[&e.key, &e.value]),
        |entries| Change::Refresh { entries },
    )
}

/// Packs items into as few changes as fit `budget` bytes of items each.
fn split<T>(
    items: Vec<T>,
    budget: usize,
    size: impl Fn(&T) -> usize,
    make: impl Fn(Vec<T>) -> Change,
) -> Result<Vec<Change>> {
    let mut changes = Vec::new();
    let mut batch = Vec::new();
    let mut used = 0usize;
    for item in items {
        let n = size(&item);
        if n > budget {
            return Err(Error::TooLarge {
                what: "entry",
                size: n,
                limit: budget,
            });
        }
        if used.saturating_add(n) > budget && !batch.is_empty() {
            changes.push(make(std::mem::take(&mut batch)));
            used = 0;
        }
        used = used.saturating_add(n);
        batch.push(item);
    }
    if !batch.is_empty() {
        changes.push(make(batch));
    }
    Ok(changes)
}
