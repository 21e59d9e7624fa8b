//! Misconfiguration fails at build time with an error that names the field.

use std::time::Duration;
use tiered_ratelimit::{
    backend::{MemoryBackend, RedisBackend},
    key::Global,
    policy::Policy,
    Algorithm, ConfigError, LeakyBucket, Quota, RateLimitLayer, Tier,
};

fn err(b: tiered_ratelimit::RateLimitLayerBuilder) -> String {
    b.build().unwrap_err().to_string()
}

#[test]
fn builder_errors_name_the_field() {
    let t = |name: &str, q: Quota| Tier::new(name, Global, q);
    assert_eq!(
        err(RateLimitLayer::builder()),
        "tiers: at least one tier is required"
    );
    assert_eq!(
        err(RateLimitLayer::builder()
            .tier(t("a", Quota::per_second(1)))
            .tier(t("a", Quota::per_second(2)))),
        "tier \"a\": name: duplicate tier name"
    );
    assert_eq!(
        err(RateLimitLayer::builder().tier(t("a", Quota::per_second(0)))),
        "tier \"a\": limit: must be greater than 0"
    );
    assert_eq!(
        err(RateLimitLayer::builder().tier(t("a", Quota::new(1, Duration::ZERO)))),
        "tier \"a\": period: must be at least 1 microsecond, got 0ns"
    );
    assert_eq!(
        err(RateLimitLayer::builder().tier(t("a", Quota::per_second(5).burst(2)).cost(3))),
        "tier \"a\": burst: 2 is smaller than cost 3; no request could ever pass"
    );
    assert_eq!(
        err(RateLimitLayer::builder().tier(t("a", Quota::per_second(5)).cost(0))),
        "tier \"a\": cost: must be greater than 0"
    );
    assert!(
        err(RateLimitLayer::builder().tier(t("a b", Quota::per_second(5))))
            .starts_with("tier \"a b\": name:")
    );
    assert!(err(RateLimitLayer::builder()
        .key_prefix("rl{x}")
        .tier(t("a", Quota::per_second(5))))
    .starts_with("key_prefix:"));
    assert!(err(RateLimitLayer::builder().tier(t(
        "a",
        Quota::new(u64::MAX / 2, Duration::from_secs(86_400 * 365))
    )))
    // No burst set: the field the user wrote is the limit.
    .starts_with("tier \"a\": limit: limit (the capacity: no burst is set) × period in units"));
}

#[test]
fn bad_redis_url_is_a_config_error() {
    let e = RedisBackend::from_url("redis//nope").unwrap_err();
    assert!(matches!(e, ConfigError::InvalidRedisUrl(_)), "{e:?}");
    assert!(e.to_string().starts_with("redis url:"));
}

#[test]
fn the_issue_schema_is_accepted_exactly_as_written() {
    let policy = Policy::from_toml_str(
        r#"
key_prefix = "rl"
failure_policy = "open"              # "open" | "closed"
backend_timeout_ms = 100
docs_url = "https://example.com/docs/rate-limits"

[client_ip]
trusted_proxies = []                 # CIDRs; empty = trust no forwarding header
ipv6_prefix = 64

[[tier]]
name = "global"
key = "global"                       # "global" | "ip" | "user" | "endpoint" | { header = "x-api-key" }
limit = 1000
period = "1s"                        # humantime: "1s", "10s", "1m", "1h"
burst = 2000                         # optional, default = limit
algorithm = "token_bucket"           # optional, default token_bucket
cost = 1                             # optional, default 1

[[tier]]
name = "ip"
key = "ip"
limit = 300
period = "1m"

[[tier]]
name = "user"
key = "user"
limit = 100
period = "1m"

[[tier]]
name = "api_key"
key = { header = "x-api-key" }
limit = 10000
period = "1h"

[[tier]]
name = "endpoint"
key = "endpoint"
limit = 50
period = "10s"
"#,
    )
    .unwrap();
    let layer = RateLimitLayer::from_policy(&policy, MemoryBackend::new()).unwrap();
    assert_eq!(
        layer.tier_names().collect::<Vec<_>>(),
        ["global", "ip", "user", "api_key", "endpoint"]
    );
}

