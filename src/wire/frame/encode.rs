//! Appending the frames a client sends to a write buffer: SETTINGS and its ACK, WINDOW_UPDATE,
//! PING and its ACK, RST_STREAM, GOAWAY, DATA, and HEADERS with the CONTINUATIONs a header
//! block longer than the peer's `SETTINGS_MAX_FRAME_SIZE` needs. The preface is
//! [`super::PREFACE`]. Nothing is padded and no priority is sent (§5.3.2).
//!
//! Arguments come from the connection, not from the peer's bytes: a stream id above 2^31 - 1 or
//! a window increment of 0 is a bug there, caught by debug assertions only.

use bytes::{BufMut, BytesMut};

use super::{
    flags, ErrorCode, Kind, Settings, DEFAULT_MAX_FRAME_SIZE, HEADER_LEN, MAX_MAX_FRAME_SIZE,
    MAX_WINDOW_SIZE, STREAM_ID_MASK,
};

/// Bytes of a GOAWAY's last stream id and error code, before its debug data.
const GOAWAY_FIXED_LEN: usize = 8;

/// Appends our SETTINGS, the parameters that are `Some` in identifier order.
pub fn settings(settings: &Settings, dst: &mut BytesMut) {
    let params = [
        (0x1, settings.header_table_size),
        (0x2, settings.enable_push.map(u32::from)),
        (0x3, settings.max_concurrent_streams),
        (0x4, settings.initial_window_size),
        (0x5, settings.max_frame_size),
        (0x6, settings.max_header_list_size),
    ];
    let count = params.iter().filter(|(_, value)| value.is_some()).count();
    head(count * 6, Kind::Settings, 0, 0, dst);
    for (id, value) in params {
        if let Some(value) = value {
            dst.put_u16(id);
            dst.put_u32(value);
        }
    }
}

/// Appends the acknowledgement of the peer's SETTINGS.
pub fn settings_ack(dst: &mut BytesMut) {
    head(0, Kind::Settings, flags::ACK, 0, dst);
}

/// Appends a WINDOW_UPDATE of `increment` (1 to 2^31 - 1) for `stream_id`, 0 for the
/// connection's window.
pub fn window_update(stream_id: u32, increment: u32, dst: &mut BytesMut) {
    debug_assert!(
        (1..=MAX_WINDOW_SIZE).contains(&increment),
        "window increment {increment}"
    );
    head(4, Kind::WindowUpdate, 0, stream_id, dst);
    dst.put_u32(increment & MAX_WINDOW_SIZE);
}

/// Appends a PING carrying `payload`.
pub fn ping(payload: [u8; 8], dst: &mut BytesMut) {
    head(payload.len(), Kind::Ping, 0, 0, dst);
    dst.put_slice(&payload);
}

/// Appends the answer to the peer's PING, echoing its `payload`.
pub fn ping_ack(payload: [u8; 8], dst: &mut BytesMut) {
    head(payload.len(), Kind::Ping, flags::ACK, 0, dst);
    dst.put_slice(&payload);
}

/// Appends an RST_STREAM ending `stream_id` with `code`.
pub fn rst_stream(stream_id: u32, code: ErrorCode, dst: &mut BytesMut) {
    head(4, Kind::RstStream, 0, stream_id, dst);
    dst.put_u32(code.0);
}

/// Appends a GOAWAY. `debug_data` is cut to what fits a frame of 16,384 bytes, the size every
/// peer accepts, so that no `SETTINGS_MAX_FRAME_SIZE` need be known to end a connection.
pub fn goaway(last_stream_id: u32, code: ErrorCode, debug_data: &[u8], dst: &mut BytesMut) {
    let room = DEFAULT_MAX_FRAME_SIZE as usize - GOAWAY_FIXED_LEN;
    let debug_data = &debug_data[..debug_data.len().min(room)];
    head(GOAWAY_FIXED_LEN + debug_data.len(), Kind::GoAway, 0, 0, dst);
    dst.put_u32(last_stream_id & STREAM_ID_MASK);
    dst.put_u32(code.0);
    dst.put_slice(debug_data);
}

/// Appends `data` for `stream_id` as DATA frames of at most `max_frame_size` (the peer's
/// `SETTINGS_MAX_FRAME_SIZE`), END_STREAM on the last when `end_stream`; empty `data` is one
/// empty frame. Flow control is the caller's: `data` must fit the windows.
pub fn data(stream_id: u32, data: &[u8], end_stream: bool, max_frame_size: u32, dst: &mut BytesMut) {
    let last = if end_stream { flags::END_STREAM } else { 0 };
    let split = Split {
        first: (Kind::Data, 0),
        then: Kind::Data,
        last,
    };
    split.put(stream_id, data, max_frame_size, dst);
}

/// Appends a header block (HPACK-coded, see [`crate::wire::hpack::Encoder`]) for `stream_id`:
/// a HEADERS frame, then CONTINUATIONs while the block is longer than `max_frame_size` (the
/// peer's `SETTINGS_MAX_FRAME_SIZE`), END_HEADERS on the last. END_STREAM goes on the HEADERS
/// frame when `end_stream` (§6.2: it belongs to HEADERS even when CONTINUATIONs follow).
pub fn headers(stream_id: u32, block: &[u8], end_stream: bool, max_frame_size: u32, dst: &mut BytesMut) {
    let first = if end_stream { flags::END_STREAM } else { 0 };
    let split = Split {
        first: (Kind::Headers, first),
        then: Kind::Continuation,
        last: flags::END_HEADERS,
    };
    split.put(stream_id, block, max_frame_size, dst);
}

/// How a payload longer than one frame is spread over several.
#[derive(Debug, Clone, Copy)]
struct Split {
    /// The first frame's type and flags.
    first: (Kind, u8),
    /// The type of the frames after it.
    then: Kind,
    /// The flag the last frame carries (the first too, when it is the only one).
    last: u8,
}

// === impl Split ===

impl Split {
    fn put(self, stream_id: u32, payload: &[u8], max_frame_size: u32, dst: &mut BytesMut) {
        // A peer's value is checked to be 16,384 or more when parsed; the clamp keeps a caller's
        // 0 from making `chunks` panic.
        let max = max_frame_size.clamp(1, MAX_MAX_FRAME_SIZE) as usize;
        let frames = payload.len().div_ceil(max).max(1);
        dst.reserve(payload.len() + frames * HEADER_LEN);
        let mut chunks = payload.chunks(max).peekable();
        let (mut kind, mut flags) = self.first;
        loop {
            let chunk = chunks.next().unwrap_or_default();
            let done = chunks.peek().is_none();
            if done {
                flags |= self.last;
            }
            head(chunk.len(), kind, flags, stream_id, dst);
            dst.put_slice(chunk);
            if done {
                return;
            }
            (kind, flags) = (self.then, 0);
        }
    }
}

/// Appends a frame header (§4.1) for a payload of `len` bytes.
fn head(len: usize, kind: Kind, flags: u8, stream_id: u32, dst: &mut BytesMut) {
    debug_assert!(len <= MAX_MAX_FRAME_SIZE as usize, "frame of {len} bytes");
    debug_assert!(stream_id <= STREAM_ID_MASK, "stream id {stream_id}");
    // The low three bytes of the length: what fits 24 bits, asserted above.
    let len = (len as u32).to_be_bytes();
    dst.reserve(HEADER_LEN);
    dst.put_slice(&len[1..]);
    dst.put_u8(kind as u8);
    dst.put_u8(flags);
    dst.put_u32(stream_id & STREAM_ID_MASK);
}
