//! Calendar periods: the boundaries of days, weeks, months and years in a
//! time zone, for quotas people bill by ("10 000 calls a month, renewed on
//! the 15th"). The rules are in [`Calendar`]'s docs.

#[cfg(feature = "calendar")]
use jiff::civil::{Date, Time};
#[cfg(feature = "calendar")]
use jiff::tz::{AmbiguousOffset, TimeZone, TimeZoneDatabase};
#[cfg(feature = "calendar")]
use jiff::Timestamp;
#[cfg(not(feature = "calendar"))]
pub(crate) use off::Calendar;
#[cfg(feature = "calendar")]
use std::sync::{Arc, OnceLock};

/// The length of a calendar period (see [`Calendar`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarPeriod {
    /// From one local midnight to the next.
    Day,
    /// Seven days from the anchor weekday (default Monday, ISO 8601).
    Week,
    /// From the anchor day of one month to that of the next (default the 1st).
    Month,
    /// From the anchor day of one year to that of the next (default 1 January).
    Year,
}

impl CalendarPeriod {
    /// Every period's [`name`](CalendarPeriod::name).
    pub const NAMES: [&'static str; 4] = ["day", "week", "month", "year"];

    /// `day`, `week`, `month` or `year`: how a policy file spells it
    /// (`period = "month"`).
    pub const fn name(self) -> &'static str {
        match self {
            CalendarPeriod::Day => "day",
            CalendarPeriod::Week => "week",
            CalendarPeriod::Month => "month",
            CalendarPeriod::Year => "year",
        }
    }

    /// The period called `name`, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Day, Self::Week, Self::Month, Self::Year]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

/// Why a [`Calendar`] could not be made. The messages name the policy
/// file's field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CalendarError {
    /// Not an IANA zone name that the bundled database knows.
    #[error("time_zone: {0:?} is not an IANA time zone name (e.g. \"Europe/Berlin\")")]
    UnknownTimeZone(String),
    /// An anchor the period cannot take.
    #[error("anchor: {value:?} is not an anchor of period = {period:?} ({expected})")]
    BadAnchor {
        /// The period's name.
        period: &'static str,
        /// The anchor given.
        value: String,
        /// What the period takes.
        expected: &'static str,
    },
}

#[cfg(feature = "calendar")]
/// The bundled IANA database (jiff's copy, compiled into the binary).
fn database() -> &'static TimeZoneDatabase {
    static DB: OnceLock<TimeZoneDatabase> = OnceLock::new();
    DB.get_or_init(TimeZoneDatabase::bundled)
}

#[cfg(feature = "calendar")]
#[cfg_attr(docsrs, doc(cfg(feature = "calendar")))]
/// Every zone name of the bundled database (the names `time_zone` takes).
pub fn time_zone_names() -> Vec<String> {
    database().available().map(|n| n.to_string()).collect()
}

/// A calendar period in a time zone, with its anchor, for quotas people
/// bill by ("10 000 calls a month, renewed on the 15th").
///
/// A calendar is a period (`day`, `week`, `month`, `year`), an IANA time
/// zone (default `UTC`) and an anchor (the day a period starts: a weekday for
/// `week`, a day of the month 1–31 for `month`, a `"MM-DD"` for `year`;
/// default the first). Its windows start at the **first instant** of their
/// start date in the zone: local midnight, or, where midnight does not exist
/// (a DST gap that covers it), the first instant after the gap; where
/// midnight happens twice (a fold), the first of them. A day is 23, 24 or 25
/// hours long (Lord Howe's: 23.5 or 24.5; Apia skipped 2011-12-30 whole, so
/// its 29th ran into the 31st).
///
/// An anchor past a month's end means that month's last day, as Stripe's
/// billing anchors do: anchored on the 31st, a period starts on 31 January,
/// 28 (29) February, 31 March, 30 April ...; anchored on `"02-29"`, a yearly
/// period starts on 28 February in common years.
///
/// The time-zone rules are [jiff]'s, with its bundled copy of the IANA
/// database (the same on every host, no `/usr/share/zoneinfo` needed): after
/// a zone's last listed transition its changes come from its recurring rule
/// (the POSIX TZ string that ends its TZif file), which jiff expands; a day
/// whose midnight that rule puts in a gap (Santiago, Beirut, Havana, Cairo,
/// the Azores) starts at the gap's end like one the data lists. The
/// Redis scripts hold no zone tables: the application sends the boundaries
/// around its own clock ([`Calendar::bounds_around`]) and the script picks the
/// window by Redis `TIME` ([`CalendarWindow`]).
///
/// All instants are Unix epoch **microseconds**.
///
/// ```
/// use tiered_ratelimit::algorithm::Calendar;
/// // Renewed on the 31st, in Berlin: 31 Jan, 29 Feb (2024), 31 Mar ...
/// let c = Calendar::month().time_zone("Europe/Berlin")?.anchor("31")?;
/// // 2024-02-15T12:00Z is in the window 2024-01-31T00:00+01:00 ..
/// // 2024-02-29T00:00+01:00.
/// let (start, end) = c.window_at(1_707_998_400_000_000).unwrap();
/// assert_eq!((start, end), (1_706_655_600_000_000, 1_709_161_200_000_000));
/// # Ok::<(), tiered_ratelimit::algorithm::CalendarError>(())
/// ```
#[cfg(feature = "calendar")]
#[cfg_attr(docsrs, doc(cfg(feature = "calendar")))]
#[derive(Clone, PartialEq, Eq)]
#[must_use]
pub struct Calendar {
    period: CalendarPeriod,
    /// Week: the weekday, Monday = 0; month: the day, 1–31; year: the month
    /// (1–12) × 32 + the day (1–31).
    anchor: u16,
    zone: TimeZone,
    zone_name: Arc<str>,
}

