//! One measured cell (operation x size x source), printed in nccl-tests' columns as a
//! table, JSON lines or CSV.

use serde_json::json;
use ucxkit_tools::size::format_size;

/// A measured cell.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CollRow {
    pub(crate) op: String,
    pub(crate) bytes: usize,
    pub(crate) count: usize,
    pub(crate) dtype: String,
    pub(crate) redop: String,
    pub(crate) root: usize,
    pub(crate) np: usize,
    pub(crate) algo: String,
    pub(crate) time_us: f64,
    pub(crate) wrong: Option<u64>,
    /// The timed calls the time is the mean of.
    pub(crate) iters: u64,
    /// `ucxkit` or `mpi`.
    pub(crate) source: String,
}

/// nccl-tests' bus-bandwidth factor: what each rank's link carries relative to the
/// algorithm bandwidth.
pub(crate) fn bus_factor(op: &str, n: usize) -> f64 {
    let n = n.max(1) as f64;
    match op {
        "allreduce" => 2.0 * (n - 1.0) / n,
        "reduce_scatter" | "allgather" | "alltoall" | "gather" | "scatter" => (n - 1.0) / n,
        _ => 1.0,
    }
}

impl CollRow {
    /// Algorithm bandwidth, GB/s (10^9 bytes).
    pub(crate) fn algbw(&self) -> f64 {
        if self.time_us <= 0.0 {
            return 0.0;
        }
        self.bytes as f64 / (self.time_us * 1e-6) / 1e9
    }

    /// Bus bandwidth, GB/s.
    pub(crate) fn busbw(&self) -> f64 {
        self.algbw() * bus_factor(&self.op, self.np)
    }

    pub(crate) fn json(&self) -> String {
        json!({
            "op": self.op, "bytes": self.bytes, "count": self.count, "np": self.np, "dtype": self.dtype,
            "redop": self.redop, "root": self.root, "algo": self.algo, "time_us": self.time_us,
            "algbw_gbps": self.algbw(), "busbw_gbps": self.busbw(), "wrong": self.wrong, "iters": self.iters,
            "source": self.source,
        })
        .to_string()
    }

    /// Parses a line [`CollRow::json`] (or the MPI benchmark) wrote.
    pub(crate) fn from_json(line: &str, source: &str) -> Option<CollRow> {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        let s = |k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_string();
        let u = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0) as usize;
        Some(CollRow {
            op: s("op"),
            bytes: u("bytes"),
            count: u("count"),
            dtype: s("dtype"),
            redop: s("redop"),
            root: u("root"),
            np: u("np"),
            algo: if source == "mpi" { "mpi".into() } else { s("algo") },
            time_us: v.get("time_us")?.as_f64()?,
            wrong: v.get("wrong").and_then(|x| x.as_u64()),
            iters: v.get("iters").and_then(|x| x.as_u64()).unwrap_or(0),
            source: source.into(),
        })
    }

    pub(crate) fn csv_header() -> &'static str {
        "op,bytes,count,dtype,redop,root,np,algo,time_us,algbw_gbps,busbw_gbps,wrong,source"
    }

    pub(crate) fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{},{:.3},{:.4},{:.4},{},{}",
            self.op,
            self.bytes,
            self.count,
            self.dtype,
            self.redop,
            self.root,
            self.np,
            self.algo,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong.map_or(String::new(), |w| w.to_string()),
            self.source
        )
    }

    pub(crate) fn table_header() -> String {
        format!(
            "{:<15} {:>9} {:>10} {:>5} {:>5} {:>4} {:>11} {:>9} {:>9} {:>6}  {:<18} {}",
            "op",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time_us",
            "algbw",
            "busbw",
            "wrong",
            "algorithm",
            "source"
        )
    }

    pub(crate) fn table(&self) -> String {
        format!(
            "{:<15} {:>9} {:>10} {:>5} {:>5} {:>4} {:>11.2} {:>9.3} {:>9.3} {:>6}  {:<18} {}",
            self.op,
            format_size(self.bytes),
            self.count,
            self.dtype,
            self.redop,
            self.root,
            self.time_us,
            self.algbw(),
            self.busbw(),
            self.wrong.map_or("-".into(), |w| w.to_string()),
            self.algo,
            self.source
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_json_and_bus_factors_follow_nccl_tests() {
        let r = CollRow {
            op: "allreduce".into(),
            bytes: 1 << 20,
            count: 1 << 18,
            dtype: "f32".into(),
            redop: "sum".into(),
            root: 0,
            np: 4,
            algo: "ring".into(),
            time_us: 100.0,
            wrong: Some(0),
            iters: 250,
            source: "ucxkit".into(),
        };
        assert_eq!(CollRow::from_json(&r.json(), "ucxkit"), Some(r.clone()));
        assert!((r.algbw() - 10.48576).abs() < 1e-9);
        assert!((r.busbw() - r.algbw() * 1.5).abs() < 1e-9);
        assert_eq!(bus_factor("broadcast", 8), 1.0);
        assert_eq!(r.csv().split(',').count(), CollRow::csv_header().split(',').count());
    }
}
