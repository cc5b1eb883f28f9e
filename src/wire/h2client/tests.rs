//! Tests of the client connection frame by frame: a peer scripted with our own frame encoder
//! and HPACK (and raw bytes where the encoder would not send it), our output read back with
//! the frame parser. The run against the `h2` crate's server is in `interop.rs`.

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method};

use super::*;
use crate::wire::frame::{flags, Frame, Kind, DEFAULT_MAX_FRAME_SIZE};
use crate::wire::HeadLines;

fn head<'a>(method: &'a Method, headers: &'a HeaderMap) -> RequestHead<'a> {
    RequestHead {
        method,
        scheme: "http",
        authority: "upstream.test",
        path: "/v1/chat?x=1",
        headers,
        lines: crate::wire::HeadLines::NONE,
    }
}

/// A connection past its preface, the peer's SETTINGS (`settings`) and its acknowledgement of
/// ours, with nothing left in `out` or the events.
fn connected_with(config: Config, settings: Settings) -> Connection {
    let mut conn = Connection::new(config);
    let mut peer = BytesMut::new();
    encode::settings(&settings, &mut peer);
    encode::settings_ack(&mut peer);
    conn.recv(&mut peer).unwrap();
    assert!(conn.is_settings_acked());
    conn.out().clear();
    while conn.next_event().is_some() {}
    conn
}

fn connected() -> Connection {
    connected_with(Config::default(), Settings::default())
}

/// A connection whose receive windows are `stream` and `connection` bytes.
fn with_windows(stream: u32, connection: u32) -> Connection {
    let config = Config {
        stream_window: stream,
        connection_window: connection,
        ..Config::default()
    };
    connected_with(config, Settings::default())
}

/// Every frame in `out`, which is emptied.
fn written(conn: &mut Connection) -> Vec<Frame> {
    let mut out = conn.out().split();
    if out.starts_with(PREFACE) {
        let _ = out.split_to(PREFACE.len());
    }
    let mut frames = Vec::new();
    while let Some(frame) = Frame::parse(&mut out, MAX_MAX_FRAME).unwrap() {
        frames.push(frame);
    }
    assert!(out.is_empty(), "a partial frame in out");
    frames
}

const MAX_MAX_FRAME: u32 = crate::wire::frame::MAX_MAX_FRAME_SIZE;

fn events(conn: &mut Connection) -> Vec<Event> {
    std::iter::from_fn(|| conn.next_event()).collect()
}

fn block(fields: &[(&str, &str)]) -> BytesMut {
    let mut block = BytesMut::new();
    for (name, value) in fields {
        hpack::Encoder.encode(name.as_bytes(), value.as_bytes(), false, &mut block);
    }
    block
}

/// The peer's HEADERS for `stream_id`.
fn peer_headers(stream_id: u32, fields: &[(&str, &str)], end_stream: bool) -> BytesMut {
    let mut buf = BytesMut::new();
    encode::headers(
        stream_id,
        &block(fields),
        end_stream,
        DEFAULT_MAX_FRAME_SIZE,
        &mut buf,
    );
    buf
}

fn peer_data(stream_id: u32, data: &[u8], end_stream: bool) -> BytesMut {
    let mut buf = BytesMut::new();
    encode::data(stream_id, data, end_stream, DEFAULT_MAX_FRAME_SIZE, &mut buf);
    buf
}

/// A frame built by hand.
fn raw(kind: u8, flags: u8, stream_id: u32, payload: &[u8]) -> BytesMut {
    let mut out = BytesMut::new();
    out.put_slice(&(payload.len() as u32).to_be_bytes()[1..]);
    out.put_u8(kind);
    out.put_u8(flags);
    out.put_u32(stream_id);
    out.put_slice(payload);
    out
}

fn get(conn: &mut Connection) -> u32 {
    conn.open(&head(&Method::GET, &HeaderMap::new()), true).unwrap()
}

fn lines(event: &Event) -> &[u8] {
    match event {
        Event::Head { fields, .. } | Event::Trailers { fields, .. } => fields.lines.lines(),
        other => panic!("not a head: {other:?}"),
    }
}

fn reset_of(event: &Event) -> (u32, ErrorCode, Cause) {
    match event {
        Event::Reset {
            stream_id,
            code,
            cause,
        } => (*stream_id, *code, *cause),
        other => panic!("not a reset: {other:?}"),
    }
}

