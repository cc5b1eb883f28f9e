//! Per-source accounting of application connections, and the leak detector.
//!
//! Every downstream source (peer IP) gets a sliding window of connections opened, connections
//! closed, the requests those carried and how many were closed idle. A source that opens many
//! connections with about one request each (default: at least 100 connections in 60 s at under
//! 1.5 requests per connection) is almost always building a new HTTP client or transport per
//! request: the leak the seed articles describe. The detector logs one warning per window naming
//! the source, the numbers, the likely cause and what the sidecar is doing about it, and
//! `/debug/clients` shows the same per source.
//!
//! The hot path touches the table twice per connection (open and close), never per request:
//! a connection reports its request count when it closes.
//!
//! Not handled here: counting requests (the connection task does), serving `/debug/clients`
//! (`admin`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

/// The window the detector looks at.
pub const LEAK_WINDOW: Duration = Duration::from_secs(60);
/// Connections in the window before a source can be flagged.
pub const LEAK_MIN_CONNECTIONS: u64 = 100;
/// Requests per connection under which a busy source is flagged.
pub const LEAK_MAX_REQUESTS_PER_CONNECTION: f64 = 1.5;
/// Sources tracked at most; the least recently active is forgotten beyond this.
const MAX_SOURCES: usize = 4096;
/// The window is kept as this many buckets.
const BUCKETS: usize = 6;

#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    /// Which window slice this bucket holds (time since start / slice length).
    slice: u64,
    opened: u64,
    closed: u64,
    requests: u64,
    idle_closed: u64,
}

#[derive(Debug)]
struct Source {
    buckets: [Bucket; BUCKETS],
    totals: Bucket,
    last_seen: Instant,
    last_warned: Option<Instant>,
}

/// What `/debug/clients` shows for one source.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClientReport {
    /// Peer IP.
    pub source: String,
    /// Connections opened since the sidecar started.
    pub connections_opened: u64,
    /// Requests carried by connections that have closed.
    pub requests: u64,
    /// Requests per closed connection.
    pub requests_per_connection: f64,
    /// Keep-alive connections closed by `downstream.idle_timeout`.
    pub idle_closes: u64,
    /// Connections opened in the last window.
    pub window_connections_opened: u64,
    /// Requests per connection closed in the last window.
    pub window_requests_per_connection: f64,
    /// Whether the leak detector flags this source now.
    pub leaking: bool,
}

/// What the detector found, for the warning.
#[derive(Debug, Clone, PartialEq)]
pub struct Leak {
    /// Peer IP.
    pub source: IpAddr,
    /// Connections opened in the window.
    pub connections: u64,
    /// Requests per closed connection in the window.
    pub requests_per_connection: f64,
}

/// The per-source table.
#[derive(Debug)]
pub struct Clients {
    start: Instant,
    sources: Mutex<HashMap<IpAddr, Source>>,
}

impl Default for Clients {
    fn default() -> Self {
        Self::new()
    }
}

impl Clients {
    /// An empty table.
    pub fn new() -> Self {
        Clients {
            start: Instant::now(),
            sources: Mutex::new(HashMap::new()),
        }
    }

    fn slice(&self, now: Instant) -> u64 {
        let slice_len = LEAK_WINDOW.as_millis() as u64 / BUCKETS as u64;
        now.saturating_duration_since(self.start).as_millis() as u64 / slice_len
    }

    /// Runs `f` on `ip`'s entry and the index of the current bucket (reset if it is stale).
    fn with_source<R>(&self, ip: IpAddr, now: Instant, f: impl FnOnce(&mut Source, usize) -> R) -> R {
        let slice = self.slice(now);
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        if sources.len() >= MAX_SOURCES && !sources.contains_key(&ip) {
            if let Some(oldest) = sources.iter().min_by_key(|(_, s)| s.last_seen).map(|(ip, _)| *ip) {
                sources.remove(&oldest);
            }
        }
        let source = sources.entry(ip).or_insert_with(|| Source {
            buckets: [Bucket::default(); BUCKETS],
            totals: Bucket::default(),
            last_seen: now,
            last_warned: None,
        });
        source.last_seen = now;
        let index = (slice % BUCKETS as u64) as usize;
        if source.buckets[index].slice != slice {
            source.buckets[index] = Bucket {
                slice,
                ..Bucket::default()
            };
        }
        f(source, index)
    }

