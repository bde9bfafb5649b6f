//! How late a node's runtime runs a short timer while the node does its
//! heaviest work (issue 36): the node shares the application's runtime, so
//! whatever it holds a worker for, the application's tasks wait for.
//!
//! ```text
//! cargo bench -p integration-tests --bench stalls              # full sizes, about 2 minutes
//! cargo bench -p integration-tests --bench stalls -- --quick   # small sizes
//! cargo bench -p integration-tests --bench stalls -- --only storm   # scenarios named so
//! ```
//!
//! Without `--bench` (as under `cargo test --all-targets`) it runs a tiny
//! smoke pass.
//!
//! Method: each scenario gets a fresh tokio runtime of 2 worker threads
//! (the machine has 2 cores), the nodes' runtime. On it, next to the node, a
//! timer task sleeps 10 ms at a time and records how much later than asked
//! each wake-up came (the node's own lateness monitor measures the same; it
//! is read too). Publishers run on a runtime of their own (one worker), as
//! another process would. Scenarios:
//! 1. `clear-1m`: a cache of 1,000,000 entries; one published
//!    `invalidate_all`; until the node holds none.
//! 2. `resync-1m`: the same cache; an event of a publisher the nodes
//!    know lost on the way (the transport drops it), found as a gap at the
//!    next one: a resync.
//! 3. `storm`: 50,000 single-entry events a second for 20 s.
//! 4. `big-events`: 50 events a second of 10,000 entries each, for 20 s.
//!
//! The baseline, in the same run: `raw-moka-clear-1m`, a plain moka cache
//! of 1,000,000 entries on the same kind of runtime, `invalidate_all` and
//! then `run_pending_tasks` as a task of the runtime (what a node did
//! before its housekeeping moved to the runtime's blocking pool).

#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cache_sync::transport::FaultyTransport;
use cache_sync::{Node, Publisher, SyncedCache, transport::EmbeddedTransport};
use tokio::runtime::Runtime;

const TICK: Duration = Duration::from_millis(10);
/// Nodes on the one runtime for the storms: both workers apply.
const STORM_NODES: usize = 2;
/// Nodes (caches) on the one runtime for the clears: as in the CDC bench,
/// enough that both workers have work.
const NODES: usize = 4;

struct Sizes {
    entries: u64,
    seconds: u64,
}

fn runtime(workers: usize) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

/// The timer task: its lateness samples, in µs, once stopped.
struct Timer {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<u64>>,
}

impl Timer {
    fn start(rt: &Runtime) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = rt.spawn({
            let stop = stop.clone();
            async move {
                let mut late = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let due = tokio::time::Instant::now() + TICK;
                    tokio::time::sleep_until(due).await;
                    let l = tokio::time::Instant::now().saturating_duration_since(due);
                    late.push(u64::try_from(l.as_micros()).unwrap_or(u64::MAX));
                }
                late
            }
        });
        Timer { stop, task }
    }

    fn finish(self, rt: &Runtime) -> Vec<u64> {
        self.stop.store(true, Ordering::Relaxed);
        rt.block_on(self.task).expect("timer task")
    }
}

