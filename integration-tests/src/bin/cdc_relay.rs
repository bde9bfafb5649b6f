//! A CDC relay in a process of its own, for tests that `kill -9` it:
//! `cdc_relay DATABASE_URL REDIS_URL TOPIC SLOT`. Maps table `items`
//! (`id bigint` key, `name text` value) to cache `items`, published to a
//! Redis stream, until killed.

use std::time::Duration;

use cache_sync::{
    Publisher, Table,
    cdc::{CdcRelay, CdcTable},
    transport::RedisStreamsTransport,
};

const ITEMS: Table<i64, String> = Table::new("items");

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [database, redis, topic, slot] = args.as_slice() else {
        eprintln!("usage: cdc_relay DATABASE_URL REDIS_URL TOPIC SLOT");
        std::process::exit(2);
    };
    let transport = RedisStreamsTransport::connect(redis.as_str())
        .await
        .expect("connect to redis");
    let publisher = Publisher::builder(transport)
        .topic(topic.as_str())
        .origin("cdc-relay-process")
        .build()
        .expect("publisher");
    let _relay = CdcRelay::builder(database.as_str(), publisher)
        .slot(slot.as_str())
        .publication(slot.as_str())
        .standby_retry(Duration::from_millis(100))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .expect("relay starts");
    std::future::pending::<()>().await;
}
