//! Changes in their wire form, as a publisher sends them.
//!
//! A publish used to build a [`Change`] (a `Vec` of changes, a `Vec` of
//! entries, a `Bytes` per key and per value), encode it through bincode's
//! serde layer into a growing `Vec`, and hand that over as a `Bytes`, which
//! allocated once more because the `Vec`'s capacity was not its length:
//! twelve allocations for a one-entry publish besides the transport's. Here
//! the items of every event of a publish are encoded once, back to back,
//! into one buffer, in exactly the bytes bincode writes for `Change`'s
//! items, and each event is written into a buffer of exactly its size, so
//! the `Bytes` made from it takes the buffer over without allocating. The
//! bytes on the wire do not change: tests compare them with bincode's
//! encoding of the same `Change`, header and extension.

use serde::Serialize;

#[cfg(any(test, feature = "_sql", feature = "mysql-cdc"))]
use super::Change;
use super::reader::Reader;
use super::writer::{
    bytes_len, option_len, put_bytes, put_option, put_part, put_varint, varint_len,
};
use super::{CLEAR, FORMAT_V1, Header, HeaderExt, INVALIDATE, REFRESH, framed_len_of};
use crate::error::{Error, Result};

thread_local! {
    /// A cleared items buffer, given back by the last publish on this
    /// thread. Taken out whole, never borrowed across an await: a publish
    /// that resumes on another thread gives its buffer back there.
    static SPARE: std::cell::Cell<Option<Vec<u8>>> = const { std::cell::Cell::new(None) };
}

/// The largest items buffer kept for reuse: a few small publishes' worth.
const SPARE_MAX: usize = 4096;

/// The changes of one publish, each to become one event, in order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outgoing {
    /// Every event's items (a clear's version), back to back, as on the wire.
    bytes: Vec<u8>,
    /// The first event, inline: a publish is usually one event, which then
    /// needs no list.
    first: Option<Event>,
    /// The events after the first.
    more: Vec<Event>,
}

/// Where one event's items end in [`Outgoing::bytes`] (they begin where
/// the previous event's end), what kind of change it is and how many items.
#[derive(Debug, Clone, Copy)]
struct Event {
    kind: u32,
    items: u64,
    end: usize,
}

/// One event's change, as [`encode_body`] writes it after the header.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Body<'a> {
    /// `Change`'s variant index.
    kind: u32,
    /// How many keys or entries (not written for a clear).
    items: u64,
    /// The items, or a clear's version, encoded.
    bytes: &'a [u8],
}

impl Body<'_> {
    /// An announcement: an invalidation of no key (see the module docs of `wire`).
    pub(crate) const ANNOUNCE: Body<'static> = Body {
        kind: INVALIDATE,
        items: 0,
        bytes: &[],
    };
}

impl Outgoing {
    /// A clear, at `version` if any.
    pub(crate) fn clear(version: Option<u64>) -> Self {
        let mut out = Outgoing::with_room();
        put_option(&mut out.bytes, version);
        out.push(CLEAR, 0);
        out
    }

    /// Installs these entries, each at its version if any, packed into as
    /// few events as fit `budget` bytes of items each (as `framed_len`
    /// counts them). An entry that can never fit is [`Error::TooLarge`].
    pub(crate) fn refreshes<K: Serialize, V: Serialize>(
        entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
        budget: usize,
    ) -> Result<Self> {
        let mut out = Outgoing::with_room();
        let mut pack = Packer::new(REFRESH, budget);
        for (k, v, version) in entries {
            let at = out.bytes.len();
            let key = put_part(&mut out.bytes, &k, "key")?;
            let value = put_part(&mut out.bytes, &v, "value")?;
            put_option(&mut out.bytes, version);
            pack.item(&mut out, at, framed_len_of(&[key, value]));
        }
        pack.finish(out)
    }

