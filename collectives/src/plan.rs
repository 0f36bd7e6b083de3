//! Which algorithm runs a collective: every candidate's schedule is priced with a cost
//! model, as NCCL does, and the cheapest wins:
//!
//! time = Σ over steps (latency + max(bytes sent, bytes received) / bandwidth
//!        + bytes reduced / reduction rate),
//!
//! taken over the slowest rank. The constants ([`Costs`]) are the communicator's, the
//! same on every rank, so every rank picks the same algorithm. A switch between two
//! algorithms needs the new one to win by a margin ([`HYSTERESIS`]) over the choice for
//! the neighbouring smaller size, so that noise in the constants does not make the
//! choice flip back and forth between sizes. [`Plan`] says what was chosen and why; a
//! choice can be forced per communicator ([`crate::Options::algorithm`]) or by the
//! environment ([`ENV`]).

use std::fmt;
use std::time::Duration;

use crate::schedule::{doubling, even_blocks, linear, ring, tree, Schedule, Xfer};

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
            Op::Allreduce => &[RecursiveDoubling, Rabenseifner, Ring, DoubleTree],
            Op::Broadcast => &[Knomial(2), Knomial(4), Direct, Chain, ScatterAllgather, DoubleTree],
            Op::Reduce => &[Knomial(2), Knomial(4), Direct, DoubleTree],
            Op::Allgather => &[Ring],
            Op::ReduceScatter => &[Ring, RingBidir],
            Op::Gather | Op::Scatter => &[Direct],
            Op::Alltoall => &[Pairwise, Bruck],
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
    /// The root talks to every rank at once (broadcast, reduce, gather, scatter).
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

/// The cost model's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// Per step whose messages are all short: the latency of one message round.
    pub latency: Duration,
    /// Per step with a message of [`Costs::rndv_threshold`] bytes or more: the latency
    /// of a rendezvous (the receiver asks for the data before it moves).
    pub rndv_latency: Duration,
    /// The message size from which UCX uses its rendezvous protocol.
    pub rndv_threshold: usize,
    /// Bytes per second one rank moves in one direction.
    pub bandwidth: f64,
    /// Bytes per second one rank reduces.
    pub reduce_rate: f64,
}

impl Default for Costs {
    /// Shared memory on one host, as `ucxkit-coll --np 2 tune` measured it with UCX
    /// 1.13 on a 2-core machine (medians of runs that spread about 2x): 0.5 µs per short
    /// step, 2 µs per rendezvous step (from 8 KiB), 6 GB/s per direction, reductions at
    /// 12 GB/s.
    fn default() -> Costs {
        Costs {
            latency: Duration::from_nanos(500),
            rndv_latency: Duration::from_micros(2),
            rndv_threshold: 8 << 10,
            bandwidth: 6e9,
            reduce_rate: 12e9,
        }
    }
}

/// The variable naming a file of cost constants (as [`Costs::to_text`] writes them,
/// for example by `ucxkit-coll tune`), loaded by every communicator made afterwards
/// unless its options give constants.
pub const COSTS_ENV: &str = "UCXKIT_COLL_COSTS";

impl Costs {
    /// The constants as `key=value` lines: `latency_us`, `rndv_latency_us`,
    /// `rndv_threshold` (bytes), `bandwidth` (bytes/s) and `reduce_rate` (bytes/s).
    pub fn to_text(&self) -> String {
        format!(
            "latency_us={}\nrndv_latency_us={}\nrndv_threshold={}\nbandwidth={}\nreduce_rate={}\n",
            self.latency.as_secs_f64() * 1e6,
            self.rndv_latency.as_secs_f64() * 1e6,
            self.rndv_threshold,
            self.bandwidth,
            self.reduce_rate
        )
    }

    /// Parses [`Costs::to_text`]'s form; keys left out keep their defaults.
    ///
    /// # Errors
    /// A line that is not `key=value` with a known key and a positive, finite number.
    pub fn from_text(text: &str) -> Result<Costs, String> {
        let mut c = Costs::default();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("{line:?} is not key=value"))?;
            let v: f64 = v.trim().parse().map_err(|_| format!("{line:?}: not a number"))?;
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{line:?}: must be positive"));
            }
            match k.trim() {
                "latency_us" => c.latency = Duration::from_secs_f64(v * 1e-6),
                "rndv_latency_us" => c.rndv_latency = Duration::from_secs_f64(v * 1e-6),
                "rndv_threshold" => c.rndv_threshold = v as usize,
                "bandwidth" => c.bandwidth = v,
                "reduce_rate" => c.reduce_rate = v,
                other => return Err(format!("unknown cost {other:?}")),
            }
        }
        Ok(c)
    }
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
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {} B: {}", self.op, self.bytes, self.algorithm)?;
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

/// The pipelined chain's pieces for `bytes`: 64 KiB each, from 1 to 64.
pub(crate) fn chain_segments(bytes: usize) -> usize {
    (bytes / (64 << 10)).clamp(1, 64)
}

