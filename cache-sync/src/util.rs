//! Small helpers shared by every layer.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// The hasher of every internal map: keys come off the wire (cache names,
/// publisher ids, cache keys), so it is seeded at random, as std's is; but
/// foldhash costs a fraction of std's SipHash-1-3, and hashing is a good part
/// of applying an event. hashbrown uses it by default.
pub(crate) type Hasher = foldhash::fast::RandomState;

/// A `HashMap` with [`Hasher`].
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, Hasher>;

/// A `HashSet` with [`Hasher`].
pub(crate) type HashSet<T> = std::collections::HashSet<T, Hasher>;

/// A random 64-bit number, different on every call: the one source of the
/// ids that must not repeat across processes, restarts or parties (a
/// publisher's id, a request's, an embedded transport's instance, a debt's
/// token, the auditor's marker numbers and its jitter). std's `RandomState`
/// takes its keys from the operating system's generator once per thread and
/// changes them with every instance; hashing a process-wide counter with a
/// fresh one needs no `rand` dependency, and its output is not predictable
/// without the keys.
/// FNV-1a of `parts`, each followed by a zero byte but the last: a stable
/// name for a relay group's report source, the same in every process and
/// release (relays standing in for one another must agree on it).
#[cfg(any(feature = "postgres-cdc", feature = "mysql-cdc", feature = "_outbox"))]
pub(crate) fn source_hash(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            // The zero byte between parts (xor with 0 changes nothing).
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        for b in part.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

pub(crate) fn random_u64() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    static N: AtomicU64 = AtomicU64::new(0);
    std::hash::RandomState::new().hash_one(N.fetch_add(1, Relaxed))
}

/// Locks a std mutex, taking it over if a panic poisoned it. No state behind
/// these locks is left half-written across a panic point (a caller's `Hash`
/// or `Eq` is the only code that could panic under one), so serving on beats
/// taking the node down.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The wait between retries of a failing call: none until the first
/// failure, then `min`, doubling after each further failure up to `max`,
/// and none again after a success. Saturates rather than overflows, for any
/// bounds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    current: Option<Duration>,
}

impl Backoff {
    /// `min` should not exceed `max`; where it does, every wait is `max`.
    pub(crate) const fn new(min: Duration, max: Duration) -> Self {
        Self {
            min,
            max,
            current: None,
        }
    }

    /// After a failure: the wait before the next attempt.
    pub(crate) fn fail(&mut self) -> Duration {
        let next = self
            .current
            .map_or(self.min, |d| d.saturating_mul(2))
            .max(self.min)
            .min(self.max);
        self.current = Some(next);
        next
    }

    /// After a success: the next attempt waits for nothing.
    pub(crate) fn reset(&mut self) {
        self.current = None;
    }

    /// The wait before the next attempt: zero unless the last one failed.
    pub(crate) fn wait(&self) -> Duration {
        self.current.unwrap_or(Duration::ZERO)
    }
}

/// How long a node's task works on a runtime worker before it gives the
/// runtime a turn to run its timer and I/O driver.
pub(crate) const SLICE: Duration = Duration::from_micros(200);

/// Units of work between two reads of the clock in [`pace`].
const PACE_EVERY: u32 = 16;

thread_local! {
    /// Per worker thread: units since the clock was last read, and when
    /// the current slice of the node's work on this thread began.
    static PACED: std::cell::Cell<(u32, Option<std::time::Instant>)> =
        const { std::cell::Cell::new((0, None)) };
}

/// Yields to the runtime taken by [`pace`], for tests.
#[cfg(test)]
pub(crate) static PACE_YIELDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One unit of a long run of work on the runtime (reading a record,
/// applying an entry, an auditor's step): spends a unit of tokio's
/// cooperative budget, and after some [`SLICE`] of work yields with
/// `yield_now`.
///
/// Why both: the budget makes the task give its worker back every 128
/// units, but it is then queued again at once, and a worker whose queue
/// never empties polls its timer and I/O driver only every 61 tasks it
/// runs (tokio's `event_interval`): a node applying a backlog of
/// 10,000-entry events kept every timer of the application 20 to 40 ms
/// late (p99). `yield_now` hands the task back only after the worker has
/// polled its driver, so timers and sockets are served every slice. The
/// clock is read once every 16 units (some 25 ns each), so pacing costs
/// about 0.1 % of applying an entry.
pub(crate) async fn pace() {
    tokio::task::coop::consume_budget().await;
    let due = PACED.with(|p| {
        let (n, start) = p.get();
        let n = n.wrapping_add(1);
        if n % PACE_EVERY != 0 {
            p.set((n, start));
            return false;
        }
        let now = std::time::Instant::now();
        match start {
            Some(start) if now.saturating_duration_since(start) >= SLICE => {
                p.set((n, None));
                true
            }
            Some(_) => {
                p.set((n, start));
                false
            }
            None => {
                p.set((n, Some(now)));
                false
            }
        }
    });
    if due {
        #[cfg(test)]
        PACE_YIELDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokio::task::yield_now().await;
    }
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

/// The longest timeout or interval a transport takes: an hour. Longer
/// means nothing a broker connection can use, and sums of two such
/// settings must not overflow.
pub(crate) const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// Refuses a capacity below `min`, naming the setting: a builder stores
/// what it is given, and `build` or `connect` calls this before doing
/// anything else.
pub(crate) fn check_at_least<T: PartialOrd + fmt::Display>(
    setting: &str,
    value: T,
    min: T,
) -> Result<()> {
    if value >= min {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{setting} must be at least {min}, not {value}"
    )))
}

