//! The binlog relay against a MariaDB of the test's own (`mariadb_server`:
//! a row binlog with full metadata): what commits reaches every node, what
//! rolls back never does, values of every column type a dictionary table
//! uses read as text, and after a fault (the relay stopped, its position
//! purged, the server killed, the relay's lock lost) every node agrees
//! with the database.
#![cfg(feature = "mysql-cdc")]
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use cache_sync::cdc::{BinlogRelay, BinlogRelayBuilder, CdcTable};
use cache_sync::transport::EmbeddedTransport;
use cache_sync::{Node, Publisher, SyncedCache, Table};
use integration_tests::eventually;
use integration_tests::mariadb_server::MariaDbServer;
use mysql_async::prelude::Queryable as _;

const ITEMS: Table<i64, String> = Table::new("items");

struct Fixture {
    db: MariaDbServer,
    transport: EmbeddedTransport,
    nodes: Vec<Node>,
    caches: Vec<SyncedCache<i64, String>>,
}

async fn fixture(n: usize) -> Fixture {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let db = tokio::task::spawn_blocking(MariaDbServer::start)
        .await
        .unwrap();
    db.sql(
        "CREATE DATABASE app;
         CREATE TABLE app.items (id BIGINT PRIMARY KEY, name VARCHAR(100) CHARACTER SET utf8mb4 NOT NULL) ENGINE=InnoDB",
    )
    .unwrap();
    let transport = EmbeddedTransport::new();
    let mut nodes = Vec::new();
    let mut caches = Vec::new();
    for i in 0..n {
        let cache = SyncedCache::new(ITEMS, moka::future::Cache::new(100_000));
        nodes.push(
            Node::builder(format!("n{i}"), transport.clone())
                .register(&cache)
                .start()
                .await
                .unwrap(),
        );
        caches.push(cache);
    }
    Fixture {
        db,
        transport,
        nodes,
        caches,
    }
}

impl Fixture {
    fn url(&self) -> String {
        format!("{}app", self.db.url())
    }

    fn relay(&self) -> BinlogRelayBuilder {
        BinlogRelay::builder(self.url(), Publisher::new(self.transport.clone())).table(
            CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")),
        )
    }

    fn sql(&self, sql: &str) {
        if let Err(e) = self.db.sql(&format!("USE app; {sql}")) {
            panic!("{sql}: {e}");
        }
    }

    /// The table's rows.
    fn rows(&self) -> BTreeMap<i64, String> {
        self.db
            .sql("SELECT id, name FROM app.items")
            .unwrap()
            .lines()
            .map(|l| {
                let (id, name) = l.split_once('\t').unwrap();
                (id.parse().unwrap(), name.to_owned())
            })
            .collect()
    }

    async fn hold(&self, want: &BTreeMap<i64, String>) -> bool {
        for cache in &self.caches {
            for (k, v) in want {
                if cache.peek(k).await.as_ref() != Some(v) {
                    return false;
                }
            }
        }
        true
    }

