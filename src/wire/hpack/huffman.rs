//! HPACK's Huffman code (RFC 7541 §5.2, Appendix B): the code table, encoding, and a decoder
//! that reads a whole symbol per table lookup.
//!
//! The code is canonical: sorted by length and then by symbol, each code is the one before plus
//! one, shifted left when the length grows (`the_code_is_canonical` derives every code from the
//! lengths alone and finds the RFC's). So a decoder needs no tree: it looks at the next 32 bits,
//! finds the code's length by comparing them with where each length's codes end, and turns the
//! code into a symbol by its offset from the first code of that length. A 256-entry table answers
//! the codes of at most 8 bits (every letter, digit and common punctuation) in one lookup.

#[cfg(test)]
use bytes::{BufMut, BytesMut};

/// How a Huffman-coded string breaks RFC 7541 §5.2. What follows the last whole symbol is
/// padding: it must be a prefix of EOS (all ones), and shorter than a byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HuffmanError {
    /// More than 7 bits left after the last whole symbol.
    #[error("Huffman padding longer than 7 bits")]
    PaddingTooLong,
    /// The bits after the last whole symbol are not all ones.
    #[error("Huffman padding not all ones")]
    PaddingNotOnes,
    /// The end-of-string symbol decoded inside the string.
    #[error("EOS symbol inside a Huffman-coded string")]
    Eos,
}

/// The end-of-string symbol, whose code pads the last byte.
const EOS: u16 = 256;

/// The longest code (several symbols and EOS have 30 bits).
const MAX_LEN: usize = 30;

