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
            Ok(crate::quota::Granted::default())
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
