//! Redis Streams: durable and replayable, with trimming and resets detected.

use std::collections::VecDeque;
use std::fmt;
use std::sync::LazyLock;
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, Value};

use super::super::{
    Delivery, HeartbeatSubscription, Loss, LossReason, Offset, Position, Record, StartFrom,
    SubscribeOptions, Subscription, Tags, Transport,
};
use super::{
    EPOCH, ID, ORDINAL, STREAMS, bad_reply, check_timeout, key_part, map_err, publisher_connection,
};
use crate::error::{Error, Result};
use crate::util::check_at_least;

/// Each entry records its own ordinal: how many entries the stream has ever
/// received, counting this one. Readers compare ordinals to find entries
/// that `MAXLEN` trimming removed before they were read, which `XREAD`
/// otherwise skips without a word.
///
/// The count lives in a counter key next to the stream (`KEYS[2]`), bumped in
/// the same atomic step as the `XADD`. It equals the stream's own
/// `entries-added`, but reading that takes `XINFO STREAM`, which builds the
/// whole stream summary (first and last entries included) and made each
/// publish cost Redis about 5× a plain `XADD`. A missing counter (first
/// publish, an evicted or deleted key, a stream written by an older
/// cache-sync) restarts from `entries-added`, so the count never jumps back
/// while the stream lives. A failed `XADD` takes its number back, so it
/// causes no false gap.
const XADD_SCRIPT: &str = concat!(
    include_str!("redis_epoch.lua"),
    include_str!("redis_publish.lua")
);

/// Where the stream stands, read in one atomic step: the ordinal of its last
/// entry (the counter, or `entries-added` without one), its length, its
/// last id, and its epoch. The epoch is made here if the stream has none
/// yet, exactly as the publish script would, so that a reader of a stream
/// nobody has written to yet still has a history to name: had it none, a
/// wipe and a new stream grown past its position would go unnoticed.
const STATE_SCRIPT: &str = concat!(
    include_str!("redis_epoch.lua"),
    r"
local added, length, last = 0, 0, '0-0'
local ok, info = pcall(redis.call, 'XINFO', 'STREAM', KEYS[1])
if ok then
  for i = 1, #info, 2 do
    local k = info[i]
    if k == 'entries-added' then added = info[i + 1]
    elseif k == 'length' then length = info[i + 1]
    elseif k == 'last-generated-id' then last = info[i + 1] end
  end
end
local counter = redis.call('GET', KEYS[2])
if counter then added = tonumber(counter) end
return {added, length, last, stream_epoch()}
"
);

/// The Redis Streams transport: one stream per topic; every node reads it
/// with `XREAD BLOCK` from its own last id (no consumer group: broadcast).
///
/// - **Delivery:** every entry still in the stream, in order, to every node.
/// - **Retention:** `XADD … MAXLEN ~ n` (default 100 000 entries). A node that
///   falls further behind, or resumes from a position older than that, gets
///   [`LossReason::Trimmed`] with the number of entries missed.
/// - **Disconnects:** the subscription fails; the node re-subscribes from its
///   last id with backoff, losing nothing still in the stream.
/// - **History reset** (the stream deleted, or a Redis without persistence
///   restarted): detected from the ordinals and signalled as
///   [`LossReason::HistoryReset`].
/// - **Start positions:** latest, earliest, a stored position, a timestamp.
/// - **Heartbeats** ([`Transport::publish_heartbeat`]) go to a stream of
///   their own beside the topic's, `<stream key>:hb`, so they never take
///   the change stream's `MAXLEN` room or its ordinals, and no change
///   subscription reads them. It keeps about 4096 entries (`MAXLEN ~ 4096`),
///   and each publish sets it to expire a minute later, so a topic nobody
///   beats on any more leaves no key behind. A heartbeat subscription reads
///   it with `XREAD BLOCK` from where it ended when the subscription was
///   made. A party's reply channel ([`Transport::publish_reply`]) is a
///   stream of the same kind, `<stream key>:hb:r:<party, 16 hex digits>`,
///   read only by that party.
///
/// Needs Redis 7.0 or later (`entries-added` in `XINFO STREAM`).
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[derive(Clone)]
pub struct RedisStreamsTransport {
    client: Client,
    publisher: ConnectionManager,
    script: redis::Script,
    config: StreamsConfig,
}

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

/// The stream's key, and the keys of its ordinal counter and its epoch.
#[derive(Debug, Clone)]
struct StreamKeys {
    stream: String,
    counter: String,
    epoch: String,
}

