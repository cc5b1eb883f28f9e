//! The reader of one response body ([`Reader`]) and its incremental JSON scanner: checks that
//! each document is well-formed JSON, byte by byte in bounded state, and hands the fields on the
//! known paths to the tally as it meets them.
//!
//! The scanner keeps no text: a key is matched against the known keys of its length once its
//! end quote is found (part by part when a chunk ends inside it), a
//! string is skipped with `memchr` up to its next quote or backslash, a number is validated
//! digit by digit (and summed when it is a count), and nesting is one bit per level. What is not
//! checked: control characters and UTF-8 inside strings (they are skipped, not validated, so
//! that a completion's text costs a `memchr` and not a branch per byte).
//!
//! Not handled here: SSE framing (`sse`), the paths and counts (`fields`).

use memchr::memchr2;

use super::fields::{KeyMatch, Node, Slot, Tally, Target};
use super::sse::Lines;
use super::{Framing, Outcome, Reason, Shapes, Usage, DEPTH_MAX, DOCUMENT_MAX};

/// The largest count taken: JSON numbers past 2^53 lose precision in most parsers, so a
/// provider never sends one; a larger value is taken as not a count.
const COUNT_MAX: u64 = 1 << 53;

/// The longest known path: root object, `message`, `usage`, a details object.
const CHAIN: usize = 4;

/// Reads one response body's usage as it streams past, in bounded state.
#[derive(Debug)]
pub struct Reader {
    framing: Framing,
    scanner: Scanner,
    lines: Lines,
    tally: Tally,
    gave_up: Option<Reason>,
    /// Set by the first `finish`: whether the body was complete.
    finished: Option<bool>,
}

impl Reader {
    /// A reader of a body framed as `framing`, taking `shapes`' fields.
    pub fn new(framing: Framing, shapes: Shapes) -> Reader {
        Reader {
            framing,
            scanner: Scanner::new(shapes, framing == Framing::Json),
            lines: Lines::new(),
            tally: Tally::new(),
            gave_up: None,
            finished: None,
        }
    }

    /// The next bytes of the body, in order.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.gave_up.is_some() || self.finished.is_some() {
            return;
        }
        let read = match self.framing {
            Framing::Json => self.scanner.scan(chunk, &mut self.tally),
            Framing::Sse => self.lines.feed(chunk, &mut self.scanner, &mut self.tally),
        };
        if let Err(reason) = read {
            self.gave_up = Some(reason);
        }
    }

    /// How the body carries its JSON.
    pub fn framing(&self) -> Framing {
        self.framing
    }

    /// Documents ended so far: SSE events (whatever their data; an event is a block of lines
    /// with at least one field, so comment-only keep-alives are not counted), or JSON documents
    /// (1 once the root value closed, or one per element of a root array).
    pub fn events(&self) -> u64 {
        self.scanner.documents
    }

    /// Whether a usage count's key of an accepted shape has been seen, on its path.
    pub fn shaped(&self) -> bool {
        self.tally.shaped
    }

    /// What the body said, once it ended (`complete`) or was cut. A second call returns what the
    /// first did.
    ///
    /// An SSE body's last event, when no blank line ended it, is discarded even in a complete
    /// body, as the SSE specification says.
    pub fn finish(&mut self, complete: bool) -> Outcome {
        if self.finished.is_none() {
            self.finished = Some(complete);
            if complete && self.gave_up.is_none() && self.framing == Framing::Json {
                // An empty body is not JSON either.
                match self.scanner.end(&mut self.tally) {
                    Ok(true) => {}
                    Ok(false) => self.gave_up = Some(Reason::Malformed),
                    Err(reason) => self.gave_up = Some(reason),
                }
            }
        }
        let complete = self.finished == Some(true);
        let model = self.tally.model();
        if let Some(reason) = self.gave_up {
            return Outcome::Unreadable { reason, model };
        }
        let counts = self.tally.committed();
        if counts.has_totals() {
            return Outcome::Read(Usage {
                tokens: counts.tokens(),
                model,
            });
        }
        let reason = if !complete {
            Reason::Cut
        } else if self.lines.malformed {
            Reason::Malformed
        } else {
            Reason::NoUsage
        };
        Outcome::Unreadable { reason, model }
    }
}