#[test]
fn a_new_connection_sends_the_preface_settings_and_a_larger_connection_window() {
    let mut conn = Connection::new(Config::default());
    assert!(conn.out().starts_with(PREFACE));
    let frames = written(&mut conn);
    let settings = Settings {
        enable_push: Some(false),
        initial_window_size: Some(2 * 1024 * 1024),
        max_frame_size: Some(16_384),
        max_header_list_size: Some(16 * 1024),
        ..Settings::default()
    };
    assert_eq!(
        frames,
        [
            Frame::Settings { ack: false, settings },
            Frame::WindowUpdate {
                stream_id: 0,
                increment: 5 * 1024 * 1024 - 65_535
            },
        ]
    );
    assert!(!conn.is_settings_acked());
}

#[test]
fn a_get_goes_out_with_its_pseudo_headers_first_and_connection_fields_left_out() {
    let mut conn = connected();
    let mut headers = HeaderMap::new();
    headers.insert("host", HeaderValue::from_static("ignored.test"));
    headers.insert("connection", HeaderValue::from_static("keep-alive"));
    headers.insert("te", HeaderValue::from_static("gzip, trailers"));
    headers.insert("x-app", HeaderValue::from_static("billing"));
    let mut secret = HeaderValue::from_static("Bearer sk-1");
    secret.set_sensitive(true);
    headers.insert("authorization", secret);
    let id = conn.open(&head(&Method::GET, &headers), true).unwrap();
    assert_eq!(id, 1);
    let frames = written(&mut conn);
    let [Frame::Headers {
        stream_id: 1,
        fragment,
        end_stream: true,
        end_headers: true,
    }] = frames.as_slice()
    else {
        panic!("{frames:?}");
    };
    let mut fields = Vec::new();
    let mut never_indexed = Vec::new();
    hpack::Decoder::new(4096, 1 << 16)
        .decode(fragment, |f| {
            let name = String::from_utf8(f.name.to_vec()).unwrap();
            if f.never_indexed {
                never_indexed.push(name.clone());
            }
            fields.push((name, String::from_utf8(f.value.to_vec()).unwrap()));
            Ok::<_, std::convert::Infallible>(())
        })
        .unwrap();
    let expected = [
        (":method", "GET"),
        (":scheme", "http"),
        (":authority", "upstream.test"),
        (":path", "/v1/chat?x=1"),
        ("te", "trailers"),
        ("x-app", "billing"),
        ("authorization", "Bearer sk-1"),
    ];
    let fields: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
    assert_eq!(fields, expected);
    assert_eq!(never_indexed, ["authorization"]);
    assert_eq!(conn.open_streams(), 1);
    assert_eq!(get(&mut conn), 3, "client streams take rising odd ids");
}

/// Decodes a HEADERS frame's block as (name, value) text.
fn decoded(fragment: &[u8]) -> Vec<(String, String)> {
    let mut fields = Vec::new();
    hpack::Decoder::new(4096, 1 << 16)
        .decode(fragment, |f| {
            let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
            fields.push((text(f.name), text(f.value)));
            Ok::<_, std::convert::Infallible>(())
        })
        .unwrap();
    fields
}

/// Fields kept as lines go out after the pseudo-header fields and before the map's, names
/// lowercased (one longer than the encoder's stack room too), values trimmed; with no
/// authority of its own the request takes the lines' `Host`, the upstream's once set. The
/// block is the one the same lines moved into the map give.
#[test]
fn fields_kept_as_lines_go_out_lowercased_before_the_maps() {
    let long = format!("X-{}", "Long".repeat(20));
    let raw = format!("Host:  app.local \r\nUser-Agent:  curl/8 \r\n{long}: 1\r\nAccept: */*\r\n\r\n");
    let kept = || {
        let mut lines = HeadLines::default();
        lines.keep(Bytes::from(raw.clone()), 19);
        lines
    };
    let mut headers = HeaderMap::new();
    headers.insert("content-length", HeaderValue::from_static("0"));
    let mut conn = connected();
    let mut open = |authority, lines: &HeadLines, headers: &HeaderMap| {
        let head = RequestHead {
            authority,
            lines,
            ..head(&Method::GET, headers)
        };
        conn.open(&head, true).unwrap();
        let frames = written(&mut conn);
        let [Frame::Headers { fragment, .. }] = frames.as_slice() else {
            panic!("{frames:?}");
        };
        decoded(fragment)
    };
    let mut mapped = headers.clone();
    kept().into_map(&mut mapped);
    assert_eq!(
        open("", &kept(), &headers),
        open("", HeadLines::NONE, &mapped),
        "the lines encode as their map does"
    );
    let mut lines = kept();
    for (authority, host) in [("upstream.test", None), ("", None), ("", Some("api.example"))] {
        if let Some(host) = host {
            assert!(lines.set_upstream_host(&HeaderValue::from_static(host)));
        }
        let fields = open(authority, &lines, &headers);
        let authority = match (authority, host) {
            ("", None) => "app.local",
            ("", Some(host)) => host,
            (authority, _) => authority,
        };
        let fields: Vec<(&str, &str)> = fields.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(
            fields,
            [
                (":method", "GET"),
                (":scheme", "http"),
                (":authority", authority),
                (":path", "/v1/chat?x=1"),
                ("user-agent", "curl/8"),
                (long.to_ascii_lowercase().as_str(), "1"),
                ("accept", "*/*"),
                ("content-length", "0"),
            ]
        );
    }
}

