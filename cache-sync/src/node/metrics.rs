//! `GET /metrics`: the node's counters in the Prometheus text format.
//!
//! Nothing is counted twice: the families are built at scrape time from the
//! same snapshot `GET /cache-sync/status` serves ([`Node::status_settled`]),
//! through a [`Collector`], so the apply and read paths keep their existing
//! counters and pay nothing more for metrics (but for the latency
//! histogram, observed once per run of events). prometheus-client encodes
//! everything: names, the `_total` suffix of counters, label escaping.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::Node;
use super::cluster_metrics::register_cluster_metrics;
use crate::status::{AuditStatus, CacheStatus, NodeStatus};

/// Every family's name starts with this (and `_`).
const PREFIX: &str = "cache_sync";

/// The `Content-Type` of what [`render`] returns: the Prometheus text
/// format, version 0.0.4, as prometheus-client documents it.
pub(super) const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The whole exposition, as of now.
pub(super) async fn render(node: &Node) -> Result<String, std::fmt::Error> {
    let status = node.status_settled().await;
    let mut latencies: Vec<_> = node
        .handle
        .shared
        .caches()
        .values()
        .map(|c| (c.name().to_owned(), c.latency().histogram().clone()))
        .collect();
    latencies.sort_by(|a, b| a.0.cmp(&b.0));
    let mut registry = Registry::with_prefix(PREFIX);
    let ready = node.is_ready();
    registry.register_collector(Box::new(NodeCollector {
        status,
        ready,
        latencies,
        lateness: node.handle.shared.lateness.histogram().clone(),
    }));
    register_cluster_metrics(&mut registry, node);
    let mut text = String::new();
    prometheus_text::encode(&mut text, &registry)?;
    Ok(text)
}

/// One scrape's snapshot: the node's status and each cache's latency
/// histogram (shared handles, read when encoded).
#[derive(Debug)]
struct NodeCollector {
    status: NodeStatus,
    ready: bool,
    /// By cache name, sorted.
    latencies: Vec<(String, Histogram)>,
    /// How late the runtime ran the node's timer (`lateness.rs`).
    lateness: Histogram,
}

/// A per-cache counter: family name (no `_total`: the encoder adds it),
/// help, and the field it reads.
type CacheCounter = (&'static str, &'static str, fn(&CacheStatus) -> u64);

const CACHE_COUNTERS: [CacheCounter; 20] = [
    (
        "cache_events_applied",
        "Events applied to the cache.",
        |c| c.events_applied,
    ),
    (
        "cache_events_rejected",
        "Events for the cache that could not be applied in full (unreadable, undecodable keys, and per value, undecodable refresh values).",
        |c| c.rejected_events,
    ),
    (
        "cache_stale_ignored",
        "Refreshes ignored because the cache already reflects a newer version.",
        |c| c.stale_ignored,
    ),
    ("cache_refreshes", "Entries updated by events.", |c| {
        c.refreshes
    }),
    ("cache_invalidations", "Keys removed by events.", |c| {
        c.invalidations
    }),
    ("cache_clears", "Clear events applied.", |c| c.clears),
    (
        "cache_refresh_fallbacks",
        "Refreshes whose value did not decode, applied as invalidations.",
        |c| c.refresh_fallbacks,
    ),
    (
        "cache_coalesced",
        "Refreshes skipped because a later entry of the same backlog overrides them.",
        |c| c.coalesced,
    ),
    (
        "cache_refreshes_quarantined",
        "Versioned refreshes applied as invalidations during the quarantine after a loss or registration.",
        |c| c.refreshes_quarantined,
    ),
    (
        "cache_writes_parked",
        "Event writes that waited for a pinned load of their key.",
        |c| c.writes_parked,
    ),
    (
        "cache_loss_resyncs",
        "Times the whole cache was invalidated because a change may have been missed.",
        |c| c.loss_resyncs,
    ),
    ("cache_hits", "Reads that found a value.", |c| c.hits),
    ("cache_misses", "Reads that did not find a value.", |c| {
        c.misses
    }),
    ("cache_loads", "Loader runs.", |c| c.loads),
    (
        "cache_load_failures",
        "Loader runs that returned an error.",
        |c| c.load_failures,
    ),
    (
        "cache_loads_superseded",
        "Load results discarded because the key changed while they ran.",
        |c| c.loads_superseded,
    ),
    (
        "cache_loads_stale",
        "Versioned loads not cached because their version was or might have been older than one the node knew.",
        |c| c.loads_stale,
    ),
    (
        "cache_fresh_reads",
        "Forced-fresh reads, each of which ran the loader whatever the cache held.",
        |c| c.fresh_reads,
    ),
    (
        "cache_stale_bypasses",
        "Reads past the cache's staleness bound that went to the source rather than memory.",
        |c| c.stale_bypasses,
    ),
    (
        "cache_stale_served",
        "Reads past the cache's staleness bound served from memory all the same.",
        |c| c.stale_served,
    ),
];

