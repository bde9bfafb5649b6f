//! The transport conformance suite: one set of scenarios that every
//! transport must pass, faults included. A transport is plugged in through a
//! [`Fixture`]. A scenario its broker cannot produce is listed as ignored,
//! with the reason, for that transport in `tests/conformance.rs`; run
//! anyway, it fails ([`cannot_run`]) rather than pass having tested nothing.
//!
//! The workload is randomized from a seed that is printed, so a failure can
//! be replayed with `CONFORMANCE_SEED=<seed>`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cache_sync::transport::{
    Delivery, FaultyTransport, HeartbeatSubscription, StartFrom, SubscribeOptions, Subscription,
    Transport,
};
use cache_sync::{DictionaryPublisher, NodeBuilder, Publisher, transport::FileOffsetStore};

use crate::{Db, Row, TABLE, TestNode, assert_no_stale_entries, holds_no_stale_entries};

/// Faults a transport may be asked to survive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The broker is killed (`kill -9`) and restarted on the same data.
    BrokerRestart,
    /// The broker is paused (SIGSTOP) past the client timeouts, then resumed.
    BrokerPause,
    /// The broker closes the nodes' connections.
    ConnectionKill,
    /// History is trimmed past a node that was not reading.
    TrimPastReader,
    /// The broker disconnects a slow subscriber whose output buffer overflowed.
    BufferLimitDisconnect,
    /// A node process stops and starts again, from its saved position.
    NodeRestart,
    /// While a node is paused, the broker loses all its data (killed and
    /// restarted on an empty store), and the new history grows past the
    /// paused node's position before the node resumes.
    WipeWhilePaused,
    /// On a cluster, the server that leads the topic (the master of its
    /// slot, the stream's leader, the broker of the table's queue) is
    /// killed while events flow; a replica, or the other broker, takes over. The killed server stays down until the nodes converged
    /// without it, then comes back as a replica while events flow again.
    LeaderKilled,
    /// The same server paused past the cluster's failover timeout while
    /// events flow, then resumed: it comes back a stale old leader.
    LeaderPaused,
    /// On a Redis Cluster, the topic's slot is moved to another master
    /// while events flow.
    SlotMoved,
    /// A failover that loses writes the old leader had acknowledged. On a
    /// Redis Cluster, its replica stops replicating while events flow, the
    /// master is killed and the replica takes over with what it has; on
    /// RocketMQ with two brokers, the table's broker is killed while events
    /// flow and comes back without its store.
    FailoverLosesWrites,
    /// On a cluster, the server a node is connected to is killed (and
    /// started again) while events flow; others serve the topic on.
    ConnectedServerKilled,
}

impl Fault {
    /// Whether the fault needs a cluster of servers.
    pub fn needs_a_cluster(self) -> bool {
        matches!(
            self,
            Fault::LeaderKilled
                | Fault::LeaderPaused
                | Fault::SlotMoved
                | Fault::FailoverLosesWrites
                | Fault::ConnectedServerKilled
        )
    }
}

/// What a fault should do to a node's view, per transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Nothing is lost: the node resumes and no loss is signalled.
    NoLoss,
    /// Events may be lost: at least one loss must be signalled and counted.
    Loss,
    /// Events may or may not be lost (a failover loses what its replica
    /// had not received, if anything): the check is that every node agrees
    /// with the source of truth afterwards, so any loss was detected.
    MayLose,
}

/// A transport under test.
#[async_trait]
pub trait Fixture: Send + Sync {
    /// For messages: `"redis-streams"`, ….
    fn name(&self) -> &'static str;
    /// A new client, as another process would make.
    async fn transport(&self) -> Arc<dyn Transport>;
    /// Node settings the transport needs in tests (short timeouts).
    fn configure(&self, b: NodeBuilder) -> NodeBuilder {
        b.reconnect_backoff(Duration::from_millis(10), Duration::from_millis(250))
    }
    /// What `fault` should do, or `None` if this transport cannot show it.
    fn expect(&self, fault: Fault) -> Option<Expect>;
    /// Makes the broker-side part of `fault` happen; returns when it healed,
    /// or, for a server killed on a cluster, once the others took over.
    async fn inject(&mut self, fault: Fault);
    /// Brings back what [`Fixture::inject`] left down (a killed leader
    /// returns as a replica), once the nodes showed they converge without
    /// it: a node that reads only through the dead server must not wait for
    /// it to return.
    async fn heal(&mut self, fault: Fault) {
        let _ = fault;
    }
    /// How soon after its broker is killed every node must report itself
    /// unhealthy (`consuming: false`), or `None` without a broker.
    fn health_bound(&self) -> Option<Duration>;
    /// The largest message the broker takes, where it is below the 8 MiB
    /// that [`a_refusal_is_no_disconnect`] publishes (`None`: it takes that).
    fn max_message_bytes(&self) -> Option<usize> {
        None
    }
    /// What the broker holds for `topic`, read beside the transport, or
    /// `None` where the suite has no such look.
    fn stored(&self, topic: &str) -> Option<Stored> {
        let _ = topic;
        None
    }
    /// Kills the broker (`kill -9`) and leaves it down.
    fn kill(&mut self) {}
    /// Starts a killed broker again, on the same data.
    fn revive(&mut self) {}
    /// Pauses the broker (SIGSTOP) and leaves it paused; false without a
    /// broker to pause.
    fn pause(&mut self) -> bool {
        false
    }
    /// Resumes a paused broker.
    fn resume(&mut self) {}
    /// How long after the suite's fence a cache's event may still arrive.
    /// The fence is a cache of its own; where caches travel in different
    /// queues (RocketMQ with two brokers), it can overtake the table's
    /// events, and a node holds an entry they change until they arrive.
    /// Zero (the default) where one queue orders them: any stale entry
    /// after the fence then fails at once.
    fn settle(&self) -> Duration {
        Duration::ZERO
    }
}

/// Ends a scenario that its fixture cannot produce. Such a case is listed as
/// ignored for that transport in `tests/conformance.rs`, so `cargo test`
/// prints it as ignored; run anyway (`--ignored`), it fails rather than
/// pass having tested nothing.
pub fn cannot_run(transport: &str, what: &str) -> ! {
    panic!(
        "{transport}: the fixture cannot produce {what}; this case is listed as \
         ignored for {transport} in tests/conformance.rs, and never passes here"
    )
}

/// What a broker holds for a topic (see [`Fixture::stored`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    /// Records in the topic's change history.
    pub history: u64,
    /// Messages its heartbeat channel keeps.
    pub heartbeats: u64,
    /// How long the heartbeat channel lives on without a publish, if it
    /// expires.
    pub heartbeats_expire_in: Option<Duration>,
}

/// Publishes enough events that a new history grows well past any position
/// a node held in the old one (the suite's workloads publish hundreds).
pub async fn regrow(transport: Arc<dyn Transport>) {
    let p = Publisher::builder(transport)
        .origin("regrow")
        .build()
        .expect("publisher");
    for i in 0..1500u32 {
        retry(|| p.insert("filler", [(i, i)])).await;
    }
}