#[test]
fn a_response_comes_out_as_a_head_of_lines_and_its_data() {
    let mut conn = connected();
    let id = get(&mut conn);
    let mut peer = peer_headers(
        id,
        &[
            (":status", "200"),
            ("content-type", "application/json"),
            ("content-length", "5"),
            ("x-ratelimit-remaining-requests", "9"),
        ],
        false,
    );
    peer.extend_from_slice(&peer_data(id, b"hello", true));
    conn.recv(&mut peer).unwrap();
    assert!(peer.is_empty());
    let events = events(&mut conn);
    assert_eq!(events.len(), 2, "{events:?}");
    let Event::Head {
        stream_id,
        fields,
        end_stream: false,
    } = &events[0]
    else {
        panic!("{events:?}");
    };
    assert_eq!(
        (*stream_id, fields.status, fields.content_length),
        (1, 200, Some(5))
    );
    assert_eq!(
        fields.lines.lines(),
        b"content-type: application/json\r\ncontent-length: 5\r\nx-ratelimit-remaining-requests: 9\r\n"
    );
    assert!(fields.lines.has_content_length());
    assert!(fields.lines.has_limit_fields());
    assert!(fields.lines.body_type().framing.is_some());
    assert_eq!(
        events[1],
        Event::Data {
            stream_id: 1,
            data: Bytes::from_static(b"hello"),
            end_stream: true
        }
    );
    assert_eq!(conn.open_streams(), 0, "both sides ended: the stream is gone");
}

#[test]
fn frames_arriving_a_byte_at_a_time_give_the_same_events() {
    let mut conn = connected();
    let id = get(&mut conn);
    let mut whole = peer_headers(id, &[(":status", "200")], false);
    whole.extend_from_slice(&peer_data(id, b"abc", true));
    let mut buf = BytesMut::new();
    let mut seen = Vec::new();
    for byte in whole.iter() {
        buf.put_u8(*byte);
        conn.recv(&mut buf).unwrap();
        seen.extend(events(&mut conn));
    }
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(matches!(seen[1], Event::Data { end_stream: true, .. }));
}

#[test]
fn the_peers_settings_are_acknowledged_and_bound_how_many_streams_open() {
    let mut conn = Connection::new(Config::default());
    written(&mut conn);
    let mut peer = BytesMut::new();
    let settings = Settings {
        max_concurrent_streams: Some(1),
        ..Settings::default()
    };
    encode::settings(&settings, &mut peer);
    conn.recv(&mut peer).unwrap();
    assert_eq!(events(&mut conn), [Event::Settings]);
    assert_eq!(
        written(&mut conn),
        [Frame::Settings {
            ack: true,
            settings: Settings::default()
        }]
    );
    assert_eq!(conn.max_concurrent_streams(), 1);
    get(&mut conn);
    assert!(!conn.can_open());
    let err = conn
        .open(&head(&Method::GET, &HeaderMap::new()), true)
        .unwrap_err();
    assert_eq!(err, OpenError::AtLimit);
    assert!(!conn.is_settings_acked());
}

