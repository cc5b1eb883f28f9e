//! The pacing metrics (`pace`): requests held and refused, keys closed, what upstreams say is
//! left, and limit fields that were ignored.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::per_upstream::{by_upstream, UpstreamFamily};
use super::{ReasonLabels, UpstreamLabel};

/// `upstream`, `unit` (`requests` or `tokens`).
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct UnitLabels {
    /// Configured name, or host:port.
    pub upstream: String,
    /// `requests` or `tokens`.
    pub unit: &'static str,
}

by_upstream!(UnitLabels);

/// Why a pace key closes (`pace::key`): made at zero with an upstream's handles, so a quiet
/// upstream's panel shows 0.
const CLOSE_REASONS: [&str; 2] = ["retry_after", "remaining"];

type WaitFamily = UpstreamFamily<UpstreamLabel, Histogram, fn() -> Histogram>;

fn wait_histogram() -> Histogram {
    // 1 ms .. ~65 s: a window's smoothing spaces requests by milliseconds, a reset is seconds
    // to a minute away.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The pacing families.
#[derive(Debug)]
pub(super) struct PaceFamilies {
    waits: UpstreamFamily<UpstreamLabel, Counter>,
    wait_seconds: WaitFamily,
    rejected: UpstreamFamily<UpstreamLabel, Counter>,
    closed: UpstreamFamily<ReasonLabels, Counter>,
    remaining: UpstreamFamily<UnitLabels, Gauge>,
    header_errors: UpstreamFamily<UpstreamLabel, Counter>,
}

impl Default for PaceFamilies {
    fn default() -> Self {
        PaceFamilies {
            waits: UpstreamFamily::default(),
            wait_seconds: WaitFamily::new_with_constructor(wait_histogram),
            rejected: UpstreamFamily::default(),
            closed: UpstreamFamily::default(),
            remaining: UpstreamFamily::default(),
            header_errors: UpstreamFamily::default(),
        }
    }
}

impl PaceFamilies {
    /// Removes every series of the upstream labelled `upstream`.
    pub(super) fn forget(&self, upstream: &str) {
        self.waits.forget(upstream);
        self.wait_seconds.forget(upstream);
        self.rejected.forget(upstream);
        self.closed.forget(upstream);
        self.remaining.forget(upstream);
        self.header_errors.forget(upstream);
    }

    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "pace_waits",
            "Requests held by pacing before going upstream",
            self.waits.clone(),
        );
        registry.register(
            "pace_wait_seconds",
            "Time a request was held by pacing before it went",
            self.wait_seconds.clone(),
        );
        registry.register(
            "pace_rejected",
            "Requests answered 429 rate_limited: pacing would have held them past pace.max_wait or their deadline",
            self.rejected.clone(),
        );
        registry.register(
            "pace_closed",
            "Times a pace key closed, by reason: retry_after (a 429 or 503 asked every request to wait), remaining (the quota reached pace.reserve)",
            self.closed.clone(),
        );
        registry.register(
            "upstream_ratelimit_remaining",
            "What the upstream last said is left before its reset, the lowest over its pace keys, by unit",
            self.remaining.clone(),
        );
        registry.register(
            "pace_header_errors",
            "Rate-limit fields an upstream sent that were ignored: malformed or absurd values",
            self.header_errors.clone(),
        );
    }

    /// One upstream's handles; `upstream` is its label within the cardinality budget.
    pub(super) fn handles(self: &std::sync::Arc<Self>, upstream: String) -> PaceMetrics {
        let label = UpstreamLabel {
            upstream: upstream.clone(),
        };
        for reason in CLOSE_REASONS {
            self.closed.get_or_create_owned(&ReasonLabels {
                upstream: upstream.clone(),
                reason,
            });
        }
        let unit = |unit| UnitLabels {
            upstream: upstream.clone(),
            unit,
        };
        PaceMetrics {
            waits: self.waits.get_or_create_owned(&label),
            wait_seconds: self.wait_seconds.get_or_create_owned(&label),
            rejected: self.rejected.get_or_create_owned(&label),
            header_errors: self.header_errors.get_or_create_owned(&label),
            remaining_requests: self.remaining.get_or_create_owned(&unit("requests")),
            remaining_tokens: self.remaining.get_or_create_owned(&unit("tokens")),
            families: self.clone(),
            upstream,
        }
    }
}

/// One upstream's pacing metric handles.
#[derive(Debug, Clone)]
pub struct PaceMetrics {
    /// `egress_pace_waits_total`.
    pub waits: Counter,
    /// `egress_pace_wait_seconds`.
    pub wait_seconds: Histogram,
    /// `egress_pace_rejected_total`.
    pub rejected: Counter,
    /// `egress_pace_header_errors_total`.
    pub header_errors: Counter,
    /// `egress_upstream_ratelimit_remaining{unit="requests"}`.
    pub remaining_requests: Gauge,
    /// `egress_upstream_ratelimit_remaining{unit="tokens"}`.
    pub remaining_tokens: Gauge,
    families: std::sync::Arc<PaceFamilies>,
    upstream: String,
}

impl PaceMetrics {
    /// Counts a key closed for `reason`.
    pub fn closed(&self, reason: &'static str) {
        let labels = ReasonLabels {
            upstream: self.upstream.clone(),
            reason,
        };
        self.families.closed.get_or_create_owned(&labels).inc();
    }
}
