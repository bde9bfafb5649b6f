//! The node's own counters, and the [`NodeStatus`] made of them and of
//! its caches' (what the status endpoint, the metrics and the heartbeat
//! report).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::Shared;
use crate::status::NodeStatus;
use crate::transport::LossReason;
use crate::util::{lock, now_us};

#[derive(Default)]
pub(super) struct NodeStats {
    pub(super) received: AtomicU64,
    pub(super) skipped: AtomicU64,
    pub(super) rejected: AtomicU64,
    pub(super) losses: AtomicU64,
    /// `losses` split by reason, indexed by `loss_index`; they sum to it.
    pub(super) losses_by_reason: [AtomicU64; LOSS_REASONS.len()],
    pub(super) publisher_gaps: AtomicU64,
    /// Events from a replaced outbox relay, applied as invalidations.
    pub(super) fenced: AtomicU64,
    /// Events at or below their publisher's last number for their cache,
    /// applied as invalidations.
    pub(super) late: AtomicU64,
    pub(super) transport_errors: AtomicU64,
    pub(super) last_loss: Mutex<Option<(String, u64)>>,
}

/// Every `LossReason`, in the order of `NodeStats::losses_by_reason`.
pub(super) const LOSS_REASONS: [LossReason; 6] = [
    LossReason::Trimmed,
    LossReason::Reconnected,
    LossReason::HistoryReset,
    LossReason::PublisherGap,
    LossReason::Overflow,
    LossReason::Unreadable,
];

/// Where `reason` is in `LOSS_REASONS`. A match with no wildcard, so a new
/// reason does not compile until it has a counter.
pub(super) fn loss_index(reason: LossReason) -> usize {
    match reason {
        LossReason::Trimmed => 0,
        LossReason::Reconnected => 1,
        LossReason::HistoryReset => 2,
        LossReason::PublisherGap => 3,
        LossReason::Overflow => 4,
        LossReason::Unreadable => 5,
    }
}

impl Shared {
    /// The status, with `consuming` as the flag says (the node's handle
    /// also knows whether it was told to stop).
    pub(super) fn status(&self) -> NodeStatus {
        let s = self;
        let node_age = s.freshness.age();
        let ms = |age: std::time::Duration| u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        let mut caches: Vec<_> = s
            .caches()
            .values()
            .map(|c| {
                let mut status = c.status();
                status.freshness_age_ms = c.freshness_age(node_age).map(ms);
                status
            })
            .collect();
        caches.sort_by(|a, b| a.name.cmp(&b.name));
        let last_loss = lock(&s.stats.last_loss).clone();
        NodeStatus {
            node_id: s.id.clone(),
            transport: s.transport.kind().to_owned(),
            topic: s.topic.clone(),
            consuming: s.consuming.load(Relaxed),
            position: lock(&s.position).clone(),
            events_received: s.stats.received.load(Relaxed),
            events_skipped: s.stats.skipped.load(Relaxed),
            events_rejected: s.stats.rejected.load(Relaxed),
            losses: s.stats.losses.load(Relaxed),
            losses_by_reason: LOSS_REASONS
                .iter()
                .zip(&s.stats.losses_by_reason)
                .map(|(reason, n)| (reason.label().to_owned(), n.load(Relaxed)))
                .collect(),
            publisher_gaps: s.stats.publisher_gaps.load(Relaxed),
            events_fenced: s.stats.fenced.load(Relaxed),
            events_late: s.stats.late.load(Relaxed),
            transport_errors: s.stats.transport_errors.load(Relaxed),
            last_loss_reason: last_loss.as_ref().map(|(r, _)| r.clone()),
            last_loss_at_us: last_loss.map(|(_, at)| at),
            heartbeats_sent: s.cluster.stats().sent.load(Relaxed),
            heartbeats_received: s.cluster.stats().received.load(Relaxed),
            heartbeats_rejected: s.cluster.stats().rejected.load(Relaxed),
            heartbeats_dropped: s.cluster.stats().dropped.load(Relaxed),
            runtime_lateness_us: s.lateness.recent_max_us(tokio::time::Instant::now()),
            freshness_age_ms: node_age.map(ms),
            caches,
        }
    }

    /// Counts a loss and remembers its reason for the status.
    pub(super) fn record_loss(&self, reason: LossReason) {
        self.stats.losses.fetch_add(1, Relaxed);
        // `loss_index` is always in bounds; `get` rather than indexing
        // keeps a panic out of the consumer all the same.
        if let Some(n) = self.stats.losses_by_reason.get(loss_index(reason)) {
            n.fetch_add(1, Relaxed);
        }
        *lock(&self.stats.last_loss) = Some((reason.label().to_owned(), now_us()));
    }
}