#[test]
fn data_goes_out_as_far_as_both_windows_allow_and_on_after_a_window_update() {
    let settings = Settings {
        initial_window_size: Some(10),
        max_frame_size: Some(16_384),
        ..Settings::default()
    };
    let mut conn = connected_with(Config::default(), settings);
    let id = conn.open(&head(&Method::POST, &HeaderMap::new()), false).unwrap();
    written(&mut conn);
    let mut body = Bytes::from(vec![b'x'; 25]);
    assert_eq!(conn.send_capacity(id), 10);
    assert!(!conn.send_data(id, &mut body, true).unwrap());
    assert_eq!(body.len(), 15);
    let frames = written(&mut conn);
    assert!(
        matches!(&frames[..], [Frame::Data { data, end_stream: false, .. }] if data.len() == 10),
        "{frames:?}"
    );
    assert!(!conn.send_data(id, &mut body, true).unwrap(), "nothing more fits");
    assert!(
        written(&mut conn).is_empty(),
        "no empty DATA frame while the window is shut"
    );

    let mut peer = BytesMut::new();
    encode::window_update(id, 100, &mut peer);
    conn.recv(&mut peer).unwrap();
    assert_eq!(events(&mut conn), [Event::Capacity { stream_id: id }]);
    assert!(conn.send_data(id, &mut body, true).unwrap());
    let frames = written(&mut conn);
    assert!(
        matches!(&frames[..], [Frame::Data { data, end_stream: true, .. }] if data.len() == 15),
        "{frames:?}"
    );
    assert_eq!(conn.send_data(id, &mut Bytes::new(), true), Err(NotOpen(id)));
}

#[test]
fn the_connection_window_bounds_every_stream_together() {
    let settings = Settings {
        initial_window_size: Some(1 << 20),
        ..Settings::default()
    };
    let mut conn = connected_with(Config::default(), settings);
    let a = conn.open(&head(&Method::POST, &HeaderMap::new()), false).unwrap();
    let b = conn.open(&head(&Method::POST, &HeaderMap::new()), false).unwrap();
    let mut first = Bytes::from(vec![0u8; 60_000]);
    let mut second = Bytes::from(vec![0u8; 60_000]);
    assert!(conn.send_data(a, &mut first, false).unwrap());
    assert!(!conn.send_data(b, &mut second, false).unwrap());
    assert_eq!(second.len(), 60_000 - 5_535, "65,535 in all on the connection");
    assert_eq!(conn.send_capacity(b), 0);
    let mut peer = BytesMut::new();
    encode::window_update(0, 1_000, &mut peer);
    conn.recv(&mut peer).unwrap();
    assert_eq!(events(&mut conn), [Event::Capacity { stream_id: 0 }]);
    assert_eq!(conn.send_capacity(b), 1_000);
}

#[test]
fn a_smaller_initial_window_can_take_a_streams_window_below_zero() {
    let mut conn = connected();
    let id = conn.open(&head(&Method::POST, &HeaderMap::new()), false).unwrap();
    let mut body = Bytes::from(vec![0u8; 60_000]);
    assert!(conn.send_data(id, &mut body, false).unwrap());
    let mut peer = BytesMut::new();
    let settings = Settings {
        initial_window_size: Some(1_000),
        ..Settings::default()
    };
    encode::settings(&settings, &mut peer);
    encode::window_update(id, 59_000, &mut peer);
    conn.recv(&mut peer).unwrap();
    // 65,535 - 60,000 - 64,535 + 59,000 = 0: still nothing may go.
    assert_eq!(conn.send_capacity(id), 0);
}

#[test]
fn received_data_is_credited_back_only_as_the_caller_releases_it() {
    let mut conn = with_windows(100, 65_535);
    let id = get(&mut conn);
    written(&mut conn);
    let mut peer = peer_headers(id, &[(":status", "200")], false);
    peer.extend_from_slice(&peer_data(id, &[7; 60], false));
    conn.recv(&mut peer).unwrap();
    events(&mut conn);
    assert!(
        written(&mut conn).is_empty(),
        "nothing credited before the caller consumed it"
    );
    conn.release(id, 60);
    assert_eq!(
        written(&mut conn),
        [Frame::WindowUpdate {
            stream_id: id,
            increment: 60
        }]
    );
    // 100 more fit the stream's window again; 101 do not.
    let mut peer = peer_data(id, &[7; 101], false);
    conn.recv(&mut peer).unwrap();
    let (stream_id, code, cause) = reset_of(&events(&mut conn)[0]);
    assert_eq!((stream_id, code), (id, ErrorCode::FLOW_CONTROL_ERROR));
    assert_eq!(cause, Cause::Fault(StreamFault::WindowExceeded));
    assert!(matches!(
        written(&mut conn)[..],
        [Frame::RstStream {
            stream_id: 1,
            error_code: ErrorCode::FLOW_CONTROL_ERROR
        }]
    ));
    assert_eq!(conn.open_streams(), 0);
}

