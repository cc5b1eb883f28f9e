//! What the sidecar's outputs never carry, held end to end against the running sidecar:
//!
//! - a forged access-log line: hostile paths, hosts and user agents, written byte for byte on
//!   raw sockets, come out of the text log escaped as nginx escapes them (`"`, `\` and bytes
//!   outside printable ASCII as `\xHH`), so that a combined-format regex reads every field
//!   where it is; JSON lines stay valid JSON;
//! - a credential: URL userinfo (forward mode, inside a CONNECT served as plain HTTP, CONNECT
//!   targets, h2c), `Proxy-Authorization` and a `request_headers` value are absent from the
//!   access log (JSON and text), from stderr at `EGRESS_LOG=debug`, from every response body,
//!   `/metrics`, `/debug/pools` and `/debug/clients`;
//! - the open-proxy warning.
//!
//! That credential fields print as `Sensitive` is held by unit tests where it is decided: the
//! downstream codec (`credentials_are_read_as_sensitive`) and the h2c server's
//! `mark_credentials`.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use support::{ChildSidecar, FakeUpstream, RawClient, Sidecar, TempDir};

// === shared helpers ===

async fn wait_lines(path: &Path, n: usize) -> Vec<Vec<u8>> {
    support::wait_file_lines(path, n).await
}

/// Sends `head` (raw bytes, the whole request) on a connection of its own and reads the answer.
async fn exchange(sidecar: SocketAddr, head: &[u8]) -> support::RawResponse {
    let mut client = RawClient::connect(sidecar).await;
    client.send_raw(head).await;
    tokio::time::timeout(Duration::from_secs(10), client.read_response(false))
        .await
        .expect("an answer within 10 s")
        .expect("an answer")
}

// === 1. hostile bytes in the access log ===

/// One hostile request: the bytes of its request line's target, its `Host` and its
/// `User-Agent` as sent.
struct Hostile {
    target: Vec<u8>,
    host: Vec<u8>,
    user_agent: Option<Vec<u8>>,
    status: u16,
}

impl Hostile {
    fn head(&self) -> Vec<u8> {
        let mut head = b"GET ".to_vec();
        head.extend_from_slice(&self.target);
        head.extend_from_slice(b" HTTP/1.1\r\nHost: ");
        head.extend_from_slice(&self.host);
        if let Some(ua) = &self.user_agent {
            head.extend_from_slice(b"\r\nUser-Agent: ");
            head.extend_from_slice(ua);
        }
        head.extend_from_slice(b"\r\nConnection: close\r\n\r\n");
        head
    }

    /// The path the log shows: the target's, without the query (`access_log.query` is off).
    fn path(&self) -> Vec<u8> {
        let after_scheme = match self.target.windows(3).position(|w| w == b"://") {
            Some(at) => {
                let rest = &self.target[at + 3..];
                let slash = rest.iter().position(|&b| b == b'/').unwrap_or(rest.len());
                &rest[slash..]
            }
            None => &self.target[..],
        };
        let end = after_scheme
            .iter()
            .position(|&b| b == b'?')
            .unwrap_or(after_scheme.len());
        after_scheme[..end].to_vec()
    }
}

fn hostile_requests(origin: SocketAddr) -> Vec<Hostile> {
    let forged_ua = b"evil\" 999 0 \"-\" \"forged\\\" upstream=evil\tend".to_vec();
    let mut high_ua = b"agent/\x80\xff \xc3\xa9 \\x41".to_vec();
    high_ua.extend_from_slice(b" \"q\"");
    vec![
        // Absolute-form: a quote and a backslash in the path, a forged tail in the agent.
        Hostile {
            target: format!("http://{origin}/q\"x\\y%22z{{a}}|\"+200+0+\"-\"?k=%22v\\").into_bytes(),
            host: origin.to_string().into_bytes(),
            user_agent: Some(forged_ua),
            status: 200,
        },
        // Origin-form with UTF-8 in the path (httparse's path, not the plain scan) and bytes
        // that are no UTF-8 in the agent.
        Hostile {
            target: b"/caf\xc3\xa9/\"\"/%2522".to_vec(),
            host: origin.to_string().into_bytes(),
            user_agent: Some(high_ua),
            status: 200,
        },
        // A host no one can route to: refused, and logged with the host as sent.
        Hostile {
            target: b"/bad-host\"".to_vec(),
            host: b"h\"o\\st".to_vec(),
            user_agent: Some(b"\\\"".to_vec()),
            status: 400,
        },
        Hostile {
            target: b"/high-host".to_vec(),
            host: b"h\xc3\xa9\xff".to_vec(),
            user_agent: None,
            status: 400,
        },
    ]
}

