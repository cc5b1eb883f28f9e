//! Header blocks both ways: a request's head encoded for HEADERS (pseudo-header fields first,
//! connection-specific fields left out: RFC 9113 §8.2.2, §8.3.1), and a response's decoded
//! block checked (§8.1.1, §8.2, §8.3.2) and written out as HTTP/1.1 field lines
//! ([`WireFields`]), which the HTTP/1.1 server sends as they are.

use bytes::{BufMut, BytesMut};
use http::{HeaderMap, Method};

use crate::wire::fields::{BodyType, WireFields};
use crate::wire::hpack::{self, Field, Pseudo};
use crate::wire::names;
use crate::wire::scan;
use crate::wire::HeadLines;

/// What a request's HEADERS frame carries.
#[derive(Debug, Clone, Copy)]
pub struct RequestHead<'a> {
    /// `:method`.
    pub method: &'a Method,
    /// `:scheme`: `http` or `https`.
    pub scheme: &'a str,
    /// `:authority`; when empty, a `Host` field's value takes its place.
    pub authority: &'a str,
    /// `:path`, with the query.
    pub path: &'a str,
    /// The other fields; `Host`, connection-specific fields and a `TE` other than `trailers` are
    /// left out.
    pub headers: &'a HeaderMap,
    /// Fields kept as the lines they came in, sent before the map's: none of them is `Host`
    /// after the first, connection-specific, `TE` or a credential ([`HeadLines`]).
    pub lines: &'a HeadLines,
}

/// A response head or trailers that came through whole and valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fields {
    /// `:status`; 0 for trailers.
    pub status: u16,
    /// The regular fields, as HTTP/1.1 lines.
    pub lines: WireFields,
    /// What the `Content-Length` says (the last one, when several agree).
    pub content_length: Option<u64>,
    /// A field an HTTP/1.1 hop-by-hop rewrite removes is among them (`Proxy-Authenticate`).
    pub hop_by_hop: bool,
}

/// Why a decoded block is malformed (§8.1.1): a stream error of type PROTOCOL_ERROR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    /// A field name with an uppercase letter, or a byte no token takes (§8.2.1).
    #[error("field name not a lowercase token")]
    Name,
    /// A field value with NUL, CR, LF or another control byte (§8.2.1).
    #[error("field value with a forbidden byte")]
    Value,
    /// A pseudo-header field a response does not have, one after a regular field, or one twice.
    #[error("pseudo-header field out of place")]
    Pseudo,
    /// No `:status`, or one that is not three digits.
    #[error("no valid :status")]
    Status,
    /// A connection-specific field (§8.2.2).
    #[error("connection-specific field")]
    ConnectionSpecific,
    /// `Content-Length` values that disagree or are not a number.
    #[error("bad content-length")]
    ContentLength,
    /// Trailers with a pseudo-header field (§8.1).
    #[error("pseudo-header field in trailers")]
    PseudoInTrailers,
    /// An informational head (1xx) that ends the stream, or a `101`, which HTTP/2 has not
    /// (§8.1, §8.6).
    #[error("informational response ending the stream, or 101")]
    Informational,
    /// Trailers without END_STREAM (§8.1).
    #[error("trailers not ending the stream")]
    TrailersWithoutEnd,
    /// A body longer or shorter than its `Content-Length`, or a body where none may be (§8.1.1).
    #[error("body length differs from content-length")]
    BodyLength,
    /// DATA before the response's head.
    #[error("data before the response head")]
    DataBeforeHead,
}

/// Appends a request's header block to `dst`.
pub(super) fn encode_request(head: &RequestHead<'_>, dst: &mut BytesMut) {
    let encoder = hpack::Encoder;
    encoder.encode_pseudo(Pseudo::Method, head.method.as_str().as_bytes(), dst);
    encoder.encode_pseudo(Pseudo::Scheme, head.scheme.as_bytes(), dst);
    let authority = if head.authority.is_empty() {
        head.lines.host().unwrap_or_else(|| {
            head.headers
                .get(http::header::HOST)
                .map_or(&b""[..], |v| v.as_bytes())
        })
    } else {
        head.authority.as_bytes()
    };
    encoder.encode_pseudo(Pseudo::Authority, authority, dst);
    encoder.encode_pseudo(Pseudo::Path, head.path.as_bytes(), dst);
    head.lines
        .for_each_field(|name, value| encode_line(name, value, dst));
    for (name, value) in head.headers {
        let name = name.as_str().as_bytes();
        if is_connection_specific(name) || name == b"host" {
            continue;
        }
        if name == b"te" {
            // §8.2.2: TE may only say `trailers`, which gRPC needs.
            if value
                .as_bytes()
                .split(|b| *b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
            {
                encoder.encode(b"te", b"trailers", false, dst);
            }
            continue;
        }
        encoder.encode(name, value.as_bytes(), value.is_sensitive(), dst);
    }
}

/// Appends a field kept as its line, its name lowercased as HTTP/2 requires (§8.2.1). Never
/// sensitive: a credential is never kept as a line.
fn encode_line(name: &[u8], value: &[u8], dst: &mut BytesMut) {
    // Most names fit: lowercased on the stack.
    let mut low = [0u8; 48];
    match low.get_mut(..name.len()) {
        Some(low) => {
            low.copy_from_slice(name);
            low.make_ascii_lowercase();
            hpack::Encoder.encode(low, value, false, dst);
        }
        None => hpack::Encoder.encode(&name.to_ascii_lowercase(), value, false, dst),
    }
}

/// Fields §8.2.2 forbids in HTTP/2 (`te` is checked apart: a request may carry `trailers`).
fn is_connection_specific(name: &[u8]) -> bool {
    matches!(
        name,
        b"connection" | b"keep-alive" | b"proxy-connection" | b"transfer-encoding" | b"upgrade"
    )
}

/// Room for the lines of this many typical heads, taken at once: heads split their lines off
/// one buffer instead of allocating each.
const LINES_CHUNK: usize = 4096;

/// Reads one decoded response block (a head when `trailers` is false), writing its lines at
/// the end of `lines`, a buffer the connection keeps.
pub(super) struct Reader<'a> {
    trailers: bool,
    status: Option<u16>,
    regular_began: bool,
    lines: &'a mut BytesMut,
    content_length: Option<u64>,
    hop_by_hop: bool,
    limit_fields: bool,
    body: BodyType,
}

