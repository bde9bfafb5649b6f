//! Coalescing a backlog: within one run of events for a cache, a refresh
//! that a later entry of the same run overrides is never decoded nor
//! written.
//!
//! A node that falls behind (a storm, a slow moment of its runtime) reads
//! its backlog in long runs, and a hot key (a feature flag, a counter row)
//! can appear in one many times. Applying each refresh in turn decodes and
//! writes values only the last of which survives; skipping those the run
//! itself overrides lets a node that is behind catch up faster, and ends
//! in the same cache state as applying every one.
//!
//! A refresh is skipped only when applying the later entry after it is
//! certain to leave no trace of it, whatever the cache held:
//! - the refresh and the later entry are both in events that are not late
//!   (a late event's refresh is never installed, so it overrides nothing);
//! - the later entry is a refresh or an invalidation of the same key
//!   (same encoded bytes; keys equal in value but encoded differently are
//!   simply not coalesced);
//! - both are unversioned (applied in order, the later one wins), or both
//!   are versioned and the later one's version is higher (the cache's
//!   version check lets it through wherever it let the earlier one). An
//!   equal version, or a mix of versioned and unversioned, is applied as is;
//! - no clear comes between them (a clear is rare, and what it empties is
//!   left to it).
//!
//! Short runs are applied as they come: a node that keeps up reads runs
//! of a few events, where looking for repeats would cost more than it
//! saves.

use std::hash::BuildHasher as _;

use crate::util::HashMap;
use crate::wire::ChangeView;

use super::Event;

/// Runs shorter than this are not searched for repeats. A consumer's batch
/// is up to `max_batch` records (256 by default): a run this long means the
/// node read a backlog, not one event as it came.
pub(super) const COALESCE_FROM: usize = 128;

/// Runs of more entries than this are applied as they come: the search
/// runs in one poll, without yielding, so it must stay well under the
/// millisecond a node may hold a worker (some 100 µs for 4,096 one-entry
/// events on a small VM), and its memory small.
pub(super) const COALESCE_MAX_ENTRIES: usize = 4096;

/// The entries of a run that a later entry of it overrides, by their
/// position among all the run's entries (events in order, each event's
/// items in order).
#[derive(Debug, Default)]
pub(super) struct Superseded {
    /// One bit per entry; empty when nothing is skipped.
    bits: Vec<u64>,
}

impl Superseded {
    /// Finds the refreshes of `events` that a later entry overrides.
    pub(super) fn of(events: &[Event<'_>]) -> Self {
        if events.len() < COALESCE_FROM {
            return Self::default();
        }
        // Counted first, from the events' headers: a run over the bound
        // costs no more than this.
        let mut total = 0usize;
        for event in events {
            total = total.saturating_add(entries_of(event));
            if total > COALESCE_MAX_ENTRIES {
                return Self::default();
            }
        }
        if !maybe_repeats(events) {
            return Self::default();
        }
        // Every entry, in order; `None` for a clear, a barrier: nothing
        // before it is coalesced with anything after it.
        let mut entries: Vec<Option<Entry<'_>>> = Vec::with_capacity(total);
        for event in events {
            match &event.change {
                ChangeView::Invalidate(items) | ChangeView::Refresh(items) => {
                    let refresh = matches!(event.change, ChangeView::Refresh(_));
                    for item in items.clone() {
                        entries.push(Some(Entry {
                            key: item.key,
                            version: item.version,
                            skippable: refresh && !event.late,
                            overrides: !event.late,
                        }));
                    }
                }
                ChangeView::Clear { .. } => entries.push(None),
                ChangeView::Announce => {}
            }
        }
        let mut bits = Vec::new();
        // Walking backwards, the nearest later entry of each key: whether
        // it overrides, and its version.
        let mut later: HashMap<&[u8], Entry<'_>> =
            HashMap::with_capacity_and_hasher(total, crate::util::Hasher::default());
        for (i, entry) in entries.iter().enumerate().rev() {
            let Some(entry) = entry else {
                later.clear();
                continue;
            };
            if entry.skippable
                && let Some(next) = later.get(entry.key)
                && next.overrides
                && match (entry.version, next.version) {
                    (None, None) => true,
                    (Some(v), Some(w)) => w > v,
                    _ => false,
                }
            {
                if bits.is_empty() {
                    bits = vec![0u64; entries.len().div_ceil(64)];
                }
                bits[i / 64] |= 1 << (i % 64);
            }
            later.insert(entry.key, *entry);
        }
        Self { bits }
    }

    /// Whether the run's `i`-th entry is overridden later in the run.
    pub(super) fn contains(&self, i: usize) -> bool {
        self.bits
            .get(i / 64)
            .is_some_and(|word| word >> (i % 64) & 1 == 1)
    }

    /// Whether any entry is.
    pub(super) fn any(&self) -> bool {
        !self.bits.is_empty()
    }
}

/// Bits of the first pass's filter: 64 Ki, 8 KiB, so that 4,096 distinct
/// keys rarely collide in it.
const FILTER_BITS: usize = 1 << 16;

/// Whether a key may repeat in the run, from one bit per key's hash: the
/// usual run, of distinct keys, costs a hash per entry and no map (a full
/// search cost some 260 instructions per one-entry event, 5 % of applying
/// it). A collision only means the full search runs.
fn maybe_repeats(events: &[Event<'_>]) -> bool {
    let hasher = foldhash::fast::FixedState::with_seed(0);
    let mut seen = vec![0u64; FILTER_BITS / 64];
    for event in events {
        if let ChangeView::Invalidate(items) | ChangeView::Refresh(items) = &event.change {
            for item in items.clone() {
                let bit = usize::try_from(hasher.hash_one(item.key)).unwrap_or(0) % FILTER_BITS;
                let (word, mask) = (bit / 64, 1u64 << (bit % 64));
                if let Some(w) = seen.get_mut(word) {
                    if *w & mask != 0 {
                        return true;
                    }
                    *w |= mask;
                }
            }
        }
    }
    false
}

/// How many entries `event` takes in a run's numbering: its items, or one
/// for a clear.
pub(super) fn entries_of(event: &Event<'_>) -> usize {
    match &event.change {
        ChangeView::Invalidate(items) | ChangeView::Refresh(items) => items.remaining(),
        ChangeView::Clear { .. } => 1,
        ChangeView::Announce => 0,
    }
}

/// One entry of a run, as far as coalescing needs it.
#[derive(Debug, Clone, Copy)]
struct Entry<'a> {
    /// The key's encoded bytes.
    key: &'a [u8],
    version: Option<u64>,
    /// A refresh in an event that is not late: one that may be skipped.
    skippable: bool,
    /// In an event that is not late: it overrides what came before.
    overrides: bool,
}
