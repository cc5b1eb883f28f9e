//! Validation: the file schema in, the typed [`Config`] out, with defaults filled in and every
//! problem reported at once, each naming its key (`upstreams[0].pool.max_idle`).
//!
//! Cross-field rules live here too: `max_idle <= max_connections`, unique names, listen
//! addresses and authorities, the CA file loading as TLS will load it.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::problems::{duration_or, opt_duration_or, parse_size, Problems};
use super::schema::{
    FileBudget, FileConfig, FileDownstream, FileHeaderRules, FileHttp2, FileLlm, FileOutlier, FilePace,
    FilePolicy, FilePool, FileRetry, FileSettings, FileTls, FileUpstream, FileVia, Scalar,
};
use super::via::ViaConfig;
use super::{access_log, endpoints, global_rate_limit, header_rules, llm, pace, retry, traces, via};
use super::{
    load_ca_file, Authority, Balance, BudgetConfig, Config, ConfigError, DownstreamConfig, HeaderRules,
    HostPattern, Http2Config, LlmConfig, OutlierConfig, Overrides, PaceConfig, PolicyConfig, PoolConfig,
    Protocol, RetryConfig, Scheme, ShutdownConfig, TlsConfig, UpstreamConfig, UpstreamSettings,
    DEFAULT_ADMIN, DEFAULT_BUDGET_MEMORY_FRACTION, DEFAULT_CONNECT_TIMEOUT, DEFAULT_DOWNSTREAM_IDLE_TIMEOUT,
    DEFAULT_DOWNSTREAM_MAX_CONNECTIONS, DEFAULT_DRAIN_TIMEOUT, DEFAULT_H2_KEEPALIVE_INTERVAL,
    DEFAULT_H2_KEEPALIVE_TIMEOUT, DEFAULT_H2_MAX_STREAMS, DEFAULT_HEADER_READ_TIMEOUT,
    DEFAULT_LEAKY_IDLE_TIMEOUT, DEFAULT_LISTEN, DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_IDLE_DOWNSTREAM,
    DEFAULT_POOL_IDLE_TIMEOUT, DEFAULT_POOL_MAX_CONNECTING, DEFAULT_POOL_MAX_CONNECTIONS,
    DEFAULT_POOL_MAX_IDLE, DEFAULT_POOL_MAX_LIFETIME, DEFAULT_POOL_MAX_PENDING, DEFAULT_POOL_PENDING_TIMEOUT,
};
use crate::redact;

/// Upper bound on `downstream.max_connections`.
const MAX_DOWNSTREAM_CONNECTIONS: usize = 1_000_000;
/// Smallest explicit budget accepted: below it the sidecar could not hold its own start-up
/// footprint and would stop accepting for good.
const MIN_BUDGET_BYTES: usize = 8 << 20;

pub(super) fn validate(file: FileConfig, overrides: &Overrides) -> Result<Config, ConfigError> {
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
    let dns = endpoints::validate_dns(&file.dns, &mut problems);
    let access_log = access_log::validate_access_log(&file.access_log, &mut problems);
    let tracing = traces::validate_tracing(&file.tracing, &mut problems);

    let problems = problems.into_vec();
    if !problems.is_empty() {
        return Err(ConfigError::Invalid(problems));
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
        dns,
        access_log,
        tracing,
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
        request_timeout: None,
        body_idle_timeout: Some(retry::DEFAULT_BODY_IDLE_TIMEOUT),
        retry: RetryConfig::default(),
        pace: PaceConfig::default(),
        llm: LlmConfig::default(),
        global_rate_limit: super::GlobalRateLimitConfig::unset(),
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
        balance: Balance::LeastConnections,
        outlier: OutlierConfig::default(),
        via: ViaConfig::default(),
        tls: TlsConfig::default(),
        request_headers: HeaderRules::default(),
        tracing: super::UpstreamTracing::default(),
    }
}

