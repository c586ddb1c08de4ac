//! PNG charts of benchmark reports (feature `plot`).
//!
//! plotters draws text with a TrueType font it must be given; none is bundled, so one is read
//! at run time from `KVQ_FONT` or the usual system locations (DejaVu, Liberation, Noto).

use crate::error::{Error, Result};
use crate::report::DecodeBenchReport;
use plotters::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
];

/// Register a sans-serif font with plotters once per process.
fn ensure_font() -> Result<()> {
    static REGISTERED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let env = std::env::var("KVQ_FONT").ok();
            let path = env
                .iter()
                .map(String::as_str)
                .chain(FONT_CANDIDATES.iter().copied())
                .find(|p| Path::new(p).is_file())
                .ok_or("no TrueType font found: set KVQ_FONT to a .ttf file")?;
            let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{path}: not a usable font"))
        })
        .clone()
        .map_err(Error::InvalidArgument)
}

/// The case a report's chart shows: `llama3-8b` when the report has rows of it (the grid's
/// main family), else the case of its first row; `None` for an empty report.
pub fn chart_case(report: &DecodeBenchReport) -> Option<&str> {
    let has = |case: &str| report.rows.iter().any(|r| r.shape.case == case);
    if has("llama3-8b") {
        Some("llama3-8b")
    } else {
        report.rows.first().map(|r| &*r.shape.case)
    }
}

/// Draw "% of read ceiling vs tokens in the batch (B·L)" with one line per K/V format pair,
/// for the rows of one `case` (e.g. `llama3-8b`), into a PNG at `path`.
pub fn percent_of_ceiling_png(report: &DecodeBenchReport, case: &str, path: &Path) -> Result<()> {
    ensure_font()?;
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in report.rows.iter().filter(|r| r.shape.case == case) {
        series
            .entry(format!("K {} / V {}", r.k_format, r.v_format))
            .or_default()
            .push((
                (r.shape.batch * r.shape.context_len) as f64,
                r.pct_of_ceiling,
            ));
    }
    if series.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "no rows for case '{case}' to plot"
        )));
    }
    let x_max = series.values().flatten().map(|p| p.0).fold(1.0, f64::max) * 1.5;
    let x_min = series
        .values()
        .flatten()
        .map(|p| p.0)
        .fold(f64::MAX, f64::min)
        / 1.5;
    let draw = |e: &dyn std::fmt::Display| Error::InvalidArgument(format!("plot: {e}"));

    let root = BitMapBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "kvq decode, {case}: % of measured read ceiling ({:.0} GB/s, {})",
                report.ceiling_gbps, report.device
            ),
            ("sans-serif", 22),
        )
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(56)
        .build_cartesian_2d((x_min..x_max).log_scale(), 0.0..105.0)
        .map_err(|e| draw(&e))?;
    chart
        .configure_mesh()
        .x_desc("tokens in the batch (B · L), log scale")
        .y_desc("% of read ceiling")
        .x_label_formatter(&|x| match *x {
            x if x >= 1e6 => format!("{:.0}M", x / 1e6),
            x if x >= 1e3 => format!("{:.0}k", x / 1e3),
            x => format!("{x:.0}"),
        })
        .draw()
        .map_err(|e| draw(&e))?;
    for (i, (name, mut pts)) in series.into_iter().enumerate() {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| draw(&e))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))
            .map_err(|e| draw(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{DecodeBenchRow, DecodeCase};

    #[test]
    fn draws_a_png() {
        let mut report = DecodeBenchReport::new("test GPU", 4700.0);
        for (fmt, pct) in [("bf16", 90.0), ("int4-k32", 80.0)] {
            for (b, l) in [(1, 4096), (16, 4096), (64, 16384)] {
                report.rows.push(DecodeBenchRow {
                    shape: DecodeCase::llama3_8b(b, l),
                    k_format: fmt.into(),
                    v_format: fmt.into(),
                    splits: 1,
                    median_us: 1.0,
                    bytes: 1,
                    gbps: 1.0,
                    pct_of_ceiling: pct * (b * l) as f64 / (64.0 * 16384.0),
                    speedup_vs_bf16: None,
                });
            }
        }
        let path = std::env::temp_dir().join(format!("kvq-plot-{}.png", std::process::id()));
        percent_of_ceiling_png(&report, "llama3-8b", &path).unwrap();
        let png = std::fs::read(&path).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert!(percent_of_ceiling_png(&report, "nope", &path).is_err());
        std::fs::remove_file(&path).unwrap();
    }
}
