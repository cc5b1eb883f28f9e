//! The HTTP/2 client side of one upstream connection, on our own protocol state
//! ([`crate::wire::h2client`]): the connection's task (socket reads and writes, PING keepalive,
//! closing once the pool lets go) and a request's stream (its head, its body, its response).
//!
//! Why not hyper's client, or the `h2` crate under it: hyper runs every request through a
//! dispatch channel to the connection's task, spawns a task per request to await the response
//! and hands it back through a oneshot; `h2` Huffman-codes and indexes every field it sends and
//! keeps its own stream store and buffers beside ours. A proxy's stream is simpler: the
//! request's own task opens the stream and awaits the head, as it runs its HTTP/1.1 exchanges.
//! Our first client, this same design on `h2`, cost 44,397 instructions per GET; this one costs
//! 38,182 (`benches/h2_client.rs`, `benches/RESULTS.md`). Settings follow hyper's defaults (2 MiB
//! stream and 5 MiB connection windows, 16 KiB header lists, no push).
//!
//! What the two sides share is one `Mutex<State>`: the protocol state and, per stream, what has
//! come for it and who waits. A request's own task opens its stream, queues its HEADERS and
//! awaits its head; the connection's task reads, hands events to the streams and wakes them, and
//! writes whatever any side queued. Only a request with a body spawns a task, to pump the body
//! while the response streams (a gRPC call sends and receives at once).
//!
//! Keepalive: while streams are open, a PING goes out every `keepalive_interval`; one not
//! acknowledged within `keepalive_timeout` ends the connection, and its streams fail. An idle
//! connection is not pinged (hyper's `keep_alive_while_idle(false)`).

mod driver;

use std::collections::{HashMap, VecDeque};
use std::future::poll_fn;
use std::hash::{BuildHasherDefault, Hasher};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{oneshot, Notify};

use crate::wire::frame::ErrorCode;
use crate::wire::h2client::{Cause, Config, Connection, Fields, OpenError, RequestHead};
use crate::wire::{BoxError, HeadLines, RequestBody, WireFields};

/// PING keepalive settings.
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    /// Between PINGs while streams are open.
    pub interval: std::time::Duration,
    /// For the acknowledgement.
    pub timeout: std::time::Duration,
}

/// Whether a connection takes new streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// It does (perhaps once a stream ends, at the server's limit).
    Open,
    /// It will take none (a GOAWAY came, or the stream ids are spent); streams open finish.
    GoingAway,
    /// The connection ended.
    Gone,
}

/// Why a stream gave no response, or its body failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The connection could not open a stream (gone, or going away); the request was not
    /// touched.
    #[error("stream not opened: {0}")]
    Unsent(Ended),
    /// The stream was reset: by the server, by us for what the server sent, or because a
    /// GOAWAY said the server never processed it ([`Cause::Unprocessed`]: safe to retry).
    #[error("stream reset with {code}: {cause:?}")]
    Reset {
        /// The RST_STREAM's or GOAWAY's code.
        code: ErrorCode,
        /// Who reset it, and why.
        cause: Cause,
    },
    /// The connection ended under the stream.
    #[error("connection ended: {0}")]
    Connection(Ended),
    /// Our request body failed (the application went away, or sent a malformed body).
    #[error("request body: {0}")]
    RequestBody(String),
}

/// Why a connection ended.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Ended {
    /// The socket failed.
    #[error("i/o: {0}")]
    Io(Arc<std::io::Error>),
    /// The server broke the protocol; our GOAWAY said so.
    #[error(transparent)]
    Protocol(crate::wire::h2client::ConnError),
    /// The server closed the socket.
    #[error("closed by the server")]
    Closed,
    /// The server sent GOAWAY: no new streams.
    #[error("server sent GOAWAY ({0})")]
    GoingAway(ErrorCode),
    /// A keepalive PING went unanswered within `keepalive_timeout`.
    #[error("keep-alive timed out: no PING acknowledgement within keepalive_timeout")]
    Unanswered,
    /// Every handle went and the connection closed.
    #[error("closed")]
    Released,
}

/// What a connection's task and its streams share.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the connection's task: there is output to write, or a handle went.
    task: Notify,
    /// What every stream names in `:scheme` and `:authority`, when the connection is to one
    /// origin; else each request's target does.
    origin: Option<Origin>,
}

