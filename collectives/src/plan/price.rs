//! The model's prices: the schedule an algorithm gives each rank ([`schedule`]), and
//! the modelled time of all ranks' schedules on a host layout ([`price_all`]).

use std::fmt;
use std::time::Duration;

use super::{Algorithm, Costs, Op, CACHED_CALL};
use crate::hosts::Hosts;
use crate::schedule::{doubling, even_blocks, hier, linear, ring, tree, Combine, Schedule, Step, Xfer};

/// The most scratch, in bytes, a direct reduce-scatter may hold (n - 1 blocks) to be
/// offered: past it the received blocks no longer stay in cache until they are reduced,
/// and the rings, which hold one block, measured faster (4 ranks on 2 cores, 16 MiB:
/// 6.6 ms by two rings, 7.4-8.2 ms direct; at 1 MiB, 0.75 MiB of scratch, the same).
pub(crate) const DIRECT_SCRATCH: usize = 1 << 20;

/// The blocks, in bytes, for which a crowded power-of-two group allgathers by recursive
/// doubling rather than directly: the model prices one step of n - 1 messages below
/// log2(n) steps, but on a crowded host a rank's messages wait for their receivers to
/// run. 4 ranks on 2 processors, alternated runs, direct -> doubling: 4 KiB 9.0 -> 8.1
/// us, 16 KiB 11.7 -> 8.3, 64 KiB 21.0 -> 17.2, 128 KiB 38.0 -> 35.7 (medians); 256 KiB
/// 70-96 -> 50-81 (six of six runs), 512 KiB and 2 MiB faster in five of five, 1 MiB
/// in four of five, 4 MiB in four of four (804-1071 -> 756-930 us); 8 MiB alike, 16
/// MiB 3.3 -> 3.5 ms the other way; 16 B alike (a one-step call either way), and 3
/// ranks (folding first) 3.7 -> 4.7 us at 16 B.
pub(crate) const CROWDED_DOUBLING_BLOCKS: std::ops::RangeInclusive<usize> = 1024..=1 << 20;

/// Whether `alg` is offered for `op` on `hosts` with `count` elements of `elem` bytes:
/// the direct reduce-scatter only while its n - 1 blocks of scratch stay within
/// [`DIRECT_SCRATCH`]; where a host runs more ranks than it has processors, a broadcast
/// only by the trees whose ranks wait on one parent each (k-nomial, direct). There the
/// algorithms that need many ranks running at once, step after step, wait on ranks that
/// are not running, which the model does not price: 4 ranks on 2 processors broadcast
/// 1 MiB in 188-210 us by the trees, 251-297 by chain, double tree and scatter-allgather;
/// 16 MiB in 5.5-7.6 ms against 6.8-9.5; 4 MiB by chain in 4.0-4.3 ms against 0.9.
/// There a power-of-two group allgathers blocks of [`CROWDED_DOUBLING_BLOCKS`] bytes by
/// recursive doubling, not directly; elsewhere doubling is not offered (the
/// model never prices it below direct, and hysteresis would carry it up from the small
/// sizes).
fn offered(op: Op, alg: Algorithm, hosts: &Hosts, count: usize, elem: usize) -> bool {
    use Algorithm::{Chain, Direct, DoubleTree, RecursiveDoubling, ScatterAllgather, TwoLevel};
    match (op, alg) {
        (Op::ReduceScatter, Direct) => {
            let n = hosts.ranks();
            n.saturating_sub(1).saturating_mul(count).saturating_mul(elem) <= DIRECT_SCRATCH
        }
        (Op::Broadcast, Chain | ScatterAllgather | DoubleTree) => !hosts.any_crowded(),
        (Op::Allgather, Direct | RecursiveDoubling) => {
            let pow2 = hosts.ranks().is_power_of_two();
            let block = count.saturating_mul(elem);
            let doubling = hosts.any_crowded() && pow2 && CROWDED_DOUBLING_BLOCKS.contains(&block);
            doubling == (alg == RecursiveDoubling)
        }
        (_, TwoLevel) => hosts.two_level(),
        _ => true,
    }
}

/// The pipelined chain's pieces for `bytes`: 64 KiB each, from 1 to 64.
pub(crate) fn chain_segments(bytes: usize) -> usize {
    (bytes / (64 << 10)).clamp(1, 64)
}

