//! What validation reports and the parsers every config section shares: [`Problems`], the
//! list each finding goes into, and durations and sizes as the file writes them. The sections
//! and `validate` both use this file; it uses neither.

use std::time::Duration;

use super::schema::Scalar;
use super::Problem;

/// Every problem validation finds, each naming its key: reported together, not one at a time.
#[derive(Default)]
pub(super) struct Problems(Vec<Problem>);

impl Problems {
    pub(super) fn add(&mut self, key: impl Into<String>, reason: impl Into<String>) {
        self.0.push(Problem {
            key: key.into(),
            reason: reason.into(),
        });
    }

    /// Unwraps a parse result, recording the error against `key` and falling back to `fallback`.
    pub(super) fn take<T>(&mut self, key: &str, result: Result<T, String>, fallback: T) -> T {
        result.unwrap_or_else(|reason| {
            self.add(key, reason);
            fallback
        })
    }

    /// Every problem recorded, in the order found.
    pub(super) fn into_vec(self) -> Vec<Problem> {
        self.0
    }
}

// === scalar parsers ===

pub(super) fn parse_duration(value: &Scalar) -> Result<Duration, String> {
    match value {
        Scalar::Int(0) => Ok(Duration::ZERO),
        Scalar::Int(n) => Err(format!("{n} needs a unit, e.g. {n}s or {n}ms")),
        Scalar::Str(s) if s.trim() == "0" => Ok(Duration::ZERO),
        Scalar::Str(s) => crate::duration::human(s).map_err(|e| format!("{s:?} {e}")),
    }
}

pub(super) fn duration_or(
    raw: &Option<Scalar>,
    base: Duration,
    key: &str,
    problems: &mut Problems,
) -> Duration {
    match raw {
        Some(v) => problems.take(key, parse_duration(v), base),
        None => base,
    }
}

/// Like [`duration_or`], where 0 means "off".
pub(super) fn opt_duration_or(
    raw: &Option<Scalar>,
    base: Option<Duration>,
    key: &str,
    problems: &mut Problems,
) -> Option<Duration> {
    match raw {
        Some(v) => problems
            .take(key, parse_duration(v).map(Some), base)
            .filter(|d| !d.is_zero()),
        None => base,
    }
}

/// `65536`, `64KiB`, `1MiB`, `64KB` (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024).
pub(super) fn parse_size(value: &Scalar) -> Result<usize, String> {
    let text = match value {
        Scalar::Int(n) => return usize::try_from(*n).map_err(|_| format!("{n} is too large")),
        Scalar::Str(s) => s.trim(),
    };
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 65536, 64KiB or 1MiB"))?;
    let multiplier: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "k" => 1 << 10,
        "MiB" | "M" | "m" => 1 << 20,
        "GiB" | "G" | "g" => 1 << 30,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => return Err(format!("{text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB)")),
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size(&Scalar::Str("64KiB".into())), Ok(65536));
        assert_eq!(parse_size(&Scalar::Int(4096)), Ok(4096));
        assert!(parse_size(&Scalar::Str("64 parsecs".into())).is_err());
        assert_eq!(
            parse_duration(&Scalar::Str("250ms".into())),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(parse_duration(&Scalar::Int(0)), Ok(Duration::ZERO));
        assert!(parse_duration(&Scalar::Int(5)).is_err());
    }
}
