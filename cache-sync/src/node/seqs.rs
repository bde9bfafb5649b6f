//! Gap tracking: the last sequence number seen per publisher and cache.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use crate::util::{HashSet, Hasher};

/// Last sequence number seen per (publisher, cache), to detect gaps.
/// Keyed by publisher first, so a lookup by `&str` allocates nothing.
#[derive(Default)]
pub(super) struct PublisherSeqs {
    /// (publisher, cache, last seq), found with one hash of both: a
    /// table keyed by the pair would need an owned key to look up.
    last: HashTable<(u64, String, u64)>,
    hasher: Hasher,
    pub(super) tracked: usize,
    /// Caches whose unknown publishers are not taken on trust: every cache
    /// held when the subscription last resumed, until it is resynced.
    pub(super) distrusted: HashSet<String>,
}

/// Bounds memory when publishers come and go: forgetting baselines only
/// delays gap detection for the next event of each, it never raises a false one.
pub(super) const MAX_TRACKED_PUBLISHERS: usize = 100_000;

impl PublisherSeqs {
    /// After a loss every cache was resynced: nothing before now matters.
    pub(super) fn clear(&mut self) {
        self.last.clear();
        self.tracked = 0;
        self.distrusted.clear();
    }

    /// The subscription resumed from a position. Had the transport's history
    /// been replaced unnoticed in between, a publisher's earlier events
    /// would be gone, and only a known baseline could tell; so for these
    /// caches, a publisher's first event after a start counts as a gap.
    pub(super) fn resumed(&mut self, caches: impl IntoIterator<Item = String>) {
        self.distrusted.extend(caches);
    }

    /// `cache` was resynced: what any publisher sent it before is moot.
    pub(super) fn resynced(&mut self, cache: &str) {
        self.distrusted.remove(cache);
    }

    /// Records `seq`; returns how many events may have been missed before
    /// it, if any. Checked arithmetic throughout: `seq` comes off the wire.
    pub(super) fn observe(&mut self, publisher: u64, cache: &str, seq: u64) -> Option<u64> {
        let hash = self.hasher.hash_one((publisher, cache));
        let same = |e: &(u64, String, u64)| e.0 == publisher && e.1 == cache;
        if let Some((.., last)) = self.last.find_mut(hash, same) {
            // A redelivery (seq <= last) is applied again but does not move back.
            let missed = seq.checked_sub(*last).and_then(|d| d.checked_sub(1));
            *last = (*last).max(seq);
            return missed.filter(|&m| m > 0);
        }
        if self.tracked >= MAX_TRACKED_PUBLISHERS {
            // Forgetting baselines is safe here, not after a resume: the
            // caches stay distrusted.
            self.last.clear();
            self.tracked = 0;
        }
        let hasher = &self.hasher;
        self.last
            .insert_unique(hash, (publisher, cache.to_owned(), seq), |e| {
                hasher.hash_one((e.0, e.1.as_str()))
            });
        self.tracked = self.tracked.saturating_add(1);
        // A publisher's first event (seq 1) vouches for everything before it.
        (seq > 1 && self.distrusted.contains(cache)).then(|| seq.saturating_sub(1))
    }
}
