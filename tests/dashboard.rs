//! The Grafana dashboard (`deploy/grafana/egress-sidecar.json`) against the sidecar's
//! `/metrics`: every metric name in every panel's query is a family a sidecar that served
//! traffic exports (a histogram only through its `_bucket`, `_sum` or `_count`), and on a quiet
//! sidecar every family the dashboard reads by upstream has a sample at 0 for each configured
//! upstream, at start and for an upstream a reload adds, so its panels show zeros, not "no
//! data". The PromQL reading is tested here too (`support::dashboard::selectors`).

mod support;

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use support::dashboard::{self, Selector};
use support::{ChildSidecar, FakeUpstream, RefusingPort};

/// Families keyed by labels only traffic reveals (an app, a model, a status of an LLM answer):
/// none exists before the first answer, so their queries end in `or on() vector(0)`.
const TRAFFIC_ONLY: &[&str] = &[
    "egress_llm_tokens_total",
    "egress_llm_requests_total",
    "egress_llm_usage_unreadable_total",
    "egress_llm_time_to_first_token_seconds",
];

/// What the issue asks the dashboard to show, by the families that show it.
const REQUIRED: &[&str] = &[
    "egress_upstream_requests_total",
    "egress_upstream_errors_total",
    "egress_upstream_connections",
    "egress_pool_pending_requests",
    "egress_pool_wait_duration_seconds",
    "egress_upstream_connections_opened_total",
    "egress_pool_reused_total",
    "egress_leaks_detected_total",
    "egress_downstream_idle_closed_total",
    "egress_memory_budget_bytes",
    "egress_memory_sheds_total",
    "egress_upstream_retries_total",
    "egress_upstream_timeouts_total",
    "egress_pace_waits_total",
    "egress_llm_tokens_total",
    "egress_global_rate_limit_calls_total",
    "egress_upstream_dns_refreshes_total",
    "egress_upstream_ejections_total",
    "egress_process_resident_memory_bytes",
];

fn names(expr: &str) -> Vec<String> {
    dashboard::selectors(expr).into_iter().map(|s| s.name).collect()
}

#[test]
fn promql_names_are_told_from_functions_labels_and_keywords() {
    assert_eq!(
        dashboard::selectors(
            r#"sum by (upstream, code) (rate(egress_a_total{upstream=~"$upstream", code!="2.."}[$__rate_interval]))"#
        ),
        vec![Selector {
            name: "egress_a_total".into(),
            labels: vec!["upstream".into(), "code".into()],
        }]
    );
    assert_eq!(
        names(r#"histogram_quantile(0.99, sum by (le) (rate(h_bucket{x="a}{b"}[5m]))) or on() vector(0)"#),
        ["h_bucket"]
    );
    assert_eq!(
        names("a / ignoring (code) group_left b offset 1h30m > bool 0.5e3 unless on(instance) c"),
        ["a", "b", "c"]
    );
    assert_eq!(
        names("sum without (instance, pod) (x) * on (job) group_right (env) max(y) and z @ start() + topk by (a) (3, w)"),
        ["x", "y", "z", "w"]
    );
    assert_eq!(
        names(r#"count(up{job='by (x)'}) # a comment naming not_a_metric"#),
        ["up"]
    );
    assert_eq!(
        names("label_replace(m, \"dst\", \"$1\", \"src\", \"(.*)\")"),
        ["m"]
    );
    assert!(!dashboard::selectors("rate(m[1m])")[0].by_upstream());
}

#[test]
fn histogram_series_map_to_their_family() {
    let families = dashboard::families(
        "# TYPE egress_h histogram\n# TYPE egress_c_total counter\n# TYPE egress_g_count gauge\n",
    );
    let of = |n| dashboard::family_of(n, &families);
    assert_eq!(of("egress_h_bucket").as_deref(), Some("egress_h"));
    assert_eq!(of("egress_h_count").as_deref(), Some("egress_h"));
    assert_eq!(of("egress_h"), None, "a histogram's own name selects nothing");
    assert_eq!(of("egress_c_total").as_deref(), Some("egress_c_total"));
    assert_eq!(of("egress_g_count").as_deref(), Some("egress_g_count"));
    assert_eq!(of("egress_g"), None);
    assert_eq!(of("egress_c_total_count"), None);
}

/// The families the dashboard queries, each with whether some query selects it by upstream.
fn dashboard_families(exposition: &str) -> (HashMap<String, bool>, Vec<String>) {
    let families = dashboard::families(exposition);
    let mut used = HashMap::new();
    let mut unknown = Vec::new();
    for query in dashboard::queries(&dashboard::load()) {
        let selectors = dashboard::selectors(&query.expr);
        if selectors.is_empty() {
            unknown.push(format!(
                "{} ({}): no metric in {}",
                query.panel, query.ref_id, query.expr
            ));
        }
        for selector in selectors {
            let (by_upstream, name) = (selector.by_upstream(), selector.name);
            match dashboard::family_of(&name, &families) {
                Some(family) => *used.entry(family).or_insert(false) |= by_upstream,
                None => unknown.push(format!("{} ({}): {name}", query.panel, query.ref_id)),
            }
        }
    }
    (used, unknown)
}

async fn metrics_text(admin: SocketAddr) -> String {
    let resp = support::admin_get(admin, "/metrics").await;
    assert_eq!(resp.status, 200);
    resp.text()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_metric_is_exported_by_a_sidecar_that_served_traffic() {
    let dash = dashboard::load();
    assert!(dash["schemaVersion"].as_u64().unwrap_or(0) >= 36, "schemaVersion");
    let vars = dash["templating"]["list"].as_array().expect("templating.list");
    let var = |name: &str| {
        vars.iter()
            .find(|v| v["name"] == name)
            .unwrap_or_else(|| panic!("no ${name} variable"))
    };
    assert_eq!(var("datasource")["type"], "datasource");
    assert_eq!(var("datasource")["query"], "prometheus");
    let upstream_var = var("upstream")["definition"]
        .as_str()
        .expect("$upstream definition");
    let label_values = upstream_var
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(", upstream)"))
        .unwrap_or_else(|| panic!("$upstream is not label_values(METRIC, upstream): {upstream_var}"));

    let upstream = FakeUpstream::start().await;
    let llm = dashboard::llm_origin().await;
    let service = RefusingPort::new();
    let yaml = dashboard::upstreams_yaml(&[("api", upstream.addr)], service.addr, Some(llm.addr));
    let sidecar = ChildSidecar::spawn(&yaml).await;
    let urls = [format!("http://{}/", upstream.addr)];
    dashboard::traffic(sidecar.addr, "127.0.0.1", &urls, &llm, 5).await;
    let text = metrics_text(sidecar.admin).await;

    let (used, mut unknown) = dashboard_families(&text);
    if dashboard::family_of(label_values, &dashboard::families(&text)).is_none() {
        unknown.push(format!("$upstream variable: {label_values}"));
    }
    let mut listed: Vec<_> = used.keys().collect();
    listed.sort();
    println!("the dashboard reads {} families: {listed:?}", listed.len());
    assert!(unknown.is_empty(), "not exported by the sidecar: {unknown:#?}");
    let missing: Vec<_> = REQUIRED.iter().filter(|f| !used.contains_key(**f)).collect();
    assert!(missing.is_empty(), "the dashboard shows none of {missing:?}");
    for panel in dash["panels"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] != "row")
    {
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "panel {} must use the $datasource variable",
            panel["title"]
        );
    }
}

