//! Bounds on idle application connections, so a leaking client cannot push the sidecar over its
//! memory limit: `downstream.max_idle_connections` closes the longest idle first, and sources the
//! leak detector flags get `downstream.leaky_idle_timeout`. Parking one adds no task: the task
//! that wakes parked connections runs from the start.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{scrape, value, ChildSidecar, FakeUpstream, RawClient, Sidecar};

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
    for i in 0..6usize {
        let mut client = RawClient::connect(sidecar.addr).await;
        assert_eq!(client.get(&url).await.status, 200);
        clients.push(client);
        // Each goes idle, and into the idle list (parked), before the next one; from the
        // fourth on, parking one closes the longest idle, so the lot stays at 3.
        let parked = |m: &prometheus_parse::Scrape| value(m, "egress_downstream_parked_connections", &[]);
        let closed = |m: &prometheus_parse::Scrape| value(m, "egress_downstream_idle_closed_total", &[]);
        let want = ((i + 1).min(3) as f64, i.saturating_sub(2) as f64);
        let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| {
            (parked(m), closed(m)) == want
        })
        .await;
        assert_eq!(
            (parked(&m), closed(&m)),
            want,
            "(parked, closed) once client {i} idles"
        );
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
    // Its connections are closed by the client here; wait until the sidecar saw them close
    // and its leak detector flags the source.
    assert!(
        support::eventually(Duration::from_secs(3), || upstream.requests() == 120).await,
        "all served"
    );
    let admin = sidecar.admin;
    let flagged = support::eventually_async(Duration::from_secs(5), || async move {
        let resp = support::admin_get(admin, "/debug/clients").await;
        let report: serde_json::Value = serde_json::from_slice(&resp.body).expect("JSON");
        report
            .as_array()
            .expect("an array of sources")
            .iter()
            .any(|s| s["source"] == "127.0.0.3" && s["leaking"] == true)
    })
    .await;
    assert!(flagged, "the leak detector flags 127.0.0.3");

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

/// A leak watch on `egress_runtime_tasks` (tests/soak.rs, an operator's alert) compares it to
/// a count taken at rest. The first connection parked must not move that count: a task that
/// started with it and stayed would read as a leak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_parked_connection_leaves_the_tasks_at_rest_where_they_were() {
    let upstream = FakeUpstream::start().await;
    // Debug logs say when the one-off task that releases the start-up pages has ended.
    let sidecar = ChildSidecar::spawn_with_env("", &[("EGRESS_LOG", "info,egress_sidecar=debug")]).await;
    let logs = sidecar.logs.clone();
    let released = || logs.lock().unwrap().iter().any(|l| l.contains("start-up pages"));
    assert!(
        support::eventually(Duration::from_secs(5), released).await,
        "start-up pages released"
    );
    let url = format!("http://{}/", upstream.addr);
    let tasks = |m: &prometheus_parse::Scrape| value(m, "egress_runtime_tasks", &[]);
    let open = |m: &prometheus_parse::Scrape| value(m, "egress_downstream_connections", &[]);
    // At rest after a first exchange (its upstream connection stays in the pool), from a
    // client that left at once and so never parked.
    assert_eq!(RawClient::connect(sidecar.addr).await.get(&url).await.status, 200);
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| open(m) == 0.0).await;
    assert_eq!(open(&m), 0.0, "the first client's connection closed");
    let at_rest = tasks(&m);

    let mut client = RawClient::connect(sidecar.addr).await;
    assert_eq!(client.get(&url).await.status, 200);
    support::wait_parked(sidecar.admin, 1, Some(1)).await;
    drop(client);
    support::wait_parked(sidecar.admin, 0, Some(0)).await;
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| tasks(m) == at_rest).await;
    assert_eq!(
        tasks(&m),
        at_rest,
        "runtime tasks at rest, before and after a parked connection"
    );
}
