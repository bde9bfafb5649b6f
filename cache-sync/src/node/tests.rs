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
mod late;
mod probe;
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

/// Sequence numbers run per (publisher, cache), so a gap resyncs only the
/// cache whose sequence jumped, not every cache on the topic: only that
/// cache can have missed anything.
#[tokio::test]
async fn a_gap_in_a_publishers_sequence_invalidates_that_cache_only() {
    let transport = EmbeddedTransport::new();
    let (a, b) = (cache("a"), cache("b"));
    let node = Node::builder("n1", transport.clone())
        .register(&a)
        .register(&b)
        .start()
        .await
        .unwrap();
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 1, &refresh_change("x", "1")),
        )
        .await
        .unwrap();
    eventually("seq 1", async || holds(&a, "x", Some("1")).await).await;
    b.insert("y".into(), "untouched by a's gap".into()).await;
    // Sequence 2 and 3 never arrive.
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 4, &refresh_change("z", "4")),
        )
        .await
        .unwrap();
    eventually("seq 4", async || holds(&a, "z", Some("4")).await).await;
    assert_eq!(
        a.get("x").await,
        None,
        "stale entries before the gap are gone"
    );
    assert_eq!(
        b.get("y").await.as_deref(),
        Some("untouched by a's gap"),
        "another cache's sequence did not jump"
    );
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (1, 1));
    assert_eq!(s.last_loss_reason.as_deref(), Some("publisher_gap"));
    let resyncs: Vec<_> = s
        .caches
        .iter()
        .map(|c| (c.name.as_str(), c.loss_resyncs))
        .collect();
    assert_eq!(resyncs, [("a", 1), ("b", 0)]);
    // A redelivery of an old sequence number is not a gap.
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 2, &refresh_change("w", "2")),
        )
        .await
        .unwrap();
    transport
        .publish(
            DEFAULT_TOPIC,
            "a",
            raw_event("a", 7, 5, &refresh_change("v", "5")),
        )
        .await
        .unwrap();
    eventually("seq 5", async || holds(&a, "v", Some("5")).await).await;
    assert_eq!(node.status().publisher_gaps, 1);
}

/// After a resume (a re-subscription from the node's position, with no loss
/// signalled), the first event of a publisher the node has not heard from
/// cannot vouch for the ones before it: had the history been replaced
/// without the transport noticing, they would be gone. It is answered as a
/// gap in that cache. At a fresh start (empty caches) it is trusted.
#[tokio::test]
async fn after_a_resume_an_unknown_publishers_first_event_is_not_trusted() {
    let flaky = flaky();
    let (a, b) = (cache("a"), cache("b"));
    let node = Node::builder("n1", flaky.clone())
        .reconnect_backoff(Duration::from_millis(1), Duration::from_millis(10))
        .register(&a)
        .register(&b)
        .start()
        .await
        .unwrap();
    let publish = |cache: &'static str, publisher, seq, k: &'static str| {
        let transport = flaky.inner();
        async move {
            transport
                .publish(
                    DEFAULT_TOPIC,
                    cache,
                    raw_event(cache, publisher, seq, &refresh_change(k, "v")),
                )
                .await
                .unwrap();
        }
    };
    // Before any resume: a publisher first seen at seq 41 is trusted.
    publish("a", 1, 41, "a1").await;
    eventually("applied", async || holds(&a, "a1", Some("v")).await).await;
    // The first subscription fails after that batch; the node resumes.
    eventually("resumed", async || flaky.subscriptions() == 2).await;
    b.insert("warm".into(), "kept".into()).await;
    publish("a", 1, 42, "a2").await; // known publisher, next number: fine
    publish("a", 2, 1, "a3").await; // a new publisher's first event: fine
    publish("b", 3, 17, "b1").await; // unknown, after a resume: a gap in b
    eventually("b1 applied", async || holds(&b, "b1", Some("v")).await).await;
    assert!(holds(&a, "a1", Some("v")).await, "a was not resynced");
    assert_eq!(b.peek("warm").await, None, "b was resynced");
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (1, 1), "{s:?}");
    publish("b", 3, 18, "b2").await; // now known
    eventually("b2 applied", async || holds(&b, "b2", Some("v")).await).await;
    assert_eq!(node.status().publisher_gaps, 1);
}

