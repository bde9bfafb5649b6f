//! The NATS JetStream transport on a three-server cluster, below the
//! conformance suite: a subscription whose ordered consumer lived on a
//! server that was killed and left dead, while its client stayed connected
//! to another server (so no reconnect ends the subscription).
#![cfg(feature = "nats")]

use std::time::Duration;

use bytes::Bytes;
use cache_sync::transport::NatsJetStreamTransport;
use cache_sync::transport::{Delivery, StartFrom, SubscribeOptions, Subscription, Transport};
use integration_tests::nats_cluster::NatsCluster;

/// How long a node may take to read on after its consumer's server died:
/// a JetStream election (up to about 10 s here), then the subscription's
/// silence check (two `pull_expiry`s, 2 s each) and a request timeout.
const BOUND: Duration = Duration::from_secs(40);

async fn connect(url: String) -> NatsJetStreamTransport {
    NatsJetStreamTransport::builder(url)
        .replicas(3)
        .connect()
        .await
        .expect("connect")
}

/// Reads until `payload` arrives; `Err` if the subscription ends first.
async fn read(sub: &mut Box<dyn Subscription>, payload: &[u8]) -> cache_sync::Result<()> {
    loop {
        if let Delivery::Batch { records, .. } = sub.next(64).await?
            && records.iter().any(|r| r.payload == payload)
        {
            return Ok(());
        }
    }
}

