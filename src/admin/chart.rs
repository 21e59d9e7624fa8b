//! The page's chart: each tier's 429 rate over its history buckets, as
//! inline SVG rendered on the server.

use super::html::Esc;
use crate::observe::recorder::BucketCounts;
use std::fmt::Write as _;

const PALETTE: [&str; 8] = [
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// `HH:MM` (UTC) of an epoch second, `HH:MM:SS` when `step` (the bucket
/// length) is under a minute.
fn clock(t: u64, step: u64) -> String {
    let (h, m, sec) = ((t / 3600) % 24, (t / 60) % 60, t % 60);
    if step < 60 {
        format!("{h:02}:{m:02}:{sec:02}")
    } else {
        format!("{h:02}:{m:02}")
    }
}

/// One tier's line on the chart: its closed buckets and the open one.
pub(super) struct Series {
    pub(super) name: String,
    pub(super) closed: Vec<BucketCounts>,
    /// The bucket not closed yet: drawn as a hollow dot, marked partial.
    pub(super) open: Option<BucketCounts>,
}

impl Series {
    /// Every bucket, oldest first, with whether it is the open one.
    fn points(&self) -> impl Iterator<Item = (&BucketCounts, bool)> + '_ {
        let open = self
            .open
            .as_ref()
            .filter(|o| self.closed.iter().all(|b| b.start < o.start));
        self.closed
            .iter()
            .map(|b| (b, false))
            .chain(open.map(|b| (b, true)))
    }
}

