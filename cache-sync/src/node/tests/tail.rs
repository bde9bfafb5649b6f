//! Tail loss: the last events before a quiet period, found by the
//! publishers' announcements of their last sequence numbers.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::super::announcements::MAX_PENDING_CHECKS;
use super::super::consume::apply_loss;
use super::super::seqs::{Missing, PublisherSeqs};
use super::*;
use crate::transport::Loss;
use crate::wire::{ChangeView, decode_change, decode_header};

const INTERVAL: Duration = Duration::from_secs(1);

/// The embedded transport, keeping what reaches it: the tests count
/// publishes and the announcements among them, and lose one on purpose
/// with `lose_publishes`, between publisher and broker.
fn lossy() -> FaultyTransport {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.record_publishes(true);
    transport
}

/// Announcements among what reached the broker.
fn announcements(transport: &FaultyTransport) -> usize {
    transport
        .published()
        .iter()
        .filter(|(_, payload)| {
            let event = crate::wire::strip_unverified(payload);
            decode_header(event, usize::MAX).is_ok_and(|(_, body)| {
                matches!(decode_change(event, body), Ok(ChangeView::Announce))
            })
        })
        .count()
}

/// How long these tests wait for a condition: on paused time, so a long
/// limit costs no real time.
const LONG: Duration = Duration::from_secs(600);

async fn nodes(transport: &FaultyTransport, window: Duration, n: usize) -> Vec<(Node, Cache)> {
    let mut out = Vec::new();
    for i in 0..n {
        let c = cache("t");
        let node = Node::builder(format!("n{i}"), transport.clone())
            .reorder_window(window)
            .register(&c)
            .start()
            .await
            .unwrap();
        out.push((node, c));
    }
    out
}

fn resyncs(node: &Node) -> u64 {
    node.status().caches[0].loss_resyncs
}

