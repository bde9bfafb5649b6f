//! The cluster view as served (`GET /cache-sync/cluster`, the web page, the
//! CLI): live nodes, their lag behind the newest version, the nodes gone.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Heartbeat;
use crate::transport::Position;
use crate::util::{HashMap, now_us};

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
    /// How long it has been behind, in milliseconds: since the observer
    /// first saw it behind, or since the first node now above its version
    /// reached the version it holds (on that node's clock), whichever is
    /// earlier. A lower bound: it may have been behind before either.
    pub behind_ms: Option<u64>,
    /// Entries held (approximate).
    pub entries: u64,
    /// Resyncs after a possible loss.
    pub loss_resyncs: u64,
    /// Whether refreshes are quarantined for now.
    pub quarantined: bool,
    /// Publish-to-applied time of its last event, in microseconds.
    pub last_latency_us: Option<u64>,
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

/// Per cache: the newest version, and when the first node reached it.
#[derive(Default)]
struct Newest {
    version: Option<u64>,
    at_us: Option<u64>,
}

/// Notes, per (node, cache), when it was first seen behind the newest
/// version any member reports, and forgets those level again: run at
/// every heartbeat taken in, so a listening observer times a lag from when
/// it began, not from when someone first looked.
pub(super) fn track_behind<'a>(
    members: impl Iterator<Item = &'a Heartbeat> + Clone,
    behind: &mut HashMap<(String, String), u64>,
    now_us: u64,
) {
    let mut newest: BTreeMap<&str, u64> = BTreeMap::new();
    for h in members.clone() {
        for c in &h.caches {
            if let Some(v) = c.version {
                let n = newest.entry(c.name.as_str()).or_insert(v);
                *n = (*n).max(v);
            }
        }
    }
    let mut still: Vec<(&str, &str)> = Vec::new();
    for h in members {
        for c in &h.caches {
            let Some(&best) = newest.get(c.name.as_str()) else {
                continue;
            };
            if c.version.unwrap_or(0) < best {
                still.push((h.node_id.as_str(), c.name.as_str()));
                behind
                    .entry((h.node_id.clone(), c.name.clone()))
                    .or_insert(now_us);
            }
        }
    }
    behind.retain(|(node, cache), _| still.contains(&(node.as_str(), cache.as_str())));
}

/// Builds the view. `behind` remembers, per (node, cache), when this
/// observer first saw it behind; it is updated here.
pub(super) fn build(
    observer: &str,
    topic: &str,
    members: Vec<(Heartbeat, u64, Duration)>,
    gone: Vec<(String, u64)>,
    behind: &mut HashMap<(String, String), u64>,
) -> ClusterView {
    let at_us = now_us();
    let mut still_behind: Vec<(String, String)> = Vec::new();
    let mut newest: BTreeMap<&str, Newest> = BTreeMap::new();
    for (h, _, _) in &members {
        for c in &h.caches {
            let n = newest.entry(c.name.as_str()).or_default();
            match (c.version, n.version) {
                (Some(v), Some(best)) if v < best => {}
                (Some(v), Some(best)) if v == best => {
                    n.at_us = min_some(n.at_us, c.version_at_us);
                }
                (Some(v), _) => {
                    n.version = Some(v);
                    n.at_us = c.version_at_us;
                }
                (None, _) => {}
            }
        }
    }
    let mut summaries: BTreeMap<&str, CacheSummary> = BTreeMap::new();
    let mut nodes: Vec<NodeView> = members
        .iter()
        .map(|(h, _, age)| {
            let caches: Vec<NodeCacheView> = h
                .caches
                .iter()
                .map(|c| {
                    let best = newest.get(c.name.as_str());
                    let lag = best
                        .and_then(|b| b.version)
                        .map(|b| b.saturating_sub(c.version.unwrap_or(0)));
                    // How long behind: the longer of two lower bounds, this
                    // observer's own sighting and the earliest time a node
                    // now above this one's version reached its version (on
                    // that node's clock). The first alone misses a node
                    // that was behind before the observer started; the
                    // second alone, a node stuck while newer versions keep
                    // coming.
                    let behind_ms = match lag {
                        Some(l) if l > 0 => {
                            let key = (h.node_id.clone(), c.name.clone());
                            let seen = *behind.entry(key.clone()).or_insert(at_us);
                            still_behind.push(key);
                            let above = members
                                .iter()
                                .filter_map(|(o, _, _)| {
                                    o.caches.iter().find(|oc| oc.name == c.name)
                                })
                                .filter(|oc| oc.version > c.version)
                                .filter_map(|oc| oc.version_at_us)
                                .min();
                            let since = above.map_or(seen, |a| a.min(seen));
                            Some(at_us.saturating_sub(since) / 1000)
                        }
                        Some(_) => Some(0),
                        None => None,
                    };
                    let s = summaries
                        .entry(c.name.as_str())
                        .or_insert_with(|| CacheSummary {
                            name: c.name.clone(),
                            newest_version: best.and_then(|b| b.version),
                            nodes: 0,
                            behind: 0,
                        });
                    s.nodes = s.nodes.saturating_add(1);
                    if lag.unwrap_or(0) > 0 {
                        s.behind = s.behind.saturating_add(1);
                    }
                    NodeCacheView {
                        name: c.name.clone(),
                        version: c.version,
                        lag,
                        behind_ms,
                        entries: c.entries,
                        loss_resyncs: c.loss_resyncs,
                        quarantined: c.quarantined,
                        last_latency_us: c.last_latency_us,
                    }
                })
                .collect();
            let lagging = !h.ready || caches.iter().any(|c| c.lag.unwrap_or(0) > 0);
            NodeView {
                node_id: h.node_id.clone(),
                transport: h.transport.clone(),
                started_at_us: h.started_at_us,
                age_ms: u64::try_from(age.as_millis()).unwrap_or(u64::MAX),
                interval_ms: h.interval_ms,
                consuming: h.consuming,
                ready: h.ready,
                position: h.position.clone(),
                losses: h.losses,
                lagging,
                caches,
            }
        })
        .collect();
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    // Forget sightings of caches level again, and of nodes gone.
    behind.retain(|key, _| still_behind.contains(key));
    let mut gone: Vec<GoneNode> = gone
        .into_iter()
        .map(|(node_id, last_seen_at_us)| GoneNode {
            node_id,
            last_seen_at_us,
        })
        .collect();
    gone.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    ClusterView {
        observer: observer.to_owned(),
        topic: topic.to_owned(),
        at_us,
        nodes,
        gone,
        caches: summaries.into_values().collect(),
    }
}

fn min_some(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}