/// The origin a connection was opened to. A pool's connection serves one upstream, so its
/// streams name it whatever the request's target says: the request keeps its origin-form
/// target and no absolute URI is built for each (240 instructions a request, callgrind h2c).
#[derive(Debug, Clone)]
pub struct Origin {
    /// `:scheme`.
    pub scheme: http::uri::Scheme,
    /// `:authority`.
    pub authority: http::uri::Authority,
}

#[derive(Debug)]
struct State {
    conn: Connection,
    slots: HashMap<u32, Slot, BuildHasherDefault<StreamIdHasher>>,
    /// The stream limit: `unheard` until the server's SETTINGS come.
    max_streams: usize,
    /// Senders waiting for room to open a stream.
    waiting: Vec<Waker>,
    /// [`Sender`]s alive; at 0 with no stream left, the connection closes.
    senders: usize,
    /// The connection is gone, and why.
    ended: Option<Ended>,
    /// The task wants to hear when the last stream ends (its keepalive timer runs).
    wake_on_idle: bool,
}

/// Hashes the slots' keys, stream ids, with one multiplication. The ids are ours (rising odd
/// numbers), not the server's choice, so SipHash's defence against chosen keys buys nothing
/// here; it took 119 instructions a lookup, eight lookups a request (callgrind, h2c). Halved
/// first: odd ids times an odd constant would all be odd, and half the table's buckets unused.
#[derive(Debug, Default)]
struct StreamIdHasher(u64);

impl Hasher for StreamIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    /// Not used by `u32` keys; mixes any other bytes all the same.
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(Self::MULTIPLIER);
        }
    }

    fn write_u32(&mut self, id: u32) {
        self.0 = u64::from(id >> 1).wrapping_mul(Self::MULTIPLIER);
    }
}

impl StreamIdHasher {
    /// 2^64 over the golden ratio: consecutive inputs land far apart in every bit range.
    const MULTIPLIER: u64 = 0x9E37_79B9_7F4A_7C15;
}

/// What has come for one stream, and who waits for it. Moved into the map when the stream
/// opens and out when it ends; what few responses have (trailers, a failure) is boxed to keep
/// those moves short (160 bytes, from 240).
#[derive(Debug, Default)]
struct Slot {
    head: Option<Fields>,
    data: Chunks,
    trailers: Option<Box<Fields>>,
    /// The response ended (END_STREAM came).
    done: bool,
    failed: Option<Box<Error>>,
    /// The request's task, awaiting the head or reading the body.
    recv: Option<Waker>,
    /// The body's pump, waiting for send window.
    send: Option<Waker>,
}

/// Opens streams on one connection; cloned per stream. When every clone is gone and the last
/// stream has ended, the connection closes.
#[derive(Debug)]
pub struct Sender {
    shared: Arc<Shared>,
}

/// Performs the client's side of the handshake over `io` (the preface and our SETTINGS go out
/// first thing) and spawns the connection's task, which holds `on_end` until the connection
/// closes and calls it with the error that ended it, if any. `unheard` is the stream limit
/// assumed until the server's SETTINGS arrive; `origin`, what every stream names as its
/// scheme and authority (`None`: each request's absolute target, or its `Host`).
pub fn handshake<T, F>(
    io: T,
    unheard: usize,
    keepalive: Option<Keepalive>,
    origin: Option<Origin>,
    on_end: F,
) -> Sender
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    F: FnOnce(Option<BoxError>) + Send + 'static,
{
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            conn: Connection::new(Config::default()),
            slots: HashMap::default(),
            max_streams: unheard,
            waiting: Vec::new(),
            senders: 1,
            ended: None,
            wake_on_idle: false,
        }),
        task: Notify::new(),
        origin,
    });
    let driver = driver::Driver::new(io, shared.clone(), keepalive);
    tokio::spawn(async move {
        let ended = driver.run().await;
        on_end(match ended {
            Ended::Released => None,
            other => Some(other.into()),
        });
    });
    Sender { shared }
}

// === impl Shared ===

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the protocol state in no known state; the
        // connection is of no more use, but its handles must not panic in turn.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

// === impl State ===

impl State {
    /// `Ok(true)`: a stream may open now; `Ok(false)`: once one ends; `Err`: never.
    fn can_open(&self) -> Result<bool, Ended> {
        if let Some(ended) = &self.ended {
            return Err(ended.clone());
        }
        let open = self.conn.open_streams();
        let at_limit = open >= self.max_streams || open >= self.conn.max_concurrent_streams() as usize;
        if self.conn.can_open() {
            return Ok(!at_limit);
        }
        if at_limit {
            return Ok(false);
        }
        // Not the limit: a GOAWAY, or the stream ids are spent.
        Err(Ended::GoingAway(ErrorCode::NO_ERROR))
    }

