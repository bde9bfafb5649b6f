//! Outbox relay fences: the highest term seen per (cache, outbox), so that
//! what a replaced relay sends late never lands over what its successor
//! already published.

use crate::wire::Fence;

/// Outboxes remembered per cache. One cache is normally fed by one outbox
/// (a few during a migration); the bound only limits what forged fences
/// can cost on a transport that is not signed, where a forger can write any
/// value anyway.
const MAX_SCOPES_PER_CACHE: usize = 16;

/// Per cache, the highest term seen from each outbox (its scope).
#[derive(Debug, Default)]
pub(super) struct Fences {
    /// By cache name; the caches are the node's own, so their number is
    /// bounded by registration.
    caches: crate::util::HashMap<String, Vec<Fence>>,
}

impl Fences {
    /// Takes in an event's fence for `cache`: true if a higher term of the
    /// same outbox was seen before, so the event comes from a relay that
    /// was replaced and may be older than what its successor published.
    pub(super) fn fenced(&mut self, cache: &str, fence: Fence) -> bool {
        let seen = match self.caches.get_mut(cache) {
            Some(seen) => seen,
            None => self.caches.entry(cache.to_owned()).or_default(),
        };
        match seen.iter_mut().find(|f| f.scope == fence.scope) {
            Some(known) if fence.term < known.term => true,
            Some(known) => {
                known.term = fence.term;
                false
            }
            None => {
                if seen.len() >= MAX_SCOPES_PER_CACHE {
                    // The oldest outbox first: forgetting it only means a
                    // late event of its replaced relay is applied as sent.
                    seen.remove(0);
                }
                seen.push(fence);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(scope: u64, term: u64) -> Fence {
        Fence { scope, term }
    }

    #[test]
    fn a_lower_term_of_the_same_outbox_and_cache_is_fenced() {
        let mut fences = Fences::default();
        assert!(!fences.fenced("c", f(1, 7)));
        assert!(!fences.fenced("c", f(1, 7)), "the same term again");
        assert!(!fences.fenced("c", f(1, 8)));
        assert!(
            fences.fenced("c", f(1, 7)),
            "the replaced relay's late event"
        );
        // Other caches and other outboxes keep their own order.
        assert!(!fences.fenced("d", f(1, 7)));
        assert!(!fences.fenced("c", f(2, 1)));
        assert!(!fences.fenced("c", f(1, u64::MAX)));
        assert!(fences.fenced("c", f(1, 0)));
    }

    #[test]
    fn scopes_per_cache_are_bounded() {
        let mut fences = Fences::default();
        for scope in 0..1000 {
            assert!(!fences.fenced("c", f(scope, 5)));
        }
        assert!(fences.caches["c"].len() <= MAX_SCOPES_PER_CACHE);
        // The newest are remembered.
        assert!(fences.fenced("c", f(999, 4)));
    }
}
