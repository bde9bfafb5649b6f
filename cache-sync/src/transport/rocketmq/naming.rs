//! How cache-sync's names map to RocketMQ's: escaped topics and tags, the
//! `<broker>:<queue>` partition that names a queue in a position, and the
//! hash that picks a cache's queue. Together so that the producer, the
//! consumer and start planning agree on them.

use rocketmq_model::common::message::message_queue::MessageQueue;

use super::super::Offset;
use crate::transport::names;

/// A topic as RocketMQ names it: letters, digits, `-` and `_` as they are,
/// everything else escaped (`%XX`, which RocketMQ's topic alphabet allows).
/// Escaping `%` also keeps user topics clear of `%RETRY%` and `%DLQ%`.
pub(super) fn rmq_topic(topic: &str) -> std::borrow::Cow<'_, str> {
    names::escape(topic, names::plain)
}

/// A cache name as a message tag, escaped the same way: a raw `||` would
/// split one tag into two in a subscription expression, and spaces around
/// a tag are trimmed by the client.
pub(super) fn rmq_tag(cache: &str) -> std::borrow::Cow<'_, str> {
    names::escape(cache, names::plain)
}

/// Java's `String.hashCode`, as the client's `SelectMessageQueueByHash` uses.
pub(super) fn java_hash(s: &str) -> i32 {
    s.encode_utf16()
        .fold(0i32, |h, c| h.wrapping_mul(31).wrapping_add(i32::from(c)))
}

pub(super) fn partition(broker: &str, queue_id: i32) -> String {
    format!("{broker}:{queue_id}")
}

/// Where a subscription notes how far its consumer has read in a queue,
/// past messages the broker filtered out: what the freshness bound is
/// checked against, never where a subscription resumes (see
/// `watch_skips`). A name no queue's partition or anchor takes.
pub(super) fn read_past(queue: &str) -> String {
    format!("{queue}~")
}

pub(super) fn next_offset(offset: i64) -> Offset {
    Offset::Seq(u64::try_from(offset.saturating_add(1)).unwrap_or(0))
}

/// One queue of a topic and the master broker serving it.
#[derive(Debug, Clone)]
pub(super) struct QueueRef {
    pub(super) mq: MessageQueue,
    pub(super) addr: String,
    pub(super) name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn java_hash_matches_string_hash_code() {
        assert_eq!(java_hash(""), 0);
        assert_eq!(java_hash("a"), 97);
        assert_eq!(java_hash("users"), 111_578_632);
    }
}
