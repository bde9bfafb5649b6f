//! The transport conformance suite: one set of scenarios that every
//! transport must pass, faults included. A transport is plugged in through a
//! [`Fixture`]; a fault it cannot show is declared, and the suite says so.
//!
//! The workload is randomized from a seed that is printed, so a failure can
//! be replayed with `CONFORMANCE_SEED=<seed>`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cache_sync::{
    ChangeBus, Delivery, DictionaryPublisher, FileOffsetStore, NodeBuilder, Position, Publisher,
    SubscribeOptions, Subscription,
};

use crate::{Db, Row, TABLE, TestNode, assert_no_stale_entries};

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
}

/// What a fault should do to a node's view, per transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expect {
    /// Nothing is lost: the node resumes and no loss is signalled.
    NoLoss,
    /// Events may be lost: at least one loss must be signalled and counted.
    Loss,
}

/// A transport under test.
#[async_trait]
pub trait Fixture: Send + Sync {
    /// For messages: `"redis-streams"`, ….
    fn name(&self) -> &'static str;
    /// A new client, as another process would make.
    async fn bus(&self) -> Arc<dyn ChangeBus>;
    /// Node settings the transport needs in tests (short timeouts).
    fn configure(&self, b: NodeBuilder) -> NodeBuilder {
        b.reconnect_backoff(Duration::from_millis(10), Duration::from_millis(250))
    }
    /// What `fault` should do, or `None` if this transport cannot show it.
    fn expect(&self, fault: Fault) -> Option<Expect>;
    /// Makes the broker-side part of `fault` happen; returns when it healed.
    async fn inject(&mut self, fault: Fault);
}

/// Wraps a transport so a test can stop one node from reading while it
/// keeps running with its caches intact: a live node that falls behind.
struct GatedBus {
    inner: Arc<dyn ChangeBus>,
    open: tokio::sync::watch::Receiver<bool>,
    parked: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for GatedBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatedBus")
            .field("kind", &self.inner.kind())
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct GatedSubscription {
    inner: Box<dyn Subscription>,
    open: tokio::sync::watch::Receiver<bool>,
    /// A delivery read but held back while the gate is shut; kept here so a
    /// cancelled `next` loses nothing.
    held: Option<Delivery>,
    parked: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait]
impl ChangeBus for GatedBus {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn filters_by_tag(&self) -> bool {
        self.inner.filters_by_tag()
    }

    async fn publish(
        &self,
        topic: &str,
        tag: &str,
        payload: bytes::Bytes,
    ) -> cache_sync::Result<Option<Position>> {
        self.inner.publish(topic, tag, payload).await
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> cache_sync::Result<Box<dyn Subscription>> {
        let inner = self.inner.subscribe(topic, options).await?;
        Ok(Box::new(GatedSubscription {
            inner,
            open: self.open.clone(),
            held: None,
            parked: self.parked.clone(),
        }))
    }
}

#[async_trait]
impl Subscription for GatedSubscription {
    async fn next(&mut self, max: usize) -> cache_sync::Result<Delivery> {
        if self.held.is_none() {
            self.held = Some(self.inner.next(max).await?);
        }
        if !*self.open.borrow() {
            self.parked.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let _ = self.open.wait_for(|open| *open).await;
        self.parked
            .store(false, std::sync::atomic::Ordering::SeqCst);
        Ok(self.held.take().expect("held above"))
    }

    fn position(&self) -> Option<Position> {
        self.inner.position()
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
    /// Node 0 reads only while this is open.
    gate: tokio::sync::watch::Sender<bool>,
    /// Node 0 holds a delivery it may not apply yet.
    parked: Arc<std::sync::atomic::AtomicBool>,
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
        let gate = tokio::sync::watch::Sender::new(true);
        let parked = Arc::default();
        let mut nodes = Vec::new();
        let mut dirs = Vec::new();
        for i in 0..n {
            let dir = tempfile::tempdir().expect("node dir");
            nodes.push(start_node(fixture, i, dir.path(), &gate, &parked).await);
            dirs.push(dir);
        }
        let mut admins = Vec::new();
        for i in 0..2 {
            let p = Publisher::builder(fixture.bus().await)
                .origin(format!("admin-{i}"))
                .build()
                .expect("publisher");
            admins.push(p.dictionary(TABLE));
        }
        let fencer = Publisher::builder(fixture.bus().await)
            .origin("fencer")
            .build()
            .expect("publisher");
        Self {
            db: Arc::default(),
            nodes,
            admins,
            fencer,
            fences: 0,
            dirs,
            gate,
            parked,
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
                    retry(|| admin.upsert_with_version(&k, &row, version)).await;
                }
                4 => {
                    let version = self.db.delete(&k);
                    let admin = &self.admins[rng.below(2) as usize];
                    retry(|| admin.delete_with_version(&k, version)).await;
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
            retry(|| self.fencer.refresh("fence", [("fence", n)])).await;
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
        self.nodes[i] = start_node(fixture, i, self.dirs[i].path(), &self.gate, &self.parked).await;
    }

    /// Stops node 0 reading: it keeps running, caches and all, and holds
    /// back what it has read. Returns once it is parked, so everything
    /// published afterwards is behind it.
    pub async fn park_node_0(&self) {
        self.gate.send_replace(false);
        let parked = &self.parked;
        let fencer = &self.fencer;
        let n = self.fences;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !parked.load(std::sync::atomic::Ordering::SeqCst) {
            // Something to read, so the node reaches the gate.
            retry(|| fencer.refresh("fence", [("fence", n)])).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
            assert!(
                tokio::time::Instant::now() < deadline,
                "node 0 never parked"
            );
        }
    }

    /// Lets node 0 read again.
    pub fn release_node_0(&self) {
        self.gate.send_replace(true);
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
        }
    }
}

async fn start_node(
    fixture: &dyn Fixture,
    i: usize,
    dir: &std::path::Path,
    gate: &tokio::sync::watch::Sender<bool>,
    parked: &Arc<std::sync::atomic::AtomicBool>,
) -> TestNode {
    let mut bus = fixture.bus().await;
    if i == 0 {
        bus = Arc::new(GatedBus {
            inner: bus,
            open: gate.subscribe(),
            parked: parked.clone(),
        });
    }
    let store = FileOffsetStore::new(dir);
    TestNode::start(&format!("node-{i}"), bus, |b| {
        fixture.configure(b).offset_store(store)
    })
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
    let bus = fixture.bus().await;
    let only_table = TestNode::start("only-table", fixture.bus().await, |b| fixture.configure(b))
        .await
        .expect("node");
    // Unversioned refreshes of one key: the last one published must win, which
    // only holds if delivery keeps publish order.
    let p = Publisher::new(bus);
    for i in 0..200u32 {
        retry(|| p.refresh(TABLE, [("ordered", Some(format!("{i}")))])).await;
    }
    retry(|| p.refresh("not-registered-anywhere", [("x", 1u8)])).await;
    retry(|| p.refresh("fence", [("fence", 99u64)])).await;
    fence_only(std::slice::from_ref(&only_table), 99).await;
    assert_eq!(
        only_table.table.peek(&"ordered".to_owned()).await,
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
        eprintln!(
            "{}: cannot show {fault:?}; this transport has no such fault",
            fixture.name()
        );
        return;
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
        Fault::TrimPastReader => {
            // Node 0 keeps running, with its caches, but stops reading while
            // traffic continues and history is cut past its position.
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

    let after = cluster.losses();
    match (fault, expect) {
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
