//! Algorithms that pair ranks at doubling distances: recursive doubling and Rabenseifner
//! allreduce (log2 steps: the latency-optimal choices), recursive-doubling allgather,
//! the dissemination barrier, and inclusive and exclusive scans.
//!
//! Allreduce and allgather need a power-of-two group; for other sizes the first `2 * rem` ranks fold
//! in pairs first (`rem = n - p`, `p` the largest power of two not above `n`): each even
//! one hands its data to the odd one after it and waits, the `p` survivors run the
//! algorithm, and the even ones get the result back at the end.

use std::ops::Range;

use super::{add_mod, even_blocks, span, sub_mod, Combine, Region, Schedule};

/// How a world of `n` folds to a power of two.
struct Fold {
    /// The power of two.
    p: usize,
    /// Ranks folded away: `n - p`.
    rem: usize,
}

impl Fold {
    fn new(n: usize) -> Fold {
        let p = if n == 0 { 0 } else { 1 << (usize::BITS - 1 - n.leading_zeros()) };
        Fold { p, rem: n - p }
    }

    /// The rank's place among the `p` survivors, if it is one.
    fn inner(&self, r: usize) -> Option<usize> {
        if r < 2 * self.rem {
            (r % 2 == 1).then_some(r / 2)
        } else {
            Some(r - self.rem)
        }
    }

    /// The real rank of survivor `v`.
    fn real(&self, v: usize) -> usize {
        if v < self.rem {
            2 * v + 1
        } else {
            v + self.rem
        }
    }

    /// Adds the fold (step 0) and returns the first free step.
    fn fold(&self, s: &mut Schedule, r: usize, count: usize) -> usize {
        if self.rem == 0 {
            return 0;
        }
        if r < 2 * self.rem {
            if r % 2 == 0 {
                s.send(0, r + 1, Region::data(0..count));
            } else {
                s.recv_reduce(0, r - 1, 0..count, Region::data(0..count));
            }
        }
        1
    }

    /// Adds the unfold at step `at`.
    fn unfold(&self, s: &mut Schedule, at: usize, r: usize, count: usize) {
        if r < 2 * self.rem {
            if r % 2 == 1 {
                s.send(at, r - 1, Region::data(0..count));
            } else {
                s.recv(at, r + 1, Region::data(0..count));
            }
        }
    }

    fn rounds(&self) -> usize {
        self.p.trailing_zeros() as usize
    }
}

/// Recursive-doubling allreduce: every survivor exchanges its whole vector with a
/// partner at distance 1, 2, 4, ...: log2(p) steps of `count` elements (plus the fold).
/// The latency-optimal allreduce for small vectors.
pub fn allreduce(n: usize, r: usize, count: usize) -> Schedule {
    let mut s = Schedule::default();
    if n < 2 {
        return s;
    }
    let f = Fold::new(n);
    let mut at = f.fold(&mut s, r, count);
    if let Some(v) = f.inner(r) {
        for k in 0..f.rounds() {
            let peer = f.real(v ^ (1 << k));
            s.send(at + k, peer, Region::data(0..count));
            s.recv_reduce(at + k, peer, 0..count, Region::data(0..count));
        }
    }
    at += f.rounds();
    f.unfold(&mut s, at, r, count);
    s
}

/// Rabenseifner's allreduce: a reduce-scatter by recursive halving (each step exchanges
/// half of what is left with a partner at distance p/2, p/4, ..., 1) and an allgather by
/// recursive doubling (the same steps backwards): 2 log2(p) steps moving about 2 `count`
/// elements in all, which wins for mid-sized and large vectors when latency still counts.
pub fn rabenseifner(n: usize, r: usize, count: usize) -> Schedule {
    let mut s = Schedule::default();
    if n < 2 {
        return s;
    }
    let f = Fold::new(n);
    let first = f.fold(&mut s, r, count);
    let rounds = f.rounds();
    if let Some(v) = f.inner(r) {
        let blocks = even_blocks(count, f.p);
        // Halving: the blocks this rank is responsible for shrink from all p to its own.
        let (mut lo, mut hi) = (0, f.p);
        let mut kept: Vec<(usize, usize)> = Vec::with_capacity(rounds);
        for k in 0..rounds {
            let d = f.p >> (k + 1);
            let peer = f.real(v ^ d);
            let mid = lo + d;
            let (keep, give) = if v & d == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
            s.send(first + k, peer, Region::data(span(&blocks, give.0, give.1)));
            let into = span(&blocks, keep.0, keep.1);
            s.recv_reduce(first + k, peer, 0..into.len(), Region::data(into));
            kept.push((lo, hi));
            (lo, hi) = keep;
        }
        // Doubling: send what is complete, receive the partner's half, in reverse order.
        for k in 0..rounds {
            let round = rounds - 1 - k;
            let d = f.p >> (round + 1);
            let peer = f.real(v ^ d);
            let (plo, phi) = kept[round];
            let other = if lo == plo { (lo + d, phi) } else { (plo, plo + d) };
            s.send(first + rounds + k, peer, Region::data(span(&blocks, lo, hi)));
            s.recv(first + rounds + k, peer, Region::data(span(&blocks, other.0, other.1)));
            (lo, hi) = (plo, phi);
        }
    }
    f.unfold(&mut s, first + 2 * rounds, r, count);
    s
}

