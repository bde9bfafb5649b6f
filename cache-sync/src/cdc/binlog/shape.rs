//! A table's shape as a binlog TABLE_MAP event gives it, and its row
//! values rendered as text, so a [`CdcTable`](crate::cdc::CdcTable) reads a
//! MySQL row as it reads a PostgreSQL one.
//!
//! The text is what the value means, not the server's wire format:
//! integers and decimals in decimal, strings as they are (UTF-8; a string
//! in another encoding that is not valid UTF-8 reads as absent, which
//! makes the change an invalidation), binary strings and BLOBs as `\x`
//! and hex (PostgreSQL's `bytea` text), dates `YYYY-MM-DD`, DATETIME and
//! TIMESTAMP `YYYY-MM-DD HH:MM:SS[.ffffff]` (TIMESTAMP in UTC), TIME
//! `[-]HH:MM:SS[.ffffff]`, ENUM its label, SET its labels joined by `,`,
//! BIT an unsigned integer, JSON its text.

use std::io::Write as _;
use std::sync::Arc;

use mysql_async::Value;
use mysql_async::binlog::events::{OptionalMetadataField, TableMapEvent};
use mysql_async::binlog::value::BinlogValue;
use mysql_async::consts::ColumnType;
use mysql_common::io::ParseBuf;
use mysql_common::proto::MySerialize as _;

use super::super::pgoutput::{Column, Relation};

/// The binary character set: its strings are bytes, rendered in hex.
const BINARY: u16 = 63;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Text,
    Bytes,
    Enum(Vec<String>),
    Set(Vec<String>),
    Bit,
    Date,
    DateTime,
    /// Seconds since the epoch, in UTC.
    Timestamp,
    Time,
    Number,
    /// Not rendered (a type this relay does not know): reads as absent.
    Other,
}

/// One table's shape, from its TABLE_MAP event.
#[derive(Debug)]
pub(crate) struct Shape {
    pub(crate) relation: Arc<Relation>,
    kinds: Vec<Kind>,
    /// How each column's values are encoded in a row image: its type
    /// (`None`: the table map gave none), its metadata bytes, and whether
    /// it is an unsigned number.
    wire: Vec<(Option<ColumnType>, Vec<u8>, bool)>,
}

/// A cell of a row image, its text in the image's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cell {
    /// Not in the image (`binlog_row_image` MINIMAL or NOBLOB).
    Absent,
    Null,
    /// At this range of the buffer.
    Text(usize, usize),
}

/// What rendering a value gave; a text was appended to the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rendered {
    Absent,
    Null,
    Text,
}