/// The settings keys as they appear both under `defaults` and on an upstream.
struct SettingsRef<'a> {
    protocol: &'a Option<String>,
    connect_timeout: &'a Option<Scalar>,
    response_header_timeout: &'a Option<Scalar>,
    request_timeout: &'a Option<Scalar>,
    body_idle_timeout: &'a Option<Scalar>,
    retry: &'a FileRetry,
    pace: &'a FilePace,
    llm: &'a FileLlm,
    global_rate_limit: Option<&'a super::schema::FileGlobalRateLimit>,
    pool: &'a FilePool,
    http2: &'a FileHttp2,
    balance: &'a Option<String>,
    outlier: &'a FileOutlier,
    via: &'a Option<FileVia>,
    tls: &'a FileTls,
    request_headers: &'a Option<FileHeaderRules>,
    tracing: &'a super::schema::FileUpstreamTracing,
}

impl<'a> SettingsRef<'a> {
    fn from_defaults(raw: &'a FileSettings) -> Self {
        SettingsRef {
            protocol: &raw.protocol,
            connect_timeout: &raw.connect_timeout,
            response_header_timeout: &raw.response_header_timeout,
            request_timeout: &raw.request_timeout,
            body_idle_timeout: &raw.body_idle_timeout,
            retry: &raw.retry,
            pace: &raw.pace,
            llm: &raw.llm,
            global_rate_limit: raw.global_rate_limit.as_ref(),
            pool: &raw.pool,
            http2: &raw.http2,
            balance: &raw.balance,
            outlier: &raw.outlier,
            via: &raw.via,
            tls: &raw.tls,
            request_headers: &raw.request_headers,
            tracing: &raw.tracing,
        }
    }

