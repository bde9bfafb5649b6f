//! Judging an entry: the node's side as read, compared with the source's
//! row.

use std::hash::Hash;
use std::num::NonZeroU64;

use serde::Serialize;

use super::sweep::Seen;
use super::values::fingerprint;
use super::{Auditor, Row};
use crate::cache::Inner;
use crate::util::lock;

/// What a comparison says of one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verdict {
    Agrees,
    Behind,
    /// No version to compare and values are not compared.
    Unverified,
}

/// The node's entry for a key: the table's stamp when read, the version
/// the held value was installed at, and its value, where values are
/// compared.
pub(super) struct Held<V> {
    pub(super) token: u64,
    pub(super) version: Option<u64>,
    value: HeldValue<V>,
}

/// The node's value, as far as it was read.
enum HeldValue<V> {
    /// Values are not compared.
    NotCompared,
    /// Read with moka's `get`.
    Read(V),
    /// Not read: the fingerprint of the value the sweep read, which no
    /// stamped write has replaced since (and moka held the key).
    Seen(NonZeroU64),
}

/// Compares the node's entry, installed at `version`, with the source's
/// row (`None`: no row), given whether their values are equal (`None`:
/// not compared). A caller may leave the values uncompared where this
/// does not look at them: no row, or a row below `version`.
fn verdict<V>(version: Option<u64>, row: Option<&Row<V>>, same_value: Option<bool>) -> Verdict {
    let Some((_, row_version)) = row else {
        // The node holds a value for a row the source does not have.
        return Verdict::Behind;
    };
    match (version, row_version) {
        // The source lags the node (a replica): not the node's fault.
        (Some(h), Some(r)) if source_lags(h, *r) => Verdict::Agrees,
        (Some(h), Some(r)) if h == *r => match same_value {
            Some(false) => Verdict::Behind,
            _ => Verdict::Agrees,
        },
        (Some(_), Some(_)) => match same_value {
            Some(true) => Verdict::Agrees,
            _ => Verdict::Behind,
        },
        _ => match same_value {
            Some(true) => Verdict::Agrees,
            Some(false) => Verdict::Behind,
            None => Verdict::Unverified,
        },
    }
}

