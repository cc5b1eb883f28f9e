//! CONNECT tunnels, what `HTTPS_PROXY` clients ask for: check the target against policy, dial
//! it as its route says (`routing::OpaqueDial`), answer `200 Connection Established`, and hand
//! the [`Tunnel`] to the caller, which splices it in a task of its own (`tunnel`): bytes both
//! ways until both sides close or nothing moves for `downstream.idle_timeout`.
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
//! Not handled here: parsing the CONNECT head (`wire::codec`), where it goes and what its dial
//! needs (`routing`), the tunnel after its `200` (`tunnel`).

use bytes::BytesMut;
use http::Uri;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tracing::Instrument;

use super::Proxy;
use crate::access_log::Record;
use crate::clients::Source;
use crate::config::Authority;
use crate::connector::dial;
use crate::connector::h1::Transport;
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::ActiveGuard;
use crate::redact;
use crate::routing::{ConnectRoute, OpaqueDial};
use crate::tunnel::Tunnel;
use crate::wire::codec::BodyFraming;

const ESTABLISHED: &[u8] = b"HTTP/1.1 200 Connection Established\r\n\r\n";

/// How a CONNECT was answered, and what it became.
#[derive(Debug)]
pub enum Answer {
    /// An error response was sent; the client may still be sending (the caller lingers).
    Refused,
    /// The client left before the tunnel was established.
    Closed,
    /// Answered `200` here without dialing (`policy.connect_inspect`): what the client sends
    /// inside is the downstream server's to read.
    Inspect(Authority),
    /// Dialed and answered `200`: a tunnel, for the caller to splice ([`crate::tunnel::spawn`]).
    Established(Box<Tunnel>),
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
) -> Answer {
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
            Ok(ConnectRoute::Opaque(route)) => dial_opaque(&route).await,
            Ok(ConnectRoute::Inspect(authority)) => {
                if let Err(e) = client.write_all(ESTABLISHED).await {
                    tracing::debug!(error = %e, "client left before the tunnel was established");
                    return Answer::Closed;
                }
                tracing::debug!("tunnel answered here; reading what the client sends in it");
                return Answer::Inspect(authority);
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
                return Answer::Refused;
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
            return Answer::Closed;
        }
        tracing::debug!(peer = ?upstream.tcp().and_then(|t| t.peer_addr().ok()), "tunnel established");
        let line = line.take().map(|(log, record)| Box::new((log, record, started)));
        let tunnel = Tunnel::new(Box::new(upstream), buf, active).with_line(line);
        Answer::Established(Box::new(tunnel))
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

/// Checks the CONNECT request and its target against policy, and routes it.
fn check(target: &Uri, framing: BodyFraming, proxy: &Proxy) -> Result<ConnectRoute, ProxyError> {
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
    proxy.router().route_connect(text)
}

/// Dials the target of an opaque tunnel as its route says: its first hop (the target, or a
/// parent proxy), and through a parent a CONNECT of its own.
async fn dial_opaque(route: &OpaqueDial) -> Result<Transport, ProxyError> {
    let label = route.authority().to_string();
    let connect_timeout = route.connect_timeout();
    let deadline = tokio::time::Instant::now() + connect_timeout;
    let tcp = dial::tcp(route.first_hop(&label)).await?;
    let Some(parent) = route.parent() else {
        return Ok(Transport::Plain(tcp));
    };
    let mut stream = parent.secure(tcp, &label, deadline).await?;
    parent
        .tunnel_by(&mut stream, route.authority(), &label, deadline, connect_timeout)
        .await?;
    Ok(stream)
}

#[cfg(test)]
mod tests {

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use crate::downstream::testing::{eventually, serve_for_test};

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
