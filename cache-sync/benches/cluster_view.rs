//! What the cluster view costs as it grows: taking heartbeats in (of level
//! nodes, and of nodes that lag), building the view, rendering the page,
//! and the heap per member. Through the public API only, so the same file
//! runs against an older checkout for a before-and-after table.
//!
//! ```text
//! cargo bench -p cache-sync --bench cluster_view                       # 100, 1,000, 10,000 members, 1 cache each
//! cargo bench -p cache-sync --bench cluster_view -- --caches 10 1000   # 1,000 members of 10 caches
//! cargo bench -p cache-sync --bench cluster_view -- --recent 16 …      # as earlier nodes sent them: 16 recent publishers a cache (not kept now)
//! cargo bench -p cache-sync --bench cluster_view -- --name-len 64 …    # cache names of 64 bytes (8 otherwise)
//! ```
//!
//! The observer is a [`Node`] with no cache of its own (its heartbeat
//! interval an hour, so its own heartbeats do not interfere): its
//! `heartbeats_received` counter says when a burst of heartbeats has been
//! read, which a bare `Cluster` watcher does not expose. Heartbeats are
//! crafted as JSON (the wire format: `H` and the message) and published
//! with `Transport::publish_heartbeat` on an `EmbeddedTransport`, in
//! bursts the channel's buffer (1,024) holds, each waited for.
//!
//! For each size n:
//! - **fill**: n heartbeats of new nodes, all level (every cache at
//!   version 1), from an empty view;
//! - **intake, level**: heartbeats of members already in (a later
//!   `sent_at_us`), all level; per heartbeat;
//! - one node then reports version 2 of every cache: every other node
//!   lags;
//! - **intake, lagging**: heartbeats of members already in, still at
//!   version 1; per heartbeat, as many as fit in about 3 s (the quadratic
//!   code takes a long time per heartbeat at 10,000);
//! - **memory per member**: live heap (bytes requested and not freed, as
//!   `stats_alloc` counts them) after all that, less before the fill,
//!   over n; the heartbeat channel's buffer is flushed with 1,024 tiny
//!   messages first, so it holds none of the heartbeats;
//! - **view**: `Cluster::view()`, the mean of a few;
//! - **page**: `GET /cache-sync/` through `Node::status_router`, the
//!   mean of a few, and its size.
//!
//! Everything runs on one current-thread runtime; the waits poll the
//! counter between yields.

// A bench prints its table.
#![allow(clippy::print_stdout)]

use std::alloc::System;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use cache_sync::transport::Transport;
use cache_sync::{Node, transport::EmbeddedTransport};
use http_body_util::BodyExt;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use tower::ServiceExt;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const TOPIC: &str = "cache-sync";
/// Heartbeats published before waiting for them: well inside the
/// channel's buffer of 1,024.
const BURST: usize = 256;

fn live_bytes() -> i64 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

#[derive(Clone, Copy)]
struct Shape {
    caches: usize,
    recent: usize,
    /// Cache names padded to this length (`cache-00` otherwise).
    name_len: usize,
}

/// A heartbeat message of node `i`, every cache at `version`, sent at
/// `sent` (a later one replaces an earlier one).
fn heartbeat(id: &str, shape: Shape, version: u64, sent: u64) -> Bytes {
    let recent: Vec<serde_json::Value> = (0..shape.recent)
        .map(|p| {
            serde_json::json!({
                "publisher": 1_000_000 + p, "seq": 7, "published_at_us": 1_796_000_000_000_000u64,
                "applied_at_us": 1_796_000_000_001_000u64,
            })
        })
        .collect();
    let caches: Vec<serde_json::Value> = (0..shape.caches)
        .map(|c| {
            serde_json::json!({
                "name": format!("cache-{c:0>w$}", w = shape.name_len.saturating_sub(6).max(2)), "version": version,
                "version_at_us": 1_796_000_000_000_000u64, "version_age_ms": 1_000,
                "entries": 1_000, "loss_resyncs": 0, "quarantined": false,
                "last_latency_us": 800, "recent": recent,
            })
        })
        .collect();
    let message = serde_json::json!({
        "type": "heartbeat", "node_id": id, "topic": TOPIC,
        "started_at_us": 1_796_000_000_000_000u64, "sent_at_us": 1_796_000_000_000_000u64 + sent,
        "interval_ms": 3_600_000, "transport": "embedded", "consuming": true, "ready": true,
        "position": {"id": "1700-3"}, "losses": 0, "caches": caches,
    });
    let mut payload = vec![b'H'];
    serde_json::to_writer(&mut payload, &message).expect("JSON");
    Bytes::from(payload)
}

fn node_id(i: usize) -> String {
    format!("node-{i:05}")
}

fn received(node: &Node) -> u64 {
    node.status().heartbeats_received
}

