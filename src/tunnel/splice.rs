//! Moving opaque bytes between the application and an upstream once HTTP has ended on both:
//! the one splice that CONNECT tunnels and switched protocols (WebSocket) share.
//!
//! - Bytes the application sent before the splice began (read along with the request head) go
//!   first.
//! - No buffer is held while a tunnel is idle: each read goes into an 8 KiB buffer on the
//!   stack of the poll that made it and is written on at once; only what the other side does
//!   not take then is copied to the heap, and kept until it is written. tokio's
//!   `copy_bidirectional` holds two heap buffers for the tunnel's whole life (16 KiB of the
//!   28 KB an idle CONNECT tunnel cost), where thousands of idle tunnels (a leaky client behind
//!   `HTTPS_PROXY`, idle WebSockets) must stay cheap: the lesson of parked HTTP connections.
//! - Half-close is passed on: when one side finishes sending, the other side's write half is
//!   shut down, and the splice ends once both directions are done (tokio's
//!   `copy_bidirectional` semantics).
//! - An idle deadline closes both sockets after `idle_timeout` without a byte in either
//!   direction; each socket is wrapped to record when it last moved data.
//! - A splice asked to can also end quiet: nothing moved for `quiet_after` (shorter than the
//!   idle timeout), both directions open and nothing held. The tunnel then leaves its task to
//!   wait parked (its keeper's lot, `downstream::park`) and is spliced again when either socket
//!   turns readable, the idle deadline carried over through [`IdleLimits::since`].
//!
//! Not handled here: how either socket was obtained, counting tunnels (the [`Tunnel`] holds
//! its `ActiveGuard`).
//!
//! [`Tunnel`]: super::Tunnel

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};

/// The most one read moves, on the stack of the poll that reads.
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
    /// Nothing moved for [`IdleLimits::quiet_after`], with both directions open and no byte held:
    /// the sockets can wait outside the task, and be spliced again.
    Quiet,
}

impl fmt::Display for SpliceEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SpliceEnd::Closed => f.write_str("closed"),
            SpliceEnd::Idle => f.write_str("idle timeout"),
            SpliceEnd::Error(e) => write!(f, "error: {e}"),
            SpliceEnd::Quiet => f.write_str("quiet"),
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
    /// When a byte last moved either way (or [`IdleLimits::since`], if none did).
    pub(crate) last_moved: Instant,
}

/// When a splice stops for lack of traffic.
#[derive(Debug)]
pub(crate) struct IdleLimits {
    /// Nothing moved for this long: the splice ends ([`SpliceEnd::Idle`]).
    pub(crate) timeout: Duration,
    /// Nothing moved for this long, and nothing is held: the splice returns
    /// [`SpliceEnd::Quiet`]. `None` splices until the end.
    pub(crate) quiet_after: Option<Duration>,
    /// When bytes last moved: now for a new tunnel, earlier for one spliced again.
    pub(crate) since: Instant,
}

