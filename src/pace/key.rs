//! One pace key's state: what its upstream last said is left and when it resets, the requests
//! in flight that the figure may not count yet, a `Retry-After` that closes it, and its queue
//! of waiting requests (by priority, then in order of arrival).
//!
//! The model is a window: up to the reset, at most the reported remaining goes, less the
//! requests in flight when the figure came (it lags them) and those sent since. A figure
//! within the same window only lowers what is left (a late answer carries an older, higher
//! count); one after the reset starts the next window. Past the reset with no figure yet, the
//! next window is predicted from the limit and the window's length seen so far, less the
//! requests still out (sent late in the last window, they may count in this one).
//!
//! Tokens: a request's cost is known only after its answer, when its usage is read
//! (`llm`). Before, each request that goes is charged the key's estimate, a moving average of
//! what its answers spent of the tokens the binding quota counts (input and output, or, for
//! Anthropic's separate limits, uncached input or output; 0 until the first is read), and
//! requests wait while what is left is under it (never more than the window's whole limit);
//! after, the difference between what the answer spent and what it was charged is taken from
//! (or given back to) what is left, and an answer whose usage is not read gives its charge
//! back. A figure the upstream reports within the window only lowers what is left, as for
//! requests.
//!
//! With `smooth`, what is left is released evenly until the reset: each request waits
//! `(reset - last) / (left + 1)` after the one before, so the window's requests are spread.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::task::Waker;
use std::time::Duration;

use tokio::time::Instant;

use super::report::{Counted, Quota, Report};
use super::{KeyId, KeyReport, Priority, RESET_GUARD, UNKNOWN_RESET};
use crate::config::PaceConfig;
use crate::llm::Tokens;
use crate::metrics::PaceMetrics;

/// One pace key.
#[derive(Debug)]
pub(super) struct Key {
    id: KeyId,
    /// Requests sent and not yet answered (their head).
    in_flight: AtomicU32,
    /// The upstream reported a tokens quota for this key: answers settle their tokens.
    counts_tokens: AtomicBool,
    state: Mutex<State>,
    metrics: PaceMetrics,
}

/// What admission decided for one request.
#[derive(Debug)]
pub(super) enum Verdict {
    /// Go now.
    Go,
    /// Wait at this place.
    Wait(Place),
    /// It cannot go before this reset, past its time to give up.
    Refuse(Instant),
}

/// A waiter's place in a key's queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    id: u64,
    class: Priority,
}

/// What a waiter's turn came to.
#[derive(Debug)]
pub(super) enum Turn {
    /// It goes now (counted as granted).
    Go,
    /// It cannot go before this reset, past its time to give up; it left the queue.
    Refused(Instant),
    /// Not yet: look again at this time, or when woken.
    Later(Instant),
}

/// When a key opens next and what holds it.
#[derive(Debug, Clone, Copy)]
struct Opens {
    /// When the next request may go.
    at: Instant,
    /// The reset that holds it, for `Retry-After`.
    reset: Instant,
    /// Only smoothing's spacing holds it: the quota has room.
    spacing: bool,
}

#[derive(Debug, Default)]
struct State {
    requests: Option<Window>,
    tokens: Option<Window>,
    /// Tokens an answer spends of those `counted`, as a moving average of those read; 0
    /// before the first.
    per_request: u64,
    /// Which tokens the tokens quota last reported counts.
    counted: Counted,
    /// A `Retry-After` holds every request until then.
    closed_until: Option<Instant>,
    /// When the last request was let go, for smoothing.
    last_go: Option<Instant>,
    queue: Queue,
}

/// What is known of one unit's window.
#[derive(Debug, Clone, Copy)]
struct Window {
    limit: Option<u64>,
    /// What may still go before `reset_at` (requests: less those in flight and sent since).
    left: i64,
    /// The last figure reported, for `/debug/pools` and the gauge.
    reported: u64,
    reset_at: Instant,
    /// No figure of this window yet: carried over from the last one.
    predicted: bool,
    /// The window's length, as far as seen: the longest reset reported, or the policy's `w`.
    span: Option<Duration>,
    /// `left` reached the reserve in this window (counted once in `egress_pace_closed_total`).
    exhausted: bool,
}