/// Refuses a duration outside `min..=max`, naming the setting and the
/// range in words (`1ms`, `1h`).
pub(crate) fn check_duration(
    setting: &str,
    value: Duration,
    min: Duration,
    max: Duration,
) -> Result<()> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{setting} must be between {} and {}, not {}",
        Readable(min),
        Readable(max),
        Readable(value)
    )))
}

/// A duration as a person would write it: `1h`, `5min`, `2s`, `100ms`.
struct Readable(Duration);

impl fmt::Display for Readable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d == Duration::MAX {
            return f.write_str("Duration::MAX");
        }
        let secs = d.as_secs();
        if d.subsec_nanos() == 0 && secs > 0 {
            for (unit, name) in [(3600, "h"), (60, "min"), (1, "s")] {
                if let Some(n) = secs.checked_div(unit).filter(|_| secs.is_multiple_of(unit)) {
                    return write!(f, "{n}{name}");
                }
            }
        }
        // Below a second, or not whole: `100ms`, `1ns`, `1.5s`.
        write!(f, "{d:?}")
    }
}

/// `now + d`, or the far future when that does not fit the clock. Every
/// configured duration goes through this, so `Duration::MAX` means "for as
/// long as the process runs" instead of an overflow panic.
pub(crate) fn deadline_after(d: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(d.min(FAR_FUTURE)).unwrap_or(now)
}

/// Runs `promtool check metrics` on `text`, fed on stdin, and requires
/// exit 0 (promtool exits 3 for lint problems, 1 for parse errors).
/// A missing promtool fails the test: always under CI, and elsewhere
/// unless CACHE_SYNC_SKIP_PROMTOOL=1, which skips it out loud.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn promtool_check(text: &str) {
    use std::io::Write as _;
    use std::process::{Command, Stdio};

    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let install = "install it (Debian: apt-get install prometheus; scripts/test does)";
            if std::env::var_os("CI").is_some() {
                panic!("promtool is not installed, and CI is set: {install}");
            }
            if std::env::var("CACHE_SYNC_SKIP_PROMTOOL").as_deref() == Ok("1") {
                eprintln!(
                    "SKIPPED: promtool check metrics (promtool not installed, CACHE_SYNC_SKIP_PROMTOOL=1)"
                );
                return;
            }
            panic!(
                "promtool is not installed: {install}, or set CACHE_SYNC_SKIP_PROMTOOL=1 to skip this check"
            );
        }
        Err(e) => panic!("promtool did not start: {e}"),
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed ({}):\n{}{}\non:\n{text}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// None until set; then only forward; its age the time since.
    #[tokio::test(start_paused = true)]
    async fn a_moment_only_moves_forward() {
        let m = Moment::default();
        assert_eq!(m.age(), None);
        let first = tokio::time::Instant::now();
        tokio::time::advance(Duration::from_secs(5)).await;
        let later = tokio::time::Instant::now();
        m.advance(later);
        assert_eq!(m.age(), Some(Duration::ZERO));
        m.advance(first);
        assert_eq!(
            m.age(),
            Some(Duration::ZERO),
            "an earlier moment is no news"
        );
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(m.age(), Some(Duration::from_millis(250)));
    }

    #[test]
    fn backoff_doubles_within_its_bounds_and_starts_over_after_a_success() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new(ms(100), ms(500));
        assert_eq!(b.wait(), Duration::ZERO, "no wait before a failure");
        let waits: Vec<_> = (0..5).map(|_| b.fail()).collect();
        assert_eq!(waits, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
        assert_eq!(b.wait(), ms(500));
        b.reset();
        assert_eq!(b.wait(), Duration::ZERO);
        assert_eq!(b.fail(), ms(100), "starts over at the minimum");
    }

    #[test]
    fn backoff_at_the_edges_never_overflows() {
        for (min, max) in [
            (Duration::ZERO, Duration::ZERO),
            (Duration::ZERO, Duration::MAX),
            (Duration::MAX, Duration::MAX),
            (Duration::from_nanos(1), Duration::MAX),
            // Reversed bounds: every wait is the maximum.
            (Duration::MAX, Duration::from_millis(1)),
        ] {
            let mut b = Backoff::new(min, max);
            for _ in 0..200 {
                let wait = b.fail();
                assert!(wait <= max, "{min:?}..{max:?}: {wait:?}");
            }
        }
        // From zero it stays zero: doubling nothing is nothing.
        assert_eq!(
            Backoff::new(Duration::ZERO, Duration::MAX).fail(),
            Duration::ZERO
        );
    }

    #[tokio::test]
    async fn any_duration_gives_a_deadline() {
        let now = tokio::time::Instant::now();
        assert!(deadline_after(Duration::ZERO) >= now);
        assert!(deadline_after(Duration::from_nanos(1)) >= now);
        assert!(deadline_after(Duration::MAX) > now + Duration::from_secs(86_400 * 365));
    }

    #[test]
    fn capacities_below_the_minimum_are_refused_by_name() {
        assert!(check_at_least("max_len", 1usize, 1).is_ok());
        assert!(check_at_least("max_len", usize::MAX, 1).is_ok());
        let e = check_at_least("max_len", 0usize, 1).unwrap_err();
        assert!(e.is_config());
        assert_eq!(
            e.to_string(),
            "invalid configuration: max_len must be at least 1, not 0"
        );
        assert!(
            check_at_least("max_messages", -1i64, 1)
                .unwrap_err()
                .is_config()
        );
    }

    #[test]
    fn durations_outside_the_range_are_refused_in_words() {
        let (min, max) = (Duration::from_millis(1), MAX_TIMEOUT);
        assert!(check_duration("block", min, min, max).is_ok());
        assert!(check_duration("block", max, min, max).is_ok());
        for (value, shown) in [
            (Duration::ZERO, "0ns"),
            (Duration::from_nanos(999_999), "999.999µs"),
            (max + Duration::from_nanos(1), "3600.000000001s"),
            (Duration::from_secs(7200), "2h"),
            (Duration::MAX, "Duration::MAX"),
        ] {
            let e = check_duration("block", value, min, max).unwrap_err();
            assert!(e.is_config());
            assert_eq!(
                e.to_string(),
                format!("invalid configuration: block must be between 1ms and 1h, not {shown}")
            );
        }
        assert_eq!(Readable(Duration::from_secs(300)).to_string(), "5min");
        assert_eq!(Readable(Duration::from_secs(2)).to_string(), "2s");
        assert_eq!(Readable(Duration::from_millis(100)).to_string(), "100ms");
    }
}

