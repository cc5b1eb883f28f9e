//! HTTP/1.1 upgrades (WebSocket) passed through on dedicated upstream connections: the
//! handshake's headers, bytes both ways after `101`, non-101 answers relayed like any response,
//! the pool left alone, and the cases that are not passed through.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use support::{closes_within, eventually, read_n, RawClient, Sidecar};

// === a raw upstream that speaks just enough HTTP/1.1 ===

/// A request head the upstream received.
#[derive(Debug, Clone)]
struct Head {
    method: String,
    target: String,
    headers: HeaderMap,
}

/// A keep-alive HTTP/1.1 server written against the wire, so that what the sidecar sends is
/// seen exactly. Paths:
/// - `/ws...` with `Upgrade`: `101` (plus a greeting in the same write), then echoes bytes
///   until the client finishes sending, then finishes too;
/// - `/reject`: `426` with a `Content-Length` body; `/reject-chunked`: `426` with a chunked
///   body and a trailer;
/// - `/hang`: never answers;
/// - anything else: `200` "ok".
struct RawUpstream {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    heads: Arc<Mutex<Vec<Head>>>,
    task: tokio::task::JoinHandle<()>,
}

const GREETING: &[u8] = b"welcome|";

impl RawUpstream {
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Serves over TLS with `acceptor`.
    async fn start_tls(acceptor: tokio_rustls::TlsAcceptor) -> Self {
        Self::start_with(Some(acceptor)).await
    }

    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (o, a, h) = (open.clone(), accepted.clone(), heads.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let (o, h, tls) = (o.clone(), h.clone(), tls.clone());
                tokio::spawn(async move {
                    match tls {
                        None => serve_raw(stream, h).await,
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                serve_raw(stream, h).await;
                            }
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        RawUpstream {
            addr,
            open,
            accepted,
            heads,
            task,
        }
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    fn heads(&self) -> Vec<Head> {
        self.heads.lock().unwrap().clone()
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_raw<S>(mut stream: S, heads: Arc<Mutex<Vec<Head>>>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break p + 4;
            }
            let mut tmp = [0u8; 4096];
            match stream.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        };
        let head = {
            let mut slots = [httparse::EMPTY_HEADER; 64];
            let mut req = httparse::Request::new(&mut slots);
            req.parse(&buf[..head_end]).expect("a valid request head");
            let mut headers = HeaderMap::new();
            for h in req.headers.iter() {
                headers.append(
                    http::HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                    http::HeaderValue::from_bytes(h.value).unwrap(),
                );
            }
            Head {
                method: req.method.unwrap().to_owned(),
                target: req.path.unwrap().to_owned(),
                headers,
            }
        };
        buf.drain(..head_end);
        heads.lock().unwrap().push(head.clone());
        let path = head.target.split('?').next().unwrap_or("").to_owned();
        if path.starts_with("/ws") && head.headers.contains_key("upgrade") {
            let key = head
                .headers
                .get("sec-websocket-key")
                .map_or("", |v| v.to_str().unwrap())
                .to_owned();
            let mut out = format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                 Keep-Alive: timeout=5\r\nSec-WebSocket-Accept: accept-for-{key}\r\n\r\n"
            )
            .into_bytes();
            out.extend_from_slice(GREETING);
            out.extend_from_slice(&buf);
            stream.write_all(&out).await.unwrap();
            let (mut rd, mut wr) = tokio::io::split(stream);
            if tokio::io::copy(&mut rd, &mut wr).await.is_ok() {
                let _ = wr.shutdown().await;
                let mut rest = [0u8; 64];
                while let Ok(n) = rd.read(&mut rest).await {
                    if n == 0 {
                        break;
                    }
                }
            }
            return;
        }
        let answer: &[u8] = match path.as_str() {
            "/reject" => {
                b"HTTP/1.1 426 Upgrade Required\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                  Content-Type: text/plain\r\nContent-Length: 16\r\n\r\nnot a websocket\n"
            }
            "/reject-chunked" => {
                b"HTTP/1.1 426 Upgrade Required\r\nTransfer-Encoding: chunked\r\nTrailer: x-why\r\n\r\n\
                  4\r\nnope\r\n0\r\nx-why: chunked\r\n\r\n"
            }
            "/hang" => {
                let mut rest = [0u8; 64];
                while let Ok(n) = stream.read(&mut rest).await {
                    if n == 0 {
                        break;
                    }
                }
                return;
            }
            _ => b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        };
        if stream.write_all(answer).await.is_err() {
            return;
        }
    }
}

// === client side ===

/// A WebSocket opening handshake for `target` (absolute-form through the forward proxy, or
/// origin-form on a route listener), with hop-by-hop fields that must not reach the upstream.
fn handshake(target: &str, host: &str) -> String {
    format!(
        "GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         Proxy-Connection: keep-alive\r\nKeep-Alive: timeout=30\r\n\r\n"
    )
}

/// Sends `request` and expects `101`; returns the raw stream and bytes read past the head.
async fn switch(sidecar: SocketAddr, request: &str) -> (TcpStream, Vec<u8>, HeaderMap) {
    let mut client = RawClient::connect(sidecar).await;
    client.send_raw(request.as_bytes()).await;
    let resp = tokio::time::timeout(Duration::from_secs(5), client.read_response(true))
        .await
        .expect("answered within 5s")
        .expect("a response");
    assert_eq!(resp.status, 101, "{:?} {}", resp.headers, resp.text());
    let early = client.take_buffered();
    (client.stream, early, resp.headers)
}

// === tests ===

#[tokio::test]
async fn a_websocket_handshake_switches_and_bytes_flow_both_ways() {
    let upstream = RawUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let (mut ws, mut early, headers) = switch(
        sidecar.addr,
        &handshake(&format!("http://{up}/ws/chat?room=1"), &up.to_string()),
    )
    .await;

    // The client sees the upstream's 101 with what a WebSocket client checks.
    assert_eq!(headers["upgrade"], "websocket");
    assert_eq!(headers["connection"], "upgrade");
    assert_eq!(
        headers["sec-websocket-accept"],
        "accept-for-dGhlIHNhbXBsZSBub25jZQ=="
    );
    assert!(
        !headers.contains_key("keep-alive"),
        "hop-by-hop field relayed: {headers:?}"
    );

    // The upstream saw an origin-form upgrade with only the upgrade's hop-by-hop fields.
    let heads = upstream.heads();
    assert_eq!(heads.len(), 1);
    let head = &heads[0];
    assert_eq!(head.method, "GET");
    assert_eq!(head.target, "/ws/chat?room=1");
    assert_eq!(head.headers["host"], up.to_string());
    assert_eq!(head.headers["upgrade"], "websocket");
    assert_eq!(head.headers["connection"], "upgrade");
    assert_eq!(head.headers["sec-websocket-key"], "dGhlIHNhbXBsZSBub25jZQ==");
    assert_eq!(head.headers["sec-websocket-version"], "13");
    for gone in ["proxy-connection", "keep-alive"] {
        assert!(!head.headers.contains_key(gone), "{gone} forwarded");
    }

    // Upstream to client: the greeting that came in the same packet as the 101.
    assert_eq!(read_n(&mut ws, &mut early, GREETING.len()).await, GREETING);
    // Client to upstream and back, several times.
    for msg in [&b"hello"[..], b"frames are opaque here", &[0u8, 0x81, 0xff, 0x7f]] {
        ws.write_all(msg).await.unwrap();
        assert_eq!(read_n(&mut ws, &mut early, msg.len()).await, msg);
    }
    // Half-close from the client ends the upstream side, whose close comes back.
    ws.shutdown().await.unwrap();
    assert!(closes_within(&mut ws, Duration::from_secs(3)).await);
    assert!(eventually(Duration::from_secs(3), || upstream.open() == 0).await);
}

#[tokio::test]
async fn pooled_requests_are_unaffected_by_upgrades() {
    let upstream = RawUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let mut plain = RawClient::connect(sidecar.addr).await;
    assert_eq!(plain.get(&format!("http://{up}/plain")).await.text(), "ok");
    assert_eq!(upstream.accepted(), 1);

    let (mut ws, mut early, _) = switch(
        sidecar.addr,
        &handshake(&format!("http://{up}/ws"), &up.to_string()),
    )
    .await;
    assert_eq!(upstream.accepted(), 2, "the upgrade got a connection of its own");
    assert_eq!(read_n(&mut ws, &mut early, GREETING.len()).await, GREETING);

    // While the WebSocket is open, plain requests still reuse the pooled connection.
    for _ in 0..3 {
        assert_eq!(plain.get(&format!("http://{up}/plain")).await.text(), "ok");
        let mut other = RawClient::connect(sidecar.addr).await;
        assert_eq!(other.get(&format!("http://{up}/plain")).await.text(), "ok");
    }
    ws.write_all(b"still here").await.unwrap();
    assert_eq!(read_n(&mut ws, &mut early, 10).await, b"still here");
    drop(ws);
    assert!(eventually(Duration::from_secs(3), || upstream.open() == 1).await);
    assert_eq!(plain.get(&format!("http://{up}/plain")).await.text(), "ok");
    assert_eq!(upstream.accepted(), 2, "the pool dialed again");
}

#[tokio::test]
async fn a_refused_upgrade_is_relayed_as_a_normal_response() {
    let upstream = RawUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let host = up.to_string();
    let mut client = RawClient::connect(sidecar.addr).await;

    client
        .send_raw(handshake(&format!("http://{up}/reject"), &host).as_bytes())
        .await;
    let resp = client.read_response(false).await.expect("a response");
    assert_eq!(resp.status, 426);
    assert_eq!(resp.text(), "not a websocket\n");
    assert_eq!(resp.header("content-length"), Some("16"));
    assert_eq!(
        resp.header("x-egress-error"),
        None,
        "the upstream's answer, not the sidecar's"
    );
    assert_eq!(
        resp.header("upgrade"),
        None,
        "hop-by-hop fields of a non-101 are removed"
    );

    // The client connection stays usable: the response was framed as usual.
    assert_eq!(client.get(&format!("http://{up}/plain")).await.text(), "ok");

    client
        .send_raw(handshake(&format!("http://{up}/reject-chunked"), &host).as_bytes())
        .await;
    let resp = client.read_response(false).await.expect("a response");
    assert_eq!(resp.status, 426);
    assert_eq!(resp.text(), "nope");
    assert_eq!(client.get(&format!("http://{up}/plain")).await.text(), "ok");

    // Two dedicated connections and one pooled; the dedicated ones close after their answer.
    assert_eq!(upstream.accepted(), 3);
    assert!(
        eventually(Duration::from_secs(3), || upstream.open() == 1).await,
        "{} upstream connections open",
        upstream.open()
    );
}

#[tokio::test]
async fn upgrades_through_a_route_listener_use_the_upstream_host_and_addresses() {
    let upstream = RawUpstream::start().await;
    let port = upstream.addr.port();
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: ws\n    url: http://ws.internal:{port}\n    listen: 127.0.0.1:0\n    \
         addresses: [127.0.0.1:{port}]\n"
    ))
    .await;
    let route = sidecar.routes[0];
    let (mut ws, mut early, _) = switch(route, &handshake("/ws", &route.to_string())).await;
    assert_eq!(read_n(&mut ws, &mut early, GREETING.len()).await, GREETING);
    let head = &upstream.heads()[0];
    assert_eq!(head.target, "/ws");
    assert_eq!(head.headers["host"], format!("ws.internal:{port}"));
    ws.write_all(b"abc").await.unwrap();
    assert_eq!(read_n(&mut ws, &mut early, 3).await, b"abc");
}

