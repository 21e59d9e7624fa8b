//! Calendar quotas (issue 28) beyond the HTTP scenario of
//! tests/algorithms/algorithms_http.rs: two application instances whose clocks
//! disagree by seconds agree on the window Redis's clock picks, and a
//! calendar tier with another algorithm is refused naming the field.

use crate::support::redis_server::RedisServer;
use tiered_ratelimit::algorithm::{Calendar, CalendarWindow, Limit};
use tiered_ratelimit::backend::{Backend, ManualClock, TierCheck};
use tiered_ratelimit::{key::Global, Algorithm, Quota, RateLimitLayer, Tier};

/// 2024-10-27T00:00 in Berlin (2024-10-26T22:00Z), before a 25-hour day.
const BERLIN_MIDNIGHT_US: u64 = 1_729_980_000_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_clocks_seconds_apart_agree_on_the_window() {
    let server = RedisServer::start();
    // The manual clock stands for Redis TIME: the scripts read it, the
    // instances do not.
    let redis_clock = ManualClock::new(BERLIN_MIDNIGHT_US - 1);
    let backend: Backend = server.backend_on(&redis_clock).into();
    let day = Calendar::day().time_zone("Europe/Berlin").unwrap();
    // Instance A's clock is 7 s behind Redis's, B's 4 s ahead (already in
    // the next day by its own clock).
    let check = |app_now_us: u64| TierCheck {
        key: "cal:day:k".to_owned(),
        limit: Limit::Calendar(CalendarWindow {
            limit: 3,
            bounds: day.bounds_around(app_now_us).unwrap(),
        }),
        cost: 1,
        home: None,
    };
    let (a, b) = (
        check(BERLIN_MIDNIGHT_US - 7_000_000),
        check(BERLIN_MIDNIGHT_US + 4_000_000),
    );
    let remaining = |v: tiered_ratelimit::backend::Verdict| {
        let d = v.decisions[0];
        (d.allowed, d.remaining, d.reset_after_us)
    };
    // 1 µs before Berlin's midnight (by Redis): both count in the old day.
    let va = backend.check(vec![a.clone()]).await.unwrap();
    assert_eq!(remaining(va), (true, 2, 1));
    let vb = backend.check(vec![b.clone()]).await.unwrap();
    assert_eq!(remaining(vb), (true, 1, 1));
    // At midnight: both in the new day (25 hours long), one count.
    redis_clock.set(BERLIN_MIDNIGHT_US);
    let day25 = 25 * 3_600_000_000;
    let vb = backend.check(vec![b]).await.unwrap();
    assert_eq!(remaining(vb), (true, 2, day25));
    let va = backend.check(vec![a]).await.unwrap();
    assert_eq!(remaining(va), (true, 1, day25));
    // Stored as one integer, the window start plus the count; it expires
    // with the window, plus a minute.
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let v: String = redis::cmd("GET")
        .arg("cal:day:k")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, (BERLIN_MIDNIGHT_US + 2).to_string());
    let pttl: u64 = redis::cmd("PTTL")
        .arg("cal:day:k")
        .query_async(&mut conn)
        .await
        .unwrap();
    // (PTTL counts down in Redis's real time since the SET.)
    let want = day25 / 1000 + 60_000;
    assert!(
        pttl <= want && pttl + 5_000 > want,
        "PTTL {pttl}, want {want}"
    );
}

#[test]
fn another_algorithm_or_lease_mode_is_refused_naming_the_field() {
    let month = Calendar::month().anchor("31").unwrap();
    let err = RateLimitLayer::builder()
        .tier(
            Tier::new("monthly", Global, Quota::per_hour(10))
                .calendar(month)
                .algorithm(Algorithm::TokenBucket),
        )
        .build()
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tier \"monthly\": algorithm: a calendar period (period = \"month\") counts with \
         fixed_window only, not token_bucket"
    );
}

