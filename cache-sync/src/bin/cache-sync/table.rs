//! The cluster table and the verdict `status` exits with.

use std::fmt::Write as _;
use std::time::Duration;

use cache_sync::cluster::ClusterView;

use crate::duration::show;

/// What `status` concludes from a view.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every live node is within `max_lag` of the newest version.
    Level,
    /// No live node at all: a probe must not pass on an empty cluster.
    Empty,
    /// These caches have been behind for longer than `max_lag`, one line
    /// each: `node cache: N versions behind for at least T` (how long is a
    /// lower bound: see `NodeCacheView::behind_ms`).
    Diverged(Vec<String>),
}

impl Verdict {
    /// 0 when level, 1 otherwise (2 is left to errors).
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            Verdict::Level => 0,
            Verdict::Empty | Verdict::Diverged(_) => 1,
        }
    }
}

pub(crate) fn verdict(view: &ClusterView, max_lag: Duration) -> Verdict {
    if view.nodes.is_empty() {
        return Verdict::Empty;
    }
    let diverged = view.diverged(max_lag);
    if diverged.is_empty() {
        return Verdict::Level;
    }
    Verdict::Diverged(
        diverged
            .into_iter()
            .map(|(node, cache, behind)| {
                let lag = cache.lag.unwrap_or(0);
                let since = if behind == Duration::MAX {
                    "for an unknown time".to_owned()
                } else {
                    format!("for at least {}", show(behind))
                };
                format!(
                    "{} {}: {lag} version{} behind {since}",
                    node.node_id,
                    cache.name,
                    if lag == 1 { "" } else { "s" }
                )
            })
            .collect(),
    )
}

const HEADER: [&str; 10] = [
    "NODE",
    "CACHE",
    "VERSION",
    "LAG",
    "BEHIND",
    "READY",
    "FRESH",
    "LOSSES",
    "HEARTBEAT",
    "AUDIT",
];

