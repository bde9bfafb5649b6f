//! The topic's tail, for the node's freshness bound: every queue's end on
//! every master broker, read once the broker's commit-log reader has caught
//! up with what it acknowledged.
//!
//! A broker acknowledges a send once the message is in its commit log, and
//! indexes it into its queue (the offsets a consumer reads and the admin API
//! reports) a moment later, on tasks of its own. A queue's end read in
//! between would leave out a message already acknowledged, and a node that
//! reached that end would claim a bound it does not have. So each broker is
//! first asked how far its reader is behind its commit log
//! (`dispatchBehindBytes` in its runtime stats, the log's end read before
//! the reader's place), and the queue ends are read only once it is not.
//! That narrows the window without closing it: the Rust broker's reader
//! hands what it parsed to a separate task that writes the queue entries,
//! and nothing the broker answers says where that task is (see
//! `docs/design.md`, The freshness bound).

use std::collections::HashSet;
use std::time::Duration;

use rocketmq_client_rust::{BrokerAdmin, DefaultMQAdminExt, TopicAdmin};

use super::super::{Offset, Position};
use super::*;
use crate::error::{Error, Result};

/// How many times a broker whose indexing is behind is asked again before
/// this tail gives up (the next check asks afresh).
const INDEXED_TRIES: u32 = 20;
/// How long between those tries: the indexer runs every millisecond.
const INDEXED_WAIT: Duration = Duration::from_millis(2);
/// A tail that takes longer fails, and its admin client is replaced.
const TAIL_TIMEOUT: Duration = Duration::from_secs(5);

impl Inner {
    /// The tail of `topic` (already escaped). One in flight at a time: a
    /// call while another runs fails at once, so a hung broker holds one
    /// request, not one per check.
    pub(super) async fn tail(&self, topic: &str) -> Result<Position> {
        self.ensure_open()?;
        let Ok(mut slot) = self.tail_admin.try_lock() else {
            return Err(Error::Transport {
                transport: KIND,
                source: "the previous request for the topic's tail is still unanswered".into(),
            });
        };
        if slot.is_none() {
            *slot = Some(self.admin().await?);
        }
        let admin = slot.as_ref().map(Admin::get).expect("just set");
        let read = tokio::time::timeout(TAIL_TIMEOUT, read_tail(admin, topic))
            .await
            .unwrap_or_else(|_| {
                Err(Error::disconnected(
                    KIND,
                    "the topic's tail was not answered in time",
                ))
            });
        if let Ok(tail) = &read
            && let Some(tx) = crate::util::lock(&self.tails).get(topic)
        {
            tx.send_replace(Some(tail.clone()));
        }
        if read.is_err() {
            // A fresh client instance next time: the client's circuit
            // breaker may have opened on this one during an outage.
            if let Some(mut admin) = slot.take() {
                admin.shutdown().await;
            }
        }
        read
    }
}

/// Whether `position` has read every queue of `tail` up to its end: by the
/// records handed over, or past them where the consumer passed other
/// caches' messages (its [`read_past`] marks). And every broker whose
/// queues the position names is in the tail: a broker that died leaves the
/// topic's route (the name server drops it when its connection closes), so
/// a tail read meanwhile does not name it, and the messages it acknowledged
/// before it died may be unread; until it is back, or the node starts
/// afresh, nothing is proved.
pub(super) fn covered(position: &Position, tail: &Position) -> bool {
    let reached = |partition: &str, end: u64| matches!(position.get(partition), Some(Offset::Seq(at)) if *at >= end);
    let mut queues = tail
        .iter()
        .filter(|(p, _)| broker_of(p).is_some())
        .peekable();
    if queues.peek().is_none() {
        return false;
    }
    let queues_reached = queues.all(|(queue, end)| match end {
        Offset::Seq(end) => reached(queue, *end) || reached(&read_past(queue), *end),
        Offset::Id(_) => false,
    });
    if !queues_reached {
        return false;
    }
    let named: HashSet<&str> = tail.iter().filter_map(|(p, _)| broker_of(p)).collect();
    position
        .iter()
        .filter_map(|(p, _)| broker_of(p))
        .all(|broker| named.contains(broker))
}

