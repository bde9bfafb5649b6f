//! Small helpers shared by every layer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Locks a std mutex, taking it over if a panic poisoned it. No state behind
/// these locks is left half-written across a panic point (a caller's `Hash`
/// or `Eq` is the only code that could panic under one), so serving on beats
/// taking the node down.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Microseconds since the Unix epoch; 0 if the clock is before it.
pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// How far [`deadline_after`] reaches when a duration does not fit the
/// clock: about 30 years, as tokio's own "far future".
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365 * 30);

/// Bounds a transport's timeout or interval setting: at least 1 ms (a
/// zero would spin), at most an hour (longer means nothing a broker
/// connection can use, and sums of two such settings must not overflow).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn clamp_timeout(d: Duration) -> Duration {
    d.clamp(Duration::from_millis(1), Duration::from_secs(3600))
}

/// `now + d`, or the far future when that does not fit the clock. Every
/// configured duration goes through this, so `Duration::MAX` means "for as
/// long as the process runs" instead of an overflow panic.
pub(crate) fn deadline_after(d: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(d.min(FAR_FUTURE)).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn any_duration_gives_a_deadline() {
        let now = tokio::time::Instant::now();
        assert!(deadline_after(Duration::ZERO) >= now);
        assert!(deadline_after(Duration::from_nanos(1)) >= now);
        assert!(deadline_after(Duration::MAX) > now + Duration::from_secs(86_400 * 365));
    }
}
