//! Upstreams reached through a corporate parent proxy (`via`), against a real Squid with basic
//! auth: pooled absolute-form requests and one CONNECT per pooled TLS connection, refusals
//! (502 parent_refused, never retried), `no_via` and `direct`, credentials re-read from their
//! file, the app's own Proxy-Authorization kept from the parent, and `url: env`.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use support::{
    distinct_client_ports, eventually, fetch_until, ChildSidecar, FakeUpstream, RawClient, RawResponse,
    RefusingPort, Sidecar, Squid, SquidEntry, TempDir, TestCa,
};

// === helpers ===

/// A started Squid and a credentials file, in a directory of its own, holding Squid's user and
/// `password` (None: the right one).
async fn squid_with_credentials(password: Option<&str>) -> Option<(Squid, TempDir, PathBuf)> {
    let squid = Squid::start().await?;
    let dir = TempDir::new();
    let creds = dir.path.join("parent-credentials");
    let line = match password {
        Some(password) => format!("{}:{password}", squid.user),
        None => squid.credentials(),
    };
    std::fs::write(&creds, format!("{line}\n")).unwrap();
    Some((squid, dir, creds))
}

/// `via: { url: <squid>, credentials_file: <creds> }` plus `extra` keys, flow style.
fn via(squid: &Squid, creds: &Path, extra: &str) -> String {
    format!(
        "{{ url: {url}, credentials_file: {creds}{extra} }}",
        url = squid.url(),
        creds = creds.display()
    )
}

/// A TLS origin (HTTP/1.1) with a certificate for 127.0.0.1, and the CA file an upstream's
/// `tls: { ca_file }` names.
async fn tls_origin(ca: &TestCa, dir: &TempDir) -> (FakeUpstream, PathBuf) {
    let origin = FakeUpstream::start_tls(ca.server(&["127.0.0.1"], false, &[])).await;
    (origin, ca.write_pem(dir))
}

/// One GET of `url` on a new connection to `sidecar`.
async fn get_once(sidecar: SocketAddr, url: &str) -> RawResponse {
    RawClient::connect(sidecar).await.get_with(url, "").await
}

/// `clients` keep-alive connections at once, each GETting `url{i}` `each` times in turn;
/// returns every status.
async fn burst(sidecar: SocketAddr, url: &str, clients: usize, each: usize) -> Vec<u16> {
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let url = url.to_owned();
            tokio::spawn(async move {
                let mut client = RawClient::connect(sidecar).await;
                let mut statuses = Vec::new();
                for i in 0..each {
                    let resp = client.get_with(&format!("{url}{}", c * each + i), "").await;
                    statuses.push(resp.status);
                }
                statuses
            })
        })
        .collect();
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.unwrap());
    }
    all
}

/// Asserts a 502 parent_refused naming the parent's URL and `status`; returns the body.
fn assert_parent_refused(resp: &RawResponse, squid: &Squid, status: u16, what: &str) -> String {
    let body = resp.assert_sidecar_error(502, "parent_refused", what);
    assert!(
        body.contains(&squid.url()),
        "{what}: the parent's URL in {body:?}"
    );
    assert!(body.contains(&status.to_string()), "{what}: {status} in {body:?}");
    body
}

/// Squid's lines for requests to `origin` (absolute-form GETs, or CONNECTs to it).
fn lines_for(entries: &[SquidEntry], origin: SocketAddr) -> Vec<&SquidEntry> {
    let authority = origin.to_string();
    entries
        .iter()
        .filter(|e| e.url == authority || e.url.starts_with(&format!("http://{authority}/")))
        .collect()
}

/// A TCP server echoing every byte back (the far end of an opaque tunnel).
/// A plain origin, a TLS one (`secure`, also `secure.test:80` for apps) and an echo server for
/// opaque CONNECTs, and a sidecar reaching all three through `squid`.
struct Origins {
    plain: FakeUpstream,
    secure: FakeUpstream,
    echo: SocketAddr,
    sidecar: Sidecar,
}

async fn origins_through(squid: &Squid, dir: &TempDir, creds: &Path) -> Origins {
    origins_via(&via(squid, creds, ""), dir).await
}

