//! HTTP/2 frames (RFC 9113 §4, §5.5, §6): [`Frame::parse`] splits one whole frame off a read
//! buffer, checks its shape and hands its payload out as [`Bytes`] of that buffer; [`encode`]
//! appends the frames a client sends.
//!
//! The second piece, after [`super::hpack`], of an upstream HTTP/2 client of our own that is to
//! replace the `h2` crate on the request path. It is not written on top of `h2` because `h2`
//! keeps its codec private (no stable API to borrow it from), and the point of our own client is
//! fewer instructions per request: `h2` costs about 11,400 of the 33,400 instructions a request
//! proxied to an h2c upstream takes. Hence no copy of a payload (a DATA frame's data and a header
//! block's fragment are slices of the read buffer), no allocation per frame, and no state:
//! a small response's HEADERS and DATA take 454 instructions to parse (`benches/h2_frame.rs`).
//!
//! What a frame's own bytes decide is checked here, with the error code and the scope (the
//! connection or one stream) RFC 9113 gives it: the stream identifier a type requires (0 or
//! not), fixed and minimum lengths, padding, SETTINGS values (§6.5.2), a WINDOW_UPDATE of 0.
//! A frame longer than the `SETTINGS_MAX_FRAME_SIZE` we announced is a connection error as soon
//! as its header arrives; §4.2 would let it be a stream error on a stream, but that means
//! reading a payload we refused to buffer only to drop it.
//!
//! Left to the connection, which keeps the state they need: stream states (§5.1, a frame on an
//! idle or closed stream), CONTINUATION sequencing (§6.10: nothing but CONTINUATIONs of that
//! stream until END_HEADERS), flow-control windows (§6.9: a DATA frame's `flow_len` counts
//! against them, and a window past 2^31-1), SETTINGS acknowledgement and its timeout, what
//! depends on the role (a server's `SETTINGS_ENABLE_PUSH` of 1, a PUSH_PROMISE after we disabled
//! push: §6.5.2, §8.4), and the priority signals (§5.3.2: deprecated; a HEADERS frame's priority
//! fields are skipped unread and a PRIORITY frame, once its shape is checked, means nothing).

mod decode;
pub mod encode;

use std::fmt;

use bytes::{Bytes, BytesMut};

/// What a client sends first on a connection (§3.4), before its SETTINGS frame.
pub const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A frame header's length (§4.1): 24 bits of length, type, flags, 32 bits of stream id.
pub const HEADER_LEN: usize = 9;

/// `SETTINGS_MAX_FRAME_SIZE` until a SETTINGS frame says otherwise, and its lowest value.
pub const DEFAULT_MAX_FRAME_SIZE: u32 = 16_384;

/// The highest `SETTINGS_MAX_FRAME_SIZE` (2^24 - 1): the most a frame's 24-bit length says.
pub const MAX_MAX_FRAME_SIZE: u32 = 16_777_215;

/// The largest flow-control window and window increment (2^31 - 1).
pub const MAX_WINDOW_SIZE: u32 = 0x7fff_ffff;

/// A stream identifier's 31 bits; the reserved bit above them is ignored on receipt (§4.1).
const STREAM_ID_MASK: u32 = 0x7fff_ffff;

/// Frame flags (§6); each means something only on the types named.
pub mod flags {
    /// DATA, HEADERS: the last frame the sender sends on the stream.
    pub const END_STREAM: u8 = 0x1;
    /// SETTINGS, PING: an acknowledgement (the same bit as END_STREAM).
    pub const ACK: u8 = 0x1;
    /// HEADERS, PUSH_PROMISE, CONTINUATION: the header block ends with this frame.
    pub const END_HEADERS: u8 = 0x4;
    /// DATA, HEADERS, PUSH_PROMISE: a pad length byte leads the payload.
    pub const PADDED: u8 = 0x8;
    /// HEADERS: a stream dependency and weight follow the pad length.
    pub const PRIORITY: u8 = 0x20;
}

/// The frame types of §6, by their number on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Type 0x0.
    Data = 0x0,
    /// Type 0x1.
    Headers = 0x1,
    /// Type 0x2.
    Priority = 0x2,
    /// Type 0x3.
    RstStream = 0x3,
    /// Type 0x4.
    Settings = 0x4,
    /// Type 0x5.
    PushPromise = 0x5,
    /// Type 0x6.
    Ping = 0x6,
    /// Type 0x7.
    GoAway = 0x7,
    /// Type 0x8.
    WindowUpdate = 0x8,
    /// Type 0x9.
    Continuation = 0x9,
}