/// Dissemination barrier: in step k every rank signals rank `r + 2^k` and waits for
/// rank `r - 2^k` (empty messages): ceil(log2 n) steps, for any n.
pub fn barrier(n: usize, r: usize) -> Schedule {
    let mut s = Schedule { sync: true, ..Schedule::default() };
    let mut d = 1;
    let mut k = 0;
    while d < n {
        s.send(k, add_mod(r, d, n), Region::data(0..0));
        s.recv(k, sub_mod(r, d, n), Region::data(0..0));
        d *= 2;
        k += 1;
    }
    s
}

/// k-nomial (k-port dissemination) barrier: in round j every rank signals ranks
/// `r + i k^j` and waits for `r - i k^j`, for i in 1..k with `i k^j < n`: ceil(log_k n)
/// rounds of up to k - 1 messages each, fewer rounds than dissemination (radix 2) when
/// messages in flight together cost little more than one. `radix` below 2 is taken as 2.
pub fn knomial_barrier(n: usize, r: usize, radix: usize) -> Schedule {
    let k = radix.max(2);
    let mut s = Schedule { sync: true, ..Schedule::default() };
    let (mut m, mut round) = (1usize, 0usize);
    while m < n {
        for i in 1..k {
            let Some(d) = i.checked_mul(m).filter(|&d| d < n) else { break };
            s.send(round, add_mod(r, d, n), Region::data(0..0));
            s.recv(round, sub_mod(r, d, n), Region::data(0..0));
        }
        m = match m.checked_mul(k) {
            Some(x) => x,
            None => break,
        };
        round += 1;
    }
    s
}

/// Inclusive (`exclusive` false) or exclusive scan by recursive doubling (Hillis and
/// Steele): in step k rank `r` sends its running partial to `r + 2^k` and folds in the
/// one of `r - 2^k`. Rank `r` ends with the reduction of ranks `0..=r` (inclusive) or
/// `0..r` (exclusive; rank 0's data is left as it was). Scratch: two vectors.
pub fn scan(n: usize, r: usize, count: usize, exclusive: bool) -> Schedule {
    let mut s = Schedule::default();
    if n < 2 {
        return s;
    }
    let partial = Region::scratch(0..count);
    let incoming: Range<usize> = count..2 * count;
    s.reserve_scratch(2 * count);
    s.copy_before(0, Region::data(0..count), partial.clone());
    let mut d = 1;
    let mut k = 0;
    let mut first = true;
    while d < n {
        if r + d < n {
            s.send(k, r + d, partial.clone());
        }
        if r >= d {
            s.recv(k, r - d, Region::scratch(incoming.clone()));
            let from = Region::scratch(incoming.clone());
            let into = Region::data(0..count);
            s.combine_after(
                k,
                if exclusive && first {
                    Combine::Copy { from, into }
                } else {
                    Combine::Reduce { from, into }
                },
            );
            s.combine_after(
                k,
                Combine::Reduce { from: Region::scratch(incoming.clone()), into: partial.clone() },
            );
            first = false;
        }
        d *= 2;
        k += 1;
    }
    s
}

