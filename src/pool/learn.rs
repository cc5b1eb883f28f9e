//! Learning an upstream's own idle timeout from the idle ages at which it closes pooled HTTP/1.1
//! connections, so that the pool can retire connections a margin before the upstream would.
//!
//! Owns only the arithmetic: which observations count, when they agree, the value learned and
//! how long it holds. It sees no sockets and no clock of its own; the pool feeds it the idle
//! age of every connection the upstream closed while it sat idle in the pool, and asks it for
//! the idle limit to apply (see the pool's module doc for where those closes are noticed).
//!
//! The rule:
//! - Ages under [`MIN_AGE`] are ignored: a close that soon after a response is a server that
//!   closes after every response without saying `Connection: close`, or one restarting, not an
//!   idle timer; and under it the margin would leave almost no time to reuse a connection.
//! - Closes noticed within [`SAME_EVENT`] of the previous one count once: an upstream that
//!   restarts drops every idle connection at the same instant, and connections returned by one
//!   burst have near-equal idle ages, so one event must not look like agreeing observations.
//! - The last [`WINDOW`] observations are kept. The learned age is the smallest age `a` with
//!   at least [`AGREE`] kept observations in `[a, a + agreement(a)]`,
//!   `agreement(a) = max(100 ms, a / 20)`: an idle timer fires within tens of milliseconds of
//!   its time, while closes for other reasons (restarts, rebalancing, lifetime caps) land
//!   anywhere, and a wide band would let three of those, hours apart, teach a low value.
//!   Taking the lowest such cluster, not the lowest age, means one early close (a restart, a
//!   crash) teaches nothing, while an upstream that repeatedly closes at an age is followed
//!   even if it sometimes closes later too.
//! - Connections are retired at `a - margin(a)`, `margin(a) = max(250 ms, a / 10)`: a 2 s
//!   upstream gets its connections retired at 1.75 s. The margin covers the close's flight time
//!   (the age is measured when the FIN arrives, after the upstream decided) and timer slack on
//!   both sides.
//! - A learned age holds for [`TTL`] after the newest observation that supports it. While it
//!   holds, the pool retires connections before the upstream closes them, so nothing can show
//!   that the upstream now keeps connections longer; once it lapses the pool keeps connections
//!   up to its own limits again, and the next close at the same age (which agrees with the kept
//!   observations) re-establishes it at once. An upstream that lowered its timeout is followed
//!   without waiting: its closes come before our retirement and form a lower cluster.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Idle ages below this are not an idle timer.
pub const MIN_AGE: Duration = Duration::from_millis(500);
/// Closes noticed this close together are one event.
pub const SAME_EVENT: Duration = Duration::from_millis(100);
/// Observations kept.
pub const WINDOW: usize = 8;
/// Observations that must agree before their age is used.
pub const AGREE: usize = 3;
/// How long a learned age holds without a new observation supporting it.
pub const TTL: Duration = Duration::from_secs(600);
/// The smallest margin between the learned age and retirement.
const MIN_MARGIN: Duration = Duration::from_millis(250);
/// The narrowest band of ages that agree.
const MIN_AGREEMENT: Duration = Duration::from_millis(100);

/// How far apart observations may lie and still agree: an idle timer's jitter.
fn agreement(age: Duration) -> Duration {
    MIN_AGREEMENT.max(age / 20)
}

/// How far before a learned age connections are retired.
pub fn margin(age: Duration) -> Duration {
    MIN_MARGIN.max(age / 10)
}

/// How long an idle connection may stay idle: `idle_timeout`, shortened by the upstream's
/// `Keep-Alive: timeout` hint and by the learned retirement age, whichever is smallest; `true`
/// when the learned age is what binds (the close is then counted as `learned_idle_timeout`).
pub fn idle_limit(
    idle_timeout: Duration,
    hint: Option<Duration>,
    retire_after: Option<Duration>,
) -> (Duration, bool) {
    let configured = hint.map_or(idle_timeout, |hint| hint.min(idle_timeout));
    match retire_after {
        Some(learned) if learned < configured => (learned, true),
        _ => (configured, false),
    }
}

/// One upstream close of an idle connection.
#[derive(Debug, Clone, Copy)]
struct Observation {
    age: Duration,
    at: Instant,
}

/// A learned idle timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Learned {
    age: Duration,
    /// Observations in its cluster.
    support: usize,
    /// When it lapses unless a new observation supports it.
    until: Instant,
}

/// A change of the learned value, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    /// The upstream idle timeout learned before, if any.
    pub old: Option<Duration>,
    /// The one learned now, if any.
    pub new: Option<Duration>,
    /// Observations supporting the new value (0 when none is learned).
    pub support: usize,
}

