//! The publisher: how admin services tell every node what changed.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::table::Table;
use crate::transport::{DEFAULT_TOPIC, Position, Transport};
use crate::util::{lock, now_us};
use crate::wire::{
    Change, Codec, DEFAULT_MAX_EVENT_BYTES, EntryVersion, Header, KeyVersion, Keyring,
    MAX_EVENT_BYTES_CEILING, Origin, encode_part, framed_len,
};

/// Publishes change events for named caches.
///
/// Each call is one batch; a batch larger than the event size limit is split
/// into several events, in order. Events to one cache from one publisher are
/// numbered 1, 2, 3, … so nodes can detect a missing one. Publishing to one
/// cache is serialised, so the numbers reach the transport in order.
///
/// A failed publish returns an error and still uses up its sequence number:
/// if the event did reach some nodes, the next one must not reuse the number,
/// and if it did not, nodes see a gap and invalidate, which is safe.
///
/// Cheap to clone; clones share the sequence numbers.
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<PublisherInner>,
}

struct PublisherInner {
    transport: Arc<dyn Transport>,
    topic: String,
    origin: String,
    id: u64,
    codec: Codec,
    seqs: Mutex<HashMap<String, Arc<tokio::sync::Mutex<u64>>>>,
}

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("topic", &self.inner.topic)
            .field("origin", &self.inner.origin)
            .field("id", &format_args!("{:016x}", self.inner.id))
            .finish_non_exhaustive()
    }
}

/// Configures a [`Publisher`].
pub struct PublisherBuilder {
    transport: Arc<dyn Transport>,
    topic: String,
    origin: String,
    max_event_bytes: usize,
    keyring: Option<Keyring>,
}

impl fmt::Debug for PublisherBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PublisherBuilder")
            .field("topic", &self.topic)
            .field("origin", &self.origin)
            .finish_non_exhaustive()
    }
}

impl PublisherBuilder {
    /// The topic to publish to. Default `"cache-sync"`.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = topic.into();
        self
    }

    /// A name for this publisher in nodes' logs (a service or node name).
    pub fn origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = origin.into();
        self
    }

    /// Largest event sent, signature included; larger batches are split.
    /// Keep it at or below the nodes' limit. Default 1 MiB; 1 byte to
    /// 64 MiB, and [`build`](Self::build) refuses anything else.
    pub fn max_event_bytes(mut self, n: usize) -> Self {
        self.max_event_bytes = n;
        self
    }

    /// Signs every event with the ring's primary key (HMAC-SHA256).
    pub fn signing(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// The publisher, once the transport has accepted the topic's name
    /// ([`check_topic`](crate::transport::Transport::check_topic)) and the
    /// settings are in range; otherwise [`Error::Config`] naming the rule
    /// broken.
    pub fn build(self) -> Result<Publisher> {
        self.transport.check_topic(&self.topic)?;
        if self.max_event_bytes == 0 || self.max_event_bytes > MAX_EVENT_BYTES_CEILING {
            return Err(Error::Config(format!(
                "max_event_bytes must be between 1 and {MAX_EVENT_BYTES_CEILING}, not {}",
                self.max_event_bytes
            )));
        }
        let codec = Codec::new(self.max_event_bytes, self.keyring);
        Ok(Publisher::with_codec(
            self.transport,
            self.topic,
            self.origin,
            codec,
        ))
    }
}

impl Publisher {
    /// A publisher with settings already checked (a node's own: its topic
    /// and its codec, so that what this one seals the node can open).
    pub(crate) fn with_codec(
        transport: Arc<dyn Transport>,
        topic: String,
        origin: String,
        codec: Codec,
    ) -> Self {
        Publisher {
            inner: Arc::new(PublisherInner {
                transport,
                topic,
                origin,
                // Random: a restarted publisher must not continue an old numbering.
                id: RandomState::new().hash_one((std::process::id(), now_us())),
                codec,
                seqs: Mutex::default(),
            }),
        }
    }
}

/// What a publish call sent.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Published {
    /// Events sent (0 for an empty batch; more than 1 when it was split).
    pub events: usize,
    /// The transport position of the last one, where the transport reports it.
    pub position: Option<Position>,
}

impl Publisher {
    /// A publisher on `transport` with the default topic, `cache-sync`, a
    /// name every transport accepts.
    pub fn new(transport: impl Transport) -> Self {
        Self::with_codec(
            Arc::new(transport),
            DEFAULT_TOPIC.into(),
            "publisher".into(),
            Codec::new(DEFAULT_MAX_EVENT_BYTES, None),
        )
    }

    /// Configures a publisher on `transport`.
    pub fn builder(transport: impl Transport) -> PublisherBuilder {
        PublisherBuilder {
            transport: Arc::new(transport),
            topic: DEFAULT_TOPIC.into(),
            origin: "publisher".into(),
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            keyring: None,
        }
    }

