//! The per-upstream connection pool: a hard cap, a FIFO wait queue, MRU reuse of HTTP/1.1
//! connections and stream counting on multiplexed HTTP/2 connections.
//!
//! hyper-util's pool has no connection cap, no queue and only one HTTP/2 connection per host, so
//! this one is ours. One [`Pool`] per upstream holds:
//! - `open`: connections dialing, in use or idle. It never exceeds `max_connections`. A
//!   connection counts until its socket is closed: the [`Slot`] guard travels from the dial
//!   into the HTTP/1.1 connection itself (or the HTTP/2 connection's driver task) and gives the
//!   place back when that is dropped.
//! - `idle`: connections ready for a request, most recently used last (checked out first),
//!   each closed after `idle_timeout` (sooner when the upstream's `Keep-Alive: timeout=N` says
//!   so, or when the pool has learned the upstream's own idle timeout: below) or, once idle,
//!   after `max_lifetime`. Beyond `max_idle`, the oldest idle connections are
//!   closed after a one-second grace, so that load hovering around `max_idle` does not churn.
//! - `h2`: HTTP/2 connections, each carrying up to min(`http2.max_streams_per_connection`, the
//!   server's current SETTINGS_MAX_CONCURRENT_STREAMS) streams, re-read at every checkout so the
//!   pool follows a server that changes it. Requests fill connections in order; a new one is
//!   dialed only when every connection is full. A connection that saw GOAWAY or passed
//!   `max_lifetime` takes no new streams and closes when its last stream ends; one with no
//!   streams for `idle_timeout` is closed.
//! - `waiters`: requests waiting for a connection, oldest first, at most `max_pending`, each for
//!   at most `pending_timeout`. A connection (or HTTP/2 stream slot) that frees up goes straight
//!   to the oldest waiter; so does a freshly dialed one. With `max_connections: 1` an HTTP/2
//!   upstream behaves like Go's `StrictMaxConcurrentStreams`.
//!
//! Dials are decoupled from requests: a dial is started only while more requests wait than the
//! dials in flight will serve (one request each for HTTP/1.1, a connection's worth of streams
//! for HTTP/2, everything for the single probe dial while the protocol is not yet known from
//! ALPN), never more than `max_connecting` at once, and its connection serves whoever is oldest
//! in the queue when it is ready. A burst of N requests therefore opens at most
//! `min(N, max_connections)` HTTP/1.1 connections, or `ceil(N / streams)` HTTP/2 ones, and a
//! connection that frees up first serves the burst before the dial finishes (no dial storm).
//!
//! Not handled here: how a connection is dialed ([`crate::connector`]), retries and
//! timeouts of a request on its connection ([`crate::upstream`]).
//!
//! # Race window
//! A connection checked out idle may be closed by the upstream at the same instant. Idle
//! HTTP/1.1 sockets carry the reaper's waker, so a close that arrives is noticed at once, and
//! checkout looks again before handing one out; the remaining window (the upstream's FIN in
//! flight while the request is written) is closed by the retry in `upstream`, and avoided
//! altogether once the upstream's idle timeout is learned.
//!
//! # Learned upstream idle timeouts
//! Most upstreams close idle keep-alive connections after a timeout of their own and do not
//! announce it. The pool learns it from the idle age of every HTTP/1.1 connection the upstream
//! closes while the connection sits idle in the pool (noticed at once by the reaper's waker on
//! the socket, or by checkout looking before it hands one out), and from nothing else: not
//! closes the pool decides, not connections closed after a response with `Connection: close`
//! (closed at check-in, never idle), not connections that fail while carrying a request. After
//! [`learn::AGREE`] closes at agreeing idle ages (each at least [`learn::MIN_AGE`]), idle
//! connections are retired a margin (max(250 ms, 10 %)) before that age, counted as
//! `learned_idle_timeout`; the smallest of `idle_timeout`, the `Keep-Alive` hint and the
//! learned age wins. The learned value lapses 10 minutes after the last close supporting it, so
//! an upstream that raised its timeout is followed; [`learn`] has the whole rule. It is
//! exported as `egress_upstream_learned_idle_timeout_seconds` and in `/debug/pools`, and logged
//! at info when it changes. It lives and dies with the pool: a reload that keeps the pool
//! keeps it. HTTP/2 is not covered: a server closing an idle HTTP/2 connection sends GOAWAY
//! first, and a stream that crosses it comes back unsent and is retried whatever its method.

mod body;
// Tests and benches of the pool only; `test-support` lets benches/pool.rs reach it.
#[cfg(any(test, feature = "test-support"))]
pub mod in_memory;
pub mod learn;

use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
#[cfg(any(test, feature = "test-support"))]
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

pub use body::{PooledBody, SendError, UpstreamBody};

use crate::config::PoolConfig;
use crate::connector::{h1, Connect, Dialed, H2Sender, Place};
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::UpstreamMetrics;
use crate::wire::RequestBody;

/// Idle connections beyond `max_idle` are closed once idle this long, rather than at once: under
/// steady load the idle count swings past `max_idle` for microseconds as requests complete
/// together, and closing then would churn connections (HAProxy's `pool-purge-delay` idea).
const IDLE_SURPLUS_GRACE: Duration = Duration::from_secs(1);

