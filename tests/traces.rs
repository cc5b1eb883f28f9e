//! OpenTelemetry traces end to end: the sidecar exports OTLP/HTTP (protobuf) to a real
//! OpenTelemetry Collector (tests/otelcol, built from its Go modules), which writes what it
//! received to a file the tests read. Spans per request and per attempt, their parents, their
//! attributes, where a slow request's time went, propagation, and a collector that is down.

mod support;

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::time::Duration;

use serde_json::Value;
use support::otelcol::{attribute, span_duration, stopped_endpoint, Collector};
use support::*;

const SERVER: i64 = 2;
const CLIENT: i64 = 3;

/// An app's W3C trace context: a trace and the app's own span, sampled.
#[derive(Clone)]
struct AppContext {
    trace_id: String,
    span_id: String,
}

impl AppContext {
    fn new() -> Self {
        let draw = || std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
        AppContext {
            trace_id: format!("{:016x}{:016x}", draw(), draw()),
            span_id: format!("{:016x}", draw() | 1),
        }
    }

    fn header(&self, flags: &str) -> String {
        format!("traceparent: 00-{}-{}-{flags}\r\n", self.trace_id, self.span_id)
    }
}

/// A GET through the sidecar's forward proxy for `url`, with `extra` header lines.
async fn get(sidecar: &Sidecar, url: &str, extra: &str) -> RawResponse {
    RawClient::connect(sidecar.addr).await.get_with(url, extra).await
}

fn kind(span: &Value) -> i64 {
    span["kind"]
        .as_i64()
        .unwrap_or_else(|| panic!("span without kind: {span}"))
}

fn text(span: &Value, key: &str) -> String {
    match attribute(span, key) {
        Some(Value::String(s)) => s,
        other => panic!("{key} is {other:?} in {span}"),
    }
}

fn number(span: &Value, key: &str) -> f64 {
    attribute(span, key)
        .and_then(|v| v.as_f64())
        .unwrap_or_else(|| panic!("{key} is no number in {span}"))
}

/// The spans of each trace, by trace id.
fn by_trace(spans: &[Value]) -> HashMap<String, Vec<Value>> {
    let mut traces: HashMap<String, Vec<Value>> = HashMap::new();
    for span in spans {
        let id = span["traceId"].as_str().expect("a traceId").to_owned();
        traces.entry(id).or_default().push(span.clone());
    }
    traces
}

/// A sidecar exporting to `otlp` (`tracing: { otlp }` and `tracing_extra` keys), with one
/// upstream `origin` at `origin` and `upstream_extra`, each line of it indented under it.
async fn traced_sidecar(
    otlp: &str,
    tracing_extra: &str,
    origin: &ScriptedOrigin,
    upstream_extra: &str,
) -> Sidecar {
    let mut yaml = format!(
        "tracing: {{ otlp: \"{otlp}\"{tracing_extra} }}\nupstreams:\n  - name: origin\n    url: http://{}\n",
        origin.addr
    );
    if !upstream_extra.is_empty() {
        yaml.push_str(&format!("    {upstream_extra}\n"));
    }
    Sidecar::start(&yaml).await
}