/// Appendix B: `(code, length in bits)` for each symbol, EOS last. Spec data, transcribed.
const CODES: [(u32, u8); 257] = [
    (0x1ff8, 13),     // (0)
    (0x7fffd8, 23),   // (1)
    (0xfffffe2, 28),  // (2)
    (0xfffffe3, 28),  // (3)
    (0xfffffe4, 28),  // (4)
    (0xfffffe5, 28),  // (5)
    (0xfffffe6, 28),  // (6)
    (0xfffffe7, 28),  // (7)
    (0xfffffe8, 28),  // (8)
    (0xffffea, 24),   // (9)
    (0x3ffffffc, 30), // (10)
    (0xfffffe9, 28),  // (11)
    (0xfffffea, 28),  // (12)
    (0x3ffffffd, 30), // (13)
    (0xfffffeb, 28),  // (14)
    (0xfffffec, 28),  // (15)
    (0xfffffed, 28),  // (16)
    (0xfffffee, 28),  // (17)
    (0xfffffef, 28),  // (18)
    (0xffffff0, 28),  // (19)
    (0xffffff1, 28),  // (20)
    (0xffffff2, 28),  // (21)
    (0x3ffffffe, 30), // (22)
    (0xffffff3, 28),  // (23)
    (0xffffff4, 28),  // (24)
    (0xffffff5, 28),  // (25)
    (0xffffff6, 28),  // (26)
    (0xffffff7, 28),  // (27)
    (0xffffff8, 28),  // (28)
    (0xffffff9, 28),  // (29)
    (0xffffffa, 28),  // (30)
    (0xffffffb, 28),  // (31)
    (0x14, 6),        // ' ' (32)
    (0x3f8, 10),      // '!' (33)
    (0x3f9, 10),      // '"' (34)
    (0xffa, 12),      // '#' (35)
    (0x1ff9, 13),     // '$' (36)
    (0x15, 6),        // '%' (37)
    (0xf8, 8),        // '&' (38)
    (0x7fa, 11),      // '\'' (39)
    (0x3fa, 10),      // '(' (40)
    (0x3fb, 10),      // ')' (41)
    (0xf9, 8),        // '*' (42)
    (0x7fb, 11),      // '+' (43)
    (0xfa, 8),        // ',' (44)
    (0x16, 6),        // '-' (45)
    (0x17, 6),        // '.' (46)
    (0x18, 6),        // '/' (47)
    (0x0, 5),         // '0' (48)
    (0x1, 5),         // '1' (49)
    (0x2, 5),         // '2' (50)
    (0x19, 6),        // '3' (51)
    (0x1a, 6),        // '4' (52)
    (0x1b, 6),        // '5' (53)
    (0x1c, 6),        // '6' (54)
    (0x1d, 6),        // '7' (55)
    (0x1e, 6),        // '8' (56)
    (0x1f, 6),        // '9' (57)
    (0x5c, 7),        // ':' (58)
    (0xfb, 8),        // ';' (59)
    (0x7ffc, 15),     // '<' (60)
    (0x20, 6),        // '=' (61)
    (0xffb, 12),      // '>' (62)
    (0x3fc, 10),      // '?' (63)
    (0x1ffa, 13),     // '@' (64)
    (0x21, 6),        // 'A' (65)
    (0x5d, 7),        // 'B' (66)
    (0x5e, 7),        // 'C' (67)
    (0x5f, 7),        // 'D' (68)
    (0x60, 7),        // 'E' (69)
    (0x61, 7),        // 'F' (70)
    (0x62, 7),        // 'G' (71)
    (0x63, 7),        // 'H' (72)
    (0x64, 7),        // 'I' (73)
    (0x65, 7),        // 'J' (74)
    (0x66, 7),        // 'K' (75)
    (0x67, 7),        // 'L' (76)
    (0x68, 7),        // 'M' (77)
    (0x69, 7),        // 'N' (78)
    (0x6a, 7),        // 'O' (79)
    (0x6b, 7),        // 'P' (80)
    (0x6c, 7),        // 'Q' (81)
    (0x6d, 7),        // 'R' (82)
    (0x6e, 7),        // 'S' (83)
    (0x6f, 7),        // 'T' (84)
    (0x70, 7),        // 'U' (85)
    (0x71, 7),        // 'V' (86)
    (0x72, 7),        // 'W' (87)
    (0xfc, 8),        // 'X' (88)
    (0x73, 7),        // 'Y' (89)
    (0xfd, 8),        // 'Z' (90)
    (0x1ffb, 13),     // '[' (91)
    (0x7fff0, 19),    // '\\' (92)
    (0x1ffc, 13),     // ']' (93)
    (0x3ffc, 14),     // '^' (94)
    (0x22, 6),        // '_' (95)
    (0x7ffd, 15),     // '`' (96)
    (0x3, 5),         // 'a' (97)
    (0x23, 6),        // 'b' (98)
    (0x4, 5),         // 'c' (99)
    (0x24, 6),        // 'd' (100)
    (0x5, 5),         // 'e' (101)
    (0x25, 6),        // 'f' (102)
    (0x26, 6),        // 'g' (103)
    (0x27, 6),        // 'h' (104)
    (0x6, 5),         // 'i' (105)
    (0x74, 7),        // 'j' (106)
    (0x75, 7),        // 'k' (107)
    (0x28, 6),        // 'l' (108)
    (0x29, 6),        // 'm' (109)
    (0x2a, 6),        // 'n' (110)
    (0x7, 5),         // 'o' (111)
    (0x2b, 6),        // 'p' (112)
    (0x76, 7),        // 'q' (113)
    (0x2c, 6),        // 'r' (114)
    (0x8, 5),         // 's' (115)
    (0x9, 5),         // 't' (116)
    (0x2d, 6),        // 'u' (117)
    (0x77, 7),        // 'v' (118)
    (0x78, 7),        // 'w' (119)
    (0x79, 7),        // 'x' (120)
    (0x7a, 7),        // 'y' (121)
    (0x7b, 7),        // 'z' (122)
    (0x7ffe, 15),     // '{' (123)
    (0x7fc, 11),      // '|' (124)
    (0x3ffd, 14),     // '}' (125)
    (0x1ffd, 13),     // '~' (126)
    (0xffffffc, 28),  // (127)
    (0xfffe6, 20),    // (128)
    (0x3fffd2, 22),   // (129)
    (0xfffe7, 20),    // (130)
    (0xfffe8, 20),    // (131)
    (0x3fffd3, 22),   // (132)
    (0x3fffd4, 22),   // (133)
    (0x3fffd5, 22),   // (134)
    (0x7fffd9, 23),   // (135)
    (0x3fffd6, 22),   // (136)
    (0x7fffda, 23),   // (137)
    (0x7fffdb, 23),   // (138)
    (0x7fffdc, 23),   // (139)
    (0x7fffdd, 23),   // (140)
    (0x7fffde, 23),   // (141)
    (0xffffeb, 24),   // (142)
    (0x7fffdf, 23),   // (143)
    (0xffffec, 24),   // (144)
    (0xffffed, 24),   // (145)
    (0x3fffd7, 22),   // (146)
    (0x7fffe0, 23),   // (147)
    (0xffffee, 24),   // (148)
    (0x7fffe1, 23),   // (149)
    (0x7fffe2, 23),   // (150)
    (0x7fffe3, 23),   // (151)
    (0x7fffe4, 23),   // (152)
    (0x1fffdc, 21),   // (153)
    (0x3fffd8, 22),   // (154)
    (0x7fffe5, 23),   // (155)
    (0x3fffd9, 22),   // (156)
    (0x7fffe6, 23),   // (157)
    (0x7fffe7, 23),   // (158)
    (0xffffef, 24),   // (159)
    (0x3fffda, 22),   // (160)
    (0x1fffdd, 21),   // (161)
    (0xfffe9, 20),    // (162)
    (0x3fffdb, 22),   // (163)
    (0x3fffdc, 22),   // (164)
    (0x7fffe8, 23),   // (165)
    (0x7fffe9, 23),   // (166)
    (0x1fffde, 21),   // (167)
    (0x7fffea, 23),   // (168)
    (0x3fffdd, 22),   // (169)
    (0x3fffde, 22),   // (170)
    (0xfffff0, 24),   // (171)
    (0x1fffdf, 21),   // (172)
    (0x3fffdf, 22),   // (173)
    (0x7fffeb, 23),   // (174)
    (0x7fffec, 23),   // (175)
    (0x1fffe0, 21),   // (176)
    (0x1fffe1, 21),   // (177)
    (0x3fffe0, 22),   // (178)
    (0x1fffe2, 21),   // (179)
    (0x7fffed, 23),   // (180)
    (0x3fffe1, 22),   // (181)
    (0x7fffee, 23),   // (182)
    (0x7fffef, 23),   // (183)
    (0xfffea, 20),    // (184)
    (0x3fffe2, 22),   // (185)
    (0x3fffe3, 22),   // (186)
    (0x3fffe4, 22),   // (187)
    (0x7ffff0, 23),   // (188)
    (0x3fffe5, 22),   // (189)
    (0x3fffe6, 22),   // (190)
    (0x7ffff1, 23),   // (191)
    (0x3ffffe0, 26),  // (192)
    (0x3ffffe1, 26),  // (193)
    (0xfffeb, 20),    // (194)
    (0x7fff1, 19),    // (195)
    (0x3fffe7, 22),   // (196)
    (0x7ffff2, 23),   // (197)
    (0x3fffe8, 22),   // (198)
    (0x1ffffec, 25),  // (199)
    (0x3ffffe2, 26),  // (200)
    (0x3ffffe3, 26),  // (201)
    (0x3ffffe4, 26),  // (202)
    (0x7ffffde, 27),  // (203)
    (0x7ffffdf, 27),  // (204)
    (0x3ffffe5, 26),  // (205)
    (0xfffff1, 24),   // (206)
    (0x1ffffed, 25),  // (207)
    (0x7fff2, 19),    // (208)
    (0x1fffe3, 21),   // (209)
    (0x3ffffe6, 26),  // (210)
    (0x7ffffe0, 27),  // (211)
    (0x7ffffe1, 27),  // (212)
    (0x3ffffe7, 26),  // (213)
    (0x7ffffe2, 27),  // (214)
    (0xfffff2, 24),   // (215)
    (0x1fffe4, 21),   // (216)
    (0x1fffe5, 21),   // (217)
    (0x3ffffe8, 26),  // (218)
    (0x3ffffe9, 26),  // (219)
    (0xffffffd, 28),  // (220)
    (0x7ffffe3, 27),  // (221)
    (0x7ffffe4, 27),  // (222)
    (0x7ffffe5, 27),  // (223)
    (0xfffec, 20),    // (224)
    (0xfffff3, 24),   // (225)
    (0xfffed, 20),    // (226)
    (0x1fffe6, 21),   // (227)
    (0x3fffe9, 22),   // (228)
    (0x1fffe7, 21),   // (229)
    (0x1fffe8, 21),   // (230)
    (0x7ffff3, 23),   // (231)
    (0x3fffea, 22),   // (232)
    (0x3fffeb, 22),   // (233)
    (0x1ffffee, 25),  // (234)
    (0x1ffffef, 25),  // (235)
    (0xfffff4, 24),   // (236)
    (0xfffff5, 24),   // (237)
    (0x3ffffea, 26),  // (238)
    (0x7ffff4, 23),   // (239)
    (0x3ffffeb, 26),  // (240)
    (0x7ffffe6, 27),  // (241)
    (0x3ffffec, 26),  // (242)
    (0x3ffffed, 26),  // (243)
    (0x7ffffe7, 27),  // (244)
    (0x7ffffe8, 27),  // (245)
    (0x7ffffe9, 27),  // (246)
    (0x7ffffea, 27),  // (247)
    (0x7ffffeb, 27),  // (248)
    (0xffffffe, 28),  // (249)
    (0x7ffffec, 27),  // (250)
    (0x7ffffed, 27),  // (251)
    (0x7ffffee, 27),  // (252)
    (0x7ffffef, 27),  // (253)
    (0x7fffff0, 27),  // (254)
    (0x3ffffee, 26),  // (255)
    (0x3fffffff, 30), // EOS
];

