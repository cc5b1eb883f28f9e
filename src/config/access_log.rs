//! The `access_log` keys: one line per request, JSON or nginx-style text, to stdout or a file,
//! sampled; typed and validated (`check` opens the file as the sidecar will).

use std::path::PathBuf;

use serde::Serialize;

use super::problems::Problems;
use super::schema::FileAccessLog;

/// The access log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AccessLogConfig {
    /// Whether lines are written at all.
    pub enabled: bool,
    /// `json` or `text`.
    pub format: AccessLogFormat,
    /// The file lines are appended to; `None`: stdout.
    #[serde(serialize_with = "ser_path")]
    pub path: Option<PathBuf>,
    /// The share of requests logged, 0 to 1.
    pub sample: f64,
    /// Whether the query string is logged with the path.
    pub query: bool,
}

/// An access log line's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessLogFormat {
    /// One JSON object per line.
    Json,
    /// nginx's combined format, then `key=value` fields.
    Text,
}

impl Default for AccessLogConfig {
    fn default() -> Self {
        AccessLogConfig {
            enabled: false,
            format: AccessLogFormat::Json,
            path: None,
            sample: 1.0,
            query: false,
        }
    }
}

fn ser_path<S: serde::Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    match path {
        Some(p) => s.collect_str(&p.display()),
        None => s.serialize_str(""),
    }
}

pub(super) fn validate_access_log(raw: &FileAccessLog, problems: &mut Problems) -> AccessLogConfig {
    let base = AccessLogConfig::default();
    let format = match raw.format.as_deref().map(str::trim) {
        None | Some("json") => AccessLogFormat::Json,
        Some("text") => AccessLogFormat::Text,
        Some(other) => {
            problems.add("access_log.format", format!("{other:?} is not json or text"));
            base.format
        }
    };
    let sample = raw.sample.unwrap_or(base.sample);
    if !(0.0..=1.0).contains(&sample) {
        problems.add("access_log.sample", format!("{sample} is outside 0..1"));
    }
    let path = raw.path.clone().filter(|p| !p.as_os_str().is_empty());
    let enabled = raw.enabled.unwrap_or(base.enabled);
    if let (Some(path), true) = (&path, enabled) {
        // Opened as the writer will open it: created if missing, appended to.
        if let Err(e) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            problems.add("access_log.path", format!("{}: {e}", path.display()));
        }
    }
    AccessLogConfig {
        enabled,
        format,
        path,
        sample,
        query: raw.query.unwrap_or(base.query),
    }
}
