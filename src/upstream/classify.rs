//! What an upstream failure means to the application: the errors of the HTTP/1.1 client, the
//! HTTP/2 streams and hyper's client (upgrades) mapped to the contract's error kinds, and
//! whether an HTTP/2 stream was refused unprocessed (so a bodyless request may go again); the
//! count of the answers the sidecar made by kind (`egress_upstream_errors_total`).

use super::Upstream;
use crate::connector::{h1, http2};
use crate::error::{ErrorKind, ProxyError};
use crate::wire::frame::ErrorCode;
use crate::wire::h2client::Cause;

impl Upstream {
    /// Counts `err` as an answer the sidecar made to a request for this upstream, whether it
    /// came from admission, an attempt or an upgrade; returns its kind.
    pub fn failed(&self, err: &ProxyError) -> ErrorKind {
        self.metrics.failed(err.kind());
        err.kind()
    }

    /// Maps an error of hyper's HTTP/1.1 client (upgrades) to the contract's kinds.
    pub fn classify_error(&self, e: &hyper::Error) -> ProxyError {
        if e.is_parse() || e.is_parse_status() || e.is_parse_too_large() {
            return self.error(ErrorKind::ProtocolError, format!("invalid response: {e}"));
        }
        let cause = match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        };
        if e.is_user() || e.is_body_write_aborted() {
            // Our request body failed: the application went away or sent a malformed body.
            if cause.contains(crate::wire::REQUEST_BODY_IDLE) {
                self.cuts.body_idle.inc();
            }
            return self.error(ErrorKind::BadRequest, format!("request body: {cause}"));
        }
        self.error(
            ErrorKind::UpstreamReset,
            format!("connection closed before a response: {cause}"),
        )
    }

    /// Maps an HTTP/1.1 exchange error to the contract's kinds.
    pub(super) fn classify_h1(&self, e: &h1::Error) -> ProxyError {
        match e {
            h1::Error::Invalid(_) => self.error(ErrorKind::ProtocolError, e.to_string()),
            h1::Error::RequestBody(why) => {
                if why.contains(crate::wire::REQUEST_BODY_IDLE) {
                    self.cuts.body_idle.inc();
                }
                self.error(ErrorKind::BadRequest, e.to_string())
            }
            h1::Error::Closed | h1::Error::Truncated(_) => {
                self.error(ErrorKind::UpstreamReset, e.to_string())
            }
            h1::Error::Io(io) => self.error(
                ErrorKind::UpstreamReset,
                format!("connection closed before a response: {io}"),
            ),
        }
    }

    /// Maps an HTTP/2 stream error to the contract's kinds; `true` when the upstream refused
    /// the stream unprocessed (REFUSED_STREAM, or GOAWAY with a lower last stream id).
    pub(super) fn classify_h2(&self, e: &http2::Error) -> (ProxyError, bool) {
        match e {
            // Our request body failed: the application went away or sent a malformed body.
            http2::Error::RequestBody(why) => {
                if why.contains(crate::wire::REQUEST_BODY_IDLE) {
                    self.cuts.body_idle.inc();
                }
                (self.error(ErrorKind::BadRequest, e.to_string()), false)
            }
            // Never on the wire: unprocessed, as a refused stream is.
            http2::Error::Unsent(_) => (self.error(ErrorKind::UpstreamReset, format!("HTTP/2 {e}")), true),
            http2::Error::Reset { code, cause } => {
                let refused = *code == ErrorCode::REFUSED_STREAM || *cause == Cause::Unprocessed;
                let kind = match cause {
                    // We reset it for what the upstream sent on it.
                    Cause::Fault(_) => ErrorKind::ProtocolError,
                    _ if *code == ErrorCode::PROTOCOL_ERROR => ErrorKind::ProtocolError,
                    _ => ErrorKind::UpstreamReset,
                };
                (self.error(kind, format!("HTTP/2 {e}")), refused)
            }
            http2::Error::Connection(ended) => {
                let err = match ended {
                    http2::Ended::Protocol(_) => self.error(ErrorKind::ProtocolError, format!("HTTP/2 {e}")),
                    _ => self.error(
                        ErrorKind::UpstreamReset,
                        format!("connection closed before a response: {ended}"),
                    ),
                };
                (err, false)
            }
        }
    }
}
