//! Calendar boundaries: DST days decided at the exact instant, and a
//! property test over the 400-year Gregorian cycle and every bundled zone
//! against an independent computation.

use super::{Calendar, CalendarError, CalendarPeriod, CalendarWindow};
use jiff::civil::Date;
use jiff::tz::TimeZone;
use jiff::{Span, Timestamp};
use proptest::prelude::*;

mod posix_rule;
use posix_rule::{rule_zones, Rule, RuleZone};

/// An RFC 3339 instant as epoch µs.
fn us(s: &str) -> u64 {
    let t: Timestamp = s.parse().expect("test instant");
    u64::try_from(t.as_microsecond()).expect("after 1970")
}

/// `c`'s windows around the boundary `b`: the instant 1 µs before it is in
/// `[before, b)`, the boundary itself in `[b, after)`.
fn boundary(c: &Calendar, before: &str, b: &str, after: &str) {
    let (before, b, after) = (us(before), us(b), us(after));
    assert_eq!(
        c.window_at(b - 1),
        Some((before, b)),
        "{c:?} 1 µs before {b}"
    );
    assert_eq!(c.window_at(b), Some((b, after)), "{c:?} at {b}");
}

#[test]
fn new_york_days_of_23_and_25_hours() {
    let c = Calendar::day().time_zone("America/New_York").unwrap();
    // 2024-03-10: 02:00 EST -> 03:00 EDT, a 23-hour day.
    boundary(
        &c,
        "2024-03-09T05:00Z",
        "2024-03-10T05:00Z",
        "2024-03-11T04:00Z",
    );
    boundary(
        &c,
        "2024-03-10T05:00Z",
        "2024-03-11T04:00Z",
        "2024-03-12T04:00Z",
    );
    // 2024-11-03: 02:00 EDT -> 01:00 EST, a 25-hour day.
    boundary(
        &c,
        "2024-11-02T04:00Z",
        "2024-11-03T04:00Z",
        "2024-11-04T05:00Z",
    );
    boundary(
        &c,
        "2024-11-03T04:00Z",
        "2024-11-04T05:00Z",
        "2024-11-05T05:00Z",
    );
}

#[test]
fn berlin_days_and_a_month_across_the_changes() {
    let c = Calendar::day().time_zone("Europe/Berlin").unwrap();
    // 2024-03-31 02:00 CET -> 03:00 CEST; 2024-10-27 03:00 CEST -> 02:00 CET.
    boundary(
        &c,
        "2024-03-29T23:00Z",
        "2024-03-30T23:00Z",
        "2024-03-31T22:00Z",
    );
    boundary(
        &c,
        "2024-03-30T23:00Z",
        "2024-03-31T22:00Z",
        "2024-04-01T22:00Z",
    );
    boundary(
        &c,
        "2024-10-25T22:00Z",
        "2024-10-26T22:00Z",
        "2024-10-27T23:00Z",
    );
    boundary(
        &c,
        "2024-10-26T22:00Z",
        "2024-10-27T23:00Z",
        "2024-10-28T23:00Z",
    );
    // March 2024 in Berlin is 31 days less one hour.
    let m = Calendar::month().time_zone("Europe/Berlin").unwrap();
    boundary(
        &m,
        "2024-02-29T23:00Z",
        "2024-03-31T22:00Z",
        "2024-04-30T22:00Z",
    );
}

#[test]
fn lord_howe_half_hour_shifts() {
    let c = Calendar::day().time_zone("Australia/Lord_Howe").unwrap();
    // 2024-04-07 02:00 +11 -> 01:30 +10:30: 24.5 hours.
    boundary(
        &c,
        "2024-04-05T13:00Z",
        "2024-04-06T13:00Z",
        "2024-04-07T13:30Z",
    );
    boundary(
        &c,
        "2024-04-06T13:00Z",
        "2024-04-07T13:30Z",
        "2024-04-08T13:30Z",
    );
    // 2024-10-06 02:00 +10:30 -> 02:30 +11: 23.5 hours.
    boundary(
        &c,
        "2024-10-04T13:30Z",
        "2024-10-05T13:30Z",
        "2024-10-06T13:00Z",
    );
    boundary(
        &c,
        "2024-10-05T13:30Z",
        "2024-10-06T13:00Z",
        "2024-10-07T13:00Z",
    );
}

