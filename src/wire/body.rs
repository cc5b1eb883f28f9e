//! The request body as the upstream client sees it: frames the downstream connection task
//! decodes off the socket, handed over through a small bounded channel.
//!
//! The channel holds at most [`BODY_CHANNEL_FRAMES`] frames, so an upload moves at the pace of
//! the upstream with flat memory. The first poll signals the connection task, which is the
//! moment to answer `Expect: 100-continue`: the upstream connection exists and the client wants the
//! body.

use std::pin::Pin;
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
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Empty => true,
            RequestBody::Http2(body) => body.is_end_stream(),
            RequestBody::Streaming(_) => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            RequestBody::Empty => SizeHint::with_exact(0),
            RequestBody::Streaming(StreamingBody { length: Some(n), .. }) => SizeHint::with_exact(*n),
            RequestBody::Streaming(_) => SizeHint::default(),
            RequestBody::Http2(body) => body.size_hint(),
        }
    }
}
