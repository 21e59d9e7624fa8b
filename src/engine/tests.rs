//! Unit tests of the engine's decision and outcome steps, without HTTP: the
//! facts come from [`TestFacts`], a front door of a few lines.

use super::decide::decide;
use super::decision::{Block, Decision};
use super::facts::Facts;
use super::outcome::outcome;
use super::plan::{plan, Meta, Planned, Purpose};
use super::runtime::FailurePolicy;
use super::state::Shared;
use crate::algorithm::TierDecision;
use crate::backend::Verdict;
use crate::error::BackendError;
use crate::key::{Global, KeyError, KeyWriter};
use crate::observe::RequestDecision;
use crate::rollout::Mode;
use crate::{http::layer::RateLimitLayer, http::tier::Tier, quota::Quota};
use std::borrow::Cow;
use std::sync::Arc;

/// A request every tier counts, at cost 1, under the key `k`.
struct TestFacts;

impl Facts for TestFacts {
    fn cost(&self, _: usize) -> Option<u64> {
        Some(1)
    }
    fn key(&self, _: usize, key: &mut KeyWriter<'_>) -> Result<bool, KeyError> {
        key.part(b"k");
        Ok(true)
    }
    fn plan(&self, _: usize) -> Option<Cow<'_, str>> {
        None
    }
    fn endpoint(&self) -> (&str, &str) {
        ("GET", "/")
    }
}

/// A layer of `n` tiers `t0`, `t1`, … (10 per minute each), its engine state
/// and the meta of a request checked on every tier.
fn setup(n: usize, shadow: &[usize], policy: FailurePolicy) -> (Arc<Shared>, Meta) {
    let mut b = RateLimitLayer::builder().failure_policy(policy);
    for i in 0..n {
        let mut t = Tier::new(format!("t{i}"), Global, Quota::per_minute(10));
        if shadow.contains(&i) {
            t = t.mode(Mode::Shadow);
        }
        b = b.tier(t);
    }
    let layer = b.build().expect("valid");
    let shared = layer.shared.clone();
    let mut meta = Meta::default();
    let Planned::Check(_) = plan(&shared, &TestFacts, Purpose::Check, &mut meta) else {
        panic!("every tier applies");
    };
    (shared, meta)
}

fn tier(allowed: bool, remaining: u64, reset_after_us: u64, retry_after_us: u64) -> TierDecision {
    TierDecision {
        allowed,
        limit: 10,
        remaining,
        reset_after_us,
        retry_after_us,
        delay_us: 0,
    }
}

const NOW_US: u64 = 1_700_000_000_000_000;

fn verdict(decisions: Vec<TierDecision>) -> Verdict {
    Verdict {
        now_us: NOW_US,
        decisions,
        charges: Vec::new(),
    }
}

#[test]
fn the_binding_tier_is_the_longest_wait_and_every_denying_tier_is_listed() {
    let (shared, meta) = setup(3, &[], FailurePolicy::Open);
    let v = verdict(vec![
        tier(false, 0, 6_000_000, 2_000_001),
        tier(true, 4, 30_000_000, 0),
        tier(false, 0, 6_000_000, 5_500_000),
    ]);
    let Decision::Block(Block::Limited(d)) = decide(&shared, &meta, &v, None) else {
        panic!("denied");
    };
    assert_eq!(d.check, 2);
    assert_eq!(&*d.rejection.tier, "t2");
    let violated: Vec<&str> = d.rejection.violated_policies.iter().map(|t| &**t).collect();
    assert_eq!(violated, ["t0", "t2"]);
    // 5.5 s, rounded up.
    assert_eq!(d.rejection.retry_after, 6);
    assert_eq!(d.headers.retry_after, Some(6));
    assert_eq!(d.rejection.reset, (NOW_US + 5_500_000).div_ceil(1_000_000));
    assert_eq!(d.shadow_tiers, 0);
}

#[test]
fn on_a_tie_the_first_denying_tier_binds() {
    let (shared, meta) = setup(2, &[], FailurePolicy::Open);
    let v = verdict(vec![
        tier(false, 0, 6_000_000, 3_000_000),
        tier(false, 0, 6_000_000, 3_000_000),
    ]);
    let Decision::Block(Block::Limited(d)) = decide(&shared, &meta, &v, None) else {
        panic!("denied");
    };
    assert_eq!((d.check, &*d.rejection.tier), (0, "t0"));
}

