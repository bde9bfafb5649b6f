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
//!   version has been known, see [`Staircase`](super::view::Staircase));
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
//!
//! This file holds the store, its bounds and its intake; what a member is
//! lives in `member`, the per-name index in `index`, members leaving and
//! the nodes gone lately in `expiry`, and the byte estimates in
//! `accounting`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Heartbeat;
use super::heartbeat::MISSED_INTERVALS;
use crate::util::{HashMap, MAX_TIMEOUT};
use accounting::{name_bytes, summary_bytes};
use expiry::Gone;
use member::{StoredCache, dedup};

mod accounting;
mod expiry;
mod index;
mod member;

pub(super) use index::CacheIndex;
pub(super) use member::Member;

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
    /// How many members claim each count of live nodes
    /// ([`Heartbeat::live_nodes`]): the largest is at hand without a pass
    /// over the members.
    claims: BTreeMap<u64, u32>,
    /// Everything accounted: members, names with their indexes, gone nodes.
    bytes: usize,
    /// Of which, gone nodes (given up first when room is needed).
    gone_bytes: usize,
    tie: u64,
    drops: Drops,
}

/// How long a node is live after its last heartbeat: three of its own
/// intervals, the interval clamped to what a node can be given (a forged
/// `u64::MAX` must not make an entry immortal).
pub(super) fn lifetime(interval_ms: u64) -> Duration {
    Duration::from_millis(interval_ms.max(1))
        .min(MAX_TIMEOUT)
        .saturating_mul(MISSED_INTERVALS)
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
                self.unclaim(m.live_nodes);
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
        self.claim(h.live_nodes);
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
        for idx in self.caches.values_mut() {
            idx.own = None;
        }
        for c in &h.caches {
            if let Some(idx) = self.caches.get_mut(c.name.as_str()) {
                idx.own = c.version;
                if let Some(v) = c.version {
                    idx.staircase
                        .learn(v, known_since(h, c.version_age_ms, now), now);
                }
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

    /// Live nodes, the owning node (if any) included whether or not its
    /// echo arrived.
    pub(super) fn live(&self, owner: Option<&str>) -> u64 {
        let n = self
            .others(owner)
            .saturating_add(usize::from(owner.is_some()));
        u64::try_from(n).unwrap_or(u64::MAX)
    }

    /// The most live nodes any member's own view held: this view has not
    /// heard every node while it holds fewer. `O(log n)`.
    pub(super) fn most_claimed(&self) -> u64 {
        self.claims.last_key_value().map_or(0, |(&n, _)| n)
    }

    fn claim(&mut self, live_nodes: Option<u64>) {
        if let Some(n) = live_nodes {
            let count = self.claims.entry(n).or_default();
            *count = count.saturating_add(1);
        }
    }

    pub(super) fn unclaim(&mut self, live_nodes: Option<u64>) {
        let Some(n) = live_nodes else {
            return;
        };
        if let std::collections::btree_map::Entry::Occupied(mut e) = self.claims.entry(n) {
            *e.get_mut() = e.get().saturating_sub(1);
            if *e.get() == 0 {
                e.remove();
            }
        }
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
