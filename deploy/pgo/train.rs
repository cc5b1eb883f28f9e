//! The training run of the profile-guided release build (`deploy/pgo/build.sh`): it drives an
//! instrumented `egress-sidecar` through the paths users run, so that the compiler lays out,
//! inlines and orders branches for them. Every answer is checked, so a wrong one fails the build.
//!
//! The sidecar runs twice, on one worker thread and on two. One thread is the current-thread
//! runtime that a CPU limit of 1 gets, and that the benches measure. Its upstreams are served
//! from this process: HTTP/1.1, h2c, TLS (HTTP/1.1, and h2 by ALPN), and a TCP echo. The traffic:
//! - keep-alive HTTP/1.1 through route listeners: small answers, a 64 KiB one, a chunked
//!   stream, and POSTed bodies echoed back;
//! - absolute-form requests on the forward-proxy listener (`HTTP_PROXY`), and origin-form ones
//!   routed by `Host`;
//! - HTTP/1.1 clients to the h2c and the TLS upstreams;
//! - one-request connections left open, as a leaky client leaves them: parked, then closed,
//!   and the leak detector warns about their source;
//! - CONNECT tunnels, opaque (to the echo) and with plain HTTP/1.1 inside (served through the
//!   pool, as Node's fetch and gRPC clients send it).
//!
//! Usage: `pgo-train SIDECAR_BIN`. The binary writes its profile at exit, to the directory its
//! `-Cprofile-generate` named, so it is stopped with SIGTERM and must exit 0.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

type Body = BoxBody<Bytes, Infallible>;
type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

const BIG: usize = 64 * 1024;
const CHUNK: usize = 1024;
const CHUNKS: usize = 16;
const POSTED: usize = 2048;

fn main() {
    let sidecar = std::env::args().nth(1).expect("usage: pgo-train SIDECAR_BIN");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let upstreams = Upstreams::start().await;
        for threads in [1, 2] {
            let started = Instant::now();
            let mut child = Sidecar::start(&sidecar, &upstreams, threads).await;
            traffic(&child.ports, &upstreams).await;
            child.stop().await;
            eprintln!("pgo-train: {threads} worker thread(s): {:.1?}", started.elapsed());
        }
    });
}

// === the upstreams ===

/// The upstreams this process serves, by port, and the scratch directory that holds the CA of
/// the TLS one (`ca.pem`) and the sidecar's config files.
struct Upstreams {
    h1: u16,
    h2c: u16,
    tls: u16,
    echo: u16,
    dir: std::path::PathBuf,
}

impl Upstreams {
    async fn start() -> Self {
        let dir = std::env::temp_dir().join(format!("pgo-train.{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let acceptor = tls_acceptor(&dir);
        Upstreams {
            h1: serve(false, None).await,
            h2c: serve(true, None).await,
            tls: serve(false, Some(acceptor)).await,
            echo: echo().await,
            dir,
        }
    }
}

impl Drop for Upstreams {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A CA written to `dir/ca.pem`, and a TLS server with a certificate it signed for `localhost`
/// that offers h2 and HTTP/1.1 by ALPN.
fn tls_acceptor(dir: &std::path::Path) -> tokio_rustls::TlsAcceptor {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
    std::fs::write(dir.join("ca.pem"), ca_cert.pem()).expect("ca.pem");
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = rcgen::KeyPair::generate().expect("key");
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
    let cert = params.signed_by(&key, &issuer).expect("certificate");
    let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).expect("key DER");
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(vec![cert.der().clone()], key_der)
        .expect("server config");
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// An HTTP upstream on a port of its own: h2c when `h2c`, else HTTP/1.1, or either by ALPN
/// behind `tls`.
async fn serve(h2c: bool, tls: Option<tokio_rustls::TlsAcceptor>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => serve_connection(TokioIo::new(stream), h2c).await,
                    Some(acceptor) => {
                        let Ok(stream) = acceptor.accept(stream).await else {
                            return;
                        };
                        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                        serve_connection(TokioIo::new(stream), h2).await;
                    }
                }
            });
        }
    });
    port
}

async fn serve_connection<I>(io: I, h2: bool)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(answer);
    // A connection the sidecar closes (idle, drained) ends its future with an error: not ours
    // to report; wrong answers are caught on the client side.
    if h2 {
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .max_concurrent_streams(100)
            .serve_connection(io, service)
            .await;
    } else {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    }
}

/// `/big`: 64 KiB; `/chunked`: 16 KiB in 1 KiB frames with no length (chunked in HTTP/1.1);
/// `/echo`: the request body; anything else: `ok\n`.
async fn answer(request: Request<Incoming>) -> Result<Response<Body>, hyper::Error> {
    let body: Body = match request.uri().path() {
        "/big" => Full::new(Bytes::from(vec![b'x'; BIG])).boxed(),
        "/chunked" => Chunks(CHUNKS).boxed(),
        "/echo" => Full::new(request.into_body().collect().await?.to_bytes()).boxed(),
        _ => Full::new(Bytes::from_static(b"ok\n")).boxed(),
    };
    Ok(Response::builder()
        .header("content-type", "text/plain")
        .header("cache-control", "no-store")
        .body(body)
        .expect("response"))
}

