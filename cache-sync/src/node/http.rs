//! The status endpoint: what each node's caches hold and how far they got.

use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::Node;
use crate::cluster::ClusterView;
use crate::status::NodeStatus;

// The cluster page is the router's, but its file sits beside this one with
// the node's other parts rather than in an `http/` directory of its own.
#[path = "page.rs"]
mod page;

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: &'a str,
    cache: &'a str,
}

/// The trace route, which the application mounts itself: keys are data.
pub(crate) fn trace_router(node: Node) -> Router {
    Router::new()
        .route("/cache-sync/caches/{name}/trace", get(trace))
        .with_state(node)
}

#[derive(Deserialize)]
struct TraceQuery {
    key: Option<String>,
}

/// `GET /cache-sync/caches/{name}/trace?key=…`.
async fn trace(
    State(node): State<Node>,
    Path(name): Path<String>,
    Query(query): Query<TraceQuery>,
) -> Response {
    let fail = |status, error: &str| {
        (
            status,
            Json(ErrorBody {
                error,
                cache: &name,
            }),
        )
            .into_response()
    };
    let Some(key) = query.key else {
        return fail(StatusCode::BAD_REQUEST, "no key: ?key=… is required");
    };
    let Some(cache) = node.handle.shared.cache(&name) else {
        return fail(
            StatusCode::NOT_FOUND,
            "no cache of that name is registered on this node",
        );
    };
    match cache.trace_of(&key) {
        Ok(records) => Json(serde_json::json!({
            "cache": name,
            "key": key,
            "tracing": records.is_some(),
            "records": records.unwrap_or_default(),
        }))
        .into_response(),
        Err(e) => fail(StatusCode::BAD_REQUEST, &e),
    }
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

#[cfg(test)]
pub(super) mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;
    use crate::{SyncedCache, transport::EmbeddedTransport};

    pub(in crate::node) async fn node_with_cache() -> (Node, SyncedCache<String, String>) {
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
        let mut parsed: NodeStatus = serde_json::from_str(&text).unwrap();
        // The bound's age, the node's and each cache's, moves between two
        // looks (by a millisecond or so); the rest of the status is still.
        let mut now = node.status();
        for status in [&mut parsed, &mut now] {
            status.freshness_age_ms = None;
            for cache in &mut status.caches {
                cache.freshness_age_ms = None;
            }
        }
        assert_eq!(parsed, now);
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

    /// Keys are data: the status router has no trace route; the trace
    /// router, which the application mounts, shows a traced key's history.
    #[tokio::test]
    async fn traces_only_on_the_router_the_application_mounts() {
        let transport = EmbeddedTransport::new();
        let traced = SyncedCache::<String, String>::builder("traced", moka::future::Cache::new(10))
            .trace_bytes(1 << 16)
            .build()
            .unwrap();
        let ids = SyncedCache::<u64, String>::builder("ids", moka::future::Cache::new(10))
            .trace_bytes(1 << 16)
            .build()
            .unwrap();
        let plain = SyncedCache::<String, String>::new("plain", moka::future::Cache::new(10));
        let node = Node::builder("node-7", transport)
            .register(&traced)
            .register(&ids)
            .register(&plain)
            .start()
            .await
            .unwrap();
        node.publisher()
            .insert_versioned("traced", [("secret key", "v", Some(3))])
            .await
            .unwrap();
        crate::node::tests::eventually("applied", async || {
            traced.get("secret key").await.is_some()
        })
        .await;
        ids.insert(42, "x".into()).await;

        let response = node
            .status_router()
            .oneshot(
                Request::get("/cache-sync/caches/traced/trace?key=secret%20key")
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            StatusCode::NOT_FOUND,
            "no trace route among the status routes"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(!String::from_utf8_lossy(&body).contains("secret"));

        for key in ["secret%20key", "%22secret%20key%22"] {
            let uri = format!("/cache-sync/caches/traced/trace?key={key}");
            let (code, json, _) = get(node.trace_router(), &uri).await;
            assert_eq!(code, StatusCode::OK, "{json}");
            assert_eq!(json["tracing"].as_bool(), Some(true));
            let records = json["records"].as_array().unwrap();
            assert_eq!(records.last().unwrap()["event"], "refreshed", "{json}");
            assert_eq!(records.last().unwrap()["version"], 3);
        }
        let (code, json, _) = get(node.trace_router(), "/cache-sync/caches/ids/trace?key=42").await;
        assert_eq!(
            (
                code,
                json["records"]
                    .as_array()
                    .and_then(|r| r.last())
                    .and_then(|r| r["event"].as_str())
            ),
            (StatusCode::OK, Some("inserted"))
        );
        let (code, json, _) =
            get(node.trace_router(), "/cache-sync/caches/ids/trace?key=abc").await;
        assert_eq!(code, StatusCode::BAD_REQUEST, "{json}");
        let (code, json, _) =
            get(node.trace_router(), "/cache-sync/caches/plain/trace?key=k").await;
        assert_eq!(
            (code, json["tracing"].as_bool()),
            (StatusCode::OK, Some(false))
        );
        assert_eq!(json["records"], serde_json::json!([]));
        let (code, _, _) = get(node.trace_router(), "/cache-sync/caches/traced/trace").await;
        assert_eq!(code, StatusCode::BAD_REQUEST);
        let (code, json, _) = get(node.trace_router(), "/cache-sync/caches/nope/trace?key=k").await;
        assert_eq!(
            (code, json["cache"].as_str()),
            (StatusCode::NOT_FOUND, Some("nope"))
        );
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
}