/// Recursive-doubling allgather, in place: survivors of the fold exchange everything
/// they hold with a partner at distance 1, 2, 4, ...: log2(p) steps moving the same
/// bytes as the ring's n - 1. Folding, each even rank of the first `2 * rem` hands its
/// block to the odd one after it and gets every block back at the end. A survivor's
/// ranks, and those of any aligned group of survivors, are consecutive, so each message
/// is one span of blocks. Four ranks on two cores, 64 KiB: Open MPI's default there
/// (16.6 us, its linear form 35-42, its ring 23-24).
pub fn allgather(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    let f = Fold::new(n);
    if f.rem > 0 && r < 2 * f.rem {
        if r % 2 == 0 {
            s.send(0, r + 1, Region::data(blocks[r].clone()));
        } else {
            s.recv(0, r - 1, Region::data(blocks[r - 1].clone()));
        }
    }
    let first = usize::from(f.rem > 0);
    let all = span(blocks, 0, n);
    let Some(v) = f.inner(r) else {
        s.recv(first + f.rounds(), r + 1, Region::data(all));
        return s;
    };
    // The first real rank of survivor `u` (`u == p`: one past the last).
    let lo = |u: usize| {
        if u == f.p {
            n
        } else if u < f.rem {
            2 * u
        } else {
            u + f.rem
        }
    };
    for k in 0..f.rounds() {
        let d = 1 << k;
        let (mine, theirs) = (v & !(d - 1), (v ^ d) & !(d - 1));
        let step = first + k;
        s.send(step, f.real(v ^ d), Region::data(span(blocks, lo(mine), lo(mine + d))));
        s.recv(step, f.real(v ^ d), Region::data(span(blocks, lo(theirs), lo(theirs + d))));
    }
    if f.rem > 0 && r < 2 * f.rem {
        s.send(first + f.rounds(), r - 1, Region::data(all));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::sim::{allgathers, contribution, reduce_all, run, COUNTS, SIZES};
    use crate::ReduceOp;

    #[test]
    fn both_allreduces_match_the_reference() {
        for n in SIZES {
            for count in COUNTS {
                let parts: Vec<Vec<u32>> = (0..n).map(|r| contribution(r, count)).collect();
                let want = reduce_all(&parts, ReduceOp::Sum);
                for form in [allreduce, rabenseifner] {
                    let scheds: Vec<_> = (0..n).map(|r| form(n, r, count)).collect();
                    let got = run(&scheds, parts.clone(), vec![vec![]; n], ReduceOp::Sum);
                    assert!(got.iter().all(|g| *g == want), "n {n} count {count}");
                }
            }
        }
    }

    #[test]
    fn allgather_fills_every_block_in_ceil_log2_steps() {
        use crate::schedule::blocks_of;
        for n in SIZES {
            for lens in [vec![3; n], (0..n).map(|i| (i * 5) % 4).collect(), vec![0; n]] {
                let blocks = blocks_of(&lens);
                let scheds: Vec<_> = (0..n).map(|r| allgather(n, r, &blocks)).collect();
                assert!(allgathers(&scheds, &blocks), "n {n} lens {lens:?}");
                let fold = usize::from(!n.is_power_of_two()) * 2;
                let want = (n as f64).log2().floor() as usize + fold;
                assert!(scheds.iter().all(|s| s.steps.len() <= want), "n {n}");
            }
        }
    }

    #[test]
    fn rabenseifner_moves_about_twice_the_vector() {
        let s = rabenseifner(8, 3, 800);
        assert_eq!(s.bytes_sent(1), 700 * 2);
        assert_eq!(s.busy_steps(), 6);
    }

    #[test]
    fn barrier_pairs_up_in_ceil_log2_steps() {
        for n in SIZES {
            let scheds: Vec<_> = (0..n).map(|r| barrier(n, r)).collect();
            run::<u8>(&scheds, vec![vec![]; n], vec![vec![]; n], ReduceOp::Sum);
            assert_eq!(scheds[0].busy_steps(), (n as f64).log2().ceil() as usize);
        }
    }

    /// Every rank must have heard, directly or through others, from every rank before
    /// it leaves: followed through the schedules' messages round by round.
    #[test]
    fn knomial_barriers_hear_from_everyone() {
        for k in [2, 3, 4, 8] {
            for n in SIZES {
                let scheds: Vec<_> = (0..n).map(|r| knomial_barrier(n, r, k)).collect();
                run::<u8>(&scheds, vec![vec![]; n], vec![vec![]; n], ReduceOp::Sum);
                let mut heard: Vec<Vec<bool>> = (0..n).map(|r| (0..n).map(|i| i == r).collect()).collect();
                for st in 0..scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0) {
                    let before = heard.clone();
                    for (r, sched) in scheds.iter().enumerate() {
                        for x in sched.steps.get(st).map_or(&[][..], |s| &s.xfers[..]) {
                            if let crate::schedule::Xfer::Recv { peer, .. } = x {
                                for i in 0..n {
                                    heard[r][i] |= before[*peer][i];
                                }
                            }
                        }
                    }
                }
                assert!(heard.iter().all(|h| h.iter().all(|&x| x)), "k {k} n {n}");
            }
        }
    }

    #[test]
    fn scans_match_prefix_reductions() {
        for n in SIZES {
            for count in COUNTS {
                let parts: Vec<Vec<i16>> = (0..n).map(|r| contribution(r, count)).collect();
                for exclusive in [false, true] {
                    let scheds: Vec<_> = (0..n).map(|r| scan(n, r, count, exclusive)).collect();
                    let got = run(&scheds, parts.clone(), vec![vec![]; n], ReduceOp::Prod);
                    for r in 0..n {
                        let want = match (exclusive, r) {
                            (true, 0) => parts[0].clone(),
                            (true, _) => reduce_all(&parts[..r], ReduceOp::Prod),
                            (false, _) => reduce_all(&parts[..=r], ReduceOp::Prod),
                        };
                        assert_eq!(got[r], want, "n {n} count {count} rank {r} exclusive {exclusive}");
                    }
                }
            }
        }
    }
}
