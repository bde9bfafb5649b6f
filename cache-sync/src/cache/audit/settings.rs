//! The auditor's settings: `Audit`, its defaults and ranges, and the pace
//! they set for rounds.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::Rows;
use super::values::Values;
use crate::util::{MAX_TIMEOUT, check_at_least, check_duration};

type ReadFuture<K, V> = Pin<Box<dyn Future<Output = Result<Rows<K, V>, String>> + Send>>;
type Read<K, V> = Arc<dyn Fn(Vec<K>) -> ReadFuture<K, V> + Send + Sync>;

/// The most keys one read of the source asks for.
pub(crate) const MAX_AUDIT_BATCH: usize = 10_000;

/// What the grace window adds to the reorder window and the announce
/// interval by default: time for a delivery and its apply, and for a
/// round to come round.
pub(crate) const AUDIT_MARGIN: Duration = Duration::from_secs(2);

// The defaults and ranges `Audit`'s docs and design.md state
// (tests/doc_limits.rs checks them).
const DEFAULT_AUDIT_RATE: u32 = 100;
const DEFAULT_AUDIT_BATCH: usize = 100;
const DEFAULT_AUDIT_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_AUDIT_WINDOW: Duration = Duration::from_secs(3600);
const MIN_AUDIT_WINDOW: Duration = Duration::from_secs(60);
const MAX_AUDIT_WINDOW: Duration = Duration::from_secs(30 * 86_400);

/// A consistency auditor for one cache: how to read the source of truth,
/// and how fast. Give it to [`SyncedCacheBuilder::audit`](crate::SyncedCacheBuilder::audit).
///
/// The node that holds the cache sweeps the entries it holds, in batches,
/// at most [`rate`](Self::rate) keys a second, and reads each batch from
/// the source in one call. An entry older than the source's row (by
/// version, or by value where values are compared) is a *suspect*: its
/// event may be in flight. It is read again after the
/// [grace window](Self::grace); if the node still holds the very same
/// entry (no write, event or clear touched the key meanwhile) and the
/// source still differs, it is an *inconsistency*: counted, logged with
/// the key's trace, and repaired by removing the entry, so the next read
/// loads it. See [`AuditStatus`](crate::status::AuditStatus) for what is reported.
///
/// The auditor's reads of the node's entries count no access in moka (for
/// its eviction policy and its time-to-idle, so audited entries idle out
/// as others do), except where noted here. A sweep takes the keys from
/// moka's iteration, which counts none, and where values are compared,
/// keeps no copy of the values: for each key, a 64-bit fingerprint of its
/// value's encoding (bincode's standard encoding, the one
/// [`compare_values`](Self::compare_values) falls back on), 8 bytes a key
/// for up to a sweep. When the sweep reaches a key that no write touched
/// since and that moka still holds, a source row whose encoding has the
/// same fingerprint agrees, with no access. Two different encodings share
/// a fingerprint with a chance of about 2⁻⁶⁴ (a keyed hash, its key drawn
/// at random when the cache is built), which would let a wrong entry pass
/// for one sweep. Read with moka's `get`, which counts as an access, are
/// only: an entry whose fingerprint differs from the row's, where the
/// versions leave the values to decide (read after the source, then
/// compared as `compare_values` says), a key written
/// since the sweep began (which that write just accessed), one the
/// bounded version table cannot vouch for while it is full (see
/// [`max_tracked_keys`](crate::SyncedCacheBuilder::max_tracked_keys)), a
/// value that does not encode, and a suspect read again after its grace
/// window.
pub struct Audit<K, V> {
    pub(super) read: Read<K, V>,
    /// How values are compared, where they are.
    pub(super) values: Option<Values<V>>,
    pub(in crate::cache) rate: u32,
    pub(in crate::cache) batch: usize,
    pub(super) grace: Option<Duration>,
    pub(super) timeout: Duration,
    pub(super) window: Duration,
}

impl<K, V> fmt::Debug for Audit<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Audit")
            .field("compares_values", &self.values.is_some())
            .field("rate", &self.rate)
            .field("batch", &self.batch)
            .field("grace", &self.grace)
            .field("timeout", &self.timeout)
            .field("window", &self.window)
            .finish_non_exhaustive()
    }
}

