//! Gap tracking: the last sequence number seen per publisher and cache.

use std::collections::VecDeque;
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashTable;
use tokio::time::Instant;

use super::announcements::Check;
use super::fences::Fences;
use crate::util::{HashSet, Hasher};

/// Last sequence number seen per (publisher, cache), to detect gaps.
/// Keyed by publisher first, so a lookup by `&str` allocates nothing.
#[derive(Default)]
pub(super) struct PublisherSeqs {
    /// Per (publisher, cache), found with one hash of both: a table keyed
    /// by the pair would need an owned key to look up.
    last: HashTable<Baseline>,
    pub(super) hasher: Hasher,
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
    pub(super) checks: VecDeque<Check>,
    /// Per pending check: (publisher, cache, the highest number announced
    /// since, and the end of the reorder window after the announcement that
    /// raised it to that number).
    pub(super) checking: HashTable<(u64, String, u64, Instant)>,
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
    pub(super) fn missed_since(&self, prior: impl FnOnce() -> Option<Prior>) -> bool {
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

    fn find(&self, publisher: u64, cache: &str) -> Option<&Baseline> {
        let hash = self.hasher.hash_one((publisher, cache));
        self.last
            .find(hash, |e| e.publisher == publisher && &*e.cache == cache)
    }

    /// The last number seen from `publisher` for `cache` since the last
    /// loss, if any: what gaps are judged from.
    pub(super) fn last(&self, publisher: u64, cache: &str) -> Option<u64> {
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
    pub(super) fn set_last(&mut self, publisher: u64, cache: &str, seq: u64) {
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
