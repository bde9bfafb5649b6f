//! The cluster view as served (`GET /cache-sync/cluster`, the web page, the
//! CLI): live nodes, their lag behind the newest version, the nodes gone.

use std::collections::BTreeMap;
use std::mem::size_of;
use std::ops::Bound;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::members::{CacheIndex, Member, Members};
use crate::status::AuditStatus;
use crate::transport::Position;
use crate::util::HashMap;

/// The whole cluster, as one observer sees it. No key or value appears.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ClusterView {
    /// Who observed it: a node's id, or a watcher's name.
    pub observer: String,
    /// The topic.
    pub topic: String,
    /// Microseconds since the Unix epoch when the view was made.
    pub at_us: u64,
    /// Live nodes, by id.
    pub nodes: Vec<NodeView>,
    /// Nodes that missed three heartbeat intervals in the last five
    /// minutes, by id.
    pub gone: Vec<GoneNode>,
    /// Every cache some live node holds, by name.
    pub caches: Vec<CacheSummary>,
}

/// One live node in a [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeView {
    /// The node's id.
    pub node_id: String,
    /// The transport's kind.
    pub transport: String,
    /// Microseconds since the Unix epoch when the node started.
    pub started_at_us: u64,
    /// Milliseconds since its last heartbeat arrived (0 for the observer
    /// itself).
    pub age_ms: u64,
    /// Its heartbeat interval, in milliseconds.
    pub interval_ms: u64,
    /// Whether its consumer runs on a healthy transport.
    pub consuming: bool,
    /// Whether it is ready to serve.
    pub ready: bool,
    /// Its position.
    pub position: Position,
    /// Losses it answered by a resync.
    pub losses: u64,
    /// Its freshness bound's age as it last reported it, when it sent the
    /// heartbeat `age_ms` ago (see
    /// [`NodeStatus::freshness_age_ms`](crate::status::NodeStatus::freshness_age_ms)).
    /// `None` while unknown, and from older nodes.
    #[serde(default)]
    pub freshness_age_ms: Option<u64>,
    /// Not ready, or some cache behind the newest version: shown highlighted.
    pub lagging: bool,
    /// Its caches, by name.
    pub caches: Vec<NodeCacheView>,
}

/// One cache on one node, in a [`NodeView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeCacheView {
    /// The cache name.
    pub name: String,
    /// The highest version the node took in.
    pub version: Option<u64>,
    /// How many versions it is behind the newest any live node reports for
    /// this cache (0 when level; `None` while no version is known).
    pub lag: Option<u64>,
    /// How long it has been behind, in milliseconds: a lower bound, as long
    /// as a version above the one it holds has been known. Measured on the
    /// observer's own clock, never by comparing two machines' clocks: from
    /// when the observer received a heartbeat reporting such a version,
    /// or earlier by the age that heartbeat gave for it (how long ago the
    /// version rose on the node that reported it, a duration on that
    /// node's own clock, at most its uptime and a day), and never longer
    /// than this node has been up. 0 when level; `None` while no node
    /// reports a version.
    pub behind_ms: Option<u64>,
    /// Entries held (approximate).
    pub entries: u64,
    /// Resyncs after a possible loss.
    pub loss_resyncs: u64,
    /// Whether refreshes are quarantined for now.
    pub quarantined: bool,
    /// Publish-to-applied time of its last event, in microseconds.
    pub last_latency_us: Option<u64>,
    /// How fresh that node proved the cache when it sent the heartbeat, in
    /// milliseconds (see
    /// [`CacheStatus::freshness_age_ms`](crate::status::CacheStatus::freshness_age_ms):
    /// the node's own age, or a CDC relay's lag added to it); `None` while
    /// unknown.
    #[serde(default)]
    pub freshness_age_ms: Option<u64>,
    /// What its consistency auditor found there, if the cache is audited
    /// on that node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditStatus>,
}

/// A node that stopped sending heartbeats.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct GoneNode {
    /// The node's id.
    pub node_id: String,
    /// Microseconds since the Unix epoch when its last heartbeat arrived.
    pub last_seen_at_us: u64,
}

/// One cache across the live nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CacheSummary {
    /// The cache name.
    pub name: String,
    /// The newest version any live node reports.
    pub newest_version: Option<u64>,
    /// Live nodes holding it.
    pub nodes: usize,
    /// Of those, nodes behind the newest version.
    pub behind: usize,
}

impl ClusterView {
    /// The (node, cache, how long) of every cache that has been behind the
    /// newest version for longer than `max_lag`.
    pub fn diverged(&self, max_lag: Duration) -> Vec<(&NodeView, &NodeCacheView, Duration)> {
        let mut out = Vec::new();
        for node in &self.nodes {
            for cache in &node.caches {
                if cache.lag.unwrap_or(0) == 0 {
                    continue;
                }
                // Behind for an unknown time: counted as beyond any limit.
                let behind = cache.behind_ms.map_or(Duration::MAX, Duration::from_millis);
                if behind > max_lag {
                    out.push((node, cache, behind));
                }
            }
        }
        out
    }