    /// No node holds a value the table does not have.
    fn stale(&self) -> Option<String> {
        let db = self.rows();
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

    /// Every row updated once more arrives on every node, and nothing
    /// stale is left.
    async fn flows(&self, tag: &str) {
        self.sql(&format!("UPDATE items SET name = CONCAT('{tag}', id)"));
        let want = self.rows();
        eventually("every node holds every row's last value", async || {
            self.hold(&want).await
        })
        .await;
        assert_eq!(self.stale(), None);
    }

    /// A relay once it streams, and rows `0..n` named `a` and their id
    /// written and arrived on every node.
    async fn streaming(&self, n: i64) -> BinlogRelay {
        let relay = self.relay().start().await.unwrap();
        eventually("the relay streams", async || relay.stats().active).await;
        self.sql(&insert(0..n, "a"));
        eventually("rows arrive", async || self.hold(&named(0..n, "a")).await).await;
        relay
    }

    async fn shutdown(self) {
        for node in self.nodes {
            node.shutdown().await.unwrap();
        }
    }
}

fn named(range: std::ops::Range<i64>, name: &str) -> BTreeMap<i64, String> {
    range.map(|i| (i, format!("{name}{i}"))).collect()
}

fn insert(range: std::ops::Range<i64>, name: &str) -> String {
    let values: Vec<String> = range.map(|i| format!("({i}, '{name}{i}')")).collect();
    format!("INSERT INTO items (id, name) VALUES {}", values.join(", "))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_changes_reach_every_node_and_rolled_back_ones_never() {
    let f = fixture(3).await;
    // A name outside the database's default character set (latin1).
    let relay = f.relay().name("реле ✓ 🚀").start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    f.sql(&insert(0..50, "a"));
    eventually("every node holds the inserted rows", async || {
        f.hold(&named(0..50, "a")).await
    })
    .await;
    f.sql("UPDATE items SET name = CONCAT('b', id) WHERE id < 10");
    f.sql("DELETE FROM items WHERE id >= 40");
    f.sql("BEGIN; UPDATE items SET name = 'rolled back' WHERE id = 20; ROLLBACK");
    f.sql(
        "BEGIN; INSERT INTO items VALUES (1000, 'gone'); DELETE FROM items WHERE id = 1000; COMMIT",
    );
    // A key changed: the old key is dropped, the new one installed.
    f.sql("UPDATE items SET id = 3000 WHERE id = 30");
    f.sql("INSERT INTO items VALUES (2000, 'last')");
    let want = f.rows();
    eventually("every node holds the committed rows", async || {
        f.hold(&want).await
    })
    .await;
    for cache in &f.caches {
        for id in (40..50).chain([30, 1000]) {
            assert_eq!(cache.peek(&id).await, None, "{id}");
        }
        assert!(cache.iter().all(|(_, v)| v != "rolled back"));
    }
    assert_eq!(f.stale(), None);
    let stats = relay.stats();
    assert!(stats.active, "{stats:?}");
    assert!(stats.transactions >= 6, "{stats:?}");
    assert_eq!(stats.resyncs, 1, "the first start's clear: {stats:?}");
    assert!(stats.confirmed_lsn > 0, "{stats:?}");
    let metrics = relay.metrics();
    assert!(
        metrics.contains("cache_sync_cdc_active{slot=\"реле ✓ 🚀\"} 1"),
        "{metrics}"
    );
    relay.shutdown().await;
    // Its saved position is found again by that name: no resync.
    let again = f.relay().name("реле ✓ 🚀").start().await.unwrap();
    eventually("the relay streams again", async || again.stats().active).await;
    assert_eq!(again.stats().resyncs, 0, "{:?}", again.stats());
    again.shutdown().await;
    f.shutdown().await;
}

/// Every column type a dictionary table uses, read as `CdcTable`'s
/// functions see it: the text `Row::get` returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dictionary_column_type_reads_as_text() {
    const ROWS: Table<i64, String> = Table::new("typed");
    let f = fixture(0).await;
    f.sql(
        "CREATE TABLE typed (
            id BIGINT UNSIGNED PRIMARY KEY,
            small TINYINT, big BIGINT UNSIGNED, price DECIMAL(12, 3),
            ratio DOUBLE, name VARCHAR(50) CHARACTER SET utf8mb4, body TEXT CHARACTER SET utf8mb4,
            raw BLOB, bin VARBINARY(8), day DATE, at DATETIME(6), ts TIMESTAMP NULL,
            span TIME, doc JSON, kind ENUM('red', 'green'), tags SET('x', 'y', 'z'),
            bits BIT(10), year YEAR, nothing INT NULL
        )",
    );
    let cache = SyncedCache::new(ROWS, moka::future::Cache::new(100));
    let node = Node::builder("n", f.transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    const COLUMNS: [&str; 18] = [
        "small", "big", "price", "ratio", "name", "body", "raw", "bin", "day", "at", "ts", "span",
        "doc", "kind", "tags", "bits", "year", "nothing",
    ];
    let relay = BinlogRelay::builder(f.url(), Publisher::new(f.transport.clone()))
        .table(
            CdcTable::new(ROWS, "typed", |row| row.parse("id")).value(|row| {
                Some(
                    COLUMNS
                        .iter()
                        .map(|c| row.get(c).unwrap_or("NULL").to_owned())
                        .collect::<Vec<_>>()
                        .join("|"),
                )
            }),
        )
        .start()
        .await
        .unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    f.sql(
        "SET time_zone = '+00:00';
         INSERT INTO typed VALUES (7, -5, 18446744073709551615, -123.450,
            0.5, 'héllo ✓', 'long text', X'00ff', X'0102', '2026-12-07', '2026-12-07 10:11:12.000013',
            '2026-12-07 10:11:12', '-838:59:59', '{\"a\": [1, 2]}', 'green', 'x,z', b'1000000001', 2026, NULL)",
    );
    let want = [
        "-5",
        "18446744073709551615",
        "-123.450",
        "0.5",
        "héllo ✓",
        "long text",
        "\\x00ff",
        "\\x0102",
        "2026-12-07",
        "2026-12-07 10:11:12.000013",
        "2026-12-07 10:11:12",
        "-838:59:59",
        "{\"a\": [1, 2]}",
        "green",
        "x,z",
        "513",
        "2026",
        "NULL",
    ]
    .join("|");
    eventually("the typed row arrives", async || {
        cache.peek(&7).await.as_deref() == Some(want.as_str())
    })
    .await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    f.shutdown().await;
}

/// Stopped and started again, a relay goes on from its saved position: the
/// changes made while it was down arrive, and nothing is resynced. A
/// position purged from the server while it was down is a resync: every
/// mapped cache cleared, nothing stale left. A server killed and started
/// again: the relay reconnects and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_resumes_from_its_position_and_a_purged_one_is_a_resync() {
    let mut f = fixture(2).await;
    let relay = f.streaming(20).await;
    relay.shutdown().await;

