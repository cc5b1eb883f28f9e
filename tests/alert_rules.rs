//! The Prometheus alert rules (`deploy/prometheus/`): promtool accepts them and passes their
//! unit tests, every metric their expressions name is one a sidecar that served traffic
//! exports, and the PrometheusRule manifest carries the rule file's groups exactly.
//!
//! promtool is Debian's `prometheus` package: without it the promtool test is skipped, except
//! under CI=true, where it fails naming the package.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;
use support::dashboard::{families, family_of, selectors};
use support::{admin_get, FakeUpstream, RawClient, RefusingPort, Sidecar};

const RULES: &str = "deploy/prometheus/egress-sidecar-rules.yaml";
const RULE_TESTS: &str = "deploy/prometheus/egress-sidecar-rules.test.yaml";
const MANIFEST: &str = "deploy/kubernetes/prometheus-rules.yaml";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn yaml(path: &str) -> Value {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    serde_norway::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every rule of every group in a rule file's parsed YAML.
fn rules(file: &Value) -> Vec<&Value> {
    let groups = file["groups"].as_array().expect("groups");
    groups
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules"))
        .collect()
}

/// promtool, where Debian puts it or on PATH.
fn promtool() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("promtool"));
    std::iter::once(PathBuf::from("/usr/bin/promtool"))
        .chain(on_path)
        .find(|p| p.is_file())
}

/// Runs `promtool args...` from the crate root; its output, or a panic with it on failure.
fn run_promtool(promtool: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new(promtool)
        .args(args)
        .current_dir(root())
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn promtool_checks_the_rules_and_passes_their_unit_tests() {
    let Some(promtool) = promtool() else {
        return support::skip("no promtool (Debian's prometheus package)");
    };
    let checked = run_promtool(&promtool, &["check", "rules", RULES]);
    println!("{checked}");
    let alerts = rules(&yaml(RULES)).len();
    assert!(
        checked.contains(&format!("SUCCESS: {alerts} rules found")),
        "{checked}"
    );
    let tested = run_promtool(&promtool, &["test", "rules", RULE_TESTS]);
    println!("{tested}");
    assert!(tested.contains("SUCCESS"), "{tested}");

    // Every alert has a group that fires it and one that expects nothing of it: a test file
    // that left an alert out would pass all the same.
    let tests = yaml(RULE_TESTS);
    let mut fired = BTreeSet::new();
    let mut quiet = BTreeSet::new();
    for group in tests["tests"].as_array().expect("tests") {
        for case in group["alert_rule_test"].as_array().into_iter().flatten() {
            let name = case["alertname"].as_str().unwrap().to_owned();
            match case["exp_alerts"].as_array().map(Vec::len) {
                Some(0) | None => quiet.insert(name),
                Some(_) => fired.insert(name),
            };
        }
    }
    for rule in rules(&yaml(RULES)) {
        let name = rule["alert"].as_str().expect("only alerts");
        assert!(fired.contains(name), "no unit test fires {name}");
        assert!(quiet.contains(name), "no unit test keeps {name} quiet");
    }
}

#[test]
fn the_prometheus_rule_manifest_carries_the_rule_files_groups() {
    let manifest = yaml(MANIFEST);
    assert_eq!(manifest["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(manifest["kind"], "PrometheusRule");
    assert_eq!(
        manifest["metadata"]["labels"]["release"], "kube-prometheus-stack",
        "kube-prometheus-stack's default ruleSelector"
    );
    let file = yaml(RULES);
    assert!(!rules(&file).is_empty());
    assert_eq!(
        manifest["spec"]["groups"], file["groups"],
        "{MANIFEST}'s spec.groups must be {RULES}'s groups"
    );
}

#[test]
fn every_alert_says_what_to_do_and_has_a_runbook() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let headings: BTreeSet<String> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|h| h.trim().to_lowercase())
        .collect();
    let file = yaml(RULES);
    for group in file["groups"].as_array().unwrap() {
        assert!(group["name"].as_str().unwrap().starts_with("egress-sidecar"));
    }
    for rule in rules(&file) {
        let name = rule["alert"].as_str().expect("only alerts");
        assert!(rule["labels"]["severity"].is_string(), "{name}: severity");
        for key in ["summary", "description"] {
            let text = rule["annotations"][key].as_str().unwrap_or_default();
            assert!(text.len() > 20, "{name}: annotations.{key} is {text:?}");
        }
        let anchor = name.to_lowercase();
        assert_eq!(
            rule["annotations"]["runbook_url"],
            format!("README.md#{anchor}"),
            "{name}"
        );
        assert!(headings.contains(&anchor), "README.md has no '### {name}'");
    }
}

// === metric names in PromQL (the reader is tests/support/dashboard.rs's) ===

/// The problems with `expr`'s selectors against an exposition: names of no family, and label
/// names no sample of their family carries (checked where the family has samples).
fn unexported(expr: &str, text: &str) -> Vec<String> {
    let families = families(text);
    let mut problems = Vec::new();
    for selector in selectors(expr) {
        let Some(family) = family_of(&selector.name, &families) else {
            problems.push(format!("{} is no series the sidecar exports", selector.name));
            continue;
        };
        let samples: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.strip_prefix(selector.name.as_str())
                    .is_some_and(|rest| rest.starts_with(['{', ' ']))
            })
            .collect();
        if samples.is_empty() {
            println!("{family}: no samples after this traffic, its label names go unchecked");
            continue;
        }
        for label in &selector.labels {
            let key = format!("{label}=\"");
            if !samples
                .iter()
                .any(|s| s.contains(&format!("{{{key}")) || s.contains(&format!(",{key}")))
            {
                problems.push(format!("{}: no sample has a label {label}", selector.name));
            }
        }
    }
    problems
}

