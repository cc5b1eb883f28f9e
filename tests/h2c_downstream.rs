//! h2c from applications (gRPC-style clients with prior knowledge): streams are proxied like
//! HTTP/1.1 requests, to HTTP/2 and HTTP/1.1 upstreams, with trailers intact both ways.

mod support;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::{FakeUpstream, Sidecar};

type ClientBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

async fn h2c_client(addr: std::net::SocketAddr) -> hyper::client::conn::http2::SendRequest<ClientBody> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// A body of one data frame followed by trailers, like a unary gRPC call.
fn message_with_trailers(data: &'static [u8], checksum: &str) -> ClientBody {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-request-checksum", checksum.parse().unwrap());
    let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = vec![
        Ok(Frame::data(Bytes::from_static(data))),
        Ok(Frame::trailers(trailers)),
    ];
    StreamBody::new(futures_stream(frames)).boxed()
}

fn futures_stream<T: Unpin>(items: Vec<T>) -> impl futures_core::Stream<Item = T> + Unpin {
    struct Iter<T>(std::vec::IntoIter<T>);
    impl<T: Unpin> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(items.into_iter())
}

async fn unary_call(sidecar: std::net::SocketAddr, uri: String) -> (http::Response<()>, Bytes, HeaderMap) {
    let mut client = h2c_client(sidecar).await;
    let req = Request::post(uri)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(message_with_trailers(b"\0\0\0\0\x05hello", "abc123"))
        .unwrap();
    let resp = client.send_request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    (
        http::Response::from_parts(parts, ()),
        collected.to_bytes(),
        trailers,
    )
}

#[tokio::test]
async fn a_grpc_style_call_keeps_its_trailers_through_an_h2_upstream() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: grpc\n    url: http://{}\n    protocol: http2\n",
        upstream.addr
    ))
    .await;
    let (resp, body, trailers) = unary_call(sidecar.addr, format!("http://{}/grpc", upstream.addr)).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/grpc");
    assert_eq!(&body[..], b"\0\0\0\0\x05hello");
    assert_eq!(trailers["grpc-status"], "0", "response trailers");
    assert_eq!(trailers["x-seen-request-checksum"], "abc123", "request trailers");
    let seen = upstream.seen();
    assert_eq!(seen[0].version, http::Version::HTTP_2);
    assert_eq!(seen[0].path(), "/grpc");
}

/// gRPC cannot go over HTTP/1.1, which is what a plain-TCP upstream with `protocol: auto` (the
/// default) is spoken to in: gRPC calls to it take an h2c pool of their own, and share it.
#[tokio::test]
async fn grpc_to_an_auto_upstream_goes_over_h2c_and_multiplexes() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: grpc\n    url: http://{}\n",
        upstream.addr
    ))
    .await;
    for _ in 0..3 {
        let (resp, body, trailers) = unary_call(sidecar.addr, format!("http://{}/grpc", upstream.addr)).await;
        assert_eq!(resp.status(), 200);
        assert_eq!(&body[..], b"\0\0\0\0\x05hello");
        assert_eq!(trailers["grpc-status"], "0", "response trailers");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    assert!(
        seen.iter().all(|s| s.version == http::Version::HTTP_2),
        "HTTP/2 upstream"
    );
    assert_eq!(upstream.accepted(), 1, "three calls, one h2c connection");
}

#[tokio::test]
async fn h2c_streams_on_a_route_listener_go_to_its_upstream_over_http11() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: plain\n    url: http://{}\n    listen: 127.0.0.1:0\n",
        upstream.addr
    ))
    .await;
    let route = sidecar.routes[0];
    let mut client = h2c_client(route).await;
    let mut calls = Vec::new();
    for i in 0..20 {
        let req = Request::get(format!("http://{route}/bytes/{}", 1000 + i))
            .body(
                http_body_util::Empty::<Bytes>::new()
                    .map_err(|never| match never {})
                    .boxed(),
            )
            .unwrap();
        calls.push(client.send_request(req));
    }
    for (i, call) in calls.into_iter().enumerate() {
        let resp = call.await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body.len(), 1000 + i);
    }
    // The HTTP/1.1 upstream's fields, which the sidecar keeps as their lines for HTTP/1.1
    // clients, reach an h2c client too (hyper would not add this one of its own).
    let req = Request::get(format!("http://{route}/sse/1"))
        .body(
            http_body_util::Empty::<Bytes>::new()
                .map_err(|never| match never {})
                .boxed(),
        )
        .unwrap();
    let resp = client.send_request(req).await.unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let seen = upstream.seen();
    assert_eq!(seen.len(), 21);
    assert!(seen.iter().all(|s| s.version == http::Version::HTTP_11));
    assert_eq!(seen[0].headers["host"], upstream.addr.to_string().as_str());
}
