//! Which algorithm runs a collective: every candidate's schedule is priced with a cost
//! model, as NCCL does, and the cheapest wins:
//!
//! time = Σ over steps (latency + max(bytes sent, bytes received) / bandwidth
//!        + bytes reduced / reduction rate),
//!
//! taken over the slowest rank, where a step ends when its busiest rank's messages have
//! moved. Messages between hosts ([`Hosts`]) pay the network's latency, and each host's
//! ranks share its network bandwidth. The constants ([`Costs`]) are the communicator's, the
//! same on every rank, so every rank picks the same algorithm. A switch between two
//! algorithms needs the new one to win by a margin ([`HYSTERESIS`]) over the choice for
//! the neighbouring smaller size, so that noise in the constants does not make the
//! choice flip back and forth between sizes. [`Plan`] says what was chosen and why; a
//! choice can be forced per communicator ([`crate::Options::algorithm`]) or by the
//! environment ([`ENV`]).

use std::fmt;
use std::time::Duration;

use crate::hosts::Hosts;

mod costs;
mod price;

pub use costs::{Costs, CACHED_CALL, COSTS_ENV};
pub(crate) use price::schedule;
pub use price::{price_all, Phases};

/// The environment variable that forces algorithms: a comma-separated list of
/// `operation=algorithm`, for example `allreduce=ring,broadcast=knomial:4`. Operations
/// and algorithms are named as [`Op`] and [`Algorithm`] print them.
pub const ENV: &str = "UCXKIT_COLL_ALGO";

/// A collective operation, as the planner knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Op {
    Allreduce,
    Broadcast,
    Reduce,
    Allgather,
    ReduceScatter,
    Gather,
    Scatter,
    Alltoall,
    Barrier,
    Scan,
}

impl Op {
    /// Every operation.
    pub const ALL: [Op; 10] = [
        Op::Allreduce,
        Op::Broadcast,
        Op::Reduce,
        Op::Allgather,
        Op::ReduceScatter,
        Op::Gather,
        Op::Scatter,
        Op::Alltoall,
        Op::Barrier,
        Op::Scan,
    ];

    /// Its name (`allreduce`, `reduce_scatter`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Allreduce => "allreduce",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::Allgather => "allgather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
            Op::Alltoall => "alltoall",
            Op::Barrier => "barrier",
            Op::Scan => "scan",
        }
    }

    /// The algorithms that can run it.
    pub fn candidates(self) -> &'static [Algorithm] {
        use Algorithm::*;
        match self {
            Op::Allreduce => &[RecursiveDoubling, Rabenseifner, Ring, DoubleTree, TwoLevel],
            Op::Broadcast => &[Knomial(2), Knomial(4), Direct, Chain, ScatterAllgather, DoubleTree, TwoLevel],
            Op::Reduce => &[Knomial(2), Knomial(4), Direct, DoubleTree],
            Op::Allgather => &[Ring, Direct, RecursiveDoubling, TwoLevel],
            Op::ReduceScatter => &[Ring, RingBidir, Direct],
            Op::Gather | Op::Scatter => &[Direct],
            Op::Alltoall => &[Direct, Pairwise, Bruck],
            Op::Barrier => &[Dissemination, Knomial(4)],
            Op::Scan => &[RecursiveDoubling],
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Op {
    type Err = String;
    fn from_str(s: &str) -> Result<Op, String> {
        Op::ALL.into_iter().find(|o| o.name() == s).ok_or_else(|| format!("unknown operation {s:?}"))
    }
}

/// An algorithm (see [`crate::schedule`] for each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Ring: reduce-scatter and allgather around the ring.
    Ring,
    /// Two rings in opposite directions (reduce-scatter).
    RingBidir,
    /// Recursive doubling (allreduce, scan).
    RecursiveDoubling,
    /// Recursive halving then doubling (allreduce).
    Rabenseifner,
    /// A k-nomial tree of the given radix (broadcast, reduce).
    Knomial(u8),
    /// The root talks to every rank at once (broadcast, reduce, gather, scatter); every
    /// rank to every other at once (allgather, reduce-scatter, all-to-all).
    Direct,
    /// Pipelined chain (broadcast).
    Chain,
    /// Binomial scatter then ring allgather (broadcast).
    ScatterAllgather,
    /// Two binary trees, each carrying half (broadcast, reduce, allreduce).
    DoubleTree,
    /// Pairwise exchange (all-to-all).
    Pairwise,
    /// Bruck's log-step exchange (all-to-all).
    Bruck,
    /// Dissemination (barrier).
    Dissemination,
    /// Inside each host, then among one leader per host, then inside each host again
    /// (allreduce, broadcast, allgather; see [`crate::schedule::hier`]).
    TwoLevel,
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Algorithm::Ring => f.write_str("ring"),
            Algorithm::RingBidir => f.write_str("ring2"),
            Algorithm::RecursiveDoubling => f.write_str("doubling"),
            Algorithm::Rabenseifner => f.write_str("rabenseifner"),
            Algorithm::Knomial(k) => write!(f, "knomial:{k}"),
            Algorithm::Direct => f.write_str("direct"),
            Algorithm::Chain => f.write_str("chain"),
            Algorithm::ScatterAllgather => f.write_str("scatter_allgather"),
            Algorithm::DoubleTree => f.write_str("dbtree"),
            Algorithm::Pairwise => f.write_str("pairwise"),
            Algorithm::Bruck => f.write_str("bruck"),
            Algorithm::Dissemination => f.write_str("dissemination"),
            Algorithm::TwoLevel => f.write_str("two_level"),
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Algorithm, String> {
        Ok(match s {
            "ring" => Algorithm::Ring,
            "ring2" => Algorithm::RingBidir,
            "doubling" => Algorithm::RecursiveDoubling,
            "rabenseifner" => Algorithm::Rabenseifner,
            "direct" => Algorithm::Direct,
            "chain" => Algorithm::Chain,
            "scatter_allgather" => Algorithm::ScatterAllgather,
            "dbtree" => Algorithm::DoubleTree,
            "pairwise" => Algorithm::Pairwise,
            "bruck" => Algorithm::Bruck,
            "dissemination" => Algorithm::Dissemination,
            "two_level" => Algorithm::TwoLevel,
            _ => match s.strip_prefix("knomial:").map(str::parse::<u8>) {
                Some(Ok(k)) if k >= 2 => Algorithm::Knomial(k),
                _ => {
                    return Err(format!(
                        "unknown algorithm {s:?} (knomial takes a radix of 2 or more: knomial:4)"
                    ))
                }
            },
        })
    }
}

