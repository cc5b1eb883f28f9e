//! What tests need from the machine: tools (skipping or failing without them), Go programs,
//! a test CA, and sockets that hold ports.

use super::*;

// === what a test needs from the machine ===

/// Whether this is a CI run (`CI=true`, as .ci/run is started): there a missing tool means a
/// missing install step, and the test that needs it fails instead of skipping.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// Says why a test cannot run on this machine. Locally it prints `SKIPPED: why` and the caller
/// returns; in CI it fails the test, naming what is missing.
pub fn skip(why: &str) {
    assert!(
        !in_ci(),
        "CI=true and this test cannot run: {why}; .ci/run must install it"
    );
    println!("SKIPPED: {why}");
}

// === Go programs under tests/ ===

/// Whether `go` runs here.
pub async fn have_go() -> bool {
    tokio::process::Command::new("go")
        .arg("version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .is_ok_and(|s| s.success())
}

/// A port free a moment ago: bound and released, for the programs that cannot take port 0
/// (Squid, envoyproxy/ratelimit, the OpenTelemetry Collector, Prometheus). Whoever uses it
/// retries with another on a clash.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `go`, run in `dir` as every test builds Go: no cgo, the local toolchain, no workspace, and a
/// build cache under the target dir when the environment names none.
pub fn go_command(dir: &std::path::Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new("go");
    cmd.current_dir(dir)
        .env("CGO_ENABLED", "0")
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "")
        .env("GOWORK", "off")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let has_cache_home = ["GOCACHE", "XDG_CACHE_HOME", "HOME"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    if !has_cache_home {
        cmd.env(
            "GOCACHE",
            std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("gocache"),
        );
    }
    cmd
}

/// Builds the Go program at `src` (relative to the crate root) into the cargo target tmpdir;
/// `None` when `go` is not on PATH. `src` is a stdlib-only `.go` file, or a module directory
/// (its own go.mod and go.sum; .ci/run downloads its modules first).
pub async fn build_go(src: &str, name: &str) -> Option<std::path::PathBuf> {
    if !have_go().await {
        return None;
    }
    let out_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("go-bin");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(name);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // A module is built from its own directory (the crate root has no go.mod).
    let (dir, package) = if root.join(src).join("go.mod").is_file() {
        (root.join(src), ".")
    } else {
        (root.to_path_buf(), src)
    };
    let mut cmd = go_command(&dir);
    cmd.args(["build", "-o"]).arg(&out).arg(package);
    run_go(&mut cmd, &format!("go build {src}"), Duration::from_secs(180)).await;
    Some(out)
}

/// Runs `cmd` (a `go build` or `go install` from [`go_command`]) within `limit`; the test
/// fails, with go's stderr, when it fails.
pub async fn run_go(cmd: &mut tokio::process::Command, what: &str, limit: Duration) {
    let output = tokio::time::timeout(limit, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} took longer than {limit:?}"))
        .unwrap_or_else(|e| panic!("running {what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

// === TLS ===

/// A throwaway certificate authority for TLS tests.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
}

impl TestCa {
    pub fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "egress-sidecar test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestCa {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A certificate for `names` (expired when asked) and its key.
    fn issue(&self, names: &[&str], expired: bool) -> (rcgen::Certificate, rcgen::KeyPair) {
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert, key)
    }

    /// A certificate for `names` and its key written as PEM files `{stem}.crt` and `{stem}.key`
    /// in `dir`, readable by any user (a server that drops privileges reads them).
    pub fn server_files(
        &self,
        names: &[&str],
        dir: &std::path::Path,
        stem: &str,
    ) -> (std::path::PathBuf, std::path::PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let (cert, key) = self.issue(names, false);
        let files = (dir.join(format!("{stem}.crt")), dir.join(format!("{stem}.key")));
        std::fs::write(&files.0, cert.pem()).unwrap();
        std::fs::write(&files.1, key.serialize_pem()).unwrap();
        for file in [&files.0, &files.1] {
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        files
    }

    /// A client certificate (clientAuth EKU) whose subject is `CN={cn}`, and its key, as PEM
    /// text: for mutual TLS, written where the sidecar reads them.
    pub fn client_pem(&self, cn: &str) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A server config with a certificate for `names` (expired when asked) offering `alpn`.
    pub fn server(&self, names: &[&str], expired: bool, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
        let (cert, key) = self.issue(names, expired);
        let key_der = rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.der().clone()], key_der)
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    }

    /// Writes the CA certificate into `dir`; returns the path.
    pub fn write_pem(&self, dir: &TempDir) -> std::path::PathBuf {
        let path = dir.path.join("ca.pem");
        std::fs::write(&path, &self.pem).unwrap();
        path
    }
}

/// A loopback address whose connects hang: a listener with a full accept queue drops further
/// SYNs. Kept alive by this value.
pub struct Blackhole {
    pub addr: SocketAddr,
    _listener: socket2::Socket,
    _fillers: Vec<socket2::Socket>,
}

impl Blackhole {
    /// A blackhole on 127.0.0.1.
    pub async fn start() -> Self {
        Self::bind("127.0.0.1:0".parse().unwrap())
            .await
            .expect("a blackhole on 127.0.0.1")
    }

    /// A blackhole on `addr` (port 0: any), IPv4 or IPv6; an error when it cannot be bound
    /// there (no `::1` on this machine, say).
    pub async fn bind(addr: SocketAddr) -> std::io::Result<Self> {
        let domain = socket2::Domain::for_address(addr);
        let listener = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
        if addr.is_ipv6() {
            listener.set_only_v6(true)?;
        }
        listener.bind(&addr.into())?;
        listener.listen(0)?;
        let addr = listener.local_addr()?.as_socket().unwrap();
        let mut fillers = Vec::new();
        for _ in 0..4 {
            let s = socket2::Socket::new(domain, socket2::Type::STREAM, None)?;
            s.set_nonblocking(true)?;
            let _ = s.connect(&addr.into());
            fillers.push(s);
        }
        // Nothing accepts, so once one filler is established the backlog-0 queue is full and
        // every later SYN is dropped; the others stay in SYN-SENT (no peer address).
        let full = eventually(Duration::from_secs(5), || {
            fillers.iter().any(|s| s.peer_addr().is_ok())
        })
        .await;
        assert!(full, "no filler connection was established");
        Ok(Blackhole {
            addr,
            _listener: listener,
            _fillers: fillers,
        })
    }
}

/// A loopback address that refuses connections for as long as this value lives: a TCP socket
/// bound to it but not listening answers a SYN with an RST, and holding the port keeps anyone
/// else from taking it (a port bound, released and then used could be taken meanwhile).
pub struct RefusingPort {
    pub addr: SocketAddr,
    _socket: socket2::Socket,
}

impl RefusingPort {
    pub fn new() -> Self {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        let addr = socket.local_addr().unwrap().as_socket().unwrap();
        RefusingPort {
            addr,
            _socket: socket,
        }
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }
}

/// Proxy-related variables a child client must not inherit from the test's environment.
pub const PROXY_ENV: &[&str] = &[
    "HTTP_PROXY",
    "http_proxy",
    "HTTPS_PROXY",
    "https_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
    // Go ignores HTTP_PROXY when this is set (CGI).
    "REQUEST_METHOD",
];

/// A child client with a clean proxy environment, no stdin, killed if the test drops it.
pub fn client_command(program: impl AsRef<std::ffi::OsStr>) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    for var in PROXY_ENV {
        cmd.env_remove(var);
    }
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    cmd
}

/// curl, ignoring any `.curlrc`, as a [`client_command`].
pub fn curl() -> tokio::process::Command {
    let mut cmd = client_command("curl");
    cmd.arg("-q");
    cmd
}

/// Whether curl runs here; when it does not, the test is [`skip`]ped (a failure under CI).
pub fn curl_or_skip() -> bool {
    let runs = std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !runs {
        skip("`curl` is not on PATH");
    }
    runs
}
