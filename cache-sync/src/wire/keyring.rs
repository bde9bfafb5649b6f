//! Signed events: HMAC-SHA256 over the whole encoded event, with a key id so
//! keys can be rotated.
//!
//! A signed payload wraps an unsigned one:
//! `[FORMAT_SIGNED][key id length: u8][key id][32-byte tag][unsigned event]`.
//! The tag covers a domain string, the key id and the unsigned event, and is
//! checked (in constant time) before a single byte of the event is parsed.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::error::{DecodeError, DecodeErrorKind, Error, Result};

pub(crate) const FORMAT_SIGNED: u8 = 0x53; // 'S'
const DOMAIN: &[u8] = b"cache-sync/event/v1";
const TAG_LEN: usize = 32;
const MIN_SECRET: usize = 16;

/// The most a signature adds to an event: the format byte, the key id's
/// length byte, the key id (at most 255 bytes) and the tag.
pub(crate) const SIGNED_OVERHEAD: usize = 2 + 255 + TAG_LEN;

/// Keys for signing and verifying events.
///
/// Publishers sign with the primary key; nodes accept any key in the ring.
/// To rotate: add the new key to every node's ring, switch publishers'
/// primary to it, then remove the old key from the nodes.
///
/// ```
/// # fn main() -> cache_sync::Result<()> {
/// let ring = cache_sync::Keyring::new("2026-11", b"a secret of at least 16 bytes".to_vec())?
///     .accept("2026-10", b"the previous secret, still accepted".to_vec())?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Keyring {
    primary: Arc<str>,
    keys: Arc<HashMap<String, Vec<u8>>>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secrets.
        let mut ids: Vec<_> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("Keyring")
            .field("primary", &self.primary)
            .field("key_ids", &ids)
            .finish()
    }
}

impl Keyring {
    /// A ring whose primary (signing) key is `secret`, named `id`.
    /// The id is 1 to 255 bytes; the secret at least 16 bytes.
    pub fn new(id: impl Into<String>, secret: impl Into<Vec<u8>>) -> Result<Self> {
        let id = id.into();
        let ring = Self {
            primary: id.as_str().into(),
            keys: Arc::default(),
        };
        ring.accept(id, secret)
    }

    /// Also accepts events signed with `secret`, named `id`.
    pub fn accept(mut self, id: impl Into<String>, secret: impl Into<Vec<u8>>) -> Result<Self> {
        let (id, secret) = (id.into(), secret.into());
        if id.is_empty() || id.len() > 255 {
            return Err(Error::Config("a key id must be 1 to 255 bytes".into()));
        }
        if secret.len() < MIN_SECRET {
            return Err(Error::Config(format!(
                "key {id:?}: a secret must be at least {MIN_SECRET} bytes"
            )));
        }
        Arc::make_mut(&mut self.keys).insert(id, secret);
        Ok(self)
    }

    fn mac(&self, id: &str, event: &[u8]) -> Option<Hmac<Sha256>> {
        let secret = self.keys.get(id)?;
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret).ok()?;
        mac.update(DOMAIN);
        mac.update(&[id.len() as u8]);
        mac.update(id.as_bytes());
        mac.update(event);
        Some(mac)
    }

    /// Wraps an unsigned event with the primary key's signature.
    pub(crate) fn sign(&self, event: &[u8]) -> Vec<u8> {
        let id = &*self.primary;
        let tag = self.mac(id, event).map(|m| m.finalize().into_bytes());
        let mut out = Vec::with_capacity(event.len().saturating_add(SIGNED_OVERHEAD));
        out.push(FORMAT_SIGNED);
        out.push(id.len() as u8);
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(tag.as_deref().unwrap_or(&[0; TAG_LEN]));
        out.extend_from_slice(event);
        out
    }

    /// Checks a signed payload and returns the unsigned event inside.
    pub(crate) fn open<'a>(&self, payload: &'a [u8]) -> Result<&'a [u8], DecodeError> {
        let reject = |k| Err(DecodeError::new(k));
        let Some((&FORMAT_SIGNED, rest)) = payload.split_first() else {
            return reject(DecodeErrorKind::Unsigned);
        };
        let Some((&id_len, rest)) = rest.split_first() else {
            return reject(DecodeErrorKind::BadSignature);
        };
        let id_len = usize::from(id_len);
        if rest.len() < id_len + TAG_LEN {
            return reject(DecodeErrorKind::BadSignature);
        }
        let (id, rest) = rest.split_at(id_len);
        let (tag, event) = rest.split_at(TAG_LEN);
        let id = String::from_utf8_lossy(id);
        let Some(mac) = self.mac(&id, event) else {
            return reject(DecodeErrorKind::UnknownKey(id.into_owned()));
        };
        match mac.verify_slice(tag) {
            Ok(()) => Ok(event),
            Err(_) => reject(DecodeErrorKind::BadSignature),
        }
    }
}

