//! NATS JetStream transport details the conformance suite does not reach.
#![cfg(feature = "nats")]

use bytes::Bytes;
use cache_sync::transport::NatsJetStreamTransport;
use cache_sync::transport::{Delivery, StartFrom, SubscribeOptions, Transport};
use integration_tests::nats_server::NatsServer;

/// The transport remembers which streams it made, instead of asking the server on
/// every publish. A stream deleted behind its back must not turn every later
/// publish into an error: the next one makes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_recreates_a_stream_deleted_behind_its_back() {
    let server = NatsServer::start();
    let transport = NatsJetStreamTransport::connect(server.url()).await.unwrap();
    transport
        .publish("t", "c", Bytes::from_static(b"first"))
        .await
        .unwrap();

    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    let names: Vec<String> = {
        use futures_util::TryStreamExt;
        js.stream_names().try_collect().await.unwrap()
    };
    assert_eq!(names.len(), 1, "{names:?}");
    assert!(js.delete_stream(&names[0]).await.unwrap().success);

    transport
        .publish("t", "c", Bytes::from_static(b"second"))
        .await
        .expect("the publish after the deletion makes the stream again");
    let mut sub = transport
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

/// A stream with the topic's name that belongs to something else (other
/// subjects) is refused, not read or written; and the error says so truthfully:
/// the server is up and answered, so it is no disconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_the_name_with_other_subjects_is_refused_truthfully() {
    let server = NatsServer::start();
    let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "cache-sync_orders".into(),
        subjects: vec!["someone.else.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let transport = NatsJetStreamTransport::connect(server.url()).await.unwrap();
    let err = transport
        .publish("orders", "c", Bytes::from_static(b"x"))
        .await
        .expect_err("published into another application's stream");
    assert!(err.is_config() && !err.is_disconnected(), "{err}");
    assert!(err.to_string().contains("someone.else.>"), "{err}");
    let err = transport
        .subscribe("orders", SubscribeOptions::new(StartFrom::Latest))
        .await
        .expect_err("subscribed to another application's stream");
    assert!(err.is_config(), "{err}");

    // A topic of another name is unaffected.
    transport
        .publish("order", "c", Bytes::from_static(b"x"))
        .await
        .unwrap();

    // A server that answers with an error is not a disconnect either: a
    // stream whose limits the server refuses fails as a transport error.
    let strict = NatsJetStreamTransport::builder(server.url())
        .subject_prefix("strict")
        .connect()
        .await
        .unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "taken".into(),
        subjects: vec!["strict.held".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let err = strict
        .publish("held", "c", Bytes::from_static(b"x"))
        .await
        .expect_err("two streams cannot share a subject");
    assert!(
        !err.is_disconnected(),
        "the server is up and answered: {err}"
    );
}
