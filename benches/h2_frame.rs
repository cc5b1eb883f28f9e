//! What does reading an HTTP/2 response's frames cost with our own frame codec, before HPACK?
//!
//! One case: `h2_frame_parse_headers_and_data`, `wire::frame::Frame::parse` taking a typical
//! small response off a read buffer: its HEADERS frame (`:status`, `content-type`,
//! `content-length`, `date`, `server`, as our HPACK encoder codes them) and one DATA frame with
//! END_STREAM. The buffer is filled outside the timed part.
//!
//! Run: `cargo bench --bench h2_frame` (numbers are reported, not asserted). For an instruction
//! count instead of a time, `FRAME_PAIRS=N` skips criterion and parses N such responses from one
//! buffer in `parse_all`, which callgrind can count alone:
//! `FRAME_PAIRS=10000 valgrind --tool=callgrind --toggle-collect='*parse_all*' <bench binary>`,
//! then the collected Ir over N.

// criterion_group! defines an undocumented `pub fn` for the group.
#![allow(missing_docs)]

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{criterion_group, BatchSize, Criterion};
use egress_sidecar::wire::frame::{encode, Frame, DEFAULT_MAX_FRAME_SIZE};
use egress_sidecar::wire::hpack::Encoder;

const BODY: &[u8] = b"{\"id\":42,\"items\":[1,2,3],\"next\":null}\n";

/// A response's HEADERS and DATA frames on stream 1, as an upstream would send them.
fn response_frames() -> BytesMut {
    let mut block = BytesMut::new();
    for (name, value) in [
        (":status", "200"),
        ("content-type", "application/json"),
        ("content-length", "39"),
        ("date", "Mon, 02 Nov 2026 10:00:00 GMT"),
        ("server", "nginx"),
    ] {
        Encoder.encode(name.as_bytes(), value.as_bytes(), false, &mut block);
    }
    let mut frames = BytesMut::new();
    encode::headers(1, &block, false, DEFAULT_MAX_FRAME_SIZE, &mut frames);
    encode::data(1, BODY, true, DEFAULT_MAX_FRAME_SIZE, &mut frames);
    frames
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

criterion_group!(benches, bench_frame);

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
    benches();
    Criterion::default().configure_from_args().final_summary();
}
