//! One downstream connection: read a request head, hand the request to the proxy, stream the
//! request body up and the response down, repeat while keep-alive holds. A CONNECT, or a
//! response that switches protocols, hands the socket over for good (`proxy::connect`,
//! `proxy::upgrade`; then `tunnel`).
//!
//! # Memory while idle
//! Between requests the task waits on socket readiness alone. The per-exchange state (about
//! 2.3 KiB) lives in a box made when a request arrives, which a connection keeps while
//! requests follow within `QUIET_AFTER` (a box per request cost two of malloc's slow paths
//! each time), and the read buffer with it (given back to `spare` after each request, it
//! went to a thread's few kept buffers, and with more connections than those the rest freed
//! and allocated a buffer per request: about 750 instructions each). Quiet for longer, the
//! connection releases both. An idle connection therefore costs its task, its socket
//! registration and a timer, not the ~16 KiB of buffers a general-purpose server keeps; and
//! `PARK_AFTER` after going quiet the task ends and the connection waits in `park`,
//! which costs less still.
//!
//! # Cancel safety
//! Reading the request body (`pump`) runs beside the proxy call and the response writer in
//! `select!` loops; the pump's steps are cancel safe.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use http::{Method, Request, Response, Version};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

use super::inside::{self, Inside};
use super::pump::BodyPump;
use super::respond::{encode_response, into_body, write_body, write_response, Outgoing};
use super::stream::Stream;
use super::wait_timer::{self, WaitTimer};
use super::{Context, Served, PARK_AFTER};
use crate::clients::Source;
use crate::config::{Authority, DownstreamConfig};
use crate::error::{ErrorKind, ProxyError};
use crate::live::Seen;
use crate::proxy::connect::Answer;
use crate::proxy::{upgrade, ResponseBody};
use crate::routing::{Arrival, Inspected};
use crate::tunnel::Tunnel;
use crate::wire::codec::{self, Decoder, HeadError, HeadFacts};
use crate::wire::{HeadLines, RequestBody};

/// First read buffer for a request head; grows up to `max_header_bytes`. (1 KiB, within
/// glibc's per-thread cache, cost more at 64 connections: callgrind, `benches/RESULTS.md`.)
const HEAD_BUF_INITIAL: usize = 2048;
/// After answering a request whose body was not read, keep reading and discarding for this long
/// so the client sees the response rather than a reset.
const LINGER: Duration = Duration::from_secs(2);

/// An application connection and what it carried so far.
pub(super) struct Session<S> {
    pub(super) stream: S,
    buf: BytesMut,
    pub(super) peer: Source,
    pub(super) requests: u64,
    /// From a source the leak detector flagged when it connected.
    pub(super) leaky: bool,
    /// When the current idle period runs out: its idle timeout after the last exchange ended.
    /// One deadline, kept whether the connection waits in its task or parked, so that parking
    /// late (a busy runtime) or waking without a request does not move it.
    pub(super) idle_deadline: Instant,
}

impl<S> Session<S> {
    /// Bytes read and not yet parsed.
    pub(super) fn buffered(&self) -> &[u8] {
        &self.buf
    }
}

impl<S: Stream> Session<S> {
    /// A connection just accepted.
    pub(super) fn new(stream: S, peer: Source, leaky: bool) -> Self {
        // No idle period before the first request: `header_read_timeout` bounds that wait.
        Session::resume(stream, peer, 0, leaky, Instant::now())
    }

    /// A kept-alive connection coming back from `park`, in the idle period that ends at
    /// `idle_deadline`.
    pub(super) fn resume(
        stream: S,
        peer: Source,
        requests: u64,
        leaky: bool,
        idle_deadline: Instant,
    ) -> Self {
        Session {
            stream,
            buf: BytesMut::new(),
            peer,
            requests,
            leaky,
            idle_deadline,
        }
    }
}