impl fmt::Debug for RedisStreamsTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStreamsTransport")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone)]
struct StreamsConfig {
    max_len: usize,
    block: Duration,
    response_timeout: Duration,
    key_prefix: String,
}

/// Configures a [`RedisStreamsTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[derive(Debug, Clone)]
pub struct RedisStreamsBuilder {
    url: String,
    config: StreamsConfig,
}

impl RedisStreamsBuilder {
    /// Approximate number of entries kept per topic (`MAXLEN ~`). Default
    /// 100 000; at least 1, or [`connect`](Self::connect) refuses it.
    pub fn max_len(mut self, n: usize) -> Self {
        self.config.max_len = n;
        self
    }

    /// How long one `XREAD BLOCK` waits before asking again. Default 5 s;
    /// between 1 ms and an hour, or [`connect`](Self::connect) refuses it.
    /// The reader's response timeout is this plus
    /// [`response_timeout`](Self::response_timeout); the `redis` crate's
    /// default of 500 ms would fail every blocking read.
    pub fn block(mut self, block: Duration) -> Self {
        self.config.block = block;
        self
    }

    /// How long to wait for a connection or an answer before treating the
    /// server as unreachable. Default 5 s; between 1 ms and an hour, or
    /// [`connect`](Self::connect) refuses it.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.config.response_timeout = timeout;
        self
    }

    /// Prefix of the stream key; the topic follows. Default `"cache-sync:"`.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.key_prefix = prefix.into();
        self
    }

    /// Connects and checks the server version.
    ///
    /// A setting out of its range is refused with [`Error::Config`] before
    /// anything is sent.
    pub async fn connect(self) -> Result<RedisStreamsTransport> {
        self.check()?;
        let client = Client::open(self.url.as_str()).map_err(|e| Error::Config(e.to_string()))?;
        let mut publisher =
            publisher_connection(&client, STREAMS, self.config.response_timeout).await?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut publisher)
            .await
            .map_err(|e| map_err(STREAMS, e))?;
        let version = info
            .lines()
            .find_map(|l| l.strip_prefix("redis_version:"))
            .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
        if version.is_none_or(|major| major < 7) {
            return Err(Error::Unsupported {
                transport: STREAMS,
                what: "Redis before 7.0",
            });
        }
        Ok(RedisStreamsTransport {
            client,
            publisher,
            script: redis::Script::new(XADD_SCRIPT),
            config: self.config,
        })
    }

    /// Everything `connect` refuses, checked without touching the network.
    pub(super) fn check(&self) -> Result<()> {
        let c = &self.config;
        check_at_least("redis-streams max_len", c.max_len, 1)?;
        check_timeout("redis-streams block", c.block)?;
        check_timeout("redis-streams response_timeout", c.response_timeout)
    }
}

impl RedisStreamsTransport {
    /// Configures a transport for the server at `url` (`redis://127.0.0.1:6379/`).
    pub fn builder(url: impl Into<String>) -> RedisStreamsBuilder {
        RedisStreamsBuilder {
            url: url.into(),
            config: StreamsConfig {
                max_len: 100_000,
                block: Duration::from_secs(5),
                response_timeout: Duration::from_secs(5),
                key_prefix: "cache-sync:".into(),
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(url: impl Into<String>) -> Result<Self> {
        Self::builder(url).connect().await
    }

    /// `<prefix><topic>`, with `:` (and `%`) in the topic escaped: the
    /// counter and epoch keys append `:n` and `:e`, and unescaped, topic
    /// `x:n` would have been topic `x`'s counter.
    fn keys(&self, topic: &str) -> StreamKeys {
        let stream = format!("{}{}", self.config.key_prefix, key_part(topic));
        StreamKeys {
            counter: format!("{stream}:n"),
            epoch: format!("{stream}:e"),
            stream,
        }
    }

    /// `<stream key>:hb`. The escaped topic holds no `:`, so this is no
    /// other topic's stream, counter or epoch key, nor theirs this one.
    /// Made apart from [`keys`](Self::keys), which every publish calls.
    fn heartbeat_key(&self, topic: &str) -> String {
        format!("{}{}:hb", self.config.key_prefix, key_part(topic))
    }

    /// `<stream key>:hb:r:<to, 16 hex digits>`: a party's reply stream,
    /// after the heartbeat stream's key, so no other key of this or
    /// another topic.
    fn reply_key(&self, topic: &str, to: u64) -> String {
        format!("{}:r:{to:016x}", self.heartbeat_key(topic))
    }

    fn block_ms(&self) -> u64 {
        u64::try_from(self.config.block.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    async fn reader(&self) -> Result<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.config.response_timeout))
            .set_response_timeout(Some(
                self.config
                    .block
                    .saturating_add(self.config.response_timeout),
            ));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| map_err(STREAMS, e))
    }
}

/// Where the stream stands (see `STATE_SCRIPT`).
#[derive(Debug, Default)]
struct StreamState {
    /// Ordinal of the last entry ever added.
    entries_added: u64,
    length: u64,
    last_id: String,
    epoch: u64,
}

impl StreamState {
    /// Ordinal of the entry before the oldest one kept.
    fn trimmed(&self) -> u64 {
        self.entries_added.saturating_sub(self.length)
    }