    fn from_upstream(raw: &'a FileUpstream) -> Self {
        SettingsRef {
            protocol: &raw.protocol,
            connect_timeout: &raw.connect_timeout,
            response_header_timeout: &raw.response_header_timeout,
            request_timeout: &raw.request_timeout,
            body_idle_timeout: &raw.body_idle_timeout,
            retry: &raw.retry,
            pace: &raw.pace,
            llm: &raw.llm,
            global_rate_limit: raw.global_rate_limit.as_ref(),
            pool: &raw.pool,
            http2: &raw.http2,
            balance: &raw.balance,
            outlier: &raw.outlier,
            via: &raw.via,
            tls: &raw.tls,
            request_headers: &raw.request_headers,
            tracing: &raw.tracing,
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
    let request_timeout = opt_duration_or(
        raw.request_timeout,
        base.request_timeout,
        &key("request_timeout"),
        problems,
    );
    let body_idle_timeout = opt_duration_or(
        raw.body_idle_timeout,
        base.body_idle_timeout,
        &key("body_idle_timeout"),
        problems,
    );
    let retry = retry::merge_retry(&base.retry, raw.retry, &key("retry"), problems);
    let pace = pace::merge_pace(&base.pace, raw.pace, &key("pace"), problems);
    let llm = llm::merge_llm(&base.llm, raw.llm, &key("llm"), problems);
    let global_rate_limit = global_rate_limit::merge_global_rate_limit(
        &base.global_rate_limit,
        raw.global_rate_limit,
        &key("global_rate_limit"),
        problems,
        merge_tls,
    );
    if !prefix.starts_with("defaults")
        && global_rate_limit.tokens
        && !global_rate_limit.descriptors.is_empty()
        && llm.usage == super::UsageMode::Off
    {
        problems.add(
            key("global_rate_limit.tokens"),
            "is true but llm.usage is off: no answer's tokens would be read to report",
        );
    }
    let pool = merge_pool(&base.pool, raw.pool, &key("pool"), problems);
    let http2 = merge_http2(&base.http2, raw.http2, &key("http2"), problems);
    let balance = endpoints::merge_balance(base.balance, raw.balance, &key("balance"), problems);
    let outlier = endpoints::merge_outlier(&base.outlier, raw.outlier, &key("outlier"), problems);
    let via = via::merge_via(&base.via, raw.via, &key("via"), problems);
    let tls = merge_tls(&base.tls, raw.tls, &key("tls"), problems);
    let request_headers = header_rules::merge_header_rules(
        &base.request_headers,
        raw.request_headers,
        &key("request_headers"),
        problems,
    );
    let tracing = traces::merge_upstream_tracing(&base.tracing, raw.tracing);
    UpstreamSettings {
        protocol,
        connect_timeout,
        response_header_timeout,
        request_timeout,
        body_idle_timeout,
        retry,
        pace,
        llm,
        global_rate_limit,
        pool,
        http2,
        balance,
        outlier,
        via,
        tls,
        request_headers,
        tracing,
    }
}

/// `tls` under `prefix`, each key present replacing the base's; the files are checked as TLS
/// will load them.
fn merge_tls(base: &TlsConfig, raw: &FileTls, prefix: &str, problems: &mut Problems) -> TlsConfig {
    let key = |k: &str| format!("{prefix}.{k}");
    let tls = TlsConfig {
        ca_file: raw.ca_file.clone().or_else(|| base.ca_file.clone()),
        server_name: raw.server_name.clone().or_else(|| base.server_name.clone()),
        insecure_skip_verify: raw.insecure_skip_verify.unwrap_or(base.insecure_skip_verify),
        client_cert_file: raw
            .client_cert_file
            .clone()
            .or_else(|| base.client_cert_file.clone()),
        client_key_file: raw
            .client_key_file
            .clone()
            .or_else(|| base.client_key_file.clone()),
    };
    if let (Some(ca), Some(_)) = (&tls.ca_file, &raw.ca_file) {
        if let Err(why) = load_ca_file(ca) {
            problems.add(key("ca_file"), why);
        }
    }
    if let (Some(name), Some(_)) = (&tls.server_name, &raw.server_name) {
        if rustls::pki_types::ServerName::try_from(name.as_str()).is_err() {
            problems.add(
                key("server_name"),
                format!("{name:?} is not a DNS name or IP address"),
            );
        }
    }
    let touched = raw.client_cert_file.is_some() || raw.client_key_file.is_some();
    match (&tls.client_cert_file, &tls.client_key_file) {
        _ if !touched => {}
        (Some(cert), Some(private)) => {
            let read = |path: &PathBuf, k: &str, problems: &mut Problems| {
                std::fs::read(path)
                    .map_err(|e| problems.add(key(k), format!("{}: {e}", path.display())))
                    .ok()
            };
            let cert_pem = read(cert, "client_cert_file", problems);
            let key_pem = read(private, "client_key_file", problems);
            if let (Some(cert_pem), Some(key_pem)) = (cert_pem, key_pem) {
                if let Err(why) = super::load_client_identity(&cert_pem, &key_pem) {
                    problems.add(key("client_cert_file"), why);
                }
            }
        }
        (Some(_), None) => problems.add(key("client_key_file"), "is required with client_cert_file"),
        (None, Some(_)) => problems.add(key("client_cert_file"), "is required with client_key_file"),
        (None, None) => {}
    }
    tls
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
    let settings = merge_settings(defaults, SettingsRef::from_upstream(raw), &prefix, problems);
    Some(UpstreamConfig {
        name,
        url: format!("{}://{authority}", scheme.as_str()),
        scheme,
        authority,
        aliases,
        listen,
        addresses,
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
        connect_inspect: raw.connect_inspect.unwrap_or(true),
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
/// Errors show `text` without its userinfo.
fn parse_upstream_url(text: &str) -> Result<(Scheme, Authority), String> {
    let shown = redact::target(text);
    let uri: http::Uri = text.parse().map_err(|e| format!("{shown:?} is not a URL: {e}"))?;
    let scheme = match uri.scheme_str() {
        Some("http") => Scheme::Http,
        Some("https") => Scheme::Https,
        Some(other) => return Err(format!("{shown:?}: scheme {other:?} is not http or https")),
        None => {
            return Err(format!(
                "{shown:?} needs a scheme and a host, e.g. https://api.example.com"
            ))
        }
    };
    let authority = uri.authority().ok_or_else(|| format!("{shown:?} has no host"))?;
    if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
        return Err(format!(
            "{shown:?}: a path or query is not supported, only scheme://host[:port]"
        ));
    }
    let authority = Authority::parse(authority.as_str(), scheme.default_port())?;
    Ok((scheme, authority))
}