/// The code table for the encoder, indexed by byte. Only tests encode: our requests' strings go
/// out as they are (see `hpack`'s module doc), and the tests code strings for the decoder.
#[cfg(test)]
static ENCODE: [(u32, u8); 257] = CODES;

/// The decoding tables, derived from the code lengths at compile time.
static DECODING: Decoding = Decoding::build();

/// Codes this long or shorter decode through [`Decoding::short`].
const SHORT_BITS: usize = 8;

/// Canonical decoding tables (see the module doc); the arrays of `MAX_LEN + 1` are indexed by
/// code length.
struct Decoding {
    /// By the next 8 bits: `symbol | length << 9` of the code they start with, 0 when that code
    /// is longer than 8 bits.
    short: [u16; 1 << SHORT_BITS],
    /// One past the last code of each length, left-aligned in 32 bits: the next 32 bits hold a
    /// code of the first length whose `end` they are below. A `u64`, as the last is 2^32.
    end: [u64; MAX_LEN + 1],
    /// The first code of each length.
    first: [u32; MAX_LEN + 1],
    /// Where each length's symbols start in `symbols`.
    start: [u16; MAX_LEN + 1],
    /// The symbols in code order: by length, then by symbol.
    symbols: [u16; 257],
}

impl Decoding {
    /// Built from the code lengths alone, the canonical way; `the_code_is_canonical` checks that
    /// this gives the RFC's codes.
    const fn build() -> Self {
        let mut count = [0u64; MAX_LEN + 1];
        let mut symbol = 0;
        while symbol < CODES.len() {
            count[CODES[symbol].1 as usize] += 1;
            symbol += 1;
        }
        let mut tables = Decoding {
            short: [0; 1 << SHORT_BITS],
            end: [0; MAX_LEN + 1],
            first: [0; MAX_LEN + 1],
            start: [0; MAX_LEN + 1],
            symbols: [0; 257],
        };
        let mut code = 0u64;
        let mut next = 0;
        let mut len = 1;
        while len <= MAX_LEN {
            code = (code + count[len - 1]) << 1;
            tables.first[len] = code as u32;
            tables.start[len] = next as u16;
            tables.end[len] = (code + count[len]) << (32 - len);
            let mut symbol = 0;
            while symbol < CODES.len() {
                if CODES[symbol].1 as usize == len {
                    tables.symbols[next] = symbol as u16;
                    if len <= SHORT_BITS {
                        let code = code as usize + next - tables.start[len] as usize;
                        let span = 1 << (SHORT_BITS - len);
                        let mut i = 0;
                        while i < span {
                            tables.short[code * span + i] = symbol as u16 | (len as u16) << 9;
                            i += 1;
                        }
                    }
                    next += 1;
                }
                symbol += 1;
            }
            len += 1;
        }
        tables
    }

