//! The relay's Prometheus exposition: built from its stats at scrape time.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use super::CdcRelayStats;

#[derive(Debug)]
struct RelayCollector {
    slot: String,
    stats: CdcRelayStats,
}

impl Collector for RelayCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = &self.stats;
        let labels = [("slot", self.slot.as_str())];
        ConstGauge::new(i64::from(s.active)).encode(
            encoder
                .encode_descriptor(
                    "cdc_active",
                    "1 while this relay streams the slot (0: standby or reconnecting).",
                    None,
                    MetricType::Gauge,
                )?
                .encode_family(&labels)?,
        )?;
        for (name, help, value) in [
            (
                "cdc_transactions",
                "Transactions published.",
                s.transactions,
            ),
            (
                "cdc_rows",
                "Row changes taken from published transactions.",
                s.rows,
            ),
            (
                "cdc_resyncs",
                "Resyncs published: clears of the mapped caches for a new or lost slot, or of a table's after an operator changed it.",
                s.resyncs,
            ),
            (
                "cdc_takeovers",
                "Times this relay took the slot over from another.",
                s.takeovers,
            ),
            (
                "cdc_failures",
                "Replication sessions that ended in an error.",
                s.failures,
            ),
            (
                "cdc_mark_failures",
                "Freshness marks that could not be written into the WAL: no report follows each.",
                s.mark_failures,
            ),
        ] {
            ConstCounter::new(value).encode(
                encoder
                    .encode_descriptor(name, help, None, MetricType::Counter)?
                    .encode_family(&labels)?,
            )?;
        }
        if let Some(bytes) = s.lag_bytes {
            ConstGauge::new(i64::try_from(bytes).unwrap_or(i64::MAX)).encode(
                encoder
                    .encode_descriptor(
                        "cdc_slot_lag",
                        "How far the slot's confirmed position is behind the end of the server's log.",
                        Some(&Unit::Bytes),
                        MetricType::Gauge,
                    )?
                    .encode_family(&labels)?,
            )?;
        }
        ConstGauge::new(s.lag_seconds).encode(
            encoder
                .encode_descriptor(
                    "cdc_slot_lag",
                    "How long ago, on the server's clock, the oldest received but unconfirmed transaction committed.",
                    Some(&Unit::Seconds),
                    MetricType::Gauge,
                )?
                .encode_family(&labels)?,
        )?;
        Ok(())
    }
}

pub(super) fn encode(slot: &str, stats: &CdcRelayStats) -> String {
    let mut registry = Registry::with_prefix("cache_sync");
    registry.register_collector(Box::new(RelayCollector {
        slot: slot.to_owned(),
        stats: stats.clone(),
    }));
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_text::encode(&mut text, &registry);
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::promtool_check;

    #[test]
    fn the_exposition_is_valid_and_says_what_the_stats_say() {
        let stats = CdcRelayStats {
            active: true,
            transactions: 7,
            rows: 70,
            resyncs: 1,
            takeovers: 2,
            failures: 3,
            skipped: 0,
            confirmed_lsn: 99,
            lag_bytes: Some(4096),
            lag_seconds: 1.5,
            mark_failures: 5,
        };
        let text = encode("cache_sync", &stats);
        for line in [
            "cache_sync_cdc_active{slot=\"cache_sync\"} 1",
            "cache_sync_cdc_transactions_total{slot=\"cache_sync\"} 7",
            "cache_sync_cdc_takeovers_total{slot=\"cache_sync\"} 2",
            "cache_sync_cdc_mark_failures_total{slot=\"cache_sync\"} 5",
            "cache_sync_cdc_slot_lag_bytes{slot=\"cache_sync\"} 4096",
            "cache_sync_cdc_slot_lag_seconds{slot=\"cache_sync\"} 1.5",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        promtool_check(&text);
        // Before the first lag reading: no bytes sample, still valid.
        let text = encode("s", &CdcRelayStats::default());
        assert!(!text.contains("lag_bytes{"), "{text}");
        promtool_check(&text);
    }
}
