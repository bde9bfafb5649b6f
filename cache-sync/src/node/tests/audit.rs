//! The consistency auditor on running nodes: a write that bypassed the
//! publisher is found, counted exactly and repaired; events in flight are
//! not held against a node; a bad source is counted, backed off, and
//! repairs nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};
use std::time::Duration;

use super::*;
use crate::Audit;
use crate::status::{AuditStatus, TraceEvent};

use super::cluster::start;

/// The source of truth: rows with the version of their last write.
#[derive(Default)]
struct Db {
    rows: Mutex<HashMap<String, (String, u64)>>,
    /// How the next reads answer (see `Mode`).
    mode: AtomicU8,
}

/// How the source answers reads.
#[repr(u8)]
enum Mode {
    Truthful = 0,
    Fails = 1,
    Hangs = 2,
    /// Answers for a key it was not asked for, with a version above all.
    Unasked = 3,
    /// Answers one key twice.
    Twice = 4,
    /// Panics.
    Panics = 5,
}

impl Db {
    fn write(&self, key: &str, value: &str, version: u64) {
        self.rows
            .lock()
            .unwrap()
            .insert(key.to_owned(), (value.to_owned(), version));
    }

    fn row(&self, key: &str) -> Option<(String, u64)> {
        self.rows.lock().unwrap().get(key).cloned()
    }

    fn set(&self, mode: Mode) {
        self.mode.store(mode as u8, Relaxed);
    }

    fn audit(self: &Arc<Self>) -> Audit<String, String> {
        let db = self.clone();
        Audit::versioned(move |keys: Vec<String>| {
            let db = db.clone();
            async move {
                match db.mode.load(Relaxed) {
                    1 => return Err("connection refused"),
                    2 => std::future::pending::<()>().await,
                    3 => return Ok(vec![("not-asked".into(), Some(("x".into(), u64::MAX)))]),
                    4 => {
                        let k = keys[0].clone();
                        return Ok(vec![(k.clone(), None), (k, None)]);
                    }
                    5 => panic!("the source's driver panicked"),
                    _ => {}
                }
                Ok(keys
                    .into_iter()
                    .map(|k| {
                        let row = db.row(&k);
                        (k, row)
                    })
                    .collect())
            }
        })
    }
}

fn audited(
    db: &Arc<Db>,
    configure: impl FnOnce(Audit<String, String>) -> Audit<String, String>,
) -> Cache {
    SyncedCache::builder("countries", moka::future::Cache::new(100_000))
        .trace_bytes(1 << 20)
        .audit(configure(db.audit()))
        .build()
        .unwrap()
}

fn audit<V: Clone + Send + Sync + 'static>(c: &SyncedCache<String, V>) -> AuditStatus {
    c.status().audit.expect("audited")
}

/// Publishes `n` rows, versioned, written to the source first as a writer
/// would, and waits until every cache holds them.
async fn seed(db: &Db, publisher: &Publisher, caches: &[&Cache], n: usize) {
    let rows: Vec<(String, String, Option<u64>)> = (0..n)
        .map(|i| (format!("k{i}"), format!("v{i}"), Some(1)))
        .collect();
    for (k, v, _) in &rows {
        db.write(k, v, 1);
    }
    for chunk in rows.chunks(500) {
        publisher
            .insert_versioned("countries", chunk.to_vec())
            .await
            .unwrap();
    }
    for c in caches {
        eventually("every row applied", async || {
            c.status().refreshes >= n as u64
        })
        .await;
    }
}

