//! The conformance scenarios on a Redis Cluster of three masters with a
//! replica each: Streams, and sharded Pub/Sub. The faults are a cluster's:
//! the topic's master killed, or paused past the failover timeout and
//! resumed stale; the topic's slot moved; a failover that loses
//! acknowledged writes. Whole-cluster faults (every server killed, paused
//! or wiped at once) are the one-server fixtures' scenarios.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use cache_sync::transport::Transport;
use cache_sync::transport::{RedisPubSubTransport, RedisStreamsTransport};
use integration_tests::conformance::{Expect, Fault, Fixture, retry};
use integration_tests::redis_cluster::{RedisCluster, ServerLinks};

use super::*;

/// The suite's topic (the default) as its keys' and channels' hash tag.
const TAG: &str = "{cache-sync}";

/// How a fixture reaches the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Streams,
    ShardedPubSub,
}

/// A transport of `kind` on the cluster the `seeds` lead to, with the
/// timeouts the suite's scenarios are sized for.
async fn connect(kind: Kind, seeds: Vec<String>) -> Arc<dyn Transport> {
    match kind {
        Kind::Streams => Arc::new(
            retry(|| {
                RedisStreamsTransport::cluster(seeds.clone())
                    .block(Duration::from_millis(100))
                    .response_timeout(Duration::from_millis(500))
                    .connect()
            })
            .await,
        ),
        Kind::ShardedPubSub => Arc::new(
            retry(|| {
                RedisPubSubTransport::cluster(seeds.clone())
                    .ping_interval(Duration::from_millis(100))
                    .ping_timeout(Duration::from_millis(300))
                    .response_timeout(Duration::from_millis(500))
                    .connect()
            })
            .await,
        ),
    }
}

struct OnCluster {
    cluster: RedisCluster,
    /// The links between the servers, to split them.
    links: ServerLinks,
    kind: Kind,
    /// A server killed by the fault, until it is healed.
    down: Option<usize>,
}

impl OnCluster {
    async fn start(kind: Kind) -> Self {
        let (cluster, links) = RedisCluster::start_with_server_links().await;
        Self {
            cluster,
            links,
            kind,
            down: None,
        }
    }

    /// How many times server `i` has run the command the transport
    /// publishes with (`XADD`; `EVAL` of an `SPUBLISH` for sharded
    /// Pub/Sub): `INFO commandstats` counts calls it ran, not those it
    /// refused, so each one it ran after a split was acknowledged.
    fn publishes_run_by(&self, i: usize) -> u64 {
        let command = match self.kind {
            Kind::Streams => "cmdstat_xadd:calls=",
            Kind::ShardedPubSub => "cmdstat_eval:calls=",
        };
        let stats = self
            .cluster
            .server(i)
            .query(&["INFO", "commandstats"])
            .ok()
            .and_then(|r| r.text())
            .unwrap_or_default();
        stats
            .lines()
            .find_map(|l| l.strip_prefix(command))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    fn slot(&self) -> u16 {
        self.cluster.slot(TAG)
    }

    /// The stream's length on the master that serves it.
    fn history_len(&self) -> u64 {
        let master = self.cluster.master_of(self.slot());
        let key = format!("cache-sync:{TAG}");
        let reply = self
            .cluster
            .server(master)
            .command(&["XLEN", &key])
            .expect("XLEN");
        reply
            .strip_prefix(':')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("XLEN: {reply}"))
    }

