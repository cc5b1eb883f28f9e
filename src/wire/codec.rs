//! The HTTP/1.1 wire format: parsing request heads, decoding request bodies
//! (Content-Length and chunked; `connector::h1` decodes response bodies with the same
//! [`Decoder`]), and encoding response heads and chunked bodies.
//!
//! Framing follows RFC 9112 §6 strictly, because a proxy that disagrees with its upstream about
//! where a request ends is a request-smuggling proxy: both `Transfer-Encoding` and
//! `Content-Length`, a transfer coding other than a final `chunked`, differing `Content-Length`
//! values, or `Transfer-Encoding` on HTTP/1.0 are all rejected with 400.
//!
//! Not handled here: sockets, timeouts (`downstream::conn`), header semantics (`proxy::headers`).

use std::io::Write as _;
use std::mem::MaybeUninit;
use std::ops::Range;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri, Version};
use http_body::Frame;
use smallvec::SmallVec;

use super::is_credential;
use super::scan::{self, Field, Fields};
use crate::redact;

/// Most header fields accepted in one request head.
pub const MAX_HEADERS: usize = 128;
/// Longest chunk-size line (size plus extensions) accepted.
const MAX_CHUNK_LINE: usize = 4096;

/// A parsed request head.
#[derive(Debug)]
pub struct RequestHead {
    /// Method.
    pub method: Method,
    /// Request target as sent: absolute-form, origin-form, authority-form or `*`.
    pub uri: Uri,
    /// HTTP/1.0 or HTTP/1.1.
    pub version: Version,
    /// Header fields.
    pub headers: HeaderMap,
    /// Its framing and what it asks of the connection.
    pub facts: HeadFacts,
}

/// What a request head says beyond the request it describes: how its body is delimited and
/// what the client asks of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadFacts {
    /// How the body is delimited.
    pub body: BodyFraming,
    /// Whether the client wants the connection kept open.
    pub keep_alive: bool,
    /// `Expect: 100-continue`.
    pub expect_continue: bool,
}

/// How a request body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFraming {
    /// No body.
    Empty,
    /// `Content-Length: n`, n > 0.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// Why a request head was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// More than `max_header_bytes` or [`MAX_HEADERS`].
    #[error("request head larger than {0}")]
    TooLarge(String),
    /// Malformed.
    #[error("{0}")]
    Invalid(String),
}

impl HeadError {
    /// [`HeadError::Invalid`], built out of line: `#[cold]` lays a refusal's code out of the
    /// request path's hot lines in a build without a profile.
    #[cold]
    fn invalid(why: impl Into<String>) -> Self {
        HeadError::Invalid(why.into())
    }
}

/// httparse accepts bare LF line endings (RFC 9112 §2.2 allows it); the sidecar does not, since
/// an upstream that disagrees on where a line ends is how requests get smuggled past a proxy.
fn has_bare_lf(head: &[u8]) -> bool {
    memchr::memchr_iter(b'\n', head).any(|i| i == 0 || head[i - 1] != b'\r')
}

/// Parses a request head from the front of `buf`; `Ok(None)` = incomplete. On success the head's
/// bytes are removed from `buf`.
pub fn parse_head(buf: &mut BytesMut, max_header_bytes: usize) -> Result<Option<RequestHead>, HeadError> {
    let mut req = http::Request::new(());
    let Some(facts) = parse_head_into(buf, max_header_bytes, &mut req)? else {
        return Ok(None);
    };
    let (parts, ()) = req.into_parts();
    Ok(Some(RequestHead {
        method: parts.method,
        uri: parts.uri,
        version: parts.version,
        headers: parts.headers,
        facts,
    }))
}

/// [`parse_head`] into `req`, whose method, target, version and fields it sets (its body and
/// extensions are left as they are); returns what else the head says. `req` is left as it was
/// unless the head is complete and valid.
///
/// In place because a whole head (232 bytes) moved by value through each level of the
/// downstream path was a `memcpy` call per level (a dozen per request at 64 connections in
/// callgrind); its parts are each small enough to be moved inline.
pub fn parse_head_into<B>(
    buf: &mut BytesMut,
    max_header_bytes: usize,
    req: &mut http::Request<B>,
) -> Result<Option<HeadFacts>, HeadError> {
    parse_head_keeping(buf, max_header_bytes, req, None)
}

