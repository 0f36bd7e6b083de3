//! The shapes one object takes from its owner to several receivers, and the cost model
//! that picks one ([`Shape::choose`]).
//!
//! In a chain or a tree, a receiver pulls from the receiver above it, which passes each
//! chunk on as soon as it checked out (it relays the object while it pulls it), so the
//! transfers overlap: the owner sends the object once (a chain) or a few times (a tree)
//! instead of once per receiver, and each level adds about one chunk's time. Direct
//! sends win where the owner's link carries several transfers at full speed at once
//! (one host, where each receiver copies for itself) or the object is small.

use std::time::Duration;

/// How an object goes from its owner to several receivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Every receiver pulls from the owner.
    Direct,
    /// Receiver `i` pulls from receiver `i - 1`; the first from the owner.
    Chain,
    /// A tree under the owner with this fan-out: the first `k` receivers pull from the
    /// owner, receiver `i` after them from receiver `i / k - 1`. `Tree(1)` is a chain.
    Tree(u32),
}

impl Shape {
    /// The receiver that receiver `i` pulls from, or `None` for the owner.
    pub fn parent(self, i: usize) -> Option<usize> {
        match self {
            Shape::Direct => None,
            Shape::Chain => i.checked_sub(1),
            Shape::Tree(k) => (i / k.max(1) as usize).checked_sub(1),
        }
    }

    /// How many receivers one node sends to, at most, among `n`.
    pub fn fanout(self, n: usize) -> usize {
        match self {
            Shape::Direct => n,
            Shape::Chain => n.min(1),
            Shape::Tree(k) => n.min(k.max(1) as usize),
        }
    }

    /// How many receivers deep the shape goes for `n` receivers (the owner's own
    /// receivers are level 1).
    pub fn depth(self, n: usize) -> usize {
        (0..n).map(|i| self.level(i)).max().unwrap_or(0)
    }

    /// The level of receiver `i` (1 for the owner's own).
    fn level(self, mut i: usize) -> usize {
        let mut level = 1;
        while let Some(p) = self.parent(i) {
            i = p;
            level += 1;
        }
        level
    }

    /// The time the model gives this shape for `n` receivers of an object of `size`
    /// bytes, a relay passing bytes on `lag` bytes behind what it receives: the busiest
    /// sender's time for the whole object, plus the lag's way and one latency per level
    /// below the first, plus the arrival skew for every level (a receiver that arrives
    /// late holds up those below it). The lag is a chunk where chunks in flight arrive
    /// one after another (shared memory), and the window of chunks in flight where they
    /// arrive together (TCP, which interleaves them: with 1 MiB chunks and a window of 8,
    /// 8 MiB).
    pub fn estimate(self, n: usize, size: u64, lag: u64, cost: &LinkCost) -> Duration {
        if n == 0 {
            return Duration::ZERO;
        }
        let bw = cost.bandwidth.max(1.0);
        // A sender's transfers share its link beyond `parallel` at once.
        let share = (self.fanout(n) as f64 / f64::from(cost.parallel.max(1))).max(1.0);
        let whole = size as f64 / bw * share;
        let hop = lag.min(size) as f64 / bw * share + cost.latency.as_secs_f64();
        let depth = self.depth(n) as f64;
        let secs = cost.latency.as_secs_f64() + whole + (depth - 1.0) * hop + depth * cost.skew.as_secs_f64();
        Duration::from_secs_f64(secs)
    }

    /// The shape with the least [`Shape::estimate`] among direct sends, a chain and
    /// trees of fan-out 2 to 4 (direct on a tie).
    pub fn choose(n: usize, size: u64, lag: u64, cost: &LinkCost) -> Shape {
        let mut best = (Shape::Direct, Shape::Direct.estimate(n, size, lag, cost));
        for s in [Shape::Chain, Shape::Tree(2), Shape::Tree(3), Shape::Tree(4)] {
            let t = s.estimate(n, size, lag, cost);
            if t < best.1 {
                best = (s, t);
            }
        }
        best.0
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shape::Direct => write!(f, "direct"),
            Shape::Chain => write!(f, "chain"),
            Shape::Tree(k) => write!(f, "tree{k}"),
        }
    }
}

impl std::str::FromStr for Shape {
    type Err = String;

