//! Row versions taken from the database, for tables that several services
//! write.
//!
//! A node installs a change only if its version is newer than what it has
//! seen for that key. With one writer, the dictionary helper's automatic
//! versions (publish-time clocks) are enough. With two, publish order is not
//! commit order: a writer that commits first may publish last (a slow network,
//! a retry), and its publish-time version would then win over the newer row.
//! The database's own row version orders the commits, whoever publishes first.
//!
//! The same goes for a node's read-through loads: `get_with_versioned` caches
//! the row with the version the database gave it, so an older event still in
//! transit cannot replace it afterwards.
//!
//! ```text
//! cargo run -p cache-sync-examples --example db_versions
//! ```
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cache_sync::{
    DictionaryPublisher, Node, Publisher, SyncedCache, Table, transport::EmbeddedTransport,
};

const COUNTRIES: Table<String, String> = Table::new("countries");

/// Stands in for a SQL table `countries (code, name, version)`: code -> (name, version).
type Database = Arc<Mutex<HashMap<String, (String, u64)>>>;

/// One admin service: writes the shared database, then publishes the row
/// with the version the database gave it.
struct Admin {
    db: Database,
    table: DictionaryPublisher<String, String>,
}

impl Admin {
    /// `UPDATE countries SET name = $1, version = version + 1
    ///  WHERE code = $2 RETURNING version`
    fn update(&self, code: &str, name: &str) -> u64 {
        let mut db = self.db.lock().expect("database lock");
        let row = db.entry(code.into()).or_insert((String::new(), 0));
        *row = (name.into(), row.1 + 1);
        row.1
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let transport = EmbeddedTransport::new();
    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = Node::builder("node-1", transport.clone())
        .register(&countries)
        .start()
        .await?;

    let db = Database::default();
    let seed = ("Germany".to_string(), 1);
    db.lock().expect("database lock").insert("de".into(), seed);
    let admin = |origin: &str| -> cache_sync::Result<Admin> {
        let publisher = Publisher::builder(transport.clone())
            .origin(origin)
            .build()?;
        Ok(Admin {
            db: db.clone(),
            table: publisher.dictionary(COUNTRIES),
        })
    };
    let (a, b) = (admin("admin-a")?, admin("admin-b")?);

    // admin-a commits first, admin-b second: the database orders them.
    let v_a = a.update("de", "Deutschland");
    let v_b = b.update("de", "Allemagne");
    println!("database: admin-a wrote version {v_a}, admin-b version {v_b}");
    // But admin-b publishes first and admin-a's event arrives late.
    let de = "de".to_string();
    b.table.insert_versioned(&de, "Allemagne", v_b).await?;
    a.table.insert_versioned(&de, "Deutschland", v_a).await?;

    let settled = async || node.status_settled().await.caches[0].clone();
    // The late event is one the node ignores: the node already holds a newer
    // version, so `Cluster::applied_version` would not wait for it. The
    // node's `stale_ignored` counter tells when it arrived.
    let stale_ignored = async |n: u64| {
        tokio::time::timeout(Duration::from_secs(5), async {
            while settled().await.stale_ignored < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
    };
    stale_ignored(1).await?;
    let cache = settled().await;
    let held = countries.peek("de").await;
    let in_db = db.lock().expect("database lock")["de"].clone();
    println!(
        "node-1 holds de = {held:?} at version {:?} ({} stale ignored); the database: {in_db:?}",
        cache.version, cache.stale_ignored
    );
    // The newer row wins, as in the database; the late, older one is ignored.
    assert_eq!(held.as_deref(), Some(in_db.0.as_str()));
    assert_eq!((cache.version, cache.stale_ignored), (Some(v_b), 1));

    // A read-through load races a late event. admin-a commits "fr", then
    // admin-b; node-1 misses "fr" and loads admin-b's row from the database
    // before admin-a's event arrives.
    let v_a = a.update("fr", "Frankreich");
    let v_b = b.update("fr", "Francia");
    let fr = "fr".to_string();
    let loaded = countries
        .get_with_versioned(fr.clone(), || {
            // SELECT name, version FROM countries WHERE code = 'fr'
            let row = db.lock().expect("database lock")["fr"].clone();
            async move { row }
        })
        .await;
    println!("node-1 loaded fr = {loaded:?} at version {v_b}");
    a.table.insert_versioned(&fr, "Frankreich", v_a).await?;
    stale_ignored(2).await?;
    let held = countries.peek("fr").await;
    println!("after admin-a's late event (version {v_a}), node-1 holds fr = {held:?}");
    // The load was cached at its row's version, so the older event is stale.
    // Loaded by `get_with`, the value would carry no version, and this
    // event, newer than anything node-1 had seen for "fr", would replace it.
    assert_eq!(held.as_deref(), Some("Francia"));
    assert_eq!(settled().await.loads_stale, 0);
    node.shutdown().await?;
    Ok(())
}
