//! The per-upstream HTTP/1.1 connection pool: a hard cap, a FIFO wait queue, MRU reuse.
//!
//! hyper-util's pool has no connection cap and no queue, so this one is ours. One [`Pool`] per
//! upstream holds:
//! - `open`: connections dialing, in use or idle. It never exceeds `max_connections`. A
//!   connection counts until its socket is closed: the [`Slot`] guard travels from the dial
//!   into the connection's driver task and gives the place back when that task ends.
//! - `idle`: connections ready for a request, most recently used last (checked out first),
//!   each closed after `idle_timeout` (sooner when the upstream's `Keep-Alive: timeout=N` says
//!   so) or, once idle, after `max_lifetime`. Beyond `max_idle`, the oldest idle connections are
//!   closed after a one-second grace, so that load hovering around `max_idle` does not churn.
//! - `waiters`: requests waiting for a connection, oldest first, at most `max_pending`, each for
//!   at most `pending_timeout`. A connection that finishes a request goes straight to the oldest
//!   waiter; so does a freshly dialed one.
//!
//! Dials are decoupled from requests: a dial is started only while more requests wait than dials
//! are in flight, never more than `max_connecting` at once, and its connection serves whoever is
//! oldest in the queue when it is ready. A burst of N requests therefore opens at most
//! `min(N, max_connections)` connections, `max_connecting` at a time, and a connection that
//! frees up first serves the burst before the dial finishes (no dial storm).
//!
//! Not handled here: how a connection is dialed ([`crate::upstream::dial`]), retries and
//! timeouts of a request on its connection ([`crate::upstream`]).
//!
//! # Race window
//! A connection checked out idle may be closed by the upstream at the same instant. Checkout
//! only hands out connections hyper reports open and ready; the remaining window (the upstream's
//! FIN in flight while the request is written) is closed by the retry in `upstream`.

mod body;

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hyper::client::conn::http1::SendRequest;
use tokio::sync::{oneshot, Notify};
use tokio::time::Instant;

pub use body::PooledBody;

use crate::config::PoolConfig;
use crate::downstream::RequestBody;
use crate::error::{ErrorKind, ProxyError};

/// Idle connections beyond `max_idle` are closed once idle this long, rather than at once: under
/// steady load the idle count swings past `max_idle` for microseconds as requests complete
/// together, and closing then would churn connections (HAProxy's `pool-purge-delay` idea).
const IDLE_SURPLUS_GRACE: Duration = Duration::from_secs(1);

/// The request handle of one upstream HTTP/1.1 connection.
pub type Sender = SendRequest<RequestBody>;

/// Dials a new connection for a pool; the `Slot` must live as long as the connection's socket.
pub trait Connect: Send + Sync + fmt::Debug + 'static {
    /// Opens a connection and spawns its driver task holding `slot`.
    fn connect(&self, slot: Slot) -> Pin<Box<dyn Future<Output = Result<Sender, ProxyError>> + Send + '_>>;
}

/// An upstream connection with its bookkeeping.
#[derive(Debug)]
pub struct Conn {
    sender: Sender,
    id: u64,
    created: Instant,
    requests: u64,
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

struct Waiter {
    id: u64,
    tx: oneshot::Sender<Result<Conn, ProxyError>>,
}

#[derive(Default)]
struct State {
    /// Oldest first; `pop()` yields the most recently used.
    idle: Vec<Idle>,
    open: usize,
    connecting: usize,
    waiters: VecDeque<Waiter>,
    next_waiter: u64,
    reaper_running: bool,
    reaper_deadline: Option<Instant>,
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
    config: PoolConfig,
    connector: Box<dyn Connect>,
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
    /// Idle connections.
    pub idle: usize,
    /// Dials in flight.
    pub connecting: usize,
    /// Requests waiting.
    pub pending: usize,
    /// Connections opened since start.
    pub opened_total: u64,
    /// Requests that reused a connection.
    pub reused_total: u64,
}

// === impl Pool ===

impl Pool {
    /// A pool for the upstream labelled `label`.
    pub fn new(label: Arc<str>, config: PoolConfig, connector: Box<dyn Connect>) -> Arc<Self> {
        Arc::new(Pool {
            label,
            config,
            connector,
            state: Mutex::new(State::default()),
            reaper_wake: Notify::new(),
            stats: Stats::default(),
        })
    }

