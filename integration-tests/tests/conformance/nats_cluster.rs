//! The conformance scenarios on a JetStream cluster of three servers, the
//! topic's stream kept on all three (`replicas(3)`). The faults are a
//! cluster's: the stream's leader killed, or paused past the election
//! timeout and resumed stale, and the server the nodes are connected to
//! killed. Whole-cluster faults are the one-server fixture's scenarios.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cache_sync::transport::NatsJetStreamTransport;
use cache_sync::transport::Transport;
use integration_tests::conformance::{Expect, Fault, Fixture, retry};
use integration_tests::nats_cluster::{NatsCluster, RouteLinks};

use super::*;

/// The suite's topic's stream: `<prefix>_<topic>`, both `cache-sync`.
const STREAM: &str = "cache-sync_cache-sync";

struct NatsOnCluster {
    cluster: NatsCluster,
    /// The routes between the servers, to split them.
    links: RouteLinks,
    /// A server killed by the fault, until it is healed.
    down: Option<usize>,
}

impl NatsOnCluster {
    async fn start() -> Self {
        let (cluster, links) = NatsCluster::start_with_route_proxies().await;
        Self {
            cluster,
            links,
            down: None,
        }
    }

    /// Lets events flow for a while with the cluster as it is.
    async fn let_events_flow() {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    async fn fail(&mut self, fault: Fault) {
        match fault {
            Fault::LeaderKilled => {
                Self::let_events_flow().await;
                let leader = self.leader();
                self.cluster.kill(leader);
                let new = self.cluster.wait_for_new_leader(STREAM, leader);
                eprintln!("{STREAM}: leader {leader} killed, server {new} leads");
                Self::let_events_flow().await;
                self.down = Some(leader);
            }
            Fault::LeaderPaused => {
                Self::let_events_flow().await;
                let leader = self.leader();
                self.cluster.pause(leader);
                let new = self.cluster.wait_for_new_leader(STREAM, leader);
                eprintln!("{STREAM}: leader {leader} paused, server {new} leads");
                Self::let_events_flow().await;
                self.cluster.resume(leader);
                self.cluster.wait_in_sync(STREAM);
            }
            Fault::LeaderSplit => {
                Self::let_events_flow().await;
                let leader = self.leader();
                self.links.isolate(leader);
                // A publish needs two of the three servers: the cut leader
                // acknowledges none from now on, and the other two elect
                // a new one.
                let new = self.cluster.wait_for_new_leader(STREAM, leader);
                eprintln!(
                    "{STREAM}: leader {leader} cut from its peers, server {new} leads (meta leader: {})",
                    if self.cluster.is_meta_leader(leader) {
                        "the cut one"
                    } else {
                        "another"
                    }
                );
                // Until the new leader stores publishes again: only then is
                // there something for the cut-off node to miss.
                let elected = self.cluster.last_seq_on(new, STREAM).unwrap_or(0);
                let deadline = std::time::Instant::now() + Duration::from_secs(60);
                while self.cluster.last_seq_on(new, STREAM).unwrap_or(0) < elected + 10 {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "{STREAM}: the new leader stored no publish in 60 s"
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
                eprintln!("{STREAM}: the new leader stores publishes");
                // Past the bound with the new leader taking writes: a node
                // held to the old one must not serve what they replaced.
                tokio::time::sleep(Duration::from_secs(3)).await;
            }
            Fault::ConnectedServerKilled => {
                Self::let_events_flow().await;
                let busiest = self.cluster.busiest();
                self.cluster.kill(busiest);
                eprintln!("server {busiest}, which held the most client connections, killed");
                Self::let_events_flow().await;
                self.down = Some(busiest);
            }
            other => panic!("not injectable here: {other:?}"),
        }
    }

    fn leader(&self) -> usize {
        self.cluster
            .stream_leader(STREAM)
            .unwrap_or_else(|| panic!("no server reports a leader of {STREAM}"))
    }
}

#[async_trait]
impl Fixture for NatsOnCluster {
    fn name(&self) -> &'static str {
        "nats-jetstream-cluster"
    }

    async fn transport(&self) -> Arc<dyn Transport> {
        let urls = self.cluster.urls();
        let transport = retry(|| {
            NatsJetStreamTransport::builder(urls.as_str())
                .max_messages(2000)
                .replicas(3)
                .connect()
        })
        .await;
        Arc::new(transport)
    }

    /// One URL each, and the connections stay open through a split (only
    /// the routes are cut): each client reads and publishes through its
    /// server for as long as the split lasts.
    async fn transports_either_side(&self) -> Option<[Arc<dyn Transport>; 2]> {
        // The first publish makes the stream, which elects its leader
        // soon after (a cache no node holds: nothing to apply).
        let p = cache_sync::Publisher::new(self.transport().await);
        retry(|| p.insert("split-setup", [(0u32, 0u32)])).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::task::block_in_place(|| self.cluster.stream_leader(STREAM)).is_none() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{STREAM} has no leader 30 s after a client made it"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let leader = tokio::task::block_in_place(|| self.leader());
        let other = (0..self.cluster.len())
            .find(|&i| i != leader)
            .expect("a follower");
        let mut either = Vec::new();
        for i in [leader, other] {
            let url = self.cluster.url_of(i);
            let transport = retry(|| {
                NatsJetStreamTransport::builder(url.as_str())
                    .max_messages(2000)
                    .replicas(3)
                    .connect()
            })
            .await;
            either.push(Arc::new(transport) as Arc<dyn Transport>);
        }
        eprintln!("a node held to server {leader} (the leader), the publisher to server {other}");
        either.try_into().ok()
    }

    fn expect(&self, fault: Fault) -> Option<Expect> {
        match fault {
            // A publish is acknowledged once two of the three servers hold
            // it: a leader lost, or the server a node reads through, loses
            // none of what was acknowledged, and a node resumes by sequence.
            Fault::LeaderKilled | Fault::ConnectedServerKilled | Fault::NodeRestart => {
                Some(Expect::NoLoss)
            }
            // The same, but a node whose server is paused hears nothing on
            // its stream until its PINGs time out, while the publishers'
            // announcements reach it through the other servers: past the
            // reorder window it takes the events it has not seen for lost
            // and resyncs their caches. Safe, and a cost (seen: one
            // publisher gap on the node reading through the paused leader).
            Fault::LeaderPaused => Some(Expect::MayLose),
            // Nothing acknowledged is lost (the cut leader acknowledges
            // nothing alone), but a node reading through it hears its
            // publishers' announcements only after the heal, and may take
            // what it missed meanwhile for lost, as above.
            Fault::LeaderSplit => Some(Expect::MayLose),
            Fault::TrimPastReader => Some(Expect::Loss),
            _ => None,
        }
    }

    async fn inject(&mut self, fault: Fault) {
        match fault {
            Fault::NodeRestart => {}
            Fault::TrimPastReader => {
                // More than the stream keeps (2000) plus what the parked
                // node's client may already hold (its ordered consumer
                // pulls in batches whether or not the node reads): with
                // 2500 the case once failed for want of a loss, on the
                // cluster, every node correct and none having lost a thing.
                let p = cache_sync::Publisher::new(self.transport().await);
                for i in 0..4000u32 {
                    retry(|| p.insert("filler", [(i, i)])).await;
                }
            }
            // The harness waits with blocking calls: the runtime's other
            // worker goes on with the nodes and the traffic meanwhile.
            fault => tokio::task::block_in_place(|| {
                tokio::runtime::Handle::current().block_on(self.fail(fault))
            }),
        }
    }

    async fn heal(&mut self, fault: Fault) {
        if fault == Fault::LeaderSplit {
            self.links.heal();
            tokio::task::block_in_place(|| self.cluster.wait_in_sync(STREAM));
        }
        if let Some(server) = self.down.take() {
            tokio::task::block_in_place(|| {
                self.cluster.restart(server);
                self.cluster.wait_in_sync(STREAM);
            });
            eprintln!("{STREAM}: server {server} back and in sync");
        }
    }

    fn health_bound(&self) -> Option<Duration> {
        None
    }

    fn max_message_bytes(&self) -> Option<usize> {
        // The servers' default `max_payload`.
        Some(1 << 20)
    }
}

conformance!(nats_jetstream_cluster, NatsOnCluster::start().await, {
    normal_path_every_node_gets_every_event_in_order,
    leader_killed_while_events_flow,
    leader_paused_past_failover_then_resumed_stale,
    slot_moved_while_events_flow = ignore "NATS has no slots: a stream lives on its replicas",
    failover_lost_acknowledged_writes =
        ignore "JetStream acknowledges a publish once a quorum holds it: a failover loses none",
    connected_server_killed,
    broker_killed_and_restarted = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    broker_paused_past_client_timeouts = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    connections_killed = ignore "the server has no command to cut one client off",
    history_trimmed_past_a_reader,
    slow_subscriber_disconnected_by_buffer_limit =
        ignore "a consumer that falls behind stays in the stream; only its limits lose",
    node_process_restarted,
    broker_wiped_while_a_node_was_paused = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    health_follows_a_killed_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    publish_cut_mid_flight_resyncs_only_that_cache,
    publish_cut_at_the_tail_is_found_by_the_announcement,
    pipelined_publishes_arrive_in_order,
    broker_killed_with_publishes_in_flight = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed is the one-server fixture's scenario",
    names_map_one_to_one_onto_broker_resources,
    heartbeat_channel_beside_the_change_history,
    heartbeats_take_no_room_in_the_change_history =
        ignore "heartbeats are core NATS messages, which the server never stores",
    optional_channels_are_declared_on_both_sides,
    replies_reach_only_their_party,
    a_refused_publish_is_no_disconnect,
    cluster_view_converges_and_publishes_are_acknowledged,
    a_stopped_node_leaves_the_cluster_view,
    readiness_follows_a_paused_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    freshness_follows_a_paused_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker paused is the one-server fixture's scenario",
    freshness_proved_past_other_caches_events,
    partition_blackholes_a_node = ignore "clients learn the other servers' addresses from the one they reach and move to them, so no proxy on one client link holds a node cut off; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_loses_the_answers = ignore "clients learn the other servers' addresses from the one they reach and move to them, so no proxy on one client link holds a node cut off; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_loses_the_requests = ignore "clients learn the other servers' addresses from the one they reach and move to them, so no proxy on one client link holds a node cut off; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_cuts_the_publisher = ignore "clients learn the other servers' addresses from the one they reach and move to them, so no proxy on one client link holds a node cut off; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    latency_spikes_on_a_node_link = ignore "clients learn the other servers' addresses from the one they reach and move to them, so no proxy on one client link holds a node cut off; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    a_link_flapping_for_a_minute = ignore "clients learn the other servers' addresses from the one they reach and move to them, so no proxy on one client link holds a node cut off; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    leader_split_from_its_peers,
});
