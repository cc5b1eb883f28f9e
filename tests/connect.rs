//! CONNECT tunnels (`HTTPS_PROXY` clients): curl through the sidecar to a TLS server, raw
//! bytes both ways with half-close, every refusal with its documented status and kind, and the
//! idle deadline.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use support::{
    closes_within, eventually, read_n, FakeUpstream, RawClient, RawResponse, Sidecar, TempDir, TestCa,
};

// === helpers ===

/// A TCP server that echoes every byte and, when the client finishes sending, finishes too.
struct EchoServer {
    addr: SocketAddr,
    open: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl EchoServer {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let (o, a) = (open.clone(), accepted.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let o = o.clone();
                tokio::spawn(async move {
                    let (mut rd, mut wr) = stream.split();
                    if tokio::io::copy(&mut rd, &mut wr).await.is_ok() {
                        let _ = wr.shutdown().await;
                        // Wait for the peer's close so `open` counts a really closed socket.
                        let mut rest = [0u8; 64];
                        while let Ok(n) = rd.read(&mut rest).await {
                            if n == 0 {
                                break;
                            }
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        EchoServer {
            addr,
            open,
            accepted,
            task,
        }
    }

    fn open(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }

    fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends a CONNECT for `target` (plus `extra` bytes in the same write) and reads the answer's
/// head. A 200 leaves the client's stream at the first tunnelled byte (bytes read past the head
/// are returned); anything else is read whole.
async fn connect(
    sidecar: SocketAddr,
    target: &str,
    extra: &[u8],
) -> (RawClient, Result<Vec<u8>, RawResponse>) {
    let mut client = RawClient::connect(sidecar).await;
    let resp = tokio::time::timeout(
        Duration::from_secs(5),
        client.open_tunnel(target, "User-Agent: test\r\n", extra),
    )
    .await
    .expect("answered within 5s")
    .expect("a response, not a bare close");
    if resp.status != 200 {
        return (client, Err(resp));
    }
    assert!(
        resp.headers.is_empty(),
        "a tunnel's 200 has no fields: {:?}",
        resp.headers
    );
    let early = client.take_buffered();
    (client, Ok(early))
}

async fn output(cmd: &mut tokio::process::Command) -> String {
    let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .expect("curl finished within 30s")
        .unwrap();
    assert!(
        out.status.success(),
        "curl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A CONNECT the sidecar must refuse, and how.
struct Refusal<'a> {
    what: &'a str,
    sidecar: &'a Sidecar,
    target: String,
    status: u16,
    kind: &'a str,
    /// Phrases the body must contain.
    needles: &'a [&'a str],
}

// === tests ===

#[tokio::test]
async fn curl_tunnels_through_https_proxy_to_a_tls_server() {
    if !support::curl_or_skip() {
        return;
    }
    let ca = TestCa::new();
    let upstream = FakeUpstream::start_tls(ca.server(&["localhost"], false, &[b"http/1.1"])).await;
    let port = upstream.addr.port();
    let sidecar = Sidecar::start(&format!("policy:\n  connect_ports: [{port}]\n")).await;
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let url = format!("https://localhost:{port}/");

    // HTTPS_PROXY, as applications set it.
    let text = output(
        support::curl()
            .args(["-sS", "--cacert"])
            .arg(&ca_file)
            .args(["-w", "\n%{http_connect} %{http_code}"])
            .arg(&url)
            .env("https_proxy", format!("http://{}", sidecar.addr)),
    )
    .await;
    assert_eq!(
        text, "ok\n200 200",
        "body, then the CONNECT status and the response status"
    );

    // -x, and a 1 MiB upload answered with its length: bulk bytes both ways.
    let upload = dir.path.join("upload.bin");
    std::fs::write(&upload, vec![b'u'; 1 << 20]).unwrap();
    let text = output(
        support::curl()
            .args(["-sS", "--cacert"])
            .arg(&ca_file)
            .args(["-x", &format!("http://{}", sidecar.addr)])
            .arg("--data-binary")
            .arg(format!("@{}", upload.display()))
            .arg(format!("{url}drain")),
    )
    .await;
    assert_eq!(text, (1u64 << 20).to_string());

    // The TLS server saw both requests, through its own TLS session: the sidecar only moved
    // bytes (the Host is what curl sent, not a rewritten one).
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0].headers["host"], format!("localhost:{port}"));
    assert_eq!(seen[1].body_len, 1 << 20);
    assert!(eventually(Duration::from_secs(3), || upstream.open() == 0).await);
}

#[tokio::test]
async fn raw_tunnel_moves_bytes_both_ways_and_passes_half_close() {
    let echo = EchoServer::start().await;
    let sidecar = Sidecar::start(&format!("policy:\n  connect_ports: [{}]\n", echo.addr.port())).await;
    // Bytes sent right behind the CONNECT head (as TLS clients do with their ClientHello) go
    // first.
    let (client, answer) = connect(sidecar.addr, &echo.addr.to_string(), b"early|").await;
    let mut early = answer.expect("200 Connection Established");
    let mut stream = client.stream;
    assert_eq!(read_n(&mut stream, &mut early, 6).await, b"early|");

    // 4 MiB each way at once: the 8 KiB buffers and backpressure, with no byte lost or
    // reordered.
    let payload: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
    let (mut rd, mut wr) = stream.into_split();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        wr.write_all(&sent).await.unwrap();
        // Half-close: the echo server sees end-of-file only through the tunnel.
        wr.shutdown().await.unwrap();
        wr
    });
    let m = support::scrape(sidecar.admin).await;
    assert_eq!(
        support::value(&m, "egress_tunnels_active", &[("kind", "connect")]),
        1.0
    );
    let mut echoed = Vec::with_capacity(payload.len());
    tokio::time::timeout(Duration::from_secs(20), rd.read_to_end(&mut echoed))
        .await
        .expect("echo and end-of-file within 20s")
        .unwrap();
    assert_eq!(echoed.len(), payload.len());
    assert!(echoed == payload, "echoed bytes differ");
    let _wr = writer.await.unwrap();
    assert!(
        eventually(Duration::from_secs(3), || echo.open() == 0).await,
        "the upstream side of the tunnel stayed open"
    );
    assert_eq!(echo.accepted(), 1);
    let active =
        |m: &prometheus_parse::Scrape| support::value(m, "egress_tunnels_active", &[("kind", "connect")]);
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(3), |m| active(m) == 0.0).await;
    assert_eq!(active(&m), 0.0, "the tunnel gauge returns to 0");
    assert_eq!(
        support::value(&m, "egress_tunnels_opened_total", &[("kind", "connect")]),
        1.0
    );
}

#[tokio::test]
async fn refused_connects_get_documented_errors_and_close() {
    let echo = EchoServer::start().await;
    let port = echo.addr.port();
    let target = echo.addr.to_string();
    let refusing = support::RefusingPort::new();
    let dead = refusing.port();
    let open = Sidecar::start_with_route(|route_port| {
        format!(
            "upstreams:\n  - name: routed\n    url: http://routed.example\n    listen: 127.0.0.1:{route_port}\n\
             policy:\n  connect_ports: [{port}, {dead}, {route_port}]\n"
        )
    })
    .await;
    let route_port = open.routes[0].port();
    let disabled = Sidecar::start(&format!("policy:\n  connect: false\n  connect_ports: [{port}]\n")).await;
    let denied = Sidecar::start(&format!(
        "policy:\n  deny_hosts: [127.0.0.0/8]\n  connect_ports: [{port}]\n"
    ))
    .await;
    let not_allowed = Sidecar::start(&format!(
        "policy:\n  allow_hosts: [\"*.example.com\"]\n  connect_ports: [{port}]\n"
    ))
    .await;
    // Without inspection a CONNECT to a port outside connect_ports is refused, as before
    // issue 20; with it (the default) it is answered here (tests/tunnel.rs).
    let default_ports = Sidecar::start("policy:\n  connect_inspect: false\n").await;

    let refusal = |what, sidecar, target: &str, status, kind, needles| Refusal {
        what,
        sidecar,
        target: target.to_owned(),
        status,
        kind,
        needles,
    };
    let own = format!("127.0.0.1:{route_port}");
    let own_by_name = format!("localhost:{route_port}");
    let dead_target = format!("127.0.0.1:{dead}");
    const HINT: &str = "send plain http:// requests through the sidecar";
    let cases = [
        refusal(
            "port outside connect_ports",
            &default_ports,
            &target,
            403,
            "denied",
            &["policy.connect_ports: [443]", HINT],
        ),
        refusal(
            "CONNECT disabled",
            &disabled,
            &target,
            403,
            "denied",
            &["policy.connect: false", HINT],
        ),
        refusal(
            "host in deny_hosts",
            &denied,
            &target,
            403,
            "denied",
            &["is denied by policy.deny_hosts"],
        ),
        refusal(
            "host not in allow_hosts",
            &not_allowed,
            &target,
            403,
            "denied",
            &["is not in policy.allow_hosts"],
        ),
        refusal(
            "the sidecar's own listener",
            &open,
            &own,
            508,
            "loop",
            &["is this sidecar"],
        ),
        refusal(
            "the sidecar's own listener by name",
            &open,
            &own_by_name,
            508,
            "loop",
            &["is this sidecar"],
        ),
        refusal(
            "a port nobody listens on",
            &open,
            &dead_target,
            502,
            "connect_failed",
            &["connecting to 127.0.0.1:"],
        ),
        refusal(
            "no port",
            &open,
            "127.0.0.1",
            400,
            "bad_request",
            &["needs a port"],
        ),
    ];
    for Refusal {
        what,
        sidecar,
        target,
        status,
        kind,
        needles,
    } in cases
    {
        let (mut client, answer) = connect(sidecar.addr, &target, b"").await;
        let resp = answer.expect_err(what);
        let body = resp.assert_sidecar_error(status, kind, what);
        for needle in needles {
            assert!(body.contains(needle), "{what}: {needle:?} not in {body:?}");
        }
        assert_eq!(resp.header("connection"), Some("close"), "{what}");
        assert!(
            client.is_closed_within(Duration::from_secs(3)).await,
            "{what}: connection left open"
        );
    }

    // A CONNECT with a body is malformed (the bytes after the head belong to the tunnel).
    let mut client = RawClient::connect(open.addr).await;
    client
        .send_raw(
            format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nContent-Length: 5\r\n\r\nhello")
                .as_bytes(),
        )
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(resp.status, 400, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("bad_request"));

    assert_eq!(echo.accepted(), 0, "a refused CONNECT reached the target");
}

#[tokio::test]
async fn a_connect_that_hangs_answers_504_connect_timeout() {
    let blackhole = support::Blackhole::start().await;
    let addr = blackhole.addr;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  connect_timeout: 300ms\npolicy:\n  connect_ports: [{}]\n",
        addr.port()
    ))
    .await;
    let started = Instant::now();
    let (_client, answer) = connect(sidecar.addr, &addr.to_string(), b"").await;
    let resp = answer.expect_err("no tunnel");
    assert_eq!(resp.status, 504, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("connect_timeout"));
    assert!(resp.text().contains("connect_timeout (300ms)"), "{}", resp.text());
    assert!(started.elapsed() < Duration::from_secs(3));
    drop(blackhole);
}

