//! The Unix-socket listener (`listen_unix`): it serves what the TCP forward-proxy listener
//! serves, manages its socket file, and lets the leak detector name processes: two real
//! processes on the socket, a leaky Go binary and a well-behaved python3, are told apart by
//! pid and executable.

mod support;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use support::{ChildSidecar, FakeUpstream, Sidecar, TempDir};

/// A python3 client keeping one connection over the Unix socket for all its requests (origin
/// form, routed by `Host`).
const WELL_BEHAVED: &str = r#"
import http.client, socket, sys
class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, host):
        super().__init__(host)
        self.unix_path = path
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)
path, host, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = UnixConnection(path, host)
for _ in range(n):
    conn.request("GET", "/")
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200, (resp.status, body)
conn.close()
"#;

/// The interpreter behind `python3` (pyenv and distro shims exec it), so that its pid and
/// executable are what the sidecar sees.
async fn python3() -> Option<PathBuf> {
    let out = tokio::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .await
        .ok()?;
    let path = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !path.is_empty()).then(|| std::fs::canonicalize(path).unwrap())
}

fn my_uid() -> u32 {
    std::fs::metadata("/proc/self").unwrap().uid()
}

async fn debug_clients(admin: std::net::SocketAddr) -> Vec<serde_json::Value> {
    let resp = support::admin_get(admin, "/debug/clients").await;
    assert_eq!(resp.status, 200);
    serde_json::from_slice(&resp.body).expect("JSON")
}

/// Sends `raw` on a fresh Unix-socket connection and reads until the sidecar closes it.
async fn exchange(path: &Path, raw: &[u8]) -> String {
    let mut stream = UnixStream::connect(path).await.unwrap();
    stream.write_all(raw).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out))
        .await
        .expect("closed within 5s")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaky_process_on_the_unix_socket_is_named_by_pid_and_executable() {
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH");
        return;
    };
    let Some(python) = python3().await else {
        support::skip("`python3` is not on PATH");
        return;
    };
    let leaky = std::fs::canonicalize(leaky).unwrap();
    let upstream = FakeUpstream::start().await;
    let dir = TempDir::new();
    let socket = dir.path.join("egress.sock");
    let sidecar = ChildSidecar::spawn(&format!(
        "listen_unix: {}\nupstreams:\n  - name: fake\n    url: http://{}\n",
        socket.display(),
        upstream.addr
    ))
    .await;

    // The leaky client: 150 requests, each on a new connection (absolute-form, the proxy dialed
    // over the Unix socket), then it exits.
    let url = format!("http://{}/", upstream.addr);
    let child = tokio::process::Command::new(&leaky)
        .args([
            "-n",
            "150",
            "-url",
            &url,
            "-wait",
            "0s",
            "-proxy",
            "http://egress.invalid",
        ])
        .arg("-unix")
        .arg(&socket)
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let leaky_pid = child.id().unwrap();
    let out = child.wait_with_output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"ok\":150"));

    // The well-behaved client: 150 requests on one connection.
    let child = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(WELL_BEHAVED)
        .arg(&socket)
        .arg(upstream.addr.to_string())
        .arg("150")
        .kill_on_drop(true)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let python_pid = child.id().unwrap();
    let out = child.wait_with_output().await.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    assert!(support::eventually(Duration::from_secs(5), || upstream.requests() >= 300).await);
    let warned = support::eventually(Duration::from_secs(5), || {
        !sidecar.logged("likely builds").is_empty()
    })
    .await;
    // Every connection has closed once the counts are in.
    let mut report = Vec::new();
    for _ in 0..50 {
        report = debug_clients(sidecar.admin).await;
        let closed = report
            .iter()
            .map(|r| r["requests"].as_u64().unwrap())
            .sum::<u64>();
        if closed == 300 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    let by_pid = |pid: u32| {
        report
            .iter()
            .find(|r| r["pid"] == pid)
            .unwrap_or_else(|| panic!("no source with pid {pid} in {report:?}"))
    };
    let uid = my_uid();

    let bad = by_pid(leaky_pid);
    assert_eq!(bad["exe"], leaky.to_str().unwrap());
    assert_eq!(bad["uid"], uid);
    assert_eq!(
        bad["source"],
        format!("pid {leaky_pid} ({}) uid {uid}", leaky.display())
    );
    assert_eq!(bad["leaking"], true);
    assert_eq!(bad["connections_opened"], 150);
    assert_eq!(bad["requests_per_connection"], 1.0);

    let good = by_pid(python_pid);
    assert_eq!(good["exe"], python.to_str().unwrap());
    assert_eq!(good["leaking"], false);
    assert_eq!(good["connections_opened"], 1);
    assert_eq!(good["requests"], 150);
    assert_eq!(report.len(), 2, "only the two processes: {report:?}");

    assert!(warned, "no leak warning logged");
    let warnings = sidecar.logged("likely builds");
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let warning: serde_json::Value = serde_json::from_str(&warnings[0]).unwrap();
    let fields = &warning["fields"];
    assert_eq!(fields["pid"], leaky_pid, "{warning}");
    assert_eq!(fields["exe"], leaky.to_str().unwrap());
    let message = fields["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("client pid {leaky_pid} ({})", leaky.display())),
        "{message}"
    );
    assert!(!warnings[0].contains(&format!("pid {python_pid} ")));
    assert_eq!(
        upstream.accepted(),
        1,
        "all of it over one pooled upstream connection"
    );
}

