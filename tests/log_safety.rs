//! What the sidecar logs about its own exposure and never about its users' credentials: the
//! open-proxy warning, and no Authorization, Proxy-Authorization or Cookie value at any level.

mod support;

use std::time::Duration;

use support::{ChildSidecar, FakeUpstream, RawClient};

#[tokio::test]
async fn a_proxy_listener_open_to_the_network_without_an_allow_list_is_warned_about() {
    let open = ChildSidecar::spawn_with_env("", &[("EGRESS_LISTEN", "0.0.0.0:0")]).await;
    let warnings = open.logged("open proxy");
    assert_eq!(warnings.len(), 1, "{:?}", open.logs.lock().unwrap());
    assert!(
        warnings[0].contains("\"WARN\"") && warnings[0].contains("0.0.0.0:"),
        "{}",
        warnings[0]
    );

    let listed = ChildSidecar::spawn_with_env(
        "policy: { allow_hosts: ['*.example.com'] }\n",
        &[("EGRESS_LISTEN", "0.0.0.0:0")],
    )
    .await;
    assert!(listed.logged("open proxy").is_empty());
    let loopback = ChildSidecar::spawn("").await;
    assert!(loopback.logged("open proxy").is_empty());
}

#[tokio::test]
async fn credentials_never_reach_the_logs_even_at_trace_level() {
    const SECRETS: [&str; 3] = [
        "s3cr3t-bearer-value",
        "s3cr3t-proxy-auth-value",
        "s3cr3t-cookie-value",
    ];
    let h1 = FakeUpstream::start().await;
    let h2 = FakeUpstream::start_h2(None, 100).await;
    let sidecar = ChildSidecar::spawn_with_env(
        &format!(
            "upstreams:\n  - {{ name: h2, url: 'http://{}', protocol: http2 }}\npolicy: {{ deny_hosts: [denied.example] }}\n",
            h2.addr
        ),
        &[("EGRESS_LOG", "trace")],
    )
    .await;
    let credentials = format!(
        "Authorization: Bearer {}\r\nProxy-Authorization: Basic {}\r\nCookie: session={}\r\n",
        SECRETS[0], SECRETS[1], SECRETS[2]
    );
    let requests = [
        format!("GET http://{}/ HTTP/1.1\r\nHost: x\r\n{credentials}\r\n", h1.addr),
        format!("GET http://{}/ HTTP/1.1\r\nHost: x\r\n{credentials}\r\n", h2.addr),
        format!("GET http://denied.example/ HTTP/1.1\r\nHost: x\r\n{credentials}\r\n"),
        format!("POST http://{}/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n{credentials}\r\nx", h1.addr),
        format!("GET http://{}/ HTTP/1.1\r\nHost: x\r\n{credentials}Bad Header\r\n\r\n", h1.addr),
    ];
    for raw in &requests {
        let mut client = RawClient::connect(sidecar.addr).await;
        client.send_raw(raw.as_bytes()).await;
        let resp = tokio::time::timeout(Duration::from_secs(5), client.read_response(false))
            .await
            .expect("answered within 5s")
            .expect("a response");
        assert!(resp.status > 0);
    }
    // Give trace output from the connections' tasks time to arrive.
    let logged_enough =
        support::eventually(Duration::from_secs(5), || sidecar.logs.lock().unwrap().len() > 20).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let logs = sidecar.logs.lock().unwrap().clone();
    assert!(logged_enough, "trace logging produced only {} lines", logs.len());
    for secret in SECRETS {
        let leaks: Vec<&String> = logs.iter().filter(|l| l.contains(secret)).collect();
        assert!(leaks.is_empty(), "{secret} logged: {leaks:?}");
    }
    assert_eq!(h1.requests() + h2.requests(), 2);
}
