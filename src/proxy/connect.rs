//! CONNECT tunnels, what `HTTPS_PROXY` clients ask for: check the target against policy, dial
//! it, answer `200 Connection Established`, then splice bytes both ways until both sides close
//! or nothing moves for `downstream.idle_timeout`. The splice is the caller's to run
//! ([`Established::splice`]), in a task of its own: an idle tunnel then holds nothing else.
//!
//! The sidecar sees nothing inside a tunnel (usually TLS end to end), so nothing in it can be
//! pooled; the refusal texts say so, pointing applications at plain `http://` requests. After a
//! tunnel, or a refused CONNECT, the downstream connection is closed, never reused for HTTP.
//!
//! Checks, in order: a CONNECT with a body or a malformed target is `400 bad_request`;
//! `policy.connect: false` or a port outside `policy.connect_ports` is `403 denied`; a host
//! refused by `allow_hosts`/`deny_hosts` is `403 denied`; the sidecar's own listener is
//! `508 loop` (also after resolving). Dialing uses `defaults.connect_timeout`.
//!
//! Not handled here: parsing the CONNECT head (`wire::codec`), moving bytes
//! (`proxy::splice`).

use std::any::Any;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use bytes::BytesMut;
use http::Uri;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::Instant;
use tracing::Instrument;

pub use super::splice::Idle;
use super::splice::{self, SpliceEnd};
use super::Proxy;
use crate::access_log::{AccessLog, Record};
use crate::clients::Source;
use crate::config::{Authority, Scheme};
use crate::connector::dial::{self, DialTarget};
use crate::connector::h1::Transport;
use crate::connector::parent::Parent;
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::ActiveGuard;
use crate::redact;
use crate::routing::Tunnel;
use crate::upstream::Io;
use crate::wire::codec::BodyFraming;

const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// How a CONNECT ended, or what it became.
#[derive(Debug)]
pub enum TunnelEnd {
    /// An error response was sent; the client may still be sending (the caller lingers).
    Refused,
    /// The client left before the tunnel was established.
    Closed,
    /// Answered `200` here without dialing (`policy.connect_inspect`): what the client sends
    /// inside is the downstream server's to read.
    Inspect(Authority),
    /// Established and answered `200`: the caller splices it ([`Established::splice`]).
    Established(Box<Established>),
}

/// A tunnel answered (`200` to a CONNECT, or a `101` passed on), waiting for its splice.
/// Handed to the caller rather than spliced here so that an idle tunnel holds no more than its
/// splice's state: the caller runs it in a task of its own, after the connection's task (and
/// every future it held) is gone.
pub struct Established {
    /// The dialed target, or the upstream connection that switched protocols.
    upstream: Box<dyn Io>,
    /// What the client sent behind its request head: the tunnel's first bytes.
    early: BytesMut,
    /// Counts the tunnel open until the splice ends.
    _active: ActiveGuard,
    /// The access-log line, written when the tunnel closes, and when the CONNECT came; boxed,
    /// as most tunnels are not logged and this waits in every idle tunnel's task.
    line: Option<Box<(Arc<AccessLog>, Record, std::time::Instant)>>,
    /// The tunnel's span when enabled (a debug span: at the default level it is not): boxed
    /// for the same reason, 40 bytes.
    span: Option<Box<tracing::Span>>,
}

impl std::fmt::Debug for Established {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Established").finish_non_exhaustive()
    }
}

impl Established {
    /// A tunnel to `upstream`, counted open in `active`, whose first bytes (from the client)
    /// are what `buf` holds; the buffer goes with the tunnel.
    pub(super) fn new(upstream: Box<dyn Io>, buf: &mut BytesMut, active: ActiveGuard) -> Self {
        Established {
            upstream,
            early: std::mem::take(buf),
            _active: active,
            line: None,
            span: Some(tracing::Span::current())
                .filter(|span| !span.is_disabled())
                .map(Box::new),
        }
    }

