//! The typed table handle both sides share.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

/// A cached table: its name, its key and value types and, optionally, its
/// topic, in one value that the admin service and every node share (put it
/// in a crate both depend on).
///
/// ```
/// use cache_sync::transport::EmbeddedTransport;
/// use cache_sync::{Publisher, SyncedCache, Table};
///
/// const COUNTRIES: Table<String, String> = Table::new("countries");
///
/// # async fn run() -> cache_sync::Result<()> {
/// # let transport = EmbeddedTransport::new();
/// // On a node: the moka cache must hold `String` → `String`.
/// let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(10_000));
/// // In the admin service: only `String` rows for `String` keys compile.
/// let table = Publisher::new(transport).dictionary(COUNTRIES);
/// table.insert("de", "Germany").await?;
/// # Ok(()) }
/// ```
///
/// With plain names (`SyncedCache::new("countries", …)`,
/// `publisher.dictionary::<String, String>("countries")`) a mismatch of
/// types or names shows only at run time, as rejected events and resyncs;
/// with a shared `Table` the types cannot differ:
///
/// ```compile_fail
/// # use cache_sync::{SyncedCache, Table};
/// const COUNTRIES: Table<String, String> = Table::new("countries");
/// // A cache of `u32` values cannot wrap the table of `String` rows.
/// let cache = SyncedCache::new(COUNTRIES, moka::future::Cache::<String, u32>::new(16));
/// ```
///
/// A pinned topic
/// ([`with_topic`](Self::with_topic)) is checked when the cache is
/// registered and when the publisher sends.
pub struct Table<K, V> {
    name: Cow<'static, str>,
    topic: Option<&'static str>,
    // `fn() -> _`: a table neither owns nor drops keys and values, so it is
    // `Send`, `Sync` and `Unpin` whatever they are.
    _types: PhantomData<fn() -> (K, V)>,
}

impl<K, V> Table<K, V> {
    /// A table named `name`, on whichever topic the node or publisher uses.
    /// Names follow the common rule (1 to 255 bytes of UTF-8, no control
    /// characters), checked when a node registers the cache or a publisher
    /// sends.
    pub const fn new(name: &'static str) -> Self {
        Self {
            name: Cow::Borrowed(name),
            topic: None,
            _types: PhantomData,
        }
    }

    /// A table named `name` that lives on `topic`: a node on another topic
    /// refuses to register its cache, and a publisher on another topic
    /// refuses to send its changes, both with [`Error::Config`](crate::Error::Config).
    pub const fn with_topic(name: &'static str, topic: &'static str) -> Self {
        Self {
            name: Cow::Borrowed(name),
            topic: Some(topic),
            _types: PhantomData,
        }
    }

    /// The table's name: what events address its cache by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The topic it is pinned to, if any.
    pub fn topic(&self) -> Option<&'static str> {
        self.topic
    }

    pub(crate) fn into_parts(self) -> (String, Option<&'static str>) {
        (self.name.into_owned(), self.topic)
    }
}

/// The topic a pinned table's changes must travel on, as a refusal.
pub(crate) fn check_topic(table: &str, pinned: Option<&str>, actual: &str) -> crate::Result<()> {
    match pinned {
        Some(topic) if topic != actual => Err(crate::Error::Config(format!(
            "table {table:?} lives on topic {topic:?}, not {actual:?}"
        ))),
        _ => Ok(()),
    }
}

impl<K, V> Clone for Table<K, V> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            topic: self.topic,
            _types: PhantomData,
        }
    }
}

impl<K, V> fmt::Debug for Table<K, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Table")
            .field("name", &self.name)
            .field("topic", &self.topic)
            .field("key", &std::any::type_name::<K>())
            .field("value", &std::any::type_name::<V>())
            .finish()
    }
}

/// A plain name: a table on whichever topic is in use, its types left to
/// inference.
impl<K, V> From<&str> for Table<K, V> {
    fn from(name: &str) -> Self {
        Self::from(name.to_owned())
    }
}

