//! Host names and host patterns, as config validation and the policy checks both read them.
//!
//! - the canonical spelling of a host ([`canonical_host`]): every numeric IPv4 form that
//!   `inet_aton`, and so getaddrinfo, accepts (`0x7f.1`, `0177.0.0.1`, `2130706433`) becomes a
//!   dotted quad, IPv6 is compressed and IPv4-mapped IPv6 becomes IPv4, a trailing dot goes, and
//!   anything that is neither a DNS name nor an IP literal is refused. Patterns, loop checks and
//!   pool keys then see one spelling per address;
//! - the host patterns of `policy.allow_hosts` / `deny_hosts` ([`HostPattern`]).
//!
//! Not handled here: what the policy does with a match (`policy`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Longest DNS name (RFC 1035), without the trailing dot.
const MAX_NAME_LEN: usize = 253;
/// Longest DNS label.
const MAX_LABEL_LEN: usize = 63;

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
            // Addresses are compared in canonical form, so an IPv4-mapped network must be one
            // too, or `::ffff:10.0.0.0/104` would never match 10.1.2.3.
            return Ok(match ip {
                IpAddr::V6(v6) if len >= 96 && v6.to_ipv4_mapped().is_some() => {
                    HostPattern::Net(canonical_ip(ip), len - 96)
                }
                _ => HostPattern::Net(ip, len),
            });
        }
        let (suffix, name) = match text.strip_prefix("*.") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let host = canonical_host(name)
            .map_err(|why| format!("{text:?} is not a host name, *.domain, IP or CIDR: {why}"))?;
        match (suffix, host.parse::<IpAddr>()) {
            (false, Ok(ip)) => Ok(HostPattern::Net(ip, if ip.is_ipv4() { 32 } else { 128 })),
            (true, Ok(_)) => Err(format!("{text:?}: *. goes before a domain name, not an IP")),
            (true, Err(_)) => Ok(HostPattern::Suffix(host)),
            (false, Err(_)) => Ok(HostPattern::Exact(host)),
        }
    }

    /// Whether `host` (in [`canonical_host`] form) matches.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(name) => host == name,
            HostPattern::Suffix(name) => host
                .strip_suffix(name.as_str())
                .is_some_and(|head| head.ends_with('.') && head.len() > 1),
            HostPattern::Net(..) => host.parse::<IpAddr>().is_ok_and(|ip| self.contains(ip)),
        }
    }

    /// Whether this is a network pattern covering `ip`.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match self {
            HostPattern::Net(net, len) => in_network(canonical_ip(ip), *net, *len),
            _ => false,
        }
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

/// Whether `ip` lies in `net`/`len`; addresses of different families never do.
pub(crate) fn in_network(ip: IpAddr, net: IpAddr, len: u8) -> bool {
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

/// The one spelling of a host: a lower-case DNS name without a trailing dot, a dotted-quad
/// IPv4 address, or a compressed IPv6 address without brackets (IPv4-mapped ones as IPv4).
pub fn canonical_host(text: &str) -> Result<String, String> {
    if let Some(inner) = text.strip_prefix('[') {
        let inner = inner
            .strip_suffix(']')
            .ok_or_else(|| format!("{text:?} opens a bracket it does not close"))?;
        let ip: Ipv6Addr = inner
            .parse()
            .map_err(|_| format!("[{inner}] is not an IPv6 address (zone ids are not accepted)"))?;
        return Ok(canonical_ip(IpAddr::V6(ip)).to_string());
    }
    if text.contains(':') {
        let ip: Ipv6Addr = text
            .parse()
            .map_err(|_| format!("{text:?} is not a host name or IP address"))?;
        return Ok(canonical_ip(IpAddr::V6(ip)).to_string());
    }
    let name = text.strip_suffix('.').unwrap_or(text);
    if let Some(ip) = parse_inet_aton(name)? {
        return Ok(ip.to_string());
    }
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!(
            "{text:?} is not a host name (1 to {MAX_NAME_LEN} characters)"
        ));
    }
    for label in name.split('.') {
        let valid_chars = label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if label.is_empty() || label.len() > MAX_LABEL_LEN || !valid_chars {
            return Err(format!(
                "{text:?} is not a host name (labels of 1 to {MAX_LABEL_LEN} letters, digits, '-' or '_')"
            ));
        }
    }
    Ok(name.to_ascii_lowercase())
}

