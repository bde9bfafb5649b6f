//! The conformance scenarios on RocketMQ with two master brokers of
//! different names under one name server, the topic's queues on both (one
//! each). The faults are one broker's: the broker of the table's queue
//! killed while events flow, and started again on its store, or without
//! it. Faults of the whole broker are the one-broker fixture's scenarios.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use cache_sync::transport::Transport;
use integration_tests::TABLE;
use integration_tests::conformance::{Expect, Fault, Fixture, retry};
use integration_tests::rocketmq_server::RocketMqServer;

use super::*;

struct TwoBrokers {
    server: RocketMqServer,
    /// The broker killed by the fault, and whether it returns without its
    /// store, until it is healed.
    down: Option<(usize, bool)>,
}

impl TwoBrokers {
    fn start() -> Self {
        Self {
            server: RocketMqServer::start_with_brokers(2),
            down: None,
        }
    }

    /// The broker whose queue the table's events go to: a cache's events go
    /// to the queue its name hashes to, and topics made by the transport
    /// all have the same queues, so a publish to another topic under the
    /// table's tag tells.
    async fn tables_broker(&self) -> usize {
        let transport = self.transport().await;
        let position = retry(|| transport.publish("placement", TABLE, Bytes::from_static(b"?")))
            .await
            .expect("a RocketMQ publish says where it went");
        let (partition, _) = position.iter().next().expect("one queue");
        let name = partition.split(':').next().unwrap_or_default();
        (0..self.server.brokers())
            .find(|&i| self.server.broker_name_of(i) == name)
            .unwrap_or_else(|| panic!("no broker is named {name}"))
    }

    async fn kill_tables_broker(&mut self, wiped: bool) {
        let broker = self.tables_broker().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.server.kill_broker(broker);
        eprintln!(
            "broker {} (the table's queue) killed",
            self.server.broker_name_of(broker)
        );
        // Events flow to the other broker for a while.
        tokio::time::sleep(Duration::from_secs(1)).await;
        self.down = Some((broker, wiped));
    }
}

#[async_trait]
impl Fixture for TwoBrokers {
    fn name(&self) -> &'static str {
        "rocketmq-brokers"
    }

    async fn transport(&self) -> Arc<dyn Transport> {
        rocketmq_transport(&self.server).await
    }

    fn expect(&self, fault: Fault) -> Option<Expect> {
        match fault {
            // The table's events move to the other broker's queue. What
            // the dead broker held that a node had not read yet arrives
            // after later events, once it is back: a gap first (the cache
            // is resynced), then late events (applied as invalidations).
            Fault::LeaderKilled => Some(Expect::MayLose),
            // What the wiped broker held is gone: its readers find its
            // queue's offsets behind their positions.
            Fault::FailoverLosesWrites => Some(Expect::Loss),
            _ => None,
        }
    }

    async fn inject(&mut self, fault: Fault) {
        match fault {
            Fault::LeaderKilled => self.kill_tables_broker(false).await,
            Fault::FailoverLosesWrites => self.kill_tables_broker(true).await,
            other => panic!("not injectable here: {other:?}"),
        }
    }

    async fn heal(&mut self, _fault: Fault) {
        let Some((broker, wiped)) = self.down.take() else {
            return;
        };
        tokio::task::block_in_place(|| {
            if wiped {
                self.server.wipe_broker(broker);
            } else {
                self.server.restart_broker(broker);
            }
        });
        eprintln!(
            "broker {} back{}",
            self.server.broker_name_of(broker),
            if wiped { " without its store" } else { "" }
        );
        if !wiped {
            // Publishers leave a broker they found down out for 10 s: past
            // that, the table's events go to its queue again, and the nodes
            // must be reading it (the suite's traffic and checks follow).
            tokio::time::sleep(Duration::from_secs(11)).await;
            assert_eq!(
                self.tables_broker().await,
                broker,
                "the table's events go to its broker again"
            );
        }
    }

    fn health_bound(&self) -> Option<Duration> {
        None
    }

    fn max_message_bytes(&self) -> Option<usize> {
        // The broker's default `maxMessageSize`.
        Some(4 << 20)
    }

    fn settle(&self) -> Duration {
        // The fence and the table hash to different brokers' queues, so
        // the fence says nothing of the table's events. And an event of
        // the table stranded on the killed broker, the last its publisher
        // sent for a while, shows only by the publisher's announcement of
        // its number, which lands on the other broker within an announce
        // interval (1 s) and resyncs the cache a reorder window (10 s, the
        // node's default) after it arrived, if the event did not come
        // first: `publish_cut_at_the_tail`'s bound, with 2 s for the
        // fence's own way and a busy machine.
        Duration::from_secs(1 + 10 + 2)
    }
}

