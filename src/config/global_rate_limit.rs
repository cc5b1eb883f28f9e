//! The `global_rate_limit` keys, per upstream and in `defaults`: which rate-limit service (Envoy's
//! `ShouldRateLimit` protocol) keeps a rate limit shared by the fleet, what a request is counted as
//! (its descriptors), and what happens when the service says no or does not answer.
//!
//! Each key present replaces the one it merges over (`defaults`, then the upstream), as
//! `descriptors` does as a whole. A section is on once it has descriptors; `descriptors: []` on
//! an upstream turns off what `defaults` would give it.

use std::time::Duration;

use serde::Serialize;

use super::problems::{duration_or, Problems};
use super::schema::{FileEntry, FileGlobalRateLimit};
use super::{ser_duration, Authority, Scheme, TlsConfig};

/// What the service's silence means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum FailureMode {
    /// The request goes: the service is a dependency, not a single point of failure.
    #[default]
    Allow,
    /// `503 rate_limit_unavailable`: nothing goes unless the service said it may.
    Deny,
}

/// One entry of a descriptor: what the sidecar sends as a `(key, value)` pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Entry {
    /// `("upstream", <the upstream's name>)`.
    Upstream,
    /// `("app", <the app>)`: `x-egress-app`, else the executable of a Unix-socket client, else
    /// the upstream a route listener is bound to, else `unknown`.
    App,
    /// `(<name>, <the request's header value>)`; a request without the header sends no such
    /// descriptor (Envoy's `request_headers` action).
    Header {
        /// The header, lower-cased.
        name: String,
    },
    /// `(key, value)` as written.
    Literal {
        /// The entry's key.
        key: String,
        /// The entry's value.
        value: String,
    },
}

impl Serialize for Entry {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        match self {
            Entry::Upstream => map.serialize_entry("key", "upstream")?,
            Entry::App => map.serialize_entry("key", "app")?,
            Entry::Header { name } => {
                map.serialize_entry("key", "header")?;
                map.serialize_entry("name", name)?;
            }
            Entry::Literal { key, value } => {
                map.serialize_entry("key", key)?;
                map.serialize_entry("value", value)?;
            }
        }
        map.end()
    }
}

impl Entry {
    /// `{ key: unit, value: tokens }`: the descriptor it is in counts tokens.
    pub fn is_token_unit(&self) -> bool {
        matches!(self, Entry::Literal { key, value } if key == "unit" && value == "tokens")
    }
}

/// A descriptor as configured: entries sent together as one descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(transparent)]
pub struct DescriptorSpec {
    /// Its entries, in order.
    pub entries: Vec<Entry>,
}

impl DescriptorSpec {
    /// It has a `{ key: unit, value: tokens }` entry: token reports go to it, and requests
    /// only check it.
    pub fn counts_tokens(&self) -> bool {
        self.entries.iter().any(Entry::is_token_unit)
    }
}

/// Where the rate-limit service listens.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServiceUrl {
    /// `http` (h2c) or `https`.
    pub scheme: Scheme,
    /// Its host and port.
    pub authority: Authority,
}

impl Serialize for ServiceUrl {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl std::fmt::Display for ServiceUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme.as_str(), self.authority)
    }
}

/// An upstream's `global_rate_limit` settings, or what `defaults` gives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct GlobalRateLimitConfig {
    /// The service; `None` until a level names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service: Option<ServiceUrl>,
    /// TLS towards an `https` service.
    pub tls: TlsConfig,
    /// The service's domain (its config's `domain`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub domain: String,
    /// What each request is counted as; empty: off.
    pub descriptors: Vec<DescriptorSpec>,
    /// Answers' token usage is reported on the token descriptors.
    pub tokens: bool,
    /// The longest a call may take before `failure_mode` decides.
    #[serde(serialize_with = "ser_duration")]
    pub timeout: Duration,
    /// What the service's silence means.
    pub failure_mode: FailureMode,
    /// An over-limit answer whose reset is within it holds the request until then.
    #[serde(serialize_with = "ser_duration")]
    pub max_wait: Duration,
}

