//! Egress policy: which hosts and addresses the sidecar connects to on an application's behalf.
//!
//! Owns two things:
//! - the special-purpose ranges `policy.deny_private` refuses ([`special_range`]);
//! - the two checks: by name when a request is routed ([`PolicyConfig::check_host`]), and on
//!   every resolved address before connecting ([`Guard::check_addresses`]). Dialing connects to
//!   exactly the addresses checked, so a name that re-resolves elsewhere between the check and
//!   the connect (DNS rebinding) cannot slip through.
//!
//! [`Guard`] carries the policy in force (a reload swaps it) together with the sidecar's own
//! listener addresses, which are never dialed (loops).
//!
//! Not handled here: the canonical spelling of a host and the host patterns the checks match
//! (`config::host`), CONNECT's own rules (`routing::Router::route_connect`), resolving
//! and connecting (`connector::dial`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::config::{canonical_ip, in_network, Authority, HostPattern, PolicyConfig};
use crate::error::{ErrorKind, ProxyError};
use crate::live::Live;

/// The special-purpose ranges `deny_private` refuses (IANA's special-purpose registries, as
/// Smokescreen and Envoy's SSRF filters use them), named for error messages.
const SPECIAL_V4: &[([u8; 4], u8, &str)] = &[
    ([0, 0, 0, 0], 8, "\"this network\""),
    ([10, 0, 0, 0], 8, "private"),
    (
        [100, 64, 0, 0],
        10,
        "shared address space (carrier-grade NAT, Alibaba Cloud metadata)",
    ),
    ([127, 0, 0, 0], 8, "loopback"),
    ([169, 254, 0, 0], 16, "link-local (cloud metadata services)"),
    ([172, 16, 0, 0], 12, "private"),
    ([192, 0, 0, 0], 24, "IETF protocol assignments"),
    ([192, 0, 2, 0], 24, "documentation"),
    ([192, 168, 0, 0], 16, "private"),
    ([198, 18, 0, 0], 15, "benchmarking"),
    ([198, 51, 100, 0], 24, "documentation"),
    ([203, 0, 113, 0], 24, "documentation"),
    ([224, 0, 0, 0], 4, "multicast"),
    ([240, 0, 0, 0], 4, "reserved and broadcast"),
];

const SPECIAL_V6: &[(u128, u8, &str)] = &[
    (0, 96, "unspecified, loopback or IPv4-compatible"),
    (0x0100_0000_0000_0000_0000_0000_0000_0000, 64, "discard-only"),
    (0x2001_0000_0000_0000_0000_0000_0000_0000, 32, "Teredo"),
    (0x2001_0db8_0000_0000_0000_0000_0000_0000, 32, "documentation"),
    (0x0064_ff9b_0001_0000_0000_0000_0000_0000, 48, "local-use NAT64"),
    (
        0xfc00_0000_0000_0000_0000_0000_0000_0000,
        7,
        "unique local (AWS IPv6 metadata)",
    ),
    (0xfe80_0000_0000_0000_0000_0000_0000_0000, 10, "link-local"),
    (0xff00_0000_0000_0000_0000_0000_0000_0000, 8, "multicast"),
];

/// Prefixes whose addresses carry an IPv4 address in their low 32 bits (NAT64) or in bits
/// 16-48 (6to4): the embedded address is checked like a plain one.
const NAT64: (u128, u8) = (0x0064_ff9b_0000_0000_0000_0000_0000_0000, 96);
const SIX_TO_FOUR: (u128, u8) = (0x2002_0000_0000_0000_0000_0000_0000_0000, 16);

/// Which special-purpose range `ip` is in, if any.
pub fn special_range(ip: IpAddr) -> Option<&'static str> {
    match canonical_ip(ip) {
        IpAddr::V4(v4) => SPECIAL_V4
            .iter()
            .find(|(net, len, _)| in_network(IpAddr::V4(v4), IpAddr::from(*net), *len))
            .map(|(_, _, name)| *name),
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let embedded = if in_prefix(bits, NAT64) {
                Some(bits as u32)
            } else if in_prefix(bits, SIX_TO_FOUR) {
                Some((bits >> 80) as u32)
            } else {
                None
            };
            if let Some(v4) = embedded {
                return special_range(IpAddr::V4(Ipv4Addr::from(v4)));
            }
            SPECIAL_V6
                .iter()
                .find(|(net, len, _)| in_prefix(bits, (*net, *len)))
                .map(|(_, _, name)| *name)
        }
    }
}