/// Parses [`ENV`]'s syntax: `op=algorithm,...`.
pub fn parse_forced(spec: &str) -> Result<Vec<(Op, Algorithm)>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (op, alg) = p.split_once('=').ok_or_else(|| format!("{p:?} is not op=algorithm"))?;
            let (op, alg): (Op, Algorithm) = (op.trim().parse()?, alg.trim().parse()?);
            if !op.candidates().iter().any(|c| std::mem::discriminant(c) == std::mem::discriminant(&alg)) {
                return Err(format!("{alg} cannot run {op}"));
            }
            Ok((op, alg))
        })
        .collect()
}

/// How much better (as a fraction) an algorithm must price than the choice for half the
/// size before the choice changes.
pub const HYSTERESIS: f64 = 0.10;

/// What the planner chose for one call, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The operation.
    pub op: Op,
    /// Bytes per rank the plan was made for.
    pub bytes: usize,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Forced (by the communicator's options or [`ENV`]) rather than chosen.
    pub forced: bool,
    /// Every candidate with its modelled time.
    pub priced: Vec<(Algorithm, Duration)>,
    /// For a two-level algorithm, the algorithms of its phases.
    pub phases: Option<Phases>,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {} B: {}", self.op, self.bytes, self.algorithm)?;
        if let Some(p) = &self.phases {
            write!(f, " [{p}]")?;
        }
        if self.forced {
            return f.write_str(" (forced)");
        }
        f.write_str(" (modelled:")?;
        for (a, t) in &self.priced {
            write!(f, " {a} {:.2} us", t.as_secs_f64() * 1e6)?;
        }
        f.write_str(")")
    }
}