#[test]
fn policy_errors_name_the_field() {
    let e = Policy::from_toml_str("failure_policy = \"sometimes\"")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("failure_policy") && e.contains("sometimes"),
        "{e}"
    );
    let e = Policy::from_toml_str("[[tier]]\nname='a'\nkey='global'\nlimit=1\nperiod='soon'\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("period"), "{e}");
    let e = Policy::from_toml_str(
        "[[tier]]\nname='a'\nkey={ header = 'x', extra = 1 }\nlimit=1\nperiod='1s'\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("extra"), "{e}");
    let p = Policy::from_toml_str(
        "[client_ip]\nipv6_prefix = 129\n[[tier]]\nname='a'\nkey='ip'\nlimit=1\nperiod='1s'\n",
    )
    .unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("client_ip.ipv6_prefix"), "{e}");
    let e = Policy::from_file("/nonexistent/policy.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/policy.toml"), "{e}");
}

#[test]
fn policy_algorithms_by_name() {
    let tier = |algo: &str, extra: &str| {
        format!(
            "[[tier]]\nname='t'\nkey='global'\nlimit=10\nperiod='1m'\nalgorithm='{algo}'\n{extra}"
        )
    };
    for algo in [
        "fixed_window",
        "sliding_window_log",
        "sliding_window_counter",
        "token_bucket",
        "leaky_bucket",
    ] {
        let p = Policy::from_toml_str(&tier(algo, "")).unwrap();
        let _layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    }
    let p = Policy::from_toml_str(&tier("leaky_bucket_shape", "max_delay='2s'")).unwrap();
    let _layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();

    let p = Policy::from_toml_str(&tier("leaky_bucket_shape", "")).unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "policy: tier \"t\": max_delay: required by algorithm = \"leaky_bucket_shape\""
    );
    let p = Policy::from_toml_str(&tier("token_bucket", "max_delay='2s'")).unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_delay"), "{e}");
    let e = Policy::from_toml_str(&tier("gcra", ""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gcra") && e.contains("algorithm"), "{e}");
    // Window algorithms have no burst.
    let p = Policy::from_toml_str(&tier("fixed_window", "burst=20")).unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("tier \"t\": burst: FixedWindow has no burst"),
        "{e}"
    );
    // A fixed cost above the capacity is a build error, for every algorithm.
    let p = Policy::from_toml_str(&tier("sliding_window_log", "cost=11")).unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "tier \"t\": burst: 10 is smaller than cost 11; no request could ever pass"
    );
}

/// `algorithm = "concurrency"`: a limit of requests in flight, no period,
/// an optional lease; the quickstart's commented tier, uncommented, builds.
#[test]
fn policy_concurrency_tier() {
    let p = Policy::from_toml_str(
        "[[tier]]\nname='ip_inflight'\nkey='ip'\nalgorithm='concurrency'\nlimit=2\nlease='60s'\n",
    )
    .unwrap();
    let layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    let t = &layer.handle().tiers()[0];
    assert_eq!(
        (t.algorithm, t.quota.limit()),
        (
            Algorithm::Concurrency {
                slot_ttl: Duration::from_secs(60)
            },
            2
        )
    );
    // Without a lease: 60 s.
    let p = Policy::from_toml_str(
        "[[tier]]\nname='c'\nkey='global'\nalgorithm='concurrency'\nlimit=5\n",
    )
    .unwrap();
    let layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    assert_eq!(
        layer.handle().tiers()[0].algorithm,
        Algorithm::Concurrency {
            slot_ttl: Duration::from_secs(60)
        }
    );
    // A lease only for concurrency; a rate tier still needs its period.
    let p = Policy::from_toml_str(
        "[[tier]]\nname='t'\nkey='global'\nlimit=5\nperiod='1s'\nlease='5s'\n",
    )
    .unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "policy: tier \"t\": lease: only algorithm = \"concurrency\" uses it"
    );
    let p = Policy::from_toml_str("[[tier]]\nname='t'\nkey='global'\nlimit=5\n").unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "tier \"t\": period: must be at least 1 microsecond, got 0ns"
    );
}

