//! A key's accounting on a clock the tests move: what goes, what waits and until when.

use std::time::Duration;

use tokio::time::Instant;

use super::*;
use crate::metrics::Metrics;

fn key() -> Key {
    Key::new(7, Metrics::new().pace("llm"))
}

fn config(smooth: bool, reserve: u64) -> PaceConfig {
    PaceConfig {
        enabled: true,
        max_wait: Duration::from_secs(30),
        reserve,
        smooth,
    }
}

fn requests(remaining: u64, limit: Option<u64>, reset_ms: u64) -> Report {
    Report {
        requests: Some(Quota {
            limit,
            remaining,
            reset: Some(Duration::from_millis(reset_ms)),
            window: None,
        }),
        ..Report::default()
    }
}

const FAR: Duration = Duration::from_secs(3600);

fn goes(key: &Key, now: Instant, config: &PaceConfig) -> bool {
    match key.admit(now, config, Priority::Normal, now + FAR) {
        Verdict::Go => {
            key.sent();
            true
        }
        Verdict::Wait(place) => {
            key.leave(place);
            false
        }
        Verdict::Refuse(_) => false,
    }
}

#[test]
fn what_is_left_goes_then_requests_wait_for_the_reset() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    key.apply(&requests(3, None, 2_000), t0, &config, false);
    assert!((0..3).all(|_| goes(&key, t0, &config)));
    assert!(!goes(&key, t0, &config), "the fourth waits");
    let state = key.lock();
    let opens = state.opens_at(t0, &config).expect("closed");
    assert_eq!(opens.reset, t0 + Duration::from_secs(2));
    assert_eq!(opens.at, opens.reset + RESET_GUARD);
    assert!(!opens.spacing);
}

#[test]
fn requests_in_flight_count_against_the_figure_and_a_late_higher_figure_changes_nothing() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    // Two requests out before anything was known, then one of them answered: 5 left.
    key.sent();
    key.sent();
    key.apply(&requests(5, None, 2_000), t0, &config, true);
    assert_eq!(
        key.lock().requests.unwrap().left,
        4,
        "the other request in flight counts"
    );
    // An older answer arrives late with a higher figure.
    key.apply(
        &requests(9, None, 2_000),
        t0 + Duration::from_millis(5),
        &config,
        true,
    );
    assert_eq!(key.lock().requests.unwrap().left, 4);
}

#[test]
fn past_the_reset_the_next_window_is_predicted_from_the_limit_less_what_is_out() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    key.apply(&requests(0, Some(10), 2_000), t0, &config, false);
    assert!(!goes(&key, t0 + Duration::from_millis(1_990), &config));
    key.sent(); // one request still out from the last window
    let t1 = t0 + Duration::from_millis(2_000) + RESET_GUARD;
    let mut went = 0;
    while goes(&key, t1, &config) {
        went += 1;
    }
    assert_eq!(went, 9, "the limit less the request still out");
    let w = key.lock().requests.unwrap();
    assert!(w.predicted);
    assert_eq!(w.reset_at, t0 + Duration::from_secs(4), "one window length on");
    // The window's first figure replaces the prediction.
    key.apply(&requests(3, Some(10), 1_500), t1, &config, true);
    assert!(!key.lock().requests.unwrap().predicted);
}

#[test]
fn a_retry_after_closes_the_key_and_a_wait_past_the_give_up_is_refused_with_the_reset() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    let report = Report {
        retry_after: Some(Duration::from_secs(3)),
        ..Report::default()
    };
    key.apply(&report, t0, &config, false);
    assert_eq!(key.lock().closed_until, Some(t0 + Duration::from_secs(3)));
    match key.admit(t0, &config, Priority::Normal, t0 + Duration::from_secs(1)) {
        Verdict::Refuse(reset) => assert_eq!(reset, t0 + Duration::from_secs(3)),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        key.admit(t0, &config, Priority::Normal, t0 + Duration::from_secs(5)),
        Verdict::Wait(_)
    ));
    assert_eq!(key.lock().queue.len(), 1);
}

#[test]
fn smoothing_spaces_what_is_left_evenly_until_the_reset() {
    let key = key();
    let config = config(true, 0);
    let t0 = Instant::now();
    key.apply(&requests(20, Some(20), 2_000), t0, &config, false);
    assert!(goes(&key, t0, &config));
    let state = key.lock();
    let opens = state.opens_at(t0, &config).expect("spaced");
    // 19 left over 2 s: one every 100 ms, the last a step before the reset.
    assert_eq!(opens.at - t0, Duration::from_millis(100));
    assert!(opens.spacing);
    drop(state);
    // The spacing yields to a request that would give up before its slot: the quota has room.
    let soon = t0 + Duration::from_millis(50);
    assert!(matches!(
        key.admit(t0, &config, Priority::Normal, soon),
        Verdict::Go
    ));
}

