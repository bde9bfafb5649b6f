//! Where one key stands on every node, and how it got there.
//!
//! Three nodes cache `countries`, loaded with the row's version. A row is
//! changed in the database with no event (a hand-run `UPDATE`, say): the
//! nodes go on serving the old value. A read that must not act on a cached
//! value (a price before payment) uses `get_fresh`, which reads the source
//! whatever the cache holds and installs the newer row on that node. Then:
//!
//! - `Cluster::probe` asks every node that holds the cache what it holds
//!   for the key, and at which version: node-1 is ahead, the others behind;
//! - the trace route (`Node::trace_router`, mounted here on a loopback
//!   listener of its own) shows, on one node, each write to the key: which
//!   event or load, from whom, at which version;
//! - once the admin publishes the change, the probe agrees.
//!
//! ```text
//! cargo run -p cache-sync-examples --example probe
//! ```
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cache_sync::status::TraceEvent;
use cache_sync::{Node, Publisher, SyncedCache, cluster::Cluster, transport::EmbeddedTransport};
use tokio::net::TcpListener;

#[path = "shared/http.rs"]
mod http;
use http::http_get;

const CACHE: &str = "countries";

/// The source of truth: each code's name and version.
type Db = Arc<Mutex<HashMap<String, (String, u64)>>>;

fn read(db: &Db, code: &str) -> (Option<String>, u64) {
    let db = db.lock().expect("the database");
    match db.get(code) {
        Some((name, version)) => (Some(name.clone()), *version),
        None => (None, 0),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db: Db = Arc::default();
    db.lock()
        .map_err(|_| "the database")?
        .insert("de".into(), ("Germany".into(), 1));

    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    for id in ["node-1", "node-2", "node-3"] {
        let countries: SyncedCache<String, Option<String>> =
            SyncedCache::builder(CACHE, moka::future::Cache::new(100))
                // Each key's last writes, kept in up to 64 KiB.
                .trace_bytes(64 << 10)
                .build()?;
        let node = Node::builder(id, transport.clone())
            .register(&countries)
            .start()
            .await?;
        // Every node has read the row once, at version 1.
        let de = countries
            .get_with_versioned("de".to_owned(), || async { read(&db, "de") })
            .await;
        assert_eq!(de.as_deref(), Some("Germany"));
        nodes.push((node, countries));
    }
    let cluster = Cluster::builder(transport.clone())
        .observer("admin")
        .start()
        .await?;

    // The row changes behind the publisher's back: no event.
    db.lock()
        .map_err(|_| "the database")?
        .insert("de".into(), ("Deutschland".into(), 2));
    let (node_1, countries_1) = &nodes[0];
    let cached = countries_1.get("de").await.flatten();
    println!("{}: cached de = {cached:?}", node_1.id());
    let fresh = countries_1
        .get_fresh("de".to_owned(), || async { read(&db, "de") })
        .await;
    println!("{}: get_fresh de = {fresh:?}", node_1.id());
    assert_eq!(fresh.as_deref(), Some("Deutschland"));

    let probe = cluster.probe(CACHE, "de", Duration::from_secs(5)).await?;
    println!("probe of de, newest version {:?}:\n{probe}", probe.newest());
    assert!(!probe.agrees());
    assert_eq!(probe.newest(), Some(2));
    let mut behind: Vec<&str> = probe.behind().collect();
    behind.sort_unstable();
    assert_eq!(behind, ["node-2", "node-3"]);

    // The admin publishes the change, with the row's version.
    let publisher = Publisher::builder(transport).origin("admin").build()?;
    let published = publisher
        .insert_versioned(CACHE, [("de", Some("Deutschland"), Some(2))])
        .await?;
    let acks = published.applied_by(&cluster, Duration::from_secs(5)).await;
    assert!(acks.is_complete(), "{acks}");
    let probe = cluster.probe(CACHE, "de", Duration::from_secs(5)).await?;
    println!("after the admin's publish:\n{probe}");
    assert!(probe.agrees());

    // How each node got there (after the clear its registration made):
    // node-1 loaded version 2 itself, so the event at that version changed
    // nothing there; node-2 took it from the event.
    for (node, countries) in &nodes[..2] {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(axum::serve(listener, node.trace_router()).into_future());
        let (status, body) = http_get(addr, "/cache-sync/caches/countries/trace?key=de").await?;
        server.abort();
        println!(
            "{}: GET /cache-sync/caches/countries/trace?key=de: {status}\n{body}",
            node.id()
        );
        assert!(status.ends_with("200 OK"), "{status}");
        let events: Vec<TraceEvent> = countries.trace("de").iter().map(|r| r.event).collect();
        let expected: &[TraceEvent] = if node.id() == "node-1" {
            &[
                TraceEvent::Cleared,
                TraceEvent::Loaded,
                TraceEvent::Loaded,
                TraceEvent::StaleIgnored,
            ]
        } else {
            &[
                TraceEvent::Cleared,
                TraceEvent::Loaded,
                TraceEvent::Refreshed,
            ]
        };
        assert_eq!(events, expected, "{}", node.id());
    }

    cluster.shutdown().await;
    for (node, _) in nodes {
        node.shutdown().await?;
    }
    Ok(())
}
