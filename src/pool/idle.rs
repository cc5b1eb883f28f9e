//! HTTP/1.1 connections between requests: check-in and hand-over to the oldest waiter, the
//! idle list, the deadlines that close idle connections, the reaper task that enforces them
//! (HTTP/2 ones too) and hears upstream closes, and the upstream's `Keep-Alive` hints.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use super::{learn, past_lifetime, Grant, Pool, State, Tracker};
use crate::config::PoolConfig;
use crate::connector::h1;

/// Idle connections beyond `max_idle` are closed once idle this long, rather than at once: under
/// steady load the idle count swings past `max_idle` for microseconds as requests complete
/// together, and closing then would churn connections (HAProxy's `pool-purge-delay` idea).
pub(super) const IDLE_SURPLUS_GRACE: Duration = Duration::from_secs(1);

/// An idle HTTP/1.1 connection carries the reaper's waker, which hears the upstream close it,
/// once it has been idle this long. Under load a connection is idle for microseconds between
/// requests, and registering the waker at every check-in cost a lock and a waker swap on the
/// socket, 165 instructions per request (callgrind); the reaper now wakes once per this span
/// instead. A close in the first moments of idleness is still seen: by checkout, which looks
/// at the socket's readiness before it hands the connection out, or by the reaper when it
/// starts watching. Below [`learn::MIN_AGE`]: a close noticed late was at an idle age the
/// learner does not take, and every close at an age it takes is noticed at once.
pub(super) const WATCH_AFTER: Duration = Duration::from_millis(200);

/// An upstream connection with its bookkeeping.
///
/// Boxed wherever it goes (the idle list, a grant, a lease), once, when it is dialed. An
/// exchange moves it a dozen times, out of the idle list, through the checkout into its lease
/// and the response body, and back, and at 208 bytes each move was a `memcpy` call: twelve
/// per request (callgrind), in the part of user time that ran slowest per instruction.
#[derive(Debug)]
pub struct Conn {
    pub(super) io: h1::Connection,
    pub(super) track: Tracker,
    pub(super) id: u64,
    pub(super) created: Instant,
    /// From the upstream's `Keep-Alive: timeout=N`, less a margin.
    pub(super) idle_limit: Option<Duration>,
    /// From the upstream's `Keep-Alive: max=N`: requests this connection may still serve.
    pub(super) remaining_hint: Option<u64>,
    pub(super) retire: bool,
}

impl Conn {
    /// Takes the upstream's intent for this connection from the response head it just read.
    pub(super) fn observe_response(&mut self) {
        let persistence = self.io.transfer().persistence();
        self.retire |= persistence.close;
        if let Some(timeout) = advertised_idle(persistence.timeout_secs) {
            // Retire before the upstream's own timer fires: reusing a connection in its last
            // moments races the upstream's close.
            let margin = Duration::from_secs(1).min(timeout / 2);
            self.idle_limit = Some(timeout - margin);
        }
        if let Some(max) = persistence.max {
            self.remaining_hint = Some(max.into());
        }
    }
}

/// An upstream's `Keep-Alive: timeout=N`, as a duration: past `duration::LONGEST`
/// (`timeout=99999999999` saturates at u32::MAX seconds, 136 years) it is no timeout an
/// upstream means, and is ignored.
fn advertised_idle(timeout_secs: Option<u32>) -> Option<Duration> {
    timeout_secs.and_then(|secs| crate::duration::bounded(Duration::from_secs(secs.into())).ok())
}

pub(super) struct Idle {
    pub(super) conn: Box<Conn>,
    pub(super) since: Instant,
    /// The reaper's waker is on its socket ([`WATCH_AFTER`]).
    pub(super) watched: bool,
}

impl Idle {
    /// When the reaper starts watching it, if it does not yet.
    fn watch_from(&self) -> Option<Instant> {
        (!self.watched).then(|| self.since + WATCH_AFTER)
    }
}