/// How [`serve`] ended.
pub(super) enum Ended<S> {
    Closed(Served),
    /// Idle for `PARK_AFTER` between requests: to be parked.
    Idle(Session<S>),
    /// A tunnel established (a CONNECT, or a switch of protocols): to be spliced in a task
    /// of its own.
    Tunnel(S, Box<Tunnel>, Served),
}

/// Serves one connection until it closes, idles out, idles long enough to be parked, or the
/// sidecar drains.
pub(super) async fn serve<S: Stream>(
    mut conn: Session<S>,
    arrival: &mut Arrival,
    ctx: &Arc<Context>,
) -> Ended<S> {
    let mut drain = ctx.drain.clone();
    let mut sleep = std::pin::pin!(wait_timer::sleep(conn.idle_deadline));
    let mut timer = WaitTimer::new(sleep.as_mut());
    loop {
        if conn.buf.is_empty() {
            let max_head = ctx.config.get().max_header_bytes;
            match wait_for_bytes(&mut conn, ctx, &mut drain, &mut timer, None, max_head).await {
                Wake::Readable => {}
                wake => return ended(conn, wake, ctx),
            }
            if conn.requests == 0 {
                let deadline = Instant::now() + ctx.config.get().header_read_timeout;
                if super::h2c::starts_with_preface(&conn.stream, deadline).await {
                    let _ = Box::pin(super::h2c::serve(
                        conn.stream,
                        arrival.clone(),
                        conn.peer,
                        ctx.clone(),
                    ))
                    .await;
                    return Ended::Closed(Served {
                        requests: 0,
                        idle_closed: false,
                    });
                }
            }
        }
        // The exchanges' state (about 2.3 KiB) is boxed once a request is here, and kept while
        // requests follow one another within `QUIET_AFTER`: a box per exchange was past glibc's
        // per-thread cache and took malloc's and free's slow paths (600 instructions per
        // request in callgrind). A connection yet to send a request, or quiet for longer,
        // holds none of it (held until parking, the boxes of a burst of one-request clients
        // raised the heap's high-water mark: 70 bytes more per idle connection afterwards).
        match Box::pin(serve_requests(conn, arrival, ctx, &mut drain, &mut timer)).await {
            Stay::Ended(ended) => return ended,
            Stay::Quiet(quiet) if ctx.draining() => return served(&quiet, false),
            Stay::Quiet(quiet) => conn = quiet,
        }
    }
}

/// How long a connection keeps its exchanges' box while waiting for the next request.
const QUIET_AFTER: Duration = Duration::from_millis(5);

/// How [`serve_requests`] ended.
enum Stay<S> {
    Ended(Ended<S>),
    /// No request for `QUIET_AFTER`: to wait on without the exchanges' box.
    Quiet(Session<S>),
}

/// How a connection ends when a wait for a request did not end `Readable`.
fn ended<S>(conn: Session<S>, wake: Wake, ctx: &Context) -> Ended<S> {
    match wake {
        // A wait that did not watch the drain signal ends here as it would have.
        Wake::Park | Wake::TimedOut if ctx.draining() => served(&conn, false),
        Wake::Park => Ended::Idle(conn),
        Wake::TimedOut if conn.requests > 0 => {
            ctx.count_idle_close(conn.requests);
            served(&conn, true)
        }
        Wake::Readable | Wake::Closed | Wake::Draining | Wake::TimedOut | Wake::Quiet => served(&conn, false),
    }
}