async fn start_collector() -> Option<Collector> {
    Collector::start().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_traced_requests_make_two_hundred_spans_with_their_parents_and_waits() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    let slow = Duration::from_millis(400);
    origin.script("/slow", vec![Answer::ok("slow").head_after(slow)]);
    // One connection: the requests sent while the slow one holds it wait in the pool's queue.
    let sidecar = traced_sidecar(
        &collector.endpoint(),
        ", sample: 0.0, service_name: traced-sidecar",
        &origin,
        "pool: { max_connections: 1 }",
    )
    .await;

    // Ten rounds: a slow request, and once it holds the connection nine fast ones behind it.
    let mut apps: Vec<(AppContext, bool)> = Vec::new();
    for round in 0..10 {
        let app = AppContext::new();
        apps.push((app.clone(), true));
        let sidecar_addr = sidecar.addr;
        let slow_url = origin.url("/slow");
        let slow_request = tokio::spawn(async move {
            RawClient::connect(sidecar_addr)
                .await
                .get_with(&slow_url, &app.header("01"))
                .await
        });
        origin
            .wait_requests(round * 10 + 1, Duration::from_secs(10))
            .await;
        let mut fast = Vec::new();
        for _ in 0..9 {
            let app = AppContext::new();
            apps.push((app.clone(), false));
            let url = origin.url("/fast?key=secret-in-query");
            fast.push(tokio::spawn(async move {
                RawClient::connect(sidecar_addr)
                    .await
                    .get_with(&url, &app.header("01"))
                    .await
            }));
        }
        assert_eq!(slow_request.await.unwrap().status, 200);
        for request in fast {
            assert_eq!(request.await.unwrap().status, 200);
        }
    }

    let spans = collector.wait_for_spans(200, Duration::from_secs(20)).await;
    assert_eq!(
        spans.len(),
        200,
        "one SERVER and one CLIENT span per request:\n{}",
        collector.log()
    );
    assert!(
        !serde_json::to_string(&spans).unwrap().contains("secret-in-query"),
        "no query in any span"
    );
    let traces = by_trace(&spans);
    let seen = origin.recorded();
    let mut slow_client_spans = 0;
    for (app, is_slow) in &apps {
        let trace = traces
            .get(&app.trace_id)
            .unwrap_or_else(|| panic!("no spans for trace {}", app.trace_id));
        assert_eq!(trace.len(), 2, "{trace:?}");
        let server = trace.iter().find(|s| kind(s) == SERVER).expect("a SERVER span");
        let client = trace.iter().find(|s| kind(s) == CLIENT).expect("a CLIENT span");
        assert_eq!(
            server["parentSpanId"],
            app.span_id.as_str(),
            "under the app's span"
        );
        assert_eq!(
            client["parentSpanId"], server["spanId"],
            "the attempt under the request"
        );
        assert_eq!(server["name"], "GET");
        assert_eq!(client["name"], "GET");
        assert_eq!(
            support::otelcol::resource_attribute(server, "service.name"),
            Some(Value::from("traced-sidecar"))
        );
        let path = if *is_slow { "/slow" } else { "/fast" };
        for span in [server, client] {
            assert_eq!(text(span, "http.request.method"), "GET");
            assert_eq!(text(span, "url.full"), format!("http://{}{path}", origin.addr));
            assert_eq!(text(span, "server.address"), "127.0.0.1");
            assert_eq!(number(span, "server.port"), f64::from(origin.addr.port()));
            assert_eq!(number(span, "http.response.status_code"), 200.0);
            assert_eq!(text(span, "network.protocol.version"), "1.1");
            assert!(attribute(span, "error.type").is_none(), "{span}");
        }
        assert_eq!(text(server, "egress.upstream"), "origin");
        assert_eq!(text(client, "network.peer.address"), "127.0.0.1");
        assert_eq!(text(client, "egress.endpoint"), origin.addr.to_string());
        assert!(["reused", "dialed"].contains(&text(client, "egress.connection").as_str()));
        let waited = number(client, "egress.pool.wait");
        if *is_slow {
            slow_client_spans += 1;
            assert!(
                span_duration(client) >= slow,
                "the slow upstream's time is in the attempt: {client}"
            );
            assert!(span_duration(server) >= span_duration(client));
        } else {
            // Each fast request was sent once the slow one held the only connection.
            assert!(
                waited >= 0.2,
                "a request queued behind a {slow:?} one shows its wait: {waited}s in {client}"
            );
        }
        // The origin saw the attempt's context, not the app's.
        let sent = format!("00-{}-{}-01", app.trace_id, client["spanId"].as_str().unwrap());
        assert!(
            seen.iter()
                .any(|r| r.header("traceparent") == Some(sent.as_str())),
            "the origin got {sent}"
        );
    }
    assert_eq!(slow_client_spans, 10);
    println!(
        "example SERVER and CLIENT spans:\n{}",
        serde_json::to_string_pretty(&traces[&apps[0].0.trace_id]).unwrap()
    );
    sidecar.stop().await;
    collector.stop().await;
}

