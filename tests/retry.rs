//! Timeouts and retries (issue 23) against a scripted origin: status retries honour
//! `Retry-After` (up to `retry_after_max`), idempotency and the retry budget; `request_timeout`
//! (and `x-egress-timeout`) answers 504 before the head, `body_idle_timeout` cuts a silent body
//! and keeps its connection out of the pool; an SSE stream passes untouched with the defaults;
//! the per-request headers are checked and never forwarded; `check` names a bad `retry.on`.

mod support;

use std::time::{Duration, Instant};

use support::{Answer, RawClient, RawResponse, ScriptedOrigin, Sidecar};

/// The sidecar with one upstream `origin` for `origin`, with `settings` (lines indented four
/// spaces) under it, and `top` (say `defaults:`) before.
async fn sidecar(origin: &ScriptedOrigin, top: &str, settings: &str) -> Sidecar {
    Sidecar::start(&format!(
        "{top}upstreams:\n  - name: origin\n    url: http://{}\n{settings}",
        origin.addr
    ))
    .await
}

/// Sends `method path` to `origin` through the sidecar on a new connection, with `headers`
/// (each line ending in CRLF) and `body`, and reads the response.
async fn send(
    sidecar: &Sidecar,
    origin: &ScriptedOrigin,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> RawResponse {
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = origin.addr;
    client
        .send_raw(
            format!(
                "{method} http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{headers}Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await;
    tokio::time::timeout(Duration::from_secs(30), client.read_response(method == "HEAD"))
        .await
        .unwrap_or_else(|_| panic!("{method} {path}: no response in 30 s"))
        .unwrap_or_else(|| panic!("{method} {path}: closed before a response"))
}

/// A metric of upstream `origin`, with `labels` besides.
async fn metric(sidecar: &Sidecar, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut all = vec![("upstream", "origin")];
    all.extend_from_slice(labels);
    support::value(&support::scrape(sidecar.admin).await, name, &all)
}

/// Waits (up to 5 s) for a metric of upstream `origin` to reach `want`, and returns its value.
async fn metric_reaches(sidecar: &Sidecar, name: &str, labels: &[(&str, &str)], want: f64) -> f64 {
    let mut all = vec![("upstream", "origin")];
    all.extend_from_slice(labels);
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(5), |m| {
        support::value(m, name, &all) >= want
    })
    .await;
    support::value(&m, name, &all)
}

#[tokio::test]
async fn a_429_with_retry_after_is_retried_after_the_wait_whatever_the_method() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/limited",
        vec![
            Answer::status(429).header("retry-after", "1").body("slow down"),
            Answer::ok("done"),
        ],
    );
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    let started = Instant::now();
    let resp = send(&sidecar, &origin, "POST", "/limited", "", "data").await;
    let took = started.elapsed();
    println!("429 with Retry-After: 1, then 200: answered after {took:?}");
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.text(), "done");
    assert!(
        took >= Duration::from_secs(1),
        "answered after {took:?}, before Retry-After: 1"
    );
    assert!(took < Duration::from_secs(10), "answered after {took:?}");
    let seen = origin.requests("/limited");
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen[1].at - seen[0].at >= Duration::from_millis(950),
        "retried {:?} after the 429",
        seen[1].at - seen[0].at
    );
    assert!(
        seen.iter().all(|r| r.method == "POST" && r.body_len == 4),
        "{seen:?}"
    );
    assert_eq!(
        metric(&sidecar, "egress_upstream_retries_total", &[("reason", "429")]).await,
        1.0
    );
}

#[tokio::test]
async fn a_get_answered_503_twice_gets_the_third_answer() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/flaky",
        vec![Answer::status(503), Answer::status(503), Answer::ok("third")],
    );
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    let resp = send(&sidecar, &origin, "GET", "/flaky", "", "").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(resp.text(), "third");
    assert_eq!(origin.requests("/flaky").len(), 3);
    assert_eq!(
        metric(&sidecar, "egress_upstream_retries_total", &[("reason", "503")]).await,
        2.0
    );
}

