//! A connection's task: reads the socket into the protocol state and hands its events to the
//! streams, writes whatever the streams or the state queued, sends keepalive PINGs while streams
//! are open, and closes the connection once every handle and stream is gone.

use std::sync::Arc;
use std::task::Waker;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};

use super::Keepalive;
use super::{Ended, Error, Shared, State};
use crate::wire::frame::ErrorCode;
use crate::wire::h2client::Event;

/// Bytes read at a time; a frame longer than this is read over several reads.
const READ_CHUNK: usize = 16 * 1024;

/// How long a GOAWAY after a protocol error may take to go out before the socket is dropped.
const LAST_WORDS: Duration = Duration::from_secs(1);

/// The task's own state; the streams' is in [`Shared`].
pub(super) struct Driver<T> {
    io: T,
    shared: Arc<Shared>,
    pings: Option<Pings>,
}

/// PING keepalive: waiting out the interval while streams are open, or waiting for an answer.
struct Pings {
    keepalive: Keepalive,
    timer: std::pin::Pin<Box<Sleep>>,
    armed: bool,
    awaiting: bool,
}

// === impl Driver ===

impl<T: AsyncRead + AsyncWrite + Unpin> Driver<T> {
    pub(super) fn new(io: T, shared: Arc<Shared>, keepalive: Option<Keepalive>) -> Self {
        Driver {
            io,
            shared,
            pings: keepalive.map(Pings::new),
        }
    }

    /// Runs the connection until it ends; every stream still waiting then fails with why.
    pub(super) async fn run(self) -> Ended {
        let Driver {
            io,
            shared,
            mut pings,
        } = self;
        let (mut rd, mut wr) = tokio::io::split(io);
        let mut rbuf = BytesMut::with_capacity(READ_CHUNK);
        let mut wbuf = BytesMut::new();
        let ended = loop {
            let (closing, ping_due) = {
                let mut state = shared.lock();
                let closing = state.senders == 0 && state.slots.is_empty();
                if closing {
                    state.conn.go_away(ErrorCode::NO_ERROR);
                }
                wbuf.extend_from_slice(state.conn.out());
                state.conn.out().clear();
                let streams_open = !state.slots.is_empty();
                let ping_due = pings.as_mut().is_some_and(|p| p.arm(streams_open));
                // The timer must stop once the last stream ends.
                state.wake_on_idle = ping_due;
                (closing, ping_due)
            };
            if closing && wbuf.is_empty() {
                let _ = wr.shutdown().await;
                break Ended::Released;
            }
            let ping_timer = async {
                match pings.as_mut() {
                    Some(p) if ping_due => (&mut p.timer).await,
                    _ => std::future::pending().await,
                }
            };
            tokio::select! {
                read = rd.read_buf(reserve(&mut rbuf)) => match read {
                    Ok(0) => break Ended::Closed,
                    Err(e) => break Ended::Io(Arc::new(e)),
                    Ok(_) => {
                        if let Err(e) = receive(&shared, &mut rbuf, &mut pings) {
                            last_words(&shared, &mut wr).await;
                            break e;
                        }
                    }
                },
                written = wr.write_buf(&mut wbuf), if !wbuf.is_empty() => {
                    if let Err(e) = written {
                        break Ended::Io(Arc::new(e));
                    }
                }
                () = shared.task.notified() => {}
                () = ping_timer => {
                    let p = pings.as_mut().expect("the timer is armed only with keepalive");
                    if p.awaiting {
                        break Ended::Unanswered;
                    }
                    p.sent();
                    shared.lock().conn.ping(*b"egressKA");
                }
            }
        };
        end(&shared, &ended);
        ended
    }
}

/// Room for the next read, without moving what is unparsed.
fn reserve(rbuf: &mut BytesMut) -> &mut BytesMut {
    if rbuf.capacity() - rbuf.len() < READ_CHUNK / 4 {
        rbuf.reserve(READ_CHUNK);
    }
    rbuf
}

/// Hands what was read to the protocol state, and its events to the streams.
fn receive(shared: &Shared, rbuf: &mut BytesMut, pings: &mut Option<Pings>) -> Result<(), Ended> {
    let mut state = shared.lock();
    let received = state.conn.recv(rbuf);
    while let Some(event) = state.conn.next_event() {
        dispatch(&mut state, event, pings);
    }
    // Streams that ended made room.
    state.wake_waiting();
    received.map_err(Ended::Protocol)
}