#[tokio::test]
async fn falling_behind_the_history_is_answered_by_invalidating() {
    // History of 4 records, and the consumer cannot run while we publish 50
    // (the current-thread runtime only switches tasks at an await that blocks).
    let transport = EmbeddedTransport::builder()
        .max_records(4)
        .build()
        .expect("valid settings");
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .max_batch(1)
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("stale".into(), "old".into()).await;
    let p = node.publisher();
    for i in 0..50 {
        p.insert("t", [(format!("k{i}"), "v")]).await.unwrap();
    }
    eventually("last event applied", async || {
        holds(&c, "k49", Some("v")).await
    })
    .await;
    let s = node.status();
    assert!(s.losses >= 1, "{s:?}");
    assert_eq!(s.last_loss_reason.as_deref(), Some("trimmed"));
    assert!(s.caches[0].loss_resyncs >= 1);
    assert_eq!(c.get("stale").await, None);
}

/// The embedded transport, whose first subscription breaks after one batch.
pub(super) fn flaky() -> FaultyTransport {
    let t = FaultyTransport::new(EmbeddedTransport::new());
    t.break_next_subscription_after(1);
    t
}

#[tokio::test]
async fn a_broken_subscription_resumes_where_it_was_without_loss() {
    let flaky = flaky();
    let c = cache("t");
    let node = Node::builder("n1", flaky.clone())
        .max_batch(1)
        .reconnect_backoff(Duration::from_millis(1), Duration::from_millis(10))
        .register(&c)
        .start()
        .await
        .unwrap();
    let p = node.publisher();
    for i in 0..5 {
        p.insert("t", [(format!("k{i}"), "v")]).await.unwrap();
    }
    eventually("all applied", async || holds(&c, "k4", Some("v")).await).await;
    for i in 0..5 {
        assert!(holds(&c, &format!("k{i}"), Some("v")).await, "k{i} lost");
    }
    let s = node.status();
    assert_eq!(s.transport_errors, 1);
    assert_eq!(s.losses, 0, "resuming from a known position loses nothing");
    assert_eq!(flaky.subscriptions(), 2);
    assert!(node.is_consuming());
}

#[tokio::test]
async fn shutdown_saves_the_position_and_a_restart_replays_from_it() {
    let transport = EmbeddedTransport::new();
    let store = MemoryOffsetStore::new();
    let node = Node::builder("n1", transport.clone())
        .offset_store(store.clone())
        .register(&cache("t"))
        .start()
        .await
        .unwrap();
    let p = node.publisher();
    p.insert("t", [("a", "1")]).await.unwrap();
    eventually("applied", async || node.status().events_received == 1).await;
    node.shutdown().await.unwrap();
    assert!(!node.is_consuming());
    let saved = store
        .load(DEFAULT_TOPIC)
        .await
        .unwrap()
        .expect("position saved on shutdown");

    p.insert("t", [("b", "2")]).await.unwrap(); // while the node is down
    let c = cache("t");
    let node = Node::builder("n1", transport)
        .offset_store(store.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    assert_eq!(node.status().position, saved);
    eventually("replayed", async || holds(&c, "b", Some("2")).await).await;
    assert_eq!(
        c.get("a").await,
        None,
        "only what came after the saved position is replayed"
    );
}

#[tokio::test]
async fn file_store_positions_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let transport = EmbeddedTransport::new();
    let node = Node::builder("n1", transport.clone())
        .offset_store(FileOffsetStore::new(dir.path()))
        .persist_interval(Duration::from_millis(10))
        .register(&cache("t"))
        .start()
        .await
        .unwrap();
    node.publisher().insert("t", [("a", "1")]).await.unwrap();
    let path = dir.path().join("offsets.json");
    eventually("saved periodically", async || {
        std::fs::read_to_string(&path).is_ok_and(|s| s.contains("\"offsetTable\""))
    })
    .await;
    node.shutdown().await.unwrap();
    let stored = FileOffsetStore::new(dir.path())
        .load(DEFAULT_TOPIC)
        .await
        .unwrap();
    assert_eq!(stored, Some(node.status().position));
}

#[tokio::test]
async fn caches_can_be_registered_after_start() {
    let transport = EmbeddedTransport::new();
    let node = Node::start("n1", transport.clone()).await.unwrap();
    let c = cache("late");
    c.insert("warm".into(), "from before".into()).await;
    node.register(&c).await.unwrap();
    assert_eq!(c.get("warm").await, None, "registration empties the cache");
    node.publisher().insert("late", [("k", "v")]).await.unwrap();
    eventually("applied after late registration", async || {
        holds(&c, "k", Some("v")).await
    })
    .await;
}

