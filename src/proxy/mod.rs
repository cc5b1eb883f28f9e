//! The request path, from a parsed downstream request to the response the application sees.
//!
//! Order, outermost first:
//! 1. [`observe`]: the request's span and access-log line, for HTTP/1.1 and h2c alike; errors
//!    become responses ([`ProxyError::to_response`]), logged once here;
//! 2. `routing`: pick the upstream, apply policy and loop detection;
//! 3. `headers`: origin-form, `Host`, hop-by-hop removal;
//! 4. [`admit`]: whether the request goes now, after a wait, or is refused;
//! 5. `upstream`: pooled connection, response-head deadline, stale-connection retry;
//! 6. `headers` again on the way back.
//!
//! Requests that end HTTP on their connection leave this path: CONNECT goes to [`connect`]
//! (the downstream task calls it directly), and an upgrade request is sent by [`upgrade`] on a
//! dedicated connection instead of the pool (step 4). Both hand the tunnel they answer to the
//! caller; `tunnel` owns it from there.
//!
//! Not handled here: the wire format (`wire`), connections (`downstream`).

pub mod admit;
pub mod connect;
pub mod headers;
pub mod meter;
pub mod observe;
pub mod upgrade;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use prometheus_client::metrics::counter::Counter;

use std::sync::Arc;

use crate::access_log::{self, AccessLog};
use crate::caught;
use crate::clients::Source;
use crate::error::{ErrorKind, ProxyError};
use crate::routing::{Arrival, Router};
use crate::trace::Tracer;
use crate::upstream::{Deadline, TimedBody, Upstream};
use crate::wire::codec::{self, ResponseFraming};
use crate::wire::{BoxError, HeadLines, RequestBody, WireFields};

/// Handles downstream requests.
#[derive(Debug)]
pub struct Proxy {
    router: Router,
    access_log: Option<Arc<AccessLog>>,
    tracer: Option<Arc<Tracer>>,
    admit: admit::Admit,
}

impl Proxy {
    /// A proxy routing with `router`.
    pub fn new(router: Router) -> Self {
        Proxy {
            router,
            access_log: None,
            tracer: None,
            admit: admit::Admit::default(),
        }
    }

    /// This proxy, admitting requests as `admit` decides.
    #[cfg(test)]
    pub(crate) fn with_admit(mut self, admit: admit::Admit) -> Self {
        self.admit = admit;
        self
    }

    /// This proxy, writing a line per request (sampled) to `log`.
    pub fn with_access_log(mut self, log: Option<AccessLog>) -> Self {
        self.access_log = log.map(Arc::new);
        self
    }

    /// This proxy, tracing requests with `tracer` (`None`: tracing is off).
    pub fn with_tracer(mut self, tracer: Option<Arc<Tracer>>) -> Self {
        self.tracer = tracer;
        self
    }

    /// Whether requests may be logged: the downstream side then says where each came from.
    pub fn logs_access(&self) -> bool {
        self.access_log.is_some()
    }

    /// Logs a request refused before it could be forwarded (a malformed or oversized head).
    pub fn log_refused(&self, source: Option<Source>, err: &ProxyError) {
        let Some(log) = self.access_log.as_ref().filter(|log| log.sampled()) else {
            return;
        };
        let mut record = access_log::Record::begin(
            std::time::SystemTime::now(),
            source,
            "-".to_owned(),
            "-".to_owned(),
            "-".to_owned(),
        );
        record.status = err.kind().status().as_u16();
        record.error = Some(err.kind().as_str());
        log.write(&record);
    }

