//! OpenTelemetry traces: which requests are traced (a `traceparent`'s sampled flag, else
//! `tracing.sample`), W3C trace context in and out, the span of a request (kind SERVER) and of
//! each upstream attempt (kind CLIENT), and handing finished spans to the exporter
//! ([`export`]) through a bounded queue that drops, counted, rather than wait.
//!
//! # Why not the OpenTelemetry SDK
//! The spans leave as OTLP protobuf built from `opentelemetry-proto`'s messages (the OTel
//! project's own generated types), but they are made here, not by `opentelemetry_sdk`'s tracer:
//! - On the request path a span here is a struct of typed fields (ids, times, a status, the
//!   addresses): no attribute is made into a key-value until the exporter's task encodes the
//!   batch. The SDK's span holds `Vec<KeyValue>` built as the request goes, a `Context` passed
//!   through a thread-local, and its span processors and exporters behind `dyn` calls.
//! - The SDK's batch processor runs a thread of its own, and counts what it drops only in its
//!   own log; `egress_trace_spans_dropped_total` needs the count, and a sidecar in 64 MiB a
//!   thread's stack less.
//! - `opentelemetry-otlp`'s HTTP exporter brings reqwest (or hyper-util's pooled client), a
//!   second HTTP client beside the one hyper already gives; the exporter here keeps one
//!   HTTP/1.1 connection to the collector with hyper's client.
//! - Sampling (parent-based, ratio for roots) and W3C `traceparent` are a page each.
//!
//! Measured (`benches/RESULTS.md`, "Traces"; callgrind, one SERVER and one CLIENT span per
//! request): the SDK's request path (its tracer, a processor that queues `SpanData`) takes
//! 23,841 instructions to this module's 6,815; the export side is alike (44,398 for the SDK's
//! grouping and encoding, 48,713 here with the post), as both build `opentelemetry-proto`'s
//! messages. The crates save no work where it counts, on the request; they would add a thread.
//!
//! Off (no `tracing.otlp`), the proxy holds no [`Tracer`] and a request costs one branch.

pub mod export;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Request};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;

use crate::config::TracingConfig;

/// W3C trace context's fields.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// The vendors' part of W3C trace context.
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
/// W3C baggage.
pub const BAGGAGE: HeaderName = HeaderName::from_static("baggage");

/// Spans waiting for the exporter; past it they are dropped (OpenTelemetry's default queue).
pub const QUEUE_SPANS: usize = 2048;

/// Makes spans and queues them for export.
#[derive(Debug)]
pub struct Tracer {
    /// Roots are traced when a draw falls below this (`u64::MAX`: always).
    threshold: u64,
    ids: Ids,
    queue: mpsc::Sender<Finished>,
    dropped: Counter,
}

impl Tracer {
    /// A tracer for `config` and the exporter that drains its queue; `None` when tracing is off.
    /// `dropped` counts spans the full queue refused, `failed` those the collector did not take.
    pub fn start(
        config: &TracingConfig,
        dropped: Counter,
        failed: Counter,
    ) -> Option<(Arc<Tracer>, export::Exporter)> {
        let otlp = config.otlp.clone()?;
        let (queue, spans) = mpsc::channel(QUEUE_SPANS);
        let threshold = if config.sample >= 1.0 {
            u64::MAX
        } else {
            (config.sample * u64::MAX as f64) as u64
        };
        let tracer = Tracer {
            threshold,
            ids: Ids::seeded(),
            queue,
            dropped,
        };
        let exporter = export::Exporter::new(otlp, &config.service_name, spans, failed);
        Some((Arc::new(tracer), exporter))
    }

    /// The SERVER span of a request with `headers`, when it is traced: under the application's
    /// `traceparent` when it has a valid one (traced when its sampled flag is set), else the
    /// root of a new trace, traced by `tracing.sample`.
    pub fn server(self: &Arc<Self>, headers: &HeaderMap) -> Option<ServerSpan> {
        let (trace_id, parent) = match headers.get(TRACEPARENT).and_then(|v| parse(v.as_bytes())) {
            Some(parent) if !parent.sampled => return None,
            Some(parent) => (parent.trace_id, Some(parent.span_id)),
            None if self.threshold == u64::MAX || self.ids.draw() < self.threshold => {
                (self.ids.trace_id(), None)
            }
            None => return None,
        };
        Some(ServerSpan {
            traced: Traced {
                tracer: self.clone(),
                trace_id,
                span_id: self.ids.span_id(),
                root: parent.is_none(),
                retry_reason: None,
                admission_wait: Arc::default(),
            },
            parent,
            start: SystemTime::now(),
            started: std::time::Instant::now(),
        })
    }

