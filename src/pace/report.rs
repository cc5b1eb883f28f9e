//! What one response says about its upstream's rate limits, read from the header forms in use:
//! OpenAI's and Azure's `x-ratelimit-*`, Anthropic's `anthropic-ratelimit-*`, the IETF draft's
//! `RateLimit` and `RateLimit-Policy`, and `Retry-After` / `retry-after-ms` on 429 and 503.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderValue};

use crate::duration::{self, DurationError};
use crate::wire::names::is_limit_field;

/// A limit's state in one unit, as one response gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quota {
    /// The window's whole quota, when sent.
    pub limit: Option<u64>,
    /// What is left of it.
    pub remaining: u64,
    /// Until the quota is whole again, when sent. A reset written in whole seconds is rounded
    /// up by its sender, so this is an upper bound.
    pub reset: Option<Duration>,
    /// The window's length, when sent (the IETF policy's `w`).
    pub window: Option<Duration>,
}

/// Which tokens a tokens quota counts: Anthropic limits input and output apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Counted {
    /// Input and output (OpenAI's `-tokens`, Anthropic's combined `tokens`).
    #[default]
    All,
    /// Input not read from a prompt cache (Anthropic's `input-tokens`: cache reads do not
    /// count against it).
    Input,
    /// Output (Anthropic's `output-tokens`).
    Output,
}

/// What a response says of its upstream's limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Requests: of several forms sent together (a gateway's `RateLimit` beside its
    /// provider's fields), the one with the least left.
    pub requests: Option<Quota>,
    /// Tokens: of several token limits (Anthropic's input and output, or several forms), the
    /// one with the least left.
    pub tokens: Option<Quota>,
    /// Which tokens `tokens` counts.
    pub tokens_counted: Counted,
    /// How long a 429 or 503 asks every request to wait: `retry-after-ms`, else `Retry-After`.
    pub retry_after: Option<Duration>,
}

/// A limit field whose value was ignored: its name (lower case), the value (at most 64
/// characters), and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed {
    /// The field's name.
    pub header: String,
    /// Its value.
    pub value: String,
    /// What is wrong with it.
    pub why: String,
}

impl Report {
    /// Reads the limit fields among `fields` (name and value bytes as received, names in any
    /// case) of a response with `status`, received at `now`. A value that does not parse is
    /// treated as absent and told to `malformed`; fields this module does not read are passed
    /// over. Of a name sent more than once, the first value that parses counts (but the lines
    /// of `RateLimit` and `RateLimit-Policy` are one list, RFC 9651 §4.2, so all count).
    pub fn read<'a>(
        status: u16,
        fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        now: SystemTime,
        malformed: &mut dyn FnMut(Malformed),
    ) -> Report {
        let mut tell = |header: &'static str, value: &[u8], why: String| {
            malformed(Malformed {
                header: header.to_owned(),
                value: String::from_utf8_lossy(value).chars().take(64).collect(),
                why,
            })
        };
        let mut openai = [Parts::default(); 2];
        let mut anthropic = [Parts::default(); 4];
        let mut policies = Vec::new();
        let mut limits = Vec::new();
        let (mut waits_ms, mut waits) = (Vec::new(), Vec::new());
        for (name, value) in fields {
            let Some((header, field)) = field(name) else {
                continue;
            };
            let parts = match field {
                Field::OpenAi(part, unit) => (&mut openai[unit as usize], part),
                Field::Anthropic(part, kind) => (&mut anthropic[kind as usize], part),
                Field::RateLimitPolicy => {
                    if let Err(why) = ietf::policies(value, &mut policies) {
                        tell(header, value, why);
                    }
                    continue;
                }
                Field::RateLimit => {
                    if let Err(why) = ietf::limits(value, &mut limits) {
                        tell(header, value, why);
                    }
                    continue;
                }
                Field::RetryAfterMs | Field::RetryAfter if !matches!(status, 429 | 503) => continue,
                Field::RetryAfterMs => {
                    waits_ms.push(value);
                    continue;
                }
                Field::RetryAfter => {
                    waits.push(value);
                    continue;
                }
            };
            let read = match parts {
                (parts, Part::Limit) if parts.limit.is_none() => count(value).map(|n| parts.limit = Some(n)),
                (parts, Part::Remaining) if parts.remaining.is_none() => {
                    count(value).map(|n| parts.remaining = Some(n))
                }
                (parts, Part::Reset) if parts.reset.is_none() => {
                    let reset = match field {
                        Field::OpenAi(..) => text(value).and_then(|t| said(duration::go(t))),
                        _ => text(value).and_then(|t| said(duration::until_rfc3339(t, now))),
                    };
                    reset.map(|d| parts.reset = Some(d))
                }
                _ => Ok(()),
            };
            if let Err(why) = read {
                tell(header, value, why);
            }
        }
        let standard = ietf::requests(&policies, &limits);
        let requests = [openai[0].quota(), anthropic[0].quota(), standard];
        let tokens = [
            (openai[1].quota(), Counted::All),
            (anthropic[1].quota(), Counted::All),
            (anthropic[2].quota(), Counted::Input),
            (anthropic[3].quota(), Counted::Output),
        ];
        let least_tokens = tokens
            .into_iter()
            .filter_map(|(quota, counted)| Some((quota?, counted)))
            .reduce(|least, q| {
                if q.0.remaining < least.0.remaining {
                    q
                } else {
                    least
                }
            });
        let retry_after = asked_wait(waits_ms, waits, now, &mut |header, value, e| {
            tell(header, value.as_bytes(), e.to_string())
        });
        Report {
            requests: least(requests.into_iter().flatten()),
            tokens: least_tokens.map(|(quota, _)| quota),
            tokens_counted: least_tokens.map_or(Counted::All, |(_, counted)| counted),
            retry_after,
        }
    }

    /// Whether it says nothing.
    pub fn is_empty(&self) -> bool {
        *self == Report::default()
    }
}