#[test]
fn data_past_the_connection_window_ends_the_connection() {
    let mut conn = with_windows(1 << 20, 65_535);
    let id = get(&mut conn);
    let mut peer = peer_headers(id, &[(":status", "200")], false);
    for _ in 0..4 {
        peer.extend_from_slice(&peer_data(id, &[0; 16_384], false));
    }
    let err = conn.recv(&mut peer).unwrap_err();
    assert_eq!(err.code, ErrorCode::FLOW_CONTROL_ERROR);
    assert_eq!(err.reason, Reason::WindowExceeded);
    let frames = written(&mut conn);
    assert!(
        matches!(
            frames.last(),
            Some(Frame::GoAway {
                error_code: ErrorCode::FLOW_CONTROL_ERROR,
                ..
            })
        ),
        "{frames:?}"
    );
    let events = events(&mut conn);
    assert_eq!(reset_of(events.last().unwrap()).2, Cause::Connection);
    assert_eq!(
        conn.recv(&mut BytesMut::new()),
        Err(err),
        "a failed connection stays failed"
    );
    assert!(matches!(
        conn.open(&head(&Method::GET, &HeaderMap::new()), true),
        Err(OpenError::Failed(_))
    ));
}

#[test]
fn padding_is_credited_back_at_once() {
    let mut conn = with_windows(100, 65_535);
    let id = get(&mut conn);
    written(&mut conn);
    let mut peer = peer_headers(id, &[(":status", "200")], false);
    // 1 pad length byte, 4 data bytes, 50 bytes of padding: 55 count, 51 are padding.
    let mut payload = vec![50u8];
    payload.extend_from_slice(b"data");
    payload.extend_from_slice(&[0; 50]);
    peer.extend_from_slice(&raw(Kind::Data as u8, flags::PADDED, id, &payload));
    conn.recv(&mut peer).unwrap();
    assert!(matches!(&events(&mut conn)[1], Event::Data { data, .. } if data == "data"));
    assert_eq!(
        written(&mut conn),
        [Frame::WindowUpdate {
            stream_id: id,
            increment: 51
        }]
    );
}

#[test]
fn informational_heads_are_dropped_before_the_final_one() {
    let mut conn = connected();
    let id = get(&mut conn);
    let mut peer = peer_headers(
        id,
        &[(":status", "103"), ("link", "</a.css>; rel=preload")],
        false,
    );
    peer.extend_from_slice(&peer_headers(id, &[(":status", "204")], true));
    conn.recv(&mut peer).unwrap();
    let events = events(&mut conn);
    assert!(
        matches!(&events[..], [Event::Head { fields, end_stream: true, .. }] if fields.status == 204),
        "{events:?}"
    );
}

/// A literal with incremental indexing (§6.2.1), new name: what our encoder never sends but
/// servers do.
fn indexed_literal(name: &str, value: &str) -> Vec<u8> {
    let mut out = vec![0x40, name.len() as u8];
    out.extend_from_slice(name.as_bytes());
    out.push(value.len() as u8);
    out.extend_from_slice(value.as_bytes());
    out
}

#[test]
fn a_malformed_head_resets_its_stream_and_keeps_hpack_in_step_for_the_next() {
    let mut conn = connected();
    let first = get(&mut conn);
    let second = get(&mut conn);
    written(&mut conn);
    // `X-Upper` is malformed (§8.2.1), but the block inserts `x-server: a` into the table.
    let mut bad = block(&[(":status", "200")]);
    bad.extend_from_slice(&indexed_literal("x-server", "a"));
    bad.extend_from_slice(&indexed_literal("X-Upper", "b"));
    let mut peer = BytesMut::new();
    encode::headers(first, &bad, true, DEFAULT_MAX_FRAME_SIZE, &mut peer);
    // The second response names the table's entries by index: 63 is `x-server: a` now (62 is
    // `X-Upper: b`, the newest).
    let mut good = block(&[(":status", "200")]);
    good.put_u8(0x80 | 63);
    encode::headers(second, &good, true, DEFAULT_MAX_FRAME_SIZE, &mut peer);
    conn.recv(&mut peer).unwrap();
    let events = events(&mut conn);
    assert_eq!(
        reset_of(&events[0]),
        (
            first,
            ErrorCode::PROTOCOL_ERROR,
            Cause::Fault(StreamFault::Malformed(Malformed::Name))
        )
    );
    assert_eq!(lines(&events[1]), b"x-server: a\r\n");
    assert!(matches!(
        written(&mut conn)[..],
        [Frame::RstStream {
            stream_id: 1,
            error_code: ErrorCode::PROTOCOL_ERROR
        }]
    ));
}

