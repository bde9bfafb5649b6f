//! Event writes to a key under a pinned load: parked, never holding up the
//! consumer, applied in order after the load or at `max_pin_wait`, and
//! dropped by clears (issue 21, item 10). Slow loaders are `sleep`s on a
//! paused clock, so nothing here depends on the machine's speed; times
//! asserted are the paused clock's.

use std::collections::HashMap as StdHashMap;

use proptest::prelude::*;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::*;
use crate::{Node, transport::EmbeddedTransport};

/// A cache whose loads pin their key at the first retry (a write during the
/// first attempt sends the second under the pin), with `wait` as the bound.
fn pinning_cache(name: &str, wait: Duration) -> Cache {
    SyncedCache::builder(name, moka::future::Cache::new(1000))
        .max_load_retries(0)
        .max_pin_wait(wait)
        .build()
        .expect("valid settings")
}

fn is_pinned(c: &Cache, key: &str) -> bool {
    lock(&c.inner.pins).pins.contains_key(key)
}

/// Starts `c.get_with(key)` and returns once `key` is pinned. The first
/// attempt is overtaken by its own invalidation, so the second runs pinned:
/// it sleeps `slow`, then returns `value`. Any later attempt (after the
/// pinned one was overtaken) returns `value` + " again" at once.
async fn slow_pinned_load(c: &Cache, key: &str, value: &str, slow: Duration) -> JoinHandle<String> {
    let calls = Arc::new(AtomicUsize::new(0));
    let load = {
        let (c, c2) = (c.clone(), c.clone());
        let (key, value) = (key.to_string(), value.to_string());
        tokio::spawn(async move {
            c.get_with(key.clone(), move || {
                let (c, key, value, calls) =
                    (c2.clone(), key.clone(), value.clone(), calls.clone());
                async move {
                    match calls.fetch_add(1, Relaxed) {
                        0 => {
                            c.invalidate(&key).await; // overtakes this attempt
                            "first".to_string()
                        }
                        1 => {
                            tokio::time::sleep(slow).await;
                            value
                        }
                        _ => format!("{value} again"),
                    }
                }
            })
            .await
        })
    };
    for _ in 0..1000 {
        if is_pinned(c, key) {
            return load;
        }
        tokio::task::yield_now().await;
    }
    panic!("the load never pinned {key}");
}

