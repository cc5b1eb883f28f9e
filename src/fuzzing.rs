//! Fuzz entry points: each takes arbitrary bytes, drives one parser the way the request path
//! does, and asserts the invariants the rest of the sidecar relies on (a panic is a finding).
//!
//! `fuzz/` runs them under libFuzzer (cargo-fuzz, which needs a nightly toolchain); the test
//! below replays the committed corpus (`tests/fuzz_corpus/<target>/`) through them on stable in
//! every `cargo test`, so each input that once found a bug stays a regression test.
//!
//! Not a public API and not in the release library: compiled only under `cfg(fuzzing)`, which
//! cargo-fuzz sets, and `cfg(test)`, so that both runners share one definition of each target.

use std::net::IpAddr;

use bytes::BytesMut;
use http::header::{
    CONNECTION, CONTENT_LENGTH, EXPECT, HOST, PROXY_AUTHORIZATION, TE, TRANSFER_ENCODING, UPGRADE,
};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};

use crate::config::{self, canonical_host, Authority, HostPattern};
use crate::proxy::headers;
use crate::wire::codec::{self, BodyFraming, Decoder};
use crate::wire::frame::{self, Frame, FrameError};

const PROXY_CONNECTION: http::HeaderName = http::HeaderName::from_static("proxy-connection");
const KEEP_ALIVE: http::HeaderName = http::HeaderName::from_static("keep-alive");

/// Largest head the targets accept, as `downstream.max_header_bytes` defaults to.
const MAX_HEAD: usize = 64 * 1024;

/// A fuzz target: arbitrary bytes in, a panic on a broken invariant.
pub type FuzzFn = fn(&[u8]);

/// The fuzz targets by name, for runners that take the name from a directory.
pub const TARGETS: &[(&str, FuzzFn)] = &[
    ("request_head", request_head),
    ("host", host),
    ("header_rewrite", header_rewrite),
    ("config", config),
    ("duration", duration),
    ("limit_report", limit_report),
    ("llm_usage", llm_usage),
    ("hpack", hpack),
    ("frame", frame),
    ("h2client", h2client),
];

/// A request head as the downstream codec reads it, then its body as far as it arrived: a
/// parsed head carries no CR, LF or NUL in any value and exactly one framing, and the body
/// decoder never yields more bytes than it was given.
pub fn request_head(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    let Ok(Some(head)) = codec::parse_head(&mut buf, MAX_HEAD) else {
        return;
    };
    for (name, value) in &head.headers {
        let bytes = value.as_bytes();
        assert!(
            !bytes.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)),
            "{name} carries CR, LF or NUL"
        );
    }
    let lengths = head.headers.get_all(CONTENT_LENGTH).iter().count();
    let codings = head.headers.get_all(TRANSFER_ENCODING).iter().count();
    assert!(lengths <= 1, "{lengths} Content-Length fields accepted");
    assert!(
        lengths == 0 || codings == 0,
        "Content-Length with Transfer-Encoding accepted"
    );
    if head.facts.body == BodyFraming::Chunked {
        let _ = codec::check_buffered_chunks(&buf, MAX_HEAD);
    }
    let given = buf.len();
    let mut decoder = Decoder::new(head.facts.body);
    let mut decoded = 0;
    while let Ok(Some(frame)) = decoder.decode(&mut buf, MAX_HEAD) {
        decoded += frame.data_ref().map_or(0, |d| d.len());
    }
    assert!(decoded <= given, "decoded {decoded} body bytes from {given}");
    if let Some(authority) = head.uri.authority() {
        authority_round_trips(authority.as_str());
    }
}

