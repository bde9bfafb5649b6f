//! Redis transports against a server of the test's own.

use std::time::Duration;

use bytes::Bytes;
use cache_sync::transport::{Delivery, LossReason, Offset, StartFrom, SubscribeOptions, Transport};
use cache_sync::{
    Node, Publisher, SyncedCache,
    transport::{RedisPubSubTransport, RedisStreamsTransport},
};
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

/// A server, a transport on it (100 ms blocking reads) and a reader of topic
/// `t` that has read its one entry, "a".
async fn reader_past_a() -> (
    RedisServer,
    RedisStreamsTransport,
    Box<dyn cache_sync::transport::Subscription>,
) {
    let server = RedisServer::start();
    let transport = RedisStreamsTransport::builder(server.url())
        .block(Duration::from_millis(100))
        .connect()
        .await
        .expect("connect");
    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .expect("subscribe");
    transport
        .publish("t", "c", Bytes::from_static(b"a"))
        .await
        .expect("publish a");
    assert!(matches!(
        sub.next(10).await.expect("read a"),
        Delivery::Batch { .. }
    ));
    (server, transport, sub)
}

/// A trim with nothing published after it is still noticed, on the reader's
/// next idle wake-up, rather than only when a later entry shows the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_notice_a_trim_while_idle() {
    let (server, transport, mut sub) = reader_past_a().await;
    // "b" is published and trimmed before the reader asks again.
    transport
        .publish("t", "c", Bytes::from_static(b"b"))
        .await
        .unwrap();
    let reply = server
        .command(&["XTRIM", "cache-sync:{t}", "MAXLEN", "0"])
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

