//! The policy file's unit tests: field names in errors, the tables as the
//! builder types, values checked with their line.

use super::*;

#[test]
fn unknown_fields_are_named() {
    let err = Policy::from_toml_str("key_prefx = \"rl\"")
        .unwrap_err()
        .to_string();
    assert!(err.contains("key_prefx"), "{err}");
    let err =
        Policy::from_toml_str("[[tier]]\nname='a'\nkey='global'\nlimit=1\nperiod='1s'\nburts=3\n")
            .unwrap_err()
            .to_string();
    assert!(err.contains("burts"), "{err}");
    let err = Policy::from_toml_str("[[tier]]\nname='a'\nkey='ipp'\nlimit=1\nperiod='1s'\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("ipp"), "{err}");
}

/// An unknown `key` string lists the four names and the header form
/// (docs/rollout.md once showed `key = "api_key"`).
#[test]
fn an_unknown_key_names_the_header_form() {
    let err = Policy::from_toml_str(
        "[[tier]]\nname = 'api'\nkey = 'api_key'\nlimit = 1\nperiod = '1s'\n",
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "policy: TOML parse error at line 3, column 7\n  |\n3 | key = 'api_key'\n  |       ^^^^^^^^^\n\
         unknown key `api_key`, expected `global`, `ip`, `user`, `endpoint`, \
         or { header = \"<name>\" } to key on a request header \
         (an API key: { header = \"x-api-key\" })\n"
    );
}

#[test]
fn trusted_proxies_accept_cidrs_and_addresses() {
    let p = Policy::from_toml_str("[client_ip]\ntrusted_proxies=['10.0.0.0/8','192.0.2.1','::1']")
        .unwrap();
    assert_eq!(p.client_ip.trusted().len(), 3);
    let err = Policy::from_toml_str("[client_ip]\ntrusted_proxies=['nope']")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("nope") && err.contains("trusted_proxies"),
        "{err}"
    );
}

#[test]
fn invalid_tiers_fail_at_build_naming_the_field() {
    let p = Policy::from_toml_str("[[tier]]\nname='ip'\nkey='ip'\nlimit=0\nperiod='1s'\n").unwrap();
    let err = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tier \"ip\": limit: must be greater than 0"
    );
}

/// Every table reads straight into the type the builder takes.
#[test]
fn tables_are_the_builder_types() {
    use crate::key::ForwardedHeader;
    use crate::{quota::Quota, rollout::DenyStatus};
    let p = Policy::from_toml_str(
        r#"
mode = "canary:5"
headers = "ietf"
body = "problem"
circuit_breaker = { failures = 7 }
[client_ip]
trusted_proxies = ["10.0.0.0/8", "::ffff:192.0.2.0/120"]
forwarded_headers = ["Forwarded", "x-real-ip", "forwarded"]
ipv6_prefix = 56
[allowlist]
users = ["ops-bot"]
[denylist]
api_keys = ["sk_bad"]
status = 429
[control]
redis_key = "svc:control"
[[tier]]
name = "t"
key = { header = "X-Api-Key" }
limit = 10
period = "1m"
algorithm = "leaky_bucket_shape"
max_delay = "1500ms"
methods = ["GET", "PURGE"]
plan = { header = "X-Plan" }
[tier.plans]
pro = { limit = 100, period = "1m", burst = 200 }
"#,
    )
    .unwrap();
    assert_eq!(p.mode, Mode::Canary { percent: 5 });
    assert_eq!(p.headers, HeaderStyle::IetfDraft11);
    assert_eq!(p.body, RejectionBody::Problem);
    assert_eq!(
        p.circuit_breaker,
        CircuitBreaker {
            failures: 7,
            probe_interval: Duration::from_millis(500),
        }
    );
    assert_eq!(
        p.client_ip.trusted(),
        [
            "10.0.0.0/8".parse().unwrap(),
            "192.0.2.0/24".parse().unwrap()
        ]
    );
    assert_eq!(
        p.client_ip.headers(),
        [ForwardedHeader::Forwarded, ForwardedHeader::XRealIp]
    );
    assert_eq!(p.denylist.status, DenyStatus::TooManyRequests);
    assert!(!p.denylist.list.is_empty() && !p.allowlist.is_empty());
    assert_eq!(p.control, Some(ControlKey::new("svc:control")));
    let t = &p.tiers[0];
    assert_eq!(
        t.key,
        KeySpec::Header(http::HeaderName::from_static("x-api-key"))
    );
    assert_eq!(t.key.to_string(), "header:x-api-key");
    assert_eq!(t.algorithm.as_deref(), Some("leaky_bucket_shape"));
    assert_eq!(
        t.methods,
        Some(vec![http::Method::GET, "PURGE".parse().unwrap()])
    );
    assert_eq!(
        t.plan,
        PlanSource::Header(http::HeaderName::from_static("x-plan"))
    );
    assert_eq!(t.plans["pro"], Quota::per_minute(100).burst(200));
    let layer = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap();
    let tier = &layer.handle().tiers()[0];
    assert_eq!(
        tier.algorithm,
        crate::algorithm::kind::Algorithm::LeakyBucket(
            crate::algorithm::kind::LeakyBucket::Shape {
                max_delay: Duration::from_millis(1500)
            }
        )
    );
    assert_eq!(layer.handle().mode(), Mode::Canary { percent: 5 });
}

