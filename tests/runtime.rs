//! With one core (a CPU limit of 1, or `TOKIO_WORKER_THREADS=1`) the sidecar runs everything on
//! its main thread, as nginx's single worker does, and still serves every kind of exchange:
//! concurrent keep-alive requests, streamed bodies both ways, and idle connections that were
//! parked and come back.

mod support;

use std::time::Duration;

use support::{ChildSidecar, FakeUpstream, RawClient};
use tokio::io::AsyncWriteExt;

/// `Threads:` of /proc/PID/status.
fn threads(sidecar: &ChildSidecar) -> usize {
    let pid = sidecar.child.id().expect("running");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads in /proc/PID/status")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_runs_on_the_main_thread_and_serves_everything() {
    let upstream = FakeUpstream::start().await;
    let up = upstream.addr;
    let sidecar = ChildSidecar::spawn_with_env("", &[("TOKIO_WORKER_THREADS", "1")]).await;
    assert_eq!(threads(&sidecar), 1, "one worker: the main thread alone");

    // Concurrent keep-alive clients, each sending several requests.
    let mut clients = Vec::new();
    for _ in 0..8 {
        let addr = sidecar.addr;
        clients.push(tokio::spawn(async move {
            let mut client = RawClient::connect(addr).await;
            for _ in 0..25 {
                let resp = client.get(&format!("http://{up}/")).await;
                assert_eq!(resp.status, 200);
                assert_eq!(resp.text(), "ok");
            }
        }));
    }
    for client in clients {
        client.await.unwrap();
    }

    // A streamed upload and download.
    let mut client = RawClient::connect(sidecar.addr).await;
    let len = 4 << 20;
    let head = format!("POST http://{up}/drain HTTP/1.1\r\nHost: {up}\r\nContent-Length: {len}\r\n\r\n");
    client.send_raw(head.as_bytes()).await;
    client.stream.write_all(&vec![b'x'; len]).await.unwrap();
    let resp = client.read_response(false).await.expect("upload answered");
    assert_eq!(resp.text(), len.to_string());
    let resp = client.get(&format!("http://{up}/bytes/{len}")).await;
    assert_eq!(resp.body.len(), len);

    // Idle long enough to be parked (100 ms), then used again.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let resp = client.get(&format!("http://{up}/")).await;
    assert_eq!(resp.text(), "ok");

    assert_eq!(threads(&sidecar), 1, "still one thread after serving");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_run_beside_the_main_thread() {
    let sidecar = ChildSidecar::spawn_with_env("", &[("TOKIO_WORKER_THREADS", "2")]).await;
    assert!(
        threads(&sidecar) >= 3,
        "main thread and two workers: {}",
        threads(&sidecar)
    );
}
