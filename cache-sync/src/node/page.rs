//! The cluster page, `GET /cache-sync/`: the cluster view of
//! `GET /cache-sync/cluster` as an HTML table for people, nodes by caches,
//! with the nodes that lag or are not ready highlighted.
//!
//! The template (`templates/cluster.html`) is compiled in by askama, which
//! escapes everything it prints for HTML: node ids and cache names are
//! whatever some node put in its heartbeat. Everything the template shows
//! is worked out here, as text, so it holds no logic beyond ifs and loops.

use askama::Template;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use super::Node;
use crate::cluster::{ClusterView, NodeCacheView, NodeView};

/// How often the page reloads itself, in seconds: a couple of heartbeat
/// intervals at the default, without hammering a node that many people
/// watch.
const REFRESH_SECS: u32 = 2;

#[derive(Template)]
#[template(path = "cluster.html")]
struct ClusterPage<'a> {
    observer: &'a str,
    topic: &'a str,
    /// The view's time of day, UTC.
    at: String,
    converged: bool,
    refresh_secs: u32,
    columns: Vec<Column<'a>>,
    rows: Vec<Row<'a>>,
    gone: Vec<Gone<'a>>,
}

/// A cache: one column.
struct Column<'a> {
    name: &'a str,
    newest: String,
    nodes: usize,
    behind: usize,
}

/// A live node: one row.
struct Row<'a> {
    id: &'a str,
    transport: &'a str,
    is_observer: bool,
    ready: bool,
    consuming: bool,
    lagging: bool,
    /// Why it is highlighted, in words, so that it is not colour alone.
    marker: String,
    age: String,
    interval: String,
    losses: u64,
    /// One per column, in the columns' order.
    cells: Vec<Cell<'a>>,
}

/// A cache on a node.
struct Cell<'a> {
    name: &'a str,
    /// Whether the node holds this cache at all.
    held: bool,
    lagging: bool,
    /// "v5", or "no version" before the first versioned event.
    version: String,
    /// "level", "behind by 4 for 1.2 s", or "no node has a version yet".
    lag: String,
    entries: u64,
    resyncs: u64,
    quarantined: bool,
}

struct Gone<'a> {
    id: &'a str,
    ago: String,
}

pub(super) async fn cluster_page(State(node): State<Node>) -> Response {
    match render(&node.cluster().view()) {
        Ok(html) => Html(html).into_response(),
        Err(e) => {
            // Only a formatting error can land here (askama checked the
            // template when the crate was built).
            tracing::warn!(error = %e, "cluster page: rendering failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the cluster page could not be rendered; GET /cache-sync/cluster has the same view as JSON",
            )
                .into_response()
        }
    }
}

fn render(view: &ClusterView) -> askama::Result<String> {
    let columns: Vec<Column<'_>> = view
        .caches
        .iter()
        .map(|c| Column {
            name: &c.name,
            newest: c
                .newest_version
                .map_or_else(|| "unknown".to_owned(), |v| format!("v{v}")),
            nodes: c.nodes,
            behind: c.behind,
        })
        .collect();
    let rows = view
        .nodes
        .iter()
        .map(|n| row(n, &view.observer, &columns))
        .collect();
    let gone = view
        .gone
        .iter()
        .map(|g| Gone {
            id: &g.node_id,
            ago: human_ms(view.at_us.saturating_sub(g.last_seen_at_us) / 1000),
        })
        .collect();
    ClusterPage {
        observer: &view.observer,
        topic: &view.topic,
        at: time_of_day(view.at_us),
        converged: view.is_converged(),
        refresh_secs: REFRESH_SECS,
        columns,
        rows,
        gone,
    }
    .render()
}

