//! The status page (`GET /` on the admin listener): one HTML file compiled in (`status.html`),
//! with the numbers of the moment rendered into it here, so that it reads without JavaScript.
//! Its script renders the same markup again every 2 s from `/debug/pools`, `/debug/clients`
//! and `/debug/usage`; [`render`] and the script's `render` build the same elements with the
//! same `data-*` attributes from the same fields, one in Rust and one in JavaScript
//! (`tests/status_page.rs` holds them to it in Chromium, branch by branch).
//!
//! Every value that is shown is HTML-escaped: upstream names, endpoint addresses, executable
//! paths, app and model names come from outside (a config, a process table, request headers,
//! an upstream's answers).
//!
//! Not here: collecting the reports (`admin`), what they mean (their own modules).

use std::fmt::Write;

use serde::Serialize;

use crate::budget::BudgetReport;
use crate::clients::ClientReport;
use crate::endpoint::EndpointReport;
use crate::llm::ledger::{self, Row};
use crate::pace::PaceReport;
use crate::pool::PoolReport;

/// The page, with `<!--status-->` where the rendered numbers go.
const TEMPLATE: &str = include_str!("status.html");

/// Where [`render`]'s markup goes in the template.
const SLOT: &str = "<!--status-->";

/// Sources that are not flagged shown at most (busiest first); flagged ones are all shown.
pub const OTHER_SOURCES_SHOWN: usize = 10;

/// Token rows shown at most (the ledger names up to 64 apps times 256 models).
pub const TOKEN_ROWS_SHOWN: usize = 100;

/// The sidecar itself, as `/debug/pools` shows it under `sidecar`.
#[derive(Debug, Clone, Serialize)]
pub struct SidecarReport {
    /// The crate's version.
    pub version: &'static str,
    /// Whole seconds since the admin listener started serving (when `app::run` started).
    pub uptime_seconds: u64,
    /// The process's resident memory, when `/proc` shows it: what a sidecar without a
    /// memory budget shows as its memory.
    pub resident_bytes: Option<u64>,
}

/// What the page shows: the reports of the three JSON endpoints.
#[derive(Debug)]
pub struct View<'a> {
    /// `/debug/pools`' `sidecar`.
    pub sidecar: &'a SidecarReport,
    /// `/debug/pools`' `pools`.
    pub pools: &'a [PoolReport],
    /// `/debug/pools`' `pace`.
    pub pace: &'a [PaceReport],
    /// `/debug/pools`' `budget`.
    pub budget: Option<&'a BudgetReport>,
    /// `/debug/clients`.
    pub clients: &'a [ClientReport],
    /// `/debug/usage`.
    pub usage: &'a ledger::Report,
}

/// The whole page with `view`'s numbers in it.
pub fn page(view: &View<'_>) -> String {
    TEMPLATE.replacen(SLOT, &render(view), 1)
}

/// The markup inside `<main id="status">`: what the script's `render` makes from the JSON.
pub fn render(view: &View<'_>) -> String {
    let mut out = String::with_capacity(8 * 1024);
    sidecar(&mut out, view.sidecar, view.budget);
    pools(&mut out, view.pools, view.pace);
    clients(&mut out, view.clients);
    tokens(&mut out, view.usage);
    out
}

