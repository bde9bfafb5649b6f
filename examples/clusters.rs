//! A node and an admin service on a Redis Cluster and on a NATS cluster.
//! The code is the code for one server; only how the transport connects
//! differs: `RedisStreamsTransport::cluster` takes seed addresses (the
//! client learns the rest, and follows slots as they move), and a NATS
//! transport takes the cluster's servers comma-separated, with
//! `replicas(3)` so that its stream outlives the loss of its leader.
//!
//! For each cluster given, two nodes start on it, the admin publishes an
//! insert and waits until both nodes answer that they applied it, then an
//! invalidation; each step is checked against what the nodes hold. Exits 0
//! when every step was applied on every node within 10 s.
//!
//! ```text
//! cargo run -p cache-sync-examples --features redis,nats --example clusters -- \
//!     --redis-cluster redis://127.0.0.1:7000,redis://127.0.0.1:7001,redis://127.0.0.1:7002 \
//!     --nats-cluster nats://127.0.0.1:4222,nats://127.0.0.1:4223,nats://127.0.0.1:4224
//! ```
//!
//! `./scripts/test` runs it against the Redis Cluster and the NATS cluster
//! the integration tests' harness starts (`integration-tests/tests/clusters_example.rs`).

#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use cache_sync::cluster::Cluster;
use cache_sync::transport::{NatsJetStreamTransport, RedisStreamsTransport, Transport};
use cache_sync::{Node, Publisher, SyncedCache};
use clap::Parser;

const CACHE: &str = "countries";
const WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, clap::Parser)]
#[command(name = "clusters")]
struct Args {
    /// A Redis Cluster's seed addresses, comma-separated
    #[arg(long, value_name = "URLS", value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// A NATS cluster's servers, comma-separated
    #[arg(long, value_name = "URLS")]
    nats_cluster: Option<String>,
    /// The topic, so that runs beside each other keep apart
    #[arg(long, default_value = "clusters-example")]
    topic: String,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if args.redis_cluster.is_empty() && args.nats_cluster.is_none() {
        return Err("give --redis-cluster, --nats-cluster or both".into());
    }
    if !args.redis_cluster.is_empty() {
        // One connection per process, as on one server; the client finds
        // every master from the seeds.
        let transport = RedisStreamsTransport::cluster(args.redis_cluster.clone())
            .connect()
            .await?;
        round_trip("Redis Cluster", Arc::new(transport), &args.topic).await?;
    }
    if let Some(urls) = &args.nats_cluster {
        let transport = NatsJetStreamTransport::builder(urls.clone())
            .replicas(3)
            .connect()
            .await?;
        round_trip("NATS cluster", Arc::new(transport), &args.topic).await?;
    }
    Ok(())
}

/// Two nodes and an admin on one transport: an insert and an invalidation,
/// each acknowledged by both nodes and checked in their caches.
async fn round_trip(
    name: &str,
    transport: Arc<dyn Transport>,
    topic: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let mut nodes = Vec::new();
    for id in ["node-1", "node-2"] {
        let countries: SyncedCache<String, String> =
            SyncedCache::new(CACHE, moka::future::Cache::new(100));
        let node = Node::builder(id, transport.clone())
            .topic(topic)
            .register(&countries)
            .start()
            .await?;
        nodes.push((node, countries));
    }
    let cluster = Cluster::builder(transport.clone())
        .topic(topic)
        .observer("admin")
        .start()
        .await?;
    let publisher = Publisher::builder(transport)
        .topic(topic)
        .origin("admin")
        .build()?;

    let acks = publisher
        .insert(CACHE, [("de", "Deutschland")])
        .await?
        .applied_by(&cluster, WAIT)
        .await;
    println!("{name}: insert de: {acks}");
    if !acks.is_complete() || acks.applied() != nodes.len() {
        return Err(format!("{name}: the insert was not applied everywhere: {acks}").into());
    }
    for (node, countries) in &nodes {
        let de = countries.peek("de").await;
        if de.as_deref() != Some("Deutschland") {
            return Err(format!("{name}: {} holds {de:?}", node.id()).into());
        }
    }

    let acks = publisher
        .invalidate(CACHE, ["de"])
        .await?
        .applied_by(&cluster, WAIT)
        .await;
    println!("{name}: invalidate de: {acks}");
    if !acks.is_complete() || acks.applied() != nodes.len() {
        return Err(format!("{name}: the invalidation was not applied everywhere: {acks}").into());
    }
    for (node, countries) in &nodes {
        if let Some(de) = countries.peek("de").await {
            return Err(format!("{name}: {} still holds {de:?}", node.id()).into());
        }
    }

    cluster.shutdown().await;
    for (node, _) in nodes {
        node.shutdown().await?;
    }
    Ok(())
}