/// A per-cache gauge: family name, help, and the field it reads; a cache
/// whose field is `None` has no sample.
type CacheGauge = (&'static str, &'static str, fn(&CacheStatus) -> Option<u64>);

const CACHE_GAUGES: [CacheGauge; 4] = [
    (
        "cache_entries",
        "Entries held, as moka counts them (approximate).",
        |c| Some(c.entries),
    ),
    (
        "cache_tracked_keys",
        "Per-key version records held (bounded).",
        |c| Some(c.tracked_keys),
    ),
    (
        "cache_version",
        "The highest entry version in the events taken in for the cache; only caches that have seen a versioned event have a sample.",
        |c| c.version,
    ),
    (
        "cache_quarantined",
        "1 while versioned refreshes are applied as invalidations, after a loss or a late registration.",
        |c| Some(u64::from(c.quarantined)),
    ),
];

/// A per-cache counter of the consistency auditor, as [`CacheCounter`];
/// only audited caches have a sample.
type AuditCounter = (&'static str, &'static str, fn(&AuditStatus) -> u64);

const AUDIT_COUNTERS: [AuditCounter; 9] = [
    (
        "cache_audit_checks",
        "Entries the auditor compared with the source of truth and judged.",
        |a| a.checks,
    ),
    (
        "cache_audit_suspects",
        "Entries found behind the source, to be read again after the grace window.",
        |a| a.suspects,
    ),
    (
        "cache_audit_suspects_cleared",
        "Suspects explained within the grace window (the key written, the cache cleared, or the source agreeing).",
        |a| a.suspects_cleared,
    ),
    (
        "cache_audit_inconsistencies",
        "Entries still behind the source, unchanged, after the grace window.",
        |a| a.inconsistencies,
    ),
    (
        "cache_audit_repairs",
        "Inconsistent entries removed by the auditor.",
        |a| a.repairs,
    ),
    (
        "cache_audit_unverified",
        "Entries the auditor could not judge (no version and values not compared, or left out of the source's answer).",
        |a| a.unverified,
    ),
    (
        "cache_audit_source_reads",
        "Reads of the source of truth by the auditor.",
        |a| a.source_reads,
    ),
    (
        "cache_audit_source_failures",
        "Auditor reads of the source that failed, timed out or answered for keys not asked.",
        |a| a.source_failures,
    ),
    (
        "cache_audit_sweeps",
        "Sweeps begun over the cache's entries.",
        |a| a.sweeps,
    ),
];

/// A per-cache gauge of the auditor: family, help, and the value (`None`:
/// no sample).
type AuditGauge = (&'static str, &'static str, fn(&AuditStatus) -> Option<f64>);

