//! Invalidation from PostgreSQL's own log: a CDC relay and two nodes, and
//! any write to the `countries` table, from any client, reaches them. No
//! outbox, no publish call in the writer:
//!
//! ```text
//! cargo run -p cache-sync-examples --features postgres-cdc --example postgres_cdc
//! psql -h 127.0.0.1 -U postgres -c "UPDATE countries SET name = 'Deutschland' WHERE code = 'de'"
//! ```
//!
//! The server needs `wal_level = logical` (the example says so, with the
//! fix, when it does not). The relay and the nodes run in one process on
//! the embedded transport; in production the relay runs beside the
//! database (one active, the others standing by) and publishes to a broker.
//! Every 500 ms each node reads a few codes through its cache and prints
//! any that changed, with the cache's version: the commit's LSN.

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache,
    cdc::{CdcRelay, CdcTable},
    transport::EmbeddedTransport,
};
use clap::Parser as _;
use sqlx::PgPool;
use tracing_subscriber::EnvFilter;

#[path = "shared/countries_db.rs"]
mod countries_db;
#[path = "shared/tables.rs"]
mod tables;
use tables::COUNTRIES;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

const SHOWN: [&str; 6] = ["de", "es", "fr", "it", "nl", "se"];

/// A CDC relay and two nodes caching the `countries` table: a write from
/// any client reaches both. Ctrl-C stops it.
#[derive(Debug, clap::Parser)]
#[command(name = "postgres_cdc", verbatim_doc_comment)]
struct Args {
    /// The database (its server needs wal_level = logical)
    #[arg(long, value_name = "URL", default_value = countries_db::DEFAULT_URL)]
    database: String,
    /// The replication slot and publication the relay owns
    #[arg(long, value_name = "NAME", default_value = "cache_sync_example")]
    slot: String,
    /// Exit after this many seconds (default: run until Ctrl-C)
    #[arg(long, value_name = "SECONDS")]
    exit_after: Option<u64>,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("postgres_cdc: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let pool = PgPool::connect(&args.database).await?;
    let level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(&pool)
        .await?;
    if level != "logical" {
        return Err(format!(
            "the server runs with wal_level = {level}; logical replication needs \
             `ALTER SYSTEM SET wal_level = logical` and a restart of the server"
        )
        .into());
    }
    countries_db::create(&pool).await?;

    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    for id in ["node-a", "node-b"] {
        let cache = SyncedCache::new(COUNTRIES, moka::future::Cache::new(1_000));
        let node = Node::builder(id, transport.clone())
            .register(&cache)
            .start()
            .await?;
        nodes.push((id, node, cache));
    }
    // INSERT and UPDATE install the committed row on every node; DELETE
    // drops it; TRUNCATE clears the cache. Each at the commit's LSN.
    let relay = CdcRelay::builder(args.database.as_str(), Publisher::new(transport.clone()))
        .slot(args.slot.as_str())
        .publication(args.slot.as_str())
        .table(
            CdcTable::new(COUNTRIES, "countries", |row| {
                row.get("code").map(str::to_owned)
            })
            .value(|row| Some(row.get("name").map(str::to_owned))),
        )
        .start()
        .await?;
    println!(
        "relay on slot {:?}; now write the table from anywhere, e.g.:\n  \
         psql -h 127.0.0.1 -U postgres -c \"UPDATE countries SET name = 'Deutschland' WHERE code = 'de'\"",
        args.slot
    );

    let mut shown: Vec<BTreeMap<&str, Option<String>>> = vec![BTreeMap::new(); nodes.len()];
    let deadline = args
        .exit_after
        .map(|s| tokio::time::Instant::now() + Duration::from_secs(s));
    loop {
        for ((id, _, cache), shown) in nodes.iter().zip(&mut shown) {
            for code in SHOWN {
                // The loader's version is the cache's, read before the
                // query: see `CdcRelay`'s docs on loads.
                let value = cache
                    .get_with_versioned(code.to_owned(), || async {
                        let version = cache.version().unwrap_or(0);
                        let name = sqlx::query_scalar::<_, Option<String>>(
                            "SELECT name FROM countries WHERE code = $1",
                        )
                        .bind(code)
                        .fetch_optional(&pool)
                        .await
                        .ok()
                        .flatten()
                        .flatten();
                        (name, version)
                    })
                    .await;
                if shown.get(code) != Some(&value) {
                    let lsn = cache.version().unwrap_or(0);
                    println!(
                        "{id}: {code} = {value:?} (cache version {:X}/{:X})",
                        lsn >> 32,
                        lsn & 0xFFFF_FFFF
                    );
                    shown.insert(code, value);
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = tokio::signal::ctrl_c() => break,
        }
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            break;
        }
    }
    let stats = relay.stats();
    println!(
        "relay: {} transactions, {} row changes, slot lag {} bytes",
        stats.transactions,
        stats.rows,
        stats.lag_bytes.unwrap_or(0)
    );
    relay.shutdown().await;
    // A slot keeps the server's WAL until a relay reads it: one left behind
    // by a relay that never comes back fills the disk. A production relay
    // keeps its slot across restarts (its standbys need it); this example
    // is done with it.
    sqlx::query("SELECT pg_drop_replication_slot($1)")
        .bind(&args.slot)
        .execute(&pool)
        .await?;
    sqlx::raw_sql(&format!(
        "DROP PUBLICATION \"{}\"",
        args.slot.replace('"', "\"\"")
    ))
    .execute(&pool)
    .await?;
    println!("dropped the slot and the publication");
    for (_, node, _) in nodes {
        node.shutdown().await?;
    }
    Ok(())
}
