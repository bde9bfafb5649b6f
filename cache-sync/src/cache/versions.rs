//! Per-key versions and touch stamps: the bookkeeping that keeps old events
//! and slow loads from overwriting newer data.
//!
//! Every decision here is made under the key's write lock (see
//! `Inner::write`), held until moka has the change, so the decision and the
//! cache mutation it leads to are one step as far as any other write to the
//! same key is concerned.

use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

use crate::util::Hasher;

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

/// What to do with a load's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LoadDecision {
    /// Cache the value.
    Install,
    /// The key was written, or the cache cleared, since the load began: the
    /// value may predate that write, so discard it and load again.
    Superseded,
    /// Its version is older than one the node knows for the key (or, the
    /// key's record evicted, may be): hand it to the caller, do not cache it.
    Stale,
}

/// No slot: the end of the recency list.
const NIL: u32 = u32::MAX;

/// The most records one table holds: slots are numbered by `u32`, and
/// `NIL` is taken.
pub(crate) const MAX_RECORDS: usize = (u32::MAX - 1) as usize;

/// Stamps count writes; three bits of the word that holds them are flags.
/// At a billion writes a second they would last 73 years.
const STAMP_MASK: u64 = (1 << 61) - 1;
/// The value the cache holds for the key was installed at the record's
/// (exact) version, by a versioned refresh or load, and nothing unversioned
/// wrote the key since: see [`VersionTable::held_at`].
const HELD_AT: u64 = 1 << 61;
const HAS_VERSION: u64 = 1 << 62;
const EXACT: u64 = 1 << 63;

/// One key's record, in the slab. 24 bytes besides the key: the version, the
/// stamp with three flags, and the two links of the recency list.
#[derive(Debug)]
struct Slot<K> {
    key: K,
    /// The newest version known for the key (when `HAS_VERSION`); unless
    /// `EXACT`, only an upper bound on what was forgotten (the evicted floor
    /// when the record was made).
    version: u64,
    /// The stamp of the last write to the key (loads that began before it
    /// lose), and the flags.
    meta: u64,
    /// Neighbours in the recency list: towards the least recently written,
    /// and towards the most.
    older: u32,
    newer: u32,
}

impl<K> Slot<K> {
    fn version(&self) -> Option<u64> {
        (self.meta & HAS_VERSION != 0).then_some(self.version)
    }

    fn exact(&self) -> bool {
        self.meta & EXACT != 0
    }

    fn touched(&self) -> u64 {
        self.meta & STAMP_MASK
    }

    fn set_version(&mut self, version: Option<u64>, exact: bool) {
        self.meta &= STAMP_MASK;
        if let Some(v) = version {
            self.version = v;
            self.meta |= HAS_VERSION;
        }
        if exact {
            self.meta |= EXACT;
        }
    }

    fn held_at(&mut self, held: bool) {
        if held {
            self.meta |= HELD_AT;
        } else {
            self.meta &= !HELD_AT;
        }
    }

    fn set_touched(&mut self, stamp: u64) {
        self.meta = (self.meta & !STAMP_MASK) | (stamp & STAMP_MASK);
    }
}

