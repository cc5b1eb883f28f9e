//! The `pace` keys, per upstream and in `defaults`: whether an upstream's advertised rate limits
//! hold requests, for how long at most, how much quota is kept back, and whether what is left
//! is spread over the window.

use std::time::Duration;

use serde::Serialize;

use super::problems::{duration_or, Problems};
use super::schema::FilePace;
use super::ser_duration;

/// How an upstream's requests are paced to the limits its responses advertise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PaceConfig {
    /// Read the limit fields and hold requests; off: the fields pass, nothing waits.
    pub enabled: bool,
    /// The longest a request is held; one that would wait longer is answered `429
    /// rate_limited` at once.
    #[serde(serialize_with = "ser_duration")]
    pub max_wait: Duration,
    /// Remaining requests (or tokens) kept back: at or below it, requests wait for the reset.
    pub reserve: u64,
    /// Release what is left evenly until the reset rather than at once.
    pub smooth: bool,
}

impl Default for PaceConfig {
    fn default() -> Self {
        PaceConfig {
            enabled: true,
            max_wait: Duration::from_secs(30),
            reserve: 0,
            smooth: true,
        }
    }
}

/// The most `pace.max_wait` may be: a request held longer than an hour is held by mistake.
const MAX_WAIT_BOUND: Duration = Duration::from_secs(3600);

/// The most `pace.reserve` may be: past any quota a provider gives.
const MAX_RESERVE: u64 = 1_000_000_000;

/// `pace` under `prefix`, over `base`: each key present replaces the base's.
pub(super) fn merge_pace(
    base: &PaceConfig,
    raw: &FilePace,
    prefix: &str,
    problems: &mut Problems,
) -> PaceConfig {
    let key = |k: &str| format!("{prefix}.{k}");
    let max_wait = duration_or(&raw.max_wait, base.max_wait, &key("max_wait"), problems);
    let max_wait = if max_wait > MAX_WAIT_BOUND {
        problems.add(key("max_wait"), "is more than 1h");
        base.max_wait
    } else {
        max_wait
    };
    let reserve = match raw.reserve {
        None => base.reserve,
        Some(n) if n <= MAX_RESERVE => n,
        Some(n) => {
            problems.add(key("reserve"), format!("{n} is more than {MAX_RESERVE}"));
            base.reserve
        }
    };
    PaceConfig {
        enabled: raw.enabled.unwrap_or(base.enabled),
        max_wait,
        reserve,
        smooth: raw.smooth.unwrap_or(base.smooth),
    }
}