/// Whether the source's row, at `row`, is below the version the node's
/// value was installed at, `held`: a lagging replica, which agrees
/// whatever the values (see [`verdict`]).
fn source_lags(held: u64, row: u64) -> bool {
    held > row
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// The node's entry for `key`, read under its stripe so no write to it
    /// is half done; `None` if it holds none. Where values are compared,
    /// the value is left unread if it can be: moka counts a `get` as an
    /// access (for its eviction policy, and its time-to-idle, which an
    /// auditor reading every entry each sweep would never let pass: issue
    /// 35, item 8), and `contains_key` and its iteration count none. So if
    /// the sweep fingerprinted the value (`seen`: the fingerprint, and the
    /// table's stamp before the sweep) and no write to the key was stamped
    /// since, the fingerprint stands for it (see [`judge`](Self::judge));
    /// only a key written since, which that write has just accessed
    /// anyway, or one without a fingerprint (a value that does not encode,
    /// a suspect read again) is read with `get` here.
    pub(super) async fn held(&self, key: &K, seen: Option<Seen>) -> Option<Held<V>> {
        let auditor = self.audit.as_ref()?;
        let _stripe = self.write_locks[self.stripe(key)].lock().await;
        let (token, version, seen) = {
            let table = lock(&self.table);
            let seen = seen
                .filter(|(_, since)| !table.superseded(key, *since))
                .map(|(fingerprint, _)| fingerprint);
            (table.load_token(), table.held_at(key), seen)
        };
        let value = match (auditor.audit.values, seen) {
            (Some(_), Some(seen)) if self.cache.contains_key(key) => HeldValue::Seen(seen),
            (Some(_), Some(_)) => return None,
            (Some(_), None) => HeldValue::Read(self.cache.get(key).await?),
            (None, _) if self.cache.contains_key(key) => HeldValue::NotCompared,
            (None, _) => return None,
        };
        Some(Held {
            token,
            version,
            value,
        })
    }

    /// Judges the node's entry, as [`held`](Self::held) read it, against
    /// the source's row (`None`: no row). A value left unread (its
    /// fingerprint) agrees if the row's value encodes to the same
    /// fingerprint, with no access; otherwise, where the verdict looks at
    /// the values, it is read now with `get` and compared as
    /// [`Audit::compare_values`](super::Audit::compare_values) says, if
    /// the entry is still the one read first (see
    /// [`value_now`](Self::value_now)). `None`: it is not, or moka no
    /// longer holds it, and there is nothing to judge.
    pub(super) async fn judge(
        &self,
        auditor: &Auditor<K, V>,
        key: &K,
        held: Held<V>,
        row: Option<&Row<V>>,
    ) -> Option<Verdict> {
        let same_value = match (auditor.audit.values, held.value, row) {
            (Some(values), HeldValue::Read(value), Some((source, _))) => {
                Some((values.same)(&value, source))
            }
            (Some(values), HeldValue::Seen(seen), Some((source, source_version))) => {
                let lags = held
                    .version
                    .zip(*source_version)
                    .is_some_and(|(h, r)| source_lags(h, r));
                if fingerprint(values, &auditor.fingerprints, source) == Some(seen) {
                    // The same encoding as the value the sweep read, which
                    // is still the one held: equal.
                    Some(true)
                } else if lags {
                    // Agrees whatever the values.
                    None
                } else {
                    let value = self.value_now(key, held.token, held.version).await?;
                    Some((values.same)(&value, source))
                }
            }
            // No row, which is behind whatever the value, or values not
            // compared.
            _ => None,
        };
        Some(verdict(held.version, row, same_value))
    }

    /// The node's value for `key`, read with `get` under its stripe after
    /// the source's row, if the entry is still the one [`held`](Self::held)
    /// read: no write to the key stamped since `token`, and its value
    /// installed at the same `version`. Otherwise `None`: a write landing
    /// after the node's side was read, judged against a row read before
    /// it, would look behind (the order `audit_round` keeps for this
    /// reason), and it explains any difference anyway. An install no stamp
    /// shows (an entry moka expired, loaded again without a version) is
    /// read and judged; the grace window's second read, with `get`, judges
    /// a suspect it makes again before anything counts.
    async fn value_now(&self, key: &K, token: u64, version: Option<u64>) -> Option<V> {
        let _stripe = self.write_locks[self.stripe(key)].lock().await;
        {
            let table = lock(&self.table);
            if table.superseded(key, token) || table.held_at(key) != version {
                return None;
            }
        }
        self.cache.get(key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_hold_a_lagging_source_against_nobody() {
        // The node's value installed at `version`, against a row, with the
        // values compared or not.
        let judge =
            |version: Option<u64>, held: &str, row: Option<(&str, Option<u64>)>, compared: bool| {
                let row = row.map(|(v, ver)| (v.to_owned(), ver));
                let same = row.as_ref().filter(|_| compared).map(|(v, _)| v == held);
                verdict(version, row.as_ref(), same)
            };
        // By version alone.
        assert_eq!(
            judge(Some(5), "a", Some(("b", Some(6))), false),
            Verdict::Behind
        );
        assert_eq!(
            judge(Some(6), "a", Some(("b", Some(6))), false),
            Verdict::Agrees
        );
        assert_eq!(
            judge(Some(7), "a", Some(("b", Some(6))), false),
            Verdict::Agrees
        );
        assert_eq!(
            judge(None, "a", Some(("b", Some(6))), false),
            Verdict::Unverified
        );
        assert_eq!(judge(Some(1), "a", None, false), Verdict::Behind);
        // With values.
        assert_eq!(
            judge(Some(6), "a", Some(("b", Some(6))), true),
            Verdict::Behind
        );
        assert_eq!(
            judge(Some(5), "b", Some(("b", Some(6))), true),
            Verdict::Agrees
        );
        assert_eq!(
            judge(Some(7), "a", Some(("b", Some(6))), true),
            Verdict::Agrees
        );
        assert_eq!(
            judge(None, "a", Some(("b", Some(6))), true),
            Verdict::Behind
        );
        assert_eq!(judge(None, "b", Some(("b", None)), true), Verdict::Agrees);
        assert_eq!(judge(None, "b", None, true), Verdict::Behind);
        // What `judge` leaves uncompared: no row, or a lagging source.
        assert_eq!(verdict::<String>(None, None, None), Verdict::Behind);
        assert!(source_lags(7, 6) && !source_lags(6, 6) && !source_lags(5, 6));
    }
}
