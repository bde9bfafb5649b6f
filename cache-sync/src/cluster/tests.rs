//! The view's storage, indexes and bounds, through `Cluster::observe` (what
//! the heartbeat channel's reader calls) and the staircase alone.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use tokio::time::Instant;

use super::handle::LocalHeartbeat;
use super::members::{GONE_KEPT, MAX_MEMBER_BYTES, MAX_MEMBERS, MAX_TOTAL_BYTES, lifetime};
use super::view::Staircase;
use super::*;
use crate::transport::embedded::EmbeddedTransport;
use crate::transport::{DEFAULT_TOPIC, Position};
use crate::util::lock;
use crate::wire::Codec;

/// The view's own interval. Tests run on a paused clock: members of
/// 100 ms intervals expire only when a test moves it on.
const EVERY: Duration = Duration::from_millis(100);

pub(super) fn cache(name: &str, version: Option<u64>) -> CacheHeartbeat {
    CacheHeartbeat {
        name: name.into(),
        version,
        version_at_us: None,
        version_age_ms: None,
        entries: 1,
        loss_resyncs: 0,
        quarantined: false,
        last_latency_us: None,
        freshness_age_ms: None,
        audit: None,
    }
}

pub(super) fn heartbeat(id: &str, caches: Vec<CacheHeartbeat>) -> Heartbeat {
    Heartbeat {
        node_id: id.into(),
        topic: DEFAULT_TOPIC.into(),
        started_at_us: 1_000_000,
        sent_at_us: 2_000_000,
        interval_ms: 100,
        transport: "embedded".into(),
        consuming: true,
        ready: true,
        position: Position::default(),
        losses: 0,
        live_nodes: None,
        freshness_age_ms: None,
        caches,
    }
}

/// A watcher; with `local`, the view of a node "me".
pub(super) fn watcher(local: Option<LocalHeartbeat>) -> Cluster {
    Cluster::new(
        if local.is_some() { "me" } else { "watcher" }.into(),
        DEFAULT_TOPIC.into(),
        Arc::new(EmbeddedTransport::new()),
        Codec::new(1 << 20, None),
        EVERY,
        local,
        None,
    )
}

fn ids(c: &Cluster) -> Vec<String> {
    c.nodes().into_iter().map(|h| h.node_id).collect()
}

#[tokio::test(start_paused = true)]
async fn a_cache_listed_twice_is_kept_once_the_first() {
    let c = watcher(None);
    c.observe(heartbeat(
        "n1",
        vec![
            cache("b", Some(3)),
            cache("a", Some(1)),
            cache("a", Some(9)),
            cache("b", Some(7)),
        ],
    ));
    c.observe(heartbeat("n2", vec![cache("a", Some(2))]));
    let nodes = c.nodes();
    let n1 = &nodes[0];
    assert_eq!(
        n1.caches
            .iter()
            .map(|c| (c.name.as_str(), c.version))
            .collect::<Vec<_>>(),
        [("a", Some(1)), ("b", Some(3))]
    );
    let view = c.view();
    let n1 = view.node("n1").unwrap();
    assert_eq!(n1.caches.len(), 2);
    // The 9 that lost is not the newest: n2's 2 is.
    assert_eq!(view.caches[0].newest_version, Some(2));
    assert_eq!((view.caches[0].nodes, view.caches[0].behind), (2, 1));
    assert_eq!(view.caches[1].nodes, 1);
}

#[tokio::test(start_paused = true)]
async fn the_newest_heartbeat_per_node_wins_by_its_own_stamps() {
    let c = watcher(None);
    let mut newer = heartbeat("n1", vec![cache("a", Some(5))]);
    newer.sent_at_us = 3_000_000;
    let older = heartbeat("n1", vec![cache("a", Some(4))]);
    c.observe(newer);
    c.observe(older);
    assert_eq!(c.nodes()[0].caches[0].version, Some(5));
}

#[tokio::test(start_paused = true)]
async fn holders_come_from_the_index_and_include_the_owning_node() {
    let own = heartbeat("me", vec![cache("a", Some(1)), cache("own-only", None)]);
    let local: LocalHeartbeat = Box::new(move || Some(own.clone()));
    let c = watcher(Some(local));
    c.observe(heartbeat("n2", vec![cache("a", Some(1)), cache("b", None)]));
    c.observe(heartbeat("n1", vec![cache("a", Some(1))]));
    // The owning node's echo: counted once, as itself.
    c.observe(heartbeat("me", vec![cache("a", Some(1)), cache("b", None)]));
    assert_eq!(c.holders("a"), ["me", "n1", "n2"]);
    // Its echo held "b"; as of now it does not.
    assert_eq!(c.holders("b"), ["n2"]);
    assert_eq!(ids(&c), ["me", "n1", "n2"]);
    assert_eq!(c.holders("own-only"), ["me"]);
    assert!(c.holders("nobody").is_empty());
    // A node that drops a cache leaves its holders.
    c.observe({
        let mut h = heartbeat("n2", vec![cache("a", Some(2))]);
        h.sent_at_us = 3_000_000;
        h
    });
    assert!(c.holders("b").is_empty());
    assert_eq!(c.view().caches.len(), 2, "a and own-only");
}

