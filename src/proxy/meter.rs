//! Reading what an LLM answer spent as its body streams to the application, and counting it for
//! its app and model once the body ends: the request path's token accounting (`llm`).
//!
//! A pooled answer is read when its upstream reads usage (`llm.usage` is not `off`) and its
//! `Content-Type` is JSON or an event stream. Every byte goes to the application as it came,
//! when it came: the reader sees a frame's bytes after they are in hand and before the frame is
//! handed on, and keeps a few hundred bytes of state (`llm::Reader`).
//!
//! Who spent it (`app`): the request's `x-egress-app`, else the executable of a Unix-socket
//! client, else the upstream a route listener is bound to, else `unknown`. The model: the
//! answer's, else the one the request's path names (Gemini), else `unknown`. Both are labels
//! within the ledger's caps. What the request carries from its head to its answer is the
//! two-byte ids of those it named ([`Named`]): a request's future holds it across the send.

use std::borrow::Cow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response};
use http_body::{Body, Frame, SizeHint};

use crate::clients::Source;
use crate::global_rate_limit::Charge;
use crate::llm::ledger::{self, LabelId};
use crate::llm::{self, Framing, Outcome, Reader, Reason, Tokens};
use crate::pace::Spend;
use crate::routing::Arrival;
use crate::upstream::{Reading, TimedBody, Upstream};
use crate::wire::{BodyType, BoxError, RequestBody, WireFields};

/// Whether a request's answer is read, and what the request named for its labels: its
/// `x-egress-app`, the model in its path.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Named {
    /// The answer is read (see [`Named::of`]).
    read: bool,
    /// `None`: no `x-egress-app` (or an empty one).
    app: Option<LabelId>,
    /// The model the path names.
    model: Option<LabelId>,
}

impl Named {
    /// Whether the answer to `req`, bound for `upstream`, is read, and what `req` names. It is
    /// read when the upstream reads usage: every answer of a known provider's host or a named
    /// provider (a `HEAD` aside), and, of another host, the answers to `POST`s (every LLM call
    /// is one: a JSON API's `GET`s are not scanned for a shape they never have). An upstream
    /// whose answers are all read is asked for them uncompressed (see [`ask_identity`]).
    pub(super) fn of(req: &mut Request<RequestBody>, upstream: &Upstream, app: Option<HeaderValue>) -> Named {
        let Some(reading) = upstream.usage() else {
            return Named::default();
        };
        let method = req.method();
        if method == Method::HEAD || !(reading.always || method == Method::POST) {
            return Named::default();
        }
        if reading.always {
            ask_identity(req);
        }
        let ledger = reading.metrics.ledger();
        let app = app.and_then(|value| ledger.app_id(&String::from_utf8_lossy(value.as_bytes())));
        let model = if reading.model_in_path {
            llm::model_in_path(req.uri().path()).map(|m| ledger.model_id(m.as_str()))
        } else {
            None
        };
        Named {
            read: true,
            app,
            model,
        }
    }
}

/// Asks for an uncompressed answer: a compressed body cannot be read as it passes without
/// inflating a copy of it (a window of 32 KiB for gzip, up to 16 MiB for Brotli, per answer).
/// LLM answers are small text, and a server may always answer `identity`: the application
/// gets what the provider sent, byte for byte, only not compressed.
fn ask_identity(req: &mut Request<RequestBody>) {
    let headers = req.headers_mut();
    if headers.contains_key(http::header::ACCEPT_ENCODING) {
        headers.insert(
            http::header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
}

/// Who sent a request, for its answer's `app`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Who<'a> {
    pub(super) source: &'a Source,
    pub(super) arrival: &'a Arrival,
    pub(super) named: Named,
}

/// `resp` on its way to the application: its body read for usage when `upstream` reads usage
/// and the body is JSON or an event stream.
pub(super) fn meter(
    resp: Response<TimedBody>,
    upstream: &Upstream,
    who: Who<'_>,
    charge: Option<Charge>,
) -> Response<super::ResponseBody> {
    let Some(reading) = upstream.usage().filter(|_| who.named.read) else {
        return resp.map(super::ResponseBody::Upstream);
    };
    // Answers without a body (`1xx`, `204`, `304`) say nothing.
    if matches!(resp.status().as_u16(), 100..=199 | 204 | 304) {
        return resp.map(super::ResponseBody::Upstream);
    }
    // An HTTP/1.1 head's fields may be lines in the body, noted as they were parsed.
    let body = match resp.body().wire_fields() {
        Some(wire) => wire.body_type(),
        None => BodyType::of_map(resp.headers()),
    };
    let (Some(framing), compressed) = (body.framing, body.compressed) else {
        return resp.map(super::ResponseBody::Upstream);
    };
    let status = resp.status().as_u16();
    let meter = Meter {
        compressed,
        reader: Reader::new(framing, reading.shapes),
        reading: reading.clone(),
        app: app_label(reading, who),
        model: who.named.model,
        status,
        head_at: Instant::now(),
        first_event: None,
        spend: None,
        charge,
        settled: None,
    };
    resp.map(|mut inner| {
        let mut meter = meter;
        meter.spend = inner.take_spend();
        super::ResponseBody::Metered(Box::new(Metered { inner, meter }))
    })
}

/// The `app` label of a request from `who`.
fn app_label(reading: &Reading, who: Who<'_>) -> Arc<str> {
    let ledger = reading.metrics.ledger();
    match who.named.app {
        Some(id) => ledger.app_label(id),
        None => match app_name(None, who.source, who.arrival) {
            Some(name) => ledger.app(&name),
            None => ledger.unknown(),
        },
    }
}

/// Who sent a request: its `x-egress-app` (`header`, trimmed and cut as the ledger takes it),
/// else the executable of a Unix-socket client, else the upstream a route listener is bound
/// to; `None`: `unknown`. The ledger caps how many become labels; the global rate limit's
/// `app` entry sends each as it is.
pub(super) fn app_name<'a>(
    header: Option<&'a HeaderValue>,
    source: &'a Source,
    arrival: &'a Arrival,
) -> Option<Cow<'a, str>> {
    if let Some(value) = header {
        let name = match String::from_utf8_lossy(value.as_bytes()) {
            Cow::Borrowed(text) => Cow::Borrowed(ledger::app_name(text)),
            Cow::Owned(text) => Cow::Owned(ledger::app_name(&text).to_owned()),
        };
        if !name.is_empty() {
            return Some(name);
        }
    }
    if let Source::Unix(process) = source {
        if let Some(exe) = &process.exe {
            return Some(Cow::Borrowed(exe.rsplit('/').next().unwrap_or(exe)));
        }
    }
    if let Arrival::Route(upstream) = arrival {
        return Some(Cow::Borrowed(upstream));
    }
    None
}

