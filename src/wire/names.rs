//! Header names recognised by their bytes: the fields most heads carry, matched a word at a
//! time, before `HeaderName::from_bytes` is asked.
//!
//! `from_bytes` lowercases a name byte by byte into a scratch buffer and then matches it
//! against every standard name of its length; over the eight or so fields of a request and its
//! response that was 800 instructions per request in callgrind, more than httparse spent
//! finding the fields. A name outside this list (and any name `from_bytes` would refuse) still
//! goes to `from_bytes`.

use http::header::{
    ACCEPT, ACCEPT_ENCODING, ACCEPT_LANGUAGE, ACCEPT_RANGES, AGE, AUTHORIZATION, CACHE_CONTROL, CONNECTION,
    CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, COOKIE, DATE, ETAG, EXPECT, HOST, LAST_MODIFIED,
    LOCATION, ORIGIN, PROXY_AUTHORIZATION, SERVER, SET_COOKIE, TE, TRANSFER_ENCODING, UPGRADE, USER_AGENT,
    VARY, VIA,
};
use http::HeaderName;

/// `Keep-Alive`, which http has no constant for; `from_bytes` would allocate it each time.
pub const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// The header name `raw` spells, whatever its case, when it is one of the common fields;
/// `None` otherwise.
///
/// `raw` must be a field name httparse accepted (a token): for token bytes, setting bit
/// `0x20` folds case exactly (no other token byte lands on a letter, a digit or `-`).
pub fn common(raw: &[u8]) -> Option<HeaderName> {
    let name = match raw.len() {
        2 if folded_eq(raw, b"te") => TE,
        3 if folded_eq(raw, b"age") => AGE,
        3 if folded_eq(raw, b"via") => VIA,
        4 if folded_eq(raw, b"host") => HOST,
        4 if folded_eq(raw, b"date") => DATE,
        4 if folded_eq(raw, b"etag") => ETAG,
        4 if folded_eq(raw, b"vary") => VARY,
        6 if folded_eq(raw, b"server") => SERVER,
        6 if folded_eq(raw, b"accept") => ACCEPT,
        6 if folded_eq(raw, b"cookie") => COOKIE,
        6 if folded_eq(raw, b"origin") => ORIGIN,
        6 if folded_eq(raw, b"expect") => EXPECT,
        7 if folded_eq(raw, b"upgrade") => UPGRADE,
        8 if folded_eq(raw, b"location") => LOCATION,
        10 if folded_eq(raw, b"user-agent") => USER_AGENT,
        10 if folded_eq(raw, b"connection") => CONNECTION,
        10 if folded_eq(raw, b"keep-alive") => KEEP_ALIVE,
        10 if folded_eq(raw, b"set-cookie") => SET_COOKIE,
        12 if folded_eq(raw, b"content-type") => CONTENT_TYPE,
        13 if folded_eq(raw, b"authorization") => AUTHORIZATION,
        13 if folded_eq(raw, b"cache-control") => CACHE_CONTROL,
        13 if folded_eq(raw, b"last-modified") => LAST_MODIFIED,
        13 if folded_eq(raw, b"accept-ranges") => ACCEPT_RANGES,
        14 if folded_eq(raw, b"content-length") => CONTENT_LENGTH,
        15 if folded_eq(raw, b"accept-encoding") => ACCEPT_ENCODING,
        15 if folded_eq(raw, b"accept-language") => ACCEPT_LANGUAGE,
        16 if folded_eq(raw, b"content-encoding") => CONTENT_ENCODING,
        17 if folded_eq(raw, b"transfer-encoding") => TRANSFER_ENCODING,
        19 if folded_eq(raw, b"proxy-authorization") => PROXY_AUTHORIZATION,
        _ => return None,
    };
    Some(name)
}

/// A name off the wire: a common one without `from_bytes`, any other through it.
pub fn from_wire(raw: &[u8]) -> Result<HeaderName, http::header::InvalidHeaderName> {
    match common(raw) {
        Some(name) => Ok(name),
        None => HeaderName::from_bytes(raw),
    }
}

/// Whether `raw` names a field an upstream's rate limits are read from (`pace::report`), in
/// any case: OpenAI's and Azure's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`,
/// Anthropic's `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
/// remaining,reset}`, the IETF draft's `RateLimit` and `RateLimit-Policy`, `Retry-After` and
/// `retry-after-ms`. Other `x-ratelimit-*` names (Azure's `*-tokens_usage_based`) are not.
///
/// Asked of every field of every response head, so it looks at the length and the first byte
/// before it compares: a field that is none of these costs a few instructions. For token
/// bytes it is exact; for other bytes it may say yes to a name that is none of these (as
/// [`folded_eq`] may), never no to one that is.
#[inline]
pub fn is_limit_field(raw: &[u8]) -> bool {
    // Inline, and most names (Server, Date, Content-Type) end here: the head parser asks for
    // every field of every response.
    raw.len() >= 9 && matches!(raw[0] | 0x20, b'x' | b'a' | b'r') && limit_field_by_name(raw)
}

