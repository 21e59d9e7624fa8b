//! Timestamps in access logs, to Unix epoch microseconds, without a date
//! library: CLF (`10/Oct/2000:13:55:36 -0700`), RFC 3339 / ISO 8601
//! (`2000-10-10T13:55:36.123Z`) and epoch numbers (seconds, milliseconds or
//! microseconds, told apart by magnitude).

use std::fmt::Write as _;

/// How a log's timestamps are written (`--time-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum TimeFormat {
    /// Decide per value: a number (or a numeric string) is an epoch (see
    /// [`TimeFormat::Epoch`]), a value with `/` is CLF, anything else RFC 3339.
    #[default]
    Auto,
    /// `10/Oct/2000:13:55:36 -0700` (nginx `$time_local`, Apache `%t`),
    /// optionally with a fraction of a second after the seconds.
    Clf,
    /// `2000-10-10T13:55:36.123+02:00` (nginx `$time_iso8601`); `Z` or an
    /// offset, a space instead of `T`; no offset means UTC.
    Rfc3339,
    /// A Unix epoch number: below 10^11 seconds (fractions allowed, nginx
    /// `$msec`), below 10^14 milliseconds, otherwise microseconds.
    Epoch,
}

impl std::str::FromStr for TimeFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(TimeFormat::Auto),
            "clf" => Ok(TimeFormat::Clf),
            "rfc3339" | "iso8601" => Ok(TimeFormat::Rfc3339),
            "epoch" => Ok(TimeFormat::Epoch),
            other => Err(format!(
                "unknown time format {other:?} (auto, clf, rfc3339, epoch)"
            )),
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's
/// `days_from_civil`).
pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `(year, month, day)` of a day count since 1970-01-01.
pub(crate) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// `2024-03-01T12:34:56Z` (seconds) for epoch microseconds.
pub(crate) fn format_utc_seconds(us: u64) -> String {
    let mut s = format_utc_minute_prefix(us);
    let secs = (us / 1_000_000) % 60;
    let _ = write!(s, ":{secs:02}Z");
    s
}

/// `2024-03-01T12:34Z` (the minute) for epoch microseconds.
pub(crate) fn format_utc_minute(us: u64) -> String {
    let mut s = format_utc_minute_prefix(us);
    s.push('Z');
    s
}

fn format_utc_minute_prefix(us: u64) -> String {
    let secs = i64::try_from(us / 1_000_000).unwrap_or(i64::MAX);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}",
        sod / 3600,
        (sod % 3600) / 60
    )
}

/// `03-01 12:34` for chart axis labels.
pub(crate) fn format_axis_label(us: u64, with_date: bool) -> String {
    let secs = i64::try_from(us / 1_000_000).unwrap_or(i64::MAX);
    let (_, m, d) = civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    if with_date {
        format!("{m:02}-{d:02} {:02}:{:02}", sod / 3600, (sod % 3600) / 60)
    } else {
        format!("{:02}:{:02}", sod / 3600, (sod % 3600) / 60)
    }
}

fn digits(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 19 {
        return None;
    }
    let mut n = 0u64;
    for &c in b {
        if !c.is_ascii_digit() {
            return None;
        }
        n = n * 10 + u64::from(c - b'0');
    }
    Some(n)
}

/// Microseconds of a fraction's digits (`123` → 123 000), beyond 6 digits
/// truncated.
fn fraction_us(b: &[u8]) -> Option<u64> {
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut us = 0u64;
    for i in 0..6 {
        us = us * 10 + b.get(i).map_or(0, |c| u64::from(c - b'0'));
    }
    Some(us)
}