#[test]
fn the_reserve_is_kept_back() {
    let key = key();
    let config = config(false, 2);
    let t0 = Instant::now();
    key.apply(&requests(3, None, 2_000), t0, &config, false);
    assert!(goes(&key, t0, &config));
    assert!(!goes(&key, t0, &config), "two are kept back");
}

#[test]
fn waiters_are_served_by_class_then_in_order() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    key.apply(&requests(0, None, 1_000), t0, &config, false);
    let give_up = t0 + FAR;
    let places: Vec<Place> = [
        Priority::Low,
        Priority::Low,
        Priority::High,
        Priority::Normal,
        Priority::High,
    ]
    .into_iter()
    .map(|p| match key.admit(t0, &config, p, give_up) {
        Verdict::Wait(place) => place,
        other => panic!("{other:?}"),
    })
    .collect();
    let mut order = Vec::new();
    let state = &mut key.lock();
    while let Some(first) = state.queue.first() {
        order.push(places.iter().position(|p| *p == first).unwrap());
        state.queue.remove(first);
    }
    assert_eq!(order, [2, 4, 3, 0, 1]);
}

#[test]
fn a_waiter_that_leaves_is_gone_from_the_queue() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    key.apply(&requests(0, None, 1_000), t0, &config, false);
    let Verdict::Wait(place) = key.admit(t0, &config, Priority::Normal, t0 + FAR) else {
        panic!("should wait");
    };
    assert_eq!(key.report(t0, &config).waiters, 1);
    key.leave(place);
    assert_eq!(key.report(t0, &config).waiters, 0);
}

#[test]
fn no_tokens_left_holds_requests_until_the_tokens_reset() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    let report = Report {
        tokens: Some(Quota {
            limit: Some(1000),
            remaining: 0,
            reset: Some(Duration::from_millis(700)),
            window: None,
        }),
        ..Report::default()
    };
    key.apply(&report, t0, &config, false);
    assert!(!goes(&key, t0, &config));
    assert!(goes(&key, t0 + Duration::from_millis(700) + RESET_GUARD, &config));
}

fn tokens(remaining: u64, reset_ms: u64) -> Report {
    Report {
        tokens: Some(Quota {
            limit: Some(100_000),
            remaining,
            reset: Some(Duration::from_millis(reset_ms)),
            window: None,
        }),
        ..Report::default()
    }
}

fn spend(input: u64, output: u64) -> Tokens {
    Tokens {
        input,
        output,
        cache_read: 0,
        cache_write: 0,
        reasoning: 0,
    }
}

/// A request goes and is charged, as `Ticket::going` charges it; `None` when it waits.
fn charged(key: &Key, now: Instant, config: &PaceConfig) -> Option<u32> {
    goes(key, now, config).then(|| key.charge(now))
}

#[test]
fn requests_are_charged_the_estimate_of_their_tokens_and_settled_with_what_they_spent() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    assert!(!key.counts_tokens(), "no tokens quota reported yet");
    key.apply(&tokens(1_000, 60_000), t0, &config, false);
    assert!(key.counts_tokens());
    let left = |key: &Key| key.lock().tokens.unwrap().left;
    // Nothing read yet: the estimate is 0, two requests go at once, charged nothing.
    let (a, b) = (
        charged(&key, t0, &config).unwrap(),
        charged(&key, t0, &config).unwrap(),
    );
    assert_eq!((a, b, left(&key)), (0, 0, 1_000));
    // Their answers spent 300 and 100: each settles what it spent against what it was charged.
    key.spent(&spend(200, 100), a, t0);
    assert_eq!(left(&key), 700);
    assert_eq!(key.lock().per_request, 300);
    key.spent(&spend(60, 40), b, t0);
    assert_eq!(left(&key), 600);
    assert_eq!(key.lock().per_request, (300 * 3 + 100) / 4);
    // Now each is charged the estimate, 250; the third would need 250 of the 100 left.
    let (c, d) = (
        charged(&key, t0, &config).unwrap(),
        charged(&key, t0, &config).unwrap(),
    );
    assert_eq!((c, d, left(&key)), (250, 250, 100));
    assert!(
        charged(&key, t0, &config).is_none(),
        "100 left is less than the estimate"
    );
    // One spent less than its charge: the difference comes back, and a request fits again.
    key.spent(&spend(40, 10), c, t0);
    assert_eq!(left(&key), 300);
    // One whose usage was not read gives its whole charge back; the estimate stays.
    let estimate = key.lock().per_request;
    key.refund(d, t0);
    assert_eq!((left(&key), key.lock().per_request), (550, estimate));
    // A figure from the upstream within the window only lowers what is left.
    key.apply(&tokens(5_000, 60_000), t0, &config, false);
    assert_eq!(left(&key), 550);
    key.apply(&tokens(50, 60_000), t0, &config, false);
    assert_eq!(left(&key), 50);
    assert!(!goes(&key, t0, &config));
}

