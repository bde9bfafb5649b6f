//! Acknowledged publishes: ask every node that holds a cache to say when it
//! has applied a publish, and wait until every live one did.
//!
//! The request names the cache, the target (a publisher's sequence number,
//! or a version) and this party; each node answers once, with a message of
//! a few dozen bytes that only this party reads (see `message::Ack`), so
//! an acknowledged publish costs the channel one request and one answer per
//! node, and nobody decodes what is not theirs.

use std::fmt;
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::requests::{FirstSend, MAX_ANSWERS, MAX_NODE_ID_BYTES, Registered, Requests, Wait};
use super::{Ack, Cluster, Message, Request, Target};
use crate::util::{HashMap, lock};

/// Which nodes applied a publish, as they answered.
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
    /// Why the wait cannot call the publish applied everywhere, if it
    /// cannot: see [`Incomplete`]. `None`: every live node that holds the
    /// cache applied it, as a view that could be trusted to know every live
    /// node tells.
    pub incomplete: Option<Incomplete>,
}

/// Why an acknowledged publish is not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Incomplete {
    /// Some live node holding the cache had not answered that it applied
    /// the publish when the wait ended.
    Pending,
    /// No live node holds the cache.
    NoNode,
    /// The view may not have heard every live node yet: it started reading
    /// the heartbeat channel too recently (it needs 1.5 heartbeat
    /// intervals, or 500 ms after its roll call, whichever comes first),
    /// or it holds fewer live nodes than a node it heard counts in its own
    /// view ([`Heartbeat::live_nodes`](crate::cluster::Heartbeat::live_nodes)):
    /// no clock tells when a slow node's answer will come, but a count
    /// does. A node that stopped lately is still counted by the others
    /// until it expires there, so a view that has just started may say
    /// this for up to four heartbeat intervals after a node stops.
    Settling,
    /// The view is not reading the heartbeat channel (its subscription
    /// broke, or the transport has none): any node may be missing from it.
    NotListening,
    /// The view is at its member cap or its byte budget, or lately had to
    /// drop a node's heartbeat for lack of room: a live node holding the
    /// cache may be missing from it, so its answer would not be waited for.
    ViewFull,
}

impl fmt::Display for Incomplete {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Incomplete::Pending => "some nodes had not applied it",
            Incomplete::NoNode => "no live node holds the cache",
            Incomplete::Settling => "the cluster view may not know every node yet",
            Incomplete::NotListening => "the cluster view is not reading the heartbeat channel",
            Incomplete::ViewFull => "the cluster view is full and may be missing nodes",
        })
    }
}

/// One node in [`Acks`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeAck {
    /// The node's id.
    pub node_id: String,
    /// Whether it answered that it applied the publish.
    pub applied: bool,
    /// From the publish (or, for [`Cluster::applied_version`], the start of
    /// the wait) until its answer arrived here, on this party's clock: an
    /// upper bound on the node's publish-to-applied time, with no clock
    /// skew in it. `None` if not applied.
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
            incomplete: None,
        }
    }

    /// Whether every live node that holds the cache applied it: see
    /// [`incomplete`](Self::incomplete).
    pub fn is_complete(&self) -> bool {
        self.incomplete.is_none()
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

/// `applied on 12/12 nodes in 3 ms`, and why not complete when it is not:
/// `applied on 2/3 nodes in 5000 ms (incomplete: some nodes had not applied it)`.
impl fmt::Display for Acks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "applied on {}/{} nodes in {} ms",
            self.applied(),
            self.nodes.len(),
            self.elapsed.as_millis()
        )?;
        match self.incomplete {
            Some(why) => write!(f, " (incomplete: {why})"),
            None => Ok(()),
        }
    }
}

/// What a node must have applied, and since when the wait counts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Goal {
    pub(crate) target: Target,
    /// When the publish went out, on this party's clock; latencies count
    /// from it (from the start of the wait when `None`).
    pub(crate) since: Option<Instant>,
}

/// The requests a party waits on, and the answers in: by request id, each
/// answering node with when its answer arrived (see `requests.rs`). Beside
/// them, what the nodes told of the things this party follows (see
/// `node/acks.rs`): per (cache, publisher or version), each node's last
/// value and when it arrived. Only things a wait of this party asked for
/// are kept, and each goes once no wait has asked for it for a while, so
/// forged answers cannot grow it.
#[derive(Default)]
pub(crate) struct Waiters {
    requests: Requests<Instant>,
    followed: Mutex<HashMap<(String, Option<u64>), Followed>>,
}

/// What the nodes told of one thing this party follows.
struct Followed {
    /// Per node: its last value, and when that arrived here.
    nodes: HashMap<String, (u64, Instant)>,
    /// When a wait last asked for it.
    asked: Instant,
}