impl<K, V> Audit<K, V>
where
    K: Send + 'static,
    V: Send + 'static,
{
    /// Audits against a versioned source: `read` gets a batch of keys and
    /// answers, for each, `Some((value, version))` for the row in the
    /// source, in the versions the table's events carry, or `None` where
    /// there is no row (a cache that keeps absences, of `Option<V>`,
    /// answers `Some((None, version))` instead). A key it leaves out is
    /// not judged this time; a reply naming a key it was not asked for,
    /// or one twice, is refused whole, as an error is.
    ///
    /// An entry is behind when the value the node holds was installed at a
    /// version below the row's (by an event's refresh or a versioned load),
    /// or when the source has no row for it. A value installed with no
    /// version (a plain `get_with`, a local insert, an unversioned refresh,
    /// or any of these after a versioned write), or whose record the
    /// bounded version table evicted, cannot be judged by version: it is
    /// compared by value if [`compare_values`](Self::compare_values) is on,
    /// and otherwise counted as `unverified`. A row at a version below the
    /// node's (the source is a lagging replica) is not held against the
    /// node; a row a lagging replica does not have yet is, until it is read
    /// again after the grace window, so a replica that lags by more than
    /// that makes false inconsistencies: audit against the primary.
    pub fn versioned<F, Fut, E>(read: F) -> Self
    where
        F: Fn(Vec<K>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<(K, Option<(V, u64)>)>, E>> + Send + 'static,
        E: fmt::Display,
    {
        Self::with_read(Arc::new(move |keys| {
            let f = read(keys);
            Box::pin(async move {
                match f.await {
                    Ok(rows) => Ok(rows
                        .into_iter()
                        .map(|(k, row)| (k, row.map(|(v, version)| (v, Some(version)))))
                        .collect()),
                    Err(e) => Err(e.to_string()),
                }
            })
        }))
    }

    /// Audits against a source without versions, comparing values: `read`
    /// answers `Some(value)` for a row, or `None` where there is none.
    /// Otherwise as [`versioned`](Self::versioned). Values compare as
    /// [`compare_values`](Self::compare_values) says.
    pub fn by_value<F, Fut, E>(read: F) -> Self
    where
        V: PartialEq + Serialize,
        F: Fn(Vec<K>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<(K, Option<V>)>, E>> + Send + 'static,
        E: fmt::Display,
    {
        let mut audit = Self::with_read(Arc::new(move |keys| {
            let f = read(keys);
            Box::pin(async move {
                match f.await {
                    Ok(rows) => Ok(rows
                        .into_iter()
                        .map(|(k, row)| (k, row.map(|v| (v, None))))
                        .collect()),
                    Err(e) => Err(e.to_string()),
                }
            })
        }));
        audit.values = Some(Values::of());
        audit
    }

    fn with_read(read: Read<K, V>) -> Self {
        Self {
            read,
            values: None,
            rate: DEFAULT_AUDIT_RATE,
            batch: DEFAULT_AUDIT_BATCH,
            grace: None,
            timeout: DEFAULT_AUDIT_TIMEOUT,
            window: DEFAULT_AUDIT_WINDOW,
        }
    }

    /// Also compares values: an entry the node knows at the row's version
    /// (or at none) but whose value differs is behind, and one whose value
    /// equals the row's is not, whatever its version.
    ///
    /// Two values are equal if `PartialEq` says so, or else if they encode
    /// to the same bytes (bincode's standard encoding, as events carry
    /// values). The second makes a value equal to itself where `PartialEq`
    /// is not reflexive: a float NaN, alone or inside a value, would
    /// otherwise be removed as an inconsistency at every sweep. It adds no
    /// false agreement (what encodes alike reaches every node alike; a
    /// field that `Serialize` skips is never compared), and two NaNs with
    /// different bits still differ. The encoding is paid only where
    /// `PartialEq` says the values differ.
    pub fn compare_values(mut self) -> Self
    where
        V: PartialEq + Serialize,
    {
        self.values = Some(Values::of());
        self
    }

    /// At most this many keys a second are read from the source, suspects'
    /// second reads included, in at most rate ÷ batch reads a second.
    /// Default 100; at least 1. A round reads up to a batch, then waits
    /// batch ÷ rate, stretched by a random 0 to 25 % so that nodes started
    /// together drift apart and do not read together; so a sweep of the
    /// whole cache takes about 1.25 × entries ÷ rate (in whole batches),
    /// plus the time the reads themselves take. A cache smaller than a
    /// batch is swept whole each round.
    pub fn rate(mut self, keys_per_second: u32) -> Self {
        self.rate = keys_per_second;
        self
    }

    /// How many keys one read of the source asks for. Default 100; 1 to
    /// 10,000. A read starts at most every batch ÷ rate seconds.
    pub fn batch(mut self, keys: usize) -> Self {
        self.batch = keys;
        self
    }

    /// How long a mismatch waits, as a suspect, for the event that would
    /// explain it before it is read again. Default: the node's
    /// [reorder window](crate::NodeBuilder::reorder_window) + the default
    /// announce interval (1 s) + 2 s, 13 s with the defaults: within that,
    /// an event published when the source changed has arrived, or its
    /// loss has been noticed (by its publisher's announcement) and the
    /// cache resynced. Time while the node is not ready does not count:
    /// a suspect waits a whole window after the node is ready again.
    /// Raise it where writers commit long before they publish (an outbox
    /// relay that lags, a publish retried through a broker's failover), or
    /// where publishers announce less often than every second
    /// ([`PublisherBuilder::announce_interval`](crate::PublisherBuilder::announce_interval)).
    /// `Duration::MAX` never confirms anything; since at most 4 × batch
    /// suspects (and at least 64) wait at a time, the sweep then stops
    /// once that many mismatches are open, until events explain them.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = Some(grace);
        self
    }

    /// A read of the source that takes longer than this counts as failed.
    /// Default 5 s; 1 ms to 1 h.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The window the consistency nines are taken over. Default 1 h; 1 min
    /// to 30 days. It is kept in 60 buckets, and slides by one.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    pub(in crate::cache) fn check(&self) -> crate::Result<()> {
        check_at_least("audit rate", self.rate, 1)?;
        check_at_least("audit batch", self.batch, 1)?;
        if self.batch > MAX_AUDIT_BATCH {
            return Err(crate::Error::Config(format!(
                "audit batch must be at most {MAX_AUDIT_BATCH}, not {}",
                self.batch
            )));
        }
        check_duration(
            "audit timeout",
            self.timeout,
            Duration::from_millis(1),
            MAX_TIMEOUT,
        )?;
        check_duration(
            "audit window",
            self.window,
            MIN_AUDIT_WINDOW,
            MAX_AUDIT_WINDOW,
        )
    }

    /// The wait a round that read `keys` keys asks for: their share of the
    /// rate, stretched by 0 to 25 % at random.
    pub(super) fn pace(&self, keys: usize) -> Duration {
        let share = keys.max(1) as f64 / f64::from(self.rate);
        let stretch = 1.0 + (crate::util::random_u64() % 1024) as f64 / 4096.0;
        Duration::from_secs_f64(share * stretch)
    }
}

