//! An application node that loads the `countries` table from PostgreSQL,
//! with each row's version, and keeps its cache in step with the changes
//! `postgres_admin` commits through the outbox. Run two or more:
//!
//! ```text
//! cargo run -p cache-sync-examples --features redis,postgres --example postgres_node -- --transport redis-streams --node-id node-a
//! ```
//!
//! Every 2 s it reads a few codes through the cache and prints them with the
//! cache's version. A read that misses loads the row and its version
//! (`try_get_with_versioned`), so a late, older refresh cannot replace a
//! newer row the node loaded, and a row loaded from a replica older than a
//! delete the node has seen is returned but not cached.

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{Node, SyncedCache};
use clap::Parser as _;
use sqlx::PgPool;
use tracing_subscriber::EnvFilter;

#[path = "shared/countries_db.rs"]
mod countries_db;
#[path = "shared/tables.rs"]
mod tables;
#[path = "shared/transport.rs"]
mod transport;
use tables::COUNTRIES;
use transport::TransportArgs;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

const SHOWN: [&str; 5] = ["de", "fr", "it", "cz", "xx"];
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// Caches the `countries` table, loading from PostgreSQL, and keeps it in
/// step with what `postgres_admin` commits. Ctrl-C stops it.
#[derive(Debug, clap::Parser)]
#[command(name = "postgres_node", verbatim_doc_comment)]
struct Args {
    #[command(flatten)]
    transport: TransportArgs,
    /// The database `postgres_admin` writes
    #[arg(long, value_name = "URL", default_value = countries_db::DEFAULT_URL)]
    database: String,
    /// The node's name in status and logs
    #[arg(long, value_name = "ID", default_value = "postgres-node")]
    node_id: String,
    /// Where to serve the status endpoint (loopback, a free port by default)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    http: std::net::SocketAddr,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("postgres_node failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let pool = PgPool::connect(&args.database).await?;
    countries_db::create(&pool).await?;
    let transport = args.transport.connect().await?;
    let countries: SyncedCache<String, Option<String>> =
        SyncedCache::new(COUNTRIES, moka::future::Cache::new(10_000));
    let node = Node::builder(args.node_id.as_str(), transport)
        .register(&countries)
        .start()
        .await?;
    let status = node.serve_status(args.http).await?;
    println!(
        "{}: caching {:?} from PostgreSQL over {}; status on http://{}/cache-sync/status",
        node.id(),
        COUNTRIES.name(),
        node.status().transport,
        status.local_addr()
    );

    let mut every = tokio::time::interval(REPORT_EVERY);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            signal = &mut ctrl_c => {
                signal?;
                break;
            }
            _ = every.tick() => {
                let mut shown = Vec::new();
                for code in SHOWN {
                    let row = countries
                        .try_get_with_versioned(code.to_owned(), || {
                            // A handle on the shared pool, for the future.
                            let pool = pool.clone();
                            async move { countries_db::read(&pool, code).await }
                        })
                        .await;
                    shown.push(match row {
                        Ok(Some(name)) => format!("{code}={name}"),
                        Ok(None) => format!("{code}=(no row)"),
                        Err(e) => format!("{code}=(load failed: {e})"),
                    });
                }
                let version = node.status().caches[0]
                    .version
                    .map_or_else(|| "none".to_owned(), |v| v.to_string());
                println!("{}: version {version}  {}", node.id(), shown.join(" "));
            }
        }
    }
    status.shutdown().await?;
    node.shutdown().await?;
    Ok(())
}
