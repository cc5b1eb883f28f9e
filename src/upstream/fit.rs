//! Fitting a request to the connection it goes on: its version, and absolute-form through a
//! parent proxy (the proxy hands it over in origin-form with the upstream's `Host`).

use http::Request;

use super::Upstream;
use crate::wire::RequestBody;

impl Upstream {
    /// The proxy hands requests over in origin-form with the upstream's `Host`
    /// (`proxy::headers::to_upstream`), which is what HTTP/1.1 sends, and what HTTP/2 sends
    /// too: its `:scheme`/`:authority` come from the pool connection's origin
    /// (`connector::http2::Origin`), its `:path` from the target, and the head's encoder
    /// leaves `Host` out (`wire::h2client`; taking it out of the map cost 270 instructions a
    /// request). So a retry on the other protocol converts nothing; only a request through a
    /// parent proxy is made absolute-form.
    pub(super) fn fit_request(&self, req: &mut Request<RequestBody>, http2: bool) {
        if http2 {
            *req.version_mut() = http::Version::HTTP_2;
            return;
        }
        *req.version_mut() = http::Version::HTTP_11;
        if self.forward {
            self.make_absolute(req);
            self.fit_forwarded(req);
        }
    }

    /// Makes the request's target `http://host[:port]/path?query`, keeping its path.
    fn make_absolute(&self, req: &mut Request<RequestBody>) {
        let Some(authority) = &self.uri_authority else {
            return;
        };
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
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
