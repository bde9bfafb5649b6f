use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use tokio::sync::{Barrier, oneshot};

use serde::Serialize;

use super::*;
use crate::cache::Event;
use crate::util::{lock, now_us};
use crate::wire::{Change, EntryVersion, Header, KeyVersion, encode, encode_part};

mod coalescing;
mod fresh_reads;
mod pinned_writes;
mod trace;
mod versioned_loads;

type Cache = SyncedCache<String, String>;

fn cache() -> Cache {
    SyncedCache::new("t", moka::future::Cache::new(1000))
}

fn header() -> Header<'static> {
    Header {
        cache: "t",
        origin: crate::wire::Origin(b"test"),
        publisher: 1,
        seq: 1,
        published_at_us: now_us(),
    }
}

fn b<T: Serialize + ?Sized>(v: &T) -> bytes::Bytes {
    encode_part(v, "test").unwrap()
}

async fn refresh(c: &Cache, k: &str, v: &str, version: Option<u64>) {
    let change = Change::Refresh {
        entries: vec![EntryVersion {
            key: b(k),
            value: b(v),
            version,
        }],
    };
    apply(c, &change).await;
}

/// Applies a change the way a node does: encoded, read back, checked.
async fn apply(c: &Cache, change: &Change) {
    let bytes = encode(&header(), change).unwrap();
    let (header, offset) = crate::wire::decode_header(&bytes, 1 << 20).unwrap();
    let change = crate::wire::decode_change(&bytes, offset).unwrap();
    c.inner
        .apply(&[Event {
            header,
            change,
            late: false,
        }])
        .await;
}

async fn invalidate(c: &Cache, k: &str, version: Option<u64>) {
    let change = Change::Invalidate {
        keys: vec![KeyVersion { key: b(k), version }],
    };
    apply(c, &change).await;
}

async fn clear(c: &Cache) {
    apply(c, &Change::Clear { version: None }).await;
}

/// A "database" with one row, whose loader reads the row and then parks on a
/// barrier, so the test can apply a change between the read and the install.
struct SlowDb {
    row: Mutex<String>,
    reads: AtomicUsize,
    /// The first load waits here twice: after reading, and before returning.
    gate: Barrier,
}

impl SlowDb {
    fn new(v: &str) -> Arc<Self> {
        Arc::new(Self {
            row: Mutex::new(v.into()),
            reads: AtomicUsize::new(0),
            gate: Barrier::new(2),
        })
    }

    async fn load(&self) -> String {
        let v = lock(&self.row).clone();
        if self.reads.fetch_add(1, Relaxed) == 0 {
            self.gate.wait().await; // read done
            self.gate.wait().await; // change applied
        }
        v
    }

    fn set(&self, v: &str) {
        *lock(&self.row) = v.into();
    }
}

/// Regression for the bug every peer had: a load starts, an invalidation
/// lands, then the load installs the value it read before the invalidation.
async fn load_racing_with(change: impl AsyncFnOnce(&Cache)) -> (Cache, String) {
    load_with_retries_racing_with(3, change).await
}

async fn load_with_retries_racing_with(
    retries: u32,
    change: impl AsyncFnOnce(&Cache),
) -> (Cache, String) {
    let c = SyncedCache::builder("t", moka::future::Cache::new(1000))
        .max_load_retries(retries)
        .build()
        .expect("valid settings");
    let db = SlowDb::new("old");
    let load = {
        let (c, db) = (c.clone(), db.clone());
        tokio::spawn(async move { c.get_with("k".into(), || db.load()).await })
    };
    db.gate.wait().await; // the loader has read "old"
    db.set("new");
    change(&c).await;
    db.gate.wait().await; // let the loader return "old"
    let got = load.await.unwrap();
    (c, got)
}

#[tokio::test]
async fn an_invalidation_during_a_load_wins() {
    let (c, got) = load_racing_with(async |c| invalidate(c, "k", None).await).await;
    assert_eq!(
        got, "new",
        "the load must be retried, not return what it read before"
    );
    assert_eq!(c.get("k").await.as_deref(), Some("new"));
    assert_eq!(c.status().loads_superseded, 1);
}