/// Serves requests on `conn`, which has the first bytes of one to read, and waits for each
/// next one.
async fn serve_requests<S: Stream>(
    mut conn: Session<S>,
    arrival: &mut Arrival,
    ctx: &Arc<Context>,
    drain: &mut watch::Receiver<bool>,
    timer: &mut WaitTimer<'_>,
) -> Stay<S> {
    // The live settings through a copy of this task's (see `live`): a lock per read was two
    // atomic read-modify-writes, three times per request.
    let mut settings = Seen::default();
    loop {
        let (max_head, head_timeout) = {
            let cfg = ctx.config.read(&mut settings);
            (cfg.max_header_bytes, cfg.header_read_timeout)
        };
        let mut next = exchange(&mut conn, arrival, ctx, timer, max_head, head_timeout).await;
        if matches!(next, Next::Connect(_) | Next::Switch(_)) {
            // Boxed: a tunnel's state should not weigh on every connection's future.
            next = Box::pin(beyond_http(&mut conn, next, arrival, ctx)).await;
        }
        match next {
            // One unit of the runtime's budget per exchange: the socket reads and writes that
            // find their socket ready skip it (`sock`), and a client pipelining requests the
            // sidecar answers itself would otherwise never give the thread back.
            Next::Again => tokio::task::coop::consume_budget().await,
            Next::Close | Next::Connect(_) | Next::Switch(_) => return Stay::Ended(served(&conn, false)),
            Next::Tunnel(tunnel) => {
                let served = Served {
                    requests: conn.requests,
                    idle_closed: false,
                };
                return Stay::Ended(Ended::Tunnel(conn.stream, tunnel, served));
            }
            Next::Inspect(authority) => {
                let deadline = Instant::now() + ctx.config.get().header_read_timeout;
                match inside::sniff(&conn.stream, conn.buffered().first().copied(), deadline).await {
                    Inside::Http1 => {
                        let inspected = Inspected::new(authority, &ctx.metrics, "connect_http");
                        *arrival = Arrival::Inspected(Arc::new(inspected));
                    }
                    Inside::H2 => {
                        let inspected = Inspected::new(authority, &ctx.metrics, "connect_h2");
                        let requests = conn.requests;
                        let arrival = Arrival::Inspected(Arc::new(inspected));
                        if Box::pin(super::h2c::serve(conn.stream, arrival, conn.peer, ctx.clone())).await {
                            ctx.metrics.families().tunnel_refused("h2_error");
                        }
                        return Stay::Ended(Ended::Closed(Served {
                            requests,
                            idle_closed: false,
                        }));
                    }
                    Inside::Refused(reason) => {
                        inside::refuse(reason, &authority, ctx);
                        return Stay::Ended(served(&conn, false));
                    }
                }
            }
        }
        if ctx.draining() {
            return Stay::Ended(served(&conn, false));
        }
        let now = Instant::now();
        let (idle, max_head) = {
            let cfg = ctx.config.read(&mut settings);
            (idle_limit(conn.leaky, cfg), cfg.max_header_bytes)
        };
        conn.idle_deadline = now + idle;
        if conn.buf.is_empty() {
            let quiet = Some((now, QUIET_AFTER));
            match wait_for_bytes(&mut conn, ctx, drain, timer, quiet, max_head).await {
                Wake::Readable => {}
                wake => {
                    // Waiting on, or closing, it holds no buffer (see `spare`).
                    crate::spare::DOWNSTREAM.give_back(std::mem::take(&mut conn.buf));
                    return match wake {
                        Wake::Quiet => Stay::Quiet(conn),
                        wake => Stay::Ended(ended(conn, wake, ctx)),
                    };
                }
            }
        }
    }
}

