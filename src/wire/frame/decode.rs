//! The shape of each frame type (RFC 9113 §6): its header read, its payload checked and cut into
//! a [`Frame`]. Only what the frame's own bytes decide; see the module doc of `frame` for what
//! the connection checks.

use bytes::Bytes;

use super::{
    flags, ErrorCode, Frame, FrameError, Kind, Settings, Violation, HEADER_LEN, MAX_WINDOW_SIZE,
    STREAM_ID_MASK,
};

/// Bytes of stream dependency and weight a HEADERS frame with the PRIORITY flag carries, and
/// the whole of a PRIORITY frame's payload.
const PRIORITY_LEN: u32 = 5;

/// Bytes of an RST_STREAM payload, and of a WINDOW_UPDATE's.
const WORD_LEN: u32 = 4;

/// Bytes of a PING payload.
const PING_LEN: u32 = 8;

/// Bytes of a GOAWAY's last stream id and error code, before its debug data.
const GOAWAY_FIXED_LEN: u32 = 8;

/// Bytes of one SETTINGS parameter: a 16-bit identifier, a 32-bit value.
const SETTING_LEN: usize = 6;

/// A frame header (§4.1), read before its payload is in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Head {
    /// The payload's length.
    pub(super) len: u32,
    kind: u8,
    flags: u8,
    /// Reserved bit cleared.
    stream_id: u32,
}

// === impl Head ===

impl Head {
    /// The header at the front of `buf`, once its nine bytes are there.
    pub(super) fn peek(buf: &[u8]) -> Option<Head> {
        let h = buf.first_chunk::<HEADER_LEN>()?;
        Some(Head {
            len: u32::from_be_bytes([0, h[0], h[1], h[2]]),
            kind: h[3],
            flags: h[4],
            stream_id: u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & STREAM_ID_MASK,
        })
    }

    /// The frame this header and its whole `payload` make, if its shape is sound.
    pub(super) fn frame(self, payload: Bytes) -> Result<Frame, FrameError> {
        let Some(kind) = Kind::from_u8(self.kind) else {
            return Ok(Frame::Unknown {
                kind: self.kind,
                stream_id: self.stream_id,
                len: self.len,
            });
        };
        match kind {
            Kind::Data => self.data(payload),
            Kind::Headers => self.headers(payload),
            Kind::Priority => self.priority(),
            Kind::RstStream => self.rst_stream(&payload),
            Kind::Settings => self.settings(&payload),
            Kind::PushPromise => self.push_promise(payload),
            Kind::Ping => self.ping(&payload),
            Kind::GoAway => self.goaway(payload),
            Kind::WindowUpdate => self.window_update(&payload),
            Kind::Continuation => self.continuation(payload),
        }
    }

    fn data(self, payload: Bytes) -> Result<Frame, FrameError> {
        self.on_stream(Kind::Data)?;
        Ok(Frame::Data {
            stream_id: self.stream_id,
            data: self.unpad(Kind::Data, payload)?,
            end_stream: self.has(flags::END_STREAM),
            flow_len: self.len,
        })
    }

    fn headers(self, payload: Bytes) -> Result<Frame, FrameError> {
        self.on_stream(Kind::Headers)?;
        let mut fragment = self.unpad(Kind::Headers, payload)?;
        if self.has(flags::PRIORITY) {
            // Deprecated signals (§5.3.2): skipped unread, so a self-dependency is not looked for.
            if fragment.len() < PRIORITY_LEN as usize {
                return Err(self.length_error(Kind::Headers));
            }
            fragment = fragment.slice(PRIORITY_LEN as usize..);
        }
        Ok(Frame::Headers {
            stream_id: self.stream_id,
            fragment,
            end_stream: self.has(flags::END_STREAM),
            end_headers: self.has(flags::END_HEADERS),
        })
    }

