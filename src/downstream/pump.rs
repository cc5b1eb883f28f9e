//! A request body's way from the downstream socket into the body channel the upstream side
//! reads: decoding its framing, answering `Expect: 100-continue` when the upstream asks, and,
//! once the body is in, watching for the client going away.
//!
//! # Cancel safety
//! The connection runs [`BodyPump::step`] beside the proxy call and the response writer in
//! `select!` loops. It is cancel safe: a decoded frame waits in `pending` until a channel
//! permit is held, and socket reads go into the connection buffer, so a step dropped mid-way
//! loses nothing.

use bytes::{Bytes, BytesMut};
use http_body::Frame;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::wait_timer::Hold;
use crate::wire::codec::{BodyError, Decoder};
use crate::wire::BodySender;

/// Read size for request bodies.
const BODY_READ_SIZE: usize = 16 * 1024;
const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Moves a request body from the socket into the body channel.
pub(super) struct BodyPump {
    decoder: Decoder,
    tx: Option<mpsc::Sender<Result<Frame<Bytes>, BodyError>>>,
    /// Present until the upstream side asks for the body (only with `Expect: 100-continue`).
    awaiting_start: Option<oneshot::Receiver<()>>,
    pending: Option<Frame<Bytes>>,
    failed: bool,
}

impl BodyPump {
    pub(super) fn finished() -> Self {
        BodyPump {
            decoder: Decoder::Done,
            tx: None,
            awaiting_start: None,
            pending: None,
            failed: false,
        }
    }

    pub(super) fn new(decoder: Decoder, sender: BodySender, expect_continue: bool) -> Self {
        BodyPump {
            decoder,
            tx: Some(sender.tx),
            awaiting_start: expect_continue.then_some(sender.started),
            pending: None,
            failed: false,
        }
    }

    pub(super) fn is_active(&self) -> bool {
        self.tx.is_some() && !self.failed
    }

    /// The whole body was read off the socket (so the connection can carry another request).
    /// A frame decoded but not passed on does not count against it: its bytes are read.
    pub(super) fn is_complete(&self) -> bool {
        self.decoder.is_done() && !self.failed
    }

    /// Takes in, without waiting, what of the body was already read off the socket, passing
    /// it on while the upstream side still takes it and dropping it once it stopped reading.
    /// Returns whether the whole body is now in. Done before the request goes up (so that the
    /// body can go with its head) and again once the response is ready.
    ///
    /// Whether the pump got to bytes that came with the head before the response was ready
    /// is a matter of scheduling (the response can be decided before the pump's first step,
    /// or win its race against the step that would read them): the connection's fate must
    /// not be. A body still to come is not waited for.
    #[inline(always)]
    pub(super) fn take_in_buffered(&mut self, buf: &mut BytesMut, max_trailer: usize) -> bool {
        // A body read whole, or none (most requests): nothing to take in. Checked first, and
        // inlined, as every request comes here (callgrind: 86 instructions per request
        // without it).
        if self.pending.is_none() && self.decoder.is_done() {
            if self.tx.is_some() {
                self.end_body();
            }
            return !self.failed;
        }
        self.take_in_more(buf, max_trailer)
    }

    /// The end of the body, sent by dropping its sender.
    #[inline(never)]
    fn end_body(&mut self) {
        self.tx = None;
    }

    /// [`Self::take_in_buffered`] for a body not all in yet.
    #[inline(never)]
    fn take_in_more(&mut self, buf: &mut BytesMut, max_trailer: usize) -> bool {
        // Waiting for 100 Continue, the client has sent no body: `abandon_unstarted` decides.
        while !self.failed && self.awaiting_start.is_none() {
            if let Some(frame) = self.pending.take() {
                if let Some(tx) = self.tx.as_ref() {
                    match tx.try_send(Ok(frame)) {
                        Ok(()) => {}
                        Err(mpsc::error::TrySendError::Full(frame)) => {
                            // The upstream side gets it, and the rest, while the response goes.
                            self.pending = frame.ok();
                            return self.is_complete();
                        }
                        // The upstream side stopped reading: the rest is read only to drop it.
                        Err(mpsc::error::TrySendError::Closed(_)) => self.tx = None,
                    }
                }
            }
            match self.decoder.decode(buf, max_trailer) {
                Ok(Some(frame)) => self.pending = Some(frame),
                Ok(None) => break,
                Err(e) => self.fail(e),
            }
        }
        if self.decoder.is_done() && self.pending.is_none() {
            self.tx = None; // end of body
        }
        self.is_complete()
    }

    /// The response is under way without the upstream having asked for the body: the client,
    /// which waits for 100 Continue, will not send it, so stop waiting for it.
    /// Returns whether a body was abandoned (the connection cannot carry another request).
    #[inline(always)]
    pub(super) fn abandon_unstarted(&mut self) -> bool {
        if self.awaiting_start.is_none() {
            return false;
        }
        self.abandon();
        true
    }

    #[inline(never)]
    fn abandon(&mut self) {
        self.awaiting_start = None;
        self.end_body();
    }

    /// Tells the upstream side the body is broken (it aborts the upstream request).
    pub(super) fn fail(&mut self, err: BodyError) {
        tracing::debug!(error = %err, "request body failed");
        self.failed = true;
        if let Some(tx) = self.tx.take() {
            let _ = tx.try_send(Err(err));
        }
    }

