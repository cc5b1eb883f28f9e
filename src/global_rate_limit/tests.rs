//! The global rate limit against a rate-limit service served in the test with tonic (what it answers is
//! scripted per test; what it was asked is kept): descriptors and their addends, the over-limit
//! cache, waits, token batches, and the service down or slow under each failure mode. The real
//! service (envoyproxy/ratelimit on Redis) is driven by `tests/global_rate_limit.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::HeaderValue as PbHeader;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use http::HeaderMap;

use super::*;
use crate::config::{Authority, DescriptorSpec, Scheme};

type Script = dyn Fn(&RateLimitRequest) -> RateLimitResponse + Send + Sync;

struct Fake {
    asked: Mutex<Vec<RateLimitRequest>>,
    answer: Box<Script>,
    delay: Duration,
}

#[tonic::async_trait]
impl RateLimitService for Fake {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let request = request.into_inner();
        let answer = (self.answer)(&request);
        self.asked.lock().unwrap().push(request);
        tokio::time::sleep(self.delay).await;
        Ok(tonic::Response::new(answer))
    }
}

pub(crate) struct Served {
    fake: Arc<Fake>,
    pub(crate) port: u16,
    server: tokio::task::JoinHandle<()>,
}

impl Served {
    pub(crate) fn asked(&self) -> Vec<RateLimitRequest> {
        self.fake.asked.lock().unwrap().clone()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// A rate-limit service on loopback answering as `answer` says, after `delay`.
pub(crate) async fn serve(
    delay: Duration,
    answer: impl Fn(&RateLimitRequest) -> RateLimitResponse + Send + Sync + 'static,
) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let fake = Arc::new(Fake {
        asked: Mutex::default(),
        answer: Box::new(answer),
        delay,
    });
    let service = RateLimitServiceServer::from_arc(fake.clone());
    // Served by hyper as the sidecar's h2c listener is: tonic's router is not compiled.
    let server = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((tcp, _)) = listener.accept().await {
            let service = service.clone();
            let call = hyper::service::service_fn(move |req| tower::Service::call(&mut service.clone(), req));
            let http2 = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
            connections.spawn(async move {
                let _ = http2
                    .serve_connection(hyper_util::rt::TokioIo::new(tcp), call)
                    .await;
            });
        }
    });
    Served { fake, port, server }
}

pub(crate) fn status(code: Code, reset_secs: i64) -> DescriptorStatus {
    DescriptorStatus {
        code: code as i32,
        duration_until_reset: Some(PbDuration {
            seconds: reset_secs,
            nanos: 0,
        }),
        ..Default::default()
    }
}

/// Every descriptor `code`; the overall code the service would give.
fn all(code: Code, reset_secs: i64) -> impl Fn(&RateLimitRequest) -> RateLimitResponse {
    move |req| RateLimitResponse {
        overall_code: code as i32,
        statuses: req.descriptors.iter().map(|_| status(code, reset_secs)).collect(),
        ..Default::default()
    }
}

fn section(port: u16, descriptors: Vec<Vec<Entry>>) -> GlobalRateLimitConfig {
    let descriptors: Vec<DescriptorSpec> = descriptors
        .into_iter()
        .map(|entries| DescriptorSpec { entries })
        .collect();
    GlobalRateLimitConfig {
        service: Some(ServiceUrl {
            scheme: Scheme::Http,
            authority: Authority {
                host: "127.0.0.1".into(),
                port,
            },
        }),
        domain: "egress".into(),
        tokens: descriptors.iter().any(DescriptorSpec::counts_tokens),
        descriptors,
        ..GlobalRateLimitConfig::unset()
    }
}

fn tokens_entry() -> Entry {
    Entry::Literal {
        key: "unit".into(),
        value: "tokens".into(),
    }
}

fn limiter(config: &GlobalRateLimitConfig, metrics: &Metrics) -> Arc<Limiter> {
    Services::default()
        .limiter("partner", config, metrics)
        .expect("on")
}

async fn decide(limiter: &Arc<Limiter>, headers: &HeaderMap) -> Result<Granted, Refusal> {
    let asking = limiter
        .describe(headers, Some("billing"))
        .expect("a descriptor applies");
    match limiter.check(asking, None) {
        Decision::Refused(refusal) => Err(refusal),
        Decision::Ask(check) => check.await,
    }
}

fn pairs(d: &RateLimitDescriptor) -> Vec<(&str, &str)> {
    d.entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()))
        .collect()
}

