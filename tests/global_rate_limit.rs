//! One quota for the whole fleet (issue 45), end to end: sidecars (the real binary, child
//! processes) calling Envoy's rate-limit service, the real `envoyproxy/ratelimit` counting in
//! a real Redis (tests/support/ratelimit.rs), in front of scripted origins. The service allows
//! 30 requests a minute to upstream `partner` and 1,000 tokens a minute to upstream `llm`. The
//! five things the issue says the tests must show, one test each, and a sixth:
//! 1. three sidecars, three apps, 30 requests each: the origin sees exactly 30, the others are
//!    refused with `429 rate_limited`, and the sidecars' call counts add up to Redis' counter;
//! 2. tokens reported after each answer: past 1,000, the next call on any sidecar is refused;
//! 3. the service killed mid-run: `allow` sends every request without waiting on it, `deny`
//!    answers 503, and the restarted service enforces the limit again within 2 s;
//! 4. a storm of 5,000 requests over the limit costs the service at most one call;
//! 5. a service slower than `timeout` (a proxy adding 100 ms) is not waited for;
//! 6. (beyond the issue's list) descriptors made of the app, a header and a literal reach the
//!    service as the keys it counts per value.
//!
//! Plus a check of the harness itself: the service, configured so, counts every call in Redis
//! and checks without counting when a descriptor's `hits_addend` is 0 (what test 2 relies on);
//! restarted, it goes on from Redis' counts; the slow proxy delays both ways.
//!
//! The service counts in fixed calendar minutes (a window resets on the minute): a test that
//! counts needs its run inside one window, so it waits for the next minute when fewer than
//! its time + 5 s are left of this one (`fresh_window`, by the system clock, which the service
//! reads too). Each test starts its own Redis and service, so they run in parallel.
//! Run with `--nocapture` to see the measured numbers.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use support::ratelimit::{
    fresh_window, http_exchange, ratelimit_or_skip, RateLimitService, Redis, Resp, SlowProxy,
};
use support::{ChildSidecar, RawClient, RawResponse, ScriptedOrigin};

/// The service's limits, per minute.
const PARTNER_LIMIT: usize = 30;
const TOKEN_LIMIT: u64 = 1000;
/// Test 3's upstream that denies when the service is away, and its small limit.
const STRICT_LIMIT: usize = 5;
/// What the scripted LLM answer reports: 200 in, 100 out.
const TOKENS_PER_CALL: u64 = 300;

/// The service's config: one domain, a limit per upstream (test 3's `open` never reaches its
/// own), the token limit on `llm`'s `unit: tokens` descriptor, and for upstream `shapes` one
/// per app (2), per `x-tenant` value and per literal `generic_key` (test 6).
fn service_config() -> String {
    format!(
        "\
domain: egress
descriptors:
  - key: upstream
    value: partner
    rate_limit: {{ unit: minute, requests_per_unit: {PARTNER_LIMIT} }}
  - key: upstream
    value: llm
    descriptors:
      - key: unit
        value: tokens
        rate_limit: {{ unit: minute, requests_per_unit: {TOKEN_LIMIT} }}
  - key: upstream
    value: open
    rate_limit: {{ unit: minute, requests_per_unit: 100000 }}
  - key: upstream
    value: strict
    rate_limit: {{ unit: minute, requests_per_unit: {STRICT_LIMIT} }}
  - key: upstream
    value: shapes
    descriptors:
      - key: app
        rate_limit: {{ unit: minute, requests_per_unit: 2 }}
      - key: x-tenant
        rate_limit: {{ unit: minute, requests_per_unit: 100 }}
  - key: generic_key
    value: openai-org
    rate_limit: {{ unit: minute, requests_per_unit: 100 }}
"
    )
}

const PATH: &str = "/quota";
const CHAT: &str = "/v1/chat/completions";
const PARTNER: &[(&str, &str)] = &[("upstream", "partner")];
const LLM_TOKENS: &[(&str, &str)] = &[("upstream", "llm"), ("unit", "tokens")];
const STRICT: &[(&str, &str)] = &[("upstream", "strict")];
const ORG: &[(&str, &str)] = &[("generic_key", "openai-org")];

// === the fleet ===

/// Redis and the service counting in it, started with [`service_config`].
struct Quota {
    redis: Redis,
    service: RateLimitService,
}

impl Quota {
    /// `None` (the test skipped) without redis-server or a way to build the service.
    async fn start() -> Option<Self> {
        let bin = ratelimit_or_skip().await?;
        let redis = Redis::start().await;
        let service = RateLimitService::start(&bin, &redis, &service_config()).await;
        Some(Quota { redis, service })
    }
}

