//! The freshness bound against a real broker: proved while the node keeps
//! up, growing for as long as the broker answers nothing, proved again
//! once it does.

use std::time::Duration;

use cache_sync::{Node, Publisher, SyncedCache};
use tokio::time::Instant;

use super::{Fixture, cannot_run, retry};

/// How often the scenario's node proves its bound.
const EVERY: Duration = Duration::from_millis(50);
/// A bound this young is fresh: twenty intervals, for a loaded machine.
const FRESH_MS: u64 = 1000;
/// A bound past other caches' events comes within this (a loaded
/// machine's margin over a few proof intervals).
const PROVED_PAST_WITHIN: Duration = Duration::from_secs(8);
/// An age past this was proved by nothing for seconds.
const STALE_MS: u64 = 3000;

/// A node on `topic` holding `cache`, proving every `EVERY`, once it has
/// proved a young bound. A transport that proves none cannot run these
/// scenarios.
async fn proving_node(
    fixture: &mut dyn Fixture,
    topic: &str,
    cache: &str,
) -> (SyncedCache<String, String>, Node) {
    let name = fixture.name();
    let cache: SyncedCache<String, String> = SyncedCache::new(cache, moka::future::Cache::new(100));
    let node = fixture
        .configure(Node::builder("fresh", fixture.transport().await))
        .topic(topic)
        .freshness_interval(EVERY)
        .register(&cache)
        .start()
        .await
        .unwrap_or_else(|e| panic!("{name}: node: {e}"));
    let age = || node.status().freshness_age_ms;
    first_bound(name, &age).await;
    crate::eventually(&format!("{name}: a young bound"), async || {
        age().is_some_and(|a| a <= FRESH_MS)
    })
    .await;
    (cache, node)
}

/// Waits for the node's first bound; a transport that proves none cannot
/// run these scenarios.
async fn first_bound(name: &str, age: &impl Fn() -> Option<u64>) {
    let asked = Instant::now();
    while age().is_none() {
        if asked.elapsed() > Duration::from_secs(5) {
            cannot_run(
                name,
                "a freshness bound (its transport does not tell its tail)",
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A node proves a young bound while it keeps up; while its broker is
/// paused (it resets nothing: a partition looks the same to the node) the
/// bound's age grows past the pause so far; once the broker answers again,
/// the node proves a young bound again.
pub async fn freshness_follows_a_paused_broker(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let topic = format!("fresh-{name}-{}", std::process::id());
    let (cache, node) = proving_node(fixture, &topic, "fresh").await;
    let age = || node.status().freshness_age_ms;
    let fresh = async || age().is_some_and(|a| a <= FRESH_MS);

    let publisher = Publisher::builder(fixture.transport().await)
        .topic(&topic)
        .build()
        .expect("publisher");
    retry(|| publisher.insert("fresh", [("k", "v1")])).await;
    crate::eventually(&format!("{name}: v1 applied"), async || {
        cache.peek("k").await == Some("v1".to_owned())
    })
    .await;
    crate::eventually(&format!("{name}: a young bound after a publish"), fresh).await;

    if !fixture.pause() {
        cannot_run(name, "a paused broker");
    }
    let paused = Instant::now();
    while age().is_none_or(|a| a < STALE_MS) {
        if paused.elapsed() > Duration::from_secs(30) {
            fixture.resume();
            panic!(
                "{name}: the bound's age is {:?} ms 30 s into a broker pause",
                age()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fixture.resume();
    let resumed = Instant::now();
    crate::eventually(&format!("{name}: a young bound after the pause"), fresh).await;
    eprintln!(
        "{name}: the bound was young again {:?} after the broker resumed",
        resumed.elapsed()
    );
    node.shutdown().await.expect("shutdown");
}

/// A node proves its bound past events of caches it does not hold: on a
/// transport whose broker filters them out (RocketMQ's tags), its consumer
/// moves past them without handing any over, and the bound must follow
/// that move, not stop at the node's own last event. A bound asked after
/// the other cache's publishes were acknowledged is proved, and the node's
/// own cache still takes its events.
pub async fn freshness_proved_past_other_caches_events(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let topic = format!("fresh-past-{name}-{}", std::process::id());
    let (cache, node) = proving_node(fixture, &topic, "mine").await;
    let age = || node.status().freshness_age_ms;

    // No announcements: one of this node's cache, coming after the other
    // cache's events, would carry the node past them by itself.
    let publisher = Publisher::builder(fixture.transport().await)
        .topic(&topic)
        .announce_interval(Duration::MAX)
        .build()
        .expect("publisher");
    retry(|| publisher.insert("mine", [("k", "v1")])).await;
    crate::eventually(&format!("{name}: v1 applied"), async || {
        cache.peek("k").await == Some("v1".to_owned())
    })
    .await;
    // Another cache's events, last on the topic: on RocketMQ they share
    // the queue its tag hashes to, filtered out by the broker for this node.
    for i in 0..20 {
        retry(|| publisher.insert("other", [(format!("k{i}"), "x")])).await;
    }
    let acknowledged = Instant::now();
    // A proof asked after the last acknowledgement is younger than the
    // time since it. Well before RocketMQ's 15 s long poll, which alone
    // would carry a consumer held at its own last message past them.
    while age().is_none_or(|a| u128::from(a) >= acknowledged.elapsed().as_millis()) {
        assert!(
            acknowledged.elapsed() < PROVED_PAST_WITHIN,
            "{name}: no bound proved past the other cache's events {:?} after them (age {:?} ms)",
            acknowledged.elapsed(),
            age()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!(
        "{name}: proved past the other cache's events {:?} after their acknowledgement",
        acknowledged.elapsed()
    );
    retry(|| publisher.insert("mine", [("k", "v2")])).await;
    crate::eventually(&format!("{name}: v2 applied"), async || {
        cache.peek("k").await == Some("v2".to_owned())
    })
    .await;
    node.shutdown().await.expect("shutdown");
}
