//! The cache-sync demo: three application nodes and an admin service in one
//! process, kept in step over an in-process [`EmbeddedTransport`] (no server needed).
//!
//! Each node caches a `countries` table (country code -> name) and reads it
//! through from a shared in-memory "database". The admin changes rows (writing
//! the database first, then publishing), and after every change the demo
//! waits until all three nodes hold the new rows and prints what each holds
//! and how long the change took to arrive.
//!
//! ```text
//! cargo run -p cache-sync-examples --example demo
//! cargo run -p cache-sync-examples --example demo -- --keep-running
//! RUST_LOG=cache_sync=debug cargo run -p cache-sync-examples --example demo
//! ```

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cache_sync::{
    DictionaryPublisher, EmbeddedTransport, Node, Publisher, StatusServer, SyncedCache,
};
use tokio::sync::RwLock;
use tracing_subscriber::EnvFilter;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// The name the nodes register their caches under and the admin publishes to.
const CACHE: &str = "countries";
const NODE_IDS: [&str; 3] = ["node-1", "node-2", "node-3"];
/// Between two admin changes, so the output can be followed as it happens.
const PAUSE: Duration = Duration::from_millis(300);
/// On one machine a change arrives in well under a millisecond; a node this
/// late is broken, not slow.
const CONVERGENCE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the status endpoints stay up after the last change.
const LINGER: Duration = Duration::from_secs(3);

#[tokio::main]
async fn main() -> ExitCode {
    // The library logs losses and rejected events at `warn`; show them.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let keep_running = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--keep-running") => true,
        Some(_) => {
            eprintln!("usage: demo [--keep-running]");
            return ExitCode::from(2);
        }
    };
    match run(keep_running).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(keep_running: bool) -> Result<()> {
    let db = Database::seeded();
    let transport = EmbeddedTransport::new();
    println!(
        "cache-sync demo: {} nodes on one in-process transport, cache {CACHE:?}, database of {} countries",
        NODE_IDS.len(),
        db.rows.read().await.len()
    );

    let mut nodes = Vec::new();
    for id in NODE_IDS {
        nodes.push(AppNode::start(id, &transport, &db).await?);
    }
    println!("\nStatus endpoints (paste into another terminal):");
    for n in &nodes {
        let addr = n.status.local_addr();
        let base = format!("http://{addr}");
        println!("  {} on {addr}", n.node.id());
        println!("    curl -s {base}/cache-sync/status");
        println!("    curl -s {base}/cache-sync/caches/{CACHE}");
        println!("    curl -s {base}/readyz");
    }
    if let Some(n) = nodes.first() {
        let base = format!("http://{}", n.status.local_addr());
        println!("  The whole cluster, as any node sees it (open the first in a browser):");
        println!("    {base}/cache-sync/");
        println!("    curl -s {base}/cache-sync/cluster");
        println!("    curl -s {base}/metrics");
    }

    println!("\nWarming the caches through the loader:");
    let warm_up: [&[&str]; 3] = [
        &["de", "fr", "it"],
        &["de", "es", "nl"],
        &["de", "fr", "pl"],
    ];
    for (n, codes) in nodes.iter().zip(warm_up) {
        let reads_before = db.reads();
        let mut held = Vec::new();
        for code in codes {
            held.push((code.to_string(), n.country(code).await));
        }
        println!(
            "  {}  {}  ({} database reads)",
            n.node.id(),
            show_rows(&held),
            db.reads() - reads_before
        );
    }

    // The admin service is a separate publisher on the same transport; its origin
    // names it in the nodes' logs.
    let admin = Admin {
        db: db.clone(),
        table: Publisher::builder(transport.clone())
            .origin("admin")
            .build()?
            .dictionary(CACHE),
    };

    let change = admin.upsert("de", "Deutschland").await?;
    report(&nodes, &db, &change).await?;
    println!("  (no node read the database: the event carried the new row)");

    tokio::time::sleep(PAUSE).await;
    let change = admin.delete("fr").await?;
    report(&nodes, &db, &change).await?;
    println!("  A read after the delete goes back to the database:");
    for n in &nodes {
        let reads_before = db.reads();
        let found = n.country("fr").await;
        println!(
            "  {}  fr -> {}  ({} database read; a missing row is not cached)",
            n.node.id(),
            found.as_deref().unwrap_or("no such country"),
            db.reads() - reads_before
        );
    }

    tokio::time::sleep(PAUSE).await;
    // No node has read "cz": an upsert installs the row everywhere anyway.
    let change = admin.upsert("cz", "Czechia").await?;
    report(&nodes, &db, &change).await?;

    tokio::time::sleep(PAUSE).await;
    let change = admin
        .replace_all(&[
            ("de", "Deutschland"),
            ("es", "España"),
            ("it", "Italia"),
            ("pt", "Portugal"),
        ])
        .await?;
    report(&nodes, &db, &change).await?;

    println!("\nWhat each node's status endpoint reports now (a few of its counters):");
    for n in &nodes {
        let s = n.node.status();
        let c = n.countries.status();
        println!(
            "  {}  events: {} received, {} applied ({} refreshes, {} invalidations, {} clears, \
             {} stale), {} losses, {} gaps",
            s.node_id,
            s.events_received,
            c.events_applied,
            c.refreshes,
            c.invalidations,
            c.clears,
            c.stale_ignored,
            s.losses,
            s.publisher_gaps,
        );
        println!(
            "  {}  reads: {} hits, {} misses, {} loads ({} found no row)",
            " ".repeat(s.node_id.len()),
            c.hits,
            c.misses,
            c.loads,
            c.load_failures,
        );
    }

    if keep_running {
        println!("\nServing the status endpoints until Ctrl-C.");
        tokio::signal::ctrl_c().await?;
    } else {
        println!(
            "\nExiting in {} s (run with `-- --keep-running` to keep the endpoints up).",
            LINGER.as_secs()
        );
        tokio::time::sleep(LINGER).await;
    }

    for n in nodes {
        n.status.shutdown().await?;
        // Saves the node's position and waits for its consumer to finish.
        n.node.shutdown().await?;
    }
    println!("Shut down cleanly.");
    Ok(())
}

