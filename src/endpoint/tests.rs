//! Unit tests of the endpoint set: balance, ejection and the answer's replacement.

use super::*;

fn addr(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

fn set(addrs: &[&str], balance: Balance) -> Arc<Set> {
    Set::new(SetSpec {
        label: "t".into(),
        authority: Authority {
            host: "t.test".into(),
            port: 80,
        },
        addresses: addrs.iter().map(|a| addr(a)).collect(),
        parent: None,
        balance,
        outlier: OutlierConfig::default(),
        resolver: Arc::new(dns::Resolver::new(&Default::default())),
        metrics: crate::metrics::Metrics::new().upstream("t"),
    })
}

fn guard() -> Guard {
    let config = crate::config::parse("", &Default::default()).unwrap();
    Guard::new(Vec::new(), config.policy)
}

/// Plans `n` dials and keeps their claims (connections that stay open).
async fn open_n(set: &Arc<Set>, n: usize) -> Vec<Claim> {
    let mut claims = Vec::new();
    for _ in 0..n {
        let plan = set.plan(&guard()).await.unwrap();
        claims.push(plan.claim_for(0));
    }
    claims
}

fn spread(set: &Set) -> Vec<usize> {
    set.lock().endpoints.iter().map(|e| e.open()).collect()
}

#[tokio::test]
async fn least_connections_spreads_a_burst_evenly() {
    let set = set(
        &["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"],
        Balance::LeastConnections,
    );
    let claims = open_n(&set, 30).await;
    assert_eq!(spread(&set), vec![10, 10, 10]);
    drop(claims);
    assert_eq!(spread(&set), vec![0, 0, 0], "claims give their load back");
}

#[tokio::test]
async fn ties_go_in_turn_from_the_first_address() {
    let set = set(&["[::1]:80", "10.0.0.2:80"], Balance::LeastConnections);
    let first = set.plan(&guard()).await.unwrap();
    assert_eq!(first.attempts[0].addr(), addr("[::1]:80"));
    assert_eq!(
        first.attempts[1].addr(),
        addr("10.0.0.2:80"),
        "the others follow as fallbacks"
    );
    drop(first);
    let second = set.plan(&guard()).await.unwrap();
    assert_eq!(
        second.attempts[0].addr(),
        addr("10.0.0.2:80"),
        "a tie goes to the next in turn"
    );
}

#[tokio::test]
async fn a_winner_other_than_the_pick_takes_the_claim() {
    let set = set(&["10.0.0.1:80", "10.0.0.2:80"], Balance::LeastConnections);
    let plan = set.plan(&guard()).await.unwrap();
    assert_eq!(spread(&set), vec![1, 0]);
    let claim = plan.claim_for(1);
    assert_eq!(claim.endpoint().addr(), addr("10.0.0.2:80"));
    assert_eq!(spread(&set), vec![0, 1]);
}

#[tokio::test]
async fn failures_eject_at_most_half_and_a_success_clears_them() {
    let set = set(&["10.0.0.1:80", "10.0.0.2:80"], Balance::LeastConnections);
    let (a, b) = {
        let inner = set.lock();
        (inner.endpoints[0].clone(), inner.endpoints[1].clone())
    };
    for _ in 0..3 {
        set.failed(&a);
    }
    for _ in 0..5 {
        set.failed(&b);
    }
    let counts = set.counts();
    assert_eq!(
        (counts.active, counts.ejected),
        (1, 1),
        "the second of two stays in use"
    );
    let report = set.report(|_| 0);
    assert_eq!(report.endpoints[0].state, "ejected");
    assert!(report.endpoints[0].ejected_until.is_some());
    assert_eq!(report.endpoints[1].state, "active");
    // Every dial now starts at the endpoint still in use; the ejected one is tried last.
    for _ in 0..3 {
        let plan = set.plan(&guard()).await.unwrap();
        assert_eq!(plan.attempts[0].addr(), b.addr());
        assert_eq!(plan.attempts[1].addr(), a.addr());
    }
    b.succeeded();
    assert_eq!(b.failures.load(Ordering::Relaxed), 0);
}

#[tokio::test(start_paused = true)]
async fn an_ejection_ends_then_one_more_failure_ejects_for_twice_as_long() {
    let set = set(
        &["10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"],
        Balance::LeastConnections,
    );
    let a = set.lock().endpoints[0].clone();
    for _ in 0..3 {
        set.failed(&a);
    }
    let first = set.report(|_| 0).endpoints[0].ejected_for_ms.unwrap();
    assert!((4_900..=5_000).contains(&first), "{first}");
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(set.counts().ejected, 0, "probed again after the ejection");
    set.failed(&a);
    let second = set.report(|_| 0).endpoints[0].ejected_for_ms.unwrap();
    assert!((9_900..=10_000).contains(&second), "{second}");
}

#[tokio::test]
async fn p2c_prefers_the_cheaper_endpoint() {
    let set = set(&["10.0.0.1:80", "10.0.0.2:80"], Balance::P2cEwma);
    let (fast, slow) = {
        let inner = set.lock();
        (inner.endpoints[0].clone(), inner.endpoints[1].clone())
    };
    fast.observe_latency(Duration::from_millis(1));
    slow.observe_latency(Duration::from_millis(100));
    let claims = open_n(&set, 20).await;
    // Cost is latency times load: the fast one takes connections until it carries about 100
    // times the load of the slow one.
    assert_eq!(spread(&set), vec![20, 0]);
    drop(claims);
}

#[test]
fn a_new_answer_keeps_records_and_drains_what_left() {
    let set = set(&[], Balance::LeastConnections);
    let mut inner = set.lock();
    assert!(!inner.replace(vec![addr("10.0.0.1:80"), addr("10.0.0.2:80")]));
    let kept = inner.endpoints[0].clone();
    let busy = inner.endpoints[1].clone();
    let claim = Claim::new(busy.clone());
    assert!(
        inner.replace(vec![addr("10.0.0.1:80"), addr("10.0.0.3:80")]),
        "10.0.0.2 left"
    );
    assert!(
        Arc::ptr_eq(&inner.endpoints[0], &kept),
        "a staying endpoint keeps its record"
    );
    assert!(busy.is_removed());
    assert_eq!(inner.draining.len(), 1, "kept while it has a connection");
    assert!(!inner.replace(vec![addr("10.0.0.2:80")]) || !busy.is_removed());
    assert!(!busy.is_removed(), "back in the answer, no longer draining");
    assert!(Arc::ptr_eq(&inner.endpoints[0], &busy));
    drop(claim);
}

#[test]
fn families_alternate_after_the_first() {
    let a = |s: &str| s.parse::<SocketAddr>().unwrap();
    let (v6a, v6b) = (a("[::1]:80"), a("[::2]:80"));
    let (v4a, v4b, v4c) = (a("127.0.0.1:80"), a("127.0.0.2:80"), a("127.0.0.3:80"));
    let order = |v: Vec<SocketAddr>| interleave_families(v, SocketAddr::is_ipv6);
    assert_eq!(
        order(vec![v6a, v6b, v4a, v4b, v4c]),
        vec![v6a, v4a, v6b, v4b, v4c]
    );
    assert_eq!(order(vec![v4a, v4b, v6a]), vec![v4a, v6a, v4b]);
    assert_eq!(order(vec![]), Vec::<SocketAddr>::new());
}
