//! A staleness bound on reads: a cache built with
//! [`max_staleness`](crate::SyncedCacheBuilder::max_staleness) serves from
//! memory only while its node proves it fresh within the bound (see the
//! node's `freshness.rs`). Past it, a read goes to the source, or, where
//! the builder said so, is served and counted.

use std::sync::Mutex;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::time::Instant;

use crate::util::{Moment, lock};

/// Relay sources one cache takes reports from, at most. Past it a new
/// source's reports are refused and the cache's freshness is unknown from
/// then on: dropping a source to make room could hide a stalled relay.
const MAX_SOURCES: usize = 16;

/// The bound, and what the cache knows of its node's proof.
#[derive(Debug)]
pub(super) struct Bound {
    pub(super) max: Duration,
    /// Serve past the bound (and count it) rather than read the source.
    pub(super) serve: bool,
    /// The proof of the node that holds the cache, kept here (one atomic
    /// load on a read, no lock shared by every reader): set when a node
    /// claims the cache, moved forward by that node's proofs, and none
    /// before or after (nothing proves the cache fresh then).
    proof: Moment,
    /// Past the bound now: logged once as it starts and once as it ends.
    past: AtomicBool,
}

impl Bound {
    pub(super) fn new(max: Duration, serve: bool) -> Self {
        Bound {
            max,
            serve,
            proof: Moment::default(),
            past: AtomicBool::new(false),
        }
    }

    /// The cache's freshness age (its node's proof's, and its relays'
    /// where it has any: see [`Sources::age`]), if known, and whether it
    /// is past the bound (older than `max`, or unknown).
    pub(super) fn age(&self, sources: &Sources) -> (Option<Duration>, bool) {
        let age = sources.age(self.proof.age());
        (age, age.is_none_or(|a| a > self.max))
    }

    /// Whether a read now is past the bound (see [`age`](Self::age)). Logs
    /// the start and end of each episode.
    pub(super) fn past(&self, cache: &str, sources: &Sources) -> bool {
        let (age, past) = self.age(sources);
        // A load first: every read of the cache passes here, and a store
        // on each would bounce the flag's cache line between cores.
        if self.past.load(Relaxed) != past && self.past.swap(past, Relaxed) != past {
            let age_ms = age.map(|a| a.as_millis());
            if past && self.serve {
                tracing::warn!(
                    cache,
                    max_ms = self.max.as_millis(),
                    age_ms,
                    "the node cannot prove this cache fresh within its bound; its reads are served, and counted, until it can"
                );
            } else if past {
                tracing::warn!(
                    cache,
                    max_ms = self.max.as_millis(),
                    age_ms,
                    "the node cannot prove this cache fresh within its bound; its reads go to the source until it can"
                );
            } else {
                tracing::info!(
                    cache,
                    "the node proves this cache fresh within its bound again"
                );
            }
        }
        past
    }
}

/// What relays (CDC and outbox) report of one cache (see [`Watermark`](crate::wire::Watermark)):
/// per source, a moment on this process's clock before which everything
/// the source's database made visible is applied to the cache.
#[derive(Debug, Default)]
pub(super) struct Sources {
    /// Reports are awaited: set by the first (or by the builder's
    /// [`relayed`](crate::SyncedCacheBuilder::relayed)), and never
    /// unset: a relay that stops reporting is what this is here to see.
    expected: AtomicBool,
    /// The earliest of the sources' moments; none while any source has
    /// none, or past `MAX_SOURCES`. Read by every bounded read.
    moment: Moment,
    each: Mutex<SourceMoments>,
}

#[derive(Debug, Default)]
struct SourceMoments {
    each: Vec<Source>,
    /// A source past `MAX_SOURCES` reported.
    full: bool,
}

/// One source of reports for a cache.
#[derive(Debug)]
struct Source {
    id: u64,
    /// Everything its database made visible before then is applied.
    moment: Option<Instant>,
    /// Its last report taken: epoch, number, and the node's proof then
    /// (which that report's acknowledgement came after).
    last: Option<(u64, u64, Instant)>,
}

impl Sources {
    pub(super) fn new(expected: bool) -> Self {
        Sources {
            expected: AtomicBool::new(expected),
            ..Sources::default()
        }
    }

    /// The cache's freshness age, given its node's proof's age: that age,
    /// or the oldest source's if older, for a cache that awaits reports;
    /// unknown if either is.
    pub(super) fn age(&self, proof: Option<Duration>) -> Option<Duration> {
        if !self.expected.load(Relaxed) {
            return proof;
        }
        Some(proof?.max(self.moment.age()?))
    }