/// Every name of the one table is a valid `algorithm`.
#[test]
fn every_algorithm_name_is_accepted() {
    for name in crate::algorithm::kind::Algorithm::NAMES {
        let max_delay = if name == "leaky_bucket_shape" {
            "max_delay = '1s'"
        } else {
            ""
        };
        let p = Policy::from_toml_str(&format!(
                "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\nalgorithm='{name}'\n{max_delay}"
            ))
            .unwrap();
        let layer = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap();
        assert_eq!(layer.handle().tiers()[0].algorithm.name(), name);
    }
}

/// What the file alone can get wrong is an error when it is read,
/// naming the field or value and the line.
#[test]
fn values_are_checked_when_read_with_their_line() {
    let tier = "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\n";
    for (text, line, what) in [
        (
            format!("{tier}[denylist]\nstatus = 418\n"),
            7,
            "denylist.status: 418 is not 403 or 429",
        ),
        (
            format!("[allowlist]\napi_key_header = 'a b'\n{tier}"),
            2,
            "\"a b\", expected a header name",
        ),
        (
            format!("[allowlist]\nusers = []\nipz = []\n{tier}"),
            3,
            "unknown field `ipz`",
        ),
        (
            format!("[denylist]\nips = ['10.0.0.0/33']\n{tier}"),
            2,
            "10.0.0.0/33",
        ),
        (
            format!("[client_ip]\nipv6_prefix = 64\nproxies = []\n{tier}"),
            3,
            "unknown field `proxies`",
        ),
        (
            format!("{tier}methods = ['GET', 'G E T']\n"),
            6,
            "\"G E T\", expected an HTTP method",
        ),
        (
            format!("{tier}mode = 'sometimes'\n"),
            6,
            "unknown variant `sometimes`, expected one of `enforce`, `shadow`, `canary`, `off`",
        ),
        (
            format!("mode = 'canary'\n{tier}"),
            1,
            "unknown mode \"canary\"",
        ),
        (
            format!("{tier}plan = {{ header = 'x plan' }}\n"),
            6,
            "\"x plan\", expected a header name",
        ),
        (
            tier.replace("key='global'", "key={ header = 'a b' }"),
            3,
            "\"a b\", expected a header name",
        ),
        (
            tier.replace("key='global'", "key={ heder = 'x' }"),
            3,
            "unknown field `heder`, expected `header`",
        ),
    ] {
        let e = Policy::from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.contains(&format!("at line {line},")) && e.contains(what),
            "{text}\n{e}"
        );
    }
}

