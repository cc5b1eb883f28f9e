//! `/metrics` on the admin listener: after a scripted load the values equal what the test
//! counted, the gauges return to 0 once connections idle out, and the output parses as
//! Prometheus text.

mod support;

use std::time::Duration;

use support::{scrape, value, FakeUpstream, RawClient, Sidecar};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_a_scripted_load_and_gauges_return_to_zero() {
    let upstream = FakeUpstream::start().await;
    let refusing = support::RefusingPort::new();
    let refused = refusing.addr;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: up\n    url: http://{}\n    pool: {{ idle_timeout: 300ms, max_connections: 2, max_pending: 0 }}\n",
        upstream.addr
    ))
    .await;
    // 10 successes over two client connections, one of them concurrent with a slow request.
    let mut a = RawClient::connect(sidecar.addr).await;
    let mut b = RawClient::connect(sidecar.addr).await;
    for _ in 0..5 {
        assert_eq!(a.get(&format!("http://{}/", upstream.addr)).await.status, 200);
        assert_eq!(b.get(&format!("http://{}/", upstream.addr)).await.status, 200);
    }
    // Two slow requests hold both connections; a third is rejected (max_pending: 0).
    let up = upstream.addr;
    let slow = support::spawn_gets(sidecar.addr, &format!("http://{up}/sleep/500"), 2);
    assert!(support::eventually(Duration::from_secs(3), || upstream.requests() == 12).await);
    let rejected = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{up}/"))
        .await;
    assert_eq!(rejected.status, 503);
    for task in slow {
        assert_eq!(task.await.unwrap().status, 200);
    }
    // One request to a port that refuses connections.
    let failed = RawClient::connect(sidecar.addr)
        .await
        .get(&format!("http://{refused}/"))
        .await;
    assert_eq!(failed.status, 502);

    let m = scrape(sidecar.admin).await;
    let up_label = [("upstream", "up")];
    assert_eq!(
        value(
            &m,
            "egress_upstream_requests_total",
            &[("upstream", "up"), ("code", "200")]
        ),
        12.0
    );
    assert_eq!(
        value(
            &m,
            "egress_upstream_requests_total",
            &[("upstream", "up"), ("code", "503")]
        ),
        1.0
    );
    let refused_label = refused.to_string();
    assert_eq!(
        value(
            &m,
            "egress_upstream_requests_total",
            &[("upstream", refused_label.as_str()), ("code", "502")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &m,
            "egress_pool_rejected_total",
            &[("upstream", "up"), ("reason", "pool_overflow")]
        ),
        1.0
    );
    assert_eq!(
        value(&m, "egress_upstream_connections_opened_total", &up_label),
        upstream.accepted() as f64
    );
    assert_eq!(upstream.accepted(), 2);
    assert_eq!(
        value(&m, "egress_pool_reused_total", &up_label),
        10.0,
        "12 requests on 2 connections"
    );
    assert_eq!(value(&m, "egress_downstream_connections_opened_total", &[]), 6.0);
    assert_eq!(
        value(&m, "egress_pool_wait_duration_seconds_count", &up_label),
        12.0
    );
    assert_eq!(
        value(&m, "egress_upstream_request_duration_seconds_count", &up_label),
        12.0
    );
    assert_eq!(
        value(
            &m,
            "egress_upstream_connections",
            &[("upstream", "up"), ("state", "idle")]
        ),
        2.0
    );

    // Idle upstream connections close after 300ms: gauges to 0, closes counted with their reason.
    drop((a, b));
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| {
        let closed = [("upstream", "up"), ("reason", "idle_timeout")];
        value(m, "egress_upstream_connections_closed_total", &closed) == 2.0
            && value(m, "egress_upstream_connections", &up_label) == 0.0
            && value(m, "egress_downstream_connections", &[]) == 0.0
    })
    .await;
    for state in ["idle", "active"] {
        assert_eq!(
            value(
                &m,
                "egress_upstream_connections",
                &[("upstream", "up"), ("state", state)]
            ),
            0.0,
            "{state}"
        );
    }
    assert_eq!(value(&m, "egress_pool_pending_requests", &up_label), 0.0);
    assert_eq!(
        value(
            &m,
            "egress_upstream_connections_closed_total",
            &[("upstream", "up"), ("reason", "idle_timeout")]
        ),
        2.0
    );
    assert!(
        support::eventually(Duration::from_secs(2), || upstream.open() == 0).await,
        "the upstream saw its connections close"
    );
    assert_eq!(value(&m, "egress_downstream_connections", &[]), 0.0);
    assert!(value(&m, "egress_downstream_requests_per_connection_count", &[]) >= 4.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_pool_metrics_count_streams_on_one_connection_and_return_to_zero() {
    let upstream = FakeUpstream::start_h2(None, 100).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: h2\n    url: http://{}\n    protocol: http2\n    pool: {{ idle_timeout: 300ms }}\n",
        upstream.addr
    ))
    .await;
    let tasks = support::spawn_gets(sidecar.addr, &format!("http://{}/sleep/200", upstream.addr), 20);
    for task in tasks {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let m = scrape(sidecar.admin).await;
    let label = [("upstream", "h2")];
    assert_eq!(
        value(
            &m,
            "egress_upstream_requests_total",
            &[("upstream", "h2"), ("code", "200")]
        ),
        20.0
    );
    assert_eq!(
        value(&m, "egress_upstream_connections_opened_total", &label),
        upstream.accepted() as f64
    );
    assert_eq!(upstream.accepted(), 1);
    assert_eq!(
        value(
            &m,
            "egress_upstream_connections",
            &[("upstream", "h2"), ("state", "idle")]
        ),
        1.0
    );
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| {
        let closed = [("upstream", "h2"), ("reason", "idle_timeout")];
        value(m, "egress_upstream_connections_closed_total", &closed) == 1.0
            && value(m, "egress_upstream_connections", &label) == 0.0
    })
    .await;
    for state in ["idle", "active"] {
        assert_eq!(
            value(
                &m,
                "egress_upstream_connections",
                &[("upstream", "h2"), ("state", state)]
            ),
            0.0,
            "{state}"
        );
    }
    assert_eq!(
        value(
            &m,
            "egress_upstream_connections_closed_total",
            &[("upstream", "h2"), ("reason", "idle_timeout")]
        ),
        1.0
    );
    assert!(support::eventually(Duration::from_secs(2), || upstream.open() == 0).await);
}
