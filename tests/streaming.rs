//! Bodies stream both ways without buffering: server-sent events arrive event by event, 1 GiB
//! uploads and downloads pass with flat sidecar memory, `Expect: 100-continue` works, and the
//! downstream connection rules (pipelining, HTTP/1.0, HEAD, idle and header timeouts) hold.

mod support;

use std::time::{Duration, Instant};

use support::{ChildSidecar, FakeUpstream, RawClient, Sidecar};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const GIB: u64 = 1 << 30;

#[tokio::test]
async fn server_sent_events_arrive_one_by_one() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = upstream.addr;
    client
        .send_raw(format!("GET http://{host}/sse/5 HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let (status, headers) = client.read_head().await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    for i in 0..5 {
        // The upstream sends event i+1 only after the test has received event i, so a proxy
        // that buffered would stall here.
        let chunk = tokio::time::timeout(Duration::from_secs(5), client.read_chunk())
            .await
            .unwrap_or_else(|_| panic!("event {i} held back by the proxy"))
            .expect("stream ended early");
        assert_eq!(String::from_utf8(chunk).unwrap(), format!("data: event {i}\n\n"));
        upstream.sse_next.notify_one();
    }
    assert_eq!(client.read_chunk().await, Some(Vec::new()), "last chunk");
}

async fn one_gib_upload(sidecar: std::net::SocketAddr, upstream: std::net::SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(sidecar).await.unwrap();
    let head =
        format!("POST http://{upstream}/drain HTTP/1.1\r\nHost: {upstream}\r\nContent-Length: {GIB}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let block = vec![b'u'; 256 * 1024];
    let mut sent = 0;
    while sent < GIB {
        stream.write_all(&block).await.unwrap();
        sent += block.len() as u64;
    }
    let mut client = RawClient::from_stream(stream);
    client.read_response(false).await.unwrap().text()
}

async fn one_gib_download(sidecar: std::net::SocketAddr, upstream: std::net::SocketAddr) -> u64 {
    let mut client = RawClient::connect(sidecar).await;
    client
        .send_raw(
            format!("GET http://{upstream}/bytes/{GIB} HTTP/1.1\r\nHost: {upstream}\r\n\r\n").as_bytes(),
        )
        .await;
    let (status, headers) = client.read_head().await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-length"], GIB.to_string().as_str());
    let mut received = client.take_buffered().len() as u64;
    let mut buf = vec![0u8; 256 * 1024];
    while received < GIB {
        let n = client.stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed after {received} bytes");
        received += n as u64;
    }
    received
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gigabyte_bodies_stream_with_flat_memory() {
    let upstream = FakeUpstream::start().await;
    let sidecar = ChildSidecar::spawn("").await;
    let rss_start = sidecar.status_kib("VmRSS");

    let started = Instant::now();
    assert_eq!(one_gib_upload(sidecar.addr, upstream.addr).await, GIB.to_string());
    let upload = started.elapsed();
    let hwm_after_upload = sidecar.status_kib("VmHWM");

    let started = Instant::now();
    assert_eq!(one_gib_download(sidecar.addr, upstream.addr).await, GIB);
    let download = started.elapsed();
    let hwm = sidecar.status_kib("VmHWM");

    println!(
        "sidecar RSS at start {rss_start} KiB; peak after 1 GiB upload {hwm_after_upload} KiB \
         ({upload:?}); peak after 1 GiB download {hwm} KiB ({download:?})"
    );
    // Flat: the peak stays within a few MiB of the start, nowhere near the GiB that passed.
    assert!(
        hwm < rss_start + 16 * 1024,
        "peak RSS {hwm} KiB grew from {rss_start} KiB"
    );
}

#[tokio::test]
async fn expect_100_continue_is_answered_when_the_upstream_wants_the_body() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = upstream.addr;
    client
        .send_raw(
            format!(
                "POST http://{host}/drain HTTP/1.1\r\nHost: {host}\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    let (status, _) = tokio::time::timeout(Duration::from_secs(5), client.read_head())
        .await
        .expect("100 Continue sent without the body");
    assert_eq!(status, 100);
    client.send_raw(b"hello").await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), "5");
    assert!(
        !upstream.seen()[0].headers.contains_key("expect"),
        "Expect is hop-by-hop here"
    );
}

#[tokio::test]
async fn expect_100_continue_gets_the_final_status_when_refused() {
    let sidecar = Sidecar::start("policy: { deny_hosts: [\"blocked.example\"] }\n").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(
            b"POST http://blocked.example/ HTTP/1.1\r\nHost: blocked.example\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n",
        )
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 403);
    assert_eq!(resp.header("x-egress-error"), Some("denied"));
    assert_eq!(resp.header("connection"), Some("close"));
}

