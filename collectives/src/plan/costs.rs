//! The cost model's constants ([`Costs`]): what a message step, a byte moved and a byte
//! reduced cost inside a host and between hosts, and their text form (written by
//! `ucxkit-coll tune`, read through [`COSTS_ENV`]).

use std::time::Duration;

/// The cost model's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// Per step whose messages are all short: the latency of one message round.
    pub latency: Duration,
    /// Per step with a message of [`Costs::rndv_threshold`] bytes or more: the latency
    /// of a rendezvous (the receiver asks for the data before it moves).
    pub rndv_latency: Duration,
    /// The message size from which a collective's messages go by UCX's rendezvous
    /// protocol (the executor sends shorter ones eagerly over shared memory, up to 64
    /// KiB; UCX on its own from 8 KiB).
    pub rndv_threshold: usize,
    /// Bytes per second one rank moves in one direction.
    pub bandwidth: f64,
    /// Bytes per second one rank reduces data in memory.
    pub reduce_rate: f64,
    /// Bytes per second one rank reduces data in its cache: calls of up to
    /// [`CACHED_CALL`] bytes per rank, whose received values are reduced as they land.
    pub cached_reduce_rate: f64,
    /// Per step with a message to another host: the network's latency.
    pub net_latency: Duration,
    /// Bytes per second one host moves over the network in one direction, shared by
    /// its ranks.
    pub net_bandwidth: f64,
}

impl Default for Costs {
    /// Shared memory on one host, as `ucxkit-coll --np 2 tune` measured it with UCX
    /// 1.13 on a 2-core machine (medians of runs that spread about 2x): 0.5 µs per short
    /// step, 2 µs per rendezvous step (past 64 KiB), 6 GB/s per direction, reductions at
    /// 12 GB/s in memory and 40 GB/s in cache (`cargo bench --bench reduce`: f32 sums of
    /// 1 MiB at 40 GiB/s, 16 KiB at 84). Between hosts, UCX's TCP transport on the same
    /// machine's loopback: 8 µs, 2 GB/s.
    fn default() -> Costs {
        Costs {
            latency: Duration::from_nanos(500),
            rndv_latency: Duration::from_micros(2),
            rndv_threshold: (64 << 10) + 1,
            bandwidth: 6e9,
            reduce_rate: 12e9,
            cached_reduce_rate: 40e9,
            net_latency: Duration::from_micros(8),
            net_bandwidth: 2e9,
        }
    }
}

/// The most bytes per rank of a call whose reductions the model prices at
/// [`Costs::cached_reduce_rate`]. Above it, calls by recursive doubling (one step,
/// reducing all of the data at once) measured slower than by Rabenseifner (half the data
/// reduced, a step more), as the memory rate predicts; below it the reverse, as the cache
/// rate does: 2 ranks, alternated runs, Rabenseifner / doubling: 64 KiB 1.10, 128 KiB
/// 0.99-1.06, 192 KiB 1.01, 256 KiB 0.49-0.61, 384 KiB 0.51.
pub const CACHED_CALL: usize = 128 << 10;

/// The variable naming a file of cost constants (as [`Costs::to_text`] writes them,
/// for example by `ucxkit-coll tune`), loaded by every communicator made afterwards
/// unless its options give constants.
pub const COSTS_ENV: &str = "UCXKIT_COLL_COSTS";

impl Costs {
    /// The constants of messages between hosts, as those of one flat group (the leaders
    /// of a two-level algorithm).
    pub fn network(&self) -> Costs {
        Costs {
            latency: self.net_latency,
            rndv_latency: self.net_latency,
            bandwidth: self.net_bandwidth,
            ..*self
        }
    }

    /// The constants as `key=value` lines: `latency_us`, `rndv_latency_us`,
    /// `rndv_threshold` (bytes), `bandwidth` (bytes/s), `reduce_rate` (bytes/s),
    /// `cached_reduce_rate` (bytes/s), `net_latency_us` and `net_bandwidth` (bytes/s).
    pub fn to_text(&self) -> String {
        format!(
            "latency_us={}\nrndv_latency_us={}\nrndv_threshold={}\nbandwidth={}\nreduce_rate={}\n\
             cached_reduce_rate={}\nnet_latency_us={}\nnet_bandwidth={}\n",
            self.latency.as_secs_f64() * 1e6,
            self.rndv_latency.as_secs_f64() * 1e6,
            self.rndv_threshold,
            self.bandwidth,
            self.reduce_rate,
            self.cached_reduce_rate,
            self.net_latency.as_secs_f64() * 1e6,
            self.net_bandwidth,
        )
    }

    /// Parses [`Costs::to_text`]'s form; keys left out keep their defaults.
    ///
    /// # Errors
    /// A line that is not `key=value` with a known key and a positive, finite number.
    pub fn from_text(text: &str) -> Result<Costs, String> {
        let mut c = Costs::default();
        let us = |v: f64| Duration::from_secs_f64(v * 1e-6);
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (k, v) = line.split_once('=').ok_or_else(|| format!("{line:?} is not key=value"))?;
            let v: f64 = v.trim().parse().map_err(|_| format!("{line:?}: not a number"))?;
            if !(v.is_finite() && v > 0.0 && v < 1e18) {
                return Err(format!("{line:?}: must be positive and below 1e18"));
            }
            match k.trim() {
                "latency_us" => c.latency = us(v),
                "rndv_latency_us" => c.rndv_latency = us(v),
                "rndv_threshold" => c.rndv_threshold = v as usize,
                "bandwidth" => c.bandwidth = v,
                "reduce_rate" => c.reduce_rate = v,
                "cached_reduce_rate" => c.cached_reduce_rate = v,
                "net_latency_us" => c.net_latency = us(v),
                "net_bandwidth" => c.net_bandwidth = v,
                other => return Err(format!("unknown cost {other:?}")),
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_round_trip_as_text() {
        let c = Costs {
            latency: Duration::from_nanos(1500),
            bandwidth: 3e9,
            reduce_rate: 2e9,
            cached_reduce_rate: 5e9,
            net_latency: Duration::from_micros(20),
            ..Costs::default()
        };
        assert_eq!(Costs::from_text(&c.to_text()), Ok(c));
        assert!(Costs::from_text("latency_us=-1").is_err());
        assert!(Costs::from_text("latency_us=1e300").is_err());
        assert!(Costs::from_text("speed=1").is_err());
        assert!(Costs::from_text("bandwidth").is_err());
        assert_eq!(Costs::default().network().bandwidth, Costs::default().net_bandwidth);
    }
}
