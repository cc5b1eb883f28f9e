//! The fleet-wide quota tests' services (issue 45): a real `redis-server` and Envoy's
//! rate-limit service (`envoyproxy/ratelimit`'s `service_cmd`, built from its pinned Go module)
//! on loopback, a Redis reader speaking RESP, a TCP proxy that slows the service down, and the
//! service's fixed calendar windows. Not the sidecar: tests/support/child.rs starts that.

use super::*;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{SystemTime, UNIX_EPOCH};

/// The Go module the service is built from, and its pin (.ci/run reads this line to warm the
/// build cache with the same version).
pub const RATELIMIT_PACKAGE: &str = "github.com/envoyproxy/ratelimit/src/service_cmd";
pub const RATELIMIT_VERSION: &str = "v1.4.1-0.20260122083618-3fb702589d36";

/// A prebuilt `service_cmd` to use instead of building one (a developer's shortcut; the tests
/// build their own when it is unset).
pub const RATELIMIT_BIN_ENV: &str = "EGRESS_TEST_RATELIMIT_BIN";

/// The domain every test's service config and sidecar config use.
pub const DOMAIN: &str = "egress";

/// The service's binary, when this machine has what the tests need (`redis-server`, and `go`
/// or a prebuilt binary): otherwise the test is [`skip`]ped, which fails it under CI.
pub async fn ratelimit_or_skip() -> Option<PathBuf> {
    let redis = std::process::Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !redis {
        skip("`redis-server` is not on PATH (Debian package redis-server)");
        return None;
    }
    let bin = service_cmd().await;
    if bin.is_none() {
        skip("`go` is not on PATH; envoyproxy/ratelimit's service_cmd cannot be built");
    }
    bin
}

/// `service_cmd`, built once per test binary into the cargo target tmpdir (kept there across
/// runs, per pinned version); `None` without `go`.
async fn service_cmd() -> Option<PathBuf> {
    static BUILT: tokio::sync::OnceCell<Option<PathBuf>> = tokio::sync::OnceCell::const_new();
    BUILT.get_or_init(build_service_cmd).await.clone()
}

async fn build_service_cmd() -> Option<PathBuf> {
    if let Some(bin) = std::env::var_os(RATELIMIT_BIN_ENV).filter(|v| !v.is_empty()) {
        let bin = PathBuf::from(bin);
        assert!(bin.is_file(), "{RATELIMIT_BIN_ENV}={} is no file", bin.display());
        return Some(bin);
    }
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tmp.join("go-bin").join(format!("ratelimit-{RATELIMIT_VERSION}"));
    let bin = dir.join("service_cmd");
    if bin.is_file() {
        return Some(bin);
    }
    if !super::machine::have_go().await {
        return None;
    }
    // Installed beside, then renamed in: another test binary reading the path never finds
    // half a file.
    let staging = dir.join(format!("staging-{}", std::process::id()));
    std::fs::create_dir_all(&staging).unwrap();
    let mut cmd = super::machine::go_command(tmp);
    cmd.arg("install")
        .arg(format!("{RATELIMIT_PACKAGE}@{RATELIMIT_VERSION}"))
        .env("GOBIN", &staging);
    // Cold (modules fetched, nothing cached) it takes a minute or two; .ci/run warms both.
    let what = format!("go install {RATELIMIT_PACKAGE}@{RATELIMIT_VERSION}");
    super::machine::run_go(&mut cmd, &what, Duration::from_secs(600)).await;
    std::fs::rename(staging.join("service_cmd"), &bin).unwrap();
    let _ = std::fs::remove_dir_all(&staging);
    Some(bin)
}

/// Whether a program's log says it could not bind its port (Redis and Go say it so).
fn bind_clash(log: &str) -> bool {
    let log = log.to_ascii_lowercase();
    log.contains("address already in use")
}

// === Redis ===

/// `redis-server` on 127.0.0.1, without persistence; killed on drop, its directory removed.
pub struct Redis {
    pub addr: SocketAddr,
    _child: tokio::process::Child,
    _dir: TempDir,
}

