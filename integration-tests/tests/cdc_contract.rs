//! The CDC contract (`docs/design.md`, "The CDC contract"), one suite run
//! against both sources: PostgreSQL's log (`CdcRelay`) and MariaDB's binlog
//! (`BinlogRelay`), each on a server of the test's own. Every scenario is
//! written once, against [`Source`], and instantiated for both.
//!
//! What every scenario checks is the contract's end state: once writes
//! stop, no node holds a value the table does not have ("stale"), and
//! every row written once more reaches every node. Faults come at moments
//! drawn from a seed, printed at the start of each test; set
//! `CDC_CONTRACT_SEED` to run one again.
#![cfg(all(feature = "postgres-cdc", feature = "mysql-cdc"))]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use cache_sync::cdc::{BinlogRelay, CdcRelay, CdcRelayStats, CdcTable};
use cache_sync::transport::EmbeddedTransport;
use cache_sync::{Node, Publisher, SyncedCache, Table};
use integration_tests::eventually;
use integration_tests::mariadb_server::MariaDbServer;
use integration_tests::postgres_server::PostgresServer;
use mysql_async::prelude::Queryable as _;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const ITEMS: Table<i64, String> = Table::new("items");

fn mapping() -> CdcTable<i64, String> {
    CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name"))
}

/// A relay of either source.
enum Relay {
    Pg(CdcRelay),
    Binlog(BinlogRelay),
}

impl Relay {
    fn stats(&self) -> CdcRelayStats {
        match self {
            Self::Pg(r) => r.stats(),
            Self::Binlog(r) => r.stats(),
        }
    }

    async fn shutdown(self) {
        match self {
            Self::Pg(r) => r.shutdown().await,
            Self::Binlog(r) => r.shutdown().await,
        }
    }
}

/// What the suite needs of a source: its server, SQL on its `items` table
/// (`id` primary key, `name`, `body`), its relay, and its faults.
trait Source: Sized {
    /// The server with the `items` table.
    async fn start() -> Self;
    /// Runs `sql` (several statements allowed, on one connection).
    async fn try_exec(&self, sql: &str) -> Result<(), String>;
    async fn rows(&self) -> BTreeMap<i64, String>;
    /// SQL for `prefix` followed by the text of `expr`.
    fn concat(prefix: &str, expr: &str) -> String;
    async fn relay(&self, transport: &EmbeddedTransport, max_rows: usize) -> Relay;
    fn kill(&mut self);
    fn restart(&mut self);
    /// Kills every session of the relay's (its stream and its others).
    async fn kill_relay_sessions(&self);
    /// With no relay running: the relay's saved position no longer exists
    /// (PostgreSQL: its slot dropped; MariaDB: its binlogs purged).
    async fn lose_position(&self);
    /// A writer of single-row updates and two-row transactions over `keys`
    /// keys, until told to stop; returns how many it wrote.
    fn writer(&self, keys: i64, seed: u64) -> (watch::Sender<bool>, JoinHandle<u64>);

    async fn exec(&self, sql: &str) {
        if let Err(e) = self.try_exec(sql).await {
            panic!("{sql}: {e}");
        }
    }
}

struct Postgres {
    server: PostgresServer,
    pool: PgPool,
}

