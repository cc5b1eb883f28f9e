//! The status page's server-side render: its size, that it loads nothing from elsewhere, that
//! hostile names stay text, and that the numbers land in the attributes the browser test reads.

use std::sync::Arc;

use super::*;
use crate::clients::{Clients, Process, Source};
use crate::llm::ledger::Counts;
use crate::pace::KeyReport;
use crate::pool::ConnectionReport;

const HOSTILE: &str = "<script>alert(1)</script><img src=x onerror=alert(2)>\"'&";

fn connection(id: u64, state: &'static str) -> ConnectionReport {
    ConnectionReport {
        id,
        protocol: Some("http1"),
        state,
        age_seconds: 1.0,
        idle_seconds: None,
        requests: 1,
        streams_in_use: None,
        stream_limit: None,
        closing_reason: None,
        endpoint: Some("127.0.0.1:80".into()),
    }
}

fn pool(upstream: &str) -> PoolReport {
    PoolReport {
        upstream: upstream.into(),
        protocol: Some("http1"),
        retired: None,
        max_connections: 2,
        max_idle: 2,
        max_streams_per_connection: 100,
        open: 2,
        pending: 3,
        opened_total: 5,
        reused_total: 7,
        learned_idle_timeout_ms: Some(4000),
        learned_retire_after_ms: Some(3500),
        idle_close_observations: 3,
        connections: vec![connection(1, "idle"), connection(2, "active")],
        endpoints: vec![EndpointReport {
            address: upstream.into(),
            state: "ejected",
            open: 2,
            idle: 1,
            consecutive_failures: 5,
            ejections: 1,
            ejected_until: None,
            ejected_for_ms: Some(1500),
        }],
        dns: None,
        via: Some(upstream.into()),
    }
}

fn usage(app: &str) -> ledger::Report {
    let row = Row {
        upstream: "openai".into(),
        app: app.into(),
        model: app.into(),
        counts: Counts {
            requests: 2,
            input_tokens: 30,
            output_tokens: 12,
            ..Counts::default()
        },
    };
    ledger::Report {
        since_start: vec![row.clone()],
        last_60s: vec![row],
    }
}

/// A leaking Unix-socket source whose executable is `exe`.
fn leaking(exe: &str) -> Vec<ClientReport> {
    let clients = Clients::new();
    let source = Source::Unix(Arc::new(Process {
        pid: Some(42),
        uid: 1000,
        start_time: Some(1),
        exe: Some(exe.into()),
    }));
    for _ in 0..150 {
        clients.opened(&source);
        clients.closed(&source, 1, true);
    }
    clients.report()
}

fn rendered(name: &str) -> String {
    let sidecar = SidecarReport {
        version: "1.2.3",
        uptime_seconds: 3725,
        resident_bytes: Some(8 << 20),
    };
    let pace = vec![PaceReport {
        upstream: name.into(),
        keys: vec![KeyReport {
            key: "0badc0de".into(),
            remaining_requests: Some(9),
            remaining_tokens: None,
            reset_ms: Some(250),
            closed: true,
            waiters: 4,
        }],
    }];
    let clients = leaking(name);
    let usage = usage(name);
    page(&View {
        sidecar: &sidecar,
        pools: &[pool(name)],
        pace: &pace,
        budget: None,
        clients: &clients,
        usage: &usage,
    })
}

#[test]
fn the_page_is_one_small_file_that_loads_nothing_from_elsewhere() {
    assert!(
        TEMPLATE.len() < 30 * 1024,
        "status.html is {} bytes: keep it under 30 KiB",
        TEMPLATE.len()
    );
    assert_eq!(TEMPLATE.matches(SLOT).count(), 1);
    for outside in ["http:", "https:", "src=", "href=", "@import", "url(", "//cdn"] {
        assert!(!TEMPLATE.contains(outside), "status.html names {outside:?}");
    }
    // The constants the script shares with this module.
    assert!(TEMPLATE.contains(&format!("OTHER_SOURCES_SHOWN = {OTHER_SOURCES_SHOWN},")));
    assert!(TEMPLATE.contains(&format!("TOKEN_ROWS_SHOWN = {TOKEN_ROWS_SHOWN};")));
}

