//! The freshness bound: an age that stays small while the node keeps up,
//! grows while it cannot reach the broker's tail or cannot read, comes
//! back once it can, and stays unknown where the transport cannot tell.

use super::*;

const EVERY: Duration = Duration::from_millis(20);

/// Within three intervals: a bound proved afresh (a loaded machine may
/// delay one round, so the checks wait for it with `eventually`).
const FRESH: u64 = 60;
/// Past this, the node proved nothing for many intervals.
const STALE: u64 = 400;

/// A node holding only `c`, proving its bound every `EVERY`.
pub(super) async fn node_on(transport: &FaultyTransport, c: &Cache) -> Node {
    Node::builder("n", transport.clone())
        .freshness_interval(EVERY)
        .register(c)
        .start()
        .await
        .unwrap()
}

fn age(node: &Node) -> Option<u64> {
    node.status().freshness_age_ms
}

#[tokio::test]
async fn an_idle_node_proves_a_bound_within_intervals() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = cache("t");
    let node = node_on(&transport, &c).await;
    eventually("a bound within three intervals", async || {
        age(&node).is_some_and(|a| a <= FRESH)
    })
    .await;
    // And keeps proving it: later, still fresh.
    tokio::time::sleep(Duration::from_millis(200)).await;
    eventually("a bound within three intervals", async || {
        age(&node).is_some_and(|a| a <= FRESH)
    })
    .await;
}

/// The broker's tail unanswered, as across a partition that closes no
/// connection: the node can prove nothing, and its age grows for as long
/// as it lasts; once answered again it is fresh again.
#[tokio::test]
async fn a_node_that_cannot_reach_the_tail_shows_a_growing_age() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = cache("t");
    let node = node_on(&transport, &c).await;
    eventually("a bound within three intervals", async || {
        age(&node).is_some_and(|a| a <= FRESH)
    })
    .await;
    transport.hang_tails(true);
    eventually("an age past STALE", async || {
        age(&node).is_some_and(|a| a > STALE)
    })
    .await;
    transport.hang_tails(false);
    eventually("a bound within three intervals", async || {
        age(&node).is_some_and(|a| a <= FRESH)
    })
    .await;
    assert!(node.status().consuming, "no transport error was involved");
}

/// A node that stops reading while publishes go on has not applied what
/// the tail says was acknowledged: its age grows; once it reads again, the
/// age falls back. A node that reads nothing new while nothing is
/// published stays fresh (checked above): the bound is about what was
/// acknowledged, not about traffic.
#[tokio::test]
async fn a_node_that_stops_reading_while_publishes_go_on_shows_a_growing_age() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = cache("t");
    let node = node_on(&transport, &c).await;
    eventually("a bound within three intervals", async || {
        age(&node).is_some_and(|a| a <= FRESH)
    })
    .await;
    transport.stall(true);
    let publisher = Publisher::new(transport.clone());
    publisher.insert("t", [("k", "v1")]).await.unwrap();
    eventually("an age past STALE", async || {
        age(&node).is_some_and(|a| a > STALE)
    })
    .await;
    assert_eq!(c.peek("k").await, None, "nothing was read meanwhile");
    transport.stall(false);
    eventually("a bound within three intervals", async || {
        age(&node).is_some_and(|a| a <= FRESH)
    })
    .await;
    assert_eq!(c.peek("k").await.as_deref(), Some("v1"));
}

/// A transport that cannot tell its tail proves nothing: the age stays
/// unknown rather than claiming a bound, in the status and in `/metrics`.
#[tokio::test]
async fn a_transport_that_cannot_tell_its_tail_leaves_the_age_unknown() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    transport.hide_tails(true);
    let c = cache("t");
    let node = node_on(&transport, &c).await;
    Publisher::new(transport.clone())
        .insert("t", [("k", "v1")])
        .await
        .unwrap();
    eventually("v1 applied", async || holds(&c, "k", Some("v1")).await).await;
    tokio::time::sleep(EVERY * 10).await;
    assert_eq!(age(&node), None);
}