#[tokio::test]
async fn a_retry_is_an_attempt_of_its_own_with_its_reason() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    origin.script("/flaky", vec![Answer::status(503), Answer::ok("second time")]);
    let retry = "retry: { attempts: 1, on: [503], backoff: { base: 10ms } }";
    let sidecar = traced_sidecar(&collector.endpoint(), "", &origin, retry).await;
    let app = AppContext::new();
    assert_eq!(
        get(&sidecar, &origin.url("/flaky"), &app.header("01"))
            .await
            .status,
        200
    );
    let spans = collector.wait_for_spans(3, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 3, "{spans:?}");
    let server = spans.iter().find(|s| kind(s) == SERVER).unwrap();
    let mut attempts: Vec<&Value> = spans.iter().filter(|s| kind(s) == CLIENT).collect();
    attempts.sort_by_key(|s| s["startTimeUnixNano"].as_str().unwrap().parse::<u64>().unwrap());
    assert!(attempts.iter().all(|a| a["parentSpanId"] == server["spanId"]));
    assert_eq!(number(attempts[0], "http.response.status_code"), 503.0);
    assert_eq!(text(attempts[0], "error.type"), "503");
    assert_eq!(attempts[0]["status"]["code"], 2, "ERROR");
    assert!(attribute(attempts[0], "http.request.resend_count").is_none());
    assert_eq!(number(attempts[1], "http.response.status_code"), 200.0);
    assert_eq!(number(attempts[1], "http.request.resend_count"), 1.0);
    assert_eq!(text(attempts[1], "egress.retry.reason"), "503");
    assert_eq!(text(attempts[1], "egress.connection"), "reused");
    assert_eq!(number(server, "http.request.resend_count"), 1.0);
    assert_eq!(number(server, "http.response.status_code"), 200.0);
    sidecar.stop().await;
    collector.stop().await;
}

#[tokio::test]
async fn propagate_false_keeps_every_trace_field_from_the_upstream() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let private = ScriptedOrigin::start().await;
    let open = ScriptedOrigin::start().await;
    let sidecar = Sidecar::start(&format!(
        "tracing: {{ otlp: \"{}\", sample: 0.0 }}\n\
         upstreams:\n  - name: private\n    url: http://{}\n    tracing: {{ propagate: false }}\n\
         \x20 - name: open\n    url: http://{}\n",
        collector.endpoint(),
        private.addr,
        open.addr
    ))
    .await;
    let context = |app: &AppContext, flags: &str| {
        format!(
            "{}tracestate: vendor=opaque\r\nbaggage: user=alice\r\n",
            app.header(flags)
        )
    };
    let traced = AppContext::new();
    let untraced = AppContext::new();
    for origin in [&private, &open] {
        assert_eq!(
            get(&sidecar, &origin.url("/a"), &context(&traced, "01"))
                .await
                .status,
            200
        );
        assert_eq!(
            get(&sidecar, &origin.url("/b"), &context(&untraced, "00"))
                .await
                .status,
            200
        );
    }
    for seen in private.recorded() {
        for field in ["traceparent", "tracestate", "baggage"] {
            assert_eq!(
                seen.header(field),
                None,
                "{field} reached the private upstream ({})",
                seen.path
            );
        }
    }
    let spans = collector.wait_for_spans(4, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 4, "the sampled requests only: {spans:?}");
    let open_seen = open.recorded();
    let a = open_seen.iter().find(|r| r.path == "/a").unwrap();
    let client = spans
        .iter()
        .find(|s| kind(s) == CLIENT && text(s, "egress.endpoint") == open.addr.to_string())
        .unwrap();
    assert_eq!(
        a.header("traceparent"),
        Some(format!("00-{}-{}-01", traced.trace_id, client["spanId"].as_str().unwrap()).as_str()),
        "the open upstream's parent is the attempt"
    );
    assert_eq!(a.header("tracestate"), Some("vendor=opaque"));
    assert_eq!(a.header("baggage"), Some("user=alice"));
    let b = open_seen.iter().find(|r| r.path == "/b").unwrap();
    assert_eq!(
        b.header("traceparent"),
        Some(format!("00-{}-{}-00", untraced.trace_id, untraced.span_id).as_str()),
        "an untraced request's context passes as it came"
    );
    sidecar.stop().await;
    collector.stop().await;
}

