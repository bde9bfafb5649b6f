//! Running the caches' consistency auditors (`cache/audit.rs`): a task per
//! audited cache, so a slow or hanging source of truth holds up no other
//! cache and none of the node's own work. A round runs only while the node
//! is ready; a suspect's grace window counts from the last moment it was
//! not.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::Shared;
use crate::cache::{AUDIT_MARGIN, CacheHandle};
use crate::publish::DEFAULT_ANNOUNCE_INTERVAL;
use crate::util::{HashSet, deadline_after};

/// How often an auditor looks at the node's readiness between rounds, so
/// a short spell of not being ready is not missed while a round waits.
const READY_TICK: Duration = Duration::from_millis(100);

/// Starts an auditor for each audited cache as it is registered; ends them
/// when the node stops.
pub(super) async fn audit_loop(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    let mut registrations = shared.registrations.subscribe();
    let mut started = HashSet::default();
    let mut auditors = JoinSet::new();
    loop {
        for (name, cache) in shared.caches().iter() {
            if cache.audit_first_wait().is_some() && started.insert(name.clone()) {
                auditors.spawn(audit_cache(shared.clone(), cache.clone(), stop.clone()));
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            changed = registrations.changed() => if changed.is_err() { break },
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
            let round = cache.audit_round(grace, settled_since, &ready);
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