impl Source for Postgres {
    async fn start() -> Self {
        let server = tokio::task::spawn_blocking(PostgresServer::start)
            .await
            .unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&server.url())
            .await
            .unwrap();
        let source = Self { server, pool };
        source
            .exec("CREATE TABLE items (id bigint PRIMARY KEY, name text NOT NULL, body text)")
            .await;
        source
    }

    async fn try_exec(&self, sql: &str) -> Result<(), String> {
        sqlx::raw_sql(sql)
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    async fn rows(&self) -> BTreeMap<i64, String> {
        sqlx::query_as::<_, (i64, String)>("SELECT id, name FROM items")
            .fetch_all(&self.pool)
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    fn concat(prefix: &str, expr: &str) -> String {
        format!("'{prefix}' || {expr}")
    }

    async fn relay(&self, transport: &EmbeddedTransport, max_rows: usize) -> Relay {
        Relay::Pg(
            CdcRelay::builder(self.server.url(), Publisher::new(transport.clone()))
                .standby_retry(Duration::from_millis(50))
                .max_rows_per_transaction(max_rows)
                .table(mapping())
                .start()
                .await
                .unwrap(),
        )
    }

    fn kill(&mut self) {
        self.server.kill();
    }

    fn restart(&mut self) {
        self.server.restart();
    }

    async fn kill_relay_sessions(&self) {
        let _ = self
            .try_exec(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE pid <> pg_backend_pid() AND (backend_type = 'walsender' \
                 OR application_name LIKE '%cache-sync%' OR application_name LIKE '%cache_sync%')",
            )
            .await;
    }

    async fn lose_position(&self) {
        eventually("the slot is let go", async || {
            self.try_exec("SELECT pg_drop_replication_slot('cache_sync')")
                .await
                .is_ok()
        })
        .await;
    }

    fn writer(&self, keys: i64, seed: u64) -> (watch::Sender<bool>, JoinHandle<u64>) {
        let pool = self.pool.clone();
        spawn_writer(seed, keys, move |sql| {
            let pool = pool.clone();
            async move {
                let _ = sqlx::raw_sql(&sql).execute(&pool).await;
            }
        })
    }
}

struct MariaDb {
    server: MariaDbServer,
    pool: mysql_async::Pool,
}

impl MariaDb {
    fn url(&self) -> String {
        format!("{}app", self.server.url())
    }
}

impl Source for MariaDb {
    async fn start() -> Self {
        let server = tokio::task::spawn_blocking(MariaDbServer::start)
            .await
            .unwrap();
        server
            .sql(
                "CREATE DATABASE app; CREATE TABLE app.items (id BIGINT PRIMARY KEY, \
                 name VARCHAR(200) CHARACTER SET utf8mb4 NOT NULL, body TEXT) ENGINE=InnoDB",
            )
            .unwrap();
        let pool = mysql_async::Pool::new(format!("{}app", server.url()).as_str());
        Self { server, pool }
    }

    async fn try_exec(&self, sql: &str) -> Result<(), String> {
        let mut conn = self.pool.get_conn().await.map_err(|e| e.to_string())?;
        conn.query_drop(sql).await.map_err(|e| e.to_string())
    }

    async fn rows(&self) -> BTreeMap<i64, String> {
        let mut conn = self.pool.get_conn().await.unwrap();
        conn.query::<(i64, String), _>("SELECT id, name FROM items")
            .await
            .unwrap()
            .into_iter()
            .collect()
    }

    fn concat(prefix: &str, expr: &str) -> String {
        format!("CONCAT('{prefix}', {expr})")
    }

    async fn relay(&self, transport: &EmbeddedTransport, max_rows: usize) -> Relay {
        Relay::Binlog(
            BinlogRelay::builder(self.url(), Publisher::new(transport.clone()))
                .standby_retry(Duration::from_millis(50))
                .max_rows_per_transaction(max_rows)
                .table(mapping())
                .start()
                .await
                .unwrap(),
        )
    }

    fn kill(&mut self) {
        self.server.kill();
    }

    fn restart(&mut self) {
        self.server.restart();
    }

    async fn kill_relay_sessions(&self) {
        // Every session but the test's own: the relay's stream (a dump
        // thread), its lock and its visibility writes; writers reconnect.
        let Ok(mut conn) = self.pool.get_conn().await else {
            return;
        };
        let ids: Vec<u64> = conn
            .query("SELECT ID FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND USER = 'root'")
            .await
            .unwrap_or_default();
        for id in ids {
            let _ = conn.query_drop(format!("KILL {id}")).await;
        }
    }

    async fn lose_position(&self) {
        let server = &self.server;
        server.purge_binlogs();
    }

    fn writer(&self, keys: i64, seed: u64) -> (watch::Sender<bool>, JoinHandle<u64>) {
        let pool = self.pool.clone();
        spawn_writer(seed, keys, move |sql| {
            let pool = pool.clone();
            async move {
                if let Ok(mut conn) = pool.get_conn().await {
                    let _ = conn.query_drop(sql).await;
                }
            }
        })
    }
}

/// A small seeded generator (xorshift64*): the suite's random moments.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn seed(test: &str) -> u64 {
    let seed = std::env::var("CDC_CONTRACT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
                .into()
        });
    eprintln!("{test}: CDC_CONTRACT_SEED={seed}");
    seed
}

