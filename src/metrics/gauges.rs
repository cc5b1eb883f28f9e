//! The gauges computed at scrape time: each upstream's pool connections by state, waiting
//! requests, endpoints by state and learned idle timeout, read from its pools; and the
//! process's tasks, open files and resident memory.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;

use super::{GaugeSources, UpstreamLabel};

/// Computes the gauges at scrape time.
#[derive(Debug)]
pub(super) struct GaugeCollector(pub(super) Arc<GaugeSources>);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    upstream: String,
    state: &'static str,
}

/// One label's pool gauges.
#[derive(Debug, Default)]
struct PoolGauges {
    active: i64,
    idle: i64,
    pending: i64,
    /// The smallest learned upstream idle timeout among the label's pools.
    learned_idle_timeout: Option<std::time::Duration>,
    /// Endpoints by state (active, ejected, draining): the largest among the label's pools,
    /// since an upstream's pools share one endpoint set.
    endpoints: [i64; 3],
}

impl GaugeCollector {
    /// Sums per label: every upstream past the label budget reports as `other`, and a pool a
    /// reload retired reports with its successor.
    fn pool_gauges(&self) -> std::collections::BTreeMap<String, PoolGauges> {
        let mut by_label: std::collections::BTreeMap<String, PoolGauges> = Default::default();
        for (label, pool) in self.0.pools.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let Some(pool) = pool.upgrade() else { continue };
            let s = pool.counts();
            let idle = s.idle as i64;
            let entry = by_label.entry(label.clone()).or_default();
            entry.active += s.open as i64 - idle;
            entry.idle += idle;
            entry.pending += s.pending as i64;
            for (total, n) in entry.endpoints.iter_mut().zip(s.endpoints) {
                *total = (*total).max(n as i64);
            }
            entry.learned_idle_timeout = match (entry.learned_idle_timeout, s.learned_idle_timeout) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        by_label
    }
}

impl Collector for GaugeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let by_label = self.pool_gauges();
        let gauge = ConstGauge::new(0i64);
        let mut conns = encoder.encode_descriptor(
            "upstream_connections",
            "Open upstream connections: active (dialing or carrying requests) and idle",
            None,
            gauge.metric_type(),
        )?;
        for (label, g) in &by_label {
            for (state, value) in [("active", g.active), ("idle", g.idle)] {
                let labels = StateLabels {
                    upstream: label.clone(),
                    state,
                };
                ConstGauge::new(value).encode(conns.encode_family(&labels)?)?;
            }
        }
        let mut pending = encoder.encode_descriptor(
            "pool_pending_requests",
            "Requests waiting for a pooled connection or stream",
            None,
            gauge.metric_type(),
        )?;
        for (label, g) in &by_label {
            let labels = UpstreamLabel {
                upstream: label.clone(),
            };
            ConstGauge::new(g.pending).encode(pending.encode_family(&labels)?)?;
        }
        let mut endpoints = encoder.encode_descriptor(
            "upstream_endpoints",
            "An upstream's endpoints by state: active, ejected (outlier detection) and draining (left the DNS answer, connections still open)",
            None,
            gauge.metric_type(),
        )?;
        for (label, g) in &by_label {
            for (state, value) in ["active", "ejected", "draining"].into_iter().zip(g.endpoints) {
                let labels = StateLabels {
                    upstream: label.clone(),
                    state,
                };
                ConstGauge::new(value).encode(endpoints.encode_family(&labels)?)?;
            }
        }
        let learned = ConstGauge::new(0f64);
        let mut learned_family = encoder.encode_descriptor(
            "upstream_learned_idle_timeout_seconds",
            "The upstream's own idle timeout as learned from its closes of idle HTTP/1.1 connections (0: nothing learned)",
            None,
            learned.metric_type(),
        )?;
        for (label, g) in &by_label {
            let labels = UpstreamLabel {
                upstream: label.clone(),
            };
            let seconds = g.learned_idle_timeout.map_or(0.0, |d| d.as_secs_f64());
            ConstGauge::new(seconds).encode(learned_family.encode_family(&labels)?)?;
        }
        encode_process_gauges(&mut encoder)
    }
}

/// What a soak run or an operator watches for leaks: tasks alive in the runtime, open file
/// descriptors and resident memory, read at scrape time (Linux `/proc/self`; a gauge whose
/// source cannot be read is left out rather than reported as 0).
fn encode_process_gauges(encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let tasks = tokio::runtime::Handle::try_current()
        .ok()
        .map(|h| h.metrics().num_alive_tasks());
    let fds = std::fs::read_dir("/proc/self/fd").ok().map(Iterator::count);
    let rss = crate::resident::rss_bytes()
        .ok()
        .and_then(|b| usize::try_from(b).ok());
    let gauges = [
        ("runtime_tasks", "Tasks alive in the sidecar's runtime", tasks),
        ("process_open_fds", "Open file descriptors", fds),
        ("process_resident_memory_bytes", "Resident memory (VmRSS)", rss),
    ];
    for (name, help, value) in gauges {
        let Some(value) = value else { continue };
        let gauge = ConstGauge::new(value as i64);
        let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
        gauge.encode(metric)?;
    }
    Ok(())
}
