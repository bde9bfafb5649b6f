//! Entry points for the fuzz targets in `cache-sync/fuzz`, and the replay
//! of their corpora in `cargo test`.
//!
//! Not part of the API: compiled for this crate's tests and behind the
//! internal `_fuzz` feature, which only the fuzz crate turns on. Each
//! function takes untrusted bytes, must never panic on them, and asserts
//! the properties that must hold whatever the bytes are.

use crate::wire::{ChangeView, decode_change, decode_header_ext, decode_part, encode_ext};
use crate::wire::{Keyring, strip_unverified};

/// The limit the targets decode under: small, so the fuzzer reaches it.
pub(crate) const LIMIT: usize = 4096;

/// The event decoder: header, change, and the keys and values inside. What
/// decodes re-encodes, and decodes again to the same event. (Not always to
/// the same bytes: a varint may arrive longer than bincode would write it.)
pub fn event(data: &[u8]) {
    let Ok((header, ext, offset)) = decode_header_ext(data, LIMIT, None) else {
        return;
    };
    let Ok(view) = decode_change(data, offset) else {
        return;
    };
    let change = view.to_change();
    let again = encode_ext(&header, &ext, &change).expect("a decoded event encodes");
    assert!(again.len() <= data.len(), "re-encoding grew the event");
    let (header2, ext2, offset2) =
        decode_header_ext(&again, LIMIT, None).expect("a re-encoded header decodes");
    let change2 = decode_change(&again, offset2).expect("a re-encoded change decodes");
    assert_eq!(
        (&header2, ext2, change2.to_change()),
        (&header, ext, change)
    );
    let parts: Vec<&[u8]> = match view {
        ChangeView::Invalidate(items) => items.map(|i| i.key).collect(),
        ChangeView::Refresh(items) => items.flat_map(|i| [i.key, i.value]).collect(),
        ChangeView::Clear { .. } | ChangeView::Announce => Vec::new(),
    };
    for part in parts {
        let _ = decode_part::<String>(part, "key");
        let _ = decode_part::<u64>(part, "key");
        let _ = decode_part::<(Option<String>, Vec<u8>)>(part, "value");
    }
}

/// The heartbeat channel's reader: whatever arrives there, on a party
/// that verifies and on one that does not, is refused or read without
/// panicking; what is read seals and opens to itself, and a verifying
/// party opens nothing the ring did not sign.
pub fn heartbeat(data: &[u8]) {
    use crate::cluster::{OpenedMessage, open_message, seal_ack_message, seal_message};
    use crate::wire::Codec;
    let plain = Codec::new(LIMIT, None);
    if let Ok(opened) = open_message(&plain, data) {
        let sealed = match &opened {
            OpenedMessage::Message(m) => seal_message(&plain, m),
            OpenedMessage::Ack { asker, ack } => seal_ack_message(&plain, *asker, ack),
        };
        if let Ok(sealed) = sealed {
            assert_eq!(open_message(&plain, &sealed).ok(), Some(opened));
        }
    }
    // Skipping another party's answer reads only what opening would: an
    // answer that names an asker opens as an answer to that asker, or not
    // at all.
    if let Some(asker) = Codec::ack_for(data)
        && let Ok(opened) = open_message(&plain, data)
    {
        assert!(
            matches!(opened, OpenedMessage::Ack { asker: a, .. } if a == asker),
            "{opened:?} was skipped as an answer for {asker}"
        );
    }
    let verifying = Codec::new(LIMIT, Some(ring()));
    if let Ok(message) = open_message(&verifying, data) {
        let inner = ring()
            .open(data)
            .expect("what opened was signed by the ring");
        assert!(data.ends_with(inner));
        let _ = message;
    }
}

pub(crate) fn ring() -> Keyring {
    Keyring::new("fuzz", b"a fixed secret for the fuzz target".to_vec())
        .expect("a valid key")
        .accept("k2", b"a second accepted secret".to_vec())
        .expect("a valid key")
}

/// The signed-frame opener. Nothing opens unless it is exactly a frame the
/// ring would have made; whatever the bytes, signing them and opening the
/// result gives them back.
pub fn signed(data: &[u8]) {
    let ring = ring();
    if let Ok(inner) = ring.open(data) {
        assert!(data.ends_with(inner), "an opened frame's event is its tail");
        assert_eq!(ring.sign(inner), data, "a forged frame opened");
    }
    let stripped = strip_unverified(data);
    assert!(data.ends_with(stripped));
    let frame = ring.sign(data);
    assert_eq!(ring.open(&frame).ok(), Some(data));
}

/// `offsets.json` parsing. What parses writes back to a file that parses to
/// the same positions.
pub fn offsets(data: &[u8]) {
    crate::transport::fuzz_offsets(data);
}

/// The outbox's row decoder (what a relay reads from the database). What
/// decodes re-encodes to a row no longer than the input that decodes to
/// the same change.
pub fn outbox_row(data: &[u8]) {
    let Ok(change) = crate::wire::decode_row(data, LIMIT) else {
        return;
    };
    let again = crate::wire::encode_row(&change, LIMIT).expect("a decoded row encodes");
    assert!(again.len() <= data.len(), "re-encoding grew the row");
    let change2 = crate::wire::decode_row(&again, LIMIT).expect("a re-encoded row decodes");
    assert_eq!(change2, change);
}

/// The decoder of PostgreSQL's `pgoutput` messages (what the CDC relay
/// reads off its replication connection), and the rows its mappings read
/// from what decodes. The input is a sequence of messages, each two length
/// bytes (little-endian) and then its bytes (the last one takes what is
/// left when it claims more), handled in order as the relay would: a
/// `Relation` is kept under its id, and every tuple of a change is read as
/// a `Row` against its relation (or, so that the fuzzer need not match the
/// ids, against the last relation decoded).
///
/// Checked, whatever the bytes: nothing panics or overflows; a message
/// that decodes (other than one of a kind the decoder skips unread) is
/// exactly its bytes, so one byte more or one less does not decode, and
/// holds no more columns or relations than its bytes can carry; and a
/// `Row` reads each column, by name, as the tuple holds it, with
/// `is_complete` false exactly when a column asked for was not carried
/// (unchanged, binary, not UTF-8, outside the identity of a key-only row,
/// or not in the table: never a NULL) or did not parse. No round trip:
/// the crate has no encoder (only the server writes these messages).
#[cfg(feature = "postgres-cdc")]
pub fn pgoutput(data: &[u8]) {
    use crate::cdc::pgoutput::{Message, decode};

    let mut relations = std::collections::HashMap::new();
    let mut last = None;
    let mut rest = data;
    while let [a, b, tail @ ..] = rest {
        let len = usize::from(u16::from_le_bytes([*a, *b]));
        let (message, tail) = tail.split_at(len.min(tail.len()));
        rest = tail;
        let Ok(decoded) = decode(message) else {
            continue;
        };
        pgoutput_exact(message, &decoded);
        let (id, old, new) = match decoded {
            Message::Relation(relation) => {
                last = Some(relation.id);
                relations.insert(relation.id, relation);
                continue;
            }
            Message::Insert { relation, new } => (relation, None, new),
            Message::Update { relation, old, new } => (relation, old, new),
            Message::Delete { relation, old } => (relation, None, old),
            Message::Truncate { .. } | Message::Other(_) => continue,
        };
        let Some(relation) = relations
            .get(&id)
            .or_else(|| last.and_then(|l| relations.get(&l)))
        else {
            continue;
        };
        for tuple in old.iter().chain([&new]) {
            pgoutput_rows(relation, tuple);
        }
    }
}

