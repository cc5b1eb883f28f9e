//! Dialing an upstream: resolve, TCP connect and TLS handshake within `connect_timeout`, socket
//! options, then an HTTP/1.1 connection (`h1`), or the HTTP/2 handshake and the connection's
//! driver task.
//!
//! Which HTTP: `protocol: http1` always HTTP/1.1; `http2` always HTTP/2 (h2c with prior
//! knowledge on plain TCP, ALPN `h2` on TLS); `auto` follows ALPN on TLS and is HTTP/1.1 on
//! plain TCP.
//!
//! Addresses come from the upstream's endpoint set (`crate::endpoint`: static `addresses` or
//! the DNS answer, with the balance's pick first), or from the resolver for a tunnel's host.
//! Several addresses are raced within the deadline, happy eyeballs style (see [`race`]). A
//! connection that turns out to reach one of the sidecar's own listeners is refused as `loop`.
//!
//! [`tcp`] is also how CONNECT tunnels and upgraded (WebSocket) connections, which live outside
//! the pool, reach their targets.
//!
//! Not handled here: which connection a request uses (`pool`), TLS settings (`tls`).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::h1::{self, Transport};
use super::http2;
use super::parent::Parent;
use super::tls::TlsConnector;
use super::{Connect, Dialed, Place};
use crate::config::{Authority, Http2Config, Protocol};
use crate::endpoint::dns::Resolver;
use crate::endpoint::{interleave_families, Set};
use crate::error::{ErrorKind, ProxyError};
use crate::policy::Guard;

/// TCP keepalive probes on upstream sockets find peers that vanished without a FIN.
const TCP_KEEPALIVE_TIME: Duration = Duration::from_secs(60);
const TCP_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Shortest wait for an HTTP/2 server's SETTINGS after the handshake: loopback round trips are
/// microseconds, but hyper's connection task must also get scheduled on a busy runtime.
const MIN_SETTINGS_WAIT: Duration = Duration::from_millis(20);

/// Dials connections, over TCP or TLS, to one upstream.
#[derive(Debug)]
pub struct Connector {
    label: Arc<str>,
    authority: Authority,
    endpoints: Arc<Set>,
    connect_timeout: Duration,
    guard: Arc<Guard>,
    /// `None`: plain TCP. `Some(Err)`: TLS was asked for but cannot be set up (every dial
    /// fails with `tls_failed` saying why).
    tls: Option<Result<TlsConnector, String>>,
    protocol: Protocol,
    http2: Http2Config,
    /// The parent proxy connections go through, if any.
    parent: Option<Arc<Parent>>,
    /// What HTTP/2 connections name in their streams.
    origin: Option<http2::Origin>,
}

/// A pool connector's [`DialTarget`], owned: the connector dials it for as long as its pool
/// lives, through `parent` when there is one.
#[derive(Debug)]
pub struct OwnedTarget {
    /// Label in errors and logs.
    pub label: Arc<str>,
    /// Host and port (DNS name or IP).
    pub authority: Authority,
    /// The upstream's endpoints.
    pub endpoints: Arc<Set>,
    /// TCP plus TLS deadline.
    pub connect_timeout: Duration,
    /// The policy and the sidecar's own listeners, never to be dialed.
    pub guard: Arc<Guard>,
    /// The parent proxy to go through (`endpoints` are then the parent's).
    pub parent: Option<Arc<Parent>>,
    /// The scheme and authority HTTP/2 streams name (`:scheme`, `:authority`).
    pub origin: Option<http2::Origin>,
}

impl Connector {
    /// A connector for `target`; `tls` is `None` for plain TCP.
    pub fn new(
        target: OwnedTarget,
        tls: Option<Result<TlsConnector, String>>,
        protocol: Protocol,
        http2: Http2Config,
    ) -> Self {
        Connector {
            label: target.label,
            authority: target.authority,
            endpoints: target.endpoints,
            connect_timeout: target.connect_timeout,
            guard: target.guard,
            tls,
            protocol,
            http2,
            parent: target.parent,
            origin: target.origin,
        }
    }

