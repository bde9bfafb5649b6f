//! The node's hub (`Shared`): what its tasks (consume, maintenance,
//! heartbeat, the acknowledgement sender) and its `Node` handles share,
//! with its configuration. The tasks read and set its fields directly, on
//! their hot paths, and the builder makes it in one literal, so the fields
//! are visible to the node module (and no further). What it does lives by
//! concern: the cache map and registrations in `registry`, the counters
//! and the status in `stats`, the heartbeat in `heartbeat`.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use super::acks;
use super::registry::CacheMap;
use super::stats::NodeStats;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::transport::OffsetStore;
use crate::transport::{
    LossReason, Position, StartFrom, SubscribeOptions, Subscription, Transport,
};
use crate::util::lock;
use crate::wire::Codec;

/// A node that failed to start, or whose last task and handle are gone,
/// lets its caches be registered on another node.
impl Drop for Shared {
    fn drop(&mut self) {
        self.release_caches();
    }
}

pub(super) struct Shared {
    /// This node's claim on its caches; see `CacheHandle::claim`.
    pub(super) token: u64,
    pub(super) id: String,
    pub(super) topic: String,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) offsets: Arc<dyn OffsetStore>,
    pub(super) config: Config,
    /// Opens what the transport delivers: the size limit and, when the node
    /// verifies signatures, the keyring.
    pub(super) codec: Codec,
    /// Copied on write (registrations are rare), so the consumer takes one
    /// snapshot per batch instead of a lock and an `Arc` clone per event.
    pub(super) caches: RwLock<Arc<CacheMap>>,
    /// Bumped on every registration, so the consumer can re-subscribe with
    /// the new tag set.
    pub(super) registrations: watch::Sender<u64>,
    pub(super) position: Mutex<Position>,
    /// The position moved since it was last saved.
    pub(super) dirty: AtomicBool,
    /// Signalled after each applied batch; see `maintenance_loop`.
    pub(super) applied: Notify,
    pub(super) consuming: AtomicBool,
    /// The consume task runs (see [`Node::is_alive`](super::Node::is_alive)).
    pub(super) alive: AtomicBool,
    /// The start replay is done: the transport had no more to give at once
    /// (see `consume_loop`).
    pub(super) caught_up: AtomicBool,
    /// Acknowledgement requests between the heartbeat task, which takes
    /// them in and sends the answers, and the consume task, which decides
    /// when each is met.
    pub(super) ack_queue: acks::AckQueue,
    /// The auditors' round-trip markers (see `audit.rs`).
    pub(super) markers: super::audit::Markers,
    /// Key probes being answered now (see `heartbeat::answer_probe`).
    pub(super) probes_in_flight: std::sync::atomic::AtomicUsize,
    pub(super) started_at_us: u64,
    /// What this node sees of the cluster, its own heartbeat included.
    pub(super) cluster: Cluster,
    pub(super) stats: NodeStats,
    /// The thread moka's housekeeping runs on, the node's caches' and its
    /// maintenance task's (see `cache::Housekeeper`).
    pub(super) housekeeper: Arc<crate::cache::Housekeeper>,
    /// How late the runtime runs the node's timer (see `lateness.rs`).
    pub(super) lateness: super::lateness::Lateness,
    /// The freshness bound the node has proved (see `freshness.rs`).
    pub(super) freshness: super::freshness::Freshness,
}

#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) start_from: StartFrom,
    pub(super) max_batch: usize,
    pub(super) max_event_bytes: usize,
    pub(super) persist_interval: Duration,
    pub(super) min_backoff: Duration,
    pub(super) max_backoff: Duration,
    pub(super) reorder_window: Duration,
    /// `Duration::MAX`: no heartbeats.
    pub(super) heartbeat_interval: Duration,
    /// `Duration::MAX`: no freshness bound.
    pub(super) freshness_interval: Duration,
}

impl Shared {
    pub(super) async fn subscribe(&self, from: StartFrom) -> Result<Box<dyn Subscription>> {
        let mut options = SubscribeOptions::new(from);
        if self.transport.filters_by_tag() {
            options = options.with_tags(self.caches().keys().cloned());
        }
        self.transport.subscribe(&self.topic, options).await
    }

    pub(super) async fn persist(&self) -> Result<()> {
        let position = lock(&self.position).clone();
        if position.is_empty() {
            return Ok(());
        }
        self.offsets.save(&self.topic, &position).await
    }

    pub(super) async fn resync_all(&self, reason: LossReason, missed: Option<u64>) {
        self.record_loss(reason);
        let caches: Vec<_> = self.caches().values().cloned().collect();
        tracing::warn!(
            node = %self.id, topic = %self.topic, reason = reason.label(), ?missed, caches = caches.len(),
            "events may have been lost; invalidating every cache on the topic"
        );
        for cache in caches {
            cache.resync().await;
        }
    }
}
