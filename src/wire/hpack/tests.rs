//! Tests of the decoder and encoder: RFC 7541 Appendix C, each decoding error from a crafted
//! block, and encoder output decoded again. The Huffman code's own tests are in `huffman.rs`.

use std::convert::Infallible;

use bytes::BytesMut;

use super::*;

/// Bytes from hex digits, spaces and line breaks ignored (as the RFC prints them).
pub(super) fn hex(text: &str) -> Vec<u8> {
    let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    let value = |d: u8| (d as char).to_digit(16).unwrap() as u8;
    digits.chunks(2).map(|p| value(p[0]) << 4 | value(p[1])).collect()
}

type Owned = Vec<(Vec<u8>, Vec<u8>, bool)>;

fn decode(decoder: &mut Decoder, block: &[u8]) -> Result<Owned, DecodeError<Infallible>> {
    let mut fields = Vec::new();
    decoder.decode(block, |f| {
        fields.push((f.name.to_vec(), f.value.to_vec(), f.never_indexed));
        Ok(())
    })?;
    Ok(fields)
}

fn text(pairs: &[(&[u8], &[u8])]) -> Vec<(String, String)> {
    let lossy = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    pairs.iter().map(|(n, v)| (lossy(n), lossy(v))).collect()
}

fn expected(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

/// Decodes one RFC example block and checks its fields, then the dynamic table's entries
/// (newest first) and size.
fn check(decoder: &mut Decoder, block: &str, fields: &[(&str, &str)], table: &[(&str, &str)], size: usize) {
    let decoded = decode(decoder, &hex(block)).unwrap();
    let pairs: Vec<_> = decoded.iter().map(|(n, v, _)| (&n[..], &v[..])).collect();
    assert_eq!(text(&pairs), expected(fields));
    assert_eq!(text(&decoder.table_entries()), expected(table));
    assert_eq!(decoder.table_size(), size);
}

fn block_error(decoder: &mut Decoder, block: &[u8]) -> BlockError {
    match decode(decoder, block) {
        Err(DecodeError::Block(e)) => e,
        other => panic!("{block:02x?}: {other:?}"),
    }
}

fn fresh() -> Decoder {
    Decoder::new(4096, usize::MAX)
}

// === C.1: integers ===

fn integer(bytes: &[u8], prefix_bits: u32) -> Result<usize, BlockError> {
    let mut src = Cursor(bytes);
    let value = src.integer(prefix_bits)?;
    assert!(src.0.is_empty(), "{bytes:02x?}: bytes left");
    Ok(value)
}

fn put(value: usize, prefix_bits: u32) -> Vec<u8> {
    let mut dst = BytesMut::new();
    put_integer(value, prefix_bits, 0, &mut dst);
    dst.to_vec()
}

#[test]
fn c1_integers() {
    for (value, prefix_bits, bytes) in [
        (10, 5, &[0b01010][..]),
        (1337, 5, &[0b11111, 0b10011010, 0b00001010]),
        (42, 8, &[0b00101010]),
    ] {
        assert_eq!(put(value, prefix_bits), bytes);
        assert_eq!(integer(bytes, prefix_bits), Ok(value));
    }
    // The prefix's other bits are the representation's, not the integer's.
    assert_eq!(integer(&[0b1110_1010], 5), Ok(10));
}

#[test]
fn integers_up_to_2_pow_32_minus_1_and_no_further() {
    let max = u32::MAX as usize;
    assert_eq!(integer(&put(max, 7), 7), Ok(max));
    assert_eq!(integer(&put(max, 4), 4), Ok(max));
    assert_eq!(integer(&put(max + 1, 7), 7), Err(BlockError::IntegerOverflow));
    // Six continuation bytes, though the value is small.
    let padded = [0x7f, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00];
    assert_eq!(integer(&padded, 7), Err(BlockError::IntegerOverflow));
    // Five are fine when the value fits.
    assert_eq!(integer(&[0x7f, 0x81, 0x80, 0x80, 0x80, 0x00], 7), Ok(128));
    assert_eq!(integer(&[0x7f, 0x81], 7), Err(BlockError::Truncated));
}

// === C.2: one field each ===

#[test]
fn c2_1_literal_with_indexing() {
    let block = "400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572";
    let field = [("custom-key", "custom-header")];
    check(&mut fresh(), block, &field, &field, 55);
}

#[test]
fn c2_2_literal_without_indexing() {
    let block = "040c 2f73 616d 706c 652f 7061 7468";
    check(&mut fresh(), block, &[(":path", "/sample/path")], &[], 0);
}

#[test]
fn c2_3_literal_never_indexed() {
    let mut decoder = fresh();
    let block = hex("1008 7061 7373 776f 7264 0673 6563 7265 74");
    let fields = decode(&mut decoder, &block).unwrap();
    assert_eq!(fields, [(b"password".to_vec(), b"secret".to_vec(), true)]);
    assert_eq!(decoder.table_size(), 0);
}

#[test]
fn c2_4_indexed() {
    check(&mut fresh(), "82", &[(":method", "GET")], &[], 0);
}

// === C.3 to C.6: a connection's blocks through one decoder ===

const AUTHORITY: (&str, &str) = (":authority", "www.example.com");
const NO_CACHE: (&str, &str) = ("cache-control", "no-cache");
const CUSTOM: (&str, &str) = ("custom-key", "custom-value");

fn requests(blocks: [&str; 3]) {
    let mut decoder = fresh();
    let get = [(":method", "GET"), (":scheme", "http"), (":path", "/"), AUTHORITY];
    check(&mut decoder, blocks[0], &get, &[AUTHORITY], 57);
    let second = [get[0], get[1], get[2], AUTHORITY, NO_CACHE];
    check(&mut decoder, blocks[1], &second, &[NO_CACHE, AUTHORITY], 110);
    let third = [
        (":method", "GET"),
        (":scheme", "https"),
        (":path", "/index.html"),
        AUTHORITY,
        CUSTOM,
    ];
    check(
        &mut decoder,
        blocks[2],
        &third,
        &[CUSTOM, NO_CACHE, AUTHORITY],
        164,
    );
}

#[test]
fn c3_requests_without_huffman() {
    requests([
        "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        "8286 84be 5808 6e6f 2d63 6163 6865",
        "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
    ]);
}

#[test]
fn c4_requests_with_huffman() {
    requests([
        "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
        "8286 84be 5886 a8eb 1064 9cbf",
        "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
    ]);
}

const LOCATION: (&str, &str) = ("location", "https://www.example.com");
const DATE_21: (&str, &str) = ("date", "Mon, 21 Oct 2013 20:13:21 GMT");
const DATE_22: (&str, &str) = ("date", "Mon, 21 Oct 2013 20:13:22 GMT");
const PRIVATE: (&str, &str) = ("cache-control", "private");
const GZIP: (&str, &str) = ("content-encoding", "gzip");
const COOKIE: (&str, &str) = (
    "set-cookie",
    "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1",
);

/// Three responses with a 256-byte table: the second evicts `:status: 302`, the third three
/// entries more.
fn responses(blocks: [&str; 3]) {
    let mut decoder = Decoder::new(256, usize::MAX);
    let first = [(":status", "302"), PRIVATE, DATE_21, LOCATION];
    let table = [LOCATION, DATE_21, PRIVATE, (":status", "302")];
    check(&mut decoder, blocks[0], &first, &table, 222);
    let second = [(":status", "307"), PRIVATE, DATE_21, LOCATION];
    let table = [(":status", "307"), LOCATION, DATE_21, PRIVATE];
    check(&mut decoder, blocks[1], &second, &table, 222);
    let third = [(":status", "200"), PRIVATE, DATE_22, LOCATION, GZIP, COOKIE];
    check(&mut decoder, blocks[2], &third, &[COOKIE, GZIP, DATE_22], 215);
}

#[test]
fn c5_responses_without_huffman() {
    responses([
        "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
         2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70
         6c65 2e63 6f6d",
        "4803 3330 37c1 c0bf",
        "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
         54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
         5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e
         3d31",
    ]);
}

#[test]
fn c6_responses_with_huffman() {
    responses([
        "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
         2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
        "4883 640e ffc1 c0bf",
        "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
         77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
         9587 3160 65c0 03ed 4ee5 b106 3d50 07",
    ]);
}

// === The dynamic table ===

/// §4.4: a new entry may name an entry its own insertion evicts.
#[test]
fn an_entry_may_take_its_name_from_the_entry_it_evicts() {
    let mut decoder = fresh();
    // Size update to 60, then `ab: cd` (36 bytes).
    decode(
        &mut decoder,
        &[0x3f, 0x1d, 0x40, 0x02, b'a', b'b', 0x02, b'c', b'd'],
    )
    .unwrap();
    assert_eq!(decoder.table_size(), 36);
    // `ab` by index 62, with a value that makes 38 bytes: `ab: cd` must go first.
    let fields = decode(&mut decoder, &[0x7e, 0x04, b'w', b'x', b'y', b'z']).unwrap();
    assert_eq!(fields, [(b"ab".to_vec(), b"wxyz".to_vec(), false)]);
    assert_eq!(text(&decoder.table_entries()), expected(&[("ab", "wxyz")]));
    assert_eq!(decoder.table_size(), 38);
}

#[test]
fn size_updates_come_first_any_number_of_them() {
    let mut decoder = fresh();
    check(
        &mut decoder,
        "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        &[(":method", "GET"), (":scheme", "http"), (":path", "/"), AUTHORITY],
        &[AUTHORITY],
        57,
    );
    // To 0 (evicting everything), then back to 4,096, then a field.
    check(&mut decoder, "20 3fe1 1f 82", &[(":method", "GET")], &[], 0);
    assert_eq!(decoder.table_max(), 4096);
    assert_eq!(
        block_error(&mut decoder, &[0x82, 0x20]),
        BlockError::LateTableSizeUpdate
    );
    let too_large = BlockError::TableSizeTooLarge {
        size: 4097,
        max: 4096,
    };
    assert_eq!(block_error(&mut decoder, &[0x3f, 0xe2, 0x1f]), too_large);
}

// === Errors ===

#[test]
fn malformed_blocks_are_errors() {
    use BlockError::*;
    let cases: [(&[u8], BlockError); 14] = [
        // An index whose continuation byte is missing; a literal cut before its name, its value,
        // its value's bytes.
        (&[0x82, 0xff], Truncated),
        (&[0x40], Truncated),
        (&[0x41], Truncated),
        (&[0x41, 0x7f], Truncated),
        (&[0xff, 0xff, 0xff, 0xff, 0xff, 0x0f], IntegerOverflow),
        (&[0x80], BadIndex(0)),
        (&[0xbe], BadIndex(62)),
        (&[0x7e, 0x00], BadIndex(62)),
        (&[0x0f, 0xf0, 0xff, 0xff, 0xff, 0x0f], BadIndex(u32::MAX as usize)),
        (&[0x40, 0x05, b'a', b'b'], StringPastEnd { len: 5, left: 2 }),
        (&[0x00, 0x81, 0xff, 0x00], Huffman(HuffmanError::PaddingTooLong)),
        (&[0x00, 0x81, 0x18, 0x00], Huffman(HuffmanError::PaddingNotOnes)),
        (&[0x01, 0x84, 0xff, 0xff, 0xff, 0xff], Huffman(HuffmanError::Eos)),
        (&[0x82, 0x3f, 0x00], LateTableSizeUpdate),
    ];
    for (block, error) in cases {
        assert_eq!(block_error(&mut fresh(), block), error, "{block:02x?}");
    }
}

/// Past `max_list_size`, the callback is not called again, but the block is decoded to its end:
/// the entry it adds is in the table, and the next block can use it.
#[test]
fn a_list_too_large_is_refused_with_the_table_kept_in_step() {
    let mut decoder = Decoder::new(4096, 70);
    // `:method: GET` (42 bytes), then `custom-key: custom-header` (55) added to the table.
    let block = hex("82 400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572");
    let mut calls = 0;
    let outcome = decoder.decode(&block, |_| {
        calls += 1;
        Ok::<_, Infallible>(())
    });
    assert!(
        matches!(outcome, Err(DecodeError::ListTooLarge { max: 70 })),
        "{outcome:?}"
    );
    assert_eq!(calls, 1);
    assert_eq!(decoder.table_size(), 55);
    let fields = decode(&mut decoder, &[0xbe]).unwrap();
    assert_eq!(
        fields,
        [(b"custom-key".to_vec(), b"custom-header".to_vec(), false)]
    );
}

#[test]
fn a_refused_field_stops_the_calls_but_not_the_decoding() {
    let mut decoder = fresh();
    let block = hex("82 86 400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572");
    let mut names = Vec::new();
    let outcome = decoder.decode(&block, |f| {
        names.push(f.name.to_vec());
        if f.name == b":scheme" {
            return Err("refused");
        }
        Ok(())
    });
    assert!(
        matches!(outcome, Err(DecodeError::Field("refused"))),
        "{outcome:?}"
    );
    assert_eq!(names, [&b":method"[..], b":scheme"]);
    assert_eq!(decoder.table_size(), 55);
    // A malformed block wins over a refusal: the connection has to end.
    let outcome = decoder.decode(&[0x82, 0x80], |_| Err("refused"));
    assert!(
        matches!(outcome, Err(DecodeError::Block(BlockError::BadIndex(0)))),
        "{outcome:?}"
    );
}

/// Random blocks: errors or fields, never a panic, and never a table past its maximum.
#[test]
fn random_blocks_decode_or_fail() {
    let mut rng = Lcg(7);
    let mut decoder = Decoder::new(256, 4096);
    for _ in 0..20_000 {
        let len = rng.below(48);
        // Small first bytes more often, so that literals and size updates come up.
        let block: Vec<u8> = (0..len).map(|_| rng.byte() >> (rng.below(3) * 2)).collect();
        let _ = decoder.decode(&block, |_| Ok::<_, Infallible>(()));
        assert!(decoder.table_size() <= decoder.table_max());
        assert!(decoder.table_max() <= 256);
    }
}

// === Encoder ===

fn encode(name: &str, value: &[u8], sensitive: bool) -> Vec<u8> {
    let mut dst = BytesMut::new();
    Encoder.encode(name.as_bytes(), value, sensitive, &mut dst);
    dst.to_vec()
}

#[test]
fn a_whole_static_entry_is_one_byte() {
    assert_eq!(encode(":method", b"GET", false), [0x82]);
    assert_eq!(encode(":status", b"200", false), [0x88]);
    // The last of a name's entries, and one in the middle.
    assert_eq!(encode(":status", b"500", false), [0x80 | 14]);
    assert_eq!(encode(":method", b"POST", false), [0x83]);
    assert_eq!(encode(":path", b"/index.html", false), [0x85]);
    assert_eq!(encode("accept-encoding", b"gzip, deflate", false), [0x90]);
    assert_eq!(encode("www-authenticate", b"", false), [0x80 | 61]);
    // Its value is in the RFC: indexing it gives nothing away.
    assert_eq!(encode(":method", b"GET", true), [0x82]);
}

#[test]
fn a_static_name_goes_by_index_and_sensitive_fields_are_never_indexed() {
    // `user-agent` is 58: 15 in the 4-bit prefix, 43 after.
    assert_eq!(encode("user-agent", b"x", false), [0x0f, 43, 0x01, b'x']);
    assert_eq!(encode(":status", b"302", false), [0x08, 0x03, b'3', b'0', b'2']);
    // `authorization` is 23.
    let sensitive = encode("authorization", b"Bearer x", true);
    assert_eq!(sensitive[..2], [0x10 | 0x0f, 8]);
    let fields = decode(&mut fresh(), &sensitive).unwrap();
    assert_eq!(fields, [(b"authorization".to_vec(), b"Bearer x".to_vec(), true)]);

    let literal = encode("x-secret", b"v", true);
    assert_eq!(literal[0], 0x10);
    let fields = decode(&mut fresh(), &literal).unwrap();
    assert_eq!(fields, [(b"x-secret".to_vec(), b"v".to_vec(), true)]);
    assert_eq!(encode("x-a", b"", false), [0x00, 0x03, b'x', b'-', b'a', 0x00]);
}

#[test]
fn strings_go_out_as_they_are_never_huffman_coded() {
    // Huffman would code this value in 12 bytes (RFC 7541 C.4.1); it goes out in 15.
    let coded = encode("x-host", b"www.example.com", false);
    assert!(coded.ends_with(b"\x0fwww.example.com"), "{coded:02x?}");
    assert_eq!(&coded[..8], b"\x00\x06x-host");
    let binary = [0xff, 0x00, 0x7f];
    assert!(encode("x-bin", &binary, false).ends_with(&[0x03, 0xff, 0x00, 0x7f]));
}

/// Pseudo-random draws for the round trips: deterministic, so a failure repeats.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }

    fn below(&mut self, n: usize) -> usize {
        self.next() as usize % n
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// Many fields, names lowercase (some the static table's), values any bytes, some sensitive,
/// encoded into one block: a fresh decoder gives them all back, adds nothing to its table, and
/// reads a sensitive field as never indexed unless it was a whole static entry.
#[test]
fn encoded_fields_decode_to_themselves() {
    let mut rng = Lcg(1);
    for _ in 0..200 {
        let mut block = BytesMut::new();
        let mut sent = Vec::new();
        for _ in 0..rng.below(30) {
            let name: Vec<u8> = match rng.below(4) {
                0 => STATIC[rng.below(STATIC.len())].0.to_vec(),
                _ => (0..1 + rng.below(20))
                    .map(|_| b"abcdefghijklmnopqrstuvwxyz0123456789-_"[rng.below(38)])
                    .collect(),
            };
            let value: Vec<u8> = (0..rng.below(40)).map(|_| rng.byte()).collect();
            let sensitive = rng.below(4) == 0;
            Encoder.encode(&name, &value, sensitive, &mut block);
            let whole_entry = matches!(find_static(&name, &value), Some(StaticMatch::Field(_)));
            sent.push((name, value, sensitive && !whole_entry));
        }
        let mut decoder = fresh();
        assert_eq!(decode(&mut decoder, &block).unwrap(), sent);
        assert_eq!(decoder.table_size(), 0);
    }
}

/// A pseudo-header field encodes as [`Encoder::encode`] encodes it by name: whole entries by
/// their index (`GET`, `http`, `/`), other values after the name's index.
#[test]
fn pseudo_fields_encode_as_by_name() {
    let cases: [(Pseudo, &str, &[&[u8]]); 4] = [
        (Pseudo::Method, ":method", &[b"GET", b"POST", b"PUT", b"get", b""]),
        (Pseudo::Scheme, ":scheme", &[b"http", b"https", b"ftp"]),
        (
            Pseudo::Path,
            ":path",
            &[b"/", b"/index.html", b"/v1/chat/completions?x=1"],
        ),
        (
            Pseudo::Authority,
            ":authority",
            &[b"api.openai.com", b"127.0.0.1:8080", b""],
        ),
    ];
    for (pseudo, name, values) in cases {
        for value in values {
            let mut by_pseudo = BytesMut::new();
            Encoder.encode_pseudo(pseudo, value, &mut by_pseudo);
            assert_eq!(
                by_pseudo[..],
                encode(name, value, false)[..],
                "{name} {:?}",
                String::from_utf8_lossy(value)
            );
        }
    }
}