/// A host as requests, `Host` headers and the policy lists spell it: canonical forms are
/// canonical (parsing one again changes nothing, IPs print as Rust prints them), and patterns
/// and authorities survive printing and parsing again.
pub fn host(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(host) = canonical_host(text) {
        assert_eq!(
            canonical_host(&host).as_ref(),
            Ok(&host),
            "canonical form of {text:?} is not canonical"
        );
        if let Ok(ip) = host.parse::<IpAddr>() {
            assert_eq!(ip.to_canonical().to_string(), host);
        } else {
            assert!(host
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b)));
        }
    }
    if let Ok(pattern) = HostPattern::parse(text) {
        assert_eq!(
            HostPattern::parse(&pattern.to_string()),
            Ok(pattern.clone()),
            "{pattern} from {text:?}"
        );
    }
    authority_round_trips(text);
}

fn authority_round_trips(text: &str) {
    if let Ok(authority) = Authority::parse(text, 80) {
        let again = Authority::parse(&authority.to_string(), 80);
        assert_eq!(again, Ok(authority), "from {text:?}");
    }
}

/// A parsed request rewritten for an upstream, and the same fields as a response rewritten for
/// the application: no hop-by-hop field survives, nor any field `Connection` names (except
/// `Host` and `Content-Length`, which frame and route the message), `TE` is at most
/// `trailers`, and `Host` is the upstream's.
pub fn header_rewrite(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    let Ok(Some(head)) = codec::parse_head(&mut buf, MAX_HEAD) else {
        return;
    };
    let named = connection_names(&head.headers);
    let upstream_host = HeaderValue::from_static("upstream.example:8080");
    let mut req = Request::new(());
    *req.method_mut() = head.method;
    *req.uri_mut() = head.uri;
    *req.headers_mut() = head.headers.clone();
    headers::to_upstream(&mut req, &upstream_host);
    let sent = req.headers();
    assert_eq!(sent.get_all(HOST).iter().collect::<Vec<_>>(), [&upstream_host]);
    assert!(req.uri().scheme().is_none(), "{} is not origin-form", req.uri());
    for gone in [
        CONNECTION,
        TRANSFER_ENCODING,
        UPGRADE,
        PROXY_AUTHORIZATION,
        EXPECT,
        PROXY_CONNECTION,
        KEEP_ALIVE,
    ] {
        assert!(!sent.contains_key(&gone), "{gone} forwarded");
    }
    assert!(sent.get_all(TE).iter().all(|te| te == "trailers"), "TE forwarded");
    assert_removed(sent, &named);

    let mut resp = Response::new(());
    *resp.headers_mut() = head.headers;
    headers::to_downstream(&mut resp);
    for gone in [
        CONNECTION,
        TRANSFER_ENCODING,
        UPGRADE,
        TE,
        PROXY_CONNECTION,
        KEEP_ALIVE,
    ] {
        assert!(!resp.headers().contains_key(&gone), "{gone} returned");
    }
    assert_removed(resp.headers(), &named);
}

fn connection_names(headers: &HeaderMap) -> Vec<http::HeaderName> {
    headers
        .get_all(CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b','))
        .map(<[u8]>::trim_ascii)
        // `close` is the connection option, never taken as a field name.
        .filter(|token| !token.eq_ignore_ascii_case(b"close"))
        .filter_map(|token| http::HeaderName::from_bytes(token).ok())
        // `TE: trailers` is sent on by design (gRPC needs it), whatever `Connection` names; a
        // client sending TE must name it there (RFC 9110 §10.1.4). The TE checks hold it to
        // `trailers`.
        .filter(|name| *name != HOST && *name != CONTENT_LENGTH && *name != TE)
        .collect()
}

fn assert_removed(headers: &HeaderMap, named: &[http::HeaderName]) {
    for name in named {
        assert!(!headers.contains_key(name), "{name}, named by Connection, kept");
    }
}

/// A config file: any text is either a config or a config error, and a config serializes (what
/// `egress-sidecar check` prints).
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = config::parse(text, &Default::default()) {
        serde_json::to_string(&config).expect("a valid config serializes");
    }
}

