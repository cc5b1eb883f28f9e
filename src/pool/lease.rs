//! The guards of a request and of a connection: [`Tracker`] (a connection's state and close
//! reason), `Waiting` (a place in the wait queue), [`Slot`] (a place under `max_connections`)
//! and [`Lease`] (a checked-out connection or stream slot).

use std::fmt;
#[cfg(any(test, feature = "test-support"))]
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
#[cfg(any(test, feature = "test-support"))]
use std::task::Poll;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::idle::Conn;
use super::{Grant, H2Stream, Pool, SendError, UpstreamBody};
use crate::connector::{h1, Place};
use crate::endpoint::{Claim, Endpoint};
use crate::error::{ErrorKind, ProxyError};
use crate::wire::{HeadLines, RequestBody};

/// One connection's shared record, held by its [`Slot`], its pool entry and the pool's registry
/// of open connections: whether it is dialing, open, or closing and why, and the requests it
/// served. The close reason is counted when the socket is gone
/// (`egress_upstream_connections_closed_total{reason}`); the first reason recorded wins.
#[derive(Debug, Clone, Default)]
pub struct Tracker(Arc<Track>);

#[derive(Debug, Default)]
struct Track {
    state: AtomicU8,
    http2: AtomicBool,
    requests: AtomicU64,
    /// The endpoint the connection reached, once connected.
    endpoint: OnceLock<Arc<Endpoint>>,
}

impl Tracker {
    const DIALING: u8 = 0;
    const OPEN: u8 = 1;
    /// Index [`Self::OPEN`] doubles as the reason of a connection that ended with none recorded:
    /// the upstream closed it.
    const REASONS: [&'static str; 16] = [
        "dialing",
        "upstream_close",
        "idle_timeout",
        "learned_idle_timeout",
        "max_lifetime",
        "max_requests",
        "max_idle",
        "goaway",
        "aborted",
        "error",
        "reload",
        "shutdown",
        "memory_budget",
        "endpoint_removed",
        "request_timeout",
        "body_idle_timeout",
    ];

    pub(super) fn set(&self, reason: &'static str) {
        if let Some(code) = Self::REASONS.iter().position(|r| *r == reason) {
            let _ =
                self.0
                    .state
                    .compare_exchange(Self::OPEN, code as u8, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    pub(super) fn opened(&self, http2: bool) {
        self.0.http2.store(http2, Ordering::Relaxed);
        self.0.state.store(Self::OPEN, Ordering::Relaxed);
    }

    /// `None` while the dial had not produced a connection.
    pub(super) fn reason(&self) -> Option<&'static str> {
        match self.0.state.load(Ordering::Relaxed) {
            Self::DIALING => None,
            code => Self::REASONS.get(usize::from(code)).copied(),
        }
    }

    /// Whether a reason to close was recorded.
    pub(super) fn is_closing(&self) -> bool {
        self.0.state.load(Ordering::Relaxed) > Self::OPEN
    }

    pub(super) fn is_http2(&self) -> bool {
        self.0.http2.load(Ordering::Relaxed)
    }

    pub(super) fn requests(&self) -> u64 {
        self.0.requests.load(Ordering::Relaxed)
    }

    /// Counts a request sent on the connection. Only its lease's holder counts, one at a
    /// time (a lease changes hands under the pool's lock), so a load and a store do: an
    /// atomic add was a locked instruction per request, about twenty cycles.
    pub(super) fn count_request(&self) {
        let requests = self.0.requests.load(Ordering::Relaxed);
        self.0.requests.store(requests + 1, Ordering::Relaxed);
    }

    /// The endpoint the connection reached, once connected (none for in-memory connectors).
    pub(super) fn endpoint(&self) -> Option<&Arc<Endpoint>> {
        self.0.endpoint.get()
    }

    /// Whether the connection's endpoint left the DNS answer.
    pub(super) fn endpoint_removed(&self) -> bool {
        self.endpoint().is_some_and(|e| e.is_removed())
    }
}

// === impl Waiting ===

/// A request's place in the wait queue; leaving it (timeout, cancellation) removes it.
pub(super) struct Waiting {
    pub(super) pool: Arc<Pool>,
    pub(super) id: u64,
    pub(super) rx: Option<oneshot::Receiver<Result<Grant, ProxyError>>>,
}

impl Waiting {
    pub(super) async fn wait(mut self, deadline: Instant) -> Result<Grant, ProxyError> {
        let rx = self.rx.as_mut().expect("present until drop");
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(result)) => {
                self.rx = None;
                result
            }
            Ok(Err(_)) => Err(self.pool.error(ErrorKind::PendingTimeout, "pool closed")),
            Err(_) => {
                // A connection may have been handed over in the instant the timer fired.
                if let Some(Ok(grant)) = self.leave() {
                    return Ok(grant);
                }
                self.pool.metrics.rejected("pending_timeout");
                let cfg = self.pool.config();
                Err(self.pool.error(
                    ErrorKind::PendingTimeout,
                    format!(
                        "no connection within pending_timeout ({}); {} of max_connections {} open",
                        humantime::format_duration(cfg.pending_timeout),
                        self.pool.open_connections(),
                        cfg.max_connections
                    ),
                ))
            }
        }
    }