impl<'a> Reader<'a> {
    /// A reader for a block of `block_len` bytes; `lines` must be empty.
    pub(super) fn new(trailers: bool, block_len: usize, lines: &'a mut BytesMut) -> Self {
        debug_assert!(lines.is_empty());
        // Decoded lines run longer than the block: names and values come out of tables and
        // Huffman codes, and each line gains ": " and CRLF. A fresh chunk when the room left
        // may not do; the heads split off the old one keep it alive as long as they need it.
        let room = block_len * 2 + 64;
        if lines.capacity() < room {
            *lines = BytesMut::with_capacity(room.max(LINES_CHUNK));
        }
        Reader {
            trailers,
            status: None,
            regular_began: false,
            lines,
            content_length: None,
            hop_by_hop: false,
            limit_fields: false,
            body: BodyType::default(),
        }
    }

    /// Takes one field, in order.
    pub(super) fn field(&mut self, field: Field<'_>) -> Result<(), Malformed> {
        let Field { name, value, .. } = field;
        if let Some(pseudo) = name.strip_prefix(b":") {
            return self.pseudo(pseudo, value);
        }
        self.regular_began = true;
        if !scan::is_lower_token(name) {
            return Err(Malformed::Name);
        }
        if !scan::is_field_value(value) {
            return Err(Malformed::Value);
        }
        if is_connection_specific(name) || name == b"te" {
            return Err(Malformed::ConnectionSpecific);
        }
        match name {
            b"content-length" => self.content_length(value)?,
            b"content-type" => self.body.content_type(value),
            b"content-encoding" => self.body.content_encoding(value),
            b"proxy-authenticate" => self.hop_by_hop = true,
            _ => self.limit_fields |= names::is_limit_field(name),
        }
        self.lines.reserve(name.len() + value.len() + 4);
        self.lines.put_slice(name);
        self.lines.put_slice(b": ");
        self.lines.put_slice(value);
        self.lines.put_slice(b"\r\n");
        Ok(())
    }

    fn pseudo(&mut self, pseudo: &[u8], value: &[u8]) -> Result<(), Malformed> {
        if self.trailers {
            return Err(Malformed::PseudoInTrailers);
        }
        if pseudo != b"status" || self.regular_began || self.status.is_some() {
            return Err(Malformed::Pseudo);
        }
        let status = match value {
            [a @ b'1'..=b'9', b, c] if b.is_ascii_digit() && c.is_ascii_digit() => {
                u16::from(a - b'0') * 100 + u16::from(b - b'0') * 10 + u16::from(c - b'0')
            }
            _ => return Err(Malformed::Status),
        };
        self.status = Some(status);
        Ok(())
    }

    fn content_length(&mut self, value: &[u8]) -> Result<(), Malformed> {
        let value = value.trim_ascii();
        if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
            return Err(Malformed::ContentLength);
        }
        let n = value.iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        match self.content_length {
            Some(seen) if seen != n => Err(Malformed::ContentLength),
            _ => {
                self.content_length = Some(n);
                Ok(())
            }
        }
    }

    /// The block read whole.
    pub(super) fn finish(self) -> Result<Fields, Malformed> {
        let status = match (self.trailers, self.status) {
            (true, _) => 0,
            (false, Some(status)) => status,
            (false, None) => return Err(Malformed::Status),
        };
        let lines = WireFields::new(self.lines.split().freeze(), self.content_length.is_some())
            .with_limit_fields(self.limit_fields)
            .with_body_type(self.body);
        Ok(Fields {
            status,
            lines,
            content_length: self.content_length,
            hop_by_hop: self.hop_by_hop,
        })
    }
}