    fn position(&self) -> Position {
        streams_position(&self.last_id, self.entries_added, self.epoch)
    }
}

/// Hashed once: `Script::new` computes the SHA-1 that `EVALSHA` sends.
static STATE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(STATE_SCRIPT));

async fn stream_state(conn: &mut MultiplexedConnection, keys: &StreamKeys) -> Result<StreamState> {
    let (entries_added, length, last_id, epoch): (u64, u64, String, String) = STATE
        .key(&keys.stream)
        .key(&keys.counter)
        .key(&keys.epoch)
        .invoke_async(conn)
        .await
        .map_err(|e| map_err(STREAMS, e))?;
    // An epoch that is not a number was not written by cache-sync; 0 never
    // matches one that was, so a position from it reads as another history.
    Ok(StreamState {
        entries_added,
        length,
        last_id,
        epoch: epoch.parse().unwrap_or(0),
    })
}

fn into_string(v: Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        Value::VerbatimString { text, .. } => Some(text),
        _ => None,
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// One stream entry as read.
struct Entry {
    id: String,
    ordinal: Option<u64>,
    /// Entries of a cache-sync before epochs carry none.
    epoch: Option<u64>,
    tag: Option<String>,
    payload: Bytes,
}

/// Takes the entry apart without copying: every node parses every entry, so
/// this runs once per event per node.
fn parse_entry(v: Value) -> Option<Entry> {
    let Value::Array(parts) = v else {
        return None;
    };
    let mut parts = parts.into_iter();
    let (Some(id), Some(Value::Array(fields)), None) = (parts.next(), parts.next(), parts.next())
    else {
        return None;
    };
    let mut entry = Entry {
        id: into_string(id)?,
        ordinal: None,
        epoch: None,
        tag: None,
        payload: Bytes::new(),
    };
    let mut fields = fields.into_iter();
    while let (Some(k), Some(v)) = (fields.next(), fields.next()) {
        let Value::BulkString(k) = k else { continue };
        match (k.as_slice(), v) {
            (b"n", v) => entry.ordinal = as_u64(&v),
            (b"e", v) => entry.epoch = Some(as_u64(&v).unwrap_or(0)),
            (b"t", v) => entry.tag = into_string(v),
            (b"p", Value::BulkString(b)) => entry.payload = Bytes::from(b),
            _ => {}
        }
    }
    Some(entry)
}

/// Entries from an `XREAD` reply for one key (RESP2 array or RESP3 map).
fn parse_xread(v: Value) -> Vec<Value> {
    let streams: Vec<Value> = match v {
        Value::Nil => return Vec::new(),
        Value::Array(streams) => streams
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut kv) if kv.len() == 2 => kv.pop(),
                _ => None,
            })
            .collect(),
        Value::Map(m) => m.into_iter().map(|(_, v)| v).collect(),
        _ => return Vec::new(),
    };
    streams
        .into_iter()
        .flat_map(|s| match s {
            Value::Array(entries) => entries,
            _ => Vec::new(),
        })
        .collect()
}

fn streams_position(id: &str, ordinal: u64, epoch: u64) -> Position {
    let mut p = Position::single(ID, Offset::Id(id.to_owned()));
    p.set(ORDINAL, Offset::Seq(ordinal));
    p.set(EPOCH, Offset::Seq(epoch));
    p
}