/// The table (FRESH: how fresh each node proves each cache, its own
/// proof's age or a CDC relay's lag added to it; a node's own where it
/// holds no cache): one row per node and cache (a node without caches gets one
/// row), the lagging ones marked with `*`, then the nodes gone lately.
pub(crate) fn render(view: &ClusterView) -> String {
    let mut rows: Vec<[String; 10]> = Vec::new();
    for node in &view.nodes {
        let mark = if node.lagging { "* " } else { "  " };
        let ready = match (node.ready, node.consuming) {
            (true, _) => "yes",
            (false, true) => "no",
            (false, false) => "no (not consuming)",
        };
        let age = show(Duration::from_millis(node.age_ms));
        // How old the node's freshness proof was when it sent the heartbeat
        // ("?": its transport tells no tail, or it proved nothing yet).
        let fresh =
            |age: Option<u64>| age.map_or_else(|| "?".into(), |ms| show(Duration::from_millis(ms)));
        let node_cells = |cache: String, version, lag, behind, fresh: String, audit| {
            [
                format!("{mark}{}", node.node_id),
                cache,
                version,
                lag,
                behind,
                ready.to_owned(),
                fresh,
                node.losses.to_string(),
                age.clone(),
                audit,
            ]
        };
        if node.caches.is_empty() {
            rows.push(node_cells(
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                fresh(node.freshness_age_ms),
                "-".into(),
            ));
        }
        for c in &node.caches {
            let version = c.version.map_or_else(|| "-".into(), |v| v.to_string());
            let lag = c.lag.map_or_else(|| "?".into(), |l| l.to_string());
            let behind = match (c.lag, c.behind_ms) {
                (Some(0), _) => "-".into(),
                (_, Some(ms)) => show(Duration::from_millis(ms)),
                (_, None) => "?".into(),
            };
            // Inconsistencies of checks over the auditor's window.
            let audit = c.audit.as_ref().map_or_else(
                || "-".into(),
                |a| {
                    // None found: a lower bound.
                    let at_least = if a.window_inconsistencies == 0 {
                        "≥ "
                    } else {
                        ""
                    };
                    let nines = a
                        .nines()
                        .map_or_else(String::new, |n| format!(", {at_least}{n:.1} nines"));
                    format!(
                        "{} of {} in {}{nines}",
                        a.window_inconsistencies,
                        a.window_checks,
                        show(Duration::from_secs(a.window_s))
                    )
                },
            );
            rows.push(node_cells(
                c.name.clone(),
                version,
                lag,
                behind,
                fresh(c.freshness_age_ms),
                audit,
            ));
        }
    }
    let mut out = String::new();
    let lagging = view.nodes.iter().filter(|n| n.lagging).count();
    let _ = writeln!(
        out,
        "topic {}: {} live node{}, {lagging} lagging, {} gone",
        view.topic,
        view.nodes.len(),
        if view.nodes.len() == 1 { "" } else { "s" },
        view.gone.len()
    );
    if view.nodes.is_empty() {
        out.push_str("no node answered\n");
    } else {
        let header = HEADER.map(String::from);
        // Widths in characters, not bytes, so that names in any script
        // line up as well as a monospace terminal allows.
        let mut widths = [0usize; 10];
        for row in std::iter::once(&header).chain(&rows) {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        for row in std::iter::once(&header).chain(&rows) {
            let mut line = String::new();
            for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
                if i > 0 {
                    line.push_str("  ");
                }
                line.push_str(cell);
                let pad = w.saturating_sub(cell.chars().count());
                line.extend(std::iter::repeat_n(' ', pad));
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
    for g in &view.gone {
        let ago = Duration::from_micros(view.at_us.saturating_sub(g.last_seen_at_us));
        let _ = writeln!(
            out,
            "gone: {} (last heartbeat {} ago)",
            g.node_id,
            show(ago)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use cache_sync::cluster::{GoneNode, NodeCacheView, NodeView};

    // The view types are `#[non_exhaustive]`: outside the library they are
    // built the way a client gets them, from JSON.
    fn cache(
        name: &str,
        version: Option<u64>,
        lag: Option<u64>,
        behind_ms: Option<u64>,
    ) -> NodeCacheView {
        serde_json::from_value(serde_json::json!({
            "name": name, "version": version, "lag": lag, "behind_ms": behind_ms,
            "entries": 3, "loss_resyncs": 0, "quarantined": false, "last_latency_us": null,
        }))
        .unwrap()
    }

    fn node(id: &str, caches: Vec<NodeCacheView>) -> NodeView {
        let lagging = caches.iter().any(|c| c.lag.unwrap_or(0) > 0);
        serde_json::from_value(serde_json::json!({
            "node_id": id, "transport": "redis-streams", "started_at_us": 1, "age_ms": 40,
            "interval_ms": 100, "consuming": true, "ready": true,
            "position": serde_json::to_value(cache_sync::transport::Position::default()).unwrap(),
            "losses": 2, "lagging": lagging, "caches": caches,
        }))
        .unwrap()
    }

    fn view(nodes: Vec<NodeView>, gone: Vec<(&str, u64)>) -> ClusterView {
        let gone: Vec<GoneNode> = gone
            .into_iter()
            .map(|(id, at)| {
                serde_json::from_value(serde_json::json!({"node_id": id, "last_seen_at_us": at}))
                    .unwrap()
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "observer": "cli", "topic": "cache-sync", "at_us": 10_000_000u64,
            "nodes": nodes, "gone": gone, "caches": [],
        }))
        .unwrap()
    }

    #[test]
    fn no_node_is_a_failure() {
        let v = view(vec![], vec![("old", 4_000_000)]);
        assert_eq!(verdict(&v, Duration::from_secs(10)), Verdict::Empty);
        assert_eq!(Verdict::Empty.exit_code(), 1);
        let table = render(&v);
        assert!(table.contains("no node answered"), "{table}");
        assert!(
            table.contains("gone: old (last heartbeat 6.0 s ago)"),
            "{table}"
        );
    }

    #[test]
    fn level_nodes_pass() {
        let v = view(
            vec![
                node("a", vec![cache("countries", Some(7), Some(0), Some(0))]),
                node("b", vec![]),
            ],
            vec![],
        );
        let verdict = verdict(&v, Duration::from_secs(10));
        assert_eq!(verdict, Verdict::Level);
        assert_eq!(verdict.exit_code(), 0);
        let table = render(&v);
        assert!(table.contains("2 live nodes, 0 lagging, 0 gone"), "{table}");
        assert!(table.lines().any(|l| l.starts_with("  b  ")), "{table}");
    }

    #[test]
    fn a_lagging_node_fails_only_beyond_max_lag() {
        let v = view(
            vec![
                node("a", vec![cache("countries", Some(9), Some(0), Some(0))]),
                node(
                    "slow",
                    vec![cache("countries", Some(7), Some(2), Some(1_500))],
                ),
            ],
            vec![],
        );
        assert_eq!(verdict(&v, Duration::from_secs(10)), Verdict::Level);
        let Verdict::Diverged(lines) = verdict(&v, Duration::from_secs(1)) else {
            panic!("1.5 s behind is beyond 1 s");
        };
        assert_eq!(
            lines,
            ["slow countries: 2 versions behind for at least 1.5 s"]
        );
        let table = render(&v);
        assert!(table.contains("* slow"), "{table}");
        assert!(table.contains("1 lagging"), "{table}");
    }

    #[test]
    fn behind_for_an_unknown_time_fails_any_max_lag() {
        let v = view(
            vec![node("n", vec![cache("c", None, Some(1), None)])],
            vec![],
        );
        let Verdict::Diverged(lines) = verdict(&v, Duration::from_secs(3600)) else {
            panic!("an unknown time counts as beyond any limit");
        };
        assert_eq!(lines, ["n c: 1 version behind for an unknown time"]);
        let table = render(&v);
        let row = table.lines().find(|l| l.contains("* n")).unwrap();
        assert!(row.contains(" ? "), "{table}");
    }

    /// The FRESH cell of the first row that contains `id`.
    fn fresh_cell(table: &str, id: &str) -> String {
        let header = table.lines().nth(1).unwrap();
        let at = header.chars().take(header.find("FRESH").unwrap()).count();
        let row = table.lines().find(|l| l.contains(id)).unwrap();
        row.chars().skip(at).take_while(|c| *c != ' ').collect()
    }

    #[test]
    fn freshness_shows_per_node_and_unknown_as_a_question_mark() {
        let mut proved = serde_json::to_value(node("proved", vec![])).unwrap();
        proved["freshness_age_ms"] = serde_json::json!(2_500);
        let proved: NodeView = serde_json::from_value(proved).unwrap();
        let table = render(&view(vec![proved, node("unproved", vec![])], vec![]));
        let fresh = |id: &str| fresh_cell(&table, id);
        assert_eq!(fresh("unproved"), "?", "{table}");
        assert_eq!(fresh("  proved"), "2.5", "{table}");

        // A cache's row shows the cache's own (a relay's lag added, or
        // unknown while one is awaited), not its node's.
        let mut caches = Vec::new();
        for (name, age) in [("relayed", Some(7_000)), ("awaiting", None)] {
            let mut c = serde_json::to_value(cache(name, Some(1), Some(0), None)).unwrap();
            c["freshness_age_ms"] = serde_json::json!(age);
            caches.push(serde_json::from_value::<NodeCacheView>(c).unwrap());
        }
        let mut n = serde_json::to_value(node("n1", caches)).unwrap();
        n["freshness_age_ms"] = serde_json::json!(100);
        let table = render(&view(vec![serde_json::from_value(n).unwrap()], vec![]));
        let fresh = |id: &str| fresh_cell(&table, id);
        assert_eq!(fresh("relayed"), "7.0", "{table}");
        assert_eq!(fresh("awaiting"), "?", "{table}");
    }

    #[test]
    fn gone_nodes_are_listed_and_do_not_count() {
        let v = view(
            vec![node("a", vec![cache("c", Some(1), Some(0), Some(0))])],
            vec![("b", 9_000_000)],
        );
        assert_eq!(verdict(&v, Duration::ZERO), Verdict::Level);
        assert!(render(&v).contains("gone: b (last heartbeat 1.0 s ago)"));
    }

    #[test]
    fn names_with_spaces_and_unicode_line_up() {
        let v = view(
            vec![
                node("nœud 1", vec![cache("Länder", Some(1), Some(0), Some(0))]),
                node("ノード 二", vec![cache("c", Some(1), Some(0), Some(0))]),
            ],
            vec![],
        );
        let table = render(&v);
        let rows: Vec<&str> = table.lines().skip(1).collect();
        // The CACHE column starts at the same character in every row.
        let at = |l: &str, what: &str| l.find(what).map(|b| l[..b].chars().count());
        assert_eq!(at(rows[0], "CACHE"), at(rows[1], "Länder"), "{table}");
        assert_eq!(at(rows[0], "CACHE"), at(rows[2], "c "), "{table}");
        assert!(table.contains("ノード 二"));
    }

    #[test]
    fn an_audited_cache_shows_its_findings() {
        let mut audited = cache("countries", Some(4), Some(0), Some(0));
        audited.audit = Some(
            serde_json::from_value(serde_json::json!({
                "checks": 1000, "suspects": 3, "suspects_cleared": 1, "suspects_pending": 0,
                "inconsistencies": 2, "repairs": 2, "unverified": 0, "source_reads": 10,
                "source_failures": 0, "sweeps": 1, "last_stale_age_ms": 13000,
                "max_stale_age_ms": 13000, "window_s": 3600, "window_checks": 1000,
                "window_inconsistencies": 2,
            }))
            .unwrap(),
        );
        let v = view(
            vec![
                node("a", vec![audited]),
                node("b", vec![cache("countries", Some(4), Some(0), Some(0))]),
            ],
            vec![],
        );
        let table = render(&v);
        let rows: Vec<&str> = table.lines().skip(1).collect();
        assert!(rows[0].ends_with("AUDIT"), "{table}");
        assert!(
            rows[1].ends_with("2 of 1000 in 1.0 h, 2.7 nines"),
            "{table}"
        );
        assert!(rows[2].ends_with(" -"), "{table}");
    }
}
