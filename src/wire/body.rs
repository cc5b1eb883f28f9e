//! The request body as the upstream client sees it: frames the downstream connection task
//! decodes off the socket, handed over through a small bounded channel.
//!
//! The channel holds at most [`BODY_CHANNEL_FRAMES`] frames, so an upload moves at the pace of
//! the upstream with flat memory. The first poll signals the connection task, which is the
//! moment to answer `Expect: 100-continue`: the upstream connection exists and the client wants the
//! body.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{mpsc, oneshot};

use super::codec::BodyError;

/// Frames buffered between the downstream socket and the upstream connection.
pub(super) const BODY_CHANNEL_FRAMES: usize = 2;

/// A request body forwarded upstream.
#[derive(Debug, Default)]
pub enum RequestBody {
    /// No body.
    #[default]
    Empty,
    /// A body streamed from the downstream connection.
    Streaming(StreamingBody),
    /// A body from an HTTP/2 (h2c) downstream stream, trailers included.
    Http2(hyper::body::Incoming),
    /// A body streamed on while a copy of it is kept for a retry ([`RequestBody::keep`]).
    Kept(Box<Kept>),
    /// A kept body, sent again.
    Replay(Replay),
}

/// A body passing through, copied (by reference count: [`Bytes`] are shared, not copied) up to
/// a limit.
#[derive(Debug)]
pub struct Kept {
    inner: RequestBody,
    copy: Arc<Mutex<Copy>>,
}

/// The frames kept so far, and whether they are the whole body.
#[derive(Debug, Default)]
struct Copy {
    frames: Vec<Bytes>,
    len: usize,
    limit: usize,
    complete: bool,
    /// Over the limit, trailers, or an error: cannot be sent again.
    lost: bool,
}

/// The retry loop's handle on a kept body.
#[derive(Debug, Clone)]
pub struct KeptCopy(Arc<Mutex<Copy>>);

impl KeptCopy {
    /// The whole body again, if it passed completely and within the limit.
    pub fn replay(&self) -> Option<RequestBody> {
        let copy = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (copy.complete && !copy.lost).then(|| {
            RequestBody::Replay(Replay {
                frames: copy.frames.iter().rev().cloned().collect(),
                len: copy.len as u64,
            })
        })
    }
}

/// A kept body's frames, last first (each poll pops one).
#[derive(Debug)]
pub struct Replay {
    frames: Vec<Bytes>,
    len: u64,
}

/// The receiving end of a streamed request body.
#[derive(Debug)]
pub struct StreamingBody {
    rx: mpsc::Receiver<Result<Frame<Bytes>, BodyError>>,
    started: Option<oneshot::Sender<()>>,
    length: Option<u64>,
}

/// The connection task's end of a streamed request body.
#[derive(Debug)]
pub struct BodySender {
    /// Where decoded frames go.
    pub tx: mpsc::Sender<Result<Frame<Bytes>, BodyError>>,
    /// Fires when the upstream side first asks for the body.
    pub started: oneshot::Receiver<()>,
}

impl RequestBody {
    /// A streamed body of known `length` (Content-Length) or unknown length (chunked).
    pub fn channel(length: Option<u64>) -> (RequestBody, BodySender) {
        let (tx, rx) = mpsc::channel(BODY_CHANNEL_FRAMES);
        let (started_tx, started) = oneshot::channel();
        let body = StreamingBody {
            rx,
            started: Some(started_tx),
            length,
        };
        (RequestBody::Streaming(body), BodySender { tx, started })
    }

    /// Whether the body is known to be empty (and so can be replayed).
    pub fn is_empty(&self) -> bool {
        matches!(self, RequestBody::Empty)
    }

    /// This body, keeping a copy of what passes for a retry, up to `limit` bytes; `None` when
    /// there is nothing to keep (no body: it replays as it is).
    pub fn keep(&mut self, limit: usize) -> Option<KeptCopy> {
        if self.is_empty() {
            return None;
        }
        let copy = Arc::new(Mutex::new(Copy {
            limit,
            ..Copy::default()
        }));
        let inner = std::mem::take(self);
        *self = RequestBody::Kept(Box::new(Kept {
            inner,
            copy: copy.clone(),
        }));
        Some(KeptCopy(copy))
    }
}

impl Kept {
    fn record(&self, polled: &Poll<Option<Result<Frame<Bytes>, BodyError>>>) {
        let mut copy = self.copy.lock().unwrap_or_else(|p| p.into_inner());
        if copy.lost {
            return;
        }
        match polled {
            Poll::Pending => {}
            Poll::Ready(None) => copy.complete = true,
            Poll::Ready(Some(Ok(frame))) => match frame.data_ref() {
                Some(data) if copy.len + data.len() <= copy.limit => {
                    copy.len += data.len();
                    copy.frames.push(data.clone());
                }
                _ => {
                    copy.lost = true;
                    copy.frames = Vec::new();
                }
            },
            Poll::Ready(Some(Err(_))) => copy.lost = true,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            RequestBody::Empty => Poll::Ready(None),
            RequestBody::Http2(body) => Pin::new(body)
                .poll_frame(cx)
                .map_err(|e| BodyError(format!("reading the HTTP/2 request body: {e}"))),
            RequestBody::Streaming(body) => {
                if let Some(started) = body.started.take() {
                    let _ = started.send(());
                }
                body.rx.poll_recv(cx)
            }
            RequestBody::Kept(kept) => {
                let polled = Pin::new(&mut kept.inner).poll_frame(cx);
                kept.record(&polled);
                if matches!(polled, Poll::Ready(Some(_))) && kept.inner.is_end_stream() {
                    // The last frame: the body is whole without another poll.
                    kept.record(&Poll::Ready(None));
                }
                polled
            }
            RequestBody::Replay(replay) => Poll::Ready(replay.frames.pop().map(|data| {
                replay.len -= data.len() as u64;
                Ok(Frame::data(data))
            })),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Empty => true,
            RequestBody::Http2(body) => body.is_end_stream(),
            RequestBody::Streaming(_) => false,
            RequestBody::Kept(kept) => kept.inner.is_end_stream(),
            RequestBody::Replay(replay) => replay.frames.is_empty(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Empty => SizeHint::with_exact(0),
            RequestBody::Streaming(StreamingBody { length: Some(n), .. }) => SizeHint::with_exact(*n),
            RequestBody::Streaming(_) => SizeHint::default(),
            RequestBody::Http2(body) => body.size_hint(),
            RequestBody::Kept(kept) => kept.inner.size_hint(),
            RequestBody::Replay(replay) => SizeHint::with_exact(replay.len),
        }
    }
}
