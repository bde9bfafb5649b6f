//! Order and versions: ids and automatic versions follow commit order per
//! cache under concurrent writers, never wrap, and the delayed second
//! invalidation comes after its delay without holding anything up.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_versions_increase_pass_caller_versions_and_never_wrap() {
    let db = TestDb::new("versions").await;
    let outbox = db.outbox();
    let table = outbox.dictionary::<String, String>("c");
    let mut tx = db.pool.begin().await.unwrap();
    let a = outbox.next_version(&mut tx, "c").await.unwrap();
    let b = table.insert(&mut tx, "k", "v").await.unwrap();
    assert!(b > a);
    let caller = b + 1_000_000_000;
    table
        .invalidate_versioned(&mut tx, "k", caller)
        .await
        .unwrap();
    let c = outbox.next_version(&mut tx, "c").await.unwrap();
    assert!(c > caller, "automatic versions pass caller versions");
    let other = outbox.next_version(&mut tx, "other").await.unwrap();
    assert!(other < caller, "versions are per cache");
    tx.commit().await.unwrap();

    // A rolled-back transaction gives its version back (the counter is
    // ahead of the clock here, so the next version is the counter's + 1).
    let mut tx = db.pool.begin().await.unwrap();
    let d = outbox.next_version(&mut tx, "c").await.unwrap();
    tx.rollback().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    let e = outbox.next_version(&mut tx, "c").await.unwrap();
    assert_eq!(
        (d, e),
        (c + 1, c + 1),
        "the rolled-back version was given back"
    );

    // Versions are bigint in the database: past i64::MAX nothing follows.
    table
        .insert_versioned(&mut tx, "k", "v", u64::MAX)
        .await
        .unwrap();
    let err = table.insert(&mut tx, "k", "v").await.unwrap_err();
    assert!(
        matches!(err, Error::VersionExhausted(v) if v == i64::MAX as u64),
        "{err}"
    );
    tx.rollback().await.unwrap();
    db.drop_schema().await;
}

/// One enqueue in a transaction; returns the version it used (0 for none).
type Enqueue = Box<dyn for<'c> Fn(&'c mut sqlx::PgConnection) -> BoxFuture<'c, u64> + Send + Sync>;

/// Two transactions on one cache: A enqueues first, then B enqueues and
/// tries to commit at once, and only then A commits. Returns the commit
/// order (1 for A, 2 for B), the order the relay published them in, and
/// their versions.
async fn race(db: &TestDb, a: Enqueue, b: Enqueue) -> (Vec<u32>, Vec<u32>, u64, u64) {
    let mut tx_a = db.pool.begin().await.unwrap();
    let va = a(&mut tx_a).await;
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let task_b = {
        let pool = db.pool.clone();
        tokio::spawn(async move {
            let mut tx_b = pool.begin().await.unwrap();
            let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                .fetch_one(&mut *tx_b)
                .await
                .unwrap();
            pid_tx.send(pid).unwrap();
            let vb = b(&mut tx_b).await;
            tx_b.commit().await.unwrap();
            vb
        })
    };
    // A commits once B has either committed or waits for a lock A holds.
    // The commit order is read off which of the two it was: the clients'
    // own timing after A's commit is not (B's commit can return first).
    let pid = pid_rx.await.unwrap();
    let mut b_first = false;
    eventually("B committed or waits for a lock", async || {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)",
        )
        .bind(pid)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        b_first = task_b.is_finished();
        waiting || b_first
    })
    .await;
    tx_a.commit().await.unwrap();
    let vb = task_b.await.unwrap();
    let commit_order = if b_first { vec![2, 1] } else { vec![1, 2] };

    let rec = recorder();
    let relay = db.relay(Publisher::new(rec.clone())).await;
    wait_published(&relay, 2).await;
    relay.shutdown().await;
    let published = events(&rec).into_iter().map(|(_, m)| m).collect();
    (commit_order, published, va, vb)
}

