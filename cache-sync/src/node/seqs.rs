//! Gap tracking: the last sequence number seen per publisher and cache.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use hashbrown::HashTable;
use tokio::time::Instant;

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
    /// Announcements this node is behind, oldest first: deadlines are
    /// arrival plus the node's one reorder window, so the queue is in
    /// deadline order. At most one per (publisher, cache), in `checking`.
    checks: VecDeque<Check>,
    checking: HashTable<(u64, String)>,
}

/// A publisher announced `seq` for `cache` while the node's last was below
/// it: unless the events up to `seq` arrive by `deadline`, they were lost.
struct Check {
    publisher: u64,
    cache: String,
    seq: u64,
    deadline: Instant,
}

/// Events a node has not seen and will not wait for any longer: numbers
/// `from..=to` of a publisher for a cache.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Missing {
    pub(super) publisher: u64,
    pub(super) cache: String,
    pub(super) from: u64,
    pub(super) to: u64,
}

/// Bounds memory when publishers come and go: forgetting baselines only
/// delays gap detection for the next event of each, it never raises a false one.
pub(super) const MAX_TRACKED_PUBLISHERS: usize = 100_000;

/// Bounds the pending announcement checks. At the bound a new one is
/// answered at once (a resync) rather than dropped: a dropped check would be
/// a loss nobody notices.
pub(super) const MAX_PENDING_CHECKS: usize = 10_000;

impl PublisherSeqs {
    /// After a loss every cache was resynced: nothing before now matters.
    pub(super) fn clear(&mut self) {
        self.last.clear();
        self.tracked = 0;
        self.distrusted.clear();
        self.checks.clear();
        self.checking.clear();
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

    /// The last number seen from `publisher` for `cache`, if known.
    fn last(&self, publisher: u64, cache: &str) -> Option<u64> {
        let hash = self.hasher.hash_one((publisher, cache));
        self.last
            .find(hash, |e| e.0 == publisher && e.1 == cache)
            .map(|e| e.2)
    }

    /// `publisher` announced `seq` as its last number for `cache`. Returns
    /// the events to answer as lost now: from an unknown publisher on a
    /// distrusted cache (as [`observe`](Self::observe) does for a first
    /// event above 1), or when the pending checks are at their bound.
    /// Otherwise a node that is behind checks again at `deadline`
    /// ([`due`](Self::due)), and an unknown publisher's `seq` becomes its
    /// baseline.
    pub(super) fn announced(
        &mut self,
        publisher: u64,
        cache: &str,
        seq: u64,
        deadline: Instant,
    ) -> Option<Missing> {
        let missing = |from| Missing {
            publisher,
            cache: cache.to_owned(),
            from,
            to: seq,
        };
        if seq == 0 {
            // No publisher numbers an event 0: it vouches for nothing.
            return None;
        }
        let Some(last) = self.last(publisher, cache) else {
            let distrusted = self.distrusted.contains(cache);
            let _ = self.observe(publisher, cache, seq);
            return distrusted.then(|| missing(1));
        };
        if last >= seq {
            return None;
        }
        let hash = self.hasher.hash_one((publisher, cache));
        if self
            .checking
            .find(hash, |e| e.0 == publisher && e.1 == cache)
            .is_some()
        {
            // The earlier check covers the older numbers first; if the node
            // is still behind this one afterwards, a repeat announces it again.
            return None;
        }
        if self.checks.len() >= MAX_PENDING_CHECKS {
            let _ = self.observe(publisher, cache, seq);
            return Some(missing(last.saturating_add(1)));
        }
        let hasher = &self.hasher;
        self.checking
            .insert_unique(hash, (publisher, cache.to_owned()), |e| {
                hasher.hash_one((e.0, e.1.as_str()))
            });
        self.checks.push_back(Check {
            publisher,
            cache: cache.to_owned(),
            seq,
            deadline,
        });
        None
    }

    /// When the earliest pending check falls due.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.checks.front().map(|c| c.deadline)
    }

    /// The next check due at `now` whose events have not all arrived; each
    /// answered this way counts as seen, so it is not answered twice.
    pub(super) fn due(&mut self, now: Instant) -> Option<Missing> {
        while self.checks.front().is_some_and(|c| c.deadline <= now) {
            let check = self.checks.pop_front()?;
            let hash = self
                .hasher
                .hash_one((check.publisher, check.cache.as_str()));
            if let Ok(entry) = self
                .checking
                .find_entry(hash, |e| e.0 == check.publisher && e.1 == check.cache)
            {
                entry.remove();
            }
            // A baseline forgotten meanwhile (the bound on publishers) may
            // have hidden the events' arrival: a needless resync, never a
            // missed loss.
            let last = self.last(check.publisher, &check.cache).unwrap_or(0);
            if last >= check.seq {
                continue;
            }
            let _ = self.observe(check.publisher, &check.cache, check.seq);
            return Some(Missing {
                publisher: check.publisher,
                from: last.saturating_add(1),
                to: check.seq,
                cache: check.cache,
            });
        }
        None
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
