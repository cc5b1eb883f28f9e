//! The connection against another implementation: a server built on the `h2` crate over a real
//! loopback socket, driven by the smallest loop that can drive it (write what is out, read, hand
//! the bytes in, take the events). Windows of 65,535 bytes on both sides make flow control do
//! its work both ways: the server waits for our WINDOW_UPDATEs, and we for its.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Method};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// Far longer than the exchanges take; a hang fails instead of stalling the run.
const PATIENCE: Duration = Duration::from_secs(20);

const BIG: usize = 300_000;
const UPLOAD: usize = 200_000;

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

/// `/big`: 200 with [`BIG`] bytes; `/echo`: the body's length and the request's `x-sum`
/// trailer echoed as trailers; `/held`: answered only once `/release` comes.
async fn serve(listener: TcpListener) {
    let (io, _) = listener.accept().await.unwrap();
    let mut conn = h2::server::Builder::new()
        .max_concurrent_streams(2)
        .handshake::<_, Bytes>(io)
        .await
        .unwrap();
    let (held_tx, held_rx) = tokio::sync::watch::channel(false);
    while let Some(accepted) = conn.accept().await {
        // Our GOAWAY and close end the connection; what went wrong before shows on our side.
        let Ok((req, mut respond)) = accepted else {
            break;
        };
        let mut held = held_rx.clone();
        let held_tx = held_tx.clone();
        tokio::spawn(async move {
            let path = req.uri().path().to_owned();
            let mut body = req.into_body();
            let mut received = Vec::new();
            while let Some(chunk) = body.data().await {
                let chunk = chunk.unwrap();
                body.flow_control().release_capacity(chunk.len()).unwrap();
                received.extend_from_slice(&chunk);
            }
            let trailers = body.trailers().await.unwrap();
            let response = http::Response::builder().status(200).body(()).unwrap();
            match path.as_str() {
                "/big" => {
                    let mut send = respond.send_response(response, false).unwrap();
                    send.send_data(Bytes::from(pattern(BIG)), true).unwrap();
                }
                "/echo" => {
                    assert_eq!(received, pattern(UPLOAD));
                    let mut send = respond.send_response(response, false).unwrap();
                    send.send_data(Bytes::from(received.len().to_string()), false)
                        .unwrap();
                    let sum = trailers.unwrap()["x-sum"].clone();
                    let mut echoed = HeaderMap::new();
                    echoed.insert("x-sum-echo", sum);
                    send.send_trailers(echoed).unwrap();
                }
                "/held" => {
                    let _ = held.wait_for(|released| *released).await;
                    respond.send_response(response, true).unwrap();
                }
                _ => {
                    held_tx.send_replace(true);
                    respond.send_response(response, true).unwrap();
                }
            }
        });
    }
}

/// Our side of the socket: the connection and the loop around it.
struct Driver {
    io: TcpStream,
    conn: Connection,
    buf: BytesMut,
}

impl Driver {
    async fn flush(&mut self) {
        while !self.conn.out().is_empty() {
            self.io.write_buf(self.conn.out()).await.unwrap();
        }
    }

    async fn event(&mut self) -> Event {
        loop {
            if let Some(event) = self.conn.next_event() {
                return event;
            }
            self.flush().await;
            let read = self.io.read_buf(&mut self.buf).await.unwrap();
            assert!(read > 0, "the server closed the connection");
            self.conn.recv(&mut self.buf).unwrap();
        }
    }

    /// The response on `id`, its body released as it comes: status, body, trailer lines.
    async fn response(&mut self, id: u32) -> (u16, Vec<u8>, Vec<u8>) {
        let (mut status, mut body, mut trailers) = (0, Vec::new(), Vec::new());
        loop {
            match self.event().await {
                Event::Head {
                    stream_id,
                    fields,
                    end_stream,
                } if stream_id == id => {
                    status = fields.status;
                    if end_stream {
                        return (status, body, trailers);
                    }
                }
                Event::Data {
                    stream_id,
                    data,
                    end_stream,
                } if stream_id == id => {
                    body.extend_from_slice(&data);
                    self.conn.release(id, data.len());
                    if end_stream {
                        return (status, body, trailers);
                    }
                }
                Event::Trailers { stream_id, fields } if stream_id == id => {
                    trailers.extend_from_slice(fields.lines.lines());
                    return (status, body, trailers);
                }
                Event::Reset { stream_id, .. } if stream_id == id => panic!("stream {id} reset"),
                _ => {}
            }
        }
    }

    fn open(&mut self, method: &Method, path: &str, end_stream: bool) -> u32 {
        let headers = HeaderMap::new();
        let head = RequestHead {
            method,
            scheme: "http",
            authority: "upstream.test",
            path,
            headers: &headers,
            lines: crate::wire::HeadLines::NONE,
        };
        self.conn.open(&head, end_stream).unwrap()
    }
}

async fn exchanges() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(listener));
    let config = Config {
        stream_window: 65_535,
        connection_window: 65_535,
        ..Config::default()
    };
    let mut ours = Driver {
        io: TcpStream::connect(addr).await.unwrap(),
        conn: Connection::new(config),
        buf: BytesMut::new(),
    };
    while ours.event().await != Event::Settings {}
    assert_eq!(ours.conn.max_concurrent_streams(), 2);

    // A body four times the windows: it comes only as we release it.
    let id = ours.open(&Method::GET, "/big", true);
    let (status, body, _) = ours.response(id).await;
    assert_eq!((status, body.len()), (200, BIG));
    assert!(body == pattern(BIG), "the body came through byte for byte");

    // An upload three times the server's windows, sent as they open, then trailers.
    let id = ours.open(&Method::POST, "/echo", false);
    let mut upload = Bytes::from(pattern(UPLOAD));
    while !ours.conn.send_data(id, &mut upload, false).unwrap() {
        while !matches!(ours.event().await, Event::Capacity { .. }) {}
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("x-sum", HeaderValue::from_static("12345"));
    ours.conn.send_trailers(id, &trailers).unwrap();
    let (status, body, trailers) = ours.response(id).await;
    assert_eq!((status, body), (200, UPLOAD.to_string().into_bytes()));
    assert_eq!(trailers, b"x-sum-echo: 12345\r\n");

    // The server's limit of two streams: a third waits until one ends.
    let held = ours.open(&Method::GET, "/held", true);
    let release = ours.open(&Method::GET, "/release", true);
    assert!(!ours.conn.can_open());
    assert_eq!(ours.response(release).await.0, 200);
    assert_eq!(ours.response(held).await.0, 200);
    assert!(ours.conn.can_open());
    assert!(ours.conn.is_settings_acked());
    assert_eq!(ours.conn.open_streams(), 0);

    ours.conn.go_away(ErrorCode::NO_ERROR);
    ours.flush().await;
    drop(ours);
    server.await.unwrap();
}

#[tokio::test]
async fn flow_control_trailers_and_stream_limits_work_against_an_h2_server() {
    tokio::time::timeout(PATIENCE, exchanges())
        .await
        .expect("the exchanges finish");
}
