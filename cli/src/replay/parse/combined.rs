//! The combined / common log format (nginx, Apache): a line's fields by
//! position, quoted fields unescaped.

use super::{bad, parse_ip, parse_status, LineParser, Malformed, Record};

impl LineParser {
    pub(super) fn parse_combined(
        &mut self,
        line: &[u8],
        rec: &mut Record,
    ) -> Result<(), Malformed> {
        let mut c = Cursor { b: line, i: 0 };
        let host = c.token().ok_or(bad("missing client address"))?;
        rec.ip = Some(parse_ip(host).ok_or(bad("client address is not an IP address"))?);
        c.token().ok_or(bad("missing ident field"))?;
        let user = c.token().ok_or(bad("missing user field"))?;
        if self.remote_user && user != b"-" && !user.is_empty() {
            rec.user.put(user);
        }
        let ts = c.bracketed().ok_or(bad("missing [timestamp]"))?;
        rec.time_us = Some(
            self.time_cache
                .parse(ts, self.time_format)
                .ok_or(bad("unreadable [timestamp]"))?,
        );
        let request = c.quoted().ok_or(bad("missing \"request\""))?;
        unescape_into(request, &mut rec.request.bytes);
        rec.request.set = true;
        let status = c.token().ok_or(bad("missing status"))?;
        rec.status = parse_status(status);
        c.token().ok_or(bad("missing body bytes"))?;
        // Optional: referer, user agent, then the configured extras.
        if c.at_end() {
            return Ok(());
        }
        c.field().ok_or(bad("unreadable referer"))?;
        if c.at_end() {
            return Ok(());
        }
        c.field().ok_or(bad("unreadable user agent"))?;
        let mut scratch = Vec::new();
        for k in 0..self.extras.len() {
            if c.at_end() {
                break;
            }
            let f = c.field().ok_or(bad("unreadable extra field"))?;
            let slot = self.extras[k];
            if f.contains(&b'\\') {
                unescape_into(f, &mut scratch);
                self.put(slot, &scratch, rec);
            } else {
                self.put(slot, f, rec);
            }
        }
        Ok(())
    }
}

/// Undoes the escapes nginx (`\xHH`) and Apache (`\"`, `\\`, `\xHH`) write
/// in quoted fields.
fn unescape_into(b: &[u8], out: &mut Vec<u8>) {
    out.clear();
    if !b.contains(&b'\\') {
        out.extend_from_slice(b);
        return;
    }
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'\\' && i + 1 < b.len() {
            match b[i + 1] {
                b'x' if i + 3 < b.len() && hex(b[i + 2]).is_some() && hex(b[i + 3]).is_some() => {
                    out.push(hex(b[i + 2]).unwrap_or(0) << 4 | hex(b[i + 3]).unwrap_or(0));
                    i += 4;
                    continue;
                }
                b'"' | b'\\' => {
                    out.push(b[i + 1]);
                    i += 2;
                    continue;
                }
                _ => {}
            }
        }
        out.push(c);
        i += 1;
    }
}

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn skip_spaces(&mut self) {
        while self.i < self.b.len() && self.b[self.i] == b' ' {
            self.i += 1;
        }
    }
    fn at_end(&mut self) -> bool {
        self.skip_spaces();
        self.i >= self.b.len()
    }
    /// Up to the next space.
    fn token(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        let start = self.i;
        while self.i < self.b.len() && self.b[self.i] != b' ' {
            self.i += 1;
        }
        (self.i > start).then(|| &self.b[start..self.i])
    }
    /// `[...]`.
    fn bracketed(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        if self.b.get(self.i) != Some(&b'[') {
            return None;
        }
        let start = self.i + 1;
        let end = start + memchr::memchr(b']', &self.b[start..])?;
        self.i = end + 1;
        Some(&self.b[start..end])
    }
    /// `"..."` with backslash escapes; the raw (escaped) content.
    fn quoted(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        if self.b.get(self.i) != Some(&b'"') {
            return None;
        }
        let start = self.i + 1;
        let mut j = start;
        // The next quote not escaped by an odd number of backslashes.
        while let Some(p) = memchr::memchr(b'"', &self.b[j..]) {
            let q = j + p;
            let backslashes = self.b[start..q]
                .iter()
                .rev()
                .take_while(|&&c| c == b'\\')
                .count();
            if backslashes % 2 == 0 {
                self.i = q + 1;
                return Some(&self.b[start..q]);
            }
            j = q + 1;
        }
        None
    }
    /// A quoted field or a bare token.
    fn field(&mut self) -> Option<&'a [u8]> {
        self.skip_spaces();
        if self.b.get(self.i) == Some(&b'"') {
            self.quoted()
        } else {
            self.token()
        }
    }
}
