//! The upstream response body, which gives its connection back to the pool when it ends.
//!
//! An HTTP/1.1 connection is reusable only once the response body has been read to its end;
//! returning it when the head arrives would hand the next request a busy connection. Dropping
//! the body early (the application went away) drops the lease, which closes the connection.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use super::Lease;

/// A response body from a pooled connection.
#[derive(Debug)]
pub struct PooledBody {
    inner: Incoming,
    lease: Option<Lease>,
}

impl PooledBody {
    /// Wraps `inner`; `lease` returns to the pool when the body ends.
    pub fn new(inner: Incoming, lease: Lease) -> Self {
        let mut body = PooledBody {
            inner,
            lease: Some(lease),
        };
        body.release_if_done();
        body
    }

    fn release_if_done(&mut self) {
        if self.inner.is_end_stream() {
            if let Some(lease) = self.lease.take() {
                lease.release();
            }
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some(lease) = this.lease.take() {
                    lease.release();
                }
            }
            Poll::Ready(Some(Ok(_))) => this.release_if_done(),
            Poll::Ready(Some(Err(_))) => this.lease = None,
            Poll::Pending => {}
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
