//! Prometheus metrics on a registry owned by [`Metrics`] and passed to what it measures (no
//! globals), rendered in the text format for the admin listener's `/metrics`.
//!
//! prometheus-client (the official Rust client) is used rather than tikv's `prometheus`: it is
//! maintained, its labels are typed structs, and it carries no protobuf dependency.
//!
//! Counters and histograms are updated where things happen. The pool gauges (connections by
//! state, waiting requests, the learned upstream idle timeout) are read from the pools at scrape
//! time, and the downstream gauge is held by a guard in each connection task, so all are exact
//! and return to 0 when connections close, whatever closed them.
//!
//! Label cardinality is bounded: past [`MAX_UPSTREAM_LABELS`] distinct upstream labels, new
//! upstreams are counted under `other`.
//!
//! What a dashboard panel reads exists from start-up at zero: each upstream's handles make its
//! series for the label values known before any traffic (see `UpstreamMetrics::start_at_zero`),
//! and the unlabelled and fixed-label families are made with the registry. A status code beyond
//! `200`, a retried status, an app or a model is only known once traffic shows it.
//!
//! Not handled here: serving `/metrics` (`admin`); the gauges computed at scrape time
//! (`gauges`); the classic text format (`classic`).

mod classic;
mod gauges;
mod global_rate_limit;
mod latency;
mod llm;
mod pace;
mod per_upstream;

pub use global_rate_limit::GlobalRateLimitMetrics;
pub use latency::Latency;
pub use llm::LlmMetrics;
pub use pace::{PaceMetrics, UnitLabels};
use per_upstream::{by_upstream, UpstreamFamily};

use std::collections::HashSet;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Distinct `upstream` label values before new ones become `other`.
pub const MAX_UPSTREAM_LABELS: usize = 256;
/// The label for upstreams past the budget.
pub const OTHER: &str = "other";

/// `upstream`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    /// Configured name, or host:port.
    pub upstream: String,
}

/// `upstream`, `code`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    /// Configured name, or host:port.
    pub upstream: String,
    /// HTTP status.
    pub code: u16,
}

/// `upstream`, `reason`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Configured name, or host:port.
    pub upstream: String,
    /// Why.
    pub reason: &'static str,
}

by_upstream!(CodeLabels, ReasonLabels, RetryLabels, KindLabels, HeaderLabels);

impl per_upstream::ByUpstream for UpstreamLabel {
    const ALONE: bool = true;

    fn upstream(&self) -> &str {
        &self.upstream
    }

    fn alone(upstream: &str) -> Option<Self> {
        let upstream = upstream.to_owned();
        Some(UpstreamLabel { upstream })
    }
}

/// `kind` of a tunnel: `connect` (an opaque CONNECT), `connect_http` and `connect_h2` (plain
/// HTTP/1.x or h2c inside a CONNECT, served through the pool) or `upgrade` (a `101` switch such
/// as WebSocket).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// `connect`, `connect_http`, `connect_h2` or `upgrade`.
    pub kind: &'static str,
}

/// `upstream`, `reason` (a retry's: a status among them).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetryLabels {
    /// Configured name, or host:port.
    pub upstream: String,
    /// Why.
    pub reason: String,
}

/// `upstream`, `kind`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// Configured name, or host:port.
    pub upstream: String,
    /// Which.
    pub kind: &'static str,
}

/// `upstream`, `header`: a header an upstream sent whose value was ignored.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeaderLabels {
    /// Configured name, or host:port.
    pub upstream: String,
    /// The header's name, lowercase.
    pub header: &'static str,
}

/// `reason` a CONNECT answered by the sidecar was closed without serving anything, or (`h2_error`)
/// its h2c connection ended with a protocol error.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabel {
    /// `tls_port_not_allowed`, `not_http`, `no_request` or `h2_error`.
    pub reason: &'static str,
}

/// `result` of a config reload: `success` or `failure`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `success` or `failure`.
    pub result: &'static str,
}

/// Why spans were dropped: `queue_full` or `export_failed`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabel {
    /// The reason.
    pub reason: &'static str,
}

/// What the memory budget shed: `downstream_idle`, `upstream_idle` or `accept_paused`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabel {
    /// The shedding step.
    pub action: &'static str,
}

