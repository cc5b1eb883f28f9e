//! A response head off an HTTP/1.1 upstream connection, parsed in one pass that also reads what
//! its fields say about the body's framing and about the connection.
//!
//! The fields that decide framing and reuse (`Transfer-Encoding`, `Content-Length`,
//! `Connection`, `Keep-Alive`), and those the hop-by-hop rewrite removes, are recognised by
//! their bytes where the scan (`scan`, or httparse) found them: looking them up in a map cost a
//! hash and a probe each (callgrind). Most heads then need no rewriting, and their fields are
//! kept as lines (`wire::fields`) with no map built at all.

use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Response, StatusCode, Version};
use smallvec::SmallVec;

use super::Error;
use crate::spare;
use crate::wire::codec::ConnectionTokens;
use crate::wire::names;
use crate::wire::scan::{self, Field, Fields, Found};
use crate::wire::{BodyType, WireFields};

/// Most header fields in a response head.
pub(super) const MAX_RESPONSE_HEADERS: usize = 128;

/// A final or interim response head.
#[derive(Debug)]
pub(super) struct Head {
    pub(super) resp: Response<()>,
    pub(super) persistence: Persistence,
    pub(super) framing: Framing,
    /// The fields as their lines, when they go on unchanged; `resp`'s map is then empty.
    pub(super) wire: Option<WireFields>,
}

#[cfg(test)]
impl Head {
    /// The response with every field in its map, wherever `parse` left them.
    pub(super) fn mapped(mut self) -> Response<()> {
        if let Some(wire) = self.wire.take() {
            wire.into_map(self.resp.headers_mut()).expect("valid lines");
        }
        self.resp
    }
}

/// What a response head says about its connection (`Connection` and `Keep-Alive`), read
/// while the head is parsed.
///
/// `Keep-Alive` is kept as the numbers it gives, not as its value: this rides in every
/// response's body state, which a value (40 bytes) took past the size memcpy moves cheaply.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Persistence {
    /// The upstream will close: `Connection: close`, or HTTP/1.0 without `keep-alive`.
    pub close: bool,
    /// `Keep-Alive: timeout=N`: seconds the upstream keeps the connection idle.
    pub timeout_secs: Option<u32>,
    /// `Keep-Alive: max=N`: requests the upstream will still serve on the connection.
    pub max: Option<u32>,
}

impl Persistence {
    /// Takes in a `Keep-Alive` value (`timeout=5, max=100`); other parameters, and numbers
    /// that do not parse, are ignored; numbers past `u32` are capped.
    fn keep_alive(&mut self, value: &[u8]) {
        let number = |digits: &[u8]| parse_length(digits).map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        for param in value.split(|b| *b == b',') {
            let Some(eq) = param.iter().position(|b| *b == b'=') else {
                continue;
            };
            let (name, val) = (param[..eq].trim_ascii(), param[eq + 1..].trim_ascii());
            let val = val
                .strip_prefix(b"\"")
                .and_then(|v| v.strip_suffix(b"\""))
                .unwrap_or(val);
            if name.eq_ignore_ascii_case(b"timeout") {
                self.timeout_secs = number(val);
            } else if name.eq_ignore_ascii_case(b"max") {
                self.max = number(val);
            }
        }
    }
}

/// What a response head's fields say about its body (RFC 9112 §6.3), before the status and
/// the request's method are taken into account.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) enum Framing {
    /// `Transfer-Encoding` present: chunked when its last coding is `chunked`, else the body
    /// runs to the close. A `Content-Length` beside it is ignored (and dropped from the head).
    TransferCoded {
        chunked: bool,
    },
    /// `Content-Length` alone.
    Length(u64),
    MalformedLength,
    DifferingLengths,
    /// Neither field: the body runs to the close.
    #[default]
    Unframed,
}

impl Framing {
    /// Takes in one `Transfer-Encoding` field; the last one's last coding decides.
    fn transfer_encoding(&mut self, value: &[u8]) {
        let last = value.rsplit(|b| *b == b',').next().unwrap_or(b"");
        *self = Framing::TransferCoded {
            chunked: last.trim_ascii().eq_ignore_ascii_case(b"chunked"),
        };
    }

