//! The admin service, through a transactional outbox: it writes the
//! `countries` table in PostgreSQL and, in the same transaction, the change
//! event into the outbox; a relay publishes committed events to every
//! `postgres_node` over Redis, NATS or RocketMQ. The admin's commands need no
//! broker: a change whose transaction commits is published even when the
//! broker is down at that moment, or the admin crashes right after.
//!
//! ```text
//! # once, and then in its own terminal: the relay (a sidecar, or in the admin service)
//! cargo run -p cache-sync-examples --features redis,postgres --example postgres_admin -- relay --transport redis-streams
//! # each change: one transaction, row and event together
//! cargo run -p cache-sync-examples --features redis,postgres --example postgres_admin -- insert de Deutschland
//! cargo run -p cache-sync-examples --features redis,postgres --example postgres_admin -- invalidate fr
//! ```
//!
//! The database is `--database URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`). Every command creates the
//! `countries` table (seeded) and the outbox's schema where missing.

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::error::Error;
use std::process::ExitCode;

use cache_sync::{
    Publisher,
    outbox::{Outbox, OutboxRelay},
};
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

/// Writes the `countries` table in PostgreSQL with its change event in the
/// same transaction, or runs the relay that publishes those events.
#[derive(Debug, clap::Parser)]
#[command(name = "postgres_admin", verbatim_doc_comment)]
struct Args {
    /// The database holding `countries` and the outbox
    #[arg(long, value_name = "URL", default_value = countries_db::DEFAULT_URL)]
    database: String,
    #[command(subcommand)]
    command: Command,
}

/// As in the `admin` example, the subcommands are the outbox dictionary's
/// writes, `insert` and `invalidate`; each writes the row too.
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// A row is inserted or updated: one transaction writes it and its event
    Insert { code: String, name: String },
    /// A row is deleted: one transaction marks it deleted and writes its event
    Invalidate { code: String },
    /// Publishes committed events until Ctrl-C (run one or more; one
    /// publishes at a time, the others stand by)
    Relay {
        #[command(flatten)]
        transport: TransportArgs,
    },
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
            eprintln!("postgres_admin failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let pool = PgPool::connect(&args.database).await?;
    let outbox = Outbox::new();
    outbox.migrate(&pool).await?;
    countries_db::create(&pool).await?;
    let table = outbox.dictionary(COUNTRIES);
    match args.command {
        Command::Insert { code, name } => {
            let mut tx = pool.begin().await?;
            // The event first: it takes the table's enqueue lock and the
            // version, so the row and its event carry the same version and
            // writers of this table commit in version order.
            let version = table.insert(&mut tx, &code, &Some(name.clone())).await?;
            countries_db::write(&mut tx, &code, Some(&name), version).await?;
            tx.commit().await?;
            println!(
                "postgres_admin: insert {code}={name}  committed with its event at version {version}"
            );
        }
        Command::Invalidate { code } => {
            let mut tx = pool.begin().await?;
            let version = table.invalidate(&mut tx, &code).await?;
            // A deleted row stays, without a name, at its version: a node
            // that loads it afterwards gets the version the tombstone has.
            countries_db::write(&mut tx, &code, None, version).await?;
            tx.commit().await?;
            println!(
                "postgres_admin: invalidate {code}  committed with its event at version {version}"
            );
        }
        Command::Relay { transport } => {
            let transport = transport.connect().await?;
            let publisher = Publisher::builder(transport)
                .origin("postgres-relay")
                .build()?;
            let relay = OutboxRelay::builder(pool, publisher)
                .outbox(outbox)
                .start()
                .await?;
            println!("postgres_admin: relaying committed events; Ctrl-C stops");
            tokio::signal::ctrl_c().await?;
            relay.shutdown().await;
            let stats = relay.stats();
            println!(
                "postgres_admin: published {} events, {} publish failures (retried)",
                stats.published, stats.publish_failures
            );
        }
    }
    Ok(())
}
