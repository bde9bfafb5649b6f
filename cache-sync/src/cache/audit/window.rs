//! The nines' window: checks and inconsistencies over the last window,
//! in buckets.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// The nines' window is kept in this many buckets: the window slides by a
/// sixtieth of itself.
const WINDOW_BUCKETS: u32 = 60;

/// Checks and inconsistencies over the last `width × WINDOW_BUCKETS`.
pub(super) struct Window {
    width: Duration,
    /// (bucket start, checks, inconsistencies), oldest first.
    buckets: VecDeque<(Instant, u64, u64)>,
}

impl Window {
    pub(super) fn new(window: Duration) -> Self {
        Self {
            width: window.checked_div(WINDOW_BUCKETS).unwrap_or(window),
            buckets: VecDeque::new(),
        }
    }

    pub(super) fn add(&mut self, now: Instant, checks: u64, inconsistencies: u64) {
        self.expire(now);
        match self.buckets.back_mut() {
            Some((start, c, i)) if now.saturating_duration_since(*start) < self.width => {
                *c = c.saturating_add(checks);
                *i = i.saturating_add(inconsistencies);
            }
            _ => self.buckets.push_back((now, checks, inconsistencies)),
        }
    }

    fn expire(&mut self, now: Instant) {
        let span = self.width.saturating_mul(WINDOW_BUCKETS);
        while self
            .buckets
            .front()
            .is_some_and(|(start, _, _)| now.saturating_duration_since(*start) >= span)
        {
            self.buckets.pop_front();
        }
    }

    pub(super) fn sums(&mut self, now: Instant) -> (u64, u64) {
        self.expire(now);
        self.buckets.iter().fold((0, 0), |(c, i), (_, bc, bi)| {
            (c.saturating_add(*bc), i.saturating_add(*bi))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_forgets_what_slid_out() {
        let mut w = Window::new(Duration::from_secs(60));
        let t0 = Instant::now();
        w.add(t0, 10, 1);
        w.add(t0 + Duration::from_millis(500), 5, 0);
        assert_eq!(w.sums(t0 + Duration::from_secs(30)), (15, 1));
        w.add(t0 + Duration::from_secs(30), 7, 0);
        assert_eq!(w.sums(t0 + Duration::from_secs(60)), (7, 0));
        assert_eq!(w.sums(t0 + Duration::from_secs(91)), (0, 0));
    }
}