/// A 429 that says no quota is left until a reset, with no `Retry-After`: the retry by policy
/// waits for the key's reset (pacing), not only its backoff of at most 10 ms.
#[tokio::test]
async fn a_retry_waits_for_its_pace_keys_reset_not_only_its_backoff() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/spent",
        vec![
            Answer::status(429)
                .header("x-ratelimit-limit-requests", "5")
                .header("x-ratelimit-remaining-requests", "0")
                .header("x-ratelimit-reset-requests", "1s"),
            Answer::ok("after the reset"),
        ],
    );
    let settings = "    retry: { attempts: 1, backoff: { base: 10ms, max: 10ms } }\n";
    let sidecar = sidecar(&origin, "", settings).await;
    let resp = send(&sidecar, &origin, "GET", "/spent", "", "").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let seen = origin.requests("/spent");
    assert_eq!(seen.len(), 2, "{seen:?}");
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= Duration::from_millis(950),
        "retried {gap:?} after a 429 that said the quota resets in 1s"
    );
}

#[tokio::test]
async fn a_retry_after_over_the_maximum_passes_the_response_through_at_once() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/later",
        vec![
            Answer::status(429)
                .header("retry-after", "3600")
                .body("come back in an hour"),
            Answer::ok("too soon"),
        ],
    );
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    let started = Instant::now();
    let resp = send(&sidecar, &origin, "GET", "/later", "", "").await;
    let took = started.elapsed();
    assert_eq!(resp.status, 429, "{}", resp.text());
    assert_eq!(resp.header("retry-after"), Some("3600"));
    assert_eq!(resp.text(), "come back in an hour");
    assert!(took < Duration::from_secs(5), "the 429 took {took:?}");
    assert_eq!(origin.requests("/later").len(), 1);
    assert_eq!(metric(&sidecar, "egress_upstream_retries_total", &[]).await, 0.0);
}

/// A Retry-After that would end past the request's deadline is not waited: the answer in hand
/// goes to the app at once, where waiting would end in `504 request_timeout` at the deadline.
#[tokio::test]
async fn a_retry_after_past_the_request_deadline_is_not_waited() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/deadline",
        vec![
            Answer::status(429).header("retry-after", "5").body("in 5 s"),
            Answer::ok("past the deadline"),
        ],
    );
    let settings = "    request_timeout: 2s\n    retry: { attempts: 2, retry_after_max: 60s }\n";
    let sidecar = sidecar(&origin, "", settings).await;
    let started = Instant::now();
    let resp = send(&sidecar, &origin, "GET", "/deadline", "", "").await;
    let took = started.elapsed();
    println!(
        "429 with Retry-After: 5 under request_timeout: 2s: {} after {took:?}",
        resp.status
    );
    assert_eq!(resp.status, 429, "the 429 in hand, not a wait: {}", resp.text());
    assert_eq!(resp.text(), "in 5 s");
    assert!(
        took < Duration::from_secs(5),
        "answered after {took:?}: the Retry-After was waited"
    );
    assert_eq!(origin.requests("/deadline").len(), 1);
    assert_eq!(metric(&sidecar, "egress_upstream_retries_total", &[]).await, 0.0);
}