/// The flat algorithms a two-level form runs in its phases: inside each host before the
/// leaders' phase (allreduce's reduce), between the leaders, and inside each host after
/// it (a broadcast). Inner choices are per host size, as hosts may hold different numbers
/// of ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct Phases {
    /// The reduce inside each host (allreduce only), by the host's number of ranks.
    pub before: Vec<(usize, Algorithm)>,
    /// Between the leaders, priced with the network's constants.
    pub inter: Algorithm,
    /// The broadcast inside each host, by the host's number of ranks.
    pub after: Vec<(usize, Algorithm)>,
}

impl Phases {
    /// The cheapest flat algorithm of each phase of `op`'s two-level form.
    pub fn choose(op: Op, hosts: &Hosts, root: usize, count: usize, elem: usize, c: &Costs) -> Phases {
        let mut sizes: Vec<usize> = (0..hosts.count()).map(|h| hosts.members(h).len()).collect();
        sizes.sort_unstable();
        sizes.dedup();
        // A host of m ranks alone, with the processors of the fewest-processor such host.
        let alone = |m: usize| Hosts::flat(m).with_cpus(&vec![hosts.cpus_of_size(m); m]);
        let per_size = |op: Op, count: usize| -> Vec<(usize, Algorithm)> {
            sizes.iter().map(|&m| (m, cheapest(op, &alone(m), 0, count, elem, c))).collect()
        };
        let leaders = Hosts::flat(hosts.count());
        match op {
            Op::Allreduce => Phases {
                before: per_size(Op::Reduce, count),
                inter: cheapest(Op::Allreduce, &leaders, 0, count, elem, &c.network()),
                after: per_size(Op::Broadcast, count),
            },
            Op::Allgather => Phases {
                before: Vec::new(),
                inter: Algorithm::Ring,
                after: per_size(Op::Broadcast, count * hosts.ranks()),
            },
            _ => Phases {
                before: Vec::new(),
                inter: cheapest(
                    Op::Broadcast,
                    &leaders,
                    hosts.of(root.min(hosts.ranks().max(1) - 1)),
                    count,
                    elem,
                    &c.network(),
                ),
                after: per_size(Op::Broadcast, count),
            },
        }
    }

    fn for_size(v: &[(usize, Algorithm)], m: usize) -> Algorithm {
        v.iter().find(|(k, _)| *k == m).map_or(Algorithm::Direct, |(_, a)| *a)
    }
}

impl fmt::Display for Phases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[(usize, Algorithm)]| {
            let mut a: Vec<String> = v.iter().map(|(_, a)| a.to_string()).collect();
            a.dedup();
            a.join("/")
        };
        if !self.before.is_empty() {
            write!(f, "reduce {} inside hosts, ", list(&self.before))?;
        }
        write!(f, "{} between hosts, broadcast {} inside hosts", self.inter, list(&self.after))
    }
}

/// The cheapest flat algorithm for `op` (no hysteresis: for a phase of a two-level form).
fn cheapest(op: Op, hosts: &Hosts, root: usize, count: usize, elem: usize, c: &Costs) -> Algorithm {
    op.candidates()
        .iter()
        .filter(|&&a| a != Algorithm::TwoLevel && offered(op, a, hosts, count, elem))
        .map(|&a| (a, price_all(op, a, hosts, root, count, elem, c)))
        .min_by_key(|(_, t)| *t)
        .map_or(Algorithm::Direct, |(a, _)| a)
}