/// A body of `.0` frames of [`CHUNK`] bytes and no length known in advance.
struct Chunks(usize);

impl hyper::body::Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.0 == 0 {
            return Poll::Ready(None);
        }
        self.0 -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'c'; CHUNK])))))
    }
}

/// A TCP echo: what an opaque CONNECT tunnel reaches.
async fn echo() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("address").port();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let (mut read, mut write) = stream.split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
            });
        }
    });
    port
}

// === the sidecar ===

/// The sidecar's listeners.
struct Ports {
    proxy: u16,
    h1: u16,
    h2c: u16,
    tls_h1: u16,
    tls_h2: u16,
}

struct Sidecar {
    child: tokio::process::Child,
    ports: Ports,
}

impl Sidecar {
    async fn start(binary: &str, upstreams: &Upstreams, threads: usize) -> Self {
        let ports = Ports {
            proxy: free_port(),
            h1: free_port(),
            h2c: free_port(),
            tls_h1: free_port(),
            tls_h2: free_port(),
        };
        let config = upstreams.dir.join(format!("sidecar-{threads}.yaml"));
        std::fs::write(&config, config_text(&ports, upstreams)).expect("config");
        let mut command = tokio::process::Command::new(binary);
        for var in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"] {
            command.env_remove(var).env_remove(var.to_lowercase());
        }
        let child = command
            .arg("run")
            .arg("--config")
            .arg(&config)
            .env("TOKIO_WORKER_THREADS", threads.to_string())
            .env("EGRESS_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .expect("start the sidecar");
        for port in [ports.proxy, ports.h1, ports.h2c, ports.tls_h1, ports.tls_h2] {
            wait_listening(port).await;
        }
        Sidecar { child, ports }
    }

    /// SIGTERM (by `sh`'s builtin `kill`: build images may lack procps), then the exit, which
    /// writes the profile.
    async fn stop(&mut self) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("sh")
            .args(["-c", "kill -TERM \"$0\"", &pid])
            .status()
            .expect("sh");
        assert!(status.success(), "kill -TERM {pid}");
        let status = tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("the sidecar exits within 20 s of SIGTERM")
            .expect("wait");
        assert!(status.success(), "the sidecar exited with {status}");
    }
}

fn config_text(ports: &Ports, up: &Upstreams) -> String {
    let ca = up.dir.join("ca.pem");
    let ca = ca.display();
    format!(
        "listen: 127.0.0.1:{proxy}
admin: 127.0.0.1:0
shutdown: {{ drain_timeout: 1s }}
policy: {{ connect_ports: [{echo}, {h1}] }}
upstreams:
  - name: h1
    url: http://127.0.0.1:{h1}
    listen: 127.0.0.1:{r_h1}
    pool: {{ max_connections: 64, max_idle: 64 }}
  - name: h2c
    url: http://127.0.0.1:{h2c}
    protocol: http2
    listen: 127.0.0.1:{r_h2c}
  - name: tls-h1
    url: https://127.0.0.1:{tls}
    protocol: http1
    tls: {{ ca_file: {ca}, server_name: localhost }}
    listen: 127.0.0.1:{r_tls_h1}
  - name: tls-h2
    url: https://localhost:{tls}
    addresses: [127.0.0.1:{tls}]
    tls: {{ ca_file: {ca} }}
    listen: 127.0.0.1:{r_tls_h2}
",
        proxy = ports.proxy,
        echo = up.echo,
        h1 = up.h1,
        h2c = up.h2c,
        tls = up.tls,
        r_h1 = ports.h1,
        r_h2c = ports.h2c,
        r_tls_h1 = ports.tls_h1,
        r_tls_h2 = ports.tls_h2,
    )
}

/// A loopback port nothing listens on now (bound, then let go).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
}

async fn wait_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the sidecar listens on {port} within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// === the traffic ===