/// While a retry waits out its Retry-After, it holds no connection: the 429's connection is
/// back in the pool, idle (the next attempt takes it again), not active for the waiting request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_retry_holds_no_connection() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/wait",
        vec![
            Answer::status(429).header("retry-after", "4").body("wait"),
            Answer::ok("after the wait"),
        ],
    );
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    let (addr, url) = (sidecar.addr, origin.url("/wait"));
    let waiting = tokio::spawn(async move {
        let mut client = RawClient::connect(addr).await;
        client.get(&url).await
    });
    assert_eq!(origin.wait_requests(1, Duration::from_secs(5)).await.len(), 1);
    let connections = |m: &prometheus_parse::Scrape, state| {
        support::value(
            m,
            "egress_upstream_connections",
            &[("upstream", "origin"), ("state", state)],
        )
    };
    let m = support::scrape_until(sidecar.admin, Duration::from_secs(2), |m| {
        connections(m, "active") == 0.0 && connections(m, "idle") == 1.0
    })
    .await;
    let during = (connections(&m, "active"), connections(&m, "idle"));
    assert!(
        !waiting.is_finished(),
        "answered before the Retry-After: the scrape came too late"
    );
    assert_eq!(
        during,
        (0.0, 1.0),
        "(active, idle) connections while the retry waits"
    );
    assert_eq!(origin.requests("/wait").len(), 1, "still waiting");
    let resp = waiting.await.unwrap();
    assert_eq!((resp.status, resp.text()), (200, "after the wait".to_owned()));
    assert_eq!(origin.accepted(), 1, "the retry took the pooled connection again");
}

#[tokio::test]
async fn a_post_is_retried_on_503_only_with_an_idempotency_key() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/charge",
        vec![Answer::status(503), Answer::status(503), Answer::ok("charged")],
    );
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;

    let resp = send(&sidecar, &origin, "POST", "/charge", "", "data").await;
    assert_eq!(
        resp.status,
        503,
        "a POST without Idempotency-Key: {}",
        resp.text()
    );
    assert_eq!(
        origin.requests("/charge").len(),
        1,
        "a POST without a key was retried"
    );

    let resp = send(
        &sidecar,
        &origin,
        "POST",
        "/charge",
        "Idempotency-Key: k1\r\n",
        "data",
    )
    .await;
    assert_eq!(resp.status, 200, "a POST with Idempotency-Key: {}", resp.text());
    assert_eq!(resp.text(), "charged");
    let seen = origin.requests("/charge");
    assert_eq!(seen.len(), 3, "{seen:?}");
    for attempt in &seen[1..] {
        assert_eq!(attempt.header("idempotency-key"), Some("k1"));
        assert_eq!(attempt.body_len, 4, "the retried body");
    }
}

#[tokio::test]
async fn retries_stay_within_the_budget() {
    let origin = ScriptedOrigin::start().await;
    origin.script("/down", vec![Answer::status(503).body("down")]);
    let sidecar = sidecar(
        &origin,
        "",
        "    retry: { attempts: 3, backoff: { base: 1ms, max: 5ms } }\n    pool: { max_connections: 128, max_idle: 128 }\n",
    )
    .await;
    let tasks = support::spawn_gets(sidecar.addr, &origin.url("/down"), 100);
    for task in tasks {
        let resp = task.await.unwrap();
        assert_eq!(resp.status, 503, "{}", resp.text());
        assert_eq!(resp.text(), "down", "the origin's 503, not the sidecar's");
    }
    let seen = origin.recorded().len();
    println!("100 concurrent GETs to an always-503 path, attempts 3: the origin saw {seen} requests");
    // ratio 0.2 of 100 requests, plus min_per_second 10: about 130 at most.
    assert!(seen <= 130, "the origin saw {seen} requests for 100");
    assert!(seen > 100, "no retry at all ({seen} requests)");
    assert!(
        metric(&sidecar, "egress_upstream_retry_budget_exhausted_total", &[]).await > 0.0,
        "budget never exhausted"
    );
    assert_eq!(
        metric(&sidecar, "egress_upstream_retries_total", &[("reason", "503")]).await,
        (seen - 100) as f64,
        "retries counted"
    );
}