/// The enqueue lock makes B wait for A, so A commits first and B is
/// published after it. Without the lock B commits first with the higher
/// id, and the relay, in id order, publishes A (the later commit) last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_follow_commit_order_per_cache() {
    let db = TestDb::new("commit_order").await;
    let enqueue = |m: u32| -> Enqueue {
        let outbox = db.outbox();
        Box::new(move |conn| {
            let outbox = outbox.clone();
            Box::pin(async move {
                outbox
                    .insert_versioned(conn, "c", [("k", marker(m), None)])
                    .await
                    .unwrap();
                0
            })
        })
    };
    let (commits, published, _, _) = race(&db, enqueue(1), enqueue(2)).await;
    assert_eq!(published, commits, "published in commit order");
    db.drop_schema().await;
}

/// A writes the row with its own version (a row version column ahead of
/// the clock), B with an automatic one: B commits later, so its version
/// must be the higher. Without the lock B reads the counter before A's
/// version is committed and takes the clock's, below A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automatic_versions_follow_commit_order_per_cache() {
    let db = TestDb::new("version_order").await;
    let table = db.outbox().dictionary::<String, String>("c");
    let ahead = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
        + 60_000_000;
    let a: Enqueue = {
        let table = table.clone();
        Box::new(move |conn| {
            let table = table.clone();
            Box::pin(async move {
                table
                    .insert_versioned(conn, "k", &marker(1), ahead)
                    .await
                    .unwrap()
            })
        })
    };
    let b: Enqueue = Box::new(move |conn| {
        let table = table.clone();
        Box::pin(async move { table.insert(conn, "k", &marker(2)).await.unwrap() })
    });
    let (commits, published, va, vb) = race(&db, a, b).await;
    assert_eq!(published, commits, "published in commit order");
    let version = |m: u32| if m == 1 { va } else { vb };
    assert!(
        version(commits[1]) > version(commits[0]),
        "the later commit carries the higher version: commits {commits:?}, versions A {va} B {vb}"
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delayed_second_invalidation_comes_after_its_delay_and_holds_nothing_up() {
    let db = TestDb::new("again").await;
    let delay = Duration::from_millis(1500);
    let outbox = db.builder().again_after(delay).build().unwrap();
    let rec = recorder();
    let relay = db.relay(Publisher::new(rec.clone())).await;

    let mut tx = db.pool.begin().await.unwrap();
    outbox.invalidate(&mut tx, "c", [marker(9)]).await.unwrap();
    tx.rollback().await.unwrap();

    let start = Instant::now();
    let mut tx = db.pool.begin().await.unwrap();
    outbox.invalidate(&mut tx, "c", [marker(1)]).await.unwrap();
    tx.commit().await.unwrap();
    let mut tx = db.pool.begin().await.unwrap();
    outbox
        .insert_versioned(&mut tx, "c", [(marker(2), "x", None)])
        .await
        .unwrap();
    tx.commit().await.unwrap();

    wait_published(&relay, 2).await;
    assert!(start.elapsed() < delay, "the first copies took the delay");
    assert_eq!(
        events(&rec),
        [("c".to_owned(), 1), ("c".to_owned(), 2)],
        "the delayed copies hold back neither their first copies nor a later row"
    );
    assert_eq!(db.rows().await, 2, "the second copies wait in the outbox");
    wait_published(&relay, 4).await;
    assert!(start.elapsed() >= delay, "the second copies came early");
    // The refresh's second copy is an invalidation of its key; the
    // rolled-back call's copy would have had a lower id and been due
    // earlier, so it would have come with or before these.
    assert_eq!(
        events(&rec),
        [1, 2, 1, 2].map(|m| ("c".to_owned(), m)),
        "{:?}",
        events(&rec)
    );
    let twos: Vec<_> = payloads_for(&rec, "c")
        .into_iter()
        .filter(|p| markers(p) == [2])
        .collect();
    assert_eq!(twos.len(), 2);
    assert!(
        twos[1].len() < twos[0].len(),
        "the refresh's second copy carries no value"
    );
    assert_eq!(db.rows().await, 0);
    relay.shutdown().await;
    db.drop_schema().await;
}
