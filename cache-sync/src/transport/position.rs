//! Where a subscriber stands in a topic: one offset per partition.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Where a subscriber stands in a topic: one offset per partition.
///
/// Opaque to applications; meaningful only to the transport that produced it.
/// It serializes to JSON as a map from key to offset, like RocketMQ's
/// `offsets.json`:
///
/// ```json
/// {"broker-a:0": 1042, "broker-a:1": 977}
/// ```
///
/// The keys are the transport's own, and each names the history it belongs
/// to as well as a place in it, so a position from a lost history is caught
/// rather than resumed into: the embedded transport keeps one entry, named
/// after the transport instance (`embedded-<id>`); a Redis
/// stream the last entry id read, its ordinal and the stream's epoch (`id`,
/// `n`, `e`); a NATS stream the last sequence read and the stream's creation
/// time (`seq`, `created`); RocketMQ, per message queue, the *next* offset
/// to read (as in its consumer offsets) and an anchor naming the message
/// before it (`<broker>:<queue>@`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Position(BTreeMap<String, Offset>);

/// One partition's offset: a sequence number, or a transport-specific id such
/// as a Redis stream entry id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(untagged)]
#[non_exhaustive]
pub enum Offset {
    /// A numeric offset or sequence (embedded transport, NATS, RocketMQ).
    Seq(u64),
    /// An opaque id (a Redis stream entry id).
    Id(String),
}

impl Position {
    /// A position in a transport with a single partition.
    pub fn single(partition: impl Into<String>, offset: Offset) -> Self {
        let mut p = Self::default();
        p.set(partition, offset);
        p
    }

    /// Sets one partition's offset.
    pub fn set(&mut self, partition: impl Into<String>, offset: Offset) {
        self.0.insert(partition.into(), offset);
    }

    /// One partition's offset.
    pub fn get(&self, partition: &str) -> Option<&Offset> {
        self.0.get(partition)
    }

    /// Partitions and their offsets, in partition order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Offset)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Has no partition at all (nothing consumed yet).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Takes every partition that `later` names from `later`.
    pub fn advance(&mut self, later: &Position) {
        // In place where the partition exists: this runs for every batch.
        for (k, v) in &later.0 {
            match self.0.get_mut(k) {
                Some(offset) => offset.clone_from(v),
                None => {
                    self.0.insert(k.clone(), v.clone());
                }
            }
        }
    }
}

/// Whether `position` has read up to `tail` within one history: its
/// sequence under `seq` at or past the tail's, and the history named under
/// `history` the same (a sequence of another history says nothing of this
/// one). For transports whose positions carry both (Redis Streams' ordinal
/// and epoch, NATS's sequence and creation time).
#[cfg(any(test, feature = "redis", feature = "nats"))]
pub(crate) fn reached_in_history(
    position: &Position,
    tail: &Position,
    seq: &str,
    history: &str,
) -> bool {
    let read = match (position.get(seq), tail.get(seq)) {
        (Some(Offset::Seq(at)), Some(Offset::Seq(end))) => at >= end,
        _ => false,
    };
    read && tail.get(history).is_some() && position.get(history) == tail.get(history)
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match v {
                Offset::Seq(n) => write!(f, "{k}: {n}")?,
                Offset::Id(s) => write!(f, "{k}: {s}")?,
            }
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_json_is_a_partition_map() {
        let mut p = Position::single("broker-a:0", Offset::Seq(1042));
        p.set("stream", Offset::Id("1700-0".into()));
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(json, r#"{"broker-a:0":1042,"stream":"1700-0"}"#);
        assert_eq!(serde_json::from_str::<Position>(&json).unwrap(), p);
        assert_eq!(p.to_string(), "{broker-a:0: 1042, stream: 1700-0}");
    }

    #[test]
    fn a_tail_is_reached_only_in_its_own_history() {
        let at = |n: u64, e: u64| {
            let mut p = Position::single("n", Offset::Seq(n));
            p.set("e", Offset::Seq(e));
            p
        };
        let reached = |p: &Position, t: &Position| reached_in_history(p, t, "n", "e");
        assert!(reached(&at(5, 1), &at(5, 1)));
        assert!(reached(&at(u64::MAX, 1), &at(0, 1)));
        assert!(!reached(&at(4, 1), &at(5, 1)));
        assert!(
            !reached(&at(9, 2), &at(5, 1)),
            "another history, however far"
        );
        assert!(!reached(&at(9, 0), &at(5, 1)));
        assert!(!reached(&Position::single("n", Offset::Seq(9)), &at(5, 1)));
        assert!(
            !reached(&at(9, 1), &Position::single("n", Offset::Seq(5))),
            "a tail that names no history proves nothing"
        );
        assert!(!reached(&Position::default(), &at(0, 1)));
    }

    #[test]
    fn advance_takes_only_named_partitions() {
        let mut p = Position::single("q0", Offset::Seq(5));
        p.set("q1", Offset::Seq(9));
        p.advance(&Position::single("q1", Offset::Seq(10)));
        assert_eq!(p.get("q0"), Some(&Offset::Seq(5)));
        assert_eq!(p.get("q1"), Some(&Offset::Seq(10)));
    }
}
