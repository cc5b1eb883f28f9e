//! The upstream response body, which gives its connection back to the pool when it ends.
//!
//! An HTTP/1.1 connection is reusable only once the response body has been read to its end;
//! returning it when the head arrives would hand the next request a busy connection. Its body
//! is read off the socket by whoever polls this body (the downstream connection's task), which
//! also finishes sending the request body. Dropping the body early (the application went away)
//! drops the lease, which closes the connection.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::Lease;
use crate::connector::{h1, http2};
use crate::wire::{BoxError, WireFields};

/// The body of a response as [`Lease::send`] returns it, before it is tied to its lease.
///
/// Sixteen bytes, so that a response head with it (128) moves in registers, not by a `memcpy`
/// call at each frame on its way up: the HTTP/1.1 exchange's state stays with its connection
/// ([`h1::Connection::transfer`]), and an HTTP/2 stream's body (88 bytes) is boxed.
#[derive(Debug)]
pub enum UpstreamBody {
    /// HTTP/1.1: the rest of the exchange, run on the leased connection (ended once the lease
    /// is gone).
    Http1,
    /// HTTP/2: the stream's response body.
    Http2(Box<http2::Body>),
}

/// Why [`Lease::send`] got no response head.
#[derive(Debug)]
pub enum SendError {
    /// On HTTP/1.1.
    Http1(h1::Error),
    /// On HTTP/2; the request is left in place when it was never sent
    /// ([`http2::Error::Unsent`]).
    Http2(http2::Error),
}

/// A response body from a pooled connection.
///
/// Boxed: a response is moved a dozen times on its way to the downstream writer (out of the
/// retry loop, through the proxy, into the deadline wrapper and the writer), and held inline
/// this body made each move copy about 530 bytes; one small allocation per response costs
/// less (callgrind, `benches/RESULTS.md`).
///
/// `X` is the caller's state for the body (the upstream's deadlines: `upstream::TimedBody`),
/// kept in the same box: beside it, it made every body the proxy writes 80 bytes, and a
/// response head with one (192) a `memcpy` call at each of six moves; in the box, a body is a
/// pointer and its response moves in registers.
#[derive(Debug)]
pub struct PooledBody<X = ()>(Box<Pooled<X>>);

#[derive(Debug)]
struct Pooled<X> {
    inner: UpstreamBody,
    lease: Option<Lease>,
    info: ServedBy,
    /// Taken off the connection before the lease can go back to the pool.
    wire: Option<WireFields>,
    extra: X,
}

/// How a response was served, as the access log shows it: read at the head, since the lease
/// may go back to the pool before anyone asks.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServedBy {
    /// The endpoint's address.
    pub endpoint: Option<std::net::SocketAddr>,
    /// The connection had served before.
    pub reused: bool,
    /// HTTP/2 upstream.
    pub http2: bool,
}

impl<X> PooledBody<X> {
    /// Ties `inner` to `lease`, which returns to the pool when the body ends, with the caller's
    /// `extra`. `served` is the lease's as it was before the request went out (a connection
    /// counts the request it carries, so reuse is read before).
    pub fn new(mut inner: UpstreamBody, mut lease: Lease, info: ServedBy, extra: X) -> Self {
        let wire = match &mut inner {
            UpstreamBody::Http1 => lease.h1_mut().and_then(h1::Connection::take_wire_fields),
            UpstreamBody::Http2(body) => body.take_wire_fields(),
        };
        // A body that came whole with its head (or none) frees the connection at once.
        let lease = if inner.is_end_stream(Some(&lease)) {
            lease.release_with_head();
            None
        } else {
            Some(lease)
        };
        PooledBody(Box::new(Pooled {
            inner,
            lease,
            info,
            wire,
            extra,
        }))
    }

    /// The caller's state for the body.
    pub fn extra(&self) -> &X {
        &self.0.extra
    }

    /// The caller's state for the body.
    pub fn extra_mut(&mut self) -> &mut X {
        &mut self.0.extra
    }

    /// How the response was served.
    pub fn served(&self) -> ServedBy {
        self.0.info
    }

    /// The response's fields as their lines, when its head's map was left empty for them.
    pub fn take_wire_fields(&mut self) -> Option<WireFields> {
        self.0.wire.take()
    }