    f.sql("UPDATE items SET name = CONCAT('down', id) WHERE id < 10");
    let relay = f.relay().start().await.unwrap();
    let want = f.rows();
    eventually(
        "what changed while the relay was down arrives",
        async || f.hold(&want).await,
    )
    .await;
    assert_eq!(relay.stats().resyncs, 0, "{:?}", relay.stats());
    relay.shutdown().await;

    // Changed while down, and the binlog that held it purged: lost.
    f.sql("UPDATE items SET name = CONCAT('lost', id) WHERE id < 5");
    f.db.purge_binlogs();
    let relay = f.relay().start().await.unwrap();
    eventually("the lost position is a resync", async || {
        relay.stats().resyncs == 1
    })
    .await;
    eventually("no node holds a row the purge hid", async || {
        f.stale().is_none()
    })
    .await;
    f.flows("after").await;

    f.db.kill();
    f.db.restart();
    eventually("the relay reconnects", async || relay.stats().active).await;
    f.flows("restarted").await;
    let stats = relay.stats();
    assert!(stats.failures >= 1, "{stats:?}");
    assert_eq!(stats.resyncs, 1, "a restart loses nothing: {stats:?}");
    relay.shutdown().await;
    // The saved position is in the binlog the restart began: a relay
    // started from it reads on from there, losing nothing.
    f.sql("UPDATE items SET name = CONCAT('new file', id) WHERE id < 3");
    let relay = f.relay().start().await.unwrap();
    let want = f.rows();
    eventually("what changed in the new binlog arrives", async || {
        f.hold(&want).await
    })
    .await;
    assert_eq!(relay.stats().resyncs, 0, "{:?}", relay.stats());
    relay.shutdown().await;
    f.shutdown().await;
}

/// TRUNCATE and DDL naming a mapped table clear its cache; rows written
/// after them arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_on_a_mapped_table_clear_its_cache() {
    let f = fixture(1).await;
    let relay = f.relay().start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    for statement in [
        "TRUNCATE TABLE items",
        "ALTER TABLE items ADD COLUMN extra INT NULL",
        "ALTER TABLE items DROP COLUMN extra",
        "RENAME TABLE items TO items_old, items_old TO items",
        // Dropped and created again: the drop clears.
        "DROP TABLE items; CREATE TABLE items (id BIGINT PRIMARY KEY, name VARCHAR(100) CHARACTER SET utf8mb4 NOT NULL)",
    ] {
        f.sql(&format!("DELETE FROM items; {}", insert(0..5, "x")));
        eventually("rows arrive", async || f.hold(&named(0..5, "x")).await).await;
        // Written behind the relay's back (not in the binlog): only the
        // statement's clear removes it.
        f.sql(&format!(
            "SET sql_log_bin = 0; UPDATE items SET name = 'unlogged' WHERE id = 1; SET sql_log_bin = 1; {statement}"
        ));
        eventually(statement, async || f.caches[0].peek(&1).await.is_none()).await;
    }
    f.sql(&insert(0..5, "y"));
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// Two relays of one name: one streams, the other stands by and takes
/// over when the first's connection ends (its lock goes with it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_when_the_active_relays_connection_ends() {
    let f = fixture(1).await;
    let a = f.relay().start().await.unwrap();
    eventually("a streams", async || a.stats().active).await;
    // Another server id: relays of one name share theirs by default, and
    // the server then drops the old reader's dump when the new one starts.
    // Here only a's check of its own connection can stop it.
    let b = f
        .relay()
        .server_id(12_345)
        .standby_retry(Duration::from_millis(50))
        .start()
        .await
        .unwrap();
    f.sql(&insert(0..5, "a"));
    eventually("rows arrive", async || f.hold(&named(0..5, "a")).await).await;
    assert!(!b.stats().active, "{:?}", b.stats());
    // Past a's next save: a has nothing more to write, so only its check
    // of its own connection can tell it the lock is gone.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The active relay's lock connection (idle, in the relay's database)
    // killed from the server: a notices within a second and stands by.
    let idle = f
        .db
        .sql("SELECT ID FROM information_schema.PROCESSLIST WHERE DB = 'app' AND COMMAND = 'Sleep'")
        .unwrap();
    for id in idle.lines() {
        let _ = f.db.sql(&format!("KILL {id}"));
    }
    eventually("b takes over", async || b.stats().active).await;
    eventually("a stands by", async || !a.stats().active).await;
    a.shutdown().await;
    assert_eq!(b.stats().takeovers, 1, "{:?}", b.stats());
    f.flows("b").await;
    b.shutdown().await;
    f.shutdown().await;
}

