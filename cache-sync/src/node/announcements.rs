//! Announcement checks: numbers a publisher announced that this node is
//! behind, counted lost unless their events arrive within the reorder
//! window.

use std::hash::BuildHasher;

use tokio::time::Instant;

use super::seqs::{Missing, Prior, PublisherSeqs};

/// Bounds the pending announcement checks. At the bound a new one is
/// answered at once (a resync) rather than dropped: a dropped check would be
/// a loss nobody notices.
pub(super) const MAX_PENDING_CHECKS: usize = 10_000;

/// A publisher announced `seq` for `cache` while the node's last was below
/// it: unless the events up to `seq` arrive by `deadline`, they were lost.
/// Later announcements raise the check's highest number (in `checking`),
/// not this one: see [`PublisherSeqs::announced_after`].
pub(super) struct Check {
    publisher: u64,
    pub(super) cache: String,
    seq: u64,
    deadline: Instant,
}

impl PublisherSeqs {
    /// Queues `check` in deadline order: a re-armed check's deadline can
    /// be later than that of checks started after it.
    fn enqueue(&mut self, check: Check) {
        let at = self
            .checks
            .partition_point(|c| c.deadline <= check.deadline);
        self.checks.insert(at, check);
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
    #[cfg(test)]
    pub(super) fn announced(
        &mut self,
        publisher: u64,
        cache: &str,
        seq: u64,
        deadline: Instant,
    ) -> Option<Missing> {
        self.announced_after(publisher, cache, seq, deadline, || None)
    }

    /// The check of an announcement, told when the announced event was
    /// sent (see [`Prior`]; asked only for a publisher the node does not
    /// know): an unknown publisher whose announced event was
    /// sent while this node was holding every event of the cache lost it on
    /// the way here (a one-shot publisher, its only event lost), and the
    /// numbers up to it are answered as lost at once. Otherwise its number
    /// becomes a baseline, as before: events sent before the node listened
    /// are not its to miss.
    pub(super) fn announced_after(
        &mut self,
        publisher: u64,
        cache: &str,
        seq: u64,
        deadline: Instant,
        prior: impl FnOnce() -> Option<Prior>,
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
            if self.applied(publisher, cache).is_some_and(|a| a >= seq) {
                // A baseline from before a loss already reaches it: every
                // number up to it arrived or was covered then.
                return None;
            }
            let lost = self.distrusted.contains(cache) || self.missed_since(prior);
            self.set_last(publisher, cache, seq);
            return lost.then(|| missing(1));
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
            self.set_last(publisher, cache, seq);
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
            self.set_last(check.publisher, &check.cache, newest);
            return Some(Missing {
                publisher: check.publisher,
                from: last.saturating_add(1),
                to: newest,
                cache: check.cache,
            });
        }
        None
    }
}