/// An error code (§7), as RST_STREAM and GOAWAY carry it; a code this list lacks is kept as it
/// came, since §7 says an unknown code must not trigger anything special.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u32);

/// One frame, its payload a slice of the buffer it was parsed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// DATA (§6.1), padding removed.
    Data {
        /// Never 0.
        stream_id: u32,
        /// The data, without the pad length byte and padding.
        data: Bytes,
        /// END_STREAM was set.
        end_stream: bool,
        /// The whole payload's length, padding included: what counts against the flow-control
        /// windows (§6.9.1), which `data.len()` alone would undercount.
        flow_len: u32,
    },
    /// HEADERS (§6.2), padding and priority fields removed.
    Headers {
        /// Never 0.
        stream_id: u32,
        /// This frame's part of the header block, for HPACK once END_HEADERS has come.
        fragment: Bytes,
        /// END_STREAM was set.
        end_stream: bool,
        /// END_HEADERS was set: no CONTINUATION follows.
        end_headers: bool,
    },
    /// PRIORITY (§6.3), well formed; the connection ignores it (§5.3.2).
    Priority {
        /// Never 0.
        stream_id: u32,
    },
    /// RST_STREAM (§6.4).
    RstStream {
        /// Never 0.
        stream_id: u32,
        /// Why the stream ended.
        error_code: ErrorCode,
    },
    /// SETTINGS (§6.5), or its acknowledgement (no parameters then).
    Settings {
        /// ACK was set.
        ack: bool,
        /// The parameters this frame sets, each checked against §6.5.2.
        settings: Settings,
    },
    /// PUSH_PROMISE (§6.6), parsed so that the connection can refuse it.
    PushPromise {
        /// The stream the promise is on; never 0.
        stream_id: u32,
        /// The stream the server reserves.
        promised_stream_id: u32,
        /// This frame's part of the promised request's header block.
        fragment: Bytes,
        /// END_HEADERS was set.
        end_headers: bool,
    },
    /// PING (§6.7).
    Ping {
        /// ACK was set: the answer to one of ours.
        ack: bool,
        /// Opaque data an answer echoes.
        payload: [u8; 8],
    },
    /// GOAWAY (§6.8).
    GoAway {
        /// The highest stream the sender may have acted on; later ones can be retried.
        last_stream_id: u32,
        /// Why the connection ends.
        error_code: ErrorCode,
        /// Diagnostic bytes, not for parsing.
        debug_data: Bytes,
    },
    /// WINDOW_UPDATE (§6.9); the increment is never 0.
    WindowUpdate {
        /// 0 for the connection's window.
        stream_id: u32,
        /// 1 to 2^31 - 1.
        increment: u32,
    },
    /// CONTINUATION (§6.10).
    Continuation {
        /// Never 0.
        stream_id: u32,
        /// The next part of the header block.
        fragment: Bytes,
        /// END_HEADERS was set.
        end_headers: bool,
    },
    /// A type §6 does not define (§5.5: ignored, but the connection needs to see it, since one
    /// inside a header block is a connection error).
    Unknown {
        /// The frame's type.
        kind: u8,
        /// Its stream id, reserved bit cleared.
        stream_id: u32,
        /// Its payload's length.
        len: u32,
    },
}

/// The parameters of one SETTINGS frame (§6.5.2); `None` for one it does not carry. A parameter
/// sent twice keeps its last value, as §6.5.3 has them processed in order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settings {
    /// SETTINGS_HEADER_TABLE_SIZE (0x1).
    pub header_table_size: Option<u32>,
    /// SETTINGS_ENABLE_PUSH (0x2): 0 or 1.
    pub enable_push: Option<bool>,
    /// SETTINGS_MAX_CONCURRENT_STREAMS (0x3).
    pub max_concurrent_streams: Option<u32>,
    /// SETTINGS_INITIAL_WINDOW_SIZE (0x4): at most 2^31 - 1.
    pub initial_window_size: Option<u32>,
    /// SETTINGS_MAX_FRAME_SIZE (0x5): 16,384 to 16,777,215.
    pub max_frame_size: Option<u32>,
    /// SETTINGS_MAX_HEADER_LIST_SIZE (0x6).
    pub max_header_list_size: Option<u32>,
}

