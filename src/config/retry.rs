//! The timeout and retry keys: `request_timeout`, `body_idle_timeout` and `retry`, per upstream
//! and in `defaults`, typed and validated.

use std::time::Duration;

use serde::Serialize;

use super::problems::{duration_or, parse_size, Problems};
use super::schema::{FileBackoff, FileRetry, FileRetryBudget, Scalar};
use super::{ser_duration, ser_size};

/// `body_idle_timeout` when not set: long enough for a model that thinks between tokens,
/// short enough that a dead stream does not hold its connection for good.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// What is retried, how often and how soon.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetryConfig {
    /// Extra attempts after the first; 0 = only the connection-level retries.
    pub attempts: u32,
    /// The failures that are retried.
    pub on: RetryOn,
    /// The wait before a retry without `Retry-After`.
    pub backoff: Backoff,
    /// The longest `Retry-After` waited out; a longer one passes the response through.
    #[serde(serialize_with = "ser_duration")]
    pub retry_after_max: Duration,
    /// How many retries an upstream may make.
    pub budget: RetryBudget,
    /// A request body longer than this is not kept, so not retried once sent.
    #[serde(serialize_with = "ser_size")]
    pub buffer_body_up_to: usize,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            attempts: 0,
            on: RetryOn::default(),
            backoff: Backoff {
                base: Duration::from_millis(100),
                max: Duration::from_secs(2),
            },
            retry_after_max: Duration::from_secs(30),
            budget: RetryBudget {
                ratio: 0.2,
                min_per_second: 10,
            },
            buffer_body_up_to: 64 << 10,
        }
    }
}

/// Exponential backoff with full jitter: a wait drawn from 0 up to `base` doubled per retry,
/// at most `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Backoff {
    /// The bound of the first wait.
    #[serde(serialize_with = "ser_duration")]
    pub base: Duration,
    /// The largest bound.
    #[serde(serialize_with = "ser_duration")]
    pub max: Duration,
}

/// Retries per upstream stay under `ratio` of its requests plus `min_per_second`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RetryBudget {
    /// The share of requests that may be retried.
    pub ratio: f32,
    /// Retries allowed per second whatever the ratio allows.
    pub min_per_second: u32,
}

/// `retry.on`: failures without a response, and response statuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryOn {
    /// No connection could be made: nothing was sent, so any method may go again.
    pub connect_failure: bool,
    /// The connection failed after the request went out, before a response head.
    pub reset: bool,
    /// Response statuses (4xx and 5xx).
    pub statuses: Vec<u16>,
}

impl Default for RetryOn {
    fn default() -> Self {
        RetryOn {
            connect_failure: true,
            reset: true,
            statuses: vec![429, 502, 503, 504],
        }
    }
}

impl RetryOn {
    /// Whether a response with `status` is retried.
    pub fn status(&self, status: u16) -> bool {
        self.statuses.contains(&status)
    }
}

impl Serialize for RetryOn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(None)?;
        if self.connect_failure {
            seq.serialize_element("connect_failure")?;
        }
        if self.reset {
            seq.serialize_element("reset")?;
        }
        for status in &self.statuses {
            seq.serialize_element(status)?;
        }
        seq.end()
    }
}