impl Shape {
    /// The shape `tme` describes, or why it cannot be read. Column names
    /// come from its optional metadata (`binlog_row_metadata = FULL`);
    /// without them no column can be read by name.
    pub(crate) fn new(tme: &TableMapEvent<'_>) -> Result<Shape, String> {
        let count = usize::try_from(tme.columns_count())
            .map_err(|_| "a table map with more columns than memory".to_owned())?;
        let mut names = Vec::new();
        let mut primary = Vec::new();
        // COLUMN_CHARSET lists every character column's set; DEFAULT_CHARSET
        // gives one and the exceptions, by position among those columns.
        let mut charsets: Vec<u16> = Vec::new();
        let mut default_charset = None;
        let mut exceptions: Vec<(u64, u16)> = Vec::new();
        let mut enums: Vec<Vec<String>> = Vec::new();
        let mut sets: Vec<Vec<String>> = Vec::new();
        // One flag per numeric column, in order: unsigned.
        let mut unsigned: Vec<bool> = Vec::new();
        for field in tme.iter_optional_meta() {
            let field = field.map_err(|e| format!("a table map's metadata: {e}"))?;
            match field {
                OptionalMetadataField::Signedness(flags) => {
                    unsigned.extend(flags.iter().by_vals());
                }
                OptionalMetadataField::ColumnName(n) => {
                    for name in n.iter_names() {
                        let name = name.map_err(|e| format!("a column name: {e}"))?;
                        names.push(String::from_utf8_lossy(name.name_raw()).into_owned());
                    }
                }
                OptionalMetadataField::SimplePrimaryKey(k) => {
                    for i in k.iter_indexes() {
                        primary.push(i.map_err(|e| format!("a primary key: {e}"))?);
                    }
                }
                OptionalMetadataField::PrimaryKeyWithPrefix(k) => {
                    for key in k.iter_keys() {
                        let key = key.map_err(|e| format!("a primary key: {e}"))?;
                        primary.push(key.column_index());
                    }
                }
                OptionalMetadataField::DefaultCharset(d) => {
                    default_charset = Some(d.default_charset());
                    for c in d.iter_non_default() {
                        let c = c.map_err(|e| format!("a charset: {e}"))?;
                        exceptions.push((c.column_index(), c.charset()));
                    }
                }
                OptionalMetadataField::ColumnCharset(c) => {
                    for c in c.iter_charsets() {
                        charsets.push(c.map_err(|e| format!("a charset: {e}"))?);
                    }
                }
                // Read here, not with mysql_common's `iter_values`: see
                // `labels`.
                OptionalMetadataField::EnumStrValue(v) => {
                    let mut raw = Vec::new();
                    v.serialize(&mut raw);
                    enums = labels(&raw).map_err(|e| format!("enum labels: {e}"))?;
                }
                OptionalMetadataField::SetStrValue(v) => {
                    let mut raw = Vec::new();
                    v.serialize(&mut raw);
                    sets = labels(&raw).map_err(|e| format!("set labels: {e}"))?;
                }
                _ => {}
            }
        }
        if names.len() != count {
            return Err(format!(
                "the table map of {}.{} names {} of its {count} columns: the server must log them (binlog_row_metadata = FULL)",
                tme.database_name(),
                tme.table_name(),
                names.len()
            ));
        }
        let mut kinds = Vec::with_capacity(count);
        let mut wire = Vec::with_capacity(count);
        let mut unsigned = unsigned.into_iter();
        for i in 0..count {
            let ty = tme.get_column_type(i).ok().flatten();
            let meta = tme.get_column_metadata(i).unwrap_or(&[]).to_vec();
            // As mysql_common's row decoder reads the flags: one per
            // numeric column, none for the others.
            let is_unsigned =
                ty.is_some_and(|t| t.is_numeric_type()) && unsigned.next().unwrap_or(false);
            wire.push((ty, meta, is_unsigned));
        }
        let mut character = 0usize;
        let (mut next_enum, mut next_set) = (0usize, 0usize);
        for i in 0..count {
            let ty = match tme.get_column_type(i) {
                Ok(Some(ty)) => ty,
                _ => {
                    kinds.push(Kind::Other);
                    continue;
                }
            };
            let kind = match ty {
                ColumnType::MYSQL_TYPE_ENUM => {
                    let k = enums
                        .get(next_enum)
                        .cloned()
                        .map_or(Kind::Other, Kind::Enum);
                    next_enum = next_enum.saturating_add(1);
                    k
                }
                ColumnType::MYSQL_TYPE_SET => {
                    let k = sets.get(next_set).cloned().map_or(Kind::Other, Kind::Set);
                    next_set = next_set.saturating_add(1);
                    k
                }
                t if t.is_character_type() => {
                    let charset = match default_charset {
                        Some(d) => exceptions
                            .iter()
                            .find(|(at, _)| usize::try_from(*at).ok() == Some(character))
                            .map_or(d, |(_, c)| *c),
                        None => charsets.get(character).copied().unwrap_or(0),
                    };
                    character = character.saturating_add(1);
                    if charset == BINARY {
                        Kind::Bytes
                    } else {
                        Kind::Text
                    }
                }
                ColumnType::MYSQL_TYPE_GEOMETRY => Kind::Bytes,
                ColumnType::MYSQL_TYPE_BIT => Kind::Bit,
                ColumnType::MYSQL_TYPE_DATE | ColumnType::MYSQL_TYPE_NEWDATE => Kind::Date,
                ColumnType::MYSQL_TYPE_DATETIME | ColumnType::MYSQL_TYPE_DATETIME2 => {
                    Kind::DateTime
                }
                ColumnType::MYSQL_TYPE_TIMESTAMP | ColumnType::MYSQL_TYPE_TIMESTAMP2 => {
                    Kind::Timestamp
                }
                ColumnType::MYSQL_TYPE_TIME | ColumnType::MYSQL_TYPE_TIME2 => Kind::Time,
                ColumnType::MYSQL_TYPE_JSON => Kind::Text,
                ColumnType::MYSQL_TYPE_TINY
                | ColumnType::MYSQL_TYPE_SHORT
                | ColumnType::MYSQL_TYPE_INT24
                | ColumnType::MYSQL_TYPE_LONG
                | ColumnType::MYSQL_TYPE_LONGLONG
                | ColumnType::MYSQL_TYPE_FLOAT
                | ColumnType::MYSQL_TYPE_DOUBLE
                | ColumnType::MYSQL_TYPE_NEWDECIMAL
                | ColumnType::MYSQL_TYPE_DECIMAL
                | ColumnType::MYSQL_TYPE_YEAR => Kind::Number,
                _ => Kind::Other,
            };
            kinds.push(kind);
        }
        let columns = names
            .into_iter()
            .enumerate()
            .map(|(i, name)| Column {
                name,
                identity: primary.iter().any(|&p| usize::try_from(p).ok() == Some(i)),
            })
            .collect();
        Ok(Shape {
            relation: Arc::new(Relation {
                id: 0,
                schema: tme.database_name().into_owned(),
                name: tme.table_name().into_owned(),
                // Every image carries the primary key, and FULL images the
                // whole row: see `Stream::rows`.
                replica_identity: b'd',
                columns,
            }),
            kinds,
            wire,
        })
    }

