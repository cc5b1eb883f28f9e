//! Issue 41 item 5: a self-signed upstream certificate made the usual way (`openssl req -x509`,
//! which marks it `CA:TRUE`) and given as `tls.ca_file` is accepted when the upstream presents
//! exactly it, as curl accepts the same file; its name and dates are still checked, and a
//! certificate that is not the file's is still refused.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use support::{FakeUpstream, RawClient, RawResponse, Sidecar, TempDir};

/// `openssl req -x509` with its default extensions, for `upstream.test`: `{stem}.crt`,
/// `{stem}.key` in `dir`. `None` (after `support::skip`) without openssl.
fn openssl_self_signed(dir: &Path, stem: &str) -> Option<(PathBuf, PathBuf)> {
    let (crt, key) = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ])
        .args([
            "-days",
            "2",
            "-subj",
            "/CN=upstream.test",
            "-addext",
            "subjectAltName=DNS:upstream.test",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .output();
    match made {
        Ok(out) if out.status.success() => Some((crt, key)),
        Ok(out) => panic!("openssl req -x509: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => {
            support::skip(&format!("openssl: {e}"));
            None
        }
    }
}

/// A TLS server config presenting `cert` with `key` (DER).
fn acceptor(cert: CertificateDer<'static>, key: PrivateKeyDer<'static>) -> tokio_rustls::TlsAcceptor {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

fn acceptor_from_files(crt: &Path, key: &Path) -> tokio_rustls::TlsAcceptor {
    acceptor(
        CertificateDer::from_pem_file(crt).unwrap(),
        PrivateKeyDer::from_pem_file(key).unwrap(),
    )
}

/// `GET http://upstream.test/` through a sidecar whose https upstream `secure` is `upstream`,
/// with `tls` settings.
async fn get(upstream: &FakeUpstream, tls: &str) -> RawResponse {
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: secure\n    url: https://upstream.test:{port}\n    aliases: [upstream.test:80]\n    \
         addresses: [{addr}]\n    tls: {{ {tls} }}\n",
        port = upstream.addr.port(),
        addr = upstream.addr,
    ))
    .await;
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get("http://upstream.test/")
        .await;
    sidecar.stop().await;
    resp
}

#[tokio::test]
async fn an_openssl_self_signed_certificate_in_ca_file_is_accepted_as_curl_accepts_it() {
    let dir = TempDir::new();
    let Some((crt, key)) = openssl_self_signed(&dir.path, "self") else {
        return;
    };
    let text = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(&crt)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("CA:TRUE"),
        "openssl req -x509 marks its certificate CA:TRUE: the case at hand"
    );
    let upstream = FakeUpstream::start_tls(acceptor_from_files(&crt, &key)).await;
    let ca_file = format!("ca_file: {}", crt.display());

    let resp = get(&upstream, &ca_file).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(upstream.requests(), 1);

    // curl, given the same file, accepts the same upstream (a child of its own: the upstream
    // is served by this test's runtime).
    match tokio::process::Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(&crt)
        .arg("--resolve")
        .arg(format!("upstream.test:{}:127.0.0.1", upstream.addr.port()))
        .arg(format!("https://upstream.test:{}/", upstream.addr.port()))
        .args(["--max-time", "10"])
        .output()
        .await
    {
        Ok(out) => assert_eq!(String::from_utf8_lossy(&out.stdout), "200", "curl: {out:?}"),
        Err(e) => support::skip(&format!("curl: {e}")),
    }

    // Its name is still checked.
    let resp = get(&upstream, &format!("{ca_file}, server_name: other.test")).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("tls_failed"));
    assert!(
        resp.text().to_lowercase().contains("not valid for name"),
        "{}",
        resp.text()
    );
}

#[tokio::test]
async fn only_the_files_own_certificate_is_taken_as_it_is() {
    let dir = TempDir::new();
    let Some((trusted, _)) = openssl_self_signed(&dir.path, "trusted") else {
        return;
    };
    let Some((other, other_key)) = openssl_self_signed(&dir.path, "other") else {
        return;
    };
    // Same name, same shape, another key: not the file's certificate.
    let upstream = FakeUpstream::start_tls(acceptor_from_files(&other, &other_key)).await;
    let resp = get(&upstream, &format!("ca_file: {}", trusted.display())).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("tls_failed"));
    assert_eq!(upstream.requests(), 0);
}

#[tokio::test]
async fn an_expired_self_signed_certificate_in_ca_file_is_refused() {
    let mut params = rcgen::CertificateParams::new(vec!["upstream.test".to_owned()]).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    let dir = TempDir::new();
    let crt = dir.path.join("expired.crt");
    std::fs::write(&crt, cert.pem()).unwrap();
    let upstream = FakeUpstream::start_tls(acceptor(
        cert.der().clone(),
        PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
    ))
    .await;
    let resp = get(&upstream, &format!("ca_file: {}", crt.display())).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("tls_failed"));
    assert!(resp.text().to_lowercase().contains("expired"), "{}", resp.text());
    assert_eq!(upstream.requests(), 0);
}
