//! Heartbeat and reply channels: channels of their own beside the topic's,
//! each subscription on a connection of its own, PINGed while quiet.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use redis::Value;

use super::RedisPubSubTransport;
use super::sharded::ShardHeartbeats;
use crate::error::{Error, Result};
use crate::transport::HeartbeatSubscription;
use crate::transport::redis::{PUBSUB, map_err};

impl RedisPubSubTransport {
    /// A heartbeat or reply channel's subscription, on a connection of its
    /// own.
    pub(super) async fn listen_beats(
        &self,
        channel: &str,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        if let Some(servers) = &self.sharded {
            let beats = ShardHeartbeats::start(servers, channel, self.shard_settings()).await?;
            return Ok(Box::new(beats));
        }
        let (sink, stream) = self.listen(channel).await?;
        Ok(Box::new(PubSubHeartbeats {
            sink,
            stream,
            ping_interval: self.config.ping_interval,
            ping_timeout: self.config.ping_timeout,
        }))
    }
}

/// A heartbeat subscription on its own pub/sub connection.
struct PubSubHeartbeats {
    sink: redis::aio::PubSubSink,
    stream: redis::aio::PubSubStream,
    ping_interval: Duration,
    ping_timeout: Duration,
}

impl fmt::Debug for PubSubHeartbeats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PubSubHeartbeats").finish_non_exhaustive()
    }
}

#[async_trait]
impl HeartbeatSubscription for PubSubHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            // A quiet link is PINGed: a connection that died without a
            // reset would otherwise wait here for ever, and the caller,
            // never told, would never subscribe again. Heartbeats are few,
            // so a timer per wait costs nothing worth saving.
            match tokio::time::timeout(self.ping_interval, self.stream.next()).await {
                Ok(Some(msg)) => return Ok(Bytes::copy_from_slice(msg.get_payload_bytes())),
                Ok(None) => {
                    return Err(Error::disconnected(
                        PUBSUB,
                        "the heartbeat connection closed",
                    ));
                }
                Err(_) => {
                    match tokio::time::timeout(self.ping_timeout, self.sink.ping::<Value>()).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => return Err(map_err(PUBSUB, e)),
                        Err(_) => {
                            return Err(Error::disconnected(PUBSUB, "PING went unanswered"));
                        }
                    }
                }
            }
        }
    }
}
