//! Routing: which upstream a request means, and whether policy lets it go there.
//!
//! Owns the contract's "How requests are routed": absolute-form requests pick an upstream by
//! authority (a configured one by `url` or `aliases`, else one made on the fly with `defaults`),
//! origin-form requests on a route-mode listener go to that listener's upstream, and origin-form
//! requests on the main listener are matched by `Host` against configured upstreams only.
//! Requests aimed at the sidecar's own listeners are refused as `loop`. CONNECT targets are
//! checked and routed here too (`policy.connect`, `connect_ports`, host lists, loop): an opaque
//! tunnel's route ([`OpaqueDial`]) carries everything its dial needs (the configured upstream's
//! endpoints, else the resolver; the parent proxy; the connect timeout; the policy guard), so
//! that `proxy::connect` dials from it without asking the router again.
//!
//! Upstreams met on the fly live in [`on_the_fly::Table`]: a quiet one is let go, its host
//! remembered there, and a host unused for 5 minutes is forgotten ([`Router::sweep_on_the_fly`]).
//!
//! A reload swaps the routing table whole ([`Router::reload`]); requests already routed finish
//! on the upstream they were given.
//!
//! Not handled here: header rewriting (`proxy::headers`), connections (`pool`), dialing and
//! answering a CONNECT (`proxy::connect`), moving tunnel bytes (`tunnel`), when to reload
//! (`reload`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderMap, Uri};
use rustc_hash::FxHashMap;

use crate::config::{Authority, Config, Scheme};
use crate::connector::dial::{DialTarget, Resolve};
use crate::connector::parent::Parent;
use crate::endpoint::dns::Resolver;
use crate::endpoint::Set;
use crate::error::{ErrorKind, ProxyError};
use crate::live::Live;
use crate::metrics::{ActiveGuard, Metrics};
use crate::policy::Guard;
use crate::redact;
use crate::reload::Summary;
use crate::upstream::{Shared, Spec, Upstream};
use on_the_fly::Met;

pub mod on_the_fly;

/// Where a downstream request arrived.
#[derive(Debug, Clone)]
pub enum Arrival {
    /// The forward-proxy listener.
    Forward,
    /// A route-mode listener bound to the upstream of this name.
    Route(Arc<str>),
    /// Inside a CONNECT that the sidecar answered itself and serves as HTTP, because the
    /// client speaks plain HTTP in it: every request goes to the CONNECT's authority.
    Inspected(Arc<Inspected>),
}

/// A CONNECT answered here and served as plain HTTP (`policy.connect_inspect`), shared by its
/// connection and its requests: while any holds it, it counts in `egress_tunnels_active`
/// (kinds `connect_http`, `connect_h2`). Not a tunnel in the sidecar's sense: no bytes are
/// spliced, its requests go through the pool.
#[derive(Debug)]
pub struct Inspected {
    /// The CONNECT authority.
    pub authority: Authority,
    _active: ActiveGuard,
}

impl Inspected {
    /// A CONNECT to `authority` served as HTTP, counted under `kind` (`connect_http` or
    /// `connect_h2`).
    pub fn new(authority: Authority, metrics: &Metrics, kind: &'static str) -> Self {
        Inspected {
            authority,
            _active: ActiveGuard::new(metrics, kind),
        }
    }
}

/// Where an allowed CONNECT goes: the CONNECT's route, as [`Route`] is a request's.
#[derive(Debug)]
pub enum ConnectRoute {
    /// A port in `policy.connect_ports`: dialed as this says and spliced, unseen.
    Opaque(OpaqueDial),
    /// Any other port, with `policy.connect_inspect`: answered here, and what the client sends
    /// inside is served if it is plain HTTP.
    Inspect(Authority),
}

/// Everything the dial of an opaque tunnel needs, decided when it is routed: through the
/// endpoints of the configured upstream the target names (its static `addresses`, balance and
/// ejections), else what the resolver finds; chained through a parent proxy when that upstream
/// (or `defaults.via`, for other hosts) names one.
#[derive(Debug)]
pub struct OpaqueDial {
    authority: Authority,
    first_hop: FirstHop,
    parent: Option<Arc<Parent>>,
    connect_timeout: Duration,
    guard: Arc<Guard>,
}

/// Where the addresses of an opaque tunnel's first hop come from.
#[derive(Debug)]
enum FirstHop {
    /// The configured upstream's endpoint set (through a parent, the parent's).
    Endpoints(Arc<Set>),
    /// The resolver, for the parent proxy of `defaults.via`.
    Parent(Arc<Resolver>),
    /// The resolver, for the target's host.
    Name(Arc<Resolver>),
}

