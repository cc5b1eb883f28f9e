//! What does the sidecar spend per request on the HTTP/1.1 wire format and header rewriting,
//! outside the sockets and the pool?
//!
//! Cases, each on a typical small request or response (a Go `net/http` client's GET through
//! `HTTP_PROXY`: absolute-form, `User-Agent`, `Accept-Encoding`, `Proxy-Connection`, an
//! `Authorization` token):
//! - `parse_head_absolute_form`: `wire::codec::parse_head` from the raw bytes;
//! - `to_upstream_absolute_form`: `proxy::headers::to_upstream` (origin-form target, hop-by-hop
//!   fields out, `Host` set) on the parsed request;
//! - `request_parse_and_rewrite`: both, what a request costs before it reaches the pool;
//! - `to_downstream_response`: `proxy::headers::to_downstream` on a 200 with hop-by-hop fields;
//! - `encode_head_response`: `wire::codec::encode_head` of that response into a buffer.
//!
//! Run: `cargo bench --bench rewrite` (numbers are reported, not asserted).

// criterion_group! defines an undocumented `pub fn` for the group.
#![allow(missing_docs)]

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use egress_sidecar::proxy::headers::{to_downstream, to_upstream};
use egress_sidecar::wire::codec::{encode_head, parse_head, RequestHead, ResponseFraming};
use http::{HeaderValue, Request, Response, StatusCode, Version};

const MAX_HEADER_BYTES: usize = 64 * 1024;

const REQUEST: &[u8] = b"GET http://api.internal:8080/v1/items?limit=10 HTTP/1.1\r\n\
Host: api.internal:8080\r\n\
User-Agent: Go-http-client/1.1\r\n\
Accept: application/json\r\n\
Accept-Encoding: gzip\r\n\
Authorization: Bearer 0123456789abcdef0123456789abcdef\r\n\
Proxy-Connection: keep-alive\r\n\
X-Request-Id: 7f3c2a1e-4b5d-4c6e-8f90-a1b2c3d4e5f6\r\n\
\r\n";

fn parsed() -> RequestHead {
    parse_head(&mut BytesMut::from(REQUEST), MAX_HEADER_BYTES)
        .expect("valid head")
        .expect("complete head")
}

fn request_of(head: RequestHead) -> Request<()> {
    let mut req = Request::new(());
    *req.method_mut() = head.method;
    *req.uri_mut() = head.uri;
    *req.version_mut() = head.version;
    *req.headers_mut() = head.headers;
    req
}

fn response() -> Response<()> {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .header("content-length", "42")
        .header("date", "Mon, 02 Nov 2026 10:00:00 GMT")
        .header("server", "nginx")
        .header("connection", "keep-alive")
        .header("keep-alive", "timeout=60")
        .header("cache-control", "no-store")
        .body(())
        .expect("response")
}

fn bench_rewrite(c: &mut Criterion) {
    let host = HeaderValue::from_static("api.internal:8080");

    c.bench_function("parse_head_absolute_form", |b| {
        b.iter_batched_ref(
            || BytesMut::from(REQUEST),
            |buf| parse_head(black_box(buf), MAX_HEADER_BYTES),
            BatchSize::SmallInput,
        );
    });
    c.bench_function("to_upstream_absolute_form", |b| {
        b.iter_batched_ref(
            || request_of(parsed()),
            |req| to_upstream(black_box(req), &host),
            BatchSize::SmallInput,
        );
    });
    c.bench_function("request_parse_and_rewrite", |b| {
        b.iter_batched_ref(
            || BytesMut::from(REQUEST),
            |buf| {
                let head = parse_head(black_box(buf), MAX_HEADER_BYTES)
                    .ok()
                    .flatten()
                    .expect("head");
                let mut req = request_of(head);
                to_upstream(&mut req, &host);
                req
            },
            BatchSize::SmallInput,
        );
    });
    c.bench_function("to_downstream_response", |b| {
        b.iter_batched_ref(
            response,
            |resp| to_downstream(black_box(resp)),
            BatchSize::SmallInput,
        );
    });
    let mut upstream_response = response();
    to_downstream(&mut upstream_response);
    let mut out = Vec::with_capacity(1024);
    c.bench_function("encode_head_response", |b| {
        b.iter(|| {
            out.clear();
            encode_head(
                upstream_response.status(),
                None,
                black_box(upstream_response.headers()),
                b"",
                ResponseFraming::Length,
                true,
                Version::HTTP_11,
                &mut out,
            );
            black_box(out.len())
        });
    });
}

criterion_group!(benches, bench_rewrite);
criterion_main!(benches);