    fn submit(&self, span: Finished) {
        if self.queue.try_send(span).is_err() {
            self.dropped.inc();
        }
    }
}

/// A traced request's context, carried in its extensions to the upstream attempts.
#[derive(Debug, Clone)]
pub struct Traced {
    tracer: Arc<Tracer>,
    trace_id: [u8; 16],
    /// The request's (SERVER) span: the attempts' parent.
    span_id: [u8; 8],
    /// The trace began here (no valid `traceparent` came): the app's `tracestate` belongs to
    /// no trace the upstream will see.
    root: bool,
    /// Why the next attempt is made, when it is a retry.
    retry_reason: Option<String>,
    /// Nanoseconds admission held the request (0: none), shared with the request's span, so
    /// that a request that fails after its wait still shows it.
    admission_wait: Arc<AtomicU64>,
}

impl Traced {
    /// The trace's id in hex, as the access log shows it.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }
}

/// A request's span (kind SERVER), open: kept by the request's observer until its response
/// body ends, or until the request is given up (the observer then ends it as `canceled`).
#[derive(Debug)]
pub struct ServerSpan {
    traced: Traced,
    parent: Option<[u8; 8]>,
    start: SystemTime,
    /// `start` on the monotonic clock: the end is `start` plus what it measures, so a step of
    /// the wall clock cannot make a span end before it starts.
    started: std::time::Instant,
}

impl ServerSpan {
    /// The context the request carries to its attempts.
    pub fn traced(&self) -> &Traced {
        &self.traced
    }

    /// Ends the span with what the request's line knows.
    pub fn end(self, mut fields: ServerFields) {
        let Traced {
            tracer,
            trace_id,
            span_id,
            admission_wait,
            ..
        } = self.traced;
        fields.method = bounded(std::mem::take(&mut fields.method));
        fields.authority = bounded(std::mem::take(&mut fields.authority));
        fields.path = bounded(std::mem::take(&mut fields.path));
        let waited = admission_wait.load(Ordering::Relaxed);
        fields.admission_wait = (waited > 0).then(|| Duration::from_nanos(waited));
        tracer.submit(Finished {
            trace_id,
            span_id,
            parent: self.parent,
            start: self.start,
            end: self.start + self.started.elapsed(),
            fields: Fields::Server(Box::new(fields)),
        });
    }
}

/// What a request's span says, read off its access-log record when it ends.
#[derive(Debug, Default)]
pub struct ServerFields {
    /// Method.
    pub method: String,
    /// `http` or `https`: how the upstream is reached.
    pub scheme: &'static str,
    /// The host[:port] the request named, userinfo removed.
    pub authority: String,
    /// Path; a query is cut off here.
    pub path: String,
    /// What the application got.
    pub status: u16,
    /// The `x-egress-error` kind of a sidecar-made answer.
    pub error: Option<&'static str>,
    /// The downstream protocol (`HTTP/1.1`, `HTTP/2`).
    pub protocol: &'static str,
    /// The application's address, when it came over TCP.
    pub client: Option<SocketAddr>,
    /// The upstream's label.
    pub upstream: Option<Arc<str>>,
    /// Times the request was sent again.
    pub retries: u32,
    /// How long admission (pacing, the fleet's rate limit) held the request (set by
    /// [`ServerSpan::end`]).
    pub admission_wait: Option<Duration>,
    /// The model an LLM answer named.
    pub model: Option<Arc<str>>,
    /// Tokens an LLM answer reported: input, output.
    pub tokens: Option<(u64, u64)>,
}

/// An upstream attempt's span (kind CLIENT), open from asking the pool until the response head
/// or failure. Dropped unended (the application left, or the request's deadline passed), it is
/// exported with `error.type` `canceled`.
#[derive(Debug)]
pub struct ClientSpan {
    tracer: Arc<Tracer>,
    trace_id: [u8; 16],
    parent: [u8; 8],
    span_id: [u8; 8],
    start: SystemTime,
    asked: tokio::time::Instant,
    fields: ClientFields,
    ended: bool,
}