#[test]
fn responses_that_break_the_rules_of_section_8_reset_only_their_stream() {
    let cases: &[(&[(&str, &str)], Malformed)] = &[
        (&[("content-type", "text/plain")], Malformed::Status),
        (&[(":status", "2000")], Malformed::Status),
        (&[(":status", "200"), (":path", "/")], Malformed::Pseudo),
        (&[("x-a", "1"), (":status", "200")], Malformed::Pseudo),
        (
            &[(":status", "200"), ("connection", "close")],
            Malformed::ConnectionSpecific,
        ),
        (
            &[(":status", "200"), ("transfer-encoding", "chunked")],
            Malformed::ConnectionSpecific,
        ),
        (&[(":status", "200"), ("x-a", "one\r\ntwo")], Malformed::Value),
        (
            &[
                (":status", "200"),
                ("content-length", "5"),
                ("content-length", "6"),
            ],
            Malformed::ContentLength,
        ),
        (
            &[(":status", "200"), ("content-length", "5")],
            Malformed::BodyLength,
        ),
        (&[(":status", "101")], Malformed::Informational),
    ];
    for (fields, why) in cases {
        let mut conn = connected();
        let id = get(&mut conn);
        let mut peer = peer_headers(id, fields, true);
        conn.recv(&mut peer).unwrap();
        let events = events(&mut conn);
        assert_eq!(
            reset_of(&events[0]),
            (
                id,
                ErrorCode::PROTOCOL_ERROR,
                Cause::Fault(StreamFault::Malformed(*why))
            ),
            "{fields:?}"
        );
        assert!(conn.can_open(), "{fields:?}: the connection goes on");
    }
}

#[test]
fn a_body_must_match_its_content_length_except_after_head() {
    let mut conn = connected();
    let id = get(&mut conn);
    let mut peer = peer_headers(id, &[(":status", "200"), ("content-length", "3")], false);
    peer.extend_from_slice(&peer_data(id, b"abcd", true));
    conn.recv(&mut peer).unwrap();
    let events = events(&mut conn);
    assert_eq!(
        reset_of(&events[1]).2,
        Cause::Fault(StreamFault::Malformed(Malformed::BodyLength))
    );

    let id = conn.open(&head(&Method::HEAD, &HeaderMap::new()), true).unwrap();
    let mut peer = peer_headers(id, &[(":status", "200"), ("content-length", "300")], true);
    conn.recv(&mut peer).unwrap();
    assert!(matches!(
        conn.next_event(),
        Some(Event::Head { end_stream: true, .. })
    ));
}

#[test]
fn trailers_end_the_response_and_must_end_the_stream() {
    let mut conn = connected();
    let id = get(&mut conn);
    let mut peer = peer_headers(
        id,
        &[(":status", "200"), ("content-type", "application/grpc")],
        false,
    );
    peer.extend_from_slice(&peer_data(id, b"\0\0\0\0\0", false));
    peer.extend_from_slice(&peer_headers(id, &[("grpc-status", "0")], true));
    conn.recv(&mut peer).unwrap();
    let events = events(&mut conn);
    assert_eq!(events.len(), 3);
    assert_eq!(lines(&events[2]), b"grpc-status: 0\r\n");
    assert_eq!(conn.open_streams(), 0);

    let id = get(&mut conn);
    let mut peer = peer_headers(id, &[(":status", "200")], false);
    peer.extend_from_slice(&peer_headers(id, &[("grpc-status", "0")], false));
    conn.recv(&mut peer).unwrap();
    let events = std::iter::from_fn(|| conn.next_event()).collect::<Vec<_>>();
    assert_eq!(
        reset_of(&events[1]).2,
        Cause::Fault(StreamFault::Malformed(Malformed::TrailersWithoutEnd))
    );
}