#[tokio::test]
async fn misconfiguration_fails_at_start() {
    let transport = EmbeddedTransport::new();
    let err = Node::builder("n1", transport.clone())
        .register(&cache("x"))
        .register(&cache("x"))
        .start()
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::DuplicateCache(ref n) if n == "x"),
        "{err}"
    );

    let shared = cache("y");
    let _n1 = Node::builder("n1", transport.clone())
        .register(&shared)
        .start()
        .await
        .unwrap();
    let err = Node::builder("n2", transport.clone())
        .register(&shared)
        .start()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("already registered"), "{err}");

    let err = Node::builder("n3", transport.clone())
        .max_event_bytes(usize::MAX)
        .start()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    let err = Node::builder("", transport).start().await.unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
}

#[tokio::test]
async fn dropping_the_last_handle_stops_the_consumer() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    let weak = Arc::downgrade(&node.handle.shared);
    drop(node);
    eventually("tasks exited", async || weak.strong_count() == 0).await;
}

/// A key type whose `Deserialize` panics: user code the node cannot vouch for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
struct PanickyKey(String);

impl<'de> serde::Deserialize<'de> for PanickyKey {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> std::result::Result<Self, D::Error> {
        panic!("user Deserialize panicked")
    }
}

#[tokio::test]
async fn a_panic_in_user_code_shows_as_unhealthy_rather_than_silently_stale() {
    let transport = EmbeddedTransport::new();
    let c: SyncedCache<PanickyKey, String> = SyncedCache::new("t", moka::future::Cache::new(10));
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    assert!(node.is_consuming());
    node.publisher()
        .invalidate("t", [PanickyKey("k".into())])
        .await
        .unwrap();
    eventually("node reports itself down", async || !node.is_consuming()).await;
    assert!(!node.status().consuming);
}

