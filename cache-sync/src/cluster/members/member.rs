//! What a view keeps of one live node ([`Member`]): a summary of its last
//! heartbeat, its caches deduplicated by name (the first of a name wins),
//! each name an interned `Arc<str>` shared with the cache's other holders
//! and its index.

use std::sync::Arc;

use tokio::time::Instant;

use crate::cluster::{CacheHeartbeat, Heartbeat};
use crate::status::AuditStatus;
use crate::transport::{Offset, Position};

/// One live node, as its last heartbeat described it.
#[derive(Debug)]
pub(in crate::cluster) struct Member {
    pub(in crate::cluster) id: Arc<str>,
    pub(in crate::cluster) started_at_us: u64,
    pub(in crate::cluster) sent_at_us: u64,
    pub(in crate::cluster) interval_ms: u64,
    pub(in crate::cluster) transport: Box<str>,
    pub(in crate::cluster) consuming: bool,
    pub(in crate::cluster) ready: bool,
    /// Its position's partitions, in order: a `Position` (a B-tree) with
    /// one partition takes a whole node, about 600 bytes.
    position: Box<[(Box<str>, Offset)]>,
    pub(in crate::cluster) losses: u64,
    /// The live nodes its own view held (see [`Heartbeat::live_nodes`]).
    pub(in crate::cluster) live_nodes: Option<u64>,
    /// Its freshness bound's age when it sent the heartbeat.
    pub(in crate::cluster) freshness_age_ms: Option<u64>,
    /// By name, each name once.
    pub(in crate::cluster) caches: Box<[StoredCache]>,
    /// When its heartbeat arrived, on this party's monotonic clock.
    pub(in crate::cluster) seen: Instant,
    /// The same, in microseconds since the Unix epoch on this party's
    /// clock: for display only.
    pub(in crate::cluster) seen_at_us: u64,
    /// Its key in the expiry queue.
    pub(super) expires: (Instant, u64),
    /// What it is accounted, its cache names' text aside (see
    /// [`Members::bytes`](super::Members::bytes)).
    pub(super) bytes: usize,
}

/// One cache of a [`Member`].
#[derive(Debug)]
pub(in crate::cluster) struct StoredCache {
    pub(in crate::cluster) name: Arc<str>,
    pub(in crate::cluster) version: Option<u64>,
    pub(in crate::cluster) version_at_us: Option<u64>,
    pub(in crate::cluster) entries: u64,
    pub(in crate::cluster) loss_resyncs: u64,
    pub(in crate::cluster) last_latency_us: Option<u64>,
    pub(in crate::cluster) freshness_age_ms: Option<u64>,
    pub(in crate::cluster) quarantined: bool,
    /// Boxed: most caches are not audited, and their slot stays small.
    pub(in crate::cluster) audit: Option<Box<AuditStatus>>,
}

/// Keeps the first cache of each name, in name order.
pub(super) fn dedup(caches: &mut Vec<CacheHeartbeat>) {
    // Stable: of equal names, the first stays first, and `dedup_by` keeps it.
    caches.sort_by(|a, b| a.name.cmp(&b.name));
    caches.dedup_by(|later, first| later.name == first.name);
}

impl StoredCache {
    pub(super) fn new(c: CacheHeartbeat, name: Arc<str>) -> Self {
        StoredCache {
            name,
            version: c.version,
            version_at_us: c.version_at_us,
            entries: c.entries,
            loss_resyncs: c.loss_resyncs,
            last_latency_us: c.last_latency_us,
            freshness_age_ms: c.freshness_age_ms,
            quarantined: c.quarantined,
            audit: c.audit.map(Box::new),
        }
    }
}

impl Member {
    pub(super) fn new(
        h: Heartbeat,
        id: Arc<str>,
        caches: Box<[StoredCache]>,
        seen: (Instant, u64),
        expires: (Instant, u64),
        bytes: usize,
    ) -> Self {
        Member {
            id,
            started_at_us: h.started_at_us,
            sent_at_us: h.sent_at_us,
            interval_ms: h.interval_ms,
            transport: h.transport.into_boxed_str(),
            consuming: h.consuming,
            ready: h.ready,
            position: h
                .position
                .iter()
                .map(|(partition, offset)| (Box::from(partition), offset.clone()))
                .collect(),
            losses: h.losses,
            live_nodes: h.live_nodes,
            freshness_age_ms: h.freshness_age_ms,
            caches,
            seen: seen.0,
            seen_at_us: seen.1,
            expires,
            bytes,
        }
    }

    /// A member of no view: the owning node's own heartbeat, as of now.
    pub(in crate::cluster) fn detached(mut h: Heartbeat, now: Instant, now_us: u64) -> Self {
        dedup(&mut h.caches);
        let caches = std::mem::take(&mut h.caches)
            .into_iter()
            .map(|c| {
                let name = Arc::from(c.name.as_str());
                StoredCache::new(c, name)
            })
            .collect();
        let id = Arc::from(std::mem::take(&mut h.node_id).into_boxed_str());
        Member::new(h, id, caches, (now, now_us), (now, 0), 0)
    }

    /// Its position.
    pub(in crate::cluster) fn position(&self) -> Position {
        let mut p = Position::default();
        for (partition, offset) in &self.position {
            p.set(partition.as_ref(), offset.clone());
        }
        p
    }

    /// The heartbeat it stands for, as kept: caches deduplicated, and no
    /// `version_age_ms` (an age as of its arrival, not of now).
    pub(in crate::cluster) fn to_heartbeat(&self, topic: &str) -> Heartbeat {
        Heartbeat {
            node_id: self.id.to_string(),
            topic: topic.to_owned(),
            started_at_us: self.started_at_us,
            sent_at_us: self.sent_at_us,
            interval_ms: self.interval_ms,
            transport: self.transport.to_string(),
            consuming: self.consuming,
            ready: self.ready,
            position: self.position(),
            losses: self.losses,
            live_nodes: self.live_nodes,
            freshness_age_ms: self.freshness_age_ms,
            caches: self
                .caches
                .iter()
                .map(|c| CacheHeartbeat {
                    name: c.name.to_string(),
                    version: c.version,
                    version_at_us: c.version_at_us,
                    version_age_ms: None,
                    entries: c.entries,
                    loss_resyncs: c.loss_resyncs,
                    quarantined: c.quarantined,
                    last_latency_us: c.last_latency_us,
                    freshness_age_ms: c.freshness_age_ms,
                    audit: c.audit.as_deref().cloned(),
                })
                .collect(),
        }
    }
}
