//! Redis Streams: durable and replayable, with trimming and resets detected.
//! This file holds the transport type, its stream keys and reader
//! connections, and its [`Transport`] impl; the parts it is built from live
//! in the files below.

use std::fmt;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Value};

use super::super::{
    HeartbeatSubscription, Loss, LossReason, Offset, PendingPublish, Position, StartFrom,
    SubscribeOptions, Subscription, Tags, Transport,
};
use super::servers::{Commands, Servers};
use super::{EPOCH, ID, ORDINAL, STREAMS, key_part, map_err};
use crate::error::Result;

mod builder;
mod heartbeat;
mod pipeline;
mod reply;
mod state;
mod subscription;

pub use builder::RedisStreamsBuilder;
use builder::StreamsConfig;
use reply::parse_entry;
use state::{stream_state, streams_position};
use subscription::StreamsSubscription;

/// The Redis Streams transport: one stream per topic; every node reads it
/// with `XREAD BLOCK` from its own last id (no consumer group: broadcast).
///
/// - **Delivery:** every entry still in the stream, in order, to every node.
/// - **Retention:** `XADD … MAXLEN ~ n` (default 100 000 entries). A node that
///   falls further behind, or resumes from a position older than that, gets
///   [`LossReason::Trimmed`] with the number of entries missed. A reader that
///   finds the trim while reading on reads on from the stream's newest entry
///   (the node's resync supersedes every entry before it), so a node that
///   fell behind under load starts level rather than at the trim's edge.
/// - **Disconnects:** the subscription fails; the node re-subscribes from its
///   last id with backoff, losing nothing still in the stream.
/// - **History reset** (the stream deleted, or a Redis without persistence
///   restarted): detected from the ordinals and signalled as
///   [`LossReason::HistoryReset`]; so is a history that went another way
///   after a node's position (a promoted replica, or an append-only file
///   not yet synced, lost the last entries, and new ones took their
///   ordinals): a resume checks that the entry its position names is
///   still there.
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
    servers: Arc<Servers>,
    publisher: Commands,
    script: redis::Script,
    config: StreamsConfig,
    /// Publishes pipelined, on one server (`None` on a cluster).
    pipeline: Option<Arc<pipeline::Pipeline>>,
}

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

impl RedisStreamsTransport {
    /// `<prefix>{<topic>}`, with `:`, `{`, `}` (and `%`) in the topic
    /// escaped: the counter and epoch keys append `:n` and `:e`, and
    /// unescaped, topic `x:n` would have been topic `x`'s counter. The
    /// braces make the topic the keys' hash tag: on a Redis Cluster every
    /// key of a topic (these, and the heartbeat and reply streams) is in
    /// one slot, so each script touches one.
    fn keys(&self, topic: &str) -> StreamKeys {
        let stream = self.stream_key(topic);
        StreamKeys {
            counter: format!("{stream}:n"),
            epoch: format!("{stream}:e"),
            stream,
        }
    }
    fn stream_key(&self, topic: &str) -> String {
        format!("{}{{{}}}", self.config.key_prefix, key_part(topic))
    }

    fn block_ms(&self) -> u64 {
        u64::try_from(self.config.block.as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// A blocking reader's own connection, to the server that serves
    /// `key` (see `servers`).
    async fn reader(&self, key: &str) -> Result<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.config.response_timeout))
            .set_response_timeout(Some(
                self.config
                    .block
                    .saturating_add(self.config.response_timeout),
            ));
        self.servers.connection_for(key, &config, STREAMS).await
    }
}

/// The entry at `id`, if the stream holds it: `Some(None)` when it does
/// not.
async fn entry_at(
    conn: &mut MultiplexedConnection,
    keys: &StreamKeys,
    id: &str,
) -> Result<Option<reply::Entry>> {
    let reply: Value = redis::cmd("XRANGE")
        .arg(&keys.stream)
        .arg(id)
        .arg(id)
        .arg("COUNT")
        .arg(1)
        .query_async(conn)
        .await
        .map_err(|e| map_err(STREAMS, e))?;
    Ok(match reply {
        Value::Array(mut v) if !v.is_empty() => parse_entry(v.swap_remove(0)),
        _ => None,
    })
}