/// Chooses the algorithm for `op` of `count` elements of `elem` bytes on the ranks
/// `hosts` lays out. Two-level algorithms compete only where ranks span hosts and share
/// some ([`Hosts::two_level`]).
pub fn choose(op: Op, hosts: &Hosts, root: usize, count: usize, elem: usize, c: &Costs) -> Plan {
    let priced = price::candidates(op, hosts, root, count, elem, c);
    let best = priced.iter().min_by_key(|(_, t)| *t).map(|(a, _)| *a).unwrap_or(Algorithm::Direct);
    // Hysteresis: keep the choice for half the size unless the best beats it clearly.
    let algorithm = if count > 1 {
        let smaller = choose(op, hosts, root, count / 2, elem, c).algorithm;
        let t = |a: Algorithm| priced.iter().find(|(x, _)| *x == a).map(|(_, t)| t.as_secs_f64());
        match (t(smaller), t(best)) {
            (Some(ts), Some(tb)) if tb >= ts * (1.0 - HYSTERESIS) => smaller,
            _ => best,
        }
    } else {
        best
    };
    let phases = (algorithm == Algorithm::TwoLevel).then(|| Phases::choose(op, hosts, root, count, elem, c));
    Plan { op, bytes: count * elem, algorithm, forced: false, priced, phases }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_allreduces_double_and_large_ones_halve_or_ring() {
        let c = Costs::default();
        let flat = Hosts::flat;
        assert_eq!(choose(Op::Allreduce, &flat(8), 0, 2, 4, &c).algorithm, Algorithm::RecursiveDoubling);
        // Large: halving-doubling moves what the ring moves in fewer steps on a power of
        // two; elsewhere its fold costs a whole vector more.
        assert_eq!(choose(Op::Allreduce, &flat(8), 0, 4 << 20, 4, &c).algorithm, Algorithm::Rabenseifner);
        assert_eq!(choose(Op::Allreduce, &flat(6), 0, 4 << 20, 4, &c).algorithm, Algorithm::Ring);
        let p = choose(Op::Broadcast, &flat(3), 0, 2, 4, &c);
        assert!(p.to_string().starts_with("broadcast of 8 B: "), "{p}");
        // Two-level forms compete only across hosts.
        assert_eq!(p.priced.len(), Op::Broadcast.candidates().len() - 1);
    }

    #[test]
    fn hosts_interleaved_over_the_network_go_two_level() {
        let c = Costs::default();
        // Six ranks dealt round-robin to two hosts: every step of a flat ring crosses the
        // network, where the two-level forms cross it once per host. (On 8 ranks halving
        // and doubling keeps its large steps inside the hosts, and wins.)
        let hosts = Hosts::from_keys(&[0, 1, 0, 1, 0, 1]);
        for op in [Op::Allreduce, Op::Broadcast, Op::Allgather] {
            let p = choose(op, &hosts, 0, 1 << 20, 4, &c);
            assert_eq!(p.algorithm, Algorithm::TwoLevel, "{p}");
            assert!(p.to_string().contains("between hosts"), "{p}");
        }
        // Within one host nothing changes.
        let one = choose(Op::Allreduce, &Hosts::flat(8), 0, 1 << 20, 4, &c);
        assert_ne!(one.algorithm, Algorithm::TwoLevel);
        // A message to another host costs the network's latency.
        let split = Hosts::from_keys(&[0, 1]);
        let t = |h: &Hosts| price_all(Op::Allreduce, Algorithm::RecursiveDoubling, h, 0, 1, 4, &c);
        assert!(t(&split) > t(&Hosts::flat(2)) * 10);
    }

    /// Where a host runs more ranks than it has processors, a broadcast is offered only
    /// by the k-nomial and direct trees; the same layout with enough processors (or
    /// unknown counts) is offered every candidate.
    #[test]
    fn crowded_hosts_broadcast_by_trees() {
        let c = Costs::default();
        let offered = |h: &Hosts, count: usize| -> Vec<Algorithm> {
            choose(Op::Broadcast, h, 0, count, 4, &c).priced.iter().map(|(a, _)| *a).collect()
        };
        let crowded = Hosts::flat(4).with_cpus(&[2; 4]);
        let trees = [Algorithm::Knomial(2), Algorithm::Knomial(4), Algorithm::Direct];
        for count in [2, 16 << 10, 256 << 10, 4 << 20] {
            assert_eq!(offered(&crowded, count), trees, "{count} elements");
            let all = Op::Broadcast.candidates().len() - 1;
            assert_eq!(offered(&Hosts::flat(4), count).len(), all);
            assert_eq!(offered(&Hosts::flat(4).with_cpus(&[4; 4]), count).len(), all);
        }
        // Allreduce keeps its candidates.
        let ar = |h: &Hosts| choose(Op::Allreduce, h, 0, 4 << 20, 4, &c).priced.len();
        assert_eq!(ar(&crowded), ar(&Hosts::flat(4)));
        // Two hosts, one crowded: the crowded one's phase inside a host is no chain
        // either.
        let two = Hosts::from_keys(&[0, 0, 0, 1, 1, 1]).with_cpus(&[2, 2, 2, 2, 2, 2]);
        let p = Phases::choose(Op::Broadcast, &two, 0, 4 << 20, 4, &c);
        assert!(p.after.iter().all(|(_, a)| *a != Algorithm::Chain), "{p}");
        let free = Phases::choose(Op::Broadcast, &Hosts::from_keys(&[0, 0, 0, 1, 1, 1]), 0, 4 << 20, 4, &c);
        assert!(free.after.iter().any(|(_, a)| *a == Algorithm::Chain), "{free}");
    }

    /// Which algorithm allgathers, by host layout and block size (4-byte elements).
    #[test]
    fn crowded_power_of_two_groups_allgather_mid_size_blocks_by_doubling() {
        let c = Costs::default();
        let crowded = |n: usize| Hosts::flat(n).with_cpus(&vec![2; n]);
        let cases = [
            (crowded(4), 256, Algorithm::RecursiveDoubling),
            (crowded(4), 8 << 10, Algorithm::RecursiveDoubling),
            (crowded(8), 256, Algorithm::RecursiveDoubling),
            (crowded(4), 4, Algorithm::Direct),
            (crowded(4), 16 << 10, Algorithm::RecursiveDoubling),
            (crowded(4), 256 << 10, Algorithm::RecursiveDoubling),
            (crowded(4), 512 << 10, Algorithm::Direct),
            (crowded(4), 4 << 20, Algorithm::Direct),
            (crowded(3), 4, Algorithm::Direct),
            (Hosts::flat(4), 4, Algorithm::Direct),
            (Hosts::flat(4).with_cpus(&[4; 4]), 8 << 10, Algorithm::Direct),
        ];
        for (hosts, count, want) in cases {
            let p = choose(Op::Allgather, &hosts, 0, count, 4, &c);
            assert_eq!(p.algorithm, want, "{} ranks, {count} elements: {p}", hosts.ranks());
        }
    }

    /// Two ranks on two processors (4-byte elements): messages of up to 64 KiB go
    /// eagerly, so nothing splits them to dodge the rendezvous; allreduce halves its
    /// data (Rabenseifner) only past the cache's size, where reducing it costs more than
    /// a step.
    #[test]
    fn two_ranks_split_messages_only_where_it_pays() {
        let c = Costs::default();
        let two = Hosts::flat(2).with_cpus(&[2; 2]);
        let cases = [
            (Op::Broadcast, 2 << 10, Algorithm::Knomial(2)),
            (Op::Broadcast, 16 << 10, Algorithm::Knomial(2)),
            (Op::Reduce, 2 << 10, Algorithm::Knomial(2)),
            (Op::Allreduce, 2 << 10, Algorithm::RecursiveDoubling),
            (Op::Allreduce, 16 << 10, Algorithm::RecursiveDoubling),
            (Op::Allreduce, 32 << 10, Algorithm::RecursiveDoubling),
            (Op::Allreduce, 64 << 10, Algorithm::Rabenseifner),
            (Op::Allreduce, 256 << 10, Algorithm::Rabenseifner),
        ];
        for (op, count, want) in cases {
            let p = choose(op, &two, 0, count, 4, &c);
            assert_eq!(p.algorithm, want, "{count} elements: {p}");
        }
    }

    /// The cache's reduction rate prices calls of up to `CACHED_CALL` bytes a rank, all
    /// of the call counted: a reduce-scatter's blocks times the ranks.
    #[test]
    fn reductions_are_priced_at_the_cache_rate_by_the_whole_call() {
        let c = Costs::default();
        let fast = Costs { cached_reduce_rate: 1e15, ..c };
        let four = Hosts::flat(4);
        let price = |op, count, c: &Costs| price_all(op, Algorithm::Ring, &four, 0, count, 4, c);
        let k = 1024;
        // (operation, elements as the planner counts them, in the cache)
        let cases = [
            (Op::Allreduce, 32 * k, true),
            (Op::Allreduce, 64 * k, false),
            (Op::ReduceScatter, 8 * k, true),
            (Op::ReduceScatter, 16 * k, false),
        ];
        for (op, count, cached) in cases {
            let (slow, quick) = (price(op, count, &c), price(op, count, &fast));
            assert_eq!(quick < slow, cached, "{op} of {count}: {slow:?} {quick:?}");
        }
    }

    #[test]
    fn forced_algorithms_parse_and_are_checked() {
        assert_eq!(
            parse_forced("allreduce=ring, broadcast=knomial:4"),
            Ok(vec![(Op::Allreduce, Algorithm::Ring), (Op::Broadcast, Algorithm::Knomial(4))])
        );
        assert!(parse_forced("allreduce=pairwise").is_err());
        assert!(parse_forced("broadcast=knomial:1").is_err());
        assert!(parse_forced("allreduce").is_err());
        assert!(parse_forced("").expect("empty").is_empty());
        for op in Op::ALL {
            for a in op.candidates() {
                assert_eq!(a.to_string().parse::<Algorithm>(), Ok(*a));
            }
        }
    }

    #[test]
    fn every_candidate_schedules_every_size() {
        let c = Costs::default();
        for op in Op::ALL {
            for n in 1..=9 {
                for hosts in [Hosts::flat(n), Hosts::from_keys(&(0..n).map(|r| r % 3).collect::<Vec<_>>())] {
                    for a in op.candidates() {
                        let _ = price_all(op, *a, &hosts, n / 2, 5, 4, &c);
                    }
                }
            }
        }
    }
}
