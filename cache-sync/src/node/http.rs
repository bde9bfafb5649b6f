//! The status endpoint: what each node's caches hold and how far they got.

use std::future::Future;
use std::net::SocketAddr;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::Node;
use crate::cluster::ClusterView;
use crate::error::{Error, Result};
use crate::status::NodeStatus;
use crate::util::deadline_after;

// The cluster page is the router's, but its file sits beside this one with
// the node's other parts rather than in an `http/` directory of its own.
#[path = "page.rs"]
mod page;

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    cache: &'a str,
}

pub(crate) fn router(node: Node) -> Router {
    Router::new()
        .route("/cache-sync/status", get(node_status))
        .route("/cache-sync/caches/{name}", get(cache_status))
        .route("/cache-sync/cluster", get(cluster))
        // The cluster page, for a browser; axum tells the two paths apart,
        // and people type either.
        .route("/cache-sync/", get(page::cluster_page))
        .route("/cache-sync", get(page::cluster_page))
        .route("/healthz", get(healthz))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(node)
}

async fn cluster(State(node): State<Node>) -> Json<ClusterView> {
    Json(node.cluster().view())
}

/// 200 while the consume task runs, whatever the broker does: a restart
/// would not bring the broker back.
async fn livez(State(node): State<Node>) -> Response {
    if node.is_alive() {
        (
            StatusCode::OK,
            Json(serde_json::json!({ "status": "alive" })),
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "consumer stopped" })),
        )
            .into_response()
    }
}

/// 200 once consuming, caught up and out of quarantine; 503 with the
/// reasons otherwise.
async fn readyz(State(node): State<Node>) -> Response {
    let reasons = node.not_ready();
    if reasons.is_empty() {
        (
            StatusCode::OK,
            Json(serde_json::json!({ "status": "ready" })),
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "not ready", "reasons": reasons })),
        )
            .into_response()
    }
}

async fn node_status(State(node): State<Node>) -> Json<NodeStatus> {
    Json(node.status_settled().await)
}

async fn cache_status(State(node): State<Node>, Path(name): Path<String>) -> Response {
    match node
        .status_settled()
        .await
        .caches
        .into_iter()
        .find(|c| c.name == name)
    {
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

async fn metrics(State(node): State<Node>) -> Response {
    match super::metrics::render(&node).await {
        Ok(text) => ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text).into_response(),
        // prometheus-client reports what it cannot encode as `fmt::Error`;
        // writing into a `String` never fails and these metrics use nothing
        // its text encoder refuses, so this is not expected. Answered all the
        // same rather than unwrapped.
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "metrics did not encode").into_response(),
    }
}

/// How long a client may take to send a request's head (line and
/// headers), from the moment the server starts reading it. Defeats clients
/// that send half a request, or a byte at a time.
pub(crate) const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may make no progress at all (an idle keep-alive
/// connection, a stalled body, a client that stops reading the response).
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long [`StatusServer::shutdown`] lets requests in flight finish
/// before it closes their connections.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// Connections served at once. Past that, new ones wait in the listen
/// queue until one closes (the timeouts above bound how long that takes),
/// so a flood of idle clients cannot use up the process's file descriptors.
/// Probes and scrapes need a handful.
pub(crate) const MAX_CONNECTIONS: usize = 64;
/// How long one connection is kept: after that it is closed once its
/// request in flight is answered. Busy keep-alive clients never go idle,
/// so without this, as many of them as the cap could keep a probe out for
/// good.
pub(crate) const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);

/// A running status server. Stops when [`shutdown`](Self::shutdown) is called
/// or when dropped.
///
/// It speaks HTTP/1.1 with keep-alive. A client gets
/// 10 s to send a request's head and a connection that makes no progress
/// for 60 s is closed, so no client can hold a connection, or the server's
/// shutdown, hostage; shutdown lets requests in flight finish for up to 5 s,
/// then closes what is left. At most 64 connections are served at once;
/// more wait to be accepted until one closes, and none is kept longer than
/// 60 s (it closes after the request in flight).
#[derive(Debug)]
pub struct StatusServer {
    addr: SocketAddr,
    stop: Option<watch::Sender<bool>>,
    task: Option<JoinHandle<()>>,
}

impl StatusServer {
    pub(crate) async fn bind(node: Node, addr: impl ToSocketAddrs) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| Error::io("status listener", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("status listener", e))?;
        let (stop, stopped) = watch::channel(false);
        Ok(Self {
            addr,
            stop: Some(stop),
            task: Some(tokio::spawn(serve(listener, router(node), stopped))),
        })
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, lets requests in flight finish for up to 5 s, closes
    /// every connection, and waits for all of that.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            stop.send_replace(true);
        }
        if let Some(task) = self.task.take() {
            task.await
                .map_err(|e| Error::io("status server", std::io::Error::other(e)))?;
        }
        Ok(())
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop.send_replace(true);
        }
    }
}