/// Strips a signature without checking it, for nodes that do not verify
/// (so publishers can start signing before nodes start checking).
pub(crate) fn strip_unverified(payload: &[u8]) -> &[u8] {
    match payload.split_first() {
        Some((&FORMAT_SIGNED, rest)) => match rest.split_first() {
            Some((&id_len, rest)) => rest
                .get(usize::from(id_len) + TAG_LEN..)
                .unwrap_or_default(),
            None => &[],
        },
        _ => payload,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring() -> Keyring {
        Keyring::new("k2", b"0123456789abcdef-new".to_vec()).unwrap()
    }

    #[test]
    fn signed_events_open_and_tampering_is_caught() {
        let signed = ring().sign(b"\x01event bytes");
        assert_eq!(ring().open(&signed).unwrap(), b"\x01event bytes");
        for i in 0..signed.len() {
            let mut t = signed.clone();
            t[i] ^= 0x01;
            assert!(ring().open(&t).is_err(), "flipping byte {i} went unnoticed");
        }
        assert!(ring().open(&signed[..signed.len() - 1]).is_err());
    }

    #[test]
    fn rejects_unsigned_unknown_keys_and_forgeries() {
        assert_eq!(
            ring().open(b"\x01plain").unwrap_err().kind,
            DecodeErrorKind::Unsigned
        );
        let other = Keyring::new("k9", b"0123456789abcdef-other".to_vec()).unwrap();
        let err = ring().open(&other.sign(b"x")).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::UnknownKey("k9".into()));
        // Same key id, wrong secret: a forgery.
        let forger = Keyring::new("k2", b"guessed-secret-0000".to_vec()).unwrap();
        assert_eq!(
            ring().open(&forger.sign(b"x")).unwrap_err().kind,
            DecodeErrorKind::BadSignature
        );
    }

    #[test]
    fn rotation_accepts_old_and_new_keys() {
        let old = Keyring::new("k1", b"0123456789abcdef-old".to_vec()).unwrap();
        let nodes = ring()
            .accept("k1", b"0123456789abcdef-old".to_vec())
            .unwrap();
        assert!(nodes.open(&old.sign(b"x")).is_ok());
        assert!(nodes.open(&ring().sign(b"x")).is_ok());
    }

    #[test]
    fn short_secrets_and_bad_ids_are_refused_and_debug_hides_secrets() {
        assert!(Keyring::new("k", b"short".to_vec()).is_err());
        assert!(Keyring::new("", b"0123456789abcdef".to_vec()).is_err());
        assert!(!format!("{:?}", ring()).contains("0123456789"));
    }

    #[test]
    fn strip_unverified_returns_the_inner_event() {
        assert_eq!(strip_unverified(&ring().sign(b"\x01inner")), b"\x01inner");
        assert_eq!(strip_unverified(b"\x01plain"), b"\x01plain");
        assert_eq!(strip_unverified(&[FORMAT_SIGNED]), b"");
    }
}
