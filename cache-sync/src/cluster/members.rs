//! What a view keeps of the nodes, and the indexes it answers from.
//!
//! Per live node, a summary of its last heartbeat ([`Member`]): what the
//! view, the page, the metrics, [`Cluster::nodes`](super::Cluster::nodes)
//! and acknowledged publishes read, its caches deduplicated by name (the
//! first of a name wins), each name interned: one `Arc<str>` per distinct
//! name, shared by every member that holds the cache and by its index.
//! Beside the members:
//! - per cache name, an index ([`CacheIndex`]): the nodes that hold it, how
//!   many hold each version (so the newest and the lowest are at hand
//!   without a pass over the members), and its staircase (how long each
//!   version has been known, see [`Staircase`]);
//! - an expiry queue, members by deadline, so that expiring costs
//!   `O(log n)` for each member that goes and nothing for those that stay;
//! - the nodes gone lately, with a queue of their own.
//!
//! Taking a heartbeat in costs `O(c log n)` (c its caches, n the members):
//! nothing here loops over the members but to build a view or list them.
//!
//! Everything is accounted in bytes: an estimate of the heap it takes,
//! compared with a measurement in `benches/cluster_view.rs`. A heartbeat
//! that would not fit (a member over [`MAX_MEMBER_BYTES`], or the whole
//! over [`MAX_TOTAL_BYTES`] once the nodes gone lately were given up for
//! room, or a new node past [`MAX_MEMBERS`]) is dropped, and the drop is
//! remembered so that the view can tell it may be missing a node.

use std::collections::BTreeMap;
use std::mem::size_of;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::heartbeat::MISSED_INTERVALS;
use super::view::Staircase;
use super::{CacheHeartbeat, Heartbeat};
use crate::transport::{Offset, Position};
use crate::util::{HashMap, HashSet, MAX_TIMEOUT};

/// How long a gone node is still listed as gone (not as live).
pub(super) const GONE_KEPT: Duration = Duration::from_secs(300);
/// Bounds the members a view keeps, against a flood of made-up node ids
/// on a topic whose heartbeats are not signed (and the nodes gone lately
/// listed, likewise).
pub(super) const MAX_MEMBERS: usize = 10_000;
/// Bounds what one member's summary may take, in bytes as the view
/// accounts them (its cache names counted in full): room for a node of
/// about 1,300 caches. A heartbeat
/// may be 1 MiB of JSON; kept whole, it would take about 2 MB.
pub(super) const MAX_MEMBER_BYTES: usize = 256 << 10;
/// Bounds what the whole view takes, in bytes as accounted: members,
/// cache names with their indexes, nodes gone lately (given up first).
/// Room for the 10,000 members of the cap at 13 KiB each: a node of one
/// cache is accounted about 0.7 KiB, of 10 caches 2.2 KiB, of 100 caches
/// 18 KiB (`benches/cluster_view.rs` measured 0.6, 1.8 and 14 KiB).
pub(super) const MAX_TOTAL_BYTES: usize = 128 << 20;
/// The longest a heartbeat's `version_age_ms` is believed: it comes off
/// the wire. Besides, never longer than the sender's own uptime.
const MAX_VERSION_AGE: Duration = Duration::from_secs(24 * 3600);

/// One live node, as its last heartbeat described it.
#[derive(Debug)]
pub(super) struct Member {
    pub(super) id: Arc<str>,
    pub(super) started_at_us: u64,
    pub(super) sent_at_us: u64,
    pub(super) interval_ms: u64,
    pub(super) transport: Box<str>,
    pub(super) consuming: bool,
    pub(super) ready: bool,
    /// Its position's partitions, in order: a `Position` (a B-tree) with
    /// one partition takes a whole node, about 600 bytes.
    position: Box<[(Box<str>, Offset)]>,
    pub(super) losses: u64,
    /// By name, each name once.
    pub(super) caches: Box<[StoredCache]>,
    /// When its heartbeat arrived, on this party's monotonic clock.
    pub(super) seen: Instant,
    /// The same, in microseconds since the Unix epoch on this party's
    /// clock: for display only.
    pub(super) seen_at_us: u64,
    /// Its key in the expiry queue.
    expires: (Instant, u64),
    /// What it is accounted, its cache names' text aside (see
    /// [`Members::bytes`]).
    bytes: usize,
}

