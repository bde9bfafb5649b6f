//! A staleness bound on reads: a cache built with
//! [`max_staleness`](crate::SyncedCacheBuilder::max_staleness) serves from
//! memory only while its node proves it fresh within the bound (see the
//! node's `freshness.rs`). Past it, a read goes to the source, or, where
//! the builder said so, is served and counted.

use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::util::Moment;

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

    /// The node's proof's age, if there is one, and whether it is past
    /// the bound (older than `max`, or none at all).
    pub(super) fn age(&self) -> (Option<Duration>, bool) {
        let age = self.proof.age();
        (age, age.is_none_or(|a| a > self.max))
    }

    /// Whether a read now is past the bound (see [`age`](Self::age)). Logs
    /// the start and end of each episode.
    pub(super) fn past(&self, cache: &str) -> bool {
        let (age, past) = self.age();
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

impl<K, V> super::Inner<K, V> {
    /// Whether a read now must not be served from memory: past the bound
    /// and not serving past it (counted in `stale_bypasses`). Past a
    /// serving bound, counted in `stale_served` and served.
    pub(super) fn past_bound(&self) -> bool {
        let Some(bound) = &self.bound else {
            return false;
        };
        if !bound.past(&self.name) {
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
            .map_or((std::time::Duration::ZERO, None), |b| (b.max, b.age().0));
        crate::Error::Stale {
            cache: self.name.clone(),
            max,
            age,
        }
    }

    /// Holds the cache's reads to `proof`, the proof of the node that
    /// claimed it so far; `None` when it lets the cache go.
    pub(super) fn prove_with(&self, proof: Option<&Moment>) {
        if let Some(bound) = &self.bound {
            bound.proof.set_from(proof);
        }
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
