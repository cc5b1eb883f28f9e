//! The token-accounting tests' view of the sidecar (tests/llm_usage.rs): a child sidecar for
//! the scripted LLM provider and its route listeners, its CPU time; the `egress_llm_*` metrics
//! as tables; `/debug/usage` and the access log against them; raw requests and streams through
//! a route listener, as the SDKs send them.

use super::llm_provider::{digest, Answer, LlmProvider, Shape, Spend, Writes};
use super::*;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use serde_json::Value;

pub const CHAT: &str = "/v1/chat/completions";

// === the sidecar ===

/// The route listeners of upstreams openai, anthropic and gemini, from the sidecar's log.
pub async fn routes(sidecar: &ChildSidecar) -> [SocketAddr; 3] {
    let find = |name: &str| -> Option<SocketAddr> {
        sidecar.logged("route listener").iter().find_map(|line| {
            let v: Value = serde_json::from_str(line).ok()?;
            let fields = if v["fields"].is_object() { &v["fields"] } else { &v };
            (fields["upstream"] == name).then(|| fields["listen"].as_str()?.parse().ok())?
        })
    };
    let mut found = None;
    for _ in 0..250 {
        if let (Some(a), Some(b), Some(c)) = (find("openai"), find("anthropic"), find("gemini")) {
            found = Some([a, b, c]);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    found.unwrap_or_else(|| panic!("no route listeners logged: {:?}", sidecar.logged("listen")))
}

/// A sidecar for the provider's three upstreams with route listeners, `llm.usage` as given, a
/// pool for `connections`, and `extra` config at the top.
pub async fn sidecar(
    provider: &LlmProvider,
    usage: &str,
    connections: usize,
    extra: &str,
) -> (ChildSidecar, [SocketAddr; 3]) {
    sidecar_with_env(provider, usage, connections, extra, &[]).await
}

/// Like [`sidecar`], with extra environment variables.
pub async fn sidecar_with_env(
    provider: &LlmProvider,
    usage: &str,
    connections: usize,
    extra: &str,
    env: &[(&str, &str)],
) -> (ChildSidecar, [SocketAddr; 3]) {
    let yaml = format!("{extra}{}", provider.upstreams_yaml(usage, true, connections));
    let sidecar = ChildSidecar::spawn_with_env(&yaml, env).await;
    let routes = routes(&sidecar).await;
    (sidecar, routes)
}

/// CPU time the process has used (user + system), from /proc/PID/stat (in USER_HZ, 100 a
/// second on Linux).
pub fn cpu_seconds(sidecar: &ChildSidecar) -> f64 {
    let pid = sidecar.child.id().expect("running");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

// === metrics ===

pub type Key = (String, String, String); // upstream, app, model

pub fn sample_value(s: &prometheus_parse::Sample) -> f64 {
    match s.value {
        prometheus_parse::Value::Counter(v)
        | prometheus_parse::Value::Gauge(v)
        | prometheus_parse::Value::Untyped(v) => v,
        _ => panic!("{} is not a number", s.metric),
    }
}

/// Every sample of `name` as (labels named by `keys`) -> value.
pub fn series(scrape: &prometheus_parse::Scrape, name: &str, keys: &[&str]) -> BTreeMap<Vec<String>, f64> {
    let mut out = BTreeMap::new();
    for s in scrape.samples.iter().filter(|s| s.metric == name) {
        let labels = keys
            .iter()
            .map(|k| {
                s.labels
                    .get(k)
                    .unwrap_or_else(|| panic!("{name} without label {k}"))
                    .to_owned()
            })
            .collect();
        *out.entry(labels).or_insert(0.0) += sample_value(s);
    }
    out
}

/// `egress_llm_tokens_total` by (upstream, app, model) -> Spend.
pub fn token_table(scrape: &prometheus_parse::Scrape) -> BTreeMap<Key, Spend> {
    let mut out: BTreeMap<Key, Spend> = BTreeMap::new();
    for (labels, v) in series(
        scrape,
        "egress_llm_tokens_total",
        &["upstream", "app", "model", "type"],
    ) {
        let key = (labels[0].clone(), labels[1].clone(), labels[2].clone());
        let spend = out.entry(key).or_default();
        let v = v as u64;
        match labels[3].as_str() {
            "input" => spend.input += v,
            "output" => spend.output += v,
            "cache_read" => spend.cache_read += v,
            "cache_write" => spend.cache_write += v,
            "reasoning" => spend.reasoning += v,
            other => panic!("egress_llm_tokens_total with type {other}"),
        }
    }
    out
}

/// The types each (upstream, app, model) of `egress_llm_tokens_total` has a series for.
pub fn token_types(scrape: &prometheus_parse::Scrape) -> BTreeMap<Key, BTreeSet<String>> {
    let mut out: BTreeMap<Key, BTreeSet<String>> = BTreeMap::new();
    for labels in series(
        scrape,
        "egress_llm_tokens_total",
        &["upstream", "app", "model", "type"],
    )
    .into_keys()
    {
        out.entry((labels[0].clone(), labels[1].clone(), labels[2].clone()))
            .or_default()
            .insert(labels[3].clone());
    }
    out
}

/// `egress_llm_requests_total` by (upstream, app, model, status).
pub fn request_table(scrape: &prometheus_parse::Scrape) -> BTreeMap<Vec<String>, u64> {
    series(
        scrape,
        "egress_llm_requests_total",
        &["upstream", "app", "model", "status"],
    )
    .into_iter()
    .map(|(k, v)| (k, v as u64))
    .collect()
}

/// `egress_llm_usage_unreadable_total` by (upstream, reason).
pub fn unreadable_table(scrape: &prometheus_parse::Scrape) -> BTreeMap<(String, String), u64> {
    series(
        scrape,
        "egress_llm_usage_unreadable_total",
        &["upstream", "reason"],
    )
    .into_iter()
    .map(|(k, v)| ((k[0].clone(), k[1].clone()), v as u64))
    .collect()
}

/// `egress_llm_time_to_first_token_seconds` observations by (upstream, model).
pub fn first_token_counts(scrape: &prometheus_parse::Scrape) -> BTreeMap<(String, String), u64> {
    series(
        scrape,
        "egress_llm_time_to_first_token_seconds_count",
        &["upstream", "model"],
    )
    .into_iter()
    .map(|(k, v)| ((k[0].clone(), k[1].clone()), v as u64))
    .collect()
}

/// The cumulative buckets of `egress_llm_time_to_first_token_seconds{upstream, model}`:
/// (upper bound in seconds, observations at or below it).
pub fn first_token_buckets(
    scrape: &prometheus_parse::Scrape,
    upstream: &str,
    model: &str,
) -> Vec<(f64, f64)> {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == "egress_llm_time_to_first_token_seconds")
        .filter(|s| s.labels.get("upstream") == Some(upstream) && s.labels.get("model") == Some(model))
        .flat_map(|s| match &s.value {
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.iter().map(|b| (b.less_than, b.count)).collect::<Vec<_>>()
            }
            _ => panic!("{} is not a histogram", s.metric),
        })
        .collect()
}

pub fn llm_series_count(scrape: &prometheus_parse::Scrape) -> usize {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric.starts_with("egress_llm_"))
        .count()
}