impl GlobalRateLimitConfig {
    /// The section as `defaults` has it when the file says nothing.
    pub fn unset() -> Self {
        GlobalRateLimitConfig {
            timeout: DEFAULT_TIMEOUT,
            ..Default::default()
        }
    }

    /// Nothing was said of it: the effective config leaves it out.
    pub fn is_unset(&self) -> bool {
        *self == Self::unset()
    }

    /// Requests are counted: a service and descriptors.
    pub fn is_on(&self) -> bool {
        self.service.is_some() && !self.descriptors.is_empty()
    }
}

const DEFAULT_TIMEOUT: Duration = Duration::from_millis(50);
/// Past this a call to a rate-limit service is not a check but a stall.
const MAX_TIMEOUT: Duration = Duration::from_secs(10);
/// A request held longer than an hour is held by mistake (as `pace.max_wait`).
const MAX_WAIT_BOUND: Duration = Duration::from_secs(3600);
/// Descriptors per request, and entries per descriptor: each is a counter the service reads and
/// writes per call.
const MAX_DESCRIPTORS: usize = 16;
const MAX_ENTRIES: usize = 8;

/// `global_rate_limit` under `prefix`, over `base`.
pub(super) fn merge_global_rate_limit(
    base: &GlobalRateLimitConfig,
    raw: Option<&FileGlobalRateLimit>,
    prefix: &str,
    problems: &mut Problems,
    merge_tls: impl FnOnce(&TlsConfig, &super::schema::FileTls, &str, &mut Problems) -> TlsConfig,
) -> GlobalRateLimitConfig {
    let Some(raw) = raw else {
        return base.clone();
    };
    let key = |k: &str| format!("{prefix}.{k}");
    let service = match &raw.service {
        None => base.service.clone(),
        Some(text) => problems.take(&key("service"), parse_service(text).map(Some), None),
    };
    let tls = merge_tls(&base.tls, &raw.tls, &key("tls"), problems);
    let domain = match &raw.domain {
        None => base.domain.clone(),
        Some(d) if d.is_empty() || d.chars().any(|c| c.is_control()) => {
            problems.add(
                key("domain"),
                format!("{d:?} must be non-empty, without control characters"),
            );
            base.domain.clone()
        }
        Some(d) => d.clone(),
    };
    let descriptors = match &raw.descriptors {
        None => base.descriptors.clone(),
        Some(list) => descriptors(list, &key("descriptors"), problems),
    };
    let timeout = duration_or(&raw.timeout, base.timeout, &key("timeout"), problems);
    // Bounds are checked where a key is written, not again under every upstream inheriting it.
    if raw.timeout.is_some() && (timeout.is_zero() || timeout > MAX_TIMEOUT) {
        problems.add(key("timeout"), "must be more than 0 and at most 10s");
    }
    let max_wait = duration_or(&raw.max_wait, base.max_wait, &key("max_wait"), problems);
    if raw.max_wait.is_some() && max_wait > MAX_WAIT_BOUND {
        problems.add(key("max_wait"), "is more than 1h");
    }
    let failure_mode = match raw.failure_mode.as_deref() {
        None => base.failure_mode,
        Some("allow") => FailureMode::Allow,
        Some("deny") => FailureMode::Deny,
        Some(other) => {
            problems.add(key("failure_mode"), format!("{other:?} is not allow or deny"));
            base.failure_mode
        }
    };
    let section = GlobalRateLimitConfig {
        service,
        tls,
        domain,
        descriptors,
        tokens: raw.tokens.unwrap_or(base.tokens),
        timeout,
        failure_mode,
        max_wait,
    };
    // `defaults` may leave the service or the domain to the upstreams.
    if !prefix.starts_with("defaults") {
        check_whole(&section, prefix, problems);
    }
    section
}