/// Heads with bytes the codec refuses: in the target, what `http::Uri` does not take (`<`, a
/// `"` in the query); in a field value, DEL and NUL.
fn refused_heads(origin: SocketAddr) -> Vec<Vec<u8>> {
    let head = |target: &str, agent: &[u8]| {
        let mut head = format!("GET {target} HTTP/1.1\r\nHost: {origin}\r\nUser-Agent: ").into_bytes();
        head.extend_from_slice(agent);
        head.extend_from_slice(b"\r\n\r\n");
        head
    };
    vec![
        head("/a<b>", b"ua"),
        head("/q?k=\"v\"", b"ua"),
        head("/del", b"a\x7fb"),
        head("/nul", b"a\x00b"),
    ]
}

/// nginx's escaping undone: `\xHH` is byte HH; any other backslash, a quote or a byte outside
/// printable ASCII means the field was not escaped.
fn unescape(field: &str) -> Result<Vec<u8>, String> {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => {
                let hex = field
                    .get(i + 1..i + 4)
                    .and_then(|h| h.strip_prefix('x'))
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("a bare backslash at {i} in {field:?}"))?;
                out.push(hex);
                i += 4;
            }
            b @ 0x20..=0x7e if b != b'"' => {
                out.push(b);
                i += 1;
            }
            b => return Err(format!("unescaped byte {b:#04x} at {i} in {field:?}")),
        }
    }
    Ok(out)
}

/// The combined format as log shippers read it (Logstash's and GoAccess's patterns): a quoted
/// field is `"[^"]*"`. Run by python3's `re` on the file; prints one JSON array of the groups
/// per line, or null for a line the pattern does not match (or that is not ASCII).
const COMBINED: &str = r#"
import json, re, sys
combined = re.compile(r'^(\S+) (\S+) (\S+) \[([^\]]+)\] "([^"]*)" (\d{3}) (\d+|-) "([^"]*)" "([^"]*)"( upstream=\S+ endpoint=\S+ ttfb_ms=\S+ duration_ms=\S+ error=\S+ retries=\d+)$')
for raw in open(sys.argv[1], 'rb').read().split(b'\n')[:-1]:
    try:
        m = combined.match(raw.decode('ascii'))
    except UnicodeDecodeError:
        m = None
    print(json.dumps(m.groups() if m else None))
"#;

