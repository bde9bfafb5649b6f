//! A decoder for the row messages of PostgreSQL's `pgoutput` plugin,
//! protocol version 1 (`Relation`, `Insert`, `Update`, `Delete`,
//! `Truncate`; `Begin`, `Commit` and `Message` are parsed by the
//! replication client). Input comes off a network connection: every length
//! and count is checked against what is left, and nothing panics or
//! allocates more than the input's own size on any byte string.

// A binlog relay alone (feature `mysql-cdc`) uses the row types, not
// the decoder.
#![cfg_attr(not(feature = "postgres-cdc"), allow(dead_code))]

use std::fmt;

/// A decoded message. Borrowed from the payload: a change is mapped into
/// cache events before the next message is read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Message<'a> {
    Relation(Relation),
    Insert {
        relation: u32,
        new: Tuple<'a>,
    },
    Update {
        relation: u32,
        /// `'K'`: the old replica identity columns (sent when they changed);
        /// `'O'`: the whole old row (replica identity FULL).
        old: Option<Tuple<'a>>,
        new: Tuple<'a>,
    },
    Delete {
        relation: u32,
        old: Tuple<'a>,
    },
    Truncate {
        relations: Vec<u32>,
    },
    /// `Type`, `Origin`, and anything a later server adds: nothing a cache
    /// needs.
    Other(u8),
}

/// A table's shape, sent before its first change and again after every
/// change to its schema (a column added or dropped, a rename).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relation {
    pub(crate) id: u32,
    pub(crate) schema: String,
    pub(crate) name: String,
    /// `d` default (primary key), `n` nothing, `f` full, `i` index.
    pub(crate) replica_identity: u8,
    pub(crate) columns: Vec<Column>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Column {
    pub(crate) name: String,
    /// Part of the replica identity.
    pub(crate) identity: bool,
}

/// A row's columns, in the relation's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Tuple<'a> {
    pub(crate) columns: Vec<Datum<'a>>,
    /// `'K'`, `'O'` or `'N'`: a key tuple holds only the identity columns.
    pub(crate) kind: u8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Datum<'a> {
    Null,
    /// A TOASTed value the update did not change: the server did not send it.
    Unchanged,
    /// The value in text format (the relay never asks for binary).
    Text(&'a [u8]),
    Binary(&'a [u8]),
}

/// Why a payload did not decode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PgoutputError(pub(crate) &'static str);

impl fmt::Display for PgoutputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed pgoutput message: {}", self.0)
    }
}

impl std::error::Error for PgoutputError {}

