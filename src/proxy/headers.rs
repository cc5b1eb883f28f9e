//! Header rewriting between downstream and upstream (RFC 9110 §7.6, RFC 9112 §3.2).
//!
//! Towards the upstream: the request target becomes origin-form, `Host` becomes the upstream's
//! authority, and hop-by-hop fields go: `Connection` and every field it names,
//! `Proxy-Connection`, `Keep-Alive`, `Transfer-Encoding` (the body is re-framed), `Upgrade`,
//! `TE` (except `trailers`), `Proxy-Authorization` (meant for us), and `Expect` (the sidecar
//! answers `100-continue` itself). `Trailer` is end-to-end and stays.
//!
//! Towards the application: the same hop-by-hop set plus `Proxy-Authenticate`.
//!
//! Upgrades passed through (`proxy::upgrade`) are the exception: the request keeps `Upgrade`
//! and goes with `Connection: upgrade`, and a `101` keeps the upstream's `Upgrade` and goes
//! with `Connection: upgrade`; every other hop-by-hop field is still removed.
//!
//! The sidecar's own request headers, `x-egress-timeout`, `x-egress-retry`,
//! `x-egress-pace-key`, `x-egress-priority` and `x-egress-app`, are read and removed before
//! anything is forwarded ([`take_asked`]).
//!
//! `Max-Forwards` on OPTIONS and TRACE is decremented, and at 0 the sidecar answers itself
//! ([`take_hop`], [`last_hop_answer`]).
//!
//! Credentials (`Authorization`, `Proxy-Authorization`, `Cookie`) are marked sensitive as they
//! are read ([`crate::wire::is_credential`]): their `Debug` form is `Sensitive`, so no log line at any level
//! carries them, and HPACK never indexes them on HTTP/2 (RFC 7541 §7.1.3).
//!
//! No `Via` or `X-Forwarded-*` is added: egress requests leave the cluster, where they would
//! leak internal addresses, and a `Via` header turns off compression on many servers (nginx's
//! `gzip_proxied off` default).

use std::sync::LazyLock;

use bytes::Bytes;
use http::header::{
    ALLOW, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, EXPECT, HOST, MAX_FORWARDS, PROXY_AUTHENTICATE,
    PROXY_AUTHORIZATION, TE, TRANSFER_ENCODING, UPGRADE,
};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri, Version};

use crate::redact;
use crate::upstream::Asked;
use crate::wire::names::KEEP_ALIVE;
use crate::wire::{is_credential, HeadLines};

const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Removed in both directions.
const HOP_BY_HOP: [HeaderName; 6] = [
    CONNECTION,
    PROXY_CONNECTION,
    KEEP_ALIVE,
    TRANSFER_ENCODING,
    UPGRADE,
    TE,
];
/// `Upgrade`'s bit in what [`Strip::present`] finds.
const UPGRADE_PRESENT: u16 = 1 << 4;
/// `TE`'s bit in what [`Strip::present`] finds.
const TE_PRESENT: u16 = 1 << 5;

/// Removed from requests, with the hop-by-hop set.
static TO_UPSTREAM: LazyLock<Strip> = LazyLock::new(|| Strip::with(&[PROXY_AUTHORIZATION, EXPECT]));
/// Removed from responses, with the hop-by-hop set.
static TO_DOWNSTREAM: LazyLock<Strip> = LazyLock::new(|| Strip::with(&[PROXY_AUTHENTICATE]));

/// What one pass over a request's field names found: which fields [`to_upstream`] removes,
/// whether the sidecar's own `x-egress-*` fields are there, and whether a credential field
/// pacing keys on is. The steps that follow skip what is not: a lookup of `Upgrade` and a
/// second walk for `x-egress-` cost 120 instructions per request between them, the three
/// credential lookups 360 (callgrind).
#[derive(Debug, Clone, Copy)]
pub struct Scanned {
    strip: u16,
    egress: bool,
    credential: bool,
}

impl Scanned {
    /// An `Upgrade` field is present (the request may ask for a switch of protocols).
    pub fn upgrade(&self) -> bool {
        self.strip & UPGRADE_PRESENT != 0
    }
}