#[tokio::test]
async fn a_silent_body_is_cut_after_body_idle_timeout_and_its_connection_not_pooled() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/stall",
        vec![Answer::status(200)
            .header("content-length", "1000")
            .chunk(Duration::ZERO, &"x".repeat(100))
            .then_hang()],
    );
    let sidecar = sidecar(&origin, "", "    body_idle_timeout: 1s\n").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = origin.addr;
    client
        .send_raw(format!("GET http://{host}/stall HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let started = Instant::now();
    let (status, got) = tokio::time::timeout(Duration::from_secs(20), client.read_until_closed())
        .await
        .expect("the silent response was never cut")
        .expect("a head before the close");
    let took = started.elapsed();
    assert_eq!(status, 200);
    assert_eq!(got, 100, "the body bytes before the cut");
    assert!(took >= Duration::from_millis(900), "cut after {took:?}");
    assert!(took < Duration::from_secs(10), "cut after {took:?}");
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_timeouts_total",
            &[("kind", "body_idle")],
            1.0
        )
        .await,
        1.0
    );

    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_connections_closed_total",
            &[("reason", "body_idle_timeout")],
            1.0
        )
        .await,
        1.0
    );
    assert!(
        support::eventually(Duration::from_secs(5), || origin.open() == 0).await,
        "the cut connection is still open at the origin"
    );

    let resp = send(&sidecar, &origin, "GET", "/after", "", "").await;
    assert_eq!(resp.status, 200);
    let stalled = &origin.requests("/stall")[0];
    let after = &origin.requests("/after")[0];
    assert_ne!(
        after.conn, stalled.conn,
        "the cut connection went back to the pool"
    );
    assert_eq!(origin.accepted(), 2);
}

#[tokio::test]
async fn x_egress_timeout_answers_504_and_the_control_headers_never_reach_the_origin() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/slow",
        vec![Answer::ok("late").head_after(Duration::from_secs(5))],
    );
    let sidecar = sidecar(&origin, "", "").await;

    let started = Instant::now();
    let resp = send(&sidecar, &origin, "GET", "/slow", "x-egress-timeout: 1s\r\n", "").await;
    let took = started.elapsed();
    println!("x-egress-timeout: 1s on a head that comes after 5 s: 504 after {took:?}");
    resp.assert_sidecar_error(504, "request_timeout", "x-egress-timeout: 1s");
    assert!(
        took >= Duration::from_millis(900) && took <= Duration::from_secs(3),
        "504 after {took:?}"
    );
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_timeouts_total",
            &[("kind", "request")],
            1.0
        )
        .await,
        1.0
    );

    let resp = send(
        &sidecar,
        &origin,
        "GET",
        "/fast",
        "x-egress-timeout: 30s\r\nx-egress-retry: on\r\n",
        "",
    )
    .await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    let seen = origin.recorded();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for r in &seen {
        for header in ["x-egress-timeout", "x-egress-retry"] {
            assert_eq!(r.header(header), None, "{header} forwarded on {}", r.path);
        }
    }
}

#[tokio::test]
async fn response_header_timeout_is_counted_as_its_kind() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/slow",
        vec![Answer::ok("late").head_after(Duration::from_secs(2))],
    );
    let sidecar = sidecar(&origin, "", "    response_header_timeout: 200ms\n").await;
    let resp = send(&sidecar, &origin, "GET", "/slow", "", "").await;
    assert_eq!(resp.status, 504, "{}", resp.text());
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_timeouts_total",
            &[("kind", "response_header")],
            1.0
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&sidecar, "egress_upstream_timeouts_total", &[("kind", "request")]).await,
        0.0
    );
}

#[tokio::test]
async fn bad_control_headers_are_400_naming_the_header() {
    let origin = ScriptedOrigin::start().await;
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    for (header, value) in [("x-egress-timeout", "soon"), ("x-egress-retry", "maybe")] {
        let resp = send(
            &sidecar,
            &origin,
            "GET",
            "/",
            &format!("{header}: {value}\r\n"),
            "",
        )
        .await;
        let body = resp.assert_sidecar_error(400, "bad_request", header);
        assert!(body.contains(header), "{header}: {value}: {body:?}");
    }
    assert_eq!(origin.recorded().len(), 0, "a bad request was forwarded");
}

