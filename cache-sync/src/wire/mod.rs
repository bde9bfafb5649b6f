//! The change event and its wire format.
//!
//! A payload is one format byte followed by two bincode-2 values: the
//! [`Header`] and the [`Change`]. Keys and values inside a change are
//! themselves bincode-encoded byte strings, so a node can read the envelope
//! without knowing any cache's types, skip events for caches it does not hold
//! after reading only the header, and reject one bad value without losing the
//! rest of the batch.
//!
//! Two formats are read. Version 1 is the format byte 1, the header and the
//! change. Version 2 (format byte 2) puts a [`HeaderExt`] between the
//! header and the change: how long ago the publisher sent its previous
//! event for the cache (so a node can tell a lost event from one published
//! before it listened, without comparing clocks), and an outbox relay's
//! fence. Version 3 (format byte 3) adds a CDC relay's [`Watermark`] after
//! them, on its announcements only. An event with nothing in its extension
//! is written as version 1, which nodes built before version 2 read; one
//! without a watermark as version 2. An older node refuses a newer version
//! as unreadable and resyncs its cache, which is safe: upgrade nodes before
//! publishers.
//!
//! A publisher's announcement of the last sequence number it used for a
//! cache is an empty invalidation (`Change::Invalidate` with no keys)
//! carrying that number again: a publisher never sends an empty
//! invalidation otherwise (an empty batch publishes nothing). Nodes read it
//! as [`ChangeView::Announce`]. No new variant goes on the wire, so a node
//! built before announcements existed reads one as a change that changes
//! nothing, with a repeated number: a redelivery, or, if it is behind, a
//! gap in the numbers. Either answer is right.

use std::fmt;

use bincode::config::{self, Configuration, LittleEndian, Varint};
use bytes::Bytes;
use serde::{Serialize, de::DeserializeOwned};

use crate::error::{DecodeError, DecodeErrorKind, Error, Result};

mod codec;
mod keyring;
mod outgoing;
mod reader;
#[cfg(any(test, feature = "_outbox", feature = "_fuzz"))]
mod row;
mod view;
mod writer;

pub(crate) use codec::{Channel, Codec, Refused};
pub(crate) use outgoing::{Body, Outgoing};
#[cfg(any(test, feature = "_outbox", feature = "_fuzz"))]
pub(crate) use row::{decode_row, encode_row};

#[cfg(test)]
pub(crate) use keyring::FORMAT_SIGNED;
pub use keyring::Keyring;
pub(crate) use keyring::strip_unverified;
use reader::Reader;
pub(crate) use view::{ChangeView, Items};

/// The longest topic or cache name, in bytes: short enough for every
/// transport's resource names, and a bound on the header's size.
pub(crate) const MAX_NAME_BYTES: usize = 255;

/// The first wire format: the header, then the change.
pub(crate) const FORMAT_V1: u8 = 1;
/// The header, its [`HeaderExt`] (without a watermark), then the change.
pub(crate) const FORMAT_V2: u8 = 2;
/// The header, its [`HeaderExt`] with a watermark, then the change.
pub(crate) const FORMAT_V3: u8 = 3;

/// The default limit on one encoded event: 1 MiB.
pub(crate) const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// The highest limit that can be configured.
///
/// bincode's own limit is a compile-time constant. It bounds how much a length
/// prefix may claim, so a forged prefix in a small payload cannot make the
/// decoder reserve gigabytes. The configured (runtime) limit is then enforced
/// on the payload length before decoding starts.
pub(crate) const MAX_EVENT_BYTES_CEILING: usize = 64 << 20;

/// Refuses an event size limit outside 1 byte to the ceiling: one rule for
/// every builder that takes `max_event_bytes` (node, publisher, outbox).
pub(crate) fn check_max_event_bytes(n: usize) -> Result<()> {
    if n == 0 || n > MAX_EVENT_BYTES_CEILING {
        return Err(Error::Config(format!(
            "max_event_bytes must be between 1 and {MAX_EVENT_BYTES_CEILING}, not {n}"
        )));
    }
    Ok(())
}

