//! One application node of the multi-process demo: it caches the `countries`
//! table and keeps it in step with the changes the `admin` example publishes
//! over Redis, NATS or RocketMQ. Run two or more, each in its own terminal:
//!
//! ```text
//! cargo run -p cache-sync-examples --features redis --example node -- --transport redis-streams --http 127.0.0.1:9465 --node-id node-a
//! cargo run -p cache-sync-examples --features redis --example node -- --transport redis-streams --http 127.0.0.1:9466 --node-id node-b
//! cargo run -p cache-sync-examples --features redis --example admin -- --transport redis-streams insert de Deutschland
//! curl -s http://127.0.0.1:9465/cache-sync/caches/countries
//! ```
//!
//! `--transport` takes the command-line tool's names: `redis-streams` or
//! `redis-pubsub` (feature `redis`), `nats-jetstream` (feature `nats`),
//! `rocketmq` (feature `rocketmq`). `--url URL` names the server when it is
//! not on its usual port on 127.0.0.1.
//!
//! Every 2 s the node prints its cache's version, its entry count and what it
//! holds for a few codes. Ctrl-C stops it cleanly: it saves its position and
//! exits with status 0.

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::error::Error;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{Node, SyncedCache, transport::FileOffsetStore};
use clap::Parser as _;
use tracing_subscriber::EnvFilter;

#[path = "shared/tables.rs"]
mod tables;
#[path = "shared/transport.rs"]
mod transport;
use tables::COUNTRIES;
use transport::TransportArgs;

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// Read through the loader at start-up and shown on every status line. `cz`
/// and `xx` are not in the seed, so they start out cached as missing rows;
/// `cz` is one the admin's `demo` creates.
const SHOWN: [&str; 5] = ["de", "fr", "it", "cz", "xx"];
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// The rows the loader answers from, standing in for the admin's database.
const SEED: [(&str, &str); 8] = [
    ("de", "Germany"),
    ("es", "Spain"),
    ("fr", "France"),
    ("it", "Italy"),
    ("jp", "Japan"),
    ("nl", "Netherlands"),
    ("pl", "Poland"),
    ("se", "Sweden"),
];

/// Runs one application node: it caches the `countries` table and keeps it in
/// step with what the `admin` example publishes. Prints a status line every
/// 2 s; Ctrl-C stops it cleanly.
#[derive(Debug, clap::Parser)]
#[command(
    name = "node",
    verbatim_doc_comment,
    after_help = "RUST_LOG=cache_sync=debug shows the library's logs (on stderr); the default\n\
                  shows warnings only."
)]
struct Args {
    #[command(flatten)]
    transport: TransportArgs,
    /// Where to serve the status endpoint. Default 127.0.0.1:0:
    /// loopback only, on a free port (the address is printed). An
    /// address such as 0.0.0.0:9465 makes it reachable from other hosts
    // Loopback unless asked otherwise: the status endpoint has no
    // authentication.
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "127.0.0.1:0",
        hide_default_value = true,
        value_parser = socket_addr,
        verbatim_doc_comment
    )]
    http: SocketAddr,
    /// The node's name in status and logs (default HOSTNAME-PID)
    #[arg(
        long,
        value_name = "ID",
        default_value_t = default_node_id(),
        hide_default_value = true,
        value_parser = clap::builder::NonEmptyStringValueParser::new()
    )]
    node_id: String,
    /// Keep the node's position in DIR/offsets.json, so a restarted
    /// node resumes where it stopped (not on redis-pubsub; default: in
    /// memory, so a restarted node starts from the newest event)
    #[arg(long, value_name = "DIR", verbatim_doc_comment)]
    data_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    // The library logs losses and rejected events at `warn`; show them.
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("node failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn socket_addr(arg: &str) -> Result<SocketAddr, String> {
    arg.parse()
        .map_err(|_| "not an address such as 127.0.0.1:9465".into())
}

