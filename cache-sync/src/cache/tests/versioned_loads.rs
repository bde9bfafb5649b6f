//! `get_with_versioned`: a loaded value carries its row version.

use std::collections::HashMap as StdHashMap;

use proptest::prelude::*;

use super::*;

async fn load_at(c: &Cache, k: &str, value: &str, version: u64) -> String {
    let value = value.to_string();
    c.get_with_versioned(k.into(), || {
        let value = value.clone();
        async move { (value, version) }
    })
    .await
}

/// The case: a load reads the row at v12, then a refresh at v10,
/// published earlier but delayed in transit, arrives.
#[tokio::test]
async fn a_delayed_older_refresh_does_not_replace_a_versioned_load() {
    let c = cache();
    assert_eq!(load_at(&c, "k", "v12", 12).await, "v12");
    assert_eq!(
        c.status().version,
        None,
        "loads do not raise the applied version"
    );
    refresh(&c, "k", "v10", Some(10)).await;
    assert_eq!(c.get("k").await.as_deref(), Some("v12"));
    refresh(&c, "k", "v12 again", Some(12)).await;
    assert_eq!(
        c.get("k").await.as_deref(),
        Some("v12"),
        "the loaded version itself is stale too, as after a refresh at it"
    );
    let s = c.status();
    assert_eq!(
        (s.stale_ignored, s.refreshes, s.loads, s.loads_stale),
        (2, 0, 1, 0)
    );
}

/// What `get_with` still does, as its docs say: its value carries no
/// version, so the same late refresh replaces it.
#[tokio::test]
async fn an_unversioned_load_is_replaced_by_a_newer_than_known_refresh() {
    let c = cache();
    c.get_with("k".into(), || async { "v12".to_string() }).await;
    refresh(&c, "k", "v10", Some(10)).await;
    assert_eq!(c.get("k").await.as_deref(), Some("v10"));
}

#[tokio::test]
async fn a_newer_refresh_replaces_a_versioned_load() {
    let c = cache();
    load_at(&c, "k", "v12", 12).await;
    refresh(&c, "k", "v13", Some(13)).await;
    assert_eq!(c.get("k").await.as_deref(), Some("v13"));
    let s = c.status();
    assert_eq!((s.refreshes, s.stale_ignored), (1, 0));
}

/// The loader read a lagging replica: the node has seen the row deleted at
/// v10, the loader still finds it at v9.
#[tokio::test]
async fn a_load_older_than_a_tombstone_is_returned_but_not_cached() {
    let c = cache();
    invalidate(&c, "k", Some(10)).await;
    assert_eq!(load_at(&c, "k", "v9", 9).await, "v9", "the caller gets it");
    assert_eq!(c.peek("k").await, None, "nothing cached");
    assert_eq!(c.status().loads_stale, 1);
    // Nor older than a newer refresh or load.
    refresh(&c, "j", "v13", Some(13)).await;
    c.invalidate("j").await; // unversioned: the record stays at 13
    assert_eq!(load_at(&c, "j", "v12", 12).await, "v12");
    assert_eq!(c.peek("j").await, None);
    // An equal version is the same row, and installs.
    assert_eq!(load_at(&c, "k", "v10", 10).await, "v10");
    assert_eq!(c.peek("k").await.as_deref(), Some("v10"));
    refresh(&c, "k", "v10 late", Some(10)).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("v10"));
    let s = c.status();
    assert_eq!((s.loads, s.loads_stale, s.stale_ignored), (3, 2, 1));
}

#[tokio::test]
async fn a_load_below_a_versioned_clear_is_not_cached() {
    let c = cache();
    apply(&c, &Change::Clear { version: Some(20) }).await;
    assert_eq!(load_at(&c, "k", "v19", 19).await, "v19");
    assert_eq!(c.peek("k").await, None);
    assert_eq!(load_at(&c, "k", "v20", 20).await, "v20");
    assert_eq!(c.peek("k").await.as_deref(), Some("v20"));
    assert_eq!(c.status().loads_stale, 1);
}

