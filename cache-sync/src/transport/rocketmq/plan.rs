//! Where a subscription starts: positions, timestamps and the anchors that
//! prove a stored offset belongs to the history that is there now.

use std::collections::HashSet;
use std::path::Path;
use std::time::UNIX_EPOCH;

use rocketmq_client_rust::{ConsumerAdmin, DefaultMQAdminExt, OffsetAdmin};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;

use super::super::{Loss, LossReason, Offset, Position, StartFrom};
use super::*;
use crate::error::{Error, Result};

/// Where a subscription starts, per queue.
pub(super) struct StartPlan {
    /// The queues read: those whose broker answered.
    pub(super) queues: Vec<QueueRef>,
    /// Brokers not read now: those of the topic's route that did not
    /// answer (down, while another is up), with their address, and those
    /// the starting position names that the route lacks (gone from the name
    /// server, or back without the topic). Their queues are read once they
    /// return, by a subscription that checks what they hold then; their
    /// place in the position is kept meanwhile.
    pub(super) missing: Vec<(String, Option<String>)>,
    pub(super) seed: Position,
    pub(super) loss: Option<Loss>,
    pub(super) from_where: ConsumeFromWhere,
}

pub(super) async fn plan_start(
    admin: &DefaultMQAdminExt,
    topic: &str,
    from: &StartFrom,
) -> Result<StartPlan> {
    let route = queues_of(admin, topic).await?;
    let mut queues = Vec::with_capacity(route.len());
    let mut missing: Vec<(String, Option<String>)> = Vec::new();
    let mut seed = Position::default();
    let mut trimmed = 0u64;
    let mut reset = false;
    let mut maybe_trimmed = false;
    for q in route {
        if missing
            .iter()
            .any(|(_, addr)| addr.as_deref() == Some(&q.addr))
        {
            continue;
        }
        let (min, max) = match offsets(admin, &q).await {
            Ok(o) => o,
            // Down: the other brokers are read meanwhile.
            Err(e) if !reachable(&q.addr).await => {
                tracing::warn!(transport = KIND, topic, broker = %q.mq.broker_name(),
                    addr = %q.addr, error = %e,
                    "a broker of the topic is down; reading the others until it returns");
                missing.push((q.mq.broker_name().to_string(), Some(q.addr)));
                continue;
            }
            Err(e) => return Err(e),
        };
        let offset = match from {
            StartFrom::Latest => max,
            StartFrom::Earliest => min,
            StartFrom::Position(p) => match p.get(&q.name) {
                Some(Offset::Seq(n)) => {
                    let n = i64::try_from(*n).unwrap_or(i64::MAX);
                    if n > max {
                        reset = true;
                        max
                    } else if n < min {
                        trimmed = trimmed
                            .saturating_add(u64::try_from(min.saturating_sub(n)).unwrap_or(0));
                        min
                    } else if n > 0 && !same_history(admin, topic, &q, n, p).await? {
                        // The message before the position is not the one this
                        // node read there: the broker's store was replaced
                        // (wiped, or another broker under the same name).
                        reset = true;
                        max
                    } else {
                        n
                    }
                }
                Some(Offset::Id(_)) => {
                    reset = true;
                    max
                }
                // A queue added after the position was taken: all of it is new.
                None => min,
            },
            StartFrom::Timestamp(t) => {
                let ms = t
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                let found = OffsetAdmin::search_offset(
                    admin,
                    q.addr.as_str().into(),
                    topic.into(),
                    q.mq.queue_id(),
                    ms,
                    ADMIN_TIMEOUT_MS,
                )
                .await
                .map_err(err)?;
                let found = i64::try_from(found).unwrap_or(max).clamp(min, max);
                // Messages after `t` may already have been deleted.
                if min > 0 && found == min {
                    maybe_trimmed = true;
                }
                found
            }
        };
        seed.set(
            q.name.clone(),
            Offset::Seq(u64::try_from(offset).unwrap_or(0)),
        );
        queues.push(q);
    }
    if queues.is_empty() {
        return Err(Error::disconnected(
            KIND,
            format!("no broker of topic {topic} answers"),
        ));
    }
    if let StartFrom::Position(p) = from {
        // What the position says of queues not read now (their broker is
        // down, or out of the route): kept, so that a subscription after
        // their return resumes them there and checks their history.
        // Sets, not scans: a position may name many queues.
        let read: HashSet<&str> = queues.iter().map(|q| q.name.as_str()).collect();
        let mut named: HashSet<String> = missing.iter().map(|(name, _)| name.clone()).collect();
        for (partition, offset) in p.iter() {
            let queue = partition
                .strip_suffix('@')
                .or_else(|| partition.strip_suffix('~'))
                .unwrap_or(partition);
            if read.contains(queue) {
                continue;
            }
            seed.set(partition, offset.clone());
            let broker = partition.split(':').next().unwrap_or_default();
            if named.insert(broker.to_owned()) {
                missing.push((broker.to_owned(), None));
            }
        }
    }
    if reset {
        // Continue from the end of what the brokers hold now.
        for q in &queues {
            let (_, max) = offsets(admin, q).await?;
            seed.set(q.name.clone(), Offset::Seq(u64::try_from(max).unwrap_or(0)));
        }
    }
    // Name the history each starting offset belongs to, so that a later
    // re-subscription from this position can tell whether it still exists;
    // and start each queue's read-past mark there, replacing one of an
    // earlier subscription (perhaps of a history since replaced).
    for q in &queues {
        if let Some(Offset::Seq(n)) = seed.get(&q.name).cloned() {
            seed.set(read_past(&q.name), Offset::Seq(n));
            set_anchor(&mut seed, q, anchor_before(admin, topic, q, n).await?);
        }
    }
    let loss = if reset {
        Some(Loss::new(
            LossReason::HistoryReset,
            None,
            Some(seed.clone()),
        ))
    } else if trimmed > 0 || maybe_trimmed {
        Some(Loss::new(
            LossReason::Trimmed,
            (trimmed > 0).then_some(trimmed),
            Some(seed.clone()),
        ))
    } else {
        None
    };
    let from_where = match from {
        StartFrom::Latest => ConsumeFromWhere::ConsumeFromLastOffset,
        _ => ConsumeFromWhere::ConsumeFromFirstOffset,
    };
    Ok(StartPlan {
        queues,
        missing,
        seed,
        loss,
        from_where,
    })
}

