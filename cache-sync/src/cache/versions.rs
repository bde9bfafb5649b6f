//! Per-key versions and touch stamps: the bookkeeping that keeps old events
//! and slow loads from overwriting newer data.
//!
//! Every decision here is made under the key's write lock (see
//! `Inner::write`), held until moka has the change, so the decision and the
//! cache mutation it leads to are one step as far as any other write to the
//! same key is concerned.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// What to do with a refresh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RefreshDecision {
    /// Install the value.
    Apply,
    /// Older than what the cache already reflects: leave the entry alone.
    Stale,
    /// Cannot tell whether it is older (its record was evicted from the
    /// bounded table): drop the entry so the next read loads it.
    Invalidate,
}

#[derive(Debug, Clone)]
struct KeyMeta {
    /// The newest version known for the key; when `exact` is false, only an
    /// upper bound on what was forgotten (the evicted floor at creation).
    version: Option<u64>,
    exact: bool,
    /// Stamp of the last write to the key; loads that began before it lose.
    touched: u64,
    /// Position in the eviction queue; older queue entries for the key are stale.
    tick: u64,
}

/// A bounded map from key to version and last-write stamp.
///
/// Memory: at most `capacity` records (each one key clone plus 40 bytes),
/// plus an eviction queue of at most `2 * capacity + 64` key clones.
/// When full, the least recently written record is evicted, and its version
/// and stamp are folded into floors that apply to every untracked key, so
/// eviction can only make decisions more conservative, never less.
#[derive(Debug)]
pub(crate) struct VersionTable<K> {
    map: HashMap<K, KeyMeta>,
    queue: VecDeque<(K, u64)>,
    capacity: usize,
    next_tick: u64,
    /// Monotonic write counter.
    stamp: u64,
    /// Highest version among evicted records.
    evicted_version: Option<u64>,
    /// Highest stamp among evicted records.
    evicted_touch: u64,
    /// Refreshes below this version are stale (set by a versioned clear).
    clear_floor: Option<u64>,
    /// Stamp of the last clear or resync.
    cleared_at: u64,
}