    /// The symbol whose code starts `window` (the next 32 bits, left-aligned), and its length.
    fn symbol(&self, window: u32) -> (u16, u32) {
        let short = self.short[(window >> (32 - SHORT_BITS)) as usize];
        if short != 0 {
            return (short & 0x1ff, u32::from(short >> 9));
        }
        if window == u32::MAX {
            // EOS, or a string's padding: spare it the walk through every length.
            return (EOS, MAX_LEN as u32);
        }
        for len in SHORT_BITS + 1..=MAX_LEN {
            if u64::from(window) < self.end[len] {
                let offset = (window >> (32 - len)) - self.first[len];
                let symbol = self.symbols[usize::from(self.start[len]) + offset as usize];
                return (symbol, len as u32);
            }
        }
        // Unreachable: the codes fill the code space (the Kraft sum test), so the last length's
        // `end` is 2^32.
        (EOS, MAX_LEN as u32)
    }
}

/// Decodes a Huffman-coded string, appending the bytes to `dst`.
pub(super) fn decode(src: &[u8], dst: &mut Vec<u8>) -> Result<(), HuffmanError> {
    // The shortest code is 5 bits.
    dst.reserve(src.len() * 8 / 5);
    let mut bits = Bits {
        acc: 0,
        len: 0,
        rest: src,
    };
    loop {
        bits.refill();
        if bits.len < MAX_LEN as u32 {
            // Refilling stops short only at the end of the string.
            return decode_tail(bits.acc, bits.len, dst);
        }
        // Any code fits in what is buffered: no end to mind until it runs low.
        while bits.len >= MAX_LEN as u32 {
            let window = (bits.acc << (64 - bits.len) >> 32) as u32;
            let (symbol, len) = DECODING.symbol(window);
            if symbol == EOS {
                return Err(HuffmanError::Eos);
            }
            dst.push(symbol as u8);
            bits.len -= len;
        }
    }
}

