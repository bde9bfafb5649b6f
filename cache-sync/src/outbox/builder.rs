//! Configuring an [`Outbox`]: its schema, topic and event size.

use std::sync::Arc;
use std::time::Duration;

use super::{MAX_SCHEMA_BYTES, Outbox, OutboxInner};
use crate::error::{Error, Result};
use crate::transport::names::{self, NameKind};
use crate::util::{MAX_TIMEOUT, check_duration};
use crate::wire::check_max_event_bytes;

/// Configures an [`Outbox`].
#[derive(Debug, Clone)]
pub struct OutboxBuilder {
    pub(super) schema: String,
    pub(super) topic: Option<String>,
    pub(super) max_event_bytes: usize,
    pub(super) again_after: Option<Duration>,
}

impl OutboxBuilder {
    /// The schema holding the outbox's tables. Default `cache_sync`. A
    /// plain, unquoted SQL identifier: 1 to 63 bytes of lowercase ASCII
    /// letters, digits and `_`, not starting with a digit or `pg_`;
    /// [`build`](Self::build) refuses anything else.
    pub fn schema(mut self, name: impl Into<String>) -> Self {
        self.schema = name.into();
        self
    }

    /// The topic its rows are for: the topic of the publisher its relay
    /// publishes through. Unset by default, and then rows go to whatever
    /// topic the relay's publisher has. Once set, a relay refuses to start
    /// with a publisher on another topic, and a
    /// [`dictionary`](Outbox::dictionary) of a [`Table`](crate::Table) pinned to another
    /// topic refuses every write, as a
    /// [`DictionaryPublisher`](crate::DictionaryPublisher) does. A table
    /// pinned to a topic needs it set: without it, the outbox could not tell
    /// at write time where its rows will go, and refuses them too. Either
    /// way, a pinned table's row never goes out on another topic.
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// The largest row (one encoded change) an enqueue writes; larger
    /// calls are split over several rows, and a single key or entry that
    /// does not fit is [`Error::TooLarge`]. The relay reads no row larger
    /// than this either. The relay's publisher splits rows again under its
    /// own limit. Default 1 MiB; 1 byte to 64 MiB.
    pub fn max_event_bytes(mut self, n: usize) -> Self {
        self.max_event_bytes = n;
        self
    }

    /// Every change is enqueued twice: as it is, and, due `delay` later by
    /// the database's clock, as an invalidation of the keys it changed at
    /// the same versions (a clear as the same clear), as
    /// [`PublisherBuilder::again_after`](crate::PublisherBuilder::again_after)
    /// sends it: for nodes whose reads go to a lagging replica, which may
    /// reload the old row after the first event. The second copy is a row
    /// of its own, written in the same transaction, so it is gone with a
    /// rollback and survives a relay crash. The relay publishes it when due
    /// without holding up later rows: an invalidation removes, and removal
    /// is never stale, so publishing it after later events of its cache
    /// costs at most a reload. Off by default; 1 ms to 1 h, and
    /// [`build`](Self::build) refuses anything else.
    pub fn again_after(mut self, delay: Duration) -> Self {
        self.again_after = Some(delay);
        self
    }

    /// The outbox, or [`Error::Config`] naming the setting out of range.
    pub fn build(self) -> Result<Outbox> {
        check_schema(&self.schema)?;
        if let Some(topic) = &self.topic {
            names::check(NameKind::Topic, topic)?;
        }
        check_max_event_bytes(self.max_event_bytes)?;
        if let Some(delay) = self.again_after {
            check_duration("again_after", delay, Duration::from_millis(1), MAX_TIMEOUT)?;
        }
        Ok(Outbox {
            inner: Arc::new(OutboxInner {
                schema: self.schema,
                topic: self.topic,
                max_event_bytes: self.max_event_bytes,
                again_after: self.again_after,
            }),
        })
    }
}

/// The schema rule: a name that needs no quoting anywhere it is spliced
/// into SQL, so no quoting mistake can turn it into SQL of its own.
fn check_schema(name: &str) -> Result<()> {
    let refuse = |rule: &str| {
        let shown: String = name.chars().take(64).collect();
        Err(Error::Config(format!(
            "invalid outbox schema name {shown:?}: {rule}"
        )))
    };
    if name.is_empty() || name.len() > MAX_SCHEMA_BYTES {
        return refuse("a schema name is 1 to 63 bytes");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return refuse("a schema name holds only a-z, 0-9 and _");
    }
    if name.as_bytes()[0].is_ascii_digit() || name.starts_with("pg_") {
        return refuse("a schema name starts with neither a digit nor pg_");
    }
    Ok(())
}
