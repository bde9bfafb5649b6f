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

mod channels;
mod faults;
mod freshness;
mod partitions;
mod publishes;

pub use channels::*;
pub use faults::*;
pub use freshness::*;
pub use partitions::*;
pub use publishes::*;

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
    /// A node's link to its broker is cut (both ways without a reset, one
    /// way, slowed, flapping) by a proxy, then healed ([`partitioned`]).
    Partition,
    /// On a cluster, the server that leads the topic is cut from its peers
    /// (both ways, closing nothing) while every client still reaches it,
    /// past the cluster's failover timeout, then healed: a split brain.
    /// The majority elects a new leader; the old one takes writes from the
    /// clients beside it until it finds itself alone, and loses them when
    /// it rejoins ([`partitioned`] with [`Cut::LeaderSplit`]). The fixture
    /// checks that it did lose some.
    LeaderSplit,
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
                | Fault::LeaderSplit
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
    /// The broker's one address, where the suite can put a fault proxy in
    /// front of it, or `None` (no broker, or clients that learn other
    /// addresses from it).
    fn address(&self) -> Option<std::net::SocketAddr> {
        None
    }
    /// A new client that reaches the broker at `addr`: a proxy in front of
    /// [`Fixture::address`].
    async fn transport_at(&self, addr: std::net::SocketAddr) -> Arc<dyn Transport> {
        let _ = addr;
        cannot_run(self.name(), "a client through a proxy")
    }
    /// For [`Fault::LeaderSplit`]: a new client held to the server that
    /// leads the topic now, and one held to another server, so that a
    /// split puts a node on the minority's side and the publisher on the
    /// majority's. `None` where clients go wherever the cluster sends them
    /// (both sides then hold whatever clients they hold).
    async fn transports_either_side(&self) -> Option<[Arc<dyn Transport>; 2]> {
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