/// What an attempt's span says.
#[derive(Debug, Default)]
pub struct ClientFields {
    method: http::Method,
    scheme: &'static str,
    host: String,
    port: u16,
    path: String,
    resend_count: u32,
    retry_reason: Option<String>,
    status: Option<u16>,
    error: Option<&'static str>,
    http2: bool,
    peer: Option<SocketAddr>,
    pool_wait: Option<Duration>,
    reused: bool,
}

/// The upstream an attempt goes to, as its span names it.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `http` or `https`.
    pub scheme: &'static str,
    /// Host.
    pub host: &'a str,
    /// Port.
    pub port: u16,
}

impl ClientSpan {
    /// The span of an attempt at sending `req` (the `resend_count`th resend) to `target`, when
    /// the request is traced; its `traceparent` becomes the attempt's unless `propagate` is off.
    pub fn begin(
        req: &mut Request<crate::wire::RequestBody>,
        target: Target<'_>,
        resend_count: u32,
        propagate: bool,
    ) -> Option<Box<ClientSpan>> {
        // Looked up first: an untraced request pays this lookup only.
        if !is_traced(req) {
            return None;
        }
        let method = bounded_method(req.method());
        let path = req.uri().path().to_owned();
        let traced = req.extensions_mut().get_mut::<Traced>()?;
        let span_id = traced.tracer.ids.span_id();
        let attempt = Box::new(ClientSpan {
            tracer: traced.tracer.clone(),
            trace_id: traced.trace_id,
            parent: traced.span_id,
            span_id,
            start: SystemTime::now(),
            asked: tokio::time::Instant::now(),
            fields: ClientFields {
                method,
                scheme: target.scheme,
                host: target.host.to_owned(),
                port: target.port,
                path: bounded(path),
                resend_count,
                retry_reason: traced.retry_reason.take(),
                ..ClientFields::default()
            },
            ended: false,
        });
        if propagate {
            let header = traceparent(&attempt.trace_id, &span_id);
            let root = traced.root;
            let headers = req.headers_mut();
            headers.insert(TRACEPARENT, header);
            if root {
                headers.remove(TRACESTATE);
            }
        }
        Some(attempt)
    }

    /// The pool gave a connection at `granted`: to `peer`, reused or dialed, HTTP/2 or not.
    pub fn leased(
        &mut self,
        granted: tokio::time::Instant,
        peer: Option<SocketAddr>,
        reused: bool,
        http2: bool,
    ) {
        let f = &mut self.fields;
        f.pool_wait = Some(granted.saturating_duration_since(self.asked));
        f.peer = peer;
        f.reused = reused;
        f.http2 = http2;
    }

    /// The attempt ended with a response head of `status`.
    pub fn answered(mut self: Box<Self>, status: u16) {
        self.fields.status = Some(status);
        self.end();
    }

    /// The attempt failed with the error of `kind`.
    pub fn failed(mut self: Box<Self>, kind: &'static str) {
        self.fields.error = Some(kind);
        self.end();
    }

    fn end(&mut self) {
        self.ended = true;
        let fields = std::mem::take(&mut self.fields);
        self.tracer.submit(Finished {
            trace_id: self.trace_id,
            span_id: self.span_id,
            parent: Some(self.parent),
            start: self.start,
            end: self.start + self.asked.elapsed(),
            fields: Fields::Client(Box::new(fields)),
        });
    }
}

impl Drop for ClientSpan {
    fn drop(&mut self) {
        if !self.ended {
            self.fields.error = Some("canceled");
            self.end();
        }
    }
}

/// Whether `req` is traced (carries its span's context).
pub fn is_traced<B>(req: &Request<B>) -> bool {
    req.extensions().get::<Traced>().is_some()
}

/// Notes on a traced request how long admission held it.
pub fn admitted<B>(req: &Request<B>, waited: Duration) {
    if let Some(traced) = req.extensions().get::<Traced>() {
        let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX).max(1);
        traced.admission_wait.store(nanos, Ordering::Relaxed);
    }
}

/// Past this a path or authority is cut (at a character's boundary) before it is kept in a
/// span: a queue of spans must not hold 64 KiB heads (OpenTelemetry's attribute value length
/// limit, set).
pub const MAX_VALUE_BYTES: usize = 2048;

