//! Invalidation from MySQL's or MariaDB's binary log: a binlog relay and
//! two nodes, and any write to the `countries` table, from any client,
//! reaches them:
//!
//! ```text
//! cargo run -p cache-sync-examples --features mysql-cdc --example mysql_cdc
//! mariadb -h 127.0.0.1 -u root test -e "UPDATE countries SET name = 'Deutschland' WHERE code = 'de'"
//! ```
//!
//! The server needs `log_bin`, `binlog_format = ROW` and
//! `binlog_row_metadata = FULL` (the example says so, with the fix, when
//! it does not). The relay and the nodes run in one process on the
//! embedded transport; in production the relay runs beside the database
//! (one active, the others standing by) and publishes to a broker. Every
//! 500 ms each node reads a few codes through its cache and prints any
//! that changed, with the cache's version (the binlog position's).

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache,
    cdc::{BinlogRelay, CdcTable},
    transport::EmbeddedTransport,
};
use clap::Parser as _;
use mysql_async::prelude::Queryable as _;
use tracing_subscriber::EnvFilter;

#[path = "shared/tables.rs"]
mod tables;
use tables::COUNTRIES;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

const SHOWN: [&str; 4] = ["de", "es", "fr", "it"];

/// A binlog relay and two nodes caching the `countries` table: a write
/// from any client reaches both. Ctrl-C stops it.
#[derive(Debug, clap::Parser)]
#[command(name = "mysql_cdc", verbatim_doc_comment)]
struct Args {
    /// The database (its server needs a row binlog with full metadata)
    #[arg(
        long,
        value_name = "URL",
        default_value = "mysql://root@127.0.0.1:3306/test"
    )]
    database: String,
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
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mysql_cdc: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let pool = mysql_async::Pool::from_url(args.database.as_str())?;
    let mut conn = pool.get_conn().await?;
    let settings: Option<(Option<i64>, Option<String>, Option<String>)> = conn
        .query_first("SELECT @@log_bin, @@binlog_format, @@binlog_row_metadata")
        .await?;
    if settings != Some((Some(1), Some("ROW".into()), Some("FULL".into()))) {
        return Err(format!(
            "the server's binlog is {settings:?} (log_bin, binlog_format, binlog_row_metadata); \
             the relay needs log_bin on, binlog_format = ROW and binlog_row_metadata = FULL: \
             start the server with --log-bin --binlog-format=ROW --binlog-row-metadata=FULL \
             --server-id=1"
        )
        .into());
    }
    conn.query_drop(
        "CREATE TABLE IF NOT EXISTS countries (code VARCHAR(2) PRIMARY KEY, name VARCHAR(100) NOT NULL);
         INSERT IGNORE INTO countries VALUES ('de', 'Germany'), ('es', 'Spain'), ('fr', 'France'), ('it', 'Italy')",
    )
    .await?;

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
    // drops it; TRUNCATE and DDL on the table clear the cache.
    let relay = BinlogRelay::builder(args.database.as_str(), Publisher::new(transport.clone()))
        .name("cache_sync_example")
        .table(
            CdcTable::new(COUNTRIES, "countries", |row| {
                row.get("code").map(str::to_owned)
            })
            .value(|row| Some(row.get("name").map(str::to_owned))),
        )
        .start()
        .await?;
    println!("relay started; now write the table from anywhere");

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
                        let name = match pool.get_conn().await {
                            Ok(mut c) => c
                                .exec_first::<String, _, _>(
                                    "SELECT name FROM countries WHERE code = ?",
                                    (code,),
                                )
                                .await
                                .ok()
                                .flatten(),
                            Err(_) => None,
                        };
                        (name, version)
                    })
                    .await;
                if shown.get(code) != Some(&value) {
                    println!(
                        "{id}: {code} = {value:?} (cache version {})",
                        cache.version().unwrap_or(0)
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
        "relay: {} transactions, {} row changes, {} resyncs, {} failures",
        stats.transactions, stats.rows, stats.resyncs, stats.failures
    );
    relay.shutdown().await;
    for (_, node, _) in nodes {
        node.shutdown().await?;
    }
    drop(conn);
    pool.disconnect().await?;
    Ok(())
}