/// Lets the drainers run until nothing of `c` is parked.
async fn drained(c: &Cache) {
    for _ in 0..1000 {
        if !c.inner.parked() {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("parked writes were never applied");
}

/// The symptom, on a node: an event for a key under a slow pinned
/// load must not stall the consumer, or events for other keys and other
/// caches behind it would wait for the database too.
#[tokio::test(start_paused = true)]
async fn on_a_node_a_slow_pinned_load_holds_up_no_other_key_or_cache() {
    let transport = EmbeddedTransport::new();
    let a = pinning_cache("a", Duration::from_secs(10));
    let b: Cache = SyncedCache::new("b", moka::future::Cache::new(100));
    let node = Node::builder("n1", transport.clone())
        .register(&a)
        .register(&b)
        .start()
        .await
        .unwrap();
    let load = slow_pinned_load(&a, "k", "loaded", Duration::from_secs(2)).await;
    let started = Instant::now();
    let publisher = node.publisher();
    // First the pinned key, then another key of its cache, then another cache.
    publisher.insert("a", [("k", "k1")]).await.unwrap();
    publisher.insert("a", [("other", "o1")]).await.unwrap();
    publisher.insert("b", [("x", "x1")]).await.unwrap();
    while !(a.peek("other").await.as_deref() == Some("o1")
        && b.peek("x").await.as_deref() == Some("x1"))
    {
        assert!(
            !load.is_finished(),
            "the other key and cache waited for the pinned load"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(!load.is_finished());
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(a.inner.parked() && !b.inner.parked());
    assert_eq!(a.peek("k").await, None, "the pinned key's event waits");

    assert_eq!(load.await.unwrap(), "loaded");
    drained(&a).await;
    assert_eq!(
        a.peek("k").await.as_deref(),
        Some("k1"),
        "the parked event lands after the load's install"
    );
    let s = a.status();
    assert_eq!((s.writes_parked, s.events_applied, s.refreshes), (1, 2, 2));
    node.shutdown().await.unwrap();
}

/// The same through `CacheHandle::apply`, as the node calls it: keys of the
/// pinned key's own stripe and another cache go on at once.
#[tokio::test(start_paused = true)]
async fn events_for_other_keys_and_caches_apply_while_a_load_is_pinned() {
    let c = pinning_cache("t", Duration::from_secs(10));
    let other_cache = cache();
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
    let started = Instant::now();
    refresh(&c, "k", "k1", Some(1)).await;
    let (same_stripe, others) = neighbours(&c, "k");
    for o in same_stripe.iter().chain(&others[..10]) {
        refresh(&c, o, "v", Some(2)).await;
    }
    refresh(&other_cache, "k", "elsewhere", Some(1)).await;
    assert_eq!(started.elapsed(), Duration::ZERO, "an apply waited");
    assert!(!load.is_finished());
    for o in same_stripe.iter().chain(&others[..10]) {
        assert_eq!(c.peek(o).await.as_deref(), Some("v"), "{o}");
    }
    assert_eq!(other_cache.peek("k").await.as_deref(), Some("elsewhere"));
    assert!(c.inner.parked() && !other_cache.inner.parked());
    // The parked item has not raised the version; the others have.
    assert_eq!(c.status().version, Some(2));
    assert_eq!(load.await.unwrap(), "loaded");
    drained(&c).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("k1"));
}

/// Events for the pinned key apply in delivery order after the load, and
/// the load's own value is not left over a newer event; the version rises
/// only as they apply.
#[tokio::test(start_paused = true)]
async fn parked_events_apply_in_delivery_order_after_the_load() {
    use Ev::{Invalidate as I, Refresh as R};
    #[derive(Debug)]
    enum Ev {
        Refresh(&'static str, Option<u64>),
        Invalidate(Option<u64>),
    }
    // The events, and the value they leave.
    let cases = [
        (
            vec![R("v1", Some(1)), I(Some(2)), R("v3", Some(3))],
            Some("v3"),
        ),
        (vec![R("v1", None), I(None), R("v3", None)], Some("v3")),
        (vec![R("v1", Some(1)), I(Some(2))], None),
        (vec![R("v1", None), R("v2", None), I(None)], None),
    ];
    for (events, left) in cases {
        let c = pinning_cache("t", Duration::from_secs(10));
        let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
        for event in &events {
            match *event {
                R(value, version) => refresh(&c, "k", value, version).await,
                I(version) => invalidate(&c, "k", version).await,
            }
        }
        let n = events.len() as u64;
        let s = c.status();
        assert_eq!((s.writes_parked, s.version), (n, None), "{events:?}");
        assert_eq!(c.peek("k").await, None, "{events:?}");
        assert!(c.inner.parked());
        assert_eq!(load.await.unwrap(), "loaded", "{events:?}");
        drained(&c).await;
        assert_eq!(c.peek("k").await.as_deref(), left, "{events:?}");
        let versioned = events
            .iter()
            .filter_map(|e| match *e {
                R(_, v) | I(v) => v,
            })
            .max();
        assert_eq!(c.status().version, versioned, "{events:?}");
        assert_eq!(c.status().events_applied, n);
    }
}

/// At the bound the parked writes apply, with the load still running; the
/// load, overtaken, returns the newer cached value, or with none cached
/// (an invalidation) loads again. It never returns or caches its own.
#[tokio::test(start_paused = true)]
async fn at_the_bound_parked_writes_apply_and_the_pinned_load_does_not_return_older() {
    for last in ["refresh", "invalidate"] {
        let c = pinning_cache("t", Duration::from_millis(500));
        let start = Instant::now();
        let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
        refresh(&c, "k", "ev1", Some(1)).await;
        if last == "invalidate" {
            invalidate(&c, "k", Some(2)).await;
        }
        assert!(c.inner.parked());
        tokio::time::sleep_until(start + Duration::from_millis(499)).await;
        assert!(c.inner.parked(), "{last}: applied before the bound");
        tokio::time::sleep_until(start + Duration::from_millis(501)).await;
        assert!(!c.inner.parked(), "{last}: not applied at the bound");
        assert!(!load.is_finished());
        let expected = (last == "refresh").then_some("ev1");
        assert_eq!(c.peek("k").await.as_deref(), expected, "{last}");
        let got = load.await.unwrap();
        let s = c.status();
        if last == "refresh" {
            assert_eq!(got, "ev1", "the overtaken load returned its own value");
            assert_eq!(c.peek("k").await.as_deref(), Some("ev1"));
            assert_eq!((s.loads, s.loads_superseded), (2, 2));
        } else {
            assert_eq!(got, "loaded again");
            assert_eq!(c.peek("k").await.as_deref(), Some("loaded again"));
            assert_eq!((s.loads, s.loads_superseded), (3, 2));
        }
        assert_eq!(s.version, Some(if last == "refresh" { 1 } else { 2 }));
    }
}

/// A local write from another task waits for the pin up to the same bound,
/// then goes ahead; the overtaken load returns it.
#[tokio::test(start_paused = true)]
async fn a_local_write_waits_for_the_pin_only_up_to_the_bound() {
    let c = pinning_cache("t", Duration::from_millis(500));
    let start = Instant::now();
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
    c.insert("k".into(), "mine".into()).await;
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_millis(600),
        "{waited:?}"
    );
    assert!(!load.is_finished());
    assert!(!c.inner.parked(), "a local write is no parked event");
    assert_eq!(load.await.unwrap(), "mine");
    assert_eq!(c.peek("k").await.as_deref(), Some("mine"));
    assert_eq!(c.status().writes_parked, 0);
}

/// `Duration::ZERO` waits for nothing; `Duration::MAX` waits for the load.
#[tokio::test(start_paused = true)]
async fn the_bounds_zero_and_max() {
    let c = pinning_cache("t", Duration::ZERO);
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
    refresh(&c, "k", "ev1", None).await;
    assert!(!c.inner.parked());
    assert_eq!(c.peek("k").await.as_deref(), Some("ev1"));
    c.insert("j".into(), "local".into()).await;
    assert_eq!(load.await.unwrap(), "ev1");
    assert_eq!(c.status().writes_parked, 0);

    let c = pinning_cache("t", Duration::MAX);
    let start = Instant::now();
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(30)).await;
    refresh(&c, "k", "ev1", None).await;
    tokio::time::sleep(Duration::from_secs(29)).await;
    assert!(c.inner.parked());
    assert_eq!(load.await.unwrap(), "loaded");
    assert!(start.elapsed() >= Duration::from_secs(30));
    drained(&c).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("ev1"));
}

/// A clear event, or a resync, while writes are parked: it does not wait
/// for the load, nothing parked lands after it, and a parked versioned
/// invalidation's tombstone survives it.
#[tokio::test(start_paused = true)]
async fn a_clear_drops_parked_writes_but_keeps_their_tombstones() {
    for how in ["clear", "versioned clear", "resync"] {
        let c = pinning_cache("t", Duration::from_secs(10));
        let start = Instant::now();
        let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
        refresh(&c, "k", "before the clear", Some(1)).await;
        invalidate(&c, "k", Some(5)).await;
        refresh(&c, "other", "o", Some(2)).await;
        assert!(c.inner.parked());
        match how {
            "clear" => clear(&c).await,
            "versioned clear" => apply(&c, &Change::Clear { version: Some(3) }).await,
            _ => c.inner.resync().await,
        }
        assert_eq!(start.elapsed(), Duration::ZERO, "{how} waited for the load");
        assert!(!c.inner.parked(), "{how}");
        assert_eq!(c.peek("other").await, None, "{how}");
        assert_eq!(
            c.status().version,
            Some(5),
            "{how}: the dropped items are done"
        );
        // The clear overtook the load: nothing is cached, so it loads again.
        assert_eq!(load.await.unwrap(), "loaded again", "{how}");
        tokio::time::sleep(Duration::from_secs(20)).await; // past any bound
        assert_eq!(
            c.peek("k").await.as_deref(),
            Some("loaded again"),
            "{how}: a parked write landed after the clear"
        );
        refresh(&c, "k", "older than the tombstone", Some(4)).await;
        assert_eq!(
            c.peek("k").await.as_deref(),
            Some("loaded again"),
            "{how}: the parked tombstone was lost"
        );
        refresh(&c, "k", "v6", Some(6)).await;
        assert_eq!(c.peek("k").await.as_deref(), Some("v6"), "{how}");
    }
}

/// After a clear, a write to the still pinned key still waits behind the
/// pin, and lands after the load's install.
#[tokio::test(start_paused = true)]
async fn writes_parked_after_a_clear_still_land_in_order() {
    let c = pinning_cache("t", Duration::from_secs(10));
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
    refresh(&c, "k", "a", None).await;
    clear(&c).await;
    refresh(&c, "k", "b", None).await;
    assert!(c.inner.parked());
    assert_eq!(load.await.unwrap(), "loaded again");
    drained(&c).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("b"));
    assert_eq!(c.status().writes_parked, 2);
}

