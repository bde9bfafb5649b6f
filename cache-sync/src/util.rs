//! Small helpers shared by every layer.

use std::time::Duration;

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
