//! The HTML page: no script, everything escaped, forms that post back to
//! `POST /mode`.

use super::api::window_hours;
use super::chart::{chart_svg, Series};
use super::form::form_pairs;
use super::html::Esc;
use super::mode::scope;
use super::reply::{base_of, page_path};
use super::Admin;
use crate::handle::{InspectError, KeyStatus};
use crate::rollout::Mode;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use http::{header, HeaderValue};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#222;background:#f6f7f9}\
header{background:#1d2733;color:#fff;padding:10px 20px;display:flex;gap:16px;align-items:center;flex-wrap:wrap}\
header h1{font-size:18px;margin:0 12px 0 0}\
main{padding:12px 20px;display:grid;grid-template-columns:1fr 1fr;gap:12px}\
section{background:#fff;border:1px solid #dde;border-radius:6px;padding:10px 14px}\
section.wide{grid-column:1/3}\
h2{font-size:15px;margin:2px 0 8px}\
h3{font-size:14px;margin:12px 0 6px}\
table{border-collapse:collapse;width:100%}\
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top}\
th{font-weight:600;color:#556}\
td.n{text-align:right;font-variant-numeric:tabular-nums}\
code{font-size:13px;word-break:break-all}\
.badge{display:inline-block;padding:2px 8px;border-radius:10px;font-weight:600;font-size:13px}\
.enforce{background:#2e7d32;color:#fff}.shadow{background:#6a6f7a;color:#fff}\
.canary{background:#ef6c00;color:#fff}.off{background:#c62828;color:#fff}\
.closed{background:#2e7d32;color:#fff}.open{background:#c62828;color:#fff}.half_open{background:#ef6c00;color:#fff}\
.alert{background:#fdecea}\
form{display:inline;margin:0}\
button{font:inherit;padding:3px 10px;border-radius:4px;border:1px solid #889;background:#fff;cursor:pointer}\
button.kill{background:#c62828;color:#fff;border-color:#8e0000;font-weight:700}\
button.resume{background:#2e7d32;color:#fff;border-color:#1b5e20;font-weight:700}\
.muted{color:#778}.scope{font-size:12px;opacity:.85}header .muted{color:#aab}.sw{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px;border-radius:2px}\
svg text{font:11px system-ui,sans-serif;fill:#556}";

/// A key looked up from the page: its tier, key, and what peek answered.
type Lookup = (String, String, Result<KeyStatus, InspectError>);

pub(super) async fn page(State(admin): State<Arc<Admin>>, req: Request) -> Response {
    let base = base_of(&req);
    let (mut tier, mut key) = (None, None);
    for (k, v) in form_pairs(req.uri().query().unwrap_or("")) {
        match k.as_str() {
            "peek_tier" => tier = Some(v),
            "peek_key" => key = Some(v),
            _ => {}
        }
    }
    let lookup = match (tier, key) {
        (Some(t), Some(k)) if !k.is_empty() => {
            let r = admin.handle.peek(&t, &k).await;
            Some((t, k, r))
        }
        _ => None,
    };
    // Each tier taking overrides, with its list (or why it could not be read).
    let mut overrides = Vec::new();
    for t in admin.handle.tiers().into_iter().filter(|t| t.overrides) {
        let list = admin.handle.overrides(&t.name).await;
        overrides.push((t.name, list));
    }
    let log = if admin.handle.planned_tiers().is_empty() {
        None
    } else {
        Some(
            admin
                .handle
                .rollout_log(super::plan::PAGE_LOG_ENTRIES)
                .await,
        )
    };
    let html = render_page(&admin, &base, lookup.as_ref(), &overrides, log.as_ref());
    let mut res = Response::new(Body::from(html));
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; img-src data:; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    res
}

fn mode_badge(m: Mode) -> String {
    format!(
        r#"<span class="badge {}">{}</span>"#,
        m.label(),
        Esc(&m.to_string())
    )
}

/// A `<select name="mode">` of the usual modes, `current` selected.
fn mode_select(current: Mode) -> String {
    let mut modes = vec![
        Mode::Enforce,
        Mode::Canary { percent: 50 },
        Mode::Canary { percent: 10 },
        Mode::Canary { percent: 1 },
        Mode::Shadow,
        Mode::Off,
    ];
    if !modes.contains(&current) {
        modes.insert(1, current);
    }
    let mut s = String::from(r#"<select name="mode">"#);
    for m in modes {
        let v = m.to_string();
        let sel = if m == current { " selected" } else { "" };
        let _ = write!(s, r#"<option value="{0}"{sel}>{0}</option>"#, Esc(&v));
    }
    s.push_str("</select>");
    s
}

/// Each tier taking overrides, and its list.
type OverrideLists = [(
    String,
    Result<Vec<crate::handle::OverrideEntry>, crate::handle::OverrideError>,
)];

fn render_page(
    admin: &Admin,
    base: &str,
    lookup: Option<&Lookup>,
    overrides: &OverrideLists,
    log: Option<&Result<Vec<crate::rollout::RolloutEvent>, crate::engine::ControlError>>,
) -> String {
    let h = &admin.handle;
    let mode = h.mode();
    let tiers = h.tiers();
    let counts = h.counts();
    let anomalies = h.anomalies();
    let action = format!("{base}/mode");
    // Beside every button: where it applies.
    let scope = match h.fleet_control_key() {
        Some(key) => format!(
            r#" <span class="scope">all instances (control key <code>{}</code>)</span>"#,
            Esc(key)
        ),
        None => format!(r#" <span class="scope">{}</span>"#, Esc(&scope(h))),
    };
    let rendered = h.now_s();
    let mut s = String::with_capacity(16 * 1024);
    let _ = write!(
        s,
        r#"<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>rate limiter admin</title><meta name="viewport" content="width=device-width,initial-scale=1"><meta http-equiv="refresh" content="{}"><style>{CSS}</style></head><body>"#,
        admin.refresh.as_secs()
    );

    // Header: mode, circuit, kill switch.
    let circuit = h.circuit_state();
    let _ = write!(
        s,
        r#"<header><h1>tiered-ratelimit</h1><span id="mode">mode {}</span><span>circuit <span class="badge {c}" id="circuit">{c}</span></span>"#,
        mode_badge(mode),
        c = Esc(circuit),
    );
    let alerting = anomalies.iter().filter(|a| a.alerting).count();
    let _ = write!(
        s,
        r#"<span>anomalies <span class="badge {}" id="alerting">{alerting} alerting</span></span>"#,
        if alerting == 0 { "closed" } else { "open" }
    );
    let effective = h.effective_mode();
    if effective != mode {
        let _ = write!(
            s,
            r#"<span id="override">in force {} (the fleet control key overrides this page)</span>"#,
            mode_badge(effective)
        );
    }
    if mode == Mode::Off {
        let _ = write!(
            s,
            r#"<form method="post" action="{}"><input type="hidden" name="mode" value="enforce"><button class="resume" id="resume">Resume: enforce</button>{scope}</form>"#,
            Esc(&action)
        );
    } else {
        let _ = write!(
            s,
            r#"<form method="post" action="{}"><input type="hidden" name="mode" value="off"><button class="kill" id="kill-switch">Kill switch: mode off</button>{scope}</form>"#,
            Esc(&action)
        );
    }
    let _ = write!(
        s,
        r#"<form method="post" action="{}">{} <button>set global mode</button>{scope}</form><span id="rendered" class="muted">rendered {}, refreshes every {} s</span></header><main>"#,
        Esc(&action),
        mode_select(mode),
        humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs(rendered)),
        admin.refresh.as_secs()
    );

    // The chart.
    let series: Vec<Series> = tiers
        .iter()
        .map(|t| Series {
            name: t.name.clone(),
            closed: h.history(&t.name).unwrap_or_default(),
            open: h.open_bucket(&t.name),
        })
        .collect();
    s.push_str(r#"<section class="wide"><h2>429 rate per tier</h2>"#);
    s.push_str(&chart_svg(&series));
    s.push_str("</section>");

    // Tiers.
    s.push_str(r#"<section class="wide"><h2>Tiers</h2><table id="tiers"><tr><th>tier</th><th>mode</th><th>effective</th><th>algorithm</th><th>quota</th><th>plans</th><th>set mode</th></tr>"#);
    for t in &tiers {
        let plans: Vec<String> = t
            .plans
            .iter()
            .map(|(p, q)| format!("{}: {}", Esc(p), quota_text(q)))
            .collect();
        let _ = write!(
            s,
            r#"<tr><td><code>{name}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><form method="post" action="{action}"><input type="hidden" name="tier" value="{name}">{} <button>set</button>{scope}</form></td></tr>"#,
            mode_badge(t.mode),
            mode_badge(t.effective_mode),
            t.algorithm.name(),
            quota_text(&t.quota),
            if plans.is_empty() {
                "<span class=\"muted\">–</span>".to_owned()
            } else {
                plans.join("<br>")
            },
            mode_select(t.mode),
            name = Esc(&t.name),
            action = Esc(&action),
        );
    }
    s.push_str("</table></section>");
    super::candidates::render_candidates(&mut s, admin, &tiers);
    super::settings::render_settings(&mut s, base, h, &tiers, &scope);
    super::plan::render_plans(&mut s, base, h, log);

    // Top blocked keys: refused, and apart from them the keys a tier not
    // enforced for them would have refused (they got their answer).
    let hours = window_hours(admin.window);
    let _ = write!(
        s,
        r#"<section><h2>Top blocked keys, last {hours} h</h2><table id="top-blocked"><tr><th>tier</th><th>key</th><th class="n">refused (429)</th><th class="n">± error</th><th></th></tr>"#
    );
    top_rows(&mut s, admin, &tiers, base, false);
    let _ = write!(
        s,
        r#"<h3>Would have been blocked (shadow, or a canary not enforced for the key): let through</h3><table id="top-shadow-limited"><tr><th>tier</th><th>key</th><th class="n">would be refused</th><th class="n">± error</th><th></th></tr>"#
    );
    top_rows(&mut s, admin, &tiers, base, true);
    s.push_str("</section>");
    render_lookup(&mut s, &tiers, base, lookup);
    if !overrides.is_empty() {
        render_overrides(&mut s, base, overrides);
    }

    // Counts and anomalies.
    // One figure for the 429s the limiter answered, however answered,
    // split below it.
    let _ = write!(
        s,
        r#"<section><h2>Requests since start</h2><table id="counts"><tr id="count-429s"><th>429s</th><th class="n">{}</th></tr><tr class="split"><td>&nbsp;&nbsp;limited (the backend's, and a key's first from the deny cache)</td><td class="n">{}</td></tr><tr class="split"><td>&nbsp;&nbsp;cache_blocked (the deny cache's, no backend call)</td><td class="n">{}</td></tr>"#,
        counts.limited + counts.cache_blocked,
        counts.limited,
        counts.cache_blocked
    );
    for (k, v) in [
        ("allowed", counts.allowed),
        ("shadow_limited", counts.shadow_limited),
        ("allowlisted", counts.allowlisted),
        ("denylisted", counts.denylisted),
        ("fail_open", counts.fail_open),
        ("fail_closed", counts.fail_closed),
        ("fallback", counts.fallback),
        ("skipped", counts.skipped),
    ] {
        let _ = write!(s, r#"<tr><td>{k}</td><td class="n">{v}</td></tr>"#);
    }
    s.push_str("</table>");
    let _ = write!(
        s,
        r#"<h2 style="margin-top:12px">429-rate anomalies: {alerting} alerting</h2><table id="anomalies"><tr><th>tier</th><th>endpoint</th><th class="n">rate</th><th class="n">baseline</th><th class="n">σ</th></tr>"#
    );
    if anomalies.is_empty() {
        s.push_str(r#"<tr><td colspan="5" class="muted">no baseline yet</td></tr>"#);
    }
    for a in &anomalies {
        let _ = write!(
            s,
            r#"<tr{}><td><code>{}</code></td><td><code>{}</code></td><td class="n">{:.1} %</td><td class="n">{:.1} %</td><td class="n">{:.1} %</td></tr>"#,
            if a.alerting { r#" class="alert""# } else { "" },
            Esc(&a.tier),
            Esc(&a.endpoint),
            a.rate * 100.0,
            a.mean * 100.0,
            a.sigma * 100.0
        );
    }
    s.push_str("</table></section>");

    let _ = write!(
        s,
        r#"<section class="wide muted">JSON: <code>{b}/api/status</code>, <code>{b}/api/top/&lt;tier&gt;</code>, <code>{b}/api/history/&lt;tier&gt;</code>, <code>{b}/api/anomalies</code>, <code>POST {b}/api/mode</code> (bearer token). Counts, history and top keys are this process's only.</section></main></body></html>"#,
        b = Esc(base)
    );
    s
}

/// A stored key part as people read it ([`readable_key_part`]: decoded,
/// control characters shown as U+FFFD), its stored form as the tooltip;
/// both HTML-escaped (a key is text a client chose).
///
/// [`readable_key_part`]: crate::key::readable_key_part
/// The rows of a top-keys table, every tier's heaviest first, and its
/// closing tag: the keys refused, or (`shadow`) the keys a tier not
/// enforced for them would have refused.
fn top_rows(
    s: &mut String,
    admin: &Admin,
    tiers: &[crate::handle::TierStatus],
    base: &str,
    shadow: bool,
) {
    let h = &admin.handle;
    let key_action = format!("{base}/key");
    let mut any = false;
    for t in tiers {
        let top = if shadow {
            h.top_shadow_limited(&t.name, admin.top_n, admin.window)
        } else {
            h.top_blocked(&t.name, admin.top_n, admin.window)
        };
        for k in top.unwrap_or_default() {
            any = true;
            let lift = if t.penalty && !shadow {
                r#" <button name="action" value="lift">lift block</button>"#
            } else {
                ""
            };
            let _ = write!(
                s,
                r#"<tr><td><code>{}</code></td><td>{}</td><td class="n">{}</td><td class="n">{}</td><td><form method="post" action="{}"><input type="hidden" name="tier" value="{}"><input type="hidden" name="key" value="{}"><button name="action" value="reset">reset</button>{lift}</form></td></tr>"#,
                Esc(&t.name),
                key_cell(&k.key),
                k.count,
                k.error,
                Esc(&key_action),
                Esc(&t.name),
                Esc(&k.key),
            );
        }
    }
    if !any {
        let none = if shadow {
            "nothing would have been blocked in this window"
        } else {
            "nothing blocked in this window"
        };
        let _ = write!(s, r#"<tr><td colspan="5" class="muted">{none}</td></tr>"#);
    }
    s.push_str("</table>");
}

fn key_cell(stored: &str) -> String {
    let shown: String = crate::key::readable_key_part(stored)
        .chars()
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect();
    format!(
        r#"<code class="key" title="{}">{}</code>"#,
        Esc(stored),
        Esc(&shown)
    )
}

fn quota_text(q: &crate::quota::Quota) -> String {
    let mut s = format!("{} / {}", q.limit(), humantime::format_duration(q.period()));
    if q.burst_size() != q.limit() {
        let _ = write!(s, ", burst {}", q.burst_size());
    }
    s
}

/// "Why is this key blocked?": a key's numbers ([`handle`](crate::handle#peek-reset-and-lift)).
fn render_lookup(
    s: &mut String,
    tiers: &[crate::handle::TierStatus],
    base: &str,
    lookup: Option<&Lookup>,
) {
    let page = page_path(base);
    let (cur_tier, cur_key) = lookup.map_or(("", ""), |(t, k, _)| (t.as_str(), k.as_str()));
    let _ = write!(
        s,
        r#"<section><h2>Look up a key</h2><form method="get" action="{}"><select name="peek_tier">"#,
        Esc(page)
    );
    for t in tiers {
        let sel = if t.name == cur_tier { " selected" } else { "" };
        let _ = write!(s, r#"<option{sel}>{}</option>"#, Esc(&t.name));
    }
    let _ = write!(
        s,
        r#"</select> <input name="peek_key" value="{}" placeholder="key (as shown, or stored)"> <button>peek</button></form>"#,
        Esc(cur_key)
    );
    match lookup {
        None => {}
        Some((_, _, Ok(st))) => {
            let blocked = st.blocked_for.map_or_else(
                || "no".to_owned(),
                |d| format!("for {} s", d.as_secs_f64().ceil()),
            );
            let _ = write!(
                s,
                r#"<table id="lookup"><tr><th>next request</th><td>{}</td></tr><tr><th>limit</th><td class="n">{}</td></tr><tr><th>remaining after it</th><td class="n">{}</td></tr><tr><th>full again in</th><td class="n">{} s</td></tr><tr><th>passes in</th><td class="n">{} s</td></tr><tr><th>penalty box</th><td>{}</td></tr>{}</table>"#,
                if st.allowed { "allowed" } else { "denied" },
                st.limit,
                st.remaining,
                st.reset_after.as_secs_f64().ceil(),
                st.retry_after.as_secs_f64().ceil(),
                Esc(&blocked),
                renews_row(st.renews_at_us),
            );
        }
        Some((_, _, Err(e))) => {
            let _ = write!(
                s,
                r#"<p id="lookup" class="muted">{}</p>"#,
                Esc(&e.to_string())
            );
        }
    }
    s.push_str("</section>");
}

/// Per-key overrides ([`handle`](crate::handle#per-key-overrides)): each tier's list with a remove
/// button, and a form to add one (`POST /key`, `action=override`).
fn render_overrides(s: &mut String, base: &str, lists: &OverrideLists) {
    let action = format!("{base}/key");
    s.push_str(r#"<section><h2>Per-key overrides</h2><table id="overrides"><tr><th>tier</th><th>key</th><th>rule</th><th>expires</th><th></th></tr>"#);
    for (tier, list) in lists {
        match list {
            Err(e) => {
                let _ = write!(
                    s,
                    r#"<tr><td><code>{}</code></td><td colspan="4" class="muted">{}</td></tr>"#,
                    Esc(tier),
                    Esc(&e.to_string())
                );
            }
            Ok(list) => {
                for o in list {
                    let expires = o.expires_at_us.map_or_else(
                        || "never".to_owned(),
                        |u| {
                            humantime::format_rfc3339_seconds(
                                std::time::UNIX_EPOCH + std::time::Duration::from_micros(u),
                            )
                            .to_string()
                        },
                    );
                    let _ = write!(
                        s,
                        r#"<tr><td><code>{t}</code></td><td>{shown}</td><td>{r}</td><td>{expires}</td><td><form method="post" action="{a}"><input type="hidden" name="action" value="remove_override"><input type="hidden" name="tier" value="{t}"><input type="hidden" name="key" value="{k}"><button>remove</button></form></td></tr>"#,
                        shown = key_cell(&o.key),
                        t = Esc(tier),
                        k = Esc(&o.key),
                        r = Esc(&o.rule.to_string()),
                        a = Esc(&action),
                    );
                }
            }
        }
    }
    let _ = write!(
        s,
        r#"</table><form method="post" action="{}"><input type="hidden" name="action" value="override"><select name="tier">"#,
        Esc(&action)
    );
    for (tier, _) in lists {
        let _ = write!(s, r#"<option>{}</option>"#, Esc(tier));
    }
    s.push_str(r#"</select> <input name="key" placeholder="key (as shown, or stored)"> <input name="rule" placeholder="unlimited | blocked | 1000/1m"> <input name="ttl" placeholder="ttl (1d), empty: none"> <button>set</button></form></section>"#);
}

/// A calendar quota's renewal (RFC 3339, UTC) as a row of the lookup table.
fn renews_row(at_us: Option<u64>) -> String {
    let at = at_us.map(|us| {
        humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_micros(us))
    });
    at.map_or_else(String::new, |t| {
        format!("<tr><th>quota renews</th><td>{t}</td></tr>")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_html() {
        assert_eq!(
            Esc(r#"<a href="x">'&'</a>"#).to_string(),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
        assert_eq!(Esc("plain ✓").to_string(), "plain ✓");
    }
}
