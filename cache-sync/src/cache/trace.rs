//! A bounded record of what happened to keys, for `SyncedCache::trace`:
//! off unless the builder turns it on (`trace_bytes`), and then capped in
//! bytes, the oldest records going first.
//!
//! One ring per cache, under one lock taken once per record: a record is a
//! few words, the key (cloned) and, for an event, its origin, shared with
//! the records before it from the same origin (publishers are few, and an
//! allocation per event was a tenth of the apply path's cost). A key's
//! trace is found by a scan, which only a caller asking for it pays.

use std::collections::VecDeque;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use crate::status::{TraceEvent, TraceRecord};
use crate::util::{lock, now_us};
use crate::wire::Header;

pub(super) struct Trace<K> {
    max_bytes: usize,
    /// The bytes a key takes beyond its inline size (its encoded length,
    /// which bounds what a `String` or `Vec` key holds on the heap).
    key_bytes: fn(&K) -> usize,
    ring: Mutex<Ring<K>>,
}

struct Ring<K> {
    /// Oldest first.
    records: VecDeque<Kept<K>>,
    bytes: usize,
    /// The last origin seen, as sent and as text.
    origin: Option<(Box<[u8]>, Arc<str>)>,
}

struct Kept<K> {
    /// `None`: a record of the whole cache (a clear, a resync), which
    /// belongs to every key's trace.
    key: Option<K>,
    at_us: u64,
    event: TraceEvent,
    version: Option<u64>,
    /// An event's origin, publisher and sequence numbers.
    from: Option<(Arc<str>, u64, u64)>,
    /// What this record counts against the cap.
    bytes: usize,
}

impl<K> Kept<K> {
    fn to_record(&self) -> TraceRecord {
        TraceRecord {
            at_us: self.at_us,
            event: self.event,
            version: self.version,
            origin: self.from.as_ref().map(|(o, _, _)| o.to_string()),
            publisher: self.from.as_ref().map(|&(_, p, _)| p),
            seq: self.from.as_ref().map(|&(_, _, s)| s),
        }
    }
}

impl<K: PartialEq + Clone> Trace<K> {
    pub(super) fn new(max_bytes: usize, key_bytes: fn(&K) -> usize) -> Self {
        Self {
            max_bytes,
            key_bytes,
            ring: Mutex::new(Ring {
                records: VecDeque::new(),
                bytes: 0,
                origin: None,
            }),
        }
    }

    /// Records `event` for `key` (`None`: the whole cache), from an event
    /// with `header` if there was one, at `at_us` (this node's clock; the
    /// apply path reads it once per run). A record larger than the cap on
    /// its own is not kept.
    pub(super) fn record(
        &self,
        key: Option<K>,
        event: TraceEvent,
        version: Option<u64>,
        header: Option<&Header<'_>>,
        at_us: u64,
    ) {
        let bytes = size_of::<Kept<K>>()
            .saturating_add(key.as_ref().map_or(0, self.key_bytes))
            .saturating_add(header.map_or(0, |h| h.origin.0.len()));
        if bytes > self.max_bytes {
            return;
        }
        let mut ring = lock(&self.ring);
        let from = header.map(|h| {
            let origin = match &ring.origin {
                Some((sent, text)) if **sent == *h.origin.0 => Arc::clone(text),
                _ => {
                    let text: Arc<str> = String::from_utf8_lossy(h.origin.0).into();
                    ring.origin = Some((h.origin.0.into(), Arc::clone(&text)));
                    text
                }
            };
            (origin, h.publisher, h.seq)
        });
        while ring.bytes.saturating_add(bytes) > self.max_bytes {
            let Some(oldest) = ring.records.pop_front() else {
                break;
            };
            ring.bytes = ring.bytes.saturating_sub(oldest.bytes);
        }
        ring.bytes = ring.bytes.saturating_add(bytes);
        ring.records.push_back(Kept {
            key,
            at_us,
            event,
            version,
            from,
            bytes,
        });
    }

    /// `key`'s records and the whole cache's, oldest first.
    pub(super) fn of<Q>(&self, key: &Q) -> Vec<TraceRecord>
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        lock(&self.ring)
            .records
            .iter()
            .filter(|r| r.key.as_ref().is_none_or(|k| k.borrow() == key))
            .map(Kept::to_record)
            .collect()
    }

    /// The cap, for the builder's check.
    pub(super) fn max_bytes(&self) -> usize {
        self.max_bytes
    }

    /// `key`'s last `n` records (the whole cache's among them), oldest
    /// first, each origin cut to at most `origin_bytes`: a walk back from
    /// the newest that stops at `n`.
    pub(super) fn last_of(&self, key: &K, n: usize, origin_bytes: usize) -> Vec<TraceRecord> {
        let ring = lock(&self.ring);
        let mut out: Vec<TraceRecord> = ring
            .records
            .iter()
            .rev()
            .filter(|r| r.key.as_ref().is_none_or(|k| k == key))
            .take(n)
            .map(|r| {
                let mut record = r.to_record();
                if let Some(origin) = &mut record.origin {
                    let mut end = origin.len().min(origin_bytes);
                    while !origin.is_char_boundary(end) {
                        end = end.saturating_sub(1);
                    }
                    origin.truncate(end);
                }
                record
            })
            .collect();
        drop(ring);
        out.reverse();
        out
    }

    /// Bytes held, by the count `record` keeps.
    #[cfg(test)]
    pub(super) fn bytes(&self) -> usize {
        lock(&self.ring).bytes
    }

    /// What one record of `key` from an event of `origin` counts.
    #[cfg(test)]
    pub(super) fn record_bytes(&self, key: &K, origin: &str) -> usize {
        size_of::<Kept<K>>() + (self.key_bytes)(key) + origin.len()
    }
}

impl<K, V> super::Inner<K, V>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    V: Clone + Send + Sync + 'static,
{
    /// Records `event` for `key`, a clone taken only while tracing is on
    /// (`None` otherwise, and then this is one branch).
    pub(super) fn traced(&self, key: Option<K>, event: TraceEvent, version: Option<u64>) {
        if let (Some(trace), Some(key)) = (&self.trace, key) {
            trace.record(Some(key), event, version, None, now_us());
        }
    }
}