/// The case: three writes bypass the publisher; every node that
/// held the keys reports exactly three inconsistencies, within the bound
/// (a sweep, 1.25 × entries ÷ rate, plus the grace window, plus a round),
/// repairs them, and then loads the source's rows. The other keys, which
/// the source agrees with, are never suspects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_that_bypassed_the_publisher_are_found_counted_exactly_and_repaired() {
    let db = Arc::new(Db::default());
    let (entries, rate, grace) = (1000, 2000, Duration::from_millis(300));
    let caches: Vec<Cache> = (0..3)
        .map(|_| audited(&db, |a| a.rate(rate).batch(100).grace(grace)))
        .collect();
    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    for (i, c) in caches.iter().enumerate() {
        nodes.push(start(&format!("n{i}"), transport.clone(), &[c]).await);
    }
    let publisher = Publisher::new(transport.clone());
    let refs: Vec<&Cache> = caches.iter().collect();
    seed(&db, &publisher, &refs, entries).await;
    // A sweep has run over the seeded rows: none is behind.
    for c in &caches {
        eventually("a whole sweep", async || audit(c).checks >= entries as u64).await;
        let a = audit(c);
        assert_eq!((a.suspects, a.inconsistencies), (0, 0), "{a:?}");
    }

    let bypassed = ["k7", "k500", "k999"];
    let at = tokio::time::Instant::now();
    for k in bypassed {
        db.write(k, "changed behind its back", 2);
    }
    let bound = Duration::from_secs_f64(1.25 * entries as f64 / f64::from(rate))
        + grace
        + Duration::from_secs_f64(1.25 * 100.0 / f64::from(rate));
    for c in &caches {
        eventually("three inconsistencies", async || {
            audit(c).inconsistencies >= 3
        })
        .await;
    }
    let took = at.elapsed();
    // Room for a loaded machine: the bound is the design's, not a timing
    // target (docs/benchmarks.md has the measured figures).
    assert!(
        took < bound + Duration::from_secs(3),
        "took {took:?}, bound {bound:?}"
    );
    // Two more sweeps: still exactly three, and each repaired.
    let checks = audit(&caches[0]).checks;
    eventually("two more sweeps", async || {
        audit(&caches[0]).checks >= checks + 2 * entries as u64
    })
    .await;
    for c in &caches {
        let a = audit(c);
        assert_eq!((a.inconsistencies, a.repairs), (3, 3), "{a:?}");
        assert!(a.max_stale_age_ms.is_some_and(|ms| ms >= 300), "{a:?}");
        assert_eq!(a.window_inconsistencies, 3);
        assert!(a.nines().is_some_and(|n| n > 0.0));
        for k in bypassed {
            assert_eq!(c.peek(k).await, None, "{k} repaired by removal");
            let trace = c.trace(k);
            assert_eq!(
                trace.last().map(|r| (r.event, r.version)),
                Some((TraceEvent::Repaired, Some(2))),
                "{trace:?}"
            );
            let v = c
                .get_with_versioned(k.to_owned(), || async {
                    let (v, version) = db.row(k).unwrap();
                    (v, version)
                })
                .await;
            assert_eq!(v, "changed behind its back");
        }
        assert_eq!(c.peek("k8").await.as_deref(), Some("v8"), "untouched");
    }
    for n in nodes {
        n.shutdown().await.unwrap();
    }
}

/// Events held back in transit make suspects that clear when they land,
/// however long they were held: past the grace window, the node must show
/// that its link delivers (its marker comes back) before anything counts,
/// and a stalled link, which the node cannot tell from a quiet one, does
/// not return it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_held_in_flight_past_the_grace_window_are_no_inconsistency() {
    let db = Arc::new(Db::default());
    let grace = Duration::from_millis(200);
    let c = audited(&db, |a| {
        a.rate(5000)
            .batch(50)
            .grace(grace)
            .timeout(Duration::from_millis(200))
    });
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let node = start("n", transport.clone(), &[&c]).await;
    let publisher = Publisher::new(transport.inner());
    seed(&db, &publisher, &[&c], 200).await;

    transport.stall(true);
    for i in 0..50 {
        let k = format!("k{i}");
        db.write(&k, "new", 2);
        publisher
            .insert_versioned("countries", [(k, "new".to_owned(), Some(2))])
            .await
            .unwrap();
    }
    eventually("suspects", async || audit(&c).suspects >= 50).await;
    // Ten grace windows, the node ready all along.
    tokio::time::sleep(grace * 10).await;
    assert!(node.is_ready());
    let a = audit(&c);
    assert_eq!((a.inconsistencies, a.suspects_pending), (0, 50), "{a:?}");
    transport.stall(false);
    eventually("every event applied", async || {
        c.peek("k49").await.as_deref() == Some("new")
    })
    .await;
    eventually("every suspect judged", async || {
        let a = audit(&c);
        a.suspects_pending == 0 && a.suspects_cleared >= 50
    })
    .await;
    let a = audit(&c);
    assert_eq!((a.inconsistencies, a.repairs), (0, 0), "{a:?}");
    node.shutdown().await.unwrap();
}