/// [`parse_head_into`], the fields of a plain head left as their lines in `lines` (and the
/// map empty) when none is one the request path reads ([`super::lines`]).
pub fn parse_head_keeping_lines<B>(
    buf: &mut BytesMut,
    max_header_bytes: usize,
    req: &mut http::Request<B>,
    lines: &mut super::HeadLines,
) -> Result<Option<HeadFacts>, HeadError> {
    parse_head_keeping(buf, max_header_bytes, req, Some(lines))
}

#[inline(always)]
fn parse_head_keeping<B>(
    buf: &mut BytesMut,
    max_header_bytes: usize,
    req: &mut http::Request<B>,
    lines: Option<&mut super::HeadLines>,
) -> Result<Option<HeadFacts>, HeadError> {
    let mut plain = false;
    // Not zero-filled, unlike an array: clearing every slot per head showed in callgrind.
    let mut fields: Fields<MAX_HEADERS> = SmallVec::new();
    let line = match scan::request_head(buf, &mut fields) {
        // Plain: CRLF line endings, so no bare LF to look for.
        Some(line) => {
            plain = true;
            Line {
                method: Method::from_bytes(&buf[line.method]).map_err(|_| invalid_method())?,
                len: line.len,
                target: line.target,
                version: line.version,
            }
        }
        None => {
            fields.clear();
            match httparse_head(buf, &mut fields, max_header_bytes)? {
                Some(line) => line,
                None => return Ok(None),
            }
        }
    };
    let len = line.len;
    if len > max_header_bytes {
        return Err(HeadError::TooLarge(format!(
            "max_header_bytes ({max_header_bytes})"
        )));
    }
    let method = line.method;
    let version = if line.version == 0 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    let target = line.target;
    let head = buf.split_to(len).freeze();

    // httparse hands out the target and names as `str`: these bytes are UTF-8. Read as text
    // only for an error's message (a check of UTF-8 is a call, 40 instructions).
    let text = |at: Range<usize>| std::str::from_utf8(&head[at]).unwrap_or("");
    let uri = Uri::from_maybe_shared(head.slice(target.clone())).map_err(|e| {
        let shown = redact::target(text(target.clone()));
        HeadError::invalid(format!("invalid request target {:?}: {e}", truncate(&shown)))
    })?;
    check_target_form(&method, &uri, &head[target])?;
    if let Some(lines) = lines.filter(|_| plain && method != Method::CONNECT) {
        if let Some((host_line, rest)) = keep_lines(&head, &fields, len) {
            *req.method_mut() = method;
            *req.uri_mut() = uri;
            *req.version_mut() = version;
            if !req.headers().is_empty() {
                req.headers_mut().clear();
            }
            // The head itself, cut to its lines: a slice of it, and the head dropped, would
            // count the buffer's references up and down once more (two atomic instructions).
            let mut kept = head;
            kept.advance(host_line);
            lines.keep(kept, rest - host_line);
            // One Host and no field that framing or persistence depend on: a bodyless
            // request, kept alive on HTTP/1.1 (HTTP/1.0 asks with a `Connection` field).
            return Ok(Some(HeadFacts {
                body: BodyFraming::Empty,
                keep_alive: version == Version::HTTP_11,
                expect_continue: false,
            }));
        }
    }
    // Room for the fields `proxy::headers` sets on the way up (`Host`, `TE`): http's `insert`
    // reserves a slot even when it replaces, and a map filled to capacity rehashes into one
    // twice the size (a third of the request path's header work in callgrind).
    let mut headers = crate::spare::header_map(fields.len() + 2);
    let mut present = Present::default();
    for field in &fields {
        let name = super::names::from_wire(&head[field.name()]).map_err(|_| {
            HeadError::invalid(format!("invalid header name {:?}", truncate(text(field.name()))))
        })?;
        let mut value = field_value(head.slice(field.value()));
        value.set_sensitive(is_credential(&name));
        present.note(&name);
        headers.append(name, value);
    }
    let facts = head_facts(&method, &uri, version, &headers, present)?;
    *req.method_mut() = method;
    *req.uri_mut() = uri;
    *req.version_mut() = version;
    crate::spare::set_headers(req.headers_mut(), headers);
    Ok(Some(facts))
}