/// [`Origins`] with `defaults.via` set to `via` (flow style).
async fn origins_via(via: &str, dir: &TempDir) -> Origins {
    let plain = FakeUpstream::start().await;
    let ca = TestCa::new();
    let (secure, ca_file) = tls_origin(&ca, dir).await;
    let echo = echo_server().await;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  via: {via}\npolicy: {{ connect_ports: [{echo_port}] }}\nupstreams:\n  \
         - name: plain\n    url: http://{plain}\n  \
         - name: secure\n    url: https://{secure}\n    aliases: [secure.test:80]\n    \
         tls: {{ ca_file: {ca} }}\n",
        echo_port = echo.port(),
        plain = plain.addr,
        secure = secure.addr,
        ca = ca_file.display()
    ))
    .await;
    Origins {
        plain,
        secure,
        echo,
        sidecar,
    }
}

async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut rd, mut wr) = stream.split();
                let _ = tokio::io::copy(&mut rd, &mut wr).await;
            });
        }
    });
    addr
}

/// Sends `CONNECT target` with `extra` header lines; returns the client and the answer's head
/// (with the whole body unless it is a 200).
async fn connect(sidecar: SocketAddr, target: &str, extra: &str) -> (RawClient, RawResponse) {
    let mut client = RawClient::connect(sidecar).await;
    let resp = tokio::time::timeout(Duration::from_secs(15), client.open_tunnel(target, extra, b""))
        .await
        .expect("CONNECT answered within 15s")
        .expect("a response to CONNECT, not a bare close");
    (client, resp)
}

/// Through an open tunnel: sends `bytes`, reads as many back.
async fn echo_through(client: &mut RawClient, bytes: &[u8]) -> Vec<u8> {
    let mut got = client.take_buffered();
    client.stream.write_all(bytes).await.unwrap();
    while got.len() < bytes.len() {
        let mut chunk = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), client.stream.read(&mut chunk))
            .await
            .expect("echo within 10s")
            .unwrap();
        assert!(n > 0, "tunnel closed before the echo");
        got.extend_from_slice(&chunk[..n]);
    }
    got
}

fn basic(credentials: &str) -> String {
    base64::Engine::encode(&base64::engine::general_purpose::STANDARD, credentials)
}

// === the harness itself ===

#[tokio::test]
async fn squid_lets_authenticated_clients_through_and_logs_them() {
    if !support::curl_or_skip() {
        return;
    }
    let Some(squid) = Squid::start().await else { return };
    let origin = FakeUpstream::start().await;
    let run = |userinfo: String| {
        let proxy = format!("http://{userinfo}@{}", squid.addr);
        let url = format!("http://{}/harness", origin.addr);
        async move {
            let out = support::curl()
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-x", &proxy, &url])
                .output()
                .await
                .unwrap();
            String::from_utf8(out.stdout).unwrap()
        }
    };
    // Right, wrong, right again: a refused password does not stick in Squid's auth cache.
    assert_eq!(run(squid.credentials()).await, "200");
    assert_eq!(run("alice:wrong".into()).await, "407");
    assert_eq!(run(squid.credentials()).await, "200");
    squid.fence(origin.addr).await;
    let entries = squid.entries();
    let summary: Vec<_> = entries.iter().map(|e| (e.status, e.user.as_str())).collect();
    assert_eq!(
        summary,
        [(200, "alice"), (407, "alice"), (200, "alice")],
        "{entries:?}"
    );
    assert_eq!(
        entries[0].proxy_authorization,
        format!("Basic {}", basic(&squid.credentials()))
    );
    assert_eq!(origin.requests(), 3, "the fence reached the origin too");
    // What Squid forwards carries its Via, and never the Proxy-Authorization it consumed.
    let seen = &origin.seen()[0];
    assert!(seen.headers.get("via").is_some(), "{:?}", seen.headers);
    assert!(
        seen.headers.get("proxy-authorization").is_none(),
        "{:?}",
        seen.headers
    );
}