/// A source that fails, hangs, panics, or answers for keys it was not
/// asked (or one twice) is counted, backed off (doubling from one round's pace), and
/// repairs nothing, even though the bad answers name versions above
/// everything the node holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_source_is_counted_backed_off_and_repairs_nothing() {
    let modes = [
        Mode::Fails,
        Mode::Hangs,
        Mode::Unasked,
        Mode::Twice,
        Mode::Panics,
    ];
    for label in modes.map(|m| m as u8) {
        let db = Arc::new(Db::default());
        // A round every 10 ms while the source answers.
        let c = audited(&db, |a| {
            a.rate(1000)
                .batch(10)
                .grace(Duration::ZERO)
                .timeout(Duration::from_millis(20))
        });
        let transport = EmbeddedTransport::new();
        let node = start("n", transport.clone(), &[&c]).await;
        seed(&db, &Publisher::new(transport.clone()), &[&c], 100).await;
        eventually("a round", async || audit(&c).source_reads > 0).await;
        db.mode.store(label, Relaxed);
        // Every row differs now: only a read that answered could say so.
        for i in 0..100 {
            db.write(&format!("k{i}"), "other", 9);
        }
        let before = audit(&c);
        eventually("failures", async || {
            audit(&c).source_failures >= before.source_failures + 3
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let a = audit(&c);
        assert_eq!(
            (a.inconsistencies, a.repairs),
            (0, 0),
            "mode {label}: {a:?}"
        );
        // Doubling from 10 ms, 1.5 s holds at most 8 reads (10, 20, ... 1280
        // ms); unbacked, it would be about 150.
        let reads = a.source_reads - before.source_reads;
        assert!(reads <= 10, "mode {label}: {reads} reads: {a:?}");
        assert_eq!(c.iter().count(), 100, "mode {label}");
        // Back to the truth: every row is behind, and found.
        db.set(Mode::Truthful);
        eventually("found once the source answers", async || {
            audit(&c).inconsistencies == 100
        })
        .await;
        node.shutdown().await.unwrap();
    }
}

/// The auditor reads nothing while the node is not ready (here: a cache
/// registered late is quarantined for the reorder window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_read_while_the_node_is_not_ready() {
    let db = Arc::new(Db::default());
    let c = audited(&db, |a| a.rate(1000).batch(10));
    let transport = EmbeddedTransport::new();
    let node = Node::builder("n", transport.clone())
        .reorder_window(Duration::from_millis(800))
        .start()
        .await
        .unwrap();
    node.register(&c).await.unwrap();
    let registered = tokio::time::Instant::now();
    assert!(!node.is_ready());
    eventually("ready", async || node.is_ready()).await;
    assert!(registered.elapsed() >= Duration::from_millis(700));
    assert_eq!(audit(&c).source_reads, 0, "read while not ready");
    // An empty cache reads nothing either; one entry, and it is read.
    db.write("k", "v", 1);
    c.get_with_versioned("k".to_owned(), || async { ("v".to_owned(), 1) })
        .await;
    eventually("a read", async || audit(&c).source_reads > 0).await;
    node.shutdown().await.unwrap();
}

