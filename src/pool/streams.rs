//! HTTP/2 connections in the pool: stream counting against the server's limit, stream slots
//! for waiters, GOAWAY and draining, and the reaper's HTTP/2 pass.

use std::sync::Arc;

use tokio::time::Instant;

use super::{past_lifetime, Grant, Pool, State, Tracker};
use crate::config::PoolConfig;
use crate::connector::http2::Status;
use crate::connector::H2Sender;
use crate::endpoint::Endpoint;

/// An HTTP/2 connection and its stream count.
pub(super) struct H2Conn {
    pub(super) sender: H2Sender,
    pub(super) track: Tracker,
    pub(super) id: u64,
    pub(super) created: Instant,
    pub(super) in_flight: usize,
    pub(super) served: u64,
    /// GOAWAY seen or `max_lifetime` passed: no new streams; closed when the last one ends.
    pub(super) draining: bool,
    /// When `in_flight` last dropped to zero.
    pub(super) idle_since: Instant,
}

/// A stream slot on an HTTP/2 connection, counted in its `in_flight`.
#[derive(Debug)]
pub struct H2Stream {
    pub(super) sender: H2Sender,
    pub(super) conn_id: u64,
    pub(super) reused: bool,
    pub(super) endpoint: Option<Arc<Endpoint>>,
}

impl H2Conn {
    /// Whether the pool keeps this connection: not once it is gone; one the server sent GOAWAY
    /// on drains, kept while its streams finish.
    fn keep(&mut self) -> bool {
        match self.sender.status() {
            Status::Open => true,
            Status::Gone => false,
            Status::GoingAway => {
                if !self.draining {
                    self.track.set("goaway");
                    self.draining = true;
                }
                self.in_flight > 0
            }
        }
    }

    /// Streams this connection may carry now.
    pub(super) fn stream_limit(&self, max_streams: usize) -> usize {
        max_streams.min(self.sender.max_streams())
    }

    /// Whether this connection may take another stream; one past `max_lifetime`, one that has
    /// carried `max_requests_per_connection` streams and one whose endpoint left the DNS answer
    /// start draining here, at a checkout, a grant to a waiter or when its last stream ends, as a
    /// busy connection has no reaper deadline of its own.
    fn takes_streams(&mut self, cfg: &PoolConfig, max_streams: usize, now: Instant) -> bool {
        if past_lifetime(cfg, self.created, now) {
            self.track.set("max_lifetime");
            self.draining = true;
        } else if cfg
            .max_requests_per_connection
            .is_some_and(|max| self.served >= max)
        {
            self.track.set("max_requests");
            self.draining = true;
        } else if self.track.endpoint_removed() {
            self.track.set("endpoint_removed");
            self.draining = true;
        }
        !self.draining && self.in_flight < self.stream_limit(max_streams)
    }

    fn grant_stream(&mut self, cfg: &PoolConfig) -> H2Stream {
        self.in_flight += 1;
        self.served += 1;
        if cfg
            .max_requests_per_connection
            .is_some_and(|max| self.served >= max)
        {
            // This stream is its last: the connection closes when it ends.
            self.track.set("max_requests");
            self.draining = true;
        }
        H2Stream {
            sender: self.sender.clone(),
            conn_id: self.id,
            reused: self.served > 1,
            endpoint: self.track.endpoint().cloned(),
        }
    }

    /// When this connection, carrying no stream, must close.
    fn idle_deadline(&self, cfg: &PoolConfig) -> Instant {
        let by_idle = self.idle_since + cfg.idle_timeout;
        match cfg.max_lifetime {
            Some(life) => by_idle.min(self.created + life),
            None => by_idle,
        }
    }
}

impl Pool {
    /// A stream slot on the first HTTP/2 connection with room. `now`: when the checkout
    /// started (an HTTP/1.1 pool, with no HTTP/2 connection, read the clock here for nothing).
    pub(super) fn take_stream(
        &self,
        st: &mut State,
        avoid: Option<&Arc<Endpoint>>,
        now: Instant,
    ) -> Option<H2Stream> {
        st.h2.retain_mut(H2Conn::keep);
        let (cfg, max_streams) = (st.config, st.max_streams);
        let to_avoid = |c: &H2Conn| match (avoid, c.track.endpoint()) {
            (Some(avoid), Some(e)) => Arc::ptr_eq(avoid, e),
            _ => false,
        };
        // A retry prefers a connection to another endpoint, and takes the failing one's only
        // when there is no other.
        let index = st
            .h2
            .iter_mut()
            .position(|c| !to_avoid(c) && c.takes_streams(&cfg, max_streams, now))
            .or_else(|| {
                st.h2
                    .iter_mut()
                    .position(|c| c.takes_streams(&cfg, max_streams, now))
            })?;
        Some(st.h2[index].grant_stream(&cfg))
    }