/// `text`, cut to [`MAX_VALUE_BYTES`].
pub fn bounded(mut text: String) -> String {
    if text.len() > MAX_VALUE_BYTES {
        let mut at = MAX_VALUE_BYTES;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
    }
    text
}

/// `method`, cut to [`MAX_VALUE_BYTES`]: an extension method is as long as the head allows.
fn bounded_method(method: &http::Method) -> http::Method {
    let text = method.as_str().as_bytes();
    match text.get(..MAX_VALUE_BYTES) {
        // A method is token characters (ASCII): any cut of it is one too.
        Some(cut) if text.len() > MAX_VALUE_BYTES => {
            http::Method::from_bytes(cut).unwrap_or_else(|_| method.clone())
        }
        _ => method.clone(),
    }
}

/// Notes on a traced request why its next attempt is made.
pub fn retrying(req: &mut Request<crate::wire::RequestBody>, reason: impl Into<String>) {
    if let Some(traced) = req.extensions_mut().get_mut::<Traced>() {
        traced.retry_reason = Some(reason.into());
    }
}

/// Removes the trace context an application sent, for an upstream that must not see it.
pub fn strip_context(headers: &mut HeaderMap) {
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    headers.remove(BAGGAGE);
}

/// A span ended, waiting for export.
#[derive(Debug)]
pub struct Finished {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    start: SystemTime,
    end: SystemTime,
    fields: Fields,
}

/// A span's kind and what it says; boxed, so a queued span is small.
#[derive(Debug)]
enum Fields {
    Server(Box<ServerFields>),
    Client(Box<ClientFields>),
}

/// A parsed `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    /// The trace.
    pub trace_id: [u8; 16],
    /// The caller's span.
    pub span_id: [u8; 8],
    /// The sampled flag.
    pub sampled: bool,
}

/// A W3C `traceparent` (`version-traceid-parentid-flags`, lower-case hex), if valid: version
/// 00 exactly, a later version by its first four fields; ids not all zeros; version ff never.
pub fn parse(value: &[u8]) -> Option<Parent> {
    if value.len() < 55 || (value.len() > 55 && value[55] != b'-') {
        return None;
    }
    let version = unhex::<1>(&value[0..2])?[0];
    if version == 0xff || (version == 0 && value.len() != 55) {
        return None;
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let trace_id = unhex::<16>(&value[3..35])?;
    let span_id = unhex::<8>(&value[36..52])?;
    let flags = unhex::<1>(&value[53..55])?[0];
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// `00-<trace>-<span>-01`: a sampled span's context.
pub fn traceparent(trace_id: &[u8; 16], span_id: &[u8; 8]) -> HeaderValue {
    let mut text = String::with_capacity(55);
    text.push_str("00-");
    text.push_str(&hex(trace_id));
    text.push('-');
    text.push_str(&hex(span_id));
    text.push_str("-01");
    HeaderValue::from_str(&text).expect("hex is a valid header value")
}

/// Lower-case hex, as W3C trace context and OTLP's JSON write ids.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// `N` bytes from `2N` lower-case hex digits (W3C forbids upper case).
fn unhex<const N: usize>(text: &[u8]) -> Option<[u8; N]> {
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (i, pair) in text.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

/// Span and trace ids: SplitMix64 over a counter from a random start, so no two ids of this
/// process are alike (the mix is a bijection) and other processes start elsewhere. Not a
/// secret: trace ids are visible to every hop anyway.
#[derive(Debug)]
struct Ids {
    state: AtomicU64,
}

impl Ids {
    fn seeded() -> Self {
        use std::hash::BuildHasher;
        let seed =
            std::collections::hash_map::RandomState::new().hash_one((std::process::id(), SystemTime::now()));
        Ids {
            state: AtomicU64::new(seed),
        }
    }

    fn draw(&self) -> u64 {
        const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut z = self
            .state
            .fetch_add(GOLDEN, Ordering::Relaxed)
            .wrapping_add(GOLDEN);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Never all zeros (invalid in W3C trace context).
    fn span_id(&self) -> [u8; 8] {
        loop {
            let id = self.draw();
            if id != 0 {
                return id.to_be_bytes();
            }
        }
    }

    fn trace_id(&self) -> [u8; 16] {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&self.draw().to_be_bytes());
        id[8..].copy_from_slice(&self.span_id());
        id
    }
}

#[cfg(test)]
mod tests;
