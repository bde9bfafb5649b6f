//! Routing each record: authenticate, read the header, pick the cache,
//! check the sequence, apply; and answer what cannot be read.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tracing::Instrument as _;

use super::Shared;
use super::registry::CacheMap;
use super::seqs::{Missing, Prior, PublisherSeqs};
use crate::cache::{CacheHandle, Event};
use crate::transport::{LossReason, Record};
use crate::util::{deadline_after, now_us};
use crate::wire::{ChangeView, Header, HeaderExt, Refused};

pub(super) async fn apply_records(shared: &Shared, seqs: &mut PublisherSeqs, records: Vec<Record>) {
    // Every record here was published before this snapshot, so a cache
    // registered after it has nothing in this batch that its own reset and
    // first loads would not already reflect.
    let caches = shared.caches();
    // When the batch arrived, for the ages messages carry (see `Prior`):
    // one clock read per batch.
    let received = tokio::time::Instant::now();
    let mut run = Run::default();
    let mut last: Option<(&str, &Arc<dyn CacheHandle>)> = None;
    for record in &records {
        // Authenticating and reading a record costs microseconds, and a
        // batch can hold thousands: a unit of work each (and more in
        // `apply`), so the consumer yields its worker at least every 128,
        // and lets the runtime's driver run every slice (`util::pace`).
        crate::util::pace().await;
        shared.stats.received.fetch_add(1, Relaxed);
        // Tag filter: skip other caches' events without reading them. The
        // tag is not authenticated, but skipping changes nothing.
        let tagged = match record.tag.as_deref() {
            // Runs of one cache's events are the rule: compare the tag
            // with the last one before hashing it.
            Some(tag) => match last.filter(|(t, _)| *t == tag).map(|(_, c)| c) {
                Some(c) => Some(c),
                None => match caches.get(tag) {
                    Some(c) => {
                        last = Some((tag, c));
                        Some(c)
                    }
                    None => {
                        shared.stats.skipped.fetch_add(1, Relaxed);
                        continue;
                    }
                },
            },
            None => None,
        };
        // Authentication comes before anything that could change state,
        // the size check and the tag's cache included: what fails it may
        // only bump a counter, or forgeries could flush caches at will.
        let opened = match shared.codec.open(&record.payload, tagged.map(|c| c.name())) {
            Ok(opened) => opened,
            Err(Refused::Unauthentic(e)) => {
                reject(shared, record, &e.to_string(), e.kind().label());
                continue;
            }
            // Authentic, or the node does not ask: an unreadable event may
            // have carried a change.
            Err(Refused::Unreadable { error, event }) => {
                reject(shared, record, &error.to_string(), error.kind().label());
                run.flush().await;
                let header = shared.codec.salvage_header(event);
                unreadable(shared, seqs, &caches, tagged, header, &error.to_string()).await;
                continue;
            }
        };
        let header = opened.header;
        // The tag nearly always names the header's cache: a comparison
        // then saves hashing the name again.
        let cache = match tagged {
            // The same &str when the tag named the header's cache.
            Some(c) if std::ptr::eq(c.name(), header.cache) || c.name() == header.cache => c,
            _ => match caches.get(header.cache) {
                Some(c) => c,
                None => {
                    shared.stats.skipped.fetch_add(1, Relaxed);
                    continue;
                }
            },
        };
        let mut change = opened.change();
        let prior = || prior(&opened.ext, received, cache);
        if let Ok(ChangeView::Announce) = change {
            if header.seq == 0 && header.publisher == shared.markers.id {
                // One of this node's auditor markers, back (`audit.rs`):
                // what came before it in this batch is applied first, since
                // its return says exactly that.
                run.flush().await;
                shared
                    .markers
                    .returned(header.cache, header.published_at_us);
            }
            if let Some(mark) = opened.ext.watermark
                && let Some(proof) = shared.freshness.proof.get()
                && seqs.applied(header.publisher, header.cache).unwrap_or(0) >= header.seq
            {
                // A CDC relay's report. It was published after the tail
                // this node last reached was read (it is applied after that
                // tail, on a topic read in order), so its acknowledgement
                // came after the moment the node asked for that tail, its
                // proof: the next report says how long after its mark that
                // acknowledgement was (see `bound::Sources::report`).
                // Taken only with every event of its publisher it vouches
                // for applied (its number reached: an event that moved
                // queue could still be on its way), and only with a proof:
                // without one the node is replaying what was published
                // before it started, reports of relays that may be gone
                // for good. What came before it in this batch may be what
                // it vouches for: applied first.
                run.flush().await;
                cache.relay_reported(shared.token, &mark, proof);
            }
            // Authentic (or the node does not verify), like every event:
            // a forged announcement is refused above and changes nothing.
            let deadline = deadline_after(shared.config.reorder_window);
            if let Some(missing) =
                seqs.announced_after(header.publisher, header.cache, header.seq, deadline, prior)
            {
                run.flush().await;
                tail_lost(shared, seqs, cache, &missing).await;
            }
            continue;
        }
        if let Some(fence) = opened.ext.fence
            && seqs.fences.fenced(header.cache, fence)
        {
            // From an outbox relay that was replaced (its session died
            // while it published): what it sends now may be older than
            // what its successor already sent. Removal is never stale, so
            // its refreshes land as invalidations of their keys.
            shared.stats.fenced.fetch_add(1, Relaxed);
            tracing::warn!(node = %shared.id, cache = %header.cache, origin = %header.origin,
                term = fence.term, "event from a replaced outbox relay; applying it as an invalidation");
            if let Ok(ChangeView::Refresh(items)) = change {
                change = Ok(ChangeView::Invalidate(items));
            }
        }
        let observed = seqs.observe_late(header.publisher, header.cache, header.seq, prior);
        if observed.late {
            // Late: its publisher's later events for this cache came first
            // (a redelivery, a replay, or a publisher whose events moved to
            // another queue when a broker failed, read from the old one
            // after the new). A gap may have resynced the cache meanwhile,
            // and a value loaded since without a version may be newer than
            // the key's record says, so its refreshes are never installed:
            // an unversioned one lands as an invalidation, a versioned one
            // is ignored if the record already has its version (a replay
            // changes nothing) and lands as an invalidation otherwise (see
            // `Op::Late`).
            shared.stats.late.fetch_add(1, Relaxed);
            tracing::debug!(node = %shared.id, cache = %header.cache, origin = %header.origin,
                publisher = header.publisher, seq = header.seq,
                "event at or below its publisher's last number; its refreshes are not installed");
        }
        if let Some(missed) = observed.missed {
            shared.stats.publisher_gaps.fetch_add(1, Relaxed);
            shared.record_loss(LossReason::PublisherGap);
            tracing::warn!(node = %shared.id, cache = %header.cache, origin = %header.origin,
                publisher = header.publisher, seq = header.seq, missed,
                "gap in a publisher's sequence; invalidating that cache");
            // Sequence numbers run per (publisher, cache): only this cache
            // can have missed anything. What came before the gap goes first.
            run.flush().await;
            cache.resync().await;
            seqs.resynced(header.cache);
        }
        match change {
            Ok(change) => {
                if run.switches_from(cache) {
                    run.flush().await;
                }
                // Built in place: an event is some 150 bytes, and every
                // move through an async call is a copy.
                run.cache = Some(cache);
                run.events.push(Event {
                    header,
                    change,
                    late: observed.late,
                });
            }
            Err(e) => {
                reject(shared, record, &e.to_string(), e.kind().label());
                run.flush().await;
                cache.reject(&e.to_string()).await;
                seqs.resynced(header.cache);
            }
        }
    }
    run.flush().await;
}

