//! The `via` keys: a parent proxy upstreams are reached through, typed and validated, and the
//! choice of parent for one upstream (including the sidecar's own `HTTP(S)_PROXY`/`NO_PROXY`).

use std::path::PathBuf;

use serde::Serialize;

use super::problems::Problems;
use super::schema::FileVia;
use super::{Authority, HostPattern, Scheme};
use crate::redact;

/// How an upstream is reached.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ViaConfig {
    /// Direct, a parent proxy, or the sidecar's own proxy environment.
    pub url: Via,
    /// One line `user:password` for `Proxy-Authorization`; re-read when it changes.
    pub credentials_file: Option<PathBuf>,
    /// CA certificates (PEM) an `https://` parent's certificate may chain to, beside the
    /// system store.
    pub ca_file: Option<PathBuf>,
    /// Hosts reached directly whatever `url` says.
    pub no_via: Vec<HostPattern>,
}

/// `via.url`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Via {
    /// No parent (the default).
    #[default]
    Direct,
    /// The sidecar's own `HTTPS_PROXY` (https upstreams), `HTTP_PROXY` (http upstreams) and
    /// `NO_PROXY`, read when the upstream is built.
    Env,
    /// A parent proxy.
    Parent(ParentUrl),
}

impl Serialize for Via {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Via::Direct => s.serialize_str("direct"),
            Via::Env => s.serialize_str("env"),
            Via::Parent(p) => s.collect_str(&p.display()),
        }
    }
}

/// A parent proxy's address, and the credentials its URL carried (from the environment only:
/// the config file names a `credentials_file` instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentUrl {
    /// `http` (plain) or `https` (TLS to the parent).
    pub scheme: Scheme,
    /// Host and port.
    pub authority: Authority,
    /// `user:password` from the URL's userinfo, if any.
    pub userinfo: Option<String>,
}

impl ParentUrl {
    /// Parses `http://host:port` (port default 3128 for http, 443 for https), with optional
    /// `user:password@`.
    /// Errors show `text` without its userinfo.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        let shown = redact::target(text);
        let (scheme, rest) = if let Some(rest) = text.strip_prefix("http://") {
            (Scheme::Http, rest)
        } else if let Some(rest) = text.strip_prefix("https://") {
            (Scheme::Https, rest)
        } else {
            return Err(format!(
                "{shown:?} is not direct, env, or an http:// or https:// proxy URL"
            ));
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.contains('/') || rest.contains('?') {
            return Err(format!("{shown:?}: a proxy URL has no path"));
        }
        let (userinfo, hostport) = match rest.rsplit_once('@') {
            Some((user, host)) => (Some(percent_decode(user)), host),
            None => (None, rest),
        };
        let default_port = match scheme {
            Scheme::Http => 3128,
            Scheme::Https => 443,
        };
        let authority = Authority::parse(hostport, default_port).map_err(|e| format!("{shown:?}: {e}"))?;
        Ok(ParentUrl {
            scheme,
            authority,
            userinfo,
        })
    }

    /// The URL without credentials, as logs, errors and `/debug/pools` show it.
    pub fn display(&self) -> String {
        format!("{}://{}", self.scheme.as_str(), self.authority)
    }
}

/// The parent one upstream goes through, and what reaching it takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentRoute {
    /// The parent's address.
    pub url: ParentUrl,
    /// `via.credentials_file`.
    pub credentials_file: Option<PathBuf>,
    /// `via.ca_file`.
    pub ca_file: Option<PathBuf>,
}

impl ViaConfig {
    /// The parent `host` (an upstream's, in canonical form) is reached through, if any, for an
    /// upstream of `scheme`; `env` reads the sidecar's environment now.
    pub fn parent_for(&self, scheme: Scheme, host: &str) -> Option<ParentRoute> {
        if self.no_via.iter().any(|p| p.matches(host)) {
            return None;
        }
        let url = match &self.url {
            Via::Direct => None,
            Via::Parent(parent) => Some(parent.clone()),
            Via::Env => from_env(scheme, host, |name| std::env::var(name).ok()),
        }?;
        Some(ParentRoute {
            url,
            credentials_file: self.credentials_file.clone(),
            ca_file: self.ca_file.clone(),
        })
    }
}

/// The parent the proxy environment names for `host`, curl's way: `HTTPS_PROXY` for https,
/// `HTTP_PROXY` for http (upper or lower case), none when `NO_PROXY` lists the host (a name,
/// its parent domain with or without a leading dot, an IP or CIDR, or `*`).
fn from_env(scheme: Scheme, host: &str, var: impl Fn(&str) -> Option<String>) -> Option<ParentUrl> {
    let get = |upper: &str| {
        var(upper)
            .or_else(|| var(&upper.to_ascii_lowercase()))
            .filter(|v| !v.trim().is_empty())
    };
    if let Some(no_proxy) = get("NO_PROXY") {
        if no_proxy
            .split(',')
            .any(|entry| no_proxy_matches(entry.trim(), host))
        {
            return None;
        }
    }
    let name = match scheme {
        Scheme::Https => "HTTPS_PROXY",
        Scheme::Http => "HTTP_PROXY",
    };
    let url = get(name)?;
    // A bare host:port means http://, as curl and Go read it.
    let url = if url.contains("://") {
        url
    } else {
        format!("http://{url}")
    };
    match ParentUrl::parse(&url) {
        Ok(parent) => Some(parent),
        Err(why) => {
            tracing::warn!("{name} ignored: {why}");
            None
        }
    }
}