#[tokio::test(start_paused = true)]
async fn parked_is_true_exactly_while_an_event_write_waits() {
    let c = pinning_cache("t", Duration::from_secs(10));
    assert!(!c.inner.parked());
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
    assert!(!c.inner.parked(), "a pin alone parks nothing");
    refresh(&c, "other", "o", None).await;
    assert!(!c.inner.parked(), "another key is not parked");
    invalidate(&c, "k", None).await;
    assert!(c.inner.parked());
    tokio::time::sleep(Duration::from_millis(1999)).await;
    assert!(c.inner.parked(), "still waiting for the load");
    load.await.unwrap();
    drained(&c).await;
    assert!(!c.inner.parked());
    assert_eq!(c.peek("k").await, None);
    // Dropped by a clear: done, too.
    let load = slow_pinned_load(&c, "k", "loaded", Duration::from_secs(2)).await;
    refresh(&c, "k", "x", None).await;
    assert!(c.inner.parked());
    c.inner.reset().await;
    assert!(!c.inner.parked());
    load.await.unwrap();
}

/// A step of the randomized test, over two keys.
#[derive(Debug, Clone)]
enum Step {
    /// `get_with` of the key, whose loader reads the row and takes this
    /// many ms to return it; with `true`, its first attempt is overtaken at
    /// once by its own invalidation, so the load runs pinned from the start
    /// (the cache has no retries).
    Load(u8, u64, bool),
    /// The row changes, and its event arrives: a refresh with the new row
    /// or an invalidation, versioned or not.
    Event(u8, bool, bool),
    /// Every row changes, and a clear arrives (or, `true`, a resync).
    Clear(bool),
    /// A local invalidation from the test's task.
    LocalInvalidate(u8),
    Advance(u64),
}