/// What a message says of its publisher's previous event, on this node's
/// clock: sent by `received` less the age the publisher measured, into a
/// cache registered and last emptied when it says. Computed only when the
/// message carries an age; an age beyond the clock's reach says nothing.
fn prior(
    ext: &HeaderExt,
    received: tokio::time::Instant,
    cache: &Arc<dyn CacheHandle>,
) -> Option<Prior> {
    let age = Duration::from_micros(ext.since_prev_us?);
    Some(Prior {
        sent_by: received.checked_sub(age)?,
        registered: cache.registered_at(),
        emptied: cache.emptied_at(),
    })
}

/// Answers the announcement checks that fell due: their events did not
/// arrive within the reorder window.
pub(super) async fn expire_checks(shared: &Shared, seqs: &mut PublisherSeqs) {
    let now = tokio::time::Instant::now();
    while let Some(missing) = seqs.due(now) {
        if let Some(cache) = shared.cache(&missing.cache) {
            tail_lost(shared, seqs, &cache, &missing).await;
        }
    }
}

/// A publisher announced numbers this node never saw: the events are lost,
/// and only this cache can have missed them. Counted as a publisher gap.
async fn tail_lost(
    shared: &Shared,
    seqs: &mut PublisherSeqs,
    cache: &Arc<dyn CacheHandle>,
    missing: &Missing,
) {
    shared.stats.publisher_gaps.fetch_add(1, Relaxed);
    shared.record_loss(LossReason::PublisherGap);
    tracing::warn!(node = %shared.id, cache = %missing.cache, publisher = missing.publisher,
        from = missing.from, to = missing.to,
        "a publisher announced sequence numbers this node never received; invalidating that cache");
    cache.resync().await;
    seqs.resynced(&missing.cache);
}