#[tokio::test]
async fn x_egress_retry_off_sends_a_retryable_request_once() {
    let origin = ScriptedOrigin::start().await;
    origin.script("/flaky", vec![Answer::status(503), Answer::ok("second")]);
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    let resp = send(&sidecar, &origin, "GET", "/flaky", "x-egress-retry: off\r\n", "").await;
    assert_eq!(resp.status, 503, "{}", resp.text());
    assert_eq!(origin.requests("/flaky").len(), 1);
}

#[tokio::test]
async fn a_body_over_buffer_body_up_to_is_not_retried_once_sent() {
    let origin = ScriptedOrigin::start().await;
    let script = vec![Answer::status(503), Answer::ok("second")];
    origin.script("/big", script.clone());
    origin.script("/small", script);
    let sidecar = sidecar(
        &origin,
        "",
        "    retry: { attempts: 2, buffer_body_up_to: 1KiB }\n",
    )
    .await;
    let key = "Idempotency-Key: k2\r\n";
    let resp = send(&sidecar, &origin, "POST", "/big", key, &"b".repeat(2000)).await;
    assert_eq!(resp.status, 503, "a 2000-byte body over 1KiB: {}", resp.text());
    assert_eq!(origin.requests("/big").len(), 1);
    let resp = send(&sidecar, &origin, "POST", "/small", key, &"s".repeat(500)).await;
    assert_eq!(resp.status, 200, "a 500-byte body under 1KiB: {}", resp.text());
    let seen = origin.requests("/small");
    assert_eq!(seen.iter().map(|r| r.body_len).collect::<Vec<_>>(), [500, 500]);
}

#[tokio::test]
async fn request_timeout_is_504_before_the_head_and_cuts_the_stream_after_it() {
    let origin = ScriptedOrigin::start().await;
    origin.script(
        "/slow",
        vec![Answer::ok("late").head_after(Duration::from_millis(2500))],
    );
    let ticks = (0..10).fold(Answer::status(200), |a, i| {
        a.chunk(
            Duration::from_millis(if i == 0 { 0 } else { 500 }),
            &format!("data: tick {i}\n\n"),
        )
    });
    origin.script("/ticks", vec![ticks]);
    let sidecar = sidecar(&origin, "", "    request_timeout: 1500ms\n").await;

    let started = Instant::now();
    let resp = send(&sidecar, &origin, "GET", "/slow", "", "").await;
    let took = started.elapsed();
    resp.assert_sidecar_error(504, "request_timeout", "request_timeout: 1500ms");
    assert!(
        took >= Duration::from_millis(1400) && took <= Duration::from_secs(4),
        "504 after {took:?}"
    );

    // x-egress-timeout: 0s turns it off for this request.
    let resp = send(&sidecar, &origin, "GET", "/slow", "x-egress-timeout: 0s\r\n", "").await;
    assert_eq!(resp.status, 200, "x-egress-timeout: 0s: {}", resp.text());

    // After the head: a 5 s stream is cut at 1.5 s, without its last chunk.
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = origin.addr;
    client
        .send_raw(format!("GET http://{host}/ticks HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let (status, _) = client.read_head().await;
    assert_eq!(status, 200);
    let (ticks, complete) = read_events(&mut client).await;
    assert!(!complete, "the stream outlived request_timeout");
    assert!(
        (1..10).contains(&ticks.len()),
        "{} ticks before the cut",
        ticks.len()
    );
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_timeouts_total",
            &[("kind", "request")],
            2.0
        )
        .await,
        2.0
    );
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_connections_closed_total",
            &[("reason", "request_timeout")],
            1.0
        )
        .await,
        1.0,
        "the cut stream's connection"
    );
}

