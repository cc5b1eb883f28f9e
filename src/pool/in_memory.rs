//! An upstream connection without sockets, for tests and benches that exercise the pool itself:
//! the sidecar's HTTP/1.1 client over an in-memory pipe to an in-process server answering every request
//! with an empty `200`.

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;

use crate::connector::{h1, Dialed, Place};
use crate::error::ProxyError;

/// Dials an in-memory connection with `buffer` bytes each way; `place` lives as long as it does.
pub async fn dial(place: Box<dyn Place>, buffer: usize) -> Result<Dialed, ProxyError> {
    let (client, server) = tokio::io::duplex(buffer);
    tokio::spawn(async move {
        let svc = service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(
                http_body_util::Empty::<bytes::Bytes>::new(),
            ))
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(server), svc)
            .await;
    });
    Ok(Dialed::Http1(h1::Connection::new(
        h1::Transport::Memory(client),
        place,
    )))
}
