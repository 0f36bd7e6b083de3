//! `--plot FILE.svg`: bandwidth and latency against message size, one line per test
//! (and per source when `--compare` adds ucx_perftest's rows), log-scaled axes.
//!
//! Two panels side by side: bandwidth (MiB/s) of the bandwidth tests, and one-way
//! latency (µs) of the latency tests. ucx_perftest's series are dashed, in the colour of
//! the matching ucxkit series. Plain SVG, no dependencies.

use std::fmt::Write as _;

use crate::report::Row;
use crate::size::format_size;

const W: f64 = 1100.0;
const PANEL_W: f64 = 430.0;
const PANEL_H: f64 = 340.0;
const TOP: f64 = 60.0;
const LEFT: [f64; 2] = [90.0, 640.0];
const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22",
];

/// One series: a test from one source, its points (size, value) sorted by size.
struct Series {
    name: String,
    test: String,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

fn series(rows: &[Row], latency: bool, is_latency: &dyn Fn(&str) -> bool) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for r in rows.iter().filter(|r| is_latency(&r.test) == latency) {
        let value = if latency { r.lat_us } else { r.bw_mibps };
        if !(value.is_finite() && value > 0.0 && r.size > 0) {
            continue;
        }
        let name = if r.source == "ucxkit" { r.test.clone() } else { format!("{} ({})", r.test, r.source) };
        match out.iter_mut().find(|s| s.name == name) {
            Some(s) => s.points.push((r.size as f64, value)),
            None => out.push(Series {
                name,
                test: r.test.clone(),
                dashed: r.source != "ucxkit",
                points: vec![(r.size as f64, value)],
            }),
        }
    }
    for s in &mut out {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A log axis: [lo, hi] in powers of `base`, covering the data.
fn log_range(values: impl Iterator<Item = f64>, base: f64) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (1.0, base);
    }
    let lo = base.powf(lo.log(base).floor());
    let mut hi = base.powf(hi.log(base).ceil());
    if hi <= lo {
        hi = lo * base;
    }
    (lo, hi)
}

fn fmt_value(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{}k", v / 1e3)
    } else {
        format!("{v}")
    }
}

