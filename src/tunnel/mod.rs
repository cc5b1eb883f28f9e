//! A tunnel: a CONNECT dialed and answered `200`, or an upgrade answered `101`, from then to
//! its end. It owns the pair ([`Tunnel`]: the client's bytes sent early, the upstream stream,
//! its count in `egress_tunnels_active`, its access-log line and span), splicing bytes both
//! ways in a task of its own ([`spawn`]), going quiet, the [`Dormant`] record a quiet tunnel
//! waits as outside any task, waking, and the end: the debug log saying how it ended and the
//! access-log line.
//!
//! Whoever keeps the client's side (the downstream connection it came on) does so through
//! [`Keeper`]: how long the tunnel may idle, whether it may leave its task when quiet, the lot
//! that holds it then, and the accounting once it has ended. Whether the upstream side can
//! wait as a bare descriptor is the stream's to say ([`Io::may_park`]).
//!
//! An idle tunnel must stay cheap: a leaky client behind `HTTPS_PROXY` leaves one per leak,
//! and idle WebSockets wait for minutes (`benches/idle_memory.sh`). So a tunnel is spliced in a
//! task of its own, after the connection's task (and every future it held) is gone, and after
//! its keeper's quiet time without a byte it leaves that task too.
//!
//! Not handled here: checking, dialing and answering a CONNECT (`proxy::connect`), sending an
//! upgrade and answering its `101` (`proxy::upgrade`), the lot quiet tunnels park in
//! (`downstream::park`).

mod splice;

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

use crate::access_log::{AccessLog, Record};
use crate::caught;
use crate::connector::h1::Transport;
use crate::connector::Io;
use crate::metrics::ActiveGuard;
use splice::{IdleLimits, SpliceEnd};

/// A tunnel's access-log line, and when its CONNECT came: boxed, as most tunnels are not
/// logged and this waits in every idle tunnel's task.
pub type Line = Option<Box<(Arc<AccessLog>, Record, std::time::Instant)>>;

/// A tunnel answered (`200` to a CONNECT, or a `101` passed on), to be spliced.
/// Handed back by the code that answered it rather than spliced there so that an idle tunnel
/// holds no more than its splice's state: [`spawn`] runs it in a task of its own.
pub struct Tunnel {
    /// The dialed target, or the upstream connection that switched protocols.
    upstream: Box<dyn Io>,
    /// What the client sent behind its request head: the tunnel's first bytes.
    early: BytesMut,
    /// Kept until it closes, spliced or parked.
    books: Bookkeeping,
}

/// What a tunnel keeps from its answer to its close, whether spliced ([`Tunnel`]) or parked
/// ([`Dormant`]).
struct Bookkeeping {
    /// Counts the tunnel open until it closes.
    _active: ActiveGuard,
    /// The access-log line, written when the tunnel closes.
    line: Line,
    /// The tunnel's span when enabled (a debug span: at the default level it is not): boxed
    /// for the same reason as the line, 40 bytes.
    span: Option<Box<tracing::Span>>,
}

impl Bookkeeping {
    /// Logs how the tunnel ended and writes its access-log line.
    fn close(&mut self, end: &dyn std::fmt::Display) {
        let _entered = self.span.as_deref().map(tracing::Span::enter);
        tracing::debug!(%end, "spliced connection closed");
        if let Some((log, mut record, started)) = self.line.take().map(|line| *line) {
            record.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
            log.write(&record);
        }
    }
}

impl std::fmt::Debug for Tunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnel").finish_non_exhaustive()
    }
}

impl Tunnel {
    /// A tunnel to `upstream`, counted open in `active`, whose first bytes (from the client)
    /// are what `buf` holds; the buffer goes with the tunnel. Its span is the current one.
    pub fn new(upstream: Box<dyn Io>, buf: &mut BytesMut, active: ActiveGuard) -> Self {
        Tunnel {
            upstream,
            early: std::mem::take(buf),
            books: Bookkeeping {
                _active: active,
                line: None,
                span: Some(tracing::Span::current())
                    .filter(|span| !span.is_disabled())
                    .map(Box::new),
            },
        }
    }

    /// This tunnel, writing `line` (its bytes and duration filled in) when it closes.
    pub fn with_line(mut self, line: Line) -> Self {
        self.books.line = line;
        self
    }

    /// Moves bytes between `client` and the upstream until both close or nothing moves for
    /// `idle.timeout`, then writes the access-log line; or, with `idle.quiet_after`, until
    /// nothing has moved for that long, returning the instant it would close for idling
    /// (`Some`) with the tunnel intact, to be spliced again later. Borrows the tunnel rather
    /// than taking it, so that the task it runs in holds it once.
    async fn splice(
        &mut self,
        client: &mut (impl AsyncRead + AsyncWrite + Unpin),
        idle: IdleLimits,
    ) -> Option<Instant> {
        let timeout = idle.timeout;
        let spliced = splice::splice(client, &mut self.early, &mut self.upstream, idle).await;
        if let Some((_, record, _)) = self.books.line.as_deref_mut() {
            record.bytes_in += spliced.up;
            record.bytes_out += spliced.down;
        }
        if let SpliceEnd::Quiet = spliced.end {
            return Some(spliced.last_moved + timeout);
        }
        self.books.close(&spliced.end);
        None
    }

