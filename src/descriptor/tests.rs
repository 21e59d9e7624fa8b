//! The descriptor limiter's unit tests.

use super::*;
use crate::backend::{ManualClock, MemoryBackend};

const T0_US: u64 = 1_700_000_000 * 1_000_000;

fn limiter(rules: &str) -> DescriptorLimiter {
    RulesPolicy::from_toml_str(rules)
        .unwrap()
        .limiter(MemoryBackend::with_manual_clock(ManualClock::new(T0_US)))
        .unwrap()
}

fn names(a: &Answer) -> Vec<Option<&str>> {
    a.statuses
        .iter()
        .map(|s| s.limit.as_ref().map(|l| &*l.name))
        .collect()
}

/// A value on an earlier entry is more specific than one on a later
/// entry; a rule with no value is the most general.
#[tokio::test]
async fn the_most_specific_rule_applies() {
    let l = limiter(
        r#"
        domain = "d"
        [[rule]]
        name = "any"
        match = [{ key = "a" }, { key = "b" }]
        limit = 5
        period = "1m"
        [[rule]]
        name = "b_is_1"
        match = [{ key = "a" }, { key = "b", value = "1" }]
        limit = 5
        period = "1m"
        [[rule]]
        name = "a_is_x"
        match = [{ key = "a", value = "x" }, { key = "b" }]
        limit = 5
        period = "1m"
        "#,
    );
    let d = |a, b| Descriptor::new(vec![("a", a), ("b", b)]);
    let got = l
        .check(
            "d",
            &[d("x", "1"), d("y", "1"), d("y", "2"), d("x", "2")],
            1,
        )
        .await
        .unwrap();
    assert_eq!(
        names(&got),
        [Some("a_is_x"), Some("b_is_1"), Some("any"), Some("a_is_x")]
    );
    // A descriptor with fewer or other entries matches none of them.
    let got = l
        .check("d", &[Descriptor::new(vec![("a", "x")])], 1)
        .await
        .unwrap();
    assert_eq!(names(&got), [None]);
}

/// One rule, two descriptors: the same values are one check with the
/// summed cost; other values are a check of their own, in the same
/// all-or-nothing call.
#[tokio::test]
async fn descriptors_of_one_rule_are_grouped_by_their_values() {
    let l = limiter(
        r#"
        domain = "d"
        [[rule]]
        name = "ip"
        match = [{ key = "ip" }]
        limit = 3
        period = "1m"
        "#,
    );
    let ip = |v| Descriptor::new(vec![("ip", v)]);
    let a = l.check("d", &[ip("1"), ip("2"), ip("1")], 1).await.unwrap();
    assert_eq!(a.overall, Code::Ok);
    let left: Vec<u64> = a.statuses.iter().map(|s| s.remaining).collect();
    assert_eq!(left, [1, 2, 1]);
    // ip 1 has 1 left: 2 more of it deny the request, and ip 2 is not
    // charged either.
    let a = l.check("d", &[ip("2"), ip("1"), ip("1")], 1).await.unwrap();
    assert_eq!(a.overall, Code::OverLimit);
    assert_eq!(a.statuses[1].code, Code::OverLimit);
    let a = l.check("d", &[ip("2")], 1).await.unwrap();
    assert_eq!(a.statuses[0].remaining, 1);
}