#[async_trait]
impl Transport for RedisStreamsTransport {
    fn kind(&self) -> &'static str {
        STREAMS
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        self.check_tag(tag)?;
        let mut conn = self.publisher.clone();
        let keys = self.keys(topic);
        let id: String = self
            .script
            .key(&keys.stream)
            .key(&keys.counter)
            .key(&keys.epoch)
            .arg(self.config.max_len)
            .arg(tag)
            .arg(payload.as_ref())
            .invoke_async(&mut conn)
            .await
            .map_err(|e| map_err(STREAMS, e))?;
        Ok(Some(Position::single(ID, Offset::Id(id))))
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        self.check_topic(topic)?;
        let keys = self.keys(topic);
        let mut conn = self.reader().await?;
        let state = stream_state(&mut conn, &keys).await?;
        let trimmed = state.trimmed();
        let mut pending = None;
        let (id, ordinal) = match options.from {
            StartFrom::Latest => (state.last_id.clone(), state.entries_added),
            StartFrom::Earliest => ("0-0".to_owned(), trimmed),
            StartFrom::Position(p) => match (p.get(ID), p.get(ORDINAL), p.get(EPOCH)) {
                (Some(Offset::Id(id)), Some(Offset::Seq(n)), Some(Offset::Seq(e)))
                    if *e == state.epoch && *n <= state.entries_added =>
                {
                    if let Some(missed) = trimmed.checked_sub(*n).filter(|&m| m > 0) {
                        // Entries after the stored position are gone already.
                        pending = Some(Loss::new(
                            LossReason::Trimmed,
                            Some(missed),
                            Some(streams_position(id, trimmed, state.epoch)),
                        ));
                        (id.clone(), trimmed)
                    } else {
                        (id.clone(), *n)
                    }
                }
                // Another history (another epoch, or a position from before
                // epochs), or an ordinal past this one's end.
                _ => {
                    pending = Some(Loss::new(
                        LossReason::HistoryReset,
                        None,
                        Some(state.position()),
                    ));
                    (state.last_id.clone(), state.entries_added)
                }
            },
            StartFrom::Timestamp(t) => {
                let ms = t
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                let first: Value = redis::cmd("XRANGE")
                    .arg(&keys.stream)
                    .arg(ms)
                    .arg("+")
                    .arg("COUNT")
                    .arg(1)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| map_err(STREAMS, e))?;
                let first = match first {
                    Value::Array(mut v) if !v.is_empty() => parse_entry(v.swap_remove(0)),
                    _ => None,
                };
                // XREAD returns ids after the one given: start just before `ms`.
                let start = match ms.checked_sub(1) {
                    Some(before) => format!("{before}-{}", u64::MAX),
                    None => "0-0".to_owned(),
                };
                match first.and_then(|e| e.ordinal) {
                    Some(n) => {
                        // `n` is the oldest entry kept at or after `t`:
                        // trimmed ones came before it, and some of them may
                        // have been at or after `t`.
                        let before = n.saturating_sub(1);
                        if before == trimmed && trimmed > 0 {
                            pending = Some(Loss::new(LossReason::Trimmed, None, None));
                        }
                        (start, before)
                    }
                    None => {
                        if state.length == 0 && trimmed > 0 {
                            pending = Some(Loss::new(LossReason::Trimmed, None, None));
                        }
                        (state.last_id.clone(), state.entries_added)
                    }
                }
            }
        };
        Ok(Box::new(StreamsSubscription {
            conn,
            keys,
            id,
            ordinal,
            epoch: state.epoch,
            block_ms: self.block_ms(),
            pending,
            tags: Tags::default(),
        }))
    }

    async fn publish_heartbeat(&self, topic: &str, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_beat(self.heartbeat_key(topic), &payload).await
    }

    async fn subscribe_heartbeats(&self, topic: &str) -> Result<Box<dyn HeartbeatSubscription>> {
        self.check_topic(topic)?;
        self.read_beats(self.heartbeat_key(topic)).await
    }

    async fn publish_reply(&self, topic: &str, to: u64, payload: Bytes) -> Result<()> {
        self.check_topic(topic)?;
        self.publish_beat(self.reply_key(topic, to), &payload).await
    }

    async fn subscribe_replies(
        &self,
        topic: &str,
        to: u64,
    ) -> Result<Box<dyn HeartbeatSubscription>> {
        self.check_topic(topic)?;
        self.read_beats(self.reply_key(topic, to)).await
    }
}

