//! Configuration: the YAML schema users write, and the validated [`Config`] the rest of the
//! crate reads.
//!
//! The file structs (`File*`) mirror the YAML one to one, reject unknown keys, and keep every
//! value loose (durations and sizes as strings) so that validation can report *every* problem at
//! once, each naming its key. [`Config`] is what comes out: typed, defaults filled in, and
//! cross-field rules checked (`max_idle <= max_connections`, unique listen addresses, ...).
//! Precedence is flags > environment > file > built-in defaults; `main` folds flags and
//! environment into [`Overrides`] before calling [`load`].
//!
//! Not handled here: how a request picks an upstream (`routing`) or what the pool does with its
//! settings (`pool`).

mod host;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde::{Deserialize, Serialize, Serializer};

pub use host::{canonical_host, HostPattern};
pub(crate) use host::{canonical_ip, in_network};

/// Forward-proxy listener when nothing else is configured.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:15080";
/// Admin listener when nothing else is configured.
pub const DEFAULT_ADMIN: &str = "127.0.0.1:15081";
/// A client keep-alive connection idle this long is closed.
pub const DEFAULT_DOWNSTREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// A request head must arrive within this.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Downstream connections served at once; more wait in the accept backlog.
pub const DEFAULT_DOWNSTREAM_MAX_CONNECTIONS: usize = 10_000;
/// Upper bound on `downstream.max_connections`.
const MAX_DOWNSTREAM_CONNECTIONS: usize = 1_000_000;
/// Idle keep-alive application connections kept: a healthy application keeps a few per host
/// in its pool, a leaking one thousands; at ~1.6 KB each this bounds idle memory to ~1.6 MiB.
pub const DEFAULT_MAX_IDLE_DOWNSTREAM: usize = 1024;
/// Idle timeout for connections from a source the leak detector flags: its connections are
/// never reused, so holding them is pure cost.
pub const DEFAULT_LEAKY_IDLE_TIMEOUT: Duration = Duration::from_secs(1);
/// Largest request head accepted.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// Time allowed for TCP connect (and, later, TLS handshake) to an upstream.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Hard cap on open connections per upstream.
pub const DEFAULT_POOL_MAX_CONNECTIONS: usize = 64;
/// Idle connections kept per upstream.
pub const DEFAULT_POOL_MAX_IDLE: usize = 32;
/// A pooled connection idle this long is closed.
pub const DEFAULT_POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// A pooled connection older than this is closed once idle.
pub const DEFAULT_POOL_MAX_LIFETIME: Duration = Duration::from_secs(600);
/// Requests allowed to wait for a connection per upstream.
pub const DEFAULT_POOL_MAX_PENDING: usize = 1024;
/// How long a request may wait for a connection.
pub const DEFAULT_POOL_PENDING_TIMEOUT: Duration = Duration::from_secs(5);
/// Dials in flight per upstream, so that a burst does not become a dial storm.
pub const DEFAULT_POOL_MAX_CONNECTING: usize = 8;
/// Upper bound on concurrent streams per HTTP/2 connection.
pub const DEFAULT_H2_MAX_STREAMS: u32 = 100;
/// HTTP/2 PING interval while streams are open.
pub const DEFAULT_H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long to wait for a PING acknowledgement.
pub const DEFAULT_H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to keep serving after SIGTERM.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(8);
/// Share of the container's memory limit the sidecar keeps its footprint under: the rest is
/// headroom for what it cannot shed at once (requests in flight, the kernel's socket buffers).
pub const DEFAULT_BUDGET_MEMORY_FRACTION: f64 = 0.8;
/// Smallest explicit budget accepted: below it the sidecar could not hold its own start-up
/// footprint and would stop accepting for good.
const MIN_BUDGET_BYTES: usize = 8 << 20;

// === file schema ===