    /// The ALPN list for `protocol`.
    pub fn alpn(protocol: Protocol) -> &'static [&'static [u8]] {
        match protocol {
            Protocol::Auto => &[b"h2", b"http/1.1"],
            Protocol::Http1 => &[b"http/1.1"],
            Protocol::Http2 => &[b"h2"],
        }
    }

    fn error(&self, kind: ErrorKind, cause: impl Into<String>) -> ProxyError {
        ProxyError::new(kind, cause).with_upstream(&*self.label)
    }

    /// The TCP part of this connector's dials.
    fn dial_target(&self) -> DialTarget<'_> {
        DialTarget {
            label: &self.label,
            authority: &self.authority,
            resolve: Resolve::Endpoints(&self.endpoints),
            connect_timeout: self.connect_timeout,
            guard: &self.guard,
        }
    }

    /// A TCP connection to one of the upstream's endpoints, the balance's pick first; attempts
    /// that fail (or lose the race after an attempt delay) count against their endpoints.
    async fn tcp(&self, place: &dyn Place, deadline: Instant) -> Result<TcpStream, ProxyError> {
        let target = self.dial_target();
        let plan = tokio::time::timeout_at(deadline, self.endpoints.plan(&self.guard))
            .await
            .map_err(|_| target.resolve_timeout_error())??;
        let addrs: Vec<SocketAddr> = plan.attempts.iter().map(|e| e.addr()).collect();
        let started = Instant::now();
        let raced = race(&target, &addrs, deadline).await;
        for &i in &raced.failed {
            self.endpoints.failed(&plan.attempts[i]);
        }
        let (stream, winner) = raced.result.map_err(|e| match &self.parent {
            Some(parent) => e.with_context(&format!("through parent proxy {}", parent.shown())),
            None => e,
        })?;
        let endpoint = &plan.attempts[winner];
        endpoint.succeeded();
        endpoint.seed_latency(started.elapsed());
        place.connected(plan.claim_for(winner));
        Ok(stream)
    }

    async fn connect(&self, place: Box<dyn Place>) -> Result<Dialed, ProxyError> {
        let started = Instant::now();
        let deadline = started + self.connect_timeout;
        let tcp = self.tcp(&*place, deadline).await?;
        // A TCP handshake is one round trip: the measure of how soon a server's SETTINGS come.
        let rtt = started.elapsed();
        let io = match &self.parent {
            None => Transport::Plain(tcp),
            Some(parent) => {
                let mut io = parent.secure(tcp, &self.label, deadline).await?;
                // Plain HTTP/1.1 goes as absolute-form requests on the parent connection itself.
                if self.tls.is_some() || self.protocol == Protocol::Http2 {
                    parent
                        .tunnel_by(
                            &mut io,
                            &self.authority,
                            &self.label,
                            deadline,
                            self.connect_timeout,
                        )
                        .await?;
                }
                io
            }
        };
        match &self.tls {
            None if self.protocol == Protocol::Http2 => self.handshake_h2(io, place, rtt, deadline).await,
            None => Ok(self.http1(io, place)),
            Some(Err(why)) => Err(self.error(ErrorKind::TlsFailed, why.clone())),
            Some(Ok(tls)) => match io {
                Transport::Plain(tcp) => {
                    let stream = handshake_tls(&self.dial_target(), tls, tcp, deadline).await?;
                    let h2 = TlsConnector::negotiated_h2(&stream);
                    self.over_tls(h2, Transport::Tls(Box::new(stream)), place, rtt, deadline)
                        .await
                }
                // A tunnel through a TLS parent.
                io => {
                    let stream = handshake_tls(&self.dial_target(), tls, io, deadline).await?;
                    let h2 = TlsConnector::negotiated_h2(&stream);
                    self.over_tls(h2, Transport::Nested(Box::new(stream)), place, rtt, deadline)
                        .await
                }
            },
        }
    }

    /// A TLS connection to the upstream: HTTP/2 when ALPN chose it (`h2`), else HTTP/1.1.
    async fn over_tls(
        &self,
        h2: bool,
        io: Transport,
        place: Box<dyn Place>,
        rtt: Duration,
        deadline: Instant,
    ) -> Result<Dialed, ProxyError> {
        if h2 {
            self.handshake_h2(io, place, rtt, deadline).await
        } else if self.protocol == Protocol::Http2 {
            Err(self.error(
                ErrorKind::ProtocolError,
                "the upstream did not agree to h2 in ALPN",
            ))
        } else {
            Ok(self.http1(io, place))
        }
    }

    /// HTTP/1.1 needs no handshake, and no task: the requests it carries run it.
    fn http1(&self, stream: Transport, place: Box<dyn Place>) -> Dialed {
        Dialed::Http1(h1::Connection::new(stream, place))
    }

    async fn handshake_h2<T>(
        &self,
        io: T,
        place: Box<dyn Place>,
        rtt: Duration,
        deadline: Instant,
    ) -> Result<Dialed, ProxyError>
    where
        T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        // Until the server's SETTINGS arrive, h2 assumes this many streams. One more than we
        // would ever use marks "not heard yet": the pool must not hand out a connection's worth
        // of streams to a server that allows fewer.
        let unheard = self.http2.max_streams_per_connection as usize + 1;
        let keepalive = self.http2.keepalive_interval.map(|interval| http2::Keepalive {
            interval,
            timeout: self.http2.keepalive_timeout,
        });
        let label = self.label.clone();
        let on_end = move |error: Option<crate::wire::BoxError>| {
            if let Some(e) = error {
                place.failed();
                tracing::debug!(upstream = %label, error = %e, "upstream connection ended with an error");
            }
            drop(place);
        };
        // The preface and our SETTINGS go out from the connection's task; a server that
        // does not speak HTTP/2 fails the first stream, as one that broke the handshake did.
        let sender = http2::handshake(io, unheard, keepalive, self.origin.clone(), on_end);
        // The driver task applies the server's SETTINGS; wait here about one round trip for
        // the first value, checking every millisecond; a server that announces none (no limit)
        // costs this wait once. Afterwards the driver republishes the limit after every poll,
        // so the pool follows a server that changes it.
        let wait_until = deadline.min(Instant::now() + (rtt * 2).max(MIN_SETTINGS_WAIT));
        while sender.max_streams() == unheard && Instant::now() < wait_until {
            if let Some(ended) = sender.ended() {
                // An HTTP/1.1 server answers the preface with a 400 (not a frame) and closes.
                let kind = match ended {
                    http2::Ended::Protocol(_) => ErrorKind::ProtocolError,
                    _ => ErrorKind::UpstreamReset,
                };
                return Err(self.error(kind, format!("HTTP/2 connection ended at its start: {ended}")));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(Dialed::Http2(sender))
    }
}

