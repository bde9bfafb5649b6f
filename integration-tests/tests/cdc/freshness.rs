//! The relay's reports of its lag in the nodes' staleness bound: a relay
//! cut off from its database (a partition that closes nothing), or gone,
//! puts every node's bounded cache past its bound within the bound, while
//! the database changes under it; once the relay is back, the nodes are
//! within it again, holding what the database holds.

use std::time::Instant;

use integration_tests::proxy::Proxy;

use super::*;

const BOUND: Duration = Duration::from_secs(1);
/// How late a read may see a replaced value past the bound: the bound
/// is checked on every read, so only the reader's own polling and the
/// scheduling of a loaded machine.
const SLACK: Duration = Duration::from_millis(250);

/// A relay that reaches its database through `proxy`, reporting often.
fn relay_through(proxy: &Proxy, transport: &EmbeddedTransport) -> cache_sync::cdc::CdcRelayBuilder {
    CdcRelay::builder(
        format!("postgres://postgres@{}/postgres", proxy.addr()),
        Publisher::new(transport.clone()),
    )
    .standby_retry(Duration::from_millis(50))
    .lag_interval(Duration::from_millis(200))
    .freshness_interval(Duration::from_millis(50))
    .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
}

/// A node proving every 100 ms, holding `items` bounded at `BOUND` and
/// waiting for a relay's reports from the start.
async fn bounded_node(transport: &EmbeddedTransport) -> (SyncedCache<i64, String>, Node) {
    let cache = SyncedCache::builder(ITEMS, moka::future::Cache::new(1000))
        .max_staleness(BOUND)
        .relayed()
        .build()
        .unwrap();
    let node = Node::builder("n", transport.clone())
        .freshness_interval(Duration::from_millis(100))
        .register(&cache)
        .start()
        .await
        .unwrap();
    (cache, node)
}

fn age(node: &Node) -> Option<u64> {
    node.status()
        .caches
        .first()
        .and_then(|c| c.freshness_age_ms)
}

/// Reads key 1 until `until`, failing on a read begun later than the
/// bound (plus slack) after `replaced` that returns `old`; returns how many
/// reads went to the source (answered `None`).
async fn judge(
    cache: &SyncedCache<i64, String>,
    old: &str,
    replaced: Instant,
    until: Instant,
) -> usize {
    let mut bypassed = 0;
    while Instant::now() < until {
        // When the read began: the bound is checked then, and a loaded
        // machine may take long to return (a full run measured one read
        // 9 ms past the slack when timed from its end).
        let late = replaced.elapsed();
        let got = cache.get(&1).await;
        if got.as_deref() == Some(old) {
            assert!(
                late <= BOUND + SLACK,
                "a read begun {late:?} after the database replaced {old:?} returned it, past a bound of {BOUND:?}"
            );
        }
        bypassed += usize::from(got.is_none());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    bypassed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_from_its_database_puts_nodes_past_their_bound() {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    let transport = EmbeddedTransport::new();
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], pg.port()));
    let proxy = Proxy::start(upstream).await;
    let (cache, node) = bounded_node(&transport).await;
    // Awaited from the start: nothing proves the cache fresh yet.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(age(&node), None, "no report yet");
    let relay = relay_through(&proxy, &transport).start().await.unwrap();
    exec(&pool, "INSERT INTO items VALUES (1, 'a', NULL)").await;
    eventually("the row held and the cache fresh", async || {
        cache.get(&1).await.as_deref() == Some("a") && age(&node).is_some_and(|a| a < 500)
    })
    .await;

    // The relay cut off from its database, which changes meanwhile.
    proxy.blackhole();
    exec(&pool, "UPDATE items SET name = 'b' WHERE id = 1").await;
    let replaced = Instant::now();
    let bypassed = judge(&cache, "a", replaced, replaced + Duration::from_secs(4)).await;
    assert!(bypassed > 0, "no read went to the source during the cut");
    assert_eq!(cache.get(&1).await, None, "past the bound at the cut's end");
    assert!(age(&node).is_some_and(|a| a > 2000), "{:?}", age(&node));
    assert!(!node.is_ready(), "past a bound, not ready");
    assert!(
        node.status().freshness_age_ms.is_some_and(|a| a < 1000),
        "the node's own proof is young: the topic is fine, the relay is not"
    );
    assert!(cache.status().stale_bypasses > 0);

    // Healed: the change arrives, and the cache is within its bound.
    proxy.heal();
    // Within the relay's statement timeout and backoff: the held bytes
    // may have timed its session out.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(cache.get(&1).await.as_deref() == Some("b") && age(&node).is_some_and(|a| a < 1000)) {
        assert!(
            Instant::now() < deadline,
            "the change held and the cache fresh again: {:?} {:?}",
            cache.peek(&1).await,
            age(&node)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(node.is_ready());

    // The relay gone: past the bound again, within the bound's time.
    relay.shutdown().await;
    exec(&pool, "UPDATE items SET name = 'c' WHERE id = 1").await;
    let replaced = Instant::now();
    judge(&cache, "b", replaced, replaced + Duration::from_secs(2)).await;
    assert_eq!(cache.get(&1).await, None, "past the bound with no relay");
    node.shutdown().await.unwrap();
}

/// Without reports (`freshness_interval(Duration::MAX)`), a cache built
/// `relayed` is never proved fresh: its reads go to the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_that_never_reports_leaves_a_relayed_cache_unproved() {
    let (pg, pool, transport, nodes) = items_fixture(0).await;
    let (cache, node) = bounded_node(&transport).await;
    let relay = relay(&pg, &transport)
        .freshness_interval(Duration::MAX)
        .start()
        .await
        .unwrap();
    exec(&pool, "INSERT INTO items VALUES (1, 'a', NULL)").await;
    eventually("the row held", async || {
        cache.peek(&1).await.as_deref() == Some("a")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(cache.get(&1).await, None);
    assert_eq!(age(&node), None);
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    nodes.shutdown().await;
}

/// The relay cut off from the broker, not the database (its publishes
/// hang, as across a partition of the relay's link): the nodes read on,
/// their own proof young, but no report comes, and past the bound their
/// reads go to the source; once the publishes go through, the changes
/// and a report follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_publishes_hang_puts_nodes_past_their_bound() {
    let (pg, pool, transport, nodes) = items_fixture(0).await;
    // Built `relayed`: a cache that learns of its relay from the first
    // report is judged by its node's proof alone until then, and the hang
    // below may come first (it did, in one run of three).
    let (cache, node) = bounded_node(&transport).await;
    let faulty = cache_sync::transport::FaultyTransport::new(transport.clone());
    let relay = CdcRelay::builder(pg.url(), Publisher::new(faulty.clone()))
        .freshness_interval(Duration::from_millis(50))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    exec(&pool, "INSERT INTO items VALUES (1, 'a', NULL)").await;
    eventually("the row held and the cache fresh", async || {
        cache.get(&1).await.as_deref() == Some("a") && age(&node).is_some_and(|a| a < 500)
    })
    .await;
    faulty.hang_publishes(true);
    exec(&pool, "UPDATE items SET name = 'b' WHERE id = 1").await;
    let replaced = Instant::now();
    let bypassed = judge(&cache, "a", replaced, replaced + Duration::from_secs(3)).await;
    assert!(bypassed > 0);
    assert!(node.status().freshness_age_ms.is_some_and(|a| a < 1000));
    faulty.hang_publishes(false);
    eventually("the change held and the cache fresh again", async || {
        cache.get(&1).await.as_deref() == Some("b") && age(&node).is_some_and(|a| a < 1000)
    })
    .await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    nodes.shutdown().await;
}