/// Renders the SVG for `rows`; `is_latency` says which tests are latency tests.
pub(crate) fn render(rows: &[Row], title: &str, is_latency: &dyn Fn(&str) -> bool) -> String {
    let mut svg = String::new();
    // Tall enough for the longer legend (two entries per line under each panel).
    let entries = [false, true].map(|l| series(rows, l, is_latency).len()).into_iter().max().unwrap_or(0);
    let h = TOP + PANEL_H + 62.0 + 16.0 * entries.div_ceil(2) as f64 + 12.0;
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="{W}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="28" font-size="16" text-anchor="middle">{}</text>"#,
        W / 2.0,
        esc(title)
    );
    // One colour per test, shared by its ucxkit and ucx_perftest series.
    let mut tests: Vec<String> = Vec::new();
    for r in rows {
        if !tests.contains(&r.test) {
            tests.push(r.test.clone());
        }
    }
    let colour = |t: &str| PALETTE[tests.iter().position(|x| x == t).unwrap_or(0) % PALETTE.len()];
    for (panel, latency) in [(0usize, false), (1, true)] {
        let ss = series(rows, latency, is_latency);
        let left = LEFT[panel];
        let label = if latency { "one-way latency (µs)" } else { "bandwidth (MiB/s)" };
        let _ = writeln!(svg, r#"<g class="panel" id="{}">"#, if latency { "latency" } else { "bandwidth" });
        let _ = writeln!(
            svg,
            r##"<rect x="{left}" y="{TOP}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes)</text>"#,
            left + PANEL_W / 2.0,
            TOP + PANEL_H + 40.0
        );
        let _ = writeln!(
            svg,
            r#"<text transform="translate({},{}) rotate(-90)" text-anchor="middle">{label}</text>"#,
            left - 62.0,
            TOP + PANEL_H / 2.0
        );
        let (x0, x1) = log_range(ss.iter().flat_map(|s| s.points.iter().map(|p| p.0)), 2.0);
        let (y0, y1) = log_range(ss.iter().flat_map(|s| s.points.iter().map(|p| p.1)), 10.0);
        let px = |x: f64| left + (x.log2() - x0.log2()) / (x1.log2() - x0.log2()) * PANEL_W;
        let py = |y: f64| TOP + PANEL_H - (y.log10() - y0.log10()) / (y1.log10() - y0.log10()) * PANEL_H;
        // Ticks: sizes at powers of 4 (every other power of two), values at powers of ten.
        let steps = (x1.log2() - x0.log2()).round() as i32;
        let stride = if steps > 12 {
            4
        } else if steps > 6 {
            2
        } else {
            1
        };
        for k in (0..=steps).step_by(stride as usize) {
            let x = x0 * 2f64.powi(k);
            let _ = writeln!(
                svg,
                r##"<line x1="{0}" y1="{TOP}" x2="{0}" y2="{1}" stroke="#ddd"/><text x="{0}" y="{2}" text-anchor="middle">{3}</text>"##,
                px(x),
                TOP + PANEL_H,
                TOP + PANEL_H + 16.0,
                esc(&format_size(x as usize))
            );
        }
        let decades = (y1.log10() - y0.log10()).round() as i32;
        for k in 0..=decades {
            let y = y0 * 10f64.powi(k);
            let _ = writeln!(
                svg,
                r##"<line x1="{left}" y1="{0}" x2="{1}" y2="{0}" stroke="#ddd"/><text x="{2}" y="{3}" text-anchor="end">{4}</text>"##,
                py(y),
                left + PANEL_W,
                left - 6.0,
                py(y) + 4.0,
                fmt_value(y)
            );
        }
        for (i, s) in ss.iter().enumerate() {
            let c = colour(&s.test);
            let pts: Vec<String> =
                s.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y))).collect();
            let dash = if s.dashed { r#" stroke-dasharray="6,4""# } else { "" };
            let _ = writeln!(
                svg,
                r#"<polyline class="series" data-name="{}" points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
                esc(&s.name),
                pts.join(" ")
            );
            for &(x, y) in &s.points {
                let _ = writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{c}"/>"#, px(x), py(y));
            }
            // Legend, below the panel.
            let ly = TOP + PANEL_H + 62.0 + 16.0 * (i / 2) as f64;
            let lx = left + 220.0 * (i % 2) as f64;
            let _ = writeln!(
                svg,
                r#"<line x1="{lx}" y1="{0}" x2="{1}" y2="{0}" stroke="{c}" stroke-width="2"{dash}/><text x="{2}" y="{3}">{4}</text>"#,
                ly,
                lx + 24.0,
                lx + 30.0,
                ly + 4.0,
                esc(&s.name)
            );
        }
        if ss.is_empty() {
            let _ = writeln!(
                svg,
                r##"<text x="{}" y="{}" text-anchor="middle" fill="#888">no {} tests in this run</text>"##,
                left + PANEL_W / 2.0,
                TOP + PANEL_H / 2.0,
                if latency { "latency" } else { "bandwidth" }
            );
        }
        let _ = writeln!(svg, "</g>");
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(test: &str, size: usize, lat: f64, bw: f64, source: &str) -> Row {
        Row {
            test: test.into(),
            size,
            iters: 100,
            lat_us: lat,
            lat_p50_us: lat,
            lat_p99_us: lat,
            bw_mibps: bw,
            msg_rate: 1.0,
            transport: "posix".into(),
            source: source.into(),
        }
    }

    #[test]
    fn renders_well_formed_svg_with_every_series() {
        let lat = |t: &str| t.ends_with("_lat");
        let mut rows = Vec::new();
        for (i, size) in [8usize, 4096, 65536, 1 << 20, 16 << 20].into_iter().enumerate() {
            let f = (i + 1) as f64;
            rows.push(r("tag_lat", size, 0.3 * f * f, 0.0, "ucxkit"));
            rows.push(r("tag_lat", size, 0.25 * f * f, 0.0, "ucx_perftest"));
            rows.push(r("tag_bw", size, 1.0, 100.0 * f * f, "ucxkit"));
            rows.push(r("put_bw", size, 1.0, 90.0 * f * f, "ucxkit"));
        }
        rows.push(r("stream_lat", 64, 1.5, 0.0, "ucxkit"));
        let svg = render(&rows, "ucxkit-perf <posix> & friends", &lat);
        let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        let root = doc.root_element();
        assert_eq!(root.tag_name().name(), "svg");
        let names: Vec<&str> = root
            .descendants()
            .filter(|n| n.attribute("class") == Some("series"))
            .filter_map(|n| n.attribute("data-name"))
            .collect();
        assert_eq!(names.len(), 5, "{names:?}");
        for want in ["tag_lat", "tag_lat (ucx_perftest)", "tag_bw", "put_bw", "stream_lat"] {
            assert!(names.contains(&want), "missing series {want}: {names:?}");
        }
        // Each series has one point per size.
        let tag_bw = root.descendants().find(|n| n.attribute("data-name") == Some("tag_bw")).unwrap();
        assert_eq!(tag_bw.attribute("points").unwrap().split(' ').count(), 5);
        // Both panels and the escaped title are there.
        assert!(root.descendants().any(|n| n.attribute("id") == Some("bandwidth")));
        assert!(root.descendants().any(|n| n.attribute("id") == Some("latency")));
        assert!(svg.contains("&lt;posix&gt; &amp; friends"));
        assert!(svg.contains("MiB/s") && svg.contains("µs"));
    }

    #[test]
    fn empty_run_still_renders() {
        let svg = render(&[], "empty", &|_| false);
        roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert!(svg.contains("no bandwidth tests"));
    }
}