/// One cache of a [`Member`].
#[derive(Debug)]
pub(super) struct StoredCache {
    pub(super) name: Arc<str>,
    pub(super) version: Option<u64>,
    pub(super) version_at_us: Option<u64>,
    pub(super) entries: u64,
    pub(super) loss_resyncs: u64,
    pub(super) last_latency_us: Option<u64>,
    pub(super) quarantined: bool,
}

/// One cache name across the members that hold it.
#[derive(Debug, Default)]
pub(super) struct CacheIndex {
    holders: HashSet<Arc<str>>,
    /// How many holders are at each version (holders without one are not
    /// counted here; `unversioned` counts them).
    versions: BTreeMap<u64, u32>,
    unversioned: u32,
    pub(super) staircase: Staircase,
}

impl CacheIndex {
    /// The newest version a holder reports.
    pub(super) fn newest(&self) -> Option<u64> {
        self.versions.last_key_value().map(|(v, _)| *v)
    }

    /// The lowest version a holder is at, a holder without one counting as
    /// at 0 (as its lag does).
    fn lowest(&self) -> u64 {
        if self.unversioned > 0 {
            return 0;
        }
        self.versions.first_key_value().map_or(0, |(v, _)| *v)
    }

    /// Its holders, by node id (in no order).
    pub(super) fn holders(&self) -> impl Iterator<Item = &Arc<str>> {
        self.holders.iter()
    }

    fn add(&mut self, id: &Arc<str>, version: Option<u64>) {
        self.holders.insert(id.clone());
        match version {
            Some(v) => {
                let n = self.versions.entry(v).or_insert(0);
                *n = n.saturating_add(1);
            }
            None => self.unversioned = self.unversioned.saturating_add(1),
        }
    }

    fn remove(&mut self, id: &str, version: Option<u64>) {
        self.holders.remove(id);
        match version {
            Some(v) => {
                if let Some(n) = self.versions.get_mut(&v) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        self.versions.remove(&v);
                    }
                }
            }
            None => self.unversioned = self.unversioned.saturating_sub(1),
        }
    }

    /// Keeps the staircase to what the holders can ask of it: nothing
    /// below the lowest version held, nothing above the newest (a version
    /// no live node holds any more, such as a forged one, must not stand
    /// for the ones below it).
    fn tidy(&mut self, now: Instant) {
        let Some(newest) = self.newest() else {
            self.staircase.clear();
            return;
        };
        self.staircase.keep_between(self.lowest(), newest, now);
    }
}

/// A node gone lately.
#[derive(Debug)]
struct Gone {
    last_seen_at_us: u64,
    key: (Instant, u64),
    bytes: usize,
}

/// Why a heartbeat was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    /// Larger than one member may take.
    Member,
    /// More bytes than the view has room for.
    Bytes,
    /// A new node, and the view holds `MAX_MEMBERS` already.
    Count,
}

impl Full {
    pub(super) fn reason(self) -> &'static str {
        match self {
            Full::Member => "heartbeat over the per-node byte bound",
            Full::Bytes => "view over its byte budget",
            Full::Count => "view at its member cap",
        }
    }
}

/// What became of a heartbeat.
#[derive(Debug)]
pub(super) enum Intake {
    Stored,
    /// Older than the one kept for its node (a redelivery, a reordering).
    Stale,
    /// No room: the node's id is handed back for the log.
    Dropped(Full, String),
}

/// The drops for lack of room, for [`Members::overflowing`] and the log.
#[derive(Debug, Default)]
struct Drops {
    /// Until when the view counts as overflowing: three intervals of the
    /// sender of the last heartbeat dropped, the longest such.
    until: Option<Instant>,
    last_warned: Option<Instant>,
    since_warned: u64,
}

/// Every member, the indexes, the nodes gone lately, and their bytes.
#[derive(Debug, Default)]
pub(super) struct Members {
    nodes: HashMap<Arc<str>, Member>,
    /// Members by deadline (and a tie-breaker): the first is the next to go.
    expiry: BTreeMap<(Instant, u64), Arc<str>>,
    /// Per cache name; its keys are the interned names.
    caches: HashMap<Arc<str>, CacheIndex>,
    gone: HashMap<Arc<str>, Gone>,
    /// Gone nodes by last heartbeat: the first is the next to be forgotten.
    gone_order: BTreeMap<(Instant, u64), Arc<str>>,
    /// Everything accounted: members, names with their indexes, gone nodes.
    bytes: usize,
    /// Of which, gone nodes (given up first when room is needed).
    gone_bytes: usize,
    tie: u64,
    drops: Drops,
}