#[test]
fn an_estimate_past_the_whole_limit_still_lets_a_request_go_each_window() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    let small = |remaining| Report {
        tokens: Some(Quota {
            limit: Some(8_000),
            remaining,
            reset: Some(Duration::from_millis(700)),
            window: None,
        }),
        ..Report::default()
    };
    key.apply(&small(8_000), t0, &config, false);
    let first = charged(&key, t0, &config).unwrap();
    key.spent(&spend(9_000, 1_000), first, t0);
    assert_eq!(
        key.lock().per_request,
        10_000,
        "more than the window's whole limit"
    );
    assert!(!goes(&key, t0, &config), "nothing left in this window");
    // The next window holds 8,000 whole: the estimate is capped at it, so one request goes.
    let next = t0 + Duration::from_millis(700) + RESET_GUARD;
    key.apply(&small(8_000), next, &config, false);
    assert!(goes(&key, next, &config));
}

#[test]
fn anthropics_input_quota_counts_uncached_input_and_its_output_quota_output() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    let quota = |counted| Report {
        tokens: Some(Quota {
            limit: Some(100_000),
            remaining: 100_000,
            reset: Some(Duration::from_secs(60)),
            window: None,
        }),
        tokens_counted: counted,
        ..Report::default()
    };
    let answer = Tokens {
        input: 10_000,
        output: 500,
        cache_read: 9_000,
        cache_write: 0,
        reasoning: 0,
    };
    key.apply(&quota(Counted::Input), t0, &config, false);
    key.spent(&answer, 0, t0);
    assert_eq!(
        key.lock().per_request,
        1_000,
        "cache reads do not count against input"
    );
    let key = super::Key::new(8, crate::metrics::Metrics::new().pace("llm"));
    key.apply(&quota(Counted::Output), t0, &config, false);
    key.spent(&answer, 0, t0);
    assert_eq!(key.lock().per_request, 500);
}

#[test]
fn tokens_spent_beyond_the_window_close_it_until_the_reset() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    key.apply(&tokens(1_000, 700), t0, &config, false);
    let charge = charged(&key, t0, &config).unwrap();
    key.spent(&spend(4_000, 1_000), charge, t0);
    assert!(key.lock().tokens.unwrap().left < 0);
    assert!(!goes(&key, t0, &config));
    let opens = key.lock().opens_at(t0, &config).expect("closed");
    assert!(!opens.spacing);
    assert_eq!(opens.reset, t0 + Duration::from_millis(700));
}

#[test]
fn more_waiters_than_the_window_holds_are_refused_when_the_reset_is_past_their_give_up() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    key.apply(&requests(0, None, 5_000), t0, &config, false);
    assert!(matches!(
        key.admit(t0, &config, Priority::Normal, t0 + Duration::from_secs(1)),
        Verdict::Refuse(_)
    ));
}

#[test]
fn a_key_binds_while_its_window_or_retry_after_is_ahead_or_requests_wait() {
    let key = key();
    let config = config(false, 0);
    let t0 = Instant::now();
    assert!(!key.binds(t0), "a new key knows nothing");
    key.apply(&requests(5, None, 1_000), t0, &config, false);
    assert!(key.binds(t0));
    assert!(!key.binds(t0 + Duration::from_secs(2)), "past its reset");
    let report = Report {
        retry_after: Some(Duration::from_secs(5)),
        ..Report::default()
    };
    key.apply(&report, t0, &config, false);
    assert!(key.binds(t0 + Duration::from_secs(2)));
}

#[test]
fn absurd_figures_neither_wrap_nor_panic() {
    let key = key();
    let config = config(true, u64::MAX);
    let t0 = Instant::now();
    key.apply(&requests(u64::MAX, Some(u64::MAX), 1), t0, &config, false);
    assert!(!goes(&key, t0, &config), "a reserve past any figure holds");
    let config = self::config(true, 0);
    key.apply(
        &requests(1 << 33, None, 2_000),
        t0 + Duration::from_secs(1),
        &config,
        false,
    );
    assert!(goes(&key, t0 + Duration::from_secs(1), &config));
    // A window of a nanosecond, idle for an hour: forgotten, not wrapped.
    let tiny = Window {
        limit: Some(5),
        left: 0,
        reported: 0,
        reset_at: t0,
        predicted: false,
        span: Some(Duration::from_nanos(1)),
        exhausted: false,
    };
    assert!(tiny
        .current(t0 + Duration::from_secs(3600 * 24 * 365), 0)
        .is_none());
}
