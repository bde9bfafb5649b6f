//! The command line.

use std::time::Duration;

use crate::duration;
use crate::transport::{self, Kind, SignKey};

/// Watches the nodes of a cache-sync cluster through their heartbeats, and
/// publishes changes to their caches. Joins the topic as a watcher, not as a
/// node: it holds no cache and consumes no change event.
#[derive(Debug, clap::Parser)]
#[command(name = "cache-sync", version)]
pub(crate) struct Args {
    #[arg(long, global = true, value_name = "NAME", value_parser = transport::parse,
          help = transport::help())]
    pub(crate) transport: Option<Kind>,
    /// The broker: a URL such as redis://127.0.0.1:6379/ or
    /// nats://127.0.0.1:4222, or a RocketMQ name server such as
    /// 127.0.0.1:9876. Default: the transport's usual port on 127.0.0.1
    #[arg(long, global = true, verbatim_doc_comment)]
    pub(crate) url: Option<String>,
    /// The nodes' topic
    #[arg(long, global = true, default_value = "cache-sync")]
    pub(crate) topic: String,
    /// Signs what this tool sends (requests for heartbeats, publishes)
    /// with the secret in PATH, under key id ID, and accepts only
    /// heartbeats signed with it. Use it when the nodes verify signatures.
    /// One trailing newline in the file is ignored
    #[arg(long, global = true, value_name = "ID=PATH", value_parser = transport::parse_sign_key,
          verbatim_doc_comment)]
    pub(crate) sign_key: Option<SignKey>,
    /// The nodes' heartbeat interval (500ms, 2s, 1m): a node silent for
    /// three of them is gone
    #[arg(long, global = true, value_name = "DURATION", default_value = "2s",
          value_parser = duration::parse, verbatim_doc_comment)]
    pub(crate) heartbeat_interval: Duration,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Prints the nodes and their caches once. Exits 0 when every node is
    /// within --max-lag of the newest version of each cache, 1 when some
    /// node has been behind for longer (listed on stderr), no node
    /// answered, or the view may miss a node (a node it heard counts more
    /// than it holds, still so four intervals after --wait), 2 on errors
    #[command(verbatim_doc_comment)]
    Status {
        /// How long a cache may trail the newest version before the
        /// cluster counts as diverged
        #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration::parse)]
        max_lag: Duration,
        /// Prints the cluster view as JSON instead of the table
        #[arg(long)]
        json: bool,
        /// How long to listen for heartbeats. Default: 1.5 heartbeat
        /// intervals (nodes answer this tool's roll call at once, but a
        /// node that missed it is heard within one interval)
        #[arg(long, value_name = "DURATION", value_parser = duration::parse, verbatim_doc_comment)]
        wait: Option<Duration>,
    },
    /// Redraws the table every interval until Ctrl-C
    Watch {
        /// Default: the heartbeat interval
        #[arg(long, value_name = "DURATION", value_parser = duration::parse)]
        every: Option<Duration>,
    },
    /// Publishes a change to every node's cache
    #[command(subcommand)]
    Publish(Publish),
    /// Asks every node that holds a cache what it holds for one key: a
    /// line per node (held or absent, the newest version it knows, whether
    /// the cache is quarantined), flagging the nodes that differ from the
    /// newest. Exits 0 when every node answered and all agree, 1 when they
    /// disagree, some node did not answer or some could not read the key,
    /// 2 on errors (a key that no node could read: see --key-type)
    #[command(verbatim_doc_comment)]
    // Positional, as a publish's are: the cache, then the key.
    Probe {
        /// The cache's name, e.g. countries
        cache: String,
        /// The key, of --key-type
        #[arg(allow_hyphen_values = true)]
        key: String,
        /// The cache's key type
        #[arg(long, value_name = "TYPE", default_value = "string")]
        key_type: KeyType,
        /// How long to wait for every node's answer
        #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = duration::parse)]
        timeout: Duration,
        /// Prints the answers as JSON (with each node's trace of the key,
        /// where its cache keeps one) instead of the lines
        #[arg(long)]
        json: bool,
    },
}

