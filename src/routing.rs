//! Routing: which upstream a request means, and whether policy lets it go there.
//!
//! Owns the contract's "How requests are routed": absolute-form requests pick an upstream by
//! authority (a configured one by `url` or `aliases`, else one made on the fly with `defaults`),
//! origin-form requests on a route-mode listener go to that listener's upstream, and origin-form
//! requests on the main listener are matched by `Host` against configured upstreams only.
//! Requests aimed at the sidecar's own listeners are refused as `loop`. CONNECT targets are
//! checked here too (`policy.connect`, `connect_ports`, host lists, loop), though they never pick
//! an upstream.
//!
//! A reload swaps the routing table whole ([`Router::reload`]); requests already routed finish
//! on the upstream they were given.
//!
//! Not handled here: header rewriting (`proxy::headers`), connections (`pool`), moving tunnel
//! bytes (`proxy::connect`), when to reload (`reload`).

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::Uri;

use crate::config::{Authority, Config, PolicyConfig, Scheme};
use crate::error::{ErrorKind, ProxyError};
use crate::metrics::Metrics;
use crate::reload::Live;
use crate::upstream::{Spec, Upstream};

/// An on-the-fly upstream unused this long (and holding no connection) is forgotten.
const DYNAMIC_UPSTREAM_TTL: Duration = Duration::from_secs(300);
/// How many on-the-fly upstreams may exist before forgetting unused ones is attempted.
const DYNAMIC_UPSTREAM_SWEEP_AT: usize = 1024;

/// Where a downstream request arrived.
#[derive(Debug, Clone)]
pub enum Entry {
    /// The forward-proxy listener.
    Forward,
    /// A route-mode listener bound to the upstream of this name.
    Route(Arc<str>),
}

/// The result of routing: the upstream and the authority the request named.
#[derive(Debug)]
pub struct Target {
    /// Where the request goes.
    pub upstream: Arc<Upstream>,
}

/// A host pattern in `policy.allow_hosts` / `deny_hosts`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// `api.example.com`
    Exact(String),
    /// `*.example.com`: any subdomain (not the apex).
    Suffix(String),
    /// `10.0.0.0/8` or a single IP.
    Net(IpAddr, u8),
}

impl HostPattern {
    /// Parses a pattern, naming what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Some((ip, len)) = text.split_once('/') {
            let ip: IpAddr = ip
                .parse()
                .map_err(|_| format!("{text:?}: {ip:?} is not an IP address"))?;
            let max = if ip.is_ipv4() { 32 } else { 128 };
            let len: u8 = len
                .parse()
                .ok()
                .filter(|l| *l <= max)
                .ok_or_else(|| format!("{text:?}: prefix length must be 0..={max}"))?;
            return Ok(HostPattern::Net(ip, len));
        }
        if let Ok(ip) = text
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            return Ok(HostPattern::Net(ip, if ip.is_ipv4() { 32 } else { 128 }));
        }
        let (suffix, name) = match text.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let valid = !name.is_empty()
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            });
        if !valid {
            return Err(format!("{text:?} is not a host name, *.domain, IP or CIDR"));
        }
        let name = name.to_ascii_lowercase();
        Ok(if suffix {
            HostPattern::Suffix(name)
        } else {
            HostPattern::Exact(name)
        })
    }

    /// Whether `host` (lower-cased name or IP literal) matches.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(name) => host == name,
            HostPattern::Suffix(name) => host
                .strip_suffix(name.as_str())
                .is_some_and(|head| head.ends_with('.') && head.len() > 1),
            HostPattern::Net(net, len) => host.parse::<IpAddr>().is_ok_and(|ip| in_network(ip, *net, *len)),
        }
    }
}

fn in_network(ip: IpAddr, net: IpAddr, len: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

impl fmt::Display for HostPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostPattern::Exact(n) => f.write_str(n),
            HostPattern::Suffix(n) => write!(f, "*.{n}"),
            HostPattern::Net(ip, len) => write!(f, "{ip}/{len}"),
        }
    }
}

impl serde::Serialize for HostPattern {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

type DynamicKey = (Scheme, Authority);
/// An on-the-fly upstream and when a request last used it.
type DynamicEntry = (Arc<Upstream>, Instant);

/// The configured part of routing, replaced whole by a reload.
#[derive(Debug)]
struct Routes {
    config: Arc<Config>,
    by_authority: HashMap<Authority, Arc<Upstream>>,
    by_name: HashMap<Arc<str>, Arc<Upstream>>,
}

impl Routes {
    fn new(config: Arc<Config>, upstreams: &[Arc<Upstream>]) -> Self {
        let mut by_authority = HashMap::new();
        let mut by_name = HashMap::new();
        for up in upstreams {
            for auth in up.authorities() {
                by_authority.insert(auth.clone(), up.clone());
            }
            by_name.insert(Arc::from(up.label()), up.clone());
        }
        Routes {
            config,
            by_authority,
            by_name,
        }
    }
}

/// What a reload did to the configured upstreams.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReloadSummary {
    /// Kept their pool and connections (new pool limits applied).
    pub kept: usize,
    /// New names.
    pub added: usize,
    /// Same name, but where or how connections are made changed: a new pool, the old drains.
    pub replaced: usize,
    /// Gone from the config: their pools drain.
    pub removed: usize,
}

