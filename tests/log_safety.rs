//! What the sidecar logs about its own exposure: the open-proxy warning.
//!
//! That credentials never reach the logs is held by unit tests where it is decided: the
//! downstream codec (`credentials_are_read_as_sensitive`) and the h2c server's
//! `mark_credentials` mark Authorization, Proxy-Authorization and Cookie values sensitive, so
//! they print as `Sensitive`. An end-to-end log scan could not fail: nothing in the sidecar logs
//! header values at any level, with or without the marking.

mod support;

use support::ChildSidecar;

#[tokio::test]
async fn a_proxy_listener_open_to_the_network_without_an_allow_list_is_warned_about() {
    let open = ChildSidecar::spawn_with_env("", &[("EGRESS_LISTEN", "0.0.0.0:0")]).await;
    let warnings = open.logged("open proxy");
    assert_eq!(warnings.len(), 1, "{:?}", open.logs.lock().unwrap());
    assert!(
        warnings[0].contains("\"WARN\"") && warnings[0].contains("0.0.0.0:"),
        "{}",
        warnings[0]
    );

    let listed = ChildSidecar::spawn_with_env(
        "policy: { allow_hosts: ['*.example.com'] }\n",
        &[("EGRESS_LISTEN", "0.0.0.0:0")],
    )
    .await;
    assert!(listed.logged("open proxy").is_empty());
    let loopback = ChildSidecar::spawn("").await;
    assert!(loopback.logged("open proxy").is_empty());
}