impl Redis {
    pub async fn start() -> Self {
        for _ in 0..10 {
            let dir = TempDir::new();
            let port = free_port();
            let log = dir.path.join("redis.log");
            let mut child = tokio::process::Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(&dir.path)
                .arg("--logfile")
                .arg(&log)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .expect("starting redis-server");
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            // Ours answers with its own directory: not another server that holds the port.
            let want = dir.path.canonicalize().unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    let logged = std::fs::read_to_string(&log).unwrap_or_default();
                    if bind_clash(&logged) {
                        break;
                    }
                    panic!("redis-server exited ({status}):\n{logged}");
                }
                if let Some(mut client) = RedisClient::connect(addr).await {
                    if let Resp::Array(items) = client.command(&["CONFIG", "GET", "dir"]).await {
                        if items.get(1).and_then(Resp::text).map(PathBuf::from) == Some(want.clone()) {
                            return Redis {
                                addr,
                                _child: child,
                                _dir: dir,
                            };
                        }
                    }
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "redis-server on {addr} did not answer in 10 s:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("redis-server found no free port in 10 tries");
    }

    /// One command's reply, on a new connection.
    pub async fn command(&self, args: &[&str]) -> Resp {
        let mut client = RedisClient::connect(self.addr)
            .await
            .unwrap_or_else(|| panic!("Redis on {} refused a connection", self.addr));
        client.command(args).await
    }

    /// The rate-limit service's counter for the descriptor `entries` in its current window
    /// (0 before the first hit). Its key is `DOMAIN_key_value_..._WINDOWSTART`; more than one
    /// window's key means the test crossed a window, which fails it (see [`fresh_window`]).
    pub async fn counter(&self, entries: &[(&str, &str)]) -> u64 {
        let mut pattern = format!("{DOMAIN}_");
        for (key, value) in entries {
            pattern.push_str(&format!("{key}_{value}_"));
        }
        // The window's start is all digits: a longer descriptor's key never matches.
        pattern.push_str("[0-9]*");
        let keys = match self.command(&["KEYS", &pattern]).await {
            Resp::Array(keys) => keys.iter().filter_map(Resp::text).collect::<Vec<_>>(),
            other => panic!("KEYS {pattern}: {other:?}"),
        };
        let keys: Vec<String> = keys
            .into_iter()
            .filter(|k| {
                k[pattern.len() - "[0-9]*".len()..]
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .collect();
        assert!(
            keys.len() <= 1,
            "counters of more than one window for {entries:?}: {keys:?} (the test crossed a window)"
        );
        match keys.first() {
            None => 0,
            Some(key) => match self.command(&["GET", key]).await {
                Resp::Bulk(Some(v)) => String::from_utf8(v).unwrap().parse().unwrap(),
                Resp::Bulk(None) => 0,
                other => panic!("GET {key}: {other:?}"),
            },
        }
    }

    /// Waits (up to `within`) until the counter of `entries` is at least `n`; returns it.
    pub async fn counter_reaches(&self, entries: &[(&str, &str)], n: u64, within: Duration) -> u64 {
        fetch_until(within, || self.counter(entries), |c| *c >= n).await
    }
}

/// A RESP reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Resp {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Resp>),
}

impl Resp {
    /// A simple or bulk string as text.
    pub fn text(&self) -> Option<String> {
        match self {
            Resp::Simple(s) => Some(s.clone()),
            Resp::Bulk(Some(b)) => String::from_utf8(b.clone()).ok(),
            _ => None,
        }
    }

    /// One whole reply at the start of `buf` and its length; None while it is incomplete.
    fn parse(buf: &[u8]) -> Option<(Resp, usize)> {
        let end = buf.windows(2).position(|w| w == b"\r\n")?;
        let line = std::str::from_utf8(&buf[1..end]).expect("RESP line is text");
        let after = end + 2;
        Some(match buf[0] {
            b'+' => (Resp::Simple(line.to_owned()), after),
            b'-' => (Resp::Error(line.to_owned()), after),
            b':' => (Resp::Int(line.parse().unwrap()), after),
            b'$' => {
                let len: i64 = line.parse().unwrap();
                if len < 0 {
                    (Resp::Bulk(None), after)
                } else {
                    let len = len as usize;
                    if buf.len() < after + len + 2 {
                        return None;
                    }
                    (
                        Resp::Bulk(Some(buf[after..after + len].to_vec())),
                        after + len + 2,
                    )
                }
            }
            b'*' => {
                let n: i64 = line.parse().unwrap();
                let mut items = Vec::new();
                let mut at = after;
                for _ in 0..n.max(0) {
                    let (item, used) = Resp::parse(&buf[at..])?;
                    items.push(item);
                    at += used;
                }
                (Resp::Array(items), at)
            }
            other => panic!("not a RESP reply: {:?}", other as char),
        })
    }
}

/// One connection to Redis, a command at a time.
struct RedisClient {
    stream: TcpStream,
}

impl RedisClient {
    async fn connect(addr: SocketAddr) -> Option<Self> {
        TcpStream::connect(addr)
            .await
            .ok()
            .map(|stream| RedisClient { stream })
    }

    async fn command(&mut self, args: &[&str]) -> Resp {
        let mut out = format!("*{}\r\n", args.len()).into_bytes();
        for arg in args {
            out.extend_from_slice(format!("${}\r\n{arg}\r\n", arg.len()).as_bytes());
        }
        self.stream.write_all(&out).await.expect("writing to Redis");
        let mut buf = Vec::new();
        loop {
            if let Some((reply, _)) = (!buf.is_empty()).then(|| Resp::parse(&buf)).flatten() {
                return reply;
            }
            let mut chunk = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut chunk))
                .await
                .expect("Redis answered within 5 s")
                .expect("reading from Redis");
            assert!(n > 0, "Redis closed the connection mid-reply");
            buf.extend_from_slice(&chunk[..n]);
        }
    }
}