/// A `global_rate_limit` section calling `service` in domain `egress` with `descriptors` (YAML
/// flow style) and `rest` (`, key: value` pairs).
fn quota_section(service: &str, descriptors: &str, rest: &str) -> String {
    format!("{{ service: {service}, domain: egress, descriptors: {descriptors}{rest} }}")
}

/// The sections of the counting tests (1, 2, 4): a 1 s timeout, so a call slowed down by a busy
/// machine is still answered, and `deny`, so one that is not shows as a 503 instead of
/// slipping a request past the count.
fn counting_section(service: &RateLimitService, descriptors: &str) -> String {
    quota_section(&service.url(), descriptors, ", timeout: 1s, failure_mode: deny")
}

/// One upstream of a sidecar's config: `name` for `origin`, no retries, and `extra` lines
/// (each indented four spaces, ending in a newline).
fn upstream(name: &str, origin: &ScriptedOrigin, extra: &str) -> String {
    format!(
        "  - name: {name}\n    url: http://{}\n    retry: {{ attempts: 0 }}\n{extra}",
        origin.addr
    )
}

fn sidecar_yaml(upstreams: &[String]) -> String {
    format!("upstreams:\n{}", upstreams.concat())
}

/// `n` sidecars with the same config, started side by side.
async fn sidecars(yaml: &str, n: usize) -> Vec<ChildSidecar> {
    let mut started = Vec::new();
    let mut spawning = Vec::new();
    for _ in 0..n {
        let yaml = yaml.to_owned();
        spawning.push(tokio::spawn(async move { ChildSidecar::spawn(&yaml).await }));
    }
    for s in spawning {
        started.push(s.await.unwrap());
    }
    started
}

// === requests ===

/// A keep-alive connection to a sidecar's proxy listener, opened again when the sidecar
/// closed the last one.
struct Conn {
    sidecar: SocketAddr,
    client: Option<RawClient>,
}

impl Conn {
    fn new(sidecar: SocketAddr) -> Self {
        Conn {
            sidecar,
            client: None,
        }
    }

    /// A GET of `url` with `extra` header lines; its response and how long it took.
    async fn get(&mut self, url: &str, extra: &str) -> (RawResponse, Duration) {
        let host = url.split('/').nth(2).unwrap_or("");
        self.send(format!("GET {url} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n"))
            .await
    }

    /// A POST of a JSON `body` to `url` with `extra` header lines.
    async fn post_json(&mut self, url: &str, extra: &str, body: &str) -> (RawResponse, Duration) {
        let host = url.split('/').nth(2).unwrap_or("");
        self.send(format!(
            "POST {url} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n{extra}\r\n{body}",
            body.len()
        ))
        .await
    }

    async fn send(&mut self, request: String) -> (RawResponse, Duration) {
        if self.client.is_none() {
            self.client = Some(RawClient::connect(self.sidecar).await);
        }
        let client = self.client.as_mut().unwrap();
        let started = Instant::now();
        client.send_raw(request.as_bytes()).await;
        let resp = tokio::time::timeout(Duration::from_secs(20), client.read_response(false))
            .await
            .unwrap_or_else(|_| panic!("no response in 20 s to {request:?}"))
            .unwrap_or_else(|| panic!("closed before a response to {request:?}"));
        let took = started.elapsed();
        if resp
            .header("connection")
            .is_some_and(|v| v.eq_ignore_ascii_case("close"))
        {
            self.client = None;
        }
        (resp, took)
    }
}

/// Asserts a sidecar's `429 rate_limited` with a `Retry-After` of 1 to 60 s (a minute
/// window's reset, rounded up); returns it.
fn assert_rate_limited(resp: &RawResponse, what: &str) -> u64 {
    resp.assert_sidecar_error(429, "rate_limited", what);
    let after: u64 = resp
        .header("retry-after")
        .unwrap_or_else(|| panic!("{what}: no Retry-After"))
        .parse()
        .unwrap_or_else(|e| panic!("{what}: Retry-After {:?}: {e}", resp.header("retry-after")));
    assert!((1..=60).contains(&after), "{what}: Retry-After {after}");
    after
}

// === the sidecar's counts ===

/// `egress_global_rate_limit_calls_total` of `upstream` by result, and its
/// `egress_global_rate_limit_seconds` histogram's count and count at most 102.4 ms (a bucket's
/// bound: 0.1 ms doubled 10 times).
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Calls {
    ok: u64,
    over_limit: u64,
    error: u64,
    timeout: u64,
    cached: u64,
    timed: u64,
    timed_within_102ms: u64,
}