    /// Forgets stream `id`, whose response was read to its end (or failed); `true` when the
    /// connection's task must hear it: it went idle, and the task closes it or stops pinging.
    fn finish(&mut self, id: u32) -> bool {
        self.slots.remove(&id);
        self.slots.is_empty() && (self.senders == 0 || self.wake_on_idle)
    }

    /// Wakes the senders waiting for room, unless there is still none (they would only wait
    /// again); those that cannot open at all learn it.
    fn wake_waiting(&mut self) {
        if !matches!(self.can_open(), Ok(false)) {
            self.waiting.drain(..).for_each(Waker::wake);
        }
    }
}

// === impl Slot ===

impl Slot {
    /// Nothing more comes for the stream and nothing but its queued data is left to read.
    fn is_finished(&self) -> bool {
        self.done && self.data.is_empty() && self.trailers.is_none() && self.failed.is_none()
    }
}

/// A stream's DATA not yet read, in order. Most responses come in one frame: it is held in
/// place, and a deque is made only when a second comes before the first is read. A deque for
/// every stream cost each h2c request its allocation, growth and free, about 600
/// instructions (callgrind, issue 47).
#[derive(Debug, Default)]
enum Chunks {
    #[default]
    Empty,
    One(Bytes),
    Many(VecDeque<Bytes>),
}

impl Chunks {
    fn push(&mut self, data: Bytes) {
        *self = match std::mem::take(self) {
            Chunks::Empty => Chunks::One(data),
            Chunks::One(first) => Chunks::Many(VecDeque::from([first, data])),
            Chunks::Many(mut queue) => {
                queue.push_back(data);
                Chunks::Many(queue)
            }
        };
    }

    fn pop(&mut self) -> Option<Bytes> {
        match self {
            Chunks::Many(queue) => queue.pop_front(),
            _ => match std::mem::take(self) {
                Chunks::One(data) => Some(data),
                _ => None,
            },
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Chunks::Empty => true,
            Chunks::One(_) => false,
            Chunks::Many(queue) => queue.is_empty(),
        }
    }

    /// Bytes held: what the stream's window is owed when they are dropped unread.
    fn held(&self) -> usize {
        match self {
            Chunks::Empty => 0,
            Chunks::One(data) => data.len(),
            Chunks::Many(queue) => queue.iter().map(Bytes::len).sum(),
        }
    }
}

// === impl Sender ===

impl Clone for Sender {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        Sender {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let last = {
            let mut state = self.shared.lock();
            state.senders -= 1;
            state.senders == 0
        };
        if last {
            self.shared.task.notify_one();
        }
    }
}

impl Sender {
    /// The server's current stream limit (the `unheard` value until its SETTINGS arrive).
    pub fn max_streams(&self) -> usize {
        self.shared.lock().max_streams
    }

    /// Whether the connection is gone, or will take no new stream.
    pub fn is_closed(&self) -> bool {
        self.status() != Status::Open
    }

    /// Why the connection ended, once it has.
    pub fn ended(&self) -> Option<Ended> {
        self.shared.lock().ended.clone()
    }

    /// Whether the connection takes new streams.
    pub fn status(&self) -> Status {
        let state = self.shared.lock();
        match state.can_open() {
            Ok(_) => Status::Open,
            Err(_) if state.ended.is_some() => Status::Gone,
            Err(_) => Status::GoingAway,
        }
    }

