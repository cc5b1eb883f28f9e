//! Request and response heads in the form clients and upstreams send (`HTTP/1.x`, CRLF line
//! endings, `name: value` fields), found in one pass over the bytes, sixteen at a time on x86-64
//! (SSE2) and a word at a time elsewhere; any other head goes to httparse, which is the
//! authority on what a head may be.
//!
//! httparse spent 1,694 instructions (inclusive) on nginx's five-field response head and 921
//! on h2load's request head (callgrind): it checks each name and value through a per-call SIMD
//! dispatch that values of a few dozen bytes are too short to profit from, then steps a byte
//! iterator. This scan reads eight bytes at a time: `callgrind.sh` went 17,691 -> 17,276
//! instructions per request with it on responses, and -> 16,562 with it on requests too, where
//! a plain head (CRLF only) also spares `codec`'s search for bare LFs. (Its first version, a
//! table lookup per byte after a `memmem` search for the blank line, cost 690 more than
//! httparse.) Sixteen-byte steps took the field lines of those two heads from 1,349 to about
//! 1,020 instructions (callgrind, 64 clients).
//!
//! It accepts a subset of what httparse accepts, and never refuses a head itself: where it
//! stops, complete or not, httparse starts over. Where it accepts, it finds what httparse
//! finds (method, target, version, status, fields, length); `same_as_httparse` and
//! `request_heads_same_as_httparse` check that on 100,000 mutated heads each.

use std::ops::Range;

use smallvec::SmallVec;

/// Where a field's name and value lie in the head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Field {
    pub(crate) name: (u32, u32),
    pub(crate) value: (u32, u32),
}

impl Field {
    pub(crate) fn name(&self) -> Range<usize> {
        self.name.0 as usize..self.name.1 as usize
    }

    pub(crate) fn value(&self) -> Range<usize> {
        self.value.0 as usize..self.value.1 as usize
    }
}

/// What a head's status line says, and how long the head is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Found {
    /// The head's length, its blank line included.
    pub(crate) len: usize,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub(crate) version: u8,
    pub(crate) code: u16,
}

/// What a request line says, and how long the head is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RequestLine {
    /// The head's length, its blank line included.
    pub(crate) len: usize,
    pub(crate) method: Range<usize>,
    pub(crate) target: Range<usize>,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub(crate) version: u8,
}

/// Where a head's fields lie; filled in place (a returned one would be copied, 2 KiB).
pub(crate) type Fields<const N: usize> = SmallVec<[Field; N]>;

/// What httparse takes in a field name: RFC 9110's `tchar`.
static TOKEN: [bool; 256] = {
    let mut out = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        out[b] = c.is_ascii_alphanumeric()
            || matches!(c, b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*')
            || matches!(c, b'+' | b'-' | b'.' | b'^' | b'_' | b'`' | b'|' | b'~');
        b += 1;
    }
    out
};

/// What httparse takes in a field value and in a reason phrase: HTAB, SP, VCHAR, obs-text.
static TEXT: [bool; 256] = {
    let mut out = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        out[b] = c == b'\t' || (c >= b' ' && c <= 0x7e) || c >= 0x80;
        b += 1;
    }
    out
};

/// A `tchar` that is not an uppercase letter: what an HTTP/2 field name may hold (RFC 9113
/// §8.2.1).
static LOWER_TOKEN: [bool; 256] = {
    let mut out = TOKEN;
    let mut b = b'A';
    while b <= b'Z' {
        out[b as usize] = false;
        b += 1;
    }
    out
};

/// Whether `bytes` is a non-empty token without uppercase letters: an HTTP/2 field name.
/// A word at a time, as heads are scanned: a lookup per byte cost an HTTP/2 response's seven
/// fields about 800 instructions with their values (callgrind, h2c).
///
/// On x86-64, names of letters, digits and `-` in one SSE2 step up to sixteen bytes
/// (`wide::all_within`); the other token bytes go the exact way.
pub(crate) fn is_lower_token(bytes: &[u8]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if !bytes.is_empty() && wide::all_within(bytes, wide::Run::LowerName) {
        return true;
    }
    !bytes.is_empty() && token_end::<true>(bytes, 0).is_none()
}

