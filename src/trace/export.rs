//! The exporter: one task that drains the span queue in batches, encodes each batch as an OTLP
//! `ExportTraceServiceRequest` (protobuf) and posts it to the collector's `/v1/traces` on one
//! kept HTTP/1.1 connection. Off the request path: a collector that is slow or down costs
//! requests nothing; the batch it did not take is dropped and counted (`export_failed`).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{span, status, ResourceSpans, ScopeSpans, Span, Status};
use prometheus_client::metrics::counter::Counter;
use prost::Message;
use tokio::sync::{mpsc, watch};

use super::{ClientFields, Fields, Finished, ServerFields};
use crate::config::OtlpUrl;

/// Spans per request to the collector (OpenTelemetry's default batch).
pub const MAX_BATCH: usize = 512;
/// How long the first span of a batch waits for others.
pub const BATCH_DELAY: Duration = Duration::from_secs(1);
/// A post the collector has not answered by then has failed (OTLP's default timeout).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// What is still queued at shutdown gets this long, in all (`app` waits a little longer).
pub const FINAL_EXPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// The most of a collector's answer that is read.
const MAX_ANSWER_BYTES: usize = 64 * 1024;

/// Drains the span queue to the collector.
#[derive(Debug)]
pub struct Exporter {
    otlp: OtlpUrl,
    pub(super) resource: Resource,
    pub(super) spans: mpsc::Receiver<Finished>,
    failed: Counter,
    connection: Option<http1::SendRequest<Full<Bytes>>>,
    /// Spans in the post under way, counted as dropped if a stop cuts it.
    posting: u64,
}

impl Exporter {
    pub(super) fn new(
        otlp: OtlpUrl,
        service_name: &str,
        spans: mpsc::Receiver<Finished>,
        failed: Counter,
    ) -> Self {
        let resource = Resource {
            attributes: vec![
                text("service.name", service_name.to_owned()),
                text("service.version", env!("CARGO_PKG_VERSION").to_owned()),
                text("telemetry.sdk.name", "egress-sidecar".to_owned()),
                text("telemetry.sdk.language", "rust".to_owned()),
            ],
            ..Resource::default()
        };
        Exporter {
            otlp,
            resource,
            spans,
            failed,
            connection: None,
            posting: 0,
        }
    }

    /// Exports batches until `stop` turns true, then what is still queued, once.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            let open = tokio::select! {
                n = self.spans.recv_many(&mut batch, MAX_BATCH) => n > 0,
                _ = stop.wait_for(|s| *s) => false,
            };
            if !open {
                break;
            }
            let deadline = tokio::time::Instant::now() + BATCH_DELAY;
            while batch.len() < MAX_BATCH {
                let room = MAX_BATCH - batch.len();
                tokio::select! {
                    biased;
                    _ = stop.wait_for(|s| *s) => break,
                    n = self.spans.recv_many(&mut batch, room) => if n == 0 { break },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
            if *stop.borrow() {
                break;
            }
            // A stop while a batch is posted ends the post too: what is left gets the final one.
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => {
                    let lost = std::mem::take(&mut self.posting);
                    if lost > 0 {
                        self.failed_export(lost, "stopped while posting");
                    }
                    break;
                }
                () = self.export(&mut batch, EXPORT_TIMEOUT) => {}
            }
        }
        self.finish(batch).await;
    }

    /// The last spans (those of the requests drained before the stop, and a batch a stop cut
    /// off), within [`FINAL_EXPORT_TIMEOUT`] in all; what is left then is dropped, counted.
    async fn finish(&mut self, mut batch: Vec<Finished>) {
        let deadline = tokio::time::Instant::now() + FINAL_EXPORT_TIMEOUT;
        loop {
            while batch.len() < MAX_BATCH {
                match self.spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(_) => break,
                }
            }
            if batch.is_empty() {
                return;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                let count = batch.len() as u64;
                batch.clear();
                self.failed_export(count, "the stop's deadline passed");
                continue;
            }
            self.export(&mut batch, left).await;
        }
    }

    /// Posts `batch` (left empty); counts its spans as dropped when the collector does not
    /// take it.
    pub(super) async fn export(&mut self, batch: &mut Vec<Finished>, timeout: Duration) {
        let count = batch.len() as u64;
        let body = encode(&self.resource, batch.drain(..));
        self.posting = count;
        let posted = tokio::time::timeout(timeout, self.post(body)).await;
        self.posting = 0;
        match posted {
            Ok(Ok(())) => {}
            Ok(Err(why)) => self.failed_export(count, &why),
            Err(_) => self.failed_export(count, &format!("no answer within {timeout:?}")),
        }
    }

    fn failed_export(&mut self, count: u64, why: &str) {
        // The connection may be in any state: the next batch dials afresh.
        self.connection = None;
        self.failed.inc_by(count);
        tracing::debug!(spans = count, otlp = %self.otlp, "span export failed: {why}");
    }

    async fn post(&mut self, body: Bytes) -> Result<(), String> {
        let kept = self.connection.take().filter(|sender| !sender.is_closed());
        let reused = kept.is_some();
        let sender = match kept {
            Some(sender) => self.connection.insert(sender),
            None => self.connection.insert(self.connect().await?),
        };
        let resp = match send(sender, &self.otlp, body.clone()).await {
            Ok(resp) => resp,
            // The collector may have closed the kept connection as the batch went out (the
            // keep-alive race): once more on a new one.
            Err(_) if reused => {
                let sender = self.connection.insert(self.connect().await?);
                send(sender, &self.otlp, body).await?
            }
            Err(why) => return Err(why),
        };
        let status = resp.status();
        // Read whole, so the connection can carry the next batch; a collector's answer is a
        // few bytes (a partial-success message at most), so a long one is an error.
        let answer = Limited::new(resp.into_body(), MAX_ANSWER_BYTES)
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        if status.is_success() {
            Ok(())
        } else {
            let text = answer.to_bytes();
            Err(format!(
                "{status}: {}",
                String::from_utf8_lossy(&text[..text.len().min(200)])
            ))
        }
    }

    async fn connect(&self) -> Result<http1::SendRequest<Full<Bytes>>, String> {
        let authority = &self.otlp.authority;
        let stream = tokio::net::TcpStream::connect((authority.host.as_str(), authority.port))
            .await
            .map_err(|e| format!("connecting to {authority}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(sender)
    }
}

/// Posts `body` to the collector on `sender`; the response head, or why there is none.
async fn send(
    sender: &mut http1::SendRequest<Full<Bytes>>,
    otlp: &OtlpUrl,
    body: Bytes,
) -> Result<http::Response<hyper::body::Incoming>, String> {
    sender.ready().await.map_err(|e| e.to_string())?;
    let req = http::Request::post(&otlp.traces_path)
        .header(http::header::HOST, otlp.authority.to_string())
        .header(http::header::CONTENT_TYPE, "application/x-protobuf")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    sender.send_request(req).await.map_err(|e| e.to_string())
}

/// One `ExportTraceServiceRequest` of `spans`, under `resource`.
pub(super) fn encode(resource: &Resource, spans: impl Iterator<Item = Finished>) -> Bytes {
    let scope = InstrumentationScope {
        name: "egress-sidecar".to_owned(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        ..InstrumentationScope::default()
    };
    let request = ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![ScopeSpans {
                scope: Some(scope),
                spans: spans.map(to_span).collect(),
                schema_url: String::new(),
            }],
            schema_url: String::new(),
        }],
    };
    Bytes::from(request.encode_to_vec())
}