/// A duration from outside, through every parser of `crate::duration`: whatever one accepts is
/// at most `LONGEST` and adds to both clocks without overflow; nothing panics.
pub fn duration(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let now = std::time::SystemTime::now();
    let parsed = [
        crate::duration::human(&text),
        crate::duration::seconds(&text),
        crate::duration::millis(&text),
        crate::duration::until(&text, now),
        crate::duration::go(&text),
        crate::duration::until_rfc3339(&text, now),
    ];
    for d in parsed.into_iter().flatten() {
        assert!(d <= crate::duration::LONGEST, "{text:?} gave {d:?}");
        assert!(now.checked_add(d).is_some(), "{text:?}: SystemTime + {d:?}");
        assert!(
            std::time::Instant::now().checked_add(d).is_some(),
            "{text:?}: Instant + {d:?}"
        );
    }
}

/// A response's limit fields, one `name: value` a line, the first line the status: every
/// duration read is bounded, and every value told as malformed is one of a field read, in
/// lower case, cut to 64 characters.
pub fn limit_report(data: &[u8]) {
    use crate::pace::report::Report;
    let mut lines = data.split(|b| *b == b'\n');
    let status = lines
        .next()
        .and_then(|l| std::str::from_utf8(l).ok()?.trim().parse().ok())
        .unwrap_or(429);
    let fields = lines.filter_map(|line| {
        let colon = line.iter().position(|b| *b == b':')?;
        Some((&line[..colon], line[colon + 1..].trim_ascii()))
    });
    let now = std::time::SystemTime::now();
    let report = Report::read(status, fields, now, &mut |bad| {
        assert!(bad.value.chars().count() <= 64, "{bad:?}");
        assert_eq!(bad.header, bad.header.to_ascii_lowercase(), "{bad:?}");
        assert!(
            crate::wire::names::is_limit_field(bad.header.as_bytes()),
            "{bad:?}"
        );
    });
    let quotas = [report.requests, report.tokens].into_iter().flatten();
    let waits = quotas
        .flat_map(|q| [q.reset, q.window])
        .chain([report.retry_after]);
    for d in waits.flatten() {
        assert!(d <= crate::duration::LONGEST, "{report:?}");
    }
}

/// A response body as the usage reader sees it, the first byte choosing where it is cut into
/// chunks: for both framings and every shape, the outcome, the events and `shaped` are the same
/// whole and chunked, a second `finish` says what the first did, and no count read is more than
/// the fields it adds up may hold (each at most 2^53).
pub fn llm_usage(data: &[u8]) {
    use crate::llm::{Framing, Outcome, Reader, Shapes, Tokens};
    let Some((&seed, body)) = data.split_first() else {
        return;
    };
    let mut chunks = Vec::new();
    let mut rest = body;
    let mut draw = u32::from(seed) | 0x100;
    while !rest.is_empty() {
        // xorshift32: chunk lengths from 1 to 24, as the seed says.
        draw ^= draw << 13;
        draw ^= draw >> 17;
        draw ^= draw << 5;
        let (chunk, after) = rest.split_at((draw % 24 + 1).min(rest.len() as u32) as usize);
        chunks.push(chunk);
        rest = after;
    }
    // How many raw fields each count adds up, per shape (`Shapes::All`: all of them).
    let terms = |shapes: Shapes| -> Tokens {
        let (input, output, cache_read, cache_write, reasoning) = match shapes {
            Shapes::All => (5, 4, 4, 1, 3),
            Shapes::OpenAi => (2, 2, 2, 0, 2),
            Shapes::Anthropic => (3, 1, 1, 1, 0),
            Shapes::Gemini => (1, 2, 1, 0, 1),
        };
        Tokens {
            input,
            output,
            cache_read,
            cache_write,
            reasoning,
        }
    };
    for framing in [Framing::Json, Framing::Sse] {
        for shapes in [Shapes::All, Shapes::OpenAi, Shapes::Anthropic, Shapes::Gemini] {
            let run = |chunks: &[&[u8]]| {
                let mut reader = Reader::new(framing, shapes);
                for chunk in chunks {
                    reader.feed(chunk);
                }
                let seen = (reader.events(), reader.shaped());
                let outcome = reader.finish(true);
                assert_eq!(reader.finish(false), outcome, "{framing:?} {shapes:?}");
                (outcome, seen)
            };
            let whole = run(&[body]);
            assert_eq!(run(&chunks), whole, "{framing:?} {shapes:?}");
            if let Outcome::Read(usage) = whole.0 {
                let (t, n) = (usage.tokens, terms(shapes));
                let most = |terms: u64| terms << 53;
                assert!(
                    t.input <= most(n.input)
                        && t.output <= most(n.output)
                        && t.cache_read <= most(n.cache_read)
                        && t.cache_write <= most(n.cache_write)
                        && t.reasoning <= most(n.reasoning),
                    "{framing:?} {shapes:?}: {usage:?}"
                );
            }
        }
    }
}