/// The wait before the first round: up to one round's pace, at random, so
/// nodes started together do not read the source together.
pub(crate) fn first_wait(rate: u32, batch: usize) -> Duration {
    let share = batch.max(1) as f64 / f64::from(rate.max(1));
    // Whole nanoseconds, rounded down: `from_secs_f64` rounds to the
    // nearest, which can land above one share when it is under a
    // nanosecond (a rate of a billion keys a second).
    let nanos = share * (crate::util::random_u64() % 1024) as f64 / 1024.0 * 1e9;
    Duration::from_nanos(nanos as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::audit::window::Window;
    use tokio::time::Instant;

    fn any_audit(rate: u32, batch: usize, timeout: Duration, window: Duration) -> Audit<u32, u32> {
        Audit::versioned(|keys: Vec<u32>| async move {
            Ok::<_, String>(keys.into_iter().map(|k| (k, None)).collect())
        })
        .rate(rate)
        .batch(batch)
        .timeout(timeout)
        .window(window)
    }

    proptest::proptest! {
        /// Every setting at its edges and between: refused exactly outside
        /// its documented range, and where taken, the waits it makes are
        /// finite, within the rate (at most 25 % over a round's share), and
        /// never panic.
        #[test]
        fn settings_are_refused_outside_their_range_and_pace_within_the_rate(
            rate in proptest::prop_oneof![
                proptest::strategy::Just(0u32), proptest::strategy::Just(1), proptest::strategy::Just(u32::MAX), proptest::prelude::any::<u32>()
            ],
            batch in proptest::prop_oneof![
                proptest::strategy::Just(0usize), proptest::strategy::Just(1), proptest::strategy::Just(MAX_AUDIT_BATCH),
                proptest::strategy::Just(MAX_AUDIT_BATCH + 1), proptest::strategy::Just(usize::MAX), 0..20_000usize
            ],
            timeout_ms in proptest::prop_oneof![
                proptest::strategy::Just(0u64), proptest::strategy::Just(1), proptest::strategy::Just(3_600_000), proptest::strategy::Just(3_600_001), proptest::strategy::Just(u64::MAX)
            ],
            window_s in proptest::prop_oneof![
                proptest::strategy::Just(0u64), proptest::strategy::Just(59), proptest::strategy::Just(60), proptest::strategy::Just(30 * 86_400), proptest::strategy::Just(30 * 86_400 + 1), proptest::strategy::Just(u64::MAX)
            ],
            keys in 0..=MAX_AUDIT_BATCH,
        ) {
            let audit = any_audit(
                rate,
                batch,
                Duration::from_millis(timeout_ms),
                Duration::from_secs(window_s),
            );
            let in_range = rate >= 1
                && (1..=MAX_AUDIT_BATCH).contains(&batch)
                && (1..=3_600_000).contains(&timeout_ms)
                && (60..=30 * 86_400).contains(&window_s);
            proptest::prop_assert_eq!(audit.check().is_ok(), in_range);
            if in_range {
                let keys = keys.min(batch);
                let pace = audit.pace(keys);
                let share = keys.max(1) as f64 / f64::from(rate);
                // Durations count whole nanoseconds.
                proptest::prop_assert!(pace.as_secs_f64() >= share * 0.999 - 1e-9);
                proptest::prop_assert!(pace.as_secs_f64() <= share * 1.25 + 1e-9);
                proptest::prop_assert!(first_wait(rate, batch).as_secs_f64() <= batch as f64 / f64::from(rate));
                let mut w = Window::new(audit.window);
                let now = Instant::now();
                w.add(now, u64::MAX, u64::MAX);
                w.add(now, 1, 1);
                proptest::prop_assert_eq!(w.sums(now), (u64::MAX, u64::MAX));
            }
        }
    }
}