/// The schedule of `alg` running `op` on rank `r` of `n`, for `count` elements (per
/// rank's block where the operation has blocks) with `root`.
pub(crate) fn schedule(
    op: Op,
    alg: Algorithm,
    n: usize,
    r: usize,
    root: usize,
    count: usize,
    elem: usize,
) -> Schedule {
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
        (Op::Allgather, _) => ring::allgather(n, r, &even_blocks(count * n, n)),
        (Op::ReduceScatter, Algorithm::RingBidir) => {
            ring::reduce_scatter_bidir(n, r, &even_blocks(count * n, n))
        }
        (Op::ReduceScatter, _) => ring::reduce_scatter(n, r, &even_blocks(count * n, n)),
        (Op::Gather, _) => linear::gather(n, r, root, &even_blocks(count * n, n)),
        (Op::Scatter, _) => linear::scatter(n, r, root, &even_blocks(count * n, n)),
        (Op::Alltoall, Algorithm::Bruck) => linear::bruck_alltoall(n, r, count),
        (Op::Alltoall, _) => {
            let b = even_blocks(count * n, n);
            linear::pairwise_alltoall(n, r, &b, &b)
        }
        (Op::Barrier, Algorithm::Knomial(k)) => doubling::knomial_barrier(n, r, k.into()),
        (Op::Barrier, _) => doubling::barrier(n, r),
        (Op::Scan, _) => doubling::scan(n, r, count, false),
    }
}

/// The modelled time of one rank's schedule.
pub fn price(s: &Schedule, elem: usize, c: &Costs) -> Duration {
    Duration::from_secs_f64(s.steps.iter().map(|st| step_price(st, elem, c)).sum())
}

/// The modelled time of one step of one rank, in seconds.
fn step_price(st: &crate::schedule::Step, elem: usize, c: &Costs) -> f64 {
    let (mut out, mut inn, mut largest) = (0usize, 0usize, 0usize);
    for x in &st.xfers {
        let bytes = match x {
            Xfer::Send { from, .. } => {
                out += from.len() * elem;
                from.len() * elem
            }
            Xfer::Recv { into, .. } => {
                inn += into.len() * elem;
                into.len() * elem
            }
        };
        largest = largest.max(bytes);
    }
    let reduced: usize = st
        .combines
        .iter()
        .map(|c| match c {
            crate::schedule::Combine::Reduce { from, .. } => from.len() * elem,
            crate::schedule::Combine::Copy { .. } => 0,
        })
        .sum();
    let mut t = out.max(inn) as f64 / c.bandwidth + reduced as f64 / c.reduce_rate;
    if !st.xfers.is_empty() {
        let l = if largest >= c.rndv_threshold { c.rndv_latency } else { c.latency };
        t += l.as_secs_f64();
    }
    t
}

/// The modelled time of `alg` running `op`: the ranks move in lockstep (a step waits
/// for its messages), so each step costs what it costs its busiest rank, and steps in
/// which a rank is idle still take the others' time.
pub fn price_all(
    op: Op,
    alg: Algorithm,
    n: usize,
    root: usize,
    count: usize,
    elem: usize,
    c: &Costs,
) -> Duration {
    let scheds: Vec<Schedule> = (0..n).map(|r| schedule(op, alg, n, r, root, count, elem)).collect();
    let steps = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
    let t: f64 = (0..steps)
        .map(|i| {
            scheds.iter().filter_map(|s| s.steps.get(i)).map(|st| step_price(st, elem, c)).fold(0.0, f64::max)
        })
        .sum();
    Duration::from_secs_f64(t)
}

/// Chooses the algorithm for `op` of `count` elements of `elem` bytes on `n` ranks.
pub fn choose(op: Op, n: usize, root: usize, count: usize, elem: usize, c: &Costs) -> Plan {
    let priced: Vec<(Algorithm, Duration)> =
        op.candidates().iter().map(|&a| (a, price_all(op, a, n, root, count, elem, c))).collect();
    let best = priced.iter().min_by_key(|(_, t)| *t).map(|(a, _)| *a).unwrap_or(Algorithm::Direct);
    // Hysteresis: keep the choice for half the size unless the best beats it clearly.
    let algorithm = if count > 1 {
        let smaller = choose(op, n, root, count / 2, elem, c).algorithm;
        let t = |a: Algorithm| priced.iter().find(|(x, _)| *x == a).map(|(_, t)| t.as_secs_f64());
        match (t(smaller), t(best)) {
            (Some(ts), Some(tb)) if tb >= ts * (1.0 - HYSTERESIS) => smaller,
            _ => best,
        }
    } else {
        best
    };
    Plan { op, bytes: count * elem, algorithm, forced: false, priced }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_allreduces_double_and_large_ones_halve_or_ring() {
        let c = Costs::default();
        assert_eq!(choose(Op::Allreduce, 8, 0, 2, 4, &c).algorithm, Algorithm::RecursiveDoubling);
        // Large: halving-doubling moves what the ring moves in fewer steps on a power of
        // two; elsewhere its fold costs a whole vector more.
        assert_eq!(choose(Op::Allreduce, 8, 0, 4 << 20, 4, &c).algorithm, Algorithm::Rabenseifner);
        assert_eq!(choose(Op::Allreduce, 6, 0, 4 << 20, 4, &c).algorithm, Algorithm::Ring);
        let p = choose(Op::Broadcast, 3, 0, 2, 4, &c);
        assert!(p.to_string().starts_with("broadcast of 8 B: "), "{p}");
        assert_eq!(p.priced.len(), Op::Broadcast.candidates().len());
    }

    #[test]
    fn costs_round_trip_as_text() {
        let c = Costs {
            latency: Duration::from_nanos(1500),
            bandwidth: 3e9,
            reduce_rate: 2e9,
            ..Costs::default()
        };
        assert_eq!(Costs::from_text(&c.to_text()), Ok(c));
        assert!(Costs::from_text("latency_us=-1").is_err());
        assert!(Costs::from_text("speed=1").is_err());
        assert!(Costs::from_text("bandwidth").is_err());
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
                for a in op.candidates() {
                    let _ = price_all(op, *a, n, n / 2, 5, 4, &c);
                }
            }
        }
    }
}
