//! `/debug/pools` on the admin listener lists exactly the connections the upstream sees: their
//! number (counted at the upstream), protocol, state, requests and HTTP/2 streams.

mod support;

use std::time::Duration;

use serde_json::Value;
use support::{debug_pool, eventually, spawn_gets, FakeUpstream, RawClient, Sidecar};

fn connections(pool: &Value) -> &Vec<Value> {
    pool["connections"].as_array().expect("a connections array")
}

fn in_state<'a>(pool: &'a Value, state: &str) -> Vec<&'a Value> {
    connections(pool).iter().filter(|c| c["state"] == state).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_connections_match_the_upstream_busy_and_idle() {
    let upstream = FakeUpstream::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: up\n    url: http://{}\n    pool: {{ max_connections: 8, idle_timeout: 30s }}\n",
        upstream.addr
    ))
    .await;
    let up = upstream.addr;
    // Three requests in a row on one connection.
    let mut client = RawClient::connect(sidecar.addr).await;
    for _ in 0..3 {
        assert_eq!(client.get(&format!("http://{up}/")).await.status, 200);
    }
    let pool = debug_pool(sidecar.admin, "up").await;
    assert_eq!(pool["open"], 1);
    assert_eq!(connections(&pool).len(), upstream.open());
    let conn = &connections(&pool)[0];
    assert_eq!(conn["protocol"], "http1");
    assert_eq!(conn["state"], "idle");
    assert_eq!(conn["requests"], 3);
    assert!(conn["idle_seconds"].as_f64().is_some());

    // Four slow requests at once: the idle connection and three new ones, all busy.
    let slow = spawn_gets(sidecar.addr, &format!("http://{up}/sleep/1000"), 4);
    assert!(eventually(Duration::from_secs(3), || upstream.requests() == 7).await);
    let pool = debug_pool(sidecar.admin, "up").await;
    assert_eq!(upstream.open(), 4);
    assert_eq!(connections(&pool).len(), upstream.open(), "{pool:#}");
    assert_eq!(pool["open"], 4);
    assert_eq!(in_state(&pool, "active").len(), 4, "{pool:#}");
    assert!(in_state(&pool, "active")
        .iter()
        .all(|c| c["idle_seconds"].is_null()));
    for task in slow {
        assert_eq!(task.await.unwrap().status, 200);
    }

    let pool = debug_pool(sidecar.admin, "up").await;
    assert_eq!(connections(&pool).len(), upstream.open());
    assert_eq!(in_state(&pool, "idle").len(), 4, "{pool:#}");
    let served: u64 = connections(&pool)
        .iter()
        .map(|c| c["requests"].as_u64().unwrap())
        .sum();
    assert_eq!(served, upstream.requests() as u64);
    assert_eq!(pool["opened_total"], upstream.accepted());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_are_shown_per_connection() {
    let upstream = FakeUpstream::start_h2(None, 50).await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: h2\n    url: http://{}\n    protocol: http2\n",
        upstream.addr
    ))
    .await;
    let slow = spawn_gets(sidecar.addr, &format!("http://{}/sleep/1000", upstream.addr), 20);
    assert!(eventually(Duration::from_secs(3), || upstream.requests() == 20).await);
    let pool = debug_pool(sidecar.admin, "h2").await;
    assert_eq!(upstream.open(), 1);
    assert_eq!(connections(&pool).len(), 1, "{pool:#}");
    let conn = &connections(&pool)[0];
    assert_eq!(conn["protocol"], "http2");
    assert_eq!(conn["state"], "active");
    assert_eq!(conn["streams_in_use"], 20);
    assert_eq!(
        conn["stream_limit"], 50,
        "min(100 configured, 50 from the server)"
    );
    for task in slow {
        assert_eq!(task.await.unwrap().status, 200);
    }
    let pool = debug_pool(sidecar.admin, "h2").await;
    let conn = &connections(&pool)[0];
    assert_eq!(conn["state"], "idle");
    assert_eq!(conn["streams_in_use"], 0);
    assert_eq!(conn["requests"], 20);
    assert_eq!(pool["protocol"], "http2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_in_flight_is_listed_as_connecting() {
    let blackhole = support::Blackhole::start().await;
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: slow\n    url: http://{}\n    connect_timeout: 2s\n",
        blackhole.addr
    ))
    .await;
    let (addr, target) = (sidecar.addr, blackhole.addr);
    let pending = tokio::spawn(async move {
        RawClient::connect(addr)
            .await
            .get(&format!("http://{target}/"))
            .await
    });
    let mut pool = Value::Null;
    let listed = async {
        loop {
            pool = debug_pool(sidecar.admin, "slow").await;
            if !connections(&pool).is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(2), listed)
        .await
        .expect("the dial is listed");
    let conn = &connections(&pool)[0];
    assert_eq!(conn["state"], "connecting", "{pool:#}");
    assert!(conn["protocol"].is_null());
    pending.abort();
}
