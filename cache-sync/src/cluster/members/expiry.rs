//! Members leave: one whose last heartbeat is three of its intervals old
//! moves to the nodes gone lately, which are listed for `GONE_KEPT`, at
//! most `MAX_MEMBERS` of them, and given up first when room is needed.
//! Both are queued (members by deadline, gone nodes by last heartbeat), so
//! expiring costs `O(log n)` per node that goes and nothing for those that
//! stay.

use std::sync::Arc;

use tokio::time::Instant;

use super::accounting::GONE_FIXED;
use super::{GONE_KEPT, MAX_MEMBERS, Members};

/// A node gone lately.
#[derive(Debug)]
pub(super) struct Gone {
    pub(super) last_seen_at_us: u64,
    key: (Instant, u64),
    bytes: usize,
}

impl Members {
    /// Moves the members whose last heartbeat is three of their intervals
    /// old to the nodes gone, and forgets those gone for `GONE_KEPT`;
    /// returns the ids of those that went. `O(log n)` per member that
    /// goes, `O(1)` when none does.
    pub(in crate::cluster) fn expire(&mut self, now: Instant) -> Vec<Arc<str>> {
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
            self.unclaim(m.live_nodes);
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
    pub(super) fn forget_gone(&mut self, id: &str) -> Option<Arc<str>> {
        let (id, g) = self.gone.remove_entry(id)?;
        self.gone_order.remove(&g.key);
        self.unaccount_gone(g.bytes);
        Some(id)
    }

    /// Forgets the gone node heard from longest ago; false if none is left.
    pub(super) fn forget_oldest_gone(&mut self) -> bool {
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
}