/// A policy file's calendar tier: `period = "month"`, `anchor = 31`,
/// `time_zone = "Europe/Berlin"`, through a real server. In 2024 the
/// period anchored on the 31st renews on 29 February (Berlin midnight,
/// 2024-02-28T23:00Z), then on 31 March (2024-03-30T23:00Z: the clocks
/// change at 02:00 that day).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_file_month_anchored_on_the_31st() {
    use crate::support::{app, client, denied, limits, ok, serve};
    use tiered_ratelimit::{backend::MemoryBackend, policy::Policy};
    const FEB29_S: u64 = 1_709_161_200;
    const MAR31_S: u64 = 1_711_839_600;
    let policy = Policy::from_toml_str(
        "[[tier]]\nname = 'monthly'\nkey = 'global'\nlimit = 1\nperiod = 'month'\n\
         anchor = 31\ntime_zone = 'Europe/Berlin'\n",
    )
    .unwrap();
    let clock = ManualClock::new(FEB29_S * 1_000_000 - 1);
    let layer =
        RateLimitLayer::from_policy(&policy, MemoryBackend::with_manual_clock(clock.clone()))
            .unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let send = || async { limits(&c.get(format!("http://{addr}/")).send().await.unwrap()) };
    assert_eq!(send().await, ok(1, 0, FEB29_S));
    assert_eq!(send().await, denied(1, 0, FEB29_S, 1));
    clock.set(FEB29_S * 1_000_000);
    assert_eq!(send().await, ok(1, 0, MAR31_S));
    assert_eq!(send().await, denied(1, 0, MAR31_S, MAR31_S - FEB29_S));
}

#[test]
fn policy_misconfiguration_names_the_field() {
    use tiered_ratelimit::{backend::MemoryBackend, policy::Policy};
    let err = |extra: &str| {
        let text = format!("[[tier]]\nname = 't'\nkey = 'global'\nlimit = 1\n{extra}\n");
        match Policy::from_toml_str(&text) {
            Err(e) => e.to_string(),
            Ok(p) => RateLimitLayer::from_policy(&p, MemoryBackend::new())
                .unwrap_err()
                .to_string(),
        }
    };
    assert_eq!(
        err("period = 'month'\nalgorithm = 'token_bucket'"),
        "tier \"t\": algorithm: a calendar period (period = \"month\") counts with \
         fixed_window only, not token_bucket"
    );
    assert_eq!(
        err("period = 'day'\ntime_zone = 'Mars/Olympus'"),
        "policy: tier \"t\": time_zone: \"Mars/Olympus\" is not an IANA time zone name (e.g. \
         \"Europe/Berlin\")"
    );
    assert_eq!(
        err("period = '1h'\ntime_zone = 'UTC'"),
        "policy: tier \"t\": time_zone: only a calendar period (period = \"day\", \"week\", \
         \"month\" or \"year\") uses it"
    );
    assert_eq!(
        err("period = 'week'\nanchor = 'someday'"),
        "policy: tier \"t\": anchor: \"someday\" is not an anchor of period = \"week\" (a weekday, \
         \"monday\" to \"sunday\")"
    );
    assert!(err("period = 'fortnight'").contains("invalid period \"fortnight\""));
}

