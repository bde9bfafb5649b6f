//! Network partitions between a node (or the publisher) and its broker,
//! made by a fault proxy ([`crate::proxy`]): both directions cut without a
//! reset, one direction only, latency spikes, a flapping link. While the
//! fault lasts, a reader on the cut-off node checks every read against the
//! source's history: with `max_staleness(d)` set, **no read returns a
//! value that a publish acknowledged more than `d` plus one freshness
//! interval before the read began had replaced**. After the heal, every
//! node holds nothing stale and every loss was signalled.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use cache_sync::DictionaryPublisher;
use tokio::time::Instant;

use super::*;
use crate::proxy::Proxy;

/// The bound the cut-off node's table keeps.
const BOUND: Duration = Duration::from_millis(1000);
/// How often that node proves its freshness.
const EVERY: Duration = Duration::from_millis(100);
/// Keys the writer spreads its writes over.
const PARTITION_KEYS: u64 = 8;

/// A partition the proxy makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Both directions cut, without a reset, past every client timeout.
    Blackhole,
    /// The node's requests get through, nothing comes back.
    AnswersLost,
    /// The broker's bytes get through, the node's requests do not.
    RequestsLost,
    /// The publisher cut off both ways while the nodes are not.
    Publisher,
    /// 200 ms added each way, then 2 s.
    LatencySpikes,
    /// Cut and healed every 200 ms.
    Flapping,
    /// No proxy between the clients and the cluster: the topic's leader
    /// cut from its peers by the fixture ([`Fault::LeaderSplit`]), the
    /// nodes and the publisher on either side, wherever their clients take
    /// them.
    LeaderSplit,
}

impl Cut {
    /// Whether the cut stops the node's proof for longer than the bound,
    /// so its bounded reads must go to the source. A split leaves the
    /// nodes a server to read from: whether they prove anything meanwhile
    /// depends on the cluster's timing, and every read is judged either
    /// way.
    fn outlives_the_bound(self) -> bool {
        !matches!(self, Cut::Publisher | Cut::Flapping | Cut::LeaderSplit)
    }

    /// The fault a fixture is asked to expect of it.
    fn fault(self) -> Fault {
        match self {
            Cut::LeaderSplit => Fault::LeaderSplit,
            _ => Fault::Partition,
        }
    }
}

/// A value written, and when its publish was acknowledged.
type Write = (String, Option<Instant>);

/// Each key's writes in order, with the moment the publisher knew each
/// one acknowledged (`None` until then): the history reads are judged by.
#[derive(Debug, Default)]
struct History {
    writes: Mutex<HashMap<String, Vec<Write>>>,
}

impl History {
    /// Why a read of `key` that began at `began` and returned `row` is
    /// older than `allowed`, if it is: the write that replaced the value it
    /// returned was acknowledged before `began - allowed`.
    fn judge(&self, key: &str, row: &Row, began: Instant, allowed: Duration) -> Option<String> {
        let writes = self.writes.lock().expect("history lock");
        let list = writes.get(key).map_or(&[][..], Vec::as_slice);
        // `None` is the row before its first write.
        let next = match row {
            None => 0,
            Some(value) => match list.iter().position(|(v, _)| v == value) {
                Some(i) => i + 1,
                None => return Some(format!("{key} = {value:?}, never written")),
            },
        };
        let (replaced_by, acked) = list.get(next)?;
        let acked = (*acked)?;
        let late = began.checked_duration_since(acked)?;
        (late > allowed).then(|| {
            format!(
                "{key} = {row:?}, replaced by {replaced_by:?} acknowledged {late:?} before \
                 the read began (allowed {allowed:?})"
            )
        })
    }
}

/// What the reader saw while the fault lasted.
#[derive(Debug, Default)]
struct Reads {
    done: AtomicU64,
    violations: Mutex<Vec<String>>,
    /// The fault is on.
    faulted: AtomicBool,
    /// The node reported itself not ready while the fault was on.
    not_ready: AtomicBool,
    /// The oldest freshness age seen, in ms.
    oldest_ms: AtomicU64,
}

