//! Ring algorithms: each rank sends to its right neighbour and receives from its left,
//! one block per step, so every link carries the same load and bandwidth is optimal for
//! large messages (n - 1 steps per phase, each moving 1/n of the data).

use std::ops::Range;

use super::{add_mod, sub_mod, Region, Schedule};

/// Reduce-scatter around the ring, from step `first`: after `n - 1` steps rank `r`
/// holds block `(r + 1 + shift) mod n` fully reduced (in `Data`). Block `b` is
/// `blocks[b]` of the data buffer; scratch needed: the longest block.
pub fn reduce_scatter_into(
    sched: &mut Schedule,
    first: usize,
    n: usize,
    r: usize,
    blocks: &[Range<usize>],
    shift: usize,
) {
    if n < 2 {
        return;
    }
    let (right, left) = (add_mod(r, 1, n), sub_mod(r, 1, n));
    let longest = blocks.iter().map(|b| b.len()).max().unwrap_or(0);
    for s in 0..n - 1 {
        // Step s: pass on the block reduced so far, take in the next one.
        let send = sub_mod(add_mod(r, shift, n), s, n);
        let recv = sub_mod(send, 1, n);
        sched.send(first + s, right, Region::data(blocks[send].clone()));
        sched.recv_reduce(first + s, left, 0..blocks[recv].len(), Region::data(blocks[recv].clone()));
    }
    sched.reserve_scratch(longest);
}

/// Allgather around the ring, from step `first`: rank `r` starts with block
/// `(r + shift) mod n` and ends with all of them, after `n - 1` steps.
pub fn allgather_into(
    sched: &mut Schedule,
    first: usize,
    n: usize,
    r: usize,
    blocks: &[Range<usize>],
    shift: usize,
) {
    if n < 2 {
        return;
    }
    let (right, left) = (add_mod(r, 1, n), sub_mod(r, 1, n));
    for s in 0..n - 1 {
        let send = sub_mod(add_mod(r, shift, n), s, n);
        let recv = sub_mod(send, 1, n);
        sched.send(first + s, right, Region::data(blocks[send].clone()));
        sched.recv(first + s, left, Region::data(blocks[recv].clone()));
    }
}

/// Allreduce as a ring reduce-scatter followed by a ring allgather: 2(n - 1) steps, each
/// moving `count / n` elements: the bandwidth-optimal allreduce.
pub fn allreduce(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    reduce_scatter_into(&mut s, 0, n, r, blocks, 0);
    // Rank r now holds block r + 1.
    allgather_into(&mut s, n.saturating_sub(1), n, r, blocks, 1);
    s
}

/// Reduce-scatter: rank `r` ends with block `r` reduced (`blocks[r]` of its data).
pub fn reduce_scatter(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    reduce_scatter_into(&mut s, 0, n, r, blocks, n.saturating_sub(1));
    s
}

/// Reduce-scatter over two rings at once, in opposite directions, each carrying half of
/// every block: both directions of every link work, so a full-duplex link moves the
/// data in about half the time of one ring. Rank `r` ends with block `r`. Scratch: the
/// longest block. With two ranks the one ring already uses both directions, and this is
/// [`reduce_scatter`].
pub fn reduce_scatter_bidir(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    if n < 3 {
        return reduce_scatter(n, r, blocks);
    }
    let mut s = Schedule::default();
    let (right, left) = (add_mod(r, 1, n), sub_mod(r, 1, n));
    let lower = |b: usize| blocks[b].start..blocks[b].start + blocks[b].len() / 2;
    let upper = |b: usize| blocks[b].start + blocks[b].len() / 2..blocks[b].end;
    let half = blocks.iter().map(|b| b.len() / 2).max().unwrap_or(0);
    for st in 0..n - 1 {
        // Clockwise: lower halves, as in `reduce_scatter`.
        let send = sub_mod(add_mod(r, n - 1, n), st, n);
        let recv = sub_mod(send, 1, n);
        s.send(st, right, Region::data(lower(send)));
        s.recv_reduce(st, left, 0..lower(recv).len(), Region::data(lower(recv)));
        // Counter-clockwise: upper halves, mirrored; rank r ends with block r too.
        let send = add_mod(add_mod(r, 1, n), st, n);
        let recv = add_mod(send, 1, n);
        s.send(st, left, Region::data(upper(send)));
        s.recv_reduce(st, right, half..half + upper(recv).len(), Region::data(upper(recv)));
    }
    s.reserve_scratch(half + blocks.iter().map(|b| b.len() - b.len() / 2).max().unwrap_or(0));
    s
}

/// Allgather: rank `r` starts with block `r` and ends with every block.
pub fn allgather(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    allgather_into(&mut s, 0, n, r, blocks, 0);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::sim::{allgathers, contribution, reduce_all, run, COUNTS, SIZES};
    use crate::schedule::{blocks_of, even_blocks};
    use crate::ReduceOp;

    #[test]
    fn allreduce_matches_the_reference() {
        for n in SIZES {
            for count in COUNTS {
                let blocks = even_blocks(count, n);
                let scheds: Vec<_> = (0..n).map(|r| allreduce(n, r, &blocks)).collect();
                let parts: Vec<Vec<i64>> = (0..n).map(|r| contribution(r, count)).collect();
                let want = reduce_all(&parts, ReduceOp::Sum);
                let got = run(&scheds, parts, vec![vec![]; n], ReduceOp::Sum);
                assert!(got.iter().all(|g| *g == want), "n {n} count {count}");
                if n > 1 {
                    assert_eq!(scheds[0].busy_steps(), 2 * (n - 1));
                }
            }
        }
    }

    #[test]
    fn reduce_scatter_both_forms_leave_each_rank_its_block() {
        for n in SIZES {
            for lens in [vec![3; n], (0..n).map(|i| i % 3).collect(), (0..n).map(|i| 2 * i + 1).collect()] {
                let blocks = blocks_of(&lens);
                let count = blocks.last().map_or(0, |b| b.end);
                let parts: Vec<Vec<f32>> = (0..n).map(|r| contribution(r, count)).collect();
                let want = reduce_all(&parts, ReduceOp::Max);
                for form in [reduce_scatter, reduce_scatter_bidir] {
                    let scheds: Vec<_> = (0..n).map(|r| form(n, r, &blocks)).collect();
                    let got = run(&scheds, parts.clone(), vec![vec![]; n], ReduceOp::Max);
                    for r in 0..n {
                        assert_eq!(got[r][blocks[r].clone()], want[blocks[r].clone()], "n {n} lens {lens:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn allgather_fills_every_block() {
        for n in SIZES {
            let blocks = blocks_of(&(0..n).map(|i| (i * 5) % 4).collect::<Vec<_>>());
            let scheds: Vec<_> = (0..n).map(|r| allgather(n, r, &blocks)).collect();
            assert!(allgathers(&scheds, &blocks), "n {n}");
        }
    }
}