#[test]
fn a_header_block_spans_continuations_and_nothing_may_come_between() {
    let mut conn = connected();
    let id = get(&mut conn);
    let whole = block(&[(":status", "200"), ("x-long", &"v".repeat(40))]);
    let (a, b) = whole.split_at(10);
    let mut peer = raw(Kind::Headers as u8, flags::END_STREAM, id, a);
    peer.extend_from_slice(&raw(Kind::Continuation as u8, flags::END_HEADERS, id, b));
    conn.recv(&mut peer).unwrap();
    assert!(matches!(
        conn.next_event(),
        Some(Event::Head { end_stream: true, .. })
    ));

    let id = get(&mut conn);
    let mut peer = raw(Kind::Headers as u8, 0, id, a);
    peer.extend_from_slice(&raw(Kind::Ping as u8, 0, 0, &[0; 8]));
    let err = conn.recv(&mut peer).unwrap_err();
    assert_eq!(err.reason, Reason::ContinuationExpected);

    let mut conn = connected();
    let mut peer = raw(Kind::Continuation as u8, flags::END_HEADERS, 1, b);
    get(&mut conn);
    assert_eq!(
        conn.recv(&mut peer).unwrap_err().reason,
        Reason::StrayContinuation
    );
}

#[test]
fn a_header_block_past_the_list_size_is_refused_before_it_is_whole() {
    let config = Config {
        max_header_list_size: 100,
        ..Config::default()
    };
    let mut conn = connected_with(config, Settings::default());
    let id = get(&mut conn);
    let mut peer = raw(Kind::Headers as u8, 0, id, &[0; 16_000]);
    peer.extend_from_slice(&raw(Kind::Continuation as u8, 0, id, &[0; 1_000]));
    let err = conn.recv(&mut peer).unwrap_err();
    assert_eq!(
        (err.code, err.reason),
        (ErrorCode::ENHANCE_YOUR_CALM, Reason::BlockTooLarge)
    );
}

#[test]
fn a_goaway_fails_the_streams_it_never_processed_as_retryable() {
    let mut conn = connected();
    let (a, b) = (get(&mut conn), get(&mut conn));
    let mut peer = BytesMut::new();
    encode::goaway(a, ErrorCode::NO_ERROR, b"bye", &mut peer);
    conn.recv(&mut peer).unwrap();
    let events = events(&mut conn);
    assert_eq!(reset_of(&events[0]), (b, ErrorCode::NO_ERROR, Cause::Unprocessed));
    assert_eq!(
        events[1],
        Event::GoAway {
            last_stream_id: a,
            code: ErrorCode::NO_ERROR,
            debug_data: Bytes::from_static(b"bye")
        }
    );
    assert_eq!(conn.open_streams(), 1, "stream 1 goes on");
    assert_eq!(
        conn.open(&head(&Method::GET, &HeaderMap::new()), true),
        Err(OpenError::GoingAway)
    );
    let mut peer = peer_headers(a, &[(":status", "200")], true);
    conn.recv(&mut peer).unwrap();
    assert!(matches!(conn.next_event(), Some(Event::Head { .. })));
}

#[test]
fn frames_on_streams_we_never_opened_end_the_connection() {
    for peer in [
        peer_data(2, b"x", false),
        peer_headers(5, &[(":status", "200")], true),
        raw(Kind::RstStream as u8, 0, 7, &[0, 0, 0, 8]),
    ] {
        let mut conn = connected();
        get(&mut conn);
        let id = peer
            .get(5..9)
            .map(|b| u32::from_be_bytes(b.try_into().unwrap()))
            .unwrap();
        let err = conn.recv(&mut peer.clone()).unwrap_err();
        assert_eq!(
            (err.code, err.reason),
            (ErrorCode::PROTOCOL_ERROR, Reason::IdleStream(id))
        );
    }
}

#[test]
fn pushes_are_refused_since_we_disable_them() {
    let mut conn = connected();
    get(&mut conn);
    let mut payload = vec![0, 0, 0, 2];
    payload.extend_from_slice(&block(&[(":method", "GET")]));
    let mut peer = raw(Kind::PushPromise as u8, flags::END_HEADERS, 1, &payload);
    assert_eq!(conn.recv(&mut peer).unwrap_err().reason, Reason::Push);

    let mut conn = connected();
    let mut peer = BytesMut::new();
    let settings = Settings {
        enable_push: Some(true),
        ..Settings::default()
    };
    encode::settings(&settings, &mut peer);
    assert_eq!(conn.recv(&mut peer).unwrap_err().reason, Reason::Push);
}

