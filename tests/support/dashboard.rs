//! The Grafana dashboard as tests read it: its queries, the metric names in a PromQL
//! expression, the families of an exposition (a histogram's `_bucket`, `_sum` and `_count` map
//! to it) and its samples; and a sidecar config and traffic that give its panels something to
//! show (a global quota whose service refuses, an OpenAI-shaped origin). Used by path
//! (`support::dashboard`) by tests/dashboard.rs and tests/prometheus.rs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use super::{Answer, RawClient, ScriptedOrigin};

/// The sidecar's `upstreams:` for `names` at `addrs`, each with a global quota at `service`
/// (a port that refuses: each call fails and the request goes, `failure_mode: allow`), and an
/// upstream `llm` at `llm` read as OpenAI's API, when given.
pub fn upstreams_yaml(
    upstreams: &[(&str, SocketAddr)],
    service: SocketAddr,
    llm: Option<SocketAddr>,
) -> String {
    let mut yaml = String::from("upstreams:\n");
    let quota = format!(
        "    global_rate_limit: {{ service: http://{service}, domain: egress, descriptors: [[{{ key: upstream }}]] }}\n"
    );
    for (name, addr) in upstreams {
        yaml.push_str(&format!("  - name: {name}\n    url: http://{addr}\n{quota}"));
    }
    if let Some(addr) = llm {
        yaml.push_str(&format!(
            "  - name: llm\n    url: http://{addr}\n    llm: {{ usage: openai }}\n{quota}"
        ));
    }
    yaml
}

const MODEL: &str = "gpt-4o-2024-08-06";

/// An origin answering as OpenAI's chat completions: JSON with usage (`/v1/chat/completions`),
/// an event stream whose last event carries it (`/stream`), and a 200 whose body is no JSON
/// (`/broken`: its usage is unreadable).
pub async fn llm_origin() -> ScriptedOrigin {
    let origin = ScriptedOrigin::start().await;
    let usage = r#""usage":{"prompt_tokens":8,"completion_tokens":5,"total_tokens":13}"#;
    let json = format!(r#"{{"id":"c1","object":"chat.completion","model":"{MODEL}","choices":[],{usage}}}"#);
    origin.script(
        "/v1/chat/completions",
        vec![Answer::ok(&json).header("content-type", "application/json")],
    );
    let delta = format!(r#"data: {{"model":"{MODEL}","choices":[{{"delta":{{"content":"hi"}}}}]}}"#);
    let last = format!(r#"data: {{"model":"{MODEL}","choices":[],{usage}}}"#);
    origin.script(
        "/stream",
        vec![Answer::status(200)
            .header("content-type", "text/event-stream")
            .chunk(Duration::from_millis(5), &format!("{delta}\n\n"))
            .chunk(Duration::from_millis(5), &format!("{last}\n\ndata: [DONE]\n\n"))],
    );
    origin.script(
        "/broken",
        vec![Answer::ok("not json").header("content-type", "application/json")],
    );
    origin
}

/// `rounds` of: a request to each of `urls` and one of each LLM answer of `llm`, on one
/// connection from `from` (a loopback address) to the sidecar at `proxy`.
pub async fn traffic(proxy: SocketAddr, from: &str, urls: &[String], llm: &ScriptedOrigin, rounds: usize) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let mut client = RawClient::from_stream(socket.connect(proxy).await.unwrap());
    let llm_urls = ["/v1/chat/completions", "/stream", "/broken"].map(|p| llm.url(p));
    for _ in 0..rounds {
        for url in urls.iter().chain(&llm_urls) {
            assert_eq!(client.get(url).await.status, 200, "{url}");
        }
    }
}

/// The dashboard file.
pub const PATH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/grafana/egress-sidecar.json");

/// The dashboard, parsed.
pub fn load() -> serde_json::Value {
    let text = std::fs::read_to_string(PATH).unwrap_or_else(|e| panic!("{PATH}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{PATH} is no JSON: {e}"))
}

/// One query of a panel.
#[derive(Debug, Clone)]
pub struct Query {
    /// The panel's title.
    pub panel: String,
    /// The target's `refId`.
    pub ref_id: String,
    pub expr: String,
}

/// Every panel's targets, rows' nested panels included; panics on a target with no `expr`.
pub fn queries(dashboard: &serde_json::Value) -> Vec<Query> {
    let mut out = Vec::new();
    let mut stack: Vec<&serde_json::Value> = dashboard["panels"].as_array().expect("panels").iter().collect();
    while let Some(panel) = stack.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            stack.extend(nested);
        }
        let title = panel["title"].as_str().unwrap_or("?").to_owned();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"]
                .as_str()
                .filter(|e| !e.trim().is_empty())
                .unwrap_or_else(|| panic!("panel {title:?} has a target without an expr: {target}"));
            out.push(Query {
                panel: title.clone(),
                ref_id: target["refId"].as_str().unwrap_or("?").to_owned(),
                expr: expr.to_owned(),
            });
        }
    }
    out.sort_by(|a, b| (&a.panel, &a.ref_id).cmp(&(&b.panel, &b.ref_id)));
    out
}

