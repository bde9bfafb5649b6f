//! The public entry points: the builder and its settings, `connect` (which
//! starts the client runtime and the producer) and `shutdown`. Apart from
//! the machinery they start, which callers never see.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use rocketmq_client_rust::{ClientRuntime, ClientRuntimeConfig, TelemetryHandle};
use rocketmq_runtime::{RuntimeConfig, RuntimeOwner};
use tokio::sync::RwLock;

use super::*;
use crate::error::{Error, Result};
use crate::util::check_at_least;

#[derive(Debug, Clone)]
pub(super) struct RmqConfig {
    pub(super) namesrv: String,
    pub(super) queues: u32,
    offset_dir: Option<PathBuf>,
    name_prefix: String,
}

/// Configures a [`RocketMqTransport`].
#[cfg_attr(docsrs, doc(cfg(feature = "rocketmq")))]
#[derive(Debug, Clone)]
pub struct RocketMqBuilder {
    config: RmqConfig,
}

impl RocketMqBuilder {
    /// Message queues of a topic the transport creates. Default 4; at least
    /// 1, or [`connect`](Self::connect) refuses it. More queues spread
    /// caches over more brokers' queues; order holds per cache either way.
    pub fn queues_per_topic(mut self, n: u32) -> Self {
        self.config.queues = n;
        self
    }

    /// The directory the client keeps consumer offsets in. The client reads
    /// it only from the process environment (see the type's docs), so this
    /// must name the same directory: [`connect`](Self::connect) fails with
    /// [`Error::Config`] otherwise. Default: whatever the client uses.
    pub fn offset_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.config.offset_dir = Some(dir.into());
        self
    }

    /// Prefix of the consumer groups and client instance names the transport
    /// creates. Default `"cache-sync"`.
    pub fn name_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.config.name_prefix = prefix.into();
        self
    }

    /// Starts the client runtime and the producer.
    ///
    /// A setting out of its range is refused with [`Error::Config`] before
    /// the runtime starts or anything is sent.
    pub async fn connect(self) -> Result<RocketMqTransport> {
        check_at_least("rocketmq queues_per_topic", self.config.queues, 1)?;
        // Boxed as `dyn Send`: the client's futures nest so deeply that
        // every crate awaiting them would need a higher recursion limit.
        let connecting: BoxFuture<'static, Result<RocketMqTransport>> = Box::pin(self.start());
        connecting.await
    }

    async fn start(self) -> Result<RocketMqTransport> {
        let client_dir = client_offset_dir();
        let offset_dir = match self.config.offset_dir.clone() {
            Some(dir) if !same_dir(&dir, &client_dir) => {
                return Err(Error::Config(format!(
                    "rocketmq offset dir {} differs from the client's {}; the client reads it \
                     only from the environment variable rocketmq.client.localOffsetStoreDir \
                     at process start",
                    dir.display(),
                    client_dir.display()
                )));
            }
            _ => client_dir,
        };
        let owner = RuntimeOwner::plan(RuntimeConfig::for_parallelism("cache-sync-rmq", 2))
            .map_err(|e| Error::Config(format!("rocketmq runtime: {e}")))?
            .build()
            .map_err(|e| Error::Config(format!("rocketmq runtime: {e}")))?;
        let rt = match ClientRuntime::try_new(
            owner.root_context().component("client"),
            ClientRuntimeConfig::default(),
            TelemetryHandle::noop(),
        ) {
            Ok(rt) => rt,
            Err(e) => {
                // Dropping a runtime inside the caller's runtime panics.
                let _ = owner.shutdown_background();
                return Err(err(e));
            }
        };
        let inner = Arc::new(Inner {
            id: unique_id(&self.config.name_prefix),
            config: self.config,
            offset_dir,
            rt,
            owner: Mutex::new(Some(owner)),
            producer: RwLock::new(None),
            producers_made: AtomicU64::new(0),
            send_failures: Mutex::new(SendFailures::default()),
            topics: tokio::sync::Mutex::new(HashMap::new()),
            creating: Mutex::new(HashMap::new()),
            names: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            tail_admin: tokio::sync::Mutex::new(None),
            watches: Mutex::new(HashMap::new()),
            tails: Mutex::new(HashMap::new()),
        });
        let producer = inner.new_producer().await?;
        *inner.producer.write().await = Some(producer);
        Ok(RocketMqTransport {
            inner: inner as Arc<dyn Shared>,
        })
    }
}

impl RocketMqTransport {
    /// Configures a transport for the name server at `namesrv_addr`
    /// (`127.0.0.1:9876`; several separated by `;`).
    pub fn builder(namesrv_addr: impl Into<String>) -> RocketMqBuilder {
        RocketMqBuilder {
            config: RmqConfig {
                namesrv: namesrv_addr.into(),
                queues: 4,
                offset_dir: None,
                name_prefix: "cache-sync".into(),
            },
        }
    }

    /// Connects with default settings.
    pub async fn connect(namesrv_addr: impl Into<String>) -> Result<Self> {
        Self::builder(namesrv_addr).connect().await
    }

    /// Stops the producer and the client runtime for every clone of this
    /// transport. Subscriptions still alive then fail with a disconnect.
    // A plain fn returning a boxed future, not an `async fn`: callers in
    // other crates would otherwise have to lay out the client's deeply nested
    // futures themselves, and need a raised recursion limit to do it.
    pub fn shutdown(&self) -> BoxFuture<'static, ()> {
        let inner = self.inner.clone();
        Box::pin(async move { inner.get().shutdown().await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn connect_refuses_zero_queues_before_any_io() {
        // Nothing listens there; a connection attempt would fail otherwise.
        let e = RocketMqTransport::builder("127.0.0.1:1")
            .queues_per_topic(0)
            .connect()
            .await
            .unwrap_err();
        assert!(e.is_config(), "{e:?}");
        assert!(e.to_string().contains("queues_per_topic"), "{e}");
    }
}