impl Connect for Connector {
    fn connect(
        &self,
        place: Box<dyn Place>,
    ) -> Pin<Box<dyn Future<Output = Result<Dialed, ProxyError>> + Send + '_>> {
        Box::pin(Connector::connect(self, place))
    }
}

fn set_socket_options(stream: &TcpStream) {
    // Failures here leave a working socket with default options; not worth failing the dial.
    let _ = stream.set_nodelay(true);
    let keepalive = TcpKeepalive::new()
        .with_time(TCP_KEEPALIVE_TIME)
        .with_interval(TCP_KEEPALIVE_INTERVAL);
    let _ = SockRef::from(stream).set_tcp_keepalive(&keepalive);
}

// === TCP dials, shared with tunnels and upgrades ===

/// Where a dial's addresses come from.
#[derive(Debug, Clone, Copy)]
pub enum Resolve<'a> {
    /// An upstream's endpoint set (static addresses, or its DNS answer).
    Endpoints(&'a Arc<Set>),
    /// The resolver, for a host met in a tunnel.
    Name(&'a Resolver),
    /// The resolver, for a parent proxy a tunnel goes through: the operator chose it, so its
    /// addresses are not policy-checked.
    Parent(&'a Resolver),
}

/// What to dial.
#[derive(Debug, Clone, Copy)]
pub struct DialTarget<'a> {
    /// Names the target in errors: an upstream label, or host:port for tunnels.
    pub label: &'a str,
    /// Host and port (DNS name or IP).
    pub authority: &'a Authority,
    /// Where the addresses come from.
    pub resolve: Resolve<'a>,
    /// Deadline for resolving and connecting.
    pub connect_timeout: Duration,
    /// The policy in force and the sidecar's own listeners.
    pub guard: &'a Guard,
}

impl DialTarget<'_> {
    fn error(&self, kind: ErrorKind, cause: impl Into<String>) -> ProxyError {
        ProxyError::new(kind, cause).with_upstream(self.label)
    }

    fn loop_error(&self, addr: SocketAddr) -> ProxyError {
        self.error(
            ErrorKind::Loop,
            format!("{} resolves to {addr}, which is this sidecar", self.authority),
        )
    }

    fn timeout_error(&self) -> ProxyError {
        self.error(
            ErrorKind::ConnectTimeout,
            format!(
                "connecting to {} took longer than connect_timeout ({})",
                self.authority,
                humantime::format_duration(self.connect_timeout)
            ),
        )
    }

    /// The deadline passed while the name was being resolved.
    fn resolve_timeout_error(&self) -> ProxyError {
        let host = match self.resolve {
            Resolve::Endpoints(set) => set.resolved_name(),
            Resolve::Name(_) | Resolve::Parent(_) => Some(self.authority.host.as_str()),
        };
        match host {
            Some(host) => self.error(
                ErrorKind::ConnectTimeout,
                format!(
                    "resolving {host} took longer than connect_timeout ({})",
                    humantime::format_duration(self.connect_timeout)
                ),
            ),
            None => self.timeout_error(),
        }
    }

    /// The timeout of a race, naming the addresses it tried.
    fn timeout_error_tried(&self, tried: &[SocketAddr]) -> ProxyError {
        self.error(
            ErrorKind::ConnectTimeout,
            format!(
                "connecting to {} ({}) took longer than connect_timeout ({})",
                self.authority,
                list(tried),
                humantime::format_duration(self.connect_timeout)
            ),
        )
    }

    /// The addresses to connect to, in the order to try them. Static `addresses` are the
    /// operator's own choice; the policy checks those the request's host names or resolves to,
    /// before any is dialed.
    async fn resolve(&self) -> Result<Vec<SocketAddr>, ProxyError> {
        let (resolver, checked) = match self.resolve {
            Resolve::Endpoints(set) => return set.addresses(self.guard).await,
            Resolve::Name(resolver) => (resolver, true),
            Resolve::Parent(resolver) => (resolver, false),
        };
        let host = self.authority.host.as_str();
        let found = match host.parse() {
            Ok(ip) => vec![SocketAddr::new(ip, self.authority.port)],
            Err(_) => resolver
                .lookup(host)
                .await
                .map_err(|e| self.error(ErrorKind::ConnectFailed, format!("resolving {host}: {e}")))?
                .ips
                .into_iter()
                .map(|ip| SocketAddr::new(ip, self.authority.port))
                .collect(),
        };
        if checked {
            self.guard.check_addresses(self.label, self.authority, &found)?;
        }
        Ok(interleave_families(found, SocketAddr::is_ipv6))
    }

    /// A listener on 0.0.0.0 is reachable through every local address, which only the
    /// connected socket reveals: the peer is this host when it has our own local IP.
    fn is_self_connection(&self, stream: &TcpStream) -> Option<SocketAddr> {
        let (Ok(peer), Ok(me)) = (stream.peer_addr(), stream.local_addr()) else {
            return None;
        };
        let to_self = peer.ip() == me.ip()
            && self
                .guard
                .local_addrs()
                .iter()
                .any(|l| l.port() == peer.port() && (l.ip().is_unspecified() || l.ip() == peer.ip()));
        to_self.then_some(peer)
    }
}