// === 1. pooled through the parent ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_and_https_upstreams_go_through_the_parent_on_pooled_connections() {
    let Some((squid, dir, creds)) = squid_with_credentials(None).await else {
        return;
    };
    let plain = FakeUpstream::start().await;
    let ca = TestCa::new();
    let (secure, ca_file) = tls_origin(&ca, &dir).await;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  via: {via}\nupstreams:\n  \
         - name: plain\n    url: http://{plain}\n    pool: {{ max_connections: 4 }}\n  \
         - name: secure\n    url: https://{secure}\n    aliases: [secure.test:80]\n    \
         tls: {{ ca_file: {ca} }}\n    pool: {{ max_connections: 4 }}\n",
        via = via(&squid, &creds, ""),
        plain = plain.addr,
        secure = secure.addr,
        ca = ca_file.display()
    ))
    .await;

    let plain_statuses = burst(sidecar.addr, &format!("http://{}/plain/", plain.addr), 20, 2).await;
    let secure_statuses = burst(sidecar.addr, "http://secure.test/secure/", 20, 2).await;
    assert_eq!(
        plain_statuses,
        vec![200; 40],
        "http:// upstream through the parent"
    );
    assert_eq!(
        secure_statuses,
        vec![200; 40],
        "https:// upstream through the parent"
    );
    assert_eq!(
        (plain.requests(), secure.requests()),
        (40, 40),
        "requests at the origins"
    );

    for label in ["plain", "secure"] {
        let pool = support::debug_pool(sidecar.admin, label).await;
        assert_eq!(pool["via"], squid.url(), "/debug/pools names the parent: {pool}");
    }

    // CONNECT lines are written when tunnels close: stop the sidecar, see the origin's TLS
    // connections (Squid's server side of each tunnel) close, then fence the log.
    sidecar.stop().await;
    assert!(
        eventually(Duration::from_secs(10), || secure.open() == 0).await,
        "tunnels still open at the TLS origin after the sidecar stopped"
    );
    squid.fence(plain.addr).await;
    let entries = squid.entries();
    let gets = lines_for(&entries, plain.addr);
    let connects = lines_for(&entries, secure.addr);
    println!(
        "squid: http:// {} requests over {} client connections; https:// {} CONNECTs over {} \
         client connections ({} TLS connections at the origin)",
        gets.len(),
        distinct_client_ports(gets.iter().copied()),
        connects.len(),
        distinct_client_ports(connects.iter().copied()),
        secure.accepted()
    );
    assert_eq!(gets.len(), 40, "every http:// request in squid's log: {gets:?}");
    assert!(
        gets.iter()
            .all(|e| e.method == "GET" && e.status == 200 && e.user == "alice"),
        "{gets:?}"
    );
    let get_connections = distinct_client_ports(gets.iter().copied());
    assert!(
        (1..=4).contains(&get_connections),
        "http:// requests came over {get_connections} client connections, max_connections 4"
    );
    assert!(
        (1..=4).contains(&connects.len()),
        "one CONNECT per pooled tunnel, not per request (max_connections 4): {} CONNECTs",
        connects.len()
    );
    assert!(
        connects
            .iter()
            .all(|e| e.method == "CONNECT" && e.status == 200 && e.user == "alice"),
        "{connects:?}"
    );
    assert_eq!(
        entries.len(),
        gets.len() + connects.len(),
        "nothing else went to the parent: {entries:?}"
    );
}

// === 2. a refused password ===

#[tokio::test]
async fn a_wrong_password_is_502_parent_refused_naming_407_and_never_retried() {
    let Some((squid, dir, creds)) = squid_with_credentials(Some("wrong")).await else {
        return;
    };
    let Origins {
        plain,
        secure,
        echo,
        sidecar,
    } = origins_through(&squid, &dir, &creds).await;

    for i in 0..5 {
        let resp = get_once(sidecar.addr, &format!("http://{}/refused/{i}", plain.addr)).await;
        let body = assert_parent_refused(&resp, &squid, 407, "http:// upstream, wrong password");
        if i == 0 {
            println!("http:// upstream: {body}");
        }
        let resp = get_once(sidecar.addr, "http://secure.test/refused").await;
        let body = assert_parent_refused(&resp, &squid, 407, "https:// upstream, wrong password");
        if i == 0 {
            println!("https:// upstream: {body}");
        }
        let (_client, resp) = connect(sidecar.addr, &echo.to_string(), "").await;
        let body = assert_parent_refused(&resp, &squid, 407, "opaque CONNECT, wrong password");
        if i == 0 {
            println!("opaque CONNECT: {body}");
        }
    }
    assert_eq!(
        (plain.requests(), secure.accepted()),
        (0, 0),
        "nothing reached the origins"
    );

    squid.fence(plain.addr).await;
    let entries = squid.entries();
    let counts = [
        lines_for(&entries, plain.addr).len(),
        lines_for(&entries, secure.addr).len(),
        lines_for(&entries, echo).len(),
    ];
    println!("squid's lines for 5 refused requests each (http, https, CONNECT): {counts:?}");
    assert!(
        counts.iter().all(|&n| (1..=5).contains(&n)),
        "each refused app request reaches the parent once at most, no retry: {counts:?} in {entries:?}"
    );
    assert!(entries.iter().all(|e| e.status == 407), "{entries:?}");
    assert_eq!(entries.len(), counts.iter().sum::<usize>(), "{entries:?}");
}