/// The memory budget's shedding steps, made at zero with the registry.
const MEMORY_SHED_ACTIONS: [&str; 3] = ["downstream_idle", "upstream_idle", "accept_paused"];

/// Retry reasons known before any traffic: the policy's (`upstream::retry`) and the
/// connection-level ones (`upstream`); a retried status is only known once seen.
const RETRY_REASONS: [&str; 5] = [
    "connect_failure",
    "reset",
    "stale_connection",
    "refused_stream",
    "unsent",
];

/// Deadline kinds of `egress_upstream_timeouts_total`.
const TIMEOUT_KINDS: [&str; 3] = ["request", "body_idle", "response_header"];

/// Upstream close reasons an idle-closes panel reads: the pool's own idle timeouts and the
/// upstream closing a connection (idle ones, mostly). The others start when first counted.
const IDLE_CLOSE_REASONS: [&str; 3] = ["idle_timeout", "learned_idle_timeout", "upstream_close"];

fn requests_per_connection_histogram() -> Histogram {
    Histogram::new([1.0, 2.0, 5.0, 10.0, 100.0, 1000.0, 10000.0])
}

/// 1 ms .. ~65 s (`Latency`): LLM calls think for minutes, pool waits are usually
/// sub-millisecond.
type LatencyFamily = UpstreamFamily<UpstreamLabel, Latency>;

/// The families every upstream and downstream connection reports into.
#[derive(Debug)]
pub struct Families {
    opened: UpstreamFamily<UpstreamLabel, Counter>,
    closed: UpstreamFamily<ReasonLabels, Counter>,
    requests: UpstreamFamily<CodeLabels, Counter>,
    duration: LatencyFamily,
    wait: LatencyFamily,
    reused: UpstreamFamily<UpstreamLabel, Counter>,
    rejected: UpstreamFamily<ReasonLabels, Counter>,
    retries: UpstreamFamily<RetryLabels, Counter>,
    errors: UpstreamFamily<KindLabels, Counter>,
    retry_budget_exhausted: UpstreamFamily<UpstreamLabel, Counter>,
    timeouts: UpstreamFamily<KindLabels, Counter>,
    ejections: UpstreamFamily<UpstreamLabel, Counter>,
    dns_refreshes: UpstreamFamily<UpstreamLabel, Counter>,
    dns_failures: UpstreamFamily<UpstreamLabel, Counter>,
    ignored_headers: UpstreamFamily<HeaderLabels, Counter>,
    /// Panics caught in a request's or a connection's task (`crate::caught`).
    pub panics: Counter,
    /// Downstream connections accepted.
    pub downstream_opened: Counter,
    /// Downstream connections open now (a guard per connection task keeps it exact).
    pub downstream_open: Gauge,
    /// Idle application connections parked now (`downstream::park`).
    pub downstream_parked: Gauge,
    /// Downstream keep-alive connections closed by `idle_timeout`.
    pub downstream_idle_closed: Counter,
    /// Warnings the leak detector logged (`clients`): one per flagged source and window.
    pub leaks_detected: Counter,
    /// Requests each downstream connection carried, observed when it closes.
    pub downstream_requests_per_connection: Histogram,
    tunnels_opened: Family<KindLabel, Counter>,
    tunnels_active: Family<KindLabel, Gauge>,
    tunnels_refused: Family<RefusalLabel, Counter>,
    /// Config reloads by result.
    pub reloads: Family<ResultLabel, Counter>,
    /// 1 when the last reload was applied (or none was tried), 0 when it was rejected.
    pub last_reload_successful: Gauge,
    /// The memory budget in bytes (0: none).
    pub memory_budget: Gauge,
    /// Memory usage as the budget measures it, at the last measurement.
    pub memory_usage: Gauge,
    memory_sheds: Family<ActionLabel, Counter>,
    /// Access log lines dropped because the writer was behind.
    pub access_log_dropped: Counter,
    /// Spans not exported, by reason.
    trace_spans_dropped: Family<DropLabel, Counter>,
}