#[cfg(feature = "calendar")]
impl std::fmt::Debug for Calendar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Calendar")
            .field("period", &self.period.name())
            .field("anchor", &self.anchor_label())
            .field("time_zone", &&*self.zone_name)
            .finish()
    }
}

#[cfg(feature = "calendar")]
const WEEKDAYS: [&str; 7] = [
    "monday",
    "tuesday",
    "wednesday",
    "thursday",
    "friday",
    "saturday",
    "sunday",
];

#[cfg(feature = "calendar")]
impl Calendar {
    /// A calendar period in UTC with the default anchor.
    pub fn new(period: CalendarPeriod) -> Self {
        let anchor = match period {
            CalendarPeriod::Day | CalendarPeriod::Week => 0,
            CalendarPeriod::Month => 1,
            CalendarPeriod::Year => 32 + 1,
        };
        Self {
            period,
            anchor,
            zone: TimeZone::UTC,
            zone_name: Arc::from("UTC"),
        }
    }

    /// Local days (from midnight to midnight), UTC until [`time_zone`](Self::time_zone).
    pub fn day() -> Self {
        Self::new(CalendarPeriod::Day)
    }

    /// Weeks from Monday (see [`anchor`](Self::anchor)).
    pub fn week() -> Self {
        Self::new(CalendarPeriod::Week)
    }

    /// Months from the 1st (see [`anchor`](Self::anchor)).
    pub fn month() -> Self {
        Self::new(CalendarPeriod::Month)
    }

    /// Years from 1 January (see [`anchor`](Self::anchor)).
    pub fn year() -> Self {
        Self::new(CalendarPeriod::Year)
    }

    /// The IANA time zone whose local midnights bound the windows
    /// (`"America/New_York"`; case-insensitive; default `"UTC"`).
    ///
    /// # Errors
    /// [`CalendarError::UnknownTimeZone`] for a name the bundled database
    /// lacks.
    pub fn time_zone(mut self, name: &str) -> Result<Self, CalendarError> {
        let zone = database()
            .get(name)
            .map_err(|_| CalendarError::UnknownTimeZone(name.to_owned()))?;
        self.zone_name = Arc::from(zone.iana_name().unwrap_or(name));
        self.zone = zone;
        Ok(self)
    }

    /// The day a period starts: for `week` a weekday (`"monday"` …
    /// `"sunday"`, any case), for `month` a day of the month (`"1"` …
    /// `"31"`; past a month's end, its last day), for `year` a `"MM-DD"`
    /// (`"04-06"`; `"02-29"` is 28 February in common years). `day` takes
    /// none.
    ///
    /// # Errors
    /// [`CalendarError::BadAnchor`], naming what the period takes.
    pub fn anchor(mut self, anchor: &str) -> Result<Self, CalendarError> {
        let bad = |expected| CalendarError::BadAnchor {
            period: self.period.name(),
            value: anchor.to_owned(),
            expected,
        };
        let day_of = |s: &str, max: u16| s.parse::<u16>().ok().filter(|d| (1..=max).contains(d));
        self.anchor = match self.period {
            CalendarPeriod::Day => return Err(bad("a day starts at local midnight: no anchor")),
            CalendarPeriod::Week => {
                let lower = anchor.to_ascii_lowercase();
                let at = WEEKDAYS.iter().position(|w| *w == lower);
                let at = at.ok_or_else(|| bad("a weekday, \"monday\" to \"sunday\""))?;
                u16::try_from(at).unwrap_or(0)
            }
            CalendarPeriod::Month => {
                day_of(anchor, 31).ok_or_else(|| bad("a day of the month, 1 to 31"))?
            }
            CalendarPeriod::Year => {
                const DAYS: [u16; 12] = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
                let expected = "\"MM-DD\", e.g. \"04-06\"";
                let (m, d) = anchor.split_once('-').ok_or_else(|| bad(expected))?;
                let m = day_of(m, 12).filter(|_| m.len() == 2);
                let m = m.ok_or_else(|| bad(expected))?;
                let max = DAYS[usize::from(m - 1)];
                let d = day_of(d, max).filter(|_| d.len() == 2);
                m * 32 + d.ok_or_else(|| bad(expected))?
            }
        };
        Ok(self)
    }

