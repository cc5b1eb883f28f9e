//! Test support: a counting fake upstream, the sidecar in-process or as a child process, and a
//! minimal raw HTTP/1.1 client. Everything binds 127.0.0.1:0.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};

pub type BoxBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

// === fake upstream ===

/// What the fake upstream saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub version: http::Version,
    pub method: String,
    pub uri: String,
    pub headers: HeaderMap,
    pub body_len: u64,
    /// The request body ended as framed (`/drain` only); false when it was cut off.
    pub body_complete: bool,
}

#[derive(Default)]
pub struct Counters {
    /// Connections open now.
    pub open: AtomicUsize,
    /// Most connections open at once.
    pub peak: AtomicUsize,
    /// Connections accepted in total.
    pub accepted: AtomicUsize,
    /// Requests received.
    pub requests: AtomicUsize,
    /// TLS handshakes that resumed an earlier session.
    pub tls_resumed: AtomicUsize,
    /// `notify_waiters()`: every open HTTP/2 connection sends GOAWAY and finishes its streams.
    pub goaway: Notify,
    /// `notify_waiters()`: every open connection is dropped at once (the upstream dies).
    pub kill: Notify,
}

/// An HTTP/1.1 upstream that counts connections. Paths:
/// - `/sleep/{ms}`: answers "ok" after ms
/// - `/echo`: streams the request body back
/// - `/drain`: reads the body, answers its length
/// - `/bytes/{n}`: streams n bytes
/// - `/close`: answers with `Connection: close`
/// - `/keepalive/{secs}`: answers with `Keep-Alive: timeout=secs`
/// - `/sse/{n}`: n events, each sent after `sse_next` is notified
/// - anything else: "ok"
pub struct FakeUpstream {
    pub addr: SocketAddr,
    pub counters: Arc<Counters>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub sse_next: Arc<Notify>,
    stop: Option<oneshot::Sender<()>>,
}

impl FakeUpstream {
    pub async fn start() -> Self {
        Self::start_with(None, None).await
    }

    /// Serves over TLS with `acceptor` (see [`TestCa`]): HTTP/2 when ALPN picks h2 (100
    /// streams), else HTTP/1.1.
    pub async fn start_tls(acceptor: tokio_rustls::TlsAcceptor) -> Self {
        Self::start_with(Some(acceptor), None).await
    }

