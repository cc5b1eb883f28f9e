//! The client side of one HTTP/2 connection (RFC 9113) as a state machine without I/O: bytes
//! read from the upstream go in through [`Connection::recv`], what the caller asks (open a
//! stream, send data, reset, release what it consumed) goes in through methods, and out come
//! [`Event`]s and the bytes to write ([`Connection::out`]).
//!
//! The third piece, after [`super::hpack`] and [`super::frame`], of the upstream HTTP/2 client
//! that is to replace the `h2` crate on the request path (see `frame`'s doc for why). Without
//! I/O it can be driven by whichever task holds the socket, tested frame by frame, and fuzzed;
//! the task and the pool's use of it come next.
//!
//! What it keeps: stream states (§5.1; a client's streams are its own odd ids, so a frame on an
//! even id or on one above the last opened is on an idle stream, a connection error), the
//! CONTINUATION sequence (§6.10), both flow-control windows of the connection and of every stream
//! (§6.9: receive windows are credited back only as the caller releases what it consumed, so a
//! slow application slows the upstream instead of growing our buffers), the peer's SETTINGS
//! (initial window changes applied to open streams, §6.9.2) and our acknowledgement of them,
//! PING answers, GOAWAY (streams above its last id come back as unprocessed, safe to retry), and
//! the checks of §8 on a response (pseudo-header fields, connection-specific fields, a body that
//! matches its `Content-Length`, trailers that end the stream).
//!
//! A response's fields come out as HTTP/1.1 lines ([`Fields::lines`]), which the HTTP/1.1
//! server writes as they are, never as a header map: that is where the instructions go.
//!
//! Leniencies, as the `h2` crate has them: frames on a stream that has closed (ended or reset)
//! are dropped, their header blocks still decoded to keep HPACK in step and their DATA credited
//! back to the connection, since the peer may have sent them before it saw the end. Priority
//! signals mean nothing (§5.3.2). Our SETTINGS are acknowledged or not ([`Connection::is_settings_acked`]);
//! how long to wait for that is the task's to decide.

mod head;
mod recv;
mod streams;

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;

pub use head::{Fields, Malformed, RequestHead};

use super::frame::{encode, ErrorCode, Settings, Violation, MAX_WINDOW_SIZE, PREFACE};
use super::hpack::{self, BlockError};
use streams::{Stream, Streams};

/// The window §6.9.2 starts every stream and the connection with.
const DEFAULT_WINDOW: u32 = 65_535;

/// `SETTINGS_HEADER_TABLE_SIZE` we leave at its default, for the peer's encoder.
const HEADER_TABLE_SIZE: usize = 4_096;

/// The highest stream id (§5.1.1); a connection that has used it opens no more streams.
const MAX_STREAM_ID: u32 = 0x7fff_ffff;

/// What we announce and keep. The defaults are hyper's, as `connector::http2` sets them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// `SETTINGS_INITIAL_WINDOW_SIZE`: what a stream may receive ahead of the caller.
    pub stream_window: u32,
    /// The connection's receive window, raised from 65,535 by a WINDOW_UPDATE at the start.
    pub connection_window: u32,
    /// `SETTINGS_MAX_HEADER_LIST_SIZE`.
    pub max_header_list_size: u32,
    /// `SETTINGS_MAX_FRAME_SIZE`: the longest frame we take.
    pub max_frame_size: u32,
}

/// What happened, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A response's final head (informational ones are dropped).
    Head {
        /// The stream.
        stream_id: u32,
        /// Its status and fields.
        fields: Fields,
        /// No body follows.
        end_stream: bool,
    },
    /// Part of a response's body. The caller must [`Connection::release`] its length once it
    /// has consumed it, or dropped it: until then it counts against both receive windows.
    Data {
        /// The stream.
        stream_id: u32,
        /// The bytes, a slice of the read buffer.
        data: Bytes,
        /// The body ends here.
        end_stream: bool,
    },
    /// A response's trailers; the stream's response is whole.
    Trailers {
        /// The stream.
        stream_id: u32,
        /// The fields (`status` is 0).
        fields: Fields,
    },
    /// The stream ended before its exchange did; it is gone from the connection.
    Reset {
        /// The stream.
        stream_id: u32,
        /// The code a RST_STREAM or GOAWAY carried, or the one we reset it with.
        code: ErrorCode,
        /// Who ended it, and why.
        cause: Cause,
    },
    /// A send window grew: sends waiting on stream `stream_id` (0: on any stream) may go on.
    Capacity {
        /// The stream, or 0 for the connection's window.
        stream_id: u32,
    },
    /// The peer's SETTINGS changed ([`Connection::max_concurrent_streams`] among them).
    Settings,
    /// The answer to one of our PINGs.
    Pong {
        /// What ours carried.
        payload: [u8; 8],
    },
    /// The peer is closing: no stream above `last_stream_id` was or will be processed.
    GoAway {
        /// The last stream it may act on.
        last_stream_id: u32,
        /// Why.
        code: ErrorCode,
        /// Diagnostic bytes.
        debug_data: Bytes,
    },
}

