//! What the peer's bytes do to a client connection: each frame taken off the read buffer and
//! acted on by its type and stream, and a stream's response read from its header blocks and
//! DATA (RFC 9113 §5.1, §6, §8.1).

use bytes::{Bytes, BytesMut};

use super::head::Reader;
use super::streams::{Response, Stream};
use super::{Cause, ConnError, Connection, Event, Fields, Malformed, PendingBlock, Reason, StreamFault};
use crate::wire::frame::{encode, ErrorCode, Frame, FrameError, Settings, Violation, MAX_WINDOW_SIZE};
use crate::wire::hpack::DecodeError;

// === impl Connection ===

impl Connection {
    /// Takes every whole frame off `buf` and acts on it. After an error the connection is
    /// done: a GOAWAY is in [`Self::out`], every open stream got an [`Event::Reset`], and later
    /// calls give the same error.
    pub fn recv(&mut self, buf: &mut BytesMut) -> Result<(), ConnError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        loop {
            let result = match Frame::parse(buf, self.config.max_frame_size) {
                Ok(Some(frame)) => self.frame(frame),
                Ok(None) => return Ok(()),
                Err(FrameError::Stream {
                    stream_id,
                    code,
                    violation,
                }) => self.frame_stream_error(stream_id, code, violation),
                Err(FrameError::Connection { code, violation }) => Err(ConnError {
                    code,
                    reason: Reason::Frame(violation),
                }),
            };
            if let Err(e) = result {
                self.fail(e.clone());
                return Err(e);
            }
        }
    }

    fn fail(&mut self, e: ConnError) {
        if !self.goaway_sent {
            self.goaway_sent = true;
            encode::goaway(0, e.code, b"", &mut self.out);
        }
        for stream in self.streams.drain() {
            self.events.push_back(Event::Reset {
                stream_id: stream.id,
                code: e.code,
                cause: Cause::Connection,
            });
        }
        self.pending_block = None;
        self.failed = Some(e);
    }

    fn frame(&mut self, frame: Frame) -> Result<(), ConnError> {
        if self.pending_block.is_some() {
            return match frame {
                Frame::Continuation {
                    stream_id,
                    fragment,
                    end_headers,
                } => self.continuation(stream_id, &fragment, end_headers),
                _ => Err(protocol(Reason::ContinuationExpected)),
            };
        }
        match frame {
            Frame::Data {
                stream_id,
                data,
                end_stream,
                flow_len,
            } => self.data(stream_id, data, end_stream, flow_len),
            Frame::Headers {
                stream_id,
                fragment,
                end_stream,
                end_headers,
            } => self.headers(stream_id, fragment, end_stream, end_headers),
            Frame::Priority { .. } | Frame::Unknown { .. } => Ok(()),
            Frame::RstStream {
                stream_id,
                error_code,
            } => self.rst_stream(stream_id, error_code),
            Frame::Settings { ack, settings } => self.settings(ack, &settings),
            Frame::PushPromise { .. } => Err(protocol(Reason::Push)),
            Frame::Ping { ack: true, payload } => {
                self.events.push_back(Event::Pong { payload });
                Ok(())
            }
            Frame::Ping { ack: false, payload } => {
                encode::ping_ack(payload, &mut self.out);
                Ok(())
            }
            Frame::GoAway {
                last_stream_id,
                error_code,
                debug_data,
            } => {
                self.goaway(last_stream_id, error_code, debug_data);
                Ok(())
            }
            Frame::WindowUpdate { stream_id, increment } => self.window_update(stream_id, increment),
            Frame::Continuation { .. } => Err(protocol(Reason::StrayContinuation)),
        }
    }

    /// Whether `stream_id` is one we never opened (§5.1: idle); a server opens none, and we
    /// disabled push.
    fn is_idle(&self, stream_id: u32) -> bool {
        stream_id.is_multiple_of(2) || stream_id >= self.next_id
    }

    /// The open stream, `Ok(None)` for one that has closed, an error for an idle one.
    fn stream(&mut self, stream_id: u32) -> Result<Option<&mut Stream>, ConnError> {
        if self.is_idle(stream_id) {
            return Err(protocol(Reason::IdleStream(stream_id)));
        }
        Ok(self.streams.get_mut(stream_id))
    }

    fn frame_stream_error(
        &mut self,
        stream_id: u32,
        code: ErrorCode,
        violation: Violation,
    ) -> Result<(), ConnError> {
        if self.pending_block.is_some() {
            return Err(protocol(Reason::ContinuationExpected));
        }
        if !self.is_idle(stream_id) {
            self.stream_fault(stream_id, code, StreamFault::Frame(violation));
        }
        Ok(())
    }

    /// Resets an open stream for what the peer sent on it.
    fn stream_fault(&mut self, stream_id: u32, code: ErrorCode, fault: StreamFault) {
        if self.streams.remove(stream_id).is_some() {
            encode::rst_stream(stream_id, code, &mut self.out);
            self.events.push_back(Event::Reset {
                stream_id,
                code,
                cause: Cause::Fault(fault),
            });
        }
    }

    fn data(
        &mut self,
        stream_id: u32,
        data: Bytes,
        end_stream: bool,
        flow_len: u32,
    ) -> Result<(), ConnError> {
        let flow = i64::from(flow_len);
        if flow > self.recv_window {
            return Err(flow_control(Reason::WindowExceeded));
        }
        self.recv_window -= flow;
        let Some(stream) = self.stream(stream_id)? else {
            self.credit_connection(flow_len);
            return Ok(());
        };
        let fault = if stream.remote_closed {
            Some((ErrorCode::STREAM_CLOSED, StreamFault::AfterEnd))
        } else if flow > stream.recv_window {
            Some((ErrorCode::FLOW_CONTROL_ERROR, StreamFault::WindowExceeded))
        } else {
            stream.recv_window -= flow;
            body_fault(stream, data.len(), end_stream)
                .map(|m| (ErrorCode::PROTOCOL_ERROR, StreamFault::Malformed(m)))
        };
        if let Some((code, fault)) = fault {
            self.credit_connection(flow_len);
            self.stream_fault(stream_id, code, fault);
            return Ok(());
        }
        stream.remote_closed = end_stream;
        let done = stream.is_done();
        // Padding is nobody's to consume: credited back now.
        let padding = flow_len - data.len() as u32;
        if padding > 0 {
            self.release(stream_id, padding as usize);
        }
        if done {
            self.streams.remove(stream_id);
        }
        self.events.push_back(Event::Data {
            stream_id,
            data,
            end_stream,
        });
        Ok(())
    }

    fn headers(
        &mut self,
        stream_id: u32,
        fragment: Bytes,
        end_stream: bool,
        end_headers: bool,
    ) -> Result<(), ConnError> {
        if self.is_idle(stream_id) {
            return Err(protocol(Reason::IdleStream(stream_id)));
        }
        if end_headers {
            return self.block(stream_id, &fragment, end_stream);
        }
        self.check_block_len(fragment.len())?;
        self.pending_block = Some(PendingBlock {
            stream_id,
            block: BytesMut::from(&fragment[..]),
            end_stream,
        });
        Ok(())
    }

    fn continuation(&mut self, stream_id: u32, fragment: &[u8], end_headers: bool) -> Result<(), ConnError> {
        let pending_len = match &self.pending_block {
            Some(pending) if pending.stream_id == stream_id => pending.block.len(),
            _ => return Err(protocol(Reason::ContinuationExpected)),
        };
        self.check_block_len(pending_len + fragment.len())?;
        let Some(mut pending) = self.pending_block.take() else {
            return Err(protocol(Reason::StrayContinuation));
        };
        pending.block.extend_from_slice(fragment);
        if end_headers {
            return self.block(pending.stream_id, &pending.block, pending.end_stream);
        }
        self.pending_block = Some(pending);
        Ok(())
    }

    /// A compressed block is never longer than the fields it codes plus a few bytes each, so
    /// one past the list size and a frame is refused unread; its fields would be anyway.
    fn check_block_len(&self, len: usize) -> Result<(), ConnError> {
        let max = self.config.max_header_list_size as usize + self.config.max_frame_size as usize;
        if len > max {
            return Err(ConnError {
                code: ErrorCode::ENHANCE_YOUR_CALM,
                reason: Reason::BlockTooLarge,
            });
        }
        Ok(())
    }

    /// A whole header block: decoded whatever becomes of the stream, to keep HPACK in step.
    fn block(&mut self, stream_id: u32, block: &[u8], end_stream: bool) -> Result<(), ConnError> {
        let trailers = self
            .streams
            .get_mut(stream_id)
            .is_some_and(|s| matches!(s.response, Response::Body { .. }));
        let mut reader = Reader::new(trailers, block.len(), &mut self.lines);
        let decoded = match self.decoder.decode(block, |field| reader.field(field)) {
            Ok(()) => reader.finish().map_err(StreamFault::Malformed),
            Err(DecodeError::Block(e)) => {
                return Err(ConnError {
                    code: ErrorCode::COMPRESSION_ERROR,
                    reason: Reason::Compression(e),
                })
            }
            Err(DecodeError::ListTooLarge { .. }) => Err(StreamFault::ListTooLarge),
            Err(DecodeError::Field(m)) => Err(StreamFault::Malformed(m)),
        };
        // What a refused block wrote before it was refused.
        self.lines.clear();
        let Some(stream) = self.streams.get_mut(stream_id) else {
            return Ok(());
        };
        let fields = match decoded {
            Ok(_) if stream.remote_closed => Err((ErrorCode::STREAM_CLOSED, StreamFault::AfterEnd)),
            Ok(fields) => Ok(fields),
            Err(fault) => Err((ErrorCode::PROTOCOL_ERROR, fault)),
        };
        let event = fields.and_then(|fields| {
            response_event(stream, fields, end_stream)
                .map_err(|m| (ErrorCode::PROTOCOL_ERROR, StreamFault::Malformed(m)))
        });
        match event {
            Ok(None) => {}
            Ok(Some(event)) => {
                if stream.is_done() {
                    self.streams.remove(stream_id);
                }
                self.events.push_back(event);
            }
            Err((code, fault)) => self.stream_fault(stream_id, code, fault),
        }
        Ok(())
    }

    fn rst_stream(&mut self, stream_id: u32, code: ErrorCode) -> Result<(), ConnError> {
        if self.stream(stream_id)?.is_some() {
            self.streams.remove(stream_id);
            self.events.push_back(Event::Reset {
                stream_id,
                code,
                cause: Cause::Peer,
            });
        }
        Ok(())
    }

    fn settings(&mut self, ack: bool, settings: &Settings) -> Result<(), ConnError> {
        if ack {
            self.settings_unacked = self.settings_unacked.saturating_sub(1);
            return Ok(());
        }
        if settings.enable_push == Some(true) {
            return Err(protocol(Reason::Push));
        }
        if let Some(window) = settings.initial_window_size {
            let delta = i64::from(window) - i64::from(self.peer.initial_window_size);
            for stream in self.streams.iter_mut() {
                stream.send_window += delta;
                if stream.send_window > i64::from(MAX_WINDOW_SIZE) {
                    return Err(flow_control(Reason::WindowOverflow));
                }
            }
            self.peer.initial_window_size = window;
            if delta > 0 {
                self.events.push_back(Event::Capacity { stream_id: 0 });
            }
        }
        if let Some(size) = settings.max_frame_size {
            self.peer.max_frame_size = size;
        }
        if let Some(max) = settings.max_concurrent_streams {
            self.peer.max_concurrent_streams = max;
        }
        // SETTINGS_HEADER_TABLE_SIZE bounds a table our encoder never fills; the peer's
        // SETTINGS_MAX_HEADER_LIST_SIZE is advice (§6.5.2) the request path's own limits meet.
        encode::settings_ack(&mut self.out);
        self.events.push_back(Event::Settings);
        Ok(())
    }

    fn goaway(&mut self, last_stream_id: u32, code: ErrorCode, debug_data: Bytes) {
        let last = self
            .goaway_received
            .map_or(last_stream_id, |seen| seen.min(last_stream_id));
        self.goaway_received = Some(last);
        for stream in self.streams.split_above(last) {
            self.events.push_back(Event::Reset {
                stream_id: stream.id,
                code,
                cause: Cause::Unprocessed,
            });
        }
        self.events.push_back(Event::GoAway {
            last_stream_id: last,
            code,
            debug_data,
        });
    }

    fn window_update(&mut self, stream_id: u32, increment: u32) -> Result<(), ConnError> {
        let max = i64::from(MAX_WINDOW_SIZE);
        if stream_id == 0 {
            self.send_window += i64::from(increment);
            if self.send_window > max {
                return Err(flow_control(Reason::WindowOverflow));
            }
        } else {
            let Some(stream) = self.stream(stream_id)? else {
                return Ok(());
            };
            stream.send_window += i64::from(increment);
            if stream.send_window > max {
                self.stream_fault(
                    stream_id,
                    ErrorCode::FLOW_CONTROL_ERROR,
                    StreamFault::WindowOverflow,
                );
                return Ok(());
            }
        }
        self.events.push_back(Event::Capacity { stream_id });
        Ok(())
    }
}