/// Publishes `payloads` in bursts, each waited for; the time taken, and
/// how many went, stopping early once `budget` has passed.
async fn publish(
    transport: &EmbeddedTransport,
    node: &Node,
    payloads: Vec<Bytes>,
    budget: Duration,
) -> (Duration, usize) {
    let started = Instant::now();
    let mut sent = 0;
    let mut burst = 1;
    let mut payloads = payloads.into_iter().peekable();
    while payloads.peek().is_some() {
        let mut want = received(node);
        let at = Instant::now();
        for p in payloads.by_ref().take(burst) {
            transport
                .publish_heartbeat(TOPIC, p)
                .await
                .expect("publish");
            sent += 1;
            want += 1;
        }
        while received(node) < want {
            tokio::task::yield_now().await;
        }
        if started.elapsed() >= budget {
            break;
        }
        // Small bursts while each heartbeat is slow (the quadratic code at
        // 10,000), up to `BURST` when they are quick.
        if at.elapsed() < Duration::from_millis(20) {
            burst = (burst * 2).min(BURST);
        }
    }
    (started.elapsed(), sent)
}

/// 1,024 tiny messages (refused): the channel's buffer then holds none of
/// the heartbeats.
async fn flush(transport: &EmbeddedTransport, node: &Node) {
    let junk = (0..1_024).map(|_| Bytes::from_static(b"x")).collect();
    publish(transport, node, junk, Duration::MAX).await;
}

async fn settle(node: &Node) {
    // Its own first heartbeat and roll call, and the echoes.
    let mut last = received(node);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = received(node);
        if now == last && now > 0 {
            return;
        }
        last = now;
    }
}

/// Mean time of `f`, over at least 3 runs and about a second.
async fn mean<T>(mut f: impl AsyncFnMut() -> T) -> (Duration, T) {
    let started = Instant::now();
    let mut runs = 0u32;
    loop {
        let out = f().await;
        runs += 1;
        if runs >= 3 && started.elapsed() >= Duration::from_secs(1) || runs >= 20 {
            return (started.elapsed() / runs, out);
        }
    }
}

fn show(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1_000.0 {
        format!("{us:.1} µs")
    } else if us < 1_000_000.0 {
        format!("{:.1} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

async fn run(n: usize, shape: Shape) {
    let transport = EmbeddedTransport::new();
    let node = Node::builder("observer", transport.clone())
        .heartbeat_interval(Duration::from_secs(3600))
        .start()
        .await
        .expect("observer starts");
    settle(&node).await;
    flush(&transport, &node).await;
    let base = live_bytes();

    let fill: Vec<Bytes> = (0..n)
        .map(|i| heartbeat(&node_id(i), shape, 1, 1))
        .collect();
    let (fill_time, _) = publish(&transport, &node, fill, Duration::MAX).await;

    let k = n.min(2_000);
    let level: Vec<Bytes> = (0..k)
        .map(|i| heartbeat(&node_id(i), shape, 1, 2))
        .collect();
    let (t, sent) = publish(&transport, &node, level, Duration::from_secs(3)).await;
    let level = t / sent as u32;

    // One node moves on: the others lag.
    let leader = vec![heartbeat(&node_id(0), shape, 2, 3)];
    publish(&transport, &node, leader, Duration::MAX).await;
    let lagging: Vec<Bytes> = (1..=k.min(n - 1).max(1))
        .map(|i| heartbeat(&node_id(i % n), shape, 1, 3))
        .collect();
    let (t, sent) = publish(&transport, &node, lagging, Duration::from_secs(3)).await;
    let lagging = t / sent as u32;

    flush(&transport, &node).await;
    let per_member = (live_bytes() - base) / n as i64;

    let cluster = node.cluster();
    let (view_time, view) = mean(async || cluster.view()).await;
    // Every member and the observer (the code before the bounds counted
    // the observer's echo under the member cap: one fewer at 10,000).
    assert!(view.nodes.len() >= n, "{} nodes", view.nodes.len());
    assert!(!view.is_converged());
    drop(view);
    let router = node.status_router();
    let (page_time, page_bytes) = mean(async || {
        let response = router
            .clone()
            .oneshot(
                axum::http::Request::get("/cache-sync/")
                    .body(Body::empty())
                    .expect("request"),
            )
            .await
            .expect("response");
        assert!(response.status().is_success());
        response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes()
            .len()
    })
    .await;
    println!(
        "| {n} | {} | {} | {} | {} | {} | {} | {} ({} KiB) | {per_member} |",
        shape.caches,
        shape.recent,
        show(fill_time),
        show(level),
        show(lagging),
        show(view_time),
        show(page_time),
        page_bytes / 1024,
    );
    node.shutdown().await.expect("shutdown");
}

fn main() {
    let mut shape = Shape {
        caches: 1,
        recent: 0,
        name_len: 8,
    };
    let mut sizes = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--caches" => {
                shape.caches = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--caches N")
            }
            "--recent" => {
                shape.recent = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--recent N")
            }
            "--name-len" => {
                shape.name_len = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--name-len N")
            }
            "--bench" => {}
            n => sizes.push(n.parse::<usize>().expect("a number of members")),
        }
    }
    if sizes.is_empty() {
        sizes = vec![100, 1_000, 10_000];
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "| members | caches each | recent each | fill (n heartbeats, level) | intake, level (per heartbeat) | intake, lagging (per heartbeat) | view | page | heap per member (bytes) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for n in sizes {
        runtime.block_on(run(n, shape));
    }
}