/// Stands in for the database table the caches front.
#[derive(Clone)]
struct Database {
    rows: Arc<RwLock<BTreeMap<String, String>>>,
    /// Counted so the demo can show which reads the cache saved.
    reads: Arc<AtomicU64>,
}

impl Database {
    fn seeded() -> Self {
        let rows = [
            ("de", "Germany"),
            ("es", "Spain"),
            ("fr", "France"),
            ("it", "Italy"),
            ("jp", "Japan"),
            ("nl", "Netherlands"),
            ("pl", "Poland"),
            ("se", "Sweden"),
        ];
        Self {
            rows: Arc::new(RwLock::new(
                rows.into_iter()
                    .map(|(k, v)| (k.into(), v.into()))
                    .collect(),
            )),
            reads: Arc::default(),
        }
    }

    async fn select(&self, code: &str) -> Option<String> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        // A real query takes a while; that is what the cache saves.
        tokio::time::sleep(Duration::from_millis(2)).await;
        self.rows.read().await.get(code).cloned()
    }

    fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

/// The loader's answer for a code the database lacks. An error rather than a
/// placeholder value, because errors are not cached: the row may be created
/// later, and a cached placeholder would hide it. (The status endpoint
/// counts it under `load_failures`.)
#[derive(Debug)]
struct NotFound;

/// One application node: its cache, the consumer keeping it in step, and its
/// status endpoint.
struct AppNode {
    node: Node,
    countries: SyncedCache<String, String>,
    status: StatusServer,
    db: Database,
}

impl AppNode {
    async fn start(id: &str, transport: &EmbeddedTransport, db: &Database) -> Result<Self> {
        let countries = SyncedCache::new(CACHE, moka::future::Cache::new(10_000));
        // Registration empties the cache (nothing read before it was kept in
        // step), so it comes before the first read.
        let node = Node::builder(id, transport.clone())
            .register(&countries)
            .start()
            .await?;
        // Port 0: the OS picks a free port, so the demo never clashes with
        // anything already listening.
        let status = node.serve_status("127.0.0.1:0").await?;
        Ok(Self {
            node,
            countries,
            status,
            db: db.clone(),
        })
    }

    /// Read-through: the cached row if there is one, else the database's,
    /// which is then cached for the next reader.
    async fn country(&self, code: &str) -> Option<String> {
        let db = &self.db;
        self.countries
            .try_get_with(code.to_owned(), || async move {
                db.select(code).await.ok_or(NotFound)
            })
            .await
            .ok()
    }

    /// What the cache holds for `codes`, without loading anything.
    async fn holds(&self, codes: impl Iterator<Item = &String>) -> Vec<(String, Option<String>)> {
        let mut held = Vec::new();
        for code in codes {
            held.push((code.clone(), self.countries.peek(code).await));
        }
        held
    }

    async fn has_applied(&self, change: &Change) -> bool {
        // The version alone is not enough: replace_all sends two events (a
        // clear, then the rows) at one version. So compare the rows too.
        self.countries.status().version == Some(change.version)
            && self
                .holds(change.expected.iter().map(|(code, _)| code))
                .await
                == change.expected
    }
}