    /// Reads one row image from `buf` (as mysql_common's `BinlogRow`
    /// does, with its value decoder, without building the column
    /// descriptions it builds for every row): the cells of the columns
    /// `present` marks (`None`: all), their text appended to `text`.
    /// `cells` gets one per column of the table.
    pub(crate) fn decode(
        &self,
        present: Option<&[bool]>,
        buf: &mut ParseBuf<'_>,
        text: &mut Vec<u8>,
        cells: &mut Vec<Cell>,
    ) -> std::io::Result<()> {
        let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_owned());
        text.clear();
        cells.clear();
        cells.resize(self.wire.len(), Cell::Absent);
        let here = |i: usize| present.is_none_or(|p| p.get(i).copied().unwrap_or(false));
        // Read through a copy that lives no longer than the metadata the
        // value decoder borrows along with it; `buf` moves past what it
        // read at the end.
        let data = buf.0;
        let mut local = ParseBuf(data);
        let count = (0..self.wire.len()).filter(|&i| here(i)).count();
        let nulls: &[u8] = local.parse(count.div_ceil(8))?;
        let mut j = 0usize;
        for (i, ((ty, meta, unsigned), cell)) in self.wire.iter().zip(cells.iter_mut()).enumerate()
        {
            let Some(ty) = *ty else {
                return Err(bad("no column type"));
            };
            if !here(i) {
                continue;
            }
            // Bit j of the image's null bitmap, least significant first.
            let null = nulls
                .get(j / 8)
                .is_none_or(|byte| byte & (1u8 << (j % 8)) != 0);
            j = j.saturating_add(1);
            if null {
                *cell = Cell::Null;
                continue;
            }
            let value: BinlogValue<'_> = local.parse((ty, meta.as_slice(), *unsigned, false))?;
            let start = text.len();
            *cell = match self.render(i, &value, text) {
                Rendered::Absent => {
                    text.truncate(start);
                    Cell::Absent
                }
                Rendered::Null => Cell::Null,
                Rendered::Text => Cell::Text(start, text.len()),
            };
        }
        let read = data.len().saturating_sub(local.0.len());
        buf.0 = data.get(read..).unwrap_or(&[]);
        Ok(())
    }

    /// The number of columns.
    pub(crate) fn len(&self) -> usize {
        self.kinds.len()
    }

    /// Column `i`'s value as text, appended to `out` (rows are rendered
    /// into one buffer reused from row to row: no allocation per cell).
    pub(super) fn render(&self, i: usize, value: &BinlogValue<'_>, out: &mut Vec<u8>) -> Rendered {
        let kind = self.kinds.get(i).unwrap_or(&Kind::Other);
        let value = match value {
            BinlogValue::Value(v) => v,
            BinlogValue::Jsonb(j) => {
                return match serde_json::Value::try_from(j.clone()) {
                    Ok(v) => {
                        out.extend_from_slice(v.to_string().as_bytes());
                        Rendered::Text
                    }
                    Err(_) => Rendered::Absent,
                };
            }
            // A partial JSON update names a path, not the value.
            BinlogValue::JsonDiff(_) => return Rendered::Absent,
        };
        render(kind, value, out)
    }
}