impl Families {
    /// Every family empty, every counter and gauge at 0.
    fn new() -> Self {
        Families {
            opened: UpstreamFamily::default(),
            closed: UpstreamFamily::default(),
            requests: UpstreamFamily::default(),
            duration: UpstreamFamily::default(),
            wait: UpstreamFamily::default(),
            reused: UpstreamFamily::default(),
            rejected: UpstreamFamily::default(),
            retries: UpstreamFamily::default(),
            errors: UpstreamFamily::default(),
            retry_budget_exhausted: UpstreamFamily::default(),
            timeouts: UpstreamFamily::default(),
            ejections: UpstreamFamily::default(),
            dns_refreshes: UpstreamFamily::default(),
            dns_failures: UpstreamFamily::default(),
            ignored_headers: UpstreamFamily::default(),
            panics: Counter::default(),
            access_log_dropped: Counter::default(),
            trace_spans_dropped: Family::default(),
            downstream_opened: Counter::default(),
            downstream_open: Gauge::default(),
            downstream_parked: Gauge::default(),
            downstream_idle_closed: Counter::default(),
            leaks_detected: Counter::default(),
            downstream_requests_per_connection: requests_per_connection_histogram(),
            tunnels_opened: Family::default(),
            tunnels_active: Family::default(),
            tunnels_refused: Family::default(),
            reloads: Family::default(),
            last_reload_successful: Gauge::default(),
            memory_budget: Gauge::default(),
            memory_usage: Gauge::default(),
            memory_sheds: Family::default(),
        }
    }

    /// Removes every series of the upstream labelled `upstream`.
    fn forget(&self, upstream: &str) {
        let families = [
            &self.opened,
            &self.reused,
            &self.retry_budget_exhausted,
            &self.ejections,
            &self.dns_refreshes,
            &self.dns_failures,
        ];
        for family in families {
            family.forget(upstream);
        }
        self.duration.forget(upstream);
        self.wait.forget(upstream);
        self.closed.forget(upstream);
        self.rejected.forget(upstream);
        self.requests.forget(upstream);
        self.retries.forget(upstream);
        self.errors.forget(upstream);
        self.timeouts.forget(upstream);
        self.ignored_headers.forget(upstream);
    }

    /// Upstream connections and the requests they carry: opened, closed, sent, timed,
    /// reused, refused by the pool, retried.
    fn register_upstream_traffic(&self, registry: &mut Registry) {
        registry.register(
            "upstream_connections_opened",
            "Upstream connections opened",
            self.opened.clone(),
        );
        registry.register(
            "upstream_connections_closed",
            "Upstream connections closed, by reason",
            self.closed.clone(),
        );
        registry.register(
            "upstream_requests",
            "Requests sent to upstreams, by final status (sidecar-made errors included)",
            self.requests.clone(),
        );
        registry.register(
            "upstream_request_duration_seconds",
            "Time from sending a request upstream to its response head",
            self.duration.clone(),
        );
        registry.register(
            "pool_wait_duration_seconds",
            "Time a request waited for a pooled connection or stream",
            self.wait.clone(),
        );
        registry.register(
            "pool_reused",
            "Requests that reused an open connection",
            self.reused.clone(),
        );
        registry.register(
            "pool_rejected",
            "Requests refused by the pool, by reason",
            self.rejected.clone(),
        );
        registry.register(
            "upstream_retries",
            "Requests sent again, by reason: connect_failure, reset, a response status, or the \
             connection-level stale_connection, refused_stream, unsent",
            self.retries.clone(),
        );
        registry.register(
            "upstream_errors",
            "Answers the sidecar made itself to requests routed to an upstream, by x-egress-error kind \
             (admission refusals such as rate_limited included)",
            self.errors.clone(),
        );
        registry.register(
            "upstream_ignored_headers",
            "Header values an upstream sent that were ignored: a Retry-After or retry-after-ms that is no bounded duration",
            self.ignored_headers.clone(),
        );
    }

    /// What went wrong inside the sidecar: caught panics, access log lines dropped.
    fn register_faults(&self, registry: &mut Registry) {
        registry.register(
            "panics",
            "Panics caught in a request's or a connection's task: a bug; the request got 502 internal where it still could",
            self.panics.clone(),
        );
        registry.register(
            "access_log_dropped",
            "Access log lines dropped because the writer was behind",
            self.access_log_dropped.clone(),
        );
        registry.register(
            "trace_spans_dropped",
            "Spans not exported: queue_full (the export queue was full) or export_failed (the \
             collector did not take their batch)",
            self.trace_spans_dropped.clone(),
        );
    }