/// What only the merged section can say: a service and domain for its descriptors, token
/// descriptors exactly when tokens are reported.
fn check_whole(section: &GlobalRateLimitConfig, prefix: &str, problems: &mut Problems) {
    let key = |k: &str| format!("{prefix}.{k}");
    if section.descriptors.is_empty() {
        return;
    }
    if section.service.is_none() {
        problems.add(key("service"), "is required when descriptors are set");
    }
    if section.domain.is_empty() {
        problems.add(key("domain"), "is required when descriptors are set");
    }
    let token_descriptors = section.descriptors.iter().filter(|d| d.counts_tokens()).count();
    if section.tokens && token_descriptors == 0 {
        problems.add(
            key("tokens"),
            "is true but no descriptor has { key: unit, value: tokens } to report them on",
        );
    }
    if !section.tokens && token_descriptors > 0 {
        problems.add(
            key("descriptors"),
            "a descriptor with { key: unit, value: tokens } needs tokens: true (it would count requests as tokens)",
        );
    }
}

/// `http://host:port` (h2c) or `https://host:port`; no path.
fn parse_service(text: &str) -> Result<ServiceUrl, String> {
    let (scheme, rest) = if let Some(rest) = text.strip_prefix("http://") {
        (Scheme::Http, rest)
    } else if let Some(rest) = text.strip_prefix("https://") {
        (Scheme::Https, rest)
    } else {
        return Err(format!("{text:?} is not an http:// or https:// URL"));
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#']) {
        return Err(format!("{text:?} must be scheme://host[:port], without a path"));
    }
    let authority = Authority::parse(rest, scheme.default_port())?;
    Ok(ServiceUrl { scheme, authority })
}

fn descriptors(list: &[Vec<FileEntry>], prefix: &str, problems: &mut Problems) -> Vec<DescriptorSpec> {
    if list.len() > MAX_DESCRIPTORS {
        problems.add(
            prefix,
            format!("has {} descriptors; at most {MAX_DESCRIPTORS}", list.len()),
        );
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, raw) in list.iter().enumerate() {
        let at = format!("{prefix}[{i}]");
        if raw.is_empty() || raw.len() > MAX_ENTRIES {
            problems.add(&at, format!("must have 1 to {MAX_ENTRIES} entries"));
            continue;
        }
        let entries: Vec<Entry> = raw
            .iter()
            .enumerate()
            .filter_map(|(j, e)| entry(e, &format!("{at}[{j}]"), problems))
            .collect();
        if entries.len() == raw.len() {
            let spec = DescriptorSpec { entries };
            if out.contains(&spec) {
                problems.add(&at, "repeats an earlier descriptor");
            }
            out.push(spec);
        }
    }
    out
}