fn report(name: &str, mut late: Vec<u64>, node_us: Option<u64>, extra: &str) {
    late.sort_unstable();
    let q = |p: f64| -> u64 {
        if late.is_empty() {
            return 0;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let i = ((late.len() - 1) as f64 * p).round() as usize;
        late[i]
    };
    let max = late.last().copied().unwrap_or(0);
    let node = node_us.map_or("-".to_owned(), |us| format!("{:.1}", us as f64 / 1000.0));
    println!(
        "| {name} | {} | {:.2} | {:.2} | {:.1} | {node} | {extra} |",
        late.len(),
        q(0.5) as f64 / 1000.0,
        q(0.99) as f64 / 1000.0,
        max as f64 / 1000.0,
    );
}

async fn fill(cache: &SyncedCache<u64, u64>, n: u64) {
    for i in 0..n {
        cache.insert(i, i).await;
    }
}

/// Polls until the node's cache holds nothing (moka's count settles with
/// its housekeeping).
async fn until_empty(node: &Node) {
    loop {
        let status = node.status_settled().await;
        if status.caches.iter().all(|c| c.entries == 0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn clear(sizes: &Sizes, lose_it: bool) {
    let rt = runtime(2);
    let publishers = runtime(1);
    let embedded = EmbeddedTransport::new();
    // One per node: a fault's count is shared by every subscription made
    // through one, so a single wrapper would drop the record for one node.
    let faulties: Vec<FaultyTransport> = (0..NODES)
        .map(|_| FaultyTransport::new(embedded.clone()))
        .collect();
    let nodes = rt.block_on(async {
        let mut nodes = Vec::new();
        for (i, faulty) in faulties.iter().enumerate() {
            let cache: SyncedCache<u64, u64> =
                SyncedCache::new("big", moka::future::Cache::new(sizes.entries * 2));
            let node = Node::builder(format!("n{i}"), faulty.clone())
                .register(&cache)
                .start()
                .await
                .expect("node");
            // Filled once registered: a registration empties the cache.
            fill(&cache, sizes.entries).await;
            node.status_settled().await;
            nodes.push((node, cache));
        }
        nodes
    });
    let publisher = publishers.block_on(async { Publisher::new(embedded.clone()) });
    if lose_it {
        // The nodes hear from the publisher once first. A publisher's
        // first event a node sees, numbered past 1, counts as a gap only
        // when the one before it was sent a reorder window (10 s) after
        // the node went live; a known publisher's next number is checked
        // at once.
        publishers.block_on(async {
            publisher.invalidate("big", [0u64]).await.expect("publish");
        });
        rt.block_on(async {
            for (node, _) in &nodes {
                while node.status().caches.iter().any(|c| c.events_applied == 0) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        });
    }
    let timer = Timer::start(&rt);
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
    let started = Instant::now();
    publishers.block_on(async {
        if lose_it {
            // Lost on the way to the nodes: the next event shows the gap.
            for faulty in &faulties {
                faulty.drop_records(1);
            }
            publisher.invalidate("big", [1u64]).await.expect("publish");
            publisher.invalidate("big", [2u64]).await.expect("publish");
        } else {
            publisher.invalidate_all("big").await.expect("publish");
        }
    });
    rt.block_on(async {
        for (node, _) in &nodes {
            until_empty(node).await;
        }
    });
    let took = started.elapsed();
    let (late, node_us) = settle_and_read(&rt, timer, &nodes);
    report(
        if lose_it { "resync-1m" } else { "clear-1m" },
        late,
        node_us,
        &format!("{NODES} nodes emptied in {:.2} s", took.as_secs_f64()),
    );
    rt.block_on(async {
        for (node, _) in nodes {
            node.shutdown().await.expect("shutdown");
        }
    });
}

/// Lets the runtime settle for 200 ms, then stops the timer: its samples,
/// and the worst lateness the nodes' own monitors saw.
fn settle_and_read(
    rt: &Runtime,
    timer: Timer,
    nodes: &[(Node, SyncedCache<u64, u64>)],
) -> (Vec<u64>, Option<u64>) {
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
    let late = timer.finish(rt);
    let node_us = nodes
        .iter()
        .map(|(n, _)| n.status().runtime_lateness_us)
        .max();
    (late, node_us)
}

fn raw_moka_clear(sizes: &Sizes) {
    let rt = runtime(2);
    let caches = rt.block_on(async {
        let mut caches = Vec::new();
        for _ in 0..NODES {
            let cache: moka::future::Cache<u64, u64> = moka::future::Cache::new(sizes.entries * 2);
            for i in 0..sizes.entries {
                cache.insert(i, i).await;
            }
            cache.run_pending_tasks().await;
            caches.push(cache);
        }
        caches
    });
    let timer = Timer::start(&rt);
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
    let started = Instant::now();
    let tasks: Vec<_> = caches
        .iter()
        .map(|cache| {
            let cache = cache.clone();
            rt.spawn(async move {
                cache.invalidate_all();
                cache.run_pending_tasks().await;
            })
        })
        .collect();
    rt.block_on(async {
        for task in tasks {
            task.await.expect("housekeeping");
        }
    });
    let took = started.elapsed();
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
    report(
        "raw-moka-clear-1m (baseline)",
        timer.finish(&rt),
        None,
        &format!("{NODES} caches emptied in {:.2} s", took.as_secs_f64()),
    );
}

/// `rate` events a second of `entries` entries each, for `sizes.seconds`.
fn storm(name: &str, sizes: &Sizes, rate: u64, entries: u64) {
    let rt = runtime(2);
    let publishers = runtime(1);
    let transport = EmbeddedTransport::new();
    let nodes = rt.block_on(async {
        let mut nodes = Vec::new();
        for i in 0..STORM_NODES {
            let cache: SyncedCache<u64, u64> = SyncedCache::new(
                "storm",
                moka::future::Cache::new(
                    std::env::var("STORM_CAP")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(1_000_000),
                ),
            );
            let node = Node::builder(format!("n{i}"), transport.clone())
                .max_event_bytes(4 << 20)
                .register(&cache)
                .start()
                .await
                .expect("node");
            nodes.push((node, cache));
        }
        nodes
    });
    let publisher = publishers.block_on(async {
        Publisher::builder(transport.clone())
            .max_event_bytes(4 << 20)
            .build()
            .expect("publisher")
    });
    let timer = Timer::start(&rt);
    let started = Instant::now();
    let sent = publishers.block_on(async {
        // Paced in steps of 10 ms (rate / 100 events each), or of one
        // event each below 100 a second.
        let per_step = (rate / 100).max(1);
        let step = Duration::from_secs(per_step) / u32::try_from(rate.max(1)).unwrap_or(u32::MAX);
        let mut sent = 0u64;
        let mut next = tokio::time::Instant::now();
        let end = next + Duration::from_secs(sizes.seconds);
        let mut key = 0u64;
        while tokio::time::Instant::now() < end {
            for _ in 0..per_step {
                let batch: Vec<(u64, u64)> = (0..entries)
                    .map(|_| {
                        key = (key + 1) % 1_000_000;
                        (key, sent)
                    })
                    .collect();
                publisher.insert("storm", batch).await.expect("publish");
                sent += 1;
            }
            next += step;
            tokio::time::sleep_until(next).await;
        }
        sent
    });
    let elapsed = started.elapsed().as_secs_f64();
    let applied_then: u64 = nodes
        .iter()
        .map(|(n, _)| n.status().caches[0].events_applied)
        .min()
        .unwrap_or(0);
    let (late, node_us) = settle_and_read(&rt, timer, &nodes);
    #[allow(clippy::cast_precision_loss)]
    let extra = format!(
        "{STORM_NODES} nodes; sent {:.0}/s, the slower node applied {:.0}/s while sending",
        sent as f64 / elapsed,
        applied_then as f64 / elapsed
    );
    report(name, late, node_us, &extra);
    rt.block_on(async {
        for (node, _) in nodes {
            node.shutdown().await.expect("shutdown");
        }
    });
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let bench = args.iter().any(|a| a == "--bench");
    let quick = args.iter().any(|a| a == "--quick");
    let sizes = if !bench {
        Sizes {
            entries: 10_000,
            seconds: 1,
        }
    } else if quick {
        Sizes {
            entries: 200_000,
            seconds: 3,
        }
    } else {
        Sizes {
            entries: 1_000_000,
            seconds: 20,
        }
    };
    println!(
        "timer lateness on the nodes' runtime (2 workers), in ms; {} entries, {} s storms\n",
        sizes.entries, sizes.seconds
    );
    println!(
        "| scenario | ticks | p50 | p99 | max | node's own monitor, max of the last minute | notes |"
    );
    println!("|---|---|---|---|---|---|---|");
    // `--only NAME`: the scenarios whose name starts with NAME.
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map_or("", String::as_str);
    let run = |name: &str| name.starts_with(only);
    if run("raw-moka-clear") {
        raw_moka_clear(&sizes);
    }
    if run("clear") {
        clear(&sizes, false);
    }
    if run("resync") {
        clear(&sizes, true);
    }
    if run("storm") {
        storm("storm (50,000 single-entry events/s)", &sizes, 50_000, 1);
    }
    if run("big-events") {
        storm(
            "big-events (50 events/s of 10,000 entries)",
            &sizes,
            50,
            10_000,
        );
    }
}