    /// The counter of spans dropped for `reason` (`queue_full`, `export_failed`).
    pub fn trace_spans_dropped(&self, reason: &'static str) -> Counter {
        self.trace_spans_dropped
            .get_or_create(&DropLabel { reason })
            .clone()
    }

    /// An upstream's health: its retry budget, deadlines, outlier ejections, DNS.
    fn register_upstream_health(&self, registry: &mut Registry) {
        registry.register(
            "upstream_retry_budget_exhausted",
            "Retries not made because the upstream's retry budget was spent",
            self.retry_budget_exhausted.clone(),
        );
        registry.register(
            "upstream_timeouts",
            "Exchanges cut by a deadline, by kind: request (request_timeout), body_idle \
             (body_idle_timeout), response_header (response_header_timeout)",
            self.timeouts.clone(),
        );
        registry.register(
            "upstream_ejections",
            "Endpoints ejected by outlier detection (consecutive connect failures or resets)",
            self.ejections.clone(),
        );
        registry.register(
            "upstream_dns_refreshes",
            "Resolutions of an upstream's host name",
            self.dns_refreshes.clone(),
        );
        registry.register(
            "upstream_dns_failures",
            "Resolutions of an upstream's host name that failed (the last good answer is kept up to dns.max_ttl)",
            self.dns_failures.clone(),
        );
    }

    /// Application connections: accepted, open, parked, closed idle, requests per
    /// connection.
    fn register_downstream(&self, registry: &mut Registry) {
        registry.register(
            "downstream_connections_opened",
            "Application connections accepted",
            self.downstream_opened.clone(),
        );
        registry.register(
            "downstream_connections",
            "Open application connections",
            self.downstream_open.clone(),
        );
        registry.register(
            "downstream_parked_connections",
            "Idle application keep-alive connections parked outside their tasks (idle over 100 ms)",
            self.downstream_parked.clone(),
        );
        registry.register(
            "downstream_idle_closed",
            "Application keep-alive connections closed by downstream.idle_timeout",
            self.downstream_idle_closed.clone(),
        );
        registry.register(
            "leaks_detected",
            "Times the leak detector flagged an application source (a new connection per request); \
             the source is named in the warning it logs and in /debug/clients",
            self.leaks_detected.clone(),
        );
        registry.register(
            "downstream_requests_per_connection",
            "Requests per application connection, observed at close (1 everywhere = a leaky client)",
            self.downstream_requests_per_connection.clone(),
        );
    }

    /// Tunnels: opened, active, refused.
    fn register_tunnels(&self, registry: &mut Registry) {
        registry.register(
            "tunnels_opened",
            "Tunnels established: opaque CONNECT (kind=connect), plain HTTP inside a CONNECT served through the pool (kind=connect_http, connect_h2) and protocol switches such as WebSocket (kind=upgrade)",
            self.tunnels_opened.clone(),
        );
        registry.register(
            "tunnels_active",
            "Tunnels open now, by kind",
            self.tunnels_active.clone(),
        );
        registry.register(
            "tunnels_refused",
            "CONNECTs the sidecar answered itself and closed without serving, by reason",
            self.tunnels_refused.clone(),
        );
    }

    /// Config reloads: by result, and whether the last one applied.
    fn register_reloads(&self, registry: &mut Registry) {
        registry.register(
            "config_reloads",
            "Config reloads (SIGHUP or file change), by result",
            self.reloads.clone(),
        );
        registry.register(
            "config_last_reload_successful",
            "1 when the last config reload was applied (or none was tried), 0 when it was rejected",
            self.last_reload_successful.clone(),
        );
    }

    /// The memory budget: its size, the usage it measures, what it shed.
    fn register_memory(&self, registry: &mut Registry) {
        registry.register(
            "memory_budget_bytes",
            "The memory budget: budget.memory_bytes, or budget.memory_fraction of the cgroup limit (0: none)",
            self.memory_budget.clone(),
        );
        registry.register(
            "memory_usage_bytes",
            "Memory usage as the budget measures it (cgroup working set, or RSS), at the last measurement",
            self.memory_usage.clone(),
        );
        registry.register(
            "memory_sheds",
            "What the memory budget shed: idle application connections (downstream_idle), idle upstream connections (upstream_idle), accept pauses (accept_paused)",
            self.memory_sheds.clone(),
        );
    }