/// A duration or size as written: `10s`, `64KiB`, or a bare number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Scalar {
    Int(u64),
    Str(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileConfig {
    listen: Option<String>,
    listen_unix: Option<String>,
    admin: Option<String>,
    downstream: FileDownstream,
    defaults: FileSettings,
    upstreams: Vec<FileUpstream>,
    policy: FilePolicy,
    shutdown: FileShutdown,
    budget: FileBudget,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileDownstream {
    idle_timeout: Option<Scalar>,
    header_read_timeout: Option<Scalar>,
    max_connections: Option<u64>,
    max_header_bytes: Option<Scalar>,
    max_idle_connections: Option<u64>,
    leaky_idle_timeout: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileSettings {
    protocol: Option<String>,
    connect_timeout: Option<Scalar>,
    response_header_timeout: Option<Scalar>,
    pool: FilePool,
    http2: FileHttp2,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FilePool {
    max_connections: Option<u64>,
    max_idle: Option<u64>,
    idle_timeout: Option<Scalar>,
    max_lifetime: Option<Scalar>,
    max_requests_per_connection: Option<u64>,
    max_pending: Option<u64>,
    pending_timeout: Option<Scalar>,
    max_connecting: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileHttp2 {
    max_streams_per_connection: Option<u64>,
    keepalive_interval: Option<Scalar>,
    keepalive_timeout: Option<Scalar>,
}

// serde's `flatten` does not combine with `deny_unknown_fields`, so the per-upstream overrides
// repeat the keys of `FileSettings`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileUpstream {
    name: Option<String>,
    url: Option<String>,
    aliases: Vec<String>,
    listen: Option<String>,
    addresses: Vec<String>,
    tls: FileTls,
    protocol: Option<String>,
    connect_timeout: Option<Scalar>,
    response_header_timeout: Option<Scalar>,
    pool: FilePool,
    http2: FileHttp2,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileTls {
    ca_file: Option<PathBuf>,
    server_name: Option<String>,
    insecure_skip_verify: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FilePolicy {
    allow_hosts: Vec<String>,
    deny_hosts: Vec<String>,
    connect: Option<bool>,
    connect_ports: Option<Vec<u64>>,
    deny_private: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileShutdown {
    drain_timeout: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileBudget {
    enabled: Option<bool>,
    memory_fraction: Option<f64>,
    memory_bytes: Option<Scalar>,
}

// === validated config ===

/// The validated configuration: every key present, every value typed.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// Forward-proxy listener.
    pub listen: SocketAddr,
    /// Forward-proxy listener on a Unix socket, next to `listen`; none by default.
    pub listen_unix: Option<PathBuf>,
    /// Admin listener.
    pub admin: SocketAddr,
    /// Connections from the application.
    pub downstream: DownstreamConfig,
    /// Settings for every upstream not overriding them.
    pub defaults: UpstreamSettings,
    /// Configured upstreams.
    pub upstreams: Vec<UpstreamConfig>,
    /// Egress allow/deny rules.
    pub policy: PolicyConfig,
    /// Drain behaviour.
    pub shutdown: ShutdownConfig,
    /// The memory budget.
    pub budget: BudgetConfig,
    /// Hosts whose plain-HTTP requests are sent upstream over TLS (`EGRESS_TLS_HOSTS`); not a
    /// file key, so `check` prints it as a comment.
    #[serde(skip)]
    pub tls_hosts: Vec<String>,
}

/// Connections from the application.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct DownstreamConfig {
    /// Close a keep-alive connection idle this long.
    #[serde(serialize_with = "ser_duration")]
    pub idle_timeout: Duration,
    /// A request head must arrive within this.
    #[serde(serialize_with = "ser_duration")]
    pub header_read_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// Largest request head accepted.
    #[serde(serialize_with = "ser_size")]
    pub max_header_bytes: usize,
    /// Idle keep-alive connections kept; beyond it the longest idle is closed first.
    pub max_idle_connections: usize,
    /// Idle timeout for connections from a source the leak detector flags (at most
    /// `idle_timeout`).
    #[serde(serialize_with = "ser_duration")]
    pub leaky_idle_timeout: Duration,
}

/// Which HTTP version to speak upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// ALPN on TLS, HTTP/1.1 on plain TCP.
    Auto,
    /// Always HTTP/1.1.
    Http1,
    /// Always HTTP/2 (h2c with prior knowledge on plain TCP).
    Http2,
}

/// Per-upstream settings: `defaults`, or an upstream with its overrides applied.
#[derive(Debug, Clone, Serialize)]
pub struct UpstreamSettings {
    /// HTTP version upstream.
    pub protocol: Protocol,
    /// TCP connect deadline.
    #[serde(serialize_with = "ser_duration")]
    pub connect_timeout: Duration,
    /// Deadline for the response head once the request is sent; `None` = wait forever.
    #[serde(serialize_with = "ser_opt_duration")]
    pub response_header_timeout: Option<Duration>,
    /// Pool knobs.
    pub pool: PoolConfig,
    /// HTTP/2 knobs.
    pub http2: Http2Config,
}

/// The pool knobs of one upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolConfig {
    /// Hard cap on open (connecting + active + idle) connections.
    pub max_connections: usize,
    /// Idle connections kept.
    pub max_idle: usize,
    /// Close a pooled connection idle this long.
    #[serde(serialize_with = "ser_duration")]
    pub idle_timeout: Duration,
    /// Close a connection older than this once idle; `None` = never.
    #[serde(serialize_with = "ser_opt_duration")]
    pub max_lifetime: Option<Duration>,
    /// Retire a connection after this many requests; `None` = unlimited.
    #[serde(serialize_with = "ser_opt_count")]
    pub max_requests_per_connection: Option<u64>,
    /// Requests allowed to wait for a connection.
    pub max_pending: usize,
    /// How long a request may wait for a connection.
    #[serde(serialize_with = "ser_duration")]
    pub pending_timeout: Duration,
    /// Dials in flight at once.
    pub max_connecting: usize,
}

/// HTTP/2 knobs of one upstream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Http2Config {
    /// Upper bound on concurrent streams per connection.
    pub max_streams_per_connection: u32,
    /// PING interval while streams are open; `None` = off.
    #[serde(serialize_with = "ser_opt_duration")]
    pub keepalive_interval: Option<Duration>,
    /// PING acknowledgement deadline.
    #[serde(serialize_with = "ser_duration")]
    pub keepalive_timeout: Duration,
}

/// `http` or `https` towards an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// Plain TCP.
    Http,
    /// TLS originated by the sidecar.
    Https,
}

impl Scheme {
    /// The port a URL of this scheme means when it names none.
    pub fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }

    /// `http` or `https`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::Http => "http",
            Scheme::Https => "https",
        }
    }
}

/// A host and port, the key under which requests find an upstream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Authority {
    /// Lower-cased host name or IP literal (IPv6 without brackets).
    pub host: String,
    /// Port.
    pub port: u16,
}

impl Authority {
    /// Parses `host[:port]`, lower-casing the host; `default_port` fills a missing port.
    pub fn parse(text: &str, default_port: u16) -> Result<Self, String> {
        let auth: http::uri::Authority = text
            .parse()
            .map_err(|e| format!("{text:?} is not a host[:port]: {e}"))?;
        if text.contains('@') {
            return Err(format!("{text:?} must not carry user information"));
        }
        let host = canonical_host(auth.host()).map_err(|why| format!("{text:?}: {why}"))?;
        let port = match auth.port() {
            Some(p) => p
                .as_str()
                .parse::<u16>()
                .map_err(|_| format!("{text:?} has an invalid port"))?,
            None => default_port,
        };
        if port == 0 {
            return Err(format!("{text:?} has port 0"));
        }
        Ok(Authority { host, port })
    }
}