/// A server that does not log column names cannot be read by name: the
/// relay refuses it, counts the failure, and streams once it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_full_row_metadata_is_refused_until_it_has_it() {
    let f = fixture(1).await;
    f.db.sql("SET GLOBAL binlog_row_metadata = 'MINIMAL'")
        .unwrap();
    let relay = f.relay().start().await.unwrap();
    eventually("the relay refuses", async || relay.stats().failures >= 2).await;
    assert!(!relay.stats().active);
    f.db.sql("SET GLOBAL binlog_row_metadata = 'FULL'").unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    f.sql(&insert(0..5, "a"));
    eventually("rows arrive", async || f.hold(&named(0..5, "a")).await).await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// A transaction past the row cap reaches nodes as one clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_past_the_cap_is_a_clear() {
    let f = fixture(1).await;
    let relay = f
        .relay()
        .max_rows_per_transaction(10)
        .start()
        .await
        .unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    f.sql(&insert(0..5, "a"));
    eventually("rows arrive", async || f.hold(&named(0..5, "a")).await).await;
    f.sql(&format!(
        "BEGIN; {}; UPDATE items SET name = 'big' WHERE id = 0; COMMIT",
        insert(100..200, "b")
    ));
    eventually("the cache is cleared", async || {
        f.caches[0].peek(&1).await.is_none()
    })
    .await;
    assert_eq!(f.stale(), None);
    // Within the cap: keys again.
    f.sql("UPDATE items SET name = 'small' WHERE id < 5");
    let want: BTreeMap<i64, String> = (0..5).map(|i| (i, "small".to_owned())).collect();
    eventually("rows arrive", async || f.hold(&want).await).await;
    assert_eq!(f.stale(), None);
    relay.shutdown().await;
    f.shutdown().await;
}

/// A client of the test's server, with no default database: it never
/// looks like the relay's connections (which are in `app`).
fn client(f: &Fixture) -> mysql_async::Pool {
    mysql_async::Pool::new(f.db.url().as_str())
}