/// With one record kept, a tombstone is evicted into the floor: a load
/// below the floor might be older than the forgotten tombstone, so it is
/// not cached; at the floor it is no older than anything forgotten.
#[tokio::test]
async fn a_load_below_the_evicted_floor_is_not_cached() {
    let c: Cache = SyncedCache::builder("t", moka::future::Cache::new(1000))
        .max_tracked_keys(1)
        .build()
        .expect("valid settings");
    invalidate(&c, "a", Some(50)).await;
    refresh(&c, "b", "b10", Some(10)).await; // evicts a's tombstone
    assert_eq!(load_at(&c, "a", "a40", 40).await, "a40");
    assert_eq!(c.peek("a").await, None);
    assert_eq!(load_at(&c, "a", "a50", 50).await, "a50");
    assert_eq!(c.peek("a").await.as_deref(), Some("a50"));
    // Now tracked exactly: at or below is stale, above replaces.
    refresh(&c, "a", "a50 late", Some(50)).await;
    assert_eq!(c.peek("a").await.as_deref(), Some("a50"));
    refresh(&c, "a", "a51", Some(51)).await;
    assert_eq!(c.peek("a").await.as_deref(), Some("a51"));
    assert_eq!(c.status().loads_stale, 1);
}

#[tokio::test]
async fn versions_zero_and_max_work() {
    let c = cache();
    assert_eq!(load_at(&c, "z", "z0", 0).await, "z0");
    assert_eq!(c.peek("z").await.as_deref(), Some("z0"));
    refresh(&c, "z", "z0 late", Some(0)).await;
    assert_eq!(c.peek("z").await.as_deref(), Some("z0"));
    refresh(&c, "z", "z1", Some(1)).await;
    assert_eq!(c.peek("z").await.as_deref(), Some("z1"));

    assert_eq!(load_at(&c, "m", "max", u64::MAX).await, "max");
    refresh(&c, "m", "max late", Some(u64::MAX)).await;
    assert_eq!(c.peek("m").await.as_deref(), Some("max"));
    invalidate(&c, "m", Some(u64::MAX)).await;
    assert_eq!(c.peek("m").await, None, "removal always wins");
    assert_eq!(load_at(&c, "m", "max-1", u64::MAX - 1).await, "max-1");
    assert_eq!(c.peek("m").await, None);
    assert_eq!(load_at(&c, "m", "max again", u64::MAX).await, "max again");
    assert_eq!(c.peek("m").await.as_deref(), Some("max again"));
    let s = c.status();
    assert_eq!((s.loads_stale, s.stale_ignored, s.refreshes), (1, 2, 1));
}

/// Concurrent calls for one key, versioned or not, share the first one's
/// load.
#[tokio::test]
async fn concurrent_versioned_loads_coalesce() {
    let c = cache();
    let loads = Arc::new(AtomicUsize::new(0));
    let (release, released) = oneshot::channel::<()>();
    let released = Arc::new(Mutex::new(Some(released)));
    let leader = {
        let (c, loads) = (c.clone(), loads.clone());
        tokio::spawn(async move {
            c.get_with_versioned("k".into(), || {
                loads.fetch_add(1, Relaxed);
                let released = lock(&released).take();
                async move {
                    if let Some(r) = released {
                        let _ = r.await;
                    }
                    ("v12".to_string(), 12)
                }
            })
            .await
        })
    };
    tokio::task::yield_now().await;
    let mut followers = Vec::new();
    for i in 0..3 {
        let (c, loads) = (c.clone(), loads.clone());
        followers.push(tokio::spawn(async move {
            if i == 0 {
                c.get_with("k".into(), || {
                    loads.fetch_add(1, Relaxed);
                    async { "unversioned".to_string() }
                })
                .await
            } else {
                c.get_with_versioned("k".into(), || {
                    loads.fetch_add(1, Relaxed);
                    async { ("other".to_string(), 99) }
                })
                .await
            }
        }));
    }
    for _ in 0..4 {
        tokio::task::yield_now().await;
    }
    release.send(()).unwrap();
    assert_eq!(leader.await.unwrap(), "v12");
    for f in followers {
        assert_eq!(f.await.unwrap(), "v12");
    }
    assert_eq!(loads.load(Relaxed), 1);
    assert_eq!(c.status().loads, 1);
    refresh(&c, "k", "v11", Some(11)).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("v12"), "cached at v12");
}