/// How long a response asks to wait before the next request: `retry-after-ms` (milliseconds,
/// as OpenAI and Azure send it), else `Retry-After` in seconds or as an HTTP date (RFC 9110
/// §10.2.3), whatever the status (the caller knows whether it is one that asks). `None` when
/// there is none that parses into a bounded duration ([`crate::duration`]); each one that does
/// not goes to `ignored` (its name, value and why), as if it were not there.
pub fn retry_after(
    headers: &HeaderMap,
    now: SystemTime,
    ignored: &mut dyn FnMut(&'static str, &str, DurationError),
) -> Option<Duration> {
    let values = |name| headers.get_all(name).into_iter().map(HeaderValue::as_bytes);
    asked_wait(values(RETRY_AFTER_MS), values(RETRY_AFTER), now, ignored)
}

const RETRY_AFTER_MS: &str = "retry-after-ms";
const RETRY_AFTER: &str = "retry-after";

/// [`retry_after`] over the values of each field, in the order received: the first that
/// parses.
fn asked_wait<'v>(
    millis: impl IntoIterator<Item = &'v [u8]>,
    after: impl IntoIterator<Item = &'v [u8]>,
    now: SystemTime,
    ignored: &mut dyn FnMut(&'static str, &str, DurationError),
) -> Option<Duration> {
    for value in millis {
        let value = String::from_utf8_lossy(value);
        match duration::millis(&value) {
            Ok(wait) => return Some(wait),
            Err(e) => ignored(RETRY_AFTER_MS, &value, e),
        }
    }
    for value in after {
        let value = String::from_utf8_lossy(value);
        let value = value.trim();
        let wait = if value.bytes().next().is_some_and(|b| b.is_ascii_alphabetic()) {
            duration::until(value, now)
        } else {
            duration::seconds(value)
        };
        match wait {
            Ok(wait) => return Some(wait),
            Err(e) => ignored(RETRY_AFTER, value, e),
        }
    }
    None
}

/// A field read here: its form and what of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// `x-ratelimit-{part}-{unit}`.
    OpenAi(Part, Unit),
    /// `anthropic-ratelimit-{kind}-{part}`.
    Anthropic(Part, Kind),
    RateLimitPolicy,
    RateLimit,
    RetryAfterMs,
    RetryAfter,
}

/// Which figure of a quota.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Limit,
    Remaining,
    Reset,
}

/// OpenAI's units, indexing its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Requests = 0,
    Tokens = 1,
}

/// Anthropic's limits, indexing its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Requests = 0,
    Tokens = 1,
    InputTokens = 2,
    OutputTokens = 3,
}