/// The binlog holds a transaction when it commits: one that began first
/// and commits last arrives last, at a version above the ones that
/// committed before it, and a later change of its row wins over it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transaction_committing_after_later_ones_arrives_in_commit_order() {
    let f = fixture(2).await;
    f.sql(&insert(0..5, "a"));
    let relay = f.relay().start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    let pool = client(&f);
    let mut long = pool.get_conn().await.unwrap();
    long.query_drop("BEGIN").await.unwrap();
    long.query_drop("UPDATE app.items SET name = 'long' WHERE id = 1")
        .await
        .unwrap();
    f.sql("UPDATE items SET name = 'short' WHERE id = 2");
    let short: BTreeMap<i64, String> = [(2, "short".to_owned())].into();
    eventually("the later, shorter transaction arrives", async || {
        f.hold(&short).await
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for cache in &f.caches {
        assert_ne!(cache.peek(&1).await.as_deref(), Some("long"), "uncommitted");
    }
    long.query_drop("COMMIT").await.unwrap();
    let want: BTreeMap<i64, String> = [(1, "long".to_owned()), (2, "short".to_owned())].into();
    eventually("the long transaction arrives once committed", async || {
        f.hold(&want).await
    })
    .await;
    f.sql("UPDATE items SET name = 'later' WHERE id = 1");
    let later: BTreeMap<i64, String> = [(1, "later".to_owned())].into();
    eventually("a later change wins", async || f.hold(&later).await).await;
    assert_eq!(f.stale(), None);
    drop(long);
    pool.disconnect().await.unwrap();
    relay.shutdown().await;
    f.shutdown().await;
}

/// Composite keys, NULL values, a partitioned table (its partitions are
/// the table's own business in the binlog), a partition truncated, and a
/// table nobody maps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn composite_keys_nulls_and_partitioned_tables() {
    const PAIRS: Table<(i64, String), Option<String>> = Table::new("pairs");
    let f = fixture(0).await;
    f.sql(
        "CREATE TABLE pairs (a INT, b VARCHAR(10), v VARCHAR(10) NULL, PRIMARY KEY (a, b))
             PARTITION BY RANGE (a) (PARTITION low VALUES LESS THAN (100), PARTITION high VALUES LESS THAN MAXVALUE);
         CREATE TABLE other (id INT PRIMARY KEY, v INT)",
    );
    let cache = SyncedCache::new(PAIRS, moka::future::Cache::new(100));
    let node = Node::builder("n", f.transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    let relay = BinlogRelay::builder(f.url(), Publisher::new(f.transport.clone()))
        .table(
            CdcTable::new(PAIRS, "app.pairs", |row| {
                Some((row.parse("a")?, row.get("b")?.to_owned()))
            })
            .value(|row| Some(row.get("v").map(str::to_owned))),
        )
        .start()
        .await
        .unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    f.sql(
        "INSERT INTO pairs VALUES (1, 'x', 'one'), (1, 'y', NULL), (150, 'x', 'high');
         INSERT INTO other VALUES (1, 1)",
    );
    let key = |a: i64, b: &str| (a, b.to_owned());
    eventually("the rows arrive", async || {
        cache.peek(&key(1, "x")).await == Some(Some("one".into()))
            && cache.peek(&key(1, "y")).await == Some(None)
            && cache.peek(&key(150, "x")).await == Some(Some("high".into()))
    })
    .await;
    // A key's part changed: the old key goes.
    f.sql("UPDATE pairs SET b = 'z', v = 'moved' WHERE a = 1 AND b = 'x'");
    eventually("the old key goes, the new arrives", async || {
        cache.peek(&key(1, "x")).await.is_none()
            && cache.peek(&key(1, "z")).await == Some(Some("moved".into()))
    })
    .await;
    f.sql("ALTER TABLE pairs TRUNCATE PARTITION high");
    eventually("the partition's truncate clears", async || {
        cache.peek(&key(150, "x")).await.is_none() && cache.peek(&key(1, "z")).await.is_none()
    })
    .await;
    relay.shutdown().await;
    node.shutdown().await.unwrap();
    f.shutdown().await;
}

/// Four writers on overlapping keys (updates, deletes, inserts, several
/// rows per transaction) while the relay's connections are killed from the
/// server at random moments: once the writes stop, every node agrees with
/// the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_storm_with_the_relays_connections_killed_ends_equal_to_the_table() {
    let f = fixture(2).await;
    f.sql(&insert(0..100, "a"));
    let relay = f.relay().start().await.unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    let pool = client(&f);
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let pool = pool.clone();
        writers.push(tokio::spawn(async move {
            let mut conn = pool.get_conn().await.unwrap();
            let mut x = w.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for i in 0..150u64 {
                // xorshift: keys collide across writers.
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let id = x % 100;
                let sql = match x % 5 {
                    0 => format!("DELETE FROM app.items WHERE id = {id}"),
                    1 => format!("REPLACE INTO app.items VALUES ({id}, 'w{w}i{i}')"),
                    2 => format!(
                        "BEGIN; UPDATE app.items SET name = 'w{w}t{i}' WHERE id = {id}; UPDATE app.items SET name = 'w{w}u{i}' WHERE id = {}; COMMIT",
                        (id + 1) % 100
                    ),
                    _ => format!("UPDATE app.items SET name = 'w{w}n{i}' WHERE id = {id}"),
                };
                conn.query_drop(sql).await.unwrap();
            }
        }));
    }
    let killer = {
        let db_url = f.db.url();
        tokio::spawn(async move {
            let pool = mysql_async::Pool::new(db_url.as_str());
            for round in 0u64..6 {
                tokio::time::sleep(Duration::from_millis(150 + 97 * (round % 3))).await;
                let mut conn = pool.get_conn().await.unwrap();
                let ids: Vec<u64> = conn
                    .query("SELECT ID FROM information_schema.PROCESSLIST WHERE DB = 'app' AND ID <> CONNECTION_ID()")
                    .await
                    .unwrap();
                for id in ids {
                    let _ = conn.query_drop(format!("KILL {id}")).await;
                }
            }
            pool.disconnect().await.unwrap();
        })
    };
    for w in writers {
        w.await.unwrap();
    }
    killer.await.unwrap();
    pool.disconnect().await.unwrap();
    eventually("no node holds a stale row", async || f.stale().is_none()).await;
    f.flows("after").await;
    assert!(relay.stats().failures >= 1, "{:?}", relay.stats());
    relay.shutdown().await;
    f.shutdown().await;
}