    /// Tells every node to drop `keys` from `cache`. Unversioned: applied in
    /// delivery order.
    pub async fn invalidate<K: Serialize>(
        &self,
        cache: &str,
        keys: impl IntoIterator<Item = K>,
    ) -> Result<Published> {
        self.invalidate_versioned(cache, keys.into_iter().map(|k| (k, None)))
            .await
    }

    /// Tells every node to drop `keys`, each leaving a tombstone at its version
    /// so an older refresh arriving later is ignored.
    pub async fn invalidate_versioned<K: Serialize>(
        &self,
        cache: &str,
        keys: impl IntoIterator<Item = (K, Option<u64>)>,
    ) -> Result<Published> {
        let mut items = Vec::new();
        for (k, version) in keys {
            items.push(KeyVersion {
                key: encode_part(&k, "key")?,
                version,
            });
        }
        let changes = self.split(
            items,
            |k| framed_len(&[&k.key]),
            |keys| Change::Invalidate { keys },
        )?;
        self.send(cache, changes).await
    }

    /// Tells every node to replace the values of these keys where they hold
    /// them. Unversioned: applied in delivery order.
    pub async fn refresh<K: Serialize, V: Serialize>(
        &self,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Published> {
        self.refresh_versioned(cache, entries.into_iter().map(|(k, v)| (k, v, None)))
            .await
    }

    /// Like [`refresh`](Self::refresh), with a version per entry: a node
    /// ignores a refresh older than what it already reflects for that key.
    pub async fn refresh_versioned<K: Serialize, V: Serialize>(
        &self,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
    ) -> Result<Published> {
        let changes = self.refresh_changes(entries)?;
        self.send(cache, changes).await
    }

    /// Tells every node to drop everything in `cache`.
    pub async fn clear(&self, cache: &str) -> Result<Published> {
        self.send(cache, vec![Change::Clear { version: None }])
            .await
    }

    /// Drops everything and makes `version` a floor: refreshes older than it
    /// that arrive later are ignored.
    pub async fn clear_versioned(&self, cache: &str, version: u64) -> Result<Published> {
        self.send(
            cache,
            vec![Change::Clear {
                version: Some(version),
            }],
        )
        .await
    }

    /// A typed publisher for one dictionary table: a [`Table`] shared with
    /// the nodes, or a plain cache name with the types spelt out
    /// (`dictionary::<String, String>("countries")`).
    pub fn dictionary<K: Serialize, V: Serialize>(
        &self,
        table: impl Into<Table<K, V>>,
    ) -> DictionaryPublisher<K, V> {
        DictionaryPublisher::new(self.clone(), table.into())
    }

    fn invalidate_changes<K: Serialize>(
        &self,
        keys: impl IntoIterator<Item = (K, Option<u64>)>,
    ) -> Result<Vec<Change>> {
        let mut items = Vec::new();
        for (k, version) in keys {
            items.push(KeyVersion {
                key: encode_part(&k, "key")?,
                version,
            });
        }
        self.split(
            items,
            |k| framed_len(&[&k.key]),
            |keys| Change::Invalidate { keys },
        )
    }

    fn refresh_changes<K: Serialize, V: Serialize>(
        &self,
        entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
    ) -> Result<Vec<Change>> {
        let mut items = Vec::new();
        for (k, v, version) in entries {
            items.push(EntryVersion {
                key: encode_part(&k, "key")?,
                value: encode_part(&v, "value")?,
                version,
            });
        }
        self.split(
            items,
            |e| framed_len(&[&e.key, &e.value]),
            |entries| Change::Refresh { entries },
        )
    }

    /// Packs items into as few changes as fit the size limit.
    fn split<T>(
        &self,
        items: Vec<T>,
        size: impl Fn(&T) -> usize,
        make: impl Fn(Vec<T>) -> Change,
    ) -> Result<Vec<Change>> {
        let budget = self.inner.codec.entry_budget(&self.inner.origin);
        let mut changes = Vec::new();
        let mut batch = Vec::new();
        let mut used = 0usize;
        for item in items {
            let n = size(&item);
            if n > budget {
                return Err(Error::TooLarge {
                    what: "entry",
                    size: n,
                    limit: budget,
                });
            }
            if used.saturating_add(n) > budget && !batch.is_empty() {
                changes.push(make(std::mem::take(&mut batch)));
                used = 0;
            }
            used = used.saturating_add(n);
            batch.push(item);
        }
        if !batch.is_empty() {
            changes.push(make(batch));
        }
        Ok(changes)
    }

    /// Splits an already built change (the outbox relay's, stored before
    /// this publisher's limit was known) as this publisher's limit needs.
    /// An entry that can never fit is [`Error::TooLarge`].
    #[cfg(feature = "postgres")]
    pub(crate) fn resplit(&self, change: Change) -> Result<Vec<Change>> {
        match change {
            Change::Invalidate { keys } => self.split(
                keys,
                |k| framed_len(&[&k.key]),
                |keys| Change::Invalidate { keys },
            ),
            Change::Refresh { entries } => self.split(
                entries,
                |e| framed_len(&[&e.key, &e.value]),
                |entries| Change::Refresh { entries },
            ),
            clear @ Change::Clear { .. } => Ok(vec![clear]),
        }
    }

    pub(crate) async fn send(&self, cache: &str, changes: Vec<Change>) -> Result<Published> {
        self.send_with(cache, || Ok((changes, ())))
            .await
            .map(|(p, ())| p)
    }

    /// Builds the changes while holding the cache's publish lock, so that
    /// versions assigned in `build` reach the transport in version order.
    async fn send_with<T>(
        &self,
        cache: &str,
        build: impl FnOnce() -> Result<(Vec<Change>, T)>,
    ) -> Result<(Published, T)> {
        self.inner.transport.check_tag(cache)?;
        let seq = {
            let mut seqs = lock(&self.inner.seqs);
            seqs.entry(cache.to_owned()).or_default().clone()
        };
        // Held across the publish so numbers reach the transport in order.
        let mut seq = seq.lock().await;
        let (changes, out) = build()?;
        let mut published = Published {
            events: 0,
            position: None,
        };
        for change in changes {
            // 2^64 publishes to one cache from one publisher will not happen;
            // saturating keeps the numbers from ever going back regardless.
            *seq = seq.saturating_add(1);
            let header = Header {
                cache,
                origin: Origin(self.inner.origin.as_bytes()),
                publisher: self.inner.id,
                seq: *seq,
                published_at_us: now_us(),
            };
            let payload = self.inner.codec.seal(&header, &change)?;
            let position = self
                .inner
                .transport
                .publish(&self.inner.topic, cache, Bytes::from(payload))
                .await?;
            published.events = published.events.saturating_add(1);
            published.position = position.or(published.position);
        }
        Ok((published, out))
    }
}

mod dictionary;

pub use dictionary::DictionaryPublisher;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedTransport;
    use crate::transport::{Delivery, StartFrom, SubscribeOptions};
    use crate::wire::decode;

