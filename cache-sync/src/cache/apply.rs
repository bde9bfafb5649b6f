//! Applying events: the type-erased face a node sees of each cache.

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{
    Ordering::AcqRel, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
use std::time::Duration;

use async_trait::async_trait;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::coalesce::{Superseded, entries_of};
use super::park::{Item, Op};
use super::stats::LatencyHistogram;
use super::{Housekeeper, Inner};
use crate::status::{CacheStatus, KeyState, TraceEvent, TraceRecord};
use crate::util::{lock, now_us};
use crate::wire::{ChangeView, Header, decode_part};

/// One event for a cache: its header, and its change, read and checked.
#[derive(Debug)]
pub(crate) struct Event<'a> {
    pub(crate) header: Header<'a>,
    pub(crate) change: ChangeView<'a>,
    /// Numbered at or below its publisher's last for the cache (a
    /// redelivery, a replay, an event that changed queue): its refreshes
    /// are never installed (see `Op::Late`).
    pub(crate) late: bool,
}

impl Event<'_> {
    /// The versions the event names, for a tracing span.
    pub(crate) fn versions(&self) -> impl Iterator<Item = u64> + '_ {
        let (items, clear) = match &self.change {
            ChangeView::Invalidate(items) | ChangeView::Refresh(items) => {
                (Some(items.clone()), None)
            }
            ChangeView::Clear { version } => (None, *version),
            ChangeView::Announce => (None, None),
        };
        items
            .into_iter()
            .flatten()
            .filter_map(|i| i.version)
            .chain(clear)
    }
}