impl fmt::Display for Authority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

impl Serialize for Authority {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// TLS settings towards one upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize)]
pub struct TlsConfig {
    /// Extra CA bundle (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// SNI and verification name; defaults to the url host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// Skip certificate verification (testing only).
    pub insecure_skip_verify: bool,
}

/// One configured upstream.
#[derive(Debug, Clone, Serialize)]
pub struct UpstreamConfig {
    /// Label in metrics and logs.
    pub name: String,
    /// `scheme://host:port` as normalised from the file.
    pub url: String,
    /// Whether the sidecar originates TLS.
    #[serde(skip)]
    pub scheme: Scheme,
    /// Host and port from `url`: the upstream's own authority.
    #[serde(skip)]
    pub authority: Authority,
    /// Other authorities that mean this upstream.
    pub aliases: Vec<Authority>,
    /// Route-mode listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// Static endpoints instead of DNS.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<SocketAddr>,
    /// TLS settings (used when `scheme` is https).
    pub tls: TlsConfig,
    /// Settings with this upstream's overrides applied.
    #[serde(flatten)]
    pub settings: UpstreamSettings,
}

/// Egress allow/deny rules.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyConfig {
    /// Empty = any host; else only these.
    pub allow_hosts: Vec<HostPattern>,
    /// Checked first.
    pub deny_hosts: Vec<HostPattern>,
    /// Allow CONNECT tunnels.
    pub connect: bool,
    /// Ports CONNECT may reach.
    pub connect_ports: Vec<u16>,
    /// Refuse loopback, private, link-local (cloud metadata) and other special-purpose
    /// addresses unless `allow_hosts` lists them (`policy::special_range`).
    pub deny_private: bool,
}

/// Drain behaviour.
#[derive(Debug, Clone, Serialize)]
pub struct ShutdownConfig {
    /// Keep serving this long after SIGTERM.
    #[serde(serialize_with = "ser_duration")]
    pub drain_timeout: Duration,
}

/// The memory budget (`budget`): where its size comes from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BudgetConfig {
    /// Whether there is a budget at all.
    pub enabled: bool,
    /// Share of the cgroup memory limit used as the budget.
    pub memory_fraction: f64,
    /// An explicit budget in bytes instead of one from the cgroup; 0 = from the cgroup.
    #[serde(serialize_with = "ser_opt_size")]
    pub memory_bytes: Option<usize>,
}

/// Values from flags and environment variables, which win over the file.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    /// `--listen` / `EGRESS_LISTEN`.
    pub listen: Option<String>,
    /// `--listen-unix` / `EGRESS_LISTEN_UNIX`; empty turns off the file's `listen_unix`.
    pub listen_unix: Option<String>,
    /// `--admin` / `EGRESS_ADMIN`.
    pub admin: Option<String>,
    /// `EGRESS_TLS_HOSTS`, comma separated.
    pub tls_hosts: Option<String>,
}

/// One thing wrong with a config, naming its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// Dotted key path, e.g. `upstreams[0].pool.max_idle`.
    pub key: String,
    /// Why the value is rejected.
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.reason)
    }
}

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("config: cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The values are wrong; one entry per problem.
    #[error("{}", display_problems(.0))]
    Invalid(Vec<Problem>),
}

fn display_problems(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("config: {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Default for Config {
    fn default() -> Self {
        validate(FileConfig::default(), &Overrides::default()).expect("built-in defaults are valid")
    }
}

/// Loads, merges and validates: file (if any), then `overrides`.
pub fn load(path: Option<&Path>, overrides: &Overrides) -> Result<Config, ConfigError> {
    let text = match path {
        Some(path) => std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?,
        None => String::new(),
    };
    parse(&text, overrides)
}

/// Parses and validates YAML text (empty text = all defaults).
pub fn parse(text: &str, overrides: &Overrides) -> Result<Config, ConfigError> {
    let file = if text.trim().is_empty() {
        FileConfig::default()
    } else {
        let de = serde_norway::Deserializer::from_str(text);
        serde_path_to_error::deserialize::<_, FileConfig>(de).map_err(|err| {
            let key = err.path().to_string();
            let key = if key == "." { "(top level)".into() } else { key };
            ConfigError::Invalid(vec![Problem {
                key,
                reason: err.into_inner().to_string(),
            }])
        })?
    };
    validate(file, overrides)
}

/// Renders the effective config as YAML, for `check`.
pub fn to_yaml(config: &Config) -> String {
    let mut out = serde_norway::to_string(config).unwrap_or_else(|e| format!("# cannot render: {e}\n"));
    if !config.tls_hosts.is_empty() {
        out.push_str(&format!("# EGRESS_TLS_HOSTS: {}\n", config.tls_hosts.join(",")));
    }
    out
}

/// Parses a PEM bundle of CA certificates. Validation checks `tls.ca_file` with it and TLS
/// loads its trust anchors with it, so a file `check` accepts is one every dial can use.
pub fn load_ca_file(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: not a PEM certificate bundle: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificates in it", path.display()));
    }
    Ok(certs)
}

// === validation ===

#[derive(Default)]
struct Problems(Vec<Problem>);

impl Problems {
    fn add(&mut self, key: impl Into<String>, reason: impl Into<String>) {
        self.0.push(Problem {
            key: key.into(),
            reason: reason.into(),
        });
    }

    /// Unwraps a parse result, recording the error against `key` and falling back to `fallback`.
    fn take<T>(&mut self, key: &str, result: Result<T, String>, fallback: T) -> T {
        result.unwrap_or_else(|reason| {
            self.add(key, reason);
            fallback
        })
    }
}