    /// The period.
    pub fn period(&self) -> CalendarPeriod {
        self.period
    }

    /// The zone's IANA name (as the database spells it).
    pub fn time_zone_name(&self) -> &str {
        &self.zone_name
    }

    /// The anchor as [`anchor`](Self::anchor) takes it (`""` for `day`).
    pub fn anchor_label(&self) -> String {
        match self.period {
            CalendarPeriod::Day => String::new(),
            CalendarPeriod::Week => WEEKDAYS[usize::from(self.anchor % 7)].to_owned(),
            CalendarPeriod::Month => self.anchor.to_string(),
            CalendarPeriod::Year => format!("{:02}-{:02}", self.anchor / 32, self.anchor % 32),
        }
    }

    /// The nominal length, microseconds (day 24 h, week 7 days, month 31
    /// days, year 366 days): the longest a window can be, give or take a DST
    /// shift. For the bounds that need one (a key's time-to-live margin).
    pub fn longest_us(&self) -> u64 {
        const DAY: u64 = 86_400_000_000;
        match self.period {
            CalendarPeriod::Day => DAY,
            CalendarPeriod::Week => 7 * DAY,
            CalendarPeriod::Month => 31 * DAY,
            CalendarPeriod::Year => 366 * DAY,
        }
    }

    /// The start date of the period that holds the date `d` (by dates only).
    fn start_on_or_before(&self, d: Date) -> Option<Date> {
        match self.period {
            CalendarPeriod::Day => Some(d),
            CalendarPeriod::Week => {
                let back = (d.weekday().to_monday_zero_offset() - self.anchor_i8()).rem_euclid(7);
                d.checked_sub(jiff::Span::new().days(back)).ok()
            }
            CalendarPeriod::Month => {
                let this = self.in_month(d.year(), d.month())?;
                if this <= d {
                    return Some(this);
                }
                let prev = d.first_of_month().yesterday().ok()?;
                self.in_month(prev.year(), prev.month())
            }
            CalendarPeriod::Year => {
                let this = self.in_year(d.year())?;
                if this <= d {
                    return Some(this);
                }
                self.in_year(d.year().checked_sub(1)?)
            }
        }
    }

    /// The start date of the period after the one starting on `s`.
    fn next_start(&self, s: Date) -> Option<Date> {
        match self.period {
            CalendarPeriod::Day => s.tomorrow().ok(),
            CalendarPeriod::Week => s.checked_add(jiff::Span::new().days(7)).ok(),
            CalendarPeriod::Month => {
                let next = s.last_of_month().tomorrow().ok()?;
                self.in_month(next.year(), next.month())
            }
            CalendarPeriod::Year => self.in_year(s.year().checked_add(1)?),
        }
    }

    fn anchor_i8(&self) -> i8 {
        i8::try_from(self.anchor % 32).unwrap_or(1)
    }

    /// The anchor day in a month, clamped to its last day.
    fn in_month(&self, year: i16, month: i8) -> Option<Date> {
        let first = Date::new(year, month, 1).ok()?;
        Date::new(year, month, self.anchor_i8().min(first.days_in_month())).ok()
    }

    /// The anchor date in a year, its day clamped to the month's last.
    fn in_year(&self, year: i16) -> Option<Date> {
        let month = i8::try_from(self.anchor / 32).ok()?;
        self.in_month(year, month)
    }

    /// The first instant of the date `d` in the zone: local midnight; in a
    /// gap, the transition that ends the gap; in a fold, the earlier one.
    fn first_instant(&self, d: Date) -> Option<Timestamp> {
        let midnight = d.to_datetime(Time::midnight());
        let ambiguous = self.zone.to_ambiguous_timestamp(midnight);
        match ambiguous.offset() {
            AmbiguousOffset::Unambiguous { .. } | AmbiguousOffset::Fold { .. } => {
                ambiguous.earlier().ok()
            }
            AmbiguousOffset::Gap { .. } => {
                // `earlier` is an instant before the gap (on the clock, before
                // midnight): the next transition is the gap's end.
                let before = ambiguous.earlier().ok()?;
                let t = self.zone.following(before).next()?;
                Some(t.timestamp())
            }
        }
    }