fn step() -> impl Strategy<Value = Step> {
    let key = 0u8..2;
    prop_oneof![
        3 => (key.clone(), prop_oneof![Just(0u64), 1u64..1500], prop::bool::weighted(0.7))
            .prop_map(|(k, ms, pin)| Step::Load(k, ms, pin)),
        5 => (key.clone(), any::<bool>(), any::<bool>()).prop_map(|(k, r, v)| Step::Event(k, r, v)),
        1 => any::<bool>().prop_map(Step::Clear),
        1 => key.prop_map(Step::LocalInvalidate),
        3 => (0u64..800).prop_map(Step::Advance),
    ]
}

fn max_pin_wait() -> impl Strategy<Value = Duration> {
    prop_oneof![
        Just(Duration::ZERO),
        Just(Duration::from_millis(100)),
        Just(Duration::from_millis(700)),
        Just(Duration::MAX),
    ]
}

/// The row's number: its values are `k@n`, `n` growing with every change.
fn row_number(value: &str) -> u64 {
    value.split('@').nth(1).unwrap().parse().unwrap()
}

/// What the cache holds for `k`, read without yielding.
fn held(c: &Cache, k: u8) -> Option<String> {
    let k = k.to_string();
    c.iter().find(|(key, _)| **key == k).map(|(_, v)| v)
}