/// Where a head's `Host` line starts and where the field lines after it start, when `Host`
/// comes first and every other field may pass through as it came
/// ([`super::lines::is_passed_through`]).
fn keep_lines(head: &[u8], fields: &Fields<MAX_HEADERS>, len: usize) -> Option<(usize, usize)> {
    let (host, rest) = fields.split_first()?;
    if !head[host.name()].eq_ignore_ascii_case(b"host")
        || !rest
            .iter()
            .all(|field| super::lines::is_passed_through(&head[field.name()]))
    {
        return None;
    }
    let rest_start = rest.first().map_or(len - 2, |field| field.name().start);
    Some((host.name().start, rest_start))
}

/// A field's value, unchecked: `scan` and httparse took only field-value bytes (HTAB, SP,
/// VCHAR, obs-text), the set `HeaderValue` takes.
///
/// Checking them again, a byte at a time, was the costliest line of the request's parse (481
/// of 12,823 instructions per request for h2load's two fields, in callgrind). Debug builds
/// check them still, and the differential and fuzz suites feed this path mutated heads.
pub(super) fn field_value(bytes: Bytes) -> HeaderValue {
    debug_assert!(scan::is_field_value(&bytes));
    // SAFETY: the bytes are valid in a `HeaderValue`, as said above; that is the function's
    // only requirement, and a broken one breaks no memory safety (`to_str` checks again).
    #[allow(unsafe_code)]
    unsafe {
        HeaderValue::from_maybe_shared_unchecked(bytes)
    }
}

/// A request line, by where its target lies in the head.
struct Line {
    len: usize,
    method: Method,
    target: Range<usize>,
    version: u8,
}

fn invalid_method() -> HeadError {
    HeadError::invalid("invalid method")
}

/// httparse's reading of a request head the plain scan did not take; `Ok(None)`: incomplete.
fn httparse_head(
    buf: &[u8],
    fields: &mut Fields<MAX_HEADERS>,
    max_header_bytes: usize,
) -> Result<Option<Line>, HeadError> {
    // Uninitialised: filling 128 empty slots (4 KiB) cost more than parsing a small head.
    let mut slots = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match req.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => {
            if buf.len() >= max_header_bytes {
                return Err(HeadError::TooLarge(format!(
                    "max_header_bytes ({max_header_bytes})"
                )));
            }
            return Ok(None);
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HeadError::TooLarge(format!("{MAX_HEADERS} header fields")))
        }
        Err(e) => return Err(HeadError::invalid(format!("malformed request head: {e}"))),
    };
    if len <= max_header_bytes && has_bare_lf(&buf[..len]) {
        return Err(HeadError::invalid(
            "request head has a line ending in LF without CR",
        ));
    }
    // Where the parts lie in the head: they are read again from the head's frozen bytes, so
    // that the URI and the values share its memory instead of each copying itself out.
    let base = buf.as_ptr() as usize;
    let range = |part: &[u8]| {
        let start = part.as_ptr() as usize - base;
        start..start + part.len()
    };
    // A head is at most `max_header_bytes`, far below 4 GiB.
    let span = |part: &[u8]| {
        let at = range(part);
        (at.start as u32, at.end as u32)
    };
    fields.extend(req.headers.iter().map(|h| Field {
        name: span(h.name.as_bytes()),
        value: span(h.value),
    }));
    Ok(Some(Line {
        len,
        // Not by where it lies: httparse answers the common methods with a `&'static str`.
        method: Method::from_bytes(req.method.unwrap_or("").as_bytes()).map_err(|_| invalid_method())?,
        target: range(req.path.unwrap_or("").as_bytes()),
        version: req.version.unwrap_or(1),
    }))
}

fn truncate(text: &str) -> &str {
    let end = text.char_indices().nth(80).map_or(text.len(), |(i, _)| i);
    &text[..end]
}

/// Whether the target's form fits the method; `raw`, the target as it came, parsed into `uri`
/// already (so ASCII).
fn check_target_form(method: &Method, uri: &Uri, raw: &[u8]) -> Result<(), HeadError> {
    let ok = if method == Method::CONNECT {
        uri.authority().is_some() && uri.scheme().is_none()
    } else if raw == b"*" {
        method == Method::OPTIONS
    } else if uri.scheme().is_some() {
        uri.authority().is_some_and(|a| !a.host().is_empty())
    } else {
        raw.starts_with(b"/")
    };
    if ok {
        Ok(())
    } else {
        let shown = redact::target(std::str::from_utf8(raw).unwrap_or(""));
        Err(HeadError::invalid(format!(
            "invalid request target {:?} for {method}",
            truncate(&shown)
        )))
    }
}

