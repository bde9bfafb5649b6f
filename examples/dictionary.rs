//! The admin service's writes to a dictionary table: a `DictionaryPublisher`
//! sends each to every node, whether or not the node ever read the row.
//!
//! | write | what every node does |
//! |---|---|
//! | `insert(key, row)` | installs the row |
//! | `invalidate(key)` | drops it, and keeps a tombstone: a late, older insert cannot bring it back |
//! | `replace_all(rows)` | drops every row, then installs these |
//! | `invalidate_all()` | drops every row |
//!
//! Each returns the version the helper gave the change (microseconds,
//! strictly increasing), and every node reports its cache at the newest
//! version it applied; a `Cluster` watcher waits for all of them to reach
//! it (`applied_version`). In a real admin service each write follows the
//! database write it announces.
//!
//! ```text
//! cargo run -p cache-sync-examples --example dictionary
//! ```
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table, cluster::Cluster, transport::EmbeddedTransport,
};

const COUNTRIES: Table<String, String> = Table::new("countries");
const SHOWN: [&str; 5] = ["de", "es", "fr", "it", "pt"];

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    for id in ["node-1", "node-2", "node-3"] {
        let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
        let node = Node::builder(id, transport.clone())
            .register(&countries)
            .start()
            .await?;
        nodes.push((node, countries));
    }
    // Only node-1 has read a row so far.
    let loader = || async { "Germany".to_owned() };
    nodes[0].1.get_with("de".to_owned(), loader).await;

    let cluster = Cluster::watch(transport.clone()).await?;
    let table = Publisher::builder(transport)
        .origin("admin")
        .build()?
        .dictionary(COUNTRIES);
    // Waits until every node has applied `version`, then checks what each holds.
    let applied = async |label: &str, version: u64, expected: &str| {
        let acks = cluster
            .applied_version(COUNTRIES.name(), version, Duration::from_secs(5))
            .await;
        println!("admin: {label} (version {version}): {acks}");
        assert!(acks.is_complete(), "{acks}");
        for (node, countries) in &nodes {
            let mut held = Vec::new();
            for code in SHOWN {
                let name = countries.peek(code).await;
                held.push(format!("{code}={}", name.as_deref().unwrap_or("-")));
            }
            println!("  {}  {}", node.id(), held.join(" "));
            assert_eq!(held.join(" "), expected, "on {}", node.id());
        }
    };

    let v = table.insert("de", "Deutschland").await?;
    applied("insert de", v, "de=Deutschland es=- fr=- it=- pt=-").await;

    let v = table.invalidate("de").await?;
    applied("invalidate de", v, "de=- es=- fr=- it=- pt=-").await;

    let rows: BTreeMap<String, String> = [("es", "España"), ("fr", "France"), ("it", "Italia")]
        .map(|(code, name)| (code.to_owned(), name.to_owned()))
        .into();
    table.replace_all(&rows).await?;
    // replace_all sends a clear and then the rows, at one version, and a
    // node takes that version in with the clear. So the next change is what
    // proves the rows arrived: a node applies one publisher's changes in
    // order, so one that applied it applied everything before.
    let v = table.insert("pt", "Portugal").await?;
    applied(
        "replace_all es fr it, insert pt",
        v,
        "de=- es=España fr=France it=Italia pt=Portugal",
    )
    .await;

    let v = table.invalidate_all().await?;
    applied("invalidate_all", v, "de=- es=- fr=- it=- pt=-").await;

    for (node, countries) in &nodes {
        let s = countries.status();
        println!(
            "{}: {} refreshes (inserted rows), {} invalidations, {} clears",
            node.id(),
            s.refreshes,
            s.invalidations,
            s.clears
        );
        assert_eq!((s.refreshes, s.invalidations, s.clears), (5, 1, 2));
    }
    cluster.shutdown().await;
    for (node, _) in nodes {
        node.shutdown().await?;
    }
    Ok(())
}
