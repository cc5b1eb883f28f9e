//! A response's header fields kept as the upstream wrote them, for an HTTP/1.1 client to get
//! byte for byte instead of through a header map.
//!
//! Filling an `http::HeaderMap` from a parsed head, and encoding the map again for the client,
//! cost about 2,000 instructions per response (callgrind: a hash, a probe and two `Bytes`
//! handles per field, then the walk back out), a tenth of all the sidecar spends on a request.
//! When nothing on the way reads or changes the fields, the head's lines go out as they came:
//! the upstream HTTP/1.1 client leaves the map empty and the lines ride in the response body
//! (`connector::h1`; the HTTP/2 client, `connector::http2`, does the same with the lines it
//! decodes a head's fields to), the HTTP/1.1 server writes them after the status line
//! (`downstream::respond`), and whoever needs a map (the h2c server, a retry reading
//! `Retry-After`) asks for one with [`WireFields::into_map`].
//!
//! Only lines that need no rewriting are kept this way: names and values httparse accepted
//! (the same bytes `HeaderName` and `HeaderValue` accept), each line ending in CRLF, and no
//! hop-by-hop field left among them. Names keep the case the upstream gave them, as nginx
//! passes them on.

use std::fmt;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

/// Header field lines, each `name: value\r\n`, without the blank line that ends a head.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct WireFields {
    lines: Bytes,
    content_length: bool,
    /// A rate-limit field is among them ([`super::names::is_limit_field`]), noted as the head
    /// was parsed: pacing reads only the heads that carry one.
    limit_fields: bool,
    /// What `Content-Type` and `Content-Encoding` say of the body, noted as the head was
    /// parsed: the reader of LLM usage reads only JSON and event streams.
    body: BodyType,
}

/// What a response's `Content-Type` and `Content-Encoding` say of its body, for readers of
/// bodies (`llm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BodyType {
    /// JSON or an event stream, else `None`.
    pub framing: Option<crate::llm::Framing>,
    /// A `Content-Encoding` other than `identity`.
    pub compressed: bool,
}

impl BodyType {
    /// Reads a `Content-Type` value.
    pub fn content_type(&mut self, value: &[u8]) {
        self.framing = crate::llm::Framing::of(value);
    }

    /// Reads a `Content-Encoding` value.
    pub fn content_encoding(&mut self, value: &[u8]) {
        self.compressed |= !value.trim_ascii().eq_ignore_ascii_case(b"identity");
    }

    /// What the fields of `map` say.
    pub fn of_map(map: &HeaderMap) -> Self {
        let mut body = BodyType::default();
        if let Some(value) = map.get(http::header::CONTENT_TYPE) {
            body.content_type(value.as_bytes());
        }
        for value in map.get_all(http::header::CONTENT_ENCODING) {
            body.content_encoding(value.as_bytes());
        }
        body
    }
}

/// A line that could not go into a header map.
#[derive(Debug, thiserror::Error)]
#[error("header field line {0:?} is not a valid field")]
pub struct BadLine(String);

impl WireFields {
    /// Lines as they are to be written. The caller vouches for them: valid field names and
    /// values, each line ending in CRLF, no hop-by-hop field among them.
    pub fn new(lines: Bytes, content_length: bool) -> Self {
        debug_assert!(lines.is_empty() || lines.ends_with(b"\r\n"));
        WireFields {
            lines,
            content_length,
            limit_fields: false,
            body: BodyType::default(),
        }
    }

    /// These lines, noted with what they say of the body.
    pub fn with_body_type(mut self, body: BodyType) -> Self {
        self.body = body;
        self
    }

    /// What the lines say of the body.
    pub fn body_type(&self) -> BodyType {
        self.body
    }

    /// These lines, noted as carrying a rate-limit field (or not).
    pub fn with_limit_fields(mut self, present: bool) -> Self {
        self.limit_fields = present;
        self
    }

    /// Whether a rate-limit field is among them.
    pub fn has_limit_fields(&self) -> bool {
        self.limit_fields
    }

