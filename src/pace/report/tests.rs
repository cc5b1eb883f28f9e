//! Tests of reading a response's limit fields: each provider's form, the choices among several
//! quotas, and the values ignored as malformed.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

use super::*;

/// 2023-11-14T22:13:20Z.
fn now() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
}

/// The report of a response with `status` and `fields`, and what was malformed in it.
fn read(status: u16, fields: &[(&str, &str)]) -> (Report, Vec<Malformed>) {
    let mut bad = Vec::new();
    let report = Report::read(
        status,
        fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())),
        now(),
        &mut |m| bad.push(m),
    );
    (report, bad)
}

/// The report of fields that are all well formed.
fn clean(status: u16, fields: &[(&str, &str)]) -> Report {
    let (report, bad) = read(status, fields);
    assert_eq!(bad, [], "{fields:?}");
    report
}

fn quota(limit: Option<u64>, remaining: u64, reset: Option<Duration>) -> Quota {
    Quota {
        limit,
        remaining,
        reset,
        window: None,
    }
}

fn secs(s: u64) -> Option<Duration> {
    Some(Duration::from_secs(s))
}

fn millis(ms: u64) -> Option<Duration> {
    Some(Duration::from_millis(ms))
}

#[test]
fn openai_fields() {
    let report = clean(
        200,
        &[
            ("content-type", "application/json"),
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-reset-tokens", "6m0s"),
        ],
    );
    assert_eq!(report.requests, Some(quota(Some(60), 59, secs(1))));
    assert_eq!(report.tokens, Some(quota(Some(150_000), 149_984, secs(360))));
    assert_eq!(report.retry_after, None);
    for (reset, want) in [
        ("12ms", millis(12)),
        ("1m30.5s", millis(90_500)),
        ("59.517s", millis(59_517)),
        ("2h3m4.5s", millis(7_384_500)),
        ("0s", Some(Duration::ZERO)),
        ("500us", Some(Duration::from_micros(500))),
        ("500µs", Some(Duration::from_micros(500))),
        ("10ns", Some(Duration::from_nanos(10))),
    ] {
        let report = clean(
            200,
            &[
                ("x-ratelimit-remaining-requests", "3"),
                ("x-ratelimit-reset-requests", reset),
            ],
        );
        assert_eq!(report.requests.unwrap().reset, want, "{reset}");
    }
}

/// Azure sends only the remaining pair, and names of its own that are not read.
#[test]
fn azure_fields() {
    let report = clean(
        200,
        &[
            ("x-ratelimit-remaining-requests", "119"),
            ("x-ratelimit-remaining-tokens", "119000"),
            ("x-ratelimit-limit-tokens_usage_based", "oops"),
            ("x-ratelimit-remaining-tokens_usage_based", "-5"),
            ("x-ratelimit-reset-tokens_usage_based", "never"),
        ],
    );
    assert_eq!(report.requests, Some(quota(None, 119, None)));
    assert_eq!(report.tokens, Some(quota(None, 119_000, None)));
}

/// A limit or reset without its remaining is no quota.
#[test]
fn a_quota_needs_its_remaining() {
    let report = clean(
        200,
        &[
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-reset-requests", "1s"),
            ("anthropic-ratelimit-tokens-limit", "1000"),
        ],
    );
    assert!(report.is_empty(), "{report:?}");
    assert!(clean(200, &[]).is_empty());
    assert!(!clean(200, &[("x-ratelimit-remaining-tokens", "0")]).is_empty());
}

