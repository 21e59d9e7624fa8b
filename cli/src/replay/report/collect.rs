//! The [`Collector`]: every decision counted as it is made, per tier,
//! endpoint, key and minute, then turned into the [`Report`].

use super::fx::FxMap;
use super::timeline::{timeline, MinuteAcc};
use super::{
    BlockedKey, EndpointReport, InputSummary, LineIssue, PeakMinute, Report, TierCount, TierReport,
    TierSummary, Totals, MINUTE_US,
};
use crate::replay::time::{format_utc_minute, format_utc_seconds};
use std::collections::BTreeMap;
use tiered_ratelimit::offline::{Admission, Checks};

struct KeyAcc {
    display: String,
    rejected: u64,
    /// Requests on the tier from the first would-be 429 on (included).
    requests: u64,
    first_us: u64,
    last_us: u64,
}

struct TierAcc {
    name: String,
    applied: u64,
    rejected: u64,
    shadow_limited: u64,
    keys: FxMap<String, KeyAcc>,
}

struct EndpointAcc {
    label: String,
    requests: u64,
    rejected: u64,
    by_tier: Vec<u64>,
}

/// Accumulates decisions.
pub(crate) struct Collector {
    tiers: Vec<TierAcc>,
    endpoints: Vec<EndpointAcc>,
    minutes: BTreeMap<u64, MinuteAcc>,
    cur_minute: Option<u64>,
    cur: MinuteAcc,
    pub(crate) input: InputSummary,
    totals: Totals,
    first_us: Option<u64>,
    last_us: u64,
    max_examples: usize,
}

impl Collector {
    pub(crate) fn new(tier_names: Vec<String>, max_examples: usize) -> Self {
        let n = tier_names.len();
        Self {
            tiers: tier_names
                .into_iter()
                .map(|name| TierAcc {
                    name,
                    applied: 0,
                    rejected: 0,
                    shadow_limited: 0,
                    keys: FxMap::default(),
                })
                .collect(),
            endpoints: Vec::new(),
            minutes: BTreeMap::new(),
            cur_minute: None,
            cur: MinuteAcc::new(n),
            input: InputSummary::default(),
            totals: Totals::default(),
            first_us: None,
            last_us: 0,
            max_examples,
        }
    }

    /// Registers an endpoint label; returns its index.
    pub(crate) fn add_endpoint(&mut self, label: String) -> usize {
        if let Some(i) = self.endpoints.iter().position(|e| e.label == label) {
            return i;
        }
        let n = self.tiers.len();
        self.endpoints.push(EndpointAcc {
            label,
            requests: 0,
            rejected: 0,
            by_tier: vec![0; n],
        });
        self.endpoints.len() - 1
    }

    pub(crate) fn issue(&mut self, input: &str, line: u64, reason: &str, malformed: bool) {
        if malformed {
            self.input.malformed += 1;
            if self.input.first_malformed.is_none() {
                self.input.first_malformed = Some(LineIssue {
                    input: input.to_owned(),
                    line,
                    reason: reason.to_owned(),
                });
            }
        } else {
            self.input.unreplayable += 1;
        }
        if self.input.examples.len() < self.max_examples {
            self.input.examples.push(LineIssue {
                input: input.to_owned(),
                line,
                reason: reason.to_owned(),
            });
        }
    }

    pub(crate) fn input_error(&mut self, input: &str, line: u64, error: String) {
        self.input.errors.push(LineIssue {
            input: input.to_owned(),
            line,
            reason: error,
        });
    }

    /// The time of a replayed request (`clock` is the virtual clock after
    /// it: never behind).
    pub(crate) fn time(&mut self, t_us: u64, clock_us: u64) {
        if t_us < clock_us {
            self.input.out_of_order += 1;
            #[allow(clippy::cast_precision_loss)]
            let back = (clock_us - t_us) as f64 / 1e6;
            if back > self.input.max_step_back_seconds {
                self.input.max_step_back_seconds = back;
            }
        }
        if self.first_us.is_none() {
            self.first_us = Some(clock_us);
        }
        self.last_us = self.last_us.max(clock_us);
        let m = clock_us / MINUTE_US;
        if self.cur_minute != Some(m) {
            self.flush_minute();
            self.cur_minute = Some(m);
        }
    }

    fn flush_minute(&mut self) {
        if let Some(m) = self.cur_minute.take() {
            let n = self.tiers.len();
            let cur = std::mem::replace(&mut self.cur, MinuteAcc::new(n));
            match self.minutes.get_mut(&m) {
                Some(acc) => acc.merge(&cur),
                None => {
                    self.minutes.insert(m, cur);
                }
            }
        }
    }

