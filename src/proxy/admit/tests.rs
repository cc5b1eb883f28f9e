//! The admission step on served connections, HTTP/1.1 and h2c alike: what it is given, that a
//! refused request goes nowhere, and that a held one goes once its wait ends, not before.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use super::{Admission, Admit, Admitting};
use crate::clients::Source;
use crate::downstream::testing::{ok_upstream as upstream, serve_admitting};
use crate::error::{ErrorKind, ProxyError};
use crate::proxy::tests::{h2c_get, read_response};

/// What the step was given for one request.
#[derive(Debug, Clone, PartialEq)]
struct Given {
    upstream: String,
    method: String,
    uri: String,
    app: Option<String>,
    source: Source,
    deadline: Option<Duration>,
}

fn recording(given: Arc<Mutex<Vec<Given>>>) -> Admit {
    Admit::probed(Box::new(move |req: &mut Admitting<'_>| {
        let app = req.request.headers().get("x-app");
        given.lock().unwrap().push(Given {
            upstream: req.upstream.label().to_string(),
            method: req.request.method().to_string(),
            uri: req.request.uri().to_string(),
            app: app.map(|v| v.to_str().unwrap().to_owned()),
            source: req.source.clone(),
            deadline: req.deadline.map(|d| d.limit()),
        });
        Admission::Now
    }))
}

#[tokio::test]
async fn the_step_is_given_the_routed_request_its_source_and_its_deadline_on_both_protocols() {
    let (up, requests) = upstream().await;
    let given = Arc::new(Mutex::new(Vec::new()));
    let (me, _ctx) = serve_admitting("", recording(given.clone())).await;

    let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
    let req = format!(
        "GET http://{up}/one?q=1 HTTP/1.1\r\nhost: {up}\r\nx-app: h1\r\nx-egress-timeout: 7s\r\n\r\n"
    );
    client.write_all(req.as_bytes()).await.unwrap();
    let answer = read_response(&mut client).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    let (h2_source, status, body) = h2c_get(me, &format!("http://{up}/two"), ("x-app", "h2")).await;
    assert_eq!((status, &body[..]), (200, &b"ok"[..]));

    let given = given.lock().unwrap().clone();
    let label = up.to_string();
    assert_eq!(
        given,
        [
            Given {
                upstream: label.clone(),
                method: "GET".into(),
                // As it goes upstream: origin-form, after the sidecar's own headers are taken.
                uri: "/one?q=1".into(),
                app: Some("h1".into()),
                source: Source::Tcp(client.local_addr().unwrap()),
                deadline: Some(Duration::from_secs(7)),
            },
            Given {
                upstream: label,
                method: "GET".into(),
                uri: "/two".into(),
                app: Some("h2".into()),
                source: Source::Tcp(h2_source),
                deadline: None,
            },
        ]
    );
    assert_eq!(requests.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_refused_request_goes_nowhere_and_a_held_one_goes_when_its_wait_ends() {
    let (up, requests) = upstream().await;
    let (release, released) = tokio::sync::watch::channel(false);
    let admit = Admit::probed(Box::new(move |req: &mut Admitting<'_>| {
        if req.request.uri().path() == "/refused" {
            return Admission::Refused(ProxyError::new(ErrorKind::Denied, "refused by the test's step"));
        }
        let mut released = released.clone();
        Admission::After(Box::pin(async move {
            let _ = released.wait_for(|r| *r).await;
            Ok(crate::global_rate_limit::Granted::default())
        }))
    }));
    let (me, _ctx) = serve_admitting("", admit).await;

    let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
    let req = format!("GET http://{up}/refused HTTP/1.1\r\nhost: {up}\r\n\r\n");
    client.write_all(req.as_bytes()).await.unwrap();
    let answer = read_response(&mut client).await;
    assert!(answer.starts_with("HTTP/1.1 403 "), "{answer}");
    assert!(answer.contains("refused by the test's step"), "{answer}");
    assert_eq!(
        requests.load(Ordering::SeqCst),
        0,
        "a refused request went upstream"
    );

    let held_uri = format!("http://{up}/held");
    let held = tokio::spawn(async move { h2c_get(me, &held_uri, ("x-app", "h2")).await });
    let req = format!("GET http://{up}/held HTTP/1.1\r\nhost: {up}\r\n\r\n");
    client.write_all(req.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        requests.load(Ordering::SeqCst),
        0,
        "a held request went before its wait ended"
    );
    release.send(true).unwrap();
    let answer = read_response(&mut client).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    let (_, status, _) = held.await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(requests.load(Ordering::SeqCst), 2);
}

/// An upstream that keeps each request head it reads and answers with `script` in turn, then
/// `ok`.
async fn heads_upstream(script: Vec<&'static [u8]>) -> (std::net::SocketAddr, Arc<Mutex<Vec<String>>>) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let kept = heads.clone();
    let script = Arc::new(Mutex::new(script.into_iter()));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let (kept, script) = (kept.clone(), script.clone());
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = s.read(&mut buf).await {
                    got.extend_from_slice(&buf[..n]);
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head: Vec<u8> = got.drain(..end + 4).collect();
                        kept.lock()
                            .unwrap()
                            .push(String::from_utf8_lossy(&head).to_lowercase());
                        let ok = &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"[..];
                        let answer = script.lock().unwrap().next().unwrap_or(ok);
                        if s.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, heads)
}

#[tokio::test]
async fn the_global_rate_limit_refuses_over_its_limit_and_adds_what_the_service_asks_on_both_protocols() {
    use crate::global_rate_limit::tests::{serve, status};
    use envoy_types::pb::envoy::config::core::v3::HeaderValue as PbHeader;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

    let header = |key: &str, value: &str| PbHeader {
        key: key.into(),
        value: value.into(),
        ..Default::default()
    };
    let service = serve(Duration::ZERO, move |req: &RateLimitRequest| {
        let spent = req
            .descriptors
            .iter()
            .flat_map(|d| &d.entries)
            .any(|e| e.value == "spent");
        let code = if spent { Code::OverLimit } else { Code::Ok };
        RateLimitResponse {
            overall_code: code as i32,
            statuses: req.descriptors.iter().map(|_| status(code, 9)).collect(),
            response_headers_to_add: vec![header("ratelimit-reset", "9")],
            request_headers_to_add: vec![header("x-quota", "granted")],
            ..Default::default()
        }
    })
    .await;
    let (up, heads) = heads_upstream(Vec::new()).await;
    let yaml = format!(
        "defaults:\n  global_rate_limit:\n    service: http://127.0.0.1:{}\n    domain: egress\n    descriptors: [[{{ key: upstream }}, {{ key: app }}]]\n",
        service.port
    );
    let (me, _ctx) = crate::downstream::testing::serve_for_test(&yaml).await;
    let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
    let get = |app: &str| format!("GET http://{up}/q HTTP/1.1\r\nhost: {up}\r\nx-egress-app: {app}\r\n\r\n");

    client.write_all(get("billing").as_bytes()).await.unwrap();
    let answer = read_response(&mut client).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    client.write_all(get("spent").as_bytes()).await.unwrap();
    let answer = read_response(&mut client).await.to_lowercase();
    assert!(answer.starts_with("http/1.1 429 "), "{answer}");
    for field in [
        "x-egress-error: rate_limited",
        "retry-after: 9",
        "ratelimit-reset: 9",
    ] {
        assert!(answer.contains(field), "{field} in {answer}");
    }
    // Answered from the cache: no call, and still nothing upstream.
    let (_, status, body) = h2c_get(me, &format!("http://{up}/q"), ("x-egress-app", "spent")).await;
    assert_eq!(status, 429, "{body:?}");
    assert!(
        String::from_utf8_lossy(&body).contains("global_rate_limit"),
        "{body:?}"
    );

    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 1, "only the granted request went: {heads:?}");
    assert!(heads[0].contains("\r\nx-quota: granted\r\n"), "{}", heads[0]);
    let apps: Vec<String> = service
        .asked()
        .iter()
        .map(|r| r.descriptors[0].entries[1].value.clone())
        .collect();
    assert_eq!(apps, ["billing", "spent"], "the third was not asked");
}