impl<K: Hash + Eq + Clone> VersionTable<K> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            map: HashMap::new(),
            queue: VecDeque::new(),
            capacity: capacity.max(1),
            next_tick: 0,
            stamp: 0,
            evicted_version: None,
            evicted_touch: 0,
            clear_floor: None,
            cleared_at: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// The stamp a load records when it starts.
    pub(crate) fn load_token(&self) -> u64 {
        self.stamp
    }

    /// Whether anything that could change `key` happened since `token`.
    pub(crate) fn superseded(&self, key: &K, token: u64) -> bool {
        if self.cleared_at > token {
            return true;
        }
        match self.map.get(key) {
            Some(m) => m.touched > token,
            None => self.evicted_touch > token,
        }
    }

    /// A local write (insert or invalidate) with no version.
    pub(crate) fn touch(&mut self, key: &K) {
        self.written(key);
    }

    /// Stamps a write to `key` and returns its record.
    fn written(&mut self, key: &K) -> &mut KeyMeta {
        self.stamp = self.stamp.saturating_add(1);
        let stamp = self.stamp;
        let m = self.record(key);
        m.touched = stamp;
        m
    }

    pub(crate) fn refresh(&mut self, key: &K, version: Option<u64>) -> RefreshDecision {
        let Some(v) = version else {
            self.touch(key);
            return RefreshDecision::Apply;
        };
        if self.clear_floor.is_some_and(|floor| v < floor) {
            return RefreshDecision::Stale;
        }
        let (known, exact) = match self.map.get(key) {
            Some(m) => (m.version, m.exact),
            None => (self.evicted_version, false),
        };
        if known.is_some_and(|k| v <= k) {
            if exact {
                return RefreshDecision::Stale;
            }
            self.touch(key);
            return RefreshDecision::Invalidate;
        }
        let m = self.written(key);
        m.version = Some(v);
        m.exact = true;
        RefreshDecision::Apply
    }

    /// An invalidation always removes the entry; with a version it also
    /// leaves a tombstone that older refreshes cannot pass.
    pub(crate) fn invalidate(&mut self, key: &K, version: Option<u64>) {
        let m = self.written(key);
        if let Some(v) = version
            && m.version.is_none_or(|k| v > k)
        {
            m.version = Some(v);
            m.exact = true;
        }
    }

    pub(crate) fn clear(&mut self, version: Option<u64>) {
        self.stamp = self.stamp.saturating_add(1);
        self.cleared_at = self.stamp;
        if let Some(v) = version {
            self.clear_floor = Some(self.clear_floor.map_or(v, |f| f.max(v)));
        }
    }

    /// The key's record, created if missing, and made the most recently
    /// written. Keeps at most `capacity` records.
    ///
    /// The queue holds one live entry per record (the one whose tick matches
    /// the record's) plus superseded entries that compaction drops. Room is
    /// made before the key is inserted and its entry pushed, so eviction can
    /// never meet the key being recorded. An earlier version compacted after
    /// pushing the new entry but before moving the record's tick: compaction
    /// dropped the new entry and kept a stale one, and eviction then spun
    /// forever, under the table's lock, skipping the one record it must keep.
    fn record(&mut self, key: &K) -> &mut KeyMeta {
        self.compact_queue();
        if !self.map.contains_key(key) {
            self.evict_to(self.capacity.saturating_sub(1));
            let meta = KeyMeta {
                version: self.evicted_version,
                exact: false,
                touched: 0,
                tick: 0,
            };
            self.map.insert(key.clone(), meta);
        }
        self.next_tick = self.next_tick.saturating_add(1);
        let tick = self.next_tick;
        self.queue.push_back((key.clone(), tick));
        let m = self.map.get_mut(key).expect("inserted above if missing");
        m.tick = tick;
        m
    }

    /// Evicts the least recently written records until at most `keep`
    /// remain. Each pass pops one queue entry, so it ends within one pass
    /// over the queue: every record has a live entry in it.
    fn evict_to(&mut self, keep: usize) {
        while self.map.len() > keep {
            let Some((k, tick)) = self.queue.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|m| m.tick == tick)
                && let Some(m) = self.map.remove(&k)
            {
                self.evicted_version = self.evicted_version.max(m.version);
                self.evicted_touch = self.evicted_touch.max(m.touched);
            }
        }
    }

    /// Drops queue entries superseded by later writes to the same key.
    fn compact_queue(&mut self) {
        if self.queue.len() <= self.capacity.saturating_mul(2).saturating_add(64) {
            return;
        }
        let map = &self.map;
        self.queue
            .retain(|(k, tick)| map.get(k).is_some_and(|m| m.tick == *tick));
    }
}

#[cfg(test)]
mod tests {
    use super::RefreshDecision::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn older_refresh_never_overwrites_newer() {
        let mut t = VersionTable::new(16);
        assert_eq!(t.refresh(&"k", Some(5)), Apply);
        assert_eq!(t.refresh(&"k", Some(4)), Stale);
        assert_eq!(
            t.refresh(&"k", Some(5)),
            Stale,
            "a redelivery is idempotent"
        );
        assert_eq!(t.refresh(&"k", Some(6)), Apply);
    }

    #[test]
    fn invalidation_leaves_a_tombstone() {
        let mut t = VersionTable::new(16);
        t.invalidate(&"k", Some(10));
        assert_eq!(t.refresh(&"k", Some(9)), Stale);
        assert_eq!(t.refresh(&"k", Some(10)), Stale);
        assert_eq!(t.refresh(&"k", Some(11)), Apply);
        // An older invalidation still removes, but does not lower the tombstone.
        t.invalidate(&"k", Some(3));
        assert_eq!(t.refresh(&"k", Some(4)), Stale);
    }

    #[test]
    fn versioned_clear_is_a_floor_for_every_key() {
        let mut t = VersionTable::new(16);
        t.clear(Some(100));
        assert_eq!(t.refresh(&"a", Some(99)), Stale);
        assert_eq!(
            t.refresh(&"b", Some(100)),
            Apply,
            "rows of a replace_all share the clear's version"
        );
    }