#[tokio::test]
async fn a_reset_before_the_head_is_retried_for_idempotent_requests_only() {
    let origin = ScriptedOrigin::start().await;
    origin.script("/get", vec![Answer::reset(), Answer::ok("again")]);
    origin.script("/post", vec![Answer::reset(), Answer::ok("again")]);
    let sidecar = sidecar(&origin, "", "    retry: { attempts: 2 }\n").await;
    let resp = send(&sidecar, &origin, "GET", "/get", "", "").await;
    assert_eq!(resp.status, 200, "{}", resp.text());
    assert_eq!(origin.requests("/get").len(), 2);
    assert_eq!(
        metric(&sidecar, "egress_upstream_retries_total", &[("reason", "reset")]).await,
        1.0
    );
    let resp = send(&sidecar, &origin, "POST", "/post", "", "data").await;
    resp.assert_sidecar_error(502, "upstream_reset", "a POST reset before the head");
    assert_eq!(
        origin.requests("/post").len(),
        1,
        "a POST that may have run went again"
    );
}

#[tokio::test]
async fn a_connect_failure_is_retried_for_any_method_body_or_not() {
    // Bound, not listening, for the whole test: refused, and no other process can take it.
    let refusing = support::RefusingPort::new();
    let port = refusing.port();
    let sidecar = Sidecar::start(&format!(
        "upstreams:\n  - name: origin\n    url: http://127.0.0.1:{port}\n    retry: {{ attempts: 2, backoff: {{ base: 1ms, max: 5ms }} }}\n"
    ))
    .await;
    let connect_retries = || {
        metric(
            &sidecar,
            "egress_upstream_retries_total",
            &[("reason", "connect_failure")],
        )
    };
    for (method, body, want) in [("GET", "", 2.0), ("POST", "data", 4.0)] {
        let mut client = RawClient::connect(sidecar.addr).await;
        client
            .send_raw(
                format!(
                    "{method} http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                )
                .as_bytes(),
            )
            .await;
        let resp = client.read_response(false).await.expect("a response");
        assert_eq!(resp.status, 502, "{method}: {}", resp.text());
        assert_eq!(
            connect_retries().await,
            want,
            "{method} with a {}-byte body: nothing was sent, so it goes again",
            body.len()
        );
    }
}

#[tokio::test]
async fn a_request_body_silent_past_body_idle_timeout_is_cut() {
    let origin = ScriptedOrigin::start().await;
    let sidecar = sidecar(&origin, "", "    body_idle_timeout: 1s\n").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = origin.addr;
    let head = format!("POST http://{host}/upload HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000\r\n\r\n");
    client
        .send_raw(format!("{head}{}", "u".repeat(100)).as_bytes())
        .await;
    // The upload then goes silent: the exchange must end (an answer or a close) soon after 1 s.
    let started = Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(5), client.read_response(false))
        .await
        .expect("a silent upload held its exchange for 5 s");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900), "ended after {took:?}");
    ended.expect("a response, not a bare close").assert_sidecar_error(
        400,
        "bad_request",
        "a silent request body",
    );
    assert!(
        support::eventually(Duration::from_secs(5), || origin.open() == 0).await,
        "the upstream connection of the cut upload is still open"
    );
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_timeouts_total",
            &[("kind", "body_idle")],
            1.0
        )
        .await,
        1.0
    );
}

/// Events of an SSE response read off `client` after its head, each with its arrival time,
/// until the stream ends (true: with its last chunk) or is cut (false).
async fn read_events(client: &mut RawClient) -> (Vec<(String, Instant)>, bool) {
    let mut events = Vec::new();
    let mut pending = String::new();
    loop {
        let chunk = tokio::time::timeout(Duration::from_secs(10), client.read_chunk())
            .await
            .expect("nothing for 10 s");
        let Some(chunk) = chunk else {
            return (events, false);
        };
        if chunk.is_empty() {
            return (events, true);
        }
        pending.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = pending.find("\n\n") {
            events.push((pending[..end].to_owned(), Instant::now()));
            pending.drain(..end + 2);
        }
    }
}

