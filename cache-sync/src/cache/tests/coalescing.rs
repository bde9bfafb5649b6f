//! Issue 36, item 3: a backlog's refreshes that the same run overrides are
//! skipped, and the cache ends as if every one had been applied.

use proptest::prelude::*;

use super::*;

/// One event of a run, before encoding.
#[derive(Debug, Clone)]
enum Ev {
    Refresh(u8, u16, Option<u64>),
    Invalidate(u8, Option<u64>),
    Clear,
    /// A refresh of keys `k0`..`k39`, unversioned, all to one value.
    Wide(u16),
}

fn change_of(ev: &Ev) -> Change {
    match ev {
        Ev::Refresh(k, v, version) => Change::Refresh {
            entries: vec![EntryVersion {
                key: b(&format!("k{k}")),
                value: b(&format!("v{v}")),
                version: *version,
            }],
        },
        Ev::Invalidate(k, version) => Change::Invalidate {
            keys: vec![KeyVersion {
                key: b(&format!("k{k}")),
                version: *version,
            }],
        },
        Ev::Clear => Change::Clear { version: None },
        Ev::Wide(v) => Change::Refresh {
            entries: (0..40)
                .map(|k| EntryVersion {
                    key: b(&format!("k{k}")),
                    value: b(&format!("v{v}")),
                    version: None,
                })
                .collect(),
        },
    }
}

/// Applies `run` (each event with its late flag) as one run, as a node
/// applies a backlog it read at once.
async fn apply_run(c: &Cache, run: &[(Ev, bool)]) {
    let encoded: Vec<Vec<u8>> = run
        .iter()
        .map(|(ev, _)| encode(&header(), &change_of(ev)).unwrap())
        .collect();
    let events: Vec<Event<'_>> = encoded
        .iter()
        .zip(run)
        .map(|(bytes, (_, late))| {
            let (header, offset) = crate::wire::decode_header(bytes, 1 << 20).unwrap();
            Event {
                header,
                change: crate::wire::decode_change(bytes, offset).unwrap(),
                late: *late,
            }
        })
        .collect();
    c.inner.apply(&events).await;
}

/// What a cache holds for keys `k0`..`k15`: each one's value and the
/// version its record knows.
async fn contents(c: &Cache) -> Vec<(Option<String>, Option<u64>)> {
    let mut out = Vec::new();
    for k in 0..16u8 {
        let key = format!("k{k}");
        let value = c.peek(&key).await;
        let version = lock(&c.inner.table).exact_version(&key);
        out.push((value, version));
    }
    out
}

fn coalesced(c: &Cache) -> u64 {
    c.inner.snapshot().coalesced
}

#[tokio::test]
async fn a_hot_key_in_a_backlog_is_written_once() {
    let c = cache();
    // 200 events: the hot key refreshed 150 times, 50 other keys once.
    let mut run = Vec::new();
    for i in 0..200u16 {
        if i % 4 == 3 {
            run.push((
                Ev::Refresh(u8::try_from(1 + i % 15).unwrap(), i, None),
                false,
            ));
        } else {
            run.push((Ev::Refresh(0, i, None), false));
        }
    }
    apply_run(&c, &run).await;
    assert_eq!(c.peek(&"k0".to_owned()).await.as_deref(), Some("v198"));
    assert_eq!(coalesced(&c), 149 + 50 - 15, "the overridden refreshes");
    let status = c.inner.snapshot();
    assert_eq!(status.events_applied, 200, "every event counts as applied");
}

#[tokio::test]
async fn a_lower_version_later_in_the_run_overrides_nothing() {
    let c = cache();
    let mut run: Vec<(Ev, bool)> = (1..=150u64)
        .map(|v| (Ev::Refresh(0, u16::try_from(v).unwrap(), Some(v)), false))
        .collect();
    // From another publisher, older: the cache keeps version 150.
    run.push((Ev::Refresh(0, 7, Some(100)), false));
    apply_run(&c, &run).await;
    assert_eq!(c.peek(&"k0".to_owned()).await.as_deref(), Some("v150"));
    assert_eq!(
        lock(&c.inner.table).exact_version(&"k0".to_owned()),
        Some(150)
    );
    assert_eq!(coalesced(&c), 149);
    assert_eq!(c.inner.snapshot().stale_ignored, 1);
}

#[tokio::test]
async fn an_equal_version_later_in_the_run_overrides_nothing() {
    let c = cache();
    let mut run: Vec<(Ev, bool)> = (0..130u16)
        .map(|i| (Ev::Refresh(1, i, None), false))
        .collect();
    // The second at the same version is stale: the first value stays.
    run.push((Ev::Refresh(0, 1, Some(5)), false));
    run.push((Ev::Refresh(0, 2, Some(5)), false));
    apply_run(&c, &run).await;
    assert_eq!(c.peek(&"k0".to_owned()).await.as_deref(), Some("v1"));
    assert_eq!(coalesced(&c), 129, "only k1's own repeats");
}