type WireConfig = Configuration<LittleEndian, Varint, config::Limit<MAX_EVENT_BYTES_CEILING>>;

const fn wire_config() -> WireConfig {
    config::standard().with_limit::<MAX_EVENT_BYTES_CEILING>()
}

/// Who sent an event and when. Decoded first and on its own, so that skipping
/// an event for another cache costs only this. Borrowed: the publisher
/// encodes its own names, and a node reads them in place from the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(test, derive(serde::Deserialize))]
pub(crate) struct Header<'a> {
    pub(crate) cache: &'a str,
    /// Node id (or admin service name) of the publisher, for logs.
    pub(crate) origin: Origin<'a>,
    /// Random per publisher instance; a restarted publisher gets a new one.
    pub(crate) publisher: u64,
    /// Per (publisher, cache), starting at 1 and increasing by exactly 1.
    pub(crate) seq: u64,
    /// Microseconds since the Unix epoch, publisher's clock. Used for latency only.
    pub(crate) published_at_us: u64,
}

/// What a version 2 event adds to its header. Empty (the default) for
/// events that need neither field; such events are written as version 1.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(test, derive(serde::Deserialize))]
pub(crate) struct HeaderExt {
    /// Microseconds, on the publisher's own clock, from its previous event
    /// for this cache (number `seq - 1`; for an announcement, the event
    /// number `seq` it announces) to this message. A duration, never a
    /// time of day: a node compares it with its own receive times only.
    /// `None` for a publisher's first event, or one that does not say.
    pub(crate) since_prev_us: Option<u64>,
    /// The outbox relay's term that sent it: see [`Fence`].
    pub(crate) fence: Option<Fence>,
    /// A CDC relay's lag, on its announcements (version 3 only).
    pub(crate) watermark: Option<Watermark>,
}

impl HeaderExt {
    fn is_empty(&self) -> bool {
        *self == HeaderExt::default()
    }

    /// The format byte an event with this extension is written with.
    pub(crate) fn format(&self) -> u8 {
        if self.watermark.is_some() {
            FORMAT_V3
        } else if self.is_empty() {
            FORMAT_V1
        } else {
            FORMAT_V2
        }
    }
}

/// A CDC relay's report, sent with an announcement for each cache it
/// maps. Report `number` says: everything the database had made visible
/// before the relay's mark for it is published before it. How long before
/// its acknowledgement that mark was is only known once it is acknowledged,
/// so the next report carries it (`acked_after_us`): a duration on the
/// relay's own clock, never a time of day, which a node takes against its
/// own proof of the topic as of the earlier report (see the node's
/// `route.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(test, derive(serde::Deserialize))]
pub(crate) struct Watermark {
    /// Which relay group (a CDC relay's slot and database, an outbox's
    /// database and schema, hashed): relays that stand in for one another
    /// report as one source.
    pub(crate) source: u64,
    /// A CDC relay session's: the database's WAL position when it started,
    /// so a later session (of any relay of the group) has a larger one. An
    /// outbox relay's: the fencing term of the pass reported on, drawn
    /// from a sequence by every pass. Its reports are numbered within it.
    pub(crate) epoch: u64,
    /// The report's number in its epoch, from 1; never sent twice.
    pub(crate) number: u64,
    /// Microseconds from the mark of report `number - 1` of the epoch to
    /// its acknowledgement by the broker for every cache; `None` for the
    /// first, or when that one did not reach every cache.
    pub(crate) acked_after_us: Option<u64>,
}

/// An outbox relay's fencing token. Every pass of a relay that holds the
/// outbox's leader lock takes a new `term` from a database sequence, so a
/// relay that lost the lock without knowing (its session died while a
/// publish was slow) sends under a lower term than the relay that replaced
/// it. A node that has seen a higher term of the same `scope` (one outbox)
/// for a cache applies what a lower one sends as invalidations: it may be
/// older than what the new relay already published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(test, derive(serde::Deserialize))]
pub(crate) struct Fence {
    /// Random per outbox, made when its schema is migrated.
    pub(crate) scope: u64,
    /// Increases with every pass of every relay of the outbox.
    pub(crate) term: u64,
}

