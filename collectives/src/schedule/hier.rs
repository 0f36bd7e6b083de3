//! Two-level schedules for ranks spread over several hosts ([`Hosts`]): phases inside
//! each host (shared memory) around one phase among one leader per host (the network),
//! so that each host's data crosses the network once. Each phase is a flat schedule run
//! by a subset of the ranks, renumbered; the phases are laid end to end at the same step
//! numbers on every rank (a phase takes as many steps as its longest member needs), so
//! messages of different phases never match.
//!
//! The flat schedules of each phase come from the caller ([`Sub`]), which picks them
//! (the planner prices the inner phases with the host's costs and the leaders' phase
//! with the network's).

use std::ops::Range;

use super::{ring, Buf, Combine, Region, Schedule, Step, Xfer};
use crate::hosts::Hosts;

/// A flat schedule of a phase: `(ranks, rank, root)` to that rank's schedule.
pub type Sub<'a> = dyn Fn(usize, usize, usize) -> Schedule + 'a;

/// `r`'s position among its host's ranks.
fn local_rank(hosts: &Hosts, r: usize) -> usize {
    hosts.members(hosts.of(r)).iter().position(|&x| x == r).unwrap_or_default()
}

/// The steps the longest schedule `f(m, i, root(h))` of a host's rank takes, over every
/// host (`m` its ranks).
fn intra_len(hosts: &Hosts, f: &Sub<'_>, root: &dyn Fn(usize) -> usize) -> usize {
    (0..hosts.count())
        .flat_map(|h| {
            let m = hosts.members(h).len();
            (0..m).map(move |i| (m, i, root(h)))
        })
        .map(|(m, i, root)| f(m, i, root).steps.len())
        .max()
        .unwrap_or(0)
}

/// The steps the longest leader's schedule `f(hosts, i, root)` takes.
fn inter_len(hosts: &Hosts, f: &Sub<'_>, root: usize) -> usize {
    let l = hosts.count();
    (0..l).map(|i| f(l, i, root).steps.len()).max().unwrap_or(0)
}

/// Lays `sub`, a flat schedule over `members` (its rank i being `members[i]`), into `s`
/// from step `at`, its regions moved by `map`.
fn embed(s: &mut Schedule, at: usize, sub: Schedule, members: &[usize], map: &dyn Fn(Region) -> Region) {
    for (i, st) in sub.steps.into_iter().enumerate() {
        let Step { copies, xfers, combines } = st;
        let dst = s.step(at + i);
        dst.copies.extend(copies.into_iter().map(|(a, b)| (map(a), map(b))));
        dst.xfers.extend(xfers.into_iter().map(|x| match x {
            Xfer::Send { peer, from } => Xfer::Send { peer: members[peer], from: map(from) },
            Xfer::Recv { peer, into } => Xfer::Recv { peer: members[peer], into: map(into) },
        }));
        dst.combines.extend(combines.into_iter().map(|c| match c {
            Combine::Copy { from, into } => Combine::Copy { from: map(from), into: map(into) },
            Combine::Reduce { from, into } => Combine::Reduce { from: map(from), into: map(into) },
        }));
    }
    let end = map(Region::scratch(0..sub.scratch)).range.end;
    if sub.scratch > 0 {
        s.reserve_scratch(end);
    }
}

fn same(r: Region) -> Region {
    r
}

/// Allreduce: each host reduces to its first rank (`reduce`), the leaders allreduce
/// (`inter`), and each leader broadcasts the result to its host (`bcast`).
pub fn allreduce(hosts: &Hosts, r: usize, reduce: &Sub<'_>, inter: &Sub<'_>, bcast: &Sub<'_>) -> Schedule {
    let (h, lr) = (hosts.of(r), local_rank(hosts, r));
    let members = hosts.members(h);
    let m = members.len();
    let leaders: Vec<usize> = (0..hosts.count()).map(|h| hosts.members(h)[0]).collect();
    let p1 = intra_len(hosts, reduce, &|_| 0);
    let p2 = inter_len(hosts, inter, 0);
    let mut s = Schedule::default();
    embed(&mut s, 0, reduce(m, lr, 0), members, &same);
    if lr == 0 {
        embed(&mut s, p1, inter(hosts.count(), h, 0), &leaders, &same);
    }
    embed(&mut s, p1 + p2, bcast(m, lr, 0), members, &same);
    s
}

