//! The Prometheus alert rules (`deploy/prometheus/`): promtool accepts them and passes their
//! unit tests, every metric their expressions name is one a sidecar that served traffic
//! exports, and the PrometheusRule manifest carries the rule file's groups exactly.
//!
//! promtool is Debian's `prometheus` package: without it the promtool test is skipped, except
//! under CI=true, where it fails naming the package.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;
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

// === metric names in PromQL ===

/// Words of PromQL that are no metric: binary and set operators, modifiers, aggregations.
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "inf",
    "nan",
    "start",
    "end",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];
/// Keywords followed by a list of label names.
const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];

/// A vector selector: its metric name and the label names its matchers use.
#[derive(Debug, PartialEq)]
struct Selector {
    name: String,
    labels: Vec<String>,
}

/// The end of the string literal opening at `at`.
fn skip_string(b: &[u8], at: usize) -> usize {
    let quote = b[at];
    let mut i = at + 1;
    while i < b.len() && b[i] != quote {
        i += if b[i] == b'\\' && quote != b'`' { 2 } else { 1 };
    }
    i + 1
}

/// The index past the bracket closing the one at `at`, strings skipped.
fn skip_bracketed(b: &[u8], at: usize) -> usize {
    let (open, close) = (
        b[at],
        match b[at] {
            b'(' => b')',
            b'[' => b']',
            _ => b'}',
        },
    );
    let mut depth = 0;
    let mut i = at;
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' | b'`' => {
                i = skip_string(b, i);
                continue;
            }
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    b.len()
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b':'
}

/// The label names of the matchers in the braces at `at` (`{a="x", b=~"y"}`), and a metric
/// name given as `__name__="..."`.
fn matchers(b: &[u8], at: usize) -> (Vec<String>, Option<String>) {
    let end = skip_bracketed(b, at);
    let (mut labels, mut name) = (Vec::new(), None);
    let mut i = at + 1;
    while i < end - 1 {
        i = skip_ws(b, i);
        let start = i;
        while i < end && is_ident(b[i]) {
            i += 1;
        }
        let label = String::from_utf8_lossy(&b[start..i]).into_owned();
        i = skip_ws(b, i);
        let exact = b.get(i) == Some(&b'=') && b.get(i + 1) != Some(&b'~');
        while i < end && !matches!(b[i], b'"' | b'\'' | b'`') {
            i += 1;
        }
        if i >= end {
            break;
        }
        let value_end = skip_string(b, i);
        if label == "__name__" && exact {
            name = Some(String::from_utf8_lossy(&b[i + 1..value_end - 1]).into_owned());
        } else if !label.is_empty() {
            labels.push(label);
        }
        i = skip_ws(b, value_end);
        if b.get(i) == Some(&b',') {
            i += 1;
        }
    }
    (labels, name)
}

/// The vector selectors of a PromQL expression: identifiers that are not functions, keywords,
/// label names (in braces and after `by`, `on`, ...), strings, durations or numbers.
fn selectors(expr: &str) -> Vec<Selector> {
    let b = expr.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' | b'\'' | b'`' => i = skip_string(b, i),
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'[' => i = skip_bracketed(b, i),
            b'{' => {
                let (labels, name) = matchers(b, i);
                if let Some(name) = name {
                    out.push(Selector { name, labels });
                }
                i = skip_bracketed(b, i);
            }
            c if c.is_ascii_digit() || c == b'.' => {
                while i < b.len() && (is_ident(b[i]) || b[i] == b'.') {
                    i += 1;
                }
            }
            c if is_ident(c) => {
                let start = i;
                while i < b.len() && is_ident(b[i]) {
                    i += 1;
                }
                let word = &expr[start..i];
                let next = skip_ws(b, i);
                let lower = word.to_ascii_lowercase();
                if LABEL_LISTS.contains(&lower.as_str()) {
                    if b.get(next) == Some(&b'(') {
                        i = skip_bracketed(b, next);
                    }
                } else if KEYWORDS.contains(&lower.as_str()) || b.get(next) == Some(&b'(') {
                    // an operator, or a function's name
                } else if b.get(next) == Some(&b'{') {
                    let (labels, _) = matchers(b, next);
                    out.push(Selector {
                        name: word.to_owned(),
                        labels,
                    });
                    i = skip_bracketed(b, next);
                } else {
                    out.push(Selector {
                        name: word.to_owned(),
                        labels: Vec::new(),
                    });
                }
            }
            _ => i += 1,
        }
    }
    out
}

/// Families in classic text: name (counters with `_total`) to type.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.trim().to_owned()))
        .collect()
}

/// The family a series name belongs to: itself unless it is a histogram's `_bucket`, `_sum` or
/// `_count` (a histogram's own name has no series).
fn family_of<'a>(name: &'a str, families: &BTreeMap<String, String>) -> Option<&'a str> {
    match families.get(name).map(String::as_str) {
        Some("histogram" | "summary") => None,
        Some(_) => Some(name),
        None => ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = name.strip_suffix(suffix)?;
            match families.get(base).map(String::as_str) {
                Some("histogram") => Some(base),
                Some("summary") if *suffix != "_bucket" => Some(base),
                _ => None,
            }
        }),
    }
}

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
