use bytes::Bytes;

use super::batch::Batch;
use super::pgoutput::{Column, Datum, Relation, Tuple};
use super::{Mapper, Row, Typed};
use crate::wire::Change;

fn relation(identity: u8) -> Relation {
    Relation {
        id: 1,
        schema: "public".into(),
        name: "items".into(),
        replica_identity: identity,
        columns: vec![
            Column {
                name: "id".into(),
                identity: true,
            },
            Column {
                name: "name".into(),
                identity: identity == b'f',
            },
            Column {
                name: "body".into(),
                identity: identity == b'f',
            },
        ],
    }
}

fn tuple(kind: u8, columns: Vec<Datum<'static>>) -> Tuple<'static> {
    Tuple { columns, kind }
}

#[test]
fn a_row_reads_what_the_change_carried_and_flags_what_it_did_not() {
    let rel = relation(b'd');
    let new = tuple(b'N', vec![Datum::Text(b"7"), Datum::Null, Datum::Unchanged]);
    let row = Row::new(&rel, &new, false);
    assert_eq!(row.parse::<i64>("id"), Some(7));
    assert_eq!(row.get("name"), None, "NULL");
    assert!(row.is_complete(), "a NULL is a value");
    assert_eq!(row.get("body"), None);
    assert!(!row.is_complete(), "an unchanged TOASTed value is not");

    for missing in ["nope", "", "ID", "id "] {
        let row = Row::new(&rel, &new, false);
        assert_eq!(row.get(missing), None);
        assert!(!row.is_complete(), "{missing:?}");
    }
    let row = Row::new(&rel, &new, false);
    assert_eq!(row.parse::<u8>("id").map(|_| ()), Some(()));
    let bad = tuple(
        b'N',
        vec![Datum::Text(b"x"), Datum::Text(b"\xff"), Datum::Binary(b"1")],
    );
    let row = Row::new(&rel, &bad, false);
    assert_eq!(row.parse::<i64>("id"), None);
    assert!(!row.is_complete(), "a value that does not parse");
    let row = Row::new(&rel, &bad, false);
    assert_eq!(row.get("name"), None);
    assert!(!row.is_complete(), "not UTF-8");
    let row = Row::new(&rel, &bad, false);
    assert_eq!(row.get("body"), None);
    assert!(!row.is_complete(), "binary");

    // Identity only (an old key tuple, or an update without one).
    let old = tuple(b'K', vec![Datum::Text(b"7"), Datum::Null, Datum::Null]);
    let row = Row::new(&rel, &old, false);
    assert_eq!(row.parse::<i64>("id"), Some(7));
    assert!(row.is_complete());
    assert_eq!(row.get("name"), None);
    assert!(
        !row.is_complete(),
        "outside the identity: not sent, not NULL"
    );
    let full = relation(b'f');
    let row = Row::new(&full, &new, true);
    assert_eq!(row.get("name"), None);
    assert!(
        row.is_complete(),
        "with REPLICA IDENTITY FULL every column is identity"
    );
}

#[test]
fn a_mapping_gives_no_key_or_value_from_an_incomplete_row() {
    let rel = relation(b'd');
    let mapper = Typed::<i64, String> {
        key: Box::new(|row| row.parse("id")),
        value: Some(Box::new(|row| {
            // Reads a column that may be missing, then ignores it.
            let _ = row.get("body");
            row.get("name").map(str::to_owned)
        })),
    };
    let new = tuple(
        b'N',
        vec![Datum::Text(b"7"), Datum::Text(b"seven"), Datum::Unchanged],
    );
    assert!(mapper.key(&Row::new(&rel, &new, false)).is_some());
    assert_eq!(
        mapper.value(&Row::new(&rel, &new, false)),
        None,
        "the function read an unchanged column: the value may be partial"
    );
    let whole = tuple(
        b'N',
        vec![Datum::Text(b"7"), Datum::Text(b"seven"), Datum::Text(b"b")],
    );
    assert!(mapper.value(&Row::new(&rel, &whole, false)).is_some());
    let keyless = Typed::<i64, String> {
        key: Box::new(|row| row.parse("name")),
        value: None,
    };
    assert_eq!(keyless.key(&Row::new(&rel, &whole, false)), None);
    assert_eq!(keyless.value(&Row::new(&rel, &whole, false)), None);
}

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

fn keys(changes: &[Change]) -> Vec<(String, Option<String>, Option<u64>)> {
    let mut out = Vec::new();
    for c in changes {
        match c {
            Change::Clear { version } => out.push(("*clear".into(), None, *version)),
            Change::Invalidate { keys } => {
                for k in keys {
                    out.push((String::from_utf8_lossy(&k.key).into(), None, k.version));
                }
            }
            Change::Refresh { entries } => {
                for e in entries {
                    out.push((
                        String::from_utf8_lossy(&e.key).into(),
                        Some(String::from_utf8_lossy(&e.value).into()),
                        e.version,
                    ));
                }
            }
        }
    }
    out.sort();
    out
}

/// The relay's way: each transaction gathered on its own, then absorbed.
fn txn(batch: &mut Batch, xid: u32, f: impl FnOnce(&mut Batch)) {
    let mut open = Batch::default();
    f(&mut open);
    batch.absorb(&mut open, Some(xid));
    assert!(open.is_empty());
}

#[test]
fn a_batch_keeps_each_keys_last_change() {
    let mut batch = Batch::default();
    txn(&mut batch, 1, |t| {
        t.key("c", b("a"), Some(b("1")), 10, 100);
        t.key("c", b("a"), None, 10, 100);
        t.key("c", b("b"), Some(b("2")), 10, 100);
    });
    txn(&mut batch, 2, |t| {
        t.key("c", b("b"), Some(b("3")), 20, 100);
    });
    // Changed nothing: not waited for.
    txn(&mut batch, 3, |_| {});
    assert_eq!(batch.xids, [1, 2]);
    assert_eq!(batch.transactions, 3);
    let out = batch.take();
    assert_eq!(out.len(), 1);
    assert_eq!(
        keys(&out[0].1),
        [
            ("a".into(), None, Some(10)),
            ("b".into(), Some("3".into()), Some(20))
        ]
    );
    assert!(batch.is_empty());
}

#[test]
fn a_truncate_clears_what_came_before_and_keeps_what_came_after() {
    let mut batch = Batch::default();
    txn(&mut batch, 1, |t| {
        t.key("c", b("a"), Some(b("1")), 10, 100);
    });
    txn(&mut batch, 2, |t| {
        t.key("c", b("b"), Some(b("2")), 20, 100);
        t.clear("c", 20);
        t.key("c", b("c"), Some(b("3")), 20, 100);
    });
    let out = batch.take();
    assert_eq!(
        keys(&out[0].1),
        [
            ("*clear".into(), None, Some(20)),
            ("c".into(), Some("3".into()), Some(20))
        ]
    );
    // The clear goes first.
    assert!(matches!(out[0].1[0], Change::Clear { .. }));
}

#[test]
fn past_its_cap_a_transaction_becomes_a_clear_and_the_next_one_counts_anew() {
    for cap in [1, 2, 5] {
        let mut batch = Batch::default();
        txn(&mut batch, 1, |t| {
            let mut saturated = false;
            for i in 0..=cap {
                saturated |= t.key("c", b(&i.to_string()), Some(b("v")), 10, cap);
            }
            assert!(saturated);
            // Ignored: the clear at this version covers the rest of it.
            t.key("c", b("late"), Some(b("v")), 10, cap);
            t.key("other", b("x"), None, 10, cap);
        });
        txn(&mut batch, 2, |t| {
            t.key("c", b("next"), Some(b("v")), 11, cap);
        });
        let mut out = batch.take();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            keys(&out[0].1),
            [
                ("*clear".into(), None, Some(10)),
                ("next".into(), Some("v".into()), Some(11))
            ],
            "cap {cap}"
        );
        assert_eq!(keys(&out[1].1), [("x".into(), None, Some(10))]);
    }
}

#[test]
fn past_its_byte_cap_a_transaction_becomes_a_clear() {
    let mut batch = Batch::default();
    let big = Bytes::from(vec![0u8; 1 << 20]);
    txn(&mut batch, 1, |t| {
        let mut saturated = false;
        for i in 0..70 {
            saturated |= t.key("c", b(&i.to_string()), Some(big.clone()), 10, usize::MAX);
        }
        assert!(saturated, "70 MiB is over the 64 MiB cap");
    });
    let out = batch.take();
    assert_eq!(keys(&out[0].1), [("*clear".into(), None, Some(10))]);
}
