//! The view's membership: taking a heartbeat in, and reading who is live
//! from the members (`members` holds them and their indexes; this side
//! locks them, expires them, logs and counts what happened).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::time::Instant;

use super::{Cluster, ClusterView, Heartbeat, members, view};
use crate::util::{lock, now_us};

/// Nodes gone at once that get a log line each; the rest one line in all.
const GONE_LOGGED: usize = 10;

impl Cluster {
    /// Every live node's last heartbeat, by node id. The node that owns
    /// this view (if any) is always in it, with its heartbeat as of now.
    /// Others' are as the view keeps them: a cache listed twice appears
    /// once (the first), and `version_age_ms` is not kept.
    pub fn nodes(&self) -> Vec<Heartbeat> {
        let own = self.own();
        let mut nodes: Vec<Heartbeat> = {
            let members = self.members(Instant::now());
            let own_id = own.as_ref().map(|o| o.node_id.as_str());
            members
                .iter()
                .filter(|m| Some(m.id.as_ref()) != own_id)
                .map(|m| m.to_heartbeat(&self.inner.topic))
                .collect()
        };
        nodes.extend(own);
        nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
        nodes
    }

    /// The view: every live node with its caches' lag behind the newest
    /// version any node reports, the nodes gone lately, and per cache the
    /// newest version and who is behind it.
    pub fn view(&self) -> ClusterView {
        let own = self.own();
        let now = Instant::now();
        let at_us = now_us();
        let mut members = self.members(now);
        let own = own.map(|h| {
            members.learn(&h, now);
            members::Member::detached(h, now, at_us)
        });
        view::build(
            &self.inner.observer,
            &self.inner.topic,
            &members,
            own.as_ref(),
            now,
            at_us,
        )
    }

    /// The owning node's heartbeat, fresh (built before the members are
    /// locked: it reads the node's caches).
    fn own(&self) -> Option<Heartbeat> {
        self.inner.local.as_ref().and_then(|f| f())
    }

    /// The members, those expired moved to the nodes gone.
    fn members(&self, now: Instant) -> std::sync::MutexGuard<'_, members::Members> {
        let mut members = lock(&self.inner.members);
        let went = members.expire(now);
        // A line per node, but not 10,000 of them when a flood of made-up
        // ids (unsigned heartbeats) expires at once.
        for id in went.iter().take(GONE_LOGGED) {
            tracing::info!(observer = %self.inner.observer, node = %id,
                "node gone: no heartbeat for three of its intervals");
        }
        if let Some(more) = went.len().checked_sub(GONE_LOGGED).filter(|&n| n > 0) {
            tracing::info!(observer = %self.inner.observer, more,
                "more nodes gone at once: no heartbeat for three of their intervals");
        }
        members
    }

    /// Takes a heartbeat in. The newest per node wins: one that was sent
    /// before the node's last (a redelivery, a reordering) is dropped, and
    /// so is one the view has no room for (counted, and logged at most
    /// once per interval). The owning node's echo is kept like any
    /// other, for how long its versions have been known (its entry is
    /// built fresh when asked), but takes no room under the member cap.
    pub(crate) fn observe(&self, heartbeat: Heartbeat) {
        let now = Instant::now();
        let interval_ms = heartbeat.interval_ms;
        let stored = {
            let mut members = self.members(now);
            match members.observe(heartbeat, now, now_us(), self.owner()) {
                members::Intake::Stored => true,
                members::Intake::Stale => false,
                members::Intake::Dropped(why, node) => {
                    self.inner.stats.dropped.fetch_add(1, Relaxed);
                    // At most one line per interval (and per second), for
                    // however many are dropped meanwhile.
                    let every = self.inner.interval.max(Duration::from_secs(1));
                    if let Some(dropped) = members.note_drop(now, interval_ms, every) {
                        tracing::warn!(observer = %self.inner.observer, node = %node,
                            reason = why.reason(), dropped, members = members.len(),
                            bytes = members.bytes(),
                            "cluster view: heartbeats dropped for lack of room (an acknowledged publish may miss their nodes)");
                    }
                    false
                }
            }
        };
        if stored {
            self.inner.updates.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Whether the view may be missing a live node for lack of room: it is
    /// at its member cap, has less room left than one node may take, or
    /// dropped a heartbeat for lack of room within the last three
    /// intervals of that heartbeat's sender (clamped as liveness is). An
    /// acknowledged publish is not complete while this holds.
    pub(crate) fn overflowing(&self) -> bool {
        let now = Instant::now();
        self.members(now).overflowing(now, self.owner())
    }

    /// How many live nodes this view holds, the owning node included: what
    /// the node's heartbeat tells as [`Heartbeat::live_nodes`].
    pub(crate) fn live_nodes(&self) -> u64 {
        self.members(Instant::now()).live(self.owner())
    }

    /// Whether some live node's own view holds more live nodes than this
    /// one: this one has not heard every node yet, however long it has
    /// listened (a node slow to answer the roll call, a heartbeat late on
    /// a loaded machine). A node that stopped lately is counted by the
    /// others until it expires there, so this may hold for up to four
    /// heartbeat intervals after one stops. `O(log n)`.
    pub(crate) fn missing_nodes(&self) -> bool {
        let members = self.members(Instant::now());
        members.most_claimed() > members.live(self.owner())
    }

    /// The owning node's id, if a node owns this view: its observer.
    fn owner(&self) -> Option<&str> {
        self.inner
            .local
            .as_ref()
            .map(|_| self.inner.observer.as_str())
    }

    /// The live nodes whose last heartbeat lists `cache`, by id, this
    /// party's own node included if it holds it; from the cache's index,
    /// `O(h log h)` for h holders.
    pub(crate) fn holders(&self, cache: &str) -> Vec<String> {
        let own = self.own();
        let own_id = own.as_ref().map(|o| o.node_id.as_str());
        let mut ids: Vec<String> = self
            .members(Instant::now())
            .index(cache)
            .map(|i| {
                i.holders()
                    .filter(|id| Some(id.as_ref()) != own_id)
                    .map(|id| id.to_string())
                    .collect()
            })
            .unwrap_or_default();
        if let Some(o) = own
            && o.caches.iter().any(|c| c.name == cache)
        {
            ids.push(o.node_id);
        }
        ids.sort();
        ids
    }
}
