//! Without the `calendar` feature, a calendar `period` is refused when the
//! layer (or the descriptor limiter) is built, naming the field and the
//! feature: not a parse error about an unknown variant, not a silent
//! fallback to a duration.

use tiered_ratelimit::backend::MemoryBackend;
use tiered_ratelimit::descriptor::RulesPolicy;
use tiered_ratelimit::policy::Policy;
use tiered_ratelimit::RateLimitLayer;

#[test]
fn a_policy_tier_with_a_calendar_period_names_the_feature() {
    let p = Policy::from_toml_str(
        "[[tier]]\nname = 'monthly'\nkey = { header = 'x-api-key' }\nlimit = 100\n\
         period = 'month'\ntime_zone = 'America/New_York'\nanchor = 15\n",
    )
    .unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "policy: tier \"monthly\": period: \"month\" is a calendar period, which needs the \
         \"calendar\" feature of tiered-ratelimit (features = [\"calendar\"] in Cargo.toml)"
    );
}

#[test]
fn a_descriptor_rule_with_a_calendar_period_names_the_feature() {
    let p = RulesPolicy::from_toml_str(
        "domain = 'd'\n[[rule]]\nname = 'daily'\nmatch = [{ key = 'k' }]\nlimit = 1\n\
         period = 'day'\n",
    )
    .unwrap();
    let e = p.limiter(MemoryBackend::new()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "policy: rule \"daily\": period: \"day\" is a calendar period, which needs the \
         \"calendar\" feature of tiered-ratelimit (features = [\"calendar\"] in Cargo.toml)"
    );
}

#[test]
fn a_duration_period_still_builds() {
    let p =
        Policy::from_toml_str("[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 100\nperiod = '1m'\n")
            .unwrap();
    assert!(RateLimitLayer::from_policy(&p, MemoryBackend::new()).is_ok());
}
