//! Fitting a request to the connection it goes on: absolute-form through a parent proxy,
//! origin-form with `Host` on HTTP/1.1, and on HTTP/2 the target as it is (the connection names
//! its origin in every stream).

use http::Request;

use super::Upstream;
use crate::wire::RequestBody;

impl Upstream {
    /// HTTP/2 names the target in `:scheme`/`:authority`, which the pool's connection fills
    /// in from its origin (`connector::http2::Origin`) whatever the request's target says, and
    /// in `:path`; HTTP/1.1 in the origin-form target and the `Host` the proxy set
    /// (`proxy::headers::to_upstream`), or absolute-form through a parent proxy. HTTP/2
    /// leaves the request as HTTP/1.1 sends it, so a retry on the other protocol converts
    /// nothing. A `Host` field stays in the map on HTTP/2: the head's encoder leaves it out
    /// (`wire::h2client`), and taking it out of the map cost 270 instructions a request.
    pub(super) fn fit_request(&self, req: &mut Request<RequestBody>, http2: bool) {
        if http2 {
            *req.version_mut() = http::Version::HTTP_2;
            return;
        }
        *req.version_mut() = http::Version::HTTP_11;
        if self.forward {
            self.make_absolute(req, http::uri::Scheme::HTTP);
            self.fit_forwarded(req);
        } else if req.uri().scheme().is_some() {
            let path = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
            if let Ok(uri) = path.parse() {
                *req.uri_mut() = uri;
            }
            req.headers_mut()
                .insert(http::header::HOST, self.host_header.clone());
        }
    }

    /// Makes the request's target `scheme://host[:port]/path?query`, keeping its path.
    fn make_absolute(&self, req: &mut Request<RequestBody>, scheme: http::uri::Scheme) {
        let Some(authority) = &self.uri_authority else {
            return;
        };
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        parts.scheme = Some(scheme);
        parts.authority = Some(authority.clone());
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        if let Ok(uri) = http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }

    /// A plain HTTP/1.1 request through a parent: absolute-form, with the parent's
    /// credentials (the application's own `Proxy-Authorization` was removed with the other
    /// hop-by-hop fields).
    fn fit_forwarded(&self, req: &mut Request<RequestBody>) {
        req.headers_mut()
            .insert(http::header::HOST, self.host_header.clone());
        let auth = self.parent.as_ref().and_then(|p| p.proxy_authorization());
        match auth {
            Some(value) => req.headers_mut().insert(http::header::PROXY_AUTHORIZATION, value),
            None => req.headers_mut().remove(http::header::PROXY_AUTHORIZATION),
        };
    }
}