    /// The router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Forwards `req`, which came from `source`; failures become sidecar-made error responses.
    /// The one entry for HTTP/1.1 and h2c requests: the returned future is the request's
    /// observer ([`observe::Handling`]): its span, and its access-log line when sampled.
    ///
    /// An HTTP/1.1 upstream's fields may come as lines in the body, the map left empty
    /// ([`ResponseBody::take_wire_fields`]): a caller that reads or writes the map calls
    /// [`map_wire_fields`] first.
    ///
    /// The request is lent (it is left spent), not moved: each level of the path that owned it
    /// would hold a copy of it in its future, and move it once more on the way down. For the
    /// same reason the observer is a struct, not one more `async` level around `forward`.
    pub fn handle<'a>(
        &'a self,
        req: &'a mut Request<RequestBody>,
        lines: &'a mut HeadLines,
        arrival: &'a Arrival,
        source: &'a Source,
    ) -> observe::Handling<
        impl Future<Output = observe::Forwarded> + 'a,
        impl Future<Output = Response<ResponseBody>> + 'a,
    > {
        let span = observe::span(req);
        let log = self.access_log.as_ref().filter(|log| log.sampled());
        // Off, tracing is this one branch.
        let server = match &self.tracer {
            Some(tracer) => tracer.server(req.headers()),
            None => None,
        };
        if matches!(arrival, Arrival::Forward) && req.uri().authority().is_none() {
            // The forward proxy routes an origin-form request by its `Host`.
            lines.into_map(req.headers_mut());
        }
        if log.is_none() && server.is_none() {
            return observe::Handling::plain(span, self.forward_caught(req, lines, arrival, source, None));
        }
        // The line and the span read the request's fields by name.
        lines.into_map(req.headers_mut());
        // Boxed: the unobserved path should not carry the line's state in its future.
        observe::Handling::logged(
            span,
            Box::pin(self.handle_observed(req, arrival, source, log, server)),
        )
    }

    /// A request with an access-log line or a span (or both).
    async fn handle_observed(
        &self,
        req: &mut Request<RequestBody>,
        arrival: &Arrival,
        source: &Source,
        log: Option<&Arc<AccessLog>>,
        server: Option<crate::trace::ServerSpan>,
    ) -> Response<ResponseBody> {
        let pending = observe::Pending::begin(req, source, log.map(|log| &**log), server);
        let mut routed = observe::Routed::default();
        let mut lines = HeadLines::default();
        let forwarded = self
            .forward_caught(req, &mut lines, arrival, source, Some(&mut routed))
            .await;
        let error = match &forwarded {
            Ok(Err(err)) => Some(err.kind().as_str()),
            Err(_) => Some(ErrorKind::Internal.as_str()),
            Ok(Ok(_)) => None,
        };
        pending.respond(answer(forwarded), routed, error, log)
    }

    /// [`Self::forward`] under the net of `crate::caught`, awaited by the caller: a plain
    /// function, as one more `async` level would add its own state to every request's future.
    fn forward_caught<'a>(
        &'a self,
        req: &'a mut Request<RequestBody>,
        lines: &'a mut HeadLines,
        arrival: &'a Arrival,
        source: &'a Source,
        routed: Option<&'a mut observe::Routed>,
    ) -> caught::Caught<impl Future<Output = Result<Response<ResponseBody>, ProxyError>> + 'a, &'a Counter>
    {
        caught::Caught::new(
            self.forward(req, lines, arrival, source, routed),
            &self.router.metrics().families().panics,
        )
    }

    async fn forward(
        &self,
        req: &mut Request<RequestBody>,
        lines: &mut HeadLines,
        arrival: &Arrival,
        source: &Source,
        routed: Option<&mut observe::Routed>,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        if req.method() == Method::CONNECT {
            return Err(connect_refused());
        }
        #[cfg(test)]
        if req.headers().contains_key(tests::PANIC_HEADER) {
            panic!("{} asked for a panic", tests::PANIC_HEADER);
        }
        // Lines hold none of the fields the scan looks for, nor `Upgrade`.
        let scanned = headers::scan(req.headers());
        let upgrade = scanned.upgrade() && upgrade::requested(req);
        let target = self.router.route(arrival, req.uri(), req.headers())?;
        if lines.is_kept() && target.upstream.reads_request_fields() {
            lines.into_map(req.headers_mut());
        }
        if let Some(routed) = routed {
            routed.upstream = Some(target.upstream.label().into());
            routed.scheme = Some(target.upstream.scheme().as_str());
        }
        if req.method() == Method::OPTIONS || req.method() == Method::TRACE {
            if let Some(answer) = last_hop(req)? {
                return Ok(answer);
            }
        }
        // Read (and removed) before anything goes upstream; an upgrade ignores them. Of
        // `x-egress-app`, only its label's id lives on (in a block: a field held across the
        // send would be 40 bytes of every request's future).
        let (timeout, no_retry, pace, named, global_rate_limit) = {
            let asked = headers::take_asked(req, scanned)
                .map_err(|why| ProxyError::new(ErrorKind::BadRequest, why))?;
            let global_rate_limit = target
                .upstream
                .global_rate_limit()
                .and_then(|limiter| describe_global(limiter, req, asked.app.as_ref(), source, arrival));
            let named = meter::Named::of(req, &target.upstream, asked.app);
            (
                asked.timeout,
                asked.no_retry,
                asked.pace,
                named,
                global_rate_limit,
            )
        };
        if upgrade {
            headers::to_upstream_upgrade(req, target.upstream.host_header());
        } else {
            headers::to_upstream_scanned(req, lines, target.upstream.host_header(), scanned);
        }
        target.upstream.rewrite_headers(req.headers_mut());
        let deadline = target.upstream.deadline(timeout);
        let admitting = admit::Admitting {
            upstream: &target.upstream,
            request: req,
            source,
            deadline,
            pace,
            global_rate_limit,
        };
        let upstream = &target.upstream;
        let ticket = match self.admit.admit(admitting) {
            (admit::Admission::Now, ticket) => ticket,
            // Boxed, and a path of its own: a request admitted at once carries no wait's state.
            (later, ticket) => {
                let sending = Sending {
                    upstream,
                    no_retry,
                    deadline,
                    upgrade,
                    who: meter::Who {
                        source,
                        arrival,
                        named,
                    },
                };
                return Box::pin(self.send_later(later, req, lines, sending, ticket)).await;
            }
        };
        if upgrade {
            // Not held across the dial: an upgrade's answer is read by no pacing.
            drop(ticket);
            return Self::upgrade(req, upstream).await;
        }
        let going = ticket.going();
        let resp = upstream.send(req, lines, no_retry, deadline, going).await?;
        let who = meter::Who {
            source,
            arrival,
            named,
        };
        Ok(to_downstream(resp, upstream, who, None))
    }

    /// The rest of [`Self::forward`] for a request the admission step did not admit at once.
    async fn send_later(
        &self,
        later: admit::Admission,
        req: &mut Request<RequestBody>,
        lines: &mut HeadLines,
        sending: Sending<'_>,
        ticket: crate::pace::Ticket,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        // Timed for a traced request only: the wait shows on its span, failed or not.
        let asked = crate::trace::is_traced(req).then(std::time::Instant::now);
        let granted = later.granted().await;
        if let Some(asked) = asked {
            crate::trace::admitted(req, asked.elapsed());
        }
        let granted = granted.inspect_err(|err| {
            sending.upstream.failed(err);
        })?;
        if !granted.headers.is_empty() {
            lines.into_map(req.headers_mut());
        }
        let headers = req.headers_mut();
        for (name, value) in granted.headers {
            headers.insert(name, value);
        }
        // Carried only to an upstream that retries by policy: the extensions map is an allocation.
        if let Some(recount) = granted
            .recount
            .filter(|_| !sending.no_retry && sending.upstream.settings().retry.attempts > 0)
        {
            req.extensions_mut().insert(recount);
        }
        if sending.upgrade {
            return Self::upgrade(req, sending.upstream).await;
        }
        let resp = sending
            .upstream
            .send(req, lines, sending.no_retry, sending.deadline, ticket.going())
            .await?;
        Ok(to_downstream(resp, sending.upstream, sending.who, granted.charge))
    }

    /// Sends an upgrade request on a connection of its own (`upgrade`).
    ///
    /// Boxed, so that plain requests do not carry the dial's state in their futures, and
    /// polled through a vtable, so that no build inlines it into the request path's future: a
    /// profile-guided build would lay the code it never saw run among that future's cold
    /// blocks, where a burst of WebSocket upgrades maps it page by page, 64 KiB at a time
    /// (benches/first_burst.py). Out of line it is one function, laid out with the tunnels'.
    fn upgrade<'a>(
        req: &'a mut Request<RequestBody>,
        upstream: &'a Upstream,
    ) -> Pin<Box<dyn Future<Output = Result<Response<ResponseBody>, ProxyError>> + Send + 'a>> {
        Box::pin(Self::send_upgrade(req, upstream))
    }

    /// [`Self::upgrade`]'s request and the rewrite of its answer.
    async fn send_upgrade(
        req: &mut Request<RequestBody>,
        upstream: &Upstream,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        let req = crate::wire::take_request(req);
        let resp = upgrade::send(upstream, req).await.inspect_err(|err| {
            upstream.failed(err);
        })?;
        let mut resp = resp.map(|body| ResponseBody::Direct(Box::new(body)));
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            headers::to_downstream_switch(&mut resp);
        } else {
            headers::to_downstream(&mut resp);
        }
        Ok(resp)
    }
}