/// Every `<` in `html` opens or closes one of the page's own elements.
fn tags_are_only_the_pages_own(html: &str) {
    const OWN: [&str; 15] = [
        "section", "h2", "h3", "table", "thead", "tbody", "tr", "th", "td", "div", "b", "span", "p",
        "article", "meter",
    ];
    let main = &html[html.find("<main id=\"status\">").unwrap()..html.find("</main>").unwrap()];
    for (at, _) in main.match_indices('<').skip(1) {
        let rest = &main[at + 1..];
        let rest = rest.strip_prefix('/').unwrap_or(rest);
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
        assert!(
            OWN.contains(&name.as_str()),
            "an element of the data's making: {}",
            &main[at..(at + 40).min(main.len())]
        );
    }
}

#[test]
fn names_from_outside_stay_text() {
    let html = rendered(HOSTILE);
    tags_are_only_the_pages_own(&html);
    let escaped = "&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;&quot;&#39;&amp;";
    // Upstream (heading, attribute, endpoint, via, pace), source and exe, app and model.
    assert!(html.matches(escaped).count() >= 10, "{html}");
    assert!(!html.contains("<img"));
    assert!(!html.contains("<script>alert"));
    // A benign name renders as itself, in attributes too.
    let html = rendered("api.example");
    tags_are_only_the_pages_own(&html);
    assert!(html.contains("data-upstream=\"api.example\""));
}

#[test]
fn the_numbers_land_in_the_attributes_and_the_text() {
    let html = rendered("up");
    assert!(
        html.contains(
            "<article class=\"pool\" data-upstream=\"up\" data-open=\"2\" data-idle=\"1\" \
             data-waiting=\"3\" data-reused=\"7\">"
        ),
        "{html}"
    );
    for shown in [
        "<b>2</b><span>open of 2</span>",
        "<b>1</b><span>idle</span>",
        "<div class=\"warn\"><b>3</b><span>waiting</span>",
        "<b>7</b><span>reused</span>",
        "learned idle timeout: <b>4.0 s</b>, idle connections retired after 3.5 s",
        "<span class=\"tag bad\">ejected</span> for 1.5 s",
        "<td class=\"n\">9</td><td class=\"n\">–</td><td class=\"n\">250 ms</td>",
        "<span class=\"tag bad\">closed</span></td><td class=\"n\">4</td>",
        "data-field=\"version\">1.2.3<",
        "data-seconds=\"3725\">1h 2m<",
        "8.0 MiB resident; no memory budget",
        "data-count=\"1\" class=\"bad\">1 flagged",
        "data-leaking=\"true\" class=\"leaking\">",
        "<span class=\"tag bad\">leaking</span>",
        "data-input=\"30\" data-output=\"12\"",
    ] {
        assert!(html.contains(shown), "no {shown:?} in {html}");
    }
}

#[test]
fn a_budget_shows_usage_against_it() {
    let sidecar = SidecarReport {
        version: "1",
        uptime_seconds: 59,
        resident_bytes: None,
    };
    let budget = BudgetReport {
        budget_bytes: 100 << 20,
        source: "memory_bytes".into(),
        usage_bytes: 25 << 20,
        usage_measure: "rss_and_sockets",
        accept_paused: true,
        shed_downstream_idle: 1,
        shed_upstream_idle: 2,
        shed_accept_paused: 3,
    };
    let html = render(&View {
        sidecar: &sidecar,
        pools: &[],
        pace: &[],
        budget: Some(&budget),
        clients: &[],
        usage: &ledger::Report {
            since_start: vec![],
            last_60s: vec![],
        },
    });
    for shown in [
        ">59s<",
        "25.0 MiB of 100.0 MiB budget (25%)",
        "<span class=\"tag bad\">accepting paused</span>",
        "downstream idle 1, upstream idle 2, accept paused 3",
        "No pool yet",
        "No application connection yet",
        "No LLM answer counted yet",
    ] {
        assert!(html.contains(shown), "no {shown:?} in {html}");
    }
}

#[test]
fn durations_read_as_an_operator_says_them() {
    assert_eq!(uptime(0), "0s");
    assert_eq!(uptime(61), "1m 1s");
    assert_eq!(uptime(3600), "1h 0m");
    assert_eq!(uptime(90_061), "1d 1h");
    assert_eq!(millis(999), "999 ms");
    assert_eq!(millis(1250), "1.2 s");
    assert_eq!(millis(1999), "1.9 s");
    assert_eq!(mib(1_572_864), "1.5 MiB");
    assert_eq!(fixed2(1.125), "1.13");
    assert_eq!(fixed2(1.0), "1.00");
}