/// Whether every byte of `bytes` may stand in a field value (what `HeaderValue` takes too).
pub(crate) fn is_field_value(bytes: &[u8]) -> bool {
    all_text(bytes)
}

/// SSE2's test of a run of `TEXT` is exact: no second way.
#[cfg(target_arch = "x86_64")]
fn all_text(bytes: &[u8]) -> bool {
    wide::all_within(bytes, wide::Run::Text)
}

#[cfg(not(target_arch = "x86_64"))]
fn all_text(bytes: &[u8]) -> bool {
    text_end(bytes, 0).is_none()
}

/// The response head at the front of `buf` when it is complete and in the plain form:
/// `HTTP/1.0` or `HTTP/1.1`, one space, three digits, an optional reason, then [`fields`].
/// `None` for anything else, complete or not, with `fields` left in any state.
pub(crate) fn response_head<const N: usize>(buf: &[u8], fields: &mut Fields<N>) -> Option<Found> {
    let (version, code, at) = status_line(buf)?;
    let len = field_lines(buf, at, fields)?;
    Some(Found { len, version, code })
}

/// The request head at the front of `buf` when it is complete and in the plain form: a token,
/// one space, a target of visible ASCII, one space, `HTTP/1.0` or `HTTP/1.1`, then
/// [`fields`]. `None` for anything else, complete or not, with `fields` left in any state.
pub(crate) fn request_head<const N: usize>(buf: &[u8], fields: &mut Fields<N>) -> Option<RequestLine> {
    let method_end = token_end::<false>(buf, 0)?;
    if method_end == 0 || *buf.get(method_end)? != b' ' {
        return None;
    }
    let target_start = method_end + 1;
    let target_end = target_end(buf, target_start)?;
    if target_end == target_start || *buf.get(target_end)? != b' ' {
        return None;
    }
    let version = match buf.get(target_end + 1..target_end + 11)? {
        b"HTTP/1.0\r\n" => 0,
        b"HTTP/1.1\r\n" => 1,
        _ => return None,
    };
    let len = field_lines(buf, target_end + 11, fields)?;
    Some(RequestLine {
        len,
        method: 0..method_end,
        target: target_start..target_end,
        version,
    })
}

/// The field lines from `at` to the blank line, at most `N` of them, each a token, a colon and
/// a value ending in CRLF, into `fields` (empty on entry); the head's length.
fn field_lines<const N: usize>(buf: &[u8], mut at: usize, fields: &mut Fields<N>) -> Option<usize> {
    // Each step reads no further than the line's CRLF: running out of bytes first is `None`.
    while buf.get(at..at + 2)? != b"\r\n" {
        let (field, next) = field_line(buf, at)?;
        if fields.len() == N {
            return None;
        }
        fields.push(field);
        at = next;
    }
    Some(at + 2)
}

/// The version, the status code and where the fields start.
fn status_line(buf: &[u8]) -> Option<(u8, u16, usize)> {
    let version = match buf.get(..9)? {
        b"HTTP/1.0 " => 0,
        b"HTTP/1.1 " => 1,
        _ => return None,
    };
    let digits = buf.get(9..12)?;
    if !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let code = digits.iter().fold(0u16, |n, d| n * 10 + u16::from(d - b'0'));
    let mut at = 12;
    if *buf.get(at)? == b' ' {
        at = text_end(buf, at + 1)?;
    }
    crlf(buf, at).then_some((version, code, at + 2))
}