/// The async-nats ordered consumer recreates itself when its server goes,
/// and retries that without end and without a word: with that server
/// killed and left dead, a subscription heard nothing more while the stream
/// went on, and its node reported itself consuming. It must read on, or
/// end (so that the node resumes from its position), within the bound.
/// With the subscription's silence check taken out, this failed in one run
/// of two (the other time the client recovered by itself after 21 s); with
/// it, the node read on 4 to 17 s after the kill in four runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_whose_consumer_died_with_its_server_reads_on() {
    let mut cluster = NatsCluster::start();
    let publisher = connect(cluster.urls()).await;
    // A subscription on a topic (and stream) of its own, its client on one
    // server, until its consumer lives on another.
    let mut found = None;
    for attempt in 0..12 {
        let topic = format!("stall{attempt}");
        publisher
            .publish(&topic, "t", Bytes::from_static(b"first"))
            .await
            .expect("publish");
        let via = attempt % cluster.len();
        let reader = connect(cluster.url_of(via)).await;
        let sub = reader
            .subscribe(&topic, SubscribeOptions::new(StartFrom::Latest))
            .await
            .expect("subscribe");
        let hosts = cluster.consumer_hosts(&format!("cache-sync_{topic}"));
        assert_eq!(hosts.len(), 1, "one consumer of a new stream: {hosts:?}");
        if hosts[0] != via {
            found = Some((topic, reader, sub, hosts[0]));
            break;
        }
    }
    let (topic, reader, mut sub, host) =
        found.expect("in 12 tries, a consumer on another server than its client's");

    tokio::task::block_in_place(|| cluster.kill(host));
    eprintln!("server {host}, which held the consumer, killed");
    let started = tokio::time::Instant::now();
    // Publishes resume once the stream has a new leader.
    loop {
        match publisher
            .publish(&topic, "t", Bytes::from_static(b"after"))
            .await
        {
            Ok(_) => break,
            Err(e) => {
                assert!(started.elapsed() < BOUND, "publishes kept failing: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    let read_on = tokio::time::timeout_at(started + BOUND, async {
        if let Err(ended) = read(&mut sub, b"after").await {
            // Ended: the node resumes from its position, as it does.
            eprintln!("the subscription ended: {ended}");
            let position = sub.position().expect("a position");
            loop {
                let resumed = reader
                    .subscribe(
                        &topic,
                        SubscribeOptions::new(StartFrom::Position(position.clone())),
                    )
                    .await;
                match resumed {
                    Ok(mut again) => {
                        if read(&mut again, b"after").await.is_ok() {
                            return;
                        }
                    }
                    Err(e) => eprintln!("resubscribing: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    })
    .await;
    assert!(
        read_on.is_ok(),
        "nothing read and no end {BOUND:?} after the consumer's server was killed"
    );
    eprintln!("read on {:?} after the kill", started.elapsed());
}

/// One server cut from its two peers (its routes blackholed, nothing
/// closed), while a bounded node reads through it and a writer writes
/// through another: the node cannot prove its topic's tail through a
/// server out of the quorum, so past its bound (1 s) its reads go to the
/// source; no read returns a value replaced more than the bound (plus one
/// proof interval and scheduling slack) before it began. After the heal,
/// the node holds the last value or nothing, and is ready again. The cut server leads
/// neither the stream nor the JetStream meta group when cut: what a leader
/// cut off with a minority answers until it steps down is not judged here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_cut_from_its_peers_puts_its_readers_past_their_bound() {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use cache_sync::{Node, Publisher, SyncedCache};

    const MAX: Duration = Duration::from_secs(1);
    const SLACK: Duration = Duration::from_millis(350);
    let (cluster, links) = NatsCluster::start_with_route_proxies().await;
    // The default topic, which the publisher and the node use.
    let topic = "cache-sync";
    let writer_transport = NatsJetStreamTransport::builder(cluster.url_of(1))
        .replicas(3)
        .connect()
        .await
        .expect("connect");
    let publisher = Publisher::new(writer_transport);
    publisher.insert("t", [("k", 0u64)]).await.expect("publish");
    let stream = format!("cache-sync_{topic}");
    // The server to cut: neither the stream's leader nor the meta leader.
    let leader = cluster.stream_leader(&stream).expect("a stream leader");
    let cut = (0..cluster.len())
        .find(|&i| i != leader && !cluster.is_meta_leader(i))
        .expect("a follower");
    let reader_transport = NatsJetStreamTransport::builder(cluster.url_of(cut))
        .replicas(3)
        .connect()
        .await
        .expect("connect");
    let cache: SyncedCache<String, u64> = SyncedCache::builder("t", moka::future::Cache::new(10))
        .max_staleness(MAX)
        .build()
        .unwrap();
    let node = Node::builder("n", reader_transport)
        .freshness_interval(Duration::from_millis(100))
        .register(&cache)
        .start()
        .await
        .unwrap();

    // The source, and when each value's publish was acknowledged.
    let db = Arc::new(Mutex::new(0u64));
    let acked: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (db, acked, stop) = (db.clone(), acked.clone(), stop.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                *db.lock().unwrap() = i;
                // Unacknowledged while the stream elects: retried with the
                // next value.
                if publisher.insert("t", [("k", i)]).await.is_ok() {
                    acked.lock().unwrap().push((Instant::now(), i));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let reads = std::cell::Cell::new(0usize);
    let bypassed = std::cell::Cell::new(0usize);
    let judge = async |until: Instant| {
        while Instant::now() < until {
            let began = Instant::now();
            let mut loaded = false;
            let got = cache
                .get_with("k".to_owned(), || {
                    loaded = true;
                    let v = *db.lock().unwrap();
                    async move { v }
                })
                .await;
            reads.set(reads.get() + 1);
            bypassed.set(bypassed.get() + usize::from(loaded));
            let must = acked
                .lock()
                .unwrap()
                .iter()
                .rev()
                .find(|(at, _)| *at + MAX + SLACK < began)
                .map_or(0, |(_, v)| *v);
            assert!(
                got >= must,
                "read {got}, but {must} had replaced it more than {MAX:?} before the read"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    judge(Instant::now() + Duration::from_secs(3)).await;
    eprintln!("cutting server {cut} (stream leader {leader}) from its peers");
    links.isolate(cut);
    let cut_at = Instant::now();
    judge(cut_at + Duration::from_secs(10)).await;
    assert!(!node.is_ready(), "past its bound, not ready");
    let during = bypassed.get();
    links.heal();
    judge(Instant::now() + Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    writer.await.unwrap();
    assert!(during > 0, "no read went to the source during the cut");
    // After the heal: ready, within the bound, and holding the last value
    // or nothing (a refresh in a quarantine after a loss lands as an
    // invalidation).
    // How long a node takes to read on after a NATS cluster's fault is
    // issue 40's (up to 26 s measured after a server's death, and a full
    // test run's load adds to it: 40 s did not suffice in one): here only
    // that it does, and then holds nothing stale.
    let last = *db.lock().unwrap();
    let healed = Instant::now();
    let deadline = healed + Duration::from_secs(120);
    loop {
        // Until it has caught up it may hold what it held at the cut (its
        // reads go to the source meanwhile: judged above).
        let held = cache.peek(&"k".to_owned()).await;
        if node.is_ready() && held.is_none_or(|v| v == last) {
            break;
        }
        let status = node.status();
        assert!(
            Instant::now() < deadline,
            "120 s after the heal: holds {held:?} of {last}, ready {}, consuming {}, freshness {:?} ms, losses {}",
            node.is_ready(),
            status.consuming,
            status.freshness_age_ms,
            status.losses
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "{} reads, {} to the source; losses {}; ready {:?} after the heal",
        reads.get(),
        bypassed.get(),
        node.status().losses,
        healed.elapsed()
    );
    node.shutdown().await.unwrap();
}
