//! Writing bincode 2's standard encoding straight into a buffer: varints,
//! byte strings, options, and serde values in place, with the sizes each
//! takes (the counterpart of `reader.rs`).

use bincode::enc::write::Writer;
use serde::Serialize;

use super::wire_config;
use crate::error::{Error, Result};

/// Bytes bincode 2's varint takes for `n`: one up to 250, else a marker
/// and two, four or eight little-endian bytes (see `Reader::varint`).
pub(super) fn varint_len(n: u64) -> usize {
    if n <= 250 {
        1
    } else if n <= u64::from(u16::MAX) {
        3
    } else if n <= u64::from(u32::MAX) {
        5
    } else {
        9
    }
}

/// A varint as bincode 2 writes it, and how many of the nine bytes it takes.
fn varint(n: u64) -> ([u8; 9], usize) {
    let mut b = [0u8; 9];
    let le = n.to_le_bytes();
    let used = varint_len(n);
    match used {
        1 => b[0] = le[0],
        _ => {
            b[0] = match used {
                3 => 251,
                5 => 252,
                _ => 253,
            };
            // The value fits the width `varint_len` picked, so these are
            // its low bytes and the rest are zero.
            for (dst, src) in b.iter_mut().skip(1).zip(le).take(used.saturating_sub(1)) {
                *dst = src;
            }
        }
    }
    (b, used)
}

/// [`varint`], written with fixed-size copies: a copy of a length known
/// only at run time is a call to `memcpy`, dearer than the write itself.
#[inline(always)]
pub(super) fn put_varint(out: &mut Vec<u8>, n: u64) {
    let le = n.to_le_bytes();
    match n {
        0..=250 => out.push(le[0]),
        251..=0xFFFF => out.extend_from_slice(&[251, le[0], le[1]]),
        0x1_0000..=0xFFFF_FFFF => out.extend_from_slice(&[252, le[0], le[1], le[2], le[3]]),
        _ => {
            out.push(253);
            out.extend_from_slice(&le);
        }
    }
}

/// A byte string's size on the wire: its length, then its bytes.
pub(super) fn bytes_len(len: usize) -> usize {
    varint_len(u64::try_from(len).unwrap_or(u64::MAX)).saturating_add(len)
}

#[inline(always)]
pub(super) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_varint(out, u64::try_from(bytes.len()).unwrap_or(u64::MAX));
    out.extend_from_slice(bytes);
}

pub(super) fn option_len(n: Option<u64>) -> usize {
    n.map_or(1, |n| varint_len(n).saturating_add(1))
}

#[inline(always)]
pub(super) fn put_option(out: &mut Vec<u8>, n: Option<u64>) {
    match n {
        None => out.push(0),
        Some(n) => {
            out.push(1);
            put_varint(out, n);
        }
    }
}

/// bincode writing straight into a buffer of ours.
struct VecWriter<'a>(&'a mut Vec<u8>);

impl Writer for VecWriter<'_> {
    #[inline]
    fn write(&mut self, bytes: &[u8]) -> std::result::Result<(), bincode::error::EncodeError> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }
}

/// Writes `value`'s bincode encoding as a byte string (its length, then its
/// bytes: what `encode_part`'s `Bytes` serialises to), in place. The length
/// is only known afterwards: one byte is set aside for it, which is all it
/// takes under 251 bytes; a longer encoding is moved up to make room.
/// Returns the encoding's length.
pub(super) fn put_part<T: Serialize + ?Sized>(
    out: &mut Vec<u8>,
    value: &T,
    what: &'static str,
) -> Result<usize> {
    let at = out.len();
    out.push(0);
    bincode::serde::encode_into_writer(value, VecWriter(out), wire_config()).map_err(|e| {
        Error::Encode {
            what,
            message: e.to_string(),
        }
    })?;
    let len = out.len().saturating_sub(at).saturating_sub(1);
    match u8::try_from(len) {
        Ok(short @ 0..=250) => {
            if let Some(b) = out.get_mut(at) {
                *b = short;
            }
        }
        _ => {
            let (prefix, used) = varint(u64::try_from(len).unwrap_or(u64::MAX));
            out.splice(
                at..=at,
                prefix.get(..used).unwrap_or_default().iter().copied(),
            );
        }
    }
    Ok(len)
}
