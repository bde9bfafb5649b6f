//! Redis transports against a server of the test's own.

use std::time::Duration;

use bytes::Bytes;
use cache_sync::transport::{Delivery, LossReason, Offset, StartFrom, SubscribeOptions, Transport};
use cache_sync::{Node, Publisher, RedisPubSubTransport, RedisStreamsTransport, SyncedCache};
use integration_tests::eventually;
use integration_tests::redis_server::RedisServer;

/// A node with one cache, "t", that re-subscribes quickly, once it has
/// applied a first refresh (`a` = `1`) published on `transport`.
async fn node_with_a_applied(
    transport: impl Transport + Clone,
) -> (SyncedCache<String, String>, Node) {
    let cache: SyncedCache<String, String> = SyncedCache::new("t", moka::future::Cache::new(100));
    let node = Node::builder("n1", transport.clone())
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(200))
        .register(&cache)
        .start()
        .await
        .expect("start the node");
    Publisher::new(transport)
        .insert("t", [("a", "1")])
        .await
        .expect("publish a");
    eventually("a applied", async || {
        cache.peek("a").await.as_deref() == Some("1")
    })
    .await;
    (cache, node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_round_trip_and_resume_after_a_broker_restart() {
    let mut server = RedisServer::start();
    let transport = RedisStreamsTransport::builder(server.url())
        .block(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let (cache, node) = node_with_a_applied(transport.clone()).await;
    server.restart();
    let p = Publisher::new(RedisStreamsTransport::connect(server.url()).await.unwrap());
    p.insert("t", [("b", "2")]).await.unwrap();
    eventually("b applied after restart", async || {
        cache.peek("b").await.as_deref() == Some("2")
    })
    .await;
    let s = node.status();
    assert_eq!(s.losses, 0, "{s:?}");
    assert!(s.transport_errors >= 1, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_round_trip_and_a_dropped_connection_is_a_loss() {
    let server = RedisServer::start();
    let transport = RedisPubSubTransport::builder(server.url())
        .ping_interval(Duration::from_millis(50))
        .connect()
        .await
        .unwrap();
    let (cache, node) = node_with_a_applied(transport.clone()).await;
    let p = Publisher::new(transport);
    assert!(server.kill_clients("pubsub") >= 1);
    eventually("loss signalled", async || node.status().losses >= 1).await;
    assert_eq!(cache.peek("a").await, None);
    eprintln!("status after loss: {:?}", node.status());
    // The node subscribes again and hears what comes next.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut i = 0;
    while cache.peek("b").await.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "never resubscribed: {:?}",
            node.status()
        );
        i += 1;
        p.insert("t", [("b", format!("{i}"))]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A trim with nothing published after it is still noticed, on the reader's
/// next idle wake-up, rather than only when a later entry shows the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_notice_a_trim_while_idle() {
    let server = RedisServer::start();
    let transport = RedisStreamsTransport::builder(server.url())
        .block(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    transport
        .publish("t", "c", Bytes::from_static(b"a"))
        .await
        .unwrap();
    assert!(matches!(
        sub.next(10).await.unwrap(),
        Delivery::Batch { .. }
    ));
    // "b" is published and trimmed before the reader asks again.
    transport
        .publish("t", "c", Bytes::from_static(b"b"))
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

/// The ordinal counter next to the stream can go missing (evicted, deleted,
/// or a stream written before it existed); numbering then continues from the
/// stream's own `entries-added`, so readers see no false gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_ordinals_continue_without_their_counter() {
    let server = RedisServer::start();
    let transport = RedisStreamsTransport::connect(server.url()).await.unwrap();
    for payload in ["a", "b"] {
        transport
            .publish("t", "c", Bytes::from(payload))
            .await
            .unwrap();
    }
    assert_eq!(
        server.command(&["INCRBY", "cache-sync:t:n", "0"]).unwrap(),
        ":2"
    );
    assert_eq!(server.command(&["DEL", "cache-sync:t:n"]).unwrap(), ":1");
    transport.publish("t", "c", Bytes::from("c")).await.unwrap();
    assert_eq!(
        server.command(&["INCRBY", "cache-sync:t:n", "0"]).unwrap(),
        ":3"
    );

    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
        .await
        .unwrap();
    let Delivery::Batch { records, position } = sub.next(10).await.unwrap() else {
        panic!("expected the three entries, not a loss");
    };
    // Three records, and the third carries ordinal 3: the subscription
    // checks that ordinals run on by one, or it would have reported a loss.
    assert_eq!(records.len(), 3);
    assert_eq!(position.get("n"), Some(&Offset::Seq(3)));
    assert!(
        records
            .iter()
            .all(|r| matches!(&r.offset, Some(Offset::Id(id)) if id.contains('-'))),
        "each record names its entry id"
    );
}

/// The `redis` crate queues Pub/Sub messages without bound; a node that takes
/// them slower than they come must hit the subscription's own limit, drop
/// the backlog, signal the loss, and carry on with what follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_backlog_past_its_limit_is_an_overflow_loss() {
    let server = RedisServer::start();
    let transport = RedisPubSubTransport::builder(server.url())
        .max_backlog_bytes(64 << 10)
        .connect()
        .await
        .unwrap();
    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    let kib = Bytes::from(vec![7u8; 1024]);
    // Publish faster than the reader takes (one record per round), until
    // the backlog passes 64 KiB (the smallest limit); how fast messages land in the client's queue
    // does not matter, only that they pile up.
    let mut lost = None;
    for _ in 0..50 {
        for _ in 0..10 {
            transport.publish("t", "c", kib.clone()).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        match tokio::time::timeout(Duration::from_secs(5), sub.next(1))
            .await
            .expect("the subscription stalled")
            .unwrap()
        {
            Delivery::Lost(loss) => {
                lost = Some(loss);
                break;
            }
            Delivery::Batch { records, .. } => assert_eq!(records.len(), 1),
            other => panic!("unexpected {other:?}"),
        }
    }
    let loss = lost.expect("a backlog of 500 KiB against a 64 KiB limit was never signalled");
    assert_eq!(loss.reason, LossReason::Overflow);
    assert!(loss.missed.is_some_and(|n| n >= 50), "{loss:?}");

    transport
        .publish("t", "c", Bytes::from_static(b"after"))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    'found: loop {
        assert!(
            std::time::Instant::now() < deadline,
            "nothing after the loss"
        );
        let next = tokio::time::timeout(Duration::from_secs(5), sub.next(256)).await;
        match next.expect("the subscription stalled").unwrap() {
            Delivery::Batch { records, .. } => {
                if records.iter().any(|r| r.payload == "after") {
                    break 'found;
                }
            }
            other => panic!("a second loss: {other:?}"),
        }
    }
}

/// Reads `n` records (no loss) from `sub`; returns its position after them.
async fn read(
    sub: &mut Box<dyn cache_sync::transport::Subscription>,
    n: usize,
) -> cache_sync::transport::Position {
    let mut got = 0;
    let mut position = None;
    while got < n {
        match sub.next(n - got).await.expect("read") {
            Delivery::Batch {
                records,
                position: p,
            } => {
                got += records.len();
                position = Some(p);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    position.expect("read something")
}

/// A stream that lost its history and grew a new one whose ordinals line up
/// with a reader's position (the new stream was trimmed so that its oldest
/// entry is exactly the next ordinal the reader expects): ids and ordinals
/// look contiguous, and only the epoch tells the histories apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_a_wiped_history_is_caught_even_when_ordinals_line_up() {
    let mut server = RedisServer::start();
    let transport = RedisStreamsTransport::builder(server.url())
        .block(Duration::from_millis(100))
        .connect()
        .await
        .unwrap();
    let p = Publisher::new(transport.clone());
    for i in 0..10u32 {
        p.insert("t", [(i, i)]).await.unwrap();
    }
    let mut sub = transport
        .subscribe("cache-sync", SubscribeOptions::new(StartFrom::Earliest))
        .await
        .unwrap();
    let position = read(&mut sub, 10).await;
    assert_eq!(position.get("n"), Some(&Offset::Seq(10)));
    drop(sub);

    server.wipe();
    let p = Publisher::new(RedisStreamsTransport::connect(server.url()).await.unwrap());
    for i in 0..20u32 {
        p.insert("t", [(i, i)]).await.unwrap();
    }
    // Keep ordinals 11..=20: the next one the old reader expects comes first.
    let reply = server
        .command(&["XTRIM", "cache-sync:cache-sync", "MAXLEN", "10"])
        .unwrap();
    assert_eq!(reply, ":10");

    let transport = RedisStreamsTransport::connect(server.url()).await.unwrap();
    let mut sub = transport
        .subscribe(
            "cache-sync",
            SubscribeOptions::new(StartFrom::Position(position)),
        )
        .await
        .unwrap();
    match sub.next(100).await.unwrap() {
        Delivery::Lost(loss) => assert_eq!(loss.reason, LossReason::HistoryReset),
        other => panic!("resumed inside another history as if nothing happened: {other:?}"),
    }
}

/// The Redis Cluster harness itself: a killed master's replica takes over
/// its slots with what it acknowledged, the old master rejoins as a
/// replica, a manual failover swaps them back, a paused master is failed
/// over and comes back a replica, and a slot moves with its keys.
#[test]
fn the_cluster_harness_fails_over_and_moves_a_slot() {
    use integration_tests::redis_cluster::RedisCluster;
    use integration_tests::redis_server::Reply;

    let mut cluster = RedisCluster::start();
    assert_eq!(cluster.masters().len(), 3);
    let key = "{cache-sync}:probe";
    let slot = cluster.slot(key);
    let master = cluster.master_of(slot);
    let replica = cluster.replica_of(master);
    let on = |c: &RedisCluster, i: usize, args: &[&str]| c.server(i).query(args).expect("query");
    assert_eq!(
        on(&cluster, master, &["SET", key, "1"]),
        Reply::Status("OK".into())
    );
    // Replication is asynchronous: wait for the replica to have it.
    assert_eq!(on(&cluster, master, &["WAIT", "1", "5000"]), Reply::Int(1));

    cluster.kill(master);
    let promoted = cluster.wait_for_new_master(slot, master);
    assert_eq!(promoted, replica);
    assert_eq!(
        on(&cluster, promoted, &["GET", key]),
        Reply::Bulk(Some(b"1".to_vec()))
    );
    cluster.restart(master);
    cluster.wait_whole();
    assert_eq!(
        cluster.replica_of(promoted),
        master,
        "the old master rejoins as a replica"
    );

    cluster.failover(master);
    cluster.wait_whole();
    assert_eq!(cluster.master_of(slot), master);

    cluster.pause(master);
    let promoted = cluster.wait_for_new_master(slot, master);
    cluster.resume(master);
    cluster.wait_whole();
    assert_eq!(
        cluster.replica_of(promoted),
        master,
        "the stale master turns replica"
    );

    let other = *cluster
        .masters()
        .iter()
        .find(|&&m| m != promoted)
        .expect("another master");
    cluster.move_slot(slot, other);
    assert_eq!(cluster.master_of(slot), other);
    assert_eq!(
        on(&cluster, other, &["GET", key]),
        Reply::Bulk(Some(b"1".to_vec()))
    );
    match on(&cluster, promoted, &["GET", key]) {
        Reply::Error(e) => assert!(e.starts_with("MOVED"), "{e}"),
        r => panic!("the old owner still answers: {r:?}"),
    }
}