/// The size of the binlog `file`, as `SHOW BINARY LOGS` says.
fn binlog_size(f: &Fixture, file: &str) -> u64 {
    f.db.sql("SHOW BINARY LOGS")
        .unwrap()
        .lines()
        .find_map(|l| {
            let mut cols = l.split('\t');
            (cols.next() == Some(file)).then(|| cols.next().unwrap().parse().unwrap())
        })
        .unwrap_or(0)
}

/// `RESET MASTER` while the relay is down, then enough writes that the new
/// first binlog reaches past the saved offset: the saved position names a
/// file and an offset the server has again, in another binlog. Resuming
/// there would skip what the new binlog held before it; it is a loss, and
/// a resync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_master_while_down_is_a_resync_even_where_the_new_binlog_reaches_the_offset() {
    let f = fixture(2).await;
    let relay = f.streaming(20).await;
    relay.shutdown().await;
    let saved = binlog_size(&f, "binlog.000001");
    f.sql("RESET MASTER");
    let mut round = 0;
    while binlog_size(&f, "binlog.000001") <= saved + 1000 {
        round += 1;
        f.sql(&format!(
            "UPDATE items SET name = CONCAT('reset{round}-', id) WHERE id < 20"
        ));
    }
    let relay = f.relay().start().await.unwrap();
    eventually("the reset is a resync", async || relay.stats().resyncs >= 1).await;
    eventually("no node holds a row the reset hid", async || {
        f.stale().is_none()
    })
    .await;
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// `RESET MASTER` while the relay streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_master_while_streaming_is_a_resync() {
    let f = fixture(2).await;
    let relay = f.streaming(20).await;
    f.sql("RESET MASTER");
    for round in 0..20 {
        f.sql(&format!(
            "UPDATE items SET name = CONCAT('reset{round}-', id) WHERE id < 20"
        ));
    }
    eventually("no node holds a row the reset hid", async || {
        f.stale().is_none()
    })
    .await;
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// The relays' table emptied, or dropped, under a streaming relay: the
/// relay writes its row again from what it holds (emptied), or starts over
/// with a resync (dropped: its session ends on the missing table). Either
/// way nothing is stale, and rows flow after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_table_emptied_or_dropped_leaves_nothing_stale() {
    let f = fixture(2).await;
    let relay = f.streaming(20).await;
    f.sql("DELETE FROM cache_sync_binlog_relays");
    f.sql("UPDATE items SET name = CONCAT('emptied', id) WHERE id < 10");
    f.flows("after-emptied").await;
    assert_eq!(relay.stats().resyncs, 1, "{:?}", relay.stats());
    f.sql("DROP TABLE cache_sync_binlog_relays");
    f.sql("UPDATE items SET name = CONCAT('dropped', id) WHERE id < 10");
    eventually("the drop is a resync", async || relay.stats().resyncs == 2).await;
    eventually("nothing stale", async || f.stale().is_none()).await;
    f.flows("after-dropped").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// `binlog_format` set to STATEMENT, and `binlog_row_metadata` to MINIMAL,
/// while the relay streams: writers' new sessions log what the relay cannot
/// read row by row. Nothing stale either way, and rows flow once the
/// settings are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binlog_settings_changed_under_a_streaming_relay_leave_nothing_stale() {
    let f = fixture(2).await;
    let relay = f.streaming(20).await;
    for (i, (set, reset)) in [
        (
            "SET GLOBAL binlog_format = 'STATEMENT'",
            "SET GLOBAL binlog_format = 'ROW'",
        ),
        (
            "SET GLOBAL binlog_format = 'MIXED'",
            "SET GLOBAL binlog_format = 'ROW'",
        ),
        (
            "SET GLOBAL binlog_row_metadata = 'MINIMAL'",
            "SET GLOBAL binlog_row_metadata = 'FULL'",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        f.sql(set);
        // A new session (the harness's client) takes the global setting.
        f.sql("UPDATE items SET name = CONCAT('changed', id) WHERE id < 10");
        eventually(set, async || f.stale().is_none()).await;
        f.sql(reset);
        f.flows(&format!("after{i}-")).await;
    }
    relay.shutdown().await;
    f.shutdown().await;
}