/// Gives one event to the stream it is for, waking whoever waits on it.
fn dispatch(state: &mut State, event: Event, pings: &mut Option<Pings>) {
    let State {
        conn,
        slots,
        max_streams,
        ..
    } = state;
    match event {
        Event::Head {
            stream_id,
            fields,
            end_stream,
        } => {
            if let Some(slot) = slots.get_mut(&stream_id) {
                slot.head = Some(fields);
                slot.done |= end_stream;
                wake(&mut slot.recv);
            }
        }
        Event::Data {
            stream_id,
            data,
            end_stream,
        } => match slots.get_mut(&stream_id) {
            Some(slot) => {
                slot.data.push(data);
                slot.done |= end_stream;
                wake(&mut slot.recv);
            }
            // Nobody reads it: credited back at once.
            None => conn.release(stream_id, data.len()),
        },
        Event::Trailers { stream_id, fields } => {
            if let Some(slot) = slots.get_mut(&stream_id) {
                slot.trailers = Some(Box::new(fields));
                slot.done = true;
                wake(&mut slot.recv);
            }
        }
        Event::Reset {
            stream_id,
            code,
            cause,
        } => {
            if let Some(slot) = slots.get_mut(&stream_id) {
                // A server that answered in full before reading the whole request may reset
                // the stream to stop the upload (NO_ERROR, RFC 9113 §8.1); the response stands.
                if !slot.done {
                    slot.failed = Some(Box::new(Error::Reset { code, cause }));
                }
                wake(&mut slot.recv);
                wake(&mut slot.send);
            }
        }
        Event::Capacity { stream_id: 0 } => {
            for slot in slots.values_mut() {
                wake(&mut slot.send);
            }
        }
        Event::Capacity { stream_id } => {
            if let Some(slot) = slots.get_mut(&stream_id) {
                wake(&mut slot.send);
            }
        }
        Event::Settings => {
            *max_streams = conn.max_concurrent_streams().try_into().unwrap_or(usize::MAX);
        }
        Event::GoAway { .. } => {}
        Event::Pong { .. } => {
            if let Some(p) = pings {
                p.answered();
            }
        }
    }
}

fn wake(waker: &mut Option<Waker>) {
    if let Some(waker) = waker.take() {
        waker.wake();
    }
}

/// Writes the GOAWAY a protocol error queued, if the socket takes it soon.
async fn last_words<W: AsyncWrite + Unpin>(shared: &Shared, wr: &mut W) {
    let out = {
        let mut state = shared.lock();
        state.conn.out().split()
    };
    let _ = tokio::time::timeout(LAST_WORDS, wr.write_all(&out)).await;
}

/// Fails every stream still waiting with why the connection ended.
fn end(shared: &Shared, ended: &Ended) {
    let mut state = shared.lock();
    state.ended = Some(ended.clone());
    for slot in state.slots.values_mut() {
        if slot.failed.is_none() && !slot.done {
            slot.failed = Some(Box::new(Error::Connection(ended.clone())));
        }
        wake(&mut slot.recv);
        wake(&mut slot.send);
    }
    state.waiting.drain(..).for_each(Waker::wake);
}

// === impl Pings ===

impl Pings {
    fn new(keepalive: Keepalive) -> Self {
        Pings {
            keepalive,
            timer: Box::pin(tokio::time::sleep(keepalive.interval)),
            armed: false,
            awaiting: false,
        }
    }

    /// Whether the timer runs: while streams are open, or while a PING is unanswered. An idle
    /// connection is not pinged (hyper's `keep_alive_while_idle(false)`).
    fn arm(&mut self, streams_open: bool) -> bool {
        if self.awaiting {
            return true;
        }
        if !streams_open {
            self.armed = false;
            return false;
        }
        if !self.armed {
            self.armed = true;
            self.timer
                .as_mut()
                .reset(Instant::now() + self.keepalive.interval);
        }
        true
    }

    fn sent(&mut self) {
        self.awaiting = true;
        self.timer.as_mut().reset(Instant::now() + self.keepalive.timeout);
    }

    fn answered(&mut self) {
        self.awaiting = false;
        self.armed = false;
    }
}