/// `exhausted_status = 403`: a spent calendar quota answers 403 with the
/// draft's quota-exceeded problem body, Retry-After to the renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_calendar_quota_may_answer_403() {
    use crate::support::{app, client, serve};
    use tiered_ratelimit::{backend::MemoryBackend, policy::Policy};
    // 2024-06-15T12:00Z: the UTC day renews in 12 hours.
    const NOON_S: u64 = 1_718_452_800;
    let policy = Policy::from_toml_str(
        "body = 'problem'\n[[tier]]\nname = 'daily'\nkey = 'global'\nlimit = 1\n\
         period = 'day'\nexhausted_status = 403\n",
    )
    .unwrap();
    let clock = ManualClock::new(NOON_S * 1_000_000);
    let layer =
        RateLimitLayer::from_policy(&policy, MemoryBackend::with_manual_clock(clock)).unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    assert_eq!(
        c.get(format!("http://{addr}/"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let res = c.get(format!("http://{addr}/")).send().await.unwrap();
    assert_eq!(res.status(), 403);
    let h = |n: &str| res.headers()[n].to_str().unwrap().to_owned();
    assert_eq!(h("content-type"), "application/problem+json");
    assert_eq!(h("retry-after"), "43200");
    assert_eq!(h("x-ratelimit-reset"), (NOON_S + 43_200).to_string());
    assert_eq!(
        res.text().await.unwrap(),
        r#"{"type":"https://iana.org/assignments/http-problem-types#quota-exceeded","title":"Request cannot be satisfied as assigned quota has been exceeded","status":403,"detail":"Retry in 43200 seconds.","violated-policies":["daily"],"retry_after":43200}"#
    );
    // Only a calendar quota takes it, and only 403 or 429.
    let err = |extra: &str| {
        let text = format!("[[tier]]\nname = 't'\nkey = 'global'\nlimit = 1\n{extra}\n");
        let p = Policy::from_toml_str(&text).unwrap();
        RateLimitLayer::from_policy(&p, MemoryBackend::new())
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        err("period = '1h'\nexhausted_status = 403"),
        "policy: tier \"t\": exhausted_status: 403 is for a calendar quota (period = \"day\", \
         \"week\", \"month\" or \"year\"); a rate answers 429"
    );
    assert_eq!(
        err("period = 'day'\nexhausted_status = 402"),
        "policy: tier \"t\": exhausted_status: 402 is neither 429 nor 403"
    );
}

/// Peek on a calendar tier: the renewal (what the admin page shows as
/// "quota renews" and `/api/peek` as `renews_at_us`), under the tier's
/// quota and under a per-key override's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peek_shows_when_the_quota_renews() {
    use tiered_ratelimit::backend::MemoryBackend;
    // 2024-02-15T12:00Z; the week from Monday renews 2024-02-19T00:00 in
    // Tokyo (2024-02-18T15:00Z).
    const NOW_US: u64 = 1_707_998_400_000_000;
    const RENEW_US: u64 = 1_708_268_400_000_000;
    let clock = ManualClock::new(NOW_US);
    let week = Calendar::week().time_zone("Asia/Tokyo").unwrap();
    let layer = RateLimitLayer::builder()
        .backend(MemoryBackend::with_manual_clock(clock))
        .tier(
            Tier::new("weekly", Global, Quota::per_hour(7))
                .calendar(week)
                .overrides(true),
        )
        .build()
        .unwrap();
    let s = layer.handle().peek("weekly", "all").await.unwrap();
    assert_eq!(s.renews_at_us, Some(RENEW_US));
    assert_eq!((s.allowed, s.limit, s.remaining), (true, 7, 6));
    assert_eq!(s.reset_after.as_micros() as u64, RENEW_US - NOW_US);
    layer
        .handle()
        .set_override(
            "weekly",
            "all",
            tiered_ratelimit::handle::Override::Quota(Quota::per_hour(70)),
            None,
            "test",
        )
        .await
        .unwrap();
    let s = layer.handle().peek("weekly", "all").await.unwrap();
    assert_eq!(
        (s.limit, s.remaining, s.renews_at_us),
        (70, 69, Some(RENEW_US))
    );
}

/// A calendar tier's plans: a plan gives a limit per calendar window (its
/// `period` may be left out), renewed at the same boundary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_of_a_calendar_tier_count_per_its_window() {
    use crate::support::{app, client, denied, limits, ok, serve};
    use tiered_ratelimit::{backend::MemoryBackend, policy::Policy};
    // 2024-06-15T12:00Z; the UTC year from 04-06 renews 2025-04-06T00:00Z.
    const NOON_S: u64 = 1_718_452_800;
    const RENEW_S: u64 = 1_743_897_600;
    let policy = Policy::from_toml_str(
        "[[tier]]\nname = 'yearly'\nkey = 'global'\nlimit = 1\nperiod = 'year'\n\
         anchor = '04-06'\nplan = { header = 'x-plan' }\n\
         [tier.plans]\npro = { limit = 2 }\n",
    )
    .unwrap();
    let clock = ManualClock::new(NOON_S * 1_000_000);
    let layer =
        RateLimitLayer::from_policy(&policy, MemoryBackend::with_manual_clock(clock)).unwrap();
    let addr = serve(app(layer)).await;
    let c = client();
    let pro = || async {
        let r = c.get(format!("http://{addr}/")).header("x-plan", "pro");
        limits(&r.send().await.unwrap())
    };
    assert_eq!(pro().await, ok(2, 1, RENEW_S));
    assert_eq!(pro().await, ok(2, 0, RENEW_S));
    assert_eq!(pro().await, denied(2, 0, RENEW_S, RENEW_S - NOON_S));
}

