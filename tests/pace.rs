//! Pacing to an upstream's advertised rate limits (issue 43), against a scripted provider on a
//! real socket that allows 20 requests per 2 s per credential (tests/support/provider.rs), with
//! the sidecar as a child process (`retry: {attempts: 0}`). The big cases run four Python apps
//! (tests/pace/app.py, `requests`, 2 keep-alive connections each: 8 in flight at most) sending
//! 50 requests each as fast as they can: directly (the baseline: most are refused) or through
//! the sidecar (none are, in about the ideal time, spread evenly), in each provider's header
//! style. The small cases use raw clients or 40 requests of the apps: credentials paced apart,
//! one `Retry-After` pausing every app, `max_wait`, priorities, a waiter that leaves, malformed
//! headers, and pacing switched off. Run with `--nocapture` to see the numbers.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::pace_app::{python_requests_or_skip, Apps};
use support::provider::{Action, Provider, Style, When};
use support::{ChildSidecar, RawClient, RawResponse};

/// The provider's limit: requests per window per credential.
const LIMIT: u32 = 20;
const WINDOW: Duration = Duration::from_secs(2);
const APPS: usize = 4;
const PER_APP: usize = 50;
/// A provider limit the small cases never reach (the headers still tell a remaining).
const LARGE_LIMIT: u32 = 1000;
const UPSTREAM: &str = "llm";
const PATH: &str = "/v1/chat/completions";
const KEY_A: &str = "Authorization: Bearer sk-pace-test-a";
const KEY_B: &str = "Authorization: Bearer sk-pace-test-b";
/// The pace settings the issue names, at their defaults.
const PACE_DEFAULTS: &str = "{ enabled: true, max_wait: 30s, reserve: 0, smooth: true }";

/// The time 200 requests take at 20 per 2 s, in seconds.
fn ideal_seconds(requests: usize) -> f64 {
    requests as f64 / f64::from(LIMIT) * WINDOW.as_secs_f64()
}

/// The sidecar with upstream `llm` for the provider, no retries, and `pace` as given.
async fn sidecar(provider: &Provider, pace: &str) -> ChildSidecar {
    ChildSidecar::spawn(&format!(
        "upstreams:\n  - name: {UPSTREAM}\n    url: http://{}\n    retry: {{ attempts: 0 }}\n    pace: {pace}\n",
        provider.addr
    ))
    .await
}

/// The apps calling the provider directly.
fn direct<'a>(provider: &Provider, headers: &'a [&'a str], apps: usize, per_app: usize) -> Apps<'a> {
    Apps {
        url: provider.url(PATH),
        proxy: None,
        headers,
        apps,
        per_app,
    }
}

/// The apps calling the provider through the sidecar, their HTTP proxy.
fn through<'a>(
    provider: &Provider,
    sidecar: &ChildSidecar,
    headers: &'a [&'a str],
    apps: usize,
    per_app: usize,
) -> Apps<'a> {
    Apps {
        proxy: Some(sidecar.addr),
        ..direct(provider, headers, apps, per_app)
    }
}

// === the sidecar's state ===

/// The pace keys `/debug/pools` shows for upstream `llm` (none before its first request).
async fn pace_keys(sidecar: &ChildSidecar) -> Vec<Value> {
    let resp = support::admin_get(sidecar.admin, "/debug/pools").await;
    assert_eq!(resp.status, 200, "/debug/pools: {}", resp.text());
    let all: Value = serde_json::from_slice(&resp.body).expect("/debug/pools is JSON");
    let pace = all["pace"]
        .as_array()
        .unwrap_or_else(|| panic!("no \"pace\" array in /debug/pools: {all}"));
    pace.iter()
        .find(|u| u["upstream"] == UPSTREAM)
        .map(|u| {
            u["keys"]
                .as_array()
                .unwrap_or_else(|| panic!("no keys array for {UPSTREAM} in {u}"))
                .clone()
        })
        .unwrap_or_default()
}

/// Requests waiting on any of upstream `llm`'s pace keys.
async fn waiters(sidecar: &ChildSidecar) -> u64 {
    pace_keys(sidecar)
        .await
        .iter()
        .map(|k| k["waiters"].as_u64().unwrap_or_else(|| panic!("waiters of {k}")))
        .sum()
}