    /// Whether every live node is ready and level with the newest version
    /// of every cache it holds.
    pub fn is_converged(&self) -> bool {
        self.nodes.iter().all(|n| !n.lagging)
    }

    /// A live node, by id.
    pub fn node(&self, id: &str) -> Option<&NodeView> {
        self.nodes.iter().find(|n| n.node_id == id)
    }
}

/// How long each version of one cache has been known, on this party's own
/// clock: a staircase of (version, since when a version at least this high
/// has been known), the later the higher. A step another makes useless (a
/// version as high, known as long) is dropped; past `MAX_STEPS`, two
/// neighbours are merged (see [`learn`](Self::learn)).
///
/// Two lower bounds feed it, neither comparing one machine's clock with
/// another's: the instant this party received a heartbeat reporting a
/// version, and that instant less the age the heartbeat gave for it
/// (`version_age_ms`: how long ago the version rose on that node, a
/// duration on the node's own clock). A node at version `u` lacks every
/// version above `u`, so it has been behind for at least as long as the
/// first step above `u` has been known.
#[derive(Debug, Default)]
pub(super) struct Staircase {
    steps: BTreeMap<u64, Step>,
}

#[derive(Debug, Clone, Copy)]
struct Step {
    /// Since when a version at least this step's has been known.
    since: Instant,
    /// The earliest `since` of the steps merged into this one: how early
    /// the true answer for the versions it now covers may be.
    floor: Instant,
}

impl Staircase {
    /// Steps kept per cache. Merging keeps the relative error of any
    /// answer small where it matters: versions rising every second while
    /// a node is stuck for an hour (3,600 steps) come down to 64 spaced
    /// about geometrically, each answer within about a tenth of the truth,
    /// and always under it.
    pub(super) const MAX_STEPS: usize = 64;
    /// What a full staircase is accounted: a B-tree entry per step, its
    /// nodes down to half full.
    pub(super) const BYTES: usize = 2 * Self::MAX_STEPS * size_of::<(u64, Step)>();

    /// Learns that `version` has been known since `since`. `O(log s)`,
    /// `O(s)` (s at most `MAX_STEPS`) when a merge is due.
    pub(super) fn learn(&mut self, version: u64, since: Instant, now: Instant) {
        // The first step at or above `version` is the earliest known of
        // those: if it is no later, this tells nothing new.
        if let Some((_, s)) = self.steps.range(version..).next()
            && s.since <= since
        {
            return;
        }
        // The steps at or below `version` known no earlier go.
        let mut floor = since;
        while let Some((&v, s)) = self.steps.range(..=version).next_back() {
            if s.since < since {
                break;
            }
            floor = floor.min(s.floor);
            self.steps.remove(&v);
        }
        self.steps.insert(version, Step { since, floor });
        if self.steps.len() > Self::MAX_STEPS {
            self.merge_one(now);
        }
    }

    /// The earliest instant at which a version above `version` was known.
    pub(super) fn behind_since(&self, version: u64) -> Option<Instant> {
        self.steps
            .range((Bound::Excluded(version), Bound::Unbounded))
            .next()
            .map(|(_, s)| s.since)
    }

    /// Drops what no holder can ask: steps below `lowest` (a node at `v`
    /// asks for the first step above `v`), and steps above `newest`, a
    /// version no live node holds any more (say a forged one, or one from
    /// a history replaced since), which must not stand for those below
    /// it. The newest is then known since `now` at least, unless a step
    /// for it survived.
    pub(super) fn keep_between(&mut self, lowest: u64, newest: u64, now: Instant) {
        if self
            .steps
            .last_key_value()
            .is_some_and(|(v, _)| *v > newest)
        {
            if let Some(above) = newest.checked_add(1) {
                drop(self.steps.split_off(&above));
            }
            if self.steps.range(newest..).next().is_none() {
                self.steps.insert(
                    newest,
                    Step {
                        since: now,
                        floor: now,
                    },
                );
            }
        }
        if self
            .steps
            .first_key_value()
            .is_some_and(|(v, _)| *v < lowest)
        {
            self.steps = self.steps.split_off(&lowest);
        }
    }

    pub(super) fn clear(&mut self) {
        self.steps.clear();
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.steps.len()
    }

