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
    /// Announcements this node is behind, in deadline order. At most one
    /// per (publisher, cache), in `checking`.
    checks: VecDeque<Check>,
    /// Per pending check: (publisher, cache, the highest number announced
    /// since, and the end of the reorder window after the announcement that
    /// raised it to that number).
    checking: HashTable<(u64, String, u64, Instant)>,
}

/// A publisher announced `seq` for `cache` while the node's last was below
/// it: unless the events up to `seq` arrive by `deadline`, they were lost.
/// Later announcements raise the check's highest number (in `checking`),
/// not this one: see [`PublisherSeqs::announced`].
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

    /// `cache` was resynced: what any publisher sent it before is moot, the
    /// numbers announced for it included (an announcement is sent after
    /// the events it vouches for, so the resync reflects them). Its pending
    /// checks go, and their publishers' baselines rise to the highest
    /// numbers announced: otherwise each would fire later and resync again
    /// for events the resync already covered.
    pub(super) fn resynced(&mut self, cache: &str) {
        self.distrusted.remove(cache);
        if self.checking.is_empty() {
            return;
        }
        let mut covered = Vec::new();
        self.checking.retain(|(publisher, c, newest, _)| {
            let keep = c != cache;
            if !keep {
                covered.push((*publisher, *newest));
            }
            keep
        });
        if covered.is_empty() {
            return;
        }
        self.checks.retain(|c| c.cache != cache);
        for (publisher, newest) in covered {
            let _ = self.observe(publisher, cache, newest);
        }
    }

    /// Queues `check` in deadline order: a re-armed check's deadline can
    /// be later than that of checks started after it.
    fn enqueue(&mut self, check: Check) {
        let at = self
            .checks
            .partition_point(|c| c.deadline <= check.deadline);
        self.checks.insert(at, check);
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
    ///
    /// A pending check for the same (publisher, cache) is raised to `seq`
    /// rather than joined by a second one, and keeps its deadline: the
    /// older numbers are judged at the end of their own window. If by then
    /// they arrived but the newest did not, the check is re-armed for the
    /// newest number at the end of the window after the announcement that
    /// raised it to that number, so every announced number is given one
    /// full reorder window from its announcement's arrival, and is answered
    /// by its end. A deadline restarted at every announcement instead
    /// would never come while a publisher keeps announcing higher numbers
    /// whose events are all lost; a deadline kept for the newest number
    /// would count its events, still inside their window, as lost.
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
        if let Some(pending) = self
            .checking
            .find_mut(hash, |e| e.0 == publisher && e.1 == cache)
        {
            if seq > pending.2 {
                pending.2 = seq;
                pending.3 = deadline;
            }
            return None;
        }
        if self.checks.len() >= MAX_PENDING_CHECKS {
            let _ = self.observe(publisher, cache, seq);
            return Some(missing(last.saturating_add(1)));
        }
        let hasher = &self.hasher;
        self.checking
            .insert_unique(hash, (publisher, cache.to_owned(), seq, deadline), |e| {
                hasher.hash_one((e.0, e.1.as_str()))
            });
        self.enqueue(Check {
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
    /// answered this way counts as seen up to the highest number announced,
    /// so it is not answered twice and the next event is no gap.
    pub(super) fn due(&mut self, now: Instant) -> Option<Missing> {
        while self.checks.front().is_some_and(|c| c.deadline <= now) {
            let mut check = self.checks.pop_front()?;
            // A baseline forgotten meanwhile (the bound on publishers) may
            // have hidden the events' arrival: a needless resync, never a
            // missed loss.
            let last = self.last(check.publisher, &check.cache).unwrap_or(0);
            let hash = self
                .hasher
                .hash_one((check.publisher, check.cache.as_str()));
            let Ok(entry) = self
                .checking
                .find_entry(hash, |e| e.0 == check.publisher && e.1 == check.cache)
            else {
                continue;
            };
            let (newest, newest_deadline) = (entry.get().2, entry.get().3);
            if last >= newest {
                entry.remove();
                continue;
            }
            if last >= check.seq {
                // The numbers due now arrived; later ones get their own window.
                check.seq = newest;
                check.deadline = newest_deadline;
                self.enqueue(check);
                continue;
            }
            entry.remove();
            let _ = self.observe(check.publisher, &check.cache, newest);
            return Some(Missing {
                publisher: check.publisher,
                from: last.saturating_add(1),
                to: newest,
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
