//! HPACK (RFC 7541), HTTP/2's header compression: a [`Decoder`] that hands each field of a
//! header block to a callback as slices, and a stateless [`Encoder`].
//!
//! Written here rather than taken from a crate: h2 keeps its HPACK private, and the crates that
//! publish one (`hpack`, `loona-hpack`, `httlib-hpack`) decode into owned `Vec`s per field. The
//! upstream HTTP/2 client this is for writes a response's fields straight out as HTTP/1.1 lines,
//! so nothing here allocates per field: an indexed field is a slice of a table, a plain literal
//! a slice of the block, and a Huffman-coded string is decoded into one of two buffers the
//! decoder keeps (a name and its value may both be coded). The one allocation is a new
//! dynamic-table entry.
//!
//! The encoder never inserts into the peer's dynamic table. That costs bytes (a repeated
//! `user-agent` goes out in full on every request) and saves an encoder table kept in step with
//! the peer's SETTINGS; it also means no secret a request carries can be probed through the
//! compression state. Nor does it Huffman-code strings: that took about 20 instructions per
//! character, 2,500 of the 9,900 a whole exchange took through `h2client`
//! (`benches/h2_frame.rs`), to save about a fifth of a head's bytes on the upstream's link.
//!
//! Not here: frames (the caller joins a HEADERS frame and its CONTINUATIONs, and bounds the
//! block's length), whether a field is valid HTTP (lowercase names, pseudo-header order,
//! connection-specific fields), and announcing a new table size after the first SETTINGS.

mod huffman;
mod table;

use bytes::{BufMut, BytesMut};

pub use huffman::HuffmanError;
use table::{find_static, find_static_value, DynamicTable, Entry, StaticMatch, ENTRY_OVERHEAD, STATIC};

/// Largest integer a block may carry (a length, an index, a table size): far past any real one,
/// and it fits a `usize` on every target.
const MAX_INTEGER: u64 = u32::MAX as u64;

/// Continuation bytes after an integer's prefix: five carry 35 bits, enough for `MAX_INTEGER`.
const MAX_CONTINUATIONS: u32 = 5;

/// First byte of a literal field not to be indexed; the name's index follows in its low 4 bits.
const WITHOUT_INDEXING: u8 = 0x00;

/// First byte of a literal field that no intermediary may index (§6.2.3).
const NEVER_INDEXED: u8 = 0x10;

/// First byte of an indexed field; the index follows in its low 7 bits.
const INDEXED: u8 = 0x80;

/// Marks a Huffman-coded string in its length's first byte.
const HUFFMAN: u8 = 0x80;

/// One field of a header block, valid for the callback's call: slices of the block, of a table
/// or of the decoder's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field<'a> {
    /// The name as sent; pseudo-header fields (`:status`) included.
    pub name: &'a [u8],
    /// The value as sent: any bytes, CR, LF and NUL included.
    pub value: &'a [u8],
    /// Sent as never indexed (§6.2.3): whoever passes it on must not index it either.
    pub never_indexed: bool,
}

