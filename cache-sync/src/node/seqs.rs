//! Gap tracking: the last sequence number seen per publisher and cache.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashTable;
use tokio::time::Instant;

use super::fences::Fences;
use crate::util::{HashSet, Hasher};

/// Last sequence number seen per (publisher, cache), to detect gaps.
/// Keyed by publisher first, so a lookup by `&str` allocates nothing.
#[derive(Default)]
pub(super) struct PublisherSeqs {
    /// Per (publisher, cache), found with one hash of both: a table keyed
    /// by the pair would need an owned key to look up.
    last: HashTable<Baseline>,
    hasher: Hasher,
    pub(super) tracked: usize,
    /// The cache names baselines point to, one copy each: only caches the
    /// node holds reach this table, so a baseline costs some 50 bytes
    /// whatever the names' length, and `MAX_TRACKED_PUBLISHERS` of them a
    /// few megabytes.
    names: HashSet<Arc<str>>,
    /// Bumped by every loss that resynced every cache: a baseline from an
    /// earlier epoch still says what was applied (for acknowledgements),
    /// but a jump past it is no gap: a number above the one right after it
    /// counts as a first.
    epoch: u32,
    /// Observations so far: each baseline's age, for `forget_oldest`.
    touches: u64,
    /// Since when the consumer has read live (its start replay done), so
    /// that a message's age in transit is short: `None` until then, and
    /// unknown publishers are then taken on trust.
    pub(super) live_since: Option<Instant>,
    /// When baselines were last forgotten for room: a publisher unknown
    /// now may be one forgotten then, whose earlier events did arrive.
    forgot_at: Option<Instant>,
    /// How late a live message may arrive: the node's reorder window. An
    /// unknown publisher's previous event counts as lost only if it was
    /// sent more than this after the node started listening (see
    /// [`Prior`]).
    pub(super) margin: Duration,
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
    /// Outbox relays' fences, per cache.
    pub(super) fences: Fences,
}

/// The last number seen from one publisher for one cache.
struct Baseline {
    publisher: u64,
    cache: Arc<str>,
    last: u64,
    /// When last touched, counted in observations, not time: see
    /// `forget_oldest`.
    touched: u64,
    /// The loss epoch it was last seen in (see `PublisherSeqs::epoch`).
    epoch: u32,
}

/// What a message says of its publisher's previous event (the one numbered
/// `seq - 1`, or for an announcement the one it announces), on the node's
/// clock, for a publisher the node does not know: it was sent at or before
/// `sent_by` (the receive time minus the age the publisher measured; the
/// message's time in transit makes the real moment earlier), into a cache
/// registered at `registered` and last emptied at `emptied`.
///
/// Two moments, because they bound different things. Before the node
/// listened (it went live, the cache was registered, baselines were
/// forgotten) an event was not its to receive, and since `sent_by` is only
/// an upper bound, an event counts as sent after such a moment only if
/// `sent_by` is more than the reorder window past it. A clear (a published
/// one, a local one, a resync) does not stop the node listening: it only
/// covers what was sent by then, so an event whose `sent_by` is after it
/// may have been sent after it, and, missing, may have left the cache
/// stale; it counts as lost (a needless resync costs a reload, a missed
/// one leaves the cache stale).
#[derive(Debug, Clone, Copy)]
pub(super) struct Prior {
    pub(super) sent_by: Instant,
    pub(super) registered: Instant,
    pub(super) emptied: Instant,
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

/// What [`PublisherSeqs::observe_late`] found of one event's number.
pub(super) struct Observed {
    /// How many events may have been missed before it.
    pub(super) missed: Option<u64>,
    /// At or below the publisher's last number for the cache.
    pub(super) late: bool,
}

/// Bounds memory when publishers come and go: forgetting baselines only
/// delays gap detection for the next event of each, it never raises a false one.
pub(super) const MAX_TRACKED_PUBLISHERS: usize = 100_000;

/// Bounds the pending announcement checks. At the bound a new one is
/// answered at once (a resync) rather than dropped: a dropped check would be
/// a loss nobody notices.
pub(super) const MAX_PENDING_CHECKS: usize = 10_000;

impl PublisherSeqs {
    /// After a loss every cache was resynced: what any publisher sent
    /// before now is reflected, and its next number is no gap. Its baseline
    /// stays, from an older epoch, to answer acknowledgements: what it says
    /// was applied still was.
    pub(super) fn clear(&mut self) {
        self.epoch = self.epoch.wrapping_add(1);
        self.distrusted.clear();
        self.checks.clear();
        self.checking.clear();
    }

