//! Tests of the frame codec: each type encoded then parsed, hand-built frames for what we never
//! send (padding, priority, PUSH_PROMISE, unknown types), every shape rule of RFC 9113 §6 with
//! its scope and code, and input that arrives a byte at a time. The h2 interop test is in
//! `interop.rs`.

use std::convert::Infallible;

use bytes::{BufMut, BytesMut};

use super::*;
use crate::wire::hpack;

/// Plenty for every frame here; the size rules have their own tests.
const MAX: u32 = DEFAULT_MAX_FRAME_SIZE;

/// A frame built by hand, so that the parser is not only checked against our own encoder.
fn raw(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream_id.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// Parses the one frame `bytes` holds; it must take all of them.
fn parse(bytes: &[u8]) -> Result<Frame, FrameError> {
    let mut buf = BytesMut::from(bytes);
    let frame = Frame::parse(&mut buf, MAX)?.expect("a whole frame");
    assert!(buf.is_empty(), "{} bytes left after {frame:?}", buf.len());
    Ok(frame)
}

/// Parses what one encoder call appended.
fn round_trip(encode: impl FnOnce(&mut BytesMut)) -> Frame {
    let mut buf = BytesMut::new();
    encode(&mut buf);
    parse(&buf).expect("our own frame parses")
}

/// Every frame in `buf`, in order, until it is empty.
fn parse_all(buf: &mut BytesMut, max: u32) -> Vec<Frame> {
    let mut frames = Vec::new();
    while let Some(frame) = Frame::parse(buf, max).expect("a valid frame") {
        frames.push(frame);
    }
    assert!(buf.is_empty(), "{} bytes left", buf.len());
    frames
}

fn connection_error(bytes: &[u8], code: ErrorCode, violation: Violation) {
    let err = parse(bytes).expect_err("refused");
    assert_eq!(err, FrameError::Connection { code, violation }, "{err}");
    assert!(err.is_connection());
}

fn settings_frame(params: &[(u16, u32)]) -> Vec<u8> {
    let mut payload = Vec::new();
    for (id, value) in params {
        payload.extend_from_slice(&id.to_be_bytes());
        payload.extend_from_slice(&value.to_be_bytes());
    }
    raw(0x4, 0, 0, &payload)
}

/// A header block of `fields`, coded by our HPACK encoder.
pub(super) fn hpack_block(fields: &[(&str, &str)]) -> BytesMut {
    let mut block = BytesMut::new();
    for (name, value) in fields {
        hpack::Encoder.encode(name.as_bytes(), value.as_bytes(), false, &mut block);
    }
    block
}

fn hpack_decode(block: &[u8]) -> Vec<(String, String)> {
    let mut decoder = hpack::Decoder::new(4096, 64 * 1024);
    let mut fields = Vec::new();
    let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    decoder
        .decode(block, |f| {
            fields.push((lossy(f.name), lossy(f.value)));
            Ok::<_, Infallible>(())
        })
        .expect("a valid block");
    fields
}

// === round trips ===

#[test]
fn settings_round_trip_with_every_parameter() {
    let settings = Settings {
        header_table_size: Some(0),
        enable_push: Some(false),
        max_concurrent_streams: Some(100),
        initial_window_size: Some(MAX_WINDOW_SIZE),
        max_frame_size: Some(MAX_MAX_FRAME_SIZE),
        max_header_list_size: Some(65_536),
    };
    let frame = round_trip(|dst| encode::settings(&settings, dst));
    assert_eq!(frame, Frame::Settings { ack: false, settings });
    let empty = round_trip(|dst| encode::settings(&Settings::default(), dst));
    let settings = Settings::default();
    assert_eq!(empty, Frame::Settings { ack: false, settings });
}

#[test]
fn settings_ack_round_trips_empty() {
    let frame = round_trip(encode::settings_ack);
    let settings = Settings::default();
    assert_eq!(frame, Frame::Settings { ack: true, settings });
}

#[test]
fn window_update_round_trips_for_the_connection_and_a_stream() {
    for (stream_id, increment) in [(0, 1), (0, MAX_WINDOW_SIZE), (7, 65_535)] {
        let frame = round_trip(|dst| encode::window_update(stream_id, increment, dst));
        let expected = Frame::WindowUpdate { stream_id, increment };
        assert_eq!(frame, expected);
    }
}

#[test]
fn ping_and_its_ack_round_trip() {
    let payload = *b"12345678";
    assert_eq!(
        round_trip(|dst| encode::ping(payload, dst)),
        Frame::Ping { ack: false, payload }
    );
    assert_eq!(
        round_trip(|dst| encode::ping_ack(payload, dst)),
        Frame::Ping { ack: true, payload }
    );
}

#[test]
fn rst_stream_round_trips_and_keeps_an_unknown_code() {
    for error_code in [ErrorCode::CANCEL, ErrorCode(0xdead_beef)] {
        let frame = round_trip(|dst| encode::rst_stream(3, error_code, dst));
        let expected = Frame::RstStream {
            stream_id: 3,
            error_code,
        };
        assert_eq!(frame, expected);
    }
}

#[test]
fn goaway_round_trips_with_its_debug_data() {
    let frame = round_trip(|dst| encode::goaway(5, ErrorCode::ENHANCE_YOUR_CALM, b"slow down", dst));
    let expected = Frame::GoAway {
        last_stream_id: 5,
        error_code: ErrorCode::ENHANCE_YOUR_CALM,
        debug_data: Bytes::from_static(b"slow down"),
    };
    assert_eq!(frame, expected);
}

/// Any peer takes a GOAWAY of 16,384 bytes, so longer debug data is cut to fit.
#[test]
fn goaway_debug_data_is_cut_to_the_smallest_max_frame_size() {
    let long = vec![b'x'; 20_000];
    let mut buf = BytesMut::new();
    encode::goaway(1, ErrorCode::NO_ERROR, &long, &mut buf);
    assert_eq!(buf.len(), HEADER_LEN + DEFAULT_MAX_FRAME_SIZE as usize);
    let Ok(Frame::GoAway { debug_data, .. }) = parse(&buf) else {
        panic!("a GOAWAY");
    };
    assert_eq!(debug_data.len(), DEFAULT_MAX_FRAME_SIZE as usize - 8);
}

#[test]
fn data_round_trips_with_and_without_end_stream() {
    for end_stream in [false, true] {
        let frame = round_trip(|dst| encode::data(1, b"body", end_stream, MAX, dst));
        let expected = Frame::Data {
            stream_id: 1,
            data: Bytes::from_static(b"body"),
            end_stream,
            flow_len: 4,
        };
        assert_eq!(frame, expected);
    }
    let empty = round_trip(|dst| encode::data(1, b"", true, MAX, dst));
    let expected = Frame::Data {
        stream_id: 1,
        data: Bytes::new(),
        end_stream: true,
        flow_len: 0,
    };
    assert_eq!(empty, expected);
}

#[test]
fn data_longer_than_a_frame_is_split_with_end_stream_on_the_last() {
    let mut buf = BytesMut::new();
    encode::data(3, b"abcdefghij", true, 4, &mut buf);
    let frames = parse_all(&mut buf, 4);
    let parts: Vec<_> = frames
        .iter()
        .map(|f| match f {
            Frame::Data {
                stream_id: 3,
                data,
                end_stream,
                ..
            } => (data.clone(), *end_stream),
            other => panic!("{other:?}"),
        })
        .collect();
    let expected =
        [("abcd", false), ("efgh", false), ("ij", true)].map(|(d, e)| (Bytes::from_static(d.as_bytes()), e));
    assert_eq!(parts, expected);
}

#[test]
fn a_short_header_block_is_one_headers_frame() {
    let block = hpack_block(&[(":status", "200")]);
    let frame = round_trip(|dst| encode::headers(1, &block, true, MAX, dst));
    let expected = Frame::Headers {
        stream_id: 1,
        fragment: block.freeze(),
        end_stream: true,
        end_headers: true,
    };
    assert_eq!(frame, expected);
}

/// The block goes out as HEADERS (END_STREAM, not END_HEADERS) and CONTINUATIONs, END_HEADERS
/// on the last only; the fragments joined decode to the fields sent.
#[test]
fn a_header_block_split_by_a_small_max_frame_size_reassembles() {
    let fields = [
        (":method", "GET"),
        (":scheme", "http"),
        (":authority", "upstream.test"),
        (":path", "/a/rather/long/path?with=a&query=string"),
        ("x-custom", "a value long enough to need several frames"),
    ];
    let block = hpack_block(&fields);
    let max = 10;
    let mut buf = BytesMut::new();
    encode::headers(5, &block, true, max, &mut buf);
    let frames = parse_all(&mut buf, max);
    assert_eq!(frames.len(), block.len().div_ceil(max as usize));
    let mut joined = Vec::new();
    for (i, frame) in frames.iter().enumerate() {
        let last = i == frames.len() - 1;
        let fragment = match (i, frame) {
            (
                0,
                Frame::Headers {
                    stream_id: 5,
                    fragment,
                    end_stream: true,
                    end_headers,
                },
            ) => {
                assert_eq!(*end_headers, last);
                fragment
            }
            (
                1..,
                Frame::Continuation {
                    stream_id: 5,
                    fragment,
                    end_headers,
                },
            ) => {
                assert_eq!(*end_headers, last, "frame {i}");
                fragment
            }
            (_, other) => panic!("frame {i}: {other:?}"),
        };
        assert!(fragment.len() <= max as usize);
        joined.extend_from_slice(fragment);
    }
    let expected: Vec<_> = fields
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    assert_eq!(hpack_decode(&joined), expected);
}

// === what we parse but never send ===

/// Padding is cut off, but the flow-controlled length counts all of the payload (§6.9.1).
#[test]
fn padded_data_loses_its_padding_but_not_its_flow_length() {
    let frame = parse(&raw(0x0, 0x8 | 0x1, 1, b"\x03abc\0\0\0")).unwrap();
    let expected = Frame::Data {
        stream_id: 1,
        data: Bytes::from_static(b"abc"),
        end_stream: true,
        flow_len: 7,
    };
    assert_eq!(frame, expected);
    let all_padding = parse(&raw(0x0, 0x8, 1, b"\x02\0\0")).unwrap();
    assert!(matches!(all_padding, Frame::Data { ref data, flow_len: 3, .. } if data.is_empty()));
}

#[test]
fn headers_lose_padding_and_priority_fields() {
    // PADDED | PRIORITY | END_HEADERS: pad 2, dependency 3 (exclusive), weight 16.
    let payload = b"\x02\x80\0\0\x03\x10\x88xy";
    let frame = parse(&raw(0x1, 0x8 | 0x20 | 0x4, 1, payload)).unwrap();
    let expected = Frame::Headers {
        stream_id: 1,
        fragment: Bytes::from_static(b"\x88"),
        end_stream: false,
        end_headers: true,
    };
    assert_eq!(frame, expected);
    let priority_only = parse(&raw(0x1, 0x20, 1, b"\0\0\0\0\x10\x88")).unwrap();
    assert!(
        matches!(priority_only, Frame::Headers { ref fragment, end_headers: false, .. }
        if fragment[..] == b"\x88"[..])
    );
}

#[test]
fn push_promise_is_parsed_for_refusal() {
    let payload = b"\x01\x80\0\0\x02\x82\0";
    let frame = parse(&raw(0x5, 0x8 | 0x4, 1, payload)).unwrap();
    let expected = Frame::PushPromise {
        stream_id: 1,
        promised_stream_id: 2,
        fragment: Bytes::from_static(b"\x82"),
        end_headers: true,
    };
    assert_eq!(frame, expected);
}

#[test]
fn priority_and_continuation_parse() {
    let priority = parse(&raw(0x2, 0, 3, b"\0\0\0\x01\xff")).unwrap();
    assert_eq!(priority, Frame::Priority { stream_id: 3 });
    let continuation = parse(&raw(0x9, 0x4, 3, b"\x82")).unwrap();
    let expected = Frame::Continuation {
        stream_id: 3,
        fragment: Bytes::from_static(b"\x82"),
        end_headers: true,
    };
    assert_eq!(continuation, expected);
}

/// §5.5: an unknown type is taken off the buffer and handed on for the connection to ignore.
#[test]
fn an_unknown_type_is_handed_on_and_the_next_frame_parses() {
    let mut bytes = raw(0xfa, 0xff, 9, b"whatever");
    bytes.extend_from_slice(&raw(0x6, 0, 0, b"pingpong"));
    let mut buf = BytesMut::from(&bytes[..]);
    let frames = parse_all(&mut buf, MAX);
    let expected = [
        Frame::Unknown {
            kind: 0xfa,
            stream_id: 9,
            len: 8,
        },
        Frame::Ping {
            ack: false,
            payload: *b"pingpong",
        },
    ];
    assert_eq!(frames, expected);
}

#[test]
fn unknown_flags_are_ignored() {
    let frame = parse(&raw(0x8, 0xff, 0, &[0, 0, 0, 1])).unwrap();
    let expected = Frame::WindowUpdate {
        stream_id: 0,
        increment: 1,
    };
    assert_eq!(frame, expected);
}

/// §4.1, §6.8, §6.9: the reserved bit is ignored wherever a stream id or increment carries it.
#[test]
fn reserved_bits_are_ignored() {
    let data = parse(&raw(0x0, 0, 0x8000_0001, b"x")).unwrap();
    assert_eq!(data.stream_id(), 1);
    let update = parse(&raw(0x8, 0, 0x8000_0000, &[0x80, 0, 0, 5])).unwrap();
    let expected = Frame::WindowUpdate {
        stream_id: 0,
        increment: 5,
    };
    assert_eq!(update, expected);
    let goaway = parse(&raw(0x7, 0, 0, &[0x80, 0, 0, 7, 0, 0, 0, 0])).unwrap();
    assert!(
        matches!(
            goaway,
            Frame::GoAway {
                last_stream_id: 7,
                ..
            }
        ),
        "{goaway:?}"
    );
}

// === SETTINGS values (§6.5.2) ===

#[test]
fn settings_keep_the_last_of_a_repeated_parameter_and_ignore_unknown_ones() {
    let frame = parse(&settings_frame(&[(0x3, 10), (0x99, 7), (0x3, 20), (0x2, 1)])).unwrap();
    let settings = Settings {
        max_concurrent_streams: Some(20),
        enable_push: Some(true),
        ..Settings::default()
    };
    assert_eq!(frame, Frame::Settings { ack: false, settings });
}

#[test]
fn settings_values_at_their_bounds_are_accepted() {
    for (id, value) in [
        (0x2, 0),
        (0x2, 1),
        (0x4, MAX_WINDOW_SIZE),
        (0x5, DEFAULT_MAX_FRAME_SIZE),
        (0x5, MAX_MAX_FRAME_SIZE),
    ] {
        assert!(parse(&settings_frame(&[(id, value)])).is_ok(), "{id}={value}");
    }
}

#[test]
fn settings_values_out_of_range_are_connection_errors() {
    let cases = [
        ((0x2, 2), ErrorCode::PROTOCOL_ERROR, Violation::EnablePush(2)),
        (
            (0x4, MAX_WINDOW_SIZE + 1),
            ErrorCode::FLOW_CONTROL_ERROR,
            Violation::InitialWindowSize(MAX_WINDOW_SIZE + 1),
        ),
        (
            (0x5, DEFAULT_MAX_FRAME_SIZE - 1),
            ErrorCode::PROTOCOL_ERROR,
            Violation::MaxFrameSize(DEFAULT_MAX_FRAME_SIZE - 1),
        ),
        (
            (0x5, MAX_MAX_FRAME_SIZE + 1),
            ErrorCode::PROTOCOL_ERROR,
            Violation::MaxFrameSize(MAX_MAX_FRAME_SIZE + 1),
        ),
    ];
    for (param, code, violation) in cases {
        connection_error(&settings_frame(&[param]), code, violation);
    }
}

// === shape errors (§4.2, §6) ===

/// A type that belongs to a stream on stream 0, or one that belongs to the connection on a
/// stream (§6.1 to §6.8, §6.10).
#[test]
fn the_wrong_stream_for_a_type_is_a_connection_protocol_error() {
    let cases = [
        (Kind::Data, 0, &b"x"[..]),
        (Kind::Headers, 0, b"\x88"),
        (Kind::Priority, 0, b"\0\0\0\x01\x10"),
        (Kind::RstStream, 0, b"\0\0\0\x08"),
        (Kind::PushPromise, 0, b"\0\0\0\x02"),
        (Kind::Continuation, 0, b"\x88"),
        (Kind::Settings, 1, b""),
        (Kind::Ping, 1, b"12345678"),
        (Kind::GoAway, 1, b"\0\0\0\0\0\0\0\0"),
    ];
    for (kind, stream_id, payload) in cases {
        let violation = match stream_id {
            0 => Violation::StreamZero(kind),
            _ => Violation::NotStreamZero { kind, stream_id },
        };
        let bytes = raw(kind as u8, 0, stream_id, payload);
        connection_error(&bytes, ErrorCode::PROTOCOL_ERROR, violation);
    }
}

/// RST_STREAM 4, PING 8, WINDOW_UPDATE 4, SETTINGS a multiple of 6 and 0 with ACK, GOAWAY at
/// least 8, PUSH_PROMISE room for its promised id, HEADERS with PRIORITY room for its 5 bytes,
/// a padded frame room for its pad length: anything else is a connection FRAME_SIZE_ERROR.
#[test]
fn wrong_lengths_are_connection_frame_size_errors() {
    let cases: &[(Kind, u8, u32, usize)] = &[
        (Kind::RstStream, 0, 1, 3),
        (Kind::RstStream, 0, 1, 5),
        (Kind::Ping, 0, 0, 7),
        (Kind::Ping, 0, 0, 9),
        (Kind::WindowUpdate, 0, 0, 3),
        (Kind::WindowUpdate, 0, 1, 5),
        (Kind::Settings, 0, 0, 5),
        (Kind::Settings, 0, 0, 7),
        (Kind::Settings, 0x1, 0, 6),
        (Kind::GoAway, 0, 0, 7),
        (Kind::PushPromise, 0, 1, 3),
        (Kind::Headers, 0x20, 1, 4),
        (Kind::Data, 0x8, 1, 0),
        (Kind::Headers, 0x8, 1, 0),
        (Kind::PushPromise, 0x8, 1, 0),
    ];
    for &(kind, flags, stream_id, len) in cases {
        let payload = vec![0; len];
        let violation = Violation::Length {
            kind,
            len: len as u32,
        };
        let bytes = raw(kind as u8, flags, stream_id, &payload);
        connection_error(&bytes, ErrorCode::FRAME_SIZE_ERROR, violation);
    }
}

/// §6.3: PRIORITY of the wrong length is a stream error; the frame is taken off the buffer and
/// the next one parses.
#[test]
fn priority_of_the_wrong_length_is_a_stream_error() {
    for len in [4, 6] {
        let mut bytes = raw(0x2, 0, 3, &vec![0; len]);
        bytes.extend_from_slice(&raw(0x6, 0, 0, b"12345678"));
        let mut buf = BytesMut::from(&bytes[..]);
        let err = Frame::parse(&mut buf, MAX).expect_err("refused");
        let expected = FrameError::Stream {
            stream_id: 3,
            code: ErrorCode::FRAME_SIZE_ERROR,
            violation: Violation::Length {
                kind: Kind::Priority,
                len: len as u32,
            },
        };
        assert_eq!(err, expected);
        assert!(!err.is_connection());
        let next = Frame::parse(&mut buf, MAX).unwrap().unwrap();
        assert!(matches!(next, Frame::Ping { .. }), "{next:?}");
    }
}

/// §6.1, §6.2, §6.6: a pad length equal to the payload's length or more.
#[test]
fn padding_as_long_as_the_payload_is_a_connection_protocol_error() {
    for (kind, flags) in [
        (Kind::Data, 0x8),
        (Kind::Headers, 0x8),
        (Kind::Headers, 0x8 | 0x20),
        (Kind::PushPromise, 0x8),
    ] {
        for pad in [6, 7, 255] {
            let payload = [pad, 0, 0, 0, 0, 0];
            let violation = Violation::Padding { pad, len: 6 };
            let bytes = raw(kind as u8, flags, 1, &payload);
            connection_error(&bytes, ErrorCode::PROTOCOL_ERROR, violation);
        }
    }
}

/// §6.9: a stream error on a stream (the frame taken off the buffer), a connection error on
/// the connection's window; the reserved bit does not make the increment non-zero.
#[test]
fn a_window_update_of_zero_is_a_protocol_error_scoped_by_its_stream() {
    for increment in [[0, 0, 0, 0], [0x80, 0, 0, 0]] {
        let violation = Violation::ZeroIncrement;
        connection_error(&raw(0x8, 0, 0, &increment), ErrorCode::PROTOCOL_ERROR, violation);
        let mut buf = BytesMut::from(&raw(0x8, 0, 3, &increment)[..]);
        let err = Frame::parse(&mut buf, MAX).expect_err("refused");
        let expected = FrameError::Stream {
            stream_id: 3,
            code: ErrorCode::PROTOCOL_ERROR,
            violation,
        };
        assert_eq!(err, expected);
        assert!(buf.is_empty(), "the frame was taken");
    }
}

/// §4.2: refused once the header is in, before the payload it announces arrives; a frame of
/// exactly the maximum is fine.
#[test]
fn a_frame_over_our_max_frame_size_is_refused_from_its_header() {
    let max = 100;
    let mut header = BytesMut::new();
    header.put_slice(&raw(0x0, 0, 1, &[0; 101])[..HEADER_LEN]);
    let err = Frame::parse(&mut header, max).expect_err("refused");
    let violation = Violation::TooLarge { len: 101, max };
    assert_eq!(
        err,
        FrameError::connection(ErrorCode::FRAME_SIZE_ERROR, violation)
    );
    let mut exact = BytesMut::from(&raw(0x0, 0, 1, &[0; 100])[..]);
    assert!(Frame::parse(&mut exact, max).unwrap().is_some());
}

// === arrival ===

/// One of each frame we encode and of those we only parse.
fn one_of_each() -> Vec<Vec<u8>> {
    let mut encoded: Vec<BytesMut> = Vec::new();
    let mut put = |f: &dyn Fn(&mut BytesMut)| {
        let mut buf = BytesMut::new();
        f(&mut buf);
        encoded.push(buf);
    };
    let settings = Settings {
        max_frame_size: Some(MAX),
        ..Settings::default()
    };
    put(&|dst| encode::settings(&settings, dst));
    put(&encode::settings_ack);
    put(&|dst| encode::window_update(0, 1000, dst));
    put(&|dst| encode::ping(*b"abcdefgh", dst));
    put(&|dst| encode::rst_stream(1, ErrorCode::CANCEL, dst));
    put(&|dst| encode::goaway(1, ErrorCode::NO_ERROR, b"bye", dst));
    put(&|dst| encode::data(1, b"data", true, MAX, dst));
    put(&|dst| encode::headers(1, b"\x88", false, MAX, dst));
    let mut frames: Vec<Vec<u8>> = encoded.into_iter().map(|b| b.to_vec()).collect();
    frames.push(raw(0x0, 0x8, 1, b"\x01x\0"));
    frames.push(raw(0x2, 0, 1, b"\0\0\0\0\x10"));
    frames.push(raw(0x5, 0x4, 1, b"\0\0\0\x02\x82"));
    frames.push(raw(0x9, 0x4, 1, b"\x82"));
    frames.push(raw(0xee, 0, 0, b"?"));
    frames
}

/// Every prefix of a whole frame is `Ok(None)` with nothing taken, however far it has come.
#[test]
fn every_prefix_of_a_frame_waits_and_takes_nothing() {
    for frame in one_of_each() {
        for cut in 0..frame.len() {
            let mut buf = BytesMut::from(&frame[..cut]);
            let outcome = Frame::parse(&mut buf, MAX);
            assert!(matches!(outcome, Ok(None)), "{frame:?} cut at {cut}: {outcome:?}");
            assert_eq!(&buf[..], &frame[..cut], "cut at {cut}");
        }
        assert!(parse(&frame).is_ok(), "{frame:?}");
    }
}

/// Frames back to back in one buffer come out one per call, in order, and a partial one at
/// the end waits.
#[test]
fn several_frames_in_one_buffer_come_out_in_order() {
    let frames = one_of_each();
    let joined: Vec<u8> = frames.concat();
    let mut buf = BytesMut::from(&joined[..]);
    buf.extend_from_slice(&frames[3][..5]);
    for frame in &frames {
        let parsed = Frame::parse(&mut buf, MAX).unwrap().expect("a whole frame");
        assert_eq!(Ok(parsed), parse(frame));
    }
    assert!(Frame::parse(&mut buf, MAX).unwrap().is_none());
    assert_eq!(&buf[..], &frames[3][..5]);
}

/// A payload is a view of the read buffer, not a copy of it.
#[test]
fn a_payload_shares_the_read_buffer() {
    let mut buf = BytesMut::from(&raw(0x0, 0, 1, b"shared")[..]);
    let start = buf.as_ptr() as usize;
    let Some(Frame::Data { data, .. }) = Frame::parse(&mut buf, MAX).unwrap() else {
        panic!("DATA");
    };
    assert_eq!(data.as_ptr() as usize, start + HEADER_LEN);
}

// === error codes ===

#[test]
fn error_codes_print_their_names_and_unknown_ones_their_number() {
    assert_eq!(ErrorCode::NO_ERROR.to_string(), "NO_ERROR");
    assert_eq!(ErrorCode::FRAME_SIZE_ERROR.to_string(), "FRAME_SIZE_ERROR");
    assert_eq!(ErrorCode::HTTP_1_1_REQUIRED.to_string(), "HTTP_1_1_REQUIRED");
    assert_eq!(ErrorCode(0xe).to_string(), "0xe");
    assert_eq!(ErrorCode(u32::MAX).name(), None);
    let err = FrameError::connection(ErrorCode::PROTOCOL_ERROR, Violation::ZeroIncrement);
    assert_eq!(
        err.to_string(),
        "connection error PROTOCOL_ERROR: WINDOW_UPDATE increment of 0"
    );
    assert_eq!(err.code(), ErrorCode::PROTOCOL_ERROR);
    assert_eq!(err.violation(), Violation::ZeroIncrement);
}
