//! What a node reports about itself and its caches
//! ([`Node::status`](crate::Node::status)): plain data, served as JSON at
//! `GET /cache-sync/status`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::transport::Position;

/// One node, as `GET /cache-sync/status` reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct NodeStatus {
    /// The node's id.
    pub node_id: String,
    /// The transport's kind (`"embedded"`, …).
    pub transport: String,
    /// The topic the node consumes.
    pub topic: String,
    /// Whether the consumer is running (false after shutdown, or while the
    /// transport is failing and the consumer is re-subscribing).
    pub consuming: bool,
    /// Every event before this position has been applied to every cache
    /// (or answered by a resync). Empty until the first batch.
    pub position: Position,
    /// Records read from the transport.
    pub events_received: u64,
    /// Records for caches this node does not hold.
    pub events_skipped: u64,
    /// Records refused: unauthentic on a verifying node (unsigned, forged or
    /// tampered, or signed with an unknown key; these change nothing), or
    /// unreadable (over the size limit, empty, of an unknown format,
    /// malformed, or with trailing bytes; each answered by resyncing the
    /// cache it names, or every cache if it names none). Each was logged with
    /// its reason. Keys and values that do not decode into a cache's types
    /// count in that cache's `rejected_events` instead.
    pub events_rejected: u64,
    /// Losses answered by a resync: loss signals from the transport, a
    /// re-subscription with no position to resume from, gaps in a
    /// publisher's sequence numbers (also counted in `publisher_gaps`; each
    /// resyncs one cache), and unreadable events that name no cache.
    pub losses: u64,
    /// `losses` by reason: every reason's label (as in `last_loss_reason`)
    /// with its count, zeros included. The counts sum to `losses` (a status
    /// taken while a loss is being counted may show it in one only). Absent
    /// in JSON from nodes older than this field; it reads as empty then.
    #[serde(default)]
    pub losses_by_reason: BTreeMap<String, u64>,
    /// Gaps found in a publisher's sequence numbers: at a later event, or
    /// when the events up to a number the publisher announced did not arrive
    /// within the reorder window.
    pub publisher_gaps: u64,
    /// Events from an outbox relay that had been replaced (its session
    /// died while it published, and another relay took over): a higher
    /// fencing term of the same outbox had been seen for their cache, so
    /// their refreshes were applied as invalidations, never over the newer
    /// rows the new relay sent. Each was logged.
    #[serde(default)]
    pub events_fenced: u64,
    /// Events numbered at or below one already seen from the same
    /// publisher for their cache: a redelivery, or an event that arrived
    /// after later ones (on a transport with several queues, a publisher's
    /// events can change queue when a broker fails). What they carry may be
    /// older than what the cache holds or a resync loaded since, so their
    /// refreshes were applied as invalidations.
    #[serde(default)]
    pub events_late: u64,
    /// Errors from the transport (each followed by a re-subscription).
    pub transport_errors: u64,
    /// The label of the latest loss's reason (`trimmed`, `history_reset`,
    /// `reconnected`, `overflow`, `publisher_gap`, `unreadable`), if any.
    pub last_loss_reason: Option<String>,
    /// Microseconds since the Unix epoch of that loss.
    pub last_loss_at_us: Option<u64>,
    /// Messages sent on the heartbeat channel (heartbeats).
    pub heartbeats_sent: u64,
    /// Messages read off the heartbeat channel (other nodes' heartbeats,
    /// requests for one).
    pub heartbeats_received: u64,
    /// Of those, refused: unsigned or forged on a verifying node,
    /// oversized, or unreadable. They change nothing.
    pub heartbeats_rejected: u64,
    /// Heartbeats this node's cluster view took in but had no room for
    /// (past its node cap or byte budget; see
    /// [`Cluster`](crate::cluster::Cluster)): their nodes may be missing from the
    /// view. Absent in JSON from nodes older than this field.
    #[serde(default)]
    pub heartbeats_dropped: u64,
    /// The most the runtime the node runs on was late running a 10 ms
    /// timer of the node's in the last minute, in microseconds: how long a
    /// task (the node's or the application's) held a worker without
    /// yielding. The whole distribution is in `GET /metrics`
    /// (`cache_sync_runtime_lateness_seconds`). Absent in JSON from nodes
    /// older than this field.
    #[serde(default)]
    pub runtime_lateness_us: u64,
    /// The age of the node's freshness bound, in milliseconds: every
    /// publish on its topic acknowledged more than this long ago has been
    /// applied (measured on this node's monotonic clock, from when it asked
    /// the broker for the topic's tail; see
    /// [`NodeBuilder::freshness_interval`](crate::NodeBuilder::freshness_interval)).
    /// It stays within about two intervals while the node keeps up, and
    /// grows while the node cannot reach its broker or falls behind.
    /// `None` before the first bound, with the bound turned off, or on a
    /// transport that cannot tell its tail. Absent in JSON from nodes older
    /// than this field.
    #[serde(default)]
    pub freshness_age_ms: Option<u64>,
    /// Each registered cache, by name.
    pub caches: Vec<CacheStatus>,
}