    /// `direct`, `chain` or `tree<k>` (`tree` alone: fan-out 2).
    fn from_str(s: &str) -> Result<Shape, String> {
        match s {
            "direct" => Ok(Shape::Direct),
            "chain" => Ok(Shape::Chain),
            "tree" => Ok(Shape::Tree(2)),
            _ => match s.strip_prefix("tree").map(str::parse::<u32>) {
                Some(Ok(k)) if k >= 1 => Ok(Shape::Tree(k)),
                _ => Err(format!("{s}: not direct, chain or tree<fan-out>")),
            },
        }
    }
}

/// What the links between the owner and the receivers cost, for [`Shape::choose`]:
/// measured (`ucxkit-objects bench` prints both) or configured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkCost {
    /// One message's way over a link.
    pub latency: Duration,
    /// Bytes per second one transfer moves over a link.
    pub bandwidth: f64,
    /// How many transfers a sender carries at full speed at once: 1 where its link is
    /// the limit (a network), more where each receiver does its own copy (one host, up
    /// to the cores).
    pub parallel: u32,
    /// How far apart the receivers arrive (zero: all ready at once).
    pub skew: Duration,
}

impl LinkCost {
    /// A network link of `bandwidth` bytes per second and `latency`, receivers ready.
    pub fn network(bandwidth: f64, latency: Duration) -> LinkCost {
        LinkCost { latency, bandwidth, parallel: 1, skew: Duration::ZERO }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_and_depths() {
        let parents = |s: Shape| (0..7).map(|i| s.parent(i)).collect::<Vec<_>>();
        let cases: [(Shape, [Option<usize>; 7], usize); 4] = [
            (Shape::Direct, [None; 7], 1),
            (Shape::Chain, [None, Some(0), Some(1), Some(2), Some(3), Some(4), Some(5)], 7),
            (Shape::Tree(2), [None, None, Some(0), Some(0), Some(1), Some(1), Some(2)], 3),
            (Shape::Tree(3), [None, None, None, Some(0), Some(0), Some(0), Some(1)], 2),
        ];
        for (shape, want, depth) in cases {
            assert_eq!(parents(shape), want, "{shape}");
            assert_eq!(shape.depth(7), depth, "{shape}");
            // Every parent comes before its child, so relays are asked before they relay.
            assert!((0..7).all(|i| shape.parent(i).map_or(true, |p| p < i)));
        }
        assert_eq!(Shape::Tree(1).depth(7), Shape::Chain.depth(7));
        assert_eq!(Shape::Chain.depth(0), 0);
    }

    #[test]
    fn the_model_picks_relays_on_a_shared_link_and_direct_where_copies_run_apart() {
        const MIB: u64 = 1 << 20;
        let gbit = LinkCost::network(125e6, Duration::from_micros(100));
        let one_host = LinkCost { parallel: 8, ..LinkCost::network(8e9, Duration::from_micros(2)) };
        let late = LinkCost { skew: Duration::from_millis(500), ..gbit };
        // (receivers, size, cost, shape)
        let cases = [
            (1, 256 * MIB, gbit, Shape::Direct),
            (4, 256 * MIB, gbit, Shape::Chain),
            (4, 4096, gbit, Shape::Direct),
            (4, 256 * MIB, one_host, Shape::Direct),
            (4, 16 * MIB, gbit, Shape::Chain),
            (4, 16 * MIB, late, Shape::Direct),
        ];
        for (n, size, cost, want) in cases {
            assert_eq!(Shape::choose(n, size, MIB, &cost), want, "{n} receivers of {size} over {cost:?}");
        }
        // 256 MiB to 4 receivers over 1 Gbit/s links, TCP's lag (1 MiB chunks, 8 in
        // flight): the model against what `ucxkit-objects bench --netns 1gbit` measured
        // (times one transfer; docs/objects.md).
        let one = Shape::Direct.estimate(1, 256 * MIB, 8 * MIB, &gbit).as_secs_f64();
        for (shape, measured) in [(Shape::Direct, 4.00), (Shape::Chain, 1.09), (Shape::Tree(2), 2.11)] {
            let model = shape.estimate(4, 256 * MIB, 8 * MIB, &gbit).as_secs_f64() / one;
            assert!((model / measured - 1.0).abs() < 0.1, "{shape}: model {model:.2}, measured {measured}");
        }
    }

    #[test]
    fn shapes_parse_and_print() {
        for s in [Shape::Direct, Shape::Chain, Shape::Tree(2), Shape::Tree(16)] {
            assert_eq!(s.to_string().parse::<Shape>(), Ok(s));
        }
        assert_eq!("tree".parse::<Shape>(), Ok(Shape::Tree(2)));
        for bad in ["", "tree0", "treex", "star"] {
            assert!(bad.parse::<Shape>().is_err(), "{bad}");
        }
    }
}
