//! What goes over the heartbeat channel, and how it is sealed and opened.
//!
//! A message is JSON behind the heartbeat format byte, signed like an event
//! when the sender has a keyring. An answer to an acknowledgement request
//! ([`Ack`]) is JSON too, behind its own format byte and the id of the party
//! that asked, so that every other party skips it unread. JSON rather than bincode: a heartbeat is
//! small and rare (one per node per interval), and a self-describing format
//! lets nodes of different versions share a channel during a rolling
//! upgrade (unknown fields are ignored, missing new ones take defaults).
//! It is parsed only after authentication and the size limit, and
//! `serde_json` bounds nesting depth, so hostile input costs at most one
//! bounded parse.

use serde::{Deserialize, Serialize};

use super::Heartbeat;
use crate::error::{DecodeError, DecodeErrorKind, Result};
use crate::status::KeyState;
use crate::wire::{Channel, Codec};

/// One message on the heartbeat channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum Message {
    /// A node's state.
    Heartbeat(Heartbeat),
    /// Asks the nodes for a heartbeat now, and again once they applied
    /// something.
    Request(Request),
    /// Asks the nodes that hold a cache what they hold for one key.
    Probe(Probe),
}

/// A key probe: every node that holds `cache` answers the party `asker`
/// with an [`Ack`] whose `probed` names `id` and says what the node holds
/// for `key`, at once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Probe {
    /// Signed, as in a request.
    pub(crate) topic: String,
    pub(crate) cache: String,
    /// The key as JSON (see `CacheHandle::probe`). Keys are data: the
    /// probe goes only where the topic's events go, signed like them.
    pub(crate) key: String,
    pub(crate) asker: u64,
    pub(crate) id: u64,
    /// Whether the asker reads its reply channel.
    #[serde(default)]
    pub(crate) reply: bool,
}

/// A node's answer to one probe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Probed {
    pub(crate) id: u64,
    pub(crate) state: KeyState,
}

/// A roll call (no cache: every node sends a heartbeat now), or an
/// acknowledgement request: every node that holds `cache` answers the
/// party `asker` with an [`Ack`] naming `id` once it has applied `target`,
/// waiting for up to `within_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Request {
    /// The topic whose nodes are asked: signed, so a request replayed into
    /// another topic's channel is refused there.
    #[serde(default)]
    pub(crate) topic: String,
    /// The cache; `None` asks every node (a roll call).
    pub(crate) cache: Option<String>,
    pub(crate) target: Option<Target>,
    /// How long the asker waits; nodes keep the request no longer (and at
    /// most a minute).
    #[serde(default)]
    pub(crate) within_ms: u64,
    /// The asking party (random per `Cluster`), which answers name.
    #[serde(default)]
    pub(crate) asker: u64,
    /// The request, among the asker's (random).
    #[serde(default)]
    pub(crate) id: u64,
    /// Whether the asker reads its reply channel
    /// ([`Transport::publish_reply`](crate::transport::Transport::publish_reply)):
    /// answers go there, else on the heartbeat channel.
    #[serde(default)]
    pub(crate) reply: bool,
}

/// A node's answer to one asker: it has applied what each request in
/// `ids` named, and how far it got with what the asker follows
/// (`progress`). A few dozen bytes; only the asker reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Ack {
    /// The topic: signed, as in a request.
    pub(crate) topic: String,
    /// The node that applied.
    pub(crate) node_id: String,
    /// The requests it answers.
    pub(crate) ids: Vec<u64>,
    /// Where the node stands with each thing the asker follows, told as it
    /// moves.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) progress: Vec<Progress>,
    /// Answers to probes (see [`Probe`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) probed: Vec<Probed>,
}

/// What an asker follows on a node for a while after each request (see
/// `node/acks.rs`): a publisher's numbers for a cache, or, with no
/// publisher, the cache's version; and how far the node got with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Progress {
    pub(crate) cache: String,
    /// `None`: the cache's version.
    pub(crate) publisher: Option<u64>,
    /// The last number applied from the publisher (or covered by a
    /// resync), or the cache's version.
    pub(crate) at: u64,
}

impl Target {
    /// What a request for this target follows: the publisher, or `None`
    /// for a version; and the value it waits for.
    pub(crate) fn followed(self) -> (Option<u64>, u64) {
        match self {
            Target::Seq { publisher, seq } => (Some(publisher), seq),
            Target::Version(v) => (None, v),
        }
    }
}

/// What a payload on the heartbeat channel held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Opened {
    Message(Message),
    Ack { asker: u64, ack: Ack },
}

/// What a node must have applied to a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Target {
    /// A publisher's event: this number or a later one from it.
    Seq {
        /// The publisher instance.
        publisher: u64,
        /// Its number for the cache.
        seq: u64,
    },
    /// The cache's version reached this one.
    Version(u64),
}

impl Request {
    /// Every node: send a heartbeat now.
    pub(crate) fn roll_call(topic: &str) -> Self {
        Request {
            topic: topic.to_owned(),
            cache: None,
            target: None,
            within_ms: 0,
            asker: 0,
            id: 0,
            reply: false,
        }
    }
}

pub(crate) fn seal(codec: &Codec, message: &Message) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(message)
        .map_err(|e| crate::Error::Config(format!("heartbeat message: {e}")))?;
    codec.seal_heartbeat(&json)
}

pub(crate) fn seal_ack(codec: &Codec, asker: u64, ack: &Ack) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(ack)
        .map_err(|e| crate::Error::Config(format!("acknowledgement: {e}")))?;
    codec.seal_ack(asker, &json)
}

/// Authenticates (when verifying), checks the size, then parses.
pub(crate) fn open(codec: &Codec, payload: &[u8]) -> Result<Opened, DecodeError> {
    let malformed = |what: &str, e: serde_json::Error| {
        DecodeError::new(DecodeErrorKind::Malformed(format!("{what}: {e}")))
    };
    match codec.open_channel(payload)? {
        Channel::Message(json) => serde_json::from_slice(json)
            .map(Opened::Message)
            .map_err(|e| malformed("heartbeat message", e)),
        Channel::Ack { asker, message } => serde_json::from_slice(message)
            .map(|ack| Opened::Ack { asker, ack })
            .map_err(|e| malformed("acknowledgement", e)),
    }
}