/// What the pool knows the upstream speaks; it decides how many dials a queue needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Negotiated {
    /// Not yet known (TLS with ALPN offering both): one probe dial at a time.
    Unknown,
    /// HTTP/1.1.
    Http1,
    /// HTTP/2.
    Http2,
}

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
}

impl Tracker {
    const DIALING: u8 = 0;
    const OPEN: u8 = 1;
    /// Index [`Self::OPEN`] doubles as the reason of a connection that ended with none recorded:
    /// the upstream closed it.
    const REASONS: [&'static str; 13] = [
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
    ];

    fn set(&self, reason: &'static str) {
        if let Some(code) = Self::REASONS.iter().position(|r| *r == reason) {
            let _ =
                self.0
                    .state
                    .compare_exchange(Self::OPEN, code as u8, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    fn opened(&self, http2: bool) {
        self.0.http2.store(http2, Ordering::Relaxed);
        self.0.state.store(Self::OPEN, Ordering::Relaxed);
    }

    /// `None` while the dial had not produced a connection.
    fn reason(&self) -> Option<&'static str> {
        match self.0.state.load(Ordering::Relaxed) {
            Self::DIALING => None,
            code => Self::REASONS.get(usize::from(code)).copied(),
        }
    }

    /// Whether a reason to close was recorded.
    fn is_closing(&self) -> bool {
        self.0.state.load(Ordering::Relaxed) > Self::OPEN
    }

    fn is_http2(&self) -> bool {
        self.0.http2.load(Ordering::Relaxed)
    }

    fn requests(&self) -> u64 {
        self.0.requests.load(Ordering::Relaxed)
    }

    fn count_request(&self) {
        self.0.requests.fetch_add(1, Ordering::Relaxed);
    }
}

/// An upstream connection with its bookkeeping.
#[derive(Debug)]
pub struct Conn {
    io: h1::Connection,
    track: Tracker,
    id: u64,
    created: Instant,
    /// From the upstream's `Keep-Alive: timeout=N`, less a margin.
    idle_limit: Option<Duration>,
    /// From the upstream's `Keep-Alive: max=N`: requests this connection may still serve.
    remaining_hint: Option<u64>,
    retire: bool,
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// An HTTP/2 connection and its stream count.
struct H2Conn {
    sender: H2Sender,
    track: Tracker,
    /// The server's current SETTINGS_MAX_CONCURRENT_STREAMS.
    server_max_streams: Arc<AtomicUsize>,
    id: u64,
    created: Instant,
    in_flight: usize,
    served: u64,
    /// GOAWAY seen or `max_lifetime` passed: no new streams; closed when the last one ends.
    draining: bool,
    /// When `in_flight` last dropped to zero.
    idle_since: Instant,
}

/// A stream slot on an HTTP/2 connection, counted in its `in_flight`.
#[derive(Debug)]
pub struct H2Stream {
    sender: H2Sender,
    conn_id: u64,
    reused: bool,
}

/// What a request is given: an HTTP/1.1 connection of its own, or a stream slot.
#[derive(Debug)]
enum Grant {
    H1(Conn),
    H2(H2Stream),
}

struct Waiter {
    id: u64,
    tx: oneshot::Sender<Result<Grant, ProxyError>>,
}

struct State {
    /// Oldest first; `pop()` yields the most recently used.
    idle: Vec<Idle>,
    h2: Vec<H2Conn>,
    protocol: Negotiated,
    /// Streams the last HTTP/2 connection allowed: how many waiters one dial will serve.
    h2_streams_hint: usize,
    open: usize,
    connecting: usize,
    waiters: VecDeque<Waiter>,
    next_waiter: u64,
    reaper_running: bool,
    reaper_deadline: Option<Instant>,
    /// The reaper task's waker, registered on the socket of every idle HTTP/1.1 connection so
    /// that an upstream closing one wakes it (`None` while no reaper has run).
    idle_waker: Option<Waker>,
    /// Every connection counted in `open`, by id: what `/debug/pools` lists.
    conns: BTreeMap<u64, Tracked>,
    next_conn_id: u64,
    /// The settings now in force (a reload may change them).
    config: PoolConfig,
    /// `http2.max_streams_per_connection`.
    max_streams: usize,
    /// Set when the pool's upstream left the config or the sidecar is stopping: connections
    /// close as soon as they are idle, with this reason.
    retired: Option<&'static str>,
    /// The upstream's own idle timeout, learned from its closes of idle connections.
    learner: learn::IdleLearner,
}

impl State {
    /// How many open connections, not already closing, exceed `max_connections` (after a
    /// reload lowered it).
    fn over_cap(&self) -> usize {
        if self.open <= self.config.max_connections {
            return 0;
        }
        let closing = self.conns.values().filter(|c| c.track.is_closing()).count();
        (self.open - closing).saturating_sub(self.config.max_connections)
    }
}

/// A registry entry: the connection's record and when it was opened (or, while dialing, when
/// the dial started).
struct Tracked {
    track: Tracker,
    since: Instant,
}

/// Counters for the admin API and tests.
#[derive(Debug, Default)]
struct Stats {
    opened: AtomicU64,
    reused: AtomicU64,
}

/// The pool of one upstream.
pub struct Pool {
    label: Arc<str>,
    connector: Box<dyn Connect>,
    metrics: UpstreamMetrics,
    state: Mutex<State>,
    reaper_wake: Notify,
    stats: Stats,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("label", &self.label)
            .field("open", &self.open_connections())
            .finish_non_exhaustive()
    }
}

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
    /// connections, while one is in force (see [`learn`]).
    pub learned_idle_timeout_ms: Option<u64>,
    /// The idle age at which connections are retired because of it: the learned timeout less
    /// a margin, when that is below `idle_timeout`.
    pub learned_retire_after_ms: Option<u64>,
    /// Upstream closes of idle connections counted towards learning since the pool started.
    pub idle_close_observations: u64,
    /// Each open connection, oldest first.
    pub connections: Vec<ConnectionReport>,
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
}

// === impl Pool ===

impl Pool {
    /// A pool for the upstream labelled `label`, which speaks `protocol` (as far as known
    /// before dialing) with at most `max_streams` streams per HTTP/2 connection.
    pub fn new(
        label: Arc<str>,
        config: PoolConfig,
        protocol: Negotiated,
        max_streams: usize,
        connector: Box<dyn Connect>,
        metrics: UpstreamMetrics,
    ) -> Arc<Self> {
        let state = State {
            idle: Vec::new(),
            h2: Vec::new(),
            protocol,
            h2_streams_hint: max_streams,
            open: 0,
            connecting: 0,
            waiters: VecDeque::new(),
            next_waiter: 0,
            reaper_running: false,
            reaper_deadline: None,
            idle_waker: None,
            conns: BTreeMap::new(),
            next_conn_id: 0,
            config,
            max_streams,
            retired: None,
            learner: learn::IdleLearner::default(),
        };
        Arc::new(Pool {
            label,
            connector,
            metrics,
            state: Mutex::new(state),
            reaper_wake: Notify::new(),
            stats: Stats::default(),
        })
    }