/// Why a stream was reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The peer sent RST_STREAM.
    Peer,
    /// We reset it for what the peer sent on it.
    Fault(StreamFault),
    /// A GOAWAY's last stream id is below it: the peer never processed it, so it may be retried.
    Unprocessed,
    /// The connection failed ([`Connection::recv`] said why).
    Connection,
}

/// What the peer did wrong on one stream (a stream error, §5.4.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StreamFault {
    /// A frame broke a shape rule.
    #[error(transparent)]
    Frame(Violation),
    /// The response is malformed (§8.1.1).
    #[error(transparent)]
    Malformed(Malformed),
    /// The header list is longer than our `SETTINGS_MAX_HEADER_LIST_SIZE`.
    #[error("header list above our limit")]
    ListTooLarge,
    /// A frame after the peer ended the stream (§5.1, half-closed (remote)).
    #[error("frame after the stream ended")]
    AfterEnd,
    /// DATA beyond the stream's receive window.
    #[error("data beyond the stream's window")]
    WindowExceeded,
    /// A WINDOW_UPDATE taking the stream's send window past 2^31 - 1.
    #[error("stream window past 2^31 - 1")]
    WindowOverflow,
}

/// Why the connection failed (a connection error, §5.4.1); a GOAWAY with `code` is in
/// [`Connection::out`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("connection error {code}: {reason}")]
pub struct ConnError {
    /// The code our GOAWAY carries.
    pub code: ErrorCode,
    /// The rule the peer broke.
    pub reason: Reason,
}

/// The rule behind a [`ConnError`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reason {
    /// A frame broke a shape rule.
    #[error(transparent)]
    Frame(Violation),
    /// A header block did not decode; HPACK's state is lost.
    #[error(transparent)]
    Compression(BlockError),
    /// A frame on a stream we never opened (§5.1: idle; a server opens none).
    #[error("frame on idle stream {0}")]
    IdleStream(u32),
    /// Another frame where a CONTINUATION of the open header block must come (§6.10).
    #[error("CONTINUATION expected")]
    ContinuationExpected,
    /// A CONTINUATION with no header block open.
    #[error("CONTINUATION without a header block")]
    StrayContinuation,
    /// A header block longer than the list size we announced allows.
    #[error("header block too large")]
    BlockTooLarge,
    /// SETTINGS_ENABLE_PUSH of 1 from a server (§6.5.2), or a PUSH_PROMISE after we disabled push.
    #[error("server push")]
    Push,
    /// DATA beyond the connection's receive window.
    #[error("data beyond the connection's window")]
    WindowExceeded,
    /// A window taken past 2^31 - 1 (§6.9.1, §6.9.2).
    #[error("flow-control window past 2^31 - 1")]
    WindowOverflow,
}

/// Why a stream could not be opened; nothing was sent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// A GOAWAY came, or we sent one: the connection takes no new streams.
    #[error("connection going away")]
    GoingAway,
    /// As many streams are open as the peer's SETTINGS_MAX_CONCURRENT_STREAMS allows.
    #[error("at the peer's concurrent stream limit")]
    AtLimit,
    /// The stream ids are used up (§5.1.1): a new connection is needed.
    #[error("stream ids exhausted")]
    IdsExhausted,
    /// The connection failed.
    #[error(transparent)]
    Failed(ConnError),
}

/// A send on a stream that no longer takes one (reset, or already ended by us).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stream {0} is not open for sending")]
pub struct NotOpen(pub u32);

/// The peer's SETTINGS in force.
#[derive(Debug, Clone, Copy)]
struct PeerSettings {
    max_concurrent_streams: u32,
    initial_window_size: u32,
    max_frame_size: u32,
}

/// A header block waiting for its CONTINUATIONs.
#[derive(Debug)]
struct PendingBlock {
    stream_id: u32,
    block: BytesMut,
    end_stream: bool,
}

/// One client connection's HTTP/2 state.
#[derive(Debug)]
pub struct Connection {
    config: Config,
    peer: PeerSettings,
    decoder: hpack::Decoder,
    streams: Streams,
    /// The id the next stream gets.
    next_id: u32,
    /// What we may still send on the connection.
    send_window: i64,
    /// What the peer may still send on the connection before our next WINDOW_UPDATE.
    recv_window: i64,
    /// Data consumed on the connection and not yet credited back.
    unreleased: u32,
    /// Our SETTINGS frames not yet acknowledged.
    settings_unacked: u32,
    pending_block: Option<PendingBlock>,
    /// The lowest last stream id a GOAWAY from the peer gave.
    goaway_received: Option<u32>,
    goaway_sent: bool,
    failed: Option<ConnError>,
    out: BytesMut,
    events: VecDeque<Event>,
    /// Where requests' header blocks are coded before they are framed into `out`.
    scratch: BytesMut,
    /// Where responses' lines are written and split off (`head::Reader`).
    lines: BytesMut,
}