/// Reads `headers`' names once, for [`take_asked`] and [`to_upstream_scanned`]; what they
/// remove or add later is no field it looks for.
pub fn scan(headers: &HeaderMap) -> Scanned {
    let (strip, egress, credential) = TO_UPSTREAM.present(headers);
    Scanned {
        strip,
        egress,
        credential,
    }
}

/// Takes `x-egress-timeout` (a duration: `30s`, `1500ms`; `0s` turns the upstream's
/// `request_timeout` off), `x-egress-retry` (`off`, or `on` for the upstream's policy),
/// `x-egress-pace-key` (any value), `x-egress-priority` (`high`, `normal`, `low`) and
/// `x-egress-app` (any value) out of the request, which `scanned` read. An invalid value is an
/// error naming the header.
pub fn take_asked(req: &mut Request<impl Sized>, scanned: Scanned) -> Result<Asked, String> {
    let headers = req.headers_mut();
    let mut asked = Asked::default();
    asked.pace.credential = scanned.credential;
    if !scanned.egress {
        return Ok(asked);
    }
    if let Some(text) = take_one(headers, X_EGRESS_TIMEOUT)? {
        asked.timeout =
            Some(crate::duration::human(&text).map_err(|e| format!("x-egress-timeout: {text:?} {e}"))?);
    }
    if let Some(value) = take_value(headers, X_EGRESS_PACE_KEY)? {
        asked.pace.tag = Some(crate::pace::Asked::tag(value.as_bytes()));
    }
    if let Some(text) = take_one(headers, X_EGRESS_PRIORITY)? {
        asked.pace.priority = crate::pace::Priority::parse(&text)
            .ok_or_else(|| format!("x-egress-priority: {text:?} is not high, normal or low"))?;
    }
    asked.app = take_value(headers, X_EGRESS_APP)?;
    if let Some(text) = take_one(headers, X_EGRESS_RETRY)? {
        asked.no_retry = if text.eq_ignore_ascii_case("off") {
            true
        } else if text.eq_ignore_ascii_case("on") {
            false
        } else {
            return Err(format!("x-egress-retry: {text:?} is not off or on"));
        };
    }
    Ok(asked)
}

/// Removes `name`, returning its one value, trimmed; more than one is an error.
fn take_one(headers: &mut HeaderMap, name: HeaderName) -> Result<Option<String>, String> {
    let value = take_value(headers, name)?;
    Ok(value.map(|value| value.to_str().unwrap_or("\u{fffd}").trim().to_owned()))
}

/// Removes `name`, returning its one value as sent; more than one is an error.
fn take_value(headers: &mut HeaderMap, name: HeaderName) -> Result<Option<HeaderValue>, String> {
    let mut values = headers.get_all(&name).iter();
    if values.next().is_none() {
        return Ok(None);
    }
    if values.next().is_some() {
        return Err(format!("{name} appears more than once"));
    }
    Ok(headers.remove(&name))
}

const X_EGRESS_TIMEOUT: HeaderName = HeaderName::from_static("x-egress-timeout");
const X_EGRESS_RETRY: HeaderName = HeaderName::from_static("x-egress-retry");
const X_EGRESS_PACE_KEY: HeaderName = HeaderName::from_static("x-egress-pace-key");
const X_EGRESS_PRIORITY: HeaderName = HeaderName::from_static("x-egress-priority");
const X_EGRESS_APP: HeaderName = HeaderName::from_static("x-egress-app");

/// `Max-Forwards` on OPTIONS and TRACE (RFC 9110 §7.6.2): `Ok(true)` when it is 0 and the
/// sidecar must answer as the final recipient, else the value is decremented for the next hop.
/// Other methods ignore the field, as the RFC says.
pub fn take_hop(req: &mut Request<impl Sized>) -> Result<bool, String> {
    if req.method() != Method::OPTIONS && req.method() != Method::TRACE {
        return Ok(false);
    }
    let mut values = req.headers().get_all(MAX_FORWARDS).iter();
    let Some(value) = values.next() else {
        return Ok(false);
    };
    let hops = (values.next().is_none())
        .then(|| value.to_str().ok()?.parse::<u32>().ok())
        .flatten()
        .ok_or_else(|| format!("invalid Max-Forwards {value:?}"))?;
    if hops == 0 {
        return Ok(true);
    }
    req.headers_mut()
        .insert(MAX_FORWARDS, HeaderValue::from(hops - 1));
    Ok(false)
}

