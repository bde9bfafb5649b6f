//! RocketMQ with two master brokers of different names under one name
//! server: the transport makes the topic's queues on both, its publishes go
//! to both (a cache's events to one queue, chosen by its tag), and a
//! subscription reads both; with one broker down, publishes move to the
//! other and subscriptions read it, until the broker returns. The failover
//! scenarios with nodes (one broker killed while events flow, back on its
//! store or without it) are the conformance suite's `rocketmq_brokers`.
#![cfg(feature = "rocketmq")]

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use cache_sync::transport::RocketMqTransport;
use cache_sync::transport::{
    Delivery, Position, StartFrom, SubscribeOptions, Subscription, Transport,
};
use integration_tests::rocketmq_server::RocketMqServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_spans_both_brokers_and_a_subscription_reads_both() {
    let server = RocketMqServer::start_with_brokers(2);
    assert_eq!(server.brokers(), 2);
    let transport = RocketMqTransport::builder(server.namesrv_addr())
        .queues_per_topic(1)
        .connect()
        .await
        .expect("connect");
    let mut sub = transport
        .subscribe("two-brokers", SubscribeOptions::new(StartFrom::Latest))
        .await
        .expect("subscribe");
    let mut brokers = BTreeSet::new();
    let tags: Vec<String> = (0..16).map(|i| format!("cache-{i}")).collect();
    for tag in &tags {
        let position = transport
            .publish("two-brokers", tag, Bytes::from(tag.clone()))
            .await
            .expect("publish")
            .expect("a RocketMQ publish says where it went");
        for (partition, _) in position.iter() {
            let broker = partition.split(':').next().unwrap_or_default().to_owned();
            brokers.insert(broker);
        }
    }
    let expected: BTreeSet<String> = (0..2)
        .map(|i| server.broker_name_of(i).to_owned())
        .collect();
    assert_eq!(
        brokers, expected,
        "16 caches' events hash over the queues of both brokers"
    );
    let mut got = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while got.len() < tags.len() {
        let next = tokio::time::timeout_at(deadline, sub.next(64))
            .await
            .expect("every event read within 60 s");
        match next.expect("subscription") {
            Delivery::Batch { records, .. } => {
                got.extend(
                    records
                        .into_iter()
                        .map(|r| String::from_utf8_lossy(&r.payload).into_owned()),
                );
            }
            other => panic!("expected events, got {other:?}"),
        }
    }
    assert_eq!(got, tags.into_iter().collect::<BTreeSet<_>>());
}

/// The broker a publish went to.
fn broker_of(position: &Position) -> String {
    let (partition, _) = position.iter().next().expect("one queue");
    partition.split(':').next().unwrap_or_default().to_owned()
}

/// Reads until `payload` arrives.
async fn read_until(sub: &mut Box<dyn Subscription>, payload: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let next = tokio::time::timeout_at(deadline, sub.next(64))
            .await
            .unwrap_or_else(|_| panic!("{payload} read within 60 s"));
        if let Delivery::Batch { records, .. } = next.expect("subscription")
            && records.iter().any(|r| r.payload == payload.as_bytes())
        {
            return;
        }
    }
}

