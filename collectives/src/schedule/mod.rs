//! Schedules: what each rank of a collective sends, receives, copies and reduces, step by
//! step, as plain data. Every algorithm is a pure function from (world size, rank, sizes)
//! to a [`Schedule`]; nothing here does I/O. The executor (`crate::exec`) runs a schedule
//! over the transport, and the simulator (`sim`, tests only) runs the schedules of all
//! ranks in memory, against which each algorithm is checked on its own.
//!
//! # Semantics
//! A rank runs its steps in order. In each step it first makes the step's copies, then
//! posts all its transfers at once and waits for all of them, then applies the step's
//! combines (copies and reductions of what arrived). A transfer of step `s` from rank `a`
//! to rank `b` matches the receive of step `s` on `b` from `a`: at most one message per
//! (step, source, destination), of exactly the receiving region's length. So every
//! rank's step `s` depends only on step-`s` messages, and a schedule whose sends and
//! receives pair up cannot deadlock.
//!
//! Regions are counted in elements, in one of a rank's buffers ([`Buf`]).

use std::ops::Range;

pub mod doubling;
pub mod hier;
pub mod linear;
pub mod ring;
pub mod tree;

#[cfg(test)]
pub(crate) mod sim;

/// A rank's buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The buffer the result is built in (the caller's, for in-place operations).
    Data,
    /// The caller's input when it is not the result buffer (all-to-all, gather): read only.
    Input,
    /// Room the collective allocates ([`Schedule::scratch`] elements).
    Scratch,
}

/// Elements `range` of buffer `buf`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// Which buffer.
    pub buf: Buf,
    /// Which elements.
    pub range: Range<usize>,
}

impl Region {
    /// Elements `range` of the data buffer.
    pub fn data(range: Range<usize>) -> Region {
        Region { buf: Buf::Data, range }
    }

    /// Elements `range` of the input buffer.
    pub fn input(range: Range<usize>) -> Region {
        Region { buf: Buf::Input, range }
    }

    /// Elements `range` of the scratch buffer.
    pub fn scratch(range: Range<usize>) -> Region {
        Region { buf: Buf::Scratch, range }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.range.len()
    }

    /// Whether it covers no element.
    pub fn is_empty(&self) -> bool {
        self.range.is_empty()
    }

    /// Whether it shares an element with `other` (same buffer, overlapping ranges).
    pub fn overlaps(&self, other: &Region) -> bool {
        self.buf == other.buf && self.range.start < other.range.end && other.range.start < self.range.end
    }
}

/// A message to or from another rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Xfer {
    /// Send `from` to rank `peer`.
    Send {
        /// The destination rank.
        peer: usize,
        /// What to send.
        from: Region,
    },
    /// Receive `into` from rank `peer` (exactly its length).
    Recv {
        /// The source rank.
        peer: usize,
        /// Where it lands.
        into: Region,
    },
}

/// A local move of elements after a step's transfers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Combine {
    /// `into = from`.
    Copy {
        /// Source.
        from: Region,
        /// Destination, of the same length.
        into: Region,
    },
    /// `into = into op from`, element by element.
    Reduce {
        /// The operand.
        from: Region,
        /// The accumulator, of the same length.
        into: Region,
    },
}

/// One step of one rank (see the module docs for the order within it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Copies made before the transfers: `(from, into)`.
    pub copies: Vec<(Region, Region)>,
    /// Transfers, all in flight together.
    pub xfers: Vec<Xfer>,
    /// Copies and reductions after every transfer finished.
    pub combines: Vec<Combine>,
}

impl Step {
    /// Bytes this step sends, for elements of `elem` bytes.
    pub fn bytes_sent(&self, elem: usize) -> usize {
        let sent = self.xfers.iter().map(|x| match x {
            Xfer::Send { from, .. } => from.len() * elem,
            Xfer::Recv { .. } => 0,
        });
        sent.sum()
    }

    /// Whether the step does nothing.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty() && self.xfers.is_empty() && self.combines.is_empty()
    }
}

/// What one rank does in one collective.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The steps, by global step number (a rank idle in a step has an empty one).
    pub steps: Vec<Step>,
    /// Elements of scratch the schedule uses.
    pub scratch: usize,
    /// Its empty messages synchronise (a barrier): they are sent. Elsewhere an empty
    /// transfer moves nothing and is left out on both sides.
    pub sync: bool,
}

