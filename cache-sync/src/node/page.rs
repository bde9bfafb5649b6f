//! The cluster page, `GET /cache-sync/`: the cluster view of
//! `GET /cache-sync/cluster` as HTML for people, with the nodes that lag or
//! are not ready highlighted (by class, and in words).
//!
//! Its size is bounded whatever the cluster: a table of the caches (newest
//! version, holders, how many behind and for how long), 100 a page
//! (`?caches=N`); then the nodes, lagging ones first, 50 a page
//! (`?page=N`): with up to 20 caches, a column per cache; past that, each
//! node lists its lagging caches, at most 10 ("and 4 more"). Every cell is
//! found through a map, so a page costs `O(n·c)` for the whole view at
//! most. The nodes gone lately are listed up to 50, the latest first.
//!
//! The template (`templates/cluster.html`) is compiled in by askama, which
//! escapes everything it prints for HTML: node ids and cache names are
//! whatever some node put in its heartbeat. Everything the template shows
//! is worked out here, as text, so it holds no logic beyond ifs and loops.

use std::cmp::Reverse;

use askama::Template;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use super::Node;
use crate::cluster::{ClusterView, NodeCacheView, NodeView};
use crate::util::HashMap;

/// How often the page reloads itself, in seconds: a couple of heartbeat
/// intervals at the default, without hammering a node that many people
/// watch.
const REFRESH_SECS: u32 = 2;
/// Nodes per page of the node table (`?page=N`).
const NODES_PER_PAGE: usize = 50;
/// Up to this many caches, the node table has a column per cache; past
/// it, each node lists only its lagging caches.
const MAX_GRID_CACHES: usize = 20;
/// Lagging caches listed per node past `MAX_GRID_CACHES`; the rest are
/// counted ("and 4 more").
const MAX_LISTED: usize = 10;
/// Caches per page of the cache table (`?caches=N`).
const CACHES_PER_PAGE: usize = 100;
/// Gone nodes listed, the latest first; the rest are counted.
const MAX_GONE_LISTED: usize = 50;

#[derive(Template)]
#[template(path = "cluster.html")]
struct ClusterPage<'a> {
    observer: &'a str,
    topic: &'a str,
    /// The view's time of day, UTC.
    at: String,
    converged: bool,
    refresh_secs: u32,
    live: usize,
    lagging: usize,
    /// Per cache, this page's share.
    caches: Vec<Summary<'a>>,
    cache_pages: Pager,
    /// A column per cache (few caches), or a list of each node's lagging
    /// caches.
    grid: bool,
    /// The columns, in grid mode.
    columns: Vec<Column<'a>>,
    /// This page's nodes, the lagging first.
    rows: Vec<Row<'a>>,
    node_pages: Pager,
    gone: Vec<Gone<'a>>,
    gone_total: usize,
    /// Gone nodes not listed.
    gone_more: usize,
}

/// Where a table's page sits among its pages, with links to its
/// neighbours (query strings, the other table's page kept).
struct Pager {
    page: usize,
    pages: usize,
    /// 1-based, inclusive; `first > last` when there is nothing.
    first: usize,
    last: usize,
    total: usize,
    prev: Option<String>,
    next: Option<String>,
}

/// A cache across the live nodes: one row of the cache table.
struct Summary<'a> {
    name: &'a str,
    newest: String,
    holders: usize,
    behind: usize,
    /// The longest any holder has been behind, or empty.
    longest: String,
}

/// A cache: one column, in grid mode.
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
    /// Caches it holds, and of those behind.
    held: usize,
    behind: usize,
    /// Grid mode: one per column, in the columns' order. List mode: its
    /// lagging caches, the longest behind first, at most `MAX_LISTED`.
    cells: Vec<Cell<'a>>,
    /// List mode: lagging caches not listed.
    more: usize,
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
    /// The auditor's findings in words, empty where the cache is not
    /// audited; `inconsistent` when it found any in its window.
    audit: String,
    inconsistent: bool,
}

struct Gone<'a> {
    id: &'a str,
    ago: String,
}