/// IPv4-mapped IPv6 (`::ffff:a.b.c.d`) as the IPv4 address it reaches.
pub(crate) fn canonical_ip(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// The numeric IPv4 spellings `inet_aton` accepts: one to four parts, each decimal, `0x` hex or
/// `0`-prefixed octal, the last filling the remaining bytes. `Ok(None)`: not numeric, a name.
/// `Err`: numeric but out of range, which getaddrinfo would not take as a name either.
/// Allocates nothing unless it fails: every request's host passes through here.
fn parse_inet_aton(text: &str) -> Result<Option<Ipv4Addr>, String> {
    // No top-level domain is numeric, so a name ending in a number can only be a mistyped or
    // disguised address (the WHATWG URL parser refuses these too).
    if !text.rsplit('.').next().is_some_and(is_numeric_part) {
        return Ok(None);
    }
    let out_of_range = || format!("{text:?} is not a valid IPv4 address");
    let mut values = [0u64; 4];
    let mut count = 0;
    for part in text.split('.') {
        let slot = values.get_mut(count).ok_or_else(out_of_range)?;
        *slot = parse_ipv4_part(part).ok_or_else(out_of_range)?;
        count += 1;
    }
    let (last, leading) = values[..count].split_last().ok_or_else(out_of_range)?;
    if leading.iter().any(|v| *v > 0xff) || *last >= 1u64 << (8 * (4 - leading.len() as u32)) {
        return Err(out_of_range());
    }
    let high = leading
        .iter()
        .enumerate()
        .fold(0u64, |acc, (i, v)| acc | (v << (24 - 8 * i as u32)));
    let value = u32::try_from(high | last).map_err(|_| out_of_range())?;
    Ok(Some(Ipv4Addr::from(value)))
}

fn hex_digits(part: &str) -> Option<&str> {
    part.strip_prefix("0x").or_else(|| part.strip_prefix("0X"))
}

fn is_numeric_part(part: &str) -> bool {
    match hex_digits(part) {
        Some(hex) => hex.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// One part's value; `None` when it is not a number or exceeds 32 bits.
fn parse_ipv4_part(part: &str) -> Option<u64> {
    if !is_numeric_part(part) {
        return None;
    }
    let (digits, radix) = match hex_digits(part) {
        Some(hex) => (hex, 16),
        None if part.len() > 1 && part.starts_with('0') => (&part[1..], 8),
        None => (part, 10),
    };
    if digits.is_empty() {
        return Some(0); // "0x" alone is 0 to inet_aton
    }
    u64::from_str_radix(digits, radix)
        .ok()
        .filter(|v| *v <= u64::from(u32::MAX))
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
        assert!(net.contains("::ffff:10.9.9.9".parse().unwrap()));
        let mapped = HostPattern::parse("::ffff:10.0.0.0/104").unwrap();
        assert_eq!(mapped.to_string(), "10.0.0.0/8");
        assert!(mapped.matches("10.1.2.3"));
        assert!(HostPattern::parse("10.0.0.0/40").is_err());
        assert!(HostPattern::parse("bad host").is_err());
        assert!(HostPattern::parse("*.10.0.0.1").is_err());
        assert_eq!(HostPattern::parse("::1").unwrap().to_string(), "::1/128");
        assert_eq!(HostPattern::parse("[::1]").unwrap().to_string(), "::1/128");
        assert_eq!(HostPattern::parse("0x7f.1").unwrap().to_string(), "127.0.0.1/32");
        assert_eq!(
            HostPattern::parse("Example.COM.").unwrap().to_string(),
            "example.com"
        );
    }

    #[test]
    fn numeric_hosts_have_one_spelling() {
        for spelling in [
            "127.0.0.1",
            "127.1",
            "127.0.1",
            "0x7f.0.0.1",
            "0X7F.1",
            "0177.0.0.1",
            "0177.0.0.01",
            "2130706433",
            "0x7f000001",
            "017700000001",
            "127.0.0.1.",
            "[::ffff:127.0.0.1]",
            "[::ffff:7f00:1]",
            "::ffff:127.0.0.1",
        ] {
            assert_eq!(canonical_host(spelling).as_deref(), Ok("127.0.0.1"), "{spelling}");
        }
        assert_eq!(canonical_host("[0:0:0:0:0:0:0:1]").as_deref(), Ok("::1"));
        assert_eq!(canonical_host("[FE80::1]").as_deref(), Ok("fe80::1"));
        assert_eq!(
            canonical_host("API.Example.com.").as_deref(),
            Ok("api.example.com")
        );
        assert_eq!(canonical_host("0").as_deref(), Ok("0.0.0.0"));
        // Names with numeric labels are names, as long as not every label is numeric.
        assert_eq!(canonical_host("1.2.3.example").as_deref(), Ok("1.2.3.example"));
        assert_eq!(canonical_host("0x7f.example").as_deref(), Ok("0x7f.example"));
        for bad in [
            "256.0.0.1",
            "1.2.3.4.5.6",
            "example.123",
            "example.0x7f",
            "0x100000000",
            "1.2.65536",
            "08.0.0.1",
            "[fe80::1%25eth0]",
            "[::1",
            "a..b",
            "",
            ".",
            "ex ample.com",
            "ex%61mple.com",
            "exa$mple.com",
        ] {
            assert!(canonical_host(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(canonical_host(&"a".repeat(64)).is_err());
        assert!(canonical_host(&["a"; 127].join(".")).is_ok(), "253 characters");
        assert!(canonical_host(&["a"; 128].join(".")).is_err(), "255 characters");
    }
}