/// What follows an exchange that ends HTTP on the connection: a CONNECT checked and served
/// (a tunnel, or an error answer; a tunnel answered here goes on as HTTP inside it), or a
/// splice to an upstream that switched protocols.
///
/// A CONNECT inside a tunnel served as HTTP is refused, whatever it names: requests in the
/// tunnel go to its authority only (as the h2c server inside one refuses CONNECT too).
async fn beyond_http<S: Stream>(conn: &mut Session<S>, next: Next, arrival: &Arrival, ctx: &Context) -> Next {
    if let (Next::Connect(_), Arrival::Inspected(inspected)) = (&next, arrival) {
        let err = ProxyError::new(
            ErrorKind::BadRequest,
            format!(
                "a CONNECT inside the CONNECT tunnel to {0} is not followed: requests in it go to {0} only",
                inspected.authority
            ),
        );
        refuse(conn, err, ctx).await;
        return Next::Close;
    }
    let source = ctx.proxy.logs_access().then(|| conn.peer.clone());
    let Session { stream, buf, .. } = conn;
    match next {
        Next::Connect(connecting) => {
            let (target, framing) = *connecting;
            match crate::proxy::connect::serve(stream, buf, &target, framing, &ctx.proxy, source).await {
                Answer::Refused => {
                    linger(stream).await;
                    Next::Close
                }
                Answer::Closed => Next::Close,
                Answer::Inspect(authority) => Next::Inspect(authority),
                Answer::Established(tunnel) => Next::Tunnel(tunnel),
            }
        }
        Next::Switch(switching) => {
            let Switching { resp, pending, span } = *switching;
            // Behind a vtable, as `Proxy::upgrade` is: one function of its own, not blocks of
            // the connection's future.
            let switched: Pin<Box<dyn Future<Output = Option<Tunnel>> + Send + '_>> =
                Box::pin(upgrade::switch(stream, buf, resp, pending, &ctx.proxy).instrument(span));
            match switched.await {
                Some(tunnel) => Next::Tunnel(Box::new(tunnel)),
                None => Next::Close,
            }
        }
        next => next,
    }
}

/// How a wait for the next request's first bytes ended.
enum Wake {
    Readable,
    Closed,
    /// `header_read_timeout` for a new connection, the idle timeout for a kept-alive one.
    TimedOut,
    /// Idle for `park::PARK_AFTER`, with more of its idle timeout to go.
    Park,
    /// No request within the quiet time asked for: the wait goes on elsewhere.
    Quiet,
    Draining,
}

/// Waits for the next request without holding a buffer, until it is time to park.
///
/// A kept-alive connection counts as woken only once bytes (or the end) are read: the
/// runtime's readiness can be stale (an edge for bytes the last read already took, delivered
/// after that read cleared it), and a connection taking that for a request waited for a head
/// under `header_read_timeout` instead of its idle timeout, and never parked.
///
/// With `quiet: (now, after)`, a wait with no request by `now + after` (or up to
/// `wait_timer::SLACK` later) ends `Quiet` (the caller's `now` saves a clock read).
///
/// All of a task's waits run on its one `timer` (see `wait_timer`).
async fn wait_for_bytes<S: Stream>(
    conn: &mut Session<S>,
    ctx: &Context,
    drain: &mut watch::Receiver<bool>,
    timer: &mut WaitTimer<'_>,
    quiet: Option<(Instant, Duration)>,
    max_head: usize,
) -> Wake {
    if conn.requests == 0 {
        // A new connection gets its first request served even while draining (apps finishing
        // their work need egress).
        let until = Instant::now() + ctx.config.get().header_read_timeout;
        return match timer.before(until, false, conn.stream.readable()).await {
            Some(readable) => wake(readable),
            None => Wake::TimedOut,
        };
    }
    let now = quiet.map_or_else(Instant::now, |(now, _)| now);
    let park_at = now + PARK_AFTER;
    let parks = ctx.parking.available() && conn.idle_deadline > park_at;
    let until = if parks { park_at } else { conn.idle_deadline };
    let quiet_at = quiet.map(|(_, after)| now + after).filter(|at| *at < until);
    let ends = quiet_at.unwrap_or(until);
    if ends > park_at {
        // Draining closes idle keep-alive connections.
        return tokio::select! {
            read = timer.before(ends, false, first_bytes(conn, max_head, false)) => match read {
                Some(read) => wake(read),
                None => Wake::TimedOut,
            },
            _ = drain.wait_for(|d| *d) => Wake::Draining,
        };
    }
    // Over within PARK_AFTER: it does not wait on the drain signal, whose registration cost
    // 630 instructions per request; whoever goes on from here sees the drain (`ended`, and
    // `serve` after a quiet one).
    // A quiet wait keeps its read buffer, as it keeps the exchanges' box.
    let hold = quiet_at.is_some();
    // A quiet wait may end a little late (`wait_timer::SLACK`): its timer then moves once in
    // a while, not at every request of a busy connection.
    match timer.before(ends, hold, first_bytes(conn, max_head, hold)).await {
        Some(read) => wake(read),
        None if hold => Wake::Quiet,
        None if parks => Wake::Park,
        None => Wake::TimedOut,
    }
}

