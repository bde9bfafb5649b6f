//! The relay's counters and gauges: the snapshot it hands out, and the
//! atomics its tasks keep them in.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

/// The relay's counters and gauges, since it started.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct CdcRelayStats {
    /// This relay streams the slot now (not a standby, not reconnecting).
    pub active: bool,
    /// Transactions published.
    pub transactions: u64,
    /// Row changes taken from them.
    pub rows: u64,
    /// Resyncs published: clears of the mapped caches for a new or lost
    /// slot, or of a table's caches after an operator changed it (see
    /// [`CdcRelay`](crate::cdc::CdcRelay)).
    pub resyncs: u64,
    /// Times this relay started streaming after another relay held the slot.
    pub takeovers: u64,
    /// Sessions that ended in an error (the database or a publish failed).
    pub failures: u64,
    /// Transactions skipped, with a clear of every mapped cache in their
    /// place, because a row change was over
    /// [`max_row_bytes`](crate::cdc::CdcRelayBuilder::max_row_bytes).
    pub skipped: u64,
    /// The slot's confirmed position (an LSN), as this relay last set it.
    pub confirmed_lsn: u64,
    /// How far the slot's confirmed position is behind the end of the
    /// log, in bytes, when last asked (`None` before the first answer).
    pub lag_bytes: Option<u64>,
    /// While this relay streams: how long ago, on the database server's
    /// clock, the oldest change it received but has not yet confirmed was
    /// committed (a resync: received); zero when it has none. It grows
    /// while a publish is stuck. What the relay has not received (it is
    /// down, or a standby, or the server is slow to send) shows in
    /// `lag_bytes` only.
    pub lag_seconds: f64,
    /// Freshness marks this relay could not write into the WAL (see
    /// [`freshness_interval`](crate::cdc::CdcRelayBuilder::freshness_interval)):
    /// refused (the role may not run `pg_logical_emit_message`) or timed
    /// out. No report follows such a mark, so the mapped caches' freshness
    /// ages on every node; the first of a run of them is logged as a
    /// warning, the run's end at `info`.
    pub mark_failures: u64,
}

pub(super) struct Shared {
    pub(super) slot: String,
    pub(super) active: AtomicBool,
    pub(super) transactions: AtomicU64,
    pub(super) rows: AtomicU64,
    pub(super) resyncs: AtomicU64,
    pub(super) takeovers: AtomicU64,
    pub(super) failures: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) mark_failures: AtomicU64,
    pub(super) confirmed: AtomicU64,
    /// `u64::MAX`: not known yet.
    pub(super) lag_bytes: AtomicU64,
    /// Microseconds since 2000-01-01 on the server's clock; 0: none.
    pub(super) oldest_pending_commit: AtomicI64,
    pub(super) server_time: ServerClock,
}

/// The server's clock as last seen (on the server's own scale, like the
/// commit times it is compared with), and when, on this process's
/// monotonic clock: between readings it is carried forward by the time
/// that passed here. So the lag in seconds grows while the relay is stuck
/// (a publish that does not return, a stream that stalls), even when
/// nothing more arrives to read the server's time from. No clock of one
/// machine is compared with another's: only time elapsed here is added.
#[derive(Debug, Default)]
pub(super) struct ServerClock {
    micros: AtomicI64,
    /// When `micros` was last raised: microseconds since [`anchor`].
    seen: AtomicI64,
}

/// The process's reference point for [`ServerClock::seen`].
fn anchor() -> std::time::Instant {
    static ANCHOR: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    *ANCHOR.get_or_init(std::time::Instant::now)
}

fn local_micros() -> i64 {
    i64::try_from(anchor().elapsed().as_micros()).unwrap_or(i64::MAX)
}

impl ServerClock {
    /// The server said its time is `micros`.
    #[cfg_attr(not(feature = "mysql-cdc"), allow(dead_code))]
    pub(super) fn store(&self, micros: i64, order: Ordering) {
        self.micros.store(micros, order);
        self.seen.store(local_micros(), order);
    }

    /// As [`store`](Self::store), unless an earlier reading was later.
    #[cfg_attr(not(feature = "postgres-cdc"), allow(dead_code))]
    pub(super) fn fetch_max(&self, micros: i64, order: Ordering) -> i64 {
        let before = self.micros.fetch_max(micros, order);
        if micros >= before {
            self.seen.store(local_micros(), order);
        }
        before
    }

    /// The last reading, as the server gave it.
    #[cfg_attr(not(feature = "postgres-cdc"), allow(dead_code))]
    pub(super) fn load(&self, order: Ordering) -> i64 {
        self.micros.load(order)
    }

    /// The server's time now, by the last reading and the time passed here
    /// since; 0 before the first reading.
    fn now(&self) -> i64 {
        let micros = self.micros.load(Ordering::Relaxed);
        if micros == 0 {
            return 0;
        }
        let since = local_micros()
            .saturating_sub(self.seen.load(Ordering::Relaxed))
            .max(0);
        micros.saturating_add(since)
    }
}

impl Shared {
    /// The counters and gauges, now.
    pub(super) fn snapshot(&self) -> CdcRelayStats {
        let s = self;
        let lag_bytes = s.lag_bytes.load(Ordering::Relaxed);
        let oldest = s.oldest_pending_commit.load(Ordering::Relaxed);
        let now = s.server_time.now();
        let lag_micros = if oldest == 0 {
            0
        } else {
            now.saturating_sub(oldest).max(0)
        };
        CdcRelayStats {
            active: s.active.load(Ordering::Relaxed),
            transactions: s.transactions.load(Ordering::Relaxed),
            rows: s.rows.load(Ordering::Relaxed),
            resyncs: s.resyncs.load(Ordering::Relaxed),
            takeovers: s.takeovers.load(Ordering::Relaxed),
            failures: s.failures.load(Ordering::Relaxed),
            skipped: s.skipped.load(Ordering::Relaxed),
            mark_failures: s.mark_failures.load(Ordering::Relaxed),
            confirmed_lsn: s.confirmed.load(Ordering::Relaxed),
            lag_bytes: (lag_bytes != u64::MAX).then_some(lag_bytes),
            #[allow(clippy::cast_precision_loss)] // microseconds: exact below 2^53
            lag_seconds: lag_micros as f64 / 1e6,
        }
    }
}
