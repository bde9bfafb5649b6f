//! Taking the entries of `XREAD`, `XRANGE` and `XREVRANGE` replies apart,
//! in RESP2 and RESP3. Pure functions, apart so they can be tested against
//! well-formed and malformed replies without a server.

use bytes::Bytes;
use redis::Value;

fn into_string(v: Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// One stream entry as read.
pub(super) struct Entry {
    pub(super) id: String,
    pub(super) ordinal: Option<u64>,
    /// Entries of a cache-sync before epochs carry none.
    pub(super) epoch: Option<u64>,
    pub(super) tag: Option<String>,
    pub(super) payload: Bytes,
}

/// Takes the entry apart without copying: every node parses every entry, so
/// this runs once per event per node.
pub(super) fn parse_entry(v: Value) -> Option<Entry> {
    let Value::Array(parts) = v else {
        return None;
    };
    let mut parts = parts.into_iter();
    let (Some(id), Some(Value::Array(fields)), None) = (parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let mut entry = Entry {
        id: into_string(id)?,
        ordinal: None,
        epoch: None,
        tag: None,
        payload: Bytes::new(),
    };
    let mut fields = fields.into_iter();
    while let (Some(k), Some(v)) = (fields.next(), fields.next()) {
        let Value::BulkString(k) = k else { continue };
        match (k.as_slice(), v) {
            (b"n", v) => entry.ordinal = as_u64(&v),
            (b"e", v) => entry.epoch = Some(as_u64(&v).unwrap_or(0)),
            (b"t", v) => entry.tag = into_string(v),
            (b"p", Value::BulkString(b)) => entry.payload = Bytes::from(b),
            _ => {}
        }
    }
    Some(entry)
}

/// Entries from an `XREAD` reply for one key (RESP2 array or RESP3 map).
pub(super) fn parse_xread(v: Value) -> Vec<Value> {
    let streams: Vec<Value> = match v {
        Value::Nil => return Vec::new(),
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut kv) if kv.len() == 2 => kv.pop(),
                _ => None,
            })
            .collect(),
        Value::Map(m) => m.into_iter().map(|(_, v)| v).collect(),
        _ => return Vec::new(),
    };
    streams
        .into_iter()
        .flat_map(|s| match s {
            Value::Array(entries) => entries,
            _ => Vec::new(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use redis::VerbatimFormat;

    use super::*;

    fn bulk(s: impl AsRef<[u8]>) -> Value {
        Value::BulkString(s.as_ref().to_vec())
    }

    /// `[id, [k1, v1, k2, v2, ...]]`, as `XREAD` and `XRANGE` list an entry.
    fn entry(id: Value, fields: Vec<(Value, Value)>) -> Value {
        let flat = fields.into_iter().flat_map(|(k, v)| [k, v]).collect();
        Value::Array(vec![id, Value::Array(flat)])
    }

    /// An entry as the publish script writes it: `n`, `e`, `t` and `p`.
    fn published(id: &str, n: u64) -> Value {
        entry(
            bulk(id),
            vec![
                (bulk("n"), bulk(n.to_string())),
                (bulk("e"), bulk("1700000000000123")),
                (bulk("t"), bulk("users")),
                (bulk("p"), bulk(b"\x00\xffbody")),
            ],
        )
    }

    fn ids(entries: Vec<Value>) -> Vec<String> {
        entries
            .into_iter()
            .map(|v| parse_entry(v).expect("a well-formed entry").id)
            .collect()
    }

    #[test]
    fn an_entry_as_published_is_taken_apart() {
        let e = parse_entry(published("1700000000000-3", 42)).expect("well-formed");
        assert_eq!(e.id, "1700000000000-3");
        assert_eq!(e.ordinal, Some(42));
        assert_eq!(e.epoch, Some(1_700_000_000_000_123));
        assert_eq!(e.tag.as_deref(), Some("users"));
        assert_eq!(e.payload, Bytes::from_static(b"\x00\xffbody"));
    }

    #[test]
    fn strings_and_numbers_are_read_in_any_form_redis_sends() {
        let e = parse_entry(entry(
            Value::SimpleString("5-0".into()),
            vec![
                (bulk("n"), Value::Int(7)),
                (bulk("e"), Value::SimpleString("9".into())),
                (
                    bulk("t"),
                    Value::VerbatimString {
                        format: VerbatimFormat::Text,
                        text: "orders".into(),
                    },
                ),
            ],
        ))
        .expect("well-formed");
        assert_eq!(e.id, "5-0");
        assert_eq!(e.ordinal, Some(7));
        assert_eq!(e.epoch, Some(9));
        assert_eq!(e.tag.as_deref(), Some("orders"));
    }

    #[test]
    fn an_entry_without_cache_syncs_fields_still_has_its_id() {
        // Another writer's entry, or one from before epochs: nothing is
        // made up for the fields it lacks.
        let e = parse_entry(entry(
            bulk("1-1"),
            vec![
                (bulk("other"), bulk("x")),
                // Only bulk-string field names count.
                (Value::Int(1), bulk("2")),
                (Value::SimpleString("n".into()), bulk("3")),
            ],
        ))
        .expect("well-formed");
        assert_eq!(e.id, "1-1");
        assert_eq!(e.ordinal, None);
        assert_eq!(e.epoch, None);
        assert_eq!(e.tag, None);
        assert!(e.payload.is_empty());
    }

    #[test]
    fn a_field_name_without_a_value_is_ignored() {
        let Value::Array(mut parts) = published("2-0", 4) else {
            unreachable!()
        };
        let Some(Value::Array(fields)) = parts.last_mut() else {
            unreachable!()
        };
        fields.push(bulk("n"));
        let e = parse_entry(Value::Array(parts)).expect("well-formed");
        assert_eq!(e.ordinal, Some(4));
    }

    #[test]
    fn malformed_fields_are_not_guessed() {
        let with = |k: &str, v: Value| parse_entry(entry(bulk("1-0"), vec![(bulk(k), v)])).unwrap();
        for n in [
            bulk("abc"),
            bulk("-1"),
            bulk(""),
            Value::Int(-1),
            Value::Nil,
            bulk([0xffu8]),
        ] {
            assert_eq!(with("n", n.clone()).ordinal, None, "ordinal {n:?}");
        }
        // An epoch that is there but not a number still marks the entry as
        // from some history: 0, which no stream's epoch is.
        for e in [bulk("x"), Value::Int(-3), Value::Nil] {
            assert_eq!(with("e", e.clone()).epoch, Some(0), "epoch {e:?}");
        }
        assert_eq!(
            with("t", bulk([b'a', 0xff])).tag,
            None,
            "a tag that is not UTF-8"
        );
        assert_eq!(with("t", Value::Int(5)).tag, None);
        // The payload is only ever a bulk string.
        assert!(
            with("p", Value::SimpleString("x".into()))
                .payload
                .is_empty()
        );
        assert!(with("p", Value::Int(1)).payload.is_empty());
    }

    #[test]
    fn malformed_entries_are_refused() {
        let fields = || Value::Array(vec![bulk("n"), bulk("1")]);
        let refused = [
            bulk("1-0"),
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![bulk("1-0")]),
            Value::Array(vec![bulk("1-0"), bulk("n")]),
            Value::Array(vec![bulk("1-0"), fields(), fields()]),
            Value::Array(vec![Value::Int(1), fields()]),
            Value::Array(vec![bulk([0xffu8]), fields()]),
            Value::Array(vec![Value::Nil, fields()]),
        ];
        for v in refused {
            assert!(parse_entry(v.clone()).is_none(), "{v:?}");
        }
    }

    #[test]
    fn xread_replies_give_their_entries_in_order() {
        assert!(parse_xread(Value::Nil).is_empty(), "nothing new");
        let resp2 = Value::Array(vec![Value::Array(vec![
            bulk("stream"),
            Value::Array(vec![published("1-0", 1), published("2-0", 2)]),
        ])]);
        assert_eq!(ids(parse_xread(resp2)), ["1-0", "2-0"]);
        let resp3 = Value::Map(vec![(
            bulk("stream"),
            Value::Array(vec![published("3-0", 3)]),
        )]);
        assert_eq!(ids(parse_xread(resp3)), ["3-0"]);
        let two_streams = Value::Array(vec![
            Value::Array(vec![bulk("a"), Value::Array(vec![published("1-0", 1)])]),
            Value::Array(vec![bulk("b"), Value::Array(vec![published("1-1", 1)])]),
        ]);
        assert_eq!(ids(parse_xread(two_streams)), ["1-0", "1-1"]);
    }

    #[test]
    fn malformed_xread_replies_give_nothing_of_the_malformed_part() {
        for v in [Value::Int(1), bulk("stream"), Value::Okay] {
            assert!(parse_xread(v.clone()).is_empty(), "{v:?}");
        }
        let reply = Value::Array(vec![
            // Not a `[key, entries]` pair.
            Value::Array(vec![bulk("a")]),
            Value::Array(vec![
                bulk("a"),
                Value::Array(vec![published("9-0", 9)]),
                Value::Array(vec![published("9-1", 9)]),
            ]),
            bulk("a"),
            // Entries that are not an array.
            Value::Array(vec![bulk("a"), bulk("1-0")]),
            Value::Array(vec![bulk("a"), Value::Array(vec![published("4-0", 4)])]),
        ]);
        assert_eq!(ids(parse_xread(reply)), ["4-0"]);
        let resp3 = Value::Map(vec![
            (bulk("a"), Value::Nil),
            (bulk("b"), Value::Array(vec![published("5-0", 5)])),
        ]);
        assert_eq!(ids(parse_xread(resp3)), ["5-0"]);
    }
}