/// A decoded message is exactly its bytes, and no larger than they allow.
#[cfg(feature = "postgres-cdc")]
fn pgoutput_exact(message: &[u8], decoded: &crate::cdc::pgoutput::Message<'_>) {
    use crate::cdc::pgoutput::{Message, Tuple, decode};

    if let Message::Other(tag) = decoded {
        // Skipped whole, unread: only a tag the decoder does not read.
        assert_eq!(message.first(), Some(tag));
        assert!(!b"RIUDT".contains(tag), "{tag} was skipped unread");
        return;
    }
    let mut longer = message.to_vec();
    longer.push(0);
    assert!(decode(&longer).is_err(), "trailing bytes were accepted");
    let (_, shorter) = message.split_last().expect("a decoded message has a tag");
    assert!(decode(shorter).is_err(), "a truncated message decoded");
    // Every column takes a byte at least, every relation column 10 (flags,
    // a name's NUL, type and modifier), every truncated relation 4.
    let fits = |t: &Tuple<'_>| t.columns.len() <= 1664 && t.columns.len() < message.len();
    match decoded {
        Message::Relation(r) => assert!(
            r.columns.len() <= 1664 && r.columns.len().saturating_mul(10) < message.len(),
            "{} columns from {} bytes",
            r.columns.len(),
            message.len()
        ),
        Message::Insert { new, .. } => assert!(new.kind == b'N' && fits(new)),
        Message::Update { old, new, .. } => {
            assert!(new.kind == b'N' && fits(new));
            if let Some(old) = old {
                assert!(matches!(old.kind, b'K' | b'O') && fits(old));
            }
        }
        Message::Delete { old, .. } => assert!(matches!(old.kind, b'K' | b'O') && fits(old)),
        Message::Truncate { relations } => {
            assert!(relations.len().saturating_mul(4) < message.len());
        }
        Message::Other(_) => {}
    }
}

/// Reads every column of `tuple` by name (and one the table does not
/// have), as every kind of row the relay makes: each read gives what the
/// tuple holds, and a row is complete exactly when every column read was
/// carried and parsed.
#[cfg(feature = "postgres-cdc")]
fn pgoutput_rows(
    relation: &crate::cdc::pgoutput::Relation,
    tuple: &crate::cdc::pgoutput::Tuple<'_>,
) {
    use crate::cdc::Row;
    use crate::cdc::pgoutput::Datum;

    // A cap on the work, not on what is reached: past a few columns, more
    // of them only make a long input slow (every name is looked up by a
    // scan, and a tuple may be read against a table of 800 columns).
    const COLUMNS: usize = 64;
    const MISSING: &str = "\u{0}not a column";
    let names = || {
        relation
            .columns
            .iter()
            .take(COLUMNS)
            .map(|c| c.name.as_str())
            .chain([MISSING])
    };
    for identity_only in [false, true] {
        // What reading `name` must give: the text, and whether the change
        // carried it (a NULL is carried; an unchanged value is not).
        let expect = |name: &str| -> (Option<&str>, bool) {
            let Some(i) = relation.columns.iter().position(|c| c.name == name) else {
                return (None, false);
            };
            let key_only = identity_only || tuple.kind == b'K';
            if key_only && !relation.columns[i].identity {
                return (None, false);
            }
            match tuple.columns.get(i) {
                Some(Datum::Null) => (None, true),
                Some(Datum::Text(bytes)) => match std::str::from_utf8(bytes) {
                    Ok(text) => (Some(text), true),
                    Err(_) => (None, false),
                },
                Some(Datum::Unchanged | Datum::Binary(_)) | None => (None, false),
            }
        };
        let shared = Row::new(relation, tuple, identity_only);
        assert_eq!(shared.table(), relation.name);
        let mut all_carried = true;
        for name in names() {
            let (text, carried) = expect(name);
            let row = Row::new(relation, tuple, identity_only);
            assert!(row.is_complete(), "a row read nothing yet");
            assert_eq!(row.get(name), text, "column {name:?}");
            assert_eq!(row.is_complete(), carried, "column {name:?}: {text:?}");
            let row = Row::new(relation, tuple, identity_only);
            assert_eq!(row.parse::<String>(name).as_deref(), text);
            assert_eq!(row.is_complete(), carried);
            let row = Row::new(relation, tuple, identity_only);
            let number = text.and_then(|t| t.parse::<i64>().ok());
            assert_eq!(row.parse::<i64>(name), number);
            assert_eq!(
                row.is_complete(),
                carried && (text.is_none() || number.is_some()),
                "column {name:?}: {text:?} as a number"
            );
            assert_eq!(shared.get(name), text);
            all_carried &= carried;
            assert_eq!(shared.is_complete(), all_carried, "column {name:?}");
        }
        // The missing column, read last, left the shared row incomplete.
        assert!(!shared.is_complete());
    }
}