#[tokio::test]
async fn an_llm_answer_puts_its_model_and_tokens_on_the_request_span() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    let answer = r#"{"id":"c1","object":"chat.completion","model":"gpt-4o-2024-08-06","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}"#;
    origin.script(
        "/v1/chat/completions",
        vec![Answer::ok(answer).header("content-type", "application/json")],
    );
    let sidecar = traced_sidecar(&collector.endpoint(), "", &origin, "llm: { usage: openai }").await;
    let resp = get(&sidecar, &origin.url("/v1/chat/completions"), "").await;
    assert_eq!(resp.status, 200);
    let spans = collector.wait_for_spans(2, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 2, "{spans:?}");
    let server = spans.iter().find(|s| kind(s) == SERVER).unwrap();
    assert_eq!(
        server["parentSpanId"].as_str().unwrap_or(""),
        "",
        "no traceparent: a root"
    );
    assert_eq!(number(server, "gen_ai.usage.input_tokens"), 12.0);
    assert_eq!(number(server, "gen_ai.usage.output_tokens"), 34.0);
    assert_eq!(text(server, "gen_ai.request.model"), "gpt-4o-2024-08-06");
    sidecar.stop().await;
    collector.stop().await;
}

#[tokio::test]
async fn a_collector_that_is_down_costs_requests_nothing_and_drops_are_counted() {
    let origin = ScriptedOrigin::start().await;
    let sidecar = traced_sidecar(&stopped_endpoint(), "", &origin, "").await;
    for _ in 0..100 {
        let app = AppContext::new();
        assert_eq!(
            get(&sidecar, &origin.url("/x"), &app.header("01")).await.status,
            200
        );
    }
    assert_eq!(origin.recorded().len(), 100);
    let scraped = scrape_until(sidecar.admin, Duration::from_secs(15), |m| {
        value(
            m,
            "egress_trace_spans_dropped_total",
            &[("reason", "export_failed")],
        ) >= 200.0
    })
    .await;
    assert_eq!(
        value(
            &scraped,
            "egress_trace_spans_dropped_total",
            &[("reason", "export_failed")]
        ),
        200.0,
        "every span of the 100 requests, and no more"
    );
    assert_eq!(
        value(
            &scraped,
            "egress_trace_spans_dropped_total",
            &[("reason", "queue_full")]
        ),
        0.0
    );
    sidecar.stop().await;
}

#[tokio::test]
async fn a_request_pacing_held_shows_its_wait() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    // The first answer spends the window's only request: the second waits for its reset.
    origin.script(
        "/limited",
        vec![
            Answer::ok("first")
                .header("x-ratelimit-limit-requests", "1")
                .header("x-ratelimit-remaining-requests", "0")
                .header("x-ratelimit-reset-requests", "1s"),
            Answer::ok("second"),
        ],
    );
    let sidecar = traced_sidecar(&collector.endpoint(), "", &origin, "pace: { smooth: false }").await;
    let (first, second) = (AppContext::new(), AppContext::new());
    assert_eq!(
        get(&sidecar, &origin.url("/limited"), &first.header("01"))
            .await
            .status,
        200
    );
    assert_eq!(
        get(&sidecar, &origin.url("/limited"), &second.header("01"))
            .await
            .status,
        200
    );
    let spans = collector.wait_for_spans(4, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 4, "{spans:?}");
    let traces = by_trace(&spans);
    let server = |app: &AppContext| {
        traces[&app.trace_id]
            .iter()
            .find(|s| kind(s) == SERVER)
            .cloned()
            .unwrap()
    };
    assert!(
        attribute(&server(&first), "egress.pacing.wait").is_none(),
        "admitted at once"
    );
    let waited = number(&server(&second), "egress.pacing.wait");
    assert!(waited >= 0.5, "held until the window's reset: {waited}s");
    sidecar.stop().await;
    collector.stop().await;
}