/// The heap of an `Arc<str>` beyond its text: two counts.
const ARC_HEADER: usize = 2 * size_of::<usize>();
/// A member beyond its strings, caches and position: the map's slot (a
/// hash table runs up to half empty after growing), the expiry queue's
/// entry, the id's `Arc` header.
const MEMBER_FIXED: usize =
    2 * size_of::<(Arc<str>, Member)>() + 2 * size_of::<((Instant, u64), Arc<str>)>() + ARC_HEADER;
/// A cache of a member beyond its name's text: the
/// stored cache, its slot in the name's holder set (up to half empty),
/// and its count in the name's versions (one B-tree entry at worst).
const CACHE_FIXED: usize =
    size_of::<StoredCache>() + 2 * (size_of::<Arc<str>>() + 1) + 2 * size_of::<(u64, u32)>();
/// A partition of a position beyond its text.
const PARTITION_FIXED: usize = size_of::<(Box<str>, Offset)>();
/// A distinct cache name beyond its text: its index's slot in the map and
/// a full staircase.
const NAME_FIXED: usize = 2 * size_of::<(Arc<str>, CacheIndex)>() + ARC_HEADER + Staircase::BYTES;
/// A gone node beyond its id's text.
const GONE_FIXED: usize =
    2 * size_of::<(Arc<str>, Gone)>() + 2 * size_of::<((Instant, u64), Arc<str>)>() + ARC_HEADER;

/// What a distinct cache name is accounted.
fn name_bytes(name: &str) -> usize {
    NAME_FIXED.saturating_add(name.len())
}

/// What a heartbeat's summary would be accounted: the member (names aside)
/// and its cache names' text, each as if no other member held it.
fn summary_bytes(h: &Heartbeat) -> (usize, usize) {
    let mut own = MEMBER_FIXED
        .saturating_add(h.node_id.len())
        .saturating_add(h.transport.len());
    for (partition, offset) in h.position.iter() {
        let id = match offset {
            Offset::Id(id) => id.len(),
            _ => 0,
        };
        own = own
            .saturating_add(PARTITION_FIXED)
            .saturating_add(partition.len())
            .saturating_add(id);
    }
    let mut names = 0usize;
    for c in &h.caches {
        own = own.saturating_add(CACHE_FIXED);
        names = names
            .saturating_add(ARC_HEADER)
            .saturating_add(c.name.len());
    }
    (own, names)
}

/// How long a node is live after its last heartbeat: three of its own
/// intervals, the interval clamped to what a node can be given (a forged
/// `u64::MAX` must not make an entry immortal).
pub(super) fn lifetime(interval_ms: u64) -> Duration {
    Duration::from_millis(interval_ms.max(1))
        .min(MAX_TIMEOUT)
        .saturating_mul(MISSED_INTERVALS)
}

/// Keeps the first cache of each name, in name order.
pub(super) fn dedup(caches: &mut Vec<CacheHeartbeat>) {
    // Stable: of equal names, the first stays first, and `dedup_by` keeps it.
    caches.sort_by(|a, b| a.name.cmp(&b.name));
    caches.dedup_by(|later, first| later.name == first.name);
}

/// Since when, on this party's clock, a heartbeat received at `at` says
/// its cache has held `version`: `at`, less the age the node gave for it,
/// a duration on its own clock (so no skew enters), clamped to the node's
/// own uptime as its stamps give it and to `MAX_VERSION_AGE`.
pub(super) fn known_since(h: &Heartbeat, age_ms: Option<u64>, at: Instant) -> Instant {
    let Some(age_ms) = age_ms else {
        return at;
    };
    let uptime = Duration::from_micros(h.sent_at_us.saturating_sub(h.started_at_us));
    let age = Duration::from_millis(age_ms)
        .min(uptime)
        .min(MAX_VERSION_AGE);
    at.checked_sub(age).unwrap_or(at)
}

impl StoredCache {
    fn new(c: CacheHeartbeat, name: Arc<str>) -> Self {
        StoredCache {
            name,
            version: c.version,
            version_at_us: c.version_at_us,
            entries: c.entries,
            loss_resyncs: c.loss_resyncs,
            last_latency_us: c.last_latency_us,
            quarantined: c.quarantined,
        }
    }
}

