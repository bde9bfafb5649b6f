//! Heartbeat and reply channels: streams of their own beside the topic's,
//! capped and expiring, read from where they end. Apart from the change
//! stream because they share none of its keys, ordinals or retention.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::Value;
use redis::aio::MultiplexedConnection;

use super::RedisStreamsTransport;
use super::reply::{parse_entry, parse_xread};
use crate::error::Result;
use crate::transport::HeartbeatSubscription;
use crate::transport::redis::{STREAMS, bad_reply, map_err};

/// Entries the heartbeat stream keeps (`MAXLEN ~`, so Redis may keep up to
/// one more radix-tree node of them): a subscriber reads only what arrives
/// after it subscribed, so this is slack for a reader between two
/// `XREAD`s, not history. A roll call makes every node answer within
/// milliseconds, so it is sized for a large cluster's burst: entries
/// trimmed before a reader got them would be heartbeats silently missed.
const HEARTBEAT_MAX_LEN: u32 = 4096;

/// How long the heartbeat stream outlives its last publish: well above any
/// heartbeat interval, so it does not blink out between beats, and short
/// enough that an abandoned topic's key goes soon.
const HEARTBEAT_TTL: Duration = Duration::from_secs(60);

/// Entries one heartbeat `XREAD` takes.
const HEARTBEAT_READ: usize = 256;

impl RedisStreamsTransport {
    /// `<stream key>:hb`. The escaped topic holds no `:`, so this is no
    /// other topic's stream, counter or epoch key, nor theirs this one.
    /// Made apart from [`keys`](Self::keys), which every publish calls.
    pub(super) fn heartbeat_key(&self, topic: &str) -> String {
        format!("{}:hb", self.stream_key(topic))
    }

    /// `<stream key>:hb:r:<to, 16 hex digits>`: a party's reply stream,
    /// after the heartbeat stream's key, so no other key of this or
    /// another topic.
    pub(super) fn reply_key(&self, topic: &str, to: u64) -> String {
        format!("{}:r:{to:016x}", self.heartbeat_key(topic))
    }

    /// Appends to a heartbeat or reply stream, which expires a while after
    /// its last message, so a channel nobody uses any more leaves no key.
    pub(super) async fn publish_beat(&self, key: String, payload: &[u8]) -> Result<()> {
        let ttl_ms = u64::try_from(HEARTBEAT_TTL.as_millis()).unwrap_or(u64::MAX);
        let mut conn = self.publisher.clone();
        // In one MULTI: the key never lives on without its expiry.
        let (_id, _expiring): (String, i64) = redis::pipe()
            .atomic()
            .cmd("XADD")
            .arg(&key)
            .arg("MAXLEN")
            .arg("~")
            .arg(HEARTBEAT_MAX_LEN)
            .arg("*")
            .arg("p")
            .arg(payload)
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(ttl_ms)
            .query_async(&mut conn)
            .await
            .map_err(|e| map_err(STREAMS, e))?;
        Ok(())
    }

    /// Reads a heartbeat or reply stream from where it ends now.
    pub(super) async fn read_beats(&self, key: String) -> Result<Box<dyn HeartbeatSubscription>> {
        let mut conn = self.reader(&key).await?;
        // The end is fixed now, not by the first `XREAD` with `$`: what is
        // published between this return and the first `next` is delivered.
        // No key yet: everything it will hold comes after this.
        let last: Value = redis::cmd("XREVRANGE")
            .arg(&key)
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut conn)
            .await
            .map_err(|e| map_err(STREAMS, e))?;
        let id = match last {
            Value::Array(mut entries) if !entries.is_empty() => {
                parse_entry(entries.swap_remove(0))
                    .ok_or_else(|| bad_reply(STREAMS, "XREVRANGE entry"))?
                    .id
            }
            _ => "0-0".to_owned(),
        };
        Ok(Box::new(StreamsHeartbeats {
            conn,
            key,
            id,
            block_ms: self.block_ms(),
            read: VecDeque::new(),
        }))
    }
}

/// A heartbeat subscription: `XREAD BLOCK` on the heartbeat stream, from the
/// last id read.
struct StreamsHeartbeats {
    conn: MultiplexedConnection,
    key: String,
    /// Last id read; the next read starts after it. Moved only once a reply
    /// is in `read`, so a cancelled `XREAD` is asked again.
    id: String,
    block_ms: u64,
    /// Payloads read but not handed out yet.
    read: VecDeque<Bytes>,
}

impl fmt::Debug for StreamsHeartbeats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamsHeartbeats")
            .field("key", &self.key)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl HeartbeatSubscription for StreamsHeartbeats {
    async fn next(&mut self) -> Result<Bytes> {
        loop {
            if let Some(payload) = self.read.pop_front() {
                return Ok(payload);
            }
            // The reader's response timeout is `block` plus the configured
            // response timeout, so a server that stops answering fails this.
            let reply: Value = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(HEARTBEAT_READ)
                .arg("BLOCK")
                .arg(self.block_ms)
                .arg("STREAMS")
                .arg(&self.key)
                .arg(&self.id)
                .query_async(&mut self.conn)
                .await
                .map_err(|e| map_err(STREAMS, e))?;
            for v in parse_xread(reply) {
                let entry = parse_entry(v).ok_or_else(|| bad_reply(STREAMS, "XREAD entry"))?;
                self.id = entry.id;
                self.read.push_back(entry.payload);
            }
        }
    }
}
