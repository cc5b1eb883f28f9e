//! TLS origination: the application sends plain HTTP, the sidecar reaches https upstreams,
//! verifies them (or says exactly why not), pools the TLS connections and resumes sessions.

mod support;

use support::{ChildSidecar, FakeUpstream, RawClient, Sidecar, TempDir, TestCa};

const H1: &[&[u8]] = &[b"http/1.1"];

/// A sidecar with one https upstream named `upstream.test` (reached at `upstream.addr`), which
/// plain-HTTP apps address as `http://upstream.test/`.
async fn sidecar_for(upstream: &FakeUpstream, tls: &str, pool: &str) -> Sidecar {
    Sidecar::start(&format!(
        "upstreams:\n  - name: secure\n    url: https://upstream.test:{port}\n    aliases: [upstream.test:80]\n    \
         addresses: [{addr}]\n    tls: {{ {tls} }}\n    pool: {{ {pool} }}\n",
        port = upstream.addr.port(),
        addr = upstream.addr,
    ))
    .await
}

#[tokio::test]
async fn plain_http_from_the_app_reaches_an_https_upstream() {
    let ca = TestCa::new();
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let upstream = FakeUpstream::start_tls(ca.server(&["upstream.test"], false, &[b"h2", b"http/1.1"])).await;
    let sidecar = sidecar_for(&upstream, &format!("ca_file: {}", ca_file.display()), "").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..3 {
        let resp = client.get("http://upstream.test/hello").await;
        assert_eq!(resp.status, 200, "{}", resp.text());
        assert_eq!(resp.text(), "ok");
    }
    assert_eq!(upstream.accepted(), 1, "the TLS connection is pooled");
    let seen = upstream.seen();
    assert_eq!(seen[0].version, http::Version::HTTP_2, "ALPN chose h2");
    assert_eq!(seen[0].path(), "/hello");
    assert_eq!(
        seen[0].authority(),
        format!("upstream.test:{}", upstream.addr.port())
    );
    // The connection names its origin in every stream: `:scheme` is the upstream's, though
    // the app asked in plain http.
    assert_eq!(
        seen[0].uri,
        format!("https://upstream.test:{}/hello", upstream.addr.port())
    );
    assert!(seen[0].headers.get("host").is_none(), "no Host field on HTTP/2");
}

#[tokio::test]
async fn an_http11_only_tls_upstream_gets_http11() {
    let ca = TestCa::new();
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let upstream = FakeUpstream::start_tls(ca.server(&["upstream.test"], false, H1)).await;
    let sidecar = sidecar_for(&upstream, &format!("ca_file: {}", ca_file.display()), "").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get("http://upstream.test/hello").await.status, 200);
    let seen = upstream.seen();
    assert_eq!(seen[0].version, http::Version::HTTP_11);
    assert_eq!(seen[0].uri, "/hello");
    assert_eq!(
        seen[0].headers["host"],
        format!("upstream.test:{}", upstream.addr.port()).as_str()
    );
}

#[tokio::test]
async fn new_dials_resume_the_tls_session() {
    let ca = TestCa::new();
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let upstream = FakeUpstream::start_tls(ca.server(&["upstream.test"], false, H1)).await;
    let sidecar = sidecar_for(
        &upstream,
        &format!("ca_file: {}", ca_file.display()),
        "max_requests_per_connection: 1",
    )
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..3 {
        assert_eq!(client.get("http://upstream.test/").await.status, 200);
    }
    assert_eq!(upstream.accepted(), 3, "one connection per request");
    let resumed = upstream
        .counters
        .tls_resumed
        .load(std::sync::atomic::Ordering::SeqCst);
    assert!(resumed >= 2, "{resumed} of 3 handshakes resumed a session");
}

/// What the application sees when the upstream's certificate does not verify.
async fn tls_failure(server_names: &[&str], expired: bool, tls: &str) -> String {
    let ca = TestCa::new();
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let upstream = FakeUpstream::start_tls(ca.server(server_names, expired, H1)).await;
    let tls = tls.replace("CA_FILE", &ca_file.display().to_string());
    let sidecar = sidecar_for(&upstream, &tls, "").await;
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get("http://upstream.test/")
        .await;
    assert_eq!(resp.status, 502, "{}", resp.text());
    assert_eq!(resp.header("x-egress-error"), Some("tls_failed"));
    assert_eq!(upstream.requests(), 0);
    resp.text()
}

#[tokio::test]
async fn a_certificate_for_another_name_is_refused() {
    let body = tls_failure(&["other.test"], false, "ca_file: CA_FILE").await;
    assert!(body.contains("upstream secure"), "{body}");
    assert!(body.to_lowercase().contains("not valid for name"), "{body}");
}

#[tokio::test]
async fn an_unknown_ca_is_refused() {
    let body = tls_failure(&["upstream.test"], false, "").await;
    assert!(
        body.to_lowercase().contains("unknown issuer") || body.contains("UnknownIssuer"),
        "{body}"
    );
}

#[tokio::test]
async fn an_expired_certificate_is_refused() {
    let body = tls_failure(&["upstream.test"], true, "ca_file: CA_FILE").await;
    assert!(body.to_lowercase().contains("expired"), "{body}");
}

#[tokio::test]
async fn insecure_skip_verify_accepts_what_it_is_told_to() {
    let ca = TestCa::new();
    let upstream = FakeUpstream::start_tls(ca.server(&["other.test"], true, H1)).await;
    let sidecar = sidecar_for(&upstream, "insecure_skip_verify: true", "").await;
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get("http://upstream.test/")
        .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
}

#[tokio::test]
async fn a_plain_http_request_to_a_tls_host_is_upgraded_by_egress_tls_hosts() {
    let ca = TestCa::new();
    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let upstream = FakeUpstream::start_tls(ca.server(&["localhost"], false, H1)).await;
    let ca_path = ca_file.display().to_string();
    let sidecar = ChildSidecar::spawn_with_env(
        "",
        &[
            ("EGRESS_TLS_HOSTS", "localhost"),
            ("SSL_CERT_FILE", ca_path.as_str()),
        ],
    )
    .await;
    let url = format!("http://localhost:{}/via-env", upstream.addr.port());
    let resp = RawClient::connect(sidecar.addr).await.get(&url).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(upstream.seen()[0].path(), "/via-env");

    // Without the variable the same request is plain HTTP, which a TLS server cannot answer.
    let plain = ChildSidecar::spawn_with_env("", &[("SSL_CERT_FILE", ca_path.as_str())]).await;
    let resp = RawClient::connect(plain.addr).await.get(&url).await;
    assert_eq!(resp.status, 502, "{}", resp.text());
}