/// For each family the dashboard reads by upstream, the upstreams with no sample at 0 in it;
/// and the other families (traffic-only ones aside) with no sample at all.
fn missing_zeros(text: &str, used: &HashMap<String, bool>, upstreams: &[&str]) -> Vec<String> {
    let families = dashboard::families(text);
    let samples = dashboard::samples(text);
    let mut missing = Vec::new();
    let mut sorted: Vec<_> = used.iter().collect();
    sorted.sort();
    for (family, by_upstream) in sorted {
        if TRAFFIC_ONLY.contains(&family.as_str()) {
            continue;
        }
        let of_family: Vec<_> = samples
            .iter()
            .filter(|s| dashboard::family_of(&s.name, &families).as_deref() == Some(family))
            .collect();
        if !by_upstream {
            if of_family.is_empty() {
                missing.push(format!("{family}: no sample"));
            }
            continue;
        }
        for upstream in upstreams {
            let zero = of_family
                .iter()
                .any(|s| s.labels.get("upstream").map(String::as_str) == Some(upstream) && s.value == 0.0);
            if !zero {
                missing.push(format!("{family}{{upstream=\"{upstream}\"}}: no sample at 0"));
            }
        }
    }
    missing
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_sidecar_has_every_upstream_family_at_zero_from_start_and_reload() {
    let service = RefusingPort::new();
    let origins = [RefusingPort::new(), RefusingPort::new(), RefusingPort::new()];
    let alpha_beta = [("alpha", origins[0].addr), ("beta", origins[1].addr)];
    let sidecar = ChildSidecar::spawn(&dashboard::upstreams_yaml(&alpha_beta, service.addr, None)).await;
    let text = metrics_text(sidecar.admin).await;
    let (used, unknown) = dashboard_families(&text);
    let unknown: Vec<_> = unknown
        .iter()
        .filter(|u| !TRAFFIC_ONLY.iter().any(|f| u.contains(&format!(": {f}"))))
        .collect();
    assert!(unknown.is_empty(), "not exported: {unknown:#?}");
    let by_upstream: BTreeSet<_> = used.iter().filter(|(_, u)| **u).map(|(f, _)| f).collect();
    println!("families read by upstream: {by_upstream:?}");
    assert!(by_upstream.len() >= 15, "{by_upstream:?}");
    let missing = missing_zeros(&text, &used, &["alpha", "beta"]);
    assert!(missing.is_empty(), "at start:\n{}", missing.join("\n"));
    assert!(
        text.contains("\negress_leaks_detected_total 0\n"),
        "the leak counter at 0 from start"
    );

    // What traffic alone makes exists only through `or on() vector(0)`.
    for query in dashboard::queries(&dashboard::load()) {
        let traffic_only = names(&query.expr)
            .iter()
            .any(|n| TRAFFIC_ONLY.iter().any(|f| n.starts_with(f)));
        if traffic_only {
            assert!(
                query.expr.trim_end().ends_with("or on() vector(0)"),
                "{} ({}) reads a family traffic makes and needs `or on() vector(0)`: {}",
                query.panel,
                query.ref_id,
                query.expr
            );
        }
    }

    // An upstream a reload adds starts at zero too.
    let all = [alpha_beta[0], alpha_beta[1], ("gamma", origins[2].addr)];
    sidecar.rewrite_config(&dashboard::upstreams_yaml(&all, service.addr, None));
    sidecar.signal("-HUP");
    let reloaded = support::fetch_until(
        Duration::from_secs(10),
        || metrics_text(sidecar.admin),
        |t| t.contains("upstream=\"gamma\""),
    )
    .await;
    let missing = missing_zeros(&reloaded, &used, &["alpha", "beta", "gamma"]);
    assert!(missing.is_empty(), "after the reload:\n{}", missing.join("\n"));
}
