//! TLS origination: the application speaks plain HTTP to the sidecar, the sidecar speaks TLS to
//! the upstream.
//!
//! One rustls `ClientConfig` per upstream, built once: trust anchors are the system store
//! (loaded once per process; `SSL_CERT_FILE` / `SSL_CERT_DIR` are honoured) plus the upstream's
//! `tls.ca_file`; SNI and the verified name are `tls.server_name` or the url host;
//! a certificate of `tls.ca_file` presented as it is, self-signed and marked `CA:TRUE` as
//! `openssl req -x509` makes it, is trusted too (`pinned`);
//! `insecure_skip_verify` swaps in a verifier that accepts any certificate but still checks the
//! handshake signatures. Keeping the config per upstream keeps its session cache, so later dials
//! resume TLS sessions instead of doing full handshakes.
//!
//! ALPN offers what `protocol` allows (`auto`: h2 then http/1.1); the dialer reads the choice.
//!
//! A client certificate (`tls.client_cert_file`, `tls.client_key_file`: mTLS) is read through
//! `watched`, so a pair cert-manager rotates is presented by new connections within a second
//! of the change. Session resumption is off for such upstreams: a resumed TLS 1.3 session
//! carries the identity of the certificate it began with, so after a rotation the server would
//! go on seeing the old one.
//!
//! Not handled here: TCP (`dial`), which protocol a pool speaks.

use std::fmt;
use std::io;
use std::sync::{Arc, OnceLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{ResolvesClientCert, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::client::TlsStream;

use super::pinned::PinnedOrWebPki;
use crate::config::{load_ca_file, load_client_identity, TlsConfig};
use crate::watched::Watched;

/// Starts TLS sessions to one upstream.
pub struct TlsConnector {
    connector: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
}

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsConnector {
    /// A connector for `host` (the url host) with `tls` settings, offering `alpn`.
    pub fn new(tls: &TlsConfig, host: &str, alpn: &[&[u8]]) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?;
        let builder = if tls.insecure_skip_verify {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate(provider)))
        } else {
            let mut roots = RootCertStore::empty();
            roots.roots.extend(system_roots().roots.iter().cloned());
            let mut pinned = Vec::new();
            if let Some(path) = &tls.ca_file {
                for cert in load_ca_file(path)? {
                    roots
                        .add(cert.clone())
                        .map_err(|e| format!("tls.ca_file {}: {e}", path.display()))?;
                    pinned.push(cert);
                }
            }
            if roots.is_empty() {
                return Err(
                    "no trusted CA certificates: the system store is empty and no tls.ca_file is set".into(),
                );
            }
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("TLS verifier: {e}"))?;
            if pinned.is_empty() {
                builder.with_webpki_verifier(webpki)
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(PinnedOrWebPki::new(webpki, pinned)))
            }
        };
        let mut config = match (&tls.client_cert_file, &tls.client_key_file) {
            (Some(cert), Some(key)) => {
                let files = Watched::new(vec![cert.clone(), key.clone()], client_identity);
                if files.get().is_none() {
                    return Err(format!(
                        "tls.client_cert_file {}: no usable certificate and key",
                        cert.display()
                    ));
                }
                let mut config = builder.with_client_cert_resolver(Arc::new(ClientCert(files)));
                config.resumption = rustls::client::Resumption::disabled();
                config
            }
            _ => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let name = tls.server_name.as_deref().unwrap_or(host);
        let server_name = ServerName::try_from(name.to_owned())
            .map_err(|e| format!("{name:?} is not a valid TLS server name: {e}"))?;
        Ok(TlsConnector {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
            server_name,
        })
    }

    /// Runs the handshake over `io`: a TCP connection, or a tunnel through a TLS parent.
    pub async fn handshake<IO>(&self, io: IO) -> io::Result<TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        self.connector.connect(self.server_name.clone(), io).await
    }

    /// Whether the server chose HTTP/2 in ALPN.
    pub fn negotiated_h2<IO>(stream: &TlsStream<IO>) -> bool {
        stream.get_ref().1.alpn_protocol() == Some(b"h2")
    }

    /// The name the certificate must be valid for.
    pub fn server_name(&self) -> String {
        self.server_name.to_str().into_owned()
    }
}

/// The client certificate of an mTLS upstream, as its files hold it now.
#[derive(Debug)]
struct ClientCert(Watched<Arc<CertifiedKey>>);

impl ResolvesClientCert for ClientCert {
    fn resolve(&self, _root_hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.0.get()
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A certificate chain and key, from the PEM contents of the cert and key files.
fn client_identity(contents: &[Vec<u8>]) -> Result<Arc<CertifiedKey>, String> {
    let (certs, key) = load_client_identity(&contents[0], &contents[1])?;
    let signing = rustls::crypto::aws_lc_rs::default_provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| format!("client_key_file: {e}"))?;
    Ok(Arc::new(CertifiedKey::new(certs, signing)))
}

/// The system's trust anchors, loaded once per process.
fn system_roots() -> &'static RootCertStore {
    static ROOTS: OnceLock<RootCertStore> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for err in &found.errors {
            tracing::warn!(error = %err, "reading the system CA store");
        }
        let mut roots = RootCertStore::empty();
        let (added, ignored) = roots.add_parsable_certificates(found.certs);
        tracing::debug!(added, ignored, "system CA certificates loaded");
        roots
    })
}

/// `insecure_skip_verify`: any certificate, any name; the handshake itself is still verified.
#[derive(Debug)]
struct AcceptAnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