/// The labels of each ENUM (or SET) column, as the optional metadata's
/// ENUM_STR_VALUE (SET_STR_VALUE) field lists them: for each column a
/// count, then each label after its length. mysql_common's `iter_values`
/// reads the same, but first reserves room for as many labels as the count
/// claims: a count off the wire (up to 2^64) made that a capacity overflow
/// panic, or an allocation that aborts the process. Here every label is
/// read before it is kept, so what is kept is no larger than the bytes.
fn labels(raw: &[u8]) -> Result<Vec<Vec<String>>, &'static str> {
    let mut buf = ParseBuf(raw);
    let mut columns = Vec::new();
    while !buf.is_empty() {
        let count = buf.checked_eat_lenenc_int().ok_or("a count past the end")?;
        let mut labels = Vec::new();
        // Each label takes a byte at least: the loop ends with the bytes.
        for _ in 0..count {
            let label = buf.checked_eat_lenenc_str().ok_or("a label past the end")?;
            labels.push(String::from_utf8_lossy(label).into_owned());
        }
        columns.push(labels);
    }
    Ok(columns)
}

/// `value` as `kind`'s text, appended to `out`. The common cases (strings,
/// numbers) are written in place; the rarer ones go through a `String`.
fn render(kind: &Kind, value: &Value, out: &mut Vec<u8>) -> Rendered {
    // Writing into a Vec cannot fail.
    let text = match (kind, value) {
        (_, Value::NULL) => return Rendered::Null,
        (Kind::Other, _) => return Rendered::Absent,
        (Kind::Text | Kind::Number, Value::Bytes(b)) => {
            out.extend_from_slice(b);
            return Rendered::Text;
        }
        (Kind::Text | Kind::Number, Value::Int(i)) => {
            let _ = write!(out, "{i}");
            return Rendered::Text;
        }
        (Kind::Text | Kind::Number, Value::UInt(u)) => {
            let _ = write!(out, "{u}");
            return Rendered::Text;
        }
        (Kind::Enum(labels), Value::Int(i)) => {
            // 1-based; 0 is the empty string an invalid value stores.
            match usize::try_from(*i) {
                Ok(0) => String::new(),
                Ok(n) => match n.checked_sub(1).and_then(|i| labels.get(i)) {
                    Some(l) => l.clone(),
                    None => return Rendered::Absent,
                },
                Err(_) => return Rendered::Absent,
            }
        }
        (Kind::Set(labels), Value::Bytes(b)) => {
            let mut bits = 0u64;
            // Little-endian, at most 64 members.
            for byte in b.iter().take(8).rev() {
                bits = bits.wrapping_shl(8) | u64::from(*byte);
            }
            let chosen: Vec<&str> = labels
                .iter()
                .enumerate()
                .filter(|(k, _)| {
                    u32::try_from(*k)
                        .ok()
                        .and_then(|k| 1u64.checked_shl(k))
                        .is_some_and(|bit| bits & bit != 0)
                })
                .map(|(_, l)| l.as_str())
                .collect();
            chosen.join(",")
        }
        (Kind::Bit, Value::Bytes(b)) => {
            if b.len() > 8 {
                return Rendered::Absent;
            }
            b.iter()
                .fold(0u64, |n, byte| n.wrapping_shl(8) | u64::from(*byte))
                .to_string()
        }
        (Kind::Bytes, Value::Bytes(b)) => {
            let mut s = String::with_capacity(b.len().saturating_mul(2).saturating_add(2));
            s.push_str("\\x");
            for byte in b {
                s.push_str(&format!("{byte:02x}"));
            }
            s
        }
        (Kind::Timestamp, Value::Int(secs)) => datetime_utc(*secs, 0),
        (Kind::Timestamp, Value::Bytes(b)) => {
            // `secs` or `secs.micros`, as mysql_common renders TIMESTAMP2.
            let Ok(s) = std::str::from_utf8(b) else {
                return Rendered::Absent;
            };
            let (secs, micros) = s.split_once('.').unwrap_or((s, "0"));
            match (secs.parse::<i64>(), micros.parse::<u32>()) {
                (Ok(secs), Ok(micros)) => datetime_utc(secs, micros),
                _ => return Rendered::Absent,
            }
        }
        (Kind::Date, Value::Date(y, m, d, ..)) => format!("{y:04}-{m:02}-{d:02}"),
        (Kind::DateTime, Value::Date(y, mo, d, h, mi, s, us)) => {
            format!(
                "{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}{}",
                fraction(*us)
            )
        }
        (Kind::Time, Value::Time(negative, days, h, m, s, us)) => {
            let hours = u64::from(*days)
                .saturating_mul(24)
                .saturating_add(u64::from(*h));
            format!(
                "{}{hours:02}:{m:02}:{s:02}{}",
                if *negative { "-" } else { "" },
                fraction(*us)
            )
        }
        (_, Value::Int(i)) => i.to_string(),
        (_, Value::UInt(u)) => u.to_string(),
        (_, Value::Float(f)) => f.to_string(),
        (_, Value::Double(f)) => f.to_string(),
        _ => return Rendered::Absent,
    };
    out.extend_from_slice(text.as_bytes());
    Rendered::Text
}