/// `HOSTNAME-PID`: unique per process on a host, and readable in the status.
fn default_node_id() -> String {
    // No dependency just for this: the environment, else Linux's procfs.
    let host = ["HOSTNAME", "COMPUTERNAME"]
        .into_iter()
        .filter_map(|var| std::env::var(var).ok())
        .chain(std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .chain(std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .find(|h| !h.is_empty())
        .unwrap_or_else(|| "node".to_owned());
    format!("{host}-{}", std::process::id())
}

async fn run(args: Args) -> Result<()> {
    let transport = args.transport.connect().await?;
    // Pub/Sub keeps no history, so there is no position worth saving.
    let pubsub = args.transport.is_pubsub();
    let offsets = match &args.data_dir {
        Some(_) if pubsub => {
            eprintln!("node: --data-dir has no effect on redis-pubsub");
            None
        }
        dir => dir.as_ref().map(FileOffsetStore::new),
    };

    // `None` caches a missing row, so repeated reads of a code that does not
    // exist stay off the database too.
    let countries: SyncedCache<String, Option<String>> =
        SyncedCache::new(COUNTRIES, moka::future::Cache::new(10_000));
    let mut builder = Node::builder(args.node_id.as_str(), transport)
        // Registration empties the cache, so it comes before the first read.
        .register(&countries);
    if let Some(store) = &offsets {
        builder = builder.offset_store(store.clone());
    }
    if pubsub {
        // Pub/Sub has no history to replay at start, so by default a node
        // drops (rather than installs) versioned refreshes for its first 10 s,
        // in case two writers published out of version order. The admin
        // example is the table's only writer and its versions reach Redis in
        // order, so the window is not needed here.
        builder = builder.reorder_window(Duration::ZERO);
    }
    let node = builder.start().await?;
    let status = node.serve_status(args.http).await?;

    let addr = status.local_addr();
    println!(
        "{}: caching {:?} over {} (topic {:?})",
        node.id(),
        COUNTRIES.name(),
        node.status().transport,
        node.topic()
    );
    println!("  status endpoint on {addr}:");
    println!(
        "    curl -s http://{addr}/cache-sync/caches/{}",
        COUNTRIES.name()
    );
    println!("    curl -s http://{addr}/cache-sync/status");
    match (&offsets, pubsub) {
        (Some(store), _) => println!("  position kept in {}", store.path().display()),
        (None, true) => println!("  no position: Pub/Sub keeps no history to resume from"),
        (None, false) => {
            println!("  position kept in memory (--data-dir DIR resumes after a restart)");
        }
    }

    for code in SHOWN {
        countries.get_with(code.to_owned(), || load(code)).await;
    }
    println!(
        "  every {} s: cache version, entries, and {} as cached \
         (`-`: not cached, `(no row)`: cached as missing). Ctrl-C stops.",
        REPORT_EVERY.as_secs(),
        SHOWN.join(" ")
    );

    let mut every = tokio::time::interval(REPORT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            signal = &mut ctrl_c => {
                signal?;
                break;
            }
            _ = every.tick() => report(&node, &countries).await,
        }
    }

    println!("{}: Ctrl-C, shutting down", node.id());
    status.shutdown().await?;
    // Applies what was already fetched and saves the position.
    node.shutdown().await?;
    let position = node.status().position;
    match &offsets {
        Some(store) if !position.is_empty() => println!(
            "{}: stopped; position {position} saved in {}",
            node.id(),
            store.path().display()
        ),
        _ => println!("{}: stopped", node.id()),
    }
    Ok(())
}

/// The read-through loader. This process cannot see the admin's database,
/// so it answers from the seed rows; in production the loader queries the
/// database the admin writes to. That is also why the node reads through it
/// only at start-up: after the admin deletes `fr`, a read here would load
/// the seed's `France` again, where a shared database would answer with no row.
async fn load(code: &str) -> Option<String> {
    SEED.iter()
        .find(|(c, _)| *c == code)
        .map(|(_, name)| (*name).to_owned())
}

/// One status line. `peek` rather than `get`, so watching the cache does not
/// count as hits and misses in the status endpoint.
async fn report(node: &Node, countries: &SyncedCache<String, Option<String>>) {
    let status = node.status_settled().await;
    let cache = status.caches.iter().find(|c| c.name == COUNTRIES.name());
    let version = cache
        .and_then(|c| c.version)
        .map_or_else(|| "none".to_owned(), |v| v.to_string());
    let entries = cache.map_or(0, |c| c.entries);
    let mut held = Vec::new();
    for code in SHOWN {
        let shown = match countries.peek(&code.to_owned()).await {
            None => "-".to_owned(),
            Some(None) => "(no row)".to_owned(),
            Some(Some(name)) => name,
        };
        held.push(format!("{code}={shown}"));
    }
    // The consumer re-subscribes by itself; until then the caches may fall behind.
    let down = if status.consuming {
        ""
    } else {
        "  [not consuming: server unreachable? see the log]"
    };
    println!(
        "{}  version {version}  entries {entries}  {}{down}",
        status.node_id,
        held.join(" ")
    );
}