/// The tail's partition naming its topic (escaped): no queue's, as it has
/// no `:<queue id>`.
const TAIL_TOPIC: &str = "!topic";

/// The tail's partition naming the address `broker` was read at.
fn broker_mark(broker: &str) -> String {
    format!("{broker}!")
}

/// The topic a tail was read for.
pub(super) fn tail_topic(tail: &Position) -> Option<&str> {
    match tail.get(TAIL_TOPIC) {
        Some(Offset::Id(topic)) => Some(topic),
        _ => None,
    }
}

/// The brokers a tail was read from, by name and address.
pub(super) fn tail_brokers(tail: &Position) -> impl Iterator<Item = (&str, &str)> {
    tail.iter().filter_map(|(p, o)| match o {
        Offset::Id(addr) if p != TAIL_TOPIC => p.strip_suffix('!').map(|b| (b, addr.as_str())),
        _ => None,
    })
}

/// The broker of a queue's partition (`<broker>:<queue id>`); `None` for
/// its anchor (`…@`) and read-past mark (`…~`).
fn broker_of(partition: &str) -> Option<&str> {
    let (broker, id) = partition.rsplit_once(':')?;
    id.parse::<i32>().ok().map(|_| broker)
}

async fn read_tail(admin: &DefaultMQAdminExt, topic: &str) -> Result<Position> {
    let Some(route) = route(admin, topic).await? else {
        return Err(Error::disconnected(
            KIND,
            format!("topic {topic} has no route"),
        ));
    };
    let mut tail = Position::default();
    tail.set(TAIL_TOPIC, Offset::Id(topic.to_owned()));
    for broker in &route.broker_datas {
        // A broker with no master listed holds queues nobody can vouch for
        // now: no tail, rather than one that leaves them out.
        let Some(addr) = broker.broker_addrs().get(&0) else {
            return Err(Error::disconnected(
                KIND,
                format!(
                    "broker {} of topic {topic} has no master",
                    broker.broker_name()
                ),
            ));
        };
        // Which process answered is checked against the node's
        // subscriptions (`Inner::vouched`), by its address.
        tail.set(
            broker_mark(broker.broker_name()),
            Offset::Id(addr.to_string()),
        );
        reader_caught_up(admin, addr.as_str()).await?;
        let stats = TopicAdmin::examine_topic_stats(admin, topic.into(), Some(addr.clone()))
            .await
            .map_err(err)?;
        for (mq, offsets) in stats.get_offset_table() {
            if mq.topic().as_str() != topic {
                continue;
            }
            tail.set(
                partition(mq.broker_name(), mq.queue_id()),
                Offset::Seq(u64::try_from(offsets.get_max_offset()).unwrap_or(0)),
            );
        }
    }
    if !tail.iter().any(|(p, _)| broker_of(p).is_some()) {
        return Err(Error::disconnected(
            KIND,
            format!("topic {topic} has no queue on a master broker"),
        ));
    }
    Ok(tail)
}