/// Where the scanner is in the JSON grammar. Flat, so that the byte loop dispatches on one
/// byte: what a state needs besides (which string an escape is in, a number's part, the literal)
/// is in the scanner's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Inside a string value that is skipped.
    SkipValue,
    /// Inside a key that is skipped.
    SkipKey,
    /// Inside a key matched against the known object's keys (`Scanner::key`).
    MatchKey,
    /// Inside a model name, kept (`Scanner::preferred`: Gemini's `modelVersion`).
    Model,
    /// After a backslash in a string (`Scanner::escaped`: the string's state); in a `\u`
    /// escape, `Scanner::at` hex digits still to come.
    Escape,
    /// Inside a number (`Scanner::num`; a count's in `Scanner::slot`, summed in `Scanner::sum`).
    Number,
    /// Inside `true`, `false` or `null` (`Scanner::word`, `Scanner::at` bytes matched).
    Literal,
    /// Before the root value.
    Start,
    /// A value expected: after `:`, or after `,` in an array.
    Value,
    /// After `[`: a value or `]`.
    FirstItem,
    /// After `{`: a key or `}`.
    FirstKey,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value in a container: `,` or the container's close.
    Next,
    /// After the root value: only whitespace.
    End,
}

/// `true`, `false` or `null`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Word {
    True,
    False,
    Null,
}

impl Word {
    fn text(self) -> &'static [u8] {
        match self {
            Word::True => b"true",
            Word::False => b"false",
            Word::Null => b"null",
        }
    }
}

/// The parts of a JSON number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Minus,
    Zero,
    Int,
    Dot,
    Fraction,
    E,
    ESign,
    Exponent,
}

impl Num {
    /// Whether a number may end here.
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Fraction | Num::Exponent)
    }
}

/// The JSON syntax of the documents of one body (JSON framing) or of one event's data at a time
/// (SSE framing), in bounded state.
#[derive(Debug)]
pub(super) struct Scanner {
    state: State,
    /// The string an escape is in (`SkipValue` or `SkipKey`).
    escaped: State,
    /// Hex digits to come in a `\u` escape, or bytes of a literal matched.
    at: u8,
    preferred: bool,
    num: Num,
    slot: Option<Slot>,
    word: Word,
    /// Open containers.
    depth: u8,
    /// The depth at which values are documents: 0, or 1 inside a JSON body's root array.
    base: u8,
    /// How many known objects are open: `chain[..known]`, at depths `base + 1 ..`; the innermost
    /// open container is known when it is at `base + known`.
    known: u8,
    chain: [Node; CHAIN],
    /// Bit `d` set: the container at depth `d + 1` is an array.
    arrays: u64,
    key: KeyMatch,
    /// What the value after the current key is for.
    target: Option<Target>,
    /// A count's digits so far.
    sum: u64,
    /// The current document's bytes before this chunk (at most [`DOCUMENT_MAX`] + 1).
    bytes: u32,
    shapes: Shapes,
    /// JSON framing: a root array's elements are documents, and a document commits when it
    /// closes (with SSE, when its event ends).
    json: bool,
    /// Documents ended: JSON documents, or SSE events (counted by `Lines`).
    pub(super) documents: u64,
}

impl Scanner {
    pub(super) fn new(shapes: Shapes, json: bool) -> Scanner {
        Scanner {
            state: State::Start,
            escaped: State::SkipValue,
            at: 0,
            preferred: false,
            num: Num::Zero,
            slot: None,
            word: Word::Null,
            depth: 0,
            base: 0,
            known: 0,
            chain: [Node::Root; CHAIN],
            arrays: 0,
            key: KeyMatch::default(),
            target: None,
            sum: 0,
            bytes: 0,
            shapes,
            json,
            documents: 0,
        }
    }

    /// Ready for the next event's data (SSE framing).
    pub(super) fn reset(&mut self, tally: &mut Tally) {
        *self = Scanner {
            documents: self.documents,
            ..Scanner::new(self.shapes, self.json)
        };
        tally.begin();
    }