/// Values compared, for a source without versions: a local insert that
/// differs from the source is found, and one that agrees is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_without_versions_is_compared_by_value() {
    let source: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let read = source.clone();
    let c: Cache = SyncedCache::builder("countries", moka::future::Cache::new(100))
        .audit(
            Audit::by_value(move |keys: Vec<String>| {
                let read = read.clone();
                async move {
                    let rows = read.lock().unwrap();
                    Ok::<_, std::convert::Infallible>(
                        keys.into_iter()
                            .map(|k| {
                                let v = rows.get(&k).cloned();
                                (k, v)
                            })
                            .collect(),
                    )
                }
            })
            .rate(1000)
            .batch(10)
            .grace(Duration::from_millis(100)),
        )
        .build()
        .unwrap();
    let node = start("n", EmbeddedTransport::new(), &[&c]).await;
    source.lock().unwrap().insert("a".into(), "1".into());
    source.lock().unwrap().insert("b".into(), "2".into());
    c.insert("a".into(), "1".into()).await;
    c.insert("b".into(), "wrong".into()).await;
    c.insert("gone".into(), "x".into()).await;
    eventually("two inconsistencies", async || {
        audit(&c).inconsistencies == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = audit(&c);
    assert_eq!(
        (a.inconsistencies, a.repairs, a.unverified),
        (2, 2, 0),
        "{a:?}"
    );
    assert_eq!(c.peek("a").await.as_deref(), Some("1"));
    assert_eq!(c.peek("b").await, None);
    assert_eq!(c.peek("gone").await, None);
    node.shutdown().await.unwrap();
}

/// Issue 35, item 10: a value equal to the source's is no inconsistency,
/// even where `PartialEq` says otherwise: a NaN, alone or in a value
/// (`NaN != NaN`), was removed on every sweep. A value that truly differs
/// (here beside a NaN) still is one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nan_held_by_the_node_and_the_source_is_no_inconsistency() {
    type Row = (f64, u32);
    let source: Arc<Mutex<HashMap<String, Row>>> = Arc::default();
    let read = source.clone();
    let c: SyncedCache<String, Row> = SyncedCache::builder("rows", moka::future::Cache::new(100))
        .audit(
            Audit::by_value(move |keys: Vec<String>| {
                let read = read.clone();
                async move {
                    let rows = read.lock().unwrap();
                    Ok::<_, std::convert::Infallible>(
                        keys.into_iter()
                            .map(|k| {
                                let v = rows.get(&k).copied();
                                (k, v)
                            })
                            .collect(),
                    )
                }
            })
            .rate(1000)
            .batch(10)
            .grace(Duration::from_millis(100)),
        )
        .build()
        .unwrap();
    let node = Node::builder("n", EmbeddedTransport::new())
        .reorder_window(Duration::ZERO)
        .register(&c)
        .start()
        .await
        .unwrap();
    for (k, held, row) in [
        ("nan", (f64::NAN, 1), (f64::NAN, 1)),
        ("plain", (0.5, 1), (0.5, 1)),
        ("differs", (f64::NAN, 1), (f64::NAN, 2)),
        // Equal by `PartialEq`, not by encoding: the fingerprints differ,
        // so the value is read and compared as `compare_values` says.
        ("signed zero", (0.0, 1), (-0.0, 1)),
    ] {
        source.lock().unwrap().insert(k.into(), row);
        c.insert(k.into(), held).await;
    }
    eventually("the differing value found", async || {
        c.status().audit.unwrap().inconsistencies >= 1
    })
    .await;
    // Three more sweeps, each judging the NaN again.
    let sweeps = c.status().audit.unwrap().sweeps;
    eventually("three more sweeps", async || {
        c.status().audit.unwrap().sweeps >= sweeps + 3
    })
    .await;
    let a = c.status().audit.unwrap();
    // The one that differs is the one suspect: the signed zero, read and
    // compared by `PartialEq`, agrees at once, not after a second look.
    assert_eq!(
        (a.inconsistencies, a.repairs, a.suspects),
        (1, 1, 1),
        "{a:?}"
    );
    assert!(
        c.peek("nan")
            .await
            .is_some_and(|(v, n)| v.is_nan() && n == 1)
    );
    assert_eq!(c.peek("plain").await, Some((0.5, 1)));
    assert!(
        c.peek("signed zero")
            .await
            .is_some_and(|(v, n)| v == 0.0 && v.is_sign_positive() && n == 1)
    );
    assert_eq!(c.peek("differs").await, None, "repaired");
    node.shutdown().await.unwrap();
}

/// Issue 35, item 8: the auditor reads values (`by_value`,
/// `compare_values`) without counting an access, so entries that agree with
/// the source still idle out. Its reads with moka's `get` restarted every
/// entry's time-to-idle at each sweep: audited entries never idled out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audited_entries_still_idle_out() {
    let entries = 50;
    let rows: Arc<HashMap<String, String>> = Arc::new(
        (0..entries)
            .map(|i| (format!("k{i}"), format!("v{i}")))
            .collect(),
    );
    for compare in ["by_value", "compare_values"] {
        let read = rows.clone();
        let by_value = Audit::by_value(move |keys: Vec<String>| {
            let read = read.clone();
            async move {
                Ok::<_, std::convert::Infallible>(
                    keys.into_iter()
                        .map(|k| {
                            let v = read.get(&k).cloned();
                            (k, v)
                        })
                        .collect(),
                )
            }
        });
        let read = rows.clone();
        let versioned = Audit::versioned(move |keys: Vec<String>| {
            let read = read.clone();
            async move {
                Ok::<_, std::convert::Infallible>(
                    keys.into_iter()
                        .map(|k| {
                            let v = read.get(&k).map(|v| (v.clone(), 1));
                            (k, v)
                        })
                        .collect(),
                )
            }
        })
        .compare_values();
        let auditor = if compare == "by_value" {
            by_value
        } else {
            versioned
        };
        let moka = moka::future::Cache::builder()
            .max_capacity(1000)
            .time_to_idle(Duration::from_secs(1))
            .build();
        let c: Cache = SyncedCache::builder("countries", moka)
            .audit(
                auditor
                    .rate(10_000)
                    .batch(10)
                    .grace(Duration::from_secs(60)),
            )
            .build()
            .unwrap();
        let node = start("n", EmbeddedTransport::new(), &[&c]).await;
        for (k, v) in rows.iter() {
            c.insert(k.clone(), v.clone()).await;
        }
        // Sweeps far more often than the idle time, every entry agreeing.
        eventually("ten sweeps", async || {
            audit(&c).checks >= 10 * entries as u64
        })
        .await;
        let a = audit(&c);
        assert_eq!((a.suspects, a.inconsistencies), (0, 0), "{compare}: {a:?}");
        // `contains_key` counts no access either.
        eventually("every entry idled out", async || {
            rows.keys().all(|k| !c.contains_key(k))
        })
        .await;
        node.shutdown().await.unwrap();
    }
}

