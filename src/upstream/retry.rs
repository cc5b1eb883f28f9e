//! Retries by policy (`retry`): which failures and responses go again, how long to wait first
//! (the response's `Retry-After`, else exponential backoff with full jitter), and the
//! per-upstream budget that keeps retries from multiplying an overload.
//!
//! The budget is tower's `TpsBudget` (linkerd2-proxy's idea: a share of recent requests plus a
//! floor per second), over a one-second window so that a burst of failures gets at most
//! `ratio` of itself plus `min_per_second` retries. tower's `ExponentialBackoff` is not used:
//! it adds its jitter on top of the exponential wait, so it never waits less than the base,
//! where full jitter (the AWS architecture blog's) draws the whole wait from zero up to the
//! bound and so spreads clients that failed together; and here a `Retry-After` replaces the
//! backoff, which tower's `Policy` would need a wrapper for. The draw is three lines.
//!
//! Also here: which methods are idempotent, and reading off a response that goes again so its
//! connection is kept. Not handled here: sending (`super`), keeping the request body
//! (`wire::body`).

use std::time::{Duration, SystemTime};

use tower::retry::budget::{Budget as _, TpsBudget};

use super::Timing;
use crate::config::{Backoff, RetryBudget, RetryConfig};
use crate::duration::DurationError;
use crate::error::{ErrorKind, ProxyError};
use crate::pace::report::retry_after;
use crate::pool::PooledBody;
use crate::rng::Xorshift;

/// How long a deposit counts: the budget's memory.
const BUDGET_WINDOW: Duration = Duration::from_secs(1);

/// Why a request goes again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reason {
    /// No connection could be made; nothing was sent.
    ConnectFailure,
    /// The connection failed after the request went out, before a response head.
    Reset,
    /// The response had this status.
    Status(u16),
}

impl Reason {
    /// The `reason` label of `egress_upstream_retries_total`.
    pub(super) fn label(self) -> String {
        match self {
            Reason::ConnectFailure => "connect_failure".to_owned(),
            Reason::Reset => "reset".to_owned(),
            Reason::Status(code) => code.to_string(),
        }
    }

    /// Whether the request can go again as it is: nothing of it was sent.
    pub(super) fn nothing_sent(self) -> bool {
        self == Reason::ConnectFailure
    }

    /// What `result` (of one attempt) gives as a reason to send the request again.
    pub(super) fn of<T, E>(
        policy: &RetryConfig,
        result: &Result<http::Response<T>, (ProxyError, E)>,
        idempotent: bool,
    ) -> Option<Self> {
        match result {
            Ok(resp) => Reason::for_status(policy, resp.status().as_u16(), idempotent),
            Err((err, _)) => Reason::for_error(policy, err, idempotent),
        }
    }

    /// The failure `err` as a reason to retry, when `policy` names it and the request may go
    /// again: a connect failure for any method, a reset for idempotent ones.
    pub(super) fn for_error(policy: &RetryConfig, err: &ProxyError, idempotent: bool) -> Option<Self> {
        match err.kind() {
            ErrorKind::ConnectFailed | ErrorKind::ConnectTimeout if policy.on.connect_failure => {
                Some(Reason::ConnectFailure)
            }
            ErrorKind::UpstreamReset if policy.on.reset && idempotent => Some(Reason::Reset),
            _ => None,
        }
    }

    /// A response with `status` as a reason to retry: a status `policy` names, for idempotent
    /// requests, or any request on 429 (RFC 6585: the request was not processed).
    pub(super) fn for_status(policy: &RetryConfig, status: u16, idempotent: bool) -> Option<Self> {
        (policy.on.status(status) && (idempotent || status == 429)).then_some(Reason::Status(status))
    }
}

/// An upstream's retry budget and jitter source.
pub(super) struct Retries {
    budget: TpsBudget,
    rng: Xorshift,
}

impl std::fmt::Debug for Retries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retries").finish_non_exhaustive()
    }
}

