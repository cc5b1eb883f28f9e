//! Trust in exactly the certificates `tls.ca_file` holds: an upstream presenting one of them,
//! byte for byte, is accepted once its name and dates check, even where the Web PKI rules
//! refuse it, as OpenSSL-based clients (curl, Python, nginx, HAProxy) and Go accept it.
//!
//! The case is the self-signed certificate internal services use: `openssl req -x509` marks it
//! `CA:TRUE` by default, and webpki refuses a CA certificate as an end entity
//! (`CaUsedAsEndEntity`), even one the operator named as trusted. Nothing else changes: a
//! certificate that is not in the file is verified by webpki alone (a CA-signed chain as
//! before), and the handshake signatures are always checked against the presented key.
//!
//! Checked for a certificate of the file: its subjectAltName names the server (rustls's name
//! check, as Go and Python 3.10+ do: no fall-back to the common name), and now is within its
//! notBefore..notAfter (`x509-parser` reads them). Not checked: its own signature and
//! extensions, which say nothing once the operator has pinned the bytes.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{CertificateError, DigitallySignedStruct, Error, SignatureScheme};

/// webpki's verifier, with the certificates of `tls.ca_file` trusted as they are.
#[derive(Debug)]
pub(super) struct PinnedOrWebPki {
    webpki: Arc<WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
}

impl PinnedOrWebPki {
    /// Verifies with `webpki`, and accepts a certificate of `pinned` whose name and dates check.
    pub(super) fn new(webpki: Arc<WebPkiServerVerifier>, pinned: Vec<CertificateDer<'static>>) -> Self {
        PinnedOrWebPki { webpki, pinned }
    }
}

impl ServerCertVerifier for PinnedOrWebPki {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let refused =
            match self
                .webpki
                .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
            {
                Ok(verified) => return Ok(verified),
                Err(refused) => refused,
            };
        if !self.pinned.iter().any(|c| c.as_ref() == end_entity.as_ref()) {
            return Err(refused);
        }
        check_dates(end_entity, now)?;
        rustls::client::verify_server_name(&ParsedCertificate::try_from(end_entity)?, server_name)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// Whether `now` is within the certificate's validity.
fn check_dates(cert: &CertificateDer<'_>, now: UnixTime) -> Result<(), Error> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|_| Error::InvalidCertificate(CertificateError::BadEncoding))?;
    let validity = parsed.validity();
    let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
    if now < validity.not_before.timestamp() {
        return Err(Error::InvalidCertificate(CertificateError::NotValidYet));
    }
    if now > validity.not_after.timestamp() {
        return Err(Error::InvalidCertificate(CertificateError::Expired));
    }
    Ok(())
}