impl Pool {
    /// Gives a ready connection to the oldest live waiter, else keeps it idle; returns it when
    /// it is to be closed, which the caller does after unlocking `st` (closing frees its slot,
    /// which takes the lock).
    ///
    /// `now`, when the caller has read the clock already: the time it goes idle.
    #[must_use]
    pub(super) fn hand_over(
        self: &Arc<Self>,
        st: &mut State,
        mut conn: Box<Conn>,
        now: Option<Instant>,
    ) -> Option<Box<Conn>> {
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
        let now = now.unwrap_or_else(Instant::now);
        let idle = Idle {
            conn,
            since: now,
            watched: false,
        };
        let mut deadline = idle_deadline(&st.config, st.learner.retire_after(now), &idle.conn, now);
        deadline = deadline.min(now + WATCH_AFTER);
        st.idle.push(idle);
        if st.idle.len() > st.config.max_idle {
            deadline = deadline.min(st.idle[0].since + IDLE_SURPLUS_GRACE);
        }
        self.schedule_reaper(st, deadline);
        None
    }

    /// Makes sure the reaper wakes by `deadline`. Inlined for the common case, a reaper that
    /// runs and will wake by then already (every check-in asks).
    #[inline]
    pub(super) fn schedule_reaper(self: &Arc<Self>, st: &mut State, deadline: Instant) {
        if st.reaper_running && st.reaper_deadline.is_some_and(|d| d <= deadline) {
            return;
        }
        self.wake_reaper_by(st, deadline);
    }

    #[inline(never)]
    fn wake_reaper_by(self: &Arc<Self>, st: &mut State, deadline: Instant) {
        if !st.reaper_running {
            st.reaper_running = true;
            st.reaper_deadline = Some(deadline);
            tokio::spawn(reap(self.clone()));
        } else if st.reaper_deadline.is_none_or(|d| deadline < d) {
            st.reaper_deadline = Some(deadline);
            self.reaper_wake.notify_one();
        }
    }

