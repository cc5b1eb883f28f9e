//! The one place that sees a request whole, on HTTP/1.1 and h2c alike: its span, entered
//! around every poll of its handling, its access-log line, and its OpenTelemetry span (kind
//! SERVER, `trace`), which ends with the line. What the line needs is read off
//! the request before it is forwarded, off the routing decision, off the response head and what
//! was served when it comes, and off the response body as it streams (its bytes, and what an
//! LLM answer spent, `meter`); the line is queued when the body ends or is dropped (a client
//! that left mid-body still gets its line, with the bytes that went out).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body::{Body, Frame, SizeHint};

use super::ResponseBody;
use crate::access_log::{trace_id, AccessLog, Record};
use crate::clients::Source;
use crate::redact;
use crate::trace;
use crate::wire::{BoxError, RequestBody};

pin_project_lite::pin_project! {
    /// A request being handled, in its span: entered around each poll (not `Instrumented`,
    /// which would move the whole future once more), so that what the request path logs
    /// carries the request's method and target. `F` forwards it unlogged, under the net of
    /// `crate::caught`; `L` forwards it under its access-log line.
    pub struct Handling<F, L> {
        span: tracing::Span,
        #[pin]
        forwarding: Forwarding<F, L>,
    }
}

pin_project_lite::pin_project! {
    #[project = ForwardingProj]
    enum Forwarding<F, L> {
        Plain { #[pin] forward: F },
        Logged { logged: Pin<Box<L>> },
    }
}

impl<F, L> Handling<F, L> {
    /// `forward`, unlogged, in `span` (see [`span`]).
    pub(super) fn plain(span: tracing::Span, forward: F) -> Self {
        Handling {
            span,
            forwarding: Forwarding::Plain { forward },
        }
    }

    /// `logged`, which writes the request's line, in `span`.
    pub(super) fn logged(span: tracing::Span, logged: Pin<Box<L>>) -> Self {
        Handling {
            span,
            forwarding: Forwarding::Logged { logged },
        }
    }

    /// The request's span, taken: for what goes on after the response (a switch of protocols).
    pub fn take_span(self: Pin<&mut Self>) -> tracing::Span {
        std::mem::replace(self.project().span, tracing::Span::none())
    }
}

/// A new span for `req`: its method and target, userinfo removed.
pub(super) fn span(req: &Request<RequestBody>) -> tracing::Span {
    tracing::debug_span!("request", method = %req.method(), uri = %redact::uri(req.uri()))
}

/// How forwarding a request ended: its response, the error to answer with, or a caught panic.
pub type Forwarded =
    Result<Result<Response<ResponseBody>, crate::error::ProxyError>, crate::caught::Panicked>;

impl<F, L> Future for Handling<F, L>
where
    F: Future<Output = Forwarded>,
    L: Future<Output = Response<ResponseBody>>,
{
    type Output = Response<ResponseBody>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Response<ResponseBody>> {
        let this = self.project();
        let _entered = this.span.enter();
        match this.forwarding.project() {
            ForwardingProj::Plain { forward } => forward.poll(cx).map(super::answer),
            ForwardingProj::Logged { logged } => logged.as_mut().poll(cx),
        }
    }
}

impl<F, L> std::fmt::Debug for Handling<F, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handling")
            .field("span", &self.span)
            .finish_non_exhaustive()
    }
}

/// What [`super::Proxy::forward`] learned of the upstream, for the line.
#[derive(Debug, Default)]
pub(super) struct Routed {
    /// The upstream's label.
    pub(super) upstream: Option<Arc<str>>,
    /// Its scheme.
    pub(super) scheme: Option<&'static str>,
}

/// How long admission (pacing, the fleet's rate limit) held a request, in its response's
/// extensions.
#[derive(Debug, Clone, Copy)]
pub(super) struct AdmissionWait(pub(super) std::time::Duration);

/// A request's line and span as far as they are known before forwarding.
#[derive(Debug)]
pub(super) struct Pending {
    record: Record,
    started: Instant,
    bytes_in: Option<Arc<AtomicU64>>,
    /// The request's OpenTelemetry span, when it is traced.
    server: Option<trace::Server>,
    /// How long admission held the request.
    admission_wait: Option<std::time::Duration>,
}

