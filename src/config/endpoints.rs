//! The endpoint keys: `dns` (the resolver), and per upstream `balance` and `outlier`, typed and
//! validated.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::Serialize;

use super::problems::{duration_or, Problems};
use super::schema::{FileDns, FileOutlier, Scalar};
use super::ser_duration;

/// The shortest time an answer is kept when `dns.min_ttl` is not set (Envoy's
/// `dns_min_refresh_rate` default): a TTL of 0 must not become a query per dial.
pub const DEFAULT_DNS_MIN_TTL: Duration = Duration::from_secs(5);
/// The longest time an answer is kept when `dns.max_ttl` is not set, and how long a last good
/// answer outlives failed refreshes.
pub const DEFAULT_DNS_MAX_TTL: Duration = Duration::from_secs(300);
/// Consecutive connect failures or resets that eject an endpoint.
pub const DEFAULT_OUTLIER_FAILURES: u32 = 3;
/// The first ejection's length; each next one of the same endpoint doubles it.
pub const DEFAULT_BASE_EJECTION: Duration = Duration::from_secs(5);
/// The longest ejection.
pub const DEFAULT_MAX_EJECTION: Duration = Duration::from_secs(120);

/// The resolver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DnsConfig {
    /// Name servers; empty means those of `/etc/resolv.conf`.
    pub servers: Vec<SocketAddr>,
    /// Answers are kept at least this long.
    #[serde(serialize_with = "ser_duration")]
    pub min_ttl: Duration,
    /// Answers are kept at most this long, and a last good answer outlives failed refreshes
    /// this long.
    #[serde(serialize_with = "ser_duration")]
    pub max_ttl: Duration,
}

impl Default for DnsConfig {
    fn default() -> Self {
        DnsConfig {
            servers: Vec::new(),
            min_ttl: DEFAULT_DNS_MIN_TTL,
            max_ttl: DEFAULT_DNS_MAX_TTL,
        }
    }
}

/// Where an upstream's new connections go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// The endpoint with the fewest open connections; ties in turn.
    LeastConnections,
    /// The better of two endpoints picked at random, by latency average times load.
    P2cEwma,
}

/// Passive outlier detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OutlierConfig {
    /// Consecutive connect failures or resets that eject an endpoint; 0 = never.
    pub consecutive_failures: u32,
    /// The first ejection's length.
    #[serde(serialize_with = "ser_duration")]
    pub base_ejection: Duration,
    /// The longest ejection.
    #[serde(serialize_with = "ser_duration")]
    pub max_ejection: Duration,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            consecutive_failures: DEFAULT_OUTLIER_FAILURES,
            base_ejection: DEFAULT_BASE_EJECTION,
            max_ejection: DEFAULT_MAX_EJECTION,
        }
    }
}

pub(super) fn validate_dns(raw: &FileDns, problems: &mut Problems) -> DnsConfig {
    let base = DnsConfig::default();
    let mut servers = Vec::new();
    for (i, text) in raw.servers.iter().flatten().enumerate() {
        match parse_server(text) {
            Ok(addr) => servers.push(addr),
            Err(why) => problems.add(format!("dns.servers[{i}]"), why),
        }
    }
    let min_ttl = duration_or(&raw.min_ttl, base.min_ttl, "dns.min_ttl", problems);
    let max_ttl = duration_or(&raw.max_ttl, base.max_ttl, "dns.max_ttl", problems);
    if max_ttl.is_zero() {
        problems.add("dns.max_ttl", "must be more than 0");
    } else if min_ttl > max_ttl {
        problems.add(
            "dns.min_ttl",
            format!(
                "{} is more than dns.max_ttl ({})",
                humantime::format_duration(min_ttl),
                humantime::format_duration(max_ttl)
            ),
        );
    }
    DnsConfig {
        servers,
        min_ttl,
        max_ttl,
    }
}

/// `10.0.0.2`, `10.0.0.2:5353` or `[fd00::2]:53`.
fn parse_server(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    text.parse()
        .map_err(|_| format!("{text:?} is not an IP address or IP:port"))
}