/// A versioned row whose loader parks after its first read, so the test
/// can apply a change between the read and the install.
struct VersionedDb {
    row: Mutex<(String, u64)>,
    reads: AtomicUsize,
    gate: Barrier,
}

impl VersionedDb {
    async fn load(&self) -> (String, u64) {
        let row = lock(&self.row).clone();
        if self.reads.fetch_add(1, Relaxed) == 0 {
            self.gate.wait().await; // read done
            self.gate.wait().await; // change applied
        }
        row
    }
}

/// The row is deleted-and-recreated (tombstone at v11, then the row at
/// v11) while the first load holds v10: that load is overtaken and
/// retried, or with no retries loaded again pinned, and the retry's v11
/// installs (equal to the tombstone).
#[tokio::test]
async fn a_versioned_load_overtaken_by_an_invalidation_is_retried() {
    for retries in [3, 0] {
        let c: Cache = SyncedCache::builder("t", moka::future::Cache::new(1000))
            .max_load_retries(retries)
            .build()
            .expect("valid settings");
        let db = Arc::new(VersionedDb {
            row: Mutex::new(("old".into(), 10)),
            reads: AtomicUsize::new(0),
            gate: Barrier::new(2),
        });
        let load = {
            let (c, db) = (c.clone(), db.clone());
            tokio::spawn(async move { c.get_with_versioned("k".into(), || db.load()).await })
        };
        db.gate.wait().await;
        *lock(&db.row) = ("new".into(), 11);
        invalidate(&c, "k", Some(11)).await;
        db.gate.wait().await;
        assert_eq!(load.await.unwrap(), "new", "retries {retries}");
        assert_eq!(
            c.peek("k").await.as_deref(),
            Some("new"),
            "retries {retries}"
        );
        let s = c.status();
        assert_eq!(
            (s.loads, s.loads_superseded, s.loads_stale),
            (2, 1, 0),
            "retries {retries}"
        );
        refresh(&c, "k", "late", Some(11)).await;
        assert_eq!(
            c.peek("k").await.as_deref(),
            Some("new"),
            "retries {retries}"
        );
    }
}

/// The pinned last load reads a lagging replica, older than the tombstone
/// that overtook the first load: returned, not cached.
#[tokio::test]
async fn a_pinned_last_load_older_than_the_key_is_not_cached() {
    let c = locking_cache();
    let calls = AtomicUsize::new(0);
    let got = c
        .get_with_versioned("k".to_string(), || async {
            if calls.fetch_add(1, Relaxed) == 0 {
                invalidate(&c, "k", Some(10)).await; // overtakes this load
                return ("first".to_string(), 10);
            }
            ("lagging".to_string(), 9)
        })
        .await;
    assert_eq!(got, "lagging");
    assert_eq!(c.peek("k").await, None);
    let s = c.status();
    assert_eq!((s.loads, s.loads_superseded, s.loads_stale), (2, 1, 1));
}

/// Loads are not quarantined: the loader read the source of truth, and its
/// version is what the node lacked after the loss.
#[tokio::test(start_paused = true)]
async fn a_versioned_load_during_the_quarantine_is_cached_with_its_version() {
    let c = cache();
    assert!(c.inner.claim(
        1,
        Duration::from_secs(10),
        std::sync::Arc::new(crate::cache::Housekeeper::start()),
        &crate::util::Moment::default(),
    ));
    c.inner.resync().await;
    assert_eq!(load_at(&c, "k", "v12", 12).await, "v12");
    assert_eq!(c.peek("k").await.as_deref(), Some("v12"));
    // A newer refresh in the window is still applied as an invalidation,
    // and the load it raced then finds the key newer than what it read.
    refresh(&c, "k", "v13", Some(13)).await;
    assert_eq!(c.peek("k").await, None);
    assert_eq!(load_at(&c, "k", "v12 lagging", 12).await, "v12 lagging");
    assert_eq!(c.peek("k").await, None);
    tokio::time::advance(Duration::from_secs(11)).await;
    assert_eq!(load_at(&c, "k", "v13", 13).await, "v13");
    refresh(&c, "k", "v10", Some(10)).await;
    assert_eq!(c.peek("k").await.as_deref(), Some("v13"));
    let s = c.status();
    assert_eq!(
        (s.refreshes_quarantined, s.loads_stale, s.stale_ignored),
        (1, 1, 1)
    );
}