/// The fields that framing and persistence depend on, noted while the map is built, so that a
/// head without them (most requests carry only `Host` of these) costs no lookup for them.
#[derive(Debug, Default, Clone, Copy)]
struct Present {
    hosts: u8,
    transfer_encoding: bool,
    content_length: bool,
    connection: bool,
    expect: bool,
}

impl Present {
    fn note(&mut self, name: &HeaderName) {
        if *name == HOST {
            self.hosts = self.hosts.saturating_add(1);
        } else if *name == TRANSFER_ENCODING {
            self.transfer_encoding = true;
        } else if *name == CONTENT_LENGTH {
            self.content_length = true;
        } else if *name == http::header::CONNECTION {
            self.connection = true;
        } else if *name == http::header::EXPECT {
            self.expect = true;
        }
    }
}

fn head_facts(
    method: &Method,
    uri: &Uri,
    version: Version,
    headers: &HeaderMap,
    present: Present,
) -> Result<HeadFacts, HeadError> {
    if present.hosts > 1 {
        return Err(HeadError::invalid("more than one Host header"));
    }
    if version == Version::HTTP_11
        && uri.scheme().is_none()
        && method != Method::CONNECT
        && present.hosts == 0
    {
        return Err(HeadError::invalid("HTTP/1.1 request without Host"));
    }
    let body = body_framing(version, headers, present)?;
    let connection = if present.connection {
        connection_tokens(headers)
    } else {
        ConnectionTokens::default()
    };
    let keep_alive = match version {
        Version::HTTP_10 => connection.keep_alive,
        _ => !connection.close,
    };
    let expect_continue = version == Version::HTTP_11
        && present.expect
        && headers
            .get(http::header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    Ok(HeadFacts {
        body,
        keep_alive,
        expect_continue,
    })
}

/// Tokens of the `Connection` header that matter for persistence.
#[derive(Debug, Default, Clone, Copy)]
pub struct ConnectionTokens {
    /// `close` present.
    pub close: bool,
    /// `keep-alive` present.
    pub keep_alive: bool,
    /// Some other token: a field name, hop-by-hop for this message.
    pub names_fields: bool,
}

impl ConnectionTokens {
    /// Notes the tokens of one `Connection` value. Bytes, not `str`: one non-ASCII token must
    /// not hide the ones beside it.
    pub fn read(&mut self, value: &[u8]) {
        // A value of one usual token, what nearly every message carries, without the split
        // and trims (170 instructions per response in callgrind).
        if super::names::folded_eq(value, b"keep-alive") {
            self.keep_alive = true;
            return;
        }
        if super::names::folded_eq(value, b"close") {
            self.close = true;
            return;
        }
        for token in value.split(|b| *b == b',').map(<[u8]>::trim_ascii) {
            if super::names::folded_eq(token, b"close") {
                self.close = true;
            } else if super::names::folded_eq(token, b"keep-alive") {
                self.keep_alive = true;
            } else if !token.is_empty() {
                self.names_fields = true;
            }
        }
    }
}

/// Reads `close` / `keep-alive` from every `Connection` header.
pub fn connection_tokens(headers: &HeaderMap) -> ConnectionTokens {
    let mut tokens = ConnectionTokens::default();
    for value in headers.get_all(http::header::CONNECTION) {
        tokens.read(value.as_bytes());
    }
    tokens
}

fn body_framing(version: Version, headers: &HeaderMap, present: Present) -> Result<BodyFraming, HeadError> {
    let has_te = present.transfer_encoding;
    let has_cl = present.content_length;
    if has_te {
        if version == Version::HTTP_10 {
            return Err(HeadError::invalid("Transfer-Encoding in an HTTP/1.0 request"));
        }
        if has_cl {
            return Err(HeadError::invalid("both Content-Length and Transfer-Encoding"));
        }
        let mut codings = Vec::new();
        for value in headers.get_all(TRANSFER_ENCODING) {
            let text = value
                .to_str()
                .map_err(|_| HeadError::invalid("invalid Transfer-Encoding"))?;
            codings.extend(
                text.split(',')
                    .map(|c| c.trim().to_ascii_lowercase())
                    .filter(|c| !c.is_empty()),
            );
        }
        return match codings.as_slice() {
            [only] if only == "chunked" => Ok(BodyFraming::Chunked),
            _ => Err(HeadError::invalid(format!(
                "Transfer-Encoding {:?} is not supported (only chunked)",
                codings.join(", ")
            ))),
        };
    }
    if !has_cl {
        return Ok(BodyFraming::Empty);
    }
    // RFC 9110 §8.6 lets a recipient merge identical repeated values ("5, 5"); the sidecar
    // refuses any repetition, as nginx does: a proxy and an upstream that merge differently
    // disagree about where the body ends.
    let mut values = headers.get_all(CONTENT_LENGTH).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(HeadError::invalid("more than one Content-Length"));
    };
    let digits = value.as_bytes();
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return Err(HeadError::invalid(format!(
            "invalid Content-Length {:?}",
            truncate(&String::from_utf8_lossy(digits))
        )));
    }
    let n: u64 = std::str::from_utf8(digits)
        .ok()
        .and_then(|d| d.parse().ok())
        .ok_or_else(|| HeadError::invalid("invalid Content-Length"))?;
    Ok(if n == 0 {
        BodyFraming::Empty
    } else {
        BodyFraming::Length(n)
    })
}

