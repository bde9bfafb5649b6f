//! The crate's one error type, and why a payload was rejected.

use std::fmt;

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in cache-sync.
///
/// Branch on the predicates ([`is_disconnected`](Error::is_disconnected),
/// [`is_decode`](Error::is_decode), …) rather than on variants: new variants
/// may be added in minor releases.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The transport could not reach its broker, or the connection dropped.
    #[error("{transport} transport disconnected: {source}")]
    Disconnected {
        /// Which transport (`"embedded"`, `"redis-streams"`, …).
        transport: &'static str,
        /// What the client library reported.
        #[source]
        source: BoxError,
    },

    /// The broker answered, but with an error.
    #[error("{transport} transport error: {source}")]
    Transport {
        /// Which transport.
        transport: &'static str,
        /// What the client library reported.
        #[source]
        source: BoxError,
    },

    /// Bytes from the outside could not be decoded into an event, key or value.
    #[error("cannot decode event: {0}")]
    Decode(#[from] DecodeError),

    /// A key, a value, an event or the offsets file could not be encoded.
    #[error("cannot encode {what}: {message}")]
    Encode {
        /// `"key"`, `"value"`, `"event"` or `"offsets"`.
        what: &'static str,
        /// The encoder's message.
        message: String,
    },

    /// An entry or an event is over the event size limit. Nothing of the
    /// call was published from the event that failed on.
    #[error("encoded {what} is {size} bytes, over the {limit}-byte event limit")]
    TooLarge {
        /// `"entry"`: one key, or one key and its value, needs more room than
        /// an event has after the header and signature (`size` and `limit`
        /// count that room), so no batch split can make it fit; nothing of
        /// the call was published. `"event"`: the encoded event, signature
        /// included, is over `max_event_bytes`; that event was not
        /// published (earlier events of a split batch were).
        what: &'static str,
        /// Its encoded size.
        size: usize,
        /// The configured limit.
        limit: usize,
    },

    /// Two caches were registered under one name on one node.
    #[error("a cache named {0:?} is already registered on this node")]
    DuplicateCache(String),

    /// The transport cannot do what was asked (say, start from a timestamp).
    #[error("{transport} transport does not support {what}")]
    Unsupported {
        /// Which transport.
        transport: &'static str,
        /// What it cannot do.
        what: &'static str,
    },

    /// A setting or a name is out of range or inconsistent. Raised when a
    /// node starts, a cache is registered, a cache, transport or publisher is
    /// built (or a transport connects); a publish raises it only for a cache
    /// name it was given, or a [`Table`](crate::Table) pinned to another
    /// topic.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// An automatic row version would have to exceed `u64::MAX`: a version
    /// passed in earlier (this one) was already the largest there is. Nothing
    /// was published. Versions never wrap, since a wrapped version would be
    /// older than the rows it is meant to replace.
    #[error("no version is newer than {0}, so no automatic version can follow it")]
    VersionExhausted(u64),

    /// Reading or writing a local file failed: the offsets file
    /// ([`FileOffsetStore`](crate::transport::FileOffsetStore)) or a RocketMQ offsets
    /// table.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: std::path::PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// The status server could not listen on its address (in use, not
    /// permitted, not this machine's).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for, in its `Debug` form (a `&str` is
        /// quoted).
        addr: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The node has shut down.
    #[error("the node has shut down")]
    Shutdown,

    /// A read that may not go to the source
    /// ([`SyncedCache::try_get`](crate::SyncedCache::try_get)) found its
    /// cache past its [staleness bound](crate::SyncedCacheBuilder::max_staleness):
    /// its node cannot prove what the cache holds fresh within it.
    #[error("cache {cache:?} is not proved fresh within {max:?} (its proof is {})", age.map_or_else(|| "missing".to_owned(), |a| format!("{a:?} old")))]
    Stale {
        /// The cache's name.
        cache: String,
        /// Its bound.
        max: std::time::Duration,
        /// How old its node's proof is; `None` when there is none (no node
        /// holds the cache, or its transport cannot tell its tail).
        age: Option<std::time::Duration>,
    },

    /// The database of the outbox or of a CDC relay failed: it could not be
    /// reached, the connection (or the replication session) dropped, or a
    /// statement failed. Not a transport error: nothing was published, and
    /// in the caller's transaction nothing was written that will be (roll
    /// it back).
    #[error("database error: {0}")]
    Database(#[source] BoxError),
}

impl Error {
    /// The broker is unreachable or the connection dropped. Usually worth a retry.
    pub fn is_disconnected(&self) -> bool {
        matches!(self, Error::Disconnected { .. })
    }

    /// Input from the outside (an event, a key, a value) did not decode.
    pub fn is_decode(&self) -> bool {
        matches!(self, Error::Decode(_))
    }

    /// An event was unsigned, forged, tampered with, or signed with an
    /// unknown key.
    pub fn is_signature(&self) -> bool {
        matches!(self, Error::Decode(d) if matches!(d.kind, DecodeErrorKind::Unsigned | DecodeErrorKind::BadSignature | DecodeErrorKind::UnknownKey(_)))
    }

    /// An event, key or value is over the size limit.
    pub fn is_too_large(&self) -> bool {
        matches!(self, Error::TooLarge { .. })
            || matches!(self, Error::Decode(d) if matches!(d.kind, DecodeErrorKind::TooLarge { .. }))
    }

    /// The transport does not support the requested operation.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. })
    }

    /// A setting or name was refused. Retrying the same call cannot help.
    pub fn is_config(&self) -> bool {
        matches!(self, Error::Config(_))
    }

    /// The broker answered, but with an error (a refused command, a stream
    /// or topic it does not have): not a dropped connection.
    pub fn is_transport(&self) -> bool {
        matches!(self, Error::Transport { .. })
    }
    /// A key, a value, an event or the offsets file could not be encoded.
    pub fn is_encode(&self) -> bool {
        matches!(self, Error::Encode { .. })
    }
    /// A cache of this name is already registered on this node.
    pub fn is_duplicate_cache(&self) -> bool {
        matches!(self, Error::DuplicateCache(_))
    }
    /// No automatic version can follow the last one (`u64::MAX`).
    pub fn is_version_exhausted(&self) -> bool {
        matches!(self, Error::VersionExhausted(_))
    }
    /// A local file could not be read or written.
    pub fn is_io(&self) -> bool {
        matches!(self, Error::Io { .. })
    }
    /// The status server could not listen on its address.
    pub fn is_bind(&self) -> bool {
        matches!(self, Error::Bind { .. })
    }
    /// The node has shut down, so it takes no more work.
    pub fn is_shutdown(&self) -> bool {
        matches!(self, Error::Shutdown)
    }

    /// A read found its cache past its staleness bound: what it holds
    /// may be older than the bound. Read the source, or retry once the
    /// node proves it fresh again.
    pub fn is_stale(&self) -> bool {
        matches!(self, Error::Stale { .. })
    }

    /// The database of the outbox or of a CDC relay failed (unreachable,
    /// connection dropped, or a statement refused).
    pub fn is_database(&self) -> bool {
        matches!(self, Error::Database(_))
    }

    pub(crate) fn disconnected(transport: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Disconnected {
            transport,
            source: source.into(),
        }
    }

    pub(crate) fn io(path: impl Into<std::path::PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// Why a payload was rejected. Every rejection is counted and logged with this
/// reason; none of them panics or stops the consumer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}")]
pub struct DecodeError {
    pub(crate) kind: DecodeErrorKind,
}

impl DecodeError {
    pub(crate) fn new(kind: DecodeErrorKind) -> Self {
        Self { kind }
    }

    /// The reason, as a machine-readable kind.
    pub fn kind(&self) -> &DecodeErrorKind {
        &self.kind
    }
}

/// The reason a payload was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecodeErrorKind {
    /// Zero bytes.
    Empty,
    /// The first byte names a format this build does not know.
    UnknownFormat(u8),
    /// More bytes than the configured limit.
    TooLarge {
        /// Bytes received.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The bytes are not a valid encoding (garbage, truncated, or a length
    /// prefix that claims more than the limit).
    Malformed(String),
    /// The value decoded but bytes were left over.
    TrailingBytes(usize),
    /// The node verifies signatures and the event carries none.
    Unsigned,
    /// The signature does not match: forged, tampered with, or truncated.
    BadSignature,
    /// Signed with a key id the node does not accept.
    UnknownKey(String),
    /// A key or value did not decode into the cache's types.
    TypeMismatch {
        /// `"key"` or `"value"`.
        what: &'static str,
        /// The decoder's message.
        message: String,
    },
}

impl DecodeErrorKind {
    /// A short, stable label, used as the `reason` field in logs.
    pub fn label(&self) -> &'static str {
        match self {
            DecodeErrorKind::Empty => "empty",
            DecodeErrorKind::UnknownFormat(_) => "unknown_format",
            DecodeErrorKind::TooLarge { .. } => "too_large",
            DecodeErrorKind::Malformed(_) => "malformed",
            DecodeErrorKind::TrailingBytes(_) => "trailing_bytes",
            DecodeErrorKind::Unsigned => "unsigned",
            DecodeErrorKind::BadSignature => "bad_signature",
            DecodeErrorKind::UnknownKey(_) => "unknown_key",
            DecodeErrorKind::TypeMismatch { .. } => "type_mismatch",
        }
    }
}

impl fmt::Display for DecodeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeErrorKind::Empty => f.write_str("empty payload"),
            DecodeErrorKind::UnknownFormat(v) => write!(f, "unknown format version {v}"),
            DecodeErrorKind::TooLarge { size, limit } => {
                write!(f, "payload is {size} bytes, over the {limit}-byte limit")
            }
            DecodeErrorKind::Malformed(m) => write!(f, "malformed payload: {m}"),
            DecodeErrorKind::TrailingBytes(n) => write!(f, "{n} trailing bytes after the event"),
            DecodeErrorKind::Unsigned => {
                f.write_str("unsigned event, and this node requires signatures")
            }
            DecodeErrorKind::BadSignature => {
                f.write_str("signature does not match (forged or tampered)")
            }
            DecodeErrorKind::UnknownKey(id) => write!(f, "signed with unknown key id {id:?}"),
            DecodeErrorKind::TypeMismatch { what, message } => {
                write!(f, "{what} does not decode into the cache's type: {message}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicates_tell_broker_trouble_from_bad_input() {
        let e = Error::disconnected("embedded", "gone");
        assert!(e.is_disconnected() && !e.is_decode());
        let e = Error::from(DecodeError::new(DecodeErrorKind::Empty));
        assert!(e.is_decode() && !e.is_disconnected());
        let e = Error::from(DecodeError::new(DecodeErrorKind::TooLarge {
            size: 2,
            limit: 1,
        }));
        assert!(e.is_decode() && e.is_too_large());
        // An unreachable database is not a broker disconnect: nothing was
        // published, and the caller's transaction is what to retry.
        let e = Error::Database("connection refused".into());
        assert!(e.is_database() && !e.is_disconnected());
        assert!(!Error::disconnected("embedded", "gone").is_database());
    }

    /// Each variant answers to its own predicate and to no other's (but
    /// that a signature failure is also a decode failure, and an oversized
    /// input decoded is also too large).
    /// No wildcard: a new variant does not compile until it has an arm
    /// here, which is the reminder to give it a predicate and a case below
    /// (the test itself cannot see a variant it is not given).
    fn _every_variant_is_below(e: &Error) {
        match e {
            Error::Disconnected { .. }
            | Error::Transport { .. }
            | Error::Decode(_)
            | Error::Encode { .. }
            | Error::TooLarge { .. }
            | Error::DuplicateCache(_)
            | Error::Unsupported { .. }
            | Error::Config(_)
            | Error::VersionExhausted(_)
            | Error::Io { .. }
            | Error::Bind { .. }
            | Error::Shutdown
            | Error::Stale { .. }
            | Error::Database(_) => {}
        }
    }

    #[test]
    fn every_variant_has_a_predicate_of_its_own() {
        type Predicate = fn(&Error) -> bool;
        let predicates: [(&str, Predicate); 15] = [
            ("disconnected", Error::is_disconnected),
            ("transport", Error::is_transport),
            ("decode", Error::is_decode),
            ("signature", Error::is_signature),
            ("encode", Error::is_encode),
            ("too_large", Error::is_too_large),
            ("duplicate_cache", Error::is_duplicate_cache),
            ("unsupported", Error::is_unsupported),
            ("config", Error::is_config),
            ("version_exhausted", Error::is_version_exhausted),
            ("io", Error::is_io),
            ("bind", Error::is_bind),
            ("shutdown", Error::is_shutdown),
            ("stale", Error::is_stale),
            ("database", Error::is_database),
        ];
        let io = || std::io::Error::other("x");
        let cases: Vec<(Error, &[&str])> = vec![
            (Error::disconnected("embedded", "gone"), &["disconnected"]),
            (
                Error::Transport {
                    transport: "nats",
                    source: "no stream".into(),
                },
                &["transport"],
            ),
            (DecodeError::new(DecodeErrorKind::Empty).into(), &["decode"]),
            (
                DecodeError::new(DecodeErrorKind::BadSignature).into(),
                &["decode", "signature"],
            ),
            (
                DecodeError::new(DecodeErrorKind::TooLarge { size: 2, limit: 1 }).into(),
                &["decode", "too_large"],
            ),
            (
                Error::Encode {
                    what: "key",
                    message: "no".into(),
                },
                &["encode"],
            ),
            (
                Error::TooLarge {
                    what: "entry",
                    size: 2,
                    limit: 1,
                },
                &["too_large"],
            ),
            (Error::DuplicateCache("c".into()), &["duplicate_cache"]),
            (
                Error::Unsupported {
                    transport: "redis-pubsub",
                    what: "history",
                },
                &["unsupported"],
            ),
            (Error::Config("x".into()), &["config"]),
            (Error::VersionExhausted(u64::MAX), &["version_exhausted"]),
            (Error::io("/tmp/offsets.json", io()), &["io"]),
            (
                Error::Bind {
                    addr: "127.0.0.1:1".into(),
                    source: io(),
                },
                &["bind"],
            ),
            (Error::Shutdown, &["shutdown"]),
            (
                Error::Stale {
                    cache: "c".into(),
                    max: std::time::Duration::from_secs(1),
                    age: None,
                },
                &["stale"],
            ),
            (Error::Database("down".into()), &["database"]),
        ];
        for (e, expected) in &cases {
            let said: Vec<&str> = predicates
                .iter()
                .filter(|(_, p)| p(e))
                .map(|(name, _)| *name)
                .collect();
            assert_eq!(&said, expected, "{e:?}");
        }
    }
}