#[test]
fn the_promql_reader_finds_selectors_and_skips_the_rest() {
    let expr = r#"
        sum without (instance, pod, code) (
            label_replace(rate(egress_a_total{code="429", upstream=~"x|y"}[5m]), "source", "up", "", "")
          or on (upstream) group_left (code)
            {__name__="egress_b", state!="z"} offset 5m
        ) / ignoring (code) egress_c_bucket > bool 0.05 and histogram_quantile(0.9, egress_d) # egress_e
    "#;
    let found = selectors(expr);
    let names: Vec<(&str, Vec<&str>)> = found
        .iter()
        .map(|s| (s.name.as_str(), s.labels.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        names,
        [
            ("egress_a_total", vec!["code", "upstream"]),
            ("egress_b", vec!["state"]),
            ("egress_c_bucket", vec![]),
            ("egress_d", vec![]),
        ]
    );

    let text = "# TYPE egress_a_total counter\negress_a_total{upstream=\"u\",code=\"200\"} 1\n\
                # TYPE egress_h histogram\negress_h_bucket{le=\"1\"} 1\negress_h_sum 1\negress_h_count 1\n";
    assert!(unexported(
        "rate(egress_a_total{code=\"5..\"}[5m]) + rate(egress_h_bucket[1m])",
        text
    )
    .is_empty());
    assert_eq!(
        unexported(
            "egress_a + egress_h + egress_h_total + egress_a_total{status=\"429\"}",
            text
        ),
        [
            "egress_a is no series the sidecar exports",
            "egress_h is no series the sidecar exports",
            "egress_h_total is no series the sidecar exports",
            "egress_a_total: no sample has a label status",
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_name_is_exported_by_a_sidecar_that_served_traffic() {
    let upstream = FakeUpstream::start().await;
    let refusing = RefusingPort::new();
    // A rate-limit service that refuses connections: its calls fail (and count as `error`), and
    // `failure_mode: allow` lets the requests through.
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: up\n    url: http://{}\n    global_rate_limit:\n      service: http://{}\n      \
         domain: egress\n      descriptors: [[{{ key: upstream }}]]\n      timeout: 100ms\n      failure_mode: allow\n",
        upstream.addr, refusing.addr
    ))
    .await;
    for _ in 0..3 {
        let resp = RawClient::connect(sidecar.addr)
            .await
            .get(&format!("http://{}/", upstream.addr))
            .await;
        assert_eq!(resp.status, 200);
    }
    let failed = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{}/", refusing.addr))
        .await;
    assert_eq!(failed.status, 502);

    let scraped = admin_get(sidecar.admin, "/metrics").await;
    assert_eq!(scraped.status, 200);
    let text = scraped.text();
    assert!(
        families(&text).contains_key("egress_upstream_requests_total"),
        "classic text names counters by their samples:\n{text}"
    );
    let mut problems = Vec::new();
    let mut named = 0;
    for rule in rules(&yaml(RULES)) {
        let name = rule["alert"].as_str().expect("only alerts");
        let expr = rule["expr"].as_str().expect("expr");
        let found = selectors(expr);
        assert!(!found.is_empty(), "{name}: no metric found in {expr}");
        named += found.len();
        problems.extend(
            unexported(expr, &text)
                .into_iter()
                .map(|p| format!("{name}: {p}")),
        );
    }
    assert!(problems.is_empty(), "{}\n{text}", problems.join("\n"));
    println!("{named} selectors checked against /metrics");
    sidecar.stop().await;
}