/// `n` events, the first at once and then one per `gap`.
fn sse_events(answer: Answer, range: std::ops::Range<usize>, gap: Duration) -> Answer {
    range.fold(answer, |a, i| {
        a.chunk(
            if i == 0 { Duration::ZERO } else { gap },
            &format!("data: event {i}\n\n"),
        )
    })
}

#[tokio::test]
async fn an_sse_stream_passes_untouched_with_the_defaults() {
    let origin = ScriptedOrigin::start().await;
    let sse = Answer::status(200).header("content-type", "text/event-stream");
    origin.script("/sse", vec![sse_events(sse, 0..10, Duration::from_secs(1))]);
    let sidecar = sidecar(&origin, "", "").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = origin.addr;
    client
        .send_raw(format!("GET http://{host}/sse HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let (status, headers) = client.read_head().await;
    let head_at = Instant::now();
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "text/event-stream");
    let (events, complete) = read_events(&mut client).await;
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    let want: Vec<String> = (0..10).map(|i| format!("data: event {i}")).collect();
    assert_eq!(names, want);
    assert!(complete, "the stream was cut");
    let first = events[0].1 - head_at;
    assert!(
        first <= Duration::from_millis(500),
        "the first event came {first:?} after the head"
    );
    let spread = events[9].1 - events[0].1;
    println!(
        "SSE, defaults: 10 events, the first {first:?} after the head, spread over {spread:?}, complete"
    );
    assert!(
        spread >= Duration::from_millis(8500) && spread <= Duration::from_secs(15),
        "events spread over {spread:?}"
    );
    for pair in events.windows(2) {
        let gap = pair[1].1 - pair[0].1;
        assert!(
            gap >= Duration::from_millis(300),
            "{:?} came {gap:?} after the one before: held back",
            pair[1].0
        );
    }
}

#[tokio::test]
async fn an_sse_stream_silent_past_body_idle_timeout_is_cut_after_its_events() {
    let origin = ScriptedOrigin::start().await;
    let sse = Answer::status(200).header("content-type", "text/event-stream");
    let sse = sse_events(sse, 0..3, Duration::from_millis(300));
    let sse = sse
        .chunk(Duration::from_secs(3), "data: event 3\n\n")
        .chunk(Duration::from_millis(100), "data: event 4\n\n");
    origin.script("/sse", vec![sse]);
    let sidecar = sidecar(&origin, "defaults: { body_idle_timeout: 2s }\n", "").await;
    let mut client = RawClient::connect(sidecar.addr).await;
    let host = origin.addr;
    client
        .send_raw(format!("GET http://{host}/sse HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await;
    let (status, _) = client.read_head().await;
    assert_eq!(status, 200);
    let (events, complete) = read_events(&mut client).await;
    let cut_at = Instant::now();
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(names, ["data: event 0", "data: event 1", "data: event 2"]);
    assert!(
        !complete,
        "the stream ended with its last chunk instead of being cut"
    );
    let silence = cut_at - events[2].1;
    println!("SSE, body_idle_timeout 2s, a 3 s gap: cut {silence:?} after event 2");
    assert!(
        silence >= Duration::from_millis(1800),
        "cut {silence:?} after the last event"
    );
    assert_eq!(
        metric_reaches(
            &sidecar,
            "egress_upstream_timeouts_total",
            &[("kind", "body_idle")],
            1.0
        )
        .await,
        1.0
    );
}

#[test]
fn check_names_a_bad_retry_on() {
    let (code, _, stderr) = support::check_config("defaults:\n  retry: { on: [teapot] }\n");
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("config: defaults.retry.on") && l.contains("teapot")),
        "no line naming defaults.retry.on:\n{stderr}"
    );
}