/// Where and how an admitted request is sent.
struct Sending<'a> {
    upstream: &'a Upstream,
    no_retry: bool,
    deadline: Option<Deadline>,
    upgrade: bool,
    who: meter::Who<'a>,
}

/// The answer to a CONNECT that reached the request path. Out of line, as [`last_hop`]:
/// `forward`'s future is inlined into `Caught::poll` only while it stays small enough.
#[cold]
#[inline(never)]
fn connect_refused() -> ProxyError {
    // The downstream task hands CONNECT to `connect::serve`; a CONNECT here cannot become a
    // tunnel.
    ProxyError::new(ErrorKind::BadRequest, "CONNECT cannot be forwarded as a request")
}

/// `Max-Forwards` of an OPTIONS or TRACE request: the sidecar's own answer at the last hop,
/// else `None` (the field decremented).
#[inline(never)]
fn last_hop(req: &mut Request<RequestBody>) -> Result<Option<Response<ResponseBody>>, ProxyError> {
    if headers::take_hop(req).map_err(|why| ProxyError::new(ErrorKind::BadRequest, why))? {
        return Ok(Some(headers::last_hop_answer(req).map(ResponseBody::from)));
    }
    Ok(None)
}

/// What the global rate limit's service is asked for `req`, for an upstream that has one. Out
/// of line: most upstreams have none, and `forward`'s future is inlined into `Caught::poll`
/// only while it stays small enough.
#[inline(never)]
fn describe_global(
    limiter: &crate::global_rate_limit::Limiter,
    req: &Request<RequestBody>,
    app: Option<&http::HeaderValue>,
    source: &Source,
    arrival: &Arrival,
) -> Option<Box<crate::global_rate_limit::Asking>> {
    let app = if limiter.needs_app() {
        meter::app_name(app, source, arrival)
    } else {
        None
    };
    limiter.describe(req.headers(), app.as_deref())
}

