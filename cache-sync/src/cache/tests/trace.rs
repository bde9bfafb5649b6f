//! `SyncedCache::trace`: what happened to a key, in order, within a cap.

use proptest::prelude::*;

use super::*;
use crate::status::{TraceEvent, TraceRecord};

fn traced(max_bytes: usize) -> Cache {
    SyncedCache::builder("t", moka::future::Cache::new(1000))
        .trace_bytes(max_bytes)
        .build()
        .expect("valid settings")
}

fn events(records: &[TraceRecord]) -> Vec<(TraceEvent, Option<u64>)> {
    records.iter().map(|r| (r.event, r.version)).collect()
}

/// The sequence: load, refresh, stale refresh, invalidation and
/// resync, in order, with each event's publisher; other keys' records stay
/// out of it.
#[tokio::test]
async fn a_key_through_load_refresh_stale_refresh_invalidation_and_resync() {
    let c = traced(1 << 20);
    c.get_with_versioned("k".into(), || async { ("v1".to_string(), 1) })
        .await;
    refresh(&c, "k", "v2", Some(2)).await;
    refresh(&c, "other", "x", Some(9)).await;
    refresh(&c, "k", "v1 late", Some(1)).await;
    invalidate(&c, "k", Some(3)).await;
    c.inner.resync().await;
    c.insert("k".into(), "local".into()).await;
    c.invalidate("k").await;
    let trace = c.trace("k");
    assert_eq!(
        events(&trace),
        [
            (TraceEvent::Loaded, Some(1)),
            (TraceEvent::Refreshed, Some(2)),
            (TraceEvent::StaleIgnored, Some(1)),
            (TraceEvent::Invalidated, Some(3)),
            (TraceEvent::Resynced, None),
            (TraceEvent::Inserted, None),
            (TraceEvent::Removed, None),
        ]
    );
    let refreshed = &trace[1];
    assert_eq!(
        (
            refreshed.origin.as_deref(),
            refreshed.publisher,
            refreshed.seq
        ),
        (Some("test"), Some(1), Some(1))
    );
    assert_eq!(
        (trace[0].origin.as_deref(), trace[0].publisher),
        (None, None)
    );
    assert!(trace.windows(2).all(|w| w[0].at_us <= w[1].at_us));
    assert_eq!(
        events(&c.trace("other")),
        [
            (TraceEvent::Refreshed, Some(9)),
            (TraceEvent::Resynced, None)
        ]
    );
}

#[tokio::test]
async fn loads_refused_and_overtaken_and_a_quarantined_refresh_are_traced() {
    let c = traced(1 << 20);
    refresh(&c, "k", "v5", Some(5)).await;
    c.get_fresh("k".into(), || async { ("v4".to_string(), 4) })
        .await;
    let (c2, _) = load_racing_with(async |c: &Cache| invalidate(c, "k", None).await).await;
    assert!(c2.trace("k").is_empty(), "off by default");
    c.inner
        .quarantine
        .lock()
        .unwrap()
        .clone_from(&Duration::from_secs(60));
    c.inner.resync().await;
    refresh(&c, "k", "v6", Some(6)).await;
    c.invalidate_all().await;
    assert_eq!(
        events(&c.trace("k")),
        [
            (TraceEvent::Refreshed, Some(5)),
            (TraceEvent::LoadStale, Some(4)),
            (TraceEvent::Resynced, None),
            (TraceEvent::Quarantined, Some(6)),
            (TraceEvent::Cleared, None),
        ]
    );
    let calls = AtomicUsize::new(0);
    let c = traced(1 << 20);
    c.get_with("k".to_string(), || async {
        if calls.fetch_add(1, Relaxed) == 0 {
            c.insert("k".into(), "local".into()).await;
        }
        "loaded".to_string()
    })
    .await;
    assert_eq!(
        events(&c.trace("k"))[..2],
        [
            (TraceEvent::Inserted, None),
            (TraceEvent::LoadSuperseded, None)
        ]
    );
}

/// A write parked behind a locked load shows twice: parked, with its
/// publisher, then what it did once applied.
#[tokio::test]
async fn a_parked_write_shows_parked_then_applied() {
    let c = SyncedCache::builder("t", moka::future::Cache::new(1000))
        .trace_bytes(1 << 20)
        .max_load_retries(0)
        .build()
        .unwrap();
    let (load, release) = parked_load(&c, "k", "loaded", true).await;
    refresh(&c, "k", "v7", Some(7)).await;
    release.send(()).unwrap();
    load.await.unwrap();
    crate::node::tests::eventually("the parked write applied", async || !c.inner.parked()).await;
    let trace = c.trace("k");
    let parked = trace
        .iter()
        .position(|r| r.event == TraceEvent::Parked)
        .expect("parked");
    assert_eq!(trace[parked].seq, Some(1));
    assert!(
        trace[parked + 1..]
            .iter()
            .any(|r| r.event == TraceEvent::Refreshed && r.version == Some(7) && r.seq.is_none()),
        "{trace:?}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever the cap and the keys (empty, unicode, huge), the trace
    /// holds at most its cap in bytes, keeps the newest records, and a
    /// record larger than the cap on its own is not kept.
    #[test]
    fn the_trace_keeps_within_its_cap_and_keeps_the_newest(
        cap in prop_oneof![Just(1usize), Just(1023), Just(1024), Just(1100), 0usize..8192, Just(1 << 20)],
        keys in proptest::collection::vec(
            prop_oneof![Just(String::new()), "\\PC{0,8}", "[a-z.*>: ]{0,300}"],
            1..40,
        ),
    ) {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
            if (1..1024).contains(&cap) {
                let refused = SyncedCache::<String, String>::builder("t", moka::future::Cache::new(10))
                    .trace_bytes(cap)
                    .build();
                prop_assert!(refused.is_err_and(|e| e.is_config()));
                return Ok(());
            }
            let c = traced(cap);
            for (i, k) in keys.iter().enumerate() {
                refresh(&c, k, "v", Some(i as u64 + 1)).await;
            }
            let Some(trace) = &c.inner.trace else {
                prop_assert_eq!(cap, 0, "a cap above 0 turns tracing on");
                prop_assert!(c.trace(&keys[0]).is_empty());
                return Ok(());
            };
            prop_assert!(trace.bytes() <= cap);
            let last = keys.last().unwrap();
            let newest = c.trace(last);
            // The last record fits if any record of its size does.
            let size = trace.record_bytes(last, "test");
            // The key's heap bytes count, not only its inline size.
            let encoded = crate::wire::encode_part(last, "k").unwrap().len();
            prop_assert!(size >= encoded + "test".len() + std::mem::size_of::<String>());
            if size <= cap {
                prop_assert_eq!(newest.last().map(|r| r.version), Some(Some(keys.len() as u64)));
            } else {
                prop_assert!(newest.iter().all(|r| r.version != Some(keys.len() as u64)));
            }
            Ok(())
        })?;
    }
}