impl Calls {
    async fn of(sidecar: &ChildSidecar, upstream: &str) -> Self {
        let m = support::scrape(sidecar.admin).await;
        let result = |r: &str| {
            let v = support::value(
                &m,
                "egress_global_rate_limit_calls_total",
                &[("upstream", upstream), ("result", r)],
            );
            assert!(v >= 0.0 && v.fract() == 0.0, "calls {upstream} {r}: {v}");
            v as u64
        };
        let seconds = "egress_global_rate_limit_seconds";
        let timed = support::value(&m, &format!("{seconds}_count"), &[("upstream", upstream)]);
        let within: f64 = m
            .samples
            .iter()
            .filter(|s| s.metric == seconds && s.labels.get("upstream") == Some(upstream))
            .flat_map(|s| match &s.value {
                prometheus_parse::Value::Histogram(buckets) => buckets.clone(),
                _ => panic!("{seconds} is not a histogram"),
            })
            .filter(|b| (b.less_than - 0.1024).abs() < 1e-9)
            .map(|b| b.count)
            .sum();
        Calls {
            ok: result("ok"),
            over_limit: result("over_limit"),
            error: result("error"),
            timeout: result("timeout"),
            cached: result("cached"),
            timed: timed as u64,
            timed_within_102ms: within as u64,
        }
    }

    /// Summed over `sidecars`.
    async fn sum(sidecars: &[ChildSidecar], upstream: &str) -> Self {
        let mut sum = Calls::default();
        for s in sidecars {
            let c = Calls::of(s, upstream).await;
            sum.ok += c.ok;
            sum.over_limit += c.over_limit;
            sum.error += c.error;
            sum.timeout += c.timeout;
            sum.cached += c.cached;
            sum.timed += c.timed;
            sum.timed_within_102ms += c.timed_within_102ms;
        }
        sum
    }

    /// Calls the service answered (each counted one hit in Redis).
    fn answered(&self) -> u64 {
        self.ok + self.over_limit
    }

    /// Calls made, answered or not (a cached answer makes none).
    fn made(&self) -> u64 {
        self.ok + self.over_limit + self.error + self.timeout
    }
}

// === latency ===

/// The `q` quantile (0..=1) of `values`, in ms.
fn quantile_ms(values: &[Duration], q: f64) -> f64 {
    let mut ms: Vec<f64> = values.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    ms[((ms.len() - 1) as f64 * q).round() as usize]
}

/// Requests alternating between `plain` (no quota: the baseline) and `quota` through one
/// sidecar, `n` of each on one connection each: the times of each. Every one must be
/// answered 200 by its origin.
async fn alternate(
    sidecar: SocketAddr,
    plain: &str,
    quota: &str,
    n: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut a, mut b) = (Conn::new(sidecar), Conn::new(sidecar));
    let (mut base, mut with) = (Vec::new(), Vec::new());
    for i in 0..n {
        let (resp, took) = a.get(plain, "").await;
        assert_eq!(resp.status, 200, "baseline request {i}: {}", resp.text());
        base.push(took);
        let (resp, took) = b.get(quota, "").await;
        assert_eq!(resp.status, 200, "request {i} with the quota: {}", resp.text());
        with.push(took);
    }
    (base, with)
}

/// Prints and returns the median added time (ms) of `with` over the baseline `base`.
fn report_added(what: &str, base: &[Duration], with: &[Duration]) -> f64 {
    let base_p50 = quantile_ms(base, 0.5);
    let added = |q| quantile_ms(with, q) - base_p50;
    println!(
        "{what}: baseline p50 {base_p50:.2} ms; added p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} requests)",
        added(0.5),
        added(0.99),
        added(1.0),
        with.len()
    );
    added(0.5)
}