/// A bounded map from key to version and last-write stamp.
///
/// Memory, measured in `docs/benchmarks.md`: one slot per record (one key
/// clone and 24 bytes, so 32 for a `u64` key), in a slab that never grows
/// past `capacity`, plus a hash index of 5 bytes per bucket (a `u32` slot
/// number and hashbrown's control byte; from 1.14 to 2.3 buckets per record).
/// Records are never removed but by eviction, which reuses the slot at once,
/// so churn leaves no holes in the slab; the index's tombstones are cleared
/// by a rebuild whenever they would double it.
///
/// When full, the least recently written record is evicted, and its version
/// and stamp are folded into floors that apply to every untracked key, so
/// eviction can only make decisions more conservative, never less.
#[derive(Debug)]
pub(crate) struct VersionTable<K> {
    /// Slot numbers, by the hash of their key.
    index: HashTable<u32>,
    slots: Vec<Slot<K>>,
    hasher: Hasher,
    /// Least and most recently written slots; `NIL` when empty.
    oldest: u32,
    newest: u32,
    capacity: usize,
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
    /// A table of at most `capacity` records (at least 1, at most
    /// [`MAX_RECORDS`]), hashing keys with `hasher`.
    pub(crate) fn new(capacity: usize, hasher: Hasher) -> Self {
        Self {
            index: HashTable::new(),
            slots: Vec::new(),
            hasher,
            oldest: NIL,
            newest: NIL,
            capacity: capacity.clamp(1, MAX_RECORDS),
            stamp: 0,
            evicted_version: None,
            evicted_touch: 0,
            clear_floor: None,
            cleared_at: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.slots.len()
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
        match self.find(key) {
            Some(i) => self.slots[i].touched() > token,
            None => self.evicted_touch > token,
        }
    }

    /// Decides whether a load that took `token` when it began may install
    /// what it read, at row `version` if the loader gave one.
    ///
    /// A versioned value installs if nothing wrote the key since the token
    /// and `version` is at least every version known for the key (the
    /// record, or the evicted floor for an untracked key, and the clear
    /// floor), and is then recorded exactly, as a refresh at `version`
    /// would be, so later refreshes at or below it are stale. Unlike a
    /// refresh, an equal version installs: the loader read the source of
    /// truth, and a row there at `version` is that version. The install
    /// stamps the key, so a load of it still in flight (which may have read
    /// an older row, possibly unversioned) no longer installs.
    ///
    /// An unversioned value leaves the record's version as it was, and
    /// marks the value as held at none (see [`held_at`](Self::held_at)).
    pub(crate) fn loaded(&mut self, key: &K, token: u64, version: Option<u64>) -> LoadDecision {
        if self.superseded(key, token) {
            return LoadDecision::Superseded;
        }
        let Some(v) = version else {
            // Installed with no version: whatever the record says, the
            // value is not known to be at it.
            if let Some(i) = self.find(key) {
                self.slots[i].held_at(false);
            }
            return LoadDecision::Install;
        };
        if self.clear_floor.is_some_and(|floor| v < floor) {
            return LoadDecision::Stale;
        }
        // An inexact version (the evicted floor) bounds what was forgotten
        // from above: at or above it, `v` is at least the true version;
        // below it, it may be older, so it must not be cached.
        let known = match self.find(key) {
            Some(i) => self.slots[i].version(),
            None => self.evicted_version,
        };
        if known.is_some_and(|known| v < known) {
            return LoadDecision::Stale;
        }
        let i = self.record(key);
        self.slots[i].set_version(Some(v), true);
        self.slots[i].held_at(true);
        self.written(i);
        LoadDecision::Install
    }

    /// The version recorded for `key` if it is exact (a refresh, a
    /// versioned invalidation or load), not the evicted floor an untracked
    /// key carries.
    pub(crate) fn exact_version(&self, key: &K) -> Option<u64> {
        let slot = &self.slots[self.find(key)?];
        if slot.exact() { slot.version() } else { None }
    }

    /// The version the value the cache holds for `key` was installed at,
    /// if a versioned refresh or load installed it and no unversioned write
    /// (a local insert or invalidation, an unversioned load or refresh),
    /// removal, clear or resync came after. Unlike [`exact_version`](Self::exact_version),
    /// which a tombstone or an older versioned write can leave under a
    /// value installed without one, this says which version the held
    /// value is (for the auditor, which must not judge a value by another's
    /// version, and for `get_fresh`). moka's own evictions and expiries do
    /// not clear it: it speaks of the value if one is held, and every
    /// install passes here.
    pub(crate) fn held_at(&self, key: &K) -> Option<u64> {
        let slot = &self.slots[self.find(key)?];
        let held = slot.exact() && slot.meta & HELD_AT != 0 && slot.touched() > self.cleared_at;
        if held { slot.version() } else { None }
    }

    /// A local write (insert or invalidate) with no version.
    pub(crate) fn touch(&mut self, key: &K) {
        let i = self.record(key);
        self.slots[i].held_at(false);
        self.written(i);
    }

    pub(crate) fn refresh(&mut self, key: &K, version: Option<u64>) -> RefreshDecision {
        let Some(v) = version else {
            self.touch(key);
            return RefreshDecision::Apply;
        };
        if self.clear_floor.is_some_and(|floor| v < floor) {
            return RefreshDecision::Stale;
        }
        // One lookup: a missing key gets its record here, carrying the
        // evicted floor as an inexact version, exactly what it is checked
        // against below.
        let i = self.record(key);
        let slot = &self.slots[i];
        if slot.version().is_some_and(|known| v <= known) {
            if slot.exact() {
                return RefreshDecision::Stale;
            }
            self.slots[i].held_at(false);
            self.written(i);
            return RefreshDecision::Invalidate;
        }
        self.slots[i].set_version(Some(v), true);
        self.slots[i].held_at(true);
        self.written(i);
        RefreshDecision::Apply
    }

    /// A refresh from a late event (see `park::Op::Late`): never
    /// [`Apply`](RefreshDecision::Apply). [`Stale`](RefreshDecision::Stale),
    /// and nothing changes, where a refresh would be stale for certain (at
    /// or below the key's exact record, or below the clear floor: the node
    /// already had that version, so what it holds is no older); otherwise
    /// [`Invalidate`](RefreshDecision::Invalidate), recorded as an
    /// invalidation at `version`.
    pub(crate) fn refresh_late(&mut self, key: &K, version: Option<u64>) -> RefreshDecision {
        if let Some(v) = version {
            if self.clear_floor.is_some_and(|floor| v < floor) {
                return RefreshDecision::Stale;
            }
            if let Some(i) = self.find(key) {
                let slot = &self.slots[i];
                if slot.exact() && slot.version().is_some_and(|known| v <= known) {
                    return RefreshDecision::Stale;
                }
            }
        }
        self.invalidate(key, version);
        RefreshDecision::Invalidate
    }

    /// An invalidation always removes the entry; with a version it also
    /// leaves a tombstone that older refreshes cannot pass.
    pub(crate) fn invalidate(&mut self, key: &K, version: Option<u64>) {
        let i = self.record(key);
        let slot = &mut self.slots[i];
        if let Some(v) = version
            && slot.version().is_none_or(|k| v > k)
        {
            slot.set_version(Some(v), true);
        }
        slot.held_at(false);
        self.written(i);
    }

    pub(crate) fn clear(&mut self, version: Option<u64>) {
        self.cleared_at = self.next_stamp();
        if let Some(v) = version {
            self.clear_floor = Some(self.clear_floor.map_or(v, |f| f.max(v)));
        }
    }

    fn next_stamp(&mut self) -> u64 {
        self.stamp = self.stamp.saturating_add(1).min(STAMP_MASK);
        self.stamp
    }

    fn find(&self, key: &K) -> Option<usize> {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        self.index
            .find(hash, |&i| slots[i as usize].key == *key)
            .map(|&i| i as usize)
    }

    /// Stamps a write to slot `i` and makes it the most recently written.
    fn written(&mut self, i: usize) {
        let stamp = self.next_stamp();
        self.slots[i].set_touched(stamp);
        self.unlink(i);
        self.push_newest(i);
    }

    /// The slot of `key`'s record, made if missing (evicting the least
    /// recently written record when full, whose slot it then takes).
    fn record(&mut self, key: &K) -> usize {
        let hash = self.hasher.hash_one(key);
        let slots = &self.slots;
        if let Some(&i) = self.index.find(hash, |&i| slots[i as usize].key == *key) {
            return i as usize;
        }
        // Every version of `key` that was forgotten is at most the floor as
        // it stands now; the record evicted below to make room is another
        // key's, so its version is no bound on this one's.
        let floor = self.evicted_version;
        let i = if self.slots.len() < self.capacity {
            // Grow towards the limit, never past it: the slab is most of
            // the table's memory, and doubling would leave up to half of it
            // unused for good.
            if self.slots.len() == self.slots.capacity() {
                let room = self.capacity.saturating_sub(self.slots.len());
                self.slots.reserve_exact(self.slots.len().max(8).min(room));
            }
            self.slots.len()
        } else {
            let i = self.oldest as usize;
            self.evict(i);
            i
        };
        let mut fresh = Slot {
            key: key.clone(),
            version: 0,
            meta: 0,
            older: NIL,
            newer: NIL,
        };
        fresh.set_version(floor, false);
        match self.slots.get_mut(i) {
            Some(slot) => *slot = fresh,
            None => self.slots.push(fresh),
        }
        // `i` fits: there are at most MAX_RECORDS slots.
        let number = u32::try_from(i).unwrap_or(NIL);
        let (slots, hasher) = (&self.slots, &self.hasher);
        self.index
            .insert_unique(hash, number, |&j| hasher.hash_one(&slots[j as usize].key));
        self.push_newest(i);
        self.clear_tombstones();
        i
    }

    /// Drops slot `i`'s record from the index and the recency list, folding
    /// its version and stamp into the floors. The caller reuses the slot.
    fn evict(&mut self, i: usize) {
        let slot = &self.slots[i];
        self.evicted_version = self.evicted_version.max(slot.version());
        self.evicted_touch = self.evicted_touch.max(slot.touched());
        let hash = self.hasher.hash_one(&slot.key);
        let number = u32::try_from(i).unwrap_or(NIL);
        if let Ok(entry) = self.index.find_entry(hash, |&j| j == number) {
            entry.remove();
        }
        self.unlink(i);
    }

    /// hashbrown marks some removed buckets as tombstones, and when they use
    /// up its spare room it doubles the table rather than rehash in place
    /// (it rehashes in place only below half full). Under steady eviction
    /// that would double the index for good; rebuild it at its right size
    /// instead. Tombstones are rare at this load (a removal leaves one only
    /// where a whole probe group is full), so this runs once in hundreds of
    /// thousands of evictions.
    fn clear_tombstones(&mut self) {
        if self.index.capacity() >= self.capacity.max(8).saturating_mul(2) {
            let slots = &self.slots;
            let hasher = &self.hasher;
            self.index
                .shrink_to(self.capacity, |&j| hasher.hash_one(&slots[j as usize].key));
        }
    }

    fn unlink(&mut self, i: usize) {
        let (older, newer) = (self.slots[i].older, self.slots[i].newer);
        match older {
            NIL if self.oldest as usize == i => self.oldest = newer,
            NIL => return, // not in the list
            o => self.slots[o as usize].newer = newer,
        }
        match newer {
            NIL => self.newest = older,
            n => self.slots[n as usize].older = older,
        }
        self.slots[i].older = NIL;
        self.slots[i].newer = NIL;
    }

    fn push_newest(&mut self, i: usize) {
        let number = u32::try_from(i).unwrap_or(NIL);
        self.slots[i].older = self.newest;
        self.slots[i].newer = NIL;
        match self.newest {
            NIL => self.oldest = number,
            n => self.slots[n as usize].newer = number,
        }
        self.newest = number;
    }
}

#[cfg(test)]
mod tests {
    use super::RefreshDecision::*;
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn table<K: Hash + Eq + Clone>(capacity: usize) -> VersionTable<K> {
        VersionTable::new(capacity, Hasher::default())
    }