    /// Returns a connection whose exchange completed; `now`, if the caller has read the clock
    /// as it did.
    pub(super) fn check_in(self: &Arc<Self>, conn: Box<Conn>, now: Option<Instant>) {
        // Read once at most, for the lifetime check and as the time the connection goes idle.
        let mut now = now;
        let mut st = self.lock();
        let cfg = st.config;
        let spent = cfg
            .max_requests_per_connection
            .is_some_and(|max| conn.track.requests() >= max)
            || conn.remaining_hint == Some(0);
        let reason = if conn.retire || !conn.io.is_reusable() {
            Some("upstream_close")
        } else if conn.track.endpoint_removed() {
            Some("endpoint_removed")
        } else if spent {
            Some("max_requests")
        // The clock is read only when a lifetime is set: most pools have none.
        } else if cfg.max_lifetime.is_some()
            && past_lifetime(&cfg, conn.created, *now.get_or_insert_with(Instant::now))
        {
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
                let closing = self.hand_over(&mut st, conn, now);
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
                let mut deadline = idle_deadline(&cfg, retire_after, &idle.conn, idle.since);
                if i < surplus {
                    deadline = deadline.min(idle.since + IDLE_SURPLUS_GRACE);
                }
                // One due now is watched as the reaper next waits (`watch_idle`).
                match idle.watch_from() {
                    Some(watch) if watch > now => deadline.min(watch),
                    _ => deadline,
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
        }
        drop(st);
        drop(expired);
        self.log_learned(learned);
        next
    }

    /// Closes the idle connections to endpoints that left the DNS answer, and stops new streams
    /// on HTTP/2 ones (closed when their last stream ends); busy HTTP/1.1 ones close at check-in.
    pub(super) fn drain_removed(&self) {
        let mut st = self.lock();
        let (removed, kept): (Vec<Idle>, Vec<Idle>) = std::mem::take(&mut st.idle)
            .into_iter()
            .partition(|idle| idle.conn.track.endpoint_removed());
        st.idle = kept;
        for idle in &removed {
            idle.conn.track.set("endpoint_removed");
        }
        let mut closing = Vec::new();
        for mut conn in std::mem::take(&mut st.h2) {
            if conn.track.endpoint_removed() {
                conn.track.set("endpoint_removed");
                conn.draining = true;
                if conn.in_flight == 0 {
                    closing.push(conn);
                    continue;
                }
            }
            st.h2.push(conn);
        }
        drop(st);
        drop(removed);
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
    /// Registers the reaper's waker on every HTTP/1.1 connection idle for [`WATCH_AFTER`] and
    /// closes those the upstream closed. Only readable sockets cost a syscall.
    fn watch_idle(&self, cx: &mut Context<'_>) {
        let mut closed = Vec::new();
        let mut learned = None;
        // Read when needed: most polls find every idle connection watched and none closed.
        let mut now = None;
        let mut st = self.lock();
        let mut i = 0;
        while i < st.idle.len() {
            let idle = &mut st.idle[i];
            if let Some(watch) = idle.watch_from() {
                if watch > *now.get_or_insert_with(Instant::now) {
                    i += 1;
                    continue;
                }
            }
            idle.watched = true;
            if idle.conn.io.poll_closed(cx).is_ready() {
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
    pub(super) fn log_learned(&self, change: Option<learn::Change>) {
        if let Some(change) = change {
            self.log_change(change);
        }
    }

    #[cold]
    fn log_change(&self, change: learn::Change) {
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

/// An idle connection a checkout found unusable (`closed` by the upstream, its endpoint
/// `removed`, or past its deadline), marked with why and put in `discard`, to close once the
/// pool's lock is released; what the learner learned from it goes in `learned`.
#[cold]
#[allow(clippy::too_many_arguments)]
pub(super) fn set_aside(
    st: &mut super::State,
    idle: Idle,
    closed: bool,
    removed: bool,
    retire_after: Option<Duration>,
    now: Instant,
    learned: &mut Option<learn::Change>,
    discard: &mut Vec<Idle>,
) {
    if closed {
        *learned = learned
            .take()
            .or(upstream_closed_idle(&mut st.learner, &idle, now));
    } else if removed {
        idle.conn.track.set("endpoint_removed");
    } else {
        idle.conn
            .track
            .set(expiry_reason(&st.config, retire_after, &idle.conn, now));
    }
    discard.push(idle);
}

/// Marks an idle connection the upstream closed and feeds its idle age to the learner: this
/// close came from the upstream's side while no request was in flight, the only kind that
/// tells its idle timeout. A connection that never carried a request is not fed: servers often
/// time out a connection waiting for its first request sooner (nginx `client_header_timeout`,
/// Node's `headersTimeout`). Returns the change of the learned value, if any.
pub(super) fn upstream_closed_idle(
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

/// When an idle HTTP/1.1 connection idle since `since` must close; `retire_after` is the
/// learned retirement age in force, if any.
pub(super) fn idle_deadline(
    cfg: &PoolConfig,
    retire_after: Option<Duration>,
    conn: &Conn,
    since: Instant,
) -> Instant {
    let (idle_limit, _) = learn::idle_limit(cfg.idle_timeout, conn.idle_limit, retire_after);
    let by_idle = since + idle_limit;
    match cfg.max_lifetime {
        Some(life) => by_idle.min(conn.created + life),
        None => by_idle,
    }
}

/// Why an idle HTTP/1.1 connection past its deadline closes.
pub(super) fn expiry_reason(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advertised_idle_timeout_past_the_bound_is_ignored() {
        assert_eq!(advertised_idle(Some(5)), Some(Duration::from_secs(5)));
        assert_eq!(
            advertised_idle(Some(365 * 24 * 3600)),
            Some(crate::duration::LONGEST)
        );
        assert_eq!(advertised_idle(Some(365 * 24 * 3600 + 1)), None);
        assert_eq!(advertised_idle(Some(u32::MAX)), None);
        assert_eq!(advertised_idle(None), None);
    }
}