/// The publisher's name, as it came: only ever written to logs, so it is not
/// checked for UTF-8 on the apply path (on the wire it is a string, and the
/// same bytes).
#[derive(Clone, Copy, PartialEq, Eq, Serialize)]
#[cfg_attr(test, derive(serde::Deserialize))]
#[serde(transparent)]
pub(crate) struct Origin<'a>(pub(crate) &'a [u8]);

impl fmt::Display for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(self.0))
    }
}

impl fmt::Debug for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&String::from_utf8_lossy(self.0), f)
    }
}

/// What changed, as a publisher used to build it, and as the outbox
/// stores it (a publish itself goes out as [`Outgoing`]).
#[cfg(any(test, feature = "_sql", feature = "mysql-cdc", feature = "_fuzz"))]
// Deserialize: tests, and the outbox, which stores changes in its rows (`row.rs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub(crate) enum Change {
    Invalidate { keys: Vec<KeyVersion> },
    Refresh { entries: Vec<EntryVersion> },
    Clear { version: Option<u64> },
}

#[cfg(any(test, feature = "_fuzz"))]
impl Change {
    /// An announcement: see the module docs.
    pub(crate) const ANNOUNCE: Change = Change::Invalidate { keys: Vec::new() };
}

#[cfg(any(test, feature = "_sql", feature = "mysql-cdc", feature = "_fuzz"))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub(crate) struct KeyVersion {
    pub(crate) key: Bytes,
    pub(crate) version: Option<u64>,
}

#[cfg(any(test, feature = "_sql", feature = "mysql-cdc", feature = "_fuzz"))]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub(crate) struct EntryVersion {
    pub(crate) key: Bytes,
    pub(crate) value: Bytes,
    pub(crate) version: Option<u64>,
}

/// The variants' indices, as serde numbers `Change`'s variants.
const INVALIDATE: u32 = 0;
const REFRESH: u32 = 1;
const CLEAR: u32 = 2;

#[cfg(any(test, feature = "_sql", feature = "mysql-cdc", feature = "_fuzz"))]
impl Change {
    /// How many keys the change names; `Clear` counts as one.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        match self {
            Change::Invalidate { keys } => keys.len(),
            Change::Refresh { entries } => entries.len(),
            Change::Clear { .. } => 1,
        }
    }

    /// What a second, delayed send of this change says: drop what it
    /// changed, at the same versions (see `PublisherBuilder::again_after`).
    #[cfg(any(test, feature = "_outbox"))]
    pub(crate) fn into_invalidation(self) -> Change {
        match self {
            Change::Refresh { entries } => Change::Invalidate {
                keys: entries
                    .into_iter()
                    .map(|e| KeyVersion {
                        key: e.key,
                        version: e.version,
                    })
                    .collect(),
            },
            other => other,
        }
    }

    #[cfg(test)]
    pub(crate) fn max_version(&self) -> Option<u64> {
        match self {
            Change::Invalidate { keys } => keys.iter().filter_map(|k| k.version).max(),
            Change::Refresh { entries } => entries.iter().filter_map(|e| e.version).max(),
            Change::Clear { version } => *version,
        }
    }
}

#[cfg(test)]
pub(crate) fn encode(header: &Header<'_>, change: &Change) -> Result<Vec<u8>> {
    encode_ext(header, &HeaderExt::default(), change)
}

/// Encodes an event with an extension: as version 2, or as version 1 when
/// the extension is empty (so nodes that read only version 1 read it).
/// Through bincode's serde layer: the reference the publisher's own writer
/// ([`Outgoing`]) is tested against, and the fuzz targets' encoder.
#[cfg(any(test, feature = "_fuzz"))]
pub(crate) fn encode_ext(header: &Header<'_>, ext: &HeaderExt, change: &Change) -> Result<Vec<u8>> {
    let encode_err = |e: bincode::error::EncodeError| Error::Encode {
        what: "event",
        message: e.to_string(),
    };
    let mut out = Vec::with_capacity(64);
    let format = ext.format();
    out.push(format);
    bincode::serde::encode_into_std_write(header, &mut out, wire_config()).map_err(encode_err)?;
    match format {
        FORMAT_V2 => bincode::serde::encode_into_std_write(
            (ext.since_prev_us, ext.fence),
            &mut out,
            wire_config(),
        )
        .map(|_| ()),
        FORMAT_V3 => {
            bincode::serde::encode_into_std_write(ext, &mut out, wire_config()).map(|_| ())
        }
        _ => Ok(()),
    }
    .map_err(encode_err)?;
    bincode::serde::encode_into_std_write(change, &mut out, wire_config()).map_err(encode_err)?;
    Ok(out)
}