    /// Counts a tunnel of `kind` opened; the returned gauge handle counts it as active until
    /// decremented.
    pub fn tunnel_opened(&self, kind: &'static str) -> Gauge {
        let label = KindLabel { kind };
        self.tunnels_opened.get_or_create(&label).inc();
        let active = self.tunnels_active.get_or_create_owned(&label);
        active.inc();
        active
    }

    /// Counts a CONNECT answered here whose inside was closed unserved, for `reason`.
    pub fn tunnel_refused(&self, reason: &'static str) {
        self.tunnels_refused.get_or_create(&RefusalLabel { reason }).inc();
    }

    /// CONNECTs answered here and closed unserved for `reason` so far.
    pub fn tunnels_refused(&self, reason: &'static str) -> u64 {
        self.tunnels_refused.get_or_create(&RefusalLabel { reason }).get()
    }

    /// What the memory budget shed by `action` so far.
    pub fn memory_sheds(&self, action: &'static str) -> u64 {
        self.memory_sheds.get_or_create(&ActionLabel { action }).get()
    }

    /// Counts `n` things the memory budget shed by `action`.
    pub fn memory_shed(&self, action: &'static str, n: u64) {
        if n > 0 {
            self.memory_sheds.get_or_create(&ActionLabel { action }).inc_by(n);
        }
    }

    /// Tunnels of `kind` opened so far and open now.
    #[cfg(test)]
    pub fn tunnel_counts(&self, kind: &'static str) -> (u64, i64) {
        let label = KindLabel { kind };
        (
            self.tunnels_opened.get_or_create(&label).get(),
            self.tunnels_active.get_or_create(&label).get(),
        )
    }
}

/// Counts one open tunnel in `egress_tunnels_active{kind}` for as long as it lives.
#[derive(Debug)]
pub struct ActiveGuard(Gauge);