    /// Counts one replayed request: `planned` holds the checks the layer
    /// made (tier and key each); `blocked` the binding check's index and
    /// the key's display form when rejected; `shadow_tiers` a bit per tier
    /// index.
    pub(crate) fn request(
        &mut self,
        now_us: u64,
        endpoint: usize,
        planned: &Checks,
        decision: &Admission,
        blocked: Option<(usize, &dyn Fn() -> String)>,
        shadow_tiers: u64,
    ) {
        self.input.replayed += 1;
        let t = &mut self.totals;
        t.requests += 1;
        self.cur.requests += 1;
        for c in 0..planned.len() {
            let i = planned.tier(c);
            let tier = &mut self.tiers[i];
            tier.applied += 1;
            self.cur.applied[i] += 1;
            // The key is read only for a tier with blocked keys to count.
            if !tier.keys.is_empty() {
                if let Some(k) = tier.keys.get_mut(planned.key_part(c)) {
                    k.requests += 1;
                }
            }
        }
        let e = &mut self.endpoints[endpoint];
        e.requests += 1;
        match decision {
            Admission::Allowed {
                delayed,
                shadow_limited,
            } => {
                t.allowed += 1;
                t.delayed += u64::from(*delayed);
                t.shadow_limited += u64::from(*shadow_limited);
            }
            Admission::Rejected { .. } => {
                t.rejected += 1;
                e.rejected += 1;
                self.cur.rejected += 1;
                if let Some((c, display)) = blocked.filter(|(c, _)| *c < planned.len()) {
                    let (i, key) = (planned.tier(c), planned.key_part(c));
                    e.by_tier[i] += 1;
                    self.cur.rejected_by[i] += 1;
                    let tier = &mut self.tiers[i];
                    tier.rejected += 1;
                    match tier.keys.get_mut(key) {
                        Some(k) => {
                            k.rejected += 1;
                            k.last_us = now_us;
                        }
                        None => {
                            tier.keys.insert(
                                key.to_owned(),
                                KeyAcc {
                                    display: display(),
                                    rejected: 1,
                                    requests: 1,
                                    first_us: now_us,
                                    last_us: now_us,
                                },
                            );
                        }
                    }
                }
            }
            Admission::Allowlisted => t.allowlisted += 1,
            Admission::Denylisted => t.denylisted += 1,
            Admission::Skipped => t.skipped += 1,
            Admission::FailOpen => t.fail_open += 1,
            Admission::FailClosed => t.fail_closed += 1,
            // A decision this version of the report does not know.
            _ => {}
        }
        if shadow_tiers != 0 {
            for (i, tier) in self.tiers.iter_mut().enumerate() {
                if i < 64 && shadow_tiers & (1 << i) != 0 {
                    tier.shadow_limited += 1;
                }
            }
        }
    }

    pub(crate) fn finish(
        mut self,
        engine: &'static str,
        modes: &'static str,
        policy: Vec<TierSummary>,
        routes: Vec<String>,
        top: usize,
        shadow_known: bool,
    ) -> Report {
        self.flush_minute();
        let n = self.tiers.len();
        let mut input = self.input;
        input.first = self.first_us.map(format_utc_seconds);
        input.last = self.first_us.map(|_| format_utc_seconds(self.last_us));
        #[allow(clippy::cast_precision_loss)]
        {
            input.span_seconds = self
                .first_us
                .map_or(0.0, |f| (self.last_us - f) as f64 / 1e6);
        }
        let mut totals = self.totals;
        totals.rejection_rate = rate(totals.rejected, totals.requests);

        let peak = |f: &dyn Fn(&MinuteAcc) -> (u64, u64)| -> Option<PeakMinute> {
            let mut best: Option<(u64, u64, u64)> = None;
            for (m, acc) in &self.minutes {
                let (rej, req) = f(acc);
                if rej > 0 && best.is_none_or(|(_, r, _)| rej > r) {
                    best = Some((*m, rej, req));
                }
            }
            best.map(|(m, rejected, requests)| PeakMinute {
                minute: format_utc_minute(m * MINUTE_US),
                rejected,
                requests,
            })
        };

        let tiers = self
            .tiers
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut keys: Vec<(&String, &KeyAcc)> = t.keys.iter().collect();
                keys.sort_by(|a, b| b.1.rejected.cmp(&a.1.rejected).then(a.0.cmp(b.0)));
                TierReport {
                    name: t.name.clone(),
                    requests: t.applied,
                    rejected: t.rejected,
                    rejection_rate: rate(t.rejected, t.applied),
                    shadow_limited: shadow_known.then_some(t.shadow_limited),
                    distinct_keys_blocked: t.keys.len() as u64,
                    top_blocked_keys: keys
                        .into_iter()
                        .take(top)
                        .map(|(_, a)| BlockedKey {
                            key: a.display.clone(),
                            rejected: a.rejected,
                            requests_since_first_429: a.requests,
                            first: format_utc_seconds(a.first_us),
                            last: format_utc_seconds(a.last_us),
                        })
                        .collect(),
                    peak_minute: peak(&|m: &MinuteAcc| (m.rejected_by[i], m.applied[i])),
                }
            })
            .collect();

        let mut endpoints: Vec<EndpointReport> = self
            .endpoints
            .iter()
            .filter(|e| e.requests > 0)
            .map(|e| EndpointReport {
                endpoint: e.label.clone(),
                requests: e.requests,
                rejected: e.rejected,
                rejection_rate: rate(e.rejected, e.requests),
                by_tier: e
                    .by_tier
                    .iter()
                    .enumerate()
                    .filter(|(_, c)| **c > 0)
                    .map(|(i, c)| TierCount {
                        tier: self.tiers[i].name.clone(),
                        rejected: *c,
                    })
                    .collect(),
            })
            .collect();
        endpoints.sort_by(|a, b| {
            b.requests
                .cmp(&a.requests)
                .then(a.endpoint.cmp(&b.endpoint))
        });

        let peak_minute = peak(&|m: &MinuteAcc| (m.rejected, m.requests));
        let timeline = timeline(&self.minutes, n);
        Report {
            engine,
            modes,
            policy,
            routes,
            input,
            totals,
            tiers,
            endpoints,
            peak_minute,
            timeline,
            candidates: Vec::new(),
        }
    }
}

pub(super) fn rate(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        #[allow(clippy::cast_precision_loss)]
        let r = a as f64 / b as f64;
        r
    }
}