    /// The tunnel with its upstream socket out of the runtime, to wait parked. Only for a
    /// tunnel whose upstream [`may_park`](Io::may_park). Should the socket not leave the
    /// runtime, the tunnel is closed (its line written) and the error returned.
    fn into_dormant(mut self) -> io::Result<Dormant> {
        let upstream = std::mem::replace(&mut self.upstream, Box::new(tokio::io::empty()));
        match upstream.into_parked() {
            Ok(upstream) => Ok(Dormant {
                upstream,
                books: self.books,
            }),
            Err(e) => {
                self.books.close(&e);
                Err(e)
            }
        }
    }
}

/// Our own stream back from what hyper made of a connection that switched protocols (two boxes
/// and its read buffer, kept by every idle WebSocket otherwise), and the bytes hyper read past
/// the `101`, which go to the client first.
pub fn unwrap_upgraded(upgraded: Upgraded) -> (Box<dyn Io>, Bytes) {
    match upgraded.downcast::<TokioIo<Box<dyn Io>>>() {
        Ok(parts) => (parts.io.into_inner(), parts.read_buf),
        Err(upgraded) => (Box::new(TokioIo::new(upgraded)), Bytes::new()),
    }
}

/// A quiet tunnel waiting parked, outside any task: its upstream socket as a bare descriptor
/// (its keeper keeps the client's), still counted open, its line still to be written.
pub struct Dormant {
    upstream: OwnedFd,
    books: Bookkeeping,
}

impl std::fmt::Debug for Dormant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dormant")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

impl Dormant {
    /// The upstream socket, to watch for readiness.
    pub fn upstream_fd(&self) -> BorrowedFd<'_> {
        self.upstream.as_fd()
    }

    /// Back in the runtime, to be spliced again ([`spawn`]). Should its socket not be
    /// registered again, the tunnel is closed (its line written) and the error returned.
    pub fn wake(self) -> io::Result<Tunnel> {
        let Dormant { upstream, mut books } = self;
        match tokio::net::TcpStream::from_std(std::net::TcpStream::from(upstream)) {
            Ok(tcp) => Ok(Tunnel {
                upstream: Box::new(Transport::Plain(tcp)),
                early: BytesMut::new(),
                books,
            }),
            Err(e) => {
                books.close(&e);
                Err(e)
            }
        }
    }

    /// Closes a tunnel whose socket could not be resumed or parked; returns the error.
    pub fn close_failed(self, e: io::Error) -> io::Error {
        self.close(&e);
        e
    }

    /// Closes a tunnel whose idle timeout ran out while parked.
    pub fn close_idle(self) {
        self.close(&SpliceEnd::Idle);
    }

    /// Closes the upstream socket, then logs and writes the line.
    fn close(self, end: &dyn std::fmt::Display) {
        let Dormant { upstream, mut books } = self;
        drop(upstream);
        books.close(end);
    }
}

/// Who keeps a tunnel's client side, `C`: what the tunnel needs of the downstream connection
/// it came on. Asked when the tunnel's task starts, told when the tunnel parks or ends.
pub trait Keeper<C>: Send + Sized + 'static {
    /// Nothing moved either way for this long: the tunnel closes.
    fn idle_timeout(&self) -> Duration;

    /// Nothing moved for this long: the tunnel leaves its task to wait in [`Keeper::park`];
    /// `None` when it cannot now (no lot, or draining).
    fn park_after(&self) -> Option<Duration>;

    /// Takes over a quiet tunnel whose task is ending, with the client's socket, to close at
    /// `deadline` unless either socket turns readable first (then [`Dormant::wake`] and
    /// [`spawn`] it again).
    fn park(self, client: C, tunnel: Dormant, deadline: Instant);

    /// The tunnel has ended (its access-log line written) and the client's socket is closed:
    /// the connection's own accounting.
    fn closed(self);
}

/// Splices `tunnel` with `client` in a task of its own, under the net of `crate::caught`
/// (`panics` counts one), its bytes last moved `since`. Once nothing has moved for its
/// keeper's [`park_after`](Keeper::park_after) (when `parks`, and its upstream may park) the
/// task ends too and the tunnel goes to its keeper's lot.
pub fn spawn<C, K>(client: C, tunnel: Tunnel, since: Instant, parks: bool, keeper: K, panics: Counter)
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    K: Keeper<C>,
{
    // Not instrumented: the tunnel's own span (a child of the connection's) is entered for
    // what it logs, and a second one would wait in every idle tunnel's task.
    tokio::spawn(caught::Caught::new(
        splicing(client, tunnel, since, parks, keeper),
        panics,
    ));
}

