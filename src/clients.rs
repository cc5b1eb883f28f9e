//! Per-source accounting of application connections, and the leak detector.
//!
//! Every downstream source gets a sliding window of connections opened, connections
//! closed, the requests those carried and how many were closed idle. A source that opens many
//! connections with about one request each (default: at least 100 connections in 60 s at under
//! 1.5 requests per connection) is almost always building a new HTTP client or transport per
//! request: the leak the seed articles describe. The detector logs one warning per window naming
//! the source, the numbers, the likely cause and what the sidecar is doing about it, and
//! `/debug/clients` shows the same per source.
//!
//! A source is a peer IP for TCP connections, and a process for connections on the Unix
//! socket (`listen_unix`): pid, uid and start time from the peer credentials, so processes
//! sharing a loopback address, or a reused pid, are told apart (see `process`). For a flagged
//! loopback IP the warning and `/debug/clients` add, best effort, the processes holding that
//! source's open connections (see `loopback`).
//!
//! The hot path touches the table twice per connection (open and close), never per request:
//! a connection reports its request count when it closes.
//!
//! Not handled here: counting requests (the connection task does), serving `/debug/clients`
//! (`admin`), reading peer credentials at accept (`downstream`).

pub mod loopback;
pub mod process;

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

pub use process::{Process, ProcessCache};

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
/// A loopback attribution scan is reused for this long (`/debug/clients` may be polled).
const SCAN_TTL: Duration = Duration::from_secs(10);
/// Loopback sources whose last scan is kept.
const SCANS_KEPT: usize = 64;

/// Where a request came from: the one name for it in downstream, this accounting and the access
/// log. The variant is also the socket type: only a TCP accept makes a `Tcp` source and only the
/// Unix accept a `Unix` one, which is how a parked descriptor is resumed as the right type.
///
/// The accounting counts a TCP source by its IP (the client's port changes with every
/// connection): [`Source::counted`] leaves the port 0, and such a source shows as its IP alone.
/// A peer never has port 0, so the two cannot be confused.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Source {
    /// A TCP peer.
    Tcp(SocketAddr),
    /// A process connected over the Unix socket.
    Unix(Arc<Process>),
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Tcp(addr) if addr.port() == 0 => addr.ip().fmt(f),
            Source::Tcp(addr) => addr.fmt(f),
            Source::Unix(process) => process.fmt(f),
        }
    }
}

impl From<IpAddr> for Source {
    /// Every connection from `ip`, as the accounting counts them.
    fn from(ip: IpAddr) -> Self {
        Source::Tcp(SocketAddr::new(ip, 0))
    }
}

impl Source {
    /// This source as the accounting counts it: a TCP peer by its IP alone.
    pub fn counted(&self) -> Source {
        match self {
            Source::Tcp(addr) => Source::from(addr.ip()),
            Source::Unix(process) => Source::Unix(process.clone()),
        }
    }

    /// The IP of a loopback TCP source: the only kind worth attributing by `/proc` scan.
    pub fn loopback_ip(&self) -> Option<IpAddr> {
        match self {
            Source::Tcp(addr) if addr.ip().to_canonical().is_loopback() => Some(addr.ip()),
            _ => None,
        }
    }

