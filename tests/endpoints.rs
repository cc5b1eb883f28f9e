//! An upstream with several addresses (issue 21, first step): connection attempts race, happy
//! eyeballs style (RFC 8305), so a dead first address costs an attempt delay, not
//! `connect_timeout`, and an upstream whose addresses are all dead fails naming every one.

mod support;

use std::time::{Duration, Instant};

use support::{Blackhole, FakeUpstream, RawClient, RefusingPort, Sidecar};

/// Every request needs a new connection, so that each one dials.
fn one_request_per_connection(addresses: &str, connect_timeout: &str) -> String {
    format!(
        "upstreams:\n  - name: multi\n    url: http://multi.test\n    addresses: [{addresses}]\n    \
         connect_timeout: {connect_timeout}\n    pool: {{ max_requests_per_connection: 1 }}\n"
    )
}

#[tokio::test]
async fn a_dead_first_address_costs_an_attempt_delay_not_connect_timeout() {
    let dead = Blackhole::start().await;
    let alive = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&one_request_per_connection(
        &format!("{}, {}", dead.addr, alive.addr),
        "5s",
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let started = Instant::now();
    for i in 0..6 {
        let resp = client.get("http://multi.test/ok").await;
        assert_eq!(resp.status, 200, "request {i}: {}", resp.text());
    }
    let took = started.elapsed();
    assert_eq!(
        alive.accepted(),
        6,
        "each request dialed, and reached the live address"
    );
    // Each dial waits about 250 ms on the dead address before the live one is tried beside it;
    // waiting out connect_timeout (5 s) on it even once would take longer than this.
    assert!(
        took < Duration::from_secs(5),
        "6 requests took {took:?}: a dial waited out connect_timeout on the dead address"
    );
    println!("6 requests with a dead first address: {took:?}");
}

#[tokio::test]
async fn all_addresses_dead_fails_naming_every_one() {
    let refusing = RefusingPort::new();
    let dead = Blackhole::start().await;
    let sidecar = Sidecar::start(&one_request_per_connection(
        &format!("{}, {}", refusing.addr, dead.addr),
        "1s",
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client.get("http://multi.test/").await;
    let body = resp.assert_sidecar_error(504, "connect_timeout", "refused then hanging");
    assert!(body.contains("connect_timeout"), "{body}");

    let other_refusing = RefusingPort::new();
    let sidecar = Sidecar::start(&one_request_per_connection(
        &format!("{}, {}", refusing.addr, other_refusing.addr),
        "5s",
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let started = Instant::now();
    let resp = client.get("http://multi.test/").await;
    let body = resp.assert_sidecar_error(502, "connect_failed", "both refusing");
    for addr in [refusing.addr, other_refusing.addr] {
        assert!(body.contains(&addr.to_string()), "{addr} not named in {body}");
    }
    // Refusals come back at once, and each lets the next attempt start: no waiting.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}
