//! Egress policy against a real upstream: denied hosts in every spelling reach nobody, names are
//! checked by the addresses they resolve to, exceptions in `allow_hosts` open exactly what they
//! list.

mod support;

use std::time::Duration;

use support::{FakeUpstream, RawClient, RawResponse, Sidecar};

/// Every way to write 127.0.0.1 that getaddrinfo (and so a naive proxy) would connect to.
const LOOPBACK_SPELLINGS: &[&str] = &[
    "127.0.0.1",
    "127.1",
    "127.0.1",
    "0x7f.0.0.1",
    "0X7F.1",
    "0177.0.0.1",
    "0177.0.0.01",
    "2130706433",
    "0x7f000001",
    "017700000001",
    "127.0.0.1.",
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
];

async fn get(sidecar: &Sidecar, url: &str) -> RawResponse {
    let mut client = RawClient::connect(sidecar.addr).await;
    tokio::time::timeout(Duration::from_secs(5), client.get(url))
        .await
        .expect("answered within 5s")
}

async fn connect(sidecar: &Sidecar, target: &str) -> RawResponse {
    let mut client = RawClient::connect(sidecar.addr).await;
    tokio::time::timeout(Duration::from_secs(5), client.open_tunnel(target, "", b""))
        .await
        .expect("answered within 5s")
        .expect("a response")
}

#[tokio::test]
async fn a_denied_network_is_denied_in_every_spelling_and_by_resolution() {
    let upstream = FakeUpstream::start().await;
    let port = upstream.addr.port();
    let sidecar = Sidecar::start(&format!(
        "policy: {{ deny_hosts: [127.0.0.0/8, '::1'], connect_ports: [{port}] }}\n"
    ))
    .await;
    for host in LOOPBACK_SPELLINGS {
        let what = format!("GET via {host}");
        let body = get(&sidecar, &format!("http://{host}:{port}/"))
            .await
            .assert_sidecar_error(403, "denied", &what);
        assert!(body.contains("127.0.0.0/8"), "{what}: {body}");
        let what = format!("CONNECT via {host}");
        connect(&sidecar, &format!("{host}:{port}"))
            .await
            .assert_sidecar_error(403, "denied", &what);
    }
    // A name is checked by what it resolves to: localhost is no IP literal, yet it is refused
    // before anything is dialed.
    let body = get(&sidecar, &format!("http://localhost:{port}/"))
        .await
        .assert_sidecar_error(403, "denied", "localhost");
    assert!(body.contains("localhost resolves to"), "{body}");
    connect(&sidecar, &format!("localhost:{port}"))
        .await
        .assert_sidecar_error(403, "denied", "CONNECT localhost");
    assert_eq!(upstream.accepted(), 0, "a denied request reached the upstream");
}

#[tokio::test]
async fn deny_private_refuses_special_addresses_unless_allow_hosts_lists_them() {
    let upstream = FakeUpstream::start().await;
    let port = upstream.addr.port();
    let sidecar = Sidecar::start("policy: { deny_private: true }\n").await;
    for host in LOOPBACK_SPELLINGS
        .iter()
        .chain(&["[::1]", "localhost", "0", "[::]"])
    {
        let what = format!("GET via {host}");
        let body = get(&sidecar, &format!("http://{host}:{port}/"))
            .await
            .assert_sidecar_error(403, "denied", &what);
        assert!(body.contains("deny_private"), "{what}: {body}");
    }
    assert_eq!(upstream.accepted(), 0, "a denied request reached the upstream");

    // The exception opens the listed address, whichever way the request spells it, and the
    // upstream gets the canonical Host.
    let sidecar = Sidecar::start("policy: { deny_private: true, allow_hosts: [127.0.0.1] }\n").await;
    for host in ["127.0.0.1", "0x7f.1", "2130706433", "[::ffff:127.0.0.1]"] {
        let resp = get(&sidecar, &format!("http://{host}:{port}/")).await;
        assert_eq!(resp.status, 200, "via {host}: {}", resp.text());
    }
    assert!(upstream
        .seen()
        .iter()
        .all(|s| s.headers.get("host").and_then(|h| h.to_str().ok()) == Some(&*format!("127.0.0.1:{port}"))));
    // Other special addresses stay refused.
    get(&sidecar, &format!("http://[::1]:{port}/"))
        .await
        .assert_sidecar_error(403, "denied", "::1");
    get(&sidecar, &format!("http://127.0.0.2:{port}/"))
        .await
        .assert_sidecar_error(403, "denied", "127.0.0.2");
}

#[tokio::test]
async fn an_allow_list_of_networks_admits_names_by_their_addresses() {
    let upstream = FakeUpstream::start().await;
    let port = upstream.addr.port();
    let sidecar = Sidecar::start("policy: { allow_hosts: [127.0.0.0/8, '::1'] }\n").await;
    let resp = get(&sidecar, &format!("http://localhost:{port}/")).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let sidecar = Sidecar::start("policy: { allow_hosts: [10.0.0.0/8] }\n").await;
    let body = get(&sidecar, &format!("http://localhost:{port}/"))
        .await
        .assert_sidecar_error(403, "denied", "localhost outside the allowed network");
    assert!(body.contains("not in policy.allow_hosts"), "{body}");
    let sidecar = Sidecar::start("policy: { allow_hosts: ['*.example.com'] }\n").await;
    get(&sidecar, &format!("http://localhost:{port}/"))
        .await
        .assert_sidecar_error(403, "denied", "a name outside a names-only allow list");
    assert_eq!(
        upstream.accepted(),
        1,
        "only the allowed request reached the upstream"
    );
}

#[tokio::test]
async fn malformed_hosts_are_bad_requests() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("").await;
    let port = upstream.addr.port();
    for host in [
        "256.0.0.1",
        "example.123",
        "1.2.3.4.5",
        "exa%6dple.com",
        "[fe80::1%25lo]",
        "a..b",
    ] {
        let what = format!("GET via {host}");
        get(&sidecar, &format!("http://{host}:{port}/"))
            .await
            .assert_sidecar_error(400, "bad_request", &what);
    }
    assert_eq!(upstream.accepted(), 0);
}
