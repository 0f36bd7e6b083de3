//! `--compare`: runs `ucx_perftest` ([`ucxkit_tools::perftest`]) with the same test,
//! size, iterations, window, transports, pinning and wait mode, and reads its result as
//! a [`Row`].

use crate::bench::Test;
use crate::AnyResult;
use ucxkit_tools::perftest::{self, Case, Values};
use ucxkit_tools::report::Row;

pub(crate) use ucxkit_tools::perftest::{net_devices, Setup};

/// Runs one ucx_perftest pair and returns its result.
pub(crate) fn run(test: Test, size: usize, iters: u64, warmup: u64, setup: &Setup<'_>) -> AnyResult<Row> {
    let size = test.effective_size(size);
    let case = Case {
        test: test.perftest_name(),
        size,
        iters,
        warmup,
        latency: test.is_latency(),
        one_sided: test.is_one_sided(),
    };
    Ok(row(test, size, perftest::run(&case, setup)?))
}

fn row(test: Test, size: usize, v: Values) -> Row {
    Row {
        test: test.name().into(),
        size,
        iters: v[0] as u64,
        lat_us: v[3],
        lat_p50_us: v[1],
        lat_p99_us: f64::NAN,
        bw_mibps: if size == 0 { 0.0 } else { v[5] },
        msg_rate: v[7],
        transport: String::new(),
        source: "ucx_perftest".into(),
    }
}

/// ucxkit / ucx_perftest on the figure that matters for the test: latency for latency
/// tests (lower is better, so a ratio above 1 is slower), message rate for atomics,
/// bandwidth otherwise (above 1 is faster).
pub(crate) fn ratio(test: Test, ours: &Row, theirs: &Row) -> f64 {
    if test.is_latency() {
        ours.lat_us / theirs.lat_us
    } else if test == Test::AtomicRate {
        ours.msg_rate / theirs.msg_rate
    } else {
        ours.bw_mibps / theirs.bw_mibps
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_take_the_overall_figures() {
        let v = [2000.0, 0.381, 15.484, 15.484, 4036.31, 4036.31, 64581.0, 64581.0];
        let r = row(Test::AmBw, 65536, v);
        assert_eq!(r.bw_mibps, 4036.31);
        assert_eq!(r.source, "ucx_perftest");
    }
}