    /// Drops `keys`, each at its version if any, packed as
    /// [`refreshes`](Self::refreshes) packs entries.
    pub(crate) fn invalidations<K: Serialize>(
        keys: impl IntoIterator<Item = (K, Option<u64>)>,
        budget: usize,
    ) -> Result<Self> {
        let mut out = Outgoing::with_room();
        let mut pack = Packer::new(INVALIDATE, budget);
        for (k, version) in keys {
            let at = out.bytes.len();
            let key = put_part(&mut out.bytes, &k, "key")?;
            put_option(&mut out.bytes, version);
            pack.item(&mut out, at, framed_len_of(&[key]));
        }
        pack.finish(out)
    }

    /// A table replaced wholesale: a clear at `version` first, so rows the
    /// new table lacks disappear and no older refresh can return, then the
    /// rows at the same version.
    pub(crate) fn replacement<'a, K: Serialize + 'a, V: Serialize + 'a>(
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
        version: u64,
        budget: usize,
    ) -> Result<Self> {
        let mut out = Outgoing::clear(Some(version));
        let rows =
            Outgoing::refreshes(rows.into_iter().map(|(k, r)| (k, r, Some(version))), budget)?;
        out.append(rows);
        Ok(out)
    }

    /// Changes built elsewhere (an outbox's rows, a CDC relay's), already
    /// split to the limit: one event each.
    #[cfg(any(feature = "_sql", feature = "mysql-cdc"))]
    pub(crate) fn from_changes(changes: Vec<Change>) -> Self {
        let mut out = Outgoing::default();
        for change in changes {
            out.put_change(&change);
        }
        out
    }

    /// One change as one more event.
    #[cfg(any(test, feature = "_sql", feature = "mysql-cdc"))]
    pub(crate) fn put_change(&mut self, change: &Change) {
        let (kind, items) = match change {
            Change::Invalidate { keys } => {
                for k in keys {
                    put_bytes(&mut self.bytes, &k.key);
                    put_option(&mut self.bytes, k.version);
                }
                (INVALIDATE, keys.len())
            }
            Change::Refresh { entries } => {
                for e in entries {
                    put_bytes(&mut self.bytes, &e.key);
                    put_bytes(&mut self.bytes, &e.value);
                    put_option(&mut self.bytes, e.version);
                }
                (REFRESH, entries.len())
            }
            Change::Clear { version } => {
                put_option(&mut self.bytes, *version);
                (CLEAR, 0)
            }
        };
        self.push(kind, u64::try_from(items).unwrap_or(u64::MAX));
    }

    /// What a second, delayed send of these changes says (see
    /// `PublisherBuilder::again_after`): each refresh becomes an
    /// invalidation of its keys at the same versions; invalidations and
    /// clears stay as they are. One event each, as before.
    pub(crate) fn into_invalidation(self) -> Outgoing {
        if self.events().all(|e| e.kind != REFRESH) {
            return self;
        }
        let mut out = Outgoing {
            bytes: Vec::with_capacity(self.bytes.len()),
            ..Outgoing::default()
        };
        for body in self.events() {
            if body.kind != REFRESH {
                out.bytes.extend_from_slice(body.bytes);
                out.push(body.kind, body.items);
                continue;
            }
            let mut r = Reader { rest: body.bytes };
            let mut items = 0u64;
            // These bytes were written above, so every read succeeds; were
            // one to fail, the event would end there, its count still right.
            while !r.rest.is_empty() {
                let (Ok(key), Ok(_value), Ok(version)) = (r.bytes(), r.bytes(), r.option_u64())
                else {
                    break;
                };
                put_bytes(&mut out.bytes, key);
                put_option(&mut out.bytes, version);
                items = items.saturating_add(1);
            }
            out.push(INVALIDATE, items);
        }
        out
    }

    /// The events, in order.
    pub(crate) fn events(&self) -> impl Iterator<Item = Body<'_>> {
        let mut start = 0;
        self.first.iter().chain(self.more.iter()).map(move |e| {
            let bytes = self.bytes.get(start..e.end).unwrap_or_default();
            start = e.end;
            Body {
                kind: e.kind,
                items: e.items,
                bytes,
            }
        })
    }

    /// An empty buffer with room for a small entry or two, so that
    /// encoding one does not grow it step by step (each step a
    /// reallocation): one that an earlier publish on this thread gave
    /// back ([`recycle`](Self::recycle)), or a new one.
    fn with_room() -> Self {
        let bytes = SPARE
            .try_with(|spare| spare.take())
            .ok()
            .flatten()
            .unwrap_or_else(|| Vec::with_capacity(64));
        Outgoing {
            bytes,
            ..Outgoing::default()
        }
    }

    /// Gives the items' buffer back once the events are sent, for the
    /// next publish on this thread to encode into: a publish then
    /// allocates only the event it hands to the transport. A buffer grown
    /// past [`SPARE_MAX`] is freed instead, so a large batch once does not
    /// keep its memory for good.
    pub(crate) fn recycle(self) {
        let mut bytes = self.bytes;
        if bytes.capacity() > SPARE_MAX || bytes.capacity() == 0 {
            return;
        }
        bytes.clear();
        // A thread being torn down has no slot left: the buffer is freed.
        let _ = SPARE.try_with(|spare| spare.set(Some(bytes)));
    }

    /// Ends an event at the end of the bytes written so far.
    fn push(&mut self, kind: u32, items: u64) {
        self.push_at(kind, items, self.bytes.len());
    }

    fn push_at(&mut self, kind: u32, items: u64, end: usize) {
        let event = Event { kind, items, end };
        if self.first.is_none() {
            self.first = Some(event);
        } else {
            self.more.push(event);
        }
    }

    /// `other`'s events after these.
    fn append(&mut self, other: Outgoing) {
        let offset = self.bytes.len();
        self.bytes.extend_from_slice(&other.bytes);
        for e in other.first.iter().chain(other.more.iter()) {
            self.push_at(e.kind, e.items, e.end.saturating_add(offset));
        }
    }
}