impl ActiveGuard {
    /// Counts a tunnel of `kind` opened, and active until this is dropped.
    pub fn new(metrics: &Metrics, kind: &'static str) -> Self {
        ActiveGuard(metrics.families().tunnel_opened(kind))
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// What a pool tells the gauges at scrape time.
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolCounts {
    /// Connections dialing, in use or idle.
    pub open: usize,
    /// Idle connections: HTTP/1.1 ones in the idle list and HTTP/2 ones carrying no stream.
    pub idle: usize,
    /// Requests waiting for a connection or stream.
    pub pending: usize,
    /// The upstream's own idle timeout, once learned.
    pub learned_idle_timeout: Option<std::time::Duration>,
    /// Endpoints by state: active, ejected, draining.
    pub endpoints: [usize; 3],
}

/// A pool as the gauges see it; the pool implements it, so metrics need not know pools.
pub trait PoolSource: Send + Sync + std::fmt::Debug {
    /// The counts now.
    fn counts(&self) -> PoolCounts;
}

/// What gauges are read from at scrape time.
#[derive(Debug, Default)]
struct GaugeSources {
    pools: Mutex<Vec<(String, Weak<dyn PoolSource>)>>,
}

/// The registry and its families.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    families: Arc<Families>,
    pace: Arc<pace::PaceFamilies>,
    llm: Arc<llm::LlmFamilies>,
    global_rate_limit: global_rate_limit::GlobalRateLimitFamilies,
    sources: Arc<GaugeSources>,
    labels: Mutex<HashSet<String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric of the contract, prefixed `egress_`. Families register in
    /// the order the exposition lists them.
    pub fn new() -> Self {
        let families = Arc::new(Families::new());
        families.last_reload_successful.set(1);
        let sources = Arc::new(GaugeSources::default());
        let mut registry = Registry::with_prefix("egress");
        families.register_upstream_traffic(&mut registry);
        families.register_faults(&mut registry);
        families.register_upstream_health(&mut registry);
        families.register_downstream(&mut registry);
        families.register_tunnels(&mut registry);
        families.register_reloads(&mut registry);
        families.register_memory(&mut registry);
        let pace = Arc::new(pace::PaceFamilies::default());
        pace.register(&mut registry);
        let llm = Arc::new(llm::LlmFamilies::default());
        llm.register(&mut registry);
        let global_rate_limit = global_rate_limit::GlobalRateLimitFamilies::default();
        global_rate_limit.register(&mut registry);
        registry.register_collector(Box::new(gauges::GaugeCollector(sources.clone())));
        for action in MEMORY_SHED_ACTIONS {
            families.memory_sheds.get_or_create_owned(&ActionLabel { action });
        }
        Metrics {
            registry,
            families,
            pace,
            llm,
            global_rate_limit,
            sources,
            labels: Mutex::new(HashSet::new()),
        }
    }

    /// The OpenMetrics text exposition (what Prometheus asks for).
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The classic Prometheus text format (0.0.4), for agents that read no OpenMetrics.
    pub fn render_classic(&self) -> String {
        classic::from_openmetrics(&self.render())
    }

    /// The downstream counters.
    pub fn families(&self) -> &Families {
        &self.families
    }

    /// The label for `name`, within the cardinality budget.
    fn label(&self, name: &str) -> String {
        let mut labels = self.labels.lock().unwrap_or_else(|p| p.into_inner());
        if labels.contains(name) || labels.len() < MAX_UPSTREAM_LABELS && labels.insert(name.to_owned()) {
            name.to_owned()
        } else {
            OTHER.to_owned()
        }
    }

    /// The pacing handles of the upstream named `name`.
    pub fn pace(&self, name: &str) -> PaceMetrics {
        self.pace.handles(self.label(name))
    }

    /// The token-accounting handles of the upstream named `name`.
    pub fn llm(&self, name: &str) -> LlmMetrics {
        LlmMetrics::new(self.label(name), self.llm.clone())
    }

    /// The global rate limit's handles of the upstream named `name`.
    pub fn global_rate_limit(&self, name: &str) -> GlobalRateLimitMetrics {
        self.global_rate_limit.handles(self.label(name))
    }

    /// What LLM answers spent, by upstream, app and model (`/debug/usage`).
    pub fn usage(&self) -> crate::llm::ledger::Report {
        self.llm.ledger.report()
    }

    /// Removes every series labelled `upstream` and gives its place under the label cap back:
    /// a host met on the fly has been forgotten. Not for `other`, which hosts past the cap
    /// share.
    pub fn forget_upstream(&self, upstream: &str) {
        if upstream == OTHER {
            return;
        }
        let mut labels = self.labels.lock().unwrap_or_else(|p| p.into_inner());
        if !labels.remove(upstream) {
            return;
        }
        self.families.forget(upstream);
        self.pace.forget(upstream);
        self.llm.forget(upstream);
        self.global_rate_limit.forget(upstream);
        if crate::resident::mostly_empty(labels.len(), labels.capacity()) {
            labels.shrink_to_fit();
        }
    }

    /// Forgets the gauge sources of pools that are gone (their weak handles keep the pools'
    /// memory until dropped).
    pub fn prune_pool_sources(&self) {
        let mut pools = self.sources.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|(_, weak)| weak.strong_count() > 0);
        if crate::resident::mostly_empty(pools.len(), pools.capacity()) {
            pools.shrink_to_fit();
        }
    }

    /// Handles for one configured upstream named `name`, its series made at zero.
    pub fn upstream(&self, name: &str) -> UpstreamMetrics {
        let upstream = self.upstream_met_on_the_fly(name);
        upstream.start_at_zero();
        upstream
    }