fn row<'a>(n: &'a NodeView, observer: &str, columns: &[Column<'a>]) -> Row<'a> {
    let behind = n.caches.iter().filter(|c| c.lag.unwrap_or(0) > 0).count();
    let marker = match (n.ready, behind) {
        (false, 0) => "lagging: not ready".to_owned(),
        (false, b) => format!("lagging: not ready, {b} cache(s) behind"),
        (true, b) => format!("lagging: {b} cache(s) behind"),
    };
    Row {
        id: &n.node_id,
        transport: &n.transport,
        is_observer: n.node_id == observer,
        ready: n.ready,
        consuming: n.consuming,
        lagging: n.lagging,
        marker,
        age: human_ms(n.age_ms),
        interval: human_ms(n.interval_ms),
        losses: n.losses,
        cells: columns
            .iter()
            .map(|col| match n.caches.iter().find(|c| c.name == col.name) {
                Some(c) => cell(c),
                None => Cell {
                    name: col.name,
                    held: false,
                    lagging: false,
                    version: String::new(),
                    lag: String::new(),
                    entries: 0,
                    resyncs: 0,
                    quarantined: false,
                },
            })
            .collect(),
    }
}

fn cell(c: &NodeCacheView) -> Cell<'_> {
    let lag = match (c.lag, c.behind_ms) {
        (None, _) => "no node has a version yet".to_owned(),
        (Some(0), _) => "level".to_owned(),
        (Some(l), Some(ms)) => format!("behind by {l} for {}", human_ms(ms)),
        (Some(l), None) => format!("behind by {l}"),
    };
    Cell {
        name: &c.name,
        held: true,
        lagging: c.lag.unwrap_or(0) > 0,
        version: c
            .version
            .map_or_else(|| "no version".to_owned(), |v| format!("v{v}")),
        lag,
        entries: c.entries,
        resyncs: c.loss_resyncs,
        quarantined: c.quarantined,
    }
}

/// "850 ms", "4.2 s", "3 min 5 s", "2 h 10 min": precise where it matters
/// (a heartbeat late by a second), short where it does not.
fn human_ms(ms: u64) -> String {
    const MIN: u64 = 60_000;
    const HOUR: u64 = 60 * MIN;
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < MIN {
        format!("{}.{} s", ms / 1000, ms % 1000 / 100)
    } else if ms < HOUR {
        format!("{} min {} s", ms / MIN, ms % MIN / 1000)
    } else {
        format!("{} h {} min", ms / HOUR, ms % HOUR / MIN)
    }
}

