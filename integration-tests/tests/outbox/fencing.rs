//! A relay whose database session dies at each step of a pass: fenced, so it
//! publishes nothing more and loses nothing.

use super::*;

/// When, in a pass of relay A, its database session dies (issue 21,
/// item 1: a relay that does not know it was replaced).
#[derive(Debug, Clone, Copy)]
enum Kill {
    /// While A waits for its `SELECT` of the rows (the test holds the
    /// table): after the lock and the term, before any publish.
    InSelect,
    /// While A's publish of its `n`th event is slow: that publish lands
    /// after relay B has taken over and published every row.
    DuringPublish(usize),
    /// After A's `n`th publish returned, before its next row.
    AfterPublish(usize),
}

/// Kills every session of `application_name` (a relay's whole pool).
async fn kill_sessions(pool: &PgPool, application_name: &str) {
    sqlx::query(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
    )
    .bind(application_name)
    .execute(pool)
    .await
    .unwrap();
}

/// Relay A's session dies at `at`, relay B takes over. Eight unversioned
/// refreshes of two keys (values 1 to 8, the last of each key 7 and 8).
/// Whatever the step: A publishes nothing once it could know it lost the
/// lock (at most the one publish in flight), B publishes every row, and
/// the node ends with each key's last value or with nothing (a fenced
/// late row is applied as an invalidation, and the next read loads the
/// database's row): never an older value.
async fn a_relay_whose_session_dies(at: Kill) {
    let db = TestDb::new("fence").await;
    let outbox = db.outbox();
    for i in 1..=8u32 {
        let mut tx = db.pool.begin().await.unwrap();
        let key = if i % 2 == 1 { "odd" } else { "even" };
        outbox
            .insert_versioned(&mut tx, "t", [(key, marker(i), None)])
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let embedded = EmbeddedTransport::new();
    let cache = SyncedCache::<String, String>::new("t", moka::future::Cache::new(10));
    let node = Node::builder("n", embedded.clone())
        .register(&cache)
        .start()
        .await
        .unwrap();

    let name_a = format!("relay-a-{}", db.schema);
    let options: sqlx::postgres::PgConnectOptions = database_url().parse().unwrap();
    let pool_a = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.application_name(&name_a))
        .await
        .unwrap();
    // Relay A's transport parks the publish the test kills A's session at.
    let a_transport = FaultyTransport::new(embedded.clone());
    // Kept, so its change events can be counted apart from its publisher's
    // announcements (sent from a second after its first publish, and
    // counted as publishes too).
    a_transport.record_publishes(true);
    let nth = |k: usize| {
        let calls = AtomicUsize::new(0);
        move |_: &str, _: &[u8]| calls.fetch_add(1, Ordering::SeqCst) + 1 == k
    };
    match at {
        Kill::InSelect => {}
        Kill::DuringPublish(k) => a_transport.hang_publishes_where(nth(k)),
        Kill::AfterPublish(k) => a_transport.hang_after_broker_where(nth(k)),
    }
    // A's publishes that reached the broker when its session was killed.
    let mut killed_at = None;
    // Held by the test while A selects, for `InSelect`.
    let mut table_lock = None;
    let b_transport = FaultyTransport::new(embedded.clone());
    b_transport.record_publishes(true);
    // Started before the table is let go, for `InSelect`.
    let mut relay_b_early = None;
    if let Kill::InSelect = at {
        let mut tx = db.pool.begin().await.unwrap();
        sqlx::query(&format!(
            "LOCK TABLE {}.outbox IN ACCESS EXCLUSIVE MODE",
            db.schema
        ))
        .execute(&mut *tx)
        .await
        .unwrap();
        table_lock = Some(tx);
    }
    let relay_a = OutboxRelay::builder(pool_a.clone(), Publisher::new(a_transport.clone()))
        .outbox(db.outbox())
        .poll_interval(Duration::from_millis(50))
        .start()
        .await
        .unwrap();
    if let Some(tx) = table_lock.take() {
        eventually("relay A waits for the table", async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 \
                 AND wait_event_type = 'Lock'",
            )
            .bind(&name_a)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            waiting == 1
        })
        .await;
        kill_sessions(&db.pool, &name_a).await;
        killed_at = Some(events(&a_transport).len());
        // B takes its pass (the leader lock) and queues for the table
        // before the test lets go of it: otherwise A's next pass, on a new
        // session, could take the lock first and publish the rows, as a
        // relay that holds the lock may (it is no longer the one whose
        // session died), and the check below could not tell.
        relay_b_early = Some(db.relay(Publisher::new(b_transport.clone())).await);
        eventually("relay B waits for the table", async || {
            let waiting: i64 = sqlx::query_scalar(&format!(
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                 WHERE NOT l.granted AND l.relation = '{}.outbox'::regclass \
                 AND a.application_name <> $1",
                db.schema
            ))
            .bind(&name_a)
            .fetch_one(&db.pool)
            .await
            .unwrap();
            waiting >= 1
        })
        .await;
        tx.rollback().await.unwrap();
    }
    // B starts once A holds its pass (or has died in it).
    eventually("relay A started its pass", async || {
        a_transport.publishes() + a_transport.hanging() > 0 || killed_at.is_some()
    })
    .await;
    // Relay B's transport keeps what B sends, on the node's broker.
    let relay_b = match relay_b_early {
        Some(relay) => relay,
        None => db.relay(Publisher::new(b_transport.clone())).await,
    };
    if let Kill::DuringPublish(_) | Kill::AfterPublish(_) = at {
        eventually("relay A's publish is parked", async || {
            a_transport.hanging() == 1
        })
        .await;
        kill_sessions(&db.pool, &name_a).await;
        killed_at = Some(events(&a_transport).len());
        if let Kill::DuringPublish(_) = at {
            // The publish in flight when the session died lands after B
            // took over and published every row, as a slow broker call would.
            eventually("relay B drained the outbox", async || db.rows().await == 0).await;
        }
        a_transport.hang_publishes(false);
    }
    eventually("the outbox is drained", async || db.rows().await == 0).await;
    // Everything either relay will ever send has been sent once both
    // stopped; every event is then applied, in order.
    relay_b.shutdown().await;
    relay_a.shutdown().await;
    // Change events only (the markers): each publisher also announces its
    // last sequence numbers, every second from its first publish, and the
    // transports count and record those too.
    let sent = (events(&a_transport).len() + events(&b_transport).len()) as u64;
    // Applied, not read: `events_received` counts each record as the node
    // reads it, before the batch's run of events is applied, and counts
    // announcements besides; on a loaded machine it passed `sent` while
    // row 7 was read but not applied, or not read yet, and the check
    // below saw row 5.
    eventually("the node applied every event", async || {
        node.status().caches[0].events_applied >= sent
    })
    .await;
    // The publish in flight, if any, counts: it landed after the kill.
    let after_kill = events(&a_transport).len() - killed_at.expect("relay A was killed");
    assert!(
        after_kill <= usize::from(matches!(at, Kill::DuringPublish(_))),
        "{at:?}: relay A published {after_kill} events after its session died"
    );
    assert_eq!(
        events(&b_transport).len(),
        8,
        "{at:?}: relay B publishes every row A did not delete"
    );
    for (key, last) in [("odd", 7), ("even", 8)] {
        let held = cache.peek(key).await;
        assert!(
            held.is_none() || held == Some(marker(last)),
            "{at:?}: the node holds {held:?} for {key}, the database {}",
            marker(last)
        );
    }
    if let Kill::DuringPublish(_) = at {
        assert_eq!(
            node.status().events_fenced,
            1,
            "{at:?}: {:?}",
            node.status()
        );
    }
    node.shutdown().await.unwrap();
    pool_a.close().await;
    db.drop_schema().await;
}