/// On several threads at once, a versioned load of a fresh key races
/// refreshes of it: whichever lands last, the key ends at the newest version
/// installed, never below the newest refresh (the load's decision and its
/// install are one step under the key's write lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parallel_versioned_loads_and_refreshes_leave_the_newest_version() {
    const REFRESHERS: u64 = 3;
    const ROUNDS: u64 = 1000;
    let c: Cache = SyncedCache::new("t", moka::future::Cache::new(10 * ROUNDS));
    let start = Arc::new(Barrier::new(REFRESHERS as usize + 1));
    let mut tasks: Vec<_> = (0..REFRESHERS)
        .map(|w| {
            let (c, start) = (c.clone(), start.clone());
            tokio::spawn(async move {
                for round in 0..ROUNDS {
                    start.wait().await;
                    let v = round * 10 + w + 1;
                    refresh(&c, &format!("k{round}"), &v.to_string(), Some(v)).await;
                }
            })
        })
        .collect();
    tasks.push({
        let (c, start) = (c.clone(), start.clone());
        tokio::spawn(async move {
            for round in 0..ROUNDS {
                start.wait().await;
                // Below, between and above the refreshes' versions.
                let v = round * 10 + round % 5;
                load_at(&c, &format!("k{round}"), &v.to_string(), v).await;
            }
        })
    });
    for t in tasks {
        t.await.unwrap();
    }
    let mut wrong = Vec::new();
    for round in 0..ROUNDS {
        let newest_refresh = round * 10 + REFRESHERS;
        let held = c.peek(&format!("k{round}")).await;
        if held
            .as_deref()
            .and_then(|h| h.parse::<u64>().ok())
            .is_none_or(|v| v < newest_refresh)
        {
            wrong.push((round, held));
        }
    }
    assert!(
        wrong.is_empty(),
        "keys below their newest refresh: {wrong:?}"
    );
}

/// An operation of the property test, on a handful of keys.
#[derive(Debug, Clone)]
enum Op {
    Load(u8, u64),
    Refresh(u8, u64),
    Invalidate(u8, Option<u64>),
    Clear(Option<u64>),
}

fn version() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..8,
        1 => Just(u64::MAX - 1),
        1 => Just(u64::MAX),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0u8..4;
    prop_oneof![
        3 => (key.clone(), version()).prop_map(|(k, v)| Op::Load(k, v)),
        3 => (key.clone(), version()).prop_map(|(k, v)| Op::Refresh(k, v)),
        2 => (key, prop::option::of(version())).prop_map(|(k, v)| Op::Invalidate(k, v)),
        1 => prop::option::of(version()).prop_map(Op::Clear),
    ]
}

/// The truth: per key the largest version seen wins, and removal always
/// wins.
#[derive(Default)]
struct Model {
    known: StdHashMap<u8, u64>,
    held: StdHashMap<u8, String>,
    floor: Option<u64>,
}

impl Model {
    fn load_installs(&self, k: u8, v: u64) -> bool {
        self.floor.is_none_or(|f| v >= f) && self.known.get(&k).is_none_or(|&known| v >= known)
    }

    fn refresh_applies(&self, k: u8, v: u64) -> bool {
        self.floor.is_none_or(|f| v >= f) && self.known.get(&k).is_none_or(|&known| v > known)
    }
}