/// Checks the format byte and size, and reads the header only.
/// Returns the header and the offset where the change begins.
pub(crate) fn decode_header(
    bytes: &[u8],
    limit: usize,
) -> Result<(Header<'_>, usize), DecodeError> {
    decode_header_ext(bytes, limit, None).map(|(header, _, offset)| (header, offset))
}

/// Checks the format byte and size, and reads the header and its extension
/// (empty for version 1); returns them and the offset where the change
/// begins. `expected` is the cache name the event most likely carries (its
/// transport tag's): a name equal to it byte for byte is valid UTF-8
/// without checking again.
pub(crate) fn decode_header_ext<'a>(
    bytes: &'a [u8],
    limit: usize,
    expected: Option<&'a str>,
) -> Result<(Header<'a>, HeaderExt, usize), DecodeError> {
    let Some((&format, rest)) = bytes.split_first() else {
        return Err(DecodeError::new(DecodeErrorKind::Empty));
    };
    if bytes.len() > limit {
        return Err(DecodeError::new(DecodeErrorKind::TooLarge {
            size: bytes.len(),
            limit,
        }));
    }
    if !matches!(format, FORMAT_V1 | FORMAT_V2 | FORMAT_V3) {
        return Err(DecodeError::new(DecodeErrorKind::UnknownFormat(format)));
    }
    let mut r = Reader { rest };
    let header = Header {
        cache: r.str_expecting(expected)?,
        origin: Origin(r.bytes()?),
        publisher: r.u64()?,
        seq: r.u64()?,
        published_at_us: r.u64()?,
    };
    let ext = if format == FORMAT_V1 {
        HeaderExt::default()
    } else {
        HeaderExt {
            since_prev_us: r.option_u64()?,
            fence: match r.byte()? {
                0 => None,
                1 => Some(Fence {
                    scope: r.u64()?,
                    term: r.u64()?,
                }),
                b => return Err(Reader::malformed(&format!("invalid option tag {b}"))),
            },
            watermark: if format == FORMAT_V3 {
                // Present: that is what version 3 says (an absent one is
                // version 2), so a tag of 0 is as malformed as any other.
                match r.byte()? {
                    1 => Some(Watermark {
                        source: r.u64()?,
                        epoch: r.u64()?,
                        number: r.u64()?,
                        acked_after_us: r.option_u64()?,
                    }),
                    b => return Err(Reader::malformed(&format!("invalid watermark tag {b}"))),
                }
            } else {
                None
            },
        }
    };
    Ok((header, ext, bytes.len().saturating_sub(r.rest.len())))
}

/// Reads (and checks) the change that follows the header, rejecting
/// trailing bytes.
pub(crate) fn decode_change(bytes: &[u8], offset: usize) -> Result<ChangeView<'_>, DecodeError> {
    let mut r = Reader {
        rest: bytes.get(offset..).unwrap_or_default(),
    };
    let change = match r.u32()? {
        INVALIDATE => match Items::check(&mut r, false)? {
            Items { left: 0, .. } => ChangeView::Announce,
            items => ChangeView::Invalidate(items),
        },
        REFRESH => ChangeView::Refresh(Items::check(&mut r, true)?),
        CLEAR => ChangeView::Clear {
            version: r.option_u64()?,
        },
        other => {
            return Err(DecodeError::new(DecodeErrorKind::Malformed(format!(
                "unknown change variant {other}"
            ))));
        }
    };
    if !r.rest.is_empty() {
        return Err(DecodeError::new(DecodeErrorKind::TrailingBytes(
            r.rest.len(),
        )));
    }
    Ok(change)
}