/// A reader that finds entries trimmed past its position reads on from the
/// stream's newest entry: the node resyncs on the loss, which supersedes
/// every entry before it, and a reader left at the trim's edge would be
/// trimmed again and again while it is behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_read_on_from_the_newest_entry_after_a_trim() {
    let (server, transport, mut sub) = reader_past_a().await;
    // "a" (read) and "b" (not) are trimmed; "c" and "d" are kept, and were
    // added before the loss.
    for payload in ["b", "c", "d"] {
        transport
            .publish("t", "c", Bytes::from(payload))
            .await
            .unwrap();
    }
    let reply = server
        .command(&["XTRIM", "cache-sync:{t}", "MAXLEN", "2"])
        .unwrap();
    assert_eq!(reply, ":2");
    match sub.next(10).await.unwrap() {
        Delivery::Lost(loss) => {
            assert_eq!(loss.reason, LossReason::Trimmed);
            assert_eq!(loss.missed, Some(1));
        }
        other => panic!("expected the trim to be signalled, got {other:?}"),
    }
    transport
        .publish("t", "c", Bytes::from_static(b"e"))
        .await
        .unwrap();
    let mut read = Vec::new();
    while read.is_empty() {
        match tokio::time::timeout(Duration::from_secs(5), sub.next(10))
            .await
            .expect("\"e\" never arrived")
            .unwrap()
        {
            Delivery::Batch { records, .. } => {
                read.extend(records.iter().map(|r| r.payload.clone()));
            }
            other => panic!("expected entries, got {other:?}"),
        }
    }
    assert_eq!(
        read,
        [Bytes::from_static(b"e")],
        "read entries the resync covers"
    );
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
        server
            .command(&["INCRBY", "cache-sync:{t}:n", "0"])
            .unwrap(),
        ":2"
    );
    assert_eq!(server.command(&["DEL", "cache-sync:{t}:n"]).unwrap(), ":1");
    transport.publish("t", "c", Bytes::from("c")).await.unwrap();
    assert_eq!(
        server
            .command(&["INCRBY", "cache-sync:{t}:n", "0"])
            .unwrap(),
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

/// Classic Pub/Sub's freshness tail: a request is reached only once every
/// message acknowledged before it was asked has been delivered, never with
/// an earlier batch; a position of another client (a process before a
/// restart) reaches none of this client's requests; on a sharded
/// subscription there is no tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_tail_is_reached_after_what_was_acknowledged_before_it() {
    let server = RedisServer::start();
    // The subscriber reads through a slow link, so that the messages are
    // still on their way when the request is answered: its PING travels
    // behind them.
    let proxy = integration_tests::proxy::Proxy::start(server.addr()).await;
    // A PONG behind 10,000 messages on a link of 300 ms each way takes
    // longer than the default PING timeout (1 s).
    let transport = RedisPubSubTransport::builder(format!("redis://{}", proxy.addr()))
        .ping_timeout(Duration::from_secs(10))
        .connect()
        .await
        .unwrap();
    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    proxy.latency(Duration::from_millis(300));
    // More than one drain moves at once (4096), all queued before the
    // PONG: so the answer's count takes several rounds. Published in one
    // pipeline, so that the request is answered (its PING sent) while
    // every message is still on its way through the slow link: the
    // subscription answers a request only once its backlog is empty.
    let sent = 10_000usize;
    let mut raw = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut pipe = redis::pipe();
    for i in 0..sent {
        pipe.cmd("PUBLISH")
            .arg("cache-sync:{t}")
            .arg(i.to_string())
            .ignore();
    }
    pipe.query_async::<()>(&mut raw).await.unwrap();
    let tail = transport.tail("t").await.unwrap().expect("a tail");
    // Small batches: the request must wait for the last of them.
    let mut got = 0usize;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            std::time::Instant::now() < deadline,
            "the tail was never reached"
        );
        let next = tokio::time::timeout(Duration::from_secs(5), sub.next(7)).await;
        match next.expect("the subscription stalled").unwrap() {
            Delivery::Batch { records, position } => {
                for r in &records {
                    assert_eq!(r.payload, got.to_string(), "in order");
                    got += 1;
                }
                if transport.covers(&position, &tail) {
                    assert_eq!(
                        got, sent,
                        "the tail was reached with messages before it undelivered"
                    );
                    break;
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // A later request is not reached by the earlier answer.
    let later = transport.tail("t").await.unwrap().expect("a tail");
    let mut reached_at = None;
    while reached_at.is_none() {
        match tokio::time::timeout(Duration::from_secs(5), sub.next(7))
            .await
            .expect("the later request was never answered")
            .unwrap()
        {
            Delivery::Batch { position, .. } if transport.covers(&position, &later) => {
                reached_at = Some(position);
            }
            Delivery::Batch { position, .. } => {
                assert!(position.is_empty() || transport.covers(&position, &tail));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let reached = reached_at.expect("reached");
    assert!(
        transport.covers(&reached, &tail),
        "a later answer reaches the earlier request too"
    );
    // Another client's answer reaches nothing of this one's.
    let other = RedisPubSubTransport::connect(server.url()).await.unwrap();
    let theirs = other.tail("t").await.unwrap().expect("a tail");
    assert!(!transport.covers(&reached, &theirs));
    assert!(!other.covers(&reached, &theirs));

    // Resuming from its own position is a reconnect: a loss first. From
    // another client's (saved by a process before a restart), a start
    // like one with no position: no loss.
    let mut own = transport
        .subscribe(
            "t",
            SubscribeOptions::new(StartFrom::Position(reached.clone())),
        )
        .await
        .unwrap();
    assert!(matches!(own.next(1).await.unwrap(), Delivery::Lost(_)));
    let mut restarted = other
        .subscribe("t", SubscribeOptions::new(StartFrom::Position(reached)))
        .await
        .unwrap();
    other
        .publish("t", "c", Bytes::from_static(b"after"))
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(5), restarted.next(10))
            .await
            .expect("the restarted subscription stalled")
            .unwrap()
        {
            Delivery::Batch { records, .. } if records.iter().any(|r| r.payload == "after") => {
                break;
            }
            Delivery::Batch { .. } => {}
            other => panic!("a restart from another client's position lost nothing: {other:?}"),
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
        .command(&["XTRIM", "cache-sync:{cache-sync}", "MAXLEN", "10"])
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

/// A history that went another way after a node's position, though its
/// epoch and its count live on: a promoted replica (or a server restarted
/// from an append-only file not yet synced) lost the last two entries, and
/// the new server, its clock behind, gave the next two ids before the
/// position's. Read on from the position's id, the first entry after it
/// carries exactly the ordinal expected next, and two events are lost
/// without a word; the resume must see that the position's own entry is
/// gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_notice_a_history_that_went_another_way() {
    use integration_tests::redis_server::Reply;

    let server = RedisServer::start();
    let transport = RedisStreamsTransport::connect(server.url()).await.unwrap();
    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    for i in 1..=10u32 {
        if i >= 9 {
            // Ids a few milliseconds apart: room for others between them.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        transport
            .publish("t", "c", Bytes::from(i.to_string()))
            .await
            .unwrap();
    }
    let mut ids = Vec::new();
    let mut position = None;
    while ids.len() < 10 {
        let Delivery::Batch {
            records,
            position: p,
        } = sub.next(10).await.unwrap()
        else {
            panic!("a loss while reading ten entries");
        };
        ids.extend(records.into_iter().map(|r| match r.offset {
            Some(Offset::Id(id)) => id,
            other => panic!("a record without its id: {other:?}"),
        }));
        position = Some(p);
    }
    drop(sub);
    let position = position.unwrap();
    assert_eq!(position.get("n"), Some(&Offset::Seq(10)));

    // The promoted replica's stream: entries 1 to 8, and its count and
    // last id as of entry 8 (the epoch key is the same).
    let ok = |r: std::io::Result<Reply>| r.expect("query");
    assert_eq!(
        ok(server.query(&["XDEL", "cache-sync:{t}", &ids[8], &ids[9]])),
        Reply::Int(2)
    );
    assert_eq!(
        ok(server.query(&["XSETID", "cache-sync:{t}", &ids[7], "ENTRIESADDED", "8"])),
        Reply::Status("OK".into())
    );
    assert_eq!(
        ok(server.query(&["SET", "cache-sync:{t}:n", "8"])),
        Reply::Status("OK".into())
    );
    // Two new events, ids between entry 8's and the lost entry 10's.
    let epoch = ok(server.query(&["GET", "cache-sync:{t}:e"]))
        .text()
        .unwrap();
    let ms = |id: &str| -> u64 { id.split('-').next().unwrap().parse().unwrap() };
    let base = ms(&ids[7]);
    assert!(base + 2 < ms(&ids[9]), "{ids:?}");
    for (n, at) in [(9, base + 1), (10, base + 2)] {
        let id = format!("{at}-0");
        let (n, payload) = (n.to_string(), format!("new {n}"));
        let reply = ok(server.query(&[
            "XADD",
            "cache-sync:{t}",
            &id,
            "n",
            &n,
            "e",
            &epoch,
            "t",
            "c",
            "p",
            &payload,
        ]));
        assert_eq!(reply.text().as_deref(), Some(id.as_str()));
    }
    assert_eq!(
        ok(server.query(&["SET", "cache-sync:{t}:n", "10"])),
        Reply::Status("OK".into())
    );
    transport
        .publish("t", "c", Bytes::from("new 11"))
        .await
        .unwrap();

    let mut sub = transport
        .subscribe("t", SubscribeOptions::new(StartFrom::Position(position)))
        .await
        .unwrap();
    match sub.next(10).await.unwrap() {
        Delivery::Lost(loss) => assert_eq!(loss.reason, LossReason::HistoryReset),
        Delivery::Batch { records, .. } => panic!(
            "read on past two lost events: {:?}",
            records.iter().map(|r| &r.payload).collect::<Vec<_>>()
        ),
        other => panic!("expected the divergence as a loss, got {other:?}"),
    }
}

/// Streams on a Redis Cluster: a node follows its topic's slot through a
/// master killed (its replica promoted), a slot moved to another master
/// while it reads, and a master paused past the node timeout and resumed
/// stale, applying each newer value, and its heartbeats go round on the
/// cluster too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_a_cluster_follow_a_failover_and_a_slot_move() {
    use integration_tests::redis_cluster::RedisCluster;
    use tokio::task::block_in_place;

    let mut cluster = block_in_place(RedisCluster::start);
    let urls = cluster.urls();
    let connect = async || {
        RedisStreamsTransport::cluster(urls.clone())
            .block(Duration::from_millis(200))
            .response_timeout(Duration::from_secs(2))
            .connect()
            .await
            .expect("connect to the cluster")
    };
    let cache: SyncedCache<String, String> = SyncedCache::new("t", moka::future::Cache::new(100));
    let node = Node::builder("n1", connect().await)
        .heartbeat_interval(Duration::from_millis(100))
        .reconnect_backoff(Duration::from_millis(10), Duration::from_millis(200))
        .register(&cache)
        .start()
        .await
        .expect("start the node");
    let publisher = Publisher::new(connect().await);
    // A publish may fail while the cluster fails over; a user retries.
    let publish = async |v: u64| {
        let value = v.to_string();
        for _ in 0..100 {
            match publisher
                .insert_versioned("t", [("k", value.as_str(), Some(v))])
                .await
            {
                Ok(_) => return,
                Err(e) => {
                    eprintln!("publish {v}: {e}; again");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        panic!("publish {v} failed 100 times");
    };
    // The newest value, or none (a loss answered by invalidating): never
    // an older one.
    let settles_on = async |v: u64| {
        let want = v.to_string();
        eventually(&format!("k = {v}"), async || {
            cache.peek("k").await.as_deref() == Some(want.as_str())
        })
        .await;
    };
    publish(1).await;
    settles_on(1).await;
    eventually("the node's heartbeat heard on the cluster", async || {
        node.cluster()
            .nodes()
            .iter()
            .any(|h| h.node_id == "n1" && h.sent_at_us > 0)
            && node.status().heartbeats_received > 0
    })
    .await;

    let slot = cluster.slot("cache-sync:{cache-sync}");
    let master = cluster.master_of(slot);
    block_in_place(|| cluster.kill(master));
    let promoted = block_in_place(|| cluster.wait_for_new_master(slot, master));
    publish(2).await;
    settles_on(2).await;

    let other = *cluster
        .masters()
        .iter()
        .find(|&&m| m != promoted)
        .expect("another master");
    block_in_place(|| cluster.move_slot(slot, other));
    publish(3).await;
    settles_on(3).await;

    // The slot's master paused past the node timeout: its replica takes
    // over; resumed, the old master is stale until it learns so.
    block_in_place(|| cluster.pause(other));
    block_in_place(|| cluster.wait_for_new_master(slot, other));
    publish(4).await;
    settles_on(4).await;
    block_in_place(|| cluster.resume(other));
    publish(5).await;
    settles_on(5).await;
    block_in_place(|| cluster.wait_whole());
    publish(6).await;
    settles_on(6).await;
    node.shutdown().await.expect("shutdown");
}

/// `redis+cluster://host:port,host:port` (the command-line tool's `--url`)
/// reaches a cluster: Streams, and Pub/Sub sharded by default; a classic
/// publish is not heard by a sharded subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_url_reaches_the_cluster_and_pubsub_is_sharded_there() {
    use integration_tests::redis_cluster::RedisCluster;

    let cluster = RedisCluster::start();
    let hosts: Vec<String> = (0..2)
        .map(|i| format!("127.0.0.1:{}", cluster.server(i).port()))
        .collect();
    let url = format!("redis+cluster://{}/", hosts.join(","));
    let streams = RedisStreamsTransport::connect(url.as_str()).await.unwrap();
    let pubsub = RedisPubSubTransport::connect(url.as_str()).await.unwrap();
    let classic = RedisPubSubTransport::builder(url.as_str())
        .sharded(false)
        .connect()
        .await
        .unwrap();
    let mut from_streams = streams
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    let mut from_pubsub = pubsub
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    classic
        .publish("t", "c", Bytes::from_static(b"classic"))
        .await
        .unwrap();
    streams
        .publish("t", "c", Bytes::from_static(b"s"))
        .await
        .unwrap();
    pubsub
        .publish("t", "c", Bytes::from_static(b"p"))
        .await
        .unwrap();
    let first = |d: Delivery| match d {
        Delivery::Batch { records, .. } => records[0].payload.clone(),
        other => panic!("expected a batch, got {other:?}"),
    };
    assert_eq!(first(from_streams.next(10).await.unwrap()), "s");
    // The sharded subscriber hears the sharded publish, and the classic one
    // published before it never.
    assert_eq!(first(from_pubsub.next(10).await.unwrap()), "p");
    let channel = "cache-sync:{t}";
    let master = cluster.master_of(cluster.slot(channel));
    let reply = cluster
        .server(master)
        .query(&["PUBSUB", "SHARDNUMSUB", channel])
        .unwrap();
    assert!(
        matches!(
            reply.items(),
            [_, integration_tests::redis_server::Reply::Int(1)]
        ),
        "PUBSUB SHARDNUMSUB on the slot's master: {reply:?}"
    );
}

/// A replica of the slot's master takes a bare `SPUBLISH` itself and passes
/// it on over the cluster bus, late, behind what was published on the master
/// since: a publisher whose slot map still named the old master published
/// there after a failover, and its events reached the nodes after a fence
/// published later by another (the conformance suite's stale-master
/// scenario, one run in six). The publish must land on the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_publish_after_a_failover_lands_on_the_new_master() {
    use integration_tests::redis_cluster::RedisCluster;
    use tokio::task::block_in_place;

    let cluster = block_in_place(RedisCluster::start);
    let url = format!("redis+cluster://127.0.0.1:{}/", cluster.server(0).port());
    let pubsub = RedisPubSubTransport::connect(url.as_str()).await.unwrap();
    // The publisher learns the slot map and connects to the slot's master.
    pubsub
        .publish("t", "c", Bytes::from_static(b"before"))
        .await
        .unwrap();
    let channel = "cache-sync:{t}";
    let old = cluster.master_of(cluster.slot(channel));
    let new = cluster.replica_of(old);
    block_in_place(|| cluster.failover(new));
    for i in [old, new] {
        cluster.server(i).command(&["CONFIG", "RESETSTAT"]).unwrap();
    }
    let mut sub = pubsub
        .subscribe("t", SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap();
    pubsub
        .publish("t", "c", Bytes::from_static(b"after"))
        .await
        .unwrap();
    match sub.next(10).await.unwrap() {
        Delivery::Batch { records, .. } => assert_eq!(records[0].payload, "after"),
        other => panic!("expected a batch, got {other:?}"),
    }
    let spublished = |i: usize| {
        let stats = cluster
            .server(i)
            .query(&["INFO", "commandstats"])
            .unwrap()
            .text()
            .unwrap();
        stats
            .lines()
            .find_map(|l| l.strip_prefix("cmdstat_spublish:calls="))
            .map_or(0, |rest| {
                rest.split(',').next().unwrap().parse::<u64>().unwrap()
            })
    };
    assert_eq!(
        spublished(old),
        0,
        "SPUBLISH ran on the old master, now a replica"
    );
    assert_eq!(spublished(new), 1, "SPUBLISH ran once on the new master");
}

/// The entry id a Streams publish returned, as (milliseconds, sequence).
fn entry_id(position: Option<cache_sync::transport::Position>) -> (u64, u64) {
    let position = position.expect("a position");
    let Some(Offset::Id(id)) = position.get("id") else {
        panic!("no entry id in {position}")
    };
    let (ms, seq) = id.split_once('-').expect("an entry id");
    (ms.parse().expect("ms"), seq.parse().expect("seq"))
}

/// Publishes handed over one after another are pipelined: they land in
/// the stream in hand-over order (their entry ids grow), a command refused
/// in the middle fails only its own publish, as the server's refusal (not
/// a disconnect), and a script cache flushed under the transport (as a
/// restarted server has) is loaded again without losing or reordering
/// anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pipelined_publishes_keep_their_order_and_their_own_errors() {
    let server = RedisServer::start();
    let transport = RedisStreamsTransport::connect(server.url()).await.unwrap();
    // The stream key of topic "bad" holds a string: XADD there fails.
    assert_eq!(
        server.command(&["SET", "cache-sync:{bad}", "x"]).unwrap(),
        "+OK"
    );
    for round in 0..2 {
        assert_eq!(server.command(&["SCRIPT", "FLUSH"]).unwrap(), "+OK");
        let mut acks = Vec::new();
        for i in 0..200 {
            let topic = if i == 100 { "bad" } else { "good" };
            let ack = transport
                .start_publish(topic, "c", Bytes::from(format!("{round}-{i}")))
                .await
                .expect("handed over");
            acks.push((topic, ack));
        }
        let mut last = (0, 0);
        for (i, (topic, ack)) in acks.into_iter().enumerate() {
            let result = ack.await;
            if topic == "bad" {
                let e = result.expect_err("XADD on a string");
                assert!(!e.is_disconnected(), "the server answered: {e}");
                continue;
            }
            let id = entry_id(result.unwrap_or_else(|e| panic!("publish {i}: {e}")));
            assert!(id > last, "publish {i} landed at {id:?}, before {last:?}");
            last = id;
        }
    }
    let mut sub = transport
        .subscribe("good", SubscribeOptions::new(StartFrom::Earliest))
        .await
        .unwrap();
    let mut payloads = Vec::new();
    while payloads.len() < 398 {
        match sub.next(1000).await.unwrap() {
            Delivery::Batch { records, .. } => {
                payloads.extend(records.into_iter().map(|r| r.payload));
            }
            other => panic!("{other:?}"),
        }
    }
    let expect: Vec<Bytes> = (0..2)
        .flat_map(|round| {
            (0..200)
                .filter(|&i| i != 100)
                .map(move |i| Bytes::from(format!("{round}-{i}")))
        })
        .collect();
    assert_eq!(payloads, expect, "each once, in hand-over order");
}