#[test]
fn anthropic_fields() {
    let report = clean(
        200,
        &[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("anthropic-ratelimit-requests-remaining", "49"),
            ("anthropic-ratelimit-requests-reset", "2023-11-14T22:13:25Z"),
            ("anthropic-ratelimit-tokens-limit", "90000"),
            ("anthropic-ratelimit-tokens-remaining", "80000"),
            ("anthropic-ratelimit-tokens-reset", "2023-11-14T22:14:20.5Z"),
        ],
    );
    assert_eq!(report.requests, Some(quota(Some(50), 49, secs(5))));
    assert_eq!(report.tokens, Some(quota(Some(90_000), 80_000, millis(60_500))));

    let report = clean(
        200,
        &[
            ("anthropic-ratelimit-requests-remaining", "1"),
            ("anthropic-ratelimit-requests-reset", "2023-11-15T00:13:30+02:00"),
        ],
    );
    assert_eq!(report.requests.unwrap().reset, secs(10), "an offset");
    let report = clean(
        200,
        &[
            ("anthropic-ratelimit-requests-remaining", "1"),
            ("anthropic-ratelimit-requests-reset", "2023-11-14T22:13:00Z"),
        ],
    );
    assert_eq!(
        report.requests.unwrap().reset,
        Some(Duration::ZERO),
        "a reset past"
    );
}

/// Of the token limits sent, the one with the least left is the report's, with its own limit
/// and reset.
#[test]
fn the_token_limit_with_least_left() {
    let all = [
        ("anthropic-ratelimit-tokens-limit", "90000"),
        ("anthropic-ratelimit-tokens-remaining", "80000"),
        ("anthropic-ratelimit-tokens-reset", "2023-11-14T22:14:20Z"),
        ("anthropic-ratelimit-input-tokens-limit", "40000"),
        ("anthropic-ratelimit-input-tokens-remaining", "1200"),
        ("anthropic-ratelimit-input-tokens-reset", "2023-11-14T22:13:30Z"),
        ("anthropic-ratelimit-output-tokens-limit", "8000"),
        ("anthropic-ratelimit-output-tokens-remaining", "7000"),
        ("anthropic-ratelimit-output-tokens-reset", "2023-11-14T22:13:21Z"),
    ];
    assert_eq!(clean(200, &all).tokens, Some(quota(Some(40_000), 1200, secs(10))));
    let output_least: Vec<_> = all
        .iter()
        .map(|&(n, v)| match n {
            "anthropic-ratelimit-output-tokens-remaining" => (n, "5"),
            _ => (n, v),
        })
        .collect();
    assert_eq!(
        clean(200, &output_least).tokens,
        Some(quota(Some(8000), 5, secs(1)))
    );
    // A kind without its remaining is not a candidate, however low its limit.
    let without_input: Vec<_> = all
        .iter()
        .copied()
        .filter(|(n, _)| *n != "anthropic-ratelimit-input-tokens-remaining")
        .collect();
    assert_eq!(
        clean(200, &without_input).tokens,
        Some(quota(Some(8000), 7000, secs(1)))
    );
    let only_output = clean(200, &all[6..]);
    assert_eq!(only_output.tokens, Some(quota(Some(8000), 7000, secs(1))));
    assert_eq!(only_output.requests, None);
    // OpenAI's tokens next to Anthropic's (a gateway passing both): still the least left.
    let report = clean(200, &[("x-ratelimit-remaining-tokens", "300"), all[4]]);
    assert_eq!(report.tokens, Some(quota(None, 300, None)));
}