fn sidecar(out: &mut String, sidecar: &SidecarReport, budget: Option<&BudgetReport>) {
    let _ = write!(
        out,
        "<section id=\"sidecar\"><h2>Sidecar</h2><table class=\"kv\">\
         <tr><th>version</th><td data-field=\"version\">{}</td></tr>\
         <tr><th>uptime</th><td data-field=\"uptime\" data-seconds=\"{}\">{}</td></tr>",
        esc(sidecar.version),
        sidecar.uptime_seconds,
        uptime(sidecar.uptime_seconds)
    );
    match budget {
        Some(b) => {
            let pct = percent(b.usage_bytes, b.budget_bytes);
            let _ = write!(
                out,
                "<tr><th>memory</th><td data-field=\"memory\" data-usage-bytes=\"{}\" \
                 data-budget-bytes=\"{}\">{} of {} budget ({pct}%) \
                 <meter min=\"0\" max=\"{}\" high=\"{}\" value=\"{}\"></meter> \
                 <span class=\"tag\">{}</span>{}</td></tr>\
                 <tr><th>memory sheds</th><td>downstream idle {}, upstream idle {}, accept paused {}</td></tr>",
                b.usage_bytes,
                b.budget_bytes,
                mib(b.usage_bytes),
                mib(b.budget_bytes),
                b.budget_bytes,
                b.budget_bytes / 10 * 9,
                b.usage_bytes,
                esc(b.usage_measure),
                if b.accept_paused {
                    " <span class=\"tag bad\">accepting paused</span>"
                } else {
                    ""
                },
                b.shed_downstream_idle,
                b.shed_upstream_idle,
                b.shed_accept_paused,
            );
        }
        None => {
            let resident = sidecar.resident_bytes.map_or_else(|| "unknown".to_owned(), mib);
            let _ = write!(
                out,
                "<tr><th>memory</th><td data-field=\"memory\">{resident} resident; no memory budget</td></tr>"
            );
        }
    }
    out.push_str("</table></section>");
}

fn pools(out: &mut String, pools: &[PoolReport], pace: &[PaceReport]) {
    out.push_str("<section id=\"pools\"><h2>Pools</h2>");
    if pools.is_empty() {
        out.push_str("<p class=\"muted\">No pool yet: none is made before its first request.</p>");
    }
    out.push_str("<div class=\"pools\">");
    for pool in pools {
        let idle = idle(pool);
        let _ = write!(
            out,
            "<article class=\"pool\" data-upstream=\"{}\" data-open=\"{}\" data-idle=\"{idle}\" \
             data-waiting=\"{}\" data-reused=\"{}\"><h3>{} <span class=\"tag\">{}</span>{}</h3>\
             <div class=\"stats\"><div><b>{}</b><span>open of {}</span></div>\
             <div><b>{idle}</b><span>idle</span></div>\
             <div{}><b>{}</b><span>waiting</span></div>\
             <div><b>{}</b><span>reused</span></div>\
             <div><b>{}</b><span>opened</span></div></div>",
            esc(&pool.upstream),
            pool.open,
            pool.pending,
            pool.reused_total,
            esc(&pool.upstream),
            esc(pool.protocol.unwrap_or("protocol not known yet")),
            pool.retired
                .map(|r| format!(" <span class=\"tag warn\">retired: {}</span>", esc(r)))
                .unwrap_or_default(),
            pool.open,
            pool.max_connections,
            if pool.pending > 0 { " class=\"warn\"" } else { "" },
            pool.pending,
            pool.reused_total,
            pool.opened_total,
        );
        let learned = match pool.learned_idle_timeout_ms {
            Some(ms) => format!(
                "<b>{}</b>{}",
                millis(ms),
                pool.learned_retire_after_ms
                    .map(|r| format!(", idle connections retired after {}", millis(r)))
                    .unwrap_or_default()
            ),
            None => format!("none ({} idle closes observed)", pool.idle_close_observations),
        };
        let _ = write!(out, "<p>learned idle timeout: {learned}");
        if let Some(via) = &pool.via {
            let _ = write!(out, "; via {}", esc(via));
        }
        if let Some(dns) = &pool.dns {
            let _ = write!(
                out,
                "; DNS {}: {} refreshes, {} failures",
                esc(&dns.host),
                dns.refreshes,
                dns.failures
            );
        }
        out.push_str("</p>");
        endpoints(out, &pool.endpoints);
        pacing(out, pace.iter().find(|p| p.upstream == pool.upstream));
        out.push_str("</article>");
    }
    out.push_str("</div></section>");
}

/// Connections with no request on them: idle HTTP/1.1 ones and HTTP/2 ones with no stream.
fn idle(pool: &PoolReport) -> usize {
    pool.connections.iter().filter(|c| c.state == "idle").count()
}

