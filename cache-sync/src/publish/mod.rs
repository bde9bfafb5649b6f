//! The publisher: how admin services tell every node what changed.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::transport::{DEFAULT_TOPIC, Position, Transport};
use crate::util::{lock, now_us};
use crate::wire::{
    Change, Codec, DEFAULT_MAX_EVENT_BYTES, EntryVersion, Header, KeyVersion, Keyring,
    MAX_EVENT_BYTES_CEILING, encode_part, framed_len,
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

    /// A typed publisher for one dictionary table, cached under `cache`.
    pub fn dictionary<K: Serialize, V: Serialize>(
        &self,
        cache: impl Into<String>,
    ) -> DictionaryPublisher<K, V> {
        DictionaryPublisher {
            publisher: self.clone(),
            cache: cache.into(),
            clock: Arc::new(VersionClock::default()),
            _types: PhantomData,
        }
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

    async fn send(&self, cache: &str, changes: Vec<Change>) -> Result<Published> {
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
                cache: cache.to_owned(),
                origin: self.inner.origin.clone(),
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

/// Hands out row versions: microseconds since the Unix epoch, bumped so each
/// is strictly greater than the last this clock gave or saw. Across restarts
/// of the admin service versions keep increasing as long as the clock does
/// not step back by more than the time between two writes.
#[derive(Debug, Default)]
struct VersionClock {
    last: AtomicU64,
}

impl VersionClock {
    /// The next version, or [`Error::VersionExhausted`] once a version of
    /// `u64::MAX` was given or seen: nothing is newer, and wrapping would
    /// make every node ignore the change as older than what it holds.
    fn next(&self) -> Result<u64> {
        let now = now_us();
        let next = |last: u64| last.checked_add(1).map(|n| n.max(now));
        match self
            .last
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, next)
        {
            Ok(prev) => next(prev).ok_or(Error::VersionExhausted(prev)),
            Err(last) => Err(Error::VersionExhausted(last)),
        }
    }

    fn observe(&self, version: u64) {
        self.last.fetch_max(version, Ordering::AcqRel);
    }
}

/// Publishes changes to one dictionary table (country codes, categories,
/// feature flags …) whose rows are cached under one name on every node.
///
/// Every change carries a row version. By default the helper assigns
/// monotonically increasing versions (see below); pass your own, such as the
/// row's version column, with the `_with_version` methods when several
/// services write the same table, so that the database orders them.
///
/// Automatic versions are microseconds since the Unix epoch, forced to be
/// strictly increasing within this helper and above any version passed in.
pub struct DictionaryPublisher<K, V> {
    publisher: Publisher,
    cache: String,
    clock: Arc<VersionClock>,
    _types: PhantomData<fn(&K, &V)>,
}

impl<K, V> Clone for DictionaryPublisher<K, V> {
    fn clone(&self) -> Self {
        Self {
            publisher: self.publisher.clone(),
            cache: self.cache.clone(),
            clock: self.clock.clone(),
            _types: PhantomData,
        }
    }
}

impl<K, V> fmt::Debug for DictionaryPublisher<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DictionaryPublisher")
            .field("cache", &self.cache)
            .finish_non_exhaustive()
    }
}

impl<K: Serialize, V: Serialize> DictionaryPublisher<K, V> {
    /// The cache name it publishes to.
    pub fn cache(&self) -> &str {
        &self.cache
    }

    /// A row was inserted or updated: every node installs `row` (unless it
    /// already reflects a newer version). Returns the version used.
    pub async fn upsert(&self, key: &K, row: &V) -> Result<u64> {
        self.upsert_many([(key, row)]).await
    }

    /// [`upsert`](Self::upsert) with the caller's version.
    pub async fn upsert_with_version(&self, key: &K, row: &V, version: u64) -> Result<u64> {
        self.publish(Some(version), |p, v| {
            p.refresh_changes([(key, row, Some(v))])
        })
        .await
    }