const AUDIT_GAUGES: [AuditGauge; 5] = [
    (
        "cache_audit_suspects_pending",
        "Suspects waiting out the grace window now.",
        |a| Some(a.suspects_pending as f64),
    ),
    (
        "cache_audit_max_stale_age_seconds",
        "The longest an inconsistent entry had been seen behind the source when it was repaired (a lower bound on how long it was stale).",
        |a| a.max_stale_age_ms.map(|ms| ms as f64 / 1e3),
    ),
    (
        "cache_audit_window_checks",
        "Checks in the auditor's sliding window (cache_audit_window_seconds).",
        |a| Some(a.window_checks as f64),
    ),
    (
        "cache_audit_window_inconsistencies",
        "Inconsistencies in the auditor's sliding window (cache_audit_window_seconds).",
        |a| Some(a.window_inconsistencies as f64),
    ),
    (
        "cache_audit_consistency_nines",
        "-log10(inconsistencies / checks) over the sliding window; with none found, log10(checks), a lower bound. No sample before the first check.",
        AuditStatus::nines,
    ),
];

/// A node-wide counter, as [`CacheCounter`].
type NodeCounter = (&'static str, &'static str, fn(&NodeStatus) -> u64);

const NODE_COUNTERS: [NodeCounter; 11] = [
    (
        "node_events_received",
        "Records read from the transport.",
        |n| n.events_received,
    ),
    (
        "node_events_skipped",
        "Records for caches this node does not hold.",
        |n| n.events_skipped,
    ),
    (
        "node_events_rejected",
        "Records refused: unauthentic on a verifying node, or unreadable.",
        |n| n.events_rejected,
    ),
    (
        "node_publisher_gaps",
        "Gaps found in a publisher's sequence numbers.",
        |n| n.publisher_gaps,
    ),
    (
        "node_events_fenced",
        "Events from a replaced outbox relay, applied as invalidations.",
        |n| n.events_fenced,
    ),
    (
        "node_events_late",
        "Events at or below their publisher's last number, applied as invalidations.",
        |n| n.events_late,
    ),
    (
        "node_transport_errors",
        "Errors from the transport, each followed by a re-subscription.",
        |n| n.transport_errors,
    ),
    ("node_heartbeats_sent", "Heartbeats this node sent.", |n| {
        n.heartbeats_sent
    }),
    (
        "node_heartbeats_received",
        "Messages read off the heartbeat channel.",
        |n| n.heartbeats_received,
    ),
    (
        "node_heartbeats_rejected",
        "Messages on the heartbeat channel refused (unsigned or forged on a verifying node, oversized, unreadable).",
        |n| n.heartbeats_rejected,
    ),
    (
        "node_heartbeats_dropped",
        "Heartbeats the cluster view had no room for (past its node cap or byte budget): their nodes may be missing from it.",
        |n| n.heartbeats_dropped,
    ),
];

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let caches = &self.status.caches;
        for (name, help, field) in CACHE_COUNTERS {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for cache in caches {
                ConstCounter::new(field(cache))
                    .encode(family.encode_family(&[("cache", cache.name.as_str())])?)?;
            }
        }
        for (name, help, field) in CACHE_GAUGES {
            // A family with no samples (no cache has a version yet) is left
            // out rather than described with nothing under it.
            if caches.iter().all(|c| field(c).is_none()) {
                continue;
            }
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for cache in caches {
                if let Some(v) = field(cache) {
                    ConstGauge::new(v)
                        .encode(family.encode_family(&[("cache", cache.name.as_str())])?)?;
                }
            }
        }
        if caches.iter().any(|c| c.freshness_age_ms.is_some()) {
            let mut family = encoder.encode_descriptor(
                "cache_freshness_age",
                "Age of the cache's freshness: every change acknowledged, or made visible by a CDC relay's database, longer ago than this has been applied (absent while unknown).",
                Some(&Unit::Seconds),
                MetricType::Gauge,
            )?;
            for cache in caches {
                if let Some(ms) = cache.freshness_age_ms {
                    #[allow(clippy::cast_precision_loss)] // milliseconds: exact below 2^53
                    ConstGauge::new(ms as f64 / 1e3)
                        .encode(family.encode_family(&[("cache", cache.name.as_str())])?)?;
                }
            }
        }
        let audited: Vec<(&str, &AuditStatus)> = caches
            .iter()
            .filter_map(|c| Some((c.name.as_str(), c.audit.as_ref()?)))
            .collect();
        if !audited.is_empty() {
            for (name, help, field) in AUDIT_COUNTERS {
                let mut family =
                    encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
                for (cache, audit) in &audited {
                    ConstCounter::new(field(audit))
                        .encode(family.encode_family(&[("cache", *cache)])?)?;
                }
            }
            let mut family = encoder.encode_descriptor(
                "cache_audit_window_seconds",
                "The auditor's sliding window, over which its window counts and nines are taken.",
                None,
                MetricType::Gauge,
            )?;
            for (cache, audit) in &audited {
                ConstGauge::new(audit.window_s)
                    .encode(family.encode_family(&[("cache", *cache)])?)?;
            }
            for (name, help, field) in AUDIT_GAUGES {
                if audited.iter().all(|(_, a)| field(a).is_none()) {
                    continue;
                }
                let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
                for (cache, audit) in &audited {
                    if let Some(v) = field(audit) {
                        ConstGauge::new(v).encode(family.encode_family(&[("cache", *cache)])?)?;
                    }
                }
            }
        }
        if !self.latencies.is_empty() {
            let mut family = encoder.encode_descriptor(
                "cache_publish_to_apply_latency",
                "Publish-to-applied time: one observation per run of events applied together, the latency of the run's last event (across machines this includes clock skew).",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            for (name, histogram) in &self.latencies {
                histogram.encode(family.encode_family(&[("cache", name.as_str())])?)?;
            }
        }

        self.lateness.encode(encoder.encode_descriptor(
            "runtime_lateness",
            "How late the runtime the node runs on ran the node's 10 ms timer: a task (the node's or the application's) held a worker that long without yielding.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?)?;

        let node = &self.status;
        for (name, help, field) in NODE_COUNTERS {
            ConstCounter::new(field(node)).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Counter,
            )?)?;
        }
        let mut family = encoder.encode_descriptor(
            "node_losses",
            "Losses answered by a resync, by reason.",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in &node.losses_by_reason {
            ConstCounter::new(*n).encode(family.encode_family(&[("reason", reason.as_str())])?)?;
        }
        ConstGauge::new(u64::from(node.consuming)).encode(encoder.encode_descriptor(
            "node_consuming",
            "1 while the consumer is running and its transport healthy, else 0.",
            None,
            MetricType::Gauge,
        )?)?;
        ConstGauge::new(u64::from(self.ready)).encode(encoder.encode_descriptor(
            "node_ready",
            "1 while the node is ready (GET /readyz answers 200), else 0.",
            None,
            MetricType::Gauge,
        )?)?;
        if let Some(ms) = node.freshness_age_ms {
            ConstGauge::new(ms as f64 / 1e3).encode(encoder.encode_descriptor(
                "node_freshness_age",
                "Age of the node's freshness bound: every publish acknowledged longer ago than this has been applied (absent while unknown).",
                Some(&Unit::Seconds),
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use axum::body::Body;
    use axum::http::{Request, StatusCode, header};
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    use super::super::stats::{LOSS_REASONS, loss_index};
    use super::super::tests::eventually;
    use crate::transport::{DEFAULT_TOPIC, Transport};
    use crate::util::now_us;
    use crate::util::promtool_check;
    use crate::wire::{Change, EntryVersion, Header, Origin, encode, encode_part};
    use crate::{Node, SyncedCache, transport::EmbeddedTransport};

    type Cache = SyncedCache<String, String>;

    fn cache(name: &str) -> Cache {
        SyncedCache::new(name, moka::future::Cache::new(100))
    }

    async fn applied(node: &Node, cache: &str) -> u64 {
        node.status()
            .caches
            .iter()
            .find(|c| c.name == cache)
            .map_or(0, |c| c.events_applied)
    }

    /// A refresh from publisher `publisher` with sequence number `seq`,
    /// published straight onto the transport (to make a gap).
    fn raw_refresh(cache: &str, publisher: u64, seq: u64, k: &str, v: &str) -> Bytes {
        let header = Header {
            cache,
            origin: Origin(b"other-node"),
            publisher,
            seq,
            published_at_us: now_us(),
        };
        let change = Change::Refresh {
            entries: vec![EntryVersion {
                key: encode_part(k, "key").unwrap(),
                value: encode_part(v, "value").unwrap(),
                version: Some(seq),
            }],
        };
        Bytes::from(encode(&header, &change).unwrap())
    }

    async fn scrape(node: &Node) -> String {
        let response = node
            .status_router()
            .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "text/plain; version=0.0.4; charset=utf-8"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// Each sample line, `name{labels}` → value (parsed here, not trusted
    /// to the encoder: the test checks what a scraper would read).
    fn samples(text: &str) -> BTreeMap<String, f64> {
        text.lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| {
                let (series, value) = l.rsplit_once(' ').unwrap();
                (series.to_owned(), value.parse().unwrap())
            })
            .collect()
    }

    fn value(samples: &BTreeMap<String, f64>, series: &str) -> f64 {
        *samples
            .get(series)
            .unwrap_or_else(|| panic!("no sample {series} in {samples:#?}"))
    }

    /// A cache audited by value against a source whose every row is
    /// "right", fast and with no grace: any other value is repaired at once.
    fn audited(name: &str) -> Cache {
        SyncedCache::builder(name, moka::future::Cache::new(10))
            .audit(
                crate::Audit::by_value(|keys: Vec<String>| async move {
                    let rows = keys.into_iter().map(|k| (k, Some("right".to_owned())));
                    Ok::<_, String>(rows.collect())
                })
                .rate(1000)
                .batch(10)
                .grace(std::time::Duration::ZERO),
            )
            .build()
            .unwrap()
    }

    /// An audited cache has the auditor's families, with the values its
    /// status reports; a cache that is not audited has no sample in them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_audited_cache_reports_its_auditor() {
        let a = audited("a");
        let b = cache("b");
        let node = Node::builder("n1", EmbeddedTransport::new())
            .reorder_window(std::time::Duration::ZERO)
            .register(&a)
            .register(&b)
            .start()
            .await
            .unwrap();
        a.insert("k".into(), "wrong".into()).await;
        eventually("an inconsistency", async || {
            a.status().audit.unwrap().inconsistencies == 1
        })
        .await;
        let text = scrape(&node).await;
        promtool_check(&text);
        let s = samples(&text);
        let audit = a.status().audit.unwrap();
        for (family, want) in [
            ("cache_sync_cache_audit_inconsistencies_total", 1.0),
            ("cache_sync_cache_audit_repairs_total", 1.0),
            ("cache_sync_cache_audit_window_inconsistencies", 1.0),
            ("cache_sync_cache_audit_window_seconds", 3600.0),
        ] {
            assert_eq!(
                value(&s, &format!(r#"{family}{{cache="a"}}"#)),
                want,
                "{family}"
            );
            assert!(!s.contains_key(&format!(r#"{family}{{cache="b"}}"#)));
        }
        assert!(value(&s, r#"cache_sync_cache_audit_checks_total{cache="a"}"#) >= 1.0);
        assert!(
            value(
                &s,
                r#"cache_sync_cache_audit_source_reads_total{cache="a"}"#
            ) >= 1.0
        );
        assert!(s.contains_key(r#"cache_sync_cache_audit_max_stale_age_seconds{cache="a"}"#));
        let nines = value(&s, r#"cache_sync_cache_audit_consistency_nines{cache="a"}"#);
        assert!(nines >= 0.0 && audit.nines().is_some(), "{nines} {audit:?}");
        node.shutdown().await.unwrap();
    }

    /// Two caches, events published one at a time (so each is a run of its
    /// own), a publisher gap on one: every family carries the values the
    /// status reports, and promtool accepts the lot.
    #[tokio::test]
    async fn metrics_report_each_cache_and_the_node() {
        let transport = EmbeddedTransport::new();
        let (a, b) = (cache("a"), cache("b"));
        let node = Node::builder("n1", transport.clone())
            .register(&a)
            .register(&b)
            .start()
            .await
            .unwrap();
        let publisher = node.publisher();
        for (i, k) in ["k1", "k2", "k3"].into_iter().enumerate() {
            publisher.insert("a", [(k, "v")]).await.unwrap();
            let want = i as u64 + 1;
            eventually("a's refresh", async || applied(&node, "a").await == want).await;
        }
        assert_eq!(a.get("k1").await.as_deref(), Some("v"));
        assert_eq!(a.get("nope").await, None);
        // Publisher 7's sequence numbers 2 and 3 never arrive: one gap.
        for (n, seq) in [(1, 1), (2, 4)] {
            transport
                .publish(DEFAULT_TOPIC, "b", raw_refresh("b", 7, seq, "x", "y"))
                .await
                .unwrap();
            eventually("b's refresh", async || applied(&node, "b").await == n).await;
        }

        let text = scrape(&node).await;
        promtool_check(&text);
        let s = samples(&text);
        let status = node.status();
        assert_eq!(
            value(&s, r#"cache_sync_cache_events_applied_total{cache="a"}"#),
            3.0
        );
        assert_eq!(
            value(&s, r#"cache_sync_cache_events_applied_total{cache="b"}"#),
            2.0
        );
        assert_eq!(
            value(&s, r#"cache_sync_cache_refreshes_total{cache="a"}"#),
            3.0
        );
        assert_eq!(value(&s, r#"cache_sync_cache_hits_total{cache="a"}"#), 1.0);
        assert_eq!(
            value(&s, r#"cache_sync_cache_misses_total{cache="a"}"#),
            1.0
        );
        assert_eq!(
            value(&s, r#"cache_sync_cache_loss_resyncs_total{cache="b"}"#),
            1.0
        );
        assert_eq!(value(&s, r#"cache_sync_cache_entries{cache="a"}"#), 3.0);
        // Versioned refreshes (seq 4 last) give b a version; a has none, so
        // no sample.
        assert_eq!(value(&s, r#"cache_sync_cache_version{cache="b"}"#), 4.0);
        assert!(!s.contains_key(r#"cache_sync_cache_version{cache="a"}"#));
        // One observation per run: three runs for a.
        let latency = "cache_sync_cache_publish_to_apply_latency_seconds";
        assert_eq!(value(&s, &format!(r#"{latency}_count{{cache="a"}}"#)), 3.0);
        assert_eq!(
            value(&s, &format!(r#"{latency}_bucket{{cache="a",le="+Inf"}}"#)),
            3.0
        );
        assert!(s.contains_key(&format!(r#"{latency}_bucket{{cache="a",le="0.0001"}}"#)));
        assert!(s.contains_key(&format!(r#"{latency}_bucket{{cache="a",le="10"}}"#)));
        assert!(value(&s, &format!(r#"{latency}_sum{{cache="a"}}"#)) >= 0.0);

        assert_eq!(value(&s, "cache_sync_node_events_received_total"), 5.0);
        assert_eq!(value(&s, "cache_sync_node_publisher_gaps_total"), 1.0);
        assert_eq!(
            value(
                &s,
                r#"cache_sync_node_losses_total{reason="publisher_gap"}"#
            ),
            1.0
        );
        assert_eq!(
            value(&s, r#"cache_sync_node_losses_total{reason="trimmed"}"#),
            0.0
        );
        assert_eq!(value(&s, "cache_sync_node_consuming"), 1.0);
        // The cluster view: this node alone, its own heartbeat of age 0.
        assert_eq!(value(&s, "cache_sync_cluster_nodes"), 1.0);
        let id = node.id().to_owned();
        assert_eq!(
            value(
                &s,
                &format!(r#"cache_sync_cluster_heartbeat_age_seconds{{node="{id}"}}"#)
            ),
            0.0
        );
        assert_eq!(
            value(
                &s,
                &format!(r#"cache_sync_cluster_cache_lag_versions{{node="{id}",cache="b"}}"#)
            ),
            0.0
        );
        assert_eq!(value(&s, r#"cache_sync_cache_quarantined{cache="a"}"#), 0.0);
        assert!(text.contains("# TYPE cache_sync_node_ready gauge\n"));
        assert!(text.contains("# TYPE cache_sync_cache_events_applied_total counter\n"));
        assert!(text.contains("# TYPE cache_sync_cache_entries gauge\n"));
        assert!(text.contains(&format!("# TYPE {latency} histogram\n")));

        // The JSON status has the same split, summing to `losses`.
        assert_eq!(status.losses_by_reason.len(), LOSS_REASONS.len());
        assert_eq!(status.losses_by_reason["publisher_gap"], 1);
        assert_eq!(status.losses_by_reason.values().sum::<u64>(), status.losses);
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["losses_by_reason"]["publisher_gap"], 1);

        node.shutdown().await.unwrap();
        let s = samples(&scrape(&node).await);
        assert_eq!(value(&s, "cache_sync_node_consuming"), 0.0);
    }

    /// Cache names may hold quotes, backslashes, spaces and any Unicode
    /// but control characters (so no newlines): label values escape `"`
    /// and `\`, and promtool parses them.
    #[tokio::test]
    async fn cache_names_are_escaped_in_labels() {
        let names = [r#"say "hi""#, r"C:\temp\", "with space", "Zürich ✓ 東京"];
        let caches: Vec<_> = names.iter().map(|n| cache(n)).collect();
        let mut builder = Node::builder("n1", EmbeddedTransport::new());
        for c in &caches {
            builder = builder.register(c);
        }
        let node = builder.start().await.unwrap();
        let publisher = node.publisher();
        for name in names {
            publisher.insert(name, [("k", "v")]).await.unwrap();
            eventually("applied", async || applied(&node, name).await == 1).await;
        }
        let text = scrape(&node).await;
        promtool_check(&text);
        let s = samples(&text);
        for (name, escaped) in names.into_iter().zip([
            r#"say \"hi\""#,
            r"C:\\temp\\",
            "with space",
            "Zürich ✓ 東京",
        ]) {
            let series = format!(r#"cache_sync_cache_events_applied_total{{cache="{escaped}"}}"#);
            assert_eq!(value(&s, &series), 1.0, "{name}");
        }
    }

    /// Whatever heartbeats say (a cache listed twice, node ids that differ
    /// only in what the encoder escapes, one claiming to be this node),
    /// each (name, labels) appears on one line, and the counter of
    /// heartbeats dropped is there.
    #[tokio::test]
    async fn every_series_appears_once_whatever_the_heartbeats_say() {
        use crate::cluster::{Message, seal_message};
        let transport = EmbeddedTransport::new();
        let a = cache("a");
        let node = Node::builder("n1", transport.clone())
            .register(&a)
            .start()
            .await
            .unwrap();
        eventually("subscribed", async || {
            node.status().heartbeats_received >= 1
        })
        .await;
        let template = node.cluster().nodes().remove(0);
        let ids = ["dup", "x\"y", "x\\y", "x\ny", "x\\ny", "", "n1"];
        let plain = crate::wire::Codec::new(1 << 20, None);
        for id in ids {
            let mut h = template.clone();
            h.node_id = id.into();
            let mut first = h.caches[0].clone();
            first.version = Some(1);
            let mut second = first.clone();
            second.version = Some(2);
            let mut b = first.clone();
            b.name = "b".into();
            h.caches = vec![first, second, b.clone(), b];
            let payload = seal_message(&plain, &Message::Heartbeat(h)).unwrap();
            transport
                .publish_heartbeat(DEFAULT_TOPIC, Bytes::from(payload))
                .await
                .unwrap();
        }
        eventually("all seen", async || {
            node.cluster().nodes().len() == ids.len()
        })
        .await;
        let text = scrape(&node).await;
        promtool_check(&text);
        let mut seen = std::collections::HashSet::new();
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let (series, _) = line.rsplit_once(' ').unwrap();
            assert!(seen.insert(series.to_owned()), "twice: {series}\n{text}");
        }
        let s = samples(&text);
        assert_eq!(value(&s, "cache_sync_cluster_nodes"), ids.len() as f64);
        for escaped in ["dup", r#"x\"y"#, r"x\\y", r"x\ny", r"x\\ny", ""] {
            // The first "a" (version 1) was kept: 1 behind the 2 nobody
            // holds any more is no lag at all.
            let series =
                format!(r#"cache_sync_cluster_cache_lag_versions{{node="{escaped}",cache="a"}}"#);
            assert_eq!(value(&s, &series), 0.0, "{series}");
        }
        assert_eq!(value(&s, "cache_sync_node_heartbeats_dropped_total"), 0.0);
        node.shutdown().await.unwrap();
    }

    #[test]
    fn every_loss_reason_has_its_own_counter() {
        for (i, reason) in LOSS_REASONS.into_iter().enumerate() {
            assert_eq!(loss_index(reason), i, "{reason}");
        }
    }

    /// Every family named in a scrape's `# TYPE` lines.
    fn families(text: &str) -> std::collections::BTreeSet<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .map(str::to_owned)
            .collect()
    }

    /// The families `Node::status_router`'s docs list: each full name in
    /// code (`cache_sync_…`), and each abbreviated one (`_…`), which takes
    /// the group of the full name before it (`cache_sync_cache_audit`,
    /// `cache_sync_cache`, `cache_sync_node`, …).
    fn documented() -> std::collections::BTreeSet<String> {
        const GROUPS: [&str; 5] = [
            "cache_sync_cache_audit",
            "cache_sync_cache",
            "cache_sync_node",
            "cache_sync_cluster",
            "cache_sync_runtime",
        ];
        let source = include_str!("mod.rs");
        let start = source
            .find("/// `GET /metrics` answers")
            .expect("status_router's docs describe /metrics");
        let end = start
            + source[start..]
                .find("/// Mounted in the application's server")
                .expect("the metrics list ends");
        let docs: String = source[start..end]
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("///"))
            .collect::<Vec<_>>()
            .join(" ");
        let name = |t: &str| {
            t.len() > 1
                && t.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        };
        let mut group: Option<&str> = None;
        let mut out = std::collections::BTreeSet::new();
        // Code is every other piece between backticks.
        for code in docs.split('`').skip(1).step_by(2) {
            if !name(code) || code.ends_with('_') {
                continue;
            }
            if code.starts_with("cache_sync_") {
                group = GROUPS
                    .iter()
                    .copied()
                    .find(|g| code.starts_with(&format!("{g}_")));
                out.insert(code.to_owned());
            } else if let (Some(g), true) = (group, code.starts_with('_')) {
                out.insert(format!("{g}{code}"));
            }
        }
        out
    }

    /// The list of families in `Node::status_router`'s docs is exactly what
    /// `/metrics` serves, with every family that can be left out present
    /// (a cache with a version, an audited cache that checked and repaired
    /// an entry, a cluster view with a versioned cache): a family added,
    /// renamed or dropped without its doc line fails here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_documented_families_are_the_ones_served() {
        let a = audited("a");
        let b = cache("b");
        let transport = EmbeddedTransport::new();
        let node = Node::builder("n1", transport.clone())
            .reorder_window(std::time::Duration::ZERO)
            .register(&a)
            .register(&b)
            .start()
            .await
            .unwrap();
        a.insert("k".into(), "wrong".into()).await;
        eventually("a repair", async || a.status().audit.unwrap().repairs == 1).await;
        transport
            .publish(DEFAULT_TOPIC, "b", raw_refresh("b", 7, 1, "x", "y"))
            .await
            .unwrap();
        eventually("b's version", async || b.status().version.is_some()).await;
        eventually("a freshness bound", async || {
            node.status().freshness_age_ms.is_some()
        })
        .await;
        // And in a heartbeat of its own, for the cluster view's gauge.
        eventually("a freshness bound in the cluster view", async || {
            node.cluster()
                .view()
                .nodes
                .iter()
                .any(|n| n.freshness_age_ms.is_some())
        })
        .await;
        let text = scrape(&node).await;
        let (served, documented) = (families(&text), documented());
        assert!(served.len() > 50, "{served:?}");
        assert_eq!(
            served.difference(&documented).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "served but not in status_router's docs"
        );
        assert_eq!(
            documented.difference(&served).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "in status_router's docs but not served"
        );
        node.shutdown().await.unwrap();
    }
}