/// The binlog relay's reading of row images (what it reads off a MySQL or
/// MariaDB replication stream): a TABLE_MAP event's body, read by
/// mysql_common's parser into the table's `Shape`, then a ROWS event's
/// body, its row images walked by `Shape::decode` (mysql_common's value
/// decoder, and `Shape::render` for every value) and read as the relay
/// reads them. The input is the ROWS event's type (the first byte picks
/// one of write, update and delete, version 1 or 2, and MySQL's partial
/// JSON update), the table map's length (two bytes, little-endian; it
/// takes what is left when it claims more), the table map's body, and the
/// rows event's body. Both are read with the post-header lengths of a
/// MySQL 5.6+ format description (a 6-byte table id); the table ids need
/// not match.
///
/// As the relay does (see `Stream::rows` in `cdc/binlog/session.rs`): a
/// partial JSON update is refused unread; a rows event whose column count
/// is not the table map's is refused; each row is decoded under
/// `catch_unwind`, where a panic (mysql_common's value decoder indexes
/// metadata it trusts) is a clean refusal of the event, not a crash.
/// Everything else runs as the relay runs it, outside `catch_unwind`: the
/// event parsers and `Shape::new` must not panic at all.
///
/// Checked, whatever the bytes: nothing else panics or overflows; every
/// row read moves on (no endless loop); a decoded image has a cell for
/// every column, each inside the image's text, none for a column the
/// image does not carry; and every column reads by name, as the relay's
/// mappings read them, without panicking.
#[cfg(feature = "mysql-cdc")]
pub fn binlog_rows(data: &[u8]) {
    use std::panic::AssertUnwindSafe;

    use mysql_common::binlog::consts::{BinlogVersion, EventType};
    use mysql_common::binlog::events::{
        BinlogEventHeader, FormatDescriptionEvent, RowsEventData, TableMapEvent,
    };
    use mysql_common::binlog::{BinlogCtx, BinlogEvent};
    use mysql_common::io::ParseBuf;

    use crate::cdc::Row;
    use crate::cdc::binlog::session::{Image, next_row};
    use crate::cdc::binlog::shape::{Cell, Shape};

    /// The body of an event of type `ty`, read whole, as `Event::read_event`
    /// reads it (bytes left over are an error).
    fn read<'a, T: BinlogEvent<'a>>(
        body: &'a [u8],
        fde: &'a FormatDescriptionEvent<'a>,
        ty: EventType,
    ) -> Option<T> {
        let size = BinlogEventHeader::LEN.saturating_add(body.len());
        let mut buf = ParseBuf(body);
        let event: T = buf.parse(BinlogCtx::new(size, fde, ty as u8)).ok()?;
        buf.is_empty().then_some(event)
    }

    const TYPES: [EventType; 7] = [
        EventType::WRITE_ROWS_EVENT_V1,
        EventType::UPDATE_ROWS_EVENT_V1,
        EventType::DELETE_ROWS_EVENT_V1,
        EventType::WRITE_ROWS_EVENT,
        EventType::UPDATE_ROWS_EVENT,
        EventType::DELETE_ROWS_EVENT,
        EventType::PARTIAL_UPDATE_ROWS_EVENT,
    ];
    let [kind, a, b, rest @ ..] = data else {
        return;
    };
    let ty = TYPES[usize::from(*kind).checked_rem(TYPES.len()).unwrap_or(0)];
    let (table_map, rows_body) =
        rest.split_at(usize::from(u16::from_le_bytes([*a, *b])).min(rest.len()));
    let fde = FormatDescriptionEvent::new(BinlogVersion::Version4);
    let Some(tme) = read::<TableMapEvent<'_>>(table_map, &fde, EventType::TABLE_MAP_EVENT) else {
        return;
    };
    let Ok(shape) = Shape::new(&tme) else {
        return;
    };
    let relation = &shape.relation;
    assert_eq!(relation.columns.len(), shape.len());
    let rows_event = match ty {
        EventType::WRITE_ROWS_EVENT_V1 => {
            read(rows_body, &fde, ty).map(RowsEventData::WriteRowsEventV1)
        }
        EventType::UPDATE_ROWS_EVENT_V1 => {
            read(rows_body, &fde, ty).map(RowsEventData::UpdateRowsEventV1)
        }
        EventType::DELETE_ROWS_EVENT_V1 => {
            read(rows_body, &fde, ty).map(RowsEventData::DeleteRowsEventV1)
        }
        EventType::WRITE_ROWS_EVENT => read(rows_body, &fde, ty).map(RowsEventData::WriteRowsEvent),
        EventType::UPDATE_ROWS_EVENT => {
            read(rows_body, &fde, ty).map(RowsEventData::UpdateRowsEvent)
        }
        EventType::DELETE_ROWS_EVENT => {
            read(rows_body, &fde, ty).map(RowsEventData::DeleteRowsEvent)
        }
        _ => read(rows_body, &fde, ty).map(RowsEventData::PartialUpdateRowsEvent),
    };
    let Some(rows_event) = rows_event else {
        return;
    };
    // The relay's refusals, before any row is read.
    if matches!(rows_event, RowsEventData::PartialUpdateRowsEvent(_)) {
        return;
    }
    let before = rows_event
        .columns_before_image()
        .map(|b| b.iter().map(|b| *b).collect::<Vec<bool>>());
    let after = rows_event
        .columns_after_image()
        .map(|b| b.iter().map(|b| *b).collect::<Vec<bool>>());
    if usize::try_from(rows_event.num_columns()).ok() != Some(shape.len()) {
        return;
    }
    quiet_caught_panics();
    let [mut old, mut new] = [Image::default(), Image::default()];
    let mut rows = ParseBuf(rows_event.rows_data());
    loop {
        let left = rows.0.len();
        CAUGHT.with(|c| c.set(true));
        let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| {
            next_row(&shape, &before, &after, &mut rows, &mut old, &mut new)
        }));
        CAUGHT.with(|c| c.set(false));
        let (has_old, has_new) = match decoded {
            Ok(Ok(Some(images))) => images,
            // The end, a row that did not decode, or a panic the relay
            // catches: each ends the event.
            Ok(Ok(None) | Err(_)) | Err(_) => break,
        };
        assert!(rows.0.len() < left, "a row read no bytes");
        for (image, present, carried) in [(&old, &before, has_old), (&new, &after, has_new)] {
            if !carried {
                continue;
            }
            assert_eq!(image.cells.len(), shape.len());
            for (i, cell) in image.cells.iter().enumerate() {
                let here = present
                    .as_ref()
                    .is_none_or(|p| p.get(i).copied().unwrap_or(false));
                match *cell {
                    Cell::Text(from, to) => {
                        assert!(here, "column {i} not in the image has a value");
                        assert!(
                            from <= to && to <= image.text.len(),
                            "{cell:?} outside the text"
                        );
                    }
                    Cell::Null => assert!(here, "column {i} not in the image is NULL"),
                    Cell::Absent => {}
                }
            }
        }
        let old_tuple = has_old.then(|| old.tuple(None, b'O'));
        let new_tuple = has_new.then(|| new.tuple(has_old.then_some(&old), b'N'));
        for tuple in old_tuple.iter().chain(new_tuple.iter()) {
            let row = Row::new(relation, tuple, false);
            // A cap on the work, as in `pgoutput_rows`.
            for column in relation.columns.iter().take(64) {
                let _ = row.get(&column.name);
            }
            let _ = row.is_complete();
        }
    }
}

#[cfg(feature = "mysql-cdc")]
thread_local! {
    /// Set while `binlog_rows` runs what the relay runs under
    /// `catch_unwind`: a panic there is a refusal, not a crash.
    static CAUGHT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// libFuzzer's panic hook aborts the process at any panic, even one that
/// would be caught; this one passes a panic on to it (and to the default
/// hook under `cargo test`) only when the code that panicked runs outside
/// the relay's `catch_unwind`.
#[cfg(feature = "mysql-cdc")]
fn quiet_caught_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CAUGHT.with(std::cell::Cell::get) {
                previous(info);
            }
        }));
    });
}

