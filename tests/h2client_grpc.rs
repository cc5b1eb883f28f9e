//! Our HTTP/2 client connection (`wire::h2client`, not yet on the request path) against a
//! server it was not written with: grpc-go's health service over h2c (`tests/grpc`). grpc-go
//! codes its heads with HPACK's dynamic table (a second response names fields the first one
//! inserted) and ends each call with trailers, so this runs what the `h2`-crate interop test
//! does not: a real server's table, gRPC framing and `grpc-status` trailers.

mod support;

use std::collections::HashMap;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use egress_sidecar::wire::h2client::{Config, Connection, Event, RequestHead};
use http::{HeaderMap, HeaderValue, Method};
use support::grpc::GrpcServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A `HealthCheckRequest` for the whole server (an empty message), gRPC-framed: uncompressed,
/// length 0.
const CHECK: &[u8] = &[0, 0, 0, 0, 0];

/// The answer: a `HealthCheckResponse` with `status: SERVING` (field 1, varint 1), framed.
const SERVING: &[u8] = &[0, 0, 0, 0, 2, 0x08, 0x01];

/// One call's response as it came: status, head lines, body, trailer lines.
#[derive(Debug, Default)]
struct Call {
    status: u16,
    head: Vec<u8>,
    body: Vec<u8>,
    trailers: Vec<u8>,
    done: bool,
}

/// Our side of the socket: the connection, the calls by stream, and the loop that drives them.
struct Client {
    io: TcpStream,
    conn: Connection,
    buf: BytesMut,
    calls: HashMap<u32, Call>,
}

impl Client {
    /// Starts a health check; its request is whole, so it fits the initial window.
    fn check(&mut self, headers: &HeaderMap) -> u32 {
        let head = RequestHead {
            method: &Method::POST,
            scheme: "http",
            authority: "grpc.internal.test",
            path: "/grpc.health.v1.Health/Check",
            headers,
            lines: egress_sidecar::wire::HeadLines::NONE,
        };
        let id = self.conn.open(&head, false).expect("a stream opens");
        let all = self
            .conn
            .send_data(id, &mut Bytes::from_static(CHECK), true)
            .unwrap();
        assert!(all, "five bytes fit the initial window");
        self.calls.insert(id, Call::default());
        id
    }

    /// Drives the connection until every call has ended.
    async fn finish(&mut self) {
        while self.calls.values().any(|c| !c.done) {
            while let Some(event) = self.conn.next_event() {
                self.take(event);
            }
            while !self.conn.out().is_empty() {
                self.io.write_buf(self.conn.out()).await.unwrap();
            }
            if self.calls.values().all(|c| c.done) {
                break;
            }
            let read = self.io.read_buf(&mut self.buf).await.unwrap();
            assert!(read > 0, "grpc-go closed the connection");
            self.conn
                .recv(&mut self.buf)
                .expect("grpc-go speaks valid HTTP/2");
        }
    }

    fn take(&mut self, event: Event) {
        match event {
            Event::Head {
                stream_id, fields, ..
            } => {
                let call = self.calls.get_mut(&stream_id).unwrap();
                call.status = fields.status;
                call.head = fields.lines.lines().to_vec();
            }
            Event::Data { stream_id, data, .. } => {
                self.calls
                    .get_mut(&stream_id)
                    .unwrap()
                    .body
                    .extend_from_slice(&data);
                self.conn.release(stream_id, data.len());
            }
            Event::Trailers { stream_id, fields } => {
                let call = self.calls.get_mut(&stream_id).unwrap();
                call.trailers = fields.lines.lines().to_vec();
                call.done = true;
            }
            Event::Reset {
                stream_id,
                code,
                cause,
            } => panic!("stream {stream_id} reset: {code} {cause:?}"),
            Event::GoAway { code, .. } => panic!("grpc-go went away: {code}"),
            Event::Capacity { .. } | Event::Settings | Event::Pong { .. } => {}
        }
    }
}

fn assert_serving(call: &Call) {
    let head = String::from_utf8_lossy(&call.head);
    let trailers = String::from_utf8_lossy(&call.trailers);
    assert_eq!(call.status, 200, "{head}");
    assert!(head.contains("content-type: application/grpc\r\n"), "{head}");
    assert_eq!(call.body, SERVING, "{head}");
    assert!(trailers.contains("grpc-status: 0\r\n"), "{trailers}");
}

#[tokio::test]
async fn health_checks_with_grpc_go_one_after_another_and_at_once() {
    let Some(bin) = support::build_go("tests/grpc", "grpcleak").await else {
        support::skip("`go` is not on PATH; the gRPC server cannot be built");
        return;
    };
    let mut server = GrpcServer::start(&bin).await;
    let mut client = Client {
        io: TcpStream::connect(&server.addr).await.unwrap(),
        conn: Connection::new(Config::default()),
        buf: BytesMut::new(),
        calls: HashMap::new(),
    };
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/grpc"));
    headers.insert("te", HeaderValue::from_static("trailers"));
    headers.insert("user-agent", HeaderValue::from_static("egress-sidecar-test"));

    let calls = async {
        // One after another: the second and third heads lean on the table the first filled.
        for _ in 0..3 {
            let id = client.check(&headers);
            client.finish().await;
            assert_serving(&client.calls[&id]);
        }
        // Five at once, multiplexed.
        let ids: Vec<u32> = (0..5).map(|_| client.check(&headers)).collect();
        client.finish().await;
        for id in ids {
            assert_serving(&client.calls[&id]);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), calls)
        .await
        .expect("the calls finish");
    assert!(client.conn.is_settings_acked());
    assert_eq!(client.conn.open_streams(), 0);

    let counts = server.counts().await;
    assert_eq!(
        (counts.accepted, counts.rpcs),
        (1, 8),
        "one connection, eight calls"
    );
}