/// Finds upstreams for requests; owns the on-the-fly upstream table.
#[derive(Debug)]
pub struct Router {
    routes: Live<Arc<Routes>>,
    dynamic: Mutex<HashMap<DynamicKey, DynamicEntry>>,
    /// The sidecar's own bound listeners, for loop detection.
    local: Vec<SocketAddr>,
    metrics: Arc<Metrics>,
}

impl Router {
    /// Builds the router over configured upstreams (by name order in `config.upstreams`).
    pub fn new(
        config: Arc<Config>,
        upstreams: &[Arc<Upstream>],
        local: Vec<SocketAddr>,
        metrics: Arc<Metrics>,
    ) -> Self {
        Router {
            routes: Live::new(Arc::new(Routes::new(config, upstreams))),
            dynamic: Mutex::new(HashMap::new()),
            local,
            metrics,
        }
    }

    /// Upstream connections open now, over every pool (draining ones included).
    pub fn upstream_connections(&self) -> usize {
        self.metrics
            .live_pools()
            .iter()
            .map(|pool| pool.open_connections())
            .sum()
    }

    /// The sidecar's own listener addresses.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.routes.get().config.clone()
    }

    /// Switches to `config`: configured upstreams whose pool key is unchanged keep their pools
    /// (with the new limits), others get new pools; pools no longer routed to drain. On-the-fly
    /// upstreams follow the new `defaults` the same way.
    pub fn reload(&self, config: Arc<Config>) -> ReloadSummary {
        let old = self.routes.get();
        let mut summary = ReloadSummary::default();
        let upstreams: Vec<Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|cfg| {
                let previous = old.by_name.get(cfg.name.as_str());
                let up = Upstream::new(
                    Spec::configured(cfg),
                    &self.local,
                    &self.metrics,
                    previous.map(|p| &**p),
                );
                match previous {
                    Some(p) if Arc::ptr_eq(p.pool(), up.pool()) => summary.kept += 1,
                    Some(_) => summary.replaced += 1,
                    None => summary.added += 1,
                }
                Arc::new(up)
            })
            .collect();
        let routes = Arc::new(Routes::new(config, &upstreams));
        let mut unused: Vec<Arc<Upstream>> = Vec::new();
        {
            let mut table = self.dynamic.lock().unwrap_or_else(|p| p.into_inner());
            let entries: Vec<_> = table.drain().collect();
            for ((scheme, authority), (up, used)) in entries {
                if routes.by_authority.contains_key(&authority) {
                    unused.push(up); // now a configured upstream
                    continue;
                }
                let spec = Spec::dynamic(scheme, authority.clone(), &routes.config);
                let next = Upstream::new(spec, &self.local, &self.metrics, Some(&up));
                if !Arc::ptr_eq(next.pool(), up.pool()) {
                    unused.push(up);
                }
                table.insert((scheme, authority), (Arc::new(next), used));
            }
            self.routes.set(routes.clone());
        }
        for (name, up) in &old.by_name {
            let kept = routes
                .by_name
                .get(name)
                .is_some_and(|next| Arc::ptr_eq(next.pool(), up.pool()));
            if !kept {
                summary.removed += usize::from(!routes.by_name.contains_key(name));
                unused.push(up.clone());
            }
        }
        for up in unused {
            up.pool().retire("reload");
        }
        summary
    }

    /// Checks a CONNECT request's authority-form target, in order: `policy.connect`,
    /// `policy.connect_ports`, the host lists, then the sidecar's own listeners.
    pub fn check_connect_target(&self, target: &str) -> Result<Authority, ProxyError> {
        let bad = |why: String| ProxyError::new(ErrorKind::BadRequest, why);
        let parsed: http::uri::Authority = target
            .parse()
            .map_err(|e| bad(format!("CONNECT target {target:?} is not host:port: {e}")))?;
        if parsed.port().is_none() {
            return Err(bad(format!("CONNECT target {target:?} needs a port (host:port)")));
        }
        let authority = Authority::parse(target, 0).map_err(|e| bad(format!("CONNECT target: {e}")))?;
        let config = self.config();
        let policy = &config.policy;
        // The hint matters: a tunnel hides the requests from the sidecar, so apps that use
        // HTTPS_PROXY get no pooling; the fix is on their side.
        const HINT: &str = "send plain http:// requests through the sidecar to get pooled, \
                            TLS-originating connections";
        if !policy.connect {
            return Err(ProxyError::new(
                ErrorKind::Denied,
                format!("CONNECT to {authority} is not allowed (policy.connect: false); {HINT}"),
            ));
        }
        if !policy.connect_ports.contains(&authority.port) {
            let ports: Vec<String> = policy.connect_ports.iter().map(u16::to_string).collect();
            return Err(ProxyError::new(
                ErrorKind::Denied,
                format!(
                    "CONNECT to {authority} is not allowed (policy.connect_ports: [{}]); {HINT}",
                    ports.join(", ")
                ),
            ));
        }
        check_policy(policy, &authority)?;
        self.check_loop(&authority)?;
        Ok(authority)
    }

    /// Routes a request by its target URI and `Host` header.
    pub fn route(&self, entry: &Entry, uri: &Uri, host: Option<&str>) -> Result<Target, ProxyError> {
        let routes = self.routes.get();
        if let (Entry::Route(name), None) = (entry, uri.scheme()) {
            let upstream = routes.by_name.get(name).cloned().ok_or_else(|| {
                ProxyError::new(
                    ErrorKind::UnknownUpstream,
                    "this listener's upstream left the config",
                )
                .with_upstream(name.to_string())
            })?;
            return Ok(Target { upstream });
        }
        let (scheme, authority) = match (uri.scheme_str(), uri.authority()) {
            (Some(s), Some(a)) => {
                let scheme = match s {
                    "http" => Scheme::Http,
                    "https" => Scheme::Https,
                    other => {
                        return Err(ProxyError::new(
                            ErrorKind::BadRequest,
                            format!("scheme {other:?} cannot be proxied; use http://"),
                        ))
                    }
                };
                let auth = Authority::parse(a.as_str(), scheme.default_port())
                    .map_err(|e| ProxyError::new(ErrorKind::BadRequest, format!("request target: {e}")))?;
                (Some(scheme), auth)
            }
            (None, None) => {
                let host = host.ok_or_else(|| {
                    ProxyError::new(
                        ErrorKind::BadRequest,
                        "origin-form request without Host; send absolute-form requests \
                         (HTTP_PROXY=http://<this listener>) or use a route-mode listener",
                    )
                })?;
                let auth = Authority::parse(host, 80)
                    .map_err(|e| ProxyError::new(ErrorKind::BadRequest, format!("Host: {e}")))?;
                (None, auth)
            }
            _ => {
                return Err(ProxyError::new(
                    ErrorKind::BadRequest,
                    format!("request target {uri} is neither absolute-form nor origin-form"),
                ))
            }
        };
        self.check_loop(&authority)?;
        check_policy(&routes.config.policy, &authority)?;
        if let Some(up) = routes.by_authority.get(&authority) {
            return Ok(Target { upstream: up.clone() });
        }
        match scheme {
            Some(scheme) => Ok(Target {
                upstream: self.dynamic_upstream(&routes.config, scheme, authority),
            }),
            None => Err(ProxyError::new(
                ErrorKind::UnknownUpstream,
                format!(
                    "Host {authority} is not a configured upstream; send absolute-form requests \
                     (HTTP_PROXY=http://<this listener>) or add it under upstreams"
                ),
            )
            .with_upstream(authority.to_string())),
        }
    }

    /// Refuses authorities that are the sidecar's own listeners.
    fn check_loop(&self, authority: &Authority) -> Result<(), ProxyError> {
        let ip = match authority.host.as_str() {
            "localhost" => Some(IpAddr::from([127, 0, 0, 1])),
            host => host.parse::<IpAddr>().ok(),
        };
        let is_self = ip.is_some_and(|ip| {
            self.local
                .iter()
                .any(|local| is_same_listener(*local, SocketAddr::new(ip, authority.port)))
        });
        if is_self {
            return Err(ProxyError::new(
                ErrorKind::Loop,
                format!(
                    "{authority} is this sidecar; send absolute-form requests \
                     (HTTP_PROXY=http://{authority}) for other hosts"
                ),
            )
            .with_upstream(authority.to_string()));
        }
        Ok(())
    }

    fn dynamic_upstream(&self, config: &Config, scheme: Scheme, authority: Authority) -> Arc<Upstream> {
        let mut authority = authority;
        let scheme = if scheme == Scheme::Http && config.tls_hosts.contains(&authority.host) {
            if authority.port == Scheme::Http.default_port() {
                authority.port = Scheme::Https.default_port();
            }
            Scheme::Https
        } else {
            scheme
        };
        let now = Instant::now();
        let mut table = self.dynamic.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((up, used)) = table.get_mut(&(scheme, authority.clone())) {
            *used = now;
            return up.clone();
        }
        if table.len() >= DYNAMIC_UPSTREAM_SWEEP_AT {
            table.retain(|_, (up, used)| {
                now.duration_since(*used) < DYNAMIC_UPSTREAM_TTL || up.pool().open_connections() > 0
            });
        }
        let up = Arc::new(Upstream::dynamic(
            scheme,
            authority.clone(),
            config,
            &self.local,
            &self.metrics,
        ));
        table.insert((scheme, authority), (up.clone(), now));
        up
    }
}

