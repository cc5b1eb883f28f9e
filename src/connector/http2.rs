//! The HTTP/2 client side of one upstream connection, on the `h2` crate directly: the
//! handshake, the connection's driver task (frames, SETTINGS, PING keepalive, closing once the
//! pool lets go), and a request's stream: its head, its body, its response.
//!
//! Why not hyper's client: hyper runs every request through a dispatch channel to the
//! connection's task, spawns a task per request to await the response and hands the response
//! back through a oneshot; the connection task also polls every request's dispatch. Here the
//! request's own task opens the stream and awaits the response, as it runs its HTTP/1.1
//! exchanges; only a request with a body spawns a task, to pump the body while the response
//! streams (a gRPC call sends and receives at once). Settings follow hyper's defaults, so the
//! wire behaviour is unchanged.
//!
//! Keepalive: while streams are open, a PING goes out every `keepalive_interval`; one not
//! acknowledged within `keepalive_timeout` ends the connection, and its streams fail. An idle
//! connection is not pinged (hyper's `keep_alive_while_idle(false)`).

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response};
use http_body::{Body as _, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

use crate::wire::{BoxError, RequestBody};

/// Stream receive window: hyper's default (the spec's 64 KiB throttles a fast upstream).
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
/// Connection receive window, hyper's default.
const CONN_WINDOW: u32 = 5 * 1024 * 1024;
/// Largest response header list we accept, hyper's default.
const MAX_HEADER_LIST: u32 = 16 * 1024;
/// Request body bytes h2 buffers per stream before it waits for the window, hyper's default.
const MAX_SEND_BUFFER: usize = 1024 * 1024;
/// Streams a server may make us reset for its errors before the connection is dropped, hyper's.
const MAX_LOCAL_ERROR_RESETS: usize = 1024;

/// PING keepalive settings.
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    /// Between PINGs while streams are open.
    pub interval: Duration,
    /// For the acknowledgement.
    pub timeout: Duration,
}

/// What a connection's streams and its driver share.
#[derive(Debug)]
struct ConnState {
    /// The server's SETTINGS_MAX_CONCURRENT_STREAMS, republished after every driver poll.
    max_streams: AtomicUsize,
    /// The driver ended: the connection is gone.
    closed: AtomicBool,
    /// Streams awaiting or streaming a response (PINGs go out only while there are some).
    open: AtomicUsize,
    /// The driver dropped the connection for an unanswered PING: its streams cannot tell
    /// (they see the socket closed under them).
    unanswered: AtomicBool,
}

/// Opens streams on one connection; cloned per stream. When every clone is gone (the pool
/// forgot the connection and its last stream ended), h2 wakes the driver and the connection
/// closes.
#[derive(Debug, Clone)]
pub struct Sender {
    tx: h2::client::SendRequest<Bytes>,
    shared: Arc<ConnState>,
}

/// Why a stream gave no response head.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection could not open a stream; the request was not touched.
    #[error("{0}")]
    Unsent(h2::Error),
    /// The connection took the request but could not open its stream: nothing went out,
    /// though the request was taken.
    #[error("stream not opened: {0}")]
    NotOpened(h2::Error),
    /// The stream failed after the request went out (or as it did).
    #[error("{0}")]
    Stream(h2::Error),
    /// Our request body failed (the application went away, or sent a malformed body).
    #[error("request body: {0}")]
    RequestBody(String),
    /// The driver dropped the connection under the stream: a keepalive PING went unanswered.
    #[error("{}", UNANSWERED)]
    Unanswered,
}

/// Performs the HTTP/2 handshake over `io` and spawns the connection's driver, which holds
/// `on_end` until the connection closes and calls it with the error that ended it, if any.
/// `unheard` is the stream limit assumed until the server's SETTINGS arrive.
pub async fn handshake<T, F>(
    io: T,
    unheard: usize,
    keepalive: Option<Keepalive>,
    on_end: F,
) -> Result<Sender, h2::Error>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    F: FnOnce(Option<BoxError>) + Send + 'static,
{
    let (tx, mut conn) = h2::client::Builder::new()
        .initial_max_send_streams(unheard)
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONN_WINDOW)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_send_buffer_size(MAX_SEND_BUFFER)
        .max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .enable_push(false)
        .handshake::<_, Bytes>(io)
        .await?;
    let shared = Arc::new(ConnState {
        max_streams: AtomicUsize::new(unheard),
        closed: AtomicBool::new(false),
        open: AtomicUsize::new(0),
        unanswered: AtomicBool::new(false),
    });
    let pings = keepalive.and_then(|k| conn.ping_pong().map(|pp| Pings::new(pp, k)));
    let driver = Driver {
        conn,
        shared: shared.clone(),
        pings,
    };
    tokio::spawn(async move {
        let ended = driver.await;
        on_end(ended.err());
    });
    Ok(Sender { tx, shared })
}

