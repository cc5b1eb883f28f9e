//! Durations taken from outside the process, parsed in one place into bounded values: the
//! config file's and the command line's (`10s`), an application's `x-egress-timeout`, and an
//! upstream's `Retry-After`, `retry-after-ms` and `Keep-Alive: timeout=N`.
//!
//! Every parser here returns a duration no longer than [`LONGEST`], so that adding it to an
//! `Instant` or a `SystemTime` cannot overflow, and refuses what is not one: a negative or
//! non-finite number, a value past the bound, a number too large for its type. What a refusal
//! means is the caller's: a config error naming the key, a `400 bad_request` naming the
//! header an application sent, or a header ignored (and counted) when an upstream sent it.
//!
//! Not here: which header a caller reads, or what it does with the wait.

use std::time::{Duration, SystemTime};

/// The longest duration taken from outside: a year. Longer than any timeout, wait or lifetime
/// an operator or a provider means (nginx refuses timers past 24.8 days), far short of what
/// would overflow the clock.
pub const LONGEST: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Why a text is not a duration the sidecar takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Not in the form the source uses.
    #[error("is not {0}")]
    Malformed(&'static str),
    /// A number below zero.
    #[error("is negative")]
    Negative,
    /// NaN or infinity.
    #[error("is not a finite number")]
    NotFinite,
    /// Past [`LONGEST`], or too large to hold.
    #[error("is longer than a year, the longest duration taken")]
    TooLong,
}

/// A human duration, as the config file and `x-egress-timeout` write it: `250ms`, `10s`,
/// `1h 30m`, or a bare `0`.
pub fn human(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    match humantime::parse_duration(text) {
        Ok(d) => bounded(d),
        Err(humantime::DurationError::NumberOverflow) => Err(DurationError::TooLong),
        Err(_) if text.starts_with('-') => Err(DurationError::Negative),
        Err(_) => Err(not_finite_or(text, "a duration like 250ms, 10s or 5m")),
    }
}

/// Whole seconds, as `Retry-After` (RFC 9110 §10.2.3: `1*DIGIT`) and `Keep-Alive: timeout=`
/// write them.
pub fn seconds(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(match text.strip_prefix('-') {
            Some(rest) if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) => {
                DurationError::Negative
            }
            _ => not_finite_or(text, "a whole number of seconds"),
        });
    }
    // Digits only: a parse failure is an overflow of u64.
    let secs = text.parse::<u64>().map_err(|_| DurationError::TooLong)?;
    bounded(Duration::from_secs(secs))
}

/// Milliseconds, fractions allowed, as `retry-after-ms` (OpenAI, Azure) writes them.
pub fn millis(text: &str) -> Result<Duration, DurationError> {
    let text = text.trim();
    let ms: f64 = text
        .parse()
        .map_err(|_| DurationError::Malformed("a number of milliseconds"))?;
    if !ms.is_finite() {
        return Err(DurationError::NotFinite);
    }
    if ms < 0.0 {
        return Err(DurationError::Negative);
    }
    // Finite and non-negative: only too large a value is left for `try_from_secs_f64` to refuse.
    let d = Duration::try_from_secs_f64(ms / 1000.0).map_err(|_| DurationError::TooLong)?;
    bounded(d)
}