/// What one pool has learned about its upstream's idle timeout.
#[derive(Debug, Default)]
pub struct IdleLearner {
    recent: VecDeque<Observation>,
    learned: Option<Learned>,
    /// Observations counted (past the floor and the same-event filter) since the pool started.
    counted: u64,
}

impl IdleLearner {
    /// Records that the upstream closed a connection idle for `age`, noticed at `now`; returns
    /// the change of the learned value, if any.
    pub fn observe(&mut self, age: Duration, now: Instant) -> Option<Change> {
        if age < MIN_AGE {
            return None;
        }
        let same_event = self
            .recent
            .back()
            .is_some_and(|last| now.saturating_duration_since(last.at) < SAME_EVENT);
        if same_event {
            return None;
        }
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(Observation { age, at: now });
        self.counted += 1;
        // A value that lapsed unnoticed is gone: restoring it is a change to log.
        self.learned = self.learned.filter(|l| now < l.until);
        self.relearn(now)
    }

    /// Lets a learned value lapse once its [`TTL`] has passed; returns the change, if any.
    pub fn refresh(&mut self, now: Instant) -> Option<Change> {
        match self.learned {
            Some(learned) if learned.until <= now => self.relearn(now),
            _ => None,
        }
    }

    /// The upstream idle timeout learned and in force at `now`.
    #[inline]
    pub fn learned(&self, now: Instant) -> Option<Duration> {
        self.learned.filter(|l| now < l.until).map(|l| l.age)
    }

    /// The idle age at which to retire connections, while a learned value is in force.
    #[inline]
    pub fn retire_after(&self, now: Instant) -> Option<Duration> {
        self.learned(now).map(|age| age - margin(age))
    }

    /// Whether it holds nothing: no observation kept, no value learned.
    pub fn is_empty(&self) -> bool {
        self.recent.is_empty() && self.learned.is_none()
    }

    /// Observations counted since the pool started.
    pub fn observations(&self) -> u64 {
        self.counted
    }

    fn relearn(&mut self, now: Instant) -> Option<Change> {
        let old = self.learned.map(|l| l.age);
        self.learned = lowest_fresh_cluster(&self.recent, now);
        let new = self.learned.map(|l| l.age);
        (old != new).then(|| Change {
            old,
            new,
            support: self.learned.map_or(0, |l| l.support),
        })
    }
}

