//! The lot's storage: parked records in the order they were parked, and their deadlines, each
//! in one contiguous buffer.
//!
//! A burst of new connections parks its records one by one while the burst's tasks, futures
//! and buffers are alive around them; when the burst ends that memory is freed, and every
//! page still holding a record stays resident. In B-trees (one node of eleven records
//! allocated per six parked) that left 1,000 B per idle client connection after a first burst
//! of 2,000, of which 229 B were in use (`benches/idle_memory.sh` with `HEAP_STATS=1`, issue
//! 47). Here the records of a lot live in one buffer that doubles as it grows and shrinks once
//! mostly empty, so they pin only the pages they fill.
//!
//! No library keeps a queue ordered by a growing key, with removal from the middle, in one
//! buffer: [`Slots`] leaves a hole where a record was taken, drops holes at either end at
//! once, and squeezes the rest out once they outnumber the records, so that one long-parked
//! connection cannot make the holes after it pile up. Looking a record up is a binary search.
//! Deadlines are a binary heap whose entries for records already taken are dropped when they
//! come first or once they outnumber the live ones ([`Deadlines`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::resident::mostly_empty;

/// Holes allowed beyond one per record before they are squeezed out: a small lot is not
/// rewritten at every removal.
const SLACK: usize = 32;

/// Records by sequence number, which only grows: the first is the longest parked.
#[derive(Debug)]
pub(super) struct Slots<V> {
    /// (sequence number, record; `None` once taken), by sequence number; neither end is a hole.
    slots: VecDeque<(u64, Option<V>)>,
    live: usize,
}

impl<V> Default for Slots<V> {
    fn default() -> Self {
        Slots {
            slots: VecDeque::new(),
            live: 0,
        }
    }
}

impl<V> Slots<V> {
    pub(super) fn len(&self) -> usize {
        self.live
    }

    /// Adds `value` under `seq`, which is greater than every sequence number added before.
    pub(super) fn push(&mut self, seq: u64, value: V) {
        debug_assert!(self.slots.back().is_none_or(|&(last, _)| last < seq));
        self.slots.push_back((seq, Some(value)));
        self.live += 1;
    }

    pub(super) fn get(&self, seq: u64) -> Option<&V> {
        let i = self.position(seq)?;
        self.slots[i].1.as_ref()
    }

    pub(super) fn remove(&mut self, seq: u64) -> Option<V> {
        let i = self.position(seq)?;
        let value = self.slots[i].1.take()?;
        self.live -= 1;
        self.tidy();
        Some(value)
    }

    /// Takes the longest parked.
    pub(super) fn pop_first(&mut self) -> Option<(u64, V)> {
        while let Some((seq, value)) = self.slots.pop_front() {
            if let Some(value) = value {
                self.live -= 1;
                self.tidy();
                return Some((seq, value));
            }
        }
        None
    }

    /// Takes every record, in order, and gives the room back.
    pub(super) fn take_all(&mut self) -> impl Iterator<Item = V> {
        self.live = 0;
        std::mem::take(&mut self.slots)
            .into_iter()
            .filter_map(|(_, value)| value)
    }

    fn position(&self, seq: u64) -> Option<usize> {
        self.slots.binary_search_by_key(&seq, |&(seq, _)| seq).ok()
    }

    /// Drops the holes at either end, squeezes out the rest once they outnumber the records,
    /// and gives the room back once mostly empty.
    fn tidy(&mut self) {
        while matches!(self.slots.front(), Some((_, None))) {
            self.slots.pop_front();
        }
        while matches!(self.slots.back(), Some((_, None))) {
            self.slots.pop_back();
        }
        if self.slots.len() > 2 * self.live + SLACK {
            self.slots.retain(|(_, value)| value.is_some());
        }
        if mostly_empty(self.slots.len(), self.slots.capacity()) {
            self.slots.shrink_to_fit();
        }
    }

    #[cfg(test)]
    fn room(&self) -> (usize, usize) {
        (self.slots.len(), self.slots.capacity())
    }
}

/// (deadline, sequence number) of every parked record, earliest first, with entries of
/// records already taken among them until they come first or are squeezed out.
#[derive(Debug, Default)]
pub(super) struct Deadlines<D: Ord + Copy> {
    heap: BinaryHeap<Reverse<(D, u64)>>,
}

impl<D: Ord + Copy> Deadlines<D> {
    pub(super) fn push(&mut self, deadline: D, seq: u64) {
        self.heap.push(Reverse((deadline, seq)));
    }

    /// The earliest deadline of a record `parked` says is still there; the entries before it
    /// go.
    pub(super) fn first(&mut self, parked: impl Fn(u64) -> bool) -> Option<(D, u64)> {
        while let Some(&Reverse((deadline, seq))) = self.heap.peek() {
            if parked(seq) {
                return Some((deadline, seq));
            }
            self.heap.pop();
        }
        None
    }

