//! HTTP/1.1 protocol upgrades passed through (WebSocket, and any other `Upgrade` token but
//! `h2c`).
//!
//! A request with `Connection: upgrade` and `Upgrade: <protocol>` is routed like any other
//! (routing, policy, `Host`, origin-form) but sent on a dedicated upstream connection dialed for
//! it and never pooled: once switched, a connection belongs to one client until it closes, and
//! a pooled connection cannot become that. Dedicated connections do not count against the
//! pool's `max_connections`, so long-lived WebSockets never starve pooled requests.
//!
//! - `101 Switching Protocols`: the head goes to the client with `Upgrade` and
//!   `Connection: upgrade` kept (other hop-by-hop fields removed), then bytes are spliced both
//!   ways (`tunnel`: half-close, `downstream.idle_timeout`), in a task of their own that the
//!   downstream connection starts ([`switch`] returns a `tunnel::Tunnel`), and the downstream
//!   connection closes afterwards.
//! - Any other status: the response goes back through the normal response path, framed as
//!   usual, and the client connection stays usable; the dedicated upstream connection closes
//!   once its body has been read.
//!
//! Passed through only for bodiless HTTP/1.1 requests. An upgrade request with a body, an
//! HTTP/1.0 one, or one asking only for `h2c` is sent as a plain pooled request with `Upgrade`
//! removed (a server is free to ignore `Upgrade`): switching after a body would need the body
//! relayed raw, and `h2c` needs the connection-specific `HTTP2-Settings`, which a proxy must not
//! forward.
//!
//! Upstreams reached over TLS (`https://` urls, `EGRESS_TLS_HOSTS`) answer `502
//! protocol_error` for now: a dedicated TLS dial needs the upstream's TLS connector, which is
//! not public yet. So do upstreams configured `protocol: http2` (h2c with prior knowledge may
//! not speak HTTP/1.1 at all).
//!
//! Not handled here: choosing the upstream (`routing`), which headers go where
//! (`proxy::headers`), the downstream wire (`downstream::conn` calls [`switch`]).

use std::fmt;

use bytes::BytesMut;
use http::{Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::Proxy;
use super::ResponseBody;
use crate::config::Protocol;
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::ActiveGuard;
use crate::tunnel::{self, Tunnel};
use crate::upstream::Upstream;
use crate::wire::codec::{self, ResponseFraming};
use crate::wire::RequestBody;

/// Marks a `101` response from [`send`]: the connection task switches the client to the
/// upstream connection this resolves to.
#[derive(Clone)]
pub struct Switch(OnUpgrade);

impl fmt::Debug for Switch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Switch")
    }
}

impl Switch {
    /// The switch `resp` carries, taken out. Only a `101` can carry one ([`send`] marks no
    /// other), so any other response skips the extensions' lookup. Inlined: every response
    /// asks, and the test is all most of them run (the plain build did not take the hint).
    #[inline(always)]
    pub fn take<B>(resp: &mut Response<B>) -> Option<Switch> {
        if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
            return None;
        }
        resp.extensions_mut().remove::<Switch>()
    }
}

/// Whether `req` asks for an upgrade the sidecar passes through: HTTP/1.1, `Connection` naming
/// `upgrade`, an `Upgrade` protocol other than `h2c`, and no body.
pub fn requested(req: &Request<RequestBody>) -> bool {
    // `Upgrade` first: nearly every request lacks it, and then one lookup settles it.
    if req.version() != Version::HTTP_11
        || !req.body().is_empty()
        || !req.headers().contains_key(http::header::UPGRADE)
    {
        return false;
    }
    asks_upgrade(req)
}

/// The rest of [`requested`], for the rare request that has `Upgrade`: out of the request
/// path.
#[cold]
fn asks_upgrade(req: &Request<RequestBody>) -> bool {
    let connection_upgrade = req
        .headers()
        .get_all(http::header::CONNECTION)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    let protocols = req
        .headers()
        .get_all(http::header::UPGRADE)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .any(|p| !p.eq_ignore_ascii_case("h2c"));
    connection_upgrade && protocols
}