/// A seeded generator (SplitMix64): small, and the same everywhere.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// From `CONFORMANCE_SEED` if set, else from the clock; printed either way.
    pub fn from_env(test: &str) -> Self {
        let seed = std::env::var("CONFORMANCE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            });
        eprintln!("{test}: CONFORMANCE_SEED={seed}");
        Self(seed)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// Keys the workload touches.
pub const KEYS: usize = 8;

fn key(i: u64) -> String {
    format!("k{i}")
}

/// Nodes, admins and the database of one scenario.
pub struct Cluster {
    /// The source of truth.
    pub db: Arc<Db>,
    /// The nodes; a restarted node replaces its slot.
    pub nodes: Vec<TestNode>,
    admins: Vec<DictionaryPublisher<String, Row>>,
    fencer: Publisher,
    fences: u64,
    dirs: Vec<tempfile::TempDir>,
    /// Node 0's faults: a stall parks it (it keeps running, caches and
    /// all, and holds back what it read). Shared by its restarts.
    gate: Option<FaultyTransport>,
    /// The fixture's [`Fixture::settle`].
    settle: Duration,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Starts `n` nodes, each with its own client and offset file.
    pub async fn start(fixture: &dyn Fixture, n: usize) -> Self {
        let mut gate = None;
        let mut nodes = Vec::new();
        let mut dirs = Vec::new();
        let db: Arc<Db> = Arc::default();
        for i in 0..n {
            let dir = tempfile::tempdir().expect("node dir");
            nodes.push(start_node(fixture, i, dir.path(), &mut gate, &db).await);
            dirs.push(dir);
        }
        let mut admins = Vec::new();
        for i in 0..2 {
            let p = Publisher::builder(fixture.transport().await)
                .origin(format!("admin-{i}"))
                .build()
                .expect("publisher");
            admins.push(p.dictionary(TABLE));
        }
        let fencer = Publisher::builder(fixture.transport().await)
            .origin("fencer")
            .build()
            .expect("publisher");
        Self {
            db,
            nodes,
            admins,
            fencer,
            fences: 0,
            dirs,
            gate,
            settle: fixture.settle(),
        }
    }

    /// `ops` random writes (upserts and deletes from two admins, database
    /// first) interleaved with read-through loads on random nodes. A publish
    /// that fails is retried, as an admin with an outbox would.
    pub async fn workload(&self, rng: &mut Rng, ops: usize) {
        for _ in 0..ops {
            let k = key(rng.below(KEYS as u64));
            match rng.below(10) {
                0..=3 => {
                    let value = format!("v{}", rng.below(1000));
                    let version = self.db.upsert(&k, &value);
                    let admin = &self.admins[rng.below(2) as usize];
                    let row = Some(value);
                    retry(|| admin.insert_versioned(&k, &row, version)).await;
                }
                4 => {
                    let version = self.db.delete(&k);
                    let admin = &self.admins[rng.below(2) as usize];
                    retry(|| admin.invalidate_versioned(&k, version)).await;
                }
                _ => {
                    let node = &self.nodes[rng.below(self.nodes.len() as u64) as usize];
                    node.read(&self.db, &k, rng.below(3) as u32).await;
                }
            }
        }
    }

    /// Waits until every node has applied everything published so far, then
    /// checks that no node holds a stale entry. The fence is published again
    /// until every node has it: on a lossy transport a node that is still
    /// re-subscribing misses it (and signals that loss).
    pub async fn converge(&mut self) {
        self.fences += 1;
        let n = self.fences;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            retry(|| self.fencer.insert("fence", [("fence", n)])).await;
            let mut all = true;
            for node in &self.nodes {
                let key = "fence".to_owned();
                let wait = tokio::time::Instant::now() + Duration::from_millis(200);
                while node.fence.peek(&key).await != Some(n) {
                    if tokio::time::Instant::now() > wait {
                        all = false;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            if all {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nodes never applied fence {n}"
            );
        }
        let keys: Vec<String> = (0..KEYS as u64).map(key).collect();
        let settled = tokio::time::Instant::now() + self.settle;
        while tokio::time::Instant::now() < settled
            && !holds_no_stale_entries(&self.db, &self.nodes, &keys).await
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_no_stale_entries(&self.db, &self.nodes, &keys).await;
        for node in &self.nodes {
            for k in &keys {
                assert_eq!(
                    node.read(&self.db, k, 0).await,
                    self.db.get(k),
                    "{} reads {k}",
                    node.node.id()
                );
            }
        }
    }

    /// Stops node `i` cleanly (its position is saved).
    pub async fn stop_node(&mut self, i: usize) {
        self.nodes[i].node.shutdown().await.expect("shutdown");
    }

    /// Starts node `i` again from its saved position, with fresh caches (a
    /// new process).
    pub async fn restart_node(&mut self, fixture: &dyn Fixture, i: usize) {
        let old = std::mem::replace(
            &mut self.nodes[i],
            start_node(fixture, i, self.dirs[i].path(), &mut self.gate, &self.db).await,
        );
        assert_consistent(&old);
    }

    /// Stops node 0 reading: it keeps running, caches and all, and holds
    /// back what it has read. Returns once it is parked, so everything
    /// published afterwards is behind it.
    pub async fn park_node_0(&self) {
        let gate = self.gate.as_ref().expect("node 0 is gated");
        gate.stall(true);
        let fencer = &self.fencer;
        let n = self.fences;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while gate.holding() == 0 {
            // Something to read, so the node reaches the gate.
            retry(|| fencer.insert("fence", [("fence", n)])).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(
                tokio::time::Instant::now() < deadline,
                "node 0 never parked"
            );
        }
    }

    /// Lets node 0 read again.
    pub fn release_node_0(&self) {
        self.gate.as_ref().expect("node 0 is gated").stall(false);
    }

    /// Losses counted on every node.
    pub fn losses(&self) -> Vec<u64> {
        self.nodes.iter().map(|n| n.node.status().losses).collect()
    }

    /// Losses the transport signalled (not inferred from publisher gaps).
    pub fn transport_losses(&self) -> Vec<u64> {
        self.nodes
            .iter()
            .map(|n| {
                let s = n.node.status();
                s.losses - s.publisher_gaps
            })
            .collect()
    }

    /// Shuts every node down.
    pub async fn shutdown(self) {
        for n in self.nodes {
            let _ = n.node.shutdown().await;
            assert_consistent(&n);
        }
    }

    /// Checks made by every node's auditor so far.
    pub fn audit_checks(&self) -> u64 {
        self.nodes
            .iter()
            .map(|n| n.table.status().audit.map_or(0, |a| a.checks))
            .sum()
    }
}

/// No node's auditor found an inconsistency: with no write bypassing the
/// publishers, one would be a false positive, whatever the faults.
fn assert_consistent(node: &TestNode) {
    let audit = node.table.status().audit.expect("audited");
    assert_eq!(
        audit.inconsistencies,
        0,
        "{}'s auditor counted inconsistencies with no write bypassing the publishers: {audit:?}",
        node.node.id()
    );
}

async fn start_node(
    fixture: &dyn Fixture,
    i: usize,
    dir: &std::path::Path,
    gate: &mut Option<FaultyTransport>,
    db: &Arc<Db>,
) -> TestNode {
    let mut transport = fixture.transport().await;
    if i == 0 {
        // A new client, as a restarted process makes, under the same switch.
        let gated = match gate {
            Some(gate) => gate.sharing(transport),
            None => FaultyTransport::new(transport),
        };
        *gate = Some(gated.clone());
        transport = Arc::new(gated);
    }
    let store = FileOffsetStore::new(dir);
    TestNode::start_audited(
        &format!("node-{i}"),
        transport,
        |b| fixture.configure(b).offset_store(store),
        db,
    )
    .await
    .expect("start node")
}

async fn fence_only(nodes: &[TestNode], n: u64) {
    for node in nodes {
        let key = "fence".to_owned();
        crate::eventually(
            &format!("{} applies fence {n}", node.node.id()),
            async || node.fence.peek(&key).await == Some(n),
        )
        .await;
    }
}

/// Publishes that failed, process-wide. A failed publish may or may not have
/// reached the broker, so it uses up its sequence number and nodes see a gap:
/// a gap without a failed publish would be a real loss.
static FAILED_PUBLISHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Retries a publish until it succeeds (for up to 30 s).
pub async fn retry<T, F, Fut>(mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = cache_sync::Result<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => {
                FAILED_PUBLISHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "publish kept failing: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Every node gets every event, in order, filtered per cache, and converges
/// on the database under a random workload.
pub async fn normal_path(fixture: &mut dyn Fixture) {
    let mut rng = Rng::from_env(&format!("{}/normal_path", fixture.name()));
    let mut cluster = Cluster::start(fixture, 3).await;
    cluster.workload(&mut rng, 300).await;
    cluster.converge().await;
    // Every node reads every key fresh, with its version: entries the
    // auditors judge by version even where the caches were quarantined
    // throughout (Pub/Sub has no history to replay at start, so its
    // refreshes landed as invalidations and its loads carried none).
    let keys: Vec<String> = (0..KEYS as u64).map(key).collect();
    for node in &cluster.nodes {
        for k in &keys {
            let db = &cluster.db;
            let read = node
                .table
                .get_fresh(k.clone(), || async move {
                    let (row, version) = db
                        .read_versioned(vec![k.clone()])
                        .pop()
                        .and_then(|(_, row)| row)
                        .expect("a row for every key asked");
                    (row, version)
                })
                .await;
            assert_eq!(
                read,
                cluster.db.get(k),
                "{} reads {k} fresh",
                node.node.id()
            );
        }
    }
    // The auditors ran (each scenario's end checks they found nothing),
    // and, every entry now agreeing with the database, each suspect still
    // waiting is cleared when its grace window ends, never counted.
    crate::eventually("the auditors check entries", async || {
        cluster.audit_checks() > 0
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while cluster.nodes.iter().any(|n| {
        n.table
            .status()
            .audit
            .is_some_and(|a| a.suspects_pending > 0)
    }) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "suspects still pending 40 s after converging"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for node in &cluster.nodes {
        let s = node.node.status();
        assert_eq!(
            (s.losses, s.publisher_gaps, s.events_rejected),
            (0, 0, 0),
            "{}: {s:?}",
            fixture.name()
        );
    }
    order_and_filtering(fixture).await;
    cluster.shutdown().await;
}

/// Events of one publisher arrive in publish order on every node, and each
/// node only applies events for caches it registered.
async fn order_and_filtering(fixture: &dyn Fixture) {
    let transport = fixture.transport().await;
    let only_table = TestNode::start("only-table", fixture.transport().await, |b| {
        fixture.configure(b)
    })
    .await
    .expect("node");
    // Unversioned refreshes of one key: the last one published must win, which
    // only holds if delivery keeps publish order.
    let p = Publisher::new(transport);
    for i in 0..200u32 {
        retry(|| p.insert(TABLE, [("ordered", Some(format!("{i}")))])).await;
    }
    retry(|| p.insert("not-registered-anywhere", [("x", 1u8)])).await;
    retry(|| p.insert("fence", [("fence", 99u64)])).await;
    fence_only(std::slice::from_ref(&only_table), 99).await;
    let settled = tokio::time::Instant::now() + fixture.settle();
    while tokio::time::Instant::now() < settled
        && only_table.table.peek("ordered").await != Some(Some("199".to_owned()))
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        only_table.table.peek("ordered").await,
        Some(Some("199".to_owned())),
        "{}: the last refresh published must be the one that sticks",
        fixture.name()
    );
    let s = only_table.node.status();
    assert_eq!(
        s.caches.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["fence", TABLE]
    );
    assert_eq!(s.events_rejected, 0);
    let _ = only_table.node.shutdown().await;
}

/// Runs the workload, injects `fault` in the middle, heals it, and checks
/// that every node converges and that the loss, if any, was signalled.
pub async fn survives(fixture: &mut dyn Fixture, fault: Fault) {
    let Some(expect) = fixture.expect(fault) else {
        cannot_run(fixture.name(), &format!("{fault:?}"));
    };
    let mut rng = Rng::from_env(&format!("{}/{fault:?}", fixture.name()));
    let mut cluster = Cluster::start(fixture, 3).await;
    cluster.workload(&mut rng, 100).await;
    cluster.converge().await;
    let before = cluster.losses();
    let transport_before = cluster.transport_losses();
    let failed_before = FAILED_PUBLISHES.load(std::sync::atomic::Ordering::Relaxed);

    match fault {
        Fault::NodeRestart => {
            // Node 0 is away while traffic continues.
            cluster.stop_node(0).await;
            cluster.workload(&mut rng, 50).await;
            fixture.inject(fault).await;
            cluster.restart_node(fixture, 0).await;
        }
        Fault::TrimPastReader | Fault::WipeWhilePaused => {
            // Node 0 keeps running, with its caches, but stops reading while
            // traffic continues, and history is cut past its position or
            // replaced by a new one grown past it.
            cluster.park_node_0().await;
            cluster.workload(&mut rng, 50).await;
            fixture.inject(fault).await;
            cluster.release_node_0();
        }
        _ => {
            // Traffic goes on while the fault happens and heals.
            let traffic = cluster.workload(&mut rng, 60);
            tokio::join!(fixture.inject(fault), traffic);
        }
    }
    // Converge before any new write: what was lost must be answered by the
    // loss signal, not papered over by later events for the same keys.
    cluster.converge().await;
    cluster.workload(&mut rng, 100).await;
    cluster.converge().await;
    // What was left down comes back while events flow, and the nodes
    // converge again with it.
    let traffic = cluster.workload(&mut rng, 60);
    tokio::join!(fixture.heal(fault), traffic);
    // And once it is back.
    cluster.workload(&mut rng, 30).await;
    if (fault, expect) == (Fault::FailoverLosesWrites, Expect::Loss) {
        // Writes were lost on the servers: the transport itself must tell,
        // once the server that lost them serves the topic again. Publisher
        // gaps alone would miss a publisher that sent nothing after them.
        crate::eventually(
            &format!(
                "{}: a node's transport signals the lost writes",
                fixture.name()
            ),
            async || {
                let now = cluster.transport_losses();
                now.iter().zip(&transport_before).any(|(a, b)| a > b)
            },
        )
        .await;
    }
    cluster.converge().await;

    let after = cluster.losses();
    if fault.needs_a_cluster() {
        // What the failover cost, for the record (docs/transports.md).
        let reasons: Vec<_> = cluster
            .nodes
            .iter()
            .map(|n| n.node.status().last_loss_reason)
            .collect();
        eprintln!(
            "{}: {fault:?}: losses per node {before:?} -> {after:?}, from the transport \
             {transport_before:?} -> {:?}, last reasons {reasons:?}",
            fixture.name(),
            cluster.transport_losses()
        );
    }
    match (fault, expect) {
        // The transport itself must tell: publisher gaps alone would miss
        // the writers that published nothing after the wipe.
        (Fault::WipeWhilePaused, Expect::Loss) => {
            let transport = cluster.transport_losses();
            assert!(
                transport[0] > transport_before[0],
                "{}: {fault:?} must be signalled by the transport on the paused node: \
                 before {transport_before:?}, after {transport:?}",
                fixture.name()
            );
        }
        // A restarted node starts with new counters; its loss shows there.
        (Fault::NodeRestart | Fault::TrimPastReader, Expect::Loss) => {
            assert!(
                after[0] >= 1,
                "{}: {fault:?} must be signalled on the node that was away: {after:?}",
                fixture.name()
            );
        }
        (Fault::NodeRestart | Fault::TrimPastReader, Expect::NoLoss) => {
            assert_eq!(
                after[0],
                0,
                "{}: {fault:?} must lose nothing: {after:?}",
                fixture.name()
            );
        }
        // Printed above; the convergence checks are the test.
        (_, Expect::MayLose) => {}
        (_, Expect::Loss) => {
            let signalled = after.iter().zip(&before).filter(|(a, b)| a > b).count();
            assert!(
                signalled >= 1,
                "{}: {fault:?} must be signalled: before {before:?}, after {after:?}",
                fixture.name()
            );
        }
        (_, Expect::NoLoss) => {
            let reasons: Vec<_> = cluster
                .nodes
                .iter()
                .map(|n| n.node.status().last_loss_reason)
                .collect();
            assert_eq!(
                cluster.transport_losses(),
                transport_before,
                "{}: {fault:?} must lose nothing; reasons {reasons:?}",
                fixture.name()
            );
            // Gaps are allowed only where a publish failed during the fault.
            let failed =
                FAILED_PUBLISHES.load(std::sync::atomic::Ordering::Relaxed) > failed_before;
            assert!(
                after == before || failed,
                "{}: gaps without a failed publish: {after:?}",
                fixture.name()
            );
        }
    }
    cluster.shutdown().await;
}

/// Kills the broker: within the transport's documented bound every node
/// reports itself unhealthy; once the broker is back, every node reports
/// itself healthy again and applies new events.
pub async fn health_follows_the_broker(fixture: &mut dyn Fixture) {
    let Some(bound) = fixture.health_bound() else {
        cannot_run(fixture.name(), "a killed broker");
    };
    let mut cluster = Cluster::start(fixture, 2).await;
    cluster.converge().await;
    for node in &cluster.nodes {
        assert!(
            node.node.is_consuming(),
            "{}: healthy before",
            fixture.name()
        );
    }
    fixture.kill();
    let killed = tokio::time::Instant::now();
    for node in &cluster.nodes {
        while node.node.is_consuming() {
            assert!(
                killed.elapsed() < bound,
                "{}: {} still reports itself healthy {:?} after its broker was killed \
                 (documented bound {bound:?})",
                fixture.name(),
                node.node.id(),
                killed.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!(
        "{}: every node unhealthy {:?} after the kill",
        fixture.name(),
        killed.elapsed()
    );
    // A publish meanwhile fails, and calls itself what it is.
    let err = cluster.nodes[0]
        .node
        .publisher()
        .insert("health-probe", [("k", "v")])
        .await
        .expect_err("a publish to a killed broker succeeded");
    assert!(
        err.is_disconnected(),
        "{}: a publish to a killed broker failed, but not as disconnected: {err}",
        fixture.name()
    );
    fixture.revive();
    for node in &cluster.nodes {
        crate::eventually(
            &format!("{} reports itself healthy again", node.node.id()),
            async || node.node.is_consuming(),
        )
        .await;
    }
    cluster.converge().await;
    cluster.shutdown().await;
}

/// The last event before a quiet period cut before the broker got it: no
/// later event shows the gap, the publisher's announcement of its last
/// number does. Every node resyncs that cache, and no other, once the
/// reorder window has passed since the announcement arrived. (The bound,
/// announce interval + reorder window, is asserted on tokio's paused clock
/// in the library's node tests; here, brokers add their own latency.)
pub async fn publish_cut_at_the_tail(fixture: &mut dyn Fixture) {
    const EVERY: Duration = Duration::from_millis(200);
    const WINDOW: Duration = Duration::from_millis(500);
    let mut nodes = Vec::new();
    let mut dirs = Vec::new();
    for i in 0..2 {
        let dir = tempfile::tempdir().expect("node dir");
        let store = FileOffsetStore::new(dir.path());
        let node = TestNode::start(&format!("tail-{i}"), fixture.transport().await, |b| {
            fixture
                .configure(b)
                .offset_store(store)
                .reorder_window(WINDOW)
        })
        .await
        .expect("start node");
        nodes.push(node);
        dirs.push(dir);
    }
    let transport = FaultyTransport::new(fixture.transport().await);
    let admin = Publisher::builder(transport.clone())
        .origin("tail-admin")
        .announce_interval(EVERY)
        .build()
        .expect("publisher");
    retry(|| admin.insert(TABLE, [("t0", Some("v0".to_owned()))])).await;
    for node in &nodes {
        crate::eventually(&format!("{} applies t0", node.node.id()), async || {
            node.table.peek("t0").await.is_some()
        })
        .await;
    }
    // Until the announcements of t0 are over, one could take the cut
    // armed below: wait for the three after the event itself.
    crate::eventually("t0 and its three announcements published", async || {
        transport.publishes() >= 4
    })
    .await;
    for node in &nodes {
        let s = node.node.status();
        assert_eq!(
            (
                s.publisher_gaps,
                s.caches.iter().map(|c| c.loss_resyncs).sum::<u64>()
            ),
            (0, 0),
            "{}: announcements of what arrived resynced: {s:?}",
            fixture.name()
        );
    }
    transport.fail_publishes(1);
    assert!(
        admin
            .insert(TABLE, [("t1", Some("v1".to_owned()))])
            .await
            .is_err()
    );
    let cut_at = tokio::time::Instant::now();
    for node in &nodes {
        crate::eventually(
            &format!("{} resyncs the table after the tail", node.node.id()),
            async || {
                let s = node.node.status();
                s.caches
                    .iter()
                    .any(|c| c.name == TABLE && c.loss_resyncs == 1)
            },
        )
        .await;
        let s = node.node.status();
        assert!(
            cut_at.elapsed() >= WINDOW,
            "{}: {} resynced before its reorder window",
            fixture.name(),
            node.node.id()
        );
        assert_eq!(
            s.caches.iter().map(|c| c.loss_resyncs).sum::<u64>(),
            1,
            "{}: only the table is resynced: {s:?}",
            fixture.name()
        );
        assert_eq!(s.publisher_gaps, 1, "{}: {s:?}", fixture.name());
        assert_eq!(node.table.peek("t0").await, None, "{}", fixture.name());
    }
    eprintln!(
        "{}: tail loss answered {:?} after the cut (announce every {EVERY:?}, window {WINDOW:?})",
        fixture.name(),
        cut_at.elapsed()
    );
    for node in nodes {
        let _ = node.node.shutdown().await;
    }
}

/// A publish the transport refuses while the broker is up (an event over
/// its message size limit: 1 MiB on NATS, 4 MiB on RocketMQ) is not
/// reported as a lost connection: a caller that retries on
/// `is_disconnected()` would retry it for ever.
pub async fn a_refusal_is_no_disconnect(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = Publisher::builder(fixture.transport().await)
        .max_event_bytes(16 << 20)
        .build()
        .expect("publisher");
    const BIG: usize = 8 << 20;
    let big = "x".repeat(BIG);
    let published = publisher.insert("big", [("k", big.as_str())]).await;
    match (fixture.max_message_bytes(), published) {
        (Some(limit), Err(e)) if limit < BIG => {
            eprintln!("{name}: refused an 8 MiB event (limit {limit} B): {e}");
            assert!(
                !e.is_disconnected(),
                "{name}: a refusal from a live broker reported as disconnected: {e}"
            );
        }
        (Some(limit), Ok(_)) if limit < BIG => {
            panic!("{name}: took an 8 MiB event over its broker's limit of {limit} B")
        }
        (_, Ok(_)) => {}
        (_, Err(e)) => panic!("{name}: refused an 8 MiB event within its limit: {e}"),
    }
    // And the transport still works.
    retry(|| publisher.insert("small", [("k", "v")])).await;
}

/// A publish cut before the broker got it leaves a gap in that publisher's
/// numbers for that cache: every node resyncs that cache, and no other. One
/// cut after the broker got it leaves no gap, and nothing is resynced.
pub async fn publish_cut_mid_flight(fixture: &mut dyn Fixture) {
    let mut cluster = Cluster::start(fixture, 2).await;
    let transport = FaultyTransport::new(fixture.transport().await);
    let admin = Publisher::builder(transport.clone())
        .origin("cut-admin")
        // An announcement could take the cut armed for the next publish
        // (announcements run in their own task). `publish_cut_at_the_tail`
        // tests them.
        .announce_interval(Duration::MAX)
        .build()
        .expect("publisher");
    let publish = async |i: u32| {
        retry(|| admin.insert(TABLE, [(format!("cut{i}"), Some(format!("v{i}")))])).await
    };
    publish(0).await;
    cluster.converge().await;
    let resyncs = |cluster: &Cluster| -> Vec<(u64, u64)> {
        cluster
            .nodes
            .iter()
            .map(|n| (n.table.status().loss_resyncs, n.fence.status().loss_resyncs))
            .collect()
    };
    let before = resyncs(&cluster);
    let transport_before = cluster.transport_losses();

    transport.cut_publishes(1);
    assert!(
        admin
            .insert(TABLE, [("cut1", Some("v1".to_owned()))])
            .await
            .is_err()
    );
    publish(2).await;
    cluster.converge().await;
    assert_eq!(
        resyncs(&cluster),
        before,
        "{}: an event that arrived leaves no gap",
        fixture.name()
    );

    transport.fail_publishes(1);
    assert!(
        admin
            .insert(TABLE, [("cut3", Some("v3".to_owned()))])
            .await
            .is_err()
    );
    publish(4).await;
    cluster.converge().await;
    for (node, ((table, fence), (table_before, fence_before))) in cluster
        .nodes
        .iter()
        .zip(resyncs(&cluster).into_iter().zip(before))
    {
        assert_eq!(
            table,
            table_before + 1,
            "{}: {} must resync the cache whose sequence jumped",
            fixture.name(),
            node.node.id()
        );
        assert_eq!(
            fence,
            fence_before,
            "{}: {} resynced a cache whose sequence did not jump",
            fixture.name(),
            node.node.id()
        );
    }
    assert_eq!(
        cluster.transport_losses(),
        transport_before,
        "{}: the transport lost nothing",
        fixture.name()
    );
    cluster.shutdown().await;
}

/// How many tasks publish at once through one publisher in the pipelined
/// scenarios: the publisher's default window.
const TASKS: usize = 64;

/// One task's key and the value it publishes `j`th.
fn task_key(t: usize) -> String {
    format!("p{t}")
}

/// The node of a pipelined scenario, and the publisher its tasks share.
async fn pipelined_setup(
    fixture: &dyn Fixture,
    name: &str,
    window: Duration,
) -> (TestNode, Publisher) {
    let node = TestNode::start(name, fixture.transport().await, |b| {
        fixture.configure(b).reorder_window(window)
    })
    .await
    .expect("start node");
    let publisher = Publisher::builder(fixture.transport().await)
        .origin(name)
        .build()
        .expect("publisher");
    (node, publisher)
}

/// Many tasks publishing to one cache through one publisher at once
/// (pipelined, where the transport can: several calls in flight) reach a
/// node in that cache's order and all apply. The node has no reorder
/// window, so a number arriving before the one it follows would be a
/// publisher gap at once.
pub async fn pipelined_publishes_arrive_in_order(fixture: &mut dyn Fixture) {
    const EACH: usize = 20;
    let (node, publisher) = pipelined_setup(fixture, "pipelined", Duration::ZERO).await;
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let publisher = publisher.clone();
            tokio::spawn(async move {
                for j in 0..EACH {
                    publisher
                        .insert(TABLE, [(task_key(t), Some(j.to_string()))])
                        .await
                        .expect("a publish to a healthy broker");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("publishing task");
    }
    retry(|| publisher.insert("fence", [("fence", 1u64)])).await;
    fence_only(std::slice::from_ref(&node), 1).await;
    tokio::time::sleep(fixture.settle()).await;
    let name = fixture.name();
    for t in 0..TASKS {
        assert_eq!(
            node.table.peek(&task_key(t)).await,
            Some(Some((EACH - 1).to_string())),
            "{name}: each key holds its last publish"
        );
    }
    let s = node.node.status();
    let applied: u64 = s
        .caches
        .iter()
        .filter(|c| c.name == TABLE)
        .map(|c| c.events_applied)
        .sum();
    assert_eq!(
        (s.publisher_gaps, s.losses, applied),
        (0, 0, (TASKS * EACH) as u64),
        "{name}: every event applied, in order: {s:?}"
    );
    let _ = node.node.shutdown().await;
}

/// The broker is killed while many publishes are in flight, and started
/// again. Each publish returns `Ok` or an error; a value whose publish
/// returned `Ok` is never silently lost: the node holds that value or a
/// later one of the same task, or nothing (it found the gaps the failed
/// ones left and resynced); where it noticed no loss, every publish tried
/// arrived. Once the tasks publish again, it holds their last values.
pub async fn broker_killed_mid_window(fixture: &mut dyn Fixture) {
    if fixture.expect(Fault::BrokerRestart).is_none() {
        cannot_run(fixture.name(), "BrokerRestart");
    }
    let name = fixture.name();
    let (node, publisher) =
        pipelined_setup(fixture, "mid-window", Duration::from_millis(200)).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let oks = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (publisher, stop, oks, errors) =
                (publisher.clone(), stop.clone(), oks.clone(), errors.clone());
            tokio::spawn(async move {
                use std::sync::atomic::Ordering::Relaxed;
                // The last value acknowledged, and the last one tried.
                let (mut last_ok, mut last_tried) = (None, 0u64);
                let mut j = 0u64;
                while !stop.load(Relaxed) {
                    j += 1;
                    last_tried = j;
                    match publisher
                        .insert(TABLE, [(task_key(t), Some(j.to_string()))])
                        .await
                    {
                        Ok(_) => {
                            last_ok = Some(j);
                            oks.fetch_add(1, Relaxed);
                        }
                        Err(_) => {
                            errors.fetch_add(1, Relaxed);
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
                (last_ok, last_tried)
            })
        })
        .collect();
    let acknowledged = |n: u64| {
        let oks = oks.clone();
        async move {
            crate::eventually(&format!("{n} publishes acknowledged"), async || {
                oks.load(std::sync::atomic::Ordering::Relaxed) >= n
            })
            .await;
        }
    };
    acknowledged(500).await;
    fixture.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    fixture.revive();
    let after = oks.load(std::sync::atomic::Ordering::Relaxed);
    acknowledged(after + 500).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sent = Vec::new();
    for task in tasks {
        sent.push(task.await.expect("publishing task"));
    }
    // Most kills fail some publishes in flight, but not all need to: a
    // client that holds its publishes across a short outage (NATS
    // reconnects, and a JetStream publish waits out its request timeout)
    // may see every one succeed (seen under load in a full run). Then no
    // publish's outcome is unknown, and the checks below require each
    // acknowledged value held and, with no loss noticed, each one tried
    // arrived.
    // Everything sent has arrived, or its gap was answered, once a fence
    // published after it has, plus a reorder window and an announcement.
    retry(|| publisher.insert("fence", [("fence", 1u64)])).await;
    fence_only(std::slice::from_ref(&node), 1).await;
    tokio::time::sleep(Duration::from_secs(2) + fixture.settle()).await;
    for (t, (last_ok, last_tried)) in sent.iter().enumerate() {
        let held = node.table.peek(&task_key(t)).await.flatten();
        let held: Option<u64> = held.map(|v| v.parse().expect("a number"));
        if let Some(v) = held {
            assert!(
                last_ok.is_none_or(|ok| v >= ok) && v <= *last_tried,
                "{name}: {} holds {v}, though {last_ok:?} was acknowledged (tried up to {last_tried})",
                task_key(t)
            );
        }
    }
    // A failed publish is one whose outcome is unknown, not one that was
    // lost: a broker killed between storing an entry and answering it
    // (Redis with `appendfsync always` does this for every entry it read
    // before the kill) fails a publish that every node then receives. So
    // the node must notice a loss whenever some publish tried never
    // arrived: each one tried is one event of the table.
    let s = node.node.status();
    let tried = oks.load(std::sync::atomic::Ordering::Relaxed)
        + errors.load(std::sync::atomic::Ordering::Relaxed);
    let arrived: u64 = s
        .caches
        .iter()
        .filter(|c| c.name == TABLE)
        .map(|c| c.events_applied)
        .sum();
    let noticed =
        s.losses > 0 || s.publisher_gaps > 0 || s.caches.iter().any(|c| c.loss_resyncs > 0);
    // Nothing noticed is right only when each one tried arrived once.
    assert!(
        noticed || (arrived == tried && s.events_late == 0),
        "{name}: {tried} publishes tried, {arrived} arrived, and the node noticed nothing: {s:?}"
    );
    // Published again, every task's last value reaches the node.
    for t in 0..TASKS {
        retry(|| publisher.insert(TABLE, [(task_key(t), Some("last".to_owned()))])).await;
    }
    retry(|| publisher.insert("fence", [("fence", 2u64)])).await;
    fence_only(std::slice::from_ref(&node), 2).await;
    tokio::time::sleep(fixture.settle()).await;
    for t in 0..TASKS {
        assert_eq!(
            node.table.peek(&task_key(t)).await,
            Some(Some("last".to_owned())),
            "{name}: {} after the broker came back",
            task_key(t)
        );
    }
    let _ = node.node.shutdown().await;
}

/// Topic names that once shared a broker resource, or broke one: each must
/// get a resource of its own, and a node on one sees none of the other's
/// events. Cache names with the characters brokers give meaning to work too.
pub async fn names_map_one_to_one(fixture: &mut dyn Fixture) {
    let pairs: [(&str, &str); 6] = [
        ("tenant.a", "tenant_a"),
        ("x", "x:n"),
        (">", "tenant.*"),
        ("a b", "a%20b"),
        ("über", "%C3%BCber"),
        ("x:e", "x"),
    ];
    for (a, b) in pairs {
        let mut nodes = Vec::new();
        for topic in [a, b] {
            let cache =
                cache_sync::SyncedCache::new("c", moka::future::Cache::<String, String>::new(10));
            let node = fixture
                .configure(cache_sync::Node::builder(
                    format!("node-{topic}"),
                    fixture.transport().await,
                ))
                .topic(topic)
                // No look-back: "x" comes up twice, and only this pair's
                // events may reach it.
                .reorder_window(Duration::ZERO)
                .register(&cache)
                .start()
                .await
                .unwrap_or_else(|e| panic!("{}: topic {topic:?}: {e}", fixture.name()));
            nodes.push((topic, node, cache));
        }
        for (topic, _, _) in &nodes {
            let p = Publisher::builder(fixture.transport().await)
                .topic(*topic)
                // Announcements are records too: the count below is of
                // this one event.
                .announce_interval(Duration::MAX)
                .build()
                .unwrap_or_else(|e| panic!("{}: topic {topic:?}: {e}", fixture.name()));
            retry(|| p.insert("c", [("k", topic.to_string())])).await;
        }
        for (topic, node, cache) in &nodes {
            crate::eventually(&format!("{topic:?} applies its own event"), async || {
                cache.peek("k").await.as_deref() == Some(*topic)
            })
            .await;
            let s = node.status();
            assert_eq!(
                (s.events_received, s.events_rejected, s.losses),
                (1, 0, 0),
                "{}: topic {topic:?} saw another topic's events: {s:?}",
                fixture.name()
            );
        }
        for (_, node, _) in nodes {
            let _ = node.shutdown().await;
        }
    }
    // Cache names are tags on some transports: characters that mean
    // something in a tag expression or a header must not.
    let names = [
        "feature flags",
        "a||b",
        "*",
        ".",
        "x:n",
        "ü",
        " lead",
        "%41",
    ];
    let caches: Vec<_> = names
        .iter()
        .map(|n| cache_sync::SyncedCache::new(*n, moka::future::Cache::<String, String>::new(10)))
        .collect();
    let mut builder = fixture.configure(cache_sync::Node::builder(
        "names",
        fixture.transport().await,
    ));
    for c in &caches {
        builder = builder.register(c);
    }
    let node = builder
        .start()
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", fixture.name()));
    let p = Publisher::new(fixture.transport().await);
    for n in names {
        retry(|| p.insert(n, [("k", n.to_string())])).await;
    }
    for c in &caches {
        crate::eventually(
            &format!("cache {:?} applies its event", c.name()),
            async || c.peek("k").await.as_deref() == Some(c.name()),
        )
        .await;
    }
    assert_eq!(node.status().events_rejected, 0);
    let _ = node.shutdown().await;
    // And names no transport can carry fail at build time, naming the rule.
    for bad in ["", "nul\0byte", "new\nline"] {
        let err = fixture
            .configure(cache_sync::Node::builder("bad", fixture.transport().await))
            .topic(bad)
            .start()
            .await
            .expect_err("a bad topic starts no node");
        assert!(err.is_config(), "{}: {bad:?}: {err}", fixture.name());
        let err = Publisher::builder(fixture.transport().await)
            .topic(bad)
            .build()
            .expect_err("a bad topic builds no publisher");
        assert!(err.is_config(), "{}: {bad:?}: {err}", fixture.name());
    }
    let long = "t".repeat(300);
    assert!(
        fixture
            .configure(cache_sync::Node::builder("long", fixture.transport().await))
            .topic(long.as_str())
            .start()
            .await
            .is_err_and(|e| e.is_config())
    );
}

/// How long a heartbeat or a change record may take to arrive.
const ARRIVES_WITHIN: Duration = Duration::from_secs(20);

/// How long nothing more must arrive before a subscription counts as
/// having delivered everything: a stray record has had time to show.
const QUIET: Duration = Duration::from_millis(1500);

/// How long a record already delivered to the client takes to be handed out.
const AT_HAND: Duration = Duration::from_millis(200);

/// The next heartbeat, failing the test if none comes.
async fn next_heartbeat(
    name: &str,
    what: &str,
    sub: &mut Box<dyn HeartbeatSubscription>,
) -> bytes::Bytes {
    match tokio::time::timeout(ARRIVES_WITHIN, sub.next()).await {
        Ok(Ok(payload)) => payload,
        Ok(Err(e)) => panic!("{name}: {what}: the heartbeat subscription failed: {e}"),
        Err(_) => panic!("{name}: {what}: no heartbeat within {ARRIVES_WITHIN:?}"),
    }
}

/// Returns once `sub` hears `publisher`'s heartbeats on `topic`, with
/// nothing of the wait left to read. On a cluster a subscription's interest
/// reaches the other servers a moment after it is made, and a core NATS
/// message sent before that reaches nobody (seen: the first five of 100
/// heartbeats lost during a loaded full run); a channel that keeps nothing
/// promises nothing earlier.
async fn heartbeats_reach(
    name: &str,
    publisher: &Arc<dyn Transport>,
    topic: &str,
    subs: &mut [&mut Box<dyn HeartbeatSubscription>],
) {
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    for sub in subs.iter_mut() {
        loop {
            retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from_static(b"probe"))).await;
            if let Ok(got) = tokio::time::timeout(Duration::from_millis(100), sub.next()).await {
                let got = got.unwrap_or_else(|e| panic!("{name}: a probe heartbeat: {e}"));
                assert_eq!(&got[..], b"probe", "{name}: a probe heartbeat");
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: no probe heartbeat within {ARRIVES_WITHIN:?}"
            );
        }
    }
    // Once every subscriber hears them, a last message after every probe
    // (one publisher's messages keep their order), read up to by each.
    retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from_static(b"ready"))).await;
    for sub in subs.iter_mut() {
        while &next_heartbeat(name, "the probes", sub).await[..] != b"ready" {}
    }
}

/// Fails if a heartbeat arrives within [`QUIET`].
async fn no_more_heartbeats(name: &str, what: &str, sub: &mut Box<dyn HeartbeatSubscription>) {
    if let Ok(got) = tokio::time::timeout(QUIET, sub.next()).await {
        panic!("{name}: {what}: got {got:?}, expected nothing more");
    }
}

/// Everything a change subscription delivers until it has been quiet for
/// [`QUIET`] after at least `expect` records: the payloads, and how many
/// losses it signalled.
async fn read_changes(
    name: &str,
    what: &str,
    sub: &mut Box<dyn Subscription>,
    expect: usize,
) -> (Vec<bytes::Bytes>, usize) {
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    let (mut payloads, mut losses) = (Vec::new(), 0);
    loop {
        let wait = if payloads.len() >= expect {
            QUIET
        } else {
            deadline.saturating_duration_since(tokio::time::Instant::now())
        };
        match tokio::time::timeout(wait, sub.next(1000)).await {
            Ok(Ok(Delivery::Batch { records, .. })) => {
                payloads.extend(records.into_iter().map(|r| r.payload));
            }
            Ok(Ok(Delivery::Lost(loss))) => {
                eprintln!("{name}: {what}: loss {loss:?}");
                losses += 1;
            }
            Ok(Ok(other)) => panic!("{name}: {what}: unexpected delivery {other:?}"),
            Ok(Err(e)) => panic!("{name}: {what}: the change subscription failed: {e}"),
            Err(_) if payloads.len() >= expect => return (payloads, losses),
            Err(_) => panic!(
                "{name}: {what}: {} of {expect} change records within {ARRIVES_WITHIN:?}",
                payloads.len()
            ),
        }
    }
}

/// The heartbeat channel beside each topic's change history: a heartbeat
/// reaches every heartbeat subscriber byte for byte, never a change
/// subscription (nor takes a change history's room), and each topic's
/// channel is its own, whatever characters its name holds. A transport
/// without one must say `Unsupported`.
pub async fn heartbeat_channel(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = fixture.transport().await;
    let (a_node, b_node) = (fixture.transport().await, fixture.transport().await);

    // (a) Two subscribers, on two clients of their own, get it byte-exact.
    let topic = "hb-a";
    let mut a = match a_node.subscribe_heartbeats(topic).await {
        Ok(sub) => sub,
        Err(e) if e.is_unsupported() => cannot_run(name, "a heartbeat channel"),
        Err(e) => panic!("{name}: subscribe_heartbeats: {e}"),
    };
    let mut b = b_node
        .subscribe_heartbeats(topic)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_heartbeats: {e}"));
    heartbeats_reach(name, &publisher, topic, &mut [&mut a, &mut b]).await;
    // Every byte value, NUL and invalid UTF-8 included.
    let beat: bytes::Bytes = (0..=255u8)
        .chain(0..=255u8)
        .rev()
        .collect::<Vec<_>>()
        .into();
    retry(|| publisher.publish_heartbeat(topic, beat.clone())).await;
    for (who, sub) in [("first", &mut a), ("second", &mut b)] {
        let got = next_heartbeat(name, who, sub).await;
        assert_eq!(
            got, beat,
            "{name}: the {who} subscriber got another payload"
        );
        no_more_heartbeats(name, who, sub).await;
    }

    // (b) Never in a change subscription of the same topic, made before or
    // after the heartbeats.
    let topic = "hb-b";
    let before = a_node
        .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe: {e}"));
    let mut beats = b_node
        .subscribe_heartbeats(topic)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_heartbeats: {e}"));
    heartbeats_reach(name, &publisher, topic, &mut [&mut beats]).await;
    for i in 0..100u32 {
        let payload = bytes::Bytes::from(format!("beat {i}"));
        retry(|| publisher.publish_heartbeat(topic, payload.clone())).await;
    }
    let change = bytes::Bytes::from_static(b"the one change event");
    retry(|| publisher.publish(topic, "c", change.clone())).await;
    let mut subs = vec![("made before, from the latest", before)];
    match b_node
        .subscribe(topic, SubscribeOptions::new(StartFrom::Earliest))
        .await
    {
        Ok(after) => subs.push(("made after, from the earliest", after)),
        Err(e) if e.is_unsupported() => {
            eprintln!("{name}: no earliest start ({e}); checked the latest one only");
        }
        Err(e) => panic!("{name}: subscribe from the earliest: {e}"),
    }
    for (what, sub) in &mut subs {
        let (payloads, losses) = read_changes(name, what, sub, 1).await;
        assert_eq!(
            (payloads, losses),
            (vec![change.clone()], 0),
            "{name}: the change subscription {what} must see the one change record and no loss"
        );
    }
    // The heartbeats themselves went through (the channel may drop some,
    // never on a quiet test broker).
    for i in 0..100u32 {
        let got = next_heartbeat(name, "the 100", &mut beats).await;
        assert_eq!(got, format!("beat {i}").as_bytes(), "{name}: heartbeat {i}");
    }
    drop(subs);

    // (c) Each topic's channel is its own, whatever its name holds.
    let topics = [
        "x", "x.hb", "x:hb", "x%hb", "x hb", "a.b", "a_b", "*", ">", "a:b", "a b", "über",
    ];
    let mut channels = Vec::new();
    let mut refused = Vec::new();
    for topic in topics {
        if let Err(e) = a_node.check_topic(topic) {
            // A name the transport cannot map is refused by its rules (a
            // config error, the same for its heartbeat channel), never
            // half-taken; the names it takes are checked below.
            assert!(
                e.is_config(),
                "{name}: {topic:?} refused, but not by a rule: {e}"
            );
            let beats = a_node.subscribe_heartbeats(topic).await;
            assert!(
                beats.as_ref().is_err_and(cache_sync::Error::is_config),
                "{name}: {topic:?} refused as a topic, yet its heartbeat channel gave {:?}",
                beats.map(drop)
            );
            refused.push(topic);
            continue;
        }
        let beats = a_node
            .subscribe_heartbeats(topic)
            .await
            .unwrap_or_else(|e| panic!("{name}: {topic:?}: subscribe_heartbeats: {e}"));
        let changes = a_node
            .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
            .await
            .unwrap_or_else(|e| panic!("{name}: {topic:?}: subscribe: {e}"));
        channels.push((topic, beats, changes));
    }
    // The plain names every transport takes are among those checked.
    assert!(
        ["x", "a_b"].iter().all(|t| !refused.contains(t)),
        "{name}: refused a plain topic: {refused:?}"
    );
    if !refused.is_empty() {
        eprintln!("{name}: refuses topics {refused:?} by its naming rules, as documented");
    }
    for (topic, ..) in &channels {
        retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from(topic.to_string()))).await;
    }
    for (topic, beats, _) in &mut channels {
        let got = next_heartbeat(name, topic, beats).await;
        assert_eq!(
            got,
            topic.as_bytes(),
            "{name}: topic {topic:?} got another topic's heartbeat"
        );
    }
    // Anything stray has had time to arrive; it would now be at hand.
    tokio::time::sleep(QUIET).await;
    for (topic, beats, changes) in &mut channels {
        if let Ok(got) = tokio::time::timeout(AT_HAND, beats.next()).await {
            panic!("{name}: topic {topic:?}: got {got:?}, expected nothing more");
        }
        match tokio::time::timeout(AT_HAND, changes.next(1000)).await {
            Err(_) => {}
            Ok(Ok(Delivery::Batch { records, .. })) if records.is_empty() => {}
            Ok(stray) => panic!("{name}: topic {topic:?}: a change subscription got {stray:?}"),
        }
    }
    drop(channels);
}

/// Where the broker keeps heartbeats (and the suite can look at it):
/// heartbeats take none of the change history's room, and their own channel
/// stays short and expires.
pub async fn heartbeats_take_no_room_in_the_history(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = fixture.transport().await;
    let topic = "hb-d";
    retry(|| publisher.publish(topic, "c", bytes::Bytes::from_static(b"change"))).await;
    retry(|| publisher.publish_heartbeat(topic, bytes::Bytes::from_static(b"beat"))).await;
    let Some(start) = fixture.stored(topic) else {
        cannot_run(name, "a look at what the broker stores");
    };
    // More than the channel keeps (Redis Streams: about 4096), so it must
    // have trimmed.
    const BEATS: u32 = 6000;
    for i in 0..BEATS {
        let payload = bytes::Bytes::from(format!("beat {i}"));
        retry(|| publisher.publish_heartbeat(topic, payload.clone())).await;
    }
    let end = fixture.stored(topic).expect("looked at once already");
    eprintln!("{name}: stored before {BEATS} heartbeats {start:?}, after {end:?}");
    assert_eq!(
        end.history, start.history,
        "{name}: heartbeats changed the length of the change history"
    );
    assert_eq!(
        start.history, 1,
        "{name}: the change history holds the one event"
    );
    assert!(
        end.heartbeats < u64::from(BEATS),
        "{name}: the heartbeat channel kept all {BEATS} heartbeats: {end:?}"
    );
    if let Some(ttl) = end.heartbeats_expire_in {
        assert!(
            ttl > Duration::ZERO && ttl <= Duration::from_secs(60),
            "{name}: the heartbeat channel lives on for {ttl:?}"
        );
    }
}

/// Each optional channel (heartbeats, replies) is either there on both
/// sides or declared missing on both: a subscription that says
/// `Unsupported` where publishing works (or the other way round) would
/// leave a party waiting for answers that go nowhere. Runs on every
/// transport; it says which it found.
pub async fn optional_channels_are_declared_on_both_sides(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let transport = fixture.transport().await;
    let topic = "declared";
    let beat = bytes::Bytes::from_static(b"beat");
    // Each side said `Unsupported`, or neither; true where it worked.
    let alike = |what: &str,
                 subscribed: cache_sync::Result<()>,
                 published: cache_sync::Result<()>| {
        let unsupported =
            |r: &cache_sync::Result<()>| r.as_ref().err().map(cache_sync::Error::is_unsupported);
        assert_eq!(
            unsupported(&subscribed),
            unsupported(&published),
            "{name}: {what}: subscribing gave {subscribed:?}, publishing {published:?}"
        );
        subscribed.is_ok()
    };
    alike(
        "heartbeats",
        transport.subscribe_heartbeats(topic).await.map(drop),
        retry_unless_unsupported(|| transport.publish_heartbeat(topic, beat.clone())).await,
    );
    let replies = alike(
        "replies",
        transport.subscribe_replies(topic, 7).await.map(drop),
        retry_unless_unsupported(|| transport.publish_reply(topic, 7, beat.clone())).await,
    );
    eprintln!(
        "{name}: reply channel {}",
        if replies {
            "present"
        } else {
            "declared unsupported"
        }
    );
}

/// `f` until it works or says `Unsupported` (a broker may still be making
/// the resource on first use).
async fn retry_unless_unsupported<F, Fut>(mut f: F) -> cache_sync::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = cache_sync::Result<()>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match f().await {
            Err(e) if !e.is_unsupported() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// A party's reply channel (answers to its acknowledgement requests): what
/// is published for a party reaches that party's reply subscription byte
/// for byte, and no other party's, nor the topic's heartbeat channel, nor
/// a change subscription; each topic's replies are its own. A transport
/// without reply channels declares it on both sides (`Unsupported`): its
/// answers then go on the heartbeat channel.
pub async fn reply_channel(fixture: &mut dyn Fixture) {
    let name = fixture.name();
    let publisher = fixture.transport().await;
    let (one, two) = (fixture.transport().await, fixture.transport().await);
    let topic = "replies";
    let mut mine = match one.subscribe_replies(topic, 1).await {
        Ok(sub) => sub,
        Err(e) if e.is_unsupported() => cannot_run(name, "reply channels"),
        Err(e) => panic!("{name}: subscribe_replies: {e}"),
    };
    let mut other_party = two
        .subscribe_replies(topic, 2)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_replies: {e}"));
    let mut shared = two
        .subscribe_heartbeats(topic)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_heartbeats: {e}"));
    let mut changes = two
        .subscribe(topic, SubscribeOptions::new(StartFrom::Latest))
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe: {e}"));
    // Party 1 on another topic, whose name reads like this one's channels.
    let lookalike = "replies.hb";
    let mut elsewhere = match one.check_topic(lookalike) {
        Ok(()) => Some(
            one.subscribe_replies(lookalike, 1)
                .await
                .unwrap_or_else(|e| panic!("{name}: subscribe_replies: {e}")),
        ),
        Err(_) => None,
    };
    let answer: bytes::Bytes = (0..=255u8).collect::<Vec<_>>().into();
    retry(|| publisher.publish_reply(topic, 1, answer.clone())).await;
    assert_eq!(
        next_heartbeat(name, "party 1's reply channel", &mut mine).await,
        answer,
        "{name}: party 1 got another payload"
    );
    no_more_heartbeats(name, "party 1's reply channel", &mut mine).await;
    no_more_heartbeats(name, "party 2's reply channel", &mut other_party).await;
    no_more_heartbeats(name, "the heartbeat channel", &mut shared).await;
    if let Some(sub) = &mut elsewhere {
        no_more_heartbeats(name, "party 1 on another topic", sub).await;
    }
    match tokio::time::timeout(AT_HAND, changes.next(1000)).await {
        Err(_) => {}
        Ok(Ok(Delivery::Batch { records, .. })) if records.is_empty() => {}
        Ok(stray) => panic!("{name}: a change subscription got {stray:?}"),
    }
    // Nobody subscribed: no error, and nothing left that a later
    // subscriber would get.
    retry(|| publisher.publish_reply(topic, 3, bytes::Bytes::from_static(b"lost"))).await;
    // A publish returns once it is on the publisher's connection, not once
    // the broker has routed it (NATS' flush waits for the socket only), so
    // a subscription made at once on another connection could still catch
    // it. A broker handles one connection's messages in order: once a
    // marker sent after it arrives, "lost" has been routed to nobody.
    retry(|| publisher.publish_reply(topic, 1, bytes::Bytes::from_static(b"marker"))).await;
    assert_eq!(
        next_heartbeat(name, "party 1's reply channel", &mut mine).await,
        bytes::Bytes::from_static(b"marker"),
        "{name}: party 1 got another payload"
    );
    let mut late = two
        .subscribe_replies(topic, 3)
        .await
        .unwrap_or_else(|e| panic!("{name}: subscribe_replies: {e}"));
    // On a cluster the new subscription's interest reaches the other
    // servers a moment after it is made, and a reply sent before then
    // reaches nobody (seen once in a loaded full run on the NATS cluster):
    // "kept" is sent until one arrives, and the first to arrive must be it.
    let deadline = tokio::time::Instant::now() + ARRIVES_WITHIN;
    let first = loop {
        retry(|| publisher.publish_reply(topic, 3, bytes::Bytes::from_static(b"kept"))).await;
        match tokio::time::timeout(Duration::from_millis(500), late.next()).await {
            Ok(Ok(payload)) => break payload,
            Ok(Err(e)) => panic!("{name}: party 3's reply channel failed: {e}"),
            Err(_) if tokio::time::Instant::now() < deadline => {}
            Err(_) => panic!("{name}: party 3's reply channel: no reply within {ARRIVES_WITHIN:?}"),
        }
    };
    assert_eq!(
        first,
        bytes::Bytes::from_static(b"kept"),
        "{name}: a reply sent before the subscription was delivered to it"
    );
}
