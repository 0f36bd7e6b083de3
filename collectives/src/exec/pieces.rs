//! Combines applied piece by piece: when a step's combines each take their operand from
//! one of the step's receives, a receive's piece (the transfer cut into pieces, see
//! `segments`) is reduced into place as soon as it lands, while the step's other pieces
//! are still moving, where the step would otherwise wait for all of them first. This is
//! the pipelined ring: reduction overlapping transfer, on data still in cache.

use std::ops::Range;

use smallvec::SmallVec;

use crate::schedule::{Combine, Region, Step, Xfer};

/// For each combine of `st`, the index (in `st.xfers`) of the receive whose whole region
/// is its operand, when the step's combines may run piece by piece; None when they may
/// not. They may when every combine reads exactly a receive's region (its own: no two
/// read the same receive) and writes a region
/// of another buffer that no receive of the step writes and no other combine reads or
/// writes: then applying a piece early gives what applying it after the step gives.
/// (Sends of the step that read a combine's region keep it closed until they finish:
/// the executor applies a piece only where no transfer holds its values.)
pub(crate) fn plan(st: &Step) -> Option<SmallVec<[usize; 2]>> {
    // (Combines are named by a u16 in flight.)
    if st.combines.is_empty() || st.combines.len() > usize::from(u16::MAX) {
        return None;
    }
    let mut map = SmallVec::new();
    for (i, c) in st.combines.iter().enumerate() {
        let (Combine::Copy { from, into } | Combine::Reduce { from, into }) = c;
        if from.buf == into.buf {
            return None;
        }
        let recv = st.xfers.iter().position(|x| matches!(x, Xfer::Recv { into: r, .. } if r == from))?;
        let landed_on = st.xfers.iter().any(|x| matches!(x, Xfer::Recv { into: r, .. } if r.overlaps(into)));
        let shared = st.combines.iter().enumerate().filter(|(j, _)| *j != i).any(|(_, d)| {
            let (Combine::Copy { from: f, into: t } | Combine::Reduce { from: f, into: t }) = d;
            t.overlaps(into) || f.overlaps(into) || t.overlaps(from)
        });
        // One combine per receive: a piece runs one combine early.
        if landed_on || shared || map.contains(&recv) {
            return None;
        }
        map.push(recv);
    }
    Some(map)
}

/// Combine `c` restricted to elements `part` of its regions (offsets from their starts):
/// `(from, into)`.
pub(crate) fn restrict(c: &Combine, part: &Range<usize>) -> (Region, Region) {
    let (Combine::Copy { from, into } | Combine::Reduce { from, into }) = c;
    let at = |r: &Region| Region { buf: r.buf, range: r.range.start + part.start..r.range.start + part.end };
    (at(from), at(into))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::Buf;

    fn recv(into: Region) -> Xfer {
        Xfer::Recv { peer: 1, into }
    }

    #[test]
    fn combines_go_piecewise_only_when_early_equals_late() {
        use Region as R;
        let reduce = |from, into| Combine::Reduce { from, into };
        // A ring reduce-scatter step: receive into scratch, reduce into data.
        let ring = Step {
            copies: vec![],
            xfers: vec![Xfer::Send { peer: 1, from: R::data(0..4) }, recv(R::scratch(0..4))],
            combines: vec![reduce(R::scratch(0..4), R::data(4..8))],
        };
        assert_eq!(plan(&ring).as_deref(), Some(&[1][..]));
        // No combines; an operand that is not a whole receive; a receive landing on the
        // result; one buffer on both sides; two combines writing one region.
        let none = Step { combines: vec![], ..ring.clone() };
        let part = Step { combines: vec![reduce(R::scratch(0..2), R::data(4..6))], ..ring.clone() };
        let landed = Step { xfers: vec![recv(R::scratch(0..4)), recv(R::data(6..7))], ..ring.clone() };
        let same = Step {
            xfers: vec![recv(R::data(0..4))],
            combines: vec![reduce(R::data(0..4), R::data(4..8))],
            copies: vec![],
        };
        let twice = Step {
            xfers: vec![recv(R::scratch(0..4)), recv(R::scratch(4..8))],
            combines: vec![reduce(R::scratch(0..4), R::data(0..4)), reduce(R::scratch(4..8), R::data(2..6))],
            copies: vec![],
        };
        let shared_recv = Step {
            xfers: vec![recv(R::scratch(0..4))],
            combines: vec![reduce(R::scratch(0..4), R::data(0..4)), reduce(R::scratch(0..4), R::data(8..12))],
            copies: vec![],
        };
        for s in [none, part, landed, same, twice, shared_recv] {
            assert_eq!(plan(&s), None, "{s:?}");
        }
        let (f, t) = restrict(&ring.combines[0], &(1..3));
        assert_eq!((f, t), (Region { buf: Buf::Scratch, range: 1..3 }, R::data(5..7)));
    }
}