/// Issue 35, item 8, with values equal only by their encoding (a NaN,
/// which `PartialEq` calls unequal to itself): the sweep's fingerprint of
/// the value matches the row's, so the entry agrees with no `get`, and
/// entries still idle out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_equal_to_the_source_only_by_encoding_still_idle_out() {
    type Row = (f64, u32);
    let entries = 50u32;
    let rows: Arc<HashMap<String, Row>> = Arc::new(
        (0..entries)
            .map(|i| (format!("k{i}"), (f64::NAN, i)))
            .collect(),
    );
    let read = rows.clone();
    let moka = moka::future::Cache::builder()
        .max_capacity(1000)
        .time_to_idle(Duration::from_secs(1))
        .build();
    let c: SyncedCache<String, Row> = SyncedCache::builder("rows", moka)
        .audit(
            Audit::by_value(move |keys: Vec<String>| {
                let read = read.clone();
                async move {
                    Ok::<_, std::convert::Infallible>(
                        keys.into_iter()
                            .map(|k| {
                                let v = read.get(&k).copied();
                                (k, v)
                            })
                            .collect(),
                    )
                }
            })
            .rate(10_000)
            .batch(10)
            .grace(Duration::from_secs(60)),
        )
        .build()
        .unwrap();
    let node = Node::builder("n", EmbeddedTransport::new())
        .reorder_window(Duration::ZERO)
        .register(&c)
        .start()
        .await
        .unwrap();
    for (k, v) in rows.iter() {
        c.insert(k.clone(), *v).await;
    }
    eventually("ten sweeps", async || {
        audit(&c).checks >= 10 * u64::from(entries)
    })
    .await;
    let a = audit(&c);
    assert_eq!((a.suspects, a.inconsistencies), (0, 0), "{a:?}");
    eventually("every entry idled out", async || {
        rows.keys().all(|k| !c.contains_key(k))
    })
    .await;
    node.shutdown().await.unwrap();
}

/// A value that counts its live copies: every clone shares `_copies`, which
/// the encoding and the equality leave out.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
struct Counted {
    value: String,
    /// Held, never read: its strong count is the number of copies.
    #[serde(skip)]
    _copies: Arc<()>,
}

impl PartialEq for Counted {
    fn eq(&self, other: &Self) -> bool {
        self.value == other.value
    }
}

/// A sweep that compares values keeps a fingerprint of each, not a copy:
/// once the node lets go of its entries, no copy of their values is left,
/// though the sweep that began with them has most of its keys ahead of it.
/// (It kept a copy of every value until it reached its key: twice the
/// values' memory for up to a sweep, and values of removed keys alive.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_keeps_no_copy_of_the_values() {
    let entries = 20;
    let source: Arc<HashMap<String, String>> = Arc::new(
        (0..entries)
            .map(|i| (format!("k{i}"), format!("v{i}")))
            .collect(),
    );
    let read = source.clone();
    let moka = moka::future::Cache::new(1000);
    // One key a round, a round a second or so: the sweep lasts about 20 s.
    let c: SyncedCache<String, Counted> = SyncedCache::builder("rows", moka.clone())
        .audit(
            Audit::by_value(move |keys: Vec<String>| {
                let read = read.clone();
                async move {
                    Ok::<_, std::convert::Infallible>(
                        keys.into_iter()
                            .map(|k| {
                                let v = read.get(&k).map(|v| Counted {
                                    value: v.clone(),
                                    _copies: Arc::default(),
                                });
                                (k, v)
                            })
                            .collect(),
                    )
                }
            })
            .rate(1)
            .batch(1)
            .grace(Duration::from_secs(60)),
        )
        .build()
        .unwrap();
    let node = Node::builder("n", EmbeddedTransport::new())
        .reorder_window(Duration::ZERO)
        .register(&c)
        .start()
        .await
        .unwrap();
    let copies = Arc::new(());
    for (k, v) in source.iter() {
        let value = Counted {
            value: v.clone(),
            _copies: copies.clone(),
        };
        c.insert(k.clone(), value).await;
    }
    eventually("a sweep begun", async || audit(&c).sweeps >= 1).await;
    for k in source.keys() {
        c.invalidate(k).await;
    }
    eventually("no copy of the values left", async || {
        moka.run_pending_tasks().await;
        Arc::strong_count(&copies) == 1
    })
    .await;
    let a = audit(&c);
    assert!(
        a.sweeps == 1 && a.checks < entries,
        "still the first sweep: {a:?}"
    );
    assert_eq!((a.suspects, a.inconsistencies), (0, 0), "{a:?}");
    node.shutdown().await.unwrap();
}