// === body decoding (request bodies here, response bodies in `connector::h1`) ===

/// Why a body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BodyError(pub String);

/// Decodes a `Content-Length` or chunked body from the bytes that follow its head.
#[derive(Debug)]
pub enum Decoder {
    /// `remaining` bytes to go.
    Length {
        /// Bytes not yet seen.
        remaining: u64,
    },
    /// Chunked coding.
    Chunked(ChunkedState),
    /// The body is complete.
    Done,
}

/// Decodes, on a copy, the part of a chunked body that arrived with its head, so that a request
/// whose first chunks are already malformed is refused before anything is forwarded. (Chunks
/// that arrive later can only abort a request already sent, which the upstream sees as an
/// incomplete body.)
pub fn check_buffered_chunks(buf: &[u8], max_trailer_bytes: usize) -> Result<(), BodyError> {
    let mut probe = Decoder::new(BodyFraming::Chunked);
    let mut copy = BytesMut::from(buf);
    while probe.decode(&mut copy, max_trailer_bytes)?.is_some() {}
    Ok(())
}

/// Where a chunked decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkedState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside chunk data.
    Data(u64),
    /// Expecting the CRLF after chunk data.
    DataEnd,
    /// After the last chunk: trailer fields until an empty line.
    Trailers,
}

impl Decoder {
    /// A decoder for `framing`.
    pub fn new(framing: BodyFraming) -> Self {
        match framing {
            BodyFraming::Empty => Decoder::Done,
            BodyFraming::Length(n) => Decoder::Length { remaining: n },
            BodyFraming::Chunked => Decoder::Chunked(ChunkedState::Size),
        }
    }

    /// Whether the whole body has been decoded.
    pub fn is_done(&self) -> bool {
        matches!(self, Decoder::Done)
    }

    /// Takes the next frame from `buf`; `Ok(None)` = more bytes needed (or done).
    pub fn decode(
        &mut self,
        buf: &mut BytesMut,
        max_trailer_bytes: usize,
    ) -> Result<Option<Frame<Bytes>>, BodyError> {
        loop {
            match self {
                Decoder::Done => return Ok(None),
                Decoder::Length { remaining } => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let take = (*remaining).min(buf.len() as u64) as usize;
                    *remaining -= take as u64;
                    let data = buf.split_to(take).freeze();
                    if *remaining == 0 {
                        *self = Decoder::Done;
                    }
                    return Ok(Some(Frame::data(data)));
                }
                Decoder::Chunked(state) => match *state {
                    ChunkedState::Size => {
                        let Some(line_end) = find_crlf(buf, MAX_CHUNK_LINE)? else {
                            return Ok(None);
                        };
                        let size = parse_chunk_size(&buf[..line_end])?;
                        buf.advance(line_end + 2);
                        *state = if size == 0 {
                            ChunkedState::Trailers
                        } else {
                            ChunkedState::Data(size)
                        };
                    }
                    ChunkedState::Data(remaining) => {
                        if buf.is_empty() {
                            return Ok(None);
                        }
                        let take = remaining.min(buf.len() as u64) as usize;
                        let data = buf.split_to(take).freeze();
                        *state = if remaining == take as u64 {
                            ChunkedState::DataEnd
                        } else {
                            ChunkedState::Data(remaining - take as u64)
                        };
                        return Ok(Some(Frame::data(data)));
                    }
                    ChunkedState::DataEnd => {
                        if buf.len() < 2 {
                            return Ok(None);
                        }
                        if &buf[..2] != b"\r\n" {
                            return Err(BodyError("chunk data not followed by CRLF".into()));
                        }
                        buf.advance(2);
                        *state = ChunkedState::Size;
                    }
                    ChunkedState::Trailers => {
                        let Some(end) = find_trailer_end(buf, max_trailer_bytes)? else {
                            return Ok(None);
                        };
                        let trailers = parse_trailers(&buf[..end])?;
                        buf.advance(end);
                        *self = Decoder::Done;
                        return Ok(trailers.map(Frame::trailers));
                    }
                },
            }
        }
    }
}

