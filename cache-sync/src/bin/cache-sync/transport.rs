//! Which transport to join, chosen with `--transport`, and the signing key.
//!
//! The tool is installed with only the features a user asks for, so the
//! choice is one `--transport NAME` checked against what was built, with
//! loopback defaults. The multi-process examples take the same flags, names
//! and defaults (`examples/shared/transport.rs`).

use std::sync::Arc;

use cache_sync::Keyring;
use cache_sync::transport::Transport;

/// A transport a node can share with this tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    RedisStreams,
    RedisPubSub,
    Nats,
    RocketMq,
}

/// Every transport's name, and whether this binary was built with it. The
/// names are the transports' own (`Transport::kind`, `NodeStatus::transport`),
/// so what a node reports is what the tool takes.
const ALL: [(&str, Kind, bool); 4] = [
    ("redis-streams", Kind::RedisStreams, cfg!(feature = "redis")),
    ("redis-pubsub", Kind::RedisPubSub, cfg!(feature = "redis")),
    ("nats-jetstream", Kind::Nats, cfg!(feature = "nats")),
    ("rocketmq", Kind::RocketMq, cfg!(feature = "rocketmq")),
];

/// The transports this binary was built with, for help and errors.
pub(crate) fn built() -> Vec<&'static str> {
    ALL.iter()
        .filter(|(_, _, on)| *on)
        .map(|(name, _, _)| *name)
        .collect()
}

fn built_list() -> String {
    let names = built();
    if names.is_empty() {
        "none (install with e.g. `cargo install --path cache-sync --features cli,redis` from a checkout)".into()
    } else {
        names.join(", ")
    }
}

/// The `--transport` help line, listing what this build has.
pub(crate) fn help() -> String {
    format!(
        "The nodes' transport; built into this binary: {}",
        built_list()
    )
}

pub(crate) fn parse(arg: &str) -> Result<Kind, String> {
    if arg == "embedded" {
        return Err(
            "the embedded transport lives inside one process: nodes on it \
                    cannot be reached from another one. Use the nodes' broker transport"
                .into(),
        );
    }
    match ALL.iter().find(|(name, _, _)| *name == arg) {
        Some((_, kind, true)) => Ok(*kind),
        Some((name, _, false)) => Err(format!(
            "{name} was not built into this binary (built: {}); reinstall with its feature",
            built_list()
        )),
        None => Err(format!("unknown transport (built: {})", built_list())),
    }
}

impl Kind {
    /// Where the broker listens when `--url` is not given: its usual
    /// port on this machine.
    pub(crate) fn default_url(self) -> &'static str {
        match self {
            Kind::RedisStreams | Kind::RedisPubSub => "redis://127.0.0.1:6379/",
            Kind::Nats => "nats://127.0.0.1:4222",
            Kind::RocketMq => "127.0.0.1:9876",
        }
    }

    pub(crate) async fn connect(self, url: &str) -> cache_sync::Result<Arc<dyn Transport>> {
        // Each arm exists only when its feature is built; `parse` never
        // hands out a kind that was not, so the fallback is unreachable in
        // practice but says what happened rather than panic.
        // With no transport built, every arm is gone and the match only
        // returns: its `Ok` is then unreachable, and that is fine.
        #[allow(unreachable_patterns, unreachable_code)]
        Ok(match self {
            #[cfg(feature = "redis")]
            Kind::RedisStreams => {
                Arc::new(cache_sync::transport::RedisStreamsTransport::connect(url).await?)
            }
            #[cfg(feature = "redis")]
            Kind::RedisPubSub => {
                Arc::new(cache_sync::transport::RedisPubSubTransport::connect(url).await?)
            }
            #[cfg(feature = "nats")]
            Kind::Nats => {
                Arc::new(cache_sync::transport::NatsJetStreamTransport::connect(url).await?)
            }
            #[cfg(feature = "rocketmq")]
            Kind::RocketMq => {
                Arc::new(cache_sync::transport::RocketMqTransport::connect(url).await?)
            }
            _ => {
                let _ = url;
                return Err(cache_sync::Error::Config(format!(
                    "transport {self:?} is not built into this binary"
                )));
            }
        })
    }
}

/// `--sign-key ID=PATH`: the key id, and the file that holds the secret.
#[derive(Debug, Clone)]
pub(crate) struct SignKey {
    pub(crate) id: String,
    pub(crate) path: std::path::PathBuf,
}

pub(crate) fn parse_sign_key(arg: &str) -> Result<SignKey, String> {
    match arg.split_once('=') {
        Some((id, path)) if !id.is_empty() && !path.is_empty() => Ok(SignKey {
            id: id.to_owned(),
            path: path.into(),
        }),
        _ => Err("expected ID=PATH, e.g. 2026-11=/run/secrets/cache-sync-key".into()),
    }
}

impl SignKey {
    /// Reads the secret. One trailing newline is dropped: `echo` and most
    /// editors end a file with one, and it is never meant as part of the
    /// secret; anything else is kept byte for byte.
    pub(crate) fn keyring(&self) -> Result<Keyring, String> {
        let mut secret = std::fs::read(&self.path)
            .map_err(|e| format!("cannot read the key file {}: {e}", self.path.display()))?;
        if secret.last() == Some(&b'\n') {
            secret.pop();
            if secret.last() == Some(&b'\r') {
                secret.pop();
            }
        }
        Keyring::new(self.id.clone(), secret).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_is_refused_with_a_reason() {
        let e = parse("embedded").unwrap_err();
        assert!(e.contains("inside one process"), "{e}");
    }

    #[test]
    fn unknown_names_list_what_was_built() {
        let e = parse("kafka").unwrap_err();
        assert!(e.contains("built:"), "{e}");
        for name in built() {
            assert!(e.contains(name), "{e}");
            assert!(parse(name).is_ok());
        }
    }

    #[test]
    fn sign_keys() {
        let k = parse_sign_key("k1=/tmp/x=y").unwrap();
        assert_eq!((k.id.as_str(), k.path.to_str()), ("k1", Some("/tmp/x=y")));
        assert!(parse_sign_key("k1").is_err());
        assert!(parse_sign_key("=/tmp/x").is_err());
    }

    #[test]
    fn a_trailing_newline_is_not_part_of_the_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, b"0123456789abcdef\n").unwrap();
        let key = SignKey {
            id: "k".into(),
            path: path.clone(),
        };
        assert!(key.keyring().is_ok());
        std::fs::write(&path, b"too short\n").unwrap();
        assert!(key.keyring().unwrap_err().contains("16 bytes"));
    }
}
