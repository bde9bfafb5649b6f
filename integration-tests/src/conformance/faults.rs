//! The fault scenarios: the workload runs while a fault is injected and
//! healed, and every node converges with any loss signalled; and health
//! that follows a killed broker.

use super::*;

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
