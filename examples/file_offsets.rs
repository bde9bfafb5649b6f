//! A node that keeps its position in `offsets.json` (a [`FileOffsetStore`]),
//! so when it restarts it applies the changes published while it was down,
//! and only those.
//!
//! The node saves its position every few seconds and on `shutdown`. Here the
//! "restart" is a second node on the same [`EmbeddedTransport`]: its positions
//! name that transport instance, so they mean nothing to another process. On
//! Redis Streams, NATS JetStream or RocketMQ the history outlives the process,
//! and the same file lets a restarted process resume.
//!
//! ```text
//! cargo run -p cache-sync-examples --example file_offsets
//! ```
#![allow(clippy::print_stdout)]

use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table,
    cluster::Cluster,
    transport::{EmbeddedTransport, FileOffsetStore},
};

const COUNTRIES: Table<String, String> = Table::new("countries");

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A directory of the node's own; in production a persistent volume.
    let dir = std::env::temp_dir().join(format!("cache-sync-file-offsets-{}", std::process::id()));
    let transport = EmbeddedTransport::new();
    let admin = Publisher::new(transport.clone()).dictionary(COUNTRIES);
    // The admin watches the nodes, to know when they have applied a change.
    let cluster = Cluster::watch(transport.clone()).await?;
    let applied = async |version: u64| {
        let acks = cluster
            .applied_version(COUNTRIES.name(), version, Duration::from_secs(5))
            .await;
        assert!(acks.is_complete(), "{acks}");
    };
    let start_node = |countries: &SyncedCache<String, String>| {
        Node::builder("node-1", transport.clone())
            .offset_store(FileOffsetStore::new(&dir))
            // One admin with automatic versions never publishes out of order,
            // so no reorder window is needed. With the default one, a resumed
            // node would apply replayed inserts as invalidations for 10 s:
            // safe (the next read goes to the database), but nothing to see.
            .reorder_window(Duration::ZERO)
            .register(countries)
            .start()
    };

    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = start_node(&countries).await?;
    applied(admin.insert("de", "Germany").await?).await;
    node.shutdown().await?; // saves the position
    let json = std::fs::read_to_string(dir.join("offsets.json"))?;
    println!("node-1 applied de, shut down; {}:\n{json}", dir.display());

    // Published while no node is running.
    admin.insert("fr", "France").await?;
    let last = admin.insert("it", "Italy").await?;
    println!("while it was down: insert fr, insert it");

    // A new cache (registration empties it anyway) and the same store.
    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = start_node(&countries).await?;
    applied(last).await;
    let status = node.status_settled().await;
    println!(
        "restarted: fr={:?} it={:?} de={:?}, {} events replayed",
        countries.peek("fr").await,
        countries.peek("it").await,
        countries.peek("de").await,
        status.events_received
    );
    // Exactly the two missed changes: it resumed after de, not from the start.
    assert_eq!(status.events_received, 2);
    assert!(!countries.contains_key("de"));

    cluster.shutdown().await;
    node.shutdown().await?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