    /// Serves HTTP/2 only, allowing `max_streams` concurrent streams per connection: over TLS
    /// when `acceptor` is given, else h2c with prior knowledge.
    pub async fn start_h2(acceptor: Option<tokio_rustls::TlsAcceptor>, max_streams: u32) -> Self {
        Self::start_with(acceptor, Some(max_streams)).await
    }

    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>, h2_streams: Option<u32>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counters = Arc::new(Counters::default());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sse_next = Arc::new(Notify::new());
        let (stop, mut stopped) = oneshot::channel();
        let (c, s, n) = (counters.clone(), seen.clone(), sse_next.clone());
        tokio::spawn(async move {
            loop {
                let (stream, _) = tokio::select! {
                    r = listener.accept() => match r { Ok(p) => p, Err(_) => continue },
                    _ = &mut stopped => return,
                };
                c.accepted.fetch_add(1, Ordering::SeqCst);
                let now = c.open.fetch_add(1, Ordering::SeqCst) + 1;
                c.peak.fetch_max(now, Ordering::SeqCst);
                let (c2, s2, n2) = (c.clone(), s.clone(), n.clone());
                let counters = c.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(req, c2.clone(), s2.clone(), n2.clone()));
                    match tls {
                        None => serve_io(TokioIo::new(stream), svc, h2_streams, &counters).await,
                        Some(acceptor) => {
                            if let Ok(stream) = acceptor.accept(stream).await {
                                let session = stream.get_ref().1;
                                if session.handshake_kind() == Some(rustls::HandshakeKind::Resumed) {
                                    counters.tls_resumed.fetch_add(1, Ordering::SeqCst);
                                }
                                let h2 = session.alpn_protocol() == Some(b"h2");
                                let streams = h2_streams.or(h2.then_some(100));
                                serve_io(TokioIo::new(stream), svc, streams, &counters).await;
                            }
                        }
                    }
                    counters.open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        FakeUpstream {
            addr,
            counters,
            seen,
            sse_next,
            stop: Some(stop),
        }
    }

    pub fn open(&self) -> usize {
        self.counters.open.load(Ordering::SeqCst)
    }
    pub fn peak(&self) -> usize {
        self.counters.peak.load(Ordering::SeqCst)
    }
    pub fn accepted(&self) -> usize {
        self.counters.accepted.load(Ordering::SeqCst)
    }
    pub fn requests(&self) -> usize {
        self.counters.requests.load(Ordering::SeqCst)
    }
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Serves one connection: HTTP/2 with `h2_streams` concurrent streams when given, else HTTP/1.1.
async fn serve_io<I, S>(io: I, svc: S, h2_streams: Option<u32>, counters: &Counters)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = BoxBody> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match h2_streams {
        Some(streams) => {
            let conn = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .max_concurrent_streams(streams)
                .serve_connection(io, svc);
            tokio::pin!(conn);
            let mut going_away = false;
            loop {
                tokio::select! {
                    _ = conn.as_mut() => return,
                    _ = counters.goaway.notified(), if !going_away => {
                        going_away = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ = counters.kill.notified() => return,
                }
            }
        }
        None => {
            let conn = hyper::server::conn::http1::Builder::new().serve_connection(io, svc);
            tokio::select! {
                _ = conn => {}
                _ = counters.kill.notified() => {}
            }
        }
    }
}

fn full(body: impl Into<Bytes>) -> BoxBody {
    Full::new(body.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

async fn handle(
    req: Request<Incoming>,
    counters: Arc<Counters>,
    seen: Arc<Mutex<Vec<Seen>>>,
    sse_next: Arc<Notify>,
) -> Result<Response<BoxBody>, Infallible> {
    counters.requests.fetch_add(1, Ordering::SeqCst);
    let path = req.uri().path().to_owned();
    let mut record = Seen {
        version: req.version(),
        method: req.method().to_string(),
        uri: req.uri().to_string(),
        headers: req.headers().clone(),
        body_len: 0,
        body_complete: false,
    };
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let resp = match segments.as_slice() {
        ["sleep", ms] => {
            // A slow upstream is the scenario here (not synchronisation).
            tokio::time::sleep(Duration::from_millis(ms.parse().unwrap_or(0))).await;
            Response::new(full("ok"))
        }
        ["grpc"] => {
            // gRPC-shaped: echo the message, answer with trailers, report the request's.
            let collected = req.into_body().collect().await.unwrap_or_default();
            let request_trailer = collected
                .trailers()
                .and_then(|t| t.get("x-request-checksum"))
                .map(|v| v.to_str().unwrap_or("").to_owned())
                .unwrap_or_default();
            let data = collected.to_bytes();
            record.body_len = data.len() as u64;
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            trailers.insert("x-seen-request-checksum", request_trailer.parse().unwrap());
            let frames: Vec<Result<Frame<Bytes>, std::io::Error>> =
                vec![Ok(Frame::data(data)), Ok(Frame::trailers(trailers))];
            let (tx, rx) = mpsc::channel(2);
            for frame in frames {
                tx.try_send(frame).unwrap();
            }
            let mut resp = Response::new(StreamBody::new(tokio_stream(rx)).boxed());
            resp.headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
            resp
        }
        ["echo"] => {
            seen.lock().unwrap().push(record);
            let body = req.into_body().map_err(std::io::Error::other).boxed();
            return Ok(Response::new(body));
        }
        ["drain"] => {
            let mut body = req.into_body();
            let mut len = 0u64;
            let mut complete = true;
            while let Some(frame) = body.frame().await {
                match frame {
                    Ok(f) => len += f.data_ref().map_or(0, |d| d.len() as u64),
                    Err(_) => {
                        complete = false;
                        break;
                    }
                }
            }
            record.body_len = len;
            record.body_complete = complete;
            Response::new(full(len.to_string()))
        }
        ["bytes", n] => {
            let total: u64 = n.parse().unwrap_or(0);
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(2);
            tokio::spawn(async move {
                let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
                let mut left = total;
                while left > 0 {
                    let n = left.min(chunk.len() as u64) as usize;
                    if tx.send(Ok(Frame::data(chunk.slice(..n)))).await.is_err() {
                        return;
                    }
                    left -= n as u64;
                }
            });
            let mut resp = Response::new(StreamBody::new(tokio_stream(rx)).boxed());
            resp.headers_mut().insert("content-length", total.into());
            resp
        }
        ["close"] => {
            let mut resp = Response::new(full("ok"));
            resp.headers_mut().insert("connection", "close".parse().unwrap());
            resp
        }
        ["keepalive", secs] => {
            let mut resp = Response::new(full("ok"));
            resp.headers_mut()
                .insert("keep-alive", format!("timeout={secs}").parse().unwrap());
            resp
        }
        ["sse", n] => {
            let events: usize = n.parse().unwrap_or(0);
            let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
            tokio::spawn(async move {
                for i in 0..events {
                    if i > 0 {
                        sse_next.notified().await;
                    }
                    let event = Bytes::from(format!("data: event {i}\n\n"));
                    if tx.send(Ok(Frame::data(event))).await.is_err() {
                        return;
                    }
                }
            });
            let mut resp = Response::new(StreamBody::new(tokio_stream(rx)).boxed());
            resp.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            resp
        }
        _ => Response::new(full("ok")),
    };
    seen.lock().unwrap().push(record);
    Ok(resp)
}

/// An mpsc receiver as a `Stream` without pulling in tokio-stream.
fn tokio_stream<T>(mut rx: mpsc::Receiver<T>) -> impl futures_core::Stream<Item = T> {
    futures_util_stream::poll_fn(move |cx| rx.poll_recv(cx))
}

mod futures_util_stream {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    pub struct PollFn<F>(F);
    impl<F> Unpin for PollFn<F> {}
    pub fn poll_fn<T, F: FnMut(&mut Context<'_>) -> Poll<Option<T>>>(f: F) -> PollFn<F> {
        PollFn(f)
    }
    impl<T, F: FnMut(&mut Context<'_>) -> Poll<Option<T>>> futures_core::Stream for PollFn<F> {
        type Item = T;
        fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
            (self.0)(cx)
        }
    }
}

// === the sidecar, in-process ===

pub struct Sidecar {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// Route-mode listeners in config order.
    pub routes: Vec<SocketAddr>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Sidecar {
    /// Starts the sidecar with `yaml` (listen/admin default to 127.0.0.1:0).
    pub async fn start(yaml: &str) -> Self {
        let mut text = String::from("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n");
        text.push_str(yaml);
        let config = egress_sidecar::config::parse(&text, &Default::default()).expect("valid test config");
        let listeners = egress_sidecar::Listeners::bind(&config).await.unwrap();
        Self::run(config, listeners)
    }

    /// Like [`Sidecar::start`], with the one route-mode listener bound by the test first:
    /// `yaml` gets its port, for configs that must name it elsewhere too (`connect_ports`).
    /// The listener is handed over bound, so no other process can take the port meanwhile.
    pub async fn start_with_route(yaml: impl FnOnce(u16) -> String) -> Self {
        let route = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = route.local_addr().unwrap().port();
        let mut text = String::from("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n");
        text.push_str(&yaml(port));
        let config = egress_sidecar::config::parse(&text, &Default::default()).expect("valid test config");
        let index = config
            .upstreams
            .iter()
            .position(|u| u.listen.is_some_and(|a| a.port() == port))
            .expect("an upstream listening on the given port");
        let listeners = egress_sidecar::Listeners {
            proxy: TcpListener::bind(config.listen).await.unwrap(),
            unix: None,
            admin: TcpListener::bind(config.admin).await.unwrap(),
            routes: vec![(index, route)],
        };
        Self::run(config, listeners)
    }

    fn run(config: egress_sidecar::config::Config, listeners: egress_sidecar::Listeners) -> Self {
        let addr = listeners.proxy.local_addr().unwrap();
        let admin = listeners.admin.local_addr().unwrap();
        let routes = listeners
            .routes
            .iter()
            .map(|(_, l)| l.local_addr().unwrap())
            .collect();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(egress_sidecar::run(config, listeners, async move {
            let _ = stopped.await;
        }));
        Sidecar {
            addr,
            admin,
            routes,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Signals shutdown and waits for the drain to finish.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

// === admin listener ===

/// GETs `path` on the admin listener.
pub async fn admin_get(admin: SocketAddr, path: &str) -> RawResponse {
    let mut client = RawClient::connect(admin).await;
    client
        .send_raw(format!("GET {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n").as_bytes())
        .await;
    client.read_response(false).await.expect("an admin response")
}

/// Scrapes `/metrics` and parses it with a Prometheus text parser.
pub async fn scrape(admin: SocketAddr) -> prometheus_parse::Scrape {
    let resp = admin_get(admin, "/metrics").await;
    assert_eq!(resp.status, 200);
    let lines = resp.text().lines().map(|l| Ok(l.to_owned())).collect::<Vec<_>>();
    prometheus_parse::Scrape::parse(lines.into_iter()).expect("valid Prometheus text")
}

/// The value of `name` summed over samples with these labels (0 when absent).
pub fn value(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            _ => panic!("{name} is not a number"),
        })
        .sum()
}

/// `/debug/pools`, parsed: the pool serving upstream `label` (not one a reload retired).
pub async fn debug_pool(admin: SocketAddr, label: &str) -> serde_json::Value {
    let resp = admin_get(admin, "/debug/pools").await;
    assert_eq!(resp.status, 200);
    let all: serde_json::Value = serde_json::from_slice(&resp.body).expect("JSON");
    all["pools"]
        .as_array()
        .expect("a pools array")
        .iter()
        .find(|p| p["upstream"] == label && p["retired"].is_null())
        .cloned()
        .unwrap_or_else(|| panic!("no pool {label} in {all}"))
}

// === raw client ===

/// A response read off a raw socket.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts the contract's shape of a sidecar-made error: `status`, `x-egress-error: kind`,
    /// and one `text/plain` line `egress-sidecar: <kind>: <cause>`. Returns the body.
    pub fn assert_sidecar_error(&self, status: u16, kind: &str, what: &str) -> String {
        assert_eq!(self.status, status, "{what}: {}", self.text());
        assert_eq!(self.header("x-egress-error"), Some(kind), "{what}");
        assert_eq!(
            self.header("content-type"),
            Some("text/plain; charset=utf-8"),
            "{what}"
        );
        let body = self.text();
        assert!(
            body.starts_with(&format!("egress-sidecar: {kind}: ")) && body.ends_with('\n'),
            "{what}: {body:?}"
        );
        assert_eq!(body.lines().count(), 1, "{what}: one line: {body:?}");
        body
    }
}

/// A keep-alive HTTP/1.1 client connection over a raw socket.
pub struct RawClient {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl RawClient {
    /// A client over an already connected stream.
    pub fn from_stream(stream: TcpStream) -> Self {
        RawClient {
            stream,
            buf: Vec::new(),
        }
    }

    /// Bytes read past the last parsed message.
    pub fn take_buffered(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.buf)
    }

    pub async fn connect(addr: SocketAddr) -> Self {
        RawClient {
            stream: TcpStream::connect(addr).await.unwrap(),
            buf: Vec::new(),
        }
    }

    pub async fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// Sends a GET in absolute-form for `url`.
    pub async fn get(&mut self, url: &str) -> RawResponse {
        let host = url.split('/').nth(2).unwrap_or("");
        self.send_raw(format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
            .await;
        self.read_response(false).await.expect("response")
    }

    /// Reads one response (`head_only` for HEAD requests); None if the connection closed first.
    pub async fn read_response(&mut self, head_only: bool) -> Option<RawResponse> {
        let (status, headers) = self.try_read_head().await?;
        let no_body = head_only || status == 204 || status == 304 || (100..200).contains(&status);
        let body = if no_body {
            Vec::new()
        } else if let Some(len) = headers.get("content-length") {
            let len: usize = len.to_str().unwrap().parse().unwrap();
            while self.buf.len() < len {
                assert!(self.fill().await, "closed mid-body");
            }
            self.buf.drain(..len).collect()
        } else if headers.get("transfer-encoding").is_some_and(|v| v == "chunked") {
            self.read_chunked().await
        } else {
            while self.fill().await {}
            std::mem::take(&mut self.buf)
        };
        Some(RawResponse {
            status,
            headers,
            body,
        })
    }

    async fn read_chunked(&mut self) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(p) = find(&self.buf, b"\r\n") {
                    break p;
                }
                assert!(self.fill().await, "closed in chunk header");
            };
            let size_text = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap();
            self.buf.drain(..line_end + 2);
            if size == 0 {
                // trailers until empty line
                loop {
                    let end = loop {
                        if let Some(p) = find(&self.buf, b"\r\n") {
                            break p;
                        }
                        assert!(self.fill().await);
                    };
                    self.buf.drain(..end + 2);
                    if end == 0 {
                        return body;
                    }
                }
            }
            while self.buf.len() < size + 2 {
                assert!(self.fill().await, "closed in chunk");
            }
            body.extend(self.buf.drain(..size));
            self.buf.drain(..2);
        }
    }

    /// Reads the next chunk of a chunked body as it arrives (for streaming tests).
    pub async fn read_chunk(&mut self) -> Option<Vec<u8>> {
        let line_end = loop {
            if let Some(p) = find(&self.buf, b"\r\n") {
                break p;
            }
            if !self.fill().await {
                return None;
            }
        };
        let size_text = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
        let size = usize::from_str_radix(size_text.trim(), 16).unwrap();
        self.buf.drain(..line_end + 2);
        while self.buf.len() < size + 2 {
            if !self.fill().await {
                return None;
            }
        }
        let data: Vec<u8> = self.buf.drain(..size).collect();
        self.buf.drain(..2);
        Some(data)
    }

    /// A response whose body the connection's end cuts short: its status and the body bytes
    /// that arrived before the close, whatever the framing promised. None if the connection
    /// closed before a head.
    pub async fn read_until_closed(&mut self) -> Option<(u16, usize)> {
        let (status, _) = self.try_read_head().await?;
        while self.fill().await {}
        Some((status, std::mem::take(&mut self.buf).len()))
    }

    /// Reads the head of a response only (the body is left for `read_chunk`).
    pub async fn read_head(&mut self) -> (u16, HeaderMap) {
        self.try_read_head().await.expect("closed before head")
    }

    /// Reads a response head; None if the connection closed first.
    async fn try_read_head(&mut self) -> Option<(u16, HeaderMap)> {
        let head_end = loop {
            if let Some(pos) = find(&self.buf, b"\r\n\r\n") {
                break pos + 4;
            }
            if !self.fill().await {
                return None;
            }
        };
        let mut slots = [httparse::EMPTY_HEADER; 64];
        let mut resp = httparse::Response::new(&mut slots);
        resp.parse(&self.buf[..head_end]).expect("valid response head");
        let status = resp.code.unwrap();
        let mut headers = HeaderMap::new();
        for h in resp.headers.iter() {
            headers.append(
                http::HeaderName::from_bytes(h.name.as_bytes()).unwrap(),
                http::HeaderValue::from_bytes(h.value).unwrap(),
            );
        }
        self.buf.drain(..head_end);
        Some((status, headers))
    }

    /// Whether the peer closed the connection (reads until EOF or `wait`).
    pub async fn is_closed_within(&mut self, wait: Duration) -> bool {
        let mut tmp = [0u8; 1024];
        match tokio::time::timeout(wait, self.stream.read(&mut tmp)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&tmp[..n]);
                false
            }
            Err(_) => false,
        }
    }