impl OpaqueDial {
    /// The CONNECT target.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The parent proxy the tunnel is chained through, with a CONNECT of its own.
    pub fn parent(&self) -> Option<&Arc<Parent>> {
        self.parent.as_ref()
    }

    /// Deadline for resolving and connecting, and for a parent's answer.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The first hop to dial (the target, or the parent), named `label` in errors.
    pub fn first_hop<'a>(&'a self, label: &'a str) -> DialTarget<'a> {
        let (authority, resolve) = match (&self.first_hop, &self.parent) {
            (FirstHop::Endpoints(set), _) => (&self.authority, Resolve::Endpoints(set)),
            (FirstHop::Parent(resolver), Some(parent)) => (parent.authority(), Resolve::Parent(resolver)),
            (FirstHop::Parent(resolver) | FirstHop::Name(resolver), _) => {
                (&self.authority, Resolve::Name(resolver))
            }
        };
        DialTarget {
            label,
            authority,
            resolve,
            connect_timeout: self.connect_timeout,
            guard: &self.guard,
        }
    }
}

/// The result of routing: the upstream the request goes to.
#[derive(Debug)]
pub struct Route {
    /// Where the request goes.
    pub upstream: Arc<Upstream>,
}

/// The configured part of routing, replaced whole by a reload.
#[derive(Debug)]
struct Routes {
    config: Arc<Config>,
    // Fx, not SipHash: every key is the config's; requests only look them up.
    by_authority: FxHashMap<Authority, Arc<Upstream>>,
    by_name: FxHashMap<Arc<str>, Arc<Upstream>>,
}