    /// The response's fields as their lines, left in place.
    pub fn wire_fields(&self) -> Option<&WireFields> {
        self.0.wire.as_ref()
    }

    /// The endpoint the response came from, if known.
    pub fn endpoint(&self) -> Option<std::sync::Arc<crate::endpoint::Endpoint>> {
        self.0.lease.as_ref().and_then(Lease::endpoint)
    }

    /// Counts the exchange as cut by a deadline of `kind` (`egress_upstream_timeouts_total`),
    /// in the upstream's series. A body still streaming has its lease: one that ended is not
    /// cut.
    pub fn timed_out(&self, kind: &'static str) {
        if let Some(lease) = &self.0.lease {
            lease.pool_metrics().timed_out(kind);
        }
    }

    /// Cuts the exchange for `reason` (a deadline): the connection is not pooled again, an
    /// HTTP/2 stream is reset, and the body reads as ended.
    pub fn abort(&mut self, reason: &'static str) {
        let this = &mut *self.0;
        if let Some(lease) = this.lease.take() {
            lease.abort(reason);
        }
        // With no lease, an HTTP/1.1 body has ended.
        this.inner = UpstreamBody::Http1;
    }
}

impl UpstreamBody {
    /// An HTTP/1.1 body ends with its exchange, which its connection keeps, on the lease until
    /// the body ends (then given back to the pool).
    fn is_end_stream(&self, lease: Option<&Lease>) -> bool {
        match self {
            UpstreamBody::Http1 => lease
                .and_then(Lease::h1)
                .is_none_or(|conn| conn.transfer().is_end_stream()),
            UpstreamBody::Http2(body) => body.is_end_stream(),
        }
    }
}

impl<X> Pooled<X> {
    /// The HTTP/1.1 connection, while the lease holds it.
    fn h1(&self) -> Option<&h1::Connection> {
        self.lease.as_ref().and_then(Lease::h1)
    }

    fn release_if_done(&mut self) {
        if self.inner.is_end_stream(self.lease.as_ref()) {
            self.release();
        }
    }

    /// Gives the lease back now that the body ended. A body that came whole in the reads that
    /// brought the head (most small answers) left the connection idle from the head's arrival,
    /// the time the lease holds: the pool need not read the clock again.
    fn release(&mut self) {
        let Some(mut lease) = self.lease.take() else {
            return;
        };
        match (&self.inner, lease.h1_mut()) {
            (UpstreamBody::Http1, Some(conn)) if conn.transfer().ended_with_head() => {
                lease.release_with_head()
            }
            _ => lease.release(),
        }
    }

    fn poll_inner(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.inner {
            UpstreamBody::Http2(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            UpstreamBody::Http1 => {
                let Some(conn) = self.lease.as_mut().and_then(Lease::h1_mut) else {
                    return Poll::Ready(None);
                };
                conn.poll_frame(cx).map_err(Into::into)
            }
        }
    }
}

impl<X> Body for PooledBody<X> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self.0;
        let polled = this.poll_inner(cx);
        match &polled {
            Poll::Ready(None) => this.release(),
            Poll::Ready(Some(Ok(_))) => this.release_if_done(),
            Poll::Ready(Some(Err(_))) => this.lease = None,
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.0.inner.is_end_stream(self.0.lease.as_ref())
    }

    fn size_hint(&self) -> SizeHint {
        let this = &*self.0;
        match &this.inner {
            UpstreamBody::Http1 => this
                .h1()
                .map_or_else(|| SizeHint::with_exact(0), |conn| conn.transfer().size_hint()),
            UpstreamBody::Http2(body) => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    /// A response head with its body state is moved several times on its way from the
    /// connection to the request path. Up to 128 bytes it moves in registers; up to 256, by a
    /// `memcpy` call (about 30 instructions), larger values in a loop (35 more). 312 bytes until
    /// issue 25, 248 until issue 47.
    #[test]
    fn a_response_moves_in_registers() {
        let size = std::mem::size_of::<http::Response<super::UpstreamBody>>();
        assert!(size <= 128, "Response<UpstreamBody> grew to {size} bytes");
    }
}
