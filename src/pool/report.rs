//! What a pool shows of itself: the counts of a [`PoolSnapshot`] and the per-connection
//! [`PoolReport`] of `/debug/pools`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{Negotiated, Pool, State, Tracked};
use crate::endpoint::{DnsReport, EndpointReport};

/// A snapshot of a pool's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSnapshot {
    /// Connections dialing, in use or idle.
    pub open: usize,
    /// Idle HTTP/1.1 connections.
    pub idle: usize,
    /// HTTP/2 connections carrying no stream.
    pub idle_http2: usize,
    /// HTTP/2 connections (busy or not).
    pub http2: usize,
    /// Streams in flight on HTTP/2 connections.
    pub streams: usize,
    /// Dials in flight.
    pub connecting: usize,
    /// Requests waiting.
    pub pending: usize,
    /// Connections opened since start.
    pub opened_total: u64,
    /// Requests that reused a connection.
    pub reused_total: u64,
    /// The upstream's idle timeout as learned from its closes, while one is in force and the
    /// pool is not retired.
    pub learned_idle_timeout: Option<Duration>,
}

/// One pool as `/debug/pools` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PoolReport {
    /// The upstream's label.
    pub upstream: String,
    /// What the upstream speaks, once known.
    pub protocol: Option<&'static str>,
    /// Why the pool keeps no connections (`reload`: its upstream left the config or changed
    /// identity; `shutdown`), if it does not.
    pub retired: Option<&'static str>,
    /// Settings in force.
    pub max_connections: usize,
    /// Settings in force.
    pub max_idle: usize,
    /// Settings in force.
    pub max_streams_per_connection: usize,
    /// Connections counted against `max_connections` (the length of `connections`).
    pub open: usize,
    /// Requests waiting for a connection.
    pub pending: usize,
    /// Connections opened since start.
    pub opened_total: u64,
    /// Requests that reused a connection.
    pub reused_total: u64,
    /// The upstream's own idle timeout (HTTP/1.1) as learned from its closes of idle
    /// connections, while one is in force (see [`learn`](super::learn)).
    pub learned_idle_timeout_ms: Option<u64>,
    /// The idle age at which connections are retired because of it: the learned timeout less
    /// a margin, when that is below `idle_timeout`.
    pub learned_retire_after_ms: Option<u64>,
    /// Upstream closes of idle connections counted towards learning since the pool started.
    pub idle_close_observations: u64,
    /// Each open connection, oldest first.
    pub connections: Vec<ConnectionReport>,
    /// The upstream's endpoints, with their load and health.
    pub endpoints: Vec<EndpointReport>,
    /// The DNS answer's state, for an upstream resolved by name.
    pub dns: Option<DnsReport>,
    /// The parent proxy the pool's connections go through (its URL, no credentials), if any.
    pub via: Option<String>,
}

/// One upstream connection as `/debug/pools` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConnectionReport {
    /// Id within the pool (1 = first dialed).
    pub id: u64,
    /// `http1` or `http2`; none while dialing.
    pub protocol: Option<&'static str>,
    /// `connecting`, `active`, `idle`, `draining` (HTTP/2: no new streams) or `closing`.
    pub state: &'static str,
    /// Seconds since the connection was established (or the dial started).
    pub age_seconds: f64,
    /// Seconds since it last carried a request, when it carries none now.
    pub idle_seconds: Option<f64>,
    /// Requests (HTTP/2: streams) it has carried.
    pub requests: u64,
    /// HTTP/2: streams open now.
    pub streams_in_use: Option<usize>,
    /// HTTP/2: min(`max_streams_per_connection`, the server's SETTINGS_MAX_CONCURRENT_STREAMS).
    pub stream_limit: Option<usize>,
    /// Why it is closing, once that is decided.
    pub closing_reason: Option<&'static str>,
    /// The endpoint it reached, once connected.
    pub endpoint: Option<String>,
}