/// Updates keys at random (the dialects share `UPDATE ... SET name = 'x'`),
/// each statement or two-statement transaction through `run`.
fn spawn_writer<F, Fut>(seed: u64, keys: i64, run: F) -> (watch::Sender<bool>, JoinHandle<u64>)
where
    F: Fn(String) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (stop, stopped) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut rng = Rng::new(seed);
        let mut n = 0u64;
        let keys = u64::try_from(keys).unwrap();
        while !*stopped.borrow() {
            let a = rng.below(keys);
            let b = rng.below(keys);
            let sql = if rng.below(3) == 0 {
                format!(
                    "BEGIN; UPDATE items SET name = 's{seed}n{n}a' WHERE id = {a}; \
                     UPDATE items SET name = 's{seed}n{n}b' WHERE id = {b}; COMMIT"
                )
            } else {
                format!("UPDATE items SET name = 's{seed}n{n}' WHERE id = {a}")
            };
            run(sql).await;
            n += 1;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        n
    });
    (stop, task)
}

struct Fixture<S> {
    source: S,
    transport: EmbeddedTransport,
    nodes: Vec<Node>,
    caches: Vec<SyncedCache<i64, String>>,
}

impl<S: Source> Fixture<S> {
    async fn new(nodes: usize) -> Self {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let source = S::start().await;
        let transport = EmbeddedTransport::new();
        let mut all = Vec::new();
        let mut caches = Vec::new();
        for i in 0..nodes {
            let cache = SyncedCache::new(ITEMS, moka::future::Cache::new(1_000_000));
            all.push(
                Node::builder(format!("n{i}"), transport.clone())
                    .register(&cache)
                    .start()
                    .await
                    .unwrap(),
            );
            caches.push(cache);
        }
        Self {
            source,
            transport,
            nodes: all,
            caches,
        }
    }

    async fn relay(&self) -> Relay {
        self.relay_capped(10_000).await
    }

    /// A relay once it streams: a new relay starts at the log's end with a
    /// resync (a clear), and what committed before that point is covered by
    /// the clear rather than published, so the scenarios write after it.
    async fn relay_capped(&self, max_rows: usize) -> Relay {
        let relay = self.source.relay(&self.transport, max_rows).await;
        eventually("the relay streams", async || relay.stats().active).await;
        relay
    }

    /// Rows `range`, named `name` and their id, in one statement.
    async fn insert(&self, range: std::ops::Range<i64>, name: &str) {
        let values: Vec<String> = range.map(|i| format!("({i}, '{name}{i}')")).collect();
        self.source
            .exec(&format!(
                "INSERT INTO items (id, name) VALUES {}",
                values.join(", ")
            ))
            .await;
    }

    fn stale(&self, db: &BTreeMap<i64, String>) -> Option<String> {
        for (i, cache) in self.caches.iter().enumerate() {
            for (k, v) in cache.iter() {
                if db.get(&*k) != Some(&v) {
                    return Some(format!(
                        "node {i} holds {k} = {v:?}, the table {:?}",
                        db.get(&*k)
                    ));
                }
            }
        }
        None
    }

    /// The contract's end state: nothing stale on any node, and every row
    /// updated once more reaches every node.
    async fn agree(&self, tag: &str) {
        let db = self.source.rows().await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while let Some(stale) = self.stale(&db) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{tag}: nodes do not agree with the table: {stale}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.source
            .exec(&format!("UPDATE items SET name = {}", S::concat(tag, "id")))
            .await;
        let want = self.source.rows().await;
        eventually(
            &format!("{tag}: every node holds every row's last value"),
            async || {
                for cache in &self.caches {
                    for (k, v) in &want {
                        if cache.peek(k).await.as_ref() != Some(v) {
                            return false;
                        }
                    }
                }
                true
            },
        )
        .await;
    }

