//! The connection to one rate-limit service: one multiplexed HTTP/2 connection (h2c, or TLS with
//! ALPN `h2`) every call of every upstream shares, made again after it is lost, with a backoff
//! between failed attempts, and the gRPC calls on it.
//!
//! Ours rather than tonic's `Channel`: that one reconnects on the next call with no backoff and
//! brings its own connector, where a check must fail at once while the service is known to
//! be down (a request then waits for nothing), reconnect in the background so that no request
//! pays a dial, and reach the service with the sidecar's TLS settings (`tls.ca_file`, mTLS).
//! tonic still frames the calls: its generated client runs over [`Calls`], a tower service
//! that sends each call's message with its head on the upstream pools' kind of HTTP/2
//! connection (`connector::http2`). Not hyper's client: it spawns a task per call to send the
//! request and another to pump its body, most of what a check cost the sidecar (callgrind).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http_body_util::BodyExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::config::{Scheme, ServiceUrl, TlsConfig};
use crate::connector::http2::{self, Keepalive, Sender};
use crate::connector::tls::TlsConnector;

/// The first wait after a failed connection attempt; it doubles up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// The longest wait between attempts: a service back up is used again within about a second.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// How long one attempt (TCP, TLS, HTTP/2 handshake) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Pings while calls are open, so that a service gone without a word is noticed.
const KEEPALIVE: Keepalive = Keepalive {
    interval: Duration::from_secs(10),
    timeout: Duration::from_secs(5),
};
/// Streams assumed until the service's SETTINGS say (gRPC servers allow 100 or more).
const STREAMS_UNHEARD: usize = 100;

/// Why a call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No connection: the last attempt failed, and the next one is made in the background.
    #[error("no connection to the rate-limit service ({0})")]
    Down(String),
    /// The call failed (a gRPC status, or the connection lost during it).
    #[error("the rate-limit service failed the call: {0}")]
    Failed(String),
    /// No answer within `timeout`.
    #[error("the rate-limit service did not answer within {0:?}")]
    Timeout(Duration),
}

enum State {
    /// Nothing dialed yet.
    Idle,
    /// The first attempt, or one after a connection that served calls was lost: calls wait for
    /// it (within their `timeout`); its outcome wakes [`Channel::changed`].
    Connecting,
    /// A connection; `backoff` is the wait before the next attempt should it close before
    /// answering a call (an endpoint that accepts and then closes is no service).
    Ready { sender: Sender, backoff: Duration },
    /// The last attempt failed: calls fail at once, while attempts go on in the background
    /// with a backoff, until one succeeds or the channel is dropped.
    Down { why: String },
}

/// One service's connection.
pub(super) struct Channel {
    url: ServiceUrl,
    origin: http::Uri,
    tls: Option<TlsConnector>,
    state: Mutex<State>,
    changed: Notify,
    /// The connection in `Ready` has answered a call.
    answered: AtomicBool,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

impl Channel {
    /// A channel to `url`; nothing is dialed before [`Channel::warm`] or the first call.
    pub(super) fn new(url: &ServiceUrl, tls: &TlsConfig) -> Result<Arc<Self>, String> {
        let tls = match url.scheme {
            Scheme::Https => Some(TlsConnector::new(tls, &url.authority.host, &[b"h2"])?),
            Scheme::Http => None,
        };
        let origin = url
            .to_string()
            .parse()
            .map_err(|e| format!("{url}: not a URI: {e}"))?;
        Ok(Arc::new(Channel {
            url: url.clone(),
            origin,
            tls,
            state: Mutex::new(State::Idle),
            changed: Notify::new(),
            answered: AtomicBool::new(false),
        }))
    }

    /// Dials now, when a runtime is there to dial on: the first requests need not wait for it.
    pub(super) fn warm(self: &Arc<Self>) {
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        let mut state = self.lock();
        if matches!(*state, State::Idle) {
            *state = State::Connecting;
            tokio::spawn(attempts(Arc::downgrade(self), Duration::ZERO, BACKOFF_MIN));
        }
    }

