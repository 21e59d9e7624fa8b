//! Envoy's rate limit units ([`Unit`]) and a quota written in one
//! ([`per_unit`]).

use crate::quota::Quota;

/// A unit of Envoy's `RateLimit.unit` (`envoy.service.ratelimit.v3`), as
/// the reference service counts them: fixed windows of these many seconds,
/// aligned to the Unix epoch (a MONTH is 30 days, a YEAR 365 days).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Unit {
    /// 1 second.
    Second,
    /// 60 seconds.
    Minute,
    /// 3,600 seconds.
    Hour,
    /// 86,400 seconds.
    Day,
    /// 604,800 seconds (7 days).
    Week,
    /// 2,592,000 seconds (30 days).
    Month,
    /// 31,536,000 seconds (365 days).
    Year,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// The unit's length in seconds.
    pub const fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Year => 31_536_000,
        }
    }

    /// The unit's name as Envoy's enum spells it (`SECOND` … `YEAR`).
    pub const fn name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Week => "WEEK",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        }
    }

    /// The unit named `name`, in any case (`second`, `MINUTE`, `Day`);
    /// `None` for anything else (Envoy's `UNKNOWN` included).
    pub fn from_name(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(name))
    }
}

/// A quota as Envoy's `requests_per_unit` and `unit`: the shortest unit
/// that holds a whole number of requests (10 per 10 s → 1 per SECOND;
/// 7 per 10 s → 42 per MINUTE; 1 per 30 days → 1 per MONTH). A period no
/// unit divides evenly is written in the shortest unit at least as long as
/// the period, rounded down (1 per 14 days → 2 per MONTH), so a quota that
/// admits requests never reads 0; a period longer than a year reads 1 per
/// YEAR at least.
pub fn per_unit(q: Quota) -> (u32, Unit) {
    let period_us = q.period().as_micros().max(1);
    let limit = u128::from(q.limit());
    let count = |unit: Unit| limit * u128::from(unit.seconds()) * 1_000_000 / period_us;
    let clamp = |n: u128| u32::try_from(n).unwrap_or(u32::MAX);
    for unit in Unit::ALL {
        let unit_us = u128::from(unit.seconds()) * 1_000_000;
        if (limit * unit_us) % period_us == 0 && limit * unit_us >= period_us {
            return (clamp(count(unit)), unit);
        }
    }
    let unit = Unit::ALL
        .into_iter()
        .find(|u| u128::from(u.seconds()) * 1_000_000 >= period_us)
        .unwrap_or(Unit::Year);
    (clamp(count(unit).max(1)), unit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn quotas_become_requests_per_unit() {
        let days = |n: u64| Duration::from_secs(n * 86_400);
        assert_eq!(per_unit(Quota::per_second(10)), (10, Unit::Second));
        assert_eq!(per_unit(Quota::per_minute(100)), (100, Unit::Minute));
        assert_eq!(
            per_unit(Quota::new(10, Duration::from_secs(10))),
            (1, Unit::Second)
        );
        assert_eq!(
            per_unit(Quota::new(7, Duration::from_secs(10))),
            (42, Unit::Minute)
        );
        assert_eq!(per_unit(Quota::per_hour(5)), (5, Unit::Hour));
        assert_eq!(per_unit(Quota::new(1, days(7))), (1, Unit::Week));
        // Was 23 per WEEK and 0 per WEEK: never 0 for a rule that admits.
        assert_eq!(per_unit(Quota::new(100, days(30))), (100, Unit::Month));
        assert_eq!(per_unit(Quota::new(1, days(14))), (2, Unit::Month));
        assert_eq!(per_unit(Quota::new(5, days(365))), (5, Unit::Year));
        assert_eq!(per_unit(Quota::new(1, days(1000))), (1, Unit::Year));
        assert_eq!(
            per_unit(Quota::new(1, Duration::from_millis(500))),
            (2, Unit::Second)
        );
    }

    #[test]
    fn unit_names_in_any_case() {
        assert_eq!(Unit::from_name("second"), Some(Unit::Second));
        assert_eq!(Unit::from_name("YEAR"), Some(Unit::Year));
        assert_eq!(Unit::from_name("Month"), Some(Unit::Month));
        assert_eq!(Unit::from_name("unknown"), None);
        assert_eq!(Unit::from_name("foo"), None);
    }
}
