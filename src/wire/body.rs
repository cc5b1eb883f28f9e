//! The request body as the upstream client sees it: frames the downstream connection task
//! decodes off the socket, handed over through a small bounded channel.
//!
//! The channel holds at most [`BODY_CHANNEL_FRAMES`] frames, so an upload moves at the pace of
//! the upstream with flat memory. The first poll signals the connection task, which is the
//! moment to answer `Expect: 100-continue`: the upstream connection exists and the client wants the
//! body.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Sleep;

use super::codec::BodyError;

/// Frames buffered between the downstream socket and the upstream connection.
pub(super) const BODY_CHANNEL_FRAMES: usize = 2;

/// A request body forwarded upstream.
#[derive(Debug, Default)]
pub enum RequestBody {
    /// No body.
    #[default]
    Empty,
    /// A body streamed from the downstream connection. Boxed, as is `Http2`: a request is
    /// moved whole several times on its way up, and with these inline it was 296 bytes, past
    /// the 256 that memcpy moves in one short sequence (callgrind: 35 instructions more per
    /// move). A request without a body, the most common, is `Empty` and allocates nothing.
    Streaming(Box<StreamingBody>),
    /// A body from an HTTP/2 (h2c) downstream stream, trailers included.
    Http2(Box<hyper::body::Incoming>),
    /// A body streamed on while a copy of it is kept for a retry ([`RequestBody::keep`]).
    Kept(Box<Kept>),
    /// A kept body, sent again.
    Replay(Replay),
    /// A body whose bytes are counted as they pass (for the access log).
    Counted(Box<Counted>),
}

/// A body and the count of its data bytes so far.
#[derive(Debug)]
pub struct Counted {
    inner: RequestBody,
    bytes: Arc<AtomicU64>,
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
    /// The longest wait for the client's next bytes, and its timer (armed at the first wait).
    idle: Option<(Duration, Option<Pin<Box<Sleep>>>)>,
    /// A frame came since the timer was set.
    moved: bool,
}

/// The error a request body ends with when the client sent nothing for its idle limit.
pub const REQUEST_BODY_IDLE: &str = "no request body bytes from the client for body_idle_timeout";