#[tokio::test]
async fn idle_tunnels_close_after_idle_timeout_and_busy_ones_stay() {
    let echo = EchoServer::start().await;
    let sidecar = Sidecar::start(&format!(
        "downstream:\n  idle_timeout: 300ms\npolicy:\n  connect_ports: [{}]\n",
        echo.addr.port()
    ))
    .await;

    // Idle: both sockets close once 300 ms pass without a byte, not before.
    let (client, answer) = connect(sidecar.addr, &echo.addr.to_string(), b"ping").await;
    let mut early = answer.expect("tunnel");
    let mut idle = client.stream;
    assert_eq!(read_n(&mut idle, &mut early, 4).await, b"ping");
    let quiet_since = Instant::now();
    assert!(
        closes_within(&mut idle, Duration::from_secs(3)).await,
        "idle tunnel kept open"
    );
    let lived = quiet_since.elapsed();
    assert!(lived >= Duration::from_millis(250), "closed after only {lived:?}");
    assert!(
        eventually(Duration::from_secs(3), || echo.open() == 0).await,
        "the idle tunnel's upstream socket stayed open"
    );

    // Busy: a byte every 100 ms for 1.2 s, four times the idle timeout.
    let (client, answer) = connect(sidecar.addr, &echo.addr.to_string(), b"").await;
    let mut early = answer.expect("tunnel");
    let mut busy = client.stream;
    for i in 0..12u8 {
        // The scenario: a client that pauses between bytes (not synchronisation).
        tokio::time::sleep(Duration::from_millis(100)).await;
        busy.write_all(&[i]).await.unwrap();
        assert_eq!(
            read_n(&mut busy, &mut early, 1).await,
            [i],
            "tunnel closed while busy"
        );
    }
    // Then it idles out too.
    assert!(closes_within(&mut busy, Duration::from_secs(3)).await);
    assert!(eventually(Duration::from_secs(3), || echo.open() == 0).await);
    assert_eq!(echo.accepted(), 2);
}

