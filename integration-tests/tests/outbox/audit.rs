//! The consistency auditor reading a real PostgreSQL through the fault
//! proxy (`integration_tests::proxy`): its source cut off both ways, then
//! its answers lost, then slowed past the read's timeout, while rows change
//! and are published. No false inconsistency: a read that fails or times
//! out judges nothing, and a late answer (held bytes delivered at the heal)
//! is never taken for a new one. After the heal it reads on, and a write
//! that bypassed the publisher is still found.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cache_sync::Audit;
use cache_sync::status::AuditStatus;
use integration_tests::proxy::Proxy;
use sqlx::postgres::PgConnectOptions;

use super::*;

/// Rows the writer writes: `k1` to `k20` once, then `k0` to `k3` over and
/// over.
const KEYS: u64 = 20;
/// The auditor gives up on a read after this.
const READ_TIMEOUT: Duration = Duration::from_millis(500);

/// A pool that reaches the test database through `proxy`.
async fn pool_through(proxy: &Proxy) -> PgPool {
    let options = PgConnectOptions::from_str(&database_url())
        .unwrap()
        .host("127.0.0.1")
        .port(proxy.addr().port());
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(READ_TIMEOUT)
        .connect_lazy_with(options)
}

/// The database's address, for the proxy in front of it.
async fn database_addr() -> SocketAddr {
    let options = PgConnectOptions::from_str(&database_url()).unwrap();
    tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .unwrap()
        .next()
        .expect("the database's host resolves")
}

fn audit_of(cache: &SyncedCache<String, String>) -> AuditStatus {
    cache.status().audit.expect("audited")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auditor_whose_source_is_cut_off_finds_no_false_inconsistency() {
    let db = TestDb::new("audit_cut").await;
    let table = format!("{}.rows", db.schema);
    sqlx::query(&format!(
        "CREATE TABLE {table} (k text PRIMARY KEY, v text NOT NULL, version bigint NOT NULL)"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    let proxy = Proxy::start(database_addr().await).await;
    let through = pool_through(&proxy).await;
    let read = {
        let (pool, table) = (through.clone(), table.clone());
        move |keys: Vec<String>| {
            let (pool, table) = (pool.clone(), table.clone());
            async move {
                let rows: Vec<(String, String, i64)> = sqlx::query_as(&format!(
                    "SELECT k, v, version FROM {table} WHERE k = ANY($1)"
                ))
                .bind(&keys)
                .fetch_all(&pool)
                .await?;
                let mut found: HashMap<String, (String, u64)> = rows
                    .into_iter()
                    .map(|(k, v, version)| (k, (v, u64::try_from(version).unwrap())))
                    .collect();
                Ok::<_, sqlx::Error>(
                    keys.into_iter()
                        .map(|k| {
                            let row = found.remove(&k);
                            (k, row)
                        })
                        .collect(),
                )
            }
        }
    };
    let cache: SyncedCache<String, String> =
        SyncedCache::builder("rows", moka::future::Cache::new(1000))
            .audit(
                Audit::versioned(read)
                    .rate(1000)
                    .batch(10)
                    .grace(Duration::from_millis(300))
                    .timeout(READ_TIMEOUT),
            )
            .build()
            .unwrap();
    let transport = EmbeddedTransport::new();
    let node = Node::builder("n", transport.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();
    let publisher = Publisher::new(transport);

    // The writer: each write to the database first, then published as a
    // versioned refresh, which the node holds: entries to judge.
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let (pool, table, writing, publisher) = (
            db.pool.clone(),
            table.clone(),
            writing.clone(),
            publisher.clone(),
        );
        tokio::spawn(async move {
            let mut version = 0u64;
            while writing.load(Ordering::Relaxed) {
                version += 1;
                // Every row once, then a few hot ones: the rest stay as
                // they are through the cuts, so a false verdict on one of
                // them is not cleared by the next write.
                let k = if version <= KEYS {
                    format!("k{version}")
                } else {
                    format!("k{}", version % 4)
                };
                let v = format!("v{version}");
                sqlx::query(&format!(
                    "INSERT INTO {table} (k, v, version) VALUES ($1, $2, $3) \
                     ON CONFLICT (k) DO UPDATE SET v = $2, version = $3"
                ))
                .bind(&k)
                .bind(&v)
                .bind(i64::try_from(version).unwrap())
                .execute(&pool)
                .await
                .unwrap();
                publisher
                    .insert_versioned("rows", [(k, v, Some(version))])
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    eventually("entries to audit and a first check", async || {
        cache.status().entries >= KEYS && audit_of(&cache).checks > 0
    })
    .await;

    // Cut both ways, then the answers only, then slowed past the timeout:
    // each outlives the read timeout several times over.
    let before = audit_of(&cache);
    for cut in 0..3 {
        match cut {
            0 => proxy.blackhole(),
            1 => proxy.cut_one_way(false),
            _ => proxy.latency(READ_TIMEOUT * 2),
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        proxy.heal();
        proxy.latency(Duration::ZERO);
        // Reading again before the next cut (the failures backed it off).
        let failures = audit_of(&cache).source_failures;
        let reads = audit_of(&cache).source_reads;
        eventually(&format!("reads answered after cut {cut}"), async || {
            let a = audit_of(&cache);
            a.source_reads > reads + 2 && a.source_failures == failures
        })
        .await;
    }
    let after = audit_of(&cache);
    eprintln!(
        "across the cuts: {} checks, {} source reads, {} failed, {} suspects ({} cleared), \
         {} inconsistencies",
        after.checks - before.checks,
        after.source_reads - before.source_reads,
        after.source_failures - before.source_failures,
        after.suspects - before.suspects,
        after.suspects_cleared - before.suspects_cleared,
        after.inconsistencies
    );
    assert_eq!(
        after.inconsistencies, 0,
        "a cut-off source made inconsistencies: {after:?}"
    );
    assert!(
        after.source_failures >= before.source_failures + 3,
        "the cuts failed no read: {after:?}"
    );

    // Still auditing: a write that bypasses the publisher is found.
    writing.store(false, Ordering::Relaxed);
    writer.await.unwrap();
    sqlx::query(&format!(
        "UPDATE {table} SET v = 'bypassed', version = version + 1000000 WHERE k = 'k10'"
    ))
    .execute(&db.pool)
    .await
    .unwrap();
    eventually("the bypassing write found", async || {
        audit_of(&cache).inconsistencies >= 1
    })
    .await;
    assert_eq!(
        audit_of(&cache).inconsistencies,
        1,
        "only the bypassing write is inconsistent"
    );
    node.shutdown().await.unwrap();
    db.drop_schema().await;
}
