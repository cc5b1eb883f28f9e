//! SIGTERM: readiness turns 503, in-flight requests complete, new requests during the drain are
//! still served, and the process exits 0 as soon as no application connection is left (at once
//! when applications are idle).

mod support;

use std::time::{Duration, Instant};

use support::{ChildSidecar, FakeUpstream, RawClient};

fn sigterm(sidecar: &ChildSidecar) {
    let pid = sidecar.child.id().expect("running").to_string();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(status.success());
}

async fn readyz(admin: std::net::SocketAddr) -> u16 {
    let mut client = RawClient::connect(admin).await;
    client
        .send_raw(b"GET /readyz HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
        .await;
    client
        .read_response(false)
        .await
        .expect("a /readyz answer")
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_load_finishes_the_work_and_exits_zero() {
    let upstream = FakeUpstream::start().await;
    let mut sidecar = ChildSidecar::spawn("shutdown: { drain_timeout: 8s }\n").await;
    assert_eq!(readyz(sidecar.admin).await, 200);
    let (addr, up) = (sidecar.addr, upstream.addr);
    let in_flight = tokio::spawn(async move {
        RawClient::connect(addr)
            .await
            .get(&format!("http://{up}/sleep/1500"))
            .await
    });
    assert!(support::eventually(Duration::from_secs(5), || upstream.requests() == 1).await);

    let signalled = Instant::now();
    sigterm(&sidecar);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(readyz(sidecar.admin).await, 503, "readiness off while draining");
    // An application still finishing its work can open a new connection and be served.
    let during = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{up}/"))
        .await;
    assert_eq!(during.status, 200);
    assert_eq!(during.header("connection"), Some("close"));

    let finished = in_flight.await.unwrap();
    assert_eq!(finished.status, 200, "in-flight request completed");
    let status = tokio::time::timeout(Duration::from_secs(8), sidecar.child.wait())
        .await
        .expect("exited within the drain deadline")
        .unwrap();
    assert!(status.success(), "exit status {status}");
    println!("exited {:?} after SIGTERM", signalled.elapsed());
    assert!(
        signalled.elapsed() < Duration::from_secs(4),
        "waited for the deadline instead of the last connection"
    );
}

#[tokio::test]
async fn sigterm_with_idle_applications_exits_at_once() {
    let upstream = FakeUpstream::start().await;
    let mut sidecar =
        ChildSidecar::spawn("shutdown: { drain_timeout: 8s }\ndownstream: { idle_timeout: 60s }\n").await;
    // An application holding an idle keep-alive connection.
    let mut idle = RawClient::connect(sidecar.addr).await;
    assert_eq!(idle.get(&format!("http://{}/", upstream.addr)).await.status, 200);
    let signalled = Instant::now();
    sigterm(&sidecar);
    let status = tokio::time::timeout(Duration::from_secs(8), sidecar.child.wait())
        .await
        .expect("exited")
        .unwrap();
    assert!(status.success(), "exit status {status}");
    assert!(
        signalled.elapsed() < Duration::from_secs(1),
        "took {:?}",
        signalled.elapsed()
    );
    assert!(
        idle.is_closed_within(Duration::from_secs(1)).await,
        "the idle connection was closed"
    );
}