// === the harness ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_counts_every_call_in_redis_and_checks_without_counting() {
    let Some(quota) = Quota::start().await else {
        return;
    };
    let window = fresh_window(Duration::from_secs(10)).await;
    let partner = json!([{ "entries": [{ "key": "upstream", "value": "partner" }] }]);
    for i in 1..=PARTNER_LIMIT {
        let answer = quota.service.should_rate_limit_json(partner.clone()).await;
        assert_eq!(answer["overallCode"], "OK", "call {i}: {answer}");
        // (protojson leaves a 0 out)
        let remaining = answer["statuses"][0]["limitRemaining"].as_u64().unwrap_or(0);
        assert_eq!(remaining, (PARTNER_LIMIT - i) as u64, "call {i}: {answer}");
    }
    let answer = quota.service.should_rate_limit_json(partner).await;
    assert_eq!(answer["overallCode"], "OVER_LIMIT", "call 31: {answer}");
    let reset: u64 = answer["statuses"][0]["durationUntilReset"]
        .as_str()
        .and_then(|s| s.strip_suffix('s'))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("durationUntilReset in {answer}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // (the clock may tick a second between its reading and ours)
    assert!(
        reset.abs_diff(window + 60 - now) <= 1,
        "the reset is the window's end ({}): {answer}",
        window + 60
    );
    let headers = answer["responseHeadersToAdd"].to_string();
    assert!(headers.contains("RateLimit-Limit"), "{answer}");
    assert_eq!(
        quota.redis.counter(PARTNER).await,
        31,
        "every call counted, the refused one too"
    );

    // Tokens: 300 reported three times, then a check (hits_addend 0) counts nothing.
    let tokens = |n: u64| json!([{ "entries": [{ "key": "upstream", "value": "llm" }, { "key": "unit", "value": "tokens" }], "hitsAddend": n }]);
    for _ in 0..3 {
        let answer = quota
            .service
            .should_rate_limit_json(tokens(TOKENS_PER_CALL))
            .await;
        assert_eq!(answer["overallCode"], "OK", "{answer}");
    }
    let answer = quota.service.should_rate_limit_json(tokens(0)).await;
    assert_eq!(answer["overallCode"], "OK", "a check at 900: {answer}");
    assert_eq!(quota.redis.counter(LLM_TOKENS).await, 900);
    let answer = quota
        .service
        .should_rate_limit_json(tokens(TOKENS_PER_CALL))
        .await;
    assert_eq!(answer["overallCode"], "OVER_LIMIT", "1,200 > 1,000: {answer}");
    let answer = quota.service.should_rate_limit_json(tokens(0)).await;
    assert_eq!(answer["overallCode"], "OVER_LIMIT", "a check at 1,200: {answer}");
    assert_eq!(quota.redis.counter(LLM_TOKENS).await, 1200);

    // Killed and started again on the same port, it goes on from Redis' counts (test 3).
    let mut quota = quota;
    let grpc = quota.service.grpc;
    quota.service.kill().await;
    assert!(tokio::net::TcpStream::connect(grpc).await.is_err(), "killed");
    quota.service.restart().await;
    assert_eq!(quota.service.grpc, grpc);
    let answer = quota.service.should_rate_limit_json(tokens(0)).await;
    assert_eq!(answer["overallCode"], "OVER_LIMIT", "after the restart: {answer}");

    // The slow proxy of test 5 holds each way's bytes 100 ms: an exchange takes 200 ms or more.
    let slow = SlowProxy::start(quota.service.http, Duration::from_millis(100)).await;
    let started = Instant::now();
    let answer = http_exchange(
        slow.addr,
        "GET /healthcheck HTTP/1.1\r\nHost: ratelimit\r\nConnection: close\r\n\r\n",
    )
    .await;
    let took = started.elapsed();
    assert_eq!(answer.map(|(status, _)| status), Some(200));
    assert!(
        took >= Duration::from_millis(200),
        "through the slow proxy in {took:?}"
    );
}

// === 1: three sidecars share one limit ===

/// Needs ~15 s inside one window (three sidecars' 90 requests, their scrapes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sidecars_send_exactly_the_fleets_30_requests_a_minute() {
    let Some(quota) = Quota::start().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    let section = counting_section(&quota.service, "[[{ key: upstream }]]");
    let yaml = sidecar_yaml(&[upstream(
        "partner",
        &origin,
        &format!("    global_rate_limit: {section}\n"),
    )]);
    let fleet = sidecars(&yaml, 3).await;
    fresh_window(Duration::from_secs(15)).await;

    // Three apps, one per sidecar, 30 requests each, all at once.
    let url = origin.url(PATH);
    let mut apps = Vec::new();
    for (i, sidecar) in fleet.iter().enumerate() {
        let (addr, url) = (sidecar.addr, url.clone());
        apps.push(tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            let mut got = Vec::new();
            for _ in 0..PARTNER_LIMIT {
                got.push(conn.get(&url, &format!("x-egress-app: app-{i}\r\n")).await.0);
            }
            got
        }));
    }
    let mut answered = Vec::new();
    for app in apps {
        answered.push(app.await.unwrap());
    }

    assert_eq!(
        origin.requests(PATH).len(),
        PARTNER_LIMIT,
        "the origin saw the fleet's limit"
    );
    let mut sent = [0u64; 3];
    let mut refused = 0;
    for (i, responses) in answered.iter().enumerate() {
        for (n, resp) in responses.iter().enumerate() {
            if resp.status == 200 {
                sent[i] += 1;
            } else {
                assert_rate_limited(resp, &format!("app-{i} request {n}"));
                refused += 1;
            }
        }
    }
    println!("sent per sidecar {sent:?}, refused {refused}");
    assert_eq!(sent.iter().sum::<u64>(), PARTNER_LIMIT as u64);
    assert_eq!(refused, 2 * PARTNER_LIMIT);

    // Each sidecar's counts: its sent requests are its OK calls, every request one result.
    for (i, sidecar) in fleet.iter().enumerate() {
        let calls = Calls::of(sidecar, "partner").await;
        println!("sidecar {i}: {calls:?}");
        assert_eq!(calls.ok, sent[i], "sidecar {i}: {calls:?}");
        assert_eq!(
            calls.answered() + calls.cached,
            PARTNER_LIMIT as u64,
            "sidecar {i}: one result per request: {calls:?}"
        );
        assert_eq!((calls.error, calls.timeout), (0, 0), "sidecar {i}: {calls:?}");
        assert_eq!(
            calls.timed,
            calls.made(),
            "sidecar {i}: each call timed: {calls:?}"
        );
    }
    // ... and the service's: every call it answered is one hit in its Redis counter.
    let total = Calls::sum(&fleet, "partner").await;
    let counter = quota.redis.counter(PARTNER).await;
    println!("fleet: {total:?}; the service's counter: {counter}");
    assert_eq!(total.ok, PARTNER_LIMIT as u64);
    assert_eq!(
        total.answered(),
        counter,
        "the sidecars' calls are the service's count"
    );
}