/// Scrapes until `egress_llm_requests_total` sums to `n` (10 s at most: answers are counted
/// when they end, which the app may see a moment before the sidecar).
pub async fn scrape_when_counted(admin: SocketAddr, n: u64) -> prometheus_parse::Scrape {
    let total = |m: &prometheus_parse::Scrape| request_table(m).values().sum::<u64>();
    let m = scrape_until(admin, Duration::from_secs(10), |m| total(m) >= n).await;
    if total(&m) != n {
        let text = admin_get(admin, "/metrics").await.text();
        let llm: Vec<&str> = text.lines().filter(|l| l.contains("egress_llm_")).collect();
        panic!(
            "{} LLM answers counted, not {n}; the llm metrics:\n{}",
            total(&m),
            llm.join("\n")
        );
    }
    m
}

// === raw requests ===

/// POSTs `body` to `path` on `addr` (a route listener) with `x-test-id: id` and, when given,
/// `x-egress-app`, on `client`; returns the response head's status and the body bytes.
pub async fn post(
    client: &mut RawClient,
    path: &str,
    id: &str,
    app: Option<&str>,
    body: &str,
) -> (u16, Vec<u8>) {
    send_post(client, path, id, app, body).await;
    let resp = tokio::time::timeout(Duration::from_secs(30), client.read_response(false))
        .await
        .unwrap_or_else(|_| panic!("{id}: no answer in 30 s"))
        .unwrap_or_else(|| panic!("{id}: closed before an answer"));
    (resp.status, resp.body)
}