/// Which message a queue offset follows: the commit-log offset and store
/// time of the message just before it. Two histories of one broker (before
/// and after its store was wiped) never hold the same message at the same
/// place with the same store time, though their queue offsets may match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Anchor {
    pub(super) commit_log_offset: i64,
    pub(super) store_timestamp: i64,
}

impl Anchor {
    pub(super) fn of(m: &MessageExt) -> Self {
        Self {
            commit_log_offset: m.commit_log_offset(),
            store_timestamp: m.store_timestamp(),
        }
    }

    pub(super) fn to_offset(self) -> Offset {
        Offset::Id(format!(
            "{}@{}",
            self.commit_log_offset, self.store_timestamp
        ))
    }

    pub(super) fn from_offset(offset: &Offset) -> Option<Self> {
        let Offset::Id(text) = offset else {
            return None;
        };
        let (log, stored) = text.split_once('@')?;
        Some(Self {
            commit_log_offset: log.parse().ok()?,
            store_timestamp: stored.parse().ok()?,
        })
    }
}

/// The partition that holds a queue's anchor, next to the queue's offset.
pub(super) fn anchor_partition(queue: &str) -> String {
    format!("{queue}@")
}

pub(super) fn set_anchor(position: &mut Position, q: &QueueRef, anchor: Option<Anchor>) {
    if let Some(a) = anchor {
        position.set(anchor_partition(&q.name), a.to_offset());
    }
}

/// The anchor of queue offset `n`, from the broker: the message at `n - 1`,
/// looked up through the consume queue. `None` for an empty queue.
pub(super) async fn anchor_before(
    admin: &DefaultMQAdminExt,
    topic: &str,
    q: &QueueRef,
    n: u64,
) -> Result<Option<Anchor>> {
    let Some(index) = n.checked_sub(1) else {
        return Ok(None);
    };
    let body = ConsumerAdmin::query_consume_queue(
        admin,
        q.addr.as_str().into(),
        topic.into(),
        q.mq.queue_id(),
        index,
        1,
        // Any group: the broker only uses it to evaluate a filter.
        "cache-sync-anchor".into(),
    )
    .await
    .map_err(err)?;
    let Some(entry) = body.queue_data.as_deref().and_then(<[_]>::first) else {
        // Trimmed away meanwhile: nothing to name, and nothing to check later.
        return Ok(None);
    };
    let message = view_message(admin, topic, q, entry.physic_offset).await?;
    Ok(message.map(|m| Anchor::of(&m)))
}