/// The smallest age with [`AGREE`] observations within its agreement band whose newest is
/// younger than [`TTL`].
fn lowest_fresh_cluster(recent: &VecDeque<Observation>, now: Instant) -> Option<Learned> {
    let mut sorted: Vec<Observation> = recent.iter().copied().collect();
    sorted.sort_by_key(|o| o.age);
    sorted.iter().enumerate().find_map(|(i, low)| {
        let cluster: Vec<&Observation> = sorted[i..]
            .iter()
            .take_while(|o| o.age <= low.age + agreement(low.age))
            .collect();
        let newest = cluster.iter().map(|o| o.at).max()?;
        let until = newest + TTL;
        (cluster.len() >= AGREE && now < until).then_some(Learned {
            age: low.age,
            support: cluster.len(),
            until,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Feeds `ages` as closes one second apart from `start`; returns the last change.
    fn feed(learner: &mut IdleLearner, start: Instant, ages: &[u64]) -> Option<Change> {
        let mut last = None;
        for (i, age) in ages.iter().enumerate() {
            if let Some(change) = learner.observe(ms(*age), start + Duration::from_secs(i as u64)) {
                last = Some(change);
            }
        }
        last
    }

    #[test]
    fn needs_three_agreeing_closes() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        assert_eq!(feed(&mut learner, start, &[2030, 2010]), None);
        assert_eq!(
            learner.learned(start + ms(2500)),
            None,
            "two closes teach nothing"
        );
        let change = learner.observe(ms(2050), start + ms(3000));
        assert_eq!(
            change,
            Some(Change {
                old: None,
                new: Some(ms(2010)),
                support: 3
            })
        );
        assert_eq!(learner.learned(start + ms(3000)), Some(ms(2010)));
        assert_eq!(learner.observations(), 3);
    }

    #[test]
    fn retires_a_margin_before_the_learned_age() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[2000, 2000, 2000]);
        let now = start + ms(3000);
        assert_eq!(learner.retire_after(now), Some(ms(1750)), "2 s: 250 ms margin");
        let mut slow = IdleLearner::default();
        feed(&mut slow, start, &[60_000, 60_100, 60_200]);
        assert_eq!(slow.retire_after(now), Some(ms(54_000)), "60 s: 10% margin");
        assert_eq!(margin(ms(500)), ms(250));
    }

    #[test]
    fn never_above_idle_timeout_or_the_keep_alive_hint() {
        let (s30, s5) = (Duration::from_secs(30), Duration::from_secs(5));
        assert_eq!(idle_limit(s30, None, Some(ms(1750))), (ms(1750), true));
        assert_eq!(idle_limit(ms(1000), None, Some(ms(1750))), (ms(1000), false));
        assert_eq!(idle_limit(s30, Some(s5), Some(ms(54_000))), (s5, false));
        assert_eq!(idle_limit(s30, Some(s5), Some(ms(1750))), (ms(1750), true));
        assert_eq!(idle_limit(s30, None, None), (s30, false));
        // Learned from a slow upstream, then idle_timeout lowered by a reload: it still binds.
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[60_000, 60_000, 60_000]);
        let retire = learner.retire_after(start + ms(3000));
        assert_eq!(idle_limit(s30, None, retire), (s30, false));
    }

    #[test]
    fn ignores_closes_right_after_a_response() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        assert_eq!(feed(&mut learner, start, &[1, 5, 50, 99, 300, 499]), None);
        assert_eq!(learner.learned(start + ms(6000)), None);
        assert_eq!(learner.observations(), 0);
    }

    #[test]
    fn closes_noticed_together_count_once() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        // An upstream restart drops five connections a burst had returned together.
        for i in 0..5 {
            learner.observe(ms(3200 + i), start + ms(i));
        }
        assert_eq!(learner.observations(), 1);
        assert_eq!(learner.learned(start + ms(10)), None);
    }

    #[test]
    fn disagreeing_closes_teach_nothing() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        assert_eq!(
            feed(&mut learner, start, &[1000, 4000, 9000, 15_000, 27_000]),
            None
        );
        assert_eq!(learner.learned(start + Duration::from_secs(6)), None);
    }

    #[test]
    fn one_early_close_does_not_make_the_pool_eager() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[5000, 700, 5100, 5050]);
        assert_eq!(learner.learned(start + Duration::from_secs(5)), Some(ms(5000)));
    }

    #[test]
    fn a_repeated_lower_age_wins_over_a_higher_one() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[30_000, 30_000, 30_000]);
        assert_eq!(learner.learned(start + Duration::from_secs(3)), Some(ms(30_000)));
        // The upstream lowered its timeout: its closes now come before our retirement.
        let change = feed(&mut learner, start + Duration::from_secs(3), &[5000, 5000, 5000]);
        assert_eq!(change.map(|c| c.new), Some(Some(ms(5000))));
    }

    #[test]
    fn a_learned_age_lapses_and_one_close_restores_it() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[2000, 2000, 2000]);
        let lapsed = start + Duration::from_secs(2) + TTL;
        assert_eq!(learner.learned(lapsed), None);
        assert_eq!(
            learner.refresh(lapsed),
            Some(Change {
                old: Some(ms(2000)),
                new: None,
                support: 0
            })
        );
        // Kept up to idle_timeout again, the next close at the same age agrees with the kept ones.
        let change = learner.observe(ms(2010), lapsed + ms(2010));
        assert_eq!(change.map(|c| (c.new, c.support)), Some((Some(ms(2000)), 4)));
    }

    #[test]
    fn a_value_that_lapsed_unnoticed_is_restored_as_a_change() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[2000, 2000, 2000]);
        // No refresh ran at the lapse: the restoring close must still report a change.
        let later = start + Duration::from_secs(2) + TTL + ms(5000);
        let change = learner.observe(ms(2000), later);
        assert_eq!(change.map(|c| (c.old, c.new)), Some((None, Some(ms(2000)))));
    }

    #[test]
    fn closes_at_scattered_ages_under_the_margin_teach_nothing() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        // Three restarts hours apart, 0.9-1.1 s into idling: within the margin of each other,
        // not within a timer's jitter.
        assert_eq!(feed(&mut learner, start, &[900, 1100, 1000]), None);
        assert_eq!(learner.learned(start + Duration::from_secs(3)), None);
    }

    #[test]
    fn keeps_only_the_latest_window() {
        let start = Instant::now();
        let mut learner = IdleLearner::default();
        feed(&mut learner, start, &[2000, 2000, 2000]);
        let later = start + Duration::from_secs(10);
        feed(
            &mut learner,
            later,
            &[9000, 12_000, 15_000, 18_000, 21_000, 24_000],
        );
        assert_eq!(
            learner.learned(later + Duration::from_secs(6)),
            None,
            "one of the three agreeing closes left the window"
        );
    }
}