/// Every field read, by its lower-case name: the names `wire::names::is_limit_field` knows.
const FIELDS: [(&str, Field); 22] = {
    use Field::{Anthropic as A, OpenAi as O};
    use Part::{Limit as L, Remaining as Rm, Reset as Rs};
    [
        ("x-ratelimit-limit-requests", O(L, Unit::Requests)),
        ("x-ratelimit-remaining-requests", O(Rm, Unit::Requests)),
        ("x-ratelimit-reset-requests", O(Rs, Unit::Requests)),
        ("x-ratelimit-limit-tokens", O(L, Unit::Tokens)),
        ("x-ratelimit-remaining-tokens", O(Rm, Unit::Tokens)),
        ("x-ratelimit-reset-tokens", O(Rs, Unit::Tokens)),
        ("anthropic-ratelimit-requests-limit", A(L, Kind::Requests)),
        ("anthropic-ratelimit-requests-remaining", A(Rm, Kind::Requests)),
        ("anthropic-ratelimit-requests-reset", A(Rs, Kind::Requests)),
        ("anthropic-ratelimit-tokens-limit", A(L, Kind::Tokens)),
        ("anthropic-ratelimit-tokens-remaining", A(Rm, Kind::Tokens)),
        ("anthropic-ratelimit-tokens-reset", A(Rs, Kind::Tokens)),
        ("anthropic-ratelimit-input-tokens-limit", A(L, Kind::InputTokens)),
        (
            "anthropic-ratelimit-input-tokens-remaining",
            A(Rm, Kind::InputTokens),
        ),
        ("anthropic-ratelimit-input-tokens-reset", A(Rs, Kind::InputTokens)),
        (
            "anthropic-ratelimit-output-tokens-limit",
            A(L, Kind::OutputTokens),
        ),
        (
            "anthropic-ratelimit-output-tokens-remaining",
            A(Rm, Kind::OutputTokens),
        ),
        (
            "anthropic-ratelimit-output-tokens-reset",
            A(Rs, Kind::OutputTokens),
        ),
        ("ratelimit-policy", Field::RateLimitPolicy),
        ("ratelimit", Field::RateLimit),
        (RETRY_AFTER_MS, Field::RetryAfterMs),
        (RETRY_AFTER, Field::RetryAfter),
    ]
};

/// The field `name` is, with its lower-case name; `None` for a field not read here, which
/// most are: `is_limit_field` turns those away before the table is searched.
fn field(name: &[u8]) -> Option<(&'static str, Field)> {
    if !is_limit_field(name) {
        return None;
    }
    FIELDS
        .iter()
        .find(|(known, _)| known.as_bytes().eq_ignore_ascii_case(name))
        .copied()
}

/// What one form said of one limit so far.
#[derive(Debug, Clone, Copy, Default)]
struct Parts {
    limit: Option<u64>,
    remaining: Option<u64>,
    reset: Option<Duration>,
}

impl Parts {
    /// The quota, when its remaining was sent.
    fn quota(&self) -> Option<Quota> {
        Some(Quota {
            limit: self.limit,
            remaining: self.remaining?,
            reset: self.reset,
            window: None,
        })
    }
}

/// Of the quotas given, the one with the least left (the first of equals).
fn least(quotas: impl IntoIterator<Item = Quota>) -> Option<Quota> {
    quotas
        .into_iter()
        .reduce(|least, q| if q.remaining < least.remaining { q } else { least })
}

/// A value as text: limit fields are ASCII.
fn text(value: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(value).map_err(|_| "is not text".to_owned())
}

/// A duration's error as the why of a [`Malformed`].
fn said(parsed: Result<Duration, DurationError>) -> Result<Duration, String> {
    parsed.map_err(|e| e.to_string())
}

/// A count (a limit, what remains of it): a whole number, at least zero, that fits 64 bits.
fn count(value: &[u8]) -> Result<u64, String> {
    let digits = value.trim_ascii();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        let negative = digits
            .strip_prefix(b"-")
            .is_some_and(|rest| !rest.is_empty() && rest.iter().all(u8::is_ascii_digit));
        return Err(if negative {
            "is negative"
        } else {
            "is not a whole number"
        }
        .to_owned());
    }
    std::str::from_utf8(digits)
        .expect("ASCII digits")
        .parse()
        .map_err(|_| "is too large for 64 bits".to_owned())
}

/// The IETF draft's fields (draft-ietf-httpapi-ratelimit-headers-11): `RateLimit-Policy`,
/// what each policy allows (`q`) in which unit (`qu`) over which window (`w`), and
/// `RateLimit`, what is left of each (`r`) and until when (`t`).
mod ietf {
    use std::time::Duration;

    use sfv::{BareItem, ListEntry, Parser};

    use super::Quota;
    use crate::duration;

    /// One `RateLimit-Policy` item.
    #[derive(Debug)]
    pub(super) struct Policy {
        name: String,
        /// `q`, unless it was malformed.
        quota: Option<u64>,
        /// Whether its unit (`qu`) is requests, the unit when none is given.
        in_requests: bool,
        window: Option<Duration>,
    }

    /// One `RateLimit` item.
    #[derive(Debug)]
    pub(super) struct Limit {
        name: String,
        remaining: u64,
        reset: Option<Duration>,
    }

