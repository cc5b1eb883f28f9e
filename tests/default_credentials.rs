//! Issue 41 item 7: credentials in `defaults` (a `request_headers` value and a `tls` client
//! certificate) go to the upstreams the operator named, and never to a host an application
//! names on the fly: absolute-form (http and https), a request in a CONNECT served as HTTP, and
//! h2c. nginx is the origin and says what it got: its access log has the client certificate's
//! subject (`ssl_verify_client optional`) and the `Authorization` it received.

mod support;

use std::time::Duration;

use support::{Nginx, RawClient, Sidecar, TempDir, TestCa};

/// The default `Authorization` the sidecar holds.
const SECRET: &str = "Bearer default-secret-7f3a";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_credentials_never_reach_hosts_met_on_the_fly() {
    let ca = TestCa::new();
    // nginx: a TLS server asking for (not requiring) a client certificate of `ca`, and a
    // plain one; both log the scheme, path, the certificate's subject and Authorization (in
    // each server: the `http` level's `access_log off` would silence one there).
    let started = Nginx::start(2, |addrs, dir| {
        let ca_file = dir.join("ca.pem");
        std::fs::write(&ca_file, &ca.pem).unwrap();
        let (cert, key) = ca.server_files(&["named.test", "127.0.0.1"], dir, "server");
        format!(
            "  log_format seen '$scheme $request_uri dn=\"$ssl_client_s_dn\" auth=\"$http_authorization\"';\n\
             \x20 server {{\n    listen {tls} ssl;\n    access_log {log} seen;\n    ssl_certificate {cert};\n    ssl_certificate_key {key};\n\
             \x20   ssl_verify_client optional;\n    ssl_client_certificate {ca};\n\
             \x20   location / {{ return 200 \"ok\\n\"; }}\n  }}\n\
             \x20 server {{\n    listen {plain};\n    access_log {log} seen;\n    location / {{ return 200 \"ok\\n\"; }}\n  }}",
            log = dir.join("seen.log").display(),
            tls = addrs[0],
            plain = addrs[1],
            cert = cert.display(),
            key = key.display(),
            ca = ca_file.display(),
        )
    })
    .await;
    let Some(nginx) = started else {
        support::skip("nginx is not installed (apt-get install nginx)");
        return;
    };
    let (tls, plain) = (nginx.addrs[0], nginx.addrs[1]);

    let dir = TempDir::new();
    let ca_file = ca.write_pem(&dir);
    let (client_cert, client_key) = ca.client_pem("default-client");
    let (cert_file, key_file) = (dir.path.join("client.crt"), dir.path.join("client.key"));
    std::fs::write(&cert_file, client_cert).unwrap();
    std::fs::write(&key_file, client_key).unwrap();
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  request_headers: {{ set: {{ Authorization: '{SECRET}' }} }}\n  \
         tls: {{ ca_file: {ca}, client_cert_file: {cert}, client_key_file: {key} }}\n\
         upstreams:\n  - name: named\n    url: https://named.test:{port}\n    aliases: [named.test:80]\n    \
         addresses: [{tls}]\n",
        ca = ca_file.display(),
        cert = cert_file.display(),
        key = key_file.display(),
        port = tls.port(),
    ))
    .await;

    // The upstream the operator named: both credentials (the test's control).
    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get("http://named.test/named").await.status, 200);
    // Hosts met on the fly, absolute-form: https (TLS originated) and http.
    for url in [
        format!("https://{tls}/fly-https"),
        format!("http://{plain}/fly-http"),
    ] {
        let mut client = RawClient::connect(sidecar.addr).await;
        let resp = client.get(&url).await;
        assert_eq!(resp.status, 200, "{url}: {}", resp.text());
    }
    // A request in a CONNECT served as HTTP.
    let mut tunnel = RawClient::connect(sidecar.addr).await;
    tunnel
        .send_raw(format!("CONNECT {plain} HTTP/1.1\r\nHost: {plain}\r\n\r\n").as_bytes())
        .await;
    let (status, _) = tunnel.read_head().await;
    assert_eq!(status, 200);
    tunnel
        .send_raw(format!("GET /tunnel HTTP/1.1\r\nHost: {plain}\r\n\r\n").as_bytes())
        .await;
    assert_eq!(tunnel.read_response(false).await.expect("an answer").status, 200);
    // h2c, to both.
    assert_eq!(
        support::h2c_get(sidecar.addr, &format!("https://{tls}/h2c-https"))
            .await
            .0,
        200
    );
    assert_eq!(
        support::h2c_get(sidecar.addr, &format!("http://{plain}/h2c-http"))
            .await
            .0,
        200
    );

    let log_path = nginx.dir().join("seen.log");
    let mut lines = Vec::new();
    for _ in 0..50 {
        lines = std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        if lines.len() >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let line = |path: &str| {
        lines
            .iter()
            .find(|l| l.split(' ').nth(1) == Some(path))
            .unwrap_or_else(|| panic!("nginx logged no {path}: {lines:#?}"))
            .clone()
    };
    assert_eq!(
        line("/named"),
        format!("https /named dn=\"CN=default-client\" auth=\"{SECRET}\""),
        "the named upstream gets both"
    );
    for (path, scheme) in [
        ("/fly-https", "https"),
        ("/fly-http", "http"),
        ("/tunnel", "http"),
        ("/h2c-https", "https"),
        ("/h2c-http", "http"),
    ] {
        assert_eq!(
            line(path),
            format!("{scheme} {path} dn=\"-\" auth=\"-\""),
            "{path}: nginx writes - for none"
        );
    }
    sidecar.stop().await;
}
