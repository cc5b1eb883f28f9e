//! What an upstream is built from (`Spec`: from the config file, or met on the fly) and the key
//! that decides whether a reloaded upstream keeps its pool (`PoolKey`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::config::{
    Authority, Config, ParentRoute, Protocol, Scheme, TlsConfig, UpstreamConfig, UpstreamSettings,
};

/// What decides where and how an upstream's connections are made. A reloaded upstream with
/// the same key keeps its pool and connections (new limits apply in place); any other change
/// means a new pool, and the old one drains.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolKey {
    pub(super) label: Arc<str>,
    pub(super) scheme: Scheme,
    pub(super) authority: Authority,
    pub(super) addresses: Vec<SocketAddr>,
    pub(super) tls: Option<TlsConfig>,
    pub(super) protocol: Protocol,
    pub(super) connect_timeout: Duration,
    pub(super) keepalive_interval: Option<Duration>,
    pub(super) keepalive_timeout: Duration,
    /// The parent proxy and what reaching it takes, when the upstream is reached through one.
    pub(super) parent: Option<ParentRoute>,
}

/// Everything an upstream is built from.
#[derive(Debug, Clone)]
pub struct Spec {
    pub(super) label: Arc<str>,
    pub(super) scheme: Scheme,
    pub(super) authority: Authority,
    pub(super) aliases: Vec<Authority>,
    pub(super) addresses: Vec<SocketAddr>,
    /// Its TLS settings among them: one copy, so that what a spec presents is what its
    /// settings say (an upstream met on the fly once kept the defaults' client certificate
    /// in a second copy after its settings had dropped it).
    pub(super) settings: UpstreamSettings,
    /// Met through an absolute-form request, not configured: its metric series are made by
    /// its traffic only.
    pub(super) met_on_the_fly: bool,
}

impl Spec {
    /// An upstream from the config file.
    pub fn configured(cfg: &UpstreamConfig) -> Self {
        Spec {
            label: cfg.name.as_str().into(),
            scheme: cfg.scheme,
            authority: cfg.authority.clone(),
            aliases: cfg.aliases.clone(),
            addresses: cfg.addresses.clone(),
            settings: cfg.settings.clone(),
            met_on_the_fly: false,
        }
    }

    /// An upstream met through an absolute-form request, with `defaults` less their
    /// credentials ([`dynamic_settings`]).
    pub fn dynamic(scheme: Scheme, authority: Authority, config: &Config) -> Self {
        Spec {
            label: authority.to_string().into(),
            scheme,
            authority,
            aliases: Vec::new(),
            addresses: Vec::new(),
            settings: dynamic_settings(config),
            met_on_the_fly: true,
        }
    }

    /// The key deciding whether an existing pool can serve this spec.
    pub fn pool_key(&self) -> PoolKey {
        PoolKey {
            label: self.label.clone(),
            scheme: self.scheme,
            authority: self.authority.clone(),
            addresses: self.addresses.clone(),
            tls: (self.scheme == Scheme::Https).then(|| self.settings.tls.clone()),
            protocol: self.settings.protocol,
            connect_timeout: self.settings.connect_timeout,
            keepalive_interval: self.settings.http2.keepalive_interval,
            keepalive_timeout: self.settings.http2.keepalive_timeout,
            parent: self.settings.via.parent_for(self.scheme, &self.authority.host),
        }
    }
}

/// `defaults` for an upstream met on the fly, less the credentials in them: the headers
/// `request_headers` sets and the client certificate of `tls` are meant for the upstreams the
/// operator named, never for any host an application may name. (`tls.ca_file` stays: it is
/// whom the sidecar trusts, not what it presents.)
fn dynamic_settings(config: &Config) -> UpstreamSettings {
    let mut settings = config.defaults.clone();
    settings.request_headers.set.clear();
    settings.tls.client_cert_file = None;
    settings.tls.client_key_file = None;
    settings
}
