//! A change as a node reads it: checked whole, then walked in place.

#[cfg(any(test, feature = "_fuzz"))]
use bytes::Bytes;

use super::reader::Reader;
#[cfg(any(test, feature = "_fuzz"))]
use super::{Change, EntryVersion, KeyVersion};
use crate::error::{DecodeError, Result};

/// What changed, as a node reads it: checked whole when it is read, then
/// walked in place, so applying an event copies no key or value bytes and
/// allocates nothing of its own.
#[derive(Debug, Clone)]
pub(crate) enum ChangeView<'a> {
    Invalidate(Items<'a>),
    Refresh(Items<'a>),
    Clear {
        version: Option<u64>,
    },
    /// An empty invalidation: the publisher's last sequence number for the
    /// cache, repeated (see the module docs). It changes no entry.
    Announce,
}

/// One key of an invalidation or one entry of a refresh. An invalidation's
/// items have an empty `value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Item<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) value: &'a [u8],
    pub(crate) version: Option<u64>,
}

/// The items of a change, read one at a time from bytes already checked.
#[derive(Debug, Clone)]
pub(crate) struct Items<'a> {
    /// Read while checking, so that a one-entry change, the usual kind, is
    /// not read twice.
    first: Option<Item<'a>>,
    /// After `first`.
    reader: Reader<'a>,
    pub(super) left: u64,
    values: bool,
}

impl<'a> Items<'a> {
    /// Reads the item count and checks every item, leaving the reader
    /// after the last one.
    pub(super) fn check(reader: &mut Reader<'a>, values: bool) -> Result<Self, DecodeError> {
        let count = reader.u64()?;
        let first = match count {
            0 => None,
            _ => Some(Self::read(reader, values)?),
        };
        let items = Self {
            first,
            reader: reader.clone(),
            left: count,
            values,
        };
        // Each read takes at least two bytes or fails, so a forged count
        // ends at the end of the payload.
        for _ in 1..count {
            Self::read(reader, values)?;
        }
        Ok(items)
    }

    fn read(reader: &mut Reader<'a>, values: bool) -> Result<Item<'a>, DecodeError> {
        let key = reader.bytes()?;
        let value = if values { reader.bytes()? } else { &[][..] };
        let version = reader.option_u64()?;
        Ok(Item {
            key,
            value,
            version,
        })
    }
}

impl Items<'_> {
    /// How many items are left to read.
    pub(crate) fn remaining(&self) -> usize {
        usize::try_from(self.left).unwrap_or(usize::MAX)
    }
}

impl<'a> Iterator for Items<'a> {
    type Item = Item<'a>;

    fn next(&mut self) -> Option<Item<'a>> {
        self.left = self.left.checked_sub(1)?;
        if let Some(first) = self.first.take() {
            return Some(first);
        }
        // Checked when the change was read, so this cannot fail; were it to,
        // the walk would end early, never read out of bounds.
        Self::read(&mut self.reader, self.values).ok()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, usize::try_from(self.left).ok())
    }
}

impl ChangeView<'_> {
    /// The change as a publisher would have built it.
    #[cfg(any(test, feature = "_fuzz"))]
    pub(crate) fn to_change(&self) -> Change {
        let copy = |b: &[u8]| Bytes::copy_from_slice(b);
        match self {
            ChangeView::Invalidate(items) => Change::Invalidate {
                keys: items
                    .clone()
                    .map(|i| KeyVersion {
                        key: copy(i.key),
                        version: i.version,
                    })
                    .collect(),
            },
            ChangeView::Refresh(items) => Change::Refresh {
                entries: items
                    .clone()
                    .map(|i| EntryVersion {
                        key: copy(i.key),
                        value: copy(i.value),
                        version: i.version,
                    })
                    .collect(),
            },
            ChangeView::Clear { version } => Change::Clear { version: *version },
            ChangeView::Announce => Change::ANNOUNCE,
        }
    }
}
