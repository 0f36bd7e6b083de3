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

/// One binary tree of a double binary tree, over relative ranks `1..n`: each rank's
/// parent (0 for the tree's root, which the broadcast root feeds), children, depth and
/// height.
struct Btree {
    parent: Vec<usize>,
    children: Vec<Vec<usize>>,
    depth: Vec<usize>,
    height: Vec<usize>,
}

impl Btree {
    /// The balanced in-order tree over `order` (relative ranks, each once), hung under
    /// rank 0.
    fn new(n: usize, order: &[usize]) -> Btree {
        let mut t = Btree {
            parent: vec![0; n],
            children: vec![Vec::new(); n],
            depth: vec![0; n],
            height: vec![0; n],
        };
        t.build(order, 0, 1);
        t
    }

    /// Builds the subtree of `part` under `parent` at `depth`; returns its root's height.
    fn build(&mut self, part: &[usize], parent: usize, depth: usize) -> Option<usize> {
        if part.is_empty() {
            return None;
        }
        let mid = part.len() / 2;
        let me = part[mid];
        self.parent[me] = parent;
        self.children[parent].push(me);
        self.depth[me] = depth;
        let l = self.build(&part[..mid], me, depth + 1);
        let r = self.build(&part[mid + 1..], me, depth + 1);
        let h = l.max(r).map_or(0, |h| h + 1);
        self.height[me] = h;
        Some(h)
    }
}

/// The two trees of a double binary tree over `n` ranks: the in-order tree over
/// relative ranks 1..n, and the same over them mirrored (an even number of them) or
/// shifted by one (odd), as NCCL builds them: either way every rank's position changes
/// parity, so the leaves of one tree (even positions) are inner nodes of the other.
fn btrees(n: usize) -> [Btree; 2] {
    let order: Vec<usize> = (1..n).collect();
    let mut other = order.clone();
    if order.len() % 2 == 0 {
        other.reverse();
    } else {
        other.rotate_left(1);
    }
    [Btree::new(n, &order), Btree::new(n, &other)]
}

/// The steps a double binary tree reduce takes on `n` ranks (the same on every rank,
/// so that what follows it starts at the same step everywhere).
fn dbtree_reduce_steps(n: usize) -> usize {
    let top = btrees(n).iter().map(|t| t.height.iter().copied().max().unwrap_or(0)).max().unwrap_or(0);
    2 * (top + 2)
}

/// What both double binary tree forms start from, for rank `r` of `n` (None below two
/// ranks): its rank relative to `root`, the way back to real ranks, the two halves of
/// `count` elements and the two trees.
#[allow(clippy::type_complexity)]
fn dbtree_setup(
    n: usize,
    r: usize,
    root: usize,
    count: usize,
) -> Option<(usize, impl Fn(usize) -> usize, Vec<std::ops::Range<usize>>, [Btree; 2])> {
    (n >= 2)
        .then(|| (sub_mod(r, root, n), move |v: usize| add_mod(v, root, n), even_blocks(count, 2), btrees(n)))
}

/// Double binary tree broadcast: the root sends one half of the data down each tree;
/// each rank passes a half on to its children in that tree. Tree 0 moves in even
/// steps, tree 1 in odd ones, so the two never share a step (and a pair of ranks never
/// has two messages in one).
pub fn dbtree_bcast(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let mut s = Schedule::default();
    let Some((v, real, halves, trees)) = dbtree_setup(n, r, root, count) else { return s };
    for (t, tree) in trees.iter().enumerate() {
        let half = Region::data(halves[t].clone());
        let step = |d: usize| 2 * d + t;
        if v != 0 {
            s.recv(step(tree.depth[v] - 1), real(tree.parent[v]), half.clone());
        }
        for &c in &tree.children[v] {
            s.send(step(tree.depth[c] - 1), real(c), half.clone());
        }
    }
    s
}

/// Double binary tree reduce to `root`: each half climbs its tree, every inner rank
/// folding in its children's partial results; the trees' roots hand them to the root.
/// Tree 0 in even steps, tree 1 in odd ones. Scratch: room for two children's halves
/// per tree.
pub fn dbtree_reduce(n: usize, r: usize, root: usize, count: usize) -> Schedule {
    let mut s = Schedule::default();
    let Some((v, real, halves, trees)) = dbtree_setup(n, r, root, count) else { return s };
    // Step of a send from a node of height h up to its parent; the root's receives from
    // a tree's root come after everything below it.
    let top = trees.iter().map(|t| t.height.iter().copied().max().unwrap_or(0)).max().unwrap_or(0);
    for (t, tree) in trees.iter().enumerate() {
        let half = halves[t].clone();
        let step = |h: usize| 2 * h + t;
        let up = |x: usize| if tree.parent[x] == 0 { top + 1 } else { tree.height[x] };
        if v != 0 {
            s.send(step(up(v)), real(tree.parent[v]), Region::data(half.clone()));
        }
        let slots = half.len();
        for (i, &c) in tree.children[v].iter().enumerate() {
            let at = (2 * t + i) * slots;
            s.recv_reduce(step(up(c)), real(c), at..at + slots, Region::data(half.clone()));
        }
    }
    s
}

/// Allreduce as a double binary tree reduce to rank 0 followed by a double binary tree
/// broadcast from it.
pub fn dbtree_allreduce(n: usize, r: usize, count: usize) -> Schedule {
    let mut s = dbtree_reduce(n, r, 0, count);
    let offset = dbtree_reduce_steps(n);
    let b = dbtree_bcast(n, r, 0, count);
    for (i, st) in b.steps.into_iter().enumerate() {
        *s.step(offset + i) = st;
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
    fn double_binary_trees_broadcast_reduce_and_allreduce() {
        check_bcast(dbtree_bcast);
        for n in SIZES {
            for count in COUNTS {
                let parts: Vec<Vec<i64>> = (0..n).map(|r| contribution(r, count)).collect();
                let want = reduce_all(&parts, ReduceOp::Sum);
                for root in [0, n - 1] {
                    let scheds: Vec<_> = (0..n).map(|r| dbtree_reduce(n, r, root, count)).collect();
                    let got = run(&scheds, parts.clone(), vec![vec![]; n], ReduceOp::Sum);
                    assert_eq!(got[root], want, "reduce n {n} count {count} root {root}");
                }
                let scheds: Vec<_> = (0..n).map(|r| dbtree_allreduce(n, r, count)).collect();
                let got = run(&scheds, parts.clone(), vec![vec![]; n], ReduceOp::Sum);
                assert!(got.iter().all(|g| *g == want), "allreduce n {n} count {count}");
            }
        }
    }

    #[test]
    fn each_tree_carries_half_and_most_leaves_of_one_are_inner_in_the_other() {
        let [a, b] = btrees(16);
        let inner_in_both =
            (1..16).filter(|&v| !a.children[v].is_empty() && !b.children[v].is_empty()).count();
        let leaves_in_both =
            (1..16).filter(|&v| a.children[v].is_empty() && b.children[v].is_empty()).count();
        assert!(inner_in_both <= 2 && leaves_in_both <= 2, "{inner_in_both} {leaves_in_both}");
        assert_eq!(dbtree_bcast(16, 0, 0, 1000).bytes_sent(1), 1000);
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