    /// Leaves the queue; returns what was handed over before leaving, if anything.
    fn leave(&mut self) -> Option<Result<Grant, ProxyError>> {
        let mut rx = self.rx.take()?;
        let mut st = self.pool.lock();
        if let Some(pos) = st.waiters.iter().position(|w| w.id == self.id) {
            st.waiters.remove(pos);
        }
        drop(st);
        rx.try_recv().ok()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        // Handed over to a request that went away: keep it for the next one.
        match self.leave() {
            Some(Ok(Grant::H1(conn))) => self.pool.check_in(conn, None),
            Some(Ok(Grant::H2(stream))) => self.pool.stream_done(stream.conn_id),
            _ => {}
        }
    }
}

// === impl Slot ===

/// One place under `max_connections`, held by a dial and then by the connection's driver task.
pub struct Slot {
    pub(super) pool: Arc<Pool>,
    pub(super) track: Tracker,
    /// The connection's id within its pool, its key in the registry.
    pub(super) id: u64,
    /// The connection's count in its endpoint's load, given back with the place.
    pub(super) claim: OnceLock<Claim>,
}

impl Place for Slot {
    fn failed(&self) {
        self.track.set("error");
    }

    fn connected(&self, claim: Claim) {
        let _ = self.track.0.endpoint.set(claim.endpoint().clone());
        let _ = self.claim.set(claim);
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot").field("pool", &self.pool.label).finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(reason) = self.track.reason() {
            self.pool.metrics.closed(reason);
        }
        let mut st = self.pool.lock();
        st.open -= 1;
        st.conns.remove(&self.id);
        self.pool.start_dials(&mut st);
    }
}

// === impl Lease ===

/// A checked-out HTTP/1.1 connection or HTTP/2 stream slot. Dropped without
/// [`Lease::release`], an HTTP/1.1 connection is closed (its exchange did not finish cleanly);
/// an HTTP/2 stream slot is simply given back (the stream is reset, the connection lives on).
#[derive(Debug)]
pub struct Lease {
    pool: Arc<Pool>,
    kind: LeaseKind,
    /// When the checkout ended.
    granted: Instant,
    /// When the response head arrived, once it has.
    arrived: Option<Instant>,
}

#[derive(Debug)]
pub(super) enum LeaseKind {
    H1(Option<Box<Conn>>),
    H2(Option<H2Stream>),
}

impl Lease {
    pub(super) fn new(pool: Arc<Pool>, kind: LeaseKind, granted: Instant) -> Self {
        Lease {
            pool,
            kind,
            granted,
            arrived: None,
        }
    }

    /// When the checkout ended: where the exchange's response time starts. A lease granted at
    /// once shares the clock read that started the checkout.
    pub fn granted(&self) -> Instant {
        self.granted
    }

    /// Whether requests on this lease go out as HTTP/2.
    pub fn is_http2(&self) -> bool {
        matches!(self.kind, LeaseKind::H2(_))
    }

    /// Whether the connection served a request before this one.
    pub fn is_reused(&self) -> bool {
        match &self.kind {
            LeaseKind::H1(conn) => conn.as_ref().is_some_and(|c| c.track.requests() > 0),
            LeaseKind::H2(stream) => stream.as_ref().is_some_and(|s| s.reused),
        }
    }

    /// The connection's id within its pool (1 = first opened).
    #[cfg(test)]
    pub fn connection_id(&self) -> u64 {
        match &self.kind {
            LeaseKind::H1(conn) => conn.as_ref().map_or(0, |c| c.id),
            LeaseKind::H2(stream) => stream.as_ref().map_or(0, |s| s.conn_id),
        }
    }

    /// Sends a request and waits for the response head. On HTTP/1.1 the request's own task
    /// writes it and reads the response, taking only the body out of `req`: the rest stays for
    /// a retry. HTTP/2 too, once the connection can open its stream: a request never sent
    /// stays in `req` whole.
    ///
    /// The fields are in `req`'s map or in `lines` ([`HeadLines`]), which HTTP/1.1 writes as
    /// they came and HTTP/2 encodes (names lowercased, values trimmed, `Host` as `:authority`
    /// when the request has none of its own).
    pub async fn send(
        &mut self,
        req: &mut http::Request<RequestBody>,
        lines: &mut HeadLines,
    ) -> Result<http::Response<UpstreamBody>, SendError> {
        match &mut self.kind {
            LeaseKind::H1(conn) => {
                let conn = conn.as_mut().expect("present until release");
                conn.track.count_request();
                if let Some(left) = conn.remaining_hint.as_mut() {
                    *left = left.saturating_sub(1);
                }
                let resp = conn.io.send(req, lines).await.map_err(SendError::Http1)?;
                conn.observe_response();
                Ok(resp.map(|()| UpstreamBody::Http1))
            }
            LeaseKind::H2(stream) => {
                let stream = stream.as_mut().expect("present until release");
                let resp = stream.sender.send(req, lines).await.map_err(SendError::Http2)?;
                Ok(resp.map(|body| UpstreamBody::Http2(Box::new(body))))
            }
        }
    }