impl Member {
    fn new(
        h: Heartbeat,
        id: Arc<str>,
        caches: Box<[StoredCache]>,
        seen: (Instant, u64),
        expires: (Instant, u64),
        bytes: usize,
    ) -> Self {
        Member {
            id,
            started_at_us: h.started_at_us,
            sent_at_us: h.sent_at_us,
            interval_ms: h.interval_ms,
            transport: h.transport.into_boxed_str(),
            consuming: h.consuming,
            ready: h.ready,
            position: h
                .position
                .iter()
                .map(|(partition, offset)| (Box::from(partition), offset.clone()))
                .collect(),
            losses: h.losses,
            caches,
            seen: seen.0,
            seen_at_us: seen.1,
            expires,
            bytes,
        }
    }

    /// A member of no view: the owning node's own heartbeat, as of now.
    pub(super) fn detached(mut h: Heartbeat, now: Instant, now_us: u64) -> Self {
        dedup(&mut h.caches);
        let caches = std::mem::take(&mut h.caches)
            .into_iter()
            .map(|c| {
                let name = Arc::from(c.name.as_str());
                StoredCache::new(c, name)
            })
            .collect();
        let id = Arc::from(std::mem::take(&mut h.node_id).into_boxed_str());
        Member::new(h, id, caches, (now, now_us), (now, 0), 0)
    }

    /// Its position.
    pub(super) fn position(&self) -> Position {
        let mut p = Position::default();
        for (partition, offset) in &self.position {
            p.set(partition.as_ref(), offset.clone());
        }
        p
    }

    /// The heartbeat it stands for, as kept: caches deduplicated, and no
    /// `version_age_ms` (an age as of its arrival, not of now).
    pub(super) fn to_heartbeat(&self, topic: &str) -> Heartbeat {
        Heartbeat {
            node_id: self.id.to_string(),
            topic: topic.to_owned(),
            started_at_us: self.started_at_us,
            sent_at_us: self.sent_at_us,
            interval_ms: self.interval_ms,
            transport: self.transport.to_string(),
            consuming: self.consuming,
            ready: self.ready,
            position: self.position(),
            losses: self.losses,
            caches: self
                .caches
                .iter()
                .map(|c| CacheHeartbeat {
                    name: c.name.to_string(),
                    version: c.version,
                    version_at_us: c.version_at_us,
                    version_age_ms: None,
                    entries: c.entries,
                    loss_resyncs: c.loss_resyncs,
                    quarantined: c.quarantined,
                    last_latency_us: c.last_latency_us,
                })
                .collect(),
        }
    }
}