impl StreamingBody {
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let polled = self.rx.poll_recv(cx);
        let Some((limit, sleep)) = self.idle.as_mut().filter(|_| polled.is_pending()) else {
            self.moved = true;
            return polled;
        };
        let until = tokio::time::Instant::now() + *limit;
        match sleep {
            None => *sleep = Some(Box::pin(tokio::time::sleep_until(until))),
            Some(sleep) if self.moved => sleep.as_mut().reset(until),
            Some(_) => {}
        }
        self.moved = false;
        let timer = sleep.as_mut().expect("armed above");
        match timer.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.idle = None;
                self.rx.close();
                Poll::Ready(Some(Err(BodyError(REQUEST_BODY_IDLE.into()))))
            }
        }
    }
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
            idle: None,
            moved: false,
        };
        (RequestBody::Streaming(Box::new(body)), BodySender { tx, started })
    }

    /// Whether the body is known to be empty (and so can be replayed).
    pub fn is_empty(&self) -> bool {
        matches!(self, RequestBody::Empty)
    }

    /// Ends a body streamed from an HTTP/1.1 client with [`REQUEST_BODY_IDLE`] when the client
    /// sends nothing for `limit` while the upstream waits for more.
    pub fn set_idle_timeout(&mut self, limit: Duration) {
        match self {
            RequestBody::Streaming(body) => body.idle = Some((limit, None)),
            RequestBody::Kept(kept) => kept.inner.set_idle_timeout(limit),
            RequestBody::Counted(counted) => counted.inner.set_idle_timeout(limit),
            _ => {}
        }
    }

    /// Counts this body's data bytes as they pass; `None` for no body.
    pub fn count(&mut self) -> Option<Arc<AtomicU64>> {
        if self.is_empty() {
            return None;
        }
        let bytes = Arc::new(AtomicU64::new(0));
        let inner = std::mem::take(self);
        *self = RequestBody::Counted(Box::new(Counted {
            inner,
            bytes: bytes.clone(),
        }));
        Some(bytes)
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
            RequestBody::Http2(body) => Pin::new(&mut **body)
                .poll_frame(cx)
                .map_err(|e| BodyError(format!("reading the HTTP/2 request body: {e}"))),
            RequestBody::Streaming(body) => {
                if let Some(started) = body.started.take() {
                    let _ = started.send(());
                }
                body.poll_next(cx)
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
            RequestBody::Counted(counted) => {
                let polled = Pin::new(&mut counted.inner).poll_frame(cx);
                if let Poll::Ready(Some(Ok(frame))) = &polled {
                    let len = frame.data_ref().map_or(0, |d| d.len() as u64);
                    counted.bytes.fetch_add(len, Ordering::Relaxed);
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
            RequestBody::Counted(counted) => counted.inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Empty => SizeHint::with_exact(0),
            RequestBody::Streaming(body) => match body.length {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
            RequestBody::Http2(body) => body.size_hint(),
            RequestBody::Kept(kept) => kept.inner.size_hint(),
            RequestBody::Replay(replay) => SizeHint::with_exact(replay.len),
            RequestBody::Counted(counted) => counted.inner.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt as _;

    use super::*;

    /// A request is moved whole several times on its way up; memcpy moves up to 256 bytes in
    /// one short sequence and larger values in a loop (35 instructions more per move).
    #[test]
    fn a_request_stays_within_a_short_move() {
        let size = std::mem::size_of::<http::Request<super::RequestBody>>();
        assert!(size <= 256, "Request<RequestBody> grew to {size} bytes");
    }

    async fn send(frames: &[&'static [u8]], length: Option<u64>) -> RequestBody {
        let (body, sender) = RequestBody::channel(length);
        for frame in frames {
            sender
                .tx
                .send(Ok(Frame::data(Bytes::from_static(frame))))
                .await
                .unwrap();
        }
        drop(sender);
        body
    }

    #[tokio::test]
    async fn a_kept_body_replays_whole_and_within_its_limit() {
        let (mut body, sender) = RequestBody::channel(Some(11));
        let copy = body.keep(64).unwrap();
        let feed = tokio::spawn(async move {
            for frame in [&b"hello"[..], &b" world"[..]] {
                sender
                    .tx
                    .send(Ok(Frame::data(Bytes::from_static(frame))))
                    .await
                    .unwrap();
            }
        });
        assert!(copy.replay().is_none(), "nothing passed yet");
        let first = body.collect().await.unwrap().to_bytes();
        feed.await.unwrap();
        assert_eq!(first, "hello world");
        let replay = copy.replay().expect("whole and within the limit");
        assert_eq!(replay.size_hint().exact(), Some(11));
        assert_eq!(replay.collect().await.unwrap().to_bytes(), "hello world");
        assert!(copy.replay().is_some(), "replayable again");

        let mut big = send(&[b"0123456789", b"0123456789"], None).await;
        let copy = big.keep(15).unwrap();
        assert_eq!(
            big.collect().await.unwrap().to_bytes().len(),
            20,
            "streamed whole"
        );
        assert!(copy.replay().is_none(), "over the limit: not kept");

        assert!(
            RequestBody::Empty.keep(64).is_none(),
            "an empty body replays as it is"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_request_body_ends_with_the_idle_error() {
        let (mut body, sender) = RequestBody::channel(None);
        body.set_idle_timeout(Duration::from_secs(5));
        sender
            .tx
            .send(Ok(Frame::data(Bytes::from_static(b"a"))))
            .await
            .unwrap();
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(first.into_data().unwrap(), "a");
        let started = tokio::time::Instant::now();
        let err = body.frame().await.unwrap().unwrap_err();
        assert_eq!(err.0, REQUEST_BODY_IDLE);
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        drop(sender);
    }
}
