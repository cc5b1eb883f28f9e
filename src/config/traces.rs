//! The `tracing` keys: the top-level section (where OpenTelemetry spans are exported, which
//! share of requests is sampled, the service name) and the per-upstream `tracing.propagate`.

use serde::Serialize;

use super::problems::Problems;
use super::schema::{FileTracing, FileUpstreamTracing};
use super::Authority;

/// Where spans go and which requests make them; off while `otlp` is unset.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TracingConfig {
    /// The OTLP/HTTP collector; spans are posted to `<otlp>/v1/traces`. `None`: no spans.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp: Option<OtlpUrl>,
    /// The share of requests without a `traceparent` that are traced, 0 to 1; a `traceparent`'s
    /// sampled flag decides for its request either way.
    pub sample: f64,
    /// The `service.name` resource attribute.
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp: None,
            // OpenTelemetry's default sampler (parent-based, always on): whoever names a
            // collector wants to see traces in it.
            sample: 1.0,
            service_name: "egress-sidecar".to_owned(),
        }
    }
}

/// An OTLP/HTTP endpoint: `http://host:port[/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpUrl {
    /// Host and port.
    pub authority: Authority,
    /// The path spans are posted to: the URL's path, then `/v1/traces`.
    pub traces_path: String,
}

impl Serialize for OtlpUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl std::fmt::Display for OtlpUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let prefix = self.traces_path.strip_suffix(TRACES_PATH).unwrap_or("");
        write!(f, "http://{}{prefix}", self.authority)
    }
}

/// Appended to the endpoint, as OpenTelemetry's exporters append it to
/// `OTEL_EXPORTER_OTLP_ENDPOINT`.
const TRACES_PATH: &str = "/v1/traces";

/// An upstream's `tracing` settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct UpstreamTracing {
    /// Whether trace context (`traceparent`, `tracestate`, `baggage`) goes to the upstream;
    /// `false` removes the application's too, traced or not.
    pub propagate: bool,
}

impl Default for UpstreamTracing {
    fn default() -> Self {
        UpstreamTracing { propagate: true }
    }
}

pub(super) fn validate_tracing(raw: &FileTracing, problems: &mut Problems) -> TracingConfig {
    let base = TracingConfig::default();
    let otlp = raw
        .otlp
        .as_deref()
        .map(str::trim)
        .filter(|text| !text.is_empty())
        .and_then(|text| problems.take("tracing.otlp", parse_otlp(text).map(Some), None));
    let sample = raw.sample.unwrap_or(base.sample);
    if !(0.0..=1.0).contains(&sample) {
        problems.add("tracing.sample", format!("{sample} is outside 0..1"));
    }
    let service_name = match raw.service_name.as_deref().map(str::trim) {
        None => base.service_name,
        Some("") => {
            problems.add("tracing.service_name", "must not be empty");
            base.service_name
        }
        Some(name) => name.to_owned(),
    };
    TracingConfig {
        otlp,
        sample,
        service_name,
    }
}

/// `http://host[:port][/prefix]`: no query, no fragment, no userinfo.
fn parse_otlp(text: &str) -> Result<OtlpUrl, String> {
    let Some(rest) = text.strip_prefix("http://") else {
        return Err(if text.starts_with("https://") {
            format!(
                "{text:?}: https is not supported; export to a collector (agent or sidecar) over \
                 plain http on the node or pod, and let it forward over TLS"
            )
        } else {
            format!("{text:?} is not an http:// URL")
        });
    };
    if rest.contains(['?', '#']) {
        return Err(format!("{text:?} must not carry a query or fragment"));
    }
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    let authority = Authority::parse(authority, 80)?;
    let prefix = path.trim_end_matches('/');
    Ok(OtlpUrl {
        authority,
        traces_path: format!("{prefix}{TRACES_PATH}"),
    })
}

/// An upstream's `tracing`, each key present replacing `base`'s.
pub(super) fn merge_upstream_tracing(base: &UpstreamTracing, raw: &FileUpstreamTracing) -> UpstreamTracing {
    UpstreamTracing {
        propagate: raw.propagate.unwrap_or(base.propagate),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracing(otlp: Option<&str>, sample: Option<f64>) -> Result<TracingConfig, Vec<String>> {
        let raw = FileTracing {
            otlp: otlp.map(str::to_owned),
            sample,
            service_name: None,
        };
        let mut problems = Problems::default();
        let config = validate_tracing(&raw, &mut problems);
        let found: Vec<String> = problems.into_vec().into_iter().map(|p| p.key).collect();
        if found.is_empty() {
            Ok(config)
        } else {
            Err(found)
        }
    }

    #[test]
    fn the_endpoint_takes_a_path_prefix_and_renders_back() {
        let config = tracing(Some("http://otel-collector:4318"), None).unwrap();
        let otlp = config.otlp.unwrap();
        assert_eq!(otlp.authority.host, "otel-collector");
        assert_eq!(otlp.authority.port, 4318);
        assert_eq!(otlp.traces_path, "/v1/traces");
        assert_eq!(otlp.to_string(), "http://otel-collector:4318");
        let prefixed = tracing(Some("http://gw/otlp/"), None).unwrap().otlp.unwrap();
        assert_eq!(prefixed.authority.port, 80);
        assert_eq!(prefixed.traces_path, "/otlp/v1/traces");
        assert_eq!(prefixed.to_string(), "http://gw:80/otlp");
        assert_eq!(tracing(None, None).unwrap().otlp, None, "off by default");
        assert_eq!(tracing(Some(""), None).unwrap().otlp, None);
    }

    #[test]
    fn bad_values_name_their_keys() {
        assert_eq!(
            tracing(Some("https://c:4318"), None).unwrap_err(),
            ["tracing.otlp"]
        );
        assert_eq!(tracing(Some("c:4318"), None).unwrap_err(), ["tracing.otlp"]);
        assert_eq!(
            tracing(Some("http://u:p@c:4318"), None).unwrap_err(),
            ["tracing.otlp"]
        );
        assert_eq!(
            tracing(Some("http://c:4318/?a"), None).unwrap_err(),
            ["tracing.otlp"]
        );
        assert_eq!(tracing(None, Some(1.5)).unwrap_err(), ["tracing.sample"]);
        assert_eq!(tracing(None, Some(-0.1)).unwrap_err(), ["tracing.sample"]);
    }
}
