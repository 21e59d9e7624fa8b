//! The Envoy service's rules file with a calendar period (issue 28): a
//! `[[rule]]` takes `period = "month"` with `time_zone` and `anchor` as a
//! `[[tier]]` does, `current_limit` says MONTH, and `duration_until_reset`
//! is the time to the next local boundary; decided at the boundary on
//! memory and a real Redis, on the manual clock.

use crate::support::redis_server::RedisServer;
use std::time::Duration;
use tiered_ratelimit::backend::{Backend, ManualClock, MemoryBackend, RedisBackend};
use tiered_ratelimit::descriptor::{Code, Descriptor, RulesPolicy, Unit};

/// 2024-02-29T00:00 in Berlin (2024-02-28T23:00Z): a month anchored on
/// the 31st renews on 29 February, then on 31 March at Berlin midnight
/// (2024-03-30T23:00Z).
const FEB29_US: u64 = 1_709_161_200_000_000;
const MAR31_US: u64 = 1_711_839_600_000_000;

// A timeout that a loaded test host never reaches: the test is about
// the boundary, not the failure policy (100 ms by default).
const RULES: &str = "domain = 'edge'\nbackend_timeout_ms = 10000\n[[rule]]\nname = 'monthly'\n\
                     match = [{ key = 'api_key' }]\nlimit = 2\nperiod = 'month'\n\
                     anchor = 31\ntime_zone = 'Europe/Berlin'\n";

async fn a_month_rule_at_its_boundary(backend: Backend, clock: ManualClock) {
    let l = RulesPolicy::from_toml_str(RULES)
        .unwrap()
        .limiter(backend)
        .unwrap();
    let d = [Descriptor::new(vec![("api_key", "k1")])];
    let check = || async {
        let a = l.check("edge", &d, 1).await.unwrap();
        let s = &a.statuses[0];
        let lim = s.limit.as_ref().unwrap();
        (
            s.code,
            lim.requests_per_unit,
            lim.unit,
            s.remaining,
            s.until_reset,
        )
    };
    let us = Duration::from_micros;
    // 2 µs and 1 µs before the boundary: the old month (1 µs left).
    assert_eq!(check().await, (Code::Ok, 2, Unit::Month, 1, us(2)));
    clock.set(FEB29_US - 1);
    assert_eq!(check().await, (Code::Ok, 2, Unit::Month, 0, us(1)));
    // At the boundary: the new month, renewed at Berlin's 31 March.
    clock.set(FEB29_US);
    let month = us(MAR31_US - FEB29_US);
    assert_eq!(check().await, (Code::Ok, 2, Unit::Month, 1, month));
    assert_eq!(check().await, (Code::Ok, 2, Unit::Month, 0, month));
    assert_eq!(check().await, (Code::OverLimit, 2, Unit::Month, 0, month));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_rule_at_its_boundary_in_memory() {
    let clock = ManualClock::new(FEB29_US - 2);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    a_month_rule_at_its_boundary(b.into(), clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_rule_at_its_boundary_on_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new(FEB29_US - 2);
    let b = RedisBackend::from_url(&server.url())
        .unwrap()
        .with_manual_clock(clock.clone())
        .with_test_ttl_slack(Duration::from_secs(7200));
    a_month_rule_at_its_boundary(b.into(), clock).await;
}

#[test]
fn a_rule_misconfiguration_names_the_rule_and_field() {
    let err = |extra: &str| {
        let text = format!(
            "domain = 'd'\n[[rule]]\nname = 'r'\nmatch = [{{ key = 'k' }}]\nlimit = 1\n{extra}\n"
        );
        let p = match RulesPolicy::from_toml_str(&text) {
            Ok(p) => p,
            Err(e) => return e.to_string(),
        };
        match p.limiter(MemoryBackend::new()) {
            Ok(_) => "accepted".to_owned(),
            Err(e) => e.to_string(),
        }
    };
    assert_eq!(
        err("period = 'day'\ntime_zone = 'Mars/Olympus'"),
        "policy: rule \"r\": time_zone: \"Mars/Olympus\" is not an IANA time zone name (e.g. \
         \"Europe/Berlin\")"
    );
    assert_eq!(
        err("period = '1h'\nanchor = 3"),
        "policy: rule \"r\": anchor: only a calendar period (period = \"day\", \"week\", \
         \"month\" or \"year\") uses it"
    );
    // The rule is the engine's tier of the same name.
    assert_eq!(
        err("period = 'week'\nalgorithm = 'token_bucket'"),
        "tier \"r\": algorithm: a calendar period (period = \"week\") counts with \
         fixed_window only, not token_bucket"
    );
}