fn validate(file: FileConfig, overrides: &Overrides) -> Result<Config, ConfigError> {
    let mut problems = Problems::default();

    let listen_text = overrides.listen.as_deref().or(file.listen.as_deref());
    let listen = problems.take(
        "listen",
        parse_addr(listen_text.unwrap_or(DEFAULT_LISTEN)),
        DEFAULT_LISTEN.parse().expect("valid default"),
    );
    let listen_unix = match overrides.listen_unix.as_deref().or(file.listen_unix.as_deref()) {
        None | Some("") => None,
        Some(path) => problems.take("listen_unix", parse_unix_path(path).map(Some), None),
    };
    let admin_text = overrides.admin.as_deref().or(file.admin.as_deref());
    let admin = problems.take(
        "admin",
        parse_addr(admin_text.unwrap_or(DEFAULT_ADMIN)),
        DEFAULT_ADMIN.parse().expect("valid default"),
    );

    let downstream = validate_downstream(&file.downstream, &mut problems);
    let builtin = builtin_settings();
    let defaults = merge_settings(
        &builtin,
        SettingsRef::from_defaults(&file.defaults),
        "defaults",
        &mut problems,
    );

    let mut upstreams = Vec::with_capacity(file.upstreams.len());
    for (i, raw) in file.upstreams.iter().enumerate() {
        if let Some(up) = validate_upstream(i, raw, &defaults, &mut problems) {
            upstreams.push(up);
        }
    }
    check_upstream_uniqueness(&upstreams, listen, admin, &mut problems);
    if listen == admin && listen.port() != 0 {
        problems.add(
            "admin",
            format!("{admin} is also the forward-proxy listen address"),
        );
    }

    let policy = validate_policy(&file.policy, &mut problems);
    let drain_timeout = duration_or(
        &file.shutdown.drain_timeout,
        DEFAULT_DRAIN_TIMEOUT,
        "shutdown.drain_timeout",
        &mut problems,
    );
    let tls_hosts = parse_tls_hosts(overrides.tls_hosts.as_deref(), &mut problems);
    let budget = validate_budget(&file.budget, &mut problems);

    if !problems.0.is_empty() {
        return Err(ConfigError::Invalid(problems.0));
    }
    Ok(Config {
        listen,
        listen_unix,
        admin,
        downstream,
        defaults,
        upstreams,
        policy,
        shutdown: ShutdownConfig { drain_timeout },
        budget,
        tls_hosts,
    })
}

fn validate_budget(raw: &FileBudget, problems: &mut Problems) -> BudgetConfig {
    let memory_fraction = raw.memory_fraction.unwrap_or(DEFAULT_BUDGET_MEMORY_FRACTION);
    if !(memory_fraction > 0.0 && memory_fraction <= 1.0) {
        problems.add(
            "budget.memory_fraction",
            format!("{memory_fraction} is outside (0, 1]: it is the share of the memory limit to stay under"),
        );
    }
    let memory_bytes = match &raw.memory_bytes {
        Some(v) => problems.take("budget.memory_bytes", parse_size(v), 0),
        None => 0,
    };
    if memory_bytes != 0 && memory_bytes < MIN_BUDGET_BYTES {
        problems.add(
            "budget.memory_bytes",
            format!(
                "{memory_bytes} bytes is under 8MiB, too little for the sidecar and a few hundred connections (0 = take the budget from the cgroup limit)"
            ),
        );
    }
    BudgetConfig {
        enabled: raw.enabled.unwrap_or(true),
        memory_fraction,
        memory_bytes: (memory_bytes != 0).then_some(memory_bytes),
    }
}

fn validate_downstream(raw: &FileDownstream, problems: &mut Problems) -> DownstreamConfig {
    let max_connections = raw
        .max_connections
        .map(|n| n as usize)
        .unwrap_or(DEFAULT_DOWNSTREAM_MAX_CONNECTIONS);
    if !(1..=MAX_DOWNSTREAM_CONNECTIONS).contains(&max_connections) {
        problems.add(
            "downstream.max_connections",
            format!("{max_connections} is outside 1..={MAX_DOWNSTREAM_CONNECTIONS}"),
        );
    }
    let max_header_bytes = match &raw.max_header_bytes {
        Some(v) => problems.take(
            "downstream.max_header_bytes",
            parse_size(v),
            DEFAULT_MAX_HEADER_BYTES,
        ),
        None => DEFAULT_MAX_HEADER_BYTES,
    };
    if !(1024..=(16 << 20)).contains(&max_header_bytes) {
        problems.add(
            "downstream.max_header_bytes",
            format!("{max_header_bytes} bytes is outside 1KiB..16MiB"),
        );
    }
    let max_idle_connections = raw
        .max_idle_connections
        .map(|n| n as usize)
        .unwrap_or(DEFAULT_MAX_IDLE_DOWNSTREAM);
    if !(1..=MAX_DOWNSTREAM_CONNECTIONS).contains(&max_idle_connections) {
        problems.add(
            "downstream.max_idle_connections",
            format!("{max_idle_connections} is outside 1..={MAX_DOWNSTREAM_CONNECTIONS}"),
        );
    }
    let idle_timeout = duration_or(
        &raw.idle_timeout,
        DEFAULT_DOWNSTREAM_IDLE_TIMEOUT,
        "downstream.idle_timeout",
        problems,
    );
    let header_read_timeout = duration_or(
        &raw.header_read_timeout,
        DEFAULT_HEADER_READ_TIMEOUT,
        "downstream.header_read_timeout",
        problems,
    );
    let leaky_idle_timeout = duration_or(
        &raw.leaky_idle_timeout,
        DEFAULT_LEAKY_IDLE_TIMEOUT,
        "downstream.leaky_idle_timeout",
        problems,
    );
    for (key, value) in [
        ("downstream.idle_timeout", idle_timeout),
        ("downstream.header_read_timeout", header_read_timeout),
        ("downstream.leaky_idle_timeout", leaky_idle_timeout),
    ] {
        if value.is_zero() {
            problems.add(key, "must be more than 0");
        }
    }
    DownstreamConfig {
        idle_timeout,
        header_read_timeout,
        max_connections,
        max_header_bytes,
        max_idle_connections,
        leaky_idle_timeout,
    }
}

