//! The admin service of the multi-process demo: publishes one change to the
//! `countries` table to every running `node` example over Redis, NATS or
//! RocketMQ, prints the version it was published at and how many nodes
//! applied it how soon (each running node answers once it has), and exits.
//!
//! ```text
//! cargo run -p cache-sync-examples --features redis --example admin -- --transport redis-streams insert de Deutschland
//! cargo run -p cache-sync-examples --features redis --example admin -- --transport redis-streams invalidate fr
//! cargo run -p cache-sync-examples --features redis --example admin -- --transport redis-streams replace-all de=Deutschland it=Italia
//! cargo run -p cache-sync-examples --features redis --example admin -- --transport redis-streams demo
//! cargo run -p cache-sync-examples --features nats --example admin -- --transport nats-jetstream insert de Deutschland
//! ```
//!
//! Give it the nodes' `--transport` (and `--url`, when the server is not on
//! its usual port on 127.0.0.1).

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, BTreeSet};
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{DictionaryPublisher, Publisher, cluster::Cluster};
use clap::error::ErrorKind;
use clap::{CommandFactory as _, Parser as _};
use tracing_subscriber::EnvFilter;

#[path = "shared/tables.rs"]
mod tables;
#[path = "shared/transport.rs"]
mod transport;
use tables::COUNTRIES;
use transport::TransportArgs;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// Between the steps of `demo`, so the nodes' status lines can be followed.
const DEMO_PAUSE: Duration = Duration::from_secs(1);
/// How long to wait for every node to report a change applied.
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

/// The nodes' table: the types come from the shared `COUNTRIES`.
type Table = DictionaryPublisher<String, Option<String>>;

/// Publishes a change to the `countries` table to every running `node`
/// example, prints the version it was published at, and exits.
#[derive(Debug, clap::Parser)]
#[command(
    name = "admin",
    verbatim_doc_comment,
    after_help = "A CODE or NAME may start with `-`; one that is `-h` or `--help` goes after\n\
                  `--`, e.g. admin --transport redis-streams invalidate -- -h"
)]
struct Args {
    #[command(flatten)]
    transport: TransportArgs,
    #[command(subcommand)]
    command: Command,
}

