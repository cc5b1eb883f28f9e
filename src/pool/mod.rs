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
//! - `streams`: HTTP/2 connections, each carrying up to min(`http2.max_streams_per_connection`, the
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
//! A connection checked out idle may be closed by the upstream at the same instant. HTTP/1.1
//! sockets idle for `idle::WATCH_AFTER` (200 ms) carry the reaper's waker, so a close that
//! arrives is noticed at once (a younger one when the reaper starts watching), and checkout
//! looks at the socket before handing one out; the remaining window (the upstream's FIN in
//! flight while the request is written) is closed by the retry in `upstream`, and avoided
//! altogether once the upstream's idle timeout is learned.
//!
//! # Learned upstream idle timeouts
//! Most upstreams close idle keep-alive connections after a timeout of their own and do not
//! announce it. The pool learns it from the idle age of every HTTP/1.1 connection the upstream
//! closes while the connection sits idle in the pool (noticed at once by the reaper's waker on
//! the socket, there from 200 ms of idleness on, or by checkout looking before it hands one
//! out), and from nothing else: not closes the pool decides, not connections closed after a
//! response with `Connection: close` (closed at check-in, never idle), not connections that
//! fail while carrying a request. After [`learn::AGREE`] closes at agreeing idle ages (each at
//! least [`learn::MIN_AGE`]), idle connections are retired a margin (max(250 ms, 10 %)) before
//! that age, counted as `learned_idle_timeout`; the smallest of `idle_timeout`, the `Keep-Alive` hint and the
//! learned age wins. The learned value lapses 10 minutes after the last close supporting it, so
//! an upstream that raised its timeout is followed; [`learn`] has the whole rule. It is
//! exported as `egress_upstream_learned_idle_timeout_seconds` and in `/debug/pools`, and logged
//! at info when it changes. It lives and dies with the pool: a reload that keeps the pool
//! keeps it. HTTP/2 is not covered: a server closing an idle HTTP/2 connection sends GOAWAY
//! first, and a stream that crosses it comes back unsent and is retried whatever its method.

mod body;
mod idle;
mod streams;
// Tests and benches of the pool only; `test-support` lets benches/pool.rs reach it.
#[cfg(any(test, feature = "test-support"))]
pub mod in_memory;
pub mod learn;
mod lease;
mod registry;
mod report;

use std::collections::BTreeMap;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

pub use body::{PooledBody, SendError, ServedBy, UpstreamBody};
pub use idle::Conn;
pub use lease::{Lease, Slot, Tracker};
pub use registry::Registry;
pub use report::{ConnectionReport, PoolReport, PoolSnapshot};
pub use streams::H2Stream;

use crate::config::PoolConfig;
use crate::connector::{Connect, Dialed};
use crate::endpoint::{self, Endpoint};
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::UpstreamMetrics;
use idle::{idle_deadline, set_aside, Idle};
use lease::{LeaseKind, Waiting};
use streams::H2Conn;

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

/// What a request is given: an HTTP/1.1 connection of its own, or a stream slot.
#[derive(Debug)]
enum Grant {
    H1(Box<Conn>),
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
    /// Inlined: every check-in asks, and the count is only needed after a reload.
    #[inline]
    fn over_cap(&self) -> usize {
        if self.open <= self.config.max_connections {
            return 0;
        }
        self.over_cap_counted()
    }