/// The query Prometheus is sent for `expr`: every upstream, a 1-minute rate window.
pub fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "15s")
        .replace("$__range", "5m")
        .replace("${upstream}", ".*")
        .replace("$upstream", ".*")
}

/// A vector selector in an expression: the metric name, and the label names its matchers use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    pub name: String,
    pub labels: Vec<String>,
}

impl Selector {
    /// Whether it matches on `upstream`.
    pub fn by_upstream(&self) -> bool {
        self.labels.iter().any(|l| l == "upstream")
    }
}

/// Words that are PromQL, not metric names, even when not followed by `(`: binary operators
/// and modifiers, and the aggregation operators (`sum by (le) (...)`).
const KEYWORDS: &[&str] = &[
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "atan2",
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
/// Keywords whose parenthesised list holds label names.
const LABEL_LISTS: &[&str] = &["by", "without", "on", "ignoring", "group_left", "group_right"];

/// The metric names `expr` selects, in order: not functions or aggregations (a word followed
/// by `(`), not label names (in `{...}` matchers or in the lists of `by`, `without`, `on`,
/// `ignoring`, `group_left`, `group_right`), not strings, durations, numbers, keywords or
/// `$variables`.
pub fn selectors(expr: &str) -> Vec<Selector> {
    let s: Vec<char> = expr.chars().collect();
    let mut out = Vec::new();
    let mut depth = 0usize;
    // The paren depth of an open label list, and whether the next `(` opens one.
    let mut label_list: Option<usize> = None;
    let mut list_next = false;
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&s, i);
        } else if c == '#' {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '[' {
            while i < s.len() && s[i] != ']' {
                i += 1;
            }
            i += 1;
        } else if c == '{' {
            // Matchers with no name before them: the name, if any, is their `__name__`.
            let (labels, name, end) = matchers(&s, i);
            if let Some(name) = name {
                out.push(Selector { name, labels });
            }
            i = end;
        } else if c == '(' {
            depth += 1;
            if list_next {
                label_list = Some(depth);
                list_next = false;
            }
            i += 1;
        } else if c == ')' {
            if label_list == Some(depth) {
                label_list = None;
            }
            depth = depth.saturating_sub(1);
            i += 1;
        } else if c.is_ascii_digit() || (c == '.' && s.get(i + 1).is_some_and(char::is_ascii_digit)) {
            // Numbers and durations: 0.99, 1e3, 0x1f, 5m, 1h30m.
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '.' || s[i] == '_') {
                i += 1;
            }
        } else if c == '$' {
            i += 1;
            while i < s.len() && (s[i].is_ascii_alphanumeric() || "_{}".contains(s[i])) {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == '_' || s[i] == ':') {
                i += 1;
            }
            let word: String = s[start..i].iter().collect();
            let next = s[i..].iter().position(|c| !c.is_whitespace()).map(|p| i + p);
            let next_char = next.map(|p| s[p]);
            if label_list.is_some() {
                continue;
            }
            let lower = word.to_ascii_lowercase();
            if LABEL_LISTS.contains(&lower.as_str()) {
                list_next = next_char == Some('(');
                continue;
            }
            if KEYWORDS.contains(&lower.as_str()) || next_char == Some('(') {
                continue;
            }
            let mut labels = Vec::new();
            if let (Some(p), Some('{')) = (next, next_char) {
                let (named, _, end) = matchers(&s, p);
                labels = named;
                i = end;
            }
            out.push(Selector { name: word, labels });
        } else {
            i += 1;
        }
    }
    out
}