/// Waits until the next request's first bytes are in `conn.buf` (or the stream ended), with
/// the read `read_head` would make: a stale readiness costs no extra call, the read finds
/// nothing and the wait goes on; the buffer goes back while it does, unless `hold`.
///
/// A poll of the stream's read, not `readable` then `try_read_buf`: a read through the poll
/// interface that comes back short tells the runtime the socket is drained, and `try_read_buf`
/// does not. The readiness it left set sent the next read on the connection (the close watch
/// while the response is awaited) to the kernel for nothing: a failed `recvfrom` per request
/// (strace).
async fn first_bytes<S: Stream>(conn: &mut Session<S>, max_head: usize, hold: bool) -> io::Result<()> {
    std::future::poll_fn(|cx| {
        reserve_head_buf(&mut conn.buf, max_head);
        let polled = conn.stream.poll_read_buf(cx, &mut conn.buf);
        if polled.is_pending() && !hold {
            // Waiting for the next request holds no buffer (see `spare`).
            crate::spare::DOWNSTREAM.give_back(std::mem::take(&mut conn.buf));
        }
        polled.map_ok(drop)
    })
    .await
}

/// The idle timeout for a kept-alive connection.
fn idle_limit(leaky: bool, cfg: &DownstreamConfig) -> Duration {
    if leaky {
        cfg.leaky_idle_timeout.min(cfg.idle_timeout)
    } else {
        cfg.idle_timeout
    }
}

fn wake(read: io::Result<()>) -> Wake {
    match read {
        Ok(()) => Wake::Readable,
        Err(_) => Wake::Closed,
    }
}

fn served<S>(conn: &Session<S>, idle_closed: bool) -> Ended<S> {
    Ended::Closed(Served {
        requests: conn.requests,
        idle_closed,
    })
}

/// Reads a request head of at most `max` bytes into `req`, within `timeout` once a read must
/// wait. `None`: the connection closed, timed out or failed, or sent a head refused here
/// (answered with its error); either way it is to be closed.
///
/// Into the caller's request, neither boxed nor returned: at 64 connections a box per head
/// (232 bytes) outran glibc's per-thread cache, a malloc and a free through their slow paths
/// on every request (~400 instructions, callgrind), and a head returned by value was copied
/// whole at each level on its way up (see `codec::parse_head_into`).
async fn read_head<S: Stream>(
    conn: &mut Session<S>,
    req: &mut Request<RequestBody>,
    lines: &mut HeadLines,
    max: usize,
    timeout: Duration,
    ctx: &Context,
) -> Option<HeadFacts> {
    let err = match read_head_or_refusal(conn, req, lines, max, timeout).await {
        Ok(head) => return head,
        Err(err) => {
            crate::rare::branch();
            err
        }
    };
    // Boxed: rare, and its writer should not weigh on every request's future.
    Box::pin(refuse(conn, err, ctx)).await;
    None
}