    /// After a record was taken, `live` are left: squeezes the entries of taken records out
    /// once they outnumber the others.
    pub(super) fn taken(&mut self, live: usize, parked: impl Fn(u64) -> bool) {
        if self.heap.len() > 2 * live + SLACK {
            self.heap.retain(|&Reverse((_, seq))| parked(seq));
        }
        if mostly_empty(self.heap.len(), self.heap.capacity()) {
            self.heap.shrink_to_fit();
        }
    }

    pub(super) fn clear(&mut self) {
        self.heap = BinaryHeap::new();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_come_out_in_the_order_they_went_in_whatever_was_taken_between() {
        let mut slots = Slots::default();
        for seq in 0..10 {
            slots.push(seq, seq * 10);
        }
        assert_eq!(slots.remove(3), Some(30));
        assert_eq!(slots.remove(3), None);
        assert_eq!(slots.remove(0), Some(0));
        assert_eq!(slots.remove(42), None);
        assert_eq!(slots.get(4), Some(&40));
        assert_eq!(slots.get(3), None);
        assert_eq!(slots.len(), 8);
        assert_eq!(slots.pop_first(), Some((1, 10)));
        assert_eq!(slots.pop_first(), Some((2, 20)));
        assert_eq!(slots.pop_first(), Some((4, 40)));
        assert_eq!(slots.take_all().collect::<Vec<_>>(), [50, 60, 70, 80, 90]);
        assert_eq!(slots.len(), 0);
        assert_eq!(slots.pop_first(), None);
    }

    /// One connection parked for an hour while thousands park and wake after it: the holes
    /// they leave do not pile up behind it.
    #[test]
    fn holes_behind_a_long_parked_record_do_not_pile_up() {
        let mut slots = Slots::default();
        slots.push(0, ());
        for seq in 1..100_000 {
            slots.push(seq, ());
            if seq > 1 {
                assert_eq!(slots.remove(seq - 1), Some(()));
            }
        }
        assert_eq!(slots.len(), 2);
        let (len, capacity) = slots.room();
        assert!(len <= 4 + SLACK, "{len} slots kept for two records");
        assert!(
            capacity <= 8 * (4 + SLACK),
            "room for {capacity} kept for two records"
        );
        assert_eq!(slots.pop_first(), Some((0, ())));
        assert_eq!(slots.pop_first(), Some((99_999, ())));
    }

    #[test]
    fn a_burst_gives_its_room_back_once_it_is_gone() {
        let mut slots = Slots::default();
        for seq in 0..10_000 {
            slots.push(seq, [0u8; 80]);
        }
        for seq in (0..10_000).rev().filter(|seq| seq % 100 != 0) {
            slots.remove(seq);
        }
        assert_eq!(slots.len(), 100);
        let (len, capacity) = slots.room();
        assert!(
            len <= 2 * 100 + SLACK && capacity < 1_000,
            "{len} slots in room for {capacity} after the burst"
        );
    }

    #[test]
    fn the_earliest_deadline_of_a_parked_record_comes_first() {
        let mut slots = Slots::default();
        let mut deadlines = Deadlines::default();
        // Two idle timeouts: deadlines do not follow the order of parking.
        for (seq, deadline) in [(0, 50), (1, 10), (2, 60), (3, 20)] {
            slots.push(seq, deadline);
            deadlines.push(deadline, seq);
        }
        assert_eq!(deadlines.first(|seq| slots.get(seq).is_some()), Some((10, 1)));
        slots.remove(1);
        slots.remove(3);
        assert_eq!(deadlines.first(|seq| slots.get(seq).is_some()), Some((50, 0)));
        slots.remove(0);
        slots.remove(2);
        assert_eq!(deadlines.first(|seq| slots.get(seq).is_some()), None);
    }

    #[test]
    fn deadlines_of_taken_records_are_squeezed_out() {
        let mut slots = Slots::default();
        let mut deadlines = Deadlines::default();
        // The first record's deadline is the earliest, so the others' entries never come
        // first: only squeezing removes them.
        slots.push(0, ());
        deadlines.push(0, 0);
        for seq in 1..10_000 {
            slots.push(seq, ());
            deadlines.push(seq, seq);
            slots.remove(seq);
            deadlines.taken(slots.len(), |seq| slots.get(seq).is_some());
        }
        assert!(
            deadlines.len() <= 2 + SLACK,
            "{} deadlines kept for one record",
            deadlines.len()
        );
        assert_eq!(deadlines.first(|seq| slots.get(seq).is_some()), Some((0, 0)));
    }
}
