//! Header rewriting between downstream and upstream (RFC 9110 §7.6, RFC 9112 §3.2).
//!
//! Towards the upstream: the request target becomes origin-form, `Host` becomes the upstream's
//! authority, and hop-by-hop fields go: `Connection` and every field it names,
//! `Proxy-Connection`, `Keep-Alive`, `Transfer-Encoding` (the body is re-framed), `Upgrade`,
//! `TE` (except `trailers`), `Proxy-Authorization` (meant for us), and `Expect` (the sidecar
//! answers `100-continue` itself). `Trailer` is end-to-end and stays.
//!
//! Towards the application: the same hop-by-hop set plus `Proxy-Authenticate`.
//!
//! No `Via` or `X-Forwarded-*` is added: egress requests leave the cluster, where they would
//! leak internal addresses, and a `Via` header turns off compression on many servers (nginx's
//! `gzip_proxied off` default).

use http::header::{
    CONNECTION, EXPECT, HOST, PROXY_AUTHENTICATE, PROXY_AUTHORIZATION, TE, TRANSFER_ENCODING, UPGRADE,
};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, Uri, Version};

const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// Rewrites a downstream request for the upstream named by `host`.
pub fn to_upstream<B>(req: &mut Request<B>, host: &HeaderValue) {
    if req.uri().scheme().is_some() {
        let origin_form = req
            .uri()
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .parse::<Uri>()
            .unwrap_or_else(|_| Uri::from_static("/"));
        *req.uri_mut() = origin_form;
    }
    let headers = req.headers_mut();
    let wants_trailers = headers.get_all(TE).iter().any(|v| {
        v.to_str()
            .unwrap_or("")
            .split(',')
            .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
    });
    strip_hop_by_hop(headers);
    headers.remove(PROXY_AUTHORIZATION);
    headers.remove(EXPECT);
    if wants_trailers {
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
    headers.insert(HOST, host.clone());
    *req.version_mut() = Version::HTTP_11;
}

/// Rewrites an upstream response for the application.
pub fn to_downstream<B>(resp: &mut Response<B>) {
    let headers = resp.headers_mut();
    strip_hop_by_hop(headers);
    headers.remove(PROXY_AUTHENTICATE);
}

/// Removes `Connection`, the fields it names, and the fixed hop-by-hop set.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .flat_map(|v| v.to_str().unwrap_or("").split(','))
            .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
            // A client must not be able to strip the fields that frame or route the message.
            .filter(|name| *name != HOST && *name != http::header::CONTENT_LENGTH)
            .collect();
        for name in named {
            headers.remove(name);
        }
        headers.remove(CONNECTION);
    }
    for name in [PROXY_CONNECTION, KEEP_ALIVE, TRANSFER_ENCODING, UPGRADE, TE] {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_becomes_origin_form_without_hop_by_hop() {
        let mut req = Request::builder()
            .uri("http://api.example.com:8080/v1/x?q=1")
            .header("host", "wrong")
            .header("connection", "keep-alive, x-secret, content-length")
            .header("x-secret", "1")
            .header("proxy-connection", "keep-alive")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers, deflate")
            .header("proxy-authorization", "Basic abc")
            .header("expect", "100-continue")
            .header("content-length", "3")
            .header("trailer", "x-checksum")
            .header("authorization", "Bearer t")
            .body(())
            .unwrap();
        to_upstream(&mut req, &HeaderValue::from_static("api.example.com:8080"));
        assert_eq!(req.uri(), "/v1/x?q=1");
        let h = req.headers();
        assert_eq!(h["host"], "api.example.com:8080");
        assert_eq!(h["te"], "trailers");
        assert_eq!(h["content-length"], "3");
        assert_eq!(h["trailer"], "x-checksum");
        assert_eq!(h["authorization"], "Bearer t");
        for gone in [
            "connection",
            "x-secret",
            "proxy-connection",
            "keep-alive",
            "proxy-authorization",
            "expect",
        ] {
            assert!(!h.contains_key(gone), "{gone} kept");
        }
    }

    #[test]
    fn response_loses_hop_by_hop() {
        let mut resp = Response::builder()
            .header("connection", "close")
            .header("keep-alive", "timeout=5")
            .header("transfer-encoding", "chunked")
            .header("proxy-authenticate", "Basic")
            .header("content-type", "text/plain")
            .body(())
            .unwrap();
        to_downstream(&mut resp);
        assert_eq!(resp.headers().len(), 1);
    }
}