/// The last of five events is lost and nothing follows it: every node
/// resyncs the cache within the announce interval plus its reorder window,
/// and not before the window has passed.
async fn a_lost_last_event_is_found_within_the_bound(window: Duration) {
    let transport = lossy();
    let nodes = nodes(&transport, window, 3).await;
    let p = Publisher::builder(transport.clone())
        .announce_interval(INTERVAL)
        .build()
        .unwrap();
    for i in 1..=4 {
        p.insert("t", [(format!("k{i}"), "v")]).await.unwrap();
    }
    for (_, c) in &nodes {
        eventually("events 1 to 4 applied", async || {
            holds(c, "k4", Some("v")).await
        })
        .await;
    }
    let lost_at = Instant::now();
    transport.lose_publishes(1);
    p.insert("t", [("k5", "v")]).await.unwrap();
    assert_eq!(transport.publishes(), 4, "the fifth publish is lost");
    let bound = INTERVAL + window;
    for (node, c) in &nodes {
        let at = eventually_within("the tail loss is answered", LONG, async || {
            resyncs(node) == 1
        })
        .await;
        let took = at - lost_at;
        // The wait polls every millisecond of tokio's clock.
        assert!(
            took <= bound + Duration::from_millis(2),
            "{} resynced after {took:?}, over the bound {bound:?}",
            node.id()
        );
        assert!(
            took >= window,
            "{} resynced after {took:?}, before its reorder window",
            node.id()
        );
        let s = node.status();
        assert_eq!(
            (s.publisher_gaps, s.losses, s.caches[0].events_applied),
            (1, 1, 4),
            "{s:?}"
        );
        assert_eq!(s.last_loss_reason.as_deref(), Some("publisher_gap"));
        assert_eq!(c.peek("k1").await, None, "the cache was emptied");
    }
    // The loss is answered once, whatever the repeats say.
    eventually_within("the repeats", LONG, async || announcements(&transport) == 3).await;
    tokio::time::sleep(window + INTERVAL).await;
    for (node, _) in &nodes {
        assert_eq!(resyncs(node), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn a_lost_last_event_is_found_by_the_announcement() {
    a_lost_last_event_is_found_within_the_bound(Duration::from_secs(10)).await;
}

#[tokio::test(start_paused = true)]
async fn with_no_reorder_window_a_lost_last_event_is_answered_at_the_announcement() {
    a_lost_last_event_is_found_within_the_bound(Duration::ZERO).await;
}

/// Nothing lost: announcements repeat the nodes' own last number, which is
/// no gap, apply nothing, and take no number from the next event. They stop
/// after three at an unchanged number, and start again after a publish.
#[tokio::test(start_paused = true)]
async fn announcements_of_what_arrived_change_nothing_and_stop_when_quiet() {
    let transport = lossy();
    let window = Duration::from_secs(2);
    let nodes = nodes(&transport, window, 2).await;
    let p = Publisher::builder(transport.clone())
        .announce_interval(INTERVAL)
        .build()
        .unwrap();
    for i in 1..=5 {
        p.insert("t", [(format!("k{i}"), "v")]).await.unwrap();
    }
    eventually_within("three announcements", LONG, async || {
        announcements(&transport) == 3
    })
    .await;
    tokio::time::sleep(window + 10 * INTERVAL).await;
    assert_eq!(
        announcements(&transport),
        3,
        "announcements stop when quiet"
    );
    for (node, c) in &nodes {
        assert!(holds(c, "k5", Some("v")).await);
        let s = node.status();
        assert_eq!(
            (
                s.events_received,
                s.publisher_gaps,
                s.losses,
                s.caches[0].loss_resyncs,
                s.caches[0].events_applied
            ),
            (8, 0, 0, 0, 5),
            "{s:?}"
        );
    }
    p.insert("t", [("k6", "v")]).await.unwrap();
    eventually_within("three more", LONG, async || announcements(&transport) == 6).await;
    tokio::time::sleep(window + 10 * INTERVAL).await;
    assert_eq!(announcements(&transport), 6);
    assert_eq!(transport.publishes(), 12);
    for (node, c) in &nodes {
        assert!(holds(c, "k6", Some("v")).await);
        assert_eq!((node.status().publisher_gaps, resyncs(node)), (0, 0));
    }
    // A dropped publisher's last publish is announced, three times, and
    // no more.
    let after = transport.publishes();
    p.insert("t", [("k7", "v")]).await.unwrap();
    drop(p);
    tokio::time::sleep(10 * INTERVAL).await;
    assert_eq!(transport.publishes(), after + 4);
    assert_eq!(announcements(&transport), 9);
}

/// Events that arrive late, but within the reorder window, clear the
/// check their announcement started.
#[tokio::test(start_paused = true)]
async fn late_events_within_the_window_clear_the_check() {
    let transport = EmbeddedTransport::new();
    let window = Duration::from_secs(5);
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .reorder_window(window)
        .register(&c)
        .start()
        .await
        .unwrap();
    let send = |seq, change: Change| {
        let t = transport.clone();
        async move {
            t.publish(DEFAULT_TOPIC, "t", raw_event("t", 7, seq, &change))
                .await
                .unwrap();
        }
    };
    send(1, refresh_change("k1", "v")).await;
    send(4, Change::ANNOUNCE).await;
    eventually("the announcement is read", async || {
        node.status().events_received == 2
    })
    .await;
    tokio::time::sleep(window / 2).await;
    send(2, refresh_change("k2", "v")).await;
    send(3, refresh_change("k3", "v")).await;
    send(4, refresh_change("k4", "v")).await;
    eventually("late events applied", async || {
        holds(&c, "k4", Some("v")).await
    })
    .await;
    tokio::time::sleep(2 * window).await;
    let s = node.status();
    assert_eq!(
        (s.publisher_gaps, s.caches[0].loss_resyncs),
        (0, 0),
        "{s:?}"
    );
    assert!(holds(&c, "k1", Some("v")).await);
    // The control: an announcement whose events never come.
    send(9, Change::ANNOUNCE).await;
    tokio::time::sleep(2 * window).await;
    assert_eq!(node.status().publisher_gaps, 1);
    assert_eq!(c.peek("k1").await, None);
}

/// On a verifying node an announcement is authenticated like any event:
/// unsigned or forged ones change nothing, a signed one is acted on.
#[tokio::test(start_paused = true)]
async fn forged_announcements_change_nothing_on_a_verifying_node() {
    let ring = Keyring::new("k1", b"node-and-admin-shared-secret".to_vec()).unwrap();
    let forger = Keyring::new("k1", b"a-guessed-secret-000000000000".to_vec()).unwrap();
    let transport = EmbeddedTransport::new();
    let window = Duration::from_secs(2);
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .verify_signatures(ring.clone())
        .reorder_window(window)
        .register(&c)
        .start()
        .await
        .unwrap();
    let send = |payload: Vec<u8>| {
        let t = transport.clone();
        async move {
            t.publish(DEFAULT_TOPIC, "t", Bytes::from(payload))
                .await
                .unwrap();
        }
    };
    send(ring.sign(&raw_event("t", 7, 1, &refresh_change("k", "v")))).await;
    eventually("the signed event applies", async || {
        holds(&c, "k", Some("v")).await
    })
    .await;
    send(raw_event("t", 7, 50, &Change::ANNOUNCE).to_vec()).await;
    send(forger.sign(&raw_event("t", 7, 50, &Change::ANNOUNCE))).await;
    // From an unknown publisher too: it would set a baseline.
    send(forger.sign(&raw_event("t", 8, 50, &Change::ANNOUNCE))).await;
    tokio::time::sleep(3 * window).await;
    let s = node.status();
    assert_eq!(
        (
            s.events_rejected,
            s.publisher_gaps,
            s.caches[0].loss_resyncs
        ),
        (3, 0, 0),
        "{s:?}"
    );
    assert!(holds(&c, "k", Some("v")).await);
    // Had the forged announcement set publisher 8's baseline at 50, its
    // real numbers below it would pass as redeliveries, gaps unseen.
    send(ring.sign(&raw_event("t", 8, 1, &refresh_change("k8", "v")))).await;
    send(ring.sign(&raw_event("t", 8, 3, &refresh_change("k8", "w")))).await;
    eventually("publisher 8's third event", async || {
        holds(&c, "k8", Some("w")).await
    })
    .await;
    assert_eq!(node.status().publisher_gaps, 1, "8's gap was seen");
    c.insert("k".into(), "v".into()).await;
    send(ring.sign(&raw_event("t", 7, 50, &Change::ANNOUNCE))).await;
    tokio::time::sleep(3 * window).await;
    assert_eq!(node.status().publisher_gaps, 2, "the signed one counts");
    assert_eq!(c.peek("k").await, None);
}

/// After a resume, an announcement from a publisher the node has not heard
/// from cannot be a baseline: the events it vouches for may be gone.
#[tokio::test(start_paused = true)]
async fn after_a_resume_an_unknown_publishers_announcement_resyncs() {
    let flaky = flaky();
    let (a, b) = (cache("a"), cache("b"));
    let node = Node::builder("n1", flaky.clone())
        .reconnect_backoff(Duration::from_millis(1), Duration::from_millis(10))
        .register(&a)
        .register(&b)
        .start()
        .await
        .unwrap();
    let send = |cache: &'static str, publisher, seq, change: Change| {
        let t = flaky.inner();
        async move {
            t.publish(
                DEFAULT_TOPIC,
                cache,
                raw_event(cache, publisher, seq, &change),
            )
            .await
            .unwrap();
        }
    };
    send("a", 1, 1, refresh_change("a1", "v")).await;
    eventually("resumed", async || flaky.subscriptions() == 2).await;
    a.insert("warm".into(), "kept".into()).await;
    b.insert("warm".into(), "kept".into()).await;
    send("b", 3, 17, Change::ANNOUNCE).await;
    send("a", 1, 1, Change::ANNOUNCE).await;
    eventually("b resynced", async || {
        node.status().caches[1].loss_resyncs == 1
    })
    .await;
    assert_eq!(b.peek("warm").await, None);
    assert!(
        holds(&a, "warm", Some("kept")).await,
        "a's publisher is known"
    );
    assert_eq!(node.status().publisher_gaps, 1);
}

#[test]
fn checks_fall_due_in_order_once_and_only_while_behind() {
    let now = Instant::now();
    let at = |s| now + Duration::from_secs(s);
    let mut seqs = PublisherSeqs::default();
    // Unknown publisher, trusted cache: a baseline.
    assert_eq!(seqs.announced(1, "a", 5, at(1)), None);
    assert_eq!(seqs.observe(1, "a", 6), None);
    assert_eq!(seqs.next_deadline(), None);
    // At or behind the node's last: nothing.
    assert_eq!(seqs.announced(1, "a", 6, at(1)), None);
    assert_eq!(seqs.announced(1, "a", 2, at(1)), None);
    assert_eq!(seqs.next_deadline(), None);
    // Ahead: a check, one per (publisher, cache).
    assert_eq!(seqs.announced(1, "a", 8, at(1)), None);
    assert_eq!(seqs.announced(1, "a", 9, at(2)), None);
    assert_eq!(seqs.announced(2, "a", 3, at(2)), None);
    assert_eq!(seqs.observe(2, "a", 1), None);
    assert_eq!(seqs.announced(2, "a", 3, at(3)), None);
    assert_eq!(seqs.next_deadline(), Some(at(1)));
    assert_eq!(seqs.due(now), None, "not yet");
    // The check for 8 was raised to 9 by the second announcement.
    assert_eq!(
        seqs.due(at(1)),
        Some(Missing {
            publisher: 1,
            cache: "a".into(),
            from: 7,
            to: 9
        })
    );
    assert_eq!(seqs.due(at(1)), None);
    // Answered: the next event is no gap.
    assert_eq!(seqs.observe(1, "a", 9), None);
    // Publisher 2's events arrived in time.
    assert_eq!(seqs.observe(2, "a", 2), None);
    assert_eq!(seqs.observe(2, "a", 3), None);
    assert_eq!(seqs.due(at(3)), None);
    assert_eq!(seqs.next_deadline(), None);
    // After a resume, an unknown publisher's announcement is a gap now.
    seqs.resumed(["b".to_owned()]);
    assert_eq!(
        seqs.announced(5, "b", 4, at(1)),
        Some(Missing {
            publisher: 5,
            cache: "b".into(),
            from: 1,
            to: 4
        })
    );
    assert_eq!(seqs.observe(5, "b", 5), None, "and 4 is its baseline");
    assert_eq!(
        seqs.announced(8, "b", 0, at(1)),
        None,
        "0 vouches for nothing"
    );
    // A loss clears the checks.
    assert_eq!(seqs.announced(5, "b", 9, at(1)), None);
    seqs.clear();
    assert_eq!((seqs.next_deadline(), seqs.due(at(9))), (None, None));
    // Unbounded numbers and windows are numbers like any other.
    assert_eq!(seqs.announced(6, "c", u64::MAX, at(1)), None);
    assert_eq!(seqs.observe(6, "c", 0), None);
}

/// A newer announcement raises a pending check: the numbers due first are
/// judged at their deadline, and the newest, if they arrived, at the end of
/// the window after its own announcement, neither earlier nor later.
#[test]
fn a_newer_announcement_gets_its_own_window() {
    let now = Instant::now();
    let at = |s| now + Duration::from_secs(s);
    let mut seqs = PublisherSeqs::default();
    assert_eq!(seqs.observe(1, "a", 1), None);
    assert_eq!(seqs.announced(1, "a", 3, at(10)), None);
    assert_eq!(seqs.announced(1, "a", 6, at(15)), None);
    assert_eq!(seqs.announced(1, "a", 5, at(16)), None, "older: no change");
    assert_eq!(seqs.observe(1, "a", 2), None);
    assert_eq!(seqs.observe(1, "a", 3), None);
    assert_eq!(seqs.due(at(10)), None, "3 arrived; 6 is not due yet");
    assert_eq!(seqs.next_deadline(), Some(at(15)));
    assert_eq!(seqs.due(at(14)), None);
    assert_eq!(
        seqs.due(at(15)),
        Some(Missing {
            publisher: 1,
            cache: "a".into(),
            from: 4,
            to: 6
        })
    );
    assert_eq!(seqs.observe(1, "a", 7), None, "6 is the baseline");
    // A re-armed check keeps the queue in deadline order.
    assert_eq!(seqs.announced(1, "a", 9, at(20)), None);
    assert_eq!(seqs.announced(1, "a", 12, at(40)), None);
    assert_eq!(seqs.observe(2, "a", 1), None);
    assert_eq!(seqs.announced(2, "a", 2, at(30)), None);
    assert_eq!(seqs.observe(1, "a", 8), None);
    assert_eq!(seqs.observe(1, "a", 9), None);
    assert_eq!(seqs.due(at(20)), None);
    assert_eq!(seqs.next_deadline(), Some(at(30)));
    assert_eq!(seqs.due(at(30)).map(|m| (m.publisher, m.to)), Some((2, 2)));
    assert_eq!(seqs.due(at(40)).map(|m| (m.publisher, m.to)), Some((1, 12)));
}

/// A resync of a cache, for whatever reason, answers its pending checks:
/// they go, and the numbers they were waiting for are the baselines.
#[test]
fn a_resync_retires_the_caches_checks() {
    let now = Instant::now();
    let mut seqs = PublisherSeqs::default();
    for p in [1, 2] {
        assert_eq!(seqs.observe(p, "a", 1), None);
        assert_eq!(seqs.observe(p, "b", 1), None);
        assert_eq!(seqs.announced(p, "a", 4, now), None);
        assert_eq!(seqs.announced(p, "b", 4, now), None);
    }
    assert_eq!(seqs.announced(1, "a", 6, now), None);
    seqs.resynced("a");
    assert_eq!(seqs.observe(1, "a", 7), None, "6 is publisher 1's baseline");
    assert_eq!(seqs.observe(2, "a", 5), None, "4 is publisher 2's");
    let mut due = Vec::new();
    while let Some(m) = seqs.due(now) {
        due.push((m.publisher, m.cache));
    }
    assert_eq!(due, [(1, "b".to_owned()), (2, "b".to_owned())]);
}

#[test]
fn at_the_bound_a_check_is_answered_at_once_not_dropped() {
    let now = Instant::now();
    let mut seqs = PublisherSeqs::default();
    for p in 0..MAX_PENDING_CHECKS as u64 {
        assert_eq!(seqs.observe(p, "a", 1), None);
        assert_eq!(seqs.announced(p, "a", 2, now), None);
    }
    let p = MAX_PENDING_CHECKS as u64;
    assert_eq!(seqs.observe(p, "a", 1), None);
    assert_eq!(
        seqs.announced(p, "a", 3, now),
        Some(Missing {
            publisher: p,
            cache: "a".into(),
            from: 2,
            to: 3
        })
    );
    let mut due = 0;
    while seqs.due(now).is_some() {
        due += 1;
    }
    assert_eq!(due, MAX_PENDING_CHECKS);
}

/// A loss that resyncs every cache makes the pending checks moot.
#[tokio::test]
async fn a_full_loss_clears_the_pending_checks() {
    let c = cache("t");
    let (shared, caches) = Node::builder("n1", EmbeddedTransport::new())
        .register(&c)
        .into_shared();
    for cache in caches {
        shared.register(cache).await.unwrap();
    }
    let mut seqs = PublisherSeqs::default();
    assert_eq!(seqs.observe(1, "t", 1), None);
    assert_eq!(seqs.announced(1, "t", 5, Instant::now()), None);
    assert!(seqs.next_deadline().is_some());
    apply_loss(
        &shared,
        &mut seqs,
        Loss::new(crate::transport::LossReason::Trimmed, Some(3), None),
    )
    .await;
    assert_eq!(seqs.next_deadline(), None);
    assert_eq!(seqs.due(Instant::now()), None);
    assert_eq!(c.status().loss_resyncs, 1, "the loss itself resynced");
}

#[test]
fn announce_interval_is_checked_by_build() {
    let build = |every| {
        Publisher::builder(EmbeddedTransport::new())
            .announce_interval(every)
            .build()
    };
    for ok in [
        Duration::from_millis(10),
        Duration::from_secs(1),
        Duration::from_secs(3600),
        Duration::MAX,
    ] {
        assert!(build(ok).is_ok(), "{ok:?}");
    }
    for refused in [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_millis(9),
        Duration::from_secs(3600) + Duration::from_nanos(1),
        Duration::MAX - Duration::from_nanos(1),
    ] {
        let e = build(refused).unwrap_err();
        assert!(e.is_config(), "{refused:?}: {e}");
    }
}

/// `Duration::MAX`: no announcements, ever.
#[tokio::test(start_paused = true)]
async fn announcements_can_be_turned_off() {
    let transport = lossy();
    let p = Publisher::builder(transport.clone())
        .announce_interval(Duration::MAX)
        .build()
        .unwrap();
    p.insert("t", [("k", "v")]).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(transport.publishes(), 1);
}

/// A publisher can outlive the runtime it first published on: the next
/// publish, on another runtime, starts announcing there.
#[test]
fn a_publisher_that_outlives_its_runtime_announces_from_the_next() {
    let transport = lossy();
    let p = Publisher::builder(transport.clone())
        .announce_interval(INTERVAL)
        .build()
        .unwrap();
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .unwrap()
    };
    // Its announcing task is dropped with it, before it ever ran.
    runtime().block_on(async { p.insert("t", [("k", "v")]).await.unwrap() });
    runtime().block_on(async {
        p.insert("t", [("k", "w")]).await.unwrap();
        eventually_within("announcements on the second runtime", LONG, async || {
            announcements(&transport) == 3
        })
        .await;
    });
}

/// Sends raw events of publisher `publisher` for cache "t".
fn sender(
    transport: &EmbeddedTransport,
) -> impl Fn(u64, u64, Change) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> {
    let transport = transport.clone();
    move |publisher, seq, change| {
        let t = transport.clone();
        Box::pin(async move {
            t.publish(DEFAULT_TOPIC, "t", raw_event("t", publisher, seq, &change))
                .await
                .unwrap();
        })
    }
}

async fn node_with_window(transport: &EmbeddedTransport, window: Duration) -> (Node, Cache) {
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .reorder_window(window)
        .register(&c)
        .start()
        .await
        .unwrap();
    (node, c)
}

/// A pending check does not swallow a newer announcement: after a gap's
/// resync, events 5 and 6 are lost and only their announcement tells.
#[tokio::test(start_paused = true)]
async fn a_newer_announcement_during_a_check_is_not_swallowed() {
    let transport = EmbeddedTransport::new();
    let window = Duration::from_secs(10);
    let (node, c) = node_with_window(&transport, window).await;
    let send = sender(&transport);
    send(7, 1, refresh_change("k1", "v")).await;
    send(7, 3, Change::ANNOUNCE).await;
    send(7, 4, refresh_change("k4", "v")).await;
    eventually("the gap at 4", async || node.status().publisher_gaps == 1).await;
    for _ in 0..3 {
        send(7, 6, Change::ANNOUNCE).await;
        tokio::time::sleep(INTERVAL).await;
    }
    tokio::time::sleep(3 * window).await;
    let s = node.status();
    assert_eq!(
        (s.publisher_gaps, s.caches[0].loss_resyncs),
        (2, 2),
        "{s:?}"
    );
    assert_eq!(c.peek("k4").await, None);
}

/// A check that fires counts the node as caught up to the highest number
/// announced, not the one it started with: the next event is no gap.
#[tokio::test(start_paused = true)]
async fn a_fired_check_takes_the_highest_announced_number() {
    let transport = EmbeddedTransport::new();
    let window = Duration::from_secs(10);
    let (node, c) = node_with_window(&transport, window).await;
    let send = sender(&transport);
    send(7, 1, refresh_change("k1", "v")).await;
    send(7, 3, Change::ANNOUNCE).await;
    send(7, 5, Change::ANNOUNCE).await;
    tokio::time::sleep(window + INTERVAL).await;
    assert_eq!(node.status().publisher_gaps, 1);
    send(7, 6, refresh_change("k6", "v")).await;
    eventually("6 applied", async || holds(&c, "k6", Some("v")).await).await;
    let s = node.status();
    assert_eq!(
        (s.publisher_gaps, s.caches[0].loss_resyncs),
        (1, 1),
        "{s:?}"
    );
}

/// A resync of the cache for another reason (here another publisher's
/// gap) answers the pending checks for it: they do not resync it again.
#[tokio::test(start_paused = true)]
async fn another_resync_of_the_cache_retires_its_checks() {
    let transport = EmbeddedTransport::new();
    let window = Duration::from_secs(10);
    let (node, c) = node_with_window(&transport, window).await;
    let send = sender(&transport);
    send(7, 1, refresh_change("k1", "v")).await;
    send(7, 3, Change::ANNOUNCE).await;
    send(8, 1, refresh_change("k2", "v")).await;
    send(8, 3, refresh_change("k3", "v")).await;
    eventually("8's gap", async || holds(&c, "k3", Some("v")).await).await;
    assert_eq!(node.status().publisher_gaps, 1);
    tokio::time::sleep(2 * window).await;
    // And 7's baseline is the announced 3: its 4 is no gap.
    send(7, 4, refresh_change("k4", "v")).await;
    eventually("7's 4", async || holds(&c, "k4", Some("v")).await).await;
    let s = node.status();
    assert_eq!(
        (s.publisher_gaps, s.caches[0].loss_resyncs),
        (1, 1),
        "{s:?}"
    );
    assert!(holds(&c, "k3", Some("v")).await);
}

/// A publisher dropped right after its last publish (one per request, or a
/// tool that publishes once) still announces it: the node finds the lost
/// last event within the bound, while the runtime keeps running.
#[tokio::test(start_paused = true)]
async fn a_dropped_publisher_still_announces_its_last_event() {
    let transport = lossy();
    let window = Duration::from_secs(5);
    let nodes = nodes(&transport, window, 1).await;
    let (node, c) = &nodes[0];
    let p = Publisher::builder(transport.clone())
        .announce_interval(INTERVAL)
        .build()
        .unwrap();
    p.insert("t", [("k1", "v")]).await.unwrap();
    eventually("k1 applied", async || holds(c, "k1", Some("v")).await).await;
    let lost_at = Instant::now();
    transport.lose_publishes(1);
    p.insert("t", [("k2", "v")]).await.unwrap();
    assert_eq!(transport.publishes(), 1, "the second publish is lost");
    drop(p);
    let at = eventually_within("the tail loss is answered", LONG, async || {
        resyncs(node) == 1
    })
    .await;
    assert!(at - lost_at <= INTERVAL + window + Duration::from_millis(2));
    tokio::time::sleep(2 * (INTERVAL + window)).await;
    let s = node.status();
    assert_eq!((s.publisher_gaps, resyncs(node)), (1, 1), "{s:?}");
    assert_eq!(announcements(&transport), 3);
}

/// An announcement the node is behind, then a transport outage: the check
/// still falls due at the end of the window, while the node re-subscribes,
/// not once the outage is over.
#[tokio::test(start_paused = true)]
async fn checks_fall_due_during_an_outage() {
    let window = Duration::from_secs(10);
    // The first subscription delivers two batches and then breaks; later
    // subscribes fail, to the end of the test.
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.break_next_subscription_after(2);
    let c = cache("t");
    let node = Node::builder("n1", transport.clone())
        .reorder_window(window)
        .max_batch(1)
        .reconnect_backoff(Duration::from_secs(1), Duration::from_secs(30))
        .register(&c)
        .start()
        .await
        .unwrap();
    transport.fail_subscriptions(true);
    let send = |seq, change: Change| {
        let t = transport.inner();
        async move {
            t.publish(DEFAULT_TOPIC, "t", raw_event("t", 7, seq, &change))
                .await
                .unwrap();
        }
    };
    let start = Instant::now();
    send(1, refresh_change("k1", "v")).await;
    send(3, Change::ANNOUNCE).await;
    eventually_within("the outage starts", LONG, async || {
        node.status().transport_errors >= 1
    })
    .await;
    let at = eventually_within("the check", LONG, async || resyncs(&node) == 1).await;
    let took = at - start;
    assert!(
        took >= window && took <= window + Duration::from_secs(1),
        "resynced after {took:?}"
    );
    assert!(transport.refused_subscriptions() >= 1, "it tried again");
    assert_eq!(transport.subscriptions(), 1, "still down");
    let s = node.status();
    assert_eq!((s.publisher_gaps, s.losses), (1, 1), "{s:?}");
}

/// Issue 21, item 2: a fresh publisher (one per request, the CLI) whose
/// only event is lost, followed by all of its announcements. The node has
/// never heard of it; taking its first announcement as a baseline would
/// leave the cache stale for good, with `publisher_gaps = 0`. The
/// announcement says how long ago its event was sent; sent while the node
/// held every event of the cache, it should have arrived, so the numbers up
/// to it are lost.
#[tokio::test(start_paused = true)]
async fn a_one_shot_publishers_lost_only_event_is_found_by_its_announcement() {
    for window in [Duration::from_secs(10), Duration::ZERO] {
        let transport = lossy();
        let nodes = nodes(&transport, window, 2).await;
        // The nodes have been up for longer than their reorder window.
        tokio::time::sleep(window + INTERVAL).await;
        for (_, c) in &nodes {
            c.insert("k".into(), "old".into()).await;
        }
        transport.lose_publishes(1);
        let one_shot = Publisher::builder(transport.clone())
            .announce_interval(INTERVAL)
            .build()
            .unwrap();
        one_shot.insert("t", [("k", "new")]).await.unwrap();
        drop(one_shot);
        let sent = Instant::now();
        for (node, c) in &nodes {
            let at =
                eventually_within("the loss is found", LONG, async || resyncs(node) == 1).await;
            // At its first announcement: nothing to wait for.
            assert!(
                at - sent <= INTERVAL + Duration::from_millis(2),
                "{:?}",
                at - sent
            );
            let s = node.status();
            assert_eq!(
                (s.publisher_gaps, s.losses),
                (1, 1),
                "window {window:?}: {s:?}"
            );
            assert_eq!(c.peek("k").await, None, "the stale value is gone");
        }
        eventually_within("the repeats", LONG, async || announcements(&transport) == 3).await;
        tokio::time::sleep(window + INTERVAL).await;
        for (node, _) in &nodes {
            assert_eq!(resyncs(node), 1, "answered once");
        }
    }
}

/// Issue 35, item 6: a clear of the cache (a published `invalidate_all`, a
/// local one, a resync) does not stop the node listening. A one-shot
/// publisher's only event, sent 0.3 s after the clear and lost, may have
/// changed a row after the clear emptied the cache, so the clear does not
/// cover it: its first announcement finds the loss. (The check used to
/// wait a reorder window after every clear before it counted anything as
/// lost, and the cache stayed stale.)
#[tokio::test(start_paused = true)]
async fn after_a_clear_a_one_shot_publishers_lost_only_event_is_still_found() {
    let window = Duration::from_secs(2);
    for clear in ["published", "local", "resync"] {
        let transport = lossy();
        let nodes = nodes(&transport, window, 1).await;
        let (node, c) = &nodes[0];
        // Live for longer than its reorder window.
        tokio::time::sleep(Duration::from_secs(3)).await;
        match clear {
            "published" => {
                let admin = Publisher::builder(transport.clone())
                    .announce_interval(Duration::MAX)
                    .build()
                    .unwrap();
                admin.invalidate_all("t").await.unwrap();
                eventually("the clear applied", async || c.status().clears == 1).await;
            }
            "local" => c.invalidate_all().await,
            _ => {
                // Publisher 7's numbers jump: a gap, which resyncs the cache.
                for seq in [1, 3] {
                    transport
                        .publish(
                            DEFAULT_TOPIC,
                            "t",
                            raw_event("t", 7, seq, &refresh_change("j", "v")),
                        )
                        .await
                        .unwrap();
                }
                eventually("the gap's resync", async || resyncs(node) == 1).await;
            }
        }
        let before = resyncs(node);
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Loaded after the clear, from the row the lost event changes.
        c.insert("k".into(), "old".into()).await;
        transport.lose_publishes(1);
        let one_shot = Publisher::builder(transport.clone())
            .announce_interval(INTERVAL)
            .build()
            .unwrap();
        one_shot.insert("t", [("k", "new")]).await.unwrap();
        drop(one_shot);
        eventually_within("the loss is found", LONG, async || {
            resyncs(node) == before + 1
        })
        .await;
        assert_eq!(
            c.peek("k").await,
            None,
            "after a {clear} clear: {:?}",
            node.status()
        );
    }
}

/// A one-shot publisher whose first event is lost and second arrives: the
/// second says the first was sent a moment ago, while the node listened.
#[tokio::test(start_paused = true)]
async fn an_unknown_publishers_first_event_above_one_is_a_gap_if_the_one_before_was_its_to_miss() {
    let transport = lossy();
    let window = Duration::from_secs(2);
    let nodes = nodes(&transport, window, 1).await;
    tokio::time::sleep(window + INTERVAL).await;
    let (node, c) = &nodes[0];
    transport.lose_publishes(1);
    let p = Publisher::builder(transport.clone())
        .announce_interval(Duration::MAX)
        .build()
        .unwrap();
    p.insert("t", [("k", "first")]).await.unwrap();
    c.insert("other".into(), "cached".into()).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    p.insert("t", [("j", "second")]).await.unwrap();
    eventually("the second event applies", async || {
        holds(c, "j", Some("second")).await
    })
    .await;
    let s = node.status();
    assert_eq!((s.publisher_gaps, resyncs(node)), (1, 1), "{s:?}");
    assert_eq!(c.peek("other").await, None);
}

/// No false alarm: an ordinary first announcement, from a publisher whose
/// last event was sent before the node started (and, with no look-back,
/// never replayed to it), is a baseline, not a loss; so is one whose event
/// was sent within the reorder window after the node started listening.
#[tokio::test(start_paused = true)]
async fn an_announcement_of_an_event_sent_before_the_node_listened_is_no_loss() {
    for window in [Duration::ZERO, Duration::from_secs(3)] {
        let transport = lossy();
        let p = Publisher::builder(transport.clone())
            .announce_interval(INTERVAL)
            .build()
            .unwrap();
        p.insert("t", [("k", "v")]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let c = cache("t");
        let node = Node::builder("late", transport.clone())
            .reorder_window(window)
            .start_from(crate::transport::StartFrom::Latest)
            .register(&c)
            .start()
            .await
            .unwrap();
        eventually_within("the repeats", LONG, async || announcements(&transport) == 3).await;
        tokio::time::sleep(window + INTERVAL).await;
        let s = node.status();
        assert_eq!(
            (s.publisher_gaps, s.losses, s.caches[0].loss_resyncs),
            (0, 0, 0),
            "window {window:?}: {s:?}"
        );
        node.shutdown().await.unwrap();
    }
}

/// The rule in isolation: only once the node reads live; the previous
/// event must have been sent more than the margin after the node went
/// live and the cache was registered, and after (or at) the cache was last
/// emptied; never across baselines forgotten for room; ages beyond the
/// clock's reach say nothing.
#[test]
fn an_unknown_publishers_previous_event_counts_as_missed_only_when_it_was_ours_to_miss() {
    use super::super::seqs::{MAX_TRACKED_PUBLISHERS, Prior};
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // Registered at the start, emptied at `emptied`.
    let prior = |sent_by, emptied| {
        move || {
            Some(Prior {
                sent_by,
                registered: t0,
                emptied,
            })
        }
    };
    let mut seqs = PublisherSeqs::default();
    seqs.margin = Duration::from_millis(100);
    // Not live yet: taken on trust.
    assert_eq!(
        seqs.announced_after(1, "a", 1, at(0), prior(at(5000), at(0))),
        None
    );
    seqs.live_since = Some(at(1000));
    let lost = |p, to| Missing {
        publisher: p,
        cache: "a".into(),
        from: 1,
        to,
    };
    // Sent well after the node was live and the cache emptied: lost.
    assert_eq!(
        seqs.announced_after(2, "a", 3, at(0), prior(at(5000), at(0))),
        Some(lost(2, 3))
    );
    // Within the margin of going live: no.
    assert_eq!(
        seqs.announced_after(3, "a", 1, at(0), prior(at(1100), at(0))),
        None
    );
    // Or of the cache being registered.
    let registered = |sent_by| {
        move || {
            Some(Prior {
                sent_by,
                registered: at(4950),
                emptied: at(4950),
            })
        }
    };
    assert_eq!(
        seqs.announced_after(4, "a", 1, at(0), registered(at(5000))),
        None
    );
    assert_eq!(seqs.observe_after(5, "a", 4, registered(at(5000))), None);
    // Issue 35, item 6: a clear does not stop the node listening. Sent
    // before the cache was emptied, the event is covered; sent after it
    // (or at it: the two cannot be ordered), it is lost, however soon.
    assert_eq!(
        seqs.announced_after(20, "a", 1, at(0), prior(at(4949), at(4950))),
        None
    );
    assert_eq!(
        seqs.observe_after(21, "a", 4, prior(at(4949), at(4950))),
        None
    );
    assert_eq!(
        seqs.announced_after(22, "a", 2, at(0), prior(at(4950), at(4950))),
        Some(lost(22, 2))
    );
    assert_eq!(
        seqs.observe_after(23, "a", 4, prior(at(4951), at(4950))),
        Some(3)
    );
    // An event: the one before it was missed; a first event vouches for
    // itself.
    assert_eq!(
        seqs.observe_after(6, "a", 4, prior(at(5000), at(0))),
        Some(3)
    );
    assert_eq!(seqs.observe_after(7, "a", 1, prior(at(5000), at(0))), None);
    // A known publisher: the numbers decide, as always.
    assert_eq!(seqs.observe_after(6, "a", 5, prior(at(9000), at(0))), None);
    // Baselines forgotten for room: their publishers' next messages are
    // judged only after the forgetting (plus the margin).
    seqs.margin = Duration::ZERO;
    seqs.live_since = Some(t0);
    let before = Instant::now();
    for p in 100..100 + MAX_TRACKED_PUBLISHERS as u64 {
        seqs.observe(p, "b", 1);
    }
    assert!(seqs.tracked < MAX_TRACKED_PUBLISHERS, "some were forgotten");
    assert_eq!(
        seqs.announced_after(100, "b", 1, at(0), prior(before, at(0))),
        None,
        "forgotten, not lost"
    );
    let after = Instant::now() + Duration::from_millis(1);
    assert!(
        seqs.announced_after(1, "b", 1, at(0), prior(after, at(0)))
            .is_some()
    );
}

/// After a loss that resynced every cache (a new epoch), a publisher whose
/// baseline from before it is just below its next number lost nothing:
/// every number up to the baseline arrived or was covered. Judged as a
/// first instead, its previous event, sent just before the resync, would
/// look possibly sent after it (`sent_by` is late by the message's time
/// in transit), and cost every busy cache a second resync after each loss.
/// A number above the next one, or an announcement above the baseline, is
/// judged as a first, as before.
#[test]
fn after_a_loss_a_publishers_next_number_is_no_loss() {
    use super::super::seqs::Prior;
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    // The previous event's `sent_by` is at the resync's moment.
    let prior = move || {
        Some(Prior {
            sent_by: at(5000),
            registered: t0,
            emptied: at(5000),
        })
    };
    let mut seqs = PublisherSeqs::default();
    seqs.live_since = Some(t0);
    for p in [1, 2, 3] {
        assert_eq!(seqs.observe(p, "a", 4), None);
    }
    seqs.clear();
    assert_eq!(seqs.observe_after(1, "a", 5, prior), None);
    assert_eq!(seqs.announced_after(2, "a", 4, at(0), prior), None);
    assert_eq!(seqs.observe_after(3, "a", 7, prior), Some(6));
    assert_eq!(
        seqs.announced_after(2, "a", 6, at(0), prior),
        Some(Missing {
            publisher: 2,
            cache: "a".into(),
            from: 1,
            to: 6
        })
    );
}

/// A publisher's wall clock an hour off, either way, changes no loss
/// decision: the node reads only the age the publisher measured on its own
/// clock (`since_prev_us`), never its time of day (`published_at_us`,
/// used for latency figures alone).
#[tokio::test(start_paused = true)]
async fn a_publishers_wall_clock_changes_no_loss_decision() {
    use crate::wire::{Header, HeaderExt, encode_ext};
    const HOUR_US: u64 = 3_600_000_000;
    for skewed in [now_us() + HOUR_US, now_us() - HOUR_US] {
        let transport = EmbeddedTransport::new();
        let window = Duration::from_secs(2);
        let c = cache("t");
        let node = Node::builder("n1", transport.clone())
            .reorder_window(window)
            .register(&c)
            .start()
            .await
            .unwrap();
        tokio::time::sleep(window * 3).await;
        let send = |publisher, seq, since_prev_us, change: Change| {
            let t = transport.clone();
            let header = Header {
                cache: "t",
                origin: crate::wire::Origin(b"skewed"),
                publisher,
                seq,
                published_at_us: skewed,
            };
            let ext = HeaderExt {
                since_prev_us,
                fence: None,
                watermark: None,
            };
            let payload = Bytes::from(encode_ext(&header, &ext, &change).unwrap());
            async move { t.publish(DEFAULT_TOPIC, "t", payload).await.unwrap() }
        };
        // An ordinary publisher: its events arrive, the announcement
        // follows; nothing is lost.
        send(1, 1, None, refresh_change("a", "1")).await;
        send(1, 2, Some(1_000), refresh_change("a", "2")).await;
        send(1, 2, Some(1_000_000), Change::ANNOUNCE).await;
        // A one-shot publisher whose only event was lost: its
        // announcement says the event went out a second ago.
        c.insert("b".into(), "stale".into()).await;
        send(2, 1, Some(1_000_000), Change::ANNOUNCE).await;
        eventually("four records read", async || {
            node.status().events_received == 4
        })
        .await;
        let s = node.status();
        assert_eq!(
            (s.publisher_gaps, s.caches[0].loss_resyncs),
            (1, 1),
            "clock {skewed}: {s:?}"
        );
        assert_eq!(c.peek("b").await, None);
        node.shutdown().await.unwrap();
    }
}

/// A pipelined publish whose acknowledgement fails while publishes before
/// and after it are in flight: its caller gets the error, the others go
/// through, and the node finds the number that never reached the broker
/// missing and resyncs the cache.
#[tokio::test(start_paused = true)]
async fn a_failed_acknowledgement_in_the_window_is_a_gap_the_node_resyncs() {
    let transport = lossy();
    let mut nodes = nodes(&transport, Duration::ZERO, 1).await;
    let (node, c) = nodes.pop().unwrap();
    let p = Publisher::builder(transport.clone())
        .announce_interval(INTERVAL)
        .build()
        .unwrap();
    p.insert("t", [("k0", "v")]).await.unwrap();
    eventually("event 1 applied", async || holds(&c, "k0", Some("v")).await).await;
    // Every acknowledgement is held back: what follows is in flight at once.
    transport.hang_after_broker_where(|_, _| true);
    let spawn = |k: &'static str| {
        let p = p.clone();
        tokio::spawn(async move { p.insert("t", [(k, "v")]).await })
    };
    let mut ok = Vec::new();
    for k in ["k1", "k2"] {
        ok.push(spawn(k));
        let n = ok.len();
        eventually("handed over", async || transport.hanging() == n).await;
    }
    transport.fail_acks(1);
    let failed = spawn("k3").await.unwrap();
    assert!(
        failed.is_err_and(|e| e.is_disconnected()),
        "its caller gets the error"
    );
    for k in ["k4", "k5"] {
        ok.push(spawn(k));
        let n = ok.len();
        eventually("handed over", async || transport.hanging() == n).await;
    }
    assert!(
        ok.iter().all(|t| !t.is_finished()),
        "all in flight together"
    );
    transport.hang_publishes(false);
    for t in ok {
        t.await.unwrap().unwrap();
    }
    assert_eq!(
        transport.publishes(),
        5,
        "all but the failed one reached the broker"
    );
    eventually_within("the gap is answered", LONG, async || resyncs(&node) == 1).await;
    eventually("the last event applied", async || {
        holds(&c, "k5", Some("v")).await
    })
    .await;
    let s = node.status();
    assert_eq!(s.publisher_gaps, 1, "{s:?}");
    assert_eq!(s.last_loss_reason.as_deref(), Some("publisher_gap"));
    assert_eq!(
        c.peek("k1").await,
        None,
        "what came before the gap was dropped"
    );
    assert_eq!(c.peek("k3").await, None, "never sent");
}
