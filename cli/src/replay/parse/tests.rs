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