fn fraction(micros: u32) -> String {
    if micros == 0 {
        String::new()
    } else {
        format!(".{micros:06}")
    }
}

// `days` is a number of seconds divided by 86,400: under 2^47 either
// way, so no step of these two overflows an i64.
#[allow(clippy::arithmetic_side_effects)]
/// `secs` since 1970-01-01 UTC as `YYYY-MM-DD HH:MM:SS[.ffffff]`.
fn datetime_utc(secs: i64, micros: u32) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}{}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        fraction(micros)
    )
}

#[allow(clippy::arithmetic_side_effects)]
/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 1..=31, 1..=12
    (y, m as u32, d as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(kind: &Kind, value: Value) -> String {
        let mut out = b"before".to_vec();
        match render(kind, &value, &mut out) {
            Rendered::Text => String::from_utf8(out.split_off(6)).unwrap(),
            other => panic!("{other:?}"),
        }
    }

    fn cell(kind: &Kind, value: Value) -> Rendered {
        render(kind, &value, &mut Vec::new())
    }

    #[test]
    fn values_render_as_their_meaning() {
        assert_eq!(text(&Kind::Number, Value::Int(-7)), "-7");
        assert_eq!(
            text(&Kind::Number, Value::UInt(u64::MAX)),
            u64::MAX.to_string()
        );
        assert_eq!(
            text(&Kind::Number, Value::Bytes(b"12.50".to_vec())),
            "12.50"
        );
        assert_eq!(
            text(&Kind::Bytes, Value::Bytes(vec![0, 0xff, 0x10])),
            "\\x00ff10"
        );
        assert_eq!(
            text(&Kind::Enum(vec!["a".into(), "b".into()]), Value::Int(2)),
            "b"
        );
        assert_eq!(
            cell(&Kind::Enum(vec!["a".into()]), Value::Int(5)),
            Rendered::Absent
        );
        assert_eq!(
            text(
                &Kind::Set(vec!["x".into(), "y".into(), "z".into()]),
                Value::Bytes(vec![0b101])
            ),
            "x,z"
        );
        assert_eq!(text(&Kind::Bit, Value::Bytes(vec![1, 2])), "258");
        assert_eq!(
            text(&Kind::Date, Value::Date(2026, 1, 2, 0, 0, 0, 0)),
            "2026-01-02"
        );
        assert_eq!(
            text(&Kind::DateTime, Value::Date(2026, 1, 2, 3, 4, 5, 60)),
            "2026-01-02 03:04:05.000060"
        );
        assert_eq!(
            text(&Kind::Time, Value::Time(true, 1, 2, 3, 4, 0)),
            "-26:03:04"
        );
        assert_eq!(
            text(&Kind::Timestamp, Value::Bytes(b"0".to_vec())),
            "1970-01-01 00:00:00"
        );
        assert_eq!(
            text(&Kind::Timestamp, Value::Bytes(b"1700000000.5".to_vec())),
            "2023-11-14 22:13:20.000005"
        );
        assert_eq!(text(&Kind::Text, Value::Int(-3)), "-3");
        assert_eq!(cell(&Kind::Text, Value::NULL), Rendered::Null);
        assert_eq!(cell(&Kind::Other, Value::Int(1)), Rendered::Absent);
    }

    /// A TABLE_MAP event's body of one ENUM column `e`, with `labels` as
    /// its optional metadata's ENUM_STR_VALUE.
    fn enum_table_map(labels: &[u8]) -> Vec<u8> {
        let mut b = vec![1, 0, 0, 0, 0, 0, 1, 0, 1, b'd', 0, 1, b't', 0];
        // One column: STRING, its metadata ENUM of one byte, nullable.
        b.extend([1, 254, 2, 0xf7, 1, 1]);
        b.extend([4, 2, 1, b'e']); // COLUMN_NAME
        b.push(6); // ENUM_STR_VALUE
        b.push(u8::try_from(labels.len()).unwrap());
        b.extend(labels);
        b
    }

    fn shape_of(body: &[u8]) -> Result<Shape, String> {
        use mysql_common::binlog::BinlogCtx;
        use mysql_common::binlog::consts::{BinlogVersion, EventType};
        use mysql_common::binlog::events::FormatDescriptionEvent;

        let fde = FormatDescriptionEvent::new(BinlogVersion::Version4);
        let ctx = BinlogCtx::new(19 + body.len(), &fde, EventType::TABLE_MAP_EVENT as u8);
        let tme: TableMapEvent<'_> = ParseBuf(body).parse(ctx).unwrap();
        Shape::new(&tme)
    }

    /// Found by the `binlog_rows` fuzz target: an ENUM_STR_VALUE whose
    /// count claims 2^64 - 1 labels panicked with a capacity overflow in
    /// mysql_common (outside the relay's `catch_unwind`); a count of
    /// millions reserved their room before reading one.
    #[test]
    fn enum_label_counts_larger_than_their_bytes_are_refused() {
        let shape = shape_of(&enum_table_map(&[2, 3, b's', b'a', b'd', 2, b'o', b'k'])).unwrap();
        assert_eq!(
            shape.kinds,
            vec![Kind::Enum(vec!["sad".into(), "ok".into()])]
        );
        let mut huge = vec![0xfe];
        huge.extend(u64::MAX.to_le_bytes());
        huge.extend([1, b'x']);
        let why = shape_of(&enum_table_map(&huge)).unwrap_err();
        assert!(why.contains("a label past the end"), "{why}");
        let why = shape_of(&enum_table_map(&[0xfd, 0xff, 0xff, 0xff])).unwrap_err();
        assert!(why.contains("a label past the end"), "{why}");
        // Labels of no column, and a count that is not there.
        assert!(shape_of(&enum_table_map(&[0xfc, 1])).is_err());
    }

    #[test]
    fn dates_far_from_the_epoch_and_at_the_edges_never_panic() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(-1), (1969, 12, 31));
        assert_eq!(civil(19_723), (2024, 1, 1));
        assert_eq!(civil(2_932_896), (9999, 12, 31));
        for secs in [i64::MIN / 2, -1, 0, 1, i64::from(u32::MAX), i64::MAX / 2] {
            let _ = datetime_utc(secs, 999_999);
        }
    }
}