/// Runs `ops` on a cache keeping `tracked` version records. With room for
/// every key the cache must match the model exactly; with less, eviction
/// may only make it hold less (a refresh becomes an invalidation, a load
/// goes uncached), never a value the model does not hold.
async fn run(tracked: usize, ops: &[Op]) -> Result<(), String> {
    let c: Cache = SyncedCache::builder("t", moka::future::Cache::new(1000))
        .max_tracked_keys(tracked)
        .build()
        .expect("valid settings");
    let exact = tracked >= 4;
    let mut m = Model::default();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Load(k, v) => {
                let value = format!("{k}@{v} load {i}");
                let ran = AtomicUsize::new(0);
                let got = c
                    .get_with_versioned(k.to_string(), || {
                        ran.fetch_add(1, Relaxed);
                        let value = value.clone();
                        async move { (value, v) }
                    })
                    .await;
                if ran.load(Relaxed) == 0 {
                    if m.held.get(&k) != Some(&got) {
                        return Err(format!(
                            "step {i} {op:?}: hit {got:?}, model holds {:?}",
                            m.held.get(&k)
                        ));
                    }
                } else {
                    if got != value {
                        return Err(format!("step {i} {op:?}: returned {got:?}"));
                    }
                    if exact && m.held.contains_key(&k) {
                        return Err(format!("step {i} {op:?}: loaded over a held value"));
                    }
                    if m.load_installs(k, v) {
                        m.known.insert(k, v);
                        m.held.insert(k, value);
                    }
                }
            }
            Op::Refresh(k, v) => {
                if m.refresh_applies(k, v) {
                    let value = format!("{k}@{v} refresh {i}");
                    refresh(&c, &k.to_string(), &value, Some(v)).await;
                    m.known.insert(k, v);
                    m.held.insert(k, value);
                } else {
                    refresh(&c, &k.to_string(), "stale", Some(v)).await;
                }
            }
            Op::Invalidate(k, v) => {
                invalidate(&c, &k.to_string(), v).await;
                m.held.remove(&k);
                if let Some(v) = v {
                    let known = m.known.entry(k).or_insert(v);
                    *known = (*known).max(v);
                }
            }
            Op::Clear(v) => {
                apply(&c, &Change::Clear { version: v }).await;
                m.held.clear();
                if let Some(v) = v {
                    m.floor = Some(m.floor.map_or(v, |f| f.max(v)));
                }
            }
        }
        for k in 0u8..4 {
            let held = c.peek(&k.to_string()).await;
            let truth = m.held.get(&k);
            let fine = match &held {
                None => !exact || truth.is_none(),
                Some(h) => truth == Some(h),
            };
            if !fine {
                return Err(format!(
                    "after step {i} {op:?}: key {k} holds {held:?}, the model {truth:?}"
                ));
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Versioned loads, refreshes, invalidations and clears in any order,
    /// versions 0 and `u64::MAX` included, with and without eviction.
    #[test]
    fn versioned_loads_and_events_agree_with_the_model(
        tracked in prop_oneof![Just(1000usize), 1usize..=3],
        ops in proptest::collection::vec(op(), 0..60),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        rt.block_on(run(tracked, &ops)).map_err(TestCaseError::fail)?;
    }
}

/// The race between a miss and the load's token: a refresh at v12 lands
/// there, so it does not supersede the load, and the loader then reads a
/// lagging replica at v10. The call returns the cached v12, not the older
/// row, whether the load was pinned (after retries) or not.
#[tokio::test]
async fn a_stale_load_returns_the_newer_cached_value() {
    for locked in [false, true] {
        let c = cache();
        refresh(&c, "k", "v12", Some(12)).await;
        assert_eq!(c.peek("k").await.as_deref(), Some("v12"));
        let key = "k".to_string();
        let mut loader = || async { Ok::<_, ()>(("v10".to_string(), Some(10))) };
        // What `load_through` does after its miss, with the refresh between.
        let got = if locked {
            c.inner.load_locked(&key, &mut loader, false).await
        } else {
            c.inner.load(&key, &mut loader, false).await
        };
        assert_eq!(got.unwrap(), "v12", "locked: {locked}");
        assert_eq!(c.peek("k").await.as_deref(), Some("v12"));
        assert_eq!(c.status().loads_stale, 1);
    }
}