#[tokio::test]
async fn descriptors_are_filled_from_the_request_and_one_lacking_its_header_is_not_sent() {
    let served = serve(Duration::ZERO, all(Code::Ok, 60)).await;
    let config = section(
        served.port,
        vec![
            vec![Entry::Upstream],
            vec![Entry::Upstream, Entry::App],
            vec![Entry::Header {
                name: "x-tenant".into(),
            }],
            vec![Entry::Literal {
                key: "generic_key".into(),
                value: "openai-org".into(),
            }],
        ],
    );
    let metrics = Metrics::new();
    let limiter = limiter(&config, &metrics);
    decide(&limiter, &HeaderMap::new()).await.unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("x-tenant", "acme".parse().unwrap());
    decide(&limiter, &headers).await.unwrap();
    let asked = served.asked();
    assert_eq!(asked.len(), 2);
    assert_eq!(asked[0].domain, "egress");
    let sent: Vec<Vec<_>> = asked[0].descriptors.iter().map(pairs).collect();
    assert_eq!(
        sent,
        vec![
            vec![("upstream", "partner")],
            vec![("upstream", "partner"), ("app", "billing")],
            vec![("generic_key", "openai-org")],
        ]
    );
    let sent: Vec<Vec<_>> = asked[1].descriptors.iter().map(pairs).collect();
    assert_eq!(sent[2], vec![("x-tenant", "acme")]);
    assert!(
        asked
            .iter()
            .flat_map(|r| &r.descriptors)
            .all(|d| d.hits_addend.is_none()),
        "each counts one"
    );
    assert_eq!(metrics.global_rate_limit("partner").ok.get(), 2);
}

#[tokio::test]
async fn an_over_limit_answer_refuses_with_its_reset_and_the_cache_answers_until_then() {
    let served = serve(Duration::ZERO, |req: &RateLimitRequest| RateLimitResponse {
        overall_code: Code::OverLimit as i32,
        statuses: vec![status(Code::OverLimit, 7), status(Code::Ok, 60)][..req.descriptors.len()].to_vec(),
        response_headers_to_add: vec![
            PbHeader {
                key: "ratelimit-limit".into(),
                value: "30".into(),
                ..Default::default()
            },
            PbHeader {
                key: "content-length".into(),
                value: "0".into(),
                ..Default::default()
            },
        ],
        ..Default::default()
    })
    .await;
    let config = section(served.port, vec![vec![Entry::Upstream], vec![Entry::App]]);
    let metrics = Metrics::new();
    let limiter = limiter(&config, &metrics);
    match decide(&limiter, &HeaderMap::new()).await {
        Err(Refusal::OverLimit {
            retry_after_secs,
            headers,
        }) => {
            assert_eq!(retry_after_secs, 7);
            let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["ratelimit-limit"], "a framing field is not passed on");
        }
        other => panic!("{other:?}"),
    }
    for _ in 0..100 {
        let asking = limiter.describe(&HeaderMap::new(), None).unwrap();
        match limiter.check(asking, None) {
            Decision::Refused(Refusal::OverLimit { retry_after_secs, .. }) => {
                assert!((6..=7).contains(&retry_after_secs));
            }
            other => panic!("the cache should answer: {other:?}"),
        }
    }
    assert_eq!(
        served.asked().len(),
        1,
        "no call while the descriptor is known spent"
    );
    let counts = metrics.global_rate_limit("partner");
    assert_eq!((counts.over_limit.get(), counts.cached.get()), (1, 100));
}

#[tokio::test]
async fn token_descriptors_are_checked_with_zero_and_charged_in_one_batched_call() {
    let served = serve(Duration::ZERO, all(Code::Ok, 60)).await;
    let config = section(
        served.port,
        vec![vec![Entry::Upstream], vec![Entry::Upstream, tokens_entry()]],
    );
    let metrics = Metrics::new();
    let limiter = limiter(&config, &metrics);
    let first = decide(&limiter, &HeaderMap::new()).await.unwrap();
    let second = decide(&limiter, &HeaderMap::new()).await.unwrap();
    let check = &served.asked()[0];
    assert_eq!(check.hits_addend, 0);
    assert_eq!(check.descriptors[0].hits_addend, None, "the request counts one");
    assert_eq!(
        check.descriptors[1].hits_addend,
        Some(UInt64Value { value: 0 }),
        "tokens: checked only"
    );
    first.charge.expect("a token descriptor").tokens(300);
    second.charge.unwrap().tokens(200);
    let reported = async {
        loop {
            if served.asked().len() > 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), reported)
        .await
        .expect("a report");
    tokio::time::sleep(REPORT_EVERY * 3).await;
    let asked = served.asked();
    assert_eq!(asked.len(), 3, "both answers' tokens in one call");
    let report = &asked[2];
    assert_eq!(report.descriptors.len(), 1, "only the token descriptor");
    assert_eq!(
        pairs(&report.descriptors[0]),
        [("upstream", "partner"), ("unit", "tokens")]
    );
    assert_eq!(
        report.descriptors[0].hits_addend,
        Some(UInt64Value { value: 500 })
    );
}