#[tokio::test]
async fn a_client_that_leaves_before_the_101_closes_the_dedicated_connection() {
    let upstream = RawUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let up = upstream.addr;
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(handshake(&format!("http://{up}/hang"), &up.to_string()).as_bytes())
        .await;
    assert!(eventually(Duration::from_secs(3), || upstream.heads().len() == 1).await);
    assert_eq!(upstream.open(), 1);
    drop(client);
    assert!(
        eventually(Duration::from_secs(3), || upstream.open() == 0).await,
        "the dedicated connection outlived its client"
    );
}

#[tokio::test]
async fn idle_switched_connections_close_after_idle_timeout() {
    let upstream = RawUpstream::start().await;
    let sidecar = Sidecar::start("downstream:\n  idle_timeout: 300ms\n").await;
    let up = upstream.addr;
    let (mut ws, mut early, _) = switch(
        sidecar.addr,
        &handshake(&format!("http://{up}/ws"), &up.to_string()),
    )
    .await;
    assert_eq!(read_n(&mut ws, &mut early, GREETING.len()).await, GREETING);
    for _ in 0..6 {
        // The scenario: a client that pauses between bytes (not synchronisation).
        tokio::time::sleep(Duration::from_millis(100)).await;
        ws.write_all(b"x").await.unwrap();
        assert_eq!(read_n(&mut ws, &mut early, 1).await, b"x", "closed while busy");
    }
    let quiet_since = Instant::now();
    assert!(
        closes_within(&mut ws, Duration::from_secs(3)).await,
        "idle WebSocket kept open"
    );
    assert!(quiet_since.elapsed() >= Duration::from_millis(250));
    assert!(eventually(Duration::from_secs(3), || upstream.open() == 0).await);
}

