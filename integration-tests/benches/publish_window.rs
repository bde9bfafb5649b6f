//! Pipelined publishing (issue 36): how many events per second one
//! `Publisher` gets acknowledged when 64 tasks share it and publish to one
//! cache over `RedisStreamsTransport`, with one call in flight at a time
//! (`window(1)`, what every publisher did before pipelining) and with the
//! default window of 64; next to `redis-benchmark` XADD against the same
//! server, from 64 connections one call each and from one connection 64
//! calls deep.
//!
//! ```text
//! cargo bench -p integration-tests --features redis --bench publish_window
//! ```
//!
//! Without `--bench` on the command line (as under `cargo test
//! --all-targets`) it runs a short smoke pass of the same code.
//!
//! Method: its own `redis-server` without persistence (the usual setup for
//! a cache transport, as in the soak bench). Each row runs for a fixed time,
//! the rows take turns (window 1, window 64, and again, three times), so
//! they share the machine's noisy moments; a row's rate is the events
//! acknowledged (their `insert().await` returned `Ok`) divided by its
//! time. No node reads the stream: this measures the publishing side.

// A benchmark's output is its table: printing to stdout is the point.
#![allow(clippy::print_stdout)]

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cache_sync::{Publisher, transport::RedisStreamsTransport};
use integration_tests::redis_server::RedisServer;

/// Tasks sharing the publisher.
const TASKS: usize = 64;

/// Events per second acknowledged with `window` for `run`.
async fn publisher_rate(url: &str, window: usize, run: Duration, round: usize) -> f64 {
    let transport = RedisStreamsTransport::connect(url).await.expect("connect");
    let publisher = Publisher::builder(transport)
        .topic(format!("window-{window}-{round}"))
        .window(window)
        .build()
        .expect("publisher");
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (publisher, stop, acked) = (publisher.clone(), stop.clone(), acked.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    publisher
                        .insert("bench", [(t as u64 * 1_000_000 + i % 1024, i)])
                        .await
                        .expect("publish");
                    acked.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("publishing task");
    }
    acked.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()
}

/// `redis-benchmark -p PORT -n N -c C -P P XADD …`; `None` if it is not
/// installed or its output has no rate.
fn xadd_rate(port: u16, requests: u64, clients: u32, pipeline: u32) -> Option<f64> {
    let output = Command::new("redis-benchmark")
        .args(["-p", &port.to_string()])
        .args(["-n", &requests.to_string()])
        .args(["-c", &clients.to_string()])
        .args(["-P", &pipeline.to_string()])
        .args(["XADD", "bench-stream", "*", "f", "v"])
        .output()
        .ok()?;
    integration_tests::redis_server::requests_per_second(&output.stdout)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (run, rounds, requests) = if full {
        (Duration::from_secs(5), 3, 500_000)
    } else {
        (Duration::from_millis(200), 1, 10_000)
    };
    let server = RedisServer::start_with(&["--appendonly", "no"]);
    let url = server.url();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (mut one, mut many) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        one.push(runtime.block_on(publisher_rate(&url, 1, run, round)));
        many.push(runtime.block_on(publisher_rate(&url, 64, run, round)));
    }
    let raw_clients = xadd_rate(server.port(), requests, 64, 1);
    let raw_pipelined = xadd_rate(server.port(), requests, 1, 64);
    let show = |r: Option<f64>| r.map_or("n/a".to_owned(), |r| format!("{r:.0}"));
    println!("| publisher, {TASKS} tasks, one cache | events/s (median of {rounds}) | each run |");
    println!("|---|---:|---|");
    for (name, rates) in [
        ("window 1 (one call at a time)", &one),
        ("window 64", &many),
    ] {
        let each: Vec<_> = rates.iter().map(|r| format!("{r:.0}")).collect();
        println!("| {name} | {:.0} | {} |", median(rates), each.join(", "));
    }
    println!(
        "| redis-benchmark XADD, 64 connections, -P 1 | {} | |",
        show(raw_clients)
    );
    println!(
        "| redis-benchmark XADD, 1 connection, -P 64 | {} | |",
        show(raw_pipelined)
    );
    let speedup = median(&many) / median(&one);
    println!("\nwindow 64 ÷ window 1: {speedup:.2}×");
    if let Some(raw) = raw_clients {
        println!(
            "window 64 ÷ XADD (64 connections): {:.2}×",
            median(&many) / raw
        );
    }
    if !full {
        assert!(
            one.iter().chain(&many).all(|&r| r > 0.0),
            "nothing published"
        );
    }
}