/// The bits of a string not yet decoded: the low `len` bits of `acc` (what lies above them was
/// decoded already), then `rest`.
struct Bits<'a> {
    acc: u64,
    len: u32,
    rest: &'a [u8],
}

impl Bits<'_> {
    /// Buffers as many whole bytes as fit: more than 56 bits, or all that is left.
    fn refill(&mut self) {
        if let Some(chunk) = self.rest.first_chunk::<8>() {
            let take = (64 - self.len) / 8;
            let word = u64::from_be_bytes(*chunk);
            // `take` is 8 only when nothing is buffered, and a shift by 64 must then give 0.
            self.acc = self.acc.unbounded_shl(take * 8) | word.unbounded_shr(64 - take * 8);
            self.len += take * 8;
            self.rest = &self.rest[take as usize..];
            return;
        }
        while self.len <= 56 {
            let Some((&byte, tail)) = self.rest.split_first() else {
                return;
            };
            self.acc = self.acc << 8 | u64::from(byte);
            self.len += 8;
            self.rest = tail;
        }
    }
}

/// Decodes the last `bits` (fewer than 30) of a string, held in the low bits of `acc`. Past them
/// the window reads ones, so the padding reads as EOS, longer than what is left, exactly when it
/// is valid.
fn decode_tail(acc: u64, mut bits: u32, dst: &mut Vec<u8>) -> Result<(), HuffmanError> {
    while bits > 0 {
        let window = ((acc << (32 - bits)) as u32) | (u32::MAX >> bits);
        let (symbol, len) = DECODING.symbol(window);
        if len > bits {
            return padding(window, bits);
        }
        // Not EOS: its 30 bits are more than are left.
        dst.push(symbol as u8);
        bits -= len;
    }
    Ok(())
}

