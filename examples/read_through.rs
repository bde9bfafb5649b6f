//! A node's read-through cache, kept current by the admin's changes.
//!
//! A read that misses runs the loader (a database query) and caches its row;
//! the next reads are hits. When the admin changes a row it writes the
//! database, then publishes: an `insert` carries the new row, which the node
//! installs, so the next read needs no query; an `invalidate` drops the row,
//! so the next read queries again. A row the database lacks is not cached:
//! the loader returns an error, which `try_get_with` hands back uncached, as
//! the row may be created later. (A cache of `Option<V>` caches the absence
//! instead: see the `node` example.)
//!
//! ```text
//! cargo run -p cache-sync-examples --example read_through
//! ```
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table, cluster::Cluster, transport::EmbeddedTransport,
};

const COUNTRIES: Table<String, String> = Table::new("countries");

/// Stands in for the table the cache fronts, counting the queries it answers.
#[derive(Default)]
struct Database {
    rows: Mutex<HashMap<String, String>>,
    queries: AtomicU64,
}

impl Database {
    /// `SELECT name FROM countries WHERE code = $1`
    fn select(&self, code: &str) -> Result<String, NotFound> {
        self.queries.fetch_add(1, Ordering::Relaxed);
        let rows = self.rows.lock().expect("database lock");
        rows.get(code).cloned().ok_or(NotFound)
    }

    /// An `INSERT … ON CONFLICT DO UPDATE` (`Some`) or a `DELETE` (`None`).
    fn write(&self, code: &str, name: Option<&str>) {
        let mut rows = self.rows.lock().expect("database lock");
        match name {
            Some(name) => rows.insert(code.into(), name.into()),
            None => rows.remove(code),
        };
    }

    fn queries(&self) -> u64 {
        self.queries.load(Ordering::Relaxed)
    }
}

/// The loader's answer for a missing row: an error, so nothing is cached.
#[derive(Debug)]
struct NotFound;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = Database::default();
    db.write("de", Some("Germany"));
    db.write("fr", Some("France"));
    let transport = EmbeddedTransport::new();
    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = Node::builder("node-1", transport.clone())
        .register(&countries)
        .start()
        .await?;
    // The cached row, or else the database's, cached for the next reader.
    let read = async |code: &str| {
        let load = || async { db.select(code) };
        countries.try_get_with(code.to_owned(), load).await.ok()
    };

    let (de, fr) = (read("de").await, read("fr").await);
    let de_again = read("de").await;
    println!(
        "read de, fr, de: {de:?} {fr:?} {de_again:?} ({} queries)",
        db.queries()
    );
    assert_eq!(db.queries(), 2, "the second read of de is a hit");

    // The admin service: writes the database first, then publishes. It
    // watches the nodes, to know when they have applied each change.
    let cluster = Cluster::watch(transport.clone()).await?;
    let admin = Publisher::new(transport).dictionary(COUNTRIES);
    let applied = async |version: u64| {
        let acks = cluster
            .applied_version(COUNTRIES.name(), version, Duration::from_secs(5))
            .await;
        assert!(acks.is_complete(), "{acks}");
    };

    db.write("de", Some("Deutschland"));
    applied(admin.insert("de", "Deutschland").await?).await;
    let de = read("de").await;
    println!(
        "admin: insert de -> de = {de:?} ({} queries: the event carried the row)",
        db.queries()
    );
    assert_eq!((de.as_deref(), db.queries()), (Some("Deutschland"), 2));

    db.write("fr", None);
    applied(admin.invalidate("fr").await?).await;
    let (fr, fr_again) = (read("fr").await, read("fr").await);
    println!(
        "admin: invalidate fr -> fr = {fr:?}, again {fr_again:?} ({} queries: no row is cached)",
        db.queries()
    );
    assert_eq!((fr, fr_again, db.queries()), (None, None, 4));

    let s = countries.status();
    println!(
        "node-1 counted {} hits, {} misses, {} loads ({} found no row), {} refreshes, {} invalidations",
        s.hits, s.misses, s.loads, s.load_failures, s.refreshes, s.invalidations
    );
    assert_eq!((s.hits, s.misses, s.loads, s.load_failures), (2, 4, 4, 2));
    assert_eq!((s.refreshes, s.invalidations), (1, 1));
    cluster.shutdown().await;
    node.shutdown().await?;
    Ok(())
}
