//! A TCP socket's reads through its readiness, without the runtime's per-read budget check.
//!
//! tokio's `AsyncRead` for `TcpStream` polls the socket's readiness through the task's
//! cooperative budget (a thread-local lookup and its restore guard) and three layers of calls
//! before each `read`: 8 readiness polls per proxied request on HTTP/1.1, ~92 instructions
//! each in the plain build, which the profile-guided build inlines away (callgrind,
//! `benches/RESULTS.md`). Here a read checks the readiness flag (`try_io`) and goes straight
//! to the socket; only a read that must wait polls the readiness, which is where the budget
//! matters: a connection's task waits at least once per request, for the upstream, so it
//! still yields to the others.
//!
//! A read that comes back short of the room it had tells the runtime the socket is drained,
//! as tokio's own read does (tokio-rs/tokio#5866): the flag is cleared with the tick read
//! before the `read`, so readiness that arrived after it is kept. Without that the next read
//! on the connection went to the kernel for nothing: a failed `recvfrom` per request.

use std::io;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Reads what `stream` has into `buf`'s spare room (the caller reserves it); `Ok(0)` at the
/// end of the stream.
pub fn poll_read_buf(
    stream: &TcpStream,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    loop {
        let room = buf.capacity() - buf.len();
        let mut short = None;
        // The outer `try_io` takes the readiness tick before the read; a short read is
        // reported to it as `WouldBlock`, which clears the flag with that tick.
        let read = stream.try_io(Interest::READABLE, || {
            let n = stream.try_read_buf(buf)?;
            if 0 < n && n < room {
                short = Some(n);
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(n)
        });
        match read {
            Ok(n) => return Poll::Ready(Ok(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => match short {
                Some(n) => return Poll::Ready(Ok(n)),
                None => ready!(stream.poll_read_ready(cx))?,
            },
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use tokio::io::AsyncWriteExt;

    use super::*;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    /// Bytes that arrive after a short read cleared the flag still wake the next read, and the
    /// end of the stream reads as 0.
    #[tokio::test]
    async fn reads_wait_for_bytes_after_a_short_read_and_see_the_end() {
        let (mut client, server) = pair().await;
        let mut buf = BytesMut::with_capacity(64);
        client.write_all(b"first").await.unwrap();
        let n = poll_fn(|cx| poll_read_buf(&server, cx, &mut buf)).await.unwrap();
        assert_eq!(&buf[..n], b"first");
        let writer = tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            client.write_all(b"second").await.unwrap();
            client
        });
        buf.clear();
        let n = poll_fn(|cx| poll_read_buf(&server, cx, &mut buf)).await.unwrap();
        assert_eq!(&buf[..n], b"second");
        drop(writer.await.unwrap());
        buf.clear();
        let n = poll_fn(|cx| poll_read_buf(&server, cx, &mut buf)).await.unwrap();
        assert_eq!(n, 0, "the peer closed");
    }

    /// A read that fills its room leaves the flag set: the rest is read without a wait.
    #[tokio::test]
    async fn a_full_read_leaves_the_rest_to_the_next() {
        let (mut client, server) = pair().await;
        client.write_all(&[7u8; 100]).await.unwrap();
        // Let all 100 bytes arrive before the first read.
        server.readable().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        let mut buf = BytesMut::with_capacity(64);
        let cap = buf.capacity();
        let first = poll_fn(|cx| poll_read_buf(&server, cx, &mut buf)).await.unwrap();
        assert_eq!(first, cap);
        buf.reserve(100);
        let second = poll_fn(|cx| poll_read_buf(&server, cx, &mut buf)).await.unwrap();
        assert_eq!(first + second, 100);
    }
}
