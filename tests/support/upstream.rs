//! Fake upstreams: the counting HTTP/1.1 and HTTP/2 one, and the fault-injecting one.

use super::*;

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
    /// Milliseconds every response waits before it is sent (see [`FakeUpstream::set_delay`]).
    pub delay_ms: std::sync::atomic::AtomicU64,
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

    /// Serves HTTP/1.1 on `listener`, bound by the caller (see [`FakeUpstream::same_port`]).
    pub fn start_on(listener: TcpListener) -> Self {
        Self::serve(listener, None, None)
    }

    /// One upstream on each of `ips` (loopback addresses), all on the SAME port: binds
    /// 127.0.0.1:0 first, then the others on its port, and starts over with a new port when
    /// one of those is taken. For an upstream whose DNS name resolves to several addresses.
    pub async fn same_port(ips: &[std::net::IpAddr]) -> Vec<Self> {
        assert_eq!(ips.first(), Some(&std::net::IpAddr::from([127, 0, 0, 1])));
        'port: for _ in 0..20 {
            let first = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let port = first.local_addr().unwrap().port();
            let mut listeners = vec![first];
            for ip in &ips[1..] {
                match TcpListener::bind(SocketAddr::new(*ip, port)).await {
                    Ok(l) => listeners.push(l),
                    Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue 'port,
                    Err(e) => panic!("binding {ip}:{port}: {e}"),
                }
            }
            return listeners.into_iter().map(Self::start_on).collect();
        }
        panic!("no port free on all of {ips:?} in 20 tries");
    }

    async fn start_with(tls: Option<tokio_rustls::TlsAcceptor>, h2_streams: Option<u32>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, tls, h2_streams)
    }

    fn serve(listener: TcpListener, tls: Option<tokio_rustls::TlsAcceptor>, h2_streams: Option<u32>) -> Self {
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

    /// Delays every response from now on by `delay` (on top of what its path does): an
    /// upstream slower than its peers.
    pub fn set_delay(&self, delay: Duration) {
        self.counters
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
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

pub(super) fn full(body: impl Into<Bytes>) -> BoxBody {
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
    let delay = counters.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        // A slow upstream is the scenario here (not synchronisation).
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
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
pub(super) fn tokio_stream<T>(mut rx: mpsc::Receiver<T>) -> impl futures_core::Stream<Item = T> {
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
