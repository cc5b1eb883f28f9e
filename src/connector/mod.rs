//! One upstream connection: an endpoint from the upstream's set, dial, TLS, and the HTTP/1.1 client side (or the HTTP/2
//! handshake and its driver task). It knows nothing of pools.
//!
//! A connection's place under its pool's `max_connections` must live exactly as long as its
//! socket, so the pool hands each dial an opaque [`Place`] that the connection (HTTP/1.1) or its
//! driver task (HTTP/2) holds and drops with the socket. The connector only ever drops it, or
//! says the connection failed; what it counts is the pool's business.
//!
//! Not handled here: which connection a request gets (`pool`), retries and deadlines
//! (`upstream`).

pub mod dial;
pub mod h1;
pub mod http2;
pub mod parent;
mod pinned;
pub mod tls;

use std::fmt;
use std::future::Future;
use std::io;
use std::os::fd::OwnedFd;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::endpoint::Claim;
use crate::error::ProxyError;

/// A connection's place under its pool's cap, held for as long as the socket is open.
pub trait Place: Send + Sync + fmt::Debug + 'static {
    /// The connection ended with an error (unless a reason was already recorded).
    fn failed(&self);

    /// The dial reached an endpoint: `claim` counts the connection in its load for as long
    /// as the place is held.
    fn connected(&self, claim: Claim);
}

/// A byte stream to an upstream: TCP, TLS over TCP, or what a switched protocol left of one.
/// Whether it may wait outside the runtime as a bare descriptor (a quiet tunnel parks) is the
/// stream's to say: only plain TCP may, as TLS keeps state no descriptor holds.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {
    /// Whether [`Io::into_parked`] would succeed.
    fn may_park(&self) -> bool {
        false
    }

    /// The stream as a bare descriptor, out of the runtime; an error (the stream dropped) for
    /// one that may not park.
    fn into_parked(self: Box<Self>) -> io::Result<OwnedFd> {
        Err(io::Error::other("only a plain TCP upstream can be parked"))
    }
}

impl<S: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for tokio_rustls::client::TlsStream<S> {}

impl Io for hyper_util::rt::TokioIo<hyper::upgrade::Upgraded> {}

/// The stand-in a tunnel holds while its stream is parked.
impl Io for tokio::io::Empty {}

/// The request handle of one upstream HTTP/2 connection (cloned per stream).
pub type H2Sender = http2::Sender;

/// A freshly dialed connection, by the protocol it speaks.
// Not boxed: moved once per dial, into the pool's entry, which is boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Dialed {
    /// HTTP/1.1: one request at a time, run by the task of the request it carries.
    Http1(h1::Connection),
    /// HTTP/2: many streams, up to the server's SETTINGS_MAX_CONCURRENT_STREAMS, which the
    /// connection's driver task keeps current ([`http2::Sender::max_streams`]).
    Http2(H2Sender),
}

/// Dials a new connection; `place` must live as long as the connection's socket.
pub trait Connect: Send + Sync + fmt::Debug + 'static {
    /// Opens a connection that holds `place` (in its driver task, for HTTP/2).
    fn connect(
        &self,
        place: Box<dyn Place>,
    ) -> Pin<Box<dyn Future<Output = Result<Dialed, ProxyError>> + Send + '_>>;
}
