//! The sweep: the keys a new sweep takes, in the order of their hash,
//! with their values' fingerprints; and which keys a round reads next:
//! the sweep's, and the suspects due.

use std::hash::{BuildHasher, Hash};
use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use super::values::fingerprint;
use super::{Auditor, State, Suspect};
use crate::cache::Inner;
use crate::util::{HashMap, lock};

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// The keys the cache holds now, for a new sweep, in the order of their
    /// hash (taken from the end), read with moka's iteration, which counts
    /// no access; where values are compared, with a fingerprint of each
    /// value, and no value kept.
    pub(super) async fn sweep(&self, auditor: &Auditor<K, V>) -> Sweep<K> {
        let Some(values) = auditor.audit.values else {
            let entries = self.in_hash_order(|_| ()).await;
            return Sweep {
                keys: entries.into_iter().map(|(k, _)| k).collect(),
                fingerprints: Vec::new(),
                since: 0,
            };
        };
        // The stamp first, then a barrier through every stripe: a write
        // stamped by then holds its stripe until moka has its value, so
        // once the barrier is through, the iteration reads it (or a later
        // write's, which a stamp after this one shows). No stamp shows a
        // load without a version into an entry that moka expired, or that
        // a clear stamped by then emptied after the iteration: the
        // fingerprint is then of a value older than the entry. If it
        // matches the source's row, a wrong entry is left to the next
        // sweep; if not, the entry is read with `get` and judged as it is.
        let since = lock(&self.table).load_token();
        for stripe in &self.write_locks {
            drop(stripe.lock().await);
        }
        // Each value moka's iteration hands over (a clone) is dropped once
        // fingerprinted: the sweep holds 8 bytes a key, not the values.
        let entries = self
            .in_hash_order(|v| fingerprint(values, &auditor.fingerprints, v))
            .await;
        let (keys, fingerprints) = entries.into_iter().unzip();
        Sweep {
            keys,
            fingerprints,
            since,
        }
    }

    /// Every entry moka holds, as `(key, what of its value)`, in descending
    /// order of the key's hash (a sweep takes them from the end). A cache of
    /// 1M entries takes a good part of a second to read and order, so it is
    /// done in slices: a unit of the task's cooperative budget per entry
    /// read (moka's iterator may be held across the yields), then the
    /// entries shared out by the top byte of their hash into 256 buckets,
    /// each sorted on its own, with a unit per bucket: never more than a
    /// bucket's sort (some 4,000 entries for 1M) at a time.
    pub(in crate::cache) async fn in_hash_order<T>(
        &self,
        of: impl Fn(&V) -> T,
    ) -> Vec<(Arc<K>, T)> {
        const BUCKETS: usize = 256;
        let mut buckets: Vec<Vec<(u64, Arc<K>, T)>> =
            std::iter::repeat_with(Vec::new).take(BUCKETS).collect();
        for (k, v) in self.cache.iter() {
            crate::util::pace().await;
            let hash = self.hasher.hash_one(&*k);
            let top = usize::try_from(hash >> 56).unwrap_or(0);
            if let Some(bucket) = buckets.get_mut(top) {
                bucket.push((hash, k, of(&v)));
            }
        }
        let mut out = Vec::with_capacity(buckets.iter().map(Vec::len).sum());
        for mut bucket in buckets.into_iter().rev() {
            crate::util::pace().await;
            bucket.sort_unstable_by_key(|(hash, _, _)| std::cmp::Reverse(*hash));
            out.extend(bucket.into_iter().map(|(_, k, t)| (k, t)));
        }
        out
    }
}

/// The fingerprint of a key's value as its sweep read it, and the version
/// table's stamp before that read (see [`Sweep`]).
pub(super) type Seen = (NonZeroU64, u64);

/// A new sweep: the keys held when it began, in the order it takes them,
/// and, where values are compared, the fingerprints of their values as
/// moka's iteration read them (one for one; `None` for a value that does
/// not encode), and the version table's stamp before that: a write to a
/// key stamped after it may have changed its value since.
pub(super) struct Sweep<K> {
    pub(super) keys: Vec<Arc<K>>,
    pub(super) fingerprints: Vec<Option<NonZeroU64>>,
    pub(super) since: u64,
}

/// The sweep's next `n` keys that are not suspects, each with its value's
/// fingerprint as the sweep read it and the stamp before that read, where
/// values are compared and the value encoded.
pub(super) fn next_keys<K: Hash + Eq>(
    state: &mut State<K>,
    n: usize,
) -> Vec<(Arc<K>, Option<Seen>)> {
    let mut out = Vec::with_capacity(n.min(state.pass.len()));
    while out.len() < n {
        let Some(key) = state.pass.pop() else { break };
        // Popped whether or not the key is skipped, so the two stay one
        // for one.
        let seen = state.seen.pop().flatten().map(|f| (f, state.seen_at));
        if !state.suspects.contains_key(&*key) {
            out.push((key, seen));
        }
    }
    out
}

/// Up to `n` suspects whose grace window is over, counting it from when
/// each was seen or from when the node was last not ready, whichever is
/// later.
pub(super) fn due_keys<K: Clone>(
    suspects: &HashMap<K, Suspect>,
    now: Instant,
    settled_since: Instant,
    grace: Duration,
    n: usize,
) -> Vec<K> {
    suspects
        .iter()
        .filter(|(_, s)| {
            s.observed
                .max(settled_since)
                .checked_add(grace)
                .is_some_and(|at| at <= now)
        })
        .map(|(k, _)| k.clone())
        .take(n)
        .collect()
}