/// Reads until the subscription ends, within `bound`; returns why.
async fn read_until_it_ends(
    sub: &mut Box<dyn Subscription>,
    what: &str,
    bound: Duration,
) -> cache_sync::Error {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        match tokio::time::timeout_at(deadline, sub.next(64)).await {
            Err(_) => panic!("the subscription did not end within {bound:?} after {what}"),
            Ok(Err(e)) => return e,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_one_broker_down_publishes_move_and_subscriptions_read_the_other() {
    let mut server = RocketMqServer::start_with_brokers(2);
    let transport = RocketMqTransport::builder(server.namesrv_addr())
        .queues_per_topic(1)
        .connect()
        .await
        .expect("connect");
    let topic = "one-broker-down";
    // A cache whose queue is on the first broker.
    let mut tag = None;
    for i in 0..16 {
        let t = format!("cache-{i}");
        let p = transport
            .publish(topic, &t, Bytes::from_static(b"probe"))
            .await
            .expect("publish")
            .expect("a position");
        if broker_of(&p) == server.broker_name_of(0) {
            tag = Some(t);
            break;
        }
    }
    let tag = tag.expect("one of 16 caches hashes to the first broker");
    let mut sub = transport
        .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
        .await
        .expect("subscribe");
    transport
        .publish(topic, &tag, Bytes::from_static(b"before"))
        .await
        .expect("publish");
    read_until(&mut sub, "before").await;
    let position = sub.position().expect("a position");

    server.kill_broker(0);
    let ended = read_until_it_ends(&mut sub, "its broker was killed", Duration::from_secs(5)).await;
    assert!(ended.is_disconnected(), "{ended}");
    // The cache's events go to the other broker now.
    let moved = transport
        .publish(topic, &tag, Bytes::from_static(b"moved"))
        .await
        .expect("a publish while one broker is down")
        .expect("a position");
    assert_eq!(broker_of(&moved), server.broker_name_of(1));
    // A subscription from the position reads the broker that answers, and
    // keeps the dead one's place.
    let mut sub = transport
        .subscribe(
            topic,
            SubscribeOptions::new(StartFrom::Position(position.clone())),
        )
        .await
        .expect("a subscription while one broker is down");
    read_until(&mut sub, "moved").await;
    let kept = sub.position().expect("a position");
    let dead = format!("{}:0", server.broker_name_of(0));
    assert_eq!(kept.get(&dead), position.get(&dead), "{kept:?}");

    // Back on its store: the subscription ends, to read it from that place,
    // once the broker accepts connections and the name server lists it
    // (polled every half second). Without that watch it ends only when the
    // client's own route, refreshed every 30 s, offers the queue's messages.
    server.restart_broker(0);
    let ended = read_until_it_ends(&mut sub, "the broker returned", Duration::from_secs(15)).await;
    assert!(!ended.is_disconnected(), "{ended}");
    let mut sub = transport
        .subscribe(topic, SubscribeOptions::new(StartFrom::Position(kept)))
        .await
        .expect("a subscription with both brokers");
    let next = tokio::time::timeout(Duration::from_secs(10), sub.next(64)).await;
    if let Ok(Ok(Delivery::Lost(loss))) = next {
        panic!("the broker kept its store: {loss:?}");
    }
}

/// A broker that comes back without its store counts its queues from 0
/// again, so a node's old offsets pass its new queue ends; RocketMQ names
/// no history in them. Until the node has started a subscription on the
/// new store (and signalled what it lost there), no bound asked after the
/// wipe may be proved: the node never read what the new store holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_brokers_return_proves_no_bound_until_the_node_has_read_its_new_store() {
    use cache_sync::{Node, Publisher, SyncedCache};

    let mut server = RocketMqServer::start();
    let namesrv = server.namesrv_addr();
    let transport = || one_queue_transport(&namesrv);
    let cache: SyncedCache<String, String> =
        SyncedCache::new("fresh", moka::future::Cache::new(100));
    let node = Node::builder("wiped", transport().await)
        .topic("wiped-return")
        .freshness_interval(Duration::from_millis(20))
        // Seconds between re-subscriptions: the broker is back, and the
        // tails read it, long before the node subscribes to it again (past
        // the 5 s a tail request left hanging by the broker's death may
        // take to give up).
        .reconnect_backoff(Duration::from_secs(8), Duration::from_secs(8))
        .register(&cache)
        .start()
        .await
        .expect("node");
    let publisher = Publisher::builder(transport().await)
        .topic("wiped-return")
        .build()
        .expect("publisher");
    // Thirty events: the queue's offset, 30, is past what the wiped
    // broker will hold.
    for i in 0..30 {
        publisher
            .insert("fresh", [("k", format!("v{i}"))])
            .await
            .expect("publish");
    }
    let waited = tokio::time::Instant::now();
    while cache.peek("k").await.as_deref() != Some("v29")
        || node.status().freshness_age_ms.is_none_or(|a| a > 1000)
    {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "v29 applied and a young bound"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let losses = node.status().losses;

    let wiped = tokio::time::Instant::now();
    server.wipe();
    // On the new store, made again by a new client with the same single
    // queue (a send alone would have the broker make it with its default
    // queue count, which the node's position would not cover anyway):
    // offset 0 of a new queue, which the old offset 30 passes.
    let publisher = Publisher::builder(transport().await)
        .topic("wiped-return")
        .build()
        .expect("publisher");
    insert_within_a_minute(&publisher, "after").await;
    // Until the node signals the loss, every bound it shows was asked
    // before the wipe (its age at least the time since; the age is in
    // whole milliseconds).
    let mut samples = 0u32;
    loop {
        let since = wiped.elapsed();
        let status = node.status();
        if status.losses > losses {
            break;
        }
        if let Some(age) = status.freshness_age_ms {
            assert!(
                u128::from(age) + 2 >= since.as_millis(),
                "a bound asked {} ms after the wipe was proved before the node read the new \
                 store (sample {samples})",
                since.as_millis().saturating_sub(u128::from(age))
            );
        }
        samples += 1;
        assert!(
            since < Duration::from_secs(90),
            "no loss signalled 90 s after the wipe"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "loss signalled {:?} after the wipe, {samples} samples before it",
        wiped.elapsed()
    );
    // The loss cleared the cache (what the new store held before the node
    // read it is answered by that, not replayed): nothing of the old
    // history is left. Then the node proves again, and takes what comes.
    assert_ne!(
        cache.peek("k").await.as_deref(),
        Some("v29"),
        "the old value survived the loss"
    );
    insert_within_a_minute(&publisher, "later").await;
    let waited = tokio::time::Instant::now();
    while cache.peek("k").await.as_deref() != Some("later")
        || node.status().freshness_age_ms.is_none_or(|a| a > 1000)
    {
        assert!(
            waited.elapsed() < Duration::from_secs(60),
            "the value published after the loss, and a young bound: {:?}, age {:?}",
            cache.peek("k").await,
            node.status().freshness_age_ms
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    node.shutdown().await.expect("shutdown");
}

/// Publishes `k` = `value` to cache `fresh`, retrying while the broker is
/// not yet taking sends (back from a wipe) for up to a minute.
async fn insert_within_a_minute(publisher: &cache_sync::Publisher, value: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match publisher.insert("fresh", [("k", value)]).await {
            Ok(_) => return,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "publish {value}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A client of the name server at `namesrv` whose topics have one queue.
async fn one_queue_transport(namesrv: &str) -> std::sync::Arc<RocketMqTransport> {
    std::sync::Arc::new(
        RocketMqTransport::builder(namesrv)
            .queues_per_topic(1)
            .connect()
            .await
            .expect("connect"),
    )
}
