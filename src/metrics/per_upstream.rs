//! A metric family labelled by upstream whose series of one `upstream` value can be removed
//! together: what forgetting a host met on the fly takes back (`Metrics::forget_upstream`).
//!
//! prometheus_client's `Family` removes a series only by its whole label set and cannot list
//! them, and a family such as `egress_upstream_requests_total` has one series per status code
//! seen. So each family notes, by `upstream` value, the label sets it made; removing a value
//! removes those. The note is taken when a series is made, never when an existing one is
//! counted: the hot path reads the family as before. A family labelled by `upstream` alone
//! (most of them) notes nothing: its one series per value is removed by the value.
//!
//! A family's own table keeps its room once its series are removed (prometheus_client offers
//! no shrink): the room for the 256 labels the cap allows, about 400 KB over all families
//! once a forward proxy has met that many hosts, taken once.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// A label set with an `upstream` label.
pub(super) trait ByUpstream: Sized {
    /// The set has no label but `upstream`.
    const ALONE: bool = false;

    /// The `upstream` label's value.
    fn upstream(&self) -> &str;

    /// The label set of `upstream` alone, when the set has no other label: its series is
    /// removed by it, and nothing needs noting.
    fn alone(_upstream: &str) -> Option<Self> {
        None
    }
}

/// A [`Family`] that can drop every series of one `upstream` value.
pub(super) struct UpstreamFamily<S, M, C = fn() -> M> {
    family: Family<S, M, C>,
    /// The label sets made, by `upstream` value.
    made: Arc<Mutex<HashMap<Box<str>, Vec<S>>>>,
}

impl<S: Clone + Hash + Eq, M: Default> Default for UpstreamFamily<S, M> {
    fn default() -> Self {
        UpstreamFamily {
            family: Family::default(),
            made: Arc::default(),
        }
    }
}

impl<S, M, C: Clone> Clone for UpstreamFamily<S, M, C> {
    fn clone(&self) -> Self {
        UpstreamFamily {
            family: self.family.clone(),
            made: self.made.clone(),
        }
    }
}

impl<S: fmt::Debug, M: fmt::Debug, C> fmt::Debug for UpstreamFamily<S, M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.family.fmt(f)
    }
}

impl<S, M, C> UpstreamFamily<S, M, C>
where
    S: Clone + Hash + Eq + ByUpstream,
    C: MetricConstructor<M>,
{
    /// A family whose series `constructor` makes (a histogram's buckets).
    pub(super) fn new_with_constructor(constructor: C) -> Self {
        UpstreamFamily {
            family: Family::new_with_constructor(constructor),
            made: Arc::default(),
        }
    }

    /// The series of `labels`, made if new (and noted under its `upstream` value).
    pub(super) fn get_or_create_owned(&self, labels: &S) -> M
    where
        M: Clone,
    {
        if let Some(series) = self.family.get(labels) {
            return series.clone();
        }
        let series = self.family.get_or_create_owned(labels);
        if S::ALONE {
            return series;
        }
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        let sets = made.entry(labels.upstream().into()).or_default();
        if !sets.contains(labels) {
            sets.push(labels.clone());
        }
        series
    }

    /// Removes every series whose `upstream` is `upstream`.
    pub(super) fn forget(&self, upstream: &str) {
        if let Some(labels) = S::alone(upstream) {
            self.family.remove(&labels);
            return;
        }
        let sets = {
            let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
            let sets = made.remove(upstream);
            if crate::resident::mostly_empty(made.len(), made.capacity()) {
                made.shrink_to_fit();
            }
            sets
        };
        for labels in sets.into_iter().flatten() {
            self.family.remove(&labels);
        }
    }
}

impl<S, M: TypedMetric, C> TypedMetric for UpstreamFamily<S, M, C> {
    const TYPE: MetricType = <M as TypedMetric>::TYPE;
}