/// Consecutive events for one cache, applied with one call: a node's
/// batch is usually one cache's events, and each call to a cache costs a
/// boxed future. Anything else that changes a cache (a resync, a reject)
/// flushes the run first, so effects keep the records' order.
#[derive(Default)]
struct Run<'c, 'e> {
    cache: Option<&'c Arc<dyn CacheHandle>>,
    events: Vec<Event<'e>>,
}

impl<'c, 'e> Run<'c, 'e> {
    /// Whether an event for `cache` must wait for this run to be applied.
    fn switches_from(&self, cache: &Arc<dyn CacheHandle>) -> bool {
        self.cache.is_some_and(|c| !Arc::ptr_eq(c, cache))
    }

    async fn flush(&mut self) {
        if let Some(cache) = self.cache.take()
            && !self.events.is_empty()
        {
            // One span per applied run of events, for tracing subscribers
            // (an OpenTelemetry exporter among them). At debug level: an
            // application logging at info pays nothing for it. Its fields
            // cost a walk over the events, paid only when a subscriber
            // enables it.
            let span = tracing::debug_span!(
                "cache_sync.apply",
                cache = cache.name(),
                events = self.events.len(),
                version.min = tracing::field::Empty,
                version.max = tracing::field::Empty,
                latency_us = tracing::field::Empty,
            );
            if span.is_disabled() {
                cache.apply(&self.events).await;
            } else {
                let versions = self.events.iter().flat_map(|e| e.versions());
                let (min, max) = versions.fold((None, None), |(lo, hi), v| {
                    (
                        Some(lo.map_or(v, |l: u64| l.min(v))),
                        Some(hi.map_or(v, |h: u64| h.max(v))),
                    )
                });
                if let (Some(lo), Some(hi)) = (min, max) {
                    span.record("version.min", lo);
                    span.record("version.max", hi);
                }
                cache.apply(&self.events).instrument(span.clone()).await;
                if let Some(last) = self.events.last() {
                    span.record(
                        "latency_us",
                        now_us().saturating_sub(last.header.published_at_us),
                    );
                }
            }
        }
        self.events.clear();
    }
}

/// An event that is authentic (or the node does not verify) but cannot be
/// applied: the cache it was meant for may have missed a change. The
/// event's header names that cache (read from the front of an oversized
/// payload; on a verifying node it is signed, unlike the tag), or else the
/// transport's tag; an event that names no cache at all may have been for
/// any of them (a Pub/Sub message carries no tag, and a publisher of a
/// newer format writes a header this node cannot read).
pub(super) async fn unreadable(
    shared: &Shared,
    seqs: &mut PublisherSeqs,
    caches: &CacheMap,
    tagged: Option<&Arc<dyn CacheHandle>>,
    header: Option<Header<'_>>,
    reason: &str,
) {
    if let Some(h) = &header
        && let Some(cache) = caches.get(h.cache)
    {
        // Its number is used up: the next one is no gap.
        let _ = seqs.observe(h.publisher, h.cache, h.seq);
        cache.reject(reason).await;
        seqs.resynced(h.cache);
    } else if let Some(cache) = tagged {
        cache.reject(reason).await;
        seqs.resynced(cache.name());
    } else if header.is_none() {
        shared.resync_all(LossReason::Unreadable, None).await;
        for cache in caches.keys() {
            seqs.resynced(cache);
        }
    }
}

pub(super) fn reject(shared: &Shared, record: &Record, reason: &str, label: &str) {
    shared.stats.rejected.fetch_add(1, Relaxed);
    tracing::warn!(node = %shared.id, tag = ?record.tag, offset = ?record.offset, bytes = record.payload.len(),
        kind = label, %reason, "rejected an event");
}

/// A node with no transport and no tasks, fed raw records as its consume
/// task would be: the hook of the `records` fuzz target
/// (`crate::fuzz::records`, where the harness and its checks are).
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) struct RawNode(Arc<Shared>);

#[cfg(any(test, feature = "_fuzz"))]
impl RawNode {
    /// Builds the node and registers its caches (which empties them).
    pub(crate) async fn new(builder: super::NodeBuilder) -> Self {
        let (shared, caches) = builder.into_shared();
        for cache in caches {
            shared.register(cache).await.expect("fresh caches register");
        }
        Self(shared)
    }

    /// Applies `records`; returns how many records the node has counted as
    /// received, and how many it refused (skipped or rejected).
    pub(crate) async fn apply(&self, records: Vec<Record>) -> (u64, u64) {
        apply_records(&self.0, &mut PublisherSeqs::default(), records).await;
        let s = &self.0.stats;
        let refused = s
            .skipped
            .load(Relaxed)
            .saturating_add(s.rejected.load(Relaxed));
        (s.received.load(Relaxed), refused)
    }
}
