//! The codec against another implementation: a GET sent with our frames and HPACK encoder to a
//! server built on the `h2` crate over a real loopback socket, its response read back with our
//! frame parser and HPACK decoder.

use std::convert::Infallible;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::tests::hpack_block;
use super::{encode, Frame, Settings, DEFAULT_MAX_FRAME_SIZE, PREFACE};
use crate::wire::hpack;

/// Far longer than the exchange takes; a hang fails instead of stalling the run.
const PATIENCE: Duration = Duration::from_secs(10);

const BODY: &[u8] = b"hello from h2";

/// Answers 200 with `x-served-by` and [`BODY`] to a GET of `/hello` carrying `x-request: ours`,
/// 400 to anything else, so that a request our encoder garbled fails the client's checks.
async fn serve(listener: TcpListener) {
    let (io, _) = listener.accept().await.unwrap();
    let mut conn = h2::server::handshake(io).await.unwrap();
    while let Some(accepted) = conn.accept().await {
        let (req, mut respond) = accepted.unwrap();
        let ours = req.method() == http::Method::GET
            && req.uri().path() == "/hello"
            && req.headers().get("x-request").is_some_and(|v| v == "ours");
        let response = http::Response::builder()
            .status(if ours { 200 } else { 400 })
            .header("x-served-by", "h2")
            .header("content-type", "text/plain")
            .body(())
            .unwrap();
        let mut send = respond.send_response(response, false).unwrap();
        send.send_data(Bytes::from_static(BODY), true).unwrap();
    }
}

/// The next whole frame, reading from `io` as long as it takes.
async fn next_frame(io: &mut TcpStream, buf: &mut BytesMut) -> Frame {
    loop {
        if let Some(frame) = Frame::parse(buf, DEFAULT_MAX_FRAME_SIZE).unwrap() {
            return frame;
        }
        let read = io.read_buf(buf).await.unwrap();
        assert!(read > 0, "the server closed the connection");
    }
}

fn request_block() -> BytesMut {
    hpack_block(&[
        (":method", "GET"),
        (":scheme", "http"),
        (":authority", "upstream.test"),
        (":path", "/hello"),
        ("x-request", "ours"),
    ])
}

/// What came back on stream 1: the response's fields, then its body.
#[derive(Debug, Default)]
struct Response {
    fields: Vec<(String, String)>,
    body: Vec<u8>,
}

/// Reads frames until stream 1 ends, answering what the connection must answer.
async fn read_response(io: &mut TcpStream, buf: &mut BytesMut) -> Response {
    let mut decoder = hpack::Decoder::new(4096, 64 * 1024);
    let mut response = Response::default();
    loop {
        match next_frame(io, buf).await {
            Frame::Headers {
                stream_id: 1,
                fragment,
                end_headers: true,
                ..
            } => {
                assert!(response.body.is_empty(), "HEADERS after DATA");
                let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                decoder
                    .decode(&fragment, |f| {
                        response.fields.push((lossy(f.name), lossy(f.value)));
                        Ok::<_, Infallible>(())
                    })
                    .unwrap();
            }
            Frame::Data {
                stream_id: 1,
                data,
                end_stream,
                ..
            } => {
                assert!(!response.fields.is_empty(), "DATA before HEADERS");
                response.body.extend_from_slice(&data);
                if end_stream {
                    return response;
                }
            }
            Frame::Ping { ack: false, payload } => {
                let mut out = BytesMut::new();
                encode::ping_ack(payload, &mut out);
                io.write_all(&out).await.unwrap();
            }
            Frame::Settings { .. } | Frame::WindowUpdate { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_get_to_an_h2_server_comes_back_whole() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(listener));
    let exchange = async {
        let mut io = TcpStream::connect(addr).await.unwrap();
        let mut out = BytesMut::new();
        out.extend_from_slice(PREFACE);
        let ours = Settings {
            enable_push: Some(false),
            ..Settings::default()
        };
        encode::settings(&ours, &mut out);
        io.write_all(&out).await.unwrap();
        out.clear();

        let mut buf = BytesMut::new();
        let first = next_frame(&mut io, &mut buf).await;
        let Frame::Settings { ack: false, settings } = first else {
            panic!("the server's preface is a SETTINGS frame, not {first:?}");
        };
        let max = settings.max_frame_size.unwrap_or(DEFAULT_MAX_FRAME_SIZE);
        encode::settings_ack(&mut out);
        encode::headers(1, &request_block(), true, max, &mut out);
        io.write_all(&out).await.unwrap();
        read_response(&mut io, &mut buf).await
    };
    let response = tokio::time::timeout(PATIENCE, exchange)
        .await
        .expect("the exchange finished");
    let field = |name: &str| {
        let found = response.fields.iter().find(|(n, _)| n == name);
        found.map(|(_, v)| v.as_str())
    };
    assert_eq!(field(":status"), Some("200"), "{response:?}");
    assert_eq!(field("x-served-by"), Some("h2"), "{response:?}");
    assert_eq!(field("content-type"), Some("text/plain"), "{response:?}");
    assert_eq!(response.body, BODY);
    server.abort();
}