/// Packs items into events of at most `budget` bytes of items each, as
/// they are written: an item that does not fit the current event starts
/// the next one, whose bytes begin where the item's do.
struct Packer {
    kind: u32,
    budget: usize,
    /// Bytes of items (as `framed_len` counts them) in the current event.
    used: usize,
    /// Items in the current event.
    items: u64,
    /// The first item too large for any event: reported once every item
    /// is encoded, so that an item that does not encode is reported first,
    /// as when the items were all encoded before they were split.
    too_large: Option<(usize, usize)>,
}

impl Packer {
    fn new(kind: u32, budget: usize) -> Self {
        Packer {
            kind,
            budget,
            used: 0,
            items: 0,
            too_large: None,
        }
    }

    /// The item written from `at` to the end, of `size` bytes.
    fn item(&mut self, out: &mut Outgoing, at: usize, size: usize) {
        if self.too_large.is_some() {
            return;
        }
        if size > self.budget {
            self.too_large = Some((size, self.budget));
            return;
        }
        if self.used.saturating_add(size) > self.budget && self.items > 0 {
            out.push_at(self.kind, self.items, at);
            self.used = 0;
            self.items = 0;
        }
        self.used = self.used.saturating_add(size);
        self.items = self.items.saturating_add(1);
    }

    fn finish(self, mut out: Outgoing) -> Result<Outgoing> {
        if let Some((size, limit)) = self.too_large {
            return Err(Error::TooLarge {
                what: "entry",
                size,
                limit,
            });
        }
        if self.items > 0 {
            out.push(self.kind, self.items);
        }
        Ok(out)
    }
}