/// The consumer's record handling, fed raw records (tags and payloads as a
/// transport would hand them over). The first byte picks whether the node
/// verifies signatures (bit 0), the size of its version table (bits 1-3)
/// and its event size limit (bits 4-5: 64 to 512 bytes, small, so that
/// oversized records are common); the rest is records, each a tag (one
/// length byte, 255 for none, then its bytes) and a payload (two length
/// bytes, little-endian, then its bytes).
///
/// Checked, whatever the bytes: nothing panics; every record is counted;
/// and on a verifying node, where no input can carry a valid signature,
/// nothing changes a cache: warm entries stay, and nothing is resynced.
pub fn records(data: &[u8]) {
    use crate::cache::SyncedCache;
    use crate::transport::Record;

    thread_local! {
        static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime for the fuzz target");
        // Made once: a new moka cache per input cost a millisecond or two,
        // most of the target's time. Registration empties them each time.
        static MOKA: (moka::future::Cache<String, String>, moka::future::Cache<u64, Vec<u8>>) =
            (moka::future::Cache::new(64), moka::future::Cache::new(64));
    }
    let ring = ring();
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let mut records = Vec::new();
    while let Some((&tag_len, tail)) = rest.split_first() {
        let (tag, tail) = match tag_len {
            255 => (None, tail),
            n => {
                let n = usize::from(n).min(tail.len());
                let (tag, tail) = tail.split_at(n);
                (
                    Some(std::sync::Arc::from(String::from_utf8_lossy(tag))),
                    tail,
                )
            }
        };
        let (len, tail) = match tail {
            [a, b, tail @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), tail),
            _ => (0, &[][..]),
        };
        let (payload, tail) = tail.split_at(len.min(tail.len()));
        records.push(Record::new(tag, bytes::Bytes::copy_from_slice(payload)));
        rest = tail;
    }
    let verify = mode & 1 == 1;
    RUNTIME.with(|rt| {
        rt.block_on(async {
            let (moka_a, moka_b) = MOKA.with(Clone::clone);
            let a: SyncedCache<String, String> = SyncedCache::builder("a", moka_a)
                // 0 is refused; the fuzz target keeps its 8 sizes as 1 to 8.
                .max_tracked_keys(usize::from((mode >> 1) & 7) + 1)
                .build()
                .expect("1 to 8 tracked keys are valid");
            let b: SyncedCache<u64, Vec<u8>> = SyncedCache::new("b", moka_b);
            let mut builder =
                crate::Node::builder("fuzz", crate::transport::EmbeddedTransport::new())
                    .max_event_bytes(64 << ((mode >> 4) & 3))
                    .register(&a)
                    .register(&b);
            if verify {
                builder = builder.verify_signatures(ring.clone());
            }
            let node = crate::node::RawNode::new(builder).await;
            a.insert("warm".into(), "kept".into()).await;
            b.insert(7, vec![7]).await;
            let n = records.len() as u64;
            // The seeds hold records signed with the target's key, so that
            // the fuzzer reaches what comes after the check too; the promise
            // is checked on inputs where no record is authentic.
            let forged_only = records.iter().all(|r| ring.open(&r.payload).is_err());
            let (received, refused) = node.apply(records).await;
            assert_eq!(received, n, "every record is counted");
            assert!(refused <= n);
            if verify && forged_only {
                assert_eq!(refused, n, "an unsigned record got through");
                assert_eq!(a.peek("warm").await.as_deref(), Some("kept"));
                assert_eq!(b.peek(&7).await, Some(vec![7]));
                for c in [a.status(), b.status()] {
                    assert_eq!(
                        (c.loss_resyncs, c.rejected_events, c.events_applied),
                        (0, 0, 0),
                        "an unauthenticated record changed cache {}",
                        c.name
                    );
                }
            }
        });
    });
}

#[cfg(test)]
mod replay {
    use std::path::Path;

    use crate::wire::{Change, EntryVersion, Fence, Header, HeaderExt, KeyVersion};

    use super::*;

    fn event_bytes(cache: &str, publisher: u64, seq: u64, change: &Change) -> Vec<u8> {
        let header = Header {
            cache,
            origin: crate::wire::Origin(b"seed"),
            publisher,
            seq,
            published_at_us: 1_796_000_000_000_000,
        };
        // Every other seed a version 2 event, with the extension's fields.
        let ext = if seq.is_multiple_of(2) {
            HeaderExt {
                since_prev_us: Some(seq * 1000),
                fence: seq.is_multiple_of(4).then_some(Fence {
                    scope: 9,
                    term: seq,
                }),
                // Every sixth a version 3 event, with a relay's watermark.
                watermark: seq.is_multiple_of(6).then_some(crate::wire::Watermark {
                    source: 5,
                    epoch: 3,
                    number: seq,
                    acked_after_us: seq.is_multiple_of(12).then_some(seq * 10),
                }),
            }
        } else {
            HeaderExt::default()
        };
        encode_ext(&header, &ext, change).expect("seed encodes")
    }

    fn changes() -> Vec<Change> {
        fn part(v: &dyn erased::Part) -> bytes::Bytes {
            v.bytes()
        }
        vec![
            Change::Refresh {
                entries: vec![EntryVersion {
                    key: part(&"de"),
                    value: part(&"Germany"),
                    version: Some(3),
                }],
            },
            Change::Refresh {
                entries: vec![
                    EntryVersion {
                        key: part(&7u64),
                        value: part(&vec![1u8, 2, 3]),
                        version: None,
                    },
                    EntryVersion {
                        key: part(&u64::MAX),
                        value: part(&Vec::<u8>::new()),
                        version: Some(u64::MAX),
                    },
                ],
            },
            Change::Invalidate {
                keys: vec![KeyVersion {
                    key: part(&"warm"),
                    version: Some(9),
                }],
            },
            Change::Clear { version: Some(5) },
            Change::Clear { version: None },
        ]
    }

    /// Type-erased keys and values for the seeds.
    mod erased {
        pub(super) trait Part {
            fn bytes(&self) -> bytes::Bytes;
        }
        impl<T: serde::Serialize> Part for T {
            fn bytes(&self) -> bytes::Bytes {
                crate::wire::encode_part(self, "seed").expect("seed part encodes")
            }
        }
    }

    /// A record for the `records` target: tag, then payload.
    fn record(tag: Option<&str>, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        match tag {
            Some(t) => {
                out.push(u8::try_from(t.len()).expect("short tag"));
                out.extend(t.as_bytes());
            }
            None => out.push(255),
        }
        let len = u16::try_from(payload.len()).expect("short payload");
        out.extend(len.to_le_bytes());
        out.extend(payload);
        out
    }