/// Each text line's combined-format groups, as python3 reads them; `None` without python3.
fn combined_groups(log: &Path) -> Option<Vec<Option<Vec<String>>>> {
    let Ok(out) = std::process::Command::new("python3")
        .arg("-c")
        .arg(COMBINED)
        .arg(log)
        .output()
    else {
        support::skip("`python3` is not on PATH");
        return None;
    };
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    Some(text.lines().map(|l| serde_json::from_str(l).unwrap()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_paths_hosts_and_agents_cannot_forge_an_access_log_line() {
    let origin = FakeUpstream::start().await;
    let dir = TempDir::new();
    let (text_log, json_log) = (dir.path.join("text.log"), dir.path.join("json.log"));
    let config = |format: &str, path: &Path| {
        format!(
            "access_log: {{ enabled: true, format: {format}, path: {} }}\n\
             upstreams:\n  - name: origin\n    url: http://{}\n",
            path.display(),
            origin.addr
        )
    };
    let text = Sidecar::start(&config("text", &text_log)).await;
    let json = Sidecar::start(&config("json", &json_log)).await;
    let requests = hostile_requests(origin.addr);
    for request in &requests {
        for sidecar in [&text, &json] {
            let resp = exchange(sidecar.addr, &request.head()).await;
            assert_eq!(
                resp.status,
                request.status,
                "{:?}: {}",
                request.path(),
                resp.text()
            );
        }
    }
    // What the codec refuses is answered 400 and logged as a refused head (`- -`).
    for head in refused_heads(origin.addr) {
        for sidecar in [&text, &json] {
            let resp = exchange(sidecar.addr, &head).await;
            assert_eq!(
                resp.status,
                400,
                "{:?}: {}",
                String::from_utf8_lossy(&head),
                resp.text()
            );
        }
    }
    // The sidecar still serves.
    let mut after = RawClient::connect(text.addr).await;
    assert_eq!(
        after.get(&format!("http://{}/after", origin.addr)).await.status,
        200
    );
    drop(after);
    let refused = refused_heads(origin.addr).len();
    let n = requests.len() + refused + 1;
    let (text_lines, json_lines) = (wait_lines(&text_log, n).await, wait_lines(&json_log, n - 1).await);
    assert_eq!(text_lines.len(), n, "one text line per request");
    assert_eq!(json_lines.len(), n - 1, "one JSON line per request");

    let Some(groups) = combined_groups(&text_log) else {
        return;
    };
    assert_eq!(groups.len(), text_lines.len(), "python3 read every line");
    let mut seen = Vec::new();
    for (line, groups) in text_lines.iter().zip(&groups) {
        let shown = String::from_utf8_lossy(line);
        let groups = groups
            .as_ref()
            .unwrap_or_else(|| panic!("not one ASCII combined-format line: {shown}"));
        let (request, status, agent) = (&groups[4], &groups[5], &groups[8]);
        let request = unescape(request).unwrap_or_else(|e| panic!("{e}: {shown}"));
        let agent = unescape(agent).unwrap_or_else(|e| panic!("{e}: {shown}"));
        seen.push((request, status.clone(), agent));
    }
    for request in &requests {
        let mut line = b"GET ".to_vec();
        line.extend_from_slice(&request.path());
        line.extend_from_slice(b" HTTP/1.1");
        let agent = request.user_agent.clone().unwrap_or_else(|| b"-".to_vec());
        let want = (line, request.status.to_string(), agent);
        assert!(
            seen.contains(&want),
            "no text line reads back as {:?} {} {:?}; read: {:?}",
            String::from_utf8_lossy(&want.0),
            want.1,
            String::from_utf8_lossy(&want.2),
            seen.iter()
                .map(|(r, s, a)| format!(
                    "{} {s} {}",
                    String::from_utf8_lossy(r),
                    String::from_utf8_lossy(a)
                ))
                .collect::<Vec<_>>()
        );
    }
    let refused_line = (b"- - HTTP/1.1".to_vec(), "400".to_owned(), b"-".to_vec());
    let refused_lines = seen.iter().filter(|s| **s == refused_line).count();
    assert_eq!(refused_lines, refused, "a line per refused head: {seen:?}");

    let objects: Vec<Value> = json_lines
        .iter()
        .map(|l| serde_json::from_slice(l).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(l))))
        .collect();
    for request in &requests {
        let path = String::from_utf8(request.path()).unwrap();
        let found = objects.iter().find(|v| v["path"] == path.as_str());
        let found = found.unwrap_or_else(|| panic!("no JSON line with path {path:?}: {objects:?}"));
        assert_eq!(found["status"], request.status, "{found}");
        if let Ok(host) = std::str::from_utf8(&request.host) {
            assert_eq!(found["authority"], host, "{found}");
        }
    }
    let refused_objects = objects
        .iter()
        .filter(|v| v["method"] == "-" && v["status"] == 400);
    assert_eq!(refused_objects.count(), refused, "{objects:?}");
}

// === 2. credentials in no output ===

/// Distinct strings, each a credential of one kind: found anywhere, it leaked.
const USER: &str = "u5er-in-url-7d1";
const PASSWORD: &str = "pa55-in-url-9c4";
const PROXY_SECRET: &str = "cHJveHktc2VjcmV0LTJiOA==";
const HEADER_SECRET: &str = "hdr-s3cret-5e0";

/// Everything a run of the sidecar put out, by where it went.
struct Outputs(Vec<(String, String)>);

impl Outputs {
    fn add(&mut self, what: impl Into<String>, text: impl Into<String>) {
        self.0.push((what.into(), text.into()));
    }

    fn assert_no_secret(&self) {
        let mut leaks = Vec::new();
        for (what, text) in &self.0 {
            for secret in [USER, PASSWORD, PROXY_SECRET, HEADER_SECRET] {
                if let Some(at) = text.find(secret) {
                    let from = text[..at].char_indices().rev().nth(120).map_or(0, |(i, _)| i);
                    let end = (at + secret.len() + 40).min(text.len());
                    let end = (end..=text.len())
                        .find(|&i| text.is_char_boundary(i))
                        .unwrap_or(text.len());
                    leaks.push(format!("{secret} in {what}: ...{}...", &text[from..end]));
                }
            }
        }
        assert!(leaks.is_empty(), "credentials leaked:\n{}", leaks.join("\n"));
    }
}

/// Sends every way a credential can come (each asserted answered as it should be), and
/// returns what the sidecar put out: responses as they arrive, then its access log, stderr,
/// `/metrics` and `/debug/*`.
async fn credentials_through(format: &str) -> Outputs {
    let origin = FakeUpstream::start().await;
    let dir = TempDir::new();
    let log = dir.path.join("access.log");
    let sidecar = ChildSidecar::spawn_with_env(
        &format!(
            "access_log: {{ enabled: true, format: {format}, path: {} }}\n\
             upstreams:\n  - name: origin\n    url: http://{}\n    \
             request_headers: {{ set: {{ X-Api-Key: \"{HEADER_SECRET}\" }} }}\n",
            log.display(),
            origin.addr
        ),
        &[("EGRESS_LOG", "debug")],
    )
    .await;
    let (up, userinfo) = (origin.addr, format!("{USER}:{PASSWORD}@"));
    let mut out = Outputs(Vec::new());
    let mut answered = |what: &str, resp: &support::RawResponse, status: u16| {
        assert_eq!(resp.status, status, "{what}: {}", resp.text());
        out.add(
            format!("the response to {what}"),
            format!("{:?}\n{}", resp.headers, resp.text()),
        );
    };
    // Forward mode: userinfo in an absolute-form target, in Host, in a CONNECT target.
    let head = format!("GET http://{userinfo}{up}/forward HTTP/1.1\r\nHost: {up}\r\n\r\n");
    answered(
        "absolute-form",
        &exchange(sidecar.addr, head.as_bytes()).await,
        400,
    );
    let head = format!("GET /host HTTP/1.1\r\nHost: {userinfo}{up}\r\n\r\n");
    answered("Host", &exchange(sidecar.addr, head.as_bytes()).await, 400);
    let head = format!("CONNECT {userinfo}{up} HTTP/1.1\r\nHost: {up}\r\n\r\n");
    answered(
        "a CONNECT target",
        &exchange(sidecar.addr, head.as_bytes()).await,
        400,
    );
    // Heads refused on their targets' shape: one `http::Uri` does not take (the codec's
    // error), a CONNECT target without a port.
    let head = format!("GET http://{userinfo}{up}/a<b> HTTP/1.1\r\nHost: {up}\r\n\r\n");
    answered(
        "an invalid absolute-form target",
        &exchange(sidecar.addr, head.as_bytes()).await,
        400,
    );
    let head = format!("CONNECT {userinfo}{} HTTP/1.1\r\nHost: {up}\r\n\r\n", up.ip());
    answered(
        "a CONNECT target without a port",
        &exchange(sidecar.addr, head.as_bytes()).await,
        400,
    );
    // Proxy-Authorization on a request that goes through, and the injected header.
    let head = format!(
        "GET http://{up}/proxy-auth HTTP/1.1\r\nHost: {up}\r\nProxy-Authorization: Basic {PROXY_SECRET}\r\n\r\n"
    );
    answered(
        "Proxy-Authorization",
        &exchange(sidecar.addr, head.as_bytes()).await,
        200,
    );
    // Inside a CONNECT served as plain HTTP (the origin's port is not in connect_ports).
    let mut tunnel = RawClient::connect(sidecar.addr).await;
    let established = tunnel
        .open_tunnel(&up.to_string(), "", b"")
        .await
        .expect("an answer");
    assert_eq!(established.status, 200, "{}", established.text());
    let head = format!(
        "GET http://{userinfo}{up}/in-tunnel HTTP/1.1\r\nHost: {up}\r\nProxy-Authorization: Basic {PROXY_SECRET}\r\n\r\n"
    );
    tunnel.send_raw(head.as_bytes()).await;
    let resp = tunnel
        .read_response(false)
        .await
        .expect("an answer inside the tunnel");
    answered("absolute-form inside a tunnel", &resp, 400);
    drop(tunnel);
    // h2c with prior knowledge, userinfo in :authority.
    let (status, body) = support::h2c_get(sidecar.addr, &format!("http://{userinfo}{up}/h2c")).await;
    assert_eq!(status, 400, "h2c: {body}");
    out.add("the h2c response", body);

    let seen = origin.seen();
    let reached = seen
        .iter()
        .find(|s| s.uri.ends_with("/proxy-auth"))
        .expect("the request went up");
    assert_eq!(
        reached.headers["x-api-key"], HEADER_SECRET,
        "the injected header is set"
    );
    assert!(!reached.headers.contains_key("proxy-authorization"));
    for s in &seen {
        out.add(format!("what the origin saw of {}", s.uri), s.uri.clone());
    }
    // Every exchange gets a line: seven requests, the tunnel's CONNECT and the one inside it.
    let lines = wait_lines(&log, 9).await;
    assert_eq!(lines.len(), 9, "access-log lines");
    for line in lines {
        out.add(format!("the {format} access log"), String::from_utf8_lossy(&line));
    }
    for path in ["/metrics", "/debug/pools", "/debug/clients"] {
        out.add(path, support::admin_get(sidecar.admin, path).await.text());
    }
    // What it logged at debug, including what came after the last request.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stderr = sidecar.logs.lock().unwrap().join("\n");
    assert!(stderr.contains("\"DEBUG\""), "logging at debug");
    out.add("stderr at debug", stderr);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_output_carries_a_credential_with_a_json_access_log() {
    credentials_through("json").await.assert_no_secret();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_output_carries_a_credential_with_a_text_access_log() {
    credentials_through("text").await.assert_no_secret();
}

// === 3. exposure ===

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
