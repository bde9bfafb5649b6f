//! Running the caches' consistency auditors (`cache/audit.rs`): a task per
//! audited cache, so a slow or hanging source of truth holds up no other
//! cache and none of the node's own work. A round runs only while the node
//! is ready; a suspect's grace window counts from the last moment it was
//! not.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Shared;
use crate::cache::{AUDIT_MARGIN, CacheHandle};
use crate::publish::DEFAULT_ANNOUNCE_INTERVAL;
use crate::util::{HashMap, HashSet, deadline_after, lock};
use crate::wire::{Body, Header, HeaderExt, Origin};

/// The markers an auditor sends round before it counts an inconsistency:
/// announcements numbered 0 (which vouch for nothing, so every node passes
/// them by) from a publisher id of this node's own, sent on the cache's
/// route and awaited on the node's own subscription.
pub(super) struct Markers {
    /// The publisher id they carry: random, as every publisher's is.
    pub(super) id: u64,
    next: AtomicU64,
    /// Per cache, the highest marker number that came back. The caches
    /// are the node's own, so the map is bounded by registration.
    back: Mutex<HashMap<String, u64>>,
    arrived: Notify,
}

impl Markers {
    pub(super) fn new() -> Self {
        Self {
            id: crate::util::random_u64(),
            next: AtomicU64::new(0),
            back: Mutex::default(),
            arrived: Notify::new(),
        }
    }

    /// A marker came back for `cache` (its number travels where an
    /// announcement's send time would).
    pub(super) fn returned(&self, cache: &str, n: u64) {
        let mut back = lock(&self.back);
        match back.get_mut(cache) {
            Some(seen) => *seen = (*seen).max(n),
            None => {
                back.insert(cache.to_owned(), n);
            }
        }
        drop(back);
        self.arrived.notify_waiters();
    }

    fn came_back(&self, cache: &str, n: u64) -> bool {
        lock(&self.back).get(cache).is_some_and(|&seen| seen >= n)
    }
}

/// Publishes a marker on `cache`'s route and waits, up to `timeout`, for it
/// to come back through the node's subscription. One cache's markers go
/// one at a time (its auditor waits for each), so the highest number back
/// says whether this one is.
async fn round_trip(shared: &Shared, cache: &str, timeout: Duration) -> bool {
    let markers = &shared.markers;
    let n = markers.next.fetch_add(1, Relaxed).saturating_add(1);
    let header = Header {
        cache,
        origin: Origin(shared.id.as_bytes()),
        publisher: markers.id,
        seq: 0,
        published_at_us: n,
    };
    let payload = match shared
        .codec
        .seal_body(&header, &HeaderExt::default(), Body::ANNOUNCE)
    {
        Ok(payload) => payload,
        Err(e) => {
            tracing::warn!(node = %shared.id, %cache, error = %e, "audit: cannot seal a marker");
            return false;
        }
    };
    let deadline = deadline_after(timeout);
    let publish = shared
        .transport
        .publish(&shared.topic, cache, bytes::Bytes::from(payload));
    match tokio::time::timeout_at(deadline, publish).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::debug!(node = %shared.id, %cache, error = %e, "audit: a marker was not published");
            return false;
        }
        Err(_) => return false,
    }
    loop {
        let arrived = markers.arrived.notified();
        tokio::pin!(arrived);
        arrived.as_mut().enable();
        if markers.came_back(cache, n) {
            return true;
        }
        if tokio::time::timeout_at(deadline, arrived).await.is_err() {
            return markers.came_back(cache, n);
        }
    }
}

/// How often an auditor looks at the node's readiness between rounds, so
/// a short spell of not being ready is not missed while a round waits.
const READY_TICK: Duration = Duration::from_millis(100);

/// Starts an auditor for each audited cache as it is registered; ends them
/// when the node stops.
pub(super) async fn audit_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut registrations = shared.registrations.subscribe();
    // The caches with an auditor running, by name; one leaves when its
    // auditor ends (its cache left the node), so a cache registered again
    // gets a new one.
    let mut started = HashSet::default();
    let mut auditors = JoinSet::new();
    loop {
        for (name, cache) in shared.caches().iter() {
            if cache.audit_first_wait().is_some() && started.insert(name.clone()) {
                let (shared, cache, stop) = (shared.clone(), cache.clone(), stop.clone());
                let name = name.clone();
                auditors.spawn(async move {
                    audit_cache(shared, cache, stop).await;
                    name
                });
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            changed = registrations.changed() => if changed.is_err() { break },
            Some(ended) = auditors.join_next() => match ended {
                Ok(name) => {
                    started.remove(&name);
                }
                // A panic in application code the auditor ran (a key's
                // `Hash`, a value's `PartialEq`): that cache's auditor is
                // gone until the node restarts; said once, loudly.
                Err(e) => tracing::error!(node = %shared.id, error = %e, "audit: an auditor ended abnormally"),
            },
        }
    }
    while auditors.join_next().await.is_some() {}
}

/// One cache's auditor, until the node stops or the cache leaves it.
async fn audit_cache(
    shared: Arc<Shared>,
    cache: Arc<dyn CacheHandle>,
    mut stop: watch::Receiver<bool>,
) {
    let grace = shared
        .config
        .reorder_window
        .saturating_add(DEFAULT_ANNOUNCE_INTERVAL)
        .saturating_add(AUDIT_MARGIN);
    let Some(first) = cache.audit_first_wait() else {
        return;
    };
    let mut next = deadline_after(first);
    let mut settled_since = Instant::now();
    let ready = || shared.ready();
    loop {
        let registered = shared
            .cache(cache.name())
            .is_some_and(|c| Arc::ptr_eq(&c, &cache));
        if !registered {
            break;
        }
        let now = Instant::now();
        if !ready() {
            settled_since = now;
        } else if now >= next {
            let name = cache.name().to_owned();
            let trip = |timeout| {
                let fut: std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>> =
                    Box::pin(round_trip(&shared, &name, timeout));
                fut
            };
            let round = cache.audit_round(grace, settled_since, &ready, &trip);
            let wait = tokio::select! {
                _ = stop.wait_for(|s| *s) => break,
                wait = round => wait,
            };
            let Some(wait) = wait else { break };
            next = deadline_after(wait);
        }
        let tick = next
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(1), READY_TICK);
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            () = tokio::time::sleep(tick) => {}
        }
    }
}