    async fn fill(&mut self) -> bool {
        let mut tmp = [0u8; 16384];
        match self.stream.read(&mut tmp).await {
            Ok(0) | Err(_) => false,
            Ok(n) => {
                self.buf.extend_from_slice(&tmp[..n]);
                true
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Sends `n` GETs for `url` at once, each on its own connection to `sidecar`.
pub fn spawn_gets(sidecar: SocketAddr, url: &str, n: usize) -> Vec<tokio::task::JoinHandle<RawResponse>> {
    (0..n)
        .map(|_| {
            let url = url.to_owned();
            tokio::spawn(async move { RawClient::connect(sidecar).await.get(&url).await })
        })
        .collect()
}

/// Polls `cond` every 20ms until it holds or `within` passes.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Like [`eventually`], for a condition that must await something (an admin endpoint, say).
pub async fn eventually_async<F, Fut>(within: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Scrapes `/metrics` every 20 ms until `cond` holds or `within` passes, and returns the last
/// scrape either way: the caller asserts on it, so a timeout fails with the values it saw.
pub async fn scrape_until(
    admin: SocketAddr,
    within: Duration,
    mut cond: impl FnMut(&prometheus_parse::Scrape) -> bool,
) -> prometheus_parse::Scrape {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let scrape = scrape(admin).await;
        if cond(&scrape) || tokio::time::Instant::now() >= deadline {
            return scrape;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (up to 5 s) until `parked` idle application connections are parked
/// (`egress_downstream_parked_connections`; a keep-alive connection is parked once it has idled
/// for 100 ms) and, when given, `open` are open (`egress_downstream_connections`). Panics
/// otherwise.
pub async fn wait_parked(admin: SocketAddr, parked: usize, open: Option<usize>) {
    let counts = |m: &prometheus_parse::Scrape| {
        let open_now = value(m, "egress_downstream_connections", &[]);
        (
            value(m, "egress_downstream_parked_connections", &[]),
            open.map_or(0.0, |_| open_now),
        )
    };
    let want = (parked as f64, open.unwrap_or(0) as f64);
    let m = scrape_until(admin, Duration::from_secs(5), |m| counts(m) == want).await;
    assert_eq!(counts(&m), want, "(parked, open) application connections");
}

// === a fault-injecting upstream, and what a faulted sidecar should return to ===

/// What the fault upstream promises in `Content-Length` before it breaks off.
pub const FAULT_BODY_LEN: usize = 1000;

/// A fault-injecting HTTP/1.1 upstream. Answers by path:
/// - `/reset-before-head`: an RST instead of a response;
/// - `/reset-mid-body` and `/truncated`: a 1000-byte promise, 100 bytes, then an RST or a FIN;
/// - `/lie-long`: `Content-Length: 5` followed by more bytes than that;
/// - `/slow-head`: the status line, then the rest of the head 3 s later;
/// - `/never`: nothing, ever (the connection stays open until the other side closes it);
/// - `/arm-close`: "ok", and the next request on this connection is met with a FIN and no
///   response: an idle keep-alive connection closed exactly as it is reused;
/// - anything else: "ok".
///
/// Keeps connections alive otherwise.
pub async fn fault_upstream() -> SocketAddr {
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
    let mut armed = false;
    loop {
        let Some(path) = read_request_path(&mut stream, &mut buf).await else {
            return;
        };
        if armed {
            let _ = stream.shutdown().await;
            return;
        }
        let partial = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {FAULT_BODY_LEN}\r\n\r\n{}",
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
            "/slow-head" => {
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\n").await;
                // The fault itself: a head that takes 3 s to finish (not synchronisation).
                tokio::time::sleep(Duration::from_secs(3)).await;
                if stream.write_all(b"Content-Length: 2\r\n\r\nok").await.is_err() {
                    return;
                }
            }
            "/never" => {
                // Holds the connection until the sidecar gives up on it.
                let mut sink = [0u8; 1024];
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
                return;
            }
            "/lie-long" => {
                let lie = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsmuggle";
                if stream.write_all(lie).await.is_err() {
                    return;
                }
            }
            _ => {
                armed = path == "/arm-close";
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
pub async fn read_request_path(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<String> {
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

pub fn open_fds(sidecar: &ChildSidecar) -> usize {
    let pid = sidecar.child.id().expect("running");
    std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().count()
}

/// Upstream connections (every pool, every state) and application connections open.
pub async fn connections(sidecar: &ChildSidecar) -> (f64, f64) {
    let scrape = scrape(sidecar.admin).await;
    (
        value(&scrape, "egress_upstream_connections", &[]),
        value(&scrape, "egress_downstream_connections", &[]),
    )
}

/// Waits (up to 10 s) until no connection is open either side and, when given, the fd count
/// is `expected`; returns (upstream connections, downstream connections, fds).
pub async fn settle(sidecar: &ChildSidecar, expected: Option<usize>) -> (f64, f64, usize) {
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

// === the sidecar, as a child process ===

/// The `egress-sidecar` binary running with a config file; killed on drop.
pub struct ChildSidecar {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub child: tokio::process::Child,
    /// The config file it runs with.
    pub config_path: std::path::PathBuf,
    /// Every line it logged (JSON).
    pub logs: Arc<Mutex<Vec<String>>>,
    _dir: TempDir,
}

impl ChildSidecar {
    /// Starts the binary with `yaml` (listen/admin 127.0.0.1:0 prepended) and waits until it
    /// logs its addresses.
    pub async fn spawn(yaml: &str) -> Self {
        Self::spawn_with_env(yaml, &[]).await
    }

    /// Like [`ChildSidecar::spawn`], with extra environment variables.
    pub async fn spawn_with_env(yaml: &str, env: &[(&str, &str)]) -> Self {
        Self::spawn_command(yaml, env, None).await
    }

    /// Like [`ChildSidecar::spawn`], started inside the cgroup whose `cgroup.procs` file is
    /// `procs`: a shell joins it, then execs the sidecar, so that the sidecar reads that
    /// cgroup's limit at start.
    pub async fn spawn_in_cgroup(yaml: &str, procs: &std::path::Path) -> Self {
        Self::spawn_command(yaml, &[], Some(procs)).await
    }

    async fn spawn_command(yaml: &str, env: &[(&str, &str)], cgroup_procs: Option<&std::path::Path>) -> Self {
        use tokio::io::AsyncBufReadExt;
        let dir = TempDir::new();
        let path = dir.path.join("config.yaml");
        std::fs::write(&path, Self::config_text(yaml)).unwrap();
        let binary = env!("CARGO_BIN_EXE_egress-sidecar");
        let mut command = match cgroup_procs {
            None => tokio::process::Command::new(binary),
            Some(procs) => {
                let mut sh = tokio::process::Command::new("sh");
                sh.arg("-c")
                    .arg("echo $$ > \"$0\" && exec \"$@\"")
                    .arg(procs)
                    .arg(binary);
                sh
            }
        };
        let mut child = command
            .arg("run")
            .arg("--config")
            .arg(&path)
            .env("EGRESS_LOG_FORMAT", "json")
            .env("EGRESS_LOG", "info")
            .envs(env.iter().copied())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (addr, admin) = loop {
            let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
                .await
                .expect("sidecar started within 20s")
                .unwrap()
                .expect("sidecar exited before listening");
            logs.lock().unwrap().push(line.clone());
            if line.contains("forward proxy listening") {
                break (json_field(&line, "listen"), json_field(&line, "admin"));
            }
        };
        // Keep draining stderr so the child never blocks on a full pipe.
        let kept = logs.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                kept.lock().unwrap().push(line);
            }
        });
        ChildSidecar {
            addr: addr.parse().unwrap(),
            admin: admin.parse().unwrap(),
            child,
            config_path: path,
            logs,
            _dir: dir,
        }
    }

    fn config_text(yaml: &str) -> String {
        format!("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n{yaml}")
    }

    /// Replaces the config file the way Kubernetes and most editors do: a new file renamed over
    /// the old one, so the sidecar never reads half of it.
    pub fn rewrite_config(&self, yaml: &str) {
        self.replace_config_file(&Self::config_text(yaml));
    }

    /// Like [`ChildSidecar::rewrite_config`], with the file's whole text (listeners included).
    pub fn replace_config_file(&self, text: &str) {
        let tmp = self.config_path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &self.config_path).unwrap();
    }

    /// Sends a signal (`-TERM`, `-HUP`, ...) with kill(1).
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Logged lines containing `text`.
    pub fn logged(&self, text: &str) -> Vec<String> {
        self.logs
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(text))
            .cloned()
            .collect()
    }

    /// Waits for the process to exit (at most `within`) and asserts it exited 0.
    pub async fn assert_exits_ok_within(&mut self, within: Duration) {
        let status = tokio::time::timeout(within, self.child.wait())
            .await
            .expect("exited in time")
            .unwrap();
        assert!(status.success(), "exit status {status}");
    }

    /// A `/proc/PID/status` field in KiB (e.g. `VmRSS`, `VmHWM`).
    pub fn status_kib(&self, field: &str) -> u64 {
        let pid = self.child.id().expect("running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} not in /proc/{pid}/status"))
    }
}

fn json_field(line: &str, name: &str) -> String {
    let key = format!("\"{name}\":\"");
    let start = line.find(&key).unwrap_or_else(|| panic!("{name} in {line}")) + key.len();
    let end = line[start..].find('"').unwrap() + start;
    line[start..end].to_owned()
}

/// A directory removed on drop.
pub struct TempDir {
    pub path: std::path::PathBuf,
}

impl TempDir {
    pub fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "egress-sidecar-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&path).unwrap();
        TempDir { path }
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

// === what a test needs from the machine ===

/// Whether this is a CI run (`CI=true`, as .ci/run is started): there a missing tool means a
/// missing install step, and the test that needs it fails instead of skipping.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Says why a test cannot run on this machine. Locally it prints `SKIPPED: why` and the caller
/// returns; in CI it fails the test, naming what is missing.
pub fn skip(why: &str) {
    assert!(
        !in_ci(),
        "CI=true and this test cannot run: {why}; .ci/run must install it"
    );
    println!("SKIPPED: {why}");
}

// === Go programs under tests/ ===

/// Builds the stdlib-only Go program at `src` (relative to the crate root) into the cargo
/// target tmpdir; `None` when `go` is not on PATH.
pub async fn build_go(src: &str, name: &str) -> Option<std::path::PathBuf> {
    use std::process::Stdio;
    let have_go = tokio::process::Command::new("go")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success());
    if !have_go {
        return None;
    }
    let out_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-bin");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(name);
    let mut cmd = tokio::process::Command::new("go");
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .args(["build", "-o"])
        .arg(&out)
        .arg(src)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "")
        .env("GOWORK", "off")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let has_cache_home = ["GOCACHE", "XDG_CACHE_HOME", "HOME"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    if !has_cache_home {
        cmd.env(
            "GOCACHE",
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("gocache"),
        );
    }
    let output = tokio::time::timeout(Duration::from_secs(180), cmd.output())
        .await
        .expect("go build took longer than 180s")
        .expect("running go build");
    assert!(
        output.status.success(),
        "go build {src} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(out)
}

// === TLS ===

/// A throwaway certificate authority for TLS tests.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
}

impl TestCa {
    pub fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "egress-sidecar test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A server config with a certificate for `names` (expired when asked) offering `alpn`.
    pub fn server(&self, names: &[&str], expired: bool, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key_der)
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }

    /// Writes the CA certificate into `dir`; returns the path.
    pub fn write_pem(&self, dir: &TempDir) -> std::path::PathBuf {
        let path = dir.path.join("ca.pem");
        std::fs::write(&path, &self.pem).unwrap();
        path
    }
}

impl Seen {
    /// The authority the request named: `:authority` for HTTP/2, `Host` for HTTP/1.1.
    pub fn authority(&self) -> String {
        match self
            .uri
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.authority().cloned())
        {
            Some(authority) => authority.to_string(),
            None => self
                .headers
                .get("host")
                .map(|h| h.to_str().unwrap().to_owned())
                .unwrap_or_default(),
        }
    }

    /// The path and query the request named.
    pub fn path(&self) -> String {
        self.uri
            .parse::<http::Uri>()
            .unwrap()
            .path_and_query()
            .unwrap()
            .to_string()
    }
}

// === raw byte helpers for tunnels and upgrades ===

/// Reads exactly `n` bytes, taking `early` (bytes already read) first.
pub async fn read_n(stream: &mut TcpStream, early: &mut Vec<u8>, n: usize) -> Vec<u8> {
    let mut out: Vec<u8> = early.drain(..early.len().min(n)).collect();
    let mut rest = vec![0u8; n - out.len()];
    tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut rest))
        .await
        .expect("bytes within 5s")
        .unwrap();
    out.extend_from_slice(&rest);
    out
}

/// Whether `stream` reaches end-of-file (or a reset) within `wait`, discarding data.
pub async fn closes_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    let mut tmp = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut tmp)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => {}
            Err(_) => return false,
        }
    }
}

