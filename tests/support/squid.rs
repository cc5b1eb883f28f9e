//! A real Squid as the corporate parent proxy: its config, password file and logs in a
//! TempDir, basic auth through `basic_ncsa_auth`, and its access log parsed for the tests.

use super::*;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

pub const SQUID_BINARY: &str = "/usr/sbin/squid";
pub const SQUID_NCSA_AUTH: &str = "/usr/lib/squid/basic_ncsa_auth";

/// The path prefix of [`Squid::fence`] requests, which [`Squid::entries`] leaves out.
const FENCE_PATH: &str = "/squid-fence/";

/// One line of Squid's access log (`logformat egress`, see [`Squid::start`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SquidEntry {
    /// The client's (the sidecar's) source port: one per client connection.
    pub client_port: u16,
    /// The port of Squid's the client connected to (its `https_port` for TLS clients).
    pub local_port: u16,
    /// `GET`, `CONNECT`, ...
    pub method: String,
    /// The absolute URL, or `host:port` for a CONNECT.
    pub url: String,
    /// The status Squid sent the client (`407` for refused credentials).
    pub status: u16,
    /// The user Squid authenticated, or `-`.
    pub user: String,
    /// The `Proxy-Authorization` the client sent, as received, or `-`.
    pub proxy_authorization: String,
}

/// A Squid on 127.0.0.1 allowing authenticated clients from localhost anywhere (CONNECT to any
/// port too), caching nothing; killed on drop.
pub struct Squid {
    pub addr: SocketAddr,
    /// Its `https_port` (TLS from clients, with a certificate for 127.0.0.1), when started
    /// with [`Squid::start_tls`].
    pub tls_addr: Option<SocketAddr>,
    /// The one user of its password file.
    pub user: String,
    pub password: String,
    // Dropped in this order: the process dies first, then its files go.
    child: tokio::process::Child,
    shm: SharedMemory,
    dir: TempDir,
}

/// A Squid's shared-memory segments (`/dev/shm/NAME-*`), named after the service name each
/// instance gets (`-n`). With Squid's default name, two instances starting at once, or one
/// after a killed one, collided on `squid-cf__queues.shm` ("File exists"); a killed Squid
/// leaves its segments, so they are removed on drop.
struct SharedMemory(String);