fn builtin_settings() -> UpstreamSettings {
    UpstreamSettings {
        protocol: Protocol::Auto,
        connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        response_header_timeout: None,
        pool: PoolConfig {
            max_connections: DEFAULT_POOL_MAX_CONNECTIONS,
            max_idle: DEFAULT_POOL_MAX_IDLE,
            idle_timeout: DEFAULT_POOL_IDLE_TIMEOUT,
            max_lifetime: Some(DEFAULT_POOL_MAX_LIFETIME),
            max_requests_per_connection: None,
            max_pending: DEFAULT_POOL_MAX_PENDING,
            pending_timeout: DEFAULT_POOL_PENDING_TIMEOUT,
            max_connecting: DEFAULT_POOL_MAX_CONNECTING,
        },
        http2: Http2Config {
            max_streams_per_connection: DEFAULT_H2_MAX_STREAMS,
            keepalive_interval: Some(DEFAULT_H2_KEEPALIVE_INTERVAL),
            keepalive_timeout: DEFAULT_H2_KEEPALIVE_TIMEOUT,
        },
    }
}

/// The settings keys as they appear both under `defaults` and on an upstream.
struct SettingsRef<'a> {
    protocol: &'a Option<String>,
    connect_timeout: &'a Option<Scalar>,
    response_header_timeout: &'a Option<Scalar>,
    pool: &'a FilePool,
    http2: &'a FileHttp2,
}

impl<'a> SettingsRef<'a> {
    fn from_defaults(raw: &'a FileSettings) -> Self {
        SettingsRef {
            protocol: &raw.protocol,
            connect_timeout: &raw.connect_timeout,
            response_header_timeout: &raw.response_header_timeout,
            pool: &raw.pool,
            http2: &raw.http2,
        }
    }

    fn from_upstream(raw: &'a FileUpstream) -> Self {
        SettingsRef {
            protocol: &raw.protocol,
            connect_timeout: &raw.connect_timeout,
            response_header_timeout: &raw.response_header_timeout,
            pool: &raw.pool,
            http2: &raw.http2,
        }
    }
}

/// Applies the keys present in `raw` over `base`; `prefix` names the section in problems.
fn merge_settings(
    base: &UpstreamSettings,
    raw: SettingsRef<'_>,
    prefix: &str,
    problems: &mut Problems,
) -> UpstreamSettings {
    let key = |k: &str| format!("{prefix}.{k}");
    let protocol = match raw.protocol.as_deref() {
        None => base.protocol,
        Some("auto") => Protocol::Auto,
        Some("http1") => Protocol::Http1,
        Some("http2") => Protocol::Http2,
        Some(other) => {
            problems.add(
                key("protocol"),
                format!("{other:?} is not one of auto, http1, http2"),
            );
            base.protocol
        }
    };
    let connect_timeout = duration_or(
        raw.connect_timeout,
        base.connect_timeout,
        &key("connect_timeout"),
        problems,
    );
    if connect_timeout.is_zero() {
        problems.add(key("connect_timeout"), "must be more than 0");
    }
    let response_header_timeout = opt_duration_or(
        raw.response_header_timeout,
        base.response_header_timeout,
        &key("response_header_timeout"),
        problems,
    );
    let pool = merge_pool(&base.pool, raw.pool, &key("pool"), problems);
    let http2 = merge_http2(&base.http2, raw.http2, &key("http2"), problems);
    UpstreamSettings {
        protocol,
        connect_timeout,
        response_header_timeout,
        pool,
        http2,
    }
}

fn merge_pool(base: &PoolConfig, raw: &FilePool, prefix: &str, problems: &mut Problems) -> PoolConfig {
    let key = |k: &str| format!("{prefix}.{k}");
    let mut pool = PoolConfig {
        max_connections: raw.max_connections.map_or(base.max_connections, |n| n as usize),
        max_idle: raw.max_idle.map_or(base.max_idle, |n| n as usize),
        idle_timeout: duration_or(
            &raw.idle_timeout,
            base.idle_timeout,
            &key("idle_timeout"),
            problems,
        ),
        max_lifetime: opt_duration_or(
            &raw.max_lifetime,
            base.max_lifetime,
            &key("max_lifetime"),
            problems,
        ),
        max_requests_per_connection: match raw.max_requests_per_connection {
            None => base.max_requests_per_connection,
            Some(0) => None,
            Some(n) => Some(n),
        },
        max_pending: raw.max_pending.map_or(base.max_pending, |n| n as usize),
        pending_timeout: duration_or(
            &raw.pending_timeout,
            base.pending_timeout,
            &key("pending_timeout"),
            problems,
        ),
        max_connecting: raw.max_connecting.map_or(base.max_connecting, |n| n as usize),
    };
    if pool.max_connections == 0 {
        problems.add(key("max_connections"), "must be at least 1");
    }
    if raw.max_idle.is_none() {
        // An inherited max_idle follows a lowered cap: `pool: { max_connections: 8 }` alone is
        // a complete, valid override.
        pool.max_idle = pool.max_idle.min(pool.max_connections);
    }
    if pool.max_idle > pool.max_connections {
        problems.add(
            key("max_idle"),
            format!(
                "{} is more than {} ({})",
                pool.max_idle,
                key("max_connections"),
                pool.max_connections
            ),
        );
    }
    if pool.max_connecting == 0 {
        problems.add(key("max_connecting"), "must be at least 1");
    }
    if pool.idle_timeout.is_zero() {
        problems.add(
            key("idle_timeout"),
            "must be more than 0 (use max_idle: 0 to keep none)",
        );
    }
    if pool.pending_timeout.is_zero() {
        problems.add(key("pending_timeout"), "must be more than 0");
    }
    pool
}

