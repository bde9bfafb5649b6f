//! What the members are accounted, in bytes: an estimate of the heap each
//! part takes (over rather than under), which the view's bounds are
//! checked against; `benches/cluster_view.rs` measures it.

use std::mem::size_of;
use std::sync::Arc;

use tokio::time::Instant;

use super::expiry::Gone;
use super::index::CacheIndex;
use super::member::{Member, StoredCache};
use crate::cluster::Heartbeat;
use crate::cluster::view::Staircase;
use crate::transport::Offset;

/// The heap of an `Arc<str>` beyond its text: two counts.
const ARC_HEADER: usize = 2 * size_of::<usize>();
/// A member beyond its strings, caches and position: the map's slot (a
/// hash table runs up to half empty after growing), the expiry queue's
/// entry, the id's `Arc` header, its count among the claims (one B-tree
/// entry at worst).
const MEMBER_FIXED: usize = 2 * size_of::<(Arc<str>, Member)>()
    + 2 * size_of::<((Instant, u64), Arc<str>)>()
    + ARC_HEADER
    + 2 * size_of::<(u64, u32)>();
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
pub(super) const GONE_FIXED: usize =
    2 * size_of::<(Arc<str>, Gone)>() + 2 * size_of::<((Instant, u64), Arc<str>)>() + ARC_HEADER;

/// What a distinct cache name is accounted.
pub(super) fn name_bytes(name: &str) -> usize {
    NAME_FIXED.saturating_add(name.len())
}

/// What a heartbeat's summary would be accounted: the member (names aside)
/// and its cache names' text, each as if no other member held it.
pub(super) fn summary_bytes(h: &Heartbeat) -> (usize, usize) {
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
        if c.audit.is_some() {
            own = own.saturating_add(size_of::<crate::status::AuditStatus>());
        }
        names = names
            .saturating_add(ARC_HEADER)
            .saturating_add(c.name.len());
    }
    (own, names)
}
