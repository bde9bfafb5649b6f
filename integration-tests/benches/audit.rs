//! The consistency auditor (issue 24): what a check costs, what the
//! auditor costs the apply path, and how soon it finds a write that
//! bypassed the publisher.
//!
//! ```text
//! cargo bench -p integration-tests --bench audit                 # apply p99 on/off, detection
//! # instructions per check, counted by callgrind in the auditor's rounds only:
//! valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*audit_round*' \
//!     target/release/deps/audit-* --bench --cost 1000
//! ```
//!
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a tiny smoke pass over the same code and checks.
//! Everything runs on the embedded transport, in one process: the auditor's
//! work (a sweep of moka, the source read, the comparisons) does not depend
//! on the broker, and the marker round trip happens only for a suspect
//! still behind after its grace window.
//!
//! - `--cost R`: one node, 10k entries, audited at R keys/s (batches of
//!   100) against an in-memory source that agrees, for 10 s of wall clock;
//!   prints the checks made. Under callgrind with the toggle above, the
//!   instructions counted are those of the rounds (the source read
//!   included), so instructions ÷ checks is the cost of a check.
//! - Apply path: two nodes on one transport, each holding the same 10k
//!   entries; one audited at R keys/s, the other not (the baseline, in
//!   the same run). Versioned refreshes of random keys go out one at a
//!   time, the next once both nodes applied it; each node's
//!   publish-to-applied time (`last_latency_us`) is a sample. At R = 100
//!   and 1000, 3000 events each, 200 a second (so about 15 s of rounds
//!   among them). `--apply-only` and `--detection-only` run one part.
//! - Detection: one node holding N entries (10k at 1000 keys/s, 100k at
//!   10 000 keys/s: a sweep of about 10 s each), with the default grace
//!   (reorder window 0 here, so 3 s); five writes to the source that
//!   bypass the publisher, one at a time at random moments, each timed
//!   from the write until the node counted it; against the documented
//!   bound, 1.25 × N ÷ rate + grace + 1.25 × batch ÷ rate.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cache_sync::{Audit, Node, Publisher, SyncedCache, transport::EmbeddedTransport};

type Cache = SyncedCache<u64, u64>;

/// The source of truth: value and version per key.
#[derive(Default)]
struct Source(Mutex<HashMap<u64, (u64, u64)>>);

impl Source {
    fn audit(self: &Arc<Self>, rate: u32, batch: usize) -> Audit<u64, u64> {
        let source = self.clone();
        Audit::versioned(move |keys: Vec<u64>| {
            let rows = source.0.lock().expect("source lock");
            let answer: Vec<_> = keys
                .into_iter()
                .map(|k| (k, rows.get(&k).copied()))
                .collect();
            async move { Ok::<_, std::convert::Infallible>(answer) }
        })
        .rate(rate)
        .batch(batch)
    }
}

fn cache(audit: Option<Audit<u64, u64>>) -> Cache {
    let mut b =
        SyncedCache::builder("table", moka::future::Cache::new(1 << 20)).max_tracked_keys(1 << 20);
    if let Some(audit) = audit {
        b = b.audit(audit);
    }
    b.build().expect("valid settings")
}

async fn node(id: &str, transport: &EmbeddedTransport, cache: &Cache) -> Node {
    Node::builder(id, transport.clone())
        .reorder_window(Duration::ZERO)
        .register(cache)
        .start()
        .await
        .expect("node starts")
}