/// PostgreSQL's limit on a table's columns (`MaxTupleAttributeNumber`).
const MAX_COLUMNS: usize = 1664;

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], PgoutputError> {
        if self.0.len() < n {
            return Err(PgoutputError(what));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, PgoutputError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, PgoutputError> {
        let b = self.take(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, PgoutputError> {
        let b = self.take(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn string(&mut self, what: &'static str) -> Result<String, PgoutputError> {
        let end = self
            .0
            .iter()
            .position(|&b| b == 0)
            .ok_or(PgoutputError(what))?;
        let s = std::str::from_utf8(&self.0[..end]).map_err(|_| PgoutputError(what))?;
        self.0 = &self.0[end.saturating_add(1)..];
        Ok(s.to_owned())
    }

    fn tuple(&mut self, kind: u8) -> Result<Tuple<'a>, PgoutputError> {
        let n = usize::from(self.u16("tuple column count")?);
        if n > MAX_COLUMNS {
            return Err(PgoutputError("tuple column count over 1664"));
        }
        // Each column takes at least one byte: a count the payload cannot
        // hold is refused before anything is allocated for it.
        if n > self.0.len() {
            return Err(PgoutputError("tuple column count past the payload"));
        }
        let mut columns = Vec::with_capacity(n);
        for _ in 0..n {
            columns.push(match self.u8("tuple column kind")? {
                b'n' => Datum::Null,
                b'u' => Datum::Unchanged,
                kind @ (b't' | b'b') => {
                    let len = self.u32("tuple value length")?;
                    let len = usize::try_from(len).map_err(|_| PgoutputError("length"))?;
                    let bytes = self.take(len, "tuple value past the payload")?;
                    if kind == b't' {
                        Datum::Text(bytes)
                    } else {
                        Datum::Binary(bytes)
                    }
                }
                _ => return Err(PgoutputError("unknown tuple column kind")),
            });
        }
        Ok(Tuple { columns, kind })
    }

    fn end(&self) -> Result<(), PgoutputError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(PgoutputError("trailing bytes"))
        }
    }
}

/// Decodes one `pgoutput` message (an `XLogData` payload).
pub(crate) fn decode(payload: &[u8]) -> Result<Message<'_>, PgoutputError> {
    let mut r = Reader(payload);
    let tag = r.u8("empty message")?;
    let message = match tag {
        b'R' => {
            let id = r.u32("relation id")?;
            let schema = r.string("relation schema")?;
            let name = r.string("relation name")?;
            let replica_identity = r.u8("replica identity")?;
            let n = usize::from(r.u16("relation column count")?);
            if n > MAX_COLUMNS {
                return Err(PgoutputError("relation column count over 1664"));
            }
            // A column takes at least 10 bytes (flags, an empty name's NUL,
            // type and modifier).
            if n > r.0.len() / 10 {
                return Err(PgoutputError("relation column count past the payload"));
            }
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                let flags = r.u8("column flags")?;
                let name = r.string("column name")?;
                let _type = r.u32("column type")?;
                let _modifier = r.u32("column type modifier")?;
                columns.push(Column {
                    name,
                    identity: flags & 1 != 0,
                });
            }
            Message::Relation(Relation {
                id,
                schema,
                name,
                replica_identity,
                columns,
            })
        }
        b'I' => {
            let relation = r.u32("insert relation")?;
            if r.u8("insert tuple kind")? != b'N' {
                return Err(PgoutputError("insert without a new tuple"));
            }
            let new = r.tuple(b'N')?;
            Message::Insert { relation, new }
        }
        b'U' => {
            let relation = r.u32("update relation")?;
            let mut kind = r.u8("update tuple kind")?;
            let mut old = None;
            if kind == b'K' || kind == b'O' {
                old = Some(r.tuple(kind)?);
                kind = r.u8("update new tuple kind")?;
            }
            if kind != b'N' {
                return Err(PgoutputError("update without a new tuple"));
            }
            let new = r.tuple(b'N')?;
            Message::Update { relation, old, new }
        }
        b'D' => {
            let relation = r.u32("delete relation")?;
            let kind = r.u8("delete tuple kind")?;
            if kind != b'K' && kind != b'O' {
                return Err(PgoutputError("delete without an old tuple"));
            }
            let old = r.tuple(kind)?;
            Message::Delete { relation, old }
        }
        b'T' => {
            let n = r.u32("truncate relation count")?;
            let _options = r.u8("truncate options")?;
            let n = usize::try_from(n).map_err(|_| PgoutputError("truncate count"))?;
            if n > r.0.len() / 4 {
                return Err(PgoutputError("truncate relation count past the payload"));
            }
            let mut relations = Vec::with_capacity(n);
            for _ in 0..n {
                relations.push(r.u32("truncate relation")?);
            }
            Message::Truncate { relations }
        }
        // Type, Origin and the rest are skipped whole: their layout is not
        // checked because nothing of them is used.
        other => return Ok(Message::Other(other)),
    };
    r.end()?;
    Ok(message)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Encoders for tests and the fuzz corpus: the server's layout.
    pub(crate) fn relation(
        id: u32,
        schema: &str,
        name: &str,
        ident: u8,
        cols: &[(&str, bool)],
    ) -> Vec<u8> {
        let mut b = vec![b'R'];
        b.extend(id.to_be_bytes());
        b.extend(schema.as_bytes());
        b.push(0);
        b.extend(name.as_bytes());
        b.push(0);
        b.push(ident);
        b.extend(u16::try_from(cols.len()).unwrap().to_be_bytes());
        for (name, key) in cols {
            b.push(u8::from(*key));
            b.extend(name.as_bytes());
            b.push(0);
            b.extend(25u32.to_be_bytes());
            b.extend((-1i32).to_be_bytes());
        }
        b
    }

    pub(crate) fn tuple(kind: u8, values: &[Option<&str>]) -> Vec<u8> {
        let mut b = vec![kind];
        b.extend(u16::try_from(values.len()).unwrap().to_be_bytes());
        for v in values {
            match v {
                None => b.push(b'n'),
                Some("\u{0}unchanged") => b.push(b'u'),
                Some(s) => {
                    b.push(b't');
                    b.extend(u32::try_from(s.len()).unwrap().to_be_bytes());
                    b.extend(s.as_bytes());
                }
            }
        }
        b
    }

    pub(crate) fn insert(rel: u32, values: &[Option<&str>]) -> Vec<u8> {
        let mut b = vec![b'I'];
        b.extend(rel.to_be_bytes());
        b.extend(tuple(b'N', values));
        b
    }

    #[test]
    fn decodes_what_the_server_sends() {
        let r = relation(
            7,
            "public",
            "countries",
            b'd',
            &[("code", true), ("name", false)],
        );
        let Message::Relation(rel) = decode(&r).unwrap() else {
            panic!()
        };
        assert_eq!(rel.name, "countries");
        assert_eq!(rel.columns.len(), 2);
        assert!(rel.columns[0].identity && !rel.columns[1].identity);

        let i = insert(7, &[Some("de"), None]);
        assert_eq!(
            decode(&i).unwrap(),
            Message::Insert {
                relation: 7,
                new: Tuple {
                    columns: vec![Datum::Text(b"de"), Datum::Null],
                    kind: b'N'
                }
            }
        );

        let mut u = vec![b'U'];
        u.extend(7u32.to_be_bytes());
        u.extend(tuple(b'K', &[Some("de"), None]));
        u.extend(tuple(b'N', &[Some("at"), Some("\u{0}unchanged")]));
        let Message::Update { old, new, .. } = decode(&u).unwrap() else {
            panic!()
        };
        assert_eq!(old.unwrap().kind, b'K');
        assert_eq!(new.columns[1], Datum::Unchanged);

        let mut t = vec![b'T'];
        t.extend(2u32.to_be_bytes());
        t.push(0);
        t.extend(7u32.to_be_bytes());
        t.extend(8u32.to_be_bytes());
        assert_eq!(
            decode(&t).unwrap(),
            Message::Truncate {
                relations: vec![7, 8]
            }
        );
    }

    #[test]
    fn refuses_every_truncation_and_trailing_bytes() {
        let mut u = vec![b'U'];
        u.extend(7u32.to_be_bytes());
        u.extend(tuple(b'O', &[Some("de"), Some("Germany")]));
        u.extend(tuple(b'N', &[Some("de"), Some("Deutschland")]));
        let messages = [
            relation(
                7,
                "public",
                "countries",
                b'f',
                &[("code", true), ("name", true)],
            ),
            insert(7, &[Some("de"), Some("Germany")]),
            u,
        ];
        for m in messages {
            assert!(decode(&m).is_ok());
            for cut in 0..m.len() {
                assert!(decode(&m[..cut]).is_err(), "{cut} of {}", m.len());
            }
            let mut longer = m.clone();
            longer.push(0);
            assert!(decode(&longer).is_err());
        }
    }

    #[test]
    fn huge_counts_allocate_nothing() {
        let mut t = vec![b'T'];
        t.extend(u32::MAX.to_be_bytes());
        t.push(0);
        assert!(decode(&t).is_err());
        let mut i = vec![b'I'];
        i.extend(1u32.to_be_bytes());
        i.push(b'N');
        i.extend(1600u16.to_be_bytes());
        assert!(decode(&i).is_err());
        let mut v = vec![b'I'];
        v.extend(1u32.to_be_bytes());
        v.push(b'N');
        v.extend(1u16.to_be_bytes());
        v.push(b't');
        v.extend(u32::MAX.to_be_bytes());
        assert!(decode(&v).is_err());
    }
}