/// An entry whose fingerprint differs from the source's row is read with
/// `get` after the row: a write to the key landing in between (here, the
/// source changes again and the node takes the new value, right after
/// the auditor read the row) is not judged against the older row, so it
/// makes not even a suspect; the next sweep finds the two agreeing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_after_the_source_was_read_is_not_judged_against_it() {
    let source: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let node_cache: Arc<std::sync::OnceLock<Cache>> = Arc::default();
    let written = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (read, cache, once) = (source.clone(), node_cache.clone(), written.clone());
    let c: Cache = SyncedCache::builder("countries", moka::future::Cache::new(100))
        .audit(
            Audit::by_value(move |keys: Vec<String>| {
                let (read, cache, once) = (read.clone(), cache.clone(), once.clone());
                async move {
                    let rows: Vec<(String, Option<String>)> = {
                        let rows = read.lock().unwrap();
                        keys.iter()
                            .map(|k| (k.clone(), rows.get(k).cloned()))
                            .collect()
                    };
                    if keys.iter().any(|k| k == "k") && !once.swap(true, Relaxed) {
                        read.lock().unwrap().insert("k".into(), "newer".into());
                        let c = cache.get().expect("set before the node started");
                        c.insert("k".into(), "newer".into()).await;
                    }
                    Ok::<_, std::convert::Infallible>(rows)
                }
            })
            .rate(1000)
            .batch(10)
            .grace(Duration::from_millis(100)),
        )
        .build()
        .unwrap();
    assert!(node_cache.set(c.clone()).is_ok(), "set once");
    let node = start("n", EmbeddedTransport::new(), &[&c]).await;
    // The source changed to "new"; its event has not reached the node.
    source.lock().unwrap().insert("k".into(), "new".into());
    c.insert("k".into(), "old".into()).await;
    eventually("the write after the read", async || written.load(Relaxed)).await;
    let sweeps = audit(&c).sweeps;
    eventually("two more sweeps", async || audit(&c).sweeps >= sweeps + 2).await;
    let a = audit(&c);
    assert_eq!((a.suspects, a.inconsistencies), (0, 0), "{a:?}");
    assert!(a.checks >= 1, "{a:?}");
    assert_eq!(c.peek("k").await.as_deref(), Some("newer"));
    node.shutdown().await.unwrap();
}

/// Held without a version, and values not compared: counted as
/// unverified, never a suspect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_without_a_version_are_unverified_unless_values_are_compared() {
    let db = Arc::new(Db::default());
    let c = audited(&db, |a| a.rate(1000).batch(10).grace(Duration::ZERO));
    let node = start("n", EmbeddedTransport::new(), &[&c]).await;
    db.write("k", "source", 5);
    c.insert("k".into(), "local".into()).await;
    eventually("unverified", async || audit(&c).unverified >= 2).await;
    let a = audit(&c);
    assert_eq!(
        (a.checks, a.suspects, a.inconsistencies),
        (0, 0, 0),
        "{a:?}"
    );
    node.shutdown().await.unwrap();
}