/// Writes `n` rows to the source and publishes them, versioned; returns once
/// every cache holds them.
async fn seed(source: &Source, publisher: &Publisher, caches: &[&Cache], n: u64) {
    let rows: Vec<(u64, u64, Option<u64>)> = (0..n).map(|k| (k, k, Some(1))).collect();
    {
        let mut s = source.0.lock().expect("source lock");
        for &(k, v, _) in &rows {
            s.insert(k, (v, 1));
        }
    }
    for chunk in rows.chunks(1000) {
        publisher
            .insert_versioned("table", chunk.to_vec())
            .await
            .expect("publish");
    }
    for c in caches {
        while c.status().refreshes < n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

fn checks(c: &Cache) -> u64 {
    c.status().audit.map_or(0, |a| a.checks)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// A fixed xorshift sequence, so every run publishes the same keys.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

async fn cost(rate: u32, seconds: u64, entries: u64) {
    let source = Arc::new(Source::default());
    let c = cache(Some(source.audit(rate, 100)));
    let transport = EmbeddedTransport::new();
    let n = node("cost", &transport, &c).await;
    seed(&source, &Publisher::new(transport.clone()), &[&c], entries).await;
    let before = checks(&c);
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let a = c.status().audit.expect("audited");
    println!(
        "cost: rate {rate}/s, {entries} entries, {seconds} s: {} checks ({} before the timed part), {} source reads, {} inconsistencies",
        a.checks, before, a.source_reads, a.inconsistencies
    );
    assert_eq!(a.inconsistencies, 0);
    n.shutdown().await.expect("shutdown");
}

async fn apply_path(rate: u32, events: usize, entries: u64) {
    let source = Arc::new(Source::default());
    let (on, off) = (cache(Some(source.audit(rate, 100))), cache(None));
    let transport = EmbeddedTransport::new();
    let (n_on, n_off) = (
        node("on", &transport, &on).await,
        node("off", &transport, &off).await,
    );
    let publisher = Publisher::new(transport.clone());
    seed(&source, &publisher, &[&on, &off], entries).await;
    let checks_before = checks(&on);
    let started = Instant::now();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut lat_on, mut lat_off) = (Vec::with_capacity(events), Vec::with_capacity(events));
    for i in 0..events {
        let k = rng.next() % entries;
        let version = 2 + i as u64;
        // The source first, as a writer does: the auditor finds it at most
        // a suspect, which the event clears.
        source
            .0
            .lock()
            .expect("source lock")
            .insert(k, (i as u64, version));
        let applied = (on.status().events_applied, off.status().events_applied);
        publisher
            .insert_versioned("table", [(k, i as u64, Some(version))])
            .await
            .expect("publish");
        loop {
            let (a, b) = (on.status(), off.status());
            if a.events_applied > applied.0 && b.events_applied > applied.1 {
                lat_on.push(a.last_latency_us.unwrap_or(0));
                lat_off.push(b.last_latency_us.unwrap_or(0));
                break;
            }
            tokio::task::yield_now().await;
        }
        // Paced, so the auditor's rounds run among the events: 200 a
        // second, about as busy as a dictionary table ever is.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    lat_on.sort_unstable();
    lat_off.sort_unstable();
    let a = on.status().audit.expect("audited");
    let checks = a.checks - checks_before;
    println!(
        "apply: rate {rate}/s, {entries} entries, {events} events in {:.1} s, {checks} checks meanwhile ({:.0}/s): \
         audited p50 {} µs p99 {} µs max {} µs; not audited p50 {} µs p99 {} µs max {} µs; p99 ratio {:.2}×; \
         suspects {}, cleared {}, inconsistencies {}",
        elapsed.as_secs_f64(),
        checks as f64 / elapsed.as_secs_f64(),
        percentile(&lat_on, 0.5),
        percentile(&lat_on, 0.99),
        lat_on.last().unwrap_or(&0),
        percentile(&lat_off, 0.5),
        percentile(&lat_off, 0.99),
        lat_off.last().unwrap_or(&0),
        percentile(&lat_on, 0.99) as f64 / percentile(&lat_off, 0.99).max(1) as f64,
        a.suspects,
        a.suspects_cleared,
        a.inconsistencies,
    );
    assert_eq!(a.inconsistencies, 0, "a false positive: {a:?}");
    n_on.shutdown().await.expect("shutdown");
    n_off.shutdown().await.expect("shutdown");
}

async fn detection(entries: u64, rate: u32, batch: usize, writes: usize) {
    let source = Arc::new(Source::default());
    let c = cache(Some(source.audit(rate, batch)));
    let transport = EmbeddedTransport::new();
    let n = node("detect", &transport, &c).await;
    // A publisher that stays: its announcements are not needed, but a live
    // admin service is the usual setting.
    let publisher = Publisher::new(transport.clone());
    seed(&source, &publisher, &[&c], entries).await;
    let grace = Duration::from_secs(3);
    let bound = Duration::from_secs_f64(1.25 * entries as f64 / f64::from(rate))
        + grace
        + Duration::from_secs_f64(1.25 * batch as f64 / f64::from(rate));
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let mut took = Vec::new();
    for i in 0..writes {
        // A random moment in the sweep.
        tokio::time::sleep(Duration::from_millis(rng.next() % 5000)).await;
        let k = rng.next() % entries;
        let before = c.status().audit.expect("audited").inconsistencies;
        let at = Instant::now();
        source
            .0
            .lock()
            .expect("source lock")
            .insert(k, (u64::MAX, 10 + i as u64));
        while c.status().audit.expect("audited").inconsistencies == before {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        took.push(at.elapsed());
        assert_eq!(c.peek(&k).await, None, "repaired");
    }
    let a = c.status().audit.expect("audited");
    let max = took.iter().max().copied().unwrap_or_default();
    let mean = took.iter().sum::<Duration>() / took.len().max(1) as u32;
    println!(
        "detection: {entries} entries at {rate} keys/s (batch {batch}), grace {grace:?}: {writes} bypassing writes, \
         found after mean {:.2} s, max {:.2} s; bound {:.2} s; counted {} inconsistencies, {} repairs",
        mean.as_secs_f64(),
        max.as_secs_f64(),
        bound.as_secs_f64(),
        a.inconsistencies,
        a.repairs,
    );
    assert_eq!(a.inconsistencies, writes as u64);
    assert!(
        max <= bound + Duration::from_secs(2),
        "{max:?} past {bound:?}"
    );
    n.shutdown().await.expect("shutdown");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        if let Some(i) = args.iter().position(|a| a == "--cost") {
            let rate = args.get(i + 1).and_then(|r| r.parse().ok()).unwrap_or(1000);
            cost(rate, 10, 10_000).await;
            return;
        }
        if !bench {
            // Smoke: the same code, tiny.
            cost(1000, 1, 200).await;
            apply_path(1000, 50, 200).await;
            detection(200, 1000, 50, 1).await;
            println!("audit bench: smoke pass ok (run with --bench for figures)");
            return;
        }
        let only = |what: &str| args.iter().any(|a| a == what);
        let all = !only("--apply-only") && !only("--detection-only");
        if all || only("--apply-only") {
            for rate in [100, 1000] {
                apply_path(rate, 3000, 10_000).await;
            }
        }
        if all || only("--detection-only") {
            detection(10_000, 1000, 100, 5).await;
            detection(100_000, 10_000, 1000, 5).await;
        }
    });
}