#[tokio::test]
async fn an_opaque_connect_to_a_configured_upstream_dials_its_addresses() {
    // `secure.test` resolves nowhere: the tunnel can only reach the echo server through the
    // upstream's static addresses, the first of which refuses (happy eyeballs moves on).
    let echo = EchoServer::start().await;
    let refusing = support::RefusingPort::new();
    let port = echo.addr.port();
    let sidecar = Sidecar::start(&format!(
        "policy:\n  connect_ports: [{port}]\nupstreams:\n  - name: secure\n    url: https://secure.test:{port}\n    \
         addresses: [{}, {}]\n",
        refusing.addr, echo.addr
    ))
    .await;
    let (client, answer) = connect(sidecar.addr, &format!("secure.test:{port}"), b"ping").await;
    let mut early = answer.expect("200 Connection Established through the configured addresses");
    let mut stream = client.stream;
    assert_eq!(read_n(&mut stream, &mut early, 4).await, b"ping");
    assert_eq!(echo.accepted(), 1);
    // A name that is no configured upstream goes to the resolver, which knows no such host.
    let (_client, answer) = connect(sidecar.addr, &format!("other.invalid:{port}"), b"").await;
    let refused = answer.expect_err("an unresolvable tunnel target is refused");
    // NXDOMAIN, or no name server answering within connect_timeout on a machine without one.
    let kind = refused.header("x-egress-error");
    assert!(
        matches!(
            (refused.status, kind),
            (502, Some("connect_failed")) | (504, Some("connect_timeout"))
        ),
        "{} {kind:?}: {}",
        refused.status,
        refused.text()
    );
}
