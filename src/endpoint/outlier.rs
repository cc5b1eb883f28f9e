//! Passive outlier detection: when an endpoint's run of failures ejects it, for how long, and
//! the cap that keeps at least half of an upstream's endpoints in use.
//!
//! After an ejection the endpoint is tried again (a probe): its failure run is kept, so one more
//! failure ejects it again for twice as long, and one success clears both the run and the
//! backoff. This is Envoy's consecutive-failure detector with linkerd2-proxy's probe after a
//! backoff.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::OutlierConfig;

/// One endpoint's ejection record.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Health {
    /// Ejections since the last success: the backoff's exponent.
    pub(super) ejections: u32,
    /// Ejected until then.
    pub(super) ejected_until: Option<Instant>,
}

impl Health {
    pub(super) fn is_ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }
}

/// Whether a run of `failures` ejects the endpoint now, when `ejected` of `total` endpoints are
/// ejected already: never more than half of them (rounded down), so a lone endpoint is never
/// ejected and a set whose endpoints all fail keeps using half of them.
pub(super) fn ejects(cfg: &OutlierConfig, failures: u32, ejected: usize, total: usize) -> bool {
    cfg.consecutive_failures > 0 && failures >= cfg.consecutive_failures && ejected < total / 2
}

/// The length of an endpoint's next ejection: `base_ejection` doubled for each earlier one since
/// its last success, at most `max_ejection`.
pub(super) fn ejection_length(cfg: &OutlierConfig, earlier: u32) -> Duration {
    let factor = 1u32.checked_shl(earlier.min(31)).unwrap_or(u32::MAX);
    cfg.base_ejection
        .checked_mul(factor)
        .unwrap_or(cfg.max_ejection)
        .min(cfg.max_ejection)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection: Duration::from_secs(5),
            max_ejection: Duration::from_secs(120),
        }
    }

    #[test]
    fn three_failures_eject_within_half_of_the_set() {
        assert!(!ejects(&cfg(), 2, 0, 2));
        assert!(ejects(&cfg(), 3, 0, 2));
        assert!(
            !ejects(&cfg(), 3, 1, 2),
            "the second of two would be more than half"
        );
        assert!(!ejects(&cfg(), 10, 0, 1), "a lone endpoint stays");
        assert!(ejects(&cfg(), 3, 1, 5) && !ejects(&cfg(), 3, 2, 5));
        let off = OutlierConfig {
            consecutive_failures: 0,
            ..cfg()
        };
        assert!(!ejects(&off, 100, 0, 4));
    }

    #[test]
    fn ejections_double_up_to_the_max() {
        let secs = |n| ejection_length(&cfg(), n).as_secs();
        assert_eq!(
            [secs(0), secs(1), secs(2), secs(4), secs(5), secs(40)],
            [5, 10, 20, 80, 120, 120]
        );
    }
}
