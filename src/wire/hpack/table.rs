//! HPACK's two tables (RFC 7541 §2.3): the static table of Appendix A, with the name lookup the
//! encoder needs, and the dynamic table a decoder keeps in step with its peer's encoder.
//!
//! The dynamic table is a `VecDeque` of entries, each one allocation holding name then value, so
//! that an index is one array access and an insertion costs one allocation; a ring of bytes would
//! save that allocation but could not hand out an entry that wraps around its end as one slice.

use std::collections::VecDeque;

/// What RFC 7541 §4.1 adds to an entry's name and value lengths for its size: the overhead the
/// peer's encoder reckons per entry, so both sides evict at the same moment.
pub(super) const ENTRY_OVERHEAD: usize = 32;

/// Appendix A, index 1 first.
const STATIC_FIELDS: [(&[u8], &[u8]); 61] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    (b":status", b"200"),
    (b":status", b"204"),
    (b":status", b"206"),
    (b":status", b"304"),
    (b":status", b"400"),
    (b":status", b"404"),
    (b":status", b"500"),
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    (b"accept-language", b""),
    (b"accept-ranges", b""),
    (b"accept", b""),
    (b"access-control-allow-origin", b""),
    (b"age", b""),
    (b"allow", b""),
    (b"authorization", b""),
    (b"cache-control", b""),
    (b"content-disposition", b""),
    (b"content-encoding", b""),
    (b"content-language", b""),
    (b"content-length", b""),
    (b"content-location", b""),
    (b"content-range", b""),
    (b"content-type", b""),
    (b"cookie", b""),
    (b"date", b""),
    (b"etag", b""),
    (b"expect", b""),
    (b"expires", b""),
    (b"from", b""),
    (b"host", b""),
    (b"if-match", b""),
    (b"if-modified-since", b""),
    (b"if-none-match", b""),
    (b"if-range", b""),
    (b"if-unmodified-since", b""),
    (b"last-modified", b""),
    (b"link", b""),
    (b"location", b""),
    (b"max-forwards", b""),
    (b"proxy-authenticate", b""),
    (b"proxy-authorization", b""),
    (b"range", b""),
    (b"referer", b""),
    (b"refresh", b""),
    (b"retry-after", b""),
    (b"server", b""),
    (b"set-cookie", b""),
    (b"strict-transport-security", b""),
    (b"transfer-encoding", b""),
    (b"user-agent", b""),
    (b"vary", b""),
    (b"via", b""),
    (b"www-authenticate", b""),
];

/// The static table (Appendix A); `STATIC[i - 1]` is index `i`.
pub(super) static STATIC: [(&[u8], &[u8]); 61] = STATIC_FIELDS;

/// How a field matches the static table, for the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StaticMatch {
    /// Name and value: the entry's index.
    Field(usize),
    /// The name only: the index of its first entry.
    Name(usize),
}

/// The static table's index of `name`, and of `name` with `value` if that is an entry.
pub(super) fn find_static(name: &[u8], value: &[u8]) -> Option<StaticMatch> {
    Some(find_static_value(static_name_index(name)?, value))
}

/// How `value` matches the static entries named as entry `first` is (a name's first index).
pub(super) fn find_static_value(first: usize, value: &[u8]) -> StaticMatch {
    // Entries sharing a name are consecutive (`:status` has seven); their count is kept, so
    // only values are compared.
    let run = usize::from(NAME_RUNS[first]);
    let index = (first..first + run).find(|index| STATIC[index - 1].1 == value);
    index.map_or(StaticMatch::Name(first), StaticMatch::Field)
}

/// At a name's first index, how many consecutive entries have that name; 0 elsewhere.
static NAME_RUNS: [u8; STATIC_FIELDS.len() + 1] = name_runs();

const fn name_runs() -> [u8; STATIC_FIELDS.len() + 1] {
    let mut runs = [0u8; STATIC_FIELDS.len() + 1];
    let mut first = 0;
    let mut i = 0;
    while i < STATIC_FIELDS.len() {
        if i == 0 || !same_bytes(STATIC_FIELDS[i].0, STATIC_FIELDS[i - 1].0) {
            first = i + 1;
        }
        runs[first] += 1;
        i += 1;
    }
    runs
}

/// Slots of the open-addressed set of static names: 52 distinct names in 128 slots keep probes
/// short, and a slot is one byte.
const NAME_SLOTS: usize = 128;

/// Each distinct static name's first index, at its hash's slot or the next free one; 0 is empty.
/// Built at compile time, so a lookup is a hash of three bytes and a compare or two instead of a
/// walk over 61 names.
static NAME_SLOTS_TABLE: [u8; NAME_SLOTS] = name_slots();

const fn name_hash(name: &[u8]) -> usize {
    let len = name.len();
    if len == 0 {
        return 0;
    }
    (len * 5 + name[0] as usize + name[len / 2] as usize * 3 + name[len - 1] as usize * 7) % NAME_SLOTS
}

const fn name_slots() -> [u8; NAME_SLOTS] {
    let mut slots = [0u8; NAME_SLOTS];
    let mut i = 0;
    while i < STATIC_FIELDS.len() {
        let name = STATIC_FIELDS[i].0;
        if i == 0 || !same_bytes(name, STATIC_FIELDS[i - 1].0) {
            let mut slot = name_hash(name);
            while slots[slot] != 0 {
                slot = (slot + 1) % NAME_SLOTS;
            }
            slots[slot] = (i + 1) as u8;
        }
        i += 1;
    }
    slots
}

const fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

fn static_name_index(name: &[u8]) -> Option<usize> {
    let mut slot = name_hash(name);
    // Bounded, though a free slot always ends the probe first.
    for _ in 0..NAME_SLOTS {
        let index = usize::from(NAME_SLOTS_TABLE[slot]);
        if index == 0 {
            return None;
        }
        if STATIC[index - 1].0 == name {
            return Some(index);
        }
        slot = (slot + 1) % NAME_SLOTS;
    }
    None
}

/// One dynamic-table entry: name then value in one allocation.
#[derive(Debug)]
pub(super) struct Entry {
    bytes: Box<[u8]>,
    name_len: usize,
}

impl Entry {
    /// Copies `name` and `value` out of wherever they were (the block, a scratch buffer, another
    /// entry that inserting this one may evict).
    pub(super) fn new(name: &[u8], value: &[u8]) -> Self {
        let mut bytes = Vec::with_capacity(name.len() + value.len());
        bytes.extend_from_slice(name);
        bytes.extend_from_slice(value);
        Entry {
            bytes: bytes.into_boxed_slice(),
            name_len: name.len(),
        }
    }

    pub(super) fn field(&self) -> (&[u8], &[u8]) {
        self.bytes.split_at(self.name_len)
    }

    fn size(&self) -> usize {
        self.bytes.len() + ENTRY_OVERHEAD
    }
}

/// The dynamic table (RFC 7541 §2.3.2, §4): newest entry first, its size never above `max`.
#[derive(Debug)]
pub(super) struct DynamicTable {
    entries: VecDeque<Entry>,
    size: usize,
    max: usize,
}

impl DynamicTable {
    pub(super) fn new(max: usize) -> Self {
        DynamicTable {
            entries: VecDeque::new(),
            size: 0,
            max,
        }
    }

    /// The entry at `index`, 0 being the newest (HPACK index 62).
    pub(super) fn get(&self, index: usize) -> Option<(&[u8], &[u8])> {
        self.entries.get(index).map(Entry::field)
    }

    pub(super) fn size(&self) -> usize {
        self.size
    }

    pub(super) fn max(&self) -> usize {
        self.max
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// A dynamic table size update (§6.3): evicts until the entries fit the new maximum.
    pub(super) fn set_max(&mut self, max: usize) {
        self.max = max;
        self.evict_to(max);
    }

    /// Adds `entry` as the newest, evicting the oldest to make room; an entry larger than the
    /// whole table empties it and is dropped (§4.4).
    pub(super) fn insert(&mut self, entry: Entry) {
        let size = entry.size();
        if size > self.max {
            self.entries.clear();
            self.size = 0;
            return;
        }
        self.evict_to(self.max - size);
        self.size += size;
        self.entries.push_front(entry);
    }

    fn evict_to(&mut self, room: usize) {
        while self.size > room {
            let Some(oldest) = self.entries.pop_back() else {
                break;
            };
            self.size -= oldest.size();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_static_name_is_found_at_its_first_index() {
        for (i, (name, value)) in STATIC.iter().enumerate() {
            let first = STATIC.iter().position(|(n, _)| n == name).unwrap() + 1;
            assert_eq!(
                static_name_index(name),
                Some(first),
                "{}",
                String::from_utf8_lossy(name)
            );
            assert_eq!(find_static(name, value), Some(StaticMatch::Field(i + 1)));
        }
        assert_eq!(find_static(b":status", b"302"), Some(StaticMatch::Name(8)));
        assert_eq!(
            find_static(b"accept-encoding", b"br"),
            Some(StaticMatch::Name(16))
        );
        assert_eq!(find_static(b"user-agent", b"x"), Some(StaticMatch::Name(58)));
        for other in [
            &b""[..],
            b"x-custom",
            b"content-typ",
            b"content-typex",
            b":statuS",
        ] {
            assert_eq!(
                find_static(other, b""),
                None,
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }

    /// The lookup stays a compare or two: no name sits far from its hash's slot.
    #[test]
    fn static_name_probes_are_short() {
        for (slot, &index) in NAME_SLOTS_TABLE.iter().enumerate() {
            if index == 0 {
                continue;
            }
            let home = name_hash(STATIC[usize::from(index) - 1].0);
            let distance = (slot + NAME_SLOTS - home) % NAME_SLOTS;
            assert!(distance <= 2, "index {index}: {distance} slots from home");
        }
    }

    #[test]
    fn insertion_evicts_the_oldest_and_an_oversized_entry_empties_the_table() {
        let mut table = DynamicTable::new(100);
        table.insert(Entry::new(b"a", b"1")); // 34
        table.insert(Entry::new(b"b", b"2")); // 34
        assert_eq!((table.len(), table.size()), (2, 68));
        table.insert(Entry::new(b"c", b"3"));
        assert_eq!((table.len(), table.size()), (2, 68));
        assert_eq!(table.get(0), Some((&b"c"[..], &b"3"[..])));
        assert_eq!(table.get(1), Some((&b"b"[..], &b"2"[..])));
        assert_eq!(table.get(2), None);
        table.insert(Entry::new(b"big", &[b'x'; 66])); // 101
        assert_eq!((table.len(), table.size()), (0, 0));
        table.insert(Entry::new(b"big", &[b'x'; 65])); // exactly 100
        assert_eq!((table.len(), table.size()), (1, 100));
        table.set_max(99);
        assert_eq!((table.len(), table.size()), (0, 0));
    }
}