#[tokio::test]
async fn an_over_limit_reset_within_max_wait_holds_the_request_then_asks_again() {
    let calls = Arc::new(Mutex::new(0));
    let counted = calls.clone();
    let served = serve(Duration::ZERO, move |req: &RateLimitRequest| {
        let mut n = counted.lock().unwrap();
        *n += 1;
        let code = if *n == 1 { Code::OverLimit } else { Code::Ok };
        all(code, 1)(req)
    })
    .await;
    let mut config = section(served.port, vec![vec![Entry::Upstream]]);
    config.max_wait = Duration::from_secs(5);
    let metrics = Metrics::new();
    let limiter = limiter(&config, &metrics);
    let granted = decide(&limiter, &HeaderMap::new()).await;
    assert!(granted.is_ok(), "{granted:?}");
    assert_eq!(served.asked().len(), 2, "asked again after the reset");
    let counts = metrics.global_rate_limit("partner");
    assert_eq!((counts.over_limit.get(), counts.ok.get()), (1, 1));
    // A deadline before the reset: no use waiting.
    *calls.lock().unwrap() = 0;
    let asking = limiter.describe(&HeaderMap::new(), None).unwrap();
    let soon = Instant::now() + Duration::from_millis(100);
    let Decision::Ask(check) = limiter.check(asking, Some(soon)) else {
        panic!("nothing cached yet");
    };
    assert!(matches!(check.await, Err(Refusal::OverLimit { .. })));
}

#[tokio::test]
async fn a_service_down_or_slow_is_decided_by_failure_mode() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let slow = serve(Duration::from_secs(2), all(Code::Ok, 60)).await;
    for port in [closed, slow.port] {
        let metrics = Metrics::new();
        let mut config = section(port, vec![vec![Entry::Upstream]]);
        let allow = limiter(&config, &metrics);
        assert!(
            decide(&allow, &HeaderMap::new()).await.is_ok(),
            "allow: the request goes"
        );
        config.failure_mode = FailureMode::Deny;
        let deny = limiter(&config, &metrics);
        match decide(&deny, &HeaderMap::new()).await {
            Err(Refusal::Unavailable(_)) => {}
            other => panic!("deny: {other:?}"),
        }
        let counts = metrics.global_rate_limit("partner");
        if port == closed {
            assert_eq!((counts.error.get(), counts.timeout.get()), (2, 0));
        } else {
            assert_eq!(
                (counts.error.get(), counts.timeout.get()),
                (0, 2),
                "slower than timeout"
            );
        }
    }
}

#[tokio::test]
async fn an_endpoint_that_accepts_and_closes_is_retried_with_a_backoff_not_per_call() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    let acceptor = tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(tcp);
        }
    });
    let metrics = Metrics::new();
    let limiter = limiter(&section(port, vec![vec![Entry::Upstream]]), &metrics);
    for _ in 0..20 {
        assert!(
            decide(&limiter, &HeaderMap::new()).await.is_ok(),
            "allow: the request goes"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    acceptor.abort();
    let accepted = accepted.load(std::sync::atomic::Ordering::SeqCst);
    // 20 calls over about 200 ms: attempts at 0, then after 100 and 200 ms of backoff.
    assert!((1..=4).contains(&accepted), "{accepted} connections for 20 calls");
    let counts = metrics.global_rate_limit("partner");
    assert_eq!(counts.error.get() + counts.timeout.get(), 20);
}

#[tokio::test]
async fn an_absurd_reset_is_held_to_a_day_not_a_panic() {
    let served = serve(Duration::ZERO, all(Code::OverLimit, i64::MAX)).await;
    let metrics = Metrics::new();
    let limiter = limiter(&section(served.port, vec![vec![Entry::Upstream]]), &metrics);
    match decide(&limiter, &HeaderMap::new()).await {
        Err(Refusal::OverLimit { retry_after_secs, .. }) => assert_eq!(retry_after_secs, 86_400),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        decide(&limiter, &HeaderMap::new()).await,
        Err(Refusal::OverLimit { .. })
    ));
    assert_eq!(served.asked().len(), 1, "cached for the day");
}