/// Header blocks from an HTTP/2 peer, through one decoder as a connection would send them: the
/// first byte times 32 is the table size we announce, then each block is a length byte and that
/// many bytes. No table outgrows its maximum, and the fields of every block decoded (up to a
/// list too large), coded again by our encoder, decode the same in a fresh decoder, which adds
/// nothing to its table. Names are lowercased first, as the encoder takes only lowercase.
pub fn hpack(data: &[u8]) {
    use crate::wire::hpack::{DecodeError, Decoder, Encoder};
    let Some((&size, mut rest)) = data.split_first() else {
        return;
    };
    let announced = usize::from(size) * 32;
    let mut decoder = Decoder::new(announced, 16 * 1024);
    while let Some((&len, tail)) = rest.split_first() {
        let (block, after) = tail.split_at(usize::from(len).min(tail.len()));
        rest = after;
        let mut fields = Vec::new();
        let outcome = decoder.decode(block, |f| {
            fields.push((f.name.to_ascii_lowercase(), f.value.to_vec()));
            Ok::<_, std::convert::Infallible>(())
        });
        assert!(
            decoder.table_size() <= decoder.table_max(),
            "table past its maximum"
        );
        assert!(
            decoder.table_max() <= announced,
            "table maximum past the announced size"
        );
        if let Err(DecodeError::Block(_)) = outcome {
            // The connection ends here.
            return;
        }
        let mut again = BytesMut::new();
        for (name, value) in &fields {
            Encoder.encode(name, value, false, &mut again);
        }
        let mut fresh = Decoder::new(0, usize::MAX);
        let mut decoded = Vec::new();
        fresh
            .decode(&again, |f| {
                decoded.push((f.name.to_vec(), f.value.to_vec()));
                Ok::<_, std::convert::Infallible>(())
            })
            .expect("our encoding decodes");
        assert_eq!(decoded, fields, "fields changed through our encoder");
        assert_eq!(fresh.table_size(), 0, "our encoding added to the table");
    }
}

/// HTTP/2 frames from a peer, as a connection reads them: the first byte times 64 is the
/// `SETTINGS_MAX_FRAME_SIZE` we announce, the rest is what the socket gives. The bytes parsed
/// all at once and arriving one at a time give the same frames and errors; a frame taken off the
/// buffer is the length its header says and within the maximum, and a stream error takes its
/// frame too; every frame of a type we also send comes back the same through our encoder.
pub fn frame(data: &[u8]) {
    let Some((&size, rest)) = data.split_first() else {
        return;
    };
    let max = u32::from(size) * 64;
    let whole = frames_arriving(rest, max, rest.len().max(1));
    let trickled = frames_arriving(rest, max, 1);
    assert_eq!(whole, trickled, "parsing depends on how the bytes arrive");
    for frame in whole.iter().flatten() {
        frame_encoded_again(frame);
    }
}