    /// Merges the step whose merge into the next (above it) costs the
    /// least relative error: its versions then answer with the next
    /// step's `since`, later than the truth by at most
    /// `next.since - floor`, out of `now - floor` behind. The last step is
    /// never merged away.
    fn merge_one(&mut self, now: Instant) {
        let steps: Vec<(u64, Step)> = self.steps.iter().map(|(v, s)| (*v, *s)).collect();
        let mut best: Option<(u64, u64, f64)> = None;
        for pair in steps.windows(2) {
            let [(v, cur), (next_v, next)] = pair else {
                continue;
            };
            let off = next
                .since
                .saturating_duration_since(cur.floor)
                .as_secs_f64();
            let behind = now.saturating_duration_since(cur.floor).as_secs_f64();
            let error = if behind > 0.0 {
                off / behind
            } else {
                f64::INFINITY
            };
            if best.is_none_or(|(_, _, e)| error < e) {
                best = Some((*v, *next_v, error));
            }
        }
        let Some((v, next_v, _)) = best else {
            return;
        };
        if let Some(merged) = self.steps.remove(&v)
            && let Some(next) = self.steps.get_mut(&next_v)
        {
            next.floor = next.floor.min(merged.floor);
        }
    }
}

/// Builds the view from the members (expired ones gone already) and the
/// owning node's own heartbeat, fresh (it replaces the node's entry among
/// the members, an echo of an earlier one). `O(n·c·log)`: per node and
/// cache, one look-up in the cache's index and one in its staircase.
pub(super) fn build(
    observer: &str,
    topic: &str,
    members: &Members,
    own: Option<&Member>,
    now: Instant,
    at_us: u64,
) -> ClusterView {
    let own_id = own.map(|o| o.id.as_ref());
    let mut list: Vec<(&Member, Duration)> = members
        .iter()
        .filter(|m| Some(m.id.as_ref()) != own_id)
        .map(|m| (m, now.saturating_duration_since(m.seen)))
        .chain(own.map(|o| (o, Duration::ZERO)))
        .collect();
    list.sort_by(|a, b| a.0.id.cmp(&b.0.id));
    // The owning node's versions are fresher than its echo in the index.
    let own_versions: HashMap<&str, u64> = own
        .map(|o| {
            o.caches
                .iter()
                .filter_map(|c| Some((c.name.as_ref(), c.version?)))
                .collect()
        })
        .unwrap_or_default();
    let mut summaries: HashMap<&str, CacheSummary> = HashMap::default();
    let mut nodes = Vec::with_capacity(list.len());
    for (m, age) in &list {
        // A node cannot have been behind for longer than it has run: its
        // uptime at its heartbeat (its own clock against itself), plus
        // the time since (this party's).
        let uptime = Duration::from_micros(m.sent_at_us.saturating_sub(m.started_at_us))
            .saturating_add(*age);
        let mut lagging = !m.ready;
        let caches: Vec<NodeCacheView> = m
            .caches
            .iter()
            .map(|c| {
                let index = members.index(&c.name);
                let newest = max_some(
                    index.and_then(CacheIndex::newest),
                    own_versions.get(c.name.as_ref()).copied(),
                );
                let have = c.version.unwrap_or(0);
                let lag = newest.map(|n| n.saturating_sub(have));
                let behind_ms = match lag {
                    Some(l) if l > 0 => {
                        let since = index.and_then(|i| i.staircase.behind_since(have));
                        let behind = since
                            .map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
                            .min(uptime);
                        Some(u64::try_from(behind.as_millis()).unwrap_or(u64::MAX))
                    }
                    Some(_) => Some(0),
                    None => None,
                };
                let behind = lag.unwrap_or(0) > 0;
                lagging |= behind;
                let s = summaries
                    .entry(c.name.as_ref())
                    .or_insert_with(|| CacheSummary {
                        name: c.name.to_string(),
                        newest_version: newest,
                        nodes: 0,
                        behind: 0,
                    });
                s.nodes = s.nodes.saturating_add(1);
                if behind {
                    s.behind = s.behind.saturating_add(1);
                }
                NodeCacheView {
                    name: c.name.to_string(),
                    version: c.version,
                    lag,
                    behind_ms,
                    entries: c.entries,
                    loss_resyncs: c.loss_resyncs,
                    quarantined: c.quarantined,
                    last_latency_us: c.last_latency_us,
                    freshness_age_ms: c.freshness_age_ms,
                    audit: c.audit.as_deref().cloned(),
                }
            })
            .collect();
        nodes.push(NodeView {
            node_id: m.id.to_string(),
            transport: m.transport.to_string(),
            started_at_us: m.started_at_us,
            age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
            interval_ms: m.interval_ms,
            consuming: m.consuming,
            ready: m.ready,
            position: m.position(),
            losses: m.losses,
            freshness_age_ms: m.freshness_age_ms,
            lagging,
            caches,
        });
    }
    let mut gone: Vec<GoneNode> = members
        .gone()
        .map(|(id, at)| GoneNode {
            node_id: id.to_owned(),
            last_seen_at_us: at,
        })
        .collect();
    gone.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    let mut caches: Vec<CacheSummary> = summaries.into_values().collect();
    caches.sort_by(|a, b| a.name.cmp(&b.name));
    ClusterView {
        observer: observer.to_owned(),
        topic: topic.to_owned(),
        at_us,
        nodes,
        gone,
        caches,
    }
}

fn max_some(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}
