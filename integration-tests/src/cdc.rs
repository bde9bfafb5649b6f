//! The CDC tests' fixture: a PostgreSQL of the test's own with an `items`
//! table, nodes caching it on an embedded transport, a relay, and the
//! checks that nodes agree with the database.

use std::collections::BTreeMap;
use std::time::Duration;

use cache_sync::{
    Node, Publisher, SyncedCache, Table,
    cdc::{CdcRelay, CdcRelayBuilder, CdcTable},
    transport::EmbeddedTransport,
};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::eventually;
use crate::postgres_server::PostgresServer;

/// The cache of the `items` table.
pub const ITEMS: Table<i64, String> = Table::new("items");

/// A pool on `server`; also sets up the tests' log (`RUST_LOG`).
pub async fn pool(server: &PostgresServer) -> PgPool {
    // RUST_LOG=cache_sync=debug shows the relay's sessions.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&server.url())
        .await
        .expect("connect to the test's PostgreSQL")
}

/// Runs `sql` (several statements allowed), panicking on an error.
pub async fn exec(pool: &PgPool, sql: &str) {
    sqlx::raw_sql(sql)
        .execute(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The `items` table: `id` (primary key), `name`, `body`.
pub async fn create_items(pool: &PgPool) {
    exec(
        pool,
        "CREATE TABLE items (id bigint PRIMARY KEY, name text NOT NULL, body text)",
    )
    .await;
}

/// The table as it is now.
pub async fn rows(pool: &PgPool) -> BTreeMap<i64, String> {
    sqlx::query_as::<_, (i64, String)>("SELECT id, name FROM items")
        .fetch_all(pool)
        .await
        .expect("read items")
        .into_iter()
        .collect()
}

/// Nodes and their `items` caches.
#[derive(Debug)]
pub struct Nodes {
    /// The nodes.
    pub nodes: Vec<Node>,
    /// Their caches, in the same order.
    pub caches: Vec<SyncedCache<i64, String>>,
}

/// `n` nodes on `transport`, each caching `items`.
pub async fn nodes(transport: &EmbeddedTransport, n: usize) -> Nodes {
    let mut nodes = Vec::new();
    let mut caches = Vec::new();
    for i in 0..n {
        let cache = SyncedCache::new(ITEMS, moka::future::Cache::new(1_000_000));
        let node = Node::builder(format!("n{i}"), transport.clone())
            .register(&cache)
            .start()
            .await
            .expect("start a node");
        nodes.push(node);
        caches.push(cache);
    }
    Nodes { nodes, caches }
}

impl Nodes {
    /// No node holds a value the database does not have for its key.
    pub fn stale(&self, db: &BTreeMap<i64, String>) -> Option<String> {
        for (i, cache) in self.caches.iter().enumerate() {
            for (k, v) in cache.iter() {
                if db.get(&*k) != Some(&v) {
                    return Some(format!(
                        "n{i} holds {k} = {v:?}; the database has {:?}",
                        db.get(&k)
                    ));
                }
            }
        }
        None
    }

    /// Every node holds exactly `want` for the keys of `want`.
    pub async fn hold(&self, want: &BTreeMap<i64, String>) -> bool {
        for cache in &self.caches {
            for (k, v) in want {
                if cache.peek(k).await.as_ref() != Some(v) {
                    return false;
                }
            }
        }
        true
    }

    pub async fn agree(&self, pool: &PgPool) {
        let db = rows(pool).await;
        let mut last = None;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while tokio::time::Instant::now() < deadline {
            match self.stale(&db) {
                None => return,
                Some(s) => last = Some(s),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!(
            "nodes do not agree with the database: {}",
            last.unwrap_or_default()
        );
    }

    pub async fn shutdown(self) {
        for n in self.nodes {
            n.shutdown().await.expect("shut a node down");
        }
    }
}

/// A server of the test's own with the `items` table, and `n` nodes on
/// an embedded transport caching it.
pub async fn items_fixture(n: usize) -> (PostgresServer, PgPool, EmbeddedTransport, Nodes) {
    let pg = PostgresServer::start();
    let pool = pool(&pg).await;
    create_items(&pool).await;
    let transport = EmbeddedTransport::new();
    let nodes = nodes(&transport, n).await;
    (pg, pool, transport, nodes)
}

/// A relay of `items` to `transport`, with short retry and check intervals.
pub fn relay(server: &PostgresServer, transport: &EmbeddedTransport) -> CdcRelayBuilder {
    CdcRelay::builder(server.url(), Publisher::new(transport.clone()))
        .standby_retry(Duration::from_millis(50))
        .lag_interval(Duration::from_millis(200))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
}

/// Inserts `range`, each row named `name` and its id.
pub async fn insert(pool: &PgPool, range: std::ops::Range<i64>, name: &str) {
    sqlx::query("INSERT INTO items SELECT g, $3 || g FROM generate_series($1::int8, $2::int8) g")
        .bind(range.start)
        .bind(range.end - 1)
        .bind(name)
        .execute(pool)
        .await
        .expect("insert items");
}

/// What [`insert`] wrote.
pub fn named(range: std::ops::Range<i64>, name: &str) -> BTreeMap<i64, String> {
    range.map(|i| (i, format!("{name}{i}"))).collect()
}

/// Every row updated once more arrives on every node.
pub async fn flows_again(pool: &PgPool, nodes: &Nodes) {
    exec(pool, "UPDATE items SET name = 'final' || id").await;
    let db = rows(pool).await;
    eventually("every node holds the last value of every row", async || {
        nodes.hold(&db).await
    })
    .await;
}

/// Writes single-row updates until told to stop; returns how many.
pub fn writer(
    pool: PgPool,
    keys: i64,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<u64>,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let mut n = 0u64;
        while !*stopped.borrow() {
            let id = i64::try_from(n).expect("fewer writes than i64::MAX") % keys;
            // Fails while the server is down: keep trying.
            let _ = sqlx::query("UPDATE items SET name = 'w' || $2 WHERE id = $1")
                .bind(id)
                .bind(n.to_string())
                .execute(&pool)
                .await;
            n += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        n
    });
    (stop, task)
}

/// The relays' record on `publication` (its comment), as JSON.
pub async fn record(pool: &PgPool, publication: &str) -> serde_json::Value {
    let comment: Option<String> = sqlx::query_scalar(
        "SELECT obj_description(oid, 'pg_publication') FROM pg_publication WHERE pubname = $1",
    )
    .bind(publication)
    .fetch_one(pool)
    .await
    .expect("the publication exists");
    serde_json::from_str(&comment.expect("a record")).expect("the record is JSON")
}

/// Writes `record` on `publication`, as a relay would.
pub async fn set_record(pool: &PgPool, publication: &str, record: &serde_json::Value) {
    let text = record.to_string().replace('\'', "''");
    exec(
        pool,
        &format!("COMMENT ON PUBLICATION \"{publication}\" IS '{text}'"),
    )
    .await;
}

/// How many resyncs the record says are owed to `slot` (of `publication`,
/// named like it).
pub async fn owed(pool: &PgPool, slot: &str) -> usize {
    let record = record(pool, slot).await;
    record["slots"][slot]["owed"].as_array().map_or(0, Vec::len)
}

/// Waits until a relay on a new slot published that slot's resync: a count
/// read as a baseline before it would take it for a later one.
pub async fn first_resync(relay: &CdcRelay) {
    eventually("the new slot's resync", async || relay.stats().resyncs >= 1).await;
}