pub(super) fn merge_balance(
    base: Balance,
    raw: &Option<String>,
    key: &str,
    problems: &mut Problems,
) -> Balance {
    match raw.as_deref() {
        None => base,
        Some("least_connections") => Balance::LeastConnections,
        Some("p2c_ewma") => Balance::P2cEwma,
        Some(other) => {
            problems.add(
                key,
                format!("{other:?} is not one of least_connections, p2c_ewma"),
            );
            base
        }
    }
}

pub(super) fn merge_outlier(
    base: &OutlierConfig,
    raw: &FileOutlier,
    prefix: &str,
    problems: &mut Problems,
) -> OutlierConfig {
    let key = |k: &str| format!("{prefix}.{k}");
    let consecutive_failures = match raw.consecutive_failures {
        None => base.consecutive_failures,
        Some(n) => u32::try_from(n).unwrap_or_else(|_| {
            problems.add(key("consecutive_failures"), format!("{n} is too large"));
            base.consecutive_failures
        }),
    };
    let outlier = OutlierConfig {
        consecutive_failures,
        base_ejection: positive(
            &raw.base_ejection,
            base.base_ejection,
            &key("base_ejection"),
            problems,
        ),
        max_ejection: positive(
            &raw.max_ejection,
            base.max_ejection,
            &key("max_ejection"),
            problems,
        ),
    };
    if outlier.base_ejection > outlier.max_ejection {
        problems.add(
            key("base_ejection"),
            format!(
                "{} is more than {} ({})",
                humantime::format_duration(outlier.base_ejection),
                key("max_ejection"),
                humantime::format_duration(outlier.max_ejection)
            ),
        );
    }
    outlier
}

fn positive(raw: &Option<Scalar>, base: Duration, key: &str, problems: &mut Problems) -> Duration {
    let value = duration_or(raw, base, key, problems);
    if value.is_zero() {
        problems.add(key, "must be more than 0");
    }
    value
}

#[cfg(test)]
mod tests {
    use super::super::{parse, Overrides};
    use super::*;

    use super::super::problems;

    #[test]
    fn defaults_and_overrides() {
        let c = parse("", &Overrides::default()).unwrap();
        assert_eq!(c.dns, DnsConfig::default());
        assert_eq!(c.defaults.balance, Balance::LeastConnections);
        assert_eq!(c.defaults.outlier, OutlierConfig::default());
        let c = parse(
            "dns: { servers: [10.0.0.2, '127.0.0.1:5353', '[fd00::2]:53'], min_ttl: 1s, max_ttl: 30s }\n\
             defaults: { balance: p2c_ewma, outlier: { consecutive_failures: 5 } }\n\
             upstreams:\n  - { name: a, url: 'http://a.test', balance: least_connections, outlier: { base_ejection: 1s } }\n",
            &Overrides::default(),
        )
        .unwrap();
        let servers: Vec<String> = c.dns.servers.iter().map(|s| s.to_string()).collect();
        assert_eq!(servers, ["10.0.0.2:53", "127.0.0.1:5353", "[fd00::2]:53"]);
        assert_eq!(
            (c.dns.min_ttl, c.dns.max_ttl),
            (Duration::from_secs(1), Duration::from_secs(30))
        );
        assert_eq!(c.defaults.balance, Balance::P2cEwma);
        let up = &c.upstreams[0].settings;
        assert_eq!(up.balance, Balance::LeastConnections);
        assert_eq!(up.outlier.consecutive_failures, 5, "inherited from defaults");
        assert_eq!(up.outlier.base_ejection, Duration::from_secs(1));
    }

    #[test]
    fn bad_values_name_their_keys() {
        let found = problems(
            "dns: { servers: [nameserver.example], min_ttl: 10m, max_ttl: 1m }\n\
             defaults: { balance: random, outlier: { base_ejection: 5m, max_ejection: 1m } }\n\
             upstreams:\n  - { name: a, url: 'http://a.test', outlier: { max_ejection: 0s } }\n",
        );
        let keys: Vec<&str> = found.iter().map(|(k, _)| k.as_str()).collect();
        for key in [
            "dns.servers[0]",
            "dns.min_ttl",
            "defaults.balance",
            "defaults.outlier.base_ejection",
            "upstreams[0].outlier.max_ejection",
        ] {
            assert!(keys.contains(&key), "{key} missing from {found:?}");
        }
        assert!(
            parse("dns: { port: 53 }\n", &Overrides::default()).is_err(),
            "unknown keys are errors"
        );
    }
}