fn in_prefix(bits: u128, (net, len): (u128, u8)) -> bool {
    in_network(
        IpAddr::V6(Ipv6Addr::from(bits)),
        IpAddr::V6(Ipv6Addr::from(net)),
        len,
    )
}

impl PolicyConfig {
    /// The check by name, when a request is routed: deny patterns first, then the allow list.
    /// A name the allow list does not match still passes when the list has networks: its
    /// resolved addresses must then fall in one ([`Guard::check_addresses`]).
    pub fn check_host(&self, host: &str) -> Result<(), String> {
        if let Some(rule) = self.deny_hosts.iter().find(|p| p.matches(host)) {
            return Err(format!("{host} is denied by policy.deny_hosts {rule}"));
        }
        if let Ok(ip) = host.parse::<IpAddr>() {
            return self.check_address(host, ip);
        }
        let has_networks = self.allow_hosts.iter().any(|p| matches!(p, HostPattern::Net(..)));
        if self.allow_hosts.is_empty() || has_networks || self.name_allowed(host) {
            return Ok(());
        }
        Err(format!("{host} is not in policy.allow_hosts"))
    }

    /// The check of one address `host` resolved to (or is).
    pub fn check_address(&self, host: &str, ip: IpAddr) -> Result<(), String> {
        let ip = canonical_ip(ip);
        self.address_verdict(host, ip).map_err(|why| {
            if host
                .parse::<IpAddr>()
                .is_ok_and(|literal| canonical_ip(literal) == ip)
            {
                format!("{ip} {why}")
            } else {
                format!("{host} resolves to {ip}, which {why}")
            }
        })
    }

    fn address_verdict(&self, host: &str, ip: IpAddr) -> Result<(), String> {
        if let Some(rule) = self.deny_hosts.iter().find(|p| p.contains(ip)) {
            return Err(format!("is denied by policy.deny_hosts {rule}"));
        }
        let in_allowed_network = self.allow_hosts.iter().any(|p| p.contains(ip));
        // Only an exact name or a network lifts deny_private: a wildcard would let any name
        // under it (wildcard DNS services map names to any address) reach internal ranges.
        let exempt = in_allowed_network
            || self
                .allow_hosts
                .iter()
                .any(|p| matches!(p, HostPattern::Exact(name) if name == host));
        if self.deny_private && !exempt {
            if let Some(range) = special_range(ip) {
                return Err(format!(
                    "is a {range} address, denied by policy.deny_private \
                     (list it in policy.allow_hosts to allow it)"
                ));
            }
        }
        if !self.allow_hosts.is_empty() && !in_allowed_network && !self.name_allowed(host) {
            return Err("is not in policy.allow_hosts".to_owned());
        }
        Ok(())
    }

    /// Whether a name pattern of the allow list matches `host` (networks are matched by address).
    fn name_allowed(&self, host: &str) -> bool {
        self.allow_hosts
            .iter()
            .any(|p| !matches!(p, HostPattern::Net(..)) && p.matches(host))
    }
}

/// The warning due when a proxy listener is reachable from other hosts and nothing limits where
/// it connects: anyone who can reach the pod can then use it as an open proxy.
pub fn open_proxy_warning(proxy_listeners: &[SocketAddr], policy: &PolicyConfig) -> Option<String> {
    let exposed: Vec<String> = proxy_listeners
        .iter()
        .filter(|a| !a.ip().is_loopback())
        .map(SocketAddr::to_string)
        .collect();
    if exposed.is_empty() || !policy.allow_hosts.is_empty() {
        return None;
    }
    Some(format!(
        "open proxy: listening on {} (not loopback) with an empty policy.allow_hosts, so anything \
         that reaches this address can send requests anywhere; list the upstreams in \
         policy.allow_hosts or listen on 127.0.0.1",
        exposed.join(", ")
    ))
}

/// What the sidecar may connect to: the policy in force and its own listeners.
#[derive(Debug)]
pub struct Guard {
    local: Vec<SocketAddr>,
    policy: Live<Arc<PolicyConfig>>,
}