// === 3. no_via and direct ===

#[tokio::test]
async fn no_via_hosts_and_direct_upstreams_bypass_the_parent() {
    let Some((squid, _dir, creds)) = squid_with_credentials(None).await else {
        return;
    };
    let (proxied, patterned, pinned, on_the_fly) = (
        FakeUpstream::start().await,
        FakeUpstream::start().await,
        FakeUpstream::start().await,
        FakeUpstream::start().await,
    );
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  via: {via}\nupstreams:\n  \
         - name: proxied\n    url: http://{proxied}\n  \
         - name: patterned\n    url: http://origin.direct.test:{patterned_port}\n    \
         addresses: [{patterned}]\n  \
         - name: pinned\n    url: http://pinned.test:{pinned_port}\n    addresses: [{pinned}]\n    \
         via: {{ url: direct }}\n",
        via = via(&squid, &creds, ", no_via: [\"*.direct.test\", localhost]"),
        proxied = proxied.addr,
        patterned = patterned.addr,
        patterned_port = patterned.addr.port(),
        pinned = pinned.addr,
        pinned_port = pinned.addr.port(),
    ))
    .await;

    let urls = [
        format!(
            "http://origin.direct.test:{}/no-via-pattern",
            patterned.addr.port()
        ),
        format!("http://pinned.test:{}/via-direct", pinned.addr.port()),
        format!("http://localhost:{}/no-via-on-the-fly", on_the_fly.addr.port()),
        format!("http://{}/via-parent", proxied.addr),
    ];
    for url in &urls {
        let resp = get_once(sidecar.addr, url).await;
        assert_eq!(resp.status, 200, "{url}: {}", resp.text());
    }
    let got = [
        patterned.requests(),
        pinned.requests(),
        on_the_fly.requests(),
        proxied.requests(),
    ];
    assert_eq!(got, [1, 1, 1, 1], "each origin got its request");
    // Squid adds Via to what it forwards: only the proxied origin's request carries it.
    let via_headers: Vec<bool> = [&patterned, &pinned, &on_the_fly, &proxied]
        .iter()
        .map(|o| o.seen()[0].headers.get("via").is_some())
        .collect();
    assert_eq!(
        via_headers,
        [false, false, false, true],
        "Via added by squid, per origin"
    );

    squid.fence(proxied.addr).await;
    let entries = squid.entries();
    let paths: Vec<&str> = entries.iter().map(|e| e.url.as_str()).collect();
    assert_eq!(
        paths,
        [format!("http://{}/via-parent", proxied.addr)],
        "only the upstream without no_via or direct went through the parent"
    );
}

// === 4. credentials re-read ===

#[tokio::test]
async fn new_credentials_in_the_file_take_effect_without_a_restart() {
    let Some((squid, dir, creds)) = squid_with_credentials(Some("outdated")).await else {
        return;
    };
    let plain = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  via: {via}\nupstreams:\n  - name: plain\n    url: http://{plain}\n",
        via = via(&squid, &creds, ""),
        plain = plain.addr
    ))
    .await;
    let url = format!("http://{}/rotated", plain.addr);
    let resp = get_once(sidecar.addr, &url).await;
    assert_parent_refused(&resp, &squid, 407, "the outdated password");

    // The new secret lands the way a mounted Secret changes: a new file renamed over the old.
    let tmp = dir.path.join("parent-credentials.new");
    std::fs::write(&tmp, format!("{}\n", squid.credentials())).unwrap();
    std::fs::rename(&tmp, &creds).unwrap();
    let mut attempts = 0;
    let resp = fetch_until(
        Duration::from_secs(10),
        || {
            attempts += 1;
            get_once(sidecar.addr, &url)
        },
        |r| r.status == 200,
    )
    .await;
    assert_eq!(
        resp.status,
        200,
        "still refused 10s after the file changed: {}",
        resp.text()
    );
    println!("the new password took effect after {attempts} attempts");

    squid.fence(plain.addr).await;
    let entries = squid.entries();
    assert_eq!(entries.first().map(|e| e.status), Some(407), "{entries:?}");
    assert_eq!(entries.last().map(|e| e.status), Some(200), "{entries:?}");
    assert_eq!(plain.requests(), 2, "the accepted request and the fence");
}

