//! A pacer end to end on header maps: learning a key from an answer, holding its requests and
//! not another credential's, and forgetting keys nothing holds.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use tokio::time::Instant;

use super::*;

fn pacer() -> Arc<Pacer> {
    Pacer::new("llm".into(), PaceConfig::default(), &Metrics::new())
}

fn with_credential(value: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(http::header::AUTHORIZATION, HeaderValue::from_static(value));
    headers
}

/// What the pacer decides for a request with `headers` to an upstream that injects no
/// credential.
fn admit(
    pacer: &Pacer,
    config: &PaceConfig,
    headers: &HeaderMap,
    asked: Asked,
    deadline: Option<Instant>,
) -> (Ticket, Pass) {
    pacer.admit(config, headers, &Credentials::default(), asked, deadline)
}

/// What `proxy::headers` says of a request that came with a credential field.
fn with_credential_sent() -> Asked {
    Asked {
        credential: true,
        ..Asked::default()
    }
}

fn exhausted() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("x-ratelimit-limit-requests", HeaderValue::from_static("20"));
    headers.insert("x-ratelimit-remaining-requests", HeaderValue::from_static("0"));
    headers.insert("x-ratelimit-reset-requests", HeaderValue::from_static("5s"));
    headers
}

#[tokio::test]
async fn an_answer_teaches_its_key_whose_requests_then_wait_and_another_credentials_do_not() {
    let pacer = pacer();
    let config = PaceConfig::default();
    let alice = with_credential("Bearer sk-alice-secret");
    let (ticket, pass) = admit(&pacer, &config, &alice, with_credential_sent(), None);
    assert!(matches!(pass, Pass::Go), "nothing is known yet");
    let ticket = ticket.going();
    pacer.observe(&config, &ticket, 200, &exhausted(), None);
    drop(ticket);

    let soon = Some(Instant::now() + Duration::from_secs(1));
    match admit(&pacer, &config, &alice, with_credential_sent(), soon).1 {
        Pass::Refuse(refusal) => assert!((4..=5).contains(&refusal.retry_after_secs), "{refusal:?}"),
        other => panic!("a wait past the deadline is refused: {other:?}"),
    }
    assert!(matches!(
        admit(&pacer, &config, &alice, with_credential_sent(), None).1,
        Pass::Wait(_)
    ));
    let bob = with_credential("Bearer sk-bob-secret");
    assert!(matches!(
        admit(&pacer, &config, &bob, with_credential_sent(), None).1,
        Pass::Go
    ));
    // A tag splits a credential's key.
    let tagged = Asked {
        tag: Some(Asked::tag(b"gpt-4o")),
        ..with_credential_sent()
    };
    assert!(matches!(admit(&pacer, &config, &alice, tagged, None).1, Pass::Go));

    // A request whose walk saw no credential field is the anonymous key's, looked up no
    // further.
    let unseen = Asked::default();
    assert!(matches!(admit(&pacer, &config, &alice, unseen, None).1, Pass::Go));

    let report = pacer.report();
    let shown = serde_json::to_string(&report).unwrap();
    assert!(!shown.contains("secret") && !shown.contains("alice"), "{shown}");
    assert!(report.keys.iter().all(|k| k.key.len() == 8), "{shown}");
}

#[tokio::test]
async fn off_reads_nothing_and_holds_nothing() {
    let pacer = pacer();
    let config = PaceConfig {
        enabled: false,
        ..PaceConfig::default()
    };
    let alice = with_credential("Bearer a");
    let (ticket, _) = admit(&pacer, &config, &alice, with_credential_sent(), None);
    pacer.observe(&config, &ticket.going(), 200, &exhausted(), None);
    assert!(matches!(
        admit(&pacer, &config, &alice, with_credential_sent(), None).1,
        Pass::Go
    ));
    assert!(pacer.report().keys.is_empty());
}

#[tokio::test]
async fn keys_nothing_holds_are_forgotten_as_new_ones_come() {
    let pacer = pacer();
    let held = pacer.key(1);
    for id in 2..=(MIN_SWEEP as u64) {
        pacer.key(id);
    }
    assert_eq!(pacer.keys.lock().unwrap().map.len(), MIN_SWEEP);
    pacer.key(10_000);
    let keys = pacer.keys.lock().unwrap();
    assert_eq!(keys.map.len(), 2, "the held key and the new one");
    assert!(keys.map.contains_key(&1));
    drop(held);
}

/// A credential `request_headers` injects keys the request even when the application sent no
/// credential field of its own.
#[tokio::test]
async fn an_injected_credential_keys_requests_the_application_sent_none_with() {
    let pacer = pacer();
    let config = PaceConfig::default();
    let injecting = Credentials::new([&http::header::AUTHORIZATION]);
    let headers = with_credential("Bearer injected");
    let (ticket, _) = pacer.admit(&config, &headers, &injecting, Asked::default(), None);
    pacer.observe(&config, &ticket.going(), 200, &exhausted(), None);
    let soon = Some(Instant::now() + Duration::from_secs(1));
    assert!(
        matches!(
            pacer
                .admit(&config, &headers, &injecting, Asked::default(), soon)
                .1,
            Pass::Refuse(_)
        ),
        "the injected credential's key is exhausted"
    );
}

/// Every request's admission returns a ticket and a pass, pacing on or off: within 128 bytes
/// they come back in registers rather than through a `memcpy` call.
#[test]
fn an_admission_returns_in_registers() {
    let size = std::mem::size_of::<(super::Ticket, super::Pass)>();
    assert!(size <= 128, "(Ticket, Pass) grew to {size} bytes");
}
