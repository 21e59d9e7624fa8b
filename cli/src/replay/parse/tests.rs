use super::*;

fn parser(extras: &[Target]) -> LineParser {
    LineParser::new(&FieldMap::default(), extras, TimeFormat::Auto, true)
}

#[test]
fn combined_line() {
    let mut p = parser(&[Target::Header(http::HeaderName::from_static("x-api-key"))]);
    let mut r = Record::default();
    let line = br#"203.0.113.9 - alice [10/Oct/2000:13:55:36 -0700] "GET /users/7?x=1 HTTP/1.1" 200 2326 "http://ex.com/" "curl/8 \"q\"" "sk_live_1""#;
    p.parse(LogFormat::Combined, line, &mut r).unwrap();
    assert_eq!(r.ip, Some("203.0.113.9".parse().unwrap()));
    assert_eq!(r.method.get(), Some(&b"GET"[..]));
    assert_eq!(r.target.get(), Some(&b"/users/7?x=1"[..]));
    assert_eq!(r.user.get(), Some(&b"alice"[..]));
    assert_eq!(r.status, Some(200));
    assert_eq!(r.headers[0].get(), Some(&b"sk_live_1"[..]));
    assert_eq!(r.time_us, Some(971_211_336_000_000));
    // common format: no referer / agent
    let line = br#"::1 - - [10/Oct/2000:13:55:36 +0000] "POST /login HTTP/1.0" 401 -"#;
    p.parse(LogFormat::Combined, line, &mut r).unwrap();
    assert_eq!(r.user.get(), None);
    assert_eq!(r.headers[0].get(), None);
    assert!(p.parse(LogFormat::Combined, b"garbage", &mut r).is_err());
    assert!(p
        .parse(
            LogFormat::Combined,
            br#"host.example - - [10/Oct/2000:13:55:36 +0000] "GET / HTTP/1.0" 200 1"#,
            &mut r
        )
        .is_err());
}

#[test]
fn request_line_escapes() {
    let mut p = parser(&[]);
    let mut r = Record::default();
    let line = br#"1.2.3.4 - - [10/Oct/2000:13:55:36 +0000] "GET /a\x22b HTTP/1.1" 200 1 "-" "-""#;
    p.parse(LogFormat::Combined, line, &mut r).unwrap();
    assert_eq!(r.target.get(), Some(&b"/a\"b"[..]));
    let line = br#"1.2.3.4 - - [10/Oct/2000:13:55:36 +0000] "-" 400 0 "-" "-""#;
    assert!(p.parse(LogFormat::Combined, line, &mut r).is_err());
}

#[test]
fn json_line_flat_and_nested() {
    let mut f = FieldMap::default();
    f.set(Target::Ip, "client.ip")
        .set(
            Target::Header(http::HeaderName::from_static("x-api-key")),
            "headers.x-api-key",
        )
        .set(Target::Plan, "plan");
    let mut p = LineParser::new(&f, &[], TimeFormat::Auto, false);
    let mut r = Record::default();
    let line = br#"{"time":"2000-10-10T13:55:36Z","client":{"ip":"198.51.100.1","port":5},"request":"GET /x HTTP/1.1","status":"429","headers":{"x-api-key":"k1"},"plan":"pro","other":[1,{"a":2}]}"#;
    p.parse(LogFormat::Json, line, &mut r).unwrap();
    assert_eq!(r.ip, Some("198.51.100.1".parse().unwrap()));
    assert_eq!(r.method.get(), Some(&b"GET"[..]));
    assert_eq!(r.target.get(), Some(&b"/x"[..]));
    assert_eq!(r.status, Some(429));
    assert_eq!(r.headers[0].get(), Some(&b"k1"[..]));
    assert_eq!(r.plan.get(), Some(&b"pro"[..]));
    assert_eq!(r.time_us, Some(971_186_136_000_000));
    // flat dotted key, epoch number
    let line = br#"{"time":971186136.5,"client.ip":"198.51.100.2","method":"POST","path":"/y"}"#;
    p.parse(LogFormat::Json, line, &mut r).unwrap();
    assert_eq!(r.ip, Some("198.51.100.2".parse().unwrap()));
    assert_eq!(r.time_us, Some(971_186_136_500_000));
    // Keys are compared as bytes: an unknown key that is not UTF-8 is
    // skipped like any other; a value that is read must be UTF-8.
    let mut line =
        br#"{"time":971186136,"client.ip":"198.51.100.3","method":"GET","path":"/z","#.to_vec();
    line.extend_from_slice(b"\"k\xff\":1}");
    p.parse(LogFormat::Json, &line, &mut r).unwrap();
    assert_eq!(r.target.get(), Some(&b"/z"[..]));
    let mut line =
        br#"{"time":971186136,"client.ip":"198.51.100.3","method":"GET","path":"/"#.to_vec();
    line.extend_from_slice(b"\xff\"}");
    assert!(p.parse(LogFormat::Json, &line, &mut r).is_err());
    assert!(p.parse(LogFormat::Json, b"{\"time\":1", &mut r).is_err());
    assert!(p.parse(LogFormat::Json, b"[1,2]", &mut r).is_err());
}