/// `flags`: the sampled bit, and whether the parent is known to be remote (bit 8) and is (9).
const SAMPLED: u32 = 0x01;
const HAS_IS_REMOTE: u32 = 0x100;
const IS_REMOTE: u32 = 0x200;

fn to_span(finished: Finished) -> Span {
    let Finished {
        trace_id,
        span_id,
        parent,
        start,
        end,
        fields,
    } = finished;
    // The span's status is ERROR as the HTTP conventions say: on a SERVER span for a 5xx (or
    // no answer), not for a 4xx the app caused; on a CLIENT span for any error.
    let (name, kind, attributes, failed, remote_parent) = match fields {
        Fields::Server(f) => {
            let error = f
                .error
                .map(str::to_owned)
                .or_else(|| (f.status >= 500).then(|| f.status.to_string()));
            let failed = error.is_some() && (f.status >= 500 || f.status == 0);
            let name = span_name(&f.method);
            (
                name,
                span::SpanKind::Server,
                server_attributes(*f, error),
                failed,
                true,
            )
        }
        Fields::Client(f) => {
            let status = f.status.unwrap_or(0);
            let error = f
                .error
                .map(str::to_owned)
                .or_else(|| (status >= 400).then(|| status.to_string()));
            let failed = error.is_some();
            let name = span_name(f.method.as_str());
            (
                name,
                span::SpanKind::Client,
                client_attributes(*f, error),
                failed,
                false,
            )
        }
    };
    let remote = if remote_parent && parent.is_some() {
        IS_REMOTE
    } else {
        0
    };
    Span {
        trace_id: trace_id.to_vec(),
        span_id: span_id.to_vec(),
        parent_span_id: parent.map(|p| p.to_vec()).unwrap_or_default(),
        flags: SAMPLED | HAS_IS_REMOTE | remote,
        name,
        kind: kind as i32,
        start_time_unix_nano: unix_nanos(start),
        end_time_unix_nano: unix_nanos(end),
        attributes,
        status: failed.then(|| Status {
            message: String::new(),
            code: status::StatusCode::Error as i32,
        }),
        ..Span::default()
    }
}

/// The methods HTTP's conventions name; any other is `_OTHER`, so that an app cannot make
/// span names (or `http.request.method` values) without bound.
const KNOWN_METHODS: [&str; 10] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "QUERY",
];

fn known_method(method: &str) -> bool {
    KNOWN_METHODS.contains(&method)
}