/// One cache, as the status endpoint reports it. No keys or values appear.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CacheStatus {
    /// The cache name.
    pub name: String,
    /// The highest entry version in the events this node has taken in for
    /// this cache (refreshes, invalidations and clears, including refreshes
    /// it ignored as stale), raised once each event is done, or `null` if no
    /// versioned event has arrived. With one publisher per table (the dictionary helper) and
    /// an ordered transport, two nodes reporting the same version and the
    /// same `position` have applied the same changes. Versioned loads do not
    /// raise it, since they differ from node to node.
    pub version: Option<u64>,
    /// Entries held, as moka counts them (approximate).
    pub entries: u64,
    /// Per-key version records held (bounded).
    pub tracked_keys: u64,
    /// Reads that found a value.
    pub hits: u64,
    /// Reads that did not.
    pub misses: u64,
    /// Loader runs.
    pub loads: u64,
    /// Loader runs that returned an error.
    pub load_failures: u64,
    /// Load results discarded because the key changed while they ran.
    pub loads_superseded: u64,
    /// Versioned loads ([`get_with_versioned`](crate::SyncedCache::get_with_versioned))
    /// not cached (the caller got the cached value if there was one, else
    /// the loaded one), because their version was
    /// older than one the node knew for the key (a tombstone, a newer
    /// refresh or load, a versioned clear) or, the key's record evicted from
    /// the bounded table, might have been.
    pub loads_stale: u64,
    /// Forced-fresh reads ([`get_fresh`](crate::SyncedCache::get_fresh)),
    /// each of which ran the loader whatever the cache held.
    #[serde(default)]
    pub fresh_reads: u64,
    /// Reads past the cache's staleness bound
    /// ([`max_staleness`](crate::SyncedCacheBuilder::max_staleness)) that
    /// went to the source rather than memory: the node could not prove the
    /// cache fresh enough. Absent in JSON from nodes older than this field.
    #[serde(default)]
    pub stale_bypasses: u64,
    /// How fresh the node proves the cache, in milliseconds: every change
    /// acknowledged longer ago than this is applied (the node's
    /// [`freshness_age_ms`](NodeStatus::freshness_age_ms)), and, for a
    /// cache fed by a CDC relay, every change its database made visible
    /// longer ago than this (the node's age plus the relay's lag). `null`
    /// while unknown: no proof yet, a transport that cannot tell, or a
    /// relay awaited that has not reported. What a staleness bound is
    /// held to. Absent in JSON from nodes older than this field.
    #[serde(default)]
    pub freshness_age_ms: Option<u64>,
    /// Reads past the bound served from memory all the same
    /// ([`max_staleness_serving`](crate::SyncedCacheBuilder::max_staleness_serving)).
    /// Absent in JSON from nodes older than this field.
    #[serde(default)]
    pub stale_served: u64,
    /// Events applied.
    pub events_applied: u64,
    /// Keys removed by events.
    pub invalidations: u64,
    /// Entries updated by events.
    pub refreshes: u64,
    /// Refreshes ignored because the cache already reflects a newer version.
    pub stale_ignored: u64,
    /// Refreshes whose value did not decode, applied as invalidations.
    pub refresh_fallbacks: u64,
    /// Refreshes skipped because a later entry for the same key, in the
    /// same backlog the node read at once, overrides them (a newer version,
    /// or both unversioned): the cache ends as if each had been applied.
    /// Absent in JSON from nodes older than this field; it reads as 0 then.
    #[serde(default)]
    pub coalesced: u64,
    /// Versioned refreshes applied as invalidations because they arrived
    /// within the quarantine after a loss or registration.
    pub refreshes_quarantined: u64,
    /// Clear events applied.
    pub clears: u64,
    /// Times the whole cache was invalidated because a change may have been
    /// missed: a loss, a publisher gap, or an unreadable event or key meant
    /// for it.
    pub loss_resyncs: u64,
    /// Events meant for this cache that could not be applied in full:
    /// unreadable ones (over the size limit, a malformed header or change;
    /// the cache was resynced), ones whose key does not decode into the
    /// cache's type (resynced), and, counted per value, refresh values that
    /// do not decode (that key invalidated; also in `refresh_fallbacks`).
    pub rejected_events: u64,
    /// Event writes that waited for a pinned load of their key (see
    /// [`SyncedCacheBuilder::max_pin_wait`](crate::SyncedCacheBuilder::max_pin_wait)):
    /// parked while the node's consumer went on with other keys, and
    /// applied in order once the load was done or the bound passed. Absent
    /// in JSON from nodes older than this field; it reads as 0 then.
    #[serde(default)]
    pub writes_parked: u64,
    /// Microseconds since the Unix epoch when the last event was applied.
    pub last_applied_at_us: Option<u64>,
    /// Publish-to-applied time of the last event, in microseconds (across
    /// machines this includes clock skew).
    pub last_latency_us: Option<u64>,
    /// Microseconds since the Unix epoch when `version` last rose.
    pub version_at_us: Option<u64>,
    /// Whether versioned refreshes are applied as invalidations for now,
    /// after a loss or a late registration (see
    /// [`NodeBuilder::reorder_window`](crate::NodeBuilder::reorder_window)).
    pub quarantined: bool,
    /// The consistency auditor's findings, if the cache is audited
    /// ([`SyncedCacheBuilder::audit`](crate::SyncedCacheBuilder::audit)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit: Option<AuditStatus>,
}