/// Checks the `bits` left after the last whole symbol: fewer than 8, all ones.
fn padding(window: u32, bits: u32) -> Result<(), HuffmanError> {
    if bits > 7 {
        Err(HuffmanError::PaddingTooLong)
    } else if window != u32::MAX {
        Err(HuffmanError::PaddingNotOnes)
    } else {
        Ok(())
    }
}

/// The length of `src` Huffman-coded, in bytes.
#[cfg(test)]
pub(super) fn encoded_len(src: &[u8]) -> usize {
    let bits: usize = src.iter().map(|&b| usize::from(ENCODE[usize::from(b)].1)).sum();
    bits.div_ceil(8)
}

/// Appends `src` Huffman-coded: exactly [`encoded_len`] bytes, the last padded with ones.
#[cfg(test)]
pub(super) fn encode(src: &[u8], dst: &mut BytesMut) {
    // The pending bits are the low `bits` of `acc`, fewer than 32 between symbols.
    let mut acc = 0u64;
    let mut bits = 0u32;
    for &byte in src {
        let (code, len) = ENCODE[usize::from(byte)];
        acc = acc << len | u64::from(code);
        bits += u32::from(len);
        if bits >= 32 {
            bits -= 32;
            dst.put_u32((acc >> bits) as u32);
        }
    }
    let pad = bits.next_multiple_of(8) - bits;
    acc = acc << pad | ((1 << pad) - 1);
    bits += pad;
    while bits > 0 {
        bits -= 8;
        dst.put_u8((acc >> bits) as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::hpack::tests::hex;

    fn encoded(src: &[u8]) -> Vec<u8> {
        let mut dst = BytesMut::new();
        encode(src, &mut dst);
        assert_eq!(dst.len(), encoded_len(src), "{src:?}");
        dst.to_vec()
    }

    fn decoded(src: &[u8]) -> Result<Vec<u8>, HuffmanError> {
        let mut dst = Vec::new();
        decode(src, &mut dst).map(|()| dst)
    }

    /// Rebuilds every code from the lengths alone, the canonical way (by length, then by
    /// symbol, each code the previous plus one, shifted when the length grows), and finds the
    /// RFC's codes: the decoder's tables are built on exactly this.
    #[test]
    fn the_code_is_canonical() {
        let mut order: Vec<usize> = (0..CODES.len()).collect();
        order.sort_by_key(|&s| (CODES[s].1, s));
        let mut code = 0u32;
        let mut prev_len = CODES[order[0]].1;
        for (i, &symbol) in order.iter().enumerate() {
            let len = CODES[symbol].1;
            if i > 0 {
                code = (code + 1) << (len - prev_len);
            }
            assert_eq!(CODES[symbol].0, code, "symbol {symbol}");
            prev_len = len;
        }
    }

    /// The code fills the code space exactly: the Kraft sum of all 257 codes is 1, so every bit
    /// string starts with some code, and no code is a prefix of another.
    #[test]
    fn kraft_sum_is_one_and_no_code_is_a_prefix_of_another() {
        let sum: u64 = CODES
            .iter()
            .map(|&(_, len)| 1u64 << (MAX_LEN - usize::from(len)))
            .sum();
        assert_eq!(sum, 1 << MAX_LEN);
        for (a, &(code_a, len_a)) in CODES.iter().enumerate() {
            assert!(
                u64::from(code_a) < 1 << len_a,
                "symbol {a}: code wider than its length"
            );
            for (b, &(code_b, len_b)) in CODES.iter().enumerate() {
                if a != b && len_a <= len_b {
                    assert_ne!(code_b >> (len_b - len_a), code_a, "{a} is a prefix of {b}");
                }
            }
        }
    }

    #[test]
    fn every_symbol_round_trips_alone_and_in_runs() {
        for byte in 0..=255u8 {
            for run in 1..=9 {
                let src = vec![byte; run];
                assert_eq!(decoded(&encoded(&src)), Ok(src), "{byte} x{run}");
            }
        }
        let all: Vec<u8> = (0..=255).chain((0..=255).rev()).collect();
        assert_eq!(decoded(&encoded(&all)), Ok(all));
    }

    #[test]
    fn pseudo_random_strings_round_trip() {
        let mut state = 0x2545_f491u32;
        for len in 0..300 {
            let src: Vec<u8> = (0..len)
                .map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (state >> 24) as u8
                })
                .collect();
            assert_eq!(decoded(&encoded(&src)), Ok(src));
        }
    }

    /// The strings RFC 7541 Appendix C.4 and C.6 Huffman-code, with their bytes there.
    #[test]
    fn rfc_examples_code_to_the_rfc_bytes() {
        let examples: [(&str, &str); 12] = [
            ("www.example.com", "f1e3 c2e5 f23a 6ba0 ab90 f4ff"),
            ("no-cache", "a8eb 1064 9cbf"),
            ("custom-key", "25a8 49e9 5ba9 7d7f"),
            ("custom-value", "25a8 49e9 5bb8 e8b4 bf"),
            ("302", "6402"),
            ("private", "aec3 771a 4b"),
            (
                "Mon, 21 Oct 2013 20:13:21 GMT",
                "d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff",
            ),
            (
                "https://www.example.com",
                "9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3",
            ),
            ("307", "640e ff"),
            (
                "Mon, 21 Oct 2013 20:13:22 GMT",
                "d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff",
            ),
            ("gzip", "9bd9 ab"),
            (
                "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1",
                "94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 \
                 3160 65c0 03ed 4ee5 b106 3d50 07",
            ),
        ];
        for (text, bytes) in examples {
            assert_eq!(encoded(text.as_bytes()), hex(bytes), "{text}");
            assert_eq!(decoded(&hex(bytes)), Ok(text.as_bytes().to_vec()), "{text}");
        }
    }

    #[test]
    fn bad_padding_and_eos_are_errors() {
        // 'a' is 00011: then 11 bits of ones.
        assert_eq!(decoded(&[0x1f, 0xff]), Err(HuffmanError::PaddingTooLong));
        assert_eq!(decoded(&[0xff]), Err(HuffmanError::PaddingTooLong));
        // 'a' then 000, which starts the code of '0' (00000) but ends first.
        assert_eq!(decoded(&[0x18]), Err(HuffmanError::PaddingNotOnes));
        // 'a' then 110.
        assert_eq!(decoded(&[0x1e]), Err(HuffmanError::PaddingNotOnes));
        // EOS (30 ones) then 2 more ones.
        assert_eq!(decoded(&[0xff; 4]), Err(HuffmanError::Eos));
        // 'a', EOS, 'a' and padding.
        let mut eos_inside = BytesMut::new();
        eos_inside.put_uint(0b00011u64 << 35 | 0x3fff_ffff << 5 | 0b00011, 5);
        assert_eq!(decoded(&eos_inside), Err(HuffmanError::Eos));
        assert_eq!(decoded(&[]), Ok(vec![]));
        assert_eq!(decoded(&[0x1f]), Ok(b"a".to_vec()));
    }

    /// Every string of up to two bytes decodes or fails without panicking, and whatever decodes
    /// codes back to the same bytes (valid padding is exactly what the encoder writes).
    #[test]
    fn every_short_input_decodes_or_fails_and_decoded_ones_code_back() {
        let inputs = (0..=255u8)
            .map(|a| vec![a])
            .chain((0..=0xffffu16).map(|ab| ab.to_be_bytes().to_vec()));
        for input in inputs {
            if let Ok(text) = decoded(&input) {
                assert_eq!(encoded(&text), input);
            }
        }
    }
}