/// Settings out of range are refused at build; the edges are taken.
#[test]
fn audit_settings_are_checked_at_build() {
    let db = Arc::new(Db::default());
    let build = |f: fn(Audit<String, String>) -> Audit<String, String>| {
        SyncedCache::builder("c", moka::future::Cache::new(1))
            .audit(f(db.audit()))
            .build()
    };
    for bad in [
        build(|a| a.rate(0)),
        build(|a| a.batch(0)),
        build(|a| a.batch(10_001)),
        build(|a| a.timeout(Duration::ZERO)),
        build(|a| a.timeout(Duration::MAX)),
        build(|a| a.window(Duration::from_secs(59))),
        build(|a| a.window(Duration::MAX)),
    ] {
        assert!(bad.unwrap_err().is_config());
    }
    for good in [
        build(|a| a.rate(1).batch(1)),
        build(|a| a.rate(u32::MAX).batch(10_000)),
        build(|a| a.grace(Duration::ZERO)),
        build(|a| a.grace(Duration::MAX)),
        build(|a| a.timeout(Duration::from_millis(1))),
        build(|a| a.window(Duration::from_secs(60))),
        build(|a| a.window(Duration::from_secs(30 * 86_400))),
    ] {
        good.unwrap();
    }
}

/// A grace window of `Duration::MAX` never confirms a suspect (and never
/// overflows the clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_grace_window_confirms_nothing() {
    let db = Arc::new(Db::default());
    let c = audited(&db, |a| a.rate(1000).batch(10).grace(Duration::MAX));
    let node = start("n", EmbeddedTransport::new(), &[&c]).await;
    db.write("k", "new", 7);
    c.get_with_versioned("k".to_owned(), || async { ("old".to_owned(), 3) })
        .await;
    eventually("a suspect", async || audit(&c).suspects_pending == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = audit(&c);
    assert_eq!((a.suspects, a.inconsistencies), (1, 0), "{a:?}");
    node.shutdown().await.unwrap();
}