    /// The pool's settings.
    pub fn config(&self) -> &PoolConfig {
        &self.config
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
            connecting: st.connecting,
            pending: st.waiters.len(),
            opened_total: self.stats.opened.load(Ordering::Relaxed),
            reused_total: self.stats.reused.load(Ordering::Relaxed),
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

    /// Waits for a ready connection: an idle one, a freed one, or a new one.
    pub async fn checkout(self: &Arc<Self>) -> Result<Lease, ProxyError> {
        let deadline = Instant::now() + self.config.pending_timeout;
        loop {
            let conn = match self.take_idle_or_enqueue()? {
                Ok(conn) => conn,
                Err(waiting) => waiting.wait(deadline).await?,
            };
            if let Some(conn) = Self::ensure_ready(conn).await {
                if conn.requests > 0 {
                    self.stats.reused.fetch_add(1, Ordering::Relaxed);
                }
                return Ok(Lease {
                    pool: self.clone(),
                    conn: Some(conn),
                });
            }
            // The connection died between check-in and now; nothing was sent on it.
        }
    }

    /// The fast path (a usable idle connection, no one waiting) or a place in the queue.
    #[allow(clippy::type_complexity)]
    fn take_idle_or_enqueue(self: &Arc<Self>) -> Result<Result<Conn, Waiting>, ProxyError> {
        let mut discard = Vec::new();
        let now = Instant::now();
        let mut st = self.lock();
        if st.waiters.is_empty() {
            while let Some(idle) = st.idle.pop() {
                if self.is_usable(&idle, now) {
                    return Ok(Ok(idle.conn));
                }
                discard.push(idle);
            }
        }
        if st.waiters.len() >= self.config.max_pending {
            drop(st);
            return Err(self.error(
                ErrorKind::PoolOverflow,
                format!(
                    "{} requests already wait for a connection (max_pending)",
                    self.config.max_pending
                ),
            ));
        }
        let (tx, rx) = oneshot::channel();
        let id = st.next_waiter;
        st.next_waiter += 1;
        st.waiters.push_back(Waiter { id, tx });
        self.start_dials(&mut st);
        drop(st);
        drop(discard);
        Ok(Err(Waiting {
            pool: self.clone(),
            id,
            rx: Some(rx),
        }))
    }

    async fn ensure_ready(mut conn: Conn) -> Option<Conn> {
        if conn.sender.is_ready() {
            return Some(conn);
        }
        // Just checked in: hyper finishes reading the previous response in its own task.
        match conn.sender.ready().await {
            Ok(()) => Some(conn),
            Err(_) => None,
        }
    }

    fn is_usable(&self, idle: &Idle, now: Instant) -> bool {
        let conn = &idle.conn;
        if conn.sender.is_closed() {
            return false;
        }
        let idle_for = now.saturating_duration_since(idle.since);
        let idle_limit = conn.idle_limit.map_or(self.config.idle_timeout, |hint| {
            hint.min(self.config.idle_timeout)
        });
        if idle_for >= idle_limit {
            return false;
        }
        !self.past_lifetime(conn, now)
    }

    fn past_lifetime(&self, conn: &Conn, now: Instant) -> bool {
        self.config
            .max_lifetime
            .is_some_and(|life| now.saturating_duration_since(conn.created) >= life)
    }

    /// Starts dials while more requests wait than dials are in flight, within both caps.
    fn start_dials(self: &Arc<Self>, st: &mut State) {
        while st.waiters.len() > st.connecting
            && st.open < self.config.max_connections
            && st.connecting < self.config.max_connecting
        {
            st.open += 1;
            st.connecting += 1;
            let slot = Slot { pool: self.clone() };
            let pool = self.clone();
            tokio::spawn(async move { pool.dial(slot).await });
        }
    }

    async fn dial(self: Arc<Self>, slot: Slot) {
        let result = self.connector.connect(slot).await;
        let mut failed = Vec::new();
        let mut st = self.lock();
        st.connecting -= 1;
        match result {
            Ok(sender) => {
                let id = self.stats.opened.fetch_add(1, Ordering::Relaxed) + 1;
                let conn = Conn {
                    sender,
                    id,
                    created: Instant::now(),
                    requests: 0,
                    idle_limit: None,
                    remaining_hint: None,
                    retire: false,
                };
                self.hand_over(&mut st, conn);
                // Requests that arrived while every allowed dial was in flight still wait.
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

    /// Gives a ready connection to the oldest live waiter, else keeps it idle.
    fn hand_over(self: &Arc<Self>, st: &mut State, mut conn: Conn) {
        while let Some(waiter) = st.waiters.pop_front() {
            match waiter.tx.send(Ok(conn)) {
                Ok(()) => return,
                Err(Ok(back)) => conn = back,
                Err(Err(_)) => unreachable!("sent Ok"),
            }
        }
        if self.config.max_idle == 0 {
            return;
        }
        let now = Instant::now();
        let mut deadline = self.idle_deadline(&conn, now);
        st.idle.push(Idle { conn, since: now });
        if st.idle.len() > self.config.max_idle {
            deadline = deadline.min(st.idle[0].since + IDLE_SURPLUS_GRACE);
        }
        if !st.reaper_running {
            st.reaper_running = true;
            st.reaper_deadline = Some(deadline);
            tokio::spawn(reap(self.clone()));
        } else if st.reaper_deadline.is_none_or(|d| deadline < d) {
            st.reaper_deadline = Some(deadline);
            self.reaper_wake.notify_one();
        }
    }

    fn idle_deadline(&self, conn: &Conn, since: Instant) -> Instant {
        let idle_limit = conn.idle_limit.map_or(self.config.idle_timeout, |hint| {
            hint.min(self.config.idle_timeout)
        });
        let by_idle = since + idle_limit;
        match self.config.max_lifetime {
            Some(life) => by_idle.min(conn.created + life),
            None => by_idle,
        }
    }

    /// Returns a connection whose exchange completed.
    fn check_in(self: &Arc<Self>, conn: Conn) {
        let spent = self
            .config
            .max_requests_per_connection
            .is_some_and(|max| conn.requests >= max)
            || conn.remaining_hint == Some(0);
        if conn.retire || spent || conn.sender.is_closed() || self.past_lifetime(&conn, Instant::now()) {
            return; // dropping the sender closes the connection; its slot frees when it is gone
        }
        let mut st = self.lock();
        self.hand_over(&mut st, conn);
    }

    /// Closes idle connections past their deadline, and the oldest idle connections beyond
    /// `max_idle` once they have been idle for [`IDLE_SURPLUS_GRACE`]; returns the next deadline.
    fn reap_once(&self, now: Instant) -> Option<Instant> {
        let mut expired = Vec::new();
        let mut st = self.lock();
        let max_idle = self.config.max_idle;
        let mut i = 0;
        while i < st.idle.len() {
            let idle = &st.idle[i];
            let surplus = i < st.idle.len().saturating_sub(max_idle);
            let expired_now = idle.conn.sender.is_closed()
                || self.idle_deadline(&idle.conn, idle.since) <= now
                || (surplus && idle.since + IDLE_SURPLUS_GRACE <= now);
            if expired_now {
                expired.push(st.idle.remove(i));
            } else {
                i += 1;
            }
        }
        let surplus = st.idle.len().saturating_sub(max_idle);
        let next = st
            .idle
            .iter()
            .enumerate()
            .map(|(i, idle)| {
                let deadline = self.idle_deadline(&idle.conn, idle.since);
                if i < surplus {
                    deadline.min(idle.since + IDLE_SURPLUS_GRACE)
                } else {
                    deadline
                }
            })
            .min();
        st.reaper_deadline = next;
        if next.is_none() {
            st.reaper_running = false;
        }
        drop(st);
        drop(expired);
        next
    }
}

/// Runs while the pool has idle connections, closing each at its deadline.
async fn reap(pool: Arc<Pool>) {
    loop {
        let Some(deadline) = pool.reap_once(Instant::now()) else {
            return;
        };
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {}
            _ = pool.reaper_wake.notified() => {}
        }
    }
}

// === impl Waiting ===

/// A request's place in the wait queue; leaving it (timeout, cancellation) removes it.
struct Waiting {
    pool: Arc<Pool>,
    id: u64,
    rx: Option<oneshot::Receiver<Result<Conn, ProxyError>>>,
}

impl Waiting {
    async fn wait(mut self, deadline: Instant) -> Result<Conn, ProxyError> {
        let rx = self.rx.as_mut().expect("present until drop");
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(result)) => {
                self.rx = None;
                result
            }
            Ok(Err(_)) => Err(self.pool.error(ErrorKind::PendingTimeout, "pool closed")),
            Err(_) => {
                // A connection may have been handed over in the instant the timer fired.
                if let Some(Ok(conn)) = self.leave() {
                    return Ok(conn);
                }
                Err(self.pool.error(
                    ErrorKind::PendingTimeout,
                    format!(
                        "no connection within pending_timeout ({}); {} of max_connections {} open",
                        humantime::format_duration(self.pool.config.pending_timeout),
                        self.pool.open_connections(),
                        self.pool.config.max_connections
                    ),
                ))
            }
        }
    }

    /// Leaves the queue; returns what was handed over before leaving, if anything.
    fn leave(&mut self) -> Option<Result<Conn, ProxyError>> {
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
        if let Some(Ok(conn)) = self.leave() {
            // Handed over to a request that went away: keep it for the next one.
            self.pool.check_in(conn);
        }
    }
}

// === impl Slot ===

/// One place under `max_connections`, held by a dial and then by the connection's driver task.
pub struct Slot {
    pool: Arc<Pool>,
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot").field("pool", &self.pool.label).finish()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.pool.lock();
        st.open -= 1;
        self.pool.start_dials(&mut st);
    }
}

// === impl Lease ===

/// A checked-out connection. Dropped without [`Lease::release`], its connection is closed.
#[derive(Debug)]
pub struct Lease {
    pool: Arc<Pool>,
    conn: Option<Conn>,
}

impl Lease {
    /// The connection's request handle.
    pub fn sender(&mut self) -> &mut Sender {
        &mut self.conn_mut().sender
    }

    /// Whether the connection served a request before this one.
    pub fn is_reused(&self) -> bool {
        self.conn().requests > 0
    }

    /// The connection's id within its pool (1 = first opened).
    pub fn connection_id(&self) -> u64 {
        self.conn().id
    }

    fn conn(&self) -> &Conn {
        self.conn.as_ref().expect("present until release")
    }

    fn conn_mut(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("present until release")
    }

    /// Counts a request sent on the connection.
    pub fn count_request(&mut self) {
        let conn = self.conn_mut();
        conn.requests += 1;
        if let Some(left) = conn.remaining_hint.as_mut() {
            *left = left.saturating_sub(1);
        }
    }

    /// Reads the upstream's intent for the connection from a response head.
    pub fn observe_response(&mut self, version: http::Version, headers: &http::HeaderMap) {
        let conn = self.conn_mut();
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

    /// Gives the connection back after its exchange completed (response body fully read).
    pub fn release(mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.check_in(conn);
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