#[tokio::test]
async fn a_refresh_during_a_load_wins() {
    let (c, got) = load_racing_with(async |c| refresh(c, "k", "new", Some(2)).await).await;
    assert_eq!(got, "new");
    assert_eq!(c.get("k").await.as_deref(), Some("new"));
    assert_eq!(c.status().loads_superseded, 1);
}

#[tokio::test]
async fn a_clear_during_a_load_wins() {
    let (c, got) = load_racing_with(async |c| clear(c).await).await;
    assert_eq!(got, "new");
    assert_eq!(c.get("k").await.as_deref(), Some("new"));
}

#[tokio::test]
async fn a_loss_resync_during_a_load_wins() {
    let (c, got) = load_racing_with(async |c| c.inner.resync().await).await;
    assert_eq!(got, "new");
    assert_eq!(c.get("k").await.as_deref(), Some("new"));
}

#[tokio::test]
async fn a_local_insert_during_a_load_wins() {
    let (c, got) = load_racing_with(async |c| c.insert("k".into(), "mine".into()).await).await;
    assert_eq!(got, "mine");
    assert_eq!(c.get("k").await.as_deref(), Some("mine"));
}

#[tokio::test]
async fn a_change_to_another_key_does_not_disturb_a_load() {
    let (c, got) = load_racing_with(async |c| invalidate(c, "other", None).await).await;
    assert_eq!(got, "old");
    assert_eq!(c.status().loads_superseded, 0);
}

/// Regression: with `max_load_retries(0)` a superseded load was returned
/// to the caller, older than the invalidation applied while it ran, though
/// the docs promise `get_with` never returns such a value.
#[tokio::test]
async fn without_retries_a_superseded_load_is_still_never_returned() {
    for change in ["invalidate", "clear", "resync"] {
        let (c, got) = load_with_retries_racing_with(0, async |c| match change {
            "invalidate" => invalidate(c, "k", None).await,
            "clear" => clear(c).await,
            _ => c.inner.resync().await,
        })
        .await;
        assert_eq!(
            got, "new",
            "{change}: returned what it read before the change"
        );
        assert_eq!(c.status().loads_superseded, 1, "{change}");
        assert_eq!(c.status().loads, 2, "{change}");
    }
}