#[test]
fn pings_are_answered_and_answers_to_ours_come_back() {
    let mut conn = connected();
    let mut peer = BytesMut::new();
    encode::ping(*b"theirs!!", &mut peer);
    encode::ping_ack(*b"ours....", &mut peer);
    conn.ping(*b"ours....");
    written(&mut conn);
    conn.recv(&mut peer).unwrap();
    assert_eq!(
        written(&mut conn),
        [Frame::Ping {
            ack: true,
            payload: *b"theirs!!"
        }]
    );
    assert_eq!(
        events(&mut conn),
        [Event::Pong {
            payload: *b"ours...."
        }]
    );
}

#[test]
fn after_a_reset_late_frames_are_dropped_and_their_data_credited_to_the_connection() {
    let mut conn = with_windows(Config::default().stream_window, 65_535);
    let ours = get(&mut conn);
    let theirs = get(&mut conn);
    conn.reset(ours, ErrorCode::CANCEL);
    let mut peer = BytesMut::new();
    encode::rst_stream(theirs, ErrorCode::INTERNAL_ERROR, &mut peer);
    conn.recv(&mut peer).unwrap();
    assert_eq!(
        reset_of(&events(&mut conn)[0]),
        (theirs, ErrorCode::INTERNAL_ERROR, Cause::Peer)
    );
    written(&mut conn);
    // Late frames on both, more than half the connection's window of data.
    let mut peer = peer_headers(ours, &[(":status", "200")], false);
    peer.extend_from_slice(&peer_data(ours, &[0; 16_384], false));
    peer.extend_from_slice(&peer_data(theirs, &[0; 16_384], false));
    peer.extend_from_slice(&raw(Kind::WindowUpdate as u8, 0, ours, &[0, 0, 0, 1]));
    conn.recv(&mut peer).unwrap();
    assert!(events(&mut conn).is_empty());
    assert_eq!(
        written(&mut conn),
        [Frame::WindowUpdate {
            stream_id: 0,
            increment: 32_768
        }]
    );
    conn.reset(ours, ErrorCode::CANCEL);
    assert!(
        written(&mut conn).is_empty(),
        "a closed stream is not reset twice"
    );
}

#[test]
fn window_updates_past_the_largest_window_are_errors_of_their_scope() {
    let mut conn = connected();
    let id = get(&mut conn);
    let mut peer = BytesMut::new();
    encode::window_update(id, MAX_WINDOW_SIZE, &mut peer);
    conn.recv(&mut peer).unwrap();
    assert_eq!(
        reset_of(&events(&mut conn)[0]).2,
        Cause::Fault(StreamFault::WindowOverflow)
    );

    let mut peer = BytesMut::new();
    encode::window_update(0, MAX_WINDOW_SIZE, &mut peer);
    let err = conn.recv(&mut peer).unwrap_err();
    assert_eq!(
        (err.code, err.reason),
        (ErrorCode::FLOW_CONTROL_ERROR, Reason::WindowOverflow)
    );
}

#[test]
fn a_request_body_ends_with_trailers_and_then_takes_no_more() {
    let mut conn = connected();
    let id = conn.open(&head(&Method::POST, &HeaderMap::new()), false).unwrap();
    assert!(conn
        .send_data(id, &mut Bytes::from_static(b"abc"), false)
        .unwrap());
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("1"));
    conn.send_trailers(id, &trailers).unwrap();
    let frames = written(&mut conn);
    assert!(
        matches!(
            &frames[..],
            [
                Frame::Headers {
                    end_stream: false,
                    ..
                },
                Frame::Data {
                    end_stream: false,
                    ..
                },
                Frame::Headers { end_stream: true, .. }
            ]
        ),
        "{frames:?}"
    );
    assert_eq!(conn.send_trailers(id, &trailers), Err(NotOpen(id)));
    conn.go_away(ErrorCode::NO_ERROR);
    assert!(!conn.can_open());
    assert!(matches!(
        written(&mut conn)[..],
        [Frame::GoAway {
            last_stream_id: 0,
            ..
        }]
    ));
}