/// Each host's leader for an operation rooted at `root`: the root on its own host, the
/// first rank elsewhere.
fn leaders_for(hosts: &Hosts, root: usize) -> Vec<usize> {
    (0..hosts.count()).map(|h| if hosts.of(root) == h { root } else { hosts.members(h)[0] }).collect()
}

/// Broadcast from `root`: the leaders (the root leading its host) broadcast among
/// themselves (`inter`), then each leader to its host (`bcast`).
pub fn broadcast(hosts: &Hosts, r: usize, root: usize, inter: &Sub<'_>, bcast: &Sub<'_>) -> Schedule {
    let (h, lr) = (hosts.of(r), local_rank(hosts, r));
    let members = hosts.members(h);
    let leaders = leaders_for(hosts, root);
    let leader_pos = |h: usize| local_rank(hosts, leaders[h]);
    let p1 = inter_len(hosts, inter, hosts.of(root));
    let mut s = Schedule::default();
    if r == leaders[h] {
        embed(&mut s, 0, inter(hosts.count(), h, hosts.of(root)), &leaders, &same);
    }
    embed(&mut s, p1, bcast(members.len(), lr, leader_pos(h)), members, &same);
    s
}

/// Allgather of the data buffer's `blocks` (rank i's is `blocks[i]`): each host gathers
/// its blocks at its leader, in scratch, where blocks lie host by host; the leaders allgather the hosts' runs, each leader broadcasts the whole to its
/// host (`bcast`, over `total` elements), and every rank copies the blocks back into
/// place.
pub fn allgather(hosts: &Hosts, r: usize, blocks: &[Range<usize>], bcast: &Sub<'_>) -> Schedule {
    let (h, lr) = (hosts.of(r), local_rank(hosts, r));
    let members = hosts.members(h);
    let leaders: Vec<usize> = (0..hosts.count()).map(|h| hosts.members(h)[0]).collect();
    // Where each rank's block lies in scratch, and each host's run.
    let mut packed = vec![0..0; blocks.len()];
    let mut runs = Vec::with_capacity(hosts.count());
    let mut at = 0;
    for g in 0..hosts.count() {
        let start = at;
        for &q in hosts.members(g) {
            packed[q] = at..at + blocks[q].len();
            at += blocks[q].len();
        }
        runs.push(start..at);
    }
    let total = at;
    // Data regions of the phases are the scratch runs; their own scratch lies after.
    let to_scratch = move |x: Region| match x.buf {
        Buf::Data => Region::scratch(x.range),
        Buf::Scratch => Region::scratch(x.range.start + total..x.range.end + total),
        Buf::Input => x,
    };
    // Each host gathers its blocks at its leader: one step.
    let p1 = usize::from((0..hosts.count()).any(|g| hosts.members(g).len() > 1));
    let p2 =
        (0..hosts.count()).map(|i| ring::allgather(hosts.count(), i, &runs).steps.len()).max().unwrap_or(0);
    let p3 = intra_len(hosts, bcast, &|_| 0);
    let mut s = Schedule::default();
    s.reserve_scratch(total);
    if lr == 0 {
        s.copy_before(0, Region::data(blocks[r].clone()), Region::scratch(packed[r].clone()));
        for &q in &members[1..] {
            s.recv(0, q, Region::scratch(packed[q].clone()));
        }
    } else {
        s.send(0, members[0], Region::data(blocks[r].clone()));
    }
    if lr == 0 {
        embed(&mut s, p1, ring::allgather(hosts.count(), h, &runs), &leaders, &to_scratch);
    }
    embed(&mut s, p1 + p2, bcast(members.len(), lr, 0), members, &to_scratch);
    let last = (p1 + p2 + p3).max(1) - 1;
    for (q, b) in blocks.iter().enumerate() {
        if q != r && !b.is_empty() {
            let c = Combine::Copy { from: Region::scratch(packed[q].clone()), into: Region::data(b.clone()) };
            s.combine_after(last, c);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::sim::{allgathers, contribution, reduce_all, run};
    use crate::schedule::{blocks_of, doubling, tree};
    use crate::ReduceOp;

    /// Layouts: contiguous, interleaved, uneven, a lone rank, three hosts.
    fn layouts() -> Vec<Hosts> {
        [
            &[0, 0, 1, 1][..],
            &[0, 1, 0, 1],
            &[0, 0, 0, 1, 1],
            &[0, 1, 1, 1],
            &[2, 0, 1, 2, 0, 1, 2],
            &[5, 5, 5],
        ]
        .iter()
        .map(|k| Hosts::from_keys(k))
        .collect()
    }

    #[test]
    fn two_level_allreduce_matches_the_reference() {
        for hosts in layouts() {
            let n = hosts.ranks();
            for count in [0, 1, 7, 100] {
                let reduce = |m, i, root| tree::knomial_reduce(m, i, root, count, 2);
                let inter = |l, i, _| doubling::allreduce(l, i, count);
                let inter_ring = |l, i, _| ring::allreduce(l, i, &crate::schedule::even_blocks(count, l));
                let bcast = |m, i, root| tree::knomial_bcast(m, i, root, count, 3);
                for inter in [&inter as &Sub<'_>, &inter_ring] {
                    let scheds: Vec<_> =
                        (0..n).map(|r| allreduce(&hosts, r, &reduce, inter, &bcast)).collect();
                    let parts: Vec<Vec<u32>> = (0..n).map(|r| contribution(r, count)).collect();
                    let want = reduce_all(&parts, ReduceOp::Sum);
                    let got = run(&scheds, parts, vec![vec![]; n], ReduceOp::Sum);
                    assert!(got.iter().all(|g| *g == want), "{hosts:?} count {count}");
                }
            }
        }
    }

    #[test]
    fn two_level_broadcast_reaches_every_rank_from_every_root() {
        for hosts in layouts() {
            let n = hosts.ranks();
            for count in [0, 1, 9] {
                let inter = |l, i, root| tree::knomial_bcast(l, i, root, count, 2);
                let bcast = |m, i, root| tree::direct_bcast(m, i, root, count);
                for root in 0..n {
                    let scheds: Vec<_> = (0..n).map(|r| broadcast(&hosts, r, root, &inter, &bcast)).collect();
                    let want: Vec<i16> = contribution(root, count);
                    let data =
                        (0..n).map(|r| if r == root { want.clone() } else { vec![0; count] }).collect();
                    let got = run(&scheds, data, vec![vec![]; n], ReduceOp::Sum);
                    assert!(got.iter().all(|g| *g == want), "{hosts:?} root {root} count {count}");
                }
            }
        }
    }

    #[test]
    fn two_level_allgather_fills_every_block() {
        for hosts in layouts() {
            let n = hosts.ranks();
            for lens in [vec![3; n], (0..n).map(|i| i % 3).collect()] {
                let blocks = blocks_of(&lens);
                let total = blocks.last().map_or(0, |b| b.end);
                let bcast = |m, i, root| tree::knomial_bcast(m, i, root, total, 2);
                let scheds: Vec<_> = (0..n).map(|r| allgather(&hosts, r, &blocks, &bcast)).collect();
                assert!(allgathers(&scheds, &blocks), "{hosts:?} lens {lens:?}");
            }
        }
    }

    #[test]
    fn only_leaders_cross_hosts() {
        let hosts = Hosts::from_keys(&[0, 1, 0, 1, 0, 1]);
        let count = 10;
        let reduce = |m, i, root| tree::knomial_reduce(m, i, root, count, 2);
        let inter = |l, i, _| doubling::allreduce(l, i, count);
        let bcast = |m, i, root| tree::knomial_bcast(m, i, root, count, 2);
        for r in 0..6 {
            let s = allreduce(&hosts, r, &reduce, &inter, &bcast);
            for x in s.steps.iter().flat_map(|st| &st.xfers) {
                let peer = match x {
                    Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => *peer,
                };
                assert!(hosts.same(r, peer) || r < 2, "rank {r} talks to {peer} on another host");
            }
        }
    }
}