// === 5. the app's Proxy-Authorization ===

#[tokio::test]
async fn the_apps_proxy_authorization_reaches_neither_the_parent_nor_the_origin() {
    let Some((squid, dir, creds)) = squid_with_credentials(None).await else {
        return;
    };
    let Origins {
        plain,
        secure,
        echo,
        sidecar,
    } = origins_through(&squid, &dir, &creds).await;
    let app_token = basic("app-user:app-secret-7f3a9c");
    let header = format!("Proxy-Authorization: Basic {app_token}\r\n");

    let mut client = RawClient::connect(sidecar.addr).await;
    let resp = client
        .get_with(&format!("http://{}/app-auth", plain.addr), &header)
        .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let resp = client.get_with("http://secure.test/app-auth", &header).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let (mut tunnel, resp) = connect(sidecar.addr, &echo.to_string(), &header).await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(echo_through(&mut tunnel, b"ping").await, b"ping");
    drop(tunnel);
    drop(client);
    sidecar.stop().await;
    assert!(
        eventually(Duration::from_secs(10), || secure.open() == 0).await,
        "tunnels to the TLS origin still open after the sidecar stopped"
    );

    squid.fence(plain.addr).await;
    let log = squid.log_text();
    assert!(
        !log.contains(&app_token),
        "the app's Proxy-Authorization reached squid:\n{log}"
    );
    let entries = squid.entries();
    let sidecar_token = format!("Basic {}", basic(&squid.credentials()));
    let methods: Vec<(&str, &str)> = entries
        .iter()
        .map(|e| (e.method.as_str(), e.proxy_authorization.as_str()))
        .collect();
    assert_eq!(
        methods.iter().filter(|(_, auth)| *auth == sidecar_token).count(),
        entries.len(),
        "squid saw the sidecar's own credentials on every request and CONNECT: {methods:?}"
    );
    assert_eq!(
        entries.len(),
        3,
        "a GET, a CONNECT for https://, an opaque CONNECT: {methods:?}"
    );
    for (label, origin) in [("http://", &plain), ("https://", &secure)] {
        for seen in origin.seen() {
            assert!(
                seen.headers.get("proxy-authorization").is_none(),
                "{label} origin got a Proxy-Authorization: {:?}",
                seen.headers
            );
            let all = format!("{:?}", seen.headers);
            assert!(!all.contains(&app_token), "{label} origin: {all}");
        }
    }
}

// === TLS to the parent (https://) ===

