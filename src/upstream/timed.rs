//! The response body under its exchange's deadlines: `request_timeout` (to the last byte) and
//! `body_idle_timeout` (the longest silence). Either cuts the stream: the body ends with an
//! error, which the downstream side turns into a cut response (HTTP/1.1: the connection closes
//! before the body's end; HTTP/2: a reset stream), the upstream connection is closed rather than
//! pooled, and the cut is counted in `egress_upstream_timeouts_total`.
//!
//! The timer is armed only when the body has to wait for bytes: a response whose body came with
//! its head (most small ones) never touches the timer wheel. Silence is measured from the first
//! wait after the last frame, and only while the body is polled: a client that reads slowly
//! stops the polling, and is not taken for a silent upstream.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use tokio::time::{Instant, Sleep};

use crate::pace::Spend;
use crate::pool::{PooledBody, ServedBy};
use crate::wire::{BoxError, WireFields};

/// The upstream's counters of exchanges cut by a deadline. A cut body counts in its pool's
/// (the same series): a handle per response was an atomic count taken and given back, two
/// locked instructions per request, for a cut that almost never comes.
#[derive(Debug)]
pub struct CutCounters {
    /// `egress_upstream_timeouts_total{kind="request"}`.
    pub request: Counter,
    /// `egress_upstream_timeouts_total{kind="body_idle"}`.
    pub body_idle: Counter,
}

/// When a request must have its response head (`request_timeout` or `x-egress-timeout`):
/// taken once, before the request is admitted, and kept through its attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    /// The instant.
    pub at: Instant,
    /// The timeout it came from, in nanoseconds, for the error that names it: 8 bytes where a
    /// `Duration` takes 16, in the state of every request with a deadline (a timeout is at
    /// most `duration::LONGEST`, a year: far within a `u64` of nanoseconds).
    limit_nanos: u64,
}

impl Deadline {
    /// `limit` from now.
    pub fn after(limit: Duration) -> Self {
        Deadline {
            at: Instant::now() + limit,
            limit_nanos: u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// The timeout it came from.
    pub fn limit(&self) -> Duration {
        Duration::from_nanos(self.limit_nanos)
    }
}

/// The deadlines of one response body.
#[derive(Debug, Clone, Copy, Default)]
pub struct Deadlines {
    /// The exchange's end (`request_timeout`).
    pub at: Option<Instant>,
    /// The longest silence (`body_idle_timeout`).
    pub idle: Option<Duration>,
}

/// A pooled response body with its deadlines: a pointer, its state in the pooled body's box
/// ([`PooledBody`]'s `extra`).
#[derive(Debug)]
pub struct TimedBody(PooledBody<Timing>);

/// What a [`TimedBody`] keeps beside the pooled body; set when the response head is in.
#[derive(Debug, Default)]
pub struct Timing {
    deadlines: Deadlines,
    /// Armed at the first wait; moved after every frame.
    sleep: Option<Pin<Box<Sleep>>>,
    /// A frame came since the timer was set.
    moved: bool,
    /// Under a deadline: the body is watched and may be cut.
    timed: bool,
    retries: u32,
    /// What settles the request's tokens in pacing, for the reader of its usage.
    spend: Option<Spend>,
}

impl TimedBody {
    /// `inner` under `deadlines`; the request was sent again `retries` times.
    pub fn new(mut inner: PooledBody<Timing>, deadlines: Deadlines, retries: u32) -> Self {
        let timing = inner.extra_mut();
        timing.deadlines = deadlines;
        timing.timed = deadlines.at.is_some() || deadlines.idle.is_some();
        timing.retries = retries;
        TimedBody(inner)
    }

    /// This body, with what settles its request's tokens in pacing.
    pub fn with_spend(mut self, spend: Option<Spend>) -> Self {
        self.0.extra_mut().spend = spend;
        self
    }

    /// What settles the request's tokens in pacing, taken once.
    pub fn take_spend(&mut self) -> Option<Spend> {
        self.0.extra_mut().spend.take()
    }

    /// How the response was served (endpoint, reuse, protocol).
    pub fn served(&self) -> ServedBy {
        self.0.served()
    }

    /// The response's fields as their lines, left in place.
    pub fn wire_fields(&self) -> Option<&WireFields> {
        self.0.wire_fields()
    }

    /// The response's fields as their lines, when its head's map was left empty for them.
    pub fn take_wire_fields(&mut self) -> Option<WireFields> {
        self.0.take_wire_fields()
    }

    /// Times the request was sent again before this response.
    pub fn retries(&self) -> u32 {
        self.0.extra().retries
    }

    /// Ends the body with the error of the deadline that passed.
    fn cut(&mut self, now: Instant) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let timing = self.0.extra_mut();
        let request = timing.deadlines.at.is_some_and(|at| now >= at);
        let (reason, kind, what) = if request {
            (
                "request_timeout",
                "request",
                "request_timeout passed before the response body ended",
            )
        } else {
            (
                "body_idle_timeout",
                "body_idle",
                "no response body bytes for body_idle_timeout",
            )
        };
        self.0.timed_out(kind);
        // What is left of the body reads as ended.
        self.0.abort(reason);
        tracing::info!(reason, "upstream response cut");
        Poll::Ready(Some(Err(io::Error::new(io::ErrorKind::TimedOut, what).into())))
    }
}

impl Timing {
    /// When the body must have moved again (or ended), from `now`.
    fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let idle = self.deadlines.idle.map(|d| now + d);
        match (self.deadlines.at, idle) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let timing = this.0.extra();
        if !timing.timed {
            // No deadline (most): the timing state is read no further.
            return Pin::new(&mut this.0).poll_frame(cx);
        }
        let polled = Pin::new(&mut this.0).poll_frame(cx);
        let timing = this.0.extra_mut();
        if let Poll::Ready(frame) = polled {
            // A stream that never pauses still ends at request_timeout.
            if let (Some(at), Some(Ok(_))) = (timing.deadlines.at, &frame) {
                let now = Instant::now();
                if now >= at {
                    return this.cut(now);
                }
            }
            timing.moved = true;
            return Poll::Ready(frame);
        }
        let now = Instant::now();
        let Some(until) = timing.next_deadline(now) else {
            return Poll::Pending;
        };
        match &mut timing.sleep {
            None => timing.sleep = Some(Box::pin(tokio::time::sleep_until(until))),
            Some(sleep) if timing.moved => sleep.as_mut().reset(until),
            Some(_) => {}
        }
        timing.moved = false;
        let sleep = timing.sleep.as_mut().expect("armed above");
        match sleep.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => this.cut(Instant::now()),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}
