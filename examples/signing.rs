//! Signed events, and rotating the signing key without a moment in which
//! nodes reject a legitimate publisher.
//!
//! Anyone who can write to the broker can publish events; a node that
//! verifies signatures applies only those signed (HMAC-SHA256) with a key in
//! its [`Keyring`]. Rejected events change nothing, not even an invalidation,
//! so forgeries cannot flush caches either. A rotation takes three steps:
//! 1. add the new key to every node's ring (nodes accept old and new);
//! 2. switch every publisher's primary (signing) key to the new one;
//! 3. remove the old key from the nodes' rings.
//!
//! ```text
//! cargo run -p cache-sync-examples --example signing
//! ```
#![allow(clippy::print_stdout)]

use std::time::Duration;

use cache_sync::{
    DictionaryPublisher, Keyring, Node, Publisher, SyncedCache, Table, cluster::Cluster,
    transport::EmbeddedTransport,
};

const COUNTRIES: Table<String, String> = Table::new("countries");
// In production these come from a secret store; at least 16 bytes each.
const OLD: (&str, &[u8]) = ("2026-10", b"october's secret, never committed");
const NEW: (&str, &[u8]) = ("2026-11", b"november's secret, never committed");

type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

#[tokio::main]
async fn main() -> Result<()> {
    // Rejections are logged at `warn`, with their reason.
    tracing_subscriber::fmt()
        .with_env_filter("warn")
        .with_writer(std::io::stderr)
        .without_time()
        .init();
    let transport = EmbeddedTransport::new();
    let publisher = |origin: &str, ring: Option<Keyring>| -> Result<DictionaryPublisher<_, _>> {
        let builder = Publisher::builder(transport.clone()).origin(origin);
        let builder = match ring {
            Some(ring) => builder.signing(ring),
            None => builder,
        };
        Ok(builder.build()?.dictionary(COUNTRIES))
    };
    let start_node = |countries: &SyncedCache<String, String>, ring: Keyring| {
        let builder = Node::builder("node-1", transport.clone());
        builder.verify_signatures(ring).register(countries).start()
    };
    // The admin's watch on the nodes, to know when they applied a change.
    // Nodes that verify sign their heartbeats and take only signed requests,
    // so it needs the keys too: it signs with the new one, accepts both.
    let ring = Keyring::new(NEW.0, NEW.1)?.accept(OLD.0, OLD.1)?;
    let cluster = Cluster::builder(transport.clone())
        .verify_signatures(ring)
        .start()
        .await?;
    let applied = async |version: u64| {
        let acks = cluster
            .applied_version(COUNTRIES.name(), version, Duration::from_secs(5))
            .await;
        assert!(acks.is_complete(), "{acks}");
    };

    // Step 1: the node accepts both keys (a ring's primary key only signs).
    let both = Keyring::new(OLD.0, OLD.1)?.accept(NEW.0, NEW.1)?;
    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = start_node(&countries, both).await?;
    let old_admin = publisher("admin-old-key", Some(Keyring::new(OLD.0, OLD.1)?))?;
    applied(old_admin.insert("de", "Germany").await?).await;
    println!("old key accepted:  de = Germany");

    // Step 2: publishers sign with the new key; the node accepts that too.
    let admin = publisher("admin", Some(Keyring::new(NEW.0, NEW.1)?))?;
    applied(admin.insert("de", "Deutschland").await?).await;
    println!("new key accepted:  de = Deutschland");

    // No signature, or a guessed secret under the right key id: rejected.
    let guessed = Keyring::new(NEW.0, b"a guessed secret, 16+ bytes")?;
    for intruder in [
        publisher("unsigned", None)?,
        publisher("guessed", Some(guessed))?,
    ] {
        intruder.insert("de", "Forged").await?;
    }
    // A node takes events in order: once it applied a later change, it has
    // judged the forgeries.
    applied(admin.insert("es", "España").await?).await;
    let status = node.status_settled().await;
    let de = countries.peek("de").await;
    println!(
        "forgeries rejected: {}, de = {de:?}",
        status.events_rejected
    );
    assert_eq!(
        de.as_deref(),
        Some("Deutschland"),
        "a forgery changed the cache"
    );

    // Step 3: once no publisher signs with the old key, nodes drop it (here,
    // node-1 restarts with a ring of the new key alone).
    node.shutdown().await?;
    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = start_node(&countries, Keyring::new(NEW.0, NEW.1)?).await?;
    applied(admin.insert("fr", "France").await?).await;
    // It replayed the last 10 s as it started (its reorder window), rejecting
    // the old key's event and both forgeries among them.
    let rejected = node.status().events_rejected;
    old_admin.insert("fr", "Frankreich").await?;
    applied(admin.insert("it", "Italia").await?).await;
    assert_eq!(node.status().events_rejected, rejected + 1);
    let fr = countries.peek("fr").await;
    println!("after a restart with the new key alone: old key rejected, fr = {fr:?}");
    assert_eq!(fr.as_deref(), Some("France"));
    cluster.shutdown().await;
    node.shutdown().await?;
    Ok(())
}