impl Guard {
    /// A guard over `policy` that refuses to dial the `local` listeners.
    pub fn new(local: Vec<SocketAddr>, policy: PolicyConfig) -> Self {
        Guard {
            local,
            policy: Live::new(Arc::new(policy)),
        }
    }

    /// The sidecar's own listener addresses.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.local
    }

    /// Whether `addr` is one of the sidecar's own listeners, never to be dialed.
    pub fn is_own_listener(&self, addr: SocketAddr) -> bool {
        self.local.iter().any(|l| is_same_listener(*l, addr))
    }

    /// The policy in force.
    pub fn policy(&self) -> Arc<PolicyConfig> {
        self.policy.get()
    }

    /// Puts a reloaded policy in force for every dial from now on.
    pub fn set_policy(&self, policy: PolicyConfig) {
        self.policy.set(Arc::new(policy));
    }

    /// Checks every address `authority` resolved to: one denied address refuses them all, so a
    /// name cannot smuggle an internal address in among public ones.
    pub fn check_addresses(
        &self,
        label: &str,
        authority: &Authority,
        addrs: &[SocketAddr],
    ) -> Result<(), ProxyError> {
        let policy = self.policy();
        for addr in addrs {
            policy
                .check_address(&authority.host, addr.ip())
                .map_err(|why| ProxyError::new(ErrorKind::Denied, why).with_upstream(label))?;
        }
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> PolicyConfig {
        crate::config::parse(yaml, &Default::default()).unwrap().policy
    }

    #[test]
    fn special_ranges() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.31.255.255",
            "192.168.0.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::1",
            "::ffff:10.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
            "::7f00:1",
        ] {
            assert!(special_range(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in [
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "64:ff9b::808:808",
            "2002:808:808::",
        ] {
            assert_eq!(special_range(ip.parse().unwrap()), None, "{ip}");
        }
    }

    #[test]
    fn open_proxy() {
        let lo: SocketAddr = "127.0.0.1:15080".parse().unwrap();
        let any: SocketAddr = "0.0.0.0:15080".parse().unwrap();
        let warning = open_proxy_warning(&[lo, any], &policy("")).unwrap();
        assert!(
            warning.contains("0.0.0.0:15080") && !warning.contains("127.0.0.1:15080"),
            "{warning}"
        );
        assert_eq!(
            open_proxy_warning(&[lo, "[::1]:1".parse().unwrap()], &policy("")),
            None
        );
        assert_eq!(
            open_proxy_warning(&[any], &policy("policy: { allow_hosts: ['*.example'] }\n")),
            None
        );
    }

    #[test]
    fn names_then_addresses() {
        let open = policy("");
        assert_eq!(open.check_host("anything.example"), Ok(()));
        assert_eq!(
            open.check_address("anything.example", "10.0.0.1".parse().unwrap()),
            Ok(())
        );

        let private = policy("policy: { deny_private: true, allow_hosts: [metadata.internal, 10.9.0.0/16, '*.example.com'] }\n");
        assert!(private.check_host("127.0.0.1").unwrap_err().contains("loopback"));
        assert!(
            private.check_host("other.example").is_ok(),
            "deferred to the addresses"
        );
        let err = private
            .check_address("api.example.com", "10.0.0.1".parse().unwrap())
            .unwrap_err();
        assert!(
            err.contains("api.example.com resolves to 10.0.0.1, which is a private address"),
            "{err}"
        );
        assert_eq!(
            private.check_address("api.example.com", "93.184.215.14".parse().unwrap()),
            Ok(())
        );
        assert_eq!(
            private.check_address("metadata.internal", "169.254.169.254".parse().unwrap()),
            Ok(())
        );
        assert_eq!(
            private.check_address("svc.local", "10.9.1.1".parse().unwrap()),
            Ok(())
        );
        assert!(private
            .check_address("other.example", "93.184.215.14".parse().unwrap())
            .is_err());

        let denied =
            policy("policy: { deny_hosts: [10.0.0.0/8, evil.example], allow_hosts: ['*.example'] }\n");
        assert!(denied.check_host("evil.example").is_err());
        assert!(denied.check_host("good.example").is_ok());
        assert!(
            denied.check_host("other.test").is_err(),
            "no networks in the allow list: refused by name"
        );
        assert!(denied
            .check_address("good.example", "::ffff:10.1.1.1".parse().unwrap())
            .is_err());
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
