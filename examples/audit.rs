//! The consistency auditor: a write that bypassed the publisher (a `psql`
//! session, a migration) is found by every node that held the row, counted,
//! logged and repaired; the writes that went through the publisher never
//! are.
//!
//! Each node's cache is built with an `Audit`: a batched, versioned read of
//! the database (here a map standing in for `SELECT code, name, version
//! FROM countries WHERE code = ANY($1)`). The node sweeps the entries it
//! holds at the rate given, and an entry older than the database is first a
//! suspect, then, if the node still holds it after the grace window, an
//! inconsistency. The grace window here is 500 ms so that the example is
//! quick; the default (the reorder window + 3 s) is what production wants.
//!
//! ```text
//! cargo run -p cache-sync-examples --example audit
//! ```
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cache_sync::{Audit, Node, Publisher, SyncedCache, transport::EmbeddedTransport};

/// code -> (name, version).
type Database = Arc<Mutex<HashMap<String, (String, u64)>>>;

fn audited(db: &Database) -> cache_sync::Result<SyncedCache<String, String>> {
    let db = db.clone();
    let read = move |codes: Vec<String>| {
        let rows = db.lock().expect("database lock");
        let answer: Vec<_> = codes
            .into_iter()
            .map(|code| {
                let row = rows.get(&code).cloned();
                (code, row)
            })
            .collect();
        async move { Ok::<_, std::io::Error>(answer) }
    };
    SyncedCache::builder("countries", moka::future::Cache::new(1000))
        .trace_bytes(64 * 1024)
        .audit(
            Audit::versioned(read)
                .rate(1000)
                .grace(Duration::from_millis(500)),
        )
        .build()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = Database::default();
    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b"] {
        let cache = audited(&db)?;
        let node = Node::builder(id, transport.clone())
            .reorder_window(Duration::ZERO)
            .register(&cache)
            .start()
            .await?;
        nodes.push((node, cache));
    }

    // The admin service: the database first, then the event.
    let admin = Publisher::new(transport.clone());
    for (i, (code, name)) in [("de", "Germany"), ("fr", "France"), ("it", "Italy")]
        .into_iter()
        .enumerate()
    {
        let version = i as u64 + 1;
        db.lock()
            .expect("database lock")
            .insert(code.into(), (name.into(), version));
        admin
            .insert_versioned(
                "countries",
                [(code.to_owned(), name.to_owned(), Some(version))],
            )
            .await?;
    }
    for (node, cache) in &nodes {
        while cache.peek("it").await.is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!("{} holds de, fr, it", node.id());
    }

    // Someone runs `UPDATE countries SET name = 'Deutschland', version = 4
    // WHERE code = 'de'` by hand: no event is published.
    db.lock()
        .expect("database lock")
        .insert("de".into(), ("Deutschland".into(), 4));
    println!("de changed in the database behind the publisher's back");

    for (node, cache) in &nodes {
        while cache.status().audit.is_none_or(|a| a.inconsistencies == 0) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let audit = cache.status().audit.expect("audited");
        println!(
            "{}: {} inconsistency found and {} repaired, after {} ms seen behind; {} checks",
            node.id(),
            audit.inconsistencies,
            audit.repairs,
            audit.max_stale_age_ms.unwrap_or(0),
            audit.checks,
        );
        assert_eq!((audit.inconsistencies, audit.repairs), (1, 1));
        let last = cache.trace(&"de".to_owned()).pop().expect("traced");
        println!(
            "{}: de's last trace record: {:?} at version {:?}",
            node.id(),
            last.event,
            last.version
        );
        // The entry was removed: the next read loads the database's row.
        let de = cache
            .get_with_versioned("de".to_owned(), || async {
                db.lock().expect("database lock")["de"].clone()
            })
            .await;
        println!("{}: reads de = {de}", node.id());
        assert_eq!(de, "Deutschland");
    }
    for (node, cache) in nodes {
        let audit = cache.status().audit.expect("audited");
        // fr and it, published as written, never counted.
        assert_eq!(audit.inconsistencies, 1);
        node.shutdown().await?;
    }
    Ok(())
}
