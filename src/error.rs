//! Errors the application sees, and the one place they become responses.
//!
//! Every response the sidecar makes itself carries `x-egress-error: <kind>` and a one-line
//! `text/plain` body naming the upstream and the cause. [`ErrorKind`] is the contract's list of
//! kinds; [`ProxyError`] adds which side caused it (pingora's downstream/upstream/internal), the
//! upstream label and a human cause. Responses from upstreams never pass through here.

use std::fmt;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

/// The header naming the kind of a sidecar-made response.
pub const ERROR_HEADER: &str = "x-egress-error";

/// The contract's error kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: the request cannot be parsed or proxied.
    BadRequest,
    /// 400: origin-form request whose Host is no configured upstream.
    UnknownUpstream,
    /// 403: policy refuses the host.
    Denied,
    /// 508: the request targets the sidecar itself.
    Loop,
    /// 431: the request head is larger than `max_header_bytes`.
    HeaderTooLarge,
    /// 502: TCP connect failed.
    ConnectFailed,
    /// 502: the upstream closed or reset the connection before a response.
    UpstreamReset,
    /// 502: TLS handshake or verification failed.
    TlsFailed,
    /// 502: the upstream spoke malformed HTTP.
    ProtocolError,
    /// 502: the parent proxy refused (407, 403, 5xx to a CONNECT; 407 to a request).
    ParentRefused,
    /// 504: TCP connect did not finish within `connect_timeout`.
    ConnectTimeout,
    /// 504: no response head within `response_header_timeout`.
    ResponseTimeout,
    /// 504: no response head within `request_timeout` (or `x-egress-timeout`), retries and
    /// their waits included.
    RequestTimeout,
    /// 503: more than `max_pending` requests waiting for a connection.
    PoolOverflow,
    /// 503: waited `pending_timeout` for a connection.
    PendingTimeout,
    /// 503: the sidecar is shutting down.
    Draining,
    /// 429: pacing to the upstream's advertised limits would hold the request past
    /// `pace.max_wait` or its deadline; nothing was sent. `Retry-After` says when the key's
    /// quota resets.
    RateLimited,
    /// 503: the rate-limit service of `global_rate_limit` did not answer (down, failing, or
    /// slower than its `timeout`) and its `failure_mode` is `deny`; nothing was sent.
    RateLimitUnavailable,
    /// 502: the sidecar failed (a panic caught in the request's task: a bug).
    Internal,
}

impl ErrorKind {
    /// The kinds a request routed to an upstream can end with, from its admission (pacing, the
    /// global rate limit) to its last attempt: each upstream's `egress_upstream_errors_total`
    /// starts at zero for these.
    pub const ROUTED: [ErrorKind; 12] = [
        ErrorKind::ConnectFailed,
        ErrorKind::UpstreamReset,
        ErrorKind::TlsFailed,
        ErrorKind::ProtocolError,
        ErrorKind::ParentRefused,
        ErrorKind::ConnectTimeout,
        ErrorKind::ResponseTimeout,
        ErrorKind::RequestTimeout,
        ErrorKind::PoolOverflow,
        ErrorKind::PendingTimeout,
        ErrorKind::RateLimited,
        ErrorKind::RateLimitUnavailable,
    ];