    /// Moves bytes between `client` and the upstream until both close or nothing moves for
    /// `idle.timeout`, then writes the access-log line; or, with `idle.quiet_after`, until
    /// nothing has moved for that long, returning the instant it would close for idling
    /// (`Some`) with the tunnel intact, to be spliced again later. Borrows the tunnel rather
    /// than taking it, so that the task it runs in holds it once.
    pub async fn splice(
        &mut self,
        client: &mut (impl AsyncRead + AsyncWrite + Unpin),
        idle: Idle,
    ) -> Option<Instant> {
        let timeout = idle.timeout;
        let spliced = splice::splice(client, &mut self.early, &mut self.upstream, idle).await;
        if let Some((_, record, _)) = self.line.as_deref_mut() {
            record.bytes_in += spliced.up;
            record.bytes_out += spliced.down;
        }
        if let SpliceEnd::Quiet = spliced.end {
            return Some(spliced.last_moved + timeout);
        }
        self.close(&spliced.end);
        None
    }

    /// Logs how it ended and writes the access-log line.
    fn close(&mut self, end: &dyn std::fmt::Display) {
        let _entered = self.span.as_deref().map(tracing::Span::enter);
        tracing::debug!(%end, "spliced connection closed");
        if let Some((log, mut record, started)) = self.line.take().map(|line| *line) {
            record.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
            log.write(&record);
        }
    }

    /// Whether the upstream side can wait as a bare descriptor ([`Established::into_dormant`]):
    /// plain TCP, which TLS and the test pipes are not.
    pub fn can_park(&self) -> bool {
        let upstream: &dyn Any = &*self.upstream;
        matches!(upstream.downcast_ref::<Transport>(), Some(Transport::Plain(_)))
    }

    /// The tunnel with its upstream socket out of the runtime, to wait parked. Only for a
    /// tunnel that [`can_park`](Established::can_park). Should the socket not leave the
    /// runtime, the tunnel is closed (its line written) and the error returned.
    pub fn into_dormant(mut self) -> io::Result<Dormant> {
        let upstream: Box<dyn Io> = std::mem::replace(&mut self.upstream, Box::new(tokio::io::empty()));
        let upstream: Box<dyn Any> = upstream;
        let left = match upstream.downcast::<Transport>().map(|transport| *transport) {
            Ok(Transport::Plain(tcp)) => tcp.into_std().map(OwnedFd::from),
            _ => Err(io::Error::other("only a plain TCP upstream can be parked")),
        };
        match left {
            Ok(upstream) => Ok(Dormant {
                upstream,
                _active: self._active,
                line: self.line,
                span: self.span,
            }),
            Err(e) => {
                self.close(&e);
                Err(e)
            }
        }
    }
}

/// A quiet tunnel waiting parked, outside any task: its upstream socket as a bare descriptor
/// (the caller keeps the client's), still counted open, its line still to be written.
pub struct Dormant {
    upstream: OwnedFd,
    _active: ActiveGuard,
    line: Option<Box<(Arc<AccessLog>, Record, std::time::Instant)>>,
    span: Option<Box<tracing::Span>>,
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