/// Whether the stream's history went another way after a position of
/// ordinal `n`, though its epoch and its count say it lives on: the entry
/// the position names (`named`, read before the state) is gone although
/// nothing trimmed it (`n` is past `trimmed`), or holds another ordinal.
///
/// A Redis replica promoted after its master failed (Redis Cluster,
/// Sentinel) lacks the writes the master acknowledged but had not passed
/// on, and so does a server restarted from an append-only file that was
/// not yet synced; the epoch and the ordinal counter are rolled back with
/// the entries. New entries then take the lost ordinals again, and their
/// ids come from the new server's clock: one behind the old server's puts
/// them before the position's id, where `XREAD` from it never looks, and
/// the first entry after it carries exactly the ordinal expected next. Only
/// the entry the position names tells that history from this one.
fn diverged(n: u64, named: Option<&Option<reply::Entry>>, trimmed: u64) -> bool {
    match named {
        // Not read (no stored position with an id), or nothing to compare
        // with (an entry of a cache-sync before ordinals).
        None | Some(Some(reply::Entry { ordinal: None, .. })) => false,
        Some(Some(entry)) => entry.ordinal != Some(n),
        Some(None) => n > trimmed,
    }
}

#[async_trait]
impl Transport for RedisStreamsTransport {
    fn kind(&self) -> &'static str {
        STREAMS
    }

    fn pipelines(&self) -> bool {
        self.pipeline.is_some()
    }

    async fn publish(&self, topic: &str, tag: &str, payload: Bytes) -> Result<Option<Position>> {
        if self.pipeline.is_some() {
            // The same queue as pipelined publishes: one order for both.
            return self.start_publish(topic, tag, payload).await?.await;
        }
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

    /// Pipelined on one server (see the `pipeline` module); on a cluster,
    /// the whole publish, one at a time.
    async fn start_publish(
        &self,
        topic: &str,
        tag: &str,
        payload: Bytes,
    ) -> Result<PendingPublish> {
        let Some(pipeline) = &self.pipeline else {
            let published = self.publish(topic, tag, payload).await?;
            return Ok(PendingPublish::ready(Ok(published)));
        };
        self.check_topic(topic)?;
        self.check_tag(tag)?;
        let keys = Arc::new(self.keys(topic));
        let answer = pipeline
            .hand_over(keys, self.config.max_len, tag, payload)
            .await?;
        Ok(PendingPublish::new(async move {
            let id = pipeline::acknowledged(answer).await?;
            Ok(Some(Position::single(ID, Offset::Id(id))))
        }))
    }

    async fn subscribe(
        &self,
        topic: &str,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>> {
        self.check_topic(topic)?;
        let keys = self.keys(topic);
        let mut conn = self.reader(&keys.stream).await?;
        // The entry a stored position names, read before the state: see
        // `diverged`.
        let named = match &options.from {
            StartFrom::Position(p) => match (p.get(ID), p.get(ORDINAL)) {
                (Some(Offset::Id(id)), Some(Offset::Seq(n))) if *n > 0 => {
                    Some(entry_at(&mut conn, &keys, id).await?)
                }
                _ => None,
            },
            _ => None,
        };
        let state = stream_state(&mut conn, &keys).await?;
        let trimmed = state.trimmed();
        let mut pending = None;
        let (id, ordinal) = match options.from {
            StartFrom::Latest => (state.last_id.clone(), state.entries_added),
            StartFrom::Earliest => ("0-0".to_owned(), trimmed),
            StartFrom::Position(p) => match (p.get(ID), p.get(ORDINAL), p.get(EPOCH)) {
                (Some(Offset::Id(id)), Some(Offset::Seq(n)), Some(Offset::Seq(e)))
                    if *e == state.epoch
                        && *n <= state.entries_added
                        && !diverged(*n, named.as_ref(), trimmed) =>
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
                // epochs), an ordinal past this one's end, or a history that
                // went another way after the position (see `diverged`).
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

    /// The stream's ordinal counter and epoch, read in one step by the
    /// state script on the publishing connection: every entry whose
    /// `XADD` returned is counted in it.
    async fn tail(&self, topic: &str) -> Result<Option<Position>> {
        self.check_topic(topic)?;
        let keys = self.keys(topic);
        let mut conn = self.publisher.clone();
        let state = stream_state(&mut conn, &keys).await?;
        Ok(Some(state.position()))
    }

    /// The ordinal read at or past the tail's, in the same epoch (an
    /// ordinal of another history says nothing of this one), and ids that
    /// agree with it (see `ids_agree`).
    fn covers(&self, position: &Position, tail: &Position) -> bool {
        crate::transport::position::reached_in_history(position, tail, ORDINAL, EPOCH)
            && ids_agree(position, tail)
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

/// Whether the ids of `position` and `tail` could be of one history: in
/// one, a later ordinal has a later id and the same ordinal the same id.
///
/// The epoch alone does not tell histories apart after a split brain: a
/// replica promoted while its master was cut off keeps the stream's epoch
/// (it was replicated) but not the entries the old master took alone. A
/// node that read those is at an ordinal the new master's counter has not
/// reached, so its position would cover the new master's tail, entries it
/// never read included, until its reader reaches the new master and finds
/// the history reset. The new master's entries carry ids from after the
/// split, which a position read on the old master does not pass. Only a
/// further refusal: in one history it agrees with the ordinals, so it
/// refuses no proof there; across a split it catches what the new master
/// added after the entries it lacks (ids are both servers' clocks, and
/// with the new master's far behind it may not: the reader's reset then
/// remains the only catch).
fn ids_agree(position: &Position, tail: &Position) -> bool {
    fn id(p: &Position) -> Option<(u64, u64)> {
        let Some(Offset::Id(id)) = p.get(ID) else {
            return None;
        };
        let (ms, seq) = id.split_once('-')?;
        Some((ms.parse().ok()?, seq.parse().ok()?))
    }
    let (Some(Offset::Seq(at)), Some(Offset::Seq(end))) =
        (position.get(ORDINAL), tail.get(ORDINAL))
    else {
        return false;
    };
    match (id(position), id(tail)) {
        (Some(read), Some(last)) => match at.cmp(end) {
            std::cmp::Ordering::Equal => read == last,
            std::cmp::Ordering::Greater => read > last,
            std::cmp::Ordering::Less => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A position read on an old master past its split, against tails of
    /// the promoted replica; and positions of one history, which it always
    /// covers when the ordinals do.
    #[test]
    fn a_tail_of_a_history_forked_by_a_split_is_not_covered() {
        let p = |ordinal, id: &str| streams_position(id, ordinal, 7);
        let node = p(1000, "5000-3");
        let covers = |tail: &Position| {
            crate::transport::position::reached_in_history(&node, tail, ORDINAL, EPOCH)
                && ids_agree(&node, tail)
        };
        // The new master: fewer entries, but added after the split.
        assert!(!covers(&p(920, "7000-0")));
        assert!(!covers(&p(1000, "7000-0")), "same ordinal, another entry");
        assert!(!covers(&p(1000, "5000-2")), "same ordinal, another entry");
        // One history: behind the position, or at it.
        assert!(covers(&p(920, "4000-9")));
        assert!(covers(&p(1000, "5000-3")));
        assert!(!covers(&p(1001, "5000-4")), "not read yet");
        // Another epoch, or ids that are no stream ids: never.
        assert!(!covers(&streams_position("4000-0", 920, 8)));
        assert!(!covers(&p(920, "x")));
        assert!(!ids_agree(
            &p(1000, "5000-3"),
            &Position::single(ORDINAL, Offset::Seq(920))
        ));
    }

    fn entry(ordinal: Option<u64>) -> reply::Entry {
        reply::Entry {
            id: "5-0".into(),
            ordinal,
            epoch: Some(1),
            tag: None,
            payload: Bytes::new(),
        }
    }

    #[test]
    fn a_position_whose_entry_is_gone_but_not_trimmed_went_another_way() {
        assert!(!diverged(10, None, 0), "nothing read: nothing to tell");
        assert!(!diverged(10, Some(&Some(entry(Some(10)))), 0));
        assert!(diverged(10, Some(&Some(entry(Some(9)))), 0), "renumbered");
        assert!(
            !diverged(10, Some(&Some(entry(None))), 0),
            "before ordinals"
        );
        assert!(diverged(10, Some(&None), 9), "gone, untrimmed");
        assert!(
            !diverged(10, Some(&None), 10),
            "trimmed, nothing after it lost"
        );
        assert!(
            !diverged(10, Some(&None), 12),
            "trimmed past it: a loss of its own"
        );
    }
}