impl Drop for SharedMemory {
    fn drop(&mut self) {
        let prefix = format!("{}-", self.0);
        for entry in std::fs::read_dir("/dev/shm").into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

impl Squid {
    /// Starts Squid with user `alice` and a fresh password, and waits until it listens.
    /// `None` (after [`skip`], which fails under CI) when Squid or what it needs is not here.
    pub async fn start() -> Option<Self> {
        Self::start_with("").await
    }

    /// Like [`Squid::start`], with `access` lines (`acl`, `http_access deny`) checked before
    /// the rule that lets authenticated clients through.
    pub async fn start_with(access: &str) -> Option<Self> {
        Self::start_with_tls(access, None).await
    }

    /// Like [`Squid::start`], also listening for TLS clients (an `https_port`: a secure web
    /// proxy) with a certificate for 127.0.0.1 issued by `ca`.
    pub async fn start_tls(ca: &TestCa) -> Option<Self> {
        Self::start_with_tls("", Some(ca)).await
    }

    async fn start_with_tls(access: &str, ca: Option<&TestCa>) -> Option<Self> {
        for (path, what) in [
            (SQUID_BINARY, "squid (Debian package squid)"),
            (SQUID_NCSA_AUTH, "basic_ncsa_auth (Debian package squid)"),
        ] {
            if !Path::new(path).exists() {
                skip(&format!("{what} is not installed: no {path}"));
                return None;
            }
        }
        if ca.is_some() && !built_with_tls() {
            skip("squid without TLS support: https_port needs Debian's squid-openssl");
            return None;
        }
        let password = format!("pw-{}-{}", std::process::id(), Self::next_id());
        let Some(hash) = apr1_hash(&password).await else {
            skip("openssl (to hash the parent proxy's password) is not installed");
            return None;
        };
        let dir = TempDir::new();
        // Squid started as root drops to the `proxy` user, which must write its logs and pid
        // file here and read the password file.
        std::fs::set_permissions(&dir.path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let passwd = dir.path.join("passwd");
        std::fs::write(&passwd, format!("alice:{hash}\n")).unwrap();
        std::fs::set_permissions(&passwd, std::fs::Permissions::from_mode(0o644)).unwrap();
        let as_root = std::fs::metadata(&dir.path).unwrap().uid() == 0;
        let tls_files = ca.map(|ca| ca.server_files(&["127.0.0.1"], &dir.path, "squid"));

        for _ in 0..10 {
            // Squid takes a port number, not a socket: pick a free one by binding port 0 and
            // releasing it. The port may be taken again before Squid binds it (no way to hand
            // Squid the bound socket), so a start that fails with "Address already in use" is
            // retried on a new port.
            let port = free_port();
            let tls = tls_files.as_ref().map(|(cert, key)| TlsPort {
                port: free_port(),
                cert,
                key,
            });
            for file in ["cache.log", "access.log", "squid.pid", "stderr.log"] {
                let _ = std::fs::remove_file(dir.path.join(file));
            }
            let config = dir.path.join("squid.conf");
            let listen = Listen {
                port,
                tls: tls.as_ref(),
            };
            std::fs::write(
                &config,
                squid_config(&dir.path, &listen, &passwd, as_root, access),
            )
            .unwrap();
            let stderr = std::fs::File::create(dir.path.join("stderr.log")).unwrap();
            // Letters and digits only: Squid refuses other service names.
            let shm = SharedMemory(format!("egress{}n{}", std::process::id(), Self::next_id()));
            let mut child = tokio::process::Command::new(SQUID_BINARY)
                .arg("-N") // no daemon: this process is Squid, and dies on drop
                .arg("-n")
                .arg(&shm.0)
                .arg("-f")
                .arg(&config)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(stderr)
                .kill_on_drop(true)
                .spawn()
                .expect("starting squid");
            match wait_listening(&mut child, &dir.path, &listen).await {
                Started::Listening => {
                    return Some(Squid {
                        addr: SocketAddr::from(([127, 0, 0, 1], port)),
                        tls_addr: tls.map(|t| SocketAddr::from(([127, 0, 0, 1], t.port))),
                        user: "alice".into(),
                        password,
                        child,
                        shm,
                        dir,
                    });
                }
                Started::PortTaken => continue,
            }
        }
        panic!("squid found no free port in 10 tries");
    }

    fn next_id() -> usize {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        NEXT.fetch_add(1, Ordering::SeqCst)
    }

    /// `http://127.0.0.1:PORT`: the parent's URL for `via.url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `https://127.0.0.1:PORT`: the URL of its `https_port` (after [`Squid::start_tls`]).
    pub fn tls_url(&self) -> String {
        format!("https://{}", self.tls_addr.expect("squid started with start_tls"))
    }

    /// `user:password`, the line of a `credentials_file`.
    pub fn credentials(&self) -> String {
        format!("{}:{}", self.user, self.password)
    }

    /// The access log's text as written so far (empty before the first line).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.path.join("access.log")).unwrap_or_default()
    }

    /// The access log, parsed, less the [`Squid::fence`] requests. Squid writes a line when a
    /// transaction ends: a request just after its response is sent, a CONNECT tunnel only
    /// when the tunnel closes.
    pub fn entries(&self) -> Vec<SquidEntry> {
        self.log_text()
            .lines()
            .map(|line| parse_entry(line).unwrap_or_else(|| panic!("unexpected squid log line {line:?}")))
            .filter(|e| !e.url.contains(FENCE_PATH))
            .collect()
    }

    /// Makes sure every transaction that ended before this call is in the access log: sends
    /// one request of its own through Squid (to `origin`, any HTTP server answering GET) and
    /// waits until its line is logged. Squid logs in the order transactions end, so a check
    /// that something is NOT in the log, made after this, cannot miss a late line.
    pub async fn fence(&self, origin: SocketAddr) {
        let path = format!("{FENCE_PATH}{}", Self::next_id());
        let mut client = RawClient::connect(self.addr).await;
        let auth = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, self.credentials());
        client
            .send_raw(
                format!(
                    "GET http://{origin}{path} HTTP/1.1\r\nHost: {origin}\r\n\
                     Proxy-Authorization: Basic {auth}\r\nConnection: close\r\n\r\n"
                )
                .as_bytes(),
            )
            .await;
        let resp = tokio::time::timeout(Duration::from_secs(10), client.read_response(false))
            .await
            .expect("squid answered the fence request within 10s")
            .expect("a response to the fence request");
        assert_eq!(
            resp.status,
            200,
            "the fence request through squid: {}",
            resp.text()
        );
        let logged = eventually(Duration::from_secs(10), || self.log_text().contains(&path)).await;
        assert!(logged, "squid never logged the fence request {path}");
    }

    /// Polls the access log every 20 ms until `cond` holds of its entries or `within` passes;
    /// returns the last entries either way (the caller asserts on them).
    pub async fn entries_until(
        &self,
        within: Duration,
        mut cond: impl FnMut(&[SquidEntry]) -> bool,
    ) -> Vec<SquidEntry> {
        fetch_until(within, || std::future::ready(self.entries()), |e| cond(e)).await
    }

    /// Squid's own log (startup, errors), for failure messages.
    pub fn cache_log(&self) -> String {
        std::fs::read_to_string(self.dir.path.join("cache.log")).unwrap_or_default()
    }

    /// Whether the process is still running.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

/// Distinct client connections among `entries`: their distinct source ports. (A port reused
/// by a later connection counts once, so this never over-counts.)
pub fn distinct_client_ports<'a>(entries: impl IntoIterator<Item = &'a SquidEntry>) -> usize {
    entries
        .into_iter()
        .map(|e| e.client_port)
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// Parses `%>a %>p %>lp %rm %ru %>Hs %un %'{Proxy-Authorization}>h` (the header last, raw: it
/// has spaces).
fn parse_entry(line: &str) -> Option<SquidEntry> {
    let mut fields = line.splitn(8, ' ');
    let _client_ip = fields.next()?;
    let client_port = fields.next()?.parse().ok()?;
    let local_port = fields.next()?.parse().ok()?;
    let method = fields.next()?.to_owned();
    let url = fields.next()?.to_owned();
    let status = fields.next()?.parse().ok()?;
    let user = fields.next()?.to_owned();
    let proxy_authorization = fields.next()?.to_owned();
    Some(SquidEntry {
        client_port,
        local_port,
        method,
        url,
        status,
        user,
        proxy_authorization,
    })
}

/// Whether this Squid can listen for TLS (`squid -v` names its build options).
fn built_with_tls() -> bool {
    std::process::Command::new(SQUID_BINARY)
        .arg("-v")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("--with-openssl"))
}

enum Started {
    Listening,
    PortTaken,
}

/// The ports Squid listens on.
struct Listen<'a> {
    port: u16,
    tls: Option<&'a TlsPort<'a>>,
}