fn month(b: &[u8]) -> Option<u32> {
    const M: [&[u8; 3]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    M.iter()
        .position(|m| m.eq_ignore_ascii_case(b))
        .and_then(|i| u32::try_from(i + 1).ok())
}

/// Epoch µs from civil fields and an offset in seconds east of UTC.
#[allow(clippy::too_many_arguments)]
fn to_epoch_us(
    y: i64,
    mo: u32,
    d: u32,
    h: u64,
    mi: u64,
    s: u64,
    frac_us: u64,
    offset_s: i64,
) -> Option<u64> {
    if !(1..=12).contains(&mo) || d < 1 || d > days_in_month(y, mo) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(y, mo, d);
    let secs = days * 86_400 + i64::try_from(h * 3600 + mi * 60 + s).ok()? - offset_s;
    let secs = u64::try_from(secs).ok()?;
    secs.checked_mul(1_000_000)?.checked_add(frac_us)
}

/// Days in month `mo` (1–12) of year `y` (proleptic Gregorian): 31 Feb is
/// not 2 March.
fn days_in_month(y: i64, mo: u32) -> u32 {
    match mo {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// `±HHMM` or `±HH:MM` (or `Z`) → seconds east of UTC.
fn offset(b: &[u8]) -> Option<i64> {
    if b == b"Z" || b == b"z" {
        return Some(0);
    }
    let (sign, rest) = match b.first()? {
        b'+' => (1, &b[1..]),
        b'-' => (-1, &b[1..]),
        _ => return None,
    };
    let (hh, mm) = match rest.len() {
        4 => (&rest[..2], &rest[2..]),
        5 if rest[2] == b':' => (&rest[..2], &rest[3..]),
        2 => (rest, &b"00"[..]),
        _ => return None,
    };
    let h = i64::try_from(digits(hh)?).ok()?;
    let m = i64::try_from(digits(mm)?).ok()?;
    if h > 23 || m > 59 {
        return None;
    }
    Some(sign * (h * 3600 + m * 60))
}

/// `10/Oct/2000:13:55:36 -0700` (the brackets already removed); seconds may
/// carry a fraction (`13:55:36.123`).
pub(crate) fn parse_clf(b: &[u8]) -> Option<u64> {
    // dd/Mon/yyyy:hh:mm:ss[.frac] zone
    if b.len() < 20 || b[2] != b'/' || b[6] != b'/' || b[11] != b':' {
        return None;
    }
    let d = u32::try_from(digits(&b[0..2])?).ok()?;
    let mo = month(&b[3..6])?;
    let y = i64::try_from(digits(&b[7..11])?).ok()?;
    if b[14] != b':' || b[17] != b':' {
        return None;
    }
    let h = digits(&b[12..14])?;
    let mi = digits(&b[15..17])?;
    let s = digits(&b[18..20])?;
    let rest = &b[20..];
    let (frac, rest) = match rest.first() {
        Some(b'.') | Some(b',') => {
            let end = rest[1..]
                .iter()
                .position(|c| !c.is_ascii_digit())
                .map_or(rest.len(), |p| p + 1);
            (fraction_us(&rest[1..end])?, &rest[end..])
        }
        _ => (0, rest),
    };
    let zone = rest.strip_prefix(b" ").unwrap_or(rest);
    let off = if zone.is_empty() { 0 } else { offset(zone)? };
    to_epoch_us(y, mo, d, h, mi, s, frac, off)
}

/// `2000-10-10T13:55:36[.frac][Z|±hh:mm|±hhmm]`; a space may stand for `T`.
pub(crate) fn parse_rfc3339(b: &[u8]) -> Option<u64> {
    if b.len() < 19 || b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let y = i64::try_from(digits(&b[0..4])?).ok()?;
    let mo = u32::try_from(digits(&b[5..7])?).ok()?;
    let d = u32::try_from(digits(&b[8..10])?).ok()?;
    let h = digits(&b[11..13])?;
    let mi = digits(&b[14..16])?;
    let s = digits(&b[17..19])?;
    let rest = &b[19..];
    let (frac, rest) = match rest.first() {
        Some(b'.') | Some(b',') => {
            let end = rest[1..]
                .iter()
                .position(|c| !c.is_ascii_digit())
                .map_or(rest.len(), |p| p + 1);
            (fraction_us(&rest[1..end])?, &rest[end..])
        }
        _ => (0, rest),
    };
    let rest = rest.strip_prefix(b" ").unwrap_or(rest);
    let off = if rest.is_empty() { 0 } else { offset(rest)? };
    to_epoch_us(y, mo, d, h, mi, s, frac, off)
}

/// An epoch in text (`1700000000`, `1700000000.123`, `1700000000123`).
pub(crate) fn parse_epoch_text(b: &[u8]) -> Option<u64> {
    let (int, frac) = match b.iter().position(|&c| c == b'.') {
        Some(p) => (&b[..p], Some(&b[p + 1..])),
        None => (b, None),
    };
    let n = digits(int)?;
    let frac = match frac {
        Some([]) => 0,
        Some(f) => fraction_us(f)?,
        None => 0,
    };
    epoch_int_us(n, frac)
}

/// Scales an integer epoch by magnitude; `frac_us` is a fraction of the unit
/// in microseconds-of-a-second, only meaningful for seconds.
fn epoch_int_us(n: u64, frac_us: u64) -> Option<u64> {
    if n < 100_000_000_000 {
        n.checked_mul(1_000_000)?.checked_add(frac_us)
    } else if n < 100_000_000_000_000 {
        n.checked_mul(1_000)?.checked_add(frac_us / 1_000_000)
    } else {
        Some(n)
    }
}

/// An epoch given as a JSON float.
pub(crate) fn epoch_f64_us(x: f64) -> Option<u64> {
    if !x.is_finite() || x < 0.0 {
        return None;
    }
    let us = if x < 1e11 {
        x * 1e6
    } else if x < 1e14 {
        x * 1e3
    } else {
        x
    };
    // Exact for every realistic epoch: µs values stay far below 2^63.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Some(us.round() as u64)
}

/// An epoch given as a JSON integer.
pub(crate) fn epoch_u64_us(n: u64) -> Option<u64> {
    epoch_int_us(n, 0)
}

/// A textual timestamp in `format`.
pub(crate) fn parse_text(b: &[u8], format: TimeFormat) -> Option<u64> {
    let b = b.strip_prefix(b"[").unwrap_or(b);
    let b = b.strip_suffix(b"]").unwrap_or(b);
    match format {
        TimeFormat::Clf => parse_clf(b),
        TimeFormat::Rfc3339 => parse_rfc3339(b),
        TimeFormat::Epoch => parse_epoch_text(b),
        TimeFormat::Auto => {
            if b.first().is_some_and(u8::is_ascii_digit)
                && b.iter().all(|c| c.is_ascii_digit() || *c == b'.')
            {
                parse_epoch_text(b)
            } else if b.len() > 2 && b[2] == b'/' {
                parse_clf(b)
            } else {
                parse_rfc3339(b)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 971_186_136_000_000; // 2000-10-10T13:55:36Z

    #[test]
    fn clf() {
        assert_eq!(parse_clf(b"10/Oct/2000:13:55:36 +0000"), Some(T));
        assert_eq!(
            parse_clf(b"10/Oct/2000:13:55:36 -0700"),
            Some(T + 7 * 3600 * 1_000_000)
        );
        assert_eq!(
            parse_clf(b"10/Oct/2000:13:55:36.250 +0000"),
            Some(T + 250_000)
        );
        assert_eq!(parse_clf(b"10/Foo/2000:13:55:36 +0000"), None);
        assert_eq!(parse_clf(b"10/Oct/2000:13:55:36 +00"), Some(T));
        // Days that do not exist are not rolled over into the next month.
        assert_eq!(parse_clf(b"31/Feb/2024:00:00:00 +0000"), None);
        assert_eq!(parse_clf(b"30/Feb/2024:00:00:00 +0000"), None);
        assert_eq!(parse_clf(b"31/Apr/2024:00:00:00 +0000"), None);
        assert!(parse_clf(b"29/Feb/2024:00:00:00 +0000").is_some());
        assert_eq!(parse_clf(b"29/Feb/2023:00:00:00 +0000"), None);
        assert_eq!(parse_clf(b"29/Feb/1900:00:00:00 +0000"), None);
        assert!(parse_clf(b"29/Feb/2000:00:00:00 +0000").is_some());
    }

    #[test]
    fn rfc3339() {
        assert_eq!(parse_rfc3339(b"2000-10-10T13:55:36Z"), Some(T));
        assert_eq!(parse_rfc3339(b"2000-10-10T13:55:36+00:00"), Some(T));
        assert_eq!(
            parse_rfc3339(b"2000-10-10 15:55:36.5+02:00"),
            Some(T + 500_000)
        );
        assert_eq!(parse_rfc3339(b"2000-10-10T13:55:36"), Some(T));
        assert_eq!(parse_rfc3339(b"2000-13-10T13:55:36Z"), None);
        assert_eq!(parse_rfc3339(b"2024-02-31T00:00:00Z"), None);
    }

    #[test]
    fn epochs_by_magnitude() {
        assert_eq!(parse_epoch_text(b"971186136"), Some(T));
        assert_eq!(parse_epoch_text(b"971186136.123"), Some(T + 123_000));
        assert_eq!(parse_epoch_text(b"971186136123"), Some(T + 123_000));
        assert_eq!(parse_epoch_text(b"971186136123456"), Some(T + 123_456));
        assert_eq!(epoch_f64_us(971_186_136.25), Some(T + 250_000));
        assert_eq!(
            parse_text(b"[10/Oct/2000:13:55:36 +0000]", TimeFormat::Auto),
            Some(T)
        );
        assert_eq!(
            parse_text(b"2000-10-10T13:55:36Z", TimeFormat::Auto),
            Some(T)
        );
    }

    #[test]
    fn civil_round_trip() {
        for days in [-1000i64, 0, 59, 60, 365, 11_016, 19_783, 50_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(format_utc_minute(T), "2000-10-10T13:55Z");
        assert_eq!(format_utc_seconds(T), "2000-10-10T13:55:36Z");
    }
}
