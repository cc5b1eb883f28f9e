//! The global rate limit's metrics (`global_rate_limit`): calls to the rate-limit service by result, and how
//! long they took.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::per_upstream::{by_upstream, UpstreamFamily};
use super::UpstreamLabel;

/// `upstream`, `result`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct ResultLabels {
    upstream: String,
    result: &'static str,
}

by_upstream!(ResultLabels);

type SecondsFamily = UpstreamFamily<UpstreamLabel, Histogram, fn() -> Histogram>;

fn call_histogram() -> Histogram {
    // 0.1 ms .. ~3.3 s: a service on loopback answers in a fraction of a millisecond, a
    // `timeout` is tens of milliseconds, a dial to a service elsewhere up to seconds.
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

/// The global rate limit's families.
#[derive(Debug)]
pub(super) struct GlobalRateLimitFamilies {
    calls: UpstreamFamily<ResultLabels, Counter>,
    seconds: SecondsFamily,
}

impl Default for GlobalRateLimitFamilies {
    fn default() -> Self {
        GlobalRateLimitFamilies {
            calls: UpstreamFamily::default(),
            seconds: SecondsFamily::new_with_constructor(call_histogram),
        }
    }
}

impl GlobalRateLimitFamilies {
    /// Removes every series of the upstream labelled `upstream`.
    pub(super) fn forget(&self, upstream: &str) {
        self.calls.forget(upstream);
        self.seconds.forget(upstream);
    }

    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "global_rate_limit_calls",
            "Quota checks and token reports, by result: ok, over_limit (the service said so), error (no connection or a failed call), timeout (no answer within global_rate_limit.timeout), cached (answered over limit without a call)",
            self.calls.clone(),
        );
        registry.register(
            "global_rate_limit_seconds",
            "Time a call to the rate-limit service took, answered or not",
            self.seconds.clone(),
        );
    }

    /// One upstream's handles; `upstream` is its label within the cardinality budget.
    pub(super) fn handles(&self, upstream: String) -> GlobalRateLimitMetrics {
        let result = |result| {
            self.calls.get_or_create_owned(&ResultLabels {
                upstream: upstream.clone(),
                result,
            })
        };
        GlobalRateLimitMetrics {
            ok: result("ok"),
            over_limit: result("over_limit"),
            error: result("error"),
            timeout: result("timeout"),
            cached: result("cached"),
            seconds: self.seconds.get_or_create_owned(&UpstreamLabel { upstream }),
        }
    }
}

/// One upstream's global rate limit metric handles.
#[derive(Debug, Clone)]
pub struct GlobalRateLimitMetrics {
    /// `egress_global_rate_limit_calls_total{result="ok"}`.
    pub ok: Counter,
    /// `{result="over_limit"}`.
    pub over_limit: Counter,
    /// `{result="error"}`.
    pub error: Counter,
    /// `{result="timeout"}`.
    pub timeout: Counter,
    /// `{result="cached"}`.
    pub cached: Counter,
    /// `egress_global_rate_limit_seconds`.
    pub seconds: Histogram,
}