/// The login recipe of docs/rollout.md, as written, builds; a bad penalty
/// box names its field.
#[test]
fn policy_penalty_box() {
    let recipe = r#"
[[tier]]
name = "login_ip"
key = "ip"
limit = 5
period = "1m"
methods = ["POST"]
skip_successful_requests = true
[tier.penalty]
violations = 3
window = "10m"
block = "15m"
backoff = 2
memory = "24h"
max_block = "24h"

[[tier]]
name = "login_user"
key = { header = "x-login-user" }
limit = 10
period = "1h"
methods = ["POST"]
skip_successful_requests = true
[tier.penalty]
violations = 5
window = "1h"
block = "1h"
"#;
    let p = Policy::from_toml_str(recipe).unwrap();
    let _layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    let bad = |penalty: &str| {
        let p = Policy::from_toml_str(&format!(
            "[[tier]]\nname='t'\nkey='ip'\nlimit=5\nperiod='1m'\n[tier.penalty]\n{penalty}\n"
        ))
        .map_err(|e| e.to_string())?;
        RateLimitLayer::from_policy(&p, MemoryBackend::new())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(
        bad("violations=0\nwindow='1m'\nblock='1m'"),
        Err("policy: tier \"t\": penalty.violations: must be 1-1023".to_owned())
    );
    assert_eq!(
        bad("violations=2\nwindow='1m'\nblock='1h'\nmax_block='1m'"),
        Err("policy: tier \"t\": penalty.max_block: must be at least block".to_owned())
    );
    assert_eq!(
        bad("violations=2\nwindow='0s'\nblock='1h'"),
        Err(
            "policy: tier \"t\": penalty.window: must be between 1 µs and 2^51 µs (about 71 years)"
                .to_owned()
        )
    );
    let e = bad("violations=2\nblock='1h'").unwrap_err();
    assert!(e.contains("window"), "{e}");
}

#[test]
fn policy_rollout_fields() {
    let p = Policy::from_toml_str(
        r#"
mode = "shadow"
shadow_headers = true

[allowlist]
ips = ["192.0.2.0/24", "2001:db8::1"]
api_keys = ["sk_partner"]
api_key_header = "x-api-key"
users = ["ops-bot"]

[denylist]
users = ["mallory"]
status = 429

[control]
redis_key = "rl:control"
poll_interval = "5s"

[[tier]]
name = "user"
key = "user"
limit = 100
period = "1m"
mode = "canary"
canary_percent = 10
methods = ["GET", "POST"]
skip_failed_requests = false
skip_successful_requests = false
plan = { header = "x-plan" }

[tier.plans]
free = { limit = 100, period = "1m" }
pro = { limit = 1000, period = "1m", burst = 2000 }
"#,
    )
    .unwrap();
    let layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    let h = layer.handle();
    assert_eq!(h.mode(), tiered_ratelimit::rollout::Mode::Shadow);
    let t = &h.tiers()[0];
    assert_eq!(
        t.mode,
        tiered_ratelimit::rollout::Mode::Canary { percent: 10 }
    );
    assert_eq!(t.effective_mode, tiered_ratelimit::rollout::Mode::Shadow);
    assert_eq!(
        t.plans,
        vec![
            ("free".to_owned(), Quota::per_minute(100)),
            ("pro".to_owned(), Quota::per_minute(1000).burst(2000)),
        ]
    );

    let bad = |extra: &str, tier_extra: &str| {
        let text = format!(
            "{extra}\n[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\n{tier_extra}"
        );
        match Policy::from_toml_str(&text) {
            Err(e) => e.to_string(),
            Ok(p) => RateLimitLayer::from_policy(&p, MemoryBackend::new())
                .unwrap_err()
                .to_string(),
        }
    };
    assert!(bad("mode = 'sometimes'", "").contains("sometimes"));
    assert_eq!(
        bad("", "mode = 'canary'"),
        "policy: tier \"t\": canary_percent: required by mode = \"canary\""
    );
    assert!(bad("", "mode='canary'\ncanary_percent = 101").contains("above 100"));
    assert!(bad("", "canary_percent = 5").contains("only mode = \"canary\""));
    assert!(bad("[denylist]\nstatus = 418", "").contains("denylist.status"));
    assert!(bad("[allowlist]\nipz = []", "").contains("ipz"));
    assert!(bad("", "methods = ['G E T']").contains("methods"));
}

#[test]
fn refund_options_are_accepted() {
    for field in ["skip_failed_requests", "skip_successful_requests"] {
        let p = Policy::from_toml_str(&format!(
            "[[tier]]\nname='login'\nkey='ip'\nlimit=5\nperiod='1m'\n{field}=true\n"
        ))
        .unwrap();
        let t = &p.tiers[0];
        assert_eq!(
            (t.skip_failed_requests, t.skip_successful_requests),
            (
                field == "skip_failed_requests",
                field == "skip_successful_requests"
            )
        );
        let _layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    }
}

#[test]
fn skipping_both_outcomes_is_refused() {
    let e = RateLimitLayer::builder()
        .tier(
            Tier::new("login", Global, Quota::per_minute(5))
                .skip_failed_requests(true)
                .skip_successful_requests(true),
        )
        .build()
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "tier \"login\": skip_failed_requests/skip_successful_requests: both set, so nothing would ever count"
    );
}

