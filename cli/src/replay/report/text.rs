//! The report as text tables ([`Report::to_text`]).

use super::Report;
use std::fmt::Write as _;

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn pct(r: f64) -> String {
    if r == 0.0 {
        "0%".to_owned()
    } else if r < 0.0001 {
        "<0.01%".to_owned()
    } else {
        format!("{:.2}%", r * 100.0)
    }
}

fn duration(secs: f64) -> String {
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let s = secs.round() as u64;
    let (d, h, m, s) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m"),
        _ => format!("{d}d{h:02}h{m:02}m"),
    }
}

/// A plain-text table.
struct Table {
    header: Vec<&'static str>,
    /// Right-aligned columns.
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn render(&self, out: &mut String) {
        let cols = self.header.len();
        let mut w: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                w[i] = w[i].max(c.chars().count());
            }
        }
        let line = |cells: &[String], out: &mut String| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = w[i].saturating_sub(c.chars().count());
                if i > 0 {
                    s.push_str("  ");
                }
                if self.right[i] {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    if i + 1 < cells.len() {
                        s.push_str(&" ".repeat(pad));
                    }
                }
            }
            out.push_str(s.trim_end());
            out.push('\n');
        };
        let head: Vec<String> = self.header.iter().map(|h| (*h).to_owned()).collect();
        line(&head, out);
        for r in &self.rows {
            line(r, out);
        }
    }
}

impl Report {
    /// The report as text tables, for a terminal.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let i = &self.input;
        let t = &self.totals;
        let _ = writeln!(
            o,
            "Replayed {} requests from {} lines ({} malformed, {} unreplayable), engine {}, {}.",
            thousands(t.requests),
            thousands(i.lines),
            thousands(i.malformed),
            thousands(i.unreplayable),
            self.engine,
            if self.modes == "enforce" {
                "every tier enforced"
            } else {
                "modes as configured"
            }
        );
        if let (Some(first), Some(last)) = (&i.first, &i.last) {
            let _ = writeln!(
                o,
                "Log time: {first} to {last} ({}).",
                duration(i.span_seconds)
            );
        }
        if let Some(m) = &i.first_malformed {
            let _ = writeln!(
                o,
                "First malformed line: {}:{}: {}",
                m.input, m.line, m.reason
            );
        }
        if i.out_of_order > 0 {
            let _ = writeln!(
                o,
                "{} lines were out of time order (at most {:.3} s back): replayed at the latest time seen.",
                thousands(i.out_of_order),
                i.max_step_back_seconds
            );
        }
        let _ = write!(
            o,
            "Would be rejected (429): {} ({})",
            thousands(t.rejected),
            pct(t.rejection_rate)
        );
        if let Some(p) = &self.peak_minute {
            let _ = write!(
                o,
                "; peak minute {} with {} of {} requests",
                p.minute,
                thousands(p.rejected),
                thousands(p.requests)
            );
        }
        o.push_str(".\n");
        let mut extra = Vec::new();
        for (n, label) in [
            (t.delayed, "delayed by shaping"),
            (t.shadow_limited, "shadow-limited"),
            (t.allowlisted, "allowlisted"),
            (t.denylisted, "denylisted"),
            (t.skipped, "no tier applied"),
            (t.fail_open, "failed open"),
            (t.fail_closed, "failed closed"),
        ] {
            if n > 0 {
                extra.push(format!("{} {label}", thousands(n)));
            }
        }
        if !extra.is_empty() {
            let _ = writeln!(o, "Also: {}.", extra.join(", "));
        }

        o.push('\n');
        let mut tiers = Table {
            header: vec![
                "TIER",
                "REQUESTS",
                "429s",
                "RATE",
                "KEYS BLOCKED",
                "PEAK 429 MINUTE",
            ],
            right: vec![false, true, true, true, true, false],
            rows: Vec::new(),
        };
        for tr in &self.tiers {
            tiers.rows.push(vec![
                tr.name.clone(),
                thousands(tr.requests),
                thousands(tr.rejected),
                pct(tr.rejection_rate),
                thousands(tr.distinct_keys_blocked),
                tr.peak_minute.as_ref().map_or_else(
                    || "-".to_owned(),
                    |p| format!("{} ({})", p.minute, thousands(p.rejected)),
                ),
            ]);
        }
        tiers.render(&mut o);

        o.push('\n');
        let mut eps = Table {
            header: vec!["ENDPOINT", "REQUESTS", "429s", "RATE", "BY TIER"],
            right: vec![false, true, true, true, false],
            rows: Vec::new(),
        };
        for e in &self.endpoints {
            eps.rows.push(vec![
                e.endpoint.clone(),
                thousands(e.requests),
                thousands(e.rejected),
                pct(e.rejection_rate),
                e.by_tier
                    .iter()
                    .map(|c| format!("{} {}", c.tier, thousands(c.rejected)))
                    .collect::<Vec<_>>()
                    .join(", "),
            ]);
        }
        eps.render(&mut o);

        if !self.candidates.is_empty() {
            o.push('\n');
            let mut cands = Table {
                header: vec![
                    "TIER",
                    "QUOTA",
                    "REQUESTS",
                    "WOULD DENY",
                    "RATE",
                    "KEYS DENIED",
                ],
                right: vec![false, false, true, true, true, true],
                rows: Vec::new(),
            };
            for c in &self.candidates {
                let live = std::iter::once((format!("{} (live)", c.live.quota), &c.live));
                let others = c.candidates.iter().map(|x| (x.quota.clone(), x));
                for (quota, x) in live.chain(others) {
                    cands.rows.push(vec![
                        c.tier.clone(),
                        quota,
                        thousands(x.requests),
                        thousands(x.would_deny),
                        pct(super::collect::rate(x.would_deny, x.requests)),
                        thousands(x.keys_denied),
                    ]);
                }
            }
            cands.render(&mut o);
        }

        if self.tiers.iter().any(|t| !t.top_blocked_keys.is_empty()) {
            o.push('\n');
            let mut keys = Table {
                header: vec![
                    "TIER",
                    "TOP BLOCKED KEY",
                    "429s",
                    "REQUESTS SINCE 1ST 429",
                    "FIRST 429",
                    "LAST 429",
                ],
                right: vec![false, false, true, true, false, false],
                rows: Vec::new(),
            };
            for tr in &self.tiers {
                for k in &tr.top_blocked_keys {
                    keys.rows.push(vec![
                        tr.name.clone(),
                        k.key.clone(),
                        thousands(k.rejected),
                        thousands(k.requests_since_first_429),
                        k.first.clone(),
                        k.last.clone(),
                    ]);
                }
            }
            keys.render(&mut o);
        }

        if !i.examples.is_empty() || !i.errors.is_empty() {
            o.push('\n');
            for e in &i.errors {
                let _ = writeln!(o, "input error: {}:{}: {}", e.input, e.line, e.reason);
            }
            if !i.examples.is_empty() {
                let skipped = i.malformed + i.unreplayable;
                let _ = writeln!(
                    o,
                    "Lines not replayed ({} of {}, first {} shown):",
                    thousands(skipped),
                    thousands(i.lines),
                    i.examples.len()
                );
                for e in &i.examples {
                    let _ = writeln!(o, "  {}:{}: {}", e.input, e.line, e.reason);
                }
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1234), "1,234");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(pct(0.25), "25.00%");
        assert_eq!(duration(3600.0 * 24.0 * 7.0), "7d00h00m");
        assert_eq!(duration(59.0), "59s");
    }
}
