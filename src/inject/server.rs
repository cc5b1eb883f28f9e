//! HTTPS for the injection webhook: TLS (reloaded when cert-manager rotates the files), HTTP/1.1,
//! the `/inject` and `/healthz` routes, and shutdown.
//!
//! The apiserver only talks HTTPS to webhooks. Routes: `POST /inject` (an AdmissionReview,
//! answered by [`super::review`]), `GET /healthz`; anything else gets 404 or 405. Not handled
//! here: what the patch contains.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::Settings;

/// The path the MutatingWebhookConfiguration names.
pub const INJECT_PATH: &str = "/inject";
/// Larger bodies get 413. A pod is at most about 1.5 MiB in etcd; a review carries one.
const MAX_BODY: usize = 8 * 1024 * 1024;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long open connections may take to finish after we stop accepting.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// A certificate and key that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file is missing or not PEM.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls::pki_types::pem::Error,
    },
    /// The certificate file holds no certificate.
    #[error("{0}: no certificate in the file")]
    NoCertificate(PathBuf),
    /// rustls refused the pair (e.g. the key does not match the certificate).
    #[error("certificate {cert} with key {key}: {source}")]
    Rustls {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        source: rustls::Error,
    },
}

/// The PEM files the webhook serves with (cert-manager's `tls.crt` and `tls.key`).
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain, leaf first.
    pub cert: PathBuf,
    /// Private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

impl TlsFiles {
    /// Reads both files into a server config offering HTTP/1.1.
    pub fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let read_err = |path: &Path| {
            let path = path.to_owned();
            move |source| TlsError::Read { path, source }
        };
        let certs = CertificateDer::pem_file_iter(&self.cert)
            .map_err(read_err(&self.cert))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(read_err(&self.cert))?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate(self.cert.clone()));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(read_err(&self.key))?;
        let rustls_err = |source| TlsError::Rustls {
            cert: self.cert.clone(),
            key: self.key.clone(),
            source,
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(rustls_err)?
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .map_err(rustls_err)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    fn modified(&self) -> Option<(SystemTime, SystemTime)> {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        Some((m(&self.cert)?, m(&self.key)?))
    }
}

/// Loads the files, then re-reads them every `every` once their modification times change
/// (cert-manager renews certificates in place). A pair that does not load is logged and the
/// previous one kept. The polling task ends when every receiver is gone.
pub fn watch_tls(files: TlsFiles, every: Duration) -> Result<watch::Receiver<Arc<ServerConfig>>, TlsError> {
    let first = files.load()?;
    let (tx, rx) = watch::channel(first);
    tokio::spawn(async move {
        let mut seen = files.modified();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = tx.closed() => return,
            }
            let now = files.modified();
            if now == seen {
                continue;
            }
            match files.load() {
                Ok(config) => {
                    tracing::info!(cert = %files.cert.display(), "reloaded the webhook certificate");
                    seen = now;
                    let _ = tx.send(config);
                }
                // Likely mid-rotation (one file written, not yet the other): try again next tick.
                Err(e) => tracing::warn!("keeping the previous webhook certificate: {e}"),
            }
        }
    });
    Ok(rx)
}

/// Serves the webhook on `listener` until `shutdown` completes, then keeps accepting for
/// `linger` (the apiserver keeps sending to a terminating pod until its endpoint is removed),
/// then lets open connections finish for up to 5 s.
pub async fn serve(
    listener: TcpListener,
    tls: watch::Receiver<Arc<ServerConfig>>,
    settings: Arc<Settings>,
    shutdown: impl Future<Output = ()>,
    linger: Duration,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let accept_until = async {
        shutdown.await;
        tracing::info!(linger = ?linger, "shutting down: serving on for the linger period");
        tokio::time::sleep(linger).await;
    };
    tokio::pin!(accept_until);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut accept_until => break,
            // Reap finished connections so the set does not grow.
            Some(_) = conns.join_next(), if !conns.is_empty() => continue,
        };
        let config = tls.borrow().clone();
        conns.spawn(connection(stream, config, settings.clone(), stop_rx.clone()));
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let all_closed = async { while conns.join_next().await.is_some() {} };
    if tokio::time::timeout(CLOSE_TIMEOUT, all_closed).await.is_err() {
        tracing::warn!("closing {} webhook connections that did not finish", conns.len());
    }
}

async fn connection(
    stream: TcpStream,
    config: Arc<ServerConfig>,
    settings: Arc<Settings>,
    mut stop: watch::Receiver<bool>,
) {
    let peer = stream.peer_addr().ok();
    let accept = tokio_rustls::TlsAcceptor::from(config).accept(stream);
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, accept).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return tracing::debug!(?peer, "TLS handshake failed: {e}"),
        Err(_) => return tracing::debug!(?peer, "TLS handshake timed out"),
    };
    let svc = service_fn(move |req| handle(req, settings.clone()));
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(tls), svc);
    tokio::pin!(conn);
    let stopping = async move {
        // Map the watch guard away at once: it must not live across the await below.
        let _ = stop.wait_for(|s| *s).await.map(|_| ());
    };
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = stopping => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(?peer, "webhook connection: {e}");
    }
}

async fn handle(
    req: Request<Incoming>,
    settings: Arc<Settings>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let allow = match req.uri().path() {
        INJECT_PATH => "POST",
        "/healthz" => "GET",
        _ => {
            return Ok(text(
                StatusCode::NOT_FOUND,
                "not found: the webhook serves POST /inject\n",
            ))
        }
    };
    if req.method().as_str() != allow && !(allow == "GET" && req.method() == Method::HEAD) {
        let mut resp = text(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method not allowed: use {allow}\n"),
        );
        resp.headers_mut()
            .insert(header::ALLOW, header::HeaderValue::from_static(allow));
        return Ok(resp);
    }
    if allow == "GET" {
        return Ok(text(StatusCode::OK, "ok\n"));
    }
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY as u64) {
        return Ok(too_large());
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => return Ok(too_large()),
        Err(e) => {
            return Ok(text(
                StatusCode::BAD_REQUEST,
                &format!("reading the request body: {e}\n"),
            ))
        }
    };
    let outcome = super::review(&body, &settings);
    tracing::info!(
        pod = %outcome.pod,
        uid = %outcome.review.response.uid,
        action = %outcome.action,
        "admission review"
    );
    Ok(json(&outcome.review))
}

fn too_large() -> Response<Full<Bytes>> {
    text(
        StatusCode::PAYLOAD_TOO_LARGE,
        &format!("request body over {MAX_BODY} bytes\n"),
    )
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_owned())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn json(review: &super::ReviewOut) -> Response<Full<Bytes>> {
    match serde_json::to_vec(review) {
        Ok(body) => {
            let mut resp = Response::new(Full::new(Bytes::from(body)));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            resp
        }
        // Only plain strings and numbers go in; this cannot happen, but is no reason to panic.
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("encoding the review: {e}\n"),
        ),
    }
}

/// Binds `addr`, naming it in the error.
pub async fn bind(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("binding the webhook listener {addr}: {e}")))
}