/// A resync whose clear fails to publish (the broker refuses it) is sent
/// again by the next session: the new position is saved only after the
/// clear went out, so the next session finds the lost one again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_whose_clear_fails_to_publish_is_sent_again() {
    let f = fixture(2).await;
    let relay = f.streaming(20).await;
    relay.shutdown().await;
    f.sql("UPDATE items SET name = CONCAT('lost', id) WHERE id < 10");
    f.db.purge_binlogs();
    let faulty = cache_sync::transport::FaultyTransport::new(f.transport.clone());
    faulty.fail_publishes(1);
    let relay = BinlogRelay::builder(f.url(), Publisher::new(faulty.clone()))
        .standby_retry(Duration::from_millis(10))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    eventually("the clear goes out at last", async || {
        relay.stats().resyncs >= 1
    })
    .await;
    eventually("no node holds a row the purge hid", async || {
        f.stale().is_none()
    })
    .await;
    assert!(relay.stats().failures >= 1, "{:?}", relay.stats());
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// While a publish does not return, the relay's lag in seconds grows (by
/// the server's clock as last read, carried forward by the time passed
/// here, since nothing more is read meanwhile); once the publish returns,
/// it and the lag in bytes fall back to zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_grows_while_a_publish_hangs_and_falls_after() {
    let f = fixture(1).await;
    let faulty = cache_sync::transport::FaultyTransport::new(f.transport.clone());
    let relay = BinlogRelay::builder(f.url(), Publisher::new(faulty.clone()))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    eventually("the relay streams", async || relay.stats().active).await;
    f.sql(&insert(0..5, "a"));
    eventually("rows arrive", async || f.hold(&named(0..5, "a")).await).await;
    assert!(relay.stats().lag_seconds < 1.0, "{:?}", relay.stats());
    faulty.hang_publishes(true);
    f.sql("UPDATE items SET name = 'held' WHERE id = 1");
    eventually("the publish hangs", async || faulty.hanging() >= 1).await;
    eventually("the lag in seconds grows past 2 s", async || {
        relay.stats().lag_seconds >= 2.0
    })
    .await;
    faulty.hang_publishes(false);
    eventually("the lag falls back", async || {
        let s = relay.stats();
        s.lag_seconds == 0.0 && s.lag_bytes == Some(0)
    })
    .await;
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// MariaDB writes an `XA PREPARE`d transaction's rows into the binlog at
/// prepare time, and its `XA COMMIT` or `XA ROLLBACK` later, as a statement
/// of its own. Rows that were only prepared must never reach a node as a
/// value (a rollback would leave it there), and once committed, nodes must
/// not keep what they held before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xa_transactions_publish_only_what_commits() {
    let f = fixture(2).await;
    let relay = f.streaming(5).await;
    // Prepared, then rolled back: the value must never be seen.
    f.sql(
        "XA START 'x1'; UPDATE items SET name = 'prepared' WHERE id = 1; \
         XA END 'x1'; XA PREPARE 'x1'",
    );
    f.sql("UPDATE items SET name = 'later' WHERE id = 2");
    eventually("a later change arrives", async || {
        f.caches[0].peek(&2).await.as_deref() == Some("later")
    })
    .await;
    for c in &f.caches {
        assert_ne!(c.peek(&1).await.as_deref(), Some("prepared"));
    }
    f.sql("XA ROLLBACK 'x1'");
    // Prepared, then committed in another session: nothing stale after.
    f.sql(
        "XA START 'x2'; UPDATE items SET name = 'two-phase' WHERE id = 3; \
         XA END 'x2'; XA PREPARE 'x2'",
    );
    f.sql("XA COMMIT 'x2'");
    // One phase: an ordinary commit.
    f.sql(
        "XA START 'x3'; UPDATE items SET name = 'one-phase' WHERE id = 4; \
         XA END 'x3'; XA COMMIT 'x3' ONE PHASE",
    );
    eventually("nothing stale", async || f.stale().is_none()).await;
    for c in &f.caches {
        assert_ne!(c.peek(&1).await.as_deref(), Some("prepared"));
    }
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// After `RESET MASTER` the saved offset can be an event's start in the
/// new binlog of the same name (here made so by hand: the relays' table
/// is pointed at one, as a run of same-sized transactions would make
/// it). The name and offset read fine; the file is another. The relay
/// tells them apart by the file's creation time and resyncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_master_where_the_saved_offset_is_an_event_in_the_new_binlog_is_a_resync() {
    let f = fixture(2).await;
    let relay = f.streaming(20).await;
    // The new binlog must be created in a later second than the old one.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    f.sql("UPDATE items SET name = CONCAT('b', id) WHERE id >= 10");
    eventually("the update arrives", async || {
        f.caches[0].peek(&15).await.as_deref() == Some("b15")
    })
    .await;
    relay.shutdown().await;
    let created =
        f.db.sql("SELECT created FROM app.cache_sync_binlog_relays")
            .unwrap();
    assert_ne!(created.trim(), "0", "the saved position knows its file");
    f.sql("RESET MASTER");
    f.sql("UPDATE items SET name = CONCAT('lost', id) WHERE id < 10");
    // An event's start in the new binlog, after the change above.
    let boundary = binlog_size(&f, "binlog.000001");
    f.sql(&format!(
        "UPDATE cache_sync_binlog_relays SET file = 'binlog.000001', pos = {boundary}"
    ));
    let relay = f.relay().start().await.unwrap();
    eventually("the other file is a resync", async || {
        relay.stats().resyncs >= 1
    })
    .await;
    eventually("no node holds a row the reset hid", async || {
        f.stale().is_none()
    })
    .await;
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// A compressed binlog (MariaDB's `log_bin_compress`): turned on under a
/// streaming relay, rows come in compressed events it does not decode, and
/// each clears (nothing stale); a relay that starts meanwhile refuses the
/// server, naming the setting, and streams once it is off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_binlog_clears_under_a_relay_and_is_refused_at_start() {
    let f = fixture(2).await;
    let relay = f.streaming(5).await;
    f.sql("SET GLOBAL log_bin_compress = ON; SET GLOBAL log_bin_compress_min_len = 10");
    // Long enough to be compressed.
    let long = "x".repeat(90);
    f.sql(&format!("UPDATE items SET name = '{long}' WHERE id = 1"));
    eventually("the compressed change clears", async || {
        f.caches.iter().all(|c| c.iter().next().is_none())
    })
    .await;
    relay.shutdown().await;
    let relay = f.relay().start().await.unwrap();
    eventually("a new session refuses the server", async || {
        relay.stats().failures >= 1
    })
    .await;
    assert!(!relay.stats().active);
    f.sql("SET GLOBAL log_bin_compress = OFF");
    eventually("it streams once the setting is off", async || {
        relay.stats().active
    })
    .await;
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}