fn entry(raw: &FileEntry, at: &str, problems: &mut Problems) -> Option<Entry> {
    let key = raw.key.as_str();
    let printable = |s: &str| !s.is_empty() && !s.chars().any(|c| c.is_control());
    if !printable(key) {
        problems.add(
            format!("{at}.key"),
            format!("{key:?} must be non-empty, without control characters"),
        );
        return None;
    }
    if let Some(value) = &raw.value {
        if raw.name.is_some() {
            problems.add(format!("{at}.name"), "goes only with key: header");
            return None;
        }
        if !printable(value) {
            problems.add(
                format!("{at}.value"),
                format!("{value:?} must be non-empty, without control characters"),
            );
            return None;
        }
        return Some(Entry::Literal {
            key: key.to_owned(),
            value: value.clone(),
        });
    }
    match (key, &raw.name) {
        ("upstream", None) => Some(Entry::Upstream),
        ("app", None) => Some(Entry::App),
        ("header", Some(name)) => match http::HeaderName::from_bytes(name.as_bytes()) {
            Ok(name) => Some(Entry::Header {
                name: name.as_str().to_owned(),
            }),
            Err(_) => {
                problems.add(format!("{at}.name"), format!("{name:?} is not a header name"));
                None
            }
        },
        ("header", None) => {
            problems.add(format!("{at}.name"), "is required with key: header");
            None
        }
        (_, Some(_)) => {
            problems.add(format!("{at}.name"), "goes only with key: header");
            None
        }
        (other, None) => {
            problems.add(
                format!("{at}.value"),
                format!("is required: {other:?} is not upstream, app or header, whose values the sidecar fills in"),
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{parse, to_yaml, Config, ConfigError, Overrides};
    use super::*;

    const ISSUE_EXAMPLE: &str = r#"
upstreams:
  - name: partner
    url: http://partner.example
    global_rate_limit:
      service: http://ratelimit.infra:8081
      domain: egress
      descriptors:
        - [{ key: upstream }]
        - [{ key: upstream }, { key: app }]
        - [{ key: upstream }, { key: header, name: X-Tenant }]
        - [{ key: generic_key, value: openai-org }]
        - [{ key: upstream }, { key: unit, value: tokens }]
      tokens: true
      timeout: 50ms
      failure_mode: allow
      max_wait: 0s
"#;

    fn config(yaml: &str) -> Config {
        parse(yaml, &Overrides::default()).unwrap()
    }

    fn problems(yaml: &str) -> Vec<(String, String)> {
        match parse(yaml, &Overrides::default()) {
            Err(ConfigError::Invalid(p)) => p.into_iter().map(|p| (p.key, p.reason)).collect(),
            other => panic!("expected problems, got {other:?}"),
        }
    }

    #[test]
    fn the_issues_example_reads_as_written_and_renders_back() {
        let c = config(ISSUE_EXAMPLE);
        let section = &c.upstreams[0].settings.global_rate_limit;
        assert!(section.is_on());
        assert_eq!(
            section.service.as_ref().unwrap().to_string(),
            "http://ratelimit.infra:8081"
        );
        assert_eq!(section.domain, "egress");
        let entries: Vec<_> = section.descriptors.iter().map(|d| d.entries.clone()).collect();
        let literal = |k: &str, v: &str| Entry::Literal {
            key: k.into(),
            value: v.into(),
        };
        assert_eq!(
            entries,
            vec![
                vec![Entry::Upstream],
                vec![Entry::Upstream, Entry::App],
                vec![
                    Entry::Upstream,
                    Entry::Header {
                        name: "x-tenant".into()
                    }
                ],
                vec![literal("generic_key", "openai-org")],
                vec![Entry::Upstream, literal("unit", "tokens")],
            ]
        );
        let tokens: Vec<bool> = section
            .descriptors
            .iter()
            .map(DescriptorSpec::counts_tokens)
            .collect();
        assert_eq!(tokens, [false, false, false, false, true]);
        assert_eq!(section.timeout, Duration::from_millis(50));
        assert_eq!(section.failure_mode, FailureMode::Allow);
        assert_eq!(section.max_wait, Duration::ZERO);
        let again = config(&to_yaml(&c));
        assert_eq!(again.upstreams[0].settings.global_rate_limit, *section);
        assert!(
            !to_yaml(&config("")).contains("global_rate_limit"),
            "unset: left out"
        );
    }

    #[test]
    fn an_upstream_merges_over_defaults_key_by_key_and_empty_descriptors_turn_it_off() {
        let c = config(
            r#"
defaults:
  global_rate_limit:
    service: https://rls.internal
    domain: egress
    timeout: 20ms
    failure_mode: deny
    descriptors: [[{ key: upstream }]]
upstreams:
  - name: a
    url: http://a.example
  - name: b
    url: http://b.example
    global_rate_limit:
      descriptors: [[{ key: upstream }, { key: app }]]
      max_wait: 2s
  - name: c
    url: http://c.example
    global_rate_limit: { descriptors: [] }
"#,
        );
        let section = |i: usize| &c.upstreams[i].settings.global_rate_limit;
        assert_eq!(section(0).descriptors, c.defaults.global_rate_limit.descriptors);
        let url = section(1).service.as_ref().unwrap();
        assert_eq!((url.scheme, url.authority.port), (Scheme::Https, 443));
        assert_eq!(section(1).timeout, Duration::from_millis(20));
        assert_eq!(section(1).failure_mode, FailureMode::Deny);
        assert_eq!(section(1).max_wait, Duration::from_secs(2));
        assert_eq!(section(1).descriptors[0].entries, [Entry::Upstream, Entry::App]);
        assert!(section(0).is_on() && section(1).is_on());
        assert!(!section(2).is_on(), "descriptors: [] turns it off");
    }

    #[test]
    fn bad_values_are_problems_naming_their_keys() {
        let found = problems(
            r#"
upstreams:
  - name: a
    url: http://a.example
    global_rate_limit:
      service: grpc://rls:8081
      domain: ""
      descriptors:
        - [{ key: header }]
        - [{ key: tenant }]
        - [{ key: app, name: x-app }]
        - []
        - [{ key: header, name: "bad header" }]
      tokens: true
      timeout: 0s
      failure_mode: maybe
      max_wait: 2h
"#,
        );
        let keys: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
        let p = "upstreams[0].global_rate_limit";
        for want in [
            format!("{p}.service"),
            format!("{p}.domain"),
            format!("{p}.descriptors[0][0].name"),
            format!("{p}.descriptors[1][0].value"),
            format!("{p}.descriptors[2][0].name"),
            format!("{p}.descriptors[3]"),
            format!("{p}.descriptors[4][0].name"),
            format!("{p}.timeout"),
            format!("{p}.failure_mode"),
            format!("{p}.max_wait"),
        ] {
            assert!(keys.contains(&want.as_str()), "{want} missing from {found:?}");
        }
    }

    #[test]
    fn defaults_may_leave_the_service_to_upstreams_and_a_bad_default_is_named_once() {
        let c = config(
            "defaults:\n  global_rate_limit:\n    domain: egress\n    descriptors: [[{ key: upstream }]]\nupstreams:\n  - name: a\n    url: http://a.example\n    global_rate_limit: { service: http://rls:8081 }\n",
        );
        assert!(c.upstreams[0].settings.global_rate_limit.is_on());
        let found = problems(
            "defaults:\n  global_rate_limit: { timeout: 1h }\nupstreams:\n  - name: a\n    url: http://a.example\n    global_rate_limit: { domain: d }\n  - name: b\n    url: http://b.example\n    global_rate_limit: { domain: d }\n",
        );
        let keys: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["defaults.global_rate_limit.timeout"], "{found:?}");
    }

    #[test]
    fn the_whole_section_must_hold_together() {
        let p = "upstreams[0].global_rate_limit";
        let found = problems(
            "upstreams:\n  - name: a\n    url: http://a.example\n    global_rate_limit:\n      descriptors: [[{ key: upstream }]]\n      tokens: true\n",
        );
        let keys: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
        for want in ["service", "domain", "tokens"] {
            assert!(
                keys.contains(&format!("{p}.{want}").as_str()),
                "{want}: {found:?}"
            );
        }
        let found = problems(
            "upstreams:\n  - name: a\n    url: http://a.example\n    global_rate_limit:\n      service: http://rls:8081\n      domain: d\n      descriptors: [[{ key: unit, value: tokens }]]\n",
        );
        assert_eq!(found[0].0, format!("{p}.descriptors"), "{found:?}");
        let found = problems(
            "upstreams:\n  - name: a\n    url: http://a.example\n    llm: { usage: off }\n    global_rate_limit:\n      service: http://rls:8081\n      domain: d\n      tokens: true\n      descriptors: [[{ key: unit, value: tokens }]]\n",
        );
        assert_eq!(
            found[0].0,
            format!("{p}.tokens"),
            "tokens are read by llm.usage: {found:?}"
        );
        let found = problems(
            "upstreams:\n  - name: a\n    url: http://a.example\n    global_rate_limit:\n      service: http://rls:8081\n      domain: d\n      descriptors: [[{ key: upstream, bogus: 1 }]]\n",
        );
        assert!(found[0].0.starts_with(p), "unknown keys are refused: {found:?}");
    }
}