    /// Issue 35, item 7: a refresh from a late event is never applied. It
    /// is stale where a refresh would be stale for certain (at or below
    /// the key's exact record, below a clear's floor), and otherwise an
    /// invalidation at its version: one newer than the record, one for a
    /// key with no record or only the evicted floor, one with no version.
    #[test]
    fn a_late_refresh_is_stale_or_an_invalidation_never_applied() {
        let mut t = table::<&str>(2);
        assert_eq!(t.refresh(&"k", Some(5)), Apply);
        assert_eq!(t.refresh_late(&"k", Some(5)), Stale);
        assert_eq!(t.refresh_late(&"k", Some(4)), Stale);
        assert_eq!(t.held_at(&"k"), Some(5), "a stale one changes nothing");
        assert_eq!(t.refresh_late(&"k", Some(6)), Invalidate);
        assert_eq!((t.exact_version(&"k"), t.held_at(&"k")), (Some(6), None));
        assert_eq!(t.refresh(&"k", Some(6)), Stale, "its tombstone stands");
        assert_eq!(t.refresh_late(&"k", None), Invalidate);
        assert_eq!(t.refresh_late(&"new", Some(1)), Invalidate);
        // "k" is evicted: the floor it leaves is no exact record.
        t.touch(&"other");
        assert_eq!(t.exact_version(&"k"), None);
        assert_eq!(t.refresh_late(&"k", Some(3)), Invalidate);
        t.clear(Some(50));
        assert_eq!(t.refresh_late(&"x", Some(49)), Stale);
        assert_eq!(t.refresh_late(&"x", Some(50)), Invalidate);
    }