fn no_proxy_matches(entry: &str, host: &str) -> bool {
    if entry.is_empty() {
        return false;
    }
    if entry == "*" {
        return true;
    }
    let entry = entry.strip_prefix("*.").unwrap_or(entry);
    let entry = entry.strip_prefix('.').unwrap_or(entry).to_ascii_lowercase();
    if let Ok(pattern) = HostPattern::parse(&entry) {
        if matches!(pattern, HostPattern::Net(..)) {
            return pattern.matches(host);
        }
    }
    host == entry
        || host
            .strip_suffix(entry.as_str())
            .is_some_and(|head| head.ends_with('.'))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `via` under `prefix`: absent keeps `base`; present replaces it as a whole (a different
/// parent rarely shares the default's credentials or exceptions).
pub(super) fn merge_via(
    base: &ViaConfig,
    raw: &Option<FileVia>,
    prefix: &str,
    problems: &mut Problems,
) -> ViaConfig {
    let Some(raw) = raw else {
        return base.clone();
    };
    let key = |k: &str| format!("{prefix}.{k}");
    let url = match raw.url.as_deref().map(str::trim) {
        None | Some("direct") => Via::Direct,
        Some("env") => Via::Env,
        Some(text) => match ParentUrl::parse(text) {
            Ok(parent) if parent.userinfo.is_some() => {
                problems.add(
                    key("url"),
                    "credentials do not go in the URL here (it is logged): use via.credentials_file",
                );
                Via::Parent(parent)
            }
            Ok(parent) => Via::Parent(parent),
            Err(why) => {
                problems.add(key("url"), why);
                Via::Direct
            }
        },
    };
    if let Some(path) = &raw.credentials_file {
        match std::fs::read_to_string(path) {
            Ok(text) if text.trim().contains(':') => {}
            Ok(_) => problems.add(
                key("credentials_file"),
                format!("{}: not one line user:password", path.display()),
            ),
            Err(e) => problems.add(key("credentials_file"), format!("{}: {e}", path.display())),
        }
    }
    if let Some(path) = &raw.ca_file {
        if let Err(why) = super::load_ca_file(path) {
            problems.add(key("ca_file"), why);
        }
    }
    let mut no_via = Vec::new();
    for (i, text) in raw.no_via.iter().flatten().enumerate() {
        match HostPattern::parse(text) {
            Ok(p) => no_via.push(p),
            Err(why) => problems.add(format!("{prefix}.no_via[{i}]"), why),
        }
    }
    ViaConfig {
        url,
        credentials_file: raw.credentials_file.clone(),
        ca_file: raw.ca_file.clone(),
        no_via,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parent_urls() {
        let p = ParentUrl::parse("http://proxy.corp:3128").unwrap();
        assert_eq!(
            (p.scheme, p.authority.to_string()),
            (Scheme::Http, "proxy.corp:3128".to_owned())
        );
        assert_eq!(
            ParentUrl::parse("http://proxy.corp").unwrap().authority.port,
            3128
        );
        let p = ParentUrl::parse("http://us%40r:p%3Ass@10.0.0.1:8080/").unwrap();
        assert_eq!(p.userinfo.as_deref(), Some("us@r:p:ss"));
        assert_eq!(p.display(), "http://10.0.0.1:8080", "no credentials shown");
        assert!(ParentUrl::parse("socks5://proxy:1080").is_err());
        assert!(ParentUrl::parse("http://proxy:3128/path").is_err());
    }

    #[test]
    fn the_environment_curls_way() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        let vars = env(&[
            ("HTTPS_PROXY", "http://squid:3128"),
            ("http_proxy", "squid-plain:3128"),
            (
                "NO_PROXY",
                "localhost,.svc.cluster.local,10.0.0.0/8,internal.example",
            ),
        ]);
        let parent = |scheme, host| from_env(scheme, host, vars).map(|p| p.display());
        assert_eq!(
            parent(Scheme::Https, "api.openai.com").as_deref(),
            Some("http://squid:3128")
        );
        assert_eq!(
            parent(Scheme::Http, "api.example.com").as_deref(),
            Some("http://squid-plain:3128")
        );
        for direct in [
            "localhost",
            "billing.svc.cluster.local",
            "10.1.2.3",
            "internal.example",
            "a.internal.example",
        ] {
            assert_eq!(parent(Scheme::Https, direct), None, "{direct}");
        }
        assert_eq!(
            parent(Scheme::Https, "notinternal.example").as_deref(),
            Some("http://squid:3128")
        );
        assert_eq!(
            from_env(
                Scheme::Https,
                "x",
                env(&[("NO_PROXY", "*"), ("HTTPS_PROXY", "http://p:1")])
            ),
            None
        );
    }
}
