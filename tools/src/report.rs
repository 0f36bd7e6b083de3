//! Results: one row per (test, size, source), printed as an aligned table, JSON lines or
//! CSV.

use serde_json::json;

use crate::size::format_size;

/// One measured row.
#[derive(Clone, Debug)]
pub struct Row {
    /// The test's name (`tag_lat`, say).
    pub test: String,
    /// Message size in bytes.
    pub size: usize,
    /// Measured iterations.
    pub iters: u64,
    /// One-way latency (latency tests) or time per message (bandwidth tests), µs.
    pub lat_us: f64,
    /// The median of the same, µs (NaN when not measured).
    pub lat_p50_us: f64,
    /// The 99th percentile, µs (NaN when not measured).
    pub lat_p99_us: f64,
    /// MiB/s (2^20 bytes per second, as ucx_perftest prints MB/s).
    pub bw_mibps: f64,
    /// Messages per second.
    pub msg_rate: f64,
    /// Transports the endpoint used.
    pub transport: String,
    /// Who measured it: `ucxkit`, or `ucx_perftest` with `--compare`.
    pub source: String,
}

impl Row {
    /// A point to plot: `test` at `size` from `source`, with a time (µs, drawn in the
    /// latency panel) or a bandwidth (MiB/s); the other figures not measured.
    pub fn point(
        test: impl Into<String>,
        size: usize,
        lat_us: f64,
        bw_mibps: f64,
        source: impl Into<String>,
    ) -> Row {
        Row {
            test: test.into(),
            size,
            iters: 0,
            lat_us,
            lat_p50_us: f64::NAN,
            lat_p99_us: f64::NAN,
            bw_mibps,
            msg_rate: 0.0,
            transport: String::new(),
            source: source.into(),
        }
    }

    /// The row as one JSON object (NaN, not measured, as null).
    pub fn json(&self) -> String {
        json!({
            "test": self.test,
            "size": self.size,
            "iters": self.iters,
            "lat_us": round(self.lat_us, 3),
            "lat_p50_us": round(self.lat_p50_us, 3),
            "lat_p99_us": round(self.lat_p99_us, 3),
            "bw_mibps": round(self.bw_mibps, 2),
            "msg_rate": round(self.msg_rate, 1),
            "transport": self.transport,
            "source": self.source,
        })
        .to_string()
    }

    /// The row as a CSV line in the order of [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        [
            self.test.clone(),
            self.size.to_string(),
            self.iters.to_string(),
            num(self.lat_us, 3),
            num(self.lat_p50_us, 3),
            num(self.lat_p99_us, 3),
            num(self.bw_mibps, 2),
            num(self.msg_rate, 1),
            csv_cell(&self.transport),
            csv_cell(&self.source),
        ]
        .join(",")
    }
}

/// Columns of `--csv`, the JSON field names.
pub const CSV_HEADER: &str =
    "test,size,iters,lat_us,lat_p50_us,lat_p99_us,bw_mibps,msg_rate,transport,source";

/// A number, or empty when it was not measured (NaN).
fn num(x: f64, digits: usize) -> String {
    if x.is_finite() {
        format!("{x:.digits$}")
    } else {
        String::new()
    }
}

fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// Rounded for JSON; NaN (not measured) becomes null.
fn round(x: f64, digits: i32) -> serde_json::Value {
    let m = 10f64.powi(digits);
    serde_json::Number::from_f64((x * m).round() / m)
        .map_or(serde_json::Value::Null, serde_json::Value::Number)
}

const HEADER: [&str; 8] =
    ["test", "size", "iters", "lat_avg_us", "lat_p50_us", "lat_p99_us", "bw_MiB/s", "msg/s"];

/// Column widths: wide enough for the header and typical values.
const WIDTHS: [usize; 8] = [14, 6, 9, 11, 11, 11, 11, 12];

/// Lays out cells in the table's columns: the first left-aligned, the rest right-aligned.
fn line<S: AsRef<str>>(cells: &[S]) -> String {
    let mut s = String::new();
    for (i, (c, w)) in cells.iter().zip(WIDTHS).enumerate() {
        let c = c.as_ref();
        if i == 0 {
            s += &format!("{c:<w$}");
        } else {
            s += &format!(" {c:>w$}");
        }
    }
    s
}

/// The table's header line.
pub fn header_line() -> String {
    line(&HEADER)
}

/// The row as a table line (a comparison source's row indented under ucxkit's).
pub fn table_line(r: &Row) -> String {
    let cell = |x: f64, d: usize| if x.is_finite() { format!("{x:.d$}") } else { "-".into() };
    let name = if r.source == "ucxkit" { r.test.clone() } else { format!("  {}", r.source) };
    line(&[
        name,
        format_size(r.size),
        r.iters.to_string(),
        cell(r.lat_us, 3),
        cell(r.lat_p50_us, 3),
        cell(r.lat_p99_us, 3),
        cell(r.bw_mibps, 1),
        cell(r.msg_rate, 0),
    ])
}

/// The comparison line under a ucxkit row and ucx_perftest's.
pub fn ratio_line(what: &str, ratio: f64) -> String {
    format!("  {:<w$} ucxkit/ucx_perftest {what} ratio {ratio:.2}", "", w = WIDTHS[0] - 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row {
            test: "tag_bw".into(),
            size: 65536,
            iters: 1000,
            lat_us: 6.5,
            lat_p50_us: 6.25,
            lat_p99_us: 9.0,
            bw_mibps: 9600.123,
            msg_rate: 153600.4,
            transport: "posix,cma".into(),
            source: "ucxkit".into(),
        }
    }

    #[test]
    fn json_has_the_documented_fields() {
        let v: serde_json::Value = serde_json::from_str(&row().json()).unwrap();
        for k in ["test", "size", "iters", "lat_us", "lat_p50_us", "lat_p99_us", "bw_mibps", "msg_rate"] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert_eq!(v["size"], 65536);
        assert_eq!(v["bw_mibps"], 9600.12);
        assert_eq!(v["source"], "ucxkit");
        let mut r = row();
        r.lat_p99_us = f64::NAN;
        let v: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert!(v["lat_p99_us"].is_null(), "not measured is null");
    }

    #[test]
    fn csv_matches_its_header() {
        let mut r = row();
        r.transport = "posix,cma".into();
        let line = r.csv();
        assert_eq!(line, "tag_bw,65536,1000,6.500,6.250,9.000,9600.12,153600.4,\"posix,cma\",ucxkit");
        // Quoted cells aside, one value per column.
        assert_eq!(CSV_HEADER.split(',').count(), 10);
        r.transport = "tcp".into();
        assert_eq!(r.csv().split(',').count(), 10);
    }

    #[test]
    fn table_columns_align() {
        let h = header_line();
        let l = table_line(&row());
        assert_eq!(h.len(), l.len(), "\n{h}\n{l}");
        assert!(l.starts_with("tag_bw"));
        assert!(l.contains("64K"));
    }
}