/// The subcommands are the dictionary's writes (`insert`, `invalidate`,
/// `replace_all`), one vocabulary with the library's; each says what
/// happened to a row of the admin's table.
#[derive(Debug, clap::Subcommand)]
enum Command {
    /// A row was inserted or updated: every node holds it
    Insert {
        /// The row's key, e.g. de
        #[arg(value_parser = code, allow_hyphen_values = true)]
        code: String,
        /// The row's value, e.g. Germany
        #[arg(allow_hyphen_values = true)]
        name: String,
    },
    /// A row was deleted: every node drops it
    Invalidate {
        /// The row's key, e.g. fr
        #[arg(value_parser = code, allow_hyphen_values = true)]
        code: String,
    },
    /// The table was replaced: every node drops all rows, then holds these
    ReplaceAll {
        /// The new table's rows, e.g. de=Germany it=Italy
        // An empty table is a legal replacement, but far more often a
        // forgotten argument than a wish to empty every node's cache.
        #[arg(
            value_name = "CODE=NAME",
            required = true,
            value_parser = row,
            allow_hyphen_values = true
        )]
        rows: Vec<(String, String)>,
    },
    /// A short scripted sequence (inserts, then an invalidation), one change a second
    Demo,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Command::ReplaceAll { rows } = &args.command {
        let mut seen = BTreeSet::new();
        if let Some((code, _)) = rows.iter().find(|(code, _)| !seen.insert(code)) {
            Args::command()
                .error(
                    ErrorKind::ValueValidation,
                    format!("replace-all: {code:?} is given twice"),
                )
                .exit();
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("admin failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The `value_parser` of every CODE.
fn code(code: &str) -> Result<String, String> {
    if code.is_empty() {
        return Err("a CODE must not be empty".into());
    }
    Ok(code.to_owned())
}

/// The `value_parser` of replace-all's CODE=NAME.
fn row(row: &str) -> Result<(String, String), String> {
    let (c, name) = row.split_once('=').ok_or("not CODE=NAME")?;
    Ok((code(c)?, name.to_owned()))
}

async fn run(args: Args) -> Result<()> {
    let transport = args.transport.connect().await?;
    // Watches the nodes' heartbeats, to know who holds the table, and asks
    // them to answer once they applied each change (on a transport without
    // a heartbeat channel, it cannot tell).
    let cluster = match Cluster::builder(transport.clone())
        .observer("admin")
        .start()
        .await
    {
        Ok(cluster) => Some(cluster),
        Err(e) if e.is_unsupported() => None,
        Err(e) => return Err(e.into()),
    };
    // The origin names this service in the nodes' logs.
    let table: Table = Publisher::builder(transport)
        .origin("admin")
        .build()?
        .dictionary(COUNTRIES);
    let admin = Admin {
        table: &table,
        cluster: cluster.as_ref(),
    };

    match args.command {
        Command::Demo => {
            let version = demo(&admin).await?;
            println!(
                "done: the last change is version {version}; every running node reports it \
                 for {:?} once it has applied it",
                COUNTRIES.name()
            );
        }
        change => {
            publish(&admin, &change).await?;
        }
    }
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    Ok(())
}

/// What a change goes out through, and who answers it applied.
struct Admin<'a> {
    table: &'a Table,
    cluster: Option<&'a Cluster>,
}

/// Publishes one change and returns its version.
///
/// A real admin service writes its database first and publishes after: the
/// other way round, a node reading between the event and the write would
/// cache the old row, and no later event would correct it. This example has
/// no database; the nodes' loader answers from a fixed seed.
async fn publish(admin: &Admin<'_>, change: &Command) -> Result<u64> {
    let table = admin.table;
    let (label, version) = match change {
        Command::Insert { code, name } => (
            format!("insert {code}={name}"),
            table.insert(code, &Some(name.clone())).await?,
        ),
        Command::Invalidate { code } => {
            (format!("invalidate {code}"), table.invalidate(code).await?)
        }
        Command::ReplaceAll { rows } => {
            let rows: BTreeMap<String, Option<String>> = rows
                .iter()
                .map(|(code, name)| (code.clone(), Some(name.clone())))
                .collect();
            (
                format!("replace-all with {} rows", rows.len()),
                table.replace_all(&rows).await?,
            )
        }
        Command::Demo => return Err("demo is a sequence of changes, not one".into()),
    };
    println!("admin: {label}  published as version {version}");
    // The table's versions rise with each change and reach every node in
    // order, so a node at this version or later has applied this change.
    // (A replace-all sends a clear and then the rows, at one version: a node
    // reports that version once it has the clear, possibly a moment before
    // it has the rows.)
    let Some(cluster) = admin.cluster else {
        return Ok(version);
    };
    let acks = cluster
        .applied_version(COUNTRIES.name(), version, ACK_TIMEOUT)
        .await;
    if acks.nodes.is_empty() {
        println!("admin: no running node holds {:?}", COUNTRIES.name());
        return Ok(version);
    }
    // The whole wait includes the watcher's first 500 ms, in which it lets
    // every node answer its roll call; each node's answer is its own time.
    println!("admin: {acks}");
    for node in &acks.nodes {
        match node.latency {
            Some(after) => println!("admin:   {} answered after {after:.1?}", node.node_id),
            None => println!(
                "admin:   not applied within {ACK_TIMEOUT:?} on {}",
                node.node_id
            ),
        }
    }
    Ok(version)
}

/// A few inserts and an invalidation, a second apart. `cz` is in no node's
/// seed, so the nodes hold it as a missing row until its insert replaces
/// that.
async fn demo(admin: &Admin<'_>) -> Result<u64> {
    let insert = |code: &str, name: &str| Command::Insert {
        code: code.into(),
        name: name.into(),
    };
    let steps = [
        insert("de", "Deutschland"),
        insert("it", "Italia"),
        insert("cz", "Czechia"),
        Command::Invalidate { code: "fr".into() },
    ];
    let mut version = 0;
    for (i, step) in steps.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(DEMO_PAUSE).await;
        }
        version = publish(admin, step).await?;
    }
    Ok(version)
}