pub(super) async fn cluster_page(State(node): State<Node>, RawQuery(query): RawQuery) -> Response {
    let (page, cache_page) = pages(query.as_deref());
    match render(&node.cluster().view(), page, cache_page) {
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

/// The node page (`page`) and the cache page (`caches`) asked for, 1 for
/// anything missing or unreadable (a page past the last shows the last).
fn pages(query: Option<&str>) -> (usize, usize) {
    let (mut page, mut caches) = (1, 1);
    for pair in query.unwrap_or("").split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let n = value.parse::<usize>().unwrap_or(1).max(1);
        match key {
            "page" => page = n,
            "caches" => caches = n,
            _ => {}
        }
    }
    (page, caches)
}

/// `items` cut into pages of `per`: the page asked for (clamped), its
/// 1-based range, and the links either side.
fn pager(total: usize, per: usize, asked: usize, link: impl Fn(usize) -> String) -> Pager {
    let pages = total.div_ceil(per).max(1);
    let page = asked.clamp(1, pages);
    let skip = page.saturating_sub(1).saturating_mul(per);
    Pager {
        page,
        pages,
        first: skip.saturating_add(1),
        last: skip.saturating_add(per).min(total),
        total,
        prev: (page > 1).then(|| link(page.saturating_sub(1))),
        next: (page < pages).then(|| link(page.saturating_add(1))),
    }
}

fn render(view: &ClusterView, page: usize, cache_page: usize) -> askama::Result<String> {
    // Per cache, the longest any holder has been behind: one pass.
    let mut longest: HashMap<&str, u64> = HashMap::default();
    for n in &view.nodes {
        for c in n.caches.iter().filter(|c| c.lag.unwrap_or(0) > 0) {
            let l = longest.entry(c.name.as_str()).or_insert(0);
            *l = (*l).max(c.behind_ms.unwrap_or(u64::MAX));
        }
    }
    // Caches with nodes behind first, then by name.
    let mut summaries: Vec<_> = view.caches.iter().collect();
    summaries.sort_by_key(|c| (c.behind == 0, c.name.as_str()));
    let node_pages = pager(view.nodes.len(), NODES_PER_PAGE, page, |p| {
        format!("?page={p}&caches={cache_page}")
    });
    let cache_pages = pager(summaries.len(), CACHES_PER_PAGE, cache_page, |p| {
        format!("?page={}&caches={p}", node_pages.page)
    });
    let caches = summaries
        .into_iter()
        .skip(cache_pages.first.saturating_sub(1))
        .take(CACHES_PER_PAGE)
        .map(|c| Summary {
            name: &c.name,
            newest: version(c.newest_version, "unknown"),
            holders: c.nodes,
            behind: c.behind,
            longest: longest
                .get(c.name.as_str())
                .map_or_else(String::new, |&ms| {
                    if ms == u64::MAX {
                        "an unknown time".to_owned()
                    } else {
                        human_ms(ms)
                    }
                }),
        })
        .collect();
    let grid = view.caches.len() <= MAX_GRID_CACHES;
    let columns: Vec<Column<'_>> = if grid {
        view.caches
            .iter()
            .map(|c| Column {
                name: &c.name,
                newest: version(c.newest_version, "unknown"),
                nodes: c.nodes,
                behind: c.behind,
            })
            .collect()
    } else {
        Vec::new()
    };
    // Lagging nodes first, then by id.
    let mut nodes: Vec<&NodeView> = view.nodes.iter().collect();
    nodes.sort_by_key(|n| (!n.lagging, n.node_id.as_str()));
    let rows = nodes
        .into_iter()
        .skip(node_pages.first.saturating_sub(1))
        .take(NODES_PER_PAGE)
        .map(|n| row(n, &view.observer, grid.then_some(&columns[..])))
        .collect();
    let mut gone: Vec<_> = view.gone.iter().collect();
    gone.sort_by_key(|g| (Reverse(g.last_seen_at_us), g.node_id.as_str()));
    let gone_total = gone.len();
    let gone = gone
        .into_iter()
        .take(MAX_GONE_LISTED)
        .map(|g| Gone {
            id: &g.node_id,
            ago: human_ms(view.at_us.saturating_sub(g.last_seen_at_us) / 1000),
        })
        .collect::<Vec<_>>();
    ClusterPage {
        observer: &view.observer,
        topic: &view.topic,
        at: time_of_day(view.at_us),
        converged: view.is_converged(),
        refresh_secs: REFRESH_SECS,
        live: view.nodes.len(),
        lagging: view.nodes.iter().filter(|n| n.lagging).count(),
        caches,
        cache_pages,
        grid,
        columns,
        rows,
        node_pages,
        gone_more: gone_total.saturating_sub(gone.len()),
        gone,
        gone_total,
    }
    .render()
}