    /// Waits until a stream may be opened.
    async fn ready(&self) -> Result<(), Error> {
        poll_fn(|cx| {
            let mut state = self.shared.lock();
            match state.can_open() {
                Ok(true) => Poll::Ready(Ok(())),
                Err(ended) => Poll::Ready(Err(Error::Unsent(ended))),
                Ok(false) => {
                    state.waiting.push(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Opens a stream for `req` and waits for the response head. Only the body is taken out of
    /// `req`, once its stream is open: the head stays for a retry (with the `Content-Length`
    /// its body states, if it was added), and on [`Error::Unsent`] the body stays too. The
    /// response head's map is left empty when its fields can go to an HTTP/1.1 client as the
    /// lines they were decoded to ([`Body::take_wire_fields`]). The request's fields are in its
    /// map or in `lines` ([`HeadLines`]), encoded with no map between.
    pub async fn send(
        &mut self,
        req: &mut Request<RequestBody>,
        lines: &HeadLines,
    ) -> Result<Response<Body>, Error> {
        let end = req.body().is_end_stream();
        if let Some(len) = req.body().size_hint().exact() {
            // As hyper does: an empty body is stated only where the method expects one.
            if len != 0 || matches!(*req.method(), Method::POST | Method::PUT | Method::PATCH) {
                req.headers_mut()
                    .entry(http::header::CONTENT_LENGTH)
                    .or_insert_with(|| http::HeaderValue::from(len));
            }
        }
        let stream = self.open(req, lines, end).await?;
        let body = std::mem::take(req.body_mut());
        let pumping = (!end).then(|| {
            let shared = stream.shared.clone();
            pump(&stream.shared, stream.id, pipe(body, shared, stream.id))
        });
        stream.response(pumping, true).await
    }

    /// Sends `head` with `body`, whole and in hand, and waits for the response head; the body
    /// goes out as the windows allow, with no task of its own when it fits them at once. The
    /// response's fields are in its map.
    pub async fn send_whole(&mut self, head: Request<()>, body: Bytes) -> Result<Response<Body>, Error> {
        self.ready().await?;
        let stream = self.open(&head, HeadLines::NONE, false).await?;
        let mut rest = body;
        let sent = {
            let mut state = self.shared.lock();
            state.conn.send_data(stream.id, &mut rest, true).unwrap_or(true)
        };
        self.shared.task.notify_one();
        let pumping = (!sent).then(|| {
            let (shared, id) = (stream.shared.clone(), stream.id);
            pump(&stream.shared, id, async move {
                send(&shared, id, rest, true).await;
                Ok(())
            })
        });
        stream.response(pumping, false).await
    }

    /// Queues the stream's HEADERS once there is room for it; the returned handle resets the
    /// stream if dropped before the response is handed on. Another sender may take the room
    /// [`Self::ready`] saw, so this waits again if it must.
    async fn open<B>(&self, head: &Request<B>, lines: &HeadLines, end: bool) -> Result<Opened, Error> {
        loop {
            if let Some(opened) = self.try_open(head, lines, end)? {
                return Ok(opened);
            }
            self.ready().await?;
        }
    }

    /// [`Self::open`] now, or `Ok(None)` while the stream limit is reached.
    fn try_open<B>(&self, head: &Request<B>, lines: &HeadLines, end: bool) -> Result<Option<Opened>, Error> {
        let uri = head.uri();
        let (scheme, authority) = match &self.shared.origin {
            Some(origin) => (origin.scheme.as_str(), origin.authority.as_str()),
            None => (
                uri.scheme_str().unwrap_or("http"),
                uri.authority().map_or("", |a| a.as_str()),
            ),
        };
        let request = RequestHead {
            method: head.method(),
            scheme,
            authority,
            path: uri.path_and_query().map_or("/", |p| p.as_str()),
            headers: head.headers(),
            lines,
        };
        let id = {
            let mut state = self.shared.lock();
            match state.can_open() {
                Ok(true) => {}
                Ok(false) => return Ok(None),
                Err(ended) => return Err(Error::Unsent(ended)),
            }
            let id = state.conn.open(&request, end).map_err(|e| match e {
                OpenError::Failed(e) => Error::Unsent(Ended::Protocol(e)),
                _ => Error::Unsent(Ended::GoingAway(ErrorCode::NO_ERROR)),
            })?;
            state.slots.insert(id, Slot::default());
            id
        };
        self.shared.task.notify_one();
        Ok(Some(Opened {
            shared: self.shared.clone(),
            id,
            handed_on: false,
        }))
    }
}

/// A stream whose response is awaited; dropped before it is handed on, it resets the stream.
struct Opened {
    shared: Arc<Shared>,
    id: u32,
    handed_on: bool,
}

impl Opened {
    /// Awaits the response head; `keep_lines`: its fields stay lines, unless one must be
    /// rewritten (a hop-by-hop field), rather than going into its map.
    async fn response(
        mut self,
        mut pumping: Option<oneshot::Receiver<String>>,
        keep_lines: bool,
    ) -> Result<Response<Body>, Error> {
        let head = poll_fn(|cx| {
            let mut state = self.shared.lock();
            let Some(slot) = state.slots.get_mut(&self.id) else {
                return Poll::Ready(Err(Error::Connection(Ended::Released)));
            };
            if let Some(head) = slot.head.take() {
                return Poll::Ready(Ok(head));
            }
            if let Some(failed) = slot.failed.as_deref().cloned() {
                return Poll::Ready(Err(failed));
            }
            slot.recv = Some(cx.waker().clone());
            Poll::Pending
        });
        let head = match &mut pumping {
            Some(body_failed) => {
                tokio::select! {
                    biased;
                    head = head => head,
                    Ok(why) = body_failed => Err(Error::RequestBody(why)),
                }
            }
            None => head.await,
        };
        // The pump resets the stream when the body fails, which fails the response too: the
        // body's reason is the one to report.
        let head = match (head, pumping.as_mut().map(oneshot::Receiver::try_recv)) {
            (Err(_), Some(Ok(why))) => Err(Error::RequestBody(why)),
            (head, _) => head,
        }?;
        let mut resp = Response::new(());
        *resp.status_mut() = StatusCode::from_u16(head.status).map_err(|_| Error::Reset {
            code: ErrorCode::PROTOCOL_ERROR,
            cause: Cause::Fault(crate::wire::h2client::StreamFault::Malformed(
                crate::wire::h2client::Malformed::Status,
            )),
        })?;
        let exact = head.content_length;
        let wire = if keep_lines && !head.hop_by_hop {
            Some(head.lines)
        } else {
            // Lines the connection checked are valid fields: nothing is left out.
            let _ = head.lines.into_map(resp.headers_mut());
            None
        };
        self.handed_on = true;
        // A response that ended with its head has nothing more to wait for on the connection.
        let (done, wake_task) = {
            let mut state = self.shared.lock();
            match state.slots.get(&self.id).is_some_and(Slot::is_finished) {
                true => (true, state.finish(self.id)),
                false => (false, false),
            }
        };
        if wake_task {
            self.shared.task.notify_one();
        }
        Ok(resp.map(|()| Body {
            shared: self.shared.clone(),
            id: self.id,
            done,
            exact,
            wire,
            _pumping: pumping,
        }))
    }
}

impl Drop for Opened {
    fn drop(&mut self) {
        if !self.handed_on {
            forget_stream(&self.shared, self.id);
        }
    }
}

/// Takes the stream's slot out, crediting back what it held and resetting the stream if it
/// had not ended.
fn forget_stream(shared: &Shared, id: u32) {
    {
        let mut state = shared.lock();
        let Some(slot) = state.slots.remove(&id) else {
            return;
        };
        let held = slot.data.held();
        state.conn.release(id, held);
        if !slot.done {
            state.conn.reset(id, ErrorCode::CANCEL);
        }
        state.wake_waiting();
    }
    shared.task.notify_one();
}

/// Runs `work` (sending a request body on stream `id`) in a task of its own; the receiver hears
/// why the body failed, if it did. Dropping the receiver (the exchange was abandoned, or its
/// response body is gone) ends the work: a request body is never sent to nobody.
fn pump<F>(shared: &Arc<Shared>, id: u32, work: F) -> oneshot::Receiver<String>
where
    F: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    let (mut failed, rx) = oneshot::channel();
    let shared = shared.clone();
    tokio::spawn(async move {
        let piped = tokio::select! {
            biased;
            _ = failed.closed() => Ok(()),
            piped = work => piped,
        };
        let code = match piped {
            Err(why) => {
                // The reason first: the reset fails the response, which then looks for it.
                let _ = failed.send(why);
                ErrorCode::INTERNAL_ERROR
            }
            Ok(()) => ErrorCode::CANCEL,
        };
        let mut state = shared.lock();
        // A failed body resets its stream. So does one whose response nobody waits for any
        // more (it ended, or was abandoned) while the request was still going out: its stream
        // would otherwise stay open, and count against the server's limit, forever.
        if code == ErrorCode::INTERNAL_ERROR || !state.slots.contains_key(&id) {
            state.conn.reset(id, code);
            state.wake_waiting();
            drop(state);
            shared.task.notify_one();
        }
    });
    rx
}

/// Sends the body; an error is the body's own (the stream's failures end it quietly: the
/// response side reports them).
async fn pipe(mut body: RequestBody, shared: Arc<Shared>, id: u32) -> Result<(), String> {
    let shared = &*shared;
    loop {
        let frame = poll_fn(|cx| {
            // A stream reset meanwhile (the server stopped the upload, or failed it) takes
            // no more: the body is left unread.
            if !stream_takes_data(shared, id, cx) {
                return Poll::Ready(None::<Option<Result<Frame<Bytes>, BoxError>>>);
            }
            Pin::new(&mut body)
                .poll_frame(cx)
                .map(|f| Some(f.map(|f| f.map_err(Into::into))))
        })
        .await;
        let Some(frame) = frame else {
            return Ok(());
        };
        match frame {
            None => {
                send(shared, id, Bytes::new(), true).await;
                return Ok(());
            }
            Some(Err(e)) => return Err(e.to_string()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let end = body.is_end_stream();
                    if !send(shared, id, data, end).await || end {
                        return Ok(());
                    }
                }
                Err(frame) => {
                    if let Ok(trailers) = frame.into_trailers() {
                        let _ = shared.lock().conn.send_trailers(id, &trailers);
                        shared.task.notify_one();
                    }
                    return Ok(());
                }
            },
        }
    }
}

/// Whether stream `id` still takes request data; while it does, `cx` is woken when that may
/// change (the stream's reset wakes its sender).
fn stream_takes_data(shared: &Shared, id: u32, cx: &Context<'_>) -> bool {
    let mut state = shared.lock();
    if !state.conn.is_sending(id) {
        return false;
    }
    if let Some(slot) = state.slots.get_mut(&id) {
        // The body is polled once per frame, mostly by the same task: its waker is kept.
        match &mut slot.send {
            Some(waker) => waker.clone_from(cx.waker()),
            unset => *unset = Some(cx.waker().clone()),
        }
    }
    true
}

/// Sends `data` as the windows allow; `false` once the stream is gone.
async fn send(shared: &Shared, id: u32, mut data: Bytes, end: bool) -> bool {
    poll_fn(|cx| {
        let mut state = shared.lock();
        let sent = state.conn.send_data(id, &mut data, end);
        shared.task.notify_one();
        match sent {
            Err(_) => Poll::Ready(false),
            Ok(true) => Poll::Ready(true),
            Ok(false) => match state.slots.get_mut(&id) {
                Some(slot) if slot.failed.is_none() => {
                    slot.send = Some(cx.waker().clone());
                    Poll::Pending
                }
                _ => Poll::Ready(false),
            },
        }
    })
    .await
}

/// A response body: data as it arrives (its window credited back as it is read), then
/// trailers. Dropped before its end, it resets the stream.
#[derive(Debug)]
pub struct Body {
    shared: Arc<Shared>,
    id: u32,
    done: bool,
    exact: Option<u64>,
    /// The head's fields, when its map was left empty for them.
    wire: Option<WireFields>,
    /// The request body's pump, if it runs: it stops when this goes.
    _pumping: Option<oneshot::Receiver<String>>,
}

impl Body {
    /// The response's fields as HTTP/1.1 lines, when its head's map was left empty for them
    /// (see `wire::fields`); taken once.
    pub fn take_wire_fields(&mut self) -> Option<WireFields> {
        self.wire.take()
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let id = self.id;
        let mut state = self.shared.lock();
        let Some(slot) = state.slots.get_mut(&id) else {
            drop(state);
            self.done = true;
            return Poll::Ready(Some(Err(Error::Connection(Ended::Released))));
        };
        if let Some(data) = slot.data.pop() {
            // The last frame ends the body with it: whoever holds the body may stop polling
            // once it has the bytes it was told of, and the stream must not stay open (nor
            // keepalive PINGs go out on an idle connection) until the body is dropped.
            let last = slot.is_finished();
            state.conn.release(id, data.len());
            let idle = last && state.finish(id);
            let wake_task = idle || !state.conn.out().is_empty();
            drop(state);
            self.done = last;
            if wake_task {
                self.shared.task.notify_one();
            }
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        if let Some(failed) = slot.failed.as_deref().cloned() {
            let wake_task = state.finish(id);
            drop(state);
            self.done = true;
            if wake_task {
                self.shared.task.notify_one();
            }
            return Poll::Ready(Some(Err(failed)));
        }
        if !slot.done {
            slot.recv = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let trailers = slot.trailers.take().map(|fields| *fields);
        let wake_task = state.finish(id);
        drop(state);
        self.done = true;
        if wake_task {
            self.shared.task.notify_one();
        }
        Poll::Ready(trailers.map(|fields| {
            let mut map = HeaderMap::new();
            let _ = fields.lines.into_map(&mut map);
            Ok(Frame::trailers(map))
        }))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        self.exact.map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        if !self.done {
            forget_stream(&self.shared, self.id);
        }
    }
}

#[cfg(test)]
mod tests;