/// The 429 rate (solid) and shadow would-block rate (dashed) of each tier,
/// one point per history bucket and a hollow one for the bucket still open
/// (partial: its counts so far), as an inline SVG.
pub(super) fn chart_svg(series: &[Series]) -> String {
    const W: f64 = 1100.0;
    const H: f64 = 230.0;
    const L: f64 = 52.0;
    const R: f64 = 12.0;
    const T: f64 = 10.0;
    const B: f64 = 24.0;
    let starts: Vec<u64> = series
        .iter()
        .flat_map(|s| s.points().map(|(b, _)| b.start))
        .collect();
    let Some(&last) = starts.iter().max() else {
        return r#"<p class="muted" id="rate-chart-empty">No request checked since the start: the chart shows the current bucket (partial) from the first one on.</p>"#.to_owned();
    };
    // The bucket length, from the closest two bucket starts (the history
    // skips buckets without traffic); a minute when there is one bucket.
    let mut sorted = starts.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let step = sorted
        .windows(2)
        .map(|w| w[1] - w[0])
        .min()
        .unwrap_or(60)
        .max(1);
    let buckets = crate::observe::recorder::HISTORY_BUCKETS as u64;
    let t_max = last + step;
    // The x axis spans the buckets the process has (from its first), not
    // the whole history length: a young process's points spread over the
    // width instead of crowding its right edge. At least 4 buckets, a
    // multiple of 4 (the axis labels fall on bucket starts), at most the
    // history's length.
    let have = (t_max - sorted[0]).div_ceil(step);
    let shown = (have.max(4).div_ceil(4) * 4).min(buckets.max(1));
    let t_min = t_max.saturating_sub(shown * step);
    let rate = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
    let peak = series
        .iter()
        .flat_map(|s| s.points().map(|(b, _)| b))
        .map(|b| rate(b.limited, b.requests).max(rate(b.shadow_limited, b.requests)))
        .fold(0.0f64, f64::max);
    let y_max = [0.05, 0.1, 0.2, 0.5, 1.0]
        .into_iter()
        .find(|m| peak <= *m)
        .unwrap_or(1.0);
    let pw = W - L - R;
    let ph = H - T - B;
    let x = |t: u64| L + pw * (t.saturating_sub(t_min)) as f64 / (t_max - t_min).max(1) as f64;
    let y = |r: f64| T + ph * (1.0 - (r / y_max).min(1.0));
    let mut s = String::with_capacity(8 * 1024);
    let span_min = (t_max - t_min) / 60;
    let _ = write!(
        s,
        r#"<svg id="rate-chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="100%" role="img" aria-label="429 rate per tier, last {span_min} minutes">"#
    );
    // Buckets in which requests passed unchecked (the backend failed and
    // the failure policy is open): shaded behind the lines, so a fail-open
    // period never reads as a quiet one.
    let mut fail_open: Vec<(u64, u64)> = Vec::new();
    for ser in series {
        for (b, _) in ser
            .points()
            .filter(|(b, _)| b.fail_open > 0 && b.start >= t_min)
        {
            match fail_open.iter_mut().find(|(t, _)| *t == b.start) {
                // A request counts once per tier: the most of any tier.
                Some((_, n)) => *n = (*n).max(b.fail_open),
                None => fail_open.push((b.start, b.fail_open)),
            }
        }
    }
    fail_open.sort_unstable();
    for &(t, n) in &fail_open {
        let _ = write!(
            s,
            r##"<rect class="fail-open" x="{:.1}" y="{T}" width="{:.1}" height="{ph:.1}" fill="#fbe0c8"><title>{} UTC: {n} requests passed unchecked (the backend failed; failure policy open)</title></rect>"##,
            x(t),
            x(t + step) - x(t),
            clock(t, step),
        );
    }
    // Grid and axes: five steps of y_max (1, 2, 4, 10 or 20 %).
    for i in 0..=5 {
        let r = y_max * f64::from(i) / 5.0;
        let yy = y(r);
        let _ = write!(
            s,
            r##"<line x1="{L}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="{}" stroke-width="1"/><text x="{}" y="{:.1}" text-anchor="end">{:.0}%</text>"##,
            W - R,
            if i == 0 { "#99a" } else { "#e4e6ea" },
            L - 6.0,
            yy + 4.0,
            r * 100.0
        );
    }
    for i in 0..=4u64 {
        let t = t_min + (t_max - t_min) * i / 4;
        let anchor = match i {
            0 => "start",
            4 => "end",
            _ => "middle",
        };
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="{anchor}">{}</text>"#,
            x(t),
            H - 6.0,
            clock(t, step)
        );
    }
    // Series: runs of adjacent buckets as polylines, every bucket a dot.
    for (i, ser) in series.iter().enumerate() {
        let name = &ser.name;
        let color = PALETTE[i % PALETTE.len()];
        let mut pts: Vec<(&BucketCounts, bool)> =
            ser.points().filter(|(b, _)| b.start >= t_min).collect();
        pts.sort_by_key(|(b, _)| b.start);
        let shadow = pts.iter().any(|(b, _)| b.shadow_limited > 0);
        let lines: &[(bool, &str)] = if shadow {
            &[(false, ""), (true, r#" stroke-dasharray="5 3""#)]
        } else {
            &[(false, "")]
        };
        for &(is_shadow, dash) in lines {
            let value = |b: &BucketCounts| {
                rate(
                    if is_shadow {
                        b.shadow_limited
                    } else {
                        b.limited
                    },
                    b.requests,
                )
            };
            let mut run: Vec<String> = Vec::new();
            let mut prev: Option<u64> = None;
            let flush = |run: &mut Vec<String>, s: &mut String| {
                if run.len() > 1 {
                    let _ = write!(
                        s,
                        r#"<polyline class="series" data-tier="{}" fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                        Esc(name),
                        run.join(" ")
                    );
                }
                run.clear();
            };
            for (b, _) in &pts {
                if prev.is_some_and(|p| b.start - p > step) {
                    flush(&mut run, &mut s);
                }
                prev = Some(b.start);
                run.push(format!("{:.1},{:.1}", x(b.start + step / 2), y(value(b))));
            }
            flush(&mut run, &mut s);
            for &(b, partial) in &pts {
                let n = if is_shadow {
                    b.shadow_limited
                } else {
                    b.limited
                };
                // The open bucket: a hollow dot, its counts so far.
                let (attrs, fill, so_far) = if partial {
                    (
                        format!(r#" class="partial" data-tier="{}""#, Esc(name)),
                        "#fff",
                        " so far (partial: bucket still open)",
                    )
                } else {
                    (String::new(), color, "")
                };
                let _ = write!(
                    s,
                    r#"<circle{attrs} cx="{:.1}" cy="{:.1}" r="{}" fill="{fill}" stroke="{color}" stroke-width="1.5"><title>{} {} UTC: {} of {} {} ({:.1} %){so_far}</title></circle>"#,
                    x(b.start + step / 2),
                    y(value(b)),
                    if partial { "3.5" } else { "2.5" },
                    Esc(name),
                    clock(b.start, step),
                    n,
                    b.requests,
                    if is_shadow {
                        "would be limited (shadow)"
                    } else {
                        "limited"
                    },
                    value(b) * 100.0
                );
            }
        }
    }
    s.push_str("</svg><div class=\"legend\">");
    for (i, ser) in series.iter().enumerate() {
        let _ = write!(
            s,
            r#"<span class="sw" style="background:{}"></span>{}"#,
            PALETTE[i % PALETTE.len()],
            Esc(&ser.name)
        );
    }
    let shaded = if fail_open.is_empty() {
        ""
    } else {
        r#"; <span class="sw" style="background:#fbe0c8"></span>shaded: the backend failed and requests passed unchecked (fail open)"#
    };
    let _ = write!(
        s,
        r#" <span class="muted">— solid: limited / requests checked by the tier; dashed: shadow would-block; hollow dot: the bucket still open (partial, counts so far){shaded}. {step} s buckets, last bucket starts {} UTC.</span></div>"#,
        clock(last, step)
    );
    s
}