/// "14:03:07 UTC", from microseconds since the Unix epoch: enough to see
/// the page move on at each reload.
fn time_of_day(at_us: u64) -> String {
    let secs = at_us / 1_000_000 % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::{Request, header};
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::*;
    use crate::{EmbeddedTransport, SyncedCache};

    async fn get(node: &Node, uri: &str) -> (StatusCode, String, String) {
        let response = node
            .status_router()
            .oneshot(Request::get(uri).body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            content_type,
            String::from_utf8(bytes.to_vec()).unwrap(),
        )
    }

    async fn until_seen(nodes: &[&Node], count: usize) {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while nodes.iter().any(|n| n.cluster().nodes().len() < count) {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the nodes never saw each other");
    }

    #[tokio::test]
    async fn an_html_page_lists_every_node_and_no_key_or_value() {
        let transport = EmbeddedTransport::new();
        let a = SyncedCache::<String, String>::new("countries", moka::future::Cache::new(10));
        let b = SyncedCache::<String, String>::new("countries", moka::future::Cache::new(10));
        let other = SyncedCache::<String, String>::new("flags", moka::future::Cache::new(10));
        let every = std::time::Duration::from_millis(50);
        let n1 = Node::builder("node-a", transport.clone())
            .heartbeat_interval(every)
            .register(&a)
            .start()
            .await
            .unwrap();
        let n2 = Node::builder("node-b", transport.clone())
            .heartbeat_interval(every)
            .register(&b)
            .register(&other)
            .start()
            .await
            .unwrap();
        a.insert("secret-key-123".into(), "secret-value-456".into())
            .await;
        until_seen(&[&n1, &n2], 2).await;
        for uri in ["/cache-sync/", "/cache-sync"] {
            let (code, content_type, html) = get(&n1, uri).await;
            assert_eq!(code, StatusCode::OK, "{uri}");
            assert!(
                content_type.starts_with("text/html"),
                "{uri}: {content_type}"
            );
            assert!(html.starts_with("<!DOCTYPE html>"), "{html}");
            for id in ["node-a", "node-b"] {
                assert!(
                    html.contains(&format!("data-node=\"{id}\"")),
                    "{id}: {html}"
                );
            }
            for cache in ["countries", "flags"] {
                assert!(html.contains(&format!("data-cache=\"{cache}\"")), "{html}");
            }
            // node-a holds no "flags": its cell says so.
            assert!(html.contains("not held"), "{html}");
            // No versioned event yet: said so, not printed as a number.
            assert!(html.contains("no version</span>"), "{html}");
            assert!(html.contains("no node has a version yet"), "{html}");
            assert!(html.contains("<meta http-equiv=\"refresh\""), "{html}");
            assert!(html.contains("(this node)"), "{html}");
            assert!(!html.contains("secret"), "a key or value leaked: {html}");
            // Inline only: nothing fetched from elsewhere.
            assert!(!html.contains("src="), "{html}");
            assert!(!html.contains("<link"), "{html}");
        }
        for n in [n1, n2] {
            n.shutdown().await.unwrap();
        }
    }

    #[tokio::test]
    async fn node_ids_and_cache_names_are_escaped() {
        const EVIL: &str = "<script>alert(\"x\")</script>";
        let transport = EmbeddedTransport::new();
        let c = SyncedCache::<String, String>::new(EVIL, moka::future::Cache::new(10));
        let node = Node::builder(EVIL, transport)
            .register(&c)
            .start()
            .await
            .unwrap();
        let (code, _, html) = get(&node, "/cache-sync/").await;
        assert_eq!(code, StatusCode::OK);
        assert!(!html.contains("<script"), "not escaped: {html}");
        assert!(!html.contains("\"x\""), "quotes not escaped: {html}");
        // Shown, escaped: in text (title, heading, row, column) and in the
        // data-node and data-cache attributes.
        let escaped = "&#60;script&#62;alert(&#34;x&#34;)&#60;/script&#62;";
        assert!(
            html.matches(escaped).count() >= 4,
            "expected the escaped name several times: {html}"
        );
        node.shutdown().await.unwrap();
    }

    #[test]
    fn a_lagging_node_is_marked_in_words_and_by_class() {
        use crate::cluster::{CacheSummary, GoneNode};
        use crate::transport::Position;
        let cache = |version, lag, behind_ms| NodeCacheView {
            name: "countries".into(),
            version: Some(version),
            lag: Some(lag),
            behind_ms: Some(behind_ms),
            entries: 3,
            loss_resyncs: 1,
            quarantined: false,
            last_latency_us: None,
        };
        let node = |id: &str, ready, c: NodeCacheView| NodeView {
            node_id: id.into(),
            transport: "embedded".into(),
            started_at_us: 0,
            age_ms: 120,
            interval_ms: 100,
            consuming: true,
            ready,
            position: Position::default(),
            losses: 0,
            lagging: !ready || c.lag.unwrap_or(0) > 0,
            caches: vec![c],
        };
        let view = ClusterView {
            observer: "n1".into(),
            topic: "cache-sync".into(),
            at_us: 3_600_000_000 + 61_000_000,
            nodes: vec![
                node("n1", true, cache(9, 0, 0)),
                node("n2", false, cache(9, 0, 0)),
                node("n3", true, cache(5, 4, 1_500)),
            ],
            gone: vec![GoneNode {
                node_id: "n0".into(),
                last_seen_at_us: 3_600_000_000,
            }],
            caches: vec![CacheSummary {
                name: "countries".into(),
                newest_version: Some(9),
                nodes: 3,
                behind: 1,
            }],
        };
        let html = render(&view).unwrap();
        assert!(
            html.contains("<tr class=\"node\" data-node=\"n1\">"),
            "{html}"
        );
        assert!(html.contains("<tr class=\"node lagging\" data-node=\"n2\">"));
        assert!(html.contains("<tr class=\"node lagging\" data-node=\"n3\">"));
        assert!(html.contains("lagging: not ready</span>"), "{html}");
        assert!(html.contains("lagging: 1 cache(s) behind"), "{html}");
        assert!(html.contains("<td class=\"cache lagging\" data-cache=\"countries\">"));
        assert!(html.contains("behind by 4 for 1.5 s"), "{html}");
        assert!(html.contains(">v5</span>"), "{html}");
        assert_eq!(html.matches("class=\"cache lagging\"").count(), 1);
        assert!(html.contains("n0: last heartbeat 1 min 1 s ago"), "{html}");
        assert!(html.contains("at 01:01:01 UTC"), "{html}");
        assert!(html.contains("1 of 3 behind"), "{html}");
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(human_ms(0), "0 ms");
        assert_eq!(human_ms(999), "999 ms");
        assert_eq!(human_ms(1_000), "1.0 s");
        assert_eq!(human_ms(4_250), "4.2 s");
        assert_eq!(human_ms(185_000), "3 min 5 s");
        assert_eq!(human_ms(7_800_000), "2 h 10 min");
        assert_eq!(
            human_ms(u64::MAX),
            format!("{} h 25 min", u64::MAX / 3_600_000)
        );
        assert_eq!(time_of_day(0), "00:00:00 UTC");
    }
}