/// "v5", or `none` without a version.
fn version(v: Option<u64>, none: &str) -> String {
    v.map_or_else(|| none.to_owned(), |v| format!("v{v}"))
}

/// A node's row: with `columns` a cell per column, each found through a
/// map of the node's caches; without, its lagging caches.
fn row<'a>(n: &'a NodeView, observer: &str, columns: Option<&[Column<'a>]>) -> Row<'a> {
    let behind = n.caches.iter().filter(|c| c.lag.unwrap_or(0) > 0).count();
    let marker = match (n.ready, behind) {
        (false, 0) => "lagging: not ready".to_owned(),
        (false, b) => format!("lagging: not ready, {b} cache(s) behind"),
        (true, b) => format!("lagging: {b} cache(s) behind"),
    };
    let (cells, more) = match columns {
        Some(columns) => {
            let held: HashMap<&str, &NodeCacheView> =
                n.caches.iter().map(|c| (c.name.as_str(), c)).collect();
            let cells = columns
                .iter()
                .map(|col| match held.get(col.name) {
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
                        audit: String::new(),
                        inconsistent: false,
                    },
                })
                .collect();
            (cells, 0)
        }
        None => {
            let mut lagging: Vec<&NodeCacheView> =
                n.caches.iter().filter(|c| c.lag.unwrap_or(0) > 0).collect();
            // The longest behind first (unknown counts as longest).
            lagging.sort_by_key(|c| (Reverse(c.behind_ms.unwrap_or(u64::MAX)), c.name.as_str()));
            let more = lagging.len().saturating_sub(MAX_LISTED);
            (
                lagging.into_iter().take(MAX_LISTED).map(cell).collect(),
                more,
            )
        }
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
        held: n.caches.len(),
        behind,
        cells,
        more,
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
        version: version(c.version, "no version"),
        lag,
        entries: c.entries,
        resyncs: c.loss_resyncs,
        quarantined: c.quarantined,
        audit: c.audit.as_ref().map_or_else(String::new, audit_words),
        inconsistent: c
            .audit
            .as_ref()
            .is_some_and(|a| a.window_inconsistencies > 0),
    }
}

