//! Rooted algorithms over trees and chains: k-nomial broadcast and reduce, the direct
//! broadcast (the root sends to each rank), the pipelined chain, and van de Geijn's
//! scatter-allgather broadcast. Ranks are taken relative to the root (`v = r - root mod
//! n`), so every tree is rooted at 0.

use super::{add_mod, even_blocks, ring, span, sub_mod, Region, Schedule};

/// The powers of `radix` below `n`: the k-nomial rounds' distances, smallest first.
fn distances(n: usize, radix: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut m = 1usize;
    while m < n {
        out.push(m);
        m = match m.checked_mul(radix) {
            Some(x) => x,
            None => break,
        };
    }
    out
}

/// k-nomial broadcast of `count` elements: in round i the ranks that have the data
/// (`v < k^i`) send it to `v + j k^i` for j in 1..k. ceil(log_k n) rounds; a larger
/// radix means fewer rounds but more sends per round from each sender. `radix` below 2
/// is taken as 2.
pub fn knomial_bcast(n: usize, r: usize, root: usize, count: usize, radix: usize) -> Schedule {
    let mut s = Schedule::default();
    let k = radix.max(2);
    let v = sub_mod(r, root, n.max(1));
    let real = |v: usize| add_mod(v, root, n);
    for (round, &m) in distances(n, k).iter().enumerate() {
        if v < m {
            for j in 1..k {
                let child = v + j * m;
                if child < n {
                    s.send(round, real(child), Region::data(0..count));
                }
            }
        } else if v < k * m {
            s.recv(round, real(v % m), Region::data(0..count));
        }
    }
    s
}

/// k-nomial reduce to `root`: in round i the ranks with `v` a multiple of k^i but not of
/// k^(i+1) send their partial result to `v - (v / k^i mod k) k^i`, which folds in up to
/// k - 1 partials at once. Other ranks' data ends holding partial results. Scratch:
/// (k - 1) vectors.
pub fn knomial_reduce(n: usize, r: usize, root: usize, count: usize, radix: usize) -> Schedule {
    let mut s = Schedule::default();
    let k = radix.max(2);
    let v = sub_mod(r, root, n.max(1));
    let real = |v: usize| add_mod(v, root, n);
    for (round, &m) in distances(n, k).iter().enumerate() {
        if v % m != 0 {
            break;
        }
        let j = (v / m) % k;
        if j != 0 {
            s.send(round, real(v - j * m), Region::data(0..count));
            break;
        }
        for j in 1..k {
            let child = v + j * m;
            if child < n {
                let at = (j - 1) * count;
                s.recv_reduce(round, real(child), at..at + count, Region::data(0..count));
            }
        }
    }
    s
}

/// Direct broadcast: the root sends to every rank at once, one step. The fastest when
/// the root's link is not the bottleneck (small messages, few ranks).
pub fn direct_bcast(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let mut s = Schedule::default();
    if r == root {
        for peer in (0..n).filter(|&p| p != root) {
            s.send(0, peer, Region::data(0..count));
        }
    } else {
        s.recv(0, root, Region::data(0..count));
    }
    s
}

/// Pipelined chain broadcast in `segments` pieces: rank v receives piece c from v - 1
/// in step v - 1 + c and passes it to v + 1 in step v + c, so n - 2 + segments steps in
/// all, each moving one piece. Bandwidth-optimal for large messages; every link is used
/// once.
pub fn chain_bcast(n: usize, r: usize, root: usize, count: usize, segments: usize) -> Schedule {
    let mut s = Schedule::default();
    if n < 2 {
        return s;
    }
    let pieces = even_blocks(count, segments.clamp(1, count.max(1)));
    let v = sub_mod(r, root, n);
    for (c, piece) in pieces.iter().enumerate() {
        if v > 0 {
            s.recv(v - 1 + c, add_mod(r, n - 1, n), Region::data(piece.clone()));
        }
        if v + 1 < n {
            s.send(v + c, add_mod(r, 1, n), Region::data(piece.clone()));
        }
    }
    s
}

