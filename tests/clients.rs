//! Real HTTP clients (curl, Python `requests`, Go `net/http`) sending plain HTTP through the
//! sidecar as their HTTP proxy, each as a subprocess with its proxy set in its own environment
//! or on its command line.
//!
//! The upstream is configured as `http://api.internal.test` with a static address: the name
//! resolves nowhere, so a request can only reach the fake upstream through the sidecar, and
//! clients that never proxy loopback targets (Go's `ProxyFromEnvironment`) still use the proxy.

mod support;

use std::path::Path;
use std::process::Output;
use std::time::{Duration, Instant};

use support::{FakeUpstream, Sidecar};
use tokio::process::Command;

const HOST: &str = "api.internal.test";

/// A fake upstream and a sidecar that maps `api.internal.test` to it.
async fn setup() -> (FakeUpstream, Sidecar) {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: api\n    url: http://{HOST}\n    addresses: [{}]\n",
        upstream.addr
    ))
    .await;
    (upstream, sidecar)
}

/// Runs `cmd` to completion within 15 s.
async fn run(mut cmd: Command) -> Output {
    let what = format!("{:?}", cmd.as_std());
    tokio::time::timeout(Duration::from_secs(15), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 15s"))
        .unwrap_or_else(|e| panic!("running {what}: {e}"))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs curl and returns (status, body); `-w` appends the status on a line of its own.
async fn curl_status_body(mut cmd: Command) -> (u16, String, String) {
    cmd.args(["-sS", "-w", "\n%{http_code}"]);
    let out = run(cmd).await;
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(
        out.status.success(),
        "curl failed: {}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    let (body, code) = stdout.rsplit_once('\n').expect("status line");
    (code.trim().parse().expect("status code"), body.to_owned(), stderr)
}

/// Checks what the upstream saw for the one request of a test.
fn assert_forwarded(upstream: &FakeUpstream, uri: &str) {
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "upstream saw {seen:?}");
    let req = &seen[0];
    assert_eq!(req.method, "GET");
    assert_eq!(req.uri, uri, "the upstream must see origin-form");
    assert_eq!(req.headers.get("host").map(|h| h.to_str().unwrap()), Some(HOST));
    for hop in ["proxy-connection", "proxy-authorization", "keep-alive"] {
        assert!(
            !req.headers.contains_key(hop),
            "hop-by-hop {hop} reached the upstream: {:?}",
            req.headers
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_with_proxy_flag_gets_origin_form_upstream() {
    let (upstream, sidecar) = setup().await;
    let mut cmd = support::curl();
    cmd.args(["-v", "-x", &format!("http://{}", sidecar.addr)])
        // curl 7.x sends this on its own; naming it keeps the check meaningful on any version.
        .args(["-H", "Proxy-Connection: Keep-Alive"])
        .arg(format!("http://{HOST}/path?q=1"));
    let (status, body, trace) = curl_status_body(cmd).await;
    assert_eq!((status, body.as_str()), (200, "ok"), "curl trace:\n{trace}");
    assert!(
        trace.contains("> GET http://api.internal.test/path?q=1 HTTP/1.1"),
        "curl did not send absolute-form to the proxy:\n{trace}"
    );
    assert!(trace.contains("> Proxy-Connection: Keep-Alive"), "{trace}");
    assert_forwarded(&upstream, "/path?q=1");
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_with_http_proxy_env_gets_origin_form_upstream() {
    let (upstream, sidecar) = setup().await;
    let mut cmd = support::curl();
    // curl reads the lower-case name for http:// URLs.
    cmd.env("http_proxy", format!("http://{}", sidecar.addr))
        .args(["-v", "-H", "Proxy-Connection: Keep-Alive"])
        .arg(format!("http://{HOST}/path"));
    let (status, body, trace) = curl_status_body(cmd).await;
    assert_eq!((status, body.as_str()), (200, "ok"), "curl trace:\n{trace}");
    assert!(
        trace.contains("> GET http://api.internal.test/path HTTP/1.1"),
        "curl did not use the proxy from http_proxy:\n{trace}"
    );
    assert_forwarded(&upstream, "/path");
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_posts_one_mebibyte_with_and_without_expect_continue() {
    const SIZE: usize = 1 << 20;
    let (upstream, sidecar) = setup().await;
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("clients-post-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("body.bin");
    std::fs::write(&file, vec![b'x'; SIZE]).unwrap();
    let proxy = format!("http://{}", sidecar.addr);

    for expect in ["Expect:", "Expect: 100-continue"] {
        let mut cmd = support::curl();
        cmd.args(["-v", "-x", &proxy, "-H", expect, "--data-binary"])
            .arg(format!("@{}", file.display()))
            .arg(format!("http://{HOST}/drain"));
        let started = Instant::now();
        let (status, body, trace) = curl_status_body(cmd).await;
        println!("POST 1 MiB with {expect:?}: {status} in {:?}", started.elapsed());
        assert_eq!(
            (status, body.as_str()),
            (200, "1048576"),
            "{expect}; curl trace:\n{trace}"
        );
        if expect.ends_with("100-continue") {
            assert!(trace.contains("> Expect: 100-continue"), "{trace}");
            // The sidecar answers 100 Continue itself; curl must not fall back to sending the
            // body after its expect timeout.
            assert!(
                trace.contains("< HTTP/1.1 100 Continue"),
                "no 100 Continue from the sidecar:\n{trace}"
            );
            assert!(!trace.contains("Done waiting for 100-continue"), "{trace}");
        } else {
            assert!(!trace.contains("100 Continue"), "{trace}");
        }
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for req in &seen {
        assert_eq!(req.method, "POST");
        assert_eq!(req.uri, "/drain");
        assert_eq!(req.body_len, SIZE as u64);
        assert!(
            !req.headers.contains_key("expect"),
            "Expect reached the upstream: {:?}",
            req.headers
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_requests_uses_http_proxy_env() {
    let probe = run({
        let mut cmd = support::client_command("python3");
        cmd.args(["-c", "import requests"]);
        cmd
    })
    .await;
    if !probe.status.success() {
        support::skip(&format!(
            "python3 cannot import requests: {}",
            text(&probe.stderr).trim()
        ));
        return;
    }
    let (upstream, sidecar) = setup().await;
    let proxy = format!("http://{}", sidecar.addr);
    let mut cmd = support::client_command("python3");
    cmd.env("HTTP_PROXY", &proxy)
        .env("http_proxy", &proxy)
        .args([
            "-c",
            "import sys, requests\n\
             r = requests.get(sys.argv[1], timeout=10)\n\
             print(r.status_code)\n\
             sys.stdout.write(r.text)\n",
        ])
        .arg(format!("http://{HOST}/py?x=1"));
    let out = run(cmd).await;
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "python failed: {}\n{}",
        out.status,
        text(&out.stderr)
    );
    assert_eq!(stdout, "200\nok");
    assert_forwarded(&upstream, "/py?x=1");
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn go_proxy_from_environment_uses_http_proxy() {
    let Some(bin) = support::build_go("tests/goenv/main.go", "goenv").await else {
        support::skip("`go` is not on PATH");
        return;
    };
    let (upstream, sidecar) = setup().await;
    let mut cmd = support::client_command(&bin);
    cmd.env("HTTP_PROXY", format!("http://{}", sidecar.addr))
        .arg(format!("http://{HOST}/hello"));
    let out = run(cmd).await;
    assert!(
        out.status.success(),
        "goenv failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(text(&out.stdout), "status=200\nok");
    assert_forwarded(&upstream, "/hello");
    sidecar.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_to_unresolvable_host_gets_502_connect_failed() {
    let (upstream, sidecar) = setup().await;
    let mut cmd = support::curl();
    cmd.args(["-sS", "-i", "-x", &format!("http://{}", sidecar.addr)])
        .arg("http://no-such-host.invalid/");
    let out = run(cmd).await;
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "curl failed: {}\n{}",
        out.status,
        text(&out.stderr)
    );
    let (head, body) = stdout.split_once("\r\n\r\n").expect("a response head");
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    assert!(status_line.starts_with("HTTP/1.1 502"), "{stdout}");
    let error = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("x-egress-error"))
        .map(|(_, value)| value.trim().to_owned());
    assert_eq!(error.as_deref(), Some("connect_failed"), "{stdout}");
    assert!(
        body.contains("no-such-host.invalid"),
        "the body names the host: {body:?}"
    );
    assert_eq!(upstream.requests(), 0);
    sidecar.stop().await;
}
