//! Moving opaque bytes between the application and an upstream once HTTP has ended on both:
//! the one splice that CONNECT tunnels and switched protocols (WebSocket) share.
//!
//! - Bytes the application sent before the splice began (read along with the request head) go
//!   first.
//! - Each direction has an 8 KiB buffer: a tunnel is usually a chatty stream, not a bulk copy,
//!   and thousands of idle WebSockets must stay cheap.
//! - Half-close is passed on: when one side finishes sending, the other side's write half is
//!   shut down, and the splice ends once both directions are done (tokio's
//!   `copy_bidirectional` semantics).
//! - An idle deadline closes both sockets after `idle_timeout` without a byte in either
//!   direction; tokio's copy has none, so each socket is wrapped to record when it last moved
//!   data.
//!
//! Not handled here: how either socket was obtained, counting tunnels (callers hold an
//! [`ActiveGuard`]).

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::Instant;

/// Buffer per direction.
const SPLICE_BUF: usize = 8 * 1024;

/// Why a splice ended.
#[derive(Debug)]
pub(crate) enum SpliceEnd {
    /// Both sides finished sending.
    Closed,
    /// Nothing moved for the idle timeout.
    Idle,
    /// A socket failed (usually a reset).
    Error(io::Error),
}

impl fmt::Display for SpliceEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpliceEnd::Closed => f.write_str("closed"),
            SpliceEnd::Idle => f.write_str("idle timeout"),
            SpliceEnd::Error(e) => write!(f, "error: {e}"),
        }
    }
}

/// What a splice moved, and how it ended.
#[derive(Debug)]
pub(crate) struct Spliced {
    /// Bytes from the application to the upstream, early bytes included.
    pub(crate) up: u64,
    /// Bytes from the upstream to the application.
    pub(crate) down: u64,
    pub(crate) end: SpliceEnd,
}

/// Copies both ways between `client` and `upstream` until both are done, an error, or
/// `idle_timeout` without traffic. `early` goes to the upstream first.
pub(crate) async fn splice<A, B>(
    client: &mut A,
    early: &[u8],
    upstream: &mut B,
    idle_timeout: Duration,
) -> Spliced
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let activity = Activity::new();
    let mut client = Watched::new(client, &activity);
    let mut upstream = Watched::new(upstream, &activity);
    let end = 'end: {
        if !early.is_empty() {
            match tokio::time::timeout(idle_timeout, upstream.write_all(early)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => break 'end SpliceEnd::Error(e),
                Err(_) => break 'end SpliceEnd::Idle,
            }
        }
        let copy =
            tokio::io::copy_bidirectional_with_sizes(&mut client, &mut upstream, SPLICE_BUF, SPLICE_BUF);
        tokio::pin!(copy);
        // Re-armed only when it fires, so busy tunnels do not touch the timer wheel per read.
        let mut deadline = Instant::now() + idle_timeout;
        loop {
            tokio::select! {
                done = &mut copy => break 'end match done {
                    Ok(_) => SpliceEnd::Closed,
                    Err(e) => SpliceEnd::Error(e),
                },
                () = tokio::time::sleep_until(deadline) => {
                    let next = activity.last() + idle_timeout;
                    if next <= Instant::now() {
                        break 'end SpliceEnd::Idle;
                    }
                    deadline = next;
                }
            }
        }
    };
    Spliced {
        up: upstream.written,
        down: client.written,
        end,
    }
}

/// When either socket of a splice last moved a byte. An atomic rather than a `Cell` because
/// the connection task holding it must be `Send`.
struct Activity {
    start: Instant,
    last_nanos: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_nanos: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let nanos = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_nanos.store(nanos, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.start + Duration::from_nanos(self.last_nanos.load(Ordering::Relaxed))
    }
}

/// A socket that records activity and counts what was written to it. Writes count as activity
/// too: a peer that drains a large backlog slowly is not idle.
struct Watched<'a, T: ?Sized> {
    io: &'a mut T,
    activity: &'a Activity,
    written: u64,
}

impl<'a, T: ?Sized> Watched<'a, T> {
    fn new(io: &'a mut T, activity: &'a Activity) -> Self {
        Watched {
            io,
            activity,
            written: 0,
        }
    }
}

impl<T: AsyncRead + Unpin + ?Sized> AsyncRead for Watched<'_, T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut *this.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin + ?Sized> AsyncWrite for Watched<'_, T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut *this.io).poll_write(cx, data);
        if let Poll::Ready(Ok(n)) = polled {
            if n > 0 {
                this.written += n as u64;
                this.activity.touch();
            }
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn early_bytes_go_first_and_half_close_passes_through() {
        let (mut client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(64);
        let task = tokio::spawn(async move {
            splice(
                &mut client_end,
                b"early ",
                &mut upstream_end,
                Duration::from_secs(5),
            )
            .await
        });
        client.write_all(b"late").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        upstream.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"early late");
        upstream.write_all(b"reply").await.unwrap();
        upstream.shutdown().await.unwrap();
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"reply");
        let spliced = task.await.unwrap();
        assert!(matches!(spliced.end, SpliceEnd::Closed), "{}", spliced.end);
        assert_eq!((spliced.up, spliced.down), (10, 5));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_deadline_moves_with_traffic() {
        let (mut client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(64);
        let started = Instant::now();
        let task = tokio::spawn(async move {
            splice(
                &mut client_end,
                b"",
                &mut upstream_end,
                Duration::from_millis(300),
            )
            .await
        });
        let mut byte = [0u8; 1];
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            client.write_all(b"x").await.unwrap();
            upstream.read_exact(&mut byte).await.unwrap();
        }
        let spliced = task.await.unwrap();
        assert!(matches!(spliced.end, SpliceEnd::Idle), "{}", spliced.end);
        let lived = started.elapsed();
        assert!(
            lived >= Duration::from_millis(1300) && lived < Duration::from_millis(1400),
            "{lived:?}"
        );
    }
}