#[tokio::test]
async fn with_signatures_on_only_authentic_events_change_anything() {
    let ring = Keyring::new("k2", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("k".into(), "cached".into()).await;

    // Unsigned, signed with an unknown key, forged (right id, wrong secret), tampered.
    Publisher::new(transport.clone())
        .insert("t", [("k", "unsigned")])
        .await
        .unwrap();
    let stranger = Keyring::new("k9", b"some-other-secret-000".to_vec()).unwrap();
    Publisher::builder(transport.clone())
        .signing(stranger)
        .build()
        .unwrap()
        .insert("t", [("k", "stranger")])
        .await
        .unwrap();
    let forger = Keyring::new("k2", b"a-guessed-secret-0000".to_vec()).unwrap();
    Publisher::builder(transport.clone())
        .signing(forger)
        .build()
        .unwrap()
        .insert("t", [("k", "forged")])
        .await
        .unwrap();
    let mut tampered = ring.sign(&raw_event("t", 5, 1, &refresh_change("k", "original")));
    let last = tampered.len() - 1;
    tampered[last] ^= 0xFF;
    transport
        .publish(DEFAULT_TOPIC, "t", Bytes::from(tampered))
        .await
        .unwrap();

    Publisher::builder(transport.clone())
        .signing(ring)
        .build()
        .unwrap()
        .insert("t", [("ok", "signed")])
        .await
        .unwrap();
    eventually("the signed event applies", async || {
        holds(&c, "ok", Some("signed")).await
    })
    .await;
    assert_eq!(
        c.peek("k").await.as_deref(),
        Some("cached"),
        "no rejected event touched the cache"
    );
    let s = node.status();
    assert_eq!((s.events_rejected, s.losses), (4, 0));
    assert_eq!(
        s.caches[0].loss_resyncs, 0,
        "forgeries must not be able to flush caches"
    );
    assert!(node.is_consuming());
    // The node's own publisher signs.
    node.publisher()
        .insert("t", [("own", "signed too")])
        .await
        .unwrap();
    eventually("own event applies", async || {
        holds(&c, "own", Some("signed too")).await
    })
    .await;
}

#[tokio::test]
async fn a_node_without_keys_accepts_signed_events_for_rollout() {
    let ring = Keyring::new("k1", b"rollout-secret-0000000".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let _node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    Publisher::builder(transport)
        .signing(ring)
        .build()
        .unwrap()
        .insert("t", [("k", "v")])
        .await
        .unwrap();
    eventually("signed event applies unverified", async || {
        holds(&c, "k", Some("v")).await
    })
    .await;
}

/// Regression: a node that started just after a delete at version 12 was
/// published, then received an upsert at version 10 (committed earlier,
/// published later by another writer), installed the older row.
#[tokio::test]
async fn a_fresh_node_replays_the_reorder_window_so_older_refreshes_are_refused() {
    let transport = EmbeddedTransport::new();
    let p = Publisher::new(transport.clone());
    p.invalidate_versioned("t", [("k", Some(12))])
        .await
        .unwrap();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    p.insert_versioned("t", [("k", "older row", Some(10))])
        .await
        .unwrap();
    p.insert_versioned("t", [("j", "newer row", Some(13))])
        .await
        .unwrap();
    eventually("j applied", async || {
        holds(&c, "j", Some("newer row")).await
    })
    .await;
    assert_eq!(
        c.peek("k").await,
        None,
        "the replayed tombstone keeps version 10 out"
    );
    let s = &node.status().caches[0];
    assert_eq!(
        (s.refreshes, s.refreshes_quarantined, s.stale_ignored),
        (1, 0, 1)
    );
}

/// Without history to replay, the same situation is answered by quarantine.
#[tokio::test]
async fn without_history_a_fresh_node_quarantines_instead() {
    // Without history: a subscription from anywhere but the latest is refused.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.refuse_history(true);
    let p = Publisher::new(transport.clone());
    p.invalidate_versioned("t", [("k", Some(12))])
        .await
        .unwrap();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    p.insert_versioned("t", [("k", "older row", Some(10))])
        .await
        .unwrap();
    p.insert("t", [("fence", "x")]).await.unwrap();
    eventually("fence applied", async || {
        holds(&c, "fence", Some("x")).await
    })
    .await;
    assert_eq!(c.peek("k").await, None);
    assert_eq!(node.status().caches[0].refreshes_quarantined, 1);
}

#[test]
fn publisher_seqs_count_gaps_per_publisher_and_cache() {
    let mut seqs = PublisherSeqs::default();
    assert_eq!(
        seqs.observe(1, "a", 5),
        None,
        "the first event sets the baseline"
    );
    assert_eq!(seqs.observe(1, "a", 6), None);
    assert_eq!(seqs.observe(1, "a", 9), Some(2));
    // A redelivery is no gap and does not move the baseline back.
    assert_eq!(seqs.observe(1, "a", 7), None);
    assert_eq!(seqs.observe(1, "a", 10), None);
    // Other caches and other publishers keep their own baselines.
    assert_eq!(seqs.observe(1, "b", 1), None);
    assert_eq!(seqs.observe(2, "a", 1), None);
    assert_eq!(seqs.observe(1, "b", 3), Some(1));
    assert_eq!(seqs.tracked, 3);
    // The ends of the range are numbers like any other.
    assert_eq!(seqs.observe(3, "a", u64::MAX), None);
    assert_eq!(seqs.observe(3, "a", u64::MAX), None);
    assert_eq!(seqs.observe(3, "a", 0), None);
    assert_eq!(seqs.observe(4, "a", 0), None);
    assert_eq!(seqs.observe(4, "a", u64::MAX), Some(u64::MAX - 1));
    // After a resume, unknown publishers do not vouch for what came before.
    seqs.resumed(["a".to_owned()]);
    assert_eq!(
        seqs.observe(5, "a", 1),
        None,
        "a first event vouches for itself"
    );
    assert_eq!(seqs.observe(6, "a", 7), Some(6));
    assert_eq!(
        seqs.observe(6, "b", 7),
        None,
        "b was not held at the resume"
    );
    seqs.resynced("a");
    assert_eq!(seqs.observe(7, "a", 3), None, "a was resynced since");
    seqs.clear();
    assert_eq!(
        seqs.observe(1, "a", 20),
        None,
        "after a loss, a new baseline"
    );
}

/// Regression: on a verifying node, an unsigned payload over the size
/// limit, tagged for a held cache, invalidated and quarantined that cache:
/// the size check and the tag routing ran before the signature check.
/// Nothing unauthenticated may change cache state; it only bumps a counter.
#[tokio::test]
async fn unauthenticated_input_changes_nothing_whatever_its_size_or_tag() {
    let ring = Keyring::new("k1", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .max_event_bytes(1024)
        .register(&c)
        .start()
        .await
        .unwrap();
    c.insert("k".into(), "cached".into()).await;

    let oversized_unsigned = raw_event("t", 5, 1, &refresh_change("k", &"x".repeat(4096)));
    let oversized_garbage = Bytes::from(vec![0xAB; 4096]);
    let mut oversized_forged = vec![crate::wire::FORMAT_SIGNED, 2, b'k', b'1'];
    oversized_forged.extend([0u8; 32 + 4096]);
    let small_garbage = Bytes::from_static(b"\x01\xff\xff\xff");
    for payload in [
        oversized_unsigned,
        oversized_garbage,
        Bytes::from(oversized_forged),
        small_garbage,
        Bytes::new(),
    ] {
        transport
            .publish(DEFAULT_TOPIC, "t", payload)
            .await
            .unwrap();
    }
    // A signed, versioned refresh afterwards: applied normally, so the cache
    // was neither resynced nor quarantined by what came before.
    let admin = Publisher::builder(transport.clone())
        .signing(ring)
        .build()
        .unwrap();
    admin
        .insert_versioned("t", [("fence", "signed", Some(7))])
        .await
        .unwrap();
    eventually("the signed event applies", async || {
        holds(&c, "fence", Some("signed")).await
    })
    .await;
    assert_eq!(c.peek("k").await.as_deref(), Some("cached"));
    let s = node.status();
    assert_eq!(s.events_rejected, 5, "{s:?}");
    assert_eq!((s.losses, s.caches[0].loss_resyncs), (0, 0), "{s:?}");
    assert_eq!(s.caches[0].rejected_events, 0, "{s:?}");
    assert_eq!(s.caches[0].refreshes_quarantined, 0, "{s:?}");
}

/// Guards against dropping an event with no tag to name its cache (Redis
/// Pub/Sub): a genuine event over the node's size limit, or one in a format
/// the node cannot read, if only counted and dropped, would leave the cache
/// it changed stale. The header, read from the front of an oversized event,
/// names the cache; an event that names none may have changed any.
#[tokio::test]
async fn an_unreadable_event_without_a_tag_invalidates_what_it_may_have_changed() {
    // Records without their tags, as Redis Pub/Sub delivers them.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.strip_tags(true);
    let (t, u) = (cache("t"), cache("u"));
    let node = Node::builder("n1", transport.clone())
        .max_event_bytes(1024)
        .register(&t)
        .register(&u)
        .start()
        .await
        .unwrap();
    t.insert("k".into(), "cached".into()).await;
    u.insert("k".into(), "cached".into()).await;

    // Too large for this node (its publisher allowed more): only "t".
    let big = raw_event("t", 5, 1, &refresh_change("k", &"x".repeat(4096)));
    transport.publish(DEFAULT_TOPIC, "t", big).await.unwrap();
    // The publisher's next number is no gap: the oversized one used up 1.
    let next = raw_event("t", 5, 2, &refresh_change("after", "big"));
    transport.publish(DEFAULT_TOPIC, "t", next).await.unwrap();
    eventually("the next event applies", async || {
        holds(&t, "after", Some("big")).await
    })
    .await;
    assert_eq!(t.get("k").await, None, "t may have missed a change");
    assert_eq!(u.peek("k").await.as_deref(), Some("cached"));
    let s = node.status();
    assert_eq!(
        (s.events_rejected, s.publisher_gaps, s.losses),
        (1, 0, 0),
        "{s:?}"
    );
    assert_eq!(
        (s.caches[0].rejected_events, s.caches[1].rejected_events),
        (1, 0)
    );

    // A format this node cannot read, naming no cache: any may be stale.
    u.insert("k".into(), "cached".into()).await;
    transport
        .publish(
            DEFAULT_TOPIC,
            "u",
            Bytes::from_static(b"\x09a newer format"),
        )
        .await
        .unwrap();
    // The loss is counted before the caches are invalidated: wait for
    // what the test is about, the invalidation.
    eventually("every cache is invalidated", async || {
        holds(&u, "k", None).await
    })
    .await;
    let s = node.status();
    assert_eq!(s.losses, 1, "{s:?}");
    assert_eq!(s.last_loss_reason.as_deref(), Some("unreadable"));
    assert_eq!(s.events_rejected, 2);
    node.shutdown().await.unwrap();
}

/// The tag is not signed, the header is (on a verifying node): an oversized
/// event re-tagged for another cache resyncs the cache its header names.
#[tokio::test]
async fn an_oversized_event_resyncs_the_cache_its_header_names_not_its_tag() {
    let ring = Keyring::new("k1", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let (t, u) = (cache("t"), cache("u"));
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .max_event_bytes(1024)
        .register(&t)
        .register(&u)
        .start()
        .await
        .unwrap();
    t.insert("k".into(), "cached".into()).await;
    u.insert("k".into(), "cached".into()).await;
    let signed = Bytes::from(ring.sign(&raw_event(
        "t",
        5,
        1,
        &refresh_change("k", &"x".repeat(4096)),
    )));
    transport.publish(DEFAULT_TOPIC, "u", signed).await.unwrap();
    eventually("the event is rejected", async || {
        node.status().events_rejected == 1
    })
    .await;
    let s = node.status();
    assert_eq!(
        (s.caches[0].rejected_events, s.caches[1].rejected_events),
        (1, 0),
        "{s:?}"
    );
    assert_eq!(t.get("k").await, None);
    assert_eq!(u.peek("k").await.as_deref(), Some("cached"));
    node.shutdown().await.unwrap();
}

/// Guards against a registration dropped while it empties the cache
/// leaving the cache in the node's map with no re-subscription, so that on
/// a transport that filters by tag its events never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_given_up_half_way_leaves_nothing_behind() {
    let transport = EmbeddedTransport::new();
    let node = Node::builder("n1", transport.clone())
        .start()
        .await
        .unwrap();
    let c = crate::cache::tests::locking_cache();
    // A write in progress, which the reset's barrier waits for (a pinned
    // load does not hold a clear up: see `cache/park.rs`).
    let release = crate::cache::tests::stall_clears(&c).await;
    let gave_up = tokio::time::timeout(Duration::from_millis(50), node.register(&c)).await;
    assert!(
        gave_up.is_err(),
        "the reset should wait for the write in progress"
    );
    assert!(node.status().caches.is_empty(), "{:?}", node.status());
    drop(release);

    // Nothing was left behind: the same cache registers, and gets events.
    node.register(&c).await.unwrap();
    node.publisher().insert("t", [("k2", "v")]).await.unwrap();
    eventually("events reach the cache", async || {
        holds(&c, "k2", Some("v")).await
    })
    .await;
    node.shutdown().await.unwrap();
}

/// Regression: a duplicate of an event whose sequence number is `u64::MAX`
/// counted as a gap in release builds (`last + 1` wrapped to 0) and
/// overflowed, killing the consumer task, in debug builds.
#[tokio::test]
async fn the_largest_sequence_number_is_just_a_number() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    for (seq, v) in [(u64::MAX - 1, "a"), (u64::MAX, "b"), (u64::MAX, "c")] {
        transport
            .publish(
                DEFAULT_TOPIC,
                "t",
                raw_event("t", 9, seq, &refresh_change("k", v)),
            )
            .await
            .unwrap();
    }
    eventually("all three applied", async || {
        node.status().caches[0].events_applied == 3
    })
    .await;
    assert!(node.is_consuming(), "the consumer task died");
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (0, 0), "{s:?}");
    // The duplicate is late: it lands as an invalidation.
    assert_eq!(s.events_late, 1, "{s:?}");
    assert_eq!(c.peek("k").await, None);
}

/// Regression: `reorder_window(Duration::MAX)` panicked in `start()`
/// (`now - window` and `now + window` overflowed). A window that does not
/// fit the clock means "as far as the clock reaches": replay all the
/// history there is, and quarantine for as long as the process lives.
#[tokio::test]
async fn an_unbounded_reorder_window_replays_everything_and_quarantines_for_good() {
    let transport = EmbeddedTransport::new();
    Publisher::new(transport.clone())
        .insert_versioned("t", [("old", "history", Some(1))])
        .await
        .unwrap();
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .reorder_window(Duration::MAX)
        .register(&c)
        .start()
        .await
        .unwrap();
    eventually("the whole history is replayed", async || {
        node.status().caches[0].events_applied == 1
    })
    .await;
    let late = cache("late");
    node.register(&late).await.unwrap();
    node.publisher()
        .insert_versioned("late", [("k", "v", Some(2))])
        .await
        .unwrap();
    eventually("applied as an invalidation", async || {
        late.status().refreshes_quarantined == 1
    })
    .await;
    assert!(node.is_consuming());
}

/// Regression: a cache claimed by a node whose `start()` failed, or by a
/// node that shut down, could never be registered again ("already
/// registered"); and `register()` on a stopped node returned `Ok` and then
/// applied nothing.
#[tokio::test]
async fn registrations_are_released_when_a_start_fails_or_a_node_stops() {
    let transport = EmbeddedTransport::new();
    let c = cache("t");

    // Start fails after the caches were claimed: a corrupt offsets file.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("offsets.json"), b"{not json").unwrap();
    let err = Node::builder("n1", transport.clone())
        .offset_store(FileOffsetStore::new(dir.path()))
        .register(&c)
        .start()
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("not a valid offsets file"),
        "{err}"
    );

    // Start fails on the configuration, with another cache already claimed.
    let err = Node::builder("n1", transport.clone())
        .register(&c)
        .register(&cache("t"))
        .start()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::DuplicateCache(_)), "{err}");

    let node = Node::builder("n2", transport.clone())
        .register(&c)
        .start()
        .await
        .expect("a failed start released the cache");
    node.shutdown().await.unwrap();

    let stopped = node.register(&cache("other")).await.unwrap_err();
    assert!(matches!(stopped, Error::Shutdown), "{stopped}");

    let again = Node::builder("n3", transport.clone())
        .register(&c)
        .start()
        .await
        .expect("a node that shut down released its caches");
    again.publisher().insert("t", [("k", "v")]).await.unwrap();
    eventually("the new node applies", async || {
        holds(&c, "k", Some("v")).await
    })
    .await;
}