    /// Handles for one upstream met on the fly: its series are made by its traffic only. A
    /// forward proxy meets hosts by the thousand, and each one's zero series (about 2 KB)
    /// would stay while its label lasts (issue 47).
    pub fn upstream_met_on_the_fly(&self, name: &str) -> UpstreamMetrics {
        let label = UpstreamLabel {
            upstream: self.label(name),
        };
        let f = &self.families;
        UpstreamMetrics {
            opened: f.opened.get_or_create_owned(&label),
            reused: f.reused.get_or_create_owned(&label),
            retry_budget_exhausted: f.retry_budget_exhausted.get_or_create_owned(&label),
            ejections: f.ejections.get_or_create_owned(&label),
            dns_refreshes: f.dns_refreshes.get_or_create_owned(&label),
            dns_failures: f.dns_failures.get_or_create_owned(&label),
            duration: f.duration.get_or_create_owned(&label),
            wait: f.wait.get_or_create_owned(&label),
            families: f.clone(),
            sources: self.sources.clone(),
            label: label.upstream,
            codes: Arc::default(),
            ok: Arc::default(),
        }
    }
}

/// One upstream's metric handles (cheap clones of the family members).
#[derive(Debug, Clone)]
pub struct UpstreamMetrics {
    /// Connections opened.
    pub opened: Counter,
    /// Requests on a reused connection or stream.
    pub reused: Counter,
    /// Retries the budget refused.
    pub retry_budget_exhausted: Counter,
    /// Endpoints ejected by outlier detection.
    pub ejections: Counter,
    /// Resolutions of the upstream's host name.
    pub dns_refreshes: Counter,
    /// Resolutions that failed.
    pub dns_failures: Counter,
    /// Time to response head.
    pub duration: Latency,
    /// Time waited for a connection.
    pub wait: Latency,
    families: Arc<Families>,
    sources: Arc<GaugeSources>,
    label: String,
    /// Counters by status already looked up: a request must not pay the family's label
    /// allocation, hash and lock for a status it has seen before.
    codes: Arc<Mutex<Vec<(u16, Counter)>>>,
    /// The `200` counter, what nearly every request counts, without the lock over `codes`
    /// (its lock and release were two atomic read-modify-writes per request).
    ok: Arc<OnceLock<Counter>>,
}

impl UpstreamMetrics {
    /// The `upstream` label its series carry: the upstream's own, or `other` past the cap.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Makes the series a dashboard reads at zero, for the label values known before any
    /// traffic, so a quiet upstream shows 0 rather than no data. `code="200"` is the one status
    /// made: nearly every request ends with it, and no made-up status is ever shown.
    fn start_at_zero(&self) {
        self.ok.get_or_init(|| self.code_counter(200));
        for kind in crate::error::ErrorKind::ROUTED {
            self.error_counter(kind);
        }
        for reason in RETRY_REASONS {
            self.families.retries.get_or_create_owned(&RetryLabels {
                upstream: self.label.clone(),
                reason: reason.to_owned(),
            });
        }
        for kind in TIMEOUT_KINDS {
            self.timeouts(kind);
        }
        for reason in IDLE_CLOSE_REASONS {
            self.families.closed.get_or_create_owned(&ReasonLabels {
                upstream: self.label.clone(),
                reason,
            });
        }
    }

    /// Counts an answer the sidecar made itself to a request for this upstream.
    pub fn failed(&self, kind: crate::error::ErrorKind) {
        self.error_counter(kind).inc();
    }

    fn error_counter(&self, kind: crate::error::ErrorKind) -> Counter {
        let labels = KindLabels {
            upstream: self.label.clone(),
            kind: kind.as_str(),
        };
        self.families.errors.get_or_create_owned(&labels)
    }

    /// Counts a connection closed for `reason`.
    pub fn closed(&self, reason: &'static str) {
        let labels = ReasonLabels {
            upstream: self.label.clone(),
            reason,
        };
        self.families.closed.get_or_create_owned(&labels).inc();
    }

    /// Counts a request sent again for `reason`.
    pub fn retried(&self, reason: &str) {
        let labels = RetryLabels {
            upstream: self.label.clone(),
            reason: reason.to_owned(),
        };
        self.families.retries.get_or_create_owned(&labels).inc();
    }

    /// Counts an exchange cut by a deadline of `kind`.
    pub fn timed_out(&self, kind: &'static str) {
        self.timeouts(kind).inc();
    }

    /// The counter of exchanges cut by a deadline of `kind`, to hold on to.
    pub fn timeouts(&self, kind: &'static str) -> Counter {
        let labels = KindLabels {
            upstream: self.label.clone(),
            kind,
        };
        self.families.timeouts.get_or_create_owned(&labels)
    }