conformance!(rocketmq_brokers, TwoBrokers::start(), {
    normal_path_every_node_gets_every_event_in_order,
    leader_killed_while_events_flow,
    failover_lost_acknowledged_writes,
    broker_killed_and_restarted = ignore "not on the two-broker fixture, which fails one broker: the whole broker killed, paused or wiped is the one-broker fixture's scenario",
    broker_paused_past_client_timeouts = ignore "not on the two-broker fixture, which fails one broker: the whole broker killed, paused or wiped is the one-broker fixture's scenario",
    connections_killed = ignore "the broker has no command to cut one client off",
    history_trimmed_past_a_reader =
        ignore "the broker deletes commit-log files only on its retention schedule",
    slow_subscriber_disconnected_by_buffer_limit =
        ignore "a slow reader is held back (its queue suspended), never dropped",
    node_process_restarted = ignore "the one-broker fixture's scenario: a node's position spans the queues of every broker either way",
    broker_wiped_while_a_node_was_paused = ignore "not on the two-broker fixture, which fails one broker: the whole broker killed, paused or wiped is the one-broker fixture's scenario",
    health_follows_a_killed_broker = ignore "not on the two-broker fixture, which fails one broker: the whole broker killed, paused or wiped is the one-broker fixture's scenario",
    publish_cut_mid_flight_resyncs_only_that_cache = ignore "the one-broker fixture's scenario: the node's side of a cut publish does not depend on the brokers",
    publish_cut_at_the_tail_is_found_by_the_announcement = ignore "the one-broker fixture's scenario: the node's side of a cut publish does not depend on the brokers",
    pipelined_publishes_arrive_in_order = ignore "the one-broker fixture's scenario: the order of one publisher's calls does not depend on the brokers",
    broker_killed_with_publishes_in_flight = ignore "not on the two-broker fixture, which fails one broker: the whole broker killed is the one-broker fixture's scenario",
    names_map_one_to_one_onto_broker_resources = ignore "the one-broker fixture's scenario: names do not depend on the brokers",
    heartbeat_channel_beside_the_change_history = ignore "the one-broker fixture's scenario",
    heartbeats_take_no_room_in_the_change_history =
        ignore "heartbeats go to a topic of their own, and the suite has no look into the broker's store",
    optional_channels_are_declared_on_both_sides = ignore "the one-broker fixture's scenario",
    replies_reach_only_their_party =
        ignore "no reply channels (a topic per party would have to be created on the brokers): answers go on the heartbeat channel",
    a_refused_publish_is_no_disconnect = ignore "the one-broker fixture's scenario",
    cluster_view_converges_and_publishes_are_acknowledged = ignore "the one-broker fixture's scenario",
    a_stopped_node_leaves_the_cluster_view = ignore "the one-broker fixture's scenario",
    readiness_follows_a_paused_broker = ignore "the client notices a hung (SIGSTOPped) broker only when a connection closes: nodes stay ready through a pause (docs/transports.md)",
    freshness_follows_a_paused_broker = ignore "not on the two-broker fixture, which fails one broker at a time: the whole broker paused is the one-broker fixture's scenario",
    freshness_proved_past_other_caches_events,
    partition_blackholes_a_node = ignore "clients learn the brokers' addresses from the name server: no proxy on the broker links yet",
    partition_loses_the_answers = ignore "clients learn the brokers' addresses from the name server: no proxy on the broker links yet",
    partition_loses_the_requests = ignore "clients learn the brokers' addresses from the name server: no proxy on the broker links yet",
    partition_cuts_the_publisher = ignore "clients learn the brokers' addresses from the name server: no proxy on the broker links yet",
    latency_spikes_on_a_node_link = ignore "clients learn the brokers' addresses from the name server: no proxy on the broker links yet",
    a_link_flapping_for_a_minute = ignore "clients learn the brokers' addresses from the name server: no proxy on the broker links yet",
    leader_split_from_its_peers = ignore "two master brokers, each the only one for its queues: no leader is elected, so none can be split from its peers",
    leader_paused_past_failover_then_resumed_stale = ignore "no replica: a paused broker's queue is read again once it resumes, as on one broker",
    slot_moved_while_events_flow = ignore "RocketMQ has no slots: a cache's queue moves only when its broker fails",
    connected_server_killed = ignore "a node connects to every broker of the topic: the broker killed is that scenario's",
});
