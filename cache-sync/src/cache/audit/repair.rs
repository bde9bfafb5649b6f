//! Repairs: an entry still behind past its grace window is counted,
//! logged, traced and removed.

use std::hash::Hash;
use std::sync::atomic::Ordering::Relaxed;

use serde::Serialize;
use tokio::time::Instant;

use super::{Auditor, Suspect};
use crate::cache::Inner;
use crate::cache::write::Write;
use crate::status::TraceEvent;

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Repairs an entry still behind after its grace window by removing it,
    /// unless something wrote the key since it was judged: then the write
    /// stands, and it was no inconsistency. Counts, logs and traces one
    /// that was; returns whether it was.
    pub(super) async fn inconsistent(
        &self,
        auditor: &Auditor<K, V>,
        key: K,
        suspect: Suspect,
        source_version: Option<u64>,
    ) -> bool {
        let trace = self.trace.as_ref().map(|t| t.of(&key));
        let repaired = self
            .write(key.clone(), |table, k| {
                if table.superseded(k, suspect.token) || table.held_at(k) != suspect.version {
                    Write::Keep
                } else {
                    table.touch(k);
                    Write::Remove
                }
            })
            .await;
        if !repaired {
            return false;
        }
        let stats = &auditor.stats;
        stats.inconsistencies.fetch_add(1, Relaxed);
        stats.repairs.fetch_add(1, Relaxed);
        let stale = Instant::now().saturating_duration_since(suspect.observed);
        let stale_ms = u64::try_from(stale.as_millis()).unwrap_or(u64::MAX);
        stats.last_stale_ms.store(stale_ms, Relaxed);
        stats.max_stale_ms.fetch_max(stale_ms.max(1), Relaxed);
        let shown = serde_json::to_string(&key).unwrap_or_else(|e| format!("<{e}>"));
        tracing::warn!(
            cache = %self.name,
            key = %shown,
            ?source_version,
            stale_for = ?stale,
            ?trace,
            "audit: the node held an entry older than the source of truth past the grace window; removed it"
        );
        self.traced(Some(key), TraceEvent::Repaired, source_version);
        true
    }
}
