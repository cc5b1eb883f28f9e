//! The process-level contract around signals and readiness, on the real binary: a second
//! SIGTERM/SIGINT during the drain exits 130 at once, and `egress-sidecar healthcheck` exits 0
//! only while the admin listener says ready (1 while draining, 1 with nothing listening).

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use support::{ChildSidecar, FakeUpstream, RawClient};

/// Long enough that a drain never ends by itself within a test: only the second signal or the
/// request finishing can end it.
const NO_DRAIN_END: &str = "shutdown: { drain_timeout: 120s }\n";

/// An application request the upstream holds for a minute, so the drain has a connection to wait
/// for. Returns once the upstream has it.
async fn hold_a_request(
    sidecar: &ChildSidecar,
    upstream: &FakeUpstream,
) -> tokio::task::JoinHandle<Option<u16>> {
    let (addr, up) = (sidecar.addr, upstream.addr);
    let in_flight = tokio::spawn(async move {
        let mut client = RawClient::connect(addr).await;
        client
            .send_raw(format!("GET http://{up}/sleep/60000 HTTP/1.1\r\nHost: {up}\r\n\r\n").as_bytes())
            .await;
        client.read_response(false).await.map(|r| r.status)
    });
    assert!(
        support::eventually(Duration::from_secs(5), || upstream.requests() == 1).await,
        "the held request reached the upstream"
    );
    in_flight
}

/// Polls `/readyz` until it answers `status` (at most `within`).
async fn readyz_becomes(admin: SocketAddr, status: u16, within: Duration) -> bool {
    support::eventually_async(within, || async move {
        support::admin_get(admin, "/readyz").await.status == status
    })
    .await
}

#[tokio::test]
async fn a_second_signal_during_the_drain_exits_130_at_once() {
    let upstream = FakeUpstream::start().await;
    let mut sidecar = ChildSidecar::spawn(NO_DRAIN_END).await;
    let in_flight = hold_a_request(&sidecar, &upstream).await;

    sidecar.signal("-TERM");
    assert!(
        readyz_becomes(sidecar.admin, 503, Duration::from_secs(5)).await,
        "the first signal started the drain"
    );
    // The drain now waits for the held request (a minute) or drain_timeout (two).
    assert!(
        tokio::time::timeout(Duration::from_millis(300), sidecar.child.wait())
            .await
            .is_err(),
        "the first signal alone must not end the process while a request is in flight"
    );

    // One SIGINT: the sidecar has listened for a second signal since start, so it cannot miss
    // this one however soon after the first it comes.
    sidecar.signal("-INT");
    let status = tokio::time::timeout(Duration::from_secs(5), sidecar.child.wait())
        .await
        .expect("the process exited on a second signal, without finishing the drain")
        .unwrap();
    assert_eq!(status.code(), Some(130), "exit status {status}");
    // The stderr reader task may still be behind the exit: wait for it to read the last line.
    assert!(
        support::eventually(Duration::from_secs(5), || sidecar.logged("second signal").len()
            == 1)
        .await,
        "the early exit is logged once"
    );
    // The held request never got its answer: the drain was cut short, not completed.
    let answered = tokio::time::timeout(Duration::from_secs(5), in_flight)
        .await
        .expect("the client saw the connection end")
        .unwrap();
    assert_eq!(answered, None, "the in-flight request was cut off by the exit");
}

/// A second signal sent right behind the first, before the drain has even started, still
/// counts: an operator's double Ctrl-C. (The handler for it was once installed by a task the
/// first signal spawned, and a signal that came before that task ran was lost.)
#[tokio::test]
async fn a_second_signal_right_behind_the_first_is_not_missed() {
    let upstream = FakeUpstream::start().await;
    let mut sidecar = ChildSidecar::spawn(NO_DRAIN_END).await;
    let _in_flight = hold_a_request(&sidecar, &upstream).await;
    // Both from one shell, microseconds apart: the sidecar takes them in one turn.
    let pid = sidecar.child.id().unwrap();
    let sent = std::process::Command::new("sh")
        .args(["-c", &format!("kill -TERM {pid}; kill -INT {pid}")])
        .status()
        .unwrap();
    assert!(sent.success());
    let status = tokio::time::timeout(Duration::from_secs(5), sidecar.child.wait())
        .await
        .expect("the second signal ended the process (without it the drain waits a minute)")
        .unwrap();
    assert_eq!(status.code(), Some(130), "exit status {status}");
}

/// Runs `egress-sidecar healthcheck --admin ADDR`; returns its exit code and stderr.
async fn healthcheck(admin: SocketAddr) -> (Option<i32>, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_egress-sidecar"))
        .arg("healthcheck")
        .arg("--admin")
        .arg(admin.to_string())
        .env_remove("EGRESS_ADMIN")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(10), output)
        .await
        .expect("healthcheck finished within 10s (its own timeout is 2s)")
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test]
async fn healthcheck_exits_0_when_ready_and_1_when_draining() {
    let upstream = FakeUpstream::start().await;
    let sidecar = ChildSidecar::spawn(NO_DRAIN_END).await;
    let (code, stderr) = healthcheck(sidecar.admin).await;
    assert_eq!(code, Some(0), "ready: {stderr}");

    let _in_flight = hold_a_request(&sidecar, &upstream).await;
    sidecar.signal("-TERM");
    assert!(readyz_becomes(sidecar.admin, 503, Duration::from_secs(5)).await);
    let (code, stderr) = healthcheck(sidecar.admin).await;
    assert_eq!(code, Some(1), "draining: {stderr}");
    assert_eq!(stderr.trim(), "not ready");
}

#[tokio::test]
async fn healthcheck_exits_1_when_nothing_listens() {
    // Bound but not listening: connects are refused, and the port stays ours for the test.
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    let (code, stderr) = healthcheck(addr).await;
    assert_eq!(code, Some(1), "nothing listening: {stderr}");
    assert!(
        stderr.contains(&format!("connecting to {addr}")),
        "says what failed: {stderr}"
    );
}