const EXACT: &str =
    "; the Redis script counts exactly only up to 2^53 (see Quota's docs for each algorithm's bound)";

/// Builds one tier `t` with `algorithm` and `quota`: `Ok` or the error text.
fn build(algorithm: Algorithm, quota: Quota) -> Result<(), String> {
    RateLimitLayer::builder()
        .tier(Tier::new("t", Global, quota).algorithm(algorithm))
        .build()
        .map(drop)
        .map_err(|e| e.to_string())
}

/// Every algorithm at its exact bound (accepted) and one past it (rejected,
/// naming the field): no quota the Redis script cannot count exactly.
#[test]
fn quotas_are_accepted_up_to_their_exact_bound_and_not_beyond() {
    const P52: u64 = 1 << 52;
    let minute = |limit| Quota::per_minute(limit);
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowLog] {
        assert_eq!(build(algorithm, minute(P52 - 1)), Ok(()));
        assert_eq!(
            build(algorithm, minute(P52)),
            Err(format!(
                "tier \"t\": limit: 4503599627370496 is above 4503599627370495 (2^52 - 1), \
                 the largest limit of {algorithm:?}{EXACT}"
            ))
        );
        // The issue's example: 2^53 + 1 was accepted, and Redis and memory
        // disagreed about it.
        assert_eq!(
            build(algorithm, minute((1 << 53) + 1)),
            Err(format!(
                "tier \"t\": limit: 9007199254740993 is above 4503599627370495 (2^52 - 1), \
                 the largest limit of {algorithm:?}{EXACT}"
            ))
        );
    }
    // Sliding counter, 1 s window: (2 × limit + 1) × 10^6 ≤ 2^53.
    let counter = Algorithm::SlidingWindowCounter;
    assert_eq!(build(counter, Quota::per_second(4_503_599_626)), Ok(()));
    assert_eq!(
        build(counter, Quota::per_second(4_503_599_627)),
        Err(format!(
            "tier \"t\": limit: (2 × limit + 1) × period, (2 × 4503599627 + 1) × 1000000 µs, \
             is above 2^53; use a smaller limit or a shorter period{EXACT}"
        ))
    );
    let us = Duration::from_micros;
    for algorithm in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket(LeakyBucket::Police),
    ] {
        // 2^51 per µs: unit 1, rate 2^51; burst 2^52: capacity 2^52 units.
        assert_eq!(
            build(algorithm, Quota::new(1 << 51, us(1)).burst(P52)),
            Ok(())
        );
        assert_eq!(
            build(algorithm, Quota::new(1 << 51, us(1)).burst(P52 + 1)),
            Err(format!(
                "tier \"t\": burst: burst × period in units, 4503599627370497 × 1 = \
                 4503599627370497, is above 2^52; use a smaller burst or a shorter period{EXACT}"
            ))
        );
        assert_eq!(
            build(algorithm, Quota::new((1 << 51) + 1, us(1)).burst(P52)),
            Err(format!(
                "tier \"t\": limit: the refill rate, 2251799813685249 units per µs \
                 (limit / gcd(limit, period in µs)), is above 2^51{EXACT}"
            ))
        );
        // 1 per 2^20 µs: unit 2^20; burst 2^32 is 2^52 units.
        assert_eq!(
            build(algorithm, Quota::new(1, us(1 << 20)).burst(1 << 32)),
            Ok(())
        );
        assert!(
            build(algorithm, Quota::new(1, us(1 << 20)).burst((1 << 32) + 1))
                .unwrap_err()
                .starts_with("tier \"t\": burst: ")
        );
    }
    // Shaping: capacity 2^52 - 2^40 units (rate 1) leaves 2^40 µs of delay.
    let shape = |max_delay| {
        Algorithm::LeakyBucket(LeakyBucket::Shape {
            max_delay: us(max_delay),
        })
    };
    let q = Quota::new(1, us(1 << 20)).burst((1 << 32) - (1 << 20));
    assert_eq!(build(shape(1 << 40), q), Ok(()));
    assert_eq!(
        build(shape((1 << 40) + 1), q),
        Err(format!(
            "tier \"t\": max_delay: capacity + max_delay × rate, 4502500115742720 + \
             1099511627777 × 1 units, is above 2^52; use a shorter max_delay or a smaller \
             burst{EXACT}"
        ))
    );
    // Every algorithm: the period at most 2^51 µs.
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowLog,
        Algorithm::SlidingWindowCounter,
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket(LeakyBucket::Police),
    ] {
        assert_eq!(build(algorithm, Quota::new(1, us(1 << 51))), Ok(()));
        assert_eq!(
            build(algorithm, Quota::new(1, us((1 << 51) + 1))),
            Err(format!(
                "tier \"t\": period: 2251799813685249 µs is above 2251799813685248 µs \
                 (2^51 µs, about 71 years), the longest period{EXACT}"
            ))
        );
    }
    // Plans are checked the same way.
    let e = RateLimitLayer::builder()
        .tier(
            Tier::new("t", Global, Quota::per_minute(10))
                .algorithm(Algorithm::FixedWindow)
                .plans([("big", Quota::per_minute(P52))]),
        )
        .build()
        .unwrap_err();
    assert!(
        matches!(&e, ConfigError::QuotaTooLarge { field: "limit", .. }),
        "{e:?}"
    );
}