/// Why a header block was not decoded.
///
/// Only [`DecodeError::Block`] loses the compression state: after the others the decoder went
/// through the rest of the block, as RFC 9113 §10.5.1 asks, so its table is still in step with the
/// peer's and only the stream need be refused.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError<E> {
    /// The block is malformed; in HTTP/2 a connection error of type COMPRESSION_ERROR (§4.3).
    #[error(transparent)]
    Block(#[from] BlockError),
    /// The fields (name, value and 32 bytes each) add up past the list size we announced; the
    /// callback got the fields before the one that crossed it.
    #[error("header list larger than {max} bytes")]
    ListTooLarge {
        /// `SETTINGS_MAX_HEADER_LIST_SIZE` as we announced it.
        max: usize,
    },
    /// The callback refused a field; it was not called again.
    #[error("header field refused")]
    Field(#[source] E),
}

/// What makes a header block malformed (RFC 7541).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    /// The block ends inside a representation.
    #[error("header block ends inside a representation")]
    Truncated,
    /// An integer past 2^32 - 1, or one with more than five continuation bytes.
    #[error("integer too large in a header block")]
    IntegerOverflow,
    /// Index 0, or past the static and dynamic tables.
    #[error("index {0} is in neither table")]
    BadIndex(usize),
    /// A string longer than what is left of the block.
    #[error("string of {len} bytes with {left} left in the block")]
    StringPastEnd {
        /// The string's length.
        len: usize,
        /// What the block has after the length.
        left: usize,
    },
    /// A Huffman-coded string that does not decode.
    #[error(transparent)]
    Huffman(#[from] HuffmanError),
    /// A dynamic table size update above the size we announced.
    #[error("dynamic table size update to {size} above the {max} announced")]
    TableSizeTooLarge {
        /// The size asked for.
        size: usize,
        /// `SETTINGS_HEADER_TABLE_SIZE` as we announced it.
        max: usize,
    },
    /// A dynamic table size update after the block's first field (§4.2 allows them only first).
    #[error("dynamic table size update after a field")]
    LateTableSizeUpdate,
}

/// The decoding side of one HTTP/2 connection: its dynamic table, in step with the peer's
/// encoder as long as every block the peer sends goes through [`Decoder::decode`] in order.
#[derive(Debug)]
pub struct Decoder {
    table: DynamicTable,
    /// `SETTINGS_HEADER_TABLE_SIZE` as we announce it: no size update may go above it.
    max_table_size: usize,
    /// `SETTINGS_MAX_HEADER_LIST_SIZE` as we announce it.
    max_list_size: usize,
    /// Huffman-coded names are decoded here, kept across blocks.
    name_buf: Vec<u8>,
    /// Huffman-coded values are decoded here, kept across blocks.
    value_buf: Vec<u8>,
}

/// The encoding side: appends fields to a header block, never touching the peer's dynamic table
/// (see the module doc), so one encoder serves any number of connections.
#[derive(Debug, Default, Clone, Copy)]
pub struct Encoder;

/// The five representations (§6), told apart by how many zero bits lead the first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Representation {
    /// `1xxxxxxx` (§6.1).
    Indexed,
    /// `01xxxxxx` (§6.2.1): the field goes into the dynamic table.
    IncrementalIndexing,
    /// `001xxxxx` (§6.3).
    SizeUpdate,
    /// `0001xxxx` (§6.2.3).
    NeverIndexed,
    /// `0000xxxx` (§6.2.2).
    WithoutIndexing,
}

// === impl Decoder ===

impl Decoder {
    /// A decoder for a connection on which we announce `max_table_size`
    /// (`SETTINGS_HEADER_TABLE_SIZE`, 4,096 by default) and `max_list_size`
    /// (`SETTINGS_MAX_HEADER_LIST_SIZE`: name, value and 32 bytes per field). The dynamic table
    /// starts at `max_table_size`, so the size must be the one in our first SETTINGS.
    pub fn new(max_table_size: usize, max_list_size: usize) -> Self {
        Decoder {
            table: DynamicTable::new(max_table_size),
            max_table_size,
            max_list_size,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
        }
    }

