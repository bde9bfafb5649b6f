//! The state every clone of a transport shares: the client runtime and its
//! owner, the producer slot, instance and group names, the offsets
//! directory the client reads, and the orderly shutdown of all of it. One
//! place where the runtime lives and dies, whatever uses it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rocketmq_client_rust::{ClientConfig, ClientRuntime, DefaultMQAdminExt, DefaultMQProducer};
use rocketmq_runtime::RuntimeOwner;
use tokio::sync::RwLock;

use super::super::Position;
use super::*;
use crate::error::{Error, Result};
use crate::util::lock;

pub(super) struct Inner {
    pub(super) config: RmqConfig,
    pub(super) offset_dir: PathBuf,
    /// Unique per transport: instance names and groups derive from it.
    pub(super) id: String,
    pub(super) rt: Arc<ClientRuntime>,
    pub(super) owner: Mutex<Option<RuntimeOwner>>,
    pub(super) producer: RwLock<Option<DefaultMQProducer>>,
    pub(super) producers_made: AtomicU64,
    pub(super) send_failures: Mutex<SendFailures>,
    /// Topics created (or found) by this transport, with their route's master
    /// brokers then (name to address).
    pub(super) topics: tokio::sync::Mutex<HashMap<String, TopicBrokers>>,
    /// One gate per topic being looked up or created, so two calls for one
    /// topic create it once, while calls for other topics (a heartbeat
    /// beside a change topic) do not wait behind a slow creation.
    pub(super) creating: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(super) names: AtomicU64,
    pub(super) closed: AtomicBool,
    /// The admin client the freshness tails are asked with, kept between
    /// checks (one per check would start a client instance every second);
    /// replaced after a failure.
    pub(super) tail_admin: tokio::sync::Mutex<Option<Admin>>,
    /// The newest tail read per topic (escaped), for this transport's
    /// subscriptions to look past the other caches' messages it names (see
    /// `watch_skips`).
    pub(super) tails: Mutex<HashMap<String, tokio::sync::watch::Sender<Option<Position>>>>,
    /// The live subscriptions' watches per topic (escaped), which vouch for
    /// the brokers a tail was read from (see `vouched`).
    pub(super) watches: Mutex<HashMap<String, Vec<Weak<Watch>>>>,
}

pub(super) fn unique_id(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    // Group names allow only letters, digits, '-', '_', '%' and '|'.
    let prefix: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

/// Where the client puts offsets: the same rule as its `LocalFileOffsetStore`.
pub(super) fn client_offset_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("rocketmq.client.localOffsetStoreDir") {
        return PathBuf::from(dir);
    }
    std::env::var("HOME").map_or_else(
        |_| PathBuf::from("/tmp/.rocketmq_offsets"),
        |home| PathBuf::from(home).join(".rocketmq_offsets"),
    )
}

pub(super) fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

pub(super) fn client_config(namesrv: &str, instance: &str) -> ClientConfig {
    let mut cc = ClientConfig::new();
    cc.set_namesrv_addr(namesrv.into());
    cc.set_instance_name(instance.into());
    cc.set_client_ip(CLIENT_IP.into());
    cc
}

impl Inner {
    /// The newest tail of `topic` (escaped), as [`tail`](Self::tail) reads
    /// them.
    pub(super) fn tails_of(&self, topic: &str) -> tokio::sync::watch::Receiver<Option<Position>> {
        lock(&self.tails)
            .entry(topic.to_owned())
            .or_insert_with(|| tokio::sync::watch::channel(None).0)
            .subscribe()
    }

    /// Registers a new subscription's watch of `topic` (escaped).
    pub(super) fn watching(&self, topic: &str, watch: &Arc<Watch>) {
        let mut watches = lock(&self.watches);
        let list = watches.entry(topic.to_owned()).or_default();
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(watch));
    }

    /// Whether the live subscriptions of the tail's topic vouch for the
    /// brokers it was read from: each is the process, with the store,
    /// whose history the subscriptions checked. None live, none vouched:
    /// between subscriptions, and after a broker closed, nothing is proved.
    pub(super) fn vouched(&self, tail: &Position) -> bool {
        let Some(topic) = tail_topic(tail) else {
            return false;
        };
        let live: Vec<Arc<Watch>> = lock(&self.watches)
            .get(topic)
            .map(|list| list.iter().filter_map(Weak::upgrade).collect())
            .unwrap_or_default();
        !live.is_empty() && live.iter().all(|w| w.vouches_for(tail_brokers(tail)))
    }

    pub(super) fn next_name(&self, what: &str) -> String {
        let n = self.names.fetch_add(1, Ordering::Relaxed);
        format!("{}-{what}-{n}", self.id)
    }

    pub(super) fn ensure_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::disconnected(KIND, "the transport was shut down"));
        }
        Ok(())
    }

    /// A short-lived admin client. Each gets its own client instance, so a
    /// circuit breaker one opened during an outage never blocks the next.
    pub(super) async fn admin(&self) -> Result<Admin> {
        let mut admin = DefaultMQAdminExt::new(self.rt.clone());
        admin.set_namesrv_addr(self.config.namesrv.as_str());
        admin
            .client_config_mut()
            .set_instance_name(self.next_name("admin").into());
        admin.client_config_mut().set_client_ip(CLIENT_IP.into());
        admin.start().await.map_err(err)?;
        Ok(Admin(Some(admin)))
    }

    pub(super) async fn shutdown(&self) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(mut producer) = self.producer.write().await.take() {
            producer.shutdown().await;
        }
        if let Some(mut admin) = self.tail_admin.lock().await.take() {
            admin.shutdown().await;
        }
        let _ = self.rt.shutdown().await;
        let owner = lock(&self.owner).take();
        if let Some(owner) = owner {
            let _ = owner.shutdown_tasks().await;
            // Consumes the runtime without blocking, so it is allowed here.
            let _ = owner.shutdown_background();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let Some(owner) = lock(&self.owner).take() else {
            return;
        };
        let producer = self.producer.get_mut().take();
        let rt = self.rt.clone();
        // The shutdown is async and Drop may run inside the application's
        // runtime, where blocking on another runtime panics: a helper thread
        // drives it on the client's own runtime.
        let handle = std::thread::Builder::new()
            .name("cache-sync-rmq-shutdown".into())
            .spawn(move || {
                owner.block_on(async {
                    let steps = async {
                        if let Some(mut p) = producer {
                            p.shutdown().await;
                        }
                        let _ = rt.shutdown().await;
                        let _ = owner.shutdown_tasks().await;
                    };
                    let _ = tokio::time::timeout(Duration::from_secs(5), steps).await;
                });
                let _ = owner.shutdown_background();
            });
        if let Ok(handle) = handle {
            let _ = handle.join();
        }
    }
}
