//! RocketMQ with two master brokers of different names under one name
//! server: the transport makes the topic's queues on both, its publishes go
//! to both (a cache's events to one queue, chosen by its tag), and a
//! subscription reads both. The failover scenarios (one broker killed while
//! events flow) are issue 23's next step; docs/transports.md says where
//! they stand.
#![cfg(feature = "rocketmq")]

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use cache_sync::RocketMqTransport;
use cache_sync::transport::{Delivery, StartFrom, SubscribeOptions, Transport};
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