/// What parsing `data` gives when it arrives `chunk` bytes at a time: each frame or error, up to
/// a connection error or the end of `data`.
fn frames_arriving(data: &[u8], max: u32, chunk: usize) -> Vec<Result<Frame, FrameError>> {
    let mut arriving = data.chunks(chunk);
    let mut buf = BytesMut::new();
    let mut outcomes = Vec::new();
    loop {
        let before = buf.len();
        let declared = buf
            .first_chunk::<3>()
            .map(|len| u32::from_be_bytes([0, len[0], len[1], len[2]]));
        let outcome = match Frame::parse(&mut buf, max) {
            Ok(None) => {
                assert_eq!(buf.len(), before, "an incomplete frame took bytes");
                let Some(more) = arriving.next() else {
                    return outcomes;
                };
                buf.extend_from_slice(more);
                continue;
            }
            Ok(Some(frame)) => Ok(frame),
            Err(e) if e.is_connection() => {
                outcomes.push(Err(e));
                return outcomes;
            }
            Err(e) => Err(e),
        };
        let len = declared.expect("a frame has a header");
        assert!(len <= max, "a frame of {len} bytes over the maximum {max}");
        let taken = before - buf.len();
        assert_eq!(taken, frame::HEADER_LEN + len as usize, "took {taken} bytes");
        outcomes.push(outcome);
    }
}

/// A frame of a type we send, encoded by us and parsed again, is the frame (less what we never
/// send: padding, priority, a header block cut short of END_HEADERS).
fn frame_encoded_again(frame: &Frame) {
    use frame::encode;
    let mut out = BytesMut::new();
    let expected = match frame.clone() {
        Frame::Settings { ack: false, settings } => {
            encode::settings(&settings, &mut out);
            frame.clone()
        }
        Frame::Settings { ack: true, .. } => {
            encode::settings_ack(&mut out);
            frame.clone()
        }
        Frame::Ping { ack, payload } => {
            let ping = if ack { encode::ping_ack } else { encode::ping };
            ping(payload, &mut out);
            frame.clone()
        }
        Frame::RstStream {
            stream_id,
            error_code,
        } => {
            encode::rst_stream(stream_id, error_code, &mut out);
            frame.clone()
        }
        Frame::GoAway {
            last_stream_id,
            error_code,
            debug_data,
        } if debug_data.len() <= frame::DEFAULT_MAX_FRAME_SIZE as usize - 8 => {
            encode::goaway(last_stream_id, error_code, &debug_data, &mut out);
            frame.clone()
        }
        Frame::WindowUpdate { stream_id, increment } => {
            encode::window_update(stream_id, increment, &mut out);
            frame.clone()
        }
        Frame::Data {
            stream_id,
            data,
            end_stream,
            ..
        } => {
            encode::data(stream_id, &data, end_stream, frame::MAX_MAX_FRAME_SIZE, &mut out);
            let flow_len = data.len() as u32;
            Frame::Data {
                stream_id,
                data,
                end_stream,
                flow_len,
            }
        }
        Frame::Headers {
            stream_id,
            fragment,
            end_stream,
            ..
        } => {
            let max = frame::MAX_MAX_FRAME_SIZE;
            encode::headers(stream_id, &fragment, end_stream, max, &mut out);
            Frame::Headers {
                stream_id,
                fragment,
                end_stream,
                end_headers: true,
            }
        }
        _ => return,
    };
    let again = Frame::parse(&mut out, frame::MAX_MAX_FRAME_SIZE);
    assert_eq!(again, Ok(Some(expected)), "our encoding parses differently");
    assert!(out.is_empty(), "our encoding left bytes over");
}

/// An upstream's bytes to our HTTP/2 client connection. The first byte says what is open before
/// they arrive: its low two bits, how many GETs; bit 2, a POST whose body waits; bit 3, small
/// receive windows (1,024 per stream), so that flow-control errors are reachable. The rest is
/// what the socket gives. All at once or a byte at a time, the events, our output and the error
/// are the same; a head's fields are valid HTTP/1.1 lines; everything we write parses as frames;
/// after an error no stream is left open. Data is released, and the POST's body sent, at the end.
pub fn h2client(data: &[u8]) {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let whole = h2client_run(control, rest, rest.len().max(1));
    let trickled = h2client_run(control, rest, 1);
    assert_eq!(whole, trickled, "the connection depends on how the bytes arrive");
}