/// `retry` under `prefix`, over `base`: each key present replaces the base's.
pub(super) fn merge_retry(
    base: &RetryConfig,
    raw: &FileRetry,
    prefix: &str,
    problems: &mut Problems,
) -> RetryConfig {
    let key = |k: &str| format!("{prefix}.{k}");
    let attempts = match raw.attempts {
        None => base.attempts,
        Some(n) if n <= 10 => n as u32,
        Some(n) => {
            problems.add(key("attempts"), format!("{n} is more than 10"));
            base.attempts
        }
    };
    let on = match &raw.on {
        None => base.on.clone(),
        Some(items) => parse_on(items, &key("on"), problems),
    };
    let FileBackoff { base: b, max: m } = &raw.backoff;
    let backoff = Backoff {
        base: duration_or(b, base.backoff.base, &key("backoff.base"), problems),
        max: duration_or(m, base.backoff.max, &key("backoff.max"), problems),
    };
    if backoff.base > backoff.max {
        problems.add(
            key("backoff.base"),
            format!(
                "{} is more than {} ({})",
                humantime::format_duration(backoff.base),
                key("backoff.max"),
                humantime::format_duration(backoff.max)
            ),
        );
    }
    let retry_after_max = duration_or(
        &raw.retry_after_max,
        base.retry_after_max,
        &key("retry_after_max"),
        problems,
    );
    let FileRetryBudget {
        ratio,
        min_per_second,
    } = &raw.budget;
    let ratio = match ratio {
        None => base.budget.ratio,
        Some(r) if (0.0..=10.0).contains(r) => *r as f32,
        Some(r) => {
            problems.add(key("budget.ratio"), format!("{r} is outside 0..10"));
            base.budget.ratio
        }
    };
    let min_per_second = match min_per_second {
        None => base.budget.min_per_second,
        Some(n) if *n <= 100_000 => *n as u32,
        Some(n) => {
            problems.add(key("budget.min_per_second"), format!("{n} is more than 100000"));
            base.budget.min_per_second
        }
    };
    let buffer_body_up_to = match &raw.buffer_body_up_to {
        None => base.buffer_body_up_to,
        Some(v) => match parse_size(v) {
            Ok(n) if n <= 16 << 20 => n,
            Ok(n) => {
                problems.add(key("buffer_body_up_to"), format!("{n} bytes is more than 16MiB"));
                base.buffer_body_up_to
            }
            Err(why) => {
                problems.add(key("buffer_body_up_to"), why);
                base.buffer_body_up_to
            }
        },
    };
    RetryConfig {
        attempts,
        on,
        backoff,
        retry_after_max,
        budget: RetryBudget {
            ratio,
            min_per_second,
        },
        buffer_body_up_to,
    }
}

fn parse_on(items: &[Scalar], key: &str, problems: &mut Problems) -> RetryOn {
    let mut on = RetryOn {
        connect_failure: false,
        reset: false,
        statuses: Vec::new(),
    };
    for (i, item) in items.iter().enumerate() {
        let text = match item {
            Scalar::Int(n) => n.to_string(),
            Scalar::Str(s) => s.trim().to_owned(),
        };
        match text.as_str() {
            "connect_failure" => on.connect_failure = true,
            "reset" => on.reset = true,
            code => match code.parse::<u16>() {
                Ok(status) if (400..600).contains(&status) => on.statuses.push(status),
                _ => problems.add(
                    format!("{key}[{i}]"),
                    format!("{text:?} is not connect_failure, reset, or a status 400-599"),
                ),
            },
        }
    }
    on
}

#[cfg(test)]
mod tests {
    use super::super::{parse, Overrides};
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let config = parse(
            "defaults:\n  request_timeout: 30s\n  retry: { attempts: 2, on: [connect_failure, 429, \"503\"] }\n\
             upstreams:\n  - url: http://a.example\n    body_idle_timeout: 0s\n    retry: { backoff: { base: 10ms } }\n",
            &Overrides::default(),
        )
        .unwrap();
        let d = &config.defaults;
        assert_eq!(d.request_timeout, Some(Duration::from_secs(30)));
        assert_eq!(d.body_idle_timeout, Some(DEFAULT_BODY_IDLE_TIMEOUT));
        assert_eq!(d.retry.attempts, 2);
        assert_eq!(
            d.retry.on,
            RetryOn {
                connect_failure: true,
                reset: false,
                statuses: vec![429, 503]
            }
        );
        let up = &config.upstreams[0].settings;
        assert_eq!(up.body_idle_timeout, None, "0s is off");
        assert_eq!(up.request_timeout, Some(Duration::from_secs(30)), "inherited");
        assert_eq!(up.retry.attempts, 2, "retry keys merge one by one");
        assert_eq!(up.retry.backoff.base, Duration::from_millis(10));
        assert_eq!(up.retry.buffer_body_up_to, 65536);
    }

    #[test]
    fn bad_values_name_their_keys() {
        let keys: Vec<String> = super::super::problems(
            "defaults:\n  retry: { on: [teapot], backoff: { base: 5s, max: 1s }, budget: { ratio: -1 } }\n",
        )
        .into_iter()
        .map(|(key, _)| key)
        .collect();
        assert_eq!(
            keys,
            [
                "defaults.retry.on[0]",
                "defaults.retry.backoff.base",
                "defaults.retry.budget.ratio"
            ]
        );
    }
}
