//! How the auditor compares values: its equality, and the fingerprints
//! of their encodings that a sweep keeps instead of the values.

use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroU64;

use bytes::Bytes;
use serde::Serialize;

/// How values are compared, where they are: the audit's equality, and the
/// encoding the sweep's fingerprints hash. Set together where
/// `V: PartialEq + Serialize` is known (`by_value`, `compare_values`).
pub(super) struct Values<V> {
    pub(super) same: fn(&V, &V) -> bool,
    pub(super) encode: fn(&V) -> Option<Bytes>,
}

impl<V> Clone for Values<V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for Values<V> {}

impl<V> Values<V> {
    pub(super) fn of() -> Self
    where
        V: PartialEq + Serialize,
    {
        Self {
            same: same_value::<V>,
            encode: encode_value::<V>,
        }
    }
}

/// A value's encoding: the wire's, which [`same_value`] compares and the
/// sweep's fingerprints hash; `None` if it does not encode.
fn encode_value<V: Serialize>(value: &V) -> Option<Bytes> {
    crate::wire::encode_part(value, "value").ok()
}

/// The audit's equality (see
/// [`Audit::compare_values`](super::Audit::compare_values)): `PartialEq`,
/// or the same encoding. A value that does not encode is judged by
/// `PartialEq` alone.
fn same_value<V: PartialEq + Serialize>(held: &V, source: &V) -> bool {
    if held == source {
        return true;
    }
    match (encode_value(held), encode_value(source)) {
        (Some(h), Some(s)) => h == s,
        _ => false,
    }
}

/// A value's fingerprint: its encoding hashed with the auditor's keyed
/// hash (SipHash-1-3, `std`'s, its key drawn at random per auditor, so
/// no writer can aim at a collision), never 0, so that `Option` of it is
/// 8 bytes. Equal encodings have equal fingerprints; different ones share
/// one with a chance of about 2⁻⁶⁴. `None` for a value that does not
/// encode.
pub(super) fn fingerprint<V>(
    values: Values<V>,
    hash: &RandomState,
    value: &V,
) -> Option<NonZeroU64> {
    let encoded = (values.encode)(value)?;
    Some(NonZeroU64::new(hash.hash_one(&encoded[..])).unwrap_or(NonZeroU64::MIN))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 35, item 10: the audit's equality is `PartialEq` or the same
    /// encoding, so a NaN equals itself and truly different values differ.
    #[test]
    fn values_compare_equal_by_partial_eq_or_encoding() {
        let nan = f64::NAN;
        assert!(same_value(&nan, &nan));
        assert!(same_value(&(nan, 1u32), &(nan, 1u32)));
        assert!(!same_value(&(nan, 1u32), &(nan, 2u32)));
        assert!(!same_value(&nan, &1.0));
        assert!(!same_value(&nan, &-nan), "another NaN's bits");
        assert!(same_value(&0.0f64, &-0.0f64), "PartialEq's equal");
        assert!(same_value(&"a".to_owned(), &"a".to_owned()));
        assert!(!same_value(&"a".to_owned(), &"b".to_owned()));
    }

    /// A fingerprint is the encoding's: equal for values that encode
    /// alike (a NaN included, which `PartialEq` denies), different for
    /// values that do not (0.0 and -0.0, which `PartialEq` calls equal,
    /// are then read and compared by `same_value`); none for a value that
    /// does not encode; and 8 bytes, `None` included.
    #[test]
    fn fingerprints_follow_the_encoding() {
        assert_eq!(std::mem::size_of::<Option<NonZeroU64>>(), 8);
        let hash = RandomState::new();
        let f = |v: &(f64, String)| fingerprint(Values::of(), &hash, v);
        let nan = f64::NAN;
        assert!(f(&(nan, "a".into())).is_some());
        assert_eq!(f(&(nan, "a".into())), f(&(nan, "a".into())));
        assert_ne!(f(&(nan, "a".into())), f(&(nan, "b".into())));
        assert_ne!(f(&(nan, "a".into())), f(&(-nan, "a".into())));
        assert_ne!(f(&(0.0, "a".into())), f(&(-0.0, "a".into())));
        // No encoding, so no fingerprint.
        #[derive(PartialEq)]
        struct Refuses;
        impl Serialize for Refuses {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("refused"))
            }
        }
        assert_eq!(fingerprint(Values::of(), &hash, &Refuses), None);
    }
}