    /// Adds the policies of one `RateLimit-Policy` line to `into`. A line that is no list is
    /// the `Err`; so is the first malformed part of an item, the rest of the line counting: an
    /// item that is no policy is left out, a malformed parameter is as if absent (a policy
    /// with a malformed unit is in no unit read here).
    pub(super) fn policies(value: &[u8], into: &mut Vec<Policy>) -> Result<(), String> {
        let mut problem = None;
        for entry in list(value)? {
            let Some((name, params)) = kept(entry, &mut problem) else {
                continue;
            };
            if !params.iter().any(|(key, _)| key == "q") {
                problem.get_or_insert_with(|| "has a policy without q".to_owned());
            }
            let mut policy = Policy {
                name,
                quota: None,
                in_requests: true,
                window: None,
            };
            for (key, value) in params {
                match key.as_str() {
                    "q" => policy.quota = kept(number(&value, "q"), &mut problem),
                    "qu" => {
                        let unit = kept(
                            name_of(&value).ok_or("has a qu that is not a string"),
                            &mut problem,
                        );
                        policy.in_requests = unit.is_some_and(|unit| unit == "requests");
                    }
                    "w" => policy.window = kept(seconds(&value, "w"), &mut problem),
                    _ => {}
                }
            }
            into.push(policy);
        }
        problem.map_or(Ok(()), Err)
    }

    /// Adds the items of one `RateLimit` line to `into`, as [`policies`] does: an item without
    /// a valid `r` is left out, a malformed `t` is as if absent.
    pub(super) fn limits(value: &[u8], into: &mut Vec<Limit>) -> Result<(), String> {
        let mut problem = None;
        for entry in list(value)? {
            let Some((name, params)) = kept(entry, &mut problem) else {
                continue;
            };
            if !params.iter().any(|(key, _)| key == "r") {
                problem.get_or_insert_with(|| "has an item without r".to_owned());
            }
            let (mut remaining, mut reset) = (None, None);
            for (key, value) in params {
                match key.as_str() {
                    "r" => remaining = kept(number(&value, "r"), &mut problem),
                    "t" => reset = kept(seconds(&value, "t"), &mut problem),
                    _ => {}
                }
            }
            if let Some(remaining) = remaining {
                into.push(Limit {
                    name,
                    remaining,
                    reset,
                });
            }
        }
        problem.map_or(Ok(()), Err)
    }

    /// `result`'s value; its error, when it is the first, goes to `problem`.
    fn kept<T, E: Into<String>>(result: Result<T, E>, problem: &mut Option<String>) -> Option<T> {
        match result {
            Ok(value) => Some(value),
            Err(why) => {
                problem.get_or_insert_with(|| why.into());
                None
            }
        }
    }

    /// The requests quota the items say the least is left of: each `RateLimit` item with the
    /// policy of its name, counted when that policy is in requests or there is none (the unit
    /// then is requests).
    pub(super) fn requests(policies: &[Policy], limits: &[Limit]) -> Option<Quota> {
        super::least(limits.iter().filter_map(|limit| {
            let policy = policies.iter().find(|p| p.name == limit.name);
            if policy.is_some_and(|p| !p.in_requests) {
                return None;
            }
            Some(Quota {
                limit: policy.and_then(|p| p.quota),
                remaining: limit.remaining,
                reset: limit.reset,
                window: policy.and_then(|p| p.window),
            })
        }))
    }

    type Entry = Result<(String, Vec<(String, BareItem)>), String>;

    /// The items of a structured-field list: each its name and its parameters, or why it is
    /// no such item.
    fn list(value: &[u8]) -> Result<Vec<Entry>, String> {
        let list: sfv::List = Parser::new(value)
            .parse_list()
            .map_err(|e| format!("is not a structured-field list ({e})"))?;
        Ok(list
            .into_iter()
            .map(|entry| {
                let ListEntry::Item(item) = entry else {
                    return Err("has an inner list".to_owned());
                };
                let name = name_of(&item.bare_item).ok_or("has an item that is not a policy name")?;
                let params = item
                    .params
                    .into_iter()
                    .map(|(key, value)| (key.as_str().to_owned(), value))
                    .collect();
                Ok((name.to_owned(), params))
            })
            .collect())
    }

    /// A name: the draft writes strings; its earlier revisions wrote tokens.
    fn name_of(item: &BareItem) -> Option<&str> {
        match item {
            BareItem::String(s) => Some(s.as_str()),
            BareItem::Token(t) => Some(t.as_str()),
            _ => None,
        }
    }

    /// A parameter that is a count: an integer, at least zero.
    fn number(value: &BareItem, key: &str) -> Result<u64, String> {
        let n = value
            .as_integer()
            .map(i64::from)
            .ok_or_else(|| format!("has a {key} that is not an integer"))?;
        u64::try_from(n).map_err(|_| format!("has a negative {key}"))
    }

    /// A parameter that is whole seconds, at most [`duration::LONGEST`].
    fn seconds(value: &BareItem, key: &str) -> Result<Duration, String> {
        let secs = Duration::from_secs(number(value, key)?);
        duration::bounded(secs).map_err(|e| format!("has a {key} that {e}"))
    }
}

#[cfg(test)]
mod tests;