fn merge_http2(base: &Http2Config, raw: &FileHttp2, prefix: &str, problems: &mut Problems) -> Http2Config {
    let key = |k: &str| format!("{prefix}.{k}");
    let max_streams = raw
        .max_streams_per_connection
        .map_or(u64::from(base.max_streams_per_connection), |n| n);
    if max_streams == 0 || max_streams > u64::from(u32::MAX >> 1) {
        problems.add(
            key("max_streams_per_connection"),
            format!("{max_streams} is outside 1..2^31"),
        );
    }
    Http2Config {
        max_streams_per_connection: max_streams.clamp(1, u64::from(u32::MAX >> 1)) as u32,
        keepalive_interval: opt_duration_or(
            &raw.keepalive_interval,
            base.keepalive_interval,
            &key("keepalive_interval"),
            problems,
        ),
        keepalive_timeout: duration_or(
            &raw.keepalive_timeout,
            base.keepalive_timeout,
            &key("keepalive_timeout"),
            problems,
        ),
    }
}

fn validate_upstream(
    index: usize,
    raw: &FileUpstream,
    defaults: &UpstreamSettings,
    problems: &mut Problems,
) -> Option<UpstreamConfig> {
    let prefix = format!("upstreams[{index}]");
    let key = |k: &str| format!("{prefix}.{k}");
    let (scheme, authority) = match raw.url.as_deref() {
        None => {
            problems.add(key("url"), "is required (e.g. https://api.example.com)");
            return None;
        }
        Some(url) => match parse_upstream_url(url) {
            Ok(parsed) => parsed,
            Err(reason) => {
                problems.add(key("url"), reason);
                return None;
            }
        },
    };
    let name = raw.name.clone().unwrap_or_else(|| authority.to_string());
    if name.is_empty() || name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        problems.add(key("name"), format!("{name:?} must be non-empty without spaces"));
    }
    let aliases = raw
        .aliases
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            Authority::parse(a, 80)
                .map_err(|reason| problems.add(format!("{prefix}.aliases[{i}]"), reason))
                .ok()
        })
        .collect();
    let listen = raw.listen.as_deref().and_then(|l| {
        parse_addr(l)
            .map_err(|reason| problems.add(key("listen"), reason))
            .ok()
    });
    let addresses = raw
        .addresses
        .iter()
        .enumerate()
        .filter_map(|(i, a)| {
            a.parse::<SocketAddr>()
                .map_err(|_| {
                    problems.add(
                        format!("{prefix}.addresses[{i}]"),
                        format!("{a:?} is not an ip:port"),
                    )
                })
                .ok()
        })
        .collect();
    let tls = TlsConfig {
        ca_file: raw.tls.ca_file.clone(),
        server_name: raw.tls.server_name.clone(),
        insecure_skip_verify: raw.tls.insecure_skip_verify.unwrap_or(false),
    };
    if let Some(ca) = &tls.ca_file {
        if let Err(why) = load_ca_file(ca) {
            problems.add(key("tls.ca_file"), why);
        }
    }
    if let Some(name) = &tls.server_name {
        if rustls::pki_types::ServerName::try_from(name.as_str()).is_err() {
            problems.add(
                key("tls.server_name"),
                format!("{name:?} is not a DNS name or IP address"),
            );
        }
    }
    let settings = merge_settings(defaults, SettingsRef::from_upstream(raw), &prefix, problems);
    Some(UpstreamConfig {
        name,
        url: format!("{}://{authority}", scheme.as_str()),
        scheme,
        authority,
        aliases,
        listen,
        addresses,
        tls,
        settings,
    })
}

fn check_upstream_uniqueness(
    upstreams: &[UpstreamConfig],
    listen: SocketAddr,
    admin: SocketAddr,
    problems: &mut Problems,
) {
    for (i, up) in upstreams.iter().enumerate() {
        for (j, earlier) in upstreams[..i].iter().enumerate() {
            if up.name == earlier.name {
                problems.add(
                    format!("upstreams[{i}].name"),
                    format!("{:?} is also the name of upstreams[{j}]", up.name),
                );
            }
            if up.listen.is_some_and(|a| a.port() != 0) && up.listen == earlier.listen {
                problems.add(
                    format!("upstreams[{i}].listen"),
                    format!(
                        "{} is also the listen address of upstreams[{j}]",
                        up.listen.expect("checked")
                    ),
                );
            }
            let mine = std::iter::once(&up.authority).chain(&up.aliases);
            for auth in mine {
                let theirs = std::iter::once(&earlier.authority).chain(&earlier.aliases);
                if theirs.into_iter().any(|a| a == auth) {
                    problems.add(
                        format!("upstreams[{i}]"),
                        format!("authority {auth} also belongs to upstreams[{j}]"),
                    );
                }
            }
        }
        if let Some(addr) = up.listen {
            for (what, taken) in [("listen", listen), ("admin", admin)] {
                if addr == taken && addr.port() != 0 {
                    problems.add(
                        format!("upstreams[{i}].listen"),
                        format!("{addr} is also the top-level {what} address"),
                    );
                }
            }
        }
    }
}