#[tokio::test(start_paused = true)]
async fn members_expire_from_a_queue_and_are_listed_as_gone() {
    let c = watcher(None);
    for (id, interval_ms) in [("slow", 1_000), ("fast", 100), ("forever", u64::MAX)] {
        let mut h = heartbeat(id, vec![cache("a", Some(1))]);
        h.interval_ms = interval_ms;
        c.observe(h);
    }
    tokio::time::advance(Duration::from_millis(301)).await;
    assert_eq!(ids(&c), ["forever", "slow"]);
    assert_eq!(c.holders("a"), ["forever", "slow"]);
    tokio::time::advance(Duration::from_millis(2_700)).await;
    assert_eq!(ids(&c), ["forever"]);
    let gone: Vec<_> = c.view().gone.into_iter().map(|g| g.node_id).collect();
    assert_eq!(gone, ["fast", "slow"]);
    // A gone node that comes back is live again, and no longer gone.
    c.observe(heartbeat("fast", vec![]));
    assert_eq!(c.view().gone.len(), 1);
    // A forged endless interval lasts three hours at most.
    tokio::time::advance(lifetime(u64::MAX)).await;
    assert_eq!(ids(&c), Vec::<String>::new());
    // Gone nodes are forgotten after five minutes.
    tokio::time::advance(GONE_KEPT).await;
    assert!(c.view().gone.is_empty());
    assert_eq!(
        lock(&c.inner.members).bytes(),
        0,
        "all accounted bytes given back"
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_view_drops_new_nodes_and_says_it_overflows() {
    let c = watcher(None);
    assert!(!c.overflowing());
    for i in 0..MAX_MEMBERS {
        c.observe(heartbeat(&format!("n{i}"), vec![cache("a", Some(1))]));
    }
    assert_eq!(c.nodes().len(), MAX_MEMBERS);
    assert_eq!(c.stats().dropped.load(Relaxed), 0);
    // At the cap: overflowing before anything is dropped.
    assert!(c.overflowing());
    let mut late = heartbeat("late", vec![cache("a", Some(1))]);
    late.interval_ms = 1_000;
    c.observe(late);
    assert_eq!(c.stats().dropped.load(Relaxed), 1);
    assert!(c.holders("a").len() == MAX_MEMBERS);
    // A member already in is still taken in.
    let mut again = heartbeat("n0", vec![cache("a", Some(2))]);
    again.sent_at_us = 3_000_000;
    c.observe(again);
    assert_eq!(c.stats().dropped.load(Relaxed), 1);
    assert_eq!(c.view().caches[0].newest_version, Some(2));
    // Keep one alive; the rest expire, and the cap is far.
    tokio::time::advance(Duration::from_millis(250)).await;
    let mut alive = heartbeat("n0", vec![]);
    alive.sent_at_us = 4_000_000;
    c.observe(alive);
    tokio::time::advance(Duration::from_millis(100)).await;
    assert_eq!(ids(&c), ["n0"]);
    // Still overflowing: "late" was dropped less than three of its own
    // intervals (1 s) ago.
    assert!(c.overflowing());
    tokio::time::advance(Duration::from_millis(2_700)).await;
    c.observe({
        let mut h = heartbeat("n0", vec![]);
        h.sent_at_us = 5_000_000;
        h
    });
    assert!(!c.overflowing());
}

#[tokio::test(start_paused = true)]
async fn heartbeats_are_bounded_in_bytes_each_and_in_all() {
    let c = watcher(None);
    // One node's heartbeat over the per-member bound: dropped.
    let mut huge = heartbeat("huge", vec![cache("a", Some(1))]);
    huge.transport = "x".repeat(MAX_MEMBER_BYTES);
    c.observe(huge);
    assert_eq!(c.stats().dropped.load(Relaxed), 1);
    assert!(ids(&c).is_empty());
    assert!(c.overflowing(), "a node is missing");
    tokio::time::advance(Duration::from_millis(301)).await;
    assert!(!c.overflowing());
    // Many cache names, each new: the names count too.
    let names: Vec<CacheHeartbeat> = (0..3_000)
        .map(|i| cache(&format!("{i:0>80}"), Some(1)))
        .collect();
    c.observe(heartbeat("many", names));
    assert_eq!(c.stats().dropped.load(Relaxed), 2);

    // Members just under the bound fill the budget; then the next is
    // dropped, and the accounted bytes never pass the budget.
    let big = "y".repeat(MAX_MEMBER_BYTES - 4096);
    let mut stored = 0;
    for i in 0.. {
        let mut h = heartbeat(&format!("big{i}"), vec![cache("a", Some(1))]);
        h.transport = big.clone();
        c.observe(h);
        let bytes = lock(&c.inner.members).bytes();
        assert!(bytes <= MAX_TOTAL_BYTES, "{bytes}");
        if c.stats().dropped.load(Relaxed) > 2 {
            break;
        }
        stored += 1;
    }
    assert!(stored >= MAX_TOTAL_BYTES / MAX_MEMBER_BYTES, "{stored}");
    let bytes = lock(&c.inner.members).bytes();
    assert!(
        bytes + MAX_MEMBER_BYTES > MAX_TOTAL_BYTES,
        "not full: {bytes}"
    );
    assert_eq!(c.nodes().len(), stored);
    assert!(c.overflowing());
    // They expire into the nodes gone, which take little, and are given
    // up for room first: a new node fits again.
    tokio::time::advance(Duration::from_millis(301)).await;
    assert!(ids(&c).is_empty());
    assert_eq!(c.view().gone.len(), stored);
    let mut h = heartbeat("after", vec![cache("a", Some(1))]);
    h.transport = big.clone();
    c.observe(h);
    assert_eq!(ids(&c), ["after"]);
    assert_eq!(c.stats().dropped.load(Relaxed), 3);
}

/// `since` the `n`th second after `t0`.
fn at(t0: Instant, secs: u64) -> Instant {
    t0 + Duration::from_secs(secs)
}

#[test]
fn a_staircase_answers_with_the_first_version_above() {
    let t0 = Instant::now();
    let now = at(t0, 100);
    let mut s = Staircase::default();
    assert_eq!(s.behind_since(0), None);
    s.learn(5, at(t0, 10), now);
    s.learn(7, at(t0, 20), now);
    // Dominated: an older version known later, or the same one later.
    s.learn(6, at(t0, 30), now);
    s.learn(7, at(t0, 25), now);
    assert_eq!(s.behind_since(4), Some(at(t0, 10)));
    assert_eq!(s.behind_since(5), Some(at(t0, 20)));
    assert_eq!(s.behind_since(6), Some(at(t0, 20)));
    assert_eq!(s.behind_since(7), None);
    // Known earlier (a heartbeat's age): the lower steps it covers go.
    s.learn(9, at(t0, 5), now);
    assert_eq!(s.behind_since(0), Some(at(t0, 5)));
    assert_eq!(s.behind_since(8), Some(at(t0, 5)));
    // Keeping to what holders at 6 to 8 can ask: the 9 goes (nobody holds
    // it any more), and 8 is known since now, no earlier.
    s.keep_between(6, 8, now);
    assert_eq!(s.behind_since(6), Some(now));
    assert_eq!(s.behind_since(7), Some(now));
    assert_eq!(s.behind_since(8), None);
}

#[test]
fn a_staircase_stays_small_and_under_the_truth() {
    // A node stuck at version 0 while versions 1 to 3,600 come, one a
    // second: the steps stay few, and each answer is a lower bound
    // within a fifth of the truth.
    let t0 = Instant::now();
    let mut s = Staircase::default();
    let now = at(t0, 3_601);
    for v in 1..=3_600u64 {
        s.learn(v, at(t0, v), at(t0, v));
    }
    assert!(s.len() <= Staircase::MAX_STEPS, "{}", s.len());
    for u in [0, 1, 10, 100, 1_000, 3_000, 3_599] {
        let truth = now - at(t0, u + 1);
        let got = now - s.behind_since(u).unwrap();
        assert!(got <= truth, "{u}: {got:?} > {truth:?}");
        assert!(
            got.as_secs_f64() >= truth.as_secs_f64() * 0.9,
            "{u}: {got:?}, truth {truth:?}"
        );
    }
}

// Paused: in real time, members of 100 ms intervals could expire while
// 10,000 are taken in.
#[tokio::test(start_paused = true)]
async fn the_owning_nodes_echo_takes_no_room_under_the_member_cap() {
    let own = heartbeat("me", vec![cache("a", Some(1))]);
    let local: LocalHeartbeat = Box::new(move || Some(own.clone()));
    let c = watcher(Some(local));
    c.observe(heartbeat("me", vec![cache("a", Some(1))]));
    for i in 0..MAX_MEMBERS - 1 {
        c.observe(heartbeat(&format!("n{i}"), vec![cache("a", Some(1))]));
    }
    assert!(!c.overflowing(), "room for one more");
    c.observe(heartbeat("last", vec![cache("a", Some(1))]));
    assert_eq!(c.stats().dropped.load(Relaxed), 0);
    assert_eq!(c.nodes().len(), MAX_MEMBERS + 1, "the others and itself");
    assert!(c.overflowing());
    c.observe(heartbeat("late", vec![cache("a", Some(1))]));
    assert_eq!(c.stats().dropped.load(Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn the_live_nodes_members_count_follow_their_heartbeats() {
    let claiming = |id: &str, sent_at_us: u64, live: u64| {
        let mut h = heartbeat(id, vec![]);
        h.sent_at_us = sent_at_us;
        h.live_nodes = Some(live);
        h
    };
    let c = watcher(None);
    assert!(!c.missing_nodes());
    c.observe(claiming("a", 2_000_000, 3));
    assert_eq!(c.live_nodes(), 1);
    assert!(c.missing_nodes(), "a counts three");
    c.observe(heartbeat("b", vec![]));
    c.observe(heartbeat("c", vec![]));
    assert!(!c.missing_nodes());
    // A member's newer count replaces its last, up or down.
    c.observe(claiming("a", 3_000_000, 5));
    assert!(c.missing_nodes());
    c.observe(claiming("a", 4_000_000, 2));
    assert!(!c.missing_nodes());
    // An older heartbeat's count is no count.
    c.observe(claiming("a", 3_500_000, 9));
    assert!(!c.missing_nodes());
    // A member's count leaves with it.
    c.observe(claiming("a", 5_000_000, 9));
    assert!(c.missing_nodes());
    tokio::time::advance(Duration::from_millis(250)).await;
    for (id, sent) in [("b", 6_000_000), ("c", 6_000_000)] {
        let mut h = heartbeat(id, vec![]);
        h.sent_at_us = sent;
        c.observe(h);
    }
    tokio::time::advance(Duration::from_millis(100)).await;
    assert_eq!(ids(&c), ["b", "c"]);
    assert!(!c.missing_nodes());

    // A node's view counts the node itself, its echo arrived or not.
    let own = heartbeat("me", vec![]);
    let local: LocalHeartbeat = Box::new(move || Some(own.clone()));
    let c = watcher(Some(local));
    assert_eq!(c.live_nodes(), 1);
    c.observe(claiming("a", 2_000_000, 2));
    assert_eq!(c.live_nodes(), 2);
    assert!(!c.missing_nodes());
    c.observe(heartbeat("me", vec![]));
    assert_eq!(c.live_nodes(), 2, "the echo is the node itself");
}

/// The owning node is ahead of its own echo among the members (its echo
/// was sent before it applied the newest version). A member's heartbeat
/// arriving meanwhile must not trim the staircase to the echo's version:
/// that dropped the step the owning node taught, and a node behind it
/// looked behind only since the next version came (a full test run caught
/// it by 63 ms in `node::tests::cluster`).
#[tokio::test(start_paused = true)]
async fn a_member_heartbeat_keeps_what_the_owning_node_taught() {
    let mine = Arc::new(std::sync::Mutex::new(1u64));
    let local: LocalHeartbeat = {
        let mine = mine.clone();
        Box::new(move || {
            let mut a = cache("a", Some(*mine.lock().unwrap()));
            a.version_age_ms = Some(0);
            Some(heartbeat("me", vec![a]))
        })
    };
    let c = watcher(Some(local));
    // Members that stay for the test (10 s intervals): a view rebuilt from
    // nothing would know nothing of before.
    let member = |id: &str, sent_at_us: u64| {
        let mut h = heartbeat(id, vec![cache("a", Some(1))]);
        h.interval_ms = 10_000;
        h.sent_at_us = sent_at_us;
        h
    };
    c.observe(member("me", 2_000_000));
    c.observe(member("n2", 2_000_000));
    *mine.lock().unwrap() = 2;
    // The view learns version 2 from the owning node, now.
    let view = c.view();
    assert_eq!(view.node("n2").unwrap().caches[0].lag, Some(1));
    tokio::time::advance(Duration::from_millis(500)).await;
    // n2 again, still at 1; the owning node's echo still says 1.
    c.observe(member("n2", 2_500_000));
    let behind = c.view().node("n2").unwrap().caches[0].behind_ms;
    assert!(
        behind.is_some_and(|ms| ms >= 500),
        "behind {behind:?} ms, since the view first knew of version 2 500 ms ago"
    );
}