/// One step of the lifecycle matrix.
#[derive(Debug, Clone)]
enum Step {
    /// Start node `slot` with these caches (a bit set), with the broker up
    /// or down. A node already in the slot is shut down first, unless
    /// `drop_old`, when it is dropped without a word.
    Start {
        slot: usize,
        caches: u8,
        broker_down: bool,
        drop_old: bool,
    },
    Register {
        slot: usize,
        cache: usize,
    },
    Shutdown {
        slot: usize,
    },
    Drop {
        slot: usize,
    },
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..3usize, 0..8u8, proptest::bool::weighted(0.25), any::<bool>()).prop_map(
            |(slot, caches, broker_down, drop_old)| Step::Start { slot, caches, broker_down, drop_old }
        ),
        3 => (0..3usize, 0..3usize).prop_map(|(slot, cache)| Step::Register { slot, cache }),
        1 => (0..3usize).prop_map(|slot| Step::Shutdown { slot }),
        1 => (0..3usize).prop_map(|slot| Step::Drop { slot }),
    ]
}

/// Drops the node and waits until it has let go of its caches: its last
/// reference gone, and then its claims released (by `Shared`'s drop, which
/// runs after the count reached 0, on whichever thread dropped it last).
/// Only its own claims: a cache it held before a shutdown may be another
/// node's since.
async fn let_go(node: Node, held: &[usize], caches: &[Cache]) {
    let token = node.handle.shared.token;
    let weak = Arc::downgrade(&node.handle.shared);
    drop(node);
    eventually("the dropped node lets go", async || {
        weak.strong_count() == 0 && held.iter().all(|&c| caches[c].owner() != token)
    })
    .await;
}