/// [`read_head`]'s reading: the head, `None` for a connection to close without an answer, or
/// the error to answer with.
async fn read_head_or_refusal<S: Stream>(
    conn: &mut Session<S>,
    req: &mut Request<RequestBody>,
    lines: &mut HeadLines,
    max: usize,
    timeout: Duration,
) -> Result<Option<HeadFacts>, ProxyError> {
    // Read from the clock only for a head that did not come in whole with its first bytes.
    let mut deadline = None;
    loop {
        if !conn.buf.is_empty() {
            match codec::parse_head_keeping_lines(&mut conn.buf, max, req, lines) {
                Ok(Some(facts)) => {
                    if facts.body == codec::BodyFraming::Chunked && !conn.buf.is_empty() {
                        if let Err(why) = codec::check_buffered_chunks(&conn.buf, max) {
                            return Err(ProxyError::new(ErrorKind::BadRequest, why.0));
                        }
                    }
                    return Ok(Some(facts));
                }
                Ok(None) => {}
                Err(HeadError::TooLarge(what)) => {
                    return Err(ProxyError::new(
                        ErrorKind::HeaderTooLarge,
                        format!("request head larger than {what}"),
                    ))
                }
                Err(HeadError::Invalid(why)) => return Err(ProxyError::new(ErrorKind::BadRequest, why)),
            }
        }
        reserve_head_buf(&mut conn.buf, max);
        let at = *deadline.get_or_insert_with(|| Instant::now() + timeout);
        let read = std::future::poll_fn(|cx| conn.stream.poll_read_buf(cx, &mut conn.buf));
        match tokio::time::timeout_at(at, read).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(None),
            Ok(Ok(_)) => {}
            Err(_) => {
                if !conn.buf.is_empty() {
                    tracing::debug!("request head not complete within header_read_timeout");
                }
                return Ok(None);
            }
        }
    }
}

/// Makes room in `buf` for a read of a request head: the thread's spare buffer if it holds none.
/// Inlined, with the spare buffer's take out of line: a connection in use holds its buffer.
#[inline(always)]
fn reserve_head_buf(buf: &mut BytesMut, max: usize) {
    if buf.capacity() == 0 {
        take_spare_head_buf(buf);
    }
    let want = if buf.capacity() == 0 {
        HEAD_BUF_INITIAL
    } else {
        buf.capacity().min(max)
    };
    buf.reserve(want.max(1024));
}

#[inline(never)]
fn take_spare_head_buf(buf: &mut BytesMut) {
    *buf = crate::spare::DOWNSTREAM.take();
}

/// What a connection does after an exchange.
enum Next {
    /// Serve the next request.
    Again,
    Close,
    /// A CONNECT answered here: read what the client sends inside (`tunnel`).
    Inspect(Authority),
    /// A CONNECT to this target, with this framing: to be checked and served. Boxed, as the
    /// switch below, so that what the connection's future holds between requests stays small.
    Connect(Box<(http::Uri, codec::BodyFraming)>),
    /// The upstream switched protocols: to be spliced.
    Switch(Box<Switching>),
    /// A tunnel established (a CONNECT, or a switch of protocols): to be spliced.
    Tunnel(Box<Tunnel>),
}

/// A response switching protocols (101), and what the splice after it needs.
struct Switching {
    resp: Response<ResponseBody>,
    pending: upgrade::Switch,
    span: tracing::Span,
}