#[tokio::test]
async fn upgrades_that_are_not_passed_through() {
    let upstream = RawUpstream::start().await;
    let up = upstream.addr;
    let sidecar = Sidecar::start("").await;

    // h2c asks for a connection-specific switch: the request goes through the pool as a plain
    // GET instead (a server may ignore Upgrade).
    let mut client = RawClient::connect(sidecar.addr).await;
    client
        .send_raw(
            format!(
                "GET http://{up}/plain HTTP/1.1\r\nHost: {up}\r\nConnection: Upgrade, HTTP2-Settings\r\n\
                 Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!((resp.status, resp.text().as_str()), (200, "ok"));
    let head = &upstream.heads()[0];
    for gone in ["upgrade", "connection", "http2-settings"] {
        assert!(
            !head.headers.contains_key(gone),
            "{gone} forwarded: {:?}",
            head.headers
        );
    }

    // An upgrade with a body is sent as a plain request too.
    client
        .send_raw(
            format!(
                "POST http://{up}/plain HTTP/1.1\r\nHost: {up}\r\nConnection: Upgrade\r\n\
                 Upgrade: websocket\r\nContent-Length: 3\r\n\r\nabc"
            )
            .as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!((resp.status, resp.text().as_str()), (200, "ok"));
    assert!(!upstream.heads()[1].headers.contains_key("upgrade"));
    assert_eq!(upstream.accepted(), 1, "both went over the pooled connection");
}

#[tokio::test]
async fn an_upgrade_to_a_tls_upstream_goes_over_tls() {
    let ca = support::TestCa::new();
    let dir = support::TempDir::new();
    let ca_file = ca.write_pem(&dir);
    // The upstream also offers h2: the dedicated connection must still ask for HTTP/1.1.
    let upstream = RawUpstream::start_tls(ca.server(&["wss.test"], false, &[b"h2", b"http/1.1"])).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: secure\n    url: https://wss.test:{port}\n    aliases: [wss.test:80]\n    \
         addresses: [{addr}]\n    tls: {{ ca_file: {ca} }}\n",
        port = upstream.addr.port(),
        addr = upstream.addr,
        ca = ca_file.display()
    ))
    .await;
    let (mut ws, mut early, headers) =
        switch(sidecar.addr, &handshake("http://wss.test/ws", "wss.test")).await;
    assert_eq!(headers["upgrade"], "websocket");
    assert_eq!(read_n(&mut ws, &mut early, GREETING.len()).await, GREETING);
    ws.write_all(b"over tls").await.unwrap();
    assert_eq!(read_n(&mut ws, &mut early, 8).await, b"over tls");
    let head = &upstream.heads()[0];
    assert_eq!(head.target, "/ws");
    assert_eq!(head.headers["host"], format!("wss.test:{}", upstream.addr.port()));
}