#[tokio::test]
async fn a_late_event_or_a_clear_overrides_nothing_before_it() {
    let c = cache();
    let mut run: Vec<(Ev, bool)> = (0..130u16)
        .map(|i| (Ev::Refresh(1, i, None), false))
        .collect();
    // Late: its refresh is never installed (an invalidation, unversioned).
    run.push((Ev::Refresh(0, 1, Some(5)), false));
    run.push((Ev::Refresh(0, 2, Some(6)), true));
    // Across a clear, nothing is coalesced.
    run.push((Ev::Refresh(2, 1, None), false));
    run.push((Ev::Clear, false));
    run.push((Ev::Refresh(2, 2, None), false));
    apply_run(&c, &run).await;
    assert_eq!(coalesced(&c), 129, "only k1's own repeats");
    assert_eq!(c.peek(&"k2".to_owned()).await.as_deref(), Some("v2"));
    assert_eq!(c.peek(&"k1".to_owned()).await, None, "cleared");
}

#[tokio::test]
async fn a_short_run_is_applied_as_it_comes() {
    let c = cache();
    let run: Vec<(Ev, bool)> = (0..100u16)
        .map(|i| (Ev::Refresh(0, i, None), false))
        .collect();
    apply_run(&c, &run).await;
    assert_eq!(c.peek(&"k0".to_owned()).await.as_deref(), Some("v99"));
    assert_eq!(coalesced(&c), 0);
}

#[tokio::test]
async fn a_run_of_more_entries_than_the_bound_is_applied_as_it_comes() {
    let c = cache();
    // 130 events of 40 entries: 5,200, over 4,096, so not searched.
    let run: Vec<(Ev, bool)> = (0..130u16).map(|i| (Ev::Wide(i), false)).collect();
    apply_run(&c, &run).await;
    assert_eq!(coalesced(&c), 0);
    assert_eq!(c.peek(&"k39".to_owned()).await.as_deref(), Some("v129"));
    // 100 of them and 30 of one entry: 4,030, searched.
    let c = cache();
    let mut run: Vec<(Ev, bool)> = (0..100u16).map(|i| (Ev::Wide(i), false)).collect();
    run.extend((0..30u16).map(|i| (Ev::Refresh(50, i, None), false)));
    apply_run(&c, &run).await;
    assert_eq!(coalesced(&c), 99 * 40 + 29);
    assert_eq!(c.peek(&"k39".to_owned()).await.as_deref(), Some("v99"));
}

#[tokio::test]
async fn a_traced_cache_applies_every_entry() {
    let c: Cache = SyncedCache::builder("t", moka::future::Cache::new(1000))
        .trace_bytes(64 * 1024)
        .build()
        .unwrap();
    let run: Vec<(Ev, bool)> = (0..200u16)
        .map(|i| (Ev::Refresh(0, i, None), false))
        .collect();
    apply_run(&c, &run).await;
    assert_eq!(coalesced(&c), 0);
    assert_eq!(c.peek(&"k0".to_owned()).await.as_deref(), Some("v199"));
}

fn ev() -> impl Strategy<Value = (Ev, bool)> {
    let key = 0u8..16;
    let version = prop_oneof![Just(None), (0u64..8).prop_map(Some)];
    let ev = prop_oneof![
        8 => (key.clone(), any::<u16>(), version.clone())
            .prop_map(|(k, v, ver)| Ev::Refresh(k, v, ver)),
        2 => (key, version).prop_map(|(k, ver)| Ev::Invalidate(k, ver)),
        1 => Just(Ev::Clear),
    ];
    (ev, prop::bool::weighted(0.1))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The cache a backlog leaves, applied as one run (coalesced), equals
    /// the one applying every event on its own (never coalesced) leaves:
    /// values and the versions the records know, whatever the mix of
    /// versions, late events, invalidations and clears.
    #[test]
    fn coalescing_never_changes_what_a_run_leaves(
        run in prop::collection::vec(ev(), 128..160),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let coalesced_cache = cache();
            apply_run(&coalesced_cache, &run).await;
            let one_by_one = cache();
            for event in &run {
                apply_run(&one_by_one, std::slice::from_ref(event)).await;
            }
            prop_assert_eq!(contents(&coalesced_cache).await, contents(&one_by_one).await);
            Ok(())
        })?;
    }
}
