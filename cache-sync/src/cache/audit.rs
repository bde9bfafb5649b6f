//! The consistency auditor: a node compares what its cache holds with the
//! source of truth, at a bounded rate, and counts, logs and repairs what no
//! event explains (a write that bypassed the publisher, a bug).
//!
//! The node's audit task (`node/audit.rs`) decides when a round runs (only
//! while the node is ready, at the pace a round asks for); a round, here,
//! decides what to read and what the answers mean.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, Hash, RandomState};
use std::num::NonZeroU64;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokio::time::Instant;

use super::Inner;
use super::write::Write;
use crate::status::{AuditStatus, TraceEvent};
use crate::util::{Backoff, HashMap, HashSet, MAX_TIMEOUT, check_at_least, check_duration, lock};

/// A source row as the auditor compares it: the value and, if the source
/// keeps one, its version.
type Row<V> = (V, Option<u64>);
type Rows<K, V> = Vec<(K, Option<Row<V>>)>;
type ReadFuture<K, V> = Pin<Box<dyn Future<Output = Result<Rows<K, V>, String>> + Send>>;
type Read<K, V> = Arc<dyn Fn(Vec<K>) -> ReadFuture<K, V> + Send + Sync>;

/// The node's round trip on the cache's route (`node/audit.rs`): whether a
/// marker it publishes now comes back through its own subscription within
/// the time given, which shows that everything published on that route
/// before it has been delivered.
pub(crate) type RoundTrip<'a> =
    &'a (dyn Fn(Duration) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> + Send + Sync);

/// The most keys one read of the source asks for.
pub(crate) const MAX_AUDIT_BATCH: usize = 10_000;

/// What the grace window adds to the reorder window and the announce
/// interval by default: time for a delivery and its apply, and for a
/// round to come round.
pub(crate) const AUDIT_MARGIN: Duration = Duration::from_secs(2);

/// The nines' window is kept in this many buckets: the window slides by a
/// sixtieth of itself.
const WINDOW_BUCKETS: u32 = 60;

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
/// loads it. See [`AuditStatus`] for what is reported.
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
    pub(super) rate: u32,
    pub(super) batch: usize,
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

    pub(super) fn check(&self) -> crate::Result<()> {
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
    fn pace(&self, keys: usize) -> Duration {
        let share = keys.max(1) as f64 / f64::from(self.rate);
        let stretch = 1.0 + (crate::util::random_u64() % 1024) as f64 / 4096.0;
        Duration::from_secs_f64(share * stretch)
    }
}

/// How values are compared, where they are: the audit's equality, and the
/// encoding the sweep's fingerprints hash. Set together where
/// `V: PartialEq + Serialize` is known (`by_value`, `compare_values`).
pub(super) struct Values<V> {
    same: fn(&V, &V) -> bool,
    encode: fn(&V) -> Option<Bytes>,
}

impl<V> Clone for Values<V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Values<V> {}

impl<V> Values<V> {
    fn of() -> Self
    where
        V: PartialEq + Serialize,
    {
        Self {
            same: same_value::<V>,
            encode: encode_value::<V>,
        }
    }
}

/// A value's encoding: the wire's, which [`same_value`] compares and the
/// sweep's fingerprints hash; `None` if it does not encode.
fn encode_value<V: Serialize>(value: &V) -> Option<Bytes> {
    crate::wire::encode_part(value, "value").ok()
}

/// The audit's equality (see [`Audit::compare_values`]): `PartialEq`, or
/// the same encoding. A value that does not encode is judged by
/// `PartialEq` alone.
fn same_value<V: PartialEq + Serialize>(held: &V, source: &V) -> bool {
    if held == source {
        return true;
    }
    match (encode_value(held), encode_value(source)) {
        (Some(h), Some(s)) => h == s,
        _ => false,
    }
}

