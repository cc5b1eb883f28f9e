//! Durations taken from outside the process, parsed in one place into bounded values: the
//! config file's and the command line's (`10s`), an application's `x-egress-timeout`, and an
//! upstream's `Retry-After`, `retry-after-ms`, `Keep-Alive: timeout=N` and rate-limit resets
//! (OpenAI's Go durations, Anthropic's RFC 3339 times).
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

/// A Go `time.Duration` as printed by Go, which is how OpenAI and Azure write
/// `x-ratelimit-reset-*`: `1s`, `6m0s`, `12ms`, `1m30.5s`, `2h3m4.5s`, `500us` or `500µs`,
/// `10ns`, or a bare `0`. Fractions are kept to the nanosecond, as Go keeps them.
pub fn go(text: &str) -> Result<Duration, DurationError> {
    const FORM: &str = "a Go duration like 1s, 6m0s or 12ms";
    let text = text.trim();
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(DurationError::Malformed(FORM));
    }
    let digits_end = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let longest = LONGEST.as_nanos();
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let (whole, after) = rest.split_at(digits_end(rest));
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => after.split_at(digits_end(after)),
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(not_finite_or(text, FORM));
        }
        let unit_end = after
            .find(|c: char| c == '.' || c.is_ascii_digit())
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_end);
        let per: u128 = match unit {
            "ns" => 1,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(not_finite_or(text, FORM)),
        };
        // Digits only: a parse failure is an overflow of u128, far past the bound.
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| DurationError::TooLong)?
        };
        // Eighteen digits are finer than a nanosecond of any unit; the rest are dropped.
        let fraction = &fraction[..fraction.len().min(18)];
        let part = if fraction.is_empty() {
            0
        } else {
            let scale = 10u128.pow(fraction.len() as u32);
            fraction.parse::<u128>().expect("at most 18 digits") * per / scale
        };
        nanos = whole
            .checked_mul(per)
            .and_then(|n| n.checked_add(part))
            .and_then(|n| n.checked_add(nanos))
            .filter(|n| *n <= longest)
            .ok_or(DurationError::TooLong)?;
        rest = after;
    }
    if negative && nanos > 0 {
        return Err(DurationError::Negative);
    }
    // At most `LONGEST`, so within u64 nanoseconds.
    Ok(Duration::from_nanos(nanos as u64))
}