/// The key and value types of a publish.
const TYPES_HELP: &str = "\
Keys and values travel bincode-encoded, as the cache's own key and value
types encode them: --key-type and --value-type must match the cache's K and
V (a SyncedCache<String, u64> takes --key-type string --value-type u64).
A key of the wrong type encodes differently and misses the entry, or hits
another one (i64 -1 and u64 1 encode alike). A value of the wrong type is
refused by nodes it does not decode on, which drop the key instead of
caching it, or, where its bytes happen to decode, cached as a wrong value.";

#[derive(Debug, clap::Subcommand)]
pub(crate) enum Publish {
    /// Drops keys from a cache on every node
    #[command(after_help = TYPES_HELP)]
    Invalidate {
        /// The cache's name, e.g. countries
        cache: String,
        /// The keys to drop, of --key-type
        // Not `allow_hyphen_values`: on a list it would swallow the options
        // after it (`--ack 5s` as two more keys). Negative numbers pass;
        // another key starting with `-` goes after `--`.
        #[arg(required = true, allow_negative_numbers = true)]
        keys: Vec<String>,
        /// Each key's version: a node keeps a tombstone at it, so an
        /// insert older than it arriving later is ignored. Without it,
        /// applied in delivery order
        #[arg(long)]
        version: Option<u64>,
        #[command(flatten)]
        common: PublishArgs,
    },
    /// Installs one key's value on every node
    #[command(after_help = TYPES_HELP)]
    Insert {
        /// The cache's name, e.g. countries
        cache: String,
        /// The key, of --key-type
        #[arg(allow_hyphen_values = true)]
        key: String,
        /// Its new value, of --value-type
        #[arg(allow_hyphen_values = true)]
        value: String,
        /// The entry's version: a node ignores it if it already holds a
        /// newer one of the key. Without it, applied in delivery order
        #[arg(long)]
        version: Option<u64>,
        /// The cache's value type
        #[arg(long, value_name = "TYPE", default_value = "string")]
        value_type: ValueType,
        #[command(flatten)]
        common: PublishArgs,
    },
    /// Drops everything in a cache on every node
    InvalidateAll {
        /// The cache's name, e.g. countries
        cache: String,
        /// Makes VERSION a floor: inserts older than it arriving later
        /// are ignored
        #[arg(long)]
        version: Option<u64>,
        #[command(flatten)]
        common: PublishArgs,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct PublishArgs {
    /// The cache's key type
    #[arg(long, value_name = "TYPE", default_value = "string")]
    pub(crate) key_type: KeyType,
    /// Waits up to this long until every live node holding the cache
    /// reports it applied; prints "applied on N/N nodes in X ms" and
    /// exits 1 if some node did not
    #[arg(long, value_name = "TIMEOUT", value_parser = duration::parse, verbatim_doc_comment)]
    pub(crate) ack: Option<Duration>,
    /// A name for this publisher in the nodes' logs
    #[arg(long, default_value = "cache-sync-cli")]
    pub(crate) origin: String,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum KeyType {
    String,
    U64,
    I64,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ValueType {
    String,
    U64,
    I64,
    Bool,
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory as _, Parser as _};

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn globals_go_anywhere() {
        let a = Args::try_parse_from([
            "cache-sync",
            "status",
            "--heartbeat-interval",
            "100ms",
            "--max-lag",
            "1h",
        ])
        .unwrap();
        assert_eq!(a.heartbeat_interval, Duration::from_millis(100));
        assert!(
            matches!(a.command, Command::Status { max_lag, .. } if max_lag == Duration::from_secs(3600))
        );
    }

    #[test]
    fn options_after_the_keys_are_options() {
        let a = Args::try_parse_from([
            "cache-sync",
            "publish",
            "invalidate",
            "countries",
            "de",
            "-1",
            "--ack",
            "5s",
        ])
        .unwrap();
        let Command::Publish(Publish::Invalidate { keys, common, .. }) = a.command else {
            panic!("not an invalidation: {a:?}");
        };
        assert_eq!(keys, ["de", "-1"]);
        assert_eq!(common.ack, Some(Duration::from_secs(5)));
    }

    #[test]
    fn embedded_is_a_usage_error() {
        let e =
            Args::try_parse_from(["cache-sync", "--transport", "embedded", "status"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("inside one process"), "{e}");
    }
}
