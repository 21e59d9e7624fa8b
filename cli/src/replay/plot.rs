//! The chart: the would-be 429 rate over time, per tier (`--plot out.svg` or
//! `out.png`).
//!
//! Text is drawn with an embedded subset of DejaVu Sans (ASCII and a few
//! symbols, 10 KB; `DejaVuSans-subset.LICENSE` beside it), so charts look
//! the same on machines without fonts.

use super::report::Report;
use super::time::format_axis_label;
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

static FONT: &[u8] = include_bytes!("DejaVuSans-subset.ttf");
static REGISTER: Once = Once::new();

const SIZE: (u32, u32) = (1200, 640);

/// Writes the chart of `report` to `path`: SVG for `.svg`, PNG for `.png`.
///
/// # Errors
/// An unknown extension, or what the drawing backend reports (an
/// unwritable path, for one).
pub fn write_plot(report: &Report, path: &Path) -> Result<(), String> {
    REGISTER.call_once(|| {
        // The font is valid (checked by a test); a failure only loses text.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("svg") => draw(report, SVGBackend::new(path, SIZE).into_drawing_area()),
        Some("png") => draw(report, BitMapBackend::new(path, SIZE).into_drawing_area()),
        _ => Err(format!(
            "{}: the chart is written as .svg or .png",
            path.display()
        )),
    }
}

/// Tableau's 10 colours: distinct, and readable on white.
const PALETTE: [(u8, u8, u8); 10] = [
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (23, 190, 207),
    (188, 189, 34),
    (127, 127, 127),
];

/// Axis ticks on whole minutes, hours or days: the finest step giving at
/// most ten ticks.
fn time_ticks(x0: u64, x1: u64) -> Vec<u64> {
    const STEPS: [u64; 14] = [
        60, 120, 300, 600, 900, 1800, 3600, 7200, 10_800, 21_600, 43_200, 86_400, 172_800, 604_800,
    ];
    let span = x1.saturating_sub(x0).max(1);
    let step = STEPS
        .iter()
        .copied()
        .find(|s| span / s <= 10)
        .unwrap_or_else(|| span.div_ceil(10).max(1));
    let mut t = x0.div_ceil(step) * step;
    let mut ticks = Vec::new();
    while t <= x1 {
        ticks.push(t);
        t += step;
    }
    ticks
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("drawing the chart: {e:?}")
}

#[allow(clippy::cast_precision_loss)]
fn pct(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 * 100.0 / b as f64
    }
}

fn draw<DB: DrawingBackend>(
    report: &Report,
    root: DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let tl = &report.timeline;
    let bucket = tl.bucket_seconds.max(60);
    let (x0, x1) = match (tl.points.first(), tl.points.last()) {
        (Some(f), Some(l)) => (f.start_epoch, l.start_epoch + bucket),
        _ => (0, bucket),
    };
    // Series: every tier, and all requests together.
    let mut series: Vec<(String, Vec<(u64, f64)>)> = report
        .tiers
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let pts = tl
                .points
                .iter()
                .filter(|p| p.requests_by_tier.get(i).copied().unwrap_or(0) > 0)
                .map(|p| {
                    (
                        p.start_epoch + bucket / 2,
                        pct(p.rejected_by_tier[i], p.requests_by_tier[i]),
                    )
                })
                .collect();
            (t.name.clone(), pts)
        })
        .collect();
    series.push((
        "all requests".to_owned(),
        tl.points
            .iter()
            .map(|p| (p.start_epoch + bucket / 2, pct(p.rejected, p.requests)))
            .collect(),
    ));
    let ymax = series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(|p| p.1))
        .fold(0.0f64, f64::max);
    let ymax = if ymax <= 0.0 {
        1.0
    } else {
        (ymax * 1.1).min(100.0)
    };
    let minutes = bucket / 60;
    let caption = format!(
        "Would-be 429 rate per tier (binding tier), {} buckets",
        if minutes.is_multiple_of(60) {
            format!("{} h", minutes / 60)
        } else {
            format!("{minutes} min")
        }
    );
    let with_date = x1 - x0 > 86_400 || {
        let d = |s: u64| s / 86_400;
        d(x0) != d(x1.saturating_sub(1))
    };
    let ticks = time_ticks(x0, x1);
    // The legend goes in a strip of its own below the chart, never over
    // the data: one row of entries, more when they do not fit.
    let names: Vec<String> = series.iter().map(|(n, _)| n.clone()).collect();
    let rows = legend_rows(&names, SIZE.0 - 2 * LEGEND_MARGIN);
    let legend_h = u32::try_from(rows.len()).unwrap_or(1) * LEGEND_ROW + LEGEND_MARGIN;
    let (root, legend) = root.split_vertically(SIZE.1.saturating_sub(legend_h));
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).with_key_points(ticks), 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .y_labels(8)
        .x_label_formatter(&|x| format_axis_label(x * 1_000_000, with_date))
        .y_label_formatter(&|y| format!("{y:.1}%"))
        .x_desc("time (UTC)")
        .y_desc("429s / requests the tier checked")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let n = series.len();
    let mut styles = Vec::with_capacity(n);
    for (k, (_, pts)) in series.into_iter().enumerate() {
        let color = if k + 1 == n {
            BLACK.mix(0.6)
        } else {
            let (r, g, b) = PALETTE[k % PALETTE.len()];
            RGBColor(r, g, b).mix(1.0)
        };
        let style = color.stroke_width(if k + 1 == n { 1 } else { 2 });
        styles.push(style);
        // A series of one point draws no line: mark its points.
        let marks = if pts.len() < 2 { 3 } else { 0 };
        chart
            .draw_series(LineSeries::new(pts, style).point_size(marks))
            .map_err(err)?;
    }
    for (r, row) in rows.iter().enumerate() {
        let y =
            i32::try_from(u32::try_from(r).unwrap_or(0) * LEGEND_ROW + LEGEND_ROW / 2).unwrap_or(0);
        for &(k, x) in row {
            let x = i32::try_from(x + LEGEND_MARGIN).unwrap_or(0);
            legend
                .draw(&PathElement::new(vec![(x, y), (x + 24, y)], styles[k]))
                .map_err(err)?;
            legend
                .draw(&Text::new(
                    names[k].clone(),
                    (x + 30, y - 8),
                    ("sans-serif", 14),
                ))
                .map_err(err)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Height of a legend row and the legend strip's margins, in pixels.
const LEGEND_ROW: u32 = 24;
const LEGEND_MARGIN: u32 = 16;

/// The legend's entries laid out in rows of at most `width` pixels: per
/// row, (series index, x offset). An entry is a 24 px line, a gap and its
/// name (about 8 px a character at 14 px), then 24 px to the next.
fn legend_rows(names: &[String], width: u32) -> Vec<Vec<(usize, u32)>> {
    let mut rows: Vec<Vec<(usize, u32)>> = vec![Vec::new()];
    let mut x = 0u32;
    for (k, name) in names.iter().enumerate() {
        let w = 30 + 8 * u32::try_from(name.chars().count()).unwrap_or(u32::MAX / 16) + 24;
        if x > 0 && x + w > width {
            rows.push(Vec::new());
            x = 0;
        }
        if let Some(row) = rows.last_mut() {
            row.push((k, x));
        }
        x = x.saturating_add(w);
    }
    rows
}