/// What an answer's line shows of its usage (`access_log`).
#[derive(Debug, Clone, Default)]
pub struct Spent {
    /// The model label, when the answer or the request named one.
    pub model: Option<Arc<str>>,
    /// The tokens, when read.
    pub tokens: Option<Tokens>,
}

/// A pooled body read for usage.
#[derive(Debug)]
pub struct Metered {
    inner: TimedBody,
    meter: Meter,
}

#[derive(Debug)]
struct Meter {
    /// The body is compressed: not read, counted as such.
    compressed: bool,
    reader: Reader,
    reading: Arc<Reading>,
    app: Arc<str>,
    /// The model the request's path named.
    model: Option<LabelId>,
    status: u16,
    head_at: Instant,
    /// Head to the end of the first event, for streams.
    first_event: Option<f64>,
    /// What settles the request's tokens in pacing.
    spend: Option<Spend>,
    /// Where the global rate limit counts them.
    charge: Option<Charge>,
    /// Counted, once.
    settled: Option<Spent>,
}

impl Meter {
    fn read(&mut self, data: &[u8]) {
        if self.compressed {
            return;
        }
        self.reader.feed(data);
        if self.reader.framing() == Framing::Sse && self.first_event.is_none() && self.reader.events() > 0 {
            self.first_event = Some(self.head_at.elapsed().as_secs_f64());
        }
    }

    /// Counts the answer, once: its body ended (`complete`), was cut or dropped.
    fn settle(&mut self, complete: bool) -> &Spent {
        let spent = match self.settled.take() {
            Some(spent) => spent,
            None => self.count(complete),
        };
        self.settled.insert(spent)
    }

    fn count(&mut self, complete: bool) -> Spent {
        let outcome = if self.compressed {
            Outcome::Unreadable {
                reason: Reason::Compressed,
                model: None,
            }
        } else {
            self.reader.finish(complete)
        };
        // A body of an upstream not known for LLM answers counts once it showed a shape.
        if !self.reading.always && !self.reader.shaped() {
            return Spent::default();
        }
        let metrics = &self.reading.metrics;
        let ledger = metrics.ledger();
        let (named, read) = match outcome {
            Outcome::Read(usage) => (usage.model, Ok(usage.tokens)),
            Outcome::Unreadable { reason, model } => (model, Err(reason)),
        };
        let model = match (named, self.model) {
            (Some(model), _) => Some(ledger.model(Some(model.as_str()))),
            (None, Some(id)) => Some(ledger.model_label(id)),
            (None, None) => None,
        };
        let label = model.clone().unwrap_or_else(|| ledger.unknown());
        // An error answer reports no usage by nature: only a successful one is unreadable.
        let success = (200..300).contains(&self.status);
        let counted = read
            .as_ref()
            .map_err(|reason: &Reason| success.then_some(*reason));
        metrics.answer(&self.app, &label, self.status, counted, self.first_event);
        let tokens = read.ok();
        if let (Some(spend), Some(tokens)) = (self.spend.take(), tokens) {
            spend.settle(&tokens);
        }
        if let (Some(charge), Some(tokens)) = (self.charge.take(), tokens) {
            charge.tokens(tokens.total());
        }
        Spent { model, tokens }
    }
}

impl Metered {
    /// How the response was served.
    pub(super) fn inner(&self) -> &TimedBody {
        &self.inner
    }

    /// The fields of the response as their lines (see `ResponseBody::take_wire_fields`).
    pub(super) fn take_wire_fields(&mut self) -> Option<WireFields> {
        self.inner.take_wire_fields()
    }

    /// What the answer spent, counted now if its body has not ended yet (as cut, unless it
    /// was all read).
    pub(super) fn spent(&mut self) -> Spent {
        let complete = self.inner.is_end_stream();
        self.meter.settle(complete).clone()
    }
}

impl Body for Metered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.meter.read(data);
                }
            }
            Poll::Ready(Some(Err(_))) => {
                this.meter.settle(false);
            }
            Poll::Ready(None) => {
                this.meter.settle(true);
            }
            Poll::Pending => {}
        }
        polled.map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        let complete = self.inner.is_end_stream();
        self.meter.settle(complete);
    }
}
