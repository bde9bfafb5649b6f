//! Where a node's reading resumes: the position it saves at shutdown and
//! replays from at the next start.

use super::*;

#[tokio::test]
async fn shutdown_saves_the_position_and_a_restart_replays_from_it() {
    let transport = EmbeddedTransport::new();
    let store = MemoryOffsetStore::new();
    let node = Node::builder("n1", transport.clone())
        .offset_store(store.clone())
        .register(&cache("t"))
        .start()
        .await
        .unwrap();
    let p = node.publisher();
    p.insert("t", [("a", "1")]).await.unwrap();
    eventually("applied", async || node.status().events_received == 1).await;
    node.shutdown().await.unwrap();
    assert!(!node.is_consuming());
    let saved = store
        .load(DEFAULT_TOPIC)
        .await
        .unwrap()
        .expect("position saved on shutdown");

    p.insert("t", [("b", "2")]).await.unwrap(); // while the node is down
    let c = cache("t");
    let node = Node::builder("n1", transport)
        .offset_store(store.clone())
        .register(&c)
        .start()
        .await
        .unwrap();
    assert_eq!(node.status().position, saved);
    eventually("replayed", async || holds(&c, "b", Some("2")).await).await;
    assert_eq!(
        c.get("a").await,
        None,
        "only what came after the saved position is replayed"
    );
}

#[tokio::test]
async fn file_store_positions_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let transport = EmbeddedTransport::new();
    let node = Node::builder("n1", transport.clone())
        .offset_store(FileOffsetStore::new(dir.path()))
        .persist_interval(Duration::from_millis(10))
        .register(&cache("t"))
        .start()
        .await
        .unwrap();
    node.publisher().insert("t", [("a", "1")]).await.unwrap();
    let path = dir.path().join("offsets.json");
    eventually("saved periodically", async || {
        std::fs::read_to_string(&path).is_ok_and(|s| s.contains("\"offsetTable\""))
    })
    .await;
    node.shutdown().await.unwrap();
    let stored = FileOffsetStore::new(dir.path())
        .load(DEFAULT_TOPIC)
        .await
        .unwrap();
    assert_eq!(stored, Some(node.status().position));
}