    /// The process of a Unix-socket source.
    pub fn process(&self) -> Option<&Process> {
        match self {
            Source::Unix(process) => Some(process),
            Source::Tcp(_) => None,
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Bucket {
    /// Which window slice this bucket holds (time since start / slice length).
    slice: u64,
    opened: u64,
    closed: u64,
    requests: u64,
    idle_closed: u64,
}

/// One source's counts over the leak window, bucket by bucket.
#[derive(Debug)]
struct History {
    buckets: [Bucket; BUCKETS],
    totals: Bucket,
    last_seen: Instant,
    last_warned: Option<Instant>,
}

/// What `/debug/clients` shows for one source.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ClientReport {
    /// Peer IP, or for a Unix-socket process `pid 1234 (/usr/bin/app) uid 1000`.
    pub source: String,
    /// Unix-socket sources: the process's pid (absent when its pid namespace hides it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Unix-socket sources: the process's uid.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// Unix-socket sources: the executable (or command name when the link is unreadable).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exe: Option<String>,
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
    /// Flagged loopback sources: processes holding this source's open connections, most first
    /// (best effort, see `loopback`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes: Option<Vec<loopback::Owner>>,
    /// Why `processes` is empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub processes_note: Option<String>,
    /// The IP to attribute, for flagged loopback sources.
    #[serde(skip)]
    attribute: Option<IpAddr>,
}

/// What the detector found, for the warning.
#[derive(Debug, Clone, PartialEq)]
pub struct Leak {
    /// Who.
    pub source: Source,
    /// Connections opened in the window.
    pub connections: u64,
    /// Requests per closed connection in the window.
    pub requests_per_connection: f64,
}

/// The per-source table.
#[derive(Debug)]
pub struct Clients {
    start: Instant,
    sources: Mutex<HashMap<Source, History>>,
    /// The listeners applications connect to, which loopback attribution looks for.
    listeners: Vec<SocketAddr>,
    /// Recent loopback scans; held while scanning, so that one scan runs at a time.
    scans: Mutex<HashMap<IpAddr, (Instant, Arc<loopback::Scan>)>>,
}

impl Default for Clients {
    fn default() -> Self {
        Self::new()
    }
}

impl Clients {
    /// An empty table that attributes no loopback source.
    pub fn new() -> Self {
        Self::with_listeners(Vec::new())
    }

    /// An empty table; flagged loopback sources are attributed by their connections to
    /// `listeners`.
    pub fn with_listeners(listeners: Vec<SocketAddr>) -> Self {
        Clients {
            start: Instant::now(),
            sources: Mutex::new(HashMap::new()),
            listeners,
            scans: Mutex::new(HashMap::new()),
        }
    }

    fn slice(&self, now: Instant) -> u64 {
        let slice_len = LEAK_WINDOW.as_millis() as u64 / BUCKETS as u64;
        now.saturating_duration_since(self.start).as_millis() as u64 / slice_len
    }

    /// Runs `f` on `key`'s entry and the index of the current bucket (reset if it is stale).
    fn with_source<R>(&self, source: &Source, now: Instant, f: impl FnOnce(&mut History, usize) -> R) -> R {
        let key = &source.counted();
        let slice = self.slice(now);
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        if !sources.contains_key(key) {
            if sources.len() >= MAX_SOURCES {
                if let Some(oldest) = sources
                    .iter()
                    .min_by_key(|(_, s)| s.last_seen)
                    .map(|(k, _)| k.clone())
                {
                    sources.remove(&oldest);
                }
            }
            sources.insert(key.clone(), History::new(now));
        }
        let source = sources.get_mut(key).expect("inserted above");
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

    /// A connection from `source` was accepted; returns whether the detector flags `source`
    /// now (its connections then get `downstream.leaky_idle_timeout`).
    pub fn opened(&self, source: &Source) -> bool {
        let now = Instant::now();
        let current = self.slice(now);
        self.with_source(source, now, |source, i| {
            source.buckets[i].opened += 1;
            source.totals.opened += 1;
            is_leaking(&window_sum(source, current))
        })
    }

    /// A connection from `from` closed after `requests` requests; returns a leak to warn about
    /// (naming the source as counted), at most once per window per source.
    pub fn closed(&self, from: &Source, requests: u64, idle_closed: bool) -> Option<Leak> {
        let now = Instant::now();
        let current = self.slice(now);
        self.with_source(from, now, |source, i| {
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
                source: from.counted(),
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
            .map(|(key, source)| {
                let window = window_sum(source, current);
                let process = key.process();
                let leaking = is_leaking(&window);
                ClientReport {
                    source: key.to_string(),
                    pid: process.and_then(|p| p.pid),
                    uid: process.map(|p| p.uid),
                    exe: process.and_then(|p| p.exe.as_deref().map(str::to_owned)),
                    connections_opened: source.totals.opened,
                    requests: source.totals.requests,
                    requests_per_connection: per_connection(&source.totals),
                    idle_closes: source.totals.idle_closed,
                    window_connections_opened: window.opened,
                    window_requests_per_connection: per_connection(&window),
                    leaking,
                    processes: None,
                    processes_note: None,
                    attribute: key.loopback_ip().filter(|_| leaking),
                }
            })
            .collect();
        reports.sort_by_key(|r| std::cmp::Reverse(r.connections_opened));
        reports
    }

    /// Like [`Clients::report`], with the processes behind each flagged loopback source, found
    /// looking up at most `max_links` fd links (see `loopback`).
    pub async fn report_attributed(self: &Arc<Self>, max_links: usize) -> Vec<ClientReport> {
        let mut reports = self.report();
        for report in &mut reports {
            let Some(ip) = report.attribute else { continue };
            let clients = self.clone();
            if let Ok(scan) = tokio::task::spawn_blocking(move || clients.attribute(ip, max_links)).await {
                report.processes = Some(scan.owners.clone());
                report.processes_note = scan.note();
            }
        }
        reports
    }

    /// The processes holding `ip`'s open connections to the sidecar's listeners, found looking
    /// up at most `max_links` fd links. Blocking (it reads `/proc`, see `loopback`): call it off
    /// the runtime's threads.
    pub fn attribute(&self, ip: IpAddr, max_links: usize) -> Arc<loopback::Scan> {
        let mut scans = self.scans.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if let Some((at, scan)) = scans.get(&ip) {
            if now.duration_since(*at) < SCAN_TTL {
                return scan.clone();
            }
        }
        let scan = Arc::new(loopback::scan(Path::new("/proc"), ip, &self.listeners, max_links));
        scans.retain(|_, (at, _)| now.duration_since(*at) < SCAN_TTL);
        if scans.len() < SCANS_KEPT {
            scans.insert(ip, (now, scan.clone()));
        }
        scan
    }
}

impl History {
    fn new(now: Instant) -> Self {
        History {
            buckets: [Bucket::default(); BUCKETS],
            totals: Bucket::default(),
            last_seen: now,
            last_warned: None,
        }
    }
}

/// The sum of the buckets in the window ending at slice `current`.
fn window_sum(source: &History, current: u64) -> Bucket {
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

    fn ip(last: u8) -> Source {
        Source::from(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn one_request_per_connection_is_flagged_once_per_window() {
        let clients = Clients::new();
        let mut warnings = Vec::new();
        for _ in 0..150 {
            clients.opened(&ip(1));
            warnings.extend(clients.closed(&ip(1), 1, true));
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
            clients.opened(&ip(2));
            assert_eq!(clients.closed(&ip(2), 20, false), None);
        }
        for _ in 0..5 {
            clients.opened(&ip(3));
            assert_eq!(clients.closed(&ip(3), 1, false), None);
        }
        assert!(clients.report().iter().all(|r| !r.leaking));
    }

    fn process(pid: u32, start_time: u64, exe: &str) -> Source {
        Source::Unix(Arc::new(Process {
            pid: Some(pid),
            uid: 1000,
            start_time: Some(start_time),
            exe: Some(exe.into()),
        }))
    }

    #[test]
    fn processes_are_sources_of_their_own_and_a_reused_pid_is_a_new_one() {
        let clients = Clients::new();
        let leaky = process(1234, 500, "/usr/bin/leaky");
        let reused = process(1234, 900, "/usr/bin/other");
        let mut warnings = Vec::new();
        for _ in 0..150 {
            clients.opened(&leaky);
            warnings.extend(clients.closed(&leaky, 1, true));
        }
        clients.opened(&reused);
        assert_eq!(clients.closed(&reused, 7, false), None);
        assert_eq!(warnings.len(), 1);
        assert_eq!(
            warnings[0].source.to_string(),
            "pid 1234 (/usr/bin/leaky) uid 1000"
        );
        let report = clients.report();
        assert_eq!(report.len(), 2, "{report:?}");
        assert_eq!(report[0].pid, Some(1234));
        assert_eq!(report[0].uid, Some(1000));
        assert_eq!(report[0].exe.as_deref(), Some("/usr/bin/leaky"));
        assert!(report[0].leaking);
        assert_eq!(report[1].exe.as_deref(), Some("/usr/bin/other"));
        assert!(!report[1].leaking);
        let json = serde_json::to_value(&report[0]).unwrap();
        assert_eq!(json["pid"], 1234);
        assert_eq!(json["exe"], "/usr/bin/leaky");
        assert!(json.get("processes").is_none());
    }

    #[test]
    fn ip_sources_report_no_process_fields() {
        let clients = Clients::new();
        clients.opened(&ip(9));
        let json = serde_json::to_value(&clients.report()[0]).unwrap();
        assert_eq!(json["source"], "10.0.0.9");
        for field in ["pid", "uid", "exe", "processes", "processes_note"] {
            assert!(json.get(field).is_none(), "{field} in {json}");
        }
    }
}