// === the rate-limit service ===

/// `envoyproxy/ratelimit` on 127.0.0.1 with the config a test gives, counting in `redis`,
/// every call counted there (its own over-limit cache off). Killed on drop.
pub struct RateLimitService {
    /// Its gRPC listener: the sidecar's `global_rate_limit.service`.
    pub grpc: SocketAddr,
    /// Its HTTP listener (`/healthcheck`, `/json`).
    pub http: SocketAddr,
    debug: SocketAddr,
    bin: PathBuf,
    redis: SocketAddr,
    child: Option<tokio::process::Child>,
    /// Its runtime root: `ratelimit/config/*.yaml` (the config), `service.log` (its output).
    dir: TempDir,
}

impl RateLimitService {
    /// Starts `bin` with `config` (one domain's YAML) and waits until it answers.
    pub async fn start(bin: &Path, redis: &Redis, config: &str) -> Self {
        let mut dir = TempDir::new();
        let config_dir = dir.path.join("ratelimit").join("config");
        std::fs::create_dir_all(&config_dir).unwrap();
        std::fs::write(config_dir.join("egress.yaml"), config).unwrap();
        for _ in 0..10 {
            let mut service = RateLimitService {
                grpc: SocketAddr::from(([127, 0, 0, 1], free_port())),
                http: SocketAddr::from(([127, 0, 0, 1], free_port())),
                debug: SocketAddr::from(([127, 0, 0, 1], free_port())),
                bin: bin.to_owned(),
                redis: redis.addr,
                child: None,
                dir,
            };
            match service.spawn().await {
                Ok(()) => return service,
                Err(log) if bind_clash(&log) => dir = service.take_dir(),
                Err(log) => panic!("the rate-limit service did not start:\n{log}"),
            }
        }
        panic!("the rate-limit service found no free ports in 10 tries");
    }