    /// Decodes one whole header block (a HEADERS frame's fragment with its CONTINUATIONs
    /// joined), handing each field to `field` in order.
    ///
    /// Once the list grows too large or `field` fails, the rest of the block is still decoded,
    /// without calls, to keep the dynamic table in step; that error comes back at the end,
    /// unless the block also turns out malformed.
    pub fn decode<E>(
        &mut self,
        block: &[u8],
        mut field: impl FnMut(Field<'_>) -> Result<(), E>,
    ) -> Result<(), DecodeError<E>> {
        let Decoder {
            table,
            max_table_size,
            max_list_size,
            name_buf,
            value_buf,
        } = self;
        let mut src = Cursor(block);
        let mut list_size = 0usize;
        let mut refused = None;
        let mut fields_began = false;
        while let Some(&first) = src.0.first() {
            let representation = Representation::of(first);
            if representation == Representation::SizeUpdate {
                if fields_began {
                    return Err(BlockError::LateTableSizeUpdate.into());
                }
                let size = src.integer(5)?;
                if size > *max_table_size {
                    let max = *max_table_size;
                    return Err(BlockError::TableSizeTooLarge { size, max }.into());
                }
                table.set_max(size);
                continue;
            }
            fields_began = true;
            let line = read_field(&mut src, representation, table, name_buf, value_buf)?;
            if refused.is_none() {
                list_size = list_size.saturating_add(line.name.len() + line.value.len() + ENTRY_OVERHEAD);
                refused = if list_size > *max_list_size {
                    Some(DecodeError::ListTooLarge { max: *max_list_size })
                } else {
                    field(line).err().map(DecodeError::Field)
                };
            }
            if representation == Representation::IncrementalIndexing {
                // Copied out first: the name may be an entry this insertion evicts (§4.4).
                let entry = Entry::new(line.name, line.value);
                table.insert(entry);
            }
        }
        refused.map_or(Ok(()), Err)
    }

    /// The dynamic table's size (§4.1): its entries' names and values, plus 32 bytes each.
    pub fn table_size(&self) -> usize {
        self.table.size()
    }

    /// The dynamic table's maximum size, as the peer's last size update set it.
    pub fn table_max(&self) -> usize {
        self.table.max()
    }

    /// The dynamic table's entries, newest first.
    #[cfg(test)]
    fn table_entries(&self) -> Vec<(&[u8], &[u8])> {
        (0..self.table.len()).filter_map(|i| self.table.get(i)).collect()
    }
}

/// Reads one field of `representation` (any but a size update).
fn read_field<'b: 's, 's>(
    src: &mut Cursor<'b>,
    representation: Representation,
    table: &'s DynamicTable,
    name_buf: &'s mut Vec<u8>,
    value_buf: &'s mut Vec<u8>,
) -> Result<Field<'s>, BlockError> {
    let prefix = match representation {
        Representation::Indexed => {
            let (name, value) = lookup(table, src.integer(7)?)?;
            return Ok(Field {
                name,
                value,
                never_indexed: false,
            });
        }
        Representation::IncrementalIndexing => 6,
        _ => 4,
    };
    let name = match src.integer(prefix)? {
        0 => src.string(name_buf)?,
        index => lookup(table, index)?.0,
    };
    Ok(Field {
        name,
        value: src.string(value_buf)?,
        never_indexed: representation == Representation::NeverIndexed,
    })
}

/// The entry at `index` (§2.3.3): the static table's 61, then the dynamic table's, newest first.
fn lookup(table: &DynamicTable, index: usize) -> Result<(&[u8], &[u8]), BlockError> {
    let found = match index.checked_sub(1) {
        Some(i) if i < STATIC.len() => Some(STATIC[i]),
        Some(i) => table.get(i - STATIC.len()),
        None => None,
    };
    found.ok_or(BlockError::BadIndex(index))
}

impl Representation {
    fn of(first: u8) -> Self {
        match first.leading_zeros() {
            0 => Representation::Indexed,
            1 => Representation::IncrementalIndexing,
            2 => Representation::SizeUpdate,
            3 => Representation::NeverIndexed,
            _ => Representation::WithoutIndexing,
        }
    }
}

/// What is left of a header block.
struct Cursor<'b>(&'b [u8]);

impl<'b> Cursor<'b> {
    fn byte(&mut self) -> Result<u8, BlockError> {
        let (&byte, rest) = self.0.split_first().ok_or(BlockError::Truncated)?;
        self.0 = rest;
        Ok(byte)
    }