/// Sends an upgrade request (already rewritten for `upstream`) on a dedicated connection and
/// returns the response head. A `101` carries a [`Switch`] in its extensions.
pub async fn send(upstream: &Upstream, req: Request<RequestBody>) -> Result<Response<Incoming>, ProxyError> {
    let error = |kind: ErrorKind, cause: String| ProxyError::new(kind, cause).with_upstream(upstream.label());
    let settings = upstream.settings();
    if settings.protocol == Protocol::Http2 {
        // Plain-TCP `http2` is h2c with prior knowledge: the server may not speak HTTP/1.1 at
        // all, and WebSocket over HTTP/2 (RFC 8441) is another protocol.
        return Err(error(
            ErrorKind::ProtocolError,
            "upgrades need HTTP/1.1 and this upstream is configured with protocol: http2".into(),
        ));
    }
    let io = upstream.dial_dedicated().await?;
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, RequestBody>(TokioIo::new(io))
        .await
        .map_err(|e| error(ErrorKind::ProtocolError, format!("HTTP/1.1 handshake: {e}")))?;
    let label = upstream.label().to_owned();
    // The task ends when the connection switches (handing the socket to `Switch`), when a
    // non-101 body has been read and `sender` is gone, or when the request is abandoned.
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(upstream = %label, error = %e, "upgrade connection ended with an error");
        }
    });
    let sending = sender.send_request(req);
    let result = match settings.response_header_timeout {
        Some(limit) => tokio::time::timeout(limit, sending).await.map_err(|_| {
            error(
                ErrorKind::ResponseTimeout,
                format!(
                    "no response head within response_header_timeout ({})",
                    humantime::format_duration(limit)
                ),
            )
        })?,
        None => sending.await,
    };
    let mut resp = result.map_err(|e| upstream.classify_error(&e))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let on_upgrade = hyper::upgrade::on(&mut resp);
        resp.extensions_mut().insert(Switch(on_upgrade));
    }
    Ok(resp)
}

/// Answers the client with a `101` from [`send`] and returns the switched upstream connection
/// as a tunnel for the caller to splice (`None` when the switch failed or the client left).
/// `buf` holds bytes the client sent after its request head; they go to the upstream first.
pub async fn switch(
    client: &mut (impl AsyncRead + AsyncWrite + Unpin),
    buf: &mut BytesMut,
    resp: Response<ResponseBody>,
    pending: Switch,
    proxy: &Proxy,
) -> Option<Tunnel> {
    let upgraded = match pending.0.await {
        Ok(upgraded) => upgraded,
        Err(e) => {
            let err = ProxyError::new(
                ErrorKind::ProtocolError,
                format!("the upstream answered 101 but its connection could not be switched: {e}"),
            );
            super::log_error(&err);
            let _ = client.write_all(&super::error_bytes(&err)).await;
            return None;
        }
    };
    let reason = resp
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .map(|r| r.as_bytes());
    let mut head = Vec::with_capacity(256);
    codec::encode_head(
        resp.status(),
        reason,
        resp.headers(),
        b"",
        ResponseFraming::None,
        true,
        Version::HTTP_11,
        &mut head,
    );
    let active = ActiveGuard::new(proxy.router().metrics(), "upgrade");
    if let Err(e) = client.write_all(&head).await {
        tracing::debug!(error = %e, "client left before the 101 was written");
        return None;
    }
    let protocol = resp
        .headers()
        .get(http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    tracing::debug!(%protocol, "connection switched");
    let (upstream, read_past) = tunnel::unwrap_upgraded(upgraded);
    if let Err(e) = client.write_all(&read_past).await {
        tracing::debug!(error = %e, "client left after the 101");
        return None;
    }
    Some(Tunnel::new(upstream, buf, active))
}

#[cfg(test)]
mod tests {

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use crate::downstream::testing::{eventually, serve_for_test};

    /// Reads until the end of a head; returns it.
    async fn read_head(stream: &mut TcpStream) -> String {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            stream.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        String::from_utf8(head).unwrap()
    }

    #[tokio::test]
    async fn switched_connections_are_counted_while_open() {
        let upstream = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = upstream.local_addr().unwrap();
        let (me, ctx) = serve_for_test("").await;

        let mut client = TcpStream::connect(me).await.unwrap();
        client
            .write_all(
                format!(
                    "GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\n\
                     Connection: Upgrade\r\nUpgrade: x-test\r\n\r\n"
                )
                .as_bytes(),
            )
            .await
            .unwrap();
        let (mut server, _) = upstream.accept().await.unwrap();
        let request = read_head(&mut server).await;
        assert!(request.starts_with("GET / HTTP/1.1\r\n"), "{request}");
        server
            .write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x-test\r\nConnection: upgrade\r\n\r\n")
            .await
            .unwrap();
        let answer = read_head(&mut client).await;
        assert!(
            answer.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
            "{answer}"
        );
        let families = ctx.metrics.families();
        assert_eq!(families.tunnel_counts("upgrade"), (1, 1));

        drop(server);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        drop(client);
        assert!(eventually(|| families.tunnel_counts("upgrade") == (1, 0)).await);
        assert_eq!(families.tunnel_counts("connect"), (0, 0));
    }
}
