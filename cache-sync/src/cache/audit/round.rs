//! One round of the auditor: what it reads from the source, in one read,
//! and what it makes of the answers.

use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use super::sweep::{due_keys, next_keys};
use super::verdict::Verdict;
use super::{Auditor, Row, Rows, Suspect};
use crate::cache::Inner;
use crate::util::{HashMap, HashSet, lock};

/// The node's round trip on the cache's route (`node/audit.rs`): whether a
/// marker it publishes now comes back through its own subscription within
/// the time given, which shows that everything published on that route
/// before it has been delivered.
pub(crate) type RoundTrip<'a> =
    &'a (dyn Fn(Duration) -> Pin<Box<dyn Future<Output = bool> + Send + 'a>> + Send + Sync);

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// One round: reads again the suspects whose grace window is over
    /// (counted from `settled_since` at the earliest: the last time the
    /// node was not ready), then the sweep's next keys, all in one read of
    /// the source. Returns how long to wait before the next round; `None`
    /// for a cache that is not audited.
    pub(in crate::cache) async fn audit_round(
        &self,
        default_grace: Duration,
        settled_since: Instant,
        ready: &(dyn Fn() -> bool + Send + Sync),
        round_trip: RoundTrip<'_>,
    ) -> Option<Duration> {
        let auditor = self.audit.as_ref()?;
        let audit = &auditor.audit;
        let grace = audit.grace.unwrap_or(default_grace);
        let now = Instant::now();
        // A new sweep's keys are gathered outside the state's lock: a scan
        // of the whole cache must not hold up the status and heartbeats,
        // which read the counters under it.
        if lock(&auditor.state).pass.is_empty() {
            let pass = self.sweep(auditor).await;
            let mut state = lock(&auditor.state);
            if state.pass.is_empty() && !pass.keys.is_empty() {
                auditor.stats.sweeps.fetch_add(1, Relaxed);
                state.pass = pass.keys;
                state.seen = pass.fingerprints;
                state.seen_at = pass.since;
            }
        }
        let (due, sweep) = {
            let mut state = lock(&auditor.state);
            if state.suspects.len() >= auditor.max_suspects() {
                // Full: first let go of the suspects already explained, so
                // that a long grace window stops the sweep only while as
                // many mismatches as the cap are really open. (Lock order:
                // the auditor's state, then the version table; nothing
                // takes them the other way round.)
                let table = lock(&self.table);
                let before = state.suspects.len();
                state.suspects.retain(|k, s| !table.superseded(k, s.token));
                let explained = before.saturating_sub(state.suspects.len());
                auditor.stats.cleared.fetch_add(explained as u64, Relaxed);
            }
            let due = due_keys(&state.suspects, now, settled_since, grace, audit.batch);
            let room = audit.batch.saturating_sub(due.len());
            // Before the due suspects leave the map: a key is asked for once.
            let sweep = if state.suspects.len() >= auditor.max_suspects() {
                Vec::new()
            } else {
                next_keys(&mut state, room)
            };
            let due: Vec<(K, Suspect)> = due
                .into_iter()
                .filter_map(|k| state.suspects.remove_entry(&k))
                .collect();
            (due, sweep)
        };
        // Suspects whose key was written or cleared since are explained.
        let due: Vec<(K, Suspect)> = {
            let table = lock(&self.table);
            due.into_iter()
                .filter(|(key, suspect)| {
                    let moved = table.superseded(key, suspect.token);
                    if moved {
                        auditor.stats.cleared.fetch_add(1, Relaxed);
                    }
                    !moved
                })
                .collect()
        };
        // The node's side first, then the source's: a write landing in
        // between shows in the stamp, and the suspect it may make clears.
        // (A value left unread, its fingerprint differing from the row's,
        // is read after the source's, but only if no write came since the
        // node's side was read: see `judge`.)
        let mut held = Vec::with_capacity(sweep.len());
        for (key, seen) in sweep {
            if let Some(entry) = self.held(&key, seen).await {
                held.push(((*key).clone(), entry));
            }
        }
        let asked: Vec<K> = due
            .iter()
            .map(|(k, _)| k.clone())
            .chain(held.iter().map(|(k, _)| k.clone()))
            .collect();
        // At most one read per batch ÷ rate, however few keys it asks for:
        // a cache smaller than a batch is not read over and over.
        let pace = audit.pace(audit.batch);
        if asked.is_empty() {
            self.audit_pending(auditor);
            return Some(pace);
        }
        auditor.stats.reads.fetch_add(1, Relaxed);
        // On a task of its own, so that a read that panics is a failed read
        // (not the end of the auditor), and one that outlives its timeout,
        // or a round dropped at shutdown, is stopped rather than left
        // running against the database.
        let read = Reading(tokio::spawn((audit.read)(asked.clone())));
        let answer = match tokio::time::timeout(audit.timeout, read).await {
            Ok(Ok(Ok(rows))) => answered(rows, &asked),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(e)) => Err(format!("the read panicked or was cancelled: {e}")),
            Err(_) => Err(format!("no answer within {:?}", audit.timeout)),
        };
        let mut rows = match answer {
            Ok(rows) => rows,
            Err(error) => {
                auditor.stats.read_failures.fetch_add(1, Relaxed);
                let mut state = lock(&auditor.state);
                // The suspects wait for the next read; the swept keys come
                // round again next sweep.
                state.suspects.extend(due);
                let wait = state.backoff.fail();
                drop(state);
                self.audit_pending(auditor);
                tracing::warn!(cache = %self.name, %error, retry_in = ?wait, "audit: reading the source failed");
                return Some(wait);
            }
        };
        lock(&auditor.state).backoff.reset();
        let mut checks = 0u64;
        for (key, entry) in held {
            let Some(row) = rows.remove(&key) else {
                auditor.stats.unverified.fetch_add(1, Relaxed);
                continue;
            };
            let (token, version) = (entry.token, entry.version);
            let Some(judged) = self.judge(auditor, &key, entry, row.as_ref()).await else {
                // Written, or gone, since the node's side was read: nothing
                // to judge; the key comes round again next sweep.
                continue;
            };
            match judged {
                Verdict::Agrees => checks = checks.saturating_add(1),
                Verdict::Unverified => {
                    auditor.stats.unverified.fetch_add(1, Relaxed);
                }
                Verdict::Behind => {
                    checks = checks.saturating_add(1);
                    auditor.stats.suspects.fetch_add(1, Relaxed);
                    lock(&auditor.state).suspects.insert(
                        key,
                        Suspect {
                            token,
                            observed: now,
                            version,
                        },
                    );
                }
            }
        }
        let mut behind = Vec::new();
        for (key, suspect) in due {
            let Some(row) = rows.remove(&key) else {
                // Not answered: it waits for the next read.
                lock(&auditor.state).suspects.insert(key, suspect);
                continue;
            };
            // Read as it is now: the sweep's fingerprint may be of a value
            // older than an install no stamp shows (an entry moka expired,
            // loaded again without a version). A `get`, which moka counts
            // as an access, but only for a suspect, once after each grace
            // window.
            let still = match self.held(&key, None).await {
                Some(entry) if !lock(&self.table).superseded(&key, suspect.token) => {
                    self.judge(auditor, &key, entry, row.as_ref()).await == Some(Verdict::Behind)
                }
                _ => false,
            };
            if still {
                behind.push((key, suspect, row.and_then(|(_, v)| v)));
            } else {
                auditor.stats.cleared.fetch_add(1, Relaxed);
            }
        }
        // Still behind past the grace window. Before it counts, the node
        // shows that its link delivers: a marker it publishes now on the
        // cache's route must come back through its own subscription, and
        // the node applies everything it read before the marker first. A
        // stalled link (a paused broker, a partition, a consumer held up)
        // that still looks ready does not return it, and the suspects
        // wait; so do they while event writes wait parked behind a load.
        let delivered = |inner: &Self| ready() && inner.parked_items.load(Relaxed) == 0;
        let confirmed = !behind.is_empty()
            && delivered(self)
            && round_trip(audit.timeout).await
            && delivered(self);
        let mut found = 0u64;
        for (key, suspect, source_version) in behind {
            if !confirmed {
                lock(&auditor.state).suspects.insert(key, suspect);
            } else if self
                .inconsistent(auditor, key, suspect, source_version)
                .await
            {
                found = found.saturating_add(1);
            } else {
                // Written while the marker travelled: the event it waited for.
                auditor.stats.cleared.fetch_add(1, Relaxed);
            }
        }
        lock(&auditor.state)
            .window
            .add(Instant::now(), checks, found);
        auditor.stats.checks.fetch_add(checks, Relaxed);
        self.audit_pending(auditor);
        Some(pace)
    }

    fn audit_pending(&self, auditor: &Auditor<K, V>) {
        let n = lock(&auditor.state).suspects.len() as u64;
        auditor.stats.pending.store(n, Relaxed);
    }
}