    async fn shutdown(self) {
        for node in self.nodes {
            node.shutdown().await.unwrap();
        }
    }
}

/// Writes from outside any application (plain SQL: inserts, updates,
/// deletes, a multi-row transaction, a rollback) reach every node; what
/// rolled back never does.
async fn bypassing_writes<S: Source>() {
    let f = Fixture::<S>::new(2).await;
    let relay = f.relay().await;
    f.insert(0..50, "a").await;
    f.source
        .exec("BEGIN; UPDATE items SET name = 'b' WHERE id < 10; DELETE FROM items WHERE id >= 40; COMMIT")
        .await;
    f.source
        .exec("BEGIN; UPDATE items SET name = 'rolled back' WHERE id = 20; ROLLBACK")
        .await;
    let want = f.source.rows().await;
    eventually("every node holds the table", async || {
        let mut all = f.stale(&want).is_none();
        for c in &f.caches {
            for (k, v) in &want {
                all &= c.peek(k).await.as_ref() == Some(v);
            }
        }
        all
    })
    .await;
    for c in &f.caches {
        assert_eq!(c.peek(&45).await, None, "a deleted row is gone");
        assert_ne!(c.peek(&20).await.as_deref(), Some("rolled back"));
    }
    f.agree("end").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// Four writers on overlapping keys while the relay's sessions are killed
/// at random moments: the nodes end on the table.
async fn concurrent_writers_with_sessions_killed<S: Source>() {
    let mut rng = Rng::new(seed("concurrent_writers_with_sessions_killed"));
    let f = Fixture::<S>::new(3).await;
    f.insert(0..40, "a").await;
    let relay = f.relay().await;
    let writers: Vec<_> = (0..4).map(|_| f.source.writer(40, rng.next())).collect();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100 + rng.below(300))).await;
        f.source.kill_relay_sessions().await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut written = 0;
    for (stop, task) in writers {
        stop.send(true).unwrap();
        written += task.await.unwrap();
    }
    assert!(written > 0);
    f.agree("after").await;
    assert!(relay.stats().failures >= 1, "{:?}", relay.stats());
    relay.shutdown().await;
    f.shutdown().await;
}