    /// Lets events flow for a while with the cluster as it is.
    async fn let_events_flow(&self) {
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    async fn fail(&mut self, fault: Fault) {
        let slot = self.slot();
        let master = self.cluster.master_of(slot);
        match fault {
            Fault::LeaderSplit => {
                self.let_events_flow().await;
                let before = self.publishes_run_by(master);
                self.links.isolate(master);
                // The majority fails it over; meanwhile it takes the
                // publisher's writes until it finds itself alone, and sends
                // them nowhere (its replica is cut from it too).
                let new = self.cluster.wait_for_new_master(slot, master);
                // Past the bound with the new master taking writes.
                tokio::time::sleep(Duration::from_secs(3)).await;
                let lost = self.publishes_run_by(master).saturating_sub(before);
                eprintln!(
                    "slot {slot}: server {master} cut from its peers, server {new} took over; \
                     the old master ran {lost} publishes after the cut"
                );
                assert!(
                    lost > 0,
                    "the old master ran no publish after the cut: no split brain to judge"
                );
            }
            Fault::LeaderKilled => {
                self.let_events_flow().await;
                self.cluster.kill(master);
                let new = self.cluster.wait_for_new_master(slot, master);
                eprintln!("slot {slot}: server {master} killed, server {new} took over");
                self.let_events_flow().await;
                self.down = Some(master);
            }
            Fault::LeaderPaused => {
                self.let_events_flow().await;
                self.cluster.pause(master);
                let new = self.cluster.wait_for_new_master(slot, master);
                eprintln!("slot {slot}: server {master} paused, server {new} took over");
                self.let_events_flow().await;
                // Back as it was: a master of the slot in its own eyes,
                // until it hears of the newer epoch.
                self.cluster.resume(master);
                self.cluster.wait_whole();
            }
            Fault::SlotMoved => {
                self.let_events_flow().await;
                let to = self
                    .cluster
                    .masters()
                    .into_iter()
                    .find(|&m| m != master)
                    .expect("another master");
                self.cluster.move_slot(slot, to);
                eprintln!("slot {slot}: moved from server {master} to server {to}");
            }
            Fault::FailoverLosesWrites => {
                let replica = self.cluster.replica_of(master);
                self.cluster.pause(replica);
                // The master drops its link to the paused replica, which
                // cannot link again: what the master takes from now on, it
                // sends nowhere. (A link left open would deliver it all:
                // the kernel buffers what a stopped process does not read.)
                assert!(self.cluster.server(master).kill_clients("replica") >= 1);
                // Writes the master acknowledges and the replica never gets.
                if self.kind == Kind::Streams {
                    let start = self.history_len();
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
                    while self.history_len() < start + 5 {
                        assert!(
                            tokio::time::Instant::now() < deadline,
                            "no events were published while the replica was paused"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                } else {
                    self.let_events_flow().await;
                }
                self.cluster.kill(master);
                self.cluster.resume(replica);
                self.cluster.take_over(replica);
                eprintln!(
                    "slot {slot}: server {master} killed ahead of its paused replica {replica}, \
                     which took over with what it had"
                );
                self.let_events_flow().await;
                // It rejoins as the new master's replica, and drops what
                // only it had.
                self.cluster.restart(master);
                self.cluster.wait_whole();
            }
            other => panic!("not injectable here: {other:?}"),
        }
    }
}

#[async_trait]
impl Fixture for OnCluster {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Streams => "redis-streams-cluster",
            Kind::ShardedPubSub => "redis-pubsub-cluster",
        }
    }

    async fn transport(&self) -> Arc<dyn Transport> {
        connect(self.kind, self.cluster.urls()).await
    }

    fn expect(&self, fault: Fault) -> Option<Expect> {
        match (self.kind, fault) {
            (_, Fault::NodeRestart) => Some(Expect::NoLoss),
            // Whether a node lost what the old master took alone depends
            // on whether it read it before the switch: judged by the
            // source, not by a count.
            (_, Fault::LeaderSplit) => Some(Expect::MayLose),
            // Pub/Sub: every resubscription may have missed messages.
            (Kind::ShardedPubSub, Fault::ConnectionKill) => Some(Expect::Loss),
            (Kind::ShardedPubSub, f)
                if f.needs_a_cluster() && f != Fault::ConnectedServerKilled =>
            {
                Some(Expect::Loss)
            }
            (Kind::Streams, Fault::ConnectionKill) => Some(Expect::NoLoss),
            (Kind::Streams, Fault::TrimPastReader) => Some(Expect::Loss),
            // A slot moves with its keys (MIGRATE): nothing is lost.
            (Kind::Streams, Fault::SlotMoved) => Some(Expect::NoLoss),
            // Replication is asynchronous: the replica that takes over may
            // lack the last writes, or may not.
            (Kind::Streams, Fault::LeaderKilled | Fault::LeaderPaused) => Some(Expect::MayLose),
            (Kind::Streams, Fault::FailoverLosesWrites) => Some(Expect::Loss),
            _ => None,
        }
    }

    async fn inject(&mut self, fault: Fault) {
        match fault {
            Fault::NodeRestart => {}
            Fault::ConnectionKill => {
                // RESP3 subscribers (sharded Pub/Sub) are of type pubsub.
                let killed: u64 = (0..self.cluster.len())
                    .flat_map(|i| ["normal", "pubsub"].map(|kind| (i, kind)))
                    .map(|(i, kind)| self.cluster.server(i).kill_clients(kind))
                    .sum();
                assert!(killed >= 1, "no connection to kill");
            }
            Fault::TrimPastReader => {
                let master = self.cluster.master_of(self.slot());
                let key = format!("cache-sync:{TAG}");
                let reply = self
                    .cluster
                    .server(master)
                    .command(&["XTRIM", &key, "MAXLEN", "0"])
                    .expect("XTRIM");
                assert!(reply.starts_with(':'), "XTRIM: {reply}");
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
            // The old master hears of the newer epoch, turns into the new
            // one's replica, and drops what it took alone.
            self.links.heal();
            tokio::task::block_in_place(|| self.cluster.wait_whole());
        }
        if let Some(server) = self.down.take() {
            // It rejoins as the new master's replica.
            tokio::task::block_in_place(|| {
                self.cluster.restart(server);
                self.cluster.wait_whole();
            });
            eprintln!("server {server} back as a replica");
        }
    }

    fn health_bound(&self) -> Option<Duration> {
        None
    }
}

conformance!(redis_streams_cluster, OnCluster::start(Kind::Streams).await, {
    normal_path_every_node_gets_every_event_in_order,
    leader_killed_while_events_flow,
    leader_paused_past_failover_then_resumed_stale,
    slot_moved_while_events_flow,
    failover_lost_acknowledged_writes,
    connected_server_killed =
        ignore "a node's connections to a Redis Cluster are to the slot's master: leader_killed_while_events_flow",
    broker_killed_and_restarted = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    broker_paused_past_client_timeouts = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    connections_killed,
    history_trimmed_past_a_reader,
    slow_subscriber_disconnected_by_buffer_limit =
        ignore "a reader that falls behind stays in the stream; only trimming loses",
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
        ignore "looked into on the one-server fixture; the keys are the same on a cluster",
    optional_channels_are_declared_on_both_sides,
    replies_reach_only_their_party,
    a_refused_publish_is_no_disconnect,
    cluster_view_converges_and_publishes_are_acknowledged,
    a_stopped_node_leaves_the_cluster_view,
    readiness_follows_a_paused_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    freshness_follows_a_paused_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker paused is the one-server fixture's scenario",
    freshness_proved_past_other_caches_events,
    partition_blackholes_a_node = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SLOTS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_loses_the_answers = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SLOTS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_loses_the_requests = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SLOTS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_cuts_the_publisher = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SLOTS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    latency_spikes_on_a_node_link = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SLOTS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    a_link_flapping_for_a_minute = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SLOTS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    leader_split_from_its_peers,
});

conformance!(redis_pubsub_cluster, OnCluster::start(Kind::ShardedPubSub).await, {
    normal_path_every_node_gets_every_event_in_order,
    leader_killed_while_events_flow,
    leader_paused_past_failover_then_resumed_stale,
    slot_moved_while_events_flow,
    failover_lost_acknowledged_writes,
    connected_server_killed =
        ignore "a node's connections to a Redis Cluster are to the slot's master: leader_killed_while_events_flow",
    broker_killed_and_restarted = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    broker_paused_past_client_timeouts = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    connections_killed,
    history_trimmed_past_a_reader = ignore "Pub/Sub keeps no history to trim",
    slow_subscriber_disconnected_by_buffer_limit =
        ignore "not on the cluster fixture: the server's output-buffer limit is the one-server fixture's scenario",
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
        ignore "Pub/Sub stores neither heartbeats nor history",
    optional_channels_are_declared_on_both_sides,
    replies_reach_only_their_party,
    a_refused_publish_is_no_disconnect,
    cluster_view_converges_and_publishes_are_acknowledged,
    a_stopped_node_leaves_the_cluster_view,
    readiness_follows_a_paused_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker killed, paused or wiped is the one-server fixture's scenario",
    freshness_follows_a_paused_broker = ignore "not on the cluster fixture, which fails one server at a time: the whole broker paused is the one-server fixture's scenario",
    freshness_proved_past_other_caches_events = ignore "sharded Pub/Sub on a cluster proves no freshness bound (no tail: a subscriber may be held by a replica that passes messages on late)",
    partition_blackholes_a_node = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SHARDS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_loses_the_answers = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SHARDS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_loses_the_requests = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SHARDS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    partition_cuts_the_publisher = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SHARDS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    latency_spikes_on_a_node_link = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SHARDS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    a_link_flapping_for_a_minute = ignore "cluster clients follow the addresses the servers announce (MOVED, CLUSTER SHARDS), so the proxy in front of a server carries every client's link to it and cannot cut one node alone; the one-server fixture runs the node-link partitions, leader_split_from_its_peers the servers' own",
    leader_split_from_its_peers = ignore "sharded Pub/Sub on a cluster proves no freshness bound (no tail: a subscriber may be held by a replica that passes messages on late), so a bounded read always goes to the source and a split has nothing to judge; redis_streams_cluster runs it",
});
