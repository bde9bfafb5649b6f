//! The outbox's row format: a change as the database outbox stores it, and
//! the relay reads it back. A format byte, then the bincode-2 `Change`.
//! Here rather than in `outbox/`, so that its decoder is fuzzed without a
//! database client.

use crate::error::{DecodeError, DecodeErrorKind, Error, Result};

use super::{Change, MAX_EVENT_BYTES_CEILING};

/// The first byte of every row's `change`: the row format, so that a later
/// release can change it and an old relay recognises what it cannot read.
const ROW_FORMAT_V1: u8 = 1;

fn row_config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_EVENT_BYTES_CEILING>()
}

pub(crate) fn encode_row(change: &Change, limit: usize) -> Result<Vec<u8>> {
    let mut row = vec![ROW_FORMAT_V1];
    bincode::serde::encode_into_std_write(change, &mut row, row_config()).map_err(|e| {
        Error::Encode {
            what: "event",
            message: e.to_string(),
        }
    })?;
    if row.len() > limit {
        return Err(Error::TooLarge {
            what: "event",
            size: row.len(),
            limit,
        });
    }
    Ok(row)
}

/// Reads a row's change. Bounded: the row's length is checked against the
/// limit before anything is read, and serde's sequence visitors preallocate
/// no more than a small cap whatever a length prefix claims.
pub(crate) fn decode_row(row: &[u8], limit: usize) -> Result<Change, DecodeError> {
    let malformed = |m: String| DecodeError::new(DecodeErrorKind::Malformed(m));
    if row.len() > limit {
        return Err(DecodeError::new(DecodeErrorKind::TooLarge {
            size: row.len(),
            limit,
        }));
    }
    let (&format, body) = row
        .split_first()
        .ok_or(DecodeError::new(DecodeErrorKind::Empty))?;
    if format != ROW_FORMAT_V1 {
        return Err(DecodeError::new(DecodeErrorKind::UnknownFormat(format)));
    }
    let (change, used) = bincode::serde::decode_from_slice::<Change, _>(body, row_config())
        .map_err(|e| malformed(e.to_string()))?;
    if used != body.len() {
        return Err(DecodeError::new(DecodeErrorKind::TrailingBytes(
            body.len().saturating_sub(used),
        )));
    }
    Ok(change)
}