impl Retries {
    /// The budget of the upstream `label`.
    pub(super) fn new(budget: RetryBudget, label: &str) -> Self {
        Retries {
            budget: TpsBudget::new(BUDGET_WINDOW, budget.min_per_second, budget.ratio),
            rng: Xorshift::seeded(label),
        }
    }

    /// A request arrived that may be retried.
    pub(super) fn deposit(&self) {
        self.budget.deposit();
    }

    /// Takes one retry from the budget; `false` when it is spent.
    pub(super) fn withdraw(&self) -> bool {
        self.budget.withdraw()
    }

    /// The wait before retry number `retry` (0 for the first): uniform in
    /// `0..=min(max, base * 2^retry)`.
    pub(super) fn backoff(&self, backoff: Backoff, retry: u32) -> Duration {
        let bound = backoff
            .base
            .saturating_mul(1u32 << retry.min(20))
            .min(backoff.max);
        let nanos = bound.as_nanos() as u64;
        if nanos == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.rng.below(nanos + 1))
    }
}

/// Reads what is left of a response the retry loop drops, when it is short and already on its
/// way: its connection then goes back to the pool instead of closing. Gives up (closing the
/// connection) past [`DRAIN_LIMIT`] bytes or [`DRAIN_WAIT`].
pub(super) async fn drain(mut body: PooledBody<Timing>) {
    use http_body_util::BodyExt as _;
    let read = async {
        let mut left = DRAIN_LIMIT;
        while let Some(Ok(frame)) = body.frame().await {
            let len = frame.data_ref().map_or(0, |d| d.len());
            left = left.checked_sub(len)?;
        }
        Some(())
    };
    let _ = tokio::time::timeout(DRAIN_WAIT, read).await;
}

/// The most of a retried response's body read to keep its connection.
const DRAIN_LIMIT: usize = 64 * 1024;
/// The longest wait for it.
const DRAIN_WAIT: Duration = Duration::from_millis(100);

/// GET, HEAD, OPTIONS, TRACE, PUT, DELETE, or anything carrying `Idempotency-Key`.
pub(super) fn is_idempotent<B>(req: &http::Request<B>) -> bool {
    use http::Method;
    matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    ) || req.headers().contains_key("idempotency-key")
}

/// How long `resp` asks to wait before the next request ([`retry_after`], shared with pacing). Its fields go into
/// its map first: an HTTP/1.1 head leaves them as lines. A value that is no duration the
/// sidecar takes goes to `ignored`.
pub(super) fn asked_wait(
    resp: &mut http::Response<PooledBody<Timing>>,
    ignored: Ignored<'_>,
) -> Option<Duration> {
    let wire = resp.body_mut().take_wire_fields();
    crate::wire::fields::into_map(wire, resp.headers_mut());
    retry_after(resp.headers(), SystemTime::now(), ignored)
}

