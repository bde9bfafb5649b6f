//! NATS JetStream transport details the conformance suite does not reach.
#![cfg(feature = "nats")]

use bytes::Bytes;
use cache_sync::{ChangeBus, Delivery, NatsJetStreamBus, StartFrom, SubscribeOptions};
use integration_tests::nats_server::NatsServer;

/// The bus remembers which streams it made, instead of asking the server on
/// every publish. A stream deleted behind its back must not turn every later
/// publish into an error: the next one makes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_recreates_a_stream_deleted_behind_its_back() {
    let server = NatsServer::start();
    let bus = NatsJetStreamBus::connect(server.url()).await.unwrap();
    bus.publish("t", "c", Bytes::from_static(b"first"))
        .await
        .unwrap();

    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let names: Vec<String> = {
        use futures_util::TryStreamExt;
        js.stream_names().try_collect().await.unwrap()
    };
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(js.delete_stream(&names[0]).await.unwrap().success);

    bus.publish("t", "c", Bytes::from_static(b"second"))
        .await
        .expect("the publish after the deletion makes the stream again");
    let mut sub = bus
        .subscribe("t", SubscribeOptions::new(StartFrom::Earliest))
        .await
        .unwrap();
    match sub.next(10).await.unwrap() {
        Delivery::Batch { records, .. } => {
            let payloads: Vec<_> = records.iter().map(|r| r.payload.clone()).collect();
            assert_eq!(payloads, [Bytes::from_static(b"second")]);
        }
        other => panic!("expected the second message, got {other:?}"),
    }
}
