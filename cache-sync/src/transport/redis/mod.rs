//! Redis transports: Streams (durable, replayable; recommended) and Pub/Sub
//! (lowest latency, lossy).

use std::time::Duration;

use redis::RedisError;
use redis::aio::ConnectionManagerConfig;

use crate::error::{Error, Result};
use crate::transport::names;
use crate::util::{MAX_TIMEOUT, check_duration};

/// A topic as part of a Redis key or channel: `:`, `{`, `}` and `%`
/// escaped (braces, so that a topic never ends or opens a key's hash tag).
fn key_part(topic: &str) -> std::borrow::Cow<'_, str> {
    names::escape(topic, |c| !matches!(c, ':' | '{' | '}'))
}

mod pubsub;
mod servers;
mod streams;

pub use pubsub::{RedisPubSubBuilder, RedisPubSubTransport};
pub use streams::{RedisStreamsBuilder, RedisStreamsTransport};

const STREAMS: &str = "redis-streams";
const PUBSUB: &str = "redis-pubsub";

/// Partition names in a Streams [`Position`](crate::transport::Position): the last entry id read, its
/// ordinal (how many entries the stream had ever received up to it), and
/// the stream's epoch, which names the history both belong to: a stream
/// deleted and made again, or a Redis that lost its data, starts a new
/// epoch, even once its ids and ordinals have grown past the old ones.
const ID: &str = "id";
const ORDINAL: &str = "n";
const EPOCH: &str = "e";

fn map_err(transport: &'static str, e: RedisError) -> Error {
    if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() || e.is_connection_refusal() {
        Error::disconnected(transport, e)
    } else {
        Error::Transport {
            transport,
            source: Box::new(e),
        }
    }
}

fn bad_reply(transport: &'static str, what: &str) -> Error {
    Error::Transport {
        transport,
        source: format!("unexpected reply: {what}").into(),
    }
}

/// The shortest timeout or interval a Redis transport takes: a zero would
/// spin, or fail every call.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// Refuses a timeout or interval outside [`MIN_TIMEOUT`]`..=`[`MAX_TIMEOUT`].
fn check_timeout(setting: &str, value: Duration) -> Result<()> {
    check_duration(setting, value, MIN_TIMEOUT, MAX_TIMEOUT)
}

/// The smallest Pub/Sub backlog limit: a smaller one would drop ordinary
/// events one by one, each as a loss.
const MIN_BACKLOG_BYTES: usize = 64 << 10;

/// How a publisher's connection manager connects and retries.
fn manager_config(response_timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(response_timeout))
        .set_response_timeout(Some(response_timeout))
        .set_number_of_retries(3)
}

#[cfg(test)]
mod tests {
    use std::fmt;

    use super::*;

    /// Nothing listens there: an attempt to connect fails with a disconnect.
    const NOWHERE: &str = "redis://127.0.0.1:1/";

    const BELOW: Duration = Duration::from_nanos(999_999);
    const ABOVE: Duration = Duration::from_nanos(3_600_000_000_001);

    /// `connect` fails with a config error naming the setting, not with the
    /// disconnect a connection attempt to [`NOWHERE`] would give.
    fn assert_refused(result: Result<impl fmt::Debug>, setting: &str) {
        let e = result.expect_err(setting);
        assert!(e.is_config(), "{setting}: {e:?}");
        assert!(e.to_string().contains(setting), "{e}");
    }

    /// Just outside every timeout's range, and the far edges.
    const BAD_TIMEOUTS: [Duration; 4] = [Duration::ZERO, BELOW, ABOVE, Duration::MAX];

    #[tokio::test]
    async fn streams_connect_refuses_out_of_range_settings_before_any_io() {
        let builder = || RedisStreamsTransport::builder(NOWHERE);
        assert_refused(builder().max_len(0).connect().await, "max_len");
        type Set = fn(RedisStreamsBuilder, Duration) -> RedisStreamsBuilder;
        let timeouts: [(&str, Set); 2] = [
            ("block", RedisStreamsBuilder::block),
            ("response_timeout", RedisStreamsBuilder::response_timeout),
        ];
        for (setting, set) in timeouts {
            for d in BAD_TIMEOUTS {
                assert_refused(set(builder(), d).connect().await, setting);
            }
        }
        // The same URL with valid settings does try to connect.
        let e = builder().connect().await.unwrap_err();
        assert!(e.is_disconnected(), "{e:?}");
    }

    #[tokio::test]
    async fn pubsub_connect_refuses_out_of_range_settings_before_any_io() {
        let builder = || RedisPubSubTransport::builder(NOWHERE);
        for bytes in [0, MIN_BACKLOG_BYTES - 1] {
            let refused = builder().max_backlog_bytes(bytes).connect().await;
            assert_refused(refused, "max_backlog_bytes");
        }
        type Set = fn(RedisPubSubBuilder, Duration) -> RedisPubSubBuilder;
        let timeouts: [(&str, Set); 3] = [
            ("ping_interval", RedisPubSubBuilder::ping_interval),
            ("ping_timeout", RedisPubSubBuilder::ping_timeout),
            ("response_timeout", RedisPubSubBuilder::response_timeout),
        ];
        for (setting, set) in timeouts {
            for d in BAD_TIMEOUTS {
                assert_refused(set(builder(), d).connect().await, setting);
            }
        }
        for prefix in ["a{", "}b", "{x}"] {
            let refused = builder().channel_prefix(prefix).connect().await;
            assert_refused(refused, "channel_prefix");
        }
        let e = builder().connect().await.unwrap_err();
        assert!(e.is_disconnected(), "{e:?}");
    }

    #[test]
    fn the_ends_of_each_range_are_accepted() {
        for (len, timeout) in [(1, MIN_TIMEOUT), (usize::MAX, MAX_TIMEOUT)] {
            RedisStreamsTransport::builder(NOWHERE)
                .max_len(len)
                .block(timeout)
                .response_timeout(timeout)
                .check()
                .unwrap();
        }
        for (bytes, timeout) in [(MIN_BACKLOG_BYTES, MIN_TIMEOUT), (usize::MAX, MAX_TIMEOUT)] {
            RedisPubSubTransport::builder(NOWHERE)
                .max_backlog_bytes(bytes)
                .ping_interval(timeout)
                .ping_timeout(timeout)
                .response_timeout(timeout)
                .check()
                .unwrap();
        }
    }
}
