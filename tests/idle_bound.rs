//! Bounds on idle application connections, so a leaking client cannot push the sidecar over its
//! memory limit: `downstream.max_idle_connections` closes the longest idle first, and sources the
//! leak detector flags get `downstream.leaky_idle_timeout`.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{scrape, value, FakeUpstream, RawClient, Sidecar};

/// A client connection from a chosen loopback address (the leak detector keys on the peer IP).
async fn connect_from(ip: &str, sidecar: SocketAddr) -> RawClient {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    RawClient::from_stream(socket.connect(sidecar).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_max_idle_connections_the_longest_idle_close_first() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("downstream: { idle_timeout: 30s, max_idle_connections: 3 }\n").await;
    let url = format!("http://{}/", upstream.addr);
    let mut clients = Vec::new();
    for _ in 0..6 {
        let mut client = RawClient::connect(sidecar.addr).await;
        assert_eq!(client.get(&url).await.status, 200);
        clients.push(client);
        // Each goes idle, and into the idle list, before the next one.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut closed = Vec::new();
    for client in &mut clients {
        closed.push(client.is_closed_within(Duration::from_millis(300)).await);
    }
    assert_eq!(closed, [true, true, true, false, false, false]);
    assert_eq!(
        clients[5].get(&url).await.status,
        200,
        "the kept ones still serve"
    );
    let m = scrape(sidecar.admin).await;
    assert_eq!(value(&m, "egress_downstream_idle_closed_total", &[]), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flagged_source_gets_the_short_idle_timeout() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start("downstream: { idle_timeout: 30s, leaky_idle_timeout: 300ms }\n").await;
    let url = format!("http://{}/", upstream.addr);
    // 127.0.0.3 behaves like the seeds' leaky client: one request per connection, 120 times.
    for _ in 0..120 {
        let mut client = connect_from("127.0.0.3", sidecar.addr).await;
        assert_eq!(client.get(&url).await.status, 200);
    }
    // Its connections are closed by the client here; wait until the sidecar saw them close.
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.requests() == 120).await,
        "all served"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;

    let mut leaky = connect_from("127.0.0.3", sidecar.addr).await;
    let mut good = connect_from("127.0.0.4", sidecar.addr).await;
    assert_eq!(leaky.get(&url).await.status, 200);
    assert_eq!(good.get(&url).await.status, 200);
    assert!(
        leaky.is_closed_within(Duration::from_secs(2)).await,
        "a flagged source's idle connection closes after leaky_idle_timeout"
    );
    assert!(
        !good.is_closed_within(Duration::from_secs(1)).await,
        "another source keeps idle_timeout"
    );
}