/// The pairs a file spells as two fields are checked together when the
/// builder is made, naming the tier and the field.
#[test]
fn paired_fields_are_checked_by_the_builder() {
    let tier = "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\n";
    for (extra, message) in [
        (
            "algorithm='leaky_bucket_shape'",
            "max_delay: required by algorithm = \"leaky_bucket_shape\"",
        ),
        (
            "max_delay='1s'",
            "max_delay: only algorithm = \"leaky_bucket_shape\" delays requests",
        ),
        (
            "mode='canary'",
            "canary_percent: required by mode = \"canary\"",
        ),
        (
            "mode='canary'\ncanary_percent=101",
            "canary_percent: 101 is above 100",
        ),
        (
            "mode='shadow'\ncanary_percent=1",
            "canary_percent: only mode = \"canary\" uses it",
        ),
    ] {
        let p = Policy::from_toml_str(&format!("{tier}{extra}\n")).unwrap();
        let e = p.builder(crate::backend::MemoryBackend::new()).unwrap_err();
        assert_eq!(e.to_string(), format!("policy: tier \"t\": {message}"));
    }
    let p = Policy::from_toml_str(&format!("{tier}mode='canary'\ncanary_percent=100\n")).unwrap();
    let layer = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new()).unwrap();
    assert_eq!(
        layer.handle().tiers()[0].mode,
        Mode::Canary { percent: 100 }
    );
}

/// The quota fields a `[[tier]]` shares with a rules file's `[[rule]]`
/// (`QuotaPolicy`, flattened, so read through serde's buffer): a mistake in
/// one is reported at its own line and column, with the parser's message,
/// as for the table's other fields; an unknown field at its key.
#[test]
fn quota_fields_are_checked_when_read_with_their_line() {
    let tier = "[[tier]]\nname='t'\nkey='global'\nlimit=1\nperiod='1s'\n";
    for (text, at, what) in [
        (
            format!("{tier}burst = 'x'\n"),
            "line 6, column 9",
            "\ninvalid type: string \"x\", expected u64\n",
        ),
        (
            format!("{tier}sync = 'often'\n"),
            "line 6, column 8",
            "\nunknown variant `often`, expected `request` or `lease`\n",
        ),
        (
            tier.replace("period='1s'", "period='fortnight'"),
            "line 5, column 8",
            "\ninvalid period \"fortnight\"",
        ),
        (
            format!("{tier}  perod = '1m'\n"),
            "line 6, column 3",
            "\nunknown field `perod`\n",
        ),
    ] {
        let e = Policy::from_toml_str(&text).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("policy: TOML parse error at {at}\n")) && e.contains(what),
            "{text}\n{e}"
        );
    }
}