    /// While the body flows, one [`BodyPump::step`]; after it, waits for the client to close
    /// (an error), keeping any pipelined bytes, up to `max_head` of them, in `buf`: once
    /// `deferred`, when given, has gone off.
    pub(super) async fn step_or_watch<R: crate::sock::ReadNow, W: AsyncWrite + Unpin>(
        &mut self,
        rd: &mut R,
        buf: &mut BytesMut,
        wr: &mut W,
        max_trailer: usize,
        max_head: usize,
        deferred: Option<&Hold<'_>>,
    ) -> Result<(), BodyError> {
        if self.is_active() {
            return self.step(rd, buf, Some(wr), max_trailer).await;
        }
        if self.failed || buf.len() >= max_head {
            return std::future::pending().await;
        }
        if let Some(hold) = deferred {
            hold.gone_off().await;
        }
        // Any room will do to see the close or pipelined bytes. Reserving more while the
        // request's head still shares the buffer's memory allocated a new buffer for every
        // request (callgrind).
        if buf.capacity() == buf.len() {
            buf.reserve(1024);
        }
        // Once an exchange, so past the runtime's budget check (see `crate::sock`).
        match std::future::poll_fn(|cx| rd.poll_read_buf_now(cx, buf)).await {
            Ok(0) => Err(BodyError("client closed the connection".into())),
            Ok(_) => Ok(()),
            Err(e) => Err(BodyError(format!("client connection: {e}"))),
        }
    }

    /// One step: answer 100-continue, or read from the socket, or pass one frame on.
    pub(super) async fn step<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(
        &mut self,
        rd: &mut R,
        buf: &mut BytesMut,
        wr: Option<&mut W>,
        max_trailer: usize,
    ) -> Result<(), BodyError> {
        if let Some(started) = self.awaiting_start.as_mut() {
            let Some(wr) = wr else {
                return std::future::pending().await;
            };
            // Either the upstream asked for the body, or it will never ask (its side dropped).
            let _ = started.await;
            self.awaiting_start = None;
            wr.write_all(CONTINUE)
                .await
                .map_err(|e| BodyError(format!("writing 100 Continue: {e}")))?;
            return Ok(());
        }
        if self.pending.is_none() {
            match self.decoder.decode(buf, max_trailer)? {
                Some(frame) => self.pending = Some(frame),
                None if self.decoder.is_done() => {
                    self.tx = None; // end of body
                    return Ok(());
                }
                None => {
                    buf.reserve(BODY_READ_SIZE);
                    return match rd.read_buf(buf).await {
                        Ok(0) => Err(BodyError("client closed the connection mid-body".into())),
                        Ok(_) => Ok(()),
                        Err(e) => Err(BodyError(format!("reading request body: {e}"))),
                    };
                }
            }
        }
        let Some(tx) = self.tx.as_ref() else {
            return Ok(());
        };
        // The frame stays in `pending` until a permit is held (cancel safety).
        let delivered = match tx.reserve().await {
            Ok(permit) => {
                permit.send(Ok(self.pending.take().expect("set above")));
                true
            }
            Err(_) => false,
        };
        // Not delivered: the upstream side stopped reading (it answered early or failed). The
        // frame is dropped; what is left of the body stays unread, but for what came with
        // the head (`take_in_buffered`), and a body left unread closes the connection.
        if !delivered {
            self.pending = None;
        }
        if !delivered || self.decoder.is_done() {
            self.tx = None;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;

    use crate::wire::codec::{BodyFraming, Decoder};
    use crate::wire::RequestBody;

    /// A pump for a `Content-Length: 4` body, and the upstream side's end of its channel.
    fn four_bytes() -> (super::BodyPump, RequestBody) {
        let (body, sender) = RequestBody::channel(Some(4));
        (
            super::BodyPump::new(Decoder::new(BodyFraming::Length(4)), sender, false),
            body,
        )
    }

    /// The response can be ready before the pump's first step: a body that came with its head
    /// is still read whole, whether the upstream side takes it or has stopped reading, and
    /// the pipelined bytes after it are left for the next request.
    #[test]
    fn a_buffered_body_is_taken_in_when_the_response_is_ready() {
        for upstream_reads in [true, false] {
            let (mut pump, body) = four_bytes();
            let kept = upstream_reads.then_some(body);
            let mut buf = BytesMut::from(&b"dataGET /next"[..]);
            assert!(
                pump.take_in_buffered(&mut buf, 1024),
                "upstream reads: {upstream_reads}"
            );
            assert!(pump.is_complete() && !pump.is_active());
            assert_eq!(&buf[..], b"GET /next");
            drop(kept);
        }
    }

    /// Part of the body still to come: not waited for, and the connection cannot go on.
    #[test]
    fn a_body_not_all_in_is_not_waited_for() {
        let (mut pump, _body) = four_bytes();
        let mut buf = BytesMut::from(&b"da"[..]);
        assert!(!pump.take_in_buffered(&mut buf, 1024));
        assert!(!pump.is_complete() && pump.is_active());
        assert!(buf.is_empty());
    }

    /// While a request without a body waits for its response, the pump watches the client
    /// for a close: it must read into the room its buffer has left, not reserve a new buffer
    /// (the request's head still shares the old one's memory, so every request allocated).
    #[tokio::test]
    async fn watching_for_the_close_reads_into_the_room_left() {
        let mut buf = bytes::BytesMut::with_capacity(1024);
        buf.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
        let head = buf.split_to(buf.len()).freeze();
        let (room, start) = (buf.capacity(), buf.as_ptr());
        assert!(room < 1024);
        let mut pump = super::BodyPump::finished();
        let mut pipelined: &[u8] = b"GET /next";
        let mut client = tokio::io::sink();
        let watched = pump.step_or_watch(&mut pipelined, &mut buf, &mut client, 1024, 8192, None);
        watched.await.unwrap();
        assert_eq!(&buf[..], b"GET /next");
        assert_eq!(
            buf.as_ptr(),
            start,
            "read into the {room} bytes left, not a new buffer"
        );
        assert_eq!(&head[..], b"GET / HTTP/1.1\r\n\r\n");
    }
}