/// The relay dropped without a shutdown and started again at random
/// moments under writes (a crash of its process, as far as the database
/// sees): at least once, so the nodes end on the table.
async fn relay_restarted_at_random_moments<S: Source>() {
    let mut rng = Rng::new(seed("relay_restarted_at_random_moments"));
    let f = Fixture::<S>::new(2).await;
    f.insert(0..40, "a").await;
    let mut relay = f.relay().await;
    let (stop, task) = f.source.writer(40, rng.next());
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(50 + rng.below(250))).await;
        drop(relay);
        tokio::time::sleep(Duration::from_millis(rng.below(100))).await;
        relay = f.relay().await;
    }
    stop.send(true).unwrap();
    assert!(task.await.unwrap() > 0);
    f.agree("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// The server killed (`kill -9`) under writes and restarted: the nodes end
/// on the table.
async fn server_killed_and_restarted<S: Source>() {
    let mut rng = Rng::new(seed("server_killed_and_restarted"));
    let mut f = Fixture::<S>::new(2).await;
    f.insert(0..40, "a").await;
    let relay = f.relay().await;
    let (stop, task) = f.source.writer(40, rng.next());
    tokio::time::sleep(Duration::from_millis(100 + rng.below(400))).await;
    f.source.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    f.source.restart();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(true).unwrap();
    task.await.unwrap();
    f.agree("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// The relay's position lost while it was down (its slot dropped, its
/// binlogs purged): a loss, answered by a resync (every mapped cache
/// cleared), and the nodes end on the table, changes made while it was
/// down included.
async fn lost_position_is_a_resync<S: Source>() {
    let f = Fixture::<S>::new(2).await;
    let relay = f.relay().await;
    f.insert(0..20, "a").await;
    f.agree("before").await;
    relay.shutdown().await;
    f.source
        .exec("UPDATE items SET name = 'missed' WHERE id < 10")
        .await;
    f.source.lose_position().await;
    let relay = f.relay().await;
    f.agree("after").await;
    // A relay that finds its position resumes without one.
    assert!(relay.stats().resyncs >= 1, "{:?}", relay.stats());
    relay.shutdown().await;
    f.shutdown().await;
}

/// A transaction past the relay's row cap is a clear, not a partial
/// publish; smaller ones around it are published row by row.
async fn big_transactions_clear<S: Source>() {
    let f = Fixture::<S>::new(2).await;
    let relay = f.relay_capped(50).await;
    f.insert(0..40, "a").await;
    f.agree("small").await;
    f.insert(100..400, "big").await;
    // Rows 0..40 were not in it: only a clear takes them away.
    eventually("the big transaction clears", async || {
        let mut cleared = true;
        for c in &f.caches {
            cleared &= c.peek(&0).await.is_none();
        }
        cleared
    })
    .await;
    // The update touches 340 rows: it clears too, and leaves nothing stale.
    let db = f.source.rows().await;
    eventually("nothing stale", async || f.stale(&db).is_none()).await;
    f.source
        .exec("UPDATE items SET name = 'one' WHERE id = 3")
        .await;
    eventually("a small change flows again", async || {
        let mut all = true;
        for c in &f.caches {
            all &= c.peek(&3).await.as_deref() == Some("one");
        }
        all
    })
    .await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// Schema changes: a column added and dropped, TRUNCATE, the mapped column
/// renamed (rows the mapping cannot read clear) and renamed back: nothing
/// stale at any step, and rows flow after.
async fn schema_changes<S: Source>() {
    let f = Fixture::<S>::new(2).await;
    let relay = f.relay().await;
    f.insert(0..20, "a").await;
    f.agree("start").await;
    f.source
        .exec("ALTER TABLE items ADD COLUMN extra INT")
        .await;
    f.agree("added").await;
    f.source.exec("ALTER TABLE items DROP COLUMN extra").await;
    f.agree("dropped").await;
    f.source.exec("TRUNCATE items").await;
    eventually("a truncate empties the caches", async || {
        f.caches.iter().all(|c| c.iter().next().is_none())
    })
    .await;
    f.insert(0..20, "b").await;
    f.agree("refilled").await;
    f.source
        .exec("ALTER TABLE items RENAME COLUMN name TO title")
        .await;
    f.source
        .exec("UPDATE items SET title = 'renamed' WHERE id < 5")
        .await;
    eventually("nothing stale while the column is renamed", async || {
        f.caches
            .iter()
            .all(|c| c.iter().all(|(k, v)| *k >= 5 || v.as_str() == "renamed"))
    })
    .await;
    f.source
        .exec("ALTER TABLE items RENAME COLUMN title TO name")
        .await;
    f.agree("renamed back").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// A write storm: eight writers, then the table and every node compared.
async fn write_storm<S: Source>() {
    let mut rng = Rng::new(seed("write_storm"));
    let f = Fixture::<S>::new(4).await;
    f.insert(0..200, "a").await;
    let relay = f.relay().await;
    let writers: Vec<_> = (0..8).map(|_| f.source.writer(200, rng.next())).collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut written = 0;
    for (stop, task) in writers {
        stop.send(true).unwrap();
        written += task.await.unwrap();
    }
    assert!(written > 100, "{written} writes");
    f.agree("after").await;
    let stats = relay.stats();
    assert!(stats.rows >= written, "{written} writes, {stats:?}");
    relay.shutdown().await;
    f.shutdown().await;
}

macro_rules! suite {
    ($source:ident, $module:ident) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn bypassing_writes_reach_every_node() {
                bypassing_writes::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_writers_with_relay_sessions_killed() {
                concurrent_writers_with_sessions_killed::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn relay_restarted_at_random_moments() {
                super::relay_restarted_at_random_moments::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn server_killed_and_restarted() {
                super::server_killed_and_restarted::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_position_is_a_resync() {
                super::lost_position_is_a_resync::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn big_transactions_clear() {
                super::big_transactions_clear::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn schema_changes() {
                super::schema_changes::<$source>().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn write_storm() {
                super::write_storm::<$source>().await;
            }
        }
    };
}

suite!(Postgres, postgres);
suite!(MariaDb, mariadb);