impl RedisStreamsTransport {
    /// Appends to a heartbeat or reply stream, which expires a while after
    /// its last message, so a channel nobody uses any more leaves no key.
    async fn publish_beat(&self, key: String, payload: &[u8]) -> Result<()> {
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
    async fn read_beats(&self, key: String) -> Result<Box<dyn HeartbeatSubscription>> {
        let mut conn = self.reader().await?;
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

struct StreamsSubscription {
    conn: MultiplexedConnection,
    keys: StreamKeys,
    /// Last id read; the next read starts after it.
    id: String,
    /// Ordinal of the entry at `id`.
    ordinal: u64,
    /// The history `id` and `ordinal` belong to.
    epoch: u64,
    block_ms: u64,
    pending: Option<Loss>,
    tags: Tags,
}

impl fmt::Debug for StreamsSubscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamsSubscription")
            .field("key", &self.keys.stream)
            .field("id", &self.id)
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

impl StreamsSubscription {
    fn position(&self) -> Position {
        streams_position(&self.id, self.ordinal, self.epoch)
    }

    /// Continues from where the stream stands now, in whatever history it
    /// holds: everything before is unknown to this node.
    fn reset_to(&mut self, state: &StreamState) -> Loss {
        self.id.clone_from(&state.last_id);
        self.ordinal = state.entries_added;
        self.epoch = state.epoch;
        Loss::new(LossReason::HistoryReset, None, Some(self.position()))
    }

    async fn idle_check(&mut self) -> Result<Option<Loss>> {
        let state = stream_state(&mut self.conn, &self.keys).await?;
        if state.epoch != self.epoch || state.entries_added < self.ordinal {
            return Ok(Some(self.reset_to(&state)));
        }
        let trimmed = state.trimmed();
        if let Some(missed) = trimmed.checked_sub(self.ordinal).filter(|&m| m > 0) {
            self.ordinal = trimmed;
            return Ok(Some(Loss::new(
                LossReason::Trimmed,
                Some(missed),
                Some(self.position()),
            )));
        }
        Ok(None)
    }
}

#[async_trait]
impl Subscription for StreamsSubscription {
    async fn next(&mut self, max: usize) -> Result<Delivery> {
        if let Some(loss) = self.pending.take() {
            return Ok(Delivery::Lost(loss));
        }
        loop {
            let reply: Value = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(max.max(1))
                .arg("BLOCK")
                .arg(self.block_ms)
                .arg("STREAMS")
                .arg(&self.keys.stream)
                .arg(&self.id)
                .query_async(&mut self.conn)
                .await
                .map_err(|e| map_err(STREAMS, e))?;
            let raw = parse_xread(reply);
            if raw.is_empty() {
                // Idle: a trim (XTRIM) or a reset with nothing new after it
                // would otherwise go unnoticed until the next entry.
                if let Some(loss) = self.idle_check().await? {
                    return Ok(Delivery::Lost(loss));
                }
                continue;
            }
            let mut records = Vec::with_capacity(raw.len());
            for v in raw {
                let Some(entry) = parse_entry(v) else {
                    return Err(bad_reply(STREAMS, "XREAD entry"));
                };
                let expected = self.ordinal.checked_add(1);
                let same_history = entry.epoch.is_none_or(|e| e == self.epoch);
                match (entry.ordinal, expected) {
                    (Some(n), Some(x)) if same_history && n == x => self.ordinal = n,
                    (Some(n), Some(x)) if same_history && n > x => {
                        if !records.is_empty() {
                            // A jump mid-batch: deliver what came before it first.
                            break;
                        }
                        // Entries between our last read and this one were
                        // trimmed; `n > ordinal + 1` here.
                        let missed = n.saturating_sub(x);
                        self.ordinal = n.saturating_sub(1);
                        return Ok(Delivery::Lost(Loss::new(
                            LossReason::Trimmed,
                            Some(missed),
                            Some(self.position()),
                        )));
                    }
                    _ => {
                        // Another epoch, ordinals that went backwards or are
                        // missing: a different stream than the one we read.
                        let state = stream_state(&mut self.conn, &self.keys).await?;
                        let loss = self.reset_to(&state);
                        if records.is_empty() {
                            return Ok(Delivery::Lost(loss));
                        }
                        self.pending = Some(loss);
                        break;
                    }
                }
                self.id.clone_from(&entry.id);
                let tag = entry.tag.as_deref().map(|t| self.tags.get(t));
                records.push(Record::new(tag, entry.payload).at(Offset::Id(entry.id)));
            }
            return Ok(Delivery::Batch {
                records,
                position: self.position(),
            });
        }
    }

    fn position(&self) -> Option<Position> {
        Some(StreamsSubscription::position(self))
    }
}