/// Decodes a whole event.
#[cfg(test)]
pub(crate) fn decode(bytes: &[u8], limit: usize) -> Result<(Header<'_>, Change), DecodeError> {
    decode_ext(bytes, limit).map(|(header, _, change)| (header, change))
}

/// Decodes a whole event, its extension included.
#[cfg(test)]
pub(crate) fn decode_ext(
    bytes: &[u8],
    limit: usize,
) -> Result<(Header<'_>, HeaderExt, Change), DecodeError> {
    let (header, ext, offset) = decode_header_ext(bytes, limit, None)?;
    Ok((header, ext, decode_change(bytes, offset)?.to_change()))
}

/// Encodes one key or value.
pub(crate) fn encode_part<T: Serialize + ?Sized>(value: &T, what: &'static str) -> Result<Bytes> {
    bincode::serde::encode_to_vec(value, wire_config())
        .map(Bytes::from)
        .map_err(|e| Error::Encode {
            what,
            message: e.to_string(),
        })
}

/// Decodes one key or value into the cache's type, rejecting trailing bytes.
pub(crate) fn decode_part<T: DeserializeOwned>(
    bytes: &[u8],
    what: &'static str,
) -> Result<T, DecodeError> {
    let mismatch =
        |message: String| DecodeError::new(DecodeErrorKind::TypeMismatch { what, message });
    let (value, used) = bincode::serde::decode_from_slice::<T, _>(bytes, wire_config())
        .map_err(|e| mismatch(e.to_string()))?;
    if used != bytes.len() {
        return Err(mismatch(format!(
            "{} trailing bytes",
            bytes.len().saturating_sub(used)
        )));
    }
    Ok(value)
}

/// Encoded size of a key or entry inside a change, used to split batches
/// before they exceed the event limit. Over-estimates the varint prefixes.
#[cfg(any(test, feature = "_sql", feature = "mysql-cdc", feature = "_fuzz"))]
pub(crate) fn framed_len(parts: &[&Bytes]) -> usize {
    parts.iter().fold(10usize, |sum, p| {
        sum.saturating_add(p.len().saturating_add(9))
    })
}

