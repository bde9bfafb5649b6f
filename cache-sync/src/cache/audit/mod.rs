//! The consistency auditor: a node compares what its cache holds with the
//! source of truth, at a bounded rate, and counts, logs and repairs what no
//! event explains (a write that bypassed the publisher, a bug).
//!
//! The node's audit task (`node/audit.rs`) decides when a round runs (only
//! while the node is ready, at the pace a round asks for); a round, here,
//! decides what to read and what the answers mean.
//!
//! Here, the auditor's state and counters, and its report; beside them,
//! its settings (`settings.rs`), how values compare and fingerprint
//! (`values.rs`), the sweep and the suspects due (`sweep.rs`), a round
//! (`round.rs`), judging an entry (`verdict.rs`), repairs (`repair.rs`),
//! and the nines' window (`window.rs`).

use std::hash::{Hash, RandomState};
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::status::AuditStatus;
use crate::util::{Backoff, HashMap, lock};

mod repair;
mod round;
mod settings;
mod sweep;
mod values;
mod verdict;
mod window;

pub(crate) use round::RoundTrip;
pub use settings::Audit;
pub(crate) use settings::{AUDIT_MARGIN, first_wait};
use window::Window;

/// A source row as the auditor compares it: the value and, if the source
/// keeps one, its version.
type Row<V> = (V, Option<u64>);
type Rows<K, V> = Vec<(K, Option<Row<V>>)>;

/// One cache's auditor: its settings, its sweep, and its counters.
pub(super) struct Auditor<K, V> {
    pub(super) audit: Audit<K, V>,
    /// The key of the values' fingerprints (see [`fingerprint`](values::fingerprint)).
    fingerprints: RandomState,
    state: Mutex<State<K>>,
    stats: AuditStats,
}

struct State<K> {
    /// What is left of the current sweep, taken from the end: the keys held
    /// when it began, in the order of their hash, so a key comes round once
    /// a sweep at about the same place.
    pass: Vec<Arc<K>>,
    /// Where values are compared, the fingerprint of each key's value as
    /// the sweep read it (`pass`'s, one for one; `None` for a value that
    /// does not encode), and the version table's stamp before that read:
    /// see [`Sweep`](sweep::Sweep). No value is kept: 8 bytes a key.
    seen: Vec<Option<NonZeroU64>>,
    seen_at: u64,
    suspects: HashMap<K, Suspect>,
    backoff: Backoff,
    window: Window,
}

/// A mismatch waiting out the grace window.
#[derive(Debug, Clone, Copy)]
struct Suspect {
    /// The version table's stamp when the node's entry was read: a write to
    /// the key (or a clear) since makes the entry another one.
    token: u64,
    /// When the mismatch was first seen, on this node's clock.
    observed: Instant,
    /// The version the held value was installed at, then: an unversioned
    /// load installs without a stamp, so the repair checks this too.
    version: Option<u64>,
}

#[derive(Default)]
struct AuditStats {
    checks: AtomicU64,
    suspects: AtomicU64,
    cleared: AtomicU64,
    inconsistencies: AtomicU64,
    repairs: AtomicU64,
    unverified: AtomicU64,
    reads: AtomicU64,
    read_failures: AtomicU64,
    sweeps: AtomicU64,
    pending: AtomicU64,
    last_stale_ms: AtomicU64,
    max_stale_ms: AtomicU64,
}

impl<K: Hash + Eq, V> Auditor<K, V> {
    pub(super) fn new(audit: Audit<K, V>) -> Self {
        let window = Window::new(audit.window);
        // From a round's share of the rate, but never below 10 ms: at a
        // rate so high that the share rounds to nothing, the backoff must
        // still grow.
        let min = Duration::from_secs_f64(audit.batch.max(1) as f64 / f64::from(audit.rate.max(1)))
            .max(Duration::from_millis(10));
        Self {
            audit,
            fingerprints: RandomState::new(),
            state: Mutex::new(State {
                pass: Vec::new(),
                seen: Vec::new(),
                seen_at: 0,
                suspects: HashMap::default(),
                backoff: Backoff::new(min, min.max(Duration::from_secs(60))),
                window,
            }),
            stats: AuditStats::default(),
        }
    }

    /// The most suspects kept: a cache whose every entry is behind (a
    /// source restored from an old backup) stops the sweep until they are
    /// judged, rather than remembering every key.
    fn max_suspects(&self) -> usize {
        self.audit.batch.saturating_mul(4).max(64)
    }

    pub(super) fn status(&self) -> AuditStatus {
        let s = &self.stats;
        let (window_checks, window_inconsistencies) = lock(&self.state).window.sums(Instant::now());
        let max_stale = s.max_stale_ms.load(Relaxed);
        AuditStatus {
            checks: s.checks.load(Relaxed),
            suspects: s.suspects.load(Relaxed),
            suspects_cleared: s.cleared.load(Relaxed),
            suspects_pending: s.pending.load(Relaxed),
            inconsistencies: s.inconsistencies.load(Relaxed),
            repairs: s.repairs.load(Relaxed),
            unverified: s.unverified.load(Relaxed),
            source_reads: s.reads.load(Relaxed),
            source_failures: s.read_failures.load(Relaxed),
            sweeps: s.sweeps.load(Relaxed),
            last_stale_age_ms: (max_stale > 0).then(|| s.last_stale_ms.load(Relaxed)),
            max_stale_age_ms: (max_stale > 0).then_some(max_stale),
            window_s: self.audit.window.as_secs(),
            window_checks,
            window_inconsistencies,
        }
    }
}