impl<K, V> From<&String> for Table<K, V> {
    fn from(name: &String) -> Self {
        Self::from(name.clone())
    }
}

impl<K, V> From<String> for Table<K, V> {
    fn from(name: String) -> Self {
        Self {
            name: Cow::Owned(name),
            topic: None,
            _types: PhantomData,
        }
    }
}

impl<K, V> From<&Table<K, V>> for Table<K, V> {
    fn from(table: &Table<K, V>) -> Self {
        table.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Node, Publisher, SyncedCache, transport::EmbeddedTransport};

    const COUNTRIES: Table<String, String> = Table::new("countries");
    const PINNED: Table<String, String> = Table::with_topic("countries", "dictionaries");

    #[tokio::test]
    async fn one_table_value_names_the_cache_on_both_sides() {
        let transport = EmbeddedTransport::new();
        let cache = SyncedCache::new(COUNTRIES, moka::future::Cache::new(16));
        let node = Node::builder("n", transport.clone())
            .register(&cache)
            .start()
            .await
            .unwrap();
        let table = node.publisher().dictionary(COUNTRIES);
        assert_eq!(table.cache(), "countries");
        table.insert("de", "Germany").await.unwrap();
        let status = node.status_settled().await;
        assert_eq!(status.caches[0].name, "countries");
        // Applied: the event named the cache the table names.
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while cache.peek("de").await.is_none() {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the refresh reached the cache");
        node.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn a_pinned_topic_is_refused_by_a_node_and_a_publisher_on_another() {
        let transport = EmbeddedTransport::new();
        let cache = SyncedCache::new(PINNED, moka::future::Cache::new(16));
        let err = Node::builder("n", transport.clone())
            .register(&cache)
            .start()
            .await
            .unwrap_err();
        assert!(err.is_config(), "{err}");
        let node = Node::builder("n", transport.clone())
            .topic("dictionaries")
            .register(&cache)
            .start()
            .await
            .expect("the table's own topic");
        let wrong = Publisher::new(transport.clone()).dictionary(PINNED);
        let err = wrong.insert("de", "x").await.unwrap_err();
        assert!(err.is_config(), "{err}");
        let right = Publisher::builder(transport)
            .topic("dictionaries")
            .build()
            .unwrap()
            .dictionary(PINNED);
        right.insert("de", "x").await.unwrap();
        node.shutdown().await.unwrap();
    }

    /// Refused before anything is claimed or emptied: a cache registered
    /// with it keeps what it held, and is free for another node.
    #[tokio::test]
    async fn a_start_refused_for_a_pinned_topic_changes_no_cache() {
        let transport = EmbeddedTransport::new();
        let plain = SyncedCache::new(COUNTRIES, moka::future::Cache::new(16));
        plain.insert("de".into(), "kept".into()).await;
        let pinned = SyncedCache::new(PINNED_OTHER, moka::future::Cache::new(16));
        let err = Node::builder("n", transport.clone())
            .register(&plain)
            .register(&pinned)
            .start()
            .await
            .unwrap_err();
        assert!(err.is_config(), "{err}");
        assert_eq!(plain.peek("de").await.as_deref(), Some("kept"));
        Node::builder("m", transport)
            .register(&plain)
            .start()
            .await
            .expect("the plain cache was not left claimed")
            .shutdown()
            .await
            .unwrap();
    }

    const PINNED_OTHER: Table<u64, u64> = Table::with_topic("ids", "elsewhere");

    #[test]
    fn plain_names_convert_and_debug_names_the_types() {
        let a: Table<u64, Vec<u8>> = "rows".into();
        let b: Table<u64, Vec<u8>> = String::from("rows").into();
        assert_eq!((a.name(), a.topic()), (b.name(), None));
        assert_eq!(PINNED.topic(), Some("dictionaries"));
        let debug = format!("{PINNED:?}");
        assert!(debug.contains("alloc::string::String"), "{debug}");
    }
}
