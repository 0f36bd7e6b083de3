//! Runs that last a given time (`--duration`).
//!
//! A short calibration estimates the time one iteration takes; the run then goes in
//! segments, each sized from the speed the segment before it measured, until the timed
//! parts add up to the duration. One estimate made up front is not enough: on a shared
//! host the processes can be moved between faster and slower processors within a run,
//! changing the speed several-fold, and a count fixed beforehand then runs several times
//! too long or too short. A segment overshoots by at most its own length times such a
//! change.

use std::time::Duration;

use crate::bench::{self, Measured, Side, Test};
use crate::AnyResult;

/// What the calibration and every segment of a run share: the test, its message size
/// and windows.
pub(crate) struct Shape {
    pub(crate) test: Test,
    pub(crate) size: usize,
    /// Outstanding messages in bandwidth tests.
    pub(crate) window: usize,
    /// Receives the bandwidth server keeps posted.
    pub(crate) recv_window: usize,
}

/// Iteration counts stay at or under this.
const MAX: u64 = 50_000_000;

/// A run of `d` goes in segments of at most `d / SEGMENTS`.
const SEGMENTS: u32 = 8;

/// Untimed iterations before each segment after the first (the connection is warm).
const SEGMENT_WARMUP: u64 = 10;

/// The iterations that take about `d` at `per` seconds each.
pub(crate) fn iters_in(d: Duration, per: f64) -> u64 {
    ((d.as_secs_f64() / per.max(1e-9)) as u64).clamp(10, MAX)
}

/// Estimates the seconds one iteration takes, for a run of about `d`. Trial runs, each
/// longer than the last, go on until one spends at least a twentieth of `d` (and 2 ms) in
/// its timed part; a run's set-up (posting receives, exchanging keys, allocating
/// buffers) is not timed, so a short trial timed by the wall clock would overstate the
/// time per iteration several times. Each trial warms up as long as it measures, and one
/// whose mean is far above its median (a stall: a preempted CPU, first-touch page faults)
/// is run again rather than trusted.
pub(crate) async fn per_iter(shape: &Shape, d: Duration, side: &mut Side<'_>) -> AnyResult<f64> {
    /// Stalled trials run again, at most this many times in all.
    const RETRIES: u32 = 4;
    let target = (d.as_secs_f64() / 20.0).max(2e-3);
    let mut trial = 20u64.max(shape.window as u64);
    let mut retries = 0;
    loop {
        let m = segment(shape, trial, trial, side).await?;
        let per = m.secs_per_iter().max(1e-9);
        let typical = m.typical_secs_per_iter();
        if typical.is_finite() && typical > 0.0 && per > 3.0 * typical && retries < RETRIES {
            retries += 1;
            continue;
        }
        if per * trial as f64 >= target || trial >= MAX {
            return Ok(per);
        }
        trial = ((target / per * 1.5) as u64).clamp(trial * 2, trial * 100).min(MAX);
    }
}

/// Runs the test until its timed parts add up to `d`, starting from an estimate of
/// `per` seconds per iteration, with `warmup` untimed iterations first.
pub(crate) async fn run_for(
    shape: &Shape,
    d: Duration,
    (per, warmup): (f64, u64),
    side: &mut Side<'_>,
) -> AnyResult<Measured> {
    let longest = d / SEGMENTS;
    let mut total = segment(shape, iters_in(longest, per), warmup, side).await?;
    let mut per = total.secs_per_iter();
    loop {
        // The last few percent are not worth a segment of their own.
        let left = d.saturating_sub(total.elapsed);
        if left.is_zero() || left < d / 50 {
            return Ok(total);
        }
        let m = segment(shape, iters_in(left.min(longest), per), SEGMENT_WARMUP, side).await?;
        per = m.secs_per_iter();
        total.add(&m)?;
    }
}

/// One run of `iters` timed iterations after `warmup` untimed ones (also a whole run
/// of a fixed count).
pub(crate) async fn segment(
    shape: &Shape,
    iters: u64,
    warmup: u64,
    side: &mut Side<'_>,
) -> AnyResult<Measured> {
    let ep = side.ep;
    let Shape { test, size, window, recv_window } = *shape;
    let run = bench::run_client(test, size, iters, warmup, window, recv_window, side);
    bench::unless_failed(ep, run).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts follow the time per iteration and stay within 10..=MAX.
    #[test]
    fn iteration_counts_for_a_duration() {
        let cases = [
            (Duration::from_millis(300), 1e-6, 300_000),
            (Duration::from_secs(1), 1e-3, 1_000),
            (Duration::from_millis(1), 1.0, 10),
            (Duration::from_secs(100), 1e-9, MAX),
            (Duration::from_secs(1), 0.0, MAX),
        ];
        for (d, per, n) in cases {
            assert_eq!(iters_in(d, per), n, "{d:?} at {per} s");
        }
    }
}