/// A pooled response from `upstream` on its way to the application, read for usage
/// (`meter`) when the upstream reads it; its tokens go to `charge`, when the global rate limit wants them.
fn to_downstream(
    resp: Response<TimedBody>,
    upstream: &Upstream,
    who: meter::Who<'_>,
    charge: Option<crate::global_rate_limit::Charge>,
) -> Response<ResponseBody> {
    let mut resp = meter::meter(resp, upstream, who, charge);
    headers::to_downstream(&mut resp);
    resp
}

/// What the application gets for a forwarded request: the response, or the error (a caught
/// panic is `502 internal`) as a sidecar-made response, logged once here. Inlined for the
/// response; the errors go out of line.
#[inline]
fn answer(
    forwarded: Result<Result<Response<ResponseBody>, ProxyError>, caught::Panicked>,
) -> Response<ResponseBody> {
    match forwarded {
        Ok(Ok(resp)) => resp,
        Ok(Err(err)) => answer_error(err),
        Err(panicked) => answer_error(panic_error(panicked)),
    }
}

/// A sidecar-made response for `err`, logged.
#[inline(never)]
fn answer_error(err: ProxyError) -> Response<ResponseBody> {
    log_error(&err);
    err.to_response()
}

#[cold]
fn panic_error(caught::Panicked(message): caught::Panicked) -> ProxyError {
    ProxyError::new(
        ErrorKind::Internal,
        format!("the sidecar failed on this request (a bug: {message})"),
    )
}

/// Logs a sidecar-made error once: server errors as warnings, refusals as information.
pub(crate) fn log_error(err: &ProxyError) {
    if err.kind().status().is_server_error() {
        tracing::warn!(error = %err, "request failed");
    } else {
        tracing::info!(error = %err, "request refused");
    }
}