/// One request and its response; returns what the connection does next.
///
/// The request and the response head live in a block of their own: a local's room in a future
/// lasts to the end of its scope even once moved out, so at function scope they would be
/// carried, unused, while the body is written. Each is made where it is worked on, and lent
/// down: moved by value (176 to 256 bytes) it was a `memcpy` call at every level.
async fn exchange<S: Stream>(
    conn: &mut Session<S>,
    arrival: &Arrival,
    ctx: &Context,
    timer: &WaitTimer<'_>,
    max_head: usize,
    head_timeout: Duration,
) -> Next {
    let span;
    let (version, keep_alive, head_only);
    // Set for a request with a body; a bodyless one's is all `None`s, cheaper to write than
    // to move.
    let mut pump = BodyPump::finished();
    let (outgoing, mut body) = {
        let mut req = Request::new(RequestBody::Empty);
        let mut lines = HeadLines::default();
        {
            let Some(facts) = read_head(conn, &mut req, &mut lines, max_head, head_timeout, ctx).await else {
                return Next::Close;
            };
            conn.requests += 1;
            if req.method() == Method::CONNECT {
                crate::rare::branch();
                // A tunnel ends HTTP on this connection whatever happens; it is served once
                // this exchange's (large) future is gone.
                let uri = std::mem::take(req.uri_mut());
                return Next::Connect(Box::new((uri, facts.body)));
            }
            (version, keep_alive) = (req.version(), facts.keep_alive);
            head_only = req.method() == Method::HEAD;
            request_body(&mut req, &mut pump, facts);
            // What of the body came with the head is in the channel before the request is
            // first polled, so that an HTTP/1.1 upstream gets it in the head's write.
            if pump.is_active() {
                pump.take_in_buffered(&mut conn.buf, max_head);
            }
        }
        // Pinned here and lent, in a block of its own: moved into `await_response` it would be
        // stored twice in this future's state.
        let mut resp = None;
        {
            let mut handling = std::pin::pin!(ctx.proxy.handle(&mut req, &mut lines, arrival, &conn.peer));
            let respond = std::pin::pin!(std::future::poll_fn(|cx| {
                handling.as_mut().poll(cx).map(|answer| resp = Some(answer))
            }));
            await_response(
                &mut conn.stream,
                &mut conn.buf,
                &mut pump,
                timer,
                respond,
                max_head,
            )
            .await;
            // A switch of protocols goes on in the request's span.
            span = handling.as_mut().take_span();
        }
        // The request has gone up (an HTTP/1.1 upstream leaves its head here). Taken apart,
        // not `mem::take`n: that would leave an empty map to drop.
        let (parts, body) = req.into_parts();
        drop(body);
        crate::spare::give_back_headers(parts.headers);
        let Some(mut response) = resp else {
            return Next::Close;
        };
        if let Some(pending) = upgrade::Switch::take(&mut response) {
            crate::rare::branch();
            // Spliced once this exchange's (large) future is gone.
            return Next::Switch(Box::new(Switching {
                resp: response,
                pending,
                span,
            }));
        }
        // A body not all in by now belongs to an early response: its rest would have to be
        // read and dropped before another request could be, so the connection closes after
        // this response, and its head says so (a keep-alive answer followed by a close would
        // cost the client the next request it sends). What came with the head is taken in
        // first: it is read, whether or not the pump got to it before the response was ready.
        let unread = pump.abandon_unstarted() || !pump.take_in_buffered(&mut conn.buf, max_head);
        let keep_alive = keep_alive && !unread && !ctx.draining();
        let wire = response.body_mut().take_wire_fields();
        let outgoing = encode_response(&mut response, wire, head_only, version, keep_alive);
        (outgoing, into_body(response))
    };
    let Session { stream, buf, .. } = conn;
    let written = send_response(stream, buf, &mut pump, &mut body, outgoing, max_head).await;
    match written {
        Ok(true) if pump.is_complete() => Next::Again,
        Ok(_) => {
            if !pump.is_complete() {
                linger(stream).await;
            }
            Next::Close
        }
        Err(e) => {
            crate::rare::branch();
            tracing::debug!(error = %e, "response not fully written");
            Next::Close
        }
    }
}

/// Answers a request refused before it could be forwarded (a malformed or oversized head),
/// then closes.
async fn refuse<S: Stream>(conn: &mut Session<S>, err: ProxyError, ctx: &Context) {
    tracing::info!(client = %conn.peer, error = %err, "refused request");
    if ctx.proxy.logs_access() {
        ctx.proxy.log_refused(Some(conn.peer.clone()), &err);
    }
    let resp = err.to_response::<ResponseBody>();
    {
        let (_, mut wr) = conn.stream.split();
        let _ = write_response(&mut wr, resp, false, Version::HTTP_11, false).await;
    }
    linger(&mut conn.stream).await;
}