/// The schedule of `alg` running `op` on rank `r` of the ranks `hosts` lays out, for
/// `count` elements (per rank's block where the operation has blocks) with `root`; a
/// two-level algorithm runs `phases` (chosen here when None).
#[allow(clippy::too_many_arguments)]
pub(crate) fn schedule(
    op: Op,
    alg: Algorithm,
    hosts: &Hosts,
    r: usize,
    root: usize,
    count: usize,
    elem: usize,
    phases: Option<&Phases>,
    c: &Costs,
) -> Schedule {
    let n = hosts.ranks();
    if alg != Algorithm::TwoLevel {
        return flat(op, alg, n, r, root, count, elem);
    }
    let chosen;
    let p = match phases {
        Some(p) => p,
        None => {
            chosen = Phases::choose(op, hosts, root, count, elem, c);
            &chosen
        }
    };
    let inter = |l: usize, i: usize, root: usize| flat(op, p.inter, l, i, root, count, elem);
    let reduce = |m: usize, i: usize, root: usize| {
        flat(Op::Reduce, Phases::for_size(&p.before, m), m, i, root, count, elem)
    };
    let bcast_of = |total: usize| {
        move |m: usize, i: usize, root: usize| {
            flat(Op::Broadcast, Phases::for_size(&p.after, m), m, i, root, total, elem)
        }
    };
    match op {
        Op::Allreduce => hier::allreduce(hosts, r, &reduce, &inter, &bcast_of(count)),
        Op::Allgather => hier::allgather(hosts, r, &even_blocks(count * n, n), &bcast_of(count * n)),
        _ => hier::broadcast(hosts, r, root, &inter, &bcast_of(count)),
    }
}

/// The bytes a rank holds in a call of `op` on `n` ranks that the planner knows by
/// `count` elements of `elem` bytes: a block for the operations cut in blocks (`count`
/// each), the whole vector for the others.
fn call_bytes(op: Op, n: usize, count: usize, elem: usize) -> usize {
    let blocks = matches!(op, Op::Allgather | Op::ReduceScatter | Op::Gather | Op::Scatter | Op::Alltoall);
    count.saturating_mul(if blocks { n } else { 1 }).saturating_mul(elem)
}

/// The schedule of a flat algorithm on rank `r` of `n`.
fn flat(op: Op, alg: Algorithm, n: usize, r: usize, root: usize, count: usize, elem: usize) -> Schedule {
    match (op, alg) {
        (Op::Allreduce, Algorithm::RecursiveDoubling) => doubling::allreduce(n, r, count),
        (Op::Allreduce, Algorithm::Rabenseifner) => doubling::rabenseifner(n, r, count),
        (Op::Allreduce, Algorithm::DoubleTree) => tree::dbtree_allreduce(n, r, count),
        (Op::Allreduce, _) => ring::allreduce(n, r, &even_blocks(count, n)),
        (Op::Broadcast, Algorithm::Knomial(k)) => tree::knomial_bcast(n, r, root, count, k.into()),
        (Op::Broadcast, Algorithm::Direct) => tree::direct_bcast(n, r, root, count),
        (Op::Broadcast, Algorithm::DoubleTree) => tree::dbtree_bcast(n, r, root, count),
        (Op::Broadcast, Algorithm::Chain) => {
            tree::chain_bcast(n, r, root, count, chain_segments(count * elem))
        }
        (Op::Broadcast, _) => tree::scatter_allgather_bcast(n, r, root, count),
        (Op::Reduce, Algorithm::Knomial(k)) => tree::knomial_reduce(n, r, root, count, k.into()),
        (Op::Reduce, Algorithm::DoubleTree) => tree::dbtree_reduce(n, r, root, count),
        (Op::Reduce, _) => tree::knomial_reduce(n, r, root, count, n.max(2)),
        (Op::Allgather, Algorithm::Direct) => linear::direct_allgather(n, r, &even_blocks(count * n, n)),
        (Op::Allgather, Algorithm::RecursiveDoubling) => {
            doubling::allgather(n, r, &even_blocks(count * n, n))
        }
        (Op::Allgather, _) => ring::allgather(n, r, &even_blocks(count * n, n)),
        (Op::ReduceScatter, Algorithm::RingBidir) => {
            ring::reduce_scatter_bidir(n, r, &even_blocks(count * n, n))
        }
        (Op::ReduceScatter, Algorithm::Direct) => {
            linear::direct_reduce_scatter(n, r, &even_blocks(count * n, n))
        }
        (Op::ReduceScatter, _) => ring::reduce_scatter(n, r, &even_blocks(count * n, n)),
        (Op::Gather, _) => linear::gather(n, r, root, &even_blocks(count * n, n)),
        (Op::Scatter, _) => linear::scatter(n, r, root, &even_blocks(count * n, n)),
        (Op::Alltoall, Algorithm::Bruck) => linear::bruck_alltoall(n, r, count),
        (Op::Alltoall, Algorithm::Direct) => {
            let b = even_blocks(count * n, n);
            linear::direct_alltoall(n, r, &b, &b)
        }
        (Op::Alltoall, _) => {
            let b = even_blocks(count * n, n);
            linear::pairwise_alltoall(n, r, &b, &b)
        }
        (Op::Barrier, Algorithm::Knomial(k)) => doubling::knomial_barrier(n, r, k.into()),
        (Op::Barrier, _) => doubling::barrier(n, r),
        (Op::Scan, _) => doubling::scan(n, r, count, false),
    }
}