    /// The pool's settings now in force.
    pub fn config(&self) -> PoolConfig {
        self.lock().config
    }

    /// Connections dialing, in use or idle.
    pub fn open_connections(&self) -> usize {
        self.lock().open
    }

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

    /// The upstream's label.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Applies settings from a reloaded config. Connections stay; a lowered `max_connections`
    /// or `max_idle` closes idle connections over it now and busy ones as they free up, a
    /// raised one serves waiting requests at once.
    pub fn reconfigure(self: &Arc<Self>, config: PoolConfig, max_streams: usize) {
        let mut st = self.lock();
        if st.config == config && st.max_streams == max_streams {
            return;
        }
        st.config = config;
        st.max_streams = max_streams;
        let now = Instant::now();
        self.schedule_reaper(&mut st, now);
        let indexes: Vec<usize> = (0..st.h2.len()).collect();
        for index in indexes {
            self.serve_stream_waiters(&mut st, index);
        }
        self.start_dials(&mut st);
    }

    /// Stops keeping connections: idle ones close now (HTTP/2 ones with GOAWAY), busy ones when
    /// their exchange ends, each counted as closed for `reason`. Requests that still reach the
    /// pool are served.
    pub fn retire(&self, reason: &'static str) {
        let mut st = self.lock();
        st.retired = Some(reason);
        let idle = std::mem::take(&mut st.idle);
        for conn in &idle {
            conn.conn.track.set(reason);
        }
        // A dropped sender with no stream left makes h2 send GOAWAY and close.
        let mut closing = Vec::new();
        for mut conn in std::mem::take(&mut st.h2) {
            conn.track.set(reason);
            conn.draining = true;
            if conn.in_flight > 0 {
                st.h2.push(conn);
            } else {
                closing.push(conn);
            }
        }
        drop(st);
        drop(idle);
        drop(closing);
    }

    /// Closes the idle connections beyond `max_idle` now rather than after their grace: the
    /// memory budget's second step. Returns how many.
    pub fn shed_idle_surplus(&self) -> usize {
        let mut st = self.lock();
        let surplus = st.idle.len().saturating_sub(st.config.max_idle);
        // Oldest first: the list is most recently used last.
        let shed: Vec<Idle> = st.idle.drain(..surplus).collect();
        for idle in &shed {
            idle.conn.track.set("memory_budget");
        }
        drop(st);
        shed.len()
    }

    /// Every connection counted in `open`, for `/debug/pools`.
    pub fn report(&self) -> PoolReport {
        let now = Instant::now();
        let st = self.lock();
        let secs = |since: Instant| now.saturating_duration_since(since).as_millis() as f64 / 1000.0;
        let connections = st
            .conns
            .iter()
            .map(|(&id, tracked)| {
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
            })
            .collect();
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
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panic in another holder: every critical section
        // is a few field updates with no user code inside.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn error(&self, kind: ErrorKind, cause: impl Into<String>) -> ProxyError {
        ProxyError::new(kind, cause).with_upstream(&*self.label)
    }

    /// Waits for a ready connection (or HTTP/2 stream slot): an idle one, a freed one, or a new
    /// one.
    pub async fn checkout(self: &Arc<Self>) -> Result<Lease, ProxyError> {
        let started = Instant::now();
        let lease = self.checkout_inner(started).await?;
        self.metrics.wait.observe(started.elapsed().as_secs_f64());
        if lease.is_reused() {
            self.metrics.reused.inc();
        }
        Ok(lease)
    }