    /// The fields as name and value bytes (the value trimmed), in order; a line with no colon
    /// is passed over.
    pub fn fields(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans().filter_map(|(start, end)| {
            let line = &self.lines[start..end];
            let colon = line.iter().position(|b| *b == b':')?;
            Some((&line[..colon], line[colon + 1..].trim_ascii()))
        })
    }

    /// Where each line is in `lines`, without its CRLF.
    fn spans(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= self.lines.len() {
                return None;
            }
            let end = memchr::memmem::find(&self.lines[at..], b"\r\n").map_or(self.lines.len(), |n| at + n);
            let span = (at, end);
            at = end + 2;
            Some(span)
        })
    }

    /// The lines, ready to write after a status line.
    pub fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// Whether a `Content-Length` is among them (the body is framed by it).
    pub fn has_content_length(&self) -> bool {
        self.content_length
    }

    /// Appends the fields to `map`, in order. Values share the lines' memory. A line that is
    /// no valid field (none is, from `connector::h1`) is left out, and the first is named in
    /// the error once the rest are in.
    pub fn into_map(self, map: &mut HeaderMap) -> Result<(), BadLine> {
        let mut first_bad = None;
        for (start, end) in self.spans() {
            if let Err(bad) = self.push_line(start, end, map) {
                first_bad.get_or_insert(bad);
            }
        }
        first_bad.map_or(Ok(()), Err)
    }

    fn push_line(&self, start: usize, end: usize, map: &mut HeaderMap) -> Result<(), BadLine> {
        let line = &self.lines[start..end];
        let bad = || BadLine(String::from_utf8_lossy(line).into_owned());
        let colon = line.iter().position(|b| *b == b':').ok_or_else(bad)?;
        // `from_bytes`, not `names::from_wire`: this path is rare, and it checks every byte.
        let name = HeaderName::from_bytes(&line[..colon]).map_err(|_| bad())?;
        let value = line[colon + 1..].trim_ascii();
        let offset = value.as_ptr() as usize - self.lines.as_ptr() as usize;
        let value = HeaderValue::from_maybe_shared(self.lines.slice(offset..offset + value.len()))
            .map_err(|_| bad())?;
        map.append(name, value);
        Ok(())
    }
}

/// Puts `wire`'s fields (if any) into `map`, for a step that reads or writes the map. A line
/// that is no field is logged and left out.
pub fn into_map(wire: Option<WireFields>, map: &mut HeaderMap) {
    if let Some(Err(err)) = wire.map(|wire| wire.into_map(map)) {
        tracing::warn!(error = %err, "response field left out");
    }
}

/// Values stay out of logs: lines carry cookies and tokens.
impl fmt::Debug for WireFields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WireFields")
            .field("bytes", &self.lines.len())
            .field("content_length", &self.content_length)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_go_into_a_map_in_order_with_their_values_trimmed() {
        let fields = WireFields::new(
            Bytes::from_static(b"Server: up\r\nSet-Cookie: a=1\r\nset-cookie:b=2  \r\nX-Empty:\r\n"),
            false,
        );
        let mut map = HeaderMap::new();
        fields.into_map(&mut map).unwrap();
        assert_eq!(map["server"], "up");
        let cookies: Vec<_> = map.get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert_eq!(map["x-empty"], "");
        assert_eq!(map.len(), 4);
    }

    #[test]
    fn a_line_that_is_no_field_is_an_error_naming_it() {
        let mut map = HeaderMap::new();
        let err = WireFields::new(Bytes::from_static(b"no colon here\r\nA: b\r\nc d: e\r\n"), false)
            .into_map(&mut map)
            .unwrap_err();
        assert!(err.to_string().contains("no colon here"), "{err}");
        assert_eq!(map["a"], "b", "the valid lines go in");
        assert_eq!(map.len(), 1);
        let err = WireFields::new(Bytes::from_static(b"bad name: x\r\n"), false)
            .into_map(&mut map)
            .unwrap_err();
        assert!(err.to_string().contains("bad name"), "{err}");
    }

    #[test]
    fn debug_output_shows_no_value() {
        let fields = WireFields::new(Bytes::from_static(b"Authorization: Bearer secret\r\n"), false);
        assert!(!format!("{fields:?}").contains("secret"));
    }
}
