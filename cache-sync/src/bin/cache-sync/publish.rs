//! `publish`: one change, typed as the cache's keys and values are.

use std::process::ExitCode;
use std::time::Duration;

use cache_sync::{Published, Publisher, cluster::Cluster};
use serde::Serialize;

use crate::Context;
use crate::args::{KeyType, Publish, ValueType};

/// A key or value parsed from the command line. Serialized as the bare
/// inner value (`untagged`), so its bincode bytes are those of a `String`,
/// `u64`, `i64` or `bool`: what the nodes decode their cache's K or V from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
enum Typed {
    String(String),
    U64(u64),
    I64(i64),
    Bool(bool),
}

fn key(arg: &str, ty: KeyType) -> Result<Typed, String> {
    Ok(match ty {
        KeyType::String => Typed::String(arg.to_owned()),
        KeyType::U64 => Typed::U64(
            arg.parse()
                .map_err(|e| format!("key {arg:?} is not a u64: {e}"))?,
        ),
        KeyType::I64 => Typed::I64(
            arg.parse()
                .map_err(|e| format!("key {arg:?} is not an i64: {e}"))?,
        ),
    })
}

fn value(arg: &str, ty: ValueType) -> Result<Typed, String> {
    Ok(match ty {
        ValueType::String => Typed::String(arg.to_owned()),
        ValueType::U64 => Typed::U64(
            arg.parse()
                .map_err(|e| format!("value {arg:?} is not a u64: {e}"))?,
        ),
        ValueType::I64 => Typed::I64(
            arg.parse()
                .map_err(|e| format!("value {arg:?} is not an i64: {e}"))?,
        ),
        ValueType::Bool => Typed::Bool(
            arg.parse()
                .map_err(|_| format!("value {arg:?} is not true or false"))?,
        ),
    })
}

/// How often the publisher announces its last sequence number, and how
/// long this process stays up after publishing: a node that lost the
/// event learns of it from an announcement (see `Publisher`), which needs
/// the process running for the three announcements that follow.
const ANNOUNCE: Duration = Duration::from_millis(100);
const LINGER: Duration = Duration::from_millis(350);

pub(crate) async fn run(ctx: &Context, command: Publish) -> Result<ExitCode, String> {
    let (cache, common) = match &command {
        Publish::Invalidate { cache, common, .. }
        | Publish::Insert { cache, common, .. }
        | Publish::InvalidateAll { cache, common, .. } => (cache.clone(), common),
    };
    // Parse everything before connecting: a typo costs no broker round trip.
    let change = match &command {
        Publish::Invalidate { keys, version, .. } => Change::Invalidate(
            keys.iter()
                .map(|k| key(k, common.key_type))
                .collect::<Result<_, _>>()?,
            *version,
        ),
        Publish::Insert {
            key: k,
            value: v,
            version,
            value_type,
            ..
        } => Change::Refresh(key(k, common.key_type)?, value(v, *value_type)?, *version),
        Publish::InvalidateAll { version, .. } => Change::Clear(*version),
    };
    let transport = ctx.connect().await?;
    let mut builder = Publisher::builder(transport.clone())
        .topic(ctx.topic.clone())
        .origin(common.origin.clone())
        .announce_interval(ANNOUNCE);
    if let Some(ring) = &ctx.keyring {
        builder = builder.signing(ring.clone());
    }
    let publisher = builder.build().map_err(|e| e.to_string())?;
    // The watcher starts before the publish, so it is listening when the
    // nodes report it applied.
    let cluster = match common.ack {
        Some(_) => Some(ctx.watcher(transport).await?),
        None => None,
    };
    let published: Published = match change {
        Change::Invalidate(keys, version) => {
            let keys = keys.into_iter().map(|k| (k, version));
            publisher.invalidate_versioned(&cache, keys).await
        }
        Change::Refresh(k, v, version) => {
            publisher.insert_versioned(&cache, [(k, v, version)]).await
        }
        Change::Clear(None) => publisher.invalidate_all(&cache).await,
        Change::Clear(Some(version)) => publisher.invalidate_all_versioned(&cache, version).await,
    }
    .map_err(|e| format!("publish failed: {e}"))?;
    let code = match (common.ack, &cluster) {
        (Some(timeout), Some(cluster)) => ack(&published, cluster, timeout).await,
        _ => {
            println!("published {} event(s) to {cache}", published.events);
            ExitCode::SUCCESS
        }
    };
    tokio::time::sleep(LINGER).await;
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    Ok(code)
}

enum Change {
    Invalidate(Vec<Typed>, Option<u64>),
    Refresh(Typed, Typed, Option<u64>),
    Clear(Option<u64>),
}

async fn ack(published: &Published, cluster: &Cluster, timeout: Duration) -> ExitCode {
    let acks = published.applied_by(cluster, timeout).await;
    println!("{acks}");
    if acks.nodes.is_empty() {
        eprintln!("no live node holds the cache: nothing confirmed the publish");
        return ExitCode::FAILURE;
    }
    let pending: Vec<&str> = acks.pending().collect();
    if !pending.is_empty() {
        eprintln!("not applied (yet) on: {}", pending.join(", "));
    }
    // Every node answering is not enough: the view must be one that
    // knows every live node (settled, listening, not full).
    match acks.incomplete {
        None => ExitCode::SUCCESS,
        Some(why) => {
            eprintln!("not confirmed: {why}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The untagged enum encodes exactly as the plain type does: what
    /// makes a CLI key hit a `SyncedCache<String, _>` entry.
    #[test]
    fn typed_values_encode_as_their_plain_type() {
        let cfg = bincode::config::standard();
        let enc = |t: &Typed| bincode::serde::encode_to_vec(t, cfg).unwrap();
        assert_eq!(
            enc(&key("de", KeyType::String).unwrap()),
            bincode::serde::encode_to_vec("de".to_string(), cfg).unwrap()
        );
        assert_eq!(
            enc(&key("7", KeyType::U64).unwrap()),
            bincode::serde::encode_to_vec(7u64, cfg).unwrap()
        );
        assert_eq!(
            enc(&key("-7", KeyType::I64).unwrap()),
            bincode::serde::encode_to_vec(-7i64, cfg).unwrap()
        );
        assert_eq!(
            enc(&value("true", ValueType::Bool).unwrap()),
            bincode::serde::encode_to_vec(true, cfg).unwrap()
        );
    }

    #[test]
    fn values_of_the_wrong_type_are_refused() {
        assert!(key("x", KeyType::U64).unwrap_err().contains("not a u64"));
        assert!(value("-1", ValueType::U64).is_err());
        assert!(
            value("yes", ValueType::Bool)
                .unwrap_err()
                .contains("true or false")
        );
    }
}
