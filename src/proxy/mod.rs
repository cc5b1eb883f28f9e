//! The request path, from a parsed downstream request to the response the application sees.
//!
//! Order, outermost first:
//! 1. errors become responses ([`ProxyError::to_response`]), logged once here;
//! 2. `routing`: pick the upstream, apply policy and loop detection;
//! 3. `headers`: origin-form, `Host`, hop-by-hop removal;
//! 4. `upstream`: pooled connection, response-head deadline, stale-connection retry;
//! 5. `headers` again on the way back.
//!
//! Not handled here: the wire format (`downstream`), CONNECT tunnels (not in this build).

pub mod headers;

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::{Body, Frame, SizeHint};

use crate::downstream::RequestBody;
use crate::error::{ErrorKind, ProxyError};
use crate::pool::PooledBody;
use crate::routing::{Entry, Router};

/// Boxed error for response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Handles downstream requests.
#[derive(Debug)]
pub struct Proxy {
    router: Router,
}

impl Proxy {
    /// A proxy routing with `router`.
    pub fn new(router: Router) -> Self {
        Proxy { router }
    }

    /// The router.
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Forwards `req`; failures become sidecar-made error responses.
    pub async fn handle(&self, req: Request<RequestBody>, entry: &Entry) -> Response<ResponseBody> {
        match self.forward(req, entry).await {
            Ok(resp) => resp,
            Err(err) => {
                if err.kind().status().is_server_error() {
                    tracing::warn!(error = %err, "request failed");
                } else {
                    tracing::info!(error = %err, "request refused");
                }
                err.to_response()
            }
        }
    }

    async fn forward(
        &self,
        mut req: Request<RequestBody>,
        entry: &Entry,
    ) -> Result<Response<ResponseBody>, ProxyError> {
        if req.method() == Method::CONNECT {
            return Err(ProxyError::new(
                ErrorKind::BadRequest,
                "CONNECT tunnels are not supported by this build; send plain http:// requests",
            ));
        }
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok());
        let target = self.router.route(entry, req.uri(), host)?;
        headers::to_upstream(&mut req, target.upstream.host_header());
        let resp = target.upstream.send(req).await?;
        let mut resp = resp.map(ResponseBody::Upstream);
        headers::to_downstream(&mut resp);
        Ok(resp)
    }
}

/// A response body: from an upstream, or made by the sidecar.
#[derive(Debug)]
pub enum ResponseBody {
    /// Streams from a pooled upstream connection.
    Upstream(PooledBody),
    /// A complete body (error responses).
    Full(Option<Bytes>),
}

impl From<Bytes> for ResponseBody {
    fn from(bytes: Bytes) -> Self {
        ResponseBody::Full(Some(bytes))
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ResponseBody::Upstream(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            ResponseBody::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ResponseBody::Upstream(body) => body.is_end_stream(),
            ResponseBody::Full(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResponseBody::Upstream(body) => body.size_hint(),
            ResponseBody::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
        }
    }
}
