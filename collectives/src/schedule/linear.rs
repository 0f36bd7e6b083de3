//! One-step and pairwise algorithms: gather and scatter with the root talking to every
//! rank at once, and pairwise all-to-all.

use std::ops::Range;

use super::{add_mod, sub_mod, Combine, Region, Schedule};

/// Gather to `root`: every rank sends its input (`Input[0..len of its block]`) and the
/// root receives rank i's into `blocks[i]` of its data (its own block copied from its
/// input). One step.
pub fn gather(n: usize, r: usize, root: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    if r == root {
        s.copy_before(0, Region::input(0..blocks[r].len()), Region::data(blocks[r].clone()));
        for peer in (0..n).filter(|&p| p != root) {
            s.recv(0, peer, Region::data(blocks[peer].clone()));
        }
    } else {
        s.send(0, root, Region::input(0..blocks[r].len()));
    }
    s
}

/// Scatter from `root`: the root sends `blocks[i]` of its input to rank i, which receives
/// it at the start of its data; the root copies its own. One step.
pub fn scatter(n: usize, r: usize, root: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    if r == root {
        s.copy_before(0, Region::input(blocks[r].clone()), Region::data(0..blocks[r].len()));
        for peer in (0..n).filter(|&p| p != root) {
            s.send(0, peer, Region::input(blocks[peer].clone()));
        }
    } else {
        s.recv(0, root, Region::data(0..blocks[r].len()));
    }
    s
}

/// Rank `r`'s partners of a group of `n` in turn, k = 1..n: `(k, r + k, r - k)`, the one
/// it sends to and the one it receives from (so that the ranks start on different
/// peers).
fn partners(n: usize, r: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (1..n).map(move |k| (k, add_mod(r, k, n), sub_mod(r, k, n)))
}

/// Pairwise all-to-all: rank r's block for rank i is `send[i]` of its input, and the
/// block from rank i lands in `recv[i]` of its data. Step k (1..n) exchanges with
/// `r + k` (send) and `r - k` (receive): one message each way per step, so no rank is
/// flooded. `send` and `recv` are this rank's layouts (all-to-allv when they differ).
pub fn pairwise_alltoall(n: usize, r: usize, send: &[Range<usize>], recv: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    s.copy_before(0, Region::input(send[r].clone()), Region::data(recv[r].clone()));
    for (k, to, from) in partners(n, r) {
        s.send(k - 1, to, Region::input(send[to].clone()));
        s.recv(k - 1, from, Region::data(recv[from].clone()));
    }
    s
}

/// Direct all-to-all: every block to its rank and from every rank at once, in one step
/// (rank r posts its sends to `r + 1, r + 2, ...` and its receives from `r - 1, r - 2,
/// ...`, so that the ranks start on different peers). One round of latency where
/// pairwise takes n - 1, and no rank waits for one peer before the next: 4 ranks on 2
/// cores, 64 KiB, 52 -> 37 us. Every rank has n - 1 messages in flight each way.
pub fn direct_alltoall(n: usize, r: usize, send: &[Range<usize>], recv: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    s.copy_before(0, Region::input(send[r].clone()), Region::data(recv[r].clone()));
    for (_, to, from) in partners(n, r) {
        s.send(0, to, Region::input(send[to].clone()));
        s.recv(0, from, Region::data(recv[from].clone()));
    }
    s
}

/// Direct allgather, in place: rank `r`'s block (`blocks[r]` of its data) to every rank
/// and every other block from its rank at once, in one step (the same order as
/// [`direct_alltoall`]). The ring moves the same bytes in n - 1 steps, each waiting for a
/// neighbour: 4 ranks on 2 cores, 16 B, 6.6-8.0 -> 4.7-5.4 us.
pub fn direct_allgather(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    for (_, to, from) in partners(n, r) {
        s.send(0, to, Region::data(blocks[r].clone()));
        s.recv(0, from, Region::data(blocks[from].clone()));
    }
    s
}

