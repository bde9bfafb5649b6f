//! The stream's bookkeeping on the server: the Lua scripts that give each
//! entry its ordinal and the stream its epoch, and where the stream stands
//! as the state script reports it. Apart because readers and the publisher
//! must agree on it, and its decoding is testable without a server.

use std::sync::LazyLock;

use super::StreamKeys;
use crate::error::Result;
use crate::transport::redis::{EPOCH, ID, ORDINAL, STREAMS, map_err};
use crate::transport::{Offset, Position};

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
pub(super) const XADD_SCRIPT: &str = concat!(
    include_str!("../redis_epoch.lua"),
    include_str!("../redis_publish.lua")
);

/// Where the stream stands, read in one atomic step: the ordinal of its last
/// entry (the counter, or `entries-added` without one), its length, its
/// last id, and its epoch. The epoch is made here if the stream has none
/// yet, exactly as the publish script would, so that a reader of a stream
/// nobody has written to yet still has a history to name: had it none, a
/// wipe and a new stream grown past its position would go unnoticed.
const STATE_SCRIPT: &str = concat!(
    include_str!("../redis_epoch.lua"),
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

/// Where the stream stands (see `STATE_SCRIPT`).
#[derive(Debug, Default)]
pub(super) struct StreamState {
    /// Ordinal of the last entry ever added.
    pub(super) entries_added: u64,
    pub(super) length: u64,
    pub(super) last_id: String,
    pub(super) epoch: u64,
}

impl StreamState {
    fn from_reply((entries_added, length, last_id, epoch): StateReply) -> Self {
        // An epoch that is not a number was not written by cache-sync; 0 never
        // matches one that was, so a position from it reads as another history.
        Self {
            entries_added,
            length,
            last_id,
            epoch: epoch.parse().unwrap_or(0),
        }
    }

    /// Ordinal of the entry before the oldest one kept.
    pub(super) fn trimmed(&self) -> u64 {
        self.entries_added.saturating_sub(self.length)
    }

    pub(super) fn position(&self) -> Position {
        streams_position(&self.last_id, self.entries_added, self.epoch)
    }
}

/// Hashed once: `Script::new` computes the SHA-1 that `EVALSHA` sends.
static STATE: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(STATE_SCRIPT));

/// The state script's reply, `{added, length, last id, epoch}`, as decoded.
type StateReply = (u64, u64, String, String);

pub(super) async fn stream_state(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    keys: &StreamKeys,
) -> Result<StreamState> {
    let reply: StateReply = STATE
        .key(&keys.stream)
        .key(&keys.counter)
        .key(&keys.epoch)
        .invoke_async(conn)
        .await
        .map_err(|e| map_err(STREAMS, e))?;
    Ok(StreamState::from_reply(reply))
}

pub(super) fn streams_position(id: &str, ordinal: u64, epoch: u64) -> Position {
    let mut p = Position::single(ID, Offset::Id(id.to_owned()));
    p.set(ORDINAL, Offset::Seq(ordinal));
    p.set(EPOCH, Offset::Seq(epoch));
    p
}

#[cfg(test)]
mod tests {
    use redis::{FromRedisValue, Value};

    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    /// The state script's reply as Redis sends it, decoded the way
    /// `stream_state` decodes it.
    fn decode(reply: Vec<Value>) -> std::result::Result<StreamState, redis::ParsingError> {
        StateReply::from_redis_value(Value::Array(reply)).map(StreamState::from_reply)
    }

    #[test]
    fn the_state_scripts_reply_is_read_in_order() {
        // `{added, length, last, stream_epoch()}`: two Lua numbers (integer
        // replies) and two strings (bulk replies).
        let state = decode(vec![
            Value::Int(12),
            Value::Int(5),
            bulk("1700000000000-3"),
            bulk("1700000000000123"),
        ])
        .unwrap();
        assert_eq!(state.entries_added, 12);
        assert_eq!(state.length, 5);
        assert_eq!(state.last_id, "1700000000000-3");
        assert_eq!(state.epoch, 1_700_000_000_000_123);
        assert_eq!(state.trimmed(), 7);
    }

    #[test]
    fn a_state_reply_of_another_shape_is_refused() {
        let good = || vec![Value::Int(1), Value::Int(1), bulk("1-0"), bulk("7")];
        assert!(decode(good()).is_ok());
        let mut short = good();
        short.pop();
        assert!(decode(short).is_err(), "three fields");
        let mut long = good();
        long.push(bulk("extra"));
        assert!(decode(long).is_err(), "five fields");
        for bad in [bulk("many"), bulk("-1"), Value::Nil, Value::Array(vec![])] {
            let mut reply = good();
            reply[0] = bad.clone();
            assert!(decode(reply).is_err(), "entries added {bad:?}");
            let mut reply = good();
            reply[1] = bad.clone();
            assert!(decode(reply).is_err(), "length {bad:?}");
        }
        assert!(StateReply::from_redis_value(Value::Nil).is_err());
        assert!(StateReply::from_redis_value(bulk("1")).is_err());
    }

    #[test]
    fn an_epoch_cache_sync_did_not_write_is_zero() {
        for epoch in ["", "abc", "-5", "1.5", " 7", "18446744073709551616"] {
            let state = StreamState::from_reply((3, 3, "1-0".to_owned(), epoch.to_owned()));
            assert_eq!(state.epoch, 0, "{epoch:?}");
        }
        let state = StreamState::from_reply((3, 3, "1-0".to_owned(), u64::MAX.to_string()));
        assert_eq!(state.epoch, u64::MAX);
    }

    #[test]
    fn trimmed_is_the_ordinal_before_the_oldest_entry_kept() {
        let state = |entries_added, length| StreamState {
            entries_added,
            length,
            ..StreamState::default()
        };
        assert_eq!(state(10, 4).trimmed(), 6);
        assert_eq!(state(10, 10).trimmed(), 0);
        assert_eq!(state(0, 0).trimmed(), 0);
        // Never below zero, whatever the server says.
        assert_eq!(state(3, 5).trimmed(), 0);
    }

    #[test]
    fn a_position_names_the_id_the_ordinal_and_the_epoch() {
        let p = streams_position("5-1", 9, 77);
        assert_eq!(p.get(ID), Some(&Offset::Id("5-1".to_owned())));
        assert_eq!(p.get(ORDINAL), Some(&Offset::Seq(9)));
        assert_eq!(p.get(EPOCH), Some(&Offset::Seq(77)));
        assert_eq!(p.iter().count(), 3);
        let state = StreamState {
            entries_added: 9,
            length: 2,
            last_id: "5-1".to_owned(),
            epoch: 77,
        };
        assert_eq!(state.position(), p);
    }
}
