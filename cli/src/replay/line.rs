//! [`Replayer::replay_line`]: one log line parsed, turned into a request head,
//! decided and counted; and how blocked keys are shown.

use super::engine::LoggedStatus;
use super::extension::set_string_extension;
use super::parse;
use super::{EngineImpl, KeyKind, LineOutcome, LogFormat, ReplayError, Replayer};
use axum::extract::MatchedPath;
use http::request::Parts;
use http::{HeaderValue, Method, Uri};
use std::net::SocketAddr;
use tiered_ratelimit::key::UserId;
use tiered_ratelimit::key::{Endpoint, KeyExtractor};
use tiered_ratelimit::rollout::Plan;

impl Replayer {
    /// Replays one line (without its newline) of the current input.
    ///
    /// # Errors
    /// Only when the route matcher and axum disagree on a route (never with
    /// the pinned versions); malformed lines are counted, not errors.
    pub fn replay_line(&mut self, line: &[u8]) -> Result<LineOutcome, ReplayError> {
        self.line_no += 1;
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(LineOutcome::Empty);
        }
        self.collector.input.lines += 1;
        // A byte order mark before the first line is not part of it.
        let line = if self.line_no == 1 {
            line.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(line)
        } else {
            line
        };
        let format = match (self.format, self.input_format) {
            (LogFormat::Auto, Some(f)) => f,
            (LogFormat::Auto, None) => {
                let f = if parse::looks_like_json(line) {
                    LogFormat::Json
                } else {
                    LogFormat::Combined
                };
                self.input_format = Some(f);
                f
            }
            (f, _) => f,
        };
        let mut parsed = self.parser.parse(format, line, &mut self.rec);
        if parsed.is_err() && self.format == LogFormat::Auto && !self.format_confirmed {
            // Detected from a line that reads in neither format (a partial
            // first line, say): until a line reads, one that reads in the
            // other format switches the input to it.
            let other = match format {
                LogFormat::Json => LogFormat::Combined,
                _ => LogFormat::Json,
            };
            if self.parser.parse(other, line, &mut self.rec).is_ok() {
                self.input_format = Some(other);
                parsed = Ok(());
            }
        }
        if parsed.is_ok() {
            self.format_confirmed = true;
        }
        if let Err((reason, malformed)) = parsed {
            self.collector
                .issue(&self.input_name, self.line_no, reason, malformed);
            return Ok(if malformed {
                LineOutcome::Malformed(reason)
            } else {
                LineOutcome::Unreplayable(reason)
            });
        }
        let rec = &self.rec;
        let Ok(method) = Method::from_bytes(rec.method.get().unwrap_or_default()) else {
            let reason = "invalid HTTP method";
            self.collector
                .issue(&self.input_name, self.line_no, reason, false);
            return Ok(LineOutcome::Unreplayable(reason));
        };
        // The target is copied into an arena the URI then shares (one
        // allocation per 64 KiB of targets, not one per line).
        self.uri_buf
            .extend_from_slice(rec.target.get().unwrap_or_default());
        let Ok(uri) = Uri::from_maybe_shared(self.uri_buf.split().freeze()) else {
            let reason = "invalid request target";
            self.collector
                .issue(&self.input_name, self.line_no, reason, false);
            return Ok(LineOutcome::Unreplayable(reason));
        };
        // The virtual clock: the log's time, never going back.
        let t = rec.time_us.unwrap_or(0);
        let now = self.clock_us.map_or(t, |c| c.max(t));
        self.clock_us = Some(now);
        self.clock.set(now);
        if self.demand {
            super::suggest::flush_demand(&mut self.demand_second, &self.handle, now);
        }
        self.collector.time(t, now);

