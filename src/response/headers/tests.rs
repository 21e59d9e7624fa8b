//! Unit tests of the header values and policy items.

use super::*;

fn headers(style: HeaderStyle, retry_after: Option<u64>, window_in: u64) -> HeaderMap {
    let h = RateLimitHeaders {
        limit: 3,
        remaining: 1,
        reset: 1_700_000_040,
        retry_after,
        reset_in: 40,
        window_in,
        policy: Arc::from("ip"),
        policies: vec![PolicyItem {
            name: Arc::from("ip"),
            quota: 3,
            window: Some(60),
            unit: QuotaUnit::Requests,
        }],
        style,
        meters: None,
    };
    let mut m = HeaderMap::new();
    h.write(&mut m);
    m
}

fn get<'m>(m: &'m HeaderMap, name: &str) -> Option<&'m str> {
    m.get(name).and_then(|v| v.to_str().ok())
}

#[test]
fn draft11_sends_the_effective_window_as_t() {
    let m = headers(HeaderStyle::IetfDraft11, None, 20);
    assert_eq!(get(&m, "ratelimit-policy"), Some(r#""ip";q=3;w=60"#));
    assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=20"#));
    assert_eq!(m.len(), 2);
}

#[test]
fn draft09_sends_the_time_until_reset_as_t() {
    let m = headers(HeaderStyle::IetfDraft09, None, 20);
    assert_eq!(get(&m, "ratelimit-policy"), Some(r#""ip";q=3;w=60"#));
    assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=40"#));
    assert_eq!(m.len(), 2);
}

#[test]
fn both_is_legacy_and_draft11() {
    let m = headers(HeaderStyle::Both, None, 20);
    assert_eq!(get(&m, "x-ratelimit-reset"), Some("1700000040"));
    assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=20"#));
    assert_eq!(m.len(), 5);
}

/// A number computed at run time above the Structured Fields range (a
/// quota raised at run time, an override) is sent as its largest
/// integer, 15 digits; the legacy headers, no Structured Fields, as is.
#[test]
fn structured_field_integers_are_capped() {
    let h = RateLimitHeaders {
        limit: u64::MAX,
        remaining: u64::MAX - 1,
        reset: 1_700_000_040,
        retry_after: None,
        reset_in: u64::MAX / 1_000_000,
        window_in: u64::MAX / 1_000_000,
        policy: Arc::from("big"),
        policies: vec![
            PolicyItem {
                name: Arc::from("big"),
                quota: u64::MAX,
                window: Some(SF_INTEGER_MAX + 1),
                unit: QuotaUnit::Requests,
            },
            PolicyItem {
                name: Arc::from("bytes"),
                quota: 10,
                window: Some(1),
                unit: QuotaUnit::ContentBytes,
            },
        ],
        style: HeaderStyle::Both,
        meters: None,
    };
    let mut m = HeaderMap::new();
    h.write(&mut m);
    assert_eq!(
        get(&m, "ratelimit-policy"),
        Some(r#""big";q=999999999999999;w=999999999999999, "bytes";q=10;qu="content-bytes";w=1"#)
    );
    assert_eq!(
        get(&m, "ratelimit"),
        Some(r#""big";r=999999999999999;t=18446744073709"#)
    );
    assert_eq!(get(&m, "x-ratelimit-limit"), Some("18446744073709551615"));
}

/// Draft-11 §6: `Retry-After` not earlier than the end of the window.
#[test]
fn retry_after_is_never_earlier_than_draft11_t() {
    let m = headers(HeaderStyle::IetfDraft11, Some(3), 5);
    assert_eq!(get(&m, "retry-after"), Some("5"));
    assert_eq!(get(&m, "ratelimit"), Some(r#""ip";r=1;t=5"#));
    let m = headers(HeaderStyle::IetfDraft11, Some(7), 5);
    assert_eq!(get(&m, "retry-after"), Some("7"));
    // Without the draft-11 fields there is no `t` to respect.
    let m = headers(HeaderStyle::Legacy, Some(3), 5);
    assert_eq!(get(&m, "retry-after"), Some("3"));
}

#[test]
fn effective_window_of_a_refilling_bucket_is_the_next_request() {
    // 3 per 60 s: one request every 20 s. 0.25 of 3 left: full in 55 s,
    // the next whole request in 15 s.
    assert_eq!(
        effective_window_us(3, 0, 55_000_000, Some((3, 60_000_000))),
        15_000_000
    );
    // Burst 10 refilled at 5 per 10 s (2 s each), 7 left, full in 6 s:
    // the next one in 2 s.
    assert_eq!(
        effective_window_us(10, 7, 6_000_000, Some((5, 10_000_000))),
        2_000_000
    );
    // Full, or a window algorithm: the time until full.
    assert_eq!(effective_window_us(3, 3, 0, Some((3, 60_000_000))), 0);
    assert_eq!(effective_window_us(3, 1, 40_000_000, None), 40_000_000);
}

#[test]
fn int_values_are_the_numbers_digits_shared_or_not() {
    let numbers = [
        0,
        7,
        9,
        10,
        42,
        99,
        100,
        999,
        1_000,
        4_321,
        9_999,
        10_000,
        1_700_000_060,
        u64::MAX,
    ];
    for field in [
        Field::Limit,
        Field::Remaining,
        Field::Reset,
        Field::RetryAfter,
    ] {
        for n in numbers {
            // Twice: written, then shared from the thread's last value.
            for _ in 0..2 {
                assert_eq!(int_value(field, n).to_str().unwrap(), n.to_string());
            }
        }
    }
    // Every number of the borrowed table.
    for n in 0..=SMALL_MAX {
        assert_eq!(
            int_value(Field::Remaining, n).to_str().unwrap(),
            n.to_string()
        );
    }
    // Many new numbers in a row: the digit buffer fills and is
    // replaced, and every value keeps its own digits.
    let values: Vec<(u64, HeaderValue)> = (0..1_000u64)
        .map(|i| {
            let n = 1_000_000_000 - i * 7;
            (n, int_value(Field::Remaining, n))
        })
        .collect();
    for (n, v) in &values {
        assert_eq!(v.to_str().unwrap(), n.to_string());
    }
    // A field's last value does not leak into another field.
    assert_eq!(int_value(Field::Limit, 50_000).to_str().unwrap(), "50000");
    assert_eq!(int_value(Field::Reset, 60_000).to_str().unwrap(), "60000");
    assert_eq!(int_value(Field::Limit, 50_000).to_str().unwrap(), "50000");
}