    /// Takes in one `Content-Length` field: a list of values that must all agree.
    fn content_length(&mut self, value: &[u8]) {
        for part in value.split(|b| *b == b',') {
            let n = parse_length(part.trim_ascii());
            *self = match (*self, n) {
                (Framing::TransferCoded { .. } | Framing::MalformedLength | Framing::DifferingLengths, _) => {
                    return
                }
                (_, None) => Framing::MalformedLength,
                (Framing::Length(seen), Some(n)) if seen != n => Framing::DifferingLengths,
                (_, Some(n)) => Framing::Length(n),
            };
        }
    }
}

/// A `Content-Length` value: digits only, no sign, no overflow.
fn parse_length(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    digits
        .iter()
        .try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d - b'0')))
}

/// Parses a response head off the front of `buf`; `Ok(None)`: incomplete. Header values share
/// the head's memory instead of being copied one by one.
///
/// When `Connection` carries only `close` and `keep-alive` (what upstreams send), it and
/// `Keep-Alive` are read into [`Persistence`] and left out of the head: they are hop-by-hop,
/// and every later step (reuse, the hop-by-hop rewrite) would otherwise look them up again. A
/// `Connection` naming other fields stays, for the rewrite to remove them.
///
/// When nothing else in the head needs rewriting, the fields are kept as their lines
/// ([`WireFields`], with `Transfer-Encoding` left out too: the client's framing is the
/// sidecar's) and the response's map stays empty.
pub(super) fn parse(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
    // Not zero-filled, unlike an array: clearing 128 slots (2 KiB) per head showed in callgrind.
    let mut fields: Fields<MAX_RESPONSE_HEADERS> = SmallVec::new();
    let found = match scan::response_head(buf, &mut fields) {
        Some(found) => found,
        None => {
            fields.clear();
            match httparse_head(buf, &mut fields)? {
                Some(found) => found,
                None => return Ok(None),
            }
        }
    };
    let code = found.code;
    let status = StatusCode::from_u16(code).map_err(|_| Error::invalid(format!("status {code}")))?;
    let version = match found.version {
        0 => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut read = Read::default();
    for (n, field) in fields.iter().enumerate() {
        read.field(n, &buf[field.name()], &buf[field.value()]);
    }
    let len = found.len;

    let Read {
        tokens,
        framing,
        mut persistence,
        persistence_fields,
        coding,
        lengths,
        rewritten,
        limit_fields,
        body,
    } = read;
    // `close` wins over `keep-alive` (as for requests); HTTP/1.0 closes unless it asks to stay.
    persistence.close = tokens.close || (version == Version::HTTP_10 && !tokens.keep_alive);
    // Transfer-Encoding overrides Content-Length (RFC 9112 §6.3); passing both on would let
    // the application frame the body differently.
    let overridden = if matches!(framing, Framing::TransferCoded { .. }) {
        lengths
    } else {
        0
    };
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    let wire = if tokens.names_fields || rewritten {
        None
    } else {
        let left_out = persistence_fields | coding | overridden;
        wire_fields(buf, len, &fields, left_out, matches!(framing, Framing::Length(_)))
            .map(|wire| wire.with_limit_fields(limit_fields).with_body_type(body))
    };
    if wire.is_none() {
        let head = buf.split_to(len).freeze();
        let read_here = if tokens.names_fields {
            0
        } else {
            persistence_fields
        };
        let headers = header_map(&head, &fields, read_here | overridden)?;
        crate::spare::set_headers(resp.headers_mut(), headers);
    }
    Ok(Some(Head {
        resp,
        persistence,
        framing,
        wire,
    }))
}

/// httparse's reading of a head the plain scan did not take; `Ok(None)`: incomplete.
fn httparse_head(buf: &[u8], fields: &mut Fields<MAX_RESPONSE_HEADERS>) -> Result<Option<Found>, Error> {
    // Uninitialised: filling 128 empty slots (4 KiB) cost more than parsing a small head.
    let mut slots = [const { MaybeUninit::uninit() }; MAX_RESPONSE_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buf,
        &mut slots,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(Error::invalid(e.to_string())),
    };
    let base = buf.as_ptr() as usize;
    let span = |part: &[u8]| {
        let start = part.as_ptr() as usize - base;
        (start as u32, (start + part.len()) as u32)
    };
    fields.extend(parsed.headers.iter().map(|h| Field {
        name: span(h.name.as_bytes()),
        value: span(h.value),
    }));
    Ok(Some(Found {
        len,
        version: parsed.version.unwrap_or(1),
        code: parsed.code.unwrap_or(0),
    }))
}

/// What the fields of a head say, read by their bytes.
#[derive(Default)]
struct Read {
    tokens: ConnectionTokens,
    framing: Framing,
    persistence: Persistence,
    /// Bit n: field n is `Connection` or `Keep-Alive`.
    persistence_fields: u128,
    /// Bit n: field n is `Transfer-Encoding`.
    coding: u128,
    /// Bit n: field n is `Content-Length`.
    lengths: u128,
    /// A field the hop-by-hop rewrite removes and this pass does not read: `Proxy-Connection`,
    /// `Upgrade`, `TE`, `Proxy-Authenticate`.
    rewritten: bool,
    /// A rate-limit field, which pacing reads (`wire::names::is_limit_field`).
    limit_fields: bool,
    /// `Content-Type` and `Content-Encoding`, which the reader of LLM usage asks.
    body: BodyType,
}

const _: () = assert!(MAX_RESPONSE_HEADERS <= 128, "one bit per field in a u128");

impl Read {
    fn field(&mut self, n: usize, name: &[u8], value: &[u8]) {
        // Made in the arms that use it: a shift of a `u128` is a dozen instructions, and most
        // fields are none of these.
        let bit = || 1u128 << n;
        match name.len() {
            2 if names::folded_eq(name, b"te") => self.rewritten = true,
            7 if names::folded_eq(name, b"upgrade") => self.rewritten = true,
            10 if names::folded_eq(name, b"connection") => {
                self.tokens.read(value);
                self.persistence_fields |= bit();
            }
            10 if names::folded_eq(name, b"keep-alive") => {
                self.persistence.keep_alive(value);
                self.persistence_fields |= bit();
            }
            12 if names::folded_eq(name, b"content-type") => self.body.content_type(value),
            14 if names::folded_eq(name, b"content-length") => {
                self.framing.content_length(value);
                self.lengths |= bit();
            }
            16 if names::folded_eq(name, b"proxy-connection") => self.rewritten = true,
            16 if names::folded_eq(name, b"content-encoding") => self.body.content_encoding(value),
            17 if names::folded_eq(name, b"transfer-encoding") => {
                self.framing.transfer_encoding(value);
                self.coding |= bit();
            }
            18 if names::folded_eq(name, b"proxy-authenticate") => self.rewritten = true,
            _ => self.limit_fields |= names::is_limit_field(name),
        }
    }
}

/// Whether field `n` is in `left_out`. A head that leaves nothing out (no `Connection`,
/// `Keep-Alive`, `Transfer-Encoding` nor a `Content-Length` it overrides) takes no `u128`
/// shift, a dozen instructions.
fn is_left_out(left_out: u128, n: usize) -> bool {
    left_out != 0 && left_out & (1 << n) != 0
}

/// The lines of the fields not in `left_out`, taken with the head (its first `len` bytes) off
/// `buf`, when every line ends in CRLF; `None`, and `buf` untouched, when one does not
/// (httparse takes a bare LF), since a client may read such a line differently.
///
/// A field's line runs from its name to the next field's name: httparse refuses folded lines,
/// so nothing else lies between. Kept lines in one run share the head's memory: the head is
/// split off and cut down to them, not sliced and dropped, which would count the buffer's
/// references up and down once more (two atomic instructions and two calls a response).
/// Lines around a left-out one are copied together.
fn wire_fields(
    buf: &mut BytesMut,
    len: usize,
    fields: &[Field],
    left_out: u128,
    content_length: bool,
) -> Option<WireFields> {
    let head = &buf[..len];
    if !head.ends_with(b"\r\n\r\n") {
        return None;
    }
    let end = head.len() - 2;
    let mut runs: SmallVec<[Range<usize>; 2]> = SmallVec::new();
    for (n, field) in fields.iter().enumerate() {
        let start = field.name.0 as usize;
        if &head[start - 2..start] != b"\r\n" {
            return None;
        }
        if is_left_out(left_out, n) {
            continue;
        }
        let stop = fields.get(n + 1).map_or(end, |next| next.name.0 as usize);
        match runs.last_mut() {
            Some(run) if run.end == start => run.end = stop,
            _ => runs.push(start..stop),
        }
    }
    let lines = match runs.as_slice() {
        [] => {
            buf.advance(len);
            Bytes::new()
        }
        [run] => {
            let mut head = buf.split_to(len);
            head.truncate(run.end);
            head.advance(run.start);
            head.freeze()
        }
        runs => {
            let mut lines = BytesMut::with_capacity(runs.iter().map(ExactSizeIterator::len).sum());
            for run in runs {
                lines.extend_from_slice(&head[run.clone()]);
            }
            buf.advance(len);
            lines.freeze()
        }
    };
    Some(WireFields::new(lines, content_length))
}

/// The fields not in `left_out` as a header map.
fn header_map(head: &Bytes, fields: &[Field], left_out: u128) -> Result<HeaderMap, Error> {
    let mut headers = spare::header_map(fields.len());
    for (n, field) in fields.iter().enumerate() {
        if is_left_out(left_out, n) {
            continue;
        }
        let name = names::from_wire(&head[field.name()]).map_err(|_| {
            let name = String::from_utf8_lossy(&head[field.name()]);
            Error::invalid(format!("header name {name:?}"))
        })?;
        let value = HeaderValue::from_maybe_shared(head.slice(field.value()))
            .map_err(|_| Error::invalid(format!("value of {name}")))?;
        headers.append(name, value);
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<Head>, Error> {
        parse(&mut BytesMut::from(text))
    }

    fn complete(text: &str) -> Head {
        head(text).unwrap().expect("complete")
    }

    #[test]
    fn the_body_type_is_noted_as_the_head_is_parsed() {
        let body = |text: &str| complete(text).wire.expect("kept as lines").body_type();
        let json = body(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: 2\r\n\r\n",
        );
        assert_eq!(
            (json.framing, json.compressed),
            (Some(crate::llm::Framing::Json), false)
        );
        let sse =
            body("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert_eq!(sse.framing, Some(crate::llm::Framing::Sse));
        let gzip =
            body("HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Type: application/json\r\n\r\n");
        assert!(gzip.compressed);
        assert!(!body("HTTP/1.1 200 OK\r\nContent-Encoding: identity\r\n\r\n").compressed);
        assert_eq!(
            body("HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n").framing,
            None
        );
    }

    #[test]
    fn connection_and_keep_alive_are_read_and_left_out_when_they_name_nothing_else() {
        let head = complete(
            "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5, max=9\r\nContent-Length: 0\r\n\r\n",
        );
        let persistence = head.persistence;
        let resp = head.mapped();
        assert!(!persistence.close);
        assert_eq!((persistence.timeout_secs, persistence.max), (Some(5), Some(9)));
        assert!(resp.headers().get("connection").is_none());
        assert!(resp.headers().get("keep-alive").is_none());
        assert_eq!(resp.headers().get("content-length").unwrap(), "0");

        let closes = |text: &str| complete(text).persistence.close;
        assert!(closes("HTTP/1.1 200 OK\r\nConnection: Close\r\n\r\n"));
        assert!(
            closes("HTTP/1.0 200 OK\r\n\r\n"),
            "HTTP/1.0 closes unless it says keep-alive"
        );
        assert!(!closes("HTTP/1.0 200 OK\r\nConnection: keep-alive\r\n\r\n"));
        assert!(
            closes("HTTP/1.1 200 OK\r\nConnection: close, keep-alive\r\n\r\n"),
            "close wins over keep-alive"
        );
    }

    #[test]
    fn a_connection_naming_other_fields_stays_for_the_hop_by_hop_rewrite() {
        let head = complete(
            "HTTP/1.1 200 OK\r\nConnection: close, x-private\r\nX-Private: 1\r\nKeep-Alive: timeout=3\r\n\r\n",
        );
        assert!(head.wire.is_none(), "the rewrite needs the map");
        let persistence = head.persistence;
        let resp = head.mapped();
        assert!(persistence.close);
        assert_eq!((persistence.timeout_secs, persistence.max), (Some(3), None));
        assert_eq!(resp.headers().get("connection").unwrap(), "close, x-private");
        assert_eq!(resp.headers().get("keep-alive").unwrap(), "timeout=3");
        assert_eq!(resp.headers().get("x-private").unwrap(), "1");
    }

    /// The parameters of `Keep-Alive`, whatever their case, spacing or quoting; anything that
    /// does not parse is ignored, and numbers past `u32` are capped.
    #[test]
    fn keep_alive_gives_its_timeout_and_max() {
        let read = |value: &str| {
            let mut persistence = Persistence::default();
            persistence.keep_alive(value.as_bytes());
            (persistence.timeout_secs, persistence.max)
        };
        assert_eq!(read("timeout=5, max=100"), (Some(5), Some(100)));
        assert_eq!(read("Max = 3"), (None, Some(3)));
        assert_eq!(read("timeout=\"7\""), (Some(7), None));
        assert_eq!(read("garbage, timeout=x, max=-1"), (None, None));
        assert_eq!(read("timeout=99999999999"), (Some(u32::MAX), None));
    }

    #[test]
    fn the_framing_fields_are_read_whatever_their_case_and_order() {
        let framing = |fields: &str| complete(&format!("HTTP/1.1 200 OK\r\n{fields}\r\n")).framing;
        assert_eq!(framing(""), Framing::Unframed);
        assert_eq!(framing("content-LENGTH: 5\r\n"), Framing::Length(5));
        assert_eq!(
            framing("Content-Length: 5, 5\r\nContent-Length: 5\r\n"),
            Framing::Length(5)
        );
        assert_eq!(
            framing("Content-Length: 5\r\nContent-Length: 6\r\n"),
            Framing::DifferingLengths
        );
        assert_eq!(framing("Content-Length: 5, 6\r\n"), Framing::DifferingLengths);
        for bad in ["-1", "+1", "", "1 2", "0x10", "18446744073709551616"] {
            assert_eq!(
                framing(&format!("Content-Length: {bad}\r\n")),
                Framing::MalformedLength,
                "{bad:?}"
            );
        }
        assert_eq!(
            framing("Content-Length: 18446744073709551615\r\n"),
            Framing::Length(u64::MAX)
        );
        let chunked = Framing::TransferCoded { chunked: true };
        let to_close = Framing::TransferCoded { chunked: false };
        assert_eq!(framing("TRANSFER-encoding: gzip, Chunked\r\n"), chunked);
        assert_eq!(framing("Transfer-Encoding: chunked, gzip\r\n"), to_close);
        assert_eq!(
            framing("Transfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n"),
            to_close
        );
        assert_eq!(
            framing("Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n"),
            chunked
        );
        // Transfer-Encoding wins over Content-Length whichever comes first, even a bad one.
        assert_eq!(
            framing("Content-Length: x\r\nTransfer-Encoding: chunked\r\n"),
            chunked
        );
        assert_eq!(
            framing("Transfer-Encoding: chunked\r\nContent-Length: x\r\n"),
            chunked
        );
        // Names of the same length are not taken for them.
        assert_eq!(
            framing("Content-Lengtz: 5\r\nX-Connection: close\r\n"),
            Framing::Unframed
        );
    }

    #[test]
    fn response_header_fields_up_to_the_limit_parse_and_one_more_is_refused() {
        let with_fields = |n: usize| {
            let fields: String = (0..n).map(|i| format!("x-f{i}: {i}\r\n")).collect();
            format!("HTTP/1.1 200 OK\r\n{fields}\r\n")
        };
        let resp = complete(&with_fields(MAX_RESPONSE_HEADERS)).mapped();
        assert_eq!(resp.headers().len(), MAX_RESPONSE_HEADERS);
        assert_eq!(resp.headers()["x-f127"], "127");
        assert!(matches!(
            head(&with_fields(MAX_RESPONSE_HEADERS + 1)),
            Err(Error::Invalid(_))
        ));
    }

    /// Pacing reads only heads with a limit field: the parse notes one, in any case, and
    /// the lines it keeps still carry it to the client.
    #[test]
    fn a_limit_field_is_noted_as_the_head_is_parsed() {
        let head = complete("HTTP/1.1 200 OK\r\nX-RateLimit-Remaining-Requests: 3\r\nA: b\r\n\r\n");
        let wire = head.wire.expect("lines");
        assert!(wire.has_limit_fields());
        let fields: Vec<_> = wire.fields().collect();
        assert_eq!(fields[0], (&b"X-RateLimit-Remaining-Requests"[..], &b"3"[..]));
        let head = complete("HTTP/1.1 429 Too Many\r\nretry-after: 3\r\n\r\n");
        assert!(head.wire.expect("lines").has_limit_fields());
        let head = complete("HTTP/1.1 200 OK\r\nX-Request-Id: 3\r\nServer: x\r\n\r\n");
        assert!(!head.wire.expect("lines").has_limit_fields());
    }

    #[test]
    fn chunked_response_drops_content_length() {
        let head =
            complete("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\nA: b\r\n\r\n");
        let wire = head.wire.expect("lines");
        assert_eq!(wire.lines(), b"A: b\r\n", "the client's framing is the sidecar's");
        assert!(!wire.has_content_length());
        // Kept in the map, for the hop-by-hop rewrite, when the map is built.
        let head = complete(
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\nUpgrade: x\r\n\r\n",
        );
        assert!(head.wire.is_none());
        let resp = head.mapped();
        assert!(!resp.headers().contains_key(http::header::CONTENT_LENGTH));
        assert_eq!(resp.headers()["transfer-encoding"], "chunked");
    }

    /// What upstreams send (nginx's order here) goes on as its lines, sharing the head's memory,
    /// and no map is built.
    #[test]
    fn plain_fields_stay_lines_and_leave_the_map_empty() {
        let text = "HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Wed, 25 Nov 2026 10:00:00 GMT\r\n\
                    content-type: text/plain\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\nok\n";
        let mut buf = BytesMut::from(text);
        let read = buf.as_ptr() as usize..buf.as_ptr() as usize + buf.len();
        let head = parse(&mut buf).unwrap().unwrap();
        assert_eq!(&buf[..], b"ok\n");
        assert!(head.resp.headers().is_empty());
        let wire = head.wire.expect("lines");
        assert_eq!(
            wire.lines(),
            b"Server: nginx\r\nDate: Wed, 25 Nov 2026 10:00:00 GMT\r\ncontent-type: text/plain\r\nContent-Length: 3\r\n"
        );
        assert!(wire.has_content_length());
        assert!(read.contains(&(wire.lines().as_ptr() as usize)), "not copied");

        // No fields at all.
        let head = complete("HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!(head.wire.expect("lines").lines(), b"");
    }

    #[test]
    fn lines_around_a_left_out_field_are_joined() {
        let head = complete(
            "HTTP/1.1 200 OK\r\nServer: up\r\nConnection: keep-alive\r\nETag: \"x\"\r\n\
             Keep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\nVary: a\r\n\r\n",
        );
        assert_eq!(head.persistence.timeout_secs, Some(5));
        let wire = head.wire.expect("lines");
        assert_eq!(wire.lines(), b"Server: up\r\nETag: \"x\"\r\nVary: a\r\n");
        assert!(!wire.has_content_length());
    }

    /// Whatever shape the kept lines take (none, one run cut from the head, runs joined), the
    /// head leaves the buffer and what follows it stays; a head kept as a map leaves it too.
    #[test]
    fn the_head_leaves_the_buffer_and_the_body_stays() {
        for (text, lines) in [
            ("HTTP/1.1 204 No Content\r\n\r\n", Some(&b""[..])),
            ("HTTP/1.1 200 OK\r\nConnection: keep-alive\r\n\r\n", Some(b"")),
            (
                "HTTP/1.1 200 OK\r\nServer: up\r\nConnection: close\r\n\r\n",
                Some(b"Server: up\r\n"),
            ),
            (
                "HTTP/1.1 200 OK\r\nServer: up\r\nKeep-Alive: timeout=5\r\nVary: a\r\n\r\n",
                Some(b"Server: up\r\nVary: a\r\n"),
            ),
            ("HTTP/1.1 200 OK\r\nServer: up\nVary: a\r\n\r\n", None),
        ] {
            let mut buf = BytesMut::from(format!("{text}body").as_str());
            let head = parse(&mut buf).unwrap().expect("complete");
            assert_eq!(&buf[..], b"body", "{text:?}");
            assert_eq!(head.wire.as_ref().map(WireFields::lines), lines, "{text:?}");
        }
    }

    /// Fields the hop-by-hop rewrite must remove, a `Connection` naming fields, or a line that
    /// ends in a bare LF: the map is built, as before lines were kept.
    #[test]
    fn heads_that_need_rewriting_get_a_map() {
        for fields in [
            "TE: trailers\r\n",
            "Upgrade: h2c\r\n",
            "Proxy-Connection: keep-alive\r\n",
            "Proxy-Authenticate: Basic\r\n",
            "Connection: x-private\r\nX-Private: 1\r\n",
        ] {
            let head = complete(&format!("HTTP/1.1 200 OK\r\nServer: up\r\n{fields}\r\n"));
            assert!(head.wire.is_none(), "{fields:?}");
            assert_eq!(head.resp.headers()["server"], "up", "{fields:?}");
        }
        for text in [
            "HTTP/1.1 200 OK\r\nServer: up\nDate: x\r\n\r\n",
            "HTTP/1.1 200 OK\nServer: up\r\n\r\n",
            "HTTP/1.1 200 OK\r\nServer: up\r\n\n",
        ] {
            let head = complete(text);
            assert!(head.wire.is_none(), "{text:?}");
            assert_eq!(head.resp.headers()["server"], "up", "{text:?}");
        }
    }

    /// The lines, read back into a map, give what the map would have held.
    #[test]
    fn lines_read_back_give_the_map_the_head_would_have_had() {
        let fields = "Server: up\r\nSet-Cookie: a=1\r\nset-cookie: b=2\r\nX-Odd:  spaced  \r\n\
                      Content-Length: 0\r\nCache-Control: no-store\r\n";
        let lines = complete(&format!("HTTP/1.1 200 OK\r\n{fields}\r\n")).mapped();
        let map = complete(&format!("HTTP/1.1 200 OK\r\n{fields}Upgrade: x\r\n\r\n")).mapped();
        let mut map = map.headers().clone();
        map.remove("upgrade");
        assert_eq!(lines.headers(), &map);
    }

    #[test]
    fn values_share_the_head_and_the_rest_of_the_buffer_stays() {
        let mut buf = BytesMut::from("HTTP/1.1 200 OK\r\nA: b\r\nA: c\r\nServer: up\r\n\r\nBODY");
        let resp = parse(&mut buf).unwrap().unwrap().mapped();
        assert_eq!(&buf[..], b"BODY");
        let values: Vec<_> = resp.headers().get_all("a").iter().collect();
        assert_eq!(values, ["b", "c"]);
        assert_eq!(resp.headers()["server"], "up");
    }
}