        // The request head.
        let route = self.routes.find(uri.path());
        let p = &mut self.parts;
        p.method = method;
        p.uri = uri;
        p.headers.clear();
        for (name, v) in self.parser.headers.iter().zip(&rec.headers) {
            if let Some(Ok(v)) = v.get().map(HeaderValue::from_bytes) {
                p.headers.append(name.clone(), v);
            }
        }
        // Extensions are updated in place where they exist: an insert
        // boxes its value (and frees the one it replaces) on every line.
        if let Some(ip) = rec.ip {
            let addr = SocketAddr::new(ip, 0);
            match p.extensions.get_mut::<SocketAddr>() {
                Some(a) => *a = addr,
                None => {
                    p.extensions.insert(addr);
                }
            }
        }
        set_string_extension::<UserId>(&mut p.extensions, rec.user.get(), &mut self.spare.user);
        set_string_extension::<Plan>(&mut p.extensions, rec.plan.get(), &mut self.spare.plan);
        // The `MatchedPath` in the head is the previous line's route's: set
        // only when the route changes.
        if route != self.matched_route {
            match route {
                Some(i) => {
                    let m = self
                        .routes
                        .matched_path(i, &p.uri)
                        .map_err(ReplayError::Engine)?;
                    match p.extensions.get_mut::<MatchedPath>() {
                        Some(old) => *old = m,
                        None => {
                            p.extensions.insert(m);
                        }
                    }
                }
                None => {
                    p.extensions.remove::<MatchedPath>();
                }
            }
            self.matched_route = route;
        }
        let status = rec.status;
        let endpoint = match self.endpoint_ids.get(&(p.method.clone(), route)) {
            Some(&e) => e,
            None => {
                let label = Endpoint
                    .extract(p)
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| format!("{} <unmatched>", p.method));
                let e = self.collector.add_endpoint(label);
                self.endpoint_ids.insert((p.method.clone(), route), e);
                e
            }
        };

        let outcome = match &mut self.engine {
            EngineImpl::Direct(d) => d.decide(&self.offline, &mut self.checks, &self.parts),
            EngineImpl::Layer(l) => {
                self.offline.plan(&self.parts, &mut self.checks);
                let req = layer_request(&self.parts, status);
                l.decide(&self.checks, req)
            }
        };
        let display = |c: usize| -> String {
            let tier = self.checks.tier(c);
            match &self.key_kinds[tier] {
                KeyKind::Header(h) => {
                    let v = self
                        .parts
                        .headers
                        .get(h)
                        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                        .unwrap_or_default();
                    if self.show_keys {
                        v
                    } else {
                        mask(&v)
                    }
                }
                KeyKind::Plain => shorten(&self.offline.raw_key(tier, &self.parts)),
            }
        };
        let blocked = outcome.binding_check.map(|c| (c, move || display(c)));
        let blocked_ref: Option<(usize, &dyn Fn() -> String)> = blocked
            .as_ref()
            .map(|(c, f)| (*c, f as &dyn Fn() -> String));
        self.collector.request(
            now,
            endpoint,
            &self.checks,
            &outcome.decision,
            blocked_ref,
            outcome.shadow_tiers,
        );
        Ok(LineOutcome::Replayed(outcome.decision))
    }
}

/// The request the layer engine sends: the planner's head without the
/// `MatchedPath` (axum sets its own), plus the logged status for the app.
fn layer_request(p: &Parts, status: Option<u16>) -> http::Request<axum::body::Body> {
    let mut req = http::Request::new(axum::body::Body::empty());
    *req.method_mut() = p.method.clone();
    *req.uri_mut() = p.uri.clone();
    *req.headers_mut() = p.headers.clone();
    let ext = req.extensions_mut();
    if let Some(a) = p.extensions.get::<SocketAddr>() {
        ext.insert(*a);
    }
    if let Some(u) = p.extensions.get::<UserId>() {
        ext.insert(u.clone());
    }
    if let Some(plan) = p.extensions.get::<Plan>() {
        ext.insert(plan.clone());
    }
    if let Some(s) = status {
        ext.insert(LoggedStatus(s));
    }
    req
}

/// An API key as shown in reports: `sk_l…9f3a`.
fn mask(v: &str) -> String {
    let chars: Vec<char> = v.chars().collect();
    if chars.len() <= 8 {
        let head: String = chars.iter().take(2).collect();
        format!("{head}…")
    } else {
        let head: String = chars.iter().take(4).collect();
        let tail: String = chars[chars.len() - 4..].iter().collect();
        format!("{head}…{tail}")
    }
}

/// Long keys cut to 80 characters for display.
fn shorten(v: &str) -> String {
    if v.chars().count() <= 80 {
        v.to_owned()
    } else {
        let head: String = v.chars().take(79).collect();
        format!("{head}…")
    }
}
