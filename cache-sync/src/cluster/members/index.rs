//! One cache name's index ([`CacheIndex`]): the nodes that hold it, how
//! many hold each version, and its staircase, so that a view answers per
//! cache without a pass over the members.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::time::Instant;

use crate::cluster::view::Staircase;
use crate::util::HashSet;

/// One cache name across the members that hold it.
#[derive(Debug, Default)]
pub(in crate::cluster) struct CacheIndex {
    pub(super) holders: HashSet<Arc<str>>,
    /// How many holders are at each version (holders without one are not
    /// counted here; `unversioned` counts them).
    versions: BTreeMap<u64, u32>,
    unversioned: u32,
    /// The owning node's version at its last fresh heartbeat (it is no
    /// member: see `Members::learn`). A view's newest counts it, so the
    /// staircase keeps what it taught: its echo among the members can be
    /// older, and trimming to that dropped the steps of the versions
    /// between, making a node behind them look behind for less long.
    pub(super) own: Option<u64>,
    pub(in crate::cluster) staircase: Staircase,
}

impl CacheIndex {
    /// The newest version a holder reports.
    pub(in crate::cluster) fn newest(&self) -> Option<u64> {
        self.versions.last_key_value().map(|(v, _)| *v)
    }

    /// The lowest version a holder is at, a holder without one counting as
    /// at 0 (as its lag does).
    fn lowest(&self) -> u64 {
        if self.unversioned > 0 {
            return 0;
        }
        self.versions.first_key_value().map_or(0, |(v, _)| *v)
    }

    /// Its holders, by node id (in no order).
    pub(in crate::cluster) fn holders(&self) -> impl Iterator<Item = &Arc<str>> {
        self.holders.iter()
    }

    pub(super) fn add(&mut self, id: &Arc<str>, version: Option<u64>) {
        self.holders.insert(id.clone());
        match version {
            Some(v) => {
                let n = self.versions.entry(v).or_insert(0);
                *n = n.saturating_add(1);
            }
            None => self.unversioned = self.unversioned.saturating_add(1),
        }
    }

    pub(super) fn remove(&mut self, id: &str, version: Option<u64>) {
        self.holders.remove(id);
        match version {
            Some(v) => {
                if let Some(n) = self.versions.get_mut(&v) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.versions.remove(&v);
                    }
                }
            }
            None => self.unversioned = self.unversioned.saturating_sub(1),
        }
    }

    /// Keeps the staircase to what the holders can ask of it: nothing
    /// below the lowest version held, nothing above the newest (a version
    /// no live node holds any more, such as a forged one, must not stand
    /// for the ones below it).
    pub(super) fn tidy(&mut self, now: Instant) {
        let Some(newest) = self.newest().max(self.own) else {
            self.staircase.clear();
            return;
        };
        self.staircase.keep_between(self.lowest(), newest, now);
    }
}