impl Pool {
    /// Current counts.
    pub fn snapshot(&self) -> PoolSnapshot {
        let st = self.lock();
        PoolSnapshot {
            open: st.open,
            idle: st.idle.len(),
            idle_http2: st.h2.iter().filter(|c| c.in_flight == 0).count(),
            http2: st.h2.len(),
            streams: st.h2.iter().map(|c| c.in_flight).sum(),
            connecting: st.connecting,
            pending: st.waiters.len(),
            opened_total: self.stats.opened.load(Ordering::Relaxed),
            reused_total: self.stats.reused.load(Ordering::Relaxed),
            // A pool a reload retired may have learned another backend's timeout.
            learned_idle_timeout: st
                .retired
                .is_none()
                .then(|| st.learner.learned(Instant::now()))
                .flatten(),
        }
    }

    /// Every connection counted in `open`, for `/debug/pools`.
    pub fn report(&self) -> PoolReport {
        let now = Instant::now();
        let st = self.lock();
        let connections = st
            .conns
            .iter()
            .map(|(&id, tracked)| connection_report(&st, id, tracked, now))
            .collect();
        let endpoints = self.endpoints.report(|addr| idle_to(&st, addr));
        PoolReport {
            upstream: self.label.to_string(),
            protocol: match st.protocol {
                Negotiated::Unknown => None,
                Negotiated::Http1 => Some("http1"),
                Negotiated::Http2 => Some("http2"),
            },
            retired: st.retired,
            max_connections: st.config.max_connections,
            max_idle: st.config.max_idle,
            max_streams_per_connection: st.max_streams,
            open: st.open,
            pending: st.waiters.len(),
            opened_total: self.stats.opened.load(Ordering::Relaxed),
            reused_total: self.stats.reused.load(Ordering::Relaxed),
            learned_idle_timeout_ms: st.learner.learned(now).map(|d| d.as_millis() as u64),
            learned_retire_after_ms: st
                .learner
                .retire_after(now)
                .filter(|d| *d < st.config.idle_timeout)
                .map(|d| d.as_millis() as u64),
            idle_close_observations: st.learner.observations(),
            connections,
            endpoints: endpoints.endpoints,
            dns: endpoints.dns,
            via: endpoints.via,
        }
    }
}

/// Connection `id` as `/debug/pools` shows it: dialing, or what its protocol's list (HTTP/2
/// connections, idle HTTP/1.1 ones) says of it, and whether it is closing.
fn connection_report(st: &State, id: u64, tracked: &Tracked, now: Instant) -> ConnectionReport {
    let secs = |since: Instant| now.saturating_duration_since(since).as_millis() as f64 / 1000.0;
    let mut conn = ConnectionReport {
        id,
        protocol: None,
        state: "connecting",
        age_seconds: secs(tracked.since),
        idle_seconds: None,
        requests: tracked.track.requests(),
        streams_in_use: None,
        stream_limit: None,
        closing_reason: None,
        endpoint: tracked.track.endpoint().map(|e| e.addr().to_string()),
    };
    if tracked.track.reason().is_none() {
        return conn;
    }
    conn.protocol = Some(if tracked.track.is_http2() {
        "http2"
    } else {
        "http1"
    });
    if let Some(h2) = st.h2.iter().find(|c| c.id == id) {
        conn.requests = h2.served;
        conn.streams_in_use = Some(h2.in_flight);
        conn.stream_limit = Some(h2.stream_limit(st.max_streams));
        conn.state = match (h2.in_flight, h2.draining) {
            (_, true) => "draining",
            (0, false) => "idle",
            _ => "active",
        };
        if h2.in_flight == 0 {
            conn.idle_seconds = Some(secs(h2.idle_since));
        }
    } else if let Some(idle) = st.idle.iter().find(|c| c.conn.id == id) {
        conn.state = "idle";
        conn.idle_seconds = Some(secs(idle.since));
    } else {
        conn.state = "active";
    }
    if tracked.track.is_closing() && conn.state != "draining" {
        conn.state = "closing";
    }
    if tracked.track.is_closing() {
        conn.closing_reason = tracked.track.reason();
    }
    conn
}

/// Idle connections to the endpoint at `addr`: HTTP/1.1 ones in the idle list, and HTTP/2
/// ones carrying no stream.
fn idle_to(st: &State, addr: SocketAddr) -> usize {
    let h1 = st
        .idle
        .iter()
        .filter(|i| i.conn.track.endpoint().is_some_and(|e| e.addr() == addr));
    let h2 = st
        .h2
        .iter()
        .filter(|c| c.in_flight == 0 && c.track.endpoint().is_some_and(|e| e.addr() == addr));
    h1.count() + h2.count()
}