    #[test]
    fn eviction_makes_decisions_conservative_not_wrong() {
        let mut t = VersionTable::new(2);
        t.invalidate(&"a", Some(50));
        t.refresh(&"b", Some(10));
        t.refresh(&"c", Some(20)); // evicts "a" and its tombstone
        assert!(t.len() <= 2);
        // "a" is untracked now: 40 might be older than the forgotten 50, so it
        // must not be installed, but dropping the entry is always safe.
        assert_eq!(t.refresh(&"a", Some(40)), Invalidate);
        assert_eq!(t.refresh(&"a", Some(51)), Apply);
        assert_eq!(t.refresh(&"a", Some(45)), Stale);
    }

    #[test]
    fn memory_stays_bounded_under_churn() {
        let mut t = VersionTable::new(100);
        for i in 0..100_000u64 {
            t.refresh(&(i % 1000), Some(i));
            t.touch(&(i % 7));
        }
        assert!(t.len() <= 100);
        assert!(t.queue.len() <= 2 * 100 + 64 + 1);
    }

    #[test]
    fn loads_are_superseded_by_writes_to_their_key_or_a_clear() {
        let mut t = VersionTable::new(16);
        let token = t.load_token();
        t.touch(&"other");
        assert!(!t.superseded(&"k", token));
        t.invalidate(&"k", None);
        assert!(t.superseded(&"k", token));
        let token = t.load_token();
        t.clear(None);
        assert!(t.superseded(&"k", token));
    }