/// Van de Geijn's broadcast: a binomial scatter of n blocks from the root, then a ring
/// allgather: about 2 `count` elements through each link in log2(n) + n - 1 steps. For
/// large messages on many ranks.
pub fn scatter_allgather_bcast(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let mut s = Schedule::default();
    if n < 2 {
        return s;
    }
    // Block v belongs to relative rank v.
    let blocks = even_blocks(count, n);
    let v = sub_mod(r, root, n);
    let real = |v: usize| add_mod(v, root, n);
    let top = n.next_power_of_two();
    let mut step = 0;
    let mut m = top / 2;
    while m >= 1 {
        if v % (2 * m) == 0 && v + m < n {
            s.send(step, real(v + m), Region::data(span(&blocks, v + m, (v + 2 * m).min(n))));
        } else if v % (2 * m) == m {
            s.recv(step, real(v - m), Region::data(span(&blocks, v, (v + m).min(n))));
        }
        step += 1;
        m /= 2;
    }
    // The ring runs over relative ranks: block v starts at relative rank v, and relative
    // neighbours are real neighbours.
    ring::allgather_into(&mut s, step, n, v, &blocks, 0);
    // `allgather_into` named relative ranks as peers: make them real.
    for st in &mut s.steps[step..] {
        for x in &mut st.xfers {
            match x {
                super::Xfer::Send { peer, .. } | super::Xfer::Recv { peer, .. } => *peer = real(*peer),
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::sim::{contribution, reduce_all, run, COUNTS, SIZES};
    use crate::ReduceOp;

    fn check_bcast(form: impl Fn(usize, usize, usize, usize) -> Schedule) {
        for n in SIZES {
            for count in COUNTS {
                for root in [0, n / 2, n - 1] {
                    let want: Vec<u64> = contribution(root, count);
                    let data =
                        (0..n).map(|r| if r == root { want.clone() } else { vec![0; count] }).collect();
                    let scheds: Vec<_> = (0..n).map(|r| form(n, r, root, count)).collect();
                    let got = run(&scheds, data, vec![vec![]; n], ReduceOp::Sum);
                    assert!(got.iter().all(|g| *g == want), "n {n} count {count} root {root}");
                }
            }
        }
    }

    #[test]
    fn every_broadcast_reaches_every_rank() {
        for k in [2, 3, 4, 8] {
            check_bcast(|n, r, root, c| knomial_bcast(n, r, root, c, k));
        }
        check_bcast(direct_bcast);
        for segs in [1, 3, 16] {
            check_bcast(|n, r, root, c| chain_bcast(n, r, root, c, segs));
        }
        check_bcast(scatter_allgather_bcast);
    }

    #[test]
    fn knomial_reduce_reaches_the_root() {
        for k in [2, 3, 5] {
            for n in SIZES {
                for count in COUNTS {
                    for root in [0, n - 1] {
                        let parts: Vec<Vec<i32>> = (0..n).map(|r| contribution(r, count)).collect();
                        let want = reduce_all(&parts, ReduceOp::Sum);
                        let scheds: Vec<_> = (0..n).map(|r| knomial_reduce(n, r, root, count, k)).collect();
                        let got = run(&scheds, parts, vec![vec![]; n], ReduceOp::Sum);
                        assert_eq!(got[root], want, "k {k} n {n} count {count} root {root}");
                    }
                }
            }
        }
    }

    #[test]
    fn knomial_rounds_shrink_with_the_radix() {
        assert_eq!(knomial_bcast(9, 0, 0, 1, 2).busy_steps(), 4);
        assert_eq!(knomial_bcast(9, 0, 0, 1, 3).busy_steps(), 2);
        assert_eq!(knomial_bcast(9, 0, 0, 1, 9).busy_steps(), 1);
    }
}