/// The wait until an RFC 3339 time, as Anthropic writes `anthropic-ratelimit-*-reset`:
/// `2026-11-27T23:10:05Z`, with fractional seconds or a `+HH:MM` / `-HH:MM` offset; zero for
/// a time already past.
pub fn until_rfc3339(text: &str, now: SystemTime) -> Result<Duration, DurationError> {
    let (secs, nanos) = rfc3339_epoch(text.trim()).ok_or(DurationError::Malformed("an RFC 3339 time"))?;
    let Ok(secs) = u64::try_from(secs) else {
        return Ok(Duration::ZERO);
    };
    let at = SystemTime::UNIX_EPOCH + Duration::new(secs, nanos);
    bounded(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Seconds and nanoseconds since the Unix epoch of an RFC 3339 `date-time` (§5.6), the `T`
/// in either case or a space (its §5.6 note), years 0000 to 9999.
fn rfc3339_epoch(text: &str) -> Option<(i64, u32)> {
    let b = text.as_bytes();
    let num = |from: usize, to: usize| -> Option<i64> {
        let digits = b.get(from..to)?;
        digits.iter().try_fold(0i64, |n, d| {
            d.is_ascii_digit().then(|| n * 10 + i64::from(d - b'0'))
        })
    };
    let at = |i: usize, allowed: &[u8]| b.get(i).is_some_and(|c| allowed.contains(c));
    if !(at(4, b"-") && at(7, b"-") && at(10, b"Tt ") && at(13, b":") && at(16, b":")) {
        return None;
    }
    let (year, month, day) = (num(0, 4)?, num(5, 7)?, num(8, 10)?);
    let (hour, minute, second) = (num(11, 13)?, num(14, 16)?, num(17, 19)?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    // A leap second (`:60`) is taken as the second after `:59`.
    if day < 1 || day > month_days || hour > 23 || minute > 59 || second > 60 {
        return None;
    }
    let mut rest = &b[19..];
    let mut nanos = 0u32;
    if let Some(after) = rest.strip_prefix(b".") {
        let end = after
            .iter()
            .position(|c| !c.is_ascii_digit())
            .unwrap_or(after.len());
        if end == 0 {
            return None;
        }
        for (i, d) in after[..end.min(9)].iter().enumerate() {
            nanos += u32::from(d - b'0') * 10u32.pow(8 - i as u32);
        }
        rest = &after[end..];
    }
    let offset = match rest {
        b"Z" | b"z" => 0,
        [sign @ (b'+' | b'-'), h1, h2, b':', m1, m2] => {
            let two = |a: u8, b: u8| {
                (a.is_ascii_digit() && b.is_ascii_digit()).then(|| i64::from((a - b'0') * 10 + (b - b'0')))
            };
            let (h, m) = (two(*h1, *h2)?, two(*m1, *m2)?);
            if h > 23 || m > 59 {
                return None;
            }
            let offset = h * 3600 + m * 60;
            if *sign == b'-' {
                -offset
            } else {
                offset
            }
        }
        _ => return None,
    };
    let days = days_from_civil(year, month, day);
    Some((days * 86_400 + hour * 3600 + minute * 60 + second - offset, nanos))
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
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

    /// The forms Go prints and OpenAI and Azure send, and the ones Go itself refuses.
    #[test]
    fn go_durations() {
        let ms = Duration::from_millis;
        for (text, want) in [
            ("1s", ms(1000)),
            ("6m0s", ms(360_000)),
            ("12ms", ms(12)),
            ("1m30.5s", ms(90_500)),
            ("59.517s", ms(59_517)),
            ("2h3m4.5s", ms(7_384_500)),
            ("0s", Duration::ZERO),
            ("0", Duration::ZERO),
            ("-0", Duration::ZERO),
            (" 7s ", ms(7000)),
            ("+7s", ms(7000)),
            ("500us", Duration::from_micros(500)),
            ("500\u{b5}s", Duration::from_micros(500)),
            ("500\u{3bc}s", Duration::from_micros(500)),
            ("10ns", Duration::from_nanos(10)),
            (".5s", ms(500)),
            ("5.s", ms(5000)),
            ("1.0000000001s", Duration::from_nanos(1_000_000_000)),
            ("0.1234567891234567891234s", Duration::from_nanos(123_456_789)),
            ("8760h", LONGEST),
        ] {
            assert_eq!(go(text), Ok(want), "{text}");
        }
        let form = DurationError::Malformed("a Go duration like 1s, 6m0s or 12ms");
        for text in [
            "", "s", "1", "10", "1x", "1 s", "1.s5", ".s", "1e3s", "1s2", "soon", "-", "1S",
        ] {
            assert_eq!(go(text), Err(form.clone()), "{text:?}");
        }
        assert_eq!(go("-1s"), Err(DurationError::Negative));
        assert_eq!(go("-1m30s"), Err(DurationError::Negative));
        assert_eq!(go("NaN"), Err(DurationError::NotFinite));
        assert_eq!(go("inf"), Err(DurationError::NotFinite));
        assert_eq!(go("99999999h"), Err(DurationError::TooLong));
        assert_eq!(go("8760h1ns"), Err(DurationError::TooLong));
        let max = u128::MAX.to_string();
        assert_eq!(go(&format!("{max}0ns")), Err(DurationError::TooLong));
        assert_eq!(go(&format!("{max}h")), Err(DurationError::TooLong));
    }

    #[test]
    fn rfc3339_times() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let stamp = |d: Duration| humantime::format_rfc3339_seconds(now + d).to_string();
        let later = stamp(Duration::from_secs(65));
        assert_eq!(until_rfc3339(&later, now), Ok(Duration::from_secs(65)), "{later}");
        let past = humantime::format_rfc3339_seconds(now - Duration::from_secs(65)).to_string();
        assert_eq!(until_rfc3339(&past, now), Ok(Duration::ZERO));
        // 1_700_000_000 is 2023-11-14T22:13:20Z.
        for (text, want) in [
            ("2023-11-14T22:13:25Z", Duration::from_secs(5)),
            ("2023-11-14t22:13:25z", Duration::from_secs(5)),
            ("2023-11-14 22:13:25Z", Duration::from_secs(5)),
            ("2023-11-14T22:13:25.25Z", Duration::from_millis(5250)),
            (
                "2023-11-14T22:13:25.123456789123Z",
                Duration::from_nanos(5_123_456_789),
            ),
            ("2023-11-15T00:13:25+02:00", Duration::from_secs(5)),
            ("2023-11-14T20:43:25-01:30", Duration::from_secs(5)),
            ("2023-11-14T22:13:25.5+00:00", Duration::from_millis(5500)),
            ("2023-11-14T22:13:59Z", Duration::from_secs(39)),
            ("2023-11-14T22:13:60Z", Duration::from_secs(40)),
            ("1970-01-01T00:00:00Z", Duration::ZERO),
            ("0001-01-01T00:00:00Z", Duration::ZERO),
        ] {
            assert_eq!(until_rfc3339(text, now), Ok(want), "{text}");
        }
        let form = DurationError::Malformed("an RFC 3339 time");
        for text in [
            "",
            "tomorrow",
            "2023-11-14",
            "2023-11-14T22:13:25",
            "2023-11-14T22:13:25+0200",
            "2023-11-14T22:13:25+02",
            "2023-11-14T22:13:25.Z",
            "2023-13-14T22:13:25Z",
            "2023-02-29T22:13:25Z",
            "2023-11-31T22:13:25Z",
            "2023-11-14T24:13:25Z",
            "2023-11-14T22:60:25Z",
            "2023-11-14T22:13:61Z",
            "2023-11-14T22:13:25+24:00",
            "+2023-11-14T22:13:25Z",
            "2023-11-14X22:13:25Z",
            "2023-1a-14T22:13:25Z",
            "Fri, 31 Dec 9999 23:59:59 GMT",
        ] {
            assert_eq!(until_rfc3339(text, now), Err(form.clone()), "{text:?}");
        }
        assert_eq!(
            until_rfc3339("9999-12-31T23:59:59Z", now),
            Err(DurationError::TooLong)
        );
        assert_eq!(
            until_rfc3339("2024-02-29T00:00:00Z", now),
            Ok(Duration::from_secs(9_164_800)),
            "a leap day"
        );
    }

    /// The calendar arithmetic agrees with humantime's over four centuries of dates.
    #[test]
    fn rfc3339_agrees_with_humantime() {
        let epoch = SystemTime::UNIX_EPOCH;
        let mut at = Duration::from_secs(0);
        while at < Duration::from_secs(400 * 366 * 86_400) {
            let text = humantime::format_rfc3339_seconds(epoch + at).to_string();
            assert_eq!(rfc3339_epoch(&text), Some((at.as_secs() as i64, 0)), "{text}");
            at += Duration::from_secs(86_400 * 7 + 3_607);
        }
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
