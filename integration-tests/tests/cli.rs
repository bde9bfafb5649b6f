//! The `cache-sync` command-line tool against nodes on a Redis server of
//! the test's own: it is built once per test process, then run as a user
//! would run it.
//!
//! Needs the Redis transports' heartbeat channel: on a branch where Redis
//! has none, the watcher cannot start and `status` exits 2 ("cannot watch
//! the heartbeats"), which these tests report as a failure.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use cache_sync::cluster::ClusterView;
use cache_sync::transport::Transport;
use cache_sync::{Node, Publisher, SyncedCache, transport::RedisStreamsTransport};
use integration_tests::redis_server::RedisServer;
use integration_tests::{built, eventually};

const EVERY: Duration = Duration::from_millis(100);

/// The binary: the one `CACHE_SYNC_BIN` names, which must be built with at
/// least the features `cli`, `redis` and `nats` (`scripts/test` passes the
/// one its test build just made with every feature), or one built here.
fn binary() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        built::binary(
            "CACHE_SYNC_BIN",
            // nats for the NATS status test; the rest needs redis only.
            &[
                "-p",
                "cache-sync",
                "--bin",
                "cache-sync",
                "--features",
                "cli,redis,nats",
            ],
            "cache-sync",
        )
    })
}

/// Runs the tool off the runtime's threads, so the nodes keep sending
/// heartbeats while it runs.
async fn cli(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(binary())
            .args(&args)
            .output()
            .expect("run cache-sync")
    })
    .await
    .expect("the blocking task")
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

use cache_sync::transport::FaultyTransport;

type Countries = SyncedCache<String, String>;