    async fn checkout_inner(self: &Arc<Self>, started: Instant) -> Result<Lease, ProxyError> {
        let deadline = started + self.config().pending_timeout;
        let grant = match self.take_or_enqueue()? {
            Ok(grant) => grant,
            Err(waiting) => waiting.wait(deadline).await?,
        };
        let (reused, kind) = match grant {
            Grant::H2(stream) => (stream.reused, LeaseKind::H2(Some(stream))),
            Grant::H1(conn) => (conn.track.requests() > 0, LeaseKind::H1(Some(conn))),
        };
        if reused {
            self.stats.reused.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Lease::new(self.clone(), kind))
    }

    /// The fast path (a free HTTP/2 stream or a usable idle connection, no one waiting) or a
    /// place in the queue.
    #[allow(clippy::type_complexity)]
    fn take_or_enqueue(self: &Arc<Self>) -> Result<Result<Grant, Waiting>, ProxyError> {
        let mut discard = Vec::new();
        let mut learned = None;
        let now = Instant::now();
        let mut st = self.lock();
        if st.waiters.is_empty() {
            if let Some(stream) = self.take_stream(&mut st) {
                return Ok(Ok(Grant::H2(stream)));
            }
            let retire_after = st.learner.retire_after(now);
            while let Some(mut idle) = st.idle.pop() {
                let closed = idle.conn.io.is_closed();
                if !closed && now < idle_deadline(&st.config, retire_after, &idle.conn, idle.since) {
                    drop(st);
                    self.log_learned(learned);
                    return Ok(Ok(Grant::H1(idle.conn)));
                }
                if closed {
                    learned = learned.or(upstream_closed_idle(&mut st.learner, &idle, now));
                } else {
                    idle.conn
                        .track
                        .set(expiry_reason(&st.config, retire_after, &idle.conn, now));
                }
                discard.push(idle);
            }
        }
        // `max_pending` bounds requests waiting for capacity; a request a new dial will serve
        // is not over the limit (so `max_pending: 0` still lets the pool grow to its cap).
        let established = st.open - st.connecting;
        let dialable = st.config.max_connections.saturating_sub(established);
        let max_pending = st.config.max_pending;
        if st.waiters.len() >= max_pending + dialable {
            drop(st);
            self.log_learned(learned);
            self.metrics.rejected("pool_overflow");
            return Err(self.error(
                ErrorKind::PoolOverflow,
                format!("{max_pending} requests already wait for a connection (max_pending)"),
            ));
        }
        let (tx, rx) = oneshot::channel();
        let id = st.next_waiter;
        st.next_waiter += 1;
        st.waiters.push_back(Waiter { id, tx });
        self.start_dials(&mut st);
        drop(st);
        drop(discard);
        self.log_learned(learned);
        Ok(Err(Waiting {
            pool: self.clone(),
            id,
            rx: Some(rx),
        }))
    }

    /// A stream slot on the first HTTP/2 connection with room.
    fn take_stream(&self, st: &mut State) -> Option<H2Stream> {
        st.h2.retain(|c| !c.sender.is_closed());
        let now = Instant::now();
        let (cfg, max_streams) = (st.config, st.max_streams);
        let conn = st
            .h2
            .iter_mut()
            .find_map(|c| c.takes_streams(&cfg, max_streams, now).then_some(c))?;
        Some(conn.grant_stream())
    }

    /// Starts dials while more requests wait than the dials in flight will serve, within both
    /// caps.
    fn start_dials(self: &Arc<Self>, st: &mut State) {
        let served_per_dial = match st.protocol {
            Negotiated::Unknown => usize::MAX,
            Negotiated::Http1 => 1,
            Negotiated::Http2 => st.h2_streams_hint.max(1),
        };
        while st.waiters.len() > st.connecting.saturating_mul(served_per_dial)
            && st.open < st.config.max_connections
            && st.connecting < st.config.max_connecting
        {
            st.open += 1;
            st.connecting += 1;
            st.next_conn_id += 1;
            let slot = Slot {
                pool: self.clone(),
                track: Tracker::default(),
                id: st.next_conn_id,
            };
            st.conns.insert(
                slot.id,
                Tracked {
                    track: slot.track.clone(),
                    since: Instant::now(),
                },
            );
            let pool = self.clone();
            tokio::spawn(async move { pool.dial(slot).await });
        }
    }

