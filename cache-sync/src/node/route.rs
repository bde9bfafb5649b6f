//! Routing each record: authenticate, read the header, pick the cache,
//! check the sequence, apply; and answer what cannot be read.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tracing::Instrument as _;

use super::seqs::{Missing, Prior, PublisherSeqs};
use super::{CacheMap, Shared};
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
        if let Some(missed) = seqs.observe_after(header.publisher, header.cache, header.seq, prior)
        {
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
                run.events.push(Event { header, change });
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
/// cache that has held every event since it was last emptied. Computed
/// only when the message carries an age; an age beyond the clock's reach
/// says nothing.
fn prior(
    ext: &HeaderExt,
    received: tokio::time::Instant,
    cache: &Arc<dyn CacheHandle>,
) -> Option<Prior> {
    let age = Duration::from_micros(ext.since_prev_us?);
    Some(Prior {
        sent_by: received.checked_sub(age)?,
        covered: cache.emptied_at(),
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

/// The `records` fuzz target (see `crate::fuzz`). The first byte picks
/// whether the node verifies signatures (bit 0), the size of its version
/// table (bits 1-3) and its event size limit (bits 4-5: 64 to 512 bytes,
/// small, so that oversized records are common); the rest is records, each a tag
/// (one length byte, 255 for none, then its bytes) and a payload (two length
/// bytes, little-endian, then its bytes).
///
/// Checked, whatever the bytes: nothing panics; every record is counted;
/// and on a verifying node, where no input can carry a valid signature,
/// nothing changes a cache: warm entries stay, and nothing is resynced.
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) fn fuzz_records(data: &[u8], ring: &crate::wire::Keyring) {
    use super::Node;
    use crate::cache::SyncedCache;

    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime for the fuzz target");
        // Made once: a new moka cache per input cost a millisecond or two,
        // most of the target's time. Registration empties them each time.
        static MOKA: (moka::future::Cache<String, String>, moka::future::Cache<u64, Vec<u8>>) =
            (moka::future::Cache::new(64), moka::future::Cache::new(64));
    }
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let mut records = Vec::new();
    while let Some((&tag_len, tail)) = rest.split_first() {
        let (tag, tail) = match tag_len {
            255 => (None, tail),
            n => {
                let n = usize::from(n).min(tail.len());
                let (tag, tail) = tail.split_at(n);
                (
                    Some(std::sync::Arc::from(String::from_utf8_lossy(tag))),
                    tail,
                )
            }
        };
        let (len, tail) = match tail {
            [a, b, tail @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), tail),
            _ => (0, &[][..]),
        };
        let (payload, tail) = tail.split_at(len.min(tail.len()));
        records.push(Record::new(tag, bytes::Bytes::copy_from_slice(payload)));
        rest = tail;
    }
    let verify = mode & 1 == 1;
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let (moka_a, moka_b) = MOKA.with(Clone::clone);
            let a: SyncedCache<String, String> = SyncedCache::builder("a", moka_a)
                // 0 is refused; the fuzz target keeps its 8 sizes as 1 to 8.
                .max_tracked_keys(usize::from((mode >> 1) & 7) + 1)
                .build()
                .expect("1 to 8 tracked keys are valid");
            let b: SyncedCache<u64, Vec<u8>> = SyncedCache::new("b", moka_b);
            let mut builder = Node::builder("fuzz", crate::EmbeddedTransport::new())
                .max_event_bytes(64 << ((mode >> 4) & 3))
                .register(&a)
                .register(&b);
            if verify {
                builder = builder.verify_signatures(ring.clone());
            }
            let (shared, caches) = builder.into_shared();
            for cache in caches {
                shared
                    .register(cache)
                    .await
                    .expect("two fresh caches register");
            }
            a.insert("warm".into(), "kept".into()).await;
            b.insert(7, vec![7]).await;
            let n = records.len() as u64;
            // The seeds hold records signed with the target's key, so that
            // the fuzzer reaches what comes after the check too; the promise
            // is checked on inputs where no record is authentic.
            let forged_only = records.iter().all(|r| ring.open(&r.payload).is_err());
            apply_records(&shared, &mut PublisherSeqs::default(), records).await;
            let s = &shared.stats;
            assert_eq!(s.received.load(Relaxed), n, "every record is counted");
            let refused = s
                .skipped
                .load(Relaxed)
                .saturating_add(s.rejected.load(Relaxed));
            assert!(refused <= n);
            if verify && forged_only {
                assert_eq!(refused, n, "an unsigned record got through");
                assert_eq!(a.peek("warm").await.as_deref(), Some("kept"));
                assert_eq!(b.peek(&7).await, Some(vec![7]));
                for c in [a.status(), b.status()] {
                    assert_eq!(
                        (c.loss_resyncs, c.rejected_events, c.events_applied),
                        (0, 0, 0),
                        "an unauthenticated record changed cache {}",
                        c.name
                    );
                }
            }
        });
    });
}