    /// A source's report `mark`, taken when the node's proof was `proof`.
    /// Report `n` says that everything visible before its mark is applied
    /// (the node took it after the events before it); report `n + 1` of
    /// the same epoch says how long after that mark `n` was acknowledged,
    /// which was after `proof` as of `n`: so everything visible before
    /// that proof less that duration is applied. A source's moment never
    /// moves back (an older report arriving late proves less, not the
    /// opposite), and a report of an older epoch, or at or below the last
    /// number of its epoch (a copy, a replay), is not taken. A moment
    /// further back than the clock reaches is unknown.
    pub(super) fn report(&self, cache: &str, mark: &crate::wire::Watermark, proof: Instant) {
        self.expected.store(true, Relaxed);
        let mut guard = lock(&self.each);
        let s = &mut *guard;
        let i = match s.each.iter().position(|src| src.id == mark.source) {
            Some(i) => i,
            None if s.each.len() < MAX_SOURCES => {
                s.each.push(Source {
                    id: mark.source,
                    moment: None,
                    last: None,
                });
                s.each.len().saturating_sub(1)
            }
            None => {
                if !s.full {
                    tracing::error!(
                        cache,
                        source = mark.source,
                        max = MAX_SOURCES,
                        "more CDC relay sources report for this cache than it keeps; its freshness is unknown from now on"
                    );
                }
                s.full = true;
                self.moment.set(None);
                return;
            }
        };
        let Some(src) = s.each.get_mut(i) else {
            return;
        };
        if let Some((epoch, number, then)) = src.last
            && epoch >= mark.epoch
        {
            // An older epoch's (a replay of an earlier relay session's), a
            // copy, or an older number: nothing.
            if epoch > mark.epoch || mark.number <= number {
                return;
            }
            if number.checked_add(1) == Some(mark.number)
                && let Some(after) = mark.acked_after_us
            {
                let placed = then.checked_sub(Duration::from_micros(after));
                src.moment = src.moment.max(placed);
            }
        }
        src.last = Some((mark.epoch, mark.number, proof));
        let earliest = if s.full {
            None
        } else {
            s.each
                .iter()
                .try_fold(None::<Instant>, |min, src| {
                    let at = src.moment?;
                    Some(Some(min.map_or(at, |m| m.min(at))))
                })
                .flatten()
        };
        self.moment.set(earliest);
    }

    /// Forgets every source's moment (a node claimed or let go of the
    /// cache: its contents start again), still awaiting reports if it was.
    pub(super) fn reset(&self) {
        let mut s = lock(&self.each);
        s.each.clear();
        s.full = false;
        self.moment.set(None);
    }
}

impl<K, V> super::Inner<K, V> {
    /// Whether a read now must not be served from memory: past the bound
    /// and not serving past it (counted in `stale_bypasses`). Past a
    /// serving bound, counted in `stale_served` and served.
    pub(super) fn past_bound(&self) -> bool {
        let Some(bound) = &self.bound else {
            return false;
        };
        if !bound.past(&self.name, &self.sources) {
            return false;
        }
        if bound.serve {
            self.stats.stale_served.fetch_add(1, Relaxed);
            false
        } else {
            self.stats.stale_bypasses.fetch_add(1, Relaxed);
            true
        }
    }

    /// The error of a read refused past the bound.
    pub(super) fn stale_error(&self) -> crate::Error {
        let (max, age) = self
            .bound
            .as_ref()
            .map_or((std::time::Duration::ZERO, None), |b| {
                (b.max, b.age(&self.sources).0)
            });
        crate::Error::Stale {
            cache: self.name.clone(),
            max,
            age,
        }
    }

    /// Holds the cache's reads to `proof`, the proof of the node that
    /// claimed it so far; `None` when it lets the cache go.
    pub(super) fn prove_with(&self, proof: Option<&Moment>) {
        self.sources.reset();
        if let Some(bound) = &self.bound {
            bound.proof.set_from(proof);
        }
    }

    /// A CDC relay's report for the cache, taken at the node's `proof`
    /// (see [`Sources::report`]), if the node `owner` holds it.
    pub(super) fn relay_reported(&self, owner: u64, mark: &crate::wire::Watermark, proof: Instant) {
        if self.owner.load(std::sync::atomic::Ordering::Acquire) == owner {
            self.sources.report(&self.name, mark, proof);
        }
    }

    /// How fresh the node that holds the cache proves it: its proof's age,
    /// or its relays' (see [`Sources::age`]); `None` if unknown.
    pub(super) fn freshness_age(&self, node_proof: Option<Duration>) -> Option<Duration> {
        self.sources.age(node_proof)
    }

    /// The node `owner` proved everything acknowledged before `at`
    /// applied: the cache's proof moves forward, if that node holds it.
    pub(super) fn proved(&self, owner: u64, at: tokio::time::Instant) {
        if let Some(bound) = &self.bound
            && self.owner.load(std::sync::atomic::Ordering::Acquire) == owner
        {
            bound.proof.advance(at);
        }
    }
}
