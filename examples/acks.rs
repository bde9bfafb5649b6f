//! Proving a change arrived: `Published::applied_by` waits until every live
//! node that holds the cache answers that it applied the publish, and says
//! which did, how soon, and why not all if not.
//!
//! The nodes are what a `Cluster` watcher hears of their heartbeats: a node
//! is live until three of its heartbeat intervals (2 s each by default) pass
//! in silence. A watcher that has just started gives the nodes up to 500 ms
//! to answer its roll call before it trusts that it knows them all, so its
//! first wait takes that long; each node's own answer comes a round trip
//! after it applied the change. For a dictionary's version, or an outbox's,
//! `Cluster::applied_version` does the same (see the `dictionary` example).
//!
//! ```text
//! cargo run -p cache-sync-examples --example acks
//! ```
#![allow(clippy::print_stdout)]

use std::time::Duration;

use cache_sync::cluster::Acks;
use cache_sync::{Node, Publisher, SyncedCache, cluster::Cluster, transport::EmbeddedTransport};

const CACHE: &str = "countries";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    for id in ["node-1", "node-2", "node-3"] {
        let countries: SyncedCache<String, String> =
            SyncedCache::new(CACHE, moka::future::Cache::new(100));
        let node = Node::builder(id, transport.clone())
            .register(&countries)
            .start()
            .await?;
        nodes.push((node, countries));
    }

    // The admin service: a watcher of the nodes, and a publisher.
    let cluster = Cluster::builder(transport.clone())
        .observer("admin")
        .start()
        .await?;
    let publisher = Publisher::builder(transport).origin("admin").build()?;

    let published = publisher.insert(CACHE, [("de", "Deutschland")]).await?;
    let acks = published.applied_by(&cluster, Duration::from_secs(5)).await;
    show("insert de", &acks);
    assert!(acks.is_complete(), "{acks}");
    assert_eq!(acks.applied(), 3);
    for (node, countries) in &nodes {
        let de = countries.peek("de").await;
        assert_eq!(de.as_deref(), Some("Deutschland"), "on {}", node.id());
    }

    // node-3 stops. Until its silence has lasted three heartbeat intervals,
    // the watcher counts it as live, and so waits for it: the wait ends at
    // the timeout, incomplete, naming it.
    let (node_3, _) = nodes.pop().ok_or("no node-3")?;
    node_3.shutdown().await?;
    let published = publisher.invalidate(CACHE, ["de"]).await?;
    let acks = published.applied_by(&cluster, Duration::from_secs(1)).await;
    show("invalidate de", &acks);
    assert!(!acks.is_complete());
    assert_eq!(acks.applied(), 2);
    assert_eq!(acks.pending().collect::<Vec<_>>(), ["node-3"]);

    cluster.shutdown().await;
    for (node, _) in nodes {
        node.shutdown().await?;
    }
    Ok(())
}

/// `applied on 3/3 nodes in 502 ms`, then each node's answer.
fn show(label: &str, acks: &Acks) {
    println!("admin: {label}: {acks}");
    for node in &acks.nodes {
        match node.latency {
            Some(after) => println!(
                "  {} applied it; answer {after:.1?} after the publish",
                node.node_id
            ),
            None => println!("  {} had not answered", node.node_id),
        }
    }
}
