//! What both sides of the proxy share about HTTP messages: the HTTP/1.1 codec, the request body
//! handed from the downstream connection to the upstream client, the error type of bodies, the
//! common header names recognised by their bytes, a fast scan of plain heads, request and
//! response fields passed on as their lines, which fields carry credentials, and, for the upstream HTTP/2 client
//! to come, HPACK, HTTP/2's header compression, HTTP/2's frames, and the client side of an HTTP/2
//! connection as a state machine without I/O.
//!
//! These sit at the bottom of the request path because the downstream server, the request path,
//! the pool and the upstream HTTP/1.1 client all speak them; none of them owns the format.

pub mod body;
pub mod codec;
pub mod fields;
pub mod frame;
pub mod h2client;
pub mod hpack;
pub mod lines;
pub mod names;
pub(crate) mod scan;

use http::header::{AUTHORIZATION, COOKIE, PROXY_AUTHORIZATION};
use http::{HeaderMap, HeaderName};

pub use body::{BodySender, KeptCopy, RequestBody, StreamingBody, REQUEST_BODY_IDLE};
pub use fields::{BodyType, WireFields};
pub use lines::HeadLines;

/// Takes a lent request (the request path lends it, see `proxy::Proxy::handle`) for a step
/// that must own it, leaving an empty one behind; the empty one allocates nothing.
pub fn take_request(req: &mut http::Request<RequestBody>) -> http::Request<RequestBody> {
    std::mem::replace(req, http::Request::new(RequestBody::Empty))
}

/// Boxed error for response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Whether a field carries credentials whose values must never be logged.
pub fn is_credential(name: &HeaderName) -> bool {
    name == AUTHORIZATION || name == PROXY_AUTHORIZATION || name == COOKIE
}

/// Marks every credential field in `headers` sensitive (for maps parsed by hyper).
pub fn mark_credentials(headers: &mut HeaderMap) {
    for (name, value) in headers.iter_mut() {
        if is_credential(name) {
            value.set_sensitive(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    /// What the h2c server (hyper-parsed heads) relies on: its credential values print as
    /// `Sensitive` wherever a header map is logged, and HPACK never indexes them upstream.
    #[test]
    fn credentials_in_a_parsed_map_are_marked_sensitive() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("authorization", "Bearer x"),
            ("proxy-authorization", "Basic y"),
            ("cookie", "c=1"),
            ("x-other", "z"),
        ] {
            headers.append(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        mark_credentials(&mut headers);
        for name in ["authorization", "proxy-authorization", "cookie"] {
            assert!(headers[name].is_sensitive(), "{name}");
        }
        assert!(!headers["x-other"].is_sensitive());
        assert!(!format!("{headers:?}").contains("Bearer"), "{headers:?}");
    }
}
