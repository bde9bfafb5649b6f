//! How cache-sync's names map to NATS: subjects, stream names and the tag
//! header, each escaped into what NATS takes as it is, and the partitions
//! of a position. Together so that publishing, subscribing and the prefix
//! check agree on them.

use async_nats::jetstream::stream;

use super::super::{Offset, Position};
use super::NatsJetStreamTransport;
use crate::transport::names;

/// The partitions of a NATS position: the last stream sequence read, and
/// the stream's creation time, which names the history the sequence
/// belongs to (a stream deleted and made again, or a server that lost its
/// store, starts another history whose sequences can reach the same numbers).
pub(super) const SEQ: &str = "seq";
pub(super) const CREATED: &str = "created";
/// Carries the cache name, so nodes skip other caches' events unread.
pub(super) const TAG_HEADER: &str = "Cache-Sync-Tag";
/// JetStream's longest stream name.
pub(super) const MAX_STREAM_NAME: usize = 255;

impl NatsJetStreamTransport {
    /// `<prefix>.<topic>`, the topic escaped into one literal token: a `.`
    /// would split it into two, and `*` or `>` would make it a wildcard
    /// that catches other topics' events.
    pub(super) fn subject(&self, topic: &str) -> String {
        format!(
            "{}.{}",
            self.config.subject_prefix,
            names::escape_with(topic, MARKER, subject_char)
        )
    }

    /// `<prefix>_<topic>`, each escaped to letters, digits and `-` (others
    /// as `=XX`), so the one `_` between them keeps the name injective:
    /// `tenant.a` and `tenant_a` get streams of their own. Names made of
    /// those characters alone are unchanged (`cache-sync_catalog`).
    pub(super) fn stream_name(&self, topic: &str) -> String {
        format!(
            "{}_{}",
            names::escape_with(&self.config.subject_prefix, MARKER, stream_char),
            names::escape_with(topic, MARKER, stream_char)
        )
    }
}

/// Escapes in NATS names start with `=` (quoted-printable's marker), not `%`:
/// the server formats a stream's name into each message's acknowledgement
/// subject as a format string, and a `%` there garbles the subject and
/// makes the client drop the connection.
pub(super) const MARKER: u8 = b'=';

/// Characters a subject token takes as they are.
pub(super) fn subject_char(c: char) -> bool {
    c.is_ascii_graphic() && !matches!(c, '.' | '*' | '>' | '%' | '=')
}

/// Characters a tag header value takes as they are.
pub(super) fn header_char(c: char) -> bool {
    c.is_ascii_graphic() && c != '='
}

/// Characters a stream name takes as they are; `_` separates the prefix
/// from the topic, so it is escaped inside them.
fn stream_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-'
}

pub(super) fn seq_position(seq: u64, created: u64) -> Position {
    let mut p = Position::single(SEQ, Offset::Seq(seq));
    p.set(CREATED, Offset::Seq(created));
    p
}

/// The stream's creation time in nanoseconds: the identity of its history.
pub(super) fn created(info: &stream::Info) -> u64 {
    u64::try_from(info.created.unix_timestamp_nanos()).unwrap_or(0)
}