#[test]
fn apia_skipped_the_30th_of_december_2011() {
    // 2011-12-29 23:59:59 -10:00 was followed by 2011-12-31 00:00:00 +14:00.
    let c = Calendar::day().time_zone("Pacific/Apia").unwrap();
    boundary(
        &c,
        "2011-12-28T10:00Z",
        "2011-12-29T10:00Z",
        "2011-12-30T10:00Z",
    );
    boundary(
        &c,
        "2011-12-29T10:00Z",
        "2011-12-30T10:00Z",
        "2011-12-31T10:00Z",
    );
    // A week anchored on the missing Friday starts when the 31st does.
    let w = Calendar::week()
        .time_zone("Pacific/Apia")
        .unwrap()
        .anchor("Friday")
        .unwrap();
    boundary(
        &w,
        "2011-12-23T10:00Z",
        "2011-12-30T10:00Z",
        "2012-01-05T10:00Z",
    );
}

#[test]
fn midnight_in_a_gap_starts_the_day_at_the_gap_end_and_a_fold_at_the_first() {
    let c = Calendar::day().time_zone("America/Sao_Paulo").unwrap();
    // 2015-10-18 00:00 -03 -> 01:00 -02: the day starts at 01:00 -02.
    boundary(
        &c,
        "2015-10-17T03:00Z",
        "2015-10-18T03:00Z",
        "2015-10-19T02:00Z",
    );
    // 2016-02-21 00:00 -02 -> 2016-02-20 23:00 -03: the 20th has 25 hours.
    boundary(
        &c,
        "2016-02-20T02:00Z",
        "2016-02-21T03:00Z",
        "2016-02-22T03:00Z",
    );
}

#[test]
fn month_anchored_on_the_31st_clamps_like_stripe() {
    let c = Calendar::month().anchor("31").unwrap();
    boundary(
        &c,
        "2023-12-31T00:00Z",
        "2024-01-31T00:00Z",
        "2024-02-29T00:00Z",
    );
    boundary(
        &c,
        "2024-01-31T00:00Z",
        "2024-02-29T00:00Z",
        "2024-03-31T00:00Z",
    );
    boundary(
        &c,
        "2024-03-31T00:00Z",
        "2024-04-30T00:00Z",
        "2024-05-31T00:00Z",
    );
    let y = Calendar::year().anchor("02-29").unwrap();
    boundary(
        &y,
        "2024-02-29T00:00Z",
        "2025-02-28T00:00Z",
        "2026-02-28T00:00Z",
    );
    let w = Calendar::week().anchor("sunday").unwrap();
    boundary(
        &w,
        "2024-06-02T00:00Z",
        "2024-06-09T00:00Z",
        "2024-06-16T00:00Z",
    );
}

#[test]
fn misconfiguration_names_the_field() {
    let err = |r: Result<Calendar, CalendarError>| r.unwrap_err().to_string();
    assert_eq!(
        err(Calendar::day().time_zone("Mars/Olympus")),
        "time_zone: \"Mars/Olympus\" is not an IANA time zone name (e.g. \"Europe/Berlin\")"
    );
    assert_eq!(
        err(Calendar::month().anchor("32")),
        "anchor: \"32\" is not an anchor of period = \"month\" (a day of the month, 1 to 31)"
    );
    assert_eq!(
        err(Calendar::week().anchor("mon")),
        "anchor: \"mon\" is not an anchor of period = \"week\" (a weekday, \"monday\" to \"sunday\")"
    );
    assert_eq!(
        err(Calendar::year().anchor("02-30")),
        "anchor: \"02-30\" is not an anchor of period = \"year\" (\"MM-DD\", e.g. \"04-06\")"
    );
    assert!(Calendar::day().anchor("1").is_err());
    assert_eq!(
        Calendar::day()
            .time_zone("america/new_york")
            .unwrap()
            .time_zone_name(),
        "America/New_York"
    );
    assert_eq!(
        CalendarPeriod::from_name("month"),
        Some(CalendarPeriod::Month)
    );
    assert_eq!(CalendarPeriod::from_name("fortnight"), None);
}

#[test]
fn bounds_put_the_app_clock_half_a_window_from_the_edges() {
    let c = Calendar::day();
    let day = 86_400_000_000;
    let noon = us("2024-06-15T12:00Z");
    let midnight = noon - day / 2;
    // Morning: yesterday and today; afternoon: today and tomorrow.
    assert_eq!(
        c.bounds_around(noon - 1),
        Some([midnight - day, midnight, midnight + day])
    );
    assert_eq!(
        c.bounds_around(noon),
        Some([midnight, midnight + day, midnight + 2 * day])
    );
    let w = CalendarWindow {
        limit: 5,
        bounds: [midnight, midnight + day, midnight + 2 * day],
    };
    assert_eq!(w.window(midnight + day - 1), (midnight, midnight + day));
    assert_eq!(
        w.window(midnight + day),
        (midnight + day, midnight + 2 * day)
    );
}

// ---- the independent computation ----