/// Waits (up to `within`) until `n` requests wait, and returns how many did at the end.
async fn waiters_reach(sidecar: &ChildSidecar, n: u64, within: Duration) -> u64 {
    support::fetch_until(within, || waiters(sidecar), |w| *w == n).await
}

/// A metric of upstream `llm` in `scrape` (0 when absent).
fn llm_value(scrape: &prometheus_parse::Scrape, name: &str) -> f64 {
    // + 0.0: an empty sum is -0.0, which would print as "-0".
    support::value(scrape, name, &[("upstream", UPSTREAM)]) + 0.0
}

/// A metric of upstream `llm`, scraped now.
async fn pace_metric(sidecar: &ChildSidecar, name: &str) -> f64 {
    llm_value(&support::scrape(sidecar.admin).await, name)
}

/// A GET of the provider through the sidecar on a new connection, with `headers` (each line
/// ending in CRLF) and `x-test-id: id`.
async fn get(sidecar: &ChildSidecar, provider: &Provider, id: &str, headers: &str) -> RawResponse {
    RawClient::connect(sidecar.addr)
        .await
        .get_with(&provider.url(PATH), &format!("{headers}x-test-id: {id}\r\n"))
        .await
}

/// Requests waiting on tasks of their own. A `JoinSet` aborts them when dropped: a test that
/// fails first ends them before its sidecar goes, so they add no failures of their own.
type Waiting = tokio::task::JoinSet<(String, RawResponse)>;

/// [`get`] on a task of its own in `waiting`; the task yields the id and the response.
fn spawn_get(
    waiting: &mut Waiting,
    sidecar: &ChildSidecar,
    provider: &Provider,
    id: String,
    headers: String,
) {
    let (proxy, url) = (sidecar.addr, provider.url(PATH));
    waiting.spawn(async move {
        let resp = RawClient::connect(proxy)
            .await
            .get_with(&url, &format!("{headers}x-test-id: {id}\r\n"))
            .await;
        (id, resp)
    });
}

/// Every response of `waiting` (within `within` in all), by id.
async fn join_all(waiting: &mut Waiting, within: Duration) -> BTreeMap<String, RawResponse> {
    let mut all = BTreeMap::new();
    let joined = tokio::time::timeout(within, async {
        while let Some(done) = waiting.join_next().await {
            let (id, resp) = done.unwrap();
            all.insert(id, resp);
        }
    })
    .await;
    assert!(
        joined.is_ok(),
        "{} requests unanswered after {within:?}; answered: {:?}",
        waiting.len(),
        all.iter().map(|(id, r)| (id, r.status)).collect::<Vec<_>>()
    );
    all
}

// === 1-4: four apps, 200 requests ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_to_the_provider_most_requests_are_refused() {
    if !python_requests_or_skip().await {
        return;
    }
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let run = direct(&provider, &[KEY_A], APPS, PER_APP).run().await;
    let refused = run.count(429);
    let summary = format!(
        "direct (baseline): {} requests: {:?}; 429s at the apps {refused}, over the limit at \
         the provider {}, run time {:.2} s (apps started up to {:.2} s late)",
        APPS * PER_APP,
        run.statuses(),
        provider.over_limit(),
        run.run_time(),
        run.latest_app()
    );
    println!("{summary}");
    assert!(refused > APPS * PER_APP / 2, "most requests refused: {summary}");
    assert_eq!(refused, provider.over_limit(), "{summary}");
    assert_eq!(refused + run.count(200), APPS * PER_APP, "{summary}");
    assert!(
        run.requests()
            .filter(|r| r.status == 429)
            .all(|r| r.retry_after.is_some()),
        "every 429 carries Retry-After: {}",
        run.not_ok()
    );
}