    /// Bytes of the document not scanned (an SSE event's data already malformed): they still
    /// count towards [`DOCUMENT_MAX`].
    pub(super) fn skip(&mut self, len: usize) -> Result<(), Reason> {
        let bytes = u64::from(self.bytes).saturating_add(len as u64);
        if bytes > DOCUMENT_MAX {
            return Err(Reason::TooLarge);
        }
        const _: () = assert!(DOCUMENT_MAX < u32::MAX as u64);
        self.bytes = bytes as u32;
        Ok(())
    }

    /// The end of the document's bytes: whether a whole value was read (false: none began);
    /// `Malformed` if one began and did not end.
    pub(super) fn end(&mut self, tally: &mut Tally) -> Result<bool, Reason> {
        if self.state == State::Number {
            if !self.num.complete() {
                return Err(Reason::Malformed);
            }
            self.end_number(tally);
            self.value_done(tally);
        }
        match self.state {
            State::End => Ok(true),
            State::Start => Ok(false),
            _ => Err(Reason::Malformed),
        }
    }

    /// The next bytes of the document(s).
    pub(super) fn scan(&mut self, bytes: &[u8], tally: &mut Tally) -> Result<(), Reason> {
        // Where the current document's bytes start in this chunk.
        let mut from = 0;
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self.state {
                State::SkipValue | State::SkipKey => {
                    let Some(n) = quote_or_backslash(&bytes[i..]) else {
                        i = bytes.len();
                        continue;
                    };
                    i += n;
                    if bytes[i] == b'"' {
                        // `string_end` for these two states, without its dispatch.
                        if self.state == State::SkipKey {
                            self.state = State::Colon;
                        } else if self.value_done(tally) {
                            self.document_done(&mut from, i + 1)?;
                        }
                        i = self.punctuation(bytes, i);
                    } else {
                        self.escape();
                    }
                }
                State::MatchKey => {
                    let rest = &bytes[i..];
                    let Some(n) = quote_or_backslash(rest) else {
                        self.key.extend(rest);
                        if !self.key.alive() {
                            self.state = State::SkipKey;
                        }
                        i = bytes.len();
                        continue;
                    };
                    i += n;
                    if rest[n] == b'"' {
                        self.target = self.key.last(&rest[..n]);
                        if matches!(self.target, Some(Target::Count(_))) {
                            tally.shaped = true;
                        }
                        self.state = State::Colon;
                        i = self.punctuation(bytes, i);
                    } else {
                        // An escaped key matches nothing.
                        self.state = State::SkipKey;
                        self.escape();
                    }
                }
                State::Model => {
                    let rest = &bytes[i..];
                    let end = quote_or_backslash(rest);
                    if !tally.model_bytes(&rest[..end.unwrap_or(rest.len())]) {
                        // Not a model name: the same bytes again, as a string skipped.
                        self.state = State::SkipValue;
                        continue;
                    }
                    let Some(n) = end else {
                        i = bytes.len();
                        continue;
                    };
                    i += n;
                    if rest[n] == b'"' {
                        if self.string_end(tally) {
                            self.document_done(&mut from, i + 1)?;
                        }
                    } else {
                        // An escaped model name is not taken.
                        self.state = State::SkipValue;
                        self.escape();
                    }
                }
                State::Escape => self.escaped_byte(b)?,
                State::Number => {
                    if self.num == Num::Int {
                        // A run of digits at once: most of a number's bytes.
                        let digits = bytes[i..].iter().take_while(|d| d.is_ascii_digit()).count();
                        if digits > 0 {
                            if self.slot.is_some() {
                                self.digits(&bytes[i..i + digits])?;
                            }
                            i += digits;
                            // Any byte but these (or a digit) ends the number, as `number` says.
                            if !matches!(bytes.get(i), None | Some(b'.' | b'e' | b'E')) {
                                self.end_number(tally);
                                if self.value_done(tally) {
                                    self.document_done(&mut from, i)?;
                                }
                            }
                            continue;
                        }
                    }
                    if let Some(next) = self.number(b)? {
                        self.num = next;
                    } else {
                        // The byte after a number is the grammar's next token: read it again.
                        self.end_number(tally);
                        if self.value_done(tally) {
                            self.document_done(&mut from, i)?;
                        }
                        continue;
                    }
                }
                State::Literal => {
                    let text = self.word.text();
                    let left = &text[usize::from(self.at)..];
                    let here = &bytes[i..];
                    if here.len() >= left.len() && left.iter().zip(here).all(|(a, b)| a == b) {
                        // The whole rest of the word at once: a byte per dispatch otherwise.
                        i += left.len();
                        self.at = text.len() as u8;
                        if self.value_done(tally) {
                            self.document_done(&mut from, i)?;
                        }
                        continue;
                    }
                    if text.get(usize::from(self.at)) != Some(&b) {
                        return Err(Reason::Malformed);
                    }
                    self.at += 1;
                    if usize::from(self.at) == text.len() && self.value_done(tally) {
                        self.document_done(&mut from, i + 1)?;
                    }
                }
                // The structural states most bytes outside strings meet, each in one dispatch.
                State::Colon if b == b':' => self.state = State::Value,
                State::Next if b == b',' => {
                    self.state = if self.in_array() { State::Value } else { State::Key };
                }
                State::Key if b == b'"' => self.key_start(),
                _ if is_space(b) => {}
                structural => {
                    if self.structural(structural, b, tally)? {
                        self.document_done(&mut from, i + 1)?;
                    }
                }
            }
            i += 1;
        }
        self.skip(bytes.len() - from)
    }

    /// A document of a root array ended at `at` (JSON framing): its bytes are checked against
    /// the limit, and the next one's start there.
    fn document_done(&mut self, from: &mut usize, at: usize) -> Result<(), Reason> {
        self.skip(at - *from)?;
        self.bytes = 0;
        *from = at;
        Ok(())
    }

    /// After a string's closing quote at `i`: the bytes that most often follow it, taken without
    /// a dispatch each (`:` and a string value's opening quote after a key; `,` and the next
    /// key's opening quote after a value). Returns where the last byte taken is.
    fn punctuation(&mut self, bytes: &[u8], mut i: usize) -> usize {
        match self.state {
            State::Colon if bytes.get(i + 1) == Some(&b':') => {
                i += 1;
                self.state = State::Value;
                // Inside an object, a string not read is all `value` would make of it.
                if self.target.is_none() && bytes.get(i + 1) == Some(&b'"') {
                    i += 1;
                    self.state = State::SkipValue;
                }
            }
            State::Next if bytes.get(i + 1) == Some(&b',') => {
                i += 1;
                if self.in_array() {
                    self.state = State::Value;
                } else {
                    self.state = State::Key;
                    if bytes.get(i + 1) == Some(&b'"') {
                        i += 1;
                        self.key_start();
                    }
                }
            }
            _ => {}
        }
        i
    }

    /// A structural byte (not whitespace) in `state`; true when it ended a document of a root
    /// array.
    fn structural(&mut self, state: State, b: u8, tally: &mut Tally) -> Result<bool, Reason> {
        match state {
            State::FirstItem | State::Next if b == b']' => return self.close(b, tally),
            State::FirstKey | State::Next if b == b'}' => return self.close(b, tally),
            State::Start | State::Value | State::FirstItem => self.value(b, tally)?,
            State::FirstKey | State::Key if b == b'"' => self.key_start(),
            State::Colon if b == b':' => self.state = State::Value,
            State::Next if b == b',' => {
                self.state = if self.in_array() { State::Value } else { State::Key };
            }
            _ => return Err(Reason::Malformed),
        }
        Ok(false)
    }

    /// A backslash in a string.
    fn escape(&mut self) {
        self.escaped = self.state;
        self.at = 0;
        self.state = State::Escape;
    }

    /// The byte after a backslash, or a hex digit of a `\u` escape.
    fn escaped_byte(&mut self, b: u8) -> Result<(), Reason> {
        if self.at == 0 {
            match b {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.state = self.escaped,
                b'u' => self.at = 4,
                _ => return Err(Reason::Malformed),
            }
        } else {
            if !b.is_ascii_hexdigit() {
                return Err(Reason::Malformed);
            }
            self.at -= 1;
            if self.at == 0 {
                self.state = self.escaped;
            }
        }
        Ok(())
    }

    fn in_array(&self) -> bool {
        self.depth > 0 && self.arrays & (1 << (self.depth - 1)) != 0
    }

    /// The first byte of a value (not whitespace).
    fn value(&mut self, b: u8, tally: &mut Tally) -> Result<(), Reason> {
        let target = self.target.take();
        let document = self.depth == self.base;
        if document && !(self.json && self.depth == 0 && b == b'[') {
            tally.begin();
        }
        match (target, b) {
            (Some(Target::Count(slot)), b'0'..=b'9') => {
                self.sum = u64::from(b - b'0');
                self.number_start(first_digit(b), Some(slot));
            }
            (Some(Target::Count(_)), b'n') => self.literal(Word::Null),
            (Some(Target::Count(_)), b'-' | b'"' | b'{' | b'[' | b't' | b'f') => {
                return Err(Reason::InvalidValue)
            }
            (Some(Target::Model { preferred }), b'"') => {
                self.preferred = preferred;
                self.state = if tally.start_model(preferred) {
                    State::Model
                } else {
                    State::SkipValue
                };
            }
            (_, b'{') => {
                self.open(false)?;
                let node = match target {
                    Some(Target::Object(node)) => Some(node),
                    _ if document => Some(Node::Root),
                    _ => None,
                };
                if let Some(node) = node {
                    if usize::from(self.known) < CHAIN {
                        self.chain[usize::from(self.known)] = node;
                        self.known += 1;
                    }
                }
                self.state = State::FirstKey;
            }
            (_, b'[') => {
                self.open(true)?;
                if self.json && self.depth == 1 {
                    self.base = 1;
                }
                self.state = State::FirstItem;
            }
            (_, b'"') => self.state = State::SkipValue,
            (_, b'-') => self.number_start(Num::Minus, None),
            (_, b'0'..=b'9') => self.number_start(first_digit(b), None),
            (_, b't') => self.literal(Word::True),
            (_, b'f') => self.literal(Word::False),
            (_, b'n') => self.literal(Word::Null),
            _ => return Err(Reason::Malformed),
        }
        Ok(())
    }

    fn number_start(&mut self, num: Num, slot: Option<Slot>) {
        self.num = num;
        self.slot = slot;
        self.state = State::Number;
    }

    /// A literal whose first byte was read.
    fn literal(&mut self, word: Word) {
        self.word = word;
        self.at = 1;
        self.state = State::Literal;
    }

    fn open(&mut self, array: bool) -> Result<(), Reason> {
        if usize::from(self.depth) >= DEPTH_MAX {
            return Err(Reason::TooDeep);
        }
        if array {
            self.arrays |= 1 << self.depth;
        } else {
            self.arrays &= !(1 << self.depth);
        }
        self.depth += 1;
        Ok(())
    }

    /// `}` or `]`; true when it ended a document of a root array.
    fn close(&mut self, b: u8, tally: &mut Tally) -> Result<bool, Reason> {
        if self.in_array() != (b == b']') {
            return Err(Reason::Malformed);
        }
        if self.known > 0 && self.depth == self.base + self.known {
            self.known -= 1;
        }
        self.depth -= 1;
        Ok(self.value_done(tally))
    }

    fn key_start(&mut self) {
        self.target = None;
        let known = usize::from(self.known);
        self.state = if known > 0 && self.depth == self.base + self.known {
            self.key = KeyMatch::new(self.chain[known - 1], self.shapes);
            if self.key.alive() {
                State::MatchKey
            } else {
                State::SkipKey
            }
        } else {
            State::SkipKey
        };
    }

    /// A string's closing quote; true when it ended a document of a root array.
    fn string_end(&mut self, tally: &mut Tally) -> bool {
        match self.state {
            State::Model => {
                tally.end_model(self.preferred);
                return self.value_done(tally);
            }
            State::SkipValue => return self.value_done(tally),
            _ => self.state = State::Colon,
        }
        false
    }

    /// The next byte of a number: its next part, or `None` when the number ended before `b`.
    fn number(&mut self, b: u8) -> Result<Option<Num>, Reason> {
        let slot = self.slot;
        let next = match (self.num, b) {
            (Num::Minus, b'0'..=b'9') => first_digit(b),
            (Num::Int, b'0'..=b'9') => {
                if slot.is_some() {
                    self.sum = self.sum * 10 + u64::from(b - b'0');
                    if self.sum > COUNT_MAX {
                        return Err(Reason::InvalidValue);
                    }
                }
                Num::Int
            }
            (Num::Zero | Num::Int, b'.' | b'e' | b'E') if slot.is_some() => return Err(Reason::InvalidValue),
            (Num::Zero | Num::Int, b'.') => Num::Dot,
            (Num::Zero | Num::Int | Num::Fraction, b'e' | b'E') => Num::E,
            (Num::Dot | Num::Fraction, b'0'..=b'9') => Num::Fraction,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exponent, b'0'..=b'9') => Num::Exponent,
            (num, _) if num.complete() && !b.is_ascii_digit() => return Ok(None),
            _ => return Err(Reason::Malformed),
        };
        Ok(Some(next))
    }

    /// More digits of a count's integer part.
    fn digits(&mut self, digits: &[u8]) -> Result<(), Reason> {
        for d in digits {
            self.sum = self.sum * 10 + u64::from(d - b'0');
            if self.sum > COUNT_MAX {
                return Err(Reason::InvalidValue);
            }
        }
        Ok(())
    }

    fn end_number(&mut self, tally: &mut Tally) {
        if let Some(slot) = self.slot {
            tally.count(slot, self.sum);
        }
    }

    /// A value ended: what may follow. True when it was a document of a root array (JSON
    /// framing), which is then committed.
    fn value_done(&mut self, tally: &mut Tally) -> bool {
        if self.depth == 0 {
            self.state = State::End;
            if self.json && self.base == 0 {
                tally.commit();
                self.documents = 1;
            }
            return false;
        }
        self.state = State::Next;
        if self.json && self.base == 1 && self.depth == 1 {
            tally.commit();
            self.documents += 1;
            return true;
        }
        false
    }
}

