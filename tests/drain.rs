//! SIGTERM: readiness turns 503, in-flight requests complete, new requests during the drain are
//! still served, and the process exits 0 as soon as no application connection is left (at once
//! when applications are idle), saying goodbye to HTTP/2 upstreams with GOAWAY.

mod support;

use std::time::{Duration, Instant};

use support::{ChildSidecar, FakeUpstream, RawClient};

fn sigterm(sidecar: &ChildSidecar) {
    sidecar.signal("-TERM");
}

async fn readyz(admin: std::net::SocketAddr) -> u16 {
    support::admin_get(admin, "/readyz").await.status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_load_finishes_the_work_and_exits_zero() {
    let upstream = FakeUpstream::start().await;
    let mut sidecar = ChildSidecar::spawn("shutdown: { drain_timeout: 8s }\n").await;
    assert_eq!(readyz(sidecar.admin).await, 200);
    let (addr, up) = (sidecar.addr, upstream.addr);
    // In flight until the test releases it: its response's second event waits for sse_next.
    let in_flight = tokio::spawn(async move {
        RawClient::connect(addr)
            .await
            .get(&format!("http://{up}/sse/2"))
            .await
    });
    assert!(support::eventually(Duration::from_secs(5), || upstream.requests() == 1).await);

    let signalled = Instant::now();
    sigterm(&sidecar);
    // The signal is handled asynchronously: wait for readiness to turn off, then check it
    // (the sidecar cannot exit meanwhile: the request above is still in flight).
    let admin = sidecar.admin;
    support::eventually_async(
        Duration::from_secs(5),
        || async move { readyz(admin).await == 503 },
    )
    .await;
    assert_eq!(readyz(sidecar.admin).await, 503, "readiness off while draining");
    // An application still finishing its work can open a new connection and be served.
    let during = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{up}/"))
        .await;
    assert_eq!(during.status, 200);
    assert_eq!(during.header("connection"), Some("close"));

    upstream.sse_next.notify_one();
    let finished = in_flight.await.unwrap();
    assert_eq!(finished.status, 200, "in-flight request completed");
    assert_eq!(finished.text(), "data: event 0\n\ndata: event 1\n\n");
    sidecar.assert_exits_ok_within(Duration::from_secs(8)).await;
    println!("exited {:?} after SIGTERM", signalled.elapsed());
    assert!(
        signalled.elapsed() < Duration::from_secs(4),
        "waited for the deadline instead of the last connection"
    );
}

#[tokio::test]
async fn sigterm_with_idle_applications_exits_at_once() {
    let upstream = FakeUpstream::start().await;
    let mut sidecar =
        ChildSidecar::spawn("shutdown: { drain_timeout: 8s }\ndownstream: { idle_timeout: 60s }\n").await;
    // An application holding an idle keep-alive connection.
    let mut idle = RawClient::connect(sidecar.addr).await;
    assert_eq!(idle.get(&format!("http://{}/", upstream.addr)).await.status, 200);
    let signalled = Instant::now();
    sigterm(&sidecar);
    sidecar.assert_exits_ok_within(Duration::from_secs(8)).await;
    assert!(
        signalled.elapsed() < Duration::from_secs(1),
        "took {:?}",
        signalled.elapsed()
    );
    assert!(
        idle.is_closed_within(Duration::from_secs(1)).await,
        "the idle connection was closed"
    );
}

/// An HTTP/2 server written frame by frame: it answers every request `200` with no body and
/// reports the frame types the client sent until it closed the connection.
async fn frame_logging_h2_server() -> (std::net::SocketAddr, tokio::sync::oneshot::Receiver<Vec<u8>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SETTINGS: u8 = 0x4;
    const HEADERS: u8 = 0x1;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut preface = [0u8; 24];
        stream.read_exact(&mut preface).await.unwrap();
        assert_eq!(&preface, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        stream
            .write_all(&[0, 0, 0, SETTINGS, 0, 0, 0, 0, 0])
            .await
            .unwrap();
        let mut types = Vec::new();
        loop {
            let mut head = [0u8; 9];
            if stream.read_exact(&mut head).await.is_err() {
                break; // the client closed the connection
            }
            let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream_id = &head[5..9];
            let mut payload = vec![0u8; len];
            stream.read_exact(&mut payload).await.unwrap();
            types.push(kind);
            if kind == SETTINGS && flags & 0x1 == 0 {
                stream
                    .write_all(&[0, 0, 0, SETTINGS, 0x1, 0, 0, 0, 0])
                    .await
                    .unwrap();
            }
            if kind == HEADERS {
                // One byte of HPACK: static table entry 8, `:status: 200`; END_STREAM | END_HEADERS.
                let mut reply = vec![0, 0, 1, HEADERS, 0x5];
                reply.extend_from_slice(stream_id);
                reply.push(0x88);
                stream.write_all(&reply).await.unwrap();
            }
        }
        let _ = tx.send(types);
    });
    (addr, rx)
}

#[tokio::test]
async fn exit_closes_http2_upstream_connections_with_goaway() {
    const GOAWAY: u8 = 0x7;
    let (upstream, frames) = frame_logging_h2_server().await;
    let mut sidecar = ChildSidecar::spawn(&format!(
        "upstreams:\n  - name: h2\n    url: http://{upstream}\n    protocol: http2\n"
    ))
    .await;
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{upstream}/"))
        .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    sigterm(&sidecar);
    sidecar.assert_exits_ok_within(Duration::from_secs(8)).await;
    let frames = tokio::time::timeout(Duration::from_secs(2), frames)
        .await
        .expect("the upstream connection was closed")
        .unwrap();
    assert_eq!(
        frames.last(),
        Some(&GOAWAY),
        "frame types the sidecar sent: {frames:?}"
    );
}