/// Copies both ways between `client` and `upstream` until both are done, an error, or no
/// traffic for as long as `idle` says. `early` goes to the upstream first, and is emptied (its
/// memory freed) once written: it is usually the connection's read buffer, not to be held by
/// an idle tunnel.
///
/// Lent, not moved: an async function keeps its arguments for its whole life, and an idle
/// tunnel's task is mostly this function's state (`benches/idle_memory.sh`). For the same
/// reason one timer serves the whole splice, moved on when it fires.
pub(crate) async fn splice<A, B>(
    client: &mut A,
    early: &mut BytesMut,
    upstream: &mut B,
    mut idle: IdleLimits,
) -> Spliced
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    idle.quiet_after = idle.quiet_after.filter(|quiet| *quiet < idle.timeout);
    let activity = Activity::since(idle.since);
    let mut client = Watched::new(client, &activity);
    let mut upstream = Watched::new(upstream, &activity);
    // Quiet counts from this splice's start too: a tunnel woken by a byte that the runtime
    // has yet to report would otherwise be found quiet at once, and parked again unread.
    let started = Instant::now();
    let mut timer = std::pin::pin!(tokio::time::sleep_until(first_check(&idle, idle.since, started)));
    let end = 'end: {
        if !early.is_empty() {
            let write = std::pin::pin!(upstream.write_all(early));
            // Never quiet while early bytes wait to be written: the write would be dropped
            // with them.
            let until = UntilIdle {
                work: write,
                timer: timer.as_mut(),
                activity: &activity,
                idle: &idle,
                quiet_from: None,
            };
            match until.await {
                Until::Done(Ok(())) => {}
                Until::Done(Err(e)) => break 'end SpliceEnd::Error(e),
                // `Quiet` cannot come without `quiet_from`.
                Until::Idle | Until::Quiet => break 'end SpliceEnd::Idle,
            }
            // The write's waits moved the timer on to the idle deadline alone.
            timer.as_mut().reset(first_check(&idle, activity.last(), started));
        }
        *early = BytesMut::new();
        let mut up = Direction::default();
        let mut down = Direction::default();
        loop {
            let copy = std::pin::pin!(std::future::poll_fn(|cx| {
                let up = up.poll_copy(cx, &mut client, &mut upstream)?;
                let down = down.poll_copy(cx, &mut upstream, &mut client)?;
                if up.is_ready() && down.is_ready() {
                    Poll::Ready(Ok::<(), io::Error>(()))
                } else {
                    Poll::Pending
                }
            }));
            let until = UntilIdle {
                work: copy,
                timer: timer.as_mut(),
                activity: &activity,
                idle: &idle,
                quiet_from: Some(started),
            };
            match until.await {
                Until::Done(Ok(())) => break 'end SpliceEnd::Closed,
                Until::Done(Err(e)) => break 'end SpliceEnd::Error(e),
                Until::Idle => break 'end SpliceEnd::Idle,
                Until::Quiet if up.is_quiet() && down.is_quiet() => break 'end SpliceEnd::Quiet,
                // Half closed, or a writer that does not take what it was given: such a
                // tunnel stays in its task to the end.
                Until::Quiet => idle.quiet_after = None,
            }
        }
    };
    Spliced {
        up: upstream.written,
        down: client.written,
        end,
        last_moved: activity.last(),
    }
}

/// When a splice that started at `started`, bytes last moved at `last`, first looks at its
/// clock: the quiet deadline, if it has one and it comes first, else the idle deadline.
fn first_check(idle: &IdleLimits, last: Instant, started: Instant) -> Instant {
    let idle_at = last + idle.timeout;
    match idle.quiet_after {
        Some(quiet) => (last.max(started) + quiet).min(idle_at),
        None => idle_at,
    }
}

/// How [`UntilIdle`] ended.
enum Until<T> {
    Done(T),
    /// Nothing moved for the idle timeout.
    Idle,
    /// Nothing moved for `quiet_after`.
    Quiet,
}

/// Polls `work` until it ends, or until nothing has moved for `idle.timeout` (or for
/// `idle.quiet_after`, when set). The timer is moved on only when it fires, so busy tunnels do not
/// touch the timer wheel per read. A future of its own rather than an async function, which
/// would hold `work` twice (its argument, and the pinned local).
struct UntilIdle<'a, F> {
    work: Pin<&'a mut F>,
    timer: Pin<&'a mut Sleep>,
    activity: &'a Activity,
    idle: &'a IdleLimits,
    /// The splice's start, when this wait may end quiet (`quiet_after` past it as well as
    /// past the last move); `None` when it may not, as the work would be lost with it.
    quiet_from: Option<Instant>,
}