/// Sends a POST of `body` to `path` with `x-test-id: id` and, when given, `x-egress-app`.
pub async fn send_post(client: &mut RawClient, path: &str, id: &str, app: Option<&str>, body: &str) {
    let app = app.map(|a| format!("x-egress-app: {a}\r\n")).unwrap_or_default();
    client
        .send_raw(
            format!(
                "POST {path} HTTP/1.1\r\nHost: api.test\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nx-test-id: {id}\r\n{app}\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await;
}

/// The request body an SDK sends for `shape`.
pub fn request_body(shape: Shape, model: &str) -> String {
    let messages = "[{\"role\":\"user\",\"content\":\"What do tokens cost?\"}]";
    match shape {
        Shape::Chat {
            stream,
            include_usage,
        } => {
            let options = if include_usage {
                ",\"stream_options\":{\"include_usage\":true}"
            } else {
                ""
            };
            format!("{{\"model\":\"{model}\",\"messages\":{messages},\"stream\":{stream}{options}}}")
        }
        Shape::Responses { stream } => {
            format!("{{\"model\":\"{model}\",\"input\":\"What do tokens cost?\",\"stream\":{stream}}}")
        }
        Shape::Messages { stream } => {
            format!(
                "{{\"model\":\"{model}\",\"max_tokens\":256,\"messages\":{messages},\"stream\":{stream}}}"
            )
        }
        Shape::Gemini { .. } => {
            "{\"contents\":[{\"role\":\"user\",\"parts\":[{\"text\":\"What do tokens cost?\"}]}]}".into()
        }
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

pub fn hex(bytes: &[u8]) -> String {
    digest([bytes]).0
}

/// One stream: the times from the request to the response head and to the end of the first
/// event, and the body's hash.
pub async fn timed_stream(route: SocketAddr, id: &str) -> (Duration, Duration, String) {
    let mut client = RawClient::connect(route).await;
    let body = request_body(
        Shape::Chat {
            stream: true,
            include_usage: true,
        },
        "gpt-4o",
    );
    let start = Instant::now();
    send_post(&mut client, CHAT, id, None, &body).await;
    let (status, _) = client.read_head().await;
    let head = start.elapsed();
    assert_eq!(status, 200);
    let mut got = Vec::new();
    let mut first = None;
    while let Some(chunk) = client.read_chunk().await {
        if chunk.is_empty() {
            break;
        }
        got.extend_from_slice(&chunk);
        if first.is_none() && got.windows(2).any(|w| w == b"\n\n") {
            first = Some(start.elapsed());
        }
    }
    (head, first.expect("an event"), hex(&got))
}

/// Holds `n` streams of `events` (answered as `content_type`, script `id`) mid-body: each app
/// has its head and first event, the provider holds the rest. Returns the sidecar's VmRSS then
/// (KiB); then they finish, and each app's bytes are checked.
pub async fn hold_streams(
    sidecar: &ChildSidecar,
    provider: &LlmProvider,
    route: SocketAddr,
    (id, n): (&str, usize),
    events: &[Bytes],
    content_type: &'static str,
) -> u64 {
    let want_hash = digest(events.iter().map(|e| &e[..])).0;
    let (release, released) = tokio::sync::watch::channel(false);
    provider.script(
        id,
        Answer::Raw {
            content_type,
            events: events.to_vec(),
            writes: Writes::Held(released),
        },
    );
    let first_seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let connecting = std::sync::Arc::new(tokio::sync::Semaphore::new(64));
    let mut streams = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (first_seen, connecting, id) = (first_seen.clone(), connecting.clone(), id.to_owned());
        streams.spawn(async move {
            let permit = connecting.acquire_owned().await.unwrap();
            let mut client = RawClient::connect(route).await;
            let body = request_body(
                Shape::Chat {
                    stream: true,
                    include_usage: true,
                },
                "gpt-4o-mini",
            );
            send_post(&mut client, CHAT, &id, None, &body).await;
            let (status, _) = client.read_head().await;
            assert_eq!(status, 200);
            let mut got = client.read_chunk().await.expect("the first event");
            first_seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(permit);
            while let Some(chunk) = client.read_chunk().await {
                if chunk.is_empty() {
                    break;
                }
                got.extend_from_slice(&chunk);
            }
            hex(&got)
        });
    }
    let all_held = eventually(Duration::from_secs(30), || {
        first_seen.load(std::sync::atomic::Ordering::SeqCst) == n && provider.holding() == n
    })
    .await;
    assert!(
        all_held,
        "{n} streams held mid-body: {} apps saw their first event, the provider holds {}",
        first_seen.load(std::sync::atomic::Ordering::SeqCst),
        provider.holding()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = sidecar.status_kib("VmRSS");
    release.send(true).unwrap();
    while let Some(done) = streams.join_next().await {
        assert_eq!(done.unwrap(), want_hash, "a held stream finishes untouched");
    }
    held
}

/// Asserts that `/debug/usage` agrees with the metrics in `m`, row by row, in both spans, and
/// has a row for each of `want`.
pub async fn assert_debug_usage(admin: SocketAddr, m: &prometheus_parse::Scrape, want: &BTreeSet<Key>) {
    let tokens = token_table(m);
    let resp = admin_get(admin, "/debug/usage").await;
    assert_eq!(resp.status, 200, "/debug/usage: {}", resp.text());
    let usage: Value = serde_json::from_slice(&resp.body).expect("/debug/usage is JSON");
    let requests = request_table(m);
    for span in ["since_start", "last_60s"] {
        let rows = usage[span]
            .as_array()
            .unwrap_or_else(|| panic!("no {span} array in {usage}"));
        let mut seen = BTreeSet::new();
        for row in rows {
            let key: Key = (
                row["upstream"].as_str().unwrap().into(),
                row["app"].as_str().unwrap().into(),
                row["model"].as_str().unwrap().into(),
            );
            let n: u64 = requests
                .iter()
                .filter(|(k, _)| k[..3] == [key.0.clone(), key.1.clone(), key.2.clone()])
                .map(|(_, v)| v)
                .sum();
            let s = tokens.get(&key).copied().unwrap_or_default();
            let got = [
                "requests",
                "input_tokens",
                "output_tokens",
                "cache_read_tokens",
                "cache_write_tokens",
                "reasoning_tokens",
            ]
            .map(|f| row[f].as_u64().unwrap_or_else(|| panic!("{f} in {row}")));
            assert_eq!(
                got,
                [n, s.input, s.output, s.cache_read, s.cache_write, s.reasoning],
                "/debug/usage {span} row {row} against the metrics"
            );
            assert!(
                seen.insert(key.clone()),
                "/debug/usage {span}: one row per {key:?}"
            );
        }
        assert!(
            want.is_subset(&seen),
            "/debug/usage {span} has a row for every (upstream, app, model): {want:?} in {seen:?}"
        );
    }
}

/// The access log's `input_tokens`, `output_tokens` and `cached_tokens` summed by (upstream,
/// model), over the JSON lines that name a model.
pub fn access_log_sums(lines: &[Vec<u8>]) -> BTreeMap<(String, String), [u64; 3]> {
    let mut logged: BTreeMap<(String, String), [u64; 3]> = BTreeMap::new();
    for line in lines {
        let v: Value = serde_json::from_slice(line).expect("JSON access log line");
        let Some(model) = v["model"].as_str() else {
            continue;
        };
        let sums = logged
            .entry((v["upstream"].as_str().unwrap().into(), model.into()))
            .or_default();
        for (i, f) in ["input_tokens", "output_tokens", "cached_tokens"]
            .iter()
            .enumerate()
        {
            sums[i] += v[f].as_u64().unwrap_or(0);
        }
    }
    logged
}