#[test]
fn an_observing_tier_never_denies_but_is_reported() {
    let (shared, meta) = setup(2, &[1], FailurePolicy::Open);
    assert!(meta.shadow.contains(1) && !meta.shadow.contains(0));
    let v = verdict(vec![
        tier(true, 7, 18_000_000, 0),
        tier(false, 0, 6_000_000, 6_000_000),
    ]);
    let Decision::Allow(a) = decide(&shared, &meta, &v, None) else {
        panic!("a shadow denial passes");
    };
    assert_eq!(a.kind, RequestDecision::ShadowLimited);
    assert_eq!(a.shadow_tiers, 1 << 1);
    // The headers describe the enforced tier only (shadow headers are off).
    let h = a.headers.expect("headers");
    assert_eq!((&*h.policy, h.remaining), ("t0", 7));
}

#[test]
fn allowed_headers_describe_the_least_remaining_then_the_longest_reset() {
    let (shared, meta) = setup(3, &[], FailurePolicy::Open);
    let v = verdict(vec![
        tier(true, 3, 42_000_000, 0),
        tier(true, 3, 48_000_000, 0),
        tier(true, 9, 6_000_000, 0),
    ]);
    let Decision::Allow(a) = decide(&shared, &meta, &v, None) else {
        panic!("allowed");
    };
    assert_eq!(a.kind, RequestDecision::Allowed);
    assert_eq!(a.shadow_tiers, 0);
    assert!(a.delay.is_zero());
    let h = a.headers.expect("headers");
    assert_eq!((&*h.policy, h.remaining, h.limit), ("t1", 3, 10));
    assert_eq!(h.reset, (NOW_US + 48_000_000).div_ceil(1_000_000));
    assert_eq!(h.retry_after, None);
}

#[test]
fn a_shaped_request_waits_for_the_latest_slot() {
    let (shared, meta) = setup(2, &[], FailurePolicy::Open);
    let mut v = verdict(vec![tier(true, 0, 1, 0), tier(true, 0, 1, 0)]);
    v.decisions[0].delay_us = 250_000;
    v.decisions[1].delay_us = 900_000;
    let Decision::Allow(a) = decide(&shared, &meta, &v, None) else {
        panic!("allowed");
    };
    assert_eq!(a.delay, std::time::Duration::from_micros(900_000));
}

#[test]
fn a_backend_error_follows_the_failure_policy() {
    let err = || Err(BackendError::Timeout(std::time::Duration::from_millis(50)));

    let (shared, meta) = setup(1, &[], FailurePolicy::Open);
    let Decision::Allow(a) = outcome(&shared, &meta, err(), &TestFacts) else {
        panic!("fail-open passes");
    };
    assert_eq!(a.kind, RequestDecision::FailOpen);
    assert!(a.headers.is_none() && a.refunds.is_none());
    assert_eq!(shared.telemetry.counts.snapshot().fail_open, 1);

    let (shared, meta) = setup(1, &[], FailurePolicy::Closed);
    assert!(matches!(
        outcome(&shared, &meta, err(), &TestFacts),
        Decision::Block(Block::Unavailable)
    ));
    assert_eq!(shared.telemetry.counts.snapshot().fail_closed, 1);

    // The fallback plans the same facts against its local limiter: 10 per
    // minute for one instance, so the 11th is denied by t0.
    let (shared, meta) = setup(1, &[], FailurePolicy::Fallback);
    for _ in 0..10 {
        let d = outcome(&shared, &meta, err(), &TestFacts);
        assert!(matches!(d, Decision::Allow(ref a) if a.kind == RequestDecision::Fallback));
    }
    let Decision::Block(Block::Limited(d)) = outcome(&shared, &meta, err(), &TestFacts) else {
        panic!("the local fallback denies the 11th");
    };
    assert_eq!(&*d.rejection.tier, "t0");
    assert_eq!(shared.telemetry.counts.snapshot().fallback, 11);
}

#[test]
fn an_answer_is_decided_and_closes_nothing_open() {
    let (shared, meta) = setup(1, &[], FailurePolicy::Closed);
    let v = verdict(vec![tier(true, 9, 6_000_000, 0)]);
    let Decision::Allow(a) = outcome(&shared, &meta, Ok(v), &TestFacts) else {
        panic!("allowed");
    };
    assert_eq!(a.kind, RequestDecision::Allowed);
    assert_eq!(shared.telemetry.counts.snapshot().allowed, 1);
    assert_eq!(shared.guards.breaker.state().label(), "closed");
    // Nothing refunds by status here.
    assert!(a.refunds.is_none());
}