/// Why a frame was refused, with the scope and error code RFC 9113 gives the rule it broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The connection must end with a GOAWAY carrying `code` (§5.4.1).
    #[error("connection error {code}: {violation}")]
    Connection {
        /// The code for the GOAWAY.
        code: ErrorCode,
        /// The rule broken.
        violation: Violation,
    },
    /// Only the stream must end, with a RST_STREAM carrying `code` (§5.4.2); the frame was taken
    /// off the buffer, and the connection goes on.
    #[error("stream error {code} on stream {stream_id}: {violation}")]
    Stream {
        /// The stream to reset.
        stream_id: u32,
        /// The code for the RST_STREAM.
        code: ErrorCode,
        /// The rule broken.
        violation: Violation,
    },
}

/// A rule of RFC 9113 a frame broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// Longer than the `SETTINGS_MAX_FRAME_SIZE` we announced (§4.2).
    #[error("frame of {len} bytes, above the {max} allowed")]
    TooLarge {
        /// The length its header says.
        len: u32,
        /// Our `SETTINGS_MAX_FRAME_SIZE`.
        max: u32,
    },
    /// A type that belongs to a stream, on stream 0.
    #[error("{0:?} frame on stream 0")]
    StreamZero(Kind),
    /// A type that belongs to the connection, on a stream.
    #[error("{kind:?} frame on stream {stream_id}")]
    NotStreamZero {
        /// The frame's type.
        kind: Kind,
        /// The stream it named.
        stream_id: u32,
    },
    /// A length the type does not allow: not its fixed length, too short for its fields, or (a
    /// SETTINGS frame) not a multiple of 6 or not 0 with ACK.
    #[error("{kind:?} frame of {len} bytes")]
    Length {
        /// The frame's type.
        kind: Kind,
        /// Its payload's length.
        len: u32,
    },
    /// A pad length not below the payload's length (§6.1, §6.2, §6.6).
    #[error("{pad} bytes of padding in a payload of {len}")]
    Padding {
        /// The pad length byte.
        pad: u8,
        /// The payload's length.
        len: u32,
    },
    /// SETTINGS_ENABLE_PUSH other than 0 or 1.
    #[error("SETTINGS_ENABLE_PUSH of {0}")]
    EnablePush(u32),
    /// SETTINGS_INITIAL_WINDOW_SIZE above 2^31 - 1.
    #[error("SETTINGS_INITIAL_WINDOW_SIZE of {0}")]
    InitialWindowSize(u32),
    /// SETTINGS_MAX_FRAME_SIZE outside 16,384..=16,777,215.
    #[error("SETTINGS_MAX_FRAME_SIZE of {0}")]
    MaxFrameSize(u32),
    /// A WINDOW_UPDATE increment of 0 (§6.9).
    #[error("WINDOW_UPDATE increment of 0")]
    ZeroIncrement,
}

// === impl Kind ===

impl Kind {
    /// The type numbered `kind`, if §6 defines it.
    pub fn from_u8(kind: u8) -> Option<Kind> {
        Some(match kind {
            0x0 => Kind::Data,
            0x1 => Kind::Headers,
            0x2 => Kind::Priority,
            0x3 => Kind::RstStream,
            0x4 => Kind::Settings,
            0x5 => Kind::PushPromise,
            0x6 => Kind::Ping,
            0x7 => Kind::GoAway,
            0x8 => Kind::WindowUpdate,
            0x9 => Kind::Continuation,
            _ => return None,
        })
    }
}

// === impl ErrorCode ===

impl ErrorCode {
    /// Not an error: a graceful GOAWAY, or a stream no longer needed.
    pub const NO_ERROR: ErrorCode = ErrorCode(0x0);
    /// A protocol error with no more specific code.
    pub const PROTOCOL_ERROR: ErrorCode = ErrorCode(0x1);
    /// The endpoint failed on its own.
    pub const INTERNAL_ERROR: ErrorCode = ErrorCode(0x2);
    /// Flow control was broken.
    pub const FLOW_CONTROL_ERROR: ErrorCode = ErrorCode(0x3);
    /// A SETTINGS frame was not acknowledged in time.
    pub const SETTINGS_TIMEOUT: ErrorCode = ErrorCode(0x4);
    /// A frame came on a half-closed stream.
    pub const STREAM_CLOSED: ErrorCode = ErrorCode(0x5);
    /// A frame had a length its type does not allow.
    pub const FRAME_SIZE_ERROR: ErrorCode = ErrorCode(0x6);
    /// The stream was refused before any processing: safe to retry.
    pub const REFUSED_STREAM: ErrorCode = ErrorCode(0x7);
    /// The stream is no longer needed.
    pub const CANCEL: ErrorCode = ErrorCode(0x8);
    /// The HPACK state cannot be kept.
    pub const COMPRESSION_ERROR: ErrorCode = ErrorCode(0x9);
    /// A CONNECT tunnel's connection failed.
    pub const CONNECT_ERROR: ErrorCode = ErrorCode(0xa);
    /// The peer is generating excessive load.
    pub const ENHANCE_YOUR_CALM: ErrorCode = ErrorCode(0xb);
    /// The transport's security is too weak.
    pub const INADEQUATE_SECURITY: ErrorCode = ErrorCode(0xc);
    /// The request must be made over HTTP/1.1.
    pub const HTTP_1_1_REQUIRED: ErrorCode = ErrorCode(0xd);