impl Schedule {
    /// Step `s`, made (and the steps before it) if missing.
    pub fn step(&mut self, s: usize) -> &mut Step {
        if self.steps.len() <= s {
            self.steps.resize_with(s + 1, Step::default);
        }
        &mut self.steps[s]
    }

    /// Adds a send in step `s`.
    pub fn send(&mut self, s: usize, peer: usize, from: Region) {
        self.step(s).xfers.push(Xfer::Send { peer, from });
    }

    /// Adds a receive in step `s`.
    pub fn recv(&mut self, s: usize, peer: usize, into: Region) {
        self.step(s).xfers.push(Xfer::Recv { peer, into });
    }

    /// Adds a receive into scratch in step `s`, reduced into `into` after the step.
    pub fn recv_reduce(&mut self, s: usize, peer: usize, scratch: Range<usize>, into: Region) {
        self.reserve_scratch(scratch.end);
        self.recv(s, peer, Region::scratch(scratch.clone()));
        self.step(s).combines.push(Combine::Reduce { from: Region::scratch(scratch), into });
    }

    /// Makes sure the schedule's scratch holds at least `end` elements.
    pub fn reserve_scratch(&mut self, end: usize) {
        self.scratch = self.scratch.max(end);
    }

    /// Adds a copy made before the transfers of step `s`.
    pub fn copy_before(&mut self, s: usize, from: Region, into: Region) {
        self.step(s).copies.push((from, into));
    }

    /// Adds a combine made after the transfers of step `s`.
    pub fn combine_after(&mut self, s: usize, c: Combine) {
        self.step(s).combines.push(c);
    }

    /// The number of steps that do something.
    pub fn busy_steps(&self) -> usize {
        self.steps.iter().filter(|s| !s.is_empty()).count()
    }

    /// Bytes this rank sends, for elements of `elem` bytes.
    pub fn bytes_sent(&self, elem: usize) -> usize {
        self.steps.iter().map(|s| s.bytes_sent(elem)).sum()
    }
}

/// `count` elements cut into `parts` blocks as even as possible, the first
/// `count % parts` one element longer. No block for `parts == 0`.
pub fn even_blocks(count: usize, parts: usize) -> Vec<Range<usize>> {
    if parts == 0 {
        return Vec::new();
    }
    let (q, r) = (count / parts, count % parts);
    let mut start = 0;
    (0..parts)
        .map(|i| {
            let len = q + usize::from(i < r);
            let b = start..start + len;
            start += len;
            b
        })
        .collect()
}

/// Consecutive blocks of the given lengths.
pub fn blocks_of(lens: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    lens.iter()
        .map(|&l| {
            let b = start..start + l;
            start += l;
            b
        })
        .collect()
}

/// The elements from the start of block `lo` to the end of block `hi - 1` (consecutive
/// blocks); empty for `lo >= hi`.
pub fn span(blocks: &[Range<usize>], lo: usize, hi: usize) -> Range<usize> {
    if lo >= hi {
        return 0..0;
    }
    blocks[lo].start..blocks[hi - 1].end
}

/// `(a + b) mod n` for ranks, without overflow or negative intermediates.
pub fn add_mod(a: usize, b: usize, n: usize) -> usize {
    (a % n + b % n) % n
}

/// `(a - b) mod n` for ranks.
pub fn sub_mod(a: usize, b: usize, n: usize) -> usize {
    (a % n + n - b % n) % n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_blocks_cover_the_count_in_order() {
        for count in [0, 1, 5, 7, 64, 1001] {
            for parts in 1..9 {
                let b = even_blocks(count, parts);
                assert_eq!(b.len(), parts);
                assert_eq!(b[0].start, 0);
                assert_eq!(b[parts - 1].end, count);
                assert!(b.windows(2).all(|w| w[0].end == w[1].start && w[0].len() >= w[1].len()));
                assert!(b[0].len() - b[parts - 1].len() <= 1);
            }
        }
        assert!(even_blocks(5, 0).is_empty());
        assert_eq!(blocks_of(&[2, 0, 3]), vec![0..2, 2..2, 2..5]);
        assert_eq!(span(&blocks_of(&[2, 0, 3]), 1, 3), 2..5);
        assert_eq!(span(&blocks_of(&[2, 0, 3]), 2, 2), 0..0);
        assert_eq!((add_mod(5, 4, 6), sub_mod(1, 3, 6)), (3, 4));
    }
}
