//! The exporter: one task that drains the span queue in batches, encodes each batch as an OTLP
//! `ExportTraceServiceRequest` (protobuf) and posts it to the collector's `/v1/traces` on one
//! kept HTTP/1.1 connection. Off the request path: a collector that is slow or down costs
//! requests nothing; the batch it did not take is dropped and counted (`export_failed`).

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
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
/// What is still queued at shutdown gets this long.
const FINAL_EXPORT_TIMEOUT: Duration = Duration::from_secs(2);

/// Drains the span queue to the collector.
#[derive(Debug)]
pub struct Exporter {
    otlp: OtlpUrl,
    pub(super) resource: Resource,
    pub(super) spans: mpsc::Receiver<Finished>,
    failed: Counter,
    connection: Option<http1::SendRequest<Full<Bytes>>>,
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
                    n = self.spans.recv_many(&mut batch, room) => if n == 0 { break },
                    _ = tokio::time::sleep_until(deadline) => break,
                    _ = stop.wait_for(|s| *s) => break,
                }
            }
            self.export(&mut batch, EXPORT_TIMEOUT).await;
        }
        // The last spans: those of the requests drained before the stop.
        while let Ok(span) = self.spans.try_recv() {
            batch.push(span);
            if batch.len() == MAX_BATCH {
                self.export(&mut batch, FINAL_EXPORT_TIMEOUT).await;
            }
        }
        if !batch.is_empty() {
            self.export(&mut batch, FINAL_EXPORT_TIMEOUT).await;
        }
    }

    /// Posts `batch` (left empty); counts its spans as dropped when the collector does not
    /// take it.
    pub(super) async fn export(&mut self, batch: &mut Vec<Finished>, timeout: Duration) {
        let count = batch.len() as u64;
        let body = encode(&self.resource, batch.drain(..));
        match tokio::time::timeout(timeout, self.post(body)).await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => self.failed_export(count, &why),
            Err(_) => self.failed_export(count, "no answer within 10s"),
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
        // Read whole, so the connection can carry the next batch.
        let answer = resp.into_body().collect().await.map_err(|e| e.to_string())?;
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
    let (name, kind, attributes, error, remote_parent) = match fields {
        Fields::Server(f) => {
            let error = f
                .error
                .map(str::to_owned)
                .or_else(|| (f.status >= 500).then(|| f.status.to_string()));
            (
                f.method.clone(),
                span::SpanKind::Server,
                server_attributes(*f, error.clone()),
                error,
                true,
            )
        }
        Fields::Client(f) => {
            let status = f.status.unwrap_or(0);
            let error = f
                .error
                .map(str::to_owned)
                .or_else(|| (status >= 400).then(|| status.to_string()));
            (
                f.method.to_string(),
                span::SpanKind::Client,
                client_attributes(*f, error.clone()),
                error,
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
        status: error.map(|_| Status {
            message: String::new(),
            code: status::StatusCode::Error as i32,
        }),
        ..Span::default()
    }
}

fn server_attributes(f: ServerFields, error: Option<String>) -> Vec<KeyValue> {
    let mut out = Vec::with_capacity(16);
    out.push(text("http.request.method", f.method));
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
    out.push(text("http.request.method", f.method.to_string()));
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