/// The policy file: the same error, naming the tier and the field.
#[test]
fn policy_quotas_past_the_exact_bound_name_the_field() {
    let p = Policy::from_toml_str(
        "[[tier]]\nname='t'\nkey='global'\nlimit=9007199254740993\nperiod='1m'\nalgorithm='sliding_window_log'\n",
    )
    .unwrap();
    let e = RateLimitLayer::from_policy(&p, MemoryBackend::new())
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "tier \"t\": limit: 9007199254740993 is above 4503599627370495 (2^52 - 1), \
             the largest limit of SlidingWindowLog{EXACT}"
        )
    );
}

/// An IPv6 prefix above 128 is refused by `build()`, whichever way the
/// `ClientIp` was made: read from a file (kept as written) or given to the
/// builder (the setter clamps it, as documented).
#[test]
fn ipv6_prefix_is_checked_by_build() {
    use tiered_ratelimit::key::ClientIp;
    let from_file = Policy::from_toml_str("[client_ip]\nipv6_prefix = 200\n")
        .unwrap()
        .client_ip;
    let e = RateLimitLayer::builder()
        .client_ip(from_file)
        .tier(Tier::new("a", Global, Quota::per_second(1)))
        .build()
        .unwrap_err();
    assert!(matches!(e, ConfigError::InvalidIpv6Prefix(200)), "{e:?}");
    assert_eq!(
        e.to_string(),
        "client_ip.ipv6_prefix: 200 is not a prefix length (0-128)"
    );
    let clamped = RateLimitLayer::builder()
        .client_ip(ClientIp::default().ipv6_prefix(200))
        .tier(Tier::new("a", Global, Quota::per_second(1)))
        .build();
    assert!(clamped.is_ok());
}

/// The quickstart's built-in policy, with every commented setting
/// uncommented (the concurrency tier, the penalty box, overrides), builds:
/// what its comments invite a user to try works as written.
#[test]
fn the_quickstart_policy_uncommented_builds() {
    let source = include_str!("../../examples/quickstart/quickstart.rs");
    let start = source.find("const DEFAULT_POLICY: &str = r#\"").unwrap();
    let body = &source[start..];
    let body = &body[body.find('"').unwrap() + 1..body.find("\"#;").unwrap()];
    fn setting(l: &str) -> Option<&str> {
        l.strip_prefix("# ").filter(|rest| {
            rest.starts_with('[')
                || rest
                    .split_once(" = ")
                    .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        })
    }
    // The header's comments document the fields: only the tiers' are settings.
    let tiers = body.find("[[tier]]").unwrap();
    let uncommented: String = body[..tiers].to_owned()
        + &body[tiers..]
            .lines()
            .map(|l| setting(l).unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
    assert!(uncommented.contains("[tier.penalty]") && uncommented.contains("\noverrides = true"));
    assert!(uncommented.contains("[tier.priced]"));
    let p = Policy::from_toml_str(&uncommented).unwrap();
    let layer = RateLimitLayer::from_policy(&p, MemoryBackend::new()).unwrap();
    let names: Vec<String> = layer
        .handle()
        .tiers()
        .iter()
        .map(|t| t.name.to_string())
        .collect();
    assert_eq!(
        names,
        [
            "global",
            "ip",
            "api_key",
            "user",
            "endpoint",
            "ip_inflight",
            "tokens"
        ]
    );
}
