//! A plain request's header fields kept as the lines they came in, for the upstream's head.
//!
//! Most requests carry only fields the sidecar passes on untouched (`Host`, `User-Agent`,
//! `Accept`...). Building them into an `http::HeaderMap` (a hash and an insert each, `Host`
//! replaced, the map walked again to write the upstream's head, its values dropped) was about a
//! tenth of the plain release build's instructions per HTTP/1.1 request, and of the code lines
//! it runs (`benches/RESULTS.md`, issue 47). A head the plain scan took whole (`wire::scan`),
//! whose first field is `Host` and whose other fields are none that a step of the request path
//! reads or removes ([`is_passed_through`]), leaves its map empty and its fields here: the
//! HTTP/1.1 client writes the upstream's `Host` and these lines as they are; the HTTP/2 client
//! encodes them, names lowercased ([`HeadLines::for_each_field`]).
//!
//! Any step that reads or writes the map by a name these lines could hold (an access-log line
//! or a trace, header rules, the global rate limit, reading a known provider's LLM usage, a
//! parent proxy, routing an origin-form target by `Host`, a retry by policy or a deadline,
//! which own the request) calls [`HeadLines::into_map`] first, which builds the map the parse
//! would have built; `proxy` and `upstream` decide where.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};

/// A request's fields as their lines, or nothing (its fields are in its map).
#[derive(Debug, Default)]
pub struct HeadLines {
    kept: Option<Kept>,
}

#[derive(Debug)]
struct Kept {
    /// The field lines, the head's blank line included: `Host: value\r\n` first, then
    /// `name: value\r\n`... and `\r\n`.
    lines: Bytes,
    /// Where the lines after `Host`'s start.
    rest: usize,
    /// The upstream's `Host`, once the request is rewritten for it (`proxy::headers`).
    upstream_host: Option<HeaderValue>,
}

impl HeadLines {
    /// No lines: the fields are in the map.
    pub const NONE: &'static HeadLines = &HeadLines { kept: None };

    /// Fields kept as `lines` (ending in the blank line), the first of them `Host`, the
    /// others from `rest` on.
    pub(super) fn keep(&mut self, lines: Bytes, rest: usize) {
        debug_assert!(lines.ends_with(b"\r\n") && rest <= lines.len() - 2);
        self.kept = Some(Kept {
            lines,
            rest,
            upstream_host: None,
        });
    }

    /// The fields are here, and the request's map is empty of them.
    pub fn is_kept(&self) -> bool {
        self.kept.is_some()
    }

    /// Sets the `Host` the upstream gets; `false` (and nothing set) when the fields are in the
    /// map, where the caller sets it.
    pub fn set_upstream_host(&mut self, host: &HeaderValue) -> bool {
        match &mut self.kept {
            Some(kept) => {
                kept.upstream_host = Some(host.clone());
                true
            }
            None => false,
        }
    }