impl Members {
    /// Live members (those expired are gone once [`expire`](Self::expire)
    /// ran), in no order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Member> {
        self.nodes.values()
    }

    pub(super) fn len(&self) -> usize {
        self.nodes.len()
    }

    /// A cache name's index, while a member holds it.
    pub(super) fn index(&self, name: &str) -> Option<&CacheIndex> {
        self.caches.get(name)
    }

    /// The nodes gone lately: id, and when their last heartbeat arrived
    /// (µs since the epoch, this party's clock).
    pub(super) fn gone(&self) -> impl Iterator<Item = (&str, u64)> {
        self.gone
            .iter()
            .map(|(id, g)| (id.as_ref(), g.last_seen_at_us))
    }

    /// Everything accounted, in bytes.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Moves the members whose last heartbeat is three of their intervals
    /// old to the nodes gone, and forgets those gone for `GONE_KEPT`;
    /// returns the ids of those that went. `O(log n)` per member that
    /// goes, `O(1)` when none does.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<Arc<str>> {
        let mut went = Vec::new();
        // Live while `now <= deadline`, as a member's `seen` plus its lifetime.
        while let Some(entry) = self.expiry.first_entry() {
            if entry.key().0 >= now {
                break;
            }
            let id = entry.remove();
            let Some(m) = self.nodes.remove(&id) else {
                continue;
            };
            self.bytes = self.bytes.saturating_sub(m.bytes);
            for c in &m.caches {
                if let Some(idx) = self.caches.get_mut(&c.name) {
                    idx.remove(&m.id, c.version);
                }
            }
            self.tidy(m.caches.iter().map(|c| &c.name), now);
            self.add_gone(m.id.clone(), m.seen, m.seen_at_us);
            went.push(m.id);
        }
        while let Some(entry) = self.gone_order.first_entry() {
            if now.saturating_duration_since(entry.key().0) <= GONE_KEPT {
                break;
            }
            let id = entry.remove();
            self.forget_gone(&id);
        }
        went
    }

    fn add_gone(&mut self, id: Arc<str>, seen: Instant, seen_at_us: u64) {
        if self.gone.len() >= MAX_MEMBERS {
            self.forget_oldest_gone();
        }
        let key = (seen, self.next_tie());
        let bytes = GONE_FIXED.saturating_add(id.len());
        self.gone_order.insert(key, id.clone());
        if let Some(old) = self.gone.insert(
            id,
            Gone {
                last_seen_at_us: seen_at_us,
                key,
                bytes,
            },
        ) {
            // Not expected (a member is never also gone), but kept exact.
            self.gone_order.remove(&old.key);
            self.unaccount_gone(old.bytes);
        }
        self.bytes = self.bytes.saturating_add(bytes);
        self.gone_bytes = self.gone_bytes.saturating_add(bytes);
    }

    /// Forgets a gone node; its id's `Arc` back, if it was one.
    fn forget_gone(&mut self, id: &str) -> Option<Arc<str>> {
        let (id, g) = self.gone.remove_entry(id)?;
        self.gone_order.remove(&g.key);
        self.unaccount_gone(g.bytes);
        Some(id)
    }

    /// Forgets the gone node heard from longest ago; false if none is left.
    fn forget_oldest_gone(&mut self) -> bool {
        let Some((_, id)) = self.gone_order.pop_first() else {
            return false;
        };
        if let Some(g) = self.gone.remove(&id) {
            self.unaccount_gone(g.bytes);
        }
        true
    }

    fn unaccount_gone(&mut self, bytes: usize) {
        self.bytes = self.bytes.saturating_sub(bytes);
        self.gone_bytes = self.gone_bytes.saturating_sub(bytes);
    }

    fn next_tie(&mut self) -> u64 {
        self.tie = self.tie.wrapping_add(1);
        self.tie
    }

    /// After the holders of these names changed: drops the indexes no
    /// member holds any more, and keeps the others' staircases to what
    /// their holders can ask.
    fn tidy<'a>(&mut self, names: impl Iterator<Item = &'a Arc<str>>, now: Instant) {
        for name in names {
            let Some(idx) = self.caches.get_mut(name) else {
                continue;
            };
            if idx.holders.is_empty() {
                self.caches.remove(name);
                self.bytes = self.bytes.saturating_sub(name_bytes(name));
            } else {
                idx.tidy(now);
            }
        }
    }

    /// Takes a heartbeat in, if it is the newest of its node and there is
    /// room for it. `O(c log n)`, c its caches; expire first. The owning
    /// node's (`owner`, its echo) is never refused for the member cap.
    pub(super) fn observe(
        &mut self,
        mut h: Heartbeat,
        now: Instant,
        now_us: u64,
        owner: Option<&str>,
    ) -> Intake {
        let old = self.nodes.get(h.node_id.as_str());
        // The newest per node wins, by its own stamps (one clock against
        // itself). An entry expired here is gone already, so a heartbeat
        // stamped far in the future cannot shadow its node for long.
        if let Some(m) = old
            && (m.started_at_us, m.sent_at_us) > (h.started_at_us, h.sent_at_us)
        {
            return Intake::Stale;
        }
        let freed = old.map_or(0, |m| m.bytes);
        let is_new = old.is_none();
        dedup(&mut h.caches);
        let (own, names) = summary_bytes(&h);
        if own.saturating_add(names) > MAX_MEMBER_BYTES {
            return Intake::Dropped(Full::Member, h.node_id);
        }
        if is_new && self.others(owner) >= MAX_MEMBERS && owner != Some(h.node_id.as_str()) {
            return Intake::Dropped(Full::Count, h.node_id);
        }
        let new_names = h
            .caches
            .iter()
            .filter(|c| !self.caches.contains_key(c.name.as_str()))
            .fold(0usize, |n, c| n.saturating_add(name_bytes(&c.name)));
        let need = own.saturating_add(new_names);
        let fits =
            |bytes: usize| bytes.saturating_sub(freed).saturating_add(need) <= MAX_TOTAL_BYTES;
        // Gone nodes are given up for room, oldest first; live ones never.
        if !fits(self.bytes.saturating_sub(self.gone_bytes)) {
            return Intake::Dropped(Full::Bytes, h.node_id);
        }
        while !fits(self.bytes) && self.forget_oldest_gone() {}

        // The member it replaces leaves the indexes; the names it held are
        // tidied only once the new one is in (the same node at the same
        // version, the common case, must not look like the newest leaving).
        let (id, old_names) = match self.nodes.remove_entry(h.node_id.as_str()) {
            Some((id, m)) => {
                self.expiry.remove(&m.expires);
                self.bytes = self.bytes.saturating_sub(m.bytes);
                for c in &m.caches {
                    if let Some(idx) = self.caches.get_mut(&c.name) {
                        idx.remove(&id, c.version);
                    }
                }
                let names: Vec<Arc<str>> = m.caches.iter().map(|c| c.name.clone()).collect();
                (id, names)
            }
            None => {
                let id = self
                    .forget_gone(&h.node_id)
                    .unwrap_or_else(|| Arc::from(h.node_id.as_str()));
                (id, Vec::new())
            }
        };
        let caches: Box<[StoredCache]> = std::mem::take(&mut h.caches)
            .into_iter()
            .map(|c| {
                let name = self.intern(&c.name);
                if let Some(idx) = self.caches.get_mut(&name) {
                    idx.add(&id, c.version);
                    if let Some(v) = c.version {
                        let since = known_since(&h, c.version_age_ms, now);
                        idx.staircase.learn(v, since, now);
                    }
                }
                StoredCache::new(c, name)
            })
            .collect();
        self.tidy(old_names.iter().chain(caches.iter().map(|c| &c.name)), now);
        let deadline = now.checked_add(lifetime(h.interval_ms)).unwrap_or(now);
        let expires = (deadline, self.next_tie());
        self.expiry.insert(expires, id.clone());
        self.bytes = self.bytes.saturating_add(own);
        let member = Member::new(h, id.clone(), caches, (now, now_us), expires, own);
        self.nodes.insert(id, member);
        Intake::Stored
    }

    /// The interned name, its index made if it had none.
    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some((k, _)) = self.caches.get_key_value(name) {
            return k.clone();
        }
        let k: Arc<str> = Arc::from(name);
        self.caches.insert(k.clone(), CacheIndex::default());
        self.bytes = self.bytes.saturating_add(name_bytes(name));
        k
    }

    /// What the owning node's own heartbeat, fresh, tells of how long its
    /// versions have been known (it is no member: see `Cluster::view`).
    pub(super) fn learn(&mut self, h: &Heartbeat, now: Instant) {
        for c in &h.caches {
            if let (Some(v), Some(idx)) = (c.version, self.caches.get_mut(c.name.as_str())) {
                idx.staircase
                    .learn(v, known_since(h, c.version_age_ms, now), now);
            }
        }
    }

    /// Remembers a heartbeat dropped for lack of room: the view counts as
    /// overflowing for three of its sender's intervals. Returns how many
    /// were dropped since the last warning when it is time for another
    /// (at most one per `warn_every`).
    pub(super) fn note_drop(
        &mut self,
        now: Instant,
        interval_ms: u64,
        warn_every: Duration,
    ) -> Option<u64> {
        let until = now.checked_add(lifetime(interval_ms)).unwrap_or(now);
        let d = &mut self.drops;
        d.until = Some(d.until.map_or(until, |u| u.max(until)));
        d.since_warned = d.since_warned.saturating_add(1);
        if d.last_warned
            .is_some_and(|at| now.saturating_duration_since(at) < warn_every)
        {
            return None;
        }
        d.last_warned = Some(now);
        Some(std::mem::take(&mut d.since_warned))
    }

    /// Members but the owning node's echo.
    fn others(&self, owner: Option<&str>) -> usize {
        let echo = owner.is_some_and(|id| self.nodes.contains_key(id));
        self.nodes.len().saturating_sub(usize::from(echo))
    }

    /// At the member cap, with less room than one member may take, or
    /// within three intervals of a drop's sender since it dropped one.
    pub(super) fn overflowing(&self, now: Instant, owner: Option<&str>) -> bool {
        let live = self.bytes.saturating_sub(self.gone_bytes);
        self.others(owner) >= MAX_MEMBERS
            || live.saturating_add(MAX_MEMBER_BYTES) > MAX_TOTAL_BYTES
            || self.drops.until.is_some_and(|until| now <= until)
    }
}
