//! The file schema: the YAML keys users write, one struct per section, mirrored one to one.
//!
//! Every struct rejects unknown keys and keeps values loose (durations and sizes as written) so
//! that validation (`validate`) can report every problem at once, each naming its key.

use std::path::PathBuf;

use serde::Deserialize;

/// A duration or size as written: `10s`, `64KiB`, or a bare number.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum Scalar {
    Int(u64),
    Str(String),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileConfig {
    pub(super) listen: Option<String>,
    pub(super) listen_unix: Option<String>,
    pub(super) admin: Option<String>,
    pub(super) downstream: FileDownstream,
    pub(super) defaults: FileSettings,
    pub(super) upstreams: Vec<FileUpstream>,
    pub(super) policy: FilePolicy,
    pub(super) shutdown: FileShutdown,
    pub(super) budget: FileBudget,
    pub(super) dns: FileDns,
    pub(super) access_log: FileAccessLog,
    pub(super) tracing: FileTracing,
}

/// `tracing` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileTracing {
    pub(super) otlp: Option<String>,
    pub(super) sample: Option<f64>,
    pub(super) service_name: Option<String>,
}

/// An upstream's (or `defaults`') `tracing` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileUpstreamTracing {
    pub(super) propagate: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileAccessLog {
    pub(super) enabled: Option<bool>,
    pub(super) format: Option<String>,
    pub(super) path: Option<PathBuf>,
    pub(super) sample: Option<f64>,
    pub(super) query: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileDownstream {
    pub(super) idle_timeout: Option<Scalar>,
    pub(super) header_read_timeout: Option<Scalar>,
    pub(super) max_connections: Option<u64>,
    pub(super) max_header_bytes: Option<Scalar>,
    pub(super) max_idle_connections: Option<u64>,
    pub(super) leaky_idle_timeout: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileSettings {
    pub(super) tls: FileTls,
    pub(super) protocol: Option<String>,
    pub(super) connect_timeout: Option<Scalar>,
    pub(super) response_header_timeout: Option<Scalar>,
    pub(super) request_timeout: Option<Scalar>,
    pub(super) body_idle_timeout: Option<Scalar>,
    pub(super) retry: FileRetry,
    pub(super) pace: FilePace,
    pub(super) llm: FileLlm,
    pub(super) global_rate_limit: Option<FileGlobalRateLimit>,
    pub(super) pool: FilePool,
    pub(super) http2: FileHttp2,
    pub(super) balance: Option<String>,
    pub(super) outlier: FileOutlier,
    pub(super) via: Option<FileVia>,
    pub(super) request_headers: Option<FileHeaderRules>,
    pub(super) tracing: FileUpstreamTracing,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileRetry {
    pub(super) attempts: Option<u64>,
    pub(super) on: Option<Vec<Scalar>>,
    pub(super) backoff: FileBackoff,
    pub(super) retry_after_max: Option<Scalar>,
    pub(super) budget: FileRetryBudget,
    pub(super) buffer_body_up_to: Option<Scalar>,
}

/// `pace` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FilePace {
    pub(super) enabled: Option<bool>,
    pub(super) max_wait: Option<Scalar>,
    pub(super) reserve: Option<u64>,
    pub(super) smooth: Option<bool>,
}

/// `global_rate_limit` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileGlobalRateLimit {
    pub(super) service: Option<String>,
    pub(super) tls: FileTls,
    pub(super) domain: Option<String>,
    pub(super) descriptors: Option<Vec<Vec<FileEntry>>>,
    pub(super) tokens: Option<bool>,
    pub(super) timeout: Option<Scalar>,
    pub(super) failure_mode: Option<String>,
    pub(super) max_wait: Option<Scalar>,
}

/// One entry of a `global_rate_limit` descriptor as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileEntry {
    pub(super) key: String,
    pub(super) value: Option<String>,
    pub(super) name: Option<String>,
}

/// `llm` as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileLlm {
    pub(super) usage: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileBackoff {
    pub(super) base: Option<Scalar>,
    pub(super) max: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileRetryBudget {
    pub(super) ratio: Option<f64>,
    pub(super) min_per_second: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileVia {
    pub(super) url: Option<String>,
    pub(super) credentials_file: Option<PathBuf>,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) no_via: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileOutlier {
    pub(super) consecutive_failures: Option<u64>,
    pub(super) base_ejection: Option<Scalar>,
    pub(super) max_ejection: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileDns {
    pub(super) servers: Option<Vec<String>>,
    pub(super) min_ttl: Option<Scalar>,
    pub(super) max_ttl: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FilePool {
    pub(super) max_connections: Option<u64>,
    pub(super) max_idle: Option<u64>,
    pub(super) idle_timeout: Option<Scalar>,
    pub(super) max_lifetime: Option<Scalar>,
    pub(super) max_requests_per_connection: Option<u64>,
    pub(super) max_pending: Option<u64>,
    pub(super) pending_timeout: Option<Scalar>,
    pub(super) max_connecting: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileHttp2 {
    pub(super) max_streams_per_connection: Option<u64>,
    pub(super) keepalive_interval: Option<Scalar>,
    pub(super) keepalive_timeout: Option<Scalar>,
}

// serde's `flatten` does not combine with `deny_unknown_fields`, so the per-upstream overrides
// repeat the keys of `FileSettings`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileUpstream {
    pub(super) name: Option<String>,
    pub(super) url: Option<String>,
    pub(super) aliases: Vec<String>,
    pub(super) listen: Option<String>,
    pub(super) addresses: Vec<String>,
    pub(super) tls: FileTls,
    pub(super) protocol: Option<String>,
    pub(super) connect_timeout: Option<Scalar>,
    pub(super) response_header_timeout: Option<Scalar>,
    pub(super) request_timeout: Option<Scalar>,
    pub(super) body_idle_timeout: Option<Scalar>,
    pub(super) retry: FileRetry,
    pub(super) pace: FilePace,
    pub(super) llm: FileLlm,
    pub(super) global_rate_limit: Option<FileGlobalRateLimit>,
    pub(super) pool: FilePool,
    pub(super) http2: FileHttp2,
    pub(super) balance: Option<String>,
    pub(super) outlier: FileOutlier,
    pub(super) via: Option<FileVia>,
    pub(super) request_headers: Option<FileHeaderRules>,
    pub(super) tracing: FileUpstreamTracing,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileTls {
    pub(super) ca_file: Option<PathBuf>,
    pub(super) server_name: Option<String>,
    pub(super) insecure_skip_verify: Option<bool>,
    pub(super) client_cert_file: Option<PathBuf>,
    pub(super) client_key_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileHeaderRules {
    pub(super) set: Option<std::collections::BTreeMap<String, FileHeaderValue>>,
    pub(super) remove: Option<Vec<String>>,
}

/// A set header's value: a literal, or `{ file: PATH }`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum FileHeaderValue {
    Literal(Scalar),
    File(FileRef),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileRef {
    pub(super) file: PathBuf,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FilePolicy {
    pub(super) allow_hosts: Vec<String>,
    pub(super) deny_hosts: Vec<String>,
    pub(super) connect: Option<bool>,
    pub(super) connect_ports: Option<Vec<u64>>,
    pub(super) connect_inspect: Option<bool>,
    pub(super) deny_private: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileShutdown {
    pub(super) drain_timeout: Option<Scalar>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct FileBudget {
    pub(super) enabled: Option<bool>,
    pub(super) memory_fraction: Option<f64>,
    pub(super) memory_bytes: Option<Scalar>,
}