#[tokio::test]
async fn a_loader_that_writes_its_own_key_is_returned_uncached_after_the_retries() {
    let c = SyncedCache::builder("t", moka::future::Cache::new(10))
        .max_load_retries(2)
        .build()
        .expect("valid settings");
    let loads = AtomicUsize::new(0);
    let got = c
        .get_with("k".to_string(), || async {
            loads.fetch_add(1, Relaxed);
            c.invalidate("k").await; // a write lands during every load
            "v".to_string()
        })
        .await;
    assert_eq!(got, "v");
    // Three unlocked loads, then one under the key's write lock, whose
    // loader still writes the key itself (it does not wait on itself).
    assert_eq!(loads.load(Relaxed), 4);
    assert_eq!(
        c.get("k").await,
        None,
        "a superseded result is never cached"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_loads_of_one_key_are_coalesced() {
    let c = cache();
    let loads = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (c, loads) = (c.clone(), loads.clone());
        tasks.push(tokio::spawn(async move {
            c.get_with("k".into(), || async {
                loads.fetch_add(1, Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
                "v".to_string()
            })
            .await
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), "v");
    }
    assert_eq!(loads.load(Relaxed), 1);
}

/// Writers on several threads at once: the decision against the version
/// table and moka's change must be one step per key, or a writer that
/// decided on an older version can insert after a newer one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parallel_versioned_refreshes_leave_the_newest_value() {
    const WRITERS: u64 = 4;
    const ROUNDS: u64 = 2000;
    // Room for every round's key: an eviction would look like a lost write.
    let c: Cache = SyncedCache::new("t", moka::future::Cache::new(10 * ROUNDS));
    let start = Arc::new(Barrier::new(WRITERS as usize));
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (c, start) = (c.clone(), start.clone());
            tokio::spawn(async move {
                // Each round, every writer refreshes the same fresh key at
                // once, each with its own version.
                for round in 0..ROUNDS {
                    start.wait().await;
                    let v = round * WRITERS + w + 1;
                    refresh(&c, &format!("k{round}"), &v.to_string(), Some(v)).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let mut wrong = Vec::new();
    for round in 0..ROUNDS {
        let newest = (round + 1) * WRITERS;
        let held = c.peek(&format!("k{round}")).await;
        if held != Some(newest.to_string()) {
            wrong.push((round, held));
        }
    }
    assert!(
        wrong.is_empty(),
        "keys not at their newest version: {wrong:?}"
    );
}

#[tokio::test]
async fn an_error_is_shared_with_waiters_and_not_cached() {
    let c = cache();
    let (release, released) = oneshot::channel::<()>();
    let leader = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut released = Some(released);
            c.try_get_with("k".into(), || {
                let r = released.take();
                async move {
                    if let Some(r) = r {
                        let _ = r.await;
                    }
                    Err::<String, _>("db down")
                }
            })
            .await
        })
    };
    tokio::task::yield_now().await;
    let follower = {
        let c = c.clone();
        tokio::spawn(async move {
            c.try_get_with("k".into(), || async { Ok::<_, &str>("unused".to_string()) })
                .await
        })
    };
    tokio::task::yield_now().await;
    release.send(()).unwrap();
    assert_eq!(*leader.await.unwrap().unwrap_err(), "db down");
    assert_eq!(*follower.await.unwrap().unwrap_err(), "db down");
    assert_eq!(c.get("k").await, None);
    assert_eq!(c.status().load_failures, 1);
}

#[tokio::test]
async fn a_cancelled_leader_does_not_strand_its_waiters() {
    let c = cache();
    let leader = {
        let c = c.clone();
        tokio::spawn(async move { c.get_with("k".into(), std::future::pending::<String>).await })
    };
    tokio::task::yield_now().await;
    let follower = {
        let c = c.clone();
        tokio::spawn(async move { c.get_with("k".into(), || async { "v".to_string() }).await })
    };
    tokio::task::yield_now().await;
    leader.abort();
    let got = tokio::time::timeout(Duration::from_secs(5), follower)
        .await
        .expect("follower hung");
    assert_eq!(got.unwrap(), "v");
}

#[tokio::test]
async fn older_refreshes_never_overwrite_newer_ones() {
    let c = cache();
    c.insert("k".into(), "loaded".into()).await;
    refresh(&c, "k", "v2", Some(2)).await;
    refresh(&c, "k", "v1", Some(1)).await;
    assert_eq!(c.get("k").await.as_deref(), Some("v2"));
    invalidate(&c, "k", Some(5)).await;
    refresh(&c, "k", "v4", Some(4)).await;
    assert_eq!(c.get("k").await, None, "the tombstone keeps v4 out");
    refresh(&c, "k", "v6", Some(6)).await;
    assert_eq!(c.get("k").await.as_deref(), Some("v6"));
    let s = c.status();
    assert_eq!(
        (s.refreshes, s.stale_ignored, s.invalidations, s.version),
        (2, 2, 1, Some(6))
    );
}

#[tokio::test]
async fn a_refresh_that_does_not_decode_becomes_an_invalidation() {
    let c = cache();
    c.insert("k".into(), "old".into()).await;
    let bad_value = bytes::Bytes::from_static(&[0xFF, 0xFF, 0xFF]);
    let change = Change::Refresh {
        entries: vec![
            EntryVersion {
                key: b("k"),
                value: bad_value,
                version: Some(3),
            },
            EntryVersion {
                key: b("j"),
                value: b("fine"),
                version: Some(3),
            },
        ],
    };
    apply(&c, &change).await;
    assert_eq!(c.get("k").await, None, "the old value must not survive");
    assert_eq!(
        c.get("j").await.as_deref(),
        Some("fine"),
        "the rest of the batch applies"
    );
    let s = c.status();
    assert_eq!((s.refresh_fallbacks, s.rejected_events), (1, 1));
}

#[tokio::test]
async fn a_key_that_does_not_decode_invalidates_the_whole_cache() {
    let c = cache();
    c.insert("a".into(), "1".into()).await;
    let change = Change::Invalidate {
        keys: vec![KeyVersion {
            key: b(&42u64),
            version: None,
        }],
    };
    apply(&c, &change).await;
    assert_eq!(c.get("a").await, None);
    assert_eq!(c.status().rejected_events, 1);
}

#[tokio::test]
async fn a_versioned_clear_keeps_older_refreshes_out() {
    let c = cache();
    c.insert("a".into(), "1".into()).await;
    apply(&c, &Change::Clear { version: Some(10) }).await;
    refresh(&c, "b", "old", Some(9)).await;
    refresh(&c, "c", "same", Some(10)).await;
    assert_eq!(c.get("a").await, None);
    assert_eq!(c.get("b").await, None);
    assert_eq!(c.get("c").await.as_deref(), Some("same"));
}

/// The floor's edge: a clear at the largest version keeps out every
/// refresh but one at that version itself, and nothing wraps.
#[tokio::test]
async fn a_versioned_clear_at_the_largest_version() {
    let c = cache();
    refresh(&c, "a", "1", Some(1)).await;
    apply(
        &c,
        &Change::Clear {
            version: Some(u64::MAX),
        },
    )
    .await;
    assert_eq!(c.get("a").await, None);
    refresh(&c, "a", "older", Some(u64::MAX - 1)).await;
    refresh(&c, "b", "older", Some(0)).await;
    assert_eq!((c.get("a").await, c.get("b").await), (None, None));
    assert_eq!(c.status().stale_ignored, 2);
    refresh(&c, "a", "at the floor", Some(u64::MAX)).await;
    assert_eq!(c.get("a").await.as_deref(), Some("at the floor"));
    // Nothing is newer than the largest version: a second refresh at it
    // is stale, and an invalidation at it still removes.
    refresh(&c, "a", "again", Some(u64::MAX)).await;
    assert_eq!(c.get("a").await.as_deref(), Some("at the floor"));
    invalidate(&c, "a", Some(u64::MAX)).await;
    assert_eq!(c.get("a").await, None);
    apply(
        &c,
        &Change::Clear {
            version: Some(u64::MAX),
        },
    )
    .await;
    assert_eq!(c.get("a").await, None);
}

#[tokio::test]
async fn reads_count_hits_and_misses() {
    let c = cache();
    assert_eq!(c.get("k").await, None);
    c.get_with("k".into(), || async { "v".to_string() }).await;
    c.get("k").await;
    let s = c.status();
    assert_eq!((s.hits, s.misses, s.loads), (1, 2, 1));
}

#[tokio::test(start_paused = true)]
async fn after_a_resync_versioned_refreshes_are_quarantined() {
    let c = cache();
    assert!(c.inner.claim(
        1,
        Duration::from_secs(10),
        std::sync::Arc::new(crate::cache::Housekeeper::start()),
        &crate::util::Moment::default(),
    ));
    c.inner.resync().await;
    refresh(&c, "k", "maybe older than what was lost", Some(10)).await;
    assert_eq!(c.get("k").await, None, "applied as an invalidation");
    refresh(&c, "u", "unversioned", None).await;
    assert_eq!(
        c.get("u").await.as_deref(),
        Some("unversioned"),
        "delivery order still holds"
    );
    tokio::time::advance(Duration::from_secs(11)).await;
    refresh(&c, "k", "after the window", Some(11)).await;
    assert_eq!(c.get("k").await.as_deref(), Some("after the window"));
    let s = c.status();
    assert_eq!((s.refreshes_quarantined, s.loss_resyncs), (1, 1));
}

/// A cache whose every load of a key is superseded until the locked last
/// one: with no retries, the first load's own invalidation sends the second
/// load under the pin.
pub(crate) fn locking_cache() -> Cache {
    SyncedCache::builder("t", moka::future::Cache::new(1000))
        .max_load_retries(0)
        .build()
        .expect("valid settings")
}

/// Spawns `c.get_with(key)` with a loader that waits for a signal, and
/// returns once that loader runs: the load's task, and the sender that
/// lets the loader return `value`. With `pinned`, the first load is
/// overtaken by its own invalidation, so on a cache with no retries
/// ([`locking_cache`]) the waiting load is the locked last one, with `key`
/// pinned.
pub(crate) async fn parked_load(
    c: &Cache,
    key: &str,
    value: &str,
    pinned: bool,
) -> (tokio::task::JoinHandle<String>, oneshot::Sender<()>) {
    let (parked_tx, parked_rx) = oneshot::channel::<()>();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let gates = Arc::new(Mutex::new((Some(parked_tx), Some(go_rx))));
    let calls = Arc::new(AtomicUsize::new(0));
    let (c2, key2, value) = (c.clone(), key.to_string(), value.to_string());
    let load = tokio::spawn({
        let c = c.clone();
        let key = key.to_string();
        async move {
            c.get_with(key, move || {
                let (c, key, value) = (c2.clone(), key2.clone(), value.clone());
                let (gates, calls) = (gates.clone(), calls.clone());
                async move {
                    if pinned && calls.fetch_add(1, Relaxed) == 0 {
                        c.invalidate(&key).await; // overtakes this load
                        return "first".to_string();
                    }
                    let (parked, go) = {
                        let mut g = lock(&gates);
                        (g.0.take().unwrap(), g.1.take().unwrap())
                    };
                    parked.send(()).unwrap();
                    go.await.unwrap();
                    value
                }
            })
            .await
        }
    });
    parked_rx.await.unwrap();
    (load, go_tx)
}

/// Holds one of `c`'s write stripes until the returned sender is used or
/// dropped, so a clear (a reset, a resync) waits in its barrier meanwhile:
/// for tests that need a registration or a resync to take a while (clears
/// do not wait for pinned loads).
pub(crate) async fn stall_clears(c: &Cache) -> oneshot::Sender<()> {
    let (release_tx, release_rx) = oneshot::channel::<()>();
    let (held_tx, held_rx) = oneshot::channel::<()>();
    let c = c.clone();
    tokio::spawn(async move {
        let _stripe = c.inner.write_locks[0].lock().await;
        held_tx.send(()).unwrap();
        let _ = release_rx.await;
    });
    held_rx.await.unwrap();
    release_tx
}

#[tokio::test(start_paused = true)]
async fn a_clear_waits_for_a_write_in_progress() {
    let c = cache();
    c.insert("k".into(), "v".into()).await;
    let release = stall_clears(&c).await;
    let reset = tokio::time::timeout(Duration::from_millis(50), c.inner.reset()).await;
    assert!(reset.is_err(), "the clear passed a held stripe");
    drop(release);
    c.inner.reset().await;
    assert_eq!(c.peek("k").await, None);
}

/// Keys other than `k` that share its write stripe, and some that do not.
fn neighbours(c: &Cache, k: &str) -> (Vec<String>, Vec<String>) {
    let stripe = c.inner.stripe(&k.to_string());
    (0..2000)
        .map(|i| format!("o{i}"))
        .partition(|o| c.inner.stripe(o) == stripe)
}

/// Guards against a last load that holds its key's whole write stripe
/// while the loader runs, making events for 1/64 of the cache's keys, and
/// the consumer behind them, wait for a slow loader. Only the key itself
/// may wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_load_holds_up_only_its_own_key() {
    let c = locking_cache();
    let (load, go_tx) = parked_load(&c, "k", "locked", true).await;
    let (same_stripe, others) = neighbours(&c, "k");
    assert!(!same_stripe.is_empty());
    let writes = async {
        for o in same_stripe.iter().chain(&others) {
            refresh(&c, o, "v", Some(1)).await;
            invalidate(&c, o, Some(2)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), writes)
        .await
        .expect("writes to other keys waited for the locked load");

    // An event for the key itself is parked, without holding up the
    // caller, and lands after the install.
    invalidate(&c, "k", Some(7)).await;
    assert!(c.inner.parked(), "a write to the pinned key went ahead");
    go_tx.send(()).unwrap();
    assert_eq!(load.await.unwrap(), "locked");
    tokio::time::timeout(Duration::from_secs(10), async {
        while c.inner.parked() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the parked invalidation was never applied");
    assert_eq!(c.get("k").await, None, "the invalidation came last");
    assert_eq!(c.status().loads, 2);
}

/// Guards against a deadlock: a locked load whose loader waits for another
/// task's load of a key in its stripe, which could not install if the
/// locked load held the stripe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_loader_may_wait_for_another_load_in_its_stripe() {
    let c = locking_cache();
    let k2 = neighbours(&c, "k").0[0].clone();
    // The other task leads a load of k2 that waits for a signal.
    let (other, release_tx) = parked_load(&c, &k2, "v2", false).await;
    let release = Arc::new(Mutex::new(Some(release_tx)));
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = c.clone();
    let first = c.get_with("k".to_string(), move || {
        let (c, release, calls, k2) = (c2.clone(), release.clone(), calls.clone(), k2.clone());
        async move {
            if calls.fetch_add(1, Relaxed) == 0 {
                c.invalidate("k").await;
                return "first".to_string();
            }
            // Locked: let the other load finish, and wait for its value.
            lock(&release).take().unwrap().send(()).unwrap();
            let v2 = c.get_with(k2, || async { "not this".to_string() }).await;
            format!("locked after {v2}")
        }
    });
    let got = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the locked load and the other load waited on each other");
    assert_eq!(got, "locked after v2");
    assert_eq!(other.await.unwrap(), "v2");
}

/// Locked loads that nest on one task: the inner loader writes the outer
/// load's key, and clears the cache, without waiting on its own task.
#[tokio::test]
async fn nested_locked_loads_do_not_wait_on_their_own_task() {
    let c = locking_cache();
    let calls = Arc::new(AtomicUsize::new(0));
    let c2 = c.clone();
    let outer = c.get_with("k1".to_string(), move || {
        let (c, calls) = (c2.clone(), calls.clone());
        async move {
            if calls.fetch_add(1, Relaxed) == 0 {
                c.invalidate("k1").await;
                return "first".to_string();
            }
            let inner_calls = AtomicUsize::new(0);
            let inner = c
                .get_with("k2".to_string(), || async {
                    if inner_calls.fetch_add(1, Relaxed) == 0 {
                        c.invalidate("k2").await;
                        return "first".to_string();
                    }
                    c.insert("k1".into(), "from the inner loader".into()).await;
                    c.invalidate_all().await;
                    "inner".to_string()
                })
                .await;
            format!("outer({inner})")
        }
    });
    let got = tokio::time::timeout(Duration::from_secs(10), outer)
        .await
        .expect("a nested locked load waited on its own task");
    assert_eq!(got, "outer(inner)");
    // Both loads were overtaken by the inner loader's own writes: returned,
    // never cached.
    assert_eq!(c.get("k1").await, None);
    assert_eq!(c.get("k2").await, None);
}

#[tokio::test]
async fn reads_take_borrowed_keys_and_iterate_as_moka_does() {
    let c = cache();
    c.insert("de".into(), "Germany".into()).await;
    c.insert("fr".into(), "France".into()).await;
    assert_eq!(c.get("de").await.as_deref(), Some("Germany"));
    assert_eq!(c.peek("fr").await.as_deref(), Some("France"));
    assert!(c.contains_key("de"));
    assert!(!c.contains_key("it"));
    let mut all: Vec<_> = c.iter().map(|(k, v)| ((*k).clone(), v)).collect();
    all.sort();
    assert_eq!(
        all,
        [
            ("de".into(), "Germany".into()),
            ("fr".into(), "France".into())
        ]
    );
    c.invalidate("de").await;
    assert!(!c.contains_key("de"));
    // get counts; peek, contains_key and iter do not.
    let s = c.status();
    assert_eq!((s.hits, s.misses), (1, 0));
}

/// Entries `k0`..`k9999`, each `v` at version 1: an event as large as a
/// node must apply without holding its worker.
fn ten_thousand_entries() -> Vec<EntryVersion> {
    (0..10_000)
        .map(|i| EntryVersion {
            key: b(&format!("k{i}")),
            value: b("v"),
            version: Some(1),
        })
        .collect()
}

/// Issue 36: applying an event of 10,000 entries never holds the worker
/// for all of them. On a runtime with one thread, a task that counts its
/// own polls runs between the entries: every 128 at most (the task's
/// cooperative budget, one unit per entry). Counted, not timed.
#[tokio::test(flavor = "current_thread")]
async fn a_ten_thousand_entry_event_is_applied_in_slices_with_yields_between() {
    let c = SyncedCache::new("t", moka::future::Cache::new(100_000));
    let entries = ten_thousand_entries();
    let polls = std::sync::Arc::new(AtomicUsize::new(0));
    let probe = tokio::spawn({
        let polls = polls.clone();
        async move {
            loop {
                polls.fetch_add(1, Relaxed);
                tokio::task::yield_now().await;
            }
        }
    });
    // Let the probe start, then count from here.
    tokio::task::yield_now().await;
    let before = polls.load(Relaxed);
    apply(&c, &Change::Refresh { entries }).await;
    let during = polls.load(Relaxed).saturating_sub(before);
    probe.abort();
    assert_eq!(c.peek(&"k9999".to_owned()).await.as_deref(), Some("v"));
    assert!(
        during >= 10_000 / 128 - 2,
        "the probe ran {during} times while 10,000 entries were applied"
    );
}

/// Issue 36: yielding on the budget alone does not let a busy runtime run
/// its timers: a worker whose queue never empties polls its driver only
/// every 61 tasks it runs. Applying a long event also yields with
/// `yield_now` every slice of work, after which the driver runs. On a
/// runtime of one worker, a task sleeping 1 ms at a time wakes many times
/// while another task applies 10,000 entries (some 100 ms in a debug
/// build); with the budget alone it woke once or twice.
#[test]
fn a_long_apply_lets_the_runtime_run_its_timers() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let c: Cache = SyncedCache::new("t", moka::future::Cache::new(100_000));
    let entries = ten_thousand_entries();
    let wakes = std::sync::Arc::new(AtomicUsize::new(0));
    let timer = rt.spawn({
        let wakes = wakes.clone();
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(1)).await;
                wakes.fetch_add(1, Relaxed);
            }
        }
    });
    // Let the timer start, then count from here.
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(5)).await });
    let yields_before = crate::util::PACE_YIELDS.load(Relaxed);
    let (during, cache) = rt
        .block_on(rt.spawn({
            let wakes = wakes.clone();
            async move {
                let before = wakes.load(Relaxed);
                apply(&c, &Change::Refresh { entries }).await;
                (wakes.load(Relaxed).saturating_sub(before), c)
            }
        }))
        .unwrap();
    timer.abort();
    assert_eq!(
        rt.block_on(cache.peek(&"k9999".to_owned())).as_deref(),
        Some("v")
    );
    assert!(crate::util::PACE_YIELDS.load(Relaxed) > yields_before);
    assert!(
        during >= 5,
        "the timer woke {during} times while 10,000 entries were applied"
    );
}