/// The message stored at `commit_log_offset` on the queue's broker, or
/// `None` when the broker holds none there (or something that is not one).
pub(super) async fn view_message(
    admin: &DefaultMQAdminExt,
    topic: &str,
    q: &QueueRef,
    commit_log_offset: i64,
) -> Result<Option<MessageExt>> {
    // The name server lists brokers by the address they announce, an IP as
    // a rule; a host name is resolved, and failing that the history cannot
    // be checked now (an error, retried), which is not the same as a
    // history that is gone.
    let broker = match q.addr.parse::<std::net::SocketAddr>() {
        Ok(a) => a,
        // IPv4 first: the client spells an id's address back as
        // `ip:port`, which is no address for IPv6, and the broker listens on
        // IPv4 by default.
        Err(_) => tokio::net::lookup_host(q.addr.as_str())
            .await
            .ok()
            .and_then(|a| {
                let all: Vec<_> = a.collect();
                all.iter().find(|a| a.is_ipv4()).or(all.first()).copied()
            })
            .ok_or_else(|| {
                Error::disconnected(KIND, format!("cannot resolve broker {}", q.addr))
            })?,
    };
    let id = offset_message_id(broker, commit_log_offset);
    match ConsumerAdmin::query_message(admin, "".into(), topic.into(), id.into()).await {
        Ok(m) => Ok(Some(m)),
        // The broker answered, but holds no such message.
        Err(_) if reachable(&q.addr).await => Ok(None),
        Err(e) => Err(err(e)),
    }
}

/// RocketMQ's offset message id: the storing broker's address and the
/// message's commit-log offset, in hex.
pub(super) fn offset_message_id(addr: std::net::SocketAddr, commit_log_offset: i64) -> String {
    let port = i32::from(addr.port());
    match addr.ip() {
        std::net::IpAddr::V4(ip) => {
            format!("{:08X}{port:08X}{commit_log_offset:016X}", u32::from(ip))
        }
        std::net::IpAddr::V6(ip) => {
            format!("{:032X}{port:08X}{commit_log_offset:016X}", u128::from(ip))
        }
    }
}

/// Whether the message this node read just before offset `n` is still
/// where it was. A position without an anchor (from before anchors, or one
/// this node never read) cannot vouch for its history.
pub(super) async fn same_history(
    admin: &DefaultMQAdminExt,
    topic: &str,
    q: &QueueRef,
    n: i64,
    position: &Position,
) -> Result<bool> {
    let Some(anchor) = position
        .get(&anchor_partition(&q.name))
        .and_then(Anchor::from_offset)
    else {
        return Ok(false);
    };
    let Some(m) = view_message(admin, topic, q, anchor.commit_log_offset).await? else {
        return Ok(false);
    };
    Ok(Anchor::of(&m) == anchor
        && m.queue_offset().checked_add(1) == Some(n)
        && m.queue_id() == q.mq.queue_id()
        && m.topic().as_str() == topic)
}

/// Writes the consumer's `offsets.json` before it starts: the client then
/// begins every queue exactly there. It never creates the directory itself.
pub(super) fn seed_offsets(
    dir: &Path,
    topic: &str,
    queues: &[QueueRef],
    seed: &Position,
) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let mut table = serde_json::Map::new();
    for q in queues {
        let Some(Offset::Seq(n)) = seed.get(&q.name) else {
            continue;
        };
        let key = serde_json::json!({
            "topic": topic,
            "brokerName": q.mq.broker_name().to_string(),
            "queueId": q.mq.queue_id(),
        })
        .to_string();
        table.insert(key, serde_json::Value::from(*n));
    }
    let body = serde_json::json!({ "offsetTable": table }).to_string();
    let file = dir.join("offsets.json");
    std::fs::write(&file, body).map_err(io(&file))
}

#[cfg(test)]
mod tests {
    use rocketmq_model::common::message::message_queue::MessageQueue;

    use super::*;

    #[test]
    fn seeded_offsets_use_the_clients_format() {
        let dir = tempfile::tempdir().unwrap();
        let q = QueueRef {
            mq: MessageQueue::from_parts("t", "broker-a", 2),
            addr: "127.0.0.1:10911".into(),
            name: partition("broker-a", 2),
        };
        let seed = Position::single("broker-a:2", Offset::Seq(25));
        seed_offsets(dir.path(), "t", &[q], &seed).unwrap();
        let text = std::fs::read_to_string(dir.path().join("offsets.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let table = v["offsetTable"].as_object().unwrap();
        let (key, value) = table.iter().next().unwrap();
        let key: serde_json::Value = serde_json::from_str(key).unwrap();
        assert_eq!(key["brokerName"], "broker-a");
        assert_eq!(key["queueId"], 2);
        assert_eq!(value, 25);
    }
}