    /// Back in the runtime, to be spliced again. Should its socket not be registered again,
    /// the tunnel is closed (its line written) and the error returned.
    pub fn wake(self) -> io::Result<Established> {
        let (upstream, mut tunnel) = self.into_parts();
        let std = std::net::TcpStream::from(upstream);
        match tokio::net::TcpStream::from_std(std) {
            Ok(tcp) => {
                tunnel.upstream = Box::new(Transport::Plain(tcp));
                Ok(tunnel)
            }
            Err(e) => {
                tunnel.close(&e);
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

    fn close(self, end: &dyn std::fmt::Display) {
        let (upstream, mut tunnel) = self.into_parts();
        drop(upstream);
        tunnel.close(end);
    }

    /// The socket, and the tunnel without it (an empty stand-in, which allocates nothing).
    fn into_parts(self) -> (OwnedFd, Established) {
        let tunnel = Established {
            upstream: Box::new(tokio::io::empty()),
            early: BytesMut::new(),
            _active: self._active,
            line: self.line,
            span: self.span,
        };
        (self.upstream, tunnel)
    }
}

/// Serves a CONNECT whose head has been read from `client` up to its answer: an error, the
/// `200` of a tunnel answered here, or the `200` of an established tunnel, returned for the
/// caller to splice. `buf` holds whatever the client sent after the head, which goes through
/// the tunnel first. `source` is where the access log says the CONNECT came from (`None`
/// when it is off).
pub async fn serve(
    client: &mut (impl AsyncRead + AsyncWrite + Unpin),
    buf: &mut BytesMut,
    target: &Uri,
    framing: BodyFraming,
    proxy: &Proxy,
    source: Option<Source>,
) -> TunnelEnd {
    let span = tracing::debug_span!("tunnel", target = %redact::uri(target));
    let started = std::time::Instant::now();
    let mut line = proxy.access_log.as_ref().filter(|log| log.sampled()).map(|log| {
        let authority = target.authority().map_or("-", |a| redact::authority(a.as_str()));
        let authority = authority.to_owned();
        let record = Record::begin(
            std::time::SystemTime::now(),
            source,
            "CONNECT".to_owned(),
            authority.clone(),
            authority,
        );
        (log.clone(), record)
    });
    let end = async {
        let opened = match check(target, framing, proxy) {
            Ok(Tunnel::Opaque(authority)) => dial_opaque(&authority, proxy).await,
            Ok(Tunnel::Inspect(authority)) => {
                if let Err(e) = client.write_all(ESTABLISHED).await {
                    tracing::debug!(error = %e, "client left before the tunnel was established");
                    return TunnelEnd::Closed;
                }
                tracing::debug!("tunnel answered here; reading what the client sends in it");
                return TunnelEnd::Inspect(authority);
            }
            Err(err) => Err(err),
        };
        let upstream = match opened {
            Ok(upstream) => upstream,
            Err(err) => {
                super::log_error(&err);
                if let Some((_, record)) = line.as_mut() {
                    record.status = err.kind().status().as_u16();
                    record.error = Some(err.kind().as_str());
                }
                let _ = client.write_all(&super::error_bytes(&err)).await;
                return TunnelEnd::Refused;
            }
        };
        if let Some((_, record)) = line.as_mut() {
            record.status = 200;
            record.ttfb_ms = started.elapsed().as_secs_f64() * 1000.0;
        }
        // Counted before the 200 goes out, so that whoever has read it sees the tunnel counted.
        let active = ActiveGuard::new(proxy.router().metrics(), "connect");
        if let Err(e) = client.write_all(ESTABLISHED).await {
            tracing::debug!(error = %e, "client left before the tunnel was established");
            return TunnelEnd::Closed;
        }
        tracing::debug!(peer = ?upstream.tcp().and_then(|t| t.peer_addr().ok()), "tunnel established");
        let mut tunnel = Established::new(Box::new(upstream), buf, active);
        tunnel.line = line.take().map(|(log, record)| Box::new((log, record, started)));
        TunnelEnd::Established(Box::new(tunnel))
    }
    .instrument(span)
    .await;
    if let Some((log, mut record)) = line {
        if record.status == 0 {
            // Answered here (inspect) or left before the answer: the 200 was written or not.
            record.status = 200;
        }
        record.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        log.write(&record);
    }
    end
}

/// Checks the CONNECT request and its target against policy.
fn check(target: &Uri, framing: BodyFraming, proxy: &Proxy) -> Result<Tunnel, ProxyError> {
    if framing != BodyFraming::Empty {
        // RFC 9110 §9.3.6: CONNECT has no content; bytes after the head belong to the tunnel,
        // so a framed body would make client and sidecar disagree about where it starts.
        return Err(ProxyError::new(
            ErrorKind::BadRequest,
            "a CONNECT request must not have a body (Content-Length or Transfer-Encoding)",
        ));
    }
    // The codec accepts CONNECT only in authority-form, so the authority is there.
    let text = target.authority().map_or("", |a| a.as_str());
    proxy.router().check_connect_target(text)
}

/// Dials the target of an opaque tunnel: through the endpoints of the configured upstream it
/// names (its static `addresses`, balance and ejections), else what the resolver finds; when
/// that upstream (or `defaults.via`, for other hosts) names a parent proxy, the tunnel is
/// chained through it with a CONNECT of its own.
async fn dial_opaque(authority: &Authority, proxy: &Proxy) -> Result<Transport, ProxyError> {
    let router = proxy.router();
    let label = authority.to_string();
    let config = router.config();
    let configured = router.configured(authority);
    let parent = match &configured {
        Some(up) => up.parent().cloned(),
        None => {
            let via = &config.defaults.via;
            via.parent_for(Scheme::Https, &authority.host)
                .map(|route| Arc::new(Parent::new(route)))
        }
    };
    let (dialed, resolve, connect_timeout) = match (&configured, &parent) {
        (Some(up), _) => (
            authority,
            dial::Resolve::Endpoints(up.endpoints()),
            up.connect_timeout(),
        ),
        (None, Some(parent)) => (
            parent.authority(),
            dial::Resolve::Parent(router.resolver()),
            config.defaults.connect_timeout,
        ),
        (None, None) => (
            authority,
            dial::Resolve::Name(router.resolver()),
            config.defaults.connect_timeout,
        ),
    };
    let deadline = tokio::time::Instant::now() + connect_timeout;
    let tcp = dial::tcp(DialTarget {
        label: &label,
        authority: dialed,
        resolve,
        connect_timeout,
        guard: router.guard(),
    })
    .await?;
    let Some(parent) = &parent else {
        return Ok(Transport::Plain(tcp));
    };
    let mut stream = parent.secure(tcp, &label, deadline).await?;
    parent
        .tunnel_by(&mut stream, authority, &label, deadline, connect_timeout)
        .await?;
    Ok(stream)
}

#[cfg(test)]
mod tests {

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use crate::downstream::testing::{eventually, serve_for_test};

    /// An idle tunnel's task is mostly this future (plus the task's header and the two
    /// sockets' registrations): keep it from creeping up unnoticed.
    #[tokio::test]
    async fn an_idle_tunnel_future_stays_small() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let upstream = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        let metrics = crate::metrics::Metrics::new();
        let tunnel = super::Established {
            upstream: Box::new(super::Transport::Plain(upstream)),
            early: bytes::BytesMut::new(),
            _active: super::ActiveGuard::new(&metrics, "connect"),
            line: None,
            span: None,
        };
        let mut tunnel = tunnel;
        let established = std::mem::size_of_val(&tunnel);
        let idle = super::Idle {
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

    #[tokio::test]
    async fn tunnels_are_counted_while_open() {
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target_addr = target.local_addr().unwrap();
        let (me, ctx) =
            serve_for_test(&format!("policy:\n  connect_ports: [{}]\n", target_addr.port())).await;

        let mut client = TcpStream::connect(me).await.unwrap();
        client
            .write_all(format!("CONNECT {target_addr} HTTP/1.1\r\nHost: {target_addr}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let (mut server, _) = target.accept().await.unwrap();
        let mut head = vec![0u8; super::ESTABLISHED.len()];
        client.read_exact(&mut head).await.unwrap();
        assert_eq!(head, super::ESTABLISHED);
        let families = ctx.metrics.families();
        assert_eq!(families.tunnel_counts("connect"), (1, 1));

        drop(client);
        let mut rest = Vec::new();
        server.read_to_end(&mut rest).await.unwrap();
        drop(server);
        assert!(eventually(|| families.tunnel_counts("connect") == (1, 0)).await);
        assert_eq!(families.tunnel_counts("upgrade"), (0, 0));
    }
}