    /// Reads a response body from [`Lease::send`] to its end on this lease. The proxy streams
    /// bodies through [`PooledBody`](super::PooledBody) instead; this is for tests and benches
    /// of the pool.
    #[cfg(any(test, feature = "test-support"))]
    pub async fn read_to_end(&mut self, body: UpstreamBody) -> Result<u64, crate::wire::BoxError> {
        use http_body::Body as _;
        let mut body = body;
        let mut read = 0;
        loop {
            let frame = std::future::poll_fn(|cx| match &mut body {
                UpstreamBody::Http2(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
                UpstreamBody::Http1 => match self.h1_mut() {
                    Some(conn) => conn.poll_frame(cx).map_err(Into::into),
                    None => Poll::Ready(None),
                },
            })
            .await;
            match frame {
                None => return Ok(read),
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len() as u64),
                Some(Err(e)) => return Err(e),
            }
        }
    }

    /// The HTTP/1.1 connection, while held.
    pub(super) fn h1(&self) -> Option<&h1::Connection> {
        match &self.kind {
            LeaseKind::H1(Some(conn)) => Some(&conn.io),
            _ => None,
        }
    }

    /// The HTTP/1.1 connection, while held.
    pub(super) fn h1_mut(&mut self) -> Option<&mut h1::Connection> {
        match &mut self.kind {
            LeaseKind::H1(Some(conn)) => Some(&mut conn.io),
            _ => None,
        }
    }

    fn endpoint_ref(&self) -> Option<&Arc<Endpoint>> {
        match &self.kind {
            LeaseKind::H1(conn) => conn.as_ref().and_then(|c| c.track.endpoint()),
            LeaseKind::H2(stream) => stream.as_ref().and_then(|s| s.endpoint.as_ref()),
        }
    }

    /// How this lease serves its request: endpoint, reuse, protocol.
    pub fn served(&self) -> super::ServedBy {
        super::ServedBy {
            endpoint: self.endpoint_ref().map(|e| e.addr()),
            reused: self.is_reused(),
            http2: self.is_http2(),
        }
    }

    /// The endpoint the connection reaches, if known.
    pub fn endpoint(&self) -> Option<Arc<Endpoint>> {
        self.endpoint_ref().cloned()
    }

    /// The response head came back `at` (since the grant: its latency): the endpoint's failure
    /// run ends, and p2c_ewma hears the latency.
    pub fn response_arrived(&mut self, at: Instant) {
        self.arrived = Some(at);
        if let Some(endpoint) = self.endpoint_ref() {
            endpoint.succeeded();
            if self.pool.endpoints.wants_latency() {
                endpoint.observe_latency(at.saturating_duration_since(self.granted));
            }
        }
    }

    /// The connection was reset under a request: one failure of its endpoint.
    pub fn reset(&self) {
        if let Some(endpoint) = self.endpoint_ref() {
            self.pool.endpoints.failed(endpoint);
        }
    }

    /// The upstream said GOAWAY on this HTTP/2 connection: no new streams on it.
    pub fn mark_draining(&self) {
        if let LeaseKind::H2(Some(stream)) = &self.kind {
            self.pool.drain_h2(stream.conn_id);
        }
    }

    /// The upstream's metrics, which its pool counts in.
    pub(super) fn pool_metrics(&self) -> &crate::metrics::UpstreamMetrics {
        &self.pool.metrics
    }

    /// Ends the exchange before its response body did, for `reason` (a deadline): an HTTP/1.1
    /// connection closes, counted under `reason`; an HTTP/2 stream is reset when its body drops.
    pub fn abort(self, reason: &'static str) {
        if let LeaseKind::H1(Some(conn)) = &self.kind {
            conn.track.set(reason);
        }
    }

    /// Gives the connection (or stream slot) back after its exchange completed (response body
    /// fully read).
    pub fn release(self) {
        self.release_at(None);
    }

    /// [`Lease::release`] just as its response head arrived: the exchange ended with the head
    /// (a body that came whole with it, or none), and the connection is idle from that instant
    /// on, which spares the pool a read of the clock.
    pub(super) fn release_with_head(self) {
        let arrived = self.arrived;
        self.release_at(arrived);
    }

    fn release_at(mut self, now: Option<Instant>) {
        match &mut self.kind {
            LeaseKind::H1(conn) => {
                if let Some(conn) = conn.take() {
                    self.pool.check_in(conn, now);
                }
            }
            LeaseKind::H2(stream) => {
                if let Some(stream) = stream.take() {
                    self.pool.stream_done(stream.conn_id);
                }
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        match &self.kind {
            LeaseKind::H2(Some(stream)) => self.pool.stream_done(stream.conn_id),
            // An HTTP/1.1 connection is dropped here, which closes it.
            LeaseKind::H1(Some(conn)) => conn.track.set("aborted"),
            _ => {}
        }
    }
}
