//! The cache-sync demo: three application nodes and an admin service in one
//! process, kept in step over an in-process [`EmbeddedTransport`] (no server
//! needed).
//!
//! Each node caches a `countries` table, read through from a shared
//! in-memory "database", and serves its status endpoints. The admin changes
//! rows, the database first and then a published change, and after each
//! prints how many nodes applied it, how soon, and what each node holds.
//! Each piece has a small example of its own: `read_through` (the loader,
//! and what changes do to what it cached), `dictionary` (the admin's
//! writes), `acks` (proving a change arrived), `axum_status` (the status
//! endpoints).
//!
//! ```text
//! cargo run -p cache-sync-examples --example demo
//! cargo run -p cache-sync-examples --example demo -- --keep-running
//! RUST_LOG=cache_sync=debug cargo run -p cache-sync-examples --example demo
//! ```

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table, cluster::Cluster, transport::EmbeddedTransport,
};
use tracing_subscriber::EnvFilter;

type Result<T, E = Box<dyn std::error::Error>> = std::result::Result<T, E>;

const COUNTRIES: Table<String, String> = Table::new("countries");
/// The admin's changes: a row written (`Some`) or deleted (`None`). No node
/// has read `cz`: the change installs it everywhere anyway.
const CHANGES: [(&str, Option<&str>); 3] = [
    ("de", Some("Deutschland")),
    ("fr", None),
    ("cz", Some("Czechia")),
];

/// Stands in for the table the caches front, counting the queries it answers.
#[derive(Default)]
struct Database {
    rows: Mutex<BTreeMap<String, String>>,
    queries: AtomicU64,
}

impl Database {
    /// `SELECT name FROM countries WHERE code = $1`; no row is an error,
    /// which the cache does not keep (the row may be created later).
    fn select(&self, code: &str) -> Result<String, &'static str> {
        self.queries.fetch_add(1, Ordering::Relaxed);
        let rows = self.rows.lock().expect("database lock");
        rows.get(code).cloned().ok_or("no such row")
    }

    /// Writes a row (`Some`) or deletes it (`None`).
    fn write(&self, code: &str, name: Option<&str>) {
        let mut rows = self.rows.lock().expect("database lock");
        match name {
            Some(name) => rows.insert(code.into(), name.into()),
            None => rows.remove(code),
        };
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    // The library logs losses and rejected events at `warn`; show them.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let keep_running = std::env::args().any(|arg| arg == "--keep-running");
    let db = Database::default();
    for (code, name) in [("de", "Germany"), ("fr", "France"), ("it", "Italy")] {
        db.write(code, Some(name));
    }
    let queries = || db.queries.load(Ordering::Relaxed);
    // Read-through: the cached row, or else the database's, cached.
    let read = async |countries: &SyncedCache<String, String>, code: &str| {
        let load = || async { db.select(code) };
        countries.try_get_with(code.to_owned(), load).await.ok()
    };
    let transport = EmbeddedTransport::new();

    println!("Three nodes, each reading de, fr and it through its loader:");
    let mut nodes = Vec::new();
    for id in ["node-1", "node-2", "node-3"] {
        let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(10_000));
        // Registration empties the cache, so it comes before the first read.
        let node = Node::builder(id, transport.clone())
            .register(&countries)
            .start()
            .await?;
        for code in ["de", "fr", "it"] {
            read(&countries, code).await;
        }
        // Port 0: the OS picks a free port, so the demo never clashes.
        let status = node.serve_status("127.0.0.1:0").await?;
        let base = format!("http://{}", status.local_addr());
        println!("  {id}  curl -s {base}/cache-sync/status   the cluster: {base}/cache-sync/");
        nodes.push((node, countries, status));
    }
    println!("  {} database queries", queries());

    // The admin service: the table's one writer, and a watcher of the nodes.
    let cluster = Cluster::builder(transport.clone())
        .observer("admin")
        .start()
        .await?;
    let table = Publisher::builder(transport)
        .origin("admin")
        .build()?
        .dictionary(COUNTRIES);
    println!(
        "\nadmin: watching the nodes; its first wait gives them 500 ms to answer its roll call"
    );
    for (code, row) in CHANGES {
        // The database first: the other way round, a node reading between
        // the change and the write would cache the old row for good.
        db.write(code, row);
        let version = match row {
            Some(name) => table.insert(code, name).await?,
            None => table.invalidate(code).await?,
        };
        let acks = cluster
            .applied_version(table.cache(), version, Duration::from_secs(5))
            .await;
        let change = row.map_or(format!("invalidate {code}"), |row| {
            format!("insert {code}={row}")
        });
        println!("\nadmin: {change} (version {version}): {acks}");
        if !acks.is_complete() {
            return Err(format!("not applied everywhere: {acks}").into());
        }
        for (node, countries, _) in &nodes {
            let held = countries.peek(code).await;
            let micros = countries.status().last_latency_us.unwrap_or_default();
            let held = held.as_deref().unwrap_or("-");
            println!(
                "  {}  {code}={held}  applied {micros} µs after the publish",
                node.id()
            );
        }
        // So the output can be followed as it happens.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let before = queries();
    for (_, countries, _) in &nodes {
        for code in ["de", "cz", "fr"] {
            read(countries, code).await;
        }
    }
    println!(
        "\nEvery node reads de, cz and fr: {} database queries, for fr (deleted); \
         de and cz came with the changes.",
        queries() - before
    );
    if keep_running {
        println!("Serving the status endpoints until Ctrl-C.");
        tokio::signal::ctrl_c().await?;
    } else {
        println!("Exiting in 3 s (`-- --keep-running` keeps the status endpoints up).");
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    cluster.shutdown().await;
    for (node, _, status) in nodes {
        status.shutdown().await?;
        // Saves the node's position and waits for its consumer to finish.
        node.shutdown().await?;
    }
    Ok(())
}
