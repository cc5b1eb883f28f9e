//! h2c from applications: a connection that opens with the HTTP/2 preface (gRPC and other
//! clients with prior knowledge) is served by hyper's HTTP/2 server, and each of its streams
//! takes the same proxy path as an HTTP/1.1 request. Trailers pass both ways (gRPC status).
//!
//! The preface is detected by peeking, so the connection reaches hyper untouched. `Upgrade: h2c`
//! is not supported (RFC 9113 deprecates it).
//!
//! Not handled here: HTTP/1.1 connections (`conn`), what a request means (`proxy`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Uri};
use http_body::Body as _;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::time::Instant;

use super::stream::Stream;
use super::Context;
use crate::clients::Source;
use crate::routing::Arrival;
use crate::wire::mark_credentials;
use crate::wire::RequestBody;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Streams one application connection may have open at once.
const MAX_STREAMS: u32 = 256;
/// Flow-control windows towards the application: bounded so a slow reader costs at most this
/// much buffered response per stream and connection.
const STREAM_WINDOW: u32 = 256 * 1024;
const CONNECTION_WINDOW: u32 = 1024 * 1024;

/// Whether the connection opens with the HTTP/2 preface; peeks, so nothing is consumed.
pub(super) async fn starts_with_preface<S: Stream>(stream: &S, deadline: Instant) -> bool {
    let mut head = [0u8; PREFACE.len()];
    loop {
        let n = match stream.peek(&mut head).await {
            Ok(n) => n,
            Err(_) => return false,
        };
        if n == PREFACE.len() {
            return head == PREFACE;
        }
        if n == 0 || head[..n] != PREFACE[..n] || Instant::now() >= deadline {
            return false;
        }
        // Part of a preface: the rest is a segment away. Peeking again at once would spin, as
        // the socket stays readable.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Serves an h2c connection from `source` until it closes or the sidecar drains; returns
/// whether it ended with a protocol error.
pub(super) async fn serve<S: Stream>(stream: S, arrival: Arrival, source: Source, ctx: Arc<Context>) -> bool {
    let service_ctx = ctx.clone();
    // Shared by the connection's streams: one reference count per request.
    let from = Arc::new((arrival, source));
    let service = service_fn(move |req: Request<Incoming>| {
        let (ctx, from) = (service_ctx.clone(), from.clone());
        async move {
            let (arrival, source) = &*from;
            let mut req = to_proxy_request(req, arrival);
            let mut lines = crate::wire::HeadLines::default();
            let mut resp = ctx.proxy.handle(&mut req, &mut lines, arrival, source).await;
            crate::proxy::map_wire_fields(&mut resp);
            Ok::<_, Infallible>(resp)
        }
    });
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_header_list_size(u32::try_from(ctx.config.get().max_header_bytes).unwrap_or(u32::MAX));
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let mut drain = ctx.drain.clone();
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = &result {
                tracing::debug!(error = %e, "h2c downstream connection ended with an error");
            }
            return result.is_err();
        }
        _ = drain.wait_for(|d| *d) => {}
    }
    // Draining: GOAWAY, then let the streams in flight finish.
    conn.as_mut().graceful_shutdown();
    conn.await.is_err()
}

/// An HTTP/2 request names its target in `:scheme`/`:authority`, which hyper turns into an
/// absolute URI: routed like an absolute-form request on the forward listener. On a route-mode
/// listener the target is that listener's upstream, so the request becomes origin-form.
fn to_proxy_request(req: Request<Incoming>, arrival: &Arrival) -> Request<RequestBody> {
    let (mut parts, body) = req.into_parts();
    mark_credentials(&mut parts.headers);
    if let (Arrival::Route(_), Some(path)) = (arrival, parts.uri.path_and_query()) {
        let authority = parts.uri.authority().map(|a| a.as_str().to_owned());
        parts.uri = path.as_str().parse().unwrap_or_else(|_| Uri::from_static("/"));
        if let Some(value) = authority.and_then(|a| a.parse().ok()) {
            parts.headers.insert(http::header::HOST, value);
        }
    }
    let body = if body.is_end_stream() {
        RequestBody::Empty
    } else {
        RequestBody::Http2(Box::new(body))
    };
    Request::from_parts(parts, body)
}