    /// Gives free stream slots of `st.h2[index]` to the oldest waiters.
    pub(super) fn serve_stream_waiters(self: &Arc<Self>, st: &mut State, index: usize) {
        // The server may have changed its limit: dials for the queue follow the latest.
        let (cfg, max_streams) = (st.config, st.max_streams);
        st.h2_streams_hint = st.h2[index].stream_limit(max_streams);
        // With nobody queued (a stream ending on a connection with room, the common case)
        // there is nothing to grant and no clock to read: the next checkout checks the
        // connection's lifetime and limits itself.
        let now = (!st.waiters.is_empty()).then(Instant::now);
        while now.is_some_and(|now| st.h2[index].takes_streams(&cfg, max_streams, now)) {
            let Some(waiter) = st.waiters.pop_front() else {
                break;
            };
            let stream = st.h2[index].grant_stream(&cfg);
            if waiter.tx.send(Ok(Grant::H2(stream))).is_err() {
                // The waiter left; its grant was dropped with the channel.
                st.h2[index].in_flight -= 1;
                st.h2[index].served -= 1;
            }
        }
        let conn = &mut st.h2[index];
        if conn.in_flight == 0 {
            let at = now.unwrap_or_else(Instant::now);
            // Marked draining now if its lifetime, requests or endpoint ran out, as before any
            // grant: the reaper then closes it.
            conn.takes_streams(&cfg, max_streams, at);
            conn.idle_since = at;
            let deadline = conn.idle_deadline(&cfg);
            self.schedule_reaper(st, deadline);
        }
    }

    /// A stream on HTTP/2 connection `conn_id` ended (response body done, or dropped).
    pub(super) fn stream_done(self: &Arc<Self>, conn_id: u64) {
        let mut st = self.lock();
        let Some(index) = st.h2.iter().position(|c| c.id == conn_id) else {
            return; // already closed and forgotten
        };
        st.h2[index].in_flight -= 1;
        let spent = |c: &H2Conn| c.draining && c.in_flight == 0;
        if !spent(&st.h2[index]) {
            // Going idle, it is checked against its limits (and may start draining).
            self.serve_stream_waiters(&mut st, index);
        }
        if spent(&st.h2[index]) {
            st.h2.remove(index);
        }
        self.start_dials(&mut st);
    }

    /// GOAWAY seen on HTTP/2 connection `conn_id`: no new streams on it.
    pub(super) fn drain_h2(&self, conn_id: u64) {
        let mut st = self.lock();
        if let Some(index) = st.h2.iter().position(|c| c.id == conn_id) {
            st.h2[index].track.set("goaway");
            st.h2[index].draining = true;
            if st.h2[index].in_flight == 0 {
                st.h2.remove(index);
            }
        }
    }

    /// Closes HTTP/2 connections idle past `idle_timeout` or past `max_lifetime` with no
    /// streams, marks busy ones past `max_lifetime` draining; returns the next deadline.
    pub(super) fn reap_h2(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let cfg = st.config;
        let past_life = |c: &H2Conn| past_lifetime(&cfg, c.created, now);
        st.h2.retain_mut(|c| {
            if !c.keep() {
                return false;
            }
            let idle_expired = c.in_flight == 0 && (c.idle_deadline(&cfg) <= now || c.draining);
            if idle_expired {
                c.track.set(if past_life(c) {
                    "max_lifetime"
                } else {
                    "idle_timeout"
                });
            }
            !idle_expired
        });
        for conn in st.h2.iter_mut().filter(|c| past_life(c)) {
            conn.track.set("max_lifetime");
            conn.draining = true;
        }
        st.h2
            .iter()
            .filter_map(|c| match (c.in_flight, c.draining) {
                (0, _) => Some(c.idle_deadline(&cfg)),
                (_, false) => cfg.max_lifetime.map(|life| c.created + life),
                (_, true) => None, // closes when its last stream ends
            })
            .min()
    }
}