    /// Whether an unknown publisher's previous event, sent by `prior`, was
    /// sent while this node held every event for the cache, so that it
    /// should have arrived and did not. Only once the node reads live, and
    /// with the reorder window's margin for the message's time in transit
    /// after the node started listening: after it went live, after the
    /// cache was registered, and after baselines were forgotten for room
    /// (those publishers' events may well have arrived). Not after the
    /// cache was last emptied, with no margin: an event possibly sent after
    /// a clear is not covered by it (see [`Prior`]). At the very moment of
    /// the clear, the two cannot be ordered, so it counts as after.
    fn missed_since(&self, prior: impl FnOnce() -> Option<Prior>) -> bool {
        let Some(live) = self.live_since else {
            return false;
        };
        let Some(prior) = prior() else {
            return false;
        };
        let listening = prior
            .registered
            .max(live)
            .max(self.forgot_at.unwrap_or(live));
        let heard = listening
            .checked_add(self.margin)
            .is_some_and(|bound| prior.sent_by > bound);
        heard && prior.sent_by >= prior.emptied
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
            self.set_last(publisher, cache, newest);
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

    fn find(&self, publisher: u64, cache: &str) -> Option<&Baseline> {
        let hash = self.hasher.hash_one((publisher, cache));
        self.last
            .find(hash, |e| e.publisher == publisher && &*e.cache == cache)
    }

    /// The last number seen from `publisher` for `cache` since the last
    /// loss, if any: what gaps are judged from.
    fn last(&self, publisher: u64, cache: &str) -> Option<u64> {
        self.find(publisher, cache)
            .filter(|e| e.epoch == self.epoch)
            .map(|e| e.last)
    }

    /// The last number applied from `publisher` to `cache`, or covered by a
    /// resync of the cache since, losses or not: what an acknowledgement is
    /// answered from.
    pub(super) fn applied(&self, publisher: u64, cache: &str) -> Option<u64> {
        self.find(publisher, cache).map(|e| e.last)
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

    /// [`announced`](Self::announced), told when the announced event was
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

    /// Records `seq`; returns how many events may have been missed before
    /// it, if any. Checked arithmetic throughout: `seq` comes off the wire.
    pub(super) fn observe(&mut self, publisher: u64, cache: &str, seq: u64) -> Option<u64> {
        self.observe_after(publisher, cache, seq, || None)
    }

    /// [`observe`](Self::observe), told when the publisher's previous event
    /// was sent (see [`Prior`]; asked only for a publisher the node does not
    /// know): such a publisher, whose event before this one was sent while
    /// the node held every event of the cache, lost it (and maybe more) on
    /// the way here.
    pub(super) fn observe_after(
        &mut self,
        publisher: u64,
        cache: &str,
        seq: u64,
        prior: impl FnOnce() -> Option<Prior>,
    ) -> Option<u64> {
        self.observe_late(publisher, cache, seq, prior).missed
    }

    /// [`observe_after`](Self::observe_after), and whether `seq` is late:
    /// at or below a number already seen from `publisher` for `cache` (in
    /// any loss epoch: a resync since does not make an older event new;
    /// unknown once the baseline was forgotten for room). One look-up for
    /// both, on the path of every event.
    pub(super) fn observe_late(
        &mut self,
        publisher: u64,
        cache: &str,
        seq: u64,
        prior: impl FnOnce() -> Option<Prior>,
    ) -> Observed {
        let hash = self.hasher.hash_one((publisher, cache));
        let touches = self.touches.wrapping_add(1);
        self.touches = touches;
        let epoch = self.epoch;
        if let Some(e) = self
            .last
            .find_mut(hash, |e| e.publisher == publisher && &*e.cache == cache)
        {
            e.touched = touches;
            // From before a loss, the number right after the baseline (or
            // one at or below it) misses nothing: every number up to the
            // baseline arrived or was covered then. Judged as a first, it
            // would be held against the resync's moment, which a previous
            // event sent just before it can seem to follow (`sent_by` is
            // late by the message's time in transit): a needless second
            // resync after every loss.
            let known = e.epoch == epoch || seq <= e.last.saturating_add(1);
            e.epoch = epoch;
            let late = seq <= e.last;
            // A late event does not move it back.
            let missed = seq.checked_sub(e.last).and_then(|d| d.checked_sub(1));
            e.last = e.last.max(seq);
            let missed = if known {
                missed.filter(|&m| m > 0)
            } else {
                // The first number since a loss: judged as a first event.
                self.first_missed(cache, seq, prior)
            };
            return Observed { missed, late };
        }
        let missed = self.first_missed(cache, seq, prior);
        self.insert(hash, publisher, cache, seq);
        Observed {
            missed,
            late: false,
        }
    }

    /// How many events before `seq`, a publisher's first number the node
    /// sees (since it started, or since a loss), were lost: none for its
    /// first event (number 1 vouches for everything before it), else all
    /// of them if the cache is distrusted after a resume or the one before
    /// was sent while the node held every event of the cache.
    fn first_missed(
        &self,
        cache: &str,
        seq: u64,
        prior: impl FnOnce() -> Option<Prior>,
    ) -> Option<u64> {
        let lost = seq > 1 && (self.distrusted.contains(cache) || self.missed_since(prior));
        lost.then(|| seq.saturating_sub(1))
    }

    /// Sets the baseline of (publisher, cache) to at least `seq`, as seen.
    fn set_last(&mut self, publisher: u64, cache: &str, seq: u64) {
        let hash = self.hasher.hash_one((publisher, cache));
        let touches = self.touches.wrapping_add(1);
        self.touches = touches;
        let epoch = self.epoch;
        match self
            .last
            .find_mut(hash, |e| e.publisher == publisher && &*e.cache == cache)
        {
            Some(e) => {
                // A publisher's numbers never go back: the larger stands,
                // whatever the epoch.
                e.last = e.last.max(seq);
                e.touched = touches;
                e.epoch = epoch;
            }
            None => self.insert(hash, publisher, cache, seq),
        }
    }

    fn insert(&mut self, hash: u64, publisher: u64, cache: &str, seq: u64) {
        if self.tracked >= MAX_TRACKED_PUBLISHERS {
            self.forget_oldest();
        }
        let cache = match self.names.get(cache) {
            Some(name) => name.clone(),
            None => {
                let name: Arc<str> = Arc::from(cache);
                self.names.insert(name.clone());
                name
            }
        };
        let hasher = &self.hasher;
        self.last.insert_unique(
            hash,
            Baseline {
                publisher,
                cache,
                last: seq,
                touched: self.touches,
                epoch: self.epoch,
            },
            |e| hasher.hash_one((e.publisher, &*e.cache)),
        );
        self.tracked = self.tracked.saturating_add(1);
    }

    /// Forgets the older half of the baselines (by when each was last
    /// touched), so the bound costs one pass per half a bound of new
    /// publishers, and the publishers heard from lately stay known.
    /// Forgetting is safe: it never raises a false gap at a later event
    /// (the caches stay distrusted after a resume, and `forgot_at` keeps a
    /// forgotten publisher's next message from looking like a loss); it only
    /// delays detection for those publishers until their next event.
    fn forget_oldest(&mut self) {
        let half = u64::try_from(MAX_TRACKED_PUBLISHERS / 2).unwrap_or(u64::MAX);
        let cutoff = self.touches.saturating_sub(half);
        self.last.retain(|e| e.touched > cutoff);
        self.tracked = self.last.len();
        // A cache name no baseline points to any more goes too.
        self.names.retain(|name| Arc::strong_count(name) > 1);
        self.forgot_at = Some(Instant::now());
    }
}
