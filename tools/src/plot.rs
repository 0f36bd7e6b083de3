//! SVG plots of results against message size (plotters' SVG backend): two panels,
//! bandwidth (MiB/s) of the bandwidth tests and one-way latency (µs) of the latency
//! tests, log-scaled, one line per test and source. A comparison source's series (such
//! as ucx_perftest's) is dashed, in the colour of the matching ucxkit series.

use plotters::element::DashedPathElement;
use plotters::prelude::*;

use crate::report::Row;

/// Width of the whole plot, in pixels.
const WIDTH: u32 = 1100;
/// Height of one panel's chart, in pixels.
const CHART_H: u32 = 420;
const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x17, 0xbe, 0xcf),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
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

/// Text as plain, markup-free characters (the backend writes text as it is given).
fn plain(s: &str) -> String {
    s.chars().map(|c| if matches!(c, '<' | '>' | '&' | '"') { '_' } else { c }).collect()
}

/// Renders the SVG for `rows`; `is_latency` says which tests are latency tests.
///
/// # Errors
/// What the drawing backend reports.
pub fn render(rows: &[Row], title: &str, is_latency: &dyn Fn(&str) -> bool) -> Result<String, String> {
    // One colour per test, shared by its sources' series.
    let mut tests: Vec<&str> = Vec::new();
    for r in rows {
        if !tests.contains(&r.test.as_str()) {
            tests.push(&r.test);
        }
    }
    let colour = |t: &str| PALETTE[tests.iter().position(|x| *x == t).unwrap_or(0) % PALETTE.len()];
    let panels = [false, true].map(|latency| (latency, series(rows, latency, is_latency)));
    // Room under the charts for the longer legend.
    let entries = panels.iter().map(|(_, s)| s.len()).max().unwrap_or(0) as u32;
    let height = 50 + CHART_H + 20 * entries + 20;
    let mut svg = String::new();
    {
        let err = |e: &dyn std::fmt::Display| format!("drawing the plot: {e}");
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let root = root.titled(&plain(title), ("sans-serif", 18)).map_err(|e| err(&e))?;
        let halves = root.split_evenly((1, 2));
        for ((latency, ss), area) in panels.iter().zip(halves.iter()) {
            let (chart_area, legend_area) = area.split_vertically(CHART_H);
            let what = if *latency { "latency" } else { "bandwidth" };
            if ss.is_empty() {
                let (w, h) = chart_area.dim_in_pixel();
                chart_area
                    .draw(&Text::new(
                        format!("no {what} tests in this run"),
                        (w as i32 / 2 - 90, h as i32 / 2),
                        ("sans-serif", 14).into_font().color(&RGBColor(0x88, 0x88, 0x88)),
                    ))
                    .map_err(|e| err(&e))?;
                continue;
            }
            let (x0, x1) = log_range(ss.iter().flat_map(|s| s.points.iter().map(|p| p.0)), 2.0);
            let (y0, y1) = log_range(ss.iter().flat_map(|s| s.points.iter().map(|p| p.1)), 10.0);
            let mut chart = ChartBuilder::on(&chart_area)
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(64)
                .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_desc("message size (bytes; k, M: 10^3, 10^6)")
                .y_desc(if *latency { "one-way latency (µs)" } else { "bandwidth (MiB/s)" })
                .x_label_formatter(&|x| fmt_value(*x))
                .y_label_formatter(&|y| fmt_value(*y))
                .draw()
                .map_err(|e| err(&e))?;
            for s in ss {
                let c = colour(&s.test);
                let style = ShapeStyle { color: c.to_rgba(), filled: false, stroke_width: 2 };
                if s.dashed {
                    chart.draw_series(DashedLineSeries::new(s.points.iter().copied(), 6, 4, style))
                } else {
                    chart.draw_series(LineSeries::new(s.points.iter().copied(), style))
                }
                .map_err(|e| err(&e))?;
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, c.filled())))
                    .map_err(|e| err(&e))?;
            }
            // The legend, under the chart: a line in the series' style and its name.
            for (i, s) in ss.iter().enumerate() {
                let y = 12 + 20 * i as i32;
                let c = colour(&s.test);
                let style = ShapeStyle { color: c.to_rgba(), filled: false, stroke_width: 2 };
                let line = [(70, y), (94, y)];
                if s.dashed {
                    legend_area.draw(&DashedPathElement::new(line, 4, 3, style)).map_err(|e| err(&e))?;
                } else {
                    legend_area.draw(&PathElement::new(line, style)).map_err(|e| err(&e))?;
                }
                legend_area
                    .draw(&Text::new(plain(&s.name), (100, y - 7), ("sans-serif", 13)))
                    .map_err(|e| err(&e))?;
            }
        }
        root.present().map_err(|e| err(&e))?;
    }
    Ok(svg)
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

    /// The texts of the document's text elements.
    fn texts(doc: &roxmltree::Document<'_>) -> Vec<String> {
        doc.descendants()
            .filter(|n| n.tag_name().name() == "text")
            .map(|n| n.text().unwrap_or("").trim().to_string())
            .collect()
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
        let svg = render(&rows, "ucxkit-perf <posix> & friends", &lat).unwrap();
        let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        let texts = texts(&doc);
        for want in ["tag_lat", "tag_lat (ucx_perftest)", "tag_bw", "put_bw", "stream_lat"] {
            assert!(texts.iter().any(|t| t == want), "no legend entry {want}: {texts:?}");
        }
        assert!(texts.iter().any(|t| t.contains("posix") && t.contains("friends")), "title: {texts:?}");
        assert!(texts.iter().any(|t| t.contains("MiB/s")) && texts.iter().any(|t| t.contains("µs")));
        // A line for each series (and the legend's), dashed ones included.
        let lines = doc.descendants().filter(|n| n.tag_name().name() == "polyline").count();
        assert!(lines >= 5, "{lines} lines");
    }

    #[test]
    fn empty_run_still_renders() {
        let svg = render(&[], "empty", &|_| false).unwrap();
        let doc = roxmltree::Document::parse(&svg).expect("well-formed SVG");
        let texts = texts(&doc);
        assert!(texts.iter().any(|t| t == "no bandwidth tests in this run"), "{texts:?}");
    }
}