/// The relay as a user with only the grants its docs name; then
/// `REPLICATION SLAVE` revoked and its sessions killed: every new session
/// fails (counted), nothing is published meanwhile and nothing is lost;
/// granted again, it resumes from its position and nodes agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_revoked_stops_the_relay_loudly_and_granted_again_it_resumes() {
    let f = fixture(2).await;
    f.db.sql(
        "CREATE USER relay@'%'; \
         GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* TO relay@'%'; \
         GRANT SELECT, INSERT, UPDATE, CREATE, ALTER ON app.* TO relay@'%'",
    )
    .unwrap();
    let url = format!("mysql://relay@127.0.0.1:{}/app", f.db.port());
    let relay = BinlogRelay::builder(url, Publisher::new(f.transport.clone()))
        .standby_retry(Duration::from_millis(10))
        .table(CdcTable::new(ITEMS, "items", |row| row.parse("id")).value(|row| row.parse("name")))
        .start()
        .await
        .unwrap();
    eventually("the relay streams with its grants", async || {
        relay.stats().active
    })
    .await;
    f.sql(&insert(0..10, "a"));
    eventually("rows arrive", async || f.hold(&named(0..10, "a")).await).await;
    f.db.sql("REVOKE REPLICATION SLAVE ON *.* FROM relay@'%'")
        .unwrap();
    let ids =
        f.db.sql("SELECT ID FROM information_schema.PROCESSLIST WHERE USER = 'relay'")
            .unwrap();
    for id in ids.lines() {
        let _ = f.db.sql(&format!("KILL {id}"));
    }
    let failures = relay.stats().failures;
    eventually("new sessions fail", async || {
        relay.stats().failures >= failures + 2
    })
    .await;
    f.sql("UPDATE items SET name = CONCAT('revoked', id) WHERE id < 5");
    f.db.sql("GRANT REPLICATION SLAVE ON *.* TO relay@'%'")
        .unwrap();
    eventually("it streams again", async || relay.stats().active).await;
    let want = f.rows();
    eventually("what changed meanwhile arrives", async || {
        f.hold(&want).await
    })
    .await;
    assert_eq!(
        relay.stats().resyncs,
        1,
        "resumed, not resynced: {:?}",
        relay.stats()
    );
    f.flows("after").await;
    relay.shutdown().await;
    f.shutdown().await;
}