/// Where the next `"` or `\\` is. Most strings in an answer are short keys and values (`"id"`,
/// `"index"`, `"stop"`, an id), which eight bytes at a time in a word find before `memchr`
/// would have set up its vectors; past them, `memchr` skips the text of a completion.
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    const HEAD: usize = 32;
    const WORD: usize = 8;
    const ONES: u64 = u64::from_le_bytes([1; WORD]);
    const HIGHS: u64 = ONES << 7;
    // Eight bytes a step (the high bit of each byte of `found` that is `"` or `\`; above the
    // first such byte, borrows may set others, so only the lowest set bit is used).
    let mut at = 0;
    while at < HEAD {
        let Some(word) = bytes[at..].first_chunk::<WORD>() else {
            break;
        };
        let word = u64::from_le_bytes(*word);
        let quotes = word ^ (ONES * u64::from(b'"'));
        let backslashes = word ^ (ONES * u64::from(b'\\'));
        let found =
            ((quotes.wrapping_sub(ONES) & !quotes) | (backslashes.wrapping_sub(ONES) & !backslashes)) & HIGHS;
        if found != 0 {
            return Some(at + found.trailing_zeros() as usize / 8);
        }
        at += WORD;
    }
    let rest = &bytes[at..];
    if at < HEAD {
        return rest
            .iter()
            .position(|b| *b == b'"' || *b == b'\\')
            .map(|n| n + at);
    }
    memchr2(b'"', b'\\', rest).map(|n| n + at)
}

fn first_digit(b: u8) -> Num {
    if b == b'0' {
        Num::Zero
    } else {
        Num::Int
    }
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

#[cfg(test)]
mod tests {
    use super::quote_or_backslash;

    #[test]
    fn quote_or_backslash_finds_the_first_at_any_place() {
        // Every other byte value around the marks, so that a word's borrows are exercised.
        let filler: Vec<u8> = (0..=u8::MAX).filter(|b| *b != b'"' && *b != b'\\').collect();
        for len in 0..80 {
            for shift in [0, 1, 7, 33, 200] {
                let text: Vec<u8> = (0..len).map(|i| filler[(i + shift) % filler.len()]).collect();
                assert_eq!(quote_or_backslash(&text), None);
                for at in 0..len {
                    for (first, second) in [(b'"', b'\\'), (b'\\', b'"'), (b'"', b'"')] {
                        let mut text = text.clone();
                        text[at] = first;
                        if at + 1 < len {
                            text[len - 1] = second;
                        }
                        assert_eq!(quote_or_backslash(&text), Some(at), "{text:?}");
                    }
                }
            }
        }
    }
}