    /// An input of the `pgoutput` target: each message after its length
    /// (two bytes, little-endian).
    #[cfg(feature = "postgres-cdc")]
    fn frames(messages: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            out.extend(u16::try_from(m.len()).expect("short message").to_le_bytes());
            out.extend(*m);
        }
        out
    }

    /// The `pgoutput` target's seeds: a table's relation, then its changes,
    /// laid out as the server sends them.
    #[cfg(feature = "postgres-cdc")]
    fn pgoutput_seeds() -> Vec<Vec<u8>> {
        use crate::cdc::pgoutput::tests::{insert, relation, tuple};

        let columns = [("code", true), ("name", false), ("population", false)];
        let countries = relation(7, "public", "countries", b'd', &columns);
        let full = relation(7, "public", "countries", b'f', &columns);
        let update = |rel: u32, old: Option<Vec<u8>>, new: &[Option<&str>]| {
            let mut b = vec![b'U'];
            b.extend(rel.to_be_bytes());
            b.extend(old.unwrap_or_default());
            b.extend(tuple(b'N', new));
            b
        };
        let delete = |rel: u32, kind: u8, old: &[Option<&str>]| {
            let mut b = vec![b'D'];
            b.extend(rel.to_be_bytes());
            b.extend(tuple(kind, old));
            b
        };
        let truncate = |rels: &[u32]| {
            let mut b = vec![b'T'];
            b.extend(u32::try_from(rels.len()).expect("few").to_be_bytes());
            b.push(1); // CASCADE
            for r in rels {
                b.extend(r.to_be_bytes());
            }
            b
        };
        let unchanged = Some("\u{0}unchanged");
        // Values the relay never asks for, or that are not text: binary,
        // and text that is not UTF-8.
        let mut odd = vec![b'I'];
        odd.extend(7u32.to_be_bytes());
        odd.push(b'N');
        odd.extend(3u16.to_be_bytes());
        odd.push(b't');
        odd.extend(2u32.to_be_bytes());
        odd.extend(b"de");
        odd.push(b'b');
        odd.extend(4u32.to_be_bytes());
        odd.extend([0, 0, 0, 7]);
        odd.push(b't');
        odd.extend(2u32.to_be_bytes());
        odd.extend([0xff, 0xfe]);
        // A Type and an Origin message: skipped.
        let mut type_message = vec![b'Y'];
        type_message.extend(16_384u32.to_be_bytes());
        type_message.extend(b"public\0mood\0");
        let mut origin = vec![b'O'];
        origin.extend(0x0000_0001_0000_0a28u64.to_be_bytes());
        origin.extend(b"upstream\0");
        let added = relation(
            7,
            "public",
            "countries",
            b'd',
            &[
                ("code", true),
                ("name", false),
                ("population", false),
                ("capital", false),
            ],
        );
        let lines = relation(
            10,
            "shop",
            "order_lines",
            b'i',
            &[("order_id", true), ("line", true), ("sku", false)],
        );
        vec![
            frames(&[
                &countries,
                &insert(7, &[Some("de"), Some("Germany"), Some("83000000")]),
            ]),
            frames(&[&countries, &insert(7, &[Some("at"), None, Some("-1")])]),
            // An update that left the key and a TOASTed value unchanged.
            frames(&[
                &countries,
                &update(7, None, &[Some("de"), unchanged, Some("84000000")]),
            ]),
            // An update that changed the key: the old key columns first.
            frames(&[
                &countries,
                &update(
                    7,
                    Some(tuple(b'K', &[Some("de"), None, None])),
                    &[Some("ge"), Some("Georgia"), Some("3700000")],
                ),
            ]),
            // Replica identity full: the whole old row.
            frames(&[
                &full,
                &update(
                    7,
                    Some(tuple(b'O', &[Some("de"), Some("Germany"), None])),
                    &[Some("de"), Some("Deutschland"), Some("83000000")],
                ),
            ]),
            frames(&[&countries, &delete(7, b'K', &[Some("de"), None, None])]),
            frames(&[
                &full,
                &delete(7, b'O', &[Some("de"), unchanged, Some("many")]),
            ]),
            frames(&[&countries, &truncate(&[7, 10])]),
            frames(&[&countries, &odd]),
            // A column added between two changes, a second table keyed by
            // an index of two columns, and messages that are skipped.
            frames(&[
                &type_message,
                &countries,
                &insert(7, &[Some("fr"), Some("France"), Some("68000000")]),
                &origin,
                &added,
                &update(7, None, &[Some("fr"), unchanged, None, Some("Paris")]),
                &lines,
                &update(
                    10,
                    Some(tuple(b'K', &[Some("41"), Some("2"), None])),
                    &[Some("42"), Some("1"), Some("SKU-9")],
                ),
                &delete(10, b'K', &[Some("42"), Some("1"), None]),
                &truncate(&[10]),
            ]),
            // A table with no columns, and an unnamed one.
            frames(&[
                &relation(9, "", "", b'n', &[]),
                &insert(9, &[]),
                &delete(9, b'O', &[]),
            ]),
        ]
    }

    /// The `pgoutput` seeds are what the server sends: every message
    /// decodes (so the fuzzer starts past the decoder's checks), and the
    /// target takes each.
    #[cfg(feature = "postgres-cdc")]
    #[test]
    fn the_pgoutput_seeds_decode() {
        for input in pgoutput_seeds() {
            let mut rest = &input[..];
            while let [a, b, tail @ ..] = rest {
                let (message, tail) = tail.split_at(usize::from(u16::from_le_bytes([*a, *b])));
                crate::cdc::pgoutput::decode(message)
                    .unwrap_or_else(|e| panic!("{e}: {message:?}"));
                rest = tail;
            }
            assert!(rest.is_empty());
            super::pgoutput(&input);
        }
    }

    /// A length-encoded integer, as the binlog writes one.
    #[cfg(feature = "mysql-cdc")]
    fn lenenc(out: &mut Vec<u8>, n: usize) {
        match n {
            0..=250 => out.push(u8::try_from(n).expect("small")),
            251..=0xffff => {
                out.push(0xfc);
                out.extend(u16::try_from(n).expect("u16").to_le_bytes());
            }
            _ => panic!("seed lengths are small"),
        }
    }

    /// A column of a seed table: name, type, metadata, and whether it may
    /// be NULL.
    #[cfg(feature = "mysql-cdc")]
    struct SeedColumn {
        name: &'static str,
        ty: u8,
        meta: &'static [u8],
    }

    /// A TABLE_MAP event's body (after the common header), as MySQL 8
    /// writes it with `binlog_row_metadata = FULL`: table id 108, the
    /// columns' types, metadata and null bitmap, then the optional
    /// metadata `fields` (type, then value).
    #[cfg(feature = "mysql-cdc")]
    fn table_map(table: &str, columns: &[SeedColumn], fields: &[(u8, Vec<u8>)]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(&108u64.to_le_bytes()[..6]);
        b.extend(1u16.to_le_bytes());
        for name in ["shop", table] {
            b.push(u8::try_from(name.len()).expect("short name"));
            b.extend(name.as_bytes());
            b.push(0);
        }
        lenenc(&mut b, columns.len());
        b.extend(columns.iter().map(|c| c.ty));
        let meta: Vec<u8> = columns
            .iter()
            .flat_map(|c| c.meta.iter().copied())
            .collect();
        lenenc(&mut b, meta.len());
        b.extend(meta);
        // Every column but the first may be NULL.
        let mut nullable = vec![0u8; columns.len().div_ceil(8)];
        for i in 1..columns.len() {
            nullable[i / 8] |= 1 << (i % 8);
        }
        b.extend(nullable);
        for (ty, value) in fields {
            b.push(*ty);
            lenenc(&mut b, value.len());
            b.extend(value);
        }
        b
    }

    /// The optional metadata's list of strings, each after its length.
    #[cfg(feature = "mysql-cdc")]
    fn strings(items: &[&str]) -> Vec<u8> {
        let mut b = Vec::new();
        for s in items {
            lenenc(&mut b, s.len());
            b.extend(s.as_bytes());
        }
        b
    }

    /// A ROWS event's body (version 2, or 1 when `v1`): table id 108, no
    /// extra data, every column in each image, then `rows` (each row's
    /// images, null bitmaps and values, as the server writes them).
    #[cfg(feature = "mysql-cdc")]
    fn rows_event(v1: bool, images: usize, columns: usize, rows: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend(&108u64.to_le_bytes()[..6]);
        b.extend(1u16.to_le_bytes()); // STMT_END_F
        if !v1 {
            b.extend(2u16.to_le_bytes()); // no extra data
        }
        lenenc(&mut b, columns);
        for _ in 0..images {
            let mut bitmap = vec![0u8; columns.div_ceil(8)];
            for i in 0..columns {
                bitmap[i / 8] |= 1 << (i % 8);
            }
            b.extend(bitmap);
        }
        b.extend(rows);
        b
    }

    /// An input of the `binlog_rows` target: the rows event's type (an
    /// index into the target's list), the table map's length, the table
    /// map, the rows event.
    #[cfg(feature = "mysql-cdc")]
    fn binlog_input(kind: u8, table_map: &[u8], rows: &[u8]) -> Vec<u8> {
        let mut out = vec![kind];
        out.extend(u16::try_from(table_map.len()).expect("short").to_le_bytes());
        out.extend(table_map);
        out.extend(rows);
        out
    }

    /// The text a seed row's columns render to (`None`: NULL).
    #[cfg(feature = "mysql-cdc")]
    type SeedRow = Vec<Option<&'static str>>;

    /// The `binlog_rows` target's seeds, and the text each row's values
    /// render to: a table of BIGINT UNSIGNED (the key), VARCHAR(64)
    /// utf8mb4, DECIMAL(10,2), DATETIME(6), JSON and ENUM columns with
    /// full metadata, its rows inserted, updated and deleted (version 2
    /// events, and version 1), a NULL, and a table of TIMESTAMP(3), BIT,
    /// SET, BLOB and TIME columns with per-column charsets.
    #[cfg(feature = "mysql-cdc")]
    fn binlog_seeds() -> Vec<(Vec<u8>, Vec<SeedRow>)> {
        const LONGLONG: u8 = 8;
        const VARCHAR: u8 = 15;
        const NEWDECIMAL: u8 = 246;
        const DATETIME2: u8 = 18;
        const JSON: u8 = 245;
        const STRING: u8 = 254;
        const TIMESTAMP2: u8 = 17;
        const BIT: u8 = 16;
        const BLOB: u8 = 252;
        const TIME2: u8 = 19;
        let orders = [
            SeedColumn {
                name: "id",
                ty: LONGLONG,
                meta: &[],
            },
            // 64 characters of up to 4 bytes: two length bytes.
            SeedColumn {
                name: "name",
                ty: VARCHAR,
                meta: &[0x00, 0x01],
            },
            SeedColumn {
                name: "price",
                ty: NEWDECIMAL,
                meta: &[10, 2],
            },
            SeedColumn {
                name: "at",
                ty: DATETIME2,
                meta: &[6],
            },
            SeedColumn {
                name: "doc",
                ty: JSON,
                meta: &[4],
            },
            // ENUM is logged as STRING, its real type in the metadata.
            SeedColumn {
                name: "mood",
                ty: STRING,
                meta: &[0xf7, 1],
            },
        ];
        let names: Vec<&str> = orders.iter().map(|c| c.name).collect();
        let fields = vec![
            (1, vec![0b1000_0000]), // SIGNEDNESS: id unsigned, price signed
            (2, vec![255]),         // DEFAULT_CHARSET utf8mb4_0900_ai_ci
            (4, strings(&names)),   // COLUMN_NAME
            (6, {
                // ENUM_STR_VALUE
                let mut v = vec![3];
                v.extend(strings(&["sad", "ok", "happy"]));
                v
            }),
            (8, vec![1, 0]), // SIMPLE_PRIMARY_KEY: column 0
            (10, vec![255]), // ENUM_AND_SET_DEFAULT_CHARSET
        ];
        let tm = table_map("orders", &orders, &fields);
        // One row image: the null bitmap, then each value not NULL.
        let row = |id: u64, name: Option<&str>, mood: u8| {
            let mut r = vec![if name.is_some() { 0 } else { 0b10 }];
            r.extend(id.to_le_bytes());
            if let Some(name) = name {
                r.extend(u16::try_from(name.len()).expect("short").to_le_bytes());
                r.extend(name.as_bytes());
            }
            // 12.50: 8 integer digits in 4 bytes, 2 fraction digits in 1,
            // the sign bit flipped.
            r.extend([0x80, 0x00, 0x00, 0x0c, 0x32]);
            // 2026-01-02 03:04:05.000060.
            let ym: u64 = 2026 * 13 + 1;
            let packed: u64 = (1 << 39) | (ym << 22) | (2 << 17) | (3 << 12) | (4 << 6) | 5;
            r.extend(&packed.to_be_bytes()[3..]);
            r.extend([0x00, 0x00, 0x3c]);
            // {"a":1}: a small object of one key, its int16 inline.
            let json = [0x00, 1, 0, 12, 0, 11, 0, 1, 0, 0x05, 1, 0, b'a'];
            r.extend(u32::try_from(json.len()).expect("short").to_le_bytes());
            r.extend(json);
            r.push(mood);
            r
        };
        let text = |id: &'static str, name: Option<&'static str>, mood: &'static str| {
            vec![
                Some(id),
                name,
                Some("12.50"),
                Some("2026-01-02 03:04:05.000060"),
                Some("{\"a\":1}"),
                Some(mood),
            ]
        };
        let mut seeds = Vec::new();
        // Kinds: 0-2 write, update, delete v1; 3-5 the same, v2.
        let insert = [row(1, Some("Ünïcode ☃"), 3), row(2, None, 1)].concat();
        seeds.push((
            binlog_input(3, &tm, &rows_event(false, 1, 6, &insert)),
            vec![
                text("1", Some("Ünïcode ☃"), "happy"),
                text("2", None, "sad"),
            ],
        ));
        seeds.push((
            binlog_input(0, &tm, &rows_event(true, 1, 6, &row(u64::MAX, Some(""), 0))),
            vec![text("18446744073709551615", Some(""), "")],
        ));
        let update = [row(1, Some("old"), 1), row(1, Some("new"), 2)].concat();
        seeds.push((
            binlog_input(4, &tm, &rows_event(false, 2, 6, &update)),
            vec![text("1", Some("old"), "sad"), text("1", Some("new"), "ok")],
        ));
        seeds.push((
            binlog_input(1, &tm, &rows_event(true, 2, 6, &update)),
            vec![text("1", Some("old"), "sad"), text("1", Some("new"), "ok")],
        ));
        seeds.push((
            binlog_input(5, &tm, &rows_event(false, 1, 6, &row(7, Some("gone"), 2))),
            vec![text("7", Some("gone"), "ok")],
        ));
        seeds.push((
            binlog_input(2, &tm, &rows_event(true, 1, 6, &row(7, Some("gone"), 2))),
            vec![text("7", Some("gone"), "ok")],
        ));
        // A partial JSON update: refused unread.
        seeds.push((
            binlog_input(6, &tm, &rows_event(false, 2, 6, &update)),
            Vec::new(),
        ));
        // Other types, each column's charset listed (COLUMN_CHARSET), a
        // binary one among them.
        let odd = [
            SeedColumn {
                name: "k",
                ty: LONGLONG,
                meta: &[],
            },
            SeedColumn {
                name: "ts",
                ty: TIMESTAMP2,
                meta: &[3],
            },
            SeedColumn {
                name: "flags",
                ty: BIT,
                meta: &[4, 1],
            },
            SeedColumn {
                name: "tags",
                ty: STRING,
                meta: &[0xf8, 1],
            },
            SeedColumn {
                name: "raw",
                ty: BLOB,
                meta: &[2],
            },
            SeedColumn {
                name: "txt",
                ty: BLOB,
                meta: &[2],
            },
            SeedColumn {
                name: "dur",
                ty: TIME2,
                meta: &[0],
            },
        ];
        let names: Vec<&str> = odd.iter().map(|c| c.name).collect();
        let fields = vec![
            (1, vec![0]),
            (3, vec![63, 255]), // COLUMN_CHARSET: raw binary, txt utf8mb4
            (4, strings(&names)),
            (5, {
                // SET_STR_VALUE
                let mut v = vec![3];
                v.extend(strings(&["x", "y", "z"]));
                v
            }),
            (8, vec![1, 0]),
        ];
        let tm = table_map("odd", &odd, &fields);
        let mut r = vec![0u8];
        r.extend(42u64.to_le_bytes());
        // 1700000000.5 s: seconds big-endian, then the fraction in 2
        // bytes (hundreds of microseconds, for 3 digits).
        r.extend(1_700_000_000u32.to_be_bytes());
        r.extend(5000u16.to_be_bytes());
        r.extend([0x02, 0x05]); // BIT(12): 517
        r.push(0b101); // x,z
        r.extend(2u16.to_le_bytes());
        r.extend([0x00, 0xff]);
        r.extend(2u16.to_le_bytes());
        r.extend(b"hi");
        // -01:02:03: 1 bit sign, 1 bit unused, 10 bits hours, 6 minutes,
        // 6 seconds, offset by 0x800000 and negated.
        let t: i64 = 0x80_0000 - ((1 << 12) | (2 << 6) | 3);
        r.extend(&t.to_be_bytes()[5..]);
        seeds.push((
            binlog_input(3, &tm, &rows_event(false, 1, 7, &r)),
            vec![vec![
                Some("42"),
                Some("2023-11-14 22:13:20.500000"),
                Some("517"),
                Some("x,z"),
                Some("\\x00ff"),
                Some("hi"),
                Some("-01:02:03"),
            ]],
        ));
        seeds
    }

    /// The `binlog_rows` seeds are what the server writes: each table map
    /// gives a shape, and each row decodes whole, to the text expected.
    #[cfg(feature = "mysql-cdc")]
    #[test]
    fn the_binlog_rows_seeds_decode() {
        use mysql_common::binlog::consts::{BinlogVersion, EventType};
        use mysql_common::binlog::events::{FormatDescriptionEvent, TableMapEvent};
        use mysql_common::io::ParseBuf;

        use crate::cdc::binlog::shape::{Cell, Shape};

        for (input, expected) in binlog_seeds() {
            let len = usize::from(u16::from_le_bytes([input[1], input[2]]));
            let (tm, rows) = input[3..].split_at(len);
            let fde = FormatDescriptionEvent::new(BinlogVersion::Version4);
            let mut buf = ParseBuf(tm);
            let ctx = mysql_common::binlog::BinlogCtx::new(
                19 + tm.len(),
                &fde,
                EventType::TABLE_MAP_EVENT as u8,
            );
            let tme: TableMapEvent<'_> = buf.parse(ctx).expect("the table map reads");
            assert!(buf.is_empty());
            let shape = Shape::new(&tme).expect("a shape");
            // The rows: past the post-header and the bitmaps.
            let columns = shape.len();
            let images = if expected.len() == 2 && input[0] % 3 == 1 {
                2
            } else {
                1
            };
            let v1 = input[0] < 3;
            let skip = if v1 { 8 } else { 10 } + 1 + images * columns.div_ceil(8);
            let mut buf = ParseBuf(&rows[skip..]);
            let (mut text, mut cells) = (Vec::new(), Vec::new());
            for want in &expected {
                shape
                    .decode(None, &mut buf, &mut text, &mut cells)
                    .expect("a row decodes");
                let got: Vec<Option<&str>> = cells
                    .iter()
                    .map(|c| match *c {
                        Cell::Text(a, b) => Some(std::str::from_utf8(&text[a..b]).expect("UTF-8")),
                        Cell::Null => None,
                        Cell::Absent => Some("(absent)"),
                    })
                    .collect();
                assert_eq!(&got, want);
            }
            assert!(expected.is_empty() || buf.is_empty(), "bytes left");
            super::binlog_rows(&input);
        }
    }

    /// Writes the inputs the fuzzers start from. Run once, by hand, before
    /// the first `scripts/fuzz`: `cargo test -p cache-sync --lib write_fuzz_seeds -- --ignored`.
    #[test]
    #[ignore = "writes files; run by hand to seed new corpora"]
    fn write_fuzz_seeds() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
        let write = |target: &str, n: usize, data: &[u8]| {
            let dir = root.join(target);
            std::fs::create_dir_all(&dir).expect("corpus dir");
            std::fs::write(dir.join(format!("seed-{n:02}")), data).expect("seed");
        };
        let ring = ring();
        let mut events = Vec::new();
        for (i, change) in changes().iter().enumerate() {
            for cache in ["a", "b"] {
                events.push(event_bytes(cache, 42, i as u64 + 1, change));
            }
        }
        for (n, e) in events.iter().enumerate() {
            write("event", n, e);
            write("signed", n, &ring.sign(e));
        }
        write("signed", 90, b"\x01plain");
        write("signed", 91, &[crate::wire::FORMAT_SIGNED, 2, b'k', b'9']);
        let offsets = [
            r#"{"offsetTable": {}}"#,
            r#"{"offsetTable": {"cache-sync": {"embedded-9f3c": 1042}}}"#,
            r#"{"offsetTable": {"t": {"broker-a:0": 25, "broker-a:0@": "4096@1796000000123", "id": "1700-3", "n": 7, "e": 1796000000123456}}}"#,
            r#"{"offsetTable": {"t": {"seq": 18446744073709551615, "created": 0}}, "extra": [1, 2]}"#,
        ];
        for (n, o) in offsets.iter().enumerate() {
            write("offsets", n, o.as_bytes());
        }
        for (n, change) in changes().iter().enumerate() {
            let row = crate::wire::encode_row(change, LIMIT).expect("seed row encodes");
            write("outbox_row", n, &row);
        }
        let heartbeat = crate::cluster::Heartbeat {
            node_id: "node-1".into(),
            topic: "cache-sync".into(),
            started_at_us: 1_796_000_000_000_000,
            sent_at_us: 1_796_000_000_123_456,
            interval_ms: 2000,
            transport: "embedded".into(),
            consuming: true,
            ready: false,
            position: crate::transport::Position::single(
                "id",
                crate::transport::Offset::Id("1700-3".into()),
            ),
            losses: 2,
            live_nodes: Some(3),
            freshness_age_ms: Some(42),
            caches: vec![crate::cluster::CacheHeartbeat {
                name: "countries".into(),
                version: Some(12),
                version_at_us: None,
                version_age_ms: Some(1_500),
                entries: 240,
                loss_resyncs: 1,
                quarantined: true,
                last_latency_us: Some(830),
                freshness_age_ms: Some(120),
                audit: None,
            }],
        };
        let messages = [
            crate::cluster::Message::Heartbeat(heartbeat),
            crate::cluster::Message::Request(crate::cluster::Request::roll_call("cache-sync")),
            crate::cluster::Message::Request(crate::cluster::Request {
                topic: "cache-sync".into(),
                cache: Some("countries".into()),
                target: Some(crate::cluster::Target::Seq {
                    publisher: 42,
                    seq: 8,
                }),
                within_ms: 5000,
                asker: 7,
                id: 9,
                reply: true,
            }),
            crate::cluster::Message::Request(crate::cluster::Request {
                topic: "cache-sync".into(),
                cache: Some("c".into()),
                target: Some(crate::cluster::Target::Version(u64::MAX)),
                within_ms: u64::MAX,
                asker: u64::MAX,
                id: 0,
                reply: false,
            }),
            crate::cluster::Message::Probe(crate::cluster::Probe {
                topic: "cache-sync".into(),
                cache: "countries".into(),
                key: "\"de\"".into(),
                asker: 7,
                id: 10,
                reply: true,
            }),
        ];
        let plain = crate::wire::Codec::new(LIMIT, None);
        let signing = crate::wire::Codec::new(LIMIT, Some(ring.clone()));
        for (n, m) in messages.iter().enumerate() {
            let sealed = crate::cluster::seal_message(&plain, m).expect("seed seals");
            write("heartbeat", n, &sealed);
            let signed = crate::cluster::seal_message(&signing, m).expect("seed signs");
            write("heartbeat", n + 10, &signed);
        }
        let ack = crate::cluster::Ack {
            topic: "cache-sync".into(),
            node_id: "node-1".into(),
            ids: vec![1, u64::MAX],
            progress: vec![crate::cluster::Progress {
                cache: "countries".into(),
                publisher: Some(42),
                at: 7,
            }],
            probed: vec![crate::cluster::Probed {
                id: 3,
                state: crate::status::KeyState {
                    held: true,
                    version: Some(9),
                    quarantined: false,
                    trace: Vec::new(),
                    error: None,
                },
            }],
        };
        for (n, codec) in [&plain, &signing].into_iter().enumerate() {
            let sealed =
                crate::cluster::seal_ack_message(codec, 0x0102_0304_0506_0708, &ack).expect("seed");
            write("heartbeat", n + 20, &sealed);
        }
        // Records: plain (mode 0) and verifying (mode 1, and with small
        // version tables), tagged and not, in order, with gaps and garbage.
        for (n, mode) in [0u8, 1, 2, 3, 0x0e].into_iter().enumerate() {
            let mut input = vec![mode];
            for (i, e) in events.iter().enumerate() {
                let cache = if i % 2 == 0 { "a" } else { "b" };
                let payload = if mode & 1 == 1 {
                    ring.sign(e)
                } else {
                    e.clone()
                };
                let tag = (i % 3 != 0).then_some(cache);
                input.extend(record(tag, &payload));
            }
            input.extend(record(Some("a"), b"\x01\xff\xff garbage"));
            input.extend(record(Some("other"), b""));
            input.extend(record(None, &event_bytes("a", 42, 99, &changes()[0])));
            write("records", n, &input);
        }
        #[cfg(feature = "postgres-cdc")]
        for (n, input) in pgoutput_seeds().iter().enumerate() {
            write("pgoutput", n, input);
        }
        #[cfg(feature = "mysql-cdc")]
        for (n, (input, _)) in binlog_seeds().iter().enumerate() {
            write("binlog_rows", n, input);
        }
    }

    /// Every input the fuzzers kept, run again as a regression test.
    #[test]
    fn the_committed_corpora_replay_cleanly() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
        type Target = fn(&[u8]);
        #[cfg_attr(
            not(any(feature = "postgres-cdc", feature = "mysql-cdc")),
            allow(unused_mut)
        )]
        let mut targets: Vec<(&str, Target)> = vec![
            ("event", super::event),
            ("signed", super::signed),
            ("offsets", super::offsets),
            ("records", super::records),
            ("outbox_row", super::outbox_row),
            ("heartbeat", super::heartbeat),
        ];
        // Built only with the feature, as the target is.
        #[cfg(feature = "postgres-cdc")]
        targets.push(("pgoutput", super::pgoutput));
        #[cfg(feature = "mysql-cdc")]
        targets.push(("binlog_rows", super::binlog_rows));
        for (name, target) in targets {
            let dir = root.join(name);
            let mut inputs = 0;
            for entry in
                std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
            {
                let path = entry.expect("corpus entry").path();
                let data = std::fs::read(&path).expect("corpus file");
                target(&data);
                inputs += 1;
            }
            assert!(
                inputs >= 10,
                "corpus {name} holds only {inputs} inputs; run scripts/fuzz"
            );
        }
    }
}