/// [`framed_len`] of parts of these lengths.
fn framed_len_of(lens: &[usize]) -> usize {
    lens.iter()
        .fold(10usize, |sum, n| sum.saturating_add(n.saturating_add(9)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header() -> Header<'static> {
        Header {
            cache: "countries",
            origin: Origin(b"node-1"),
            publisher: 42,
            seq: 7,
            published_at_us: 1_700_000_000_000_000,
        }
    }

    fn refresh() -> Change {
        Change::Refresh {
            entries: vec![EntryVersion {
                key: encode_part("de", "key").unwrap(),
                value: encode_part("Germany", "value").unwrap(),
                version: Some(3),
            }],
        }
    }

    #[test]
    fn round_trips() {
        for change in [
            refresh(),
            Change::Invalidate {
                keys: vec![KeyVersion {
                    key: encode_part(&1u32, "key").unwrap(),
                    version: None,
                }],
            },
            Change::Clear { version: Some(9) },
        ] {
            let bytes = encode(&header(), &change).unwrap();
            assert_eq!(
                decode(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap(),
                (header(), change)
            );
        }
    }

    /// An empty extension is written as version 1, which older nodes read;
    /// any field in it makes the event version 2, and both read back whole.
    #[test]
    fn the_extension_round_trips_and_picks_the_format() {
        let plain = encode(&header(), &refresh()).unwrap();
        assert_eq!(plain[0], FORMAT_V1);
        assert_eq!(
            decode_ext(&plain, DEFAULT_MAX_EVENT_BYTES).unwrap(),
            (header(), HeaderExt::default(), refresh())
        );
        for ext in [
            HeaderExt {
                since_prev_us: Some(0),
                ..HeaderExt::default()
            },
            HeaderExt {
                since_prev_us: None,
                fence: Some(Fence {
                    scope: u64::MAX,
                    term: 1,
                }),
                ..HeaderExt::default()
            },
            HeaderExt {
                since_prev_us: Some(u64::MAX),
                fence: Some(Fence {
                    scope: 7,
                    term: u64::MAX,
                }),
                ..HeaderExt::default()
            },
        ] {
            let bytes = encode_ext(&header(), &ext, &refresh()).unwrap();
            assert_eq!(bytes[0], FORMAT_V2);
            assert_eq!(
                decode_ext(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap(),
                (header(), ext, refresh())
            );
        }
        // A watermark makes it version 3, whatever else it holds.
        for since_prev_us in [None, Some(u64::MAX)] {
            let ext = HeaderExt {
                since_prev_us,
                watermark: Some(Watermark {
                    source: u64::MAX,
                    epoch: 0,
                    number: 0,
                    acked_after_us: None,
                }),
                ..HeaderExt::default()
            };
            let bytes = encode_ext(&header(), &ext, &Change::ANNOUNCE).unwrap();
            assert_eq!(bytes[0], FORMAT_V3);
            assert_eq!(
                decode_ext(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap(),
                (header(), ext, Change::ANNOUNCE)
            );
            // Version 3 with its watermark's tag at 0 (absent) or 2: refused.
            // From the end: the change (kind, no items: 2 bytes), the ack
            // (none: 1 byte), the number and epoch (0: 1 byte each), the
            // source (u64::MAX: 9 bytes), then the tag.
            let at = bytes.len() - 2 - 1 - 1 - 1 - 9 - 1;
            for tag in [0u8, 2] {
                let mut bad = bytes.clone();
                assert_eq!(bad[at], 1, "the watermark's tag");
                bad[at] = tag;
                assert!(decode_ext(&bad, DEFAULT_MAX_EVENT_BYTES).is_err());
            }
        }
    }

    /// An announcement is an empty invalidation on the wire, so a node
    /// built before announcements reads it as a change of nothing; this
    /// build reads it as `Announce`, and a non-empty one as before.
    #[test]
    fn an_announcement_is_an_empty_invalidation() {
        let bytes = encode(&header(), &Change::ANNOUNCE).unwrap();
        let empty = encode(&header(), &Change::Invalidate { keys: Vec::new() }).unwrap();
        assert_eq!(bytes, empty);
        let (h, body) = decode_header(&bytes, DEFAULT_MAX_EVENT_BYTES).unwrap();
        assert_eq!(h, header());
        let view = decode_change(&bytes, body).unwrap();
        assert!(matches!(view, ChangeView::Announce), "{view:?}");
        assert_eq!(view.to_change(), Change::ANNOUNCE);
        let one = Change::Invalidate {
            keys: vec![KeyVersion {
                key: encode_part(&1u32, "key").unwrap(),
                version: None,
            }],
        };
        let bytes = encode(&header(), &one).unwrap();
        let view = decode_change(&bytes, body).unwrap();
        assert!(matches!(view, ChangeView::Invalidate(_)), "{view:?}");
    }

    fn kind(bytes: &[u8], limit: usize) -> DecodeErrorKind {
        decode(bytes, limit).unwrap_err().kind
    }

    #[test]
    fn rejects_unknown_format_empty_oversized_and_trailing() {
        let mut bytes = encode(&header(), &refresh()).unwrap();
        assert_eq!(kind(&[], 1024), DecodeErrorKind::Empty);
        assert!(matches!(
            kind(&bytes, 10),
            DecodeErrorKind::TooLarge { limit: 10, .. }
        ));
        bytes.push(0);
        assert_eq!(kind(&bytes, 1024), DecodeErrorKind::TrailingBytes(1));
        bytes[0] = 4;
        assert_eq!(kind(&bytes, 1024), DecodeErrorKind::UnknownFormat(4));
    }

    #[test]
    fn rejects_every_truncation() {
        let bytes = encode(&header(), &refresh()).unwrap();
        for cut in 1..bytes.len() {
            let k = kind(&bytes[..cut], 1024);
            assert!(
                matches!(k, DecodeErrorKind::Malformed(_)),
                "cut at {cut}: {k:?}"
            );
        }
    }

    #[test]
    fn forged_length_prefix_is_rejected_without_allocating_it() {
        // A 20-byte payload whose cache-name length claims 2^62 bytes.
        let mut bytes = vec![FORMAT_V1];
        bytes.push(253); // bincode varint marker: a u64 follows
        bytes.extend((1u64 << 62).to_le_bytes());
        bytes.extend([0u8; 11]);
        assert!(matches!(kind(&bytes, 1024), DecodeErrorKind::Malformed(_)));
    }

    #[test]
    fn parts_reject_wrong_types() {
        let b = encode_part("not a number", "value").unwrap();
        let err = decode_part::<u64>(&b, "value").unwrap_err();
        assert!(matches!(
            err.kind,
            DecodeErrorKind::TypeMismatch { what: "value", .. }
        ));
        let b = encode_part(&(1u8, 2u8), "key").unwrap();
        assert!(
            decode_part::<u8>(&b, "key").is_err(),
            "trailing bytes must not be ignored"
        );
    }

    #[test]
    fn framed_len_bounds_the_real_size() {
        let e = match refresh() {
            Change::Refresh { entries } => entries,
            _ => unreachable!(),
        };
        let real = encode(&header(), &Change::Refresh { entries: e.clone() })
            .unwrap()
            .len()
            - encode(&header(), &Change::Refresh { entries: vec![] })
                .unwrap()
                .len();
        assert!(framed_len(&[&e[0].key, &e[0].value]) >= real);
    }

    /// bincode's own reading of an event, format byte included: the
    /// reference the hand-written reader must agree with.
    fn bincode_decode(bytes: &[u8]) -> Option<(Header<'_>, HeaderExt, Change)> {
        let config = wire_config();
        let (&format, rest) = bytes.split_first()?;
        let (header, used) =
            bincode::serde::borrow_decode_from_slice::<Header<'_>, _>(rest, config).ok()?;
        let mut rest = &rest[used..];
        let ext = match format {
            FORMAT_V1 => HeaderExt::default(),
            FORMAT_V2 => {
                let ((since_prev_us, fence), used) = bincode::serde::decode_from_slice::<
                    (Option<u64>, Option<Fence>),
                    _,
                >(rest, config)
                .ok()?;
                rest = &rest[used..];
                HeaderExt {
                    since_prev_us,
                    fence,
                    watermark: None,
                }
            }
            FORMAT_V3 => {
                let (ext, used) =
                    bincode::serde::decode_from_slice::<HeaderExt, _>(rest, config).ok()?;
                rest = &rest[used..];
                // Version 3 always carries one (see `decode_header_ext`).
                ext.watermark?;
                ext
            }
            _ => return None,
        };
        let (change, used) = bincode::serde::decode_from_slice::<Change, _>(rest, config).ok()?;
        (used == rest.len()).then_some((header, ext, change))
    }

    fn arbitrary_ext() -> impl Strategy<Value = HeaderExt> {
        let number = prop_oneof![0u64..300, any::<u64>(), Just(u64::MAX)];
        (
            proptest::option::of(number.clone()),
            proptest::option::of((number.clone(), number.clone())),
            proptest::option::of((
                number.clone(),
                number.clone(),
                number.clone(),
                proptest::option::of(number),
            )),
        )
            .prop_map(|(since_prev_us, fence, watermark)| HeaderExt {
                since_prev_us,
                fence: fence.map(|(scope, term)| Fence { scope, term }),
                watermark: watermark.map(|(source, epoch, number, acked_after_us)| Watermark {
                    source,
                    epoch,
                    number,
                    acked_after_us,
                }),
            })
    }

    fn arbitrary_event() -> impl Strategy<Value = (String, String, u64, u64, u64, Change)> {
        let version = proptest::option::of(prop_oneof![
            0u64..300,
            Just(u64::MAX),
            any::<u64>(),
            (0u64..70_000)
        ]);
        let part = proptest::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from);
        let change = prop_oneof![
            proptest::collection::vec((part.clone(), version.clone()), 0..4).prop_map(|k| {
                Change::Invalidate {
                    keys: k
                        .into_iter()
                        .map(|(key, version)| KeyVersion { key, version })
                        .collect(),
                }
            }),
            proptest::collection::vec((part.clone(), part, version.clone()), 0..4).prop_map(|e| {
                Change::Refresh {
                    entries: e
                        .into_iter()
                        .map(|(key, value, version)| EntryVersion {
                            key,
                            value,
                            version,
                        })
                        .collect(),
                }
            }),
            version.prop_map(|version| Change::Clear { version }),
        ];
        let number = prop_oneof![0u64..300, any::<u64>(), Just(u64::MAX)];
        (
            "\\PC{0,40}",
            "\\PC{0,300}",
            number.clone(),
            number.clone(),
            number,
            change,
        )
    }

    /// Every single-byte change of events of each kind, at every position:
    /// the reader agrees with bincode on each.
    #[test]
    fn the_reader_agrees_with_bincode_on_every_byte_changed() {
        let changes = [
            refresh(),
            Change::Invalidate {
                keys: vec![KeyVersion {
                    key: encode_part(&300u32, "key").unwrap(),
                    version: Some(70_000),
                }],
            },
            Change::Clear {
                version: Some(u64::MAX),
            },
            Change::Clear { version: None },
        ];
        let ext = HeaderExt {
            since_prev_us: Some(70_000),
            fence: Some(Fence {
                scope: u64::MAX,
                term: 300,
            }),
            watermark: None,
        };
        let marked = HeaderExt {
            watermark: Some(Watermark {
                source: 70_000,
                epoch: u64::MAX,
                number: 300,
                acked_after_us: Some(u64::MAX),
            }),
            ..ext
        };
        for change in changes {
            for ext in [HeaderExt::default(), ext, marked] {
                let bytes = encode_ext(&header(), &ext, &change).unwrap();
                for i in 0..bytes.len() {
                    for b in 0..=255u8 {
                        let mut changed = bytes.clone();
                        changed[i] = b;
                        assert_eq!(
                            decode_ext(&changed, MAX_EVENT_BYTES_CEILING).ok(),
                            bincode_decode(&changed),
                            "byte {i} set to {b} in {change:?}, {ext:?}"
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        /// The hand-written reader reads exactly what bincode reads, and
        /// refuses exactly what bincode refuses: on encoded events, and on
        /// those events cut short or with a byte changed.
        #[test]
        fn the_reader_agrees_with_bincode(
            (cache, origin, publisher, seq, at, change) in arbitrary_event(),
            ext in arbitrary_ext(),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            byte in any::<u8>(),
            how in 0u8..3,
        ) {
            let header = Header { cache: &cache, origin: Origin(origin.as_bytes()), publisher, seq, published_at_us: at };
            let mut bytes = encode_ext(&header, &ext, &change).unwrap();
            match how {
                0 => {}
                1 => bytes.truncate(1 + cut.index(bytes.len())),
                _ => {
                    let i = flip.index(bytes.len());
                    bytes[i] = byte;
                }
            }
            let ours = decode_ext(&bytes, MAX_EVENT_BYTES_CEILING).ok();
            let theirs = bincode_decode(&bytes);
            prop_assert_eq!(&ours, &theirs);
            if how == 0 {
                prop_assert_eq!(ours, Some((header, ext, change)));
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes, 4096);
            let _ = decode_part::<(String, Vec<u64>)>(&bytes, "value");
        }

        #[test]
        fn mutated_events_never_panic(flip in 0usize..200, byte in any::<u8>()) {
            let mut bytes = encode(&header(), &refresh()).unwrap();
            let i = flip % bytes.len();
            bytes[i] = byte;
            if let Ok((_, Change::Refresh { entries })) = decode(&bytes, 4096) {
                for e in entries {
                    let _ = decode_part::<String>(&e.key, "key");
                    let _ = decode_part::<String>(&e.value, "value");
                }
            }
        }
    }
}