/// How long a party keeps what the nodes tell of something no wait asked
/// for since: longer than the nodes keep telling it (10 s).
const FOLLOWED_KEPT: Duration = Duration::from_secs(30);

impl Waiters {
    /// Takes an answer in: for each request of this party it names that is
    /// still waited on, the node counts from now; and what it tells of the
    /// things this party follows. Whether anything changed.
    pub(crate) fn answered(&self, ack: &Ack) -> bool {
        if ack.node_id.len() > MAX_NODE_ID_BYTES {
            return false;
        }
        let now = Instant::now();
        let mut changed =
            self.requests
                .answered(&ack.node_id, ack.ids.iter().map(|&id| (id, now)), |at| at);
        if !ack.progress.is_empty() {
            let mut followed = lock(&self.followed);
            for p in &ack.progress {
                let Some(f) = followed.get_mut(&(p.cache.clone(), p.publisher)) else {
                    continue;
                };
                let room = f.nodes.len() < MAX_ANSWERS;
                match f.nodes.get_mut(&ack.node_id) {
                    Some(last) if last.0 >= p.at => {}
                    Some(last) => {
                        *last = (p.at, now);
                        changed = true;
                    }
                    None if room => {
                        f.nodes.insert(ack.node_id.clone(), (p.at, now));
                        changed = true;
                    }
                    None => {}
                }
            }
        }
        changed
    }

    fn register(&self, cache: &str, target: Target) -> Registered<'_, Instant> {
        let now = Instant::now();
        {
            let mut followed = lock(&self.followed);
            followed.retain(|_, f| now.saturating_duration_since(f.asked) <= FOLLOWED_KEPT);
            let (publisher, _) = target.followed();
            followed
                .entry((cache.to_owned(), publisher))
                .or_insert_with(|| Followed {
                    nodes: HashMap::default(),
                    asked: now,
                })
                .asked = now;
        }
        self.requests.register()
    }

    /// When each node that applied `target` told so: by answering the
    /// request `id`, or by telling a value at or past it of what this party
    /// follows (the earlier of the two).
    fn applied(&self, id: u64, cache: &str, target: Target) -> HashMap<String, Instant> {
        let mut out = self.requests.answers(id);
        let (publisher, wanted) = target.followed();
        if let Some(f) = lock(&self.followed).get(&(cache.to_owned(), publisher)) {
            for (node, (value, at)) in &f.nodes {
                if *value >= wanted {
                    out.entry(node.clone())
                        .and_modify(|t| *t = (*t).min(*at))
                        .or_insert(*at);
                }
            }
        }
        out
    }
}

/// Asks the nodes that hold `cache` to answer once they have applied the
/// goal, then waits until every live one did, or `timeout`.
pub(crate) async fn wait(cluster: &Cluster, cache: &str, goal: Goal, timeout: Duration) -> Acks {
    let wait = Wait::start(cluster, timeout);
    let since = goal.since.unwrap_or(wait.started);
    let waiters = cluster.waiters();
    let registered = waiters.register(cache, goal.target);
    let within_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    let request = Message::Request(Request {
        topic: cluster.topic().to_owned(),
        cache: Some(cache.to_owned()),
        target: Some(goal.target),
        within_ms,
        asker: cluster.asker(),
        id: registered.id,
        reply: cluster.reads_replies(),
    });
    // Not waited for: what the nodes follow for this party may already say
    // the publish is applied (see `node/acks.rs`), and the request's round
    // trip would only delay the answer.
    let first = FirstSend::Spawned;
    let gathered = wait
        .gather(cluster, cache, request, first, || {
            waiters.applied(registered.id, cache, goal.target)
        })
        .await;
    Acks {
        cache: cache.to_owned(),
        nodes: gathered
            .nodes
            .into_iter()
            .map(|(node_id, at)| NodeAck {
                applied: at.is_some(),
                latency: at.map(|at| at.saturating_duration_since(since)),
                node_id,
            })
            .collect(),
        elapsed: gathered.elapsed,
        incomplete: gathered.incomplete,
    }
}

impl Cluster {
    /// Waits until every live node that holds `cache` reports its version
    /// at `version` or newer, or `timeout` passes: the acknowledged form of
    /// a versioned change published by someone else, such as an
    /// `OutboxRelay` (feature `postgres-outbox`) for a version an outbox enqueue
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
            since: None,
        };
        wait(self, cache, goal, timeout).await
    }
}

pub(super) mod micros {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(in crate::cluster) fn serialize<S: Serializer>(
        d: &Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    pub(in crate::cluster) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Duration, D::Error> {
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