/// What one node's auditor found travels in its heartbeat: another node's
/// cluster view (JSON) and page show it, and a cache not audited shows none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_view_and_page_show_each_nodes_audit() {
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let db = Arc::new(Db::default());
    let audited_cache = audited(&db, |a| a.rate(1000).batch(10).grace(Duration::ZERO));
    let plain = cache("countries");
    let transport = EmbeddedTransport::new();
    let a = start("a", transport.clone(), &[&audited_cache]).await;
    let b = start("b", transport.clone(), &[&plain]).await;
    db.write("k", "new", 2);
    audited_cache
        .get_with_versioned("k".to_owned(), || async { ("old".to_owned(), 1) })
        .await;
    eventually("b sees a's inconsistency", async || {
        b.cluster().view().nodes.iter().any(|n| {
            n.node_id == "a"
                && n.caches[0]
                    .audit
                    .as_ref()
                    .is_some_and(|x| x.inconsistencies == 1 && x.window_checks >= 1)
        })
    })
    .await;
    let view = b.cluster().view();
    let of_b = view.nodes.iter().find(|n| n.node_id == "b").unwrap();
    assert_eq!(of_b.caches[0].audit, None);
    let json = serde_json::to_value(&view).unwrap();
    assert!(json.to_string().contains("\"inconsistencies\":1"), "{json}");

    let response = b
        .status_router()
        .oneshot(
            axum::http::Request::get("/cache-sync/")
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let html = response.into_body().collect().await.unwrap().to_bytes();
    let html = String::from_utf8(html.to_vec()).unwrap();
    assert!(
        html.contains("audited: 1 inconsistent in 1 checks over 1 h 0 min"),
        "{html}"
    );
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// A marker counts as back only once the events read before it are
/// applied: a batch whose last events are the ones the suspects wait for,
/// applied while local writes contend for the stripes, makes no
/// inconsistency. (Found by review: the marker was noted when read, before
/// the run of events ahead of it in its batch was applied, and 4 runs in 5
/// counted 100 inconsistencies.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_is_back_only_after_the_events_before_it_are_applied() {
    let db = Arc::new(Db::default());
    let grace = Duration::from_millis(100);
    let c = audited(&db, |a| {
        a.rate(100_000)
            .batch(100)
            .grace(grace)
            .timeout(Duration::from_secs(3))
    });
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let node = Node::builder("n", transport.clone())
        .reorder_window(Duration::ZERO)
        .max_batch(100_000)
        .register(&c)
        .start()
        .await
        .unwrap();
    let publisher = Publisher::new(transport.inner());
    seed(&db, &publisher, &[&c], 100).await;
    transport.stall(true);
    // Filler: many events for keys the auditor does not look at.
    for chunk in 0..40 {
        let rows: Vec<(String, String, Option<u64>)> = (0..500)
            .map(|i| (format!("f{chunk}-{i}"), "x".to_owned(), Some(1)))
            .collect();
        for (k, _, _) in &rows {
            db.write(k, "x", 1);
        }
        publisher.insert_versioned("countries", rows).await.unwrap();
    }
    for i in 0..100 {
        let k = format!("k{i}");
        db.write(&k, "new", 2);
    }
    let rows: Vec<(String, String, Option<u64>)> = (0..100)
        .map(|i| (format!("k{i}"), "new".to_owned(), Some(2)))
        .collect();
    publisher.insert_versioned("countries", rows).await.unwrap();
    eventually("suspects", async || audit(&c).suspects >= 100).await;
    tokio::time::sleep(grace * 5).await;
    // The application at work: local writes to other keys, as loads and
    // inserts do, now and then meeting the consumer on a stripe.
    for i in 0..1000 {
        db.write(&format!("local{i}"), "l", 1);
    }
    let busy = {
        let c = c.clone();
        tokio::spawn(async move {
            for i in 0u64.. {
                c.insert(format!("local{}", i % 1000), "l".to_owned()).await;
                if i % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    transport.stall(false);
    eventually("every event applied", async || {
        c.peek("k99").await.as_deref() == Some("new")
    })
    .await;
    eventually_within(
        "every suspect judged",
        Duration::from_secs(30),
        async || {
            let a = audit(&c);
            a.suspects_pending == 0
        },
    )
    .await;
    let a = audit(&c);
    busy.abort();
    assert_eq!((a.inconsistencies, a.repairs), (0, 0), "{a:?}");
    node.shutdown().await.unwrap();
}

/// A value loaded without a version after a resync is not judged by the
/// version recorded for the value before it: an event is lost, the gap
/// resyncs the cache, and a plain `get_with` loads the source's row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_load_after_a_resync_is_not_judged_by_an_older_version() {
    let db = Arc::new(Db::default());
    let c = audited(&db, |a| {
        a.rate(1000).batch(10).grace(Duration::from_millis(200))
    });
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let node = start("n", transport.clone(), &[&c]).await;
    let publisher = Publisher::new(transport.inner());
    seed(&db, &publisher, &[&c], 10).await;
    // k1 written at version 2; its event is lost on the way to this node.
    db.write("k1", "two", 2);
    transport.drop_records(1);
    publisher
        .insert_versioned("countries", [("k1".to_owned(), "two".to_owned(), Some(2))])
        .await
        .unwrap();
    // The next event shows the gap: the cache is resynced.
    db.write("k2", "two", 2);
    publisher
        .insert_versioned("countries", [("k2".to_owned(), "two".to_owned(), Some(2))])
        .await
        .unwrap();
    eventually("resynced", async || c.status().loss_resyncs >= 1).await;
    eventually("ready", async || node.is_ready()).await;
    // The application reads k1 through: the source's current row.
    let d = db.clone();
    let v = c
        .get_with("k1".to_owned(), || {
            let d = d.clone();
            async move { d.row("k1").unwrap().0 }
        })
        .await;
    assert_eq!(v, "two");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let a = audit(&c);
    assert_eq!(a.inconsistencies, 0, "{a:?}");
    node.shutdown().await.unwrap();
}

/// Nor is one loaded without a version after an unversioned invalidation:
/// a versioned refresh, then a write published as a plain invalidation,
/// then a plain `get_with`; every event delivered, nothing bypassed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_load_after_an_invalidation_is_not_judged_by_an_older_version() {
    let db = Arc::new(Db::default());
    let c = audited(&db, |a| {
        a.rate(1000).batch(10).grace(Duration::from_millis(200))
    });
    let transport = EmbeddedTransport::new();
    let node = start("n", transport.clone(), &[&c]).await;
    let publisher = Publisher::new(transport.clone());
    seed(&db, &publisher, &[&c], 10).await;
    db.write("k1", "two", 2);
    publisher.invalidate("countries", ["k1"]).await.unwrap();
    eventually("invalidated", async || c.peek("k1").await.is_none()).await;
    let d = db.clone();
    let v = c
        .get_with("k1".to_owned(), || {
            let d = d.clone();
            async move { d.row("k1").unwrap().0 }
        })
        .await;
    assert_eq!(v, "two");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let a = audit(&c);
    assert_eq!(a.inconsistencies, 0, "{a:?}");
    node.shutdown().await.unwrap();
}
