//! The trace tests' harness itself (tests/support/otelcol.rs), without the sidecar: the real
//! OpenTelemetry Collector built from tests/otelcol takes an OTLP/HTTP JSON export posted by
//! curl, and `spans()` reads it back from the collector's export file, each span with its
//! resource and scope, its attributes readable as plain JSON, its duration from its times. A
//! stopped collector and `stopped_endpoint()` refuse connections, as the "collector down" test
//! needs.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::otelcol::{attribute, resource_attribute, span_duration, stopped_endpoint, Collector};

const TRACE_A: &str = "0af7651916cd43dd8448eb211c80319c";
const TRACE_B: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// An export as an SDK sends it: two resources (services `app-a` and `app-b`); the first has
/// two spans of trace A, a SERVER span and its CLIENT child, under one scope; the second one
/// span of trace B under another scope. Attributes of every scalar kind and an array.
fn export() -> Value {
    let kv = |key: &str, value: Value| json!({ "key": key, "value": value });
    json!({
        "resourceSpans": [
            {
                "resource": { "attributes": [kv("service.name", json!({ "stringValue": "app-a" }))] },
                "scopeSpans": [{
                    "scope": { "name": "egress-sidecar", "version": "1.2.3" },
                    "spans": [
                        {
                            "traceId": TRACE_A,
                            "spanId": "00f067aa0ba902b7",
                            "parentSpanId": "b7ad6b7169203331",
                            "name": "GET",
                            "kind": 2,
                            "startTimeUnixNano": "1700000000000000000",
                            "endTimeUnixNano": "1700000000250000000",
                            "attributes": [
                                kv("http.request.method", json!({ "stringValue": "GET" })),
                                kv("http.response.status_code", json!({ "intValue": "200" })),
                                kv("egress.pool.wait", json!({ "doubleValue": 0.125 })),
                                kv("egress.connection.reused", json!({ "boolValue": true })),
                                kv("egress.endpoints", json!({ "arrayValue": { "values": [
                                    { "stringValue": "10.0.0.1:443" },
                                    { "intValue": "7" },
                                ] } })),
                            ],
                        },
                        {
                            "traceId": TRACE_A,
                            "spanId": "53995c3f42cd8ad8",
                            "parentSpanId": "00f067aa0ba902b7",
                            "name": "GET",
                            "kind": 3,
                            "startTimeUnixNano": "1700000000010000000",
                            "endTimeUnixNano": "1700000000240000000",
                            "attributes": [kv("http.request.resend_count", json!({ "intValue": "1" }))],
                        },
                    ],
                }],
            },
            {
                "resource": { "attributes": [kv("service.name", json!({ "stringValue": "app-b" }))] },
                "scopeSpans": [{
                    "scope": { "name": "other" },
                    "spans": [{
                        "traceId": TRACE_B,
                        "spanId": "a3ce929d0e0e4736",
                        "name": "POST",
                        "kind": 2,
                        "startTimeUnixNano": "1700000001000000000",
                        "endTimeUnixNano": "1700000001500000000",
                    }],
                }],
            },
        ]
    })
}

/// POSTs `body` to `<endpoint>/v1/traces` as OTLP/HTTP JSON with curl: the status.
async fn post_json(endpoint: &str, body: &Value) -> u16 {
    let output = support::curl()
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10"])
        .args(["-H", "Content-Type: application/json", "--data-binary"])
        .arg(body.to_string())
        .arg(format!("{endpoint}/v1/traces"))
        .output()
        .await
        .expect("running curl");
    assert!(
        output.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).parse().unwrap()
}

#[tokio::test]
async fn an_export_posted_as_otlp_json_is_read_back_span_by_span() {
    if !support::curl_or_skip() {
        return;
    }
    let Some(collector) = Collector::start().await else {
        return;
    };
    assert!(collector.endpoint().starts_with("http://127.0.0.1:"));
    // The readiness probe's empty export wrote no span.
    assert_eq!(collector.spans().await, Vec::<Value>::new());

    assert_eq!(post_json(&collector.endpoint(), &export()).await, 200);
    let spans = collector.wait_for_spans(3, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 3, "spans: {spans:#?}\nlog:\n{}", collector.log());

    let server = &spans[0];
    assert_eq!(server["traceId"], TRACE_A);
    assert_eq!(server["spanId"], "00f067aa0ba902b7");
    assert_eq!(server["parentSpanId"], "b7ad6b7169203331");
    assert_eq!(server["name"], "GET");
    assert_eq!(server["kind"], 2);
    assert_eq!(span_duration(server), Duration::from_millis(250));
    assert_eq!(attribute(server, "http.request.method"), Some(json!("GET")));
    assert_eq!(attribute(server, "http.response.status_code"), Some(json!(200)));
    assert_eq!(attribute(server, "egress.pool.wait"), Some(json!(0.125)));
    assert_eq!(attribute(server, "egress.connection.reused"), Some(json!(true)));
    assert_eq!(
        attribute(server, "egress.endpoints"),
        Some(json!(["10.0.0.1:443", 7]))
    );
    assert_eq!(attribute(server, "no.such.attribute"), None);
    assert_eq!(resource_attribute(server, "service.name"), Some(json!("app-a")));
    assert_eq!(server["scope"]["name"], "egress-sidecar");
    assert_eq!(server["scope"]["version"], "1.2.3");

    let client = &spans[1];
    assert_eq!(client["traceId"], TRACE_A);
    assert_eq!(client["parentSpanId"], server["spanId"]);
    assert_eq!(client["kind"], 3);
    assert_eq!(span_duration(client), Duration::from_millis(230));
    assert_eq!(attribute(client, "http.request.resend_count"), Some(json!(1)));
    assert_eq!(resource_attribute(client, "service.name"), Some(json!("app-a")));

    // The second resource's span keeps its own resource and scope.
    let other = &spans[2];
    assert_eq!(other["traceId"], TRACE_B);
    assert_eq!(other["name"], "POST");
    assert_eq!(attribute(other, "http.request.method"), None);
    assert_eq!(resource_attribute(other, "service.name"), Some(json!("app-b")));
    assert_eq!(other["scope"]["name"], "other");

    // A second export adds to the first.
    assert_eq!(post_json(&collector.endpoint(), &export()).await, 200);
    let spans = collector.wait_for_spans(6, Duration::from_secs(10)).await;
    assert_eq!(spans.len(), 6, "log:\n{}", collector.log());
    collector.stop().await;
}

#[tokio::test]
async fn a_stopped_collector_and_the_stopped_endpoint_refuse_connections() {
    let Some(collector) = Collector::start().await else {
        return;
    };
    let endpoint = collector.endpoint();
    let addr = endpoint.trim_start_matches("http://").to_owned();
    tokio::net::TcpStream::connect(&addr)
        .await
        .expect("a running collector takes connections");
    collector.stop().await;
    let refused = tokio::net::TcpStream::connect(&addr).await.unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);

    let down = stopped_endpoint();
    assert!(down.starts_with("http://127.0.0.1:"), "{down}");
    let refused = tokio::net::TcpStream::connect(down.trim_start_matches("http://"))
        .await
        .unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
    assert_ne!(stopped_endpoint(), down, "each call holds a port of its own");
}
