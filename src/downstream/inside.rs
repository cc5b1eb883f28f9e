//! What a client sends inside a CONNECT the sidecar answered itself (`policy.connect_inspect`),
//! decided by its first bytes: an HTTP/1.x request, and the connection goes on as a downstream
//! HTTP/1.1 connection whose requests all go to the CONNECT authority through the pool; the
//! HTTP/2 preface, and it is served as h2c the same way; a TLS ClientHello, and it is closed
//! (only ports in `policy.connect_ports` get opaque tunnels); anything else, or nothing within
//! `downstream.header_read_timeout`, and it is closed. Each refusal is logged with its reason and
//! counted in `egress_tunnels_refused_total{reason}`.
//!
//! Serving what is inside rather than splicing it is the point: a spliced tunnel is one upstream
//! connection per client connection, so a client that leaks connections (Node's fetch through
//! undici's `EnvHttpProxyAgent`, grpc-go through `HTTPS_PROXY`, `curl -p`) would leak them at
//! the upstream too. Served, its requests share the pool like any other.

use tokio::time::Instant;

use super::stream::Stream;
use super::Context;
use crate::config::Authority;

/// A TLS record of type handshake (RFC 8446 §5.1): a ClientHello starts with it.
const TLS_HANDSHAKE: u8 = 0x16;

/// What the first bytes inside the tunnel are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Inside {
    /// An HTTP/1.x request line: a method token, upper case.
    Http1,
    /// The HTTP/2 connection preface.
    H2,
    /// Anything else; the connection is to be closed.
    Refused(&'static str),
}

/// Reads (without consuming) what the client sends first on `stream`, until `deadline`;
/// `read` is the first byte of what was read from it already, if any.
pub(super) async fn sniff<S: Stream>(stream: &S, read: Option<u8>, deadline: Instant) -> Inside {
    // Bytes the client sent right behind the CONNECT head are already read; hyper could not be
    // handed them, so only HTTP/1.x is served from there.
    if let Some(first) = read {
        return match classify(first) {
            Inside::H2 => Inside::Refused("not_http"),
            inside => inside,
        };
    }
    let mut first = [0u8; 1];
    let peeked = tokio::time::timeout_at(deadline, stream.peek(&mut first)).await;
    match peeked {
        Err(_) | Ok(Ok(0)) | Ok(Err(_)) => Inside::Refused("no_request"),
        Ok(Ok(_)) => match classify(first[0]) {
            Inside::H2 if super::h2c::starts_with_preface(stream, deadline).await => Inside::H2,
            // `P` that is not the preface may still be `POST` or `PUT`.
            Inside::H2 => Inside::Http1,
            inside => inside,
        },
    }
}

/// What a first byte can start.
fn classify(first: u8) -> Inside {
    match first {
        b'P' => Inside::H2,
        b'A'..=b'Z' => Inside::Http1,
        TLS_HANDSHAKE => Inside::Refused("tls_port_not_allowed"),
        _ => Inside::Refused("not_http"),
    }
}

/// Counts and logs a tunnel closed unserved.
pub(super) fn refuse(reason: &'static str, authority: &Authority, ctx: &Context) {
    let why = match reason {
        "tls_port_not_allowed" => {
            "TLS inside a CONNECT to a port outside policy.connect_ports; only those ports get opaque tunnels"
        }
        "no_request" => "the client sent nothing inside the tunnel within downstream.header_read_timeout",
        _ => "the client sent neither HTTP/1.x, the HTTP/2 preface nor TLS inside the tunnel",
    };
    tracing::info!(target = %authority, reason, "tunnel closed: {why}");
    ctx.metrics.families().tunnel_refused(reason);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_bytes_decide() {
        assert_eq!(classify(b'G'), Inside::Http1);
        assert_eq!(
            classify(b'P'),
            Inside::H2,
            "POST, PUT or the preface: peeked further"
        );
        assert_eq!(classify(0x16), Inside::Refused("tls_port_not_allowed"));
        assert_eq!(classify(b'g'), Inside::Refused("not_http"));
        assert_eq!(classify(0), Inside::Refused("not_http"));
    }
}