impl<S, M, C> EncodeMetric for UpstreamFamily<S, M, C>
where
    S: Clone + Hash + Eq + EncodeLabelSet,
    M: EncodeMetric + TypedMetric,
    C: MetricConstructor<M>,
{
    fn encode(&self, encoder: MetricEncoder) -> Result<(), fmt::Error> {
        self.family.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }

    fn is_empty(&self) -> bool {
        self.family.is_empty()
    }
}

/// Implements [`ByUpstream`] for label sets whose `upstream` field holds the value.
macro_rules! by_upstream {
    ($($t:ty),* $(,)?) => {
        $(impl $crate::metrics::per_upstream::ByUpstream for $t {
            fn upstream(&self) -> &str {
                &self.upstream
            }
        })*
    };
}
pub(crate) use by_upstream;

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;

    use super::*;
    use crate::metrics::{CodeLabels, Metrics, UpstreamLabel, MAX_UPSTREAM_LABELS, OTHER};

    #[test]
    fn forgetting_an_upstream_removes_its_series_only() {
        let family: UpstreamFamily<CodeLabels, Counter> = UpstreamFamily::default();
        let labels = |upstream: &str, code| CodeLabels {
            upstream: upstream.into(),
            code,
        };
        family.get_or_create_owned(&labels("a", 200)).inc();
        family.get_or_create_owned(&labels("a", 503)).inc();
        family.get_or_create_owned(&labels("a", 200)).inc();
        family.get_or_create_owned(&labels("b", 200)).inc();
        family.forget("a");
        assert!(family.family.get(&labels("a", 200)).is_none());
        assert!(family.family.get(&labels("a", 503)).is_none());
        assert_eq!(family.family.get(&labels("b", 200)).unwrap().get(), 1);
        assert!(!family.made.lock().unwrap().contains_key("a"));
        // Made again from zero.
        assert_eq!(family.get_or_create_owned(&labels("a", 200)).get(), 0);
    }

    #[test]
    fn a_family_by_upstream_alone_notes_nothing_and_still_forgets() {
        let family: UpstreamFamily<UpstreamLabel, Counter> = UpstreamFamily::default();
        let a = UpstreamLabel { upstream: "a".into() };
        family.get_or_create_owned(&a).inc();
        assert!(family.made.lock().unwrap().is_empty());
        family.forget("a");
        assert!(family.family.get(&a).is_none());
    }

    /// Lines of the exposition that carry `upstream="<name>"`.
    fn lines_of(metrics: &Metrics, name: &str) -> usize {
        let needle = format!("upstream=\"{name}\"");
        metrics.render().lines().filter(|l| l.contains(&needle)).count()
    }

    #[test]
    fn a_forgotten_upstream_leaves_no_series_and_its_place_under_the_cap() {
        let metrics = Metrics::new();
        let host = metrics.upstream_met_on_the_fly("a.example:80");
        host.request(200);
        host.request(503);
        host.failed(crate::error::ErrorKind::ConnectFailed);
        host.closed("idle_timeout");
        host.retried("reset");
        host.duration.observe(0.01);
        let _ = metrics.pace("a.example:80");
        let configured = metrics.upstream("b");
        assert!(lines_of(&metrics, "a.example:80") > 10);
        let b_lines = lines_of(&metrics, "b");

        metrics.forget_upstream("a.example:80");
        assert_eq!(lines_of(&metrics, "a.example:80"), 0, "{}", metrics.render());
        assert_eq!(lines_of(&metrics, "b"), b_lines, "the others' series stay");
        drop(configured);

        // The cap counts labels in use: 256 taken, the next is `other` until one is forgotten.
        for i in 0..MAX_UPSTREAM_LABELS - 1 {
            let _ = metrics.upstream_met_on_the_fly(&format!("h{i}:80"));
        }
        assert_eq!(metrics.upstream_met_on_the_fly("late:80").label(), OTHER);
        metrics.forget_upstream(OTHER);
        assert_eq!(
            metrics.upstream_met_on_the_fly("late:80").label(),
            OTHER,
            "other is never forgotten"
        );
        metrics.forget_upstream("h7:80");
        assert_eq!(metrics.upstream_met_on_the_fly("late:80").label(), "late:80");
    }
}