/// A loopback address whose connects hang: a listener with a full accept queue drops further
/// SYNs. Kept alive by this value.
pub struct Blackhole {
    pub addr: SocketAddr,
    _listener: socket2::Socket,
    _fillers: Vec<socket2::Socket>,
}

impl Blackhole {
    pub async fn start() -> Self {
        let listener = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        listener
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        listener.listen(0).unwrap();
        let addr = listener.local_addr().unwrap().as_socket().unwrap();
        let mut fillers = Vec::new();
        for _ in 0..4 {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.set_nonblocking(true).unwrap();
            let _ = s.connect(&addr.into());
            fillers.push(s);
        }
        // Nothing accepts, so once one filler is established the backlog-0 queue is full and
        // every later SYN is dropped; the others stay in SYN-SENT (no peer address).
        let full = eventually(Duration::from_secs(5), || {
            fillers.iter().any(|s| s.peer_addr().is_ok())
        })
        .await;
        assert!(full, "no filler connection was established");
        Blackhole {
            addr,
            _listener: listener,
            _fillers: fillers,
        }
    }
}

/// A loopback address that refuses connections for as long as this value lives: a TCP socket
/// bound to it but not listening answers a SYN with an RST, and holding the port keeps anyone
/// else from taking it (a port bound, released and then used could be taken meanwhile).
pub struct RefusingPort {
    pub addr: SocketAddr,
    _socket: socket2::Socket,
}

impl RefusingPort {
    pub fn new() -> Self {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        RefusingPort {
            addr,
            _socket: socket,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}
