//! The admin service of the multi-process demo: publishes one change to the
//! `countries` table to every running `node` example over Redis or NATS,
//! prints the version it was published at, and exits.
//!
//! ```text
//! cargo run -p cache-sync-examples --features brokers --example admin -- --redis redis://127.0.0.1:6379/ upsert de Deutschland
//! cargo run -p cache-sync-examples --features brokers --example admin -- --redis redis://127.0.0.1:6379/ delete fr
//! cargo run -p cache-sync-examples --features brokers --example admin -- --redis redis://127.0.0.1:6379/ replace-all de=Deutschland it=Italia
//! cargo run -p cache-sync-examples --features brokers --example admin -- --redis redis://127.0.0.1:6379/ demo
//! cargo run -p cache-sync-examples --features brokers --example admin -- --nats nats://127.0.0.1:4222 upsert de Deutschland
//! ```

// An example's output is its user interface: it talks to a person at a terminal.
#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{DictionaryPublisher, Publisher};
use tracing_subscriber::EnvFilter;

#[path = "shared/transport.rs"]
mod transport;
use transport::{Choice, TransportFlags};

type Result<T, E = Box<dyn Error>> = std::result::Result<T, E>;

/// The name the nodes register their cache under.
const CACHE: &str = "countries";
/// Between the steps of `demo`, so the nodes' status lines can be followed.
const DEMO_PAUSE: Duration = Duration::from_secs(1);

/// The nodes cache `Option<String>` (`None`: no such row), and the wire
/// format carries the value type, so the admin publishes the same type.
type Table = DictionaryPublisher<String, Option<String>>;

fn usage() -> String {
    format!(
        "\
usage: admin (--redis URL [--pubsub] | --nats URL) COMMAND

Publishes a change to the `countries` table to every running `node` example.

commands:
  upsert CODE NAME          a row was inserted or updated: every node holds it
  delete CODE               a row was deleted: every node drops it
  replace-all CODE=NAME...  the table was replaced: every node drops all rows,
                            then holds these
  demo                      a short scripted sequence (upserts, then a delete),
                            one change a second

{}
options:
  -h, --help      show this message
",
        transport::USAGE
    )
}

#[derive(Debug)]
enum Command {
    Upsert(String, String),
    Delete(String),
    ReplaceAll(BTreeMap<String, String>),
    Demo,
}

#[derive(Debug)]
struct Args {
    transport: Choice,
    command: Command,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(Some(args)) => args,
        Ok(None) => {
            print!("{}", usage());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("admin: {e}\n\n{}", usage());
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("admin failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `Ok(None)`: help was asked for.
fn parse_args(mut argv: impl Iterator<Item = String>) -> Result<Option<Args>, String> {
    let mut transport = TransportFlags::default();
    let mut words = Vec::new();
    let mut options_ended = false;
    while let Some(arg) = argv.next() {
        if options_ended || !arg.starts_with('-') {
            words.push(arg);
            continue;
        }
        // Both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_owned(), Some(value)),
            _ => (arg.clone(), None),
        };
        let value = || match inline {
            Some(v) => Ok(v.to_owned()),
            None => argv.next().ok_or_else(|| format!("{flag} needs a value")),
        };
        if transport.take(&flag, inline.is_some(), value)? {
            continue;
        }
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            // Lets a code or name start with `-`.
            "--" => options_ended = true,
            _ => return Err(format!("unknown option {arg:?}")),
        }
    }
    let mut words = words.into_iter();
    let command = match words.next().as_deref() {
        None => return Err("no command given".into()),
        Some("upsert") => match (words.next(), words.next()) {
            (Some(code), Some(name)) => Command::Upsert(code, name),
            _ => return Err("upsert needs a CODE and a NAME".into()),
        },
        Some("delete") => match words.next() {
            Some(code) => Command::Delete(code),
            None => return Err("delete needs a CODE".into()),
        },
        Some("replace-all") => {
            let mut rows = BTreeMap::new();
            for row in words.by_ref() {
                let Some((code, name)) = row.split_once('=') else {
                    return Err(format!("replace-all: {row:?} is not CODE=NAME"));
                };
                if rows.insert(code.to_owned(), name.to_owned()).is_some() {
                    return Err(format!("replace-all: {code:?} is given twice"));
                }
            }
            // An empty table is a legal replacement, but far more often a
            // forgotten argument than a wish to empty every node's cache.
            if rows.is_empty() {
                return Err("replace-all needs at least one CODE=NAME".into());
            }
            Command::ReplaceAll(rows)
        }
        Some("demo") => Command::Demo,
        Some(other) => return Err(format!("unknown command {other:?}")),
    };
    if let Some(extra) = words.next() {
        return Err(format!("unexpected argument {extra:?}"));
    }
    if let Command::Upsert(code, _) | Command::Delete(code) = &command {
        check_code(code)?;
    }
    if let Command::ReplaceAll(rows) = &command {
        rows.keys().try_for_each(|code| check_code(code))?;
    }
    Ok(Some(Args {
        transport: transport.finish()?,
        command,
    }))
}

fn check_code(code: &str) -> Result<(), String> {
    if code.is_empty() {
        return Err("a CODE must not be empty".into());
    }
    Ok(())
}

async fn run(args: Args) -> Result<()> {
    let transport = args.transport.connect().await?;
    // The origin names this service in the nodes' logs.
    let table: Table = Publisher::builder(transport)
        .origin("admin")
        .build()?
        .dictionary(CACHE);

    match args.command {
        Command::Demo => {
            let version = demo(&table).await?;
            println!(
                "done: the last change is version {version}; every running node reports it \
                 for {CACHE:?} once it has applied it"
            );
        }
        change => {
            publish(&table, &change).await?;
        }
    }
    Ok(())
}

/// Publishes one change and returns its version.
///
/// A real admin service writes its database first and publishes after: the
/// other way round, a node reading between the event and the write would
/// cache the old row, and no later event would correct it. This example has
/// no database; the nodes' loader answers from a fixed seed.
async fn publish(table: &Table, change: &Command) -> Result<u64> {
    let (label, version) = match change {
        Command::Upsert(code, name) => (
            format!("upsert {code}={name}"),
            table.upsert(code, &Some(name.clone())).await?,
        ),
        Command::Delete(code) => (format!("delete {code}"), table.delete(code).await?),
        Command::ReplaceAll(rows) => {
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
    Ok(version)
}

/// A few upserts and a delete, a second apart. `cz` is in no node's seed,
/// so the nodes hold it as a missing row until its upsert replaces that.
async fn demo(table: &Table) -> Result<u64> {
    let steps = [
        Command::Upsert("de".into(), "Deutschland".into()),
        Command::Upsert("it".into(), "Italia".into()),
        Command::Upsert("cz".into(), "Czechia".into()),
        Command::Delete("fr".into()),
    ];
    let mut version = 0;
    for (i, step) in steps.iter().enumerate() {
        if i > 0 {
            tokio::time::sleep(DEMO_PAUSE).await;
        }
        version = publish(table, step).await?;
    }
    Ok(version)
}