/// What a cache's consistency auditor found on this node (see
/// [`Audit`](crate::Audit)). Counters since the cache was built; the
/// `window_` fields over the last `window_s` seconds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct AuditStatus {
    /// Entries compared with the source and judged (agreeing, or behind:
    /// each suspect counts once here, not again when read a second time).
    pub checks: u64,
    /// Entries found behind the source: events may still be in flight.
    pub suspects: u64,
    /// Suspects explained within the grace window: the key was written,
    /// the cache cleared, or the source agreed when read again.
    pub suspects_cleared: u64,
    /// Suspects waiting out the grace window now.
    pub suspects_pending: u64,
    /// Suspects still behind, with the very same entry, after the grace
    /// window: changes no event brought. Each is logged (a warning, with
    /// the key and its trace) and repaired.
    pub inconsistencies: u64,
    /// Inconsistent entries removed (the next read loads them). Fewer than
    /// `inconsistencies` only when the key was written between the
    /// judgement and the repair, which then stands.
    pub repairs: u64,
    /// Entries that could not be judged: held with no version while values
    /// are not compared, or left out of the source's answer.
    pub unverified: u64,
    /// Reads of the source.
    pub source_reads: u64,
    /// Reads of the source that failed, timed out, or answered for keys not
    /// asked (or one twice); each backs the auditor off, doubling up to a
    /// minute.
    pub source_failures: u64,
    /// Sweeps begun over the cache's entries.
    pub sweeps: u64,
    /// How long the last inconsistent entry had been seen behind when it
    /// was repaired, in milliseconds: a lower bound on how long it was
    /// stale, from the first read that found it behind, on this node's
    /// clock.
    pub last_stale_age_ms: Option<u64>,
    /// The longest such age.
    pub max_stale_age_ms: Option<u64>,
    /// The window the `window_` counts cover, in seconds.
    pub window_s: u64,
    /// Checks in the window.
    pub window_checks: u64,
    /// Inconsistencies in the window.
    pub window_inconsistencies: u64,
}