    async fn dial(self: Arc<Self>, slot: Slot) {
        let (track, id) = (slot.track.clone(), slot.id);
        let result = self.connector.connect(Box::new(slot)).await;
        if let Ok(dialed) = &result {
            track.opened(matches!(dialed, Dialed::Http2(..)));
            self.stats.opened.fetch_add(1, Ordering::Relaxed);
            self.metrics.opened.inc();
        }
        let mut failed = Vec::new();
        let mut st = self.lock();
        st.connecting -= 1;
        let now = Instant::now();
        if let (Ok(_), Some(tracked)) = (&result, st.conns.get_mut(&id)) {
            tracked.since = now;
        }
        match result {
            Ok(Dialed::Http1(io)) => {
                if st.protocol == Negotiated::Unknown {
                    st.protocol = Negotiated::Http1;
                }
                let conn = Conn {
                    io,
                    track,
                    id,
                    created: now,
                    idle_limit: None,
                    remaining_hint: None,
                    retire: false,
                };
                let closing = self.hand_over(&mut st, conn);
                // Requests that arrived while every allowed dial was in flight still wait.
                self.start_dials(&mut st);
                drop(st);
                drop(closing);
            }
            Ok(Dialed::Http2(sender, server_max_streams)) => {
                let conn = H2Conn {
                    sender,
                    track,
                    server_max_streams,
                    id,
                    created: now,
                    in_flight: 0,
                    served: 0,
                    draining: false,
                    idle_since: now,
                };
                st.protocol = Negotiated::Http2;
                st.h2_streams_hint = conn.stream_limit(st.max_streams);
                st.h2.push(conn);
                let index = st.h2.len() - 1;
                self.serve_stream_waiters(&mut st, index);
                self.start_dials(&mut st);
            }
            Err(err) => {
                // The upstream looks unreachable when nothing is established: fail every waiter
                // no other dial in flight will serve. Otherwise fail only the oldest.
                let established = st.open - st.connecting;
                let keep = if established == 0 {
                    st.connecting
                } else {
                    st.waiters.len().saturating_sub(1)
                };
                while st.waiters.len() > keep {
                    match st.waiters.pop_front() {
                        Some(w) => failed.push(w),
                        None => break,
                    }
                }
                self.start_dials(&mut st);
                drop(st);
                for w in failed {
                    let _ = w.tx.send(Err(err.clone()));
                }
            }
        }
    }

    /// Gives a ready connection to the oldest live waiter, else keeps it idle; returns it when
    /// it is to be closed, which the caller does after unlocking `st` (closing frees its slot,
    /// which takes the lock).
    #[must_use]
    fn hand_over(self: &Arc<Self>, st: &mut State, mut conn: Conn) -> Option<Conn> {
        if st.over_cap() > 0 {
            // A reload lowered the cap below what is open: shrink as connections free up.
            conn.track.set("reload");
            return Some(conn);
        }
        while let Some(waiter) = st.waiters.pop_front() {
            match waiter.tx.send(Ok(Grant::H1(conn))) {
                Ok(()) => return None,
                Err(Ok(Grant::H1(back))) => conn = back,
                Err(_) => unreachable!("sent an HTTP/1.1 grant"),
            }
        }
        if let Some(reason) = st.retired {
            conn.track.set(reason);
            return Some(conn);
        }
        if st.config.max_idle == 0 {
            conn.track.set("max_idle");
            return Some(conn);
        }
        // From now on the reaper hears of the upstream closing it.
        if let Some(waker) = &st.idle_waker {
            if conn.io.poll_closed(&mut Context::from_waker(waker)).is_ready() {
                conn.track.set("upstream_close");
                return Some(conn);
            }
        }
        let now = Instant::now();
        let mut deadline = idle_deadline(&st.config, st.learner.retire_after(now), &conn, now);
        st.idle.push(Idle { conn, since: now });
        if st.idle.len() > st.config.max_idle {
            deadline = deadline.min(st.idle[0].since + IDLE_SURPLUS_GRACE);
        }
        self.schedule_reaper(st, deadline);
        None
    }

    /// Makes sure the reaper wakes by `deadline`.
    fn schedule_reaper(self: &Arc<Self>, st: &mut State, deadline: Instant) {
        if !st.reaper_running {
            st.reaper_running = true;
            st.reaper_deadline = Some(deadline);
            tokio::spawn(reap(self.clone()));
        } else if st.reaper_deadline.is_none_or(|d| deadline < d) {
            st.reaper_deadline = Some(deadline);
            self.reaper_wake.notify_one();
        }
    }

    /// Gives free stream slots of `st.h2[index]` to the oldest waiters.
    fn serve_stream_waiters(self: &Arc<Self>, st: &mut State, index: usize) {
        // The server may have changed its limit: dials for the queue follow the latest.
        let (cfg, max_streams) = (st.config, st.max_streams);
        st.h2_streams_hint = st.h2[index].stream_limit(max_streams);
        let now = Instant::now();
        while st.h2[index].takes_streams(&cfg, max_streams, now) {
            let Some(waiter) = st.waiters.pop_front() else {
                break;
            };
            let stream = st.h2[index].grant_stream();
            if waiter.tx.send(Ok(Grant::H2(stream))).is_err() {
                // The waiter left; its grant was dropped with the channel.
                st.h2[index].in_flight -= 1;
                st.h2[index].served -= 1;
            }
        }
        let conn = &mut st.h2[index];
        if conn.in_flight == 0 {
            conn.idle_since = Instant::now();
            let deadline = conn.idle_deadline(&cfg);
            self.schedule_reaper(st, deadline);
        }
    }

    /// A stream on HTTP/2 connection `conn_id` ended (response body done, or dropped).
    fn stream_done(self: &Arc<Self>, conn_id: u64) {
        let mut st = self.lock();
        let Some(index) = st.h2.iter().position(|c| c.id == conn_id) else {
            return; // already closed and forgotten
        };
        st.h2[index].in_flight -= 1;
        if st.h2[index].draining && st.h2[index].in_flight == 0 {
            st.h2.remove(index);
        } else {
            self.serve_stream_waiters(&mut st, index);
        }
        self.start_dials(&mut st);
    }