/// [`is_limit_field`] past its first test.
fn limit_field_by_name(raw: &[u8]) -> bool {
    const OPENAI: &[&[u8]] = &[
        b"limit-tokens",
        b"reset-tokens",
        b"limit-requests",
        b"reset-requests",
        b"remaining-tokens",
        b"remaining-requests",
    ];
    const ANTHROPIC: &[&[u8]] = &[
        b"tokens-limit",
        b"tokens-reset",
        b"requests-limit",
        b"requests-reset",
        b"tokens-remaining",
        b"requests-remaining",
        b"input-tokens-limit",
        b"input-tokens-reset",
        b"output-tokens-limit",
        b"output-tokens-reset",
        b"input-tokens-remaining",
        b"output-tokens-remaining",
    ];
    let n = raw.len();
    if n < 9 {
        return false;
    }
    let after = |prefix: &[u8], suffixes: &[&[u8]]| {
        let (head, rest) = raw.split_at(prefix.len());
        folded_eq(head, prefix) && suffixes.iter().any(|s| folded_eq(rest, s))
    };
    match raw[0] | 0x20 {
        b'x' => (24..=30).contains(&n) && after(b"x-ratelimit-", OPENAI),
        b'a' => (32..=43).contains(&n) && after(b"anthropic-ratelimit-", ANTHROPIC),
        b'r' => match n {
            9 => folded_eq(raw, b"ratelimit"),
            11 => folded_eq(raw, b"retry-after"),
            14 => folded_eq(raw, b"retry-after-ms"),
            16 => folded_eq(raw, b"ratelimit-policy"),
            _ => false,
        },
        _ => false,
    }
}

/// Whether `raw`, token or field-value bytes, equals `lower` (lowercase letters, digits and
/// `-`) but for case: a word at a time, the last word overlapping the one before.
///
/// Setting bit `0x20` lands a byte on a letter, a digit or `-` only from that letter's other
/// case or from a control byte (0x10-0x19, CR), which neither tokens nor values hold (HTAB
/// lands on `)`). `eq_ignore_ascii_case` took ten instructions a byte (callgrind).
#[inline(always)]
pub fn folded_eq(raw: &[u8], lower: &[u8]) -> bool {
    let n = raw.len();
    if n != lower.len() {
        return false;
    }
    if n >= 8 {
        let word = |s: &[u8], at: usize| u64::from_le_bytes(s[at..at + 8].try_into().expect("8 bytes"));
        let fold = u64::from_le_bytes([0x20; 8]);
        let mut at = 0;
        while at + 8 < n {
            if word(raw, at) | fold != word(lower, at) {
                return false;
            }
            at += 8;
        }
        return word(raw, n - 8) | fold == word(lower, n - 8);
    }
    if n >= 4 {
        let word = |s: &[u8], at: usize| u32::from_le_bytes(s[at..at + 4].try_into().expect("4 bytes"));
        let fold = u32::from_le_bytes([0x20; 4]);
        return word(raw, 0) | fold == word(lower, 0) && word(raw, n - 4) | fold == word(lower, n - 4);
    }
    raw.iter().zip(lower).all(|(r, l)| r | 0x20 == *l)
}

#[cfg(test)]
mod tests {
    use super::{common, from_wire, is_limit_field};
    use http::HeaderName;

    /// Every common name, in any case, is the name `from_bytes` makes of it.
    #[test]
    fn common_names_match_from_bytes_in_any_case() {
        let names = [
            "te",
            "age",
            "via",
            "host",
            "date",
            "etag",
            "vary",
            "server",
            "accept",
            "cookie",
            "origin",
            "expect",
            "upgrade",
            "location",
            "user-agent",
            "connection",
            "keep-alive",
            "set-cookie",
            "content-type",
            "authorization",
            "cache-control",
            "last-modified",
            "accept-ranges",
            "content-length",
            "accept-encoding",
            "accept-language",
            "content-encoding",
            "transfer-encoding",
            "proxy-authorization",
        ];
        for name in names {
            let upper = name.to_ascii_uppercase();
            let title: String = name
                .split('-')
                .map(|w| w[..1].to_ascii_uppercase() + &w[1..])
                .collect::<Vec<_>>()
                .join("-");
            for spelled in [name, upper.as_str(), title.as_str()] {
                let expected = HeaderName::from_bytes(spelled.as_bytes()).unwrap();
                assert_eq!(common(spelled.as_bytes()), Some(expected), "{spelled}");
            }
        }
    }