/// Waits (briefly) until the broker at `addr` reports its commit-log
/// reader caught up with everything it stored.
async fn reader_caught_up(admin: &DefaultMQAdminExt, addr: &str) -> Result<()> {
    for _ in 0..INDEXED_TRIES {
        let stats = BrokerAdmin::fetch_broker_runtime_stats(admin, addr.into())
            .await
            .map_err(err)?;
        let behind = stats
            .table
            .get("dispatchBehindBytes")
            .and_then(|v| v.as_str().trim().parse::<i64>().ok());
        match behind {
            Some(b) if b <= 0 => return Ok(()),
            Some(_) => tokio::time::sleep(INDEXED_WAIT).await,
            // A broker that does not say cannot vouch for its queue ends.
            None => {
                return Err(Error::Transport {
                    transport: KIND,
                    source: format!("broker {addr} does not report how far its indexing is behind")
                        .into(),
                });
            }
        }
    }
    Err(Error::Transport {
        transport: KIND,
        source: format!("broker {addr} kept indexing behind what it stored").into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tail() -> Position {
        let mut t = Position::single("b:0", Offset::Seq(10));
        t.set("b:1", Offset::Seq(4));
        t
    }

    #[test]
    fn a_queue_is_covered_by_its_records_or_by_what_was_read_past_them() {
        let mut p = Position::single("b:0", Offset::Seq(10));
        p.set("b:1", Offset::Seq(2));
        assert!(!covered(&p, &tail()), "queue 1 read to 2 of 4");
        p.set(read_past("b:1"), Offset::Seq(3));
        assert!(!covered(&p, &tail()), "read past to 3 of 4");
        p.set(read_past("b:1"), Offset::Seq(4));
        assert!(covered(&p, &tail()));
        // Past a queue's end is covered too; a queue the position lacks is not.
        p.set("b:0", Offset::Seq(11));
        assert!(covered(&p, &tail()));
        let mut more = tail();
        more.set("c:0", Offset::Seq(0));
        assert!(!covered(&p, &more), "a queue the position never read");
    }

    #[test]
    fn a_broker_the_position_names_and_the_tail_lacks_proves_nothing() {
        // Broker `d` died: the route, and so the tail, no longer names it.
        let mut p = Position::single("b:0", Offset::Seq(10));
        p.set("b:1", Offset::Seq(4));
        p.set("d:0", Offset::Seq(7));
        p.set("d:0@", Offset::Id("1@2".into()));
        assert!(!covered(&p, &tail()));
        // Back in the tail (its queue read up to its end): covered.
        let mut back = tail();
        back.set("d:0", Offset::Seq(7));
        assert!(covered(&p, &back));
        // Broker names with colons, and partitions that are not queues.
        assert_eq!(broker_of("a:b:3"), Some("a:b"));
        assert_eq!(broker_of("a:3@"), None);
        assert_eq!(broker_of("a:3~"), None);
        assert_eq!(broker_of("a"), None);
    }

    #[test]
    fn only_sequence_numbers_cover_and_anchors_never_count() {
        // An anchor partition is `<queue>@`: a tail never names one, and
        // an Id end covers nothing.
        let p = Position::single("b:0", Offset::Seq(10));
        assert!(!covered(
            &p,
            &Position::single("b:0", Offset::Id("x".into()))
        ));
        let mut p = Position::single("b:0@", Offset::Seq(99));
        p.set(read_past("b:0@"), Offset::Seq(99));
        assert!(!covered(&p, &Position::single("b:0", Offset::Seq(1))));
    }

    #[test]
    fn a_tails_topic_and_addresses_are_no_queues() {
        let mut t = tail();
        t.set(TAIL_TOPIC, Offset::Id("orders".into()));
        t.set(broker_mark("b"), Offset::Id("127.0.0.1:10911".into()));
        t.set(broker_mark("x:1"), Offset::Id("127.0.0.1:10921".into()));
        assert_eq!(tail_topic(&t), Some("orders"));
        let mut brokers: Vec<_> = tail_brokers(&t).collect();
        brokers.sort_unstable();
        assert_eq!(
            brokers,
            [("b", "127.0.0.1:10911"), ("x:1", "127.0.0.1:10921")]
        );
        // The marks neither need covering nor name a broker the position
        // must hold.
        let mut p = Position::single("b:0", Offset::Seq(10));
        p.set("b:1", Offset::Seq(4));
        assert!(covered(&p, &t));
        p.set("b:1", Offset::Seq(3));
        assert!(!covered(&p, &t));
        // A tail of marks alone covers nothing.
        let mut marks = Position::single(TAIL_TOPIC, Offset::Id("orders".into()));
        marks.set(broker_mark("b"), Offset::Id("127.0.0.1:10911".into()));
        assert!(!covered(&Position::default(), &marks));
        assert_eq!(tail_topic(&Position::default()), None);
    }
}