async fn traffic(ports: &Ports, up: &Upstreams) {
    let local = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    // The HTTP/1.1 upstream's authority: what absolute-form targets and Host name.
    let h1: Arc<str> = format!("127.0.0.1:{}", up.h1).into();
    let mut work = JoinSet::new();
    // The request path most deployments run: route mode, 64 keep-alive connections.
    for _ in 0..64 {
        work.spawn(requests(local(ports.h1), h1.clone(), "/".into(), 600));
    }
    join(&mut work).await;
    for path in ["/big", "/chunked", "/echo"] {
        for _ in 0..8 {
            work.spawn(requests(local(ports.h1), h1.clone(), path.into(), 100));
        }
    }
    // HTTP_PROXY clients (absolute-form), and origin-form routed by Host on the main listener.
    for _ in 0..16 {
        work.spawn(requests(
            local(ports.proxy),
            h1.clone(),
            format!("http://{h1}/"),
            300,
        ));
        work.spawn(requests(
            local(ports.proxy),
            h1.clone(),
            format!("http://{h1}/echo"),
            50,
        ));
    }
    for _ in 0..8 {
        work.spawn(requests(local(ports.proxy), h1.clone(), "/".into(), 200));
    }
    join(&mut work).await;
    for port in [ports.h2c, ports.tls_h1, ports.tls_h2] {
        for _ in 0..32 {
            work.spawn(requests(local(port), h1.clone(), "/".into(), 300));
        }
        for path in ["/chunked", "/echo"] {
            for _ in 0..4 {
                work.spawn(requests(local(port), h1.clone(), path.into(), 50));
            }
        }
        join(&mut work).await;
    }
    leaky(local(ports.h1), &h1).await;
    for _ in 0..50 {
        work.spawn(opaque_tunnel(local(ports.proxy), up.echo));
        work.spawn(http_in_tunnel(local(ports.proxy), up.h1));
    }
    join(&mut work).await;
}

async fn join(work: &mut JoinSet<()>) {
    while let Some(done) = work.join_next().await {
        done.expect("a traffic task failed");
    }
}

/// `count` requests for `target` on one keep-alive connection to `addr`, each answer checked.
async fn requests(addr: SocketAddr, host: Arc<str>, target: String, count: usize) {
    let stream = TcpStream::connect(addr).await.expect("connect to the sidecar");
    let _ = stream.set_nodelay(true);
    let mut sender = handshake(stream).await;
    for _ in 0..count {
        exchange(&mut sender, &host, &target).await;
    }
}

async fn handshake<I>(io: I) -> Sender
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(connection);
    sender
}

/// One request for `target` (a path, or an absolute URL) with `Host: host`, its answer checked
/// against what [`answer`] sends for it.
async fn exchange(sender: &mut Sender, host: &str, target: &str) {
    let path = target.rsplit_once('/').map_or("", |(_, last)| last);
    let (method, body, expected) = match path {
        "big" => ("GET", Bytes::new(), BIG),
        "chunked" => ("GET", Bytes::new(), CHUNK * CHUNKS),
        "echo" => ("POST", Bytes::from(vec![b'p'; POSTED]), POSTED),
        _ => ("GET", Bytes::new(), 3),
    };
    let request = Request::builder()
        .method(method)
        .uri(target)
        .header("host", host)
        .header("user-agent", "pgo-train")
        .header("accept", "*/*")
        .body(Full::new(body))
        .expect("request");
    sender.ready().await.expect("connection ready");
    let response = sender.send_request(request).await.expect("an answer");
    let status = response.status();
    let got = response.into_body().collect().await.expect("the body").to_bytes();
    assert_eq!(
        status,
        StatusCode::OK,
        "{target}: {}",
        String::from_utf8_lossy(&got)
    );
    assert_eq!(got.len(), expected, "{target}: body length");
}

/// 600 connections of one request each, left open a second and a half (parked; past
/// `leaky_idle_timeout` the detector closes them and warns), then closed.
async fn leaky(addr: SocketAddr, host: &str) {
    let mut open = Vec::new();
    for _ in 0..600 {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let mut sender = handshake(stream).await;
        exchange(&mut sender, host, "/").await;
        open.push(sender);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
}

/// `CONNECT` to `port`, checked to answer 200; the tunnel's stream.
async fn connect(proxy: SocketAddr, port: u16) -> TcpStream {
    let mut stream = TcpStream::connect(proxy).await.expect("connect");
    let head = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.expect("CONNECT");
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        let n = stream.read(&mut byte).await.expect("CONNECT answer");
        assert!(
            n == 1,
            "the sidecar closed a CONNECT: {}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "CONNECT: {}",
        String::from_utf8_lossy(&got)
    );
    stream
}

/// An opaque tunnel to the echo: 20 round trips of 64 bytes.
async fn opaque_tunnel(proxy: SocketAddr, echo: u16) {
    let mut stream = connect(proxy, echo).await;
    let sent = [b'e'; 64];
    let mut back = [0u8; 64];
    for _ in 0..20 {
        stream.write_all(&sent).await.expect("write to the tunnel");
        stream.read_exact(&mut back).await.expect("read from the tunnel");
        assert_eq!(back, sent, "the echo through the tunnel");
    }
}

/// Plain HTTP/1.1 inside a CONNECT to the HTTP/1.1 upstream: served through the pool.
async fn http_in_tunnel(proxy: SocketAddr, h1: u16) {
    let stream = connect(proxy, h1).await;
    let mut sender = handshake(stream).await;
    let host = format!("127.0.0.1:{h1}");
    for _ in 0..100 {
        exchange(&mut sender, &host, "/").await;
    }
}
