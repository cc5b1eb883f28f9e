//! Bad input gets its documented status and `x-egress-error` kind, the connection closes, and
//! the upstream receives nothing.

mod support;

use std::time::Duration;

use support::{FakeUpstream, RawClient, Sidecar};

/// Sends `raw` on a fresh connection; returns the response and the client.
async fn send(sidecar: &Sidecar, raw: &[u8]) -> (support::RawResponse, RawClient) {
    let mut client = RawClient::connect(sidecar.addr).await;
    client.send_raw(raw).await;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.read_response(false))
        .await
        .expect("answered within 5s")
        .expect("a response, not a bare close");
    (resp, client)
}

#[tokio::test]
async fn malformed_requests_get_documented_errors_and_reach_nobody() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let me = sidecar.addr;
    let huge = "a".repeat(70 * 1024);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("garbage request line", "GARBAGE\r\n\r\n".into(), 400, "bad_request"),
        ("bad version", format!("GET http://{up}/ HTTP/9.9\r\nHost: {up}\r\n\r\n"), 400, "bad_request"),
        ("space in absolute URI", format!("GET http://exa mple.com/ HTTP/1.1\r\nHost: {up}\r\n\r\n"), 400, "bad_request"),
        ("absolute URI without host", "GET http:///path HTTP/1.1\r\nHost: a\r\n\r\n".into(), 400, "bad_request"),
        ("unsupported scheme", format!("GET ftp://{up}/ HTTP/1.1\r\nHost: {up}\r\n\r\n"), 400, "bad_request"),
        (
            "Content-Length with Transfer-Encoding",
            format!("POST http://{up}/drain HTTP/1.1\r\nHost: {up}\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
            400,
            "bad_request",
        ),
        (
            "two Content-Lengths",
            format!("POST http://{up}/drain HTTP/1.1\r\nHost: {up}\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello"),
            400,
            "bad_request",
        ),
        ("oversized header", format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nX-Big: {huge}\r\n\r\n"), 431, "header_too_large"),
        ("request to the sidecar itself", format!("GET http://{me}/ HTTP/1.1\r\nHost: {me}\r\n\r\n"), 508, "loop"),
        ("request to the sidecar via localhost", format!("GET http://localhost:{}/x HTTP/1.1\r\nHost: x\r\n\r\n", me.port()), 508, "loop"),
        ("origin-form Host naming the sidecar", format!("GET / HTTP/1.1\r\nHost: {me}\r\n\r\n"), 508, "loop"),
        ("origin-form unknown Host", "GET / HTTP/1.1\r\nHost: unknown.example\r\n\r\n".into(), 400, "unknown_upstream"),
        ("CONNECT to a port outside policy.connect_ports", format!("CONNECT {up} HTTP/1.1\r\nHost: {up}\r\n\r\n"), 403, "denied"),
    ];
    for (what, raw, status, kind) in cases {
        let (resp, mut client) = send(&sidecar, raw.as_bytes()).await;
        resp.assert_sidecar_error(status, kind, what);
        // A head that cannot be parsed or framed leaves the stream unsynchronised: the sidecar
        // must close. Well-framed requests that routing refuses may keep the connection.
        let parse_error = status == 431
            || !matches!(kind, "loop" | "unknown_upstream")
                && !what.contains("scheme")
                && !what.contains("CONNECT");
        if parse_error {
            assert!(
                client.is_closed_within(Duration::from_secs(3)).await,
                "{what}: connection left open"
            );
        }
    }
    assert_eq!(upstream.accepted(), 0, "the upstream received a connection");
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test]
async fn a_broken_chunked_body_aborts_the_upstream_request() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(
            format!("POST http://{up}/drain HTTP/1.1\r\nHost: {up}\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX").as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.expect("an error response");
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("bad_request"));
    assert!(client.is_closed_within(Duration::from_secs(3)).await);
    // The upstream saw an aborted request, never a complete one, and its connection was
    // closed rather than pooled.
    assert!(support::eventually(Duration::from_secs(3), || upstream.open() == 0).await);
    assert!(upstream.seen().iter().all(|s| s.body_len < 5));
}

#[tokio::test]
async fn a_client_that_vanishes_mid_upload_leaks_nothing() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(
            format!(
                "POST http://{up}/drain HTTP/1.1\r\nHost: {up}\r\nContent-Length: 1000000\r\n\r\npartial"
            )
            .as_bytes(),
        )
        .await;
    assert!(support::eventually(Duration::from_secs(3), || upstream.open() == 1).await);
    drop(client);
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "half-forwarded upstream request kept open"
    );
    // The pool still works afterwards.
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get(&format!("http://{up}/")).await.status, 200);
}

#[tokio::test]
async fn a_client_that_leaves_before_the_response_abandons_the_upstream_exchange() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(format!("GET http://{up}/sleep/10000 HTTP/1.1\r\nHost: {up}\r\n\r\n").as_bytes())
        .await;
    assert!(support::eventually(Duration::from_secs(3), || upstream.requests() == 1).await);
    drop(client);
    // The pooled connection carrying the abandoned exchange is closed, not left to finish.
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "upstream exchange kept running for a client that left"
    );
}
