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
        self.stamp += 1;
        let stamp = self.stamp;
        self.record(key).touched = stamp;
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
        self.touch(key);
        let m = self.record(key);
        m.version = Some(v);
        m.exact = true;
        RefreshDecision::Apply
    }

    /// An invalidation always removes the entry; with a version it also
    /// leaves a tombstone that older refreshes cannot pass.
    pub(crate) fn invalidate(&mut self, key: &K, version: Option<u64>) {
        self.touch(key);
        if let Some(v) = version {
            let m = self.record(key);
            if m.version.is_none_or(|k| v > k) {
                m.version = Some(v);
                m.exact = true;
            }
        }
    }

    pub(crate) fn clear(&mut self, version: Option<u64>) {
        self.stamp += 1;
        self.cleared_at = self.stamp;
        if let Some(v) = version {
            self.clear_floor = Some(self.clear_floor.map_or(v, |f| f.max(v)));
        }
    }

    fn record(&mut self, key: &K) -> &mut KeyMeta {
        self.next_tick += 1;
        let tick = self.next_tick;
        self.queue.push_back((key.clone(), tick));
        if !self.map.contains_key(key) {
            let meta = KeyMeta {
                version: self.evicted_version,
                exact: false,
                touched: 0,
                tick,
            };
            self.map.insert(key.clone(), meta);
            self.evict_over_capacity(key);
        }
        self.compact_queue();
        let m = self.map.get_mut(key).expect("record was just ensured");
        m.tick = tick;
        m
    }

    fn evict_over_capacity(&mut self, keep: &K) {
        while self.map.len() > self.capacity {
            let Some((k, tick)) = self.queue.pop_front() else {
                break;
            };
            if &k == keep {
                self.queue.push_back((k, tick));
                continue;
            }
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
        if self.queue.len() <= 2 * self.capacity + 64 {
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

    #[test]
    fn evicted_stamps_supersede_loads_of_untracked_keys() {
        let mut t = VersionTable::new(1);
        let token = t.load_token();
        t.touch(&"a");
        t.touch(&"b"); // evicts "a", whose write happened after the token
        assert!(t.superseded(&"a", token));
    }
}
