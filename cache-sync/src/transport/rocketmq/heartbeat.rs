//! Heartbeats: a topic of their own beside the change topic, and a
//! subscription that hands its payloads out one at a time. Apart from the
//! change path because the two share no topic, offsets or tags.

use std::collections::VecDeque;

use async_trait::async_trait;
use bytes::Bytes;
use rocketmq_model::common::topic::TOPIC_MAX_LENGTH;

use super::super::{Delivery, HeartbeatSubscription, Subscription};
use super::*;
use crate::error::{Error, Result};

/// Heartbeats go to a RocketMQ topic of their own beside the change topic,
/// `<escaped topic>%hb`, rather than into the change topic under a reserved
/// tag. A tag would keep them from change subscriptions that filter by tag
/// at the broker, but not from one that asks for every tag (`*`), and they
/// would take queue offsets in the change topic, which positions name. The
/// name is one no topic escapes to: [`rmq_topic`] writes `%` only before two
/// upper-case hex digits, and `h` is none. The topic is created the way a
/// change topic is, on first use. RocketMQ has no retention per topic, so
/// the brokers keep heartbeats as long as their commit log (by time and
/// disk, 72 h by default); a heartbeat subscription starts at the end and
/// reads none of them.
fn rmq_heartbeat_topic(topic: &str) -> String {
    format!("{}{HEARTBEAT_SUFFIX}", rmq_topic(topic))
}

/// Appended to the escaped topic for its heartbeat topic (see
/// [`rmq_heartbeat_topic`]).
const HEARTBEAT_SUFFIX: &str = "%hb";

/// The tag of every heartbeat message: the heartbeat topic carries nothing
/// else, so it only labels them for someone reading the topic by hand.
pub(super) const HEARTBEAT_TAG: &str = "heartbeat";

/// Heartbeats a heartbeat subscription takes from its consumer at a time.
const HEARTBEAT_BATCH: usize = 32;

impl RocketMqTransport {
    /// The heartbeat topic of a topic this transport accepts, or
    /// `Unsupported` where the suffix would take it past RocketMQ's topic
    /// length limit: refusing such a topic in `check_topic` would refuse a
    /// name that carries change events fine.
    pub(super) fn heartbeat_topic(&self, topic: &str) -> Result<String> {
        self.check_topic(topic)?;
        let name = rmq_heartbeat_topic(topic);
        if name.len() > TOPIC_MAX_LENGTH {
            return Err(Error::Unsupported {
                transport: KIND,
                what: "heartbeats on a topic within 3 characters of RocketMQ's topic length limit",
            });
        }
        Ok(name)
    }
}

/// A heartbeat subscription: a change subscription to the heartbeat topic
/// from its end, handing out payloads one at a time.
#[derive(Debug)]
pub(super) struct RocketMqHeartbeats {
    pub(super) subscription: RocketMqSubscription,
    /// Payloads taken from the subscription but not handed out yet; kept so
    /// a cancelled `next` loses nothing.
    pub(super) read: VecDeque<Bytes>,
}

#[async_trait]
impl HeartbeatSubscription for RocketMqHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            if let Some(payload) = self.read.pop_front() {
                return Ok(payload);
            }
            match self.subscription.next(HEARTBEAT_BATCH).await? {
                Delivery::Batch { records, .. } => {
                    self.read.extend(records.into_iter().map(|r| r.payload));
                }
                // A heartbeat channel may skip: the next beat says it all again.
                Delivery::Lost(_) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_topics_are_no_topics_escape() {
        for topic in ["x", "x%hb", "x hb", "%68b", "ü"] {
            let hb = rmq_heartbeat_topic(topic);
            assert!(hb.ends_with("%hb"), "{hb}");
            // No topic escapes to a name holding `%h`: the suffix is unique.
            assert!(!rmq_topic(topic).contains("%h"), "{topic}");
        }
        assert_ne!(rmq_heartbeat_topic("x"), rmq_topic("x%hb"));
    }
}
