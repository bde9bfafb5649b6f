//! Topic and cache names: the rule every transport accepts, and the escaping
//! that maps them one-to-one onto each broker's own resource names.
//!
//! A name is what the application chose (`"catalog"`, `"tenant.a"`, a cache
//! called `"feature flags"`). Brokers restrict their resource names, and
//! some characters mean something to them (`.` `*` `>` in NATS subjects, `:`
//! in the Redis keys this crate derives, `||` in RocketMQ tag expressions).
//! Replacing such characters with `_` made `tenant.a` and `tenant_a` share
//! one NATS stream; escaping keeps the mapping injective, so two names
//! never share a resource.

use std::borrow::Cow;
use std::fmt::Write as _;

use crate::error::{Error, Result};
use crate::wire::MAX_NAME_BYTES;

/// What a name is, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NameKind {
    Topic,
    Cache,
}

impl NameKind {
    fn label(self) -> &'static str {
        match self {
            NameKind::Topic => "topic",
            NameKind::Cache => "cache",
        }
    }
}

/// The rule every transport applies: 1 to 255 bytes of UTF-8 with no control
/// characters. Transports add limits of their own, such as the length of the
/// resource name a topic escapes to.
pub(crate) fn check(kind: NameKind, name: &str) -> Result<()> {
    if name.is_empty() || name.len() > MAX_NAME_BYTES {
        return Err(invalid(
            kind,
            name,
            format_args!("a name is 1 to {MAX_NAME_BYTES} bytes, not {}", name.len()),
        ));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(invalid(
            kind,
            name,
            format_args!("a name holds no control characters, and this one holds {c:?}"),
        ));
    }
    Ok(())
}

/// A configuration error that names the rule a name broke. Long names are
/// shortened in the message; the rule says how long they were.
pub(crate) fn invalid(kind: NameKind, name: &str, rule: impl std::fmt::Display) -> Error {
    let shown: String = name.chars().take(64).collect();
    let ellipsis = if shown.len() < name.len() { "…" } else { "" };
    Error::Config(format!(
        "{} name {shown:?}{ellipsis} is not allowed: {rule}",
        kind.label()
    ))
}

/// Spells every byte of every character that `keep` refuses as `%XX`, and
/// `%` itself as `%25`, so the result is injective: [`unescape`] gives the
/// name back. Names made only of kept characters come out unchanged, so
/// existing resource names stay as they were.
#[cfg_attr(not(any(feature = "redis", feature = "rocketmq")), allow(dead_code))]
pub(crate) fn escape(name: &str, keep: impl Fn(char) -> bool) -> Cow<'_, str> {
    escape_with(name, b'%', keep)
}

/// [`escape`] with another marker than `%`: NATS servers (2.10) format a
/// stream's name into its acknowledgement subjects as a format string, so a
/// `%` there breaks every message's reply subject.
#[cfg_attr(
    not(any(feature = "redis", feature = "rocketmq", feature = "nats")),
    allow(dead_code)
)]
pub(crate) fn escape_with(name: &str, marker: u8, keep: impl Fn(char) -> bool) -> Cow<'_, str> {
    let marker = char::from(marker);
    if name.chars().all(|c| c != marker && keep(c)) {
        return Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len().saturating_add(8));
    let mut utf8 = [0u8; 4];
    for c in name.chars() {
        if c != marker && keep(c) {
            out.push(c);
        } else {
            for b in c.encode_utf8(&mut utf8).bytes() {
                let _ = write!(out, "{marker}{b:02X}");
            }
        }
    }
    Cow::Owned(out)
}

/// The inverse of [`escape`]; `None` for text no escape produced (a bad
/// `%` sequence, or bytes that are not UTF-8).
#[cfg_attr(not(feature = "rocketmq"), allow(dead_code))]
pub(crate) fn unescape(text: &str) -> Option<Cow<'_, str>> {
    unescape_with(text, b'%')
}

/// The inverse of [`escape_with`].
#[cfg_attr(not(any(feature = "rocketmq", feature = "nats")), allow(dead_code))]
pub(crate) fn unescape_with(text: &str, marker: u8) -> Option<Cow<'_, str>> {
    if !text.as_bytes().contains(&marker) {
        return Some(Cow::Borrowed(text));
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == marker {
            let hex = bytes.get(i.checked_add(1)?..i.checked_add(3)?)?;
            let hex = std::str::from_utf8(hex).ok()?;
            // Only the upper-case form `escape` writes: a second spelling of
            // one byte would make two texts decode to one name.
            if hex.bytes().any(|h| h.is_ascii_lowercase()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i = i.saturating_add(3);
        } else {
            out.push(b);
            i = i.saturating_add(1);
        }
    }
    String::from_utf8(out).ok().map(Cow::Owned)
}

/// ASCII letters, digits, `-` and `_`: safe in every broker's names.
#[cfg_attr(not(feature = "rocketmq"), allow(dead_code))]
pub(crate) fn plain(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_common_rule() {
        assert!(check(NameKind::Topic, "catalog").is_ok());
        assert!(check(NameKind::Topic, "tenant.a > *: x ü").is_ok());
        for bad in ["", "a\0b", "a\nb", "\u{7f}"] {
            let err = check(NameKind::Cache, bad).unwrap_err();
            assert!(err.is_config(), "{err}");
            assert!(err.to_string().contains("cache name"), "{err}");
        }
        let long = "x".repeat(300);
        let err = check(NameKind::Topic, &long).unwrap_err().to_string();
        assert!(err.contains("1 to 255 bytes, not 300"), "{err}");
        assert!(err.len() < 200, "the message shortens the name: {err}");
    }

    #[test]
    fn plain_names_are_unchanged_and_others_escape() {
        assert_eq!(escape("catalog", plain), "catalog");
        assert_eq!(escape("tenant.a", plain), "tenant%2Ea");
        assert_eq!(escape("100%", plain), "100%25");
        assert_eq!(escape("ü", plain), "%C3%BC");
        assert_eq!(unescape("tenant%2Ea").as_deref(), Some("tenant.a"));
        for bad in ["%", "%2", "%zz", "%2e", "%FF"] {
            assert_eq!(unescape(bad), None, "{bad}");
        }
    }

    proptest! {
        #[test]
        fn escaping_is_injective_and_reversible(a in "\\PC{0,12}", b in "\\PC{0,12}") {
            let (ea, eb) = (escape(&a, plain), escape(&b, plain));
            prop_assert!(ea.chars().all(|c| plain(c) || c == '%'));
            let back = unescape(&ea);
            prop_assert_eq!(back.as_deref(), Some(a.as_str()));
            prop_assert_eq!(a == b, ea == eb);
        }
    }
}