    fn priority(self) -> Result<Frame, FrameError> {
        self.on_stream(Kind::Priority)?;
        if self.len != PRIORITY_LEN {
            // The one length rule §6 makes a stream error: nothing of the connection hangs on it.
            return Err(FrameError::Stream {
                stream_id: self.stream_id,
                code: ErrorCode::FRAME_SIZE_ERROR,
                violation: self.length_violation(Kind::Priority),
            });
        }
        Ok(Frame::Priority {
            stream_id: self.stream_id,
        })
    }

    fn rst_stream(self, payload: &[u8]) -> Result<Frame, FrameError> {
        self.on_stream(Kind::RstStream)?;
        self.exact_len(Kind::RstStream, WORD_LEN)?;
        Ok(Frame::RstStream {
            stream_id: self.stream_id,
            error_code: ErrorCode(word(payload, 0)),
        })
    }

    fn settings(self, payload: &[u8]) -> Result<Frame, FrameError> {
        self.on_connection(Kind::Settings)?;
        let ack = self.has(flags::ACK);
        let whole = (self.len as usize).is_multiple_of(SETTING_LEN);
        if (ack && self.len != 0) || !whole {
            return Err(self.length_error(Kind::Settings));
        }
        Ok(Frame::Settings {
            ack,
            settings: parameters(payload)?,
        })
    }

    fn push_promise(self, payload: Bytes) -> Result<Frame, FrameError> {
        self.on_stream(Kind::PushPromise)?;
        let fragment = self.unpad(Kind::PushPromise, payload)?;
        if fragment.len() < WORD_LEN as usize {
            return Err(self.length_error(Kind::PushPromise));
        }
        Ok(Frame::PushPromise {
            stream_id: self.stream_id,
            promised_stream_id: word(&fragment, 0) & STREAM_ID_MASK,
            fragment: fragment.slice(WORD_LEN as usize..),
            end_headers: self.has(flags::END_HEADERS),
        })
    }

    fn ping(self, payload: &[u8]) -> Result<Frame, FrameError> {
        self.on_connection(Kind::Ping)?;
        self.exact_len(Kind::Ping, PING_LEN)?;
        let opaque = payload.first_chunk().copied().unwrap_or_default();
        Ok(Frame::Ping {
            ack: self.has(flags::ACK),
            payload: opaque,
        })
    }

    fn goaway(self, payload: Bytes) -> Result<Frame, FrameError> {
        self.on_connection(Kind::GoAway)?;
        if self.len < GOAWAY_FIXED_LEN {
            return Err(self.length_error(Kind::GoAway));
        }
        Ok(Frame::GoAway {
            last_stream_id: word(&payload, 0) & STREAM_ID_MASK,
            error_code: ErrorCode(word(&payload, 4)),
            debug_data: payload.slice(GOAWAY_FIXED_LEN as usize..),
        })
    }

    fn window_update(self, payload: &[u8]) -> Result<Frame, FrameError> {
        self.exact_len(Kind::WindowUpdate, WORD_LEN)?;
        // The reserved bit is ignored, so the increment is at most 2^31 - 1 by construction.
        let increment = word(payload, 0) & MAX_WINDOW_SIZE;
        if increment == 0 {
            let (code, violation) = (ErrorCode::PROTOCOL_ERROR, Violation::ZeroIncrement);
            return Err(match self.stream_id {
                0 => FrameError::connection(code, violation),
                stream_id => FrameError::Stream {
                    stream_id,
                    code,
                    violation,
                },
            });
        }
        Ok(Frame::WindowUpdate {
            stream_id: self.stream_id,
            increment,
        })
    }

    fn continuation(self, payload: Bytes) -> Result<Frame, FrameError> {
        self.on_stream(Kind::Continuation)?;
        Ok(Frame::Continuation {
            stream_id: self.stream_id,
            fragment: payload,
            end_headers: self.has(flags::END_HEADERS),
        })
    }