/// Four apps through the sidecar against the provider in `style`: none of the 200 requests is
/// refused, the provider sees none over its limit, and the run takes at most `max_ratio` times
/// the ideal time.
async fn paced_through_the_sidecar(style: Style, max_ratio: f64) {
    if !python_requests_or_skip().await {
        return;
    }
    let provider = Provider::start(style, LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, PACE_DEFAULTS).await;
    let run = through(&provider, &sidecar, &[KEY_A], APPS, PER_APP).run().await;
    let total = APPS * PER_APP;
    let ideal = ideal_seconds(total);
    let ratio = run.run_time() / ideal;
    let m = support::scrape(sidecar.admin).await;
    let summary = format!(
        "{style:?} through the sidecar: {total} requests: {:?}; 429s at the apps {}, over the \
         limit at the provider {}, run time {:.2} s, ideal {ideal:.0} s, ratio {ratio:.3} (at \
         most {max_ratio}); apps started up to {:.2} s late; the sidecar held {} requests; not \
         200: {}",
        run.statuses(),
        run.count(429),
        provider.over_limit(),
        run.run_time(),
        run.latest_app(),
        llm_value(&m, "egress_pace_waits_total"),
        run.not_ok()
    );
    println!("{summary}");
    assert_eq!(run.count(429), 0, "429s reached the apps: {summary}");
    assert_eq!(
        provider.over_limit(),
        0,
        "requests over the provider's limit: {summary}"
    );
    assert_eq!(run.count(200), total, "all answered 200: {summary}");
    assert_eq!(provider.arrivals().len(), total, "each sent once: {summary}");
    assert!(ratio <= max_ratio, "run time: {summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_headers_no_429_and_near_the_ideal_time() {
    paced_through_the_sidecar(Style::OpenAi, 1.15).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_headers_no_429_and_near_the_ideal_time() {
    // Whole-second resets: within 1.3x.
    paced_through_the_sidecar(Style::Anthropic, 1.3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ietf_ratelimit_headers_no_429_and_near_the_ideal_time() {
    // Whole-second resets: within 1.3x.
    paced_through_the_sidecar(Style::Ietf, 1.3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smooth_spreads_requests_no_200ms_slice_over_twice_the_average() {
    if !python_requests_or_skip().await {
        return;
    }
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, PACE_DEFAULTS).await;
    // The sidecar cannot know a key's limit before its first response: a fresh key's first
    // requests (8 in flight) go out together, whatever it does. One request just before the
    // apps start (in the same window of the provider) tells it the limit and the window's
    // reset, so the run measures the smoothing, not that first contact.
    let apps = through(&provider, &sidecar, &[KEY_A], APPS, PER_APP);
    let started = apps.start(Duration::from_millis(2500));
    tokio::time::sleep_until(started.start_at - Duration::from_millis(200)).await;
    let warm = get(&sidecar, &provider, "warm-up", &format!("{KEY_A}\r\n")).await;
    assert_eq!(warm.status, 200, "the warm-up request: {}", warm.text());
    let run = started.finish().await;
    let mut times: Vec<Instant> = provider
        .arrivals()
        .iter()
        .filter(|a| a.test_id.as_deref().is_some_and(|id| id.starts_with("app")))
        .map(|a| a.at)
        .collect();
    times.sort();
    assert_eq!(
        times.len(),
        APPS * PER_APP,
        "the apps' requests at the provider; apps saw {:?}",
        run.statuses()
    );
    let slice = Duration::from_millis(200);
    let span = *times.last().unwrap() - times[0];
    let slices = (span.as_secs_f64() / slice.as_secs_f64()).ceil().max(1.0) as usize;
    let mut per_slice = vec![0usize; slices];
    for t in &times {
        let i = ((*t - times[0]).as_secs_f64() / slice.as_secs_f64()) as usize;
        per_slice[i.min(slices - 1)] += 1;
    }
    let average = times.len() as f64 / (span.as_secs_f64() / slice.as_secs_f64()).max(1.0);
    let max = *per_slice.iter().max().unwrap();
    let mut spread = BTreeMap::new();
    for n in &per_slice {
        *spread.entry(*n).or_insert(0) += 1;
    }
    let summary = format!(
        "smooth: {} requests over {:.2} s in {slices} slices of 200 ms: max slice {max}, average \
         {average:.2} per slice (at most {:.2}); slices by requests carried {spread:?}; apps saw \
         {:?}, over the limit at the provider {}; apps started up to {:.2} s late",
        times.len(),
        span.as_secs_f64(),
        2.0 * average,
        run.statuses(),
        provider.over_limit(),
        run.latest_app()
    );
    println!("{summary}");
    // A run that broke the limit says nothing of the spread (it may be over in one slice).
    assert_eq!(
        provider.over_limit(),
        0,
        "the run kept within the limit: {summary}"
    );
    assert!(max as f64 <= 2.0 * average, "a burst: {summary}");
}

// === 5-9: one key at a time ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_credentials_are_paced_apart() {
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    // Not smoothed: B's quota is all there, so its requests go out at once.
    let sidecar = sidecar(&provider, "{ smooth: false }").await;
    let reset = Duration::from_secs(4);
    provider.script(
        When::Credential("Bearer sk-pace-test-a".into()),
        Action::Exhaust { reset },
    );
    let a1 = get(&sidecar, &provider, "a-1", &format!("{KEY_A}\r\n")).await;
    assert_eq!(a1.status, 200, "{}", a1.text());
    assert_eq!(a1.header("x-ratelimit-remaining-requests"), Some("0"));
    let exhausted = provider.arrival("a-1").unwrap().at;
    let mut a2 = Waiting::new();
    spawn_get(&mut a2, &sidecar, &provider, "a-2".into(), format!("{KEY_A}\r\n"));
    let held = waiters_reach(&sidecar, 1, Duration::from_secs(2)).await;
    assert_eq!(held, 1, "A's second request waits for A's reset");

    let mut times = Vec::new();
    for i in 0..5 {
        let started = Instant::now();
        let b = get(&sidecar, &provider, &format!("b-{i}"), &format!("{KEY_B}\r\n")).await;
        times.push(started.elapsed());
        assert_eq!(b.status, 200, "b-{i}: {}", b.text());
    }
    let slowest = times.iter().max().unwrap();
    assert!(
        *slowest < Duration::from_millis(500),
        "B's requests are answered at once while A waits its reset ({reset:?}): took {times:?}"
    );
    assert!(
        a2.try_join_next().is_none(),
        "A's second request was answered before A's reset"
    );
    let keys = pace_keys(&sidecar).await;
    assert_eq!(keys.len(), 2, "one pace key per credential: {keys:#?}");
    for key in &keys {
        let hash = key["key"].as_str().unwrap_or_default();
        assert!(
            hash.len() == 8 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
            "a key is its hash's first 8 hex digits: {key}"
        );
    }
    let (a, b) = match keys.iter().position(|k| k["waiters"] == 1) {
        Some(0) => (&keys[0], &keys[1]),
        Some(_) => (&keys[1], &keys[0]),
        None => panic!("no key with A's waiter: {keys:#?}"),
    };
    let a_reset = a["reset_ms"].as_u64().unwrap_or(u64::MAX);
    assert!(
        a["remaining_requests"] == 0 && a["closed"] == true && a_reset <= 4000,
        "A's key: no request left, closed until its reset: {a}"
    );
    // B: 5 requests sent, 15 left of its window.
    assert!(
        b["remaining_requests"] == 15 && b["closed"] == false && b["waiters"] == 0,
        "B's key: open, 15 left: {b}"
    );
    let shown = serde_json::to_string(&keys).unwrap();
    assert!(
        !shown.contains("sk-pace-test"),
        "a credential in clear in /debug/pools: {shown}"
    );
    let logged = sidecar.logged("sk-pace-test");
    assert!(logged.is_empty(), "a credential in clear in the log: {logged:?}");

    let a2 = join_all(&mut a2, Duration::from_secs(10))
        .await
        .remove("a-2")
        .unwrap();
    assert_eq!(a2.status, 200, "{}", a2.text());
    let sent = provider.arrival("a-2").expect("A's second request sent").at - exhausted;
    assert!(
        sent >= reset,
        "A's second request reached the provider {sent:?} after A's key ran out (reset {reset:?})"
    );
    assert_eq!(provider.over_limit(), 0, "{:?}", provider.arrivals());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_to_one_app_pauses_every_app() {
    if !python_requests_or_skip().await {
        return;
    }
    // No limit headers: only the 429's Retry-After can hold anything.
    let provider = Provider::start(Style::Silent, LARGE_LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, PACE_DEFAULTS).await;
    let pause = Duration::from_secs(3);
    provider.script(When::Arrival(3), Action::TooMany { retry_after: 3 });
    let run = through(&provider, &sidecar, &[KEY_A], APPS, 10).run().await;
    let arrivals = provider.arrivals();
    let refused = arrivals
        .iter()
        .find(|a| a.scripted)
        .expect("the scripted 429 was given");
    let refused_id = refused.test_id.clone().unwrap();
    // Requests the sidecar had sent before it read the 429 cannot be recalled: they may arrive
    // just after it. At most 7 (8 in flight, one of them the refused): another app's round
    // trip through Python takes longer than the sidecar takes to read a response head.
    let grace = Duration::from_millis(100);
    let after = |a: &support::provider::Arrival| a.at.checked_duration_since(refused.at);
    let in_flight = arrivals
        .iter()
        .filter(|a| after(a).is_some_and(|d| !d.is_zero() && d <= grace))
        .count();
    let during: Vec<String> = arrivals
        .iter()
        .filter_map(|a| {
            let d = after(a)?;
            (d > grace && d < pause).then(|| format!("{:?} at +{d:?}", a.test_id))
        })
        .collect();
    let later: Vec<&str> = arrivals
        .iter()
        .filter(|a| after(a).is_some_and(|d| d >= pause))
        .filter_map(|a| a.test_id.as_deref())
        .collect();
    let apps_later: std::collections::BTreeSet<&str> =
        later.iter().filter_map(|id| id.split('-').next()).collect();
    let summary = format!(
        "429 with Retry-After: 3 to {refused_id}: {in_flight} arrived within {grace:?} after it, \
         {} between then and {pause:?} ({during:?}), {} after (from {apps_later:?}); apps saw \
         {:?}; not 200: {}",
        during.len(),
        later.len(),
        run.statuses(),
        run.not_ok()
    );
    println!("{summary}");
    assert!(
        in_flight <= 7,
        "more requests arrived right after the 429 than were in flight when it was sent (7): \
         it paused nothing: {summary}"
    );
    assert!(during.is_empty(), "requests during the pause: {summary}");
    assert!(
        apps_later.len() >= 2,
        "the other apps resume after the pause: {summary}"
    );
    assert_eq!(
        run.count(429),
        1,
        "only the scripted 429 reaches an app: {summary}"
    );
    assert!(
        run.requests().any(|r| r.id == refused_id && r.status == 429),
        "{summary}"
    );
    assert_eq!(run.count(200), APPS * 10 - 1, "{summary}");
    let m = support::scrape(sidecar.admin).await;
    let closed = support::value(
        &m,
        "egress_pace_closed_total",
        &[("upstream", UPSTREAM), ("reason", "retry_after")],
    );
    assert!(
        closed >= 1.0,
        "egress_pace_closed_total{{reason=\"retry_after\"}} {closed}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_max_wait_is_refused_at_once_and_not_sent() {
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, "{ max_wait: 1s }").await;
    provider.script(
        When::Next,
        Action::Exhaust {
            reset: Duration::from_secs(5),
        },
    );
    let first = get(&sidecar, &provider, "first", &format!("{KEY_A}\r\n")).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let started = Instant::now();
    let held = get(&sidecar, &provider, "held", &format!("{KEY_A}\r\n")).await;
    let took = started.elapsed();
    let what = format!(
        "a request that would wait past max_wait (1 s) for a reset 5 s away: answered {} \
         x-egress-error {:?} Retry-After {:?} after {took:?}; the provider saw {:?}",
        held.status,
        held.header("x-egress-error"),
        held.header("retry-after"),
        provider
            .arrivals()
            .iter()
            .map(|a| (&a.test_id, a.status))
            .collect::<Vec<_>>()
    );
    held.assert_sidecar_error(429, "rate_limited", &what);
    assert!(
        took <= Duration::from_millis(1500),
        "answered {took:?} after it was sent (at most 1.5 s)"
    );
    let retry_after = held.header("retry-after");
    assert!(
        matches!(retry_after, Some("4" | "5")),
        "Retry-After {retry_after:?}, the reset being 5 s away when the key closed"
    );
    // Had it been sent, it would have arrived by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let arrivals = provider.arrivals();
    assert!(
        provider.arrival("held").is_none() && arrivals.len() == 1,
        "the provider saw the refused request: {arrivals:?}"
    );
    assert_eq!(pace_metric(&sidecar, "egress_pace_rejected_total").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn high_priority_waiters_are_sent_before_low_ones() {
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, PACE_DEFAULTS).await;
    let reset = Duration::from_secs(3);
    provider.script(When::Next, Action::Exhaust { reset });
    // The model as pace key, on every request: it is part of the key, and never forwarded.
    let model = "x-egress-pace-key: gpt-test\r\n";
    let first = get(&sidecar, &provider, "first", &format!("{KEY_A}\r\n{model}")).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let closed = provider.arrival("first").unwrap().at;
    let mut tasks = Waiting::new();
    for i in 0..20 {
        let headers = format!("{KEY_A}\r\n{model}x-egress-priority: low\r\n");
        spawn_get(&mut tasks, &sidecar, &provider, format!("low-{i}"), headers);
    }
    let low = waiters_reach(&sidecar, 20, Duration::from_secs(2)).await;
    assert_eq!(low, 20, "the low requests wait for the reset");
    for i in 0..5 {
        let headers = format!("{KEY_A}\r\n{model}x-egress-priority: high\r\n");
        spawn_get(&mut tasks, &sidecar, &provider, format!("high-{i}"), headers);
    }
    let all = waiters_reach(&sidecar, 25, Duration::from_secs(2)).await;
    let seen_at = closed.elapsed();
    assert_eq!(all, 25, "20 low and 5 high wait");
    assert!(
        seen_at < reset,
        "the 25 were seen waiting only {seen_at:?} after the key closed, past its reset {reset:?}"
    );
    for (id, resp) in join_all(&mut tasks, Duration::from_secs(20)).await {
        assert_eq!(resp.status, 200, "{id}: {}", resp.text());
    }
    let order: Vec<String> = provider
        .arrivals()
        .iter()
        .skip(1)
        .map(|a| a.test_id.clone().unwrap_or_default())
        .collect();
    assert_eq!(order.len(), 25, "{order:?}");
    assert!(
        order[..5].iter().all(|id| id.starts_with("high-")),
        "the 5 high requests go before any low one; the provider saw {order:?}"
    );
    for a in provider.arrivals() {
        for name in ["x-egress-priority", "x-egress-pace-key"] {
            assert!(
                !a.headers.contains_key(name),
                "{name} reached the provider: {:?}",
                a.headers
            );
        }
    }
    assert_eq!(provider.over_limit(), 0, "{:?}", provider.arrivals());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_disconnects_leaves_the_queue_and_is_never_sent() {
    use tokio::io::AsyncWriteExt;
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, PACE_DEFAULTS).await;
    let reset = Duration::from_secs(3);
    provider.script(When::Next, Action::Exhaust { reset });
    let first = get(&sidecar, &provider, "first", &format!("{KEY_A}\r\n")).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let closed = provider.arrival("first").unwrap().at;

    let mut app = tokio::net::TcpStream::connect(sidecar.addr).await.unwrap();
    let host = provider.addr;
    app.write_all(
        format!("GET http://{host}{PATH} HTTP/1.1\r\nHost: {host}\r\n{KEY_A}\r\nx-test-id: gone\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let waiting = waiters_reach(&sidecar, 1, Duration::from_secs(2)).await;
    assert_eq!(waiting, 1, "the request waits for the reset");
    drop(app);
    let left = waiters_reach(&sidecar, 0, Duration::from_secs(1)).await;
    let gone_at = closed.elapsed();
    assert_eq!(left, 0, "the waiter that went away is still counted");
    assert!(
        gone_at < reset,
        "checked only {gone_at:?} after the key closed, past its reset {reset:?}"
    );

    // Past the reset, the key open again: the request would have been sent by now.
    tokio::time::sleep((reset + Duration::from_millis(500)).saturating_sub(closed.elapsed())).await;
    let after = get(&sidecar, &provider, "after", &format!("{KEY_A}\r\n")).await;
    assert_eq!(after.status, 200, "{}", after.text());
    let seen: Vec<Option<String>> = provider.arrivals().into_iter().map(|a| a.test_id).collect();
    assert_eq!(
        seen,
        [Some("first".to_owned()), Some("after".to_owned())],
        "the provider never sees the request whose app went away"
    );
}

// === 10 and pacing off: headers that must hold nothing ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_absurd_headers_are_counted_and_hold_nothing() {
    if !python_requests_or_skip().await {
        return;
    }
    let provider = Provider::start(Style::Malformed, LARGE_LIMIT, WINDOW).await;
    let mut sidecar = sidecar(&provider, PACE_DEFAULTS).await;
    let run = through(&provider, &sidecar, &[KEY_A], APPS, 10).run().await;
    let m = support::scrape(sidecar.admin).await;
    let waits = llm_value(&m, "egress_pace_waits_total");
    let rejected = llm_value(&m, "egress_pace_rejected_total");
    let errors = llm_value(&m, "egress_pace_header_errors_total");
    let summary = format!(
        "malformed headers: apps saw {:?} in {:.2} s; pace waits {waits}, rejected {rejected}, \
         header errors {errors}; not 200: {}",
        run.statuses(),
        run.run_time(),
        run.not_ok()
    );
    println!("{summary}");
    assert_eq!(run.count(200), APPS * 10, "{summary}");
    assert_eq!(waits, 0.0, "a request was held: {summary}");
    assert_eq!(rejected, 0.0, "{summary}");
    assert!(errors > 0.0, "the malformed headers are counted: {summary}");
    assert!(
        sidecar.child.try_wait().unwrap().is_none(),
        "the sidecar is still running: {summary}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pace_disabled_passes_limit_headers_and_holds_nothing() {
    if !python_requests_or_skip().await {
        return;
    }
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let sidecar = sidecar(&provider, "{ enabled: false }").await;
    let run = through(&provider, &sidecar, &[KEY_A], APPS, PER_APP).run().await;
    let waits = pace_metric(&sidecar, "egress_pace_waits_total").await;
    let total = APPS * PER_APP;
    let summary = format!(
        "pace off: {total} requests: {:?}; over the limit at the provider {}, run time {:.2} s, \
         pace waits {waits}",
        run.statuses(),
        provider.over_limit(),
        run.run_time()
    );
    println!("{summary}");
    assert!(
        run.count(429) > total / 2,
        "the provider's 429s reach the apps: {summary}"
    );
    assert_eq!(run.count(429), provider.over_limit(), "{summary}");
    assert_eq!(waits, 0.0, "{summary}");
    assert!(
        run.run_time() < ideal_seconds(total) / 2.0,
        "nothing waits: {summary}"
    );
    let arrivals = provider.arrivals();
    for r in run.requests() {
        let sent = arrivals
            .iter()
            .find(|a| a.test_id.as_deref() == Some(r.id.as_str()))
            .unwrap_or_else(|| panic!("{} never reached the provider", r.id));
        let sent: BTreeMap<String, String> = sent.sent.iter().cloned().collect();
        assert_eq!(r.headers, sent, "{}: the limit headers unchanged", r.id);
    }
}

// === the provider itself (no sidecar) ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_enforces_its_window_per_credential_and_says_so() {
    let provider = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    let mut client = RawClient::connect(provider.addr).await;
    let url = provider.url(PATH);
    for i in 0..LIMIT {
        let resp = client.get_with(&url, &format!("{KEY_A}\r\n")).await;
        assert_eq!(resp.status, 200, "request {i}");
        let remaining = (LIMIT - 1 - i).to_string();
        assert_eq!(
            resp.header("x-ratelimit-remaining-requests"),
            Some(remaining.as_str())
        );
        assert_eq!(resp.header("x-ratelimit-limit-requests"), Some("20"));
        let reset = resp.header("x-ratelimit-reset-requests").unwrap();
        assert!(reset.ends_with('s'), "a Go duration: {reset}");
    }
    let over = client.get_with(&url, &format!("{KEY_A}\r\n")).await;
    assert_eq!(over.status, 429);
    assert!(
        matches!(over.header("retry-after"), Some("1" | "2")),
        "{:?}",
        over.headers
    );
    let ms: u64 = over.header("retry-after-ms").unwrap().parse().unwrap();
    assert!(ms <= 2000, "{ms}");
    assert_eq!(over.header("x-ratelimit-remaining-requests"), Some("0"));
    // Another credential has a window of its own; x-api-key counts as one.
    let other = client.get_with(&url, "x-api-key: sk-other\r\n").await;
    assert_eq!(other.status, 200);
    assert_eq!(other.header("x-ratelimit-remaining-requests"), Some("19"));
    assert_eq!(provider.over_limit(), 1);
    let arrivals = provider.arrivals();
    assert_eq!(arrivals.len(), 22);
    assert_eq!(arrivals[21].credential, "sk-other");

    // The next window opens at the reset.
    tokio::time::sleep(Duration::from_millis(ms)).await;
    let again = client.get_with(&url, &format!("{KEY_A}\r\n")).await;
    assert_eq!(again.status, 200, "{:?}", again.headers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_provider_writes_each_style_and_scripted_answers() {
    let anthropic = Provider::start(Style::Anthropic, LIMIT, WINDOW).await;
    let mut client = RawClient::connect(anthropic.addr).await;
    let resp = client.get_with(&anthropic.url(PATH), "").await;
    assert_eq!(resp.header("anthropic-ratelimit-requests-remaining"), Some("19"));
    let reset = resp
        .header("anthropic-ratelimit-requests-reset")
        .unwrap()
        .to_owned();
    let at = anthropic.arrivals()[0].at;
    // The window is aligned to whole seconds: it ends within W of the request, not before it.
    let end = support::provider::rfc3339(anthropic.unix_seconds(at).floor() as u64 + 2);
    assert_eq!(reset, end);

    let ietf = Provider::start(Style::Ietf, LIMIT, WINDOW).await;
    let mut client = RawClient::connect(ietf.addr).await;
    let resp = client.get_with(&ietf.url(PATH), "api-key: k\r\n").await;
    assert_eq!(resp.header("ratelimit-policy"), Some("\"default\";q=20;w=2"));
    assert_eq!(resp.header("ratelimit"), Some("\"default\";r=19;t=2"));

    let openai = Provider::start(Style::OpenAi, LIMIT, WINDOW).await;
    openai.script(When::Next, Action::TooMany { retry_after: 3 });
    openai.script(
        When::Credential("k2".into()),
        Action::Exhaust {
            reset: Duration::from_secs(5),
        },
    );
    let mut client = RawClient::connect(openai.addr).await;
    let url = openai.url(PATH);
    let resp = client.get_with(&url, "x-api-key: k1\r\n").await;
    assert_eq!((resp.status, resp.header("retry-after")), (429, Some("3")));
    assert_eq!(resp.header("retry-after-ms"), Some("3000"));
    // A scripted 429 is not enforced: the next request of k1 is answered.
    assert_eq!(client.get_with(&url, "x-api-key: k1\r\n").await.status, 200);
    let resp = client.get_with(&url, "x-api-key: k2\r\n").await;
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(resp.header("x-ratelimit-reset-requests"), Some("5s"));
    // Exhausted is enforced until the reset.
    let resp = client.get_with(&url, "x-api-key: k2\r\n").await;
    assert_eq!(resp.status, 429);
    assert!(
        matches!(resp.header("retry-after"), Some("5")),
        "{:?}",
        resp.headers
    );
    let flags: Vec<(bool, bool)> = openai
        .arrivals()
        .iter()
        .map(|a| (a.scripted, a.over_limit))
        .collect();
    assert_eq!(
        flags,
        [(true, false), (false, false), (true, false), (false, true)]
    );
}

// === the provider's own header values ===

#[test]
fn the_provider_writes_header_values_as_providers_do() {
    use support::provider::{ceil_millis, ceil_seconds, go_duration_millis, rfc3339};
    assert_eq!(go_duration_millis(0), "0s");
    assert_eq!(go_duration_millis(87), "87ms");
    assert_eq!(go_duration_millis(1234), "1.234s");
    assert_eq!(go_duration_millis(1500), "1.5s");
    assert_eq!(go_duration_millis(2000), "2s");
    assert_eq!(go_duration_millis(360_000), "6m0s");
    assert_eq!(go_duration_millis(3_723_500), "1h2m3.5s");
    assert_eq!(ceil_millis(Duration::from_micros(86_001)), 87);
    assert_eq!(ceil_millis(Duration::from_millis(87)), 87);
    assert_eq!(ceil_seconds(Duration::from_millis(1001)), 2);
    assert_eq!(ceil_seconds(Duration::from_secs(3)), 3);
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339(1_795_821_005), "2026-11-27T23:10:05Z");
}