/// A source read on its task, aborted when dropped (a timeout, or a round
/// dropped when the node stops).
struct Reading<T>(tokio::task::JoinHandle<T>);

impl<T> Future for Reading<T> {
    type Output = Result<T, tokio::task::JoinError>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx)
    }
}

impl<T> Drop for Reading<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The source's answer by key, or why it is refused: a key it was not
/// asked for, or one answered twice, says the reply is not to be trusted.
fn answered<K: Hash + Eq, V>(
    rows: Rows<K, V>,
    asked: &[K],
) -> Result<HashMap<K, Option<Row<V>>>, String> {
    let asked: HashSet<&K> = asked.iter().collect();
    let mut out = HashMap::default();
    for (key, row) in rows {
        if !asked.contains(&key) {
            return Err("the source answered for a key it was not asked for".into());
        }
        if out.insert(key, row).is_some() {
            return Err("the source answered for a key twice".into());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_with_keys_not_asked_for_or_twice_is_refused() {
        let asked = vec![1u32, 2];
        assert!(answered::<u32, u8>(vec![(1, None), (3, None)], &asked).is_err());
        assert!(answered::<u32, u8>(vec![(1, None), (1, None)], &asked).is_err());
        let ok = answered::<u32, u8>(vec![(2, Some((7, Some(1))))], &asked).expect("answer");
        assert_eq!(ok.len(), 1);
    }
}