impl<F: Future> Future for UntilIdle<'_, F> {
    type Output = Until<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Poll::Ready(out) = this.work.as_mut().poll(cx) {
            return Poll::Ready(Until::Done(out));
        }
        while this.timer.as_mut().poll(cx).is_ready() {
            let last = this.activity.last();
            let now = Instant::now();
            let idle_at = last + this.idle.timeout;
            if idle_at <= now {
                return Poll::Ready(Until::Idle);
            }
            let quiet = this.quiet_from.zip(this.idle.quiet_after);
            let next = match quiet.map(|(from, after)| last.max(from) + after) {
                Some(quiet_at) if quiet_at <= now => return Poll::Ready(Until::Quiet),
                Some(quiet_at) => quiet_at,
                None => idle_at,
            };
            this.timer.as_mut().reset(next);
        }
        Poll::Pending
    }
}

/// One direction of a splice: bytes read from one side, written to the other.
#[derive(Default)]
struct Direction {
    /// Bytes read but not yet taken by the writer; `None` while they all were.
    pending: Option<Pending>,
    /// Written since the last flush.
    unflushed: bool,
    /// The reader has finished.
    read_done: bool,
    /// The writer was shut down after it: this direction is over.
    done: bool,
}

/// What a writer left of a read.
struct Pending {
    bytes: Box<[u8]>,
    at: usize,
}

impl Direction {
    /// Open both ways, with nothing held or unflushed: nothing is lost if the sockets leave
    /// the task until one of them turns readable.
    fn is_quiet(&self) -> bool {
        self.pending.is_none() && !self.unflushed && !self.read_done && !self.done
    }