/// The sidecar's own answer to OPTIONS or TRACE with `Max-Forwards: 0`: OPTIONS gets the methods
/// the sidecar forwards; TRACE gets the request head back as `message/http` (§9.3.8), without
/// credential fields.
pub fn last_hop_answer<B>(req: &Request<B>) -> Response<Bytes> {
    let mut resp = Response::new(Bytes::new());
    if req.method() == Method::TRACE {
        let target = redact::uri(req.uri());
        let mut echo = format!("{} {target} {:?}\r\n", req.method(), req.version()).into_bytes();
        for (name, value) in req.headers().iter().filter(|(n, _)| !is_credential(n)) {
            echo.extend_from_slice(name.as_str().as_bytes());
            echo.extend_from_slice(b": ");
            echo.extend_from_slice(value.as_bytes());
            echo.extend_from_slice(b"\r\n");
        }
        echo.extend_from_slice(b"\r\n");
        resp.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("message/http"));
        *resp.body_mut() = Bytes::from(echo);
    } else {
        resp.headers_mut().insert(
            ALLOW,
            HeaderValue::from_static("GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE, CONNECT"),
        );
    }
    let length = HeaderValue::from(resp.body().len());
    resp.headers_mut().insert(CONTENT_LENGTH, length);
    resp
}

/// Rewrites a downstream request for the upstream named by `host`.
pub fn to_upstream<B>(req: &mut Request<B>, host: &HeaderValue) {
    let scanned = scan(req.headers());
    to_upstream_scanned(req, &mut HeadLines::default(), host, scanned);
}

