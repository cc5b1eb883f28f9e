//! A TCP socket's reads and writes through its readiness, without the runtime's per-call
//! budget check.
//!
//! tokio's `AsyncRead` and `AsyncWrite` for `TcpStream` poll the socket's readiness through the
//! task's cooperative budget (a thread-local lookup and its restore guard) and three layers of
//! calls before each `read` or `write`: 8 readiness polls per proxied request on HTTP/1.1,
//! ~77-92 instructions each in the plain build, which the profile-guided build inlines away
//! (callgrind, `benches/RESULTS.md`). Here a read or write checks the readiness flag (`try_io`)
//! and goes straight to the socket; only one that must wait polls the readiness, with the
//! budget. So that a connection's task still gives the thread back when every socket it meets
//! is ready (a client pipelining requests the sidecar answers itself, a fast upstream), the
//! connection spends one unit of the budget per exchange (`downstream::conn`). Only writes made
//! once per exchange come here: a request's head to a plain-TCP upstream when it goes alone,
//! and a response's last write; a body's other writes keep tokio's path and its budget. Of
//! the client's reads, the head's and the watch for its close while the response is awaited.
//!
//! A read that comes back short of the room it had tells the runtime the socket is drained,
//! as tokio's own read does (tokio-rs/tokio#5866): the flag is cleared with the tick read
//! before the `read`, so readiness that arrived after it is kept. Without that the next read
//! on the connection went to the kernel for nothing: a failed `recvfrom` per request. A write
//! that the socket took only part of does the same, as tokio's write does.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, Interest};
use tokio::net::{tcp, unix, TcpStream};

/// Reads what `stream` has into `buf`'s spare room (the caller reserves it); `Ok(0)` at the
/// end of the stream.
pub fn poll_read_buf(
    stream: &TcpStream,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    let room = buf.capacity() - buf.len();
    poll_ready_io(stream, cx, Interest::READABLE, room, || stream.try_read_buf(buf))
}

/// Writes what `stream` takes of `buf` now, waiting only when the socket is not writable.
pub fn poll_write(stream: &TcpStream, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
    poll_ready_io(stream, cx, Interest::WRITABLE, buf.len(), || {
        stream.try_write(buf)
    })
}

/// Runs `op` (a read into, or a write from, `room` bytes) while the socket is ready for
/// `interest`, and waits for readiness only when it is not.
///
/// The outer `try_io` takes the readiness tick before `op`; a short transfer is reported to it
/// as `WouldBlock`, which clears the flag with that tick, and then returned as the count it is.
fn poll_ready_io(
    stream: &TcpStream,
    cx: &mut Context<'_>,
    interest: Interest,
    room: usize,
    mut op: impl FnMut() -> io::Result<usize>,
) -> Poll<io::Result<usize>> {
    loop {
        let (mut ran, mut short) = (false, None);
        let done = stream.try_io(interest, || {
            ran = true;
            let n = op()?;
            if 0 < n && n < room {
                short = Some(n);
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(n)
        });
        // A short transfer's `WouldBlock` is ours, and so is the one of a socket not ready
        // (`op` did not run): neither's kind is asked (a call into std, three a request).
        match (done, short) {
            (Ok(n), _) | (Err(_), Some(n)) => return Poll::Ready(Ok(n)),
            (Err(e), None) if !ran || e.kind() == io::ErrorKind::WouldBlock => {
                if interest.is_readable() {
                    ready!(stream.poll_read_ready(cx))?;
                } else {
                    ready!(stream.poll_write_ready(cx))?;
                }
            }
            (Err(e), None) => return Poll::Ready(Err(e)),
        }
    }
}

/// A socket's read half that can read through [`poll_read_buf`] when it is a TCP socket's.
pub trait ReadNow: AsyncRead + Unpin {
    /// Reads what the socket has into `buf`'s spare room (the caller reserves it), through
    /// the readiness flag where the socket allows it.
    fn poll_read_buf_now(&mut self, cx: &mut Context<'_>, buf: &mut BytesMut) -> Poll<io::Result<usize>> {
        std::pin::pin!(self.read_buf(buf)).poll(cx)
    }
}

impl ReadNow for tcp::ReadHalf<'_> {
    fn poll_read_buf_now(&mut self, cx: &mut Context<'_>, buf: &mut BytesMut) -> Poll<io::Result<usize>> {
        poll_read_buf(self.as_ref(), cx, buf)
    }
}