fn find_crlf(buf: &[u8], limit: usize) -> Result<Option<usize>, BodyError> {
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(pos) if pos <= limit => Ok(Some(pos)),
        Some(_) => Err(BodyError("chunk-size line too long".into())),
        None if buf.len() > limit => Err(BodyError("chunk-size line too long".into())),
        None => Ok(None),
    }
}

fn parse_chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    let digits_end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let (digits, rest) = line.split_at(digits_end);
    if digits.is_empty() || digits.len() > 15 {
        return Err(BodyError("invalid chunk size".into()));
    }
    let rest_ok = rest.is_empty()
        || rest
            .iter()
            .position(|&b| b != b' ' && b != b'\t')
            .is_some_and(|i| rest[i] == b';');
    if !rest_ok || rest.iter().any(|&b| b == b'\r' || b == b'\n') {
        return Err(BodyError("invalid chunk extension".into()));
    }
    let text = std::str::from_utf8(digits).expect("hex digits are ascii");
    u64::from_str_radix(text, 16).map_err(|_| BodyError("invalid chunk size".into()))
}

/// The length of the trailer section including its final empty line.
fn find_trailer_end(buf: &[u8], limit: usize) -> Result<Option<usize>, BodyError> {
    if buf.starts_with(b"\r\n") {
        return Ok(Some(2));
    }
    match buf.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(pos) if pos + 4 <= limit => Ok(Some(pos + 4)),
        Some(_) => Err(BodyError("trailer section too large".into())),
        None if buf.len() > limit => Err(BodyError("trailer section too large".into())),
        None => Ok(None),
    }
}

fn parse_trailers(section: &[u8]) -> Result<Option<HeaderMap>, BodyError> {
    if section == b"\r\n" {
        return Ok(None);
    }
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let parsed = match httparse::parse_headers(section, &mut slots) {
        Ok(httparse::Status::Complete((_, fields))) => fields,
        _ => return Err(BodyError("malformed trailer section".into())),
    };
    let mut map = HeaderMap::with_capacity(parsed.len());
    for h in parsed {
        let name = super::names::from_wire(h.name.as_bytes())
            .map_err(|_| BodyError("invalid trailer name".into()))?;
        let value =
            HeaderValue::from_bytes(h.value).map_err(|_| BodyError("invalid trailer value".into()))?;
        map.append(name, value);
    }
    Ok(Some(map))
}

// === response encoding ===

/// How a response body is delimited towards the application.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseFraming {
    /// No body (HEAD, 1xx, 204, 304).
    None,
    /// The upstream's `Content-Length`.
    Length,
    /// Chunked coding (HTTP/1.1 clients, unknown length).
    Chunked,
    /// Until the connection closes (HTTP/1.0 clients, unknown length).
    Close,
}