/// The task of [`spawn`]: an `async` block, not an `async fn`, which would hold its arguments
/// twice (as given, and moved into its body) in every idle tunnel's task.
#[allow(clippy::manual_async_fn)]
fn splicing<C, K>(
    mut client: C,
    mut tunnel: Tunnel,
    since: Instant,
    parks: bool,
    keeper: K,
) -> impl Future<Output = ()> + Send + 'static
where
    C: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    K: Keeper<C>,
{
    async move {
        let quiet_after = if parks {
            keeper.park_after().filter(|_| tunnel.upstream.may_park())
        } else {
            None
        };
        let idle = IdleLimits {
            timeout: keeper.idle_timeout(),
            quiet_after,
            since,
        };
        let Some(idle_deadline) = tunnel.splice(&mut client, idle).await else {
            drop((client, tunnel));
            return keeper.closed();
        };
        match tunnel.into_dormant() {
            Ok(tunnel) => keeper.park(client, tunnel, idle_deadline),
            Err(e) => {
                tracing::debug!(error = %e, "cannot park a quiet tunnel");
                drop(client);
                keeper.closed();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::net::{TcpListener, TcpStream};

    /// A client socket, and a tunnel to a plain upstream socket (counted in a registry of its
    /// own).
    async fn client_and_tunnel() -> (TcpStream, super::Tunnel) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let upstream = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let metrics = crate::metrics::Metrics::new();
        let tunnel = super::Tunnel::new(
            Box::new(super::Transport::Plain(upstream)),
            &mut bytes::BytesMut::new(),
            super::ActiveGuard::new(&metrics, "connect"),
        );
        (client, tunnel)
    }

    /// An idle tunnel's task is mostly this future (plus the task's header and the two
    /// sockets' registrations): keep it from creeping up unnoticed.
    #[tokio::test]
    async fn an_idle_tunnel_future_stays_small() {
        let (mut client, mut tunnel) = client_and_tunnel().await;
        let established = std::mem::size_of_val(&tunnel);
        let idle = super::IdleLimits {
            timeout: std::time::Duration::from_secs(60),
            quiet_after: Some(std::time::Duration::from_secs(1)),
            since: super::Instant::now(),
        };
        let splice = tunnel.splice(&mut client, idle);
        let size = std::mem::size_of_val(&splice);
        println!("established {established} B, its splice {size} B");
        // 480 bytes (debug build) when the tunnel went to a task of its own, 1,782 B per idle
        // CONNECT tunnel in all (benches/idle_memory.sh, release). 448 since the early bytes
        // are lent to the splice, not moved in, and one timer serves all of it; the tunnel
        // itself went 120 -> 72 bytes (its span and start boxed with what uses them). In a
        // release build the tunnel task's future went 720 -> 640 bytes, which with tokio's
        // task header and trailer (128-byte aligned) is one 128-byte block less per tunnel.
        // 584 since a splice can end quiet and be resumed (the idle limits it keeps, and
        // when it started): a quiet tunnel's task now ends after `downstream::park`'s
        // PARK_AFTER, so this is held while bytes move, and by tunnels that cannot park.
        assert!(size <= 584, "an idle tunnel's future grew to {size} bytes");
        assert!(established <= 72, "an idle tunnel grew to {established} bytes");
    }

    /// What a tunnel's task holds is its splice and what it was given, once: an `async fn`
    /// would hold the tunnel, the client's socket and the keeper twice.
    #[tokio::test]
    async fn a_tunnel_task_holds_its_arguments_once() {
        /// A keeper the size of a downstream connection's side of a tunnel, doing nothing.
        struct Kept {
            _room: [u64; 10],
        }
        impl super::Keeper<TcpStream> for Kept {
            fn idle_timeout(&self) -> std::time::Duration {
                std::time::Duration::from_secs(60)
            }
            fn park_after(&self) -> Option<std::time::Duration> {
                None
            }
            fn park(self, _: TcpStream, _: super::Dormant, _: super::Instant) {}
            fn closed(self) {}
        }
        let (client, tunnel) = client_and_tunnel().await;
        let given =
            std::mem::size_of_val(&client) + std::mem::size_of_val(&tunnel) + std::mem::size_of::<Kept>();
        let task = super::splicing(
            client,
            tunnel,
            super::Instant::now(),
            true,
            Kept { _room: [0; 10] },
        );
        let size = std::mem::size_of_val(&task);
        println!("a tunnel's task: {size} B, of which given {given} B");
        // The splice (584 B in a test build, `an_idle_tunnel_future_stays_small`), what the
        // task was given, and a few words: the idle limits, `since`, `parks`.
        assert!(size <= 584 + given + 48, "a tunnel's task grew to {size} bytes");
    }
}