fn validate_policy(raw: &FilePolicy, problems: &mut Problems) -> PolicyConfig {
    let mut patterns = |list: &[String], key: &str| -> Vec<HostPattern> {
        list.iter()
            .enumerate()
            .filter_map(|(i, p)| {
                HostPattern::parse(p)
                    .map_err(|reason| problems.add(format!("policy.{key}[{i}]"), reason))
                    .ok()
            })
            .collect()
    };
    let allow_hosts = patterns(&raw.allow_hosts, "allow_hosts");
    let deny_hosts = patterns(&raw.deny_hosts, "deny_hosts");
    let connect_ports = raw
        .connect_ports
        .clone()
        .unwrap_or_else(|| vec![443])
        .into_iter()
        .enumerate()
        .filter_map(|(i, p)| match u16::try_from(p) {
            Ok(port) if port > 0 => Some(port),
            _ => {
                problems.add(format!("policy.connect_ports[{i}]"), format!("{p} is not a port"));
                None
            }
        })
        .collect();
    PolicyConfig {
        allow_hosts,
        deny_hosts,
        connect: raw.connect.unwrap_or(true),
        connect_ports,
        deny_private: raw.deny_private.unwrap_or(false),
    }
}

fn parse_tls_hosts(raw: Option<&str>, problems: &mut Problems) -> Vec<String> {
    let hosts: Vec<String> = raw
        .unwrap_or("")
        .split(',')
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .collect();
    for host in &hosts {
        if rustls::pki_types::ServerName::try_from(host.as_str()).is_err() {
            problems.add("EGRESS_TLS_HOSTS", format!("{host:?} is not a host name"));
        }
    }
    hosts
}

// === scalar parsers ===

fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    text.parse()
        .map_err(|_| format!("{text:?} is not an ip:port (e.g. 127.0.0.1:15080)"))
}

/// Longest Unix socket path: `sun_path` holds 108 bytes with the terminating NUL.
const MAX_UNIX_PATH: usize = 107;

fn parse_unix_path(text: &str) -> Result<PathBuf, String> {
    if text.len() > MAX_UNIX_PATH {
        return Err(format!(
            "{text:?} is {} bytes; a Unix socket path holds at most {MAX_UNIX_PATH}",
            text.len()
        ));
    }
    if text.contains('\0') || text.ends_with('/') {
        return Err(format!("{text:?} is not a file path"));
    }
    Ok(PathBuf::from(text))
}

/// `http://host[:port]` or `https://host[:port]`, nothing after the authority but `/`.
fn parse_upstream_url(text: &str) -> Result<(Scheme, Authority), String> {
    let uri: http::Uri = text.parse().map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    let scheme = match uri.scheme_str() {
        Some("http") => Scheme::Http,
        Some("https") => Scheme::Https,
        Some(other) => return Err(format!("{text:?}: scheme {other:?} is not http or https")),
        None => {
            return Err(format!(
                "{text:?} needs a scheme and a host, e.g. https://api.example.com"
            ))
        }
    };
    let authority = uri.authority().ok_or_else(|| format!("{text:?} has no host"))?;
    if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
        return Err(format!(
            "{text:?}: a path or query is not supported, only scheme://host[:port]"
        ));
    }
    let authority = Authority::parse(authority.as_str(), scheme.default_port())?;
    Ok((scheme, authority))
}

fn parse_duration(value: &Scalar) -> Result<Duration, String> {
    match value {
        Scalar::Int(0) => Ok(Duration::ZERO),
        Scalar::Int(n) => Err(format!("{n} needs a unit, e.g. {n}s or {n}ms")),
        Scalar::Str(s) if s.trim() == "0" => Ok(Duration::ZERO),
        Scalar::Str(s) => humantime::parse_duration(s.trim())
            .map_err(|e| format!("{s:?} is not a duration like 250ms, 10s or 5m ({e})")),
    }
}

fn duration_or(raw: &Option<Scalar>, base: Duration, key: &str, problems: &mut Problems) -> Duration {
    match raw {
        Some(v) => problems.take(key, parse_duration(v), base),
        None => base,
    }
}

/// Like [`duration_or`], where 0 means "off".
fn opt_duration_or(
    raw: &Option<Scalar>,
    base: Option<Duration>,
    key: &str,
    problems: &mut Problems,
) -> Option<Duration> {
    match raw {
        Some(v) => problems
            .take(key, parse_duration(v).map(Some), base)
            .filter(|d| !d.is_zero()),
        None => base,
    }
}

/// `65536`, `64KiB`, `1MiB`, `64KB` (KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024).
fn parse_size(value: &Scalar) -> Result<usize, String> {
    let text = match value {
        Scalar::Int(n) => return usize::try_from(*n).map_err(|_| format!("{n} is too large")),
        Scalar::Str(s) => s.trim(),
    };
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size like 65536, 64KiB or 1MiB"))?;
    let multiplier: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "k" => 1 << 10,
        "MiB" | "M" | "m" => 1 << 20,
        "GiB" | "G" | "g" => 1 << 30,
        "KB" | "kB" => 1000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => return Err(format!("{text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB)")),
    };
    number
        .checked_mul(multiplier)
        .ok_or_else(|| format!("{text:?} is too large"))
}

// === serializers for `check` ===

fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_duration(*d))
}

fn ser_opt_duration<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => ser_duration(d, s),
        None => s.serialize_str("0s"),
    }
}

fn ser_opt_count<S: Serializer>(n: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(n.unwrap_or(0))
}

fn ser_opt_size<S: Serializer>(n: &Option<usize>, s: S) -> Result<S::Ok, S::Error> {
    ser_size(&n.unwrap_or(0), s)
}