/// std's reading of a client address (what `parse_ip` did before its
/// dotted-quad fast path).
fn parse_ip_std(b: &[u8]) -> Option<IpAddr> {
    let s = std::str::from_utf8(b).ok()?;
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(inner) = s.strip_prefix('[').and_then(|x| x.strip_suffix(']')) {
        return inner.parse().ok();
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip())
}

/// The dotted-quad fast path reads exactly what std reads: every address
/// form, and malformed text near the dotted quad (leading zeros, octets
/// over 255, too few or many parts, signs, spaces, non-ASCII digits).
#[test]
fn parse_ip_agrees_with_std() {
    let fixed: &[&[u8]] = &[
        b"0.0.0.0",
        b"255.255.255.255",
        b"10.0.0.123",
        b"1.2.3.4",
        b"01.2.3.4",
        b"1.2.3.04",
        b"1.2.3.0",
        b"0.0.0.00",
        b"256.1.1.1",
        b"1.1.1.256",
        b"999.1.1.1",
        b"1.2.3",
        b"1.2.3.4.",
        b".1.2.3.4",
        b"1.2.3.4.5",
        b"1..2.3",
        b"1.2.3.4 ",
        b" 1.2.3.4",
        b"+1.2.3.4",
        b"1.2.3.-4",
        b"1.2.3.4:80",
        b"1.2.3.4:",
        b"1.2.3.4:99999",
        b"[1.2.3.4]",
        b"::1",
        b"::",
        b"[::1]",
        b"[::1]:80",
        b"2001:db8::1",
        b"::ffff:1.2.3.4",
        b"2001:db8::1%eth0",
        b"fe80::1:2:3:4:5:6",
        b"1.2.3.\xd9\xa4",
        "1.2.3.\u{664}".as_bytes(),
        b"1.2.3.4\xff",
        b"",
        b"-",
        b"host.example",
        b"0000.1.2.3",
        b"1.2.3.1234",
    ];
    for b in fixed {
        assert_eq!(
            parse_ip(b),
            parse_ip_std(b),
            "{:?}",
            String::from_utf8_lossy(b)
        );
    }
    // Random text over the characters addresses are made of.
    let alphabet = b"0123456789012345678901234567890123456789....::[]af %+-";
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    };
    let mut accepted = 0;
    for _ in 0..200_000 {
        let len = 1 + (next() % 18) as usize;
        let b: Vec<u8> = (0..len)
            .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
            .collect();
        let got = parse_ip(&b);
        assert_eq!(got, parse_ip_std(&b), "{:?}", String::from_utf8_lossy(&b));
        accepted += usize::from(got.is_some());
    }
    // Random dotted quads, valid and not: mostly four parts of 1 to 3
    // digits, some of 4 digits, some with 3 or 5 parts.
    for _ in 0..200_000 {
        let parts = [4, 4, 4, 3, 5][(next() % 5) as usize];
        let text: Vec<String> = (0..parts)
            .map(|_| {
                let digits = if next() % 8 == 0 {
                    4
                } else {
                    1 + (next() % 3) as usize
                };
                (0..digits)
                    .map(|_| char::from(b'0' + (next() % 10) as u8))
                    .collect()
            })
            .collect();
        let b = text.join(".").into_bytes();
        let got = parse_ip(&b);
        assert_eq!(got, parse_ip_std(&b), "{:?}", String::from_utf8_lossy(&b));
        accepted += usize::from(got.is_some());
    }
    assert!(accepted > 10_000, "{accepted} addresses read");
}

/// A status reads as `u16`'s `FromStr` reads it: every number of up to
/// six digits (leading zeros included) and text that is not a plain number.
#[test]
fn parse_status_agrees_with_std() {
    let std_status = |b: &[u8]| -> Option<u16> { std::str::from_utf8(b).ok()?.parse().ok() };
    for n in 0..1_000_000u32 {
        for width in [0, 3, 4, 5] {
            let b = format!("{n:0width$}").into_bytes();
            assert_eq!(parse_status(&b), std_status(&b), "{n:0width$}");
        }
    }
    let odd: &[&[u8]] = &[
        b"",
        b"-",
        b"+200",
        b"-200",
        b" 200",
        b"200 ",
        b"2 0",
        b"20x",
        b"0x20",
        b"65535",
        b"65536",
        b"\xd9\xa0",
        b"2\xff",
    ];
    for b in odd {
        assert_eq!(
            parse_status(b),
            std_status(b),
            "{:?}",
            String::from_utf8_lossy(b)
        );
    }
}
