//! Configuration: the validated [`Config`] the rest of the crate reads, and the entry points
//! that produce it ([`load`], [`parse`]) or print it for `check` ([`to_yaml`]).
//!
//! The file schema users write lives in `schema`: it mirrors the YAML one to one, rejects
//! unknown keys, and keeps every value loose (durations and sizes as strings) so that
//! validation (`validate`) can report *every* problem at once, each naming its key. [`Config`]
//! is what comes out: typed, defaults filled in, and cross-field rules checked
//! (`max_idle <= max_connections`, unique listen addresses, ...). Host names and host patterns
//! are in `host`. Precedence is flags > environment > file > built-in defaults; `main` folds
//! flags and environment into [`Overrides`] before calling [`load`].
//!
//! The bottom layer: nothing here imports from the rest of the crate.
//!
//! Not handled here: how a request picks an upstream (`routing`) or what the pool does with its
//! settings (`pool`).

mod access_log;
mod endpoints;
mod global_rate_limit;
mod header_rules;
mod host;
mod llm;
mod pace;
mod problems;
mod retry;
mod schema;
mod traces;
mod validate;
mod via;

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde::{Serialize, Serializer};

use crate::redact;

pub use access_log::{AccessLogConfig, AccessLogFormat};
pub use endpoints::{
    Balance, DnsConfig, OutlierConfig, DEFAULT_BASE_EJECTION, DEFAULT_DNS_MAX_TTL, DEFAULT_DNS_MIN_TTL,
    DEFAULT_MAX_EJECTION, DEFAULT_OUTLIER_FAILURES,
};
pub use global_rate_limit::{DescriptorSpec, Entry, FailureMode, GlobalRateLimitConfig, ServiceUrl};
pub use header_rules::{header_file_value, HeaderRules, HeaderSource};
pub use host::{canonical_host, HostPattern};
pub(crate) use host::{canonical_ip, in_network};
pub use llm::{LlmConfig, UsageMode};
pub use pace::PaceConfig;
pub use retry::{Backoff, RetryBudget, RetryConfig, RetryOn, DEFAULT_BODY_IDLE_TIMEOUT};
pub use traces::{OtlpUrl, TracingConfig, UpstreamTracing};
pub use via::{ParentRoute, ParentUrl, Via, ViaConfig};

use schema::FileConfig;
use validate::validate;

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
    /// The resolver.
    pub dns: DnsConfig,
    /// The access log.
    pub access_log: AccessLogConfig,
    /// OpenTelemetry spans.
    pub tracing: TracingConfig,
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
    /// Deadline for the whole exchange, request to last response byte; `None` = off.
    #[serde(serialize_with = "ser_opt_duration")]
    pub request_timeout: Option<Duration>,
    /// Longest silence between body bytes, either direction; `None` = off.
    #[serde(serialize_with = "ser_opt_duration")]
    pub body_idle_timeout: Option<Duration>,
    /// What is retried, how often and how soon.
    pub retry: RetryConfig,
    /// Pacing to the limits the upstream advertises.
    pub pace: PaceConfig,
    /// Reading the token usage LLM APIs report.
    pub llm: LlmConfig,
    /// A rate limit shared by the fleet, kept by a rate-limit service.
    #[serde(skip_serializing_if = "GlobalRateLimitConfig::is_unset")]
    pub global_rate_limit: GlobalRateLimitConfig,
    /// Pool knobs.
    pub pool: PoolConfig,
    /// HTTP/2 knobs.
    pub http2: Http2Config,
    /// Where new connections go among the upstream's endpoints.
    pub balance: Balance,
    /// When an endpoint is ejected.
    pub outlier: OutlierConfig,
    /// A parent proxy to reach the upstream through.
    pub via: ViaConfig,
    /// TLS settings (used when the upstream is https).
    pub tls: TlsConfig,
    /// Headers set or removed on the way upstream.
    pub request_headers: HeaderRules,
    /// Whether trace context goes to the upstream.
    pub tracing: UpstreamTracing,
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
    /// Errors show `text` without its userinfo.
    pub fn parse(text: &str, default_port: u16) -> Result<Self, String> {
        let shown = redact::authority(text);
        let auth: http::uri::Authority = text
            .parse()
            .map_err(|e| format!("{shown:?} is not a host[:port]: {e}"))?;
        if text.contains('@') {
            return Err(format!(
                "{shown:?} must not carry user information (removed here)"
            ));
        }
        let host = canonical_host(auth.host()).map_err(|why| format!("{shown:?}: {why}"))?;
        let port = match auth.port() {
            Some(p) => p
                .as_str()
                .parse::<u16>()
                .map_err(|_| format!("{shown:?} has an invalid port"))?,
            None => default_port,
        };
        if port == 0 {
            return Err(format!("{shown:?} has port 0"));
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
    /// A client certificate chain (PEM) for upstreams that ask for one (mTLS); re-read when
    /// it changes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key_file: Option<PathBuf>,
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
    /// Ports CONNECT may reach with an opaque tunnel.
    pub connect_ports: Vec<u16>,
    /// A CONNECT to any other port is answered `200` and what the client sends inside is served
    /// if it is plain HTTP (HTTP/1.x or h2c), through the pool.
    pub connect_inspect: bool,
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

/// A client certificate chain and its private key from PEM: what `tls.client_cert_file` and
/// `tls.client_key_file` hold. `check` validates them with this and TLS loads them with it.
pub fn load_client_identity(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<
    (
        Vec<CertificateDer<'static>>,
        rustls::pki_types::PrivateKeyDer<'static>,
    ),
    String,
> {
    use rustls::pki_types::pem::PemObject as _;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("not a PEM certificate chain: {e}"))?;
    if certs.is_empty() {
        return Err("no PEM certificate in client_cert_file".into());
    }
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| format!("client_key_file is not a PEM private key: {e}"))?;
    Ok((certs, key))
}

/// The problems `yaml` has, as (key, reason); for the config modules' tests.
#[cfg(test)]
fn problems(yaml: &str) -> Vec<(String, String)> {
    match parse(yaml, &Overrides::default()) {
        Ok(_) => vec![],
        Err(ConfigError::Invalid(p)) => p.into_iter().map(|p| (p.key, p.reason)).collect(),
        Err(e) => panic!("unexpected {e}"),
    }
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
    fn a_url_with_userinfo_is_refused_without_repeating_it() {
        for yaml in [
            "upstreams:\n  - url: http://user-7a:s3cret-7a@api.example\n",
            "upstreams:\n  - url: http://user-7a:s3cret-7a@api.example/path\n",
            "upstreams:\n  - url: ftp://user-7a:s3cret-7a@api.example\n",
            "defaults:\n  via: { url: \"http://user-7a:s3cret-7a@proxy:3128/path\" }\n",
            "defaults:\n  via: { url: \"socks5://user-7a:s3cret-7a@proxy:1080\" }\n",
        ] {
            let found = super::problems(yaml);
            assert!(!found.is_empty(), "{yaml}");
            for (key, reason) in found {
                let shown = format!("{key}: {reason}");
                assert!(
                    !shown.contains("user-7a") && !shown.contains("s3cret-7a"),
                    "{shown}"
                );
            }
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
