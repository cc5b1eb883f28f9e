//! Durations from outside at their extremes (issue 41, items 1 and 2): an application's
//! `x-egress-timeout` past the bound, negative or not finite is `400 bad_request` naming the
//! header; an upstream's `retry-after-ms` or `Retry-After` that is no bounded duration is
//! ignored, counted in `egress_upstream_ignored_headers_total` and the request retried by
//! backoff. Each time the sidecar keeps serving, on the same connection.

mod support;

use support::{Answer, RawClient, ScriptedOrigin, Sidecar};

#[tokio::test]
async fn extreme_request_timeouts_are_refused_naming_the_header() {
    let origin = ScriptedOrigin::start().await;
    let sidecar = Sidecar::start("").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let max = format!("{}s", u64::MAX);
    for value in [
        max.as_str(),
        "99999999999999999999999s",
        "400d",
        "-1s",
        "NaN",
        "inf",
        "1e30",
    ] {
        origin.script("/t", vec![Answer::ok("fine")]);
        let resp = client
            .get_with(&origin.url("/t"), &format!("x-egress-timeout: {value}\r\n"))
            .await;
        let body = resp.assert_sidecar_error(400, "bad_request", value);
        assert!(body.contains("x-egress-timeout"), "{value}: {body}");
    }
    assert!(origin.requests("/t").is_empty(), "none went upstream");
    // The same connection still serves, and the bound itself is taken.
    origin.script("/t", vec![Answer::ok("fine")]);
    let resp = client
        .get_with(&origin.url("/t"), "x-egress-timeout: 365d\r\n")
        .await;
    assert_eq!((resp.status, resp.text()), (200, "fine".to_owned()));
    sidecar.stop().await;
}

#[tokio::test]
async fn an_upstreams_extreme_retry_after_is_ignored_and_counted() {
    let origin = ScriptedOrigin::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: origin\n    url: http://{}\n    retry: {{ attempts: 1, on: [429], backoff: {{ base: 10ms, max: 20ms }} }}\n",
        origin.addr
    ))
    .await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let max = u64::MAX.to_string();
    let cases = [
        ("retry-after-ms", "1e30"),
        ("retry-after-ms", "NaN"),
        ("retry-after-ms", "inf"),
        ("retry-after-ms", "-1"),
        ("retry-after-ms", max.as_str()),
        ("retry-after", max.as_str()),
        ("retry-after", "-1"),
        ("retry-after", "Fri, 31 Dec 9999 23:59:59 GMT"),
    ];
    for (n, (header, value)) in cases.iter().enumerate() {
        let path = format!("/r{n}");
        origin.script(
            &path,
            vec![Answer::status(429).header(header, value), Answer::ok("second")],
        );
        let resp = client.get_with(&origin.url(&path), "").await;
        assert_eq!(
            (resp.status, resp.text()),
            (200, "second".to_owned()),
            "{header}: {value}: retried by backoff"
        );
        assert_eq!(origin.requests(&path).len(), 2, "{header}: {value}");
    }
    let scrape = support::scrape(sidecar.admin).await;
    let ignored = |header| {
        support::value(
            &scrape,
            "egress_upstream_ignored_headers_total",
            &[("upstream", "origin"), ("header", header)],
        )
    };
    assert_eq!(ignored("retry-after-ms"), 5.0);
    assert_eq!(ignored("retry-after"), 3.0);
    assert_eq!(support::value(&scrape, "egress_panics_total", &[]), 0.0);
    sidecar.stop().await;
}
