//! How late the node's runtime runs a short timer: the symptom of any task
//! that holds a worker too long, the node's or the application's. A node
//! shares the application's runtime, so a stall there delays its events
//! (and the application's requests); measured here, an operator sees it
//! whoever caused it.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::watch;
use tokio::time::Instant;

use super::Shared;
use crate::util::lock;

/// The timer: short enough that a stall of a few milliseconds shows, and
/// a wake-up a hundred times a second costs a node next to nothing.
pub(super) const TICK: Duration = Duration::from_millis(10);
/// Lateness past this is logged (at most once per `WARN_EVERY`).
pub(super) const WARN_OVER: Duration = Duration::from_millis(100);
const WARN_EVERY: Duration = Duration::from_secs(10);
/// The status reports the largest lateness of the last `WINDOW`, kept as
/// `SLOTS` maxima of `WINDOW / SLOTS` each.
const WINDOW: Duration = Duration::from_secs(60);
const SLOTS: usize = 6;
const SLOT: Duration = Duration::from_secs(10);

/// Upper bounds, in seconds: 100 µs (a timer on time) to 10 s (a worker
/// held for seconds); later ones land in `+Inf`.
const BUCKETS_S: [f64; 14] = [
    0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

/// The measurements, read by the status and the metrics.
#[derive(Debug)]
pub(super) struct Lateness {
    histogram: Histogram,
    /// Per slot of the window: (its start, the largest lateness in it, µs).
    recent: std::sync::Mutex<[(Option<Instant>, u64); SLOTS]>,
}

impl Default for Lateness {
    fn default() -> Self {
        Self {
            histogram: Histogram::new(BUCKETS_S),
            recent: std::sync::Mutex::new([(None, 0); SLOTS]),
        }
    }
}

impl Lateness {
    /// One tick ran `late`, at `now`.
    pub(super) fn observe(&self, late: Duration, now: Instant) {
        let us = u64::try_from(late.as_micros()).unwrap_or(u64::MAX);
        // Microseconds to seconds; f64 is exact far past any lateness.
        #[allow(clippy::cast_precision_loss)]
        self.histogram.observe(us as f64 / 1e6);
        let mut recent = lock(&self.recent);
        // The newest slot, if it is still open; otherwise the oldest (or an
        // empty one) starts again from now.
        let open = recent
            .iter()
            .position(|(start, _)| start.is_some_and(|s| now.saturating_duration_since(s) < SLOT));
        let i = open.unwrap_or_else(|| {
            recent
                .iter()
                .enumerate()
                .min_by_key(|(_, (start, _))| *start)
                .map_or(0, |(i, _)| i)
        });
        if open.is_none() {
            recent[i] = (Some(now), 0);
        }
        recent[i].1 = recent[i].1.max(us);
    }

    /// The largest lateness of the last minute, in microseconds.
    pub(super) fn recent_max_us(&self, now: Instant) -> u64 {
        lock(&self.recent)
            .iter()
            .filter(|(start, _)| start.is_some_and(|s| now.saturating_duration_since(s) < WINDOW))
            .map(|(_, us)| *us)
            .max()
            .unwrap_or(0)
    }

    /// The histogram itself (a shared handle), to encode at scrape time.
    pub(super) fn histogram(&self) -> &Histogram {
        &self.histogram
    }
}

/// Sleeps `TICK` at a time on the node's runtime, and records how much
/// later than asked each wake-up came.
pub(super) async fn lateness_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut warned: Option<Instant> = None;
    loop {
        let due = Instant::now()
            .checked_add(TICK)
            .unwrap_or_else(Instant::now);
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep_until(due) => {}
        }
        let now = Instant::now();
        let late = now.saturating_duration_since(due);
        shared.lateness.observe(late, now);
        if late > WARN_OVER
            && warned.is_none_or(|at| now.saturating_duration_since(at) >= WARN_EVERY)
        {
            warned = Some(now);
            tracing::warn!(node = %shared.id, late_ms = late.as_millis(),
                "the runtime ran a timer this late: a task held a worker that long (the node's or the application's); events and requests waited as long");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_last_minutes_largest_lateness_is_reported_and_then_forgotten() {
        let l = Lateness::default();
        let t0 = Instant::now();
        l.observe(Duration::from_millis(300), t0);
        l.observe(Duration::from_millis(2), t0 + Duration::from_secs(15));
        assert_eq!(l.recent_max_us(t0 + Duration::from_secs(20)), 300_000);
        // Past the minute, the 300 ms is gone; the 2 ms, 15 s later, too
        // once its own minute is over.
        assert_eq!(l.recent_max_us(t0 + Duration::from_secs(61)), 2_000);
        assert_eq!(l.recent_max_us(t0 + Duration::from_secs(90)), 0);
        // Many slots' worth of ticks: a bounded ring, the newest kept.
        for s in 0..1_000u64 {
            l.observe(Duration::from_micros(s), t0 + Duration::from_secs(100 + s));
        }
        assert_eq!(l.recent_max_us(t0 + Duration::from_secs(1_099)), 999);
    }
}