/// The field whose line starts at `start`, and where the next line starts.
fn field_line(buf: &[u8], start: usize) -> Option<(Field, usize)> {
    let colon = token_end::<false>(buf, start)?;
    if colon == start || buf[colon] != b':' {
        return None;
    }
    let mut value_start = colon + 1;
    while matches!(*buf.get(value_start)?, b' ' | b'\t') {
        value_start += 1;
    }
    let end = text_end(buf, value_start)?;
    if !crlf(buf, end) {
        return None;
    }
    let mut value_end = end;
    while value_end > value_start && matches!(buf[value_end - 1], b' ' | b'\t') {
        value_end -= 1;
    }
    let span = |a: usize, b: usize| (a as u32, b as u32);
    let field = Field {
        name: span(start, colon),
        value: span(value_start, value_end),
    };
    Some((field, end + 2))
}

/// Where the first byte from `at` on that is not [`TOKEN`] lies; `None` when the buffer ends
/// first. `LOWER`: uppercase letters end the token too (an HTTP/2 name's rule).
fn token_end<const LOWER: bool>(buf: &[u8], at: usize) -> Option<usize> {
    let at = name_run::<LOWER>(buf, at);
    let table = if LOWER { &LOWER_TOKEN } else { &TOKEN };
    Some(at + buf[at..].iter().position(|b| !table[usize::from(*b)])?)
}

/// Where the run of letters, digits and `-` (what names are made of) from `at` on ends, or
/// where its scan gave way to a lookup per byte: a byte from 0x80 up, or the buffer's end.
///
/// Sixteen bytes at a time where SSE2 is (`wide`), eight bytes at a time on the rest. Each
/// eight-byte test holds bytewise with no carry between bytes: every byte is below 0x80 when
/// it runs, and below 0x80 plus 0x7f stays under 0x100.
fn name_run<const LOWER: bool>(buf: &[u8], mut at: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    match wide::run_end(
        buf,
        at,
        if LOWER {
            wide::Run::LowerName
        } else {
            wide::Run::Name
        },
    ) {
        Ok(end) => return end,
        Err(rest) => at = rest,
    }
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    // High bit of each byte set when that byte of `x` lies in `lo..=hi`.
    let within = |x: u64, lo: u64, hi: u64| (x + (0x80 - lo) * ONES) & !(x + (0x7f - hi) * ONES) & HIGH;
    while let Some(word) = buf.get(at..at + 8) {
        let x = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        if x & HIGH != 0 {
            break;
        }
        // Setting 0x20 folds uppercase letters onto lowercase (and no other byte onto a letter).
        let letters = if LOWER { x } else { x | (0x20 * ONES) };
        let name_byte = within(letters, u64::from(b'a'), u64::from(b'z'))
            | within(x, u64::from(b'0'), u64::from(b'9'))
            | within(x, u64::from(b'-'), u64::from(b'-'));
        let other = !name_byte & HIGH;
        if other != 0 {
            return at + (other.trailing_zeros() / 8) as usize;
        }
        at += 8;
    }
    at
}

/// Where the first byte from `at` on that is not [`TEXT`] lies; `None` when the buffer ends
/// first.
///
/// Sixteen bytes at a time where SSE2 is (`wide`), then eight at a time: values (a date, a
/// media type) run to a few dozen bytes, where a lookup per byte cost more than the rest of the
/// scan. The bytes outside `TEXT` are those below 0x20 but HTAB, and 0x7F; in a word, the
/// lowest byte each test flags is exact (a borrow only carries out of a byte that is itself
/// flagged), so the lowest flag of the two is the first such byte.
#[inline(always)]
fn text_end(buf: &[u8], mut at: usize) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    match wide::run_end(buf, at, wide::Run::Text) {
        Ok(end) => return Some(end),
        Err(rest) => at = rest,
    }
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    while let Some(word) = buf.get(at..at + 8) {
        let x = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let control = x.wrapping_sub(0x20 * ONES) & !x & HIGH;
        let del = x ^ (0x7f * ONES);
        let del = del.wrapping_sub(ONES) & !del & HIGH;
        let flagged = control | del;
        if flagged == 0 {
            at += 8;
            continue;
        }
        at += (flagged.trailing_zeros() / 8) as usize;
        if buf[at] != b'\t' {
            return Some(at);
        }
        at += 1;
    }
    Some(at + buf[at..].iter().position(|b| !TEXT[usize::from(*b)])?)
}