/// Every candidate of `op` [`offered`] on `hosts`, with its modelled time.
pub(crate) fn candidates(
    op: Op,
    hosts: &Hosts,
    root: usize,
    count: usize,
    elem: usize,
    c: &Costs,
) -> Vec<(Algorithm, Duration)> {
    op.candidates()
        .iter()
        .filter(|&&a| offered(op, a, hosts, count, elem))
        .map(|&a| (a, price_all(op, a, hosts, root, count, elem, c)))
        .collect()
}

/// The modelled time of `alg` running `op` on the ranks `hosts` lays out: the ranks
/// move in lockstep (a step waits for its messages), so each step costs what it costs
/// its busiest rank or host link, and steps in which a rank is idle still take the
/// others' time. Calls of up to [`CACHED_CALL`] bytes a rank reduce at the cache's rate.
pub fn price_all(
    op: Op,
    alg: Algorithm,
    hosts: &Hosts,
    root: usize,
    count: usize,
    elem: usize,
    c: &Costs,
) -> Duration {
    let in_cache;
    let c = if call_bytes(op, hosts.ranks(), count, elem) <= CACHED_CALL {
        in_cache = Costs { reduce_rate: c.cached_reduce_rate, ..*c };
        &in_cache
    } else {
        c
    };
    let phases = (alg == Algorithm::TwoLevel).then(|| Phases::choose(op, hosts, root, count, elem, c));
    let scheds: Vec<Schedule> = (0..hosts.ranks())
        .map(|r| schedule(op, alg, hosts, r, root, count, elem, phases.as_ref(), c))
        .collect();
    let steps = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
    let mut links = vec![(0usize, 0usize); hosts.count()];
    let mut t = 0.0;
    for i in 0..steps {
        links.fill((0, 0));
        let mut worst: f64 = 0.0;
        for (r, s) in scheds.iter().enumerate() {
            if let Some(st) = s.steps.get(i) {
                worst = worst.max(rank_step(st, r, hosts, elem, c, &mut links[hosts.of(r)]));
            }
        }
        for &(out, inn) in &links {
            if out + inn > 0 {
                worst = worst.max(c.net_latency.as_secs_f64() + out.max(inn) as f64 / c.net_bandwidth);
            }
        }
        t += worst;
    }
    Duration::from_secs_f64(t)
}

/// The modelled time, in seconds, of rank `r`'s step `st` but for its bytes to other
/// hosts, which it adds to its host's network link (`link`: bytes out, bytes in).
fn rank_step(st: &Step, r: usize, hosts: &Hosts, elem: usize, c: &Costs, link: &mut (usize, usize)) -> f64 {
    let (mut out, mut inn, mut largest, mut local, mut remote) = (0usize, 0usize, 0usize, false, false);
    for x in &st.xfers {
        let (peer, bytes, sent) = match x {
            Xfer::Send { peer, from } => (*peer, from.len() * elem, true),
            Xfer::Recv { peer, into } => (*peer, into.len() * elem, false),
        };
        let (o, i) = if hosts.same(r, peer) {
            local = true;
            largest = largest.max(bytes);
            (&mut out, &mut inn)
        } else {
            remote = true;
            (&mut link.0, &mut link.1)
        };
        *if sent { o } else { i } += bytes;
    }
    let reduced: usize = st
        .combines
        .iter()
        .map(|c| match c {
            Combine::Reduce { from, .. } => from.len() * elem,
            Combine::Copy { .. } => 0,
        })
        .sum();
    let reduce = reduced as f64 / c.reduce_rate;
    let mut t = out.max(inn) as f64 / c.bandwidth + reduce;
    if local {
        let l = if largest >= c.rndv_threshold { c.rndv_latency } else { c.latency };
        t += l.as_secs_f64();
    }
    if remote {
        t = t.max(c.net_latency.as_secs_f64() + reduce);
    }
    t
}