fn check_policy(policy: &PolicyConfig, authority: &Authority) -> Result<(), ProxyError> {
    if !host_allowed(policy, &authority.host) {
        return Err(ProxyError::new(
            ErrorKind::Denied,
            format!("{} is not allowed by policy", authority.host),
        )
        .with_upstream(authority.to_string()));
    }
    Ok(())
}

/// Whether two addresses are the same listening socket (a listener on 0.0.0.0 is every
/// local address on its port).
pub fn is_same_listener(local: SocketAddr, target: SocketAddr) -> bool {
    if local.port() != target.port() {
        return false;
    }
    let target_ip = target.ip();
    local.ip() == target_ip
        || (local.ip().is_unspecified() && (target_ip.is_loopback() || target_ip.is_unspecified()))
}

/// Deny patterns first, then the allow list (empty = any host).
pub fn host_allowed(policy: &PolicyConfig, host: &str) -> bool {
    if policy.deny_hosts.iter().any(|p| p.matches(host)) {
        return false;
    }
    policy.allow_hosts.is_empty() || policy.allow_hosts.iter().any(|p| p.matches(host))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let suffix = HostPattern::parse("*.Example.com").unwrap();
        assert!(suffix.matches("api.example.com"));
        assert!(!suffix.matches("example.com"));
        assert!(!suffix.matches("badexample.com"));
        let net = HostPattern::parse("10.0.0.0/8").unwrap();
        assert!(net.matches("10.1.2.3"));
        assert!(!net.matches("11.1.2.3"));
        assert!(!net.matches("ten.example"));
        assert!(HostPattern::parse("10.0.0.0/40").is_err());
        assert!(HostPattern::parse("bad host").is_err());
        assert_eq!(HostPattern::parse("::1").unwrap().to_string(), "::1/128");
    }

    #[test]
    fn connect_targets_are_checked_in_order() {
        let router = |yaml: &str| {
            let config = crate::config::parse(yaml, &Default::default()).unwrap();
            Router::new(
                Arc::new(config),
                &[],
                vec!["127.0.0.1:15080".parse().unwrap()],
                Default::default(),
            )
        };
        let kind = |r: &Router, target: &str| r.check_connect_target(target).map_err(|e| e.kind());
        let open = router("policy: { connect_ports: [443, 15080], deny_hosts: [bad.example] }\n");
        assert_eq!(
            kind(&open, "API.example.com:443"),
            Ok(Authority::parse("api.example.com:443", 0).unwrap())
        );
        assert_eq!(kind(&open, "api.example.com"), Err(ErrorKind::BadRequest));
        assert_eq!(kind(&open, "api.example.com:0"), Err(ErrorKind::BadRequest));
        assert_eq!(kind(&open, "api.example.com:8443"), Err(ErrorKind::Denied));
        assert_eq!(kind(&open, "bad.example:443"), Err(ErrorKind::Denied));
        assert_eq!(kind(&open, "localhost:15080"), Err(ErrorKind::Loop));
        // The port rule comes before the loop check.
        let default_ports = router("");
        assert_eq!(kind(&default_ports, "127.0.0.1:15080"), Err(ErrorKind::Denied));
        let off = router("policy: { connect: false }\n");
        let err = off.check_connect_target("api.example.com:443").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Denied);
        assert!(err.to_string().contains("policy.connect: false"), "{err}");
    }

    #[test]
    fn same_listener() {
        let any: SocketAddr = "0.0.0.0:15080".parse().unwrap();
        let lo: SocketAddr = "127.0.0.1:15080".parse().unwrap();
        assert!(is_same_listener(any, lo));
        assert!(!is_same_listener(lo, "127.0.0.2:15080".parse().unwrap()));
        assert!(!is_same_listener(lo, "127.0.0.1:15081".parse().unwrap()));
        assert!(!is_same_listener(lo, "10.0.0.1:15080".parse().unwrap()));
    }
}