    /// GOAWAY seen on HTTP/2 connection `conn_id`: no new streams on it.
    fn drain_h2(&self, conn_id: u64) {
        let mut st = self.lock();
        if let Some(index) = st.h2.iter().position(|c| c.id == conn_id) {
            st.h2[index].track.set("goaway");
            st.h2[index].draining = true;
            if st.h2[index].in_flight == 0 {
                st.h2.remove(index);
            }
        }
    }

    /// Returns a connection whose exchange completed.
    fn check_in(self: &Arc<Self>, conn: Conn) {
        let mut st = self.lock();
        let cfg = st.config;
        let spent = cfg
            .max_requests_per_connection
            .is_some_and(|max| conn.track.requests() >= max)
            || conn.remaining_hint == Some(0);
        let reason = if conn.retire || !conn.io.is_reusable() {
            Some("upstream_close")
        } else if spent {
            Some("max_requests")
        } else if past_lifetime(&cfg, conn.created, Instant::now()) {
            Some("max_lifetime")
        } else {
            None
        };
        match reason {
            Some(reason) => {
                drop(st);
                // Dropped below, which closes it and frees its slot.
                conn.track.set(reason);
            }
            None => {
                let closing = self.hand_over(&mut st, conn);
                drop(st);
                drop(closing);
            }
        }
    }