/// A value's fingerprint: its encoding hashed with the auditor's keyed
/// hash (SipHash-1-3, `std`'s, its key drawn at random per auditor, so
/// no writer can aim at a collision), never 0, so that `Option` of it is
/// 8 bytes. Equal encodings have equal fingerprints; different ones share
/// one with a chance of about 2⁻⁶⁴. `None` for a value that does not
/// encode.
fn fingerprint<V>(values: Values<V>, hash: &RandomState, value: &V) -> Option<NonZeroU64> {
    let encoded = (values.encode)(value)?;
    Some(NonZeroU64::new(hash.hash_one(&encoded[..])).unwrap_or(NonZeroU64::MIN))
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

/// One cache's auditor: its settings, its sweep, and its counters.
pub(super) struct Auditor<K, V> {
    pub(super) audit: Audit<K, V>,
    /// The key of the values' fingerprints (see [`fingerprint`]).
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
    /// see [`Sweep`]. No value is kept: 8 bytes a key.
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

/// Checks and inconsistencies over the last `width × WINDOW_BUCKETS`.
struct Window {
    width: Duration,
    /// (bucket start, checks, inconsistencies), oldest first.
    buckets: VecDeque<(Instant, u64, u64)>,
}

impl Window {
    fn new(window: Duration) -> Self {
        Self {
            width: window.checked_div(WINDOW_BUCKETS).unwrap_or(window),
            buckets: VecDeque::new(),
        }
    }

    fn add(&mut self, now: Instant, checks: u64, inconsistencies: u64) {
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

    fn sums(&mut self, now: Instant) -> (u64, u64) {
        self.expire(now);
        self.buckets.iter().fold((0, 0), |(c, i), (_, bc, bi)| {
            (c.saturating_add(*bc), i.saturating_add(*bi))
        })
    }
}

/// What a comparison says of one entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Agrees,
    Behind,
    /// No version to compare and values are not compared.
    Unverified,
}

/// The node's entry for a key: the table's stamp when read, the version
/// the held value was installed at, and its value, where values are
/// compared.
struct Held<V> {
    token: u64,
    version: Option<u64>,
    value: HeldValue<V>,
}

/// The node's value, as far as it was read.
enum HeldValue<V> {
    /// Values are not compared.
    NotCompared,
    /// Read with moka's `get`.
    Read(V),
    /// Not read: the fingerprint of the value the sweep read, which no
    /// stamped write has replaced since (and moka held the key).
    Seen(NonZeroU64),
}

/// Compares the node's entry, installed at `version`, with the source's
/// row (`None`: no row), given whether their values are equal (`None`:
/// not compared). A caller may leave the values uncompared where this
/// does not look at them: no row, or a row below `version`.
fn verdict<V>(version: Option<u64>, row: Option<&Row<V>>, same_value: Option<bool>) -> Verdict {
    let Some((_, row_version)) = row else {
        // The node holds a value for a row the source does not have.
        return Verdict::Behind;
    };
    match (version, row_version) {
        // The source lags the node (a replica): not the node's fault.
        (Some(h), Some(r)) if source_lags(h, *r) => Verdict::Agrees,
        (Some(h), Some(r)) if h == *r => match same_value {
            Some(false) => Verdict::Behind,
            _ => Verdict::Agrees,
        },
        (Some(_), Some(_)) => match same_value {
            Some(true) => Verdict::Agrees,
            _ => Verdict::Behind,
        },
        _ => match same_value {
            Some(true) => Verdict::Agrees,
            Some(false) => Verdict::Behind,
            None => Verdict::Unverified,
        },
    }
}

/// Whether the source's row, at `row`, is below the version the node's
/// value was installed at, `held`: a lagging replica, which agrees
/// whatever the values (see [`verdict`]).
fn source_lags(held: u64, row: u64) -> bool {
    held > row
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

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// One round: reads again the suspects whose grace window is over
    /// (counted from `settled_since` at the earliest: the last time the
    /// node was not ready), then the sweep's next keys, all in one read of
    /// the source. Returns how long to wait before the next round; `None`
    /// for a cache that is not audited.
    pub(super) async fn audit_round(
        &self,
        default_grace: Duration,
        settled_since: Instant,
        ready: &(dyn Fn() -> bool + Send + Sync),
        round_trip: RoundTrip<'_>,
    ) -> Option<Duration> {
        let auditor = self.audit.as_ref()?;
        let audit = &auditor.audit;
        let grace = audit.grace.unwrap_or(default_grace);
        let now = Instant::now();
        // A new sweep's keys are gathered outside the state's lock: a scan
        // of the whole cache must not hold up the status and heartbeats,
        // which read the counters under it.
        if lock(&auditor.state).pass.is_empty() {
            let pass = self.sweep(auditor).await;
            let mut state = lock(&auditor.state);
            if state.pass.is_empty() && !pass.keys.is_empty() {
                auditor.stats.sweeps.fetch_add(1, Relaxed);
                state.pass = pass.keys;
                state.seen = pass.fingerprints;
                state.seen_at = pass.since;
            }
        }
        let (due, sweep) = {
            let mut state = lock(&auditor.state);
            if state.suspects.len() >= auditor.max_suspects() {
                // Full: first let go of the suspects already explained, so
                // that a long grace window stops the sweep only while as
                // many mismatches as the cap are really open. (Lock order:
                // the auditor's state, then the version table; nothing
                // takes them the other way round.)
                let table = lock(&self.table);
                let before = state.suspects.len();
                state.suspects.retain(|k, s| !table.superseded(k, s.token));
                let explained = before.saturating_sub(state.suspects.len());
                auditor.stats.cleared.fetch_add(explained as u64, Relaxed);
            }
            let due = due_keys(&state.suspects, now, settled_since, grace, audit.batch);
            let room = audit.batch.saturating_sub(due.len());
            // Before the due suspects leave the map: a key is asked for once.
            let sweep = if state.suspects.len() >= auditor.max_suspects() {
                Vec::new()
            } else {
                next_keys(&mut state, room)
            };
            let due: Vec<(K, Suspect)> = due
                .into_iter()
                .filter_map(|k| state.suspects.remove_entry(&k))
                .collect();
            (due, sweep)
        };
        // Suspects whose key was written or cleared since are explained.
        let due: Vec<(K, Suspect)> = {
            let table = lock(&self.table);
            due.into_iter()
                .filter(|(key, suspect)| {
                    let moved = table.superseded(key, suspect.token);
                    if moved {
                        auditor.stats.cleared.fetch_add(1, Relaxed);
                    }
                    !moved
                })
                .collect()
        };
        // The node's side first, then the source's: a write landing in
        // between shows in the stamp, and the suspect it may make clears.
        // (A value left unread, its fingerprint differing from the row's,
        // is read after the source's, but only if no write came since the
        // node's side was read: see `judge`.)
        let mut held = Vec::with_capacity(sweep.len());
        for (key, seen) in sweep {
            if let Some(entry) = self.held(&key, seen).await {
                held.push(((*key).clone(), entry));
            }
        }
        let asked: Vec<K> = due
            .iter()
            .map(|(k, _)| k.clone())
            .chain(held.iter().map(|(k, _)| k.clone()))
            .collect();
        // At most one read per batch ÷ rate, however few keys it asks for:
        // a cache smaller than a batch is not read over and over.
        let pace = audit.pace(audit.batch);
        if asked.is_empty() {
            self.audit_pending(auditor);
            return Some(pace);
        }
        auditor.stats.reads.fetch_add(1, Relaxed);
        // On a task of its own, so that a read that panics is a failed read
        // (not the end of the auditor), and one that outlives its timeout,
        // or a round dropped at shutdown, is stopped rather than left
        // running against the database.
        let read = Reading(tokio::spawn((audit.read)(asked.clone())));
        let answer = match tokio::time::timeout(audit.timeout, read).await {
            Ok(Ok(Ok(rows))) => answered(rows, &asked),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(e)) => Err(format!("the read panicked or was cancelled: {e}")),
            Err(_) => Err(format!("no answer within {:?}", audit.timeout)),
        };
        let mut rows = match answer {
            Ok(rows) => rows,
            Err(error) => {
                auditor.stats.read_failures.fetch_add(1, Relaxed);
                let mut state = lock(&auditor.state);
                // The suspects wait for the next read; the swept keys come
                // round again next sweep.
                state.suspects.extend(due);
                let wait = state.backoff.fail();
                drop(state);
                self.audit_pending(auditor);
                tracing::warn!(cache = %self.name, %error, retry_in = ?wait, "audit: reading the source failed");
                return Some(wait);
            }
        };
        lock(&auditor.state).backoff.reset();
        let mut checks = 0u64;
        for (key, entry) in held {
            let Some(row) = rows.remove(&key) else {
                auditor.stats.unverified.fetch_add(1, Relaxed);
                continue;
            };
            let (token, version) = (entry.token, entry.version);
            let Some(judged) = self.judge(auditor, &key, entry, row.as_ref()).await else {
                // Written, or gone, since the node's side was read: nothing
                // to judge; the key comes round again next sweep.
                continue;
            };
            match judged {
                Verdict::Agrees => checks = checks.saturating_add(1),
                Verdict::Unverified => {
                    auditor.stats.unverified.fetch_add(1, Relaxed);
                }
                Verdict::Behind => {
                    checks = checks.saturating_add(1);
                    auditor.stats.suspects.fetch_add(1, Relaxed);
                    lock(&auditor.state).suspects.insert(
                        key,
                        Suspect {
                            token,
                            observed: now,
                            version,
                        },
                    );
                }
            }
        }
        let mut behind = Vec::new();
        for (key, suspect) in due {
            let Some(row) = rows.remove(&key) else {
                // Not answered: it waits for the next read.
                lock(&auditor.state).suspects.insert(key, suspect);
                continue;
            };
            // Read as it is now: the sweep's fingerprint may be of a value
            // older than an install no stamp shows (an entry moka expired,
            // loaded again without a version). A `get`, which moka counts
            // as an access, but only for a suspect, once after each grace
            // window.
            let still = match self.held(&key, None).await {
                Some(entry) if !lock(&self.table).superseded(&key, suspect.token) => {
                    self.judge(auditor, &key, entry, row.as_ref()).await == Some(Verdict::Behind)
                }
                _ => false,
            };
            if still {
                behind.push((key, suspect, row.and_then(|(_, v)| v)));
            } else {
                auditor.stats.cleared.fetch_add(1, Relaxed);
            }
        }
        // Still behind past the grace window. Before it counts, the node
        // shows that its link delivers: a marker it publishes now on the
        // cache's route must come back through its own subscription, and
        // the node applies everything it read before the marker first. A
        // stalled link (a paused broker, a partition, a consumer held up)
        // that still looks ready does not return it, and the suspects
        // wait; so do they while event writes wait parked behind a load.
        let delivered = |inner: &Self| ready() && inner.parked_items.load(Relaxed) == 0;
        let confirmed = !behind.is_empty()
            && delivered(self)
            && round_trip(audit.timeout).await
            && delivered(self);
        let mut found = 0u64;
        for (key, suspect, source_version) in behind {
            if !confirmed {
                lock(&auditor.state).suspects.insert(key, suspect);
            } else if self
                .inconsistent(auditor, key, suspect, source_version)
                .await
            {
                found = found.saturating_add(1);
            } else {
                // Written while the marker travelled: the event it waited for.
                auditor.stats.cleared.fetch_add(1, Relaxed);
            }
        }
        lock(&auditor.state)
            .window
            .add(Instant::now(), checks, found);
        auditor.stats.checks.fetch_add(checks, Relaxed);
        self.audit_pending(auditor);
        Some(pace)
    }

    /// Repairs an entry still behind after its grace window by removing it,
    /// unless something wrote the key since it was judged: then the write
    /// stands, and it was no inconsistency. Counts, logs and traces one
    /// that was; returns whether it was.
    async fn inconsistent(
        &self,
        auditor: &Auditor<K, V>,
        key: K,
        suspect: Suspect,
        source_version: Option<u64>,
    ) -> bool {
        let trace = self.trace.as_ref().map(|t| t.of(&key));
        let repaired = self
            .write(key.clone(), |table, k| {
                if table.superseded(k, suspect.token) || table.held_at(k) != suspect.version {
                    Write::Keep
                } else {
                    table.touch(k);
                    Write::Remove
                }
            })
            .await;
        if !repaired {
            return false;
        }
        let stats = &auditor.stats;
        stats.inconsistencies.fetch_add(1, Relaxed);
        stats.repairs.fetch_add(1, Relaxed);
        let stale = Instant::now().saturating_duration_since(suspect.observed);
        let stale_ms = u64::try_from(stale.as_millis()).unwrap_or(u64::MAX);
        stats.last_stale_ms.store(stale_ms, Relaxed);
        stats.max_stale_ms.fetch_max(stale_ms.max(1), Relaxed);
        let shown = serde_json::to_string(&key).unwrap_or_else(|e| format!("<{e}>"));
        tracing::warn!(
            cache = %self.name,
            key = %shown,
            ?source_version,
            stale_for = ?stale,
            ?trace,
            "audit: the node held an entry older than the source of truth past the grace window; removed it"
        );
        self.traced(Some(key), TraceEvent::Repaired, source_version);
        true
    }

    /// The node's entry for `key`, read under its stripe so no write to it
    /// is half done; `None` if it holds none. Where values are compared,
    /// the value is left unread if it can be: moka counts a `get` as an
    /// access (for its eviction policy, and its time-to-idle, which an
    /// auditor reading every entry each sweep would never let pass: issue
    /// 35, item 8), and `contains_key` and its iteration count none. So if
    /// the sweep fingerprinted the value (`seen`: the fingerprint, and the
    /// table's stamp before the sweep) and no write to the key was stamped
    /// since, the fingerprint stands for it (see [`judge`](Self::judge));
    /// only a key written since, which that write has just accessed
    /// anyway, or one without a fingerprint (a value that does not encode,
    /// a suspect read again) is read with `get` here.
    async fn held(&self, key: &K, seen: Option<Seen>) -> Option<Held<V>> {
        let auditor = self.audit.as_ref()?;
        let _stripe = self.write_locks[self.stripe(key)].lock().await;
        let (token, version, seen) = {
            let table = lock(&self.table);
            let seen = seen
                .filter(|(_, since)| !table.superseded(key, *since))
                .map(|(fingerprint, _)| fingerprint);
            (table.load_token(), table.held_at(key), seen)
        };
        let value = match (auditor.audit.values, seen) {
            (Some(_), Some(seen)) if self.cache.contains_key(key) => HeldValue::Seen(seen),
            (Some(_), Some(_)) => return None,
            (Some(_), None) => HeldValue::Read(self.cache.get(key).await?),
            (None, _) if self.cache.contains_key(key) => HeldValue::NotCompared,
            (None, _) => return None,
        };
        Some(Held {
            token,
            version,
            value,
        })
    }

    /// Judges the node's entry, as [`held`](Self::held) read it, against
    /// the source's row (`None`: no row). A value left unread (its
    /// fingerprint) agrees if the row's value encodes to the same
    /// fingerprint, with no access; otherwise, where the verdict looks at
    /// the values, it is read now with `get` and compared as
    /// [`Audit::compare_values`] says, if the entry is still the one read
    /// first (see [`value_now`](Self::value_now)). `None`: it is not, or
    /// moka no longer holds it, and there is nothing to judge.
    async fn judge(
        &self,
        auditor: &Auditor<K, V>,
        key: &K,
        held: Held<V>,
        row: Option<&Row<V>>,
    ) -> Option<Verdict> {
        let same_value = match (auditor.audit.values, held.value, row) {
            (Some(values), HeldValue::Read(value), Some((source, _))) => {
                Some((values.same)(&value, source))
            }
            (Some(values), HeldValue::Seen(seen), Some((source, source_version))) => {
                let lags = held
                    .version
                    .zip(*source_version)
                    .is_some_and(|(h, r)| source_lags(h, r));
                if fingerprint(values, &auditor.fingerprints, source) == Some(seen) {
                    // The same encoding as the value the sweep read, which
                    // is still the one held: equal.
                    Some(true)
                } else if lags {
                    // Agrees whatever the values.
                    None
                } else {
                    let value = self.value_now(key, held.token, held.version).await?;
                    Some((values.same)(&value, source))
                }
            }
            // No row, which is behind whatever the value, or values not
            // compared.
            _ => None,
        };
        Some(verdict(held.version, row, same_value))
    }

    /// The node's value for `key`, read with `get` under its stripe after
    /// the source's row, if the entry is still the one [`held`](Self::held)
    /// read: no write to the key stamped since `token`, and its value
    /// installed at the same `version`. Otherwise `None`: a write landing
    /// after the node's side was read, judged against a row read before
    /// it, would look behind (the order `audit_round` keeps for this
    /// reason), and it explains any difference anyway. An install no stamp
    /// shows (an entry moka expired, loaded again without a version) is
    /// read and judged; the grace window's second read, with `get`, judges
    /// a suspect it makes again before anything counts.
    async fn value_now(&self, key: &K, token: u64, version: Option<u64>) -> Option<V> {
        let _stripe = self.write_locks[self.stripe(key)].lock().await;
        {
            let table = lock(&self.table);
            if table.superseded(key, token) || table.held_at(key) != version {
                return None;
            }
        }
        self.cache.get(key).await
    }

    /// The keys the cache holds now, for a new sweep, in the order of their
    /// hash (taken from the end), read with moka's iteration, which counts
    /// no access; where values are compared, with a fingerprint of each
    /// value, and no value kept.
    async fn sweep(&self, auditor: &Auditor<K, V>) -> Sweep<K> {
        let Some(values) = auditor.audit.values else {
            let entries = self.in_hash_order(|_| ()).await;
            return Sweep {
                keys: entries.into_iter().map(|(k, _)| k).collect(),
                fingerprints: Vec::new(),
                since: 0,
            };
        };
        // The stamp first, then a barrier through every stripe: a write
        // stamped by then holds its stripe until moka has its value, so
        // once the barrier is through, the iteration reads it (or a later
        // write's, which a stamp after this one shows). No stamp shows a
        // load without a version into an entry that moka expired, or that
        // a clear stamped by then emptied after the iteration: the
        // fingerprint is then of a value older than the entry. If it
        // matches the source's row, a wrong entry is left to the next
        // sweep; if not, the entry is read with `get` and judged as it is.
        let since = lock(&self.table).load_token();
        for stripe in &self.write_locks {
            drop(stripe.lock().await);
        }
        // Each value moka's iteration hands over (a clone) is dropped once
        // fingerprinted: the sweep holds 8 bytes a key, not the values.
        let entries = self
            .in_hash_order(|v| fingerprint(values, &auditor.fingerprints, v))
            .await;
        let (keys, fingerprints) = entries.into_iter().unzip();
        Sweep {
            keys,
            fingerprints,
            since,
        }
    }

    /// Every entry moka holds, as `(key, what of its value)`, in descending
    /// order of the key's hash (a sweep takes them from the end). A cache of
    /// 1M entries takes a good part of a second to read and order, so it is
    /// done in slices: a unit of the task's cooperative budget per entry
    /// read (moka's iterator may be held across the yields), then the
    /// entries shared out by the top byte of their hash into 256 buckets,
    /// each sorted on its own, with a unit per bucket: never more than a
    /// bucket's sort (some 4,000 entries for 1M) at a time.
    pub(super) async fn in_hash_order<T>(&self, of: impl Fn(&V) -> T) -> Vec<(Arc<K>, T)> {
        const BUCKETS: usize = 256;
        let mut buckets: Vec<Vec<(u64, Arc<K>, T)>> =
            std::iter::repeat_with(Vec::new).take(BUCKETS).collect();
        for (k, v) in self.cache.iter() {
            crate::util::pace().await;
            let hash = self.hasher.hash_one(&*k);
            let top = usize::try_from(hash >> 56).unwrap_or(0);
            if let Some(bucket) = buckets.get_mut(top) {
                bucket.push((hash, k, of(&v)));
            }
        }
        let mut out = Vec::with_capacity(buckets.iter().map(Vec::len).sum());
        for mut bucket in buckets.into_iter().rev() {
            crate::util::pace().await;
            bucket.sort_unstable_by_key(|(hash, _, _)| std::cmp::Reverse(*hash));
            out.extend(bucket.into_iter().map(|(_, k, t)| (k, t)));
        }
        out
    }

    fn audit_pending(&self, auditor: &Auditor<K, V>) {
        let n = lock(&auditor.state).suspects.len() as u64;
        auditor.stats.pending.store(n, Relaxed);
    }
}

/// A source read on its task, aborted when dropped (a timeout, or a round
/// dropped when the node stops).
struct Reading<T>(tokio::task::JoinHandle<T>);

impl<T> Future for Reading<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for Reading<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The fingerprint of a key's value as its sweep read it, and the version
/// table's stamp before that read (see [`Sweep`]).
type Seen = (NonZeroU64, u64);

/// A new sweep: the keys held when it began, in the order it takes them,
/// and, where values are compared, the fingerprints of their values as
/// moka's iteration read them (one for one; `None` for a value that does
/// not encode), and the version table's stamp before that: a write to a
/// key stamped after it may have changed its value since.
struct Sweep<K> {
    keys: Vec<Arc<K>>,
    fingerprints: Vec<Option<NonZeroU64>>,
    since: u64,
}

/// The sweep's next `n` keys that are not suspects, each with its value's
/// fingerprint as the sweep read it and the stamp before that read, where
/// values are compared and the value encoded.
fn next_keys<K: Hash + Eq>(state: &mut State<K>, n: usize) -> Vec<(Arc<K>, Option<Seen>)> {
    let mut out = Vec::with_capacity(n.min(state.pass.len()));
    while out.len() < n {
        let Some(key) = state.pass.pop() else { break };
        // Popped whether or not the key is skipped, so the two stay one
        // for one.
        let seen = state.seen.pop().flatten().map(|f| (f, state.seen_at));
        if !state.suspects.contains_key(&*key) {
            out.push((key, seen));
        }
    }
    out
}

/// Up to `n` suspects whose grace window is over, counting it from when
/// each was seen or from when the node was last not ready, whichever is
/// later.
fn due_keys<K: Clone>(
    suspects: &HashMap<K, Suspect>,
    now: Instant,
    settled_since: Instant,
    grace: Duration,
    n: usize,
) -> Vec<K> {
    suspects
        .iter()
        .filter(|(_, s)| {
            s.observed
                .max(settled_since)
                .checked_add(grace)
                .is_some_and(|at| at <= now)
        })
        .map(|(k, _)| k.clone())
        .take(n)
        .collect()
}

/// The source's answer by key, or why it is refused: a key it was not
/// asked for, or one answered twice, says the reply is not to be trusted.
fn answered<K: Hash + Eq, V>(
    rows: Rows<K, V>,
    asked: &[K],
) -> Result<HashMap<K, Option<Row<V>>>, String> {
    let asked: HashSet<&K> = asked.iter().collect();
    let mut out = HashMap::default();
    for (key, row) in rows {
        if !asked.contains(&key) {
            return Err("the source answered for a key it was not asked for".into());
        }
        if out.insert(key, row).is_some() {
            return Err("the source answered for a key twice".into());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35, item 10: the audit's equality is `PartialEq` or the same
    /// encoding, so a NaN equals itself and truly different values differ.
    #[test]
    fn values_compare_equal_by_partial_eq_or_encoding() {
        let nan = f64::NAN;
        assert!(same_value(&nan, &nan));
        assert!(same_value(&(nan, 1u32), &(nan, 1u32)));
        assert!(!same_value(&(nan, 1u32), &(nan, 2u32)));
        assert!(!same_value(&nan, &1.0));
        assert!(!same_value(&nan, &-nan), "another NaN's bits");
        assert!(same_value(&0.0f64, &-0.0f64), "PartialEq's equal");
        assert!(same_value(&"a".to_owned(), &"a".to_owned()));
        assert!(!same_value(&"a".to_owned(), &"b".to_owned()));
    }

    /// A fingerprint is the encoding's: equal for values that encode
    /// alike (a NaN included, which `PartialEq` denies), different for
    /// values that do not (0.0 and -0.0, which `PartialEq` calls equal,
    /// are then read and compared by `same_value`); none for a value that
    /// does not encode; and 8 bytes, `None` included.
    #[test]
    fn fingerprints_follow_the_encoding() {
        assert_eq!(std::mem::size_of::<Option<NonZeroU64>>(), 8);
        let hash = RandomState::new();
        let f = |v: &(f64, String)| fingerprint(Values::of(), &hash, v);
        let nan = f64::NAN;
        assert!(f(&(nan, "a".into())).is_some());
        assert_eq!(f(&(nan, "a".into())), f(&(nan, "a".into())));
        assert_ne!(f(&(nan, "a".into())), f(&(nan, "b".into())));
        assert_ne!(f(&(nan, "a".into())), f(&(-nan, "a".into())));
        assert_ne!(f(&(0.0, "a".into())), f(&(-0.0, "a".into())));
        // No encoding, so no fingerprint.
        #[derive(PartialEq)]
        struct Refuses;
        impl Serialize for Refuses {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("refused"))
            }
        }
        assert_eq!(fingerprint(Values::of(), &hash, &Refuses), None);
    }

    #[test]
    fn verdicts_hold_a_lagging_source_against_nobody() {
        // The node's value installed at `version`, against a row, with the
        // values compared or not.
        let judge =
            |version: Option<u64>, held: &str, row: Option<(&str, Option<u64>)>, compared: bool| {
                let row = row.map(|(v, ver)| (v.to_owned(), ver));
                let same = row.as_ref().filter(|_| compared).map(|(v, _)| v == held);
                verdict(version, row.as_ref(), same)
            };
        // By version alone.
        assert_eq!(
            judge(Some(5), "a", Some(("b", Some(6))), false),
            Verdict::Behind
        );
        assert_eq!(
            judge(Some(6), "a", Some(("b", Some(6))), false),
            Verdict::Agrees
        );
        assert_eq!(
            judge(Some(7), "a", Some(("b", Some(6))), false),
            Verdict::Agrees
        );
        assert_eq!(
            judge(None, "a", Some(("b", Some(6))), false),
            Verdict::Unverified
        );
        assert_eq!(judge(Some(1), "a", None, false), Verdict::Behind);
        // With values.
        assert_eq!(
            judge(Some(6), "a", Some(("b", Some(6))), true),
            Verdict::Behind
        );
        assert_eq!(
            judge(Some(5), "b", Some(("b", Some(6))), true),
            Verdict::Agrees
        );
        assert_eq!(
            judge(Some(7), "a", Some(("b", Some(6))), true),
            Verdict::Agrees
        );
        assert_eq!(
            judge(None, "a", Some(("b", Some(6))), true),
            Verdict::Behind
        );
        assert_eq!(judge(None, "b", Some(("b", None)), true), Verdict::Agrees);
        assert_eq!(judge(None, "b", None, true), Verdict::Behind);
        // What `judge` leaves uncompared: no row, or a lagging source.
        assert_eq!(verdict::<String>(None, None, None), Verdict::Behind);
        assert!(source_lags(7, 6) && !source_lags(6, 6) && !source_lags(5, 6));
    }

    #[test]
    fn a_reply_with_keys_not_asked_for_or_twice_is_refused() {
        let asked = vec![1u32, 2];
        assert!(answered::<u32, u8>(vec![(1, None), (3, None)], &asked).is_err());
        assert!(answered::<u32, u8>(vec![(1, None), (1, None)], &asked).is_err());
        let ok = answered::<u32, u8>(vec![(2, Some((7, Some(1))))], &asked).expect("answer");
        assert_eq!(ok.len(), 1);
    }

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