/// `rollout = [...]`: the plan builds with a `[control]` table, and
/// `build()` refuses a wrong one naming the field.
#[test]
fn a_rollout_plan_is_checked_at_build_naming_the_field() {
    let tier = |rollout: &str, control: bool| {
        format!(
            "{}[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 5\nperiod = '1m'\nrollout = {rollout}\n[tier.rollout_gates]\nmin_requests = 100\n",
            if control { "[control]\nredis_key = 'rl:control'\n" } else { "" }
        )
    };
    let recipe = r#"[{ mode = "shadow", for = "1h" }, { mode = "canary:1", for = "1h" }, { mode = "canary:10", for = "1h" }, { mode = "enforce" }]"#;
    let build = |text: &str| {
        let p = Policy::from_toml_str(text)?;
        RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new())
    };
    let layer = build(&tier(recipe, true)).unwrap();
    assert_eq!(layer.handle().planned_tiers(), ["ip"]);
    for (rollout, control, want) in [
        (recipe, false, "tier \"ip\": rollout: a plan runs fleet-wide through the control key, which keeps its state and moves every instance together: set a control key (`control_key`, a policy's [control]) on a Redis backend"),
        (r#"[{ mode = "shadow", for = "1h" }, { mode = "enforce", for = "1h" }]"#, true, "tier \"ip\": rollout[1].for: the last stage is where the plan ends: it has no `for`"),
        (r#"[{ mode = "shadow" }, { mode = "enforce" }]"#, true, "tier \"ip\": rollout[0].for: every stage but the last needs a `for` (how long it lasts)"),
        (r#"[{ mode = "shadow", for = "0s" }, { mode = "enforce" }]"#, true, "tier \"ip\": rollout[0].for: must be greater than 0"),
        (r#"[{ mode = "off", for = "1h" }, { mode = "enforce" }]"#, true, "tier \"ip\": rollout[0].mode: a stage cannot be \"off\" (use the kill switch); give shadow, canary:<1-100> or enforce"),
        ("[]", true, "tier \"ip\": rollout: a plan needs at least one stage"),
    ] {
        let err = build(&tier(rollout, control)).unwrap_err().to_string();
        assert_eq!(err, want, "{rollout}");
    }
    let err = build(&tier(
        r#"[{ mode = "canary:101", for = "1h" }, { mode = "enforce" }]"#,
        true,
    ))
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("canary:101") && err.contains("line 8"),
        "{err}"
    );
    // `plan` names where a client's plan is read; the error says where a
    // rollout plan goes.
    let err = build("[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 5\nperiod = '1m'\nplan = [{ mode = 'shadow' }]\n")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("a staged rollout plan is written `rollout = ["),
        "{err}"
    );
}

/// `candidates = [...]`: read into the tier's candidate quotas, each
/// refused at build naming `candidates[i]`; a calendar tier's take its
/// period or none.
#[test]
fn candidates_are_read_and_checked_naming_the_field() {
    let tier = "[[tier]]\nname='user'\nkey='user'\nlimit=100\nperiod='1m'\n";
    let build = |text: &str| {
        let p = Policy::from_toml_str(text).map_err(|e| e.to_string())?;
        RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new())
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    let p = Policy::from_toml_str(&format!(
        "{tier}candidates=[{{ limit = 50, period = '1m' }}, {{ limit = 80, period = '1m', burst = 100 }}]\n"
    ))
    .unwrap();
    assert_eq!(
        p.tiers[0].candidates,
        [
            CandidatePolicy {
                limit: 50,
                period: Some(PolicyPeriod::Duration(std::time::Duration::from_secs(60))),
                burst: None
            },
            CandidatePolicy {
                limit: 80,
                period: Some(PolicyPeriod::Duration(std::time::Duration::from_secs(60))),
                burst: Some(100)
            },
        ]
    );
    let handle = RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new())
        .unwrap()
        .handle();
    let report = handle
        .candidates("user", 10, std::time::Duration::from_secs(3600))
        .unwrap();
    let quotas: Vec<&str> = report.candidates.iter().map(|c| c.quota.as_str()).collect();
    assert_eq!(quotas, ["50/1m", "80/1m,burst=100"]);
    assert_eq!(
        build(&format!(
            "{tier}candidates=[{{ limit = 50, period = '1m' }}, {{ limit = 0, period = '1m' }}]\n"
        )),
        Err("tier \"user\": candidates[1].limit: must be greater than 0".into())
    );
    assert_eq!(
        build(&format!("{tier}candidates=[{{ limit = 50 }}]\n")),
        Err("tier \"user\": candidates[0].period: required".into())
    );
    assert_eq!(
        build(&format!("{tier}candidates=[{{ limit = 50, period = 'month' }}]\n")),
        Err("tier \"user\": candidates[0].period: a calendar period is for a calendar tier's candidates".into())
    );
    let err = build(&format!(
        "{tier}candidates=[{{ limit = 50, period = '1m', brust = 3 }}]\n"
    ))
    .unwrap_err();
    assert!(err.contains("brust"), "{err}");
    #[cfg(feature = "calendar")]
    {
        let monthly = "[[tier]]\nname='m'\nkey='user'\nlimit=1000\nperiod='month'\n";
        assert_eq!(
            build(&format!(
                "{monthly}candidates=[{{ limit = 500 }}, {{ limit = 800, period = 'month' }}]\n"
            )),
            Ok(())
        );
        assert_eq!(
            build(&format!("{monthly}candidates=[{{ limit = 500, period = '1d' }}]\n")),
            Err("tier \"m\": candidates[0].period: a calendar tier's candidates count per its own calendar window: give its period or none".into())
        );
    }
}

