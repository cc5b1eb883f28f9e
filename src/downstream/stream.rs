//! The sockets applications connect on: TCP, and the Unix socket of `listen_unix`.
//!
//! The HTTP/1.1 server (`conn`), h2c (`h2c`) and parking (`park`) are generic over [`Stream`],
//! so each socket type gets its own compiled copy of them and the TCP path stays what it was: no
//! dispatch per read or write. What differs is set here, once per connection:
//! - accept: TCP sets `TCP_NODELAY` and names the peer by address; a Unix-socket accept reads
//!   the peer's credentials (one `getsockopt`) and names the process, from a cache that reads
//!   `/proc` only for a process not seen in the last seconds (`clients::process`);
//! - parking: a parked connection is its bare file descriptor; its [`Source`] (an address for
//!   TCP, a process for the Unix socket) says which socket type to resume it as.
//!
//! Not handled here: HTTP (`conn`, `h2c`), the accounting by source (`clients`).

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::task::{Context, Poll};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, Interest};
use tokio::net::{tcp, unix, TcpListener, TcpStream, UnixListener, UnixStream};

use crate::clients::{ProcessCache, Source};

/// An application socket.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send + Sync + Sized + 'static {
    /// The borrowed read half of [`Stream::split`].
    type Read<'a>: crate::sock::ReadNow + Send
    where
        Self: 'a;
    /// The borrowed write half of [`Stream::split`].
    type Write<'a>: crate::sock::WriteNow + Send
    where
        Self: 'a;

    /// Read and write halves usable at once (no lock, no allocation).
    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>);

    /// Waits until the socket is readable (data, end of stream or an error).
    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send;

    /// Reads what the socket has into `buf`'s spare room; `Ok(0)` at the end of the stream.
    fn poll_read_buf(&mut self, cx: &mut Context<'_>, buf: &mut BytesMut) -> Poll<io::Result<usize>> {
        std::pin::pin!(self.read_buf(buf)).poll(cx)
    }

    /// Reads without consuming.
    fn peek<'a>(&'a self, buf: &'a mut [u8]) -> impl Future<Output = io::Result<usize>> + Send + 'a;

    /// Leaves the runtime, to wait in the parking lot as a bare descriptor (see [`Source`]).
    fn into_parked(self) -> io::Result<OwnedFd>;
}

// === impl Stream for TcpStream ===

impl Stream for TcpStream {
    type Read<'a> = tcp::ReadHalf<'a>;
    type Write<'a> = tcp::WriteHalf<'a>;

    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        TcpStream::split(self)
    }

    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send {
        TcpStream::readable(self)
    }

    fn poll_read_buf(&mut self, cx: &mut Context<'_>, buf: &mut BytesMut) -> Poll<io::Result<usize>> {
        crate::sock::poll_read_buf(self, cx, buf)
    }

    fn peek<'a>(&'a self, buf: &'a mut [u8]) -> impl Future<Output = io::Result<usize>> + Send + 'a {
        TcpStream::peek(self, buf)
    }

    fn into_parked(self) -> io::Result<OwnedFd> {
        self.into_std().map(OwnedFd::from)
    }
}

// === impl Stream for UnixStream ===

impl Stream for UnixStream {
    type Read<'a> = unix::ReadHalf<'a>;
    type Write<'a> = unix::WriteHalf<'a>;

    fn split(&mut self) -> (Self::Read<'_>, Self::Write<'_>) {
        UnixStream::split(self)
    }

    fn readable(&self) -> impl Future<Output = io::Result<()>> + Send {
        UnixStream::readable(self)
    }

    async fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        // tokio has no `peek` for Unix sockets: wait for readiness, then `recv(MSG_PEEK)`.
        loop {
            UnixStream::readable(self).await?;
            let fd = self.as_raw_fd();
            match self.try_io(Interest::READABLE, || recv_peek(fd, buf)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                peeked => return peeked,
            }
        }
    }

    fn into_parked(self) -> io::Result<OwnedFd> {
        self.into_std().map(OwnedFd::from)
    }
}

pub(super) fn recv_peek(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the whole call, and `fd` is
    // borrowed from a stream that stays open across it; recv writes at most `len` bytes.
    #[allow(unsafe_code)]
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

// === peers and accepting ===

/// A listening socket the accept loop takes connections from.
pub(crate) trait Accept: Send + Sync + 'static {
    type Stream: Stream;

    fn accept(&self) -> impl Future<Output = io::Result<(Self::Stream, Source)>> + Send;
}

impl Accept for TcpListener {
    type Stream = TcpStream;

    async fn accept(&self) -> io::Result<(TcpStream, Source)> {
        let (stream, addr) = TcpListener::accept(self).await?;
        let _ = stream.set_nodelay(true);
        Ok((stream, Source::Tcp(addr)))
    }
}

/// The Unix listener, with the processes its peers were recently found to be.
#[derive(Debug)]
pub(crate) struct UnixAccept {
    pub(crate) listener: UnixListener,
    pub(crate) processes: ProcessCache,
}

impl Accept for UnixAccept {
    type Stream = UnixStream;

    async fn accept(&self) -> io::Result<(UnixStream, Source)> {
        let (stream, _) = self.listener.accept().await?;
        let process = match stream.peer_cred() {
            Ok(cred) => {
                let pid = cred.pid().and_then(|p| u32::try_from(p).ok());
                self.processes.lookup(pid, cred.uid())
            }
            // Not expected from a Unix stream socket; the connection is still served, counted
            // under an unknown process.
            Err(e) => {
                tracing::debug!(error = %e, "no peer credentials");
                self.processes.lookup(None, u32::MAX)
            }
        };
        Ok((stream, Source::Unix(process)))
    }
}