#[test]
fn bad_rules_fail_at_build_naming_the_field() {
    let err = |rules: &str| {
        RulesPolicy::from_toml_str(rules)
            .and_then(|p| p.limiter(MemoryBackend::new()))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(err("domain = \"\""), "policy: domain: must not be empty");
    assert_eq!(
        err("domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = [{ key = \"a\" }]\nperiod = \"1s\""),
        "policy: rule \"r\": limit: required (or unlimited = true)"
    );
    assert_eq!(
        err("domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = []\nunlimited = true"),
        "policy: rule \"r\": match: 0 entries, 1 to 16 are accepted"
    );
    assert_eq!(
        err(
            "domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = [{ key = \"a\" }]\nunlimited = true\n\
             [[rule]]\nname = \"s\"\nmatch = [{ key = \"a\" }]\nunlimited = true"
        ),
        "policy: rule \"s\": match: the same as rule \"r\""
    );
    // Lease mode's settings, as a tier's.
    let rule = "domain = \"d\"\n[[rule]]\nname = \"r\"\nmatch = [{ key = \"a\" }]\n";
    assert_eq!(
        err(&format!("{rule}limit = 5\nperiod = \"1s\"\nsync_max = 2")),
        "policy: rule \"r\": sync_max: only sync = \"lease\" uses it"
    );
    assert_eq!(
        err(&format!(
            "{rule}limit = 5\nperiod = \"1s\"\nsync = \"lease\"\nsync_interval = \"0s\""
        )),
        "policy: rule \"r\": sync_interval: must be above 0"
    );
    assert_eq!(
        err(&format!("{rule}unlimited = true\nsync = \"lease\"")),
        "policy: rule \"r\": sync: an unlimited rule makes no call to lease for"
    );
    assert!(err(&format!(
        "{rule}limit = 5\nperiod = \"1s\"\nsync = \"often\""
    ))
    .contains("unknown variant `often`, expected `request` or `lease`"));
    // Found by trying the service: mistakes that were accepted silently.
    assert_eq!(
        err("domain = \"d\""),
        "policy: rule: no [[rule]]: at least one is required"
    );
    let unlimited = |name: &str| {
        format!("[[rule]]\nname = \"{name}\"\nmatch = [{{ key = \"u\" }}]\nunlimited = true\n")
    };
    let limited = |name: &str, key: &str| {
        format!("[[rule]]\nname = \"{name}\"\nmatch = [{{ key = \"{key}\" }}]\nlimit = 1\nperiod = \"1s\"\n")
    };
    assert_eq!(
        err(&format!(
            "domain = \"d\"\n{}{}",
            unlimited("r"),
            limited("r", "a")
        )),
        "policy: rule \"r\": name: used by another rule"
    );
    assert_eq!(
        err(&format!("domain = \"d\"\n{}", unlimited("bad name"))),
        "policy: rule \"bad name\": name: must be 1-64 characters of [A-Za-z0-9_-]"
    );
    assert_eq!(
        err("domain = \"d\"\n[[rule]]\nname = \"u\"\nmatch = [{ key = \"u\" }]\nunlimited = true\nlimit = 5\nperiod = \"1s\""),
        "policy: rule \"u\": unlimited = true: limit, period, burst and algorithm must not be set"
    );
    let many: String = (0..65)
        .map(|i| limited(&format!("r{i}"), &format!("k{i}")))
        .collect();
    assert_eq!(
        err(&format!("domain = \"d\"\n{many}")),
        "policy: rule \"r64\": at most 64 limited rules per domain (each is a tier of one atomic check)"
    );
    assert_eq!(
        err(&format!(
            "domain = \"d\"\nbackend_timeout_ms = 0\n{}",
            limited("r", "a")
        )),
        "policy: backend_timeout_ms: must be at least 1"
    );
}

/// A `[[rule]]`'s quota fields are a `[[tier]]`'s (`policy::QuotaPolicy`):
/// the same parser, the same message, at the field's own line.
#[cfg(feature = "policy-file")]
#[test]
fn quota_fields_are_read_as_a_tiers_with_their_line() {
    let rule =
        "domain = 'd'\n[[rule]]\nname = 'r'\nmatch = [{ key = 'a' }]\nlimit = 5\nperiod = '1s'\n";
    let e = RulesPolicy::from_toml_str(&format!("{rule}burst = 'x'\n"))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("policy: rule \"r\": TOML parse error at line 7, column 9\n")
            && e.ends_with("\ninvalid type: string \"x\", expected u64\n"),
        "{e}"
    );
    let r = RulesPolicy::from_toml_str(&format!("{rule}burst = 8\nsync = 'lease'\n")).unwrap();
    assert_eq!(
        (r.rules[0].quota.limit, r.rules[0].quota.burst),
        (Some(5), Some(8))
    );
    assert_eq!(r.rules[0].quota.sync.as_deref(), Some("lease"));
}

/// A rule's candidate quotas: checked per descriptor value in the same
/// call, never changing the answer, counted as a tier's
/// (`RateLimitHandle::candidates`); refused on an unlimited rule.
#[tokio::test]
async fn a_rules_candidates_are_counted_per_descriptor() {
    let rules = |extra: &str| {
        format!(
            "domain = \"d\"\n[[rule]]\nname = \"ip\"\nmatch = [{{ key = \"ip\" }}]\nlimit = 5\nperiod = \"1m\"\n{extra}\n"
        )
    };
    let l = limiter(&rules("candidates = [{ limit = 2, period = \"1m\" }]"));
    let bare = limiter(&rules(""));
    let ip = |v| Descriptor::new(vec![("ip", v)]);
    for _ in 0..4 {
        let want = bare.check("d", &[ip("1"), ip("2")], 1).await.unwrap();
        let got = l.check("d", &[ip("1"), ip("2")], 1).await.unwrap();
        assert_eq!(got, want);
    }
    let r = l
        .handle()
        .candidates("ip", 5, std::time::Duration::from_secs(3600))
        .unwrap();
    let c = &r.candidates[0];
    assert_eq!(c.quota, "2/1m");
    // 8 checks (2 descriptors, 4 times), 2 denials of each value.
    assert_eq!((c.requests, c.would_deny, c.keys_denied), (8, 4, 2));
    let err = RulesPolicy::from_toml_str(
        "domain = \"d\"\n[[rule]]\nname = \"u\"\nmatch = [{ key = \"ip\" }]\nunlimited = true\ncandidates = [{ limit = 2, period = \"1m\" }]\n",
    )
    .unwrap()
    .limiter(MemoryBackend::new())
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "policy: rule \"u\": candidates: an unlimited rule makes no call to check them in"
    );
}