fn endpoints(out: &mut String, endpoints: &[EndpointReport]) {
    if endpoints.is_empty() {
        return;
    }
    out.push_str(
        "<table class=\"endpoints\"><thead><tr><th>endpoint</th><th>state</th>\
         <th class=\"n\">open</th><th class=\"n\">idle</th><th class=\"n\">failures</th>\
         <th class=\"n\">ejections</th></tr></thead><tbody>",
    );
    for e in endpoints {
        let class = match e.state {
            "active" => "ok",
            "ejected" => "bad",
            _ => "warn",
        };
        let _ = write!(
            out,
            "<tr data-endpoint=\"{}\" data-state=\"{}\"><td>{}</td>\
             <td><span class=\"tag {class}\">{}</span>{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(&e.address),
            esc(e.state),
            esc(&e.address),
            esc(e.state),
            e.ejected_for_ms
                .map(|ms| format!(" for {}", millis(ms)))
                .unwrap_or_default(),
            e.open,
            e.idle,
            e.consecutive_failures,
            e.ejections,
        );
    }
    out.push_str("</tbody></table>");
}

fn pacing(out: &mut String, pace: Option<&PaceReport>) {
    let Some(pace) = pace.filter(|p| !p.keys.is_empty()) else {
        out.push_str("<p class=\"pace muted\">pacing: no rate-limit key seen</p>");
        return;
    };
    out.push_str(
        "<table class=\"pace\"><thead><tr><th>pace key</th><th class=\"n\">requests left</th>\
         <th class=\"n\">tokens left</th><th class=\"n\">reset in</th><th>state</th>\
         <th class=\"n\">waiting</th></tr></thead><tbody>",
    );
    for k in &pace.keys {
        let _ = write!(
            out,
            "<tr data-key=\"{}\" data-closed=\"{}\"><td>{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td class=\"n\">{}</td></tr>",
            esc(&k.key),
            k.closed,
            esc(&k.key),
            k.remaining_requests.map_or_else(dash, |n| n.to_string()),
            k.remaining_tokens.map_or_else(dash, |n| n.to_string()),
            k.reset_ms.map_or_else(dash, millis),
            if k.closed {
                "<span class=\"tag bad\">closed</span>"
            } else {
                "<span class=\"tag ok\">open</span>"
            },
            k.waiters,
        );
    }
    out.push_str("</tbody></table>");
}

fn clients(out: &mut String, clients: &[ClientReport]) {
    let flagged = clients.iter().filter(|c| c.leaking).count();
    let _ = write!(
        out,
        "<section id=\"clients\"><h2>Application sources</h2><p data-field=\"flagged\" \
         data-count=\"{flagged}\"{}>{flagged} flagged by the leak detector (at least 100 \
         connections in 60 s at under 1.5 requests each)</p>",
        if flagged > 0 { " class=\"bad\"" } else { "" }
    );
    if clients.is_empty() {
        out.push_str("<p class=\"muted\">No application connection yet.</p></section>");
        return;
    }
    out.push_str(
        "<table><thead><tr><th>source</th><th>process</th><th class=\"n\">connections</th>\
         <th class=\"n\">requests</th><th class=\"n\">per connection</th>\
         <th class=\"n\">60 s: connections</th><th class=\"n\">60 s: per connection</th>\
         <th class=\"n\">idle closes</th><th>leak</th></tr></thead><tbody>",
    );
    let shown = clients
        .iter()
        .filter(|c| c.leaking)
        .chain(clients.iter().filter(|c| !c.leaking).take(OTHER_SOURCES_SHOWN));
    for c in shown {
        let _ = write!(
            out,
            "<tr data-source=\"{}\" data-leaking=\"{}\"{}><td>{}</td><td class=\"process\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td></tr>",
            esc(&c.source),
            c.leaking,
            if c.leaking { " class=\"leaking\"" } else { "" },
            esc(&c.source),
            processes(c),
            c.connections_opened,
            c.requests,
            fixed2(c.requests_per_connection),
            c.window_connections_opened,
            fixed2(c.window_requests_per_connection),
            c.idle_closes,
            if c.leaking {
                "<span class=\"tag bad\">leaking</span>"
            } else {
                "<span class=\"tag ok\">no</span>"
            },
        );
    }
    out.push_str("</tbody></table>");
    let hidden = clients.len() - flagged - (clients.len() - flagged).min(OTHER_SOURCES_SHOWN);
    if hidden > 0 {
        let _ = write!(
            out,
            "<p class=\"muted\">{hidden} more sources in /debug/clients</p>"
        );
    }
    out.push_str("</section>");
}