/// A sidecar-made error response on the wire, with `Connection: close`, for paths that write
/// to the socket themselves (tunnels, upgrades).
pub(crate) fn error_bytes(err: &ProxyError) -> Vec<u8> {
    let resp: Response<Bytes> = err.to_response();
    let mut out = Vec::with_capacity(256 + resp.body().len());
    codec::encode_head(
        resp.status(),
        None,
        resp.headers(),
        b"",
        ResponseFraming::Length,
        false,
        Version::HTTP_11,
        &mut out,
    );
    out.extend_from_slice(resp.body());
    out
}

/// A response body: from an upstream, or made by the sidecar.
///
/// Sixteen bytes, each variant a pointer: a response head with its body (128 bytes) moves in
/// registers on its way from the upstream to the writer (through the proxy's admission, its
/// panic net and its observer), where at 192 it was a `memcpy` call at each of six moves. What
/// nearly every response carries, `Upstream`, keeps its state in the pooled body's box; the
/// others are boxed, an allocation on rarer paths (errors, an upgrade's refusal).
#[derive(Debug)]
pub enum ResponseBody {
    /// Streams from a pooled upstream connection, under the exchange's deadlines.
    Upstream(TimedBody),
    /// Streams from a dedicated (never pooled) connection: a non-101 answer to an upgrade.
    Direct(Box<Incoming>),
    /// A complete body (error responses); `None` once read.
    Full(Option<Box<Bytes>>),
    /// `Upstream`, read for the usage an LLM API reports (`meter`).
    Metered(Box<meter::Metered>),
    /// Any of the above, under the access log.
    Logged(Box<observe::Logged>),
}

impl ResponseBody {
    /// The fields of an upstream's response as their lines, when its map was left
    /// empty for them (`wire::fields`); taken once.
    pub fn take_wire_fields(&mut self) -> Option<WireFields> {
        match self {
            ResponseBody::Upstream(body) => body.take_wire_fields(),
            ResponseBody::Metered(body) => body.take_wire_fields(),
            ResponseBody::Logged(body) => body.take_wire_fields(),
            ResponseBody::Direct(_) | ResponseBody::Full(_) => None,
        }
    }

    /// The pooled body, read for usage or not.
    pub(crate) fn pooled(&self) -> Option<&TimedBody> {
        match self {
            ResponseBody::Upstream(body) => Some(body),
            ResponseBody::Metered(body) => Some(body.inner()),
            _ => None,
        }
    }

    /// What the answer spent, when its body was read for usage (counted now, if not yet).
    pub(crate) fn spent(&mut self) -> Option<meter::Spent> {
        match self {
            ResponseBody::Metered(body) => Some(body.spent()),
            _ => None,
        }
    }
}

/// Puts the fields `resp` carries as lines into its map, for a writer that reads the map (the
/// h2c server) rather than writing the lines as they are.
pub fn map_wire_fields(resp: &mut Response<ResponseBody>) {
    let wire = resp.body_mut().take_wire_fields();
    crate::wire::fields::into_map(wire, resp.headers_mut());
}

impl From<Bytes> for ResponseBody {
    fn from(bytes: Bytes) -> Self {
        ResponseBody::Full(Some(Box::new(bytes)))
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ResponseBody::Upstream(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            ResponseBody::Metered(body) => Pin::new(&mut **body).poll_frame(cx),
            ResponseBody::Direct(body) => Pin::new(&mut **body).poll_frame(cx).map_err(Into::into),
            ResponseBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(*b)))),
            ResponseBody::Logged(body) => Pin::new(&mut **body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream(body) => body.is_end_stream(),
            ResponseBody::Metered(body) => body.is_end_stream(),
            ResponseBody::Direct(body) => body.is_end_stream(),
            ResponseBody::Full(bytes) => bytes.is_none(),
            ResponseBody::Logged(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream(body) => body.size_hint(),
            ResponseBody::Metered(body) => body.size_hint(),
            ResponseBody::Direct(body) => body.size_hint(),
            ResponseBody::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            ResponseBody::Logged(body) => body.size_hint(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
