//! The resolver: host names to addresses, asynchronously, with the answer's lifetime.
//!
//! hickory-resolver rather than getaddrinfo on a worker thread: getaddrinfo hides the TTL, and
//! an endpoint set refreshed by TTL needs it; it also ties up a thread per lookup in flight.
//! hickory reads `/etc/resolv.conf` (name servers, `search`, `ndots`, so Kubernetes short names
//! such as `billing` resolve as they do for the application), answers from `/etc/hosts` first,
//! asks for AAAA and A in parallel, and clamps TTLs into `dns.min_ttl..=dns.max_ttl` in its
//! cache. `dns.servers` replaces the name servers and keeps resolv.conf's search list.
//!
//! The resolver is built on first use (a sidecar whose upstreams all have static addresses never
//! reads resolv.conf) and rebuilt when a reload changes the `dns` section.

use std::net::IpAddr;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use hickory_resolver::config::{
    ConnectionConfig, LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts,
};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::op::Query;
use hickory_resolver::proto::rr::{Name, RecordType};
use hickory_resolver::{Hosts, TokioResolver};
use tokio::time::Instant;

use crate::config::DnsConfig;

/// Entries hickory's cache keeps: each name an upstream or a tunnel met, with its A and AAAA
/// answers. Bounded for the memory budget; the endpoint sets hold their own answers.
const CACHE_ENTRIES: u64 = 1024;

/// What a lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The addresses, in the resolver's order (AAAA before A).
    pub ips: Vec<IpAddr>,
    /// When the answer expires (its TTL, within `dns.min_ttl..=dns.max_ttl`).
    pub valid_until: Instant,
}

/// The sidecar's resolver: one for the process, shared by every endpoint set and tunnel.
#[derive(Debug)]
pub struct Resolver {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    config: DnsConfig,
    /// `Err`: hickory would not build with this configuration (every lookup says why).
    built: Option<Result<Built, String>>,
}

/// The resolver and the `/etc/hosts` it was built with.
#[derive(Clone)]
struct Built {
    resolver: Arc<TokioResolver>,
    hosts: Arc<Hosts>,
}

impl std::fmt::Debug for Built {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Built").finish_non_exhaustive()
    }
}

impl Resolver {
    /// A resolver for `config`, built on first use.
    pub fn new(config: &DnsConfig) -> Self {
        Resolver {
            state: Mutex::new(State {
                config: config.clone(),
                built: None,
            }),
        }
    }

    /// The settings in force.
    pub fn config(&self) -> DnsConfig {
        self.lock().config.clone()
    }

    /// Applies a reloaded `dns` section: lookups from now on use it.
    pub fn reconfigure(&self, config: &DnsConfig) {
        let mut st = self.lock();
        if st.config != *config {
            st.config = config.clone();
            st.built = None;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn built(&self) -> Result<Built, String> {
        let mut st = self.lock();
        if let Some(built) = &st.built {
            return built.clone();
        }
        // Read once per build, as the name servers are: a reload that changes `dns` re-reads it.
        let hosts = Hosts::from_system().unwrap_or_default();
        let built = build(&st.config).map(|resolver| Built {
            resolver: Arc::new(resolver),
            hosts: Arc::new(hosts),
        });
        st.built = Some(built.clone());
        built
    }

    /// Every address of `host`, or why there is none.
    pub async fn lookup(&self, host: &str) -> Result<Answer, String> {
        let (min_ttl, max_ttl) = {
            let st = self.lock();
            (st.config.min_ttl, st.config.max_ttl)
        };
        let built = self.built()?;
        // A name in /etc/hosts is answered from it alone, as glibc does: hickory would answer
        // the family the file has and still wait on DNS for the other.
        if let Some(ips) = from_hosts(&built.hosts, host) {
            return Ok(Answer {
                ips,
                valid_until: Instant::now() + max_ttl,
            });
        }
        let found = built.resolver.lookup_ip(host).await.map_err(|e| {
            if e.is_nx_domain() {
                "no such name (NXDOMAIN)".to_owned()
            } else if e.is_no_records_found() {
                "no A or AAAA records".to_owned()
            } else {
                e.to_string()
            }
        })?;
        let ips: Vec<IpAddr> = found.iter().collect();
        if ips.is_empty() {
            return Err("no addresses".to_owned());
        }
        // hickory clamps the TTLs it caches; the combined A and AAAA answer may carry another.
        let now = Instant::now();
        let ttl = Instant::from_std(found.valid_until())
            .saturating_duration_since(now)
            .clamp(min_ttl, max_ttl);
        Ok(Answer {
            ips,
            valid_until: now + ttl,
        })
    }
}

/// The addresses `/etc/hosts` gives `host` (IPv6 first), if it names it.
fn from_hosts(hosts: &Hosts, host: &str) -> Option<Vec<IpAddr>> {
    let name = Name::from_str(host).ok()?;
    let mut ips = Vec::new();
    for record_type in [RecordType::AAAA, RecordType::A] {
        if let Some(found) = hosts.lookup_static_host(&Query::query(name.clone(), record_type)) {
            ips.extend(found.answers().iter().filter_map(|r| r.data.ip_addr()));
        }
    }
    (!ips.is_empty()).then_some(ips)
}

fn build(config: &DnsConfig) -> Result<TokioResolver, String> {
    let (mut system, mut options) = match hickory_resolver::system_conf::read_system_conf() {
        Ok(found) => found,
        Err(e) => {
            if config.servers.is_empty() {
                tracing::warn!(
                    "reading /etc/resolv.conf: {e}; only /etc/hosts resolves names (set dns.servers)"
                );
            }
            (
                ResolverConfig::from_parts(None, Vec::new(), Vec::new()),
                ResolverOpts::default(),
            )
        }
    };
    if !config.servers.is_empty() {
        let (domain, search, _) = system.into_parts();
        let servers = config
            .servers
            .iter()
            .map(|addr| {
                let mut udp = ConnectionConfig::udp();
                udp.port = addr.port();
                let mut tcp = ConnectionConfig::tcp();
                tcp.port = addr.port();
                NameServerConfig::new(addr.ip(), true, vec![udp, tcp])
            })
            .collect();
        system = ResolverConfig::from_parts(domain, search, servers);
    }
    options.ip_strategy = LookupIpStrategy::Ipv6AndIpv4;
    options.use_hosts_file = ResolveHosts::Always;
    options.cache_size = CACHE_ENTRIES;
    options.positive_min_ttl = Some(config.min_ttl);
    options.positive_max_ttl = Some(config.max_ttl);
    // A name that does not exist yet (a Service about to be created) is asked again soon.
    options.negative_max_ttl = Some(config.min_ttl);
    let mut builder = TokioResolver::builder_with_config(system, TokioRuntimeProvider::default());
    *builder.options_mut() = options;
    builder
        .build()
        .map_err(|e| format!("the resolver could not be set up: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_entries_answer_alone_ipv6_first() {
        let mut hosts = Hosts::default();
        let file =
            "127.0.0.1 localhost\n10.0.0.5 billing billing.internal\nfd00::5 billing\n10.0.0.6 ledger\n";
        hosts.read_hosts_conf(file.as_bytes()).unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert_eq!(
            from_hosts(&hosts, "billing"),
            Some(vec![ip("fd00::5"), ip("10.0.0.5")])
        );
        assert_eq!(from_hosts(&hosts, "billing.internal"), Some(vec![ip("10.0.0.5")]));
        assert_eq!(from_hosts(&hosts, "ledger"), Some(vec![ip("10.0.0.6")]));
        assert_eq!(from_hosts(&hosts, "elsewhere.example"), None);
    }
}