/// Direct reduce-scatter: rank `r` sends block i of its data to rank i and receives
/// block r from every rank at once, into scratch (n - 1 blocks of its own length), each
/// reduced into its block as it lands; `blocks[r]` of its data ends reduced. The ring
/// moves the same bytes in n - 1 steps, each waiting for a neighbour.
pub fn direct_reduce_scatter(n: usize, r: usize, blocks: &[Range<usize>]) -> Schedule {
    let mut s = Schedule::default();
    let len = blocks[r].len();
    for (k, to, from) in partners(n, r) {
        s.send(0, to, Region::data(blocks[to].clone()));
        s.recv_reduce(0, from, (k - 1) * len..k * len, Region::data(blocks[r].clone()));
    }
    s
}

/// Bruck's all-to-all for blocks of `b` elements: ceil(log2 n) steps instead of n - 1,
/// each sending the blocks whose index has bit k set to rank `r + 2^k`, packed into one
/// message: fewer, larger messages, for small blocks where latency dominates. Blocks
/// are rotated by the rank first and back at the end. Scratch: n blocks (the rotated
/// working copy) and two packing areas of ceil(n/2) blocks.
pub fn bruck_alltoall(n: usize, r: usize, b: usize) -> Schedule {
    let mut s = Schedule::default();
    if n == 0 {
        return s;
    }
    let tmp = |i: usize| Region::scratch(i * b..(i + 1) * b);
    let half = n.div_ceil(2);
    let (send_at, recv_at) = (n * b, (n + half) * b);
    s.reserve_scratch((n + 2 * half) * b);
    for i in 0..n {
        s.copy_before(0, Region::input(add_mod(r, i, n) * b..(add_mod(r, i, n) + 1) * b), tmp(i));
    }
    let mut k = 0;
    while (1 << k) < n {
        let d = 1 << k;
        let moved: Vec<usize> = (0..n).filter(|i| i & d != 0).collect();
        for (j, &i) in moved.iter().enumerate() {
            s.copy_before(k, tmp(i), Region::scratch(send_at + j * b..send_at + (j + 1) * b));
        }
        let len = moved.len() * b;
        s.send(k, add_mod(r, d, n), Region::scratch(send_at..send_at + len));
        s.recv(k, sub_mod(r, d, n), Region::scratch(recv_at..recv_at + len));
        for (j, &i) in moved.iter().enumerate() {
            let from = Region::scratch(recv_at + j * b..recv_at + (j + 1) * b);
            s.combine_after(k, Combine::Copy { from, into: tmp(i) });
        }
        k += 1;
    }
    // Back from the rotation: the block from rank r - i sits at i.
    let last = k.saturating_sub(1);
    for i in 0..n {
        let dst = sub_mod(r, i, n);
        s.combine_after(last, Combine::Copy { from: tmp(i), into: Region::data(dst * b..(dst + 1) * b) });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::sim::{allgathers, contribution, run, SIZES};
    use crate::schedule::{blocks_of, even_blocks};
    use crate::ReduceOp;

    #[test]
    fn gather_and_scatter_place_every_block() {
        for n in SIZES {
            let lens: Vec<usize> = (0..n).map(|i| (i * 3) % 5).collect();
            let blocks = blocks_of(&lens);
            let count = blocks.last().map_or(0, |b| b.end);
            for root in [0, n - 1] {
                let inputs: Vec<Vec<u8>> = (0..n).map(|r| contribution(r, lens[r])).collect();
                let data = (0..n).map(|r| vec![0u8; if r == root { count } else { 0 }]).collect();
                let scheds: Vec<_> = (0..n).map(|r| gather(n, r, root, &blocks)).collect();
                let got = run(&scheds, data, inputs.clone(), ReduceOp::Sum);
                assert_eq!(got[root], inputs.concat(), "gather n {n} root {root}");

                let all: Vec<u8> = contribution(7, count);
                let inputs = (0..n).map(|r| if r == root { all.clone() } else { vec![] }).collect();
                let data = (0..n).map(|r| vec![0u8; lens[r]]).collect();
                let scheds: Vec<_> = (0..n).map(|r| scatter(n, r, root, &blocks)).collect();
                let got = run(&scheds, data, inputs, ReduceOp::Sum);
                for r in 0..n {
                    assert_eq!(got[r], all[blocks[r].clone()], "scatter n {n} root {root} rank {r}");
                }
            }
        }
    }

    #[test]
    fn bruck_alltoall_transposes_in_log_steps() {
        for n in SIZES {
            for b in [0, 1, 3] {
                let inputs: Vec<Vec<u32>> =
                    (0..n).map(|r| (0..n * b).map(|i| (r * 1000 + i) as u32).collect()).collect();
                let scheds: Vec<_> = (0..n).map(|r| bruck_alltoall(n, r, b)).collect();
                let got = run(&scheds, vec![vec![0; n * b]; n], inputs.clone(), ReduceOp::Sum);
                for r in 0..n {
                    for i in 0..n {
                        assert_eq!(
                            got[r][i * b..(i + 1) * b],
                            inputs[i][r * b..(r + 1) * b],
                            "n {n} b {b} rank {r}"
                        );
                    }
                }
                let rounds = (n as f64).log2().ceil() as usize;
                assert_eq!(scheds[0].steps.iter().filter(|s| !s.xfers.is_empty()).count(), rounds);
            }
        }
    }

    #[test]
    fn direct_allgather_fills_every_block_in_one_step() {
        for n in SIZES {
            for per in [0, 1, 3] {
                let blocks = even_blocks(n * per, n);
                let scheds: Vec<_> = (0..n).map(|r| direct_allgather(n, r, &blocks)).collect();
                assert!(scheds.iter().all(|s| s.steps.len() <= 1), "n {n}");
                assert!(allgathers(&scheds, &blocks), "n {n} per {per}");
            }
        }
    }

    #[test]
    fn direct_reduce_scatter_reduces_each_block_on_its_rank() {
        for n in SIZES {
            for count in [0, 1, n, 3 * n + 1] {
                let blocks = even_blocks(count, n);
                let data: Vec<Vec<u32>> = (0..n).map(|r| contribution(r, count)).collect();
                let scheds: Vec<_> = (0..n).map(|r| direct_reduce_scatter(n, r, &blocks)).collect();
                assert!(scheds.iter().all(|s| s.steps.len() <= 1), "n {n}");
                let got = run(&scheds, data.clone(), vec![vec![]; n], ReduceOp::Sum);
                for r in 0..n {
                    let want: Vec<u32> = blocks[r]
                        .clone()
                        .map(|i| data.iter().map(|d| d[i]).fold(0, u32::wrapping_add))
                        .collect();
                    assert_eq!(got[r][blocks[r].clone()], want, "n {n} count {count} rank {r}");
                }
            }
        }
    }

    /// An all-to-all form: (n, rank, send blocks, receive blocks) -> schedule.
    type Form = fn(usize, usize, &[Range<usize>], &[Range<usize>]) -> Schedule;

    #[test]
    fn pairwise_and_direct_alltoall_transpose() {
        // (form, steps with transfers in a group of n)
        type Steps = fn(usize) -> usize;
        let forms: [(Form, Steps); 2] = [(pairwise_alltoall, |n| n - 1), (direct_alltoall, |n| n.min(2) - 1)];
        for (form, steps) in forms {
            for n in SIZES {
                let one = even_blocks(n, n);
                let sched = form(n, 0, &one, &one);
                assert_eq!(sched.steps.iter().filter(|s| !s.xfers.is_empty()).count(), steps(n), "n {n}");
                for per in [0, 1, 3] {
                    let blocks = even_blocks(n * per, n);
                    let inputs: Vec<Vec<u32>> =
                        (0..n).map(|r| (0..n * per).map(|i| (r * 1000 + i) as u32).collect()).collect();
                    let scheds: Vec<_> = (0..n).map(|r| form(n, r, &blocks, &blocks)).collect();
                    let got = run(&scheds, vec![vec![0; n * per]; n], inputs.clone(), ReduceOp::Sum);
                    for r in 0..n {
                        for i in 0..n {
                            assert_eq!(
                                got[r][blocks[i].clone()],
                                inputs[i][blocks[r].clone()],
                                "n {n} per {per}"
                            );
                        }
                    }
                }
            }
        }
    }
}