// === 2: tokens ===

/// A chat completion's answer with OpenAI's `usage`: 200 prompt and 100 completion tokens.
fn chat_answer() -> support::Answer {
    let body = json!({
        "id": "chatcmpl-quota",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "gpt-4o-2024-08-06",
        "choices": [{ "index": 0, "message": { "role": "assistant", "content": "ok" }, "finish_reason": "stop" }],
        "usage": { "prompt_tokens": 200, "completion_tokens": 100, "total_tokens": TOKENS_PER_CALL },
    });
    support::Answer::ok(&body.to_string()).header("content-type", "application/json")
}

const CHAT_REQUEST: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;

/// Needs ~25 s inside one window (four calls, each waited for in Redis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_past_the_quota_hold_the_next_call_on_every_sidecar() {
    let Some(quota) = Quota::start().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    origin.script(CHAT, vec![chat_answer()]);
    let section = quota_section(
        &quota.service.url(),
        "[[{ key: upstream }, { key: unit, value: tokens }]]",
        ", tokens: true, timeout: 1s, failure_mode: deny, max_wait: 0s",
    );
    let yaml = sidecar_yaml(&[upstream(
        "llm",
        &origin,
        &format!("    llm: {{ usage: openai }}\n    global_rate_limit: {section}\n"),
    )]);
    let fleet = sidecars(&yaml, 3).await;
    fresh_window(Duration::from_secs(25)).await;

    let url = origin.url(CHAT);
    let mut conns: Vec<Conn> = fleet.iter().map(|s| Conn::new(s.addr)).collect();
    // Calls 1 to 4, one after another across the sidecars: each goes (the counter is at most
    // 900 before it), and its 300 tokens reach the service before the next.
    for call in 1..=4u64 {
        let conn = &mut conns[(call as usize - 1) % 3];
        let (resp, _) = conn.post_json(&url, "x-egress-app: chat\r\n", CHAT_REQUEST).await;
        assert_eq!(resp.status, 200, "call {call}: {}", resp.text());
        let want = call * TOKENS_PER_CALL;
        let counter = quota
            .redis
            .counter_reaches(LLM_TOKENS, want, Duration::from_secs(5))
            .await;
        assert_eq!(counter, want, "the service's token counter after call {call}");
    }
    println!("tokens counted by the service: {}", 4 * TOKENS_PER_CALL);
    // The scenario's arithmetic: three calls fit, the fourth passes the limit.
    const { assert!(3 * TOKENS_PER_CALL <= TOKEN_LIMIT && 4 * TOKENS_PER_CALL > TOKEN_LIMIT) };

    // 1,200 > 1,000: the next call is refused on every sidecar, and never sent.
    for (i, conn) in conns.iter_mut().enumerate() {
        let (resp, _) = conn.post_json(&url, "x-egress-app: chat\r\n", CHAT_REQUEST).await;
        assert_rate_limited(&resp, &format!("sidecar {i} after the quota"));
    }
    assert_eq!(
        origin.requests(CHAT).len(),
        4,
        "the origin saw the four calls only"
    );
    assert_eq!(
        quota.redis.counter(LLM_TOKENS).await,
        4 * TOKENS_PER_CALL,
        "checks count no tokens"
    );
    let calls = Calls::sum(&fleet, "llm").await;
    println!("fleet: {calls:?}");
    assert_eq!((calls.error, calls.timeout), (0, 0), "{calls:?}");
}

// === 3: the service killed, and back ===

/// One sidecar with three upstreams, each to its own origin: `open` (`allow`, the issue's
/// 50 ms timeout), `strict` (`deny`, 5 a minute, the timeout given) and `plain` (no quota: the
/// latency baseline).
struct Outage {
    sidecar: ChildSidecar,
    open: ScriptedOrigin,
    strict: ScriptedOrigin,
    plain: ScriptedOrigin,
}