    /// Counts a value of `header` this upstream sent that was ignored; `true` the first time
    /// for this upstream and header, for a caller that logs once.
    pub fn ignored_header(&self, header: &'static str) -> bool {
        let labels = HeaderLabels {
            upstream: self.label.clone(),
            header,
        };
        self.families.ignored_headers.get_or_create_owned(&labels).inc() == 0
    }

    /// Counts a request refused by the pool for `reason`.
    pub fn rejected(&self, reason: &'static str) {
        let labels = ReasonLabels {
            upstream: self.label.clone(),
            reason,
        };
        self.families.rejected.get_or_create_owned(&labels).inc();
    }

    /// Counts a request's final status.
    pub fn request(&self, code: u16) {
        if code == 200 {
            self.ok.get_or_init(|| self.code_counter(code)).inc();
            return;
        }
        let mut codes = self.codes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, counter)) = codes.iter().find(|(c, _)| *c == code) {
            counter.inc();
            return;
        }
        let counter = self.code_counter(code);
        counter.inc();
        codes.push((code, counter));
    }

    fn code_counter(&self, code: u16) -> Counter {
        let labels = CodeLabels {
            upstream: self.label.clone(),
            code,
        };
        self.families.requests.get_or_create_owned(&labels)
    }

    /// Reports `pool`'s gauges under this upstream's label from now on.
    pub fn watch_pool(&self, pool: Weak<dyn PoolSource>) {
        let mut pools = self.sources.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools.retain(|(_, weak)| weak.strong_count() > 0);
        pools.push((self.label.clone(), pool));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `200`'s counter (kept apart from the others) and the rest count into the one family,
    /// across clones of an upstream's metrics.
    #[test]
    fn statuses_count_into_their_series() {
        let metrics = Metrics::new();
        let upstream = metrics.upstream("u");
        let clone = upstream.clone();
        upstream.request(200);
        clone.request(200);
        upstream.request(503);
        drop(upstream);
        let classic = metrics.render_classic();
        for series in [
            "egress_upstream_requests_total{upstream=\"u\",code=\"200\"} 2\n",
            "egress_upstream_requests_total{upstream=\"u\",code=\"503\"} 1\n",
        ] {
            assert!(classic.contains(series), "{series} in {classic}");
        }
    }

    /// An upstream's handles make the dashboard's series at 0, the unlabelled ones exist
    /// with the registry, and past the label budget the zeros go to `other`.
    #[test]
    fn series_start_at_zero_within_the_label_budget() {
        let metrics = Metrics::new();
        let fresh = metrics.render_classic();
        for series in [
            "egress_leaks_detected_total 0\n",
            "egress_memory_sheds_total{action=\"accept_paused\"} 0\n",
        ] {
            assert!(fresh.contains(series), "{series} in {fresh}");
        }
        for i in 0..=MAX_UPSTREAM_LABELS {
            let _ = metrics.upstream(&format!("u{i}"));
        }
        let classic = metrics.render_classic();
        for series in [
            "egress_upstream_requests_total{upstream=\"u0\",code=\"200\"} 0\n",
            "egress_upstream_errors_total{upstream=\"u0\",kind=\"connect_failed\"} 0\n",
            "egress_upstream_errors_total{upstream=\"u0\",kind=\"rate_limited\"} 0\n",
            "egress_upstream_retries_total{upstream=\"u0\",reason=\"connect_failure\"} 0\n",
            "egress_upstream_timeouts_total{upstream=\"u0\",kind=\"response_header\"} 0\n",
            "egress_upstream_connections_closed_total{upstream=\"u0\",reason=\"idle_timeout\"} 0\n",
            "egress_upstream_errors_total{upstream=\"other\",kind=\"pool_overflow\"} 0\n",
        ] {
            assert!(classic.contains(series), "{series} in the exposition");
        }
        let labels: HashSet<&str> = classic
            .lines()
            .filter_map(|l| l.split_once("upstream=\"")?.1.split_once('"'))
            .map(|(label, _)| label)
            .collect();
        assert_eq!(labels.len(), MAX_UPSTREAM_LABELS + 1, "the budget and `other`");
        assert!(!labels.contains(format!("u{MAX_UPSTREAM_LABELS}").as_str()));
    }
}