type H2Outcome = (
    Vec<crate::wire::h2client::Event>,
    Vec<u8>,
    Option<crate::wire::h2client::ConnError>,
);

fn h2client_run(control: u8, data: &[u8], chunk: usize) -> H2Outcome {
    use crate::wire::h2client::{Config, Connection, Event, RequestHead};
    let mut config = Config::default();
    if control & 8 != 0 {
        config.stream_window = 1_024;
        config.connection_window = 65_535;
    }
    let mut conn = Connection::new(config);
    let headers = HeaderMap::new();
    let head = |method| RequestHead {
        method,
        scheme: "https",
        authority: "api.example",
        path: "/",
        headers: &headers,
        lines: crate::wire::HeadLines::NONE,
    };
    for _ in 0..control & 3 {
        conn.open(&head(&http::Method::GET), true)
            .expect("a fresh connection opens streams");
    }
    let post = (control & 4 != 0).then(|| conn.open(&head(&http::Method::POST), false).unwrap());
    let (mut events, mut error) = (Vec::new(), None);
    let mut buf = BytesMut::new();
    for piece in data.chunks(chunk) {
        buf.extend_from_slice(piece);
        let result = conn.recv(&mut buf);
        events.extend(std::iter::from_fn(|| conn.next_event()));
        if let Err(e) = result {
            assert_eq!(conn.open_streams(), 0, "a stream outlived its connection");
            error = Some(e);
            break;
        }
    }
    for event in &events {
        match event {
            Event::Head { fields, .. } | Event::Trailers { fields, .. } => {
                h2_lines_valid(fields.lines.lines())
            }
            Event::Data { stream_id, data, .. } => conn.release(*stream_id, data.len()),
            _ => {}
        }
    }
    if let Some(id) = post {
        let _ = conn.send_data(id, &mut bytes::Bytes::from_static(&[0; 100_000]), true);
    }
    let out = conn.out().split();
    h2_frames_valid(&out);
    (events, out.to_vec(), error)
}

/// Each line `name: value` CRLF, the name a lowercase token, the value fit for a field.
fn h2_lines_valid(lines: &[u8]) {
    for line in lines.split_inclusive(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r\n").expect("a line ends in CRLF");
        let colon = line.iter().position(|b| *b == b':').expect("a line has a colon");
        let (name, value) = (&line[..colon], &line[colon + 2..]);
        assert!(
            HeaderName::from_bytes(name).is_ok_and(|n| n.as_str().as_bytes() == name),
            "name {name:?}"
        );
        assert!(HeaderValue::from_bytes(value).is_ok(), "value {value:?}");
    }
}

/// Our output: the preface, then whole, well-formed frames.
fn h2_frames_valid(out: &[u8]) {
    let mut out = BytesMut::from(out);
    if out.starts_with(frame::PREFACE) {
        let _ = out.split_to(frame::PREFACE.len());
    }
    while let Some(_frame) = Frame::parse(&mut out, frame::MAX_MAX_FRAME_SIZE).expect("our frames parse") {}
    assert!(out.is_empty(), "a partial frame in our output");
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    /// The committed corpus, replayed through the same targets cargo-fuzz runs, on stable: every
    /// input that once found a bug, and every seed, stays a regression test without a nightly
    /// toolchain.
    #[test]
    fn every_corpus_input_passes_its_target() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus");
        for (name, target) in super::TARGETS {
            let dir = root.join(name);
            let inputs: Vec<_> = std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|entry| entry.unwrap().path())
                .collect();
            assert!(!inputs.is_empty(), "{name}: empty corpus");
            for input in inputs {
                let data = std::fs::read(&input).unwrap();
                let outcome = std::panic::catch_unwind(|| target(&data));
                assert!(outcome.is_ok(), "{name}: {} fails", input.display());
            }
        }
    }
}
