//! The envelope, sealed and opened in one place: the format byte, the header,
//! the change, the optional signed frame, and the size limit over all of them.

use super::keyring::SIGNED_OVERHEAD;
use super::outgoing::{Body, encode_body};
#[cfg(test)]
use super::{Change, encode_ext};
use super::{
    ChangeView, Header, HeaderExt, Keyring, MAX_NAME_BYTES, decode_change, decode_header,
    decode_header_ext, strip_unverified,
};
use crate::error::{DecodeError, DecodeErrorKind, Error, Result};

/// Room the header takes besides the origin: the cache name (at most
/// `MAX_NAME_BYTES`), the three numbers as varints (at most 9 bytes each),
/// the two length prefixes, the extension (two option tags and three
/// numbers), the format byte and the change's variant tag, rounded up.
const HEADER_OVERHEAD: usize = MAX_NAME_BYTES + 96;

/// The first byte of a heartbeat message (see `cluster`), where an event
/// has its format byte: `H`.
const FORMAT_HEARTBEAT: u8 = b'H';

/// The first byte of an answer to an acknowledgement request, then the
/// asking party's id (8 bytes, little-endian): every party on the channel
/// receives every answer, and all but the asker skip it on those bytes,
/// unparsed and unverified (skipping changes nothing), so an acknowledged
/// publish costs the other parties nothing to decode.
const FORMAT_ACK: u8 = b'A';

/// The limit on one heartbeat message, whatever the event limit: a node
/// with a tight `max_event_bytes` must still send its heartbeat (one per
/// cache is some hundred bytes), and nodes with different event limits
/// must still read each other's. Fixed, so every party agrees.
pub(crate) const MAX_HEARTBEAT_BYTES: usize = 1 << 20;

/// How a publisher seals and a node opens events: the size limit and, when
/// signing or verifying, the keyring. A publisher made by a node shares the
/// node's codec, so what one seals the other opens.
#[derive(Debug, Clone)]
pub(crate) struct Codec {
    max_bytes: usize,
    keyring: Option<Keyring>,
}

/// An event whose envelope is authentic (or not checked, on a node that does
/// not verify) and whose header decoded.
#[derive(Debug)]
pub(crate) struct Opened<'a> {
    pub(crate) header: Header<'a>,
    pub(crate) ext: HeaderExt,
    event: &'a [u8],
    body: usize,
}

impl<'a> Opened<'a> {
    /// Reads and checks the change that follows the header.
    pub(crate) fn change(&self) -> Result<ChangeView<'a>, DecodeError> {
        decode_change(self.event, self.body)
    }
}

