//! Results: one row per (test, size), printed as an aligned table or as JSON lines.

use serde_json::json;

use crate::size::format_size;

/// One measured row.
#[derive(Clone, Debug)]
pub(crate) struct Row {
    pub(crate) test: String,
    pub(crate) size: usize,
    pub(crate) iters: u64,
    /// One-way latency (latency tests) or time per message (bandwidth tests), µs.
    pub(crate) lat_us: f64,
    pub lat_p50_us: f64,
    pub lat_p99_us: f64,
    /// MiB/s (2^20 bytes per second, as ucx_perftest prints MB/s).
    pub(crate) bw_mibps: f64,
    pub(crate) msg_rate: f64,
    /// Transports the endpoint used.
    pub(crate) transport: String,
}

impl Row {
    pub(crate) fn json(&self) -> String {
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
        })
        .to_string()
    }
}

fn round(x: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (x * m).round() / m
}

pub(crate) const HEADER: [&str; 8] =
    ["test", "size", "iters", "lat_avg_us", "lat_p50_us", "lat_p99_us", "bw_MiB/s", "msg/s"];

/// Column widths: wide enough for the header and typical values.
const WIDTHS: [usize; 8] = [10, 6, 9, 11, 11, 11, 11, 12];

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

pub(crate) fn header_line() -> String {
    line(&HEADER)
}

pub(crate) fn table_line(r: &Row) -> String {
    line(&[
        r.test.clone(),
        format_size(r.size),
        r.iters.to_string(),
        format!("{:.3}", r.lat_us),
        format!("{:.3}", r.lat_p50_us),
        format!("{:.3}", r.lat_p99_us),
        format!("{:.1}", r.bw_mibps),
        format!("{:.0}", r.msg_rate),
    ])
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