    /// A connection from `ip` was accepted; returns whether the detector flags `ip` now (its
    /// connections then get `downstream.leaky_idle_timeout`).
    pub fn opened(&self, ip: IpAddr) -> bool {
        let now = Instant::now();
        let current = self.slice(now);
        self.with_source(ip, now, |source, i| {
            source.buckets[i].opened += 1;
            source.totals.opened += 1;
            is_leaking(&window_sum(source, current))
        })
    }

    /// A connection from `ip` closed after `requests` requests; returns a leak to warn about,
    /// at most once per window per source.
    pub fn closed(&self, ip: IpAddr, requests: u64, idle_closed: bool) -> Option<Leak> {
        let now = Instant::now();
        let current = self.slice(now);
        self.with_source(ip, now, |source, i| {
            for b in [&mut source.buckets[i], &mut source.totals] {
                b.closed += 1;
                b.requests += requests;
                b.idle_closed += u64::from(idle_closed);
            }
            let window = window_sum(source, current);
            if !is_leaking(&window)
                || source
                    .last_warned
                    .is_some_and(|t| now.duration_since(t) < LEAK_WINDOW)
            {
                return None;
            }
            source.last_warned = Some(now);
            Some(Leak {
                source: ip,
                connections: window.opened,
                requests_per_connection: per_connection(&window),
            })
        })
    }

    /// Every source, busiest first.
    pub fn report(&self) -> Vec<ClientReport> {
        let current = self.slice(Instant::now());
        let sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let mut reports: Vec<ClientReport> = sources
            .iter()
            .map(|(ip, source)| {
                let window = window_sum(source, current);
                ClientReport {
                    source: ip.to_string(),
                    connections_opened: source.totals.opened,
                    requests: source.totals.requests,
                    requests_per_connection: per_connection(&source.totals),
                    idle_closes: source.totals.idle_closed,
                    window_connections_opened: window.opened,
                    window_requests_per_connection: per_connection(&window),
                    leaking: is_leaking(&window),
                }
            })
            .collect();
        reports.sort_by_key(|r| std::cmp::Reverse(r.connections_opened));
        reports
    }
}

/// The sum of the buckets in the window ending at slice `current`.
fn window_sum(source: &Source, current: u64) -> Bucket {
    let mut sum = Bucket::default();
    for bucket in &source.buckets {
        if bucket.slice + BUCKETS as u64 > current && bucket.slice <= current {
            sum.opened += bucket.opened;
            sum.closed += bucket.closed;
            sum.requests += bucket.requests;
            sum.idle_closed += bucket.idle_closed;
        }
    }
    sum
}

fn per_connection(b: &Bucket) -> f64 {
    if b.closed == 0 {
        0.0
    } else {
        b.requests as f64 / b.closed as f64
    }
}

fn is_leaking(window: &Bucket) -> bool {
    window.opened >= LEAK_MIN_CONNECTIONS
        && window.closed > 0
        && per_connection(window) < LEAK_MAX_REQUESTS_PER_CONNECTION
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn one_request_per_connection_is_flagged_once_per_window() {
        let clients = Clients::new();
        let mut warnings = Vec::new();
        for _ in 0..150 {
            clients.opened(ip(1));
            warnings.extend(clients.closed(ip(1), 1, true));
        }
        assert_eq!(warnings.len(), 1, "one warning per window");
        assert_eq!(warnings[0].source, ip(1));
        assert!(warnings[0].connections >= 100);
        assert!((warnings[0].requests_per_connection - 1.0).abs() < f64::EPSILON);
        let report = clients.report();
        assert_eq!(report[0].connections_opened, 150);
        assert!(report[0].leaking);
    }

    #[test]
    fn reused_connections_and_few_connections_are_not_flagged() {
        let clients = Clients::new();
        for _ in 0..150 {
            clients.opened(ip(2));
            assert_eq!(clients.closed(ip(2), 20, false), None);
        }
        for _ in 0..5 {
            clients.opened(ip(3));
            assert_eq!(clients.closed(ip(3), 1, false), None);
        }
        assert!(clients.report().iter().all(|r| !r.leaking));
    }
}
