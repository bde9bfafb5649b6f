//! One node's heartbeat as it goes over the wire ([`Heartbeat`], with a
//! [`CacheHeartbeat`] per cache), and the interval it is sent at: the
//! default, the bounds and the check of the setting. Nodes build these and
//! every party reads them, so they are public and kept apart from what a
//! view keeps of them (`members`).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::status::AuditStatus;
use crate::transport::Position;
use crate::util::check_duration;

/// How often a node sends its heartbeat unless told otherwise.
pub(crate) const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(2);
/// The shortest heartbeat interval: more often would cost the transport more
/// than it tells anyone.
pub(crate) const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_millis(10);
/// A node that sent nothing for this many of its own intervals is gone.
pub(crate) const MISSED_INTERVALS: u32 = 3;

/// One node's heartbeat: who it is, how far it got, and what its caches
/// hold. No key or value appears in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Heartbeat {
    /// The node's id.
    pub node_id: String,
    /// The topic it consumes: signed with the rest, so a heartbeat replayed
    /// into another topic's channel is refused there.
    #[serde(default)]
    pub topic: String,
    /// Microseconds since the Unix epoch when the node started.
    pub started_at_us: u64,
    /// Microseconds since the Unix epoch when this heartbeat was sent, on
    /// the node's clock.
    pub sent_at_us: u64,
    /// The node's heartbeat interval, in milliseconds: it counts as gone
    /// after three of them without a heartbeat.
    pub interval_ms: u64,
    /// The transport's kind.
    pub transport: String,
    /// Whether the consumer is running and its transport healthy.
    pub consuming: bool,
    /// Whether the node is ready to serve: see [`Node::is_ready`](crate::Node::is_ready).
    pub ready: bool,
    /// The node's position: every event before it has been applied.
    pub position: Position,
    /// Losses the node answered by a resync.
    pub losses: u64,
    /// How many live nodes the node's own view held when it sent this, the
    /// node included: a lower bound on the cluster (a node that stopped is
    /// counted until it expires there). A party whose view holds fewer has
    /// not heard every node yet, whatever its clock says (see
    /// [`Incomplete::Settling`](crate::cluster::Incomplete::Settling)).
    /// Absent from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_nodes: Option<u64>,
    /// The age of the node's freshness bound when it sent this, in
    /// milliseconds (see
    /// [`NodeStatus::freshness_age_ms`](crate::status::NodeStatus::freshness_age_ms)):
    /// a duration on the node's own clock, never a timestamp. Absent while
    /// unknown, and from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freshness_age_ms: Option<u64>,
    /// Each cache the node holds, by name.
    #[serde(default)]
    pub caches: Vec<CacheHeartbeat>,
}

/// One cache in a [`Heartbeat`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CacheHeartbeat {
    /// The cache name.
    pub name: String,
    /// The highest entry version the node took in for it (see
    /// [`CacheStatus::version`](crate::status::CacheStatus::version)).
    pub version: Option<u64>,
    /// Microseconds since the Unix epoch when `version` last rose, on the
    /// node's clock. For display: another machine's clock may be off, so
    /// no party compares it with its own.
    #[serde(default)]
    pub version_at_us: Option<u64>,
    /// How long ago `version` last rose, in milliseconds, on the node's own
    /// clock: a duration, so it means the same to a party whose clock is
    /// off. Whoever receives it learns that the version has been known for
    /// at least that long (believed up to the node's own uptime, and a
    /// day), which times another node's lag even for a party that just
    /// started. Absent from older nodes.
    #[serde(default)]
    pub version_age_ms: Option<u64>,
    /// Entries held (approximate).
    pub entries: u64,
    /// Times the cache was invalidated because a change may have been missed.
    pub loss_resyncs: u64,
    /// Whether versioned refreshes are applied as invalidations for now.
    pub quarantined: bool,
    /// Publish-to-applied time of the last event, in microseconds.
    #[serde(default)]
    pub last_latency_us: Option<u64>,
    /// How fresh the node proves the cache (see
    /// [`CacheStatus::freshness_age_ms`](crate::status::CacheStatus::freshness_age_ms)),
    /// in milliseconds on the sender's clock as of sending. Absent while
    /// unknown, and from nodes older than this field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freshness_age_ms: Option<u64>,
    /// What the cache's consistency auditor found, if it is audited.
    /// Absent from older nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditStatus>,
}

/// Checks a heartbeat interval setting: 10 ms to 1 h, or `Duration::MAX`
/// for none.
pub(crate) fn check_interval(setting: &str, every: Duration) -> Result<()> {
    if every == Duration::MAX {
        return Ok(());
    }
    check_duration(
        setting,
        every,
        MIN_HEARTBEAT_INTERVAL,
        crate::util::MAX_TIMEOUT,
    )
    .map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("{m} (or Duration::MAX for none)")),
        other => other,
    })
}