impl Sender {
    /// The server's current stream limit (the `unheard` value until its SETTINGS arrive).
    pub fn max_streams(&self) -> usize {
        self.shared.max_streams.load(Ordering::Relaxed)
    }

    /// Whether the connection is gone.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::Relaxed)
    }

    /// Opens a stream for `req` and waits for the response head. `req` is taken only once the
    /// connection can open the stream: on [`Error::Unsent`] it is left as it was.
    pub async fn send(&mut self, req: &mut Request<RequestBody>) -> Result<Response<Body>, Error> {
        poll_fn(|cx| self.tx.poll_ready(cx))
            .await
            .map_err(Error::Unsent)?;
        let (parts, body) = crate::wire::take_request(req).into_parts();
        // Fields HTTP/2 forbids (`Connection` and the rest) are gone already: every request
        // passes `proxy::headers::to_upstream`, and `request_headers` may not set them.
        let mut head = Request::from_parts(parts, ());
        let end = body.is_end_stream();
        if let Some(len) = body.size_hint().exact() {
            // As hyper does: an empty body is stated only where the method expects one.
            if len != 0 || matches!(*head.method(), Method::POST | Method::PUT | Method::PATCH) {
                head.headers_mut()
                    .entry(http::header::CONTENT_LENGTH)
                    .or_insert_with(|| http::HeaderValue::from(len));
            }
        }
        // Counted before the stream opens: opening it wakes the driver, which arms the
        // keepalive only if it sees a stream open.
        let open = Open::new(&self.shared);
        // The connection took the stream at `poll_ready`; failing here (a GOAWAY or a socket
        // error handled in between) it never went out.
        let (response, stream) = self.tx.send_request(head, end).map_err(Error::NotOpened)?;
        let (response, pumping) = if end {
            (response.await, None)
        } else {
            let mut body_failed = pump(body, stream);
            let response = tokio::select! {
                biased;
                response = response => response,
                Ok(why) = &mut body_failed => return Err(Error::RequestBody(why)),
            };
            // The pump resets the stream when the body fails, which fails the response too:
            // the body's reason is the one to report.
            if let (Err(_), Ok(why)) = (&response, body_failed.try_recv()) {
                return Err(Error::RequestBody(why));
            }
            (response, Some(body_failed))
        };
        let response = response.map_err(|e| self.stream_error(e))?;
        Ok(Body::of(response, pumping, open))
    }

    /// Sends `head` with `body`, whole and in hand, and waits for the response head: the
    /// body is queued with the head (h2 sends it as the window allows), so no task pumps it.
    /// For small requests the sidecar makes itself (a rate-limit service's calls).
    pub async fn send_whole(&mut self, head: Request<()>, body: Bytes) -> Result<Response<Body>, Error> {
        poll_fn(|cx| self.tx.poll_ready(cx))
            .await
            .map_err(Error::Unsent)?;
        let open = Open::new(&self.shared);
        let (response, mut stream) = self.tx.send_request(head, false).map_err(Error::NotOpened)?;
        stream.send_data(body, true).map_err(Error::Stream)?;
        let response = response.await.map_err(|e| self.stream_error(e))?;
        Ok(Body::of(response, None, open))
    }

    /// A stream's error; one that only saw the socket go says why the driver dropped it.
    fn stream_error(&self, e: h2::Error) -> Error {
        if e.is_io() && self.shared.unanswered.load(Ordering::Relaxed) {
            Error::Unanswered
        } else {
            Error::Stream(e)
        }
    }
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// Sends `body` on `stream` from a task of its own; the receiver hears why the body failed,
/// if it did (a server that resets the stream ends the pump quietly: the response says why).
/// Dropping the receiver (the exchange was abandoned, or its response body is gone) resets
/// the stream and ends the pump: a request body is never sent to nobody.
fn pump(body: RequestBody, mut stream: h2::SendStream<Bytes>) -> oneshot::Receiver<String> {
    let (mut failed, rx) = oneshot::channel();
    tokio::spawn(async move {
        let piped = tokio::select! {
            biased;
            _ = failed.closed() => None,
            piped = pipe(body, &mut stream) => Some(piped),
        };
        match piped {
            None => stream.send_reset(h2::Reason::CANCEL),
            Some(Err(why)) => {
                // The reason first: the reset fails the response, which then looks for it.
                let _ = failed.send(why);
                stream.send_reset(h2::Reason::INTERNAL_ERROR);
            }
            Some(Ok(())) => {}
        }
    });
    rx
}

