//! Which caches a node holds: the map its consumer routes events by,
//! registering a cache in it (claiming it, emptying it, and telling the
//! consumer to re-subscribe), and releasing it again.

use std::sync::Arc;

use super::Shared;
use crate::cache::CacheHandle;
use crate::error::{Error, Result};
use crate::table::check_topic;
use crate::util::HashMap;

pub(super) type CacheMap = HashMap<String, Arc<dyn CacheHandle>>;

impl Shared {
    pub(super) fn caches(&self) -> Arc<CacheMap> {
        self.caches
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub(super) fn cache(&self, name: &str) -> Option<Arc<dyn CacheHandle>> {
        self.caches().get(name).cloned()
    }

    pub(super) async fn register(&self, cache: Arc<dyn CacheHandle>) -> Result<()> {
        let name = cache.name().to_owned();
        check_topic(&name, cache.topic(), &self.topic)?;
        {
            let mut guard = self.caches.write().unwrap_or_else(|p| p.into_inner());
            let caches = Arc::make_mut(&mut guard);
            if caches.contains_key(&name) {
                return Err(Error::DuplicateCache(name));
            }
            if !cache.claim(
                self.token,
                self.config.reorder_window,
                self.housekeeper.clone(),
                &self.freshness.proof,
            ) {
                return Err(Error::Config(format!(
                    "cache {name:?} is already registered on a node"
                )));
            }
            caches.insert(name.clone(), cache.clone());
        }
        // The reset below can wait (for a write, or a loader holding a key):
        // a caller that gives up meanwhile (a timeout) must not leave the
        // cache in the map without the re-subscription that brings its
        // events, so the registration is undone unless it completes.
        let mut undo = UndoRegister {
            shared: self,
            cache: Some(cache.clone()),
        };
        // After the insert: events applied meanwhile are wiped too, which is
        // safe; the other order could drop one that arrived in between.
        cache.reset().await;
        self.registrations.send_modify(|n| *n = n.wrapping_add(1));
        undo.cache = None;
        tracing::debug!(node = %self.id, cache = %name, "cache registered");
        Ok(())
    }

    /// Takes a cache out of the map again, and releases it.
    pub(super) fn unregister(&self, cache: &Arc<dyn CacheHandle>) {
        {
            let mut guard = self.caches.write().unwrap_or_else(|p| p.into_inner());
            Arc::make_mut(&mut guard).remove(cache.name());
        }
        cache.release(self.token);
    }

    /// Whether the node is ready, as [`Node::is_ready`](super::Node::is_ready)
    /// says, short of the stop its handle knows of.
    pub(super) fn ready(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.consuming.load(Relaxed)
            && self.caught_up.load(Relaxed)
            && !self
                .caches()
                .values()
                .any(|c| c.is_quarantined() || c.is_past_bound())
    }

    pub(super) fn release_caches(&self) {
        for cache in self.caches().values() {
            cache.release(self.token);
        }
    }
}

/// Takes a cache out again if its registration is dropped half-way.
struct UndoRegister<'a> {
    shared: &'a Shared,
    cache: Option<Arc<dyn CacheHandle>>,
}

impl Drop for UndoRegister<'_> {
    fn drop(&mut self) {
        if let Some(cache) = self.cache.take() {
            self.shared.unregister(&cache);
        }
    }
}