impl Pending {
    /// Reads the line's request fields off `req` (and counts its body from now on). A traced
    /// request carries its span's context to the upstream attempts (`trace::Traced`).
    pub(super) fn begin(
        req: &mut Request<RequestBody>,
        source: &Source,
        log: Option<&AccessLog>,
        server: Option<trace::Server>,
    ) -> Self {
        let headers = req.headers();
        let text = |name: http::header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        let authority = req
            .uri()
            .authority()
            .map(http::uri::Authority::as_str)
            .or_else(|| text(http::header::HOST))
            .map_or_else(String::new, |named| redact::authority(named).to_owned());
        let path = match (log.is_some_and(AccessLog::with_query), req.uri().path_and_query()) {
            (true, Some(pq)) => pq.as_str().to_owned(),
            _ => req.uri().path().to_owned(),
        };
        let mut record = Record::begin(
            SystemTime::now(),
            Some(source.clone()),
            req.method().to_string(),
            authority,
            path,
        );
        record.protocol = protocol(req.version());
        record.trace_id = match &server {
            Some(server) => Some(server.traced().trace_id_hex()),
            None => headers
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .and_then(trace_id),
        };
        if log.is_some_and(AccessLog::wants_user_agent) {
            record.user_agent = headers.get(http::header::USER_AGENT).map(|v| v.as_bytes().into());
        }
        if let Some(server) = &server {
            req.extensions_mut().insert(server.traced().clone());
        }
        Pending {
            record,
            started: Instant::now(),
            bytes_in: req.body_mut().count(),
            server,
            admission_wait: None,
        }
    }

    /// The response head is in: its body carries the line on.
    pub(super) fn respond(
        mut self,
        resp: Response<ResponseBody>,
        routed: Routed,
        error: Option<&'static str>,
        log: Option<&Arc<AccessLog>>,
    ) -> Response<ResponseBody> {
        self.admission_wait = resp.extensions().get::<AdmissionWait>().map(|w| w.0);
        let r = &mut self.record;
        r.status = resp.status().as_u16();
        r.error = error;
        r.upstream = routed.upstream;
        if let Some(scheme) = routed.scheme {
            r.scheme = scheme;
        }
        if let Some(body) = resp.body().pooled() {
            let served = body.served();
            r.endpoint = served.endpoint;
            r.reused = served.reused;
            r.upstream_protocol = Some(if served.http2 { "HTTP/2" } else { "HTTP/1.1" });
            r.retries = body.retries();
        }
        r.ttfb_ms = ms(self.started);
        let log = log.cloned();
        resp.map(|inner| {
            ResponseBody::Logged(Box::new(Logged {
                inner,
                pending: self,
                log,
            }))
        })
    }
}

/// A response body whose request's line is written, and span ended, when it ends.
#[derive(Debug)]
pub struct Logged {
    inner: ResponseBody,
    pending: Pending,
    log: Option<Arc<AccessLog>>,
}

impl Logged {
    pub(super) fn take_wire_fields(&mut self) -> Option<crate::wire::WireFields> {
        self.inner.take_wire_fields()
    }
}

impl Body for Logged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            let len = frame.data_ref().map_or(0, |d| d.len() as u64);
            self.pending.record.bytes_out += len;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let pending = &mut self.pending;
        pending.record.duration_ms = ms(pending.started);
        if let Some(bytes) = &pending.bytes_in {
            pending.record.bytes_in = bytes.load(Ordering::Relaxed);
        }
        if let Some(spent) = self.inner.spent() {
            let r = &mut pending.record;
            r.model = spent.model;
            if let Some(tokens) = spent.tokens {
                r.input_tokens = Some(tokens.input);
                r.output_tokens = Some(tokens.output);
                r.cached_tokens = Some(tokens.cache_read);
            }
        }
        if let Some(log) = &self.log {
            log.write(&pending.record);
        }
        if let Some(server) = pending.server.take() {
            server.end(server_fields(&mut pending.record, pending.admission_wait));
        }
    }
}

/// What a request's span says, moved out of its line (written by now).
fn server_fields(r: &mut Record, admission_wait: Option<std::time::Duration>) -> trace::ServerFields {
    let mut path = std::mem::take(&mut r.path);
    if let Some(at) = path.find('?') {
        path.truncate(at);
    }
    trace::ServerFields {
        method: std::mem::take(&mut r.method),
        scheme: r.scheme,
        authority: std::mem::take(&mut r.authority),
        path,
        status: r.status,
        error: r.error,
        protocol: r.protocol,
        client: match &r.source {
            Some(Source::Tcp(addr)) => Some(*addr),
            _ => None,
        },
        upstream: r.upstream.take(),
        retries: r.retries,
        admission_wait,
        model: r.model.take(),
        tokens: r.input_tokens.zip(r.output_tokens),
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_10 => "HTTP/1.0",
        _ => "HTTP/1.1",
    }
}
