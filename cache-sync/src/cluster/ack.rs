//! Acknowledged publishes: wait until every live node that holds a cache
//! reports, in its heartbeat, that it applied a publish.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{Cluster, Heartbeat, Message, Request, Target};
use crate::util::deadline_after;

/// Which nodes applied a publish, as their heartbeats report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Acks {
    /// The cache.
    pub cache: String,
    /// Every live node that holds the cache, by id: those that applied the
    /// publish, and those that had not when the wait ended.
    pub nodes: Vec<NodeAck>,
    /// From the start of the wait until every node had applied it, or
    /// until the timeout.
    #[serde(with = "micros")]
    pub elapsed: Duration,
    /// Whether every live node holding the cache applied it, as far as a
    /// view that could be trusted to know every live node tells: false
    /// when the view was still settling or not reading the heartbeat
    /// channel when the wait ended, or no node holds the cache.
    pub complete: bool,
}

/// One node in [`Acks`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeAck {
    /// The node's id.
    pub node_id: String,
    /// Whether it reported the publish applied.
    pub applied: bool,
    /// Publish-to-applied time on that node, across clocks (includes their
    /// skew). When the node reported a later event of the same publisher
    /// instead, the time is that event's: an upper bound. `None` if not
    /// applied, or applied by version (through an outbox).
    #[serde(with = "micros_opt")]
    pub latency: Option<Duration>,
}

impl Acks {
    /// No node, nothing waited for: an empty publish.
    pub(crate) fn none() -> Self {
        Acks {
            cache: String::new(),
            nodes: Vec::new(),
            elapsed: Duration::ZERO,
            complete: true,
        }
    }

    /// Whether every live node that holds the cache applied it: see
    /// [`complete`](Self::complete).
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// How many nodes applied it.
    pub fn applied(&self) -> usize {
        self.nodes.iter().filter(|n| n.applied).count()
    }

    /// The nodes that had not applied it when the wait ended.
    pub fn pending(&self) -> impl Iterator<Item = &str> {
        self.nodes
            .iter()
            .filter(|n| !n.applied)
            .map(|n| n.node_id.as_str())
    }
}

/// `applied on 12/12 nodes in 3 ms`.
impl fmt::Display for Acks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "applied on {}/{} nodes in {} ms",
            self.applied(),
            self.nodes.len(),
            self.elapsed.as_millis()
        )
    }
}

/// What a node must report for the wait to count it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Goal {
    pub(crate) target: Target,
    /// When the publish was sent, for latencies (publisher's clock).
    pub(crate) published_at_us: Option<u64>,
}

impl Goal {
    /// Whether `h` reports the goal met for `cache`, and the latency.
    fn met(&self, h: &Heartbeat, cache: &str) -> Option<(bool, Option<Duration>)> {
        let c = h.caches.iter().find(|c| c.name == cache)?;
        Some(match self.target {
            Target::Seq { publisher, seq } => {
                match c.recent.iter().find(|e| e.publisher == publisher) {
                    Some(e) if e.seq >= seq => {
                        let from = self.published_at_us.unwrap_or(e.published_at_us);
                        let us = e.applied_at_us.saturating_sub(from);
                        (true, Some(Duration::from_micros(us)))
                    }
                    _ => (false, None),
                }
            }
            Target::Version(v) => (c.version.is_some_and(|have| have >= v), None),
        })
    }
}

/// Asks the nodes to report, then waits until every live node holding
/// `cache` reports the goal met, or `timeout`.
pub(crate) async fn wait(cluster: &Cluster, cache: &str, goal: Goal, timeout: Duration) -> Acks {
    let started = Instant::now();
    let deadline = deadline_after(timeout);
    let mut updates = cluster.updates();
    let within_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    cluster
        .send(&Message::Request(Request {
            topic: cluster.topic().to_owned(),
            cache: Some(cache.to_owned()),
            target: Some(goal.target),
            within_ms,
        }))
        .await;
    loop {
        // A young view, or one not reading the channel, may not know every
        // node: it is not trusted to be complete until it settles.
        let now = Instant::now();
        let known = cluster.settled_at().is_some_and(|at| now >= at);
        let mut acks = tally(cluster, cache, goal, started);
        acks.complete = known && !acks.nodes.is_empty() && acks.nodes.iter().all(|n| n.applied);
        if acks.complete || now >= deadline {
            return acks;
        }
        // Woken by every heartbeat taken in, and at least every few
        // milliseconds besides: a node's own view (without heartbeats, or
        // while it settles) changes with no heartbeat arriving.
        let wake = now.checked_add(RECHECK).unwrap_or(now).min(deadline);
        tokio::select! {
            changed = updates.changed() => {
                if changed.is_err() {
                    return acks;
                }
            }
            () = tokio::time::sleep_until(wake) => {}
        }
    }
}

/// How often a wait looks again without a heartbeat to wake it.
const RECHECK: Duration = Duration::from_millis(10);

fn tally(cluster: &Cluster, cache: &str, goal: Goal, started: Instant) -> Acks {
    let mut nodes: Vec<NodeAck> = cluster
        .nodes()
        .iter()
        .filter_map(|h| {
            goal.met(h, cache).map(|(applied, latency)| NodeAck {
                node_id: h.node_id.clone(),
                applied,
                latency,
            })
        })
        .collect();
    nodes.sort_by(|a, b| a.node_id.cmp(&b.node_id));
    Acks {
        cache: cache.to_owned(),
        nodes,
        elapsed: started.elapsed(),
        complete: false,
    }
}

impl Cluster {
    /// Waits until every live node that holds `cache` reports its version
    /// at `version` or newer, or `timeout` passes: the acknowledged form of
    /// a versioned change published by someone else, such as an
    /// `OutboxRelay` (feature `postgres`) for a version an outbox enqueue
    /// returned.
    ///
    /// A cache's version is the highest it took in, so this means the
    /// change at `version` was taken in when that cache's changes reach the
    /// nodes in version order: true of one publisher at a time assigning
    /// increasing versions over an ordered transport (an outbox and its
    /// relay, a dictionary publisher), not of several writers racing.
    pub async fn applied_version(&self, cache: &str, version: u64, timeout: Duration) -> Acks {
        let goal = Goal {
            target: Target::Version(version),
            published_at_us: None,
        };
        wait(self, cache, goal, timeout).await
    }
}

mod micros {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}

mod micros_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    #[allow(clippy::ref_option)] // serde's `with` hands an `&Option`.
    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Option::<u64>::deserialize(d).map(|o| o.map(Duration::from_micros))
    }
}