/// What a whole, valid block means for its stream: a head, trailers, or (an informational
/// head) nothing.
fn response_event(stream: &mut Stream, fields: Fields, end_stream: bool) -> Result<Option<Event>, Malformed> {
    let stream_id = stream.id;
    match stream.response {
        Response::AwaitingHead if (100..200).contains(&fields.status) => {
            if end_stream || fields.status == 101 {
                return Err(Malformed::Informational);
            }
            Ok(None)
        }
        Response::AwaitingHead => {
            let bodiless = stream.head_request || fields.status == 204 || fields.status == 304;
            let expected = if bodiless { Some(0) } else { fields.content_length };
            stream.response = Response::Body {
                expected,
                received: 0,
            };
            // A HEAD's or a 304's Content-Length describes a body not sent.
            if end_stream && !bodiless && expected.is_some_and(|n| n != 0) {
                return Err(Malformed::BodyLength);
            }
            stream.remote_closed = end_stream;
            Ok(Some(Event::Head {
                stream_id,
                fields,
                end_stream,
            }))
        }
        Response::Body { expected, received } => {
            if !end_stream {
                return Err(Malformed::TrailersWithoutEnd);
            }
            if expected.is_some_and(|n| n != received) {
                return Err(Malformed::BodyLength);
            }
            stream.response = Response::Trailers;
            stream.remote_closed = true;
            Ok(Some(Event::Trailers { stream_id, fields }))
        }
        Response::Trailers => Err(Malformed::TrailersWithoutEnd),
    }
}

/// What is wrong, if anything, with `len` more body bytes (the last when `end_stream`).
fn body_fault(stream: &mut Stream, len: usize, end_stream: bool) -> Option<Malformed> {
    let Response::Body { expected, received } = &mut stream.response else {
        return Some(Malformed::DataBeforeHead);
    };
    *received += len as u64;
    let wrong = expected.is_some_and(|n| *received > n || (end_stream && *received != n));
    wrong.then_some(Malformed::BodyLength)
}

fn protocol(reason: Reason) -> ConnError {
    ConnError {
        code: ErrorCode::PROTOCOL_ERROR,
        reason,
    }
}

fn flow_control(reason: Reason) -> ConnError {
    ConnError {
        code: ErrorCode::FLOW_CONTROL_ERROR,
        reason,
    }
}