    /// Regression: with capacity 1, dozens of writes to one key and then a
    /// write to another made `record` spin forever under the table's lock
    /// (compaction dropped the live queue entry and eviction skipped the
    /// only one left). Fed by the consumer, the node stopped applying.
    /// Runs `f` on a thread of its own and waits for it under a tokio
    /// timeout. Not `spawn_blocking`: a runtime waits for its blocking
    /// tasks when it shuts down, so a spinning one would hang the test
    /// instead of failing it.
    async fn terminates<T: Send + 'static>(
        secs: u64,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        tokio::time::timeout(std::time::Duration::from_secs(secs), rx)
            .await
            .ok()?
            .ok()
    }

    #[tokio::test]
    async fn many_writes_to_one_key_then_another_terminate() {
        // Every run length, so that one of them ends exactly where the
        // queue is compacted.
        let run = terminates(30, || {
            for capacity in 1..=3 {
                for writes in 1..=300 {
                    let mut t = VersionTable::new(capacity);
                    for v in 0..writes {
                        t.refresh(&"a", Some(v));
                    }
                    assert_eq!(t.refresh(&"b", Some(1)), Apply);
                    t.touch(&"c");
                    t.invalidate(&"d", None);
                    assert_eq!(t.len(), capacity);
                    assert!(t.queue.len() <= 2 * capacity + 64 + 1, "{}", t.queue.len());
                }
            }
        });
        run.await.expect("the table spun instead of evicting");
    }

    #[test]
    fn evicted_stamps_supersede_loads_of_untracked_keys() {
        let mut t = VersionTable::new(1);
        let token = t.load_token();
        t.touch(&"a");
        t.touch(&"b"); // evicts "a", whose write happened after the token
        assert!(t.superseded(&"a", token));
    }

    /// A write the property test makes, over a handful of keys and versions
    /// so that collisions and evictions are frequent.
    #[derive(Debug, Clone)]
    enum Op {
        Touch(u8),
        Refresh(u8, Option<u64>),
        Invalidate(u8, Option<u64>),
        Clear(Option<u64>),
        /// A load of the key starts now; checked at every later step.
        Load(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        let key = 0u8..12;
        let version = prop_oneof![Just(None), (0u64..40).prop_map(Some)];
        prop_oneof![
            1 => key.clone().prop_map(Op::Touch),
            4 => (key.clone(), version.clone()).prop_map(|(k, v)| Op::Refresh(k, v)),
            2 => (key.clone(), version.clone()).prop_map(|(k, v)| Op::Invalidate(k, v)),
            1 => version.prop_map(Op::Clear),
            1 => key.prop_map(Op::Load),
        ]
    }

    /// The unbounded truth the bounded table must never contradict.
    #[derive(Default)]
    struct Model {
        versions: HashMap<u8, u64>,
        floor: Option<u64>,
        /// Per load: its key, and whether anything wrote that key (or
        /// cleared) since it started.
        loads: Vec<(u8, u64, bool)>,
    }

    impl Model {
        fn refresh(&mut self, k: u8, v: Option<u64>) -> RefreshDecision {
            let Some(v) = v else { return Apply };
            let newer = self.floor.is_none_or(|f| v >= f)
                && self.versions.get(&k).is_none_or(|known| v > *known);
            if newer {
                self.versions.insert(k, v);
                Apply
            } else {
                Stale
            }
        }

        fn invalidate(&mut self, k: u8, v: Option<u64>) {
            if let Some(v) = v {
                let known = self.versions.entry(k).or_insert(v);
                *known = (*known).max(v);
            }
        }

        fn wrote(&mut self, k: Option<u8>) {
            for (key, _, superseded) in &mut self.loads {
                *superseded |= k.is_none_or(|k| k == *key);
            }
        }
    }

    fn check(capacity: usize, ops: &[Op]) -> Result<(), String> {
        let mut t = VersionTable::new(capacity);
        let mut m = Model::default();
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Touch(k) => {
                    t.touch(&k);
                    m.wrote(Some(k));
                }
                Op::Refresh(k, v) => {
                    let got = t.refresh(&k, v);
                    let truth = m.refresh(k, v);
                    // Invalidate is always safe; otherwise the bounded table
                    // must agree: Apply of an older value lets it overwrite a
                    // newer one, and Stale of a newer one keeps an old value.
                    if got != Invalidate && got != truth {
                        return Err(format!(
                            "step {i} {op:?}: table said {got:?}, truth is {truth:?}"
                        ));
                    }
                    if got != Stale {
                        m.wrote(Some(k));
                    }
                }
                Op::Invalidate(k, v) => {
                    t.invalidate(&k, v);
                    m.invalidate(k, v);
                    m.wrote(Some(k));
                }
                Op::Clear(v) => {
                    t.clear(v);
                    if let Some(v) = v {
                        m.floor = Some(m.floor.map_or(v, |f| f.max(v)));
                    }
                    m.wrote(None);
                }
                Op::Load(k) => m.loads.push((k, t.load_token(), false)),
            }
            // A load that crossed a write must lose; one that did not may
            // lose too (eviction folds stamps), which only costs a retry.
            for (k, token, superseded) in &m.loads {
                if *superseded && !t.superseded(k, *token) {
                    return Err(format!(
                        "step {i} {op:?}: a load of {k} crossed a write and still counts as current"
                    ));
                }
            }
            if t.len() > capacity.max(1) {
                return Err(format!(
                    "step {i}: {} records over capacity {capacity}",
                    t.len()
                ));
            }
            if t.queue.len() > 2 * capacity.max(1) + 64 + 1 {
                return Err(format!("step {i}: queue of {} entries", t.queue.len()));
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        /// Any capacity from 0 (treated as 1) to 8 and any write sequence:
        /// every call returns (checked under a timeout, since the failure
        /// this guards against was a spin), the table stays within its
        /// bounds, and its decisions never contradict an unbounded model.
        #[test]
        fn bounded_tables_terminate_and_keep_the_floor_rules(
            capacity in 0usize..=8,
            // Runs of one operation, up to 100 long: long runs on one key
            // are what fill the eviction queue up to its compaction.
            runs in proptest::collection::vec((op(), 1usize..100), 0..40),
        ) {
            let ops: Vec<Op> = runs
                .into_iter()
                .flat_map(|(op, n)| std::iter::repeat_n(op, n))
                .collect();
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let outcome = rt.block_on(terminates(10, move || check(capacity, &ops)));
            let result = outcome.ok_or_else(|| TestCaseError::fail("a table operation never returned"))?;
            result.map_err(TestCaseError::fail)?;
        }
    }
}
