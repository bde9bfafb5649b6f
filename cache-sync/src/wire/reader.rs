//! Reading bincode 2's standard encoding in place, checking each length
//! against what is left, so a decode copies nothing and claims no memory
//! a payload did not bring.

use crate::error::{DecodeError, DecodeErrorKind, Result};

/// Reads the envelope's bincode values in place, one after another.
///
/// bincode's own decoder builds a reader and decoder per value and takes a
/// slow path for every varint within nine bytes of the end; reading the
/// envelope with it cost about a third of applying an event. This reads the
/// same format (bincode 2's standard config: little-endian, varint
/// integers) directly: a varint is one byte up to 250, or a marker (251,
/// 252, 253 for u16, u32, u64) and that many little-endian bytes; a length
/// prefix is a u64 varint; an `Option` is a 0 or 1 byte, then the value.
/// Lengths are checked against the bytes left, so a forged prefix cannot
/// reach past the payload, whose size the codec has already bounded. The
/// keys and values inside are still decoded by bincode, with its limit.
/// `cargo test` checks it against bincode on random values and bytes.
#[derive(Debug, Clone)]
pub(super) struct Reader<'a> {
    pub(super) rest: &'a [u8],
}

impl<'a> Reader<'a> {
    #[cold]
    pub(super) fn malformed(what: &str) -> DecodeError {
        DecodeError::new(DecodeErrorKind::Malformed(what.to_owned()))
    }

    #[inline(always)]
    pub(super) fn take_n(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.rest.len() {
            return Err(Self::malformed("unexpected end of event"));
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    #[inline(always)]
    pub(super) fn byte(&mut self) -> Result<u8, DecodeError> {
        let (&b, rest) = self
            .rest
            .split_first()
            .ok_or_else(|| Self::malformed("unexpected end of event"))?;
        self.rest = rest;
        Ok(b)
    }

    /// A varint of at most `widest` bytes (2, 4 or 8).
    #[inline(always)]
    pub(super) fn varint(&mut self, widest: usize) -> Result<u64, DecodeError> {
        let Some((&first, tail)) = self.rest.split_first() else {
            return Err(Self::malformed("unexpected end of event"));
        };
        // Each arm reads a fixed width, so none becomes a call to memcpy.
        let (value, used) = match first {
            0..=250 => (Some(u64::from(first)), 0),
            251 => (
                tail.first_chunk()
                    .map(|b| u64::from(u16::from_le_bytes(*b))),
                2,
            ),
            252 if widest >= 4 => (
                tail.first_chunk()
                    .map(|b| u64::from(u32::from_le_bytes(*b))),
                4,
            ),
            253 if widest >= 8 => (tail.first_chunk().map(|b| u64::from_le_bytes(*b)), 8),
            b => return Err(Self::bad_marker(b)),
        };
        let value = value.ok_or_else(|| Self::malformed("unexpected end of event"))?;
        self.rest = tail.get(used..).unwrap_or_default();
        Ok(value)
    }

    #[cold]
    pub(super) fn bad_marker(b: u8) -> DecodeError {
        Self::malformed(&format!("invalid varint marker {b}"))
    }

    #[inline(always)]
    pub(super) fn u64(&mut self) -> Result<u64, DecodeError> {
        self.varint(8)
    }

    pub(super) fn u32(&mut self) -> Result<u32, DecodeError> {
        // At most four bytes were read, so it fits.
        u32::try_from(self.varint(4)?).map_err(|_| Self::malformed("u32 out of range"))
    }

    #[inline(always)]
    pub(super) fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let len = self.u64()?;
        let len = usize::try_from(len).map_err(|_| Self::malformed("length out of range"))?;
        self.take_n(len)
    }

    pub(super) fn str_expecting(
        &mut self,
        expected: Option<&'a str>,
    ) -> Result<&'a str, DecodeError> {
        let bytes = self.bytes()?;
        match expected {
            Some(known) if known.as_bytes() == bytes => Ok(known),
            _ => std::str::from_utf8(bytes).map_err(|e| Self::malformed(&e.to_string())),
        }
    }

    pub(super) fn option_u64(&mut self) -> Result<Option<u64>, DecodeError> {
        match self.byte()? {
            0 => Ok(None),
            1 => self.u64().map(Some),
            b => Err(Self::malformed(&format!("invalid option tag {b}"))),
        }
    }
}