/// "audited: 2 inconsistent in 10000 checks over 1 h (3.7 nines); 1
/// suspect pending".
pub(crate) fn audit_words(a: &crate::status::AuditStatus) -> String {
    let window = human_ms(a.window_s.saturating_mul(1000));
    // None found: the figure is what the checks can show, a lower bound.
    let at_least = if a.window_inconsistencies == 0 {
        "≥ "
    } else {
        ""
    };
    let nines = a
        .nines()
        .map_or_else(String::new, |n| format!(" ({at_least}{n:.1} nines)"));
    let mut words = format!(
        "audited: {} inconsistent in {} checks over {window}{nines}",
        a.window_inconsistencies, a.window_checks
    );
    if a.suspects_pending > 0 {
        words.push_str(&format!("; {} suspect(s) pending", a.suspects_pending));
    }
    if a.source_failures > 0 {
        words.push_str(&format!("; {} failed source read(s)", a.source_failures));
    }
    words
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
    use crate::{SyncedCache, transport::EmbeddedTransport};

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
            freshness_age_ms: None,
            audit: None,
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
            freshness_age_ms: Some(5),
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
        let html = render(&view, 1, 1).unwrap();
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

    /// A heartbeat of `id` holding caches `c000`.. `c{caches - 1}`, the
    /// first `behind` of them one version behind the others.
    fn crafted(id: &str, caches: usize, behind: usize) -> crate::cluster::Heartbeat {
        crate::cluster::Heartbeat {
            node_id: id.into(),
            topic: "cache-sync".into(),
            started_at_us: 1,
            sent_at_us: 2,
            interval_ms: 60_000,
            transport: "embedded".into(),
            consuming: true,
            ready: true,
            position: crate::transport::Position::default(),
            losses: 0,
            live_nodes: None,
            freshness_age_ms: None,
            caches: (0..caches)
                .map(|i| crate::cluster::CacheHeartbeat {
                    name: format!("c{i:03}"),
                    version: Some(if i < behind { 99 } else { 100 }),
                    version_at_us: None,
                    version_age_ms: None,
                    entries: 10,
                    loss_resyncs: 0,
                    quarantined: false,
                    last_latency_us: None,
                    freshness_age_ms: None,
                    audit: None,
                })
                .collect(),
        }
    }

    fn watcher() -> crate::cluster::Cluster {
        crate::cluster::Cluster::new(
            "watcher".into(),
            "cache-sync".into(),
            std::sync::Arc::new(EmbeddedTransport::new()),
            crate::wire::Codec::new(1 << 20, None),
            std::time::Duration::from_secs(2),
            None,
            None,
        )
    }

    /// 1,000 nodes by 100 caches, every other node lagging on 30 caches:
    /// the page stays small and quick, the lagging nodes first, each
    /// listing 10 of its lagging caches and counting the rest.
    #[test]
    fn a_thousand_nodes_by_a_hundred_caches_make_a_small_page_quickly() {
        let cluster = watcher();
        let started = std::time::Instant::now();
        for i in 0..1_000 {
            let behind = if i % 2 == 0 { 30 } else { 0 };
            cluster.observe(crafted(&format!("node-{i:04}"), 100, behind));
        }
        let taken_in = started.elapsed();
        let started = std::time::Instant::now();
        let view = cluster.view();
        let html = render(&view, 1, 1).unwrap();
        let rendered = started.elapsed();
        eprintln!(
            "1,000 heartbeats taken in: {taken_in:?}; view and page: {rendered:?}, {} bytes",
            html.len()
        );
        assert!(html.len() <= 512 << 10, "{} bytes", html.len());
        // Generous for a debug build on a busy machine; a quadratic view
        // and page would take seconds at a small fraction of this.
        assert!(
            rendered <= std::time::Duration::from_secs(2),
            "{rendered:?}"
        );
        assert!(
            taken_in <= std::time::Duration::from_secs(5),
            "{taken_in:?}"
        );
        assert_eq!(html.matches("<tr class=\"node lagging\"").count(), 50);
        assert_eq!(html.matches("<tr class=\"node\"").count(), 0);
        assert!(html.contains("data-node=\"node-0000\""));
        assert!(html.contains("30 of 100 held behind"), "{html}");
        assert_eq!(html.matches("and 20 more").count(), 50);
        assert!(html.contains("page 1 of 20"), "{html}");
        assert!(html.contains("Caches 1–100 of 100") || !html.contains("id=\"cache-pages\""));
        // The cache table: the 30 lagging caches first, 100 of 100 held.
        assert!(html.contains("500 of 1000 behind"), "{html}");
        // Past the last page, the last.
        let html = render(&view, 99, 1).unwrap();
        assert!(html.contains("page 20 of 20"), "{html}");
        assert_eq!(html.matches("<tr class=\"node\"").count(), 50);
        assert!(html.contains("href=\"?page=19&#38;caches=1\""), "{html}");
    }

    #[test]
    fn many_caches_page_too() {
        let cluster = watcher();
        cluster.observe(crafted("a", 250, 120));
        cluster.observe(crafted("b", 250, 0));
        let view = cluster.view();
        let html = render(&view, 1, 3).unwrap();
        assert!(html.contains("Caches 201–250 of 250"), "{html}");
        assert_eq!(html.matches("<tr class=\"summary\"").count(), 50);
        let html = render(&view, 1, 1).unwrap();
        assert_eq!(html.matches("<tr class=\"summary behind\"").count(), 100);
        assert!(html.contains("href=\"?page=1&#38;caches=2\""), "{html}");
        // Few nodes, many caches: no grid.
        assert!(!html.contains("not held"));
        assert!(html.contains("and 110 more"), "{html}");
        assert_eq!(pages(Some("page=3&caches=x&other=1")), (3, 1));
        assert_eq!(pages(Some("page=0")), (1, 1));
        assert_eq!(pages(None), (1, 1));
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
