//! `cache-sync`: watches a cache-sync cluster's nodes through their
//! heartbeats, and publishes changes to their caches, from a shell.
//!
//! ```text
//! cache-sync --transport redis-streams status --max-lag 5s
//! cache-sync --transport nats-jetstream --url nats://10.0.0.5:4222 watch
//! cache-sync --transport redis-streams publish insert countries de Deutschland --version 7 --ack 5s
//! cache-sync --transport redis-streams probe countries de
//! ```
//!
//! Exit codes: 0 all good, 1 a node diverged, no node answered, a publish
//! was not applied everywhere in time, or a probe found nodes that
//! disagree, did not answer or could not read the key, 2 an error (bad
//! arguments, no broker, a probe's key that no node could read).

// A command-line tool's output is its interface: it prints to stdout.
#![allow(clippy::print_stdout)]

mod args;
mod duration;
mod publish;
mod table;
mod transport;

use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use cache_sync::transport::Transport;
use cache_sync::{Keyring, cluster::Cluster};
use clap::Parser as _;

use args::{Args, Command, KeyType};

/// Errors exit with 2, as clap's usage errors do; 1 means "unhealthy".
const ERROR: u8 = 2;

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::from(ERROR);
        }
    };
    match runtime.block_on(run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(ERROR)
        }
    }
}

/// What every command needs: where the nodes are, and the key.
pub(crate) struct Context {
    kind: transport::Kind,
    url: String,
    pub(crate) topic: String,
    pub(crate) keyring: Option<Keyring>,
    interval: Duration,
}

impl Context {
    fn new(args: &Args) -> Result<Self, String> {
        let kind = args.transport.ok_or_else(|| {
            let built = transport::built();
            format!(
                "--transport is required: one of {}",
                if built.is_empty() {
                    "none built into this binary".into()
                } else {
                    built.join(", ")
                }
            )
        })?;
        let keyring = args.sign_key.as_ref().map(|k| k.keyring()).transpose()?;
        Ok(Context {
            kind,
            url: args
                .url
                .clone()
                .unwrap_or_else(|| kind.default_url().to_owned()),
            topic: args.topic.clone(),
            keyring,
            interval: args.heartbeat_interval,
        })
    }

    pub(crate) async fn connect(&self) -> Result<Arc<dyn Transport>, String> {
        self.kind
            .connect(&self.url)
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.url))
    }

    /// A watcher: reads heartbeats, sends a roll call, is no node.
    pub(crate) async fn watcher(&self, transport: Arc<dyn Transport>) -> Result<Cluster, String> {
        let mut builder = Cluster::builder(transport)
            .topic(self.topic.clone())
            .observer("cache-sync-cli")
            .heartbeat_interval(self.interval);
        if let Some(ring) = &self.keyring {
            builder = builder.verify_signatures(ring.clone());
        }
        builder
            .start()
            .await
            .map_err(|e| format!("cannot watch the heartbeats on {}: {e}", self.url))
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let ctx = Context::new(&args)?;
    match args.command {
        Command::Status {
            max_lag,
            json,
            wait,
        } => {
            // 1.5 intervals: as long as a view needs to have heard every node.
            let wait = wait.unwrap_or(ctx.interval.saturating_add(ctx.interval / 2));
            let cluster = ctx.watcher(ctx.connect().await?).await?;
            tokio::time::sleep(wait).await;
            // The view may still miss a node a node it heard counts (one
            // slow to answer on a loaded machine): it waits on for that, up
            // to four intervals, as long as a node that stopped is still
            // counted by the others.
            let now = tokio::time::Instant::now();
            let until = now
                .checked_add(ctx.interval.saturating_mul(4))
                .unwrap_or(now);
            let unsettled = loop {
                match cluster.unsettled() {
                    Some(_) if tokio::time::Instant::now() < until => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    unsettled => break unsettled,
                }
            };
            let view = cluster.view();
            cluster.shutdown().await;
            if json {
                let text = serde_json::to_string_pretty(&view).map_err(|e| e.to_string())?;
                println!("{text}");
            } else {
                print!("{}", table::render(&view));
            }
            let verdict = table::verdict(&view, max_lag);
            match &verdict {
                table::Verdict::Level => {}
                table::Verdict::Empty => {
                    eprintln!("no node answered on topic {}", ctx.topic);
                }
                table::Verdict::Diverged(lines) => {
                    eprintln!("diverged for longer than {}:", duration::show(max_lag));
                    for l in lines {
                        eprintln!("  {l}");
                    }
                }
            }
            // A level table of a view that may miss a node proves nothing.
            if let Some(why) = unsettled {
                eprintln!("not every node may have been heard: {why}");
                return Ok(ExitCode::from(verdict.exit_code().max(1)));
            }
            Ok(ExitCode::from(verdict.exit_code()))
        }
        Command::Watch { every } => {
            let every = every.unwrap_or(ctx.interval);
            let cluster = ctx.watcher(ctx.connect().await?).await?;
            // Clearing the screen is for a person at a terminal; a pipe or
            // a log file gets every frame, separated.
            let terminal = std::io::stdout().is_terminal();
            let mut first = true;
            // One listener for the whole loop: a Ctrl-C pressed while a
            // frame is drawn is not lost between two `select!`s.
            let ctrl_c = tokio::signal::ctrl_c();
            tokio::pin!(ctrl_c);
            loop {
                tokio::select! {
                    _ = &mut ctrl_c => break,
                    () = tokio::time::sleep(every) => {}
                }
                let frame = table::render(&cluster.view());
                if terminal {
                    print!("\x1b[2J\x1b[H{frame}");
                } else {
                    if !first {
                        println!("----");
                    }
                    print!("{frame}");
                }
                first = false;
            }
            cluster.shutdown().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Publish(p) => publish::run(&ctx, p).await,
        Command::Probe {
            cache,
            key,
            key_type,
            timeout,
            json,
        } => {
            let cluster = ctx.watcher(ctx.connect().await?).await?;
            let bad = |e: std::num::ParseIntError| format!("--key {key}: {e}");
            // As the cache's key type serializes, so each node reads it.
            let probe = match key_type {
                KeyType::String => cluster.probe(&cache, &key, timeout).await,
                KeyType::U64 => {
                    let k = key.parse::<u64>().map_err(bad)?;
                    cluster.probe(&cache, &k, timeout).await
                }
                KeyType::I64 => {
                    let k = key.parse::<i64>().map_err(bad)?;
                    cluster.probe(&cache, &k, timeout).await
                }
            };
            cluster.shutdown().await;
            let probe = probe.map_err(|e| e.to_string())?;
            if json {
                let text = serde_json::to_string_pretty(&probe).map_err(|e| e.to_string())?;
                println!("{text}");
            } else {
                println!("{probe}");
            }
            let answered = probe.nodes.iter().filter(|n| n.state.is_some()).count();
            let refused = probe.refused().count();
            Ok(if refused > 0 && refused == answered {
                // No node could read the key: the command's error, most
                // likely a --key-type other than the cache's, not the
                // cluster's (issue 35, item 9: this passed as agreement).
                eprintln!(
                    "error: no node could read the key as its cache's key type: is --key-type the cache's?"
                );
                ExitCode::from(ERROR)
            } else if probe.is_complete() && probe.agrees() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
    }
}
