//! The publisher: how admin services tell every node what changed.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::error::Result;
use crate::table::Table;
use crate::transport::{DEFAULT_TOPIC, Transport};
use crate::util::Hasher;
#[cfg(any(feature = "_sql", feature = "mysql-cdc"))]
use crate::wire::Change;
use crate::wire::{Codec, DEFAULT_MAX_EVENT_BYTES, Outgoing};

/// Publishes change events for named caches.
///
/// Each call is one batch; a batch larger than the event size limit is split
/// into several events, in order. Events to one cache from one publisher are
/// numbered 1, 2, 3, … so nodes can detect a missing one. Events to one
/// cache are handed to the transport one at a time, in number order, and
/// the transport keeps that order on the wire; the broker's
/// acknowledgements are awaited outside that lock, so up to
/// [`window`](PublisherBuilder::window) events (64 by default) of this
/// publisher can be in flight at once (pipelined, on transports that
/// support it: see [`Transport::start_publish`]). A publish still returns
/// only once the broker acknowledged every event it sent.
///
/// A failed publish returns an error and still uses up its sequence number:
/// if the event did reach some nodes, the next one must not reuse the number,
/// and if it did not, nodes see a gap and invalidate, which is safe. So
/// does a publish whose acknowledgement fails while later ones, already in
/// flight behind it, go through.
///
/// Every [`announce_interval`](PublisherBuilder::announce_interval) (1 s
/// by default) it also announces, per cache it has published to lately, the
/// last number it used, so that a node that missed the last events before a
/// quiet period notices (see the crate docs, "What happens on loss"). After
/// a publish, a cache is announced at each interval until it has been
/// announced three times at an unchanged number, then no more until it is
/// published to again: one announcement after the last event is what a node
/// needs, the repeats cover lost announcements, and an idle publisher sends
/// nothing. Announcements run in a task spawned on the tokio runtime of a
/// publish (again by a later publish, should that runtime shut down). The
/// task holds the publisher's state, so a publisher dropped right after a
/// publish (one per request, or a command-line tool that publishes once)
/// still announces: the first announcement goes out within one interval
/// of the last publish, and the task ends, letting the state go, once
/// every cache has been announced three times unchanged (some four
/// intervals after the last publish). A later publish starts it again.
/// The promise therefore holds as long as the process and that tokio
/// runtime keep running for one announce interval after the last publish
/// (three, for the repeats that cover a lost announcement).
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
    /// Per cache, its numbering. The key is the cache's name, interned:
    /// a publish finds its cache without allocating, and takes the name
    /// from here for what it returns ([`Published`]) and queues (`again_after`).
    seqs: Mutex<HashMap<Arc<str>, Arc<tokio::sync::Mutex<SeqState>>, Hasher>>,
    /// `Duration::MAX`: no announcements.
    announce_interval: Duration,
    /// Whether an announcing task is running (or spawned, not yet run).
    announcing: AtomicBool,
    /// Per cache: the number last announced and how often it was sent.
    /// Kept here, not in the task, so that a task started again by a later
    /// publish does not announce long-quiet caches once more.
    announced: Mutex<HashMap<Arc<str>, (u64, u8)>>,
    /// The second sends of `again_after` not yet due, in due order (the
    /// delay is the same for all), and whether a task is sending them.
    again: Mutex<AgainQueue>,
    /// Each change is sent a second time, as an invalidation, this much later.
    again_after: Option<Duration>,
    /// One permit per event handed over and not yet acknowledged: the
    /// window of calls in flight, across every cache.
    window: tokio::sync::Semaphore,
    /// The transport's `pipelines()`, asked once.
    pipelines: bool,
}

/// How many events a publisher has in flight at most by default: enough to
/// fill a round trip of a few milliseconds at tens of thousands of events a
/// second, and a bounded amount of memory.
pub(crate) const DEFAULT_WINDOW: usize = 64;