/// Runs `steps`, with the rows in a "database" the loaders read, changed in
/// step with the events. Checked: a `get_with` that ran its loader never
/// returns a row older than what the cache holds when it returns (that
/// would be older than a change applied while it ran); and once everything
/// settled, every key holds its newest row or nothing, which is what
/// applying the events in order gives (absence is always safe).
async fn run(wait: Duration, steps: &[Step]) -> Result<(), String> {
    let c = pinning_cache("t", wait);
    let db: Arc<Mutex<StdHashMap<u8, String>>> =
        Arc::new(Mutex::new((0..2).map(|k| (k, format!("{k}@0"))).collect()));
    let mut loads = Vec::new();
    for (i, step) in steps.iter().enumerate() {
        let n = i as u64 + 1;
        match *step {
            Step::Load(k, ms, pin) => {
                let (c, db) = (c.clone(), db.clone());
                loads.push(tokio::spawn(async move {
                    let ran = Arc::new(AtomicUsize::new(0));
                    let got = c
                        .get_with(k.to_string(), || {
                            let first = ran.fetch_add(1, Relaxed) == 0;
                            let (c, db) = (c.clone(), db.clone());
                            async move {
                                if pin && first {
                                    c.invalidate(&k.to_string()).await;
                                    return "never installed".to_string();
                                }
                                let row = lock(&db)[&k].clone();
                                tokio::time::sleep(Duration::from_millis(ms)).await;
                                row
                            }
                        })
                        .await;
                    // Read without yielding, as the call returns.
                    let holding = (ran.load(Relaxed) > 0).then(|| held(&c, k));
                    (i, k, got, holding)
                }));
                // Let it start (and pin, or join a load in flight) before
                // the next step.
                for _ in 0..8 {
                    tokio::task::yield_now().await;
                }
            }
            Step::Event(k, is_refresh, versioned) => {
                let row = format!("{k}@{n}");
                lock(&db).insert(k, row.clone());
                let version = versioned.then_some(n);
                if is_refresh {
                    refresh(&c, &k.to_string(), &row, version).await;
                } else {
                    invalidate(&c, &k.to_string(), version).await;
                }
            }
            Step::Clear(resync) => {
                for (k, row) in lock(&db).iter_mut() {
                    *row = format!("{k}@{n}");
                }
                if resync {
                    c.inner.resync().await;
                } else {
                    clear(&c).await;
                }
            }
            Step::LocalInvalidate(k) => c.invalidate(&k.to_string()).await,
            Step::Advance(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
        }
    }
    for load in loads {
        let (i, k, got, held) = load.await.map_err(|e| e.to_string())?;
        if let Some(Some(held)) = held
            && row_number(&held) > row_number(&got)
        {
            return Err(format!(
                "load at step {i} of key {k} returned {got:?} while the cache held the newer {held:?}"
            ));
        }
    }
    // Every load is done, so every pin is gone: the drainers go.
    tokio::time::sleep(Duration::from_millis(1)).await;
    drained(&c).await;
    for k in 0..2 {
        let truth = lock(&db)[&k].clone();
        if let Some(h) = held(&c, k)
            && h != truth
        {
            return Err(format!("key {k} holds {h:?}, the newest row is {truth:?}"));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]
    /// Pinned slow loads, events for their keys and others, clears and
    /// resyncs, local writes, and every kind of bound, on a paused clock.
    #[test]
    fn parked_writes_agree_with_in_order_application(
        wait in max_pin_wait(),
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(run(wait, &steps)).map_err(TestCaseError::fail)?;
    }
}