    /// `held_at` names the version of the value held, and only while no
    /// unversioned write, removal or clear came after the versioned one.
    #[test]
    fn held_at_follows_the_last_install_only() {
        let mut t = table::<&str>(8);
        assert_eq!(t.held_at(&"k"), None);
        assert_eq!(t.refresh(&"k", Some(1)), Apply);
        assert_eq!(t.held_at(&"k"), Some(1));
        // An unversioned load installs over it: the record keeps 1.
        assert_eq!(t.loaded(&"k", t.load_token(), None), LoadDecision::Install);
        assert_eq!((t.exact_version(&"k"), t.held_at(&"k")), (Some(1), None));
        assert_eq!(t.refresh(&"k", Some(3)), Apply);
        assert_eq!(t.held_at(&"k"), Some(3));
        t.touch(&"k");
        assert_eq!((t.exact_version(&"k"), t.held_at(&"k")), (Some(3), None));
        assert_eq!(
            t.loaded(&"k", t.load_token(), Some(5)),
            LoadDecision::Install
        );
        assert_eq!(t.held_at(&"k"), Some(5));
        t.invalidate(&"k", Some(6));
        assert_eq!((t.exact_version(&"k"), t.held_at(&"k")), (Some(6), None));
        assert_eq!(t.refresh(&"k", Some(7)), Apply);
        t.clear(None);
        assert_eq!((t.exact_version(&"k"), t.held_at(&"k")), (Some(7), None));
        assert_eq!(t.refresh(&"k", Some(8)), Apply);
        assert_eq!(t.held_at(&"k"), Some(8));
        // A stale refresh changes nothing held; an unversioned one does.
        assert_eq!(t.refresh(&"k", Some(2)), Stale);
        assert_eq!(t.held_at(&"k"), Some(8));
        assert_eq!(t.refresh(&"k", None), Apply);
        assert_eq!(t.held_at(&"k"), None);
    }