    /// Writes the fields as head lines, `Host` first (the upstream's once set), without the
    /// blank line: nothing when they are in the map.
    pub fn write(&self, out: &mut Vec<u8>) {
        let Some(kept) = &self.kept else {
            return;
        };
        match &kept.upstream_host {
            Some(host) => {
                out.extend_from_slice(b"host: ");
                out.extend_from_slice(host.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            None => out.extend_from_slice(&kept.lines[..kept.rest]),
        }
        out.extend_from_slice(&kept.lines[kept.rest..kept.lines.len() - 2]);
    }

    /// The `Host` the upstream gets (the one set, else the line's); `None` when the fields are
    /// in the map.
    pub fn host(&self) -> Option<&[u8]> {
        let kept = self.kept.as_ref()?;
        match &kept.upstream_host {
            Some(host) => Some(host.as_bytes()),
            None => spans(&kept.lines[..kept.rest])
                .next()
                .map(|(_, _, value)| &kept.lines[value]),
        }
    }

    /// Calls `each` with every field after `Host`, in order: the name as it came (any case) and
    /// the value without the whitespace around it. Nothing when the fields are in the map. The
    /// HTTP/2 client encodes them from here, with no map between.
    pub fn for_each_field(&self, mut each: impl FnMut(&[u8], &[u8])) {
        if let Some(kept) = &self.kept {
            let rest = &kept.lines[kept.rest..];
            for (_, name, value) in spans(rest) {
                each(name, &rest[value]);
            }
        }
    }

    /// Moves the fields into `headers`, as the parse would have put them there, `Host` first
    /// (the upstream's once set), before any field the map holds already. Out of line: the
    /// steps that need it are the rarer paths.
    #[inline(never)]
    pub fn into_map(&mut self, headers: &mut HeaderMap) {
        let Some(kept) = self.kept.take() else {
            return;
        };
        let Kept {
            lines,
            rest,
            upstream_host,
        } = kept;
        // A kept map, as the parse takes: a new one was two allocations a request.
        let fields = memchr::memchr_iter(b'\n', &lines).count() - 1;
        let mut map = crate::spare::header_map(fields + headers.len() + 2);
        for (at, name, value) in spans(&lines) {
            let Ok(name) = super::names::from_wire(name) else {
                debug_assert!(false, "a kept line's name is a token");
                continue;
            };
            let mut value = match (&upstream_host, at < rest) {
                (Some(host), true) => host.clone(),
                _ => super::codec::field_value(lines.slice(value)),
            };
            value.set_sensitive(super::is_credential(&name));
            map.append(name, value);
        }
        let before = std::mem::replace(headers, map);
        if before.is_empty() {
            crate::spare::give_back_headers(before);
        } else {
            let mut last = None;
            for (name, value) in before {
                let name = name.or(last).expect("a map's first value has its name");
                headers.append(name.clone(), value);
                last = Some(name);
            }
        }
    }
}

/// The field lines of `lines` (which ends in the blank line, or in a line's CRLF) as where
/// each starts, its name, and where its value lies without the whitespace around it. The
/// head's scan took these lines: each is a token, a colon and a value of field-value bytes (no
/// CR or LF), ending in CRLF; a line without a colon is skipped, and a bare LF (which the scan
/// refuses) ends a line too, so no index here can fall outside `lines`.
fn spans(lines: &[u8]) -> impl Iterator<Item = (usize, &[u8], std::ops::Range<usize>)> {
    let mut at = 0;
    std::iter::from_fn(move || loop {
        if at + 2 > lines.len() || lines[at..].starts_with(b"\r\n") {
            return None;
        }
        let end = at + memchr::memchr(b'\n', &lines[at..])?;
        let (start, line) = (at, &lines[at..end]);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        at = end + 1;
        let Some(colon) = memchr::memchr(b':', line) else {
            debug_assert!(false, "a kept line is a token, a colon and a value");
            continue;
        };
        let value = &line[colon + 1..];
        let from = start + colon + 1 + (value.len() - value.trim_ascii_start().len());
        return Some((start, &line[..colon], from..from + value.trim_ascii().len()));
    })
}

/// Whether a field named `name` (as it came, any case) may stay a line: no step of the request
/// path reads, removes or replaces it by name. Not: `Host` (routing, rewritten), the
/// hop-by-hop set and what `Connection` names (`Connection`, `Proxy-Connection`, `Keep-Alive`,
/// `Transfer-Encoding`, `Upgrade`, `TE`), `Proxy-Authorization`, `Expect`, `Content-Length`
/// (framing), `Content-Type` (a gRPC request's pool), `Max-Forwards` (the last hop's answer), the sidecar's own `x-egress-*`, the
/// credentials pacing keys on or logs hide (`Authorization`, `Cookie`, `X-Api-Key`,
/// `Api-Key`), the trace context (`traceparent`, `tracestate`, `baggage`: removed for an
/// upstream that does not propagate it) and `Idempotency-Key` (retries); nor a name longer
/// than `http` takes, which the parse refuses. By length first: most names are compared with none. Steps that read fields an
/// upstream's settings name (header rules, the global rate limit's descriptors) or
/// `Accept-Encoding` (reading a known provider's LLM usage) have the lines moved into the map
/// (`Upstream::reads_request_fields`).
pub(super) fn is_passed_through(name: &[u8]) -> bool {
    let is = |other: &[u8]| name.eq_ignore_ascii_case(other);
    let read = match name.len() {
        2 => is(b"te"),
        4 => is(b"host"),
        6 => is(b"expect") || is(b"cookie"),
        7 => is(b"upgrade") || is(b"api-key") || is(b"baggage"),
        9 => is(b"x-api-key"),
        10 => is(b"connection") || is(b"keep-alive") || is(b"tracestate"),
        11 => is(b"traceparent"),
        12 => is(b"max-forwards") || is(b"content-type"),
        13 => is(b"authorization"),
        14 => is(b"content-length"),
        15 => is(b"idempotency-key"),
        16 => is(b"proxy-connection"),
        17 => is(b"transfer-encoding"),
        19 => is(b"proxy-authorization"),
        _ => false,
    };
    let own = name.len() >= 9 && name[..9].eq_ignore_ascii_case(b"x-egress-");
    // Past http's longest name the parse refuses the head: it goes that way.
    let refused = name.len() > usize::from(u16::MAX);
    !(read || own || refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name a step reads by name is kept out of the lines, in any case; others stay.
    #[test]
    fn names_the_request_path_reads_are_not_passed_through() {
        let read = [
            "host",
            "Connection",
            "proxy-connection",
            "keep-alive",
            "Transfer-Encoding",
            "upgrade",
            "TE",
            "proxy-authorization",
            "expect",
            "content-length",
            "max-forwards",
            "Content-Type",
            "x-egress-timeout",
            "X-Egress-Anything",
            "authorization",
            "cookie",
            "x-api-key",
            "api-key",
            "traceparent",
            "tracestate",
            "Baggage",
            "idempotency-key",
        ];
        for name in read {
            assert!(!is_passed_through(name.as_bytes()), "{name}");
        }
        // Every name a step of the request path looks up is in the list above.
        assert!(!is_passed_through(&[b'a'; 65_536]), "too long for http");
        assert!(is_passed_through(&[b'a'; 65_535]));
        for name in crate::pace::CREDENTIALS {
            assert!(!is_passed_through(name.as_str().as_bytes()), "{name}");
        }
        for name in [
            "user-agent",
            "Accept",
            "accept-encoding",
            "x-egress",
            "x-request-id",
            "te-x",
        ] {
            assert!(is_passed_through(name.as_bytes()), "{name}");
        }
    }

    /// A map's fields in order, as text.
    fn listed(headers: &HeaderMap) -> Vec<(&str, &str)> {
        headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect()
    }

    /// Lines written are the fields as they came, `Host` the upstream's once set; moved into
    /// a map they are what the parse builds.
    #[test]
    fn lines_write_as_they_came_and_map_as_parsed() {
        let mut lines = HeadLines::default();
        let head = b"Host:  app.local \r\nUser-Agent: curl/8\r\nAccept:  */* \r\n\r\n";
        lines.keep(Bytes::from_static(head), 19);
        let mut out = Vec::new();
        lines.write(&mut out);
        assert_eq!(
            out,
            b"Host:  app.local \r\nUser-Agent: curl/8\r\nAccept:  */* \r\n"
        );
        let mut as_parsed = HeaderMap::new();
        HeadLines {
            kept: Some(Kept {
                lines: Bytes::from_static(head),
                rest: 19,
                upstream_host: None,
            }),
        }
        .into_map(&mut as_parsed);
        let fields = listed(&as_parsed);
        assert_eq!(
            fields,
            [("host", "app.local"), ("user-agent", "curl/8"), ("accept", "*/*")]
        );
        assert!(lines.set_upstream_host(&HeaderValue::from_static("api.example:8080")));
        out.clear();
        lines.write(&mut out);
        assert_eq!(
            out,
            b"host: api.example:8080\r\nUser-Agent: curl/8\r\nAccept:  */* \r\n"
        );

        let mut headers = HeaderMap::new();
        lines.into_map(&mut headers);
        assert!(!lines.is_kept());
        let fields = listed(&headers);
        assert_eq!(
            fields,
            [
                ("host", "api.example:8080"),
                ("user-agent", "curl/8"),
                ("accept", "*/*")
            ]
        );
        // Taken: nothing more is written or moved.
        out.clear();
        lines.write(&mut out);
        assert!(out.is_empty());
        assert!(!lines.set_upstream_host(&HeaderValue::from_static("x")));

        // Fields the map held already come after the lines'.
        let mut lines = HeadLines::default();
        lines.keep(Bytes::from_static(b"Host: a\r\nX-A: 1\r\n\r\n"), 9);
        let mut headers = HeaderMap::new();
        headers.append("traceparent", HeaderValue::from_static("t"));
        headers.append("x-b", HeaderValue::from_static("1"));
        headers.append("x-b", HeaderValue::from_static("2"));
        lines.into_map(&mut headers);
        let fields = listed(&headers);
        assert_eq!(
            fields,
            [
                ("host", "a"),
                ("x-a", "1"),
                ("traceparent", "t"),
                ("x-b", "1"),
                ("x-b", "2")
            ]
        );
    }
}
