//! Unit tests of trace context, sampling, ids, the queue's drops and the OTLP encoding.

use std::collections::HashSet;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;

use super::*;
use crate::config::{Authority, OtlpUrl};

const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn config(sample: f64) -> TracingConfig {
    TracingConfig {
        otlp: Some(OtlpUrl {
            authority: Authority {
                host: "127.0.0.1".to_owned(),
                port: 4318,
            },
            traces_path: "/v1/traces".to_owned(),
        }),
        sample,
        service_name: "test-service".to_owned(),
    }
}

fn tracer(sample: f64) -> (Arc<Tracer>, export::Exporter, Counter) {
    let dropped = Counter::default();
    let (tracer, exporter) = Tracer::start(&config(sample), dropped.clone(), Counter::default()).unwrap();
    (tracer, exporter, dropped)
}

fn headers(traceparent: Option<&str>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(value) = traceparent {
        headers.insert(TRACEPARENT, HeaderValue::from_str(value).unwrap());
    }
    headers
}

#[test]
fn traceparent_is_parsed_as_w3c_says() {
    let parent = parse(PARENT.as_bytes()).unwrap();
    assert_eq!(hex(&parent.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(hex(&parent.span_id), "00f067aa0ba902b7");
    assert!(parent.sampled);
    assert!(
        !parse(b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
            .unwrap()
            .sampled
    );
    // A later version: its first four fields, and more after a dash.
    assert!(parse(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later").is_some());
    for bad in [
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
        "",
    ] {
        assert_eq!(parse(bad.as_bytes()), None, "{bad}");
    }
    let made = traceparent(&parent.trace_id, &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(made, "00-4bf92f3577b34da6a3ce929d0e0e4736-0102030405060708-01");
    assert_eq!(parse(made.as_bytes()).unwrap().trace_id, parent.trace_id);
}

#[test]
fn a_traceparent_decides_and_roots_follow_the_ratio() {
    let (never, _exporter, _) = tracer(0.0);
    let server = never
        .server(&headers(Some(PARENT)))
        .expect("a sampled parent is followed");
    assert_eq!(hex(&server.traced.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(
        server.parent.map(|p| hex(&p)).as_deref(),
        Some("00f067aa0ba902b7")
    );
    assert_ne!(server.traced.span_id, server.parent.unwrap());
    assert!(never.server(&headers(None)).is_none(), "sample 0: no roots");
    let (always, _exporter, _) = tracer(1.0);
    let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
    assert!(
        always.server(&headers(Some(unsampled))).is_none(),
        "an unsampled parent is followed"
    );
    let root = always
        .server(&headers(Some("garbage")))
        .expect("an invalid parent starts a trace");
    assert_eq!(root.parent, None);
    let (tenth, _exporter, _) = tracer(0.1);
    let traced = (0..10_000)
        .filter(|_| tenth.server(&headers(None)).is_some())
        .count();
    assert!((800..1200).contains(&traced), "{traced} of 10000 at 0.1");
}

#[test]
fn ids_do_not_repeat() {
    let ids = Ids::seeded();
    let spans: HashSet<[u8; 8]> = (0..100_000).map(|_| ids.span_id()).collect();
    assert_eq!(spans.len(), 100_000);
    let traces: HashSet<[u8; 16]> = (0..10_000).map(|_| ids.trace_id()).collect();
    assert_eq!(traces.len(), 10_000);
}

#[test]
fn a_full_queue_drops_and_counts() {
    let (tracer, _exporter, dropped) = tracer(1.0);
    for _ in 0..QUEUE_SPANS + 10 {
        tracer
            .server(&headers(None))
            .unwrap()
            .end(ServerFields::default());
    }
    assert_eq!(dropped.get(), 10);
}

#[tokio::test]
async fn an_attempt_carries_its_traceparent_and_ends_when_dropped() {
    let (tracer, mut exporter, _) = tracer(1.0);
    let server = tracer.server(&headers(Some(PARENT))).unwrap();
    let mut req = Request::new(crate::wire::RequestBody::Empty);
    *req.uri_mut() = "/v1/chat?key=secret".parse().unwrap();
    req.headers_mut()
        .insert(TRACEPARENT, HeaderValue::from_static(PARENT));
    let target = Target {
        scheme: "https",
        host: "api.example",
        port: 443,
    };
    assert!(
        ClientSpan::begin(&mut req, target, 0, true).is_none(),
        "untraced requests make no span"
    );
    req.extensions_mut().insert(server.traced().clone());
    retrying(&mut req, "503");
    let attempt = ClientSpan::begin(&mut req, target, 1, true).unwrap();
    let sent = parse(req.headers()[TRACEPARENT].as_bytes()).unwrap();
    assert_eq!(sent.trace_id, server.traced.trace_id);
    assert_eq!(
        sent.span_id, attempt.span_id,
        "the upstream sees the attempt as its parent"
    );
    drop(attempt);
    let kept = ClientSpan::begin(&mut req, target, 2, false).unwrap();
    assert_eq!(
        parse(req.headers()[TRACEPARENT].as_bytes()).unwrap().span_id,
        sent.span_id,
        "propagate: false leaves the header to the caller (rewrite_headers removed it)"
    );
    kept.answered(200);
    server.end(ServerFields {
        method: "GET".to_owned(),
        scheme: "https",
        authority: "api.example".to_owned(),
        path: "/v1/chat".to_owned(),
        status: 200,
        protocol: "HTTP/1.1",
        tokens: Some((12, 34)),
        model: Some("gpt-test".into()),
        ..ServerFields::default()
    });

    let mut spans = Vec::new();
    exporter.spans.recv_many(&mut spans, 10).await;
    assert_eq!(spans.len(), 3);
    let body = export::encode(&exporter.resource, spans.into_iter());
    let decoded = ExportTraceServiceRequest::decode(body).unwrap();
    let resource = decoded.resource_spans[0].resource.as_ref().unwrap();
    assert_eq!(
        string(&resource.attributes, "service.name"),
        Some("test-service".to_owned())
    );
    let spans = &decoded.resource_spans[0].scope_spans[0].spans;
    let (canceled, answered, server_span) = (&spans[0], &spans[1], &spans[2]);
    assert_eq!(canceled.kind, SpanKind::Client as i32);
    assert_eq!(
        string(&canceled.attributes, "error.type"),
        Some("canceled".to_owned())
    );
    assert_eq!(
        string(&canceled.attributes, "egress.retry.reason"),
        Some("503".to_owned())
    );
    assert_eq!(int(&canceled.attributes, "http.request.resend_count"), Some(1));
    assert_eq!(
        string(&answered.attributes, "url.full"),
        Some("https://api.example/v1/chat".to_owned()),
        "no query"
    );
    assert_eq!(int(&answered.attributes, "http.response.status_code"), Some(200));
    assert_eq!(
        string(&answered.attributes, "egress.retry.reason"),
        None,
        "taken by the first"
    );
    assert_eq!(answered.parent_span_id, server_span.span_id);
    assert_eq!(server_span.kind, SpanKind::Server as i32);
    assert_eq!(
        server_span.parent_span_id,
        parse(PARENT.as_bytes()).unwrap().span_id.to_vec()
    );
    assert_eq!(server_span.name, "GET");
    assert_eq!(
        int(&server_span.attributes, "gen_ai.usage.input_tokens"),
        Some(12)
    );
    assert_eq!(
        int(&server_span.attributes, "gen_ai.usage.output_tokens"),
        Some(34)
    );
    assert_eq!(
        string(&server_span.attributes, "gen_ai.request.model"),
        Some("gpt-test".to_owned())
    );
    assert_eq!(int(&server_span.attributes, "server.port"), Some(443));
    assert!(server_span.status.is_none(), "a 200 is no error");
}

#[test]
fn strip_context_removes_every_trace_field() {
    let mut headers = headers(Some(PARENT));
    headers.insert(TRACESTATE, HeaderValue::from_static("vendor=1"));
    headers.insert(BAGGAGE, HeaderValue::from_static("user=2"));
    headers.insert("x-other", HeaderValue::from_static("kept"));
    strip_context(&mut headers);
    assert_eq!(headers.len(), 1);
}

fn find<'a>(
    attributes: &'a [opentelemetry_proto::tonic::common::v1::KeyValue],
    key: &str,
) -> Option<&'a Value> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn string(attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue], key: &str) -> Option<String> {
    match find(attributes, key)? {
        Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn int(attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue], key: &str) -> Option<i64> {
    match find(attributes, key)? {
        Value::IntValue(n) => Some(*n),
        _ => None,
    }
}

/// A collector that closes a kept connection as the next batch arrives (its idle timeout
/// racing the post): the batch goes again on a new connection, and nothing is dropped.
#[tokio::test]
async fn a_batch_lost_to_a_closed_kept_connection_goes_again() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let served = Arc::new(AtomicU64::new(0));
    let counted = served.clone();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                // One request answered per connection; the next one read, then the close.
                for answer in [true, false] {
                    let mut got = Vec::new();
                    while !request_complete(&got) {
                        let n = stream.read(&mut buf).await.unwrap_or(0);
                        if n == 0 {
                            return;
                        }
                        got.extend_from_slice(&buf[..n]);
                    }
                    if !answer {
                        return;
                    }
                    counted.fetch_add(1, Ordering::SeqCst);
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                        .await;
                }
            });
        }
    });
    let mut config = config(1.0);
    config.otlp.as_mut().unwrap().authority.port = port;
    let failed = Counter::default();
    let (tracer, mut exporter) = Tracer::start(&config, Counter::default(), failed.clone()).unwrap();
    for round in 1..=3 {
        tracer
            .server(&headers(None))
            .unwrap()
            .end(ServerFields::default());
        let mut batch = Vec::new();
        exporter.spans.recv_many(&mut batch, 10).await;
        exporter
            .export(&mut batch, std::time::Duration::from_secs(5))
            .await;
        assert_eq!(served.load(Ordering::SeqCst), round, "batch {round} taken");
    }
    assert_eq!(failed.get(), 0, "no batch dropped");
}

/// Whether `got` holds a whole request: its head and the `content-length` bytes after it.
fn request_complete(got: &[u8]) -> bool {
    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    got.len() >= end + 4 + length
}

#[tokio::test]
async fn unknown_methods_long_paths_and_new_traces_are_kept_in_bounds() {
    let (tracer, mut exporter, _) = tracer(1.0);
    // No traceparent: a trace begins here, and the app's tracestate (of no trace the
    // upstream will see) does not go on.
    let server = tracer.server(&headers(None)).unwrap();
    let mut req = Request::new(crate::wire::RequestBody::Empty);
    *req.method_mut() = http::Method::from_bytes(b"BREW").unwrap();
    *req.uri_mut() = format!("/{}", "é".repeat(3000))
        .parse()
        .unwrap_or_else(|_| "/x".parse().unwrap());
    req.headers_mut()
        .insert(TRACESTATE, HeaderValue::from_static("vendor=1"));
    req.extensions_mut().insert(server.traced().clone());
    let target = Target {
        scheme: "http",
        host: "::1",
        port: 8080,
    };
    ClientSpan::begin(&mut req, target, 0, true)
        .unwrap()
        .answered(404);
    assert!(!req.headers().contains_key(TRACESTATE));
    server.end(ServerFields {
        method: "BREW".to_owned(),
        scheme: "http",
        authority: "a".repeat(5000),
        path: "/".to_owned(),
        status: 403,
        error: Some("policy_denied"),
        protocol: "HTTP/1.1",
        ..ServerFields::default()
    });
    let mut spans = Vec::new();
    exporter.spans.recv_many(&mut spans, 10).await;
    let body = export::encode(&exporter.resource, spans.into_iter());
    let decoded = ExportTraceServiceRequest::decode(body).unwrap();
    let spans = &decoded.resource_spans[0].scope_spans[0].spans;
    let (client, server) = (&spans[0], &spans[1]);
    for span in [client, server] {
        assert_eq!(span.name, "HTTP", "an unknown method names no span");
        assert_eq!(
            string(&span.attributes, "http.request.method"),
            Some("_OTHER".to_owned())
        );
        assert_eq!(
            string(&span.attributes, "http.request.method_original"),
            Some("BREW".to_owned())
        );
    }
    let url = string(&client.attributes, "url.full").unwrap();
    assert!(url.starts_with("http://[::1]:8080/"), "{url}");
    assert!(
        url.len() <= MAX_VALUE_BYTES + 30,
        "the path is cut: {}",
        url.len()
    );
    assert_eq!(
        string(&client.attributes, "server.address"),
        Some("::1".to_owned())
    );
    assert_eq!(string(&client.attributes, "error.type"), Some("404".to_owned()));
    assert!(client.status.is_some(), "a CLIENT span's 4xx is an error");
    assert!(string(&server.attributes, "server.address").unwrap().len() <= MAX_VALUE_BYTES);
    assert_eq!(
        string(&server.attributes, "error.type"),
        Some("policy_denied".to_owned())
    );
    assert!(
        server.status.is_none(),
        "a SERVER span's 4xx is the app's, not an error"
    );
    assert_eq!(server.parent_span_id, Vec::<u8>::new(), "a root");
    assert_eq!(server.flags, 0x101, "sampled; the parent (none) is not remote");
    assert_eq!(client.flags, 0x101);
    assert!(server.end_time_unix_nano >= server.start_time_unix_nano);
}

#[test]
fn bounded_cuts_at_a_character_boundary() {
    assert_eq!(bounded("short".to_owned()), "short");
    let cut = bounded("é".repeat(MAX_VALUE_BYTES));
    assert!(cut.len() <= MAX_VALUE_BYTES && cut.len() >= MAX_VALUE_BYTES - 1);
    assert!(cut.chars().all(|c| c == 'é'));
}

#[test]
fn a_long_extension_method_is_cut_in_the_span() {
    let long = http::Method::from_bytes("X".repeat(3 * MAX_VALUE_BYTES).as_bytes()).unwrap();
    assert_eq!(bounded_method(&long).as_str().len(), MAX_VALUE_BYTES);
    assert_eq!(bounded_method(&http::Method::GET), http::Method::GET);
}