/// Issue 36: an auditor's sweep reads and orders every entry of the cache;
/// for 1M entries, a good part of a second. Done in slices, with a probe
/// task running between them on a one-thread runtime; and the order is a
/// full sort's.
#[tokio::test(flavor = "current_thread")]
async fn a_sweep_of_a_large_cache_is_read_and_ordered_in_slices() {
    let c = SyncedCache::new("t", moka::future::Cache::new(100_000));
    for i in 0..50_000 {
        c.insert(format!("k{i}"), "v".to_owned()).await;
    }
    c.inner.cache.run_pending_tasks().await;
    let polls = std::sync::Arc::new(AtomicUsize::new(0));
    let probe = tokio::spawn({
        let polls = polls.clone();
        async move {
            loop {
                polls.fetch_add(1, Relaxed);
                tokio::task::yield_now().await;
            }
        }
    });
    tokio::task::yield_now().await;
    let before = polls.load(Relaxed);
    let ordered = c.inner.in_hash_order(|_| ()).await;
    let during = polls.load(Relaxed).saturating_sub(before);
    probe.abort();
    assert_eq!(ordered.len(), 50_000);
    let hashes: Vec<u64> = ordered
        .iter()
        .map(|(k, ())| std::hash::BuildHasher::hash_one(&c.inner.hasher, &**k))
        .collect();
    assert!(
        hashes.windows(2).all(|w| w[0] >= w[1]),
        "descending hash order"
    );
    assert!(
        during >= 50_000 / 128 - 2,
        "the probe ran {during} times while 50,000 entries were read"
    );
}