#[test]
fn ietf_fields() {
    let report = clean(
        200,
        &[
            ("RateLimit-Policy", r#""burst";q=100;w=60, "day";q=1000;w=86400"#),
            ("RateLimit", r#""burst";r=40;t=30, "day";r=900;t=3600"#),
        ],
    );
    assert_eq!(
        report.requests,
        Some(Quota {
            limit: Some(100),
            remaining: 40,
            reset: secs(30),
            window: secs(60),
        })
    );
    assert_eq!(report.tokens, None);

    // The least `r` wins, whichever policy it is and in whatever order the fields came.
    let report = clean(
        200,
        &[
            ("ratelimit", r#""burst";r=40;t=30, "day";r=9;t=3600;pk=:cGsx:"#),
            (
                "ratelimit-policy",
                r#""burst";q=100;w=60, "day";q=1000;w=86400;pk=:cGsx:"#,
            ),
        ],
    );
    assert_eq!(
        report.requests,
        Some(Quota {
            limit: Some(1000),
            remaining: 9,
            reset: secs(3600),
            window: secs(86_400),
        })
    );

    // Without a policy of its name an item counts as requests, with no limit or window.
    let report = clean(200, &[("RateLimit", r#""default";r=5;t=2"#)]);
    assert_eq!(report.requests, Some(quota(None, 5, secs(2))));
    // Without `t`, no reset.
    let report = clean(200, &[("RateLimit", r#""default";r=5"#)]);
    assert_eq!(report.requests, Some(quota(None, 5, None)));
    // Tokens, as the draft's earlier revisions wrote names.
    let report = clean(
        200,
        &[
            ("RateLimit-Policy", "default;q=10;w=1"),
            ("RateLimit", "default;r=3;t=1"),
        ],
    );
    assert_eq!(report.requests.unwrap().limit, Some(10));
    // An empty list says nothing, and is not malformed.
    assert!(clean(200, &[("RateLimit", ""), ("RateLimit-Policy", "")]).is_empty());
}

/// Items whose policy counts other units are passed over; `qu="requests"` is the default.
#[test]
fn ietf_units() {
    let report = clean(
        200,
        &[
            (
                "RateLimit-Policy",
                r#""bytes";q=1000000;qu="content-bytes";w=60, "conc";q=4;qu="concurrent-requests", "req";q=20;qu="requests";w=2"#,
            ),
            ("RateLimit", r#""bytes";r=0;t=50, "conc";r=1, "req";r=15;t=1"#),
        ],
    );
    assert_eq!(
        report.requests,
        Some(Quota {
            limit: Some(20),
            remaining: 15,
            reset: secs(1),
            window: secs(2),
        })
    );
    let report = clean(
        200,
        &[
            ("RateLimit-Policy", r#""bytes";q=1000;qu="content-bytes""#),
            ("RateLimit", r#""bytes";r=0;t=50"#),
        ],
    );
    assert_eq!(report.requests, None, "only bytes");
    // Names are matched exactly: "Req" is not "req".
    let report = clean(
        200,
        &[
            ("RateLimit-Policy", r#""req";q=20;qu="content-bytes""#),
            ("RateLimit", r#""Req";r=7"#),
        ],
    );
    assert_eq!(report.requests, Some(quota(None, 7, None)));
}

/// The lines of a list field are one list (RFC 9651 §4.2): each line's items count.
#[test]
fn ietf_split_lines() {
    let report = clean(
        200,
        &[
            ("RateLimit-Policy", r#""minute";q=60;w=60"#),
            ("RateLimit", r#""minute";r=30;t=20"#),
            ("RateLimit-Policy", r#""second";q=2;w=1"#),
            ("RateLimit", r#""second";r=1;t=1"#),
        ],
    );
    assert_eq!(
        report.requests,
        Some(Quota {
            limit: Some(2),
            remaining: 1,
            reset: secs(1),
            window: secs(1),
        })
    );
}

#[test]
fn names_in_any_case() {
    let report = clean(
        200,
        &[
            ("X-RateLimit-Remaining-Requests", "7"),
            ("X-RATELIMIT-RESET-REQUESTS", "2s"),
            ("x-ratelimit-LIMIT-requests", "10"),
            ("Anthropic-Ratelimit-Output-Tokens-Remaining", "9"),
        ],
    );
    assert_eq!(report.requests, Some(quota(Some(10), 7, secs(2))));
    assert_eq!(report.tokens, Some(quota(None, 9, None)));
    let report = clean(429, &[("RETRY-AFTER", "4")]);
    assert_eq!(report.retry_after, secs(4));
    let report = clean(429, &[("Retry-After-Ms", "40")]);
    assert_eq!(report.retry_after, millis(40));
}

/// A name sent twice: the first value that parses counts; one that does not, before it, is
/// told.
#[test]
fn repeated_names() {
    let report = clean(
        200,
        &[
            ("x-ratelimit-remaining-requests", "5"),
            ("x-ratelimit-remaining-requests", "9"),
            ("X-Ratelimit-Reset-Requests", "1s"),
            ("x-ratelimit-reset-requests", "5s"),
        ],
    );
    assert_eq!(report.requests, Some(quota(None, 5, secs(1))));
    let (report, bad) = read(
        200,
        &[
            ("x-ratelimit-remaining-requests", "many"),
            ("x-ratelimit-remaining-requests", "9"),
            ("x-ratelimit-remaining-requests", "8"),
        ],
    );
    assert_eq!(report.requests, Some(quota(None, 9, None)));
    assert_eq!(bad.len(), 1, "{bad:?}");
    let (report, bad) = read(429, &[("retry-after", "later"), ("retry-after", "3")]);
    assert_eq!((report.retry_after, bad.len()), (secs(3), 1));
}

/// `Retry-After` and `retry-after-ms` are read on 429 and 503 only; on other statuses they are
/// not even checked.
#[test]
fn retry_after_on_429_and_503_only() {
    let date = httpdate::fmt_http_date(now() + Duration::from_secs(90));
    for status in [429, 503] {
        assert_eq!(clean(status, &[("retry-after", "3")]).retry_after, secs(3));
        assert_eq!(clean(status, &[("retry-after", &date)]).retry_after, secs(90));
        assert_eq!(
            clean(status, &[("retry-after", "9"), ("retry-after-ms", "250.5")]).retry_after,
            Some(Duration::from_micros(250_500)),
            "the finer one wins"
        );
    }
    for status in [200, 204, 400, 404, 500, 502, 504] {
        let report = clean(
            status,
            &[
                ("retry-after", "3"),
                ("retry-after-ms", "250"),
                ("retry-after", "garbage"),
            ],
        );
        assert_eq!(report.retry_after, None, "{status}");
        assert!(report.is_empty());
    }
    // A malformed `retry-after-ms` is told and `Retry-After` is read.
    let (report, bad) = read(429, &[("retry-after-ms", "NaN"), ("retry-after", "2")]);
    assert_eq!(report.retry_after, secs(2));
    assert_eq!(
        bad,
        [Malformed {
            header: "retry-after-ms".to_owned(),
            value: "NaN".to_owned(),
            why: "is not a finite number".to_owned(),
        }]
    );
}

/// The issue's absurd values (test 10) and the other malformed ones: each is told once, with
/// its name in lower case, and is as if absent.
#[test]
fn malformed_values_are_told_and_absent() {
    let cases: &[(&str, &str, &str)] = &[
        ("x-ratelimit-reset-requests", "99999999h", "is longer than a year"),
        ("x-ratelimit-reset-requests", "-1s", "is negative"),
        ("x-ratelimit-reset-requests", "soon", "is not a Go duration"),
        ("x-ratelimit-reset-requests", "NaN", "is not a finite number"),
        ("x-ratelimit-limit-requests", "-1", "is negative"),
        ("x-ratelimit-limit-requests", "1.5", "is not a whole number"),
        ("x-ratelimit-limit-requests", "18446744073709551616", "too large"),
        (
            "anthropic-ratelimit-requests-reset",
            "tomorrow",
            "is not an RFC 3339 time",
        ),
        (
            "anthropic-ratelimit-requests-reset",
            "9999-12-31T23:59:59Z",
            "longer than a year",
        ),
        ("anthropic-ratelimit-requests-limit", "", "is not a whole number"),
    ];
    for &(name, value, why) in cases {
        let upper = name.to_ascii_uppercase();
        let remaining = if name.starts_with('x') {
            "x-ratelimit-remaining-requests"
        } else {
            "anthropic-ratelimit-requests-remaining"
        };
        let (report, bad) = read(200, &[(&upper, value), (remaining, "4")]);
        assert_eq!(bad.len(), 1, "{name}: {value}: {bad:?}");
        assert_eq!((bad[0].header.as_str(), bad[0].value.as_str()), (name, value));
        assert!(bad[0].why.contains(why), "{name}: {value}: {}", bad[0].why);
        assert_eq!(
            report.requests,
            Some(quota(None, 4, None)),
            "{name}: {value}: the quota stands, without the malformed part"
        );
    }
    for value in ["-1", "garbage", "NaN", "1e3", "+5", "18446744073709551616", " "] {
        let (report, bad) = read(200, &[("x-ratelimit-remaining-tokens", value)]);
        assert_eq!(report.tokens, None, "{value}");
        assert_eq!(bad.len(), 1, "{value}");
    }
    let (report, bad) = read(200, &[("x-ratelimit-remaining-tokens", "18446744073709551615")]);
    assert_eq!((report.tokens.unwrap().remaining, bad.len()), (u64::MAX, 0));

    for (value, why) in [
        ("-1", "is negative"),
        ("99999999999999999999", "longer than a year"),
        ("1e30", "whole number of seconds"),
        ("inf", "is not an HTTP date"),
    ] {
        let (report, bad) = read(503, &[("retry-after", value)]);
        assert_eq!(report.retry_after, None, "{value}");
        assert_eq!(bad.len(), 1, "{value}");
        assert!(bad[0].why.contains(why), "{value}: {}", bad[0].why);
    }
}

/// A value is cut to 64 characters when told, on a character boundary; bytes that are not
/// UTF-8 are malformed, not a panic.
#[test]
fn told_values_are_cut() {
    let long = "x".repeat(63) + "éé and more";
    let (_, bad) = read(200, &[("x-ratelimit-remaining-requests", &long)]);
    assert_eq!(bad[0].value, "x".repeat(63) + "é");
    let mut bad = Vec::new();
    let report = Report::read(
        200,
        [
            (&b"x-ratelimit-remaining-requests"[..], &b"\xff\xfe"[..]),
            (b"x-ratelimit-reset-requests", b"1\xffs"),
        ],
        now(),
        &mut |m| bad.push(m),
    );
    assert!(report.is_empty());
    assert_eq!(bad.len(), 2, "{bad:?}");
}

#[test]
fn malformed_ietf_fields() {
    let cases: &[(&str, &str, &str)] = &[
        ("RateLimit", "\"default\";r=", "not a structured-field list"),
        ("RateLimit", "\"default;r=5", "not a structured-field list"),
        ("RateLimit", "default;r=5,", "not a structured-field list"),
        ("RateLimit", "r=5, t=3", "not a structured-field list"),
        ("RateLimit", "\"default\";t=3", "without r"),
        ("RateLimit", "\"default\";r=-1", "negative r"),
        ("RateLimit", "\"default\";r=1.5", "r that is not an integer"),
        ("RateLimit", "\"default\";r=\"5\"", "r that is not an integer"),
        ("RateLimit", "(\"a\" \"b\");r=5", "inner list"),
        ("RateLimit", "5;r=5", "not a policy name"),
        ("RateLimit-Policy", "\"default\";q=-5", "negative q"),
        ("RateLimit-Policy", "\"default\";w=5", "without q"),
        (
            "RateLimit-Policy",
            "\"default\";q=5;",
            "not a structured-field list",
        ),
    ];
    for &(name, value, why) in cases {
        let (report, bad) = read(200, &[(name, value)]);
        assert!(report.is_empty(), "{name}: {value}: {report:?}");
        assert_eq!(bad.len(), 1, "{name}: {value}: {bad:?}");
        assert_eq!(bad[0].header, name.to_ascii_lowercase());
        assert!(bad[0].why.contains(why), "{name}: {value}: {}", bad[0].why);
    }

    // The good items of a line with a bad one still count; a malformed `t` or `w` is absent.
    let (report, bad) = read(
        200,
        &[
            ("RateLimit", r#""a";r=-1, "b";r=7;t=-3, "c";r=9"#),
            ("RateLimit-Policy", r#""b";q=10;w=99999999999999, "c";q=20"#),
        ],
    );
    assert_eq!(report.requests, Some(quota(Some(10), 7, None)), "{bad:?}");
    assert_eq!(bad.len(), 2, "one per line: {bad:?}");
    assert!(bad[0].why.contains("negative r"), "{bad:?}");
    assert!(bad[1].why.contains("w that is longer than a year"), "{bad:?}");

    // A policy whose `q` is malformed still says its unit.
    let (report, bad) = read(
        200,
        &[
            ("RateLimit-Policy", r#""t";q=-1;qu="content-bytes""#),
            ("RateLimit", r#""t";r=0"#),
        ],
    );
    assert_eq!((report.requests, bad.len()), (None, 1));
    // A policy whose unit is unreadable counts in no unit.
    let (report, bad) = read(
        200,
        &[
            ("RateLimit-Policy", r#""u";q=5;qu=5"#),
            ("RateLimit", r#""u";r=0"#),
        ],
    );
    assert_eq!((report.requests, bad.len()), (None, 1));
    // A line that is no list is told, and the other lines count.
    let (report, bad) = read(200, &[("RateLimit", "{{{"), ("RateLimit", r#""x";r=2"#)]);
    assert_eq!((report.requests, bad.len()), (Some(quota(None, 2, None)), 1));
}

/// The fields read here are exactly those `wire::names::is_limit_field` knows, so a head
/// whose fields it turns away holds nothing for this module.
#[test]
fn reads_exactly_the_limit_fields() {
    let mut candidates: Vec<String> = Vec::new();
    for (name, _) in FIELDS {
        assert!(is_limit_field(name.as_bytes()), "{name}");
        assert!(is_limit_field(name.to_ascii_uppercase().as_bytes()), "{name}");
        candidates.push(name.to_owned());
        candidates.push(name.to_ascii_uppercase());
        candidates.push(format!("{name}s"));
        candidates.push(name[..name.len() - 1].to_owned());
        candidates.push(name.replacen('-', "_", 1));
        candidates.push(name.replace("tokens", "tokens_usage_based"));
    }
    for prefix in ["x-ratelimit-", "anthropic-ratelimit-", "ratelimit-", "retry-"] {
        for rest in [
            "",
            "limit",
            "reset",
            "remaining",
            "requests",
            "tokens",
            "policy",
            "after",
            "-ms",
        ] {
            candidates.push(format!("{prefix}{rest}"));
        }
    }
    let mut read_here = 0;
    for name in &candidates {
        let known = field(name.as_bytes()).is_some();
        assert_eq!(is_limit_field(name.as_bytes()), known, "{name}");
        read_here += usize::from(known);
        if !known {
            let (report, bad) = read(429, &[(name, "1")]);
            assert!(report.is_empty() && bad.is_empty(), "{name}");
        }
    }
    assert!(read_here >= 44, "{read_here}");
}

/// `retry_after` over a header map, as the retry loop calls it: the first value that parses.
#[test]
fn retry_after_over_a_map() {
    let mut headers = HeaderMap::new();
    headers.append("retry-after", "soon".parse().unwrap());
    headers.append("retry-after", "6".parse().unwrap());
    let mut ignored = Vec::new();
    let wait = retry_after(&headers, now(), &mut |name, value, e| {
        ignored.push((name, value.to_owned(), e))
    });
    assert_eq!(wait, secs(6));
    assert_eq!(
        ignored,
        [(
            "retry-after",
            "soon".to_owned(),
            DurationError::Malformed("an HTTP date")
        )]
    );
    assert_eq!(
        retry_after(&HeaderMap::new(), now(), &mut |_, _, _| panic!()),
        None
    );
}