    /// Moves bytes from `from` to `to` until either side would block, then until `from` ends
    /// (`Ready`), passing the end on as a shutdown of `to`.
    fn poll_copy<R, W>(&mut self, cx: &mut Context<'_>, from: &mut R, to: &mut W) -> Poll<io::Result<()>>
    where
        R: AsyncRead + Unpin + ?Sized,
        W: AsyncWrite + Unpin + ?Sized,
    {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            if let Some(pending) = &mut self.pending {
                pending.at += write_some(cx, to, &pending.bytes[pending.at..])?;
                if pending.at < pending.bytes.len() {
                    return Poll::Pending;
                }
                self.pending = None;
                self.unflushed = true;
            }
            if self.read_done {
                std::task::ready!(Pin::new(&mut *to).poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            let mut stack = [std::mem::MaybeUninit::<u8>::uninit(); SPLICE_BUF];
            let mut buf = ReadBuf::uninit(&mut stack);
            match Pin::new(&mut *from).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => self.read_done = true,
                Poll::Ready(Ok(())) => {
                    let read = buf.filled();
                    let written = write_some(cx, to, read)?;
                    if written < read.len() {
                        // The writer is full: only what it did not take goes to the heap.
                        self.pending = Some(Pending {
                            bytes: read[written..].into(),
                            at: 0,
                        });
                        return Poll::Pending;
                    }
                    self.unflushed = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if self.unflushed {
                        std::task::ready!(Pin::new(&mut *to).poll_flush(cx))?;
                        self.unflushed = false;
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

/// Writes `bytes` to `to` until it would block; returns how many it took (all of them, or
/// fewer with `cx` registered for when it takes more).
fn write_some<W>(cx: &mut Context<'_>, to: &mut W, bytes: &[u8]) -> io::Result<usize>
where
    W: AsyncWrite + Unpin + ?Sized,
{
    let mut at = 0;
    while at < bytes.len() {
        match Pin::new(&mut *to).poll_write(cx, &bytes[at..]) {
            Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => at += n,
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => break,
        }
    }
    Ok(at)
}

/// When either socket of a splice last moved a byte. An atomic rather than a `Cell` because
/// the connection task holding it must be `Send`.
struct Activity {
    start: Instant,
    last_nanos: AtomicU64,
}

impl Activity {
    /// Last moved at `start`.
    fn since(start: Instant) -> Self {
        Activity {
            start,
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

    /// A splice with no early bytes.
    async fn without_early<A, B>(client: &mut A, upstream: &mut B, idle_timeout: Duration) -> Spliced
    where
        A: AsyncRead + AsyncWrite + Unpin,
        B: AsyncRead + AsyncWrite + Unpin,
    {
        splice(client, &mut BytesMut::new(), upstream, until_idle(idle_timeout)).await
    }

    /// Splices to the end, or for `timeout` of no traffic from now.
    fn until_idle(timeout: Duration) -> IdleLimits {
        IdleLimits {
            timeout,
            quiet_after: None,
            since: Instant::now(),
        }
    }

    #[tokio::test]
    async fn early_bytes_go_first_and_half_close_passes_through() {
        let (mut client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(64);
        let task = tokio::spawn(async move {
            let mut early = BytesMut::from(&b"early "[..]);
            let spliced = splice(
                &mut client_end,
                &mut early,
                &mut upstream_end,
                until_idle(Duration::from_secs(5)),
            )
            .await;
            assert!(
                early.is_empty() && early.capacity() == 0,
                "early bytes freed once written"
            );
            spliced
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

    #[tokio::test]
    async fn a_large_transfer_through_slow_sides_arrives_whole_both_ways() {
        let (client, mut client_end) = tokio::io::duplex(1000);
        let (upstream, mut upstream_end) = tokio::io::duplex(700);
        let task = tokio::spawn(async move {
            without_early(&mut client_end, &mut upstream_end, Duration::from_secs(5)).await
        });
        let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let (up, down) = (sent.clone(), sent.clone());
        let (mut client_rd, mut client_wr) = tokio::io::split(client);
        let (mut upstream_rd, mut upstream_wr) = tokio::io::split(upstream);
        let writers = tokio::spawn(async move {
            client_wr.write_all(&up).await.unwrap();
            client_wr.shutdown().await.unwrap();
            upstream_wr.write_all(&down).await.unwrap();
            upstream_wr.shutdown().await.unwrap();
        });
        let (mut at_upstream, mut at_client) = (Vec::new(), Vec::new());
        let (a, b) = tokio::join!(
            upstream_rd.read_to_end(&mut at_upstream),
            client_rd.read_to_end(&mut at_client)
        );
        a.unwrap();
        b.unwrap();
        writers.await.unwrap();
        assert!(
            at_upstream == sent && at_client == sent,
            "bytes arrive whole and in order"
        );
        let spliced = task.await.unwrap();
        assert!(matches!(spliced.end, SpliceEnd::Closed), "{}", spliced.end);
        assert_eq!((spliced.up, spliced.down), (300_000, 300_000));
    }

    #[tokio::test]
    async fn only_what_the_writer_did_not_take_is_kept_on_the_heap() {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let (mut app, mut from) = tokio::io::duplex(64);
        let (mut to, mut peer) = tokio::io::duplex(4);
        let mut direction = Direction::default();
        app.write_all(b"abc").await.unwrap();
        assert!(direction.poll_copy(&mut cx, &mut from, &mut to).is_pending());
        assert!(direction.pending.is_none(), "all taken: nothing held while idle");
        app.write_all(b"defgh").await.unwrap();
        assert!(direction.poll_copy(&mut cx, &mut from, &mut to).is_pending());
        let kept = direction.pending.as_ref().map(|p| p.bytes.len() - p.at);
        assert_eq!(kept, Some(4), "one byte fitted; the other four are kept");
        let mut got = [0u8; 8];
        peer.read_exact(&mut got[..4]).await.unwrap();
        assert!(direction.poll_copy(&mut cx, &mut from, &mut to).is_pending());
        assert!(direction.pending.is_none(), "written on: the copy is freed");
        peer.read_exact(&mut got[4..]).await.unwrap();
        assert_eq!(&got, b"abcdefgh");
    }

    #[tokio::test(start_paused = true)]
    async fn idle_deadline_moves_with_traffic() {
        let (mut client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(64);
        let started = Instant::now();
        let task = tokio::spawn(async move {
            without_early(&mut client_end, &mut upstream_end, Duration::from_millis(300)).await
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

    /// A quiet splice hands its sockets back with nothing lost, and splicing again from its
    /// last move keeps the idle deadline where it was.
    #[tokio::test(start_paused = true)]
    async fn a_quiet_splice_ends_and_resumes_with_its_idle_deadline() {
        let (mut client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(64);
        let started = Instant::now();
        let idle = IdleLimits {
            timeout: Duration::from_secs(10),
            quiet_after: Some(Duration::from_secs(1)),
            since: started,
        };
        let mut byte = [0u8; 1];
        client.write_all(b"a").await.unwrap();
        let first = splice(&mut client_end, &mut BytesMut::new(), &mut upstream_end, idle).await;
        upstream.read_exact(&mut byte).await.unwrap();
        assert!(matches!(first.end, SpliceEnd::Quiet), "{}", first.end);
        assert_eq!((first.up, first.down, first.last_moved), (1, 0, started));
        assert_eq!(started.elapsed(), Duration::from_secs(1));

        // Bytes that came while no splice ran are moved by the next one.
        upstream.write_all(b"b").await.unwrap();
        let again = IdleLimits {
            timeout: Duration::from_secs(10),
            quiet_after: None,
            since: first.last_moved,
        };
        let resumed = tokio::spawn(async move {
            splice(&mut client_end, &mut BytesMut::new(), &mut upstream_end, again).await
        });
        client.read_exact(&mut byte).await.unwrap();
        assert_eq!(&byte, b"b");
        let moved_at = Instant::now();
        let second = resumed.await.unwrap();
        assert!(matches!(second.end, SpliceEnd::Idle), "{}", second.end);
        assert_eq!((second.up, second.down, second.last_moved), (0, 1, moved_at));
        assert_eq!(
            moved_at.elapsed(),
            Duration::from_secs(10),
            "idle_timeout from the last move"
        );
    }

    /// A half-closed splice is not quiet: its end is passed on, and it stays to the end.
    #[tokio::test(start_paused = true)]
    async fn a_half_closed_splice_is_never_quiet() {
        let (mut client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(64);
        let idle = IdleLimits {
            timeout: Duration::from_secs(5),
            quiet_after: Some(Duration::from_millis(100)),
            since: Instant::now(),
        };
        let task = tokio::spawn(async move {
            splice(&mut client_end, &mut BytesMut::new(), &mut upstream_end, idle).await
        });
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        upstream.read_to_end(&mut rest).await.unwrap();
        let spliced = task.await.unwrap();
        assert!(matches!(spliced.end, SpliceEnd::Idle), "{}", spliced.end);
        drop(client);
    }

    /// Early bytes that the upstream takes slowly are written whole, however long that is
    /// quiet: a splice that ended quiet then would drop them with the write.
    #[tokio::test(start_paused = true)]
    async fn early_bytes_a_slow_upstream_takes_are_never_dropped_for_quiet() {
        let (_client, mut client_end) = tokio::io::duplex(64);
        let (mut upstream, mut upstream_end) = tokio::io::duplex(16);
        let early_bytes: Vec<u8> = (0..100u8).collect();
        let mut early = BytesMut::from(&early_bytes[..]);
        let idle = IdleLimits {
            timeout: Duration::from_secs(10),
            quiet_after: Some(Duration::from_millis(100)),
            since: Instant::now(),
        };
        let task =
            tokio::spawn(async move { splice(&mut client_end, &mut early, &mut upstream_end, idle).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut got = vec![0u8; early_bytes.len()];
        upstream.read_exact(&mut got).await.unwrap();
        assert_eq!(got, early_bytes, "written whole after a second of back-pressure");
        let written_at = Instant::now();
        let spliced = task.await.unwrap();
        assert!(matches!(spliced.end, SpliceEnd::Quiet), "{}", spliced.end);
        assert_eq!(spliced.up, 100);
        assert_eq!(
            written_at.elapsed(),
            Duration::from_millis(100),
            "quiet after the write, not idle at the timeout"
        );
    }
}