async fn node(id: &str, transport: impl Transport) -> (Countries, Node) {
    let cache: Countries = SyncedCache::new("countries", moka::future::Cache::new(100));
    let node = Node::builder(id, transport)
        .heartbeat_interval(EVERY)
        .register(&cache)
        .start()
        .await
        .expect("start a node");
    (cache, node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_publish_and_lag_on_redis_streams() {
    let server = RedisServer::start();
    let url = server.url();
    let connect = async || {
        RedisStreamsTransport::builder(url.clone())
            .block(Duration::from_millis(200))
            .connect()
            .await
            .expect("connect")
    };
    let stalled = FaultyTransport::new(connect().await);
    let (c1, n1) = node("n1", connect().await).await;
    let (c2, n2) = node("n2", connect().await).await;
    let (c3, n3) = node("n3", stalled.clone()).await;
    let caches = [&c1, &c2, &c3];
    let base = [
        "--transport",
        "redis-streams",
        "--url",
        url.as_str(),
        "--heartbeat-interval",
        "100ms",
    ];
    let run = async |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        cli(&args).await
    };

    // Every node is listed, and a level cluster passes.
    let out = run(&["status"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    for id in ["n1", "n2", "n3"] {
        assert!(stdout.contains(id), "{id} missing:\n{stdout}");
    }

    // The JSON is the library's ClusterView.
    let out = run(&["status", "--json"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let view: ClusterView = serde_json::from_str(&stdout).expect("a ClusterView");
    let ids: Vec<&str> = view.nodes.iter().map(|n| n.node_id.as_str()).collect();
    assert_eq!(ids, ["n1", "n2", "n3"]);

    // An acknowledged refresh reaches every node.
    let out = run(&[
        "publish",
        "insert",
        "countries",
        "de",
        "Deutschland",
        "--version",
        "7",
        "--ack",
        "5s",
    ])
    .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("applied on 3/3 nodes"), "{stdout}");
    for c in caches {
        assert_eq!(c.peek("de").await.as_deref(), Some("Deutschland"));
    }

    // An acknowledged invalidation, then a clear.
    for c in caches {
        c.insert("fr".into(), "France".into()).await;
    }
    let out = run(&["publish", "invalidate", "countries", "de", "--ack", "5s"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("applied on 3/3 nodes"), "{stdout}");
    for c in caches {
        assert_eq!(c.peek("de").await, None);
        assert_eq!(c.peek("fr").await.as_deref(), Some("France"));
    }
    let out = run(&["publish", "invalidate-all", "countries", "--ack", "5s"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("applied on 3/3 nodes"), "{stdout}");
    for c in caches {
        assert_eq!(c.peek("fr").await, None);
    }

    // n3 stops taking events in while the others move on to version 9.
    stalled.stall(true);
    let publisher = Publisher::new(connect().await);
    for v in [8, 9] {
        publisher
            .insert_versioned("countries", [("de", "Deutschland", Some(v))])
            .await
            .expect("publish");
    }
    eventually("n1 and n2 at version 9", async || {
        [&c1, &c2].iter().all(|c| c.status().version == Some(9))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = run(&["status", "--max-lag", "100ms"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("n3 countries"), "{stderr}");
    assert!(!stderr.contains("n1") && !stderr.contains("n2"), "{stderr}");
    let out = run(&["status", "--max-lag", "1h"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");

    // The key probe finds n3 behind on the key: it still knows version 7
    // (the key was invalidated, then the cache cleared, since).
    let out = run(&["probe", "countries", "de"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("n1: holds, version 9\n"), "{stdout}");
    assert!(
        stdout.contains("n3: absent, version 7  <- differs"),
        "{stdout}"
    );
    assert!(stdout.contains("the nodes disagree"), "{stdout}");
    let out = run(&["probe", "countries", "de", "--json"]).await;
    let probe: cache_sync::cluster::KeyProbe =
        serde_json::from_slice(&out.stdout).expect("a KeyProbe");
    assert_eq!(probe.behind().collect::<Vec<_>>(), ["n3"]);

    stalled.stall(false);
    eventually("n3 caught up", async || c3.status().version == Some(9)).await;
    let out = run(&["probe", "countries", "de"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("all 3 nodes agree"), "{stdout}");
    let out = run(&["probe", "countries", "x", "--key-type", "u64"]).await;
    assert_eq!(out.status.code(), Some(2), "{:?}", text(&out));

    // A versioned invalidation leaves a tombstone that an older insert,
    // arriving after it, cannot pass.
    let out = run(&[
        "publish",
        "invalidate",
        "countries",
        "de",
        "--version",
        "20",
        "--ack",
        "5s",
    ])
    .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let out = run(&[
        "publish",
        "insert",
        "countries",
        "de",
        "Deutschland",
        "--version",
        "15",
        "--ack",
        "5s",
    ])
    .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    for c in caches {
        assert_eq!(
            c.peek("de").await,
            None,
            "an older insert passed a tombstone"
        );
        assert_eq!(c.status().version, Some(20));
    }

    // A topic no node is on: a probe must not pass.
    let out = run(&["--topic", "nobody-here", "status"]).await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("no node answered"), "{stdout}");

    for n in [n1, n2, n3] {
        n.shutdown().await.expect("shutdown");
    }
}

/// Issue 35, item 9: a probe whose key no node can read (a string key for
/// a cache of `u64` keys) is the command's error, not agreement: it exits
/// 2 (it said "all 1 nodes agree" and exited 0). The key's own type agrees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_of_a_key_no_node_can_read_exits_2() {
    let server = RedisServer::start();
    let url = server.url();
    let transport = RedisStreamsTransport::builder(url.clone())
        .block(Duration::from_millis(200))
        .connect()
        .await
        .expect("connect");
    let ids: SyncedCache<u64, String> = SyncedCache::new("ids", moka::future::Cache::new(10));
    let n1 = Node::builder("n1", transport)
        .heartbeat_interval(EVERY)
        .register(&ids)
        .start()
        .await
        .expect("start a node");
    let probe = async |key_type: &str| {
        cli(&[
            "--transport",
            "redis-streams",
            "--url",
            url.as_str(),
            "--heartbeat-interval",
            "100ms",
            "probe",
            "ids",
            "7",
            "--key-type",
            key_type,
        ])
        .await
    };
    let out = probe("string").await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
    assert!(stdout.contains("n1: error: "), "{stdout}");
    assert!(
        stdout.contains("1 of 1 nodes could not read the key"),
        "{stdout}"
    );
    assert!(!stdout.contains("agree"), "{stdout}");
    assert!(stderr.contains("--key-type"), "{stderr}");
    let out = probe("u64").await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("all 1 nodes agree"), "{stdout}");
    n1.shutdown().await.expect("shutdown");
}

/// `status` on `transport` lists two nodes started on `connect()`.
async fn status_lists_every_node<T: Transport>(
    name: &str,
    url: &str,
    connect: impl AsyncFn() -> T,
) {
    let (_c1, n1) = node("n1", connect().await).await;
    let (_c2, n2) = node("n2", connect().await).await;
    // One name for a transport: the one the CLI takes is the one nodes
    // report.
    assert_eq!(n1.status().transport, name);
    let out = cli(&[
        "--transport",
        name,
        "--url",
        url,
        "--heartbeat-interval",
        "100ms",
        "status",
    ])
    .await;
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.contains("n1") && stdout.contains("n2"), "{stdout}");
    for n in [n1, n2] {
        n.shutdown().await.expect("shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_on_redis_pubsub() {
    let server = RedisServer::start();
    let url = server.url();
    status_lists_every_node("redis-pubsub", &url, async || {
        cache_sync::transport::RedisPubSubTransport::connect(url.clone())
            .await
            .expect("connect")
    })
    .await;
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_on_nats() {
    let server = integration_tests::nats_server::NatsServer::start();
    let url = server.url();
    status_lists_every_node("nats-jetstream", &url, async || {
        cache_sync::transport::NatsJetStreamTransport::connect(url.clone())
            .await
            .expect("connect")
    })
    .await;
}

#[tokio::test]
async fn the_embedded_transport_is_refused_with_a_reason() {
    let out = cli(&["--transport", "embedded", "status"]).await;
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("inside one process"), "{stderr}");
}
