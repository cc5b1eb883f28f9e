//! Server-sent events framing: splits a `text/event-stream` body into events and hands each
//! event's data to the JSON scanner as it streams, without storing a line.
//!
//! As the SSE specification reads a stream: lines end with `\n`, `\r\n` or `\r`; a blank line
//! ends an event; a line starting with `:` is a comment; `data` lines (one leading space after
//! the colon removed) are joined with `\n` into the event's data; other fields are skipped.
//! An event's data is one JSON document; `[DONE]` (OpenAI's end marker) and empty data are
//! skipped quietly, and data that is not JSON is skipped but remembered (`Lines::malformed`).
//!
//! Not handled: a leading byte order mark (no provider sends one), which the specification
//! strips; here it makes the first line's field unknown.

use memchr::memchr2;

use super::fields::Tally;
use super::json::Scanner;
use super::Reason;

const DATA: &[u8] = b"data";
const DONE: &[u8] = b"[DONE]";
/// `Line::Name`'s and `Lines::done`'s mark for "not that word".
const OTHER: u8 = u8::MAX;

/// Where a line is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At its first byte.
    Start,
    /// In its field name: how much of `data` it matched, or `OTHER`.
    Name(u8),
    /// In a comment, or in the value of a field not read.
    Skip,
    /// Right after `data:`: a space there is not part of the value.
    ValueStart,
    /// In a `data` value.
    Data,
}

/// The SSE state of one body: the line being read and the event it belongs to.
#[derive(Debug)]
pub(super) struct Lines {
    line: Line,
    /// The last line ended with `\r`: a `\n` right after it ends nothing.
    after_cr: bool,
    /// The event has had a field line (it counts as an event when it ends).
    fields: bool,
    /// The event has had a `data` line (the next one is joined with `\n`).
    data: bool,
    /// The event's data is not JSON: the rest of it is not scanned.
    bad: bool,
    /// How much of `[DONE]` the event's data is, or `OTHER`.
    done: u8,
    /// An event's data was not JSON.
    pub(super) malformed: bool,
}

impl Lines {
    pub(super) fn new() -> Lines {
        Lines {
            line: Line::Start,
            after_cr: false,
            fields: false,
            data: false,
            bad: false,
            done: 0,
            malformed: false,
        }
    }

    /// The next bytes of the body.
    pub(super) fn feed(
        &mut self,
        chunk: &[u8],
        scanner: &mut Scanner,
        tally: &mut Tally,
    ) -> Result<(), Reason> {
        let mut i = 0;
        while i < chunk.len() {
            let b = chunk[i];
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    i += 1;
                    continue;
                }
            }
            match self.line {
                Line::Start => match b {
                    b'\n' | b'\r' => {
                        self.after_cr = b == b'\r';
                        self.dispatch(scanner, tally)?;
                    }
                    b':' => self.line = Line::Skip,
                    // Nearly every line: its field name at once, not a byte per dispatch.
                    _ if chunk[i..].first_chunk() == Some(b"data:") => {
                        self.fields = true;
                        self.data_line(scanner, tally)?;
                        self.line = Line::ValueStart;
                        i += DATA.len();
                    }
                    _ => {
                        self.line = Line::Name(0);
                        continue;
                    }
                },
                Line::Name(matched) => match b {
                    b':' | b'\n' | b'\r' => {
                        self.fields = true;
                        let data = usize::from(matched) == DATA.len();
                        if data {
                            self.data_line(scanner, tally)?;
                        }
                        if b == b':' {
                            self.line = if data { Line::ValueStart } else { Line::Skip };
                        } else {
                            self.after_cr = b == b'\r';
                            self.line = Line::Start;
                        }
                    }
                    _ => {
                        let at = usize::from(matched);
                        self.line = Line::Name(if DATA.get(at) == Some(&b) {
                            matched + 1
                        } else {
                            OTHER
                        });
                    }
                },
                Line::ValueStart => {
                    self.line = Line::Data;
                    if b != b' ' {
                        continue;
                    }
                }
                Line::Skip | Line::Data => {
                    let rest = &chunk[i..];
                    let end = memchr2(b'\n', b'\r', rest);
                    if self.line == Line::Data {
                        self.data_bytes(&rest[..end.unwrap_or(rest.len())], scanner, tally)?;
                    }
                    let Some(end) = end else {
                        return Ok(());
                    };
                    i += end;
                    self.after_cr = chunk[i] == b'\r';
                    self.line = Line::Start;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// A `data` line starts: the data so far gets its line feed.
    fn data_line(&mut self, scanner: &mut Scanner, tally: &mut Tally) -> Result<(), Reason> {
        if self.data {
            self.data_bytes(b"\n", scanner, tally)?;
        }
        self.data = true;
        Ok(())
    }

    fn data_bytes(&mut self, bytes: &[u8], scanner: &mut Scanner, tally: &mut Tally) -> Result<(), Reason> {
        if self.done != OTHER {
            for b in bytes {
                let at = usize::from(self.done);
                if DONE.get(at) == Some(b) {
                    self.done += 1;
                } else {
                    self.done = OTHER;
                    break;
                }
            }
        }
        if self.bad {
            return scanner.skip(bytes.len());
        }
        match scanner.scan(bytes, tally) {
            Err(Reason::Malformed) => {
                self.bad = true;
                Ok(())
            }
            other => other,
        }
    }

    /// A blank line: the event ends, and its data's fields commit if it was one JSON value.
    fn dispatch(&mut self, scanner: &mut Scanner, tally: &mut Tally) -> Result<(), Reason> {
        if self.fields {
            scanner.documents += 1;
        }
        let quiet = usize::from(self.done) == DONE.len() || !self.data;
        if !quiet {
            if self.bad {
                self.malformed = true;
            } else {
                match scanner.end(tally) {
                    Ok(true) => tally.commit(),
                    Ok(false) => {}
                    Err(Reason::Malformed) => self.malformed = true,
                    Err(other) => return Err(other),
                }
            }
        }
        self.fields = false;
        self.data = false;
        self.bad = false;
        self.done = 0;
        scanner.reset(tally);
        Ok(())
    }
}
