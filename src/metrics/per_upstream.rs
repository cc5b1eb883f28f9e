//! A metric family labelled by upstream whose series of one `upstream` value can be removed
//! together: what forgetting a host met on the fly takes back (`Metrics::forget_upstream`).
//!
//! prometheus_client's `Family` removes a series only by its whole label set, cannot list
//! them, and keeps its table's room once its series are removed: the room for the 256 labels
//! the cap allows, about 400 KB over all families once a forward proxy has met that many hosts,
//! stayed after they were all forgotten (issue 47, item 4). So the family here is a table of
//! our own that encodes the way `Family` does (`MetricEncoder::encode_family` per series) and
//! gives its room back when mostly empty. It also notes, by `upstream` value, the label sets it
//! made (a family such as `egress_upstream_requests_total` has one series per status code seen);
//! removing a value removes those. A family labelled by `upstream` alone (most of them) notes
//! nothing: its one series per value is removed by the value. The table is read when a series
//! is made, never when an existing one is counted: the hot path keeps its handles.

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard};

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::family::MetricConstructor;
use prometheus_client::metrics::{MetricType, TypedMetric};

use crate::resident::mostly_empty;

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

/// A metric family, by label set, that can drop every series of one `upstream` value.
pub(super) struct UpstreamFamily<S, M, C = fn() -> M> {
    table: Arc<Mutex<Table<S, M>>>,
    constructor: C,
}

/// The series of a family, and the label sets made by `upstream` value.
struct Table<S, M> {
    series: HashMap<S, M>,
    made: HashMap<Box<str>, Vec<S>>,
}

impl<S, M: Default> Default for UpstreamFamily<S, M> {
    fn default() -> Self {
        UpstreamFamily::with(M::default)
    }
}

impl<S, M, C: Clone> Clone for UpstreamFamily<S, M, C> {
    fn clone(&self) -> Self {
        UpstreamFamily {
            table: self.table.clone(),
            constructor: self.constructor.clone(),
        }
    }
}

impl<S: fmt::Debug, M: fmt::Debug, C> fmt::Debug for UpstreamFamily<S, M, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.lock().series.iter()).finish()
    }
}

impl<S, M, C> UpstreamFamily<S, M, C> {
    fn with(constructor: C) -> Self {
        UpstreamFamily {
            table: Arc::new(Mutex::new(Table {
                series: HashMap::new(),
                made: HashMap::new(),
            })),
            constructor,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table<S, M>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<S, M, C> UpstreamFamily<S, M, C>
where
    S: Clone + Hash + Eq + ByUpstream,
    C: MetricConstructor<M>,
{
    /// A family whose series `constructor` makes (a histogram's buckets).
    pub(super) fn new_with_constructor(constructor: C) -> Self {
        UpstreamFamily::with(constructor)
    }

    /// The series of `labels`, made if new (and noted under its `upstream` value).
    pub(super) fn get_or_create_owned(&self, labels: &S) -> M
    where
        M: Clone,
    {
        let mut table = self.lock();
        if let Some(series) = table.series.get(labels) {
            return series.clone();
        }
        let series = self.constructor.new_metric();
        table.series.insert(labels.clone(), series.clone());
        if !S::ALONE {
            let sets = table.made.entry(labels.upstream().into()).or_default();
            if !sets.contains(labels) {
                sets.push(labels.clone());
            }
        }
        series
    }

    /// Removes every series whose `upstream` is `upstream`, and gives the table's room back
    /// once it is mostly empty.
    pub(super) fn forget(&self, upstream: &str) {
        let mut table = self.lock();
        if let Some(labels) = S::alone(upstream) {
            table.series.remove(&labels);
        } else if let Some(sets) = table.made.remove(upstream) {
            for labels in &sets {
                table.series.remove(labels);
            }
        }
        let Table { series, made } = &mut *table;
        if mostly_empty(series.len(), series.capacity()) {
            series.shrink_to_fit();
        }
        if mostly_empty(made.len(), made.capacity()) {
            made.shrink_to_fit();
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
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        for (labels, series) in &self.lock().series {
            series.encode(encoder.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }

    fn is_empty(&self) -> bool {
        self.lock().series.is_empty()
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
        {
            let table = family.lock();
            assert!(!table.series.contains_key(&labels("a", 200)));
            assert!(!table.series.contains_key(&labels("a", 503)));
            assert_eq!(table.series[&labels("b", 200)].get(), 1);
            assert!(!table.made.contains_key("a"));
        }
        // Made again from zero.
        assert_eq!(family.get_or_create_owned(&labels("a", 200)).get(), 0);
    }

    #[test]
    fn a_family_by_upstream_alone_notes_nothing_and_still_forgets() {
        let family: UpstreamFamily<UpstreamLabel, Counter> = UpstreamFamily::default();
        let a = UpstreamLabel { upstream: "a".into() };
        family.get_or_create_owned(&a).inc();
        assert!(family.lock().made.is_empty());
        family.forget("a");
        assert!(family.lock().series.is_empty());
    }

    #[test]
    fn a_family_gives_its_room_back_once_its_upstreams_are_forgotten() {
        let family: UpstreamFamily<CodeLabels, Counter> = UpstreamFamily::default();
        let name = |i: usize| format!("h{i}:80");
        for i in 0..256 {
            family
                .get_or_create_owned(&CodeLabels {
                    upstream: name(i),
                    code: 200,
                })
                .inc();
        }
        let full = family.lock().series.capacity();
        assert!(full >= 256, "{full}");
        for i in 0..255 {
            family.forget(&name(i));
        }
        let table = family.lock();
        assert_eq!(table.series.len(), 1);
        assert!(
            table.series.capacity() < full / 4,
            "{} of {full}",
            table.series.capacity()
        );
        assert!(table.made.capacity() < 64, "{}", table.made.capacity());
        drop(table);
        family.forget(&name(255));
        let table = family.lock();
        assert_eq!((table.series.capacity(), table.made.capacity()), (0, 0));
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
        host.duration.observe(std::time::Duration::from_millis(10));
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