// === impl Config ===

impl Default for Config {
    fn default() -> Self {
        Config {
            stream_window: 2 * 1024 * 1024,
            connection_window: 5 * 1024 * 1024,
            max_header_list_size: 16 * 1024,
            max_frame_size: super::frame::DEFAULT_MAX_FRAME_SIZE,
        }
    }
}

// === impl Connection ===

impl Connection {
    /// A connection whose preface, SETTINGS and connection WINDOW_UPDATE wait in [`Self::out`].
    pub fn new(config: Config) -> Self {
        let mut out = BytesMut::with_capacity(128);
        out.extend_from_slice(PREFACE);
        let ours = Settings {
            enable_push: Some(false),
            initial_window_size: Some(config.stream_window.min(MAX_WINDOW_SIZE)),
            max_frame_size: Some(config.max_frame_size),
            max_header_list_size: Some(config.max_header_list_size),
            ..Settings::default()
        };
        encode::settings(&ours, &mut out);
        let connection_window = config.connection_window.clamp(DEFAULT_WINDOW, MAX_WINDOW_SIZE);
        if connection_window > DEFAULT_WINDOW {
            encode::window_update(0, connection_window - DEFAULT_WINDOW, &mut out);
        }
        Connection {
            config,
            peer: PeerSettings {
                max_concurrent_streams: u32::MAX,
                initial_window_size: DEFAULT_WINDOW,
                max_frame_size: super::frame::DEFAULT_MAX_FRAME_SIZE,
            },
            decoder: hpack::Decoder::new(HEADER_TABLE_SIZE, config.max_header_list_size as usize),
            streams: Streams::default(),
            next_id: 1,
            send_window: i64::from(DEFAULT_WINDOW),
            recv_window: i64::from(connection_window),
            unreleased: 0,
            settings_unacked: 1,
            pending_block: None,
            goaway_received: None,
            goaway_sent: false,
            failed: None,
            out,
            events: VecDeque::new(),
            scratch: BytesMut::new(),
            lines: BytesMut::new(),
        }
    }

    /// What is to be written to the peer, in order; the caller takes what it wrote off the front.
    pub fn out(&mut self) -> &mut BytesMut {
        &mut self.out
    }

    /// The next event, in the order they happened.
    pub fn next_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Opens a stream with `head`'s HEADERS; END_STREAM on them when `end_stream` (no body).
    pub fn open(&mut self, head: &RequestHead<'_>, end_stream: bool) -> Result<u32, OpenError> {
        if let Some(e) = &self.failed {
            return Err(OpenError::Failed(e.clone()));
        }
        if self.goaway_received.is_some() || self.goaway_sent {
            return Err(OpenError::GoingAway);
        }
        if self.next_id > MAX_STREAM_ID {
            return Err(OpenError::IdsExhausted);
        }
        if self.streams.len() >= self.peer.max_concurrent_streams as usize {
            return Err(OpenError::AtLimit);
        }
        let id = self.next_id;
        self.next_id += 2;
        self.scratch.clear();
        head::encode_request(head, &mut self.scratch);
        encode::headers(
            id,
            &self.scratch,
            end_stream,
            self.peer.max_frame_size,
            &mut self.out,
        );
        let head_request = head.method == http::Method::HEAD;
        let mut stream = Stream::new(
            id,
            self.peer.initial_window_size,
            self.config.stream_window,
            head_request,
        );
        stream.local_closed = end_stream;
        self.streams.push(stream);
        Ok(id)
    }

    /// Sends as much of `data` as both send windows allow, taking it off the front, and
    /// END_STREAM after the last of it when `end_stream`. `Ok(true)` once all of it (and the
    /// END_STREAM asked for) is out; else the caller waits for an [`Event::Capacity`].
    pub fn send_data(&mut self, stream_id: u32, data: &mut Bytes, end_stream: bool) -> Result<bool, NotOpen> {
        let connection_window = self.send_window;
        let stream = self.sending(stream_id)?;
        let window = connection_window.min(stream.send_window).max(0);
        let n = data.len().min(usize::try_from(window).unwrap_or(usize::MAX));
        let chunk = data.split_to(n);
        let last = end_stream && data.is_empty();
        stream.send_window -= n as i64;
        stream.local_closed = last;
        let done = stream.is_done();
        self.send_window -= n as i64;
        if n > 0 || last {
            encode::data(stream_id, &chunk, last, self.peer.max_frame_size, &mut self.out);
        }
        if done {
            self.streams.remove(stream_id);
        }
        Ok(data.is_empty())
    }