/// Where the first byte from `at` on outside 0x21..=0x7e lies (a request target's end, or a
/// byte httparse checks further: it takes UTF-8 there); `None` when the buffer ends first.
fn target_end(buf: &[u8], mut at: usize) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    while let Some(word) = buf.get(at..at + 8) {
        let x = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        // As in `text_end`, each test's lowest flag is exact; bytes from 0x80 up by their bit.
        let low = x.wrapping_sub(0x21 * ONES) & !x & HIGH;
        let del = x ^ (0x7f * ONES);
        let del = del.wrapping_sub(ONES) & !del & HIGH;
        let flagged = low | del | (x & HIGH);
        if flagged != 0 {
            return Some(at + (flagged.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    Some(at + buf[at..].iter().position(|b| !(0x21..=0x7e).contains(b))?)
}

/// The scans' sixteen-byte steps, on SSE2, which every x86-64 processor has (no check at run
/// time). A mask has bit `i` set for byte `i` of the sixteen, so its `trailing_zeros` is the
/// first such byte; unlike the eight-byte words' arithmetic, comparisons have no carries and
/// take bytes from 0x80 up.
#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::{
        __m128i, _mm_andnot_si128, _mm_cmpeq_epi8, _mm_loadu_si128, _mm_min_epu8, _mm_movemask_epi8,
        _mm_or_si128, _mm_set1_epi8, _mm_sub_epi8,
    };

    /// What a scan runs through; it stops at the first byte outside.
    #[derive(Clone, Copy)]
    pub(super) enum Run {
        /// Letters, digits and `-`.
        Name,
        /// The same without uppercase letters.
        LowerName,
        /// `TEXT`: all but the bytes below 0x20 other than HTAB, and 0x7F.
        Text,
    }

    /// Where the first byte from `at` on outside `run` lies (`Ok`), or, when fewer than
    /// sixteen bytes are left before one is found, where the steps stopped (`Err`), for the
    /// narrower scans to go on from. Inlined into each scan, where `run` is a constant.
    #[inline(always)]
    pub(super) fn run_end(buf: &[u8], mut at: usize, run: Run) -> Result<usize, usize> {
        while let Some(outside) = outside(buf, at, run) {
            if outside != 0 {
                return Ok(at + outside.trailing_zeros() as usize);
            }
            at += 16;
        }
        Err(at)
    }

    /// The bytes among the sixteen from `at` outside `run`; `None` when the buffer ends first.
    #[inline(always)]
    fn outside(buf: &[u8], at: usize, run: Run) -> Option<u32> {
        let lanes: &[u8; 16] = buf.get(at..at + 16)?.try_into().ok()?;
        Some(outside_lanes(lanes, run))
    }

    /// Whether every byte of `bytes` is in `run`. A slice shorter than sixteen bytes is
    /// checked in one step, through lanes that hold its bytes and no others (two overlapping
    /// halves, or its first, middle and last bytes when it has three or fewer); a longer one
    /// in steps of sixteen, the last overlapping the one before.
    #[inline(always)]
    pub(super) fn all_within(bytes: &[u8], run: Run) -> bool {
        let n = bytes.len();
        if n > 16 {
            return match run_end(bytes, 0, run) {
                Ok(_) => false,
                // The last bytes, in a step that overlaps the one before.
                Err(rest) => rest == n || outside(bytes, n - 16, run) == Some(0),
            };
        }
        let mut lanes = [0u8; 16];
        match n {
            0 => return true,
            8.. => {
                lanes[..8].copy_from_slice(&bytes[..8]);
                lanes[8..].copy_from_slice(&bytes[n - 8..]);
            }
            4.. => {
                lanes[..4].copy_from_slice(&bytes[..4]);
                lanes[4..8].copy_from_slice(&bytes[n - 4..]);
                lanes.copy_within(..8, 8);
            }
            _ => {
                lanes = [bytes[0]; 16];
                lanes[1] = bytes[n / 2];
                lanes[2] = bytes[n - 1];
            }
        }
        outside_lanes(&lanes, run) == 0
    }

    /// The bytes among `lanes` outside `run`.
    #[inline(always)]
    fn outside_lanes(lanes: &[u8; 16], run: Run) -> u32 {
        // SAFETY: these intrinsics need SSE2 and nothing else, and SSE2 is in the x86-64
        // baseline every x86_64 target enables; the one load reads the sixteen bytes `lanes`
        // borrows, and `_mm_loadu_si128` takes any alignment.
        #[allow(unsafe_code)]
        unsafe {
            let v = _mm_loadu_si128(lanes.as_ptr().cast::<__m128i>());
            let byte = |b: u8| _mm_set1_epi8(b as i8);
            // Bytes `lo..=lo + span`: their difference from `lo`, unsigned, is at most `span`.
            let within = |x: __m128i, lo: u8, span: u8| {
                let d = _mm_sub_epi8(x, byte(lo));
                _mm_cmpeq_epi8(_mm_min_epu8(d, byte(span)), d)
            };
            match run {
                Run::Name | Run::LowerName => {
                    // Setting 0x20 folds uppercase letters onto lowercase (and no other byte
                    // onto a letter).
                    let letters = match run {
                        Run::Name => _mm_or_si128(v, byte(0x20)),
                        _ => v,
                    };
                    let name = _mm_or_si128(
                        _mm_or_si128(within(letters, b'a', 25), within(v, b'0', 9)),
                        _mm_cmpeq_epi8(v, byte(b'-')),
                    );
                    !(_mm_movemask_epi8(name) as u32) & 0xffff
                }
                Run::Text => {
                    let control = within(v, 0, 0x1f);
                    let tab = _mm_cmpeq_epi8(v, byte(b'\t'));
                    let del = _mm_cmpeq_epi8(v, byte(0x7f));
                    _mm_movemask_epi8(_mm_or_si128(_mm_andnot_si128(tab, control), del)) as u32
                }
            }
        }
    }
}

fn crlf(buf: &[u8], at: usize) -> bool {
    buf.get(at..at + 2) == Some(b"\r\n")
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::*;
    use crate::rng::Xorshift;

    const N: usize = 8;

    fn scan(text: &[u8]) -> Option<(Found, Fields<N>)> {
        let mut fields = Fields::new();
        response_head::<N>(text, &mut fields).map(|found| (found, fields))
    }

    /// httparse's reading of `buf` in the same terms: `None` unless complete and valid.
    fn httparse_head(buf: &[u8]) -> Option<(Found, Fields<N>)> {
        let mut slots = [const { MaybeUninit::uninit() }; N];
        let mut parsed = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            buf,
            &mut slots,
        ) {
            Ok(httparse::Status::Complete(len)) => len,
            _ => return None,
        };
        let base = buf.as_ptr() as usize;
        let span = |part: &[u8]| {
            let start = part.as_ptr() as usize - base;
            (start as u32, (start + part.len()) as u32)
        };
        let fields = parsed
            .headers
            .iter()
            .map(|h| Field {
                name: span(h.name.as_bytes()),
                value: span(h.value),
            })
            .collect();
        let found = Found {
            len,
            version: parsed.version?,
            code: parsed.code?,
        };
        Some((found, fields))
    }

    /// Where the scan accepts a head, httparse reads the same from it. Empty values are
    /// compared by being empty: httparse points an empty one at its line's end.
    fn assert_same(buf: &[u8]) -> bool {
        let Some((fast, fast_fields)) = scan(buf) else {
            return false;
        };
        let text = String::from_utf8_lossy(buf);
        let (slow, slow_fields) =
            httparse_head(buf).unwrap_or_else(|| panic!("httparse refuses what the scan took: {text:?}"));
        assert_eq!(fast, slow, "{text:?}");
        assert_eq!(fast_fields.len(), slow_fields.len(), "{text:?}");
        for (a, b) in fast_fields.iter().zip(&slow_fields) {
            assert_eq!(a.name, b.name, "{text:?}");
            assert_eq!(&buf[a.value()], &buf[b.value()], "{text:?}");
        }
        true
    }

    #[test]
    fn plain_heads_are_read_as_httparse_reads_them() {
        for text in [
            "HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Wed, 25 Nov 2026 10:00:00 GMT\r\nContent-Length: 3\r\n\r\nok\n",
            "HTTP/1.0 404 Not Found\r\n\r\n",
            "HTTP/1.1 204\r\n\r\n",
            "HTTP/1.1 200 \r\nA:\r\nB:   \r\nC:\tx \t\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-Obs: caf\u{e9}\r\n\r\n",
            "HTTP/1.1 999 Whatever it says\r\n!#$%&'*+-.^_`|~09azAZ: v\r\n\r\n",
        ] {
            assert!(assert_same(text.as_bytes()), "the scan takes {text:?}");
        }
    }

    /// Anything outside the plain form goes to httparse, whichever way httparse decides.
    #[test]
    fn other_heads_are_left_to_httparse() {
        for text in [
            "HTTP/1.1 200 OK\r\nServer: up\r\n",       // incomplete
            "HTTP/1.1 200 OK\nServer: up\n\n",         // bare LF
            "HTTP/1.1 200 OK\r\nServer: up\n\r\n\r\n", // one bare LF
            "\r\nHTTP/1.1 200 OK\r\n\r\n",             // a leading empty line
            "HTTP/1.2 200 OK\r\n\r\n",                 // version
            "HTTP/1.1  200 OK\r\n\r\n",                // two spaces
            "HTTP/1.1 20 OK\r\n\r\n",                  // two digits
            "HTTP/1.1 200 O\x7fK\r\n\r\n",             // DEL in the reason
            "HTTP/1.1 200 OK\r\nServer : up\r\n\r\n",  // space before the colon
            "HTTP/1.1 200 OK\r\n: up\r\n\r\n",         // no name
            "HTTP/1.1 200 OK\r\nA: b\rc\r\n\r\n",      // bare CR in a value
            "HTTP/1.1 200 OK\r\nA: b\x00\r\n\r\n",     // NUL in a value
            "HTTP/1.1 200 OK\r\nA: b\r\n c\r\n\r\n",   // folded line
            "HTTP/1.1 200 OK\r\nA\r\n\r\n",            // no colon
        ] {
            assert!(scan(text.as_bytes()).is_none(), "{text:?}");
        }
        let many: String = (0..=N).map(|i| format!("f{i}: {i}\r\n")).collect();
        assert!(scan(format!("HTTP/1.1 200 OK\r\n{many}\r\n").as_bytes()).is_none());
        let enough: String = (0..N).map(|i| format!("f{i}: {i}\r\n")).collect();
        assert!(assert_same(format!("HTTP/1.1 200 OK\r\n{enough}\r\n").as_bytes()));
    }

    /// `base` heads with one to three bytes replaced, inserted or removed, 100,000 times; each
    /// goes to `same`, which says whether the scan took it. Seeded afresh each run: a failure
    /// prints the head it failed on.
    fn mutated(base: &[&[u8]], same: fn(&[u8]) -> bool) {
        const BYTES: &[u8] = b"\r\n\r\n \t:aZ0-!~\"(),;/?=@[]{}\\\x00\x01\x7f\x80\xff";
        let rng = Xorshift::seeded("scan");
        let (mut taken, tried) = (0, 100_000);
        for _ in 0..tried {
            let mut text = base[rng.below(base.len() as u64) as usize].to_vec();
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(text.len() as u64) as usize;
                let byte = BYTES[rng.below(BYTES.len() as u64) as usize];
                match rng.below(3) {
                    0 => text[at] = byte,
                    1 => text.insert(at, byte),
                    _ => {
                        text.remove(at);
                    }
                }
            }
            taken += usize::from(same(&text));
        }
        assert!(
            taken > tried / 10,
            "the mutations left too few plain heads: {taken} of {tried}"
        );
    }

    /// The word-at-a-time checks of HTTP/2 names and values say what a lookup per byte says:
    /// field names and values of 0 to 40 bytes with one to three bytes changed at random
    /// (every byte value; whether a change lands in the first eight-byte word or past it).
    #[test]
    fn name_and_value_checks_agree_with_the_tables() {
        let rng = Xorshift::seeded("scan checks");
        let bases: [&[u8]; 4] = [
            b"content-type",
            b"x-ratelimit-remaining-requests",
            b"Fri, 04 Dec 2026 08:56:11 GMT",
            b"nghttpd nghttp2/1.52.0 (some comment; v=1)",
        ];
        for _ in 0..100_000 {
            let base = bases[rng.below(bases.len() as u64) as usize];
            let mut text = base[..rng.below(base.len() as u64 + 1) as usize].to_vec();
            for _ in 0..rng.below(4) {
                if text.is_empty() {
                    break;
                }
                let at = rng.below(text.len() as u64) as usize;
                text[at] = rng.below(256) as u8;
            }
            let lower = !text.is_empty() && text.iter().all(|b| LOWER_TOKEN[usize::from(*b)]);
            let value = text.iter().all(|b| TEXT[usize::from(*b)]);
            assert_eq!(is_lower_token(&text), lower, "{text:?}");
            assert_eq!(is_field_value(&text), value, "{text:?}");
        }
    }

    /// Every byte value at every place of a run long enough for each step (sixteen bytes,
    /// eight, one at a time), and at each start: the scans stop where the tables say, and the
    /// whole-slice checks agree with them (lengths 0 to 40: each way of filling the lanes).
    #[test]
    fn scans_stop_at_the_first_byte_the_tables_refuse() {
        fn table_end(table: &[bool; 256], buf: &[u8], at: usize) -> Option<usize> {
            buf[at..]
                .iter()
                .position(|b| !table[usize::from(*b)])
                .map(|n| at + n)
        }
        for filler in [b'a', b'Z', b'7', b'-', b'_', b' ', 0xe9] {
            for len in [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40] {
                for place in 0..len {
                    for byte in 0..=255u8 {
                        let mut buf = vec![filler; len];
                        buf[place] = byte;
                        for at in [0, 1, place.saturating_sub(8), place] {
                            let at = at.min(len);
                            assert_eq!(
                                token_end::<false>(&buf, at),
                                table_end(&TOKEN, &buf, at),
                                "{buf:?} {at}"
                            );
                            assert_eq!(
                                token_end::<true>(&buf, at),
                                table_end(&LOWER_TOKEN, &buf, at),
                                "{buf:?} {at}"
                            );
                            assert_eq!(text_end(&buf, at), table_end(&TEXT, &buf, at), "{buf:?} {at}");
                            let rest = &buf[at..];
                            let lower = !rest.is_empty() && table_end(&LOWER_TOKEN, rest, 0).is_none();
                            assert_eq!(is_lower_token(rest), lower, "{rest:?}");
                            assert_eq!(
                                is_field_value(rest),
                                table_end(&TEXT, rest, 0).is_none(),
                                "{rest:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Plain heads with bytes changed at random: wherever the scan still accepts one,
    /// httparse reads the same from it.
    #[test]
    fn same_as_httparse() {
        mutated(
            &[
                b"HTTP/1.1 200 OK\r\nServer: up\r\nX-A:  b c \r\nContent-Length: 2\r\n\r\nok",
                b"HTTP/1.0 302 Found\r\nLocation: /x?y=z\r\nA:\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nDate: Wed, 25 Nov 2026 10:00:00 GMT\r\nContent-Type: application/json\r\n\r\n",
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n",
            ],
            assert_same,
        );
    }

    fn scan_request(text: &[u8]) -> Option<(RequestLine, Fields<N>)> {
        let mut fields = Fields::new();
        request_head::<N>(text, &mut fields).map(|line| (line, fields))
    }

    /// What the request-side scan takes, httparse reads the same from.
    fn assert_same_request(buf: &[u8]) -> bool {
        let Some((fast, fast_fields)) = scan_request(buf) else {
            return false;
        };
        let text = String::from_utf8_lossy(buf);
        let mut slots = [const { MaybeUninit::uninit() }; N];
        let mut slow = httparse::Request::new(&mut []);
        let len = match slow.parse_with_uninit_headers(buf, &mut slots) {
            Ok(httparse::Status::Complete(len)) => len,
            other => panic!("httparse reads {other:?} where the scan took {text:?}"),
        };
        assert_eq!(fast.len, len, "{text:?}");
        assert_eq!(Some(fast.version), slow.version, "{text:?}");
        assert_eq!(
            slow.method.map(str::as_bytes),
            Some(&buf[fast.method.clone()]),
            "{text:?}"
        );
        assert_eq!(slow.path.map(str::as_bytes), Some(&buf[fast.target]), "{text:?}");
        assert_eq!(fast_fields.len(), slow.headers.len(), "{text:?}");
        for (a, b) in fast_fields.iter().zip(slow.headers.iter()) {
            assert_eq!(&buf[a.name()], b.name.as_bytes(), "{text:?}");
            assert_eq!(&buf[a.value()], b.value, "{text:?}");
        }
        true
    }

    #[test]
    fn request_heads_are_read_as_httparse_reads_them_or_left_to_it() {
        for text in [
            "GET / HTTP/1.1\r\nHost: a\r\n\r\n",
            "GET http://example.com:8080/a/b?c=d#e HTTP/1.0\r\nUser-Agent: x/1 (y)\r\nAccept: */*\r\n\r\nbody",
            "CONNECT example.com:443 HTTP/1.1\r\n\r\n",
            "M-SEARCH * HTTP/1.1\r\n\r\n",
        ] {
            assert!(assert_same_request(text.as_bytes()), "the scan takes {text:?}");
        }
        for text in [
            "GET / HTTP/1.1\r\nHost: a\r\n",   // incomplete
            "GET / HTTP/1.1\nHost: a\n\n",     // bare LF
            "\r\nGET / HTTP/1.1\r\n\r\n",      // a leading empty line
            "GET  / HTTP/1.1\r\n\r\n",         // two spaces
            "GET /caf\u{e9} HTTP/1.1\r\n\r\n", // UTF-8 in the target
            "GET / HTTP/2.0\r\n\r\n",          // version
            "G(T / HTTP/1.1\r\n\r\n",          // not a token
            " / HTTP/1.1\r\n\r\n",             // no method
        ] {
            assert!(scan_request(text.as_bytes()).is_none(), "{text:?}");
        }
    }

    #[test]
    fn request_heads_same_as_httparse() {
        mutated(
            &[
                b"GET /index.html?q=1 HTTP/1.1\r\nHost: example.com\r\nUser-Agent: curl/8\r\nAccept: */*\r\n\r\n",
                b"POST http://api.example.com/v1/chat HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
                b"CONNECT example.com:443 HTTP/1.0\r\nProxy-Authorization: Basic eDp5\r\n\r\n",
            ],
            assert_same_request,
        );
    }
}