    /// `http://` and its gRPC address.
    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// Kills the service (SIGKILL: its connections drop at once) and waits for it to exit.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().await.expect("killing the rate-limit service");
        }
    }

    /// Starts it again on the same ports and waits until it answers.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "restart after kill");
        if let Err(log) = self.spawn().await {
            panic!(
                "the rate-limit service did not start again on {}:\n{log}",
                self.grpc
            );
        }
    }

    /// What it printed so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path.join("service.log")).unwrap_or_default()
    }

    /// One `ShouldRateLimit` through its HTTP `/json` endpoint (the same service code as the
    /// gRPC one): `descriptors` is the request's JSON array. Returns its JSON answer.
    pub async fn should_rate_limit_json(&self, descriptors: serde_json::Value) -> serde_json::Value {
        let body = serde_json::json!({ "domain": DOMAIN, "descriptors": descriptors }).to_string();
        let (status, text) = http_exchange(
            self.http,
            &format!(
                "POST /json HTTP/1.1\r\nHost: ratelimit\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        )
        .await
        .expect("the service's HTTP listener answers");
        // It answers 429 with the same JSON when over the limit.
        assert!(status == 200 || status == 429, "/json: {status} {text}");
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("/json answered {text:?}: {e}"))
    }

    fn take_dir(self) -> TempDir {
        let RateLimitService { dir, .. } = self;
        dir
    }

    /// Spawns the process and waits (10 s at most) until its HTTP health check answers 200
    /// and its gRPC port takes connections; its log when it exits first or never does.
    async fn spawn(&mut self) -> Result<(), String> {
        let log_path = self.dir.path.join("service.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .unwrap();
        let port = |a: SocketAddr| a.port().to_string();
        let mut child = tokio::process::Command::new(&self.bin)
            .current_dir(&self.dir.path)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            // Its defaults listen on every address, send statsd and expect Redis on a socket.
            .env("USE_STATSD", "false")
            .env("REDIS_SOCKET_TYPE", "tcp")
            .env("REDIS_URL", self.redis.to_string())
            .env("RUNTIME_ROOT", &self.dir.path)
            .env("RUNTIME_SUBDIRECTORY", "ratelimit")
            .env("RUNTIME_APPDIRECTORY", "config")
            .env("RUNTIME_WATCH_ROOT", "false")
            .env("HOST", "127.0.0.1")
            .env("PORT", port(self.http))
            .env("GRPC_HOST", "127.0.0.1")
            .env("GRPC_PORT", port(self.grpc))
            .env("DEBUG_HOST", "127.0.0.1")
            .env("DEBUG_PORT", port(self.debug))
            // Off (its default, said so): with it the service would answer a key it saw over
            // the limit from memory without counting in Redis, and the tests count there.
            .env("LOCAL_CACHE_SIZE_IN_BYTES", "0")
            .env("LIMIT_RESPONSE_HEADERS_ENABLED", "true")
            .env("LOG_LEVEL", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("starting the rate-limit service");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                let logged = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!("(exited: {status})\n{logged}"));
            }
            let healthy = matches!(
                http_exchange(
                    self.http,
                    "GET /healthcheck HTTP/1.1\r\nHost: ratelimit\r\nConnection: close\r\n\r\n"
                )
                .await,
                Some((200, _))
            );
            if healthy && TcpStream::connect(self.grpc).await.is_ok() {
                // A port taken by another process would have made ours exit by now.
                tokio::time::sleep(Duration::from_millis(50)).await;
                if child.try_wait().unwrap().is_none() {
                    self.child = Some(child);
                    return Ok(());
                }
                continue;
            }
            if tokio::time::Instant::now() > deadline {
                let logged = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(format!("(no answer in 10 s)\n{logged}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One HTTP/1.1 exchange that ends with the connection: the status and the body (`None` when
/// nothing answers).
pub async fn http_exchange(addr: SocketAddr, request: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&raw);
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    Some((status, body))
}

// === a slow path to the service ===

/// A TCP proxy on 127.0.0.1:0 to `target` that holds every chunk `delay` before forwarding
/// it, both ways: a service that answers slowly.
pub struct SlowProxy {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl SlowProxy {
    pub async fn start(target: SocketAddr, delay: Duration) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let Ok(outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    let (in_r, in_w) = inbound.into_split();
                    let (out_r, out_w) = outbound.into_split();
                    tokio::join!(slow_copy(in_r, out_w, delay), slow_copy(out_r, in_w, delay));
                });
            }
        });
        SlowProxy { addr, task }
    }

    /// `http://` and its address.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read (chunks stay in order; the
/// reading goes on meanwhile, so the delay does not add up along a stream).
async fn slow_copy(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx
                        .send((tokio::time::Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            // The delay is the scenario: a service far away or overloaded.
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

// === the service's windows ===

/// The service counts in fixed calendar windows (a `minute` limit's counter starts on the
/// minute). A test that needs `needs` inside one window calls this first: when fewer than
/// `needs` + 5 s are left of the current minute, it sleeps into the next one. Returns the
/// window's start (Unix seconds).
pub async fn fresh_window(needs: Duration) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let into = Duration::from_millis((now.as_millis() % 60_000) as u64);
    let left = Duration::from_secs(60) - into;
    if left < needs + Duration::from_secs(5) {
        // Just past the minute, so the service's clock (the same one) has turned too.
        tokio::time::sleep(left + Duration::from_millis(200)).await;
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    now - now % 60
}
