//! Plain HTTP inside CONNECT (issue 20): a CONNECT to a port outside `policy.connect_ports` is
//! answered by the sidecar, and what the client sends inside is served through the pool when
//! it is HTTP/1.x or h2c. Driven with `curl -p` (`--proxytunnel`) and raw clients against a
//! counting fake upstream: the requests arrive in origin-form with the CONNECT authority as
//! `Host`, share a few pooled upstream connections, and anything else inside the tunnel is
//! closed without reaching an upstream, counted in `egress_tunnels_refused_total{reason}`.
//! `policy.connect_inspect: false` restores the 403, and a port in `connect_ports` keeps the
//! opaque tunnel (one upstream connection per client connection).

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use support::{closes_within, FakeUpstream, RawClient, RawResponse, Sidecar};

// === helpers ===

/// curl ignoring any `.curlrc`, with no proxy settings inherited, through `sidecar` with
/// `--proxytunnel`: every URL is sent inside a CONNECT.
fn curl_p(sidecar: SocketAddr) -> Command {
    let mut cmd = support::curl();
    cmd.args(["-sS", "-p", "-x", &format!("http://{sidecar}")]);
    cmd
}

/// Runs curl to completion (within 30 s): (success, stdout, stderr).
async fn run(mut cmd: Command) -> (bool, String, String) {
    let what = format!("{:?}", cmd.as_std());
    let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 30s"))
        .unwrap_or_else(|e| panic!("running {what}: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `-w` for each URL: its body, then "<CONNECT status> <status> <new connections>".
const WRITE_OUT: &str = "|%{http_connect} %{http_code} %{num_connects}\n";

/// Sends `CONNECT target` (plus `extra` in the same write) and reads the answer's head: the
/// client stream is then at the first byte from inside the tunnel.
async fn connect(sidecar: SocketAddr, target: &str, extra: &[u8]) -> RawClient {
    let mut client = RawClient::connect(sidecar).await;
    let mut raw = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").into_bytes();
    raw.extend_from_slice(extra);
    client.send_raw(&raw).await;
    let (status, headers) = tokio::time::timeout(Duration::from_secs(5), client.read_head())
        .await
        .expect("CONNECT answered within 5s");
    assert_eq!(status, 200, "CONNECT {target}: {headers:?}");
    assert!(headers.is_empty(), "a tunnel's 200 has no fields: {headers:?}");
    assert!(
        client.take_buffered().is_empty(),
        "nothing comes from inside the tunnel before the client speaks"
    );
    client
}

/// Sends an origin-form GET for `path` with `Host: host` and reads the response.
async fn get_inside(client: &mut RawClient, host: &str, path: &str) -> RawResponse {
    client
        .send_raw(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    tokio::time::timeout(Duration::from_secs(10), client.read_response(false))
        .await
        .expect("a response within 10s")
        .expect("a response, not a close")
}

/// `egress_tunnels_opened_total`, `egress_tunnels_active` (by `kind`) and
/// `egress_tunnels_refused_total` (by `reason`) from one scrape.
struct Tunnels(prometheus_parse::Scrape);

impl Tunnels {
    async fn scrape(sidecar: &Sidecar) -> Self {
        Tunnels(support::scrape(sidecar.admin).await)
    }

    /// Scrapes until `cond` holds (up to 5 s) and returns the last scrape either way.
    async fn until(sidecar: &Sidecar, cond: impl Fn(&Tunnels) -> bool) -> Self {
        let fetch = || async { Tunnels::scrape(sidecar).await };
        support::fetch_until(Duration::from_secs(5), fetch, |t| cond(t)).await
    }

    fn opened(&self, kind: &str) -> f64 {
        support::value(&self.0, "egress_tunnels_opened_total", &[("kind", kind)])
    }
    fn active(&self, kind: &str) -> f64 {
        support::value(&self.0, "egress_tunnels_active", &[("kind", kind)])
    }
    fn refused(&self, reason: &str) -> f64 {
        support::value(&self.0, "egress_tunnels_refused_total", &[("reason", reason)])
    }
    fn refused_total(&self) -> f64 {
        support::value(&self.0, "egress_tunnels_refused_total", &[])
    }
}

/// HTTP/2 frame type GOAWAY and error code FRAME_SIZE_ERROR (RFC 9113 §6.8, §7).
const GOAWAY: u8 = 0x7;
const FRAME_SIZE_ERROR: u32 = 0x6;

/// Reads until the peer closes (within 3 s), returning what it sent.
async fn read_to_close(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(3), async {
        let mut tmp = [0u8; 4096];
        loop {
            match stream.read(&mut tmp).await {
                Ok(0) | Err(_) => return,
                Ok(n) => out.extend_from_slice(&tmp[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "connection left open; read {out:?}");
    out
}

/// HTTP/2 frames in `bytes`: (type, payload).
fn h2_frames(mut bytes: &[u8]) -> Vec<(u8, Vec<u8>)> {
    let mut frames = Vec::new();
    while bytes.len() >= 9 {
        let len = usize::from(bytes[0]) << 16 | usize::from(bytes[1]) << 8 | usize::from(bytes[2]);
        let Some(payload) = bytes.get(9..9 + len) else {
            break;
        };
        frames.push((bytes[3], payload.to_vec()));
        bytes = &bytes[9 + len..];
    }
    frames
}

// === plain HTTP inside the tunnel ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_p_requests_go_in_origin_form_through_one_pooled_connection() {
    if !support::curl_or_skip() {
        return;
    }
    let upstream = FakeUpstream::start().await;
    let authority = upstream.addr.to_string();
    // The defaults: connect_ports [443], connect_inspect true.
    let sidecar = Sidecar::start("").await;

    // Three URLs in one curl run: one CONNECT, three requests on it.
    let mut cmd = curl_p(sidecar.addr);
    for path in ["/path?q=1", "/second", "/third"] {
        cmd.args(["-w", WRITE_OUT])
            .arg(format!("http://{authority}{path}"));
    }
    let (ok, out, err) = run(cmd).await;
    assert!(ok, "curl -p failed: {err}\n{out}");
    assert_eq!(
        out, "ok|200 200 1\nok|000 200 0\nok|000 200 0\n",
        "each URL: body, CONNECT status, status, new connections (one for the run)"
    );

    // A second run: a second tunnel, served by the same pooled upstream connection.
    let mut cmd = curl_p(sidecar.addr);
    cmd.args(["-w", WRITE_OUT])
        .arg(format!("http://{authority}/again"));
    let (ok, out, err) = run(cmd).await;
    assert!(ok, "curl -p failed: {err}\n{out}");
    assert_eq!(out, "ok|200 200 1\n");

    let seen = upstream.seen();
    let paths: Vec<String> = seen.iter().map(|s| s.uri.clone()).collect();
    assert_eq!(
        paths,
        ["/path?q=1", "/second", "/third", "/again"],
        "the upstream sees origin-form"
    );
    for s in &seen {
        assert_eq!(s.method, "GET");
        assert_eq!(s.version, http::Version::HTTP_11);
        assert_eq!(
            s.headers.get("host").and_then(|h| h.to_str().ok()),
            Some(authority.as_str()),
            "Host is the CONNECT authority: {:?}",
            s.headers
        );
        assert!(
            !s.headers.contains_key("proxy-connection"),
            "hop-by-hop header reached the upstream: {:?}",
            s.headers
        );
    }
    assert_eq!(
        upstream.accepted(),
        1,
        "4 requests in 2 tunnels share one pooled upstream connection"
    );
    let t = Tunnels::until(&sidecar, |t| t.active("connect_http") == 0.0).await;
    assert_eq!(t.opened("connect_http"), 2.0, "one tunnel per curl run");
    assert_eq!(t.active("connect_http"), 0.0, "closed with curl's connections");
    assert_eq!(t.opened("connect"), 0.0, "no opaque tunnel");
    assert_eq!(t.refused_total(), 0.0);
    assert_eq!(
        support::value(&t.0, "egress_pool_reused_total", &[]),
        3.0,
        "every request after the first reused the pooled connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_concurrent_tunnels_share_a_pool_of_four() {
    const CLIENTS: usize = 30;
    const REQUESTS: usize = 3;
    let upstream = FakeUpstream::start().await;
    let authority = upstream.addr.to_string();
    let sidecar = Sidecar::start("defaults:\n  pool: { max_connections: 4 }\n").await;

    // Every client has its tunnel before any sends a request, so all 30 are open at once.
    let ready = Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let (ready, authority) = (ready.clone(), authority.clone());
            let addr = sidecar.addr;
            tokio::spawn(async move {
                let mut client = connect(addr, &authority, b"").await;
                ready.wait().await;
                let mut statuses = Vec::new();
                for j in 0..REQUESTS {
                    let resp = get_inside(&mut client, &authority, &format!("/c{i}/r{j}")).await;
                    assert_eq!(resp.text(), "ok", "client {i} request {j}");
                    statuses.push(resp.status);
                }
                statuses
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for client in clients {
        statuses.extend(client.await.unwrap());
    }
    assert_eq!(statuses, vec![200; CLIENTS * REQUESTS]);
    assert_eq!(upstream.requests(), CLIENTS * REQUESTS);
    println!(
        "{CLIENTS} tunnels, {} requests: {} upstream connections accepted, at most {} open at once",
        CLIENTS * REQUESTS,
        upstream.accepted(),
        upstream.peak()
    );
    assert!(
        upstream.accepted() <= 4,
        "{} tunnels took {} upstream connections; pool.max_connections is 4",
        CLIENTS,
        upstream.accepted()
    );
    let t = Tunnels::scrape(&sidecar).await;
    assert_eq!(t.opened("connect_http"), CLIENTS as f64);
    assert_eq!(t.refused_total(), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_h2_prior_knowledge_through_the_tunnel_is_served_as_h2c() {
    if !support::curl_or_skip() {
        return;
    }
    let upstream = FakeUpstream::start().await;
    let authority = upstream.addr.to_string();
    let sidecar = Sidecar::start("").await;

    // One URL per run: curl 7.88 fails to reuse a prior-knowledge HTTP/2 connection for a
    // second URL of the same run ("Error in the HTTP2 framing layer", with or without a proxy;
    // curl/curl#10634, fixed in 8.0).
    for path in ["/h2/one", "/h2/two"] {
        let mut cmd = curl_p(sidecar.addr);
        cmd.arg("--http2-prior-knowledge")
            .args(["-w", "|%{http_connect} %{http_version} %{http_code}\n"])
            .arg(format!("http://{authority}{path}"));
        let (ok, out, err) = run(cmd).await;
        assert!(ok, "curl --http2-prior-knowledge -p failed: {err}\n{out}");
        assert_eq!(
            out, "ok|200 2 200\n",
            "{path}: an HTTP/2 response inside the tunnel"
        );
    }
    assert_eq!(
        upstream.accepted(),
        1,
        "two tunnels one after the other share one pooled upstream connection"
    );

    // Streams at once on one tunnel (hyper's client over a raw CONNECT).
    let tunnel = connect(sidecar.addr, &authority, b"").await;
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tunnel.stream),
    )
    .await
    .expect("h2 handshake inside the tunnel");
    tokio::spawn(conn);
    let streams: Vec<_> = (0..3)
        .map(|i| {
            let mut sender = sender.clone();
            let uri = format!("http://{authority}/h2/stream{i}");
            tokio::spawn(async move {
                let req = http::Request::get(uri)
                    .body(http_body_util::Empty::<bytes::Bytes>::new())
                    .unwrap();
                let resp = sender.send_request(req).await.expect("a response");
                let status = resp.status();
                let body = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap();
                (status.as_u16(), body.to_bytes())
            })
        })
        .collect();
    for stream in streams {
        assert_eq!(stream.await.unwrap(), (200, bytes::Bytes::from_static(b"ok")));
    }
    // A stream naming another authority is refused, the others on the connection unharmed.
    let req = http::Request::get("http://other.test/h2/elsewhere")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = sender.clone().send_request(req).await.expect("a response");
    assert_eq!(resp.status(), 400);
    assert_eq!(
        resp.headers().get("x-egress-error").and_then(|v| v.to_str().ok()),
        Some("bad_request")
    );
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("inside the CONNECT tunnel to"), "{body}");
    // No sender left: hyper's client ends the connection, and so the tunnel.
    drop(sender);

    let seen = upstream.seen();
    let mut paths: Vec<String> = seen.iter().map(|s| s.path()).collect();
    paths[2..].sort();
    assert_eq!(
        paths,
        ["/h2/one", "/h2/two", "/h2/stream0", "/h2/stream1", "/h2/stream2"]
    );
    for s in &seen {
        assert_eq!(s.authority(), authority, "the CONNECT authority");
    }
    assert!(
        upstream.accepted() <= 3,
        "3 streams at once need at most 3 HTTP/1.1 upstream connections, took {}",
        upstream.accepted()
    );
    let t = Tunnels::until(&sidecar, |t| t.active("connect_h2") == 0.0).await;
    assert_eq!(t.opened("connect_h2"), 3.0, "two curl runs and the hyper client");
    assert_eq!(t.active("connect_h2"), 0.0);
    assert_eq!(t.opened("connect_http"), 0.0);
    assert_eq!(t.refused_total(), 0.0);
}

// === what is not served ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anything_but_plain_http_inside_is_closed_counted_and_reaches_no_upstream() {
    let upstream = FakeUpstream::start().await;
    let authority = upstream.addr.to_string();
    let sidecar = Sidecar::start("downstream:\n  header_read_timeout: 300ms\n").await;
    let closed = |what: &'static str| move |closed: bool| assert!(closed, "{what}: connection left open");

    // Junk after the 200.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    client.send_raw(&[0x00, 0x01, 0x02, 0xff, b'\r', b'\n']).await;
    closed("junk")(closes_within(&mut client.stream, Duration::from_secs(3)).await);
    let t = Tunnels::until(&sidecar, |t| t.refused("not_http") == 1.0).await;
    assert_eq!(t.refused("not_http"), 1.0, "junk after the 200");

    // Junk in the same write as the CONNECT head (already read with it).
    let mut client = connect(sidecar.addr, &authority, b"\x00junk").await;
    closed("early junk")(closes_within(&mut client.stream, Duration::from_secs(3)).await);
    let t = Tunnels::until(&sidecar, |t| t.refused("not_http") == 2.0).await;
    assert_eq!(t.refused("not_http"), 2.0, "junk right behind the CONNECT head");

    // A lower-case method is not HTTP either.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    client
        .send_raw(format!("get / HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await;
    closed("lower-case method")(closes_within(&mut client.stream, Duration::from_secs(3)).await);
    let t = Tunnels::until(&sidecar, |t| t.refused("not_http") == 3.0).await;
    assert_eq!(t.refused("not_http"), 3.0, "a lower-case request line");

    // A request naming another authority: 400, never rerouted.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    client
        .send_raw(b"GET http://other.test/ HTTP/1.1\r\nHost: other.test\r\n\r\n")
        .await;
    let resp = client.read_response(false).await.expect("a 400, not a close");
    let body = resp.assert_sidecar_error(400, "bad_request", "absolute-form to another authority");
    assert!(
        body.contains(&format!("inside the CONNECT tunnel to {authority}")),
        "{body}"
    );
    drop(client);
    // The tunnel carries plain HTTP: `https://` naming its own authority is refused too.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    client
        .send_raw(format!("GET https://{authority}/ HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await;
    let resp = client.read_response(false).await.expect("a 400, not a close");
    resp.assert_sidecar_error(400, "bad_request", "https:// inside a plain tunnel");
    drop(client);

    // A TLS ClientHello to a port outside connect_ports.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    client
        .send_raw(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03])
        .await;
    closed("TLS")(closes_within(&mut client.stream, Duration::from_secs(3)).await);
    let t = Tunnels::until(&sidecar, |t| t.refused("tls_port_not_allowed") == 1.0).await;
    assert_eq!(t.refused("tls_port_not_allowed"), 1.0, "a ClientHello");

    // The HTTP/2 preface, then junk instead of a SETTINGS frame: hyper's h2 server ends it.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    bytes.extend_from_slice(&[0xff; 64]);
    client.send_raw(&bytes).await;
    let answer = read_to_close(&mut client.stream).await;
    let frames = h2_frames(&answer);
    let goaway = frames.iter().find(|(kind, _)| *kind == GOAWAY);
    let code = goaway.map(|(_, payload)| u32::from_be_bytes(payload[4..8].try_into().unwrap()));
    assert_eq!(
        code,
        Some(FRAME_SIZE_ERROR),
        "h2 junk: a GOAWAY(FRAME_SIZE_ERROR) before the close; frames {frames:?}"
    );
    let t = Tunnels::until(&sidecar, |t| t.refused("h2_error") == 1.0).await;
    assert_eq!(t.opened("connect_h2"), 1.0, "the preface is served as h2c");
    assert_eq!(t.active("connect_h2"), 0.0, "and closed after the junk");
    assert_eq!(
        t.refused("h2_error"),
        1.0,
        "counted as an h2c connection ended in error"
    );

    // Nothing at all: closed after header_read_timeout.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    let waited = Instant::now();
    closed("silent")(closes_within(&mut client.stream, Duration::from_secs(3)).await);
    let waited = waited.elapsed();
    assert!(
        waited >= Duration::from_millis(250),
        "closed after only {waited:?}"
    );
    let t = Tunnels::until(&sidecar, |t| t.refused("no_request") == 1.0).await;
    assert_eq!(t.refused("no_request"), 1.0, "a silent client");
    // A client that closes without a byte counts the same.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    client.stream.shutdown().await.unwrap();
    let t = Tunnels::until(&sidecar, |t| t.refused("no_request") == 2.0).await;
    assert_eq!(t.refused("no_request"), 2.0, "a client that closed");

    let t = Tunnels::until(&sidecar, |t| t.active("connect_http") == 0.0).await;
    assert_eq!(t.refused_total(), 7.0, "{:?}", t.0.samples);
    assert_eq!(t.opened("connect_http"), 2.0, "the two 400s were served tunnels");
    assert_eq!(t.active("connect_http"), 0.0);
    assert_eq!(t.opened("connect"), 0.0);
    assert_eq!(upstream.accepted(), 0, "bad input reached the upstream");
}

// === the opaque tunnel, and inspection off ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_inspect_false_restores_the_403() {
    if !support::curl_or_skip() {
        return;
    }
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("policy: { connect_inspect: false }\n").await;
    let mut cmd = curl_p(sidecar.addr);
    cmd.args(["-w", "%{http_connect}"])
        .arg(format!("http://{}/", upstream.addr));
    let (ok, out, err) = run(cmd).await;
    assert!(!ok, "curl -p succeeded without inspection: {out}");
    assert!(
        err.contains("CONNECT tunnel failed, response 403"),
        "curl's error: {err}"
    );
    assert_eq!(out, "403");
    assert_eq!(upstream.accepted(), 0);
    let t = Tunnels::scrape(&sidecar).await;
    assert_eq!(t.opened("connect_http") + t.opened("connect"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_in_connect_ports_keeps_the_opaque_tunnel() {
    if !support::curl_or_skip() {
        return;
    }
    let upstream = FakeUpstream::start().await;
    let authority = upstream.addr.to_string();
    let sidecar = Sidecar::start(&format!(
        "policy: {{ connect_ports: [{}] }}\n",
        upstream.addr.port()
    ))
    .await;
    for run_no in 0..2 {
        let mut cmd = curl_p(sidecar.addr);
        for path in ["/a", "/b"] {
            cmd.args(["-w", WRITE_OUT])
                .arg(format!("http://{authority}{path}"));
        }
        let (ok, out, err) = run(cmd).await;
        assert!(ok, "run {run_no}: curl -p failed: {err}\n{out}");
        assert_eq!(out, "ok|200 200 1\nok|000 200 0\n", "run {run_no}");
    }
    assert_eq!(
        upstream.accepted(),
        2,
        "spliced: one upstream connection per client connection"
    );
    assert_eq!(upstream.requests(), 4);
    let t = Tunnels::until(&sidecar, |t| t.active("connect") == 0.0).await;
    assert_eq!(t.opened("connect"), 2.0);
    assert_eq!(t.opened("connect_http"), 0.0);
}

/// A keep-alive tunnel stays one tunnel however many requests it carries; requests without a
/// `Host` or with a different one still go to the CONNECT authority.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_inside_go_to_the_connect_authority_whatever_their_host() {
    let upstream = FakeUpstream::start().await;
    let authority = upstream.addr.to_string();
    let sidecar = Sidecar::start("").await;
    let mut client = connect(sidecar.addr, &authority, b"").await;
    let resp = get_inside(&mut client, &authority, "/one").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    client
        .send_raw(format!("GET http://{authority}/two HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await;
    let resp = client.read_response(false).await.unwrap();
    assert_eq!(
        resp.status,
        200,
        "absolute-form naming the tunnel: {}",
        resp.text()
    );
    let resp = get_inside(&mut client, "elsewhere.test", "/three").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    client.stream.shutdown().await.unwrap();
    assert!(closes_within(&mut client.stream, Duration::from_secs(3)).await);

    let seen = upstream.seen();
    let got: Vec<(String, String)> = seen.iter().map(|s| (s.uri.clone(), s.authority())).collect();
    let want: Vec<(String, String)> = ["/one", "/two", "/three"]
        .iter()
        .map(|p| (p.to_string(), authority.clone()))
        .collect();
    assert_eq!(got, want, "(target, Host) at the upstream");
    assert_eq!(upstream.accepted(), 1);
    let t = Tunnels::until(&sidecar, |t| t.active("connect_http") == 0.0).await;
    assert_eq!(t.opened("connect_http"), 1.0);
}

/// Issue 41 item 3: inside a CONNECT served as HTTP, a second CONNECT is refused `400
/// bad_request` and the connection closed, whatever it names, and an absolute-form target
/// naming another authority is `400` too: neither reaches the other authority. The sidecar
/// goes on serving tunnels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tunnel_keeps_its_authority_against_nested_connects_and_other_targets() {
    let allowed = FakeUpstream::start().await;
    let other = FakeUpstream::start().await;
    let (authority, elsewhere) = (allowed.addr.to_string(), other.addr.to_string());
    let sidecar = Sidecar::start("").await;

    let mut client = connect(sidecar.addr, &authority, b"").await;
    client
        .send_raw(format!("GET http://{elsewhere}/abs HTTP/1.1\r\nHost: {elsewhere}\r\n\r\n").as_bytes())
        .await;
    let resp = client.read_response(false).await.expect("an answer");
    let body = resp.assert_sidecar_error(400, "bad_request", "absolute-form naming another authority");
    assert!(body.contains(&authority), "{body}");

    for nested in [elsewhere.as_str(), authority.as_str()] {
        let mut client = connect(sidecar.addr, &authority, b"").await;
        client
            .send_raw(format!("CONNECT {nested} HTTP/1.1\r\nHost: {nested}\r\n\r\n").as_bytes())
            .await;
        let resp = tokio::time::timeout(Duration::from_secs(5), client.read_response(false))
            .await
            .expect("answered within 5 s")
            .expect("an answer, not a close");
        let body = resp.assert_sidecar_error(400, "bad_request", "a nested CONNECT");
        assert!(
            body.contains(&format!("requests in it go to {authority} only")),
            "{body}"
        );
        client
            .send_raw(format!("GET /after HTTP/1.1\r\nHost: {elsewhere}\r\n\r\n").as_bytes())
            .await;
        assert!(
            closes_within(&mut client.stream, Duration::from_secs(3)).await,
            "closed after the refusal"
        );
    }
    assert_eq!(other.accepted(), 0, "nothing reached the other authority");
    assert!(other.seen().is_empty());

    // Still serving: a new tunnel carries a request to its own authority.
    let mut client = connect(sidecar.addr, &authority, b"").await;
    let resp = get_inside(&mut client, &authority, "/still").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let paths: Vec<String> = allowed.seen().iter().map(|s| s.uri.clone()).collect();
    assert_eq!(
        paths,
        ["/still"],
        "only the last request reached the tunnel's authority"
    );
}
