//! [`Replayer::new`]: the layer built from the policy on a memory backend
//! with a manual clock, and everything that feeds it.

use super::engine::{Direct, Layer};
use super::parse::{LineParser, Record};
use super::report::{Collector, FxMap};
use super::routes::Routes;
use super::{
    Engine, EngineImpl, KeyKind, Modes, ReplayError, ReplayOptions, Replayer, Spare, TierSummary,
};
use tiered_ratelimit::backend::{ManualClock, MemoryBackend};
use tiered_ratelimit::offline::Checks;
use tiered_ratelimit::policy::KeySpec;
use tiered_ratelimit::rollout::Mode;
use tiered_ratelimit::{policy::Policy, Algorithm, LeakyBucket, RateLimitLayer};

/// The algorithm's name, with the shaping bucket's `max_delay`.
fn algorithm_name(a: Algorithm) -> String {
    match a {
        Algorithm::LeakyBucket(LeakyBucket::Shape { max_delay }) => format!(
            "{} (max_delay {})",
            a.name(),
            humantime::format_duration(max_delay)
        ),
        _ => a.name().to_owned(),
    }
}

impl Replayer {
    /// Builds the layer for `policy` on a memory backend with a manual
    /// clock, and everything to feed it.
    ///
    /// # Errors
    /// The policy does not build, a route is invalid, or the engine asked
    /// for cannot replay this policy.
    pub fn new(policy: &Policy, options: ReplayOptions) -> Result<Self, ReplayError> {
        let clock = ManualClock::new(0);
        let memory = MemoryBackend::with_manual_clock(clock.clone()).max_keys(options.max_keys);
        let layer = RateLimitLayer::from_policy(policy, memory.clone())?;
        let handle = layer.handle();
        handle.set_demand(options.demand);
        if options.modes == Modes::Enforce {
            let tiers = handle.tiers();
            handle.update(|c| {
                c.mode(Mode::Enforce);
                for t in &tiers {
                    if t.mode != Mode::Off {
                        c.tier_mode(&t.name, Mode::Enforce)?;
                    }
                }
                Ok(())
            })?;
        }
        let refunds = policy
            .tiers
            .iter()
            .any(|t| t.skip_failed_requests || t.skip_successful_requests);
        let engine_choice = match (options.engine, refunds) {
            (Engine::Auto, true) | (Engine::Layer, _) => Engine::Layer,
            (Engine::Auto, false) | (Engine::Direct, false) => Engine::Direct,
            (Engine::Direct, true) => {
                return Err(ReplayError::Engine(
                    "the direct engine does not replay skip_failed_requests / \
                     skip_successful_requests (refunds by response status): use --engine layer"
                        .into(),
                ))
            }
        };
        let routes = Routes::new(&options.routes)
            .map_err(|(pattern, reason)| ReplayError::Route { pattern, reason })?;
        let engine = match engine_choice {
            Engine::Layer => EngineImpl::Layer(Box::new(Layer::new(&layer, routes.patterns())?)),
            _ => EngineImpl::Direct(Direct),
        };
        let statuses = handle.tiers();
        let policy_summary = policy
            .tiers
            .iter()
            .zip(&statuses)
            .map(|(t, s)| TierSummary {
                name: t.name.clone(),
                key: t.key.to_string(),
                algorithm: algorithm_name(s.algorithm),
                limit: s.quota.limit(),
                period: humantime::format_duration(s.quota.period()).to_string(),
                burst: s.quota.burst_size(),
                cost: t.cost,
                mode: s.effective_mode.to_string(),
            })
            .collect();
        let key_kinds = policy
            .tiers
            .iter()
            .map(|t| match &t.key {
                KeySpec::Header(h) => KeyKind::Header(h.clone()),
                _ => KeyKind::Plain,
            })
            .collect();
        let names = layer.tier_names().map(str::to_owned).collect();
        let parser = LineParser::new(
            &options.fields,
            &options.extra_fields,
            options.time_format,
            options.remote_user,
        );
        Ok(Self {
            clock,
            clock_us: None,
            demand_second: None,
            demand: options.demand,
            offline: layer
                .offline()
                .ok_or_else(|| ReplayError::Engine("replay needs the memory backend".into()))?,
            checks: Checks::default(),
            engine,
            engine_name: if engine_choice == Engine::Layer {
                "layer"
            } else {
                "direct"
            },
            modes_name: match options.modes {
                Modes::Enforce => "enforce",
                Modes::AsConfigured => "as-configured",
            },
            routes,
            parser,
            format: options.format,
            input_format: None,
            format_confirmed: false,
            rec: Record::default(),
            parts: http::Request::new(()).into_parts().0,
            spare: Spare::default(),
            matched_route: None,
            uri_buf: bytes::BytesMut::with_capacity(64 << 10),
            endpoint_ids: FxMap::default(),
            collector: Collector::new(names, options.max_examples),
            key_kinds,
            policy_summary,
            input_name: "-".into(),
            line_no: 0,
            top: options.top,
            show_keys: options.show_keys,
            handle,
        })
    }

    /// The engine deciding requests: `"direct"` or `"layer"`.
    pub fn engine(&self) -> &'static str {
        self.engine_name
    }
}