impl Outage {
    async fn start(service: &str, strict_timeout: &str) -> Self {
        let (open, strict, plain) = (
            ScriptedOrigin::start().await,
            ScriptedOrigin::start().await,
            ScriptedOrigin::start().await,
        );
        let section = |timeout: &str, mode: &str| {
            format!(
                "    global_rate_limit: {}\n",
                quota_section(
                    service,
                    "[[{ key: upstream }]]",
                    &format!(", timeout: {timeout}, failure_mode: {mode}")
                )
            )
        };
        let yaml = sidecar_yaml(&[
            upstream("open", &open, &section("50ms", "allow")),
            upstream("strict", &strict, &section(strict_timeout, "deny")),
            upstream("plain", &plain, ""),
        ]);
        let sidecar = ChildSidecar::spawn(&yaml).await;
        Outage {
            sidecar,
            open,
            strict,
            plain,
        }
    }
}

/// Needs ~20 s inside one window (strict's counter spans the outage).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_service_is_not_waited_for_and_is_used_again_once_back() {
    let Some(mut quota) = Quota::start().await else {
        return;
    };
    // strict's timeout 1 s: its 503s come from the service being away, never from a busy
    // machine slowing a call past 50 ms while the service is up.
    let fleet = Outage::start(&quota.service.url(), "1s").await;
    let pid = fleet.sidecar.child.id();
    let addr = fleet.sidecar.addr;
    let (open_url, strict_url, plain_url) = (
        fleet.open.url(PATH),
        fleet.strict.url(PATH),
        fleet.plain.url(PATH),
    );
    fresh_window(Duration::from_secs(20)).await;

    // The service up: the latency the quota adds on loopback (the connection to the service
    // made meanwhile), then 3 of strict's 5.
    let (base, with) = alternate(addr, &plain_url, &open_url, 100).await;
    report_added("the service up (added by one call)", &base, &with);
    let mut strict = Conn::new(addr);
    for i in 0..3 {
        let (resp, _) = strict.get(&strict_url, "").await;
        assert_eq!(
            resp.status,
            200,
            "strict request {i} with the service up: {}",
            resp.text()
        );
    }

    // Requests on `open` keep going while the service is killed under them.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (running, mut started) = tokio::sync::mpsc::channel::<()>(1);
    let background = {
        let (stop, url) = (stop.clone(), open_url.clone());
        tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            let mut times = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let (resp, took) = conn.get(&url, "").await;
                assert_eq!(
                    resp.status,
                    200,
                    "open request {} across the kill: {}",
                    times.len(),
                    resp.text()
                );
                times.push(took);
                if times.len() == 5 {
                    let _ = running.send(()).await;
                }
            }
            times
        })
    };
    started.recv().await.expect("the background requests run");
    quota.service.kill().await;
    let (base, with) = alternate(addr, &plain_url, &open_url, 40).await;
    let mut refused = Vec::new();
    for _ in 0..5 {
        refused.push(strict.get(&strict_url, "").await.0);
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let across = background.await.unwrap();

    // allow: every request answered by the origin, none waiting on the service.
    let opened = 100 + across.len() + 40;
    assert_eq!(
        fleet.open.requests(PATH).len(),
        opened,
        "every open request reached its origin"
    );
    let added = report_added("the service killed (allow)", &base, &with);
    // The issue's bound: timeout + 5 ms, held by the median, which a busy machine's pauses
    // do not move; each request under 1 s, which only waiting on the service would take.
    assert!(
        added <= 55.0,
        "median added latency {added:.2} ms with the service down"
    );
    let slowest = with.iter().chain(&across).max().unwrap();
    assert!(
        *slowest < Duration::from_secs(1),
        "an open request took {slowest:?} with the service down"
    );
    println!(
        "{} open requests across the kill, the slowest {:?}",
        across.len(),
        across.iter().max()
    );
    // deny: 503 rate_limit_unavailable, nothing sent.
    for (i, resp) in refused.iter().enumerate() {
        resp.assert_sidecar_error(
            503,
            "rate_limit_unavailable",
            &format!("strict request {i}, service down"),
        );
    }
    assert_eq!(fleet.strict.requests(PATH).len(), 3);
    let open_calls = Calls::of(&fleet.sidecar, "open").await;
    let strict_calls = Calls::of(&fleet.sidecar, "strict").await;
    println!("open {open_calls:?}, strict {strict_calls:?}");
    assert!(open_calls.error + open_calls.timeout >= 40, "{open_calls:?}");
    assert_eq!(strict_calls.error + strict_calls.timeout, 5, "{strict_calls:?}");

    // The service back (Redis kept strict's 3): within 2 s strict's calls are answered again,
    // 2 more go, and the 6th is refused, by the same sidecar process.
    quota.service.restart().await;
    let back = Instant::now();
    let mut statuses = Vec::new();
    while back.elapsed() < Duration::from_secs(5) {
        let (resp, _) = strict.get(&strict_url, "").await;
        statuses.push(resp.status);
        if resp.status == 429 {
            assert_rate_limited(&resp, "strict's 6th request, service back");
            break;
        }
        if resp.status == 503 {
            resp.assert_sidecar_error(503, "rate_limit_unavailable", "strict, reconnecting");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let enforced = back.elapsed();
    println!("service back: the limit enforced after {enforced:?} ({statuses:?})");
    let tail: Vec<u16> = statuses.iter().copied().skip_while(|s| *s == 503).collect();
    assert_eq!(tail, [200, 200, 429], "after the reconnection: {statuses:?}");
    assert!(
        enforced <= Duration::from_secs(2),
        "enforced again after {enforced:?}"
    );
    assert_eq!(fleet.strict.requests(PATH).len(), STRICT_LIMIT);
    assert_eq!(quota.redis.counter(STRICT).await, STRICT_LIMIT as u64 + 1);
    assert_eq!(fleet.sidecar.child.id(), pid, "the same sidecar process");
}

// === 4: a storm over the limit ===

const STORM: usize = 5000;
const STORM_CONNECTIONS: usize = 50;

/// Needs ~30 s inside one window (5,031 requests through one sidecar).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_over_the_limit_is_answered_from_the_cache() {
    let Some(quota) = Quota::start().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    let section = counting_section(&quota.service, "[[{ key: upstream }]]");
    let yaml = sidecar_yaml(&[upstream(
        "partner",
        &origin,
        &format!("    global_rate_limit: {section}\n"),
    )]);
    let sidecar = ChildSidecar::spawn(&yaml).await;
    fresh_window(Duration::from_secs(30)).await;

    let url = origin.url(PATH);
    let mut conn = Conn::new(sidecar.addr);
    for i in 0..PARTNER_LIMIT {
        let (resp, _) = conn.get(&url, "").await;
        assert_eq!(resp.status, 200, "request {i}: {}", resp.text());
    }
    let (resp, _) = conn.get(&url, "").await;
    assert_rate_limited(&resp, "the first request over the limit");
    // The service answered this one: its headers (LIMIT_RESPONSE_HEADERS_ENABLED) come along.
    assert_eq!(
        (resp.header("ratelimit-limit"), resp.header("ratelimit-remaining")),
        (Some("30"), Some("0")),
        "the service's response_headers_to_add: {:?}",
        resp.headers
    );
    let before = quota.redis.counter(PARTNER).await;
    assert_eq!(before, PARTNER_LIMIT as u64 + 1);

    let started = Instant::now();
    let mut storm = Vec::new();
    for _ in 0..STORM_CONNECTIONS {
        let (addr, url) = (sidecar.addr, url.clone());
        storm.push(tokio::spawn(async move {
            let mut conn = Conn::new(addr);
            for i in 0..STORM / STORM_CONNECTIONS {
                let (resp, _) = conn.get(&url, "").await;
                assert_rate_limited(&resp, &format!("storm request {i}"));
            }
        }));
    }
    for s in storm {
        s.await.unwrap();
    }
    let took = started.elapsed();
    let after = quota.redis.counter(PARTNER).await;
    let calls = Calls::of(&sidecar, "partner").await;
    println!(
        "{STORM} requests over the limit in {took:?}: the service's counter {before} -> {after}; {calls:?}"
    );
    assert!(
        after - before <= 1,
        "the service was called {} times in the storm",
        after - before
    );
    assert_eq!(origin.requests(PATH).len(), PARTNER_LIMIT);
    assert_eq!(calls.ok, PARTNER_LIMIT as u64);
    assert_eq!(
        calls.answered(),
        after,
        "the sidecar's calls are the service's count"
    );
    assert_eq!(
        calls.answered() + calls.cached,
        (PARTNER_LIMIT + 1 + STORM) as u64,
        "one result per request: {calls:?}"
    );
    assert!(calls.cached >= STORM as u64 - 1, "{calls:?}");
}

// === 5: a slow service ===

/// The service behind a proxy holding each chunk 100 ms (a reply comes 200 ms after its call
/// at the earliest), the sidecar's timeout 50 ms. What is asserted, and why so: every `open`
/// request is answered by its origin and every `strict` one refused with 503; the median added
/// latency is under the 100 ms the issue says no request may wait (each request under 1 s: a
/// busy 2-core machine can pause any one request for more than 100 ms, so the per-request
/// bound is left to the counts); no call was answered (`ok`, `over_limit` zero: none waited
/// for the reply) and each request's call ended as a `timeout` or `error`, timed by the
/// sidecar's histogram, at least half of them within 102.4 ms (the median again, by its clock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_service_is_not_waited_for() {
    let Some(quota) = Quota::start().await else {
        return;
    };
    let slow = SlowProxy::start(quota.service.grpc, Duration::from_millis(100)).await;
    let fleet = Outage::start(&slow.url(), "50ms").await;
    let addr = fleet.sidecar.addr;

    let (base, with) = alternate(addr, &fleet.plain.url(PATH), &fleet.open.url(PATH), 20).await;
    let mut strict = Conn::new(addr);
    let mut refused = Vec::new();
    for _ in 0..STRICT_LIMIT {
        refused.push(strict.get(&fleet.strict.url(PATH), "").await);
    }

    assert_eq!(fleet.open.requests(PATH).len(), 20, "allow: every request sent");
    let added = report_added("a service 100 ms away (allow)", &base, &with);
    assert!(added < 100.0, "median added latency {added:.2} ms");
    for (i, (resp, took)) in refused.iter().enumerate() {
        resp.assert_sidecar_error(503, "rate_limit_unavailable", &format!("strict request {i}"));
        assert!(*took < Duration::from_secs(1), "strict request {i} took {took:?}");
    }
    assert!(with.iter().all(|t| *t < Duration::from_secs(1)), "{with:?}");
    assert_eq!(fleet.strict.requests(PATH).len(), 0, "deny: nothing sent");
    for (upstream, requests) in [("open", 20), ("strict", STRICT_LIMIT as u64)] {
        let calls = Calls::of(&fleet.sidecar, upstream).await;
        println!("{upstream}: {calls:?}");
        assert_eq!(
            calls.answered(),
            0,
            "{upstream}: no call was waited for: {calls:?}"
        );
        assert_eq!(calls.timeout + calls.error, requests, "{upstream}: {calls:?}");
        assert!(calls.timeout >= 1, "{upstream}: the timeout counted: {calls:?}");
        // The sidecar's own clock: each call timed, most ended in half the reply's 200 ms.
        assert_eq!(calls.timed, requests, "{upstream}: {calls:?}");
        assert!(
            2 * calls.timed_within_102ms >= calls.timed,
            "{upstream}: {calls:?}"
        );
    }
}

