//! An outbox relay in a process of its own, for tests that `kill -9` it:
//! `outbox_relay DATABASE_URL SCHEMA REDIS_URL TOPIC`. Publishes the
//! schema's outbox to a Redis stream until killed.

use std::time::Duration;

use cache_sync::{
    Publisher,
    outbox::{Outbox, OutboxRelay},
    transport::RedisStreamsTransport,
};
use sqlx::postgres::PgPoolOptions;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [database, schema, redis, topic] = args.as_slice() else {
        eprintln!("usage: outbox_relay DATABASE_URL SCHEMA REDIS_URL TOPIC");
        std::process::exit(2);
    };
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(database)
        .await
        .expect("connect to the database");
    let transport = RedisStreamsTransport::connect(redis.as_str())
        .await
        .expect("connect to redis");
    let publisher = Publisher::builder(transport)
        .topic(topic.as_str())
        .origin("outbox-relay-process")
        .build()
        .expect("publisher");
    let outbox = Outbox::builder()
        .schema(schema.as_str())
        .build()
        .expect("outbox");
    let _relay = OutboxRelay::builder(pool, publisher)
        .outbox(outbox)
        .batch_size(16)
        .poll_interval(Duration::from_millis(50))
        .start()
        .await
        .expect("relay starts");
    // Runs until killed: the tests end it with SIGKILL.
    loop {
        tokio::time::sleep(Duration::from_secs(3600)).await;
    }
}
