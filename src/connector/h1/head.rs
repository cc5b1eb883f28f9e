//! A response head off an HTTP/1.1 upstream connection, parsed in one pass that also reads what
//! its fields say about the body's framing and about the connection.
//!
//! The fields that decide framing and reuse (`Transfer-Encoding`, `Content-Length`,
//! `Connection`) are recognised by their bytes while httparse's slices are at hand, and
//! `Keep-Alive` by its name as the map is filled: looking them up again in the header map cost
//! a hash and a probe each (callgrind), and most heads carry none of them but `Content-Length`.

use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::BytesMut;
use http::header::{CONNECTION, CONTENT_LENGTH};
use http::{HeaderValue, Response, StatusCode, Version};
use smallvec::SmallVec;

use super::Error;
use crate::spare;
use crate::wire::codec::ConnectionTokens;
use crate::wire::names::{self, KEEP_ALIVE};

/// Most header fields in a response head.
pub(super) const MAX_RESPONSE_HEADERS: usize = 128;

/// A final or interim response head.
#[derive(Debug)]
pub(super) struct Head {
    pub(super) resp: Response<()>,
    pub(super) persistence: Persistence,
    pub(super) framing: Framing,
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

/// Where a field's name and value lie in the head.
#[derive(Clone, Copy)]
struct Field {
    name: (u32, u32),
    value: (u32, u32),
}

impl Field {
    fn name(&self) -> Range<usize> {
        self.name.0 as usize..self.name.1 as usize
    }

    fn value(&self) -> Range<usize> {
        self.value.0 as usize..self.value.1 as usize
    }
}

/// Parses a response head off the front of `buf`; `Ok(None)`: incomplete. Header values share
/// the head's memory instead of being copied one by one.
///
/// When `Connection` carries only `close` and `keep-alive` (what upstreams send), it and
/// `Keep-Alive` are read into [`Persistence`] and left out of the head: they are hop-by-hop,
/// and every later step (reuse, the hop-by-hop rewrite) would otherwise look them up again. A
/// `Connection` naming other fields stays, for the rewrite to remove them.
pub(super) fn parse(buf: &mut BytesMut) -> Result<Option<Head>, Error> {
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
        Err(e) => return Err(Error::Invalid(e.to_string())),
    };
    let code = parsed.code.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| Error::Invalid(format!("status {code}")))?;
    let version = match parsed.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut tokens = ConnectionTokens::default();
    let mut framing = Framing::default();
    // Offsets, not slices: the fields are read again from the head's frozen bytes below.
    let base = buf.as_ptr() as usize;
    let span = |part: &[u8]| {
        let start = part.as_ptr() as usize - base;
        (start as u32, (start + part.len()) as u32)
    };
    // Not zero-filled, unlike an array: clearing 128 slots (2 KiB) per head showed in callgrind.
    let mut fields: SmallVec<[Field; MAX_RESPONSE_HEADERS]> = SmallVec::new();
    for h in parsed.headers.iter() {
        let name = h.name.as_bytes();
        match name.len() {
            10 if name.eq_ignore_ascii_case(b"connection") => tokens.read(h.value),
            14 if name.eq_ignore_ascii_case(b"content-length") => framing.content_length(h.value),
            17 if name.eq_ignore_ascii_case(b"transfer-encoding") => framing.transfer_encoding(h.value),
            _ => {}
        }
        fields.push(Field {
            name: span(name),
            value: span(h.value),
        });
    }
    let head = buf.split_to(len).freeze();

    let coded = matches!(framing, Framing::TransferCoded { .. });
    let mut persistence = Persistence::default();
    let mut headers = spare::header_map(fields.len());
    for field in &fields {
        let name = names::from_wire(&head[field.name()]).map_err(|_| {
            let name = String::from_utf8_lossy(&head[field.name()]);
            Error::Invalid(format!("header name {name:?}"))
        })?;
        if coded && name == CONTENT_LENGTH {
            // Transfer-Encoding overrides Content-Length (RFC 9112 §6.3); passing both on
            // would let the application frame the body differently.
            continue;
        }
        let value = HeaderValue::from_maybe_shared(head.slice(field.value()))
            .map_err(|_| Error::Invalid(format!("value of {name}")))?;
        if name == KEEP_ALIVE {
            persistence.keep_alive(value.as_bytes());
        }
        if !tokens.names_fields && (name == CONNECTION || name == KEEP_ALIVE) {
            continue;
        }
        headers.append(name, value);
    }
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    crate::spare::set_headers(resp.headers_mut(), headers);
    // `close` wins over `keep-alive` (as for requests); HTTP/1.0 closes unless it asks to stay.
    persistence.close = tokens.close || (version == Version::HTTP_10 && !tokens.keep_alive);
    Ok(Some(Head {
        resp,
        persistence,
        framing,
    }))
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
    fn connection_and_keep_alive_are_read_and_left_out_when_they_name_nothing_else() {
        let Head { resp, persistence, .. } = complete(
            "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5, max=9\r\nContent-Length: 0\r\n\r\n",
        );
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
        let Head { resp, persistence, .. } = complete(
            "HTTP/1.1 200 OK\r\nConnection: close, x-private\r\nX-Private: 1\r\nKeep-Alive: timeout=3\r\n\r\n",
        );
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
        let resp = complete(&with_fields(MAX_RESPONSE_HEADERS)).resp;
        assert_eq!(resp.headers().len(), MAX_RESPONSE_HEADERS);
        assert_eq!(resp.headers()["x-f127"], "127");
        assert!(matches!(
            head(&with_fields(MAX_RESPONSE_HEADERS + 1)),
            Err(Error::Invalid(_))
        ));
    }

    #[test]
    fn chunked_response_drops_content_length() {
        let Head { resp, .. } =
            complete("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n");
        assert!(!resp.headers().contains_key(CONTENT_LENGTH));
        assert_eq!(resp.headers()["transfer-encoding"], "chunked");
    }

    #[test]
    fn values_share_the_head_and_the_rest_of_the_buffer_stays() {
        let mut buf = BytesMut::from("HTTP/1.1 200 OK\r\nA: b\r\nA: c\r\nServer: up\r\n\r\nBODY");
        let Head { resp, .. } = parse(&mut buf).unwrap().unwrap();
        assert_eq!(&buf[..], b"BODY");
        let values: Vec<_> = resp.headers().get_all("a").iter().collect();
        assert_eq!(values, ["b", "c"]);
        assert_eq!(resp.headers()["server"], "up");
    }
}