    impl<K: Hash + Eq + Clone + std::fmt::Debug> VersionTable<K> {
        /// The structure's invariants: every slot is indexed once, under its
        /// own key, and linked once, oldest to newest; the slab never grows
        /// past the limit, and the index never to twice its right size.
        fn check_structure(&self) -> Result<(), String> {
            if self.index.len() != self.slots.len() || self.slots.len() > self.capacity {
                return Err(format!(
                    "{} indexed, {} slots, capacity {}",
                    self.index.len(),
                    self.slots.len(),
                    self.capacity
                ));
            }
            if self.slots.capacity() > self.capacity.max(8) {
                return Err(format!(
                    "slab of {} for {}",
                    self.slots.capacity(),
                    self.capacity
                ));
            }
            if self.index.capacity() >= self.capacity.max(8) * 2 {
                return Err(format!(
                    "index of {} for {}",
                    self.index.capacity(),
                    self.capacity
                ));
            }
            for (i, slot) in self.slots.iter().enumerate() {
                if self.find(&slot.key) != Some(i) {
                    return Err(format!(
                        "slot {i} ({:?}) is not indexed under its key",
                        slot.key
                    ));
                }
            }
            let (mut seen, mut at, mut prev) = (0usize, self.oldest, NIL);
            while at != NIL {
                let slot = &self.slots[at as usize];
                if slot.older != prev || seen > self.slots.len() {
                    return Err(format!("recency list broken at slot {at}"));
                }
                seen += 1;
                prev = at;
                at = slot.newer;
            }
            if seen != self.slots.len() || self.newest != prev {
                return Err(format!("{seen} linked of {} slots", self.slots.len()));
            }
            Ok(())
        }
    }