/// Whether `d` starts a period of `c` (from the anchor, by dates only).
fn is_start(c: &Calendar, d: Date) -> bool {
    let clamp = |day: i8| day.min(d.days_in_month());
    let a = i8::try_from(c.anchor % 32).unwrap();
    match c.period {
        CalendarPeriod::Day => true,
        CalendarPeriod::Week => d.weekday().to_monday_zero_offset() == a,
        CalendarPeriod::Month => d.day() == clamp(a),
        CalendarPeriod::Year => {
            d.month() == i8::try_from(c.anchor / 32).unwrap() && d.day() == clamp(a)
        }
    }
}

/// The first instant whose local date is `d` or later: within a span of
/// one offset the local date changes only where the clock passes midnight,
/// and otherwise only at a transition; so it is the earliest candidate of
/// those two kinds whose local date is `d` or later.
fn first_instant(tz: &TimeZone, d: Date) -> Timestamp {
    let midnight = d.to_datetime(jiff::civil::Time::midnight());
    let lo = jiff::tz::Offset::UTC
        .to_timestamp(midnight)
        .unwrap()
        .checked_sub(Span::new().hours(48))
        .unwrap();
    let hi = lo.checked_add(Span::new().hours(96)).unwrap();
    let mut candidates = vec![];
    let mut offsets = vec![tz.to_offset(lo)];
    for t in tz.following(lo).take_while(|t| t.timestamp() < hi) {
        candidates.push(t.timestamp());
        offsets.push(t.offset());
    }
    for o in offsets {
        candidates.push(o.to_timestamp(midnight).unwrap());
    }
    candidates
        .into_iter()
        .filter(|&c| tz.to_datetime(c).date() >= d)
        .min()
        .unwrap()
}

/// The window of `t` by walking dates: the latest period start whose first
/// instant is at or before `t`, and the next period start after it.
fn independent_window(c: &Calendar, t: Timestamp) -> (u64, u64) {
    let us = |x: Timestamp| u64::try_from(x.as_microsecond()).unwrap();
    let mut d = c.zone.to_datetime(t).date().tomorrow().unwrap();
    loop {
        if is_start(c, d) && first_instant(&c.zone, d) <= t {
            break;
        }
        d = d.yesterday().unwrap();
    }
    let mut n = d.tomorrow().unwrap();
    while !is_start(c, n) {
        n = n.tomorrow().unwrap();
    }
    (us(first_instant(&c.zone, d)), us(first_instant(&c.zone, n)))
}

fn calendar(zone: &str, period: u8, anchor: u8) -> Calendar {
    let c = Calendar::new(match period % 4 {
        0 => CalendarPeriod::Day,
        1 => CalendarPeriod::Week,
        2 => CalendarPeriod::Month,
        _ => CalendarPeriod::Year,
    })
    .time_zone(zone)
    .unwrap();
    let a = match c.period {
        CalendarPeriod::Day => return c,
        CalendarPeriod::Week => super::WEEKDAYS[usize::from(anchor % 7)].to_owned(),
        CalendarPeriod::Month => (anchor % 31 + 1).to_string(),
        // Every month, days up to 31 where the month has them (29 for
        // February, so 02-29 is in).
        CalendarPeriod::Year => {
            let m = anchor % 12 + 1;
            let max = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][usize::from(m - 1)];
            format!("{m:02}-{:02}", anchor / 12 % max + 1)
        }
    };
    c.anchor(&a).unwrap()
}

/// 2000-01-01T00:00Z .. 2400-01-01T00:00Z: one whole Gregorian cycle.
const CYCLE_US: std::ops::Range<u64> = 946_684_800_000_000..13_569_465_600_000_000;

fn zones() -> &'static [String] {
    static ZONES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    ZONES.get_or_init(|| {
        let z = super::time_zone_names();
        assert!(z.len() > 300, "the bundled database has {} zones", z.len());
        z
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5000, ..ProptestConfig::default() })]

    /// Our window of any instant of the cycle, in any zone, any period and
    /// anchor, equals the independent one; the windows before and after it
    /// touch it (every instant is in exactly one window; a month anchored
    /// on the 31st has no gaps).
    #[test]
    fn windows_equal_an_independent_computation(
        zone in any::<prop::sample::Index>(),
        at in CYCLE_US,
        period in 0u8..4,
        anchor in any::<u8>(),
    ) {
        let zone = zone.get(zones());
        let c = calendar(zone, period, anchor);
        let t = Timestamp::from_microsecond(i64::try_from(at).unwrap()).unwrap();
        let (start, end) = c.window_at(at).unwrap();
        prop_assert!(start <= at && at < end);
        prop_assert_eq!((start, end), independent_window(&c, t), "{:?} at {}", c, t);
        prop_assert_eq!(c.window_at(end).unwrap().0, end);
        prop_assert_eq!(c.window_at(start - 1).unwrap().1, start);
        let b = c.bounds_around(at).unwrap();
        prop_assert!(b[0] < b[1] && b[1] < b[2] && b[0] <= at && at < b[2]);
        prop_assert!(at - b[0] >= (b[1] - b[0]) / 2 && b[2] - at >= (b[2] - b[1]) / 2);
    }
}

