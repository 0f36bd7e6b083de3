//! Runs the schedules of every rank of a collective in memory, with the executor's
//! semantics (see the module docs of `schedule`), and checks that they pair up: every
//! receive finds the one message of its step, source and destination, of its exact
//! length, and no message is left over. The algorithms' tests compare its results with
//! a naive reference.

use std::collections::HashMap;

use super::{Buf, Combine, Region, Schedule, Xfer};
use crate::{Element, ReduceOp};

/// One rank's buffers.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Bufs<T> {
    pub(crate) data: Vec<T>,
    pub(crate) input: Vec<T>,
    pub(crate) scratch: Vec<T>,
}

impl<T: Element> Bufs<T> {
    fn get(&self, r: &Region) -> &[T] {
        let b = match r.buf {
            Buf::Data => &self.data,
            Buf::Input => &self.input,
            Buf::Scratch => &self.scratch,
        };
        &b[r.range.clone()]
    }

    fn get_mut(&mut self, r: &Region) -> &mut [T] {
        let b = match r.buf {
            Buf::Data => &mut self.data,
            Buf::Input => panic!("a schedule writes its input: {r:?}"),
            Buf::Scratch => &mut self.scratch,
        };
        &mut b[r.range.clone()]
    }
}

/// Runs `scheds` (one per rank) on `data` and `input` (one each per rank); returns each
/// rank's data buffer. Panics, naming the step and ranks, on a schedule that does not
/// pair up or reaches outside its buffers.
#[allow(clippy::needless_range_loop)] // r is a rank as much as an index
pub(crate) fn run<T: Element>(
    scheds: &[Schedule],
    data: Vec<Vec<T>>,
    input: Vec<Vec<T>>,
    op: ReduceOp,
) -> Vec<Vec<T>> {
    let n = scheds.len();
    assert_eq!((data.len(), input.len()), (n, n));
    let mut bufs: Vec<Bufs<T>> = data
        .into_iter()
        .zip(input)
        .zip(scheds)
        .map(|((data, input), s)| Bufs { data, input, scratch: vec![T::zeroed(); s.scratch] })
        .collect();
    let steps = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
    for s in 0..steps {
        let step = |r: usize| scheds[r].steps.get(s);
        for r in 0..n {
            for (from, into) in step(r).map_or(&[][..], |st| &st.copies[..]) {
                let v = bufs[r].get(from).to_vec();
                bufs[r].get_mut(into).copy_from_slice(&v);
            }
        }
        let mut wire: HashMap<(usize, usize), Vec<T>> = HashMap::new();
        for r in 0..n {
            for x in step(r).map_or(&[][..], |st| &st.xfers[..]) {
                if let Xfer::Send { peer, from } = x {
                    assert!(*peer < n && *peer != r, "step {s}: rank {r} sends to {peer}");
                    let old = wire.insert((r, *peer), bufs[r].get(from).to_vec());
                    assert!(old.is_none(), "step {s}: two messages from {r} to {peer}");
                }
            }
        }
        for r in 0..n {
            for x in step(r).map_or(&[][..], |st| &st.xfers[..]) {
                if let Xfer::Recv { peer, into } = x {
                    let m = wire.remove(&(*peer, r)).unwrap_or_else(|| {
                        panic!("step {s}: rank {r} waits for {peer}, which sends nothing")
                    });
                    assert_eq!(m.len(), into.len(), "step {s}: message {peer} -> {r} has the wrong length");
                    bufs[r].get_mut(into).copy_from_slice(&m);
                }
            }
        }
        assert!(wire.is_empty(), "step {s}: messages nobody receives: {:?}", wire.keys().collect::<Vec<_>>());
        for r in 0..n {
            for c in step(r).map_or(&[][..], |st| &st.combines[..]) {
                match c {
                    Combine::Copy { from, into } => {
                        let v = bufs[r].get(from).to_vec();
                        bufs[r].get_mut(into).copy_from_slice(&v);
                    }
                    Combine::Reduce { from, into } => {
                        let v = bufs[r].get(from).to_vec();
                        let acc = bufs[r].get_mut(into);
                        assert_eq!(acc.len(), v.len(), "step {s}: rank {r} reduces regions of two lengths");
                        T::reduce(op, acc, &v);
                    }
                }
            }
        }
    }
    bufs.into_iter().map(|b| b.data).collect()
}

/// Rank `r`'s contribution of `count` elements in tests: small integers that depend on
/// the rank and position, so that sums stay exact in every type.
pub(crate) fn contribution<T: Element>(r: usize, count: usize) -> Vec<T> {
    (0..count).map(|i| T::from_small(((r * 7 + i * 3) % 5) as u8 + 1)).collect()
}

/// Whether the allgather schedules `scheds` (one per rank, over `blocks`) leave every
/// rank with every block, each rank starting with zeros but its own block (every
/// element a value of its own, so a block landing elsewhere shows).
pub(crate) fn allgathers(scheds: &[Schedule], blocks: &[std::ops::Range<usize>]) -> bool {
    let full: Vec<u32> = (1..=blocks.last().map_or(0, |b| b.end) as u32).collect();
    let data = (0..blocks.len())
        .map(|r| {
            let mut d = vec![0; full.len()];
            d[blocks[r].clone()].copy_from_slice(&full[blocks[r].clone()]);
            d
        })
        .collect();
    let got = run(scheds, data, vec![vec![]; blocks.len()], ReduceOp::Sum);
    got.iter().all(|g| *g == full)
}

/// The element-wise reduction of `parts`, the naive reference.
pub(crate) fn reduce_all<T: Element>(parts: &[Vec<T>], op: ReduceOp) -> Vec<T> {
    let mut acc = parts[0].clone();
    for p in &parts[1..] {
        T::reduce(op, &mut acc, p);
    }
    acc
}

/// World sizes and counts the algorithms' tests sweep: every size to 9 (powers of two
/// and not) and counts of 0, 1, odd, not divisible by the size, and larger.
pub(crate) const SIZES: std::ops::RangeInclusive<usize> = 1..=9;
pub(crate) const COUNTS: [usize; 6] = [0, 1, 2, 7, 13, 100];

#[cfg(test)]
mod tests {
    use super::allgathers;
    use crate::schedule::{blocks_of, Region, Schedule};

    #[test]
    fn allgathers_sees_a_block_missing_or_misplaced() {
        let blocks = blocks_of(&[2, 2]);
        assert!(!allgathers(&[Schedule::default(), Schedule::default()], &blocks));
        // Rank 0's block lands at rank 1 over rank 1's own block.
        let (mut s0, mut s1) = (Schedule::default(), Schedule::default());
        s0.send(0, 1, Region::data(0..2));
        s1.recv(0, 0, Region::data(2..4));
        s1.send(0, 0, Region::data(2..4));
        s0.recv(0, 1, Region::data(2..4));
        assert!(!allgathers(&[s0, s1], &blocks));
    }
}