/// The start of the clock [`Moment`]s count from: taken when the first is
/// made, before any moment they hold.
static CLOCK_BASE: std::sync::LazyLock<tokio::time::Instant> =
    std::sync::LazyLock::new(tokio::time::Instant::now);

/// A moment on the process's monotonic clock (tokio's), shared between
/// tasks without a lock, or none: nanoseconds since [`CLOCK_BASE`], plus
/// one (0 is none). It only moves forward.
#[derive(Debug)]
pub(crate) struct Moment(std::sync::atomic::AtomicU64);

impl Default for Moment {
    fn default() -> Self {
        // The base before any moment: one taken earlier would count from a
        // later base, and look younger than it is.
        std::sync::LazyLock::force(&CLOCK_BASE);
        Moment(std::sync::atomic::AtomicU64::new(0))
    }
}

impl Moment {
    /// Moves the moment forward to `at`, if it is later.
    pub(crate) fn advance(&self, at: tokio::time::Instant) {
        let nanos = at.saturating_duration_since(*CLOCK_BASE).as_nanos();
        let n = u64::try_from(nanos)
            .unwrap_or(u64::MAX - 1)
            .saturating_add(1);
        self.0.fetch_max(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Takes `other`'s moment, or none, whatever it held.
    pub(crate) fn set_from(&self, other: Option<&Moment>) {
        let n = other.map_or(0, |o| o.0.load(std::sync::atomic::Ordering::Relaxed));
        self.0.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sets the moment to `at`, or none, earlier or later than it was. A
    /// moment before the clock's base is none: it cannot be told apart
    /// from the base, and would look far younger than it is.
    pub(crate) fn set(&self, at: Option<tokio::time::Instant>) {
        let at = at.filter(|at| *at >= *CLOCK_BASE);
        let n = at.map_or(0, |at| {
            let nanos = at.saturating_duration_since(*CLOCK_BASE).as_nanos();
            u64::try_from(nanos)
                .unwrap_or(u64::MAX - 1)
                .saturating_add(1)
        });
        self.0.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// The moment, if there is one.
    pub(crate) fn get(&self) -> Option<tokio::time::Instant> {
        let n = self.0.load(std::sync::atomic::Ordering::Relaxed);
        CLOCK_BASE.checked_add(Duration::from_nanos(n.checked_sub(1)?))
    }

    /// How long ago the moment was, if there is one.
    pub(crate) fn age(&self) -> Option<Duration> {
        let n = self.0.load(std::sync::atomic::Ordering::Relaxed);
        let since_base = Duration::from_nanos(n.checked_sub(1)?);
        let now = tokio::time::Instant::now().saturating_duration_since(*CLOCK_BASE);
        Some(now.saturating_sub(since_base))
    }
}