/// Gives `req`, as its head was parsed, its body, and `pump` what feeds the body from the
/// socket. Inlined for the request without a body (most), which needs nothing.
#[inline]
fn request_body(req: &mut Request<RequestBody>, pump: &mut BodyPump, facts: HeadFacts) {
    if !matches!(facts.body, codec::BodyFraming::Empty) {
        body_channel(req, pump, facts);
    }
}

/// [`request_body`] for a request with a body, of a length or chunked.
#[inline(never)]
fn body_channel(req: &mut Request<RequestBody>, pump: &mut BodyPump, facts: HeadFacts) {
    let length = match facts.body {
        codec::BodyFraming::Length(n) => Some(n),
        _ => None,
    };
    let (body, sender) = RequestBody::channel(length);
    *req.body_mut() = body;
    *pump = BodyPump::new(Decoder::new(facts.body), sender, facts.expect_continue);
}

/// Until `respond` has put the response head where the caller wants it, feeds the request body
/// (answering `Expect: 100-continue` once the upstream asks for it); once the body is in,
/// watches for the client going away, which abandons the upstream exchange (as nginx does)
/// instead of letting a long upstream call run for nobody; then returns without it.
///
/// A request without a body that came in a quiet wait is watched only once that wait's
/// timer, still standing, goes off (`WaitTimer::hold`): a few milliseconds on, so an exchange
/// that takes longer is watched as any other, and the quick ones of a busy connection skip
/// the watch's read and registration.
///
/// This and [`send_response`] are separate functions so that their states, which are never
/// alive together, share memory in the caller's future.
async fn await_response<S: Stream>(
    stream: &mut S,
    buf: &mut BytesMut,
    pump: &mut BodyPump,
    timer: &WaitTimer<'_>,
    mut respond: Pin<&mut impl Future<Output = ()>>,
    max_head: usize,
) {
    let (mut rd, mut wr) = stream.split();
    let held = if pump.is_active() { None } else { timer.hold() };
    loop {
        tokio::select! {
            // In order: an unbiased select draws a random starting branch at each poll (a
            // thread-local generator), twice or more per request, for no fairness either
            // branch needs (each ends the loop or only watches).
            biased;
            () = &mut respond => return,
            step = pump.step_or_watch(&mut rd, buf, &mut wr, max_head, max_head, held.as_ref()) => match step {
                Ok(()) => {}
                Err(_) if !pump.is_active() => {
                    tracing::debug!("client went away before the response");
                    return;
                }
                Err(e) => pump.fail(e),
            }
        }
    }
}

/// Writes the response while the rest of the request body (if any) still flows; returns
/// whether the response allows keeping the connection.
async fn send_response<S: Stream>(
    stream: &mut S,
    buf: &mut BytesMut,
    pump: &mut BodyPump,
    body: &mut ResponseBody,
    outgoing: Outgoing,
    max_trailer: usize,
) -> io::Result<bool> {
    let (mut rd, mut wr) = stream.split();
    let write = write_body(&mut wr, body, outgoing);
    tokio::pin!(write);
    loop {
        tokio::select! {
            // In order, as in `await_response`.
            biased;
            written = &mut write => return written,
            step = pump.step(&mut rd, buf, None::<&mut S::Write<'_>>, max_trailer), if pump.is_active() => {
                if let Err(e) = step {
                    pump.fail(e);
                }
            }
        }
    }
}

/// Closes our side and discards what the client still sends, briefly, so that it reads the
/// response instead of a connection reset.
async fn linger<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S) {
    let _ = stream.shutdown().await;
    let mut sink = vec![0u8; 4096];
    let deadline = Instant::now() + LINGER;
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, stream.read(&mut sink)).await {
        if n == 0 {
            break;
        }
    }
}

#[cfg(test)]
mod tests;
