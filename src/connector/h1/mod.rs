//! HTTP/1.1 on a pooled upstream connection, run by the task of the request it carries.
//!
//! hyper's client connection is a task of its own: a request crosses a channel into it and the
//! response head and body frames cross channels back, each crossing a task wake-up. Callgrind
//! put that task at a third of the sidecar's instructions per proxied request. Here the
//! downstream connection's task writes the request and reads the response off the upstream
//! socket itself ([`Connection::send`], then [`Connection::poll_frame`] through the response
//! body). Between exchanges a connection is its socket and a read buffer in the pool, and
//! [`Connection::poll_closed`] tells the pool when the upstream closes it.
//!
//! Request framing: a body of known length goes with `Content-Length`, any other with chunked
//! coding; an empty body with neither (unless the application sent `Content-Length: 0`).
//! Response framing follows RFC 9112 §6.3: no body for HEAD, 1xx, 204 and 304; chunked when
//! `Transfer-Encoding` ends in `chunked` (a `Content-Length` beside it is dropped); any other
//! transfer coding, or neither field, means the body runs to the close; differing
//! `Content-Length` values are a protocol error. Interim 1xx responses are skipped.
//!
//! A connection is reused only when the response ended cleanly, the whole request was sent, and
//! no byte arrived past the response: anything else closes it.
//!
//! Not handled here: which connection a request gets and keep-alive hints (`pool`), retries
//! and deadlines (`upstream`).

use std::collections::VecDeque;
use std::future::{poll_fn, Future as _};
use std::io::{self, IoSlice, Write as _};
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::CONTENT_LENGTH;
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
#[cfg(any(test, feature = "test-support"))]
use tokio::io::DuplexStream;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use self::head::Framing;
pub use self::head::Persistence;
use super::Place;
use crate::spare::{self, WriteBuf};
use crate::wire::codec::{self, BodyFraming, Decoder};
use crate::wire::{HeadLines, RequestBody, WireFields};

mod head;

/// Largest response head (and trailer section) accepted: the read buffer's cap.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Bytes asked of the socket per read.
const READ_SIZE: usize = 16 * 1024;
/// Body frames up to this size are copied next to their chunk framing (one slice to write).
const COPY_LIMIT: usize = 4 * 1024;
/// Slices one write of the request takes: the head's rest and queued body pieces.
const WRITE_SLICES: usize = 8;
/// Body bytes queued for one write before it goes.
const GATHER_BYTES: usize = 64 * 1024;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The upstream closed the connection before a complete response head.
    #[error("connection closed before a response")]
    Closed,
    /// Reading or writing the socket failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The response head or body is not valid HTTP/1.1.
    #[error("invalid response: {0}")]
    Invalid(String),
    /// The response body ended before its framing said it would.
    #[error("response body cut short: {0}")]
    Truncated(&'static str),
    /// The request body failed on the downstream side.
    #[error("request body: {0}")]
    RequestBody(String),
}

impl Error {
    /// [`Error::Invalid`], built out of line: `#[cold]` tells a build without a profile that
    /// the branch is the exception, and lays it out of the exchange's hot code.
    #[cold]
    fn invalid(why: impl Into<String>) -> Self {
        Error::Invalid(why.into())
    }
}

/// The byte stream of an upstream connection.
#[derive(Debug)]
pub enum Transport {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS originated by the sidecar (to the upstream, or to an `https://` parent).
    Tls(Box<TlsStream<TcpStream>>),
    /// TLS to the upstream inside a tunnel through an `https://` parent: TLS in TLS.
    Nested(Box<TlsStream<Transport>>),
    /// An in-memory pipe (tests and benches of the pool), kept out of the release binary: every
    /// upstream read and write matches on this enum.
    #[cfg(any(test, feature = "test-support"))]
    Memory(DuplexStream),
}

impl Transport {
    /// The TCP socket underneath, whose readiness costs no syscall to ask.
    pub fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Transport::Plain(tcp) => Some(tcp),
            Transport::Tls(tls) => Some(tls.get_ref().0),
            Transport::Nested(tls) => tls.get_ref().0.tcp(),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(_) => None,
        }
    }
}

impl super::Io for Transport {
    fn may_park(&self) -> bool {
        matches!(self, Transport::Plain(_))
    }