/// The wait until an HTTP date (RFC 9110 §5.6.7), as `Retry-After` may give it instead of
/// seconds; zero for a date already past.
pub fn until(date: &str, now: SystemTime) -> Result<Duration, DurationError> {
    let at = httpdate::parse_http_date(date.trim()).map_err(|_| DurationError::Malformed("an HTTP date"))?;
    bounded(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// `d`, when it is no longer than [`LONGEST`].
pub fn bounded(d: Duration) -> Result<Duration, DurationError> {
    if d > LONGEST {
        Err(DurationError::TooLong)
    } else {
        Ok(d)
    }
}

/// What is wrong with a number that did not parse: NaN and infinities are named as such.
fn not_finite_or(text: &str, form: &'static str) -> DurationError {
    let word = text.trim_start_matches(['+', '-']).to_ascii_lowercase();
    if ["nan", "inf", "infinity"].iter().any(|w| word.starts_with(w)) {
        DurationError::NotFinite
    } else {
        DurationError::Malformed(form)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The extreme values the issue names, with each parser's answer.
    #[test]
    fn extreme_values_are_refused_not_wrapped() {
        let max = u64::MAX.to_string();
        assert_eq!(human(&format!("{max}s")), Err(DurationError::TooLong));
        assert_eq!(human("99999999999999999999999s"), Err(DurationError::TooLong));
        assert_eq!(human("366d"), Err(DurationError::TooLong));
        assert_eq!(human("-1s"), Err(DurationError::Negative));
        assert_eq!(human("NaN"), Err(DurationError::NotFinite));
        assert_eq!(human("inf"), Err(DurationError::NotFinite));
        assert_eq!(
            human("1e30"),
            Err(DurationError::Malformed("a duration like 250ms, 10s or 5m"))
        );

        assert_eq!(seconds(&max), Err(DurationError::TooLong));
        assert_eq!(seconds("184467440737095516150"), Err(DurationError::TooLong));
        assert_eq!(seconds("-1"), Err(DurationError::Negative));
        assert_eq!(seconds("NaN"), Err(DurationError::NotFinite));
        assert_eq!(seconds("inf"), Err(DurationError::NotFinite));
        assert_eq!(
            seconds("1e30"),
            Err(DurationError::Malformed("a whole number of seconds"))
        );
        assert_eq!(
            seconds(""),
            Err(DurationError::Malformed("a whole number of seconds"))
        );

        assert_eq!(millis("1e30"), Err(DurationError::TooLong));
        assert_eq!(millis(&max), Err(DurationError::TooLong));
        assert_eq!(millis("-1"), Err(DurationError::Negative));
        assert_eq!(millis("-0.5"), Err(DurationError::Negative));
        assert_eq!(millis("NaN"), Err(DurationError::NotFinite));
        assert_eq!(millis("inf"), Err(DurationError::NotFinite));
        assert_eq!(millis("-inf"), Err(DurationError::NotFinite));
        assert_eq!(
            millis("soon"),
            Err(DurationError::Malformed("a number of milliseconds"))
        );

        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            until("Fri, 31 Dec 9999 23:59:59 GMT", now),
            Err(DurationError::TooLong)
        );
        assert_eq!(
            until("tomorrow", now),
            Err(DurationError::Malformed("an HTTP date"))
        );
    }

    #[test]
    fn ordinary_values_parse() {
        assert_eq!(human("0"), Ok(Duration::ZERO));
        assert_eq!(human(" 1500ms "), Ok(Duration::from_millis(1500)));
        assert_eq!(human("365d"), Ok(LONGEST), "the bound itself is taken");
        assert_eq!(seconds("30"), Ok(Duration::from_secs(30)));
        assert_eq!(seconds("0"), Ok(Duration::ZERO));
        assert_eq!(millis("250"), Ok(Duration::from_millis(250)));
        assert_eq!(millis("0.5"), Ok(Duration::from_micros(500)));
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(until(&later, now), Ok(Duration::from_secs(90)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(until(&past, now), Ok(Duration::ZERO));
    }

    /// Whatever a parser accepts can be added to the clocks the sidecar keeps.
    #[test]
    fn every_accepted_value_adds_to_a_clock() {
        let now = tokio::time::Instant::now();
        for text in ["365d", "31536000", "31536000000"] {
            let d = human(text)
                .or_else(|_| seconds(text))
                .or_else(|_| millis(text))
                .unwrap();
            assert!(now.checked_add(d).is_some(), "{text}");
            assert!(SystemTime::now().checked_add(d).is_some(), "{text}");
        }
    }
}
