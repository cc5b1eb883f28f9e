//! `egress-sidecar check`: a good config prints the effective config and exits 0; each bad one
//! exits 2 with one line per problem naming the key.

mod support;

use support::TempDir;

fn check(yaml: &str) -> (i32, String, String) {
    support::check_config(yaml)
}

#[test]
fn a_good_config_prints_the_effective_config() {
    let (code, stdout, stderr) = check(
        "upstreams:\n  - name: llm\n    url: http://api.example.com\n    aliases: [api.example.com:8080]\n    pool: { max_connections: 16 }\n",
    );
    assert_eq!(code, 0, "{stderr}");
    for expected in [
        "listen: 127.0.0.1:15080",
        "admin: 127.0.0.1:15081",
        "idle_timeout: 10s",
        "max_header_bytes: 64KiB",
        "name: llm",
        "url: http://api.example.com:80",
        "max_connections: 16",
        "max_idle: 16",
        "pending_timeout: 5s",
        "drain_timeout: 8s",
    ] {
        assert!(stdout.contains(expected), "missing {expected:?} in:\n{stdout}");
    }
}

#[test]
fn an_empty_config_is_valid() {
    let (code, stdout, _) = check("");
    assert_eq!(code, 0);
    assert!(stdout.contains("max_connections: 64"));
}

#[test]
fn each_bad_config_names_its_key() {
    let cases = [
        ("downstream:\n  idle_timeout: soon\n", "downstream.idle_timeout"),
        ("defaults:\n  connect_timeout: 3\n", "defaults.connect_timeout"),
        ("defaults:\n  pool: { max_connections: 4, max_idle: 8 }\n", "defaults.pool.max_idle"),
        (
            "upstreams:\n  - url: http://a.example\n    listen: 127.0.0.1:20000\n  - url: http://b.example\n    listen: 127.0.0.1:20000\n",
            "upstreams[1].listen",
        ),
        ("upstreams:\n  - url: /no/host\n", "upstreams[0].url"),
        ("upstreams:\n  - name: x\n", "upstreams[0].url"),
        ("upstreams:\n  - url: ftp://a.example\n", "upstreams[0].url"),
        ("upstreams:\n  - url: http://a.example\n    addresses: [nowhere]\n", "upstreams[0].addresses[0]"),
        ("upstreams:\n  - url: http://a.example\n  - url: http://a.example\n", "upstreams[1].name"),
        ("listen: localhost\n", "listen"),
        ("policy:\n  deny_hosts: [\"10.0.0.0/99\"]\n", "policy.deny_hosts[0]"),
        ("defaults:\n  pool:\n    max_conns: 3\n", "defaults.pool.max_conns"),
        ("downstream:\n  max_header_bytes: 12 parsecs\n", "downstream.max_header_bytes"),
        (
            "upstreams:\n  - url: https://a.example\n    tls: { ca_file: /nonexistent/ca.pem }\n",
            "upstreams[0].tls.ca_file",
        ),
        (
            "upstreams:\n  - url: https://a.example\n    tls: { server_name: \"not a name\" }\n",
            "upstreams[0].tls.server_name",
        ),
    ];
    for (yaml, key) in cases {
        let (code, stdout, stderr) = check(yaml);
        assert_eq!(code, 2, "{yaml:?} accepted:\n{stdout}");
        assert!(stdout.is_empty(), "{yaml:?} printed a config");
        assert!(
            stderr.lines().any(|l| l.starts_with(&format!("config: {key}: "))),
            "{yaml:?}: no line naming {key}:\n{stderr}"
        );
    }
}

/// Durations past the bound, negative or not finite are config errors naming the key, not a
/// panic at the first `Instant + timeout` (issue 41).
#[test]
fn extreme_durations_name_their_key() {
    let cases = [
        (
            "defaults:\n  connect_timeout: 18446744073709551615s\n",
            "defaults.connect_timeout",
            "longer than a year",
        ),
        (
            "defaults:\n  request_timeout: 99999999999999999999999s\n",
            "defaults.request_timeout",
            "longer than a year",
        ),
        (
            "downstream:\n  idle_timeout: 400d\n",
            "downstream.idle_timeout",
            "longer than a year",
        ),
        (
            "defaults:\n  pool: { idle_timeout: \"-1s\" }\n",
            "defaults.pool.idle_timeout",
            "negative",
        ),
        (
            "defaults:\n  retry: { retry_after_max: NaN }\n",
            "defaults.retry.retry_after_max",
            "not a finite number",
        ),
        (
            "shutdown:\n  drain_timeout: inf\n",
            "shutdown.drain_timeout",
            "not a finite number",
        ),
        (
            "defaults:\n  body_idle_timeout: \"1e30\"\n",
            "defaults.body_idle_timeout",
            "is not a duration",
        ),
    ];
    for (yaml, key, why) in cases {
        let (code, stdout, stderr) = check(yaml);
        assert_eq!(code, 2, "{yaml:?} accepted:\n{stdout}");
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with(&format!("config: {key}: ")) && l.contains(why)),
            "{yaml:?}: no line naming {key} ({why}):\n{stderr}"
        );
    }
    let (code, _, stderr) = check("defaults:\n  request_timeout: 365d\n");
    assert_eq!(code, 0, "the bound itself is taken: {stderr}");
}

#[test]
fn several_problems_are_reported_together() {
    let (code, _, stderr) =
        check("downstream:\n  idle_timeout: soon\n  header_read_timeout: later\ndefaults:\n  pool: { max_pending: 0, pending_timeout: 0s }\n");
    assert_eq!(code, 2);
    let keys: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("config: "))
        .collect();
    assert_eq!(keys.len(), 3, "{stderr}");
}

#[test]
fn a_ca_file_that_is_not_pem_is_named() {
    let dir = TempDir::new();
    let bogus = dir.path.join("ca.pem");
    std::fs::write(&bogus, "not a certificate\n").unwrap();
    let (code, _, stderr) = check(&format!(
        "upstreams:\n  - url: https://a.example\n    tls: {{ ca_file: {} }}\n",
        bogus.display()
    ));
    assert_eq!(code, 2);
    assert!(stderr.contains("config: upstreams[0].tls.ca_file: "), "{stderr}");
}

#[test]
fn https_upstreams_and_tls_hosts_are_accepted() {
    let (code, stdout, stderr) = check(
        "upstreams:\n  - name: llm\n    url: https://api.example.com\n    aliases: [api.example.com:80]\n",
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("url: https://api.example.com:443"), "{stdout}");
}