/// The penalty box on a calendar tier: 2 denials within 10 minutes box
/// the key for exactly 15 minutes, across the UTC midnight the day renews
/// at; the box holds past midnight (the headers show its end, the new day
/// is not charged), and when it ends the new day has its whole quota.
/// (A box shorter than the rest of the day shows the renewal instead:
/// the request cannot pass before it.)
async fn penalty_box_on_a_calendar_day(backend: Backend, clock: ManualClock) {
    use crate::support::{app, client, denied, limits, ok, serve};
    use std::time::Duration;
    use tiered_ratelimit::Penalty;
    // The clock starts at 2024-06-15T23:50Z, ten minutes before the UTC
    // day renews.
    const MID_S: u64 = 1_718_496_000;
    let layer = RateLimitLayer::builder()
        .backend(backend)
        .backend_timeout(Duration::from_secs(2))
        .tier(
            Tier::new("daily", Global, Quota::per_hour(2))
                .calendar(Calendar::day())
                .penalty(Penalty::new(
                    2,
                    Duration::from_secs(600),
                    Duration::from_secs(900),
                )),
        )
        .build()
        .unwrap();
    let h = layer.handle();
    let addr = serve(app(layer)).await;
    let c = client();
    let send = || async { limits(&c.get(format!("http://{addr}/")).send().await.unwrap()) };
    assert_eq!(send().await, ok(2, 1, MID_S));
    assert_eq!(send().await, ok(2, 0, MID_S));
    // The first strike: denied by the spent day, until midnight.
    assert_eq!(send().await, denied(2, 0, MID_S, 600));
    // The second: boxed 15 minutes, to 00:05; the headers show its end.
    assert_eq!(send().await, denied(2, 0, MID_S + 300, 900));
    let s = h.peek("daily", "all").await.unwrap();
    assert_eq!(
        (s.allowed, s.blocked_for),
        (false, Some(Duration::from_secs(900)))
    );
    // At midnight the day renews, but the box holds to 00:05.
    clock.set(MID_S * 1_000_000);
    assert_eq!(send().await, denied(2, 0, MID_S + 300, 300));
    clock.advance(Duration::from_secs(299));
    assert_eq!(send().await, denied(2, 0, MID_S + 300, 1));
    // The box is over: the new day was not charged while it held.
    clock.advance(Duration::from_secs(1));
    assert_eq!(send().await, ok(2, 1, MID_S + 86_400));
    assert_eq!(send().await, ok(2, 0, MID_S + 86_400));
    assert_eq!(send().await, denied(2, 0, MID_S + 86_400, 86_100));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalty_box_on_a_calendar_day_in_memory() {
    use tiered_ratelimit::backend::MemoryBackend;
    let clock = ManualClock::new(1_718_495_400_000_000);
    let b = MemoryBackend::with_manual_clock(clock.clone());
    penalty_box_on_a_calendar_day(b.into(), clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalty_box_on_a_calendar_day_on_redis() {
    let server = RedisServer::start();
    let clock = ManualClock::new(1_718_495_400_000_000);
    let b = server
        .backend_on(&clock)
        .with_test_ttl_slack(std::time::Duration::from_secs(7200));
    penalty_box_on_a_calendar_day(b.into(), clock).await;
}

/// Days whose local midnight falls in a DST gap, in years whose
/// transitions the bundled database does not list but generates from the
/// zone's recurring rule (the POSIX TZ string of its TZif file): the
/// zone, the day before's first instant, the gap day's first instant
/// (the gap's end: 01:00 local) and the next day's, epoch seconds.
const RULE_GAP_DAYS: [(&str, u64, u64, u64); 5] = [
    // <-04>4<-03>,M9.1.6/24,...: 2030-09-08 00:00 -04 -> 01:00 -03.
    (
        "America/Santiago",
        1_914_984_000,
        1_915_070_400,
        1_915_153_200,
    ),
    // EET-2EEST,M3.5.0/0,...: 2030-03-31 00:00 +02 -> 01:00 +03.
    ("Asia/Beirut", 1_901_052_000, 1_901_138_400, 1_901_221_200),
    // CST5CDT,M3.2.0/0,...: 2030-03-10 00:00 -05 -> 01:00 -04.
    (
        "America/Havana",
        1_899_262_800,
        1_899_349_200,
        1_899_432_000,
    ),
    // EET-2EEST,M4.5.5/0,...: 2030-04-26 00:00 +02 -> 01:00 +03.
    ("Africa/Cairo", 1_903_298_400, 1_903_384_800, 1_903_467_600),
    // <-01>1<+00>,M3.5.0/0,...: 2030-03-31 00:00 -01 -> 01:00 +00.
    (
        "Atlantic/Azores",
        1_901_062_800,
        1_901_149_200,
        1_901_232_000,
    ),
];

/// A daily calendar quota of 1 in each zone of [`RULE_GAP_DAYS`], through
/// a real server: refused 1 µs before the gap day's first instant, told to
/// retry in 1 s (the boundary), and renewed at that exact microsecond for
/// a 23-hour day.
async fn a_day_whose_midnight_is_in_a_rule_generated_gap(backend: impl Fn(ManualClock) -> Backend) {
    use crate::support::{app, client, denied, limits, ok, serve};
    use tiered_ratelimit::policy::Policy;
    for (i, (zone, before_s, gap_day_s, next_s)) in RULE_GAP_DAYS.into_iter().enumerate() {
        // A tier (so a stored key) per zone.
        let policy = Policy::from_toml_str(&format!(
            "[[tier]]\nname = 'daily{i}'\nkey = 'global'\nlimit = 1\nperiod = 'day'\n\
             time_zone = '{zone}'\n"
        ))
        .unwrap();
        // Noon of the day before, then 1 µs before the gap day starts.
        let clock = ManualClock::new((before_s + 12 * 3600) * 1_000_000);
        let layer = RateLimitLayer::from_policy(&policy, backend(clock.clone())).unwrap();
        let addr = serve(app(layer)).await;
        let c = client();
        let send = || async { limits(&c.get(format!("http://{addr}/")).send().await.unwrap()) };
        assert_eq!(send().await, ok(1, 0, gap_day_s), "{zone}");
        clock.set(gap_day_s * 1_000_000 - 1);
        assert_eq!(send().await, denied(1, 0, gap_day_s, 1), "{zone}");
        clock.set(gap_day_s * 1_000_000);
        assert_eq!(send().await, ok(1, 0, next_s), "{zone}");
        assert_eq!(
            send().await,
            denied(1, 0, next_s, next_s - gap_day_s),
            "{zone}"
        );
        assert_eq!(next_s - gap_day_s, 23 * 3600, "{zone}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_whose_midnight_is_in_a_rule_generated_gap_in_memory() {
    use tiered_ratelimit::backend::MemoryBackend;
    a_day_whose_midnight_is_in_a_rule_generated_gap(|c| MemoryBackend::with_manual_clock(c).into())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_whose_midnight_is_in_a_rule_generated_gap_on_redis() {
    let server = RedisServer::start();
    a_day_whose_midnight_is_in_a_rule_generated_gap(|c| {
        server
            .backend_on(&c)
            .with_test_ttl_slack(std::time::Duration::from_secs(7200))
            .into()
    })
    .await;
}