/// RFC 8305's Connection Attempt Delay: how long an attempt has before the next address is
/// tried beside it.
const ATTEMPT_DELAY: Duration = Duration::from_millis(250);

/// Resolves and connects within `connect_timeout`, racing the addresses (see [`race`]). For
/// tunnels and upgrades, which live outside the pool.
pub async fn tcp(target: DialTarget<'_>) -> Result<TcpStream, ProxyError> {
    let deadline = Instant::now() + target.connect_timeout;
    let addrs = tokio::time::timeout_at(deadline, target.resolve())
        .await
        .map_err(|_| target.resolve_timeout_error())??;
    race(&target, &addrs, deadline)
        .await
        .result
        .map(|(stream, _)| stream)
}

/// How a race ended: the stream and the index of its address, and the indexes of the attempts
/// that failed: those that errored, those still pending at the end that had run for an attempt
/// delay or more (slower than the winner by at least that, or still hanging at the deadline).
struct Raced {
    result: Result<(TcpStream, usize), ProxyError>,
    failed: Vec<usize>,
}

/// Connects to the first of `addrs` that answers by `deadline`, happy eyeballs style
/// (RFC 8305): each next attempt starts [`ATTEMPT_DELAY`] after the last or as soon as one
/// fails, the first to connect is kept and the others dropped. So a dead first address costs
/// about 250 ms rather than `connect_timeout`.
async fn race(target: &DialTarget<'_>, addrs: &[SocketAddr], deadline: Instant) -> Raced {
    let fail = |result: ProxyError, failed: Vec<usize>| Raced {
        result: Err(result),
        failed,
    };
    if let Some(own) = addrs.iter().find(|a| target.guard.is_own_listener(**a)) {
        return fail(target.loop_error(*own), Vec::new());
    }
    let mut pending = addrs.iter().copied().enumerate();
    let mut attempts = tokio::task::JoinSet::new();
    let mut started: Vec<Instant> = Vec::with_capacity(addrs.len());
    let mut failed = Vec::new();
    let mut last_err: Option<io::Error> = None;
    let mut next_at = Instant::now();
    loop {
        if Instant::now() >= next_at {
            if let Some((i, addr)) = pending.next() {
                attempts.spawn(async move { (i, TcpStream::connect(addr).await) });
                started.push(Instant::now());
                next_at = Instant::now() + ATTEMPT_DELAY;
            }
        }
        if attempts.is_empty() {
            break;
        }
        let more = pending.len() > 0;
        let finished = tokio::select! {
            finished = attempts.join_next() => finished,
            () = tokio::time::sleep_until(next_at), if more => continue,
            () = tokio::time::sleep_until(deadline) => {
                let hanging = (0..started.len()).filter(|i| !failed.contains(i));
                failed.extend(hanging.collect::<Vec<_>>());
                return fail(target.timeout_error_tried(&addrs[..started.len()]), failed);
            }
        };
        match finished {
            Some(Ok((i, Ok(stream)))) => {
                if let Some(peer) = target.is_self_connection(&stream) {
                    return fail(target.loop_error(peer), failed);
                }
                set_socket_options(&stream);
                let now = Instant::now();
                let slow = (0..started.len())
                    .filter(|&j| j != i && !failed.contains(&j) && now - started[j] >= ATTEMPT_DELAY);
                failed.extend(slow.collect::<Vec<_>>());
                return Raced {
                    result: Ok((stream, i)),
                    failed,
                };
            }
            // A failed attempt lets the next one start at once.
            Some(Ok((i, Err(e)))) => {
                failed.push(i);
                last_err = Some(e);
                next_at = Instant::now();
            }
            Some(Err(join)) => {
                last_err = Some(io::Error::other(join.to_string()));
                next_at = Instant::now();
            }
            None => break,
        }
    }
    let cause = last_err.map_or_else(|| "no address".to_owned(), |e| e.to_string());
    let err = target.error(
        ErrorKind::ConnectFailed,
        format!("connecting to {} ({}): {cause}", target.authority, list(addrs)),
    );
    fail(err, failed)
}

fn list(addrs: &[SocketAddr]) -> String {
    let text: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    text.join(", ")
}

/// The TLS half of a dial, within the deadline its TCP half started: over TCP, or over a
/// tunnel through a TLS parent.
pub async fn handshake_tls<IO>(
    target: &DialTarget<'_>,
    tls: &TlsConnector,
    io: IO,
    deadline: Instant,
) -> Result<tokio_rustls::client::TlsStream<IO>, ProxyError>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    match tokio::time::timeout_at(deadline, tls.handshake(io)).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) => Err(target.error(
            ErrorKind::TlsFailed,
            format!(
                "TLS handshake with {} (as {}): {e}",
                target.authority,
                tls.server_name()
            ),
        )),
        Err(_) => Err(target.timeout_error()),
    }
}