/// Writes one event: the format byte, the header, the extension (version
/// 2 only, as `encode_ext` decides), the change. Sized exactly first, so
/// the buffer is allocated once and full.
pub(crate) fn encode_body(header: &Header<'_>, ext: &HeaderExt, body: Body<'_>) -> Vec<u8> {
    let format = ext.format();
    let ext_len = if format == FORMAT_V1 {
        0
    } else {
        option_len(ext.since_prev_us)
            .saturating_add(match ext.fence {
                None => 1,
                Some(f) => 1usize
                    .saturating_add(varint_len(f.scope))
                    .saturating_add(varint_len(f.term)),
            })
            .saturating_add(match ext.watermark {
                None => 0,
                Some(w) => 1usize
                    .saturating_add(varint_len(w.source))
                    .saturating_add(varint_len(w.epoch))
                    .saturating_add(varint_len(w.number))
                    .saturating_add(option_len(w.acked_after_us)),
            })
    };
    let items_len = if body.kind == CLEAR {
        0
    } else {
        varint_len(body.items)
    };
    let len = [
        1,
        bytes_len(header.cache.len()),
        bytes_len(header.origin.0.len()),
        varint_len(header.publisher),
        varint_len(header.seq),
        varint_len(header.published_at_us),
        ext_len,
        varint_len(u64::from(body.kind)),
        items_len,
        body.bytes.len(),
    ]
    .iter()
    .fold(0usize, |sum, n| sum.saturating_add(*n));
    let mut out = Vec::with_capacity(len);
    out.push(format);
    put_bytes(&mut out, header.cache.as_bytes());
    put_bytes(&mut out, header.origin.0);
    put_varint(&mut out, header.publisher);
    put_varint(&mut out, header.seq);
    put_varint(&mut out, header.published_at_us);
    if format != FORMAT_V1 {
        put_option(&mut out, ext.since_prev_us);
        match ext.fence {
            None => out.push(0),
            Some(f) => {
                out.push(1);
                put_varint(&mut out, f.scope);
                put_varint(&mut out, f.term);
            }
        }
        if let Some(w) = ext.watermark {
            out.push(1);
            put_varint(&mut out, w.source);
            put_varint(&mut out, w.epoch);
            put_varint(&mut out, w.number);
            put_option(&mut out, w.acked_after_us);
        }
    }
    put_varint(&mut out, u64::from(body.kind));
    if body.kind != CLEAR {
        put_varint(&mut out, body.items);
    }
    out.extend_from_slice(body.bytes);
    debug_assert_eq!(out.len(), len, "the event's size was counted wrong");
    out
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use proptest::prelude::*;

    use super::*;
    use crate::wire::{
        EntryVersion, Fence, KeyVersion, Origin, Watermark, encode_ext, encode_part, framed_len,
    };

    fn header<'a>(cache: &'a str, origin: &'a [u8], n: [u64; 3]) -> Header<'a> {
        Header {
            cache,
            origin: Origin(origin),
            publisher: n[0],
            seq: n[1],
            published_at_us: n[2],
        }
    }

    /// Numbers at and around every varint width's edges.
    fn number() -> impl Strategy<Value = u64> {
        prop_oneof![
            0u64..300,
            prop::sample::select(vec![
                250,
                251,
                u64::from(u16::MAX) - 1,
                u64::from(u16::MAX),
                u64::from(u16::MAX) + 1,
                u64::from(u32::MAX),
                u64::from(u32::MAX) + 1,
                u64::MAX,
            ]),
            any::<u64>(),
        ]
    }

    fn ext() -> impl Strategy<Value = HeaderExt> {
        (
            prop::option::of(number()),
            prop::option::of((number(), number())),
            prop::option::of((number(), number(), number(), prop::option::of(number()))),
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

    /// Parts of every length class: short, and past 250 and 65 535 bytes.
    fn part() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            4 => prop::collection::vec(any::<u8>(), 0..300),
            1 => (0usize..3).prop_map(|n| vec![7u8; 65_530 + n * 3]),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// What `encode_body` writes is byte for byte what bincode writes
        /// for the same header, extension and change.
        #[test]
        fn events_are_what_bincode_writes(
            cache in "[a-z]{0,20}",
            origin in prop::collection::vec(any::<u8>(), 0..300),
            n in [number(), number(), number()],
            ext in ext(),
            items in prop::collection::vec((part(), part(), prop::option::of(number())), 0..4),
            kind in 0u32..3,
            clear in prop::option::of(number()),
        ) {
            let change = match kind {
                INVALIDATE => Change::Invalidate {
                    keys: items.iter().map(|(k, _, version)| KeyVersion {
                        key: Bytes::from(k.clone()),
                        version: *version,
                    }).collect(),
                },
                REFRESH => Change::Refresh {
                    entries: items.iter().map(|(k, v, version)| EntryVersion {
                        key: Bytes::from(k.clone()),
                        value: Bytes::from(v.clone()),
                        version: *version,
                    }).collect(),
                },
                _ => Change::Clear { version: clear },
            };
            let header = header(&cache, &origin, n);
            let mut out = Outgoing::default();
            out.put_change(&change);
            let bodies: Vec<_> = out.events().collect();
            prop_assert_eq!(bodies.len(), 1);
            let ours = encode_body(&header, &ext, bodies[0]);
            prop_assert_eq!(ours, encode_ext(&header, &ext, &change).unwrap());
        }

        /// Keys and values written in place are what `encode_part` makes,
        /// and the events split where `changes::split` would.
        #[test]
        fn refreshes_match_encoded_parts_and_split_by_the_budget(
            rows in prop::collection::vec(
                ("[a-z]{0,300}", prop::collection::vec(any::<u8>(), 0..400), prop::option::of(number())),
                0..12,
            ),
            budget in 0usize..2000,
        ) {
            let built = Outgoing::refreshes(rows.iter().map(|(k, v, n)| (k, v, *n)), budget);
            let entries: Vec<EntryVersion> = rows.iter().map(|(k, v, version)| EntryVersion {
                key: encode_part(k, "key").unwrap(),
                value: encode_part(v, "value").unwrap(),
                version: *version,
            }).collect();
            let sizes: Vec<usize> = entries.iter().map(|e| framed_len(&[&e.key, &e.value])).collect();
            if let Some(&too) = sizes.iter().find(|&&n| n > budget) {
                let Err(Error::TooLarge { size, limit, .. }) = built else {
                    panic!("expected too large, got {built:?}");
                };
                prop_assert_eq!((size, limit), (too, budget));
                return Ok(());
            }
            let built = built.unwrap();
            // The split as `changes::split` makes it.
            let mut expected = Outgoing::default();
            let mut batch = Vec::new();
            let mut used = 0usize;
            for (e, n) in entries.into_iter().zip(sizes) {
                if used + n > budget && !batch.is_empty() {
                    expected.put_change(&Change::Refresh { entries: std::mem::take(&mut batch) });
                    used = 0;
                }
                used += n;
                batch.push(e);
            }
            if !batch.is_empty() {
                expected.put_change(&Change::Refresh { entries: batch });
            }
            let h = header("t", b"o", [1, 2, 3]);
            let seal = |o: &Outgoing| -> Vec<Vec<u8>> {
                o.events().map(|b| encode_body(&h, &HeaderExt::default(), b)).collect()
            };
            prop_assert_eq!(seal(&built), seal(&expected));
            // And the second send's invalidation.
            let again: Vec<Vec<u8>> = seal(&built.clone().into_invalidation());
            let mut expected_again = Outgoing::default();
            for b in built.events() {
                let bytes = encode_body(&h, &HeaderExt::default(), b);
                let (_, change) = crate::wire::decode(&bytes, usize::MAX).unwrap();
                expected_again.put_change(&change.into_invalidation());
            }
            prop_assert_eq!(again, seal(&expected_again));
        }
    }

    #[test]
    fn invalidations_clears_and_replacements_are_what_bincode_writes() {
        let h = header("countries", b"admin", [9, 300, 70_000]);
        let ext = HeaderExt::default();
        let keys = Outgoing::invalidations([("de", Some(3)), ("fr", None)], 1 << 20).unwrap();
        let change = Change::Invalidate {
            keys: [("de", Some(3)), ("fr", None)]
                .map(|(k, version)| KeyVersion {
                    key: encode_part(k, "key").unwrap(),
                    version,
                })
                .to_vec(),
        };
        let body = keys.events().next().unwrap();
        assert_eq!(
            encode_body(&h, &ext, body),
            encode_ext(&h, &ext, &change).unwrap()
        );
        let clear = Outgoing::clear(Some(7));
        assert_eq!(
            encode_body(&h, &ext, clear.events().next().unwrap()),
            encode_ext(&h, &ext, &Change::Clear { version: Some(7) }).unwrap()
        );
        assert_eq!(
            encode_body(&h, &ext, Body::ANNOUNCE),
            encode_ext(&h, &ext, &Change::ANNOUNCE).unwrap()
        );
        let rows = [(1u32, "a".to_owned()), (2, "b".to_owned())];
        let replaced = Outgoing::replacement(rows.iter().map(|(k, v)| (k, v)), 5, 1 << 20).unwrap();
        let kinds: Vec<_> = replaced.events().map(|b| (b.kind, b.items)).collect();
        assert_eq!(kinds, [(CLEAR, 0), (REFRESH, 2)]);
        let refresh = replaced.events().nth(1).unwrap();
        let (_, change) = crate::wire::decode(&encode_body(&h, &ext, refresh), usize::MAX).unwrap();
        assert_eq!(change.max_version(), Some(5));
        assert_eq!(change.len(), 2);
    }

    /// A publish's items buffer is given back cleared, and the next
    /// publish on the thread encodes into it; a large one is freed.
    #[test]
    fn a_recycled_buffer_comes_back_empty_and_a_large_one_is_freed() {
        let small = Outgoing::refreshes([(1u32, 2u32, None)], 1000).unwrap();
        let at = small.bytes.as_ptr();
        small.recycle();
        let again = Outgoing::refreshes([(3u32, 4u32, Some(5))], 1000).unwrap();
        assert_eq!(again.bytes.as_ptr(), at, "not reused");
        let mut expected = Outgoing::default();
        expected.put_change(&Change::Refresh {
            entries: vec![EntryVersion {
                key: encode_part(&3u32, "key").unwrap(),
                value: encode_part(&4u32, "value").unwrap(),
                version: Some(5),
            }],
        });
        assert_eq!(again.bytes, expected.bytes);
        assert_eq!(again.events().count(), 1);
        again.recycle();
        let big = Outgoing::refreshes([(1u32, "v".repeat(SPARE_MAX), None)], usize::MAX).unwrap();
        big.recycle();
        assert!(Outgoing::with_room().bytes.capacity() <= SPARE_MAX);
    }

    /// An item that does not encode is reported before one that is too
    /// large, as when every item was encoded before the split.
    #[test]
    fn an_encoding_error_comes_before_a_size_error() {
        enum Value {
            Big,
            Fails,
        }
        impl Serialize for Value {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                match self {
                    Value::Big => s.serialize_str(&"v".repeat(5000)),
                    Value::Fails => Err(serde::ser::Error::custom("no")),
                }
            }
        }
        let err = Outgoing::refreshes([(1u32, Value::Big, None), (2, Value::Fails, None)], 1000)
            .unwrap_err();
        assert!(matches!(err, Error::Encode { what: "value", .. }), "{err}");
        let err = Outgoing::refreshes([(1u32, Value::Big, None)], 1000).unwrap_err();
        assert!(err.is_too_large(), "{err}");
    }
}