    fn into_parked(self: Box<Self>) -> io::Result<std::os::fd::OwnedFd> {
        match *self {
            Transport::Plain(tcp) => tcp.into_std().map(Into::into),
            _ => Err(io::Error::other("only a plain TCP upstream can be parked")),
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Nested(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl Transport {
    /// [`AsyncWrite::poll_flush`] of a stream that may hold bytes back (TLS records).
    #[inline(never)]
    fn poll_flush_wrapped(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(s).poll_flush(cx),
            Transport::Nested(s) => Pin::new(s).poll_flush(cx),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(s) => Pin::new(s).poll_flush(cx),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Nested(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Transport::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Transport::Nested(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Transport::Plain(s) => s.is_write_vectored(),
            Transport::Tls(s) => s.is_write_vectored(),
            Transport::Nested(s) => s.is_write_vectored(),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(s) => s.is_write_vectored(),
        }
    }

    /// Inlined: a plain TCP socket keeps nothing back, and every request flushes once; the
    /// TLS streams' flush stays out of line.
    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_flush(cx),
            other => other.poll_flush_wrapped(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Nested(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(any(test, feature = "test-support"))]
            Transport::Memory(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// An HTTP/1.1 upstream connection. It holds its pool [`Place`], so it counts under
/// `max_connections` until it is dropped, which closes the socket.
///
/// The exchange's state after the response head ([`Transfer`]) stays here rather than going up
/// with the head: the head went through half a dozen frames (the lease, the retry loop, the
/// body's constructor), and a response that carried the transfer (248 bytes) was a `memcpy`
/// call at each; a bare head (112 bytes) moves in registers.
#[derive(Debug)]
pub struct Connection {
    link: Link,
    /// The exchange in progress, or what the last one left (its response state).
    transfer: Transfer,
    _place: Box<dyn Place>,
}

/// The socket and what was read off it: what a [`Transfer`] works on.
#[derive(Debug)]
struct Link {
    stream: Transport,
    buf: BytesMut,
    /// Set when the last exchange left it unusable.
    broken: bool,
    /// The last response's fields as their lines, when its head's map was left empty for them
    /// (`head::parse`).
    wire: Option<WireFields>,
}

impl Connection {
    /// A connection over `stream`, freshly dialed.
    pub fn new(stream: Transport, place: Box<dyn Place>) -> Self {
        Connection {
            link: Link {
                stream,
                buf: BytesMut::new(),
                broken: false,
                wire: None,
            },
            transfer: Transfer::idle(),
            _place: place,
        }
    }

    /// The last response's fields as the upstream wrote them, when its head's map was left
    /// empty for them (see `wire::fields`); taken once.
    pub fn take_wire_fields(&mut self) -> Option<WireFields> {
        self.link.wire.take()
    }

    /// `Ready` when the connection can no longer carry a request: the upstream closed or reset
    /// it, or sent bytes nobody asked for. `Pending` registers `cx` to be woken when that
    /// happens. Costs no syscall while the socket has not become readable.
    pub fn poll_closed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        self.link.poll_closed(cx)
    }

    /// Whether the connection is known to be unusable, without waiting.
    ///
    /// A socket not readable as the runtime last saw it is open: that is read from its
    /// readiness without registering a waker (`try_io`), which `poll_closed` would do, taking
    /// the socket's waiter lock and replacing the reaper's waker for nothing (callgrind: 170
    /// instructions per checkout).
    pub fn is_closed(&mut self) -> bool {
        let link = &mut self.link;
        if link.broken {
            return true;
        }
        if let Some(tcp) = link.stream.tcp() {
            if tcp.try_io(tokio::io::Interest::READABLE, || Ok(())).is_err() {
                return false;
            }
        }
        link.poll_closed(&mut Context::from_waker(std::task::Waker::noop()))
            .is_ready()
    }

    /// Whether the last exchange left the connection fit for another.
    pub fn is_reusable(&self) -> bool {
        !self.link.broken && self.link.buf.is_empty()
    }

    /// Writes `req` and reads the response head; the body is read through
    /// [`Connection::poll_frame`], which also finishes sending the request body.
    ///
    /// `req` is lent, not given: its body is taken and the rest stays with the caller, so that
    /// a request without a body can go again on another connection without a copy. Its
    /// fields are in its map, or in `lines` ([`HeadLines`]), which are written first.
    pub async fn send(
        &mut self,
        req: &mut Request<RequestBody>,
        lines: &HeadLines,
    ) -> Result<Response<()>, Error> {
        self.transfer.begin(req, lines);
        let Connection { link, transfer, .. } = self;
        link.broken = true; // until the exchange ends cleanly
        let head = poll_fn(|cx| {
            // Write what can go now. A failed write still leaves the response to read: an
            // upstream may answer early (413) and close before taking the whole body.
            if let Poll::Ready(Err(e)) = transfer.poll_send(&mut link.stream, cx) {
                if let Error::RequestBody(_) = e {
                    return Poll::Ready(Err(e));
                }
            }
            transfer.poll_head(link, cx)
        })
        .await?;
        transfer.finish_if_done(link);
        Ok(head)
    }

    /// The next response body frame of the exchange [`Connection::send`] began, read off the
    /// socket; the request body keeps going up meanwhile (an upstream may answer while it
    /// reads, as an echo does). `None` once the body ended.
    pub fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        self.transfer.poll_frame(&mut self.link, cx)
    }

    /// The exchange [`Connection::send`] began: its response's framing and end.
    pub fn transfer(&self) -> &Transfer {
        &self.transfer
    }
}

impl Link {
    fn poll_closed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.broken {
            return Poll::Ready(());
        }
        if let Some(tcp) = self.stream.tcp() {
            match tcp.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(_)) => {
                    self.broken = true;
                    return Poll::Ready(());
                }
            }
        }
        // Readable: end of stream, a reset, stray bytes, or (TLS) a post-handshake message
        // such as a session ticket, which the read consumes without producing data.
        let mut probe = [0u8; 64];
        let mut probe = ReadBuf::new(&mut probe);
        match Pin::new(&mut self.stream).poll_read(cx, &mut probe) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(_) => {
                self.broken = true;
                Poll::Ready(())
            }
        }
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() == 0 {
            self.buf = spare::UPSTREAM.take();
        }
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 4 {
            self.buf.reserve(READ_SIZE);
        }
        if let Transport::Plain(tcp) = &self.stream {
            return crate::sock::poll_read_buf(tcp, cx, &mut self.buf);
        }
        let read = self.stream.read_buf(&mut self.buf);
        std::pin::pin!(read).poll(cx)
    }

    /// After a clean exchange: the read buffer goes back to the thread's spares (`spare`), so
    /// that an idle pooled connection holds its socket and nothing else (hyper's kept two 8 KiB
    /// buffers per connection).
    fn finish_exchange(&mut self) {
        self.broken = false;
        if self.buf.is_empty() {
            spare::UPSTREAM.give_back(std::mem::take(&mut self.buf));
        }
    }
}

/// A final response head, and its fields as lines when its map was left empty for them.
type FinalHead = (Response<()>, Option<WireFields>);

/// The part of one exchange after the response head: the rest of the request body going up
/// and the response body coming down.
#[derive(Debug)]
pub struct Transfer {
    /// What is left of the request head, written before anything in `out`.
    head: WriteBuf,
    /// Encoded body bytes waiting to be written, in order.
    out: VecDeque<Bytes>,
    /// The request body still to encode; `None` once its end is queued.
    body: Option<RequestBody>,
    chunked: bool,
    /// Written but not yet flushed (TLS keeps records back until flushed).
    unflushed: bool,
    /// A write failed: nothing more goes out, and the connection is not reused.
    send_failed: bool,
    head_request: bool,
    response: ResponseState,
    /// What the response head said about the connection.
    persistence: Persistence,
    /// The body was read off the socket after the head: it did not all come with it.
    read_after_head: bool,
}

#[derive(Debug)]
enum ResponseState {
    /// The head is not in yet.
    Head,
    /// Framed by `Content-Length` or chunked coding.
    Framed(Decoder),
    /// Runs until the upstream closes.
    UntilClose,
    /// Complete.
    Done,
}

impl Transfer {
    /// A connection's before its first exchange: nothing to send, no response to read.
    fn idle() -> Self {
        Transfer {
            head: WriteBuf::default(),
            out: VecDeque::new(),
            body: None,
            chunked: false,
            unflushed: false,
            send_failed: false,
            head_request: false,
            response: ResponseState::Done,
            persistence: Persistence::default(),
            read_after_head: false,
        }
    }

    /// Starts the exchange of `req`, in place of the last one (which a connection taking
    /// another request ended cleanly: its buffers are back with the thread's spares). Field by
    /// field: a new value built and moved in was a `memcpy` call.
    fn begin(&mut self, req: &mut Request<RequestBody>, lines: &HeadLines) {
        let body = std::mem::replace(req.body_mut(), RequestBody::Empty);
        self.head = WriteBuf::take(256);
        let head = &mut self.head;
        head.extend_from_slice(req.method().as_str().as_bytes());
        head.push(b' ');
        if req.uri().scheme().is_some() {
            // Absolute-form: a request to a parent proxy.
            let _ = write!(head, "{}", req.uri());
        } else {
            let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
            head.extend_from_slice(target.as_bytes());
        }
        head.extend_from_slice(b" HTTP/1.1\r\n");
        // `Content-Length` is never a line: the map alone says whether it is there.
        lines.write(head);
        for (name, value) in req.headers() {
            head.extend_from_slice(name.as_str().as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        let mut chunked = false;
        let body = match body.size_hint().exact() {
            _ if body.is_end_stream() => None,
            Some(len) => {
                if !req.headers().contains_key(CONTENT_LENGTH) {
                    let _ = write!(head, "content-length: {len}\r\n");
                }
                Some(body)
            }
            None => {
                head.extend_from_slice(b"transfer-encoding: chunked\r\n");
                chunked = true;
                Some(body)
            }
        };
        head.extend_from_slice(b"\r\n");
        self.body = body;
        self.chunked = chunked;
        self.unflushed = false;
        self.send_failed = false;
        self.head_request = req.method() == Method::HEAD;
        self.response = ResponseState::Head;
        self.persistence = Persistence::default();
        self.read_after_head = false;
    }

    /// Writes queued bytes and encodes more of the request body; `Ready(Ok)` once the whole
    /// request is written.
    ///
    /// Body frames that are ready are queued before anything is written, so that a request
    /// whose body came with its head (most POSTs) goes up in one write: one syscall fewer, and
    /// an upstream that answers before reading the body (hyper's server, when the handler
    /// ignores it) finds the body already in and keeps the connection, where a body written
    /// after its head made it close (8 to 27 POSTs in 500, `tests/pool.rs`).
    ///
    /// Inlined for a request already all written (most polls: the response's and the body's).
    #[inline(always)]
    fn poll_send(&mut self, stream: &mut Transport, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if self.body.is_none() && !self.has_unwritten() && !self.unflushed && !self.send_failed {
            return Poll::Ready(Ok(()));
        }
        self.poll_send_more(stream, cx)
    }

    #[inline(never)]
    fn poll_send_more(&mut self, stream: &mut Transport, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        if self.send_failed {
            return Poll::Ready(Err(Error::Closed));
        }
        loop {
            let room = self.body.is_some() && self.has_room();
            if let Some(body) = self.body.as_mut().filter(|_| room) {
                match Pin::new(body).poll_frame(cx) {
                    Poll::Ready(Some(Ok(frame))) => {
                        self.queue_frame(frame);
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => {
                        self.body = None;
                        self.send_failed = true;
                        return Poll::Ready(Err(Error::RequestBody(e.to_string())));
                    }
                    Poll::Ready(None) => {
                        self.body = None;
                        if self.chunked {
                            let mut last = Vec::new();
                            codec::encode_last_chunk(None, &mut last);
                            self.out.push_back(last.into());
                        }
                        continue;
                    }
                    // Woken when more comes; what is queued goes meanwhile.
                    Poll::Pending => {}
                }
            }
            if self.has_unwritten() {
                let mut slices = [IoSlice::new(&[]); WRITE_SLICES];
                let head = Some(&self.head[..]).filter(|h| !h.is_empty());
                let n = head
                    .into_iter()
                    .chain(self.out.iter().map(|b| &b[..]))
                    .zip(&mut slices)
                    .map(|(b, s)| *s = IoSlice::new(b))
                    .count();
                // One slice (a request with no body bytes queued: most) goes by `send`, not
                // `writev`, which costs the kernel about 0.1 µs more a call (loopback
                // ping-pong in C, 2.33-2.41 µs a round trip against 2.42-2.49).
                // The head alone, written once per exchange, skips the runtime's budget check
                // (`sock`); a body's writes keep it.
                let wrote = match (&slices[..n], &*stream) {
                    ([one], Transport::Plain(tcp)) if !self.head.is_empty() => {
                        crate::sock::poll_write(tcp, cx, one)
                    }
                    ([one], _) => Pin::new(&mut *stream).poll_write(cx, one),
                    (all, _) => Pin::new(&mut *stream).poll_write_vectored(cx, all),
                };
                match wrote {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => {
                        self.send_failed = true;
                        return Poll::Ready(Err(Error::Io(io::ErrorKind::WriteZero.into())));
                    }
                    Poll::Ready(Ok(written)) => {
                        self.consume(written);
                        self.unflushed = true;
                    }
                    Poll::Ready(Err(e)) => {
                        self.send_failed = true;
                        return Poll::Ready(Err(e.into()));
                    }
                }
                continue;
            }
            if self.unflushed {
                if let Err(e) = ready!(Pin::new(&mut *stream).poll_flush(cx)) {
                    self.send_failed = true;
                    return Poll::Ready(Err(e.into()));
                }
                self.unflushed = false;
            }
            return match self.body {
                None => Poll::Ready(Ok(())),
                // Polled above with nothing queued: its waker is set.
                Some(_) => Poll::Pending,
            };
        }
    }

    /// Whether another body frame may join what waits to be written: a frame takes up to
    /// three slices (chunk header, data, CRLF), and a write gathers at most
    /// [`GATHER_BYTES`], so that a large upload still moves at the upstream's pace.
    fn has_room(&self) -> bool {
        self.out.len() + 3 < WRITE_SLICES && self.out.iter().map(Bytes::len).sum::<usize>() < GATHER_BYTES
    }

    fn has_unwritten(&self) -> bool {
        !self.head.is_empty() || !self.out.is_empty()
    }

    fn consume(&mut self, mut written: usize) {
        let from_head = written.min(self.head.len());
        if from_head == self.head.len() {
            // Written whole (most heads, in one write): the buffer goes back to the spares now,
            // not when the connection next carries a request.
            self.head = WriteBuf::default();
        } else {
            self.head.drain(..from_head);
        }
        written -= from_head;
        while written > 0 {
            let front = self.out.front_mut().expect("wrote no more than queued");
            if written >= front.len() {
                written -= front.len();
                self.out.pop_front();
            } else {
                front.advance(written);
                written = 0;
            }
        }
    }

    fn queue_frame(&mut self, frame: Frame<Bytes>) {
        let frame = match frame.into_data() {
            Ok(data) if data.is_empty() => return,
            Ok(data) if !self.chunked => return self.out.push_back(data),
            Ok(data) if data.len() <= COPY_LIMIT => {
                let mut chunk = Vec::with_capacity(data.len() + 24);
                codec::encode_chunk_header(data.len(), &mut chunk);
                chunk.extend_from_slice(&data);
                chunk.extend_from_slice(b"\r\n");
                return self.out.push_back(chunk.into());
            }
            Ok(data) => {
                let mut header = Vec::with_capacity(20);
                codec::encode_chunk_header(data.len(), &mut header);
                self.out.push_back(header.into());
                self.out.push_back(data);
                return self.out.push_back(Bytes::from_static(b"\r\n"));
            }
            Err(frame) => frame,
        };
        // Trailers end a chunked body; a body of known length has nowhere to put them.
        if let (Ok(trailers), true) = (frame.into_trailers(), self.chunked) {
            let mut last = Vec::new();
            codec::encode_last_chunk(Some(&trailers), &mut last);
            self.out.push_back(last.into());
            self.body = None;
        }
    }

    /// Reads until a final response head is parsed.
    fn poll_head(&mut self, conn: &mut Link, cx: &mut Context<'_>) -> Poll<Result<Response<()>, Error>> {
        loop {
            // Polled first with nothing read, and again when woken: parsing an empty buffer
            // was two of the three parses per response (callgrind).
            if !conn.buf.is_empty() {
                if let Some((resp, wire)) = self.parse_head(&mut conn.buf)? {
                    conn.wire = wire;
                    return Poll::Ready(Ok(resp));
                }
            }
            if conn.buf.len() >= MAX_HEAD_BYTES {
                return Poll::Ready(Err(Error::invalid(format!(
                    "response head larger than {MAX_HEAD_BYTES} bytes"
                ))));
            }
            match ready!(conn.poll_fill(cx)) {
                Ok(0) => return Poll::Ready(Err(Error::Closed)),
                Ok(_) => {}
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }

    /// A final response head from the front of `buf`, interim (1xx) ones skipped; `None`:
    /// incomplete.
    fn parse_head(&mut self, buf: &mut BytesMut) -> Result<Option<FinalHead>, Error> {
        loop {
            let Some(head) = head::parse(buf)? else {
                return Ok(None);
            };
            let status = head.resp.status();
            if status.is_informational() {
                if status == StatusCode::SWITCHING_PROTOCOLS {
                    return Err(Error::invalid("101 Switching Protocols to a pooled request"));
                }
                continue;
            }
            self.response = self.body_framing(status, head.framing)?;
            self.persistence = head.persistence;
            return Ok(Some((head.resp, head.wire)));
        }
    }

    fn body_framing(&self, status: StatusCode, framing: Framing) -> Result<ResponseState, Error> {
        if self.head_request || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            return Ok(ResponseState::Done);
        }
        match framing {
            Framing::TransferCoded { chunked: true } => {
                Ok(ResponseState::Framed(Decoder::new(BodyFraming::Chunked)))
            }
            Framing::TransferCoded { chunked: false } | Framing::Unframed => Ok(ResponseState::UntilClose),
            Framing::Length(0) => Ok(ResponseState::Done),
            Framing::Length(n) => Ok(ResponseState::Framed(Decoder::new(BodyFraming::Length(n)))),
            Framing::MalformedLength => Err(Error::invalid("malformed Content-Length")),
            Framing::DifferingLengths => Err(Error::invalid("differing Content-Length values")),
        }
    }

    /// What the response head said about the connection (its default until the head is in).
    pub fn persistence(&self) -> &Persistence {
        &self.persistence
    }

    /// Whether the response body is complete.
    pub fn is_end_stream(&self) -> bool {
        matches!(self.response, ResponseState::Done)
    }

    /// Whether the response body is complete and came whole in the reads that brought its
    /// head: the upstream was done with the exchange when the head arrived.
    pub fn ended_with_head(&self) -> bool {
        self.is_end_stream() && !self.read_after_head
    }

    /// The response body's size, when framed by `Content-Length`.
    pub fn size_hint(&self) -> SizeHint {
        match &self.response {
            ResponseState::Done => SizeHint::with_exact(0),
            ResponseState::Framed(Decoder::Length { remaining }) => SizeHint::with_exact(*remaining),
            _ => SizeHint::default(),
        }
    }

    /// Whether `conn` may carry another exchange now that this one ended.
    fn ended_cleanly(&self) -> bool {
        matches!(self.response, ResponseState::Done)
            && self.body.is_none()
            && !self.has_unwritten()
            && !self.unflushed
            && !self.send_failed
    }

    fn poll_frame(
        &mut self,
        conn: &mut Link,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if let Poll::Ready(Err(Error::RequestBody(e))) = self.poll_send(&mut conn.stream, cx) {
            self.response = ResponseState::Done;
            return Poll::Ready(Some(Err(Error::RequestBody(e))));
        }
        loop {
            match &mut self.response {
                ResponseState::Head | ResponseState::Done => return Poll::Ready(None),
                ResponseState::Framed(decoder) => match decoder.decode(&mut conn.buf, MAX_HEAD_BYTES) {
                    Ok(Some(frame)) => {
                        if decoder.is_done() {
                            self.end(conn);
                        }
                        return Poll::Ready(Some(Ok(frame)));
                    }
                    Ok(None) if decoder.is_done() => {
                        self.end(conn);
                        return Poll::Ready(None);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.response = ResponseState::Done;
                        return Poll::Ready(Some(Err(Error::invalid(e.0))));
                    }
                },
                ResponseState::UntilClose => {
                    if !conn.buf.is_empty() {
                        let data = conn.buf.split().freeze();
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
            }
            let filled = ready!(conn.poll_fill(cx));
            self.read_after_head = true;
            match filled {
                Ok(0) => {
                    return match std::mem::replace(&mut self.response, ResponseState::Done) {
                        ResponseState::UntilClose => Poll::Ready(None),
                        _ => Poll::Ready(Some(Err(Error::Truncated("the upstream closed the connection")))),
                    };
                }
                Ok(_) => {}
                Err(e) => {
                    self.response = ResponseState::Done;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }

    fn end(&mut self, conn: &mut Link) {
        self.response = ResponseState::Done;
        if self.ended_cleanly() {
            self.settle(conn);
        }
    }

    /// After a clean exchange: what the request body queued goes, so that an idle connection
    /// holds no buffer (`Link::finish_exchange`).
    fn settle(&mut self, conn: &mut Link) {
        if self.out.capacity() != 0 {
            self.out = VecDeque::new();
        }
        conn.finish_exchange();
    }

    /// For a response complete at its head (HEAD, 204, `Content-Length: 0`): marks `conn`
    /// reusable if the request went out whole.
    fn finish_if_done(&mut self, conn: &mut Link) {
        if self.is_end_stream() && self.ended_cleanly() {
            self.settle(conn);
        }
    }
}

#[cfg(test)]
mod tests;