impl Routes {
    fn new(config: Arc<Config>, upstreams: &[Arc<Upstream>]) -> Self {
        let mut by_authority = FxHashMap::default();
        let mut by_name = FxHashMap::default();
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

/// Finds upstreams for requests; owns the on-the-fly upstream table.
#[derive(Debug)]
pub struct Router {
    routes: Live<Arc<Routes>>,
    /// The upstreams met on the fly.
    on_the_fly: Arc<on_the_fly::Table>,
    /// The policy, metrics and pool registry every upstream is built with.
    shared: Shared,
}

impl Router {
    /// Builds the router over configured upstreams (by name order in `config.upstreams`).
    pub fn new(config: Arc<Config>, upstreams: &[Arc<Upstream>], shared: Shared) -> Self {
        Router {
            routes: Live::new(Arc::new(Routes::new(config, upstreams))),
            on_the_fly: Arc::default(),
            shared,
        }
    }

    /// Upstream connections open now, over every pool (draining ones included).
    pub fn upstream_connections(&self) -> usize {
        self.shared.pools.open_connections()
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.routes.get().config.clone()
    }

    /// Switches to `config`: configured upstreams whose pool key is unchanged keep their pools
    /// (with the new limits), others get new pools; pools no longer routed to drain. On-the-fly
    /// upstreams follow the new `defaults` the same way.
    pub fn reload(&self, config: Arc<Config>) -> Summary {
        let old = self.routes.get();
        let mut summary = Summary::default();
        let upstreams: Vec<Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|cfg| {
                let previous = old.by_name.get(cfg.name.as_str());
                let up = Upstream::new(Spec::configured(cfg), &self.shared, previous.map(|p| &**p));
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
            let mut maps = self.on_the_fly.lock();
            let entries: Vec<_> = maps.live.drain().collect();
            for ((scheme, authority), Met { upstream: up, used }) in entries {
                // Now a configured upstream, or denied: the pool closes.
                if routes.by_authority.contains_key(&authority)
                    || check_policy(&routes.config, &authority).is_err()
                {
                    unused.push(up);
                    continue;
                }
                let spec = Spec::dynamic(scheme, authority.clone(), &routes.config);
                let next = Upstream::new(spec, &self.shared, Some(&up));
                if !Arc::ptr_eq(next.pool(), up.pool()) {
                    unused.push(up);
                }
                let upstream = Arc::new(next);
                maps.live.insert((scheme, authority), Met { upstream, used });
            }
            self.shared.guard.set_policy(routes.config.policy.clone());
            self.shared.resolver.reconfigure(&routes.config.dns);
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
            up.retire("reload");
        }
        summary
    }

    /// Checks a CONNECT request's authority-form target, in order: `policy.connect`, the port
    /// (`policy.connect_ports`, else `policy.connect_inspect`), the host lists, then the
    /// sidecar's own listeners; and routes it, with what its dial needs.
    pub fn route_connect(&self, target: &str) -> Result<ConnectRoute, ProxyError> {
        let bad = |why: String| ProxyError::new(ErrorKind::BadRequest, why);
        let parsed: http::uri::Authority = target.parse().map_err(|e| {
            bad(format!(
                "CONNECT target {:?} is not host:port: {e}",
                redact::target(target)
            ))
        })?;
        if parsed.port().is_none() {
            let shown = redact::authority(target);
            return Err(bad(format!("CONNECT target {shown:?} needs a port (host:port)")));
        }
        let authority = Authority::parse(target, 0).map_err(|e| bad(format!("CONNECT target: {e}")))?;
        let routes = self.routes.get();
        let config = &routes.config;
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
        let opaque = policy.connect_ports.contains(&authority.port);
        if !opaque && !policy.connect_inspect {
            let ports: Vec<String> = policy.connect_ports.iter().map(u16::to_string).collect();
            return Err(ProxyError::new(
                ErrorKind::Denied,
                format!(
                    "CONNECT to {authority} is not allowed (policy.connect_ports: [{}]); {HINT}",
                    ports.join(", ")
                ),
            ));
        }
        check_policy(config, &authority)?;
        self.check_loop(&authority)?;
        if !opaque {
            return Ok(ConnectRoute::Inspect(authority));
        }
        let configured = routes.by_authority.get(&authority);
        Ok(ConnectRoute::Opaque(
            self.opaque_dial(authority, configured, config),
        ))
    }

    /// How to dial an opaque tunnel to `authority`, which `configured` names if any.
    fn opaque_dial(
        &self,
        authority: Authority,
        configured: Option<&Arc<Upstream>>,
        config: &Config,
    ) -> OpaqueDial {
        let parent = match &configured {
            Some(up) => up.parent().cloned(),
            None => {
                let via = &config.defaults.via;
                via.parent_for(Scheme::Https, &authority.host)
                    .map(|route| Arc::new(Parent::new(route)))
            }
        };
        let resolver = || self.shared.resolver.clone();
        let (first_hop, connect_timeout) = match (&configured, &parent) {
            (Some(up), _) => (FirstHop::Endpoints(up.endpoints().clone()), up.connect_timeout()),
            (None, Some(_)) => (FirstHop::Parent(resolver()), config.defaults.connect_timeout),
            (None, None) => (FirstHop::Name(resolver()), config.defaults.connect_timeout),
        };
        OpaqueDial {
            authority,
            first_hop,
            parent,
            connect_timeout,
            guard: self.shared.guard.clone(),
        }
    }

    /// Routes a request by its target URI and `Host` header (looked up only for an origin-form
    /// request on the main listener, the one case that reads it).
    pub fn route(&self, arrival: &Arrival, uri: &Uri, headers: &HeaderMap) -> Result<Route, ProxyError> {
        if let (Arrival::Route(name), None) = (arrival, uri.scheme()) {
            // In place: the routes' count taken and given back was two atomic
            // read-modify-writes per request.
            let upstream = self.routes.with(|routes| routes.by_name.get(name).cloned());
            let upstream = upstream.ok_or_else(|| {
                ProxyError::new(
                    ErrorKind::UnknownUpstream,
                    "this listener's upstream left the config",
                )
                .with_upstream(name.to_string())
            })?;
            return Ok(Route { upstream });
        }
        let routes = self.routes.get();
        let (scheme, authority) = match (arrival, uri.scheme_str(), uri.authority()) {
            (Arrival::Inspected(inspected), _, _) => {
                check_inspected_target(&inspected.authority, uri)?;
                (Some(Scheme::Http), inspected.authority.clone())
            }
            (_, Some(s), Some(a)) => {
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
            (_, None, None) => {
                let host = headers.get(http::header::HOST).and_then(|h| h.to_str().ok());
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
                    format!(
                        "request target {} is neither absolute-form nor origin-form",
                        redact::uri(uri)
                    ),
                ))
            }
        };
        self.check_loop(&authority)?;
        check_policy(&routes.config, &authority)?;
        if let Some(up) = routes.by_authority.get(&authority) {
            return Ok(Route { upstream: up.clone() });
        }
        match scheme {
            Some(scheme) => Ok(Route {
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
            self.shared
                .guard
                .is_own_listener(SocketAddr::new(ip, authority.port))
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
        let key = (scheme, authority);
        self.on_the_fly
            .get_or_make(key, Instant::now(), |(scheme, authority), learned| {
                Arc::new(Upstream::dynamic(
                    *scheme,
                    authority.clone(),
                    config,
                    &self.shared,
                    learned,
                ))
            })
    }

    /// Lets quiet on-the-fly upstreams go and forgets unused hosts
    /// ([`on_the_fly::Table::sweep`]); then drops what the registries still hold of the
    /// upstreams that went, so their memory goes too.
    pub fn sweep_on_the_fly(&self, now: Instant) -> on_the_fly::Swept {
        let routes = self.routes.get();
        let metrics = &self.shared.metrics;
        let swept = self.on_the_fly.sweep(now, |label| {
            // A configured upstream may bear a host:port as its name.
            if !routes.by_name.contains_key(label) {
                metrics.forget_upstream(label);
            }
        });
        if swept != on_the_fly::Swept::default() {
            self.shared.pools.prune();
            self.shared.paces.prune();
            self.shared.metrics.prune_pool_sources();
        }
        swept
    }

    /// The on-the-fly upstreams' table, for `/debug/pools`.
    pub fn on_the_fly(&self) -> Arc<on_the_fly::Table> {
        self.on_the_fly.clone()
    }
}

/// A request inside an inspected CONNECT goes where the CONNECT goes: an absolute-form target
/// naming another authority is refused, never rerouted.
fn check_inspected_target(tunnel: &Authority, uri: &Uri) -> Result<(), ProxyError> {
    let Some(named) = uri.authority() else {
        return Ok(());
    };
    let same = uri.scheme_str() == Some("http")
        && Authority::parse(named.as_str(), Scheme::Http.default_port()).is_ok_and(|a| a == *tunnel);
    if same {
        return Ok(());
    }
    Err(ProxyError::new(
        ErrorKind::BadRequest,
        format!(
            "a request inside the CONNECT tunnel to {tunnel} names {}; send it to {tunnel} only",
            redact::uri(uri)
        ),
    ))
}

fn check_policy(config: &Config, authority: &Authority) -> Result<(), ProxyError> {
    config
        .policy
        .check_host(&authority.host)
        .map_err(|why| ProxyError::new(ErrorKind::Denied, why).with_upstream(authority.to_string()))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// What a CONNECT route says, to compare.
    #[derive(Debug, PartialEq)]
    enum Routed {
        Opaque(Authority),
        Inspect(Authority),
    }

    /// A router over `yaml`, its own listener 127.0.0.1:15080, no configured upstream.
    pub(super) fn router(yaml: &str) -> Router {
        let config = crate::config::parse(yaml, &Default::default()).unwrap();
        let guard = Guard::new(vec!["127.0.0.1:15080".parse().unwrap()], config.policy.clone());
        let resolver = Arc::new(crate::endpoint::dns::Resolver::new(&config.dns));
        Router::new(
            Arc::new(config),
            &[],
            Shared {
                guard: Arc::new(guard),
                metrics: Default::default(),
                pools: Default::default(),
                resolver,
                paces: Default::default(),
                rate_limit_services: Default::default(),
            },
        )
    }

    #[test]
    fn connect_targets_are_checked_in_order() {
        // The route's kind and authority (an opaque one carries its dial too).
        let kind = |r: &Router, target: &str| {
            r.route_connect(target)
                .map(|route| match route {
                    ConnectRoute::Opaque(dial) => Routed::Opaque(dial.authority().clone()),
                    ConnectRoute::Inspect(authority) => Routed::Inspect(authority),
                })
                .map_err(|e| e.kind())
        };
        let authority = |text: &str| Authority::parse(text, 0).unwrap();
        let open = router("policy: { connect_ports: [443, 15080], deny_hosts: [bad.example] }\n");
        assert_eq!(
            kind(&open, "API.example.com:443"),
            Ok(Routed::Opaque(authority("api.example.com:443")))
        );
        assert_eq!(kind(&open, "api.example.com"), Err(ErrorKind::BadRequest));
        assert_eq!(kind(&open, "api.example.com:0"), Err(ErrorKind::BadRequest));
        // Other ports are answered here, to serve plain HTTP inside (policy.connect_inspect).
        assert_eq!(
            kind(&open, "api.example.com:8443"),
            Ok(Routed::Inspect(authority("api.example.com:8443")))
        );
        assert_eq!(kind(&open, "bad.example:443"), Err(ErrorKind::Denied));
        assert_eq!(kind(&open, "bad.example:8080"), Err(ErrorKind::Denied));
        assert_eq!(kind(&open, "localhost:15080"), Err(ErrorKind::Loop));
        assert_eq!(kind(&router(""), "127.0.0.1:15080"), Err(ErrorKind::Loop));
        // Without inspection the port rule comes first, before the loop check.
        let opaque_only = router("policy: { connect_inspect: false }\n");
        assert_eq!(kind(&opaque_only, "127.0.0.1:15080"), Err(ErrorKind::Denied));
        assert_eq!(kind(&opaque_only, "api.example.com:8443"), Err(ErrorKind::Denied));
        let off = router("policy: { connect: false }\n");
        let err = off.route_connect("api.example.com:443").unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Denied);
        assert!(err.to_string().contains("policy.connect: false"), "{err}");
    }
}