/// What a source's process cell shows: the executable of a Unix-socket source, the processes
/// holding a flagged loopback source's connections, or why there are none.
fn processes(c: &ClientReport) -> String {
    if let Some(exe) = &c.exe {
        return esc(exe);
    }
    let mut cell = String::new();
    for (i, p) in c.processes.iter().flatten().enumerate() {
        let _ = write!(
            cell,
            "{}pid {} {} ({} open)",
            if i > 0 { ", " } else { "" },
            p.pid,
            esc(p.exe.as_deref().unwrap_or("?")),
            p.connections
        );
    }
    if let Some(note) = &c.processes_note {
        let _ = write!(cell, "<span class=\"muted\">{}</span>", esc(note));
    }
    cell
}

fn tokens(out: &mut String, usage: &ledger::Report) {
    out.push_str("<section id=\"tokens\"><h2>Tokens by app and model</h2>");
    if usage.since_start.is_empty() {
        out.push_str("<p class=\"muted\">No LLM answer counted yet.</p></section>");
        return;
    }
    out.push_str(
        "<table><thead><tr><th>upstream</th><th>app</th><th>model</th>\
         <th class=\"n\">requests</th><th class=\"n\">input</th><th class=\"n\">output</th>\
         <th class=\"n\">cache read</th><th class=\"n\">reasoning</th>\
         <th class=\"n\">60 s: input</th><th class=\"n\">60 s: output</th></tr></thead><tbody>",
    );
    for row in usage.since_start.iter().take(TOKEN_ROWS_SHOWN) {
        let recent = usage.last_60s.iter().find(|r| same_row(r, row));
        let c = &row.counts;
        let _ = write!(
            out,
            "<tr data-upstream=\"{}\" data-app=\"{}\" data-model=\"{}\" data-input=\"{}\" \
             data-output=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td></tr>",
            esc(&row.upstream),
            esc(&row.app),
            esc(&row.model),
            c.input_tokens,
            c.output_tokens,
            esc(&row.upstream),
            esc(&row.app),
            esc(&row.model),
            c.requests,
            c.input_tokens,
            c.output_tokens,
            c.cache_read_tokens,
            c.reasoning_tokens,
            recent.map_or(0, |r| r.counts.input_tokens),
            recent.map_or(0, |r| r.counts.output_tokens),
        );
    }
    out.push_str("</tbody></table>");
    if usage.since_start.len() > TOKEN_ROWS_SHOWN {
        let _ = write!(
            out,
            "<p class=\"muted\">{} more rows in /debug/usage</p>",
            usage.since_start.len() - TOKEN_ROWS_SHOWN
        );
    }
    out.push_str("</section>");
}

fn same_row(a: &Row, b: &Row) -> bool {
    a.upstream == b.upstream && a.app == b.app && a.model == b.model
}

// === formatting, as the script's helpers of the same names ===

/// `text` safe in element content and in a quoted attribute.
pub fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn dash() -> String {
    "–".to_owned()
}

fn uptime(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match secs {
        0..60 => format!("{s}s"),
        60..3600 => format!("{m}m {s}s"),
        3600..86_400 => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

// Decimals are cut (tenths) or rounded (hundredths) by integer arithmetic, as in the script:
// Rust's `{:.1}` and JavaScript's `toFixed` break ties differently.

fn millis(ms: u64) -> String {
    if ms < 1000 {
        format!("{ms} ms")
    } else {
        let tenths = ms / 100;
        format!("{}.{} s", tenths / 10, tenths % 10)
    }
}

fn mib(bytes: u64) -> String {
    let tenths = bytes.saturating_mul(10) / (1024 * 1024);
    format!("{}.{} MiB", tenths / 10, tenths % 10)
}

fn fixed2(x: f64) -> String {
    let hundredths = (x * 100.0).round() as u64;
    format!("{}.{:02}", hundredths / 100, hundredths % 100)
}

fn percent(part: u64, whole: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    (part as f64 * 100.0 / whole as f64).round() as u64
}

#[cfg(test)]
mod tests;