#[tokio::test]
async fn a_rate_limit_service_down_refuses_503_under_deny_and_lets_requests_go_under_allow() {
    let (up, requests) = upstream().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for (mode, want) in [("deny", "503"), ("allow", "200")] {
        let yaml = format!(
            "defaults:\n  global_rate_limit:\n    service: http://127.0.0.1:{closed}\n    domain: egress\n    failure_mode: {mode}\n    descriptors: [[{{ key: upstream }}]]\n"
        );
        let (me, _ctx) = crate::downstream::testing::serve_for_test(&yaml).await;
        let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
        let req = format!("GET http://{up}/ HTTP/1.1\r\nhost: {up}\r\n\r\n");
        client.write_all(req.as_bytes()).await.unwrap();
        let answer = read_response(&mut client).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {want} ")),
            "{mode}: {answer}"
        );
        if mode == "deny" {
            assert!(
                answer.contains("x-egress-error: rate_limit_unavailable"),
                "{answer}"
            );
            assert_eq!(requests.load(Ordering::SeqCst), 0, "nothing went upstream");
        }
    }
    assert_eq!(requests.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_retry_by_policy_is_counted_once_more_by_the_global_rate_limit() {
    use crate::global_rate_limit::tests::{serve, status};
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

    let service = serve(Duration::ZERO, |req: &RateLimitRequest| RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: req.descriptors.iter().map(|_| status(Code::Ok, 60)).collect(),
        ..Default::default()
    })
    .await;
    // 503 to the first request, 200 to the retry.
    let (up, _) = heads_upstream(vec![
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
    ])
    .await;
    let yaml = format!(
        "defaults:\n  retry: {{ attempts: 1, on: [503], backoff: {{ base: 1ms, max: 1ms }} }}\n  global_rate_limit:\n    service: http://127.0.0.1:{}\n    domain: egress\n    descriptors: [[{{ key: upstream }}]]\n",
        service.port
    );
    let (me, _ctx) = crate::downstream::testing::serve_for_test(&yaml).await;
    let mut client = tokio::net::TcpStream::connect(me).await.unwrap();
    let req = format!("GET http://{up}/ HTTP/1.1\r\nhost: {up}\r\n\r\n");
    client.write_all(req.as_bytes()).await.unwrap();
    let answer = read_response(&mut client).await;
    assert!(
        answer.starts_with("HTTP/1.1 200 "),
        "the retry answered: {answer}"
    );
    let reported = crate::downstream::testing::eventually(|| service.asked().len() == 2).await;
    let asked = service.asked();
    assert!(reported, "a check, then the retry's report: {asked:?}");
    let hits: Vec<_> = asked.iter().map(|r| r.descriptors[0].hits_addend).collect();
    assert_eq!(
        hits,
        [
            None,
            Some(envoy_types::pb::google::protobuf::UInt64Value { value: 1 })
        ]
    );
}