/// Sends the body; an error is the body's own (the stream's failures end it quietly).
async fn pipe(mut body: RequestBody, stream: &mut h2::SendStream<Bytes>) -> Result<(), String> {
    loop {
        let frame = tokio::select! {
            biased;
            _ = poll_fn(|cx| stream.poll_reset(cx)) => return Ok(()),
            frame = poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)) => frame,
        };
        let frame = match frame {
            None => return send_data(stream, Bytes::new(), true).await.or(Ok(())),
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(data) => {
                let end = body.is_end_stream();
                if send_data(stream, data, end).await.is_err() || end {
                    return Ok(());
                }
            }
            Err(frame) => {
                if let Ok(trailers) = frame.into_trailers() {
                    let _ = stream.send_trailers(trailers);
                    return Ok(());
                }
            }
        }
    }
}

/// Sends `data` as the window allows; an error means the stream is gone (the response side
/// reports why).
async fn send_data(stream: &mut h2::SendStream<Bytes>, mut data: Bytes, end: bool) -> Result<(), h2::Error> {
    if data.is_empty() {
        return stream.send_data(data, end);
    }
    while !data.is_empty() {
        stream.reserve_capacity(data.len());
        let granted = match poll_fn(|cx| stream.poll_capacity(cx)).await {
            Some(granted) => granted?,
            None => return Err(h2::Error::from(h2::Reason::CANCEL)),
        };
        let chunk = data.split_to(granted.min(data.len()));
        stream.send_data(chunk, end && data.is_empty())?;
    }
    Ok(())
}

/// Counts a stream in its connection's `open` while it awaits or streams its response.
#[derive(Debug)]
struct Open(Arc<ConnState>);