    /// The status the application sees.
    pub fn status(self) -> StatusCode {
        use ErrorKind::*;
        match self {
            BadRequest | UnknownUpstream => StatusCode::BAD_REQUEST,
            Denied => StatusCode::FORBIDDEN,
            Loop => StatusCode::LOOP_DETECTED,
            HeaderTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ConnectFailed | UpstreamReset | TlsFailed | ProtocolError | ParentRefused | Internal => {
                StatusCode::BAD_GATEWAY
            }
            ConnectTimeout | ResponseTimeout | RequestTimeout => StatusCode::GATEWAY_TIMEOUT,
            PoolOverflow | PendingTimeout | Draining | RateLimitUnavailable => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            RateLimited => StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// The `x-egress-error` value, also the metric label.
    pub fn as_str(self) -> &'static str {
        use ErrorKind::*;
        match self {
            BadRequest => "bad_request",
            UnknownUpstream => "unknown_upstream",
            Denied => "denied",
            Loop => "loop",
            HeaderTooLarge => "header_too_large",
            ConnectFailed => "connect_failed",
            UpstreamReset => "upstream_reset",
            TlsFailed => "tls_failed",
            ProtocolError => "protocol_error",
            ParentRefused => "parent_refused",
            ConnectTimeout => "connect_timeout",
            ResponseTimeout => "response_timeout",
            RequestTimeout => "request_timeout",
            PoolOverflow => "pool_overflow",
            PendingTimeout => "pending_timeout",
            Draining => "draining",
            RateLimited => "rate_limited",
            RateLimitUnavailable => "rate_limit_unavailable",
            Internal => "internal",
        }
    }

    /// Which side is to blame.
    pub fn source(self) -> ErrorSource {
        use ErrorKind::*;
        match self {
            BadRequest | UnknownUpstream | Denied | Loop | HeaderTooLarge => ErrorSource::Downstream,
            ConnectFailed | UpstreamReset | TlsFailed | ProtocolError | ParentRefused | ConnectTimeout
            | ResponseTimeout | RequestTimeout | RateLimited => ErrorSource::Upstream,
            PoolOverflow | PendingTimeout | Draining | RateLimitUnavailable | Internal => {
                ErrorSource::Internal
            }
        }
    }
}

/// Which side of the proxy an error came from (pingora's vocabulary).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorSource {
    /// The application's request.
    Downstream,
    /// The upstream server or the path to it.
    Upstream,
    /// The sidecar's own limits, or its bugs.
    Internal,
}

/// An error that ends a request with a sidecar-made response.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ProxyError {
    kind: ErrorKind,
    upstream: Option<String>,
    cause: String,
    /// Seconds the application is asked to wait (`Retry-After`).
    retry_after: Option<u64>,
    /// Fields a rate-limit service asked to add to its refusal (boxed: almost always none).
    headers: Option<Box<[(http::HeaderName, HeaderValue)]>>,
}

impl ProxyError {
    /// An error of `kind` with a human cause.
    pub fn new(kind: ErrorKind, cause: impl Into<String>) -> Self {
        ProxyError {
            kind,
            upstream: None,
            cause: cause.into(),
            retry_after: None,
            headers: None,
        }
    }

    /// Asks the application to wait `secs` seconds before it tries again (`Retry-After`).
    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs);
        self
    }

    /// Adds `headers` to the response; they must not name a field the sidecar sets itself.
    pub fn with_headers(mut self, headers: Vec<(http::HeaderName, HeaderValue)>) -> Self {
        if !headers.is_empty() {
            self.headers = Some(headers.into_boxed_slice());
        }
        self
    }

    /// Names the upstream (label) the error concerns.
    pub fn with_upstream(mut self, upstream: impl Into<String>) -> Self {
        self.upstream = Some(upstream.into());
        self
    }

    /// Puts `context` (where it happened) before the cause.
    pub fn with_context(mut self, context: &str) -> Self {
        self.cause = format!("{context}: {}", self.cause);
        self
    }

    /// The kind.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The upstream label, if known.
    pub fn upstream(&self) -> Option<&str> {
        self.upstream.as_deref()
    }

    /// The response the application sees.
    pub fn to_response<B: From<Bytes>>(&self) -> Response<B> {
        let body = Bytes::from(format!("{self}\n"));
        let mut resp = Response::new(B::from(body.clone()));
        *resp.status_mut() = self.kind.status();
        let headers = resp.headers_mut();
        headers.insert(ERROR_HEADER, HeaderValue::from_static(self.kind.as_str()));
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        if let Some(secs) = self.retry_after {
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
        }
        for (name, value) in self.headers.iter().flat_map(|h| h.iter()) {
            headers.append(name.clone(), value.clone());
        }
        resp
    }
}

impl fmt::Display for ProxyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "egress-sidecar: {}", self.kind.as_str())?;
        if let Some(up) = &self.upstream {
            write!(f, ": upstream {up}")?;
        }
        // One line, whatever the cause text carries.
        let cause: String = self
            .cause
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        write!(f, ": {cause}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_carries_kind_status_and_one_line() {
        let err =
            ProxyError::new(ErrorKind::PendingTimeout, "waited 5s\nfor a connection").with_upstream("llm");
        let resp: Response<Bytes> = err.to_response();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()[ERROR_HEADER], "pending_timeout");
        let body = std::str::from_utf8(resp.body()).unwrap();
        assert_eq!(
            body,
            "egress-sidecar: pending_timeout: upstream llm: waited 5s for a connection\n"
        );
    }
}