impl AuditStatus {
    /// The consistency "nines" over the window: −log10(inconsistencies ÷
    /// checks), 3.0 for one inconsistency in a thousand checks. With no
    /// inconsistency in the window it is the most the checks could show,
    /// log10(checks) (a lower bound); `None` before any check.
    pub fn nines(&self) -> Option<f64> {
        if self.window_checks == 0 {
            return None;
        }
        let bad = self.window_inconsistencies.clamp(1, self.window_checks);
        Some((self.window_checks as f64 / bad as f64).log10())
    }
}

/// What happened to a key, in one record of its trace
/// ([`SyncedCache::trace`](crate::SyncedCache::trace)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TraceEvent {
    /// An event's refresh installed its value.
    Refreshed,
    /// An event removed the entry: an invalidation, or a refresh applied as
    /// one because its version was at or below the floor evicted version
    /// records leave.
    Invalidated,
    /// An event's refresh was no newer than a version the node knew for
    /// the key, and was ignored.
    StaleIgnored,
    /// A versioned refresh during the quarantine after a loss or a late
    /// registration, applied as an invalidation.
    Quarantined,
    /// An event's write waited for a locked load of the key; what it did
    /// follows as a record of its own, with no publisher, unless a clear
    /// dropped it meanwhile (the clear's record then says so).
    Parked,
    /// A load's value was cached.
    Loaded,
    /// A versioned load older than a version the node knew for the key (or
    /// below the evicted floor): returned, not cached.
    LoadStale,
    /// A load that a write to the key overtook: its value was discarded.
    LoadSuperseded,
    /// Inserted locally ([`insert`](crate::SyncedCache::insert)).
    Inserted,
    /// Removed locally ([`invalidate`](crate::SyncedCache::invalidate)).
    Removed,
    /// Every entry dropped: a clear event, or
    /// [`invalidate_all`](crate::SyncedCache::invalidate_all). Shown in
    /// every key's trace.
    Cleared,
    /// Every entry dropped because events may have been lost. Shown in
    /// every key's trace.
    Resynced,
    /// The consistency auditor found the entry older than the source of
    /// truth past its grace window, and removed it; the version is the
    /// source's, if it keeps one.
    Repaired,
}

/// One record of a key's trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct TraceRecord {
    /// When, by this node's clock, in µs since the Unix epoch (read once
    /// per run of events applied together); never to be compared with
    /// another machine's clock. The records' order is the order they were
    /// made, which is the authority: for writes to one key from different
    /// tasks (a load installing while an event lands) it may differ by a
    /// moment from the order the writes landed, since a record is made just
    /// after its write.
    pub at_us: u64,
    /// What happened.
    pub event: TraceEvent,
    /// The version the event item or the load carried, if any.
    pub version: Option<u64>,
    /// For an event: who published it (its `origin`), and its publisher
    /// and sequence numbers.
    pub origin: Option<String>,
    /// See `origin`.
    pub publisher: Option<u64>,
    /// See `origin`.
    pub seq: Option<u64>,
}

/// What one node holds for one key, as a key probe
/// ([`Cluster::probe`](crate::cluster::Cluster::probe)) reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct KeyState {
    /// Whether the cache holds a value for the key.
    pub held: bool,
    /// The newest version the node knows exactly for the key (a refresh, a
    /// versioned load or a versioned invalidation), if any. Not held with
    /// a version: the key was removed at that version or later (a
    /// tombstone), or its entry was evicted since. An unversioned write
    /// since (a local insert, an unversioned refresh) leaves it as it was,
    /// and a key whose record the bounded version table evicted has none:
    /// compare nodes' versions for keys written with versions.
    pub version: Option<u64>,
    /// Whether the cache applies versioned refreshes as invalidations for
    /// now, after a loss or a late registration.
    pub quarantined: bool,
    /// The key's last records on that node, oldest first, if its cache
    /// traces ([`SyncedCacheBuilder::trace_bytes`](crate::SyncedCacheBuilder::trace_bytes)):
    /// at most 16.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trace: Vec<TraceRecord>,
    /// Why the node could not look the key up (it is not of the cache's
    /// key type); the other fields are then empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}
