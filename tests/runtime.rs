//! With one core (a CPU limit of 1, or `TOKIO_WORKER_THREADS=1`) the sidecar runs everything on
//! its main thread, as nginx's single worker does, and still serves every kind of exchange:
//! concurrent keep-alive requests, streamed bodies both ways, and idle connections that were
//! parked and come back.
//!
//! Once started, the sidecar releases the pages of code that start-up touched (`resident`), and
//! keeps serving with what comes back on use.

mod support;

use std::time::Duration;

use support::{ChildSidecar, FakeUpstream, RawClient};
use tokio::io::AsyncWriteExt;

/// `Threads:` of /proc/PID/status.
fn threads(sidecar: &ChildSidecar) -> usize {
    status_number(sidecar.child.id().expect("running"), "Threads") as usize
}

/// The number in a field of /proc/PID/status (`kB` fields in KiB).
fn status_number(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{key} in /proc/{pid}/status"))
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

    // Idle long enough to be parked (100 ms), then used again: wait until it is the one
    // connection open and it is parked.
    support::wait_parked(sidecar.admin, 1, Some(1)).await;
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

/// Resident KiB of the child's mappings that `resident` may release.
fn releasable_rss_kib(pid: u32) -> u64 {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    egress_sidecar::resident::releasable_kib(&smaps)
}

/// A one-thread sidecar with debug logs, once it has logged the release of its start-up pages;
/// the log line comes back too.
async fn spawn_after_release(yaml: &str) -> (ChildSidecar, String) {
    let sidecar = ChildSidecar::spawn_with_env(
        yaml,
        &[
            ("EGRESS_LOG", "info,egress_sidecar=debug"),
            ("TOKIO_WORKER_THREADS", "1"),
        ],
    )
    .await;
    let logs = sidecar.logs.clone();
    let find = || {
        logs.lock()
            .unwrap()
            .iter()
            .find(|l| l.contains("released start-up pages"))
            .cloned()
    };
    assert!(
        support::eventually(Duration::from_secs(5), || find().is_some()).await,
        "no release logged: {:?}",
        logs.lock().unwrap()
    );
    let line = find().unwrap();
    (sidecar, line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_pages_are_released_and_serving_brings_back_less() {
    let upstream = FakeUpstream::start().await;
    let up = upstream.addr;
    let (sidecar, line) = spawn_after_release("").await;
    let number = |key: &str| json_number(&line, key);
    let released_kib = number("kib");
    assert!(
        number("mappings") >= 2,
        "the executable's code and read-only data: {line}"
    );
    assert!(
        released_kib > 1024,
        "start-up touches more than 1 MiB of code: {line}"
    );

    // Serving runs code that was released: it comes back, and works.
    for _ in 0..4 {
        let mut client = RawClient::connect(sidecar.addr).await;
        for _ in 0..25 {
            let resp = client.get(&format!("http://{up}/")).await;
            assert_eq!(resp.status, 200);
            assert_eq!(resp.text(), "ok");
        }
    }
    let resp = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{up}/bytes/1000000"))
        .await;
    assert_eq!(resp.body.len(), 1_000_000);

    let back_kib = releasable_rss_kib(sidecar.child.id().expect("running"));
    assert!(
        back_kib < released_kib,
        "serving brought back {back_kib} kB, start-up held {released_kib} kB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heap_freed_after_a_burst_goes_back_to_the_kernel() {
    let upstream = FakeUpstream::start().await;
    let up = upstream.addr;
    // Start-up's pages are released first (they would make RSS fall on their own), and the
    // peak is reset below so that it is the burst's.
    let (sidecar, _) =
        spawn_after_release("defaults: { pool: { max_connections: 400, max_idle: 400 } }\n").await;
    let pid = sidecar.child.id().expect("running");
    for resp in support::spawn_gets(sidecar.addr, &format!("http://{up}/"), 8) {
        assert_eq!(resp.await.unwrap().status, 200);
    }
    let logs = sidecar.logs.clone();
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("resetting VmHWM");
    let before = status_number(pid, "VmRSS");

    // 400 requests in flight at once, each with its connection task, request state and
    // buffers; the pool dials 400 upstream connections, which stay pooled afterwards.
    for resp in support::spawn_gets(sidecar.addr, &format!("http://{up}/sleep/1000"), 400) {
        assert_eq!(resp.await.unwrap().status, 200);
    }
    let grown = status_number(pid, "VmHWM").saturating_sub(before);
    assert!(grown > 2048, "the burst grew RSS by only {grown} KiB");

    // The next trim hands back what the burst freed. Measured in this test's debug build: 2-3
    // MiB of anonymous memory stays (400 pooled connections and pages the allocator still
    // uses in part) of the 4.7-7 MiB the burst leaves without trimming.
    let trims_before = logs.lock().unwrap().len();
    let released_after_burst = || {
        logs.lock().unwrap()[trims_before..]
            .iter()
            .filter(|l| l.contains("heap trimmed"))
            .map(|l| json_number(l, "released_kib"))
            .max()
    };
    assert!(
        support::eventually(Duration::from_secs(8), || released_after_burst()
            .is_some_and(|kib| kib >= 1024))
        .await,
        "no trim after a burst of +{grown} KiB handed back 1 MiB: {:?} KiB",
        released_after_burst()
    );
    println!(
        "RSS before {before} KiB, burst +{grown} KiB; a trim after it released {:?} KiB",
        released_after_burst()
    );
}

/// The integer value of `"key":` in a JSON log line.
fn json_number(line: &str, key: &str) -> u64 {
    let at = line
        .find(&format!("\"{key}\":"))
        .unwrap_or_else(|| panic!("{key} in {line}"));
    line[at + key.len() + 3..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap_or_else(|_| panic!("{key} in {line}"))
}
