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

use std::time::Duration;

use support::{fault_upstream, settle, ChildSidecar, RawClient, FAULT_BODY_LEN};

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
        assert!(
            received < FAULT_BODY_LEN,
            "{path}: {received} bytes, as if complete"
        );
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