    #[test]
    fn older_refresh_never_overwrites_newer() {
        let mut t = table(16);
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
        let mut t = table(16);
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
        let mut t = table(16);
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
        let mut t = table(2);
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
    fn a_versioned_load_is_recorded_exactly_as_a_refresh_is() {
        let mut t = table(2);
        let token = t.load_token();
        assert_eq!(t.loaded(&"k", token, Some(12)), LoadDecision::Install);
        assert_eq!(t.refresh(&"k", Some(10)), Stale);
        assert_eq!(t.refresh(&"k", Some(12)), Stale);
        // The install was a write: a load that began before it lost.
        assert_eq!(t.loaded(&"k", token, Some(20)), LoadDecision::Superseded);
        let token = t.load_token();
        assert_eq!(t.loaded(&"k", token, Some(11)), LoadDecision::Stale);
        assert_eq!(t.loaded(&"k", token, Some(12)), LoadDecision::Install);
        // Unversioned: installs, and leaves the record as it was.
        let token = t.load_token();
        assert_eq!(t.loaded(&"k", token, None), LoadDecision::Install);
        assert_eq!(t.refresh(&"k", Some(12)), Stale);
        assert_eq!(t.refresh(&"k", Some(13)), Apply);
    }

    #[test]
    fn a_load_of_an_untracked_key_is_held_to_the_evicted_floor() {
        let mut t = table(1);
        t.invalidate(&"a", Some(50));
        t.touch(&"b"); // evicts a's tombstone into the floor
        let token = t.load_token();
        assert_eq!(t.loaded(&"a", token, Some(49)), LoadDecision::Stale);
        assert_eq!(t.len(), 1, "a stale load records nothing");
        assert_eq!(t.loaded(&"a", token, Some(50)), LoadDecision::Install);
        assert_eq!(t.refresh(&"a", Some(50)), Stale, "recorded exactly");
    }

    #[test]
    fn memory_stays_bounded_under_churn() {
        let mut t = table(100);
        for i in 0..100_000u64 {
            t.refresh(&(i % 1000), Some(i));
            t.touch(&(i % 7));
        }
        assert!(t.len() <= 100);
        t.check_structure().unwrap();
    }

    /// Slots are numbered by u32: a larger limit counts as the largest that
    /// fits, and memory still grows only with the keys written.
    #[test]
    fn limits_past_u32_are_clamped_and_allocate_nothing_up_front() {
        for limit in [usize::MAX, MAX_RECORDS + 1, MAX_RECORDS] {
            let mut t = table::<u64>(limit);
            assert_eq!(t.capacity, MAX_RECORDS);
            assert_eq!((t.slots.capacity(), t.index.capacity()), (0, 0));
            assert_eq!(t.refresh(&1, Some(1)), Apply);
            assert!(t.slots.capacity() <= 8);
        }
        assert_eq!(table::<u64>(0).capacity, 1);
    }

    /// Steady eviction at the limit: removals' tombstones must not double
    /// the index, nor the slab grow past the limit.
    #[test]
    fn churn_does_not_grow_the_index_or_the_slab() {
        let capacity = 10_000;
        let mut t = table(capacity);
        for i in 0..capacity as u64 {
            t.refresh(&i, Some(i));
        }
        let (index, slab) = (t.index.allocation_size(), t.slots.capacity());
        assert_eq!(slab, capacity, "the slab stops at the limit");
        for i in capacity as u64..(capacity as u64 * 100) {
            t.refresh(&i, Some(i));
            t.invalidate(&(i - 7), Some(i));
        }
        t.check_structure().unwrap();
        assert_eq!(t.index.allocation_size(), index);
        assert_eq!(t.slots.capacity(), slab);
    }

    #[test]
    fn loads_are_superseded_by_writes_to_their_key_or_a_clear() {
        let mut t = table(16);
        let token = t.load_token();
        t.touch(&"other");
        assert!(!t.superseded(&"k", token));
        t.invalidate(&"k", None);
        assert!(t.superseded(&"k", token));
        let token = t.load_token();
        t.clear(None);
        assert!(t.superseded(&"k", token));
    }

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
        // Every run length up to 300, at capacities 1 to 3: long runs on
        // one key, then another key, are where an eviction could meet the
        // key being written (see the CHANGELOG, 2026-11-30).
        let run = terminates(30, || {
            for capacity in 1..=3 {
                for writes in 1..=300 {
                    let mut t = table(capacity);
                    for v in 0..writes {
                        t.refresh(&"a", Some(v));
                    }
                    assert_eq!(t.refresh(&"b", Some(1)), Apply);
                    t.touch(&"c");
                    t.invalidate(&"d", None);
                    assert_eq!(t.len(), capacity);
                    t.check_structure().unwrap();
                }
            }
        });
        run.await.expect("the table spun instead of evicting");
    }

    #[test]
    fn evicted_stamps_supersede_loads_of_untracked_keys() {
        let mut t = table(1);
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
        let mut t = table(capacity);
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
            t.check_structure().map_err(|e| format!("step {i}: {e}"))?;
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
            // then another are where eviction could meet the key written.
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