/// A response ready before the request body was taken in (here a refusal, decided before the
/// body is looked at): a body that came with its head is read all the same, and the connection
/// carries the next request; a body still to come is not waited for, and the response says
/// `Connection: close` before the connection closes, never a keep-alive answer and then a close
/// the client would take the next request's loss for.
#[tokio::test]
async fn an_early_response_keeps_the_connection_only_if_the_body_is_in() {
    let sidecar = Sidecar::start("policy: { deny_hosts: [\"blocked.example\"] }\n").await;
    let head = "POST http://blocked.example/ HTTP/1.1\r\nHost: blocked.example\r\nContent-Length: 4\r\n\r\n";
    let mut client = RawClient::connect(sidecar.addr).await;
    for i in 0..3 {
        client.send_raw(format!("{head}data").as_bytes()).await;
        let resp = client
            .read_response(false)
            .await
            .unwrap_or_else(|| panic!("request {i}: the connection closed, the body was in"));
        assert_eq!(resp.status, 403);
        assert_eq!(resp.header("connection"), None, "request {i}");
    }

    let mut client = RawClient::connect(sidecar.addr).await;
    client.send_raw(head.as_bytes()).await;
    let resp = client.read_response(false).await.expect("the refusal");
    assert_eq!(resp.status, 403);
    assert_eq!(resp.header("connection"), Some("close"), "the body never came");
    assert!(client.is_closed_within(Duration::from_secs(5)).await);
}

#[tokio::test]
async fn pipelined_requests_are_answered_in_order() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = upstream.addr;
    client
        .send_raw(
            format!(
                "GET http://{host}/sleep/200 HTTP/1.1\r\nHost: {host}\r\n\r\n\
                 POST http://{host}/drain HTTP/1.1\r\nHost: {host}\r\nContent-Length: 3\r\n\r\nabc\
                 GET http://{host}/bytes/10 HTTP/1.1\r\nHost: {host}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    assert_eq!(client.read_response(false).await.unwrap().text(), "ok");
    assert_eq!(client.read_response(false).await.unwrap().text(), "3");
    assert_eq!(client.read_response(false).await.unwrap().text(), "xxxxxxxxxx");
}

#[tokio::test]
async fn http10_clients_and_head_requests() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let host = upstream.addr;

    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(format!("GET http://{host}/sse/1 HTTP/1.0\r\n\r\n").as_bytes())
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(
        resp.text(),
        "data: event 0\n\n",
        "close-delimited body for HTTP/1.0"
    );
    assert!(client.is_closed_within(Duration::from_secs(2)).await);

    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(format!("HEAD http://{host}/bytes/1000 HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let resp = client.read_response(true).await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-length"), Some("1000"));
    // Still in sync: the next response on the same connection parses.
    assert_eq!(client.get(&format!("http://{host}/")).await.text(), "ok");
}

#[tokio::test]
async fn chunked_request_bodies_are_forwarded() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = upstream.addr;
    client
        .send_raw(
            format!(
                "POST http://{host}/echo HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n\
                 5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.text(), "hello world");
}

#[tokio::test]
async fn idle_downstream_connections_are_closed() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("downstream: { idle_timeout: 300ms, header_read_timeout: 2s }\n").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(
        client.get(&format!("http://{}/", upstream.addr)).await.status,
        200
    );
    assert!(
        client.is_closed_within(Duration::from_secs(3)).await,
        "idle keep-alive connection left open past idle_timeout"
    );
    // The upstream connection stays pooled: idling downstream does not close upstream.
    assert_eq!(upstream.open(), 1);
}

#[tokio::test]
async fn slow_request_heads_are_cut_off() {
    let sidecar = Sidecar::start("downstream: { header_read_timeout: 300ms }\n").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(b"GET http://example.com/ HTTP/1.1\r\nHost: exa")
        .await;
    assert!(
        client.is_closed_within(Duration::from_secs(3)).await,
        "slow head kept open"
    );
}
