//! The status page (`GET /` on the admin listener) in a real browser: headless Chromium loads it
//! from a sidecar that served the seeds' leaky Go client and holds a capped pool under load
//! (`max_connections: 2`, five requests an upstream does not answer until the test lets it: two
//! on connections, three waiting). After the page's script has refreshed it from the JSON
//! endpoints, the DOM flags the leaking source and shows each pool's open, idle, waiting and
//! reused as `/debug/pools` gives them right after; the same numbers are in the page's bytes as
//! served (no JavaScript), and the script's render equals the server's, element for element. An
//! app name made of markup stays text. A screenshot is kept under the target dir.
//!
//! A second test feeds the script reports with something in every branch of the two renders
//! (ejected endpoints, pace keys, a retired pool, a budget, more rows than are shown, names made
//! of markup) and checks, in Chromium, that its render is the server's.
//!
//! The load is held still while the page is read (the held requests cannot finish, the leaky
//! client has exited and its connections are closed, nothing else runs), so "equal" is exact.

mod support;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use egress_sidecar::admin::status::{self, SidecarReport, View, OTHER_SOURCES_SHOWN, TOKEN_ROWS_SHOWN};
use egress_sidecar::budget::BudgetReport;
use egress_sidecar::clients::{ClientReport, Clients, Process, Source};
use egress_sidecar::endpoint::{DnsReport, EndpointReport};
use egress_sidecar::llm::ledger::{self, Counts, Row};
use egress_sidecar::pace::{KeyReport, PaceReport};
use egress_sidecar::pool::{ConnectionReport, PoolReport};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use support::{admin_get, FakeUpstream, RawClient, Sidecar, TempDir};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;

/// Requests held at the capped pool: `MAX_CONNECTIONS` on connections, the rest waiting.
const HELD: usize = 5;
const MAX_CONNECTIONS: usize = 2;
/// Quick requests on the capped pool before the held ones, on one connection (then the LLM
/// call on it, then the first held request).
const QUICK: usize = 4;
/// The leaky client's requests: one connection each, over one pooled upstream connection.
const LEAKY_REQUESTS: usize = 300;
/// An app name that is markup: the page must show it as text.
const HOSTILE_APP: &str = "<img src=x onerror=alert(1)>";

// === the upstream that holds requests ===

/// An HTTP/1.1 upstream: `/hold` answers once released, `/v1/chat/completions` answers an
/// OpenAI-shaped JSON with usage, anything else "ok" at once.
struct HoldingUpstream {
    addr: SocketAddr,
    held: Arc<AtomicUsize>,
    release: watch::Sender<bool>,
}

impl HoldingUpstream {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let held = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let counter = held.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (held, released) = (counter.clone(), released.clone());
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (held, mut released) = (held.clone(), released.clone());
                    async move {
                        let mut resp = http::Response::new(Full::new(Bytes::from_static(b"ok")));
                        match req.uri().path() {
                            "/hold" => {
                                held.fetch_add(1, Ordering::SeqCst);
                                let _ = released.wait_for(|r| *r).await;
                            }
                            "/v1/chat/completions" => {
                                *resp.body_mut() = Full::new(Bytes::from_static(
                                    br#"{"id":"c1","object":"chat.completion","model":"gpt-status-1","usage":{"prompt_tokens":30,"completion_tokens":12,"total_tokens":42}}"#,
                                ));
                                resp.headers_mut()
                                    .insert("content-type", "application/json".parse().unwrap());
                            }
                            _ => {}
                        }
                        Ok::<_, Infallible>(resp)
                    }
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service),
                );
            }
        });
        HoldingUpstream { addr, held, release }
    }
}

/// A raw client connected to `to` from the loopback address `from`: a source of its own.
async fn client_from(from: &str, to: SocketAddr) -> RawClient {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    RawClient::from_stream(socket.connect(to).await.unwrap())
}

// === headless Chromium ===

