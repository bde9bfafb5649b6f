//! Redis transports against a server of the test's own.

use std::time::Duration;

use bytes::Bytes;
use cache_sync::{
    ChangeBus, Delivery, LossReason, Node, Publisher, RedisPubSubBus, RedisStreamsBus, StartFrom,
    SubscribeOptions, SyncedCache,
};
use integration_tests::eventually;
use integration_tests::redis_server::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_round_trip_and_resume_after_a_broker_restart() {
    let mut server = RedisServer::start();
    let bus = RedisStreamsBus::builder(server.url())
        .block(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let cache: SyncedCache<String, String> = SyncedCache::new("t", moka::future::Cache::new(100));
    let node = Node::builder("n1", bus.clone())
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(200))
        .register(&cache)
        .start()
        .await
        .unwrap();
    let p = Publisher::new(bus.clone());
    p.refresh("t", [("a", "1")]).await.unwrap();
    eventually("a applied", async || {
        cache.peek(&"a".into()).await.as_deref() == Some("1")
    })
    .await;
    server.restart();
    let p = Publisher::new(RedisStreamsBus::connect(server.url()).await.unwrap());
    p.refresh("t", [("b", "2")]).await.unwrap();
    eventually("b applied after restart", async || {
        cache.peek(&"b".into()).await.as_deref() == Some("2")
    })
    .await;
    let s = node.status();
    assert_eq!(s.losses, 0, "{s:?}");
    assert!(s.transport_errors >= 1, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_round_trip_and_a_dropped_connection_is_a_loss() {
    let server = RedisServer::start();
    let bus = RedisPubSubBus::builder(server.url())
        .ping_interval(Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let cache: SyncedCache<String, String> = SyncedCache::new("t", moka::future::Cache::new(100));
    let node = Node::builder("n1", bus.clone())
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(200))
        .register(&cache)
        .start()
        .await
        .unwrap();
    let p = Publisher::new(bus.clone());
    p.refresh("t", [("a", "1")]).await.unwrap();
    eventually("a applied", async || {
        cache.peek(&"a".into()).await.as_deref() == Some("1")
    })
    .await;
    assert!(server.kill_clients("pubsub") >= 1);
    eventually("loss signalled", async || node.status().losses >= 1).await;
    assert_eq!(cache.peek(&"a".into()).await, None);
    eprintln!("status after loss: {:?}", node.status());
    // The node subscribes again and hears what comes next.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut i = 0;
    while cache.peek(&"b".into()).await.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "never resubscribed: {:?}",
            node.status()
        );
        i += 1;
        p.refresh("t", [("b", format!("{i}"))]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A trim with nothing published after it is still noticed, on the reader's
/// next idle wake-up, rather than only when a later entry shows the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_notice_a_trim_while_idle() {
    let server = RedisServer::start();
    let bus = RedisStreamsBus::builder(server.url())
        .block(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let mut sub = bus
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    bus.publish("t", "c", Bytes::from_static(b"a"))
        .await
        .unwrap();
    assert!(matches!(
        sub.next(10).await.unwrap(),
        Delivery::Batch { .. }
    ));
    // "b" is published and trimmed before the reader asks again.
    bus.publish("t", "c", Bytes::from_static(b"b"))
        .await
        .unwrap();
    let reply = server
        .command(&["XTRIM", "cache-sync:t", "MAXLEN", "0"])
        .unwrap();
    assert_eq!(reply, ":2");
    let next = tokio::time::timeout(Duration::from_secs(5), sub.next(10)).await;
    match next.expect("the trim went unnoticed while idle").unwrap() {
        Delivery::Lost(loss) => {
            assert_eq!(loss.reason, LossReason::Trimmed);
            assert_eq!(loss.missed, Some(1));
        }
        other => panic!("expected the trim to be signalled, got {other:?}"),
    }
}