impl fmt::Debug for Publisher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Publisher")
            .field("topic", &self.inner.topic)
            .field("origin", &self.inner.origin)
            .field("id", &format_args!("{:016x}", self.inner.id))
            .finish_non_exhaustive()
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
        announce_interval: Duration,
        again_after: Option<Duration>,
        window: usize,
    ) -> Self {
        Publisher {
            inner: Arc::new(PublisherInner {
                pipelines: transport.pipelines(),
                transport,
                topic,
                origin,
                // Random: a restarted publisher must not continue an old numbering.
                id: crate::util::random_u64(),
                codec,
                seqs: Mutex::default(),
                announce_interval,
                announcing: AtomicBool::new(false),
                announced: Mutex::default(),
                again: Mutex::default(),
                again_after,
                // Tokio's limit is far above any useful window; beyond it
                // the window is as good as unbounded.
                window: tokio::sync::Semaphore::new(
                    window.clamp(1, tokio::sync::Semaphore::MAX_PERMITS),
                ),
            }),
        }
    }
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
            DEFAULT_ANNOUNCE_INTERVAL,
            None,
            DEFAULT_WINDOW,
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
            announce_interval: DEFAULT_ANNOUNCE_INTERVAL,
            again_after: None,
            window: DEFAULT_WINDOW,
        }
    }

    /// Tells every node to install these entries in `cache` (unversioned:
    /// applied in delivery order). The untyped form, by cache name, for
    /// tools that do not know the key and value types; code that does uses
    /// [`dictionary`](Self::dictionary), whose [`Table`] checks them.
    pub async fn insert<K: Serialize, V: Serialize>(
        &self,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Published> {
        self.insert_versioned(cache, entries.into_iter().map(|(k, v)| (k, v, None)))
            .await
    }

    /// Like [`insert`](Self::insert), with a version per entry: a node
    /// ignores an insert older than what it already reflects for that key.
    pub async fn insert_versioned<K: Serialize, V: Serialize>(
        &self,
        cache: &str,
        entries: impl IntoIterator<Item = (K, V, Option<u64>)>,
    ) -> Result<Published> {
        let changes = Outgoing::refreshes(entries, self.budget())?;
        self.send(cache, changes).await
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
    /// so an older insert arriving later is ignored.
    pub async fn invalidate_versioned<K: Serialize>(
        &self,
        cache: &str,
        keys: impl IntoIterator<Item = (K, Option<u64>)>,
    ) -> Result<Published> {
        let changes = Outgoing::invalidations(keys, self.budget())?;
        self.send(cache, changes).await
    }

    /// Tells every node to drop everything in `cache`.
    pub async fn invalidate_all(&self, cache: &str) -> Result<Published> {
        self.send(cache, Outgoing::clear(None)).await
    }

    /// Drops everything and makes `version` a floor: inserts older than it
    /// that arrive later are ignored.
    pub async fn invalidate_all_versioned(&self, cache: &str, version: u64) -> Result<Published> {
        self.send(cache, Outgoing::clear(Some(version))).await
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

    /// The topic it publishes to.
    pub fn topic(&self) -> &str {
        &self.inner.topic
    }

    /// How many bytes of keys and values one event may carry.
    fn budget(&self) -> usize {
        self.inner.codec.entry_budget(&self.inner.origin)
    }

    /// Splits an already built change (the outbox relay's) as this
    /// publisher's limit needs.
    #[cfg(any(feature = "_sql", feature = "mysql-cdc"))]
    pub(crate) fn resplit(&self, change: Change) -> Result<Vec<Change>> {
        changes::resplit(change, self.budget())
    }
}

mod again;
mod announce;
mod builder;
#[cfg(any(feature = "_sql", feature = "mysql-cdc"))]
mod changes;
mod dictionary;
mod in_flight;
mod numbering;
mod published;
mod send;

#[cfg(feature = "_outbox")]
pub(crate) use changes::{invalidations, refreshes, replacement};

use again::AgainQueue;
pub(crate) use announce::DEFAULT_ANNOUNCE_INTERVAL;
pub use builder::PublisherBuilder;
pub use dictionary::DictionaryPublisher;
use numbering::SeqState;
pub use published::Published;
use published::Sent;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::EmbeddedTransport;
    use crate::transport::{Delivery, StartFrom, SubscribeOptions};
    use crate::wire::{Change, KeyVersion, MAX_EVENT_BYTES_CEILING, decode, encode_part};

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
        p.invalidate_all("a").await.unwrap();
        let seqs: Vec<_> = drain(&transport)
            .await
            .iter()
            .map(|(h, _)| (h.cache.clone(), h.seq))
            .collect();
        assert_eq!(seqs, [("a".into(), 1), ("b".into(), 1), ("a".into(), 2)]);
    }

    /// The second send says "drop" for every key the first changed, at the
    /// same versions, with the next sequence number, and only after the delay.
    #[tokio::test(start_paused = true)]
    async fn again_after_sends_an_invalidation_of_the_same_keys_later() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .again_after(Duration::from_secs(2))
            .announce_interval(Duration::MAX)
            .build()
            .unwrap();
        p.insert_versioned("t", [("a", "x", Some(7)), ("b", "y", None)])
            .await
            .unwrap();
        p.invalidate_all_versioned("t", 9).await.unwrap();
        tokio::time::sleep(Duration::from_millis(1999)).await;
        assert_eq!(drain(&transport).await.len(), 2, "sent again too early");
        tokio::time::sleep(Duration::from_millis(2)).await;
        let events = drain(&transport).await;
        let seqs: Vec<_> = events.iter().map(|(h, _)| h.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
        let Change::Invalidate { keys } = &events[2].1 else {
            panic!("{:?}", events[2].1)
        };
        let expect = [("a", Some(7)), ("b", None)].map(|(k, version)| KeyVersion {
            key: encode_part(&k, "key").unwrap(),
            version,
        });
        assert_eq!(keys, &expect);
        assert_eq!(events[3].1, Change::Clear { version: Some(9) });
    }

    /// The announcing task and the second sends' task hold a dropped
    /// publisher's state until their work is done, then end and let it go.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_publishers_tasks_finish_their_work_then_let_it_go() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .announce_interval(Duration::from_secs(1))
            .again_after(Duration::from_secs(2))
            .build()
            .unwrap();
        p.insert("t", [("a", "x")]).await.unwrap();
        let inner = Arc::downgrade(&p.inner);
        drop(p);
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(inner.upgrade().is_none(), "the publisher's state leaked");
        let events = drain(&transport).await;
        let sent: Vec<_> = events
            .iter()
            .filter(|(_, c)| c.len() > 0)
            .map(|(h, _)| h.seq)
            .collect();
        assert_eq!(sent, [1, 2], "the change and its second send");
        let last: Vec<_> = events
            .iter()
            .filter(|(_, c)| c.len() == 0)
            .map(|(h, _)| h.seq)
            .filter(|&seq| seq == 2)
            .collect();
        assert_eq!(last, [2, 2, 2], "the last number, announced three times");
    }

    /// A second send queued where there is no runtime to time it (the
    /// caller's is shutting down) does not panic: it waits, and goes out
    /// with the next publish's.
    #[test]
    fn a_second_send_queued_outside_a_runtime_goes_with_the_next() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .again_after(Duration::from_secs(1))
            .announce_interval(Duration::MAX)
            .build()
            .unwrap();
        p.send_again("t".into(), Duration::from_secs(1), Outgoing::clear(None));
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
            .block_on(async {
                p.invalidate_all("t").await.unwrap();
                tokio::time::sleep(Duration::from_secs(2)).await;
                let seqs: Vec<_> = drain(&transport).await.iter().map(|(h, _)| h.seq).collect();
                assert_eq!(seqs, [1, 2, 3]);
            });
    }

    /// A publish stuck in the transport for one cache does not hold up
    /// the announcements of the others.
    #[tokio::test(start_paused = true)]
    async fn a_stuck_publish_holds_up_no_other_caches_announcements() {
        let embedded = EmbeddedTransport::new();
        let transport = crate::transport::FaultyTransport::new(embedded.clone());
        let p = Publisher::builder(transport.clone())
            .announce_interval(Duration::from_secs(1))
            .build()
            .unwrap();
        p.insert("slow", [("a", "x")]).await.unwrap();
        let fast: Vec<String> = (0..8).map(|i| format!("fast{i}")).collect();
        for cache in &fast {
            p.insert(cache, [("a", "x")]).await.unwrap();
        }
        // From now on, publishes to cache "slow" hang.
        transport.hang_publishes_where(|cache, _| cache == "slow");
        let stuck = p.clone();
        let stuck = tokio::spawn(async move { stuck.insert("slow", [("b", "y")]).await });
        tokio::time::sleep(Duration::from_secs(10)).await;
        let events = drain(&embedded).await;
        for cache in &fast {
            let announced = events
                .iter()
                .filter(|(h, c)| &h.cache == cache && c.len() == 0)
                .count();
            assert_eq!(announced, 3, "{cache}");
        }
        assert!(!stuck.is_finished());
        assert!(transport.hanging() >= 1, "stuck in the transport");
        stuck.abort();
    }

    /// Waits (on paused time) until `f` holds.
    async fn until(what: &str, f: impl Fn() -> bool) {
        for _ in 0..100_000 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("never: {what}");
    }

    /// The sequence numbers of what reached the broker, in the order it
    /// took them.
    fn seqs_handed_over(transport: &crate::transport::FaultyTransport) -> Vec<u64> {
        transport
            .published()
            .iter()
            .map(|(_, payload)| decode(payload, MAX_EVENT_BYTES_CEILING).unwrap().0.seq)
            .collect()
    }

    /// Concurrent publishes of one cache are handed over one after another,
    /// in number order, without waiting for each other's acknowledgements:
    /// with every acknowledgement held back, all of them reach the broker
    /// (up to the window), and each caller still waits for its own.
    #[tokio::test(start_paused = true)]
    async fn publishes_are_handed_over_in_order_while_acknowledgements_are_outstanding() {
        let embedded = EmbeddedTransport::new();
        let transport = crate::transport::FaultyTransport::new(embedded.clone());
        transport.record_publishes(true);
        for (window, n) in [(None, 10_usize), (Some(4), 10)] {
            let mut builder =
                Publisher::builder(transport.clone()).announce_interval(Duration::MAX);
            if let Some(window) = window {
                builder = builder.window(window);
            }
            let p = builder.build().unwrap();
            let cache = format!("c{n}{window:?}");
            let before = transport.publishes();
            // Every acknowledgement held back until released.
            transport.hang_after_broker_where(|_, _| true);
            let publishing: Vec<_> = (0..n)
                .map(|i| {
                    let p = p.clone();
                    let cache = cache.clone();
                    tokio::spawn(async move { p.insert(&cache, [(i, i)]).await })
                })
                .collect();
            let in_flight = window.unwrap_or(DEFAULT_WINDOW).min(n);
            until("the window handed over", || {
                transport.hanging() == in_flight
            })
            .await;
            // Long enough for anything else to be handed over, if it would.
            tokio::time::sleep(Duration::from_secs(60)).await;
            assert_eq!(
                transport.hanging(),
                in_flight,
                "acknowledgements outstanding"
            );
            assert_eq!(transport.publishes() - before, in_flight, "handed over");
            assert!(
                publishing.iter().all(|t| !t.is_finished()),
                "returned unacknowledged"
            );
            transport.hang_publishes(false);
            for t in publishing {
                t.await.unwrap().unwrap();
            }
            assert_eq!(transport.publishes() - before, n);
        }
        let sent: Vec<_> = drain(&embedded)
            .await
            .iter()
            .map(|(h, _)| (h.cache.clone(), h.seq))
            .collect();
        let expect: Vec<_> = ["c10None", "c10Some(4)"]
            .iter()
            .flat_map(|c| (1..=10).map(|seq| (c.to_string(), seq)))
            .collect();
        assert_eq!(sent, expect, "each cache's numbers on the wire in order");
        assert_eq!(
            seqs_handed_over(&transport),
            expect.iter().map(|(_, s)| *s).collect::<Vec<_>>()
        );
    }

    /// A publish split into more events than the window hands over as many
    /// as fit, waits for its own oldest acknowledgement to hand over the
    /// next, and keeps its events in order.
    #[tokio::test(start_paused = true)]
    async fn a_publish_of_more_events_than_the_window_waits_for_its_own_acknowledgements() {
        let embedded = EmbeddedTransport::new();
        let transport = crate::transport::FaultyTransport::new(embedded.clone());
        let p = Publisher::builder(transport.clone())
            .max_event_bytes(4096)
            .window(2)
            .announce_interval(Duration::MAX)
            .build()
            .unwrap();
        let rows: Vec<(u32, String)> = (0..100).map(|i| (i, "v".repeat(200))).collect();
        let other = p.clone();
        let (big, small) = tokio::join!(p.insert("t", rows), async {
            other.insert("u", [(1, 1)]).await
        });
        let big = big.unwrap();
        small.unwrap();
        assert!(big.events > 2, "{big:?}");
        let seqs: Vec<_> = drain(&embedded)
            .await
            .iter()
            .filter(|(h, _)| h.cache == "t")
            .map(|(h, _)| h.seq)
            .collect();
        assert_eq!(seqs, (1..=big.events as u64).collect::<Vec<_>>());
    }

    #[test]
    fn the_window_is_at_least_one_and_any_larger_size_is_accepted() {
        let builder = || Publisher::builder(EmbeddedTransport::new());
        let e = builder().window(0).build().unwrap_err();
        assert!(e.is_config() && e.to_string().contains("window"), "{e}");
        for n in [1, usize::MAX] {
            let p = builder().window(n).build().unwrap();
            assert!(p.inner.window.available_permits() >= 1);
        }
    }

    #[tokio::test]
    async fn large_batches_split_under_the_limit_and_oversized_entries_fail() {
        let transport = EmbeddedTransport::new();
        let p = Publisher::builder(transport.clone())
            .max_event_bytes(4096)
            .build()
            .unwrap();
        let rows: Vec<(u32, String)> = (0..100).map(|i| (i, "v".repeat(200))).collect();
        let sent = p.insert("t", rows).await.unwrap();
        assert!(sent.events > 1, "{sent:?}");
        let events = drain(&transport).await;
        assert_eq!(events.len(), sent.events);
        assert_eq!(events.iter().map(|(_, c)| c.len()).sum::<usize>(), 100);
        let err = p.insert("t", [(1u32, "v".repeat(5000))]).await.unwrap_err();
        assert!(err.is_too_large(), "{err}");
        assert_eq!(p.insert::<u32, u32>("t", []).await.unwrap().events, 0);
    }
}