    /// The name §7 gives the code, if it gives one.
    pub fn name(self) -> Option<&'static str> {
        const NAMES: [&str; 14] = [
            "NO_ERROR",
            "PROTOCOL_ERROR",
            "INTERNAL_ERROR",
            "FLOW_CONTROL_ERROR",
            "SETTINGS_TIMEOUT",
            "STREAM_CLOSED",
            "FRAME_SIZE_ERROR",
            "REFUSED_STREAM",
            "CANCEL",
            "COMPRESSION_ERROR",
            "CONNECT_ERROR",
            "ENHANCE_YOUR_CALM",
            "INADEQUATE_SECURITY",
            "HTTP_1_1_REQUIRED",
        ];
        usize::try_from(self.0).ok().and_then(|i| NAMES.get(i).copied())
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "0x{:x}", self.0),
        }
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ErrorCode({self})")
    }
}

// === impl Frame ===

impl Frame {
    /// Splits the first frame off `buf` if the whole of it is there: `Ok(None)`, with nothing
    /// taken, until it is. `max_frame_size` is the `SETTINGS_MAX_FRAME_SIZE` we announced; a
    /// longer frame is refused once its header is in, without waiting for its payload.
    ///
    /// After a [`FrameError::Stream`] the frame is gone from `buf` and parsing may go on; after
    /// a [`FrameError::Connection`] what is left of `buf` means nothing.
    pub fn parse(buf: &mut BytesMut, max_frame_size: u32) -> Result<Option<Frame>, FrameError> {
        let Some(head) = decode::Head::peek(buf) else {
            return Ok(None);
        };
        if head.len > max_frame_size {
            let violation = Violation::TooLarge {
                len: head.len,
                max: max_frame_size,
            };
            return Err(FrameError::connection(ErrorCode::FRAME_SIZE_ERROR, violation));
        }
        let total = HEADER_LEN + head.len as usize;
        if buf.len() < total {
            return Ok(None);
        }
        let mut frame = buf.split_to(total);
        let payload = frame.split_off(HEADER_LEN).freeze();
        head.frame(payload).map(Some)
    }

    /// The stream the frame is on; 0 for the connection's own frames.
    pub fn stream_id(&self) -> u32 {
        match self {
            Frame::Data { stream_id, .. }
            | Frame::Headers { stream_id, .. }
            | Frame::Priority { stream_id }
            | Frame::RstStream { stream_id, .. }
            | Frame::PushPromise { stream_id, .. }
            | Frame::WindowUpdate { stream_id, .. }
            | Frame::Continuation { stream_id, .. }
            | Frame::Unknown { stream_id, .. } => *stream_id,
            Frame::Settings { .. } | Frame::Ping { .. } | Frame::GoAway { .. } => 0,
        }
    }
}

// === impl FrameError ===

impl FrameError {
    fn connection(code: ErrorCode, violation: Violation) -> FrameError {
        FrameError::Connection { code, violation }
    }

    /// The error code for the GOAWAY or RST_STREAM this error calls for.
    pub fn code(&self) -> ErrorCode {
        match self {
            FrameError::Connection { code, .. } | FrameError::Stream { code, .. } => *code,
        }
    }

    /// The rule the frame broke.
    pub fn violation(&self) -> Violation {
        match self {
            FrameError::Connection { violation, .. } | FrameError::Stream { violation, .. } => *violation,
        }
    }

    /// Whether the whole connection must end, not just one stream.
    pub fn is_connection(&self) -> bool {
        matches!(self, FrameError::Connection { .. })
    }
}

#[cfg(test)]
mod interop;
#[cfg(test)]
mod tests;