/// Told of a header an upstream sent whose value was ignored: its name, the value, and why.
pub(super) type Ignored<'a> = &'a mut dyn FnMut(&'static str, &str, DurationError);

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    /// `retry_after`, recording what it ignored.
    fn retry_after_noting(
        headers: &HeaderMap,
        now: SystemTime,
    ) -> (Option<Duration>, Vec<(&'static str, String)>) {
        let mut ignored = Vec::new();
        let wait = retry_after(headers, now, &mut |name, value, _| {
            ignored.push((name, value.to_owned()))
        });
        (wait, ignored)
    }

    #[test]
    fn retry_after_in_seconds_dates_and_milliseconds() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let wait = |pairs: &[(&'static str, &str)]| {
            let (wait, ignored) = retry_after_noting(&headers(pairs), now);
            assert!(ignored.is_empty(), "{pairs:?}: {ignored:?}");
            wait
        };
        assert_eq!(wait(&[("retry-after", "3")]), Some(Duration::from_secs(3)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(wait(&[("retry-after", &later)]), Some(Duration::from_secs(90)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(wait(&[("retry-after", &past)]), Some(Duration::ZERO));
        assert_eq!(
            wait(&[("retry-after-ms", "250"), ("retry-after", "9")]),
            Some(Duration::from_millis(250)),
            "the finer one wins"
        );
        assert_eq!(wait(&[]), None);
    }

    /// The values that panicked `Duration::from_secs_f64` or would overflow a deadline are
    /// ignored, each reported, and a valid companion header still counts (issue 41).
    #[test]
    fn extreme_retry_after_values_are_ignored_and_reported() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let max = u64::MAX.to_string();
        for value in ["1e30", "-1", "NaN", "inf", "-inf", max.as_str(), "soon"] {
            let (wait, ignored) = retry_after_noting(&headers(&[("retry-after-ms", value)]), now);
            assert_eq!(wait, None, "retry-after-ms: {value}");
            assert_eq!(ignored, [("retry-after-ms", value.to_owned())]);
            let (wait, ignored) = retry_after_noting(&headers(&[("retry-after", value)]), now);
            assert_eq!(wait, None, "retry-after: {value}");
            assert_eq!(ignored, [("retry-after", value.to_owned())]);
        }
        let far = "Fri, 31 Dec 9999 23:59:59 GMT";
        let (wait, ignored) = retry_after_noting(&headers(&[("retry-after", far)]), now);
        assert_eq!((wait, ignored.len()), (None, 1), "a date past the bound");
        let (wait, ignored) =
            retry_after_noting(&headers(&[("retry-after-ms", "1e30"), ("retry-after", "2")]), now);
        assert_eq!(wait, Some(Duration::from_secs(2)));
        assert_eq!(ignored, [("retry-after-ms", "1e30".to_owned())]);
    }

    #[test]
    fn backoff_is_full_jitter_under_a_doubling_bound() {
        let retries = Retries::new(
            RetryBudget {
                ratio: 0.2,
                min_per_second: 10,
            },
            "a",
        );
        let backoff = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(2),
        };
        for (retry, bound) in [(0, 100), (1, 200), (3, 800), (5, 2000), (30, 2000)] {
            let draws: Vec<Duration> = (0..200).map(|_| retries.backoff(backoff, retry)).collect();
            let bound = Duration::from_millis(bound);
            assert!(draws.iter().all(|d| *d <= bound), "retry {retry}: {draws:?}");
            assert!(
                draws.iter().any(|d| *d < bound / 4) && draws.iter().any(|d| *d > bound * 3 / 4),
                "retry {retry}: spread from 0 to the bound"
            );
        }
    }

    #[test]
    fn the_budget_allows_a_share_plus_a_floor() {
        let retries = Retries::new(
            RetryBudget {
                ratio: 0.2,
                min_per_second: 10,
            },
            "b",
        );
        for _ in 0..100 {
            retries.deposit();
        }
        let allowed = (0..200).filter(|_| retries.withdraw()).count();
        assert_eq!(allowed, 30, "20% of 100 requests plus 10 per second");
    }

    #[test]
    fn which_failures_and_statuses_go_again() {
        let policy = RetryConfig::default();
        let err = |kind| ProxyError::new(kind, "x");
        assert_eq!(
            Reason::for_error(&policy, &err(ErrorKind::ConnectFailed), false),
            Some(Reason::ConnectFailure),
            "nothing sent: any method"
        );
        assert_eq!(
            Reason::for_error(&policy, &err(ErrorKind::UpstreamReset), false),
            None
        );
        assert_eq!(
            Reason::for_error(&policy, &err(ErrorKind::UpstreamReset), true),
            Some(Reason::Reset)
        );
        assert_eq!(
            Reason::for_error(&policy, &err(ErrorKind::ResponseTimeout), true),
            None
        );
        assert_eq!(
            Reason::for_status(&policy, 503, false),
            None,
            "a POST that may have run"
        );
        assert_eq!(Reason::for_status(&policy, 503, true), Some(Reason::Status(503)));
        assert_eq!(Reason::for_status(&policy, 429, false), Some(Reason::Status(429)));
        assert_eq!(Reason::for_status(&policy, 500, true), None, "not in `on`");
    }
}
