//! Writing one response to a downstream HTTP/1.1 connection: the head encoded without awaiting,
//! then the body, with small frames coalesced into one write and streamed events flushed as
//! they arrive.

use std::io;
use std::pin::Pin;
use std::task::Poll;

use bytes::{Buf, Bytes};
use http::{Response, Version};
use http_body::{Body, Frame};
use tokio::io::{AsyncWrite, AsyncWriteExt};

use crate::sock::{write_all_now, WriteNow};
use crate::spare::WriteBuf;
use crate::wire::codec::{self, ResponseFraming};
use crate::wire::WireFields;

/// Body data up to this size is copied next to its framing to save a write.
const COALESCE_LIMIT: usize = 16 * 1024;

fn response_framing<B: Body>(
    resp: &Response<B>,
    wire: Option<&WireFields>,
    head_only: bool,
    client: Version,
) -> ResponseFraming {
    let status = resp.status();
    if head_only || status.is_informational() || status == 204 || status == 304 {
        ResponseFraming::None
    } else if wire.is_some_and(WireFields::has_content_length)
        || resp.headers().contains_key(http::header::CONTENT_LENGTH)
    {
        ResponseFraming::Length
    } else if client == Version::HTTP_11 {
        ResponseFraming::Chunked
    } else {
        ResponseFraming::Close
    }
}

/// A response head encoded for the wire, and how its body goes after it.
pub(super) struct Outgoing {
    /// The head, and body bytes held back to go out with it.
    out: WriteBuf,
    framing: ResponseFraming,
    keep_alive: bool,
}

/// Encodes `resp`'s head (no await: the head and its fields are gone before the body is
/// written, so the writing future holds only the body's progress). The caller then keeps the
/// body through [`into_body`]: a map taken out here would leave an empty one in the response,
/// whose drop runs three destructors (61 instructions a response, callgrind).
/// `wire`: fields the upstream's head left as lines (`wire::fields`), written after the map's.
pub(super) fn encode_response<B: Body>(
    resp: &mut Response<B>,
    wire: Option<WireFields>,
    head_only: bool,
    client: Version,
    keep_alive: bool,
) -> Outgoing {
    let mut framing = response_framing(resp, wire.as_ref(), head_only, client);
    if framing == ResponseFraming::Chunked && resp.body().is_end_stream() {
        resp.headers_mut()
            .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from_static("0"));
        framing = ResponseFraming::Length;
    }
    let keep_alive = keep_alive && framing != ResponseFraming::Close;
    let reason = resp
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| r.as_bytes());
    let mut out = WriteBuf::take(512);
    codec::encode_head(
        resp.status(),
        reason,
        resp.headers(),
        wire.as_ref().map_or(&[][..], WireFields::lines),
        framing,
        keep_alive,
        client,
        &mut out,
    );
    Outgoing {
        out,
        framing,
        keep_alive,
    }
}

/// Writes a response; returns whether the connection may be reused afterwards.
pub(super) async fn write_response<B, W: WriteNow>(
    wr: &mut W,
    mut resp: Response<B>,
    head_only: bool,
    client: Version,
    keep_alive: bool,
) -> io::Result<bool>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let outgoing = encode_response(&mut resp, None, head_only, client, keep_alive);
    let mut body = into_body(resp);
    write_body(wr, &mut body, outgoing).await
}

/// The body of a response whose head [`encode_response`] encoded; its fields go back to the
/// thread's spares.
pub(super) fn into_body<B>(resp: Response<B>) -> B {
    let (parts, body) = resp.into_parts();
    crate::spare::give_back_headers(parts.headers);
    body
}