    /// Ends the stream's request with trailers.
    pub fn send_trailers(&mut self, stream_id: u32, trailers: &HeaderMap) -> Result<(), NotOpen> {
        let max_frame_size = self.peer.max_frame_size;
        let stream = self.sending(stream_id)?;
        stream.local_closed = true;
        let done = stream.is_done();
        self.scratch.clear();
        for (name, value) in trailers {
            let (name, sensitive) = (name.as_str().as_bytes(), value.is_sensitive());
            hpack::Encoder.encode(name, value.as_bytes(), sensitive, &mut self.scratch);
        }
        encode::headers(stream_id, &self.scratch, true, max_frame_size, &mut self.out);
        if done {
            self.streams.remove(stream_id);
        }
        Ok(())
    }

    fn sending(&mut self, stream_id: u32) -> Result<&mut Stream, NotOpen> {
        self.streams
            .get_mut(stream_id)
            .filter(|s| !s.local_closed)
            .ok_or(NotOpen(stream_id))
    }

    /// Whether the stream still takes request data (not ended by us, not reset, not gone).
    pub fn is_sending(&mut self, stream_id: u32) -> bool {
        self.sending(stream_id).is_ok()
    }

    /// What [`Self::send_data`] could send on the stream now.
    pub fn send_capacity(&mut self, stream_id: u32) -> usize {
        let connection = self.send_window;
        self.sending(stream_id)
            .map_or(0, |s| usize::try_from(connection.min(s.send_window)).unwrap_or(0))
    }

    /// Resets the stream (the caller gave up on it); nothing more comes of it but events queued
    /// before. A stream no longer open is left alone.
    pub fn reset(&mut self, stream_id: u32, code: ErrorCode) {
        if self.streams.remove(stream_id).is_some() {
            encode::rst_stream(stream_id, code, &mut self.out);
        }
    }

    /// The caller consumed (or dropped) `n` bytes of [`Event::Data`] on the stream: credits
    /// them back, with a WINDOW_UPDATE once half a window is owed.
    pub fn release(&mut self, stream_id: u32, n: usize) {
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        self.credit_connection(n);
        let half = self.config.stream_window / 2;
        let Some(stream) = self.streams.get_mut(stream_id) else {
            return;
        };
        if stream.remote_closed {
            return;
        }
        stream.unreleased = stream.unreleased.saturating_add(n);
        if stream.unreleased >= half.max(1) {
            let increment = std::mem::take(&mut stream.unreleased);
            stream.recv_window += i64::from(increment);
            encode::window_update(stream_id, increment, &mut self.out);
        }
    }

    fn credit_connection(&mut self, n: u32) {
        self.unreleased = self.unreleased.saturating_add(n);
        let half = (self
            .config
            .connection_window
            .clamp(DEFAULT_WINDOW, MAX_WINDOW_SIZE)
            / 2)
        .max(1);
        if self.unreleased >= half {
            let increment = std::mem::take(&mut self.unreleased);
            self.recv_window += i64::from(increment);
            encode::window_update(0, increment, &mut self.out);
        }
    }

    /// Sends a PING; its answer comes as [`Event::Pong`].
    pub fn ping(&mut self, payload: [u8; 8]) {
        encode::ping(payload, &mut self.out);
    }

    /// Closes gracefully: a GOAWAY with `code`, and no new streams; open ones go on.
    pub fn go_away(&mut self, code: ErrorCode) {
        if !self.goaway_sent {
            self.goaway_sent = true;
            encode::goaway(0, code, b"", &mut self.out);
        }
    }

    /// How many streams are open.
    pub fn open_streams(&self) -> usize {
        self.streams.len()
    }

    /// The peer's SETTINGS_MAX_CONCURRENT_STREAMS (`u32::MAX` until it says one).
    pub fn max_concurrent_streams(&self) -> u32 {
        self.peer.max_concurrent_streams
    }

    /// Whether the peer acknowledged our SETTINGS.
    pub fn is_settings_acked(&self) -> bool {
        self.settings_unacked == 0
    }

    /// Whether a stream could be opened now.
    pub fn can_open(&self) -> bool {
        self.failed.is_none()
            && self.goaway_received.is_none()
            && !self.goaway_sent
            && self.next_id <= MAX_STREAM_ID
            && self.streams.len() < self.peer.max_concurrent_streams as usize
    }
}

#[cfg(test)]
mod interop;
#[cfg(test)]
mod tests;