    /// Closes idle connections past their deadline, and the oldest idle connections beyond
    /// `max_idle` once they have been idle for [`IDLE_SURPLUS_GRACE`]; returns the next deadline.
    fn reap_once(&self, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let mut st = self.lock();
        let learned = st.learner.refresh(now);
        let retire_after = st.learner.retire_after(now);
        let cfg = st.config;
        let max_idle = cfg.max_idle;
        // Connections over a cap a reload lowered: the oldest idle ones go first.
        let mut over_cap = st.over_cap();
        let mut i = 0;
        while i < st.idle.len() {
            let idle = &st.idle[i];
            let surplus = i < st.idle.len().saturating_sub(max_idle);
            let reason = if idle_deadline(&cfg, retire_after, &idle.conn, idle.since) <= now {
                Some(expiry_reason(&cfg, retire_after, &idle.conn, now))
            } else if over_cap > 0 {
                over_cap -= 1;
                Some("reload")
            } else if surplus && idle.since + IDLE_SURPLUS_GRACE <= now {
                Some("max_idle")
            } else {
                None
            };
            if let Some(reason) = reason {
                idle.conn.track.set(reason);
                expired.push(st.idle.remove(i));
            } else {
                i += 1;
            }
        }
        let surplus = st.idle.len().saturating_sub(max_idle);
        let h1_next = st
            .idle
            .iter()
            .enumerate()
            .map(|(i, idle)| {
                let deadline = idle_deadline(&cfg, retire_after, &idle.conn, idle.since);
                if i < surplus {
                    deadline.min(idle.since + IDLE_SURPLUS_GRACE)
                } else {
                    deadline
                }
            })
            .min();
        let h2_next = self.reap_h2(&mut st, now);
        let next = match (h1_next, h2_next) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        st.reaper_deadline = next;
        if next.is_none() {
            st.reaper_running = false;
            st.idle_waker = None;
        }
        drop(st);
        drop(expired);
        self.log_learned(learned);
        next
    }
}

impl Pool {
    /// Closes HTTP/2 connections idle past `idle_timeout` or past `max_lifetime` with no
    /// streams, marks busy ones past `max_lifetime` draining; returns the next deadline.
    fn reap_h2(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let cfg = st.config;
        let past_life = |c: &H2Conn| past_lifetime(&cfg, c.created, now);
        st.h2.retain(|c| {
            let idle_expired = c.in_flight == 0 && (c.idle_deadline(&cfg) <= now || c.draining);
            if idle_expired {
                c.track.set(if past_life(c) {
                    "max_lifetime"
                } else {
                    "idle_timeout"
                });
            }
            !(c.sender.is_closed() || idle_expired)
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

/// Runs while the pool has idle connections, closing each at its deadline, or as soon as the
/// upstream closes it.
async fn reap(pool: Arc<Pool>) {
    loop {
        let Some(deadline) = pool.reap_once(Instant::now()) else {
            return;
        };
        let sleep = std::pin::pin!(tokio::time::sleep_until(deadline));
        let notified = std::pin::pin!(pool.reaper_wake.notified());
        let (mut sleep, mut notified) = (sleep, notified);
        std::future::poll_fn(|cx| {
            if sleep.as_mut().poll(cx).is_ready() || notified.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            pool.watch_idle(cx);
            Poll::Pending
        })
        .await;
    }
}

impl Pool {
    /// Registers the reaper's waker on every idle HTTP/1.1 connection and closes those the
    /// upstream closed. Only readable sockets cost a syscall.
    fn watch_idle(&self, cx: &mut Context<'_>) {
        let mut closed = Vec::new();
        let mut learned = None;
        // Read only when a close is found: the reaper polls this at every check-in.
        let mut now = None;
        let mut st = self.lock();
        if !st.idle_waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            st.idle_waker = Some(cx.waker().clone());
        }
        let mut i = 0;
        while i < st.idle.len() {
            if st.idle[i].conn.io.poll_closed(cx).is_ready() {
                let idle = st.idle.remove(i);
                let now = *now.get_or_insert_with(Instant::now);
                learned = learned.or(upstream_closed_idle(&mut st.learner, &idle, now));
                closed.push(idle);
            } else {
                i += 1;
            }
        }
        drop(st);
        drop(closed);
        self.log_learned(learned);
    }

    /// Logs a change of the learned upstream idle timeout, and has the reaper recompute the
    /// deadlines of the connections already idle, which it changes.
    fn log_learned(&self, change: Option<learn::Change>) {
        let Some(change) = change else { return };
        self.reaper_wake.notify_one();
        let show =
            |d: Option<Duration>| d.map_or_else(|| "none".to_owned(), |d| format!("{}ms", d.as_millis()));
        tracing::info!(
            upstream = %self.label,
            old = %show(change.old),
            new = %show(change.new),
            observations = change.support,
            "learned upstream idle timeout changed"
        );
    }
}

/// Marks an idle connection the upstream closed and feeds its idle age to the learner: this
/// close came from the upstream's side while no request was in flight, the only kind that
/// tells its idle timeout. A connection that never carried a request is not fed: servers often
/// time out a connection waiting for its first request sooner (nginx `client_header_timeout`,
/// Node's `headersTimeout`). Returns the change of the learned value, if any.
fn upstream_closed_idle(
    learner: &mut learn::IdleLearner,
    idle: &Idle,
    now: Instant,
) -> Option<learn::Change> {
    idle.conn.track.set("upstream_close");
    if idle.conn.track.requests() == 0 {
        return None;
    }
    learner.observe(now.saturating_duration_since(idle.since), now)
}

// === connection deadlines ===

fn past_lifetime(cfg: &PoolConfig, created: Instant, now: Instant) -> bool {
    cfg.max_lifetime
        .is_some_and(|life| now.saturating_duration_since(created) >= life)
}

/// When an idle HTTP/1.1 connection idle since `since` must close; `retire_after` is the
/// learned retirement age in force, if any.
fn idle_deadline(cfg: &PoolConfig, retire_after: Option<Duration>, conn: &Conn, since: Instant) -> Instant {
    let (idle_limit, _) = learn::idle_limit(cfg.idle_timeout, conn.idle_limit, retire_after);
    let by_idle = since + idle_limit;
    match cfg.max_lifetime {
        Some(life) => by_idle.min(conn.created + life),
        None => by_idle,
    }
}

/// Why an idle HTTP/1.1 connection past its deadline closes.
fn expiry_reason(
    cfg: &PoolConfig,
    retire_after: Option<Duration>,
    conn: &Conn,
    now: Instant,
) -> &'static str {
    if past_lifetime(cfg, conn.created, now) {
        "max_lifetime"
    } else if learn::idle_limit(cfg.idle_timeout, conn.idle_limit, retire_after).1 {
        "learned_idle_timeout"
    } else {
        "idle_timeout"
    }
}

impl H2Conn {
    /// Streams this connection may carry now.
    fn stream_limit(&self, max_streams: usize) -> usize {
        max_streams.min(self.server_max_streams.load(Ordering::Relaxed))
    }

    /// Whether this connection may take another stream; one past `max_lifetime` starts draining
    /// here, as a busy connection has no reaper deadline of its own.
    fn takes_streams(&mut self, cfg: &PoolConfig, max_streams: usize, now: Instant) -> bool {
        if past_lifetime(cfg, self.created, now) {
            self.track.set("max_lifetime");
            self.draining = true;
        }
        !self.draining && self.in_flight < self.stream_limit(max_streams)
    }

    fn grant_stream(&mut self) -> H2Stream {
        self.in_flight += 1;
        self.served += 1;
        H2Stream {
            sender: self.sender.clone(),
            conn_id: self.id,
            reused: self.served > 1,
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

// === impl Waiting ===

/// A request's place in the wait queue; leaving it (timeout, cancellation) removes it.
struct Waiting {
    pool: Arc<Pool>,
    id: u64,
    rx: Option<oneshot::Receiver<Result<Grant, ProxyError>>>,
}

impl Waiting {
    async fn wait(mut self, deadline: Instant) -> Result<Grant, ProxyError> {
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
            Some(Ok(Grant::H1(conn))) => self.pool.check_in(conn),
            Some(Ok(Grant::H2(stream))) => self.pool.stream_done(stream.conn_id),
            _ => {}
        }
    }
}

// === impl Slot ===

/// One place under `max_connections`, held by a dial and then by the connection's driver task.
pub struct Slot {
    pool: Arc<Pool>,
    track: Tracker,
    /// The connection's id within its pool, its key in the registry.
    id: u64,
}

impl Place for Slot {
    fn failed(&self) {
        self.track.set("error");
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
}

#[derive(Debug)]
enum LeaseKind {
    H1(Option<Conn>),
    H2(Option<H2Stream>),
}

impl Lease {
    fn new(pool: Arc<Pool>, kind: LeaseKind) -> Self {
        Lease { pool, kind }
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
    pub fn connection_id(&self) -> u64 {
        match &self.kind {
            LeaseKind::H1(conn) => conn.as_ref().map_or(0, |c| c.id),
            LeaseKind::H2(stream) => stream.as_ref().map_or(0, |s| s.conn_id),
        }
    }

    /// Sends a request and waits for the response head. On HTTP/1.1 the request's own task
    /// writes it and reads the response, taking only the body out of `req`: the rest stays for
    /// a retry. HTTP/2 takes the whole request, and hyper hands it back in the error when it
    /// was never sent.
    pub async fn send(
        &mut self,
        req: &mut http::Request<RequestBody>,
    ) -> Result<http::Response<UpstreamBody>, SendError> {
        match &mut self.kind {
            LeaseKind::H1(conn) => {
                let conn = conn.as_mut().expect("present until release");
                conn.track.count_request();
                if let Some(left) = conn.remaining_hint.as_mut() {
                    *left = left.saturating_sub(1);
                }
                let resp = conn.io.send(req).await.map_err(SendError::Http1)?;
                Ok(resp.map(UpstreamBody::Http1))
            }
            LeaseKind::H2(stream) => {
                let stream = stream.as_mut().expect("present until release");
                let req = std::mem::replace(req, http::Request::new(RequestBody::Empty));
                let resp = stream
                    .sender
                    .try_send_request(req)
                    .await
                    .map_err(|e| SendError::Http2(Box::new(e)))?;
                Ok(resp.map(UpstreamBody::Http2))
            }
        }
    }

    /// Reads a response body from [`Lease::send`] to its end on this lease. The proxy streams
    /// bodies through [`PooledBody`] instead; this is for tests and benches of the pool.
    #[cfg(any(test, feature = "test-support"))]
    pub async fn read_to_end(&mut self, body: UpstreamBody) -> Result<u64, crate::wire::BoxError> {
        use http_body::Body as _;
        let mut body = body;
        let mut read = 0;
        loop {
            let frame = std::future::poll_fn(|cx| match &mut body {
                UpstreamBody::Http2(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
                UpstreamBody::Http1(transfer) => match self.h1_mut() {
                    Some(conn) => transfer.poll_frame(conn, cx).map_err(Into::into),
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
    fn h1_mut(&mut self) -> Option<&mut h1::Connection> {
        match &mut self.kind {
            LeaseKind::H1(Some(conn)) => Some(&mut conn.io),
            _ => None,
        }
    }

    /// The upstream said GOAWAY on this HTTP/2 connection: no new streams on it.
    pub fn mark_draining(&self) {
        if let LeaseKind::H2(Some(stream)) = &self.kind {
            self.pool.drain_h2(stream.conn_id);
        }
    }

    /// Reads the upstream's intent for an HTTP/1.1 connection from a response head.
    pub fn observe_response(&mut self, version: http::Version, headers: &http::HeaderMap) {
        let LeaseKind::H1(Some(conn)) = &mut self.kind else {
            return;
        };
        let mut close = version < http::Version::HTTP_11;
        for value in headers.get_all(http::header::CONNECTION) {
            for token in value.to_str().unwrap_or("").split(',') {
                match token.trim() {
                    t if t.eq_ignore_ascii_case("close") => close = true,
                    t if t.eq_ignore_ascii_case("keep-alive") => close = false,
                    _ => {}
                }
            }
        }
        conn.retire |= close;
        if let Some(hint) = headers.get("keep-alive").and_then(|v| v.to_str().ok()) {
            let (timeout, max) = parse_keep_alive(hint);
            if let Some(timeout) = timeout {
                // Retire before the upstream's own timer fires: reusing a connection in its last
                // moments races the upstream's close.
                let margin = Duration::from_secs(1).min(timeout / 2);
                conn.idle_limit = Some(timeout - margin);
            }
            if let Some(max) = max {
                conn.remaining_hint = Some(max);
            }
        }
    }

    /// Gives the connection (or stream slot) back after its exchange completed (response body
    /// fully read).
    pub fn release(mut self) {
        match &mut self.kind {
            LeaseKind::H1(conn) => {
                if let Some(conn) = conn.take() {
                    self.pool.check_in(conn);
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

/// Parses `Keep-Alive: timeout=5, max=100`.
fn parse_keep_alive(value: &str) -> (Option<Duration>, Option<u64>) {
    let mut timeout = None;
    let mut max = None;
    for param in value.split(',') {
        let Some((name, val)) = param.split_once('=') else {
            continue;
        };
        let val = val.trim().trim_matches('"');
        match name.trim().to_ascii_lowercase().as_str() {
            "timeout" => timeout = val.parse::<u64>().ok().map(Duration::from_secs),
            "max" => max = val.parse::<u64>().ok(),
            _ => {}
        }
    }
    (timeout, max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_hint() {
        assert_eq!(
            parse_keep_alive("timeout=5, max=100"),
            (Some(Duration::from_secs(5)), Some(100))
        );
        assert_eq!(parse_keep_alive("max=3"), (None, Some(3)));
        assert_eq!(parse_keep_alive("garbage"), (None, None));
    }
}

#[cfg(test)]
mod pool_tests;