    #[cold]
    #[inline(never)]
    fn over_cap_counted(&self) -> usize {
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
    /// The upstream's endpoints, which the connector dials and this pool reports.
    endpoints: Arc<endpoint::Set>,
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
        endpoints: Arc<endpoint::Set>,
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
            conns: BTreeMap::new(),
            next_conn_id: 0,
            config,
            max_streams,
            retired: None,
            learner: learn::IdleLearner::default(),
        };
        let pool = Arc::new(Pool {
            label,
            connector,
            endpoints,
            metrics,
            state: Mutex::new(state),
            reaper_wake: Notify::new(),
            stats: Stats::default(),
        });
        let weak = Arc::downgrade(&pool);
        pool.endpoints.on_drain(Box::new(move || {
            if let Some(pool) = weak.upgrade() {
                pool.drain_removed();
            }
        }));
        pool
    }

    /// The upstream's endpoints.
    pub fn endpoints(&self) -> &Arc<endpoint::Set> {
        &self.endpoints
    }

    /// The pool's settings now in force.
    pub fn config(&self) -> PoolConfig {
        self.lock().config
    }

    /// Connections dialing, in use or idle.
    pub fn open_connections(&self) -> usize {
        self.lock().open
    }

    /// What the pool learned of its upstream's idle timeout, taken (the pool starts learning
    /// afresh), if anything: what a host met on the fly keeps once its upstream is let go.
    pub fn take_learning(&self) -> Option<learn::IdleLearner> {
        let mut st = self.lock();
        (!st.learner.is_empty()).then(|| std::mem::take(&mut st.learner))
    }

    /// Learning carried over from the pool an on-the-fly upstream had before it was let go.
    pub fn resume_learning(&self, learner: learn::IdleLearner) {
        self.lock().learner = learner;
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

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panic in another holder: every critical section
        // is a few field updates with no user code inside.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn error(&self, kind: ErrorKind, cause: impl Into<String>) -> ProxyError {
        ProxyError::new(kind, cause).with_upstream(&*self.label)
    }

    /// Waits for a ready connection (or HTTP/2 stream slot): an idle one, a freed one, or a new
    /// one. Tests and benches only: the request path checks out through
    /// [`Pool::checkout_avoiding`].
    #[cfg(any(test, feature = "test-support"))]
    pub async fn checkout(self: &Arc<Self>) -> Result<Lease, ProxyError> {
        self.checkout_avoiding(None).await
    }

    /// Waits for a ready connection (or HTTP/2 stream slot): an idle one, a freed one, or a new
    /// one. For a retry, away from `avoid` (the endpoint that just failed the request): an idle
    /// connection or stream to another endpoint when there is one; else, while the cap allows
    /// and the set has other endpoints, a new connection (which the balance sends to the least
    /// loaded, and `avoid` counts the connection just used).
    pub async fn checkout_avoiding(
        self: &Arc<Self>,
        avoid: Option<&Arc<Endpoint>>,
    ) -> Result<Lease, ProxyError> {
        let started = Instant::now();
        let lease = self.checkout_inner(started, avoid).await?;
        // Most checkouts are granted at once, and then at `started`: no clock arithmetic
        // (37 instructions a subtraction, in callgrind).
        let granted = lease.granted();
        let waited = if granted == started {
            std::time::Duration::ZERO
        } else {
            granted.saturating_duration_since(started)
        };
        self.metrics.wait.observe(waited);
        if lease.is_reused() {
            self.metrics.reused.inc();
        }
        Ok(lease)
    }

    async fn checkout_inner(
        self: &Arc<Self>,
        started: Instant,
        avoid: Option<&Arc<Endpoint>>,
    ) -> Result<Lease, ProxyError> {
        // Only worth the set's lock when there is somewhere else to go.
        let avoid = avoid.filter(|_| self.endpoints.counts().active > 1);
        let (grant, granted) = match self.take_or_enqueue(avoid, started)? {
            Ok(grant) => (grant, started),
            Err(waiting) => {
                crate::rare::branch();
                // Read only for a wait: the pool's lock again, for every checkout.
                let deadline = started + self.config().pending_timeout;
                let grant = waiting.wait(deadline).await?;
                (grant, Instant::now())
            }
        };
        let (reused, kind) = match grant {
            Grant::H2(stream) => (stream.reused, LeaseKind::H2(Some(stream))),
            Grant::H1(conn) => (conn.track.requests() > 0, LeaseKind::H1(Some(conn))),
        };
        if reused {
            self.stats.reused.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Lease::new(self.clone(), kind, granted))
    }

    /// The fast path (a free HTTP/2 stream or a usable idle connection, no one waiting) or a
    /// place in the queue. `now`: when the checkout started (a clock read per request saved).
    ///
    /// The idle connections found unusable and the queue are out of line (`#[cold]`): inlined
    /// here, their code sat between the fast path's instructions in the request path's hot
    /// cache lines, which a build without a profile cannot tell apart (benches/RESULTS.md,
    /// sixteenth session).
    #[allow(clippy::type_complexity)]
    fn take_or_enqueue(
        self: &Arc<Self>,
        avoid: Option<&Arc<Endpoint>>,
        now: Instant,
    ) -> Result<Result<Grant, Waiting>, ProxyError> {
        let mut discard = Vec::new();
        let mut learned = None;
        let mut st = self.lock();
        if st.waiters.is_empty() {
            if let Some(stream) = self.take_stream(&mut st, avoid, now) {
                return Ok(Ok(Grant::H2(stream)));
            }
            let retire_after = st.learner.retire_after(now);
            if let Some(avoid) = avoid {
                if let Some(conn) = self.take_idle_elsewhere(&mut st, avoid, retire_after, now) {
                    return Ok(Ok(Grant::H1(conn)));
                }
            }
            // Past the idle ones to `avoid`: a new connection goes elsewhere.
            let dial_instead = avoid.is_some() && st.open < st.config.max_connections;
            while let Some(mut idle) = (!dial_instead).then(|| st.idle.pop()).flatten() {
                let closed = idle.conn.io.is_closed();
                let removed = idle.conn.track.endpoint_removed();
                if !closed
                    && !removed
                    && now < idle_deadline(&st.config, retire_after, &idle.conn, idle.since)
                {
                    drop(st);
                    self.log_learned(learned);
                    return Ok(Ok(Grant::H1(idle.conn)));
                }
                set_aside(
                    &mut st,
                    idle,
                    closed,
                    removed,
                    retire_after,
                    now,
                    &mut learned,
                    &mut discard,
                );
            }
        }
        self.enqueue(st, discard, learned)
    }

    /// A place in the queue, and the dials it may start; or the pool's overflow refusal.
    #[cold]
    #[inline(never)]
    #[allow(clippy::type_complexity)]
    fn enqueue(
        self: &Arc<Self>,
        mut st: MutexGuard<'_, State>,
        discard: Vec<Idle>,
        learned: Option<learn::Change>,
    ) -> Result<Result<Grant, Waiting>, ProxyError> {
        // `max_pending` bounds requests waiting for capacity; a request a new dial will serve
        // is not over the limit (so `max_pending: 0` still lets the pool grow to its cap).
        let established = st.open - st.connecting;
        let dialable = st.config.max_connections.saturating_sub(established);
        let max_pending = st.config.max_pending;
        if st.waiters.len() >= max_pending + dialable {
            drop(st);
            drop(discard);
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

    /// A usable idle connection to an endpoint other than `avoid`, if the pool has one.
    fn take_idle_elsewhere(
        &self,
        st: &mut State,
        avoid: &Arc<Endpoint>,
        retire_after: Option<std::time::Duration>,
        now: Instant,
    ) -> Option<Box<Conn>> {
        let index = st.idle.iter_mut().rposition(|idle| {
            let elsewhere = idle.conn.track.endpoint().is_some_and(|e| !Arc::ptr_eq(e, avoid));
            elsewhere
                && !idle.conn.track.endpoint_removed()
                && now < idle_deadline(&st.config, retire_after, &idle.conn, idle.since)
                && !idle.conn.io.is_closed()
        })?;
        Some(st.idle.remove(index).conn)
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
                claim: std::sync::OnceLock::new(),
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
                let conn = Box::new(Conn {
                    io,
                    track,
                    id,
                    created: now,
                    idle_limit: None,
                    remaining_hint: None,
                    retire: false,
                });
                let closing = self.hand_over(&mut st, conn, Some(now));
                // Requests that arrived while every allowed dial was in flight still wait.
                self.start_dials(&mut st);
                drop(st);
                drop(closing);
            }
            Ok(Dialed::Http2(sender)) => {
                let conn = H2Conn {
                    sender,
                    track,
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
}

// Here, not in idle.rs or streams.rs: both kinds of connection close at `max_lifetime`.
fn past_lifetime(cfg: &PoolConfig, created: Instant, now: Instant) -> bool {
    // The end compared, not the age: subtracting two instants normalises a `Duration`, 37
    // instructions at every check-in (callgrind), adding one is a third of that.
    cfg.max_lifetime
        .is_some_and(|life| created.checked_add(life).is_some_and(|end| now >= end))
}

#[cfg(test)]
mod pool_tests;
