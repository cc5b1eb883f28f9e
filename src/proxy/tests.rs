//! The request path on served connections: its net (`crate::caught`), under which a panic in
//! a request's task is answered `502 internal`, counted, and the connection goes on serving;
//! and its span, the same for HTTP/1.1 and h2c.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A request carrying this header panics in `Proxy::forward` (test builds only).
pub(crate) const PANIC_HEADER: &str = "x-egress-test-panic";

/// Reads one response head and its `Content-Length` body off `client`.
pub(crate) async fn read_response(client: &mut tokio::net::TcpStream) -> String {
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let length = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .map_or(0, |n| n.trim().parse::<usize>().unwrap());
            if got.len() >= end + 4 + length {
                return text;
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(5), client.read(&mut chunk))
            .await
            .expect("a response within 5 s")
            .unwrap();
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&chunk[..n]);
    }
}

/// An h2c GET of `uri` with `header`, through the sidecar at `me`: the client's address, and
/// the status and body it got.
pub(crate) async fn h2c_get(me: SocketAddr, uri: &str, header: (&str, &str)) -> (SocketAddr, u16, Bytes) {
    let stream = tokio::net::TcpStream::connect(me).await.unwrap();
    let local = stream.local_addr().unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(uri)
        .header(header.0, header.1)
        .body(Empty::<Bytes>::new())
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (local, status, body)
}

/// What the sidecar logs, kept for the test to read.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures what this thread logs, at debug and above, until the guard drops. The test's
    /// runtime runs the sidecar's tasks on this thread: they log here.
    fn start() -> (Self, tracing::subscriber::DefaultGuard) {
        let logs = Captured::default();
        let writer = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }
}

#[tokio::test]
async fn a_panic_in_a_request_is_answered_502_internal_and_counted() {
    let (logs, _logging) = Captured::start();
    let (me, ctx) = crate::downstream::testing::serve_for_test("").await;
    let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
    client
        .write_all(b"GET http://panic.test/ HTTP/1.1\r\nHost: panic.test\r\nx-egress-test-panic: 1\r\n\r\n")
        .await
        .unwrap();
    let answer = read_response(&mut client).await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    assert!(answer.contains("x-egress-error: internal\r\n"), "{answer}");
    assert!(answer.contains("asked for a panic"), "{answer}");
    assert_eq!(ctx.metrics.families().panics.get(), 1);
    let logged = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    let line = logged
        .lines()
        .find(|l| l.contains("panic caught"))
        .unwrap_or_else(|| panic!("no panic logged:\n{logged}"));
    assert!(
        line.contains("ERROR") && line.contains("request{method=GET uri=http://panic.test/}"),
        "logged as an error in the request's span: {line}"
    );
    assert!(line.contains("asked for a panic"), "{line}");

    // The same connection serves the next request: a refusal the path makes without a panic.
    client.write_all(b"GET /no-host HTTP/1.1\r\n\r\n").await.unwrap();
    let answer = read_response(&mut client).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert_eq!(ctx.metrics.families().panics.get(), 1);
}

#[tokio::test]
async fn an_h2c_request_logs_in_the_same_request_span_as_an_http1_one() {
    let (logs, _logging) = Captured::start();
    let (me, _ctx) = crate::downstream::testing::serve_for_test("").await;
    let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
    client
        .write_all(
            b"GET http://h1.panic.test/a HTTP/1.1\r\nHost: h1.panic.test\r\nx-egress-test-panic: 1\r\n\r\n",
        )
        .await
        .unwrap();
    assert!(read_response(&mut client).await.starts_with("HTTP/1.1 502 "));
    let (_, status, _) = h2c_get(me, "http://h2.panic.test/b", (PANIC_HEADER, "1")).await;
    assert_eq!(status, 502);

    let logged = String::from_utf8_lossy(&logs.0.lock().unwrap()).into_owned();
    for span in [
        "request{method=GET uri=http://h1.panic.test/a}",
        "request{method=GET uri=http://h2.panic.test/b}",
    ] {
        assert!(
            logged
                .lines()
                .any(|l| l.contains("panic caught") && l.contains(span)),
            "no panic logged in {span}:\n{logged}"
        );
    }
}

/// A response on its way from the upstream to the writer is moved at each frame (admission,
/// the panic net, the observer, the connection's exchange): at 128 bytes or fewer it moves in
/// registers, past that by a `memcpy` call each time. 192 bytes until issue 47.
#[test]
fn a_response_with_its_body_moves_in_registers() {
    let size = std::mem::size_of::<http::Response<super::ResponseBody>>();
    assert!(size <= 128, "Response<ResponseBody> grew to {size} bytes");
    let admitted =
        std::mem::size_of::<Result<http::Response<super::ResponseBody>, crate::error::ProxyError>>();
    assert!(admitted <= 128, "its Result grew to {admitted} bytes");
}
