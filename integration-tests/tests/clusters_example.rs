//! The `clusters` example (`examples/clusters.rs`) against a Redis Cluster
//! and a NATS cluster of the harness's own: what it shows must run.
#![cfg(all(feature = "redis", feature = "nats"))]

use std::process::Command;

use integration_tests::built;
use integration_tests::nats_cluster::NatsCluster;
use integration_tests::redis_cluster::RedisCluster;

#[test]
fn the_clusters_example_runs_on_a_redis_cluster_and_a_nats_cluster() {
    // Built before the clusters start, so that they do not wait on it.
    let example = built::binary(
        "CACHE_SYNC_CLUSTERS_EXAMPLE",
        &[
            "-p",
            "cache-sync-examples",
            "--example",
            "clusters",
            "--features",
            "redis,nats",
        ],
        "examples/clusters",
    );
    let redis = RedisCluster::start();
    let nats = NatsCluster::start();
    let out = Command::new(&example)
        .arg("--redis-cluster")
        .arg(redis.urls().join(","))
        .arg("--nats-cluster")
        .arg(nats.urls())
        .output()
        .expect("run the clusters example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}\n{stdout}{stderr}", out.status);
    // Each step on each cluster, acknowledged by both nodes.
    for step in [
        "Redis Cluster: insert de: applied on 2/2 nodes",
        "Redis Cluster: invalidate de: applied on 2/2 nodes",
        "NATS cluster: insert de: applied on 2/2 nodes",
        "NATS cluster: invalidate de: applied on 2/2 nodes",
    ] {
        assert!(stdout.contains(step), "{step:?} missing:\n{stdout}");
    }
}