/// Runs `cut` on the fixture's proxied link: the writer changes the source
/// and publishes throughout; the cut-off node's reader judges every read;
/// after the heal every node converges.
pub async fn partitioned(fixture: &mut dyn Fixture, cut: Cut) {
    let name = fixture.name();
    let Some(expect) = fixture.expect(cut.fault()) else {
        cannot_run(name, &format!("the cut {cut:?}"));
    };
    let direct = fixture.transport().await;
    // A split is the fixture's to make; every other cut a proxy's, in
    // front of the fixture's one broker address.
    let proxy = if cut == Cut::LeaderSplit {
        None
    } else {
        let Some(upstream) = fixture.address() else {
            cannot_run(name, "a partition (no single broker address to proxy)");
        };
        Some(Proxy::start(upstream).await)
    };
    let (node_link, publisher_link) = match &proxy {
        None => match fixture.transports_either_side().await {
            Some([beside_the_leader, beside_the_others]) => (beside_the_leader, beside_the_others),
            None => (fixture.transport().await, direct.clone()),
        },
        Some(proxy) => {
            let through = fixture.transport_at(proxy.addr()).await;
            if cut == Cut::Publisher {
                (direct.clone(), through)
            } else {
                (through, direct.clone())
            }
        }
    };

    let db: Arc<Db> = Arc::default();
    let history = Arc::new(History::default());
    let configure = |b: NodeBuilder| fixture.configure(b).freshness_interval(EVERY);
    let victim = TestNode::start_shaped("cut", node_link, configure, |t| t.max_staleness(BOUND))
        .await
        .unwrap_or_else(|e| panic!("{name}: node: {e}"));
    let control = TestNode::start("direct", fixture.transport().await, |b| {
        fixture.configure(b)
    })
    .await
    .unwrap_or_else(|e| panic!("{name}: node: {e}"));
    let nodes = Arc::new(vec![victim, control]);
    let admin = Publisher::builder(publisher_link)
        .origin("partitioned-admin")
        .build()
        .expect("publisher")
        .dictionary(TABLE);
    let fencer = Publisher::builder(direct)
        .origin("fencer")
        .build()
        .expect("publisher");

    let writing = Arc::new(AtomicBool::new(true));
    let writer = tokio::spawn(write(db.clone(), history.clone(), admin, writing.clone()));
    // Proved before the fault, so a missing proof is the fault's doing.
    crate::eventually(&format!("{name}: the bound proved"), async || {
        nodes[0]
            .node
            .status()
            .freshness_age_ms
            .is_some_and(|a| a < 500)
    })
    .await;
    crate::eventually(&format!("{name}: ready before the fault"), async || {
        nodes[0].node.is_ready()
    })
    .await;
    let reads = Arc::new(Reads::default());
    let reading = Arc::new(AtomicBool::new(true));
    let reader = tokio::spawn(read(
        db.clone(),
        history.clone(),
        nodes.clone(),
        reads.clone(),
        reading.clone(),
    ));
    let bypassed_before = nodes[0].table.status().stale_bypasses;
    let losses_before = nodes[0].node.status().losses;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let started = Instant::now();
    reads.faulted.store(true, Ordering::Relaxed);
    let cuts = match &proxy {
        Some(proxy) => inject(proxy, cut).await,
        None => {
            // The fixture returns once the majority has a new leader and
            // the old one has taken writes the new one lacks.
            fixture.inject(Fault::LeaderSplit).await;
            1
        }
    };
    let faulted = started.elapsed();
    match &proxy {
        Some(proxy) => {
            proxy.heal();
            proxy.latency(Duration::ZERO);
        }
        // Returns once the old leader rejoined as a follower.
        None => fixture.heal(Fault::LeaderSplit).await,
    }
    reads.faulted.store(false, Ordering::Relaxed);
    // Reads go on through the heal and the catch-up after it.
    tokio::time::sleep(Duration::from_secs(1)).await;
    reading.store(false, Ordering::Relaxed);
    reader.await.expect("reader");
    writing.store(false, Ordering::Relaxed);
    writer.await.expect("writer");

    let bypassed = nodes[0].table.status().stale_bypasses - bypassed_before;
    let losses = nodes[0].node.status().losses - losses_before;
    let violations = reads.violations.lock().expect("violations").clone();
    eprintln!(
        "{name}: {cut:?} for {faulted:?}: {} reads judged, {bypassed} bypassed the cache, \
         oldest freshness age {} ms, not ready seen {}, {losses} losses on the cut-off node, \
         {} connections through the proxy",
        reads.done.load(Ordering::Relaxed),
        reads.oldest_ms.load(Ordering::Relaxed),
        reads.not_ready.load(Ordering::Relaxed),
        proxy.as_ref().map_or(0, Proxy::accepted),
    );
    assert!(
        violations.is_empty(),
        "{name}: {cut:?}: {} reads older than the bound, first: {}",
        violations.len(),
        violations[0]
    );
    assert!(
        reads.done.load(Ordering::Relaxed) > 100,
        "{name}: {cut:?}: the reader hardly read"
    );
    if cut.outlives_the_bound() {
        // The fault did reach the node: its proof went stale, its reads
        // went to the source, and it left the load balancer.
        assert!(
            reads.oldest_ms.load(Ordering::Relaxed) > u64::try_from(BOUND.as_millis()).unwrap_or(0),
            "{name}: {cut:?}: the freshness age never passed the bound"
        );
        assert!(bypassed > 0, "{name}: {cut:?}: no read bypassed the cache");
        assert!(
            reads.not_ready.load(Ordering::Relaxed),
            "{name}: {cut:?}: the node never reported itself not ready"
        );
    }
    if cut == Cut::Publisher {
        // The nodes hear their broker: they prove their bound, serve from
        // memory and stay ready (what the publisher could not send is in
        // no tail: the auditor's part).
        assert_eq!(bypassed, 0, "{name}: {cut:?}: reads bypassed the cache");
        assert!(
            !reads.not_ready.load(Ordering::Relaxed),
            "{name}: {cut:?}: a node that hears its broker was not ready"
        );
    }

    // Converge: a fence on every node, then nothing stale anywhere.
    let mut n = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        n += 1;
        retry(|| fencer.insert("fence", [("fence", n)])).await;
        let wait = Instant::now() + Duration::from_millis(300);
        let mut all = false;
        while Instant::now() < wait && !all {
            all = true;
            for node in nodes.iter() {
                all &= node.fence.peek("fence").await == Some(n);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if all {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: {cut:?}: the nodes never applied a fence after the heal"
        );
    }
    let keys: Vec<String> = (0..PARTITION_KEYS).map(|k| format!("k{k}")).collect();
    assert_no_stale_entries(&db, &nodes, &keys).await;
    crate::eventually(
        &format!("{name}: {cut:?}: a young bound after the heal"),
        async || {
            nodes[0]
                .node
                .status()
                .freshness_age_ms
                .is_some_and(|a| a < 1000)
        },
    )
    .await;
    crate::eventually(
        &format!("{name}: {cut:?}: ready after the heal"),
        async || nodes[0].node.is_ready(),
    )
    .await;

    match expect {
        Expect::NoLoss => assert_eq!(
            losses,
            0,
            "{name}: {cut:?}: a partition loses nothing here (the history resumes): {:?}",
            nodes[0].node.status().last_loss_reason
        ),
        // Only a cut past the client's timeouts is sure to lose.
        Expect::Loss if matches!(cut, Cut::Blackhole | Cut::AnswersLost | Cut::RequestsLost) => {
            assert!(losses >= 1, "{name}: {cut:?}: the loss was not signalled")
        }
        _ => {}
    }
    if cut == Cut::Flapping {
        // Bounded work per flap: at most one resync for each cut.
        assert!(
            losses <= cuts,
            "{name}: {cut:?}: {losses} losses for {cuts} cuts"
        );
    }
    for node in Arc::into_inner(nodes).expect("the reader ended") {
        node.node.shutdown().await.expect("shutdown");
    }
}

/// Makes `cut` happen on `proxy` and returns once it should heal; the
/// number of separate cuts made.
async fn inject(proxy: &Proxy, cut: Cut) -> u64 {
    match cut {
        Cut::LeaderSplit => unreachable!("a split is the fixture's, not a proxy's"),
        Cut::Blackhole | Cut::Publisher => {
            proxy.blackhole();
            // Past every client timeout the fixtures set (NATS's requests
            // wait 4 s).
            tokio::time::sleep(Duration::from_secs(6)).await;
            1
        }
        Cut::AnswersLost | Cut::RequestsLost => {
            proxy.cut_one_way(cut == Cut::RequestsLost);
            tokio::time::sleep(Duration::from_secs(5)).await;
            1
        }
        Cut::LatencySpikes => {
            proxy.latency(Duration::from_millis(200));
            tokio::time::sleep(Duration::from_secs(2)).await;
            proxy.latency(Duration::from_secs(2));
            tokio::time::sleep(Duration::from_secs(6)).await;
            0
        }
        Cut::Flapping => {
            let period = Duration::from_millis(200);
            let lasts = Duration::from_secs(60);
            proxy.flap(period);
            tokio::time::sleep(lasts).await;
            (lasts.as_millis() / period.as_millis() / 2)
                .try_into()
                .unwrap_or(u64::MAX)
        }
    }
}

/// Writes the source and publishes each write, a new value every few ms,
/// noting when each publish was acknowledged.
async fn write(
    db: Arc<Db>,
    history: Arc<History>,
    admin: DictionaryPublisher<String, Row>,
    writing: Arc<AtomicBool>,
) {
    let mut n = 0u64;
    while writing.load(Ordering::Relaxed) {
        n += 1;
        let key = format!("k{}", n % PARTITION_KEYS);
        let value = format!("w{n}");
        let version = {
            let mut writes = history.writes.lock().expect("history lock");
            let version = db.upsert(&key, &value);
            writes
                .entry(key.clone())
                .or_default()
                .push((value.clone(), None));
            version
        };
        let row = Some(value.clone());
        retry(|| admin.insert_versioned(&key, &row, version)).await;
        let acked = Instant::now();
        {
            let mut writes = history.writes.lock().expect("history lock");
            if let Some(entry) = writes
                .get_mut(&key)
                .and_then(|l| l.iter_mut().rev().find(|(v, _)| *v == value))
            {
                entry.1 = Some(acked);
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reads every key on node 0 through to the source, judging each read.
async fn read(
    db: Arc<Db>,
    history: Arc<History>,
    nodes: Arc<Vec<TestNode>>,
    reads: Arc<Reads>,
    reading: Arc<AtomicBool>,
) {
    let node = &nodes[0];
    let allowed = BOUND + EVERY;
    while reading.load(Ordering::Relaxed) {
        for k in 0..PARTITION_KEYS {
            let key = format!("k{k}");
            let began = Instant::now();
            let row = node.read(&db, &key, 0).await;
            reads.done.fetch_add(1, Ordering::Relaxed);
            if let Some(why) = history.judge(&key, &row, began, allowed) {
                reads.violations.lock().expect("violations").push(why);
            }
        }
        let status = node.node.status();
        if let Some(age) = status.freshness_age_ms {
            reads.oldest_ms.fetch_max(age, Ordering::Relaxed);
        }
        if reads.faulted.load(Ordering::Relaxed) && !node.node.is_ready() {
            reads.not_ready.store(true, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