/// Writes an encoded head and then `body`; returns whether the connection may be reused.
///
/// The head and small body frames are held back to go out in one write. If the body fails,
/// what was held back still goes out before the error ends the connection: the application
/// sees the upstream's head and a body cut short, whether the failure came with the first
/// frame or a later one, never a bare close.
///
/// The body is lent, not moved in: a request's future would otherwise hold the response once
/// more at each level it passes through.
pub(super) async fn write_body<B, W: WriteNow>(
    wr: &mut W,
    body: &mut B,
    outgoing: Outgoing,
) -> io::Result<bool>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let Outgoing {
        mut out,
        framing,
        keep_alive,
    } = outgoing;
    if framing == ResponseFraming::None || body.is_end_stream() {
        write_all_now(wr, &out).await?;
        return Ok(keep_alive);
    }
    let chunked = framing == ResponseFraming::Chunked;
    let mut body = Pin::new(body);
    // A body that says it has ended is not polled again to hear it (one poll through the
    // body's layers less for most responses, whose one frame ends them).
    let mut ended = false;
    loop {
        // Take what the body has now; flush before waiting, so streamed events (SSE) go out
        // as they arrive and small responses go out in one write.
        let frame = match ended {
            true => None,
            false => match poll_now(body.as_mut()) {
                Some(frame) => frame,
                None => {
                    if !out.is_empty() {
                        wr.write_all(&out).await?;
                        out.clear();
                    }
                    std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await
                }
            },
        };
        let frame = match frame {
            None => {
                if chunked {
                    codec::encode_last_chunk(None, &mut out);
                }
                write_all_now(wr, &out).await?;
                return Ok(keep_alive);
            }
            Some(Err(e)) => {
                let _ = wr.write_all(&out).await;
                return Err(io::Error::other(format!("upstream body: {e}")));
            }
            Some(Ok(frame)) => frame,
        };
        match frame.into_data() {
            Ok(data) => write_data(wr, &mut out, data, chunked).await?,
            Err(frame) => {
                if let (Ok(trailers), true) = (frame.into_trailers(), chunked) {
                    codec::encode_last_chunk(Some(&trailers), &mut out);
                    wr.write_all(&out).await?;
                    return Ok(keep_alive);
                }
            }
        }
        ended = body.is_end_stream();
    }
}

async fn write_data<W: AsyncWrite + Unpin>(
    wr: &mut W,
    out: &mut WriteBuf,
    mut data: Bytes,
    chunked: bool,
) -> io::Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    if chunked {
        codec::encode_chunk_header(data.len(), out);
    }
    if data.len() <= COALESCE_LIMIT {
        out.extend_from_slice(&data);
    } else {
        wr.write_all(out).await?;
        out.clear();
        while data.has_remaining() {
            wr.write_buf(&mut data).await?;
        }
    }
    if chunked {
        out.extend_from_slice(b"\r\n");
    }
    if out.len() >= COALESCE_LIMIT {
        wr.write_all(out).await?;
        out.clear();
    }
    Ok(())
}

type FrameResult<B> = Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>;

/// Polls the body once without waiting.
fn poll_now<B: Body>(mut body: Pin<&mut B>) -> Option<FrameResult<B>> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    match body.as_mut().poll_frame(&mut cx) {
        Poll::Ready(frame) => Some(frame),
        Poll::Pending => None,
    }
}

#[cfg(test)]
mod tests {
    /// A body that yields its frames, then fails, all at once (an upstream whose reset arrived
    /// with its first bytes).
    struct FailsAfter(std::collections::VecDeque<bytes::Bytes>);

    impl http_body::Body for FailsAfter {
        type Data = bytes::Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, &'static str>>> {
            std::task::Poll::Ready(Some(match self.0.pop_front() {
                Some(data) => Ok(http_body::Frame::data(data)),
                None => Err("connection reset"),
            }))
        }
    }

    /// The soak run caught a bare close here: the head and first bytes were held back for one
    /// write, and a body failing before that write dropped them.
    #[tokio::test]
    async fn a_body_failing_before_the_first_write_still_sends_the_head() {
        use tokio::io::AsyncReadExt;
        let (mut client, mut server) = crate::downstream::testing::tcp_pair().await;
        let body = FailsAfter([bytes::Bytes::from_static(b"partial")].into());
        let resp = http::Response::builder()
            .header("content-length", "1000")
            .body(body)
            .unwrap();
        let (_, mut wr) = server.split();
        let written = super::write_response(&mut wr, resp, false, http::Version::HTTP_11, true).await;
        assert!(written.is_err(), "a failed body must end the connection");
        drop(server);
        let mut received = Vec::new();
        client.read_to_end(&mut received).await.unwrap();
        let text = String::from_utf8_lossy(&received);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text:?}");
        assert!(text.ends_with("\r\n\r\npartial"), "{text:?}");
    }
}
