//! The cache's counters, and the status snapshot made of them.

use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Relaxed};

use prometheus_client::metrics::histogram::Histogram;

use super::Inner;
use crate::status::CacheStatus;
use crate::util::lock;

#[derive(Default)]
pub(super) struct Stats {
    pub(super) hits: StripedCounter,
    pub(super) misses: StripedCounter,
    pub(super) loads: AtomicU64,
    pub(super) load_failures: AtomicU64,
    pub(super) loads_superseded: AtomicU64,
    pub(super) loads_stale: AtomicU64,
    pub(super) fresh_reads: AtomicU64,
    pub(super) stale_bypasses: AtomicU64,
    pub(super) stale_served: AtomicU64,
    pub(super) invalidations: AtomicU64,
    pub(super) refreshes: AtomicU64,
    pub(super) stale_ignored: AtomicU64,
    pub(super) refresh_fallbacks: AtomicU64,
    pub(super) coalesced: AtomicU64,
    pub(super) refreshes_quarantined: AtomicU64,
    pub(super) clears: AtomicU64,
    pub(super) loss_resyncs: AtomicU64,
    pub(super) rejected_events: AtomicU64,
    pub(super) writes_parked: AtomicU64,
    pub(super) events_applied: AtomicU64,
    /// Highest version applied; 0 while none.
    pub(super) version: AtomicU64,
    pub(super) last_applied_us: AtomicU64,
    pub(super) last_latency_us: AtomicU64,
    /// When `version` last rose (µs since the epoch); 0 while it never did.
    pub(super) version_at_us: AtomicU64,
    pub(super) latency: LatencyHistogram,
}

/// Publish-to-applied latency, for `GET /metrics`: one observation per run
/// of events applied together, the latency of the run's last event (the
/// same value `last_latency_us` takes), so a burst applied in one run counts
/// once, not once per event.
#[derive(Debug, Clone)]
pub(crate) struct LatencyHistogram(Histogram);

/// Upper bounds, in seconds: 100 µs (an in-process hop) to 10 s (a consumer
/// far behind); slower runs land in `+Inf`.
const LATENCY_BUCKETS_S: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self(Histogram::new(LATENCY_BUCKETS_S))
    }
}

impl LatencyHistogram {
    /// Called once per run on the apply path. prometheus-client's histogram
    /// keeps its sum, count and buckets under one `parking_lot` mutex:
    /// uncontended (one consumer applies to a cache; a scrape holds it only
    /// while it copies the buckets), that is one atomic operation to take it
    /// and one to give it back, plus a scan of at most 17 buckets. Nothing
    /// is allocated.
    pub(super) fn observe_us(&self, latency_us: u64) {
        // Microseconds to seconds, the unit Prometheus expects; f64 holds
        // every latency below 2^53 µs (285 years) exactly.
        self.0.observe(latency_us as f64 / 1e6);
    }

    /// The histogram itself (a shared handle), to encode at scrape time.
    pub(crate) fn histogram(&self) -> &Histogram {
        &self.0
    }
}

/// A counter for the read path: one shared atomic would bounce its cache
/// line between every core that reads the cache.
#[derive(Default)]
pub(super) struct StripedCounter {
    pub(super) stripes: [Stripe; STRIPES],
}

pub(super) const STRIPES: usize = 16;

#[derive(Default)]
#[repr(align(128))]
pub(super) struct Stripe(AtomicU64);

impl StripedCounter {
    pub(super) fn add_one(&self) {
        thread_local! {
            static STRIPE: usize = {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Relaxed) as usize % STRIPES
            };
        }
        let i = STRIPE.with(|s| *s);
        self.stripes[i].0.fetch_add(1, Relaxed);
    }

    pub(super) fn sum(&self) -> u64 {
        self.stripes.iter().map(|s| s.0.load(Relaxed)).sum()
    }
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    pub(super) fn quarantined(&self) -> bool {
        lock(&self.quarantine_until).is_some_and(|until| tokio::time::Instant::now() < until)
    }

    pub(super) fn snapshot(&self) -> CacheStatus {
        let s = &self.stats;
        // First: see the apply path's Release store.
        let events_applied = s.events_applied.load(Acquire);
        let version = s.version.load(Relaxed);
        let last = s.last_applied_us.load(Relaxed);
        let version_at = s.version_at_us.load(Relaxed);
        // Its own statement: a guard in the literal below would live until
        // its end, across the auditor's lock, which is taken before the
        // table's (`audit/`).
        let tracked_keys = lock(&self.table).len() as u64;
        let audit = self.audit.as_ref().map(|a| a.status());
        CacheStatus {
            name: self.name.clone(),
            version: (version > 0).then_some(version),
            entries: self.cache.entry_count(),
            tracked_keys,
            hits: s.hits.sum(),
            misses: s.misses.sum(),
            loads: s.loads.load(Relaxed),
            load_failures: s.load_failures.load(Relaxed),
            loads_superseded: s.loads_superseded.load(Relaxed),
            loads_stale: s.loads_stale.load(Relaxed),
            fresh_reads: s.fresh_reads.load(Relaxed),
            stale_bypasses: s.stale_bypasses.load(Relaxed),
            stale_served: s.stale_served.load(Relaxed),
            // Its node fills it in: the cache alone cannot know its proof.
            freshness_age_ms: None,
            events_applied,
            invalidations: s.invalidations.load(Relaxed),
            refreshes: s.refreshes.load(Relaxed),
            stale_ignored: s.stale_ignored.load(Relaxed),
            refresh_fallbacks: s.refresh_fallbacks.load(Relaxed),
            coalesced: s.coalesced.load(Relaxed),
            refreshes_quarantined: s.refreshes_quarantined.load(Relaxed),
            clears: s.clears.load(Relaxed),
            loss_resyncs: s.loss_resyncs.load(Relaxed),
            rejected_events: s.rejected_events.load(Relaxed),
            writes_parked: s.writes_parked.load(Relaxed),
            last_applied_at_us: (last > 0).then_some(last),
            last_latency_us: (last > 0).then(|| s.last_latency_us.load(Relaxed)),
            version_at_us: (version_at > 0).then_some(version_at),
            quarantined: self.quarantined(),
            audit,
        }
    }
}