/// Accepts until told to stop, then shuts the connections down within
/// `SHUTDOWN_GRACE`.
async fn serve(listener: TcpListener, app: Router, mut stop: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    let (drain, draining) = watch::channel(false);
    loop {
        tokio::select! {
            () = async { let _ = stop.wait_for(|s| *s).await; } => break,
            accepted = listener.accept(), if connections.len() < MAX_CONNECTIONS => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, app.clone(), draining.clone()));
                }
                Err(e) => {
                    // Out of file descriptors, or a connection reset before
                    // it was accepted: wait a moment rather than spin.
                    tracing::warn!(error = %e, "status server: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    drain.send_replace(true);
    let finished = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if finished.is_err() {
        tracing::debug!(
            open = connections.len(),
            "status server: closing connections still open after the grace period"
        );
    }
    connections.shutdown().await;
}

async fn connection(stream: TcpStream, app: Router, mut draining: watch::Receiver<bool>) {
    let io = TokioIo::new(IdleTimeout::new(stream, IDLE_TIMEOUT));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .keep_alive(true);
    let conn = builder.serve_connection(io, TowerToHyperService::new(app));
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        () = async { let _ = draining.wait_for(|d| *d).await; } => {
            // Finish the request in flight, if any, then close; the server
            // cuts this short after `SHUTDOWN_GRACE`.
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
        () = tokio::time::sleep(MAX_CONNECTION_AGE) => {
            // The same, bounded by the idle timeout; a shutdown meanwhile
            // cuts it short as above.
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// A stream that fails with `TimedOut` once neither a read nor a write has
/// made progress for `idle`.
struct IdleTimeout {
    stream: TcpStream,
    idle: Duration,
    deadline: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl IdleTimeout {
    fn new(stream: TcpStream, idle: Duration) -> Self {
        Self {
            stream,
            idle,
            deadline: Box::pin(tokio::time::sleep_until(deadline_after(idle))),
        }
    }

    fn progressed(&mut self) {
        self.deadline.as_mut().reset(deadline_after(self.idle));
    }

    /// Called when the stream is not ready: an error once the deadline
    /// passed, else `Pending` with the deadline's waker registered too.
    fn stalled<T>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<T>> {
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "status connection idle for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for IdleTimeout {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.stalled(cx),
        }
    }
}

impl AsyncWrite for IdleTimeout {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Ready(r) => {
                this.progressed();
                Poll::Ready(r)
            }
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        match std::pin::Pin::new(&mut this.stream).poll_flush(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => this.stalled(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower::ServiceExt;

    use super::*;
    use crate::{EmbeddedTransport, SyncedCache};

    async fn node_with_cache() -> (Node, SyncedCache<String, String>) {
        let cache = SyncedCache::new("countries", moka::future::Cache::new(100));
        let node = Node::builder("node-7", EmbeddedTransport::new())
            .register(&cache)
            .start()
            .await
            .unwrap();
        cache
            .insert("secret-key-123".into(), "secret-value-456".into())
            .await;
        cache.get("secret-key-123").await;
        (node, cache)
    }

    async fn get(router: Router, uri: &str) -> (StatusCode, serde_json::Value, String) {
        let response = router
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        (status, serde_json::from_str(&text).unwrap(), text)
    }

    #[tokio::test]
    async fn status_lists_caches_without_their_keys() {
        let (node, _cache) = node_with_cache().await;
        let (code, json, text) = get(node.status_router(), "/cache-sync/status").await;
        assert_eq!(code, StatusCode::OK);
        assert_eq!(json["node_id"], "node-7");
        assert_eq!(json["transport"], "embedded");
        assert_eq!(json["consuming"], true);
        let cache = &json["caches"][0];
        assert_eq!(cache["name"], "countries");
        assert_eq!(cache["hits"], 1);
        assert_eq!(cache["entries"], 1, "moka's lazy count is settled first");
        for field in [
            "version",
            "entries",
            "loads",
            "invalidations",
            "refreshes",
            "clears",
            "loss_resyncs",
            "rejected_events",
            "last_applied_at_us",
        ] {
            assert!(cache.get(field).is_some(), "missing {field} in {cache}");
        }
        assert!(!text.contains("secret"), "keys or values leaked: {text}");
        let parsed: NodeStatus = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed, node.status());
    }

    #[tokio::test]
    async fn one_cache_by_name_and_a_json_404_for_unknown_names() {
        let (node, _cache) = node_with_cache().await;
        let (code, json, _) = get(node.status_router(), "/cache-sync/caches/countries").await;
        assert_eq!(
            (code, json["name"].as_str()),
            (StatusCode::OK, Some("countries"))
        );
        let (code, json, _) = get(node.status_router(), "/cache-sync/caches/nope").await;
        assert_eq!(code, StatusCode::NOT_FOUND);
        assert_eq!(json["cache"], "nope");
        assert!(json["error"].as_str().unwrap().contains("no cache"));
    }

    #[tokio::test]
    async fn healthz_follows_the_consumer() {
        let (node, _cache) = node_with_cache().await;
        let (code, _, _) = get(node.status_router(), "/healthz").await;
        assert_eq!(code, StatusCode::OK);
        node.shutdown().await.unwrap();
        let (code, json, _) = get(node.status_router(), "/healthz").await;
        assert_eq!(
            (code, json["status"].as_str()),
            (StatusCode::SERVICE_UNAVAILABLE, Some("not consuming"))
        );
    }

    /// Regression: a client that sent half a request blocked
    /// `StatusServer::shutdown` without bound, and its connection stayed
    /// open for good; so did one that connected and sent nothing. The clock
    /// is paused: tokio moves it on whenever every task waits, so the
    /// server's timeouts fire without the test waiting for them.
    #[tokio::test(start_paused = true)]
    async fn no_client_holds_a_connection_or_the_shutdown_hostage() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr();
        let mut half = tokio::net::TcpStream::connect(addr).await.unwrap();
        half.write_all(b"GET /cache-sync/status HTTP/1.1\r\nHost: loc")
            .await
            .unwrap();
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        for (what, stream) in [("half a request", &mut half), ("nothing", &mut silent)] {
            let mut rest = Vec::new();
            let closed = tokio::time::timeout(
                HEADER_READ_TIMEOUT + IDLE_TIMEOUT,
                stream.read_to_end(&mut rest),
            )
            .await;
            assert!(
                closed.is_ok(),
                "a client that sent {what} still holds its connection"
            );
        }
        // A third client, mid-request when shutdown starts, cannot stall it
        // past the grace period either.
        let mut stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
        stalled
            .write_all(b"GET /healthz HTTP/1.1\r\n")
            .await
            .unwrap();
        tokio::task::yield_now().await;
        let started = tokio::time::Instant::now();
        tokio::time::timeout(SHUTDOWN_GRACE + HEADER_READ_TIMEOUT, server.shutdown())
            .await
            .expect("shutdown waited on a stalled client")
            .unwrap();
        assert!(started.elapsed() <= SHUTDOWN_GRACE + HEADER_READ_TIMEOUT);
    }

    /// Review of issue 9: connections were not capped, so idle clients
    /// could use up the process's file descriptors. Past the cap, a client
    /// waits until the silent ones time out, and is then served.
    #[tokio::test(start_paused = true)]
    async fn connections_are_capped_and_the_next_client_waits_its_turn() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr();
        let mut silent = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let started = tokio::time::Instant::now();
        let mut probe = tokio::net::TcpStream::connect(addr).await.unwrap();
        probe
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        tokio::time::timeout(
            HEADER_READ_TIMEOUT + IDLE_TIMEOUT,
            probe.read_to_string(&mut response),
        )
        .await
        .expect("the client past the cap was never served")
        .unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(
            started.elapsed() >= HEADER_READ_TIMEOUT,
            "served at once: no cap ({:?})",
            started.elapsed()
        );
        server.shutdown().await.unwrap();
    }

    /// Review of issue 9: with the cap, busy keep-alive clients (which never
    /// go idle) could hold every slot for good. A connection is closed once
    /// it is `MAX_CONNECTION_AGE` old, after the request in flight.
    #[tokio::test(start_paused = true)]
    async fn a_busy_keep_alive_connection_is_closed_when_it_is_old() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let mut stream = tokio::net::TcpStream::connect(server.local_addr())
            .await
            .unwrap();
        let opened = tokio::time::Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let sent = stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
                .await;
            // A response, or the end of the connection.
            let n = match sent {
                Ok(()) => stream.read(&mut buf).await.unwrap_or(0),
                Err(_) => 0,
            };
            if n == 0 {
                break;
            }
            assert!(
                opened.elapsed() <= MAX_CONNECTION_AGE + IDLE_TIMEOUT,
                "a busy connection was kept for {:?}",
                opened.elapsed()
            );
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        assert!(opened.elapsed() >= MAX_CONNECTION_AGE);
        server.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn serves_on_a_loopback_listener() {
        let (node, _cache) = node_with_cache().await;
        let server = node.serve_status("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr();
        assert!(addr.ip().is_loopback());
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(
                b"GET /cache-sync/status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            )
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.contains("\"node_id\":\"node-7\""), "{response}");
        server.shutdown().await.unwrap();
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "still listening after shutdown"
        );
    }
}