/// An outbox made by the release before the fence has only the first
/// migration: a relay refuses to start on it, naming the fix, and
/// `migrate` brings it up to date (idempotently).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_needs_the_second_migration_and_migrate_adds_it() {
    let db = TestDb::new("upgrade").await;
    for object in ["TABLE {s}.relay", "SEQUENCE {s}.relay_term_seq"] {
        let object = object.replace("{s}", &db.schema);
        sqlx::query(&format!("DROP {object}"))
            .execute(&db.pool)
            .await
            .unwrap();
    }
    let err = OutboxRelay::builder(db.pool.clone(), Publisher::new(EmbeddedTransport::new()))
        .outbox(db.outbox())
        .start()
        .await
        .unwrap_err();
    assert!(err.is_database(), "{err}");
    assert!(err.to_string().contains("Outbox::migrate"), "{err}");
    db.outbox().migrate(&db.pool).await.unwrap();
    db.outbox().migrate(&db.pool).await.unwrap();
    let relay = db.relay(Publisher::new(EmbeddedTransport::new())).await;
    relay.shutdown().await;
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_in_its_select_publishes_nothing() {
    a_relay_whose_session_dies(Kill::InSelect).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_during_its_first_publish_is_fenced() {
    a_relay_whose_session_dies(Kill::DuringPublish(1)).await;
}

/// The case seen on the wire: `[1, 1, 2, 3, 4, 2, 3]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_during_a_slow_publish_is_fenced() {
    a_relay_whose_session_dies(Kill::DuringPublish(2)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_between_publishes_publishes_no_more() {
    a_relay_whose_session_dies(Kill::AfterPublish(3)).await;
}

/// After its last publish, before its DELETE and COMMIT: B publishes the
/// rows again; duplicates, in order, are harmless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_session_dies_before_its_commit_loses_nothing() {
    a_relay_whose_session_dies(Kill::AfterPublish(8)).await;
}