/// Past the string literal opening at `i`.
fn skip_string(s: &[char], i: usize) -> usize {
    let quote = s[i];
    let mut j = i + 1;
    while j < s.len() && s[j] != quote {
        if s[j] == '\\' && quote != '`' {
            j += 1;
        }
        j += 1;
    }
    j + 1
}

/// The label names of the matchers opening at `i` (a `{`), but `__name__`; the value an
/// `__name__="..."` matcher names; and the index past the `}`.
fn matchers(s: &[char], i: usize) -> (Vec<String>, Option<String>, usize) {
    let mut names = Vec::new();
    let mut metric = None;
    let mut last: Option<String> = None;
    let mut j = i + 1;
    while j < s.len() && s[j] != '}' {
        let c = s[j];
        if c == '"' || c == '\'' || c == '`' {
            let end = skip_string(s, j);
            if last.as_deref() == Some("__name__") && s.get(j - 1) == Some(&'=') {
                metric = Some(s[j + 1..end - 1].iter().collect());
            }
            j = end;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = j;
            while j < s.len() && (s[j].is_ascii_alphanumeric() || s[j] == '_') {
                j += 1;
            }
            let name: String = s[start..j].iter().collect();
            if name != "__name__" {
                names.push(name.clone());
            }
            last = Some(name);
        } else {
            j += 1;
        }
    }
    (names, metric, j + 1)
}

/// Family names and their types, from the `# TYPE` lines of the classic text format.
pub fn families(exposition: &str) -> HashMap<String, String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| (name.to_owned(), kind.trim().to_owned()))
        .collect()
}

/// The family a series name queried by PromQL belongs to: itself when it is a family other
/// than a histogram or summary, the histogram when it is one's `_bucket`, `_sum` or `_count`
/// (a summary's `_sum` or `_count`). A histogram's own name selects nothing in Prometheus, so
/// it is no match.
pub fn family_of(name: &str, families: &HashMap<String, String>) -> Option<String> {
    match families.get(name).map(String::as_str) {
        Some("histogram" | "summary") => None,
        Some(_) => Some(name.to_owned()),
        None => ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = name.strip_suffix(suffix)?;
            match families.get(base).map(String::as_str) {
                Some("histogram") => Some(base.to_owned()),
                Some("summary") if *suffix != "_bucket" => Some(base.to_owned()),
                _ => None,
            }
        }),
    }
}

/// One sample line of the text format.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: HashMap<String, String>,
    pub value: f64,
}

/// Every sample of an exposition.
pub fn samples(exposition: &str) -> Vec<Sample> {
    exposition
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|line| {
            let name_end = line
                .find(['{', ' '])
                .unwrap_or_else(|| panic!("sample line {line:?}"));
            let name = line[..name_end].to_owned();
            let mut labels = HashMap::new();
            let mut rest = &line[name_end..];
            if rest.starts_with('{') {
                let chars: Vec<char> = rest.chars().collect();
                let mut j = 1;
                while j < chars.len() && chars[j] != '}' {
                    let start = j;
                    while chars[j] != '=' {
                        j += 1;
                    }
                    let key: String = chars[start..j].iter().collect();
                    j += 2; // `="`
                    let mut value = String::new();
                    while chars[j] != '"' {
                        if chars[j] == '\\' {
                            j += 1;
                        }
                        value.push(chars[j]);
                        j += 1;
                    }
                    j += 1;
                    if chars.get(j) == Some(&',') {
                        j += 1;
                    }
                    labels.insert(key.trim().to_owned(), value);
                }
                let consumed: usize = chars[..=j].iter().map(|c| c.len_utf8()).sum();
                rest = &rest[consumed..];
            }
            let value = rest
                .split_whitespace()
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no value in {line:?}"));
            Sample { name, labels, value }
        })
        .collect()
}