/// Register, start, fail, shut down, drop and register again, in any order:
/// a cache is held by at most one running node; every refusal is the one
/// the situation calls for (`DuplicateCache`, a claim held elsewhere,
/// `Shutdown`); a failed start, a shutdown and a dropped node each give
/// their caches back; and every cache a running node holds gets its events.
async fn lifecycle(steps: Vec<Step>) -> std::result::Result<(), String> {
    // Subscribing fails while the broker is down.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let caches: Vec<Cache> = (0..3).map(|i| cache(&format!("c{i}"))).collect();
    // Per slot: the node, whether it still runs, and the caches it holds.
    let mut slots: Vec<Option<(Node, bool, Vec<usize>)>> = vec![None, None, None];
    let owner = |slots: &Vec<Option<(Node, bool, Vec<usize>)>>, c: usize| {
        slots.iter().position(|s| {
            s.as_ref()
                .is_some_and(|(_, running, held)| *running && held.contains(&c))
        })
    };
    for (i, step) in steps.into_iter().enumerate() {
        let fail = |what: String| format!("step {i} {step:?}: {what}");
        match step.clone() {
            Step::Start {
                slot,
                caches: set,
                broker_down,
                drop_old,
            } => {
                if let Some((old, _, held)) = slots[slot].take() {
                    if drop_old {
                        let_go(old, &held, &caches).await;
                    } else {
                        old.shutdown()
                            .await
                            .map_err(|e| fail(format!("shutdown: {e}")))?;
                    }
                }
                let wanted: Vec<usize> = (0..3).filter(|c| set & (1 << c) != 0).collect();
                let taken = wanted.iter().any(|&c| owner(&slots, c).is_some());
                transport.fail_subscriptions(broker_down);
                let mut builder = Node::builder(format!("n{slot}"), transport.clone());
                for &c in &wanted {
                    builder = builder.register(&caches[c]);
                }
                let started = builder.start().await;
                transport.fail_subscriptions(false);
                match (started, taken, broker_down) {
                    (Ok(node), false, false) => slots[slot] = Some((node, true, wanted)),
                    (Err(e), true, _) if e.is_config() => {}
                    (Err(e), false, true) if e.is_disconnected() => {}
                    (other, taken, down) => {
                        return Err(fail(format!("taken {taken}, down {down}: got {other:?}")));
                    }
                }
            }
            Step::Register { slot, cache: c } => {
                let Some((node, _, _)) = slots[slot].as_ref() else {
                    continue;
                };
                let result = node.register(&caches[c]).await;
                let holder = owner(&slots, c);
                let (node, running, held) = slots[slot].as_mut().expect("checked above");
                match result {
                    Ok(()) if *running && holder.is_none() => held.push(c),
                    Err(Error::Shutdown) if !*running => {}
                    Err(Error::DuplicateCache(_)) if *running && held.contains(&c) => {}
                    Err(e) if *running && e.is_config() && holder.is_some_and(|h| h != slot) => {}
                    other => {
                        return Err(fail(format!(
                            "{} running {running}, holder {holder:?}: got {other:?}",
                            node.id()
                        )));
                    }
                }
            }
            Step::Shutdown { slot } => {
                if let Some((node, running, _)) = slots[slot].as_mut() {
                    node.shutdown()
                        .await
                        .map_err(|e| fail(format!("shutdown: {e}")))?;
                    *running = false;
                }
            }
            Step::Drop { slot } => {
                if let Some((node, _, held)) = slots[slot].take() {
                    let_go(node, &held, &caches).await;
                }
            }
        }
    }
    // Every cache a running node holds gets its events.
    let publisher = Publisher::new(transport.inner());
    for (c, cache) in caches.iter().enumerate() {
        if owner(&slots, c).is_none() {
            continue;
        }
        publisher
            .insert(cache.name(), [("k", "final")])
            .await
            .map_err(|e| e.to_string())?;
        eventually(&format!("{} applies", cache.name()), async || {
            holds(cache, "k", Some("final")).await
        })
        .await;
    }
    Ok(())
}