    /// Several rows at one version, split into events as the size limit needs.
    pub async fn upsert_many<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(None, |p, v| {
            p.refresh_changes(rows.into_iter().map(|(k, r)| (k, r, Some(v))))
        })
        .await
    }

    /// A row was deleted: every node drops it and keeps a tombstone, so an
    /// older upsert that arrives late cannot bring it back.
    pub async fn delete(&self, key: &K) -> Result<u64> {
        self.publish(None, |p, v| p.invalidate_changes([(key, Some(v))]))
            .await
    }

    /// [`delete`](Self::delete) with the caller's version.
    pub async fn delete_with_version(&self, key: &K, version: u64) -> Result<u64> {
        self.publish(Some(version), |p, v| p.invalidate_changes([(key, Some(v))]))
            .await
    }

    /// The table was replaced wholesale: every node drops all rows, then
    /// installs these. A clear at the same version goes first, so rows the
    /// new table lacks disappear and no older refresh can return afterwards.
    pub async fn replace_all<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(None, |p, v| replace_changes(p, rows, v)).await
    }

    /// [`replace_all`](Self::replace_all) with the caller's version.
    pub async fn replace_all_with_version<'a>(
        &self,
        rows: impl IntoIterator<Item = (&'a K, &'a V)>,
        version: u64,
    ) -> Result<u64>
    where
        K: 'a,
        V: 'a,
    {
        self.publish(Some(version), |p, v| replace_changes(p, rows, v))
            .await
    }

    /// Publishes under the table's publish lock. An automatic version is taken
    /// inside the lock, so this helper's versions reach the transport in
    /// increasing order even when it is called from many tasks at once.
    async fn publish(
        &self,
        version: Option<u64>,
        build: impl FnOnce(&Publisher, u64) -> Result<Vec<Change>>,
    ) -> Result<u64> {
        let (_, v) = self
            .publisher
            .send_with(&self.cache, || {
                let v = match version {
                    Some(v) => {
                        self.clock.observe(v);
                        v
                    }
                    None => self.clock.next()?,
                };
                Ok((build(&self.publisher, v)?, v))
            })
            .await?;
        Ok(v)
    }
}

fn replace_changes<'a, K: Serialize + 'a, V: Serialize + 'a>(
    p: &Publisher,
    rows: impl IntoIterator<Item = (&'a K, &'a V)>,
    version: u64,
) -> Result<Vec<Change>> {
    let mut changes = vec![Change::Clear {
        version: Some(version),
    }];
    changes.extend(p.refresh_changes(rows.into_iter().map(|(k, r)| (k, r, Some(version))))?);
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedTransport;
    use crate::transport::{Delivery, StartFrom, SubscribeOptions};
    use crate::wire::decode;

    async fn drain(transport: &EmbeddedTransport) -> Vec<(Header, Change)> {
        let mut sub = transport
            .subscribe(DEFAULT_TOPIC, SubscribeOptions::new(StartFrom::Earliest))
            .await
            .unwrap();
        match sub.next(10_000).await.unwrap() {
            Delivery::Batch { records, .. } => records
                .iter()
                .map(|r| decode(&r.payload, MAX_EVENT_BYTES_CEILING).unwrap())
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

    #[tokio::test]
    async fn dictionary_versions_increase_and_respect_caller_versions() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("countries");
        let a = dict.upsert(&"de".into(), &"Germany".into()).await.unwrap();
        let b = dict.delete(&"de".into()).await.unwrap();
        assert!(b > a);
        let c = dict
            .upsert_with_version(&"fr".into(), &"France".into(), u64::MAX / 2)
            .await
            .unwrap();
        let d = dict.upsert(&"it".into(), &"Italy".into()).await.unwrap();
        assert!(d > c, "auto versions must pass caller versions");
        let v = dict
            .replace_all([(&"se".to_string(), &"Sweden".to_string())])
            .await
            .unwrap();
        let events = drain(&transport).await;
        let kinds: Vec<_> = events.iter().map(|(_, c)| c.max_version()).collect();
        assert_eq!(
            kinds,
            [Some(a), Some(b), Some(c), Some(d), Some(v), Some(v)]
        );
        assert!(matches!(events[4].1, Change::Clear { .. }));
    }

    /// Regression: after a caller passed `u64::MAX`, the next automatic
    /// version wrapped (`last + 1`) and silently went backwards, so every
    /// node ignored the change as stale.
    #[tokio::test]
    async fn automatic_versions_past_the_largest_one_fail_instead_of_wrapping() {
        let transport = EmbeddedTransport::new();
        let dict = Publisher::new(transport.clone()).dictionary::<String, String>("t");
        dict.upsert_with_version(&"a".into(), &"x".into(), u64::MAX)
            .await
            .unwrap();
        for attempt in 0..2 {
            let err = dict.upsert(&"b".into(), &"y".into()).await.unwrap_err();
            assert!(
                matches!(err, Error::VersionExhausted(u64::MAX)),
                "attempt {attempt}: {err}"
            );
            assert!(dict.delete(&"b".into()).await.is_err());
        }
        // Nothing was sent for the refused calls, and no sequence number
        // was used up: nodes see no gap.
        let events = drain(&transport).await;
        assert_eq!(events.len(), 1);
        dict.upsert_with_version(&"c".into(), &"z".into(), 5)
            .await
            .unwrap();
        let seqs: Vec<_> = drain(&transport).await.iter().map(|(h, _)| h.seq).collect();
        assert_eq!(seqs, [1, 2]);
    }

    #[test]
    fn clock_is_strictly_increasing_even_when_called_in_the_same_microsecond() {
        let clock = VersionClock::default();
        let mut last = 0;
        for _ in 0..10_000 {
            let v = clock.next().unwrap();
            assert!(v > last);
            last = v;
        }
    }
}