/// A Squid listening for TLS too, a credentials file, and `via` naming its `https_port` with
/// `ca_file` trusting its certificate (`trusted`), or no `ca_file`.
async fn tls_squid(trusted: bool) -> Option<(Squid, TempDir, String)> {
    let squid_ca = TestCa::new();
    let squid = Squid::start_tls(&squid_ca).await?;
    let dir = TempDir::new();
    let creds = dir.path.join("parent-credentials");
    std::fs::write(&creds, format!("{}\n", squid.credentials())).unwrap();
    let ca_file = dir.path.join("parent-ca.pem");
    std::fs::write(&ca_file, &squid_ca.pem).unwrap();
    let ca = if trusted {
        format!(", ca_file: {}", ca_file.display())
    } else {
        String::new()
    };
    let via = format!(
        "{{ url: {url}, credentials_file: {creds}{ca} }}",
        url = squid.tls_url(),
        creds = creds.display()
    );
    Some((squid, dir, via))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_parent_carries_requests_tunnels_and_opaque_connects_over_tls() {
    let Some((squid, dir, via)) = tls_squid(true).await else {
        return;
    };
    let Origins {
        plain,
        secure,
        echo,
        sidecar,
    } = origins_via(&via, &dir).await;

    let plain_statuses = burst(sidecar.addr, &format!("http://{}/plain/", plain.addr), 2, 5).await;
    let secure_statuses = burst(sidecar.addr, "http://secure.test/secure/", 2, 5).await;
    assert_eq!(
        plain_statuses,
        vec![200; 10],
        "http:// upstream through a TLS parent"
    );
    assert_eq!(
        secure_statuses,
        vec![200; 10],
        "https:// upstream: TLS inside TLS"
    );
    let (mut tunnel, resp) = connect(sidecar.addr, &echo.to_string(), "").await;
    assert_eq!(
        resp.status,
        200,
        "opaque CONNECT through a TLS parent: {}",
        resp.text()
    );
    assert_eq!(
        echo_through(&mut tunnel, b"through two tunnels").await,
        b"through two tunnels"
    );
    drop(tunnel);
    let pool = support::debug_pool(sidecar.admin, "plain").await;
    assert_eq!(
        pool["via"],
        squid.tls_url(),
        "/debug/pools names the TLS parent: {pool}"
    );

    sidecar.stop().await;
    assert!(
        eventually(Duration::from_secs(10), || secure.open() == 0).await,
        "tunnels still open at the TLS origin after the sidecar stopped"
    );
    squid.fence(plain.addr).await;
    let entries = squid.entries();
    let tls_port = squid.tls_addr.unwrap().port();
    assert!(
        entries
            .iter()
            .all(|e| e.local_port == tls_port && e.user == "alice"),
        "every request and CONNECT came to squid's https_port, authenticated: {entries:?}"
    );
    let gets = lines_for(&entries, plain.addr);
    let connects = lines_for(&entries, secure.addr);
    let opaque = lines_for(&entries, echo);
    assert_eq!(gets.len(), 10, "every http:// request, absolute-form: {gets:?}");
    assert!(
        (1..=2).contains(&connects.len()) && connects.iter().all(|e| e.method == "CONNECT"),
        "one CONNECT per pooled TLS connection (2 clients): {connects:?}"
    );
    assert_eq!(opaque.len(), 1, "the app's tunnel, chained: {opaque:?}");
    assert_eq!(
        (plain.requests(), secure.requests()),
        (10 + 1, 10),
        "requests at the origins (the plain one also answered the fence)"
    );
}

#[tokio::test]
async fn an_https_parent_whose_certificate_is_not_trusted_is_tls_failed_naming_it() {
    let Some((squid, dir, via)) = tls_squid(false).await else {
        return;
    };
    let Origins {
        plain,
        secure,
        echo,
        sidecar,
    } = origins_via(&via, &dir).await;
    let parent = squid.tls_url();
    let resp = get_once(sidecar.addr, &format!("http://{}/untrusted", plain.addr)).await;
    let body = resp.assert_sidecar_error(502, "tls_failed", "an untrusted TLS parent");
    assert!(body.contains(&parent), "the parent named: {body:?}");
    let resp = get_once(sidecar.addr, "http://secure.test/untrusted").await;
    resp.assert_sidecar_error(502, "tls_failed", "an untrusted TLS parent, https:// upstream");
    let (_, resp) = connect(sidecar.addr, &echo.to_string(), "").await;
    let body = resp.assert_sidecar_error(502, "tls_failed", "an opaque CONNECT, untrusted TLS parent");
    assert!(body.contains(&parent), "the parent named: {body:?}");
    assert_eq!(
        (plain.requests(), secure.accepted()),
        (0, 0),
        "nothing got past the parent"
    );
}

// === 6. url: env ===

#[tokio::test]
async fn url_env_follows_the_sidecars_https_proxy_and_no_proxy() {
    let Some(squid) = Squid::start().await else { return };
    let dir = TempDir::new();
    let ca = TestCa::new();
    let ca_file = ca.write_pem(&dir);
    let secure = FakeUpstream::start_tls(ca.server(&["127.0.0.1"], false, &[])).await;
    let nearby = FakeUpstream::start_tls(ca.server(&["nearby.test"], false, &[])).await;
    let fence_origin = FakeUpstream::start().await;
    let https_proxy = format!("http://{}@{}", squid.credentials(), squid.addr);
    let sidecar = ChildSidecar::spawn_with_env(
        &format!(
            "defaults:\n  via: {{ url: env }}\nupstreams:\n  \
             - name: secure\n    url: https://{secure}\n    aliases: [secure.test:80]\n    \
             tls: {{ ca_file: {ca} }}\n  \
             - name: nearby\n    url: https://nearby.test:{nearby_port}\n    \
             aliases: [nearby.test:80]\n    addresses: [{nearby}]\n    tls: {{ ca_file: {ca} }}\n",
            secure = secure.addr,
            nearby = nearby.addr,
            nearby_port = nearby.addr.port(),
            ca = ca_file.display()
        ),
        &[
            ("HTTPS_PROXY", &https_proxy),
            ("NO_PROXY", "nearby.test,.cluster.local"),
        ],
    )
    .await;

    for i in 0..3 {
        for host in ["secure.test", "nearby.test"] {
            let resp = get_once(sidecar.addr, &format!("http://{host}/env/{i}")).await;
            assert_eq!(resp.status, 200, "{host}: {}", resp.text());
        }
    }
    assert_eq!((secure.requests(), nearby.requests()), (3, 3));
    let pools = support::admin_get(sidecar.admin, "/debug/pools").await;
    let pools_text = pools.text();
    assert!(
        !pools_text.contains(&squid.password),
        "/debug/pools shows the parent's password: {pools_text}"
    );
    let via = |pool: serde_json::Value| pool["via"].clone();
    assert_eq!(
        via(support::debug_pool(sidecar.admin, "secure").await),
        squid.url(),
        "the https:// upstream's pool goes via HTTPS_PROXY"
    );
    assert!(
        via(support::debug_pool(sidecar.admin, "nearby").await).is_null(),
        "the NO_PROXY upstream's pool goes direct"
    );

    let logs = sidecar.logs.clone();
    drop(sidecar); // killed: its tunnels close, and squid logs their CONNECTs
    assert!(
        eventually(Duration::from_secs(10), || secure.open() == 0
            && nearby.open() == 0)
        .await,
        "connections still open at the origins after the sidecar was killed"
    );
    squid.fence(fence_origin.addr).await;
    let entries = squid.entries();
    let connects = lines_for(&entries, secure.addr);
    assert!(
        !connects.is_empty()
            && connects
                .iter()
                .all(|e| e.method == "CONNECT" && e.status == 200 && e.user == "alice"),
        "the https:// upstream tunnelled through HTTPS_PROXY: {entries:?}"
    );
    assert_eq!(
        entries.len(),
        connects.len(),
        "the NO_PROXY host went direct, not through squid: {entries:?}"
    );
    let leaked: Vec<String> = logs
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains(&squid.password))
        .cloned()
        .collect();
    assert!(leaked.is_empty(), "the parent's password was logged: {leaked:?}");
}

