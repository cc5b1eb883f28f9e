//! The one place that sees a request whole, on HTTP/1.1 and h2c alike: its span, entered
//! around every poll of its handling, and its access-log line. What the line needs is read off
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

/// A request's line as far as it is known before forwarding.
#[derive(Debug)]
pub(super) struct Pending {
    record: Record,
    started: Instant,
    bytes_in: Option<Arc<AtomicU64>>,
}

impl Pending {
    /// Reads the line's request fields off `req` (and counts its body from now on).
    pub(super) fn begin(req: &mut Request<RequestBody>, source: &Source, log: &AccessLog) -> Self {
        let headers = req.headers();
        let text = |name: http::header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        let authority = req
            .uri()
            .authority()
            .map(http::uri::Authority::as_str)
            .or_else(|| text(http::header::HOST))
            .map_or_else(String::new, |named| redact::authority(named).to_owned());
        let path = match (log.with_query(), req.uri().path_and_query()) {
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
        record.trace_id = headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(trace_id);
        if log.wants_user_agent() {
            record.user_agent = headers.get(http::header::USER_AGENT).map(|v| v.as_bytes().into());
        }
        Pending {
            record,
            started: Instant::now(),
            bytes_in: req.body_mut().count(),
        }
    }

    /// The response head is in: its body carries the line on.
    pub(super) fn respond(
        mut self,
        resp: Response<ResponseBody>,
        routed: Routed,
        error: Option<&'static str>,
        log: &Arc<AccessLog>,
    ) -> Response<ResponseBody> {
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
        let log = log.clone();
        resp.map(|inner| {
            ResponseBody::Logged(Box::new(Logged {
                inner,
                pending: self,
                log,
            }))
        })
    }
}

/// A response body whose request's line is written when it ends.
#[derive(Debug)]
pub struct Logged {
    inner: ResponseBody,
    pending: Pending,
    log: Arc<AccessLog>,
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
        self.log.write(&pending.record);
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
