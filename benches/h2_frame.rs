//! What does reading an HTTP/2 response's frames cost with our own frame codec, before HPACK?
//!
//! One case: `h2_frame_parse_headers_and_data`, `wire::frame::Frame::parse` taking a typical
//! small response off a read buffer: its HEADERS frame (`:status`, `content-type`,
//! `content-length`, `date`, `server`, Huffman-coded as nginx codes them) and one DATA frame with
//! END_STREAM. The buffer is filled outside the timed part.
//!
//! A second: `h2client_exchange`, one whole exchange through `wire::h2client::Connection`, the
//! client connection without I/O: a GET's HEADERS encoded (four fields besides the pseudo-header
//! fields), the response above taken in (frames parsed, HPACK decoded into HTTP/1.1 lines, the
//! checks of RFC 9113 §8), its two events taken, the body released, the output cleared. What
//! the HTTP/2 protocol costs a request, without the task, the socket or the pool.
//!
//! Run: `cargo bench --bench h2_frame` (numbers are reported, not asserted). For an instruction
//! count instead of a time, `FRAME_PAIRS=N` skips criterion and parses N such responses from one
//! buffer in `parse_all`, which callgrind can count alone:
//! `FRAME_PAIRS=10000 valgrind --tool=callgrind --toggle-collect='*parse_all*' <bench binary>`,
//! then the collected Ir over N; `EXCHANGES=N` and `--toggle-collect='*exchange_all*'` the same
//! for the exchange.

// criterion_group! defines an undocumented `pub fn` for the group.
#![allow(missing_docs)]

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{criterion_group, BatchSize, Criterion};
use egress_sidecar::wire::frame::{encode, Frame, Settings, DEFAULT_MAX_FRAME_SIZE};
use egress_sidecar::wire::h2client::{Config, Connection, Event, RequestHead};
use http::{HeaderMap, HeaderValue, Method};

const BODY: &[u8] = b"{\"id\":42,\"items\":[1,2,3],\"next\":null}\n";

/// A response's HEADERS and DATA frames on stream 1, as an upstream would send them.
fn response_frames() -> BytesMut {
    response_frames_on(1)
}

/// The header block of [`response_frames`]: `:status: 200`, `content-type: application/json`,
/// `content-length: 38`, `date: Mon, 02 Nov 2026 10:00:00 GMT`, `server: nginx`, as a server
/// that keeps no dynamic table codes them (nginx does): the status by its static index, each
/// other field's name by its static index and its value Huffman-coded.
const RESPONSE_BLOCK: &str = "880f108b1d75d0620d263d4c7441ea0f0d8265ef0f1296d07abe940094d27eea08027140\
                              82e001700053168dff0f2784aa6355e7";

fn response_block() -> Vec<u8> {
    let hex = RESPONSE_BLOCK.as_bytes();
    hex.chunks(2)
        .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).expect("ascii"), 16).expect("hex"))
        .collect()
}

/// The same on `stream_id`.
fn response_frames_on(stream_id: u32) -> BytesMut {
    let block = response_block();
    let mut frames = BytesMut::new();
    encode::headers(stream_id, &block, false, DEFAULT_MAX_FRAME_SIZE, &mut frames);
    encode::data(stream_id, BODY, true, DEFAULT_MAX_FRAME_SIZE, &mut frames);
    frames
}

/// A connection past the server's SETTINGS and its acknowledgement of ours.
fn connection() -> Connection {
    let mut conn = Connection::new(Config::default());
    let mut peer = BytesMut::new();
    encode::settings(&Settings::default(), &mut peer);
    encode::settings_ack(&mut peer);
    conn.recv(&mut peer).expect("the server's SETTINGS");
    conn.out().clear();
    while conn.next_event().is_some() {}
    conn
}

fn request_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("user-agent", HeaderValue::from_static("python-httpx/0.27.0"));
    headers.insert("accept", HeaderValue::from_static("application/json"));
    headers.insert(
        "x-request-id",
        HeaderValue::from_static("5f0c2d6e-8a4b-4f3e-9a57-1c2b3d4e5f60"),
    );
    headers.insert("accept-encoding", HeaderValue::from_static("gzip, deflate"));
    headers
}

/// One exchange per buffer of `responses` (the n-th on stream 2n + 1, the ids the connection
/// gives): open, take the response in, take its events, release its body, clear the output.
#[inline(never)]
fn exchange_all(conn: &mut Connection, headers: &HeaderMap, responses: &mut [BytesMut]) -> usize {
    let mut bytes = 0;
    for response in responses {
        let head = RequestHead {
            method: &Method::GET,
            scheme: "https",
            authority: "api.example.com",
            path: "/v1/items?page=2",
            headers,
            lines: egress_sidecar::wire::HeadLines::NONE,
        };
        let id = conn.open(&head, true).expect("a stream opens");
        conn.recv(response).expect("a valid response");
        while let Some(event) = conn.next_event() {
            if let Event::Data { data, .. } = &event {
                bytes += data.len();
                conn.release(id, data.len());
            }
            black_box(&event);
        }
        conn.out().clear();
    }
    bytes
}

fn responses(from: usize, count: usize) -> Vec<BytesMut> {
    (from..from + count)
        .map(|n| response_frames_on(2 * n as u32 + 1))
        .collect()
}

/// Parses every frame in `buf`, dropping each as a connection would once it has acted on it.
#[inline(never)]
fn parse_all(buf: &mut BytesMut) -> usize {
    let mut parsed = 0;
    while let Ok(Some(frame)) = Frame::parse(buf, DEFAULT_MAX_FRAME_SIZE) {
        black_box(&frame);
        parsed += 1;
    }
    parsed
}

fn bench_frame(c: &mut Criterion) {
    let frames = response_frames();
    c.bench_function("h2_frame_parse_headers_and_data", |b| {
        b.iter_batched(
            || frames.clone(),
            |mut buf| parse_all(black_box(&mut buf)),
            BatchSize::SmallInput,
        );
    });
}

fn bench_exchange(c: &mut Criterion) {
    let headers = request_headers();
    let mut conn = connection();
    // Stream ids rise with every exchange, so the setup builds the next one's response.
    let done = std::cell::Cell::new(0);
    c.bench_function("h2client_exchange", |b| {
        b.iter_batched(
            || responses(done.get(), 1),
            |mut one| {
                done.set(done.get() + 1);
                exchange_all(&mut conn, &headers, black_box(&mut one))
            },
            BatchSize::SmallInput,
        );
    });
}

criterion_group!(benches, bench_frame, bench_exchange);

fn main() {
    if let Some(pairs) = std::env::var("FRAME_PAIRS").ok().and_then(|n| n.parse().ok()) {
        let one = response_frames();
        let mut buf = BytesMut::with_capacity(one.len() * pairs);
        for _ in 0..pairs {
            buf.extend_from_slice(&one);
        }
        let parsed = parse_all(&mut buf);
        assert_eq!(parsed, 2 * pairs, "every frame parsed");
        println!("{pairs} responses parsed, {} bytes each", one.len());
        return;
    }
    if let Some(count) = std::env::var("EXCHANGES").ok().and_then(|n| n.parse().ok()) {
        let mut all = responses(0, count);
        let bytes = exchange_all(&mut connection(), &request_headers(), &mut all);
        assert_eq!(bytes, count * BODY.len(), "every body came through");
        println!("{count} exchanges");
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