    /// What a test needs of a published event's header.
    #[derive(Debug)]
    pub(super) struct Sent {
        pub(super) cache: String,
        pub(super) seq: u64,
    }

    pub(super) async fn drain(transport: &EmbeddedTransport) -> Vec<(Sent, Change)> {
        let mut sub = transport
            .subscribe(DEFAULT_TOPIC, SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        match sub.next(10_000).await.unwrap() {
            Delivery::Batch { records, .. } => records
                .iter()
                .map(|r| {
                    let (h, change) = decode(&r.payload, MAX_EVENT_BYTES_CEILING).unwrap();
                    let sent = Sent {
                        cache: h.cache.to_owned(),
                        seq: h.seq,
                    };
                    (sent, change)
                })
                .collect(),
            Delivery::Lost(l) => panic!("{l:?}"),
        }
    }

    #[tokio::test]
    async fn sequences_count_per_cache_from_one() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .origin("admin")
            .build()
            .unwrap();
        p.invalidate("a", ["x"]).await.unwrap();
        p.invalidate("b", ["y"]).await.unwrap();
        p.clear("a").await.unwrap();
        let seqs: Vec<_> = drain(&transport)
            .await
            .iter()
            .map(|(h, _)| (h.cache.clone(), h.seq))
            .collect();
        assert_eq!(seqs, [("a".into(), 1), ("b".into(), 1), ("a".into(), 2)]);
    }

    #[tokio::test]
    async fn large_batches_split_under_the_limit_and_oversized_entries_fail() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .max_event_bytes(4096)
            .build()
            .unwrap();
        let rows: Vec<(u32, String)> = (0..100).map(|i| (i, "v".repeat(200))).collect();
        let sent = p.refresh("t", rows).await.unwrap();
        assert!(sent.events > 1, "{sent:?}");
        let events = drain(&transport).await;
        assert_eq!(events.len(), sent.events);
        assert_eq!(events.iter().map(|(_, c)| c.len()).sum::<usize>(), 100);
        let err = p
            .refresh("t", [(1u32, "v".repeat(5000))])
            .await
            .unwrap_err();
        assert!(err.is_too_large(), "{err}");
        assert_eq!(p.refresh::<u32, u32>("t", []).await.unwrap().events, 0);
    }
}