/// Chromium's binary, or the test is skipped (a failure under CI=true).
fn chromium_or_skip() -> Option<PathBuf> {
    let path = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())?;
    let runs = std::process::Command::new(&path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    runs.then_some(path)
}

/// One headless Chromium run on `url` with `args`: its stdout. Chromium's profile, and what it
/// writes under $HOME, go to a directory removed afterwards; the run is killed, with its
/// helper processes, if it takes over 60 s.
async fn chromium(binary: &Path, args: &[&str], url: &str) -> String {
    let home = TempDir::new();
    let mut cmd = tokio::process::Command::new(binary);
    cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        .args([
            "--no-proxy-server",
            "--disable-extensions",
            "--disable-background-networking",
        ])
        .arg(format!("--user-data-dir={}", home.path.join("profile").display()))
        .args(args)
        .arg(url)
        .env("HOME", &home.path)
        .env("XDG_CONFIG_HOME", home.path.join("config"))
        .env("XDG_CACHE_HOME", home.path.join("cache"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let child = cmd.spawn().expect("chromium starts");
    let group = child.id().expect("a pid");
    let out = match tokio::time::timeout(Duration::from_secs(60), child.wait_with_output()).await {
        Ok(out) => out.expect("chromium runs"),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{group}")])
                .status();
            panic!("chromium {args:?} took over 60 s");
        }
    };
    assert!(
        out.status.success(),
        "chromium {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("UTF-8 DOM");
    let screenshot = args.iter().any(|a| a.starts_with("--screenshot"));
    assert!(
        screenshot || !stdout.is_empty(),
        "chromium {args:?} printed no DOM:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

// === reading the page ===

/// What the page rendered: `<main>`'s content (the script, which names the same elements in its
/// templates, is outside it).
fn rendered(html: &str) -> &str {
    let from = html.find("<main id=\"status\">").expect("a <main id=status>");
    &html[from..from + html[from..].find("</main>").expect("the end of main")]
}

/// The attributes of every `<name ...>` start tag in what the page rendered, in order.
fn tags(html: &str, name: &str) -> Vec<HashMap<String, String>> {
    let open = format!("<{name} ");
    let main = rendered(html);
    main.match_indices(&open)
        .map(|(at, _)| {
            let tag = &main[at + open.len()..];
            attributes(&tag[..tag.find('>').expect("a closed start tag")])
        })
        .collect()
}

/// `a="1" b="two"` as a map (values as serialised: entities left as they are).
fn attributes(mut text: &str) -> HashMap<String, String> {
    let mut map = HashMap::new();
    while let Some(eq) = text.find("=\"") {
        let name = text[..eq].trim().to_owned();
        let rest = &text[eq + 2..];
        let end = rest.find('"').expect("a closed attribute");
        map.insert(name, rest[..end].to_owned());
        text = &rest[end + 1..];
    }
    map
}

/// The open, idle, waiting and reused counts the page shows for each pool, by upstream.
fn page_pools(html: &str) -> HashMap<String, [u64; 4]> {
    tags(html, "article")
        .into_iter()
        .map(|a| {
            let n = |k: &str| {
                a.get(k)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or_else(|| panic!("{k} in {a:?}"))
            };
            let counts = [
                n("data-open"),
                n("data-idle"),
                n("data-waiting"),
                n("data-reused"),
            ];
            (a["data-upstream"].clone(), counts)
        })
        .collect()
}

/// The same four counts from `/debug/pools` (idle: connections in state `idle`).
async fn debug_pools(admin: SocketAddr) -> HashMap<String, [u64; 4]> {
    let all: Value = serde_json::from_slice(&admin_get(admin, "/debug/pools").await.body).unwrap();
    all["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let idle = p["connections"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|c| c["state"] == "idle")
                .count() as u64;
            let n = |k: &str| p[k].as_u64().unwrap();
            (
                p["upstream"].as_str().unwrap().to_owned(),
                [n("open"), idle, n("pending"), n("reused_total")],
            )
        })
        .collect()
}

/// The `<tr>` attributes of `source` in the page's table of application sources.
fn source_row(html: &str, source: &str) -> HashMap<String, String> {
    tags(html, "tr")
        .into_iter()
        .find(|a| a.get("data-source").is_some_and(|s| s == source))
        .unwrap_or_else(|| panic!("no row for {source}"))
}

/// The rendered sections from the pools on: what does not change while the load is held (the
/// sidecar section has the uptime and the memory of the moment).
fn held_still(html: &str) -> &str {
    let main = rendered(html);
    &main[main.find("<section id=\"pools\">").expect("a pools section")..]
}

/// The `<body>` start tag's attributes.
fn body_tag(html: &str) -> HashMap<String, String> {
    let from = html
        .find("<body ")
        .unwrap_or_else(|| panic!("no <body> in {html:?}"))
        + "<body ".len();
    attributes(&html[from..from + html[from..].find('>').unwrap()])
}

/// `page` with its script cut out: what the server rendered, and nothing to change it.
fn without_script(page: &str) -> String {
    let script = page.find("<script>").expect("a script");
    let end = page.find("</script>").expect("the script's end") + "</script>".len();
    format!("{}{}", &page[..script], &page[end..])
}

/// Writes `html` as `name` in `dir`: its file:// URL.
fn file_url(dir: &TempDir, name: &str, html: &str) -> String {
    let file = dir.path.join(name);
    std::fs::write(&file, html).unwrap();
    format!("file://{}", file.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_the_leak_and_the_pools_in_chromium() {
    let Some(browser) = chromium_or_skip() else {
        support::skip("chromium is not installed (Debian: apt-get install chromium)");
        return;
    };
    let Some(leaky) = support::build_go("tests/leaky/main.go", "leaky").await else {
        support::skip("`go` is not on PATH");
        return;
    };
    let origin = FakeUpstream::start().await;
    let holding = HoldingUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "budget: {{ memory_bytes: 4GiB }}\nupstreams:\n  - name: held\n    url: http://{}\n    \
         pool: {{ max_connections: {MAX_CONNECTIONS}, pending_timeout: 120s }}\n",
        holding.addr
    ))
    .await;
    let at = Addrs {
        proxy: sidecar.addr,
        admin: sidecar.admin,
        origin: origin.addr,
        holding: holding.addr,
    };
    // In a task of its own, so that a failed check still ends in a clean stop (the held
    // requests let go, the sidecar drained) before its panic is raised here.
    let checked = tokio::spawn(page_checks(at, holding.held.clone(), leaky, browser)).await;
    let _ = holding.release.send(true);
    match checked {
        Ok(held) => {
            for request in held {
                assert_eq!(request.await.unwrap().status, 200);
            }
            sidecar.stop().await;
        }
        Err(failed) => {
            sidecar.stop().await;
            std::panic::resume_unwind(failed.into_panic());
        }
    }
}

/// Where the test's parts listen.
#[derive(Debug, Clone, Copy)]
struct Addrs {
    proxy: SocketAddr,
    admin: SocketAddr,
    origin: SocketAddr,
    holding: SocketAddr,
}

/// The load, then the page read three ways; returns the held requests, still held.
async fn page_checks(
    at: Addrs,
    holding_held: Arc<AtomicUsize>,
    leaky: PathBuf,
    browser: PathBuf,
) -> Vec<tokio::task::JoinHandle<support::RawResponse>> {
    // The leak, from 127.0.0.1: a new connection per request, through a pool made on the fly.
    let out = tokio::process::Command::new(&leaky)
        .args(["-n", &LEAKY_REQUESTS.to_string(), "-wait", "0s"])
        .args(["-url", &format!("http://{}/", at.origin)])
        .args(["-proxy", &format!("http://{}", at.proxy)])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // From 127.0.0.2, one connection: quick requests, and an LLM answer whose app is markup.
    let held_url = format!("http://{}", at.holding);
    let mut quick = client_from("127.0.0.2", at.proxy).await;
    for _ in 0..QUICK {
        assert_eq!(quick.get(&format!("{held_url}/")).await.status, 200);
    }
    let body = r#"{"model":"gpt-status","messages":[]}"#;
    quick
        .send_raw(
            format!(
                "POST {held_url}/v1/chat/completions HTTP/1.1\r\nHost: {}\r\n\
                 content-type: application/json\r\nx-egress-app: {HOSTILE_APP}\r\n\
                 content-length: {}\r\n\r\n{body}",
                at.holding,
                body.len()
            )
            .as_bytes(),
        )
        .await;
    assert_eq!(quick.read_response(false).await.unwrap().status, 200);
    // The upstream connection those requests used is idle in the pool, for the first held
    // request to reuse. (This failed 4 runs in 30 while the POST's body went up after its
    // head: the upstream, which ignores the body, then closed the connection. See
    // `tests/pool.rs`, which also checks that a client leaving at once keeps it pooled.)
    let back = support::fetch_until(
        Duration::from_secs(5),
        || debug_pools(at.admin),
        |p| p.get("held").is_some_and(|held| held[1] == 1),
    )
    .await;
    assert_eq!(
        back["held"][1], 1,
        "the quick requests' connection idle: {back:?}"
    );
    drop(quick);

    // From 127.0.0.3, the held requests: two on connections, three waiting for one.
    let held: Vec<_> = (0..HELD)
        .map(|_| {
            let (to, url) = (at.proxy, format!("{held_url}/hold"));
            tokio::spawn(async move { client_from("127.0.0.3", to).await.get(&url).await })
        })
        .collect();
    let load = support::fetch_until(
        Duration::from_secs(10),
        || support::debug_pool(at.admin, "held"),
        |p| {
            p["pending"] == (HELD - MAX_CONNECTIONS) && holding_held.load(Ordering::SeqCst) == MAX_CONNECTIONS
        },
    )
    .await;
    assert_eq!(load["pending"], HELD - MAX_CONNECTIONS, "{load:#}");
    assert_eq!(holding_held.load(Ordering::SeqCst), MAX_CONNECTIONS);

    // Every leaky connection closed and counted: the source is flagged.
    let clients = support::fetch_until(
        Duration::from_secs(10),
        || async {
            let resp = admin_get(at.admin, "/debug/clients").await;
            serde_json::from_slice::<Value>(&resp.body).unwrap()
        },
        |c: &Value| {
            c.as_array().unwrap().iter().any(|s| {
                s["source"] == "127.0.0.1" && s["leaking"] == true && s["requests"] == LEAKY_REQUESTS
            })
        },
    )
    .await;
    let leaking: Vec<_> = clients
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["leaking"] == true)
        .collect();
    assert_eq!(leaking.len(), 1, "{clients:#}");
    assert_eq!(leaking[0]["source"], "127.0.0.1");

    // What the load is, and that it holds still.
    let pools = debug_pools(at.admin).await;
    assert_eq!(
        pools.len(),
        2,
        "the capped pool and the leaky client's: {pools:?}"
    );
    // All but the first quick request, the LLM call, and the first held request.
    let reused = QUICK as u64 + 1;
    assert_eq!(
        pools["held"],
        [MAX_CONNECTIONS as u64, 0, (HELD - MAX_CONNECTIONS) as u64, reused]
    );
    let leaky_pool = pools.keys().find(|k| *k != "held").unwrap().clone();
    assert_eq!(
        pools[&leaky_pool],
        [1, 1, 0, LEAKY_REQUESTS as u64 - 1],
        "{leaky_pool}"
    );

    // Without JavaScript: the bytes as served carry the same numbers.
    let url = format!("http://{}/", at.admin);
    let served = admin_get(at.admin, "/").await;
    assert_eq!(served.status, 200);
    assert_eq!(served.header("content-type"), Some("text/html; charset=utf-8"));
    assert!(served
        .header("content-security-policy")
        .unwrap()
        .starts_with("default-src 'none'"));
    let served = served.text();
    assert!(served.len() < 64 * 1024, "{} bytes", served.len());
    assert!(served.contains("<body data-rendered-by=\"server\""));
    assert_eq!(page_pools(&served), debug_pools(at.admin).await, "served page");
    assert_eq!(source_row(&served, "127.0.0.1")["data-leaking"], "true");

    // In Chromium, after the script has refreshed the page twice (2 s apart, in virtual time).
    let dom = chromium(&browser, &["--virtual-time-budget=5000", "--dump-dom"], &url).await;
    let after = debug_pools(at.admin).await;
    let body = body_tag(&dom);
    assert_eq!(body["data-rendered-by"], "script", "the script ran: {dom}");
    assert!(body["data-refreshes"].parse::<u32>().unwrap() >= 1, "{body:?}");
    assert!(!body.contains_key("data-stale"), "a refresh failed: {dom}");
    assert_eq!(
        page_pools(&dom),
        after,
        "the page's pools against /debug/pools read after it"
    );
    let row = source_row(&dom, "127.0.0.1");
    assert_eq!(row["data-leaking"], "true");
    assert_eq!(row["class"], "leaking");
    for other in ["127.0.0.2", "127.0.0.3"] {
        assert_eq!(source_row(&dom, other)["data-leaking"], "false", "{other}");
    }
    assert_eq!(
        tags(&dom, "p")
            .iter()
            .filter(|p| p.get("data-count").is_some_and(|c| c == "1"))
            .count(),
        1
    );
    assert!(dom.contains("<span class=\"tag bad\">leaking</span>"));
    // The app made of markup is text in the DOM: no element of its making.
    assert!(dom.contains("&lt;img src=x onerror=alert(1)&gt;"), "{dom}");
    assert!(tags(&dom, "img").is_empty(), "an <img> from the app's name");
    let tokens = tags(&dom, "tr")
        .into_iter()
        .find(|t| t.get("data-model").is_some_and(|m| m == "gpt-status-1"))
        .expect("a token row");
    assert_eq!(
        (tokens["data-input"].as_str(), tokens["data-output"].as_str()),
        ("30", "12")
    );

    // The page as served, its script cut out, parsed by Chromium: the server's render, element
    // for element the same as the script's. (Headless Chromium's --dump-dom needs scripting, so
    // it is the script that goes, not scripting.)
    let dir = TempDir::new();
    let plain = chromium(
        &browser,
        &["--dump-dom"],
        &file_url(&dir, "served.html", &without_script(&served)),
    )
    .await;
    assert_eq!(body_tag(&plain)["data-rendered-by"], "server");
    assert_eq!(
        held_still(&plain),
        held_still(&dom),
        "the server's render against the script's"
    );

    // The screenshot, kept under the target dir (CARGO_TARGET_TMPDIR is its `tmp`).
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target dir");
    let dir = target.join("test-artifacts");
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("status-page.png");
    let _ = std::fs::remove_file(&png);
    let shot = format!("--screenshot={}", png.display());
    chromium(
        &browser,
        &["--virtual-time-budget=3000", "--window-size=1280,1600", &shot],
        &url,
    )
    .await;
    let bytes = std::fs::read(&png).expect("a screenshot");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    println!(
        "status page screenshot: {} ({} bytes)",
        png.display(),
        bytes.len()
    );
    assert_eq!(
        debug_pools(at.admin).await,
        after,
        "the load held still throughout"
    );

    held
}

// === the two renders, every branch ===

/// A view with something in every branch the two renders have: a name made of markup
/// everywhere a name goes, an ejected and a draining endpoint, DNS and a parent proxy, a
/// retired pool with no protocol yet, open and closed pace keys with and without their
/// figures, a budget that paused accepting, a leaking process and more quiet sources than are
/// shown, more token rows than are shown, and one with nothing in the last minute.
fn every_branch() -> (
    SidecarReport,
    Vec<PoolReport>,
    Vec<PaceReport>,
    BudgetReport,
    Vec<ClientReport>,
    ledger::Report,
) {
    let hostile = "<script>alert(1)</script>\"'&";
    let connection = |id, state| ConnectionReport {
        id,
        protocol: Some("http1"),
        state,
        age_seconds: 2.5,
        idle_seconds: None,
        requests: 3,
        streams_in_use: None,
        stream_limit: None,
        closing_reason: None,
        endpoint: None,
    };
    let endpoint = |state, ejected_for_ms| EndpointReport {
        address: format!("10.0.0.1:443 {hostile}"),
        state,
        open: 2,
        idle: 1,
        consecutive_failures: 4,
        ejections: 1,
        ejected_until: None,
        ejected_for_ms,
    };
    let busy = PoolReport {
        upstream: hostile.into(),
        protocol: Some("http2"),
        retired: None,
        max_connections: 8,
        max_idle: 8,
        max_streams_per_connection: 100,
        open: 3,
        pending: 7,
        opened_total: 11,
        reused_total: 1234,
        learned_idle_timeout_ms: Some(4_999),
        learned_retire_after_ms: Some(999),
        idle_close_observations: 6,
        connections: vec![
            connection(1, "idle"),
            connection(2, "active"),
            connection(3, "idle"),
        ],
        endpoints: vec![
            endpoint("active", None),
            endpoint("ejected", Some(12_345)),
            endpoint("draining", None),
        ],
        dns: Some(DnsReport {
            host: hostile.into(),
            refreshes: 5,
            failures: 1,
            expires_in_ms: Some(100),
            last_error: None,
        }),
        via: Some(format!("http://{hostile}:3128")),
    };
    let retired = PoolReport {
        upstream: "old".into(),
        protocol: None,
        retired: Some("reload"),
        pending: 0,
        learned_idle_timeout_ms: None,
        learned_retire_after_ms: None,
        connections: vec![],
        endpoints: vec![],
        dns: None,
        via: None,
        ..busy
    };
    let pace = vec![PaceReport {
        upstream: hostile.into(),
        keys: vec![
            KeyReport {
                key: "0badc0de".into(),
                remaining_requests: Some(-1),
                remaining_tokens: Some(20_000),
                reset_ms: Some(1_500),
                closed: true,
                waiters: 3,
            },
            KeyReport {
                key: "feedface".into(),
                remaining_requests: None,
                remaining_tokens: None,
                reset_ms: None,
                closed: false,
                waiters: 0,
            },
        ],
    }];
    let budget = BudgetReport {
        budget_bytes: 123_456_789,
        source: "memory_bytes".into(),
        usage_bytes: 98_765_432,
        usage_measure: "cgroup_working_set",
        accept_paused: true,
        shed_downstream_idle: 1,
        shed_upstream_idle: 2,
        shed_accept_paused: 3,
    };
    let clients = Clients::new();
    let process = Source::Unix(Arc::new(Process {
        pid: Some(42),
        uid: 1000,
        start_time: Some(7),
        exe: Some(format!("/opt/{hostile}").into()),
    }));
    for _ in 0..120 {
        clients.opened(&process);
        clients.closed(&process, 1, true);
    }
    for i in 0..(OTHER_SOURCES_SHOWN as u8 + 3) {
        let quiet = Source::from(std::net::IpAddr::from([10, 1, 0, i]));
        clients.opened(&quiet);
        clients.closed(&quiet, 3 + u64::from(i), false);
        clients.opened(&quiet);
        clients.closed(&quiet, 8, false);
    }
    let row = |model: String, input| Row {
        upstream: "openai".into(),
        app: hostile.into(),
        model: model.into(),
        counts: Counts {
            requests: 2,
            input_tokens: input,
            output_tokens: 17,
            cache_read_tokens: 5,
            cache_write_tokens: 0,
            reasoning_tokens: 9,
        },
    };
    let since_start = (0..TOKEN_ROWS_SHOWN as u64 + 2)
        .map(|i| row(format!("model-{i:03} {hostile}"), 100 + i))
        .collect::<Vec<_>>();
    let last_60s = vec![row(format!("model-001 {hostile}"), 7)];
    let sidecar = SidecarReport {
        version: "9.9.9",
        uptime_seconds: 90_061,
        resident_bytes: Some(1 << 30),
    };
    let usage = ledger::Report {
        since_start,
        last_60s,
    };
    (
        sidecar,
        vec![busy, retired],
        pace,
        budget,
        clients.report(),
        usage,
    )
}

/// JSON as a script literal: `<` escaped, so no string in it can close the script element.
fn script_literal(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).unwrap().replace('<', "\\u003c")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_renders_every_branch_as_the_server_does() {
    let Some(browser) = chromium_or_skip() else {
        support::skip("chromium is not installed (Debian: apt-get install chromium)");
        return;
    };
    let (sidecar, pools, pace, budget, clients, usage) = every_branch();
    let view = View {
        sidecar: &sidecar,
        pools: &pools,
        pace: &pace,
        budget: Some(&budget),
        clients: &clients,
        usage: &usage,
    };
    let empty = ledger::Report {
        since_start: vec![],
        last_60s: vec![],
    };
    // The script's render of the same reports as the endpoints serve them, over a page whose
    // server render was of nothing.
    let nothing = status::page(&View {
        sidecar: &sidecar,
        pools: &[],
        pace: &[],
        budget: None,
        clients: &[],
        usage: &empty,
    });
    let pools_json = serde_json::json!({
        "sidecar": &sidecar, "pools": &pools, "pace": &pace, "budget": &budget,
    });
    let fixture = format!(
        "<script>document.getElementById(\"status\").innerHTML = render({}, {}, {}); \
         document.body.dataset.renderedBy = \"fixture\";</script></body>",
        script_literal(&pools_json),
        script_literal(&clients),
        script_literal(&usage)
    );
    let by_script = nothing.replacen("</body>", &fixture, 1);

    let dir = TempDir::new();
    let server = chromium(
        &browser,
        &["--dump-dom"],
        &file_url(&dir, "server.html", &without_script(&status::page(&view))),
    )
    .await;
    let script = chromium(
        &browser,
        &["--dump-dom"],
        &file_url(&dir, "script.html", &by_script),
    )
    .await;
    assert_eq!(
        body_tag(&script)["data-rendered-by"],
        "fixture",
        "the fixture's script ran"
    );
    assert_eq!(
        rendered(&script),
        rendered(&server),
        "the script's render against the server's"
    );
    // What the branches are there for.
    let main = rendered(&server);
    assert!(tags(&server, "script").is_empty() && tags(&server, "img").is_empty());
    assert!(
        main.contains("&lt;script&gt;alert(1)&lt;/script&gt;\"'&amp;"),
        "{main}"
    );
    assert_eq!(
        tags(&server, "tr")
            .iter()
            .filter(|t| t.contains_key("data-source"))
            .count(),
        1 + OTHER_SOURCES_SHOWN
    );
    assert!(main.contains(">3 more sources in /debug/clients<"), "{main}");
    assert!(main.contains(">2 more rows in /debug/usage<"), "{main}");
    assert!(main.contains("retired: reload"));
    assert!(main.contains("ejected</span> for 12.3 s"), "{main}");
    assert_eq!(page_pools(&server)["old"], [3, 0, 0, 1234]);
}