    /// `ShouldRateLimit`, answered within `timeout` or not at all.
    pub(super) async fn should_rate_limit(
        self: &Arc<Self>,
        request: RateLimitRequest,
        timeout: Duration,
    ) -> Result<RateLimitResponse, CallError> {
        let call = async {
            let sender = self.sender().await?;
            let mut client = RateLimitServiceClient::with_origin(Calls(sender), self.origin.clone());
            match client.should_rate_limit(request).await {
                Ok(answer) => {
                    self.answered.store(true, Ordering::Relaxed);
                    Ok(answer.into_inner())
                }
                Err(status) => Err(CallError::Failed(format!(
                    "{:?}: {}",
                    status.code(),
                    status.message()
                ))),
            }
        };
        tokio::time::timeout(timeout, call)
            .await
            .unwrap_or(Err(CallError::Timeout(timeout)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection's sender: the live one, or the outcome of the attempt this call starts or
    /// joins. A call waits for one attempt at most, and never for one after a failure.
    async fn sender(self: &Arc<Self>) -> Result<Sender, CallError> {
        let changed = {
            let mut state = self.lock();
            match &*state {
                State::Ready { sender, .. } if !sender.is_closed() => return Ok(sender.clone()),
                State::Ready { backoff, .. } if !self.answered.swap(false, Ordering::Relaxed) => {
                    let why = "the service closed the connection before answering".to_owned();
                    let backoff = *backoff;
                    *state = State::Down { why: why.clone() };
                    tokio::spawn(attempts(Arc::downgrade(self), backoff, next(backoff)));
                    return Err(CallError::Down(why));
                }
                State::Ready { .. } | State::Idle => {
                    *state = State::Connecting;
                    tokio::spawn(attempts(Arc::downgrade(self), Duration::ZERO, BACKOFF_MIN));
                }
                State::Connecting => {}
                State::Down { why } => return Err(CallError::Down(why.clone())),
            }
            // Created under the lock: the attempt's outcome, set under it, cannot be missed.
            self.changed.notified()
        };
        changed.await;
        match &*self.lock() {
            State::Ready { sender, .. } if !sender.is_closed() => Ok(sender.clone()),
            State::Down { why } => Err(CallError::Down(why.clone())),
            _ => Err(CallError::Down("the connection closed as it was made".into())),
        }
    }

    async fn handshake(&self) -> Result<Sender, String> {
        let authority = &self.url.authority;
        let tcp = TcpStream::connect((authority.host.as_str(), authority.port))
            .await
            .map_err(|e| format!("connect to {authority}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let io: Box<dyn Io> = match &self.tls {
            Some(tls) => Box::new(
                tls.handshake(tcp)
                    .await
                    .map_err(|e| format!("TLS with {authority}: {e}"))?,
            ),
            None => Box::new(tcp),
        };
        let url = self.url.clone();
        // The driver ends when the service closes the connection or every sender is dropped
        // (the channel with them).
        Ok(http2::handshake(
            io,
            STREAMS_UNHEARD,
            Some(KEEPALIVE),
            None,
            move |ended| {
                if let Some(e) = ended {
                    tracing::debug!(service = %url, error = %e, "rate-limit service connection ended");
                }
            },
        ))
    }
}

/// Attempts to connect, after `delay`, until one succeeds or the channel is gone; `backoff` is
/// the wait after the next failure, doubling up to [`BACKOFF_MAX`].
async fn attempts(channel: Weak<Channel>, mut delay: Duration, mut backoff: Duration) {
    loop {
        tokio::time::sleep(delay).await;
        let Some(channel) = channel.upgrade() else {
            return;
        };
        let outcome = tokio::time::timeout(CONNECT_TIMEOUT, channel.handshake())
            .await
            .unwrap_or_else(|_| Err(format!("no connection within {CONNECT_TIMEOUT:?}")));
        let connected = match outcome {
            Ok(sender) => {
                channel.answered.store(false, Ordering::Relaxed);
                *channel.lock() = State::Ready { sender, backoff };
                true
            }
            Err(why) => {
                tracing::warn!(service = %channel.url, error = %why, retry_in = ?backoff, "rate-limit service unreachable");
                *channel.lock() = State::Down { why };
                false
            }
        };
        channel.changed.notify_waiters();
        if connected {
            return;
        }
        delay = backoff;
        backoff = next(backoff);
    }
}

fn next(backoff: Duration) -> Duration {
    (backoff * 2).min(BACKOFF_MAX)
}

/// What the connection runs over: TCP, or TLS over TCP.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The tower service tonic's client calls through: one HTTP/2 stream per call, its message
/// (encoded by tonic at once: a unary call's body is one frame in hand) sent with its head.
struct Calls(Sender);

type Answer = Pin<Box<dyn Future<Output = Result<http::Response<http2::Body>, http2::Error>> + Send>>;

impl tower::Service<http::Request<tonic::body::Body>> for Calls {
    type Response = http::Response<http2::Body>;
    type Error = http2::Error;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The sender waits for the connection's room itself.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let mut sender = self.0.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let body: Bytes = body
                .collect()
                .await
                .map_err(|e| http2::Error::RequestBody(e.to_string()))?
                .to_bytes();
            sender
                .send_whole(http::Request::from_parts(parts, ()), body)
                .await
        })
    }
}
