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