/// An h2c request from the app is observed in the same place: its span, a root here (no
/// `traceparent`), says HTTP/2 downstream while its attempt went upstream on HTTP/1.1.
#[tokio::test]
async fn an_h2c_request_gets_its_spans_too() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    let sidecar = traced_sidecar(&collector.endpoint(), "", &origin, "").await;
    let (status, _) = h2c_get(sidecar.addr, &origin.url("/h2c")).await;
    assert_eq!(status, 200);
    let spans = collector.wait_for_spans(2, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 2, "{spans:?}");
    let server = spans.iter().find(|s| kind(s) == SERVER).unwrap();
    let client = spans.iter().find(|s| kind(s) == CLIENT).unwrap();
    assert_eq!(server["parentSpanId"].as_str().unwrap_or(""), "");
    assert_eq!(client["parentSpanId"], server["spanId"]);
    assert_eq!(server["traceId"], client["traceId"]);
    assert_eq!(text(server, "network.protocol.version"), "2");
    assert_eq!(text(client, "network.protocol.version"), "1.1");
    let sent = origin.recorded()[0].header("traceparent").map(str::to_owned);
    assert_eq!(
        sent,
        Some(format!(
            "00-{}-{}-01",
            client["traceId"].as_str().unwrap(),
            client["spanId"].as_str().unwrap()
        ))
    );
    sidecar.stop().await;
    collector.stop().await;
}

/// An app that gives up on a slow call (its timeout) is the trace an operator wants most: the
/// request's span ends as `canceled`, and its attempt keeps its parent.
#[tokio::test]
async fn a_request_the_app_gives_up_on_still_ends_its_spans() {
    let Some(collector) = start_collector().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/stuck",
        vec![Answer::ok("late").head_after(Duration::from_secs(30))],
    );
    let sidecar = traced_sidecar(&collector.endpoint(), "", &origin, "").await;
    let app = AppContext::new();
    let mut client = RawClient::connect(sidecar.addr).await;
    let url = origin.url("/stuck");
    client
        .send_raw(
            format!(
                "GET {url} HTTP/1.1\r\nHost: {}\r\n{}\r\n",
                origin.addr,
                app.header("01")
            )
            .as_bytes(),
        )
        .await;
    origin.wait_requests(1, Duration::from_secs(10)).await;
    drop(client);
    let spans = collector.wait_for_spans(2, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 2, "{spans:?}");
    let server = spans
        .iter()
        .find(|s| kind(s) == SERVER)
        .expect("the request's span");
    let client_span = spans
        .iter()
        .find(|s| kind(s) == CLIENT)
        .expect("the attempt's span");
    assert_eq!(server["parentSpanId"], app.span_id.as_str());
    assert_eq!(client_span["parentSpanId"], server["spanId"]);
    for span in [server, client_span] {
        assert_eq!(text(span, "error.type"), "canceled");
        assert_eq!(span["status"]["code"], 2, "ERROR: {span}");
    }
    assert!(
        attribute(server, "http.response.status_code").is_none(),
        "no answer went out"
    );
    sidecar.stop().await;
    collector.stop().await;
}

/// A collector that takes the connection and never answers holds neither requests nor the
/// sidecar's stop: the final export has a deadline, and what it could not post is counted.
#[tokio::test]
async fn a_collector_that_never_answers_holds_neither_requests_nor_the_stop() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut kept = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            kept.push(stream);
        }
    });
    let origin = ScriptedOrigin::start().await;
    let sidecar = Sidecar::start(&format!(
        "shutdown: {{ drain_timeout: 1s }}\ntracing: {{ otlp: \"http://{silent_addr}\" }}\n\
         upstreams:\n  - name: origin\n    url: http://{}\n",
        origin.addr
    ))
    .await;
    for _ in 0..20 {
        assert_eq!(
            get(&sidecar, &origin.url("/x"), &AppContext::new().header("01"))
                .await
                .status,
            200
        );
    }
    // The first batch goes a second after its first span, and hangs: the stop comes meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let admin = sidecar.admin;
    let stopping = tokio::time::Instant::now();
    let metrics_before = scrape(admin).await;
    assert_eq!(
        value(
            &metrics_before,
            "egress_trace_spans_dropped_total",
            &[("reason", "export_failed")]
        ),
        0.0,
        "the post is still under way"
    );
    sidecar.stop().await;
    let took = stopping.elapsed();
    // The drain (no connection open) is at once; the exporter's final deadline is 2 s, and
    // the export under way (10 s of its own) is cut by the stop.
    assert!(took < Duration::from_secs(6), "the stop took {took:?}");
    held.abort();
}