impl ReadNow for unix::ReadHalf<'_> {}

#[cfg(test)]
impl ReadNow for &[u8] {}

/// A socket's write half that can write through [`poll_write`] when it is a TCP socket's.
pub trait WriteNow: AsyncWrite + Unpin {
    /// As `poll_write`, through the readiness flag where the socket allows it.
    fn poll_write_now(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(self).poll_write(cx, buf)
    }
}

impl WriteNow for tcp::WriteHalf<'_> {
    fn poll_write_now(&mut self, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        poll_write(self.as_ref(), cx, buf)
    }
}

impl WriteNow for unix::WriteHalf<'_> {}

/// All of `buf`, through [`WriteNow::poll_write_now`].
pub async fn write_all_now<W: WriteNow>(wr: &mut W, mut buf: &[u8]) -> io::Result<()> {
    poll_fn(|cx| {
        while !buf.is_empty() {
            match ready!(wr.poll_write_now(cx, buf))? {
                0 => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                n => buf = &buf[n..],
            }
        }
        Poll::Ready(Ok(()))
    })
    .await
}

#[cfg(test)]
mod tests {
    use std::future::{poll_fn, Future};

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

    /// Fills `server`'s socket until the kernel takes nothing more; returns how much it took.
    fn fill(server: &TcpStream) -> usize {
        let chunk = vec![1u8; 64 * 1024];
        let mut filled = 0usize;
        loop {
            match server.try_write(&chunk) {
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return filled,
                Err(e) => panic!("filling: {e}"),
            }
        }
    }

    /// A write the socket cannot take now waits for room, and what it then writes arrives
    /// whole, once and in order after what filled the socket.
    #[tokio::test]
    async fn a_write_waits_for_room_and_loses_nothing() {
        use tokio::io::AsyncReadExt;
        let (mut client, mut server) = pair().await;
        let filled = fill(&server);
        let waiting = poll_fn(|cx| Poll::Ready(poll_write(&server, cx, b"tail"))).await;
        assert!(waiting.is_pending(), "a full socket must make the write wait");
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            client.read_to_end(&mut got).await.unwrap();
            got
        });
        let (_, mut wr) = server.split();
        let written = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            write_all_now(&mut wr, b"tail"),
        );
        written.await.expect("the write never got room").unwrap();
        drop(server);
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), reader)
            .await
            .expect("the reader never saw the end")
            .unwrap();
        assert_eq!(got.len(), filled + 4);
        assert!(got[..filled].iter().all(|b| *b == 1));
        assert_eq!(&got[filled..], b"tail");
    }

    /// A write waiting for room fails when the peer resets the connection, rather than
    /// waiting on.
    #[tokio::test]
    async fn a_waiting_write_fails_when_the_peer_resets() {
        let (client, mut server) = pair().await;
        fill(&server);
        let (_, mut wr) = server.split();
        let mut write = std::pin::pin!(write_all_now(&mut wr, b"more than the socket takes"));
        assert!(
            poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx)))
                .await
                .is_pending(),
            "a full socket must make the write wait"
        );
        // SO_LINGER 0: the close resets the connection.
        client.set_zero_linger().unwrap();
        drop(client);
        let failed = tokio::time::timeout(std::time::Duration::from_secs(10), write)
            .await
            .expect("the write kept waiting after the reset");
        let kind = failed.expect_err("a write to a reset peer must fail").kind();
        assert!(
            matches!(kind, io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe),
            "unexpected error kind {kind:?}"
        );
    }
}