/// Writes the status line and header fields, framing headers and `Connection` included.
/// `lines`: more fields, already `name: value\r\n` lines (`super::WireFields`).
#[allow(clippy::too_many_arguments)]
pub fn encode_head(
    status: http::StatusCode,
    reason: Option<&[u8]>,
    headers: &HeaderMap,
    lines: &[u8],
    framing: ResponseFraming,
    keep_alive: bool,
    client_version: Version,
    out: &mut Vec<u8>,
) {
    // `as_str`, not `write!`: formatting the code cost a tenth of the head's encoding.
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(reason.unwrap_or_else(|| status.canonical_reason().unwrap_or("").as_bytes()));
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(lines);
    if framing == ResponseFraming::Chunked {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if client_version == Version::HTTP_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Writes a chunk header for `len` bytes of data.
pub fn encode_chunk_header(len: usize, out: &mut Vec<u8>) {
    let _ = write!(out, "{len:x}\r\n");
}

/// Writes the last chunk, with trailer fields if any.
pub fn encode_last_chunk(trailers: Option<&HeaderMap>, out: &mut Vec<u8>) {
    out.extend_from_slice(b"0\r\n");
    for (name, value) in trailers.into_iter().flatten() {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One usual token alone, any case, and lists of tokens, read alike.
    #[test]
    fn connection_tokens_are_read_alone_or_in_lists() {
        let read = |value: &[u8]| {
            let mut tokens = super::ConnectionTokens::default();
            tokens.read(value);
            (tokens.close, tokens.keep_alive, tokens.names_fields)
        };
        assert_eq!(read(b"keep-alive"), (false, true, false));
        assert_eq!(read(b"Keep-Alive"), (false, true, false));
        assert_eq!(read(b"CLOSE"), (true, false, false));
        assert_eq!(read(b" close , keep-alive"), (true, true, false));
        assert_eq!(read(b"keep-alivx"), (false, false, true));
        assert_eq!(read(b"close, x-private"), (true, false, true));
        assert_eq!(read(b""), (false, false, false));
    }

    fn head(text: &str) -> Result<Option<RequestHead>, HeadError> {
        let mut buf = BytesMut::from(text);
        parse_head(&mut buf, 64 * 1024)
    }

    fn with_fields(n: usize) -> String {
        let fields: String = (0..n).map(|i| format!("x-f{i}: {i}\r\n")).collect();
        format!("GET / HTTP/1.1\r\nHost: up\r\n{fields}\r\n")
    }

    #[test]
    fn header_fields_up_to_the_limit_parse_and_one_more_is_refused() {
        let h = head(&with_fields(MAX_HEADERS - 1)).unwrap().unwrap();
        assert_eq!(h.headers.len(), MAX_HEADERS);
        assert_eq!(h.headers["x-f126"], "126");
        assert!(matches!(
            head(&with_fields(MAX_HEADERS)),
            Err(HeadError::TooLarge(why)) if why.contains("header fields")
        ));
    }

    /// Each method takes the target forms RFC 9112 §3.2 gives it; the others are refused by
    /// the form check (not the URI parser), which names the target and the method.
    #[test]
    fn target_forms_fit_their_methods() {
        let target =
            |line: &str| head(&format!("{line} HTTP/1.1\r\nHost: a\r\n\r\n")).map(|h| h.unwrap().uri);
        assert_eq!(target("OPTIONS *").unwrap(), "*");
        assert_eq!(target("GET /x?y").unwrap(), "/x?y");
        assert_eq!(target("GET http://a/x").unwrap(), "http://a/x");
        assert_eq!(target("CONNECT a:443").unwrap().authority().unwrap(), "a:443");
        for (method, form) in [
            ("GET", "*"),
            ("GET", "a:443"),
            ("CONNECT", "/x"),
            ("CONNECT", "http://a/"),
        ] {
            match target(&format!("{method} {form}")) {
                Err(HeadError::Invalid(why)) => {
                    assert_eq!(why, format!("invalid request target {form:?} for {method}"))
                }
                other => panic!("{method} {form}: {other:?}"),
            }
        }
    }

    #[test]
    fn absolute_form_and_framing() {
        let h = head(
            "POST http://up.example:8080/x?y HTTP/1.1\r\nHost: up.example:8080\r\nContent-Length: 5\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.uri.authority().unwrap().as_str(), "up.example:8080");
        assert_eq!(h.facts.body, BodyFraming::Length(5));
        assert!(h.facts.keep_alive);
    }

    #[test]
    fn persistence_and_expect_come_from_the_fields_present() {
        let h = |text: &str| head(text).unwrap().unwrap().facts;
        assert!(h("GET / HTTP/1.1\r\nHost: a\r\n\r\n").keep_alive);
        assert!(!h("GET / HTTP/1.1\r\nHost: a\r\nCONNECTION: Close\r\n\r\n").keep_alive);
        assert!(!h("GET / HTTP/1.0\r\n\r\n").keep_alive);
        assert!(h("GET / HTTP/1.0\r\nConnection: x, Keep-Alive\r\n\r\n").keep_alive);
        let post = "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n";
        assert!(h(&format!("{post}expect: 100-Continue\r\n\r\n")).expect_continue);
        assert!(!h(&format!("{post}Expect: something\r\n\r\n")).expect_continue);
        assert!(!h(&format!("{post}\r\n")).expect_continue);
        assert_eq!(h(&format!("{post}\r\n")).body, BodyFraming::Length(2));
        assert_eq!(h("GET / HTTP/1.1\r\nhost: a\r\n\r\n").body, BodyFraming::Empty);
    }

    #[test]
    fn incomplete_head_waits() {
        assert_eq!(head("GET / HTTP/1.1\r\nHost: a\r\n").unwrap().map(|_| ()), None);
    }

    #[test]
    fn smuggling_shapes_are_refused() {
        for bad in [
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +3\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
            "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "GET / HTTP/1.1\r\n\r\n",
            "GET http://exa mple.com/ HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET nothing HTTP/1.1\r\nHost: a\r\n\r\n",
            "GE\x01T / HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\nHost: a\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\nX: b\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\n\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX: b\r\n c\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX: b\r\n\tc\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX: b\x00c\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX: b\rc\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a\r\nX : b\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3 3\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x3\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\n",
            "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
        ] {
            assert!(matches!(head(bad), Err(HeadError::Invalid(_))), "{bad:?}");
        }
    }

    #[test]
    fn credentials_are_read_as_sensitive() {
        let h = head("GET / HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer x\r\nCookie: c=1\r\nProxy-Authorization: Basic y\r\nX: z\r\n\r\n")
            .unwrap()
            .unwrap();
        for name in ["authorization", "cookie", "proxy-authorization"] {
            assert!(h.headers[name].is_sensitive(), "{name}");
            assert_eq!(format!("{:?}", h.headers[name]), "Sensitive");
        }
        assert!(!h.headers["x"].is_sensitive());
    }

    #[test]
    fn oversized_heads() {
        let big = format!("GET / HTTP/1.1\r\nHost: a\r\nX: {}\r\n", "a".repeat(70_000));
        assert!(matches!(head(&big), Err(HeadError::TooLarge(_))));
        let many: String = (0..200).map(|i| format!("X-{i}: v\r\n")).collect();
        assert!(matches!(
            head(&format!("GET / HTTP/1.1\r\nHost: a\r\n{many}\r\n")),
            Err(HeadError::TooLarge(_))
        ));
    }

    #[test]
    fn chunked_decoding_with_extensions_and_trailers() {
        let mut d = Decoder::new(BodyFraming::Chunked);
        let mut buf = BytesMut::from("5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Sum: 1\r\n\r\nNEXT");
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) = d.decode(&mut buf, 1024).unwrap() {
            match frame.into_data() {
                Ok(bytes) => data.extend_from_slice(&bytes),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        assert!(d.is_done());
        assert_eq!(data, b"hello world");
        assert_eq!(trailers.unwrap()["x-sum"], "1");
        assert_eq!(&buf[..], b"NEXT");
    }

    #[test]
    fn chunked_decoding_across_reads() {
        let wire = b"3\r\nabc\r\n0\r\n\r\n";
        let mut d = Decoder::new(BodyFraming::Chunked);
        let mut buf = BytesMut::new();
        let mut data = Vec::new();
        for byte in wire {
            buf.extend_from_slice(&[*byte]);
            while let Some(frame) = d.decode(&mut buf, 1024).unwrap() {
                data.extend_from_slice(&frame.into_data().unwrap());
            }
        }
        assert!(d.is_done());
        assert_eq!(data, b"abc");
    }

    #[test]
    fn bad_chunks() {
        for bad in [
            "zz\r\n",
            "3\r\nabcX\r\n",
            "3 x\r\nabc\r\n",
            "12345678901234567\r\n",
        ] {
            let mut d = Decoder::new(BodyFraming::Chunked);
            let mut buf = BytesMut::from(bad);
            let mut result = Ok(None);
            for _ in 0..4 {
                result = d.decode(&mut buf, 1024);
                if result.is_err() {
                    break;
                }
            }
            assert!(result.is_err(), "{bad:?}");
        }
    }
}
