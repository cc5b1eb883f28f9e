//! The latency histogram each request observes twice (its wait for a pooled connection, its
//! time to a response head): lock-free, its bucket worked out from the duration's bits.
//!
//! prometheus-client's `Histogram` takes a mutex, checks for a scheduled reset and searches its
//! buckets at every observation: 67 instructions each in callgrind, twice per request. Here an
//! observation is a division by a constant, a leading-zero count and two relaxed atomic adds
//! (one for a zero duration). The buckets are the ones that histogram had (1 ms doubling to
//! 65.536 s, then `+Inf`), so the series a dashboard reads are unchanged. A scrape counts the
//! observations from the buckets, so `_count` always agrees with them; `_sum` may trail an observation made during the scrape.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Finite buckets: upper bounds of 1 ms · 2^i.
const FINITE: usize = 17;
/// The first bucket's upper bound.
const FIRST_NANOS: u64 = 1_000_000;

/// A histogram of durations, shared by its clones.
#[derive(Debug, Clone, Default)]
pub struct Latency(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    /// Observations by bucket (not cumulative); the last is `+Inf`.
    buckets: [AtomicU64; FINITE + 1],
    /// The observations' sum, in nanoseconds: 584 years of latency before it wraps.
    sum_nanos: AtomicU64,
}

impl Latency {
    /// Counts one duration.
    pub fn observe(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.0.buckets[bucket(nanos)].fetch_add(1, Ordering::Relaxed);
        // A wait for a pooled connection is mostly none: nothing to add, and no locked
        // instruction (about twenty cycles) to add it.
        if nanos != 0 {
            self.0.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
        }
    }
}

/// The first bucket whose upper bound, 1 ms · 2^i, is at least `nanos` (`FINITE`: `+Inf`).
/// Past the first millisecond that is the bit length of the whole milliseconds before it.
fn bucket(nanos: u64) -> usize {
    let ms_before = nanos.saturating_sub(1) / FIRST_NANOS;
    ((u64::BITS - ms_before.leading_zeros()) as usize).min(FINITE)
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let bounds = exponential_buckets(0.001, 2.0, FINITE as u16).chain([f64::INFINITY]);
        let buckets: Vec<(f64, u64)> = bounds
            .zip(&self.0.buckets)
            .map(|(bound, n)| (bound, n.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.0.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::registry::{Metric, Registry};

    #[test]
    fn each_duration_lands_in_the_first_bucket_that_holds_it() {
        let ms = |n: u64| n * FIRST_NANOS;
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(ms(1)), 0);
        assert_eq!(bucket(ms(1) + 1), 1);
        assert_eq!(bucket(ms(2)), 1);
        assert_eq!(bucket(ms(2) + 1), 2);
        assert_eq!(bucket(ms(3)), 2);
        assert_eq!(bucket(ms(4)), 2);
        assert_eq!(bucket(ms(65_536)), FINITE - 1);
        assert_eq!(bucket(ms(65_536) + 1), FINITE);
        assert_eq!(bucket(u64::MAX), FINITE);
        for i in 0..FINITE {
            let bound = ms(1 << i);
            assert_eq!(bucket(bound), i, "{bound}");
            assert_eq!(bucket(bound + 1), i + 1, "{bound}");
        }
    }

    /// What a scrape shows is what prometheus-client's histogram with the same buckets showed
    /// for the same observations.
    fn render(metric: impl Metric) -> String {
        let mut registry = Registry::default();
        registry.register("wait", "Waits", metric);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn it_encodes_as_the_histogram_it_replaces() {
        let seen = [
            0,
            250_000,
            1_000_000,
            1_500_000,
            500_000_000,
            2_000_000_000,
            100_000_000_000,
        ];
        let ours = Latency::default();
        let theirs = Histogram::new(exponential_buckets(0.001, 2.0, 17));
        for nanos in seen {
            ours.observe(Duration::from_nanos(nanos));
            theirs.observe(Duration::from_nanos(nanos).as_secs_f64());
        }
        let (ours, theirs) = (render(ours), render(theirs));
        assert_eq!(ours, theirs);
        assert!(ours.contains("wait_count 7\n"), "{ours}");
        assert!(ours.contains("wait_bucket{le=\"0.002\"} 4\n"), "{ours}");
    }
}