impl Window {
    /// The window as of `now`: past its reset (and the guard), the next one, predicted from
    /// the limit and length when both are known (less `out`, requests still in flight); `None`
    /// when nothing is known of it.
    fn current(self, now: Instant, out: u32) -> Option<Window> {
        if now < self.reset_at + RESET_GUARD {
            return Some(self);
        }
        let (limit, span) = (self.limit?, self.span.filter(|s| !s.is_zero())?);
        let behind = now.duration_since(self.reset_at + RESET_GUARD);
        // A window too short for the time since is forgotten, not wrapped.
        let periods = u32::try_from(behind.as_nanos() / span.as_nanos())
            .ok()?
            .checked_add(1)?;
        Some(Window {
            left: i64::try_from(limit).unwrap_or(i64::MAX) - i64::from(out),
            reported: limit,
            reset_at: self.reset_at + span * periods,
            predicted: true,
            exhausted: false,
            ..self
        })
    }
}

impl Key {
    pub(super) fn new(id: KeyId, metrics: PaceMetrics) -> Self {
        Key {
            id,
            in_flight: AtomicU32::new(0),
            counts_tokens: AtomicBool::new(false),
            state: Mutex::default(),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn out(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// A request of this key went upstream.
    pub(super) fn sent(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A request of this key had its answer (or failed).
    pub(super) fn returned(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Whether answers of this key settle what they spent in tokens.
    pub(super) fn counts_tokens(&self) -> bool {
        self.counts_tokens.load(Ordering::Relaxed)
    }

    /// A request of this key goes: it is charged the estimate of its tokens, which it
    /// returns.
    pub(super) fn charge(&self, now: Instant) -> u32 {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        let charged = u32::try_from(state.per_request).unwrap_or(u32::MAX);
        if let Some(w) = state.tokens.as_mut() {
            w.left = w.left.saturating_sub(i64::from(charged));
        }
        charged
    }

    /// An answer of this key, whose request was `charged`, spent `tokens`: the estimate moves
    /// towards what the quota counts of them, and what is left takes the difference.
    pub(super) fn spent(&self, tokens: &Tokens, charged: u32, now: Instant) {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        let counted = match state.counted {
            Counted::All => tokens.input.saturating_add(tokens.output),
            Counted::Input => tokens.input.saturating_sub(tokens.cache_read),
            Counted::Output => tokens.output,
        };
        let estimate = state.per_request;
        state.per_request = if estimate == 0 {
            counted
        } else {
            estimate.saturating_mul(3).saturating_add(counted) / 4
        };
        state.give_back(i64::from(charged).saturating_sub(i64::try_from(counted).unwrap_or(i64::MAX)));
    }

    /// A request of this key was `charged`, and its answer's usage was not read: the charge
    /// is given back, the estimate stays.
    pub(super) fn refund(&self, charged: u32, now: Instant) {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        state.give_back(i64::from(charged));
    }

    /// Whether a new request with `priority` goes now, waits, or is refused because it could
    /// not go before `give_up`.
    pub(super) fn admit(
        &self,
        now: Instant,
        config: &PaceConfig,
        priority: Priority,
        give_up: Instant,
    ) -> Verdict {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        if state.queue.is_empty() && state.open_for(now, config, give_up).is_ok() {
            self.go(&mut state, now, config);
            return Verdict::Go;
        }
        let ahead = state.queue.ahead_of(priority);
        if let Some(reset) = state
            .cannot_go_before(now, config, ahead)
            .filter(|at| *at > give_up)
        {
            return Verdict::Refuse(reset);
        }
        let place = state.queue.push(priority);
        Verdict::Wait(place)
    }

    /// The turn of the waiter at `place`: the first in the queue goes when the key opens; the
    /// others wait to be first. `waker` is woken when that may have changed.
    pub(super) fn turn(
        &self,
        place: Place,
        now: Instant,
        config: &PaceConfig,
        give_up: Instant,
        waker: &Waker,
    ) -> Turn {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        if state.queue.first() == Some(place) {
            match state.open_for(now, config, give_up) {
                Ok(()) => {
                    state.queue.remove(place);
                    self.go(&mut state, now, config);
                    state.queue.wake_first();
                    return Turn::Go;
                }
                Err(opens) if opens.at > give_up => {
                    state.queue.remove(place);
                    state.queue.wake_first();
                    return Turn::Refused(opens.reset);
                }
                Err(opens) => {
                    state.queue.set_waker(place, waker);
                    return Turn::Later(opens.at);
                }
            }
        }
        if now >= give_up {
            let ahead = state.queue.position(place);
            let reset = state.cannot_go_before(now, config, ahead).unwrap_or(now);
            state.queue.remove(place);
            return Turn::Refused(reset);
        }
        state.queue.set_waker(place, waker);
        Turn::Later(give_up)
    }

    /// How long a retry of a request of this key waits at `now`: a `Retry-After`, or no
    /// quota left (not smoothing: the retry is a request the window already let go).
    pub(super) fn holds_for(&self, now: Instant, config: &PaceConfig) -> Option<Duration> {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        let opens = state.opens_at(now, config).filter(|opens| !opens.spacing)?;
        Some(opens.at - now)
    }

    /// A retry of a request of this key goes at `now`.
    pub(super) fn again(&self, now: Instant, config: &PaceConfig) {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        self.go(&mut state, now, config);
    }

    /// The waiter at `place` went away (its request was answered or dropped).
    pub(super) fn leave(&self, place: Place) {
        let mut state = self.lock();
        let was_first = state.queue.first() == Some(place);
        state.queue.remove(place);
        if was_first {
            state.queue.wake_first();
        }
    }

    /// Lets one request go at `now`.
    fn go(&self, state: &mut State, now: Instant, config: &PaceConfig) {
        state.last_go = Some(now);
        if let Some(window) = state.requests.as_mut() {
            window.left -= 1;
            self.note_exhausted(window, config);
        }
    }

    /// Counts `window` closed for `remaining` the first time what is left reaches the reserve.
    fn note_exhausted(&self, window: &mut Window, config: &PaceConfig) {
        if window.left <= reserve(config) && !window.exhausted {
            window.exhausted = true;
            self.metrics.closed("remaining");
        }
    }

    /// Takes in what a response said; `counted`: the request it answered is among those in
    /// flight.
    pub(super) fn apply(&self, report: &Report, now: Instant, config: &PaceConfig, counted: bool) {
        let others = self.out().saturating_sub(u32::from(counted));
        let mut state = self.lock();
        if let Some(wait) = report.retry_after {
            let until = now + wait;
            if state.closed_until.is_none_or(|at| at < until) {
                state.closed_until = Some(until);
                self.metrics.closed("retry_after");
            }
        }
        if let Some(quota) = report.requests {
            state.requests = take(state.requests, &quota, now, i64::from(others));
        }
        if let Some(quota) = report.tokens {
            state.tokens = take(state.tokens, &quota, now, 0);
            state.counted = report.tokens_counted;
            self.counts_tokens.store(true, Ordering::Relaxed);
        }
        let state = &mut *state;
        for window in [&mut state.requests, &mut state.tokens].into_iter().flatten() {
            self.note_exhausted(window, config);
        }
        state.queue.wake_first();
    }

    /// Whether what the key knows still binds at `now`: a window not yet reset, a
    /// `Retry-After` ahead, or waiters.
    pub(super) fn binds(&self, now: Instant) -> bool {
        let state = self.lock();
        let ahead = |w: &Option<Window>| w.is_some_and(|w| w.reset_at + RESET_GUARD > now);
        ahead(&state.requests)
            || ahead(&state.tokens)
            || state.closed_until.is_some_and(|at| at > now)
            || !state.queue.is_empty()
    }

    /// What is left, per unit, as last reported: `(requests, tokens)`.
    pub(super) fn remaining(&self) -> (Option<u64>, Option<u64>) {
        let state = self.lock();
        (
            state.requests.map(|w| w.reported),
            state.tokens.map(|w| w.reported),
        )
    }

    /// The key as `/debug/pools` shows it.
    pub(super) fn report(&self, now: Instant, config: &PaceConfig) -> KeyReport {
        let out = self.out();
        let mut state = self.lock();
        state.roll(now, out);
        let opens = state.opens_at(now, config);
        let binding = state.requests.or(state.tokens);
        KeyReport {
            key: format!("{:016x}", self.id)[..8].to_owned(),
            remaining_requests: state.requests.map(|w| w.left),
            remaining_tokens: state.tokens.map(|w| w.reported),
            reset_ms: binding.map(|w| w.reset_at.saturating_duration_since(now).as_millis() as u64),
            closed: opens.is_some_and(|opens| !opens.spacing),
            waiters: state.queue.len(),
        }
    }
}

/// `window` after a figure `quota` received at `now`, `others` requests being in flight
/// besides the one it answered.
fn take(window: Option<Window>, quota: &Quota, now: Instant, others: i64) -> Option<Window> {
    let reset = quota.reset.unwrap_or(UNKNOWN_RESET);
    // A figure for a window that has ended says nothing of the next one.
    if reset.is_zero() {
        return window;
    }
    let reset_at = now + reset;
    let left = i64::try_from(quota.remaining).unwrap_or(i64::MAX) - others;
    let span = [
        window.and_then(|w| w.span),
        quota.window,
        quota.reset.filter(|_| quota.window.is_none()),
    ]
    .into_iter()
    .flatten()
    .max();
    match window {
        // The same window: a figure only lowers what is left (a late answer carries an older
        // count), and the earliest reset is the closest bound (a reset in whole seconds is
        // rounded up).
        Some(w) if !w.predicted && now < w.reset_at + RESET_GUARD => Some(Window {
            left: w.left.min(left),
            reported: quota.remaining,
            reset_at: w.reset_at.min(reset_at),
            limit: quota.limit.or(w.limit),
            span,
            ..w
        }),
        _ => Some(Window {
            limit: quota.limit.or(window.and_then(|w| w.limit)),
            left,
            reported: quota.remaining,
            reset_at,
            predicted: false,
            span,
            exhausted: false,
        }),
    }
}

fn reserve(config: &PaceConfig) -> i64 {
    i64::try_from(config.reserve).unwrap_or(i64::MAX)
}

impl State {
    /// Adds `tokens` (takes, when negative) to what the tokens window has left, waking the
    /// first waiter when it grew.
    fn give_back(&mut self, tokens: i64) {
        if let Some(w) = self.tokens.as_mut() {
            w.left = w.left.saturating_add(tokens);
            if tokens > 0 {
                self.queue.wake_first();
            }
        }
    }

    /// Moves the windows on to `now`; `out`: requests in flight.
    fn roll(&mut self, now: Instant, out: u32) {
        self.requests = self.requests.and_then(|w| w.current(now, out));
        self.tokens = self.tokens.and_then(|w| w.current(now, 0));
        if self.closed_until.is_some_and(|at| at <= now) {
            self.closed_until = None;
        }
    }

    /// When the next request may go, and what holds it; `None` when it may go now.
    fn opens_at(&self, now: Instant, config: &PaceConfig) -> Option<Opens> {
        let mut opens = Opens {
            at: now,
            reset: now,
            spacing: false,
        };
        let mut later = |at: Instant, reset: Instant, spacing: bool| {
            if at > opens.at {
                opens = Opens { at, reset, spacing };
            }
        };
        if let Some(until) = self.closed_until {
            later(until, until, false);
        }
        if let Some(w) = self.requests {
            let left = w.left.saturating_sub(reserve(config));
            if left <= 0 {
                later(w.reset_at + RESET_GUARD, w.reset_at, false);
            } else if let (true, Some(last)) = (config.smooth, self.last_go) {
                let steps = u32::try_from(left).unwrap_or(u32::MAX).saturating_add(1);
                let spacing = w.reset_at.saturating_duration_since(last) / steps;
                later(last + spacing, w.reset_at, true);
            }
        }
        // A request needs what one is estimated to spend, at least a token, and never more
        // than a whole window holds: an estimate past the limit must not close the key for good.
        let needs = |w: &Window| {
            let estimate = i64::try_from(self.per_request.max(1)).unwrap_or(i64::MAX);
            let whole = w.limit.map_or(i64::MAX, |limit| {
                i64::try_from(limit)
                    .unwrap_or(i64::MAX)
                    .saturating_sub(reserve(config))
            });
            estimate.min(whole.max(1))
        };
        if let Some(w) = self
            .tokens
            .filter(|w| w.left.saturating_sub(reserve(config)) < needs(w))
        {
            later(w.reset_at + RESET_GUARD, w.reset_at, false);
        }
        (opens.at > now).then_some(opens)
    }

    /// Whether a request that gives up at `give_up` goes now: the key is open, or only
    /// smoothing holds it and its slot comes too late (the spacing is the sidecar's own, and
    /// yields to the request's deadline rather than refuse a request the quota has room for).
    fn open_for(&self, now: Instant, config: &PaceConfig, give_up: Instant) -> Result<(), Opens> {
        match self.opens_at(now, config) {
            None => Ok(()),
            Some(opens) if opens.spacing && opens.at > give_up => Ok(()),
            Some(opens) => Err(opens),
        }
    }

    /// The reset before which the waiter with `ahead` requests before it cannot go, when that
    /// is known now: a `Retry-After`, no quota left, or more waiters ahead than the window
    /// has left.
    fn cannot_go_before(&self, now: Instant, config: &PaceConfig, ahead: usize) -> Option<Instant> {
        let opens = self.opens_at(now, config)?;
        let left = self
            .requests
            .map_or(i64::MAX, |w| w.left.saturating_sub(reserve(config)));
        match self.requests {
            Some(w) if i64::try_from(ahead).unwrap_or(i64::MAX) >= left => Some(w.reset_at.max(opens.reset)),
            _ if !opens.spacing => Some(opens.reset),
            _ => None,
        }
    }
}

/// Waiters by class, each class in order of arrival.
#[derive(Debug, Default)]
struct Queue {
    classes: [VecDeque<(u64, Option<Waker>)>; 3],
    next: u64,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.classes.iter().all(VecDeque::is_empty)
    }

    fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    fn push(&mut self, class: Priority) -> Place {
        self.next += 1;
        self.classes[class as usize].push_back((self.next, None));
        Place { id: self.next, class }
    }

    /// Waiters served before a new one of `class`.
    fn ahead_of(&self, class: Priority) -> usize {
        self.classes[..=class as usize].iter().map(VecDeque::len).sum()
    }

    /// Waiters served before `place`.
    fn position(&self, place: Place) -> usize {
        let class = place.class as usize;
        let before: usize = self.classes[..class].iter().map(VecDeque::len).sum();
        before
            + self.classes[class]
                .iter()
                .take_while(|(id, _)| *id != place.id)
                .count()
    }

    fn first(&self) -> Option<Place> {
        self.classes.iter().enumerate().find_map(|(class, waiters)| {
            waiters.front().map(|(id, _)| Place {
                id: *id,
                class: [Priority::High, Priority::Normal, Priority::Low][class],
            })
        })
    }

    fn remove(&mut self, place: Place) {
        let waiters = &mut self.classes[place.class as usize];
        if let Some(i) = waiters.iter().position(|(id, _)| *id == place.id) {
            waiters.remove(i);
        }
    }

    fn set_waker(&mut self, place: Place, waker: &Waker) {
        let waiters = &mut self.classes[place.class as usize];
        if let Some((_, slot)) = waiters.iter_mut().find(|(id, _)| *id == place.id) {
            match slot {
                Some(w) if w.will_wake(waker) => {}
                _ => *slot = Some(waker.clone()),
            }
        }
    }

    fn wake_first(&mut self) {
        if let Some(place) = self.first() {
            let waiters = &mut self.classes[place.class as usize];
            if let Some((_, Some(waker))) = waiters.front_mut() {
                waker.wake_by_ref();
            }
        }
    }
}

#[cfg(test)]
mod tests;
