//! The status endpoint: what each node's caches hold and how far they got.

use std::future::IntoFuture;
use std::net::SocketAddr;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::bus::Position;
use crate::consumer::Node;
use crate::error::{Error, Result};

/// The address [`Node::serve_status`] is usually given: loopback only.
pub const DEFAULT_STATUS_ADDR: &str = "127.0.0.1:9464";

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
    /// Records that could not be read at all (garbage, unknown format, over
    /// the size limit). Each was logged with its reason.
    pub events_rejected: u64,
    /// Loss signals from the transport.
    pub losses: u64,
    /// Gaps found in a publisher's sequence numbers.
    pub publisher_gaps: u64,
    /// Errors from the transport (each followed by a re-subscription).
    pub transport_errors: u64,
    /// The last reason caches were invalidated for loss, if any.
    pub last_loss_reason: Option<String>,
    /// Microseconds since the Unix epoch of that loss.
    pub last_loss_at_us: Option<u64>,
    /// Each registered cache, by name.
    pub caches: Vec<CacheStatus>,
}

/// One cache, as the status endpoint reports it. No keys or values appear.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CacheStatus {
    /// The cache name.
    pub name: String,
    /// The highest entry version this node has applied for this cache (from
    /// refreshes, invalidations and clears), or `null` if no versioned event
    /// has arrived. With one publisher per table (the dictionary helper) and
    /// an ordered transport, two nodes reporting the same version and the
    /// same `position` have applied the same changes.
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
    /// Clear events applied.
    pub clears: u64,
    /// Times the whole cache was invalidated because events may have been lost.
    pub loss_resyncs: u64,
    /// Events for this cache that were rejected (a key or value did not decode).
    pub rejected_events: u64,
    /// Microseconds since the Unix epoch when the last event was applied.
    pub last_applied_at_us: Option<u64>,
    /// Publish-to-applied time of the last event, in microseconds (across
    /// machines this includes clock skew).
    pub last_latency_us: Option<u64>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    cache: &'a str,
}

pub(crate) fn router(node: Node) -> Router {
    Router::new()
        .route("/cache-sync/status", get(node_status))
        .route("/cache-sync/caches/{name}", get(cache_status))
        .route("/healthz", get(healthz))
        .with_state(node)
}

async fn node_status(State(node): State<Node>) -> Json<NodeStatus> {
    Json(node.status())
}

async fn cache_status(State(node): State<Node>, Path(name): Path<String>) -> Response {
    match node.status().caches.into_iter().find(|c| c.name == name) {
        Some(c) => Json(c).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(ErrorBody {
                error: "no cache of that name is registered on this node",
                cache: &name,
            }),
        )
            .into_response(),
    }
}

async fn healthz(State(node): State<Node>) -> Response {
    if node.is_consuming() {
        (StatusCode::OK, Json(serde_json::json!({ "status": "ok" }))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "not consuming" })),
        )
            .into_response()
    }
}

/// A running status server. Stops when [`shutdown`](Self::shutdown) is called
/// or when dropped.
#[derive(Debug)]
pub struct StatusServer {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl StatusServer {
    pub(crate) async fn bind(node: Node, addr: impl ToSocketAddrs) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io("status listener", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("status listener", e))?;
        let (stop, stopped) = oneshot::channel::<()>();
        let serve = axum::serve(listener, router(node))
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .into_future();
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(tokio::spawn(serve)),
        })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, finishes in-flight requests, and waits.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            match task.await {
                Ok(r) => r.map_err(|e| Error::io("status server", e))?,
                Err(e) => return Err(Error::io("status server", std::io::Error::other(e))),
            }
        }
        Ok(())
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