// ---- the recurring rules, expanded without jiff ----

/// The window of `t` as [`independent_window`] finds it, with the local
/// dates and first instants of `rule` instead of jiff's.
fn rule_window(c: &Calendar, rule: &Rule, t: i64) -> (u64, u64) {
    let us = |s: i64| u64::try_from(s * 1_000_000).unwrap();
    let mut d = rule.local_date(t).tomorrow().unwrap();
    while !(is_start(c, d) && rule.first_instant(d) <= t) {
        d = d.yesterday().unwrap();
    }
    let mut n = d.tomorrow().unwrap();
    while !is_start(c, n) {
        n = n.tomorrow().unwrap();
    }
    (us(rule.first_instant(d)), us(rule.first_instant(n)))
}

/// Every change the rule alone gives in the cycle (after the zone's last
/// listed transition), in every zone whose rule moves the clock across or
/// onto local midnight: the days around it start where the rule says, to
/// the microsecond, and jiff's transition is the rule's.
#[test]
fn rule_generated_midnight_changes_start_days_where_the_rule_says() {
    let zones: Vec<&RuleZone> = rule_zones()
        .iter()
        .filter(|z| z.rule.touches_midnight())
        .collect();
    let names: Vec<&str> = zones.iter().map(|z| z.name.as_str()).collect();
    for must in [
        "America/Santiago",
        "Asia/Beirut",
        "America/Havana",
        "Africa/Cairo",
    ] {
        assert!(names.contains(&must), "{must} not among {names:?}");
    }
    let mut checked = 0;
    for z in zones {
        let c = Calendar::day().time_zone(&z.name).unwrap();
        for year in 2000..2400 {
            for (at, _) in z.rule.changes(year) {
                if at <= z.last_listed_s {
                    continue;
                }
                let t = Timestamp::from_second(at).unwrap();
                let jiff_at = c
                    .zone
                    .following(t.checked_sub(Span::new().seconds(1)).unwrap());
                assert_eq!(
                    jiff_at.map(|x| x.timestamp()).next(),
                    Some(t),
                    "{}: jiff's change after {t}",
                    z.name
                );
                let (mut d, last) = (
                    z.rule.local_date(at - 1).yesterday().unwrap(),
                    z.rule.local_date(at).tomorrow().unwrap(),
                );
                while d <= last {
                    let b = u64::try_from(z.rule.first_instant(d) * 1_000_000).unwrap();
                    assert_eq!(c.window_at(b - 1).map(|w| w.1), Some(b), "{} {d}", z.name);
                    assert_eq!(c.window_at(b).map(|w| w.0), Some(b), "{} {d}", z.name);
                    d = d.tomorrow().unwrap();
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 10_000, "{checked} days checked");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// In every zone with a DST rule, within a day and a half of a change
    /// that only the rule gives (a year of the cycle after the zone's last
    /// listed transition): our window, for any period and anchor, equals
    /// the one the rule gives when expanded here, and jiff's.
    #[test]
    fn rule_generated_years_equal_the_rule(
        zone in any::<prop::sample::Index>(),
        year in 2000i16..2400,
        which in 0usize..2,
        off_us in -129_600_000_000i64..129_600_000_000,
        period in 0u8..4,
        anchor in any::<u8>(),
    ) {
        let z = zone.get(rule_zones());
        let (change, _) = z.rule.changes(year)[which];
        prop_assume!(change > z.last_listed_s);
        let at_us = change * 1_000_000 + off_us;
        let at = u64::try_from(at_us).unwrap();
        let c = calendar(&z.name, period, anchor);
        let w = c.window_at(at).unwrap();
        let t = Timestamp::from_microsecond(at_us).unwrap();
        prop_assert_eq!(w, independent_window(&c, t), "{:?} at {}", c, t);
        // The rule governs only what follows the zone's last listed
        // transition: a week, month or year window may begin before it
        // (Riga's year from 8 April 2000, a year Latvia kept no DST, is
        // listed, not the rule's), and then only jiff's answer applies.
        let by_rule = rule_window(&c, &z.rule, at_us.div_euclid(1_000_000));
        let listed_us = z.last_listed_s.saturating_mul(1_000_000);
        if i64::try_from(w.0.min(by_rule.0)).unwrap() > listed_us {
            prop_assert_eq!(w, by_rule, "{:?} at {} µs", c, at);
        }
    }
}