/// What the consumer needs from a registered cache, without its types.
#[async_trait]
pub(crate) trait CacheHandle: Send + Sync {
    fn name(&self) -> &str;
    /// The topic its table is pinned to, if any.
    fn topic(&self) -> Option<&'static str>;
    /// Claims the cache for the node with token `owner` (never 0), whose
    /// reorder window sets how long each quarantine lasts. False if another
    /// node holds it.
    /// Claims the cache for the node `owner`, whose freshness `proof`
    /// the cache's staleness bound, if any, holds its reads to.
    fn claim(
        &self,
        owner: u64,
        reorder_window: Duration,
        housekeeper: Arc<Housekeeper>,
        proof: &crate::util::Moment,
    ) -> bool;
    /// The node `owner` proved everything acknowledged before `at`
    /// applied (see the node's `freshness.rs`): a staleness bound's proof
    /// moves forward, if that node holds the cache.
    fn proved(&self, owner: u64, at: tokio::time::Instant);
    /// A CDC relay's report, taken when the node's proof was `proof` (see
    /// the node's `route.rs` and `bound::Sources::report`), if the node
    /// `owner` holds the cache.
    fn relay_reported(
        &self,
        owner: u64,
        mark: &crate::wire::Watermark,
        proof: tokio::time::Instant,
    );
    /// How fresh the cache is, given its node's proof's age: see
    /// `bound::Sources::age`.
    fn freshness_age(&self, node_proof: Option<Duration>) -> Option<Duration>;
    /// Gives the cache up, if `owner` holds it, so another node may claim it.
    fn release(&self, owner: u64);
    /// Applies events, in order. Undecodable keys or values are answered
    /// here (invalidation or a resync), counted, and logged. One call per
    /// run of events for the cache, so the boxed future that a dynamic
    /// async call costs is paid per run, not per event.
    async fn apply(&self, events: &[Event<'_>]);
    /// Whether any event write of this cache waits for a pinned load of its
    /// key: parked by `apply` (which returned without waiting) and not yet
    /// applied, in order, by the key's drainer, nor dropped by a clear
    /// after it. While true, an event `apply` returned from may not be in
    /// the cache yet, so it must not be reported as applied. Only event
    /// writes count; local writes waiting for a pin are not events.
    fn parked(&self) -> bool;
    /// Drops everything, because events may have been lost, and quarantines.
    async fn resync(&self);
    /// Drops everything (on registration; not counted as a loss).
    async fn reset(&self);
    /// For one reorder window from now, applies versioned refreshes as
    /// invalidations: a refresh delivered now may be older than an event for
    /// its key that this cache never saw (lost, or published before the node
    /// subscribed), when two writers publish in another order than they
    /// committed. Only the source of truth can tell, so the entry is dropped
    /// and the next read loads it.
    fn quarantine(&self);
    async fn reject(&self, reason: &str);
    /// Lets moka finish pending bookkeeping, so `entries` is current.
    async fn settle(&self);
    /// When the cache was last emptied (registered, resynced, cleared):
    /// every change sent by then is reflected in it.
    fn emptied_at(&self) -> tokio::time::Instant;
    /// When the cache was last registered (reset for it): before then the
    /// node was not keeping its events.
    fn registered_at(&self) -> tokio::time::Instant;
    fn status(&self) -> CacheStatus;
    /// Whether versioned refreshes are quarantined now (the status's
    /// `quarantined`, without the rest of the snapshot).
    fn is_quarantined(&self) -> bool;
    /// Whether the cache's staleness bound is past now, so that its reads
    /// go to the source (false without a bound, and for one that serves
    /// past it).
    fn is_past_bound(&self) -> bool;
    /// The trace of the key `key` names (JSON for the key, or else the
    /// text itself as a JSON string would give it), for the trace route;
    /// `None` while tracing is off, and an error for a key that is neither.
    fn trace_of(&self, key: &str) -> Result<Option<Vec<TraceRecord>>, String>;
    /// What the cache holds for the key `key` names (as for `trace_of`),
    /// for a key probe; an unreadable key is said in the state's `error`.
    async fn probe(&self, key: &str) -> KeyState;
    /// Its publish-to-applied latency histogram, for `GET /metrics`.
    fn latency(&self) -> LatencyHistogram;
    /// If the cache is audited, how long to wait before its first round.
    fn audit_first_wait(&self) -> Option<Duration>;
    /// One round of the cache's auditor (see `audit/`), with the grace
    /// window the node gives by default, the last time the node was not
    /// ready, a check that it is ready now, and the node's round trip on
    /// the cache's route; returns how long to wait before the next, or
    /// `None` when the cache is not audited.
    async fn audit_round(
        &self,
        default_grace: Duration,
        settled_since: tokio::time::Instant,
        ready: &(dyn Fn() -> bool + Send + Sync),
        round_trip: super::RoundTrip<'_>,
    ) -> Option<Duration>;
}

#[async_trait]
impl<K, V> CacheHandle for Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    V: Clone + Send + Sync + DeserializeOwned + 'static,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn topic(&self) -> Option<&'static str> {
        self.topic
    }

    fn claim(
        &self,
        owner: u64,
        reorder_window: Duration,
        housekeeper: Arc<Housekeeper>,
        proof: &crate::util::Moment,
    ) -> bool {
        if self
            .owner
            .compare_exchange(0, owner, AcqRel, Acquire)
            .is_err()
        {
            return false;
        }
        *lock(&self.quarantine) = reorder_window;
        *lock(&self.housekeeper) = Some(housekeeper);
        self.prove_with(Some(proof));
        true
    }

    fn proved(&self, owner: u64, at: tokio::time::Instant) {
        Inner::proved(self, owner, at);
    }

    fn relay_reported(
        &self,
        owner: u64,
        mark: &crate::wire::Watermark,
        proof: tokio::time::Instant,
    ) {
        Inner::relay_reported(self, owner, mark, proof);
    }

    fn freshness_age(&self, node_proof: Option<Duration>) -> Option<Duration> {
        Inner::freshness_age(self, node_proof)
    }

    fn release(&self, owner: u64) {
        // Only the claimant's release counts: a node that shut down, and
        // whose cache another node claimed since, must not free it again.
        if self
            .owner
            .compare_exchange(owner, 0, AcqRel, Acquire)
            .is_ok()
        {
            *lock(&self.housekeeper) = None;
            self.prove_with(None);
        }
    }

    async fn apply(&self, events: &[Event<'_>]) {
        let mut applied = 0u64;
        let mut published_at_us = None;
        let version_before = self.stats.version.load(Relaxed);
        // Read once per run, and again after a resync within it, which is
        // the only way a quarantine can start while this cache applies.
        let mut quarantined = self.quarantined();
        // The trace's records of a run share one time, read once, as below.
        let at_us = if self.trace.is_some() { now_us() } else { 0 };
        // A backlog's refreshes that the run itself overrides (see
        // `coalesce.rs`); with tracing on, every entry is applied, so the
        // trace tells each one.
        let superseded = if self.trace.is_none() {
            Superseded::of(events)
        } else {
            Superseded::default()
        };
        // The run's position of each event's first entry, as `Superseded`
        // numbers them.
        let mut first_entry = 0usize;
        // Each event has spent a unit of the consumer's cooperative budget
        // already, as it was read (`node/route.rs`); `apply_one` spends one
        // per further entry.
        for event in events {
            let skip = superseded.any().then_some((&superseded, first_entry));
            if superseded.any() {
                first_entry = first_entry.saturating_add(entries_of(event));
            }
            if self.apply_one(event, quarantined, at_us, skip).await {
                applied = applied.saturating_add(1);
                published_at_us = Some(event.header.published_at_us);
            } else {
                quarantined = self.quarantined();
            }
        }
        // Once per run: the clock read costs more than the rest of the
        // bookkeeping, and the run's last event is the one a reader waits for.
        let s = &self.stats;
        if let Some(published_at_us) = published_at_us {
            let now = now_us();
            s.last_applied_us.store(now, Relaxed);
            let latency_us = now.saturating_sub(published_at_us);
            s.last_latency_us.store(latency_us, Relaxed);
            s.latency.observe_us(latency_us);
            if s.version.load(Relaxed) > version_before {
                s.version_at_us.store(now, Relaxed);
            }
            // Last, and with Release (read with Acquire): a poller that sees
            // the new count also sees these events' time and latency.
            s.events_applied.fetch_add(applied, Release);
        }
    }

    fn parked(&self) -> bool {
        // Acquire: pairs with the Release of the drainer's count, made
        // after its write, so a caller that sees 0 sees the writes too.
        self.parked_items.load(Acquire) != 0
    }

    async fn resync(&self) {
        self.quarantine();
        self.clear(None).await;
        self.stats.loss_resyncs.fetch_add(1, Relaxed);
        if let Some(trace) = &self.trace {
            trace.record(None, TraceEvent::Resynced, None, None, now_us());
        }
    }

    async fn reset(&self) {
        *lock(&self.registered_at) = tokio::time::Instant::now();
        self.clear(None).await;
        if let Some(trace) = &self.trace {
            trace.record(None, TraceEvent::Cleared, None, None, now_us());
        }
    }

    fn quarantine(&self) {
        // A window too long for the clock (`Duration::MAX`) lasts for good.
        let until = crate::util::deadline_after(*lock(&self.quarantine));
        let mut q = lock(&self.quarantine_until);
        *q = Some(q.map_or(until, |old| old.max(until)));
    }

    async fn reject(&self, reason: &str) {
        self.stats.rejected_events.fetch_add(1, Relaxed);
        tracing::warn!(cache = %self.name, %reason, "unreadable event for this cache; invalidating it all, since it may have carried a change");
        self.resync().await;
    }

    async fn settle(&self) {
        self.cache.run_pending_tasks().await;
    }

    fn emptied_at(&self) -> tokio::time::Instant {
        *lock(&self.emptied_at)
    }

    fn registered_at(&self) -> tokio::time::Instant {
        *lock(&self.registered_at)
    }

    fn trace_of(&self, key: &str) -> Result<Option<Vec<TraceRecord>>, String> {
        let key = parse_key::<K>(key)?;
        Ok(self.trace.as_ref().map(|trace| trace.of(&key)))
    }

    async fn probe(&self, key: &str) -> KeyState {
        let mut state = KeyState {
            held: false,
            version: None,
            quarantined: self.quarantined(),
            trace: Vec::new(),
            error: None,
        };
        let key = match parse_key::<K>(key) {
            Ok(key) => key,
            Err(e) => {
                state.error = Some(e);
                return state;
            }
        };
        {
            // Under the key's stripe: the value and the version of one write.
            let _stripe = self.write_locks[self.stripe(&key)].lock().await;
            state.held = self.cache.contains_key(&key);
            state.version = lock(&self.table).exact_version(&key);
        }
        // After the stripe: a scan of the ring must hold up no write.
        if let Some(trace) = &self.trace {
            state.trace = trace.last_of(&key, PROBE_TRACE, PROBE_ORIGIN_BYTES);
        }
        state
    }

    fn is_past_bound(&self) -> bool {
        self.bound
            .as_ref()
            .is_some_and(|b| !b.serve && b.age(&self.sources).1)
    }

    fn is_quarantined(&self) -> bool {
        self.quarantined()
    }

    fn status(&self) -> CacheStatus {
        self.snapshot()
    }

    fn audit_first_wait(&self) -> Option<Duration> {
        let audit = &self.audit.as_ref()?.audit;
        Some(super::first_wait(audit.rate, audit.batch))
    }

    async fn audit_round(
        &self,
        default_grace: Duration,
        settled_since: tokio::time::Instant,
        ready: &(dyn Fn() -> bool + Send + Sync),
        round_trip: super::RoundTrip<'_>,
    ) -> Option<Duration> {
        Inner::audit_round(self, default_grace, settled_since, ready, round_trip).await
    }

    fn latency(&self) -> LatencyHistogram {
        self.stats.latency.clone()
    }
}

impl<K, V> Inner<K, V>
where
    K: Hash + Eq + Clone + Send + Sync + Serialize + DeserializeOwned + 'static,
    V: Clone + Send + Sync + DeserializeOwned + 'static,
{
    /// Applies one event; false if it was answered by a resync instead.
    /// With `skip`, the run's overridden entries and the position of this
    /// event's first entry among them: those entries are counted as
    /// coalesced, not applied.
    async fn apply_one(
        &self,
        event: &Event<'_>,
        quarantined: bool,
        at_us: u64,
        skip: Option<(&Superseded, usize)>,
    ) -> bool {
        let s = &self.stats;
        let header = &event.header;
        // Raised only once the change is in the cache, so a node never reports
        // a version next to an older value.
        let mut version = None;
        match &event.change {
            ChangeView::Clear { version: v } => {
                self.clear(*v).await;
                s.clears.fetch_add(1, Relaxed);
                if let Some(trace) = &self.trace {
                    trace.record(None, TraceEvent::Cleared, *v, Some(header), at_us);
                }
                version = *v;
            }
            // The node answers announcements itself; one reaching a cache
            // would name no entry.
            ChangeView::Announce => {}
            // Keys are decoded and applied one at a time, with nothing
            // collected. A key that does not decode means the event cannot
            // say which entries it meant: the whole cache is resynced, which
            // also drops whatever the event's earlier items changed.
            ChangeView::Invalidate(items) | ChangeView::Refresh(items) => {
                let refresh = matches!(event.change, ChangeView::Refresh(_));
                for (i, item) in items.clone().enumerate() {
                    // An event can carry 10,000 entries: one unit of work
                    // (`util::pace`) for each after the first (which the
                    // event's own unit covers), so applying it never holds
                    // the worker for more than some 128 entries or a slice
                    // at a time; a one-entry event pays nothing more.
                    if i > 0 {
                        crate::util::pace().await;
                    }
                    if let Some((superseded, first)) = skip
                        && superseded.contains(first.saturating_add(i))
                    {
                        s.coalesced.fetch_add(1, Relaxed);
                        continue;
                    }
                    let k = match decode_part::<K>(item.key, "key") {
                        Ok(k) => k,
                        Err(e) => {
                            self.reject_and_resync(header, &e.to_string()).await;
                            return false;
                        }
                    };
                    let op = if !refresh {
                        Op::Invalidate
                    } else if event.late {
                        // Its value is never installed: not read either.
                        match item.version {
                            Some(_) => Op::Late,
                            None => Op::Invalidate,
                        }
                    } else {
                        match decode_part::<V>(item.value, "value") {
                            Ok(_) if quarantined && item.version.is_some() => Op::Quarantined,
                            Ok(v) => Op::Refresh(v),
                            Err(err) => {
                                // Never drop a failed refresh: the old value would stay.
                                tracing::warn!(
                                    cache = %self.name, origin = %header.origin, seq = header.seq,
                                    reason = %err, "refresh value did not decode; invalidating the key instead"
                                );
                                s.rejected_events.fetch_add(1, Relaxed);
                                s.refresh_fallbacks.fetch_add(1, Relaxed);
                                Op::Invalidate
                            }
                        }
                    };
                    let v = item.version;
                    let traced = self.trace.as_ref().map(|_| k.clone());
                    let done = self.apply_item(k, Item { op, version: v }).await;
                    // A parked item raises the version once it is applied.
                    if done.is_some() {
                        version = version.max(v);
                    }
                    if let (Some(trace), Some(k)) = (&self.trace, traced) {
                        let done = done.unwrap_or(TraceEvent::Parked);
                        trace.record(Some(k), done, v, Some(header), at_us);
                    }
                }
            }
        }
        if let Some(v) = version {
            s.version.fetch_max(v, Relaxed);
        }
        true
    }

    async fn reject_and_resync(&self, header: &Header<'_>, reason: &str) {
        tracing::warn!(cache = %self.name, origin = %header.origin, seq = header.seq, %reason,
            "event key did not decode; cannot tell which entries it meant");
        self.stats.rejected_events.fetch_add(1, Relaxed);
        self.resync().await;
    }
}

/// A key's last trace records a probe answer carries.
const PROBE_TRACE: usize = 16;
/// The most bytes of a publisher's origin each of them carries, so an
/// answer stays far below the heartbeat channel's size limit.
const PROBE_ORIGIN_BYTES: usize = 64;

/// A key as the trace route and probes give it: JSON, or else the text
/// itself for a key that deserializes from a string.
fn parse_key<K: DeserializeOwned>(key: &str) -> Result<K, String> {
    serde_json::from_str::<K>(key)
        .or_else(|_| K::deserialize(serde_json::Value::String(key.to_owned())))
        .map_err(|e| format!("the key is not one of this cache's: {e}"))
}
