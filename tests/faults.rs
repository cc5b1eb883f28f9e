//! Upstream faults on the wire, against the sidecar binary: a fault-injecting HTTP/1.1 upstream
//! resets or truncates responses and lies about `Content-Length`; each fault ends the way the
//! README documents, and afterwards the pools are empty and the process holds exactly the file
//! descriptors it held before.
//!
//! (Faults covered elsewhere: refused connections, a dial that hangs and a response that never
//! comes in tests/pool.rs; an idle connection closed just as it is reused in
//! tests/pool.rs `stale_connection_race_retries_get_but_not_post`; GOAWAY and an HTTP/2
//! upstream dying mid-stream in tests/http2.rs.)

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::{ChildSidecar, RawClient};

const BODY_LEN: usize = 1000;

/// Answers by path: `/reset-before-head`, `/reset-mid-body` and `/truncated` (a 1000-byte
/// promise, 100 bytes, then an RST or a FIN), `/lie-long` (`Content-Length: 5` followed by
/// more bytes than that), anything else "ok". Keeps connections alive otherwise.
async fn fault_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve_faults(stream));
        }
    });
    addr
}

async fn serve_faults(mut stream: TcpStream) {
    let mut buf = Vec::new();
    loop {
        let Some(path) = read_request_path(&mut stream, &mut buf).await else {
            return;
        };
        let partial = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {BODY_LEN}\r\n\r\n{}",
            "x".repeat(100)
        );
        match path.as_str() {
            "/reset-before-head" => return reset(stream),
            "/reset-mid-body" => {
                let _ = stream.write_all(partial.as_bytes()).await;
                return reset(stream);
            }
            "/truncated" => {
                let _ = stream.write_all(partial.as_bytes()).await;
                let _ = stream.shutdown().await;
                return;
            }
            "/lie-long" => {
                let lie = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsmuggle";
                if stream.write_all(lie).await.is_err() {
                    return;
                }
            }
            _ => {
                if stream
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// Closes with an RST instead of a FIN.
fn reset(stream: TcpStream) {
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// Reads one request head (these requests have no body) and returns its path.
async fn read_request_path(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            buf.drain(..end + 4);
            return head.split(' ').nth(1).map(str::to_owned);
        }
        let mut chunk = [0u8; 4096];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn open_fds(sidecar: &ChildSidecar) -> usize {
    let pid = sidecar.child.id().expect("running");
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Upstream connections (every pool, every state) and application connections open.
async fn connections(sidecar: &ChildSidecar) -> (f64, f64) {
    let scrape = support::scrape(sidecar.admin).await;
    let sum = |metric: &str| -> f64 {
        scrape
            .samples
            .iter()
            .filter(|s| s.metric == metric)
            .map(|s| match s.value {
                prometheus_parse::Value::Gauge(v) => v,
                _ => 0.0,
            })
            .sum()
    };
    (
        sum("egress_upstream_connections"),
        sum("egress_downstream_connections"),
    )
}

/// Waits (up to 10 s) until no connection is open either side and, when given, the fd count
/// is `expected`; returns (upstream connections, downstream connections, fds).
async fn settle(sidecar: &ChildSidecar, expected: Option<usize>) -> (f64, f64, usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (up, down) = connections(sidecar).await;
        let fds = open_fds(sidecar);
        let quiet = up == 0.0 && down == 0.0 && expected.is_none_or(|e| e == fds);
        if quiet || tokio::time::Instant::now() > deadline {
            return (up, down, fds);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Reads a response head and then the body until the connection ends; returns the status and
/// the body bytes received.
async fn read_until_closed(client: &mut RawClient) -> (u16, usize) {
    let (status, _) = client.read_head().await;
    let mut received = client.take_buffered().len();
    while let Some(chunk) = tokio::time::timeout(Duration::from_secs(5), client.read_chunk())
        .await
        .expect("the truncated response ends within 5s")
    {
        received += chunk.len();
    }
    (status, received)
}

#[tokio::test]
async fn each_upstream_fault_ends_as_documented_and_leaks_nothing() {
    let up = fault_upstream().await;
    let sidecar = ChildSidecar::spawn("defaults: { pool: { idle_timeout: 1s } }\n").await;
    // Warm up what the process keeps for its lifetime (the parking epoll instance, runtime
    // threads), then let the pool empty, for the baseline.
    let mut warm = RawClient::connect(sidecar.addr).await;
    assert_eq!(warm.get(&format!("http://{up}/ok")).await.status, 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(warm);
    let (up_open, down_open, baseline) = settle(&sidecar, None).await;
    assert_eq!(
        (up_open, down_open),
        (0.0, 0.0),
        "connections left after the warm-up"
    );

    // Before any response byte: a fresh connection's reset is a 502, never a hang.
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .get(&format!("http://{up}/reset-before-head"))
        .await
        .assert_sidecar_error(502, "upstream_reset", "reset before the head");
    drop(client);

    // After the head: the status is already out, so the sidecar can only end the client's
    // connection early; the client sees fewer bytes than Content-Length promised and a close.
    for path in ["/reset-mid-body", "/truncated"] {
        let mut client = RawClient::connect(sidecar.addr).await;
        client
            .send_raw(format!("GET http://{up}{path} HTTP/1.1\r\nHost: {up}\r\n\r\n").as_bytes())
            .await;
        let (status, received) = read_until_closed(&mut client).await;
        assert_eq!(status, 200, "{path}");
        assert!(received < BODY_LEN, "{path}: {received} bytes, as if complete");
    }

    // A server sending more than its Content-Length: the client gets exactly the declared
    // body, and the bytes beyond it never become another client's response.
    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client.get(&format!("http://{up}/lie-long")).await;
    assert_eq!((resp.status, resp.text().as_str()), (200, "hello"));
    for _ in 0..3 {
        let resp = client.get(&format!("http://{up}/ok")).await;
        assert_eq!((resp.status, resp.text().as_str()), (200, "ok"));
    }
    drop(client);

    let settled = settle(&sidecar, Some(baseline)).await;
    assert_eq!(
        settled,
        (0.0, 0.0, baseline),
        "(upstream, downstream connections, fds) after the faults"
    );
}