    /// The window holding the instant `at_us` (epoch µs): its start and end,
    /// epoch µs (`start ≤ at_us < end`). `None` only outside the years the
    /// library represents (never for a `u64` of µs before the year 2262).
    pub fn window_at(&self, at_us: u64) -> Option<(u64, u64)> {
        let at = i64::try_from(at_us).ok()?;
        let t = Timestamp::from_microsecond(at).ok()?;
        let mut start_date = self.start_on_or_before(self.zone.to_datetime(t).date())?;
        let mut start = self.first_instant(start_date)?;
        // A fold around midnight: `t` may read the day before on the clock
        // after the next period's first instant has passed; move on (the
        // first instants never decrease, so this ends).
        for _ in 0..4 {
            let next = self.next_start(start_date)?;
            let end = self.first_instant(next)?;
            if t < end {
                let us = |x: Timestamp| u64::try_from(x.as_microsecond()).ok();
                return Some((us(start)?, us(end)?));
            }
            (start_date, start) = (next, end);
        }
        None
    }

    /// The boundaries the application sends for the instant `now_us` (its own
    /// clock): three consecutive window boundaries `[b0, b1, b2]` (two
    /// windows) such that `now_us` is at least half a window from `b0` and
    /// from `b2`. A backend whose clock is within half a window (11.5 hours
    /// or more) of the application's finds its own window among the two
    /// ([`CalendarWindow::window`]).
    pub fn bounds_around(&self, now_us: u64) -> Option<[u64; 3]> {
        let (start, end) = self.window_at(now_us)?;
        if now_us - start < end - now_us {
            let (before, _) = self.window_at(start.checked_sub(1)?)?;
            Some([before, start, end])
        } else {
            let (_, after) = self.window_at(end)?;
            Some([start, end, after])
        }
    }
}

/// A fixed window over calendar boundaries: at most `limit` cost per window,
/// the windows given by three boundaries around the application's clock
/// ([`Calendar::bounds_around`]); the backend's clock picks one of the two.
/// Stored as a fixed window's state ([`super::FixedWindowState`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalendarWindow {
    /// Cost admitted per window.
    pub limit: u64,
    /// Three consecutive window boundaries, epoch µs, increasing.
    pub bounds: [u64; 3],
}

impl CalendarWindow {
    /// The window `[start, end)` (epoch µs) that `now_us` (the backend's
    /// clock) falls in: `[b0, b1)` before `b1`, `[b1, b2)` before `b2`.
    /// Outside `[b0, b2)` (an application clock more than half a window
    /// away from the backend's: a misconfigured host) the window can only
    /// be guessed: windows as long as the nearest one, repeated from `b0`
    /// backward or from `b2` forward.
    pub fn window(&self, now_us: u64) -> (u64, u64) {
        let [b0, b1, b2] = self.bounds;
        if now_us < b0 {
            let len = (b1 - b0).max(1);
            let start = b0.saturating_sub((b0 - now_us).div_ceil(len) * len);
            (start, start + len)
        } else if now_us < b1 {
            (b0, b1)
        } else if now_us < b2 {
            (b1, b2)
        } else {
            let len = (b2 - b1).max(1);
            let start = b2 + (now_us - b2) / len * len;
            (start, start + len)
        }
    }
}

impl CalendarWindow {
    /// A key's time-to-live past its window's end, µs (one minute): only
    /// garbage collection; the stored window start, not the expiry, says
    /// which window a count belongs to.
    pub const TTL_MARGIN_US: u64 = 60_000_000;

    /// The decision for `cost` at `now_us` (the backend's clock).
    pub fn check(
        &self,
        state: Option<super::FixedWindowState>,
        now_us: u64,
        cost: u64,
    ) -> super::TierDecision {
        super::fixed_window::decide_in(self.limit, self.window(now_us), state, now_us, cost)
    }

    /// The state after admitting `cost` at `now_us`, and its time-to-live
    /// (µs): the window's end plus [`TTL_MARGIN_US`](Self::TTL_MARGIN_US).
    pub fn charge(
        &self,
        state: Option<super::FixedWindowState>,
        now_us: u64,
        cost: u64,
    ) -> (super::FixedWindowState, u64) {
        let (s, ttl) = super::fixed_window::charge_in(self.window(now_us), state, now_us, cost);
        (s, ttl + Self::TTL_MARGIN_US)
    }
}

#[cfg(not(feature = "calendar"))]
mod off;
#[cfg(all(test, feature = "calendar"))]
mod tests;
