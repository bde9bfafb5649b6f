//! The `/metrics` gauges drawn from this node's cluster view: the live
//! nodes, their heartbeats' age, readiness, freshness and per-cache lag.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use super::Node;
use crate::cluster::{ClusterView, NodeView};
use crate::util::HashSet;

/// The gauges that need the other nodes' heartbeats, built at scrape time
/// from this node's cluster view like `NodeCollector` (in `metrics.rs`).
pub(super) fn register_cluster_metrics(registry: &mut Registry, node: &Node) {
    registry.register_collector(Box::new(ClusterCollector {
        view: node.cluster().view(),
    }));
}

/// One scrape's cluster view.
#[derive(Debug)]
struct ClusterCollector {
    view: ClusterView,
}

impl Collector for ClusterCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let view = &self.view;
        // Each label set once, whatever the heartbeats said: the view lists
        // each node once (its own entry replacing any echo or forgery of
        // it) and each node's caches once (the first of a name), and the
        // encoder escapes `\`, `"` and newlines one-to-one, so distinct ids
        // stay distinct. These sets hold the line all the same.
        let mut nodes: HashSet<&str> = HashSet::default();
        let mut pairs: HashSet<(&str, &str)> = HashSet::default();
        let view_nodes: Vec<&NodeView> = view
            .nodes
            .iter()
            .filter(|n| nodes.insert(n.node_id.as_str()))
            .collect();
        ConstGauge::new(i64::try_from(view_nodes.len()).unwrap_or(i64::MAX)).encode(
            encoder.encode_descriptor(
                "cluster_nodes",
                "Live nodes in this node's cluster view (itself included).",
                None,
                MetricType::Gauge,
            )?,
        )?;
        let mut family = encoder.encode_descriptor(
            "cluster_heartbeat_age",
            "Time since each live node's last heartbeat arrived (0 for this node).",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        for n in &view_nodes {
            // Milliseconds to seconds; exact for any age below 2^53 ms.
            ConstGauge::new(n.age_ms as f64 / 1e3)
                .encode(family.encode_family(&[("node", n.node_id.as_str())])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "cluster_cache_lag_versions",
            "Per node and cache: versions behind the newest any live node reports (only caches with a version).",
            None,
            MetricType::Gauge,
        )?;
        for n in &view_nodes {
            for c in &n.caches {
                if !pairs.insert((n.node_id.as_str(), c.name.as_str())) {
                    continue;
                }
                if let Some(lag) = c.lag {
                    ConstGauge::new(i64::try_from(lag).unwrap_or(i64::MAX)).encode(
                        family.encode_family(&[
                            ("node", n.node_id.as_str()),
                            ("cache", c.name.as_str()),
                        ])?,
                    )?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "cluster_node_ready",
            "Per live node: 1 if its last heartbeat said it is ready, else 0.",
            None,
            MetricType::Gauge,
        )?;
        for n in &view_nodes {
            ConstGauge::new(i64::from(n.ready))
                .encode(family.encode_family(&[("node", n.node_id.as_str())])?)?;
        }
        let mut family = encoder.encode_descriptor(
            "cluster_node_freshness_age",
            "Per live node that proves one: the age of its freshness bound, as its last heartbeat said.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        for n in &view_nodes {
            // Unknown (no tail, nothing proved yet) is no sample, as the
            // node's own gauge does: a number would claim a proof.
            if let Some(ms) = n.freshness_age_ms {
                ConstGauge::new(ms as f64 / 1e3)
                    .encode(family.encode_family(&[("node", n.node_id.as_str())])?)?;
            }
        }
        Ok(())
    }
}