/// `[tier.guard]`: builds with a `[control]` table (with or without a
/// plan); `build()` refuses a wrong one naming the field, and the file
/// refuses any fall back but shadow.
#[test]
fn a_fall_back_guard_is_checked_at_build_naming_the_field() {
    let tier = |guard: &str, control: bool| {
        format!(
            "{}[[tier]]\nname = 'ip'\nkey = 'ip'\nlimit = 5\nperiod = '1m'\n[tier.guard]\n{guard}\n",
            if control { "[control]\nredis_key = 'rl:control'\n" } else { "" }
        )
    };
    let build = |text: &str| {
        let p = Policy::from_toml_str(text)?;
        RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new())
    };
    let layer = build(&tier(
        "fallback = 'shadow'\nbucket = '5s'\nconfirm = 3",
        true,
    ))
    .unwrap();
    let guarded: Vec<String> = layer
        .handle()
        .guard_views()
        .into_iter()
        .map(|g| g.tier)
        .collect();
    assert_eq!(guarded, ["ip"]);
    for (guard, control, want) in [
        ("fallback = 'shadow'", false, "tier \"ip\": guard: the fall back guard counts and acts fleet-wide through the control key: set a control key (`control_key`, a policy's [control]) on a Redis backend"),
        ("fallback = 'shadow'\nbucket = '500ms'", true, "tier \"ip\": guard.bucket: at least 1s"),
        ("fallback = 'shadow'\nbucket = '3s'", true, "tier \"ip\": guard.bucket: at least the control key's poll interval (5s): every instance adds its counts once a poll"),
        ("fallback = 'shadow'\nk = 0.0", true, "tier \"ip\": guard.k: a number greater than 0"),
        ("fallback = 'shadow'\nconfirm = 0", true, "tier \"ip\": guard.confirm: at least 1"),
        ("fallback = 'shadow'\nsurge_factor = 1.0", true, "tier \"ip\": guard.surge_factor: a factor greater than 1"),
    ] {
        let err = build(&tier(guard, control)).unwrap_err().to_string();
        assert_eq!(err, want, "{guard}");
    }
    for (guard, what) in [
        ("fallback = 'off'", "guard.fallback: \"off\": the only fall back is \"shadow\" (never off, never the denylist)"),
        ("bucket = '2s'", "missing field `fallback`"),
        ("fallback = 'shadow'\nkk = 4", "unknown field `kk`"),
    ] {
        let err = build(&tier(guard, true)).unwrap_err().to_string();
        assert!(err.contains(what), "{guard}: {err}");
    }
}

/// `demand = true` turns per-key demand recording on (suggestions); off by
/// default.
#[test]
fn demand_is_read_from_the_policy() {
    let tier = "[[tier]]\nname='user'\nkey='user'\nlimit=100\nperiod='1m'\n";
    let handle = |text: &str| {
        let p = Policy::from_toml_str(text).unwrap();
        RateLimitLayer::from_policy(&p, crate::backend::MemoryBackend::new())
            .unwrap()
            .handle()
    };
    assert!(!handle(tier).demand_enabled());
    assert!(handle(&format!("demand = true\n{tier}")).demand_enabled());
}