// === failures of the parent itself ===

#[tokio::test]
async fn a_connect_the_parent_answers_with_403_or_503_is_parent_refused() {
    let echo = echo_server().await;
    let closed = RefusingPort::new();
    let denied = format!(
        "acl denied_port port {}\nhttp_access deny CONNECT denied_port",
        echo.port()
    );
    let Some(squid) = Squid::start_with(&denied).await else {
        return;
    };
    let dir = TempDir::new();
    let creds = dir.path.join("parent-credentials");
    std::fs::write(&creds, squid.credentials()).unwrap();
    let plain = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  via: {via}\npolicy: {{ connect_ports: [{denied_port}, {closed_port}] }}\n",
        via = via(&squid, &creds, ""),
        denied_port = echo.port(),
        closed_port = closed.port(),
    ))
    .await;

    let (_client, resp) = connect(sidecar.addr, &echo.to_string(), "").await;
    let body = assert_parent_refused(&resp, &squid, 403, "a CONNECT squid's ACL denies");
    println!("403: {body}");
    let (_client, resp) = connect(sidecar.addr, &closed.addr.to_string(), "").await;
    let body = assert_parent_refused(&resp, &squid, 503, "a CONNECT to a closed port");
    println!("503: {body}");
    // A forwarded request's 5xx is the parent's answer about the origin: it passes through.
    let resp = get_once(sidecar.addr, &format!("http://{}/closed", closed.addr)).await;
    assert_eq!(resp.status, 503, "{}", resp.text());
    assert_eq!(
        resp.header("x-egress-error"),
        None,
        "squid's own 503 passed through"
    );

    squid.fence(plain.addr).await;
    let statuses: Vec<(String, u16)> = squid
        .entries()
        .iter()
        .map(|e| (e.method.clone(), e.status))
        .collect();
    assert_eq!(
        statuses,
        [
            ("CONNECT".into(), 403),
            ("CONNECT".into(), 503),
            ("GET".into(), 503)
        ],
        "one attempt each, none retried"
    );
}