// === 6: descriptors of the app, a header, a literal ===

/// Needs ~10 s inside one window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn app_header_and_literal_descriptors_are_counted_per_value() {
    let Some(quota) = Quota::start().await else {
        return;
    };
    let origin = ScriptedOrigin::start().await;
    let section = counting_section(
        &quota.service,
        "[[{ key: upstream }, { key: app }], [{ key: upstream }, { key: header, name: x-tenant }], \
         [{ key: generic_key, value: openai-org }]]",
    );
    let yaml = sidecar_yaml(&[upstream(
        "shapes",
        &origin,
        &format!("    global_rate_limit: {section}\n"),
    )]);
    let sidecar = ChildSidecar::spawn(&yaml).await;
    let window = fresh_window(Duration::from_secs(10)).await;

    // app-a, tenant t1: two go, the third is over app-a's 2; app-b, no tenant: goes.
    let url = origin.url(PATH);
    let mut conn = Conn::new(sidecar.addr);
    for i in 0..3 {
        let (resp, _) = conn.get(&url, "x-egress-app: app-a\r\nx-tenant: t1\r\n").await;
        if i < 2 {
            assert_eq!(resp.status, 200, "app-a request {i}: {}", resp.text());
        } else {
            assert_rate_limited(&resp, "app-a's third request");
        }
    }
    let (resp, _) = conn.get(&url, "x-egress-app: app-b\r\n").await;
    assert_eq!(resp.status, 200, "app-b: {}", resp.text());
    assert_eq!(origin.requests(PATH).len(), 3);

    // Each call counted once per descriptor, under the value the request gave it; the header's
    // descriptor left out when the header is (no key for app-b's call).
    let shapes = |key: &'static str, value: &'static str| [("upstream", "shapes"), (key, value)];
    let counted = (
        quota.redis.counter(&shapes("app", "app-a")).await,
        quota.redis.counter(&shapes("app", "app-b")).await,
        quota.redis.counter(&shapes("x-tenant", "t1")).await,
        quota.redis.counter(ORG).await,
    );
    println!("the service counted (app-a, app-b, tenant t1, openai-org): {counted:?}");
    assert_eq!(counted, (3, 1, 3, 4));
    let tenants = quota
        .redis
        .command(&["KEYS", "egress_upstream_shapes_x-tenant_*"])
        .await;
    let key = format!("egress_upstream_shapes_x-tenant_t1_{window}");
    assert_eq!(
        tenants,
        Resp::Array(vec![Resp::Bulk(Some(key.into_bytes()))]),
        "one tenant's key"
    );
}