impl Open {
    fn new(shared: &Arc<ConnState>) -> Self {
        shared.open.fetch_add(1, Ordering::Relaxed);
        Open(shared.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A response body: data as it arrives (its window released at once, as hyper does), then
/// trailers. Dropped before its end, it resets the stream (h2 does, once no handle is left).
#[derive(Debug)]
pub struct Body {
    recv: h2::RecvStream,
    data_done: bool,
    done: bool,
    exact: Option<u64>,
    /// The request body's pump, if it runs: it stops when this goes.
    _pumping: Option<oneshot::Receiver<String>>,
    _open: Open,
}

impl Body {
    /// The body of `response`, its stream counted `open` until it goes.
    fn of(
        response: Response<h2::RecvStream>,
        pumping: Option<oneshot::Receiver<String>>,
        open: Open,
    ) -> Response<Body> {
        let exact = content_length(response.headers());
        response.map(|recv| Body {
            recv,
            data_done: false,
            done: false,
            exact,
            _pumping: pumping,
            _open: open,
        })
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if !this.data_done {
            match ready!(this.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    let _ = this.recv.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(e)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => this.data_done = true,
            }
        }
        let trailers = ready!(this.recv.poll_trailers(cx));
        this.done = true;
        Poll::Ready(match trailers {
            Ok(Some(trailers)) => Some(Ok(Frame::trailers(trailers))),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.recv.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.exact.map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

/// A connection's task: polls the connection, republishes the server's stream limit, sends
/// keepalive PINGs.
struct Driver<T: AsyncRead + AsyncWrite> {
    conn: h2::client::Connection<T, Bytes>,
    shared: Arc<ConnState>,
    pings: Option<Pings>,
}

impl<T: AsyncRead + AsyncWrite + Unpin> Future for Driver<T> {
    type Output = Result<(), BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let open = this.shared.open.load(Ordering::Relaxed) > 0;
        if let Some(pings) = &mut this.pings {
            if let Poll::Ready(e) = pings.poll(cx, open) {
                this.shared.unanswered.store(true, Ordering::Relaxed);
                this.shared.closed.store(true, Ordering::Relaxed);
                return Poll::Ready(Err(e));
            }
        }
        let polled = Pin::new(&mut this.conn).poll(cx);
        this.shared
            .max_streams
            .store(this.conn.max_concurrent_send_streams(), Ordering::Relaxed);
        if polled.is_ready() {
            this.shared.closed.store(true, Ordering::Relaxed);
        }
        polled.map_err(Into::into)
    }
}

/// PING keepalive: waiting out the interval, or waiting for an acknowledgement.
struct Pings {
    pp: h2::PingPong,
    keepalive: Keepalive,
    timer: Pin<Box<Sleep>>,
    /// The timer runs (an idle connection's does not: it would wake the driver for nothing).
    armed: bool,
    awaiting_pong: bool,
}

impl Pings {
    fn new(pp: h2::PingPong, keepalive: Keepalive) -> Self {
        Pings {
            pp,
            keepalive,
            timer: Box::pin(tokio::time::sleep(keepalive.interval)),
            armed: false,
            awaiting_pong: false,
        }
    }

    /// Ready with the error that ends the connection: a PING unanswered in time. Opening a
    /// stream wakes the driver (its HEADERS go out), which arms the timer here.
    fn poll(&mut self, cx: &mut Context<'_>, streams_open: bool) -> Poll<BoxError> {
        loop {
            if self.awaiting_pong {
                return match self.pp.poll_pong(cx) {
                    Poll::Ready(Ok(_)) => {
                        self.awaiting_pong = false;
                        self.armed = false;
                        continue;
                    }
                    Poll::Ready(Err(e)) => Poll::Ready(e.into()),
                    Poll::Pending => match self.timer.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(UNANSWERED.into()),
                        Poll::Pending => Poll::Pending,
                    },
                };
            }
            if !streams_open {
                self.armed = false;
                return Poll::Pending;
            }
            if !self.armed {
                self.armed = true;
                self.rearm(self.keepalive.interval);
            }
            ready!(self.timer.as_mut().poll(cx));
            if let Err(e) = self.pp.send_ping(h2::Ping::opaque()) {
                return Poll::Ready(e.into());
            }
            self.awaiting_pong = true;
            self.rearm(self.keepalive.timeout);
        }
    }

    fn rearm(&mut self, after: Duration) {
        self.timer.as_mut().reset(Instant::now() + after);
    }
}

const UNANSWERED: &str = "keep-alive timed out: no PING acknowledgement within keepalive_timeout";

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::Request;
    use http_body::Frame;
    use tokio::net::{TcpListener, TcpStream};

    use super::{handshake, Sender};
    use crate::wire::RequestBody;

    const PATIENCE: Duration = Duration::from_secs(5);

    /// A client connection to an h2 server on a real socket; returns the server's connection.
    async fn connect() -> (Sender, h2::server::Connection<TcpStream, Bytes>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (io, _) = listener.accept().await.unwrap();
            h2::server::handshake(io).await.unwrap()
        });
        let io = TcpStream::connect(addr).await.unwrap();
        let sender = handshake(io, 101, None, |_| {}).await.unwrap();
        (sender, server.await.unwrap())
    }

    fn post(body: RequestBody) -> Request<RequestBody> {
        let mut req = Request::new(body);
        *req.method_mut() = http::Method::POST;
        *req.uri_mut() = "http://upstream.test/upload".parse().unwrap();
        req
    }

    /// A connection the pool forgot closes once its last stream's handle goes, not when the
    /// server closes it (hyper worked around an h2 that did not wake its connection then).
    #[tokio::test]
    async fn the_connection_closes_once_every_sender_is_gone() {
        let (sender, mut server) = connect().await;
        let more = sender.clone();
        drop(sender);
        drop(more);
        let accepted = tokio::time::timeout(PATIENCE, server.accept())
            .await
            .expect("the client closed the connection once its senders were gone");
        assert!(accepted.is_none(), "no stream was opened");
    }

    /// A request body still streaming when its exchange is abandoned (a deadline, the
    /// application gone) must not go on being sent to a response nobody reads.
    #[tokio::test]
    async fn an_abandoned_exchange_resets_its_stream_and_stops_the_body() {
        let (mut sender, mut server) = connect().await;
        // The pool's handle: the connection stays while the exchange goes.
        let _pooled = sender.clone();
        let (body, tx) = RequestBody::channel(None);
        let mut req = post(body);
        let exchange = tokio::spawn(async move { sender.send(&mut req).await.map(|_| ()) });
        let (request, _respond) = server.accept().await.unwrap().unwrap();
        let mut received = request.into_body();
        tx.tx
            .send(Ok(Frame::data(Bytes::from_static(b"part"))))
            .await
            .unwrap();
        let first = tokio::select! {
            data = received.data() => data,
            _ = server.accept() => panic!("the connection ended"),
        };
        assert_eq!(first.unwrap().unwrap(), Bytes::from_static(b"part"));
        exchange.abort();
        let next = tokio::select! {
            data = received.data() => data,
            _ = server.accept() => panic!("the connection ended"),
            _ = tokio::time::sleep(PATIENCE) => panic!("the stream was neither reset nor ended"),
        };
        let reset = next.expect("reset, not ended").expect_err("reset, not more data");
        assert_eq!(reset.reason(), Some(h2::Reason::CANCEL), "{reset}");
        assert!(tx.tx.is_closed(), "the body's pump ended and dropped the body");
    }

    /// A body failing before the response head (the application went away mid-upload) is
    /// the application's fault: reported as such, not as a reset by the upstream (whose
    /// endpoint would be charged a failure for it).
    #[tokio::test]
    async fn a_request_body_failing_before_the_response_is_reported_as_the_body() {
        let (mut sender, mut server) = connect().await;
        let (body, tx) = RequestBody::channel(None);
        let mut req = post(body);
        let exchange = tokio::spawn(async move { sender.send(&mut req).await.map(|_| ()) });
        let (request, _respond) = server.accept().await.unwrap().unwrap();
        let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
        tx.tx
            .send(Err(crate::wire::codec::BodyError("client went away".into())))
            .await
            .unwrap();
        let failed = tokio::time::timeout(PATIENCE, exchange)
            .await
            .unwrap()
            .unwrap()
            .expect_err("no response");
        assert!(
            matches!(&failed, super::Error::RequestBody(why) if why.contains("client went away")),
            "{failed:?}"
        );
        let reset = request.into_body().data().await.unwrap().expect_err("reset");
        assert_eq!(reset.reason(), Some(h2::Reason::INTERNAL_ERROR), "{reset}");
        serve.abort();
    }

    /// A body sent in full, then trailers; the response's data and trailers come back.
    #[tokio::test]
    async fn a_body_and_trailers_go_out_and_the_response_comes_back_whole() {
        let (mut sender, mut server) = connect().await;
        let (body, tx) = RequestBody::channel(None);
        let mut req = post(body);
        req.headers_mut()
            .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        let client = tokio::spawn(async move {
            let resp = sender.send(&mut req).await.unwrap();
            let collected = http_body_util::BodyExt::collect(resp.into_body()).await.unwrap();
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        });
        let feed = tokio::spawn(async move {
            tx.tx
                .send(Ok(Frame::data(Bytes::from_static(b"hello "))))
                .await
                .unwrap();
            tx.tx
                .send(Ok(Frame::data(Bytes::from_static(b"world"))))
                .await
                .unwrap();
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            tx.tx.send(Ok(Frame::trailers(trailers))).await.unwrap();
        });
        let (request, mut respond) = server.accept().await.unwrap().unwrap();
        let serve = tokio::spawn(async move { while server.accept().await.is_some() {} });
        assert_eq!(request.headers()["te"], "trailers");
        let mut body = request.into_body();
        let mut received = Vec::new();
        while let Some(data) = body.data().await {
            let data = data.unwrap();
            body.flow_control().release_capacity(data.len()).unwrap();
            received.extend_from_slice(&data);
        }
        assert_eq!(received, b"hello world");
        let trailers = body.trailers().await.unwrap().expect("trailers");
        assert_eq!(trailers["grpc-status"], "0");
        feed.await.unwrap();

        let mut stream = respond.send_response(http::Response::new(()), false).unwrap();
        stream.send_data(Bytes::from_static(b"answer"), false).unwrap();
        let mut out = http::HeaderMap::new();
        out.insert("grpc-status", http::HeaderValue::from_static("0"));
        stream.send_trailers(out).unwrap();
        let (data, trailers) = tokio::time::timeout(PATIENCE, client).await.unwrap().unwrap();
        assert_eq!(data, Bytes::from_static(b"answer"));
        assert_eq!(trailers.expect("response trailers")["grpc-status"], "0");
        serve.abort();
    }
}