#[tokio::test]
async fn an_unreachable_parent_is_connect_failed_naming_it() {
    let parent = RefusingPort::new();
    let dir = TempDir::new();
    let creds = dir.path.join("parent-credentials");
    std::fs::write(&creds, "alice:secret\n").unwrap();
    let plain = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  via: {{ url: http://{parent}, credentials_file: {creds} }}\n",
        parent = parent.addr,
        creds = creds.display()
    ))
    .await;
    let resp = get_once(sidecar.addr, &format!("http://{}/unreachable", plain.addr)).await;
    let body = resp.assert_sidecar_error(502, "connect_failed", "a refusing parent");
    assert_names_parent(&body, parent.addr);
    assert_eq!(plain.requests(), 0);
}

/// The error body names the parent at `addr` by its URL.
fn assert_names_parent(body: &str, addr: SocketAddr) {
    assert!(
        body.contains(&format!("http://{addr}")),
        "the parent named: {body:?}"
    );
}

/// A parent that accepts connections and never says a word: each is held until the sidecar
/// gives up on it.
async fn silent_parent() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut sink = [0u8; 1024];
                while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_parent_that_never_answers_is_connect_timeout_naming_it() {
    let blackhole = support::Blackhole::start().await;
    let silent = silent_parent().await;
    let ca = TestCa::new();
    let dir = TempDir::new();
    let (secure, ca_file) = tls_origin(&ca, &dir).await;
    let plain = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "defaults:\n  connect_timeout: 500ms\n  via: {{ url: http://{silent} }}\n\
         policy: {{ connect_ports: [{secure_port}] }}\nupstreams:\n  \
         - name: unreachable\n    url: http://{plain}\n    via: {{ url: http://{blackhole} }}\n  \
         - name: secure\n    url: https://{secure}\n    aliases: [secure.test:80]\n    \
         tls: {{ ca_file: {ca} }}\n",
        blackhole = blackhole.addr,
        secure_port = secure.addr.port(),
        plain = plain.addr,
        secure = secure.addr,
        ca = ca_file.display()
    ))
    .await;

    let resp = get_once(sidecar.addr, &format!("http://{}/hangs", plain.addr)).await;
    let body = resp.assert_sidecar_error(504, "connect_timeout", "a parent whose connects hang");
    assert_names_parent(&body, blackhole.addr);

    let (_client, resp) = connect(sidecar.addr, &secure.addr.to_string(), "").await;
    let body = resp.assert_sidecar_error(504, "connect_timeout", "an opaque CONNECT unanswered");
    assert_names_parent(&body, silent);

    let resp = get_once(sidecar.addr, "http://secure.test/unanswered").await;
    let body = resp.assert_sidecar_error(504, "connect_timeout", "a CONNECT the parent never answers");
    assert_names_parent(&body, silent);
    assert_eq!((plain.requests(), secure.accepted()), (0, 0));
}

#[test]
fn check_names_the_bad_via_key() {
    for (yaml, key) in [
        ("defaults:\n  via: { url: \"not a url\" }\n", "defaults.via.url"),
        (
            "upstreams:\n  - url: http://a.example\n    via: { url: http://127.0.0.1:3128, credentials_file: /nonexistent/parent }\n",
            "upstreams[0].via.credentials_file",
        ),
        (
            "defaults:\n  via: { url: https://127.0.0.1:3129, ca_file: /nonexistent/ca.pem }\n",
            "defaults.via.ca_file",
        ),
    ] {
        let (code, _, stderr) = support::check_config(yaml);
        assert_eq!(code, 2, "{yaml}: {stderr}");
        assert!(stderr.contains(key), "{key} named in: {stderr}");
    }
}
