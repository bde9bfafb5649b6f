use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;

use super::seqs::PublisherSeqs;
use super::*;
use crate::transport::FaultyTransport;
use crate::transport::{FileOffsetStore, OffsetStore, Position};
use crate::util::now_us;
use crate::wire::{Change, Codec, EntryVersion, Header, encode_part};
use crate::{Keyring, transport::EmbeddedTransport};

mod acks;
mod audit;
mod cluster;
mod fence;
mod freshness;
mod gaps;
mod hostile;
mod late;
mod lifecycle;
mod positions;
mod probe;
mod relay_lag;
mod reorder;
mod staleness;
mod stalls;
mod tail;

type Cache = SyncedCache<String, String>;

fn cache(name: &str) -> Cache {
    SyncedCache::new(name, moka::future::Cache::new(1000))
}

/// Polls until `f` holds; tests never sleep a fixed time to "let it settle".
pub(crate) async fn eventually(what: &str, f: impl AsyncFnMut() -> bool) {
    eventually_within(what, Duration::from_secs(10), f).await;
}

/// [`eventually`] with a limit of its own, on tokio's clock (in a test on
/// paused time a long limit costs no real time); returns when `f` held.
pub(super) async fn eventually_within(
    what: &str,
    limit: Duration,
    mut f: impl AsyncFnMut() -> bool,
) -> tokio::time::Instant {
    let deadline = tokio::time::Instant::now() + limit;
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    tokio::time::Instant::now()
}

async fn holds(c: &Cache, k: &str, v: Option<&str>) -> bool {
    c.get(&k.to_string()).await.as_deref() == v
}

fn raw_event(cache: &str, publisher: u64, seq: u64, change: &Change) -> Bytes {
    raw_event_ext(
        cache,
        publisher,
        seq,
        crate::wire::HeaderExt::default(),
        change,
    )
}

/// [`raw_event`], with a header extension (an age, a relay's fence).
fn raw_event_ext(
    cache: &str,
    publisher: u64,
    seq: u64,
    ext: crate::wire::HeaderExt,
    change: &Change,
) -> Bytes {
    let header = Header {
        cache,
        origin: crate::wire::Origin(b"forger"),
        publisher,
        seq,
        published_at_us: now_us(),
    };
    Bytes::from(crate::wire::encode_ext(&header, &ext, change).unwrap())
}

fn refresh_change(k: &str, v: &str) -> Change {
    versioned_change(k, v, None)
}

/// A one-entry refresh of `k` to `v`, at `version` if any.
fn versioned_change(k: &str, v: &str, version: Option<u64>) -> Change {
    Change::Refresh {
        entries: vec![EntryVersion {
            key: encode_part(k, "key").unwrap(),
            value: encode_part(v, "value").unwrap(),
            version,
        }],
    }
}

/// The embedded transport, whose first subscription breaks after one batch.
pub(super) fn flaky() -> FaultyTransport {
    let t = FaultyTransport::new(EmbeddedTransport::new());
    t.break_next_subscription_after(1);
    t
}

/// A node holding only `c`, reading `transport`.
async fn node_with(transport: &EmbeddedTransport, c: &Cache) -> Node {
    Node::builder("n1", transport.clone())
        .register(c)
        .start()
        .await
        .unwrap()
}

#[tokio::test]
async fn applies_events_including_its_own() {
    let transport = EmbeddedTransport::new();
    let c = cache("countries");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    node.publisher()
        .insert("countries", [("de", "Germany")])
        .await
        .unwrap();
    eventually("own refresh applied", async || {
        holds(&c, "de", Some("Germany")).await
    })
    .await;
    Publisher::new(transport)
        .invalidate("countries", ["de"])
        .await
        .unwrap();
    eventually("invalidation applied", async || holds(&c, "de", None).await).await;
    let s = node.status();
    assert_eq!(
        (
            s.events_received,
            s.losses,
            s.publisher_gaps,
            s.events_rejected
        ),
        (2, 0, 0, 0)
    );
    assert!(!s.position.is_empty());
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn skips_events_for_caches_it_does_not_hold() {
    let transport = EmbeddedTransport::new();
    let c = cache("mine");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    let p = Publisher::new(transport);
    p.insert("theirs", [("k", "v")]).await.unwrap();
    p.insert("mine", [("k", "v")]).await.unwrap();
    eventually("mine applied", async || holds(&c, "k", Some("v")).await).await;
    // The embedded transport filters by tag, so "theirs" never even reaches the node.
    assert_eq!(node.status().events_received, 1);
}

#[tokio::test]
async fn garbage_is_rejected_counted_and_survived() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .max_event_bytes(4096)
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("k".into(), "cached".into()).await;
    for payload in [
        Bytes::from_static(b""),
        Bytes::from_static(b"\x01garbage"),
        Bytes::from_static(b"\x09unknown format"),
        Bytes::from(vec![1u8; 10_000]),
    ] {
        transport
            .publish(DEFAULT_TOPIC, "t", payload)
            .await
            .unwrap();
    }
    let p = node.publisher();
    p.insert("t", [("after", "ok")]).await.unwrap();
    eventually("valid event after garbage", async || {
        holds(&c, "after", Some("ok")).await
    })
    .await;
    let s = node.status();
    assert_eq!(s.events_rejected, 4);
    assert!(s.consuming);
    // Each might have been a change to "t", so "t" was invalidated each time.
    assert_eq!(s.caches[0].rejected_events, 4);
    assert_eq!(c.get("k").await, None);
}