#[tokio::test]
async fn the_unix_listener_serves_like_the_tcp_one_and_owns_its_socket_file() {
    let upstream = FakeUpstream::start().await;
    let dir = TempDir::new();
    let socket = dir.path.join("egress.sock");
    // A stale socket file: bound by a listener that is gone.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());

    let up = upstream.addr;
    let sidecar = Sidecar::start(&format!(
        "listen_unix: {}\nupstreams:\n  - name: fake\n    url: http://{up}\n",
        socket.display()
    ))
    .await;
    // Absolute-form, as HTTP_PROXY clients send it.
    let absolute = exchange(
        &socket,
        format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(absolute.starts_with("HTTP/1.1 200 OK\r\n"), "{absolute}");
    assert!(absolute.ends_with("\r\n\r\nok"), "{absolute}");
    // Origin-form routed by Host.
    let origin = exchange(
        &socket,
        format!("GET /close HTTP/1.1\r\nHost: {up}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(origin.starts_with("HTTP/1.1 200 OK\r\n"), "{origin}");

    // h2c with prior knowledge (the preface is peeked on the Unix socket too).
    let io = hyper_util::rt::TokioIo::new(UnixStream::connect(&socket).await.unwrap());
    let (mut send, conn) = hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{up}/"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    drop(send);

    // Keep-alive across an idle spell long enough to park the connection (100 ms) and wake it.
    let mut kept = UnixStream::connect(&socket).await.unwrap();
    for _ in 0..2 {
        let req = format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\n\r\n");
        kept.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        while !got.ends_with(b"\r\n\r\nok") {
            let mut buf = [0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(5), kept.read(&mut buf))
                .await
                .expect("answered within 5s")
                .unwrap();
            assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"));
        // Until it is parked (the h2c connection above is never parked).
        support::wait_parked(sidecar.admin, 1, None).await;
    }
    drop(kept);

    sidecar.stop().await;
    assert!(!socket.exists(), "the socket file is removed at shutdown");
    assert_eq!(upstream.requests(), 5);
}

#[tokio::test]
async fn a_path_that_is_not_a_stale_socket_is_refused_naming_listen_unix() {
    let dir = TempDir::new();
    let config = |path: &Path| {
        egress_sidecar::config::parse(
            &format!(
                "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nlisten_unix: {}\n",
                path.display()
            ),
            &Default::default(),
        )
        .unwrap()
    };

    let file = dir.path.join("not-a-socket");
    std::fs::write(&file, "keep me").unwrap();
    let err = egress_sidecar::Listeners::bind(&config(&file)).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("listen_unix") && text.contains("not a socket"),
        "{text}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me", "left alone");

    // A socket something still listens on (another sidecar) is not taken over.
    let live = dir.path.join("live.sock");
    let _other = std::os::unix::net::UnixListener::bind(&live).unwrap();
    let err = egress_sidecar::Listeners::bind(&config(&live)).await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("listen_unix") && text.contains("listening"),
        "{text}"
    );
    assert!(live.exists());

    // The binary refuses to start, naming the key.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_egress-sidecar"))
        .args([
            "run",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--listen-unix",
        ])
        .arg(&file)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("listen_unix"), "{stderr}");
}

#[tokio::test]
async fn bad_input_on_the_unix_socket_gets_the_tcp_listeners_answers() {
    let upstream = FakeUpstream::start().await;
    let dir = TempDir::new();
    let socket = dir.path.join("egress.sock");
    let sidecar = Sidecar::start(&format!("listen_unix: {}\n", socket.display())).await;

    // Connect and leave at once, a few times: nothing to answer, nothing breaks.
    for _ in 0..5 {
        drop(UnixStream::connect(&socket).await.unwrap());
    }
    let mut half = UnixStream::connect(&socket).await.unwrap();
    half.write_all(b"GET http://").await.unwrap();
    drop(half);

    for garbage in [
        &b"GARBAGE\r\n\r\n"[..],
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
    ] {
        let over_unix = exchange(&socket, garbage).await;
        let mut tcp = tokio::net::TcpStream::connect(sidecar.addr).await.unwrap();
        tcp.write_all(garbage).await.unwrap();
        let mut over_tcp = Vec::new();
        tcp.read_to_end(&mut over_tcp).await.unwrap();
        let over_tcp = String::from_utf8_lossy(&over_tcp);
        assert!(over_unix.starts_with("HTTP/1.1 400 "), "{over_unix}");
        assert!(
            over_unix
                .to_ascii_lowercase()
                .contains("x-egress-error: bad_request"),
            "{over_unix}"
        );
        assert_eq!(over_unix, over_tcp, "the same answer on both listeners");
    }

    // Still serving.
    let up = upstream.addr;
    let ok = exchange(
        &socket,
        format!("GET http://{up}/ HTTP/1.1\r\nHost: {up}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    sidecar.stop().await;
}