/// Turned off, the node asks nothing and reports no age.
#[tokio::test]
async fn a_node_without_the_bound_reports_no_age() {
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = cache("t");
    let node = Node::builder("n", transport.clone())
        .freshness_interval(Duration::MAX)
        .register(&c)
        .start()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(age(&node), None);
}

/// The interval's edges: zero and under 10 ms refused with the setting's
/// name, 10 ms and `Duration::MAX` (none) taken, past an hour refused.
#[tokio::test]
async fn the_freshness_interval_is_checked_at_start() {
    for (every, ok) in [
        (Duration::ZERO, false),
        (Duration::from_nanos(1), false),
        (Duration::from_millis(10), true),
        (Duration::from_secs(3600), true),
        (Duration::from_secs(3601), false),
        (Duration::MAX, true),
    ] {
        let started = Node::builder("n", EmbeddedTransport::new())
            .freshness_interval(every)
            .start()
            .await;
        match started {
            Ok(node) => {
                assert!(ok, "{every:?} was taken");
                let _ = node.shutdown().await;
            }
            Err(e) => {
                assert!(!ok, "{every:?} was refused: {e}");
                assert!(
                    e.is_config() && e.to_string().contains("freshness_interval"),
                    "{e}"
                );
            }
        }
    }
}

/// The default rule of `Transport::covers`: every partition of the tail,
/// at a sequence number at or past it; an id only when equal; a partition
/// the position lacks, never.
#[test]
fn a_position_covers_a_tail_partition_by_partition() {
    use crate::transport::Offset;
    let t = EmbeddedTransport::new();
    let pos = |entries: &[(&str, Offset)]| {
        let mut p = Position::default();
        for (k, v) in entries {
            p.set(*k, v.clone());
        }
        p
    };
    let tail = pos(&[("a", Offset::Seq(5)), ("e", Offset::Id("x".into()))]);
    let covers = |p: &Position| t.covers(p, &tail);
    assert!(covers(&pos(&[
        ("a", Offset::Seq(5)),
        ("e", Offset::Id("x".into()))
    ])));
    assert!(covers(&pos(&[
        ("a", Offset::Seq(u64::MAX)),
        ("e", Offset::Id("x".into()))
    ])));
    assert!(!covers(&pos(&[
        ("a", Offset::Seq(4)),
        ("e", Offset::Id("x".into()))
    ])));
    assert!(!covers(&pos(&[
        ("a", Offset::Seq(5)),
        ("e", Offset::Id("y".into()))
    ])));
    assert!(
        !covers(&pos(&[("a", Offset::Seq(5))])),
        "a partition missing"
    );
    assert!(!covers(&pos(&[
        ("a", Offset::Id("5".into())),
        ("e", Offset::Id("x".into()))
    ])));
    assert!(
        t.covers(&Position::default(), &Position::default()),
        "an empty tail"
    );
}

/// The age travels in heartbeats: another party's view shows it, young
/// while the node keeps up, growing while it cannot reach the tail.
#[tokio::test]
async fn the_age_travels_in_heartbeats() {
    const BEATS: Duration = Duration::from_millis(20);
    let transport = FaultyTransport::new(EmbeddedTransport::new());
    let c = cache("t");
    let _node = Node::builder("n", transport.clone())
        .freshness_interval(EVERY)
        .heartbeat_interval(BEATS)
        .register(&c)
        .start()
        .await
        .unwrap();
    let watcher = crate::cluster::Cluster::builder(transport.clone())
        .heartbeat_interval(BEATS)
        .observer("w")
        .start()
        .await
        .unwrap();
    let reported = |pred: fn(u64) -> bool| {
        watcher
            .view()
            .nodes
            .iter()
            .any(|n| n.node_id == "n" && n.freshness_age_ms.is_some_and(pred))
    };
    eventually("a young age in the view", async || reported(|a| a <= FRESH)).await;
    transport.hang_tails(true);
    eventually("a growing age in the view", async || {
        reported(|a| a > STALE)
    })
    .await;
}