/// The admin service: the one writer of the table.
///
/// It writes the database before publishing. The other way round, a node
/// reading between the event and the database write would cache the old row,
/// and no later event would correct it.
struct Admin {
    db: Database,
    table: DictionaryPublisher<String, String>,
}

/// A published change, and what every node should hold once it is applied.
struct Change {
    label: String,
    version: u64,
    /// Each code the change touched and its row now (`None`: deleted).
    expected: Vec<(String, Option<String>)>,
    published_at: Instant,
}

impl Admin {
    async fn upsert(&self, code: &str, name: &str) -> Result<Change> {
        let (code, name) = (code.to_owned(), name.to_owned());
        self.db
            .rows
            .write()
            .await
            .insert(code.clone(), name.clone());
        let published_at = Instant::now();
        let version = self.table.insert(&code, &name).await?;
        Ok(Change {
            label: format!("upsert {code} = {name}"),
            version,
            expected: vec![(code, Some(name))],
            published_at,
        })
    }

    async fn delete(&self, code: &str) -> Result<Change> {
        let code = code.to_owned();
        self.db.rows.write().await.remove(&code);
        let published_at = Instant::now();
        let version = self.table.invalidate(&code).await?;
        Ok(Change {
            label: format!("delete {code}"),
            version,
            expected: vec![(code, None)],
            published_at,
        })
    }

    async fn replace_all(&self, rows: &[(&str, &str)]) -> Result<Change> {
        let new: BTreeMap<String, String> = rows
            .iter()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let old = std::mem::replace(&mut *self.db.rows.write().await, new.clone());
        let published_at = Instant::now();
        let version = self.table.replace_all(&new).await?;
        // Rows the new table lacks must be gone from every node as well.
        let mut codes: Vec<&String> = old.keys().chain(new.keys()).collect();
        codes.sort();
        codes.dedup();
        Ok(Change {
            label: format!("replace_all with {} rows", new.len()),
            version,
            expected: codes
                .into_iter()
                .map(|code| (code.clone(), new.get(code).cloned()))
                .collect(),
            published_at,
        })
    }
}

/// Waits until every node has applied `change`, then prints one line per node.
async fn report(nodes: &[AppNode], db: &Database, change: &Change) -> Result<()> {
    println!("\nadmin: {}  (version {})", change.label, change.version);
    let reads_before = db.reads();
    let seen_after = wait_until_applied(nodes, change).await?;
    for (n, seen) in nodes.iter().zip(seen_after) {
        let applied_us = n.countries.status().last_latency_us.unwrap_or_default();
        let codes = change.expected.iter().map(|(code, _)| code);
        println!(
            "  {}  {}  applied {} after publish (the demo saw it at {})",
            n.node.id(),
            show_rows(&n.holds(codes).await),
            millis(Duration::from_micros(applied_us)),
            millis(seen),
        );
    }
    println!(
        "  all {} nodes agree with the database at version {} ({} database reads meanwhile)",
        nodes.len(),
        change.version,
        db.reads() - reads_before
    );
    Ok(())
}

/// Polls the nodes until each has applied `change`. Returns, per node, the
/// time from the publish call until it was first seen applied (the node's
/// own `last_latency_us` is more precise; this includes the polling).
async fn wait_until_applied(nodes: &[AppNode], change: &Change) -> Result<Vec<Duration>> {
    let mut seen: Vec<Option<Duration>> = vec![None; nodes.len()];
    loop {
        for (n, seen) in nodes.iter().zip(&mut seen) {
            if seen.is_none() && n.has_applied(change).await {
                *seen = Some(change.published_at.elapsed());
            }
        }
        if let Some(all) = seen.iter().copied().collect::<Option<Vec<_>>>() {
            return Ok(all);
        }
        if change.published_at.elapsed() > CONVERGENCE_TIMEOUT {
            let late: Vec<&str> = nodes
                .iter()
                .zip(&seen)
                .filter(|(_, seen)| seen.is_none())
                .map(|(n, _)| n.node.id())
                .collect();
            return Err(format!(
                "{late:?} did not apply {:?} within {CONVERGENCE_TIMEOUT:?}",
                change.label
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// `de=Deutschland fr=-`, with `-` for a code the cache does not hold.
fn show_rows(rows: &[(String, Option<String>)]) -> String {
    rows.iter()
        .map(|(code, name)| format!("{code}={}", name.as_deref().unwrap_or("-")))
        .collect::<Vec<_>>()
        .join(" ")
}

fn millis(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}