fn ser_size<S: Serializer>(n: &usize, s: S) -> Result<S::Ok, S::Error> {
    let text = match *n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{}MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{}KiB", n >> 10),
        n => n.to_string(),
    };
    s.serialize_str(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problems(yaml: &str) -> Vec<String> {
        match parse(yaml, &Overrides::default()) {
            Ok(_) => vec![],
            Err(ConfigError::Invalid(p)) => p.iter().map(|p| p.key.clone()).collect(),
            Err(e) => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn empty_config_is_the_documented_defaults() {
        let c = parse("", &Overrides::default()).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.admin.to_string(), DEFAULT_ADMIN);
        assert_eq!(c.defaults.pool.max_connections, 64);
        assert_eq!(c.defaults.pool.max_idle, 32);
        assert_eq!(c.defaults.pool.max_lifetime, Some(Duration::from_secs(600)));
        assert_eq!(c.defaults.response_header_timeout, None);
        assert_eq!(c.downstream.max_header_bytes, 64 * 1024);
        assert_eq!(c.policy.connect_ports, vec![443]);
    }

    #[test]
    fn upstream_overrides_merge_over_defaults() {
        let c = parse(
            "defaults: { pool: { max_idle: 4, idle_timeout: 5s } }\n\
             upstreams:\n  - name: a\n    url: http://a.example:8080\n    pool: { max_connections: 2 }\n",
            &Overrides::default(),
        )
        .unwrap();
        let up = &c.upstreams[0];
        assert_eq!(up.authority, Authority::parse("a.example:8080", 80).unwrap());
        assert_eq!(up.settings.pool.max_connections, 2);
        assert_eq!(
            up.settings.pool.max_idle, 2,
            "inherited max_idle follows the lower cap"
        );
        assert_eq!(up.settings.pool.idle_timeout, Duration::from_secs(5));
    }

    #[test]
    fn every_problem_names_its_key() {
        let keys = problems(
            "downstream: { idle_timeout: soon }\n\
             defaults: { pool: { max_connections: 4, max_idle: 8 } }\n\
             upstreams:\n  - url: http://a.example\n    listen: 127.0.0.1:20000\n  - url: http://b.example\n    listen: 127.0.0.1:20000\n  - url: /no/host\n",
        );
        assert_eq!(
            keys,
            vec![
                "downstream.idle_timeout",
                "defaults.pool.max_idle",
                "upstreams[2].url",
                "upstreams[1].listen",
            ]
        );
    }

    #[test]
    fn unknown_keys_are_errors_with_their_path() {
        assert_eq!(
            problems("defaults:\n  pool:\n    max_conns: 3\n"),
            vec!["defaults.pool.max_conns"]
        );
        let err = parse("defaults:\n  pool:\n    max_conns: 3\n", &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_conns"), "{err}");
    }

    #[test]
    fn budget_takes_a_fraction_or_explicit_bytes() {
        let c = parse("", &Overrides::default()).unwrap();
        assert_eq!(c.budget.memory_fraction, 0.8);
        assert_eq!(c.budget.memory_bytes, None);
        let c = parse(
            "budget: { memory_bytes: 48MiB, memory_fraction: 0.5 }\n",
            &Overrides::default(),
        )
        .unwrap();
        assert_eq!(c.budget.memory_bytes, Some(48 << 20));
        assert_eq!(c.budget.memory_fraction, 0.5);
        assert!(to_yaml(&c).contains("memory_bytes: 48MiB"), "{}", to_yaml(&c));
        assert_eq!(
            problems("budget: { memory_fraction: 1.5, memory_bytes: 1MiB }\n"),
            vec!["budget.memory_fraction", "budget.memory_bytes"]
        );
        assert_eq!(
            problems("budget: { memory_fraction: 0 }\n"),
            vec!["budget.memory_fraction"]
        );
        assert_eq!(
            problems("budget: { memory_limit: 1 }\n"),
            vec!["budget.memory_limit"]
        );
    }

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size(&Scalar::Str("64KiB".into())), Ok(65536));
        assert_eq!(parse_size(&Scalar::Int(4096)), Ok(4096));
        assert!(parse_size(&Scalar::Str("64 parsecs".into())).is_err());
        assert_eq!(
            parse_duration(&Scalar::Str("250ms".into())),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(parse_duration(&Scalar::Int(0)), Ok(Duration::ZERO));
        assert!(parse_duration(&Scalar::Int(5)).is_err());
    }

    #[test]
    fn overrides_win_over_the_file() {
        let o = Overrides {
            listen: Some("127.0.0.1:1".into()),
            ..Overrides::default()
        };
        let c = parse("listen: 127.0.0.1:2\n", &o).unwrap();
        assert_eq!(c.listen.port(), 1);
        let unix = |file: &str, flag: Option<&str>| {
            let o = Overrides {
                listen_unix: flag.map(str::to_owned),
                ..Overrides::default()
            };
            parse(file, &o).map(|c| c.listen_unix)
        };
        assert_eq!(unix("", None).unwrap(), None, "none by default");
        let from_file = unix("listen_unix: /run/egress/proxy.sock\n", None).unwrap();
        assert_eq!(from_file.as_deref(), Some(Path::new("/run/egress/proxy.sock")));
        let from_flag = unix("listen_unix: /a.sock\n", Some("/b.sock")).unwrap();
        assert_eq!(from_flag.as_deref(), Some(Path::new("/b.sock")));
        assert_eq!(
            unix("listen_unix: /a.sock\n", Some("")).unwrap(),
            None,
            "empty flag: off"
        );
        let long = format!("listen_unix: /{}\n", "x".repeat(120));
        match unix(&long, None) {
            Err(ConfigError::Invalid(p)) => assert_eq!(p[0].key, "listen_unix"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn effective_config_renders_and_parses_back() {
        let c = parse(
            "upstreams:\n  - name: a\n    url: http://a.example\n",
            &Overrides::default(),
        )
        .unwrap();
        let yaml = to_yaml(&c);
        assert!(yaml.contains("idle_timeout: 30s"), "{yaml}");
        assert!(yaml.contains("max_header_bytes: 64KiB"), "{yaml}");
        let again = parse(&yaml, &Overrides::default()).unwrap();
        assert_eq!(to_yaml(&again), yaml);
    }
}
