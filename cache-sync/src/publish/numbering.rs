//! A cache's numbering at a publisher: the last sequence number used,
//! and when its event was sent.

use std::sync::Arc;

use super::Publisher;
use crate::error::Result;
use crate::util::lock;

/// A cache's numbering at this publisher, behind the cache's publish lock.
#[derive(Debug, Default)]
pub(super) struct SeqState {
    /// The last number used; 0 before the first event.
    pub(super) seq: u64,
    /// When the event numbered `seq` was handed to the transport, on this
    /// process's monotonic clock: every later message for the cache says
    /// how long ago that was (`HeaderExt::since_prev_us`), so a node that
    /// never heard of this publisher can tell a lost event from one sent
    /// before it listened, without comparing clocks.
    pub(super) sent_at: Option<tokio::time::Instant>,
}

impl SeqState {
    /// Microseconds since the event numbered `seq` was sent, if one was.
    pub(super) fn since_prev_us(&self) -> Option<u64> {
        self.since_prev_us_at(tokio::time::Instant::now())
    }

    /// Microseconds from the event numbered `seq` being sent to `now`.
    pub(super) fn since_prev_us_at(&self, now: tokio::time::Instant) -> Option<u64> {
        self.sent_at.map(|at| {
            u64::try_from(now.saturating_duration_since(at).as_micros()).unwrap_or(u64::MAX)
        })
    }
}

impl Publisher {
    /// The cache's interned name and numbering.
    pub(super) fn seq(&self, cache: &str) -> Result<(Arc<str>, Arc<tokio::sync::Mutex<SeqState>>)> {
        let mut seqs = lock(&self.inner.seqs);
        if let Some((name, seq)) = seqs.get_key_value(cache) {
            return Ok((name.clone(), seq.clone()));
        }
        // The first publish to this cache: the only time its name is
        // checked (the transport carries it as a tag, and a name's verdict
        // does not change) and copied. A name refused is never kept.
        (*self.inner.transport).check_tag(cache)?;
        let name: Arc<str> = Arc::from(cache);
        let seq = Arc::<tokio::sync::Mutex<SeqState>>::default();
        seqs.insert(name.clone(), seq.clone());
        Ok((name, seq))
    }
}