    fn has(self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// A type that belongs to a stream must name one: stream 0 is a connection PROTOCOL_ERROR
    /// for every such type (§6.1 to §6.4, §6.6, §6.10).
    fn on_stream(self, kind: Kind) -> Result<(), FrameError> {
        if self.stream_id == 0 {
            let violation = Violation::StreamZero(kind);
            return Err(FrameError::connection(ErrorCode::PROTOCOL_ERROR, violation));
        }
        Ok(())
    }

    /// A type that belongs to the connection must be on stream 0 (§6.5, §6.7, §6.8).
    fn on_connection(self, kind: Kind) -> Result<(), FrameError> {
        if self.stream_id != 0 {
            let violation = Violation::NotStreamZero {
                kind,
                stream_id: self.stream_id,
            };
            return Err(FrameError::connection(ErrorCode::PROTOCOL_ERROR, violation));
        }
        Ok(())
    }

    fn exact_len(self, kind: Kind, len: u32) -> Result<(), FrameError> {
        if self.len != len {
            return Err(self.length_error(kind));
        }
        Ok(())
    }

    fn length_violation(self, kind: Kind) -> Violation {
        Violation::Length { kind, len: self.len }
    }

    /// A length the type does not allow: a connection FRAME_SIZE_ERROR (§4.2, and each type's
    /// section), PRIORITY's aside.
    fn length_error(self, kind: Kind) -> FrameError {
        FrameError::connection(ErrorCode::FRAME_SIZE_ERROR, self.length_violation(kind))
    }

    /// The payload without its pad length byte and padding, when PADDED is set.
    fn unpad(self, kind: Kind, payload: Bytes) -> Result<Bytes, FrameError> {
        if !self.has(flags::PADDED) {
            return Ok(payload);
        }
        let Some(&pad) = payload.first() else {
            // No room for the pad length byte itself: too short for the type's fields.
            return Err(self.length_error(kind));
        };
        if u32::from(pad) >= self.len {
            let violation = Violation::Padding { pad, len: self.len };
            return Err(FrameError::connection(ErrorCode::PROTOCOL_ERROR, violation));
        }
        Ok(payload.slice(1..payload.len() - usize::from(pad)))
    }
}

/// SETTINGS parameters (§6.5.2), each value checked; unknown identifiers are ignored (§6.5.2).
fn parameters(payload: &[u8]) -> Result<Settings, FrameError> {
    let mut settings = Settings::default();
    for param in payload.chunks_exact(SETTING_LEN) {
        let id = u16::from_be_bytes([param[0], param[1]]);
        let value = word(param, 2);
        match id {
            0x1 => settings.header_table_size = Some(value),
            0x2 => settings.enable_push = Some(enable_push(value)?),
            0x3 => settings.max_concurrent_streams = Some(value),
            0x4 => settings.initial_window_size = Some(initial_window_size(value)?),
            0x5 => settings.max_frame_size = Some(max_frame_size(value)?),
            0x6 => settings.max_header_list_size = Some(value),
            _ => {}
        }
    }
    Ok(settings)
}

fn enable_push(value: u32) -> Result<bool, FrameError> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(FrameError::connection(
            ErrorCode::PROTOCOL_ERROR,
            Violation::EnablePush(value),
        )),
    }
}

fn initial_window_size(value: u32) -> Result<u32, FrameError> {
    if value > MAX_WINDOW_SIZE {
        // FLOW_CONTROL_ERROR, not PROTOCOL_ERROR: §6.5.2 names it for this one.
        return Err(FrameError::connection(
            ErrorCode::FLOW_CONTROL_ERROR,
            Violation::InitialWindowSize(value),
        ));
    }
    Ok(value)
}

fn max_frame_size(value: u32) -> Result<u32, FrameError> {
    if !(super::DEFAULT_MAX_FRAME_SIZE..=super::MAX_MAX_FRAME_SIZE).contains(&value) {
        return Err(FrameError::connection(
            ErrorCode::PROTOCOL_ERROR,
            Violation::MaxFrameSize(value),
        ));
    }
    Ok(value)
}

/// The big-endian 32-bit word at `at`; callers have checked the length, and a short slice reads
/// as 0 rather than panicking on a peer's bytes.
fn word(bytes: &[u8], at: usize) -> u32 {
    bytes
        .get(at..)
        .and_then(<[u8]>::first_chunk::<4>)
        .map_or(0, |w| u32::from_be_bytes(*w))
}