/// What a payload on the heartbeat channel holds (see
/// [`Codec::open_channel`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Channel<'a> {
    /// A heartbeat or a request, JSON.
    Message(&'a [u8]),
    /// An answer to an acknowledgement request, for the party `asker`.
    Ack { asker: u64, message: &'a [u8] },
}

/// Why a payload could not be opened.
#[derive(Debug)]
pub(crate) enum Refused<'a> {
    /// Unsigned, forged, tampered or signed with an unknown key, on a node
    /// that verifies: it must change nothing, or forgeries could flush
    /// caches at will.
    Unauthentic(DecodeError),
    /// Authentic (or not checked) but unreadable: over the size limit, or a
    /// header that does not decode. It may have carried a change; `event`
    /// is what is left once the signature is off, to salvage the header from
    /// (see [`Codec::salvage_header`]).
    Unreadable { error: DecodeError, event: &'a [u8] },
}

impl Codec {
    pub(crate) fn new(max_bytes: usize, keyring: Option<Keyring>) -> Self {
        Self { max_bytes, keyring }
    }

    /// How many bytes of keys and values (as `framed_len` counts them) one
    /// event from a publisher called `origin` can carry, so that a batch is
    /// split before its events outgrow the limit.
    pub(crate) fn entry_budget(&self, origin: &str) -> usize {
        let signed = if self.keyring.is_some() {
            SIGNED_OVERHEAD
        } else {
            0
        };
        self.max_bytes
            .saturating_sub(origin.len())
            .saturating_sub(HEADER_OVERHEAD)
            .saturating_sub(signed)
    }

    /// [`seal_ext`](Self::seal_ext) with an empty extension.
    #[cfg(test)]
    pub(crate) fn seal(&self, header: &Header<'_>, change: &Change) -> Result<Vec<u8>> {
        self.seal_ext(header, &HeaderExt::default(), change)
    }

    /// The bytes to publish: encoded (with the header's extension), signed
    /// when there is a keyring, and refused with [`Error::TooLarge`] over
    /// the limit.
    #[cfg(test)]
    pub(crate) fn seal_ext(
        &self,
        header: &Header<'_>,
        ext: &HeaderExt,
        change: &Change,
    ) -> Result<Vec<u8>> {
        let mut payload = encode_ext(header, ext, change)?;
        if let Some(ring) = &self.keyring {
            payload = ring.sign(&payload);
        }
        if payload.len() > self.max_bytes {
            return Err(Error::TooLarge {
                what: "event",
                size: payload.len(),
                limit: self.max_bytes,
            });
        }
        Ok(payload)
    }

    /// `seal_ext` for a publisher's change in its wire
    /// form: the same bytes, written into a buffer of exactly their size.
    pub(crate) fn seal_body(
        &self,
        header: &Header<'_>,
        ext: &HeaderExt,
        body: Body<'_>,
    ) -> Result<Vec<u8>> {
        let mut payload = encode_body(header, ext, body);
        if let Some(ring) = &self.keyring {
            payload = ring.sign(&payload);
        }
        if payload.len() > self.max_bytes {
            return Err(Error::TooLarge {
                what: "event",
                size: payload.len(),
                limit: self.max_bytes,
            });
        }
        Ok(payload)
    }

    /// Authenticates a delivered payload first (before its size, and before
    /// anything in it is parsed), then checks the limit and reads the header.
    /// `tag` is the cache name the transport says the event is for, if it
    /// says: only a hint that saves checking the same name again.
    pub(crate) fn open<'a>(
        &self,
        payload: &'a [u8],
        tag: Option<&'a str>,
    ) -> Result<Opened<'a>, Refused<'a>> {
        let event = match &self.keyring {
            Some(ring) => ring.open(payload).map_err(Refused::Unauthentic)?,
            // A publisher may sign before its nodes verify.
            None => strip_unverified(payload),
        };
        if payload.len() > self.max_bytes {
            let error = DecodeError::new(DecodeErrorKind::TooLarge {
                size: payload.len(),
                limit: self.max_bytes,
            });
            return Err(Refused::Unreadable { error, event });
        }
        match decode_header_ext(event, self.max_bytes, tag) {
            Ok((header, ext, body)) => Ok(Opened {
                header,
                ext,
                event,
                body,
            }),
            Err(error) => Err(Refused::Unreadable { error, event }),
        }
    }

    /// A heartbeat message to publish: the heartbeat format byte and the
    /// message, signed when there is a keyring (the format byte keeps a
    /// signed heartbeat from ever opening as an event, and the other way
    /// round), refused with [`Error::TooLarge`] over the limit.
    pub(crate) fn seal_heartbeat(&self, message: &[u8]) -> Result<Vec<u8>> {
        self.seal_on_channel(&[FORMAT_HEARTBEAT], message, "heartbeat")
    }

    /// An answer for the party `asker` to publish on the heartbeat channel:
    /// the ack format byte, `asker`, the message, signed when there is a
    /// keyring, refused with [`Error::TooLarge`] over the heartbeat limit.
    pub(crate) fn seal_ack(&self, asker: u64, message: &[u8]) -> Result<Vec<u8>> {
        let mut prefix = [FORMAT_ACK; 9];
        prefix[1..].copy_from_slice(&asker.to_le_bytes());
        self.seal_on_channel(&prefix, message, "acknowledgement")
    }

    fn seal_on_channel(
        &self,
        prefix: &[u8],
        message: &[u8],
        what: &'static str,
    ) -> Result<Vec<u8>> {
        let mut payload = Vec::with_capacity(message.len().saturating_add(prefix.len()));
        payload.extend_from_slice(prefix);
        payload.extend_from_slice(message);
        if let Some(ring) = &self.keyring {
            payload = ring.sign(&payload);
        }
        if payload.len() > MAX_HEARTBEAT_BYTES {
            return Err(Error::TooLarge {
                what,
                size: payload.len(),
                limit: MAX_HEARTBEAT_BYTES,
            });
        }
        Ok(payload)
    }

    /// The party an answer on the heartbeat channel is for, read without
    /// verifying anything: only to skip answers for others. `None` for
    /// anything that is not an answer.
    pub(crate) fn ack_for(payload: &[u8]) -> Option<u64> {
        match strip_unverified(payload).split_first() {
            Some((&FORMAT_ACK, rest)) => rest.first_chunk().map(|b| u64::from_le_bytes(*b)),
            _ => None,
        }
    }

    /// What a delivered payload on the heartbeat channel holds, once
    /// authenticated (when verifying) and checked for its size: a message
    /// (`H`), or an answer (`A`) with the asker it names.
    pub(crate) fn open_channel<'a>(&self, payload: &'a [u8]) -> Result<Channel<'a>, DecodeError> {
        let inner = match &self.keyring {
            Some(ring) => ring.open(payload)?,
            None => strip_unverified(payload),
        };
        if payload.len() > MAX_HEARTBEAT_BYTES {
            return Err(DecodeError::new(DecodeErrorKind::TooLarge {
                size: payload.len(),
                limit: MAX_HEARTBEAT_BYTES,
            }));
        }
        match inner.split_first() {
            Some((&FORMAT_HEARTBEAT, message)) => Ok(Channel::Message(message)),
            Some((&FORMAT_ACK, rest)) => match rest.split_first_chunk() {
                Some((asker, message)) => Ok(Channel::Ack {
                    asker: u64::from_le_bytes(*asker),
                    message,
                }),
                None => Err(DecodeError::new(DecodeErrorKind::Malformed(
                    "acknowledgement without its asker".into(),
                ))),
            },
            Some((&format, _)) => Err(DecodeError::new(DecodeErrorKind::UnknownFormat(format))),
            None => Err(DecodeError::new(DecodeErrorKind::Empty)),
        }
    }

    /// The header of an event that could not be opened, read from its front
    /// (an oversized event's header is still small), if it decodes.
    pub(crate) fn salvage_header<'a>(&self, event: &'a [u8]) -> Option<Header<'a>> {
        let front = event.get(..self.max_bytes).unwrap_or(event);
        decode_header(front, self.max_bytes).ok().map(|(h, _)| h)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::wire::{EntryVersion, framed_len};

    fn header<'a>(cache: &'a str, origin: &'a str) -> Header<'a> {
        Header {
            cache,
            origin: crate::wire::Origin(origin.as_bytes()),
            publisher: u64::MAX,
            seq: u64::MAX,
            published_at_us: u64::MAX,
        }
    }

    fn ring(id_len: usize) -> Keyring {
        Keyring::new("k".repeat(id_len), b"sixteen byte key".to_vec()).unwrap()
    }

    /// The budget is what the publisher splits batches by: an event filled
    /// to it, with the longest names and numbers, must still seal.
    #[test]
    fn an_event_filled_to_the_budget_seals_under_the_limit() {
        for signed in [false, true] {
            for max in [600usize, 1000, 4096, 1 << 20] {
                let codec = Codec::new(max, signed.then(|| ring(255)));
                let origin = "o".repeat(255);
                let budget = codec.entry_budget(&origin);
                // One entry whose framed size is exactly the budget.
                let key = Bytes::from_static(b"k");
                let Some(room) = budget.checked_sub(framed_len(&[&key, &Bytes::new()])) else {
                    continue;
                };
                let value = Bytes::from(vec![7u8; room]);
                assert_eq!(framed_len(&[&key, &value]), budget);
                let change = Change::Refresh {
                    entries: vec![EntryVersion {
                        key,
                        value,
                        version: Some(u64::MAX),
                    }],
                };
                // The largest extension an event with entries has.
                let ext = HeaderExt {
                    since_prev_us: Some(u64::MAX),
                    fence: Some(crate::wire::Fence {
                        scope: u64::MAX,
                        term: u64::MAX,
                    }),
                    // Only on announcements, which carry no entries.
                    watermark: None,
                };
                let sealed = codec
                    .seal_ext(&header(&"c".repeat(255), &origin), &ext, &change)
                    .unwrap_or_else(|e| panic!("signed {signed}, limit {max}: {e}"));
                assert!(sealed.len() <= max);
            }
        }
    }

    #[test]
    fn what_one_codec_seals_the_same_codec_opens() {
        for keyring in [None, Some(ring(3))] {
            let codec = Codec::new(1 << 10, keyring);
            let change = Change::Clear { version: Some(9) };
            let sealed = codec.seal(&header("countries", "admin"), &change).unwrap();
            let opened = codec.open(&sealed, None).unwrap();
            assert_eq!(opened.header, header("countries", "admin"));
            assert_eq!(opened.change().unwrap().to_change(), change);
        }
    }

    #[test]
    fn a_verifying_codec_refuses_unsigned_events_as_unauthentic() {
        let plain = Codec::new(1 << 10, None);
        let verifying = Codec::new(1 << 10, Some(ring(3)));
        let sealed = plain
            .seal(&header("t", "o"), &Change::Clear { version: None })
            .unwrap();
        assert!(matches!(
            verifying.open(&sealed, None),
            Err(Refused::Unauthentic(_))
        ));
        // A node that does not verify reads signed events too.
        let signed = verifying
            .seal(&header("t", "o"), &Change::Clear { version: None })
            .unwrap();
        assert!(plain.open(&signed, None).is_ok());
    }

    #[test]
    fn oversized_events_are_unreadable_but_their_header_is_salvaged() {
        let big = Codec::new(1 << 16, None);
        let small = Codec::new(64, None);
        let change = Change::Refresh {
            entries: vec![EntryVersion {
                key: Bytes::from_static(b"k"),
                value: Bytes::from(vec![0u8; 1000]),
                version: None,
            }],
        };
        let sealed = big.seal(&header("t", "o"), &change).unwrap();
        let Err(Refused::Unreadable { error, event }) = small.open(&sealed, None) else {
            panic!("an oversized event opened");
        };
        assert!(matches!(error.kind(), DecodeErrorKind::TooLarge { .. }));
        assert_eq!(small.salvage_header(event), Some(header("t", "o")));
        assert!(matches!(
            small.seal(&header("t", "o"), &change),
            Err(Error::TooLarge { what: "event", .. })
        ));
    }
}