    /// Near misses of every length class (a letter off at either end, in the middle, a digit
    /// for a letter, a token symbol whose bit 0x20 is set) are not taken for a common name.
    #[test]
    fn near_misses_go_to_from_bytes() {
        for raw in [
            "tf",
            "agf",
            "hosu",
            "dat3",
            "servet",
            "content-lenfth",
            "xontent-length",
            "content-lengtx",
            "content_length",
            "content-lengt~",
            "transfer-encodinf",
            "proxy-authorizatio~",
            "user_agent",
            "x-request-id",
            "ab",
            "a",
            "",
        ] {
            assert_eq!(common(raw.as_bytes()), None, "{raw:?}");
        }
        assert_eq!(from_wire(b"X-Request-Id").unwrap(), "x-request-id");
        assert!(from_wire(b"bad name").is_err());
    }

    /// Each limit field name is one in any case; near misses and other `x-ratelimit-*` names
    /// are not. (`pace::report` checks that it reads exactly these.)
    #[test]
    fn limit_fields_in_any_case() {
        let mut names = vec![
            "ratelimit".to_owned(),
            "ratelimit-policy".to_owned(),
            "retry-after".to_owned(),
            "retry-after-ms".to_owned(),
        ];
        for part in ["limit", "remaining", "reset"] {
            for unit in ["requests", "tokens"] {
                names.push(format!("x-ratelimit-{part}-{unit}"));
            }
            for kind in ["requests", "tokens", "input-tokens", "output-tokens"] {
                names.push(format!("anthropic-ratelimit-{kind}-{part}"));
            }
        }
        assert_eq!(names.len(), 22);
        for name in &names {
            let title: String = name
                .split('-')
                .map(|w| w[..1].to_ascii_uppercase() + &w[1..])
                .collect::<Vec<_>>()
                .join("-");
            for spelled in [name.clone(), name.to_ascii_uppercase(), title] {
                assert!(is_limit_field(spelled.as_bytes()), "{spelled}");
            }
            let mut off = name.clone().into_bytes();
            off.pop();
            assert!(!is_limit_field(&off), "{name} less a byte");
            off.extend_from_slice(b"ss");
            assert!(!is_limit_field(&off), "{name} a byte longer");
            let mut off = name.clone().into_bytes();
            off[name.len() / 2] = b'_';
            assert!(!is_limit_field(&off), "{name} a byte off");
        }
        for raw in [
            "x-ratelimit-limit-tokens_usage_based",
            "x-ratelimit-remaining-tokens_usage_based",
            "x-ratelimit-limit-requests-day",
            "x-ratelimit-reset",
            "x-ratelimit-limit",
            "x_ratelimit-limit-tokens",
            "anthropic-ratelimit-tokens",
            "anthropic-ratelimit-cache-tokens-limit",
            "anthropic-priority-input-tokens-limit",
            "ratelimit-limit",
            "ratelimit-remaining",
            "retry-afte",
            "retry-after-s",
            "x-request-id",
            "content-length",
            "r",
            "",
        ] {
            assert!(!is_limit_field(raw.as_bytes()), "{raw}");
        }
    }

    /// `folded_eq` agrees with `eq_ignore_ascii_case` on every byte string a field value may
    /// hold (tokens are a subset), for the names and tokens it is asked about: random strings
    /// mostly one byte off a target in either case, every byte value a value allows included.
    #[test]
    fn folded_eq_agrees_with_eq_ignore_ascii_case_on_field_bytes() {
        let rng = crate::rng::Xorshift::seeded("folded_eq");
        let allowed: Vec<u8> = (0..=255u8)
            .filter(|b| crate::wire::scan::is_field_value(&[*b]))
            .collect();
        let targets: [&[u8]; 8] = [
            b"te",
            b"close",
            b"upgrade",
            b"keep-alive",
            b"connection",
            b"content-length",
            b"transfer-encoding",
            b"proxy-authenticate",
        ];
        let mut equal = 0;
        for _ in 0..200_000 {
            let target = targets[rng.below(targets.len() as u64) as usize];
            let mut raw: Vec<u8> = target
                .iter()
                .map(|b| {
                    if rng.below(2) == 0 {
                        b.to_ascii_uppercase()
                    } else {
                        *b
                    }
                })
                .collect();
            match rng.below(4) {
                0 => {}
                1 => {
                    let at = rng.below(raw.len() as u64) as usize;
                    raw[at] = allowed[rng.below(allowed.len() as u64) as usize];
                }
                2 => raw.push(allowed[rng.below(allowed.len() as u64) as usize]),
                _ => {
                    raw.pop();
                }
            }
            let expected = raw.eq_ignore_ascii_case(target);
            equal += usize::from(expected);
            assert_eq!(
                super::folded_eq(&raw, target),
                expected,
                "{raw:?} against {target:?}"
            );
        }
        assert!(equal > 45_000, "too few equal cases to mean anything: {equal}");
    }
}