/// The matrix's own bookkeeping, once wrong: a node shut down keeps its
/// list of caches, which another node then claims; dropping the first must
/// wait for its own claims only (it waited for the other node's, 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_a_shut_down_nodes_caches_held_elsewhere_when_it_is_dropped() {
    let start = |slot| Step::Start {
        slot,
        caches: 0b001,
        broker_down: false,
        drop_old: false,
    };
    let steps = vec![
        start(0),
        Step::Shutdown { slot: 0 },
        start(1),
        Step::Drop { slot: 0 },
    ];
    lifecycle(steps).await.unwrap();
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]
    #[test]
    fn lifecycle_matrix(steps in proptest::collection::vec(step(), 1..16)) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let outcome = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), lifecycle(steps)).await
        });
        let result = outcome.map_err(|_| proptest::test_runner::TestCaseError::fail("hung"))?;
        result.map_err(proptest::test_runner::TestCaseError::fail)?;
    }
}

/// A batch applies in runs per cache. A gap's resync must come after the
/// events before it in the same batch: applied after it, an event that the
/// missing one superseded would outlive the resync meant to drop it.
#[tokio::test]
async fn a_gap_resyncs_after_the_events_before_it_in_the_same_batch() {
    use super::route::apply_records;
    use crate::transport::Record;

    let (a, b) = (cache("a"), cache("b"));
    let (shared, caches) = Node::builder("n", EmbeddedTransport::new())
        .register(&a)
        .register(&b)
        .into_shared();
    for c in caches {
        shared.register(c).await.unwrap();
    }
    let record = |cache: &str, seq: u64, k: &str, v: &str| {
        Record::new(
            Some(cache.into()),
            raw_event(cache, 7, seq, &refresh_change(k, v)),
        )
    };
    let records = vec![
        record("a", 1, "x", "1"),
        // Another cache in between: the runs are a, b, a.
        record("b", 1, "y", "1"),
        record("a", 2, "w", "2"),
        // Sequence 3 is missing.
        record("a", 4, "z", "4"),
    ];
    apply_records(&shared, &mut PublisherSeqs::default(), records).await;
    assert_eq!(a.peek("x").await, None, "applied after the resync");
    assert_eq!(a.peek("w").await, None, "applied after the resync");
    assert_eq!(a.peek("z").await.as_deref(), Some("4"));
    assert_eq!(b.peek("y").await.as_deref(), Some("1"));
    assert_eq!(a.status().loss_resyncs, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tmp_reviewer_sequence() {
    let steps = vec![
        Step::Start {
            slot: 0,
            caches: 1,
            broker_down: false,
            drop_old: false,
        },
        Step::Shutdown { slot: 0 },
        Step::Start {
            slot: 1,
            caches: 1,
            broker_down: false,
            drop_old: false,
        },
        Step::Drop { slot: 0 },
    ];
    lifecycle(steps).await.unwrap();
}