    /// An integer with a `prefix_bits`-bit prefix (§5.1); the first byte's other bits are the
    /// caller's to read before.
    fn integer(&mut self, prefix_bits: u32) -> Result<usize, BlockError> {
        let mask = (1u32 << prefix_bits) - 1;
        let prefix = u32::from(self.byte()?) & mask;
        if prefix < mask {
            return Ok(prefix as usize);
        }
        let mut value = u64::from(prefix);
        for shift in (0..MAX_CONTINUATIONS * 7).step_by(7) {
            let byte = self.byte()?;
            value += u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                if value > MAX_INTEGER {
                    return Err(BlockError::IntegerOverflow);
                }
                return Ok(value as usize);
            }
        }
        Err(BlockError::IntegerOverflow)
    }

    /// A string (§5.2): a slice of the block, or decoded into `buf` if Huffman-coded.
    fn string<'s>(&mut self, buf: &'s mut Vec<u8>) -> Result<&'s [u8], BlockError>
    where
        'b: 's,
    {
        let huffman = self.0.first().is_some_and(|b| b & HUFFMAN != 0);
        let len = self.integer(7)?;
        let left = self.0.len();
        let (bytes, rest) = self
            .0
            .split_at_checked(len)
            .ok_or(BlockError::StringPastEnd { len, left })?;
        self.0 = rest;
        if !huffman {
            return Ok(bytes);
        }
        buf.clear();
        huffman::decode(bytes, buf)?;
        Ok(buf)
    }
}

// === impl Encoder ===

impl Encoder {
    /// Appends one field: a whole static-table entry as its index, a static name by its index
    /// with the value literal, else name and value literal; never indexed when `sensitive`
    /// (unless it is a whole static entry, which tells nothing). Strings go out as they are,
    /// not Huffman-coded (see the module doc). `name` must be lowercase, as HTTP/2 requires.
    pub fn encode(&self, name: &[u8], value: &[u8], sensitive: bool, dst: &mut BytesMut) {
        debug_assert!(
            !name.iter().any(u8::is_ascii_uppercase),
            "HTTP/2 field names are lowercase: {:?}",
            String::from_utf8_lossy(name)
        );
        let literal = if sensitive {
            NEVER_INDEXED
        } else {
            WITHOUT_INDEXING
        };
        match find_static(name, value) {
            Some(found) => put_static(found, value, literal, dst),
            None => {
                dst.put_u8(literal);
                put_string(name, dst);
                put_string(value, dst);
            }
        }
    }

    /// Appends a request's pseudo-header field as [`Encoder::encode`] does, without looking
    /// its name up: every request carries four, and the lookup was a third of their cost.
    pub fn encode_pseudo(&self, pseudo: Pseudo, value: &[u8], dst: &mut BytesMut) {
        put_static(
            find_static_value(pseudo as usize, value),
            value,
            WITHOUT_INDEXING,
            dst,
        );
    }
}

/// A request's pseudo-header field, by its name's index in the static table (Appendix A).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pseudo {
    /// `:authority`
    Authority = 1,
    /// `:method`
    Method = 2,
    /// `:path`
    Path = 4,
    /// `:scheme`
    Scheme = 6,
}

/// Appends a field that matched the static table: the entry's index, or the name's index
/// (after `literal`'s flags) and `value`.
fn put_static(found: StaticMatch, value: &[u8], literal: u8, dst: &mut BytesMut) {
    match found {
        StaticMatch::Field(index) => put_integer(index, 7, INDEXED, dst),
        StaticMatch::Name(index) => {
            put_integer(index, 4, literal, dst);
            put_string(value, dst);
        }
    }
}

/// Appends `value` with a `prefix_bits`-bit prefix (§5.1) after the first byte's `flags`.
fn put_integer(value: usize, prefix_bits: u32, flags: u8, dst: &mut BytesMut) {
    let mask = (1usize << prefix_bits) - 1;
    if value < mask {
        dst.put_u8(flags | value as u8);
        return;
    }
    dst.put_u8(flags | mask as u8);
    let mut rest = value - mask;
    while rest >= 0x80 {
        dst.put_u8(0x80 | (rest & 0x7f) as u8);
        rest >>= 7;
    }
    dst.put_u8(rest as u8);
}

/// Appends a string (§5.2) as it is.
fn put_string(text: &[u8], dst: &mut BytesMut) {
    put_integer(text.len(), 7, 0, dst);
    dst.extend_from_slice(text);
}

#[cfg(test)]
mod tests;