/// An `https_port` and its certificate and key files.
struct TlsPort<'a> {
    port: u16,
    cert: &'a Path,
    key: &'a Path,
}

/// Waits (up to 20 s) until Squid says it accepts connections on every port of `listen`, or
/// exits because a port was taken; panics with its log on any other exit or on the timeout.
async fn wait_listening(child: &mut tokio::process::Child, dir: &Path, listen: &Listen<'_>) -> Started {
    let mut expected = vec![("Accepting HTTP Socket connections at conn", listen.port)];
    if let Some(tls) = listen.tls {
        expected.push(("Accepting HTTPS Socket connections at conn", tls.port));
    }
    let port = listen.port;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(dir.join("cache.log")).unwrap_or_default();
        let listening = |(what, port): &(&str, u16)| {
            let local = format!("local=127.0.0.1:{port} ");
            log.lines().any(|l| l.contains(what) && l.contains(&local))
        };
        if expected.iter().all(listening) {
            return Started::Listening;
        }
        if let Some(status) = child.try_wait().unwrap() {
            // Its last words may come after the exit is seen; read the log again.
            let log = std::fs::read_to_string(dir.join("cache.log")).unwrap_or_default();
            if log.contains("Address already in use") {
                return Started::PortTaken;
            }
            let stderr = std::fs::read_to_string(dir.join("stderr.log")).unwrap_or_default();
            panic!("squid exited ({status}) before listening on {port}:\n{log}\n{stderr}");
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "squid not listening on {port} within 20s:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn squid_config(dir: &Path, listen: &Listen<'_>, passwd: &Path, as_root: bool, access: &str) -> String {
    let d = dir.display();
    // Names are answered from /etc/hosts only (dns_nameservers on loopback, where none
    // listens): the tests' made-up names (*.test) are never asked of the machine's resolver,
    // and fail within seconds when they reach Squid.
    // Started as root Squid runs as cache_effective_user (default `proxy`: the directory is
    // world-writable for it); started as anyone else it stays that user and needs no setting.
    let user = if as_root {
        "cache_effective_user proxy\n"
    } else {
        ""
    };
    // An https_port without `accel` or `intercept` is a forward proxy spoken to over TLS.
    let tls = match listen.tls {
        Some(t) => format!(
            "https_port 127.0.0.1:{} tls-cert={} tls-key={}\n",
            t.port,
            t.cert.display(),
            t.key.display()
        ),
        None => String::new(),
    };
    format!(
        "http_port 127.0.0.1:{port}\n\
         {tls}\
         {user}\
         pid_filename {d}/squid.pid\n\
         cache_log {d}/cache.log\n\
         coredump_dir {d}\n\
         logformat egress %>a %>p %>lp %rm %ru %>Hs %un %'{{Proxy-Authorization}}>h\n\
         access_log stdio:{d}/access.log egress\n\
         buffered_logs off\n\
         cache deny all\n\
         cache_mem 8 MB\n\
         visible_hostname egress-sidecar-test-parent\n\
         netdb_filename none\n\
         dns_nameservers 127.0.0.1\n\
         dns_timeout 1 seconds\n\
         pinger_enable off\n\
         shutdown_lifetime 0 seconds\n\
         auth_param basic program {ncsa} {passwd}\n\
         auth_param basic children 2\n\
         auth_param basic realm egress-sidecar-test\n\
         auth_param basic credentialsttl 1 second\n\
         acl authenticated proxy_auth REQUIRED\n\
         {access}\n\
         http_access allow localhost authenticated\n\
         http_access deny all\n",
        port = listen.port,
        ncsa = SQUID_NCSA_AUTH,
        passwd = passwd.display(),
    )
}

/// An Apache MD5 (`$apr1$`) hash of `password`, which basic_ncsa_auth checks; None without
/// openssl.
async fn apr1_hash(password: &str) -> Option<String> {
    let out = tokio::process::Command::new("openssl")
        .args(["passwd", "-apr1", password])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .ok()?;
    assert!(
        out.status.success(),
        "openssl passwd: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8(out.stdout).unwrap().trim().to_owned())
}