/// [`to_upstream`] for a request whose names [`scan`] read, its fields in its map or in
/// `lines`, which hold none that is removed here.
pub fn to_upstream_scanned<B>(
    req: &mut Request<B>,
    lines: &mut HeadLines,
    host: &HeaderValue,
    scanned: Scanned,
) {
    if req.uri().scheme().is_some() {
        let mut origin_form = http::uri::Parts::default();
        origin_form.path_and_query = Some(
            req.uri()
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        );
        *req.uri_mut() = Uri::from_parts(origin_form).unwrap_or_else(|_| Uri::from_static("/"));
    }
    let headers = req.headers_mut();
    let present = scanned.strip;
    let wants_trailers = present & TE_PRESENT != 0
        && headers.get_all(TE).iter().any(|v| {
            v.to_str()
                .unwrap_or("")
                .split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
        });
    TO_UPSTREAM.remove(headers, present);
    if wants_trailers {
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
    if !lines.set_upstream_host(host) {
        headers.insert(HOST, host.clone());
    }
    *req.version_mut() = Version::HTTP_11;
}

/// Like [`to_upstream`] for an upgrade passed through: `Upgrade` stays and `Connection` is
/// `upgrade` alone (fields it named are hop-by-hop and go). Cold: out of the request path.
#[cold]
pub fn to_upstream_upgrade<B>(req: &mut Request<B>, host: &HeaderValue) {
    let protocols: Vec<HeaderValue> = req.headers().get_all(UPGRADE).iter().cloned().collect();
    to_upstream(req, host);
    keep_upgrade(req.headers_mut(), protocols);
}

/// Like [`to_downstream`] for a `101 Switching Protocols`: `Upgrade` stays and `Connection` is
/// `upgrade`.
pub fn to_downstream_switch<B>(resp: &mut Response<B>) {
    let protocols: Vec<HeaderValue> = resp.headers().get_all(UPGRADE).iter().cloned().collect();
    to_downstream(resp);
    keep_upgrade(resp.headers_mut(), protocols);
}

fn keep_upgrade(headers: &mut HeaderMap, protocols: Vec<HeaderValue>) {
    for value in protocols {
        headers.append(UPGRADE, value);
    }
    headers.insert(CONNECTION, HeaderValue::from_static("upgrade"));
}

/// Rewrites an upstream response for the application.
pub fn to_downstream<B>(resp: &mut Response<B>) {
    let headers = resp.headers_mut();
    let (present, ..) = TO_DOWNSTREAM.present(headers);
    TO_DOWNSTREAM.remove(headers, present);
}

/// The fields to remove in one direction: `Connection` and the fields it names, the
/// hop-by-hop set, and that direction's own.
///
/// One pass over the names present finds which are there, without allocating: most messages
/// carry few of these, and a hash lookup per candidate name cost more than the rest of the
/// rewriting (callgrind).
struct Strip {
    /// The hop-by-hop set first (`Connection` at 0), then the direction's own; at most 16.
    names: Vec<HeaderName>,
    /// By a name's length (31: longer), bit i: the i-th name is that long. Most fields of a
    /// message (Date, Server, Content-Type, Content-Length...) differ in length from every
    /// name here and are passed over without comparing names; the others are compared with
    /// the one or two names of their length only (a scan of the list, each name's length
    /// checked, cost some 40 instructions a field as long as `Connection`, such as
    /// `User-Agent`). Worked out once: it cost a name lookup per candidate on every message.
    by_length: [u16; 32],
}

impl Strip {
    fn with(own: &[HeaderName]) -> Strip {
        let names: Vec<HeaderName> = HOP_BY_HOP.iter().chain(own).cloned().collect();
        assert!(names.len() <= 16, "one bit per name in a u16");
        let mut by_length = [0u16; 32];
        for (i, name) in names.iter().enumerate() {
            by_length[length_slot(name.as_str().len())] |= 1 << i;
        }
        Strip { names, by_length }
    }

    /// Bit i: the i-th name is in `headers`; whether some name starts with `x-egress-`; and
    /// whether one is a credential pacing keys on ([`crate::pace::CREDENTIALS`]).
    fn present(&self, headers: &HeaderMap) -> (u16, bool, bool) {
        let mut present = 0;
        let (mut egress, mut credential) = (false, false);
        for name in headers.keys() {
            let len = name.as_str().len();
            egress |= len >= 9 && name.as_str().starts_with("x-egress-");
            let slot = length_slot(len);
            if CREDENTIAL_LENGTHS & 1 << slot != 0 && crate::pace::CREDENTIALS.contains(name) {
                credential = true;
                continue;
            }
            // Only names of its length are compared (`User-Agent` is as long as `Connection`).
            let mut candidates = self.by_length[slot];
            while candidates != 0 {
                let i = candidates.trailing_zeros() as usize;
                if self.names[i] == name {
                    present |= 1 << i;
                    break;
                }
                candidates &= candidates - 1;
            }
        }
        (present, egress, credential)
    }

    /// Removes the names `present` found, and those `Connection` names. Inlined for the
    /// message that carries none (most).
    #[inline]
    fn remove(&self, headers: &mut HeaderMap, present: u16) {
        if present != 0 {
            self.remove_present(headers, present);
        }
    }

    #[inline(never)]
    fn remove_present(&self, headers: &mut HeaderMap, present: u16) {
        if present & 1 != 0 {
            debug_assert_eq!(self.names[0], CONNECTION);
            let named: Vec<HeaderName> = headers
                .get_all(CONNECTION)
                .iter()
                // Bytes, not `to_str`: one non-ASCII token must not hide the names beside it.
                .flat_map(|v| v.as_bytes().split(|b| *b == b','))
                .map(<[u8]>::trim_ascii)
                // The usual tokens: `close` names no field, `keep-alive` one removed anyway.
                .filter(|token| {
                    !token.eq_ignore_ascii_case(b"close") && !token.eq_ignore_ascii_case(b"keep-alive")
                })
                .filter_map(|token| HeaderName::from_bytes(token).ok())
                // A client must not be able to strip the fields that frame or route the message.
                .filter(|name| *name != HOST && *name != http::header::CONTENT_LENGTH)
                .collect();
            for name in named {
                headers.remove(name);
            }
        }
        // By the bits set, not over every name: most messages carry none of them, and the
        // loop over 7 or 8 names cost 13 instructions a name, each message (callgrind).
        let mut bits = present;
        while bits != 0 {
            headers.remove(&self.names[bits.trailing_zeros() as usize]);
            bits &= bits - 1;
        }
    }
}

/// The lengths of [`crate::pace::CREDENTIALS`]' names: others are not compared.
const CREDENTIAL_LENGTHS: u32 = 1 << 13 | 1 << 9 | 1 << 7;

/// The slot of a name `len` bytes long in [`Strip`]'s table and [`CREDENTIAL_LENGTHS`].
fn length_slot(len: usize) -> usize {
    len.min(31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `scan` finds is what `take_asked` and `upgrade::requested` used to look up.
    #[test]
    fn one_scan_finds_upgrade_and_the_sidecars_own_fields() {
        let request = |fields: &[(&str, &str)]| {
            let mut req = Request::new(());
            for (name, value) in fields {
                req.headers_mut().append(
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                );
            }
            req
        };
        let mut plain = request(&[("host", "a"), ("user-agent", "x"), ("x-egressive", "1")]);
        let scanned = scan(plain.headers());
        assert!(!scanned.upgrade() && !scanned.egress);
        let asked = take_asked(&mut plain, scanned).unwrap();
        assert!(asked.timeout.is_none() && !asked.no_retry);
        assert!(!asked.pace.credential);

        // Pacing's fields: read, removed, and a credential noted (its value is not read here).
        let mut paced = request(&[
            ("X-Api-Key", "k"),
            ("x-egress-pace-key", "gpt-4o"),
            ("x-egress-priority", "HIGH"),
            ("X-Egress-App", "billing-worker"),
        ]);
        let scanned = scan(paced.headers());
        let asked = take_asked(&mut paced, scanned).unwrap();
        assert_eq!(
            asked.app.as_ref().map(HeaderValue::as_bytes),
            Some(&b"billing-worker"[..])
        );
        assert!(asked.pace.credential);
        assert_eq!(asked.pace.tag, Some(crate::pace::Asked::tag(b"gpt-4o")));
        assert_eq!(asked.pace.priority, crate::pace::Priority::High);
        assert_eq!(paced.headers().len(), 1, "only the credential stays");
        let mut wrong = request(&[("x-egress-priority", "urgent")]);
        let scanned = scan(wrong.headers());
        let why = take_asked(&mut wrong, scanned).unwrap_err();
        assert!(why.contains("x-egress-priority"), "{why}");

        let mut asking = request(&[
            ("Upgrade", "websocket"),
            ("X-Egress-Timeout", "2s"),
            ("x-egress-retry", "off"),
        ]);
        let scanned = scan(asking.headers());
        assert!(scanned.upgrade() && scanned.egress);
        let asked = take_asked(&mut asking, scanned).unwrap();
        assert_eq!(asked.timeout, Some(std::time::Duration::from_secs(2)));
        assert!(asked.no_retry);
        assert!(!asking.headers().contains_key("x-egress-timeout"));
        assert!(
            asking.headers().contains_key(UPGRADE),
            "removed later, by to_upstream"
        );
    }

    /// Each name of a direction's set is found by its own bit, among fields of its length
    /// that are not it (`User-Agent` and `Connection`, `Expect` and `Accept`), and in any
    /// case; a field as long as none of them is passed over.
    #[test]
    fn each_name_is_found_by_its_bit_among_fields_of_its_length() {
        for strip in [&*TO_UPSTREAM, &*TO_DOWNSTREAM] {
            for (i, name) in strip.names.iter().enumerate() {
                let mut headers = HeaderMap::new();
                headers.insert("user-agent", HeaderValue::from_static("curl"));
                headers.insert("accept", HeaderValue::from_static("*/*"));
                headers.insert("x", HeaderValue::from_static("1"));
                let decoy = "z".repeat(name.as_str().len());
                headers.insert(
                    HeaderName::from_bytes(decoy.as_bytes()).unwrap(),
                    HeaderValue::from_static("1"),
                );
                assert_eq!(strip.present(&headers).0, 0, "{name} is not in {headers:?}");
                let upper = name.as_str().to_ascii_uppercase();
                headers.insert(
                    HeaderName::from_bytes(upper.as_bytes()).unwrap(),
                    HeaderValue::from_static("1"),
                );
                assert_eq!(strip.present(&headers).0, 1 << i, "{name} in {headers:?}");
            }
        }
    }

    #[test]
    fn request_becomes_origin_form_without_hop_by_hop() {
        let mut req = Request::builder()
            .uri("http://api.example.com:8080/v1/x?q=1")
            .header("host", "wrong")
            .header("connection", "keep-alive, x-secret, content-length")
            .header("x-secret", "1")
            .header("proxy-connection", "keep-alive")
            .header("keep-alive", "timeout=5")
            .header("te", "trailers, deflate")
            .header("proxy-authorization", "Basic abc")
            .header("expect", "100-continue")
            .header("content-length", "3")
            .header("trailer", "x-checksum")
            .header("authorization", "Bearer t")
            .body(())
            .unwrap();
        to_upstream(&mut req, &HeaderValue::from_static("api.example.com:8080"));
        assert_eq!(req.uri(), "/v1/x?q=1");
        let h = req.headers();
        assert_eq!(h["host"], "api.example.com:8080");
        assert_eq!(h["te"], "trailers");
        assert_eq!(h["content-length"], "3");
        assert_eq!(h["trailer"], "x-checksum");
        assert_eq!(h["authorization"], "Bearer t");
        for gone in [
            "connection",
            "x-secret",
            "proxy-connection",
            "keep-alive",
            "proxy-authorization",
            "expect",
        ] {
            assert!(!h.contains_key(gone), "{gone} kept");
        }
    }

    #[test]
    fn upgrade_keeps_upgrade_and_connection_upgrade_only() {
        let mut req = Request::builder()
            .uri("http://ws.example:8080/chat")
            .header("host", "ws.example:8080")
            .header("connection", "keep-alive, Upgrade, x-hop")
            .header("x-hop", "1")
            .header("upgrade", "websocket")
            .header("proxy-connection", "keep-alive")
            .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
            .body(())
            .unwrap();
        to_upstream_upgrade(&mut req, &HeaderValue::from_static("ws.example:8080"));
        assert_eq!(req.uri(), "/chat");
        let h = req.headers();
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
        assert_eq!(h["sec-websocket-key"], "dGhlIHNhbXBsZSBub25jZQ==");
        assert!(!h.contains_key("x-hop") && !h.contains_key("proxy-connection"));

        let mut resp = Response::builder()
            .status(101)
            .header("connection", "Upgrade, keep-alive")
            .header("keep-alive", "timeout=5")
            .header("upgrade", "websocket")
            .header("sec-websocket-accept", "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
            .body(())
            .unwrap();
        to_downstream_switch(&mut resp);
        let h = resp.headers();
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
        assert_eq!(h["sec-websocket-accept"], "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
        assert!(!h.contains_key("keep-alive"));
    }

    #[test]
    fn response_loses_hop_by_hop() {
        let mut resp = Response::builder()
            .header("connection", "close")
            .header("keep-alive", "timeout=5")
            .header("transfer-encoding", "chunked")
            .header("proxy-authenticate", "Basic")
            .header("content-type", "text/plain")
            .body(())
            .unwrap();
        to_downstream(&mut resp);
        assert_eq!(resp.headers().len(), 1);
    }

    #[test]
    fn a_non_ascii_connection_token_hides_no_other() {
        let mut req = Request::builder()
            .uri("/")
            .header("connection", HeaderValue::from_bytes(b"x-hop, caf\xe9").unwrap())
            .header("x-hop", "1")
            .body(())
            .unwrap();
        to_upstream(&mut req, &HeaderValue::from_static("a.example"));
        assert!(!req.headers().contains_key("x-hop"));
    }
}