/// `{method}`, or `HTTP` for a method the conventions do not know.
fn span_name(method: &str) -> String {
    if known_method(method) { method } else { "HTTP" }.to_owned()
}

/// `http.request.method`, and `http.request.method_original` when it is `_OTHER`.
fn push_method(out: &mut Vec<KeyValue>, method: String) {
    if known_method(&method) {
        out.push(text("http.request.method", method));
    } else {
        out.push(text("http.request.method", "_OTHER".to_owned()));
        out.push(text("http.request.method_original", super::bounded(method)));
    }
}

fn server_attributes(f: ServerFields, error: Option<String>) -> Vec<KeyValue> {
    let mut out = Vec::with_capacity(16);
    push_method(&mut out, f.method);
    let (host, port) = split_authority(&f.authority, f.scheme);
    out.push(text(
        "url.full",
        format!("{}://{}{}", f.scheme, f.authority, f.path),
    ));
    out.push(text("url.scheme", f.scheme.to_owned()));
    out.push(text("url.path", f.path));
    out.push(text("server.address", host));
    if let Some(port) = port {
        out.push(int("server.port", i64::from(port)));
    }
    if f.status != 0 {
        out.push(int("http.response.status_code", i64::from(f.status)));
    }
    if let Some(error) = error {
        out.push(text("error.type", error));
    }
    out.push(text("network.protocol.version", version(f.protocol).to_owned()));
    if let Some(client) = f.client {
        out.push(text("client.address", client.ip().to_string()));
        out.push(int("client.port", i64::from(client.port())));
    }
    if let Some(upstream) = f.upstream {
        out.push(text("egress.upstream", upstream.to_string()));
    }
    if f.retries > 0 {
        out.push(int("http.request.resend_count", i64::from(f.retries)));
    }
    if let Some(wait) = f.admission_wait {
        out.push(double("egress.pacing.wait", wait.as_secs_f64()));
    }
    if let Some(model) = f.model {
        out.push(text("gen_ai.request.model", model.to_string()));
    }
    if let Some((input, output)) = f.tokens {
        out.push(int("gen_ai.usage.input_tokens", input as i64));
        out.push(int("gen_ai.usage.output_tokens", output as i64));
    }
    out
}

fn client_attributes(f: ClientFields, error: Option<String>) -> Vec<KeyValue> {
    let mut out = Vec::with_capacity(16);
    let default_port = if f.scheme == "https" { 443 } else { 80 };
    let host = if f.host.contains(':') {
        format!("[{}]", f.host)
    } else {
        f.host.clone()
    };
    let url = if f.port == default_port {
        format!("{}://{host}{}", f.scheme, f.path)
    } else {
        format!("{}://{host}:{}{}", f.scheme, f.port, f.path)
    };
    push_method(&mut out, f.method.to_string());
    out.push(text("url.full", url));
    out.push(text("server.address", f.host));
    out.push(int("server.port", i64::from(f.port)));
    if let Some(status) = f.status {
        out.push(int("http.response.status_code", i64::from(status)));
    }
    if let Some(error) = error {
        out.push(text("error.type", error));
    }
    if f.resend_count > 0 {
        out.push(int("http.request.resend_count", i64::from(f.resend_count)));
    }
    if let Some(reason) = f.retry_reason {
        out.push(text("egress.retry.reason", reason));
    }
    if let Some(wait) = f.pool_wait {
        out.push(text(
            "network.protocol.version",
            if f.http2 { "2" } else { "1.1" }.to_owned(),
        ));
        out.push(double("egress.pool.wait", wait.as_secs_f64()));
        out.push(text(
            "egress.connection",
            if f.reused { "reused" } else { "dialed" }.to_owned(),
        ));
    }
    if let Some(peer) = f.peer {
        out.push(text("network.peer.address", peer.ip().to_string()));
        out.push(int("network.peer.port", i64::from(peer.port())));
        out.push(text("egress.endpoint", peer.to_string()));
    }
    out
}

/// `host` and `port` of `host[:port]` (an IPv6 host in brackets); the port is `None` when the
/// authority names none and the scheme is unknown.
fn split_authority(authority: &str, scheme: &str) -> (String, Option<u16>) {
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => (host, port.parse().ok()),
        _ => (authority, None),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
    let port = port.or(match scheme {
        "https" => Some(443),
        "http" => Some(80),
        _ => None,
    });
    (host, port)
}

/// `network.protocol.version` of an access-log protocol (`HTTP/1.1` → `1.1`).
fn version(protocol: &str) -> &str {
    protocol.strip_prefix("HTTP/").unwrap_or(protocol)
}

fn unix_nanos(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn text(key: &str, value: String) -> KeyValue {
    attribute(key, any_value::Value::StringValue(value))
}

fn int(key: &str, value: i64) -> KeyValue {
    attribute(key, any_value::Value::IntValue(value))
}

fn double(key: &str, value: f64) -> KeyValue {
    attribute(key, any_value::Value::DoubleValue(value))
}

fn attribute(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Some(AnyValue { value: Some(value) }),
        ..KeyValue::default()
    }
}
