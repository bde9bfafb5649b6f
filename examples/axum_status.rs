//! The node's status endpoints mounted in the application's own axum server,
//! next to its own routes, instead of on a port of their own.
//!
//! `node.status_router()` is a plain `axum::Router` serving
//! `/cache-sync/status`, `/cache-sync/caches/{name}` and `/healthz`, so one
//! server and one port can carry both. The example serves on a free loopback
//! port, fetches two routes with a minimal HTTP/1.1 client, and shuts down.
//!
//! ```text
//! cargo run -p cache-sync-examples --example axum_status
//! ```
#![allow(clippy::print_stdout)]

use axum::Router;
use axum::routing::get;
use cache_sync::status::NodeStatus;
use cache_sync::{Node, SyncedCache, Table, transport::EmbeddedTransport};
use tokio::net::TcpListener;

#[path = "shared/http.rs"]
mod http;
use http::http_get;

const COUNTRIES: Table<String, String> = Table::new("countries");

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let countries = SyncedCache::new(COUNTRIES, moka::future::Cache::new(100));
    let node = Node::builder("node-1", EmbeddedTransport::new())
        .register(&countries)
        .start()
        .await?;
    // A read through the loader, so the status has an entry to count.
    let loader = || async { "Germany".to_owned() };
    countries.get_with("de".to_owned(), loader).await;

    // `merge` panics on a route both routers serve (an application `/healthz`
    // of its own, say); `.nest("/internal", node.status_router())` avoids that.
    // In your own server its limits are yours too: `axum::serve` has no
    // header-read timeout, which `node.serve_status(addr)` sets.
    let app = Router::new()
        .route("/hello", get(|| async { "hello from the application" }))
        .merge(node.status_router());
    // Port 0: the OS picks a free port. Loopback only: the status is not public.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(async move {
        let stopped = async { stopped.await.unwrap_or_default() };
        axum::serve(listener, app)
            .with_graceful_shutdown(stopped)
            .await
    });
    println!("serving on http://{addr}");

    let (status_line, body) = http_get(addr, "/hello").await?;
    println!("GET /hello -> {status_line}\n{body}");
    assert_eq!(body, "hello from the application");

    let (status_line, body) = http_get(addr, "/cache-sync/status").await?;
    // The body is a `NodeStatus`, so a monitor can read it back typed.
    let status: NodeStatus = serde_json::from_str(&body)?;
    let pretty = serde_json::to_string_pretty(&status)?;
    println!("GET /cache-sync/status -> {status_line}\n{pretty}");
    assert_eq!(
        (status.node_id.as_str(), status.caches[0].entries),
        ("node-1", 1)
    );

    // Graceful: stop accepting, finish requests in flight, then stop the node.
    let _ = stop.send(());
    server.await??;
    node.shutdown().await?;
    Ok(())
}
